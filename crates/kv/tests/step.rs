//! The KV cache's step protocol on real MLX storage, without a model:
//! reserve (real + pad tokens), write packed K/V, read, complete. After every
//! step each sequence holds exactly its real tokens (docs/architecture.md
//! invariants 1 and 2), for both backends, tile and batch padding, and any
//! chunk size; failed steps leave no trace; blocks are conserved.

use mlxcel_kv::{
    AttentionKv, KvCache, KvCacheConfig, KvLayout, KvSequence, RowReserve, StorageBackend,
};
use mlxcel_mlx::{Array, Dtype};
use rand_chacha::ChaCha8Rng;
use rand_core::{RngCore, SeedableRng};

const LAYERS: usize = 2;
const HEAD_DIM: usize = 2;

fn cache(backend: StorageBackend, block_size: usize, num_blocks: usize) -> KvCache {
    cache_with(backend, block_size, num_blocks, None)
}

fn cache_with(
    backend: StorageBackend,
    block_size: usize,
    num_blocks: usize,
    prefix: Option<mlxcel_kv::PrefixCacheConfig>,
) -> KvCache {
    KvCache::new(KvCacheConfig {
        layout: KvLayout {
            layers: LAYERS,
            kv_heads: 1,
            head_dim: HEAD_DIM,
            dtype: Dtype::Float32,
            kv_dtype: mlxcel_kv::KvCacheDtype::Auto,
        },
        block_size,
        num_blocks,
        backend,
        prefix,
    })
    .expect("cache")
}

/// The key value written for position `pos` of sequence `seq` in `layer`;
/// pad tokens get -1.
fn key(seq: usize, pos: usize, layer: usize) -> f32 {
    (seq * 10_000 + pos * 10 + layer) as f32
}

struct Seq {
    kv: KvSequence,
    prompt: usize,
    done: usize,
}

/// How each row of a step is padded.
#[derive(Debug, Clone, Copy)]
enum Padding {
    None,
    /// Each row's chunk rounded up to a multiple of the tile.
    Tile(usize),
    /// Every row padded to the longest row of the step.
    Longest,
}

fn padded_len(real: usize, longest: usize, padding: Padding) -> usize {
    match padding {
        Padding::None => real,
        Padding::Tile(t) => real.div_ceil(t) * t,
        Padding::Longest => longest,
    }
}

