//! Logit processors applied before sampling, and log-probabilities.
//!
//! Order per position (the same as vLLM's and mlx-lm's): logit bias, then
//! the repetition penalty, then presence/frequency penalties; then the
//! grammar mask (in the worker); log-probabilities are read from the result,
//! before temperature and the sampler's filters.
//!
//! - `logit_bias` (OpenAI): `logit[id] += bias`.
//! - Presence / frequency penalties (OpenAI's definition): for each token
//!   generated `c > 0` times, `logit -= presence + c * frequency`. Prompt
//!   tokens do not count.
//! - Repetition penalty (CTRL, Keskar et al. 2019; `transformers`'
//!   `RepetitionPenaltyLogitsProcessor`): for each distinct token among the
//!   last [`REPETITION_CONTEXT`] tokens (prompt and completion), a positive
//!   logit is divided by the penalty and a negative one multiplied. The
//!   window is mlx-lm's `repetition_context_size` default.

use std::collections::{HashMap, VecDeque};

use crate::api::SamplingParams;

/// Tokens the repetition penalty looks back over (mlx-lm's default).
pub const REPETITION_CONTEXT: usize = 20;

/// One choice's processors and the token history they need.
#[derive(Debug, Clone)]
pub struct LogitsProcessor {
    presence: f32,
    frequency: f32,
    repetition: f32,
    bias: Vec<(u32, f32)>,
    /// Times each token was generated.
    counts: HashMap<u32, u32>,
    /// The last [`REPETITION_CONTEXT`] tokens, prompt included.
    recent: VecDeque<u32>,
    /// End-of-sequence ids banned until `min_tokens` tokens were recorded.
    eos: Vec<u32>,
    min_tokens: usize,
    /// Tokens recorded.
    generated: usize,
}

impl LogitsProcessor {
    /// Processors of one choice of a request with `params` and `bias`,
    /// whose prompt is `prompt`.
    pub fn new(params: &SamplingParams, bias: &[(u32, f32)], prompt: &[u32]) -> Self {
        let tail = prompt.len().saturating_sub(REPETITION_CONTEXT);
        Self {
            presence: params.presence_penalty,
            frequency: params.frequency_penalty,
            repetition: params.repetition_penalty,
            bias: bias.to_vec(),
            counts: HashMap::new(),
            recent: prompt[tail..].iter().copied().collect(),
            eos: Vec::new(),
            min_tokens: 0,
            generated: 0,
        }
    }

    /// Bans the `eos` token ids until `min_tokens` tokens were generated
    /// (vLLM's `min_tokens`).
    pub fn with_min_tokens(mut self, min_tokens: usize, eos: &[u32]) -> Self {
        self.min_tokens = min_tokens;
        self.eos = eos.to_vec();
        self
    }

    /// True when [`LogitsProcessor::apply`] changes nothing.
    pub fn is_noop(&self) -> bool {
        self.bias.is_empty()
            && self.presence == 0.0
            && self.frequency == 0.0
            && self.repetition == 1.0
            && (self.generated >= self.min_tokens || self.eos.is_empty())
    }

    /// Applies bias and penalties to one row of logits (ids past the row's
    /// end are ignored).
    pub fn apply(&self, logits: &mut [f32]) {
        for &(id, bias) in &self.bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += bias;
            }
        }
        if self.repetition != 1.0 {
            let mut seen: Vec<u32> = self.recent.iter().copied().collect();
            seen.sort_unstable();
            seen.dedup();
            for id in seen {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l = if *l > 0.0 {
                        *l / self.repetition
                    } else {
                        *l * self.repetition
                    };
                }
            }
        }
        if self.presence != 0.0 || self.frequency != 0.0 {
            for (&id, &count) in &self.counts {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l -= self.presence + count as f32 * self.frequency;
                }
            }
        }
        if self.generated < self.min_tokens {
            for &id in &self.eos {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
    }

    /// Records a generated token.
    pub fn record(&mut self, token: u32) {
        self.generated += 1;
        *self.counts.entry(token).or_insert(0) += 1;
        if self.recent.len() == REPETITION_CONTEXT {
            self.recent.pop_front();
        }
        self.recent.push_back(token);
    }
}

/// Smallest log-probability reported: OpenAI's floor for tokens whose
/// probability underflows, so every reported value is a finite number.
pub const MIN_LOGPROB: f32 = -9999.0;

