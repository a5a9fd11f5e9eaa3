//! Speculative decoding: a row proposes draft tokens, one forward verifies
//! them all, and the row keeps the longest prefix the model agrees with
//! plus the model's own next token (Leviathan et al. 2023, "Fast Inference
//! from Transformers via Speculative Decoding"; with greedy sampling the
//! output is the one plain decoding gives, token for token).
//!
//! The proposer here is *prompt lookup* (Saxena 2023, "Prompt Lookup
//! Decoding"; vLLM's n-gram proposer and llama.cpp's lookup decoding work
//! the same way): no second model; the last `n` tokens of the sequence
//! (prompt and output so far) are looked up earlier in the sequence, the
//! longest `n` first, its most recent occurrence winning, and the tokens
//! that followed it there are the draft. Replies that copy from the prompt
//! (code edits, quotes, summaries, JSON echoes) accept most drafts.
//!
//! How a verification runs (`crate::worker`): a decode row becomes a row
//! of `1 + draft` tokens (its last token, then the draft) with the model's
//! output at every position (the greedy token taken on the device,
//! `crate::runner::BatchRow::device_argmax`, for rows sampled there; the
//! logits rows otherwise); the runner keeps every position, the worker
//! picks the row's tokens as plain decoding would and truncates the
//! rejected drafts through the KV crate (`KvCache::truncate_tail`, every
//! KV group) before the row advances, so nothing unverified is ever
//! donated to the prefix cache.
//!
//! Every decode row may verify: greedy or sampled (temperature, top-p,
//! top-k, min-p), with logprobs, penalties, logit bias or a grammar. A
//! sampled row draws from its own random stream exactly as without
//! speculation and keeps the drafts its draws agree with, so the target
//! distribution is kept with the highest acceptance a point-mass draft
//! allows (`p(draft)`; see `crate::worker`'s speculate module), and a
//! seeded request gives the same tokens with or without speculation up to
//! floating-point differences between a verification row's logits and a
//! decode row's (a draw that lands within that distance of a boundary
//! between two tokens can differ; identical for every seed tested).

/// Shortest suffix that must recur for a draft (tokens).
pub const NGRAM_MIN: usize = 2;
/// Longest match length compared when choosing among occurrences
/// (tokens); longer matches count as this long.
pub const NGRAM_MAX: usize = 16;

/// How many draft tokens a row may propose per verification when nothing
/// else says (`--num-speculative-tokens`).
pub const DEFAULT_NUM_TOKENS: usize = 10;

/// Decode rows in one step above which no row speculates: the step is
/// large enough that the extra positions cost compute instead of riding on
/// the weight reads a single row pays anyway.
pub const MAX_SPECULATIVE_ROWS: usize = 8;

/// A row's acceptance rate (an exponential average of accepted / proposed
/// per verification) below which it stops proposing for
/// [`PAUSE_STEPS`] decode steps.
pub const PAUSE_BELOW: f32 = 0.2;
/// Decode steps a row with too low an acceptance rate does not propose.
pub const PAUSE_STEPS: u32 = 16;
/// Weight of the newest verification in the acceptance average.
const RATE_WEIGHT: f32 = 0.3;

/// `--speculative`: how decode rows propose draft tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SpeculativeMethod {
    /// No speculation: one token per row per step.
    #[default]
    Off,
    /// Prompt lookup (see the module docs).
    Ngram,
    /// A draft model (`--draft-model`) proposes each row's draft by greedy
    /// decoding (`crate::draft`).
    Draft,
    /// A draft model when one is given; else prompt lookup on a CPU, where
    /// it paid in every workload measured (1.03-1.61x,
    /// `benches/results/2026-12-02-speculative-cpu.json`), and on a GPU
    /// where verification rows are rows of the paged-attention kernel, or
    /// a step has one row ([`gpu_verification_fits`]):
    /// 1.17-2.12x at 1, 4 and 8 clients on every workload (H100,
    /// `benches/results/2026-12-06-speculative-h100.md`). Off on a GPU
    /// whose verification rows would each take an attention of their own
    /// (0.83-0.96x at 4 clients there), and under tensor parallelism.
    Auto,
}

