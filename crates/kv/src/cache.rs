//! The KV cache the engine owns: the block pool, every sequence's positions
//! and block table, and the tensors behind them (paged or dense).
//!
//! Both backends keep a sequence's positions in one [`SequenceBlocks`]
//! (docs/architecture.md invariant 1): the dense backend allocates pool blocks
//! too, for the budget, but stores K/V in per-sequence buffers. Growing is
//! [`KvCache::append`]; shrinking is [`KvCache::truncate_tail`] and
//! [`KvCache::drop_front`], one function per direction for both backends.
//!
//! A sequence is held through an opaque [`KvSequence`]; dropping it gives
//! its blocks back at the cache's next [`KvCache::reclaim`] (the engine calls
//! it at every step), so a request that ends in any way (finished, failed,
//! cancelled, or unwound by a panic) cannot leak blocks.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::rc::Rc;

use crate::error::KvError;
use crate::hash::BlockHash;
use crate::pool::BlockPool;
use crate::prefix::{PrefixCache, PrefixCacheStats};
use crate::sequence::{BlockCopy, SequenceBlocks};
use crate::step::StepKv;
use crate::storage::{DenseStorage, KvLayout, PagedStorage};

/// Where K/V tensors live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StorageBackend {
    /// Contiguous buffers per sequence (reads are slices).
    Dense,
    /// One pool of fixed-size blocks per layer (reads gather a row's slots).
    Paged,
}

impl fmt::Display for StorageBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StorageBackend::Dense => "dense",
            StorageBackend::Paged => "paged",
        })
    }
}

/// How to build a [`KvCache`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCacheConfig {
    /// Per-token K/V shape of the model.
    pub layout: KvLayout,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the pool (the budget: `num_blocks * block_size` tokens).
    pub num_blocks: usize,
    /// Tensor storage.
    pub backend: StorageBackend,
    /// The prefix cache; `None` disables it (it needs paged storage).
    pub prefix: Option<PrefixCacheConfig>,
}

/// Prefix-cache options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixCacheConfig {
    /// Identity of what produced the K/V (model, dtype), mixed into every
    /// block hash so entries never cross models.
    pub extra_key: u64,
    /// Most unreferenced cached blocks kept; older ones are evicted first.
    pub capacity_blocks: usize,
}

/// What a prefix-cache reset freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ResetOutcome {
    /// Cached blocks nobody held, now empty.
    pub blocks_freed: usize,
    /// Their size in bytes.
    pub bytes_freed: usize,
}

impl KvCacheConfig {
    /// Blocks that fit in `budget_bytes` for `layout` and `block_size`.
    pub fn blocks_for_budget(layout: KvLayout, block_size: usize, budget_bytes: usize) -> usize {
        budget_bytes / (layout.bytes_per_token() * block_size).max(1)
    }
}

/// One row of [`KvCache::reserve_step`]: `real` tokens padded to `padded`.
#[derive(Debug, Clone, Copy)]
pub struct RowReserve<'a> {
    /// The sequence.
    pub seq: &'a KvSequence,
    /// Real tokens of the row (at least 1).
    pub real: usize,
    /// Tokens the forward writes: `real` plus pad tokens after them.
    pub padded: usize,
}

/// A reserved step: each row's sequence end before the step and its real
/// token count. Hand it back with [`KvCache::complete_step`].
#[derive(Debug)]
#[must_use = "a reserved step must be completed"]
pub struct StepReservation {
    rows: Vec<(u64, usize, usize)>,
}

/// An opaque handle on one sequence's KV. Dropping it releases the
/// sequence; its blocks return to the pool at the next [`KvCache::reclaim`].
pub struct KvSequence {
    id: u64,
    released: Rc<RefCell<Vec<u64>>>,
}

impl fmt::Debug for KvSequence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KvSequence({})", self.id)
    }
}

impl Drop for KvSequence {
    fn drop(&mut self) {
        self.released.borrow_mut().push(self.id);
    }
}

/// One sequence's bookkeeping and (dense backend) storage.
#[derive(Debug)]
pub(crate) struct SeqState {
    pub(crate) blocks: SequenceBlocks,
    pub(crate) dense: Option<DenseStorage>,
    /// Chained hashes of its full blocks from position 0 (prefix cache).
    hashes: Vec<BlockHash>,
    /// A tensor-side failure may have left its K/V half-updated (a block
    /// copy, a buffer resize): it can't run again and only awaits release.
    poisoned: bool,
}

/// The engine's KV cache; see the module docs.
#[derive(Debug)]
pub struct KvCache {
    config: KvCacheConfig,
    pub(crate) pool: BlockPool,
    pub(crate) paged: Option<PagedStorage>,
    pub(crate) seqs: HashMap<u64, SeqState>,
    next_id: u64,
    released: Rc<RefCell<Vec<u64>>>,
    prefix: Option<(PrefixCache, PrefixCacheConfig)>,
    /// Block copies made since last taken, when recording (tensor
    /// parallelism's rank 0: see replica.rs).
    pub(crate) copy_log: Option<Vec<BlockCopy>>,
}

