//! The `Backend` trait: every op family a device must run, each method returning `Result`.
//! Two implementations: `CpuBackend` (the reference, and the fallback) and `GpuContext`
//! (WGSL kernels). Both are thin: the op modules in `crate::ops` own the shape rules, the CPU
//! reference and the GPU dispatch of each family, side by side.

pub mod cpu;
mod gpu;

use crate::error::Result;
use crate::ops::elementwise::BinaryOp;
use crate::ops::reduce::ReduceOp;
use crate::tensor::Tensor;

pub trait Backend: Send + Sync {
    /// A contiguous copy of any strided view.
    fn contiguous(&self, x: &Tensor) -> Result<Tensor>;
    /// `op(a, b)` elementwise, with numpy broadcasting.
    fn binary(&self, op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor>;
    /// `x * mul + add` elementwise.
    fn affine(&self, x: &Tensor, mul: f32, add: f32) -> Result<Tensor>;
    /// Reduces one axis (kept with size 1 removed: the output drops that axis).
    fn reduce(&self, op: ReduceOp, x: &Tensor, axis: usize) -> Result<Tensor>;
    /// The dot product of two equal-length tensors, as a one-element tensor (two-pass on GPU).
    fn dot(&self, a: &Tensor, b: &Tensor) -> Result<Tensor>;
    /// Batched matrix product `[.., M, K] x [.., K, N]` (either operand may be a transposed view).
    fn matmul(&self, a: &Tensor, b: &Tensor) -> Result<Tensor>;
}
