//! A follower rank's KV (`KvReplica`, tensor parallelism) against rank 0's
//! own cache: fed only the step layouts rank 0 sends, it must hold the
//! same K/V in the same slots and give attention the same reads (per row,
//! padded, paged tables) step after step, through prefix-cache hits,
//! forks with copy-on-write, pad rewinds and front drops.

use mlxcel_kv::{
    AttentionKv, KvCache, KvCacheConfig, KvLayout, KvReplica, KvSequence, PrefixCacheConfig,
    RowReserve, StorageBackend,
};
use mlxcel_mlx::{Array, Dtype};
use rand_chacha::ChaCha8Rng;
use rand_core::{RngCore, SeedableRng};

const LAYERS: usize = 2;
const BLOCK: usize = 4;
const BLOCKS: usize = 64;

fn layout() -> KvLayout {
    KvLayout {
        layers: LAYERS,
        kv_heads: 1,
        head_dim: 2,
        dtype: Dtype::Float32,
        kv_dtype: mlxcel_kv::KvCacheDtype::Auto,
    }
}

fn vals(a: &Array) -> Vec<f32> {
    a.to_vec_f32().unwrap()
}

struct Seq {
    kv: KvSequence,
    tokens: Vec<u32>,
    computed: usize,
}

#[test]
fn a_replica_fed_step_layouts_reads_what_rank_0_reads() {
    let mut rng = ChaCha8Rng::seed_from_u64(16);
    let mut cache = KvCache::new(KvCacheConfig {
        layout: layout(),
        block_size: BLOCK,
        num_blocks: BLOCKS,
        backend: StorageBackend::Paged,
        prefix: Some(PrefixCacheConfig {
            extra_key: 1,
            capacity_blocks: BLOCKS,
        }),
    })
    .unwrap();
    cache.record_block_copies(true);
    let mut replica = KvReplica::new(layout(), BLOCKS, BLOCK).unwrap();
    let mut seqs: Vec<Seq> = Vec::new();
    let mut copies_seen = 0;
    let mut value = 0.0f32;
    for round in 0..60 {
        // Admit: prompts sharing a prefix (cache hits), or a fork of a
        // running sequence (its partial block is copied on first write).
        if seqs.len() < 3 {
            let fork = !seqs.is_empty() && rng.next_u32() % 2 == 0;
            if fork {
                let parent = &seqs[rng.next_u32() as usize % seqs.len()];
                let kv = cache.fork(&parent.kv).unwrap();
                let mut tokens = parent.tokens.clone();
                tokens.push(rng.next_u32() % 50);
                let computed = parent.computed;
                seqs.push(Seq {
                    kv,
                    tokens,
                    computed,
                });
            } else {
                let len = 5 + rng.next_u32() as usize % 9;
                let tokens: Vec<u32> = (0..len as u32).map(|i| i % 7).collect();
                let (kv, cached) = cache.new_sequence_for_prompt(&tokens).unwrap();
                seqs.push(Seq {
                    kv,
                    tokens,
                    computed: cached,
                });
            }
        }
        // Each row runs its next chunk (pads on some), or a decode token.
        let plan: Vec<(usize, usize, usize)> = seqs
            .iter()
            .enumerate()
            .map(|(i, s)| {
                if s.computed + 1 >= s.tokens.len() {
                    (i, 1, 1)
                } else {
                    let real = (s.tokens.len() - s.computed).min(1 + rng.next_u32() as usize % 5);
                    (i, real, real + rng.next_u32() as usize % 2)
                }
            })
            .collect();
        let reserve: Vec<RowReserve<'_>> = plan
            .iter()
            .map(|&(i, real, padded)| RowReserve {
                seq: &seqs[i].kv,
                real,
                padded,
            })
            .collect();
        let reservation = cache.reserve_step(&reserve).unwrap();
        let rows: Vec<(&KvSequence, usize)> =
            plan.iter().map(|&(i, _, p)| (&seqs[i].kv, p)).collect();
        let mut sent = cache.step_layout(&rows).unwrap();
        sent.copies = cache.take_block_copies();
        copies_seen += sent.copies.len();
        let tokens: usize = plan.iter().map(|p| p.2).sum();
        let ids: Vec<usize> = (0..plan.len()).collect();
        {
            let mut view = cache.step(&rows).unwrap();
            let mut mirror = replica.step(&sent).unwrap();
            for r in 0..plan.len() {
                assert_eq!(view.new_positions(r), mirror.new_positions(r));
            }
            for layer in 0..LAYERS {
                let k: Vec<f32> = (0..tokens * 2)
                    .map(|_| {
                        value += 1.0;
                        value
                    })
                    .collect();
                let k = Array::from_f32(&k, &[tokens as i32, 1, 2]).unwrap();
                let v = k.multiply(&Array::scalar(-1.0).unwrap()).unwrap();
                view.write(layer, &k, &v).unwrap();
                mirror.write(layer, &k, &v).unwrap();
                for r in 0..plan.len() {
                    let (a, b) = (view.read(layer, r).unwrap(), mirror.read(layer, r).unwrap());
                    assert_eq!(
                        vals(&a.0),
                        vals(&b.0),
                        "round {round} layer {layer} row {r}"
                    );
                    assert_eq!(vals(&a.1), vals(&b.1));
                }
                let (a, b) = (
                    view.read_padded(layer, &ids).unwrap().unwrap(),
                    mirror.read_padded(layer, &ids).unwrap().unwrap(),
                );
                assert_eq!((vals(&a.0), vals(&a.1), a.2), (vals(&b.0), vals(&b.1), b.2));
                let a = view.read_paged(layer, &ids).unwrap().unwrap();
                let (at, am) = (a.tables.to_vec_i32().unwrap(), a.meta.to_vec_i32().unwrap());
                let b = mirror.read_paged(layer, &ids).unwrap().unwrap();
                assert_eq!(at, b.tables.to_vec_i32().unwrap());
                assert_eq!(am, b.meta.to_vec_i32().unwrap());
            }
            // The whole pools agree, slot for slot.
            let (a, b): (Vec<Vec<f32>>, Vec<Vec<f32>>) = (
                view.storage().into_iter().map(vals).collect(),
                mirror.storage().into_iter().map(vals).collect(),
            );
            assert_eq!(a, b, "round {round}: pools differ");
        }
        cache.complete_step(reservation, true).unwrap();
        // Advance, donate full blocks, sometimes drop the front, end some.
        for &(i, real, _) in &plan {
            let s = &mut seqs[i];
            s.computed += real;
            if s.computed >= s.tokens.len() {
                s.tokens.push(rng.next_u32() % 50);
            }
            let end = cache.end(&s.kv).unwrap();
            cache.donate(&s.kv, &s.tokens[..end]).unwrap();
            if rng.next_u32() % 8 == 0 && cache.len(&s.kv).unwrap() > BLOCK + 1 {
                cache.drop_front(&s.kv, end - BLOCK - 1).unwrap();
            }
        }
        seqs.retain(|s| s.computed < 24);
        cache.reclaim().unwrap();
    }
    assert!(copies_seen > 0, "no copy-on-write was exercised");
}
