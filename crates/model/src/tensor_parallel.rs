//! Tensor parallelism (Megatron-LM: Shoeybi et al. 2019, "Megatron-LM:
//! Training Multi-Billion Parameter Language Models Using Model
//! Parallelism", section 3): each of `size` processes holds a slice of
//! every layer's attention heads and MLP columns.
//!
//! - q/k/v and the MLP's gate/up are *all-to-sharded*: each rank keeps
//!   `1/size` of their output rows (its heads, its intermediate columns),
//!   so the full hidden state goes in and the rank's slice comes out.
//! - o and down are *sharded-to-all*: each rank keeps the matching
//!   `1/size` of their input columns and computes a partial sum of the
//!   full output; one `all_sum` per projection adds the partial sums up
//!   (their biases are added once, after it).
//!
//! Embeddings, norms and the LM head are replicated. Every rank's KV cache
//! holds its own K/V heads only. See docs/distributed.md.

use crate::{ModelConfig, ModelError};

/// This process's place in a tensor-parallel group: rank `rank` of `size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorParallel {
    /// `0..size`; rank 0 serves HTTP and samples.
    pub rank: usize,
    /// Processes the model is split over.
    pub size: usize,
}

impl TensorParallel {
    /// Rank `rank` of `size`.
    ///
    /// # Errors
    /// [`ModelError::Config`] when `size` is 0 or `rank >= size`.
    pub fn new(rank: usize, size: usize) -> Result<Self, ModelError> {
        if size == 0 || rank >= size {
            return Err(ModelError::Config(format!(
                "tensor parallelism: rank {rank} of {size}"
            )));
        }
        Ok(TensorParallel { rank, size })
    }

    /// This rank's part `[start, start + len)` of `n` items split evenly.
    ///
    /// # Errors
    /// `n` not a multiple of the world size.
    pub fn part(&self, n: usize, what: &str) -> Result<(usize, usize), ModelError> {
        if !n.is_multiple_of(self.size) {
            return Err(ModelError::Config(format!(
                "tensor parallelism over {} ranks needs {what} ({n}) to divide by {}",
                self.size, self.size
            )));
        }
        let len = n / self.size;
        Ok((self.rank * len, len))
    }

    /// Checks that `config` splits over the group: its attention heads,
    /// K/V heads and MLP intermediate size divide by the world size, and
    /// quantized sharded-to-all projections split at quantization-group
    /// boundaries.
    ///
    /// # Errors
    /// [`ModelError::Config`] naming the first size that does not divide.
    pub fn check(&self, config: &ModelConfig) -> Result<(), ModelError> {
        self.part(config.num_attention_heads, "num_attention_heads")?;
        self.part(config.num_key_value_heads, "num_key_value_heads")?;
        self.part(config.intermediate_size, "intermediate_size")?;
        // The largest group of any module (a GGUF file's quantization is
        // recorded per module).
        let q = &config.quantization;
        let largest = q
            .default
            .iter()
            .chain(q.overrides.values().flatten())
            .map(|s| s.group_size)
            .max();
        if let Some(group) = largest {
            let group = group.max(1) as usize;
            for (what, n) in [
                (
                    "the attention output's input size per rank",
                    config.num_attention_heads * config.head_dim / self.size,
                ),
                (
                    "the MLP down projection's input size per rank",
                    config.intermediate_size / self.size,
                ),
            ] {
                if !n.is_multiple_of(group) {
                    return Err(ModelError::Config(format!(
                        "tensor parallelism over {} ranks: {what} ({n}) is not a multiple of \
                         the quantization group size ({group})",
                        self.size
                    )));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(heads: usize, kv: usize, inter: usize, quant: Option<i32>) -> ModelConfig {
        let q = quant.map_or(String::new(), |g| {
            format!(r#","quantization":{{"group_size":{g},"bits":4}}"#)
        });
        ModelConfig::from_json_str(&format!(
            r#"{{"model_type":"llama","hidden_size":{},"num_hidden_layers":1,
                "intermediate_size":{inter},"num_attention_heads":{heads},
                "num_key_value_heads":{kv},"rms_norm_eps":1e-5,"vocab_size":16{q}}}"#,
            heads * 64
        ))
        .unwrap()
    }

    #[test]
    fn parts_split_evenly_in_rank_order() {
        let tp = TensorParallel::new(2, 3).unwrap();
        assert_eq!(tp.part(9, "heads").unwrap(), (6, 3));
        assert!(tp.part(8, "heads").is_err());
        assert!(TensorParallel::new(3, 3).is_err());
        assert!(TensorParallel::new(0, 0).is_err());
    }

    #[test]
    fn a_model_whose_heads_do_not_divide_is_refused_by_name() {
        let tp = TensorParallel::new(0, 2).unwrap();
        assert!(tp.check(&config(4, 2, 128, None)).is_ok());
        // SmolLM2-135M: 9 heads, 3 K/V heads.
        let e = tp.check(&config(9, 3, 1536, None)).unwrap_err();
        assert!(e.to_string().contains("num_attention_heads (9)"), "{e}");
        let e = tp.check(&config(4, 1, 128, None)).unwrap_err();
        assert!(e.to_string().contains("num_key_value_heads (1)"), "{e}");
        let e = tp.check(&config(4, 2, 127, None)).unwrap_err();
        assert!(e.to_string().contains("intermediate_size (127)"), "{e}");
        let three = TensorParallel::new(1, 3).unwrap();
        assert!(three.check(&config(9, 3, 1536, Some(32))).is_ok());
        // 4 heads * 64 / 2 = 128 per rank: not a multiple of 256.
        let e = tp.check(&config(4, 2, 512, Some(256))).unwrap_err();
        assert!(e.to_string().contains("quantization group size"), "{e}");
    }
}
