//! softmax and log_softmax over the last axis, numerically stable, optionally causal.
//!
//! Definition (CPU and GPU alike), per row of length Tk:
//! - the row max m is subtracted before exponentiating, so any finite input (1e30 included)
//!   is safe; `-inf` entries contribute nothing and give 0 (softmax) / -inf (log_softmax);
//! - a row with no finite visible entry (all `-inf`, or fully masked) gives 0 everywhere for
//!   softmax and -inf everywhere for log_softmax, never NaN;
//! - `+inf` or NaN in a row gives NaN results (as in PyTorch; which entries is not specified);
//! - causal (`SoftmaxOpts::causal`, scores shaped [.., Tq, Tk]): query row i (its index along
//!   the second-last axis) sees keys j <= i + (Tk - Tq), the masked entries give 0 / -inf;
//!   when Tk < Tq the first Tq - Tk rows see nothing.
//!
//! The input may be any view (it is made contiguous first); the output is contiguous f32.

use rayon::prelude::*;

use super::elementwise::buf;
use super::{expect_dtype, gpu_of, to_u32};
use crate::error::{Error, Result};
use crate::gpu::{Bind, KernelSpec};
use crate::tensor::{CpuStorage, DType, Tensor};

#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SoftmaxOpts {
    /// log_softmax instead of softmax.
    pub log: bool,
    /// Causal mask for scores [.., Tq, Tk]: query i sees keys j <= i + (Tk - Tq).
    pub causal: bool,
}

impl SoftmaxOpts {
    fn name(self) -> &'static str {
        if self.log {
            "log_softmax"
        } else {
            "softmax"
        }
    }
}

/// Checks the input; returns (rows, Tk, Tq), Tq = 1 when not causal.
fn geometry(x: &Tensor, opts: SoftmaxOpts) -> Result<(usize, usize, usize)> {
    let op = opts.name();
    expect_dtype(op, x, DType::F32)?;
    let r = x.rank();
    if r == 0 || (opts.causal && r < 2) {
        let need = if opts.causal { "[.., Tq, Tk] (rank >= 2) for a causal mask" } else { "at least one dimension" };
        return Err(Error::shape(op, format!("input {} needs {need}", x.shape())));
    }
    let len = x.dims()[r - 1];
    if len == 0 {
        return Err(Error::shape(op, format!("input {} has an empty last axis", x.shape())));
    }
    let tq = if opts.causal { x.dims()[r - 2] } else { 1 };
    Ok((x.numel() / len, len, tq))
}

/// The keys query row `row` sees: all of them, or the causal prefix.
fn visible(row: usize, len: usize, tq: usize, causal: bool) -> usize {
    if causal {
        ((row % tq) as i64 + 1 + len as i64 - tq as i64).clamp(0, len as i64) as usize
    } else {
        len
    }
}

pub fn cpu_softmax(x: &Tensor, opts: SoftmaxOpts) -> Result<Tensor> {
    let (rows, len, tq) = geometry(x, opts)?;
    let x = x.contiguous()?;
    let v = match x.cpu_storage() {
        Some(CpuStorage::F32(v)) => &v[x.layout().offset..x.layout().offset + x.numel()],
        _ => return Err(Error::mismatch(opts.name(), "expected an f32 tensor on the CPU")),
    };
    let masked = if opts.log { f32::NEG_INFINITY } else { 0.0 };
    let mut out = vec![0f32; rows * len];
    out.par_chunks_mut(len).zip(v.par_chunks(len)).enumerate().for_each(|(row, (o, xr))| {
        let vis = visible(row, len, tq, opts.causal);
        let m = xr[..vis].iter().fold(f32::NEG_INFINITY, |a, &b| if b > a || b.is_nan() { b } else { a });
        if m == f32::NEG_INFINITY {
            o.fill(masked);
            return;
        }
        // f64 sum: the reference should be more exact than the kernel it checks.
        let s: f64 = xr[..vis].iter().map(|&e| ((e - m) as f64).exp()).sum();
        let (log_s, inv_s) = (s.ln(), 1.0 / s);
        for (oj, &e) in o[..vis].iter_mut().zip(&xr[..vis]) {
            let d = (e - m) as f64;
            *oj = if opts.log { (d - log_s) as f32 } else { (d.exp() * inv_s) as f32 };
        }
        o[vis..].fill(masked);
    });
    Ok(Tensor::cpu(CpuStorage::F32(out), x.shape().clone()))
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    rows: u32,
    len: u32,
    offset: u32,
    tq: u32,
    causal: u32,
    log: u32,
    _pad: [u32; 2],
}

/// Threads per row: short rows do not need 256 idle threads.
pub(crate) fn row_workgroup(len: usize) -> u32 {
    if len <= 256 {
        64
    } else {
        256
    }
}

pub fn gpu_softmax(x: &Tensor, opts: SoftmaxOpts) -> Result<Tensor> {
    let op = opts.name();
    let (rows, len, tq) = geometry(x, opts)?;
    let ctx = gpu_of(op, x)?;
    let x = x.contiguous()?;
    let out = Tensor::gpu_empty(x.shape().clone(), DType::F32, x.device())?;
    if rows == 0 {
        return Ok(out);
    }
    let params = Params {
        rows: to_u32(op, rows)?,
        len: to_u32(op, len)?,
        offset: to_u32(op, x.layout().offset)?,
        tq: to_u32(op, tq)?,
        causal: opts.causal as u32,
        log: opts.log as u32,
        _pad: [0; 2],
    };
    let wg = row_workgroup(len);
    let spec =
        KernelSpec::new(format!("softmax_wg{wg}"), include_str!("softmax.wgsl"), "softmax_rows").constant_u32("WG", wg);
    let pipeline = ctx.pipeline(&spec, &[])?;
    ctx.dispatch(
        &pipeline,
        op,
        bytemuck::bytes_of(&params),
        &[Bind::Whole(buf(&x)?), Bind::Whole(buf(&out)?)],
        ctx.grid_1d(params.rows),
    )?;
    Ok(out)
}

impl Tensor {
    /// softmax (or log_softmax, `opts.log`) over the last axis; see the module docs.
    pub fn softmax(&self, opts: SoftmaxOpts) -> Result<Tensor> {
        self.device().backend().softmax(self, opts)
    }
    /// log_softmax over the last axis.
    pub fn log_softmax(&self) -> Result<Tensor> {
        self.softmax(SoftmaxOpts { log: true, causal: false })
    }
}
