//! `POST /infill` bodies (llama-server's fill-in-the-middle route, as
//! editor plugins such as llama.vscode send them).
//!
//! Read: `input_prefix`, `input_suffix`, `input_extra` (`[{"filename",
//! "text"}]`), `prompt` (text after the middle token), `n_predict` (or
//! `max_tokens`; -1 or absent: the server's default; 0: only read the
//! prompt, which editor plugins send to warm the cache), `temperature`,
//! `top_k`, `top_p`, `min_p`, `seed`, `stop`, `presence_penalty`,
//! `frequency_penalty`, `repeat_penalty`, `stream`, `cache_prompt`,
//! `model`. llama-server's other sampler and timing options are accepted
//! and ignored, as llama-server ignores what it does not know: clients
//! send many of them.

use mlxcel_engine_api::{GenerationRequest, Infill, InfillFile, Prompt};
use serde_json::{Map, Value};

use super::params::{max_tokens, SharedParams};
use super::{check_model, from_value, ValidationError};
use crate::openai::request::CompletionRequest;

/// The sampling fields read, and the OpenAI names they are checked under.
const SAMPLING: &[(&str, &str)] = &[
    ("temperature", "temperature"),
    ("top_k", "top_k"),
    ("top_p", "top_p"),
    ("min_p", "min_p"),
    ("seed", "seed"),
    ("stop", "stop"),
    ("presence_penalty", "presence_penalty"),
    ("frequency_penalty", "frequency_penalty"),
    ("repeat_penalty", "repetition_penalty"),
    ("cache_prompt", "cache_prompt"),
];

/// An infill request that passed every rule.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedInfillRequest {
    /// The engine's request (an [`Prompt::Infill`] prompt).
    pub generation: GenerationRequest,
    /// `"stream": true`.
    pub stream: bool,
    /// `n_predict: 0`: read the prompt (into the prefix cache) and return
    /// no text.
    pub prefill_only: bool,
}

impl ValidatedInfillRequest {
    /// Checks a parsed body; `model_id` is the served model,
    /// `default_max_tokens` the budget of a request that sets none.
    ///
    /// # Errors
    /// A body that is not an object, a field of the wrong type, a sampling
    /// value out of range (named as `/v1/completions` names it), an
    /// `n_predict` of 0 or below -1, another model's name.
    pub fn parse(
        body: Value,
        model_id: &str,
        default_max_tokens: usize,
    ) -> Result<Self, ValidationError> {
        let Value::Object(mut body) = body else {
            return Err(ValidationError::BodyNotObject);
        };
        let model = match body.remove("model") {
            None | Some(Value::Null) => None,
            Some(Value::String(m)) => Some(m),
            Some(_) => return Err(wrong("model", "a string")),
        };
        check_model(model, model_id)?;
        let text = |body: &mut Map<String, Value>, key: &str| match body.remove(key) {
            None | Some(Value::Null) => Ok(String::new()),
            Some(Value::String(s)) => Ok(s),
            Some(_) => Err(wrong(key, "a string")),
        };
        let prefix = text(&mut body, "input_prefix")?;
        let suffix = text(&mut body, "input_suffix")?;
        let middle = text(&mut body, "prompt")?;
        let extra = match body.remove("input_extra") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(files)) => files
                .into_iter()
                .enumerate()
                .map(|(i, file)| {
                    let Value::Object(mut file) = file else {
                        return Err(wrong(&format!("input_extra[{i}]"), "an object"));
                    };
                    Ok(InfillFile {
                        filename: text(&mut file, "filename").map_err(|_| {
                            wrong(&format!("input_extra[{i}].filename"), "a string")
                        })?,
                        text: text(&mut file, "text")
                            .map_err(|_| wrong(&format!("input_extra[{i}].text"), "a string"))?,
                    })
                })
                .collect::<Result<_, _>>()?,
            Some(_) => return Err(wrong("input_extra", "an array of {filename, text} objects")),
        };
        let n_predict = body.remove("n_predict").filter(|v| !v.is_null());
        let max = body.remove("max_tokens").filter(|v| !v.is_null());
        let (param, budget) = match (n_predict, max) {
            (Some(v), _) => ("n_predict", Some(v)),
            (None, Some(v)) => ("max_tokens", Some(v)),
            (None, None) => ("n_predict", None),
        };
        let expected = "an integer (-1: the default, 0: only read the prompt into the cache)";
        // 0 (llama.vim and llama.vscode warm the cache with it): the
        // prompt is read and one token computed, none returned.
        let (budget, prefill_only) = match budget.map(|v| v.as_i64()) {
            None | Some(Some(-1)) => (default_max_tokens, false),
            Some(Some(0)) => (1, true),
            Some(Some(v)) => (max_tokens(param, i128::from(v))?, false),
            Some(None) => return Err(wrong(param, expected)),
        };
        let stream = match body.remove("stream") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => b,
            Some(_) => return Err(wrong("stream", "a boolean")),
        };
        // The sampling fields go through /v1/completions' rules.
        let mut shared = Map::new();
        shared.insert("prompt".into(), Value::String(String::new()));
        for (ours, openai) in SAMPLING {
            if let Some(v) = body.remove(*ours).filter(|v| !v.is_null()) {
                shared.insert((*openai).into(), v);
            }
        }
        let mut completion: CompletionRequest = from_value(Value::Object(shared))?;
        let params = SharedParams::parse(completion.take_shared())?;
        let prompt = Prompt::Infill(Infill {
            prefix,
            suffix,
            extra,
            middle,
        });
        Ok(Self {
            generation: params.request(prompt, budget),
            stream,
            prefill_only,
        })
    }
}

fn wrong(param: &str, expected: &'static str) -> ValidationError {
    ValidationError::WrongType {
        param: param.to_owned(),
        expected,
    }
}
