//! Tensors: a storage, a strided layout over it, a dtype, a device. Views (transpose, narrow,
//! reshape of contiguous data) share storage; ops return new tensors.

mod dtype;
mod shape;
mod storage;

use std::sync::Arc;

pub use dtype::{DType, Element};
pub use shape::{Layout, Shape};
pub use storage::{CpuStorage, Storage};

use crate::device::Device;
use crate::error::{Error, Result};
use crate::gpu::GpuBuffer;

#[derive(Clone)]
pub struct Tensor {
    storage: Storage,
    layout: Layout,
    dtype: DType,
    device: Device,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor({}, {}, {})", self.layout.shape, self.dtype, self.device.name())
    }
}

impl Tensor {
    // ---- construction -------------------------------------------------------------------

    /// A tensor over existing storage; `layout` must stay inside it.
    pub fn from_parts(storage: Storage, layout: Layout, dtype: DType, device: Device) -> Tensor {
        Tensor { storage, layout, dtype, device }
    }

    /// Copies `data` into a new contiguous tensor of `shape` on `device`.
    pub fn from_slice<T: Element>(data: &[T], shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
        let shape = shape.into();
        if shape.numel() != data.len() {
            return Err(Error::shape("from_slice", format!("{} elements do not fill shape {shape}", data.len())));
        }
        Self::from_bytes(bytemuck::cast_slice(data), T::DTYPE, shape, device)
    }

    /// Moves a host vector into a tensor without copying on the CPU backend.
    pub fn from_vec<T: Element>(data: Vec<T>, shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
        let shape = shape.into();
        if shape.numel() != data.len() {
            return Err(Error::shape("from_vec", format!("{} elements do not fill shape {shape}", data.len())));
        }
        match device {
            Device::Cpu => {
                let any: Box<dyn std::any::Any> = Box::new(data);
                let storage = match T::DTYPE {
                    DType::F32 => any.downcast::<Vec<f32>>().map(|v| CpuStorage::F32(*v)),
                    DType::F16 => any.downcast::<Vec<half::f16>>().map(|v| CpuStorage::F16(*v)),
                    DType::BF16 => any.downcast::<Vec<half::bf16>>().map(|v| CpuStorage::BF16(*v)),
                    DType::I32 => any.downcast::<Vec<i32>>().map(|v| CpuStorage::I32(*v)),
                    DType::U32 => any.downcast::<Vec<u32>>().map(|v| CpuStorage::U32(*v)),
                }
                .map_err(|_| Error::mismatch("from_vec", "element type does not match its dtype"))?;
                Ok(Self::cpu(storage, shape))
            }
            Device::Gpu(_) => Self::from_slice(&data, shape, device),
        }
    }

    /// A new contiguous tensor from raw little-endian bytes of `dtype`.
    pub fn from_bytes(bytes: &[u8], dtype: DType, shape: impl Into<Shape>, device: &Device) -> Result<Tensor> {
        let shape = shape.into();
        if bytes.len() != shape.numel() * dtype.size_in_bytes() {
            return Err(Error::shape("from_bytes", format!("{} bytes do not fill {dtype} shape {shape}", bytes.len())));
        }
        match device {
            Device::Cpu => Ok(Self::cpu(CpuStorage::from_bytes(dtype, bytes), shape)),
            Device::Gpu(ctx) => {
                let buf = ctx.upload(bytes)?;
                Ok(Self::gpu(buf, dtype, shape, device.clone()))
            }
        }
    }

    pub fn cpu(storage: CpuStorage, shape: Shape) -> Tensor {
        let dtype = storage.dtype();
        Tensor {
            storage: Storage::Cpu(Arc::new(storage)),
            layout: Layout::contiguous(shape),
            dtype,
            device: Device::Cpu,
        }
    }

    pub fn gpu(buf: GpuBuffer, dtype: DType, shape: Shape, device: Device) -> Tensor {
        Tensor { storage: Storage::Gpu(Arc::new(buf)), layout: Layout::contiguous(shape), dtype, device }
    }

