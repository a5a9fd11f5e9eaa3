//! The KV view of one forward (a *step*): the rows of the batch, each a
//! sequence whose last `new` positions were just appended, and the reads
//! and writes attention makes through it.
//!
//! Token order is *packed*: the step's new tokens are the rows' new tokens
//! concatenated in row order (`[tokens, ...]`), without padding between
//! rows. Positions come from the sequence's `[start, end)`; key counts come
//! from what a read returns (docs/architecture.md invariant 3).
//!
//! With KV groups (crate::group) every row has one `[start, end)` per
//! group (same `end`); layer `l` reads and writes through its group's pool
//! and block tables, so a window layer's key count is its group's.

use std::ops::Range;

use mlxcel_mlx::Array;

use crate::cache::KvCache;
use crate::error::KvError;
use crate::storage::PoolLayer;

/// What the attention layer needs from the KV cache during one step.
pub trait AttentionKv {
    /// Rows in the step.
    fn num_rows(&self) -> usize;

    /// Absolute positions of row `row`'s new tokens (their RoPE positions).
    fn new_positions(&self, row: usize) -> Range<usize>;

    /// Writes layer `layer`'s K/V of every row's new tokens, packed
    /// `[tokens, kv_heads, head_dim]` in row order.
    fn write(&mut self, layer: usize, keys: &Array, values: &Array) -> Result<(), KvError>;

    /// Row `row`'s live K/V (after [`AttentionKv::write`]),
    /// `[1, kv_heads, live, head_dim]`; `live` is the key count to mask with.
    fn read(&mut self, layer: usize, row: usize) -> Result<(Array, Array), KvError>;

    /// Several rows' live K/V padded to the longest,
    /// `[rows.len(), kv_heads, max_live, head_dim]`, and each row's live key
    /// count (keys past it are padding and must be masked). `None` when the
    /// backend can only read row by row.
    fn read_padded(
        &mut self,
        layer: usize,
        rows: &[usize],
    ) -> Result<Option<(Array, Array, Vec<usize>)>, KvError>;

    /// Several rows' K/V as the paged pool of layer `layer` and the rows'
    /// block tables, for attention that reads the pool itself (a
    /// paged-attention kernel): `None` when the backend has no pool (dense),
    /// or doesn't offer it.
    fn read_paged(&mut self, layer: usize, rows: &[usize]) -> Result<Option<PagedKv<'_>>, KvError> {
        let _ = (layer, rows);
        Ok(None)
    }

    /// The storage arrays to evaluate with the step's outputs (the
    /// recurrent states written too).
    fn storage(&self) -> Vec<&Array>;

    /// Row `row`'s real new tokens: the first ones of its new positions
    /// (the rest are pad tokens, rewound after the step). A recurrent layer
    /// folds only these into the state it writes.
    fn real_tokens(&self, row: usize) -> usize {
        self.new_positions(row).len()
    }

    /// Row `row`'s recurrent state of layer `layer` before its new tokens,
    /// one array per state of the layer (`[1, ...]` each, as written);
    /// `None` for the zero state of a sequence at position 0.
    ///
    /// # Errors
    /// A layer without recurrent state, or no state kept at the row's
    /// position (a rewind past what is kept).
    fn read_state(&mut self, layer: usize, row: usize) -> Result<Option<Vec<Array>>, KvError> {
        let _ = row;
        Err(KvError::Invariant(format!(
            "layer {layer} keeps no recurrent state in this cache"
        )))
    }

    /// Writes row `row`'s recurrent state of layer `layer` after its real
    /// tokens ([`AttentionKv::real_tokens`]), `[1, ...]` each.
    ///
    /// # Errors
    /// A layer without recurrent state.
    fn write_state(&mut self, layer: usize, row: usize, state: Vec<Array>) -> Result<(), KvError> {
        let _ = (row, state);
        Err(KvError::Invariant(format!(
            "layer {layer} keeps no recurrent state in this cache"
        )))
    }
}

