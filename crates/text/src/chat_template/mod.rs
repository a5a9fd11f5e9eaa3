//! Hugging Face chat templates (Jinja), rendered with `minijinja`.
//!
//! The environment mirrors the one `transformers` builds in
//! `utils/chat_template_utils.py` (`_compile_jinja_template`):
//! `trim_blocks` and `lstrip_blocks` on, trailing newline of the template
//! dropped, loop controls (`break`/`continue`), and the globals
//! `raise_exception(msg)` and `strftime_now(fmt)`; its `tojson` filter is
//! Python's `json.dumps` (no HTML escaping, `", "`/`": "` separators,
//! optional `indent`). Python string/dict methods (`.strip()`,
//! `.startswith()`, `.split()`, `.items()`, ...) come from
//! `minijinja-contrib`'s `pycompat`. The context holds `messages`,
//! `add_generation_prompt`, `tools` (none), `documents` (none), and
//! `bos_token`/`eos_token` when the tokenizer config defines them (like
//! `transformers`' `special_tokens_map`, they are undefined otherwise).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use minijinja::value::{Kwargs, Value};
use minijinja::{AutoEscape, Environment, Error, ErrorKind};
use serde::Serialize;

use crate::output::{TOOL_CALL_CLOSE, TOOL_CALL_OPEN};
use crate::tokenizer::{bos_eos_strings, read_json_opt, TextError};
use mlxcel_engine_api::{ChatMessage, ToolCall, ToolDefinition};

/// Name of the one template in the environment.
const TEMPLATE_NAME: &str = "chat_template";

