//! The BERT encoder (Hugging Face `BertModel`): token + position + segment embeddings and a
//! layer norm, then `num_hidden_layers` post-norm blocks of
//! `x = LN(x + Wo·attention(x))`, `x = LN(x + W2·gelu(W1·x))`.
//!
//! Shape letters: B sentences, T tokens per sentence (the longest of the batch; shorter ones
//! padded), C hidden size, H heads, D = C / H, F intermediate size.
//!
//! Weights are the checkpoint's tensors under their own names (with or without the `bert.`
//! prefix), converted to f32; the linear weights then to f16 where [`WeightDType`] says so (by
//! default on GPUs with tensor cores reachable through cooperative matrices: the products run
//! there, activations rounded to f16, f32 accumulation). Changes at load time, all exact in real arithmetic: linear
//! weights are stored transposed, [in, out], so that every product is `x [rows, in] x W`
//! with both operands row-major (the CPU's gemm ran the QKV product 1.4x faster than
//! through a transposed view); the query, key and value projections are stacked into one
//! [C, 3C] weight (one product instead of three); the query weight and bias are pre-scaled by
//! 1/sqrt(D) (no scaling pass over the scores).
//!
//! Attention: on a GPU, when every sentence of the batch has the same length (no padding),
//! the fused attention op reads Q, K and V in place from the QKV product and stores its output
//! in [B, T, H, D] order, so the output projection reads it as [B·T, C] without a copy.
//! Otherwise scores are a batched product [B·H, T, D] x [B·H, D, T], plus an additive mask
//! [B, 1, 1, T] (0, or -1e9 on padded keys) broadcast over heads and queries, softmax, and a
//! product with V.
//! The CPU always takes the explicit path (its fused attention op is a per-row reference
//! loop, 3x slower), one sentence at a time: per sentence Q, K and V are [H, T, D] views of
//! the QKV product with a single batch stride, which the CPU matmul reads in place, so the
//! [B, H, T, D] copy of Q, K and V that a whole-batch product needs is never made.
//!
//! Each residual and the layer norm after it are one op (`add_layer_norm`: one pass over both
//! inputs, no [B·T, C] sum in memory).

use std::path::Path;

use anygpu_core::ops::attention::AttentionOpts;
use anygpu_core::ops::matmul::gpu_has_coop_matmul;
use anygpu_core::ops::unary::UnaryOp;
use anygpu_core::{DType, Device, Error, Result, Tensor};

use super::config::BertConfig;
use crate::safetensors_file::SafetensorsFile;

/// The additive mask on padded keys: far below any real score, yet finite (no inf - inf).
const MASKED: f32 = -1e9;

/// Linear weights are [in, out] (transposed from the checkpoint).
struct Layer {
    /// [C, 3C]: query (pre-scaled), key, value side by side.
    w_qkv: Tensor,
    b_qkv: Tensor,
    w_o: Tensor,
    b_o: Tensor,
    ln1_w: Tensor,
    ln1_b: Tensor,
    /// [C, F]
    w_in: Tensor,
    b_in: Tensor,
    /// [F, C]
    w_out: Tensor,
    b_out: Tensor,
    ln2_w: Tensor,
    ln2_b: Tensor,
}

/// How the attention of a batch is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionPath {
    /// The fused op on a GPU when there is no padding, explicit scores + mask otherwise.
    Auto,
    /// Always explicit scores (for tests and benchmarks).
    Unfused,
}

/// The dtype of the encoder's linear weights on the device (`--dtype` of `anygpu embed`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightDType {
    /// f16 on a GPU whose tensor cores the `coop` matmul path reaches (the activations are
    /// then rounded to f16 inside the products, accumulation stays f32), f32 elsewhere.
    #[default]
    Auto,
    F32,
    F16,
}

