//! Batched matmul `[.., M, K] x [.., K, N] -> [.., M, N]`, optional bias over N.
//! Either operand may be any strided view (a transpose costs nothing). The batch dims must be
//! equal, or one operand's batch must be 1 (shared across the batch).
//!
//! Dtypes: (f32, f32) -> f32, (f16, f16) -> f16 (f32 accumulation, one rounding at the end),
//! (f32, f16) and (f16, f32) -> f32 (an LLM's f32 activations x f16 weights). The bias may be
//! f32 or f16. The CPU reference computes in f32 through the `gemm` crate.
//!
//! GPU paths ([`MatmulPath`]), picked from the dtypes, the shapes and the capability profile,
//! or forced with `ANYGPU_MATMUL=simple|tiled|f16|coop` (read once; a forced path the call
//! cannot take is ignored) — [`gpu_matmul_path`] says which one a call takes:
//! - `simple` (matmul.wgsl): 64x64 tile, 4x4 outputs per thread, f32 only. Only when forced:
//!   `tiled` was faster at every shape measured, small and M = 1 ones included (H100: 6-15x,
//!   e.g. MiniLM's mean pooling [64, 1, 128] x [64, 128, 384] 1.2 ms -> 93 us; lavapipe:
//!   2.7-5.5x), where this kernel was once picked for products under 128 rows or columns.
//! - `tiled` (matmul_tiled.wgsl): 128x128 tile, 8x8 outputs per thread in registers, vec4
//!   global loads along whichever dim is contiguous, K double-buffered through workgroup
//!   memory (16 KiB with BK = 8, so it runs under WebGPU's default limits; BK = 16 where 32 KiB
//!   are allowed). f16 operands are read as packed words with `unpack2x16float`: no feature
//!   needed.
//! - `f16`: the same kernel with `enable f16;` and f16 vector loads/stores (needs SHADER_F16).
//! - `coop` (matmul_coop.wgsl): f16 x f16 on cooperative matrices (16x16x16, f32 accumulators;
//!   tensor cores), 128x128 tile, 8 subgroups of 32. Also (f32, f16) and (f16, f32): the f32
//!   operand is rounded to f16 as it is staged (relative error 2^-11 per element, as with
//!   llama.cpp's and PyTorch's f16 paths), the output is f32; (f32, f32) never takes it. Needs EXPERIMENTAL_COOPERATIVE_MATRIX with
//!   the (16, 16, 16) f16 -> f32 shape, SHADER_F16, subgroups of exactly 32, 46-48 KiB of
//!   workgroup memory, and A and B each contiguous along one of their two dims.
//!
//! Floor arithmetic for M = N = K = 4096 on the H100 SXM (132 SMs, ~1.98 GHz boost, HBM3
//! ~3.35 TB/s; 3.0 TB/s measured by a copy):
//! - work: 2 * 4096^3 = 137.4 GFLOP.
//! - f32 on the FP32 pipes: peak 132 * 128 lanes * 2 * 1.98 GHz = 66.9 TFLOP/s -> 2.05 ms;
//!   cuBLAS FP32 measured 51.6 TFLOP/s -> 2.66 ms. Bytes: A, B read and C written once =
//!   3 * 64 MiB = 201 MB -> 60 us at 3.35 TB/s: compute-bound by 35x. The 128x128 tile reads
//!   (128 + 128) * K * 4 B per tile = 4.3 GB in all, mostly from L2 (the group-of-8 raster
//!   keeps A's rows and B's columns hot there).
//! - f16 on tensor cores: dense peak 989 TFLOP/s -> 0.139 ms; cuBLAS FP16 measured 755 TFLOP/s
//!   -> 0.182 ms. Bytes: 2 * 32 MiB read + 32 MiB written = 101 MB -> 30 us.
//!   Cooperative matrices reach the mma.sync instructions (not Hopper's wgmma), whose ceiling
//!   is ~60-65% of the wgmma peak, and WGSL has no async copies or ldmatrix control.
//! - expected: simple 0.35 TFLOP/s (measured at 2048^3); tiled f32 ~20-40 TFLOP/s (the
//!   structure of a CUDA SGEMM; 64 FMAs per 4 workgroup-memory reads); `tiled`/`f16` on f16
//!   data run on the FP32 pipes too, so about the same; coop a few hundred TFLOP/s, measured
//!   ~140 (36.7 before its operands moved as raw 16-byte chunks: see matmul_coop.wgsl).
//!   Measured figures are in BENCHMARKS.md.

use std::borrow::Cow;
use std::sync::OnceLock;

use super::elementwise::buf;
use super::unary::{UnaryOp, UNARY_MATH_WGSL};
use super::{expect_dtype, gpu_of, same_device, to_u32};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::gpu::{Bind, GpuContext, KernelSpec};
use crate::tensor::{CpuStorage, DType, Tensor};

// ---- shapes -------------------------------------------------------------------------------

/// The shape facts of one matmul.
struct Plan {
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    out_shape: Vec<usize>,
    /// (offset, batch stride, row stride, col stride) of A and B, in elements.
    a: (usize, usize, usize, usize),
    b: (usize, usize, usize, usize),
}

/// Batch stride of a view whose leading dims must collapse into one; None if they don't.
fn batch_stride(t: &Tensor) -> Option<usize> {
    let r = t.rank();
    let (dims, strides) = (t.dims(), &t.layout().strides);
    for i in 0..r.saturating_sub(3) {
        if dims[i] != 1 && strides[i] != strides[i + 1] * dims[i + 1] {
            return None;
        }
    }
    Some(if r > 2 { strides[r - 3] } else { 0 })
}

