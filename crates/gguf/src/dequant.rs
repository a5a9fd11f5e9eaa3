//! ggml's block formats decoded to float32, for the GGUF files whose
//! tensor types MLX's reader cannot read (Q5_0, Q5_1, Q5_K, BF16): such a
//! file is read tensor by tensor here instead (by `mlxcel_model::gguf`'s
//! `GgufModel`).
//!
//! Each quantized type stores a row as blocks of 32 (or, k-quants, 256
//! "super-block") elements; a block holds float16 scale(s) and the packed
//! integers, and an element is `d · q` (symmetric types: `q` centred on
//! zero) or `d · q + m` / `d · q - dmin · m` (types with a minimum). The
//! layouts are ggml's `ggml-common.h` (`block_q4_0`, ..., `block_q6_k`);
//! the decoding is its `dequantize_row_*` arithmetic, in float32.

use crate::{GgufError, TensorType};

/// Decodes one block, appending its elements.
type BlockDecoder = fn(&[u8], &mut Vec<f32>);

/// Decodes `bytes` (whole blocks of `ty`) to float32, appending to `out`.
///
/// # Errors
/// [`GgufError::NoDecoder`] for a type this module does not decode,
/// [`GgufError::PartialBlocks`] for `bytes` that are not a whole number of
/// blocks.
pub fn dequantize(ty: TensorType, bytes: &[u8], out: &mut Vec<f32>) -> Result<(), GgufError> {
    let (block_bytes, decode): (usize, BlockDecoder) = match ty.0 {
        0 => (4, |b, o| {
            o.push(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        }),
        1 => (2, |b, o| o.push(f16_at(b, 0))),
        30 => (2, |b, o| {
            o.push(f32::from_bits(
                u32::from(u16::from_le_bytes([b[0], b[1]])) << 16,
            ))
        }),
        2 => (18, q4_0),
        3 => (20, q4_1),
        6 => (22, q5_0),
        7 => (24, q5_1),
        8 => (34, q8_0),
        12 => (144, q4_k),
        13 => (176, q5_k),
        14 => (210, q6_k),
        _ => return Err(GgufError::NoDecoder(ty)),
    };
    if !bytes.len().is_multiple_of(block_bytes) {
        return Err(GgufError::PartialBlocks {
            bytes: bytes.len(),
            ty,
            block_bytes,
        });
    }
    out.reserve(bytes.len() / block_bytes * elements_per_block(ty));
    for block in bytes.chunks_exact(block_bytes) {
        decode(block, out);
    }
    Ok(())
}

/// Whether [`dequantize`] decodes `ty`.
pub fn decodes(ty: TensorType) -> bool {
    matches!(ty.0, 0 | 1 | 2 | 3 | 6 | 7 | 8 | 12 | 13 | 14 | 30)
}

fn elements_per_block(ty: TensorType) -> usize {
    match ty.0 {
        0 | 1 | 30 => 1,
        12..=14 => 256,
        _ => 32,
    }
}

/// The IEEE half-precision number at `b[at..at + 2]` (little-endian).
fn f16_at(b: &[u8], at: usize) -> f32 {
    let h = u16::from_le_bytes([b[at], b[at + 1]]);
    let sign = u32::from(h >> 15) << 31;
    let exp = u32::from((h >> 10) & 0x1f);
    let frac = u32::from(h & 0x3ff);
    let bits = match (exp, frac) {
        (0, 0) => sign,
        // Subnormal: frac · 2^-24, exact in float32.
        (0, _) => {
            let v = frac as f32 * (-24f32).exp2();
            return if sign == 0 { v } else { -v };
        }
        (0x1f, _) => sign | 0x7f80_0000 | (frac << 13),
        _ => sign | ((exp + 127 - 15) << 23) | (frac << 13),
    };
    f32::from_bits(bits)
}

/// 32 elements: `d` (f16), 16 bytes of 4-bit `q` (low nibbles are
/// elements 0..16, high nibbles 16..32); `x = d · (q - 8)`.
fn q4_0(b: &[u8], out: &mut Vec<f32>) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    out.extend(qs.iter().map(|q| (i32::from(q & 0xf) - 8) as f32 * d));
    out.extend(qs.iter().map(|q| (i32::from(q >> 4) - 8) as f32 * d));
}

/// 32 elements: `d`, `m` (f16), 16 bytes of 4-bit `q`; `x = d · q + m`.
fn q4_1(b: &[u8], out: &mut Vec<f32>) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qs = &b[4..20];
    out.extend(qs.iter().map(|q| f32::from(q & 0xf) * d + m));
    out.extend(qs.iter().map(|q| f32::from(q >> 4) * d + m));
}

/// The 5-bit values of a Q5_0/Q5_1 block: 4-bit `qs` plus bit `j` of
/// the 32-bit `qh` as the fifth bit of element `j`.
fn q5_values(qh: &[u8], qs: &[u8]) -> [u8; 32] {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let mut v = [0u8; 32];
    for (j, q) in qs.iter().enumerate() {
        let high = |bit: usize| (((qh >> bit) & 1) as u8) << 4;
        v[j] = (q & 0xf) | high(j);
        v[j + 16] = (q >> 4) | high(j + 16);
    }
    v
}

