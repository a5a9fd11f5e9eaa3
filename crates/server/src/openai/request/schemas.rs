//! Schemas written as JSON, for what the derives cannot express: the
//! `schema_with` of the request fields whose rules are unions, key patterns
//! or exclusions.

use serde_json::Value;
use utoipa::openapi::{RefOr, Schema};

/// A schema written as JSON, for the few constraints the derives cannot
/// express (`propertyNames`, `not`, a constraint on one branch of a union).
/// Keywords utoipa's schema types lack (`not`) are carried as extensions,
/// which are written out as they are.
pub(crate) fn json_schema(value: Value) -> Schema {
    // The literals of this crate are valid schemas; a test writes every one
    // back and compares.
    let mut schema: Schema = serde_json::from_value(value.clone()).unwrap_or_default();
    if let (Schema::Object(object), Value::Object(keywords)) = (&mut schema, &value) {
        if !keywords.contains_key("type") {
            object.schema_type = utoipa::openapi::schema::SchemaType::AnyValue;
        }
        let kept = serde_json::to_value(&*object).unwrap_or_default();
        let lacking: utoipa::openapi::extensions::Extensions = keywords
            .iter()
            .filter(|(key, _)| kept.get(key.as_str()).is_none())
            .map(|(key, value)| (key.clone(), value.clone()))
            .collect();
        if !lacking.is_empty() {
            object.extensions = Some(lacking);
        }
    }
    schema
}

/// A schema built from a JSON literal, for `schema_with`.
fn with_json(value: Value) -> RefOr<Schema> {
    RefOr::T(json_schema(value))
}

pub(super) fn stop_schema() -> RefOr<Schema> {
    with_json(stop_json())
}

fn stop_json() -> Value {
    serde_json::json!({
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 0, "maxItems": 4, "items": {"type": "string", "minLength": 1}},
        ],
        "description": "Up to 4 sequences that end generation; they are not part of the text. [] means none.",
    })
}

pub(super) fn logit_bias_schema() -> RefOr<Schema> {
    with_json(logit_bias_json())
}

fn logit_bias_json() -> Value {
    serde_json::json!({
        "type": "object",
        "propertyNames": {"pattern": "^[0-9]+$"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        "description": "Token id (as a string) to a bias added to its logit. Ids must be below the vocabulary size (400 otherwise).",
    })
}

pub(super) fn metadata_schema() -> RefOr<Schema> {
    with_json(metadata_json())
}

fn metadata_json() -> Value {
    serde_json::json!({
        "type": "object",
        "maxProperties": 16,
        "propertyNames": {"maxLength": 64},
        "additionalProperties": {"type": "string", "maxLength": 512},
        "description": "Accepted and not stored.",
    })
}

pub(super) fn chat_template_kwargs_schema() -> RefOr<Schema> {
    with_json(chat_template_kwargs_json())
}

fn chat_template_kwargs_json() -> Value {
    let reserved: Vec<Value> = mlxcel_engine_api::RESERVED_TEMPLATE_VARIABLES
        .iter()
        .map(|key| serde_json::json!({"required": [key]}))
        .collect();
    serde_json::json!({
        "type": "object",
        "not": {"anyOf": reserved},
        "description": "Extra chat template variables, e.g. {\"enable_thinking\": false} (vLLM extension); not messages, tools, add_generation_prompt, documents, bos_token or eos_token.",
    })
}

pub(crate) fn prompt_schema() -> RefOr<Schema> {
    with_json(prompt_json())
}

fn prompt_json() -> Value {
    let ids = serde_json::json!({"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}});
    serde_json::json!({
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
            ids,
            {"type": "array", "minItems": 1, "items": ids},
        ],
        "description": "One prompt (text or token ids) or a list of them; each prompt is a group of n choices.",
    })
}

pub(super) fn suffix_schema() -> RefOr<Schema> {
    with_json(suffix_json())
}

fn suffix_json() -> Value {
    serde_json::json!({
        "enum": ["", null],
        "description": "Not supported: only null or empty.",
    })
}

pub(super) fn continuous_usage_stats_schema() -> RefOr<Schema> {
    with_json(continuous_usage_stats_json())
}

fn continuous_usage_stats_json() -> Value {
    serde_json::json!({
        "enum": [false, null],
        "description": "Only false (vLLM extension; usage per chunk is not sent).",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each literal comes out of the document as it was written: no keyword
    /// is lost on the way through utoipa's types.
    #[test]
    fn json_schemas_keep_every_keyword() {
        for literal in [
            stop_json(),
            logit_bias_json(),
            metadata_json(),
            chat_template_kwargs_json(),
            prompt_json(),
            suffix_json(),
            continuous_usage_stats_json(),
        ] {
            let written = serde_json::to_value(json_schema(literal.clone())).unwrap();
            assert_eq!(written, literal);
        }
    }
}