/// One layer's paged pool and the block tables of some rows of a step (see
/// [`AttentionKv::read_paged`]).
#[derive(Debug)]
pub struct PagedKv<'a> {
    /// `[slots, kv_heads, head_dim]` as stored (float; its dtype may
    /// differ from the compute dtype, see `KvCacheDtype`), or, quantized,
    /// uint32 `[slots, kv_heads, head_dim * bits / 32]`; slot = block id *
    /// block size + offset.
    pub keys: &'a Array,
    /// As `keys`.
    pub values: &'a Array,
    /// The scales and biases of quantized pools; `None` for float ones.
    pub quantized: Option<PagedQuant<'a>>,
    /// int32 `[rows, max_blocks]`: each row's live blocks in position order
    /// (shorter rows padded with their last block, never read).
    pub tables: &'a Array,
    /// int32 `[rows, 2]`: the offset of each row's first live key in its
    /// first block, and its live key count.
    pub meta: &'a Array,
    /// Tokens per block.
    pub block_size: usize,
}

/// The quantization parameters of a quantized paged pool (MLX's affine
/// quantization: element `= q · scale + bias` per group).
#[derive(Debug)]
pub struct PagedQuant<'a> {
    /// `[slots, kv_heads, head_dim / group_size]`, compute dtype.
    pub key_scales: &'a Array,
    /// As `key_scales`.
    pub key_biases: &'a Array,
    /// As `key_scales`.
    pub value_scales: &'a Array,
    /// As `key_scales`.
    pub value_biases: &'a Array,
    /// Bits per element (8 or 4).
    pub bits: usize,
    /// Elements per scale and bias.
    pub group_size: usize,
}

impl<'a> PoolLayer<'a> {
    /// The pool with `tables` and `meta` (see [`PagedKv`]).
    pub(crate) fn paged_kv(
        self,
        tables: &'a Array,
        meta: &'a Array,
        block_size: usize,
    ) -> Result<PagedKv<'a>, KvError> {
        let (keys, values, quantized) = match (self.keys, self.values, self.quant) {
            ([k], [v], None) => (k, v, None),
            ([k, ks, kb], [v, vs, vb], Some(q)) => (
                k,
                v,
                Some(PagedQuant {
                    key_scales: ks,
                    key_biases: kb,
                    value_scales: vs,
                    value_biases: vb,
                    bits: q.bits,
                    group_size: q.group_size,
                }),
            ),
            _ => {
                return Err(KvError::Invariant(
                    "pool arrays do not match the KV dtype".into(),
                ))
            }
        };
        Ok(PagedKv {
            keys,
            values,
            quantized,
            tables,
            meta,
            block_size,
        })
    }
}

/// One row of a step.
#[derive(Debug)]
struct RowView {
    id: u64,
    /// First live position in each group.
    starts: Vec<usize>,
    end: usize,
    /// New tokens, the last positions of `[start, end)`.
    new: usize,
    /// Of them, real ones (the rest are pads).
    real: usize,
    /// Offset of the row's first new token in the packed step.
    packed_at: usize,
    /// Paged, per group: the row's live slots `[end - start]`, built on
    /// first read.
    slots: Vec<Option<Array>>,
}

/// One group's gathers and tables built during a step (paged).
#[derive(Debug, Default)]
struct GroupBuilt {
    /// Flat slots of the packed new tokens, int32 `[tokens, 1, 1]`.
    write_slots: Option<Array>,
    /// The last padded gather built (`rows`, slots, max_live).
    padded: Option<(Vec<usize>, Array, usize)>,
    /// The last block tables built (`rows`, tables, meta).
    tables: Option<(Vec<usize>, Array, Array)>,
}

/// The [`AttentionKv`] of one step over a [`KvCache`].
pub struct StepKv<'a> {
    cache: &'a mut KvCache,
    rows: Vec<RowView>,
    /// Per group (paged).
    built: Vec<GroupBuilt>,
    /// Recurrent states written during the step (evaluated with it).
    written_states: Vec<Array>,
}

