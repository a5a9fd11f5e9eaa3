//! The sparse mixture-of-experts feed-forward layer (Shazeer et al. 2017;
//! top-k routing as in Switch / Mixtral, Jiang et al. 2024): a router picks
//! `top_k` of `experts` gated MLPs per token, their outputs are summed
//! weighted by the router's scores, and an optional shared expert (Qwen2-MoE)
//! runs for every token.
//!
//! The experts of a layer are one stacked matrix per projection,
//! `[experts, out, in]`, multiplied through MLX's gathered matmuls
//! (`gather_mm`, or `gather_qmm` for weights kept quantized): one product
//! per (token, chosen expert), no per-expert loop on the host. When a step
//! routes many tokens (64 or more token-expert pairs) they are sorted by
//! expert first, so each expert's matrix is read in one run, and put back
//! after (on a CPU each product is the same either way; a GPU's sorted
//! and unsorted kernels may round differently). A step of many tokens
//! (prefill) multiplies quantized experts dequantized, through
//! `gather_mm` (`SparseMoe::dequantize_experts`). The reference for the
//! routing variants and the sort is mlx_lm's `models/switch_layers.py`,
//! `qwen3_moe.py`, `qwen2_moe.py` and `mixtral.py`.
//!
//! Checkpoints store experts stacked (`{path}.switch_mlp.gate_proj.weight`,
//! what mlx_lm writes; gpt-oss's `{path}.experts.gate_proj.weight`) or one
//! tensor per expert (`{path}.experts.{e}.gate_proj.weight`, Hugging Face's
//! layout; Mixtral's `w1`/`w3`/`w2`): both load, the second stacked at
//! load.
//!
//! gpt-oss's experts differ in three ways, each a field of [`MoeSpec`]:
//! the router is `{path}.router` with a bias, every expert projection has
//! a bias, and the gate and up projections combine through a clamped
//! SwiGLU ([`ExpertGlu::ClampedSwiglu`]; mlx_lm's `models/gpt_oss.py` and
//! `activations.py`).

use crate::layers::{Activation, Linear, LoadContext, Mlp, WeightMode};
use crate::{config::QuantSpec, ModelError};
use mlxcel_mlx::{Array, Dtype};

/// How router logits become the chosen experts and their weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routing {
    /// Softmax over all experts, keep the `top_k` largest probabilities;
    /// with `normalize`, divide them by their sum (Qwen3-MoE's
    /// `norm_topk_prob`; Qwen2-MoE without).
    SoftmaxTopK { normalize: bool },
    /// Keep the `top_k` largest logits, softmax over those alone
    /// (Mixtral).
    TopKSoftmax,
}

/// The checkpoint names of one expert's gated MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertNames {
    /// The gate projection (`gate_proj`; Mixtral's per-expert `w1`).
    pub gate: &'static str,
    /// The up projection (`up_proj`; `w3`).
    pub up: &'static str,
    /// The down projection (`down_proj`; `w2`).
    pub down: &'static str,
}

impl ExpertNames {
    /// `gate_proj`, `up_proj`, `down_proj`.
    pub const PROJ: ExpertNames = ExpertNames {
        gate: "gate_proj",
        up: "up_proj",
        down: "down_proj",
    };
    /// Mixtral's per-expert `w1` (gate), `w3` (up), `w2` (down).
    pub const MIXTRAL: ExpertNames = ExpertNames {
        gate: "w1",
        up: "w3",
        down: "w2",
    };
}

/// Where a block's router and stacked experts are, and which have biases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertLayout {
    /// The router's name under the block (`gate`; gpt-oss's `router`).
    pub router: &'static str,
    /// The router has a bias (gpt-oss).
    pub router_bias: bool,
    /// The stacked experts' name under the block (`switch_mlp`, what
    /// mlx_lm writes; gpt-oss's `experts`).
    pub stacked: &'static str,
    /// Every expert projection has a bias, `[experts, out]` (gpt-oss).
    pub bias: bool,
}

impl Default for ExpertLayout {
    /// The router `gate` and experts under `switch_mlp`, no biases.
    fn default() -> Self {
        ExpertLayout {
            router: "gate",
            router_bias: false,
            stacked: "switch_mlp",
            bias: false,
        }
    }
}

