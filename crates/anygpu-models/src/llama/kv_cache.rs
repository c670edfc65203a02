//! The KV cache: per layer, keys and values [Hkv, n_ctx, D] on the model's device, written in
//! place as positions are added, read through views (no copy per step).

use anygpu_core::ops::rope::RopeOpts;
use anygpu_core::quant::fused::RopeKvStore;
use anygpu_core::quant::{QTensor, RmsNorm};
use anygpu_core::{DType, Device, Error, Result, Tensor};

use super::config::LlamaConfig;
use super::decode_graph::{DecodeGraph, DecodeStats};

pub struct KvCache {
    keys: Vec<Tensor>,
    values: Vec<Tensor>,
    len: usize,
    capacity: usize,
    /// The recorded decode step bound to these buffers (GPU only, built on first use).
    pub(crate) graph: Option<DecodeGraph>,
    /// Recording was tried and failed: do not try again for this cache.
    pub(crate) graph_failed: bool,
    /// While a decode step is recorded: the positions the recording covers (the attention
    /// plans for that many keys, `AttentionOpts::max_keys`; see `decode_graph`). None outside
    /// a recording: the model then plans a step as the recording of its position would be.
    pub(crate) attention_horizon: Option<usize>,
}

impl KvCache {
    pub fn new(cfg: &LlamaConfig, n_ctx: usize, device: &Device) -> Result<KvCache> {
        if n_ctx == 0 {
            return Err(Error::shape("kv cache", "context size must be at least 1"));
        }
        let shape = [cfg.n_head_kv, n_ctx, cfg.head_dim];
        let mk = || Tensor::zeros(shape, DType::F32, device);
        let keys = (0..cfg.n_layer).map(|_| mk()).collect::<Result<Vec<_>>>()?;
        let values = (0..cfg.n_layer).map(|_| mk()).collect::<Result<Vec<_>>>()?;
        Ok(KvCache { keys, values, len: 0, capacity: n_ctx, graph: None, graph_failed: false, attention_horizon: None })
    }

    /// Positions filled.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// Forgets every position (a new conversation).
    pub fn clear(&mut self) {
        self.len = 0;
    }
    /// Drops positions after `len` (e.g. to re-run a prompt suffix).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
    /// Bytes a cache of `n_ctx` positions occupies (f32 keys and values of every layer).
    pub fn bytes_for(cfg: &LlamaConfig, n_ctx: usize) -> usize {
        2 * cfg.n_layer * cfg.n_head_kv * n_ctx * cfg.head_dim * 4
    }

    /// Bytes the cache occupies.
    pub fn byte_len(&self) -> usize {
        self.keys.iter().chain(&self.values).map(|t| t.numel() * 4).sum()
    }

    /// Writes k, v [T, Hkv, D] of layer `layer` at positions `len..len+T` and returns views of
    /// every filled position, [1, Hkv, len+T, D] each. `advance` commits the new length once
    /// every layer has been written.
    pub fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let t = k.dim("kv cache", 0)?;
        let (kc, vc) = (&mut self.keys[layer], &mut self.values[layer]);
        kc.write_at(1, self.len, &k.permute(&[1, 0, 2])?)?;
        vc.write_at(1, self.len, &v.permute(&[1, 0, 2])?)?;
        let n = self.len + t;
        Ok((kc.narrow(1, 0, n)?.unsqueeze(0)?, vc.narrow(1, 0, n)?.unsqueeze(0)?))
    }

    /// The attention input of layer `layer` for T tokens x [T, C]: the stacked Q|K|V product
    /// `w` of `rms_norm(x, norm)` (+ `bias`), Q and K rotated for positions `len..len+T`, K and
    /// V written into the layer's caches. Returns Q [T, H, D] with views of every filled
    /// position, [1, Hkv, len+T, D] each. On a GPU, decode is one dispatch (the product's rope
    /// epilogue, `QTensor::qmatmul_rms_rope_kv`).
    pub fn append_qkv(
        &mut self,
        layer: usize,
        w: &QTensor,
        x: &Tensor,
        norm: RmsNorm<'_>,
        bias: Option<&Tensor>,
        rope: &RopeOpts,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let t = x.dim("kv cache", 0)?;
        let (kc, vc) = (&mut self.keys[layer], &mut self.values[layer]);
        let (hkv, d) = (kc.dims()[0], kc.dims()[2]);
        // H from W's rows, (H + 2 Hkv) D (the product checks they divide).
        let h = (w.rows() / d.max(1)).saturating_sub(2 * hkv);
        let kv = RopeKvStore { rope, heads: (h, hkv, d), start_pos: self.len, k_cache: kc, v_cache: vc };
        let q = w.qmatmul_rms_rope_kv(x, norm, bias, kv)?;
        let n = self.len + t;
        Ok((q, kc.narrow(1, 0, n)?.unsqueeze(0)?, vc.narrow(1, 0, n)?.unsqueeze(0)?))
    }

    pub fn advance(&mut self, t: usize) {
        self.len += t;
    }

    /// Timings of the recorded decode steps run on this cache (None when decode steps run op
    /// by op: the CPU, or recording off or failed).
    pub fn decode_stats(&self) -> Option<DecodeStats> {
        self.graph.as_ref().map(DecodeGraph::stats)
    }

    /// GPU time per op of one recorded decode step (None on the CPU, without a recording, or
    /// without timestamp queries): (op, dispatches, seconds), largest first.
    pub fn profile_decode(&mut self) -> Result<Option<Vec<(String, usize, f64)>>> {
        let Some(mut g) = self.graph.take() else { return Ok(None) };
        let out = g.profile(self);
        self.graph = Some(g);
        out
    }

    /// Sets the filled length (recording the decode step at chosen positions).
    pub(crate) fn set_len(&mut self, len: usize) {
        self.len = len.min(self.capacity);
    }
}
