//! KV groups on real MLX storage, without a model: a full-attention layer
//! and a sliding-window layer keep their own block tables; the window
//! group frees the blocks that fell out of its window while the full group
//! keeps every key, reads return each group's own keys, and a prefix hit
//! puts every group where a cold run is (docs/architecture.md, "KV
//! groups").

use mlxcel_kv::{
    AttentionKv, KvCache, KvCacheConfig, KvGroupConfig, KvLayout, KvSequence, PrefixCacheConfig,
    RowReserve, StorageBackend,
};
use mlxcel_mlx::{Array, Dtype};

const HEAD_DIM: usize = 2;
const BS: usize = 4;
/// Layer 0 attends to everything, layer 1 within 9 keys (keeps 8).
const WINDOW: usize = 9;
const KEEP: usize = WINDOW - 1;

fn grouped_cache(full_blocks: usize, window_blocks: usize, prefix: bool) -> KvCache {
    let mut groups = KvGroupConfig::from_layer_windows(&[None, Some(WINDOW)], None);
    assert_eq!(groups.len(), 2);
    assert_eq!(groups[1].keep, Some(KEEP));
    groups[0].num_blocks = full_blocks;
    groups[1].num_blocks = window_blocks;
    KvCache::with_groups(
        KvCacheConfig {
            layout: KvLayout {
                layers: 2,
                kv_heads: 1,
                head_dim: HEAD_DIM,
                dtype: Dtype::Float32,
                kv_dtype: mlxcel_kv::KvCacheDtype::Auto,
            },
            block_size: BS,
            num_blocks: full_blocks + window_blocks,
            backend: StorageBackend::Paged,
            prefix: prefix.then_some(PrefixCacheConfig {
                extra_key: 3,
                capacity_blocks: 1000,
            }),
        },
        groups,
    )
    .expect("cache")
}

fn key(pos: usize, layer: usize) -> f32 {
    (pos * 10 + layer) as f32
}

/// Runs one step of `n` tokens for `seq` writing `key(pos, layer)`, checks
/// what each layer reads back, then trims; returns each layer's keys read
/// (positions).
fn step(c: &mut KvCache, seq: &KvSequence, n: usize) -> [Vec<usize>; 2] {
    let (_, read) = write_step(c, seq, n);
    c.trim(seq).expect("trim");
    c.check(seq).expect("invariants");
    read
}

/// Reserves, writes (`key(pos, layer)`), reads back and completes one step
/// of `n` tokens for `seq`, without trimming: the reservation (what a
/// failed pipelined read rolls back) and each layer's keys read.
fn write_step(
    c: &mut KvCache,
    seq: &KvSequence,
    n: usize,
) -> (mlxcel_kv::StepReservation, [Vec<usize>; 2]) {
    let reservation = c
        .reserve_step(&[RowReserve {
            seq,
            real: n,
            padded: n,
        }])
        .expect("reserve");
    let mut read = [Vec::new(), Vec::new()];
    {
        let mut s = c.step(&[(seq, n)]).expect("step");
        for (layer, got) in read.iter_mut().enumerate() {
            let vals: Vec<f32> = s
                .new_positions(0)
                .flat_map(|p| [key(p, layer); HEAD_DIM])
                .collect();
            let k = Array::from_f32(&vals, &[n as i32, 1, HEAD_DIM as i32]).expect("k");
            s.write(layer, &k, &k).expect("write");
            let (keys, _) = s.read(layer, 0).expect("read");
            let flat = keys.to_vec_f32().expect("readback");
            *got = flat
                .chunks(HEAD_DIM)
                .map(|k| {
                    assert_eq!(k[0] as usize % 10, layer, "a key of layer {layer}");
                    k[0] as usize / 10
                })
                .collect();
        }
        mlxcel_mlx::eval(&s.storage()).expect("eval");
    }
    c.complete_step(reservation.clone(), true)
        .expect("complete");
    (reservation, read)
}

