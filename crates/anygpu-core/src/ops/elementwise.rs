//! Elementwise ops: binary with numpy broadcasting (arithmetic and comparisons), `where`, and
//! affine `x * mul + add`. CPU reference and WGSL (`elementwise.wgsl`, `unary.wgsl`) side by side.
//!
//! GPU paths, fastest first: `*_vec4` when the operands are contiguous and their element counts
//! and offsets are multiples of 4 (16-byte loads reach the copy bandwidth); the scalar
//! contiguous kernel; the strided kernel for any other view or broadcast. The contiguous binary
//! kernels also take an operand broadcast along leading dims (a bias [C] against [T, C], a
//! scalar) as `i % numel`, which is far cheaper than the strided kernel's per-dim divisions.

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
    /// Comparisons give f32 1.0 (true) or 0.0 (false), IEEE semantics: a NaN operand compares
    /// unequal to everything (so `ne` is 1.0 and every other comparison 0.0). The kernels test
    /// for NaN on the bits: WGSL lets a compiler assume no NaN, and lavapipe's `!=` is false
    /// for a NaN operand.
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl BinaryOp {
    /// Every op, for tests and benchmarks.
    pub const ALL: [BinaryOp; 12] = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Maximum,
        BinaryOp::Minimum,
        BinaryOp::Eq,
        BinaryOp::Ne,
        BinaryOp::Lt,
        BinaryOp::Le,
        BinaryOp::Gt,
        BinaryOp::Ge,
    ];

    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Maximum => "maximum",
            BinaryOp::Minimum => "minimum",
            BinaryOp::Eq => "eq",
            BinaryOp::Ne => "ne",
            BinaryOp::Lt => "lt",
            BinaryOp::Le => "le",
            BinaryOp::Gt => "gt",
            BinaryOp::Ge => "ge",
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
            BinaryOp::Eq => "select(0.0, 1.0, ordered(x, y) && x == y)",
            BinaryOp::Ne => "select(0.0, 1.0, !ordered(x, y) || x != y)",
            BinaryOp::Lt => "select(0.0, 1.0, ordered(x, y) && x < y)",
            BinaryOp::Le => "select(0.0, 1.0, ordered(x, y) && x <= y)",
            BinaryOp::Gt => "select(0.0, 1.0, ordered(x, y) && x > y)",
            BinaryOp::Ge => "select(0.0, 1.0, ordered(x, y) && x >= y)",
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
            BinaryOp::Eq => (x == y) as u8 as f32,
            BinaryOp::Ne => (x != y) as u8 as f32,
            BinaryOp::Lt => (x < y) as u8 as f32,
            BinaryOp::Le => (x <= y) as u8 as f32,
            BinaryOp::Gt => (x > y) as u8 as f32,
            BinaryOp::Ge => (x >= y) as u8 as f32,
        }
    }
}

