//! From a front end's [`GenerationRequest`] to a [`Job`] the engine
//! thread runs: the prompt rendered and tokenized exactly as it will run,
//! the output grammar compiled, `max_tokens` clamped to the context and
//! the pool, the output filter's modes decided.
//!
//! The front end owns the request's rules (ranges, relations between
//! fields, names): the HTTP layer refuses a bad request with the field in
//! its own API's terms (crates/server/src/validate). What only the engine
//! can know is checked here: the vocabulary (token ids, `logit_bias`),
//! `n` against `--parallel`, the context and the KV pool, whether the
//! chat template accepts the messages, and the output's one grammar (it
//! compiles; a forced tool call and a `response_format` are not both
//! asked). A request
//! outside its documented contract (tools with a text prompt, a
//! `min_tokens` above `max_tokens`) runs with a defined meaning rather
//! than being checked twice.

use std::sync::Arc;
use std::time::Instant;

use mlxcel_kv::GroupAdmission;
use mlxcel_text::client_text::mark_client_text;
use mlxcel_text::constraint::{ConstrainedDecoder, Grammar};
use mlxcel_text::output::tool_calls::gemma4::gemma4_forced_call_prefix;
use mlxcel_text::output::tool_calls::mistral::mistral_forced_call_prefix;
use mlxcel_text::output::tool_calls::qwen3_coder::xml_forced_call_prefix;
use mlxcel_text::output::{forced_call_prefix, harmony, ToolCallFormat};
use mlxcel_text::reasoning::ReasoningMarkers;
use mlxcel_text::{Text, TextError};

use mlxcel_model::pooling::Pooling;

use crate::api::{
    EmbeddingRequest, EventStream, GenerationRequest, Prompt, RequestField, ResponseFormat,
    SamplingParams, SubmitError, TokenizeRequest, ToolChoice, ToolDefinition,
};
use crate::worker::{Job, ToolCallOutput};

/// How a prompt is turned into tokens.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Encoding<'a> {
    /// Chat: end with the assistant turn's header.
    pub(crate) generation_prompt: bool,
    /// Text: add the tokenizer's special tokens (a BOS).
    pub(crate) special_tokens: bool,
    /// Chat: markup of the engine's own after the generation prompt (a
    /// forced call's start).
    pub(crate) reply: &'a str,
}

impl Encoding<'_> {
    /// As a request runs: the generation prompt, special tokens, no reply.
    pub(crate) const RUN: Encoding<'static> = Encoding {
        generation_prompt: true,
        special_tokens: true,
        reply: "",
    };
}

/// What bounds a request in this engine.
#[derive(Debug, Clone)]
pub(crate) struct Limits {
    /// The model's context, in tokens.
    pub(crate) context_length: usize,
    /// Token ids accepted in `logit_bias`: the tokenizer's vocabulary
    /// (padding rows of the model's output have no text).
    pub(crate) vocab_size: usize,
    /// Sequences running at once (`--parallel`): the most choices.
    pub(crate) parallel: usize,
    /// Prompt plus completion tokens one request may hold in the pool.
    pub(crate) max_request_tokens: usize,
    /// The KV cache's admission rule, per KV group (for `max_tokens`).
    pub(crate) admission: GroupAdmission,
    /// Special-token strings in message content become control tokens
    /// (`--special-tokens-in-content`).
    pub(crate) special_tokens_in_content: bool,
    /// Chat replies are split into reasoning and content, at these
    /// markers.
    pub(crate) reasoning: Option<ReasoningMarkers>,
    /// How embeddings are pooled and their length (the hidden size), when
    /// the model serves them.
    pub(crate) embedding: Option<(Pooling, usize)>,
}

/// Builds the engine's jobs from requests (see the module docs).
pub(crate) struct RequestBuilder {
    pub(crate) text: Arc<Text>,
    pub(crate) limits: Limits,
}

/// The grammar of a request with the field that asked for it, and for a
/// forced tool call the reply's start that goes in the prompt.
struct Constrained {
    grammar: Grammar,
    field: RequestField,
    reply: Option<String>,
}

fn invalid(field: RequestField, message: String) -> SubmitError {
    SubmitError::InvalidRequest {
        message,
        field: Some(field),
    }
}