/// How an expert combines its gate and up projections.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum ExpertGlu {
    /// `act(gate) · up`, `act` the spec's [`MoeSpec::activation`].
    #[default]
    Gated,
    /// gpt-oss's clamped SwiGLU: with `g = min(gate, limit)` and `u =
    /// clip(up, -limit, limit)`, `(u + 1) · g · σ(alpha · g)` (OpenAI's
    /// gpt-oss reference; mlx_lm's `swiglu_oai`, alpha 1.702, limit 7).
    ClampedSwiglu { alpha: f32, limit: f32 },
}

/// What a family's sparse layer is.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeSpec {
    /// Experts per layer (`num_experts`, Mixtral's `num_local_experts`).
    pub experts: usize,
    /// Experts each token is routed to (`num_experts_per_tok`).
    pub top_k: usize,
    /// The hidden size of each expert's MLP (`moe_intermediate_size`;
    /// Mixtral's `intermediate_size`).
    pub expert_hidden: usize,
    pub routing: Routing,
    /// The names of a per-expert checkpoint's projections (stacked
    /// checkpoints always use `gate_proj`/`up_proj`/`down_proj` under
    /// `switch_mlp`).
    pub per_expert_names: ExpertNames,
    /// The hidden size of the shared expert (`shared_expert` with a
    /// sigmoid `shared_expert_gate`, Qwen2-MoE), `None` without one.
    pub shared_expert: Option<usize>,
    /// The experts' gate activation.
    pub activation: Activation,
    /// How gate and up combine.
    pub glu: ExpertGlu,
    /// The names of the router and the stacked experts.
    pub layout: ExpertLayout,
}

impl MoeSpec {
    /// Checks the counts before any weight is read.
    ///
    /// # Errors
    /// [`ModelError::Config`] for no experts, `top_k` of 0 or more than the
    /// experts.
    pub fn check(&self) -> Result<(), ModelError> {
        if self.experts == 0 || self.top_k == 0 || self.top_k > self.experts {
            return Err(ModelError::Config(format!(
                "num_experts_per_tok {} with {} experts (want 1 to the expert count)",
                self.top_k, self.experts
            )));
        }
        Ok(())
    }
}

/// Stacked expert matrices of one projection, `[experts, out, in]`.
#[derive(Debug, Clone)]
enum ExpertMatrix {
    /// Dense, `[experts, out, in]` as in the checkpoint (multiplied through
    /// a transposed view, as a dense [`Linear`] is).
    Dense(Array),
    /// Affine-quantized: `weight` `[experts, out, in · bits / 32]` uint32,
    /// `scales`/`biases` `[experts, out, in / group_size]`.
    Quantized {
        weight: Array,
        scales: Array,
        biases: Array,
        spec: QuantSpec,
    },
}

/// One projection of every expert (mlx_lm's `SwitchLinear`, without its
/// bias: [`SparseMoe`] adds the three projections' biases from one table).
#[derive(Debug, Clone)]
pub struct SwitchLinear {
    matrix: ExpertMatrix,
    /// The output rows of each expert's matrix.
    out: usize,
    /// The input width of each expert's matrix.
    input: usize,
}

