//! Loading a checkpoint: the registry of `mlxcel-models` picks the family
//! for its `model_type` (re-exported here for front ends and tests); a
//! checkpoint is a directory or a GGUF file, opened once
//! ([`Checkpoint::open`]: a GGUF header is read once per start).

use std::path::Path;

pub use mlxcel_model::gguf::is_gguf;
pub use mlxcel_models::{load_model, read_config, Checkpoint};

use mlxcel_text::Text;

use crate::EngineError;

/// The text side of `checkpoint` (a directory or a GGUF file): its
/// tokenizer, chat template (`template_file` if given, else the model's
/// own), EOS ids and grammar vocabulary for `vocab_size` logit rows
/// ([`Text::from_model_dir`], [`Text::from_gguf_header`] on the header the
/// checkpoint already read).
///
/// # Errors
/// An unreadable or unsupported tokenizer, a template that does not
/// compile.
pub fn load_text(
    checkpoint: &Checkpoint,
    template_file: Option<&Path>,
    vocab_size: usize,
) -> Result<Text, EngineError> {
    let path = checkpoint.path();
    Ok(match checkpoint.gguf_header() {
        Some(header) => Text::from_gguf_header(path, header, template_file, vocab_size)?,
        None => Text::from_model_dir(path, template_file, vocab_size)?,
    })
}
