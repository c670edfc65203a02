//! Batched matmul `[.., M, K] x [.., K, N] -> [.., M, N]`, optional bias over N.
//! Either operand may be any strided view (a transpose costs nothing). The batch dims must be
//! equal, or one operand 2-D (shared across the batch).

use super::elementwise::buf;
use super::{expect_dtype, gpu_of, same_device, to_u32};
use crate::error::{Error, Result};
use crate::gpu::{Bind, KernelSpec};
use crate::tensor::{CpuStorage, DType, Tensor};

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
        _ => Ok(()),
    }
}

/// CPU reference through the `gemm` crate (SIMD, multi-threaded, any strides).
pub fn cpu_matmul_bias(a: &Tensor, b: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let (p, a, b) = plan(a, b)?;
    check_bias(bias, p.n)?;
    let (va, vb) = match (a.cpu_storage(), b.cpu_storage()) {
        (Some(CpuStorage::F32(x)), Some(CpuStorage::F32(y))) => (x, y),
        _ => {
            return Err(Error::mismatch(
                "matmul",
                format!("expected f32 CPU tensors, got {} and {}", a.dtype(), b.dtype()),
            ))
        }
    };
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
        // from valid layouts), and `dst` holds m*n contiguous elements.
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
    Ok(Tensor::cpu(CpuStorage::F32(out), p.out_shape.into()))
}

pub fn cpu_matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    cpu_matmul_bias(a, b, None)
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    m: u32,
    n: u32,
    k: u32,
    has_bias: u32,
    bias_off: u32,
    _pad: [u32; 3],
    a: [u32; 4],
    b: [u32; 4],
}

pub fn gpu_matmul_bias(a: &Tensor, b: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    const OP: &str = "matmul";
    expect_dtype(OP, a, DType::F32)?;
    expect_dtype(OP, b, DType::F32)?;
    let ctx = gpu_of(OP, a)?;
    let (p, a, b) = plan(a, b)?;
    check_bias(bias, p.n)?;
    let bias = bias.map(|t| t.contiguous()).transpose()?;
    let out = Tensor::gpu_empty(p.out_shape.clone(), DType::F32, a.device())?;
    if out.numel() == 0 {
        return Ok(out);
    }
    let u = |x: usize| to_u32(OP, x);
    let params = Params {
        m: u(p.m)?,
        n: u(p.n)?,
        k: u(p.k)?,
        has_bias: bias.is_some() as u32,
        bias_off: u(bias.as_ref().map_or(0, |t| t.layout().offset))?,
        _pad: [0; 3],
        a: [u(p.a.0)?, u(p.a.1)?, u(p.a.2)?, u(p.a.3)?],
        b: [u(p.b.0)?, u(p.b.1)?, u(p.b.2)?, u(p.b.3)?],
    };
    let pipeline = ctx.pipeline(&KernelSpec::new("matmul_f32", include_str!("matmul.wgsl"), "matmul"), &[])?;
    let grid = [u(p.n.div_ceil(64))?, u(p.m.div_ceil(64))?, u(p.batch)?];
    let (ba, bb, bo) = (buf(&a)?, buf(&b)?, buf(&out)?);
    // Without a bias, A is bound in its slot (never read): a binding cannot stay empty.
    let bbias = match &bias {
        Some(t) => buf(t)?,
        None => ba,
    };
    let binds = [Bind::Whole(ba), Bind::Whole(bb), Bind::Whole(bbias), Bind::Whole(bo)];
    ctx.dispatch(&pipeline, OP, bytemuck::bytes_of(&params), &binds, grid)?;
    Ok(out)
}

pub fn gpu_matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    gpu_matmul_bias(a, b, None)
}

impl Tensor {
    pub fn matmul(&self, other: &Tensor) -> Result<Tensor> {
        same_device("matmul", self, other)?;
        self.device().backend().matmul(self, other)
    }
}