/// 32 elements: `d`, 4 bytes of high bits, 16 bytes of low nibbles;
/// `x = d · (q - 16)`.
fn q5_0(b: &[u8], out: &mut Vec<f32>) {
    let d = f16_at(b, 0);
    let v = q5_values(&b[2..6], &b[6..22]);
    out.extend(v.iter().map(|&q| (i32::from(q) - 16) as f32 * d));
}

/// 32 elements: `d`, `m`, 4 bytes of high bits, 16 bytes of low nibbles;
/// `x = d · q + m`.
fn q5_1(b: &[u8], out: &mut Vec<f32>) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let v = q5_values(&b[4..8], &b[8..24]);
    out.extend(v.iter().map(|&q| f32::from(q) * d + m));
}

/// 32 elements: `d`, 32 signed bytes; `x = d · q`.
fn q8_0(b: &[u8], out: &mut Vec<f32>) {
    let d = f16_at(b, 0);
    out.extend(b[2..34].iter().map(|&q| f32::from(q as i8) * d));
}

/// The 6-bit scale and minimum of sub-block `j` (0..8) of a Q4_K/Q5_K
/// super-block, packed in 12 bytes.
fn scale_min_k4(j: usize, s: &[u8]) -> (f32, f32) {
    let (sc, m) = if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    };
    (f32::from(sc), f32::from(m))
}

/// 256 elements: `d`, `dmin` (f16), 12 bytes of sub-block scales and
/// minimums, 128 bytes of 4-bit `q` (each 32 bytes: 32 elements in the
/// low nibbles, the next 32 in the high ones);
/// `x = d · sc · q - dmin · m` per sub-block of 32.
fn q4_k(b: &[u8], out: &mut Vec<f32>) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    for (chunk, qs) in b[16..144].chunks_exact(32).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, m1, d2, m2) = (d * sc1, dmin * m1, d * sc2, dmin * m2);
        out.extend(qs.iter().map(|q| d1 * f32::from(q & 0xf) - m1));
        out.extend(qs.iter().map(|q| d2 * f32::from(q >> 4) - m2));
    }
}

/// 256 elements: as Q4_K with a fifth bit per element from 32 bytes of
/// high bits (bit `2c` of byte `l` for element `l` of the low-nibble half
/// of chunk `c`, bit `2c + 1` for the high-nibble half).
fn q5_k(b: &[u8], out: &mut Vec<f32>) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qh = &b[16..48];
    for (chunk, qs) in b[48..176].chunks_exact(32).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * chunk, scales);
        let (sc2, m2) = scale_min_k4(2 * chunk + 1, scales);
        let (d1, m1, d2, m2) = (d * sc1, dmin * m1, d * sc2, dmin * m2);
        let (lo, hi) = (1u8 << (2 * chunk), 1u8 << (2 * chunk + 1));
        let high = |h: u8, bit: u8| if h & bit != 0 { 16.0 } else { 0.0 };
        out.extend(
            qs.iter()
                .zip(qh)
                .map(|(q, &h)| d1 * (f32::from(q & 0xf) + high(h, lo)) - m1),
        );
        out.extend(
            qs.iter()
                .zip(qh)
                .map(|(q, &h)| d2 * (f32::from(q >> 4) + high(h, hi)) - m2),
        );
    }
}

