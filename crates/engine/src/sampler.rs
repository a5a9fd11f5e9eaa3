//! Next-token sampling over one row of host-side logits.
//!
//! The algorithm is mlx-lm 0.32's `make_sampler` (`mlx_lm/sample_utils.py`),
//! so a seeded request here behaves like the same settings in mlx-lm (the
//! random streams differ, the distributions do not):
//!
//! 1. temperature 0 → argmax, the *first* index of the maximum (as
//!    `mx.argmax`), NaN logits ignored;
//! 2. otherwise the filters act on the *untempered* log-probabilities, in
//!    mlx-lm's order: `apply_top_p` (nucleus: keep the most likely tokens
//!    until their mass reaches `top_p`; every token tied with the last one
//!    kept stays), then `apply_min_p` (drop tokens with
//!    `p < min_p * p_max`), then `apply_top_k` (keep the `k` most likely);
//! 3. then `categorical(logprobs / temperature)` over the survivors.
//!
//! Why this order: each filter keeps a top slice of the same ranking, and
//! mlx-lm computes top-p's mass over the full distribution before the
//! others cut it, so the result is the shortest of the three slices. Doing
//! the filters before the temperature (unlike HF `transformers`, which
//! scales first) is what mlx-lm does: temperature changes which tokens are
//! likely *within* the kept set, never which tokens are kept. We mirror it
//! so that `mlx_lm.server` and mlxcel agree on what `top_p`/`min_p` mean.

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::api::SamplingParams;

/// A per-request sampler: the request's sampling settings plus its random
/// generator (ChaCha8, whose stream is the same on every platform for a
/// given seed).
#[derive(Debug, Clone)]
pub struct Sampler {
    temperature: f32,
    top_p: f32,
    top_k: usize,
    min_p: f32,
    rng: ChaCha8Rng,
}

/// One surviving token: id and its logit (finite).
#[derive(Debug, Clone, Copy)]
struct Candidate {
    id: u32,
    logit: f32,
}

impl Sampler {
    /// Builds a sampler from validated parameters. The generator is seeded
    /// from `params.seed` (`ChaCha8Rng::seed_from_u64`), or from the OS when
    /// it is `None` (falling back to the clock if the OS source fails).
    pub fn new(params: &SamplingParams) -> Self {
        let rng = match params.seed {
            Some(seed) => ChaCha8Rng::seed_from_u64(seed),
            None => ChaCha8Rng::try_from_os_rng().unwrap_or_else(|_| {
                let nanos = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(0);
                ChaCha8Rng::seed_from_u64(nanos)
            }),
        };
        Self {
            temperature: params.temperature,
            top_p: params.top_p,
            top_k: params.top_k,
            min_p: params.min_p,
            rng,
        }
    }

    /// The same seed on another of ChaCha's independent streams (choice
    /// `stream` of an `n`-choice request): choices of one seed never repeat
    /// each other or another seed's choices, and stream 0 is
    /// [`Sampler::new`]'s.
    pub fn with_stream(mut self, stream: u64) -> Self {
        self.rng.set_stream(stream);
        self
    }

    /// Whether this sampler is greedy (temperature 0, or not a positive
    /// number).
    pub fn is_greedy(&self) -> bool {
        self.temperature.is_nan() || self.temperature <= 0.0
    }

