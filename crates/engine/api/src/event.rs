//! What the engine sends back: the [`GenerationEvent`]s of a request's
//! [`EventStream`], and the finish reason, usage, timings and
//! log-probabilities they carry.

use serde::{Deserialize, Serialize};

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-sequence token was sampled (it is not part of the text),
    /// a stop string appeared, or the output grammar was complete.
    Stop,
    /// `max_tokens` or the context length was reached.
    Length,
    /// The model called tools (sent as [`GenerationEvent::ToolCallStart`]
    /// and [`GenerationEvent::ToolCallArguments`]).
    ToolCalls,
}

/// Token accounting of one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Tokens in the (rendered) prompt.
    pub prompt_tokens: usize,
    /// Tokens generated, including a final EOS token.
    pub completion_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
}

/// Timing of one finished request, in seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Timings {
    /// Time from submission to the first completion token (TTFT).
    pub time_to_first_token_s: f64,
    /// Time spent in prefill forwards.
    pub prefill_s: f64,
    /// Time spent from the first to the last completion token.
    pub decode_s: f64,
}

/// Log-probability of one token (natural log, after logit bias and
/// penalties, before temperature and the top-k/top-p/min-p filters, as
/// OpenAI and vLLM report them).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// Token id.
    pub id: u32,
    /// The token's text; bytes that are not valid UTF-8 on their own are
    /// shown as U+FFFD.
    pub text: String,
    /// The token's exact bytes.
    pub bytes: Vec<u8>,
    /// `ln p(token)`.
    pub logprob: f32,
}

/// The log-probabilities reported for one sampled token.
#[derive(Debug, Clone, PartialEq)]
pub struct SampledLogprobs {
    /// The sampled token.
    pub token: TokenLogprob,
    /// The `k` most likely tokens at this position, most likely first.
    pub top: Vec<TokenLogprob>,
}

/// One event on a request's stream. `index` is the choice (0..n) it
/// belongs to.
#[derive(Debug, Clone, PartialEq)]
pub enum GenerationEvent {
    /// New text, completed by `token`. `text` may be empty when a token ends
    /// inside a multi-byte character, or inside what may become a stop
    /// string or a tool call (it is held back until decided). An EOS token
    /// is sent only when held-back text is left.
    Delta {
        index: usize,
        token: u32,
        text: String,
        /// Reasoning text completed by `token`, which comes before `text`
        /// (reasoning models, chat prompts: the `<think>` block, see the
        /// engine's `reasoning` module); empty otherwise.
        reasoning: String,
        /// Set when the request asked for logprobs.
        logprobs: Option<SampledLogprobs>,
    },
    /// The prompt's log-probabilities (requests with `prompt_logprobs`):
    /// the first token, then one entry per prompt token after it. Sent once, on
    /// choice 0, before its first `Delta`; every choice shares the prompt.
    PromptLogprobs {
        index: usize,
        /// The first prompt token (id, text, bytes); it has no context, so
        /// its `logprob` is 0 and means nothing (OpenAI shows `null`).
        first: TokenLogprob,
        logprobs: Vec<SampledLogprobs>,
    },
    /// A tool call of choice `index` begins: its id (`call_...`) and the
    /// function it calls. Its arguments follow as
    /// [`GenerationEvent::ToolCallArguments`]; none of the call's text is
    /// sent as a `Delta`. A token's `Delta` comes before the tool-call
    /// events it completed.
    ToolCallStart {
        index: usize,
        id: String,
        name: String,
    },
    /// More of the arguments of choice `index`'s latest tool call: JSON
    /// text as generated. The call's arguments are the concatenation of
    /// its fragments (valid JSON once the call is complete; a call cut by
    /// `max_tokens` keeps what was generated).
    ToolCallArguments { index: usize, arguments: String },
    /// Choice `index` ended normally; every piece of its text was sent
    /// before this event. The request ends when every choice has.
    Finished {
        index: usize,
        reason: FinishReason,
        usage: Usage,
        timings: Timings,
        /// The stop string (of the request's `stop`) that ended the
        /// choice; `None` when it ended otherwise (EOS, length, grammar,
        /// tool calls).
        stop_sequence: Option<String>,
    },
    /// An embedding request's answer ([`crate::EmbeddingRequest`]); the
    /// request ends. `vector` is float32 `[hidden_size]`, pooled as the
    /// model's [`crate::EmbeddingModel`] says and L2-normalised; `usage`
    /// counts the prompt (no completion tokens).
    Embedding { vector: Vec<f32>, usage: Usage },
    /// The request failed inside the engine (every choice ends); nothing
    /// else was affected, unless `kind` says the engine can serve no more
    /// ([`FailureKind::GroupBroken`]).
    Failed { kind: FailureKind, message: String },
}

/// What kind of failure ended a request (`GenerationEvent::Failed`): the
/// HTTP layer answers each kind with its own status and error code, and
/// `/metrics` counts failures by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    /// The model could not build the request's step, or MLX failed while
    /// running it.
    Model,
    /// MLX could not allocate the memory the step needs: the request may
    /// succeed later, or shorter.
    OutOfMemory,
    /// The KV cache refused an operation (its pool exhausted despite
    /// admission, or broken bookkeeping).
    KvCache,
    /// The output grammar or the tokenizer failed on a sampled token.
    Output,
    /// A bug inside the engine: a panic caught at the step boundary, or
    /// broken bookkeeping of its own.
    Internal,
    /// The tensor-parallel group broke (a rank failed or stopped
    /// answering): the engine serves no more requests.
    GroupBroken,
    /// The server shut down before the request ended.
    Shutdown,
}

impl FailureKind {
    /// Every kind, for metrics that list them all.
    pub const ALL: [FailureKind; 7] = [
        FailureKind::Model,
        FailureKind::OutOfMemory,
        FailureKind::KvCache,
        FailureKind::Output,
        FailureKind::Internal,
        FailureKind::GroupBroken,
        FailureKind::Shutdown,
    ];

    /// The kind's name on the wire and in metrics (`out_of_memory`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            FailureKind::Model => "model",
            FailureKind::OutOfMemory => "out_of_memory",
            FailureKind::KvCache => "kv_cache",
            FailureKind::Output => "output",
            FailureKind::Internal => "internal",
            FailureKind::GroupBroken => "group_broken",
            FailureKind::Shutdown => "shutdown",
        }
    }
}

/// The receiving end of a request's events.
pub type EventStream = tokio::sync::mpsc::UnboundedReceiver<GenerationEvent>;
