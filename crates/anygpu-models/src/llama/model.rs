//! The llama-family transformer (Llama 2/3, SmolLM, Mistral, TinyLlama, Qwen2): token
//! embedding, `n_layer` blocks of RMSNorm -> GQA attention with RoPE -> RMSNorm -> SwiGLU,
//! final norm, output projection (tied to the embedding when the file has no output.weight).
//! Weight names follow the GGUF keys. Weights stay in their GGUF block format (QTensor).

use std::sync::Arc;

use anygpu_core::ops::attention::AttentionOpts;
use anygpu_core::ops::rope::RopeOpts;
use anygpu_core::quant::{QTensor, SharedBytes};
use anygpu_core::{DType, Device, Error, Result, Tensor};

use super::config::LlamaConfig;
use super::kv_cache::KvCache;
use crate::gguf::GgufFile;

/// The memory-mapped file, shared by every CPU weight without copying.
struct MappedFile(Arc<GgufFile>);

impl AsRef<[u8]> for MappedFile {
    fn as_ref(&self) -> &[u8] {
        self.0.bytes()
    }
}

struct Block {
    attn_norm: Tensor,
    wq: QTensor,
    wk: QTensor,
    wv: QTensor,
    bq: Option<Tensor>,
    bk: Option<Tensor>,
    bv: Option<Tensor>,
    wo: QTensor,
    ffn_norm: Tensor,
    w_gate: QTensor,
    w_up: QTensor,
    w_down: QTensor,
}

pub struct Llama {
    pub config: LlamaConfig,
    device: Device,
    token_embd: QTensor,
    blocks: Vec<Block>,
    output_norm: Tensor,
    /// None: tied to `token_embd`.
    output: Option<QTensor>,
    rope: RopeOpts,
}

/// Loads one weight of the file onto `device`.
struct Loader<'a> {
    file: &'a Arc<GgufFile>,
    shared: SharedBytes,
    device: &'a Device,
    /// Called after each tensor with (tensors done, bytes done): drives the progress bar.
    progress: &'a mut dyn FnMut(usize, u64),
    done: usize,
    bytes: u64,
}

impl Loader<'_> {
    fn info(&self, name: &str) -> Result<crate::gguf::TensorInfo> {
        self.file.tensor(name).cloned().ok_or_else(|| Error::Format(format!("tensor {name} is missing")))
    }

    fn tick(&mut self, bytes: u64) {
        self.done += 1;
        self.bytes += bytes;
        (self.progress)(self.done, self.bytes);
    }

    /// A 2-D weight in its block format: rows = dims[1], cols = dims[0].
    fn matrix(&mut self, name: &str) -> Result<QTensor> {
        let t = self.info(name)?;
        let (cols, rows) = (t.dims[0] as usize, t.dims.get(1).copied().unwrap_or(1) as usize);
        let q = QTensor::new(
            t.ggml_type,
            rows,
            cols,
            self.shared.clone(),
            t.offset as usize,
            t.n_bytes as usize,
            self.device,
        )
        .map_err(|e| Error::Format(format!("tensor {name}: {e}")))?;
        self.tick(t.n_bytes);
        Ok(q)
    }

    /// A 1-D f32 tensor (norm weights, biases): stored as F32 (or F16/BF16, converted).
    fn vector(&mut self, name: &str) -> Result<Tensor> {
        let t = self.info(name)?;
        let n = t.n_elements as usize;
        let data = self.file.tensor_data(&t)?;
        let q = QTensor::from_vec(t.ggml_type, 1, n, data.to_vec(), &Device::Cpu)
            .map_err(|e| Error::Format(format!("tensor {name}: {e}")))?;
        let v = q.dequantize()?.reshape([n])?.to_device(self.device)?;
        self.tick(t.n_bytes);
        Ok(v)
    }

    fn optional_vector(&mut self, name: &str) -> Result<Option<Tensor>> {
        if self.file.tensor(name).is_some() {
            self.vector(name).map(Some)
        } else {
            Ok(None)
        }
    }
}

