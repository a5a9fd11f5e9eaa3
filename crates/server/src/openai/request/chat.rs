//! The body of `POST /v1/chat/completions`.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::{Map, Value};
use utoipa::ToSchema;

use super::schemas::{
    chat_template_kwargs_schema, logit_bias_schema, metadata_schema, stop_schema,
};
use super::{SharedFields, Stop, StreamOptions, Unknown};
use crate::openai::message::{ChatMessage, ResponseFormat, Tool, ToolChoice};

generation_request! {
    /// The body of `POST /v1/chat/completions`. `stream_options` only with
    /// `stream` true; `top_logprobs` only with `logprobs` true. OpenAI fields
    /// mlxcel lacks (audio, function_call, functions, modalities,
    /// prediction, reasoning_effort, safety_identifier, service_tier,
    /// verbosity, web_search_options) are accepted only with their default
    /// value.
    #[schema(as = CreateChatCompletionRequest)]
    pub struct ChatCompletionRequest {
        /// Must be the served model's id (see GET /v1/models); another name
        /// is a 404.
        pub model: Option<String>,
        /// The conversation so far.
        #[schema(min_items = 1)]
        pub messages: Vec<ChatMessage>,
        /// Most tokens to generate per choice (default: the server's
        /// --default-max-tokens).
        #[schema(minimum = 1)]
        pub max_tokens: Option<i128>,
        /// Same as max_tokens; when both are given they must agree.
        #[schema(minimum = 1)]
        pub max_completion_tokens: Option<i128>,
        /// Return the log probability of each generated token.
        #[schema(default = false)]
        pub logprobs: Option<bool>,
        /// Alternatives per token; only with logprobs true.
        #[schema(minimum = 0, maximum = 20)]
        pub top_logprobs: Option<i128>,
        /// A grammar the answer must follow.
        pub response_format: Option<ResponseFormat>,
        /// Functions the model may call.
        pub tools: Option<Vec<Tool>>,
        /// Whether and which tool the model must call.
        pub tool_choice: Option<ToolChoice>,
        /// false: only the first tool call is returned.
        #[schema(default = true)]
        pub parallel_tool_calls: Option<bool>,
        /// Extra chat template variables, e.g. {"enable_thinking": false}
        /// (vLLM extension); not messages, tools, add_generation_prompt,
        /// documents, bos_token or eos_token.
        #[schema(schema_with = chat_template_kwargs_schema)]
        pub chat_template_kwargs: Option<Map<String, Value>>,
        /// Accepted and not stored.
        #[schema(schema_with = metadata_schema)]
        pub metadata: Option<BTreeMap<String, String>>,
        /// Accepted either way; nothing is stored.
        pub store: Option<bool>,
        /// Accepted and logged; the prefix cache finds shared prefixes by
        /// content.
        pub prompt_cache_key: Option<String>,
    }
}
