//! GPU kernels compiled in parallel before the warm-up (MLX's CUDA
//! backend; `docs/performance.md`, "Kernel compilation").
//!
//! MLX's CUDA backend compiles a kernel (NVRTC, one CPU thread) the first
//! time a variant runs, one after another. Measured on a fresh H200 (MLX
//! 0.32.4, SmolLM2-135M shape, 4-bit bfloat16, `--parallel 32`): the
//! warm-up took 186 s, 168 s of it in six quantized-matmul kernels
//! (16-42 s each: tiles of 16, 32 and 64 rows, a plain and an sm80 one per
//! tile, picked by the matrix's shape) and the rest in gathers and one
//! scatter (2.6-6.6 s each). Which variant an operation needs depends on
//! its dtypes, its row-count tile and its matrix shape, not on the values.
//!
//! So before the model loads, [`plan`] lists one small operation per
//! variant the warm-up will meet ([`KernelJob`]: each quantized matrix
//! shape of the checkpoint at the warm-up's token counts, gathers and the
//! K/V scatter per dtype, the routing's `take_along_axis`), and [`start`]
//! runs each in a child process (this executable again, with [`JOB_ENV`]
//! naming the job; the binaries call [`child_main`] first thing), as many
//! at once as the machine has cores, at most 16. The children write their
//! kernels into the kernel cache directory (`MLX_PTX_CACHE_DIR`, which
//! they inherit), where the warm-up then finds them. Nothing depends on it
//! for correctness: a kernel a child did not compile is compiled by the
//! warm-up, as without it. A marker file in the cache directory records a
//! job list that completed, so a restart does not start the children
//! again (with `--kernel-cache-dir none` there is no marker: the children
//! run at every start and find their kernels in MLX's default cache).
//!
//! Not covered (compiled by the warm-up, one after another, as before):
//! GGUF checkpoints' matrices, a draft model's, K/V stored in a float
//! dtype other than the compute dtype, `mx.compile`d fused kernels
//! (gpt-oss's clamped SwiGLU), tensor-parallel ranks.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mlxcel_mlx::{Array, Dtype};
use mlxcel_model::config::Quantization;

/// The environment variable that makes a process a kernel job's child:
/// its value is the job ([`KernelJob::spec`]).
pub const JOB_ENV: &str = "MLXCEL_KERNEL_JOB";

/// Children running at once at most (each holds a GPU context).
const MAX_CHILDREN: usize = 16;

/// One operation whose kernel a step will need.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelJob {
    /// `x [tokens, input] @ wᵀ` with `w` affine-quantized `[out, input]`
    /// (`quantized_matmul`, transposed).
    QuantizedMatmul {
        /// Compute dtype (of `x`, the scales and biases).
        dtype: Dtype,
        /// Rows of `x` (the step's tokens).
        tokens: usize,
        /// Output features.
        out: usize,
        /// Input features.
        input: usize,
        /// Bits per weight element.
        bits: i32,
        /// Elements per scale and bias.
        group_size: i32,
    },
    /// `take` along axis 0 of a `dtype` array with `index` indices.
    Gather { dtype: Dtype, index: Dtype },
    /// `take_along_axis` along the last axis (a mixture of experts' scores
    /// of its chosen experts).
    GatherAxis { dtype: Dtype, index: Dtype },
    /// `put_along_axis` along axis 0 (the paged pool's K/V write).
    ScatterAxis { dtype: Dtype, index: Dtype },
}

impl KernelJob {
    /// The job as [`JOB_ENV`] carries it: space-separated numbers after a
    /// kind (`qmm`, `gather`, `gather_axis`, `scatter`), dtypes as MLX's
    /// codes.
    pub fn spec(&self) -> String {
        match *self {
            KernelJob::QuantizedMatmul {
                dtype,
                tokens,
                out,
                input,
                bits,
                group_size,
            } => format!(
                "qmm {} {tokens} {out} {input} {bits} {group_size}",
                dtype as i32
            ),
            KernelJob::Gather { dtype, index } => {
                format!("gather {} {}", dtype as i32, index as i32)
            }
            KernelJob::GatherAxis { dtype, index } => {
                format!("gather_axis {} {}", dtype as i32, index as i32)
            }
            KernelJob::ScatterAxis { dtype, index } => {
                format!("scatter {} {}", dtype as i32, index as i32)
            }
        }
    }

