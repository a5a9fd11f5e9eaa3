//! The tensor side of the KV cache: where K/V live in MLX arrays, for the
//! two backends that share one bookkeeping (`SequenceBlocks` positions).
//!
//! - **Paged**: per layer, one key and one value array
//!   `[total_blocks * block_size, kv_heads, head_dim]` (a *slot* per token
//!   row). Writes scatter the step's new tokens into their slots with one
//!   `put_along_axis` per array; reads gather a row's slots with `take`. The
//!   arrays are updated in place (the cache holds the only handle), so a
//!   write costs O(new tokens), not O(pool).
//! - **Dense**: per sequence and layer, contiguous `[1, kv_heads, capacity,
//!   head_dim]` buffers (as mlx_lm's `KVCache`), grown in
//!   [`DENSE_GROW_STEP`]-token steps; buffer row `i` holds position
//!   `base + i`. Reads are slices.

use mlxcel_mlx::{zeros, Array, Dtype};

use crate::error::KvError;
use crate::sequence::BlockCopy;

/// Tokens by which a dense buffer grows (as mlx_lm's `KVCache.step`).
pub const DENSE_GROW_STEP: usize = 256;

/// The shape of one token's K/V across the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    /// Transformer layers.
    pub layers: usize,
    /// K/V heads per layer.
    pub kv_heads: usize,
    /// Features per head.
    pub head_dim: usize,
    /// Element type of K/V.
    pub dtype: Dtype,
}

impl KvLayout {
    /// Bytes of K and V of one token over all layers.
    pub fn bytes_per_token(&self) -> usize {
        2 * self.layers * self.kv_heads * self.head_dim * self.dtype.size_bytes()
    }

    fn dims(&self) -> (i32, i32) {
        (self.kv_heads as i32, self.head_dim as i32)
    }
}

/// Per-layer pool arrays of the paged backend.
#[derive(Debug)]
pub(crate) struct PagedStorage {
    /// `[layer] -> [slots, kv_heads, head_dim]`.
    keys: Vec<Array>,
    values: Vec<Array>,
    block_size: usize,
}