/// A compiled chat template plus the BOS/EOS strings it is rendered with.
/// Compiled once; `Send + Sync`, so one instance serves every request.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The template reads `tools` / `tool_calls`; when it does not, tools
    /// and calls are written into the messages as text (see
    /// [`ChatTemplate::render_with_tools`]).
    knows_tools: bool,
    knows_tool_calls: bool,
    /// The template writes `<think>` (a reasoning model's template).
    knows_reasoning: bool,
    /// The tool-call format the template teaches the model.
    tool_call_format: crate::output::ToolCallFormat,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Loads the model's chat template: `dir/chat_template.jinja` if it
    /// exists, else `chat_template` in `dir/tokenizer_config.json` (a string,
    /// or a list of `{name, template}` of which `default` is used), else
    /// `chat_template` in `dir/chat_template.json`. BOS/EOS strings come from
    /// `tokenizer_config.json` (or `special_tokens_map.json`).
    ///
    /// Returns `Ok(None)` when the model has no template. Errors: unreadable
    /// or malformed files, a list without a `default` entry, or a template
    /// that does not compile ([`TextError::TemplateSyntax`]).
    pub fn from_model_dir(dir: &Path) -> Result<Option<Self>, TextError> {
        let Some(source) = find_template_source(dir)? else {
            return Ok(None);
        };
        let (bos_token, eos_token) = bos_eos_strings(dir)?;
        Self::new(source, bos_token, eos_token).map(Some)
    }

    /// Loads a template from a Jinja file (`--chat-template`), rendered with
    /// the BOS/EOS strings of the model in `model_dir`.
    ///
    /// Errors: unreadable files, a template that does not compile.
    pub fn from_file(path: &Path, model_dir: &Path) -> Result<Self, TextError> {
        let source = std::fs::read_to_string(path).map_err(|source| TextError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let (bos_token, eos_token) = bos_eos_strings(model_dir)?;
        Self::new(source, bos_token, eos_token)
    }

    /// Whether the template writes `<think>`: a reasoning model's
    /// template (Qwen3, QwQ, DeepSeek-R1), whose replies
    /// `--reasoning-parser auto` splits.
    pub fn knows_reasoning(&self) -> bool {
        self.knows_reasoning
    }

    /// The tool-call format the template teaches the model (how replies
    /// are parsed for calls).
    pub fn tool_call_format(&self) -> crate::output::ToolCallFormat {
        self.tool_call_format
    }

    /// Compiles `source` (Jinja text) with the given special-token strings.
    ///
    /// Errors: [`TextError::TemplateSyntax`] when the source does not parse.
    pub fn new(
        source: impl Into<String>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, TextError> {
        let source = source.into();
        let knows_tools = source.contains("tools");
        let knows_tool_calls = source.contains("tool_calls");
        let knows_reasoning = source.contains("<think>");
        let tool_call_format = crate::output::ToolCallFormat::from_template(&source);
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|e| TextError::TemplateSyntax(e.to_string()))?;
        Ok(Self {
            env,
            knows_tools,
            knows_tool_calls,
            knows_reasoning,
            tool_call_format,
            bos_token,
            eos_token,
        })
    }

    /// Renders `messages` to the prompt text. With `add_generation_prompt`,
    /// the template appends the header of an assistant turn (e.g.
    /// `<|im_start|>assistant\n`).
    ///
    /// Errors (both fit a 400 response): [`TextError::TemplateException`]
    /// with the template's own message when it calls `raise_exception`
    /// (e.g. "Conversation roles must alternate ..."), and
    /// [`TextError::TemplateRender`] for any other failure on these
    /// messages.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TextError> {
        self.render_with_tools(messages, &[], add_generation_prompt)
    }

    /// [`ChatTemplate::render`] with `tools` in the context, in the format
    /// `transformers`' `apply_chat_template(tools=...)` passes them
    /// (`{"type": "function", "function": {name, description, parameters}}`;
    /// `none` when empty). Messages go in Hugging Face's format too: an
    /// assistant's `tool_calls` as `{"id", "type": "function", "function":
    /// {"name", "arguments"}}` with `arguments` parsed into an object when it
    /// is JSON (templates such as Qwen2.5's `tojson` it), `content` `none`
    /// when absent.
    ///
    /// A template that never reads `tools` (SmolLM2's, for one) still gets
    /// them: they are described in a system message, in the Hermes
    /// `<tool_call>` format the engine parses. One that never reads
    /// `tool_calls` gets earlier calls as `<tool_call>` text in the
    /// assistant message, and tool results wrapped in `<tool_response>`.
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[ToolDefinition],
        add_generation_prompt: bool,
    ) -> Result<String, TextError> {
        self.render_with_kwargs(
            messages,
            tools,
            add_generation_prompt,
            &serde_json::Map::new(),
        )
    }

    /// [`ChatTemplate::render_with_tools`] with extra template variables
    /// (`chat_template_kwargs`, e.g. Qwen3's `enable_thinking`). The
    /// variables the renderer sets itself
    /// ([`mlxcel_engine_api::RESERVED_TEMPLATE_VARIABLES`])
    /// win over `kwargs`.
    pub fn render_with_kwargs(
        &self,
        messages: &[ChatMessage],
        tools: &[ToolDefinition],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, TextError> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TextError::TemplateRender(e.to_string()))?;
        let mut ctx: BTreeMap<&str, Value> = kwargs
            .iter()
            .map(|(k, v)| (k.as_str(), Value::from_serialize(v)))
            .collect();
        let messages: Vec<serde_json::Value> = if self.knows_tool_calls {
            messages.iter().map(hf_message).collect()
        } else {
            messages
                .iter()
                .map(|m| hf_message(&calls_as_text(m)))
                .collect()
        };
        let messages = if !tools.is_empty() && !self.knows_tools {
            with_tool_system_prompt(messages, tools)
        } else {
            messages
        };
        ctx.insert("messages", Value::from_serialize(&messages));
        ctx.insert("add_generation_prompt", Value::from(add_generation_prompt));
        if tools.is_empty() {
            ctx.insert("tools", Value::from(()));
        } else {
            let tools: Vec<serde_json::Value> = tools.iter().map(hf_tool).collect();
            ctx.insert("tools", Value::from_serialize(&tools));
        }
        ctx.insert("documents", Value::from(()));
        if let Some(bos) = &self.bos_token {
            ctx.insert("bos_token", Value::from(bos.as_str()));
        }
        if let Some(eos) = &self.eos_token {
            ctx.insert("eos_token", Value::from(eos.as_str()));
        }
        template.render(ctx).map_err(render_error)
    }

    /// The BOS string the template is rendered with.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The EOS string the template is rendered with.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }
}