fn plan(a: &Tensor, b: &Tensor) -> Result<(Plan, Tensor, Tensor)> {
    const OP: &str = "matmul";
    same_device(OP, a, b)?;
    if a.rank() < 2 || b.rank() < 2 {
        return Err(Error::shape(OP, format!("operands must be at least 2-D, got {} and {}", a.shape(), b.shape())));
    }
    let (ra, rb) = (a.rank(), b.rank());
    let (m, k) = (a.dims()[ra - 2], a.dims()[ra - 1]);
    let (k2, n) = (b.dims()[rb - 2], b.dims()[rb - 1]);
    if k != k2 {
        return Err(Error::shape(OP, format!("inner dimensions differ: {} x {}", a.shape(), b.shape())));
    }
    let (ba, bb) = (&a.dims()[..ra - 2], &b.dims()[..rb - 2]);
    let batch_dims = if ba == bb || bb.iter().product::<usize>() == 1 {
        ba.to_vec()
    } else if ba.iter().product::<usize>() == 1 {
        bb.to_vec()
    } else {
        return Err(Error::shape(OP, format!("batch dimensions differ: {} x {}", a.shape(), b.shape())));
    };
    let batch: usize = batch_dims.iter().product();
    let a = if batch_stride(a).is_some() { a.clone() } else { a.contiguous()? };
    let b = if batch_stride(b).is_some() { b.clone() } else { b.contiguous()? };
    let view = |t: &Tensor| {
        let r = t.rank();
        let s = &t.layout().strides;
        let nb: usize = t.dims()[..r - 2].iter().product();
        let sb = if nb == 1 { 0 } else { batch_stride(t).unwrap_or(0) };
        (t.layout().offset, sb, s[r - 2], s[r - 1])
    };
    let mut out_shape = batch_dims;
    out_shape.extend([m, n]);
    let p = Plan { batch, m, n, k, out_shape, a: view(&a), b: view(&b) };
    Ok((p, a, b))
}

fn check_bias(bias: Option<&Tensor>, n: usize) -> Result<()> {
    match bias {
        Some(t) if t.numel() != n => {
            Err(Error::shape("matmul", format!("bias of shape {} does not match N={n}", t.shape())))
        }
        Some(t) if !matches!(t.dtype(), DType::F32 | DType::F16) => {
            Err(Error::mismatch("matmul", format!("bias must be f32 or f16, got {}", t.dtype())))
        }
        _ => Ok(()),
    }
}

/// The output dtype of `a x b`, or an error naming the unsupported pair.
fn out_dtype(a: DType, b: DType) -> Result<DType> {
    match (a, b) {
        (DType::F32, DType::F32) | (DType::F32, DType::F16) | (DType::F16, DType::F32) => Ok(DType::F32),
        (DType::F16, DType::F16) => Ok(DType::F16),
        _ => Err(Error::mismatch(
            "matmul",
            format!("no kernel for {a} x {b} (supported: f32 x f32, f16 x f16, f32 x f16, f16 x f32)"),
        )),
    }
}

// ---- CPU reference ------------------------------------------------------------------------

/// A tensor's host storage as f32 (f16 converted; the offsets and strides stay valid).
fn host_f32<'t>(op: &'static str, t: &'t Tensor) -> Result<Cow<'t, [f32]>> {
    match t.cpu_storage() {
        Some(CpuStorage::F32(v)) => Ok(Cow::Borrowed(v)),
        Some(CpuStorage::F16(v)) => Ok(Cow::Owned(v.iter().map(|x| x.to_f32()).collect())),
        Some(s) => Err(Error::mismatch(op, format!("no kernel for {} operands", s.dtype()))),
        None => Err(Error::mismatch(op, "expected CPU tensors")),
    }
}

/// CPU reference through the `gemm` crate (SIMD, multi-threaded, any strides), in f32.
pub fn cpu_matmul(a: &Tensor, b: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    const OP: &str = "matmul";
    let dtype = out_dtype(a.dtype(), b.dtype())?;
    let (p, a, b) = plan(a, b)?;
    check_bias(bias, p.n)?;
    let (va, vb) = (host_f32(OP, &a)?, host_f32(OP, &b)?);
    let mut out = vec![0f32; p.batch * p.m * p.n];
    if let Some(bias) = bias {
        let bv = bias.to_vec_f32()?;
        for row in out.chunks_mut(p.n.max(1)) {
            row.copy_from_slice(&bv);
        }
    }
    let threads = rayon::current_num_threads();
    for bi in 0..p.batch {
        let (ao, bo) = (p.a.0 + bi * p.a.1, p.b.0 + bi * p.b.1);
        let dst = &mut out[bi * p.m * p.n..(bi + 1) * p.m * p.n];
        if p.m == 0 || p.n == 0 {
            continue;
        }
        // SAFETY: the plan's offsets and strides address elements inside `va`/`vb` (they come
        // from valid layouts over these storages), and `dst` holds m*n contiguous elements.
        unsafe {
            gemm::gemm(
                p.m,
                p.n,
                p.k,
                dst.as_mut_ptr(),
                1,
                p.n as isize,
                bias.is_some(),
                va.as_ptr().add(ao),
                p.a.3 as isize,
                p.a.2 as isize,
                vb.as_ptr().add(bo),
                p.b.3 as isize,
                p.b.2 as isize,
                1.0,
                1.0,
                false,
                false,
                false,
                if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None },
            );
        }
    }
    let storage = match dtype {
        DType::F16 => CpuStorage::F16(out.iter().map(|&x| half::f16::from_f32(x)).collect()),
        _ => CpuStorage::F32(out),
    };
    Ok(Tensor::cpu(storage, p.out_shape.into()))
}