/// Whether a GPU engine of `config`, over a model of `head_dim`, verifies
/// drafts without an attention per verification row: its steps of rows of
/// up to `1 + num_tokens` tokens attend every query as a row of the
/// paged-attention kernel (`mlxcel_model::step::queries_as_kernel_rows`:
/// the paged attention path over paged storage, rows of at most
/// `SHORT_ROW_TOKENS`, a head size and pool dtype the kernel reads, not
/// turned off by `MLXCEL_PAGED_SHORT_ROWS=0`), or it runs one row a step
/// (`parallel` 1), where that row's own attention is all a step has (as
/// in decode). Layers of a head size the kernel doesn't take (Gemma 4's
/// 512-wide global layers) still attend row by row.
pub fn gpu_verification_fits(config: &crate::EngineConfig, head_dim: usize) -> bool {
    use mlxcel_kv::{KvCacheDtype, StorageBackend};
    if config.attention_path != mlxcel_model::AttentionPath::PagedDecode {
        return false;
    }
    if config.parallel <= 1 {
        return true;
    }
    config.storage_backend != Some(StorageBackend::Dense)
        && config.speculative.num_tokens < mlxcel_model::step::SHORT_ROW_TOKENS
        && (config.kv_cache_dtype == KvCacheDtype::Auto || config.kv_cache_dtype.bits().is_some())
        && mlxcel_mlx::paged_attention_head_dim_fits(head_dim)
        && mlxcel_model::step::short_rows_enabled()
}

impl SpeculativeMethod {
    /// The method's name in flags and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            SpeculativeMethod::Off => "off",
            SpeculativeMethod::Ngram => "ngram",
            SpeculativeMethod::Draft => "draft",
            SpeculativeMethod::Auto => "auto",
        }
    }

    /// The method that runs: [`SpeculativeMethod::Auto`] decided for a
    /// GPU or CPU, with or without tensor parallelism and a draft model
    /// (a draft model given is used, on any device); the others as they
    /// are. `kernel_rows`: whether a GPU's verification steps attend in
    /// the paged-attention kernel or runs one row a step
    /// ([`gpu_verification_fits`]).
    pub fn resolve(
        self,
        gpu: bool,
        tensor_parallel: bool,
        draft_model: bool,
        kernel_rows: bool,
    ) -> Self {
        match self {
            SpeculativeMethod::Auto if draft_model => SpeculativeMethod::Draft,
            SpeculativeMethod::Auto if tensor_parallel || (gpu && !kernel_rows) => {
                SpeculativeMethod::Off
            }
            SpeculativeMethod::Auto => SpeculativeMethod::Ngram,
            m => m,
        }
    }

    /// Whether rows propose drafts under this (resolved) method.
    pub fn proposes(self) -> bool {
        matches!(self, SpeculativeMethod::Ngram | SpeculativeMethod::Draft)
    }
}

impl std::fmt::Display for SpeculativeMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Speculative decoding options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpeculativeConfig {
    pub method: SpeculativeMethod,
    /// Most draft tokens a row proposes per verification (at least 1).
    pub num_tokens: usize,
    /// Decode rows in one step above which no row speculates
    /// ([`MAX_SPECULATIVE_ROWS`] unless an embedder says otherwise).
    pub max_rows: usize,
}

impl Default for SpeculativeConfig {
    fn default() -> Self {
        SpeculativeConfig {
            method: SpeculativeMethod::Off,
            num_tokens: DEFAULT_NUM_TOKENS,
            max_rows: MAX_SPECULATIVE_ROWS,
        }
    }
}

/// Prompt lookup: the draft that follows the earlier occurrence of the
/// end of `tokens` that matches it longest (at least [`NGRAM_MIN`]
/// tokens, compared up to [`NGRAM_MAX`]), the most recent one among equals:
/// at most `k` tokens, and empty when no suffix recurs or `k` is 0. An
/// occurrence may overlap the suffix itself (a repeating run proposes its
/// continuation).
pub fn ngram_draft(tokens: &[u32], k: usize) -> &[u32] {
    let len = tokens.len();
    if k == 0 || len <= NGRAM_MIN {
        return &[];
    }
    let tail = &tokens[len - NGRAM_MIN..];
    let mut best: Option<(usize, usize)> = None; // (match length, end of occurrence)
                                                 // Occurrences end at `end < len` (strictly before the suffix's end),
                                                 // newest first, so a longer match must be strictly longer to win.
    for end in (NGRAM_MIN..len).rev() {
        if &tokens[end - NGRAM_MIN..end] != tail {
            continue;
        }
        let matched = NGRAM_MIN
            + (NGRAM_MIN..NGRAM_MAX.min(end))
                .take_while(|&j| tokens[end - 1 - j] == tokens[len - 1 - j])
                .count();
        if best.is_none_or(|(m, _)| matched > m) {
            best = Some((matched, end));
            if matched == NGRAM_MAX {
                break;
            }
        }
    }
    best.map_or(&[], |(_, end)| &tokens[end..(end + k).min(len)])
}