/// A message as `transformers` hands it to a template.
fn hf_message(m: &ChatMessage) -> serde_json::Value {
    let mut out = serde_json::Map::new();
    out.insert("role".into(), m.role.clone().into());
    out.insert(
        "content".into(),
        m.content
            .clone()
            .map_or(serde_json::Value::Null, Into::into),
    );
    if !m.tool_calls.is_empty() {
        let calls = m
            .tool_calls
            .iter()
            .map(|c| {
                serde_json::json!({
                    "id": c.id,
                    "type": "function",
                    "function": { "name": c.name, "arguments": arguments_value(c) },
                })
            })
            .collect();
        out.insert("tool_calls".into(), serde_json::Value::Array(calls));
    }
    if let Some(id) = &m.tool_call_id {
        out.insert("tool_call_id".into(), id.clone().into());
    }
    if let Some(name) = &m.name {
        out.insert("name".into(), name.clone().into());
    }
    serde_json::Value::Object(out)
}

/// A call's arguments as a JSON value: the object its JSON text holds, or
/// the text itself when it is not JSON.
fn arguments_value(call: &ToolCall) -> serde_json::Value {
    serde_json::from_str(&call.arguments).unwrap_or_else(|_| call.arguments.clone().into())
}

/// A message with its tool calls (and tool results) written as text, for
/// templates that know neither.
fn calls_as_text(m: &ChatMessage) -> ChatMessage {
    let mut text = m.content.clone().unwrap_or_default();
    for c in &m.tool_calls {
        let call = serde_json::json!({ "name": c.name, "arguments": arguments_value(c) });
        if !text.is_empty() {
            text.push('\n');
        }
        text.push_str(&format!("{TOOL_CALL_OPEN}\n{call}\n{TOOL_CALL_CLOSE}"));
    }
    if m.role == "tool" {
        text = format!("<tool_response>\n{text}\n</tool_response>");
    }
    ChatMessage::text(m.role.clone(), text)
}

/// The tools described in a system message (merged into the first one when
/// there is one): what they are, and how to call them.
fn with_tool_system_prompt(
    mut messages: Vec<serde_json::Value>,
    tools: &[ToolDefinition],
) -> Vec<serde_json::Value> {
    let mut prompt = String::from(
        "You can call functions. Their JSON signatures are listed between \
         <tools> and </tools>. To call one, answer with a JSON object holding \
         its \"name\" and its \"arguments\", between <tool_call> and </tool_call>:\n\
         <tool_call>\n{\"name\": \"function_name\", \"arguments\": {\"arg\": \"value\"}}\n</tool_call>\n\
         Function results come back between <tool_response> and </tool_response>.\n<tools>",
    );
    for tool in tools {
        prompt.push('\n');
        prompt.push_str(&hf_tool(tool).to_string());
    }
    prompt.push_str("\n</tools>");
    let first_is_system = messages
        .first()
        .and_then(|m| m.get("role"))
        .and_then(|r| r.as_str())
        == Some("system");
    if first_is_system {
        let existing = messages[0]
            .get("content")
            .and_then(|c| c.as_str())
            .unwrap_or_default()
            .to_owned();
        messages[0]["content"] = format!("{existing}\n\n{prompt}").trim_start().into();
    } else {
        messages.insert(
            0,
            serde_json::json!({ "role": "system", "content": prompt }),
        );
    }
    messages
}

/// A tool as `transformers` hands it to a template.
fn hf_tool(t: &ToolDefinition) -> serde_json::Value {
    let mut function = serde_json::Map::new();
    function.insert("name".into(), t.name.clone().into());
    if let Some(d) = &t.description {
        function.insert("description".into(), d.clone().into());
    }
    function.insert("parameters".into(), t.parameters.clone());
    serde_json::json!({ "type": "function", "function": function })
}

