//! The file format of one KV block on disk.
//!
//! A file is a fixed header followed by the payload, every integer
//! little-endian:
//!
//! | bytes | field |
//! | --- | --- |
//! | 8 | magic `MLXCKVB\0` |
//! | 4 | format version ([`FORMAT_VERSION`]) |
//! | 8 | tier key ([`BlockMeta::key`]: model, dtype, block size, groups) |
//! | 16 | block hash (`u128`) |
//! | 4 | KV group index |
//! | 4 | block size, in tokens |
//! | 4 | layers in the group |
//! | 4 | K/V heads |
//! | 4 | head dimension |
//! | 4 | float element dtype code (MLX's): of the K/V, or of the scales and biases of quantized K/V |
//! | 4 | bits per element when quantized (8, 4), else 0 |
//! | 4 | quantization group size in elements, else 0 |
//! | 8 | payload length, in bytes |
//! | 8 | checksum: XXH3-64 (seed 0) of every byte before it, then the payload |
//!
//! The payload is, per layer of the group in order, the block's keys then
//! its values, the pool's bytes as stored (no conversion): float K/V
//! `[block_size, kv_heads, head_dim]` in their dtype (2 or 4 bytes an
//! element); quantized K/V as their uint32 words `[block_size, kv_heads,
//! head_dim * bits / 32]`, then scales and biases `[block_size, kv_heads,
//! head_dim / group_size]` in the header's float dtype. Bytes are in the
//! machine's byte order, little-endian on every target MLX builds for.
//! Format 2 kept every float as float32 (twice the bytes of a float16
//! pool); the format version is part of the tier key, so its files count
//! as foreign and are never read nor deleted (remove them by hand).
//!
//! A *recurrent-state snapshot* file (crate::recurrent) has the same
//! header with the group field [`SNAPSHOT_GROUP`], the layers field the
//! model's recurrent layers, and zeros in the heads, head dimension,
//! dtype, bits and group size fields. Its payload describes itself
//! ([`encode_state`]): per recurrent layer, the number of its state
//! arrays, then per array its MLX dtype code, rank and dimensions (`u32`
//! each) and its bytes as MLX holds them, so a state comes back in its own
//! dtype and shape, bit for bit.

use mlxcel_mlx::Dtype;
use xxhash_rust::xxh3::Xxh3;

use crate::hash::BlockHash;

/// The first bytes of every block file.
pub const MAGIC: [u8; 8] = *b"MLXCKVB\0";

/// The version of the layout above; a file of another version is skipped.
pub const FORMAT_VERSION: u32 = 3;

/// The group field of a recurrent-state snapshot's file.
pub const SNAPSHOT_GROUP: u32 = u32::MAX;

/// Bytes of the header, checksum included.
pub const HEADER_BYTES: usize = 8 + 4 + 8 + 16 + 4 * 8 + 8 + 8;

/// What a block file says about its contents (its header without the
/// checksum).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockMeta {
    /// Everything that makes a block valid besides its hash (model
    /// fingerprint, dtype, block size, KV groups, format), hashed; files
    /// of another key are never served.
    pub key: u64,
    /// The block's chained content hash.
    pub hash: BlockHash,
    /// The KV group whose layers the payload holds.
    pub group: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Layers of the group.
    pub layers: u32,
    /// K/V heads per layer.
    pub kv_heads: u32,
    /// Features per head.
    pub head_dim: u32,
    /// MLX dtype code of the stored floats: the K/V of float storage, the
    /// scales and biases of quantized storage.
    pub dtype: u32,
    /// Bits per element of quantized K/V; 0 for float storage.
    pub bits: u32,
    /// Elements per scale and bias of quantized K/V; 0 for float storage.
    pub group_size: u32,
}

impl BlockMeta {
    /// The header of the recurrent-state snapshot under `hash` (the block
    /// that ends where it was taken) of a model with `layers` recurrent
    /// layers.
    pub fn snapshot(key: u64, hash: BlockHash, block_size: u32, layers: u32) -> BlockMeta {
        BlockMeta {
            key,
            hash,
            group: SNAPSHOT_GROUP,
            block_size,
            layers,
            kv_heads: 0,
            head_dim: 0,
            dtype: 0,
            bits: 0,
            group_size: 0,
        }
    }

    /// Whether this describes a recurrent-state snapshot.
    pub fn is_snapshot(&self) -> bool {
        self.group == SNAPSHOT_GROUP
    }

