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

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct WriteParams {
    n: u32,
    rank: u32,
    src_offset: u32,
    dst_offset: u32,
    shape: Dims8,
    src_strides: Dims8,
    dst_strides: Dims8,
}

impl Tensor {
    /// Overwrites, in place, the slice `start..start + src.dims()[dim]` along `dim` of this
    /// tensor with `src` (same dtype and device; other dims equal). This is how a KV cache takes
    /// the keys and values of new positions without being copied.
    pub fn write_at(&mut self, dim: usize, start: usize, src: &Tensor) -> Result<()> {
        const OP: &str = "write_at";
        super::same_device(OP, self, src)?;
        if src.dtype() != self.dtype() {
            return Err(crate::Error::mismatch(OP, format!("writing {} into {}", src.dtype(), self.dtype())));
        }
        let len = src.dim(OP, dim)?;
        let dst = self.narrow(dim, start, len)?;
        if dst.dims() != src.dims() {
            return Err(crate::Error::shape(
                OP,
                format!("cannot write {} into {} at {start} on dim {dim}", src.shape(), self.shape()),
            ));
        }
        match self.device().clone() {
            crate::Device::Cpu => {
                let src_vals = cpu_contiguous(src)?;
                let indices: Vec<usize> = dst.layout().storage_indices().collect();
                // The view shares the storage: drop it, or make_mut below would copy everything.
                drop(dst);
                let storage = self.cpu_storage_mut().ok_or_else(|| crate::Error::mismatch(OP, "not a CPU tensor"))?;
                fn put<T: Copy>(dst: &mut [T], idx: &[usize], src: &[T]) {
                    for (&i, &v) in idx.iter().zip(src) {
                        dst[i] = v;
                    }
                }
                match (storage, src_vals.cpu_storage()) {
                    (CpuStorage::F32(d), Some(CpuStorage::F32(s))) => put(d, &indices, s),
                    (CpuStorage::F16(d), Some(CpuStorage::F16(s))) => put(d, &indices, s),
                    (CpuStorage::BF16(d), Some(CpuStorage::BF16(s))) => put(d, &indices, s),
                    (CpuStorage::I32(d), Some(CpuStorage::I32(s))) => put(d, &indices, s),
                    (CpuStorage::U32(d), Some(CpuStorage::U32(s))) => put(d, &indices, s),
                    _ => return Err(crate::Error::mismatch(OP, "storage types differ")),
                }
                Ok(())
            }
            crate::Device::Gpu(ctx) => {
                if self.dtype().size_in_bytes() != 4 {
                    return Err(crate::Error::Unsupported(format!(
                        "{OP}: {} on the GPU (4-byte dtypes only)",
                        self.dtype()
                    )));
                }
                let n = to_u32(OP, src.numel())?;
                if n == 0 {
                    return Ok(());
                }
                let (sl, dl) = (src.layout(), dst.layout());
                let params = WriteParams {
                    n,
                    rank: sl.dims().len() as u32,
                    src_offset: to_u32(OP, sl.offset)?,
                    dst_offset: to_u32(OP, dl.offset)?,
                    shape: Dims8::new(OP, sl.dims())?,
                    src_strides: Dims8::new(OP, &sl.strides)?,
                    dst_strides: Dims8::new(OP, &dl.strides)?,
                };
                let spec = KernelSpec::new("write_u32", include_str!("copy.wgsl"), "write_u32").with(STRIDED_WGSL);
                let pipeline = ctx.pipeline(&spec, &[])?;
                let (sb, db) = (super::elementwise::buf(src)?, super::elementwise::buf(&dst)?);
                ctx.dispatch(
                    &pipeline,
                    OP,
                    bytemuck::bytes_of(&params),
                    &[Bind::Whole(sb), Bind::Whole(db)],
                    ctx.grid_1d(n.div_ceil(256)),
                )
            }
        }
    }
}
