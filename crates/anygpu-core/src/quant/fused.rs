//! Fused weight products for the decode step, where every dispatch costs more than the small
//! matrices it multiplies (~4-5 µs of GPU time each on the H100, back to back): row-stacked
//! matrices (Q|K|V, gate|up) read in one dispatch, the matvec kernel's prologue (RMSNorm of x)
//! and epilogues (the residual add, the SwiGLU gate). Every fused product equals its
//! unfused composition, which is also what runs where the fused kernel does not apply (the CPU,
//! more than `MATVEC_MAX_N` x rows, a GLU matrix split over several bindings).

use super::gpu::{qmatvec_fused, Epilogue, QOptions};
use super::{QStorage, QTensor};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// An RMSNorm applied to a product's input: `x / sqrt(mean(x^2) + eps) * weight`.
#[derive(Clone, Copy)]
pub struct RmsNorm<'a> {
    /// [cols] f32, on the weights' device.
    pub weight: &'a Tensor,
    pub eps: f32,
}

impl QTensor {
    /// Host matrices (memory-mapped file bytes, say) of one type and width stacked row-wise
    /// into one [Σ rows, cols] matrix on `device`: one product instead of several. The bytes
    /// are joined on the host and uploaded once (rows of 18-byte Q4_0 blocks may start at any
    /// byte, which GPU buffer copies cannot do).
    pub fn stack_rows(parts: &[&QTensor], device: &Device) -> Result<QTensor> {
        const OP: &str = "stack_rows";
        let first = parts.first().ok_or_else(|| Error::shape(OP, "no matrices"))?;
        let (ty, cols) = (first.ggml_type(), first.cols());
        if let Some(bad) = parts.iter().find(|p| p.ggml_type() != ty || p.cols() != cols) {
            return Err(Error::shape(
                OP,
                format!("cannot stack {} [{}, {}] on {ty} [_, {cols}]", bad.ggml_type(), bad.rows(), bad.cols()),
            ));
        }
        let mut data = Vec::with_capacity(parts.iter().map(|p| p.byte_len()).sum());
        for p in parts {
            match p.storage() {
                QStorage::Cpu { bytes, offset, len } => {
                    data.extend_from_slice(&(**bytes).as_ref()[*offset..*offset + *len])
                }
                QStorage::Gpu(_) => return Err(Error::mismatch(OP, "the parts must be host matrices")),
            }
        }
        QTensor::from_vec(ty, parts.iter().map(|p| p.rows()).sum(), cols, data, device)
    }

    fn check_input(&self, op: &'static str, x: &Tensor) -> Result<()> {
        if !x.device().same(self.device()) || x.dtype() != DType::F32 || x.dims().last() != Some(&self.cols()) {
            return Err(Error::shape(
                op,
                format!(
                    "input {} ({}) does not match weights [{}, {}]",
                    x.shape(),
                    x.dtype(),
                    self.rows(),
                    self.cols()
                ),
            ));
        }
        Ok(())
    }

    /// `resid + x @ W^T` (a residual connection): x [.., cols], resid [.., rows].
    pub fn qmatmul_add(&self, x: &Tensor, resid: &Tensor) -> Result<Tensor> {
        const OP: &str = "qmatmul_add";
        self.check_input(OP, x)?;
        let n = x.numel() / self.cols().max(1);
        if resid.numel() != n * self.rows() || resid.dims().last() != Some(&self.rows()) || resid.dtype() != DType::F32
        {
            return Err(Error::shape(
                OP,
                format!("residual {} does not match the product [{n}, {}]", resid.shape(), self.rows()),
            ));
        }
        if self.device().gpu().is_some() && resid.device().same(self.device()) {
            if let Some(y) = qmatvec_fused(self, x, Epilogue::Add(resid), None, QOptions::default())? {
                return y.reshape(resid.shape().clone());
            }
        }
        resid.add(&self.qmatmul(x)?)
    }

    /// `rms_norm(x, norm) @ W^T`.
    pub fn qmatmul_rms(&self, x: &Tensor, norm: RmsNorm<'_>) -> Result<Tensor> {
        const OP: &str = "qmatmul_rms";
        self.check_input(OP, x)?;
        if self.device().gpu().is_some() {
            if let Some(y) =
                qmatvec_fused(self, x, Epilogue::Store, Some((norm.weight, norm.eps)), QOptions::default())?
            {
                return Ok(y);
            }
        }
        self.qmatmul(&x.rms_norm(Some(norm.weight), norm.eps)?)
    }

    /// SwiGLU over a gate|up stack W [2F, cols]: `silu(x @ W_gate^T) * (x @ W_up^T)`, [.., F].
    pub fn qmatmul_glu(&self, x: &Tensor) -> Result<Tensor> {
        self.qmatmul_glu_opts(x, None, QOptions::default())
    }

    /// [`QTensor::qmatmul_glu`] of `rms_norm(x, norm)`.
    pub fn qmatmul_glu_rms(&self, x: &Tensor, norm: RmsNorm<'_>) -> Result<Tensor> {
        self.qmatmul_glu_opts(x, Some(norm), QOptions::default())
    }

    /// [`QTensor::qmatmul_glu`] (of `rms_norm(x, norm)` if given) with the kernel knobs of
    /// `opts` (tests of the binding split).
    pub fn qmatmul_glu_opts(&self, x: &Tensor, norm: Option<RmsNorm<'_>>, opts: QOptions) -> Result<Tensor> {
        const OP: &str = "qmatmul_glu";
        self.check_input(OP, x)?;
        if !self.rows().is_multiple_of(2) {
            return Err(Error::shape(OP, format!("a gate|up stack needs an even row count, got {}", self.rows())));
        }
        if self.device().gpu().is_some() {
            if let Some(y) = qmatvec_fused(self, x, Epilogue::Glu, norm.map(|n| (n.weight, n.eps)), opts)? {
                return Ok(y);
            }
        }
        let normed;
        let x = match norm {
            Some(n) => {
                normed = x.rms_norm(Some(n.weight), n.eps)?;
                // The norm could not be fused (a wide row): the GLU epilogue still can.
                if self.device().gpu().is_some() {
                    if let Some(y) = qmatvec_fused(self, &normed, Epilogue::Glu, None, opts)? {
                        return Ok(y);
                    }
                }
                &normed
            }
            None => x,
        };
        let f = self.rows() / 2;
        let y = match self.device() {
            Device::Gpu(_) => super::gpu::qmatmul_opts(self, x, opts)?,
            Device::Cpu => self.qmatmul(x)?,
        };
        let last = y.rank() - 1;
        y.narrow(last, 0, f)?.silu()?.mul(&y.narrow(last, f, f)?)
    }
}