    /// Picks the next token from one row of logits (length = vocabulary
    /// size of the model's output, any scale; `-inf` masks a token). Greedy
    /// samplers take the first maximal index; others draw one random number.
    /// An empty or all-NaN row gives id 0.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.is_greedy() {
            return argmax(logits);
        }
        let candidates = self.candidates(logits, false);
        let Some(first) = candidates.first() else {
            return argmax(logits);
        };
        let scale = 1.0 / f64::from(self.temperature);
        let top = candidates
            .iter()
            .map(|c| f64::from(c.logit))
            .fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = candidates
            .iter()
            .map(|c| ((f64::from(c.logit) - top) * scale).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        let target = uniform01(&mut self.rng) * total;
        let mut cumulative = 0.0;
        for (c, w) in candidates.iter().zip(&weights) {
            cumulative += w;
            if cumulative > target {
                return c.id;
            }
        }
        // Rounding left `target` at the very top: the last token with weight.
        candidates
            .iter()
            .zip(&weights)
            .rev()
            .find(|(_, &w)| w > 0.0)
            .map_or(first.id, |(c, _)| c.id)
    }

    /// The ids a non-greedy draw can return for `logits`, most likely first
    /// (ties by lower id): the tokens left by top-p, min-p and top-k (see the
    /// module docs). Never empty when some logit is not NaN or `-inf`.
    pub fn support(&self, logits: &[f32]) -> Vec<u32> {
        self.candidates(logits, true).iter().map(|c| c.id).collect()
    }

    /// The surviving tokens. Sorted by [`rank`] when `sorted` or when top-p
    /// is on (it needs the order); otherwise in no particular order.
    fn candidates(&self, logits: &[f32], sorted: bool) -> Vec<Candidate> {
        let Some(max) = max_logit(logits) else {
            return Vec::new();
        };
        // min-p: p >= min_p * p_max  <=>  logit >= max + ln(min_p); the top
        // token always stays.
        let floor = if self.min_p > 0.0 {
            (max + self.min_p.ln()).min(max)
        } else {
            f32::NEG_INFINITY
        };
        let mut kept: Vec<Candidate> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| Candidate {
                id: i as u32,
                logit: sanitize(l),
            })
            .filter(|c| c.logit > f32::NEG_INFINITY && c.logit >= floor)
            .collect();
        let mut cut_by_top_k = false;
        if self.top_k > 0 && self.top_k < kept.len() {
            kept.select_nth_unstable_by(self.top_k - 1, rank);
            kept.truncate(self.top_k);
            cut_by_top_k = true;
        }
        if self.top_p > 0.0 && self.top_p < 1.0 {
            let max = f64::from(max);
            let total: f64 = logits.iter().map(|&l| prob(sanitize(l), max)).sum();
            apply_top_p(&mut kept, f64::from(self.top_p) * total, max);
        } else if sorted || cut_by_top_k {
            // After a selection the order is the std library's business;
            // sort so a seed gives the same tokens on every Rust release.
            kept.sort_unstable_by(rank);
        }
        kept
    }
}

/// Most likely first; equal logits by lower id.
fn rank(a: &Candidate, b: &Candidate) -> std::cmp::Ordering {
    b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id))
}

/// Unnormalized probability `exp(logit - max)`.
fn prob(logit: f32, max: f64) -> f64 {
    (f64::from(logit) - max).exp()
}

/// How many candidates the head-first shortcut of [`apply_top_p`] sorts.
const TOP_P_HEAD: usize = 1024;

/// Nucleus filter: sorts `kept` by [`rank`] and keeps the tokens whose
/// more-likely predecessors hold less than `limit` (= `top_p` x total mass
/// of the row), plus every token tied with the last one kept (mlx-lm's
/// `apply_top_p` keeps `logprob >= threshold`). At least one survives.
///
/// A full sort of a 150k vocabulary costs milliseconds per row, so the
/// [`TOP_P_HEAD`] most likely tokens are selected first; when they already
/// hold `limit` and the cut does not fall inside a tie at their boundary,
/// the rest cannot be kept and is never sorted.
fn apply_top_p(kept: &mut Vec<Candidate>, limit: f64, max: f64) {
    if kept.len() > TOP_P_HEAD {
        kept.select_nth_unstable_by(TOP_P_HEAD - 1, rank);
        let head_mass: f64 = kept[..TOP_P_HEAD].iter().map(|c| prob(c.logit, max)).sum();
        if head_mass >= limit {
            let mut head = kept[..TOP_P_HEAD].to_vec();
            head.sort_unstable_by(rank);
            let keep = top_p_len(&head, limit, max);
            if keep < TOP_P_HEAD {
                head.truncate(keep);
                *kept = head;
                return;
            }
        }
    }
    kept.sort_unstable_by(rank);
    let keep = top_p_len(kept, limit, max);
    kept.truncate(keep);
}