/// One prefill step over `rows` (indices into `seqs`), chunks of at most
/// `chunk` tokens, failing on purpose when `fail`. Checks every read.
fn run_step(
    cache: &mut KvCache,
    seqs: &mut [Seq],
    rows: &[usize],
    chunk: usize,
    padding: Padding,
    fail: bool,
) {
    let reals: Vec<usize> = rows
        .iter()
        .map(|&i| (seqs[i].prompt - seqs[i].done).min(chunk))
        .collect();
    let longest = *reals.iter().max().expect("rows");
    let reserve: Vec<RowReserve<'_>> = rows
        .iter()
        .zip(&reals)
        .map(|(&i, &real)| RowReserve {
            seq: &seqs[i].kv,
            real,
            padded: padded_len(real, longest, padding),
        })
        .collect();
    let padded: Vec<usize> = reserve.iter().map(|r| r.padded).collect();
    let reservation = cache.reserve_step(&reserve).expect("pool holds the step");
    drop(reserve);
    {
        let step_rows: Vec<(&KvSequence, usize)> = rows
            .iter()
            .zip(&padded)
            .map(|(&i, &n)| (&seqs[i].kv, n))
            .collect();
        let mut step = cache.step(&step_rows).expect("step view");
        for layer in 0..LAYERS {
            let mut packed = Vec::new();
            for (r, (&i, &real)) in rows.iter().zip(&reals).enumerate() {
                let positions = step.new_positions(r);
                assert_eq!(positions.start, seqs[i].done, "RoPE position of row {r}");
                for (j, p) in positions.enumerate() {
                    let v = if j < real { key(i, p, layer) } else { -1.0 };
                    packed.extend([v; HEAD_DIM]);
                }
            }
            let t = (packed.len() / HEAD_DIM) as i32;
            let k = Array::from_f32(&packed, &[t, 1, HEAD_DIM as i32]).expect("keys");
            step.write(layer, &k, &k).expect("write");
            for (r, &i) in rows.iter().enumerate() {
                let (keys, _) = step.read(layer, r).expect("read");
                let got = keys.to_vec_f32().expect("readback");
                let real_end = seqs[i].done + reals[r];
                let want: Vec<f32> = (0..seqs[i].done + padded[r])
                    .flat_map(|p| {
                        let v = if p < real_end { key(i, p, layer) } else { -1.0 };
                        [v; HEAD_DIM]
                    })
                    .collect();
                assert_eq!(got, want, "row {r} (seq {i}) layer {layer} reads its own K");
            }
            let decode: Vec<usize> = (0..rows.len()).collect();
            if let Some((keys, _, lens)) = step.read_padded(layer, &decode).expect("padded") {
                let max = *lens.iter().max().expect("lens");
                assert_eq!(keys.shape(), vec![rows.len() as i32, 1, max as i32, 2]);
            }
        }
        let storage = step.storage();
        mlxcel_mlx::eval(&storage).expect("eval storage");
    }
    cache.complete_step(reservation, !fail).expect("complete");
    for (&i, &real) in rows.iter().zip(&reals) {
        if !fail {
            seqs[i].done += real;
        }
        let s = &seqs[i];
        let bs = cache.config().block_size;
        assert_eq!(
            cache.end(&s.kv).unwrap(),
            s.done,
            "next position = real tokens"
        );
        assert_eq!(
            cache.len(&s.kv).unwrap(),
            s.done,
            "cache length = real tokens"
        );
        assert_eq!(
            cache.blocks_held(&s.kv).unwrap(),
            s.done.div_ceil(bs),
            "blocks"
        );
        cache.check(&s.kv).expect("invariants");
    }
}

fn random_run(backend: StorageBackend, seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let block_size = [1, 4, 32][(rng.next_u32() % 3) as usize];
    let mut cache = cache(backend, block_size, 4096 / block_size);
    for round in 0..6 {
        let chunk = [1, 3, 16, 64][(rng.next_u32() % 4) as usize];
        let padding = match rng.next_u32() % 3 {
            0 => Padding::None,
            1 => Padding::Tile(8),
            _ => Padding::Longest,
        };
        let mut seqs: Vec<Seq> = (0..1 + rng.next_u32() % 5)
            .map(|_| Seq {
                kv: cache.new_sequence(),
                prompt: [1, 31, 32, 33, 63, 65, 100][(rng.next_u32() % 7) as usize],
                done: 0,
            })
            .collect();
        loop {
            let rows: Vec<usize> = (0..seqs.len())
                .filter(|&i| seqs[i].done < seqs[i].prompt && rng.next_u32() % 4 != 0)
                .collect();
            if seqs.iter().all(|s| s.done == s.prompt) {
                break;
            }
            if rows.is_empty() {
                continue;
            }
            let fail = rng.next_u32() % 7 == 0;
            run_step(&mut cache, &mut seqs, &rows, chunk, padding, fail);
        }
        drop(seqs);
        cache.reclaim().expect("reclaim");
        assert_eq!(
            cache.pool().used_blocks(),
            0,
            "round {round}: blocks conserved"
        );
    }
}

#[test]
fn paged_prefill_keeps_exactly_the_real_tokens() {
    for seed in 0..12 {
        random_run(StorageBackend::Paged, seed);
    }
}

#[test]
fn dense_prefill_keeps_exactly_the_real_tokens() {
    for seed in 0..12 {
        random_run(StorageBackend::Dense, seed);
    }
}

#[test]
fn reserve_is_all_or_nothing_when_the_pool_is_full() {
    let mut c = cache(StorageBackend::Paged, 4, 3);
    let a = c.new_sequence();
    let b = c.new_sequence();
    let rows = [
        RowReserve {
            seq: &a,
            real: 5,
            padded: 8,
        },
        RowReserve {
            seq: &b,
            real: 4,
            padded: 8,
        },
    ];
    let err = c
        .reserve_step(&rows)
        .expect_err("needs 4 blocks, pool has 3");
    assert!(matches!(err, mlxcel_kv::KvError::PoolExhausted(_)), "{err}");
    assert_eq!(c.end(&a).unwrap(), 0, "first row rewound");
    assert_eq!(c.pool().used_blocks(), 0);
    drop((a, b));
    assert_eq!(c.reclaim().unwrap(), 2);
}

