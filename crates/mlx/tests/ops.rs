//! Values of the bridged operations, checked against hand-computed results.

use mlxcel_mlx::{scaled_dot_product_attention, Array, AttentionMask, Dtype};

fn close(a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() <= tol, "{a:?} vs {b:?}");
    }
}

#[test]
fn matmul_and_elementwise() {
    let a = Array::from_f32(&[1., 2., 3., 4., 5., 6.], &[2, 3]).unwrap();
    let b = Array::from_f32(&[1., 0., 0., 1., 1., 1.], &[3, 2]).unwrap();
    let c = a.matmul(&b).unwrap();
    assert_eq!(c.shape(), vec![2, 2]);
    assert_eq!(c.to_vec_f32().unwrap(), vec![4., 5., 10., 11.]);
    let s = c.add(&Array::scalar(1.0).unwrap()).unwrap();
    assert_eq!(s.to_vec_f32().unwrap(), vec![5., 6., 11., 12.]);
    let silu = Array::from_f32(&[0.0, 1.0], &[2]).unwrap().silu().unwrap();
    close(&silu.to_vec_f32().unwrap(), &[0.0, 0.731_058_6], 1e-6);
}

#[test]
fn take_slice_concat_argmax() {
    let table = Array::from_f32(&[0., 1., 10., 11., 20., 21.], &[3, 2]).unwrap();
    let ids = Array::from_u32(&[2, 0], &[2]).unwrap();
    let rows = table.take(&ids, 0).unwrap();
    assert_eq!(rows.to_vec_f32().unwrap(), vec![20., 21., 0., 1.]);
    let tail = table.slice(&[1, 1], &[3, 2]).unwrap();
    assert_eq!(tail.to_vec_f32().unwrap(), vec![11., 21.]);
    let cat = mlxcel_mlx::concatenate(&[&rows, &table], 0).unwrap();
    assert_eq!(cat.shape(), vec![5, 2]);
    let upd = table
        .slice_update(
            &Array::from_f32(&[7., 8.], &[1, 2]).unwrap(),
            &[1, 0],
            &[2, 2],
        )
        .unwrap();
    assert_eq!(upd.to_vec_f32().unwrap(), vec![0., 1., 7., 8., 20., 21.]);
    let am = Array::from_f32(&[1., 3., 3., 0.], &[1, 4])
        .unwrap()
        .argmax(-1, false)
        .unwrap();
    assert_eq!(am.to_vec_u32().unwrap(), vec![1], "first index of the max");
}

#[test]
fn rms_norm_matches_formula() {
    let x = Array::from_f32(&[1., 2., 3., 4.], &[1, 4]).unwrap();
    let w = Array::from_f32(&[1., 1., 2., 2.], &[4]).unwrap();
    let y = x.rms_norm(&w, 1e-5).unwrap().to_vec_f32().unwrap();
    let rms = ((1. + 4. + 9. + 16.) / 4.0f32 + 1e-5).sqrt();
    close(&y, &[1. / rms, 2. / rms, 6. / rms, 8. / rms], 1e-5);
}

#[test]
fn rope_rotates_pairs_by_position() {
    // head_dim 2, non-traditional: (x0, x1) rotated by angle pos * base^0 = pos.
    let x = Array::from_f32(&[1., 0., 1., 0.], &[1, 1, 2, 2]).unwrap();
    let y = x.rope(2, false, 10000.0, 1.0, 3).unwrap();
    let v = y.to_vec_f32().unwrap();
    close(&v, &[3f32.cos(), 3f32.sin(), 4f32.cos(), 4f32.sin()], 1e-5);
    let offsets = Array::from_i32(&[3], &[1]).unwrap();
    let z = x.rope_at(2, false, 10000.0, 1.0, &offsets).unwrap();
    close(&z.to_vec_f32().unwrap(), &v, 1e-6);
}

#[test]
fn sdpa_causal_matches_manual() {
    // One head, 2 queries, 2 keys, head_dim 1: causal means query 0 sees key 0 only.
    let q = Array::from_f32(&[1., 1.], &[1, 1, 2, 1]).unwrap();
    let k = Array::from_f32(&[0., 1.], &[1, 1, 2, 1]).unwrap();
    let v = Array::from_f32(&[10., 20.], &[1, 1, 2, 1]).unwrap();
    let out = scaled_dot_product_attention(&q, &k, &v, 1.0, &AttentionMask::Causal)
        .unwrap()
        .to_vec_f32()
        .unwrap();
    let p1 = 1f32.exp() / (1.0 + 1f32.exp());
    close(&out, &[10.0, 10.0 * (1.0 - p1) + 20.0 * p1], 1e-5);
    let full = scaled_dot_product_attention(&q, &k, &v, 1.0, &AttentionMask::None)
        .unwrap()
        .to_vec_f32()
        .unwrap();
    close(&full, &[10.0 * (1.0 - p1) + 20.0 * p1; 2], 1e-5);
}

