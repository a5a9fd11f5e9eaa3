//! The quality cost of storing K/V quantized or cast (`--kv-cache-dtype`),
//! measured on a real checkpoint against full-precision K/V.
//!
//! ```text
//! cargo run --release --example kv_quality -- --model models/SmolLM2-135M-Instruct \
//!     [--prompts 12] [--tokens 64] [--dtypes int8,int4,float16]
//! ```
//!
//! The model loads in float32 with dequantized weights (the CPU default).
//! Every run uses a paged KV cache of 32-token blocks built as the engine
//! builds it (one KV group per attention window, window groups trimmed
//! after every step), stored as `auto` (float32 here) or as each asked
//! dtype. Per prompt:
//!
//! - the float run decodes `--tokens` tokens greedily (EOS ignored) and
//!   keeps the logits of every position;
//! - each dtype decodes greedily on its own: does it produce the same
//!   tokens, and for how long (it stops at its first differing token);
//! - each dtype is teacher-forced on the float run's tokens (the prompt in
//!   one step, then one token per step): per position, the largest
//!   `|logit - float logit|` over the vocabulary, and whether the argmax
//!   agrees.
//!
//! Prints a markdown table (one row per dtype) and a JSON summary line.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use mlxcel_engine::api::ChatMessage;
use mlxcel_engine::loader::{load_model, load_text, read_config, Checkpoint};
use mlxcel_kv::{
    KvCache, KvCacheConfig, KvCacheDtype, KvGroupConfig, KvLayout, KvSequence, LayerState,
    RecurrentConfig, RowReserve, StorageBackend,
};
use mlxcel_mlx::Dtype;
use mlxcel_model::{AttentionPath, LoadOptions, Model, StepRow, WeightMode};
use mlxcel_text::Text;

/// Tokens per KV block (the engine's default).
const BLOCK_SIZE: usize = 32;

#[derive(Parser, Debug)]
#[command(about = "Greedy agreement and logit error of quantized/cast K/V vs float K/V")]
struct Args {
    /// Checkpoint directory (its tokenizer.json, else the GGUF file in it,
    /// gives the tokenizer).
    #[arg(long)]
    model: PathBuf,
    /// Prompts to run (at most the built-in set).
    #[arg(long, default_value_t = PROMPTS.len())]
    prompts: usize,
    /// Greedy tokens per prompt.
    #[arg(long, default_value_t = 64)]
    tokens: usize,
    /// KV cache dtypes to compare with `auto`, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "int8,int4,float16")]
    dtypes: Vec<KvCacheDtype>,
    /// Only the built-in prompts with these names (comma-separated).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Also print each prompt's token ids and, per position, the logit
    /// difference and whether the argmax agrees (stderr).
    #[arg(long)]
    detail: bool,
}

/// How a prompt is given to the model.
#[derive(Debug, Clone, Copy)]
enum Form {
    /// Raw text to continue.
    Raw,
    /// One user message through the chat template (raw `Question: ...
    /// Answer:` text when the tokenizer has none).
    Chat,
}

