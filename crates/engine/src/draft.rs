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
    /// `chunk` tokens a step, its decode rows read as the engine's are
    /// (`path`: on a GPU the paged-attention kernel, one call a layer for
    /// every row drafting).
    pub(crate) fn new(
        model: &'m dyn Model,
        kv: KvCache,
        chunk: usize,
        path: mlxcel_model::AttentionPath,
    ) -> Self {
        let runner = LocalRunner::new(model, kv.config().backend, path);
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
    /// draft model after the row's known tokens. A row more than a chunk
    /// behind runs one chunk of its tokens this round and proposes nothing
    /// (so a long context never stalls a step by more than a chunk a row).
    /// Afterwards the draft cache of a proposing row holds its tokens and
    /// all of its draft but the last token (`tokens.len() + k - 1`
    /// positions): [`Proposal::computed`].
    ///
    /// # Errors
    /// A draft step failing (the steps before it stay in the draft cache:
    /// the caller drops the rows' draft sequences).
    pub(crate) fn propose(&mut self, rows: &[DraftRow<'_>]) -> Result<Vec<Proposal>, StepError> {
        let mut out: Vec<Proposal> = rows
            .iter()
            .map(|r| Proposal {
                draft: Vec::new(),
                computed: r.computed,
            })
            .collect();
        if rows.is_empty() {
            return Ok(out);
        }
        // The first step: a chunk of each row that is behind; the rest of
        // each other row's tokens with the greedy token after the last.
        // One-token rows first (decode rows lead a step).
        let chunk = self.chunk;
        let behind = |i: usize| rows[i].tokens.len().saturating_sub(rows[i].computed) > chunk;
        let mut order: Vec<usize> = (0..rows.len())
            .filter(|&i| rows[i].computed < rows[i].tokens.len())
            .collect();
        order.sort_by_key(|&i| rows[i].tokens.len() - rows[i].computed > 1);
        let batch = StepBatch {
            rows: order
                .iter()
                .map(|&i| {
                    let r = &rows[i];
                    let end = if behind(i) {
                        r.computed + chunk
                    } else {
                        r.tokens.len()
                    };
                    let input = &r.tokens[r.computed..end];
                    let n = input.len();
                    BatchRow {
                        kv: r.kv,
                        input: RowInput::Tokens(input),
                        real: n,
                        host_logits: 0..0,
                        device_argmax: if behind(i) { 0..0 } else { n - 1..n },
                        hidden: 0..0,
                    }
                })
                .collect(),
        };
        let first = self.run(&batch)?;
        let mut drafting = Vec::new();
        for ((&i, row), token) in order.iter().zip(&batch.rows).zip(first) {
            out[i].computed = rows[i].computed + row.real;
            match token {
                Some(t) if !behind(i) => {
                    out[i].draft.push(t);
                    drafting.push(i);
                }
                None if behind(i) => {}
                _ => return Err(StepError::Internal("a draft step's tokens")),
            }
        }
        // Then one token a step for the rows that want more.
        let longest = drafting.iter().map(|&i| rows[i].k).max().unwrap_or(0);
        for step in 1..longest {
            let more: Vec<usize> = drafting
                .iter()
                .copied()
                .filter(|&i| rows[i].k > step)
                .collect();
            let inputs: Vec<[u32; 1]> = more.iter().map(|&i| [out[i].draft[step - 1]]).collect();
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
                        hidden: 0..0,
                    })
                    .collect(),
            };
            for (&i, token) in more.iter().zip(self.run(&batch)?) {
                let t = token.ok_or(StepError::Internal("a draft step's tokens"))?;
                out[i].draft.push(t);
                out[i].computed += 1;
            }
        }
        Ok(out)
    }

    /// Runs one draft step; returns each row's greedy token (`None` for a
    /// row that wants none), in row order. The draft cache is not trimmed
    /// here: rejected drafts are truncated first (`Worker::verify`), then
    /// the window groups trim.
    fn run(&mut self, batch: &StepBatch<'_>) -> Result<Vec<Option<u32>>, StepError> {
        let out = self.runner.run(&mut self.kv, batch, &NoStreams)?;
        if out.rows.len() != batch.rows.len() {
            return Err(StepError::Internal("a draft step's rows"));
        }
        Ok(out.rows.iter().map(|r| r.tokens.last().copied()).collect())
    }
}

/// What a round of proposals gave one row.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Proposal {
    /// The draft tokens (empty: the row only caught up this round).
    pub(crate) draft: Vec<u32>,
    /// Tokens whose K/V the draft cache holds now.
    pub(crate) computed: usize,
}