impl SwitchLinear {
    /// Loads `{path}.{stacked}.{name}` (stacked; `stacked` is
    /// [`ExpertLayout::stacked`]) or, when that is absent,
    /// `{path}.experts.{e}.{per_expert}` for every expert, stacking them;
    /// with `bias`, the `.bias` beside each weight too, returned beside
    /// the projection (`[experts, out]`, compute dtype).
    ///
    /// # Errors
    /// Missing tensors; an expert count other than `experts`; a
    /// quantized tensor without quantization parameters; a bias that is not
    /// `[experts, out]`.
    fn load(
        ctx: &mut LoadContext<'_>,
        path: &str,
        (name, per_expert): (&str, &str),
        layout: &ExpertLayout,
        experts: usize,
    ) -> Result<(Self, Option<Array>), ModelError> {
        let stacked = format!("{path}.{}.{name}", layout.stacked);
        let (module, parts) = if ctx.weights.contains(&format!("{stacked}.weight")) {
            let take =
                |ctx: &mut LoadContext<'_>, suffix: &str| -> Result<Option<Array>, ModelError> {
                    let key = format!("{stacked}.{suffix}");
                    if suffix != "weight" && !ctx.weights.contains(&key) {
                        return Ok(None);
                    }
                    Ok(Some(ctx.weights.take(&key)?))
                };
            let parts = [
                take(ctx, "weight")?,
                take(ctx, "scales")?,
                take(ctx, "biases")?,
                if layout.bias {
                    Some(ctx.weights.take(&format!("{stacked}.bias"))?)
                } else {
                    None
                },
            ];
            (stacked, parts)
        } else {
            let first = format!("{path}.experts.0.{per_expert}");
            if !ctx.weights.contains(&format!("{first}.weight")) {
                return Err(ModelError::Weights(format!(
                    "no experts: neither {stacked}.weight nor {first}.weight"
                )));
            }
            let mut parts: [Option<Array>; 4] = [None, None, None, None];
            for (slot, suffix) in ["weight", "scales", "biases", "bias"].iter().enumerate() {
                let wanted = match *suffix {
                    "weight" => true,
                    "bias" => layout.bias,
                    _ => ctx.weights.contains(&format!("{first}.{suffix}")),
                };
                if !wanted {
                    continue;
                }
                let mut each = Vec::new();
                for e in 0..experts {
                    let t = ctx
                        .weights
                        .take(&format!("{path}.experts.{e}.{per_expert}.{suffix}"))?;
                    let mut shape = vec![1];
                    shape.extend(t.shape());
                    each.push(t.reshape(&shape)?);
                }
                let refs: Vec<&Array> = each.iter().collect();
                parts[slot] = Some(mlxcel_mlx::concatenate(&refs, 0)?);
            }
            (first, parts)
        };
        let [weight, scales, biases, bias] = parts;
        let weight = weight.ok_or_else(|| ModelError::Weights(format!("{module}.weight")))?;
        let shape = weight.shape();
        if shape.len() != 3 || shape[0] as usize != experts {
            return Err(ModelError::Weights(format!(
                "{module}: shape {shape:?}, want [{experts}, out, in] ({experts} experts)"
            )));
        }
        let out = shape[1] as usize;
        let mut input = shape[2] as usize;
        let bias = match bias {
            None => None,
            Some(b) if b.shape() == [experts as i32, out as i32] => Some(b.astype(ctx.dtype)?),
            Some(b) => {
                return Err(ModelError::Weights(format!(
                    "{module}.bias: shape {:?}, want [{experts}, {out}]",
                    b.shape()
                )))
            }
        };
        let matrix = match (scales, biases) {
            (None, _) => ExpertMatrix::Dense(weight.astype(ctx.dtype)?),
            (Some(scales), Some(biases)) => {
                let spec = ctx.quantization.for_module(&module).ok_or_else(|| {
                    ModelError::Config(format!(
                        "{module} is quantized but config has no quantization"
                    ))
                })?;
                let scales = scales.astype(ctx.dtype)?;
                let biases = biases.astype(ctx.dtype)?;
                // Packed: `in · bits / 32` words per row.
                input = input * 32 / spec.bits.max(1) as usize;
                let groups = scales.shape();
                if groups != biases.shape()
                    || groups.len() != 3
                    || groups[..2] != shape[..2]
                    || groups[2] as usize * spec.group_size.max(1) as usize != input
                {
                    return Err(ModelError::Weights(format!(
                        "{module}: scales {groups:?} and biases {:?} do not fit weights {shape:?} \
                         at {} bits, group {}",
                        biases.shape(),
                        spec.bits,
                        spec.group_size
                    )));
                }
                match ctx.mode {
                    WeightMode::Quantized => ExpertMatrix::Quantized {
                        weight,
                        scales,
                        biases,
                        spec,
                    },
                    WeightMode::Dequantized => ExpertMatrix::Dense(
                        weight
                            .dequantize(&scales, &biases, spec.group_size, spec.bits)?
                            .astype(ctx.dtype)?,
                    ),
                }
            }
            (Some(_), None) => {
                return Err(ModelError::Weights(format!(
                    "{module}: scales without biases (only affine quantization)"
                )))
            }
        };
        Ok((SwitchLinear { matrix, out, input }, bias))
    }

    /// `x` `[..., 1, in]` through the expert `indices` (uint32, broadcast
    /// against `x`'s batch axes) -> `[..., 1, out]`. With `dequantize`,
    /// quantized experts are dequantized into `x`'s dtype for this product
    /// (all of them, `[experts, out, in]`, a temporary) and multiplied by
    /// the dense gathered matmul ([`SparseMoe`]'s `dequantize_experts`).
    fn forward(
        &self,
        x: &Array,
        indices: &Array,
        sorted: bool,
        dequantize: bool,
    ) -> Result<Array, ModelError> {
        let dense = |w: &Array| -> Result<Array, ModelError> {
            Ok(x.gather_mm(&w.transpose(&[0, 2, 1])?, indices, sorted)?)
        };
        match &self.matrix {
            ExpertMatrix::Dense(w) => dense(w),
            ExpertMatrix::Quantized {
                weight,
                scales,
                biases,
                spec,
            } if dequantize => dense(
                &weight
                    .dequantize(scales, biases, spec.group_size, spec.bits)?
                    .astype(x.dtype())?,
            ),
            ExpertMatrix::Quantized {
                weight,
                scales,
                biases,
                spec,
            } => Ok(x.gather_qmm(
                weight,
                scales,
                biases,
                indices,
                spec.group_size,
                spec.bits,
                sorted,
            )?),
        }
    }

    /// Weights of every expert (`experts x out x in`) when kept quantized;
    /// `None` for dense experts.
    fn quantized_weights(&self) -> Option<usize> {
        match &self.matrix {
            ExpertMatrix::Dense(_) => None,
            ExpertMatrix::Quantized { scales, spec, .. } => {
                Some(crate::layers::quantized_weights(scales, spec.group_size))
            }
        }
    }

    fn arrays(&self) -> Vec<&Array> {
        match &self.matrix {
            ExpertMatrix::Dense(w) => vec![w],
            ExpertMatrix::Quantized {
                weight,
                scales,
                biases,
                ..
            } => vec![weight, scales, biases],
        }
    }
}

