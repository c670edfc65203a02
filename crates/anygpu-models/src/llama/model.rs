//! The llama-family transformer (Llama 2/3, SmolLM, Mistral, TinyLlama, Qwen2): token
//! embedding, `n_layer` blocks of RMSNorm -> GQA attention with RoPE -> RMSNorm -> SwiGLU,
//! final norm, output projection (tied to the embedding when the file has no output.weight).
//! Weight names follow the GGUF keys. Weights stay in their GGUF block format (QTensor).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use anygpu_core::ops::attention::AttentionOpts;
use anygpu_core::ops::attention_decode::short_decode_keys;
use anygpu_core::ops::rope::RopeOpts;
use anygpu_core::quant::coop;
use anygpu_core::quant::gpu::QOptions;
use anygpu_core::quant::{CopyAhead, CpuMath, QTensor, RmsNorm, SharedBytes};
use anygpu_core::{DType, Device, Error, Result, Tensor};

use super::config::LlamaConfig;
use super::decode_graph::{self, DecodeGraph};
use super::kv_cache::KvCache;
use crate::gguf::GgufFile;

/// The memory-mapped file, shared by every CPU weight without copying.
struct MappedFile(Arc<GgufFile>);

impl AsRef<[u8]> for MappedFile {
    fn as_ref(&self) -> &[u8] {
        self.0.bytes()
    }
}

/// The Q, K, V projections: on a GPU, stacked into one matrix when their types match (one
/// product per token instead of three); separate otherwise (and on the CPU, where the weights
/// stay memory-mapped). One per layer: the variants' size difference does not matter.
#[allow(clippy::large_enum_variant)]
enum Qkv {
    Stacked { w: QTensor, bias: Option<Tensor> },
    Separate { w: [QTensor; 3], bias: [Option<Tensor>; 3] },
}

/// The SwiGLU projections: gate|up stacked on a GPU when their types match (the matvec kernel
/// then applies silu(gate) * up in its epilogue), separate otherwise.
enum GateUp {
    Stacked(QTensor),
    Separate { gate: QTensor, up: QTensor },
}

struct Block {
    attn_norm: Tensor,
    qkv: Qkv,
    wo: QTensor,
    ffn_norm: Tensor,
    gate_up: GateUp,
    w_down: QTensor,
}

impl Qkv {
    fn load(ld: &mut Loader, n: &dyn Fn(&str) -> String) -> Result<Qkv> {
        let names = [n("attn_q.weight"), n("attn_k.weight"), n("attn_v.weight")];
        let bias = [
            ld.optional_vector(&n("attn_q.bias"))?,
            ld.optional_vector(&n("attn_k.bias"))?,
            ld.optional_vector(&n("attn_v.bias"))?,
        ];
        let Some(w) = ld.stacked(&names, false)? else {
            let w = [ld.matrix(&names[0])?, ld.matrix(&names[1])?, ld.matrix(&names[2])?];
            return Ok(Qkv::Separate { w, bias });
        };
        let bias = if bias.iter().any(Option::is_some) {
            // The rows of each part: its bias, or zeros where the file has none.
            let rows = names.iter().map(|name| ld.info(name).map(|t| t.dims.get(1).map_or(1, |&r| r as usize)));
            let parts = bias
                .iter()
                .zip(rows)
                .map(|(b, r)| match b {
                    Some(b) => Ok(b.clone()),
                    None => Tensor::zeros([r?], DType::F32, ld.device),
                })
                .collect::<Result<Vec<_>>>()?;
            Some(Tensor::concat(&parts.iter().collect::<Vec<_>>(), 0)?)
        } else {
            None
        };
        Ok(Qkv::Stacked { w, bias })
    }

    /// Whether its product reads x rounded for the attention norm by x's producer (see
    /// `QTensor::reads_rounded_norm`).
    fn reads_rounded_norm(&self) -> Result<bool> {
        match self {
            Qkv::Stacked { w, .. } => w.reads_rounded_norm(true),
            Qkv::Separate { .. } => Ok(false),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Qkv::Stacked { w, .. } => w.byte_len(),
            Qkv::Separate { w, .. } => w.iter().map(QTensor::byte_len).sum(),
        }
    }
}