    /// The job of `spec` ([`KernelJob::spec`]); `None` when malformed.
    pub fn parse(spec: &str) -> Option<KernelJob> {
        let mut parts = spec.split_whitespace();
        let kind = parts.next()?;
        let nums: Vec<i64> = parts.map(|p| p.parse().ok()).collect::<Option<_>>()?;
        let dtype = |i: usize| Dtype::from_code(i32::try_from(*nums.get(i)?).ok()?);
        let size = |i: usize| usize::try_from(*nums.get(i)?).ok().filter(|&n| n > 0);
        let small = |i: usize| i32::try_from(*nums.get(i)?).ok().filter(|&n| n > 0);
        match (kind, nums.len()) {
            ("qmm", 6) => Some(KernelJob::QuantizedMatmul {
                dtype: dtype(0)?,
                tokens: size(1)?,
                out: size(2)?,
                input: size(3)?,
                bits: small(4)?,
                group_size: small(5)?,
            }),
            ("gather", 2) => Some(KernelJob::Gather {
                dtype: dtype(0)?,
                index: dtype(1)?,
            }),
            ("gather_axis", 2) => Some(KernelJob::GatherAxis {
                dtype: dtype(0)?,
                index: dtype(1)?,
            }),
            ("scatter", 2) => Some(KernelJob::ScatterAxis {
                dtype: dtype(0)?,
                index: dtype(1)?,
            }),
            _ => None,
        }
    }

    /// The job's operation on zeros, not evaluated (on the default
    /// device).
    ///
    /// # Errors
    /// Shapes MLX refuses (a matrix whose input is not a multiple of the
    /// group size or of the words' elements).
    pub fn build(&self) -> Result<Array, mlxcel_mlx::Error> {
        // Contiguous buffers, as the model's arrays are (a broadcast zero
        // could take another path).
        let zeros = |shape: &[i32], dtype: Dtype| mlxcel_mlx::zeros(shape, dtype)?.contiguous();
        let dim = |n: usize| {
            i32::try_from(n).map_err(|_| mlxcel_mlx::Error(format!("dimension {n} too large")))
        };
        match *self {
            KernelJob::QuantizedMatmul {
                dtype,
                tokens,
                out,
                input,
                bits,
                group_size,
            } => {
                let (t, o, i) = (dim(tokens)?, dim(out)?, dim(input)?);
                if i % group_size != 0 || (i * bits) % 32 != 0 {
                    return Err(mlxcel_mlx::Error(format!(
                        "input {i} does not pack into {bits}-bit groups of {group_size}"
                    )));
                }
                let x = zeros(&[t, i], dtype)?;
                let w = zeros(&[o, i * bits / 32], Dtype::Uint32)?;
                let scales = zeros(&[o, i / group_size], dtype)?;
                let biases = zeros(&[o, i / group_size], dtype)?;
                x.quantized_matmul(&w, &scales, &biases, true, group_size, bits)
            }
            KernelJob::Gather { dtype, index } => {
                zeros(&[8, 4], dtype)?.take(&zeros(&[2], index)?, 0)
            }
            KernelJob::GatherAxis { dtype, index } => {
                zeros(&[4, 8], dtype)?.take_along_axis(&zeros(&[4, 2], index)?, -1)
            }
            KernelJob::ScatterAxis { dtype, index } => zeros(&[8, 2, 4], dtype)?.put_along_axis(
                &zeros(&[2, 1, 1], index)?,
                &zeros(&[2, 2, 4], dtype)?,
                0,
            ),
        }
    }
}

