//! Llama-family hyperparameters, read from GGUF metadata and checked against the tensors.

use anygpu_core::{Error, Result};

use crate::gguf::GgufFile;

/// Architectures that run on this model definition (llama.cpp's names).
pub const SUPPORTED_ARCHS: [&str; 4] = ["llama", "mistral", "qwen2", "smollm"];

#[derive(Clone, Debug, serde::Serialize)]
pub struct LlamaConfig {
    pub arch: String,
    /// C: model width.
    pub n_embd: usize,
    pub n_layer: usize,
    /// H: query heads; Hkv: key/value heads (GQA when fewer).
    pub n_head: usize,
    pub n_head_kv: usize,
    /// D: head dimension.
    pub head_dim: usize,
    pub n_ff: usize,
    /// V: vocabulary size (rows of the embedding).
    pub n_vocab: usize,
    /// The context length the model was trained for.
    pub n_ctx_train: usize,
    pub rms_eps: f32,
    pub rope_base: f32,
    pub rope_dim: usize,
    /// NeoX rope layout (split halves) instead of interleaved pairs: qwen2 uses it.
    pub rope_neox: bool,
    /// Linear rope scaling: positions are multiplied by this (1 / scaling factor).
    pub rope_freq_scale: f32,
}

fn bad(msg: String) -> Error {
    Error::Format(format!("invalid llama model: {msg}"))
}

impl LlamaConfig {
    pub fn from_gguf(f: &GgufFile) -> Result<LlamaConfig> {
        let arch = f.get_str("general.architecture")?.to_string();
        if !SUPPORTED_ARCHS.contains(&arch.as_str()) {
            return Err(Error::Unsupported(format!(
                "model architecture '{arch}' is not supported (supported: {})",
                SUPPORTED_ARCHS.join(", ")
            )));
        }
        let key = |k: &str| format!("{arch}.{k}");
        let u = |k: &str| -> Result<usize> { Ok(f.get_u32(&key(k))? as usize) };
        let n_embd = u("embedding_length")?;
        let n_head = u("attention.head_count")?;
        let n_head_kv = f.get_u32_or(&key("attention.head_count_kv"), n_head as u32)? as usize;
        if n_head == 0 || n_head_kv == 0 || n_head % n_head_kv != 0 {
            return Err(bad(format!("{n_head} query heads cannot be grouped over {n_head_kv} key/value heads")));
        }
        if n_embd == 0 || n_embd % n_head != 0 {
            return Err(bad(format!("embedding length {n_embd} is not a multiple of {n_head} heads")));
        }
        let head_dim = n_embd / n_head;
        let rope_dim = f.get_u32_or(&key("rope.dimension_count"), head_dim as u32)? as usize;
        if rope_dim > head_dim || !rope_dim.is_multiple_of(2) {
            return Err(bad(format!("rope dimension {rope_dim} does not fit head dimension {head_dim}")));
        }
        let scaling = match f.get(&key("rope.scaling.type")) {
            Some(_) => f.get_str(&key("rope.scaling.type"))?.to_string(),
            None => "none".into(),
        };
        let rope_freq_scale = match scaling.as_str() {
            "none" => 1.0,
            "linear" => {
                let factor = f.get_f32_or(&key("rope.scaling.factor"), 1.0)?;
                #[allow(clippy::neg_cmp_op_on_partial_ord)] // NaN must fail too
                if !(factor > 0.0) {
                    return Err(bad(format!("rope scaling factor {factor}")));
                }
                1.0 / factor
            }
            other => {
                return Err(Error::Unsupported(format!("rope scaling type '{other}' is not supported (none, linear)")))
            }
        };
        let token_embd =
            f.tensor("token_embd.weight").ok_or_else(|| bad("tensor token_embd.weight is missing".into()))?;
        let n_vocab = token_embd.dims.get(1).copied().unwrap_or(0) as usize;
        let cfg = LlamaConfig {
            n_layer: u("block_count")?,
            n_ff: u("feed_forward_length")?,
            n_ctx_train: u("context_length")?,
            rms_eps: f.get_f32_or(&key("attention.layer_norm_rms_epsilon"), 1e-5)?,
            rope_base: f.get_f32_or(&key("rope.freq_base"), 10_000.0)?,
            rope_neox: arch == "qwen2",
            arch,
            n_embd,
            n_head,
            n_head_kv,
            head_dim,
            n_vocab,
            rope_dim,
            rope_freq_scale,
        };
        cfg.check_tensors(f)?;
        Ok(cfg)
    }

    /// Every tensor the config implies exists with the shape it implies, and no layer beyond
    /// `n_layer` exists (a block_count that does not fit the tensors is an error).
    fn check_tensors(&self, f: &GgufFile) -> Result<()> {
        let (c, d) = (self.n_embd as u64, self.head_dim as u64);
        let (q, kv, ff) = (self.n_head as u64 * d, self.n_head_kv as u64 * d, self.n_ff as u64);
        let expect = |name: &str, dims: &[u64], required: bool| -> Result<()> {
            match f.tensor(name) {
                Some(t) if t.dims == dims => Ok(()),
                Some(t) => {
                    Err(bad(format!("tensor {name} has shape {:?}, the hyperparameters imply {dims:?}", t.dims)))
                }
                None if required => Err(bad(format!("tensor {name} is missing"))),
                None => Ok(()),
            }
        };
        expect("token_embd.weight", &[c, self.n_vocab as u64], true)?;
        expect("output_norm.weight", &[c], true)?;
        expect("output.weight", &[c, self.n_vocab as u64], false)?;
        for i in 0..self.n_layer {
            let b = |s: &str| format!("blk.{i}.{s}");
            expect(&b("attn_norm.weight"), &[c], true)?;
            expect(&b("attn_q.weight"), &[c, q], true)?;
            expect(&b("attn_k.weight"), &[c, kv], true)?;
            expect(&b("attn_v.weight"), &[c, kv], true)?;
            expect(&b("attn_output.weight"), &[q, c], true)?;
            expect(&b("attn_q.bias"), &[q], false)?;
            expect(&b("attn_k.bias"), &[kv], false)?;
            expect(&b("attn_v.bias"), &[kv], false)?;
            expect(&b("ffn_norm.weight"), &[c], true)?;
            expect(&b("ffn_gate.weight"), &[c, ff], true)?;
            expect(&b("ffn_up.weight"), &[c, ff], true)?;
            expect(&b("ffn_down.weight"), &[ff, c], true)?;
        }
        if f.tensor(&format!("blk.{}.attn_norm.weight", self.n_layer)).is_some() {
            return Err(bad(format!("block_count is {} but the file has more layers", self.n_layer)));
        }
        Ok(())
    }
}