impl WeightDType {
    pub fn parse(s: &str) -> Option<WeightDType> {
        match s {
            "auto" => Some(WeightDType::Auto),
            "f32" => Some(WeightDType::F32),
            "f16" => Some(WeightDType::F16),
            _ => None,
        }
    }

    /// The dtype this choice gives on `device`.
    pub fn resolve(self, device: &Device) -> DType {
        match self {
            WeightDType::F32 => DType::F32,
            WeightDType::F16 => DType::F16,
            WeightDType::Auto => match device.gpu() {
                Some(ctx) if gpu_has_coop_matmul(ctx) => DType::F16,
                _ => DType::F32,
            },
        }
    }
}

pub struct BertModel {
    pub config: BertConfig,
    device: Device,
    word_emb: Tensor,
    /// Position embeddings with the segment-0 embedding already added: [P, C].
    pos_type0: Tensor,
    type_emb: Tensor,
    pos_emb: Tensor,
    emb_ln_w: Tensor,
    emb_ln_b: Tensor,
    layers: Vec<Layer>,
    act: UnaryOp,
    eps: f32,
    pub attention_path: AttentionPath,
    /// The checkpoint's float type (`F32`, `F16`, `BF16`: the word embeddings' dtype).
    pub checkpoint_dtype: String,
    /// The dtype of the linear weights on the device (see [`WeightDType`]); embeddings, norms
    /// and biases are f32.
    pub weight_dtype: DType,
}

/// One padded batch of token ids, row-major [B, T]; `lengths[b]` real tokens in row b.
pub struct Batch<'a> {
    pub ids: &'a [u32],
    /// Segment ids [B, T]; None means all 0 (single sentences).
    pub type_ids: Option<&'a [u32]>,
    pub lengths: &'a [usize],
    pub t: usize,
}

impl Batch<'_> {
    pub fn b(&self) -> usize {
        self.lengths.len()
    }
}

impl BertModel {
    /// Loads `config.json` and `model.safetensors` from a Hugging Face folder.
    pub fn load_dir(dir: &Path, device: &Device, weights: WeightDType) -> Result<BertModel> {
        let config = BertConfig::from_file(&dir.join("config.json"))?;
        let file = SafetensorsFile::open(dir.join("model.safetensors"))?;
        Self::load(config, &file, device, weights)
    }

