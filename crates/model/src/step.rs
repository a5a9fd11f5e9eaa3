//! The plain-data description of one forward (a *step*) that every family
//! shares: what each row feeds the model (token ids or input embeddings),
//! packed how, at which positions, and at which positions each row wants
//! next-token logits.

use std::ops::Range;

use mlxcel_kv::AttentionKv;
use mlxcel_mlx::Array;
use serde::{Deserialize, Serialize};

use crate::ModelError;

/// What one row of a step feeds the model.
#[derive(Debug, Clone, Copy)]
pub enum RowInput<'a> {
    /// Token ids: the real tokens, then any pad tokens.
    Tokens(&'a [u32]),
    /// Input embeddings `[tokens, hidden]` in the model's compute dtype,
    /// used in place of the token embedding (and of any embedding scale the
    /// family applies to token embeddings): rows whose input is not text,
    /// such as image features.
    Embeddings(&'a Array),
}

impl RowInput<'_> {
    /// Tokens in the row (pads included).
    pub fn len(&self) -> usize {
        match self {
            RowInput::Tokens(t) => t.len(),
            RowInput::Embeddings(e) => e.shape().first().map_or(0, |&n| n.max(0) as usize),
        }
    }

    /// Whether the row has no token.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One row of a step: a sequence's next tokens.
#[derive(Debug, Clone)]
pub struct StepRow<'a> {
    /// What the row runs, written to the KV cache at the positions the
    /// view gives.
    pub input: RowInput<'a>,
    /// Positions in the row (`0..len`) whose next-token logits are wanted,
    /// in order: the last real token for a row that samples
    /// (`real - 1..real`), every token of a scored prompt chunk (prompt
    /// logprobs), every draft position of a verification row (speculative
    /// decoding), nothing for a prefill chunk before the last.
    pub logits: Range<usize>,
    /// Positions in the row whose final hidden state (after the final
    /// norm, before the head) is wanted: an embedding request's last token
    /// (last-token pooling) or every token (mean pooling); empty for any
    /// other row.
    pub hidden: Range<usize>,
}

impl<'a> StepRow<'a> {
    /// A row of token ids wanting the logits of `logits_at` (or none).
    pub fn tokens(tokens: &'a [u32], logits_at: Option<usize>) -> Self {
        StepRow {
            input: RowInput::Tokens(tokens),
            logits: logits_at.map_or(0..0, |i| i..i + 1),
            hidden: 0..0,
        }
    }
}

/// What [`crate::Model::build_step`] returns, **not evaluated**.
#[derive(Debug)]
pub struct StepGraph {
    /// Float32 next-token logits `[wanted positions, vocab]`, per row in
    /// row order the positions of its [`StepRow::logits`] (`[0, vocab]`
    /// when no row wants any).
    pub logits: Array,
    /// Float32 final hidden states `[hidden positions, hidden_size]`, per
    /// row in row order the positions of its [`StepRow::hidden`]; `None`
    /// when no row wants any.
    pub hidden: Option<Array>,
}