#[test]
fn quantized_matmul_equals_dequantized_dense() {
    // Build a quantized weight by hand: 4-bit, group 32, 2 output rows, 32 inputs.
    // Packed: 8 nibbles per uint32, little end first; value q at column j.
    let mut packed = Vec::new();
    for row in 0..2u32 {
        for word in 0..4u32 {
            let mut w = 0u32;
            for n in 0..8u32 {
                let q = (row * 3 + word * 8 + n) % 16;
                w |= q << (4 * n);
            }
            packed.push(w);
        }
    }
    let w = Array::from_u32(&packed, &[2, 4]).unwrap();
    let scales = Array::from_f32(&[0.5, 0.25], &[2, 1]).unwrap();
    let biases = Array::from_f32(&[-1.0, 2.0], &[2, 1]).unwrap();
    let dense = w.dequantize(&scales, &biases, 32, 4).unwrap();
    assert_eq!(dense.shape(), vec![2, 32]);
    let d = dense.to_vec_f32().unwrap();
    assert_eq!(d[0], -1.0); // q=0
    assert_eq!(d[32 + 1], 0.25 * 4.0 + 2.0); // row 1, col 1: q = 3 + 1 = 4
    let x: Vec<f32> = (0..32).map(|i| i as f32 / 10.0).collect();
    let x = Array::from_f32(&x, &[1, 32]).unwrap();
    let qm = x
        .quantized_matmul(&w, &scales, &biases, true, 32, 4)
        .unwrap()
        .to_vec_f32()
        .unwrap();
    let dm = x.matmul(&dense.t().unwrap()).unwrap().to_vec_f32().unwrap();
    close(&qm, &dm, 1e-3);
}

#[test]
fn quantize_round_trips_within_one_step_and_refuses_a_partial_group() {
    // 3 rows of 64, two groups of 32 each.
    let v: Vec<f32> = (0..192)
        .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
        .collect();
    let w = Array::from_f32(&v, &[3, 64]).unwrap();
    for bits in [4, 8] {
        let (q, scales, biases) = w.quantize(32, bits).unwrap();
        assert_eq!(q.dtype(), Dtype::Uint32);
        assert_eq!(q.shape(), vec![3, 64 * bits / 32]);
        assert_eq!(scales.shape(), vec![3, 2]);
        assert_eq!(biases.shape(), vec![3, 2]);
        let back = q.dequantize(&scales, &biases, 32, bits).unwrap();
        let back = back.to_vec_f32().unwrap();
        let steps = scales.to_vec_f32().unwrap();
        for (i, (a, b)) in v.iter().zip(&back).enumerate() {
            // MLX may pick a negative scale (the group anchored at its max).
            let step = steps[(i / 64) * 2 + (i % 64) / 32].abs();
            // Half a step of rounding, plus up to half a step where MLX
            // moves the grid so that the group's edge falls on it.
            assert!((a - b).abs() <= step + 1e-6, "bits {bits}, {i}: {a} vs {b}");
        }
    }
    let odd = Array::from_f32(&[0.0; 48], &[1, 48]).unwrap();
    assert!(
        odd.quantize(32, 4).is_err(),
        "48 columns are not whole groups of 32"
    );
}