pub(crate) fn f32_data<'a>(op: &'static str, t: &'a Tensor) -> Result<&'a [f32]> {
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

/// The broadcast shape of `where`'s three operands, with a message naming all three.
fn where_shape(cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Vec<usize>> {
    let s = broadcast_shape("where", a.dims(), b.dims()).and_then(|s| broadcast_shape("where", cond.dims(), &s));
    s.map_err(|_| {
        Error::shape(
            "where",
            format!("cond {}, a {} and b {} do not broadcast to one shape", cond.shape(), a.shape(), b.shape()),
        )
    })
}

/// `cond != 0 ? a : b` (a NaN condition counts as true, being nonzero; -0.0 as false),
/// broadcasting all three.
pub fn cpu_where(cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (vc, va, vb) = (f32_data("where", cond)?, f32_data("where", a)?, f32_data("where", b)?);
    let shape = where_shape(cond, a, b)?;
    let idx = |t: &Tensor| -> Result<Vec<usize>> {
        Ok(strided_indices(&shape, &broadcast_layout("where", t.layout(), &shape)?, t.layout().offset))
    };
    let (ic, ia, ib) = (idx(cond)?, idx(a)?, idx(b)?);
    let out: Vec<f32> =
        (0..ic.len()).into_par_iter().map(|k| if vc[ic[k]] != 0.0 { va[ia[k]] } else { vb[ib[k]] }).collect();
    Ok(Tensor::cpu(CpuStorage::F32(out), Shape(shape)))
}

/// vec4s each thread of the `*_vec4` kernels handles. Measured on an H100 (1 GiB f32, the
/// `bench_elementwise_bandwidth` test): 8 gave unary 2.77-2.80 TB/s and add 2.85-2.87 TB/s,
/// 1, 2 and 4 were 1-5% slower; 16 (and loading into a local array first) much slower.
pub(crate) const VEC4_PER_THREAD: u32 = 8;

/// Whether `n` elements of contiguous views can be read as vec4: `n` and every one of `parts`
/// (the views' offsets, a broadcast operand's size) must be multiples of 4.
fn vec4_ok(n: usize, parts: &[usize]) -> bool {
    n.is_multiple_of(4) && parts.iter().all(|o| o.is_multiple_of(4))
}

/// Workgroups for a `*_vec4` kernel over `n` elements.
fn vec4_groups(n: u32) -> u32 {
    (n / 4).div_ceil(256 * VEC4_PER_THREAD)
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
    a_mod: u32,
    b_mod: u32,
    shape: Dims8,
    a_strides: Dims8,
    b_strides: Dims8,
}

/// For an operand that is contiguous and broadcast only along leading dims of `shape` (a bias
/// [C] against [T, C], a scalar, or the same shape): its element count `m`, so that output
/// element i reads element `i % m`. `None` when it needs the strided kernel.
fn suffix_broadcast(t: &Tensor, shape: &[usize]) -> Option<usize> {
    let dims = t.dims();
    let lead = dims.iter().take_while(|&&d| d == 1).count();
    (t.is_contiguous() && shape.ends_with(&dims[lead..])).then(|| t.numel())
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
    let (oa, ob) = (a.layout().offset, b.layout().offset);
    let mods = suffix_broadcast(a, &shape).zip(suffix_broadcast(b, &shape));
    let (ma, mb) = mods.unwrap_or((1, 1));
    let vec4 = mods.is_some() && vec4_ok(out.numel(), &[oa, ob, ma, mb]);
    // The vec4 kernel counts in vec4s.
    let unit = if vec4 { 4 } else { 1 };
    let params = BinaryParams {
        n: n / unit,
        rank: shape.len() as u32,
        a_off: to_u32(name, oa)? / unit,
        b_off: to_u32(name, ob)? / unit,
        s0: 0.0,
        s1: 0.0,
        a_mod: to_u32(name, ma)? / unit,
        b_mod: to_u32(name, mb)? / unit,
        shape: Dims8::new(name, &shape)?,
        a_strides: Dims8::new(name, &broadcast_layout(name, a.layout(), &shape)?)?,
        b_strides: Dims8::new(name, &broadcast_layout(name, b.layout(), &shape)?)?,
    };
    let (entry, groups) = match (vec4, mods.is_some()) {
        (true, _) => ("binary_vec4", vec4_groups(n)),
        (false, true) => ("binary_contiguous", n.div_ceil(256)),
        (false, false) => ("binary_strided", n.div_ceil(256)),
    };
    let spec = KernelSpec::new(format!("{entry}_{name}"), include_str!("elementwise.wgsl"), entry)
        .with(STRIDED_WGSL)
        .constant_u32("VPT", VEC4_PER_THREAD);
    let pipeline = ctx.pipeline(&spec, &[("EXPR", op.wgsl())])?;
    let (ba, bb, bo) = (buf(a)?, buf(b)?, buf(&out)?);
    ctx.dispatch(
        &pipeline,
        name,
        bytemuck::bytes_of(&params),
        &[Bind::Whole(ba), Bind::Whole(bb), Bind::Whole(bo)],
        ctx.grid_1d(groups),
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

/// Runs a unary f32 kernel `expr` (over `x`, `p.s0`, `p.s1`, and the helper functions of
/// `unary.wgsl`) on any view of `x`.
pub(crate) fn gpu_unary_expr(name: &'static str, expr: &'static str, x: &Tensor, s0: f32, s1: f32) -> Result<Tensor> {
    expect_dtype(name, x, DType::F32)?;
    let ctx = gpu_of(name, x)?;
    let out = Tensor::gpu_empty(x.shape().clone(), DType::F32, x.device())?;
    let n = to_u32(name, x.numel())?;
    if n == 0 {
        return Ok(out);
    }
    let l = x.layout();
    let contiguous = x.is_contiguous();
    let vec4 = contiguous && vec4_ok(x.numel(), &[l.offset]);
    let unit = if vec4 { 4 } else { 1 };
    let params = UnaryParams {
        n: n / unit,
        rank: l.dims().len() as u32,
        a_off: to_u32(name, l.offset)? / unit,
        _pad0: 0,
        s0,
        s1,
        _pad: [0; 2],
        shape: Dims8::new(name, l.dims())?,
        a_strides: Dims8::new(name, &l.strides)?,
    };
    let (entry, groups) = match (vec4, contiguous) {
        (true, _) => ("unary_vec4", vec4_groups(n)),
        (false, true) => ("unary_contiguous", n.div_ceil(256)),
        (false, false) => ("unary_strided", n.div_ceil(256)),
    };
    let spec = KernelSpec::new(format!("{entry}_{name}"), include_str!("unary.wgsl"), entry)
        .with(STRIDED_WGSL)
        .constant_u32("VPT", VEC4_PER_THREAD);
    let pipeline = ctx.pipeline(&spec, &[("EXPR", expr)])?;
    ctx.dispatch(
        &pipeline,
        name,
        bytemuck::bytes_of(&params),
        &[Bind::Whole(buf(x)?), Bind::Whole(buf(&out)?)],
        ctx.grid_1d(groups),
    )?;
    Ok(out)
}

pub fn gpu_affine(x: &Tensor, mul: f32, add: f32) -> Result<Tensor> {
    gpu_unary_expr("affine", "x * p.s0 + p.s1", x, mul, add)
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct WhereParams {
    n: u32,
    rank: u32,
    c_off: u32,
    a_off: u32,
    b_off: u32,
    contiguous: u32,
    _pad: [u32; 2],
    shape: Dims8,
    c_strides: Dims8,
    a_strides: Dims8,
    b_strides: Dims8,
}

pub fn gpu_where(cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    const OP: &str = "where";
    same_device(OP, cond, a)?;
    same_device(OP, a, b)?;
    for t in [cond, a, b] {
        expect_dtype(OP, t, DType::F32)?;
    }
    let ctx = gpu_of(OP, a)?;
    let shape = where_shape(cond, a, b)?;
    let out = Tensor::gpu_empty(shape.clone(), DType::F32, a.device())?;
    let n = to_u32(OP, out.numel())?;
    if n == 0 {
        return Ok(out);
    }
    let contiguous = [cond, a, b].iter().all(|t| t.dims() == shape.as_slice() && t.is_contiguous());
    let strides = |t: &Tensor| Dims8::new(OP, &broadcast_layout(OP, t.layout(), &shape)?);
    let params = WhereParams {
        n,
        rank: shape.len() as u32,
        c_off: to_u32(OP, cond.layout().offset)?,
        a_off: to_u32(OP, a.layout().offset)?,
        b_off: to_u32(OP, b.layout().offset)?,
        contiguous: contiguous as u32,
        _pad: [0; 2],
        shape: Dims8::new(OP, &shape)?,
        c_strides: strides(cond)?,
        a_strides: strides(a)?,
        b_strides: strides(b)?,
    };
    let spec = KernelSpec::new("where_cond", include_str!("elementwise.wgsl"), "where_cond")
        .with(STRIDED_WGSL)
        .constant_u32("VPT", VEC4_PER_THREAD);
    // `where` does not use the op expression; any valid one compiles the module.
    let pipeline = ctx.pipeline(&spec, &[("EXPR", "x")])?;
    ctx.dispatch(
        &pipeline,
        OP,
        bytemuck::bytes_of(&params),
        &[Bind::Whole(buf(cond)?), Bind::Whole(buf(a)?), Bind::Whole(buf(b)?), Bind::Whole(buf(&out)?)],
        ctx.grid_1d(n.div_ceil(256)),
    )?;
    Ok(out)
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
    /// 1.0 where `self == other`, else 0.0 (broadcasting).
    pub fn eq(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Eq, other)
    }
    /// 1.0 where `self != other` (or either is NaN), else 0.0.
    pub fn ne(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Ne, other)
    }
    /// 1.0 where `self < other`, else 0.0.
    pub fn lt(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Lt, other)
    }
    /// 1.0 where `self <= other`, else 0.0.
    pub fn le(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Le, other)
    }
    /// 1.0 where `self > other`, else 0.0.
    pub fn gt(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Gt, other)
    }
    /// 1.0 where `self >= other`, else 0.0.
    pub fn ge(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Ge, other)
    }
    /// `self != 0 ? a : b` elementwise (`self` is the f32 condition), broadcasting all three.
    pub fn where_cond(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        same_device("where", self, a)?;
        same_device("where", a, b)?;
        self.device().backend().where_cond(self, a, b)
    }
    /// `self * mul + add`.
    pub fn affine(&self, mul: f32, add: f32) -> Result<Tensor> {
        self.device().backend().affine(self, mul, add)
    }
    pub fn scale(&self, s: f32) -> Result<Tensor> {
        self.affine(s, 0.0)
    }
}
