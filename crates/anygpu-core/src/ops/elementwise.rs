//! Elementwise ops: binary with numpy broadcasting, and affine `x * mul + add`.
//! CPU reference and WGSL (`elementwise.wgsl`, `unary.wgsl`) side by side.

use rayon::prelude::*;

use super::{broadcast_layout, broadcast_shape, expect_dtype, gpu_of, same_device, to_u32, Dims8, STRIDED_WGSL};
use crate::error::{Error, Result};
use crate::gpu::{Bind, KernelSpec};
use crate::tensor::{CpuStorage, DType, Layout, Shape, Tensor};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Maximum,
    Minimum,
}

impl BinaryOp {
    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Maximum => "maximum",
            BinaryOp::Minimum => "minimum",
        }
    }
    fn wgsl(self) -> &'static str {
        match self {
            BinaryOp::Add => "x + y",
            BinaryOp::Sub => "x - y",
            BinaryOp::Mul => "x * y",
            BinaryOp::Div => "x / y",
            BinaryOp::Maximum => "max(x, y)",
            BinaryOp::Minimum => "min(x, y)",
        }
    }
    pub fn apply(self, x: f32, y: f32) -> f32 {
        match self {
            BinaryOp::Add => x + y,
            BinaryOp::Sub => x - y,
            BinaryOp::Mul => x * y,
            BinaryOp::Div => x / y,
            BinaryOp::Maximum => x.max(y),
            BinaryOp::Minimum => x.min(y),
        }
    }
}

fn f32_data<'a>(op: &'static str, t: &'a Tensor) -> Result<&'a [f32]> {
    match t.cpu_storage() {
        Some(CpuStorage::F32(v)) => Ok(v),
        Some(s) => Err(Error::mismatch(op, format!("expected f32, got {}", s.dtype()))),
        None => Err(Error::mismatch(op, "tensor is not on the CPU")),
    }
}

/// Storage index of every output element of `shape` for a view with `strides`/`offset`.
fn strided_indices(shape: &[usize], strides: &[usize], offset: usize) -> Vec<usize> {
    let l = Layout { shape: Shape(shape.to_vec()), strides: strides.to_vec(), offset };
    l.storage_indices().collect()
}

pub fn cpu_binary(op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let name = op.name();
    let (va, vb) = (f32_data(name, a)?, f32_data(name, b)?);
    let shape = broadcast_shape(name, a.dims(), b.dims())?;
    let out: Vec<f32> = if a.dims() == b.dims() && a.is_contiguous() && b.is_contiguous() {
        let (oa, ob) = (a.layout().offset, b.layout().offset);
        let n = a.numel();
        va[oa..oa + n].par_iter().zip(&vb[ob..ob + n]).map(|(&x, &y)| op.apply(x, y)).collect()
    } else {
        let sa = broadcast_layout(name, a.layout(), &shape)?;
        let sb = broadcast_layout(name, b.layout(), &shape)?;
        strided_indices(&shape, &sa, a.layout().offset)
            .into_iter()
            .zip(strided_indices(&shape, &sb, b.layout().offset))
            .map(|(i, j)| op.apply(va[i], vb[j]))
            .collect()
    };
    Ok(Tensor::cpu(CpuStorage::F32(out), Shape(shape)))
}

