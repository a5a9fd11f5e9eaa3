//! The Llama family: Llama 2/3 (Touvron et al. 2023), SmolLM, Mistral (with
//! its sliding window, kept by the engine's KV window and the attention
//! mask), and Qwen2 (same wiring plus q/k/v biases).
//!
//! Reference implementations: Meta's `llama/model.py`, mlx_lm's
//! `mlx_lm/models/llama.py` and `qwen2.py`. Weight paths mirror the
//! checkpoint's names (`model.layers.{i}.self_attn.q_proj`, ...).

use mlxcel_kv::AttentionKv;
use mlxcel_mlx::{Array, Dtype};
use mlxcel_model::attention::Attention;
use mlxcel_model::layers::{Embedding, Linear, LoadContext, Mlp, RmsNorm};
use mlxcel_model::profile::{self, mark};
use mlxcel_model::{
    AttentionPath, LoadOptions, Model, ModelConfig, ModelError, Step, StepRow, Weights,
};

/// `model_type`s this family serves.
pub const MODEL_TYPES: &[&str] = &["llama", "mistral", "qwen2"];

/// One transformer layer: pre-norm attention and pre-norm MLP, each residual.
struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

impl DecoderLayer {
    fn load(ctx: &mut LoadContext<'_>, path: &str, c: &ModelConfig) -> Result<Self, ModelError> {
        Ok(DecoderLayer {
            input_layernorm: RmsNorm::load(
                ctx,
                &format!("{path}.input_layernorm"),
                c.rms_norm_eps,
            )?,
            self_attn: Attention::load(ctx, &format!("{path}.self_attn"), c)?,
            post_attention_layernorm: RmsNorm::load(
                ctx,
                &format!("{path}.post_attention_layernorm"),
                c.rms_norm_eps,
            )?,
            mlp: Mlp::load(ctx, &format!("{path}.mlp"), c.mlp_bias)?,
        })
    }

    fn forward(
        &self,
        x: &Array,
        index: usize,
        kv: &mut dyn AttentionKv,
        step: &Step,
    ) -> Result<Array, ModelError> {
        let h = self.input_layernorm.forward(x)?;
        mark("norm", &[&h])?;
        let h = x.add(&self.self_attn.forward(&h, index, kv, step)?)?;
        let n = self.post_attention_layernorm.forward(&h)?;
        mark("norm", &[&n])?;
        let m = self.mlp.forward(&n)?;
        let out = h.add(&m)?;
        mark("mlp", &[&out])?;
        Ok(out)
    }

    fn arrays(&self) -> Vec<&Array> {
        let mut v = vec![
            &self.input_layernorm.weight,
            &self.post_attention_layernorm.weight,
        ];
        v.extend(self.self_attn.arrays());
        for l in [&self.mlp.gate_proj, &self.mlp.up_proj, &self.mlp.down_proj] {
            v.extend(l.arrays());
        }
        v
    }
}

/// A Llama-family causal LM.
pub struct LlamaModel {
    config: ModelConfig,
    dtype: Dtype,
    embed_tokens: Embedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    /// `None` when tied to `embed_tokens`.
    lm_head: Option<Linear>,
}

impl LlamaModel {
    /// Loads the model from an opened checkpoint and evaluates its weights.
    ///
    /// # Errors
    /// Missing tensors, shape errors, unsupported config features.
    pub fn load(
        config: ModelConfig,
        weights: &mut Weights,
        options: LoadOptions,
    ) -> Result<Self, ModelError> {
        if !MODEL_TYPES.contains(&config.model_type.as_str()) {
            return Err(ModelError::Unsupported(format!(
                "model_type {} in the llama family",
                config.model_type
            )));
        }
        let mut ctx = LoadContext {
            weights,
            quantization: &config.quantization,
            dtype: options.dtype,
            mode: options.weight_mode,
        };
        let embed_tokens = Embedding::load(&mut ctx, "model.embed_tokens")?;
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let layer = DecoderLayer::load(&mut ctx, &format!("model.layers.{i}"), &config)?;
            // Materialize layer by layer so load shows progress and peaks low.
            mlxcel_mlx::eval(&layer.arrays())?;
            tracing::debug!(layer = i, of = config.num_hidden_layers, "layer loaded");
            layers.push(layer);
        }
        let norm = RmsNorm::load(&mut ctx, "model.norm", config.rms_norm_eps)?;
        let lm_head = if config.tie_word_embeddings {
            None
        } else {
            Some(Linear::load(&mut ctx, "lm_head", false)?)
        };
        let mut rest: Vec<&Array> = embed_tokens.table.arrays();
        rest.push(&norm.weight);
        if let Some(h) = &lm_head {
            rest.extend(h.arrays());
        }
        mlxcel_mlx::eval(&rest)?;
        let unused: Vec<String> = weights
            .remaining()
            .into_iter()
            .filter(|n| !n.contains("rotary_emb.inv_freq"))
            .collect();
        if !unused.is_empty() {
            tracing::warn!(count = unused.len(), first = %unused[0], "unused tensors in checkpoint");
        }
        Ok(LlamaModel {
            dtype: options.dtype,
            config,
            embed_tokens,
            layers,
            norm,
            lm_head,
        })
    }
}

impl Model for LlamaModel {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn build_step(
        &self,
        rows: &[StepRow<'_>],
        ids: Option<&Array>,
        kv: &mut dyn AttentionKv,
        path: AttentionPath,
    ) -> Result<Array, ModelError> {
        let built = std::time::Instant::now();
        profile::restart_clock();
        let step = Step::new(rows, kv, path)?;
        let ids = match ids {
            Some(ids) => ids.reshape(&[1, step.tokens as i32])?,
            None => {
                let tokens: Vec<u32> = rows.iter().flat_map(|r| r.tokens.iter().copied()).collect();
                Array::from_u32(&tokens, &[1, step.tokens as i32])?
            }
        };
        let mut h = self.embed_tokens.forward(&ids)?;
        mark("embed", &[&h, &step.positions])?;
        for (i, layer) in self.layers.iter().enumerate() {
            h = layer.forward(&h, i, kv, &step)?;
        }
        // Only the wanted positions go through the final norm and the head.
        let wanted = step.logit_indices(rows);
        if wanted.is_empty() {
            // Nothing samples (a prefill chunk before the last): the graph
            // is the cache's writes alone.
            return Ok(mlxcel_mlx::zeros(
                &[0, self.config.vocab_size as i32],
                Dtype::Float32,
            )?);
        }
        let idx = Array::from_i32(&wanted, &[wanted.len() as i32])?;
        let last = self.norm.forward(&h.take(&idx, 1)?)?;
        let logits = match &self.lm_head {
            Some(head) => head.forward(&last)?,
            None => self.embed_tokens.as_linear(&last)?,
        };
        let logits = logits
            .reshape(&[wanted.len() as i32, -1])?
            .astype(Dtype::Float32)?;
        mark("head", &[&logits])?;
        if profile::mode() == profile::ProfileMode::Steps {
            profile::record("model.build", built);
        }
        Ok(logits)
    }
}
