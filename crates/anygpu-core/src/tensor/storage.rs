//! Where tensor elements live: typed host vectors on the CPU, buffers on a GPU.

use std::sync::Arc;

use half::{bf16, f16};

use super::dtype::DType;
use crate::gpu::GpuBuffer;

/// Host storage, typed so CPU kernels work on plain slices.
#[derive(Clone, Debug)]
pub enum CpuStorage {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    I32(Vec<i32>),
    U32(Vec<u32>),
}

impl CpuStorage {
    pub fn dtype(&self) -> DType {
        match self {
            CpuStorage::F32(_) => DType::F32,
            CpuStorage::F16(_) => DType::F16,
            CpuStorage::BF16(_) => DType::BF16,
            CpuStorage::I32(_) => DType::I32,
            CpuStorage::U32(_) => DType::U32,
        }
    }
    pub fn len(&self) -> usize {
        match self {
            CpuStorage::F32(v) => v.len(),
            CpuStorage::F16(v) => v.len(),
            CpuStorage::BF16(v) => v.len(),
            CpuStorage::I32(v) => v.len(),
            CpuStorage::U32(v) => v.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            CpuStorage::F32(v) => bytemuck::cast_slice(v),
            CpuStorage::F16(v) => bytemuck::cast_slice(v),
            CpuStorage::BF16(v) => bytemuck::cast_slice(v),
            CpuStorage::I32(v) => bytemuck::cast_slice(v),
            CpuStorage::U32(v) => bytemuck::cast_slice(v),
        }
    }
    /// Builds storage of `dtype` from little-endian bytes.
    pub fn from_bytes(dtype: DType, bytes: &[u8]) -> CpuStorage {
        fn v<T: bytemuck::Pod>(b: &[u8]) -> Vec<T> {
            b.chunks_exact(std::mem::size_of::<T>()).map(bytemuck::pod_read_unaligned).collect()
        }
        match dtype {
            DType::F32 => CpuStorage::F32(v(bytes)),
            DType::F16 => CpuStorage::F16(v(bytes)),
            DType::BF16 => CpuStorage::BF16(v(bytes)),
            DType::I32 => CpuStorage::I32(v(bytes)),
            DType::U32 => CpuStorage::U32(v(bytes)),
        }
    }
    /// The element at storage index `i` as f32 (integers converted).
    pub fn get_f32(&self, i: usize) -> f32 {
        match self {
            CpuStorage::F32(v) => v[i],
            CpuStorage::F16(v) => v[i].to_f32(),
            CpuStorage::BF16(v) => v[i].to_f32(),
            CpuStorage::I32(v) => v[i] as f32,
            CpuStorage::U32(v) => v[i] as f32,
        }
    }
}

#[derive(Clone)]
pub enum Storage {
    Cpu(Arc<CpuStorage>),
    Gpu(Arc<GpuBuffer>),
}