pub fn cpu_affine(x: &Tensor, mul: f32, add: f32) -> Result<Tensor> {
    let v = f32_data("affine", x)?;
    let out: Vec<f32> = x.layout().storage_indices().map(|i| v[i] * mul + add).collect();
    Ok(Tensor::cpu(CpuStorage::F32(out), x.shape().clone()))
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct BinaryParams {
    n: u32,
    rank: u32,
    a_off: u32,
    b_off: u32,
    s0: f32,
    s1: f32,
    _pad: [u32; 2],
    shape: Dims8,
    a_strides: Dims8,
    b_strides: Dims8,
}

pub fn gpu_binary(op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let name = op.name();
    same_device(name, a, b)?;
    expect_dtype(name, a, DType::F32)?;
    expect_dtype(name, b, DType::F32)?;
    let ctx = gpu_of(name, a)?;
    let shape = broadcast_shape(name, a.dims(), b.dims())?;
    let out = Tensor::gpu_empty(shape.clone(), DType::F32, a.device())?;
    let n = to_u32(name, out.numel())?;
    if n == 0 {
        return Ok(out);
    }
    let contiguous = a.dims() == b.dims() && a.is_contiguous() && b.is_contiguous();
    let params = BinaryParams {
        n,
        rank: shape.len() as u32,
        a_off: to_u32(name, a.layout().offset)?,
        b_off: to_u32(name, b.layout().offset)?,
        s0: 0.0,
        s1: 0.0,
        _pad: [0; 2],
        shape: Dims8::new(name, &shape)?,
        a_strides: Dims8::new(name, &broadcast_layout(name, a.layout(), &shape)?)?,
        b_strides: Dims8::new(name, &broadcast_layout(name, b.layout(), &shape)?)?,
    };
    let entry = if contiguous { "binary_contiguous" } else { "binary_strided" };
    let spec = KernelSpec::new(format!("{entry}_{name}"), include_str!("elementwise.wgsl"), entry).with(STRIDED_WGSL);
    let pipeline = ctx.pipeline(&spec, &[("EXPR", op.wgsl())])?;
    let (ba, bb, bo) = (buf(a)?, buf(b)?, buf(&out)?);
    ctx.dispatch(
        &pipeline,
        name,
        bytemuck::bytes_of(&params),
        &[Bind::Whole(ba), Bind::Whole(bb), Bind::Whole(bo)],
        ctx.grid_1d(n.div_ceil(256)),
    )?;
    Ok(out)
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct UnaryParams {
    n: u32,
    rank: u32,
    a_off: u32,
    _pad0: u32,
    s0: f32,
    s1: f32,
    _pad: [u32; 2],
    shape: Dims8,
    a_strides: Dims8,
}

/// Runs a unary f32 kernel `expr` (over `x`, `p.s0`, `p.s1`) on any view of `x`.
pub(crate) fn gpu_unary_expr(name: &'static str, expr: &'static str, x: &Tensor, s0: f32, s1: f32) -> Result<Tensor> {
    expect_dtype(name, x, DType::F32)?;
    let ctx = gpu_of(name, x)?;
    let out = Tensor::gpu_empty(x.shape().clone(), DType::F32, x.device())?;
    let n = to_u32(name, x.numel())?;
    if n == 0 {
        return Ok(out);
    }
    let l = x.layout();
    let params = UnaryParams {
        n,
        rank: l.dims().len() as u32,
        a_off: to_u32(name, l.offset)?,
        _pad0: 0,
        s0,
        s1,
        _pad: [0; 2],
        shape: Dims8::new(name, l.dims())?,
        a_strides: Dims8::new(name, &l.strides)?,
    };
    let entry = if x.is_contiguous() { "unary_contiguous" } else { "unary_strided" };
    let spec = KernelSpec::new(format!("{entry}_{name}"), include_str!("unary.wgsl"), entry).with(STRIDED_WGSL);
    let pipeline = ctx.pipeline(&spec, &[("EXPR", expr)])?;
    ctx.dispatch(
        &pipeline,
        name,
        bytemuck::bytes_of(&params),
        &[Bind::Whole(buf(x)?), Bind::Whole(buf(&out)?)],
        ctx.grid_1d(n.div_ceil(256)),
    )?;
    Ok(out)
}

pub fn gpu_affine(x: &Tensor, mul: f32, add: f32) -> Result<Tensor> {
    gpu_unary_expr("affine", "x * p.s0 + p.s1", x, mul, add)
}

pub(crate) fn buf(t: &Tensor) -> Result<&crate::gpu::GpuBuffer> {
    t.gpu_buffer().ok_or_else(|| Error::mismatch("dispatch", "tensor is not on a GPU"))
}

impl Tensor {
    pub fn binary(&self, op: BinaryOp, other: &Tensor) -> Result<Tensor> {
        same_device(op.name(), self, other)?;
        self.device().backend().binary(op, self, other)
    }
    pub fn add(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Add, other)
    }
    pub fn sub(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Sub, other)
    }
    pub fn mul(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Mul, other)
    }
    pub fn div(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Div, other)
    }
    pub fn maximum(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Maximum, other)
    }
    pub fn minimum(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Minimum, other)
    }
    /// `self * mul + add`.
    pub fn affine(&self, mul: f32, add: f32) -> Result<Tensor> {
        self.device().backend().affine(self, mul, add)
    }
    pub fn scale(&self, s: f32) -> Result<Tensor> {
        self.affine(s, 0.0)
    }
}