impl GateUp {
    fn load(ld: &mut Loader, n: &dyn Fn(&str) -> String) -> Result<GateUp> {
        let names = [n("ffn_gate.weight"), n("ffn_up.weight")];
        match ld.stacked(&names, true)? {
            Some(w) => Ok(GateUp::Stacked(w)),
            None => Ok(GateUp::Separate { gate: ld.matrix(&names[0])?, up: ld.matrix(&names[1])? }),
        }
    }

    /// As [`Qkv::reads_rounded_norm`], for the FFN norm.
    fn reads_rounded_norm(&self) -> Result<bool> {
        match self {
            GateUp::Stacked(w) => w.reads_rounded_norm(true),
            GateUp::Separate { .. } => Ok(false),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            GateUp::Stacked(w) => w.byte_len(),
            GateUp::Separate { gate, up } => gate.byte_len() + up.byte_len(),
        }
    }
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
    /// Unique per loaded model: a recorded decode step names the model it binds.
    id: u64,
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
        let device = self.device;
        self.matrix_on(name, device)
    }

    /// The matrices `names` stacked row-wise into one on the device (one product per token
    /// instead of several), where that applies: a GPU, one type and width (and, with
    /// `same_rows`, one row count, as gate|up needs), `ANYGPU_STACK_WEIGHTS` not 0. The parts
    /// are read from the memory-mapped file and uploaded once, joined. None: load them apart.
    fn stacked(&mut self, names: &[String], same_rows: bool) -> Result<Option<QTensor>> {
        let off = std::env::var("ANYGPU_STACK_WEIGHTS").is_ok_and(|v| v == "0");
        if self.device.gpu().is_none() || off {
            return Ok(None);
        }
        let infos = names.iter().map(|n| self.info(n)).collect::<Result<Vec<_>>>()?;
        let key = |t: &crate::gguf::TensorInfo| {
            (t.ggml_type, t.dims[0], if same_rows { t.dims.get(1).copied() } else { None })
        };
        if infos.iter().any(|t| key(t) != key(&infos[0])) {
            return Ok(None);
        }
        let parts = names.iter().map(|n| self.matrix_on(n, &Device::Cpu)).collect::<Result<Vec<_>>>()?;
        let parts: Vec<&QTensor> = parts.iter().collect();
        Ok(Some(QTensor::stack_rows(&parts, self.device)?.with_cpu_math(CpuMath::Q8)))
    }

    /// [`Loader::matrix`] on `device` (the CPU: the file's bytes, not copied).
    fn matrix_on(&mut self, name: &str, device: &Device) -> Result<QTensor> {
        let t = self.info(name)?;
        let (cols, rows) = (t.dims[0] as usize, t.dims.get(1).copied().unwrap_or(1) as usize);
        let q =
            QTensor::new(t.ggml_type, rows, cols, self.shared.clone(), t.offset as usize, t.n_bytes as usize, device)
                .map_err(|e| Error::Format(format!("tensor {name}: {e}")))?
                // On the CPU, products round activations to 8-bit blocks and use integer dot products,
                // as llama.cpp's CPU backend does (1.6-2x faster decode on the 2-core machine); GPU
                // tensors ignore it.
                .with_cpu_math(CpuMath::Q8);
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

/// Whether decode steps hand the attention's unmerged splits to the output projection
/// (`QTensor::qmatmul_add_combined`); `ANYGPU_FUSED_COMBINE=0` turns it off (for comparisons:
/// the results are the same up to rounding). Read once.
fn fused_combine() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("ANYGPU_FUSED_COMBINE").map(|v| v != "0").unwrap_or(true))
}

/// Whether a product `w` takes its x as f16 from the op that writes it: on a GPU's prefill, the
/// SwiGLU and the attention write f16 where the next product (down, wo) is one the coop kernel
/// takes, the values it would round its x to (`QOptions::f16_out`, `AttentionOpts::f16_out`: no
/// f32 output written and read back, no rounding dispatch between the two).
/// `ANYGPU_PREFILL_F16=0` keeps those outputs f32 (for comparisons: the results are the same).
/// Read once.
fn f16_handoff(w: &QTensor) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var("ANYGPU_PREFILL_F16").map(|v| v != "0").unwrap_or(true));
    on && coop::takes_type(w.ggml_type())
}

