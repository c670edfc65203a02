//! Reference quantizers (f32 -> blocks) for the types synthetic models and tests write:
//! F32, F16, BF16, Q8_0, Q4_0 — ggml's round-to-nearest `quantize_row_*_ref` rules.

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
        other => {
            return Err(Error::Unsupported(format!("quantizing to {other} (supported: F32, F16, BF16, Q8_0, Q4_0)")))
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantize_then_dequantize_is_close() {
        let x: Vec<f32> = (0..256).map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0).collect();
        for (ty, tol) in [(GgmlType::F16, 1e-3), (GgmlType::BF16, 1e-2), (GgmlType::Q8_0, 0.02), (GgmlType::Q4_0, 0.2)]
        {
            let mut bytes = Vec::new();
            quantize_into(ty, &x, &mut bytes).unwrap();
            assert_eq!(bytes.len() as u64, ty.byte_size(256).unwrap());
            let y = crate::quant::dequantize_to_vec(ty, &bytes, 256).unwrap();
            let err = x.iter().zip(&y).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(err < tol, "{ty}: max error {err}");
        }
    }
}