/// `[out, in]` of a linear layer's matrix (`in` unpacked when quantized;
/// 0 for a tensor of another rank).
fn matrix_dims(m: &crate::layers::Matrix) -> (usize, usize) {
    let dims = |a: &Array| match a.shape()[..] {
        [out, input] => (out as usize, input as usize),
        _ => (0, 0),
    };
    match m {
        crate::layers::Matrix::Dense(w) => dims(w),
        crate::layers::Matrix::Quantized(q) => {
            let (out, words) = dims(&q.weight);
            (out, words * 32 / q.spec.bits.max(1) as usize)
        }
    }
}

/// Token-expert pairs from which a step sorts by expert before the
/// gathered products (mlx_lm's threshold).
const SORT_FROM_PAIRS: usize = 64;

/// The sparse MoE block: router, experts, optional shared expert.
#[derive(Debug, Clone)]
pub struct SparseMoe {
    /// `[hidden] -> [experts]` logits.
    router: Linear,
    gate_proj: SwitchLinear,
    up_proj: SwitchLinear,
    down_proj: SwitchLinear,
    /// The experts' biases (gpt-oss), gate's, up's and down's side by side:
    /// `[experts, 2 · expert_hidden + hidden]`, one gather a step for all
    /// three.
    biases: Option<Array>,
    /// The shared expert and its `[hidden] -> [1]` sigmoid gate.
    shared: Option<(Mlp, Linear)>,
    top_k: usize,
    routing: Routing,
    activation: Activation,
    glu: ExpertGlu,
    /// Constants of every step, made once at load so that a step uploads
    /// none per layer: `-1` (float32, negates the router's scores for
    /// the top-k partition) and `[top_k]` (uint32, a sorted pair's token).
    neg_one: Array,
    top_k_divisor: Array,
}