    /// Bytes of the whole file when its size follows from the header: a
    /// KV block's; `None` for a snapshot (its payload describes itself).
    pub fn expected_file_bytes(&self) -> Option<u64> {
        (!self.is_snapshot()).then(|| self.file_bytes())
    }

    /// Bytes of one token's K (or V) in one head: `head_dim` floats, or the
    /// quantized words plus a scale and a bias per group. A dtype code MLX
    /// doesn't know counts 4 bytes (its files are foreign anyway).
    pub fn bytes_per_head(&self) -> u64 {
        let d = u64::from(self.head_dim);
        let float = i32::try_from(self.dtype)
            .ok()
            .and_then(Dtype::from_code)
            .map_or(4, |t| t.size_bytes() as u64);
        match (self.bits, self.group_size) {
            (0, _) | (_, 0) => d * float,
            (bits, g) => d * u64::from(bits) / 8 + 2 * d / u64::from(g) * float,
        }
    }

    /// Payload bytes of such a KV block: K and V of every layer.
    pub fn payload_bytes(&self) -> u64 {
        2 * u64::from(self.layers)
            * u64::from(self.block_size)
            * u64::from(self.kv_heads)
            * self.bytes_per_head()
    }

    /// Bytes of the whole file.
    pub fn file_bytes(&self) -> u64 {
        HEADER_BYTES as u64 + self.payload_bytes()
    }

    /// The header of a file holding `payload`.
    pub fn encode(&self, payload: &[u8]) -> Vec<u8> {
        let mut h = Vec::with_capacity(HEADER_BYTES);
        h.extend_from_slice(&MAGIC);
        h.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        h.extend_from_slice(&self.key.to_le_bytes());
        h.extend_from_slice(&self.hash.0.to_le_bytes());
        for v in [
            self.group,
            self.block_size,
            self.layers,
            self.kv_heads,
            self.head_dim,
            self.dtype,
            self.bits,
            self.group_size,
        ] {
            h.extend_from_slice(&v.to_le_bytes());
        }
        h.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        let sum = checksum(&h, payload);
        h.extend_from_slice(&sum.to_le_bytes());
        h
    }
}

/// Why a block file was not served.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    /// Shorter than its header says (a torn or truncated write).
    #[error("truncated block file: {got} bytes, {want} expected")]
    Truncated {
        /// Bytes read.
        got: u64,
        /// Bytes the header (or the expected block) needs.
        want: u64,
    },
    /// Not a block file, or one of another format version.
    #[error("not a block file of format version {FORMAT_VERSION}")]
    BadMagic,
    /// A header that describes another block (another model's key, block
    /// size, group or hash).
    #[error("block file of another key or shape")]
    Foreign,
    /// The checksum does not match the bytes.
    #[error("block file checksum mismatch")]
    Checksum,
    /// A snapshot payload that does not parse, or describes states other
    /// than the model's.
    #[error("recurrent-state snapshot file: {0}")]
    BadState(String),
}

/// One state array of a snapshot: its MLX dtype, shape and bytes as MLX
/// holds them (row-major).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateArray {
    /// The MLX dtype.
    pub dtype: Dtype,
    /// The shape.
    pub shape: Vec<usize>,
    /// `shape.product() × dtype.size_bytes()` bytes.
    pub bytes: Vec<u8>,
}

/// The payload of a snapshot file (see the module docs): per recurrent
/// layer, its state arrays.
pub fn encode_state(layers: &[Vec<StateArray>]) -> Vec<u8> {
    let len: usize = layers
        .iter()
        .flatten()
        .map(|a| 8 + 4 * a.shape.len() + a.bytes.len())
        .sum();
    let mut out = Vec::with_capacity(len + 4 * layers.len());
    for arrays in layers {
        out.extend_from_slice(&(arrays.len() as u32).to_le_bytes());
        for a in arrays {
            out.extend_from_slice(&(a.dtype as i32 as u32).to_le_bytes());
            out.extend_from_slice(&(a.shape.len() as u32).to_le_bytes());
            for &d in &a.shape {
                out.extend_from_slice(&(d as u32).to_le_bytes());
            }
            out.extend_from_slice(&a.bytes);
        }
    }
    out
}

