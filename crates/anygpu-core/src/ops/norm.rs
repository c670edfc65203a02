//! layer_norm and rms_norm over the last axis (C), f32.
//!
//! - layer_norm: `(x - mean) / sqrt(var + eps) * weight + bias`, var the biased (population)
//!   variance as in PyTorch's LayerNorm; weight and bias optional.
//! - add_layer_norm: `layer_norm(x + residual)` in one pass (a post-norm transformer's
//!   `LN(y + x)`): the sum is rounded to f32 as `add` would, and never written out on its own.
//! - rms_norm: `x / sqrt(mean(x^2) + eps) * weight`; weight optional.
//!
//! weight and bias must be f32 of shape [C]. x (and the residual) may be any view (made
//! contiguous first); the output is contiguous f32. The GPU kernels run one workgroup per row (see `norm.wgsl`); the
//! CPU reference accumulates in f64, two-pass, normalises in f64 and rounds once, running rows
//! in parallel when the tensor is large.

use std::borrow::Cow;

use rayon::prelude::*;

use super::elementwise::{buf, cpu_binary, multiversion, BinaryOp, PAR_MIN};
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

/// The contiguous f32 elements of a CPU tensor, borrowed when it is contiguous already.
fn cpu_f32<'a>(op: &'static str, t: &'a Tensor) -> Result<Cow<'a, [f32]>> {
    let fail = || Error::mismatch(op, "expected an f32 tensor on the CPU");
    let range = |t: &Tensor| t.layout().offset..t.layout().offset + t.numel();
    if t.is_contiguous() {
        return match t.cpu_storage() {
            Some(CpuStorage::F32(v)) => Ok(Cow::Borrowed(&v[range(t)])),
            _ => Err(fail()),
        };
    }
    let t = t.contiguous()?;
    match t.cpu_storage() {
        Some(CpuStorage::F32(v)) => Ok(Cow::Owned(v[range(&t)].to_vec())),
        _ => Err(fail()),
    }
}

/// The sum in f64, in 8 independent accumulators (which vectorise; the order differs from a
/// plain loop's by far less than an f32 rounding).
#[inline(always)]
pub(crate) fn sum_f64(xs: &[f32]) -> f64 {
    sum_map_f64(xs, |x| x)
}

#[inline(always)]
fn sum_map_f64(xs: &[f32], f: impl Fn(f64) -> f64) -> f64 {
    let mut acc = [0f64; 8];
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for k in 0..8 {
            acc[k] += f(c[k] as f64);
        }
    }
    rest.iter().fold(acc.iter().sum::<f64>(), |s, &x| s + f(x as f64))
}

/// `o[j] = (r[j] - mean) * inv * w[j] + b[j]` in f64, rounded once; w and b optional, each
/// combination its own loop (no per-element option test).
#[inline(always)]
fn normalize(r: &[f32], o: &mut [f32], mean: f64, inv: f64, w: Option<&[f32]>, b: Option<&[f32]>) {
    let y = |v: f32| (v as f64 - mean) * inv;
    match (w, b) {
        (Some(w), Some(b)) => {
            for (((o, &v), &w), &b) in o.iter_mut().zip(r).zip(w).zip(b) {
                *o = (y(v) * w as f64 + b as f64) as f32;
            }
        }
        (Some(w), None) => {
            for ((o, &v), &w) in o.iter_mut().zip(r).zip(w) {
                *o = (y(v) * w as f64) as f32;
            }
        }
        (None, Some(b)) => {
            for ((o, &v), &b) in o.iter_mut().zip(r).zip(b) {
                *o = (y(v) + b as f64) as f32;
            }
        }
        (None, None) => {
            for (o, &v) in o.iter_mut().zip(r) {
                *o = y(v) as f32;
            }
        }
    }
}

/// What a norm computes per row: layer_norm (`center`: mean and variance) or rms_norm.
#[derive(Clone, Copy)]
struct NormSpec<'a> {
    center: bool,
    eps: f32,
    w: Option<&'a [f32]>,
    b: Option<&'a [f32]>,
}

