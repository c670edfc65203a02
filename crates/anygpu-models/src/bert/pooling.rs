//! Sentence vectors from token vectors, as sentence-transformers' `Pooling` and `Normalize`
//! modules compute them, over padded batches (padding never counts).
//!
//! On the device: mean pooling is one batched product `[B, 1, T] x [B, T, C]` with weights
//! 1/len on real tokens and 0 on padding (1/sqrt(len) for mean_sqrt_len), CLS a narrow, max
//! a reduction after an additive -1e9 on padding (sentence-transformers sets padded tokens to
//! -1e9 before its max). Only [B, C] per mode comes back to the host, where the modes are
//! concatenated and, with `normalize`, each row divided by max(|row|, 1e-12) (torch's
//! `F.normalize`), in f64.

use anygpu_core::{Error, Result, Tensor};

use super::config::Pooling;

/// Pools `hidden` [B, T, C] into B rows of `pooling.n_modes() * C` floats.
pub fn pool(hidden: &Tensor, lengths: &[usize], pooling: &Pooling, normalize: bool) -> Result<Vec<Vec<f32>>> {
    const OP: &str = "pooling";
    let [b, t, c] = *hidden.dims() else {
        return Err(Error::shape(OP, format!("expected hidden states [B, T, C], got {}", hidden.shape())));
    };
    if lengths.len() != b {
        return Err(Error::shape(OP, format!("{} lengths for a batch of {b}", lengths.len())));
    }
    if let Some(&bad) = lengths.iter().find(|&&l| l == 0 || l > t) {
        return Err(Error::shape(OP, format!("sequence length {bad} is not in 1..={t}")));
    }
    if pooling.n_modes() == 0 {
        return Err(Error::shape(OP, "no pooling mode is enabled"));
    }
    let dev = hidden.device();
    // Weighted sum over tokens, weight w(len) on each real token.
    let weighted = |w: &dyn Fn(usize) -> f32| -> Result<Vec<f32>> {
        let mut m = vec![0f32; b * t];
        for (row, &len) in m.chunks_mut(t).zip(lengths) {
            row[..len].fill(w(len));
        }
        let m = Tensor::from_vec(m, [b, 1, t], dev)?;
        m.matmul(hidden)?.to_vec_f32()
    };
    let mut parts: Vec<Vec<f32>> = Vec::new();
    if pooling.cls {
        parts.push(hidden.narrow(1, 0, 1)?.contiguous()?.to_vec_f32()?);
    }
    if pooling.max {
        let mut m = vec![0f32; b * t];
        for (row, &len) in m.chunks_mut(t).zip(lengths) {
            row[len..].fill(-1e9);
        }
        let m = Tensor::from_vec(m, [b, t, 1], dev)?;
        parts.push(hidden.add(&m)?.max(1)?.to_vec_f32()?);
    }
    if pooling.mean {
        parts.push(weighted(&|len| 1.0 / len as f32)?);
    }
    if pooling.mean_sqrt_len {
        parts.push(weighted(&|len| 1.0 / (len as f32).sqrt())?);
    }
    let mut out = Vec::with_capacity(b);
    for i in 0..b {
        let mut row: Vec<f32> = Vec::with_capacity(parts.len() * c);
        for p in &parts {
            row.extend_from_slice(&p[i * c..(i + 1) * c]);
        }
        if normalize {
            normalize_in_place(&mut row);
        }
        out.push(row);
    }
    Ok(out)
}

/// Divides `v` by max(|v|, 1e-12).
pub fn normalize_in_place(v: &mut [f32]) {
    let norm = v.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt().max(1e-12);
    for x in v {
        *x = (*x as f64 / norm) as f32;
    }
}

/// Cosine similarity of two vectors (0 when either is all zeros), in f64.
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (x as f64, y as f64);
        ab += x * y;
        aa += x * x;
        bb += y * y;
    }
    let d = (aa * bb).sqrt();
    if d == 0.0 {
        0.0
    } else {
        (ab / d) as f32
    }
}

/// The matrix of pairwise cosines, row-major [N, N].
pub fn cosine_matrix(vs: &[Vec<f32>]) -> Vec<Vec<f32>> {
    vs.iter().map(|a| vs.iter().map(|b| cosine(a, b)).collect()).collect()
}