#[test]
fn a_window_group_frees_what_left_its_window_and_the_full_group_keeps_all() {
    let mut c = grouped_cache(64, 8, false);
    let seq = c.new_sequence();
    // A 20-token prefill, then 150 decode steps.
    let read = step(&mut c, &seq, 20);
    assert_eq!(read[0], (0..20).collect::<Vec<_>>());
    assert_eq!(read[1], (0..20).collect::<Vec<_>>(), "the chunk reads all");
    let mut most_window_blocks = 0;
    for _ in 0..150 {
        let end = c.end(&seq).unwrap();
        let read = step(&mut c, &seq, 1);
        assert_eq!(read[0], (0..=end).collect::<Vec<_>>(), "full: every key");
        assert_eq!(
            read[1],
            (end - KEEP..=end).collect::<Vec<_>>(),
            "window: the last {WINDOW} keys"
        );
        let held = c.group_blocks_held(&seq).unwrap();
        assert_eq!(held[0], (end + 1).div_ceil(BS), "full group holds all");
        most_window_blocks = most_window_blocks.max(held[1]);
        assert_eq!(c.group_range(&seq, 1).unwrap(), end + 1 - KEEP..end + 1);
    }
    // keep + one step's token, starting mid-block, plus a partial block.
    let bound = (KEEP + 1).div_ceil(BS) + 1;
    assert!(
        most_window_blocks <= bound,
        "{most_window_blocks} > {bound}"
    );
    assert_eq!(c.end(&seq).unwrap(), 170);
    assert_eq!(
        c.group_pool(0).unwrap().used_blocks(),
        170usize.div_ceil(BS)
    );
    assert_eq!(
        c.group_pool(1).unwrap().used_blocks(),
        c.group_blocks_held(&seq).unwrap()[1]
    );
    drop(seq);
    c.reclaim().unwrap();
    assert_eq!(c.counts().used, 0);
}

/// A one-token step of `seq` written and completed the way a pipelined
/// decode step is queued (its tokens not read yet): the reservation is
/// what a failed read rolls back.
fn queue(c: &mut KvCache, seq: &KvSequence) -> mlxcel_kv::StepReservation {
    write_step(c, seq, 1).0
}

/// Pipelined decode: step p is queued, step p-1's read trims the window
/// group keeping the queued step's slot too (`trim_keeping`), step p+1 is
/// queued over one key more than the window, then step p's read fails and
/// both queued steps roll back: the group holds exactly the `keep` keys a
/// synchronous rerun of step p reads. A plain trim there would have
/// dropped one of them, which `check` reports.
#[test]
fn a_rolled_back_pipelined_step_keeps_the_keys_its_rerun_reads() {
    for plain_trim in [false, true] {
        let mut c = grouped_cache(64, 8, false);
        let seq = c.new_sequence();
        step(&mut c, &seq, 20);
        for _ in 0..5 {
            step(&mut c, &seq, 1);
        }
        let p = c.end(&seq).unwrap();
        assert_eq!(c.group_range(&seq, 1).unwrap(), p - KEEP..p);
        let queued = queue(&mut c, &seq);
        if plain_trim {
            c.trim(&seq).expect("trim");
        } else {
            c.trim_keeping(&seq, 1).expect("trim");
            assert_eq!(c.group_range(&seq, 1).unwrap(), p - KEEP..p + 1);
        }
        c.check(&seq).expect("invariants while queued");
        let _behind = queue(&mut c, &seq);
        c.complete_step(queued, false).expect("roll back");
        assert_eq!(c.end(&seq).unwrap(), p);
        if plain_trim {
            let e = c.check(&seq).expect_err("a dropped key");
            assert!(e.to_string().contains("dropped keys"), "{e}");
            assert_eq!(c.group_range(&seq, 1).unwrap(), p - KEEP + 1..p);
        } else {
            c.check(&seq).expect("invariants after the rollback");
            assert_eq!(c.group_range(&seq, 1).unwrap(), p - KEEP..p);
            // The rerun reads the window's last keys, as a plain run does.
            let read = step(&mut c, &seq, 1);
            assert_eq!(read[1], (p - KEEP..=p).collect::<Vec<_>>());
        }
        drop(seq);
        c.reclaim().unwrap();
        assert_eq!(c.counts().used, 0);
    }
}

