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

/// How K/V are stored in the cache (`--kv-cache-dtype`): as the model
/// computes them, cast to another float type, or quantized with MLX's
/// affine quantizer (`w ≈ q · scale + bias`, one float scale and bias per
/// [`KvQuant::group_size`] elements of a head, in the compute dtype;
/// mlx_lm's `QuantizedKVCache` keeps the same). Attention reads
/// quantized blocks through the paged-attention kernel, which dequantizes
/// as it reads, or dequantizes the gathered rows (CPU, prefill).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KvCacheDtype {
    /// The model's compute dtype.
    #[default]
    Auto,
    /// IEEE half precision.
    Float16,
    /// bfloat16.
    Bfloat16,
    /// float32.
    Float32,
    /// 8-bit affine quantization.
    Int8,
    /// 4-bit affine quantization.
    Int4,
}

impl KvCacheDtype {
    /// Every value, in the order the command line lists them.
    pub const ALL: [KvCacheDtype; 6] = [
        KvCacheDtype::Auto,
        KvCacheDtype::Float16,
        KvCacheDtype::Bfloat16,
        KvCacheDtype::Float32,
        KvCacheDtype::Int8,
        KvCacheDtype::Int4,
    ];

    /// The name on the command line and in `/v1/cache/stats`.
    pub fn name(self) -> &'static str {
        match self {
            KvCacheDtype::Auto => "auto",
            KvCacheDtype::Float16 => "float16",
            KvCacheDtype::Bfloat16 => "bfloat16",
            KvCacheDtype::Float32 => "float32",
            KvCacheDtype::Int8 => "int8",
            KvCacheDtype::Int4 => "int4",
        }
    }

    /// Bits per quantized element; `None` for float storage.
    pub fn bits(self) -> Option<usize> {
        match self {
            KvCacheDtype::Int8 => Some(8),
            KvCacheDtype::Int4 => Some(4),
            _ => None,
        }
    }

    /// The float dtype K/V are stored in when not quantized, for a model
    /// computing in `compute`.
    pub fn float_dtype(self, compute: Dtype) -> Dtype {
        match self {
            KvCacheDtype::Float16 => Dtype::Float16,
            KvCacheDtype::Bfloat16 => Dtype::Bfloat16,
            KvCacheDtype::Float32 => Dtype::Float32,
            _ => compute,
        }
    }
}

impl std::fmt::Display for KvCacheDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for KvCacheDtype {
    type Err = String;

    /// Parses a [`KvCacheDtype::name`] (also `fp16`, `bf16`, `fp32`, `q8`,
    /// `q4`).
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "auto" => KvCacheDtype::Auto,
            "float16" | "fp16" | "f16" => KvCacheDtype::Float16,
            "bfloat16" | "bf16" => KvCacheDtype::Bfloat16,
            "float32" | "fp32" | "f32" => KvCacheDtype::Float32,
            "int8" | "q8" => KvCacheDtype::Int8,
            "int4" | "q4" => KvCacheDtype::Int4,
            other => {
                return Err(format!(
                "unknown KV cache dtype {other:?} (auto, float16, bfloat16, float32, int8, int4)"
            ))
            }
        })
    }
}

/// The quantization of K/V blocks ([`KvCacheDtype::Int8`], [`KvCacheDtype::Int4`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvQuant {
    /// Bits per element (8 or 4); `32 / bits` elements per uint32 word,
    /// the first in the lowest bits.
    pub bits: usize,
    /// Elements of a head sharing one scale and bias: 64 (mlx_lm's
    /// `kv_group_size`), or 32 when `head_dim` is not a multiple of 64.
    pub group_size: usize,
}

/// The shape of one token's K/V across the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    /// Transformer layers.
    pub layers: usize,
    /// K/V heads per layer.
    pub kv_heads: usize,
    /// Features per head.
    pub head_dim: usize,
    /// Element type K/V are computed (and read) in.
    pub dtype: Dtype,
    /// How they are stored.
    pub kv_dtype: KvCacheDtype,
}

impl KvLayout {
    /// Bytes of K and V of one token over all layers, as stored.
    pub fn bytes_per_token(&self) -> usize {
        2 * self.layers * self.kv_heads * self.bytes_per_head()
    }

