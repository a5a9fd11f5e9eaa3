//! Rotary position embedding (Su et al. 2021, "RoFormer"), with the
//! frequency scalings of `rope_scaling` (linear; Llama 3.1's, after
//! Meta's reference `apply_scaling` and mlx_lm's `Llama3RoPE`).

use crate::config::{ModelConfig, RopeScaling};
use crate::ModelError;
use mlxcel_mlx::Array;

/// RoPE over the first `dims` features of each head.
#[derive(Debug, Clone)]
pub struct Rope {
    dims: i32,
    traditional: bool,
    base: f32,
    /// Position multiplier (1/factor for linear scaling).
    scale: f32,
    /// Explicit inverse frequencies `[dims / 2]` (Llama 3 scaling).
    freqs: Option<Array>,
}

/// What a RoPE is: rotated features per head, base, layout and scaling.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeSpec {
    /// Rotated features of each head (the head size, or less for partial
    /// rotary).
    pub dims: usize,
    /// `rope_theta`.
    pub base: f32,
    /// Rotate interleaved pairs (GPT-J layout) instead of halves.
    pub traditional: bool,
    pub scaling: RopeScaling,
}

impl RopeSpec {
    /// The whole head rotated, as `config` says.
    pub fn from_config(config: &ModelConfig) -> Self {
        RopeSpec {
            dims: config.head_dim,
            base: config.rope_theta,
            traditional: config.rope_traditional,
            scaling: config.rope_scaling.clone(),
        }
    }
}

impl Rope {
    /// The RoPE `spec` describes.
    pub fn new(spec: &RopeSpec) -> Result<Self, ModelError> {
        let dims = spec.dims as i32;
        let mut rope = Rope {
            dims,
            traditional: spec.traditional,
            base: spec.base,
            scale: 1.0,
            freqs: None,
        };
        match &spec.scaling {
            RopeScaling::Divisors(divisors) => {
                let half = (dims / 2) as usize;
                if divisors.len() != half {
                    return Err(ModelError::Config(format!(
                        "{} RoPE divisors for {half} rotated frequencies",
                        divisors.len()
                    )));
                }
                // MLX's `freqs` are periods: base^(2i/dims), divisor times.
                let freqs: Vec<f32> = divisors
                    .iter()
                    .enumerate()
                    .map(|(i, d)| spec.base.powf((2 * i) as f32 / dims as f32) * d)
                    .collect();
                rope.freqs = Some(Array::from_f32(&freqs, &[half as i32])?);
            }
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => rope.scale = 1.0 / *factor,
            &RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old_ctx,
            } => {
                let low_wavelen = old_ctx / low_freq_factor;
                let high_wavelen = old_ctx / high_freq_factor;
                let half = (dims / 2) as usize;
                let freqs: Vec<f32> = (0..half)
                    .map(|i| {
                        // Wavelength-dependent period, as a multiple of the base period.
                        let f = spec.base.powf((2 * i) as f32 / dims as f32);
                        let wavelen = 2.0 * std::f32::consts::PI * f;
                        if wavelen > low_wavelen {
                            f * factor
                        } else if wavelen < high_wavelen {
                            f
                        } else {
                            let smooth = (old_ctx / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            f / ((1.0 - smooth) / factor + smooth)
                        }
                    })
                    .collect();
                rope.freqs = Some(Array::from_f32(&freqs, &[half as i32])?);
            }
        }
        Ok(rope)
    }

    /// Rotates `x` `[batch, heads, seq, head_dim]`; token `i` is at absolute
    /// position `offset + i`.
    pub fn apply(&self, x: &Array, offset: usize) -> Result<Array, ModelError> {
        let offset = i32::try_from(offset)
            .map_err(|_| ModelError::Unsupported(format!("position {offset} too large")))?;
        Ok(match &self.freqs {
            None => x.rope(self.dims, self.traditional, self.base, self.scale, offset)?,
            Some(f) => x.rope_with_freqs(self.dims, self.traditional, self.scale, offset, f)?,
        })
    }

    /// Rotates `x` `[tokens, heads, 1, head_dim]`, token `i` at absolute
    /// position `positions[i]` (int32 `[tokens]`): the packed layout of a
    /// step whose rows sit at different positions.
    pub fn apply_at(&self, x: &Array, positions: &Array) -> Result<Array, ModelError> {
        Ok(match &self.freqs {
            None => x.rope_at(
                self.dims,
                self.traditional,
                self.base,
                self.scale,
                positions,
            )?,
            Some(f) => {
                x.rope_with_freqs_at(self.dims, self.traditional, self.scale, positions, f)?
            }
        })
    }
}
