//! K/V stored otherwise than computed (`KvCacheDtype`): quantized blocks
//! (int8, int4: MLX's affine quantizer, per group of a head) and float
//! casts read back exactly what MLX's own quantize/dequantize (or cast)
//! gives for the written values, through every read of a step (row,
//! padded rows, the paged pool with its scales), after a copy-on-write of
//! a shared partial block, and after a round trip through the disk tier;
//! the budget holds the tokens the stored size promises; layouts that
//! can't be stored are refused with a configuration error.

use mlxcel_kv::{
    AttentionKv, DiskTierConfig, KvCache, KvCacheConfig, KvCacheDtype, KvError, KvLayout,
    KvSequence, PrefixCacheConfig, RowReserve, StorageBackend,
};
use mlxcel_mlx::{Array, Dtype};
use rand_chacha::ChaCha8Rng;
use rand_core::{RngCore, SeedableRng};

const LAYERS: usize = 2;
const HEADS: usize = 2;
const HEAD_DIM: usize = 64;
const BLOCK: usize = 4;

fn layout(kv_dtype: KvCacheDtype) -> KvLayout {
    KvLayout {
        layers: LAYERS,
        kv_heads: HEADS,
        head_dim: HEAD_DIM,
        dtype: Dtype::Float32,
        kv_dtype,
    }
}

fn cache(kv_dtype: KvCacheDtype, prefix: bool) -> KvCache {
    cache_in(Dtype::Float32, kv_dtype, prefix)
}

/// [`cache`] for a model computing in `dtype`.
fn cache_in(dtype: Dtype, kv_dtype: KvCacheDtype, prefix: bool) -> KvCache {
    KvCache::new(KvCacheConfig {
        layout: KvLayout {
            dtype,
            ..layout(kv_dtype)
        },
        block_size: BLOCK,
        num_blocks: 16,
        backend: StorageBackend::Paged,
        prefix: prefix.then_some(PrefixCacheConfig {
            extra_key: 7,
            capacity_blocks: 16,
        }),
    })
    .expect("cache")
}

/// Uniform values in [-1, 1) for `tokens` tokens, `[tokens, heads, dim]`.
fn random(rng: &mut ChaCha8Rng, tokens: usize) -> Vec<f32> {
    (0..tokens * HEADS * HEAD_DIM)
        .map(|_| (rng.next_u32() as f64 / u32::MAX as f64 * 2.0 - 1.0) as f32)
        .collect()
}

fn array(values: &[f32]) -> Array {
    let t = (values.len() / (HEADS * HEAD_DIM)) as i32;
    Array::from_f32(values, &[t, HEADS as i32, HEAD_DIM as i32]).expect("array")
}

/// What storing `values` as `kv_dtype` and reading them back must give,
/// computed with MLX's ops directly, `[tokens, heads, dim]` flat.
fn expected(kv_dtype: KvCacheDtype, values: &[f32]) -> Vec<f32> {
    let x = array(values);
    let back = match kv_dtype.bits() {
        Some(bits) => {
            let (w, s, b) = x.quantize(64, bits as i32).expect("quantize");
            w.dequantize(&s, &b, 64, bits as i32).expect("dequantize")
        }
        None => x
            .astype(kv_dtype.float_dtype(Dtype::Float32))
            .and_then(|a| a.astype(Dtype::Float32))
            .expect("cast"),
    };
    back.to_vec_f32().expect("values")
}

/// Writes `keys` (and `values` = keys negated) of layer `l` = keys + l for
/// every layer as one step of `seq`, in the cache's compute dtype.
fn write(cache: &mut KvCache, seq: &KvSequence, keys: &[f32]) {
    let dtype = cache.config().layout.dtype;
    let cast = |a: Array| a.astype(dtype).expect("cast");
    let n = keys.len() / (HEADS * HEAD_DIM);
    let r = cache
        .reserve_step(&[RowReserve {
            seq,
            real: n,
            padded: n,
        }])
        .expect("reserve");
    {
        let mut step = cache.step(&[(seq, n)]).expect("step");
        for l in 0..LAYERS {
            let k: Vec<f32> = keys.iter().map(|x| x + l as f32 * 0.25).collect();
            let v: Vec<f32> = k.iter().map(|x| -x).collect();
            step.write(l, &cast(array(&k)), &cast(array(&v)))
                .expect("write");
        }
        let storage: Vec<&Array> = step.storage();
        mlxcel_mlx::eval(&storage).expect("eval");
    }
    cache.complete_step(r, true).expect("complete");
}