/// The jobs for a model on a CUDA GPU: every 2-D quantized matrix shape of
/// the checkpoint in `model_dir` (safetensors; none for GGUF, for
/// `dequantized` weights, or when its headers cannot be read) at 12, 24 and
/// `min(prefill_chunk, 256)` tokens (the warm-up's row-count tiles);
/// gathers of the compute dtype, uint32 (packed weights, token ids) and
/// float32 (logits) by int32 and uint32 indices; `take_along_axis` of
/// float32 and the compute dtype by uint32 (a mixture of experts' routing:
/// measured on an H200, half of a small MoE model's warm-up once the rest
/// ran here); the pool's K/V scatter of the compute dtype and uint32
/// (quantized K/V). Without duplicates; the matmuls (the long compiles)
/// first, shape by shape, so that one shape's tiles start together.
pub fn plan(
    model_dir: &Path,
    quantization: &Quantization,
    dtype: Dtype,
    quantized_weights: bool,
    prefill_chunk: usize,
) -> Vec<KernelJob> {
    let mut jobs = Vec::new();
    if quantized_weights && model_dir.is_dir() {
        let mut tokens = vec![12, 24, prefill_chunk.clamp(1, 256)];
        tokens.sort_unstable();
        tokens.dedup();
        let matrices = mlxcel_model::weights::quantized_matrices(model_dir, quantization)
            .unwrap_or_else(|e| {
                tracing::debug!(error = %e, "no quantized-matmul kernel jobs");
                Vec::new()
            });
        for m in matrices {
            for &t in &tokens {
                jobs.push(KernelJob::QuantizedMatmul {
                    dtype,
                    tokens: t,
                    out: m.out,
                    input: m.input,
                    bits: m.spec.bits,
                    group_size: m.spec.group_size,
                });
            }
        }
    }
    for data in [dtype, Dtype::Uint32, Dtype::Float32] {
        for index in [Dtype::Int32, Dtype::Uint32] {
            jobs.push(KernelJob::Gather { dtype: data, index });
        }
    }
    for data in [dtype, Dtype::Float32] {
        jobs.push(KernelJob::GatherAxis {
            dtype: data,
            index: Dtype::Uint32,
        });
    }
    for data in [dtype, Dtype::Uint32] {
        jobs.push(KernelJob::ScatterAxis {
            dtype: data,
            index: Dtype::Int32,
        });
    }
    jobs.sort_by_cached_key(|j| match *j {
        KernelJob::QuantizedMatmul {
            tokens,
            out,
            input,
            bits,
            group_size,
            ..
        } => (0, (out, input, bits, group_size, tokens), String::new()),
        _ => (1, (0, 0, 0, 0, 0), j.spec()),
    });
    jobs.dedup();
    jobs
}

/// What [`Precompile::wait`] reports.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PrecompileReport {
    /// Jobs run (0 when a marker said they had all run before).
    pub jobs: usize,
    /// Jobs whose child failed twice (their kernels are left to the
    /// warm-up).
    pub failed: usize,
    /// Children at once.
    pub children: usize,
    /// Wall time, seconds.
    pub seconds: f64,
    /// The jobs were still running at the deadline ([`DEADLINE`]); the
    /// warm-up goes on without them (they finish on their own).
    pub timed_out: bool,
}

/// The longest [`Precompile::wait`] waits for the children: a child that
/// hangs must not keep a server from starting. Legitimate runs take a
/// minute on 16 cores (and a few on 4).
pub const DEADLINE: Duration = Duration::from_secs(600);

/// Children running [`KernelJob`]s in the background.
pub struct Precompile {
    done: Receiver<PrecompileReport>,
    started: Instant,
}

