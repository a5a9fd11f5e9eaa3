//! MLX element types.

/// MLX element types; the discriminant is the code shared with the C++ shim
/// (the order of `mlx::core::Dtype::Val`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
#[repr(i32)]
pub enum Dtype {
    Bool = 0,
    Uint8 = 1,
    Uint16 = 2,
    Uint32 = 3,
    Uint64 = 4,
    Int8 = 5,
    Int16 = 6,
    Int32 = 7,
    Int64 = 8,
    Float16 = 9,
    Float32 = 10,
    Float64 = 11,
    Bfloat16 = 12,
    Complex64 = 13,
}

impl Dtype {
    /// The dtype of MLX's code `c` (`Dtype as i32`); `None` for a code
    /// MLX doesn't define.
    pub fn from_code(c: i32) -> Option<Dtype> {
        use Dtype::*;
        Some(match c {
            0 => Bool,
            1 => Uint8,
            2 => Uint16,
            3 => Uint32,
            4 => Uint64,
            5 => Int8,
            6 => Int16,
            7 => Int32,
            8 => Int64,
            9 => Float16,
            10 => Float32,
            11 => Float64,
            12 => Bfloat16,
            13 => Complex64,
            _ => return None,
        })
    }

    /// Parses `float32`, `float16`, `bfloat16` (the names used in
    /// `config.json` `torch_dtype` and on the command line).
    pub fn parse_float(name: &str) -> Option<Dtype> {
        match name {
            "float32" | "f32" => Some(Dtype::Float32),
            "float16" | "f16" | "half" => Some(Dtype::Float16),
            "bfloat16" | "bf16" => Some(Dtype::Bfloat16),
            _ => None,
        }
    }

    /// Size of one element in bytes.
    pub fn size_bytes(self) -> usize {
        use Dtype::*;
        match self {
            Bool | Uint8 | Int8 => 1,
            Uint16 | Int16 | Float16 | Bfloat16 => 2,
            Uint32 | Int32 | Float32 => 4,
            Uint64 | Int64 | Float64 | Complex64 => 8,
        }
    }
}
