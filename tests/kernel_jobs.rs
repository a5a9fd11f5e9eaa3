//! The kernel jobs of `mlxcel_engine::kernels` (CUDA start-up: kernels
//! compiled in parallel child processes before the warm-up): the plan for
//! a quantized checkpoint, a child's exit statuses, who may start jobs,
//! and the runner's counting, retry and marker (with `/bin/true` and
//! `/bin/false` as the children). The compile itself is measured on the
//! H200 (benches/results/2026-12-03-cold-start-h200.md).

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::Command;

use mlxcel_engine::kernels::{self, KernelJob, JOB_ENV};
use mlxcel_mlx::Dtype;

const SERVER: &str = env!("CARGO_BIN_EXE_mlxcel-server");

mod common;

fn tiny(name: &str) -> PathBuf {
    common::tiny_models_root().join(name)
}

#[test]
fn the_plan_covers_every_quantized_matrix_shape_at_each_token_tile() {
    // Tiny Phi-3, 4-bit groups of 32: qkv [128, 64], o [64, 64],
    // gate_up [256, 64], down [64, 128], embed_tokens and lm_head
    // [256, 64] (scripts/make_tiny_models.py).
    let dir = tiny("phi3_q4");
    let config = mlxcel_engine::loader::read_config(&dir).expect("config");
    let jobs = kernels::plan(&dir, &config.quantization, Dtype::Float32, true, 512);
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
    let short = kernels::plan(&dir, &config.quantization, Dtype::Float32, true, 8);
    let tokens: HashSet<usize> = short
        .iter()
        .filter_map(|j| match j {
            KernelJob::QuantizedMatmul { tokens, .. } => Some(*tokens),
            _ => None,
        })
        .collect();
    assert_eq!(tokens, HashSet::from([8, 12, 24]));
    let dense = kernels::plan(&dir, &config.quantization, Dtype::Float32, false, 512);
    assert_eq!(dense.len(), 7);
    let plain = tiny("phi3");
    let plain_config = mlxcel_engine::loader::read_config(&plain).expect("config");
    let bf16 = kernels::plan(
        &plain,
        &plain_config.quantization,
        Dtype::Bfloat16,
        true,
        512,
    );
    assert!(bf16
        .iter()
        .all(|j| !matches!(j, KernelJob::QuantizedMatmul { .. })));
    assert!(bf16.contains(&KernelJob::Gather {
        dtype: Dtype::Bfloat16,
        index: Dtype::Int32
    }));
}

#[test]
fn a_child_runs_its_job_or_reports_why_not() {
    let run = |spec: &str| {
        Command::new(SERVER)
            .env(JOB_ENV, spec)
            .output()
            .expect("run the server binary")
    };
    let malformed = run("qmm 10 12");
    assert_eq!(malformed.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&malformed.stderr).contains(JOB_ENV));
    // The job and nothing else (the server would need `-m`): done on a
    // GPU; without one it fails (status 1) with MLX's reason.
    let job = KernelJob::Gather {
        dtype: Dtype::Float32,
        index: Dtype::Int32,
    };
    let out = run(&job.spec());
    assert!(out.stdout.is_empty(), "{out:?}");
    if mlxcel_mlx::gpu_available() {
        assert_eq!(out.status.code(), Some(0), "{out:?}");
    } else {
        assert_eq!(out.status.code(), Some(1), "{out:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("gpu"),
            "{out:?}"
        );
    }
}

#[test]
fn only_a_process_whose_main_runs_jobs_may_start_them() {
    // This test binary's main never called child_main.
    assert!(!kernels::available());
    assert_eq!(kernels::child_main(), None, "{JOB_ENV} is not set here");
    assert!(kernels::available());
}

#[test]
fn jobs_are_counted_retried_and_marked_done_only_when_all_succeed() {
    let cache = std::env::temp_dir().join(format!("mlxcel-kernel-jobs-{}", std::process::id()));
    std::fs::create_dir_all(&cache).expect("cache dir");
    // The marker goes to the kernel cache directory, as the children's
    // kernels do.
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
    let files = || std::fs::read_dir(&cache).expect("read").count();
    // Stand-ins for the executable: one whose every child fails, one whose
    // every child succeeds.
    let report = kernels::start(jobs.clone(), PathBuf::from("/bin/false")).wait();
    assert_eq!(
        (report.jobs, report.failed, report.timed_out),
        (3, 3, false)
    );
    assert!(report.children >= 1 && report.children <= 3);
    assert_eq!(files(), 0, "no marker after failures");
    let report = kernels::start(jobs.clone(), PathBuf::from("/bin/true")).wait();
    assert_eq!((report.jobs, report.failed), (3, 0));
    assert_eq!(files(), 1, "the marker");
    // The same list again: skipped, even with children that would fail.
    let report = kernels::start(jobs.clone(), PathBuf::from("/bin/false")).wait();
    assert_eq!((report.jobs, report.failed, report.children), (0, 0, 0));
    // Another list is not.
    let report = kernels::start(jobs[..2].to_vec(), PathBuf::from("/bin/false")).wait();
    assert_eq!((report.jobs, report.failed), (2, 2));
    let _ = std::fs::remove_dir_all(&cache);
}