    /// Builds the model from the checkpoint's tensors, checking every shape against `config`.
    pub fn load(
        config: BertConfig,
        file: &SafetensorsFile,
        device: &Device,
        weights: WeightDType,
    ) -> Result<BertModel> {
        let weight_dtype = weights.resolve(device);
        let _loading = device.gpu().map(|g| g.loading_weights());
        let c = config.hidden_size;
        let f = config.intermediate_size;
        let prefix = if file.contains("bert.embeddings.word_embeddings.weight") { "bert." } else { "" };
        let cpu = Device::Cpu;
        let get = |name: &str, shape: &[usize]| file.load_f32(&format!("{prefix}{name}"), Some(shape), &cpu);
        // LayerNorm parameters are `weight`/`bias`, or `gamma`/`beta` in old TF conversions.
        let ln = |base: &str| -> Result<(Tensor, Tensor)> {
            let w = format!("{prefix}{base}.weight");
            if file.contains(&w) || !file.contains(&format!("{prefix}{base}.gamma")) {
                Ok((get(&format!("{base}.weight"), &[c])?, get(&format!("{base}.bias"), &[c])?))
            } else {
                Ok((get(&format!("{base}.gamma"), &[c])?, get(&format!("{base}.beta"), &[c])?))
            }
        };
        let up = |t: Tensor| t.to_device(device);
        // A checkpoint's [out, in] linear weight as [in, out] in the chosen dtype, on the device.
        let linear = |t: Tensor| t.transpose(0, 1)?.contiguous()?.to_dtype(weight_dtype)?.to_device(device);
        let word_emb = get("embeddings.word_embeddings.weight", &[config.vocab_size, c])?;
        let pos_emb = get("embeddings.position_embeddings.weight", &[config.max_position_embeddings, c])?;
        let type_emb = get("embeddings.token_type_embeddings.weight", &[config.type_vocab_size, c])?;
        let pos_type0 = pos_emb.add(&type_emb.narrow(0, 0, 1)?)?;
        let (emb_ln_w, emb_ln_b) = ln("embeddings.LayerNorm")?;
        let scale = 1.0 / (config.head_dim() as f32).sqrt();
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let n = |s: &str| format!("encoder.layer.{i}.{s}");
            let wq = get(&n("attention.self.query.weight"), &[c, c])?.scale(scale)?;
            let bq = get(&n("attention.self.query.bias"), &[c])?.scale(scale)?;
            let wk = get(&n("attention.self.key.weight"), &[c, c])?;
            let bk = get(&n("attention.self.key.bias"), &[c])?;
            let wv = get(&n("attention.self.value.weight"), &[c, c])?;
            let bv = get(&n("attention.self.value.bias"), &[c])?;
            let (ln1_w, ln1_b) = ln(&n("attention.output.LayerNorm"))?;
            let (ln2_w, ln2_b) = ln(&n("output.LayerNorm"))?;
            layers.push(Layer {
                w_qkv: linear(Tensor::concat(&[&wq, &wk, &wv], 0)?)?,
                b_qkv: up(Tensor::concat(&[&bq, &bk, &bv], 0)?)?,
                w_o: linear(get(&n("attention.output.dense.weight"), &[c, c])?)?,
                b_o: up(get(&n("attention.output.dense.bias"), &[c])?)?,
                ln1_w: up(ln1_w)?,
                ln1_b: up(ln1_b)?,
                w_in: linear(get(&n("intermediate.dense.weight"), &[f, c])?)?,
                b_in: up(get(&n("intermediate.dense.bias"), &[f])?)?,
                w_out: linear(get(&n("output.dense.weight"), &[c, f])?)?,
                b_out: up(get(&n("output.dense.bias"), &[c])?)?,
                ln2_w: up(ln2_w)?,
                ln2_b: up(ln2_b)?,
            });
        }
        let act = match config.hidden_act.as_str() {
            "gelu" => UnaryOp::GeluErf,
            "relu" => UnaryOp::Relu,
            _ => UnaryOp::GeluTanh,
        };
        let eps = config.layer_norm_eps as f32;
        let checkpoint_dtype = file
            .meta(&format!("{prefix}embeddings.word_embeddings.weight"))
            .map(|m| format!("{:?}", m.dtype))
            .unwrap_or_default();
        let model = BertModel {
            word_emb: up(word_emb)?,
            pos_type0: up(pos_type0)?,
            type_emb: up(type_emb)?,
            pos_emb: up(pos_emb)?,
            emb_ln_w: up(emb_ln_w)?,
            emb_ln_b: up(emb_ln_b)?,
            layers,
            act,
            eps,
            device: device.clone(),
            config,
            attention_path: AttentionPath::Auto,
            checkpoint_dtype,
            weight_dtype,
        };
        device.sync()?;
        Ok(model)
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn hidden_size(&self) -> usize {
        self.config.hidden_size
    }

