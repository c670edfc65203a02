//! `QTensor`: a 2-D weight matrix kept in its GGML block format on its device — memory-mapped
//! file bytes on the CPU (no copy), the same bytes uploaded as-is on a GPU (no f32 expansion
//! in VRAM). Ops: `qmatmul` (x @ W^T, GGML's convention) and `gather_rows` (embeddings).

use std::sync::Arc;

use super::GgmlType;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::gpu::GpuBuffer;
use crate::tensor::{CpuStorage, DType, Shape, Tensor};

/// Bytes shared without copying: a memory-mapped file, or an owned buffer.
pub type SharedBytes = Arc<dyn AsRef<[u8]> + Send + Sync>;

#[derive(Clone)]
pub enum QStorage {
    /// `len` bytes at `offset` of `bytes`.
    Cpu {
        bytes: SharedBytes,
        offset: usize,
        len: usize,
    },
    Gpu(Arc<GpuBuffer>),
}

/// What a CPU product does with the activations. On a GPU, `Q8` also lets the decode matvec
/// round x to 8-bit blocks where it normalises x apart anyway (`x_q8` in quant/gpu.rs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CpuMath {
    /// f32 activations: dequantize-then-dot up to summation order ([`super::matvec`],
    /// [`super::matmul`]). The default, because the CPU backend is the reference every GPU
    /// kernel is checked against.
    #[default]
    Exact,
    /// Activations rounded to 8-bit blocks and integer dot products, as llama.cpp's CPU backend
    /// computes ([`super::matmul_q8`]): several times faster, for running models. Types without
    /// an integer kernel stay exact.
    Q8,
}

/// A [rows, cols] matrix of `ty` blocks, row-major (each row is cols/block_size blocks).
#[derive(Clone)]
pub struct QTensor {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    storage: QStorage,
    device: Device,
    cpu_math: CpuMath,
}

impl std::fmt::Debug for QTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "QTensor({} [{}, {}], {})", self.ty, self.rows, self.cols, self.device.name())
    }
}

impl QTensor {
    /// Wraps `len` bytes at `offset` of `bytes` (checked against the block geometry) and puts
    /// them on `device`: borrowed on the CPU, uploaded unchanged to a GPU.
    pub fn new(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        bytes: SharedBytes,
        offset: usize,
        len: usize,
        device: &Device,
    ) -> Result<QTensor> {
        if !cols.is_multiple_of(ty.block_size()) {
            return Err(Error::shape("qtensor", format!("{cols} columns is not a multiple of the {ty} block size")));
        }
        let expected = ty.byte_size(rows as u64 * cols as u64)?;
        let in_range = offset.checked_add(len).is_some_and(|end| end <= (*bytes).as_ref().len());
        if expected != len as u64 || !in_range {
            return Err(Error::shape(
                "qtensor",
                format!("{ty} [{rows}, {cols}] needs {expected} bytes, got {len} at offset {offset}"),
            ));
        }
        let storage = match device {
            Device::Cpu => QStorage::Cpu { bytes, offset, len },
            Device::Gpu(ctx) => QStorage::Gpu(Arc::new(ctx.upload(&(*bytes).as_ref()[offset..offset + len])?)),
        };
        Ok(QTensor { ty, rows, cols, storage, device: device.clone(), cpu_math: CpuMath::default() })
    }

    /// A [rows, cols] matrix of `ty` already in `buf` on the GPU of `device` (the F16 copy a
    /// prefill product dequantizes its weights into: quant/dequant_f16.rs).
    pub(crate) fn from_gpu_buffer(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        buf: GpuBuffer,
        device: &Device,
    ) -> Result<QTensor> {
        let expected = ty.byte_size(rows as u64 * cols as u64)?;
        if !cols.is_multiple_of(ty.block_size()) || buf.len < expected {
            return Err(Error::shape(
                "qtensor",
                format!("{ty} [{rows}, {cols}] needs {expected} bytes, the buffer has {}", buf.len),
            ));
        }
        let storage = QStorage::Gpu(Arc::new(buf));
        Ok(QTensor { ty, rows, cols, storage, device: device.clone(), cpu_math: CpuMath::default() })
    }

    /// A QTensor over an owned copy of `data` (tests, synthetic weights).
    pub fn from_vec(ty: GgmlType, rows: usize, cols: usize, data: Vec<u8>, device: &Device) -> Result<QTensor> {
        let len = data.len();
        Self::new(ty, rows, cols, Arc::new(data), 0, len, device)
    }