/// Kept for callers of the first API: `cpu_matmul` with an optional bias.
pub fn cpu_matmul_bias(a: &Tensor, b: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    cpu_matmul(a, b, bias)
}

// ---- GPU path choice ----------------------------------------------------------------------

/// The GPU kernels a matmul can run on (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MatmulPath {
    /// 64x64 tiles, f32 only.
    Simple,
    /// Register-blocked 128x128 tiles; f16 read with `unpack2x16float` (no feature needed).
    Tiled,
    /// Register-blocked 128x128 tiles with native f16 loads (SHADER_F16).
    TiledF16,
    /// Cooperative matrices, f16 x f16.
    Coop,
}

impl MatmulPath {
    pub const ALL: [MatmulPath; 4] = [MatmulPath::Simple, MatmulPath::Tiled, MatmulPath::TiledF16, MatmulPath::Coop];

    /// The name `ANYGPU_MATMUL` takes and benchmarks print.
    pub fn name(self) -> &'static str {
        match self {
            MatmulPath::Simple => "simple",
            MatmulPath::Tiled => "tiled",
            MatmulPath::TiledF16 => "f16",
            MatmulPath::Coop => "coop",
        }
    }

    pub fn parse(s: &str) -> Option<MatmulPath> {
        MatmulPath::ALL.into_iter().find(|p| p.name().eq_ignore_ascii_case(s.trim()))
    }
}

/// `ANYGPU_MATMUL`, read once.
fn forced_path() -> Option<MatmulPath> {
    static FORCED: OnceLock<Option<MatmulPath>> = OnceLock::new();
    *FORCED.get_or_init(|| {
        let v = std::env::var("ANYGPU_MATMUL").ok()?;
        if v.is_empty() || v.eq_ignore_ascii_case("auto") {
            return None;
        }
        let p = MatmulPath::parse(&v);
        if p.is_none() {
            log::warn!("ANYGPU_MATMUL={v:?} is not one of simple, tiled, f16, coop, auto; ignored");
        }
        p
    })
}

/// How the tiled and coop kernels read an operand (the `LA` / `LB` constants).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Access {
    /// Any strides: scalar loads.
    Strided = 0,
    /// The inner (K for A, N for B) dim is contiguous: vec4 loads along it.
    Inner = 1,
    /// The outer (M for A, K for B) dim is contiguous: vec4 loads along it.
    Outer = 2,
}

/// The access of an operand with (offset, batch stride, outer stride, inner stride) over
/// `outer` x `inner` elements. vec4 loads need a contiguous dim and every other stride and the
/// offset a multiple of 4 (so each vec4 starts at an aligned element).
fn access(v: (usize, usize, usize, usize), outer: usize, inner: usize) -> Access {
    let (off, sb, so, si) = v;
    // A stride over a dim of size 1 is never used.
    let aligned = |s: usize, d: usize| d <= 1 || s.is_multiple_of(4);
    if off % 4 != 0 || sb % 4 != 0 {
        Access::Strided
    } else if (si == 1 || inner <= 1) && aligned(so, outer) {
        Access::Inner
    } else if (so == 1 || outer <= 1) && aligned(si, inner) {
        Access::Outer
    } else {
        Access::Strided
    }
}

fn access_a(p: &Plan) -> Access {
    access((p.a.0, p.a.1, p.a.2, p.a.3), p.m, p.k)
}

/// B's access in the kernels' terms: Inner = N contiguous (row-major), Outer = K contiguous.
fn access_b(p: &Plan) -> Access {
    // B's "outer" dim is K (stride b.2) and its inner dim is N (stride b.3).
    access((p.b.0, p.b.1, p.b.2, p.b.3), p.k, p.n)
}

/// K per workgroup-memory stage of the tiled kernel: 8 fits WebGPU's 16 KiB with double
/// buffering, 16 halves the barriers where 32 KiB are allowed.
fn tiled_bk(ctx: &GpuContext) -> u32 {
    if ctx.caps.max_compute_workgroup_storage_size >= 32 * 1024 {
        16
    } else {
        8
    }
}

/// Workgroup memory of the coop kernel for the given accesses: two buffers of each operand
/// tile (rows padded by 8 halves) plus 8 KiB of f32 scratch.
fn coop_layout(la: Access, lb: Access) -> (u32, u32, u32) {
    // Row strides in halves: [m][k] or [n][k] rows hold BK = 32 (+8); [k][m] / [k][n] rows
    // hold 128 (+8).
    let sa = if la == Access::Inner { 40 } else { 136 };
    let sb = if lb == Access::Inner { 136 } else { 40 };
    let rows = |s: u32| if s == 40 { 128 } else { 32 };
    let bytes = 2 * 2 * (rows(sa) * sa + rows(sb) * sb) + 8192;
    (sa, sb, bytes)
}

fn coop_usable(ctx: &GpuContext, p: &Plan) -> bool {
    let (la, lb) = (access_a(p), access_b(p));
    gpu_has_coop_matmul(ctx) && la != Access::Strided && lb != Access::Strided
}

