//! `tools`, `tool_choice`, `response_format`, and the `tool_calls` of
//! assistant messages.

use mlxcel_engine_api::{ResponseFormat, ToolCall, ToolChoice, ToolDefinition};
use serde_json::{json, Map, Value};

use super::{
    boolean, object, reject_leftovers, require, string, take, wrong_type, ValidationError,
};

/// `tools`: an array of `{"type": "function", "function": {...}}`.
pub(super) fn parse_tools(value: Value) -> Result<Vec<ToolDefinition>, ValidationError> {
    let Value::Array(items) = value else {
        return Err(wrong_type("tools", "an array of tools"));
    };
    items
        .into_iter()
        .enumerate()
        .map(|(i, item)| parse_tool(&format!("tools[{i}]"), item))
        .collect()
}

fn parse_tool(at: &str, value: Value) -> Result<ToolDefinition, ValidationError> {
    let mut tool = object(at, value)?;
    let mut function = function_object(&mut tool, at)?;
    let at = format!("{at}.function.");
    let name = parse_name(&mut function, &at)?;
    let description = take(&mut function, "description")
        .map(|d| string(&format!("{at}description"), d))
        .transpose()?;
    let parameters = match take(&mut function, "parameters") {
        Some(Value::Object(schema)) => Value::Object(schema),
        Some(_) => return Err(wrong_type(&format!("{at}parameters"), "an object")),
        None => json!({"type": "object", "properties": {}}),
    };
    // `strict` asks for arguments that follow the schema exactly; calls are
    // parsed from the model's output either way, so it only needs a type.
    if let Some(strict) = take(&mut function, "strict") {
        boolean(&format!("{at}strict"), strict)?;
    }
    reject_leftovers(function, &[], &at)?;
    Ok(ToolDefinition {
        name,
        description,
        parameters,
    })
}

/// Checks `type: "function"` on `object` and takes its `function` object;
/// nothing else may be left in `object`.
fn function_object(
    object_: &mut Map<String, Value>,
    at: &str,
) -> Result<Map<String, Value>, ValidationError> {
    let type_param = format!("{at}.type");
    let kind = string(&type_param, require(object_, "type", &type_param)?)?;
    if kind != "function" {
        return Err(ValidationError::UnsupportedToolType {
            param: type_param,
            kind,
        });
    }
    let function_param = format!("{at}.function");
    let function = object(
        &function_param,
        require(object_, "function", &function_param)?,
    )?;
    reject_leftovers(std::mem::take(object_), &[], &format!("{at}."))?;
    Ok(function)
}

/// `name`, matching `^[a-zA-Z0-9_-]{1,64}$`.
fn parse_name(function: &mut Map<String, Value>, at: &str) -> Result<String, ValidationError> {
    let param = format!("{at}name");
    let name = string(&param, require(function, "name", &param)?)?;
    let valid = (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !valid {
        return Err(ValidationError::InvalidToolName { param, name });
    }
    Ok(name)
}

/// `tool_choice`: `none`, `auto`, `required`, or
/// `{"type": "function", "function": {"name": ...}}` naming one of `tools`.
pub(super) fn parse_tool_choice(
    value: Value,
    tools: &[ToolDefinition],
) -> Result<ToolChoice, ValidationError> {
    let choice = match value {
        Value::String(choice) => match choice.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            _ => return Err(ValidationError::UnsupportedToolChoice(choice)),
        },
        Value::Object(mut choice) => {
            let mut function = function_object(&mut choice, "tool_choice")?;
            let param = "tool_choice.function.name";
            let name = string(param, require(&mut function, "name", param)?)?;
            reject_leftovers(function, &[], "tool_choice.function.")?;
            ToolChoice::Function(name)
        }
        _ => return Err(wrong_type("tool_choice", "a string or an object")),
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
    value: Value,
) -> Result<Option<ResponseFormat>, ValidationError> {
    let mut format = object("response_format", value)?;
    let param = "response_format.type";
    let kind = string(param, require(&mut format, "type", param)?)?;
    let parsed = match kind.as_str() {
        "text" => None,
        "json_object" => Some(ResponseFormat::JsonObject),
        "json_schema" => {
            let param = "response_format.json_schema";
            let schema = object(param, require(&mut format, "json_schema", param)?)?;
            Some(ResponseFormat::JsonSchema(parse_json_schema(schema)?))
        }
        _ => return Err(ValidationError::UnsupportedResponseFormat(kind)),
    };
    reject_leftovers(format, &[], "response_format.")?;
    Ok(parsed)
}

/// `{name, schema?, strict?, description?}`: the schema (`{}` when absent,
/// which any JSON value satisfies).
fn parse_json_schema(mut spec: Map<String, Value>) -> Result<Value, ValidationError> {
    const AT: &str = "response_format.json_schema.";
    let name_param = format!("{AT}name");
    string(&name_param, require(&mut spec, "name", &name_param)?)?;
    if let Some(description) = take(&mut spec, "description") {
        string(&format!("{AT}description"), description)?;
    }
    // The grammar is enforced whether or not `strict` is set.
    if let Some(strict) = take(&mut spec, "strict") {
        boolean(&format!("{AT}strict"), strict)?;
    }
    let schema = match take(&mut spec, "schema") {
        Some(Value::Object(schema)) => Value::Object(schema),
        Some(_) => return Err(wrong_type(&format!("{AT}schema"), "an object")),
        None => Value::Object(Map::new()),
    };
    reject_leftovers(spec, &[], AT)?;
    Ok(schema)
}

/// The `tool_calls` of an assistant message at `at` (`messages[i]`).
pub(super) fn parse_message_tool_calls(
    at: &str,
    value: Value,
) -> Result<Vec<ToolCall>, ValidationError> {
    let param = format!("{at}.tool_calls");
    let Value::Array(items) = value else {
        return Err(wrong_type(&param, "an array of tool calls"));
    };
    items
        .into_iter()
        .enumerate()
        .map(|(j, item)| {
            let at = format!("{param}[{j}]");
            let mut call = object(&at, item)?;
            let id_param = format!("{at}.id");
            let id = string(&id_param, require(&mut call, "id", &id_param)?)?;
            let mut function = function_object(&mut call, &at)?;
            let fn_at = format!("{at}.function.");
            let name_param = format!("{fn_at}name");
            let name = string(&name_param, require(&mut function, "name", &name_param)?)?;
            let args_param = format!("{fn_at}arguments");
            let arguments = string(
                &args_param,
                require(&mut function, "arguments", &args_param)?,
            )?;
            reject_leftovers(function, &[], &fn_at)?;
            Ok(ToolCall {
                id,
                name,
                arguments,
            })
        })
        .collect()
}
