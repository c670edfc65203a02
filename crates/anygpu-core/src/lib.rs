//! anygpu-core: devices, tensors, ops and quantized formats. See DESIGN.md for the layering:
//! `device` finds and opens GPUs, `gpu` is the runtime (pipelines, buffers, batching),
//! `tensor` the data type, `backend` the op-family trait, `ops` one module per op family
//! (CPU reference + WGSL side by side), `quant` the GGML block formats.

pub mod backend;
pub mod bench;
pub mod device;
pub mod error;
pub mod gpu;
pub mod ops;
pub mod quant;
pub mod tensor;
pub mod testing;

pub use device::Device;
pub use error::{Error, Result};
pub use tensor::{DType, Shape, Tensor};