#[test]
fn dropping_a_handle_returns_its_blocks_at_reclaim() {
    let mut c = cache(StorageBackend::Dense, 4, 8);
    let a = c.new_sequence();
    c.append(&a, 9).unwrap();
    assert_eq!(c.pool().used_blocks(), 3);
    drop(a);
    assert_eq!(c.pool().used_blocks(), 3, "not before reclaim");
    c.reclaim().unwrap();
    assert_eq!(c.pool().used_blocks(), 0);
    assert_eq!(c.live_sequences(), 0);
}

#[test]
fn front_drop_keeps_positions_absolute_and_reads_the_window() {
    for backend in [StorageBackend::Dense, StorageBackend::Paged] {
        let mut c = cache(backend, 4, 600);
        let s = c.new_sequence();
        let mut seqs = vec![Seq {
            kv: s,
            prompt: 600,
            done: 0,
        }];
        // Prefill 600 tokens, then keep a 64-token window while decoding.
        while seqs[0].done < 600 {
            run_step(&mut c, &mut seqs, &[0], 64, Padding::None, false);
        }
        c.drop_front(&seqs[0].kv, 600 - 64).unwrap();
        assert_eq!(c.len(&seqs[0].kv).unwrap(), 64);
        assert_eq!(c.end(&seqs[0].kv).unwrap(), 600, "RoPE position unchanged");
        c.append(&seqs[0].kv, 1).unwrap();
        let mut step = c.step(&[(&seqs[0].kv, 1)]).unwrap();
        assert_eq!(step.new_positions(0), 600..601);
        let k = Array::from_f32(&[7.0, 7.0], &[1, 1, 2]).unwrap();
        step.write(0, &k, &k).unwrap();
        let (keys, _) = step.read(0, 0).unwrap();
        let got = keys.to_vec_f32().unwrap();
        assert_eq!(got.len(), 65 * 2, "{backend}: reads the live window only");
        assert_eq!(got[0], key(0, 536, 0), "{backend}: window starts at 536");
        assert_eq!(got[128], 7.0);
    }
}

fn prefix_cache(num_blocks: usize, capacity_blocks: usize) -> KvCache {
    let prefix = mlxcel_kv::PrefixCacheConfig {
        extra_key: 1,
        capacity_blocks,
    };
    cache_with(StorageBackend::Paged, 4, num_blocks, Some(prefix))
}

/// Prefills `prompt` (ids = positions) as sequence `seq_tag`'s K/V, from
/// whatever the cache already holds, and donates it.
fn prefill_and_donate(c: &mut KvCache, prompt: &[u32], seq_tag: usize) -> (KvSequence, usize) {
    let (seq, cached) = c.new_sequence_for_prompt(prompt).expect("lookup");
    let mut seqs = vec![Seq {
        kv: seq,
        prompt: prompt.len(),
        done: cached,
    }];
    while seqs[0].done < prompt.len() {
        run_step_tagged(c, &mut seqs, seq_tag);
    }
    let seq = seqs.pop().expect("one").kv;
    c.donate(&seq, prompt).expect("donate");
    (seq, cached)
}

/// `run_step` for one sequence whose key values are tagged `tag`.
fn run_step_tagged(c: &mut KvCache, seqs: &mut [Seq], tag: usize) {
    let s = &mut seqs[0];
    let n = s.prompt - s.done;
    let reservation = c
        .reserve_step(&[RowReserve {
            seq: &s.kv,
            real: n,
            padded: n,
        }])
        .expect("reserve");
    {
        let mut step = c.step(&[(&s.kv, n)]).expect("step");
        for layer in 0..LAYERS {
            let vals: Vec<f32> = step
                .new_positions(0)
                .flat_map(|p| [key(tag, p, layer); HEAD_DIM])
                .collect();
            let k = Array::from_f32(&vals, &[n as i32, 1, HEAD_DIM as i32]).expect("k");
            step.write(layer, &k, &k).expect("write");
        }
        mlxcel_mlx::eval(&step.storage()).expect("eval");
    }
    c.complete_step(reservation, true).expect("complete");
    s.done += n;
}

