//! Reductions over one axis (sum, mean, max, min, argmax) and the two-pass dot product.

use rayon::prelude::*;

use super::elementwise::buf;
use super::{expect_dtype, gpu_of, same_device, to_u32};
use crate::error::{Error, Result};
use crate::gpu::{Bind, KernelSpec};
use crate::tensor::{CpuStorage, DType, Shape, Tensor};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Mean,
    Max,
    Min,
    /// Index of the maximum (lowest index on ties), as u32.
    ArgMax,
}

impl ReduceOp {
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::ArgMax => "argmax",
        }
    }
}

/// `x` seen as [outer, len, inner] around `axis`, and the output shape (axis removed).
fn split(op: &'static str, x: &Tensor, axis: usize) -> Result<(usize, usize, usize, Vec<usize>)> {
    let len = x.dim(op, axis)?;
    if len == 0 {
        return Err(Error::shape(op, format!("cannot reduce an empty axis {axis} of {}", x.shape())));
    }
    let outer = x.dims()[..axis].iter().product();
    let inner = x.dims()[axis + 1..].iter().product();
    let mut out_shape = x.dims().to_vec();
    out_shape.remove(axis);
    Ok((outer, len, inner, out_shape))
}

pub fn cpu_reduce(op: ReduceOp, x: &Tensor, axis: usize) -> Result<Tensor> {
    let name = op.name();
    let (outer, len, inner, out_shape) = split(name, x, axis)?;
    let x = x.contiguous()?;
    let v = match x.cpu_storage() {
        Some(CpuStorage::F32(v)) => &v[x.layout().offset..x.layout().offset + x.numel()],
        _ => return Err(Error::mismatch(name, format!("expected an f32 CPU tensor, got {}", x.dtype()))),
    };
    let at = |o: usize, r: usize| v[(o / inner) * len * inner + r * inner + o % inner];
    let n_out = outer * inner;
    if op == ReduceOp::ArgMax {
        let out: Vec<u32> = (0..n_out)
            .into_par_iter()
            .map(|o| {
                let mut best = 0;
                for r in 1..len {
                    if at(o, r) > at(o, best) {
                        best = r;
                    }
                }
                best as u32
            })
            .collect();
        return Ok(Tensor::cpu(CpuStorage::U32(out), Shape(out_shape)));
    }
    let out: Vec<f32> = (0..n_out)
        .into_par_iter()
        .map(|o| {
            let vals = (0..len).map(|r| at(o, r));
            match op {
                ReduceOp::Sum => vals.sum(),
                ReduceOp::Mean => vals.sum::<f32>() / len as f32,
                ReduceOp::Max => vals.fold(f32::NEG_INFINITY, f32::max),
                ReduceOp::Min => vals.fold(f32::INFINITY, f32::min),
                ReduceOp::ArgMax => unreachable!("handled above"),
            }
        })
        .collect();
    Ok(Tensor::cpu(CpuStorage::F32(out), Shape(out_shape)))
}

pub fn cpu_dot(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    check_dot(a, b)?;
    let (va, vb) = (a.to_vec_f32()?, b.to_vec_f32()?);
    // f64 accumulation: the reference should be more exact than the kernels it checks.
    let s: f64 = va.par_iter().zip(&vb).map(|(&x, &y)| x as f64 * y as f64).sum();
    Ok(Tensor::cpu(CpuStorage::F32(vec![s as f32]), Shape(vec![])))
}

