//! CPU dequantization: the reference every other path (fused CPU matvec, WGSL kernels) is checked
//! against. Written to read like ggml-quants.c's `dequantize_row_*`, one function per type, with
//! the same float operation order so results match ggml and gguf-py bit for bit.

use half::{bf16, f16};

use super::blocks::*;
use super::GgmlType;
use crate::error::{Error, Result};

/// Expands `dst.len()` weights of type `ty` from `src` into `dst`. `src` must hold exactly
/// `dst.len()` weights, a whole number of blocks.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    let want = ty.byte_size(dst.len() as u64)?;
    if src.len() as u64 != want {
        return Err(Error::Format(format!(
            "dequantize {ty}: {} elements need {want} bytes, got {}",
            dst.len(),
            src.len()
        )));
    }
    match ty {
        GgmlType::F32 => dequant_f32(src, dst),
        GgmlType::F16 => dequant_f16(src, dst),
        GgmlType::BF16 => dequant_bf16(src, dst),
        GgmlType::Q4_0 => dequant_q4_0(as_blocks(src)?, dst),
        GgmlType::Q4_1 => dequant_q4_1(as_blocks(src)?, dst),
        GgmlType::Q5_0 => dequant_q5_0(as_blocks(src)?, dst),
        GgmlType::Q5_1 => dequant_q5_1(as_blocks(src)?, dst),
        GgmlType::Q8_0 => dequant_q8_0(as_blocks(src)?, dst),
        GgmlType::Q2K => dequant_q2k(as_blocks(src)?, dst),
        GgmlType::Q3K => dequant_q3k(as_blocks(src)?, dst),
        GgmlType::Q4K => dequant_q4k(as_blocks(src)?, dst),
        GgmlType::Q5K => dequant_q5k(as_blocks(src)?, dst),
        GgmlType::Q6K => dequant_q6k(as_blocks(src)?, dst),
    }
    Ok(())
}

/// [`dequantize`] into a new vector of `n` weights.
pub fn dequantize_to_vec(ty: GgmlType, src: &[u8], n: usize) -> Result<Vec<f32>> {
    let mut out = vec![0f32; n];
    dequantize(ty, src, &mut out)?;
    Ok(out)
}

pub(crate) fn dequant_f32(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    }
}

pub(crate) fn dequant_f16(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = f16::from_le_bytes([s[0], s[1]]).to_f32();
    }
}

pub(crate) fn dequant_bf16(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = bf16::from_le_bytes([s[0], s[1]]).to_f32();
    }
}

pub(crate) fn dequant_q4_0(blocks: &[BlockQ4_0], dst: &mut [f32]) {
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK)) {
        let d = b.d();
        for j in 0..QK / 2 {
            y[j] = ((b.qs[j] & 0x0F) as i32 - 8) as f32 * d;
            y[j + QK / 2] = ((b.qs[j] >> 4) as i32 - 8) as f32 * d;
        }
    }
}

pub(crate) fn dequant_q4_1(blocks: &[BlockQ4_1], dst: &mut [f32]) {
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK)) {
        let (d, m) = (b.d(), b.m());
        for j in 0..QK / 2 {
            y[j] = (b.qs[j] & 0x0F) as f32 * d + m;
            y[j + QK / 2] = (b.qs[j] >> 4) as f32 * d + m;
        }
    }
}

pub(crate) fn dequant_q5_0(blocks: &[BlockQ5_0], dst: &mut [f32]) {
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK)) {
        let (d, qh) = (b.d(), b.qh());
        for j in 0..QK / 2 {
            let h0 = ((qh >> j) & 1) << 4;
            let h1 = ((qh >> (j + 16)) & 1) << 4;
            y[j] = ((b.qs[j] as u32 & 0x0F | h0) as i32 - 16) as f32 * d;
            y[j + QK / 2] = ((b.qs[j] as u32 >> 4 | h1) as i32 - 16) as f32 * d;
        }
    }
}

pub(crate) fn dequant_q5_1(blocks: &[BlockQ5_1], dst: &mut [f32]) {
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK)) {
        let (d, m, qh) = (b.d(), b.m(), b.qh());
        for j in 0..QK / 2 {
            let h0 = ((qh >> j) & 1) << 4;
            let h1 = ((qh >> (j + 16)) & 1) << 4;
            y[j] = (b.qs[j] as u32 & 0x0F | h0) as f32 * d + m;
            y[j + QK / 2] = (b.qs[j] as u32 >> 4 | h1) as f32 * d + m;
        }
    }
}