impl PagedStorage {
    /// Allocates and zero-fills `slots = num_blocks * block_size` token rows
    /// per layer (evaluated now, so a budget that doesn't fit fails at start).
    pub(crate) fn new(
        layout: KvLayout,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<Self, KvError> {
        let slots = i32::try_from(num_blocks * block_size)
            .map_err(|_| KvError::TooManyBlocks(num_blocks))?;
        let (h, d) = layout.dims();
        let mut keys = Vec::with_capacity(layout.layers);
        let mut values = Vec::with_capacity(layout.layers);
        for _ in 0..layout.layers {
            let (k, v) = (
                zeros(&[slots, h, d], layout.dtype)?,
                zeros(&[slots, h, d], layout.dtype)?,
            );
            mlxcel_mlx::eval(&[&k, &v])?;
            keys.push(k);
            values.push(v);
        }
        Ok(PagedStorage {
            keys,
            values,
            block_size,
        })
    }

    /// Writes packed new K/V `[tokens, kv_heads, head_dim]` of layer `layer`
    /// into `slots` (int32 `[tokens, 1, 1]`, distinct flat slot indices).
    pub(crate) fn write(
        &mut self,
        layer: usize,
        slots: &Array,
        keys: &Array,
        values: &Array,
    ) -> Result<(), KvError> {
        let (k, v) = self.layer_mut(layer)?;
        // Replace the handle so that the graph node holds the only reference
        // to the old buffer: MLX then donates it (in-place write).
        *k = k.put_along_axis(slots, keys, 0)?;
        *v = v.put_along_axis(slots, values, 0)?;
        Ok(())
    }

    /// Gathers layer `layer`'s K/V at `slots` (int32 `[rows * len]`) as
    /// `[rows, kv_heads, len, head_dim]`.
    pub(crate) fn gather(
        &self,
        layer: usize,
        slots: &Array,
        rows: i32,
        len: i32,
    ) -> Result<(Array, Array), KvError> {
        let k = self
            .keys
            .get(layer)
            .ok_or(KvError::Invariant(format!("no layer {layer} in the pool")))?;
        let v = &self.values[layer];
        let (h, d) = (k.dim(1)?, k.dim(2)?);
        let pick = |a: &Array| -> Result<Array, KvError> {
            Ok(a.take(slots, 0)?
                .reshape(&[rows, len, h, d])?
                .transpose(&[0, 2, 1, 3])?)
        };
        Ok((pick(k)?, pick(v)?))
    }

    /// Copies the first `copy.tokens` slots of block `copy.src` into
    /// `copy.dst` in every layer (copy-on-write of a shared partial block).
    pub(crate) fn copy_block(&mut self, copy: BlockCopy) -> Result<(), KvError> {
        let bs = self.block_size;
        let src: Vec<i32> = (0..copy.tokens)
            .map(|i| (copy.src.index() * bs + i) as i32)
            .collect();
        let dst: Vec<i32> = (0..copy.tokens)
            .map(|i| (copy.dst.index() * bs + i) as i32)
            .collect();
        let n = copy.tokens as i32;
        let src = Array::from_i32(&src, &[n])?;
        let dst = Array::from_i32(&dst, &[n, 1, 1])?;
        for layer in 0..self.keys.len() {
            let (k, v) = self.layer_mut(layer)?;
            let (ks, vs) = (k.take(&src, 0)?, v.take(&src, 0)?);
            *k = k.put_along_axis(&dst, &ks, 0)?;
            *v = v.put_along_axis(&dst, &vs, 0)?;
        }
        Ok(())
    }

    /// Layer `layer`'s key and value pools.
    pub(crate) fn layer(&self, layer: usize) -> Result<(&Array, &Array), KvError> {
        match (self.keys.get(layer), self.values.get(layer)) {
            (Some(k), Some(v)) => Ok((k, v)),
            _ => Err(KvError::Invariant(format!("no layer {layer} in the pool"))),
        }
    }

    fn layer_mut(&mut self, layer: usize) -> Result<(&mut Array, &mut Array), KvError> {
        match (self.keys.get_mut(layer), self.values.get_mut(layer)) {
            (Some(k), Some(v)) => Ok((k, v)),
            _ => Err(KvError::Invariant(format!("no layer {layer} in the pool"))),
        }
    }

    pub(crate) fn arrays(&self) -> impl Iterator<Item = &Array> {
        self.keys.iter().chain(self.values.iter())
    }
}

/// One sequence's contiguous K/V buffers (dense backend). A clone shares
/// the MLX buffers; MLX copies a buffer on the first write while it is
/// shared (it updates in place only when it holds the only reference).
#[derive(Debug, Clone)]
pub(crate) struct DenseStorage {
    /// `[layer] -> [1, kv_heads, capacity, head_dim]`; `None` before the
    /// first write.
    keys: Vec<Option<Array>>,
    values: Vec<Option<Array>>,
    /// Absolute position of buffer row 0.
    base: usize,
    /// Token rows allocated per buffer.
    capacity: usize,
    layout: KvLayout,
    /// Layers that keep no K/V (recurrent ones): never allocated.
    skip: Vec<bool>,
}

impl DenseStorage {
    pub(crate) fn new(layout: KvLayout, base: usize) -> Self {
        DenseStorage {
            keys: (0..layout.layers).map(|_| None).collect(),
            values: (0..layout.layers).map(|_| None).collect(),
            base,
            capacity: 0,
            skip: vec![false; layout.layers],
            layout,
        }
    }

    /// The storage with `layers` (recurrent ones) left unallocated.
    pub(crate) fn without(mut self, layers: &[usize]) -> Self {
        for &l in layers {
            if let Some(s) = self.skip.get_mut(l) {
                *s = true;
            }
        }
        self
    }