impl SparseMoe {
    /// Loads the block at `path` (the router `{path}.gate`, or the
    /// layout's name, the experts, the shared expert
    /// `{path}.shared_expert` and its gate `{path}.shared_expert_gate`).
    ///
    /// # Errors
    /// Counts [`MoeSpec::check`] refuses; missing tensors; a router or
    /// expert stack whose expert count is not `spec.experts`;
    /// [`ModelError::Unsupported`] under tensor parallelism (experts are not
    /// split across ranks yet).
    pub fn load(ctx: &mut LoadContext<'_>, path: &str, spec: &MoeSpec) -> Result<Self, ModelError> {
        spec.check()?;
        if ctx.shard.is_some() {
            return Err(ModelError::Unsupported(
                "tensor parallelism over mixture-of-experts layers (experts are not split across ranks yet)"
                    .into(),
            ));
        }
        let layout = spec.layout;
        let router_path = format!("{path}.{}", layout.router);
        let router = Linear::load(ctx, &router_path, layout.router_bias)?;
        let (router_rows, hidden) = matrix_dims(&router.weight);
        if router_rows != spec.experts {
            return Err(ModelError::Weights(format!(
                "{router_path} routes to {router_rows} experts, config says {}",
                spec.experts
            )));
        }
        let names = spec.per_expert_names;
        let mut proj = |name: &str, per_expert: &str| {
            SwitchLinear::load(ctx, path, (name, per_expert), &layout, spec.experts)
        };
        let (gate_proj, gate_bias) = proj("gate_proj", names.gate)?;
        let (up_proj, up_bias) = proj("up_proj", names.up)?;
        let (down_proj, down_bias) = proj("down_proj", names.down)?;
        let biases = match (gate_bias, up_bias, down_bias) {
            (Some(g), Some(u), Some(d)) => Some(mlxcel_mlx::concatenate(&[&g, &u, &d], 1)?),
            _ => None,
        };
        for (name, rows) in [("gate", gate_proj.out), ("up", up_proj.out)] {
            if rows != spec.expert_hidden {
                return Err(ModelError::Weights(format!(
                    "{path}: expert {name} projections have {rows} rows, config says {}",
                    spec.expert_hidden
                )));
            }
        }
        // [out, in] of each projection against the router's input width.
        for (name, p, want) in [
            ("gate", &gate_proj, (spec.expert_hidden, hidden)),
            ("up", &up_proj, (spec.expert_hidden, hidden)),
            ("down", &down_proj, (hidden, spec.expert_hidden)),
        ] {
            if (p.out, p.input) != want {
                return Err(ModelError::Weights(format!(
                    "{path}: expert {name} projections are [{}, {}], want {want:?} \
                     (hidden size {hidden}, expert size {})",
                    p.out, p.input, spec.expert_hidden
                )));
            }
        }
        let shared = match spec.shared_expert {
            None => None,
            Some(size) => {
                let mlp = Mlp::load(ctx, &format!("{path}.shared_expert"), false)?;
                // Its intermediate size: down's input columns.
                let columns = matrix_dims(&mlp.down_proj.weight).1;
                if columns != size {
                    return Err(ModelError::Weights(format!(
                        "{path}.shared_expert.down_proj has {columns} input columns \
                         (the shared expert's intermediate size), config says {size}"
                    )));
                }
                let gate = Linear::load(ctx, &format!("{path}.shared_expert_gate"), false)?;
                Some((mlp, gate))
            }
        };
        Ok(SparseMoe {
            router,
            gate_proj,
            up_proj,
            down_proj,
            biases,
            shared,
            top_k: spec.top_k,
            routing: spec.routing,
            activation: spec.activation,
            glu: spec.glu,
            neg_one: Array::scalar(-1.0)?,
            top_k_divisor: Array::from_u32(&[spec.top_k as u32], &[1])?,
        })
    }

