//! Chained content hashes of full KV blocks.
//!
//! A block's K/V depends on every token before it, so a block is named by a
//! hash chain: `hash(i) = H(parent = hash(i - 1), tokens of block i,
//! extra_key)`. Two sequences that agree on the first `k` full blocks of
//! tokens (and on the extra key) get the same first `k` hashes, which is what
//! the prefix cache looks up.
//!
//! # Stability
//!
//! The hash is XXH3-128 with the fixed seed [`BLOCK_HASH_SEED`] over a byte
//! layout written out below, with every integer little-endian:
//!
//! | bytes | field |
//! | --- | --- |
//! | 1 | layout version, `1` |
//! | 1 | `1` when there is a parent, else `0` |
//! | 16 | parent hash (`u128`), zero for the first block |
//! | 8 | extra key (`u64`) |
//! | 4 | number of tokens (`u32`) |
//! | 4 each | token ids (`u32`) |
//!
//! XXH3's output is frozen by its specification, so a hash is the same on
//! every platform, build and Rust release (unlike std's `DefaultHasher`). A
//! test pins one value; changing the layout must bump the version byte and
//! that test together. Hashes are never persisted today, so a change costs
//! nothing but cache misses across a restart.
//!
//! XXH3 is not a cryptographic hash. 128 bits make an accidental collision
//! negligible; a client crafting a collision on purpose is not ruled out (see
//! the crate's open questions).

use std::fmt;

use xxhash_rust::xxh3::xxh3_128_with_seed;

/// The fixed seed of every block hash. Changing it invalidates every hash.
pub const BLOCK_HASH_SEED: u64 = 0x6d6c_7863_656c_6b76; // "mlxcelkv"

/// The layout version written first into every hashed message.
const LAYOUT_VERSION: u8 = 1;

/// The bytes before the token ids: version, parent flag, parent, extra key,
/// token count.
const HEADER_BYTES: usize = 1 + 1 + 16 + 8 + 4;

/// The chained content hash of one full block (128 bits).
///
/// Computed by [`BlockHash::chained`]; stable as documented in the module.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u128);

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockHash({:032x})", self.0)
    }
}

impl fmt::Display for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl BlockHash {
    /// The hash of a block holding `tokens`, following the block hashed as
    /// `parent` (`None` for the first block of a sequence, position 0).
    ///
    /// `extra_key` separates caches that must never share K/V for the same
    /// token ids: the model, its dtype, a chat template, an adapter. Pass the
    /// same value for every block of a chain.
    pub fn chained(parent: Option<BlockHash>, tokens: &[u32], extra_key: u64) -> BlockHash {
        let mut bytes = Vec::with_capacity(HEADER_BYTES + 4 * tokens.len());
        Self::chained_with(&mut bytes, parent, tokens, extra_key)
    }

    /// [`BlockHash::chained`] writing its message into `scratch` (cleared
    /// first), so a chain reuses one buffer.
    pub(crate) fn chained_with(
        scratch: &mut Vec<u8>,
        parent: Option<BlockHash>,
        tokens: &[u32],
        extra_key: u64,
    ) -> BlockHash {
        scratch.clear();
        scratch.push(LAYOUT_VERSION);
        scratch.push(u8::from(parent.is_some()));
        scratch.extend_from_slice(&parent.map_or(0, |p| p.0).to_le_bytes());
        scratch.extend_from_slice(&extra_key.to_le_bytes());
        // A block holds far fewer than 2^32 tokens; saturate rather than wrap.
        let count = u32::try_from(tokens.len()).unwrap_or(u32::MAX);
        scratch.extend_from_slice(&count.to_le_bytes());
        for token in tokens {
            scratch.extend_from_slice(&token.to_le_bytes());
        }
        BlockHash(xxh3_128_with_seed(scratch, BLOCK_HASH_SEED))
    }
}

/// The chained hashes of every FULL block of `tokens` (which start at
/// absolute position 0), `block_size` tokens per block.
///
/// A trailing partial block gets no hash: only full blocks are shared. The
/// result has `tokens.len() / block_size` entries. `block_size` 0 gives none.
pub fn hash_full_blocks(tokens: &[u32], block_size: usize, extra_key: u64) -> Vec<BlockHash> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut scratch = Vec::with_capacity(HEADER_BYTES + 4 * block_size);
    let mut parent = None;
    tokens
        .chunks_exact(block_size)
        .map(|block| {
            let hash = BlockHash::chained_with(&mut scratch, parent, block, extra_key);
            parent = Some(hash);
            hash
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_is_pinned_across_builds() {
        // If this fails, the layout, the seed or the xxh3 crate changed the
        // value of a hash. Bump LAYOUT_VERSION with any intended change. The
        // values were checked against an independent XXH3-128 (the Python
        // `xxhash` binding) fed the byte layout documented above.
        let h = BlockHash::chained(None, &[1, 2, 3, 4], 7);
        assert_eq!(format!("{h}"), PINNED_FIRST);
        let h2 = BlockHash::chained(Some(h), &[5, 6, 7, 8], 7);
        assert_eq!(format!("{h2}"), PINNED_SECOND);
    }

    const PINNED_FIRST: &str = "11d62b24df1093fa776becdffb162ec5";
    const PINNED_SECOND: &str = "5c59755ff0cb927bf17583b0262b22f0";

    #[test]
    fn chain_depends_on_parent_tokens_and_extra_key() {
        let a = BlockHash::chained(None, &[1, 2], 0);
        assert_eq!(a, BlockHash::chained(None, &[1, 2], 0));
        assert_ne!(a, BlockHash::chained(None, &[1, 3], 0));
        assert_ne!(a, BlockHash::chained(None, &[1, 2], 1));
        assert_ne!(a, BlockHash::chained(Some(a), &[1, 2], 0));
        // A parent of value zero is not the same as no parent.
        assert_ne!(a, BlockHash::chained(Some(BlockHash(0)), &[1, 2], 0));
    }

    #[test]
    fn full_blocks_only_and_chained() {
        let tokens: Vec<u32> = (0..10).collect();
        let hashes = hash_full_blocks(&tokens, 4, 9);
        assert_eq!(hashes.len(), 2);
        assert_eq!(hashes[0], BlockHash::chained(None, &[0, 1, 2, 3], 9));
        assert_eq!(
            hashes[1],
            BlockHash::chained(Some(hashes[0]), &[4, 5, 6, 7], 9)
        );
        // Same second block after a different first block: different hash.
        let other: Vec<u32> = [9, 9, 9, 9, 4, 5, 6, 7].to_vec();
        assert_ne!(hash_full_blocks(&other, 4, 9)[1], hashes[1]);
        assert!(hash_full_blocks(&tokens, 0, 9).is_empty());
        assert!(hash_full_blocks(&tokens[..3], 4, 9).is_empty());
    }
}