fn read_keys(c: &mut KvCache, seq: &KvSequence, layer: usize) -> Vec<f32> {
    c.append(seq, 1).expect("append");
    let end = c.end(seq).expect("end");
    let mut step = c.step(&[(seq, 1)]).expect("step");
    let k = Array::from_f32(&[-5.0; HEAD_DIM], &[1, 1, HEAD_DIM as i32]).expect("k");
    for l in 0..LAYERS {
        step.write(l, &k, &k).expect("write");
    }
    let (keys, _) = step.read(layer, 0).expect("read");
    let mut v = keys.to_vec_f32().expect("readback");
    drop(step);
    c.truncate_tail(seq, end - 1).expect("rewind");
    v.truncate((end - 1) * HEAD_DIM);
    v
}

#[test]
fn a_hit_adopts_blocks_and_a_whole_prompt_hit_recomputes_only_the_last_token() {
    let mut c = prefix_cache(32, 32);
    let prompt: Vec<u32> = (0..8).collect();
    let (first, cached) = prefill_and_donate(&mut c, &prompt, 1);
    assert_eq!(cached, 0, "cold");
    assert_eq!(c.pool().cached_blocks(), 2);
    // Same prompt again: both blocks hit; the last token is rewound and
    // recomputed into a private copy of the last block.
    let (second, cached) = c.new_sequence_for_prompt(&prompt).expect("lookup");
    assert_eq!(cached, 7);
    assert_eq!(c.end(&second).unwrap(), 7);
    let mut seqs = vec![Seq {
        kv: second,
        prompt: 8,
        done: 7,
    }];
    run_step_tagged(&mut c, &mut seqs, 2);
    let second = seqs.pop().unwrap().kv;
    // The first sequence still reads its own (tag 1) K/V everywhere; the
    // second reads the cached 7 then its recomputed last token (tag 2).
    let want_first: Vec<f32> = (0..8).flat_map(|p| [key(1, p, 0); HEAD_DIM]).collect();
    assert_eq!(
        read_keys(&mut c, &first, 0),
        want_first,
        "cached block intact"
    );
    let mut want_second: Vec<f32> = (0..7).flat_map(|p| [key(1, p, 0); HEAD_DIM]).collect();
    want_second.extend([key(2, 7, 0); HEAD_DIM]);
    assert_eq!(read_keys(&mut c, &second, 0), want_second);
    // Donating the second swaps its private copy for the cached block.
    let (added, shared) = c.donate(&second, &prompt).unwrap();
    assert_eq!((added, shared), (0, 1));
    assert_eq!(c.pool().used_blocks(), 2, "one copy of the prompt's blocks");
    drop((first, second));
    c.reclaim().unwrap();
    let counts = c.pool().counts();
    assert_eq!((counts.used, counts.cached, counts.evictable), (0, 2, 2));
    let stats = c.prefix_stats();
    assert_eq!((stats.lookups, stats.hits, stats.tokens_reused), (2, 1, 8));
    let reset = c.reset_prefix_cache();
    assert_eq!(reset.blocks_freed, 2);
    assert_eq!(c.reset_prefix_cache().blocks_freed, 0, "idempotent");
    assert_eq!(c.pool().cached_blocks(), 0);
}

