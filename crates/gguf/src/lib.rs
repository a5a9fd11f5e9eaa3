//! GGUF files (llama.cpp's single-file checkpoint format) read in Rust,
//! without MLX: the header ([`GgufHeader`]: metadata and tensor
//! descriptions, every length and offset checked against the file), typed
//! access to an architecture's metadata ([`Meta`]), and ggml's block
//! formats decoded to float32 ([`dequant`]). `mlxcel-model`'s `gguf`
//! module turns a file into a checkpoint the families load. Format: ggml's
//! `docs/gguf.md`.

#[cfg(feature = "count-reads")]
pub mod count_reads;
pub mod dequant;
mod error;
mod meta;
mod reader;

use std::path::Path;

pub use error::{GgufError, HeaderError};
pub use meta::Meta;
pub use reader::{GgufHeader, TensorInfo, TensorType, Value};

/// Whether `path` names a GGUF file (a file whose name ends in `.gguf`).
pub fn is_gguf(path: &Path) -> bool {
    path.is_file()
        && path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}