/// Finds the template text in a model directory (see
/// [`ChatTemplate::from_model_dir`] for the order).
fn find_template_source(dir: &Path) -> Result<Option<String>, TextError> {
    let jinja = dir.join("chat_template.jinja");
    match std::fs::read_to_string(&jinja) {
        Ok(text) => return Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(TextError::Io {
                path: jinja,
                source,
            })
        }
    }
    for file in ["tokenizer_config.json", "chat_template.json"] {
        let path = dir.join(file);
        let Some(config) = read_json_opt(&path)? else {
            continue;
        };
        match config.get("chat_template") {
            None | Some(serde_json::Value::Null) => continue,
            Some(serde_json::Value::String(s)) => return Ok(Some(s.clone())),
            Some(serde_json::Value::Array(list)) => {
                let default = list
                    .iter()
                    .find(|entry| entry.get("name").and_then(|n| n.as_str()) == Some("default"));
                return match default.and_then(|e| e.get("template")?.as_str()) {
                    Some(s) => Ok(Some(s.to_owned())),
                    None => Err(TextError::InvalidModelFile {
                        path,
                        message: "chat_template list has no template named \"default\"".into(),
                    }),
                };
            }
            Some(_) => {
                return Err(TextError::InvalidModelFile {
                    path,
                    message: "chat_template is neither a string nor a list".into(),
                })
            }
        }
    }
    Ok(None)
}

/// Marks an error raised by the template's own `raise_exception` call.
#[derive(Debug)]
struct RaisedByTemplate(String);

impl std::fmt::Display for RaisedByTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedByTemplate {}

/// `raise_exception(message)`: fails the render with the template's message.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone())
        .with_source(RaisedByTemplate(message)))
}

/// Turns a render error into a [`TextError`], keeping a template's own
/// `raise_exception` message verbatim.
fn render_error(err: Error) -> TextError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = source {
        if let Some(raised) = e.downcast_ref::<RaisedByTemplate>() {
            return TextError::TemplateException(raised.0.clone());
        }
        source = e.source();
    }
    TextError::TemplateRender(err.to_string())
}

/// `strftime_now(format)`: the local time formatted like Python's
/// `datetime.now().strftime(format)` (chrono's strftime, which shares the
/// common specifiers `%d %b %B %Y %m %H %M %S %A %a ...`).
fn strftime_now(format: &str) -> Result<String, Error> {
    use chrono::format::{Item, StrftimeItems};
    let items: Vec<Item<'_>> = StrftimeItems::new(format).collect();
    if items.iter().any(|item| matches!(item, Item::Error)) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: unsupported format {format:?}"),
        ));
    }
    let mut out = String::new();
    write!(
        out,
        "{}",
        chrono::Local::now().format_with_items(items.iter())
    )
    .map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: cannot format {format:?}"),
        )
    })?;
    Ok(out)
}

/// `tojson` as `transformers` defines it: `json.dumps(x, ensure_ascii=False,
/// indent=None)`. Keyword arguments `indent` (int) and `ensure_ascii`
/// (bool) are honoured; others are an error.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<String, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let mut buf = Vec::new();
    let result = match indent {
        Some(n) => {
            let pad = vec![b' '; n];
            let fmt = serde_json::ser::PrettyFormatter::with_indent(&pad);
            value.serialize(&mut serde_json::Serializer::with_formatter(&mut buf, fmt))
        }
        None => value.serialize(&mut serde_json::Serializer::with_formatter(
            &mut buf,
            PythonCompact,
        )),
    };
    result.map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let json = String::from_utf8(buf)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(if ensure_ascii == Some(true) {
        escape_non_ascii(&json)
    } else {
        json
    })
}

/// Python's `json.dumps` default separators: `", "` and `": "`.
struct PythonCompact;

impl serde_json::ser::Formatter for PythonCompact {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first {
            Ok(())
        } else {
            writer.write_all(b", ")
        }
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

/// `ensure_ascii=True`: every non-ASCII char as `\uXXXX` (UTF-16, lowercase
/// hex, as Python writes it). Non-ASCII can only occur inside JSON strings,
/// so escaping the whole text is exact.
fn escape_non_ascii(json: &str) -> String {
    let mut out = String::with_capacity(json.len());
    for c in json.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut units = [0u16; 2];
            for unit in c.encode_utf16(&mut units) {
                let _ = write!(out, "\\u{unit:04x}");
            }
        }
    }
    out
}

#[cfg(test)]
mod tests;
