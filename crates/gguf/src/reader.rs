//! The header of a GGUF file: metadata and tensor descriptions, read and
//! checked in Rust before MLX's reader touches the tensor data.
//!
//! Layout (ggml's `docs/gguf.md`, versions 2 and 3; little-endian): the
//! magic `GGUF`, a `u32` version, `u64` tensor and metadata counts, the
//! metadata as key/typed-value pairs, then one description per tensor
//! (name, dimensions innermost first, type, offset into the data section),
//! and the data section at the next multiple of `general.alignment`
//! (default 32). Every length and offset is checked against the file's
//! size, so a truncated or corrupt file is an error, never a huge
//! allocation or an out-of-bounds read.

use std::collections::BTreeMap;
use std::fmt;
use std::io::{BufReader, Read};
use std::path::Path;

use crate::{GgufError, HeaderError};

/// A metadata value. Integers keep their sign class, floats are widened
/// to `f64` (an `f32` value converts back exactly).
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `uint8` .. `uint64`.
    UInt(u64),
    /// `int8` .. `int64`.
    Int(i64),
    /// `float32`, `float64`.
    Float(f64),
    Bool(bool),
    String(String),
    /// An array of one value type (nested arrays are allowed by the format).
    Array(Vec<Value>),
}

impl Value {
    /// The value as an unsigned integer, when it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::UInt(v) => Some(v),
            Value::Int(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, when it is a number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::Float(v) => Some(v),
            Value::UInt(v) => Some(v as f64),
            Value::Int(v) => Some(v as f64),
            _ => None,
        }
    }

    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The value as an array.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// A ggml tensor type (`ggml_type`): its id, name and block layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorType(pub u32);

impl TensorType {
    pub const F32: TensorType = TensorType(0);
    pub const F16: TensorType = TensorType(1);
    pub const Q4_0: TensorType = TensorType(2);
    pub const Q4_1: TensorType = TensorType(3);
    pub const Q8_0: TensorType = TensorType(8);
    pub const Q4_K: TensorType = TensorType(12);
    pub const Q6_K: TensorType = TensorType(14);

    /// ggml's name for the type (`Q4_1`, `BF16`, ...), or `type N` for an
    /// id this reader does not know.
    pub fn name(self) -> String {
        self.layout()
            .map(|l| l.0.to_string())
            .unwrap_or_else(|| format!("type {}", self.0))
    }

    /// Elements per block (1 for plain types; 0 for an unknown id).
    pub fn block_elements(self) -> u64 {
        self.layout().map_or(0, |l| l.1)
    }

    /// Bytes per block (0 for an unknown id).
    pub fn block_bytes(self) -> u64 {
        self.layout().map_or(0, |l| l.2)
    }

    /// `(name, elements per block, bytes per block)` of the types ggml
    /// defines (ggml's `ggml.h` and `ggml-common.h`).
    pub(crate) fn layout(self) -> Option<(&'static str, u64, u64)> {
        Some(match self.0 {
            0 => ("F32", 1, 4),
            1 => ("F16", 1, 2),
            2 => ("Q4_0", 32, 18),
            3 => ("Q4_1", 32, 20),
            6 => ("Q5_0", 32, 22),
            7 => ("Q5_1", 32, 24),
            8 => ("Q8_0", 32, 34),
            9 => ("Q8_1", 32, 36),
            10 => ("Q2_K", 256, 84),
            11 => ("Q3_K", 256, 110),
            12 => ("Q4_K", 256, 144),
            13 => ("Q5_K", 256, 176),
            14 => ("Q6_K", 256, 210),
            15 => ("Q8_K", 256, 292),
            16 => ("IQ2_XXS", 256, 66),
            17 => ("IQ2_XS", 256, 74),
            18 => ("IQ3_XXS", 256, 98),
            19 => ("IQ1_S", 256, 50),
            20 => ("IQ4_NL", 32, 18),
            21 => ("IQ3_S", 256, 110),
            22 => ("IQ2_S", 256, 82),
            23 => ("IQ4_XS", 256, 136),
            24 => ("I8", 1, 1),
            25 => ("I16", 1, 2),
            26 => ("I32", 1, 4),
            27 => ("I64", 1, 8),
            28 => ("F64", 1, 8),
            29 => ("IQ1_M", 256, 56),
            30 => ("BF16", 1, 2),
            34 => ("TQ1_0", 256, 54),
            35 => ("TQ2_0", 256, 66),
            39 => ("MXFP4", 32, 17),
            _ => return None,
        })
    }

    /// Whether mlxcel loads this type: F32, F16, BF16, Q4_0, Q4_1, Q5_0,
    /// Q5_1, Q8_0, Q4_K, Q5_K and Q6_K. Other types (Q2_K, Q3_K, Q8_K,
    /// the i-quants, ...) are refused by name before any tensor is read.
    pub fn is_supported(self) -> bool {
        crate::dequant::decodes(self)
    }

