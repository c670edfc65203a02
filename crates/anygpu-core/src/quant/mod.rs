//! GGML quantized block formats: layout, CPU dequantization (the reference), WGSL kernels.
//!
//! - [`blocks`]: the block structs, byte for byte as ggml lays them out;
//! - [`dequantize`]: the clear, reference expansion to f32;
//! - [`matvec`] / [`matmul`]: the fast CPU products used by the CPU backend (decode / prefill).

pub mod blocks;
mod dequant;
pub mod gpu;
mod matvec;
mod qtensor;
mod quantize;
mod types;

pub use dequant::{dequantize, dequantize_to_vec};
pub use matvec::{matmul, matvec};
pub use qtensor::{QStorage, QTensor, SharedBytes};
pub use quantize::quantize_into;
pub use types::GgmlType;
