//! Draft-model speculation (`--speculative draft --draft-model DIR`): a
//! smaller model with the target's vocabulary proposes each speculating
//! row's draft by decoding it greedily, `k` steps batched across the rows
//! (Leviathan et al. 2023, Chen et al. 2023; llama-server's and vLLM's
//! draft models, mlx-lm's `speculative_generate_step`, all of which keep
//! the draft's own KV cache beside the target's).
//!
//! The draft model runs on the engine thread with its own KV cache (and
//! prefix cache) and its own local step runner. Each row keeps a sequence
//! in that cache and how many of its tokens the cache holds; a round of
//! proposals first catches the row's draft cache up with the tokens the
//! target has accepted since (whole chunks, then the rest with the first
//! draft step), then decodes. Greedy proposals are deterministic, so the
//! worker's verification (`worker/speculate.rs`) keeps the target's
//! output exactly, for greedy and sampled rows alike; the drafts it
//! rejects are truncated from the draft cache as from the target's.
//!
//! The draft cache holds as many tokens as the target's first KV group;
//! it is not part of admission: a row whose draft cannot get blocks (or
//! whose draft step fails) simply decodes without a draft that step, and
//! its draft sequence starts again from the draft's prefix cache.

use mlxcel_kv::{KvCache, KvSequence};
use mlxcel_model::{Model, RowInput};
use tokio::sync::mpsc::UnboundedSender;

use crate::api::GenerationEvent;
use crate::error::StepError;
use crate::runner::local::LocalRunner;
use crate::runner::{BatchRow, InFlight, StepBatch, StepRunner};

/// The draft model's runner and KV cache.
pub(crate) struct Drafter<'m> {
    runner: LocalRunner<'m>,
    /// The draft model's KV cache (its own pool and prefix cache).
    pub(crate) kv: KvCache,
    /// Most tokens a catch-up row runs in one step (the target's prefill
    /// chunk).
    chunk: usize,
}

/// One row's part in a round of proposals.
pub(crate) struct DraftRow<'a> {
    /// The row's sequence in the draft cache.
    pub(crate) kv: &'a KvSequence,
    /// The row's known tokens (prompt and output so far).
    pub(crate) tokens: &'a [u32],
    /// Tokens whose K/V the draft cache holds (`< tokens.len()`).
    pub(crate) computed: usize,
    /// Draft tokens wanted (at least 1).
    pub(crate) k: usize,
}

/// A draft step fails no request by itself: nothing to fail.
struct NoStreams;

impl InFlight for NoStreams {
    fn streams(&self) -> Vec<UnboundedSender<GenerationEvent>> {
        Vec::new()
    }
}

impl<'m> Drafter<'m> {
    /// A drafter running `model` over `kv`, catching rows up by at most
    /// `chunk` tokens a step.
    pub(crate) fn new(model: &'m dyn Model, kv: KvCache, chunk: usize) -> Self {
        let runner = LocalRunner::new(
            model,
            kv.config().backend,
            mlxcel_model::AttentionPath::PerRow,
        );
        Drafter {
            runner,
            kv,
            chunk: chunk.max(1),
        }
    }

    /// A draft sequence for a row whose known tokens are `tokens`: its
    /// prefix from the draft's prefix cache when `cached`, and how many
    /// tokens that covers.
    ///
    /// # Errors
    /// The prefix lookup failing.
    pub(crate) fn new_sequence(
        &mut self,
        tokens: &[u32],
        cached: bool,
    ) -> Result<(KvSequence, usize), StepError> {
        if cached {
            Ok(self
                .kv
                .new_sequence_for_prompt_chunked(tokens, self.chunk)?)
        } else {
            Ok((self.kv.new_sequence(), 0))
        }
    }

    /// Proposes each row's draft: `k` tokens by greedy decoding of the
    /// draft model after the row's known tokens. Afterwards the draft cache
    /// of a row holds its tokens and all of its draft but the last token
    /// (`tokens.len() + k - 1` positions).
    ///
    /// # Errors
    /// A draft step failing (the steps before it stay in the draft cache:
    /// the caller drops the rows' draft sequences).
    pub(crate) fn propose(&mut self, rows: &[DraftRow<'_>]) -> Result<Vec<Vec<u32>>, StepError> {
        let mut computed: Vec<usize> = rows.iter().map(|r| r.computed).collect();
        // Whole chunks first, keeping at most a chunk for the first step.
        loop {
            let behind: Vec<usize> = (0..rows.len())
                .filter(|&i| rows[i].tokens.len() - computed[i] > self.chunk)
                .collect();
            if behind.is_empty() {
                break;
            }
            let batch = StepBatch {
                rows: behind
                    .iter()
                    .map(|&i| BatchRow {
                        kv: rows[i].kv,
                        input: RowInput::Tokens(
                            &rows[i].tokens[computed[i]..computed[i] + self.chunk],
                        ),
                        real: self.chunk,
                        host_logits: 0..0,
                        device_argmax: 0..0,
                    })
                    .collect(),
            };
            self.run(&batch)?;
            for &i in &behind {
                computed[i] += self.chunk;
            }
        }
        // The first step: the rest of each row's tokens, the greedy token
        // after the last; one-token rows first (decode rows lead a step).
        let mut order: Vec<usize> = (0..rows.len()).collect();
        order.sort_by_key(|&i| rows[i].tokens.len() - computed[i] > 1);
        let batch = StepBatch {
            rows: order
                .iter()
                .map(|&i| {
                    let input = &rows[i].tokens[computed[i]..];
                    BatchRow {
                        kv: rows[i].kv,
                        input: RowInput::Tokens(input),
                        real: input.len(),
                        host_logits: 0..0,
                        device_argmax: input.len() - 1..input.len(),
                    }
                })
                .collect(),
        };
        let first = self.run(&batch)?;
        let mut drafts = vec![Vec::new(); rows.len()];
        for (&i, token) in order.iter().zip(first) {
            drafts[i].push(token);
        }
        // Then one token a step for the rows that want more.
        let longest = rows.iter().map(|r| r.k).max().unwrap_or(0);
        for step in 1..longest {
            let more: Vec<usize> = (0..rows.len()).filter(|&i| rows[i].k > step).collect();
            let inputs: Vec<[u32; 1]> = more.iter().map(|&i| [drafts[i][step - 1]]).collect();
            let batch = StepBatch {
                rows: more
                    .iter()
                    .zip(&inputs)
                    .map(|(&i, input)| BatchRow {
                        kv: rows[i].kv,
                        input: RowInput::Tokens(input),
                        real: 1,
                        host_logits: 0..0,
                        device_argmax: 0..1,
                    })
                    .collect(),
            };
            for (&i, token) in more.iter().zip(self.run(&batch)?) {
                drafts[i].push(token);
            }
        }
        Ok(drafts)
    }

    /// Runs one draft step; returns each row's greedy token (rows that
    /// want none give none) and trims what left a window.
    fn run(&mut self, batch: &StepBatch<'_>) -> Result<Vec<u32>, StepError> {
        let out = self.runner.run(&mut self.kv, batch, &NoStreams)?;
        for r in &batch.rows {
            self.kv.trim(r.kv)?;
        }
        Ok(out
            .rows
            .iter()
            .filter_map(|r| r.tokens.last().copied())
            .collect())
    }
}