#[test]
fn dtype_roundtrip_and_safetensors() {
    let a = Array::from_f32(&[1.5, -2.0], &[2]).unwrap();
    let h = a.astype(Dtype::Float16).unwrap();
    assert_eq!(h.dtype(), Dtype::Float16);
    assert_eq!(h.nbytes(), 4);
    let dir = std::env::temp_dir().join(format!("mlxcel-st-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.safetensors");
    mlxcel_mlx::save_safetensors(&path, &[("a".into(), &a), ("h".into(), &h)]).unwrap();
    let mut st = mlxcel_mlx::SafeTensors::load(&path).unwrap();
    let mut names = st.names();
    names.sort();
    assert_eq!(names, vec!["a", "h"]);
    assert_eq!(st.take("h").unwrap().to_vec_f32().unwrap(), vec![1.5, -2.0]);
    assert!(st.take("h").is_err(), "taken twice");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Single-row and single-column products go through the GEMV forwarding of
/// `src/gemv_forward.cc`; every operand layout must equal the exact product.
#[test]
fn matmul_single_row_and_column_all_layouts() {
    assert!(
        mlxcel_mlx::gemv_forwarding_active(),
        "cblas_sgemm does not resolve to the forwarder in this binary"
    );
    let (k, n) = (37usize, 19usize);
    let a: Vec<f32> = (0..k).map(|i| (i as f32 * 0.37).sin()).collect();
    let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
    // Exact y[j] = sum_i a[i] * b[i, j] in f64.
    let want: Vec<f32> = (0..n)
        .map(|j| {
            (0..k)
                .map(|i| a[i] as f64 * b[i * n + j] as f64)
                .sum::<f64>() as f32
        })
        .collect();
    let row = Array::from_f32(&a, &[1, k as i32]).unwrap();
    let col = Array::from_f32(&a, &[k as i32, 1]).unwrap();
    let bm = Array::from_f32(&b, &[k as i32, n as i32]).unwrap();
    let bt = bm.t().unwrap().contiguous().unwrap(); // [n, k] row-major
                                                    // m = 1: b plain and b transposed (a strided view of bt).
    close(&row.matmul(&bm).unwrap().to_vec_f32().unwrap(), &want, 1e-4);
    close(
        &row.matmul(&bt.t().unwrap()).unwrap().to_vec_f32().unwrap(),
        &want,
        1e-4,
    );
    // m = 1 with a transposed operand: colᵀ is a [1, k] strided view.
    close(
        &col.t().unwrap().matmul(&bm).unwrap().to_vec_f32().unwrap(),
        &want,
        1e-4,
    );
    // n = 1: bt [n, k] @ a [k, 1] = y, and the transposed-a layout.
    close(&bt.matmul(&col).unwrap().to_vec_f32().unwrap(), &want, 1e-4);
    close(
        &bm.t().unwrap().matmul(&col).unwrap().to_vec_f32().unwrap(),
        &want,
        1e-4,
    );
    close(
        &bt.matmul(&row.t().unwrap()).unwrap().to_vec_f32().unwrap(),
        &want,
        1e-4,
    );
}

/// Products of 2 to `skinny_max_rows()` rows (48 with AVX-512, 8 with
/// AVX2) against a `[n, k]` weight go to the skinny GEMM of
/// `src/skinny_gemm.cc` (more rows to BLAS): every row equals the exact
/// product, and a row's output is bit for bit the same whatever the
/// number of rows beside it. `k` leaves a remainder after the 16- and
/// 8-lane sums, and `n` (266 x 1,203 weights: two parts of 134 and 132
/// columns on two or more cores) spans several weight-row blocks, a
/// column tail and the thread split.
#[test]
fn skinny_products_are_exact_and_independent_of_the_row_count() {
    assert!(mlxcel_mlx::gemv_forwarding_active());
    let skinny = mlxcel_mlx::skinny_max_rows();
    #[cfg(target_arch = "x86_64")]
    assert!(
        skinny >= 8,
        "AVX2 at least on the machines we test on: {skinny}"
    );
    #[cfg(target_arch = "x86_64")]
    if std::env::var("MLXCEL_SKINNY_AVX512").as_deref() == Ok("0") {
        assert_eq!(skinny, 8, "AVX2 kernels only");
    }
    let (k, n, rows) = (1_203usize, 266usize, skinny + 4);
    let a: Vec<f32> = (0..rows * k).map(|i| (i as f32 * 0.37).sin()).collect();
    let w: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.11).cos()).collect();
    let wm = Array::from_f32(&w, &[n as i32, k as i32]).unwrap();
    let exact: Vec<f32> = (0..rows * n)
        .map(|i| {
            let (r, j) = (i / n, i % n);
            (0..k)
                .map(|p| a[r * k + p] as f64 * w[j * k + p] as f64)
                .sum::<f64>() as f32
        })
        .collect();
    let mut first: Vec<Vec<f32>> = Vec::new();
    for m in 2..=rows {
        let x = Array::from_f32(&a[..m * k], &[m as i32, k as i32]).unwrap();
        let y = x.matmul(&wm.t().unwrap()).unwrap().to_vec_f32().unwrap();
        for r in 0..m {
            let row = &y[r * n..(r + 1) * n];
            close(row, &exact[r * n..(r + 1) * n], 1e-3);
            if m <= skinny {
                match first.get(r) {
                    Some(seen) => assert!(
                        seen.iter()
                            .zip(row)
                            .all(|(s, v)| s.to_bits() == v.to_bits()),
                        "row {r} differs at m = {m}"
                    ),
                    None => first.push(row.to_vec()),
                }
            }
        }
    }
}

