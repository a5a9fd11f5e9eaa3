//! Loading a checkpoint: the registry of `mlxcel-models` picks the family
//! for its `model_type` (re-exported here for front ends and tests); a
//! checkpoint is a directory or a GGUF file.

use std::path::Path;

pub use mlxcel_model::gguf::is_gguf;
pub use mlxcel_models::{load_model, read_config};

use mlxcel_text::Text;

use crate::EngineError;

/// The text side of the checkpoint at `path` (a directory or a GGUF file):
/// its tokenizer, chat template (`template_file` if given, else the
/// model's own), EOS ids and grammar vocabulary for `vocab_size` logit rows
/// ([`Text::from_model_dir`], [`Text::from_gguf_header`]).
///
/// # Errors
/// An invalid or unsupported GGUF, an unreadable or unsupported tokenizer,
/// a template that does not compile.
pub fn load_text(
    path: &Path,
    template_file: Option<&Path>,
    vocab_size: usize,
) -> Result<Text, EngineError> {
    if is_gguf(path) {
        let gguf = mlxcel_model::gguf::GgufModel::open(path)?;
        Ok(Text::from_gguf_header(
            path,
            &gguf.header,
            template_file,
            vocab_size,
        )?)
    } else {
        Ok(Text::from_model_dir(path, template_file, vocab_size)?)
    }
}
