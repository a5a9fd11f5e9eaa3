//! What the recurrent token mixers (Gated DeltaNet, Mamba2) share: how a
//! step's packed rows are run (decode rows batched, prompt rows alone
//! over their real tokens) and how each row's state is read from and
//! written to the KV view ([`AttentionKv::read_state`],
//! [`AttentionKv::write_state`]).

use mlxcel_kv::AttentionKv;
use mlxcel_mlx::{Array, Dtype};

use crate::step::Step;
use crate::ModelError;

/// Runs a recurrent layer over a step's rows and packs the outputs in
/// step order, `[tokens, ...pad_shape]`. The leading one-token rows
/// (decode) go to `run` as one batch; every other row alone, over its
/// real tokens ([`AttentionKv::real_tokens`]), its pad tokens given zeros
/// of `pad_shape` and `dtype` (they change no state). `run(kv, rows,
/// start, len)` gets rows consecutive in the packed step from token
/// `start`, `len` tokens each, and returns `[rows · len, ...pad_shape]`.
///
/// # Errors
/// What `run` returns; MLX errors.
pub(crate) fn run_rows(
    step: &Step,
    kv: &mut dyn AttentionKv,
    pad_shape: &[i32],
    dtype: Dtype,
    mut run: impl FnMut(&mut dyn AttentionKv, &[usize], usize, usize) -> Result<Array, ModelError>,
) -> Result<Array, ModelError> {
    let decode = step.rows.iter().take_while(|r| r.len() == 1).count();
    let mut parts = Vec::new();
    if decode > 0 {
        let rows: Vec<usize> = (0..decode).collect();
        parts.push(run(kv, &rows, 0, 1)?);
    }
    for (row, span) in step.rows.iter().enumerate().skip(decode) {
        let real = kv.real_tokens(row).clamp(1, span.len());
        parts.push(run(kv, &[row], span.start, real)?);
        if real < span.len() {
            let mut shape = vec![(span.len() - real) as i32];
            shape.extend_from_slice(pad_shape);
            parts.push(mlxcel_mlx::zeros(&shape, dtype)?);
        }
    }
    join(&parts)
}

/// `parts` joined along axis 0 (one part as it is).
pub(crate) fn join(parts: &[Array]) -> Result<Array, ModelError> {
    Ok(match parts {
        [one] => one.clone(),
        _ => mlxcel_mlx::concatenate(&parts.iter().collect::<Vec<_>>(), 0)?,
    })
}

/// The states of `rows` before their new tokens, each of the layer's `N`
/// arrays joined along axis 0 (`[rows, ...]`); a row at position 0 starts
/// from `zero()` (`[1, ...]` each).
///
/// # Errors
/// A kept state of another arity than `N` ([`ModelError::Config`]); the KV
/// view's errors (a missing state is its invariant error, never a zero
/// state).
pub(crate) fn read_states<const N: usize>(
    kv: &mut dyn AttentionKv,
    layer: usize,
    rows: &[usize],
    zero: impl Fn() -> Result<[Array; N], ModelError>,
) -> Result<[Array; N], ModelError> {
    let mut slots: [Vec<Array>; N] = std::array::from_fn(|_| Vec::with_capacity(rows.len()));
    for &row in rows {
        let state: [Array; N] = match kv.read_state(layer, row)? {
            Some(st) => st.try_into().map_err(|st: Vec<Array>| {
                ModelError::Config(format!(
                    "layer {layer}: a recurrent state of {} arrays, want {N}",
                    st.len()
                ))
            })?,
            None => zero()?,
        };
        for (slot, a) in slots.iter_mut().zip(state) {
            slot.push(a);
        }
    }
    let joined = slots
        .iter()
        .map(|s| join(s))
        .collect::<Result<Vec<_>, _>>()?;
    joined
        .try_into()
        .map_err(|_| ModelError::Config(format!("layer {layer}: no rows")))
}

/// Checks each `(name, array, want)`: the array under `{path}.{name}` has
/// shape `want`.
///
/// # Errors
/// [`ModelError::Config`] naming the first that does not.
pub(crate) fn check_shapes(
    path: &str,
    checks: &[(&str, &Array, Vec<i32>)],
) -> Result<(), ModelError> {
    for (name, a, want) in checks {
        if a.shape() != *want {
            return Err(ModelError::Config(format!(
                "{path}.{name} has shape {:?}, want {want:?}",
                a.shape()
            )));
        }
    }
    Ok(())
}

/// Writes each of `rows`' state after its real tokens: row `i` gets slice
/// `i` (axis 0) of every array of `states` (`[rows, ...]`).
///
/// # Errors
/// The KV view's errors; MLX errors.
pub(crate) fn write_states(
    kv: &mut dyn AttentionKv,
    layer: usize,
    rows: &[usize],
    states: &[Array],
) -> Result<(), ModelError> {
    for (i, &row) in rows.iter().enumerate() {
        let i = i as i32;
        let own = states
            .iter()
            .map(|x| {
                let mut hi = x.shape().to_vec();
                let mut lo = vec![0; hi.len()];
                lo[0] = i;
                hi[0] = i + 1;
                Ok(x.slice(&lo, &hi)?)
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        kv.write_state(layer, row, own)?;
    }
    Ok(())
}

/// Tokens `start..start + rows · len` of a packed `[1, tokens, width]`
/// as `[rows, len, width]`.
///
/// # Errors
/// MLX errors (a span outside `x`).
pub(crate) fn rows_span(
    x: &Array,
    start: usize,
    rows: usize,
    len: usize,
) -> Result<Array, ModelError> {
    let width = x.shape().last().copied().unwrap_or(0);
    let (from, n, l) = (start as i32, rows as i32, len as i32);
    Ok(x.slice(&[0, from, 0], &[1, from + n * l, width])?
        .reshape(&[n, l, width])?)
}

/// A depthwise causal convolution over time, continuing from `state` (the
/// previous `kernel - 1` inputs, `[rows, kernel - 1, channels]`): `input`
/// `[rows, len, channels]`, `weight` `[channels, kernel, 1]`, an optional
/// `bias` `[channels]`, SiLU after. Returns the output `[rows, len,
/// channels]` and the state after the inputs (their last `kernel - 1`).
///
/// # Errors
/// MLX errors.
pub(crate) fn causal_conv(
    state: &Array,
    input: &Array,
    weight: &Array,
    bias: Option<&Array>,
) -> Result<(Array, Array), ModelError> {
    let (n, k1) = (state.shape()[0], state.shape()[1]);
    let (l, c) = (input.shape()[1], input.shape()[2]);
    let all = mlxcel_mlx::concatenate(&[state, input], 1)?;
    let next = all.slice(&[0, l, 0], &[n, l + k1, c])?;
    let mut out = all.depthwise_conv1d(weight)?;
    if let Some(b) = bias {
        out = out.add(b)?;
    }
    Ok((out.silu()?, next))
}