    /// Checks the batch: sizes agree, lengths fit T and the position table, ids fit the vocab.
    fn check(&self, batch: &Batch) -> Result<()> {
        const OP: &str = "bert forward";
        let (b, t) = (batch.b(), batch.t);
        if b == 0 || t == 0 {
            return Err(Error::shape(OP, format!("empty batch ({b} sequences of {t} tokens)")));
        }
        if batch.ids.len() != b * t {
            return Err(Error::shape(OP, format!("{} ids for {b} sequences of {t} tokens", batch.ids.len())));
        }
        if t > self.config.max_position_embeddings {
            return Err(Error::shape(
                OP,
                format!("{t} tokens exceed the model's {} positions", self.config.max_position_embeddings),
            ));
        }
        if let Some(&bad) = batch.lengths.iter().find(|&&l| l == 0 || l > t) {
            return Err(Error::shape(OP, format!("sequence length {bad} is not in 1..={t}")));
        }
        if let Some(&bad) = batch.ids.iter().find(|&&id| id as usize >= self.config.vocab_size) {
            return Err(Error::Index { op: "token id", index: bad as i64, len: self.config.vocab_size });
        }
        if let Some(ty) = batch.type_ids {
            if ty.len() != b * t {
                return Err(Error::shape(OP, format!("{} segment ids for {} tokens", ty.len(), b * t)));
            }
            if let Some(&bad) = ty.iter().find(|&&id| id as usize >= self.config.type_vocab_size) {
                return Err(Error::Index { op: "segment id", index: bad as i64, len: self.config.type_vocab_size });
            }
        }
        Ok(())
    }

    /// The last hidden state [B, T, C] of a padded batch (rows past a sequence's length hold
    /// values that pooling ignores).
    pub fn forward(&self, batch: &Batch) -> Result<Tensor> {
        self.check(batch)?;
        let cfg = &self.config;
        let (b, t, c) = (batch.b(), batch.t, cfg.hidden_size);
        let (h, d) = (cfg.num_attention_heads, cfg.head_dim());
        let dev = &self.device;

        // ---- embeddings ----
        // Ids stay on the host: the gather validates them there and uploads them once (a GPU
        // copy would be read back for that check: a round trip per batch).
        let ids = Tensor::from_slice(batch.ids, [b * t], &Device::Cpu)?;
        let words = self.word_emb.gather(&ids)?.reshape([b, t, c])?;
        let x = match batch.type_ids {
            None => words.add(&self.pos_type0.narrow(0, 0, t)?)?,
            Some(ty) => {
                let ty = Tensor::from_slice(ty, [b * t], &Device::Cpu)?;
                let seg = self.type_emb.gather(&ty)?.reshape([b, t, c])?;
                words.add(&self.pos_emb.narrow(0, 0, t)?)?.add(&seg)?
            }
        };
        let mut x = x.reshape([b * t, c])?.layer_norm(Some(&self.emb_ln_w), Some(&self.emb_ln_b), self.eps)?;

        // ---- attention mask: [B, 1, 1, T], 0 or MASKED on padded keys, broadcast ----
        let padded = batch.lengths.iter().any(|&l| l != t);
        let on_cpu = matches!(dev, Device::Cpu);
        let fused = !padded && !on_cpu && self.attention_path == AttentionPath::Auto;
        let mask = if padded {
            let mut m = vec![0f32; b * t];
            for (row, &len) in m.chunks_mut(t).zip(batch.lengths) {
                row[len..].fill(MASKED);
            }
            Some(Tensor::from_vec(m, [b, 1, 1, t], dev)?)
        } else {
            None
        };
        // The scale 1/sqrt(D) is folded into the query weights.
        let opts = AttentionOpts { scale: 1.0, causal: false, max_keys: None, f16_out: false };

        for l in &self.layers {
            let qkv = x.matmul_bias(&l.w_qkv, &l.b_qkv)?; // [B·T, 3C]
            let ctx = if fused {
                // Q, K, V read in place: [B, 3H, T, D] views of the product.
                let qkv = qkv.reshape([b, t, 3 * h, d])?.permute(&[0, 2, 1, 3])?;
                let (q, k, v) = (qkv.narrow(1, 0, h)?, qkv.narrow(1, h, h)?, qkv.narrow(1, 2 * h, h)?);
                q.attention(&k, &v, &opts)? // [B, H, T, D], stored [B, T, H, D]
            } else if on_cpu {
                self.attention_per_sentence(&qkv, mask.as_ref(), b, t)?
            } else {
                // One copy puts Q, K, V each in [B, H, T, D] order.
                let qkv = qkv.reshape([b, t, 3, h, d])?.permute(&[2, 0, 3, 1, 4])?.contiguous()?;
                let part = |i: usize| qkv.narrow(0, i, 1)?.reshape([b * h, t, d]);
                let (q, k, v) = (part(0)?, part(1)?, part(2)?);
                let mut scores = q.matmul(&k.transpose(1, 2)?)?;
                if let Some(mask) = &mask {
                    scores = scores.reshape([b, h, t, t])?.add(mask)?.reshape([b * h, t, t])?;
                }
                let probs = scores.softmax(Default::default())?;
                probs.matmul(&v)?.reshape([b, h, t, d])?
            };
            // A view for the fused op's output; a copy on the other paths.
            let ctx = ctx.permute(&[0, 2, 1, 3])?.reshape([b * t, c])?;
            let attn = ctx.matmul_bias(&l.w_o, &l.b_o)?;
            x = attn.add_layer_norm(&x, Some(&l.ln1_w), Some(&l.ln1_b), self.eps)?;
            // The activation in the product's epilogue where the GPU path allows (one pass less).
            let inner = x.matmul_bias_act(&l.w_in, &l.b_in, self.act)?;
            let out = inner.matmul_bias(&l.w_out, &l.b_out)?;
            x = out.add_layer_norm(&x, Some(&l.ln2_w), Some(&l.ln2_b), self.eps)?;
        }
        x.reshape([b, t, c])
    }