impl RequestBuilder {
    /// The job of `request` and the stream its events arrive on.
    ///
    /// # Errors
    /// [`SubmitError::InvalidRequest`] for what only the engine can check
    /// (see the module docs), [`SubmitError::ContextLengthExceeded`] for a
    /// prompt that cannot fit.
    pub(crate) fn job(
        &self,
        mut request: GenerationRequest,
    ) -> Result<(Job, EventStream), SubmitError> {
        let limits = &self.limits;
        let n = request.n.max(1);
        if n > limits.parallel {
            return Err(invalid(
                RequestField::N,
                format!(
                    "n = {n} is more than the {} sequences this server runs at once (--parallel)",
                    limits.parallel
                ),
            ));
        }
        if let Some(&(bad, _)) = request
            .logit_bias
            .iter()
            .find(|(id, _)| *id as usize >= limits.vocab_size)
        {
            return Err(invalid(
                RequestField::LogitBias,
                format!(
                    "token id {bad} is outside the vocabulary ({})",
                    limits.vocab_size
                ),
            ));
        }
        let chat = matches!(request.prompt, Prompt::Chat(_));
        // Tools belong to chat prompts; `tool_choice: none` hides them.
        let tools: &[ToolDefinition] = if chat && request.tool_choice != ToolChoice::None {
            &request.tools
        } else {
            &[]
        };
        let format = self
            .text
            .template
            .as_ref()
            .map(|t| t.tool_call_format())
            .unwrap_or_default();
        let constrained = constraint_of(&request, tools, format)?;
        let constraints = match (&constrained, &self.text.grammar) {
            (Some(c), Some(tokens)) => (0..n)
                .map(|_| ConstrainedDecoder::new(tokens, &c.grammar))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| invalid(c.field, e.to_string()))?,
            (Some(c), None) => {
                return Err(invalid(
                    c.field,
                    "constrained output is not available for this model's tokenizer".into(),
                ))
            }
            (None, _) => Vec::new(),
        };
        let reply = constrained.as_ref().and_then(|c| c.reply.clone());
        let prompt = self.encode(
            &request.prompt,
            tools,
            &request.chat_template_kwargs,
            Encoding {
                reply: reply.as_deref().unwrap_or(""),
                ..Encoding::RUN
            },
        )?;
        if prompt.is_empty() {
            return Err(invalid(RequestField::Prompt, "the prompt is empty".into()));
        }
        self.check_token_ids(&prompt)?;
        request.max_tokens = self.max_tokens(prompt.len(), n, request.max_tokens)?;
        // A harmony reply (gpt-oss) carries its reasoning on a channel of
        // its own: the harmony reader splits it, with or without tools.
        let harmony = chat && format == ToolCallFormat::Harmony;
        // Constrained output (a schema, a forced call) is all content.
        let reasoning = limits
            .reasoning
            .filter(|_| chat && constrained.is_none() && !harmony)
            .map(|markers| {
                let tail = &prompt[prompt.len().saturating_sub(8)..];
                let tail = self.text.tokenizer.decode(tail, false).unwrap_or_default();
                (markers, markers.prompt_opens_block(&tail))
            });
        let tool_calls = match reply {
            Some(prefix) => ToolCallOutput::Forced { format, prefix },
            None if !tools.is_empty() => ToolCallOutput::Parsed(format),
            None if harmony => ToolCallOutput::Harmony,
            None => ToolCallOutput::Off,
        };
        // An infill ends where the model leaves the middle: at an EOS id or
        // any of its FIM control tokens (llama.cpp ends one there too).
        let stop_ids = match &request.prompt {
            Prompt::Infill(_) => self
                .text
                .fim
                .as_ref()
                .map(|f| f.stop_ids.clone())
                .unwrap_or_default(),
            _ => Vec::new(),
        };
        let (events, stream) = tokio::sync::mpsc::unbounded_channel();
        let job = Job {
            prompt,
            request,
            submitted: Instant::now(),
            events,
            constraints,
            tool_calls,
            reasoning,
            stop_ids,
            embedding: None,
        };
        Ok((job, stream))
    }

    /// The job of an embedding request: its prompt encoded as a text
    /// completion's, prefill only, no sampling; it ends with one
    /// `Embedding` event.
    ///
    /// # Errors
    /// [`SubmitError::InvalidRequest`] for a model that serves no
    /// embeddings, a prompt that is not text or token ids, an empty one,
    /// ids outside the vocabulary; [`SubmitError::ContextLengthExceeded`].
    pub(crate) fn embedding_job(
        &self,
        request: EmbeddingRequest,
    ) -> Result<(Job, EventStream), SubmitError> {
        let Some((pooling, _)) = self.limits.embedding else {
            return Err(SubmitError::InvalidRequest {
                message: "this model does not serve embeddings (start the server with \
                          --embeddings to serve them from any model)"
                    .into(),
                field: None,
            });
        };
        if !matches!(request.prompt, Prompt::Text(_) | Prompt::Tokens(_)) {
            return Err(invalid(
                RequestField::Prompt,
                "an embedding's input is text or token ids".into(),
            ));
        }
        let prompt = self.encode(&request.prompt, &[], &serde_json::Map::new(), Encoding::RUN)?;
        if prompt.is_empty() {
            return Err(invalid(RequestField::Prompt, "the input is empty".into()));
        }
        self.check_token_ids(&prompt)?;
        let mut generation = GenerationRequest::new(request.prompt, SamplingParams::greedy(), 1);
        generation.cache_prompt = request.cache_prompt;
        generation.speculative = false;
        // Admission charges the prompt and one more token.
        generation.max_tokens = self.max_tokens(prompt.len(), 1, 1)?;
        let (events, stream) = tokio::sync::mpsc::unbounded_channel();
        let job = Job {
            prompt,
            request: generation,
            submitted: Instant::now(),
            events,
            constraints: Vec::new(),
            tool_calls: ToolCallOutput::Off,
            reasoning: None,
            stop_ids: Vec::new(),
            embedding: Some(pooling),
        };
        Ok((job, stream))
    }

    /// `max_tokens` clamped so that the request fits the model's context
    /// and, to its last token, the KV pool with all its `n` choices (else
    /// it could never be admitted).
    ///
    /// # Errors
    /// [`SubmitError::ContextLengthExceeded`] when not even one token fits.
    fn max_tokens(&self, prompt: usize, n: usize, asked: usize) -> Result<usize, SubmitError> {
        let limits = &self.limits;
        let too_long = || SubmitError::ContextLengthExceeded {
            prompt_tokens: prompt,
            context_length: limits.context_length.min(limits.max_request_tokens),
        };
        if prompt >= limits.context_length {
            return Err(too_long());
        }
        let want = asked.min(limits.context_length - prompt).max(1);
        limits
            .admission
            .max_new_tokens(prompt, n, want)
            .ok_or_else(too_long)
    }

    /// The token ids of a `/tokenize` request: rendered and encoded as a
    /// generation would be, checked against the vocabulary.
    ///
    /// # Errors
    /// Template and tokenizer failures, ids outside the vocabulary.
    pub(crate) fn tokenize(&self, request: &TokenizeRequest) -> Result<Vec<u32>, SubmitError> {
        let tokens = self.encode(
            &request.prompt,
            &request.tools,
            &request.chat_template_kwargs,
            Encoding {
                generation_prompt: request.add_generation_prompt,
                special_tokens: request.add_special_tokens,
                reply: "",
            },
        )?;
        self.check_token_ids(&tokens)?;
        Ok(tokens)
    }

    /// Renders (chat) and tokenizes `prompt` with `tools` and extra chat
    /// template variables `kwargs` (client text marked like the messages,
    /// so special-token strings stay text) as `encoding` says.
    ///
    /// # Errors
    /// Template errors (`raise_exception`, bad messages), a model without
    /// a chat template, tokenizer errors, as
    /// [`SubmitError::InvalidRequest`] on the prompt.
    pub(crate) fn encode(
        &self,
        prompt: &Prompt,
        tools: &[ToolDefinition],
        kwargs: &serde_json::Map<String, serde_json::Value>,
        encoding: Encoding<'_>,
    ) -> Result<Vec<u32>, SubmitError> {
        let bad = |e: TextError| invalid(RequestField::Prompt, e.to_string());
        let tokenizer = &self.text.tokenizer;
        match prompt {
            Prompt::Tokens(ids) => Ok(ids.clone()),
            Prompt::Text(t) if encoding.special_tokens => {
                tokenizer.encode_text_prompt(t).map_err(bad)
            }
            Prompt::Text(t) => tokenizer.encode(t, false).map_err(bad),
            Prompt::Infill(infill) => self
                .text
                .fim
                .as_ref()
                .ok_or_else(|| {
                    invalid(
                        RequestField::Suffix,
                        "this model has no fill-in-the-middle tokens (<|fim_prefix|>, \
                         <fim_prefix> or <PRE> and their suffix and middle tokens)"
                            .into(),
                    )
                })?
                .prompt(tokenizer, infill)
                .map_err(bad),
            Prompt::Chat(messages) => {
                let template = self.text.template.as_ref().ok_or_else(|| {
                    invalid(
                        RequestField::Prompt,
                        "this model has no chat template".into(),
                    )
                })?;
                let marked = if self.limits.special_tokens_in_content {
                    None
                } else {
                    mark_client_text(tokenizer, messages, tools, kwargs)
                };
                let gp = encoding.generation_prompt;
                match marked {
                    // Nothing typed looks like a control token: the plain path.
                    None => {
                        let rendered = template
                            .render_with_kwargs(messages, tools, gp, kwargs)
                            .map_err(bad)?
                            + encoding.reply;
                        tokenizer.encode_chat_prompt(&rendered).map_err(bad)
                    }
                    Some((messages, tools, kwargs)) => {
                        let rendered = template
                            .render_with_kwargs(&messages, &tools, gp, &kwargs)
                            .map_err(bad)?
                            + encoding.reply;
                        tokenizer.encode_marked_chat_prompt(&rendered).map_err(bad)
                    }
                }
            }
        }
    }

    /// Refuses token ids outside the tokenizer's vocabulary (a 400 on
    /// `prompt`).
    ///
    /// # Errors
    /// [`SubmitError::InvalidRequest`] naming the first such id.
    pub(crate) fn check_token_ids(&self, tokens: &[u32]) -> Result<(), SubmitError> {
        let vocab = self.text.tokenizer.vocab_size();
        match tokens.iter().find(|&&t| t as usize >= vocab) {
            Some(bad) => Err(invalid(
                RequestField::Prompt,
                format!("token id {bad} is outside the vocabulary ({vocab})"),
            )),
            None => Ok(()),
        }
    }
}