/// How many draft tokens the model agrees with: the length of the longest
/// prefix of `draft` equal to `verified` (the greedy token after the row's
/// last token and after each draft token, `draft.len() + 1` of them). The
/// row then keeps that many drafts and emits `verified[..=accepted]`.
pub fn accepted_prefix(draft: &[u32], verified: &[u32]) -> usize {
    draft
        .iter()
        .zip(verified)
        .take_while(|(d, v)| d == v)
        .count()
}

/// A row's speculation state: its draft length (adaptive) and acceptance.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct RowSpeculation {
    /// Draft tokens the next verification may propose (1..=max).
    k: usize,
    max: usize,
    /// Exponential average of accepted / proposed.
    rate: f32,
    /// Decode steps left without proposals.
    paused: u32,
}

impl RowSpeculation {
    /// A row that may propose up to `max` tokens (0: never).
    pub(crate) fn new(max: usize) -> Self {
        RowSpeculation {
            k: max,
            max,
            rate: 1.0,
            paused: 0,
        }
    }

    /// A decode step of the row begins: the draft tokens it may propose
    /// (0 while paused; a paused step counts down).
    pub(crate) fn next_step(&mut self) -> usize {
        if self.paused > 0 {
            self.paused -= 1;
            if self.paused == 0 {
                // Try again, half trusted.
                self.rate = 0.5;
                self.k = self.max.min(2);
            }
            return 0;
        }
        self.k
    }

    /// The draft tokens the row's next verification may propose, without
    /// counting a step (0 while paused).
    pub(crate) fn proposal(&self) -> usize {
        if self.active() {
            self.k
        } else {
            0
        }
    }

    /// Whether the row would propose this step (without counting down).
    pub(crate) fn active(&self) -> bool {
        self.max > 0 && self.paused == 0
    }

    /// Stops proposing for [`PAUSE_STEPS`] decode steps (a failed draft
    /// round).
    pub(crate) fn pause(&mut self) {
        if self.max > 0 {
            self.paused = PAUSE_STEPS;
        }
    }