    /// The chosen experts `[..., top_k]` (uint32) and their weights
    /// `[..., top_k]` (float32) from router logits `[..., experts]`.
    fn route(&self, logits: &Array) -> Result<(Array, Array), ModelError> {
        let k = self.top_k as i32;
        let logits = logits.astype(Dtype::Float32)?;
        // The k largest: the first k of an argpartition of the negated
        // logits (the order mlx_lm's Mixtral and Qwen2-MoE take them in).
        let top = |x: &Array| -> Result<Array, ModelError> {
            let neg = x.multiply(&self.neg_one)?;
            let part = neg.argpartition(k - 1, -1)?;
            let mut stop = part.shape();
            let begin = vec![0; stop.len()];
            if let Some(last) = stop.last_mut() {
                *last = k;
            }
            Ok(part.slice(&begin, &stop)?)
        };
        Ok(match self.routing {
            Routing::SoftmaxTopK { normalize } => {
                let probs = logits.softmax(-1)?;
                let inds = top(&probs)?;
                let scores = probs.take_along_axis(&inds, -1)?;
                let scores = if normalize {
                    scores.divide(&scores.sum_axis(-1, true)?)?
                } else {
                    scores
                };
                (inds, scores)
            }
            Routing::TopKSoftmax => {
                let inds = top(&logits)?;
                let scores = logits.take_along_axis(&inds, -1)?.softmax(-1)?;
                (inds, scores)
            }
        })
    }

    /// `[..., hidden] -> [..., hidden]`.
    ///
    /// # Errors
    /// MLX errors of the graph.
    pub fn forward(&self, x: &Array) -> Result<Array, ModelError> {
        let (inds, scores) = self.route(&self.router.forward(x)?)?;
        self.combine(x, &inds, &scores)
    }

    /// The router's logits `[..., experts]` of `x` `[..., hidden]`.
    ///
    /// # Errors
    /// MLX errors of the graph.
    pub fn router_logits(&self, x: &Array) -> Result<Array, ModelError> {
        self.router.forward(x)
    }

    /// [`SparseMoe::forward`] of `x` `[..., hidden]` routed by `logits`
    /// `[..., experts]` that the caller computed from its own router input
    /// (Gemma 4 routes from the residual stream and runs the experts on a
    /// norm of it), each chosen expert's weight then multiplied by
    /// `expert_scale[expert]` (`[experts]`) when given (Gemma 4's
    /// `per_expert_scale`).
    ///
    /// # Errors
    /// MLX errors of the graph.
    pub fn forward_routed(
        &self,
        x: &Array,
        logits: &Array,
        expert_scale: Option<&Array>,
    ) -> Result<Array, ModelError> {
        let (inds, scores) = self.route(logits)?;
        let scores = match expert_scale {
            Some(s) => scores.multiply(&s.astype(Dtype::Float32)?.take(&inds, 0)?)?,
            None => scores,
        };
        self.combine(x, &inds, &scores)
    }

    /// `x` `[..., hidden]` through its chosen experts `inds` `[..., top_k]`
    /// weighted by `scores` (float32), plus the shared expert.
    fn combine(&self, x: &Array, inds: &Array, scores: &Array) -> Result<Array, ModelError> {
        let dtype = x.dtype();
        let shape = x.shape();
        let hidden = *shape.last().unwrap_or(&0);
        let tokens: i32 = shape[..shape.len().saturating_sub(1)].iter().product();
        let k = self.top_k as i32;
        let inds = inds.reshape(&[tokens, k])?;
        let pairs = (tokens * k) as usize;
        // [tokens, k, hidden]: each token through each of its experts.
        // Batch-invariant execution never sorts: the sorted and unsorted
        // gathered matmuls may round differently (`crate::invariant`).
        let dequantize = self.dequantize_experts(tokens as usize);
        let y = if pairs >= SORT_FROM_PAIRS && !crate::invariant::enabled() {
            // Sorted by expert: one run of rows per expert.
            let flat = inds.reshape(&[tokens * k])?;
            let order = flat.argsort(0)?;
            let inverse = order.argsort(0)?;
            let rows = order.floor_divide(&self.top_k_divisor)?;
            let xs = x.reshape(&[tokens, 1, hidden])?.take(&rows, 0)?;
            let sorted = flat.take(&order, 0)?;
            let y = self.experts(&xs, &sorted, true, dequantize)?;
            y.take(&inverse, 0)?.reshape(&[tokens, k, hidden])?
        } else {
            let xs = x.reshape(&[tokens, 1, 1, hidden])?;
            self.experts(&xs, &inds, false, dequantize)?
                .reshape(&[tokens, k, hidden])?
        };
        let scores = scores.reshape(&[tokens, k, 1])?.astype(dtype)?;
        let mut out = y.multiply(&scores)?.sum_axis(1, false)?;
        if let Some((mlp, gate)) = &self.shared {
            let flat = x.reshape(&[tokens, hidden])?;
            let g = gate.forward(&flat)?.sigmoid()?;
            out = out.add(&g.multiply(&mlp.forward(&flat)?)?)?;
        }
        Ok(out.reshape(&shape)?)
    }