    /// Whether MLX's GGUF reader reads this type: F32 and F16 as they
    /// are; Q4_0, Q4_1, Q4_K and Q8_0 as MLX affine quantized weights
    /// (group size 32); Q6_K dequantized to float16. A file with any other
    /// type (its reader fails on the whole file) is read by mlxcel's own
    /// decoder ([`crate::dequant`]) instead, every tensor to float32.
    pub fn mlx_reads(self) -> bool {
        matches!(self.0, 0 | 1 | 2 | 3 | 8 | 12 | 14)
    }

    /// Bits per weight of a quantized type, rounded down (Q4_0, Q4_1 and
    /// Q4_K: 4; Q5_0, Q5_1, Q5_K: 5; Q6_K: 6; Q8_0: 8); `None` for float
    /// types and the types mlxcel does not load.
    pub fn stored_bits(self) -> Option<i32> {
        match self.0 {
            2 | 3 | 12 => Some(4),
            6 | 7 | 13 => Some(5),
            14 => Some(6),
            8 => Some(8),
            _ => None,
        }
    }

    /// Whether MLX keeps this type quantized, and at how many bits.
    pub fn mlx_quantized_bits(self) -> Option<i32> {
        match self.0 {
            2 | 3 | 12 => Some(4),
            8 => Some(8),
            _ => None,
        }
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// One tensor's description.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// Row-major shape (GGUF stores the innermost dimension first; this is
    /// reversed, as MLX loads it): a `[out, in]` matrix is `[out, in]`.
    pub shape: Vec<u64>,
    pub ty: TensorType,
    /// Byte offset in the data section.
    pub offset: u64,
}

/// A GGUF file's header.
#[derive(Debug, Clone)]
pub struct GgufHeader {
    /// Format version (2 or 3).
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    /// Byte offset of the data section in the file (tensor offsets count
    /// from here).
    pub data_start: u64,
}

/// Largest dimension count ggml writes.
const MAX_DIMS: u32 = 4;

impl GgufHeader {
    /// Reads and checks the header of `path`: magic, version, every length
    /// against the file's size, tensor types known to ggml, and each
    /// tensor's data inside the file.
    ///
    /// # Errors
    /// [`GgufError::Io`] when the file cannot be read;
    /// [`GgufError::Invalid`] naming what is wrong ([`HeaderError`]) when
    /// it is not a valid GGUF file (bad magic, unsupported version,
    /// truncation, a tensor past the end of the file, an unknown tensor
    /// type id).
    pub fn read(path: &Path) -> Result<Self, GgufError> {
        #[cfg(feature = "count-reads")]
        crate::count_reads::record(path);
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        let size = file.metadata().map_err(io)?.len();
        let mut r = Cursor {
            inner: BufReader::new(file),
            pos: 0,
            size,
        };
        Self::parse(&mut r).map_err(|source| GgufError::Invalid {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Parses a header from `bytes` (a whole file), as
    /// [`GgufHeader::read`] does a file's.
    #[cfg(test)]
    pub(crate) fn parse_bytes(bytes: &[u8]) -> Result<Self, HeaderError> {
        Self::parse(&mut Cursor {
            inner: bytes,
            pos: 0,
            size: bytes.len() as u64,
        })
    }

    fn parse<R: Read>(r: &mut Cursor<R>) -> Result<Self, HeaderError> {
        let magic = r.bytes::<4>()?;
        if &magic != b"GGUF" {
            return Err(HeaderError::BadMagic);
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(HeaderError::Version(version));
        }
        let tensor_count = r.u64()?;
        let kv_count = r.u64()?;
        let mut metadata = BTreeMap::new();
        for _ in 0..kv_count {
            let key = r.string()?;
            let ty = r.u32()?;
            let value = r.value(ty, 0).map_err(|e| HeaderError::Metadata {
                key: key.clone(),
                source: Box::new(e),
            })?;
            metadata.insert(key, value);
        }
        // Each description takes at least 24 bytes.
        r.check_count(tensor_count, 24)?;
        let mut tensors = Vec::with_capacity(tensor_count.min(1 << 16) as usize);
        for _ in 0..tensor_count {
            tensors.push(r.tensor_info()?);
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => v
                .as_u64()
                .filter(|a| *a > 0 && a.is_power_of_two())
                .ok_or(HeaderError::Alignment)?,
        };
        let data_start = r.pos.div_ceil(alignment) * alignment;
        for t in &tensors {
            let bytes = tensor_bytes(t)?;
            let end = data_start
                .checked_add(t.offset)
                .and_then(|s| s.checked_add(bytes));
            if !t.offset.is_multiple_of(alignment) || end.is_none_or(|e| e > r.size) {
                return Err(HeaderError::OutsideFile {
                    name: t.name.clone(),
                    bytes,
                    offset: t.offset,
                });
            }
        }
        Ok(GgufHeader {
            version,
            metadata,
            tensors,
            data_start,
        })
    }

    /// Metadata value `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// The data size of `t` in bytes.
fn tensor_bytes(t: &TensorInfo) -> Result<u64, HeaderError> {
    let (_, block, block_bytes) =
        t.ty.layout()
            .ok_or_else(|| HeaderError::UnknownTensorType {
                name: t.name.clone(),
                id: t.ty.0,
            })?;
    let inner = t.shape.last().copied().unwrap_or(1);
    if !inner.is_multiple_of(block) {
        return Err(HeaderError::PartialRow {
            name: t.name.clone(),
            row: inner,
            ty: t.ty,
        });
    }
    let overflow = |what| HeaderError::Overflow {
        name: t.name.clone(),
        what,
    };
    let count = t
        .shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| overflow("shape"))?;
    (count / block)
        .checked_mul(block_bytes)
        .ok_or_else(|| overflow("size"))
}

/// The fewest bytes a value of metadata type `ty` takes in the file.
fn min_value_bytes(ty: u32) -> u64 {
    match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        // A string's length, an array's type and length.
        8 => 8,
        9 => 12,
        _ => 8,
    }
}

/// A reader that knows its position and the file's size.
struct Cursor<R> {
    inner: R,
    pos: u64,
    size: u64,
}

impl<R: Read> Cursor<R> {
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N], HeaderError> {
        let mut b = [0u8; N];
        self.inner
            .read_exact(&mut b)
            .map_err(|_| HeaderError::Truncated(self.pos))?;
        self.pos += N as u64;
        Ok(b)
    }

    fn u32(&mut self) -> Result<u32, HeaderError> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }

    fn u64(&mut self) -> Result<u64, HeaderError> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }

    /// Fails unless `count` items of at least `min_bytes` each fit in what
    /// is left of the file.
    fn check_count(&self, count: u64, min_bytes: u64) -> Result<(), HeaderError> {
        let left = self.size.saturating_sub(self.pos);
        if count.checked_mul(min_bytes).is_none_or(|n| n > left) {
            return Err(HeaderError::CountTooLarge {
                count,
                at: self.pos,
            });
        }
        Ok(())
    }

    fn string(&mut self) -> Result<String, HeaderError> {
        let len = self.u64()?;
        self.check_count(len, 1)?;
        let mut buf = vec![0u8; len as usize];
        self.inner
            .read_exact(&mut buf)
            .map_err(|_| HeaderError::Truncated(self.pos))?;
        self.pos += len;
        String::from_utf8(buf).map_err(|_| HeaderError::NotUtf8(self.pos))
    }

    /// A value of GGUF metadata type `ty` (`gguf_metadata_value_type`).
    fn value(&mut self, ty: u32, depth: u32) -> Result<Value, HeaderError> {
        Ok(match ty {
            0 => Value::UInt(u8::from_le_bytes(self.bytes()?).into()),
            1 => Value::Int(i8::from_le_bytes(self.bytes()?).into()),
            2 => Value::UInt(u16::from_le_bytes(self.bytes()?).into()),
            3 => Value::Int(i16::from_le_bytes(self.bytes()?).into()),
            4 => Value::UInt(self.u32()?.into()),
            5 => Value::Int(i32::from_le_bytes(self.bytes()?).into()),
            6 => Value::Float(f32::from_le_bytes(self.bytes()?).into()),
            7 => match u8::from_le_bytes(self.bytes()?) {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(HeaderError::BadBool(b)),
            },
            8 => Value::String(self.string()?),
            9 => {
                if depth > 2 {
                    return Err(HeaderError::NestedTooDeep);
                }
                let elem = self.u32()?;
                let len = self.u64()?;
                self.check_count(len, min_value_bytes(elem))?;
                let mut items = Vec::with_capacity(len.min(1 << 16) as usize);
                for _ in 0..len {
                    items.push(self.value(elem, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::UInt(self.u64()?),
            11 => Value::Int(i64::from_le_bytes(self.bytes()?)),
            12 => Value::Float(f64::from_le_bytes(self.bytes()?)),
            t => return Err(HeaderError::UnknownValueType(t)),
        })
    }

    fn tensor_info(&mut self) -> Result<TensorInfo, HeaderError> {
        let name = self.string()?;
        let n_dims = self.u32()?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(HeaderError::Dimensions { name, dims: n_dims });
        }
        let mut shape = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            let d = self.u64()?;
            if d == 0 || d > i32::MAX as u64 {
                return Err(HeaderError::Dimension { name, dim: d });
            }
            shape.push(d);
        }
        shape.reverse();
        let ty = TensorType(self.u32()?);
        let offset = self.u64()?;
        Ok(TensorInfo {
            name,
            shape,
            ty,
            offset,
        })
    }
}

#[cfg(test)]
mod tests;