/// Whether `path` can run this product on this device.
fn path_usable(ctx: &GpuContext, path: MatmulPath, da: DType, db: DType, p: &Plan) -> bool {
    let max = ctx.caps.max_workgroups() as usize;
    match path {
        MatmulPath::Simple => {
            da == DType::F32 && db == DType::F32 && p.batch <= max && p.m.div_ceil(64) <= max && p.n.div_ceil(64) <= max
        }
        MatmulPath::Tiled => true,
        MatmulPath::TiledF16 => ctx.caps.shader_f16 && (da == DType::F16 || db == DType::F16),
        MatmulPath::Coop => {
            matches!((da, db), (DType::F16, DType::F16) | (DType::F32, DType::F16) | (DType::F16, DType::F32))
                && coop_usable(ctx, p)
        }
    }
}

fn choose(ctx: &GpuContext, da: DType, db: DType, p: &Plan, want: Option<MatmulPath>) -> MatmulPath {
    if let Some(w) = want.filter(|&w| path_usable(ctx, w, da, db, p)) {
        return w;
    }
    let usable = |w| path_usable(ctx, w, da, db, p);
    if usable(MatmulPath::Coop) {
        MatmulPath::Coop
    } else if usable(MatmulPath::TiledF16) {
        MatmulPath::TiledF16
    } else {
        MatmulPath::Tiled
    }
}

/// The path `a.matmul(b)` (with this bias) takes on its GPU: `simple`, `tiled`, `f16` or
/// `coop` (`ANYGPU_MATMUL` included), for benchmarks and diagnostics.
pub fn gpu_matmul_path(a: &Tensor, b: &Tensor, bias: Option<&Tensor>) -> Result<&'static str> {
    let ctx = gpu_of("matmul", a)?;
    out_dtype(a.dtype(), b.dtype())?;
    let (p, _, _) = plan(a, b)?;
    check_bias(bias, p.n)?;
    Ok(choose(&ctx, a.dtype(), b.dtype(), &p, forced_path()).name())
}

/// Whether this GPU multiplies f16 on cooperative matrices (tensor cores) through the `coop`
/// path, for operands contiguous along a dim: what a model decides its weight dtype by.
pub fn gpu_has_coop_matmul(ctx: &GpuContext) -> bool {
    // The largest layout: A's and B's tiles both [128][32 + 8] halves (48 KiB in all).
    ctx.caps.coop_f16_unsupported(coop_layout(Access::Inner, Access::Outer).2).is_none()
}

/// Whether `path` can run `a x b` on `a`'s GPU (tests and benchmarks).
pub fn gpu_matmul_supports(a: &Tensor, b: &Tensor, path: MatmulPath) -> Result<bool> {
    let ctx = gpu_of("matmul", a)?;
    out_dtype(a.dtype(), b.dtype())?;
    let (p, _, _) = plan(a, b)?;
    Ok(path_usable(&ctx, path, a.dtype(), b.dtype(), &p))
}

pub fn gpu_matmul(a: &Tensor, b: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    gpu_matmul_impl(a, b, bias, None, forced_path(), false)
}

/// `act(a x b + bias)`: on the coop path the activation is applied as the outputs are written
/// (saving the separate op's pass over the output: BERT's 8192 x 1536 GELU input, 50 MB), on
/// the others by the unary op after the product. Same values either way (the same functions,
/// unary_math.wgsl), except that an f16 output is rounded once, after the activation.
pub fn gpu_matmul_act(a: &Tensor, b: &Tensor, bias: Option<&Tensor>, act: UnaryOp) -> Result<Tensor> {
    gpu_matmul_impl(a, b, bias, Some(act), forced_path(), false)
}

/// `gpu_matmul` on a given path; an error if the path cannot run this product here.
pub fn gpu_matmul_using(a: &Tensor, b: &Tensor, bias: Option<&Tensor>, path: MatmulPath) -> Result<Tensor> {
    gpu_matmul_impl(a, b, bias, None, Some(path), true)
}

/// Kept for callers of the first API.
pub fn gpu_matmul_bias(a: &Tensor, b: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    gpu_matmul(a, b, bias)
}

fn gpu_matmul_impl(
    a: &Tensor,
    b: &Tensor,
    bias: Option<&Tensor>,
    act: Option<UnaryOp>,
    want: Option<MatmulPath>,
    strict: bool,
) -> Result<Tensor> {
    const OP: &str = "matmul";
    let ctx = gpu_of(OP, a)?;
    let dtype = out_dtype(a.dtype(), b.dtype())?;
    let (p, a, b) = plan(a, b)?;
    check_bias(bias, p.n)?;
    if let Some(bias) = bias {
        same_device(OP, &a, bias)?;
    }
    let path = choose(&ctx, a.dtype(), b.dtype(), &p, want);
    if strict && want.is_some_and(|w| w != path) {
        return Err(Error::Unsupported(format!(
            "matmul: the {} path cannot run {} x {} ({} x {}) on {}",
            want.map_or("?", |w| w.name()),
            a.shape(),
            b.shape(),
            a.dtype(),
            b.dtype(),
            ctx.info.name
        )));
    }
    let bias = bias.map(|t| t.contiguous()).transpose()?;
    let out = Tensor::gpu_empty(p.out_shape.clone(), dtype, a.device())?;
    if out.numel() == 0 {
        return Ok(out);
    }
    to_u32(OP, out.numel())?;
    let fused = if path == MatmulPath::Coop { act } else { None };
    match path {
        MatmulPath::Simple => dispatch_simple(&ctx, &p, &a, &b, bias.as_ref(), &out)?,
        MatmulPath::Tiled | MatmulPath::TiledF16 | MatmulPath::Coop => {
            dispatch_blocked(&ctx, path, &p, &a, &b, bias.as_ref(), fused, &out)?
        }
    }
    match act {
        Some(op) if fused.is_none() => out.unary(op),
        _ => Ok(out),
    }
}