    /// Bytes of one token's K (or V) in one head, as stored: the packed
    /// elements plus a scale and a bias per group when quantized.
    pub fn bytes_per_head(&self) -> usize {
        let d = self.head_dim;
        match self.quant() {
            Some(q) => d * q.bits / 8 + 2 * (d / q.group_size) * self.dtype.size_bytes(),
            None => d * self.stored_dtype().size_bytes(),
        }
    }

    /// The name of how K/V are stored, `auto` resolved: `float16`, `int8`...
    pub fn kv_dtype_name(&self) -> String {
        match self.kv_dtype {
            KvCacheDtype::Auto => match self.dtype {
                Dtype::Float16 => "float16".into(),
                Dtype::Bfloat16 => "bfloat16".into(),
                Dtype::Float32 => "float32".into(),
                other => format!("{other:?}").to_lowercase(),
            },
            d => d.name().into(),
        }
    }

    /// The dtype of the stored K/V data: uint32 words when quantized.
    pub fn stored_dtype(&self) -> Dtype {
        match self.kv_dtype.bits() {
            Some(_) => Dtype::Uint32,
            None => self.kv_dtype.float_dtype(self.dtype),
        }
    }

    /// The quantization, `None` for float storage (or a head size the
    /// quantizer can't split: see [`KvLayout::check`]).
    pub fn quant(&self) -> Option<KvQuant> {
        let bits = self.kv_dtype.bits()?;
        let group_size = [64, 32]
            .into_iter()
            .find(|g| self.head_dim.is_multiple_of(*g))?;
        Some(KvQuant { bits, group_size })
    }

    /// Checks that K/V of this shape can be stored as asked.
    ///
    /// # Errors
    /// [`KvError::Config`] for a quantized dtype with `head_dim` not a
    /// multiple of 32.
    pub fn check(&self) -> Result<(), KvError> {
        if self.kv_dtype.bits().is_some() && self.quant().is_none() {
            return Err(KvError::Config(format!(
                "--kv-cache-dtype {} quantizes heads in groups of 32 or 64 features; \
                 this model's heads have {}",
                self.kv_dtype, self.head_dim
            )));
        }
        Ok(())
    }

    /// Checks that dense (per-sequence) buffers can store K/V as asked.
    ///
    /// # Errors
    /// [`KvError::Config`] for a quantized dtype: quantized blocks live in
    /// the paged pool only.
    pub fn check_dense(&self) -> Result<(), KvError> {
        if self.kv_dtype.bits().is_some() {
            return Err(KvError::Config(format!(
                "--kv-cache-dtype {} needs paged KV storage (--decode-storage-backend paged)",
                self.kv_dtype
            )));
        }
        Ok(())
    }

    /// Per stored array of one token and head (K data, then its scales and
    /// biases when quantized): its last dimension and dtype.
    pub(crate) fn stored_parts(&self) -> Vec<(i32, Dtype)> {
        let d = self.head_dim;
        match self.quant() {
            Some(q) => vec![
                ((d * q.bits / 32) as i32, Dtype::Uint32),
                ((d / q.group_size) as i32, self.dtype),
                ((d / q.group_size) as i32, self.dtype),
            ],
            None => vec![(d as i32, self.stored_dtype())],
        }
    }

    fn dims(&self) -> (i32, i32) {
        (self.kv_heads as i32, self.head_dim as i32)
    }

    /// `x` (computed K or V, `[..., head_dim]`) as stored: cast, or
    /// quantized into `[data, scales, biases]` along the last axis.
    fn encode(&self, x: &Array) -> Result<Vec<Array>, KvError> {
        Ok(match self.quant() {
            Some(q) => {
                let (w, s, b) = x.quantize(q.group_size as i32, q.bits as i32)?;
                vec![w, s, b]
            }
            None if x.dtype() == self.stored_dtype() => vec![x.clone()],
            None => vec![x.astype(self.stored_dtype())?],
        })
    }