    /// Records a verification of `proposed` drafts of which `accepted`
    /// held: the next draft grows by one after a full acceptance and
    /// shrinks to one past what held otherwise; a row whose average drops
    /// below [`PAUSE_BELOW`] pauses for [`PAUSE_STEPS`].
    pub(crate) fn record(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        let ratio = accepted as f32 / proposed as f32;
        self.rate = (1.0 - RATE_WEIGHT) * self.rate + RATE_WEIGHT * ratio;
        self.k = if accepted == proposed {
            (self.k + 1).min(self.max)
        } else {
            (accepted + 1).min(self.max)
        };
        if self.rate < PAUSE_BELOW {
            self.paused = PAUSE_STEPS;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_match_wins_then_the_most_recent_occurrence() {
        // The end [.., 7, 8, 9] matches 3 tokens at 1..4 (followed by 4,
        // 5) and only [8, 9] more recently at 6..8 (followed by 1): the
        // longer match wins.
        let t = [0, 7, 8, 9, 4, 5, 8, 9, 1, 7, 8, 9];
        assert_eq!(ngram_draft(&t, 3), &[4, 5, 8]);
        // Two occurrences of [3, 4], both preceded by something else: the
        // most recent one.
        let t = [3, 4, 10, 11, 3, 4, 20, 21, 5, 3, 4];
        assert_eq!(ngram_draft(&t, 2), &[20, 21]);
        // Matches longer than NGRAM_MAX count as NGRAM_MAX: the most
        // recent of two long ones.
        let run: Vec<u32> = (100..100 + NGRAM_MAX as u32 + 4).collect();
        let mut t = run.clone();
        t.push(1);
        t.extend(&run);
        t.push(2);
        t.extend(&run);
        assert_eq!(ngram_draft(&t, 1), &[2]);
    }

    #[test]
    fn drafts_stop_at_k_and_at_the_end() {
        let t = [1, 2, 3, 4, 1, 2];
        assert_eq!(ngram_draft(&t, 10), &[3, 4, 1, 2]);
        assert_eq!(ngram_draft(&t, 1), &[3]);
        assert_eq!(ngram_draft(&t, 0), &[] as &[u32]);
        // A repeating run proposes its continuation (the overlapping
        // match ending one token back is the longest and newest).
        let t = [5, 5, 5, 5];
        assert_eq!(ngram_draft(&t, 3), &[5]);
    }

    #[test]
    fn no_recurring_suffix_no_draft() {
        assert!(ngram_draft(&[1, 2, 3, 4, 5], 4).is_empty());
        assert!(ngram_draft(&[1], 4).is_empty());
        assert!(ngram_draft(&[], 4).is_empty());
        // A single recurring token is below the shortest n-gram.
        assert!(ngram_draft(&[9, 1, 2, 9], 4).is_empty());
    }

    #[test]
    fn auto_is_prompt_lookup_where_verification_is_cheap() {
        use SpeculativeMethod::*;
        assert_eq!(Auto.resolve(false, false, false, false), Ngram);
        assert_eq!(Auto.resolve(true, false, false, true), Ngram);
        assert_eq!(Auto.resolve(true, false, false, false), Off);
        assert_eq!(Auto.resolve(false, true, false, true), Off);
        assert_eq!(Ngram.resolve(true, false, false, false), Ngram);
        assert_eq!(Off.resolve(false, false, false, true), Off);
        assert_eq!(Auto.resolve(true, false, true, false), Draft);
        assert_eq!(Off.resolve(false, false, true, true), Off);
    }

    #[test]
    fn verification_fits_in_the_kernel_or_one_row() {
        use mlxcel_kv::{KvCacheDtype, StorageBackend};
        use mlxcel_model::AttentionPath;
        let config = |f: &dyn Fn(&mut crate::EngineConfig)| {
            let mut c = crate::EngineConfig::new("m".into());
            c.attention_path = AttentionPath::PagedDecode;
            c.parallel = 8;
            f(&mut c);
            c
        };
        assert!(gpu_verification_fits(&config(&|_| {}), 64));
        assert!(gpu_verification_fits(
            &config(&|c| c.kv_cache_dtype = KvCacheDtype::Int8),
            128
        ));
        assert!(gpu_verification_fits(
            &config(&|c| c.storage_backend = Some(StorageBackend::Paged)),
            256
        ));
        // One row a step: its own attention, on any storage.
        let one = |c: &mut crate::EngineConfig| {
            c.parallel = 1;
            c.storage_backend = Some(StorageBackend::Dense);
        };
        assert!(gpu_verification_fits(&config(&one), 80));
        // Each verification row would take an attention of its own.
        let dense = |c: &mut crate::EngineConfig| c.storage_backend = Some(StorageBackend::Dense);
        assert!(!gpu_verification_fits(&config(&dense), 64));
        let batched = |c: &mut crate::EngineConfig| c.attention_path = AttentionPath::BatchedDecode;
        assert!(!gpu_verification_fits(&config(&batched), 64));
        let long = |c: &mut crate::EngineConfig| c.speculative.num_tokens = 16;
        assert!(!gpu_verification_fits(&config(&long), 64));
        let cast = |c: &mut crate::EngineConfig| c.kv_cache_dtype = KvCacheDtype::Float32;
        assert!(!gpu_verification_fits(&config(&cast), 64));
        assert!(!gpu_verification_fits(&config(&|_| {}), 80));
        assert!(!gpu_verification_fits(&config(&|_| {}), 512));
    }

    #[test]
    fn acceptance_is_the_agreeing_prefix() {
        assert_eq!(accepted_prefix(&[1, 2, 3], &[1, 2, 3, 4]), 3);
        assert_eq!(accepted_prefix(&[1, 2, 3], &[1, 5, 3, 4]), 1);
        assert_eq!(accepted_prefix(&[1, 2, 3], &[0, 2, 3, 4]), 0);
        assert_eq!(accepted_prefix(&[], &[7]), 0);
    }

    #[test]
    fn the_draft_length_adapts_and_pauses() {
        let mut r = RowSpeculation::new(4);
        assert_eq!(r.next_step(), 4);
        r.record(4, 1);
        assert_eq!(r.next_step(), 2, "one past what held");
        r.record(2, 2);
        assert_eq!(r.next_step(), 3, "grows after a full acceptance");
        // Rejections drive the average under the threshold: a pause.
        for _ in 0..6 {
            r.record(3, 0);
        }
        assert!(!r.active());
        for _ in 0..PAUSE_STEPS {
            assert_eq!(r.next_step(), 0);
        }
        assert!(r.active());
        assert_eq!(r.next_step(), 2, "resumes with a short draft");
        assert_eq!(RowSpeculation::new(0).next_step(), 0);
        assert!(!RowSpeculation::new(0).active());
        // A failed draft round pauses a row; a row that never speculates
        // stays off.
        let mut r = RowSpeculation::new(3);
        r.pause();
        assert!(!r.active());
        for _ in 0..PAUSE_STEPS {
            assert_eq!(r.next_step(), 0);
        }
        assert!(r.active());
        let mut off = RowSpeculation::new(0);
        off.pause();
        assert_eq!(off.next_step(), 0);
    }
}