// ---- the simple kernel --------------------------------------------------------------------

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct SimpleParams {
    m: u32,
    n: u32,
    k: u32,
    has_bias: u32,
    bias_off: u32,
    _pad: [u32; 3],
    a: [u32; 4],
    b: [u32; 4],
}

fn dispatch_simple(
    ctx: &GpuContext,
    p: &Plan,
    a: &Tensor,
    b: &Tensor,
    bias: Option<&Tensor>,
    out: &Tensor,
) -> Result<()> {
    const OP: &str = "matmul";
    expect_dtype(OP, a, DType::F32)?;
    expect_dtype(OP, b, DType::F32)?;
    // The simple kernel reads the bias as f32.
    let bias_f32;
    let bias = match bias {
        Some(t) if t.dtype() != DType::F32 => {
            bias_f32 = Tensor::from_vec(t.to_vec_f32()?, [t.numel()], a.device())?;
            Some(&bias_f32)
        }
        other => other,
    };
    let u = |x: usize| to_u32(OP, x);
    let params = SimpleParams {
        m: u(p.m)?,
        n: u(p.n)?,
        k: u(p.k)?,
        has_bias: bias.is_some() as u32,
        bias_off: u(bias.map_or(0, |t| t.layout().offset))?,
        _pad: [0; 3],
        a: [u(p.a.0)?, u(p.a.1)?, u(p.a.2)?, u(p.a.3)?],
        b: [u(p.b.0)?, u(p.b.1)?, u(p.b.2)?, u(p.b.3)?],
    };
    let pipeline = ctx.pipeline(&KernelSpec::new("matmul_f32", include_str!("matmul.wgsl"), "matmul"), &[])?;
    let grid = [u(p.n.div_ceil(64))?, u(p.m.div_ceil(64))?, u(p.batch)?];
    let (ba, bb, bo) = (buf(a)?, buf(b)?, buf(out)?);
    // Without a bias, A is bound in its slot (never read): a binding cannot stay empty.
    let bbias = match bias {
        Some(t) => buf(t)?,
        None => ba,
    };
    let binds = [Bind::Whole(ba), Bind::Whole(bb), Bind::Whole(bbias), Bind::Whole(bo)];
    ctx.dispatch(&pipeline, OP, bytemuck::bytes_of(&params), &binds, grid)
}

// ---- the register-blocked and cooperative-matrix kernels ----------------------------------

/// How a binding's elements are declared and read in WGSL.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Elem {
    F32,
    /// f16 packed two per u32 word, (un)packed with `unpack2x16float` / `pack2x16float`.
    F16Packed,
    /// f16 as WGSL's `f16` (`enable f16;`).
    F16Native,
}

fn elem(d: DType, native_f16: bool) -> Elem {
    match d {
        DType::F16 if native_f16 => Elem::F16Native,
        DType::F16 => Elem::F16Packed,
        _ => Elem::F32,
    }
}

/// A read-only binding `name` with `ld_{name}4(i)` (elements i..i+3, i a multiple of 4) and
/// `ld_{name}(i)`, both as f32. Arrays of 4-element vectors: bindings are rounded up to 16 bytes.
fn input_wgsl(name: &str, binding: u32, e: Elem) -> String {
    let decl = |ty: &str| format!("@group(0) @binding({binding}) var<storage, read> {name}: array<{ty}>;\n");
    match e {
        Elem::F32 => {
            decl("vec4<f32>")
                + &format!(
                    "fn ld_{name}4(i: u32) -> vec4<f32> {{ return {name}[i >> 2u]; }}\n\
                 fn ld_{name}(i: u32) -> f32 {{ return {name}[i >> 2u][i & 3u]; }}\n"
                )
        }
        Elem::F16Packed => {
            decl("vec2<u32>")
                + &format!(
                    "fn ld_{name}4(i: u32) -> vec4<f32> {{\n    let w = {name}[i >> 2u];\n    \
                 return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));\n}}\n\
                 fn ld_{name}(i: u32) -> f32 {{ return unpack2x16float({name}[i >> 2u][(i >> 1u) & 1u])[i & 1u]; }}\n"
                )
        }
        Elem::F16Native => {
            decl("vec4<f16>")
                + &format!(
                    "fn ld_{name}4(i: u32) -> vec4<f32> {{ return vec4<f32>({name}[i >> 2u]); }}\n\
                 fn ld_{name}(i: u32) -> f32 {{ return f32({name}[i >> 2u][i & 3u]); }}\n"
                )
        }
    }
}

