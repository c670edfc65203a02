//! Elementwise ops: binary with numpy broadcasting (arithmetic and comparisons), `where`, and
//! affine `x * mul + add`. CPU reference and WGSL (`elementwise.wgsl`, `unary.wgsl`) side by side.
//!
//! GPU paths, fastest first: `*_vec4` when the operands are contiguous and their element counts
//! and offsets are multiples of 4 (16-byte loads reach the copy bandwidth); the scalar
//! contiguous kernel; the strided kernel for any other view or broadcast. The contiguous binary
//! kernels also take an operand broadcast along leading dims (a bias [C] against [T, C], a
//! scalar) as `i % numel`, which is far cheaper than the strided kernel's per-dim divisions.
//!
//! CPU: the output is walked as rows after merging the dims that every operand has contiguous
//! (`Walk`), so a same-shape op is one long row and a broadcast bias add is rows with inner
//! strides (1, 1) or (1, 0): plain loops that vectorise. Large outputs are split into chunks
//! run on rayon (`par_fill`); small ones stay on the calling thread.

use rayon::prelude::*;

use super::{broadcast_layout, broadcast_shape, expect_dtype, gpu_of, same_device, to_u32, Dims8, STRIDED_WGSL};
use crate::error::{Error, Result};
use crate::gpu::{Bind, KernelSpec};
use crate::tensor::{CpuStorage, DType, Shape, Tensor};

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

// ---- CPU loops: row by row over merged dims, in parallel when large -----------------------