pub(crate) fn dequant_q8_0(blocks: &[BlockQ8_0], dst: &mut [f32]) {
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK)) {
        let d = b.d();
        for (y, q) in y.iter_mut().zip(b.qs) {
            *y = q as f32 * d;
        }
    }
}

pub(crate) fn dequant_q2k(blocks: &[BlockQ2K], dst: &mut [f32]) {
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let (d, dmin) = (b.d(), b.dmin());
        // 16 groups of 16; group g = 8n + 2j + h reads bits 2j of qs[32n + 16h ..][..16].
        for g in 0..16 {
            let (n, j, h) = (g / 8, (g % 8) / 2, g % 2);
            let sc = b.scales[g];
            let dl = d * (sc & 0x0F) as f32;
            let ml = dmin * (sc >> 4) as f32;
            let q = &b.qs[32 * n + 16 * h..][..16];
            let out = &mut y[128 * n + 32 * j + 16 * h..][..16];
            for l in 0..16 {
                out[l] = dl * ((q[l] >> (2 * j)) & 3) as f32 - ml;
            }
        }
    }
}

pub(crate) fn dequant_q3k(blocks: &[BlockQ3K], dst: &mut [f32]) {
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = b.d();
        let scales = q3k_scales(&b.scales);
        // Same group walk as Q2_K; the high bit of weight (n, j, l) is bit 4n + j of hmask[l].
        for (g, sc) in scales.into_iter().enumerate() {
            let (n, j, h) = (g / 8, (g % 8) / 2, g % 2);
            let dl = d * sc as f32;
            let q = &b.qs[32 * n + 16 * h..][..16];
            let hm = &b.hmask[16 * h..][..16];
            let out = &mut y[128 * n + 32 * j + 16 * h..][..16];
            for l in 0..16 {
                let low = ((q[l] >> (2 * j)) & 3) as i32;
                let high_clear = (hm[l] >> (4 * n + j)) & 1 == 0;
                out[l] = dl * (low - if high_clear { 4 } else { 0 }) as f32;
            }
        }
    }
}

pub(crate) fn dequant_q4k(blocks: &[BlockQ4K], dst: &mut [f32]) {
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let (d, dmin) = (b.d(), b.dmin());
        for k in 0..4 {
            let q = &b.qs[32 * k..][..32];
            for (h, shift) in [(0, 0), (1, 4)] {
                let (sc, m) = scale_min_k4(2 * k + h, &b.scales);
                let (dl, ml) = (d * sc as f32, dmin * m as f32);
                let out = &mut y[64 * k + 32 * h..][..32];
                for l in 0..32 {
                    out[l] = dl * ((q[l] >> shift) & 0x0F) as f32 - ml;
                }
            }
        }
    }
}

pub(crate) fn dequant_q5k(blocks: &[BlockQ5K], dst: &mut [f32]) {
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let (d, dmin) = (b.d(), b.dmin());
        for k in 0..4 {
            let q = &b.qs[32 * k..][..32];
            for (h, shift) in [(0, 0), (1, 4)] {
                let g = 2 * k + h;
                let (sc, m) = scale_min_k4(g, &b.scales);
                let (dl, ml) = (d * sc as f32, dmin * m as f32);
                let out = &mut y[64 * k + 32 * h..][..32];
                for l in 0..32 {
                    let high = ((b.qh[l] >> g) & 1) << 4;
                    out[l] = dl * (((q[l] >> shift) & 0x0F) | high) as f32 - ml;
                }
            }
        }
    }
}

pub(crate) fn dequant_q6k(blocks: &[BlockQ6K], dst: &mut [f32]) {
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = b.d();
        for n in 0..2 {
            let ql = &b.ql[64 * n..][..64];
            let qh = &b.qh[32 * n..][..32];
            let sc = &b.scales[8 * n..][..8];
            let out = &mut y[128 * n..][..128];
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
                let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                out[l] = d * sc[is] as f32 * q1 as f32;
                out[l + 32] = d * sc[is + 2] as f32 * q2 as f32;
                out[l + 64] = d * sc[is + 4] as f32 * q3 as f32;
                out[l + 96] = d * sc[is + 6] as f32 * q4 as f32;
            }
        }
    }
}