    /// Whether a step of `tokens` tokens multiplies this
    /// layer's quantized experts dequantized, through the dense gathered
    /// matmul: when [`crate::layers::dequantizes_for`] holds for the
    /// step's tokens and every projection's experts together, as for a
    /// linear layer. Only on a GPU: a CPU's default dequantizes experts at load,
    /// and with `--weights quantized` its 16-token threshold would
    /// dequantize every expert of a layer for most steps (not measured
    /// there). Never under batch-invariant execution (the kernel would then
    /// depend on the batch's token count).
    ///
    /// Why: MLX's gathered quantized matmul does not speed up with many
    /// tokens. Measured on an H100 (MLX 0.32.4, bfloat16, 4-bit group 64,
    /// one projection of every token-expert pair, `benches/moe_prefill.py`,
    /// `benches/results/2026-12-07-moe-prefill-h100.md`): at 1,024 tokens
    /// gpt-oss-20b's experts take 18.8 ms sorted through `gather_qmm`
    /// (3.6 TFLOP/s) and 1.54 ms dequantized then `gather_mm` (44 TFLOP/s),
    /// Qwen3-30B-A3B's 5.39 and 1.16 ms; at 256 tokens 5.03 against 1.64
    /// and 1.49 against 1.17 ms; at 64 tokens the quantized kernel wins on
    /// Qwen3-30B-A3B (0.50 against 1.13 ms). The dequantized experts are a
    /// temporary of the product: `experts x out x in` elements of the
    /// compute dtype (531 MB for gpt-oss-20b's gate projection in
    /// bfloat16), memory the KV budget does not count, like any step's
    /// activations.
    fn dequantize_experts(&self, tokens: usize) -> bool {
        let weights = [&self.gate_proj, &self.up_proj, &self.down_proj]
            .iter()
            .map(|p| p.quantized_weights())
            .collect::<Option<Vec<usize>>>();
        let Some(smallest) = weights.and_then(|w| w.into_iter().min()) else {
            return false;
        };
        !crate::invariant::enabled()
            && crate::layers::dequantizes_for(tokens, smallest)
            && mlxcel_mlx::default_device_is_gpu()
    }

