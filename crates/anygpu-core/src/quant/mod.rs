//! GGML quantized block formats: layout, CPU dequantization (the reference), WGSL kernels.
//!
//! - [`blocks`]: the block structs, byte for byte as ggml lays them out;
//! - [`dequantize`]: the clear, reference expansion to f32;
//! - [`matvec`] / [`matmul`]: the CPU products with f32 activations (decode / prefill), equal to
//!   dequantize-then-dot up to summation order: the reference for the GPU kernels;
//! - [`matmul_q8`]: the CPU backend's fast product for model execution, activations rounded to
//!   8-bit blocks as llama.cpp's CPU backend does (chosen per weight by [`CpuMath`]): `q8.rs`
//!   for the 32-weight formats, `q8k.rs` for Q4_K, Q5_K and Q6_K;
//! - [`gpu`]: the WGSL products and gathers that read the blocks as stored, and [`coop`]: the
//!   prefill product on cooperative matrices (tensor cores), where a device has them, and
//!   [`dequant_f16`]: the f16 copy of quantized weights that a long prefill product reads.

pub mod blocks;
pub mod coop;
pub mod copy_ahead;
mod dequant;
pub mod dequant_f16;
pub mod fused;
pub mod gpu;
mod matvec;
mod matvec_layout;
mod q8;
mod q8k;
mod qtensor;
mod quantize;
mod types;

pub use copy_ahead::CopyAhead;
pub use dequant::{dequantize, dequantize_to_vec};
pub use fused::RmsNorm;
pub use matvec::{matmul, matmul_q8, matvec};
#[doc(hidden)]
pub use q8::{round_blocks as q8_round_blocks, HostQ8Block};
pub use qtensor::{CpuMath, QStorage, QTensor, SharedBytes};
pub use quantize::quantize_into;
pub use types::GgmlType;