    /// Explicit attention one sentence at a time, reading Q, K and V in place from the QKV
    /// product (the CPU path): per sentence, Q is an [H, T, D] view with strides [D, 3C, 1],
    /// one batch stride, which the CPU matmul takes as it is, so no [B, H, T, D] copy of Q, K
    /// and V is made (that copy was 4% of a forward pass). Returns [B, H, T, D].
    fn attention_per_sentence(&self, qkv: &Tensor, mask: Option<&Tensor>, b: usize, t: usize) -> Result<Tensor> {
        let (h, d) = (self.config.num_attention_heads, self.config.head_dim());
        // [3, B, H, T, D], a view; narrowing keeps unit dims, so a sentence's Q is [1, 1, H, T, D].
        let qkv = qkv.reshape([b, t, 3, h, d])?.permute(&[2, 0, 3, 1, 4])?;
        let mut outs = Vec::with_capacity(b);
        for i in 0..b {
            let s = qkv.narrow(1, i, 1)?; // [3, 1, H, T, D]
            let (q, k, v) = (s.narrow(0, 0, 1)?, s.narrow(0, 1, 1)?, s.narrow(0, 2, 1)?);
            let mut scores = q.matmul(&k.transpose(3, 4)?)?; // [1, 1, H, T, T]
            if let Some(mask) = mask {
                scores = scores.add(&mask.narrow(0, i, 1)?.reshape([1, 1, 1, 1, t])?)?;
            }
            outs.push(scores.softmax(Default::default())?.matmul(&v)?); // [1, 1, H, T, D]
        }
        let refs: Vec<&Tensor> = outs.iter().collect();
        Tensor::concat(&refs, 1)?.reshape([b, h, t, d])
    }

    /// Bytes of weights on the device.
    pub fn weight_bytes(&self) -> usize {
        let n = |t: &Tensor| t.numel() * t.dtype().size_in_bytes();
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                n(&l.w_qkv)
                    + n(&l.b_qkv)
                    + n(&l.w_o)
                    + n(&l.b_o)
                    + n(&l.w_in)
                    + n(&l.b_in)
                    + n(&l.w_out)
                    + n(&l.b_out)
                    + 4 * n(&l.ln1_w)
            })
            .sum();
        layers + n(&self.word_emb) + 2 * n(&self.pos_emb) + n(&self.type_emb) + 2 * n(&self.emb_ln_w)
    }
}