    pub fn zeros(shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Tensor> {
        let shape = shape.into();
        let bytes = vec![0u8; shape.numel() * dtype.size_in_bytes()];
        Self::from_bytes(&bytes, dtype, shape, device)
    }

    /// An uninitialised contiguous output tensor on a GPU (ops fill it).
    pub fn gpu_empty(shape: impl Into<Shape>, dtype: DType, device: &Device) -> Result<Tensor> {
        let shape = shape.into();
        let ctx = device.gpu().ok_or_else(|| Error::mismatch("gpu_empty", "not a GPU device"))?;
        let bytes = (Shape::checked_numel(shape.dims())? as u64)
            .checked_mul(dtype.size_in_bytes() as u64)
            .ok_or_else(|| Error::shape("alloc", format!("{shape} is too large")))?;
        let buf = ctx.alloc(bytes)?;
        Ok(Self::gpu(buf, dtype, shape, device.clone()))
    }

    // ---- accessors ----------------------------------------------------------------------

    pub fn shape(&self) -> &Shape {
        &self.layout.shape
    }
    pub fn dims(&self) -> &[usize] {
        self.layout.dims()
    }
    pub fn rank(&self) -> usize {
        self.layout.shape.rank()
    }
    pub fn numel(&self) -> usize {
        self.layout.shape.numel()
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn device(&self) -> &Device {
        &self.device
    }
    pub fn layout(&self) -> &Layout {
        &self.layout
    }
    pub fn storage(&self) -> &Storage {
        &self.storage
    }
    pub fn is_contiguous(&self) -> bool {
        self.layout.is_contiguous()
    }
    /// The dimension `d`, or an error naming the op.
    pub fn dim(&self, op: &'static str, d: usize) -> Result<usize> {
        self.dims()
            .get(d)
            .copied()
            .ok_or_else(|| Error::shape(op, format!("dimension {d} out of range for shape {}", self.shape())))
    }

    pub fn cpu_storage(&self) -> Option<&CpuStorage> {
        match &self.storage {
            Storage::Cpu(s) => Some(s),
            Storage::Gpu(_) => None,
        }
    }
    /// Mutable host storage (copied first if another tensor shares it).
    pub fn cpu_storage_mut(&mut self) -> Option<&mut CpuStorage> {
        match &mut self.storage {
            Storage::Cpu(s) => Some(Arc::make_mut(s)),
            Storage::Gpu(_) => None,
        }
    }
    pub fn gpu_buffer(&self) -> Option<&GpuBuffer> {
        match &self.storage {
            Storage::Gpu(b) => Some(b),
            Storage::Cpu(_) => None,
        }
    }

    // ---- moving data --------------------------------------------------------------------

    /// The elements in row-major order as `T` (which must be this tensor's dtype).
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype {
            return Err(Error::mismatch("to_vec", format!("tensor is {}, asked for {}", self.dtype, T::DTYPE)));
        }
        let bytes = self.to_bytes()?;
        Ok(bytes.chunks_exact(std::mem::size_of::<T>()).map(bytemuck::pod_read_unaligned).collect())
    }

    /// The elements as f32, whatever the dtype.
    pub fn to_vec_f32(&self) -> Result<Vec<f32>> {
        let host = self.to_device(&Device::Cpu)?;
        let s = host.cpu_storage().ok_or_else(|| Error::mismatch("to_vec_f32", "expected host storage"))?;
        Ok(host.layout.storage_indices().map(|i| s.get_f32(i)).collect())
    }

    /// Row-major bytes of the logical tensor.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let t = self.contiguous()?;
        let es = t.dtype.size_in_bytes();
        let start = t.layout.offset * es;
        let len = t.numel() * es;
        match &t.storage {
            Storage::Cpu(s) => Ok(s.as_bytes()[start..start + len].to_vec()),
            Storage::Gpu(b) => b.context().read(b.buffer(), start as u64, len as u64),
        }
    }

    /// This tensor on another device (a no-op clone when already there).
    pub fn to_device(&self, device: &Device) -> Result<Tensor> {
        if self.device.same(device) {
            return Ok(self.clone());
        }
        let bytes = self.to_bytes()?;
        Self::from_bytes(&bytes, self.dtype, self.shape().clone(), device)
    }

    // ---- views --------------------------------------------------------------------------

    /// Same storage, new shape; copies first when the layout is not contiguous.
    pub fn reshape(&self, shape: impl Into<Shape>) -> Result<Tensor> {
        let shape = shape.into();
        if shape.numel() != self.numel() {
            return Err(Error::shape("reshape", format!("cannot reshape {} into {shape}", self.shape())));
        }
        let t = self.contiguous()?;
        let offset = t.layout.offset;
        Ok(Tensor { layout: Layout { strides: shape.contiguous_strides(), shape, offset }, ..t })
    }

    /// Swaps two dimensions (a view).
    pub fn transpose(&self, d0: usize, d1: usize) -> Result<Tensor> {
        let r = self.rank();
        if d0 >= r || d1 >= r {
            return Err(Error::shape("transpose", format!("dims {d0},{d1} out of range for {}", self.shape())));
        }
        let mut perm: Vec<usize> = (0..r).collect();
        perm.swap(d0, d1);
        self.permute(&perm)
    }

    /// Reorders dimensions (a view): output dim i is input dim `perm[i]`.
    pub fn permute(&self, perm: &[usize]) -> Result<Tensor> {
        let r = self.rank();
        let mut seen = vec![false; r];
        if perm.len() != r || perm.iter().any(|&p| p >= r || std::mem::replace(&mut seen[p], true)) {
            return Err(Error::shape("permute", format!("{perm:?} is not a permutation of {} dims", r)));
        }
        let dims = perm.iter().map(|&p| self.dims()[p]).collect::<Vec<_>>();
        let strides = perm.iter().map(|&p| self.layout.strides[p]).collect();
        Ok(Tensor { layout: Layout { shape: Shape(dims), strides, offset: self.layout.offset }, ..self.clone() })
    }

    /// Elements `start..start+len` along `dim` (a view).
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        let n = self.dim("narrow", dim)?;
        if start.checked_add(len).is_none_or(|e| e > n) {
            return Err(Error::shape(
                "narrow",
                format!("{start}..{} out of range 0..{n} on dim {dim} of {}", start.saturating_add(len), self.shape()),
            ));
        }
        let mut layout = self.layout.clone();
        layout.offset += start * layout.strides[dim];
        layout.shape.0[dim] = len;
        Ok(Tensor { layout, ..self.clone() })
    }

    /// Inserts a dimension of size 1 at `dim` (a view).
    pub fn unsqueeze(&self, dim: usize) -> Result<Tensor> {
        if dim > self.rank() {
            return Err(Error::shape("unsqueeze", format!("dim {dim} out of range for {}", self.shape())));
        }
        let mut layout = self.layout.clone();
        let stride = layout.strides.get(dim).map_or(1, |&s| s * layout.shape.0[dim]);
        layout.shape.0.insert(dim, 1);
        layout.strides.insert(dim, stride);
        Ok(Tensor { layout, ..self.clone() })
    }

    /// A contiguous copy (or this tensor, when already contiguous).
    pub fn contiguous(&self) -> Result<Tensor> {
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        self.device.backend().contiguous(self)
    }
}
