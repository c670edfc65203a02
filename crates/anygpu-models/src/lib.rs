//! anygpu-models: model files (GGUF, safetensors), tokenizers, chat templates, model
//! definitions (llama, BERT) and sampling. Depends on anygpu-core only.

pub mod bert;
pub mod chat_template;
pub mod generate;
pub mod gguf;
pub mod llama;
pub mod safetensors_file;
pub mod sampling;
pub mod synthetic;
pub mod tokenizer;