/// The AVX2 kernels, which an AVX-512 machine never picks: the test above
/// again in a child process told to keep to them (`MLXCEL_SKINNY_AVX512=0`,
/// read once per process).
#[test]
#[cfg(target_arch = "x86_64")]
fn skinny_products_through_the_avx2_kernels() {
    let name = "skinny_products_are_exact_and_independent_of_the_row_count";
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--test-threads=1"])
        .env("MLXCEL_SKINNY_AVX512", "0")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn version_and_device_names() {
    // The version of the libmlx this test links (the project's pinned one).
    let version = mlxcel_mlx::version();
    assert!(
        version.split('.').count() >= 3 && version.starts_with("0."),
        "{version}"
    );
    let cpu = mlxcel_mlx::device_name(false).unwrap();
    assert!(!cpu.trim().is_empty());
    #[cfg(target_arch = "x86_64")]
    assert!(cpu.ends_with("(x86_64)"), "{cpu}");
    // Asking for a GPU that is not there is an error, not a crash.
    assert_eq!(
        mlxcel_mlx::device_name(true).is_ok(),
        mlxcel_mlx::gpu_available()
    );
}

/// Mamba2's scan over two tokens, one row, two heads sharing one group
/// (state 2, head size 1), against the recurrence written out by hand:
/// `Δ = clip(softplus(dt + dt_bias))`, `S = exp(-exp(a_log) Δ) S + Δ x b`,
/// `y = S · c + d x`; heads that are not a multiple of the groups are an
/// error, not a crash.
#[test]
fn ssm_scan_matches_the_recurrence_and_refuses_bad_groups() {
    let softplus = |v: f32| (1.0 + v.exp()).ln();
    let (xs, dts) = ([[0.5f32, -1.0], [2.0, 0.25]], [[0.3f32, -0.7], [1.2, 0.1]]);
    let (bs, cs) = ([[1.0f32, -2.0], [0.5, 0.75]], [[0.2f32, 0.4], [-1.0, 3.0]]);
    let (a_log, d, dt_bias) = ([0.1f32, -0.3], [0.9f32, 1.1], [0.05f32, -0.2]);
    let init = [[0.1f32, -0.2], [0.3, 0.4]]; // [head][state]
    let mut s = init;
    let mut want_y = Vec::new();
    for t in 0..2 {
        for h in 0..2 {
            let dt = softplus(dts[t][h] + dt_bias[h]).clamp(0.001, 100.0);
            let decay = (-a_log[h].exp() * dt).exp();
            let mut y = 0.0;
            for i in 0..2 {
                s[h][i] = decay * s[h][i] + dt * xs[t][h] * bs[t][i];
                y += s[h][i] * cs[t][i];
            }
            want_y.push(y + d[h] * xs[t][h]);
        }
    }
    let flat = |v: &[[f32; 2]; 2]| v.iter().flatten().copied().collect::<Vec<_>>();
    let x = Array::from_f32(&flat(&xs), &[1, 2, 2, 1]).unwrap();
    let dt = Array::from_f32(&flat(&dts), &[1, 2, 2]).unwrap();
    let b = Array::from_f32(&flat(&bs), &[1, 2, 1, 2]).unwrap();
    let c = Array::from_f32(&flat(&cs), &[1, 2, 1, 2]).unwrap();
    let a_log = Array::from_f32(&a_log, &[2]).unwrap();
    let d = Array::from_f32(&d, &[2]).unwrap();
    let dt_bias = Array::from_f32(&dt_bias, &[2]).unwrap();
    let state = Array::from_f32(&flat(&init), &[1, 2, 1, 2]).unwrap();
    let (y, next) = mlxcel_mlx::ssm_scan(
        &x,
        &dt,
        &b,
        &c,
        &a_log,
        &d,
        &dt_bias,
        (0.001, 100.0),
        &state,
    )
    .unwrap();
    assert_eq!(y.shape(), vec![1, 2, 2, 1]);
    close(&y.to_vec_f32().unwrap(), &want_y, 1e-5);
    close(&next.to_vec_f32().unwrap(), &flat(&s), 1e-5);
    // Three heads cannot share two groups.
    let x3 = mlxcel_mlx::zeros(&[1, 2, 3, 1], mlxcel_mlx::Dtype::Float32).unwrap();
    let b2 = mlxcel_mlx::zeros(&[1, 2, 2, 2], mlxcel_mlx::Dtype::Float32).unwrap();
    let h3 = mlxcel_mlx::zeros(&[3], mlxcel_mlx::Dtype::Float32).unwrap();
    let s3 = mlxcel_mlx::zeros(&[1, 3, 1, 2], mlxcel_mlx::Dtype::Float32).unwrap();
    let dt3 = mlxcel_mlx::zeros(&[1, 2, 3], mlxcel_mlx::Dtype::Float32).unwrap();
    assert!(mlxcel_mlx::ssm_scan(&x3, &dt3, &b2, &b2, &h3, &h3, &h3, (0.001, 100.0), &s3).is_err());
}

#[test]
fn raw_bytes_round_trip_without_conversion() {
    // 1.5 and -2.0 as bfloat16: 0x3fc0 and 0xc000, little-endian.
    let a = Array::from_f32(&[1.5, -2.0, 0.25, 8.0], &[2, 2])
        .unwrap()
        .astype(Dtype::Bfloat16)
        .unwrap();
    let bytes = a.to_bytes().unwrap();
    assert_eq!(&bytes[..4], &[0xc0, 0x3f, 0x00, 0xc0]);
    assert_eq!(bytes.len(), 8);
    let back = Array::from_bytes(&bytes, &[2, 2], Dtype::Bfloat16).unwrap();
    assert_eq!(back.dtype(), Dtype::Bfloat16);
    assert_eq!(back.shape(), vec![2, 2]);
    assert_eq!(
        back.astype(Dtype::Float32).unwrap().to_vec_f32().unwrap(),
        vec![1.5, -2.0, 0.25, 8.0]
    );
    // A strided view reads out in row-major order.
    let t = Array::from_f32(&[1.0, 2.0, 3.0, 4.0], &[2, 2])
        .unwrap()
        .transpose(&[1, 0])
        .unwrap();
    let tb = t.to_bytes().unwrap();
    let floats: Vec<f32> = tb
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(floats, vec![1.0, 3.0, 2.0, 4.0]);
    // Bytes that don't fill the shape are an error.
    assert!(Array::from_bytes(&bytes[..6], &[2, 2], Dtype::Bfloat16).is_err());
}

/// The gated products of an MLP against their definitions in plain ops
/// (SiLU: x·σ(x); GELU, tanh approximation: 0.5·x·(1 + tanh(√(2/π)(x +
/// 0.044715·x³)))), on hand-computed values and bit for bit against
/// `silu`/`gelu_tanh` times up.
#[test]
fn gated_activations() {
    let gate = Array::from_f32(&[-2.0, -0.5, 0.0, 0.5, 1.0, 3.0], &[2, 3]).unwrap();
    let up = Array::from_f32(&[1.0, 2.0, -1.0, 0.25, -3.0, 0.5], &[2, 3]).unwrap();
    let g: Vec<f32> = gate.to_vec_f32().unwrap();
    let u: Vec<f32> = up.to_vec_f32().unwrap();
    let silu: Vec<f32> = g
        .iter()
        .zip(&u)
        .map(|(&x, &y)| x / (1.0 + (-x).exp()) * y)
        .collect();
    let gelu: Vec<f32> = g
        .iter()
        .zip(&u)
        .map(|(&x, &y)| {
            let inner = (2.0f32 / std::f32::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
            0.5 * x * (1.0 + inner.tanh()) * y
        })
        .collect();
    let sw = mlxcel_mlx::swiglu(&gate, &up).unwrap();
    let ge = mlxcel_mlx::geglu_tanh(&gate, &up).unwrap();
    assert_eq!(sw.shape(), vec![2, 3]);
    close(&sw.to_vec_f32().unwrap(), &silu, 1e-6);
    close(&ge.to_vec_f32().unwrap(), &gelu, 1e-6);
    let plain_sw = gate.silu().unwrap().multiply(&up).unwrap();
    let plain_ge = gate.gelu_tanh().unwrap().multiply(&up).unwrap();
    assert_eq!(sw.to_vec_f32().unwrap(), plain_sw.to_vec_f32().unwrap());
    assert_eq!(ge.to_vec_f32().unwrap(), plain_ge.to_vec_f32().unwrap());
}
