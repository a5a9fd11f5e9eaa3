//! Admission arithmetic: how many blocks a request may hold at worst, and
//! how many tokens it may generate in a pool of a given size. The engine
//! asks these questions here and nowhere else; every answer is a closed
//! form (no search), so admission costs O(1) whatever the pool size.
//!
//! A sequence holding `t` tokens holds at worst `ceil((h(t) + pad) / bs) +
//! 1` blocks, `bs` the block size: `pad` is the pad tokens a tiled prefill
//! chunk writes past its real end (`tile - 1`, 0 without tiles), the `+ 1`
//! a block that a window (or a shared prompt's copy-on-write) leaves
//! partly used. `h(t)` is `t` without a window; with a keep of `w` keys,
//! the sequence keeps `w` keys between steps and a prefill chunk of up to
//! `chunk` tokens on top, starting mid-block: `h(t) = min(t, w + chunk) +
//! bs`. Pipelined decode holds `w + 2` (the queued step's key kept, the
//! next step's slot): within `w + chunk` for chunks of 2 or more, and
//! within the `+ bs` slack for a chunk of 1.
//!
//! A request of `p` prompt tokens and `n` choices of up to `m` new tokens
//! holds at worst `W(p + m) + (n - 1) · W(m + bs)`: the first choice all its
//! tokens, each other choice its own tokens and a copy of the prompt's last
//! block (the prompt's full blocks are shared).

/// The admission rule of one KV cache and scheduler configuration
/// (built with [`Admission::new`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    /// Tokens per block (at least 1).
    block_size: usize,
    /// Pad tokens a prefill chunk may write past its real end: the prefill
    /// tile minus one, 0 without tiles.
    pad: usize,
    /// Keys a sequence keeps between steps (`--max-kv-size`, a model's
    /// window); `None`: all of them.
    window: Option<usize>,
    /// The longest prefill chunk, in tokens (what a windowed sequence
    /// holds on top of its window during a step).
    chunk: usize,
}

/// Blocks a request may hold at worst ([`Admission::request`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestBlocks {
    /// The whole request, every choice.
    pub total: usize,
    /// What each choice after the first may hold beyond the shared prompt.
    pub per_extra_choice: usize,
}

impl Admission {
    /// The rule for `block_size`-token blocks, prefill tiles of `tile`
    /// tokens (0: none), a window of `window` keys and prefill chunks of up
    /// to `chunk` tokens.
    pub fn new(block_size: usize, tile: usize, window: Option<usize>, chunk: usize) -> Self {
        Admission {
            block_size: block_size.max(1),
            pad: tile.saturating_sub(1),
            window,
            chunk,
        }
    }

    /// `ceil((h(t) + pad) / bs)`, the blocks of `t` tokens before the
    /// partial block (see the module docs).
    fn ceil_blocks(&self, tokens: usize) -> usize {
        let held = match self.window {
            Some(w) => tokens.min(w.saturating_add(self.chunk)) + self.block_size,
            None => tokens,
        };
        (held + self.pad).div_ceil(self.block_size)
    }

    /// Blocks one sequence holding `tokens` tokens may hold at worst.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        self.ceil_blocks(tokens) + 1
    }

    /// Blocks a request of `prompt` tokens and `n` choices (at least 1) of
    /// up to `max_tokens` new tokens may hold at worst.
    pub fn request(&self, prompt: usize, max_tokens: usize, n: usize) -> RequestBlocks {
        let per_extra_choice = self.blocks_for(max_tokens + self.block_size);
        RequestBlocks {
            total: self.blocks_for(prompt + max_tokens) + n.saturating_sub(1) * per_extra_choice,
            per_extra_choice,
        }
    }

    /// Blocks that hold no request's tokens: what the empty request costs
    /// (the partial block and the pad); a pool needs more than this.
    pub fn slack(&self) -> usize {
        self.blocks_for(0)
    }

    /// Longest sequence (prompt and new tokens) a pool of `pool_blocks`
    /// blocks holds alone; `usize::MAX` when a window bounds what any
    /// sequence holds below that.
    pub fn max_request_tokens(&self, pool_blocks: usize) -> usize {
        let pool_tokens = pool_blocks.saturating_sub(self.slack()) * self.block_size;
        match self.window {
            Some(w) if w.saturating_add(self.chunk) + self.block_size <= pool_tokens => usize::MAX,
            _ => pool_tokens,
        }
    }

    /// The most new tokens (at most `want`) that a request of `prompt`
    /// tokens and `n` choices may generate within `pool_blocks` blocks;
    /// `None` when not even one fits. Closed form (see the module docs):
    /// the worst case is a sum of two ceilings of `m` and is inverted
    /// piece by piece where a window caps either term.
    pub fn max_new_tokens(
        &self,
        prompt: usize,
        n: usize,
        pool_blocks: usize,
        want: usize,
    ) -> Option<usize> {
        let n = n.max(1);
        let fits = |m: usize| self.request(prompt, m, n).total <= pool_blocks;
        if want == 0 || !fits(1) {
            return None;
        }
        if fits(want) {
            return Some(want);
        }
        let bs = self.block_size as i128;
        // Budget of the two ceilings: total = c1 + (n-1)·c2 + n.
        let k = pool_blocks as i128 - n as i128;
        // c1 = ceil((m + a1)/bs), c2 = ceil((m + a2)/bs), unsaturated.
        let (a1, a2) = match self.window {
            Some(_) => (
                prompt as i128 + bs + self.pad as i128,
                2 * bs + self.pad as i128,
            ),
            None => (prompt as i128 + self.pad as i128, bs + self.pad as i128),
        };
        // Where each term stops growing (a window caps it), as m.
        let cap = self.window.map(|w| w as i128 + self.chunk as i128);
        let (s1, s2) = match cap {
            Some(s) => (s - prompt as i128, s - bs),
            None => (i128::MAX, i128::MAX),
        };
        let largest = if s1 <= s2 {
            solve(k, bs, n as i128, a1, a2, s1, s2, true)
        } else {
            solve(k, bs, n as i128, a1, a2, s2, s1, false)
        };
        // `fits(1)` holds and `fits(want)` does not: the answer is in
        // `[1, want)`; the closed form lands there (checked in tests).
        Some(largest.clamp(1, want as i128 - 1) as usize)
    }
}