/// 256 elements: 128 bytes of low nibbles, 64 bytes of 2-bit high parts,
/// 16 signed 8-bit scales (one per 16 elements), then `d` (f16);
/// `x = d · scale · (q - 32)`, in two halves of 128.
fn q6_k(b: &[u8], out: &mut Vec<f32>) {
    let d = f16_at(b, 208);
    let start = out.len();
    out.resize(start + 256, 0.0);
    let y = &mut out[start..];
    for half in 0..2 {
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..128 + 32 * half + 32];
        let sc = &b[192 + 8 * half..192 + 8 * half + 8];
        let y = &mut y[128 * half..128 * half + 128];
        for l in 0..32 {
            let is = l / 16;
            let q = |low: u8, shift: u32| {
                (i32::from(low) | (i32::from((qh[l] >> shift) & 3) << 4)) - 32
            };
            let scale = |k: usize| d * f32::from(sc[is + k] as i8);
            y[l] = scale(0) * q(ql[l] & 0xf, 0) as f32;
            y[l + 32] = scale(2) * q(ql[l + 32] & 0xf, 2) as f32;
            y[l + 64] = scale(4) * q(ql[l] >> 4, 4) as f32;
            y[l + 96] = scale(6) * q(ql[l + 32] >> 4, 6) as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16_bytes(v: f32) -> [u8; 2] {
        // Exact for the small powers of two and halves used below.
        let bits = v.to_bits();
        let sign = ((bits >> 16) & 0x8000) as u16;
        let exp = ((bits >> 23) & 0xff) as i32 - 127 + 15;
        let frac = ((bits >> 13) & 0x3ff) as u16;
        let h = if v == 0.0 {
            sign
        } else {
            sign | ((exp as u16) << 10) | frac
        };
        h.to_le_bytes()
    }

    #[test]
    fn half_precision_decodes_normals_subnormals_and_signs() {
        assert_eq!(f16_at(&0x3c00u16.to_le_bytes(), 0), 1.0);
        assert_eq!(f16_at(&0xc000u16.to_le_bytes(), 0), -2.0);
        assert_eq!(f16_at(&0x3555u16.to_le_bytes(), 0), 0.333_251_95);
        assert_eq!(f16_at(&0x0001u16.to_le_bytes(), 0), 2f32.powi(-24));
        assert_eq!(f16_at(&0x8001u16.to_le_bytes(), 0), -(2f32.powi(-24)));
        assert!(f16_at(&0x7c00u16.to_le_bytes(), 0).is_infinite());
    }

    #[test]
    fn q5_0_puts_the_fifth_bit_of_element_j_at_bit_j() {
        // d = 0.5; every low nibble 3 (element j) and 12 (element j + 16);
        // high bits set for elements 0 and 17.
        let mut b = Vec::new();
        b.extend(f16_bytes(0.5));
        b.extend((1u32 | 1 << 17).to_le_bytes());
        b.extend([0xc3u8; 16]);
        let mut out = Vec::new();
        dequantize(TensorType(6), &b, &mut out).unwrap();
        assert_eq!(out.len(), 32);
        assert_eq!(out[0], (19.0 - 16.0) * 0.5);
        assert_eq!(out[1], (3.0 - 16.0) * 0.5);
        assert_eq!(out[16], (12.0 - 16.0) * 0.5);
        assert_eq!(out[17], (28.0 - 16.0) * 0.5);
    }

    #[test]
    fn q4_k_applies_each_sub_block_scale_and_minimum() {
        // d = 1, dmin = 0.5; sub-block scales 1..8 and minimums 2 (the
        // packed 6-bit layout), every nibble pair 0x21 (low 1, high 2).
        let mut b = Vec::new();
        b.extend(f16_bytes(1.0));
        b.extend(f16_bytes(0.5));
        let (sc, m): ([u8; 8], [u8; 8]) = ([1, 2, 3, 4, 5, 6, 7, 8], [2; 8]);
        let mut s = [0u8; 12];
        for j in 0..4 {
            s[j] = sc[j];
            s[j + 4] = m[j];
            s[j + 8] = (sc[j + 4] & 0xf) | ((m[j + 4] & 0xf) << 4);
        }
        b.extend(s);
        b.extend([0x21u8; 128]);
        let mut out = Vec::new();
        dequantize(TensorType(12), &b, &mut out).unwrap();
        assert_eq!(out.len(), 256);
        for j in 0..8 {
            let q = if j % 2 == 0 { 1.0 } else { 2.0 };
            let want = sc[j] as f32 * q - 0.5 * 2.0;
            assert_eq!(out[32 * j], want, "sub-block {j}");
            assert_eq!(out[32 * j + 31], want, "sub-block {j}");
        }
    }

    #[test]
    fn q6_k_centres_six_bit_values_and_reads_d_last() {
        // ql all 0x21, qh all 0b11_10_01_00: element l of each quarter gets
        // high bits 0, 1, 2, 3; scales 1..16; d = 0.25.
        let mut b = vec![0x21u8; 128];
        b.extend([0b1110_0100u8; 64]);
        b.extend((1..=16).map(|s| s as u8));
        b.extend(f16_bytes(0.25));
        let mut out = Vec::new();
        dequantize(TensorType(14), &b, &mut out).unwrap();
        assert_eq!(out.len(), 256);
        // First half: quarter 0 = low nibble 1, high 0, scale 1.
        assert_eq!(out[0], 0.25 * 1.0 * (1.0 - 32.0));
        // Quarter 1 (l + 32): low nibble 1, high 1, scale sc[2] = 3.
        assert_eq!(out[32], 0.25 * 3.0 * (17.0 - 32.0));
        // Quarter 2: high nibble 2, high 2, scale 5.
        assert_eq!(out[64], 0.25 * 5.0 * (34.0 - 32.0));
        // Quarter 3, element 16 (is = 1): nibble 2, high 3, scale sc[7] = 8.
        assert_eq!(out[96 + 16], 0.25 * 8.0 * (50.0 - 32.0));
        // Second half uses scales 9..16.
        assert_eq!(out[128], 0.25 * 9.0 * (1.0 - 32.0));
    }

    #[test]
    fn unknown_types_and_partial_blocks_are_errors() {
        let e = dequantize(TensorType(16), &[0; 66], &mut Vec::new())
            .unwrap_err()
            .to_string();
        assert!(e.contains("IQ2_XXS"), "{e}");
        let e = dequantize(TensorType(8), &[0; 35], &mut Vec::new())
            .unwrap_err()
            .to_string();
        assert!(e.contains("Q8_0"), "{e}");
    }
}
