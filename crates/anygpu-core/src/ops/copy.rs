//! `contiguous`: strided views to row-major copies.

use super::{gpu_of, to_u32, Dims8, STRIDED_WGSL};
use crate::error::Result;
use crate::gpu::{Bind, KernelSpec};
use crate::tensor::{CpuStorage, Tensor};

/// CPU reference: gathers every element in row-major order.
pub fn cpu_contiguous(x: &Tensor) -> Result<Tensor> {
    let s = x.cpu_storage().ok_or_else(|| crate::Error::mismatch("contiguous", "tensor is not on the CPU"))?;
    fn gather<T: Copy>(v: &[T], x: &Tensor) -> Vec<T> {
        x.layout().storage_indices().map(|i| v[i]).collect()
    }
    let out = match s {
        CpuStorage::F32(v) => CpuStorage::F32(gather(v, x)),
        CpuStorage::F16(v) => CpuStorage::F16(gather(v, x)),
        CpuStorage::BF16(v) => CpuStorage::BF16(gather(v, x)),
        CpuStorage::I32(v) => CpuStorage::I32(gather(v, x)),
        CpuStorage::U32(v) => CpuStorage::U32(gather(v, x)),
    };
    Ok(Tensor::cpu(out, x.shape().clone()))
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n: u32,
    rank: u32,
    offset: u32,
    _pad: u32,
    shape: Dims8,
    strides: Dims8,
}

pub fn gpu_contiguous(x: &Tensor) -> Result<Tensor> {
    const OP: &str = "contiguous";
    let ctx = gpu_of(OP, x)?;
    let out = Tensor::gpu_empty(x.shape().clone(), x.dtype(), x.device())?;
    let n = to_u32(OP, x.numel())?;
    if n == 0 {
        return Ok(out);
    }
    let l = x.layout();
    let params = Params {
        n,
        rank: l.dims().len() as u32,
        offset: to_u32(OP, l.offset)?,
        _pad: 0,
        shape: Dims8::new(OP, l.dims())?,
        strides: Dims8::new(OP, &l.strides)?,
    };
    let (entry, threads) = match x.dtype().size_in_bytes() {
        4 => ("copy_u32", n),
        _ => ("copy_u16", n.div_ceil(2)),
    };
    let spec = KernelSpec::new(entry, include_str!("copy.wgsl"), entry).with(STRIDED_WGSL);
    let pipeline = ctx.pipeline(&spec, &[])?;
    let src = x.gpu_buffer().ok_or_else(|| crate::Error::mismatch(OP, "no GPU buffer"))?;
    let dst = out.gpu_buffer().ok_or_else(|| crate::Error::mismatch(OP, "no GPU buffer"))?;
    ctx.dispatch(
        &pipeline,
        OP,
        bytemuck::bytes_of(&params),
        &[Bind::Whole(src), Bind::Whole(dst)],
        ctx.grid_1d(threads.div_ceil(256)),
    )?;
    Ok(out)
}