impl Precompile {
    /// Waits for every child, [`DEADLINE`] at most from the start. A child
    /// is never killed (one killed while writing its kernel would leave a
    /// truncated file in the cache): at the deadline this returns and the
    /// children finish on their own.
    pub fn wait(self) -> PrecompileReport {
        let left = DEADLINE.saturating_sub(self.started.elapsed());
        match self.done.recv_timeout(left) {
            Ok(report) => report,
            Err(e) => {
                let timed_out = matches!(e, RecvTimeoutError::Timeout);
                if !timed_out {
                    tracing::warn!("the kernel jobs' thread stopped without a report");
                }
                PrecompileReport {
                    seconds: self.started.elapsed().as_secs_f64(),
                    timed_out,
                    ..PrecompileReport::default()
                }
            }
        }
    }
}

/// Whether this process may start kernel jobs: it is not a job itself and
/// its `main` called [`child_main`] (so a child of it runs the job and
/// nothing else: a binary that never called it would start as itself).
pub fn available() -> bool {
    CHILD_MAIN_CALLED.load(Ordering::Relaxed) && std::env::var_os(JOB_ENV).is_none()
}

static CHILD_MAIN_CALLED: AtomicBool = AtomicBool::new(false);

/// The marker that records `jobs` as done in the kernel cache directory
/// (`MLX_PTX_CACHE_DIR`); `None` when it is not set.
fn marker(jobs: &[KernelJob]) -> Option<PathBuf> {
    let dir = std::env::var_os("MLX_PTX_CACHE_DIR")?;
    let list: Vec<String> = jobs.iter().map(KernelJob::spec).collect();
    let key = format!("{}|{}", mlxcel_mlx::version(), list.join(";"));
    Some(Path::new(&dir).join(format!(
        "mlxcel-jobs-{:016x}.done",
        crate::platform::stable_hash(&key)
    )))
}

/// Starts `jobs` in child processes of `exe` (this executable, whose
/// `main` calls [`child_main`] first: see [`available`]), as many at once
/// as the machine has cores (at most 16), each with [`JOB_ENV`] set; the
/// children inherit the environment (`MLX_PTX_CACHE_DIR`). A job whose
/// child fails is run once more (two children compiling the same kernel
/// can meet a file the other is still writing). When every job succeeded
/// and `MLX_PTX_CACHE_DIR` is set, a marker there skips the same list
/// next time. Returns at once.
pub fn start(jobs: Vec<KernelJob>, exe: PathBuf) -> Precompile {
    let (tx, done) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(run_children(jobs, &exe));
    });
    Precompile {
        done,
        started: Instant::now(),
    }
}