    /// This matrix with `math` for its CPU products (a model loader asks for [`CpuMath::Q8`];
    /// tests and references keep the exact default).
    pub fn with_cpu_math(mut self, math: CpuMath) -> QTensor {
        self.cpu_math = math;
        self
    }

    pub fn cpu_math(&self) -> CpuMath {
        self.cpu_math
    }

    pub fn ggml_type(&self) -> GgmlType {
        self.ty
    }
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    pub fn device(&self) -> &Device {
        &self.device
    }
    pub fn storage(&self) -> &QStorage {
        &self.storage
    }
    /// Bytes this matrix occupies on its device.
    pub fn byte_len(&self) -> usize {
        self.row_bytes() * self.rows
    }
    pub fn row_bytes(&self) -> usize {
        self.cols / self.ty.block_size() * self.ty.type_size()
    }

    fn cpu_bytes(&self) -> Option<&[u8]> {
        match &self.storage {
            QStorage::Cpu { bytes, offset, len } => Some(&(**bytes).as_ref()[*offset..*offset + *len]),
            QStorage::Gpu(_) => None,
        }
    }

    /// `x @ W^T`: x [.., cols] f32 (or f16: see `QOptions::f16_out`) -> [.., rows] f32.
    pub fn qmatmul(&self, x: &Tensor) -> Result<Tensor> {
        const OP: &str = "qmatmul";
        if !x.device().same(&self.device) {
            return Err(Error::mismatch(
                OP,
                format!("input on {}, weights on {}", x.device().name(), self.device.name()),
            ));
        }
        if !matches!(x.dtype(), DType::F32 | DType::F16) {
            return Err(Error::mismatch(OP, format!("input must be f32 or f16, got {}", x.dtype())));
        }
        let k = *x.dims().last().ok_or_else(|| Error::shape(OP, "input is a scalar"))?;
        if k != self.cols {
            return Err(Error::shape(
                OP,
                format!("input {} does not match weights [{}, {}]", x.shape(), self.rows, self.cols),
            ));
        }
        let n = x.numel() / k.max(1);
        let mut out_shape = x.dims().to_vec();
        *out_shape.last_mut().expect("rank >= 1 checked above") = self.rows;
        match &self.device {
            Device::Cpu => {
                let xs = match x.dtype() {
                    DType::F16 => x.to_dtype(DType::F32)?.to_vec::<f32>()?,
                    _ => x.contiguous()?.to_vec::<f32>()?,
                };
                let w = self.cpu_bytes().ok_or_else(|| Error::mismatch(OP, "weights not on the CPU"))?;
                let mut y = vec![0f32; n * self.rows];
                if self.cpu_math == CpuMath::Q8 {
                    super::matmul_q8(self.ty, w, self.rows, self.cols, &xs, n, &mut y)?;
                } else if n == 1 {
                    super::matvec(self.ty, w, self.rows, self.cols, &xs, &mut y)?;
                } else {
                    super::matmul(self.ty, w, self.rows, self.cols, &xs, n, &mut y)?;
                }
                Ok(Tensor::cpu(CpuStorage::F32(y), Shape(out_shape)))
            }
            Device::Gpu(_) => super::gpu::qmatmul(self, x, n, out_shape),
        }
    }

    /// Rows `ids` of the matrix, dequantized: [len(ids), cols] f32 (embedding lookup).
    /// Out-of-range ids are an error.
    pub fn gather_rows(&self, ids: &[u32]) -> Result<Tensor> {
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.rows) {
            return Err(Error::Index { op: "embedding", index: bad as i64, len: self.rows });
        }
        match &self.device {
            Device::Cpu => {
                let w = self.cpu_bytes().ok_or_else(|| Error::mismatch("embedding", "weights not on the CPU"))?;
                let rb = self.row_bytes();
                let mut out = vec![0f32; ids.len() * self.cols];
                for (dst, &id) in out.chunks_mut(self.cols.max(1)).zip(ids) {
                    let r = id as usize;
                    super::dequantize(self.ty, &w[r * rb..(r + 1) * rb], dst)?;
                }
                Ok(Tensor::cpu(CpuStorage::F32(out), Shape(vec![ids.len(), self.cols])))
            }
            Device::Gpu(_) => super::gpu::gather_rows(self, ids),
        }
    }

    /// The whole matrix as f32 [rows, cols] (tests and small tensors only).
    pub fn dequantize(&self) -> Result<Tensor> {
        let ids: Vec<u32> = (0..self.rows as u32).collect();
        self.gather_rows(&ids)
    }
}
