//! `POST /tokenize` and `POST /detokenize` bodies.

use mlxcel_engine_api::{Prompt, TokenizeRequest};
use serde_json::{Map, Value};

use super::chat::{check_template_kwargs, parse_messages};
use super::tools::parse_tools;
use super::{check_model, from_value, reject_unknown, ValidationError};
use crate::openai::tokenize::{DetokenizeBody, TokenizeBody};

/// A `/tokenize` request that passed every rule.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedTokenizeRequest {
    /// What the engine encodes.
    pub request: TokenizeRequest,
}

impl ValidatedTokenizeRequest {
    /// Checks a parsed body against the served `model_id`.
    pub fn parse(body: Value, model_id: &str) -> Result<Self, ValidationError> {
        let body: TokenizeBody = from_value(body)?;
        check_model(body.model, model_id)?;
        reject_unknown(body.unknown, &[], "")?;
        for (param, value) in [
            ("continue_final_message", body.continue_final_message),
            ("return_token_strs", body.return_token_strs),
        ] {
            if value == Some(true) {
                return Err(ValidationError::UnsupportedParameter {
                    param: param.into(),
                });
            }
        }
        let request = match (body.prompt, body.messages) {
            (Some(text), None) => {
                let chat_only = [
                    (
                        "add_generation_prompt",
                        body.add_generation_prompt.is_some(),
                    ),
                    ("tools", body.tools.is_some()),
                    ("chat_template_kwargs", body.chat_template_kwargs.is_some()),
                ];
                if let Some((param, _)) = chat_only.iter().find(|(_, given)| *given) {
                    return Err(ValidationError::OnlyWith {
                        param: (*param).into(),
                        with: "messages",
                    });
                }
                TokenizeRequest {
                    prompt: Prompt::Text(text),
                    add_generation_prompt: false,
                    add_special_tokens: body.add_special_tokens.unwrap_or(true),
                    tools: Vec::new(),
                    chat_template_kwargs: Map::new(),
                }
            }
            (None, Some(messages)) => {
                // The chat template writes the special tokens it wants.
                if body.add_special_tokens == Some(true) {
                    return Err(ValidationError::UnsupportedParameter {
                        param: "add_special_tokens".into(),
                    });
                }
                TokenizeRequest {
                    prompt: Prompt::Chat(parse_messages(messages)?),
                    add_generation_prompt: body.add_generation_prompt.unwrap_or(true),
                    add_special_tokens: false,
                    tools: body.tools.map(parse_tools).transpose()?.unwrap_or_default(),
                    chat_template_kwargs: body
                        .chat_template_kwargs
                        .map(check_template_kwargs)
                        .transpose()?
                        .unwrap_or_default(),
                }
            }
            _ => return Err(ValidationError::PromptOrMessages),
        };
        Ok(Self { request })
    }
}

/// A `/detokenize` request that passed every rule.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedDetokenizeRequest {
    /// The ids to decode (the engine checks them against its vocabulary).
    pub tokens: Vec<u32>,
}

impl ValidatedDetokenizeRequest {
    /// Checks a parsed body against the served `model_id`.
    pub fn parse(body: Value, model_id: &str) -> Result<Self, ValidationError> {
        let body: DetokenizeBody = from_value(body)?;
        check_model(body.model, model_id)?;
        reject_unknown(body.unknown, &[], "")?;
        let tokens = body
            .tokens
            .into_iter()
            .enumerate()
            .map(|(i, id)| {
                u32::try_from(id).map_err(|_| ValidationError::TokenIdOutOfRange {
                    param: format!("tokens[{i}]"),
                    value: id,
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { tokens })
    }
}
