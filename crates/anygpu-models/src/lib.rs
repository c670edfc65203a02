//! anygpu-models: model files, tokenizers, model definitions.
