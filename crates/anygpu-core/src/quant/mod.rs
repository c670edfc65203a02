//! GGML quantized block formats: layout, CPU dequantization (the reference), WGSL kernels.

mod types;

pub use types::GgmlType;