#[test]
fn concurrent_prefills_of_one_prefix_end_up_sharing_one_copy() {
    let mut c = prefix_cache(64, 64);
    let shared: Vec<u32> = (100..112).collect();
    let seqs: Vec<KvSequence> = (0..4)
        .map(|i| {
            let mut prompt = shared.clone();
            prompt.push(i);
            let (s, cached) = c.new_sequence_for_prompt(&prompt).expect("lookup");
            assert_eq!(cached, 0, "nothing cached before any prefill");
            let mut rows = vec![Seq {
                kv: s,
                prompt: prompt.len(),
                done: 0,
            }];
            run_step_tagged(&mut c, &mut rows, i as usize);
            rows.pop().unwrap().kv
        })
        .collect();
    assert_eq!(c.pool().used_blocks(), 4 * 4, "four private copies");
    for (i, s) in seqs.iter().enumerate() {
        let mut prompt = shared.clone();
        prompt.push(i as u32);
        c.donate(s, &prompt).unwrap();
    }
    assert_eq!(
        c.pool().used_blocks(),
        3 + 4,
        "3 shared full blocks + 4 partial"
    );
    drop(seqs);
    c.reclaim().unwrap();
    assert_eq!(c.pool().counts().evictable, 3);
}

#[test]
fn capacity_bounds_unreferenced_cached_blocks_lru_first() {
    let mut c = prefix_cache(64, 2);
    let a: Vec<u32> = (0..8).collect();
    let b: Vec<u32> = (50..58).collect();
    let (sa, _) = prefill_and_donate(&mut c, &a, 1);
    drop(sa);
    c.reclaim().unwrap();
    let (sb, _) = prefill_and_donate(&mut c, &b, 2);
    drop(sb);
    c.reclaim().unwrap();
    assert_eq!(c.pool().counts().evictable, 2, "capacity 2");
    let (_, cached_b) = c.new_sequence_for_prompt(&b).unwrap();
    let (_, cached_a) = c.new_sequence_for_prompt(&a).unwrap();
    assert_eq!((cached_a, cached_b), (0, 7), "the older prompt was evicted");
}

/// `n` choices: a forked sequence shares every block (no copy until a
/// write), the first write into the shared partial block copies it, each
/// side then reads its own tail over the common prefix, and dropping both
/// returns every block.
fn fork_shares_the_prefix_and_copies_on_write(backend: StorageBackend) {
    let mut c = cache(backend, 4, 16);
    let total = c.pool().free_blocks();
    let (a, _) = {
        let (seq, _) = c.new_sequence_for_prompt(&[]).expect("new");
        let mut seqs = vec![Seq {
            kv: seq,
            prompt: 10,
            done: 0,
        }];
        run_step_tagged(&mut c, &mut seqs, 1);
        (seqs.pop().expect("one").kv, ())
    };
    let held = total - c.pool().free_blocks();
    assert_eq!(held, 3, "10 tokens in blocks of 4");
    let b = c.fork(&a).expect("fork");
    assert_eq!(c.len(&b).expect("len"), 10);
    assert_eq!(
        total - c.pool().free_blocks(),
        held,
        "a fork copies nothing"
    );
    let mut sa = vec![Seq {
        kv: a,
        prompt: 11,
        done: 10,
    }];
    let mut sb = vec![Seq {
        kv: b,
        prompt: 11,
        done: 10,
    }];
    run_step_tagged(&mut c, &mut sa, 1);
    run_step_tagged(&mut c, &mut sb, 2);
    if backend == StorageBackend::Paged {
        assert_eq!(
            total - c.pool().free_blocks(),
            held + 1,
            "only the shared partial block was copied"
        );
    }
    let (a, b) = (sa.pop().expect("a").kv, sb.pop().expect("b").kv);
    for layer in 0..LAYERS {
        let ka = read_keys(&mut c, &a, layer);
        let kb = read_keys(&mut c, &b, layer);
        let expect = |tag: usize| -> Vec<f32> {
            (0..11)
                .flat_map(|p| [key(if p < 10 { 1 } else { tag }, p, layer); HEAD_DIM])
                .collect()
        };
        assert_eq!(ka, expect(1), "layer {layer}: the original");
        assert_eq!(kb, expect(2), "layer {layer}: the fork");
    }
    drop((a, b));
    c.reclaim().expect("reclaim");
    assert_eq!(c.pool().free_blocks(), total);
}

#[test]
fn paged_fork_shares_the_prefix_and_copies_on_write() {
    fork_shares_the_prefix_and_copies_on_write(StorageBackend::Paged);
}

#[test]
fn dense_fork_shares_the_prefix_and_copies_on_write() {
    fork_shares_the_prefix_and_copies_on_write(StorageBackend::Dense);
}
