//! Multi-head attention with grouped-query K/V (Ainslie et al. 2023), the one
//! attention layer that talks to the KV view. The mask is built here, from
//! the number of live keys the view returns (ARCHITECTURE.md invariant 3).

use crate::kv_view::DenseSequenceCache;
use crate::layers::{Linear, LoadContext};
use crate::rope::Rope;
use crate::{ModelConfig, ModelError};
use mlxcel_mlx::{scaled_dot_product_attention, Array, AttentionMask};

/// Self-attention of one transformer layer.
#[derive(Debug, Clone)]
pub struct Attention {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    rope: Rope,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    scale: f32,
}

impl Attention {
    /// Loads `{path}.{q,k,v,o}_proj`.
    pub fn load(
        ctx: &mut LoadContext<'_>,
        path: &str,
        config: &ModelConfig,
    ) -> Result<Self, ModelError> {
        Ok(Attention {
            q_proj: Linear::load(ctx, &format!("{path}.q_proj"), config.qkv_bias)?,
            k_proj: Linear::load(ctx, &format!("{path}.k_proj"), config.qkv_bias)?,
            v_proj: Linear::load(ctx, &format!("{path}.v_proj"), config.qkv_bias)?,
            o_proj: Linear::load(ctx, &format!("{path}.o_proj"), config.o_bias)?,
            rope: Rope::new(config)?,
            heads: config.num_attention_heads as i32,
            kv_heads: config.num_key_value_heads as i32,
            head_dim: config.head_dim as i32,
            scale: (config.head_dim as f32).powf(-0.5),
        })
    }

    /// `x` `[1, seq, hidden]` -> `[1, seq, hidden]`. The `seq` new tokens are
    /// at absolute positions `cache.next_position()..`; their K/V are written
    /// to layer `layer` of `cache`.
    pub fn forward(
        &self,
        x: &Array,
        layer: usize,
        cache: &mut DenseSequenceCache,
    ) -> Result<Array, ModelError> {
        let shape = x.shape();
        let (b, l) = (shape[0], shape[1]);
        let split = |y: Array, heads: i32| -> Result<Array, ModelError> {
            Ok(y.reshape(&[b, l, heads, self.head_dim])?
                .transpose(&[0, 2, 1, 3])?)
        };
        let q = split(self.q_proj.forward(x)?, self.heads)?;
        let k = split(self.k_proj.forward(x)?, self.kv_heads)?;
        let v = split(self.v_proj.forward(x)?, self.kv_heads)?;
        let position = cache.next_position();
        let q = self.rope.apply(&q, position)?;
        let k = self.rope.apply(&k, position)?;
        let (keys, values) = cache.append_and_fetch(layer, &k, &v)?;
        let mask = causal_mask(l, keys.dim(2)?)?;
        let o = scaled_dot_product_attention(&q, &keys, &values, self.scale, &mask)?;
        let o = o
            .transpose(&[0, 2, 1, 3])?
            .reshape(&[b, l, self.heads * self.head_dim])?;
        self.o_proj.forward(&o)
    }

    /// Every tensor of the layer.
    pub fn arrays(&self) -> Vec<&Array> {
        [&self.q_proj, &self.k_proj, &self.v_proj, &self.o_proj]
            .into_iter()
            .flat_map(Linear::arrays)
            .collect()
    }
}

/// The mask for `q_len` new queries over `k_len` live keys, the new queries
/// being the last `q_len` of them: a single query sees every live key; more
/// than one see keys up to their own position (lower-right causal).
///
/// # Errors
/// `q_len > k_len` (the view must return the new keys too).
pub fn causal_mask(q_len: i32, k_len: i32) -> Result<AttentionMask, ModelError> {
    if q_len > k_len || q_len < 1 {
        return Err(ModelError::Cache(format!(
            "{q_len} queries over {k_len} live keys"
        )));
    }
    Ok(if q_len == 1 {
        AttentionMask::None
    } else {
        AttentionMask::Causal
    })
}