/// The admission rule of a cache of KV groups: one [`Admission`] and pool
/// size per group (built by [`crate::KvCache::admission`]). A request fits
/// when it fits every group; a window group's worst case is bounded by its
/// keep plus a chunk whatever the request's length, the full group's grows
/// with prompt and new tokens. Plain data, so the engine's handle answers
/// `max_tokens` questions without the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupAdmission {
    /// Per group: its rule and its pool's blocks.
    groups: Vec<(Admission, usize)>,
}

impl GroupAdmission {
    /// The rule of groups with `rules[g]` over `pool_blocks[g]` blocks.
    pub fn new(groups: Vec<(Admission, usize)>) -> Self {
        GroupAdmission { groups }
    }

    /// Per group: its rule and its pool's blocks.
    pub fn groups(&self) -> &[(Admission, usize)] {
        &self.groups
    }

    /// Blocks a request may hold at worst, per group.
    pub fn request(&self, prompt: usize, max_tokens: usize, n: usize) -> Vec<RequestBlocks> {
        self.groups
            .iter()
            .map(|(rule, _)| rule.request(prompt, max_tokens, n))
            .collect()
    }

    /// Whether every group's pool holds more than its slack (the empty
    /// request's cost); the first group that doesn't, with its pool and slack.
    pub fn undersized(&self) -> Option<(usize, usize, usize)> {
        self.groups
            .iter()
            .enumerate()
            .find(|(_, (rule, pool))| *pool <= rule.slack())
            .map(|(g, (rule, pool))| (g, *pool, rule.slack()))
    }

    /// Longest sequence a request may reach alone: the least over groups
    /// ([`Admission::max_request_tokens`]); `usize::MAX` when every group
    /// is bounded by a window.
    pub fn max_request_tokens(&self) -> usize {
        self.groups
            .iter()
            .map(|(rule, pool)| rule.max_request_tokens(*pool))
            .min()
            .unwrap_or(0)
    }

    /// The most new tokens (at most `want`) a request of `prompt` tokens
    /// and `n` choices may generate: the least over groups of
    /// [`Admission::max_new_tokens`] (each group's answer is a prefix of
    /// `1..=want`, so the least is the largest count every group holds);
    /// `None` when one group can't hold even one.
    pub fn max_new_tokens(&self, prompt: usize, n: usize, want: usize) -> Option<usize> {
        self.groups
            .iter()
            .map(|(rule, pool)| rule.max_new_tokens(prompt, n, *pool, want))
            .try_fold(want, |least, m| m.map(|m| least.min(m)))
    }
}