/// Defines `fn name(args)` that runs its body compiled for AVX-512F, AVX2 or the baseline
/// (SSE2 on x86-64), whichever this CPU has. The arithmetic is the same (Rust never fuses a
/// multiply and an add on its own), so the results are too, only the vector width differs
/// (16, 8 or 4 f32 lanes). For loops written to vectorise: every call inside the body must be
/// `#[inline(always)]` to be compiled for the wider target too.
macro_rules! multiversion {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $body:block) => {
        $(#[$m])*
        $vis fn $name($($arg: $ty),*) {
            #[inline(always)]
            fn body($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn avx512($($arg: $ty),*) {
                    body($($arg),*)
                }
                #[target_feature(enable = "avx2")]
                unsafe fn avx2($($arg: $ty),*) {
                    body($($arg),*)
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has AVX-512F (checked just above).
                    return unsafe { avx512($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU has AVX2 (checked just above).
                    return unsafe { avx2($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}
pub(crate) use multiversion;

/// Elements below which a CPU elementwise op stays on the calling thread: a rayon fork/join
/// costs microseconds, about what 30,000 f32 additions take.
pub(crate) const PAR_MIN: usize = 1 << 15;

/// Fills `out` by `f(start, chunk)` (chunk = out[start..start + len]), in parallel chunks of at
/// least PAR_MIN / 2 elements when `out` is large, on the calling thread otherwise.
pub(crate) fn par_fill(out: &mut [f32], f: impl Fn(usize, &mut [f32]) + Sync) {
    let n = out.len();
    let threads = rayon::current_num_threads();
    if n < PAR_MIN || threads == 1 {
        f(0, out);
        return;
    }
    // A few chunks per thread balance the load; multiples of 64 keep vector loops aligned.
    let chunk = n.div_ceil(threads * 4).max(PAR_MIN / 2).next_multiple_of(64);
    out.par_chunks_mut(chunk).enumerate().for_each(|(i, o)| f(i * chunk, o));
}

/// An output shape walked as rows, with the storage strides and offset of each of K operands.
/// Dims of size 1 are dropped and neighbouring dims merged where every operand is contiguous
/// across them, so a same-shape op on contiguous data is one long row and a bias add
/// [T, C] + [C] is T rows of C (inner strides 1 and 1), and `pos [T, C] + words [B, T, C]`
/// B rows of T*C.
struct Walk<const K: usize> {
    dims: Vec<usize>,
    strides: [Vec<usize>; K],
    offs: [usize; K],
}

impl<const K: usize> Walk<K> {
    fn new(shape: &[usize], strides: [&[usize]; K], offs: [usize; K]) -> Walk<K> {
        let mut dims: Vec<usize> = Vec::new();
        let mut st: [Vec<usize>; K] = std::array::from_fn(|_| Vec::new());
        for (i, &d) in shape.iter().enumerate() {
            if d == 1 {
                continue;
            }
            if let Some(last) = dims.last_mut() {
                if (0..K).all(|k| st[k].last() == Some(&(strides[k][i] * d))) {
                    *last *= d;
                    for k in 0..K {
                        if let Some(s) = st[k].last_mut() {
                            *s = strides[k][i];
                        }
                    }
                    continue;
                }
            }
            dims.push(d);
            for k in 0..K {
                st[k].push(strides[k][i]);
            }
        }
        if dims.is_empty() {
            dims.push(1);
            for s in st.iter_mut() {
                s.push(0);
            }
        }
        Walk { dims, strides: st, offs }
    }

    /// The inner (last-dim) stride of each operand.
    fn inner(&self) -> [usize; K] {
        std::array::from_fn(|k| self.strides[k][self.dims.len() - 1])
    }

    /// Calls `seg(pos, len, bases)` for the pieces of output elements [start, end) that lie in
    /// one row: output pos..pos+len reads operand k at bases[k] + j * inner[k].
    fn segments(&self, start: usize, end: usize, mut seg: impl FnMut(usize, usize, [usize; K])) {
        let r = self.dims.len();
        let last = self.dims[r - 1];
        let inner = self.inner();
        let mut pos = start;
        while pos < end {
            let (mut row, col) = (pos / last, pos % last);
            let len = (last - col).min(end - pos);
            let mut bases: [usize; K] = std::array::from_fn(|k| self.offs[k] + col * inner[k]);
            for d in (0..r - 1).rev() {
                let i = row % self.dims[d];
                row /= self.dims[d];
                for (k, b) in bases.iter_mut().enumerate() {
                    *b += i * self.strides[k][d];
                }
            }
            seg(pos, len, bases);
            pos += len;
        }
    }
}

/// `f(src, dst)` over every element of `x` (whose storage is `v`), in parallel chunks when
/// large; a strided view is gathered chunk by chunk first. The row-major result.
pub(crate) fn cpu_map(x: &Tensor, v: &[f32], f: impl Fn(&[f32], &mut [f32]) + Sync) -> Vec<f32> {
    let n = x.numel();
    let mut out = vec![0f32; n];
    let l = x.layout();
    if x.is_contiguous() {
        let src = &v[l.offset..l.offset + n];
        par_fill(&mut out, |start, o| f(&src[start..start + o.len()], o));
    } else {
        let walk = Walk::new(l.dims(), [&l.strides], [l.offset]);
        let [inner] = walk.inner();
        par_fill(&mut out, |start, o| {
            let mut tmp = Vec::with_capacity(o.len());
            walk.segments(start, start + o.len(), |_, len, [base]| {
                tmp.extend((0..len).map(|j| v[base + j * inner]));
            });
            f(&tmp, o);
        });
    }
    out
}

/// One row piece of a binary op: `o[j] = f(a[ia + j*sa], b[ib + j*sb])`, with the common
/// stride pairs written out so that they vectorise.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn binary_row(
    f: impl Fn(f32, f32) -> f32,
    a: &[f32],
    ia: usize,
    sa: usize,
    b: &[f32],
    ib: usize,
    sb: usize,
    o: &mut [f32],
) {
    let n = o.len();
    match (sa, sb) {
        (1, 1) => {
            for ((o, &x), &y) in o.iter_mut().zip(&a[ia..ia + n]).zip(&b[ib..ib + n]) {
                *o = f(x, y);
            }
        }
        (1, 0) => {
            let y = b[ib];
            for (o, &x) in o.iter_mut().zip(&a[ia..ia + n]) {
                *o = f(x, y);
            }
        }
        (0, 1) => {
            let x = a[ia];
            for (o, &y) in o.iter_mut().zip(&b[ib..ib + n]) {
                *o = f(x, y);
            }
        }
        _ => {
            for (j, o) in o.iter_mut().enumerate() {
                *o = f(a[ia + j * sa], b[ib + j * sb]);
            }
        }
    }
}

fn binary_walk(f: impl Fn(f32, f32) -> f32 + Sync + Copy, walk: &Walk<2>, va: &[f32], vb: &[f32], out: &mut [f32]) {
    let [sa, sb] = walk.inner();
    par_fill(out, |start, o| {
        walk.segments(start, start + o.len(), |pos, len, [ia, ib]| {
            binary_row(f, va, ia, sa, vb, ib, sb, &mut o[pos - start..pos - start + len]);
        });
    });
}

pub fn cpu_binary(op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let name = op.name();
    let (va, vb) = (f32_data(name, a)?, f32_data(name, b)?);
    let shape = broadcast_shape(name, a.dims(), b.dims())?;
    let sa = broadcast_layout(name, a.layout(), &shape)?;
    let sb = broadcast_layout(name, b.layout(), &shape)?;
    let walk = Walk::new(&shape, [&sa, &sb], [a.layout().offset, b.layout().offset]);
    let mut out = vec![0f32; shape.iter().product()];
    // One instance per op, so that each inner loop is straight arithmetic.
    let o = &mut out;
    match op {
        BinaryOp::Add => binary_walk(|x, y| x + y, &walk, va, vb, o),
        BinaryOp::Sub => binary_walk(|x, y| x - y, &walk, va, vb, o),
        BinaryOp::Mul => binary_walk(|x, y| x * y, &walk, va, vb, o),
        BinaryOp::Div => binary_walk(|x, y| x / y, &walk, va, vb, o),
        BinaryOp::Maximum => binary_walk(f32::max, &walk, va, vb, o),
        BinaryOp::Minimum => binary_walk(f32::min, &walk, va, vb, o),
        _ => binary_walk(|x, y| op.apply(x, y), &walk, va, vb, o),
    }
    Ok(Tensor::cpu(CpuStorage::F32(out), Shape(shape)))
}

pub fn cpu_affine(x: &Tensor, mul: f32, add: f32) -> Result<Tensor> {
    let v = f32_data("affine", x)?;
    let out = cpu_map(x, v, |src, dst| {
        for (o, &e) in dst.iter_mut().zip(src) {
            *o = e * mul + add;
        }
    });
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
    let st = |t: &Tensor| broadcast_layout("where", t.layout(), &shape);
    let (sc, sa, sb) = (st(cond)?, st(a)?, st(b)?);
    let offs = [cond.layout().offset, a.layout().offset, b.layout().offset];
    let walk = Walk::new(&shape, [&sc, &sa, &sb], offs);
    let [ic, ia, ib] = walk.inner();
    let mut out = vec![0f32; shape.iter().product()];
    par_fill(&mut out, |start, o| {
        walk.segments(start, start + o.len(), |pos, len, [bc, ba, bb]| {
            for (j, o) in o[pos - start..pos - start + len].iter_mut().enumerate() {
                *o = if vc[bc + j * ic] != 0.0 { va[ba + j * ia] } else { vb[bb + j * ib] };
            }
        });
    });
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
        .with(super::unary::UNARY_MATH_WGSL)
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

#[cfg(test)]
mod tests {
    //! The CPU loops (merged dims, row pieces, parallel chunks) against a plain element-by-element
    //! walk of the same views, at sizes past PAR_MIN so that the parallel path runs, with
    //! broadcast, transposed and offset operands.
    use super::{BinaryOp, PAR_MIN};
    use crate::ops::{broadcast_layout, broadcast_shape};
    use crate::tensor::{Layout, Shape};
    use crate::testing::rand_vec;
    use crate::{Device, Result, Tensor};

    fn t(seed: u64, dims: &[usize]) -> Tensor {
        let n = dims.iter().product();
        Tensor::from_vec(rand_vec(seed, n), dims, &Device::Cpu).expect("tensor")
    }

    /// Storage index of every element of `shape` for a view with `strides` and `offset`.
    fn indices(shape: &[usize], strides: Vec<usize>, offset: usize) -> Vec<usize> {
        Layout { shape: Shape(shape.to_vec()), strides, offset }.storage_indices().collect()
    }

    fn naive_binary(op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Vec<f32>> {
        let shape = broadcast_shape("t", a.dims(), b.dims())?;
        let (va, vb) = (a.to_device(&Device::Cpu)?, b.to_device(&Device::Cpu)?);
        let (da, db) = (super::f32_data("t", &va)?, super::f32_data("t", &vb)?);
        let ia = indices(&shape, broadcast_layout("t", a.layout(), &shape)?, a.layout().offset);
        let ib = indices(&shape, broadcast_layout("t", b.layout(), &shape)?, b.layout().offset);
        Ok(ia.iter().zip(&ib).map(|(&i, &j)| op.apply(da[i], db[j])).collect())
    }

    #[test]
    fn binary_loops_match_element_walk() -> Result<()> {
        let cases: Vec<(Tensor, Tensor)> = vec![
            (t(1, &[3, 200, 70]), t(2, &[3, 200, 70])),               // one long row
            (t(3, &[3, 200, 70]), t(4, &[70])),                       // bias: (1, 0)... rows
            (t(5, &[3, 200, 70]), t(6, &[200, 1])),                   // column broadcast
            (t(7, &[1, 200, 1]), t(8, &[300, 1, 70])),                // both broadcast
            (t(9, &[300, 200]).transpose(0, 1)?, t(10, &[200, 300])), // transposed operand
            (t(11, &[7]).narrow(0, 3, 1)?, t(12, &[250, 170])),       // scalar view at an offset
            (t(13, &[500, 90]).narrow(1, 5, 80)?, t(14, &[500, 1])),  // rows with a gap
            (t(15, &[2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2]), t(16, &[2])), // rank 16, rows of 2
        ];
        for (i, (a, b)) in cases.iter().enumerate() {
            let n: usize = broadcast_shape("t", a.dims(), b.dims())?.iter().product();
            assert!(n >= PAR_MIN, "case {i} is too small to run in parallel");
            for op in [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Div, BinaryOp::Maximum, BinaryOp::Lt] {
                let got = a.binary(op, b)?.to_vec_f32()?;
                assert_eq!(got, naive_binary(op, a, b)?, "case {i} {op:?}");
                let got = b.binary(op, a)?.to_vec_f32()?;
                assert_eq!(got, naive_binary(op, b, a)?, "case {i} {op:?} swapped");
            }
        }
        Ok(())
    }

    #[test]
    fn strided_unary_affine_and_where_match_element_walk() -> Result<()> {
        let x = t(20, &[300, 211]).transpose(0, 1)?.narrow(0, 3, 200)?;
        let v = x.contiguous()?.to_vec_f32()?;
        let want: Vec<f32> = v.iter().map(|&e| e * 0.5 - 2.0).collect();
        assert_eq!(x.affine(0.5, -2.0)?.to_vec_f32()?, want);
        let want: Vec<f32> = v.iter().map(|&e| crate::ops::unary::gelu_erf_f32(e)).collect();
        assert_eq!(x.gelu()?.to_vec_f32()?, want);
        let want: Vec<f32> = v.iter().map(|&e| e.exp()).collect();
        let got = x.exp()?.to_vec_f32()?;
        assert!(got.iter().zip(&want).all(|(g, w)| (g - w).abs() <= 1e-6 * w.abs()));

        let cond = t(21, &[200, 1]).gt(&Tensor::from_vec(vec![0.0f32], [1], &Device::Cpu)?)?;
        let (a, b) = (t(22, &[300, 200]).transpose(0, 1)?, t(23, &[300]));
        let got = cond.where_cond(&a, &b)?.to_vec_f32()?;
        let (c, av, bv) = (cond.to_vec_f32()?, a.contiguous()?.to_vec_f32()?, b.to_vec_f32()?);
        let want: Vec<f32> = (0..200 * 300).map(|k| if c[k / 300] != 0.0 { av[k] } else { bv[k % 300] }).collect();
        assert_eq!(got, want);
        Ok(())
    }
}
