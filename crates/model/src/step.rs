//! The plain-data description of one forward (a *step*) that every family
//! shares: which tokens run, packed how, at which positions, and which rows
//! want logits.

use std::ops::Range;

use mlxcel_kv::AttentionKv;
use mlxcel_mlx::Array;

use crate::ModelError;

/// One row of a step: a sequence's next tokens.
#[derive(Debug, Clone, Copy)]
pub struct StepRow<'a> {
    /// The tokens to run (real tokens, then any pad tokens), written to the
    /// KV cache at the positions the view gives.
    pub tokens: &'a [u32],
    /// Index in `tokens` of the token whose next-token logits are wanted
    /// (the last real one), or `None` (a prefill chunk before the last).
    pub logits_at: Option<usize>,
    /// Leading real tokens whose next-token logits are wanted too, to score
    /// the prompt (prompt logprobs): `tokens[..scored]`, all before
    /// `logits_at`; 0 for none.
    pub scored: usize,
}

/// How the step's attention reads the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionPath {
    /// One attention per row over that row's keys.
    #[default]
    PerRow,
    /// The leading one-token (decode) rows in one attention over keys
    /// padded to the longest row, with a padding mask (paged storage only;
    /// row by row otherwise).
    BatchedDecode,
    /// The leading one-token (decode) rows in one paged-attention kernel
    /// that reads each row's keys from the pool through its block table (no
    /// gather, no mask): GPU backends only, paged storage only; as
    /// [`AttentionPath::BatchedDecode`] elsewhere.
    PagedDecode,
}

/// A step as the layers see it: packed token spans and positions.
#[derive(Debug)]
pub struct Step {
    /// Tokens in the step (all rows, packed).
    pub tokens: usize,
    /// Row `r`'s tokens are packed at `rows[r]`.
    pub rows: Vec<Range<usize>>,
    /// Absolute position of each packed token, int32 `[tokens]`.
    pub positions: Array,
    /// The leading rows attended together (one token each), 0 for none.
    pub batched_decode_rows: usize,
    /// Whether those rows use the paged-attention kernel.
    pub paged_kernel: bool,
    /// The padding masks of the rows attended together, built by the first
    /// layer that needs each: keyed by the rows' live key counts and the
    /// layer's window (layers of different KV groups see different counts,
    /// windowed layers hide more keys).
    pub batched_masks: std::cell::RefCell<Vec<BatchedMask>>,
}

/// One padding mask of a step ([`Step::batched_masks`]).
#[derive(Debug, Clone)]
pub struct BatchedMask {
    /// Each row's live key count.
    pub lens: Vec<usize>,
    /// The layer's window (`None`: full attention).
    pub window: Option<usize>,
    /// The mask `[rows, 1, 1, max_live]`.
    pub mask: mlxcel_mlx::AttentionMask,
}

impl Step {
    /// Packs `rows` and reads their positions from `kv`.
    ///
    /// # Errors
    /// A row whose token count differs from the positions reserved for it,
    /// an empty step, or rows attended together that hold more than one token.
    pub fn new(
        rows: &[StepRow<'_>],
        kv: &dyn AttentionKv,
        path: AttentionPath,
    ) -> Result<Self, ModelError> {
        if rows.is_empty() || rows.len() != kv.num_rows() {
            return Err(ModelError::Cache(format!(
                "{} rows for a KV view of {}",
                rows.len(),
                kv.num_rows()
            )));
        }
        let mut spans = Vec::with_capacity(rows.len());
        let mut positions = Vec::new();
        for (r, row) in rows.iter().enumerate() {
            let pos = kv.new_positions(r);
            let bad_logits = row.logits_at.is_some_and(|i| i >= row.tokens.len())
                || row.scored > row.logits_at.unwrap_or(row.tokens.len());
            if pos.len() != row.tokens.len() || row.tokens.is_empty() || bad_logits {
                return Err(ModelError::Cache(format!(
                    "row {r}: {} tokens, {} positions reserved, logits at {:?}, {} scored",
                    row.tokens.len(),
                    pos.len(),
                    row.logits_at,
                    row.scored
                )));
            }
            spans.push(positions.len()..positions.len() + pos.len());
            positions.extend(pos.map(|p| p as i32));
        }
        let batched_decode_rows = match path {
            AttentionPath::PerRow => 0,
            AttentionPath::BatchedDecode | AttentionPath::PagedDecode => {
                rows.iter().take_while(|r| r.tokens.len() == 1).count()
            }
        };
        let paged_kernel = path == AttentionPath::PagedDecode
            && batched_decode_rows > 0
            && mlxcel_mlx::paged_attention_available();
        let tokens = positions.len();
        Ok(Step {
            tokens,
            rows: spans,
            positions: Array::from_i32(&positions, &[tokens as i32])?,
            batched_decode_rows,
            paged_kernel,
            batched_masks: std::cell::RefCell::default(),
        })
    }

    /// Packed indices of the tokens whose logits are wanted, in row order:
    /// each row's scored tokens, then its `logits_at`.
    pub fn logit_indices(&self, rows: &[StepRow<'_>]) -> Vec<i32> {
        rows.iter()
            .zip(&self.rows)
            .flat_map(|(row, span)| {
                (0..row.scored)
                    .chain(row.logits_at)
                    .map(move |i| (span.start + i) as i32)
            })
            .collect()
    }
}