impl<'a> StepKv<'a> {
    pub(crate) fn new(cache: &'a mut KvCache, rows: Vec<(u64, usize)>) -> Result<Self, KvError> {
        let mut views = Vec::with_capacity(rows.len());
        let mut packed_at = 0;
        let groups = cache.groups.len();
        for (id, new) in rows {
            let s = cache
                .seqs
                .get(&id)
                .ok_or(KvError::Invariant(format!("unknown sequence {id}")))?;
            let starts: Vec<usize> = s.blocks.iter().map(|b| b.start()).collect();
            let end = s.first().end();
            let shortest = s.blocks.iter().map(|b| b.len()).min().unwrap_or(0);
            if new == 0 || new > shortest || views.iter().any(|v: &RowView| v.id == id) {
                return Err(KvError::Invariant(format!(
                    "bad step row: sequence {id} [{:?}, {end}) with {new} new tokens",
                    starts
                )));
            }
            // A reserved step knows its real tokens; a bare view (tests)
            // has none.
            let real = match s.reserved {
                Some((old_end, real)) if old_end + new == end && real <= new => real,
                _ => new,
            };
            views.push(RowView {
                id,
                starts,
                end,
                new,
                real,
                packed_at,
                slots: (0..groups).map(|_| None).collect(),
            });
            packed_at += new;
        }
        let mut built: Vec<GroupBuilt> = (0..groups).map(|_| GroupBuilt::default()).collect();
        for (g, b) in built.iter_mut().enumerate() {
            if cache.groups[g].paged.is_some() {
                b.write_slots = Some(Self::new_token_slots(cache, g, &views, packed_at)?);
            }
        }
        Ok(StepKv {
            cache,
            rows: views,
            built,
            written_states: Vec::new(),
        })
    }

    fn new_token_slots(
        cache: &KvCache,
        group: usize,
        rows: &[RowView],
        total: usize,
    ) -> Result<Array, KvError> {
        let mut slots = Vec::with_capacity(total);
        for r in rows {
            slots.extend(Self::slots_of(cache, group, r.id, r.end - r.new..r.end)?);
        }
        Ok(Array::from_i32(&slots, &[total as i32, 1, 1])?)
    }

    /// Flat pool slot indices of positions `range` of sequence `id` in
    /// group `group`.
    fn slots_of(
        cache: &KvCache,
        group: usize,
        id: u64,
        range: Range<usize>,
    ) -> Result<Vec<i32>, KvError> {
        let s = &cache.seqs[&id].blocks[group];
        let bs = cache.config().block_size;
        range
            .map(|p| {
                s.slot_of(p)
                    .map(|slot| slot.flat_index(bs) as i32)
                    .ok_or(KvError::Invariant(format!("position {p} not live")))
            })
            .collect()
    }

    fn row(&self, row: usize) -> Result<&RowView, KvError> {
        self.rows
            .get(row)
            .ok_or(KvError::Invariant(format!("no row {row} in the step")))
    }

    /// The KV group of model layer `layer` and its index in the group.
    fn group_of(&self, layer: usize) -> Result<(usize, usize), KvError> {
        self.cache
            .layer_group
            .get(layer)
            .copied()
            .filter(|&(g, _)| g < self.cache.groups.len())
            .ok_or(KvError::Invariant(format!(
                "layer {layer} keeps no K/V in the cache"
            )))
    }

    /// The index of model layer `layer` among the recurrent layers.
    fn recurrent_of(&self, layer: usize) -> Result<usize, KvError> {
        self.cache
            .layer_recurrent
            .get(layer)
            .copied()
            .flatten()
            .ok_or(KvError::Invariant(format!(
                "layer {layer} keeps no recurrent state in the cache"
            )))
    }

    /// Live key count of row `row` in the first KV group (`end - start`).
    pub fn live_len(&self, row: usize) -> Result<usize, KvError> {
        self.group_live_len(0, row)
    }

    /// Live key count of row `row` in group `group`.
    fn group_live_len(&self, group: usize, row: usize) -> Result<usize, KvError> {
        let r = self.row(row)?;
        let start = r
            .starts
            .get(group)
            .ok_or(KvError::Invariant(format!("no KV group {group}")))?;
        Ok(r.end - start)
    }
}

