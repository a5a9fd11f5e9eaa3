//! One running choice of a request ([`Sequence`]), the one way to make
//! one ([`Sequence::new`]), and what its job decides for every choice.

use std::sync::Arc;
use std::time::Instant;

use mlxcel_kv::KvSequence;
use mlxcel_text::constraint::ConstrainedDecoder;
use mlxcel_text::detokenizer::IncrementalDetokenizer;
use mlxcel_text::output::{OutputFilter, ToolCallFormat};
use mlxcel_text::reasoning::ReasoningSplitter;

use super::{Job, ToolCallOutput};
use crate::api::{Timings, Usage};
use crate::logits::LogitsProcessor;
use crate::sampler::Sampler;
use crate::speculative::RowSpeculation;

/// One running choice of a request.
pub(super) struct Sequence {
    pub(super) id: u64,
    /// Shared by the request's choices.
    pub(super) job: Arc<Job>,
    /// The choice (0..n).
    pub(super) index: usize,
    /// Choice 0 before its first token: the other choices, forked from it
    /// once the prompt is computed (they share its blocks).
    pub(super) forks: Vec<Fork>,
    pub(super) kv: KvSequence,
    /// Prompt then sampled tokens.
    pub(super) tokens: Vec<u32>,
    /// Tokens whose K/V is cached.
    pub(super) computed: usize,
    /// Blocks it may need by its last token, per KV group.
    pub(super) worst_blocks: Vec<usize>,
    pub(super) sampler: Sampler,
    pub(super) processor: LogitsProcessor,
    pub(super) constraint: Option<ConstrainedDecoder>,
    /// Its draft length and acceptance (`crate::speculative`).
    pub(super) speculation: RowSpeculation,
    /// The draft tokens the step being run verifies (empty otherwise).
    pub(super) draft: Vec<u32>,
    /// A verified row's picked tokens, waiting to be streamed
    /// (`Worker::verify`, then `Worker::emit_verified`).
    pub(super) picks: Vec<super::emit::Picked>,
    /// Its sequence in the draft model's cache (`--speculative draft`),
    /// made at its first proposal.
    pub(super) draft_kv: Option<KvSequence>,
    /// Tokens whose K/V the draft model's cache holds.
    pub(super) draft_computed: usize,
    pub(super) detok: IncrementalDetokenizer,
    pub(super) filter: OutputFilter,
    pub(super) usage: Usage,
    pub(super) timings: Timings,
    pub(super) first_token_at: Option<Instant>,
    /// Prompt logprobs found so far (requests with `prompt_logprobs`),
    /// sent once the prompt is computed.
    pub(super) prompt_logprobs: Vec<crate::api::SampledLogprobs>,
    /// An embedding request's pooled hidden states so far (the sum of
    /// every position's for mean pooling, the last one's for last-token
    /// pooling); empty before its first.
    pub(super) pooled: Vec<f32>,
    pub(super) span: tracing::Span,
}

impl Sequence {
    /// How many of the `real` tokens a row runs from `computed` on are
    /// scored (their next token is a prompt token): none unless the
    /// request wants prompt logprobs.
    pub(super) fn scored_in_row(&self, real: usize) -> usize {
        if self.job.request.prompt_logprobs.is_none() {
            return 0;
        }
        let last_scored = self.job.prompt.len().saturating_sub(1);
        (self.computed + real)
            .min(last_scored)
            .saturating_sub(self.computed)
    }
}

impl Sequence {
    /// Whether its next token can be sampled on the device: a greedy
    /// choice with no logit processors, grammar, logprobs or choices still
    /// to fork (each of those needs the logits row on the host), and not
    /// an embedding request (which samples nothing: this keeps it out of
    /// the decode pipeline and speculation).
    pub(super) fn samples_on_device(&self) -> bool {
        self.forks.is_empty()
            && self.sampler.is_greedy()
            && self.processor.is_noop()
            && self.constraint.is_none()
            && self.job.request.logprobs.is_none()
            && self.job.embedding.is_none()
    }
}

/// How a sampling row's next token reaches [`Worker::emit`].
#[derive(Debug, Clone, Copy)]
pub(super) enum NextToken<'a> {
    /// Sampled on the device.
    Sampled(u32),
    /// Float32 logits `[vocab]` to process and sample on the host.
    Logits(&'a [f32]),
}

/// A choice still to fork from choice 0.
pub(super) struct Fork {
    pub(super) index: usize,
    pub(super) constraint: Option<ConstrainedDecoder>,
}

/// Where a new sequence starts: its place in the request and in the
/// cache ([`Sequence::new`], the one constructor: choice 0 at admission,
/// the other choices when they fork).
pub(super) struct Start {
    /// A fresh sequence id.
    pub(super) id: u64,
    /// The choice (0..n).
    pub(super) index: usize,
    pub(super) kv: KvSequence,
    /// Known tokens (the prompt, or the parent's tokens) and those whose
    /// K/V the cache holds.
    pub(super) tokens: Vec<u32>,
    pub(super) computed: usize,
    /// Blocks it may need by its last token, per KV group.
    pub(super) worst_blocks: Vec<usize>,
    /// Its logit processors (a fork continues its parent's).
    pub(super) processor: LogitsProcessor,
    pub(super) constraint: Option<ConstrainedDecoder>,
    /// Its speculation state (drafts of at most 0 tokens when it does not
    /// speculate).
    pub(super) speculation: RowSpeculation,
    /// Choice 0 before its prompt is computed: the other choices.
    pub(super) forks: Vec<Fork>,
    pub(super) usage: Usage,
    pub(super) timings: Timings,
    pub(super) span: tracing::Span,
}

impl Sequence {
    /// A running choice of `job` from `start`: its own sampler (choice `i`
    /// draws from the request's seed on ChaCha stream `i`), detokenizer
    /// and output filter.
    pub(super) fn new(job: Arc<Job>, start: Start) -> Self {
        let sampler = Sampler::new(&job.request.sampling);
        Sequence {
            id: start.id,
            index: start.index,
            forks: start.forks,
            kv: start.kv,
            tokens: start.tokens,
            computed: start.computed,
            worst_blocks: start.worst_blocks,
            sampler: match start.index {
                0 => sampler,
                i => sampler.with_stream(i as u64),
            },
            processor: start.processor,
            constraint: start.constraint,
            speculation: start.speculation,
            draft: Vec::new(),
            picks: Vec::new(),
            draft_kv: None,
            draft_computed: 0,
            detok: IncrementalDetokenizer::new(),
            filter: job.output_filter(),
            usage: start.usage,
            timings: start.timings,
            first_token_at: None,
            prompt_logprobs: Vec::new(),
            pooled: Vec::new(),
            span: start.span,
            job,
        }
    }
}

impl Job {
    /// A fresh output filter for one of its choices.
    pub(super) fn output_filter(&self) -> OutputFilter {
        let filter = match &self.tool_calls {
            ToolCallOutput::Off => OutputFilter::new(&self.request.stop, &[]),
            ToolCallOutput::Harmony => {
                OutputFilter::with_format(&self.request.stop, &[], ToolCallFormat::Harmony)
            }
            ToolCallOutput::Parsed(format) => {
                OutputFilter::with_format(&self.request.stop, &self.request.tools, *format)
            }
            ToolCallOutput::Forced { format, prefix } => {
                OutputFilter::forced_in(*format, &self.request.stop, &self.request.tools, prefix)
            }
        };
        match self.reasoning {
            Some((markers, open)) => filter.with_reasoning(ReasoningSplitter::new(markers, open)),
            None => filter,
        }
    }
}
