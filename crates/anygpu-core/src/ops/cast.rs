//! Casts between f32, f16 and bf16 (any view in, a contiguous tensor out).
//!
//! Rounding is to nearest even on the way down (`half`'s `from_f32`): values beyond f16's range
//! become +-inf, NaN stays NaN. Widening is exact. A cast to the tensor's own dtype returns the
//! tensor itself (tensors are immutable, so sharing is safe). Integer dtypes are not cast here.

use rayon::prelude::*;

use super::elementwise::buf;
use super::{gpu_of, to_u32, Dims8, STRIDED_WGSL};
use crate::error::{Error, Result};
use crate::gpu::{Bind, KernelSpec};
use crate::tensor::{CpuStorage, DType, Tensor};

fn check(x: &Tensor, dtype: DType) -> Result<()> {
    if x.dtype().is_float() && dtype.is_float() {
        Ok(())
    } else {
        Err(Error::mismatch(
            "cast",
            format!("casts {} {} to {dtype}: only f32, f16 and bf16 convert", x.shape(), x.dtype()),
        ))
    }
}

pub fn cpu_cast(x: &Tensor, dtype: DType) -> Result<Tensor> {
    check(x, dtype)?;
    if x.dtype() == dtype {
        return Ok(x.clone());
    }
    let s = x.cpu_storage().ok_or_else(|| Error::mismatch("cast", "tensor is not on the CPU"))?;
    let l = x.layout();
    // Every source element as f32 (exact), in row-major order.
    let vals: Vec<f32> = if x.is_contiguous() {
        (l.offset..l.offset + x.numel()).into_par_iter().map(|i| s.get_f32(i)).collect()
    } else {
        l.storage_indices().map(|i| s.get_f32(i)).collect()
    };
    let out = match dtype {
        DType::F32 => CpuStorage::F32(vals),
        DType::F16 => CpuStorage::F16(vals.par_iter().map(|&v| half::f16::from_f32(v)).collect()),
        DType::BF16 => CpuStorage::BF16(vals.par_iter().map(|&v| half::bf16::from_f32(v)).collect()),
        DType::I32 | DType::U32 => unreachable!("rejected by check()"),
    };
    Ok(Tensor::cpu(out, x.shape().clone()))
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n: u32,
    rank: u32,
    offset: u32,
    contiguous: u32,
    shape: Dims8,
    strides: Dims8,
}

pub fn gpu_cast(x: &Tensor, dtype: DType) -> Result<Tensor> {
    const OP: &str = "cast";
    check(x, dtype)?;
    if x.dtype() == dtype {
        return Ok(x.clone());
    }
    let ctx = gpu_of(OP, x)?;
    let out = Tensor::gpu_empty(x.shape().clone(), dtype, x.device())?;
    let n = to_u32(OP, x.numel())?;
    if n == 0 {
        return Ok(out);
    }
    let l = x.layout();
    let params = Params {
        n,
        rank: l.dims().len() as u32,
        offset: to_u32(OP, l.offset)?,
        contiguous: x.is_contiguous() as u32,
        shape: Dims8::new(OP, l.dims())?,
        strides: Dims8::new(OP, &l.strides)?,
    };
    let load = match x.dtype() {
        DType::F16 => "load_f16",
        DType::BF16 => "load_bf16",
        _ => "load_f32",
    };
    let (entry, store, threads) = match dtype {
        DType::F16 => ("cast_to16", "store_f16", n.div_ceil(2)),
        DType::BF16 => ("cast_to16", "store_bf16", n.div_ceil(2)),
        _ => ("cast_to32", "", n),
    };
    let name = format!("cast_{}_{}", x.dtype(), dtype);
    let spec = KernelSpec::new(name, include_str!("cast.wgsl"), entry).with(STRIDED_WGSL);
    // cast_to32 does not use STORE; any function name of the right type compiles.
    let store = if store.is_empty() { "store_bf16" } else { store };
    let pipeline = ctx.pipeline(&spec, &[("LOAD", load), ("STORE", store)])?;
    ctx.dispatch(
        &pipeline,
        OP,
        bytemuck::bytes_of(&params),
        &[Bind::Whole(buf(x)?), Bind::Whole(buf(&out)?)],
        ctx.grid_1d(threads.div_ceil(256)),
    )?;
    Ok(out)
}

impl Tensor {
    /// This tensor converted to `dtype` (f32, f16 or bf16; round to nearest even).
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        self.device().backend().cast(self, dtype)
    }
}
