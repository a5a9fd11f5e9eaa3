//! Warm-up: every kind of step the engine runs, once, before the first
//! request (`docs/performance.md`, "Kernel compilation").
//!
//! MLX compiles GPU kernels lazily, the first time a variant is evaluated,
//! and on a fresh machine some take tens of seconds (measured on an H200:
//! 16-42 s for each 4-bit quantized-matmul kernel; on CUDA
//! `crate::kernels` compiles them in parallel child processes first).
//! Which variants a step needs depends only on a few things, not on exact
//! shapes: the quantized matmul picks a tile from the step's token count
//! (under 8 rows, 8-16, 17-32, more), gathers and scatters by dtype, the
//! paged-attention kernel by model shape, sampling by path (device argmax,
//! or host logits). So a handful of real requests covers them all:
//!
//! - one prompt of a full prefill chunk plus 24 tokens, decoded for a few
//!   tokens (a large chunk, a 17-32-token chunk, one-row pipelined decode
//!   sampled on the device; on paged storage a row that long runs the
//!   paged kernel split into parts, and its merge);
//! - one sampled 12-token prompt (an 8-16-token chunk, sampling on the
//!   host);
//! - `min(parallel, 12)` 12-token prompts at once, half greedy and half
//!   sampled (a multi-row decode through the batched attention path);
//! - as many greedy ones, half of them stopping after two tokens (a
//!   pipelined decode step that gathers the tokens of the rows still
//!   running from the previous step's);
//! - one prompt of each power of two from 16 to 1,024 tokens (up to the
//!   chunk), one token each: the first prompt of a new length otherwise
//!   pays for cuBLAS choosing and loading kernels for the attention's
//!   matmul shapes (measured 1.5-3.6x its later prefill time on an H200).
//!
//! The requests run through [`Engine::submit`] like any other, with the
//! prompt cache off, so they leave no cached blocks behind (the engine's
//! step counters do include them).

use std::time::Instant;

use crate::api::{GenerationEvent, GenerationRequest, InferenceService, Prompt, SamplingParams};
use crate::error::EngineError;
use crate::handle::Engine;

/// Completion tokens of each warm-up request.
const WARMUP_TOKENS: usize = 4;

/// What [`warm_up`] ran.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WarmupReport {
    /// Requests run.
    pub requests: usize,
    /// Wall time, seconds.
    pub seconds: f64,
}

/// Runs the warm-up requests (see the module docs) and waits for them.
///
/// # Errors
/// A request refused or failed: the engine could not run a step it will
/// need to serve.
pub fn warm_up(
    engine: &Engine,
    chunk: usize,
    parallel: usize,
) -> Result<WarmupReport, EngineError> {
    let started = Instant::now();
    // The longest prompt a request may have here (context and KV pool).
    let context = engine
        .context_length()
        .min(engine.info.max_request_tokens)
        .saturating_sub(WARMUP_TOKENS + 1);
    // Token ids: a short cycle of small ids, valid in every vocabulary.
    let tokens = |n: usize, salt: u32| -> Vec<u32> {
        (0..n as u32).map(|i| 100 + (i * 7 + salt) % 500).collect()
    };
    let long = (chunk + 24).min(context).max(1);
    let mut rounds: Vec<Vec<GenerationRequest>> = vec![vec![request(tokens(long, 0), None)]];
    rounds.push(vec![request(tokens(12, 1), Some(0))]);
    let many = parallel.min(12);
    rounds.push(
        (0..many)
            .map(|i| request(tokens(12, i as u32 + 2), (i % 2 == 1).then_some(i as u64)))
            .collect(),
    );
    if many >= 2 {
        // Greedy rows that finish at different steps: the pipelined decode
        // then goes on with a subset of the rows in flight, whose tokens
        // it picks out on the device (a gather the rounds above never
        // run; measured on an H200, its compile in the first minute of
        // serving halved 8-client throughput).
        rounds.push(
            (0..many)
                .map(|i| {
                    let mut r = request(tokens(12, i as u32 + 20), None);
                    r.max_tokens = if i % 2 == 0 { 2 } else { WARMUP_TOKENS + 2 };
                    r
                })
                .collect(),
        );
    }
    let mut lengths = Vec::new();
    let mut n = 16;
    while n <= chunk.min(1024).min(context) {
        lengths.push(n);
        n *= 2;
    }
    rounds.push(
        lengths
            .iter()
            .map(|&n| {
                let mut r = request(tokens(n, n as u32), None);
                r.max_tokens = 1;
                r
            })
            .collect(),
    );
    let mut requests = 0;
    let total: usize = rounds.iter().map(Vec::len).sum();
    for round in rounds {
        let streams = round
            .into_iter()
            .map(|r| engine.submit(r))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| EngineError::Config(format!("warm-up request refused: {e}")))?;
        for mut stream in streams {
            requests += 1;
            loop {
                match stream.blocking_recv() {
                    Some(GenerationEvent::Finished { .. }) => {
                        // Drawn as a bar by the binaries (see `src/progress.rs`).
                        tracing::debug!(
                            target: "mlxcel::progress",
                            stage = "warming up",
                            done = requests,
                            total
                        );
                        break;
                    }
                    Some(GenerationEvent::Failed { message, .. }) => {
                        return Err(EngineError::Config(format!(
                            "warm-up step failed: {message}"
                        )))
                    }
                    Some(_) => {}
                    None => {
                        return Err(EngineError::Thread(
                            "the engine stopped during warm-up".into(),
                        ))
                    }
                }
            }
        }
    }
    Ok(WarmupReport {
        requests,
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// A warm-up request of `prompt`: greedy, or sampled with `seed`.
fn request(prompt: Vec<u32>, seed: Option<u64>) -> GenerationRequest {
    let sampling = SamplingParams {
        temperature: if seed.is_some() { 0.8 } else { 0.0 },
        seed,
        ..SamplingParams::default()
    };
    let mut r = GenerationRequest::new(Prompt::Tokens(prompt), sampling, WARMUP_TOKENS);
    r.ignore_eos = true;
    r.cache_prompt = false;
    r
}
