//! Speculative decoding in the worker (`crate::speculative`): which decode
//! rows verify drafts this step, what a verification keeps, and how its
//! tokens are streamed.
//!
//! A verification row runs the row's last token and its draft (`1 + d`
//! tokens) and gets the model's output at every position: the greedy token
//! taken on the device for rows sampled there, the logits row for the
//! others. [`Worker::verify`] picks the row's tokens position by position
//! exactly as plain decoding would (the same processors, grammar and
//! sampler, drawing from the same random stream), and stops at the first
//! pick that differs from the draft: that pick is the model's own token
//! after the agreeing drafts. A sampled row therefore emits, for a given
//! seed, the tokens it would emit without speculation (up to
//! floating-point differences between the logits of a verification row
//! and of a decode row, which move a draw only when it lands within them
//! of a boundary between two tokens): the draft
//! (a point mass from prompt lookup) is accepted with probability
//! `p(draft)`, the most any scheme can accept it while keeping the target
//! distribution (the maximal coupling that speculative rejection sampling,
//! Leviathan et al. 2023 and Chen et al. 2023, reaches for a point-mass
//! proposal), and a rejection yields the sampler's own draw, whose law
//! given the rejection is the residual distribution. Then the rejected
//! drafts are truncated (every KV group, through `KvCache::truncate_tail`)
//! before the row advances, so the cache holds exactly the tokens a plain
//! decode would have computed, and only those are ever donated to the
//! prefix cache. The picks are streamed one by one through the normal emit
//! path (stop strings, `max_tokens` and EOS end the choice at the same
//! token as without speculation).

use super::{Emitted, Job, NextToken, Worker};
use crate::draft::DraftRow;
use crate::error::StepError;
use crate::runner::RowOutput;
use crate::scheduler::{PlannedRow, StepPlan};
use crate::speculative::{accepted_prefix, ngram_draft, RowSpeculation, SpeculativeMethod};