fn check_dot(a: &Tensor, b: &Tensor) -> Result<()> {
    same_device("dot", a, b)?;
    if a.numel() != b.numel() {
        return Err(Error::shape("dot", format!("lengths differ: {} and {}", a.shape(), b.shape())));
    }
    Ok(())
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct AxisParams {
    outer: u32,
    len: u32,
    inner: u32,
    n_out: u32,
    scale: f32,
    offset: u32,
    _pad: [u32; 2],
}

pub fn gpu_reduce(op: ReduceOp, x: &Tensor, axis: usize) -> Result<Tensor> {
    gpu_reduce_into(op, x, axis, None)
}

/// The argmax of each row of `x` [rows, len] (f32, on a GPU), written as u32 into the first
/// `rows` elements of `ids` (a u32 tensor of the same GPU starting at element 0): the greedy
/// decode step leaves the next token id where its embedding lookup reads it, so the following
/// step can run before the host has seen the id.
pub fn gpu_argmax_into(x: &Tensor, ids: &Tensor) -> Result<()> {
    const OP: &str = "argmax";
    same_device(OP, x, ids)?;
    expect_dtype(OP, ids, DType::U32)?;
    if x.rank() != 2 {
        return Err(Error::shape(OP, format!("expected rows of logits [rows, len], got {}", x.shape())));
    }
    if ids.layout().offset != 0 || ids.numel() < x.dims()[0] {
        return Err(Error::shape(OP, format!("{} ids cannot take {} rows from element 0", ids.shape(), x.dims()[0])));
    }
    let [rows, len] = *x.dims() else { unreachable!("rank checked above") };
    if len >= ARGMAX_SPLIT_MIN_LEN && x.dtype() == DType::F32 {
        return gpu_argmax_split(x, rows, len, ids);
    }
    gpu_reduce_into(ReduceOp::ArgMax, x, 1, Some(ids)).map(|_| ())
}

/// Rows at least this long take the two-pass argmax (argmax_split.wgsl): SmolLM2's 49,152
/// logits 21-22 µs in one workgroup on the H100.
const ARGMAX_SPLIT_MIN_LEN: usize = 4096;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct ArgmaxSplitParams {
    rows: u32,
    len: u32,
    offset: u32,
    groups: u32,
}

fn gpu_argmax_split(x: &Tensor, rows: usize, len: usize, ids: &Tensor) -> Result<()> {
    const OP: &str = "argmax";
    let ctx = gpu_of(OP, x)?;
    let x = x.contiguous()?;
    let groups = len.div_ceil(1024);
    let params = ArgmaxSplitParams {
        rows: to_u32(OP, rows)?,
        len: to_u32(OP, len)?,
        offset: to_u32(OP, x.layout().offset)?,
        groups: to_u32(OP, groups)?,
    };
    to_u32(OP, rows * groups)?;
    let max = ctx.caps.max_workgroups() as usize;
    if groups > max || rows > max {
        return Err(Error::shape(OP, format!("{rows} rows of {len} exceed one dispatch's workgroups")));
    }
    let part_val = Tensor::gpu_empty([rows * groups], DType::F32, x.device())?;
    let part_idx = Tensor::gpu_empty([rows * groups], DType::U32, x.device())?;
    let binds =
        [Bind::Whole(buf(&x)?), Bind::Whole(buf(&part_val)?), Bind::Whole(buf(&part_idx)?), Bind::Whole(buf(ids)?)];
    let src = include_str!("argmax_split.wgsl");
    let partial = ctx.pipeline(&KernelSpec::new("argmax_partial", src, "argmax_partial"), &[])?;
    let fin = ctx.pipeline(&KernelSpec::new("argmax_final", src, "argmax_final"), &[])?;
    let bytes = bytemuck::bytes_of(&params);
    ctx.dispatch(&partial, OP, bytes, &binds, [groups as u32, rows as u32, 1])?;
    ctx.dispatch(&fin, OP, bytes, &binds, [rows as u32, 1, 1])
}

fn gpu_reduce_into(op: ReduceOp, x: &Tensor, axis: usize, ids: Option<&Tensor>) -> Result<Tensor> {
    let name = op.name();
    expect_dtype(name, x, DType::F32)?;
    let ctx = gpu_of(name, x)?;
    let (outer, len, inner, out_shape) = split(name, x, axis)?;
    let x = x.contiguous()?;
    let n_out = to_u32(name, outer * inner)?;
    let vals = Tensor::gpu_empty(out_shape.clone(), DType::F32, x.device())?;
    let idxs = match ids {
        Some(t) => t.clone(),
        None => Tensor::gpu_empty(out_shape.clone(), DType::U32, x.device())?,
    };
    let params = AxisParams {
        outer: to_u32(name, outer)?,
        len: to_u32(name, len)?,
        inner: to_u32(name, inner)?,
        n_out,
        scale: if op == ReduceOp::Mean { 1.0 / len as f32 } else { 1.0 },
        offset: to_u32(name, x.layout().offset)?,
        _pad: [0; 2],
    };
    let (init, better, is_sum) = match op {
        ReduceOp::Sum | ReduceOp::Mean => ("0.0", "return false;", "true"),
        ReduceOp::Max | ReduceOp::ArgMax => {
            ("bitcast<f32>(0xff800000u)", "return a > b || (a == b && ia < ib);", "false")
        }
        ReduceOp::Min => ("bitcast<f32>(0x7f800000u)", "return a < b || (a == b && ia < ib);", "false"),
    };
    let kind = match op {
        ReduceOp::Sum | ReduceOp::Mean => "sum",
        ReduceOp::Max | ReduceOp::ArgMax => "max",
        ReduceOp::Min => "min",
    };
    let spec = KernelSpec::new(format!("reduce_{kind}"), include_str!("reduce.wgsl"), "reduce_axis");
    let pipeline = ctx.pipeline(&spec, &[("INIT", init), ("BETTER", better), ("IS_SUM", is_sum)])?;
    ctx.dispatch(
        &pipeline,
        name,
        bytemuck::bytes_of(&params),
        &[Bind::Whole(buf(&x)?), Bind::Whole(buf(&vals)?), Bind::Whole(buf(&idxs)?)],
        ctx.grid_1d(n_out),
    )?;
    Ok(if op == ReduceOp::ArgMax { idxs } else { vals })
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct DotParams {
    n: u32,
    a_off: u32,
    b_off: u32,
    n_partials: u32,
}

pub fn gpu_dot(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    check_dot(a, b)?;
    expect_dtype("dot", a, DType::F32)?;
    expect_dtype("dot", b, DType::F32)?;
    let ctx = gpu_of("dot", a)?;
    let (a, b) = (a.contiguous()?, b.contiguous()?);
    let n = to_u32("dot", a.numel())?;
    // Enough workgroups to fill a big GPU, few enough for one workgroup to add them up.
    let groups = n.div_ceil(256 * 4).clamp(1, 1024);
    let partials = Tensor::gpu_empty([groups as usize], DType::F32, a.device())?;
    let out = Tensor::gpu_empty(Vec::<usize>::new(), DType::F32, a.device())?;
    let params = DotParams {
        n,
        a_off: to_u32("dot", a.layout().offset)?,
        b_off: to_u32("dot", b.layout().offset)?,
        n_partials: groups,
    };
    let p1 = ctx.pipeline(&KernelSpec::new("dot_partial", include_str!("dot.wgsl"), "dot_partial"), &[])?;
    let p2 = ctx.pipeline(&KernelSpec::new("sum_final", include_str!("sum_final.wgsl"), "sum_final"), &[])?;
    let bytes = bytemuck::bytes_of(&params);
    ctx.dispatch(
        &p1,
        "dot",
        bytes,
        &[Bind::Whole(buf(&a)?), Bind::Whole(buf(&b)?), Bind::Whole(buf(&partials)?)],
        [groups, 1, 1],
    )?;
    ctx.dispatch(&p2, "dot", bytes, &[Bind::Whole(buf(&partials)?), Bind::Whole(buf(&out)?)], [1, 1, 1])?;
    Ok(out)
}

impl Tensor {
    pub fn reduce(&self, op: ReduceOp, axis: usize) -> Result<Tensor> {
        self.device().backend().reduce(op, self, axis)
    }
    pub fn sum(&self, axis: usize) -> Result<Tensor> {
        self.reduce(ReduceOp::Sum, axis)
    }
    pub fn mean(&self, axis: usize) -> Result<Tensor> {
        self.reduce(ReduceOp::Mean, axis)
    }
    pub fn max(&self, axis: usize) -> Result<Tensor> {
        self.reduce(ReduceOp::Max, axis)
    }
    pub fn min(&self, axis: usize) -> Result<Tensor> {
        self.reduce(ReduceOp::Min, axis)
    }
    pub fn argmax(&self, axis: usize) -> Result<Tensor> {
        self.reduce(ReduceOp::ArgMax, axis)
    }
    pub fn dot(&self, other: &Tensor) -> Result<Tensor> {
        same_device("dot", self, other)?;
        self.device().backend().dot(self, other)
    }
}
