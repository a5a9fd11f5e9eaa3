//! Admission (a waiting request becomes choice 0 of a running sequence
//! when the pool can hold it to its last token) and the forking of a
//! request's other choices once its prompt is computed.

use std::sync::Arc;

use crate::api::{Timings, Usage};
use crate::error::StepError;
use crate::logits::LogitsProcessor;

use super::sequence::{Fork, Sequence, Start};
use super::{Job, Worker};

impl Worker<'_> {
    /// Admits waiting requests, in order, while a slot is free and the pool
    /// can hold each to its last token on top of what running ones may
    /// still take. A request that doesn't fit waits (and so do later ones).
    pub(super) fn admit(&mut self) {
        let rule = self.config.admission(&self.kv);
        while let Some(job) = self.waiting.front() {
            // Choices still to fork hold their slots already.
            let slots: usize = self.running.iter().map(|s| 1 + s.forks.len()).sum();
            if slots + job.request.n.max(1) > self.config.parallel {
                break;
            }
            let need: Vec<usize> = rule
                .request(job.prompt.len(), job.request.max_tokens, job.request.n)
                .iter()
                .map(|r| r.total)
                .collect();
            let running = self
                .running
                .iter()
                .map(|s| (&s.kv, s.worst_blocks.as_slice()));
            if !self.kv.fits(&need, running) {
                break;
            }
            let Some(job) = self.waiting.pop_front() else {
                break;
            };
            match self.new_sequence(job, need) {
                Ok(seq) => self.running.push(seq),
                Err((job, e)) => {
                    tracing::error!(error = %e, "prefix lookup failed");
                    let _ = job.events.send(StepError::from(e).event());
                }
            }
        }
    }

    /// Choice 0 of `job`, its prompt prefix taken from the prefix cache
    /// unless the request opted out; the other choices wait in its `forks`.
    /// `worst_blocks` covers every choice.
    #[allow(clippy::result_large_err)]
    fn new_sequence(
        &mut self,
        mut job: Job,
        worst_blocks: Vec<usize>,
    ) -> Result<Sequence, (Job, mlxcel_kv::KvError)> {
        // A scored prompt is computed whole: cached tokens have no logits;
        // so is a mean-pooled embedding: cached tokens have no hidden
        // states (a last-token one recomputes its last token on any hit).
        let whole = job.request.prompt_logprobs.is_some()
            || job.embedding == Some(mlxcel_model::pooling::Pooling::Mean);
        let (kv, cached) = if job.request.cache_prompt && !whole {
            // Each KV group starts where a cold run is at the last chunk
            // boundary (`KvCache::new_sequence_for_prompt_chunked`).
            let chunk = self.config.scheduler.prefill_chunk_size;
            match self.kv.new_sequence_for_prompt_chunked(&job.prompt, chunk) {
                Ok(found) => found,
                Err(e) => return Err((job, e)),
            }
        } else {
            (self.kv.new_sequence(), 0)
        };
        let mut constraints = std::mem::take(&mut job.constraints).into_iter();
        let first = constraints.next();
        let forks = (1..job.request.n.max(1))
            .map(|index| Fork {
                index,
                constraint: constraints.next(),
            })
            .collect();
        let id = self.next_id;
        self.next_id += 1;
        let span = tracing::info_span!(
            "request",
            id,
            prompt_tokens = job.prompt.len(),
            cached_tokens = cached
        );
        let start = Start {
            id,
            index: 0,
            kv,
            tokens: job.prompt.clone(),
            computed: cached,
            worst_blocks,
            processor: LogitsProcessor::new(
                &job.request.sampling,
                &job.request.logit_bias,
                &job.prompt,
            )
            .with_min_tokens(job.request.min_tokens, &self.text.eos),
            constraint: first,
            speculation: self.row_speculation(&job),
            forks,
            usage: Usage {
                prompt_tokens: job.prompt.len(),
                completion_tokens: 0,
                cached_tokens: cached,
            },
            timings: Timings::default(),
            span,
        };
        Ok(Sequence::new(Arc::new(job), start))
    }

    /// Forks choice 0 (at `seq`, its prompt just computed) into the
    /// request's other choices; returns their indices in `running`. Each
    /// shares its blocks and samples from the same logits with its own
    /// generator (the seed on ChaCha stream `index`).
    pub(super) fn fork_choices(&mut self, seq: usize) -> Result<Vec<usize>, StepError> {
        let forks = std::mem::take(&mut self.running[seq].forks);
        let mut children = Vec::with_capacity(forks.len());
        let (prompt, max_tokens) = {
            let job = &self.running[seq].job;
            (job.prompt.len(), job.request.max_tokens)
        };
        // Each child may hold `own` blocks beyond the prompt's; choice 0
        // now promises only its own tokens.
        let rule = self
            .config
            .admission(&self.kv)
            .request(prompt, max_tokens, 1);
        let parent_worst: Vec<usize> = rule.iter().map(|r| r.total).collect();
        let own: Vec<usize> = rule.iter().map(|r| r.per_extra_choice).collect();
        for fork in forks {
            let parent = &self.running[seq];
            let kv = self.kv.fork(&parent.kv)?;
            let held = self.kv.group_blocks_held(&kv)?;
            let id = self.next_id;
            self.next_id += 1;
            let span = tracing::info_span!(parent: &parent.span, "choice", index = fork.index);
            let start = Start {
                id,
                index: fork.index,
                kv,
                tokens: parent.tokens.clone(),
                computed: parent.computed,
                worst_blocks: held.iter().zip(&own).map(|(h, o)| h + o).collect(),
                processor: parent.processor.clone(),
                constraint: fork.constraint,
                speculation: self.row_speculation(&parent.job),
                forks: Vec::new(),
                usage: parent.usage,
                timings: parent.timings,
                span,
            };
            children.push(Sequence::new(Arc::clone(&parent.job), start));
        }
        // All or none: a failed fork drops the children made so far.
        let first = self.running.len();
        self.running.extend(children);
        self.running[seq].worst_blocks = parent_worst;
        Ok((first..self.running.len()).collect())
    }
}
