//! A sequence's positions in a [`KvCache`]: where it starts and ends in
//! each group, the blocks it holds, and the one function per direction
//! that grows it ([`KvCache::append`]) or shrinks it
//! ([`KvCache::truncate_tail`], [`KvCache::drop_front`], [`KvCache::trim`]).

use super::{KvCache, KvSequence};
use crate::error::KvError;

impl KvCache {
    /// The sequence's first live position in the first group (a window
    /// group's may be later: [`KvCache::group_range`]).
    pub fn start(&self, seq: &KvSequence) -> Result<usize, KvError> {
        Ok(self.state(seq)?.first().start())
    }

    /// One past its last live position: the next token's (RoPE) position,
    /// the same in every group.
    pub fn end(&self, seq: &KvSequence) -> Result<usize, KvError> {
        Ok(self.state(seq)?.first().end())
    }

    /// Live tokens in the first group, `end - start` (the key count its
    /// layers' attention sees).
    pub fn len(&self, seq: &KvSequence) -> Result<usize, KvError> {
        Ok(self.state(seq)?.first().len())
    }

    /// The sequence's live positions `[start, end)` in group `group`.
    pub fn group_range(
        &self,
        seq: &KvSequence,
        group: usize,
    ) -> Result<std::ops::Range<usize>, KvError> {
        let b = self
            .state(seq)?
            .blocks
            .get(group)
            .ok_or(KvError::Invariant(format!("no KV group {group}")))?;
        Ok(b.start()..b.end())
    }

    /// Blocks the sequence holds, summed over groups.
    pub fn blocks_held(&self, seq: &KvSequence) -> Result<usize, KvError> {
        Ok(self.group_blocks_held(seq)?.iter().sum())
    }

    /// Blocks the sequence holds in each group, in group order.
    pub fn group_blocks_held(&self, seq: &KvSequence) -> Result<Vec<usize>, KvError> {
        Ok(self
            .state(seq)?
            .blocks
            .iter()
            .map(|b| b.blocks().len())
            .collect())
    }