/// Number of leading `sorted` candidates nucleus sampling keeps (see
/// [`apply_top_p`]); 0 only when `sorted` is empty.
fn top_p_len(sorted: &[Candidate], limit: f64, max: f64) -> usize {
    let mut above = 0.0;
    let mut keep = 0;
    for c in sorted {
        if above >= limit {
            break;
        }
        above += prob(c.logit, max);
        keep += 1;
    }
    let Some(last) = sorted.get(keep.max(1) - 1) else {
        return 0;
    };
    let keep = keep.max(1);
    keep + sorted[keep..]
        .iter()
        .take_while(|c| c.logit >= last.logit)
        .count()
}

/// NaN counts as `-inf` (never chosen); `+inf` as the largest finite value.
fn sanitize(logit: f32) -> f32 {
    if logit.is_nan() {
        f32::NEG_INFINITY
    } else {
        logit.min(f32::MAX)
    }
}

/// The largest non-NaN, non-`-inf` logit.
fn max_logit(logits: &[f32]) -> Option<f32> {
    logits
        .iter()
        .map(|&l| sanitize(l))
        .filter(|&l| l > f32::NEG_INFINITY)
        .reduce(f32::max)
}

/// First index of the maximum, NaN ignored (0 for an empty or all-NaN row).
fn argmax(logits: &[f32]) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &l) in logits.iter().enumerate() {
        if l.is_nan() {
            continue;
        }
        if best.is_none_or(|(_, b)| l > b) {
            best = Some((i, l));
        }
    }
    best.map_or(0, |(i, _)| i as u32)
}