#[test]
fn a_prefix_hit_starts_each_group_where_a_cold_run_is() {
    let mut c = grouped_cache(64, 16, true);
    let prompt: Vec<u32> = (0..30).collect();
    let cold = c.new_sequence();
    // Cold: chunks of 8 (ending at multiples of 8), donating after each.
    let mut done = 0;
    while done < prompt.len() {
        let n = (8 - done % 8).min(prompt.len() - done);
        c.reserve_step(&[RowReserve {
            seq: &cold,
            real: n,
            padded: n,
        }])
        .map(|r| c.complete_step(r, true))
        .expect("reserve")
        .expect("complete");
        done += n;
        c.donate(&cold, &prompt[..done]).expect("donate");
        c.trim(&cold).expect("trim");
    }
    assert_eq!(c.group_range(&cold, 1).unwrap(), 30 - KEEP..30);
    drop(cold);
    c.reclaim().unwrap();

    // The same prompt and more: 7 full blocks are cached in the full
    // group; the window group still holds its old blocks in the free queue.
    let longer: Vec<u32> = (0..40).collect();
    let (warm, cached) = c.new_sequence_for_prompt_chunked(&longer, 8).unwrap();
    assert_eq!(cached, 28);
    assert_eq!(c.group_range(&warm, 0).unwrap(), 0..28);
    // A cold run of `longer` at its last chunk boundary (24) holds the
    // 8 keys before it.
    assert_eq!(c.group_range(&warm, 1).unwrap(), 24 - KEEP..28);
    assert_eq!(c.group_blocks_held(&warm).unwrap(), vec![7, 3]);
    c.check(&warm).unwrap();
    drop(warm);
    c.reclaim().unwrap();
    assert_eq!(c.counts().used, 0);
}

#[test]
fn a_request_fits_when_it_fits_every_group() {
    let mut c = grouped_cache(64, 8, false);
    let rule = c.admission(0, 8);
    let need = |prompt: usize, max_tokens: usize| -> Vec<usize> {
        rule.request(prompt, max_tokens, 1)
            .iter()
            .map(|r| r.total)
            .collect()
    };
    // The window group's worst case (keep 8 + a chunk of 8 + a block,
    // and a partial block) does not grow with the request.
    assert_eq!(need(10, 10), vec![6, 6]);
    assert_eq!(need(1000, 10), vec![254, 6]);
    // The full group bounds max_tokens: ceil((100 + m) / 4) + 1 <= 64.
    assert_eq!(rule.max_new_tokens(100, 1, 1000), Some(152));
    let none: [(&KvSequence, &[usize]); 0] = [];
    assert!(c.fits(&need(10, 10), none));
    assert!(
        !c.fits(&need(1000, 10), none),
        "the full group is too small"
    );
    // One running sequence may still take 6 window blocks: a second
    // doesn't fit the window group's 8, though the full group has room.
    let running = c.new_sequence();
    let worst = need(10, 10);
    assert!(!c.fits(&need(10, 10), [(&running, worst.as_slice())]));
    drop(running);
    c.reclaim().unwrap();
}

/// A window group alone trims only what its layers' window hides (a step
/// queued behind another may see a key past the window: pipelined
/// decode); `--max-kv-size` trims keys the attention would still see, on
/// the full group and on a window wider than the cap.
#[test]
fn only_a_size_cap_trims_inside_what_attention_sees() {
    let windowed = grouped_cache(16, 8, false);
    assert!(windowed.trims());
    assert!(!windowed.trims_inside_attention());
    for (windows, cap) in [
        (vec![None, Some(WINDOW)], Some(100)),
        (vec![None, Some(WINDOW)], Some(4)),
        (vec![None], Some(100)),
    ] {
        let mut groups = KvGroupConfig::from_layer_windows(&windows, cap);
        for g in &mut groups {
            g.num_blocks = 16;
        }
        let blocks = groups.iter().map(|g| g.num_blocks).sum();
        let c = KvCache::with_groups(
            KvCacheConfig {
                layout: KvLayout {
                    layers: windows.len(),
                    kv_heads: 1,
                    head_dim: HEAD_DIM,
                    dtype: Dtype::Float32,
                    kv_dtype: mlxcel_kv::KvCacheDtype::Auto,
                },
                block_size: BS,
                num_blocks: blocks,
                backend: StorageBackend::Paged,
                prefix: None,
            },
            groups,
        )
        .expect("cache");
        assert!(c.trims_inside_attention(), "{windows:?} capped at {cap:?}");
    }
}
