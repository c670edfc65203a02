//! layer_norm and rms_norm over the last axis (C), f32.
//!
//! - layer_norm: `(x - mean) / sqrt(var + eps) * weight + bias`, var the biased (population)
//!   variance as in PyTorch's LayerNorm; weight and bias optional.
//! - rms_norm: `x / sqrt(mean(x^2) + eps) * weight`; weight optional.
//!
//! weight and bias must be f32 of shape [C]. x may be any view (made contiguous first); the
//! output is contiguous f32. The GPU kernels run one workgroup per row (see `norm.wgsl`); the
//! CPU reference runs rows in parallel and accumulates in f64, two-pass.

use rayon::prelude::*;

use super::elementwise::buf;
use super::softmax::row_workgroup;
use super::{expect_dtype, gpu_of, same_device, to_u32};
use crate::error::{Error, Result};
use crate::gpu::{Bind, KernelSpec};
use crate::tensor::{CpuStorage, DType, Tensor};

/// Checks x and the optional weight/bias; returns (rows, C).
fn check(op: &'static str, x: &Tensor, params: &[(&str, Option<&Tensor>)]) -> Result<(usize, usize)> {
    expect_dtype(op, x, DType::F32)?;
    let c = match x.dims().last() {
        Some(&c) if c > 0 => c,
        _ => return Err(Error::shape(op, format!("input {} needs a non-empty last axis", x.shape()))),
    };
    for (what, t) in params {
        if let Some(t) = t {
            same_device(op, x, t)?;
            if t.dtype() != DType::F32 {
                return Err(Error::mismatch(op, format!("{what} must be f32, got {}", t.dtype())));
            }
            if t.dims() != [c] {
                return Err(Error::shape(
                    op,
                    format!("{what} shape {} does not match [{c}], the last axis of input {}", t.shape(), x.shape()),
                ));
            }
        }
    }
    Ok((x.numel() / c, c))
}

/// The contiguous f32 elements of a CPU tensor.
fn cpu_f32(op: &'static str, t: &Tensor) -> Result<Vec<f32>> {
    let t = t.contiguous()?;
    match t.cpu_storage() {
        Some(CpuStorage::F32(v)) => Ok(v[t.layout().offset..t.layout().offset + t.numel()].to_vec()),
        _ => Err(Error::mismatch(op, "expected an f32 tensor on the CPU")),
    }
}

/// Runs `f(row, out_row)` over the rows of x in parallel and wraps the result.
fn cpu_rows(x: &Tensor, xs: &[f32], c: usize, f: impl Fn(&[f32], &mut [f32]) + Sync) -> Tensor {
    let mut out = vec![0f32; xs.len()];
    out.par_chunks_mut(c).zip(xs.par_chunks(c)).for_each(|(o, r)| f(r, o));
    Tensor::cpu(CpuStorage::F32(out), x.shape().clone())
}

fn affine(y: f64, j: usize, w: &Option<Vec<f32>>, b: &Option<Vec<f32>>) -> f32 {
    let y = w.as_ref().map_or(y, |w| y * w[j] as f64);
    b.as_ref().map_or(y, |b| y + b[j] as f64) as f32
}

pub fn cpu_layer_norm(x: &Tensor, w: Option<&Tensor>, b: Option<&Tensor>, eps: f32) -> Result<Tensor> {
    const OP: &str = "layer_norm";
    let (_, c) = check(OP, x, &[("weight", w), ("bias", b)])?;
    let xs = cpu_f32(OP, x)?;
    let w = w.map(|t| cpu_f32(OP, t)).transpose()?;
    let b = b.map(|t| cpu_f32(OP, t)).transpose()?;
    Ok(cpu_rows(x, &xs, c, |r, o| {
        let mean = r.iter().map(|&v| v as f64).sum::<f64>() / c as f64;
        let var = r.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / c as f64;
        let inv = 1.0 / (var + eps as f64).sqrt();
        for (j, (oj, &v)) in o.iter_mut().zip(r).enumerate() {
            *oj = affine((v as f64 - mean) * inv, j, &w, &b);
        }
    }))
}