impl KvCache {
    /// A cache of `config.num_blocks` blocks. The paged backend allocates
    /// and zero-fills its pool arrays now.
    ///
    /// # Errors
    /// A zero block size, too many blocks, or an MLX allocation failure.
    pub fn new(config: KvCacheConfig) -> Result<Self, KvError> {
        let pool = BlockPool::new(config.num_blocks, config.block_size)?;
        let paged = match config.backend {
            StorageBackend::Paged => Some(PagedStorage::new(
                config.layout,
                config.num_blocks,
                config.block_size,
            )?),
            StorageBackend::Dense => None,
        };
        let prefix = match (config.backend, config.prefix) {
            (StorageBackend::Paged, Some(p)) => Some((PrefixCache::new(), p)),
            _ => None,
        };
        Ok(KvCache {
            config,
            pool,
            paged,
            seqs: HashMap::new(),
            next_id: 0,
            released: Rc::default(),
            prefix,
            copy_log: None,
        })
    }

    /// The configuration it was built with.
    pub fn config(&self) -> &KvCacheConfig {
        &self.config
    }

    /// The block pool (counts, for stats).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Sequences alive (handles not yet reclaimed).
    pub fn live_sequences(&self) -> usize {
        self.seqs.len()
    }

    /// A new empty sequence at `[0, 0)`.
    pub fn new_sequence(&mut self) -> KvSequence {
        let dense = match self.config.backend {
            StorageBackend::Dense => Some(DenseStorage::new(self.config.layout, 0)),
            StorageBackend::Paged => None,
        };
        self.insert_sequence(SeqState {
            blocks: SequenceBlocks::new(&self.pool),
            dense,
            hashes: Vec::new(),
            poisoned: false,
        })
    }

    fn insert_sequence(&mut self, state: SeqState) -> KvSequence {
        let id = self.next_id;
        self.next_id += 1;
        self.seqs.insert(id, state);
        KvSequence {
            id,
            released: Rc::clone(&self.released),
        }
    }

    /// Whether the prefix cache is on.
    pub fn prefix_cache_enabled(&self) -> bool {
        self.prefix.is_some()
    }

    /// A new sequence for a prompt of `tokens`, starting from the longest
    /// cached prefix of full blocks (adopted by reference, never copied);
    /// returns it and the number of prompt tokens whose K/V it already holds.
    /// When every prompt token is cached, the last one is rewound so that
    /// its logits are computed (its block is then copied before the write,
    /// the cached one staying intact). Without a prefix cache, an empty
    /// sequence.
    pub fn new_sequence_for_prompt(
        &mut self,
        tokens: &[u32],
    ) -> Result<(KvSequence, usize), KvError> {
        let Some((cache, cfg)) = &mut self.prefix else {
            return Ok((self.new_sequence(), 0));
        };
        let found = cache.lookup(&mut self.pool, tokens, cfg.extra_key)?;
        let mut hashes: Vec<BlockHash> = found
            .iter()
            .filter_map(|&b| self.pool.hash_of(b).ok().flatten())
            .collect();
        let mut blocks = SequenceBlocks::from_prefix(&self.pool, found);
        if !tokens.is_empty() && blocks.end() >= tokens.len() {
            if let Err(e) = blocks.truncate_tail(&mut self.pool, tokens.len() - 1) {
                blocks.release(&mut self.pool)?;
                return Err(e);
            }
        }
        hashes.truncate(blocks.end() / self.config.block_size);
        let cached = blocks.end();
        let seq = self.insert_sequence(SeqState {
            blocks,
            dense: None,
            hashes,
            poisoned: false,
        });
        Ok((seq, cached))
    }

    /// A second sequence holding the same positions and K/V as `seq` (the
    /// `n` choices of one prompt): paged, it references the same blocks
    /// (each block's refcount goes up; the first write into a shared
    /// partial block copies it); dense, it shares the buffers until one is
    /// written. Errors: an unknown or poisoned sequence.
    pub fn fork(&mut self, seq: &KvSequence) -> Result<KvSequence, KvError> {
        let state = self
            .seqs
            .get(&seq.id)
            .ok_or(KvError::Invariant(format!("unknown sequence {}", seq.id)))?;
        if state.poisoned {
            return Err(KvError::Invariant(format!(
                "sequence {} lost its K/V to an earlier storage failure",
                seq.id
            )));
        }
        let blocks = state.blocks.fork(&mut self.pool)?;
        let forked = SeqState {
            blocks,
            dense: state.dense.clone(),
            hashes: state.hashes.clone(),
            poisoned: false,
        };
        Ok(self.insert_sequence(forked))
    }

