//! What rank 0 sends the other ranks, and how.
//!
//! A [`Plan`] travels as JSON bytes packed into int32 words through
//! `all_sum` (rank 0 contributes the words, the others zeros), which every
//! backend carries: one collective of [`HEAD_WORDS`] words, and a second
//! one when the plan is longer. A step's plan is the model's rows (token
//! ids and the positions whose logits are wanted) and the KV crate's own
//! serialisable [`StepLayout`] (each row's positions and block table, the
//! block copies the bookkeeping made).

use std::ops::Range;

use mlxcel_kv::StepLayout;
use mlxcel_mlx::{distributed, Array, Dtype};
use mlxcel_model::{AttentionPath, RowInput, StepRow};
use serde::{Deserialize, Serialize};

use crate::error::GroupError;

/// Words of a plan's first collective (the length, then the first bytes).
pub const HEAD_WORDS: usize = 1024;

/// What rank 0 broadcasts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) enum Plan {
    /// Once, after loading: the pool every follower allocates, and what it
    /// checks its own model against.
    Setup(Setup),
    /// One step's inputs.
    Step(WireStep),
    /// Rank 0 is shutting down: followers exit.
    Stop,
}

/// The group's set-up, sent once by rank 0.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Setup {
    /// The model rank 0 loaded (`config.json` `model_type`), its layer
    /// count and compute dtype: every rank must load the same.
    pub(crate) model_type: String,
    pub(crate) layers: usize,
    pub(crate) dtype: Dtype,
    /// The K/V pool every rank allocates: blocks, and tokens per block.
    pub(crate) num_blocks: usize,
    pub(crate) block_size: usize,
    /// How every rank stores K/V (`KvCacheDtype::name`: `auto`, `int8`...).
    pub(crate) kv_dtype: String,
}

/// One row of a step as it crosses ranks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct WireRow {
    /// Token ids, pads included.
    pub(crate) tokens: Vec<u32>,
    /// Positions whose next-token logits are wanted.
    pub(crate) logits: Range<usize>,
}

/// One step's inputs, everything a follower's forward depends on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct WireStep {
    pub(crate) path: AttentionPath,
    pub(crate) rows: Vec<WireRow>,
    pub(crate) layout: StepLayout,
}

impl WireStep {
    /// The plan of a step over `rows` whose KV view is `layout`; `None`
    /// when a row's input is embeddings (only token rows cross ranks).
    pub(crate) fn new(
        rows: &[StepRow<'_>],
        layout: StepLayout,
        path: AttentionPath,
    ) -> Option<Self> {
        let rows = rows
            .iter()
            .map(|r| match r.input {
                RowInput::Tokens(t) => Some(WireRow {
                    tokens: t.to_vec(),
                    logits: r.logits.clone(),
                }),
                RowInput::Embeddings(_) => None,
            })
            .collect::<Option<_>>()?;
        Some(WireStep { path, rows, layout })
    }

    /// The rows as the model takes them.
    pub(crate) fn model_rows(&self) -> Vec<StepRow<'_>> {
        self.rows
            .iter()
            .map(|r| StepRow {
                input: RowInput::Tokens(&r.tokens),
                logits: r.logits.clone(),
                // Hidden states are read on rank 0 only, after the last
                // layer's all-reduce: the other ranks need not build them.
                hidden: 0..0,
            })
            .collect()
    }
}

/// Packs `bytes` as little-endian int32 words after a length word.
fn to_words(bytes: &[u8]) -> Vec<i32> {
    let mut words = Vec::with_capacity(1 + bytes.len().div_ceil(4));
    words.push(bytes.len() as i32);
    words.extend(bytes.chunks(4).map(|c| {
        let mut w = [0u8; 4];
        w[..c.len()].copy_from_slice(c);
        i32::from_le_bytes(w)
    }));
    words
}

/// The bytes of [`to_words`]'s words (the length word first).
fn from_words(words: &[i32]) -> Result<Vec<u8>, GroupError> {
    let len = words.first().copied().unwrap_or(0);
    let bad = || GroupError::Length {
        bytes: i64::from(len),
        words: words.len(),
    };
    let len = usize::try_from(len).map_err(|_| bad())?;
    let mut bytes: Vec<u8> = words[1..].iter().flat_map(|w| w.to_le_bytes()).collect();
    if bytes.len() < len {
        return Err(bad());
    }
    bytes.truncate(len);
    Ok(bytes)
}

