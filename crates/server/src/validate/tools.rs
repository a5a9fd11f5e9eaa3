//! `tools`, `tool_choice`, `response_format`, and the `tool_calls` of
//! assistant messages.

use mlxcel_engine_api::{ResponseFormat, ToolCall, ToolChoice, ToolDefinition};
use serde_json::{json, Value};

use super::{reject_unknown, ValidationError};
use crate::openai::message::{
    self, FunctionType, ResponseFormatType, ToolCallRequest, ToolChoiceMode,
};
use crate::openai::request::Tag;

/// `tools`: each `{"type": "function", "function": {...}}`.
pub(super) fn parse_tools(
    tools: Vec<message::Tool>,
) -> Result<Vec<ToolDefinition>, ValidationError> {
    tools
        .into_iter()
        .enumerate()
        .map(|(i, tool)| {
            let at = format!("tools[{i}]");
            check_function_type(&tool.kind, &at)?;
            reject_unknown(tool.unknown, &[], &format!("{at}."))?;
            let function = tool.function;
            let at = format!("{at}.function.");
            let name = check_name(function.name, &at)?;
            // `strict` asks for arguments that follow the schema exactly;
            // calls are parsed from the model's output either way.
            reject_unknown(function.unknown, &[], &at)?;
            Ok(ToolDefinition {
                name,
                description: function.description,
                parameters: function.parameters.map_or_else(
                    || json!({"type": "object", "properties": {}}),
                    Value::Object,
                ),
            })
        })
        .collect()
}

/// `type` is `function`.
pub(super) fn check_function_type(
    kind: &Tag<FunctionType>,
    at: &str,
) -> Result<(), ValidationError> {
    match kind {
        Tag::Known(FunctionType::Function) => Ok(()),
        Tag::Other(kind) => Err(ValidationError::UnsupportedToolType {
            param: format!("{at}.type"),
            kind: kind.clone(),
        }),
    }
}

/// `name`, matching `^[a-zA-Z0-9_-]{1,64}$`.
pub(super) fn check_name(name: String, at: &str) -> Result<String, ValidationError> {
    let valid = (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !valid {
        return Err(ValidationError::InvalidToolName {
            param: format!("{at}name"),
            name,
        });
    }
    Ok(name)
}

/// `tool_choice`: `none`, `auto`, `required`, or
/// `{"type": "function", "function": {"name": ...}}` naming one of `tools`.
pub(super) fn parse_tool_choice(
    choice: message::ToolChoice,
    tools: &[ToolDefinition],
) -> Result<ToolChoice, ValidationError> {
    let choice = match choice {
        message::ToolChoice::Mode(Tag::Known(mode)) => match mode {
            ToolChoiceMode::None => ToolChoice::None,
            ToolChoiceMode::Auto => ToolChoice::Auto,
            ToolChoiceMode::Required => ToolChoice::Required,
        },
        message::ToolChoice::Mode(Tag::Other(choice)) => {
            return Err(ValidationError::UnsupportedToolChoice(choice))
        }
        message::ToolChoice::Function(named) => {
            check_function_type(&named.kind, "tool_choice")?;
            let function = named
                .function
                .ok_or_else(|| ValidationError::Missing("tool_choice.function".into()))?;
            reject_unknown(named.unknown, &[], "tool_choice.")?;
            reject_unknown(function.unknown, &[], "tool_choice.function.")?;
            ToolChoice::Function(function.name)
        }
    };
    match &choice {
        ToolChoice::Required | ToolChoice::Function(_) if tools.is_empty() => {
            Err(ValidationError::ToolChoiceWithoutTools)
        }
        ToolChoice::Function(name) if !tools.iter().any(|t| &t.name == name) => {
            Err(ValidationError::UnknownToolChoice(name.clone()))
        }
        _ => Ok(choice),
    }
}

/// `response_format`; `{"type": "text"}` is `None`.
pub(super) fn parse_response_format(
    format: message::ResponseFormat,
) -> Result<Option<ResponseFormat>, ValidationError> {
    let kind = match format.kind {
        Tag::Known(kind) => kind,
        Tag::Other(kind) => return Err(ValidationError::UnsupportedResponseFormat(kind)),
    };
    let parsed = match (kind, format.json_schema) {
        (ResponseFormatType::JsonSchema, None) => {
            return Err(ValidationError::Missing(
                "response_format.json_schema".into(),
            ))
        }
        (ResponseFormatType::JsonSchema, Some(spec)) => {
            const AT: &str = "response_format.json_schema.";
            // The grammar is enforced whether or not `strict` is set.
            reject_unknown(spec.unknown, &[], AT)?;
            // No schema: any JSON value.
            let schema = spec.schema.unwrap_or_default();
            Some(ResponseFormat::JsonSchema(Value::Object(schema)))
        }
        (_, Some(_)) => {
            return Err(ValidationError::UnrecognizedParameter {
                param: "response_format.json_schema".into(),
            })
        }
        (ResponseFormatType::Text, None) => None,
        (ResponseFormatType::JsonObject, None) => Some(ResponseFormat::JsonObject),
    };
    reject_unknown(format.unknown, &[], "response_format.")?;
    Ok(parsed)
}

/// The `tool_calls` of an assistant message at `at` (`messages[i]`).
pub(super) fn parse_message_tool_calls(
    at: &str,
    calls: Vec<ToolCallRequest>,
) -> Result<Vec<ToolCall>, ValidationError> {
    calls
        .into_iter()
        .enumerate()
        .map(|(j, call)| {
            let at = format!("{at}.tool_calls[{j}]");
            check_function_type(&call.kind, &at)?;
            reject_unknown(call.unknown, &[], &format!("{at}."))?;
            reject_unknown(call.function.unknown, &[], &format!("{at}.function."))?;
            Ok(ToolCall {
                id: call.id,
                name: call.function.name,
                arguments: call.function.arguments,
            })
        })
        .collect()
}
