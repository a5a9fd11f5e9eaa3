//! Admission against a [`KvCache`]'s pools: its admission rule and whether
//! a request fits next to the running sequences.

use super::{KvCache, KvSequence};
use crate::admission::{Admission, GroupAdmission};

impl KvCache {
    /// The admission rule of this cache (crates/kv/src/admission.rs): per
    /// group, the worst case under its keep, prefill tiles of `tile`
    /// tokens and chunks of `chunk`, over its pool's blocks.
    pub fn admission(&self, tile: usize, chunk: usize) -> GroupAdmission {
        GroupAdmission::new(
            self.groups
                .iter()
                .map(|g| {
                    (
                        Admission::new(self.config.block_size, tile, g.config.keep, chunk),
                        g.config.num_blocks,
                    )
                })
                .collect(),
        )
    }

    /// Whether a request that may hold `need[g]` blocks of group `g` fits
    /// now, on top of what the running sequences may still take: each
    /// `(sequence, worst[g])` of `running` may grow to `worst[g]` blocks.
    /// The one admission question, answered per group.
    pub fn fits<'s>(
        &self,
        need: &[usize],
        running: impl IntoIterator<Item = (&'s KvSequence, &'s [usize])>,
    ) -> bool {
        let mut promised = vec![0usize; self.groups.len()];
        for (seq, worst) in running {
            let held = self.group_blocks_held(seq).ok();
            for (g, p) in promised.iter_mut().enumerate() {
                let w = worst.get(g).copied().unwrap_or(0);
                let h = held.as_ref().and_then(|h| h.get(g).copied()).unwrap_or(w);
                *p += w.saturating_sub(h);
            }
        }
        self.groups.iter().enumerate().all(|(g, group)| {
            group.pool.free_blocks() >= promised[g] + need.get(g).copied().unwrap_or(0)
        })
    }
}