/// A row's keys and values of layer `l` read in a step of one new token
/// (`next`), as `[tokens, heads, dim]` flat (the read is
/// `[1, heads, tokens, dim]`).
fn read_with_next(cache: &mut KvCache, seq: &KvSequence, next: &[f32], l: usize) -> [Vec<f32>; 2] {
    write(cache, seq, next);
    let mut step = cache.step(&[(seq, 1)]).expect("step");
    let (k, v) = step.read(l, 0).expect("read");
    let (pk, pv, lens) = step
        .read_padded(l, &[0])
        .expect("padded")
        .expect("paged reads padded");
    assert_eq!(lens, vec![k.dim(2).unwrap() as usize]);
    assert_eq!(flat(&pk), flat(&k), "padded read == row read");
    assert_eq!(flat(&pv), flat(&v), "padded read == row read");
    [flat(&k), flat(&v)]
}

/// A read `[1, heads, tokens, dim]` as `[tokens, heads, dim]` flat.
fn flat(a: &Array) -> Vec<f32> {
    a.transpose(&[0, 2, 1, 3])
        .and_then(|a| a.astype(Dtype::Float32))
        .and_then(|a| a.to_vec_f32())
        .expect("values")
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn stored_kv_reads_back_what_mlx_quantizes_or_casts_through_every_read_and_a_fork() {
    // Largest error allowed against the written values in [-1.25, 1.25):
    // one quantization step of the range (2.5 / 255, 2.5 / 15: MLX's
    // affine quantizer rounds its bias too, so the error exceeds half a
    // step), float16's and bfloat16's rounding.
    for (kv_dtype, bound) in [
        (KvCacheDtype::Int8, 0.0099),
        (KvCacheDtype::Int4, 0.167),
        (KvCacheDtype::Float16, 1e-3),
        (KvCacheDtype::Bfloat16, 8e-3),
    ] {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let mut kv = cache(kv_dtype, false);
        let seq = kv.new_sequence();
        // 10 tokens: blocks 0 and 1 full, block 2 half (shared by the fork).
        let prompt = random(&mut rng, 10);
        write(&mut kv, &seq, &prompt);
        let fork = kv.fork(&seq).expect("fork");
        let (a, b) = (random(&mut rng, 1), random(&mut rng, 1));
        for l in 0..LAYERS {
            let shift = |v: &[f32]| -> Vec<f32> { v.iter().map(|x| x + l as f32 * 0.25).collect() };
            let [k0, v0] = if l == 0 {
                read_with_next(&mut kv, &seq, &a, l)
            } else {
                let mut step = kv.step(&[(&seq, 1)]).expect("step");
                let (k, v) = step.read(l, 0).expect("read");
                [flat(&k), flat(&v)]
            };
            let written: Vec<f32> = shift(&[prompt.clone(), a.clone()].concat());
            let want = expected(kv_dtype, &written);
            assert_eq!(k0, want, "{kv_dtype} layer {l}: keys as MLX stores them");
            let neg: Vec<f32> = written.iter().map(|x| -x).collect();
            assert_eq!(v0, expected(kv_dtype, &neg), "{kv_dtype} layer {l}: values");
            let err = max_diff(&k0, &written);
            assert!(
                err > 0.0 && err <= bound,
                "{kv_dtype} layer {l}: error {err} against the written keys (bound {bound})"
            );
        }
        // The fork wrote its own 11th token into a copy of block 2: its
        // first 10 tokens read as the parent's, its 11th is its own.
        let [fk, _] = read_with_next(&mut kv, &fork, &b, 0);
        let [pk, _] = {
            let mut step = kv.step(&[(&seq, 1)]).expect("step");
            let (k, v) = step.read(0, 0).expect("read");
            [flat(&k), flat(&v)]
        };
        let per = HEADS * HEAD_DIM;
        assert_eq!(fk[..10 * per], pk[..10 * per], "{kv_dtype}: shared prefix");
        assert_eq!(
            fk[10 * per..11 * per],
            expected(kv_dtype, &b)[..],
            "{kv_dtype}: the fork's own token"
        );
        assert_eq!(
            pk[10 * per..11 * per],
            expected(kv_dtype, &a)[..],
            "{kv_dtype}: the parent's token survived the fork's write"
        );
        // The paged pool as a kernel reads it: words and their scales.
        let mut step = kv.step(&[(&seq, 1)]).expect("step");
        let pool = step.read_paged(0, &[0]).expect("paged").expect("pool");
        let slots = 16 * BLOCK as i32;
        match kv_dtype.bits() {
            Some(bits) => {
                assert_eq!(pool.keys.dtype(), Dtype::Uint32);
                assert_eq!(
                    pool.keys.shape(),
                    vec![slots, HEADS as i32, (HEAD_DIM * bits / 32) as i32]
                );
                let q = pool.quantized.as_ref().expect("scales");
                assert_eq!((q.bits, q.group_size), (bits, 64));
                assert_eq!(q.key_scales.shape(), vec![slots, HEADS as i32, 1]);
                assert_eq!(q.value_biases.dtype(), Dtype::Float32);
            }
            None => {
                assert!(pool.quantized.is_none());
                assert_eq!(pool.keys.dtype(), kv_dtype.float_dtype(Dtype::Float32));
            }
        }
    }
}

#[test]
fn a_budget_holds_the_tokens_the_stored_size_promises() {
    let f16 = KvLayout {
        dtype: Dtype::Float16,
        ..layout(KvCacheDtype::Auto)
    };
    let with = |kv_dtype| KvLayout { kv_dtype, ..f16 };
    // Per token, layer and head: 64 float16 = 128 bytes; int8: 64 bytes and
    // a float16 scale and bias; int4: 32 + 4.
    assert_eq!(f16.bytes_per_token(), 2 * LAYERS * HEADS * 128);
    assert_eq!(
        with(KvCacheDtype::Int8).bytes_per_token(),
        2 * LAYERS * HEADS * 68
    );
    assert_eq!(
        with(KvCacheDtype::Int4).bytes_per_token(),
        2 * LAYERS * HEADS * 36
    );
    assert_eq!(
        with(KvCacheDtype::Float32).bytes_per_token(),
        2 * LAYERS * HEADS * 256
    );
    let budget = 64 << 20;
    let blocks = |l: KvLayout| KvCacheConfig::blocks_for_budget(l, 32, budget) as f64;
    let base = blocks(f16);
    assert!(blocks(with(KvCacheDtype::Int8)) / base > 1.88);
    assert!(blocks(with(KvCacheDtype::Int4)) / base > 3.55);
    // Heads of 96 features quantize in groups of 32.
    let q = KvLayout {
        head_dim: 96,
        ..with(KvCacheDtype::Int8)
    }
    .quant()
    .expect("quantized");
    assert_eq!((q.bits, q.group_size), (8, 32));
    assert_eq!(with(KvCacheDtype::Auto).kv_dtype_name(), "float16");
    assert_eq!(with(KvCacheDtype::Int4).kv_dtype_name(), "int4");
    for d in KvCacheDtype::ALL {
        assert_eq!(d.name().parse::<KvCacheDtype>(), Ok(d));
    }
    assert!("int3".parse::<KvCacheDtype>().is_err());
}

#[test]
fn quantized_kv_is_refused_where_it_cannot_be_stored() {
    let build = |l: KvLayout, backend| {
        KvCache::new(KvCacheConfig {
            layout: l,
            block_size: BLOCK,
            num_blocks: 8,
            backend,
            prefix: None,
        })
    };
    let dense = build(layout(KvCacheDtype::Int8), StorageBackend::Dense);
    assert!(
        matches!(&dense, Err(KvError::Config(m)) if m.contains("paged")),
        "{dense:?}"
    );
    let odd = build(
        KvLayout {
            head_dim: 48,
            ..layout(KvCacheDtype::Int4)
        },
        StorageBackend::Paged,
    );
    assert!(
        matches!(&odd, Err(KvError::Config(m)) if m.contains("48")),
        "{odd:?}"
    );
    // A float cast stores fine in dense buffers.
    assert!(build(layout(KvCacheDtype::Float16), StorageBackend::Dense).is_ok());
}

#[test]
fn stored_blocks_survive_the_disk_tier_byte_for_byte_and_only_for_their_dtype() {
    let dir = std::env::temp_dir().join(format!("mlxcel-kv-quantized-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let tier = DiskTierConfig {
        dir: dir.clone(),
        max_bytes: 64 << 20,
        fingerprint: 3,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let values = random(&mut rng, 8);
    let next = random(&mut rng, 1);
    let tokens: Vec<u32> = (100..109).collect();
    let files = |dir: &std::path::Path| -> Vec<(std::path::PathBuf, u64)> {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return Vec::new();
        };
        let mut out: Vec<_> = entries
            .filter_map(|e| e.ok())
            .filter(|e| e.path().extension().is_some_and(|x| x == "kvb"))
            .map(|e| (e.path(), e.metadata().expect("metadata").len()))
            .collect();
        out.sort();
        out
    };
    // Payload bytes of one token's K (or V) in one head, as the pool keeps
    // it: 8 or 4 bits a feature plus a scale and bias per 64 in the compute
    // dtype (4 bytes for float32, 2 for bfloat16); 2 bytes a feature for
    // the float casts.
    let per_head = |dtype: Dtype, kv_dtype: KvCacheDtype| match kv_dtype.bits() {
        Some(bits) => HEAD_DIM * bits / 8 + 2 * dtype.size_bytes(),
        None => HEAD_DIM * 2,
    };
    for (dtype, kv_dtype) in [
        (Dtype::Float32, KvCacheDtype::Int8),
        (Dtype::Float32, KvCacheDtype::Int4),
        (Dtype::Float32, KvCacheDtype::Float16),
        (Dtype::Float32, KvCacheDtype::Bfloat16),
        (Dtype::Bfloat16, KvCacheDtype::Int8),
    ] {
        let before = files(&dir);
        // Compute 8 tokens (two full blocks), donate, save at a clean stop.
        let mut first = cache_in(dtype, kv_dtype, true);
        first.open_disk_tier(&tier).expect("tier");
        let (seq, cached) = first.new_sequence_for_prompt(&tokens).expect("lookup");
        assert_eq!(cached, 0);
        write(&mut first, &seq, &values);
        first.donate(&seq, &tokens[..8]).expect("donate");
        let [want_k, want_v] = read_with_next(&mut first, &seq, &next, 1);
        assert_eq!(first.save_to_disk(), 2, "{kv_dtype}: blocks saved");
        drop(seq);
        drop(first);
        // Each file is the header and the block's bytes as stored.
        let new: Vec<_> = files(&dir)
            .into_iter()
            .filter(|f| !before.contains(f))
            .collect();
        assert_eq!(new.len(), 2, "{kv_dtype}: two new files");
        let payload = 2 * LAYERS * BLOCK * HEADS * per_head(dtype, kv_dtype);
        for (path, len) in &new {
            assert_eq!(
                *len as usize,
                mlxcel_kv::disk::format::HEADER_BYTES + payload,
                "{kv_dtype}: {}",
                path.display()
            );
        }
        // A new cache of the same dtype starts warm from the files.
        let mut second = cache_in(dtype, kv_dtype, true);
        second.open_disk_tier(&tier).expect("tier");
        let (seq, cached) = second.new_sequence_for_prompt(&tokens).expect("lookup");
        assert_eq!(cached, 8, "{kv_dtype}: hit from disk");
        let [k, v] = read_with_next(&mut second, &seq, &next, 1);
        assert_eq!(k, want_k, "{kv_dtype}: keys from disk");
        assert_eq!(v, want_v, "{kv_dtype}: values from disk");
    }
    // Another KV dtype in the same directory finds none of them.
    let mut other = cache(KvCacheDtype::Float32, true);
    other.open_disk_tier(&tier).expect("tier");
    let (_, cached) = other.new_sequence_for_prompt(&tokens).expect("lookup");
    assert_eq!(cached, 0, "float32 cache served no other dtype's block");
    let _ = std::fs::remove_dir_all(&dir);
}
