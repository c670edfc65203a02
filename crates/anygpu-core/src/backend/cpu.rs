//! The CPU backend: the reference implementation of every op (see `crate::ops::*::cpu`).

use super::Backend;
use crate::error::Result;
use crate::ops::{self, elementwise::BinaryOp, reduce::ReduceOp};
use crate::tensor::Tensor;

pub struct CpuBackend;

impl Backend for CpuBackend {
    fn contiguous(&self, x: &Tensor) -> Result<Tensor> {
        ops::copy::cpu_contiguous(x)
    }
    fn binary(&self, op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        ops::elementwise::cpu_binary(op, a, b)
    }
    fn affine(&self, x: &Tensor, mul: f32, add: f32) -> Result<Tensor> {
        ops::elementwise::cpu_affine(x, mul, add)
    }
    fn reduce(&self, op: ReduceOp, x: &Tensor, axis: usize) -> Result<Tensor> {
        ops::reduce::cpu_reduce(op, x, axis)
    }
    fn dot(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        ops::reduce::cpu_dot(a, b)
    }
    fn matmul(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        ops::matmul::cpu_matmul(a, b)
    }
}
