//! The llama family: configuration from GGUF metadata, the model, its KV cache.

mod config;
pub mod decode_graph;
mod kv_cache;
mod model;

pub use config::{LlamaConfig, SUPPORTED_ARCHS};
pub use kv_cache::KvCache;
pub use model::Llama;