/// The grammar a request's output must follow: a required or named tool
/// call over `tools` (then the reply's start goes in the prompt,
/// [`forced_call_prefix`], or the model's own for a `format` of
/// [`ToolCallFormat::Harmony`], [`ToolCallFormat::Qwen3CoderXml`],
/// [`ToolCallFormat::MistralV11`] or [`ToolCallFormat::Gemma4`],
/// with a grammar of that format: the model generates only the rest of the
/// call, for a named function only its arguments, and the output filter
/// builds the call from it), or its `response_format`.
///
/// # Errors
/// A forced call together with a `response_format` (one output, one
/// grammar: an engine rule, the front ends don't check it); a named
/// function that is not among `tools` (no schema to constrain its
/// arguments with).
fn constraint_of(
    request: &GenerationRequest,
    tools: &[ToolDefinition],
    format: ToolCallFormat,
) -> Result<Option<Constrained>, SubmitError> {
    let harmony = format == ToolCallFormat::Harmony;
    let field = RequestField::ToolChoice;
    let forced = !tools.is_empty()
        && matches!(
            request.tool_choice,
            ToolChoice::Required | ToolChoice::Function(_)
        );
    if forced && request.response_format.is_some() {
        return Err(invalid(
            field,
            "a required tool call cannot be combined with response_format".into(),
        ));
    }
    let schemas = || -> Vec<(String, serde_json::Value)> {
        tools
            .iter()
            .map(|t| (t.name.clone(), t.parameters.clone()))
            .collect()
    };
    let xml = format == ToolCallFormat::Qwen3CoderXml;
    let mistral = format == ToolCallFormat::MistralV11;
    let gemma4 = format == ToolCallFormat::Gemma4;
    let (grammar, only) = match &request.tool_choice {
        ToolChoice::Required if !tools.is_empty() && harmony => {
            (Grammar::HarmonyCall { tools: schemas() }, None)
        }
        ToolChoice::Required if !tools.is_empty() && xml => (
            Grammar::XmlCalls {
                tools: schemas(),
                named: false,
                single: !request.parallel_tool_calls,
            },
            None,
        ),
        ToolChoice::Required if !tools.is_empty() && mistral => (
            Grammar::MistralCalls {
                tools: schemas(),
                single: !request.parallel_tool_calls,
            },
            None,
        ),
        ToolChoice::Required if !tools.is_empty() && gemma4 => (
            Grammar::Gemma4Calls {
                tools: schemas(),
                named: false,
                single: !request.parallel_tool_calls,
            },
            None,
        ),
        ToolChoice::Required if !tools.is_empty() => (
            Grammar::ToolCalls {
                tools: schemas(),
                single: !request.parallel_tool_calls,
            },
            None,
        ),
        ToolChoice::Function(name) if !tools.is_empty() => {
            let tool = tools
                .iter()
                .find(|t| &t.name == name)
                .ok_or_else(|| invalid(field, format!("no tool named `{name}` to call")))?;
            let grammar = if xml {
                Grammar::XmlCalls {
                    tools: vec![(tool.name.clone(), tool.parameters.clone())],
                    named: true,
                    single: true,
                }
            } else if gemma4 {
                Grammar::Gemma4Calls {
                    tools: vec![(tool.name.clone(), tool.parameters.clone())],
                    named: true,
                    single: true,
                }
            } else {
                Grammar::JsonSchema(tool.parameters.clone())
            };
            (grammar, Some(name))
        }
        _ => {
            return Ok(request.response_format.as_ref().map(|f| Constrained {
                grammar: match f {
                    ResponseFormat::JsonObject => Grammar::JsonObject,
                    ResponseFormat::JsonSchema(schema) => Grammar::JsonSchema(schema.clone()),
                },
                field: RequestField::ResponseFormat,
                reply: None,
            }));
        }
    };
    Ok(Some(Constrained {
        grammar,
        field,
        reply: Some(match format {
            ToolCallFormat::Harmony => harmony::forced_call_prefix(only.map(String::as_str)),
            ToolCallFormat::Qwen3CoderXml => xml_forced_call_prefix(only.map(String::as_str)),
            ToolCallFormat::MistralV11 => mistral_forced_call_prefix(only.map(String::as_str)),
            ToolCallFormat::Gemma4 => gemma4_forced_call_prefix(only.map(String::as_str)),
            _ => forced_call_prefix(only.map(String::as_str)),
        }),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str) -> ToolDefinition {
        ToolDefinition {
            name: name.into(),
            description: None,
            parameters: serde_json::json!({"type": "object", "properties": {"a": {"type": "integer"}}}),
        }
    }

    /// Forced calls on a Gemma 4 template: its own prefix in the prompt and
    /// its own grammar, over the named function alone when one is named.
    #[test]
    fn gemma4_forced_calls_are_written_in_its_format() {
        let tools = [tool("f"), tool("g")];
        let schemas: Vec<_> = tools
            .iter()
            .map(|t| (t.name.clone(), t.parameters.clone()))
            .collect();
        let mut request =
            GenerationRequest::new(Prompt::Text("x".into()), SamplingParams::greedy(), 8);
        request.tool_choice = ToolChoice::Required;
        request.parallel_tool_calls = false;
        let c = constraint_of(&request, &tools, ToolCallFormat::Gemma4)
            .unwrap()
            .unwrap();
        assert_eq!(c.reply.as_deref(), Some("<|tool_call>call:"));
        let required = Grammar::Gemma4Calls {
            tools: schemas.clone(),
            named: false,
            single: true,
        };
        assert_eq!(c.grammar, required);
        request.tool_choice = ToolChoice::Function("g".into());
        let c = constraint_of(&request, &tools, ToolCallFormat::Gemma4)
            .unwrap()
            .unwrap();
        assert_eq!(c.reply.as_deref(), Some("<|tool_call>call:g{"));
        let named = Grammar::Gemma4Calls {
            tools: vec![schemas[1].clone()],
            named: true,
            single: true,
        };
        assert_eq!(c.grammar, named);
        // The Hermes format keeps its JSON arguments after its own prefix.
        let c = constraint_of(&request, &tools, ToolCallFormat::default())
            .unwrap()
            .unwrap();
        assert_eq!(c.grammar, Grammar::JsonSchema(tools[1].parameters.clone()));
        assert!(c.reply.is_some_and(|r| r.starts_with("<tool_call>")));
    }
}