    /// Makes room for positions up to `end` (exclusive), given that the
    /// sequence's live range starts at `start`. Compacts the front first
    /// when at least [`DENSE_GROW_STEP`] dropped rows sit before `start`.
    pub(crate) fn reserve(&mut self, start: usize, end: usize) -> Result<(), KvError> {
        if start >= self.base + DENSE_GROW_STEP {
            self.compact(start)?;
        }
        let need = end - self.base;
        if need <= self.capacity {
            return Ok(());
        }
        let new_cap = need.div_ceil(DENSE_GROW_STEP) * DENSE_GROW_STEP;
        let (h, d) = self.layout.dims();
        let extra = [1, h, (new_cap - self.capacity) as i32, d];
        let skip = self.skip.iter().chain(self.skip.iter());
        for (buf, _) in self
            .keys
            .iter_mut()
            .chain(self.values.iter_mut())
            .zip(skip)
            .filter(|(_, &s)| !s)
        {
            let fresh = zeros(&extra, self.layout.dtype)?;
            *buf = Some(match buf.take() {
                None => fresh,
                Some(old) => mlxcel_mlx::concatenate(&[&old, &fresh], 2)?,
            });
        }
        self.capacity = new_cap;
        Ok(())
    }

    /// Drops buffer rows before `start` (amortized: called once per
    /// [`DENSE_GROW_STEP`] dropped positions).
    fn compact(&mut self, start: usize) -> Result<(), KvError> {
        let drop = (start - self.base) as i32;
        let (h, d, cap) = (
            self.layout.kv_heads as i32,
            self.layout.head_dim as i32,
            self.capacity as i32,
        );
        for buf in self.keys.iter_mut().chain(self.values.iter_mut()) {
            if let Some(old) = buf.take() {
                *buf = Some(old.slice(&[0, 0, drop, 0], &[1, h, cap, d])?);
            }
        }
        self.capacity -= drop as usize;
        self.base = start;
        Ok(())
    }

    /// Writes `keys`/`values` `[1, kv_heads, n, head_dim]` at absolute
    /// positions `[at, at + n)` (reserved by [`DenseStorage::reserve`]).
    pub(crate) fn write(
        &mut self,
        layer: usize,
        at: usize,
        keys: &Array,
        values: &Array,
    ) -> Result<(), KvError> {
        let n = keys.dim(2)?;
        let row = (at - self.base) as i32;
        let (h, d) = self.layout.dims();
        if row as usize + n as usize > self.capacity {
            return Err(KvError::Invariant(format!(
                "dense write of {n} tokens at row {row} past capacity {}",
                self.capacity
            )));
        }
        for (buf, new) in [
            (self.keys.get_mut(layer), keys),
            (self.values.get_mut(layer), values),
        ] {
            let slot = buf.ok_or(KvError::Invariant(format!("no layer {layer}")))?;
            let old = slot
                .take()
                .ok_or(KvError::Invariant("dense write before reserve".into()))?;
            // `old` is moved into the node: MLX may update in place.
            *slot = Some(old.slice_update(new, &[0, 0, row, 0], &[1, h, row + n, d])?);
        }
        Ok(())
    }

    /// Live K/V of positions `[start, end)`, `[1, kv_heads, end - start, head_dim]`.
    pub(crate) fn read(
        &self,
        layer: usize,
        start: usize,
        end: usize,
    ) -> Result<(Array, Array), KvError> {
        let (h, d) = self.layout.dims();
        let (a, b) = ((start - self.base) as i32, (end - self.base) as i32);
        let read = |buf: Option<&Option<Array>>| -> Result<Array, KvError> {
            let arr = buf
                .and_then(Option::as_ref)
                .ok_or(KvError::Invariant(format!(
                    "dense read of empty layer {layer}"
                )))?;
            Ok(arr.slice(&[0, 0, a, 0], &[1, h, b, d])?)
        };
        Ok((read(self.keys.get(layer))?, read(self.values.get(layer))?))
    }

    pub(crate) fn arrays(&self) -> impl Iterator<Item = &Array> {
        self.keys.iter().chain(self.values.iter()).flatten()
    }

    /// Checks that the buffers hold positions `[start, end)`.
    pub(crate) fn check_covers(&self, start: usize, end: usize) -> Result<(), KvError> {
        if start < self.base || end > self.base + self.capacity {
            return Err(KvError::Invariant(format!(
                "dense buffers hold [{}, {}), sequence is [{start}, {end})",
                self.base,
                self.base + self.capacity
            )));
        }
        Ok(())
    }
}