/// A coop kernel operand (see matmul_coop.wgsl's header): binding `name`, the chunk type
/// `Raw_{name}`, `ld_{name}(i, n)` and `st_{name}(at, r, n)`. `whole_chunks`: every chunk the
/// kernel reads starts 16-byte aligned and is wholly inside or wholly past the data (see
/// [`whole_chunks`]), so a chunk is one or two 16-byte loads, kept raw until it is stored;
/// otherwise it is read as two masked 4-element vectors and converted at once (any shape the
/// vec4 accesses allow, slower). f32 data is clamped to f16's range and rounded: the tensor
/// cores multiply f16.
fn coop_operand_wgsl(name: &str, binding: u32, d: DType, whole_chunks: bool) -> String {
    let tile = if name == "a" { "sa" } else { "sb" };
    let decl = |ty: &str| format!("@group(0) @binding({binding}) var<storage, read> {name}: array<{ty}>;\n");
    let f16_range = "vec4<f32>(-65504.0), vec4<f32>(65504.0)";
    match (d, whole_chunks) {
        (DType::F16, true) => {
            decl("vec4<u32>")
                + &format!(
                    "alias Raw_{name} = vec4<u32>;\n\
                     fn ld_{name}(i: u32, n: u32) -> Raw_{name} {{ return {name}[i >> 3u]; }}\n\
                     fn st_{name}(at: u32, r: Raw_{name}, n: u32) {{\n    \
                     {tile}[at] = select(vec4<f16>(0.0h), u2h(r.xy), n != 0u);\n    \
                     {tile}[at + 1u] = select(vec4<f16>(0.0h), u2h(r.zw), n != 0u);\n}}\n"
                )
        }
        (_, true) => {
            decl("vec4<f32>")
                + &format!(
                    "struct Raw_{name} {{ lo: vec4<f32>, hi: vec4<f32> }}\n\
                     fn ld_{name}(i: u32, n: u32) -> Raw_{name} {{ return Raw_{name}({name}[i >> 2u], {name}[(i >> 2u) + 1u]); }}\n\
                     fn st_{name}(at: u32, r: Raw_{name}, n: u32) {{\n    \
                     {tile}[at] = select(vec4<f16>(0.0h), vec4<f16>(clamp(r.lo, {f16_range})), n != 0u);\n    \
                     {tile}[at + 1u] = select(vec4<f16>(0.0h), vec4<f16>(clamp(r.hi, {f16_range})), n != 0u);\n}}\n"
                )
        }
        (_, false) => {
            let (elem, conv) = match d {
                DType::F16 => ("vec4<f16>", format!("{name}[i >> 2u]")),
                _ => ("vec4<f32>", format!("vec4<f16>(clamp({name}[i >> 2u], {f16_range}))")),
            };
            decl(elem)
                + &format!(
                    "struct Raw_{name} {{ lo: vec4<f16>, hi: vec4<f16> }}\n\
                     fn {name}_vec(i: u32, len: u32) -> vec4<f16> {{\n    \
                     if (len == 0u) {{\n        return vec4<f16>(0.0h);\n    }}\n    \
                     let x = {conv};\n    \
                     return select(vec4<f16>(0.0h), x, vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(len));\n}}\n\
                     fn ld_{name}(i: u32, n: u32) -> Raw_{name} {{\n    \
                     return Raw_{name}({name}_vec(i, n), {name}_vec(i + 4u, max(n, 4u) - 4u));\n}}\n\
                     fn st_{name}(at: u32, r: Raw_{name}, n: u32) {{\n    \
                     {tile}[at] = r.lo;\n    \
                     {tile}[at + 1u] = r.hi;\n}}\n"
                )
        }
    }
}

/// Whether the coop kernel can read an operand in whole 16-byte chunks (`coop_operand_wgsl`):
/// its chunks start at multiples of 8 elements along the contiguous dim from the offset, so
/// the offset and the other strides must keep 16-byte alignment (8 f16, 4 f32 elements), and
/// the contiguous dim must be a multiple of 8 (no chunk straddles its end).
/// `v` = (offset, batch stride, stride of the other dim), `contiguous` = the contiguous dim's length.
fn whole_chunks(d: DType, v: (usize, usize, usize), contiguous: usize) -> bool {
    let align = if d == DType::F16 { 8 } else { 4 };
    v.0.is_multiple_of(align) && v.1.is_multiple_of(align) && v.2.is_multiple_of(align) && contiguous.is_multiple_of(8)
}

/// The output binding `c` (4) with `st_c4(i, v)` (i a multiple of 4; only when `vec_out`)
/// and `st_c(i, v)`.
fn output_wgsl(e: Elem, vec_out: bool) -> String {
    let decl = |ty: &str| format!("@group(0) @binding(4) var<storage, read_write> c: array<{ty}>;\n");
    match (e, vec_out) {
        (Elem::F32, true) => {
            decl("vec4<f32>")
                + "fn st_c4(i: u32, v: vec4<f32>) { c[i >> 2u] = v; }\n\
               fn st_c(i: u32, v: f32) { c[i >> 2u][i & 3u] = v; }\n"
        }
        (Elem::F32, false) => {
            decl("f32")
                + "fn st_c4(i: u32, v: vec4<f32>) { c[i] = v.x; c[i + 1u] = v.y; c[i + 2u] = v.z; c[i + 3u] = v.w; }\n\
               fn st_c(i: u32, v: f32) { c[i] = v; }\n"
        }
        // Two outputs share a word: when N is odd they may belong to different invocations, so
        // a lone half is merged in atomically (each side only clears and sets its own bits).
        (Elem::F16Packed, _) => {
            decl("atomic<u32>")
                + "fn st_c4(i: u32, v: vec4<f32>) {\n    \
                 atomicStore(&c[i >> 1u], pack2x16float(v.xy));\n    \
                 atomicStore(&c[(i >> 1u) + 1u], pack2x16float(v.zw));\n}\n\
               fn st_c(i: u32, v: f32) {\n    \
                 let shift = (i & 1u) * 16u;\n    \
                 let bits = (pack2x16float(vec2<f32>(v, 0.0)) & 0xffffu) << shift;\n    \
                 atomicAnd(&c[i >> 1u], ~(0xffffu << shift));\n    \
                 atomicOr(&c[i >> 1u], bits);\n}\n"
        }
        (Elem::F16Native, true) => {
            decl("vec4<f16>")
                + "fn st_c4(i: u32, v: vec4<f32>) { c[i >> 2u] = vec4<f16>(v); }\n\
               fn st_c(i: u32, v: f32) { c[i >> 2u][i & 3u] = f16(v); }\n"
        }
        (Elem::F16Native, false) => {
            decl("f16")
                + "fn st_c4(i: u32, v: vec4<f32>) {\n    \
                 c[i] = f16(v.x); c[i + 1u] = f16(v.y); c[i + 2u] = f16(v.z); c[i + 3u] = f16(v.w);\n}\n\
               fn st_c(i: u32, v: f32) { c[i] = f16(v); }\n"
        }
    }
}

