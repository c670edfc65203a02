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
//! The CPU reference exponentiates in f32 (`unary::exp_f32`, ~1e-7 relative: x - m <= 0, so
//! no overflow) and sums in f64; rows run in parallel when the tensor is large.

use rayon::prelude::*;

use super::elementwise::{buf, multiversion, PAR_MIN};
use super::norm::sum_f64;
use super::unary::exp_f32;
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
#[inline(always)]
fn visible(row: usize, len: usize, tq: usize, causal: bool) -> usize {
    if causal {
        ((row % tq) as i64 + 1 + len as i64 - tq as i64).clamp(0, len as i64) as usize
    } else {
        len
    }
}

/// The largest element, NaN if any is NaN; in 8 lanes, which vectorise.
#[inline(always)]
fn row_max(xs: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; 8];
    let mut nan = false;
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for k in 0..8 {
            m[k] = m[k].max(c[k]);
            nan |= c[k].is_nan();
        }
    }
    for &x in rest {
        m[0] = m[0].max(x);
        nan |= x.is_nan();
    }
    if nan {
        f32::NAN
    } else {
        m.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b))
    }
}

multiversion! {
    /// Softmax of the rows `first..` held in `xs` (rows of `len`) into `out`, vectorised for the
    /// widest of AVX-512, AVX2 and SSE2 this CPU has.
    fn rows(first: usize, xs: &[f32], out: &mut [f32], len: usize, tq: usize, opts: SoftmaxOpts) {
        let masked = if opts.log { f32::NEG_INFINITY } else { 0.0 };
        for (i, (o, xr)) in out.chunks_mut(len).zip(xs.chunks(len)).enumerate() {
            let vis = visible(first + i, len, tq, opts.causal);
            let m = row_max(&xr[..vis]);
            if m == f32::NEG_INFINITY {
                o.fill(masked);
                continue;
            }
            // f32 exponentials of x - m <= 0 (so in 0..=1; ~1e-7 relative error, plus the
            // rounding of x - m), summed in f64; written to `o` first: each computed once.
            let (o_vis, o_rest) = o.split_at_mut(vis);
            for (oj, &e) in o_vis.iter_mut().zip(&xr[..vis]) {
                *oj = exp_f32(e - m);
            }
            let s = sum_f64(o_vis);
            if opts.log {
                let log_s = s.ln();
                for (oj, &e) in o_vis.iter_mut().zip(&xr[..vis]) {
                    *oj = ((e - m) as f64 - log_s) as f32;
                }
            } else {
                let inv_s = (1.0 / s) as f32;
                for oj in o_vis.iter_mut() {
                    *oj *= inv_s;
                }
            }
            o_rest.fill(masked);
        }
}
}

pub fn cpu_softmax(x: &Tensor, opts: SoftmaxOpts) -> Result<Tensor> {
    let (n_rows, len, tq) = geometry(x, opts)?;
    let x = x.contiguous()?;
    let v = match x.cpu_storage() {
        Some(CpuStorage::F32(v)) => &v[x.layout().offset..x.layout().offset + x.numel()],
        _ => return Err(Error::mismatch(opts.name(), "expected an f32 tensor on the CPU")),
    };
    let mut out = vec![0f32; n_rows * len];
    if n_rows * len < PAR_MIN {
        rows(0, v, &mut out, len, tq, opts);
    } else {
        // Tasks of whole rows, at least PAR_MIN / 2 elements each.
        let per_task = (PAR_MIN / 2).div_ceil(len);
        out.par_chunks_mut(per_task * len)
            .zip(v.par_chunks(per_task * len))
            .enumerate()
            .for_each(|(t, (o, xr))| rows(t * per_task, xr, o, len, tq, opts));
    }
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

#[cfg(test)]
mod tests {
    use super::SoftmaxOpts;
    use crate::testing::rand_vec;
    use crate::{Device, Tensor};

    /// The CPU softmax (parallel path: past PAR_MIN elements) against an f64 computation, plain,
    /// log and causal, rows of 1 to 300.
    #[test]
    fn cpu_softmax_matches_f64() {
        for (rows, len) in [(400, 128), (40_000, 1), (130, 300)] {
            let x: Vec<f32> = rand_vec(7, rows * len).iter().map(|v| v * 30.0).collect();
            let tq = 10;
            for (log, causal) in [(false, false), (true, false), (false, true), (true, true)] {
                let t = Tensor::from_vec(x.clone(), [rows / tq, tq, len], &Device::Cpu).expect("t");
                let got = t.softmax(SoftmaxOpts { log, causal }).expect("softmax").to_vec_f32().expect("vec");
                for r in 0..rows {
                    let xr = &x[r * len..(r + 1) * len];
                    let vis = if causal { (r % tq + 1 + len).saturating_sub(tq).min(len) } else { len };
                    let m = xr[..vis].iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b as f64));
                    let s: f64 = xr[..vis].iter().map(|&v| (v as f64 - m).exp()).sum();
                    for (j, &g) in got[r * len..(r + 1) * len].iter().enumerate() {
                        let want = match (j < vis, log) {
                            (false, false) => 0.0,
                            (false, true) => f64::NEG_INFINITY,
                            (true, false) => (xr[j] as f64 - m).exp() / s,
                            (true, true) => xr[j] as f64 - m - s.ln(),
                        };
                        // x - m is rounded to f32 (as the GPU kernels do): its error, up to
                        // 6e-8 |x - m|, carries into the result.
                        let d = (xr[j] as f64 - m).abs();
                        let ok = if j >= vis {
                            g as f64 == want
                        } else if log {
                            (g as f64 - want).abs() <= 1e-6 * (1.0 + d + s.ln())
                        } else {
                            (g as f64 - want).abs() <= 1e-6 * (1.0 + d) * want.abs() + 1e-37
                        };
                        assert!(ok, "rows {rows} len {len} log {log} causal {causal}: [{r}, {j}] = {g}, want {want}");
                    }
                }
            }
        }
    }
}
