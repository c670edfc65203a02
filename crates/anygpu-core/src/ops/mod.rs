//! Op families. Each module owns its shape rules, its CPU reference (`cpu_*`), its GPU
//! dispatch (`gpu_*`) and its WGSL file beside it.

pub mod attention;
pub mod attention_coop;
pub mod attention_decode;
pub mod cast;
pub mod copy;
pub mod elementwise;
pub mod index;
pub mod matmul;
pub mod norm;
pub mod reduce;
pub mod rope;
pub mod rope_kv;
pub mod softmax;
pub mod unary;

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::gpu::GpuContext;
use crate::tensor::{DType, Layout, Tensor};

/// Highest rank the strided GPU kernels index (two vec4 of dims).
pub const MAX_RANK: usize = 8;

/// Tests only: the cooperative-matrix emulation the coop kernels' emulated variants share
/// (`EmuM`, `EmuC`, `emu_mad`, `emu_store`; each kernel adds its `emu_el`).
pub(crate) const COOP_EMU_WGSL: &str = include_str!("coop_emu.wgsl");

/// WGSL `to_f16(v)`: four f32 rounded to f16, clamped to its range (an outlier activation
/// saturates instead of becoming inf). The one rounding of the activations that the
/// tensor-core kernels read as f16: `quant::coop`'s x (`x_to_f16`, or f16 written by the SwiGLU
/// epilogue) and the attention's Q and f16 output, so that an op that writes f16 for a product
/// writes the values the product would have rounded its x to.
pub(crate) const TO_F16_WGSL: &str = "fn to_f16(v: vec4<f32>) -> vec4<f16> {
    return vec4<f16>(clamp(v, vec4<f32>(-65504.0), vec4<f32>(65504.0)));
}";

/// WGSL shared by kernels that walk strided layouts.
pub(crate) const STRIDED_WGSL: &str = include_str!("strided.wgsl");

/// Shape and strides packed the way `strided.wgsl` reads them: 8 dims in two vec4<u32>.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable, Default)]
pub(crate) struct Dims8(pub [u32; MAX_RANK]);

impl Dims8 {
    pub fn new(op: &'static str, v: &[usize]) -> Result<Dims8> {
        if v.len() > MAX_RANK {
            return Err(Error::shape(op, format!("rank {} exceeds the GPU kernels' maximum of {MAX_RANK}", v.len())));
        }
        let mut d = [0u32; MAX_RANK];
        for (o, &x) in d.iter_mut().zip(v) {
            *o = to_u32(op, x)?;
        }
        Ok(Dims8(d))
    }
}

pub(crate) fn to_u32(op: &'static str, x: usize) -> Result<u32> {
    u32::try_from(x).map_err(|_| Error::shape(op, format!("{x} does not fit the GPU kernels' 32-bit indices")))
}

/// The GPU context of a tensor, or an error when it lives on the CPU.
pub(crate) fn gpu_of(op: &'static str, t: &Tensor) -> Result<Arc<GpuContext>> {
    t.device().gpu().cloned().ok_or_else(|| Error::mismatch(op, "tensor is not on a GPU"))
}

pub(crate) fn same_device(op: &'static str, a: &Tensor, b: &Tensor) -> Result<()> {
    if a.device().same(b.device()) {
        Ok(())
    } else {
        Err(Error::mismatch(
            op,
            format!("tensors on different devices ({} and {})", a.device().name(), b.device().name()),
        ))
    }
}

pub(crate) fn expect_dtype(op: &'static str, t: &Tensor, dtype: DType) -> Result<()> {
    if t.dtype() == dtype {
        Ok(())
    } else {
        Err(Error::mismatch(op, format!("expected {dtype}, got {}", t.dtype())))
    }
}

/// The layout of `t` broadcast to `shape` (stride 0 on broadcast dims, right-aligned).
pub(crate) fn broadcast_layout(op: &'static str, l: &Layout, shape: &[usize]) -> Result<Vec<usize>> {
    let r = shape.len();
    let lr = l.dims().len();
    let mut strides = vec![0usize; r];
    for i in 0..lr {
        let (d, s) = (l.dims()[lr - 1 - i], l.strides[lr - 1 - i]);
        let o = shape[r - 1 - i];
        strides[r - 1 - i] = if d == o {
            s
        } else if d == 1 {
            0
        } else {
            return Err(Error::shape(op, format!("cannot broadcast {:?} to {shape:?}", l.dims())));
        };
    }
    Ok(strides)
}

/// numpy's broadcast of two shapes.
pub(crate) fn broadcast_shape(op: &'static str, a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let r = a.len().max(b.len());
    (0..r)
        .map(|i| {
            let da = if i + a.len() >= r { a[i + a.len() - r] } else { 1 };
            let db = if i + b.len() >= r { b[i + b.len() - r] } else { 1 };
            match (da, db) {
                (x, y) if x == y => Ok(x),
                (1, y) => Ok(y),
                (x, 1) => Ok(x),
                _ => Err(Error::shape(op, format!("shapes {a:?} and {b:?} do not broadcast"))),
            }
        })
        .collect()
}