/// A whole buffer bound with its length rounded up to 16 bytes, so a kernel reading
/// 4-element vectors reaches the last elements. The pool's size classes are multiples of 32
/// bytes, so the rounded range is inside the buffer.
fn bind16(t: &Tensor) -> Result<Bind<'_>> {
    let g = buf(t)?;
    let len = g.len.max(16).next_multiple_of(16);
    if len > g.buffer().size() {
        return Err(Error::gpu(
            "matmul",
            format!("buffer of {} bytes is smaller than its binding {len}", g.buffer().size()),
        ));
    }
    Ok(Bind::Slice(g.buffer(), 0, len))
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct BlockedParams {
    m: u32,
    n: u32,
    k: u32,
    has_bias: u32,
    bias_off: u32,
    batch0: u32,
    tiles_m: u32,
    tiles_n: u32,
    a: [u32; 4],
    b: [u32; 4],
}

/// The kernel of a blocked path: its spec and the `{{IO}}` text.
struct Blocked {
    path: MatmulPath,
    bk: u32,
    a: DType,
    b: DType,
    bias: Option<DType>,
    out: DType,
    la: Access,
    lb: Access,
    vec_out: bool,
    /// Coop only: A / B read in whole 16-byte chunks ([`whole_chunks`]).
    whole_a: bool,
    whole_b: bool,
    /// Coop only: the activation applied to each output (after the bias).
    act: Option<UnaryOp>,
}

impl Blocked {
    fn kernel(&self) -> (KernelSpec, String) {
        let native = self.path != MatmulPath::Tiled;
        // Without a bias, A's buffer fills the bias slot (never read).
        let mut io = input_wgsl("bias", 3, self.bias.map_or(Elem::F32, |d| elem(d, native)));
        io.push_str(&output_wgsl(elem(self.out, native), self.vec_out));
        let spec = if self.path == MatmulPath::Coop {
            io.insert_str(
                0,
                &(coop_operand_wgsl("a", 1, self.a, self.whole_a) + &coop_operand_wgsl("b", 2, self.b, self.whole_b)),
            );
            io.push_str(&format!("fn act(x: f32) -> f32 {{ return {}; }}\n", self.act.map_or("x", |op| op.wgsl())));
            let (sa, sb, _) = coop_layout(self.la, self.lb);
            let rows = |s: u32| if s == 40 { 128 } else { 32 };
            KernelSpec::new("matmul_coop", include_str!("matmul_coop.wgsl"), "matmul")
                .with("enable f16;")
                .with("enable wgpu_cooperative_matrix;")
                .with(UNARY_MATH_WGSL)
                .constant_u32("LA", self.la as u32)
                .constant_u32("LB", self.lb as u32)
                .constant_u32("SA", sa)
                .constant_u32("SB", sb)
                .constant_u32("SA4", rows(sa) * sa / 4)
                .constant_u32("SB4", rows(sb) * sb / 4)
                .constant_u32("VEC_OUT", self.vec_out as u32)
        } else {
            io.push_str(&input_wgsl("a", 1, elem(self.a, native)));
            io.push_str(&input_wgsl("b", 2, elem(self.b, native)));
            let spec = KernelSpec::new("matmul_tiled", include_str!("matmul_tiled.wgsl"), "matmul")
                .constant_u32("BK", self.bk)
                .constant_u32("LA", self.la as u32)
                .constant_u32("LB", self.lb as u32)
                .constant_u32("VEC_OUT", self.vec_out as u32);
            if native {
                spec.with("enable f16;")
            } else {
                spec
            }
        };
        (spec, io)
    }
}

