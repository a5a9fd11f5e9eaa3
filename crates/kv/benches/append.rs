//! Appending one token's K/V costs O(token), not O(pool) (docs/architecture.md,
//! "Threads and memory"): the time of a decode-style append (reserve one
//! position, write its K/V through a step view, evaluate) at two pool sizes
//! 128x apart, for both backends. A copy of the pool per append would make
//! the large pool ~128x slower.
//!
//! Run: `cargo bench -p mlxcel-kv --bench append`.

use std::time::Instant;

use mlxcel_kv::{AttentionKv, KvCache, KvCacheConfig, KvLayout, StorageBackend};
use mlxcel_mlx::{Array, Dtype};

const BLOCK: usize = 32;
const APPENDS: usize = 2_000;

/// Microseconds per appended token into a pool of `blocks` blocks.
fn per_append_us(backend: StorageBackend, blocks: usize) -> f64 {
    let layout = KvLayout {
        layers: 1,
        kv_heads: 3,
        head_dim: 64,
        dtype: Dtype::Float32,
        kv_dtype: mlxcel_kv::KvCacheDtype::Auto,
    };
    let mut cache = KvCache::new(KvCacheConfig {
        layout,
        block_size: BLOCK,
        num_blocks: blocks,
        backend,
        prefix: None,
    })
    .expect("cache");
    let k = Array::from_f32(&[0.5; 3 * 64], &[1, 3, 64]).expect("k");
    let seq = cache.new_sequence();
    let capacity = (blocks - 1) * BLOCK;
    let mut run = |n: usize| {
        for _ in 0..n {
            if cache.end(&seq).expect("end") >= capacity {
                // Start over (rare: once per `capacity` appends).
                cache.truncate_tail(&seq, 0).expect("rewind");
            }
            cache.append(&seq, 1).expect("append");
            let mut step = cache.step(&[(&seq, 1)]).expect("step");
            step.write(0, &k, &k).expect("write");
            mlxcel_mlx::eval(&step.storage()).expect("eval");
        }
    };
    run(100);
    let t = Instant::now();
    run(APPENDS);
    t.elapsed().as_secs_f64() * 1e6 / APPENDS as f64
}

fn main() {
    println!("| backend | pool tokens | pool MiB | us per append |");
    println!("| --- | --- | --- | --- |");
    for backend in [StorageBackend::Paged, StorageBackend::Dense] {
        for blocks in [64, 64 * 128] {
            let us = per_append_us(backend, blocks);
            let mib = (blocks * BLOCK * 2 * 3 * 64 * 4) as f64 / (1 << 20) as f64;
            println!("| {backend} | {} | {mib:.0} | {us:.1} |", blocks * BLOCK);
        }
    }
}
