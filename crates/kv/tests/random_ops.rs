//! A seeded random run of the KV bookkeeping against a shadow of the K/V it
//! stands for.
//!
//! Several sequences are admitted (with prefix-cache lookups), appended to,
//! rewound, front-dropped, forked, donated and released at random, with the
//! occasional cache reset. A shadow pool stores, per token slot, a
//! fingerprint of "the K/V of position p after this exact token prefix under
//! this extra key", written through the slots and block copies the
//! bookkeeping returns. After every round the run checks the pool's and each
//! sequence's invariants, exact reference counts, and that every live
//! position and every cached block still holds the right fingerprint: a
//! write into a shared or cached block, a wrong hit or a lost copy shows up
//! as a mismatch. When every sequence has ended, no block is used
//! (invariant 7), and a reset empties the pool.

use std::collections::HashMap;

use mlxcel_kv::{Appended, BlockHash, BlockId, BlockPool, KvError, PrefixCache, SequenceBlocks};
use rand_chacha::ChaCha8Rng;
use rand_core::{RngCore, SeedableRng};

/// Rounds per configuration.
const ROUNDS: usize = 20_000;
/// Most sequences alive at once.
const MAX_LIVE: usize = 8;

/// One live sequence and what the test knows about it.
#[derive(Clone)]
struct Live {
    seq: SequenceBlocks,
    /// Token ids of positions `[0, seq.end())`.
    tokens: Vec<u32>,
    /// Fingerprint of each position's K/V, `[0, seq.end())`.
    fps: Vec<u64>,
    /// The model/template identity this sequence runs under.
    key: u64,
}

/// What happened, to show that the run reached the interesting cases.
#[derive(Default, Debug)]
struct Seen {
    hits: usize,
    whole_hits: usize,
    copies: usize,
    exhausted: usize,
    reset_freed: usize,
    front_drops: usize,
    all_ended: usize,
}

struct Run {
    rng: ChaCha8Rng,
    pool: BlockPool,
    cache: PrefixCache,
    live: Vec<Live>,
    /// The shadow K/V: one fingerprint per token slot, by flat slot index.
    shadow: Vec<Option<u64>>,
    /// Fingerprints each cached hash stood for when registered.
    cached_content: HashMap<BlockHash, Vec<Option<u64>>>,
    /// A few shared system prompts, so lookups hit.
    system: Vec<Vec<u32>>,
    seen: Seen,
}