    /// Donates the sequence's full blocks of `tokens` (its token ids from
    /// position 0, at least `end` of them) to the prefix cache; see
    /// [`PrefixCache::donate`]. Returns (newly cached, swapped for shared).
    pub fn donate(&mut self, seq: &KvSequence, tokens: &[u32]) -> Result<(usize, usize), KvError> {
        let Some((cache, cfg)) = &mut self.prefix else {
            return Ok((0, 0));
        };
        let state = self
            .seqs
            .get_mut(&seq.id)
            .ok_or(KvError::Invariant(format!("unknown sequence {}", seq.id)))?;
        cache.donate(
            &mut self.pool,
            &mut state.blocks,
            &mut state.hashes,
            tokens,
            cfg.extra_key,
        )
    }

    /// Frees every cached block nobody holds (idempotent; blocks of running
    /// sequences stay).
    pub fn reset_prefix_cache(&mut self) -> ResetOutcome {
        let blocks_freed = self.pool.reset_prefix_cache();
        ResetOutcome {
            blocks_freed,
            bytes_freed: blocks_freed * self.block_bytes(),
        }
    }

    /// Prefix-cache counters (zero when disabled).
    pub fn prefix_stats(&self) -> PrefixCacheStats {
        match &self.prefix {
            Some((c, _)) => c.stats(&self.pool),
            None => PrefixCacheStats::default(),
        }
    }

    /// Most unreferenced cached blocks kept (0 when disabled).
    pub fn prefix_capacity_blocks(&self) -> usize {
        self.prefix.as_ref().map_or(0, |(_, c)| c.capacity_blocks)
    }

    /// Bytes of K/V one block holds.
    pub fn block_bytes(&self) -> usize {
        self.config.layout.bytes_per_token() * self.config.block_size
    }

    /// Evicts least recently used unreferenced cached blocks beyond the
    /// prefix cache's capacity.
    fn enforce_prefix_capacity(&mut self) {
        let Some((_, cfg)) = &self.prefix else { return };
        let evictable = self.pool.counts().evictable;
        if evictable > cfg.capacity_blocks {
            self.pool.evict_cached(evictable - cfg.capacity_blocks);
        }
    }

    /// Gives back the blocks of every dropped [`KvSequence`]; returns how
    /// many sequences were released.
    pub fn reclaim(&mut self) -> Result<usize, KvError> {
        let ids: Vec<u64> = self.released.borrow_mut().drain(..).collect();
        let mut first_error = None;
        for id in &ids {
            if let Some(mut s) = self.seqs.remove(id) {
                if let Err(e) = s.blocks.release(&mut self.pool) {
                    first_error.get_or_insert(e);
                }
            }
        }
        if !ids.is_empty() {
            self.enforce_prefix_capacity();
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(ids.len()),
        }
    }

    pub(crate) fn state(&self, seq: &KvSequence) -> Result<&SeqState, KvError> {
        self.seqs
            .get(&seq.id)
            .ok_or(KvError::Invariant(format!("unknown sequence {}", seq.id)))
    }

    /// The sequence's first live position.
    pub fn start(&self, seq: &KvSequence) -> Result<usize, KvError> {
        Ok(self.state(seq)?.blocks.start())
    }

    /// One past its last live position: the next token's (RoPE) position.
    pub fn end(&self, seq: &KvSequence) -> Result<usize, KvError> {
        Ok(self.state(seq)?.blocks.end())
    }

    /// Live tokens, `end - start` (the key count attention sees).
    pub fn len(&self, seq: &KvSequence) -> Result<usize, KvError> {
        Ok(self.state(seq)?.blocks.len())
    }

    /// Blocks the sequence holds.
    pub fn blocks_held(&self, seq: &KvSequence) -> Result<usize, KvError> {
        Ok(self.state(seq)?.blocks.blocks().len())
    }

    /// Reserves positions `[end, end + n)` for `n` new tokens: blocks from
    /// the pool (copy-on-write of a shared last block first) and, dense, room
    /// in the buffers. All or nothing.
    ///
    /// # Errors
    /// [`KvError::PoolExhausted`] when the pool can't hold them (nothing
    /// changed), or an MLX failure growing a buffer (the blocks are given
    /// back).
    pub fn append(&mut self, seq: &KvSequence, n: usize) -> Result<(), KvError> {
        let id = seq.id;
        let state = self
            .seqs
            .get_mut(&id)
            .ok_or(KvError::Invariant(format!("unknown sequence {id}")))?;
        if state.poisoned {
            return Err(KvError::Invariant(format!(
                "sequence {id} lost its K/V to an earlier storage failure"
            )));
        }
        let old_end = state.blocks.end();
        let appended = state.blocks.append_slots(&mut self.pool, n)?;
        let grown = match (&mut state.dense, &mut self.paged, appended.copy) {
            (Some(d), _, _) => d.reserve(state.blocks.start(), state.blocks.end()),
            (None, Some(p), Some(copy)) => {
                if let Some(log) = &mut self.copy_log {
                    log.push(copy);
                }
                p.copy_block(copy)
            }
            _ => Ok(()),
        };
        if let Err(e) = grown {
            // The copy or the resize may have stopped half-way: this
            // sequence's K/V can no longer be trusted.
            state.poisoned = true;
            state.blocks.truncate_tail(&mut self.pool, old_end)?;
            return Err(e);
        }
        Ok(())
    }