/// The state arrays of `layers` recurrent layers in a snapshot payload,
/// [`encode_state`]'s inverse.
///
/// # Errors
/// [`FormatError::BadState`]: a payload that ends early, runs past its
/// last layer, names a dtype MLX doesn't have, or a dimension over
/// `i32::MAX` (MLX's shapes are `i32`).
pub fn decode_state(payload: &[u8], layers: usize) -> Result<Vec<Vec<StateArray>>, FormatError> {
    let bad = |why: &str| FormatError::BadState(why.to_string());
    let mut at = 0usize;
    let word = |at: &mut usize| -> Result<u32, FormatError> {
        let w = payload.get(*at..*at + 4).ok_or_else(|| bad("ends early"))?;
        *at += 4;
        Ok(u32_at(w, 0))
    };
    let mut out = Vec::with_capacity(layers);
    for _ in 0..layers {
        let n = word(&mut at)? as usize;
        let mut arrays = Vec::with_capacity(n.min(16));
        for _ in 0..n {
            let dtype = i32::try_from(word(&mut at)?)
                .ok()
                .and_then(Dtype::from_code)
                .ok_or_else(|| bad("an unknown dtype"))?;
            let rank = word(&mut at)? as usize;
            if rank > 8 {
                return Err(bad("an array of rank over 8"));
            }
            let mut shape = Vec::with_capacity(rank);
            for _ in 0..rank {
                let d = word(&mut at)?;
                if i32::try_from(d).is_err() {
                    return Err(bad("a dimension over i32"));
                }
                shape.push(d as usize);
            }
            let len = shape
                .iter()
                .try_fold(dtype.size_bytes(), |n, &d| n.checked_mul(d))
                .ok_or_else(|| bad("an array too large"))?;
            let end = at
                .checked_add(len)
                .ok_or_else(|| bad("an array too large"))?;
            let bytes = payload
                .get(at..end)
                .ok_or_else(|| bad("ends early"))?
                .to_vec();
            at = end;
            arrays.push(StateArray {
                dtype,
                shape,
                bytes,
            });
        }
        out.push(arrays);
    }
    if at != payload.len() {
        return Err(bad("bytes past its last layer"));
    }
    Ok(out)
}

