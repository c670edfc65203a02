//! Reference quantizers (f32 -> blocks) for the types synthetic models and tests write:
//! F32, F16, BF16, Q8_0, Q4_0 — ggml's round-to-nearest `quantize_row_*_ref` rules — and Q4_K
//! with plain per-group min / max scales (ggml's reference searches for better ones; for
//! synthetic benchmark models any valid encoding serves).

use super::GgmlType;
use crate::error::{Error, Result};

/// Appends the blocks of `x` (a whole number of blocks) in format `ty` to `out`.
pub fn quantize_into(ty: GgmlType, x: &[f32], out: &mut Vec<u8>) -> Result<()> {
    if !x.len().is_multiple_of(ty.block_size()) {
        return Err(Error::shape("quantize", format!("{} values is not a multiple of the {ty} block size", x.len())));
    }
    match ty {
        GgmlType::F32 => x.iter().for_each(|v| out.extend(v.to_le_bytes())),
        GgmlType::F16 => x.iter().for_each(|v| out.extend(half::f16::from_f32(*v).to_le_bytes())),
        GgmlType::BF16 => x.iter().for_each(|v| out.extend(half::bf16::from_f32(*v).to_le_bytes())),
        GgmlType::Q8_0 => {
            for b in x.chunks_exact(32) {
                let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(half::f16::from_f32(d).to_le_bytes());
                out.extend(b.iter().map(|v| (v * id).round() as i8 as u8));
            }
        }
        GgmlType::Q4_0 => {
            for b in x.chunks_exact(32) {
                // The value of largest magnitude maps to -8, as ggml does.
                let max = b.iter().fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(half::f16::from_f32(d).to_le_bytes());
                let q = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
                out.extend((0..16).map(|j| q(b[j]) | (q(b[j + 16]) << 4)));
            }
        }
        GgmlType::Q4K => x.chunks_exact(256).for_each(|b| quantize_q4k_block(b, out)),
        other => {
            return Err(Error::Unsupported(format!(
                "quantizing to {other} (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_K)"
            )))
        }
    }
    Ok(())
}

/// One Q4_K super-block (144 bytes: d, dmin, 12 bytes of 6-bit group scales and mins, 128 bytes
/// of nibbles) for 256 values: each group of 32 gets scale (max - min) / 15 and offset -min
/// (min <= 0), rounded to 6 bits against the super-block's d = max scale / 63 and dmin = max
/// offset / 63 (as `get_scale_min_k4` unpacks them), then every value to the nearest nibble.
fn quantize_q4k_block(b: &[f32], out: &mut Vec<u8>) {
    let mut scale = [0f32; 8];
    let mut offset = [0f32; 8];
    for (g, v) in b.chunks_exact(32).enumerate() {
        let mn = v.iter().fold(0f32, |m, &x| m.min(x));
        let mx = v.iter().fold(mn, |m, &x| m.max(x));
        scale[g] = (mx - mn) / 15.0;
        offset[g] = -mn;
    }
    let d = half::f16::from_f32(scale.iter().fold(0f32, |m, &v| m.max(v)) / 63.0);
    let dmin = half::f16::from_f32(offset.iter().fold(0f32, |m, &v| m.max(v)) / 63.0);
    let q6 = |v: f32, unit: f32| if unit > 0.0 { (v / unit).round().clamp(0.0, 63.0) as u8 } else { 0 };
    let sc: Vec<u8> = scale.iter().map(|&v| q6(v, d.to_f32())).collect();
    let m: Vec<u8> = offset.iter().map(|&v| q6(v, dmin.to_f32())).collect();
    out.extend(d.to_le_bytes());
    out.extend(dmin.to_le_bytes());
    let mut s = [0u8; 12];
    for j in 0..4 {
        s[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        s[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
        s[j + 8] = (sc[j + 4] & 15) | ((m[j + 4] & 15) << 4);
    }
    out.extend(s);
    let q = |g: usize, x: f32| {
        let (step, off) = (d.to_f32() * sc[g] as f32, dmin.to_f32() * m[g] as f32);
        if step > 0.0 {
            ((x + off) / step).round().clamp(0.0, 15.0) as u8
        } else {
            0
        }
    };
    for chunk in 0..4 {
        let (lo, hi) = (2 * chunk, 2 * chunk + 1);
        out.extend((0..32).map(|l| q(lo, b[64 * chunk + l]) | (q(hi, b[64 * chunk + 32 + l]) << 4)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantize_then_dequantize_is_close() {
        let x: Vec<f32> = (0..256).map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0).collect();
        for (ty, tol) in [
            (GgmlType::F16, 1e-3),
            (GgmlType::BF16, 1e-2),
            (GgmlType::Q8_0, 0.02),
            (GgmlType::Q4_0, 0.2),
            (GgmlType::Q4K, 0.2),
        ] {
            let mut bytes = Vec::new();
            quantize_into(ty, &x, &mut bytes).unwrap();
            assert_eq!(bytes.len() as u64, ty.byte_size(256).unwrap());
            let y = crate::quant::dequantize_to_vec(ty, &bytes, 256).unwrap();
            let err = x.iter().zip(&y).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(err < tol, "{ty}: max error {err}");
        }
    }
}