multiversion! {
    /// Normalises the rows of length `c` in `xs` into `out`, vectorised for the widest of
    /// AVX-512, AVX2 and SSE2 this CPU has.
    fn rows(xs: &[f32], out: &mut [f32], c: usize, spec: NormSpec) {
        for (o, r) in out.chunks_mut(c).zip(xs.chunks(c)) {
            let (mean, var) = if spec.center {
                let mean = sum_f64(r) / c as f64;
                (mean, sum_map_f64(r, |v| (v - mean) * (v - mean)) / c as f64)
            } else {
                (0.0, sum_map_f64(r, |v| v * v) / c as f64)
            };
            let inv = 1.0 / (var + spec.eps as f64).sqrt();
            normalize(r, o, mean, inv, spec.w, spec.b);
        }
    }
}

/// Runs the norm over the rows of x, in parallel tasks of whole rows when x is large (a few
/// thousand elements and less take longer to fork than to compute).
fn cpu_norm(x: &Tensor, xs: &[f32], c: usize, spec: NormSpec) -> Tensor {
    let mut out = vec![0f32; xs.len()];
    if xs.len() < PAR_MIN {
        rows(xs, &mut out, c, spec);
    } else {
        let per_task = (PAR_MIN / 2).div_ceil(c) * c;
        out.par_chunks_mut(per_task).zip(xs.par_chunks(per_task)).for_each(|(o, r)| rows(r, o, c, spec));
    }
    Tensor::cpu(CpuStorage::F32(out), x.shape().clone())
}

pub fn cpu_layer_norm(x: &Tensor, w: Option<&Tensor>, b: Option<&Tensor>, eps: f32) -> Result<Tensor> {
    const OP: &str = "layer_norm";
    let (_, c) = check(OP, x, &[("weight", w), ("bias", b)])?;
    let xs = cpu_f32(OP, x)?;
    let w = w.map(|t| cpu_f32(OP, t)).transpose()?;
    let b = b.map(|t| cpu_f32(OP, t)).transpose()?;
    Ok(cpu_norm(x, &xs, c, NormSpec { center: true, eps, w: w.as_deref(), b: b.as_deref() }))
}

/// Checks add_layer_norm's residual against x: same shape, f32, same device.
fn check_residual(op: &'static str, x: &Tensor, r: &Tensor) -> Result<()> {
    same_device(op, x, r)?;
    expect_dtype(op, r, DType::F32)?;
    if r.dims() != x.dims() {
        return Err(Error::shape(op, format!("residual shape {} does not match input {}", r.shape(), x.shape())));
    }
    Ok(())
}

/// `layer_norm(x + r)`: the composition of the CPU `add` (the sum rounded to f32) and the
/// layer_norm reference.
pub fn cpu_add_layer_norm(x: &Tensor, r: &Tensor, w: Option<&Tensor>, b: Option<&Tensor>, eps: f32) -> Result<Tensor> {
    const OP: &str = "add_layer_norm";
    check(OP, x, &[("weight", w), ("bias", b)])?;
    check_residual(OP, x, r)?;
    cpu_layer_norm(&cpu_binary(BinaryOp::Add, x, r)?, w, b, eps)
}

pub fn cpu_rms_norm(x: &Tensor, w: Option<&Tensor>, eps: f32) -> Result<Tensor> {
    const OP: &str = "rms_norm";
    let (_, c) = check(OP, x, &[("weight", w)])?;
    let xs = cpu_f32(OP, x)?;
    let w = w.map(|t| cpu_f32(OP, t)).transpose()?;
    Ok(cpu_norm(x, &xs, c, NormSpec { center: false, eps, w: w.as_deref(), b: None }))
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
    /// add_layer_norm: the residual's offset.
    r_off: u32,
    _pad: [u32; 3],
}

/// The norm kernels of norm.wgsl: `op` is the entry point (layer_norm, rms_norm,
/// add_layer_norm); `r` the residual of add_layer_norm.
fn gpu_norm(
    op: &'static str,
    x: &Tensor,
    r: Option<&Tensor>,
    w: Option<&Tensor>,
    b: Option<&Tensor>,
    eps: f32,
) -> Result<Tensor> {
    let (rows, c) = check(op, x, &[("weight", w), ("bias", b)])?;
    if let Some(r) = r {
        check_residual(op, x, r)?;
    }
    let ctx = gpu_of(op, x)?;
    let x = x.contiguous()?;
    let r = r.map(|t| t.contiguous()).transpose()?;
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
        r_off: off(&r)?,
        _pad: [0; 3],
    };
    let wg = row_workgroup(c);
    let spec = KernelSpec::new(format!("{op}_wg{wg}"), include_str!("norm.wgsl"), op).constant_u32("WG", wg);
    let pipeline = ctx.pipeline(&spec, &[])?;
    let bx = buf(&x)?;
    let bw = w.as_ref().map_or(Ok(bx), buf)?;
    let bb = b.as_ref().map_or(Ok(bx), buf)?;
    let bo = buf(&out)?;
    // The residual is binding 5, after the output: the other entry points keep bindings 1-4.
    let mut binds = vec![Bind::Whole(bx), Bind::Whole(bw), Bind::Whole(bb), Bind::Whole(bo)];
    if let Some(r) = &r {
        binds.push(Bind::Whole(buf(r)?));
    }
    ctx.dispatch(&pipeline, op, bytemuck::bytes_of(&params), &binds, ctx.grid_1d(params.rows))?;
    Ok(out)
}

