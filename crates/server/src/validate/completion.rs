//! `POST /v1/completions` bodies.

use mlxcel_engine_api::{GenerationRequest, Infill, Prompt};
use serde_json::Value;

use super::params::{max_tokens, SharedParams};
use super::{check_model, from_value, reject_unknown, StreamOptions, ValidationError};
use crate::openai::request::{self, CompletionRequest};

/// `max_tokens` when the request sets none (OpenAI's default).
pub const DEFAULT_MAX_TOKENS: usize = 16;
/// Most alternatives per token a completions request may ask for.
const MAX_LOGPROBS: i128 = 5;

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
        let mut request: CompletionRequest = from_value(body)?;
        check_model(request.model.take(), model_id)?;
        Self::check(request)
    }

    /// Applies the rules to a request read from the wire.
    pub fn check(mut request: CompletionRequest) -> Result<Self, ValidationError> {
        let shared = request.take_shared();
        let mut prompts = parse_prompt(request.prompt)?;
        let echo = request.echo.unwrap_or(false);
        // A `suffix` makes each text prompt the code before the cursor of a
        // fill-in-the-middle prompt (the model's FIM tokens; a model
        // without them is refused by the engine, naming `suffix`).
        if let Some(suffix) = request.suffix.filter(|s| !s.is_empty()) {
            if echo {
                return Err(ValidationError::NotWith {
                    param: "suffix".into(),
                    with: "echo",
                });
            }
            prompts = prompts
                .into_iter()
                .map(|prompt| match prompt {
                    Prompt::Text(prefix) => Ok(Prompt::Infill(Infill {
                        prefix,
                        suffix: suffix.clone(),
                        ..Infill::default()
                    })),
                    _ => Err(ValidationError::WrongType {
                        param: "prompt".into(),
                        expected: "text (a string or strings) with a suffix",
                    }),
                })
                .collect::<Result<_, _>>()?;
        }
        let max_tokens = match request.max_tokens {
            Some(value) => max_tokens("max_tokens", value)?,
            None => DEFAULT_MAX_TOKENS,
        };
        let shared = SharedParams::parse(shared)?;
        let logprobs = match request.logprobs {
            Some(k) if !(0..=MAX_LOGPROBS).contains(&k) => {
                return Err(ValidationError::LogprobsOutOfRange(k))
            }
            Some(k) => Some(k as usize),
            None => None,
        };
        if let Some(best_of) = request.best_of {
            if best_of != shared.n as i128 {
                return Err(ValidationError::BestOfNotN {
                    best_of,
                    n: shared.n,
                });
            }
        }
        shared.check_min_tokens(max_tokens)?;
        reject_unknown(request.unknown, &[], "")?;
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

/// `prompt`: lists must not be empty, token ids must be u32s.
fn parse_prompt(prompt: request::Prompt) -> Result<Vec<Prompt>, ValidationError> {
    parse_prompts(prompt, "prompt")
}

/// A completions-style prompt field named `field` (`prompt`, or
/// embeddings' `input`): lists must not be empty, token ids must be u32s.
pub(super) fn parse_prompts(
    prompt: request::Prompt,
    field: &str,
) -> Result<Vec<Prompt>, ValidationError> {
    match prompt {
        request::Prompt::Text(text) => Ok(vec![Prompt::Text(text)]),
        request::Prompt::Texts(texts) if texts.is_empty() => Err(empty(field)),
        request::Prompt::Texts(texts) => Ok(texts.into_iter().map(Prompt::Text).collect()),
        request::Prompt::Tokens(ids) => Ok(vec![Prompt::Tokens(token_ids(field, ids)?)]),
        request::Prompt::TokenLists(lists) => lists
            .into_iter()
            .enumerate()
            .map(|(i, ids)| {
                let param = format!("{field}[{i}]");
                if ids.is_empty() {
                    return Err(empty(&param));
                }
                Ok(Prompt::Tokens(token_ids(&param, ids)?))
            })
            .collect(),
    }
}

fn empty(param: &str) -> ValidationError {
    ValidationError::EmptyPrompt {
        param: param.to_owned(),
    }
}

/// Every id of the list at `param` as a u32 token id.
fn token_ids(param: &str, ids: Vec<i128>) -> Result<Vec<u32>, ValidationError> {
    ids.into_iter()
        .enumerate()
        .map(|(j, value)| {
            u32::try_from(value).map_err(|_| ValidationError::TokenIdOutOfRange {
                param: format!("{param}[{j}]"),
                value,
            })
        })
        .collect()
}
