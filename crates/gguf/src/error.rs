//! What can go wrong reading a GGUF file.

use std::path::PathBuf;

use crate::TensorType;

/// Errors of reading a GGUF file: its header, its metadata, its tensors'
/// data.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file cannot be opened or read.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file is not a valid GGUF file (the header says what is wrong).
    #[error("{}: {source}", path.display())]
    Invalid {
        path: PathBuf,
        #[source]
        source: HeaderError,
    },
    /// A metadata key the reader needs is absent (`{arch}.{key}`).
    #[error("GGUF metadata has no {0}")]
    MissingKey(String),
    /// A metadata value of another type than the key's (`expected`: "an
    /// integer", "a number").
    #[error("GGUF {key} is not {expected}")]
    KeyType { key: String, expected: &'static str },
    /// Tensor data of a type [`crate::dequant::dequantize`] does not decode.
    #[error("no decoder for {0}")]
    NoDecoder(TensorType),
    /// Tensor data that is not a whole number of its type's blocks.
    #[error("{bytes} bytes are not whole {ty} blocks of {block_bytes}")]
    PartialBlocks {
        bytes: usize,
        ty: TensorType,
        block_bytes: usize,
    },
}

/// What is wrong with a GGUF header (the reason of
/// [`GgufError::Invalid`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    /// The file does not start with `GGUF`.
    #[error("not a GGUF file (no GGUF magic)")]
    BadMagic,
    /// A format version other than 2 or 3.
    #[error("GGUF version {0} (supported: 2 and 3)")]
    Version(u32),
    /// The file ends inside the header (at this byte).
    #[error("truncated at byte {0}")]
    Truncated(u64),
    /// A count (of items, or a string's bytes) read at byte `at` that the
    /// rest of the file cannot hold.
    #[error("a count of {count} at byte {at} does not fit in the file")]
    CountTooLarge { count: u64, at: u64 },
    /// A string (ending at this byte) that is not UTF-8.
    #[error("string at byte {0} is not UTF-8")]
    NotUtf8(u64),
    /// A bool stored as a byte other than 0 or 1.
    #[error("bool byte {0}")]
    BadBool(u8),
    /// Arrays of arrays more than three deep.
    #[error("arrays nested too deep")]
    NestedTooDeep,
    /// A metadata value type id the format does not define.
    #[error("unknown value type {0}")]
    UnknownValueType(u32),
    /// The value of metadata `key` is invalid.
    #[error("metadata {key}: {source}")]
    Metadata {
        key: String,
        #[source]
        source: Box<HeaderError>,
    },
    /// `general.alignment` is zero or not a power of two.
    #[error("general.alignment is not a power of two")]
    Alignment,
    /// A tensor with no or more than 4 dimensions.
    #[error("tensor {name} has {dims} dimensions")]
    Dimensions { name: String, dims: u32 },
    /// A tensor dimension of 0 or past `i32::MAX`.
    #[error("tensor {name} has a dimension of {dim}")]
    Dimension { name: String, dim: u64 },
    /// A tensor type id ggml does not define.
    #[error("tensor {name} has unknown type id {id}")]
    UnknownTensorType { name: String, id: u32 },
    /// A row that is not a whole number of its type's blocks.
    #[error("tensor {name}: row of {row} elements is not a whole number of {ty} blocks")]
    PartialRow {
        name: String,
        row: u64,
        ty: TensorType,
    },
    /// A tensor whose element or byte count overflows 64 bits (`what`:
    /// "shape" or "size").
    #[error("tensor {name}: {what} overflows")]
    Overflow { name: String, what: &'static str },
    /// A tensor's data (unaligned, or past the end of the file).
    #[error("tensor {name} ({bytes} bytes at offset {offset}) lies outside the file")]
    OutsideFile {
        name: String,
        bytes: u64,
        offset: u64,
    },
}
