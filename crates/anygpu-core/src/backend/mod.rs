//! The `Backend` trait: every op family a device must run, each method returning `Result`.
//! Two implementations: `CpuBackend` (the reference, and the fallback) and `GpuContext`
//! (WGSL kernels). Both are thin: the op modules in `crate::ops` own the shape rules, the CPU
//! reference and the GPU dispatch of each family, side by side.

pub mod cpu;
mod gpu;

use crate::error::Result;
use crate::ops::attention::AttentionOpts;
use crate::ops::elementwise::BinaryOp;
use crate::ops::reduce::ReduceOp;
use crate::ops::rope::RopeOpts;
use crate::ops::softmax::SoftmaxOpts;
use crate::ops::unary::UnaryOp;
use crate::tensor::{DType, Tensor};

pub trait Backend: Send + Sync {
    // ---- memory and layout ----
    /// A contiguous copy of any strided view.
    fn contiguous(&self, x: &Tensor) -> Result<Tensor>;
    /// Converts between f32, f16 and bf16.
    fn cast(&self, x: &Tensor, dtype: DType) -> Result<Tensor>;
    /// Concatenation along `dim`.
    fn concat(&self, xs: &[&Tensor], dim: usize) -> Result<Tensor>;
    /// Repeats every slice along `dim` `n` times in place (`[a, b] -> [a, a, b, b]`): GQA's
    /// key/value heads shared by groups of query heads.
    fn repeat_interleave(&self, x: &Tensor, dim: usize, n: usize) -> Result<Tensor>;

    // ---- elementwise ----
    fn unary(&self, op: UnaryOp, x: &Tensor) -> Result<Tensor>;
    /// `op(a, b)` elementwise, with numpy broadcasting.
    fn binary(&self, op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor>;
    /// `x * mul + add` elementwise.
    fn affine(&self, x: &Tensor, mul: f32, add: f32) -> Result<Tensor>;
    /// `cond != 0 ? a : b`, broadcasting all three.
    fn where_cond(&self, cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor>;

    // ---- reductions ----
    /// Reduces one axis (the output drops that axis).
    fn reduce(&self, op: ReduceOp, x: &Tensor, axis: usize) -> Result<Tensor>;
    /// The dot product of two equal-length tensors, as a one-element tensor (two-pass on GPU).
    fn dot(&self, a: &Tensor, b: &Tensor) -> Result<Tensor>;

    // ---- normalisation ----
    /// softmax / log_softmax over the last axis, optionally causally masked.
    fn softmax(&self, x: &Tensor, opts: SoftmaxOpts) -> Result<Tensor>;
    /// Layer norm over the last axis, with optional weight and bias.
    fn layer_norm(&self, x: &Tensor, weight: Option<&Tensor>, bias: Option<&Tensor>, eps: f32) -> Result<Tensor>;
    /// `layer_norm(x + residual)` in one op (x and residual of one shape).
    fn add_layer_norm(
        &self,
        x: &Tensor,
        residual: &Tensor,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f32,
    ) -> Result<Tensor>;
    /// RMS norm over the last axis, with optional weight.
    fn rms_norm(&self, x: &Tensor, weight: Option<&Tensor>, eps: f32) -> Result<Tensor>;

    // ---- matrix products ----
    /// Batched matrix product `[.., M, K] x [.., K, N]` (+ bias over N); either operand may be
    /// a transposed view.
    fn matmul(&self, a: &Tensor, b: &Tensor, bias: Option<&Tensor>) -> Result<Tensor>;

    // ---- indexing ----
    /// Embedding lookup: rows of `table` [V, C] for integer `ids` [..] -> [.., C].
    fn gather(&self, table: &Tensor, ids: &Tensor) -> Result<Tensor>;
    /// Slices of `x` along `dim` picked by integer `ids` [N].
    fn index_select(&self, x: &Tensor, dim: usize, ids: &Tensor) -> Result<Tensor>;

    // ---- transformer blocks ----
    /// Rotary position embedding of `x` [.., T, H, D] for positions `start_pos..start_pos+T`.
    fn rope(&self, x: &Tensor, start_pos: usize, opts: &RopeOpts) -> Result<Tensor>;
    /// Scaled dot-product attention: q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D] -> [B, Hq, Tq, D].
    fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor, opts: &AttentionOpts) -> Result<Tensor>;
}