/// Varied prompts: code, prose, Q&A, lists, data; raw and chat.
const PROMPTS: &[(&str, Form, &str)] = &[
    (
        "code-rust",
        Form::Raw,
        "/// Returns the n-th Fibonacci number, computed iteratively.\n\
         pub fn fibonacci(n: u64) -> u64 {\n    let (mut a, mut b) = (0u64, 1u64);\n",
    ),
    (
        "code-python",
        Form::Raw,
        "import json\nfrom pathlib import Path\n\n\ndef load_records(path: Path) -> list[dict]:\n    \
         \"\"\"Read a JSON-lines file and return the records whose 'status' is 'ok'.\"\"\"\n",
    ),
    (
        "prose-story",
        Form::Raw,
        "The lighthouse keeper had not seen a ship in eleven days. On the twelfth morning, \
         the fog lifted just enough for her to make out a shape on the horizon, low and dark, \
         moving against the wind. She reached for the telescope and",
    ),
    (
        "prose-encyclopedic",
        Form::Raw,
        "Photosynthesis is the process by which green plants, algae and some bacteria convert \
         light energy into chemical energy. In plants it takes place mainly in the chloroplasts \
         of leaf cells, where chlorophyll absorbs light. The overall reaction",
    ),
    (
        "qa-raw",
        Form::Raw,
        "Q: What is the capital of Australia?\nA: Canberra.\n\nQ: How many bones are in the \
         adult human body?\nA: 206.\n\nQ: Why is the sky blue?\nA:",
    ),
    (
        "list-raw",
        Form::Raw,
        "Packing list for a three-day hiking trip:\n1. Backpack (40 litres)\n2. Tent\n3.",
    ),
    (
        "chat-explain",
        Form::Chat,
        "Explain the difference between a process and a thread to a new programmer.",
    ),
    (
        "chat-list",
        Form::Chat,
        "Give me five tips for writing clear technical documentation, as a numbered list.",
    ),
    (
        "chat-code",
        Form::Chat,
        "Write a Python function that checks whether a string is a palindrome, ignoring case \
         and punctuation.",
    ),
    (
        "chat-math",
        Form::Chat,
        "A train leaves at 14:20 and arrives at 17:05. How long is the journey? \
         Explain step by step.",
    ),
    (
        "data-csv",
        Form::Raw,
        "city,country,population_millions\nTokyo,Japan,37.4\nDelhi,India,31.0\n\
         Shanghai,China,27.1\nSao Paulo,Brazil,22.0\n",
    ),
    (
        "long-technical",
        Form::Raw,
        "A key-value cache stores the attention keys and values of every token a transformer \
         has already processed, so that generating the next token only needs to compute the \
         new token's query, key and value. Its size grows linearly with the sequence length, \
         the number of layers and the number of key-value heads, which is why long contexts \
         and many concurrent requests are limited by memory rather than by compute. Several \
         techniques reduce this cost. Grouped-query attention shares each key-value head among \
         several query heads. Paged storage allocates the cache in fixed-size blocks so that \
         sequences do not need contiguous memory. Quantization stores each key and value with \
         fewer bits, for example",
    ),
];