impl Llama {
    /// Builds the model from a validated GGUF file, uploading weights to `device` unchanged.
    /// `progress(tensors_done, bytes_done)` is called after each tensor.
    pub fn load(file: &Arc<GgufFile>, device: &Device, progress: &mut dyn FnMut(usize, u64)) -> Result<Llama> {
        let config = LlamaConfig::from_gguf(file)?;
        let _loading = device.gpu().map(|g| g.loading_weights());
        let shared: SharedBytes = Arc::new(MappedFile(file.clone()));
        let mut ld = Loader { file, shared, device, progress, done: 0, bytes: 0 };
        let token_embd = ld.matrix("token_embd.weight")?;
        let mut blocks = Vec::with_capacity(config.n_layer);
        for i in 0..config.n_layer {
            let n = |s: &str| format!("blk.{i}.{s}");
            blocks.push(Block {
                attn_norm: ld.vector(&n("attn_norm.weight"))?,
                qkv: Qkv::load(&mut ld, &n)?,
                wo: ld.matrix(&n("attn_output.weight"))?,
                ffn_norm: ld.vector(&n("ffn_norm.weight"))?,
                gate_up: GateUp::load(&mut ld, &n)?,
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
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        Ok(Llama { config, device: device.clone(), token_embd, blocks, output_norm, output, rope, id })
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// One decode step: runs `token` at position `cache.len()` and returns the logits [V].
    /// On a GPU the step is a replay of the recorded forward pass (built on the first call for
    /// this cache, see [`super::decode_graph`]); if recording fails the per-op path runs.
    pub fn decode(&self, token: u32, cache: &mut KvCache) -> Result<Vec<f32>> {
        if self.prepare_decode(cache) {
            if let Some(mut g) = cache.graph.take() {
                let out = g.step(self, token, cache);
                cache.graph = Some(g);
                return out;
            }
        }
        self.forward(&[token], cache, false)?.to_vec_f32()
    }

    /// Records the decode step for `cache` now if it will be replayed (a GPU model, not
    /// disabled, not failed before); returns whether decode steps on this cache replay.
    /// Recording failures are reported once on stderr and fall back to the per-op path.
    pub fn prepare_decode(&self, cache: &mut KvCache) -> bool {
        if self.device.gpu().is_none() || !decode_graph::enabled() {
            return false;
        }
        if cache.graph.as_ref().is_some_and(|g| !g.belongs_to(self)) {
            cache.graph = None;
        }
        if cache.graph.is_none() && !cache.graph_failed {
            match DecodeGraph::build(self, cache) {
                Ok(g) => cache.graph = Some(g),
                Err(e) => {
                    cache.graph_failed = true;
                    eprintln!("anygpu: decode step not recorded ({e}); running it op by op");
                }
            }
        }
        cache.graph.is_some()
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
        if self.device.is_cpu() && rayon::current_thread_index().is_none() {
            // On the CPU every op forks onto the rayon pool; run from a pool thread, the small
            // ops of a decode step do not park and wake the caller each time (~28% of a decode
            // step's time in the kernel's sleep/wake on the 2-core machine).
            return rayon::scope(|_| self.forward(tokens, cache, all_logits));
        }
        let cfg = &self.config;
        if tokens.is_empty() {
            return Err(Error::shape("llama forward", "no tokens"));
        }
        if let Some(&bad) = tokens.iter().find(|&&id| id as usize >= cfg.n_vocab) {
            return Err(Error::Index { op: "token id", index: bad as i64, len: cfg.n_vocab });
        }
        let x = self.token_embd.gather_rows(tokens)?; // [T, C]
        self.forward_embedded(x, cache, all_logits)
    }

    /// Fails when `t` more positions do not fit in the cache.
    pub(crate) fn check_room(&self, cache: &KvCache, t: usize) -> Result<()> {
        let pos = cache.len();
        if pos + t > cache.capacity() {
            return Err(Error::shape(
                "llama forward",
                format!(
                    "context length exceeded: {} positions requested, the context holds {} (raise --ctx-size, at most the model's {})",
                    pos + t,
                    cache.capacity(),
                    self.config.n_ctx_train
                ),
            ));
        }
        Ok(())
    }

    /// The positions of a decode step's first recording (see `decode_graph`): the most keys
    /// the attention walks unsplit on this device (`short_decode_keys`: 256 where the decode
    /// attention kernel runs, else 160); 0 on the CPU.
    pub fn first_stage_keys(&self) -> usize {
        let cfg = &self.config;
        match self.device.gpu() {
            Some(ctx) => short_decode_keys(ctx, cfg.head_dim, cfg.n_head / cfg.n_head_kv.max(1)),
            None => 0,
        }
    }

    /// The token embedding matrix (also the output projection when tied).
    pub(crate) fn token_embd(&self) -> &QTensor {
        &self.token_embd
    }

    /// [`Llama::forward`] from embedded tokens x [T, C].
    pub(crate) fn forward_embedded(&self, x: Tensor, cache: &mut KvCache, all_logits: bool) -> Result<Tensor> {
        let cfg = &self.config;
        let t = x.dim("llama forward", 0)?;
        self.check_room(cache, t)?;
        let pos = cache.len();
        let (h, hkv, d) = (cfg.n_head, cfg.n_head_kv, cfg.head_dim);
        // A recording plans the attention for its horizon; a step outside one is planned as
        // the recording that would run its position is (the first positions' stage of a
        // longer cache, see `first_stage_keys`), so the per-op path computes what the replay
        // does.
        let short = self.first_stage_keys();
        let first_stage = t == 1 && pos < short && cache.capacity() > short;
        let max_keys = cache.attention_horizon.or(first_stage.then_some(short));
        let attn = AttentionOpts { scale: 1.0 / (d as f32).sqrt(), causal: true, max_keys, f16_out: false };
        let head = self.output.as_ref().unwrap_or(&self.token_embd);
        let mut x = x;
        // x rounded for the next RMSNorm by the product that wrote it, where the product after
        // the norm reads that (on a GPU, rows too wide to stage the norm: see
        // QTensor::qmatmul_add_rounding): no rounding dispatch of its own.
        let mut x_rounded = None;
        // A GPU's long prefill products read f16 copies of quantized weights, each made beside
        // an earlier, longer product: the model lists its products in order for that.
        let _copies = CopyAhead::begin(t, || self.products_in_order(all_logits));
        for (li, b) in self.blocks.iter().enumerate() {
            // The RMSNorms run inside the products that read them (fused on a GPU for a few
            // tokens at a time, see anygpu_core::quant::fused).
            let attn_norm = RmsNorm { weight: &b.attn_norm, eps: cfg.rms_eps, rounded: x_rounded.as_ref() };
            let (q, keys, values) = match &b.qkv {
                // The product, rope and the cache store in one op (one dispatch when decoding on
                // a GPU).
                Qkv::Stacked { w, bias } => cache.append_qkv(li, w, &x, attn_norm, bias.as_ref(), &self.rope)?,
                Qkv::Separate { w, bias } => {
                    let hn = x.rms_norm(Some(&b.attn_norm), cfg.rms_eps)?;
                    let proj = |i: usize, heads: usize| -> Result<Tensor> {
                        let y = w[i].qmatmul(&hn)?;
                        let y = match &bias[i] {
                            Some(bv) => y.add(bv)?,
                            None => y,
                        };
                        y.reshape([t, heads, d])
                    };
                    let (q, k, v) =
                        (proj(0, h)?.rope(pos, &self.rope)?, proj(1, hkv)?.rope(pos, &self.rope)?, proj(2, hkv)?);
                    let (keys, values) = cache.append(li, &k, &v)?; // [1, Hkv, pos+T, D] views
                    (q, keys, values)
                }
            };
            let q = q.permute(&[1, 0, 2])?.unsqueeze(0)?; // [1, H, T, D]

            // Decoding on a GPU, an attention that splits the keys stops after its first pass
            // where the output projection merges the splits itself (one dispatch fewer per
            // layer); elsewhere it runs whole (a short cache unsplit: see ops::attention).
            let partials =
                match t == 1 && fused_combine() && b.wo.merges_attention_partials(&q, &keys, &values, &attn)? {
                    true => q.attention_partials(&keys, &values, &attn)?,
                    false => None,
                };
            // Elsewhere, where the output projection multiplies 8-bit x, the attention rounds
            // its output for it as it writes it (no rounding dispatch between the two).
            let rounded = match partials.is_none() && b.wo.takes_q8_rows() {
                true => q.attention_q8(&keys, &values, &attn)?,
                false => None,
            };
            let ffn_rounding = b.gate_up.reads_rounded_norm()?.then_some(&b.ffn_norm);
            (x, x_rounded) = match (partials, rounded, ffn_rounding) {
                (Some(p), _, _) => (b.wo.qmatmul_add_combined(&p, &x)?, None),
                (None, Some(r), Some(next)) => b.wo.qmatmul_add_q8_rounding(&r, &x, next)?,
                (None, Some(r), None) => (b.wo.qmatmul_add_q8(&r, &x)?, None),
                (None, None, _) => {
                    // [1, H, T, D], stored [1, T, H, D]: the permute and reshape are views.
                    let attn = AttentionOpts { f16_out: f16_handoff(&b.wo), ..attn };
                    let a = q.attention(&keys, &values, &attn)?;
                    let a = a.permute(&[0, 2, 1, 3])?.reshape([t, h * d])?;
                    match ffn_rounding {
                        Some(next) => b.wo.qmatmul_add_rounding(&a, &x, next)?,
                        None => (b.wo.qmatmul_add(&a, &x)?, None),
                    }
                }
            };
            let ffn_norm = RmsNorm { weight: &b.ffn_norm, eps: cfg.rms_eps, rounded: x_rounded.as_ref() };
            let g = match &b.gate_up {
                GateUp::Stacked(w) => w.qmatmul_glu_opts(
                    &x,
                    Some(ffn_norm),
                    QOptions { f16_out: f16_handoff(&b.w_down), ..QOptions::default() },
                )?,
                GateUp::Separate { gate, up } => {
                    let hn = x.rms_norm(Some(&b.ffn_norm), cfg.rms_eps)?;
                    gate.qmatmul(&hn)?.silu()?.mul(&up.qmatmul(&hn)?)?
                }
            };
            // The next norm: the next block's attention norm, or the output norm (whose rows
            // are those of the last x row only: rounded when that is all of x).
            let next_rounding = match self.blocks.get(li + 1) {
                Some(nb) => nb.qkv.reads_rounded_norm()?.then_some(&nb.attn_norm),
                None => (head.reads_rounded_norm(false)? && (t == 1 || all_logits)).then_some(&self.output_norm),
            };
            (x, x_rounded) = match next_rounding {
                Some(next) => b.w_down.qmatmul_add_rounding(&g, &x, next)?,
                None => (b.w_down.qmatmul_add(&g, &x)?, None),
            };
        }
        cache.advance(t);
        let x = if all_logits { x } else { x.narrow(0, t - 1, 1)? };
        let output_norm = RmsNorm { weight: &self.output_norm, eps: cfg.rms_eps, rounded: x_rounded.as_ref() };
        head.qmatmul_rms(&x, output_norm)
    }

    /// The weights of a forward pass's products, in the order it multiplies by them.
    fn products_in_order(&self, all_logits: bool) -> Vec<QTensor> {
        let mut order = Vec::with_capacity(self.blocks.len() * 6 + 1);
        for b in &self.blocks {
            match &b.qkv {
                Qkv::Stacked { w, .. } => order.push(w.clone()),
                Qkv::Separate { w, .. } => order.extend(w.iter().cloned()),
            }
            order.push(b.wo.clone());
            match &b.gate_up {
                GateUp::Stacked(w) => order.push(w.clone()),
                GateUp::Separate { gate, up } => order.extend([gate.clone(), up.clone()]),
            }
            order.push(b.w_down.clone());
        }
        if all_logits {
            order.push(self.output.as_ref().unwrap_or(&self.token_embd).clone());
        }
        order
    }

    /// Bytes of weights on the device.
    pub fn weight_bytes(&self) -> usize {
        let q = |w: &QTensor| w.byte_len();
        let blocks: usize =
            self.blocks.iter().map(|b| b.qkv.bytes() + q(&b.wo) + b.gate_up.bytes() + q(&b.w_down)).sum();
        blocks + q(&self.token_embd) + self.output.as_ref().map_or(0, q)
    }

    pub fn dtype(&self) -> DType {
        DType::F32
    }
}
