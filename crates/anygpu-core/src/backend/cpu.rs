//! The CPU backend: the reference implementation of every op (see `crate::ops::*::cpu_*`).

use super::Backend;
use crate::error::Result;
use crate::ops::{
    self, attention::AttentionOpts, elementwise::BinaryOp, reduce::ReduceOp, rope::RopeOpts, softmax::SoftmaxOpts,
    unary::UnaryOp,
};
use crate::tensor::{DType, Tensor};

pub struct CpuBackend;

impl Backend for CpuBackend {
    fn contiguous(&self, x: &Tensor) -> Result<Tensor> {
        ops::copy::cpu_contiguous(x)
    }
    fn cast(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        ops::cast::cpu_cast(x, dtype)
    }
    fn concat(&self, xs: &[&Tensor], dim: usize) -> Result<Tensor> {
        ops::index::cpu_concat(xs, dim)
    }
    fn repeat_interleave(&self, x: &Tensor, dim: usize, n: usize) -> Result<Tensor> {
        ops::index::cpu_repeat_interleave(x, dim, n)
    }
    fn unary(&self, op: UnaryOp, x: &Tensor) -> Result<Tensor> {
        ops::unary::cpu_unary(op, x)
    }
    fn binary(&self, op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        ops::elementwise::cpu_binary(op, a, b)
    }
    fn affine(&self, x: &Tensor, mul: f32, add: f32) -> Result<Tensor> {
        ops::elementwise::cpu_affine(x, mul, add)
    }
    fn where_cond(&self, cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        ops::elementwise::cpu_where(cond, a, b)
    }
    fn reduce(&self, op: ReduceOp, x: &Tensor, axis: usize) -> Result<Tensor> {
        ops::reduce::cpu_reduce(op, x, axis)
    }
    fn dot(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        ops::reduce::cpu_dot(a, b)
    }
    fn softmax(&self, x: &Tensor, opts: SoftmaxOpts) -> Result<Tensor> {
        ops::softmax::cpu_softmax(x, opts)
    }
    fn layer_norm(&self, x: &Tensor, weight: Option<&Tensor>, bias: Option<&Tensor>, eps: f32) -> Result<Tensor> {
        ops::norm::cpu_layer_norm(x, weight, bias, eps)
    }
    fn add_layer_norm(
        &self,
        x: &Tensor,
        residual: &Tensor,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f32,
    ) -> Result<Tensor> {
        ops::norm::cpu_add_layer_norm(x, residual, weight, bias, eps)
    }
    fn rms_norm(&self, x: &Tensor, weight: Option<&Tensor>, eps: f32) -> Result<Tensor> {
        ops::norm::cpu_rms_norm(x, weight, eps)
    }
    fn matmul(&self, a: &Tensor, b: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        ops::matmul::cpu_matmul(a, b, bias)
    }
    fn gather(&self, table: &Tensor, ids: &Tensor) -> Result<Tensor> {
        ops::index::cpu_gather(table, ids)
    }
    fn index_select(&self, x: &Tensor, dim: usize, ids: &Tensor) -> Result<Tensor> {
        ops::index::cpu_index_select(x, dim, ids)
    }
    fn rope(&self, x: &Tensor, start_pos: usize, opts: &RopeOpts) -> Result<Tensor> {
        ops::rope::cpu_rope(x, start_pos, opts)
    }
    fn attention(&self, q: &Tensor, k: &Tensor, v: &Tensor, opts: &AttentionOpts) -> Result<Tensor> {
        ops::attention::cpu_attention(q, k, v, opts)
    }
}
