//! The KV cache: per layer, keys and values [Hkv, n_ctx, D] on the model's device, written in
//! place as positions are added, read through views (no copy per step).

use anygpu_core::{DType, Device, Error, Result, Tensor};

use super::config::LlamaConfig;

pub struct KvCache {
    keys: Vec<Tensor>,
    values: Vec<Tensor>,
    len: usize,
    capacity: usize,
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
        Ok(KvCache { keys, values, len: 0, capacity: n_ctx })
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

    pub fn advance(&mut self, t: usize) {
        self.len += t;
    }
}