impl AttentionKv for StepKv<'_> {
    fn num_rows(&self) -> usize {
        self.rows.len()
    }

    fn new_positions(&self, row: usize) -> Range<usize> {
        self.rows.get(row).map_or(0..0, |r| r.end - r.new..r.end)
    }

    fn write(&mut self, layer: usize, keys: &Array, values: &Array) -> Result<(), KvError> {
        if let Some(&source) = self.cache.kv_source.get(layer).filter(|&&s| s != layer) {
            return Err(KvError::Invariant(format!(
                "layer {layer} reads layer {source}'s K/V and writes none"
            )));
        }
        let (g, local) = self.group_of(layer)?;
        if let (Some(pool), Some(slots)) =
            (&mut self.cache.groups[g].paged, &self.built[g].write_slots)
        {
            return pool.write(local, slots, keys, values);
        }
        let (h, d) = (keys.dim(1)?, keys.dim(2)?);
        for r in &self.rows {
            let (a, n) = (r.packed_at as i32, r.new as i32);
            let part = |x: &Array| -> Result<Array, KvError> {
                Ok(x.slice(&[a, 0, 0], &[a + n, h, d])?
                    .reshape(&[1, n, h, d])?
                    .transpose(&[0, 2, 1, 3])?)
            };
            let dense = self
                .cache
                .seqs
                .get_mut(&r.id)
                .and_then(|s| s.dense.as_mut())
                .ok_or(KvError::Invariant(format!(
                    "sequence {} has no storage",
                    r.id
                )))?;
            dense.write(layer, r.end - r.new, &part(keys)?, &part(values)?)?;
        }
        Ok(())
    }

    fn read(&mut self, layer: usize, row: usize) -> Result<(Array, Array), KvError> {
        let (g, local) = self.group_of(layer)?;
        let r = self.row(row)?;
        let (id, start, end) = (r.id, r.starts[g], r.end);
        let Some(pool) = &self.cache.groups[g].paged else {
            let dense = self.cache.seqs[&id]
                .dense
                .as_ref()
                .ok_or(KvError::Invariant(format!("sequence {id} has no storage")))?;
            // A shared layer's K/V are its source's (same group, so the
            // same live range).
            let source = self.cache.kv_source.get(layer).copied().unwrap_or(layer);
            return dense.read(source, start, end);
        };
        if self.rows[row].slots[g].is_none() {
            let slots = Self::slots_of(self.cache, g, id, start..end)?;
            self.rows[row].slots[g] = Some(Array::from_i32(&slots, &[slots.len() as i32])?);
        }
        match &self.rows[row].slots[g] {
            Some(slots) => pool.gather(local, slots, 1, (end - start) as i32),
            None => Err(KvError::Invariant("row slots missing".into())),
        }
    }

    fn read_padded(
        &mut self,
        layer: usize,
        rows: &[usize],
    ) -> Result<Option<(Array, Array, Vec<usize>)>, KvError> {
        let (g, local) = self.group_of(layer)?;
        if self.cache.groups[g].paged.is_none() || rows.is_empty() {
            return Ok(None);
        }
        let lens = rows
            .iter()
            .map(|&r| self.group_live_len(g, r))
            .collect::<Result<Vec<_>, _>>()?;
        let stale = self.built[g]
            .padded
            .as_ref()
            .is_none_or(|(built, _, _)| built != rows);
        if stale {
            let max = lens.iter().copied().max().unwrap_or(0);
            let mut slots = Vec::with_capacity(rows.len() * max);
            for &row in rows {
                let r = self.row(row)?;
                let mut own = Self::slots_of(self.cache, g, r.id, r.starts[g]..r.end)?;
                // Pad with the row's own first slot: finite values, masked out.
                let fill = own[0];
                own.resize(max, fill);
                slots.extend(own);
            }
            let arr = Array::from_i32(&slots, &[slots.len() as i32])?;
            self.built[g].padded = Some((rows.to_vec(), arr, max));
        }
        match (&self.built[g].padded, &self.cache.groups[g].paged) {
            (Some((_, slots, max)), Some(pool)) => {
                let (k, v) = pool.gather(local, slots, rows.len() as i32, *max as i32)?;
                Ok(Some((k, v, lens)))
            }
            _ => Ok(None),
        }
    }

    fn read_paged(&mut self, layer: usize, rows: &[usize]) -> Result<Option<PagedKv<'_>>, KvError> {
        let (g, local) = self.group_of(layer)?;
        if self.cache.groups[g].paged.is_none() || rows.is_empty() {
            return Ok(None);
        }
        let stale = self.built[g]
            .tables
            .as_ref()
            .is_none_or(|(built, _, _)| built != rows);
        if stale {
            let mut tables: Vec<Vec<i32>> = Vec::with_capacity(rows.len());
            let mut meta = Vec::with_capacity(rows.len() * 2);
            for &row in rows {
                let r = self.row(row)?;
                let s = &self.cache.seqs[&r.id].blocks[g];
                let bs = s.block_size();
                let start = r.starts[g];
                // The view's [start, end) is the sequence's now.
                if (s.start(), s.end()) != (start, r.end) || r.end == start {
                    return Err(KvError::Invariant(format!(
                        "row {row}: view [{start}, {}) vs sequence [{}, {})",
                        r.end,
                        s.start(),
                        s.end()
                    )));
                }
                tables.push(s.blocks().iter().map(|b| b.index() as i32).collect());
                meta.push((start % bs) as i32);
                meta.push((r.end - start) as i32);
            }
            let width = tables.iter().map(Vec::len).max().unwrap_or(1).max(1);
            let mut flat = Vec::with_capacity(rows.len() * width);
            for mut t in tables {
                let fill = t.last().copied().unwrap_or(0);
                t.resize(width, fill);
                flat.extend(t);
            }
            let n = rows.len() as i32;
            let tables = Array::from_i32(&flat, &[n, width as i32])?;
            let meta = Array::from_i32(&meta, &[n, 2])?;
            self.built[g].tables = Some((rows.to_vec(), tables, meta));
        }
        match (&self.built[g].tables, &self.cache.groups[g].paged) {
            (Some((_, tables, meta)), Some(pool)) => Ok(Some(pool.layer(local)?.paged_kv(
                tables,
                meta,
                self.cache.config().block_size,
            )?)),
            _ => Ok(None),
        }
    }

    fn storage(&self) -> Vec<&Array> {
        let mut out: Vec<&Array> = self.written_states.iter().collect();
        if self.cache.groups.iter().any(|g| g.paged.is_some()) {
            out.extend(
                self.cache
                    .groups
                    .iter()
                    .filter_map(|g| g.paged.as_ref())
                    .flat_map(|p| p.arrays()),
            );
            return out;
        }
        out.extend(
            self.rows
                .iter()
                .filter_map(|r| self.cache.seqs.get(&r.id))
                .filter_map(|s| s.dense.as_ref())
                .flat_map(|d| d.arrays()),
        );
        out
    }

    fn real_tokens(&self, row: usize) -> usize {
        self.rows.get(row).map_or(0, |r| r.real)
    }

    fn read_state(&mut self, layer: usize, row: usize) -> Result<Option<Vec<Array>>, KvError> {
        let index = self.recurrent_of(layer)?;
        let r = self.row(row)?;
        let at = r.end - r.new;
        let seq = self
            .cache
            .seqs
            .get(&r.id)
            .ok_or(KvError::Invariant(format!("unknown sequence {}", r.id)))?;
        match seq.recurrent.at(at).and_then(|e| e.layers[index].as_ref()) {
            Some(state) => Ok(Some(state.as_ref().clone())),
            None if at == 0 => Ok(None),
            None => Err(KvError::Invariant(format!(
                "sequence {}: no recurrent state of layer {layer} at position {at}",
                r.id
            ))),
        }
    }

    fn write_state(&mut self, layer: usize, row: usize, state: Vec<Array>) -> Result<(), KvError> {
        let index = self.recurrent_of(layer)?;
        let layers = self.cache.recurrent.layers.len();
        let r = self.row(row)?;
        let (id, at, chunk) = (r.id, r.end - r.new + r.real, r.real > 1);
        let seq = self
            .cache
            .seqs
            .get_mut(&id)
            .ok_or(KvError::Invariant(format!("unknown sequence {id}")))?;
        self.written_states.extend(state.iter().cloned());
        seq.recurrent.at_mut(at, layers, chunk).layers[index] = Some(std::rc::Rc::new(state));
        Ok(())
    }
}
