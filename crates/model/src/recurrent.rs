//! What the recurrent token mixers (Gated DeltaNet, Mamba2) share: how a
//! step's packed rows are run (decode rows batched, prompt rows alone
//! over their real tokens) and how each row's state is read from and
//! written to the KV view ([`AttentionKv::read_state`],
//! [`AttentionKv::write_state`]).

use mlxcel_kv::AttentionKv;
use mlxcel_mlx::{Array, Dtype};

use crate::layers::LoadContext;
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

/// The depthwise convolution weight `{path}.conv1d.weight` of `channels`
/// filters of width `kernel`, as MLX's `Conv1d` lays it out: `[channels,
/// kernel, 1]`; Hugging Face's `[channels, 1, kernel]` is transposed.
///
/// # Errors
/// A missing tensor; any other shape ([`ModelError::Config`]).
pub(crate) fn load_conv_weight(
    ctx: &mut LoadContext<'_>,
    path: &str,
    channels: usize,
    kernel: usize,
) -> Result<Array, ModelError> {
    let (channels, kernel) = (channels as i32, kernel as i32);
    let mut weight = ctx.float(&format!("{path}.conv1d.weight"))?;
    if weight.shape() == [channels, 1, kernel] {
        weight = weight.transpose(&[0, 2, 1])?;
    }
    if weight.shape() != [channels, kernel, 1] {
        return Err(ModelError::Config(format!(
            "{path}.conv1d.weight has shape {:?}, want [{channels}, {kernel}, 1]",
            weight.shape()
        )));
    }
    Ok(weight.contiguous()?)
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

/// Writes each of `rows`' state after its real tokens: row `i` gets row
/// `i` (axis 0) of every array of `states` (`[rows, ...]`). One row's
/// arrays are kept as they are; several rows' (a decode batch) are views
/// of the batch's arrays (no copy, no extra kernel per row): every row
/// keeps its newest entries, so the batch buffer would be kept whole
/// anyway, but a prefix-cache snapshot taken from a batched decode step
/// keeps its step's whole buffer alive until it is evicted.
///
/// # Errors
/// The KV view's errors; MLX errors.
pub(crate) fn write_states(
    kv: &mut dyn AttentionKv,
    layer: usize,
    rows: &[usize],
    states: &[Array],
) -> Result<(), ModelError> {
    if let [row] = rows {
        return Ok(kv.write_state(layer, *row, states.to_vec())?);
    }
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
    let (k1, l) = (state.shape()[1], input.shape()[1]);
    let all = mlxcel_mlx::concatenate(&[state, input], 1)?;
    // Gathered, not sliced: the state is kept after the step and must not
    // hold `all`'s buffer (`[rows, len + kernel - 1, channels]`).
    let last: Vec<i32> = (l..l + k1).collect();
    let next = all.take(&Array::from_i32(&last, &[k1])?, 1)?;
    let mut out = all.depthwise_conv1d(weight)?;
    if let Some(b) = bias {
        out = out.add(b)?;
    }
    Ok((out.silu()?, next))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A prompt chunk's convolution state owns a buffer of its own size:
    /// it does not keep the chunk's input alive.
    #[test]
    fn a_kept_convolution_state_does_not_pin_the_chunk() {
        let (len, channels, kernel) = (1024, 64, 4);
        let ones =
            |shape: &[i32]| mlxcel_mlx::zeros(shape, Dtype::Float32)?.add(&Array::scalar(1.0)?);
        let state = mlxcel_mlx::zeros(&[1, kernel - 1, channels], Dtype::Float32).unwrap();
        let input = ones(&[1, len, channels]).unwrap();
        let weight = ones(&[channels, kernel, 1]).unwrap();
        let (out, next) = causal_conv(&state, &input, &weight, None).unwrap();
        assert_eq!(out.shape(), vec![1, len, channels]);
        assert_eq!(next.shape(), vec![1, kernel - 1, channels]);
        assert_eq!(next.to_vec_f32().unwrap(), vec![1.0; 3 * 64]);
        let whole = (len + kernel - 1) as usize * channels as usize * 4;
        let own = next.buffer_bytes().unwrap();
        assert!(own < whole / 8, "state buffer {own} bytes of {whole}");
    }
}