impl Llama {
    /// Builds the model from a validated GGUF file, uploading weights to `device` unchanged.
    /// `progress(tensors_done, bytes_done)` is called after each tensor.
    pub fn load(file: &Arc<GgufFile>, device: &Device, progress: &mut dyn FnMut(usize, u64)) -> Result<Llama> {
        let config = LlamaConfig::from_gguf(file)?;
        let shared: SharedBytes = Arc::new(MappedFile(file.clone()));
        let mut ld = Loader { file, shared, device, progress, done: 0, bytes: 0 };
        let token_embd = ld.matrix("token_embd.weight")?;
        let mut blocks = Vec::with_capacity(config.n_layer);
        for i in 0..config.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}");
            blocks.push(Block {
                attn_norm: ld.vector(&n("attn_norm.weight"))?,
                wq: ld.matrix(&n("attn_q.weight"))?,
                wk: ld.matrix(&n("attn_k.weight"))?,
                wv: ld.matrix(&n("attn_v.weight"))?,
                bq: ld.optional_vector(&n("attn_q.bias"))?,
                bk: ld.optional_vector(&n("attn_k.bias"))?,
                bv: ld.optional_vector(&n("attn_v.bias"))?,
                wo: ld.matrix(&n("attn_output.weight"))?,
                ffn_norm: ld.vector(&n("ffn_norm.weight"))?,
                w_gate: ld.matrix(&n("ffn_gate.weight"))?,
                w_up: ld.matrix(&n("ffn_up.weight"))?,
                w_down: ld.matrix(&n("ffn_down.weight"))?,
            });
        }
        let output_norm = ld.vector("output_norm.weight")?;
        let output = if file.tensor("output.weight").is_some() { Some(ld.matrix("output.weight")?) } else { None };
        let freq_factors = match file.tensor("rope_freqs.weight") {
            Some(_) => Some(ld.vector("rope_freqs.weight")?.to_vec_f32()?),
            None => None,
        };
        let rope = RopeOpts {
            base: config.rope_base,
            neox: config.rope_neox,
            rotary_dim: config.rope_dim,
            freq_scale: config.rope_freq_scale,
            freq_factors,
        };
        device.sync()?;
        Ok(Llama { config, device: device.clone(), token_embd, blocks, output_norm, output, rope })
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Number of tensors `load` reports progress for.
    pub fn tensor_count(file: &GgufFile) -> usize {
        file.tensors().len()
    }

    /// A KV cache for up to `n_ctx` positions on this model's device.
    pub fn new_cache(&self, n_ctx: usize) -> Result<KvCache> {
        KvCache::new(&self.config, n_ctx, &self.device)
    }

    /// Runs `tokens` at positions `cache.len()..`, appends their keys/values to the cache and
    /// returns the logits [T, V] of every position (`all_logits`) or of the last one [1, V].
    pub fn forward(&self, tokens: &[u32], cache: &mut KvCache, all_logits: bool) -> Result<Tensor> {
        let cfg = &self.config;
        let t = tokens.len();
        if t == 0 {
            return Err(Error::shape("llama forward", "no tokens"));
        }
        let pos = cache.len();
        if pos + t > cache.capacity() {
            return Err(Error::shape(
                "llama forward",
                format!(
                    "context length exceeded: {} positions requested, the context holds {} (raise --ctx-size, at most the model's {})",
                    pos + t,
                    cache.capacity(),
                    cfg.n_ctx_train
                ),
            ));
        }
        if let Some(&bad) = tokens.iter().find(|&&id| id as usize >= cfg.n_vocab) {
            return Err(Error::Index { op: "token id", index: bad as i64, len: cfg.n_vocab });
        }
        let (h, hkv, d) = (cfg.n_head, cfg.n_head_kv, cfg.head_dim);
        let attn = AttentionOpts { scale: 1.0 / (d as f32).sqrt(), causal: true };
        let mut x = self.token_embd.gather_rows(tokens)?; // [T, C]
        for (li, b) in self.blocks.iter().enumerate() {
            let hn = x.rms_norm(Some(&b.attn_norm), cfg.rms_eps)?;
            let proj = |w: &QTensor, bias: &Option<Tensor>| -> Result<Tensor> {
                let y = w.qmatmul(&hn)?;
                match bias {
                    Some(bv) => y.add(bv),
                    None => Ok(y),
                }
            };
            let q = proj(&b.wq, &b.bq)?.reshape([t, h, d])?.rope(pos, &self.rope)?;
            let k = proj(&b.wk, &b.bk)?.reshape([t, hkv, d])?.rope(pos, &self.rope)?;
            let v = proj(&b.wv, &b.bv)?.reshape([t, hkv, d])?;
            let (keys, values) = cache.append(li, &k, &v)?; // [1, Hkv, pos+T, D] views
            let q = q.permute(&[1, 0, 2])?.unsqueeze(0)?; // [1, H, T, D]
            let a = q.attention(&keys, &values, &attn)?; // [1, H, T, D]
            let a = a.reshape([h, t, d])?.permute(&[1, 0, 2])?.reshape([t, h * d])?;
            x = x.add(&b.wo.qmatmul(&a)?)?;
            let hn = x.rms_norm(Some(&b.ffn_norm), cfg.rms_eps)?;
            let gate = b.w_gate.qmatmul(&hn)?.silu()?;
            let up = b.w_up.qmatmul(&hn)?;
            x = x.add(&b.w_down.qmatmul(&gate.mul(&up)?)?)?;
        }
        cache.advance(t);
        let x = if all_logits { x } else { x.narrow(0, t - 1, 1)? };
        let x = x.rms_norm(Some(&self.output_norm), cfg.rms_eps)?;
        self.output.as_ref().unwrap_or(&self.token_embd).qmatmul(&x)
    }

    /// Bytes of weights on the device.
    pub fn weight_bytes(&self) -> usize {
        let q = |w: &QTensor| w.byte_len();
        let blocks: usize = self
            .blocks
            .iter()
            .map(|b| q(&b.wq) + q(&b.wk) + q(&b.wv) + q(&b.wo) + q(&b.w_gate) + q(&b.w_up) + q(&b.w_down))
            .sum();
        blocks + q(&self.token_embd) + self.output.as_ref().map_or(0, q)
    }

    pub fn dtype(&self) -> DType {
        DType::F32
    }
}
