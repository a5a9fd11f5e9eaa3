//! Step planning: which rows run in the next forward, with how many tokens.
//!
//! The scheduler schedules tokens, not phases (vLLM v1's scheduler does the
//! same): every running sequence has *known* tokens (prompt plus sampled) and
//! *computed* tokens (those whose K/V is cached), and a row is a sequence
//! catching up. One behind is a decode row (one token); further behind is a
//! prefill row, given one chunk. Its output, a [`StepPlan`], is plain data a
//! test can build by hand.
//!
//! Chunk boundaries are fixed in absolute positions (multiples of the chunk
//! size), so how a prompt is split never depends on what else runs in the
//! step. Prefill chunks may be padded to a tile multiple; pad tokens come
//! after the real ones and are rewound after the step.

/// Scheduling options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Prefill tokens one step may run (at least one chunk always runs), and
    /// the chunk grid: chunks end at multiples of this many positions.
    pub prefill_chunk_size: usize,
    /// Pad each prefill chunk to a multiple of this many tokens (0: no pad).
    pub prefill_tile: usize,
    /// With recurrent layers and a prefix cache: the KV block size. A
    /// prompt's last chunk then ends at its last block boundary before its
    /// end (the rest runs in the next step), so a recurrent-state snapshot
    /// exists where a repeat of the prompt can resume (`mlxcel_kv`'s
    /// recurrent.rs). 0: off.
    pub snapshot_block: usize,
}

/// What the scheduler needs to know of one running sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqProgress {
    /// Tokens known (prompt + sampled).
    pub known: usize,
    /// Tokens whose K/V is in the cache.
    pub computed: usize,
    /// Whether its prompt is scored (prompt logprobs): its chunks are at
    /// most [`SCORED_CHUNK`] tokens, as each token's logits row is read back.
    pub scored: bool,
    /// Whether its blocks go to the prefix cache (`cache_prompt`): only
    /// then is its prompt's last chunk split for a recurrent-state snapshot
    /// ([`SchedulerConfig::snapshot_block`]).
    pub donates: bool,
}

/// Largest prefill chunk of a scored prompt: every token's `[vocab]`
/// logits row of a chunk is read back at once (128 rows of a 152k
/// vocabulary are 78 MB of float32).
pub const SCORED_CHUNK: usize = 128;

/// One row of a planned step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedRow {
    /// Index of the sequence in the slice given to [`plan_step`].
    pub seq: usize,
    /// Real tokens: known tokens `[computed, computed + real - draft)`,
    /// then the row's draft tokens.
    pub real: usize,
    /// Tokens the forward runs: `real` then `padded - real` pad tokens.
    pub padded: usize,
    /// Whether the row's last real token is the last known one (its logits
    /// give the next token).
    pub sample: bool,
    /// Draft tokens after the row's last known token: a decode row that
    /// verifies a speculation (`crate::speculative`; the greedy token at
    /// each of its positions comes back). 0 for every row the scheduler
    /// plans.
    pub draft: usize,
}

/// A step: decode rows first (one token each), then verification rows
/// (a decode row with drafts), then prefill rows.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StepPlan {
    pub rows: Vec<PlannedRow>,
}

impl StepPlan {
    /// Rows of one token at the front (attended together when batched).
    pub fn decode_rows(&self) -> usize {
        self.rows.iter().take_while(|r| r.padded == 1).count()
    }

    /// Real prefill tokens in the step.
    pub fn prefill_tokens(&self) -> usize {
        self.rows[self.decode_rows()..]
            .iter()
            .filter(|r| r.draft == 0)
            .map(|r| r.real)
            .sum()
    }

    /// Rows that verify draft tokens.
    pub fn verify_rows(&self) -> usize {
        self.rows.iter().filter(|r| r.draft > 0).count()
    }
}