pub fn gpu_layer_norm(x: &Tensor, w: Option<&Tensor>, b: Option<&Tensor>, eps: f32) -> Result<Tensor> {
    gpu_norm("layer_norm", x, None, w, b, eps)
}

pub fn gpu_add_layer_norm(x: &Tensor, r: &Tensor, w: Option<&Tensor>, b: Option<&Tensor>, eps: f32) -> Result<Tensor> {
    gpu_norm("add_layer_norm", x, Some(r), w, b, eps)
}

pub fn gpu_rms_norm(x: &Tensor, w: Option<&Tensor>, eps: f32) -> Result<Tensor> {
    gpu_norm("rms_norm", x, None, w, None, eps)
}

impl Tensor {
    /// Layer norm over the last axis (weight and bias [C], optional).
    pub fn layer_norm(&self, weight: Option<&Tensor>, bias: Option<&Tensor>, eps: f32) -> Result<Tensor> {
        self.device().backend().layer_norm(self, weight, bias, eps)
    }
    /// `layer_norm(self + residual)` in one op (a post-norm block's `LN(y + x)`): residual of
    /// the same shape, the norm over the last axis, weight and bias [C] optional.
    pub fn add_layer_norm(
        &self,
        residual: &Tensor,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f32,
    ) -> Result<Tensor> {
        same_device("add_layer_norm", self, residual)?;
        self.device().backend().add_layer_norm(self, residual, weight, bias, eps)
    }
    /// RMS norm over the last axis (weight [C], optional).
    pub fn rms_norm(&self, weight: Option<&Tensor>, eps: f32) -> Result<Tensor> {
        self.device().backend().rms_norm(self, weight, eps)
    }
}

#[cfg(test)]
mod tests {
    use crate::testing::rand_vec;
    use crate::{Device, Tensor};

    /// Many rows (the parallel path splits them into tasks) against an f64 computation.
    #[test]
    fn cpu_norms_match_f64_over_many_rows() {
        let (rows, c) = (333, 129);
        let x: Vec<f32> = rand_vec(3, rows * c).iter().map(|v| 5.0 + 3.0 * v).collect();
        let (w, b) = (rand_vec(4, c), rand_vec(5, c));
        let dev = Device::Cpu;
        let xt = Tensor::from_vec(x.clone(), [rows, c], &dev).expect("x");
        let (wt, bt) =
            (Tensor::from_vec(w.clone(), [c], &dev).expect("w"), Tensor::from_vec(b.clone(), [c], &dev).expect("b"));
        let ln = xt.layer_norm(Some(&wt), Some(&bt), 1e-5).expect("ln").to_vec_f32().expect("v");
        let rms = xt.rms_norm(Some(&wt), 1e-5).expect("rms").to_vec_f32().expect("v");
        for r in 0..rows {
            let xr: Vec<f64> = x[r * c..(r + 1) * c].iter().map(|&v| v as f64).collect();
            let mean = xr.iter().sum::<f64>() / c as f64;
            let var = xr.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / c as f64;
            let ms = xr.iter().map(|v| v * v).sum::<f64>() / c as f64;
            for j in 0..c {
                let want_ln = (xr[j] - mean) / (var + 1e-5).sqrt() * w[j] as f64 + b[j] as f64;
                let want_rms = xr[j] / (ms + 1e-5).sqrt() * w[j] as f64;
                assert!((ln[r * c + j] as f64 - want_ln).abs() <= 1e-6 * (1.0 + want_ln.abs()), "ln [{r}, {j}]");
                assert!((rms[r * c + j] as f64 - want_rms).abs() <= 1e-6 * (1.0 + want_rms.abs()), "rms [{r}, {j}]");
            }
        }
    }
}