/// The text side for `dir`: the directory itself when it has a
/// `tokenizer.json`, else its one GGUF file (whose header carries the
/// tokenizer).
fn text_for(dir: &Path, vocab_size: usize) -> Result<(Text, PathBuf)> {
    let source = if dir.join("tokenizer.json").exists() {
        dir.to_path_buf()
    } else {
        let mut ggufs = std::fs::read_dir(dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
            .collect::<Vec<_>>();
        ggufs.sort();
        match ggufs.as_slice() {
            [one] => one.clone(),
            _ => bail!(
                "{}: no tokenizer.json and not exactly one GGUF file",
                dir.display()
            ),
        }
    };
    let checkpoint = Checkpoint::open(&source)?;
    Ok((load_text(&checkpoint, None, vocab_size)?, source))
}

/// Token ids of prompt `(form, text)`.
fn encode(text: &Text, form: Form, prompt: &str) -> Result<Vec<u32>> {
    Ok(match (form, &text.template) {
        (Form::Raw, _) => text.tokenizer.encode_text_prompt(prompt)?,
        (Form::Chat, Some(template)) => {
            let rendered = template.render(&[ChatMessage::text("user", prompt)], true)?;
            text.tokenizer.encode_chat_prompt(&rendered)?
        }
        (Form::Chat, None) => text
            .tokenizer
            .encode_text_prompt(&format!("Question: {prompt}\nAnswer:"))?,
    })
}

/// A paged KV cache for one sequence of up to `tokens` positions, stored
/// as `kv_dtype`, split into the model's KV groups as the engine's
/// `Plan::kv_cache` does (recurrent layers and layers reading another
/// layer's K/V keep none).
fn kv_cache(model: &dyn Model, kv_dtype: KvCacheDtype, tokens: usize) -> Result<KvCache> {
    let states = model.layer_states();
    let recurrent = RecurrentConfig {
        layers: states
            .iter()
            .enumerate()
            .filter(|(_, s)| matches!(s, LayerState::Recurrent { .. }))
            .map(|(l, _)| l)
            .collect(),
        ..RecurrentConfig::default()
    };
    let windows: Vec<Option<usize>> = states.iter().map(LayerState::window).collect();
    let mut groups = KvGroupConfig::from_layer_windows(&windows, None);
    let shared = LayerState::shared_layers(&states);
    let blocks = tokens.div_ceil(BLOCK_SIZE) + 2;
    for g in &mut groups {
        g.layers
            .retain(|l| !recurrent.layers.contains(l) && !shared.iter().any(|s| s.0 == *l));
        g.num_blocks = blocks;
    }
    if groups.len() > 1 {
        groups.retain(|g| !g.layers.is_empty());
    }
    let config = KvCacheConfig {
        layout: KvLayout {
            kv_dtype,
            ..model.kv_layout()
        },
        block_size: BLOCK_SIZE,
        num_blocks: blocks * groups.len(),
        backend: StorageBackend::Paged,
        prefix: None,
    };
    Ok(KvCache::with_shared_layers(
        config, groups, recurrent, &shared,
    )?)
}

/// Runs `tokens` as one row of `seq` (then trims window groups); the
/// logits of its last token.
fn step(model: &dyn Model, kv: &mut KvCache, seq: &KvSequence, tokens: &[u32]) -> Result<Vec<f32>> {
    let n = tokens.len();
    let reservation = kv.reserve_step(&[RowReserve {
        seq,
        real: n,
        padded: n,
    }])?;
    let logits = {
        let mut view = kv.step(&[(seq, n)])?;
        let rows = [StepRow::tokens(tokens, Some(n - 1))];
        model.forward(&rows, &mut view, AttentionPath::PerRow)?
    };
    kv.complete_step(reservation, true)?;
    kv.trim(seq)?;
    Ok(logits.to_vec_f32()?)
}

fn argmax(v: &[f32]) -> u32 {
    (0..v.len())
        .max_by(|&a, &b| v[a].total_cmp(&v[b]))
        .unwrap_or(0) as u32
}

/// Decodes `n` tokens greedily after `prompt` (EOS ignored): the tokens and,
/// when `keep_logits`, the logits each was picked from. With `until`, stops
/// after the first token that differs from `until`'s at its position.
fn greedy(
    model: &dyn Model,
    kv_dtype: KvCacheDtype,
    prompt: &[u32],
    n: usize,
    keep_logits: bool,
    until: Option<&[u32]>,
) -> Result<(Vec<u32>, Vec<Vec<f32>>)> {
    let mut kv = kv_cache(model, kv_dtype, prompt.len() + n)?;
    let seq = kv.new_sequence();
    let (mut tokens, mut kept) = (Vec::with_capacity(n), Vec::new());
    let mut logits = step(model, &mut kv, &seq, prompt)?;
    for i in 0..n {
        let token = argmax(&logits);
        tokens.push(token);
        if until.is_some_and(|u| u.get(i) != Some(&token)) {
            break;
        }
        let next = if i + 1 < n {
            Some(step(model, &mut kv, &seq, &[token])?)
        } else {
            None
        };
        if keep_logits {
            kept.push(logits);
        }
        match next {
            Some(next) => logits = next,
            None => break,
        }
    }
    Ok((tokens, kept))
}

/// Teacher-forces `forced` after `prompt`: per position, the logits.
/// Calls `each(position, logits)` instead of keeping them.
fn forced(
    model: &dyn Model,
    kv_dtype: KvCacheDtype,
    prompt: &[u32],
    forced: &[u32],
    mut each: impl FnMut(usize, &[f32]),
) -> Result<()> {
    let mut kv = kv_cache(model, kv_dtype, prompt.len() + forced.len())?;
    let seq = kv.new_sequence();
    let mut logits = step(model, &mut kv, &seq, prompt)?;
    for (i, &token) in forced.iter().enumerate() {
        each(i, &logits);
        if i + 1 < forced.len() {
            logits = step(model, &mut kv, &seq, &[token])?;
        }
    }
    Ok(())
}

/// One dtype's results over all prompts.
#[derive(Debug, Default)]
struct Tally {
    prompts: usize,
    /// Prompts whose greedy tokens all equal the float run's.
    exact: usize,
    /// Sum over prompts of the matching prefix length.
    prefix_sum: usize,
    /// Prompts where the greedy run's matching prefix differs from the first
    /// teacher-forced argmax disagreement (0 expected: the runs are
    /// identical up to there).
    inconsistent: usize,
    /// Teacher-forced positions, and those whose argmax agrees.
    positions: usize,
    argmax_agree: usize,
    /// Per position `max_i |logit - float logit|`: largest and sum.
    diff_max: f32,
    diff_sum: f64,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.tokens == 0 || args.prompts == 0 {
        bail!("--tokens and --prompts must be positive");
    }
    let started = Instant::now();
    let config = read_config(&args.model)
        .with_context(|| format!("reading the config of {}", args.model.display()))?;
    let vocab = config.vocab_size;
    let (text, tokenizer_source) = text_for(&args.model, vocab)?;
    let model_type = config.model_type.clone();
    let options = LoadOptions {
        dtype: Dtype::Float32,
        weight_mode: WeightMode::Dequantized,
        quantize: None,
    };
    let model = load_model(&args.model, config, options)?;
    let model = model.as_ref();
    let layout = model.kv_layout();
    let windows: Vec<Option<usize>> = model
        .layer_states()
        .iter()
        .map(LayerState::window)
        .collect();
    let groups = kv_cache(model, KvCacheDtype::Auto, 1)?.groups().count();
    eprintln!(
        "{} ({model_type}): {} layers, {} KV heads of {}, {groups} KV group(s), windows {:?}; \
         tokenizer from {}; loaded in {:.1}s",
        args.model.display(),
        layout.layers,
        layout.kv_heads,
        layout.head_dim,
        windows
            .iter()
            .flatten()
            .collect::<std::collections::BTreeSet<_>>(),
        tokenizer_source.display(),
        started.elapsed().as_secs_f64()
    );

    let prompts = PROMPTS
        .iter()
        .filter(|(name, _, _)| args.only.is_empty() || args.only.iter().any(|o| o == name))
        .take(args.prompts)
        .map(|&(name, form, prompt)| Ok((name, encode(&text, form, prompt)?)))
        .collect::<Result<Vec<_>>>()?;
    if prompts.is_empty() {
        let names: Vec<&str> = PROMPTS.iter().map(|p| p.0).collect();
        bail!(
            "no prompt selected (--only {:?}; names: {names:?})",
            args.only
        );
    }
    let mut tallies: Vec<Tally> = args.dtypes.iter().map(|_| Tally::default()).collect();
    for (name, prompt) in &prompts {
        let t0 = Instant::now();
        let (want, want_logits) =
            greedy(model, KvCacheDtype::Auto, prompt, args.tokens, true, None)?;
        if args.detail {
            eprintln!("{name}: prompt {prompt:?}, float tokens {want:?}");
        }
        let mut line = format!("{name:<20} {:>4} prompt tokens:", prompt.len());
        for (&kv_dtype, tally) in args.dtypes.iter().zip(&mut tallies) {
            let (got, _) = greedy(model, kv_dtype, prompt, args.tokens, false, Some(&want))?;
            let prefix = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
            let mut first_miss = None;
            let mut worst = 0f32;
            forced(model, kv_dtype, prompt, &want, |i, logits| {
                let float = &want_logits[i];
                let diff = logits
                    .iter()
                    .zip(float)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                worst = worst.max(diff);
                if args.detail {
                    let (got, top) = (argmax(logits), want[i]);
                    eprintln!("  {kv_dtype} position {i:>2}: max|dlogit| {diff:.3}, argmax {got} (float {top})");
                }
                tally.diff_max = tally.diff_max.max(diff);
                tally.diff_sum += f64::from(diff);
                tally.positions += 1;
                if argmax(logits) == want[i] {
                    tally.argmax_agree += 1;
                } else if first_miss.is_none() {
                    first_miss = Some(i);
                }
            })?;
            tally.prompts += 1;
            tally.exact += usize::from(prefix == want.len());
            tally.prefix_sum += prefix;
            if first_miss.unwrap_or(want.len()) != prefix {
                tally.inconsistent += 1;
            }
            line += &format!("  {kv_dtype} prefix {prefix:>3} max|dlogit| {worst:.3}");
        }
        eprintln!("{line}  ({:.1}s)", t0.elapsed().as_secs_f64());
    }

    let name = args.model.file_name().map_or_else(
        || args.model.display().to_string(),
        |n| n.to_string_lossy().into(),
    );
    // Bytes per token as served on a GPU (float16 compute: scales and biases
    // in float16), against float16 K/V.
    let bytes = |kv_dtype| {
        KvLayout {
            dtype: Dtype::Float16,
            kv_dtype,
            ..layout
        }
        .bytes_per_token()
    };
    let f16_bytes = bytes(KvCacheDtype::Float16);
    println!(
        "| model | KV dtype | bytes/token (f16 compute) | greedy = float ({} tokens) | mean matching prefix | max Δlogit | mean Δlogit | argmax agreement |",
        args.tokens
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut summary = Vec::new();
    for (&kv_dtype, t) in args.dtypes.iter().zip(&tallies) {
        let mean_prefix = t.prefix_sum as f64 / t.prompts as f64;
        let mean_diff = t.diff_sum / t.positions as f64;
        let agree = t.argmax_agree as f64 / t.positions as f64;
        let b = bytes(kv_dtype);
        println!(
            "| {name} | {kv_dtype} | {b} ({:.2}x tokens of float16) | {}/{} | {mean_prefix:.1} | {:.3} | {mean_diff:.4} | {:.1}% |",
            f16_bytes as f64 / b as f64,
            t.exact,
            t.prompts,
            t.diff_max,
            100.0 * agree
        );
        if t.inconsistent > 0 {
            eprintln!(
                "warning: {kv_dtype}: {} prompt(s) whose greedy prefix differs from the first \
                 teacher-forced argmax miss",
                t.inconsistent
            );
        }
        summary.push(serde_json::json!({
            "kv_dtype": kv_dtype.name(),
            "bytes_per_token_f16_compute": b,
            "prompts": t.prompts,
            "greedy_exact": t.exact,
            "mean_matching_prefix": mean_prefix,
            "positions": t.positions,
            "max_abs_logit_diff": t.diff_max,
            "mean_max_abs_logit_diff": mean_diff,
            "argmax_agreement": agree,
            "greedy_vs_forced_inconsistent": t.inconsistent,
        }));
    }
    let json = serde_json::json!({
        "model": name,
        "model_type": model_type,
        "compute_dtype": "float32",
        "block_size": BLOCK_SIZE,
        "tokens": args.tokens,
        "prompts": prompts.len(),
        "prompt_tokens": prompts.iter().map(|(_, p)| p.len()).collect::<Vec<_>>(),
        "kv_groups": groups,
        "seconds": started.elapsed().as_secs_f64(),
        "results": summary,
    });
    println!("{json}");
    Ok(())
}