fn checksum(header: &[u8], payload: &[u8]) -> u64 {
    let mut x = Xxh3::new();
    x.update(header);
    x.update(payload);
    x.digest()
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut a = [0; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Checks a whole file's bytes against the block `want` describes and
/// returns its payload.
///
/// # Errors
/// A short file, another magic or version, a header describing another
/// block, a checksum mismatch.
pub fn decode<'a>(bytes: &'a [u8], want: &BlockMeta) -> Result<&'a [u8], FormatError> {
    let least = want.expected_file_bytes().unwrap_or(HEADER_BYTES as u64);
    if (bytes.len() as u64) < least {
        return Err(FormatError::Truncated {
            got: bytes.len() as u64,
            want: least,
        });
    }
    if bytes[..8] != MAGIC || u32_at(bytes, 8) != FORMAT_VERSION {
        return Err(FormatError::BadMagic);
    }
    let mut hash = [0; 16];
    hash.copy_from_slice(&bytes[20..36]);
    let got = BlockMeta {
        key: u64_at(bytes, 12),
        hash: BlockHash(u128::from_le_bytes(hash)),
        group: u32_at(bytes, 36),
        block_size: u32_at(bytes, 40),
        layers: u32_at(bytes, 44),
        kv_heads: u32_at(bytes, 48),
        head_dim: u32_at(bytes, 52),
        dtype: u32_at(bytes, 56),
        bits: u32_at(bytes, 60),
        group_size: u32_at(bytes, 64),
    };
    let payload = u64_at(bytes, 68);
    if got != *want || (!want.is_snapshot() && payload != want.payload_bytes()) {
        return Err(FormatError::Foreign);
    }
    let expected = (HEADER_BYTES as u64).saturating_add(payload);
    if bytes.len() as u64 != expected {
        return Err(FormatError::Truncated {
            got: bytes.len() as u64,
            want: expected,
        });
    }
    let (header, payload) = bytes.split_at(HEADER_BYTES);
    if checksum(&header[..HEADER_BYTES - 8], payload) != u64_at(header, HEADER_BYTES - 8) {
        return Err(FormatError::Checksum);
    }
    Ok(payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> BlockMeta {
        BlockMeta {
            key: 11,
            hash: BlockHash(0x1234),
            group: 0,
            block_size: 2,
            layers: 1,
            kv_heads: 1,
            head_dim: 2,
            dtype: 10,
            bits: 0,
            group_size: 0,
        }
    }

    #[test]
    fn round_trip_and_every_corruption_is_caught() {
        let m = meta();
        let payload: Vec<u8> = (0..m.payload_bytes() as u8).collect();
        let mut file = m.encode(&payload);
        assert_eq!(file.len(), HEADER_BYTES);
        file.extend_from_slice(&payload);
        assert_eq!(decode(&file, &m).unwrap(), &payload[..]);
        // A flipped payload byte, a flipped header byte, a short file.
        let mut bad = file.clone();
        bad[HEADER_BYTES + 3] ^= 1;
        assert_eq!(decode(&bad, &m), Err(FormatError::Checksum));
        let mut bad = file.clone();
        bad[56] ^= 1;
        assert_eq!(decode(&bad, &m), Err(FormatError::Foreign));
        assert!(matches!(
            decode(&file[..file.len() - 1], &m),
            Err(FormatError::Truncated { .. })
        ));
        let mut bad = file.clone();
        bad[0] = b'X';
        assert_eq!(decode(&bad, &m), Err(FormatError::BadMagic));
        // Another model's key; the same block quantized.
        let other = BlockMeta { key: 12, ..m };
        assert_eq!(decode(&file, &other), Err(FormatError::Foreign));
        let q8 = BlockMeta {
            bits: 8,
            group_size: 32,
            head_dim: 64,
            ..m
        };
        // Per token and head: 64 bytes of 8-bit codes, a float32 scale and
        // bias for each of 2 groups; K and V of 2 tokens.
        assert_eq!(q8.payload_bytes(), 2 * 2 * (64 + 2 * 2 * 4));
        // Float storage: 2 bytes an element for float16 and bfloat16.
        assert_eq!(m.payload_bytes(), 2 * 2 * 2 * 4);
        assert_eq!(BlockMeta { dtype: 12, ..m }.payload_bytes(), 2 * 2 * 2 * 2);
        assert!(matches!(
            decode(&file, &q8),
            Err(FormatError::Truncated { .. })
        ));
    }

    #[test]
    fn snapshot_files_describe_their_states() {
        let layers = vec![
            vec![
                StateArray {
                    dtype: Dtype::Bfloat16,
                    shape: vec![1, 3, 4],
                    bytes: (0..24).collect(),
                },
                StateArray {
                    dtype: Dtype::Float32,
                    shape: vec![1, 2, 2, 2],
                    bytes: (100..132).collect(),
                },
            ],
            vec![StateArray {
                dtype: Dtype::Float32,
                shape: vec![2],
                bytes: vec![7; 8],
            }],
        ];
        let payload = encode_state(&layers);
        assert_eq!(decode_state(&payload, 2).unwrap(), layers);
        // One layer too many or too few, a cut payload, an unknown dtype.
        assert!(decode_state(&payload, 3).is_err());
        assert!(decode_state(&payload, 1).is_err());
        assert!(decode_state(&payload[..payload.len() - 1], 2).is_err());
        let mut bad = payload.clone();
        bad[4] = 99;
        assert!(matches!(
            decode_state(&bad, 2),
            Err(FormatError::BadState(_))
        ));
        // A dimension over i32 (the first array's second one).
        let mut bad = payload.clone();
        bad[16..20].copy_from_slice(&0x8000_0000u32.to_le_bytes());
        assert!(matches!(
            decode_state(&bad, 2),
            Err(FormatError::BadState(_))
        ));

        // A snapshot file of any payload length; its header and checksum
        // are checked as a block's.
        let m = BlockMeta::snapshot(11, BlockHash(7), 8, 2);
        assert!(m.is_snapshot() && m.expected_file_bytes().is_none());
        let mut file = m.encode(&payload);
        file.extend_from_slice(&payload);
        assert_eq!(decode(&file, &m).unwrap(), &payload[..]);
        assert!(matches!(
            decode(&file[..file.len() - 1], &m),
            Err(FormatError::Truncated { .. })
        ));
        let mut bad = file.clone();
        bad[HEADER_BYTES + 9] ^= 1;
        assert_eq!(decode(&bad, &m), Err(FormatError::Checksum));
        // Another hash, another count of recurrent layers, a KV block.
        for other in [
            BlockMeta::snapshot(11, BlockHash(8), 8, 2),
            BlockMeta::snapshot(11, BlockHash(7), 8, 3),
            BlockMeta { group: 0, ..m },
        ] {
            assert!(decode(&file, &other).is_err(), "{other:?}");
        }
    }
}
