//! Loading a checkpoint: the registry of `mlxcel-models` picks the family
//! for its `model_type` (re-exported here for front ends and tests); a
//! checkpoint is a directory or a GGUF file, opened once per start
//! ([`Checkpoint`]: a GGUF header serves the config, the tokenizer and the
//! weights).

use std::path::Path;

pub use mlxcel_model::gguf::is_gguf;
use mlxcel_model::gguf::GgufHeader;
pub use mlxcel_models::{load_model, read_config, Checkpoint};

use crate::chat_template::ChatTemplate;
use crate::gguf_text::GgufText;
use crate::tokenizer::{TextError, TextTokenizer};
use crate::EngineError;

/// The tokenizer, chat template (`template_file` if given, else
/// `tokenizer.chat_template`) and EOS ids of a GGUF file, from its
/// `header` (read once, by [`Checkpoint::open`]; `path` names the file in
/// errors).
///
/// # Errors
/// An unsupported tokenizer, a template that does not compile.
pub fn gguf_text(
    path: &Path,
    header: &GgufHeader,
    template_file: Option<&Path>,
) -> Result<(TextTokenizer, Option<ChatTemplate>, Vec<u32>), EngineError> {
    let text = GgufText::from_header(path, header)?;
    let source = match template_file {
        Some(file) => Some(
            std::fs::read_to_string(file).map_err(|source| TextError::Io {
                path: file.to_path_buf(),
                source,
            })?,
        ),
        None => text.chat_template.clone(),
    };
    let template = source
        .map(|s| ChatTemplate::new(s, text.bos_token.clone(), text.eos_token.clone()))
        .transpose()?;
    let mut eos = text.eos_ids;
    if let Some(id) = text
        .eos_token
        .as_deref()
        .and_then(|t| text.tokenizer.token_to_id(t))
    {
        if !eos.contains(&id) {
            eos.push(id);
        }
    }
    Ok((text.tokenizer, template, eos))
}