/// Runs `job` in a child of `exe`; the child's error when it fails.
fn run_child(exe: &Path, job: &KernelJob) -> Option<String> {
    let out = Command::new(exe)
        .env(JOB_ENV, job.spec())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output();
    match out {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!(
            "{}: {}",
            o.status,
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Some(e.to_string()),
    }
}

fn run_children(jobs: Vec<KernelJob>, exe: &Path) -> PrecompileReport {
    let started = Instant::now();
    let marker = marker(&jobs);
    if marker.as_deref().is_some_and(Path::exists) {
        return PrecompileReport::default();
    }
    let children = std::thread::available_parallelism()
        .map_or(4, usize::from)
        .clamp(1, MAX_CHILDREN)
        .min(jobs.len());
    let total = jobs.len();
    let queue = Arc::new(Mutex::new(VecDeque::from(jobs)));
    let failed = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..children)
        .map(|_| {
            let (queue, failed, exe) = (Arc::clone(&queue), Arc::clone(&failed), exe.to_owned());
            std::thread::spawn(move || loop {
                let Some(job) = queue.lock().ok().and_then(|mut q| q.pop_front()) else {
                    return;
                };
                let t = Instant::now();
                let error = run_child(&exe, &job).and_then(|first| {
                    tracing::debug!(job = %job.spec(), error = %first, "kernel job failed; once more");
                    run_child(&exe, &job)
                });
                match error {
                    None => tracing::debug!(
                        job = %job.spec(),
                        seconds = t.elapsed().as_secs_f64(),
                        "kernel job done"
                    ),
                    Some(error) => {
                        tracing::warn!(
                            job = %job.spec(),
                            %error,
                            "kernel job failed; the warm-up compiles its kernel"
                        );
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    let mut lost = 0;
    for w in workers {
        if w.join().is_err() {
            lost += 1;
        }
    }
    let failed = failed.load(Ordering::Relaxed) + lost;
    if failed == 0 {
        if let Some(path) = &marker {
            if let Err(e) = std::fs::write(path, b"") {
                tracing::debug!(path = %path.display(), error = %e, "no kernel job marker");
            }
        }
    }
    PrecompileReport {
        jobs: total,
        failed,
        children,
        seconds: started.elapsed().as_secs_f64(),
        timed_out: false,
    }
}

/// The child's side: when [`JOB_ENV`] is set, runs that job on the GPU and
/// returns the process's exit status (0 done, 1 failed, 2 malformed job);
/// `None` in an ordinary process. Binaries that let the engine start
/// children call it before anything else and exit with its status.
pub fn child_main() -> Option<i32> {
    CHILD_MAIN_CALLED.store(true, Ordering::Relaxed);
    let spec = std::env::var(JOB_ENV).ok()?;
    let Some(job) = KernelJob::parse(&spec) else {
        eprintln!("malformed {JOB_ENV}: {spec:?}");
        return Some(2);
    };
    let run = || -> Result<(), mlxcel_mlx::Error> {
        mlxcel_mlx::use_device(true)?;
        job.build()?.eval()
    };
    Some(match run() {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("{e}");
            1
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_round_trip_and_malformed_ones_are_refused() {
        let jobs = [
            KernelJob::QuantizedMatmul {
                dtype: Dtype::Bfloat16,
                tokens: 24,
                out: 576,
                input: 1536,
                bits: 4,
                group_size: 64,
            },
            KernelJob::Gather {
                dtype: Dtype::Float32,
                index: Dtype::Int32,
            },
            KernelJob::ScatterAxis {
                dtype: Dtype::Uint32,
                index: Dtype::Int32,
            },
            KernelJob::GatherAxis {
                dtype: Dtype::Bfloat16,
                index: Dtype::Uint32,
            },
        ];
        for job in jobs {
            assert_eq!(KernelJob::parse(&job.spec()), Some(job), "{}", job.spec());
        }
        assert_eq!(jobs[0].spec(), "qmm 12 24 576 1536 4 64");
        for bad in [
            "",
            "qmm 12 24 576 1536 4",
            "qmm 12 0 576 1536 4 64",
            "qmm 99 24 576 1536 4 64",
            "gather 10 x",
            "gather 10 7 1",
            "conv 10 7",
        ] {
            assert_eq!(KernelJob::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn every_kind_of_job_builds_and_runs() {
        for job in [
            KernelJob::QuantizedMatmul {
                dtype: Dtype::Float32,
                tokens: 12,
                out: 48,
                input: 128,
                bits: 4,
                group_size: 64,
            },
            KernelJob::Gather {
                dtype: Dtype::Uint32,
                index: Dtype::Uint32,
            },
            KernelJob::ScatterAxis {
                dtype: Dtype::Float32,
                index: Dtype::Int32,
            },
            KernelJob::GatherAxis {
                dtype: Dtype::Float32,
                index: Dtype::Uint32,
            },
        ] {
            let a = job.build().expect("build");
            a.eval().expect("eval");
            let expected: &[i32] = match job {
                KernelJob::QuantizedMatmul { .. } => &[12, 48],
                KernelJob::Gather { .. } => &[2, 4],
                KernelJob::ScatterAxis { .. } => &[8, 2, 4],
                KernelJob::GatherAxis { .. } => &[4, 2],
            };
            assert_eq!(a.shape(), expected, "{}", job.spec());
        }
        let bad = KernelJob::QuantizedMatmul {
            dtype: Dtype::Float32,
            tokens: 12,
            out: 48,
            input: 100,
            bits: 4,
            group_size: 64,
        };
        assert!(bad.build().is_err());
    }
}
