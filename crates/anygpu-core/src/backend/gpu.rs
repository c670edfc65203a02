//! The GPU backend: `GpuContext` runs every op family through WGSL kernels
//! (see `crate::ops::*::gpu`).

use super::Backend;
use crate::error::Result;
use crate::gpu::GpuContext;
use crate::ops::{self, elementwise::BinaryOp, reduce::ReduceOp};
use crate::tensor::Tensor;

impl Backend for GpuContext {
    fn contiguous(&self, x: &Tensor) -> Result<Tensor> {
        ops::copy::gpu_contiguous(x)
    }
    fn binary(&self, op: BinaryOp, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        ops::elementwise::gpu_binary(op, a, b)
    }
    fn affine(&self, x: &Tensor, mul: f32, add: f32) -> Result<Tensor> {
        ops::elementwise::gpu_affine(x, mul, add)
    }
    fn reduce(&self, op: ReduceOp, x: &Tensor, axis: usize) -> Result<Tensor> {
        ops::reduce::gpu_reduce(op, x, axis)
    }
    fn dot(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        ops::reduce::gpu_dot(a, b)
    }
    fn matmul(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        ops::matmul::gpu_matmul(a, b)
    }
}
