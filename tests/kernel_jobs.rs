//! The kernel jobs of `mlxcel_engine::kernels` (CUDA start-up: kernels
//! compiled in parallel child processes before the warm-up): the plan for
//! a quantized checkpoint, the child's exit statuses, and a failed child
//! counted without a marker. On this CPU-only machine a child cannot reach
//! a GPU, which is what the failure paths need; the compile itself is
//! measured on the H200 (benches/results/2026-12-03-cold-start-h200.md).

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::Command;

use mlxcel_engine::kernels::{self, KernelJob, JOB_ENV};
use mlxcel_mlx::Dtype;

const SERVER: &str = env!("CARGO_BIN_EXE_mlxcel-server");

fn tiny(name: &str) -> PathBuf {
    std::env::var_os("MLXCEL_TINY_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/tiny-models"))
        .join(name)
}

#[test]
fn the_plan_covers_every_quantized_matrix_shape_at_each_token_tile() {
    // Tiny Phi-3, 4-bit groups of 32: qkv [128, 64], o [64, 64],
    // gate_up [256, 64], down [64, 128], embed_tokens and lm_head
    // [256, 64] (scripts/make_tiny_models.py).
    let dir = tiny("phi3_q4");
    let config = mlxcel_engine::loader::read_config(&dir).expect("config");
    let jobs = kernels::plan(&dir, &config.quantization, Dtype::Float32, true, 512).expect("plan");
    let mut expected = HashSet::new();
    for (out, input) in [(128, 64), (64, 64), (256, 64), (64, 128)] {
        for tokens in [12, 24, 256] {
            expected.insert(KernelJob::QuantizedMatmul {
                dtype: Dtype::Float32,
                tokens,
                out,
                input,
                bits: 4,
                group_size: 32,
            });
        }
    }
    for dtype in [Dtype::Float32, Dtype::Uint32] {
        for index in [Dtype::Int32, Dtype::Uint32] {
            expected.insert(KernelJob::Gather { dtype, index });
        }
        expected.insert(KernelJob::ScatterAxis {
            dtype,
            index: Dtype::Int32,
        });
    }
    // The routing's take_along_axis: the compute dtype and float32 (one
    // job here, both being float32).
    expected.insert(KernelJob::GatherAxis {
        dtype: Dtype::Float32,
        index: Dtype::Uint32,
    });
    assert_eq!(jobs.len(), expected.len(), "{jobs:?}");
    assert_eq!(jobs.iter().copied().collect::<HashSet<_>>(), expected);
    // The matmuls (the long compiles) come first.
    let first_other = jobs
        .iter()
        .position(|j| !matches!(j, KernelJob::QuantizedMatmul { .. }))
        .expect("gathers");
    assert_eq!(first_other, 12);

    // A short prefill chunk is its own tile; dequantized weights and a
    // checkpoint without quantized matrices get no matmul jobs.
    let short = kernels::plan(&dir, &config.quantization, Dtype::Float32, true, 8).expect("plan");
    let tokens: HashSet<usize> = short
        .iter()
        .filter_map(|j| match j {
            KernelJob::QuantizedMatmul { tokens, .. } => Some(*tokens),
            _ => None,
        })
        .collect();
    assert_eq!(tokens, HashSet::from([8, 12, 24]));
    let dense =
        kernels::plan(&dir, &config.quantization, Dtype::Float32, false, 512).expect("plan");
    assert_eq!(dense.len(), 7);
    let plain = tiny("phi3");
    let plain_config = mlxcel_engine::loader::read_config(&plain).expect("config");
    let bf16 = kernels::plan(
        &plain,
        &plain_config.quantization,
        Dtype::Bfloat16,
        true,
        512,
    )
    .expect("plan");
    assert!(bf16
        .iter()
        .all(|j| !matches!(j, KernelJob::QuantizedMatmul { .. })));
    assert!(bf16.contains(&KernelJob::Gather {
        dtype: Dtype::Bfloat16,
        index: Dtype::Int32
    }));
}

#[test]
fn a_child_reports_a_malformed_job_and_a_missing_gpu() {
    let run = |spec: &str| {
        Command::new(SERVER)
            .env(JOB_ENV, spec)
            .output()
            .expect("run the server binary")
    };
    let malformed = run("qmm 10 12");
    assert_eq!(malformed.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&malformed.stderr).contains(JOB_ENV));
    // No GPU here: the job fails (status 1) with MLX's reason, and the
    // server never starts (it would need `-m`).
    let job = KernelJob::Gather {
        dtype: Dtype::Float32,
        index: Dtype::Int32,
    };
    let no_gpu = run(&job.spec());
    assert_eq!(no_gpu.status.code(), Some(1), "{no_gpu:?}");
    assert!(!no_gpu.stderr.is_empty());
    assert!(no_gpu.stdout.is_empty());
}

#[test]
fn failed_children_are_counted_and_leave_no_marker() {
    let cache = std::env::temp_dir().join(format!("mlxcel-kernel-jobs-{}", std::process::id()));
    std::fs::create_dir_all(&cache).expect("cache dir");
    // The children inherit the kernel cache directory.
    std::env::set_var("MLX_PTX_CACHE_DIR", &cache);
    let jobs = vec![
        KernelJob::Gather {
            dtype: Dtype::Float32,
            index: Dtype::Int32,
        },
        KernelJob::ScatterAxis {
            dtype: Dtype::Float32,
            index: Dtype::Int32,
        },
        KernelJob::Gather {
            dtype: Dtype::Uint32,
            index: Dtype::Uint32,
        },
    ];
    let report = kernels::start(jobs, PathBuf::from(SERVER)).wait();
    assert_eq!(report.jobs, 3);
    assert_eq!(report.failed, 3);
    assert!(report.children >= 1 && report.children <= 3);
    let left: Vec<_> = std::fs::read_dir(&cache).expect("read").collect();
    assert!(left.is_empty(), "{left:?}");
    let _ = std::fs::remove_dir_all(&cache);
}
