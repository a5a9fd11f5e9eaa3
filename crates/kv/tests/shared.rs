//! Layers that read another layer's K/V (`LayerState::SharedAttention`,
//! Gemma 4's KV sharing) on real MLX storage, without a model: a shared
//! layer keeps no K/V, its reads return its source's keys (dense, paged,
//! and in KV groups, where a window source's reads are its window), and a
//! write to it is an error.

use mlxcel_kv::{
    AttentionKv, KvCache, KvCacheConfig, KvError, KvGroupConfig, KvLayout, KvSequence, LayerState,
    RecurrentConfig, RowReserve, StorageBackend,
};
use mlxcel_mlx::{Array, Dtype};

const BS: usize = 4;
const WINDOW: usize = 9;

/// Layer 0 full, layer 1 within `WINDOW` keys, layer 2 reads layer 0's
/// K/V, layer 3 layer 1's.
fn states() -> Vec<LayerState> {
    vec![
        LayerState::Attention { window: None },
        LayerState::Attention {
            window: Some(WINDOW),
        },
        LayerState::SharedAttention {
            source: 0,
            window: None,
        },
        LayerState::SharedAttention {
            source: 1,
            window: Some(WINDOW),
        },
    ]
}

fn cache(backend: StorageBackend, grouped: bool) -> Result<KvCache, KvError> {
    let states = states();
    let shared = LayerState::shared_layers(&states);
    assert_eq!(shared, vec![(2, 0), (3, 1)]);
    let windows: Vec<Option<usize>> = if grouped {
        states.iter().map(LayerState::window).collect()
    } else {
        vec![None; states.len()]
    };
    let mut groups = KvGroupConfig::from_layer_windows(&windows, None);
    for g in &mut groups {
        g.layers.retain(|l| !shared.iter().any(|&(s, _)| s == *l));
        g.num_blocks = 64;
    }
    let blocks = 64 * groups.len();
    KvCache::with_shared_layers(
        KvCacheConfig {
            layout: KvLayout {
                layers: 4,
                kv_heads: 1,
                head_dim: 1,
                dtype: Dtype::Float32,
                kv_dtype: mlxcel_kv::KvCacheDtype::Auto,
            },
            block_size: BS,
            num_blocks: blocks,
            backend,
            prefix: None,
        },
        groups,
        RecurrentConfig::default(),
        &shared,
    )
}

/// One step of `n` tokens: layers 0 and 1 write `10 * pos + layer`; every
/// layer's read back, as `(position, layer written)` pairs.
fn step(c: &mut KvCache, seq: &KvSequence, n: usize) -> Vec<Vec<(usize, usize)>> {
    let reservation = c
        .reserve_step(&[RowReserve {
            seq,
            real: n,
            padded: n,
        }])
        .expect("reserve");
    let mut read = Vec::new();
    {
        let mut s = c.step(&[(seq, n)]).expect("step");
        for layer in 0..4 {
            let vals: Vec<f32> = s
                .new_positions(0)
                .map(|p| (p * 10 + layer) as f32)
                .collect();
            let k = Array::from_f32(&vals, &[n as i32, 1, 1]).expect("k");
            if layer >= 2 {
                let err = s.write(layer, &k, &k).expect_err("a shared layer wrote");
                assert!(err.to_string().contains("writes none"), "{err}");
            } else {
                s.write(layer, &k, &k).expect("write");
            }
            let (keys, _) = s.read(layer, 0).expect("read");
            let keys = keys.to_vec_f32().expect("readback");
            read.push(
                keys.iter()
                    .map(|&k| (k as usize / 10, k as usize % 10))
                    .collect(),
            );
        }
        mlxcel_mlx::eval(&s.storage()).expect("eval");
    }
    c.complete_step(reservation, true).expect("complete");
    c.trim(seq).expect("trim");
    read
}

#[test]
fn a_shared_layer_reads_its_sources_keys_on_every_storage() {
    for (backend, grouped) in [
        (StorageBackend::Dense, false),
        (StorageBackend::Paged, false),
        (StorageBackend::Paged, true),
    ] {
        let mut c = cache(backend, grouped).expect("cache");
        let seq = c.new_sequence();
        let mut read = step(&mut c, &seq, 12);
        for _ in 0..5 {
            read = step(&mut c, &seq, 1);
        }
        // 17 positions; layer 2 sees layer 0's, layer 3 layer 1's.
        assert_eq!(read[2], read[0], "{backend} grouped={grouped}");
        assert_eq!(read[3], read[1], "{backend} grouped={grouped}");
        assert!(read[2].iter().all(|&(_, l)| l == 0));
        assert!(read[3].iter().all(|&(_, l)| l == 1));
        assert_eq!(read[0].len(), 17);
        // In groups the window layer (and so its sharer) keeps its window.
        let want = if grouped { WINDOW } else { 17 };
        assert_eq!(read[3].len(), want, "{backend} grouped={grouped}");
    }
}

/// The one group's layers, and the `(layer, source)` pairs.
type Case = (&'static [usize], &'static [(usize, usize)]);

#[test]
fn sharing_that_does_not_map_to_stored_kv_is_refused() {
    let layout = KvLayout {
        layers: 3,
        kv_heads: 1,
        head_dim: 1,
        dtype: Dtype::Float32,
        kv_dtype: mlxcel_kv::KvCacheDtype::Auto,
    };
    let config = KvCacheConfig {
        layout,
        block_size: BS,
        num_blocks: 8,
        backend: StorageBackend::Paged,
        prefix: None,
    };
    let group = |layers: Vec<usize>| KvGroupConfig {
        layers,
        window: None,
        keep: None,
        num_blocks: 8,
    };
    let cases: [Case; 4] = [
        // A shared layer also in a group.
        (&[0, 1, 2], &[(2, 0)]),
        // A source that itself shares.
        (&[0], &[(1, 0), (2, 1)]),
        // Out of range.
        (&[0, 1, 2], &[(3, 0)]),
        // Listed twice.
        (&[0, 1], &[(2, 0), (2, 1)]),
    ];
    for (layers, shared) in cases {
        let err = KvCache::with_shared_layers(
            config,
            vec![group(layers.to_vec())],
            RecurrentConfig::default(),
            shared,
        )
        .expect_err("built");
        assert!(
            err.to_string().contains("shared layer"),
            "{shared:?}: {err}"
        );
    }
}
