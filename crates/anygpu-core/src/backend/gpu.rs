//! The GPU backend: `GpuContext` runs every op family through WGSL kernels
//! (see `crate::ops::*::gpu_*`).

use super::Backend;
use crate::error::Result;
use crate::gpu::GpuContext;
use crate::ops::{
    self, attention::AttentionOpts, elementwise::BinaryOp, reduce::ReduceOp, rope::RopeOpts, softmax::SoftmaxOpts,
    unary::UnaryOp,
};
use crate::tensor::{DType, Tensor};

impl Backend for GpuContext {
    fn contiguous(&self, x: &Tensor) -> Result<Tensor> {
        ops::copy::gpu_contiguous(x)
    }
    fn cast(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        ops::cast::gpu_cast(x, dtype)
    }
    fn concat(&self, xs: &[&Tensor], dim: usize) -> Result<Tensor> {
        ops::index::gpu_concat(xs, dim)
    }
    fn repeat_interleave(&self, x: &Tensor, dim: usize, n: usize) -> Result<Tensor> {
        ops::index::gpu_repeat_interleave(x, dim, n)
    }
    fn unary(&self, op: UnaryOp, x: &Tensor) -> Result<Tensor> {
        ops::unary::gpu_unary(op, x)
    }
    fn binary(&self, op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        ops::elementwise::gpu_binary(op, a, b)
    }
    fn affine(&self, x: &Tensor, mul: f32, add: f32) -> Result<Tensor> {
        ops::elementwise::gpu_affine(x, mul, add)
    }
    fn where_cond(&self, cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        ops::elementwise::gpu_where(cond, a, b)
    }
    fn reduce(&self, op: ReduceOp, x: &Tensor, axis: usize) -> Result<Tensor> {
        ops::reduce::gpu_reduce(op, x, axis)
    }
    fn dot(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        ops::reduce::gpu_dot(a, b)
    }
    fn softmax(&self, x: &Tensor, opts: SoftmaxOpts) -> Result<Tensor> {
        ops::softmax::gpu_softmax(x, opts)
    }
    fn layer_norm(&self, x: &Tensor, weight: Option<&Tensor>, bias: Option<&Tensor>, eps: f32) -> Result<Tensor> {
        ops::norm::gpu_layer_norm(x, weight, bias, eps)
    }
    fn add_layer_norm(
        &self,
        x: &Tensor,
        residual: &Tensor,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f32,
    ) -> Result<Tensor> {
        ops::norm::gpu_add_layer_norm(x, residual, weight, bias, eps)
    }
    fn rms_norm(&self, x: &Tensor, weight: Option<&Tensor>, eps: f32) -> Result<Tensor> {
        ops::norm::gpu_rms_norm(x, weight, eps)
    }
    fn matmul(&self, a: &Tensor, b: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        ops::matmul::gpu_matmul(a, b, bias)
    }
    fn gather(&self, table: &Tensor, ids: &Tensor) -> Result<Tensor> {
        ops::index::gpu_gather(table, ids)
    }
    fn index_select(&self, x: &Tensor, dim: usize, ids: &Tensor) -> Result<Tensor> {
        ops::index::gpu_index_select(x, dim, ids)
    }
    fn rope(&self, x: &Tensor, start_pos: usize, opts: &RopeOpts) -> Result<Tensor> {
        ops::rope::gpu_rope(x, start_pos, opts)
    }
    fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor, opts: &AttentionOpts) -> Result<Tensor> {
        ops::attention::gpu_attention(q, k, v, opts)
    }
}