    /// Stored `parts` (as [`KvLayout::encode`] returns) back to the
    /// compute dtype.
    fn decode(&self, parts: &[Array]) -> Result<Array, KvError> {
        match (self.quant(), parts) {
            (Some(q), [w, s, b]) => Ok(w.dequantize(s, b, q.group_size as i32, q.bits as i32)?),
            (None, [x]) if x.dtype() == self.dtype => Ok(x.clone()),
            (None, [x]) => Ok(x.astype(self.dtype)?),
            _ => Err(KvError::Invariant(format!(
                "{} stored K/V arrays for {}",
                parts.len(),
                self.kv_dtype
            ))),
        }
    }
}

/// One layer's K or V in a paged pool: `[slots, kv_heads, x]` arrays, the
/// data and, when quantized, its scales and biases (see
/// [`KvLayout::encode`]).
type Stored = Vec<Array>;

/// Per-layer pool arrays of the paged backend.
#[derive(Debug)]
pub(crate) struct PagedStorage {
    /// `[layer] -> [data, (scales, biases)]`, each `[slots, kv_heads, x]`.
    keys: Vec<Stored>,
    values: Vec<Stored>,
    block_size: usize,
    layout: KvLayout,
}

/// One layer's pool arrays, as [`PagedStorage::layer`] lends them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PoolLayer<'a> {
    /// K: `[data]`, or `[data, scales, biases]` when quantized.
    pub(crate) keys: &'a [Array],
    /// V, as `keys`.
    pub(crate) values: &'a [Array],
    pub(crate) quant: Option<KvQuant>,
}