pub fn cpu_rms_norm(x: &Tensor, w: Option<&Tensor>, eps: f32) -> Result<Tensor> {
    const OP: &str = "rms_norm";
    let (_, c) = check(OP, x, &[("weight", w)])?;
    let xs = cpu_f32(OP, x)?;
    let w = w.map(|t| cpu_f32(OP, t)).transpose()?;
    Ok(cpu_rows(x, &xs, c, |r, o| {
        let ms = r.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / c as f64;
        let inv = 1.0 / (ms + eps as f64).sqrt();
        for (j, (oj, &v)) in o.iter_mut().zip(r).enumerate() {
            *oj = affine(v as f64 * inv, j, &w, &None);
        }
    }))
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    rows: u32,
    len: u32,
    x_off: u32,
    w_off: u32,
    b_off: u32,
    has_w: u32,
    has_b: u32,
    eps: f32,
}

fn gpu_norm(op: &'static str, x: &Tensor, w: Option<&Tensor>, b: Option<&Tensor>, eps: f32) -> Result<Tensor> {
    let (rows, c) = check(op, x, &[("weight", w), ("bias", b)])?;
    let ctx = gpu_of(op, x)?;
    let x = x.contiguous()?;
    let w = w.map(|t| t.contiguous()).transpose()?;
    let b = b.map(|t| t.contiguous()).transpose()?;
    let out = Tensor::gpu_empty(x.shape().clone(), DType::F32, x.device())?;
    if rows == 0 {
        return Ok(out);
    }
    let off = |t: &Option<Tensor>| t.as_ref().map_or(Ok(0), |t| to_u32(op, t.layout().offset));
    let params = Params {
        rows: to_u32(op, rows)?,
        len: to_u32(op, c)?,
        x_off: to_u32(op, x.layout().offset)?,
        w_off: off(&w)?,
        b_off: off(&b)?,
        has_w: w.is_some() as u32,
        has_b: b.is_some() as u32,
        eps,
    };
    let wg = row_workgroup(c);
    let spec = KernelSpec::new(format!("{op}_wg{wg}"), include_str!("norm.wgsl"), op).constant_u32("WG", wg);
    let pipeline = ctx.pipeline(&spec, &[])?;
    let bx = buf(&x)?;
    let bw = w.as_ref().map_or(Ok(bx), buf)?;
    let bb = b.as_ref().map_or(Ok(bx), buf)?;
    ctx.dispatch(
        &pipeline,
        op,
        bytemuck::bytes_of(&params),
        &[Bind::Whole(bx), Bind::Whole(bw), Bind::Whole(bb), Bind::Whole(buf(&out)?)],
        ctx.grid_1d(params.rows),
    )?;
    Ok(out)
}

pub fn gpu_layer_norm(x: &Tensor, w: Option<&Tensor>, b: Option<&Tensor>, eps: f32) -> Result<Tensor> {
    gpu_norm("layer_norm", x, w, b, eps)
}

pub fn gpu_rms_norm(x: &Tensor, w: Option<&Tensor>, eps: f32) -> Result<Tensor> {
    gpu_norm("rms_norm", x, w, None, eps)
}

impl Tensor {
    /// Layer norm over the last axis (weight and bias [C], optional).
    pub fn layer_norm(&self, weight: Option<&Tensor>, bias: Option<&Tensor>, eps: f32) -> Result<Tensor> {
        self.device().backend().layer_norm(self, weight, bias, eps)
    }
    /// RMS norm over the last axis (weight [C], optional).
    pub fn rms_norm(&self, weight: Option<&Tensor>, eps: f32) -> Result<Tensor> {
        self.device().backend().rms_norm(self, weight, eps)
    }
}