    /// Reserves positions `[end, end + n)` for `n` new tokens in every
    /// group: blocks from the pools (copy-on-write of a shared last block
    /// first) and, dense, room in the buffers. All or nothing.
    ///
    /// # Errors
    /// [`KvError::PoolExhausted`] when a pool can't hold them (nothing
    /// changed), or an MLX failure growing a buffer or copying a block (the
    /// blocks are given back, the sequence poisoned).
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
        let old_end = state.blocks[0].end();
        let mut result = Ok(());
        let mut grown = 0;
        for (g, blocks) in state.blocks.iter_mut().enumerate() {
            let group = &mut self.groups[g];
            let appended = match blocks.append_slots(&mut group.pool, n) {
                Ok(a) => a,
                Err(e) => {
                    result = Err(e);
                    break;
                }
            };
            grown += 1;
            // Evicted cached blocks still hold their K/V: save them before
            // the copy or the step writes into them.
            super::disk::save_evicted(&mut self.disk, &self.config.layout, g, group);
            if let (Some(p), Some(copy)) = (&mut group.paged, appended.copy) {
                if let Some(log) = &mut self.copy_log {
                    log.push(copy);
                }
                if let Err(e) = p.copy_block(copy) {
                    // The copy may have stopped half-way: this sequence's
                    // K/V can no longer be trusted.
                    state.poisoned = true;
                    result = Err(e);
                    break;
                }
            }
        }
        if result.is_ok() {
            if let Some(d) = &mut state.dense {
                if let Err(e) = d.reserve(state.blocks[0].start(), state.blocks[0].end()) {
                    state.poisoned = true;
                    result = Err(e);
                }
            }
        }
        if result.is_err() {
            for (g, blocks) in state.blocks.iter_mut().enumerate().take(grown) {
                blocks.truncate_tail(&mut self.groups[g].pool, old_end)?;
            }
        }
        result
    }

    /// Rewinds the tail to `new_end` in every group (drops pad rows, or a
    /// failed step's tokens): positions and blocks move together; the
    /// dropped positions are never read again.
    pub fn truncate_tail(&mut self, seq: &KvSequence, new_end: usize) -> Result<(), KvError> {
        let state = self
            .seqs
            .get_mut(&seq.id)
            .ok_or(KvError::Invariant(format!("unknown sequence {}", seq.id)))?;
        state.recurrent.prune(new_end);
        for (g, blocks) in state.blocks.iter_mut().enumerate() {
            blocks.truncate_tail(&mut self.groups[g].pool, new_end)?;
        }
        Ok(())
    }

    /// Drops the front to `new_start` in every group that starts before
    /// it; positions keep their absolute values.
    pub fn drop_front(&mut self, seq: &KvSequence, new_start: usize) -> Result<(), KvError> {
        let state = self
            .seqs
            .get_mut(&seq.id)
            .ok_or(KvError::Invariant(format!("unknown sequence {}", seq.id)))?;
        for (g, blocks) in state.blocks.iter_mut().enumerate() {
            if blocks.start() < new_start {
                blocks.drop_front(&mut self.groups[g].pool, new_start)?;
            }
        }
        Ok(())
    }

    /// Drops each group's front to what it keeps between steps (its
    /// [`KvGroupConfig::keep`]: `end - keep` when it holds more): a window
    /// group frees the blocks that fell out of its window, the full group
    /// keeps everything (or the last `--max-kv-size`). Call it after every
    /// step, once the step's blocks were donated.
    ///
    /// # Errors
    /// [`KvError::Invariant`] for a sequence this cache doesn't know.
    ///
    /// [`KvGroupConfig::keep`]: crate::KvGroupConfig::keep
    pub fn trim(&mut self, seq: &KvSequence) -> Result<(), KvError> {
        self.trim_keeping(seq, 0)
    }

    /// [`KvCache::trim`] with `ahead` positions at the end reserved by
    /// steps queued but not read yet (pipelined decode): each group keeps
    /// `keep + ahead` keys, what the next synchronous step would keep
    /// once those queued steps were rolled back (a failed read). A step
    /// queued after this trim sees up to `ahead` keys more than its window,
    /// which its layers mask.
    ///
    /// # Errors
    /// As [`KvCache::trim`].
    pub fn trim_keeping(&mut self, seq: &KvSequence, ahead: usize) -> Result<(), KvError> {
        let state = self
            .seqs
            .get_mut(&seq.id)
            .ok_or(KvError::Invariant(format!("unknown sequence {}", seq.id)))?;
        for (g, blocks) in state.blocks.iter_mut().enumerate() {
            let group = &mut self.groups[g];
            if let Some(keep) = group.config.keep {
                let keep = keep + ahead;
                if blocks.len() > keep {
                    blocks.drop_front(&mut group.pool, blocks.end() - keep)?;
                }
            }
        }
        Ok(())
    }

    /// Checks that the sequence's positions, block tables and storage
    /// agree, that every group ends at the same position, that a group
    /// that dropped its front still holds the `keep` keys the next step
    /// reads ([`KvGroupConfig::keep`]), and that it donated no block past
    /// its end (a rolled-back step's positions are never in the prefix
    /// cache).
    ///
    /// # Errors
    /// [`KvError::Invariant`] naming the first broken one.
    ///
    /// [`KvGroupConfig::keep`]: crate::KvGroupConfig::keep
    pub fn check(&self, seq: &KvSequence) -> Result<(), KvError> {
        let s = self.state(seq)?;
        let end = s.first().end();
        for (g, b) in s.blocks.iter().enumerate() {
            b.check_invariants()?;
            if b.end() != end {
                return Err(KvError::Invariant(format!(
                    "KV groups end at {} and {end}",
                    b.end()
                )));
            }
            if let Some(keep) = self.groups[g].config.keep {
                if b.start() > 0 && b.len() < keep {
                    return Err(KvError::Invariant(format!(
                        "KV group {g} dropped keys it keeps: it holds [{}, {end}), {keep} keys kept",
                        b.start()
                    )));
                }
            }
        }
        let donated = s.hashes.len() * self.config.block_size;
        if donated > end {
            return Err(KvError::Invariant(format!(
                "donated blocks up to position {donated}, past the end {end}"
            )));
        }
        if let Some(d) = &s.dense {
            d.check_covers(s.first().start(), end)?;
        }
        Ok(())
    }
}
