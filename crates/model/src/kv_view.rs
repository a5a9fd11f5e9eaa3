//! The sequence KV cache the attention layer reads and writes through.
//!
//! A sequence's cache is the absolute position range `[start, end)` plus the
//! per-layer storage holding it (ARCHITECTURE.md invariant 1): its length is
//! derived (`end - start`), and every shrink moves positions and storage
//! together. This is the dense (contiguous) backend; the paged block pool
//! implements the same surface.

use crate::ModelError;
use mlxcel_mlx::{zeros, Array, Dtype};

/// Tokens by which a dense layer buffer grows (as mlx_lm's `KVCache.step`).
pub const DENSE_GROW_STEP: usize = 256;

/// One layer's contiguous K/V buffers, `[1, kv_heads, capacity, head_dim]`.
#[derive(Debug, Default)]
struct DenseLayer {
    keys: Option<Array>,
    values: Option<Array>,
}

/// A sequence's KV cache in contiguous per-layer buffers.
#[derive(Debug)]
pub struct DenseSequenceCache {
    layers: Vec<DenseLayer>,
    /// First live absolute position.
    start: usize,
    /// One past the last live absolute position (the next token's position).
    end: usize,
    /// Tokens written by the forward in flight, beyond `end`; committed by
    /// [`DenseSequenceCache::commit`].
    pending: usize,
    capacity: usize,
    kv_heads: i32,
    head_dim: i32,
    dtype: Dtype,
}

impl DenseSequenceCache {
    /// An empty cache for `layers` layers of `kv_heads` x `head_dim` K/V.
    pub fn new(layers: usize, kv_heads: usize, head_dim: usize, dtype: Dtype) -> Self {
        DenseSequenceCache {
            layers: (0..layers).map(|_| DenseLayer::default()).collect(),
            start: 0,
            end: 0,
            pending: 0,
            capacity: 0,
            kv_heads: kv_heads as i32,
            head_dim: head_dim as i32,
            dtype,
        }
    }

    /// Live tokens (`end - start`).
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    /// Whether no token is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Absolute position of the next token (RoPE offset).
    pub fn next_position(&self) -> usize {
        self.end
    }

    /// Starts a forward of `n` new tokens: makes room for them in every layer.
    pub fn begin(&mut self, n: usize) -> Result<(), ModelError> {
        self.pending = n;
        let need = self.len() + n;
        if need <= self.capacity {
            return Ok(());
        }
        let new_cap = need.div_ceil(DENSE_GROW_STEP) * DENSE_GROW_STEP;
        let grow = (new_cap - self.capacity) as i32;
        let shape = [1, self.kv_heads, grow, self.head_dim];
        for layer in &mut self.layers {
            for buf in [&mut layer.keys, &mut layer.values] {
                let extra = zeros(&shape, self.dtype)?;
                *buf = Some(match buf.take() {
                    None => extra,
                    Some(old) => mlxcel_mlx::concatenate(&[&old, &extra], 2)?,
                });
            }
        }
        self.capacity = new_cap;
        Ok(())
    }

    /// Writes layer `layer`'s new keys/values `[1, kv_heads, n, head_dim]`
    /// after the live tokens and returns all live ones plus the new,
    /// `[1, kv_heads, len + n, head_dim]`.
    pub fn append_and_fetch(
        &mut self,
        layer: usize,
        keys: &Array,
        values: &Array,
    ) -> Result<(Array, Array), ModelError> {
        let at = self.len() as i32;
        let n = self.pending as i32;
        let (h, d) = (self.kv_heads, self.head_dim);
        let l = self
            .layers
            .get_mut(layer)
            .ok_or_else(|| ModelError::Cache(format!("no layer {layer}")))?;
        let write = |buf: &mut Option<Array>, new: &Array| -> Result<Array, ModelError> {
            let old = buf
                .take()
                .ok_or_else(|| ModelError::Cache("append before begin".into()))?;
            // The old handle is dropped here, so MLX can update in place.
            let updated = old.slice_update(new, &[0, 0, at, 0], &[1, h, at + n, d])?;
            let live = updated.slice(&[0, 0, 0, 0], &[1, h, at + n, d])?;
            *buf = Some(updated);
            Ok(live)
        };
        Ok((write(&mut l.keys, keys)?, write(&mut l.values, values)?))
    }

    /// Makes the tokens of the forward in flight live (`end += n`).
    pub fn commit(&mut self) {
        self.end += self.pending;
        self.pending = 0;
    }

    /// Abandons the forward in flight (its writes stay invisible).
    pub fn abort(&mut self) {
        self.pending = 0;
    }

    /// Rewinds the tail so that `end = new_end` (`start <= new_end <= end`);
    /// the dropped positions are never visible again.
    pub fn truncate_tail(&mut self, new_end: usize) -> Result<(), ModelError> {
        if new_end < self.start || new_end > self.end {
            return Err(ModelError::Cache(format!(
                "truncate to {new_end} outside [{}, {}]",
                self.start, self.end
            )));
        }
        self.end = new_end;
        Ok(())
    }

    /// Bytes of K/V storage held.
    pub fn nbytes(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| [&l.keys, &l.values])
            .flatten()
            .map(Array::nbytes)
            .sum()
    }

    /// Every layer buffer (to evaluate them with the step).
    pub fn arrays(&self) -> Vec<&Array> {
        self.layers
            .iter()
            .flat_map(|l| [&l.keys, &l.values])
            .flatten()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn append_fetch_commit_and_rewind() {
        let mut c = DenseSequenceCache::new(1, 1, 2, Dtype::Float32);
        c.begin(2).unwrap();
        let k = Array::from_f32(&[1., 2., 3., 4.], &[1, 1, 2, 2]).unwrap();
        let (kk, vv) = c.append_and_fetch(0, &k, &k).unwrap();
        assert_eq!(kk.shape(), vec![1, 1, 2, 2]);
        assert_eq!(vv.to_vec_f32().unwrap(), vec![1., 2., 3., 4.]);
        assert_eq!(c.len(), 0, "not live before commit");
        c.commit();
        assert_eq!((c.len(), c.next_position()), (2, 2));
        c.begin(1).unwrap();
        let k2 = Array::from_f32(&[5., 6.], &[1, 1, 1, 2]).unwrap();
        let (kk, _) = c.append_and_fetch(0, &k2, &k2).unwrap();
        assert_eq!(kk.to_vec_f32().unwrap(), vec![1., 2., 3., 4., 5., 6.]);
        c.commit();
        c.truncate_tail(1).unwrap();
        assert_eq!((c.len(), c.next_position()), (1, 1));
        c.begin(1).unwrap();
        let k3 = Array::from_f32(&[7., 8.], &[1, 1, 1, 2]).unwrap();
        let (kk, _) = c.append_and_fetch(0, &k3, &k3).unwrap();
        assert_eq!(
            kk.to_vec_f32().unwrap(),
            vec![1., 2., 7., 8.],
            "rewound token is gone"
        );
        c.abort();
        assert_eq!(c.len(), 1);
        assert!(c.truncate_tail(5).is_err());
    }

    #[test]
    fn grows_in_steps() {
        let mut c = DenseSequenceCache::new(2, 1, 2, Dtype::Float32);
        c.begin(DENSE_GROW_STEP + 1).unwrap();
        assert_eq!(c.nbytes(), 2 * 2 * 2 * DENSE_GROW_STEP * 2 * 4);
    }
}