/// Sums `words` (padded with zeros to `n`) over the group and reads the sum.
fn sum_words(words: &[i32], n: usize) -> Result<Vec<i32>, GroupError> {
    let mut padded = vec![0i32; n];
    let k = words.len().min(n);
    padded[..k].copy_from_slice(&words[..k]);
    let x = Array::from_i32(&padded, &[n as i32])?;
    Ok(distributed::all_sum(&x, None)?.to_vec_i32()?)
}

/// Broadcasts `plan` from rank 0 (`Some`) to every rank (`None` on
/// followers) and returns it: one collective of [`HEAD_WORDS`], a second
/// for the rest of a longer plan.
///
/// # Errors
/// A failed collective, or a plan that does not serialize or parse.
pub(crate) fn broadcast(plan: Option<&Plan>) -> Result<Plan, GroupError> {
    let words = match plan {
        Some(p) => to_words(&serde_json::to_vec(p).map_err(|e| GroupError::Json(e.to_string()))?),
        None => Vec::new(),
    };
    let mut all = sum_words(&words, HEAD_WORDS)?;
    let len = all.first().copied().unwrap_or(0).max(0) as usize;
    let total = 1 + len.div_ceil(4);
    if total > HEAD_WORDS {
        let rest = words.get(HEAD_WORDS..).unwrap_or(&[]);
        all.extend(sum_words(rest, total - HEAD_WORDS)?);
    }
    let bytes = from_words(&all)?;
    serde_json::from_slice(&bytes).map_err(|e| GroupError::Json(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlxcel_kv::{CopyLayout, RowLayout};

    #[test]
    fn words_round_trip_any_length() {
        for n in [0usize, 1, 3, 4, 5, 4095, 4096, 4097, 10_000] {
            let bytes: Vec<u8> = (0..n).map(|i| (i * 31 % 251) as u8).collect();
            let words = to_words(&bytes);
            assert_eq!(words.len(), 1 + n.div_ceil(4));
            assert_eq!(from_words(&words).unwrap(), bytes);
        }
        assert!(from_words(&[9, 0]).is_err());
        assert!(from_words(&[-1]).is_err());
    }

    #[test]
    fn a_step_plan_round_trips_through_json() {
        let tokens = [5u32, 6, 7];
        let rows = [StepRow {
            input: RowInput::Tokens(&tokens),
            logits: 1..3,
            hidden: 0..0,
        }];
        let layout = StepLayout {
            copies: vec![CopyLayout {
                src: 3,
                dst: 9,
                tokens: 2,
            }],
            rows: vec![RowLayout {
                start: 30,
                end: 35,
                new: 3,
                blocks: vec![1, 9],
            }],
        };
        let plan =
            Plan::Step(WireStep::new(&rows, layout.clone(), AttentionPath::PagedDecode).unwrap());
        let json = serde_json::to_vec(&plan).unwrap();
        let back: Plan = serde_json::from_slice(&from_words(&to_words(&json)).unwrap()).unwrap();
        assert_eq!(back, plan);
        let Plan::Step(step) = back else {
            unreachable!()
        };
        assert_eq!(step.layout, layout);
        assert_eq!(step.path, AttentionPath::PagedDecode);
        let model_rows = step.model_rows();
        assert!(matches!(model_rows[0].input, RowInput::Tokens(t) if t == tokens));
        assert_eq!(model_rows[0].logits, 1..3);
    }

    #[test]
    fn a_setup_round_trips_with_its_dtype_by_name() {
        let plan = Plan::Setup(Setup {
            model_type: "llama".into(),
            layers: 2,
            dtype: Dtype::Bfloat16,
            num_blocks: 10,
            block_size: 32,
            kv_dtype: "int8".into(),
        });
        let json = serde_json::to_string(&plan).unwrap();
        assert!(json.contains("\"bfloat16\""), "{json}");
        assert!(json.contains("\"int8\""), "{json}");
        assert_eq!(serde_json::from_str::<Plan>(&json).unwrap(), plan);
    }
}
