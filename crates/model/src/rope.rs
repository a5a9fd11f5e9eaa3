//! Rotary position embedding (Su et al. 2021, "RoFormer"), with the
//! frequency scalings of `rope_scaling` (linear; Llama 3.1's, after
//! Meta's reference `apply_scaling` and mlx_lm's `Llama3RoPE`; YaRN, Peng
//! et al. 2023, after mlx_lm's `YarnRoPE`).

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
    /// Explicit periods `[dims / 2]` (Llama 3, YaRN, GGUF divisors).
    freqs: Option<Array>,
    /// YaRN's attention factor: the rotated features are multiplied by it
    /// before the rotation (1: no multiply).
    input_scale: f32,
}

/// What a RoPE is: rotated features per head, base, layout and scaling.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeSpec {
    /// Rotated features of each head (the head size, or less for partial
    /// rotary; 0 for none: no position embedding, Granite 4's `nope`).
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
            input_scale: 1.0,
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
            &RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: old_ctx,
                beta_fast,
                beta_slow,
                mscale,
                mscale_all_dim,
            } => {
                let (freqs, input_scale) = yarn(
                    dims as usize,
                    spec.base,
                    factor,
                    old_ctx,
                    (beta_fast, beta_slow),
                    (mscale, mscale_all_dim),
                );
                rope.freqs = Some(Array::from_f32(&freqs, &[freqs.len() as i32])?);
                rope.input_scale = input_scale;
            }
        }
        Ok(rope)
    }

    /// YaRN's attention factor (1 without YaRN), which this RoPE then no
    /// longer applies: a caller that rotates whole heads of both queries
    /// and keys applies its square to the attention scores instead (one
    /// scalar instead of two multiplies a layer).
    pub fn take_input_scale(&mut self) -> f32 {
        std::mem::replace(&mut self.input_scale, 1.0)
    }

    /// `x` with its rotated features multiplied by YaRN's attention factor
    /// (unchanged without one).
    fn scale_input(&self, x: &Array) -> Result<Array, ModelError> {
        if self.input_scale == 1.0 {
            return Ok(x.clone());
        }
        let factor = Array::scalar(self.input_scale)?.astype(x.dtype())?;
        let shape = x.shape();
        let last = *shape.last().unwrap_or(&0);
        if last == self.dims {
            return Ok(x.multiply(&factor)?);
        }
        // Partial rotary: only the first `dims` features are scaled.
        let begin = vec![0; shape.len()];
        let mut mid = shape.clone();
        if let Some(m) = mid.last_mut() {
            *m = self.dims;
        }
        let mut from = begin.clone();
        if let Some(f) = from.last_mut() {
            *f = self.dims;
        }
        let rotated = x.slice(&begin, &mid)?.multiply(&factor)?;
        let rest = x.slice(&from, &shape)?;
        Ok(mlxcel_mlx::concatenate(
            &[&rotated, &rest],
            shape.len() as i32 - 1,
        )?)
    }

    /// Rotates `x` `[batch, heads, seq, head_dim]`; token `i` is at absolute
    /// position `offset + i`.
    pub fn apply(&self, x: &Array, offset: usize) -> Result<Array, ModelError> {
        if self.dims == 0 {
            return Ok(x.clone());
        }
        let x = &self.scale_input(x)?;
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
        if self.dims == 0 {
            return Ok(x.clone());
        }
        let x = &self.scale_input(x)?;
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

/// YaRN's periods `[dims / 2]` (as multiples of 1, MLX's `freqs`) and its
/// attention factor, for RoPE base `base` stretched by `factor` from a
/// context of `old_ctx` tokens; `betas` are `(beta_fast, beta_slow)` in
/// rotations, `mscales` `(mscale, mscale_all_dim)`. Peng et al. 2023; the
/// correction range is floored and ceiled as mlx_lm's `YarnRoPE` does,
/// also for a config with `"truncate": false` (gpt-oss's), which Hugging
/// Face's implementation reads as no rounding: the reference here is
/// mlx_lm, and the two differ slightly on those configs.
fn yarn(
    dims: usize,
    base: f32,
    factor: f32,
    old_ctx: f32,
    betas: (f32, f32),
    mscales: (f32, f32),
) -> (Vec<f32>, f32) {
    let correction_dim = |rotations: f32| {
        dims as f32 * (old_ctx / (rotations * 2.0 * std::f32::consts::PI)).ln() / (2.0 * base.ln())
    };
    let low = correction_dim(betas.0).floor().max(0.0);
    let high = correction_dim(betas.1).ceil().min(dims as f32 - 1.0);
    let high = if low == high { high + 0.001 } else { high };
    let attention = |s: f32, m: f32| {
        if s <= 1.0 {
            1.0
        } else {
            0.1 * m * s.ln() + 1.0
        }
    };
    let input_scale = attention(factor, mscales.0) / attention(factor, mscales.1);
    let freqs = (0..dims / 2)
        .map(|i| {
            let extra = base.powf((2 * i) as f32 / dims as f32);
            let inter = factor * extra;
            // 1 keeps the period (fast rotations), 0 stretches it.
            let keep = 1.0 - ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
            inter * extra / (inter * keep + extra * (1.0 - keep))
        })
        .collect();
    (freqs, input_scale)
}

#[cfg(test)]
mod yarn_tests {
    #[test]
    fn yarn_keeps_fast_periods_and_stretches_slow_ones() {
        // gpt-oss: head 64, base 150000, factor 32 from 4096 tokens.
        let (freqs, scale) = super::yarn(64, 150_000.0, 32.0, 4096.0, (32.0, 1.0), (1.0, 0.0));
        assert_eq!(freqs.len(), 32);
        let base = |i: usize| 150_000f32.powf((2 * i) as f32 / 64.0);
        // Below the beta_fast correction dimension (8.09 -> 8): unchanged.
        for (i, f) in freqs.iter().enumerate().take(8) {
            assert!((f / base(i) - 1.0).abs() < 1e-6, "{i}");
        }
        // Above the beta_slow one (17.4 -> 18): stretched by the factor.
        for (i, f) in freqs.iter().enumerate().skip(18) {
            assert!((f / base(i) - 32.0).abs() < 1e-3, "{i}");
        }
        assert!(freqs[12] / base(12) > 1.0 && freqs[12] / base(12) < 32.0);
        // 0.1 ln 32 + 1.
        assert!((scale - 1.346_574).abs() < 1e-5, "{scale}");
    }
}