/// Natural-log probabilities from one row of logits: that of `token`, and
/// the `k` most likely tokens that are not masked (most likely first, ties
/// by lower id). NaN logits count as `-inf` and `+inf` as the largest
/// finite value; every value returned is at least [`MIN_LOGPROB`].
pub fn log_probs(logits: &[f32], token: u32, k: usize) -> (f32, Vec<(u32, f32)>) {
    let clean = |l: f32| {
        if l.is_nan() {
            f32::NEG_INFINITY
        } else {
            l.min(f32::MAX)
        }
    };
    let max = logits
        .iter()
        .map(|&l| clean(l))
        .fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return (MIN_LOGPROB, Vec::new());
    }
    let sum: f64 = logits
        .iter()
        .map(|&l| f64::from(clean(l) - max).exp())
        .sum();
    // (l - max) - ln(sum): exact even when max is huge.
    let log_sum = sum.ln();
    let lp = |l: f32| ((f64::from(clean(l)) - f64::from(max) - log_sum) as f32).max(MIN_LOGPROB);
    let chosen = logits.get(token as usize).map_or(MIN_LOGPROB, |&l| lp(l));
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    let k = k.min(ids.len());
    let rank = |a: &u32, b: &u32| {
        clean(logits[*b as usize])
            .total_cmp(&clean(logits[*a as usize]))
            .then(a.cmp(b))
    };
    if k > 0 && k < ids.len() {
        ids.select_nth_unstable_by(k - 1, rank);
    }
    ids.truncate(k);
    ids.retain(|&id| clean(logits[id as usize]) > f32::NEG_INFINITY);
    ids.sort_unstable_by(rank);
    let top = ids
        .into_iter()
        .map(|id| (id, lp(logits[id as usize])))
        .collect();
    (chosen, top)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(presence: f32, frequency: f32, repetition: f32) -> SamplingParams {
        SamplingParams {
            presence_penalty: presence,
            frequency_penalty: frequency,
            repetition_penalty: repetition,
            ..SamplingParams::greedy()
        }
    }

    #[test]
    fn bias_and_openai_penalties_follow_their_definitions() {
        let mut p = LogitsProcessor::new(&params(0.5, 0.25, 1.0), &[(1, 3.0), (9, 1.0)], &[0]);
        assert!(!p.is_noop());
        p.record(2);
        p.record(2);
        p.record(3);
        let mut logits = vec![1.0, 1.0, 1.0, 1.0];
        p.apply(&mut logits);
        // id 1: +3 bias; id 2: -(0.5 + 2*0.25); id 3: -(0.5 + 0.25);
        // id 0 is a prompt token: untouched; id 9 is out of range.
        assert_eq!(logits, vec![1.0, 4.0, 0.0, 0.25]);
    }

    #[test]
    fn min_tokens_bans_eos_until_enough_tokens_were_generated() {
        let mut p =
            LogitsProcessor::new(&params(0.0, 0.0, 1.0), &[], &[0]).with_min_tokens(2, &[3]);
        for step in 0..3 {
            // Device sampling must wait while the ban holds.
            assert_eq!(p.is_noop(), step >= 2, "step {step}");
            let mut logits = vec![1.0; 4];
            p.apply(&mut logits);
            let banned = if step < 2 { f32::NEG_INFINITY } else { 1.0 };
            assert_eq!(logits, vec![1.0, 1.0, 1.0, banned], "step {step}");
            p.record(1);
        }
        assert!(LogitsProcessor::new(&params(0.0, 0.0, 1.0), &[], &[0])
            .with_min_tokens(0, &[3])
            .is_noop());
    }

    #[test]
    fn repetition_penalty_scales_recent_tokens_by_sign() {
        let prompt: Vec<u32> = (0..30).map(|i| i % 4 + 10).collect();
        let mut p = LogitsProcessor::new(&params(0.0, 0.0, 2.0), &[], &prompt);
        p.record(1);
        let mut logits = vec![
            4.0, 4.0, -4.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 6.0, -6.0, 6.0,
        ];
        p.apply(&mut logits);
        assert_eq!(logits[0], 4.0, "not in the window");
        assert_eq!(logits[1], 2.0, "generated: divided");
        assert_eq!(logits[10], 3.0);
        assert_eq!(logits[11], -12.0, "negative: multiplied");
        assert_eq!(logits[12], 3.0);
    }

    #[test]
    fn the_repetition_window_slides() {
        let mut p = LogitsProcessor::new(&params(0.0, 0.0, 2.0), &[], &[5]);
        for _ in 0..REPETITION_CONTEXT {
            p.record(7);
        }
        let mut logits = vec![2.0; 8];
        p.apply(&mut logits);
        assert_eq!(logits[5], 2.0, "the prompt token slid out");
        assert_eq!(logits[7], 1.0);
    }

    #[test]
    fn defaults_change_nothing() {
        let p = LogitsProcessor::new(&SamplingParams::default(), &[], &[1, 2, 3]);
        assert!(p.is_noop());
    }

    #[test]
    fn log_probs_are_a_log_softmax_with_sorted_top_k() {
        let logits = [
            0.0_f32,
            (2.0f32).ln(),
            f32::NEG_INFINITY,
            (5.0f32).ln(),
            f32::NAN,
        ];
        let (lp, top) = log_probs(&logits, 1, 3);
        assert!((lp - (2.0f32 / 8.0).ln()).abs() < 1e-6);
        let ids: Vec<u32> = top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![3, 1, 0]);
        assert!((top[0].1 - (5.0f32 / 8.0).ln()).abs() < 1e-6);
        let (masked, top) = log_probs(&logits, 2, 5);
        assert_eq!(masked, MIN_LOGPROB);
        assert_eq!(top.len(), 3, "masked tokens are not alternatives");
        // An infinite logit (a penalty divided by ~0) stays finite.
        let (lp, top) = log_probs(&[f32::INFINITY, 1.0, f32::INFINITY], 1, 2);
        assert_eq!(lp, MIN_LOGPROB);
        assert!((top[0].1 - 0.5f32.ln()).abs() < 1e-6);
        let total: f32 = top.iter().map(|t| t.1.exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
    }
}