/// The WGSL of every specialisation of the tiled and coop kernels, labelled, with the path
/// each belongs to: tests validate them offline (the coop one cannot run on every machine).
#[doc(hidden)]
pub fn blocked_wgsl_variants() -> Vec<(String, MatmulPath, String)> {
    use DType::{F16, F32};
    let mut v = Vec::new();
    let accesses = [Access::Strided, Access::Inner, Access::Outer];
    for path in [MatmulPath::Tiled, MatmulPath::TiledF16, MatmulPath::Coop] {
        for (a, b) in [(F32, F32), (F16, F16), (F32, F16), (F16, F32)] {
            let coop = path == MatmulPath::Coop;
            if (coop || path == MatmulPath::TiledF16) && (a, b) == (F32, F32) {
                continue;
            }
            let out = if (a, b) == (F16, F16) { F16 } else { F32 };
            for la in accesses.into_iter().filter(|&l| !coop || l != Access::Strided) {
                for lb in accesses.into_iter().filter(|&l| !coop || l != Access::Strided) {
                    for vec_out in [false, true] {
                        for bias in [None, Some(F32), Some(F16)] {
                            // (BK, whole chunks): the tiled kernel's two K steps; the coop
                            // kernel's two ways of reading its operands.
                            let forms: &[(u32, bool)] =
                                if coop { &[(32, false), (32, true)] } else { &[(8, false), (16, false)] };
                            for &(bk, whole) in forms {
                                let (whole_a, whole_b) = (whole, whole);
                                // One activation is enough to validate the epilogue's text.
                                let act = (coop && whole).then_some(UnaryOp::GeluErf);
                                let k = Blocked { path, bk, a, b, bias, out, la, lb, vec_out, whole_a, whole_b, act };
                                let (spec, io) = k.kernel();
                                let label = format!(
                                    "{} {a}x{b}->{out} LA={} LB={} vec_out={vec_out} bias={bias:?} BK={bk} whole_chunks={whole}",
                                    path.name(),
                                    la as u32,
                                    lb as u32
                                );
                                v.push((label, path, spec.source_text(&[("IO", &io)])));
                            }
                        }
                    }
                }
            }
        }
    }
    v
}

#[allow(clippy::too_many_arguments)]
fn dispatch_blocked(
    ctx: &GpuContext,
    path: MatmulPath,
    p: &Plan,
    a: &Tensor,
    b: &Tensor,
    bias: Option<&Tensor>,
    act: Option<UnaryOp>,
    out: &Tensor,
) -> Result<()> {
    const OP: &str = "matmul";
    let u = |x: usize| to_u32(OP, x);
    let kernel = Blocked {
        path,
        bk: if path == MatmulPath::Coop { 32 } else { tiled_bk(ctx) },
        a: a.dtype(),
        b: b.dtype(),
        bias: bias.map(|t| t.dtype()),
        out: out.dtype(),
        la: access_a(p),
        lb: access_b(p),
        vec_out: p.n.is_multiple_of(4),
        whole_a: if access_a(p) == Access::Inner {
            whole_chunks(a.dtype(), (p.a.0, p.a.1, p.a.2), p.k)
        } else {
            whole_chunks(a.dtype(), (p.a.0, p.a.1, p.a.3), p.m)
        },
        whole_b: if access_b(p) == Access::Inner {
            whole_chunks(b.dtype(), (p.b.0, p.b.1, p.b.2), p.n)
        } else {
            whole_chunks(b.dtype(), (p.b.0, p.b.1, p.b.3), p.k)
        },
        act,
    };
    let (spec, io) = kernel.kernel();
    let pipeline = ctx.pipeline(&spec, &[("IO", &io)])?;
    let (tiles_m, tiles_n) = (p.m.div_ceil(128), p.n.div_ceil(128));
    let mut params = BlockedParams {
        m: u(p.m)?,
        n: u(p.n)?,
        k: u(p.k)?,
        has_bias: bias.is_some() as u32,
        bias_off: u(bias.map_or(0, |t| t.layout().offset))?,
        batch0: 0,
        tiles_m: u(tiles_m)?,
        tiles_n: u(tiles_n)?,
        a: [u(p.a.0)?, u(p.a.1)?, u(p.a.2)?, u(p.a.3)?],
        b: [u(p.b.0)?, u(p.b.1)?, u(p.b.2)?, u(p.b.3)?],
    };
    let [gx, gy, _] = ctx.grid_1d(u(tiles_m * tiles_n)?);
    let binds = [bind16(a)?, bind16(b)?, bind16(bias.unwrap_or(a))?, bind16(out)?];
    // Batches beyond the per-dimension limit go in several dispatches.
    let max_z = ctx.caps.max_workgroups() as usize;
    for b0 in (0..p.batch).step_by(max_z) {
        params.batch0 = u(b0)?;
        let gz = u((p.batch - b0).min(max_z))?;
        ctx.dispatch(&pipeline, OP, bytemuck::bytes_of(&params), &binds, [gx, gy, gz])?;
    }
    Ok(())
}

impl Tensor {
    pub fn matmul(&self, other: &Tensor) -> Result<Tensor> {
        same_device("matmul", self, other)?;
        self.device().backend().matmul(self, other, None)
    }
    /// `self x other + bias` (bias broadcast over rows).
    pub fn matmul_bias(&self, other: &Tensor, bias: &Tensor) -> Result<Tensor> {
        same_device("matmul", self, other)?;
        same_device("matmul", self, bias)?;
        self.device().backend().matmul(self, other, Some(bias))
    }

    /// `act(self x other + bias)`, the activation fused into the product where the GPU path
    /// allows ([`gpu_matmul_act`]); on the CPU, the product then the unary op.
    pub fn matmul_bias_act(&self, other: &Tensor, bias: &Tensor, act: UnaryOp) -> Result<Tensor> {
        same_device("matmul", self, other)?;
        same_device("matmul", self, bias)?;
        match self.device() {
            Device::Gpu(_) => gpu_matmul_act(self, other, Some(bias), act),
            Device::Cpu => self.matmul_bias(other, bias)?.unary(act),
        }
    }
}