/// Plans the next step over `seqs` (in arrival order). Every sequence one
/// token behind decodes; sequences further behind get their next chunk, in
/// order, while the step's prefill tokens stay within the chunk size (the
/// first prefill row always runs).
pub fn plan_step(seqs: &[SeqProgress], config: SchedulerConfig) -> StepPlan {
    let chunk = config.prefill_chunk_size.max(1);
    let mut rows: Vec<PlannedRow> = seqs
        .iter()
        .enumerate()
        .filter(|(_, s)| s.known == s.computed + 1)
        .map(|(seq, _)| PlannedRow {
            seq,
            real: 1,
            padded: 1,
            sample: true,
            draft: 0,
        })
        .collect();
    let mut budget = chunk;
    let mut any_prefill = false;
    for (seq, s) in seqs.iter().enumerate() {
        if s.known <= s.computed + 1 {
            continue;
        }
        // A scored prompt's chunks divide the grid's (the cap is a power
        // of two, as chunk sizes are in practice; either way they end on a
        // multiple of the cap).
        let chunk = if s.scored {
            chunk.min(SCORED_CHUNK)
        } else {
            chunk
        };
        let mut end = s.known.min((s.computed / chunk + 1) * chunk);
        if config.snapshot_block > 0 && s.donates && end == s.known {
            let boundary = (s.known - 1) / config.snapshot_block * config.snapshot_block;
            if boundary > s.computed {
                end = boundary;
            }
        }
        let real = end - s.computed;
        if any_prefill && real > budget {
            break;
        }
        let padded = match config.prefill_tile {
            0 => real,
            t => real.div_ceil(t) * t,
        };
        rows.push(PlannedRow {
            seq,
            real,
            padded,
            sample: end == s.known,
            draft: 0,
        });
        budget = budget.saturating_sub(real);
        any_prefill = true;
    }
    StepPlan { rows }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(chunk: usize, tile: usize) -> SchedulerConfig {
        SchedulerConfig {
            snapshot_block: 0,
            prefill_chunk_size: chunk,
            prefill_tile: tile,
        }
    }

    fn p(known: usize, computed: usize) -> SeqProgress {
        SeqProgress {
            known,
            computed,
            scored: false,
            donates: true,
        }
    }

    #[test]
    fn with_recurrent_state_a_donated_prompt_ends_a_chunk_at_its_last_block() {
        let config = SchedulerConfig {
            snapshot_block: 16,
            ..cfg(512, 0)
        };
        // 100 known tokens: the chunk ends at 96, the last 4 run next.
        assert_eq!(
            plan_step(&[p(100, 0)], config).rows,
            vec![row(0, 96, 96, false)]
        );
        assert_eq!(
            plan_step(&[p(100, 96)], config).rows,
            vec![row(0, 4, 4, true)]
        );
        // A prompt that is not cached runs whole.
        let private = SeqProgress {
            donates: false,
            ..p(100, 0)
        };
        assert_eq!(
            plan_step(&[private], config).rows,
            vec![row(0, 100, 100, true)]
        );
    }

    #[test]
    fn scored_prompts_run_in_small_chunks() {
        let scored = SeqProgress {
            scored: true,
            ..p(300, 0)
        };
        let plan = plan_step(&[scored, p(300, 0)], cfg(512, 0));
        assert_eq!(
            plan.rows,
            vec![
                row(0, SCORED_CHUNK, SCORED_CHUNK, false),
                row(1, 300, 300, true)
            ]
        );
        let plan = plan_step(
            &[SeqProgress {
                computed: 256,
                ..scored
            }],
            cfg(512, 0),
        );
        assert_eq!(plan.rows, vec![row(0, 44, 44, true)]);
    }

    fn row(seq: usize, real: usize, padded: usize, sample: bool) -> PlannedRow {
        PlannedRow {
            seq,
            real,
            padded,
            sample,
            draft: 0,
        }
    }

    #[test]
    fn decode_rows_come_first_then_chunks_within_budget() {
        let plan = plan_step(&[p(300, 0), p(11, 10), p(40, 0), p(8, 7)], cfg(64, 0));
        assert_eq!(
            plan.rows,
            vec![
                row(1, 1, 1, true),
                row(3, 1, 1, true),
                row(0, 64, 64, false),
            ],
            "seq 2's chunk (40) exceeds what's left of the 64-token budget (0)"
        );
        assert_eq!(plan.decode_rows(), 2);
        assert_eq!(plan.prefill_tokens(), 64);
    }

    #[test]
    fn short_prompts_share_a_step() {
        let plan = plan_step(&[p(33, 0), p(31, 0), p(1, 0)], cfg(512, 0));
        assert_eq!(
            plan.rows,
            vec![
                row(2, 1, 1, true),
                row(0, 33, 33, true),
                row(1, 31, 31, true)
            ]
        );
    }

    #[test]
    fn chunks_end_on_the_absolute_grid() {
        // 70 computed (e.g. from a cache hit): the next chunk ends at 128.
        let plan = plan_step(&[p(300, 70)], cfg(64, 0));
        assert_eq!(plan.rows, vec![row(0, 58, 58, false)]);
        let plan = plan_step(&[p(130, 128)], cfg(64, 0));
        assert_eq!(plan.rows, vec![row(0, 2, 2, true)]);
    }

    #[test]
    fn tile_pads_prefill_chunks_only() {
        let plan = plan_step(&[p(33, 0), p(5, 4)], cfg(16, 32));
        assert_eq!(plan.rows, vec![row(1, 1, 1, true), row(0, 16, 32, false)]);
        let plan = plan_step(&[p(33, 32)], cfg(16, 32));
        assert_eq!(
            plan.rows,
            vec![row(0, 1, 1, true)],
            "a 1-token tail decodes"
        );
        let plan = plan_step(&[p(34, 32)], cfg(16, 32));
        assert_eq!(plan.rows, vec![row(0, 2, 32, true)]);
    }

    #[test]
    fn idle_sequences_plan_nothing() {
        assert!(plan_step(&[p(5, 5)], cfg(16, 0)).rows.is_empty());
    }
}