    /// The gated MLP of each row's expert: `x` `[..., 1, hidden]`,
    /// `indices` broadcast against its batch axes -> `[..., 1, hidden]`.
    fn experts(
        &self,
        x: &Array,
        indices: &Array,
        sorted: bool,
        dequantize: bool,
    ) -> Result<Array, ModelError> {
        let g = self.gate_proj.forward(x, indices, sorted, dequantize)?;
        let u = self.up_proj.forward(x, indices, sorted, dequantize)?;
        // Each row's expert's biases, `[..., 1, width]` like the products:
        // one gather, three views.
        let biases = match &self.biases {
            None => None,
            Some(table) => {
                let (inner, hidden) = (self.gate_proj.out as i32, self.down_proj.out as i32);
                let mut shape = indices.shape();
                shape.extend([1, 2 * inner + hidden]);
                let rows = table.take(indices, 0)?.reshape(&shape)?;
                let part = |from: i32, to: i32| -> Result<Array, ModelError> {
                    let mut begin = vec![0; shape.len()];
                    let mut end = shape.clone();
                    if let (Some(b), Some(e)) = (begin.last_mut(), end.last_mut()) {
                        (*b, *e) = (from, to);
                    }
                    Ok(rows.slice(&begin, &end)?)
                };
                Some([
                    part(0, inner)?,
                    part(inner, 2 * inner)?,
                    part(2 * inner, 2 * inner + hidden)?,
                ])
            }
        };
        let h = match self.glu {
            ExpertGlu::Gated => {
                let (g, u) = match &biases {
                    Some([bg, bu, _]) => (g.add(bg)?, u.add(bu)?),
                    None => (g, u),
                };
                match self.activation {
                    Activation::Silu => mlxcel_mlx::swiglu(&g, &u)?,
                    Activation::GeluTanh => mlxcel_mlx::geglu_tanh(&g, &u)?,
                }
            }
            ExpertGlu::ClampedSwiglu { alpha, limit } => {
                let b = biases.as_ref().map(|[bg, bu, _]| (bg, bu));
                mlxcel_mlx::clamped_swiglu(&g, &u, b, alpha, limit)?
            }
        };
        let y = self.down_proj.forward(&h, indices, sorted, dequantize)?;
        Ok(match &biases {
            Some([_, _, bd]) => y.add(bd)?,
            None => y,
        })
    }

    /// Every tensor of the block.
    pub fn arrays(&self) -> Vec<&Array> {
        let mut v = self.router.arrays();
        for p in [&self.gate_proj, &self.up_proj, &self.down_proj] {
            v.extend(p.arrays());
        }
        v.extend(&self.biases);
        if let Some((mlp, gate)) = &self.shared {
            v.extend(mlp.arrays());
            v.extend(gate.arrays());
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::tests::matrix;

    /// Quantized experts multiplied dequantized give the dense gathered
    /// product of the dequantized experts bit for bit (sorted and unsorted
    /// indices), which is not what the quantized kernel gives: the test
    /// can tell the two paths apart.
    #[test]
    fn dequantized_experts_take_the_dense_gathered_product() {
        let (experts, out, input) = (4usize, 32usize, 128usize);
        let w = matrix(experts * out, input, 5)
            .reshape(&[experts as i32, out as i32, input as i32])
            .unwrap();
        let (weight, scales, biases) = w.quantize(64, 4).unwrap();
        let spec = QuantSpec {
            group_size: 64,
            bits: 4,
        };
        let dense_w = weight
            .dequantize(&scales, &biases, 64, 4)
            .unwrap()
            .astype(Dtype::Float32)
            .unwrap();
        let linear = SwitchLinear {
            matrix: ExpertMatrix::Quantized {
                weight,
                scales,
                biases,
                spec,
            },
            out,
            input,
        };
        assert_eq!(linear.quantized_weights(), Some(experts * out * input));
        let tokens = 12usize;
        let x = matrix(tokens, input, 9)
            .reshape(&[tokens as i32, 1, input as i32])
            .unwrap();
        let ids: Vec<u32> = (0..tokens as u32)
            .map(|t| (t * 3 + 1) % experts as u32)
            .collect();
        let mut sorted_ids = ids.clone();
        sorted_ids.sort_unstable();
        for (ids, sorted) in [(ids, false), (sorted_ids, true)] {
            let indices = Array::from_u32(&ids, &[tokens as i32]).unwrap();
            let want = x
                .gather_mm(&dense_w.transpose(&[0, 2, 1]).unwrap(), &indices, sorted)
                .unwrap()
                .to_vec_f32()
                .unwrap();
            let got = linear
                .forward(&x, &indices, sorted, true)
                .unwrap()
                .to_vec_f32()
                .unwrap();
            let kernel = linear
                .forward(&x, &indices, sorted, false)
                .unwrap()
                .to_vec_f32()
                .unwrap();
            assert_eq!(got.len(), tokens * out);
            assert_eq!(got, want, "sorted {sorted}: not the dense product");
            assert_ne!(kernel, want, "sorted {sorted}: the paths round alike here");
            let worst = got
                .iter()
                .zip(&kernel)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(
                worst < 1e-3,
                "sorted {sorted}: dense off the kernel by {worst}"
            );
        }
    }
}