/// How the step's attention reads the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
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
    /// Under batch-invariant execution ([`crate::invariant`]): every query
    /// of the step, prefill included, is attended on its own over its own
    /// live keys (one row of the paged-attention kernel on a GPU, one
    /// attention of one query elsewhere).
    pub every_query: bool,
    /// With the paged-attention kernel, under [`Step::every_query`] or for
    /// a step of short rows ([`queries_as_kernel_rows`]): the queries as
    /// rows of the kernel. Per packed token,
    /// int32 `[tokens]` its row, and int32 `[tokens, 2]` `(0, keys after
    /// it)`: subtracted from its row's kernel meta (first-key offset, live
    /// keys), the query's own.
    pub query_rows: Option<(Array, Array)>,
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
    /// [`ModelError::StepMismatch`]: an empty step, a row count other than
    /// the view's, a row whose token count differs from the positions
    /// reserved for it, or logits wanted past a row's end.
    pub fn new(
        rows: &[StepRow<'_>],
        kv: &dyn AttentionKv,
        path: AttentionPath,
    ) -> Result<Self, ModelError> {
        if rows.is_empty() || rows.len() != kv.num_rows() {
            return Err(StepMismatch::RowCount {
                rows: rows.len(),
                view_rows: kv.num_rows(),
            }
            .into());
        }
        let mut spans = Vec::with_capacity(rows.len());
        let mut positions = Vec::new();
        for (r, row) in rows.iter().enumerate() {
            let pos = kv.new_positions(r);
            let len = row.input.len();
            if pos.len() != len || len == 0 || row.logits.end > len || row.hidden.end > len {
                return Err(StepMismatch::Row {
                    row: r,
                    tokens: len,
                    positions: pos.len(),
                    logits: row.logits.clone(),
                }
                .into());
            }
            spans.push(positions.len()..positions.len() + pos.len());
            positions.extend(pos.map(|p| p as i32));
        }
        let batched_decode_rows = match path {
            AttentionPath::PerRow => 0,
            AttentionPath::BatchedDecode | AttentionPath::PagedDecode => {
                rows.iter().take_while(|r| r.input.len() == 1).count()
            }
        };
        let kernel = path == AttentionPath::PagedDecode && mlxcel_mlx::paged_attention_available();
        let paged_kernel = kernel && batched_decode_rows > 0;
        let tokens = positions.len();
        let every_query = crate::invariant::enabled();
        let query_rows = if kernel
            && (every_query || (short_rows_enabled() && queries_as_kernel_rows(&spans)))
        {
            let mut owner = Vec::with_capacity(tokens);
            let mut after = Vec::with_capacity(2 * tokens);
            for (r, span) in spans.iter().enumerate() {
                let n = span.len();
                for i in 0..n {
                    owner.push(r as i32);
                    after.extend([0, (n - 1 - i) as i32]);
                }
            }
            Some((
                Array::from_i32(&owner, &[tokens as i32])?,
                Array::from_i32(&after, &[tokens as i32, 2])?,
            ))
        } else {
            None
        };
        Ok(Step {
            tokens,
            rows: spans,
            positions: Array::from_i32(&positions, &[tokens as i32])?,
            batched_decode_rows,
            paged_kernel,
            every_query,
            query_rows,
            batched_masks: std::cell::RefCell::default(),
        })
    }

    /// Packed indices of the tokens whose logits are wanted, in row order
    /// (each row's [`StepRow::logits`]).
    pub fn logit_indices(&self, rows: &[StepRow<'_>]) -> Vec<i32> {
        rows.iter()
            .zip(&self.rows)
            .flat_map(|(row, span)| row.logits.clone().map(move |i| (span.start + i) as i32))
            .collect()
    }

    /// Packed indices of the tokens whose final hidden state is wanted, in
    /// row order (each row's [`StepRow::hidden`]).
    pub fn hidden_indices(&self, rows: &[StepRow<'_>]) -> Vec<i32> {
        rows.iter()
            .zip(&self.rows)
            .flat_map(|(row, span)| row.hidden.clone().map(move |i| (span.start + i) as i32))
            .collect()
    }

    /// Whether every row's input is token ids.
    pub fn all_tokens(rows: &[StepRow<'_>]) -> bool {
        rows.iter().all(|r| matches!(r.input, RowInput::Tokens(_)))
    }
}

/// The most tokens a row may have for a step of such rows to attend every
/// query as a row of the paged-attention kernel
/// ([`queries_as_kernel_rows`]): speculative verification (1 + the draft
/// tokens, 10 at most by default), a short prompt or the short tail of one.
pub const SHORT_ROW_TOKENS: usize = 16;

/// Whether a step of rows packed at `spans` attends each query as a row
/// of its own of the paged-attention kernel (where the step's path is
/// [`AttentionPath::PagedDecode`] and the kernel runs): when no row has
/// more than [`SHORT_ROW_TOKENS`] tokens and one has more than one. Such
/// rows otherwise take an attention each, over their keys gathered from
/// the pool under a causal mask (a dozen graph nodes per row and layer);
/// as kernel rows the whole step is one kernel per layer, and a
/// verification query reads its keys as the decode query at its position
/// would. Steps of decode rows only keep the batched kernel call; longer
/// rows (prefill chunks) keep MLX's fused attention, which reads a row's
/// keys once for all its queries.
pub fn queries_as_kernel_rows(spans: &[Range<usize>]) -> bool {
    spans.iter().all(|s| s.len() <= SHORT_ROW_TOKENS) && spans.iter().any(|s| s.len() > 1)
}

/// `MLXCEL_PAGED_SHORT_ROWS=0` turns [`queries_as_kernel_rows`] off in
/// this process (to measure against the per-row attention it replaces);
/// read once.
pub fn short_rows_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("MLXCEL_PAGED_SHORT_ROWS").map_or(true, |v| v != "0"))
}

/// A step whose rows do not match its KV view or its own shape: a bug
/// above the model (the engine reserves positions for exactly the rows it
/// runs), reported instead of panicking.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StepMismatch {
    /// The step has no row, or not as many as the view.
    #[error("{rows} rows for a KV view of {view_rows}")]
    RowCount { rows: usize, view_rows: usize },
    /// A row's token count differs from the positions reserved for it, or
    /// it wants logits (or hidden states) past its end.
    #[error("row {row}: {tokens} tokens, {positions} positions reserved, logits at {logits:?}")]
    Row {
        row: usize,
        tokens: usize,
        positions: usize,
        logits: Range<usize>,
    },
    /// More new queries than live keys (the view must return the new keys
    /// too).
    #[error("{queries} queries over {keys} live keys")]
    QueriesOverKeys { queries: i32, keys: i32 },
    /// A row attended in a padded batch with no live key, or more than the
    /// batch was padded to.
    #[error("row of {live} live keys in a batch padded to {padded}")]
    PaddedRow { live: usize, padded: usize },
    /// A token id past the embedding table.
    #[error("token id {id} is outside the embedding table ({vocab} rows)")]
    TokenOutOfRange { id: u32, vocab: usize },
    /// Input embeddings whose shape is not `[tokens, hidden]`.
    #[error("row {row}: input embeddings of shape {shape:?}, want [tokens, {hidden}]")]
    Embeddings {
        row: usize,
        shape: Vec<i32>,
        hidden: usize,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spans(lens: &[usize]) -> Vec<Range<usize>> {
        let mut at = 0;
        lens.iter()
            .map(|&n| {
                at += n;
                at - n..at
            })
            .collect()
    }

    #[test]
    fn short_multi_token_rows_attend_as_kernel_rows() {
        // Verification rows (1 + 10 drafts) beside decode rows.
        assert!(queries_as_kernel_rows(&spans(&[1, 11, 1, 5])));
        assert!(queries_as_kernel_rows(&spans(&[SHORT_ROW_TOKENS])));
        // Decode rows only keep the batched kernel call.
        assert!(!queries_as_kernel_rows(&spans(&[1, 1, 1])));
        // A prefill chunk keeps MLX's fused attention, and so does the step.
        assert!(!queries_as_kernel_rows(&spans(&[
            1,
            11,
            SHORT_ROW_TOKENS + 1
        ])));
        assert!(!queries_as_kernel_rows(&spans(&[512])));
    }
}