impl PagedStorage {
    /// Allocates and zero-fills `slots = num_blocks * block_size` token rows
    /// per layer (evaluated now, so a budget that doesn't fit fails at start).
    pub(crate) fn new(
        layout: KvLayout,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<Self, KvError> {
        layout.check()?;
        let slots = i32::try_from(num_blocks * block_size)
            .map_err(|_| KvError::TooManyBlocks(num_blocks))?;
        let h = layout.kv_heads as i32;
        let mut keys = Vec::with_capacity(layout.layers);
        let mut values = Vec::with_capacity(layout.layers);
        for _ in 0..layout.layers {
            let alloc = || -> Result<Stored, KvError> {
                layout
                    .stored_parts()
                    .into_iter()
                    .map(|(x, dtype)| Ok(zeros(&[slots, h, x], dtype)?))
                    .collect()
            };
            let (k, v) = (alloc()?, alloc()?);
            let all: Vec<&Array> = k.iter().chain(&v).collect();
            mlxcel_mlx::eval(&all)?;
            keys.push(k);
            values.push(v);
        }
        Ok(PagedStorage {
            keys,
            values,
            block_size,
            layout,
        })
    }

    /// Writes packed new K/V `[tokens, kv_heads, head_dim]` (compute dtype)
    /// of layer `layer` into `slots` (int32 `[tokens, 1, 1]`, distinct flat
    /// slot indices), stored as the layout says.
    pub(crate) fn write(
        &mut self,
        layer: usize,
        slots: &Array,
        keys: &Array,
        values: &Array,
    ) -> Result<(), KvError> {
        let (k, v) = (self.layout.encode(keys)?, self.layout.encode(values)?);
        self.write_stored(layer, slots, &k, &v)
    }

    /// Writes already stored parts (as [`KvLayout::encode`] returns, each
    /// `[tokens, kv_heads, x]`) of layer `layer` into `slots`.
    pub(crate) fn write_stored(
        &mut self,
        layer: usize,
        slots: &Array,
        keys: &[Array],
        values: &[Array],
    ) -> Result<(), KvError> {
        let (pk, pv) = self.layer_mut(layer)?;
        for (pool, new) in [(pk, keys), (pv, values)] {
            if pool.len() != new.len() {
                return Err(KvError::Invariant(format!(
                    "{} stored parts written into a pool of {}",
                    new.len(),
                    pool.len()
                )));
            }
            for (p, n) in pool.iter_mut().zip(new) {
                // MLX's scatter would broadcast the pool to a wider value
                // (e.g. more heads) instead of failing.
                if n.shape().len() != 3 || n.dim(1)? != p.dim(1)? || n.dim(2)? != p.dim(2)? {
                    return Err(KvError::Invariant(format!(
                        "K/V of shape {:?} written into a pool of {:?}",
                        n.shape(),
                        p.shape()
                    )));
                }
                // Replace the handle so that the graph node holds the only
                // reference to the old buffer: MLX then donates it
                // (in-place write).
                *p = p.put_along_axis(slots, n, 0)?;
            }
        }
        Ok(())
    }

    /// Gathers layer `layer`'s K/V at `slots` (int32 `[rows * len]`) as
    /// `[rows, kv_heads, len, head_dim]` in the compute dtype (dequantized
    /// or cast back when stored otherwise).
    pub(crate) fn gather(
        &self,
        layer: usize,
        slots: &Array,
        rows: i32,
        len: i32,
    ) -> Result<(Array, Array), KvError> {
        let (k, v) = self.layer_stored(layer)?;
        let (h, d) = self.layout.dims();
        let pick = |parts: &[Array]| -> Result<Array, KvError> {
            let taken = parts
                .iter()
                .map(|a| a.take(slots, 0))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(self
                .layout
                .decode(&taken)?
                .reshape(&[rows, len, h, d])?
                .transpose(&[0, 2, 1, 3])?)
        };
        Ok((pick(k)?, pick(v)?))
    }

    /// The stored parts of layer `layer` at `slots` (int32 `[n]`), K then
    /// V, each `[n, kv_heads, x]` (for the disk tier).
    pub(crate) fn take_stored(&self, layer: usize, slots: &Array) -> Result<Vec<Array>, KvError> {
        let (k, v) = self.layer_stored(layer)?;
        Ok(k.iter()
            .chain(v)
            .map(|a| a.take(slots, 0))
            .collect::<Result<Vec<_>, _>>()?)
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
        let pools = || self.keys.iter().chain(self.values.iter()).flatten();
        let parts = pools()
            .map(|a| a.take(&src, 0))
            .collect::<Result<Vec<_>, _>>()?;
        // The slots are read before any pool is written: a scatter whose
        // pool a pending read still holds cannot write in place, and on
        // the CPU (where a queued read keeps its input) each copy-on-write
        // then copied every layer's whole pool (measured: 20-choice
        // requests on a 32 MiB pool ran 9x slower than now).
        mlxcel_mlx::eval(&parts.iter().collect::<Vec<_>>())?;
        let pools = self.keys.iter_mut().chain(self.values.iter_mut()).flatten();
        for (a, part) in pools.zip(&parts) {
            *a = a.put_along_axis(&dst, part, 0)?;
        }
        Ok(())
    }

    /// Layer `layer`'s key and value pools.
    pub(crate) fn layer(&self, layer: usize) -> Result<PoolLayer<'_>, KvError> {
        let (keys, values) = self.layer_stored(layer)?;
        Ok(PoolLayer {
            keys,
            values,
            quant: self.layout.quant(),
        })
    }

    fn layer_stored(&self, layer: usize) -> Result<(&[Array], &[Array]), KvError> {
        match (self.keys.get(layer), self.values.get(layer)) {
            (Some(k), Some(v)) => Ok((k, v)),
            _ => Err(KvError::Invariant(format!("no layer {layer} in the pool"))),
        }
    }

    fn layer_mut(&mut self, layer: usize) -> Result<(&mut Stored, &mut Stored), KvError> {
        match (self.keys.get_mut(layer), self.values.get_mut(layer)) {
            (Some(k), Some(v)) => Ok((k, v)),
            _ => Err(KvError::Invariant(format!("no layer {layer} in the pool"))),
        }
    }

    pub(crate) fn arrays(&self) -> impl Iterator<Item = &Array> {
        self.keys.iter().chain(self.values.iter()).flatten()
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
    /// Empty buffers for `layout` (float storage only: the cache refuses
    /// a quantized dense layout, see [`KvLayout::check_dense`]).
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
            let fresh = zeros(&extra, self.layout.stored_dtype())?;
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
            let new = &self.layout.encode(new)?[0];
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
            self.layout
                .decode(&[arr.slice(&[0, 0, a, 0], &[1, h, b, d])?])
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
