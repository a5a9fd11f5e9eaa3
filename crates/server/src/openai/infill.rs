//! The wire types of llama-server's `POST /infill` (fill-in-the-middle
//! for editor plugins: llama.vscode, llama.vim and others that speak it).

use serde::Serialize;
use utoipa::ToSchema;

/// The body of `POST /infill` (documentation only: the body is read by
/// `crate::validate::ValidatedInfillRequest`). Other llama-server options
/// are accepted and ignored.
#[derive(Debug, Clone, PartialEq, ToSchema)]
#[schema(as = InfillRequest)]
#[allow(dead_code)]
pub struct InfillBody {
    /// Must be the served model's id when given; another name is a 404.
    pub model: Option<String>,
    /// The code before the cursor.
    pub input_prefix: Option<String>,
    /// The code after the cursor.
    pub input_suffix: Option<String>,
    /// Other files of the project, put before the prefix (the
    /// repository-level layout when the model has file-separator tokens).
    pub input_extra: Option<Vec<InfillExtraFile>>,
    /// Text after the middle token that the model continues (what is typed
    /// on the cursor's line, for clients that send it apart).
    pub prompt: Option<String>,
    /// Most tokens to generate; -1 or absent: the server's default; 0:
    /// only read the prompt into the prefix cache (editor plugins warm it
    /// so), no text returned.
    #[schema(minimum = -1)]
    pub n_predict: Option<i64>,
    /// `n_predict` under OpenAI's name (used when `n_predict` is absent).
    #[schema(minimum = -1)]
    pub max_tokens: Option<i64>,
    #[schema(minimum = 0, maximum = 2)]
    pub temperature: Option<f64>,
    #[schema(minimum = 0)]
    pub top_k: Option<i64>,
    #[schema(exclusive_minimum = 0, maximum = 1)]
    pub top_p: Option<f64>,
    #[schema(minimum = 0, maximum = 1)]
    pub min_p: Option<f64>,
    pub seed: Option<i64>,
    /// Stop strings (at most 4).
    pub stop: Option<Vec<String>>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    /// `repetition_penalty` under llama-server's name.
    pub repeat_penalty: Option<f64>,
    /// Stream `data: {"content", "stop": false}` events, then the whole
    /// answer's fields with `"stop": true`.
    pub stream: Option<bool>,
    /// Read the prompt's prefix from the prefix cache (default true).
    pub cache_prompt: Option<bool>,
}

/// One file of `input_extra`.
#[derive(Debug, Clone, PartialEq, ToSchema)]
#[allow(dead_code)]
pub struct InfillExtraFile {
    pub filename: Option<String>,
    pub text: Option<String>,
}

/// The answer of `POST /infill` (llama-server's fields), and the last
/// event of a stream.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct InfillResponse {
    /// The text that goes between prefix and suffix (streamed: this
    /// event's part of it).
    pub content: String,
    /// The served model's id.
    pub model: String,
    /// `true` on the answer and on a stream's last event.
    pub stop: bool,
    /// Why it ended: `eos` (an end token or a stop string) or `limit`
    /// (`n_predict`); absent on a stream's content events.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_type: Option<&'static str>,
    /// Tokens generated (absent on a stream's content events).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_predicted: Option<usize>,
    /// Tokens in the prompt the model read (absent on content events).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_evaluated: Option<usize>,
    /// Prompt tokens whose KV came from the prefix cache (absent on
    /// content events).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_cached: Option<usize>,
}