/// A uniform draw in `[0, 1)` with 53 random bits.
fn uniform01(rng: &mut ChaCha8Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_p: f32, top_k: usize, min_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_p,
            top_k,
            min_p,
            seed: Some(42),
            ..SamplingParams::default()
        }
    }

    /// Logits whose softmax is exactly `probs` (up to rounding).
    fn logits_of(probs: &[f64]) -> Vec<f32> {
        probs.iter().map(|p| p.ln() as f32).collect()
    }

    #[test]
    fn greedy_takes_the_first_maximum_and_ignores_nan() {
        let mut s = Sampler::new(&SamplingParams::greedy());
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 3.0]), 1);
        assert_eq!(s.sample(&[f32::NAN, 1.0, f32::NAN, 2.0]), 3);
        assert_eq!(s.sample(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
        assert_eq!(s.sample(&[f32::NAN, f32::NAN]), 0);
        assert_eq!(s.sample(&[]), 0);
        assert_eq!(s.sample(&[1.0, f32::INFINITY, f32::INFINITY]), 1);
    }

    #[test]
    fn same_seed_same_sequence() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 7919) % 13) as f32 * 0.3).collect();
        let draw = |seed| {
            let mut s = Sampler::new(&SamplingParams {
                seed: Some(seed),
                ..SamplingParams::default()
            });
            (0..200).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(1), draw(1));
        assert_ne!(draw(1), draw(2));
    }

    #[test]
    fn the_seeded_stream_is_pinned() {
        // Platform-stable: ChaCha8 + our own u64 -> f64 mapping. If this
        // changes, seeded requests change answers across releases.
        let mut s = Sampler::new(&params(1.0, 1.0, 0, 0.0));
        let ids: Vec<u32> = (0..12).map(|_| s.sample(&[0.0, 0.0, 0.0, 0.0])).collect();
        let mut rng = ChaCha8Rng::seed_from_u64(42);
        let want: Vec<u32> = (0..12)
            .map(|_| (uniform01(&mut rng) * 4.0) as u32)
            .collect();
        assert_eq!(ids, want);
    }

    #[test]
    fn top_k_one_is_greedy() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let mut s = Sampler::new(&params(1.5, 1.0, 1, 0.0));
        for _ in 0..200 {
            let logits: Vec<f32> = (0..30)
                .map(|_| (uniform01(&mut rng) * 10.0) as f32)
                .collect();
            assert_eq!(s.sample(&logits), argmax(&logits));
        }
        // Ties: the first index, like greedy.
        assert_eq!(s.sample(&[1.0, 5.0, 5.0]), 1);
    }

    #[test]
    fn frequencies_match_softmax() {
        let probs = [0.4, 0.25, 0.2, 0.1, 0.05];
        // Temperature 2 flattens: p_i^(1/2), renormalized.
        for (temperature, expected) in [
            (1.0f32, probs.to_vec()),
            (2.0, {
                let r: Vec<f64> = probs.iter().map(|p: &f64| p.sqrt()).collect();
                let z: f64 = r.iter().sum();
                r.iter().map(|x| x / z).collect()
            }),
        ] {
            let logits = logits_of(&probs);
            let mut s = Sampler::new(&params(temperature, 1.0, 0, 0.0));
            let draws = 20_000;
            let mut counts = [0usize; 5];
            for _ in 0..draws {
                counts[s.sample(&logits) as usize] += 1;
            }
            let chi2: f64 = counts
                .iter()
                .zip(&expected)
                .map(|(&c, &p)| {
                    let e = p * draws as f64;
                    (c as f64 - e).powi(2) / e
                })
                .sum();
            // 4 degrees of freedom: P(chi2 > 18.47) = 0.001.
            assert!(
                chi2 < 18.47,
                "T={temperature}: chi2 {chi2}, counts {counts:?}"
            );
        }
    }

    // The kept sets in the top-p / min-p / combined tests are those of
    // mlx-lm 0.32.2 in the venv, e.g. `apply_top_k(apply_top_p(lp, 0.85), 3)`
    // and `apply_min_p(lp, 0.19)` on `lp = log([0.1, 0.5, 0.05, 0.3, 0.05])`.
    #[test]
    fn top_p_keeps_the_smallest_set_reaching_the_mass() {
        let logits = logits_of(&[0.1, 0.5, 0.05, 0.3, 0.05]);
        // Ranked: 1 (0.5), 3 (0.3), 0 (0.1), 2/4 (0.05 each).
        assert_eq!(
            Sampler::new(&params(1.0, 0.45, 0, 0.0)).support(&logits),
            [1]
        );
        assert_eq!(
            Sampler::new(&params(1.0, 0.7, 0, 0.0)).support(&logits),
            [1, 3]
        );
        assert_eq!(
            Sampler::new(&params(1.0, 0.85, 0, 0.0)).support(&logits),
            [1, 3, 0]
        );
        // The token that crosses 0.92 is tied with the next: both stay.
        assert_eq!(
            Sampler::new(&params(1.0, 0.92, 0, 0.0)).support(&logits),
            [1, 3, 0, 2, 4]
        );
        // Tiny top_p still keeps one token.
        assert_eq!(
            Sampler::new(&params(1.0, 1e-6, 0, 0.0)).support(&logits),
            [1]
        );
        // Excluded tokens are never drawn.
        let mut s = Sampler::new(&params(1.0, 0.7, 0, 0.0));
        assert!((0..2000).all(|_| matches!(s.sample(&logits), 1 | 3)));
    }

    #[test]
    fn min_p_is_relative_to_the_top_probability() {
        let logits = logits_of(&[0.1, 0.5, 0.05, 0.3, 0.05]);
        // min_p 0.19: threshold 0.095 keeps 0.1 and drops the 0.05s.
        assert_eq!(
            Sampler::new(&params(1.0, 1.0, 0, 0.19)).support(&logits),
            [1, 3, 0]
        );
        assert_eq!(
            Sampler::new(&params(1.0, 1.0, 0, 0.5)).support(&logits),
            [1, 3]
        );
        assert_eq!(
            Sampler::new(&params(1.0, 1.0, 0, 0.7)).support(&logits),
            [1]
        );
        assert_eq!(
            Sampler::new(&params(1.0, 1.0, 0, 1.0)).support(&logits),
            [1]
        );
        let mut s = Sampler::new(&params(3.0, 1.0, 0, 0.5));
        assert!((0..2000).all(|_| matches!(s.sample(&logits), 1 | 3)));
    }

    #[test]
    fn filters_combine_as_the_shortest_slice() {
        let logits = logits_of(&[0.1, 0.5, 0.05, 0.3, 0.05]);
        assert_eq!(
            Sampler::new(&params(1.0, 0.85, 2, 0.0)).support(&logits),
            [1, 3]
        );
        assert_eq!(
            Sampler::new(&params(1.0, 0.7, 4, 0.0)).support(&logits),
            [1, 3]
        );
        assert_eq!(
            Sampler::new(&params(1.0, 0.99, 4, 0.15)).support(&logits),
            [1, 3, 0]
        );
        // top-p's mass is measured on the full distribution, before top-k
        // cuts it (mlx-lm's order): 0.5 + 0.3 < 0.85 keeps token 0. Had top-k
        // run first and renormalized, (0.5 + 0.3) / 0.9 >= 0.85 would drop it.
        assert_eq!(
            Sampler::new(&params(1.0, 0.85, 3, 0.0)).support(&logits),
            [1, 3, 0]
        );
        // Temperature does not change the kept set.
        assert_eq!(
            Sampler::new(&params(5.0, 0.7, 0, 0.0)).support(&logits),
            [1, 3]
        );
    }

    /// Reference nucleus filter: full sort, keep while the mass above is
    /// below `top_p`, then every token tied with the last kept.
    fn naive_top_p(logits: &[f32], top_p: f64) -> Vec<u32> {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let p: Vec<f64> = logits.iter().map(|&l| (f64::from(l - max)).exp()).collect();
        let total: f64 = p.iter().sum();
        let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
        ids.sort_by(|&a, &b| {
            logits[b as usize]
                .total_cmp(&logits[a as usize])
                .then(a.cmp(&b))
        });
        let mut above = 0.0;
        let mut keep = Vec::new();
        for &id in &ids {
            if above >= top_p * total {
                break;
            }
            above += p[id as usize];
            keep.push(id);
        }
        let last = logits[*keep.last().unwrap() as usize];
        keep.extend(
            ids[keep.len()..]
                .iter()
                .take_while(|&&id| logits[id as usize] >= last),
        );
        keep
    }

    #[test]
    fn large_vocab_top_p_matches_a_full_sort() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        for round in 0..16 {
            // Peaked or flat rows, logits rounded to create many ties.
            let spread = if round % 2 == 0 { 12.0 } else { 0.5 };
            let logits: Vec<f32> = (0..20_000)
                .map(|_| ((uniform01(&mut rng) * spread * 4.0).round() / 4.0) as f32)
                .collect();
            for top_p in [0.01f32, 0.3, 0.9, 0.999] {
                let got = Sampler::new(&params(1.0, top_p, 0, 0.0)).support(&logits);
                assert_eq!(
                    got,
                    naive_top_p(&logits, f64::from(top_p)),
                    "round {round} p {top_p}"
                );
            }
        }
    }

    #[test]
    fn masked_and_nan_logits_are_never_drawn() {
        let logits = [f32::NAN, 0.0, f32::NEG_INFINITY, 0.0];
        let mut s = Sampler::new(&params(1.0, 1.0, 0, 0.0));
        assert!((0..1000).all(|_| matches!(s.sample(&logits), 1 | 3)));
        assert_eq!(s.support(&logits), [1, 3]);
        assert_eq!(s.support(&[f32::NAN]), Vec::<u32>::new());
        assert_eq!(s.sample(&[f32::NAN, f32::NAN]), 0);
        let mut s = Sampler::new(&params(1.0, 0.5, 0, 0.1));
        assert_eq!(s.sample(&[f32::NEG_INFINITY, f32::INFINITY, 1.0]), 1);
    }

    #[test]
    fn unseeded_samplers_differ() {
        let logits = vec![0.0f32; 1000];
        let draw = || {
            let mut s = Sampler::new(&SamplingParams::default());
            (0..20).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_ne!(draw(), draw());
    }
}