fn fingerprint(prev: u64, token: u32, pos: usize) -> u64 {
    let mut x = prev ^ (u64::from(token) << 20) ^ (pos as u64).rotate_left(44);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

impl Run {
    fn new(seed: u64, blocks: usize, block_size: usize) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let system = (0..3)
            .map(|i| {
                let len = 3 * block_size + i * 5;
                (0..len).map(|_| rng.next_u32() % 5).collect()
            })
            .collect();
        Run {
            rng,
            pool: BlockPool::new(blocks, block_size).unwrap(),
            cache: PrefixCache::new(),
            live: Vec::new(),
            shadow: vec![None; blocks * block_size],
            cached_content: HashMap::new(),
            system,
            seen: Seen::default(),
        }
    }

    fn below(&mut self, n: usize) -> usize {
        (self.rng.next_u64() % n as u64) as usize
    }

    /// Writes `appended` into the shadow for the tokens at positions from `from`.
    fn apply(&mut self, appended: &Appended, fps: &[u64], from: usize) {
        let bs = self.pool.block_size();
        if let Some(copy) = appended.copy {
            for i in 0..copy.tokens {
                self.shadow[copy.dst.index() * bs + i] = self.shadow[copy.src.index() * bs + i];
            }
            self.seen.copies += 1;
        }
        for (k, slot) in appended.slots.iter().enumerate() {
            self.shadow[slot.flat_index(bs)] = Some(fps[from + k]);
        }
    }

    /// Appends `new` tokens to sequence `i`; on exhaustion checks that
    /// nothing moved and returns the error.
    fn append(&mut self, i: usize, new: &[u32]) -> Result<(), KvError> {
        let before = (self.live[i].seq.clone(), self.pool.counts());
        let live = &mut self.live[i];
        let from = live.seq.end();
        let result = live.seq.append_slots(&mut self.pool, new.len());
        let appended = match result {
            Ok(a) => a,
            Err(e) => {
                assert!(matches!(e, KvError::PoolExhausted(_)), "{e}");
                assert_eq!((self.live[i].seq.clone(), self.pool.counts()), before);
                self.seen.exhausted += 1;
                return Err(e);
            }
        };
        for &t in new {
            let prev = live.fps.last().copied().unwrap_or(live.key);
            live.fps.push(fingerprint(prev, t, live.tokens.len()));
            live.tokens.push(t);
        }
        let fps = live.fps.clone();
        self.apply(&appended, &fps, from);
        Ok(())
    }

    fn random_tokens(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| self.rng.next_u32() % 5).collect()
    }

    /// Admits a prompt: lookup, adopt the hit, prefill the rest.
    fn admit(&mut self) {
        let sys = self.below(self.system.len() + 1);
        let mut prompt = self.system.get(sys).cloned().unwrap_or_default();
        let tail = self.below(3 * self.pool.block_size() + 1);
        prompt.extend(self.random_tokens(tail));
        if prompt.is_empty() {
            prompt.push(1);
        }
        let key = if self.below(10) == 0 { 2 } else { 1 };
        let hit = self.cache.lookup(&mut self.pool, &prompt, key).unwrap();
        let seq = SequenceBlocks::from_prefix(&self.pool, hit);
        let mut live = Live {
            tokens: prompt[..seq.end()].to_vec(),
            fps: Vec::new(),
            seq,
            key,
        };
        for (p, &t) in live.tokens.iter().enumerate() {
            let prev = live.fps.last().copied().unwrap_or(key);
            live.fps.push(fingerprint(prev, t, p));
        }
        self.seen.hits += usize::from(!live.seq.is_empty());
        if live.seq.end() == prompt.len() {
            // Whole prompt cached: recompute only the last token.
            self.seen.whole_hits += 1;
            let end = prompt.len() - 1;
            live.seq.truncate_tail(&mut self.pool, end).unwrap();
            live.tokens.truncate(end);
            live.fps.truncate(end);
        }
        self.live.push(live);
        let i = self.live.len() - 1;
        self.check_live(i);
        let rest = prompt[self.live[i].seq.end()..].to_vec();
        if self.append(i, &rest).is_err() {
            // Admission fails: the request would wait. Give back the hit.
            let mut gone = self.live.pop().unwrap();
            gone.seq.release(&mut self.pool).unwrap();
        }
    }

    fn donate(&mut self, i: usize) {
        let live = &self.live[i];
        let added = self
            .cache
            .insert(&mut self.pool, &live.seq, &live.tokens, live.key)
            .unwrap();
        if live.seq.start() > 0 {
            assert_eq!(added, 0);
        }
        let bs = self.pool.block_size();
        for &b in self.live[i].seq.blocks() {
            if let Some(h) = self.pool.hash_of(b).unwrap() {
                let content = self.shadow[b.index() * bs..(b.index() + 1) * bs].to_vec();
                let expected = self.cached_content.entry(h).or_insert(content.clone());
                assert_eq!(*expected, content, "two contents under one hash");
            }
        }
    }

    fn round(&mut self) {
        let n = self.live.len();
        let op = self.below(100);
        if n == 0 || (op < 15 && n < MAX_LIVE) {
            return self.admit();
        }
        let i = self.below(n);
        let (start, end) = (self.live[i].seq.start(), self.live[i].seq.end());
        match op {
            0..=39 => {
                let k = 1 + self.below(6);
                let new = self.random_tokens(k);
                let _ = self.append(i, &new);
            }
            40..=51 => {
                let to = start + self.below(end - start + 1);
                let live = &mut self.live[i];
                live.seq.truncate_tail(&mut self.pool, to).unwrap();
                live.tokens.truncate(to);
                live.fps.truncate(to);
            }
            52..=57 => {
                let to = start + self.below(end - start + 1);
                self.live[i].seq.drop_front(&mut self.pool, to).unwrap();
                self.seen.front_drops += usize::from(to > start);
            }
            58..=69 => self.donate(i),
            70..=84 => {
                if self.below(2) == 0 {
                    self.donate(i);
                }
                let mut gone = self.live.swap_remove(i);
                gone.seq.release(&mut self.pool).unwrap();
            }
            85..=91 if n < MAX_LIVE => {
                let mut copy = self.live[i].clone();
                copy.seq = self.live[i].seq.fork(&mut self.pool).unwrap();
                self.live.push(copy);
            }
            92..=93 => {
                let evictable = self.pool.counts().evictable;
                let freed = self.pool.reset_prefix_cache();
                assert_eq!(freed, evictable);
                self.seen.reset_freed += freed;
            }
            _ => {
                // A probe: look up a sequence's own tokens, then let go.
                let (tokens, key) = (self.live[i].tokens.clone(), self.live[i].key);
                let hit = self.cache.lookup(&mut self.pool, &tokens, key).unwrap();
                self.check_blocks_hold(&hit, &self.live[i].fps.clone());
                let mut rev = hit;
                rev.reverse();
                self.pool.free(&rev).unwrap();
            }
        }
    }

    /// The first blocks of a prefix hold exactly the fingerprints `fps`.
    fn check_blocks_hold(&self, blocks: &[BlockId], fps: &[u64]) {
        let bs = self.pool.block_size();
        for (j, b) in blocks.iter().enumerate() {
            for off in 0..bs {
                let want = Some(fps[j * bs + off]);
                assert_eq!(self.shadow[b.index() * bs + off], want, "hit block {b}");
            }
        }
    }

    /// Every live position of sequence `i` holds its own fingerprint.
    fn check_live(&self, i: usize) {
        let live = &self.live[i];
        live.seq.check_invariants().unwrap();
        assert_eq!(live.tokens.len(), live.seq.end());
        assert_eq!(live.seq.len(), live.seq.end() - live.seq.start());
        let bs = self.pool.block_size();
        for p in live.seq.start()..live.seq.end() {
            let slot = live.seq.slot_of(p).unwrap();
            assert_eq!(
                self.shadow[slot.flat_index(bs)],
                Some(live.fps[p]),
                "pos {p}"
            );
        }
    }

    fn check(&self) {
        self.pool.check_invariants().unwrap();
        let counts = self.pool.counts();
        assert_eq!(counts.used + counts.free, counts.total);
        let mut held: HashMap<BlockId, u32> = HashMap::new();
        for i in 0..self.live.len() {
            self.check_live(i);
            for &b in self.live[i].seq.blocks() {
                *held.entry(b).or_default() += 1;
            }
        }
        assert_eq!(counts.used, held.len(), "used blocks are the held blocks");
        let bs = self.pool.block_size();
        for id in 0..counts.total as u32 {
            let b = BlockId(id);
            let want = held.get(&b).copied().unwrap_or(0);
            assert_eq!(self.pool.ref_count(b).unwrap(), want, "refcount of {b}");
            if let Some(h) = self.pool.hash_of(b).unwrap() {
                assert_eq!(self.pool.cached_block(h), Some(b));
                let content = &self.shadow[b.index() * bs..(b.index() + 1) * bs];
                assert_eq!(self.cached_content.get(&h).unwrap(), content, "cached {b}");
            }
        }
        if self.live.is_empty() {
            assert_eq!(counts.used, 0);
            assert_eq!(counts.evictable, counts.cached);
        }
    }

    fn finish(&mut self) {
        while let Some(mut live) = self.live.pop() {
            live.seq.release(&mut self.pool).unwrap();
        }
        self.check();
        assert_eq!(self.pool.used_blocks(), 0);
        self.pool.reset_prefix_cache();
        let counts = self.pool.counts();
        assert_eq!(
            (counts.used, counts.cached, counts.free),
            (0, 0, counts.total)
        );
    }
}

fn run(seed: u64, blocks: usize, block_size: usize) {
    let mut run = Run::new(seed, blocks, block_size);
    for _ in 0..ROUNDS {
        run.round();
        run.check();
        run.seen.all_ended += usize::from(run.live.is_empty());
    }
    let stats = run.cache.stats(&run.pool);
    println!(
        "seed {seed}, {blocks}x{block_size}: {:?} {stats:?}",
        run.seen
    );
    let seen = &run.seen;
    assert!(seen.hits > 0 && seen.whole_hits > 0);
    // With one token per block no block is ever partial, so nothing is copied.
    assert_eq!(seen.copies > 0, block_size > 1);
    assert!(seen.exhausted > 0 && seen.reset_freed > 0 && seen.front_drops > 0);
    assert!(stats.evictions > 0 && stats.inserts > 0);
    run.finish();
}

#[test]
fn random_ops_block_size_4() {
    run(1, 40, 4);
}

#[test]
fn random_ops_block_size_3() {
    run(2, 24, 3);
}

#[test]
fn random_ops_block_size_1() {
    run(3, 64, 1);
}
