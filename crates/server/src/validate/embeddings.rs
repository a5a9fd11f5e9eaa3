//! `POST /v1/embeddings` bodies.

use mlxcel_engine_api::Prompt;
use serde_json::Value;

use super::completion::parse_prompts;
use super::{check_model, from_value, reject_unknown, ValidationError};
use crate::openai::embeddings::EmbeddingsBody;

/// Most inputs one request may embed (OpenAI's limit).
pub const MAX_INPUTS: usize = 2048;

/// An embeddings request that passed every rule the HTTP layer owns (the
/// engine checks token ids against the vocabulary and lengths against the
/// context; the handler checks `dimensions` against the model).
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedEmbeddingsRequest {
    /// One prompt per input, in order: text or token ids, none empty.
    pub inputs: Vec<Prompt>,
    /// `encoding_format: "base64"`.
    pub base64: bool,
    /// Keep this many leading numbers of each vector (then renormalise).
    pub dimensions: Option<usize>,
}

impl ValidatedEmbeddingsRequest {
    /// Checks a parsed body against the served `model_id`.
    ///
    /// # Errors
    /// The first rule broken: a wrong type or unknown key, another model
    /// (404), an empty input list or an empty input (`input[i]`), more than
    /// [`MAX_INPUTS`] inputs, a token id that is no u32, an
    /// `encoding_format` other than `float` and `base64`, `dimensions`
    /// below 1.
    pub fn parse(body: Value, model_id: &str) -> Result<Self, ValidationError> {
        let body: EmbeddingsBody = from_value(body)?;
        check_model(body.model, model_id)?;
        reject_unknown(body.unknown, &[], "")?;
        let inputs = parse_prompts(body.input, "input")?;
        if inputs.len() > MAX_INPUTS {
            return Err(ValidationError::TooMany {
                param: "input",
                count: inputs.len(),
                max: MAX_INPUTS,
            });
        }
        let several = inputs.len() > 1;
        for (i, input) in inputs.iter().enumerate() {
            if matches!(input, Prompt::Text(t) if t.is_empty()) {
                return Err(ValidationError::EmptyPrompt {
                    param: if several {
                        format!("input[{i}]")
                    } else {
                        "input".into()
                    },
                });
            }
        }
        let base64 = match body.encoding_format.as_deref() {
            None | Some("float") => false,
            Some("base64") => true,
            Some(other) => {
                return Err(ValidationError::ValueOutOfRange {
                    param: "encoding_format".into(),
                    value: format!("'{other}'"),
                    range: "'float' or 'base64'".into(),
                })
            }
        };
        let dimensions = match body.dimensions {
            None => None,
            Some(d) if d >= 1 => Some(usize::try_from(d).unwrap_or(usize::MAX)),
            Some(d) => {
                return Err(ValidationError::ValueOutOfRange {
                    param: "dimensions".into(),
                    value: d.to_string(),
                    range: "at least 1".into(),
                })
            }
        };
        Ok(Self {
            inputs,
            base64,
            dimensions,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(body: Value) -> Result<ValidatedEmbeddingsRequest, ValidationError> {
        ValidatedEmbeddingsRequest::parse(body, "m")
    }

    fn param(body: Value) -> Option<String> {
        parse(body).err().and_then(|e| e.param())
    }

    #[test]
    fn every_input_shape_becomes_prompts() {
        let r = parse(json!({"input": "hi", "model": "m", "user": "u"})).ok();
        assert_eq!(r.map(|r| r.inputs), Some(vec![Prompt::Text("hi".into())]));
        let r = parse(json!({"input": ["a", "b"], "encoding_format": "base64", "dimensions": 4}));
        let r = r.ok();
        assert_eq!(r.as_ref().map(|r| r.inputs.len()), Some(2));
        assert_eq!(
            r.as_ref().map(|r| (r.base64, r.dimensions)),
            Some((true, Some(4)))
        );
        let r = parse(json!({"input": [[1, 2], [3]]})).ok();
        assert_eq!(
            r.map(|r| r.inputs),
            Some(vec![Prompt::Tokens(vec![1, 2]), Prompt::Tokens(vec![3])])
        );
        let r = parse(json!({"input": [5, 6]})).ok();
        assert_eq!(r.map(|r| r.inputs), Some(vec![Prompt::Tokens(vec![5, 6])]));
    }

    #[test]
    fn each_broken_rule_names_its_field() {
        assert_eq!(param(json!({})).as_deref(), Some("input"));
        assert_eq!(param(json!({"input": ""})).as_deref(), Some("input"));
        assert_eq!(param(json!({"input": []})).as_deref(), Some("input"));
        assert_eq!(
            param(json!({"input": ["a", ""]})).as_deref(),
            Some("input[1]")
        );
        assert_eq!(
            param(json!({"input": [[1], []]})).as_deref(),
            Some("input[1]")
        );
        assert_eq!(param(json!({"input": [-1]})).as_deref(), Some("input[0]"));
        assert_eq!(param(json!({"input": 3})).as_deref(), Some("input"));
        let many = vec!["x"; MAX_INPUTS + 1];
        assert_eq!(param(json!({"input": many})).as_deref(), Some("input"));
        assert_eq!(
            param(json!({"input": "a", "encoding_format": "int8"})).as_deref(),
            Some("encoding_format")
        );
        assert_eq!(
            param(json!({"input": "a", "dimensions": 0})).as_deref(),
            Some("dimensions")
        );
        assert_eq!(
            param(json!({"input": "a", "pooling": "x"})).as_deref(),
            Some("pooling")
        );
        assert!(matches!(
            parse(json!({"input": "a", "model": "other"})),
            Err(ValidationError::ModelNotFound(_))
        ));
    }
}