impl Worker<'_> {
    /// The speculation state of a new choice of `job`: drafts of up to
    /// `--num-speculative-tokens` when the engine speculates and the
    /// request did not opt out, none otherwise.
    pub(super) fn row_speculation(&self, job: &Job) -> RowSpeculation {
        let on = self.config.speculative.method.proposes() && job.request.speculative;
        RowSpeculation::new(if on {
            self.config.speculative.num_tokens
        } else {
            0
        })
    }

    /// Whether sequence `seq` may verify drafts at all: it speculates and
    /// has no choices left to fork (any sampling works: greedy or not,
    /// logprobs, penalties, bias, grammar).
    fn speculates(&self, seq: usize) -> bool {
        let s = &self.running[seq];
        s.speculation.active() && s.forks.is_empty()
    }

    /// Whether a pipelined chain stops so that sequence `seq` can verify
    /// a draft in the synchronous step after it: it drafts with a model
    /// (which proposes from the tokens read), or verification does not run
    /// inside the pipeline and its tokens so far already end in a
    /// recurring n-gram (the token in flight is not known yet; the
    /// synchronous step looks again).
    pub(super) fn ends_chain(&self, seq: usize) -> bool {
        self.speculates(seq)
            && match self.config.speculative.method {
                SpeculativeMethod::Draft => true,
                _ => {
                    !self.config.pipelined_verification
                        && !ngram_draft(&self.running[seq].tokens, 1).is_empty()
                }
            }
    }

    /// The prompt-lookup draft of sequence `seq` for a step queued behind
    /// one whose tokens are not read yet: the lookup runs over the
    /// sequence's tokens followed by `queued_draft` (the drafts the step
    /// in flight verifies, taken as kept), and the first token it
    /// proposes is its guess of the token in flight, the row's input, so
    /// the draft is what follows that guess: `(guess, draft)`. At most
    /// the row's adaptive length, `left - 1` (`left`: tokens the row may
    /// still emit after the step in flight) and a prefill chunk less one;
    /// no draft when the row does not speculate or no suffix recurs.
    pub(super) fn guess_draft(
        &self,
        seq: usize,
        queued_draft: &[u32],
        left: usize,
    ) -> (Option<u32>, Vec<u32>) {
        if !self.config.speculative.method.proposes() || !self.speculates(seq) {
            return (None, Vec::new());
        }
        let s = &self.running[seq];
        let k = self.draft_room(s.speculation.proposal(), left);
        if k == 0 {
            return (None, Vec::new());
        }
        let joined;
        let tokens: &[u32] = if queued_draft.is_empty() {
            &s.tokens
        } else {
            joined = [s.tokens.as_slice(), queued_draft].concat();
            &joined
        };
        match ngram_draft(tokens, k + 1).split_first() {
            Some((&first, draft)) if !draft.is_empty() => (Some(first), draft.to_vec()),
            _ => (None, Vec::new()),
        }
    }

    /// A row's draft length `k` bounded to stay one token short of the
    /// `left` tokens it may still emit and of a prefill chunk.
    fn draft_room(&self, k: usize, left: usize) -> usize {
        k.min(left.saturating_sub(1))
            .min(self.config.scheduler.prefill_chunk_size.saturating_sub(1))
    }

    /// A decode step of `seq` passed without a chance to propose (a
    /// pipelined step): a paused row counts down.
    pub(super) fn pass_speculation(&mut self, seq: usize) {
        let _ = self.running[seq].speculation.next_step();
    }

    /// Turns decode rows of `plan` into verification rows: each speculating
    /// row proposes a draft (prompt lookup over its prompt and output, or
    /// the draft model's greedy tokens), at most its adaptive length, one
    /// token short of its `max_tokens` and of a prefill chunk. No row
    /// speculates in a step of more than `SpeculativeConfig::max_rows`
    /// ([`crate::speculative::MAX_SPECULATIVE_ROWS`]) decode rows.
    /// Verification rows move behind the plain decode rows (those are
    /// attended together), before the prefill rows.
    pub(super) fn speculate(&mut self, plan: &mut StepPlan) {
        let method = self.config.speculative.method;
        if !method.proposes() {
            return;
        }
        // A draft left by a failed step is not proposed again as is.
        for s in &mut self.running {
            s.draft.clear();
        }
        let decode = plan.decode_rows();
        if decode == 0 || decode > self.config.speculative.max_rows {
            return;
        }
        // (row of the plan, draft length) of every row that proposes.
        let mut wanted = Vec::new();
        for (i, r) in plan.rows[..decode].iter().enumerate() {
            let s = &mut self.running[r.seq];
            if !s.forks.is_empty() {
                continue;
            }
            // Every decode step counts for a paused row (it resumes after
            // `PAUSE_STEPS` whether or not its steps are pipelined).
            let k = s.speculation.next_step();
            let left = s
                .job
                .request
                .max_tokens
                .saturating_sub(s.usage.completion_tokens);
            let k = self.draft_room(k, left);
            if k > 0 {
                wanted.push((i, k));
            }
        }
        if method == SpeculativeMethod::Draft {
            self.draft_with_model(plan, &wanted);
        } else {
            for &(i, k) in &wanted {
                let s = &mut self.running[plan.rows[i].seq];
                s.draft = ngram_draft(&s.tokens, k).to_vec();
            }
        }
        let mut any = false;
        for &(i, _) in &wanted {
            let r = &mut plan.rows[i];
            let n = self.running[r.seq].draft.len();
            if n == 0 {
                continue;
            }
            r.draft = n;
            r.real = 1 + n;
            r.padded = r.real;
            any = true;
        }
        if any {
            // Stable: plain decode rows, verification rows, prefill rows.
            plan.rows
                .sort_by_key(|r| match (r.padded == 1, r.draft > 0) {
                    (true, _) => 0,
                    (false, true) => 1,
                    (false, false) => 2,
                });
        }
    }

    /// The draft model's proposals for the `(plan row, length)` pairs of
    /// `wanted`, into each sequence's `draft`. A row gets its draft
    /// sequence at its first proposal (from the draft's prefix cache), and
    /// its blocks filled with accepted tokens are donated to that cache at
    /// each round. When a round fails (an error, no blocks in the draft
    /// pool, a panic), no row of this step has a draft, the rows' draft
    /// sequences are dropped (they start again from the prefix cache) and
    /// the rows pause proposing.
    fn draft_with_model(&mut self, plan: &StepPlan, wanted: &[(usize, usize)]) {
        let Some(drafter) = self.drafter.as_mut() else {
            return;
        };
        if wanted.is_empty() {
            return;
        }
        for &(i, _) in wanted {
            let s = &mut self.running[plan.rows[i].seq];
            if let Some(kv) = &s.draft_kv {
                // Blocks the accepted tokens filled become hittable.
                let end = s.draft_computed.min(s.tokens.len());
                if s.job.request.cache_prompt {
                    if let Err(e) = drafter.kv.donate(kv, &s.tokens[..end]) {
                        tracing::warn!(error = %e, "donating draft blocks");
                    }
                }
                continue;
            }
            match drafter.new_sequence(&s.tokens, s.job.request.cache_prompt) {
                Ok((kv, cached)) => {
                    s.draft_kv = Some(kv);
                    s.draft_computed = cached;
                }
                Err(e) => tracing::warn!(error = %e, "a draft sequence"),
            }
        }
        let seqs: Vec<(usize, usize)> = wanted
            .iter()
            .map(|&(i, k)| (plan.rows[i].seq, k))
            .filter(|&(seq, _)| self.running[seq].draft_kv.is_some())
            .collect();
        let rows: Vec<DraftRow<'_>> = seqs
            .iter()
            .filter_map(|&(seq, k)| {
                let s = &self.running[seq];
                Some(DraftRow {
                    kv: s.draft_kv.as_ref()?,
                    tokens: &s.tokens,
                    computed: s.draft_computed,
                    k,
                })
            })
            .collect();
        let proposed =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drafter.propose(&rows)))
                .unwrap_or_else(|panic| Err(StepError::from_panic(&*panic)));
        drop(rows);
        match proposed {
            Ok(proposals) => {
                for (&(seq, _), p) in seqs.iter().zip(proposals) {
                    let s = &mut self.running[seq];
                    s.draft_computed = p.computed;
                    s.draft = p.draft;
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, rows = seqs.len(), "a draft round failed: no drafts this step");
                for &(seq, _) in &seqs {
                    let s = &mut self.running[seq];
                    s.draft_kv = None;
                    s.draft_computed = 0;
                    s.speculation.pause();
                }
            }
        }
    }

    /// What a verification row keeps: the number of its drafts the model
    /// agreed with. The row's tokens are picked here, position by position
    /// as plain decoding picks them, up to the first that differs from the
    /// draft (or ends the choice); the rejected drafts' positions are
    /// truncated from the cache (the row then advances by `1 + accepted`)
    /// and the picks wait in `Sequence::picks` for
    /// [`Worker::emit_verified`].
    ///
    /// # Errors
    /// A row output without a token or logits row per position, the
    /// grammar failing on a pick, or the truncation failing.
    pub(super) fn verify(&mut self, r: &PlannedRow, out: &RowOutput) -> Result<usize, StepError> {
        let seq = r.seq;
        let on_device = self.running[seq].samples_on_device();
        let outputs = if on_device {
            out.tokens.len()
        } else {
            out.logits_rows()
        };
        if outputs != r.real || self.running[seq].draft.len() != r.draft {
            return Err(StepError::Internal(
                "a verification row without an output per position",
            ));
        }
        let draft = std::mem::take(&mut self.running[seq].draft);
        let mut picks = Vec::with_capacity(r.real);
        for i in 0..r.real {
            let next = if on_device {
                NextToken::Sampled(out.tokens[i])
            } else {
                match out.logits_row(i) {
                    Some(row) => NextToken::Logits(row),
                    None => return Err(StepError::Internal("a verification row's logits")),
                }
            };
            let picked = self.pick(seq, next)?;
            let agrees = draft.get(i) == Some(&picked.token);
            let ends = picked.is_eos || picked.grammar_done;
            picks.push(picked);
            if !agrees || ends {
                break;
            }
        }
        let accepted = accepted_prefix(&draft, &picks.iter().map(|p| p.token).collect::<Vec<_>>());
        let s = &mut self.running[seq];
        s.picks = picks;
        let end = s.computed + 1 + accepted;
        if accepted < r.draft {
            // (A kept draft leaves the cache as it is: a step queued
            // behind this one may hold positions past `end`.)
            self.kv.truncate_tail(&s.kv, end)?;
        }
        if let (Some(drafter), Some(kv)) = (self.drafter.as_mut(), &s.draft_kv) {
            // The draft cache keeps only what the target accepted, then
            // its window groups trim; a failure here costs the row its
            // draft sequence, not its request.
            let kept = if s.draft_computed > end {
                drafter.kv.truncate_tail(kv, end).map(|()| end)
            } else {
                Ok(s.draft_computed)
            };
            match kept.and_then(|kept| drafter.kv.trim(kv).map(|()| kept)) {
                Ok(kept) => s.draft_computed = kept,
                Err(e) => {
                    tracing::warn!(error = %e, "truncating the draft cache");
                    s.draft_kv = None;
                    s.draft_computed = 0;
                }
            }
        }
        s.speculation.record(r.draft, accepted);
        let c = &mut self.counters;
        c.speculative_verifications += 1;
        c.speculative_proposed_tokens += r.draft as u64;
        c.speculative_accepted_tokens += accepted as u64;
        c.decode_tokens += accepted as u64;
        Ok(accepted)
    }

    /// Verifies and streams a verification row of a pipelined step
    /// ([`Worker::verify`] over its greedy `tokens`, then
    /// [`Worker::emit_verified`]). `guess`: the first token the draft was
    /// looked up after, when that token was in flight; a wrong guess says
    /// nothing of how well the row's drafts hold, so that verification
    /// leaves the row's adaptive draft length as it was. `ahead`: tokens
    /// of the row in a step queued behind this one, which assumed the
    /// whole draft kept; when a draft was rejected, that step was
    /// discarded (`ahead` is 0) unless the row stopped at an end of text
    /// inside its kept drafts, which ends it.
    pub(super) fn emit_pipelined_verification(
        &mut self,
        seq: usize,
        draft: &[u32],
        guess: Option<u32>,
        tokens: &[u32],
        ahead: usize,
    ) {
        let s = &mut self.running[seq];
        // The row's first token (emitted by the step before) is known now.
        let guessed_wrong = guess.is_some_and(|g| s.tokens.last() != Some(&g));
        let adaptive = s.speculation;
        s.draft = draft.to_vec();
        let row = PlannedRow {
            seq,
            real: tokens.len(),
            padded: tokens.len(),
            sample: true,
            draft: draft.len(),
        };
        let out = RowOutput {
            tokens: tokens.to_vec(),
            ..RowOutput::default()
        };
        let accepted = match self.verify(&row, &out) {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::error!(error = %e, "a pipelined verification failed");
                self.fail(seq, &e);
                return;
            }
        };
        if guessed_wrong {
            self.running[seq].speculation = adaptive;
        }
        let kept_ahead = if accepted == draft.len() { ahead } else { 0 };
        if let Err(e) = self.advance(seq, 1 + accepted, kept_ahead) {
            tracing::error!(error = %e, "row failed after its forward");
            self.fail(seq, &e);
            return;
        }
        self.emit_verified(seq);
        let id = self.running[seq].id;
        if ahead > kept_ahead && !self.done.contains(&id) {
            // Its queued step's positions were truncated with the
            // rejected drafts: only an end of text may stop it there.
            self.fail(
                seq,
                &StepError::Internal("a pipelined verification stopped short of its queued step"),
            );
        }
    }

    /// Streams a verification row's picks (its agreeing drafts and the
    /// model's token after them) until the choice ends, then donates the
    /// blocks they filled.
    pub(super) fn emit_verified(&mut self, seq: usize) {
        let picks = std::mem::take(&mut self.running[seq].picks);
        for picked in picks {
            match self.emit_picked(seq, picked) {
                Ok(Emitted::Continue) => {}
                Ok(Emitted::Finished | Emitted::Cancelled) => {
                    self.done.push(self.running[seq].id);
                    return;
                }
                Err(e) => {
                    self.fail(seq, &e);
                    return;
                }
            }
        }
        // Every position the cache holds has a known token again.
        if let Err(e) = self.donate_known(seq) {
            tracing::error!(error = %e, "donating a verified row's blocks");
        }
    }
}