/// Largest `m` with `c1(m) + (n - 1)·c2(m) <= k`, where
/// `c1 = ceil((min(m, s1') + a1) / bs)` saturating at `m = s1'` and
/// likewise `c2` (`first_saturates`: term 1 saturates first, at `lo`; the
/// other at `hi`). Pieces: both terms grow (`m < lo`), one grows
/// (`lo <= m < hi`), neither (`m >= hi`, the caller's `fits(want)` case).
#[allow(clippy::too_many_arguments)]
fn solve(
    k: i128,
    bs: i128,
    n: i128,
    a1: i128,
    a2: i128,
    lo: i128,
    hi: i128,
    first_saturates: bool,
) -> i128 {
    let c = |m: i128, a: i128, s: i128| -> i128 {
        (m.min(s) + a).div_euclid(bs) + i128::from((m.min(s) + a).rem_euclid(bs) != 0)
    };
    let (s1, s2) = if first_saturates { (lo, hi) } else { (hi, lo) };
    let total = |m: i128| c(m, a1, s1) + (n - 1) * c(m, a2, s2);
    if lo != i128::MAX && total(lo) <= k {
        // In [lo, hi): the saturated term is a constant; the other is one
        // ceiling with weight `w`.
        let (w, a, fixed) = if first_saturates {
            (n - 1, a2, c(lo, a1, s1))
        } else {
            (1, a1, (n - 1) * c(lo, a2, s2))
        };
        if w == 0 {
            return hi - 1;
        }
        // ceil((m + a)/bs) <= q  <=>  m <= q·bs - a.
        let q = (k - fixed).div_euclid(w);
        return (q * bs - a).min(hi - 1);
    }
    // Both terms grow: x = m + a2, c2 = ceil(x/bs) = u, and
    // c1 = ceil((x + d)/bs) with d = a1 - a2 = D·bs + r (0 <= r < bs) is
    // D + u, or D + u + 1 when x > u·bs - r.
    let d = a1 - a2;
    let (dd, r) = (d.div_euclid(bs), d.rem_euclid(bs));
    let u = (k - dd).div_euclid(n);
    let x = if r == 0 || dd + n * u < k {
        u * bs
    } else {
        u * bs - r
    };
    (x - a2).min(lo.saturating_sub(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The closed form against a scan, over every small configuration.
    #[test]
    fn the_closed_form_equals_a_scan() {
        let mut checked = 0;
        for bs in [1, 2, 3, 4, 16] {
            for tile in [0, 1, 4] {
                for window in [None, Some(1), Some(5), Some(20)] {
                    for chunk in [1, 3, 8] {
                        let rule = Admission::new(bs, tile, window, chunk);
                        for prompt in [0, 1, 2, 5, 17, 40] {
                            for n in [1, 2, 3, 5] {
                                for pool in 0..60 {
                                    let want = 200;
                                    let scan = (1..=want)
                                        .take_while(|&m| rule.request(prompt, m, n).total <= pool)
                                        .last();
                                    assert_eq!(
                                        rule.max_new_tokens(prompt, n, pool, want),
                                        scan,
                                        "{rule:?} prompt {prompt} n {n} pool {pool}"
                                    );
                                    checked += 1;
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(checked > 100_000);
    }

    /// Groups: the least over groups against a scan of "fits every
    /// group", a full group next to window groups.
    #[test]
    fn groups_admit_what_fits_every_group() {
        let mut checked = 0;
        for bs in [1, 4, 16] {
            for window in [Some(3), Some(20)] {
                for chunk in [2, 8] {
                    for full_pool in [0, 7, 30, 90] {
                        for window_pool in [0, 5, 12, 40] {
                            let rules = GroupAdmission::new(vec![
                                (Admission::new(bs, 0, None, chunk), full_pool),
                                (Admission::new(bs, 0, window, chunk), window_pool),
                            ]);
                            for prompt in [0, 3, 17, 60] {
                                for n in [1, 2, 4] {
                                    let want = 150;
                                    let scan = (1..=want)
                                        .take_while(|&m| {
                                            rules
                                                .request(prompt, m, n)
                                                .iter()
                                                .zip(rules.groups())
                                                .all(|(r, (_, pool))| r.total <= *pool)
                                        })
                                        .last();
                                    assert_eq!(rules.max_new_tokens(prompt, n, want), scan);
                                    checked += 1;
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(checked > 1000);
        // A window group's worst case does not grow with the request.
        let rules = GroupAdmission::new(vec![
            (Admission::new(16, 0, None, 32), 1000),
            (Admission::new(16, 0, Some(63), 32), 10),
        ]);
        let short = rules.request(100, 10, 1);
        let long = rules.request(5000, 10, 1);
        assert_eq!(short[1].total, long[1].total);
        assert!(long[0].total > short[0].total);
        assert_eq!(rules.max_request_tokens(), 999 * 16);
        assert_eq!(rules.undersized(), None);
    }

    #[test]
    fn worst_cases_match_their_definition() {
        let rule = Admission::new(32, 0, None, 512);
        assert_eq!(rule.blocks_for(64), 3);
        let tiled = Admission::new(32, 32, None, 512);
        assert_eq!(tiled.blocks_for(33), 3);
        // Two choices of 10 new tokens over a 100-token prompt: the first
        // holds 110 tokens (5 blocks), the second its own 10 plus a block.
        let r = rule.request(100, 10, 2);
        assert_eq!(r.per_extra_choice, 3);
        assert_eq!(r.total, 5 + 3);
        // A window bounds what any length holds.
        let windowed = Admission::new(16, 0, Some(64), 32);
        assert_eq!(windowed.blocks_for(10_000), windowed.blocks_for(96));
        assert_eq!(windowed.max_request_tokens(100), usize::MAX);
        assert_eq!(rule.max_request_tokens(10), 9 * 32, "one block of slack");
    }
}