    /// Rewinds the tail to `new_end` (drops pad rows, or a failed step's
    /// tokens): positions and blocks move together; the dropped positions
    /// are never read again.
    pub fn truncate_tail(&mut self, seq: &KvSequence, new_end: usize) -> Result<(), KvError> {
        let (state, pool) = self.state_and_pool(seq)?;
        state.blocks.truncate_tail(pool, new_end)
    }

    /// Drops the front to `new_start` (a window or `--max-kv-size`);
    /// positions keep their absolute values.
    pub fn drop_front(&mut self, seq: &KvSequence, new_start: usize) -> Result<(), KvError> {
        let (state, pool) = self.state_and_pool(seq)?;
        state.blocks.drop_front(pool, new_start)
    }

    /// The sequence's state and the pool, borrowed together.
    fn state_and_pool(
        &mut self,
        seq: &KvSequence,
    ) -> Result<(&mut SeqState, &mut BlockPool), KvError> {
        let state = self
            .seqs
            .get_mut(&seq.id)
            .ok_or(KvError::Invariant(format!("unknown sequence {}", seq.id)))?;
        Ok((state, &mut self.pool))
    }

    /// Checks that the sequence's positions, block table and storage agree.
    pub fn check(&self, seq: &KvSequence) -> Result<(), KvError> {
        let s = self.state(seq)?;
        s.blocks.check_invariants()?;
        if let Some(d) = &s.dense {
            d.check_covers(s.blocks.start(), s.blocks.end())?;
        }
        Ok(())
    }

    /// Reserves one step's positions: each row's `padded` tokens (its
    /// `real` tokens followed by `padded - real` pad tokens) are appended.
    /// All or nothing: when a row doesn't fit, the rows before it are
    /// rewound and the error returned.
    pub fn reserve_step(&mut self, rows: &[RowReserve<'_>]) -> Result<StepReservation, KvError> {
        let mut done: Vec<(u64, usize, usize)> = Vec::with_capacity(rows.len());
        for r in rows {
            let old_end = self.end(r.seq)?;
            let result = if r.real == 0 || r.padded < r.real {
                Err(KvError::Invariant(format!(
                    "row of {} real tokens padded to {}",
                    r.real, r.padded
                )))
            } else {
                self.append(r.seq, r.padded)
            };
            if let Err(e) = result {
                self.rewind_ids(done.iter().map(|&(id, end, _)| (id, end)))?;
                return Err(e);
            }
            done.push((r.seq.id, old_end, r.real));
        }
        Ok(StepReservation { rows: done })
    }

    /// Ends a step reserved by [`KvCache::reserve_step`]. On success each
    /// row keeps exactly its real tokens (`end = old_end + real`: pad rows
    /// are rewound through the one tail-shrink path); on failure every row
    /// returns to where it was. Rows whose sequence was released meanwhile
    /// are skipped.
    pub fn complete_step(&mut self, step: StepReservation, success: bool) -> Result<(), KvError> {
        let targets = step
            .rows
            .iter()
            .map(|&(id, old_end, real)| (id, if success { old_end + real } else { old_end }));
        self.rewind_ids(targets.collect::<Vec<_>>())
    }

    fn rewind_ids(
        &mut self,
        targets: impl IntoIterator<Item = (u64, usize)>,
    ) -> Result<(), KvError> {
        for (id, end) in targets {
            if let Some(state) = self.seqs.get_mut(&id) {
                if state.blocks.end() != end {
                    state.blocks.truncate_tail(&mut self.pool, end)?;
                }
            }
        }
        Ok(())
    }

    /// The view of one forward over `rows` (each sequence with its last
    /// `new_tokens` positions just appended); see [`StepKv`].
    ///
    /// # Errors
    /// An unknown sequence, `new_tokens` larger than the sequence, or the
    /// same sequence twice.
    pub fn step(&mut self, rows: &[(&KvSequence, usize)]) -> Result<StepKv<'_>, KvError> {
        StepKv::new(self, rows.iter().map(|(s, n)| (s.id, *n)).collect())
    }
}
