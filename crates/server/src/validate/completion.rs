//! `POST /v1/completions` bodies.

use mlxcel_engine_api::{GenerationRequest, Prompt};
use serde_json::Value;

use super::params::{max_tokens, SharedParams};
use super::{
    boolean, integer, object_for_model, reject_leftovers, require, string, take, wrong_type,
    StreamOptions, ValidationError,
};

/// `max_tokens` when the request sets none (OpenAI's default).
pub const DEFAULT_MAX_TOKENS: usize = 16;
/// Most alternatives per token a completions request may ask for.
const MAX_LOGPROBS: i128 = 5;

/// Fields of the OpenAI completions API that mlxcel does not implement yet,
/// accepted only with a default value.
const UNSUPPORTED_FIELDS: &[&str] = &["suffix"];

/// A text completion request that passed every rule.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedCompletionRequest {
    /// One request per prompt, in the order of `prompt`; each has the same
    /// `n`, so choice `i` of prompt `p` is choice `p * n + i` of the answer.
    pub generations: Vec<GenerationRequest>,
    /// `Some` for `"stream": true`.
    pub stream: Option<StreamOptions>,
    /// `echo`: each choice's text starts with its prompt.
    pub echo: bool,
    /// The client's opaque end-user id, for the logs.
    pub user: Option<String>,
}

impl ValidatedCompletionRequest {
    /// Checks a parsed body. `model_id` is the served model.
    pub fn parse(body: Value, model_id: &str) -> Result<Self, ValidationError> {
        let mut body = object_for_model(body, model_id)?;
        let prompts = parse_prompt(require(&mut body, "prompt", "prompt")?)?;
        let max_tokens = match take(&mut body, "max_tokens") {
            Some(value) => max_tokens("max_tokens", value)?,
            None => DEFAULT_MAX_TOKENS,
        };
        let shared = SharedParams::parse(&mut body)?;
        let logprobs = match take(&mut body, "logprobs") {
            Some(value) => {
                let k = integer("logprobs", value)?;
                if !(0..=MAX_LOGPROBS).contains(&k) {
                    return Err(ValidationError::LogprobsOutOfRange(k));
                }
                Some(k as usize)
            }
            None => None,
        };
        let echo = match take(&mut body, "echo") {
            Some(value) => boolean("echo", value)?,
            None => false,
        };
        if let Some(best_of) = take(&mut body, "best_of") {
            let best_of = integer("best_of", best_of)?;
            if best_of != shared.n as i128 {
                return Err(ValidationError::BestOfNotN {
                    best_of,
                    n: shared.n,
                });
            }
        }
        shared.check_min_tokens(max_tokens)?;
        reject_leftovers(body, UNSUPPORTED_FIELDS, "")?;
        let generations = prompts
            .into_iter()
            .map(|prompt| GenerationRequest {
                logprobs,
                // `echo` returns the prompt: with `logprobs`, its logprobs too.
                prompt_logprobs: logprobs.filter(|_| echo),
                ..shared.request(prompt, max_tokens)
            })
            .collect();
        Ok(Self {
            generations,
            stream: shared.stream,
            echo,
            user: shared.user,
        })
    }
}

/// `prompt`: a string, a list of strings, a list of token ids, or a list of
/// token-id lists. Lists must not be empty.
fn parse_prompt(value: Value) -> Result<Vec<Prompt>, ValidationError> {
    let items = match value {
        Value::String(text) => return Ok(vec![Prompt::Text(text)]),
        Value::Array(items) => items,
        _ => return Err(wrong_type("prompt", PROMPT_TYPES)),
    };
    let Some(first) = items.first() else {
        return Err(empty("prompt"));
    };
    match first {
        Value::String(_) => items
            .into_iter()
            .enumerate()
            .map(|(i, item)| string(&format!("prompt[{i}]"), item).map(Prompt::Text))
            .collect(),
        Value::Number(_) => Ok(vec![Prompt::Tokens(token_ids("prompt", items)?)]),
        Value::Array(_) => items
            .into_iter()
            .enumerate()
            .map(|(i, item)| {
                let param = format!("prompt[{i}]");
                match item {
                    Value::Array(ids) if ids.is_empty() => Err(empty(&param)),
                    Value::Array(ids) => Ok(Prompt::Tokens(token_ids(&param, ids)?)),
                    _ => Err(wrong_type(&param, "an array of token ids")),
                }
            })
            .collect(),
        _ => Err(wrong_type("prompt[0]", PROMPT_TYPES)),
    }
}

const PROMPT_TYPES: &str =
    "a string, an array of strings, an array of token ids or an array of arrays of token ids";

fn empty(param: &str) -> ValidationError {
    ValidationError::EmptyPrompt {
        param: param.to_owned(),
    }
}

/// Every item of the list at `param` as a u32 token id.
fn token_ids(param: &str, items: Vec<Value>) -> Result<Vec<u32>, ValidationError> {
    items
        .into_iter()
        .enumerate()
        .map(|(j, item)| {
            let param = format!("{param}[{j}]");
            let value = integer(&param, item)?;
            u32::try_from(value).map_err(|_| ValidationError::TokenIdOutOfRange { param, value })
        })
        .collect()
}
