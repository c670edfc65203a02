//! Text generation and scoring on a llama model: chunked prefill, one token per decode step,
//! sampling, stop at end-of-generation, timings; and perplexity over a token sequence.

use std::time::Instant;

use anygpu_core::{Error, Result};
use rayon::prelude::*;

use crate::llama::{KvCache, Llama};
use crate::sampling::Sampler;
use crate::tokenizer::LlmTokenizer;

/// Prompt tokens per forward pass during prefill (bounds activation memory).
pub const PREFILL_CHUNK: usize = 512;

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Timings {
    pub prompt_tokens: usize,
    pub prefill_ms: f64,
    pub prefill_tokens_per_s: f64,
    pub generated_tokens: usize,
    pub decode_ms: f64,
    pub decode_tokens_per_s: f64,
    /// Recording the decode step for replay (GPU, once per KV cache), not in decode_ms.
    pub record_ms: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The model produced an end-of-generation token.
    EndOfGeneration,
    /// `max_tokens` were generated.
    Length,
    /// The context is full.
    ContextFull,
    /// The caller's callback asked to stop.
    Stopped,
}

pub struct Generation {
    pub generated_ids: Vec<u32>,
    pub stop: StopReason,
    pub timings: Timings,
}

/// Runs `tokens` through the model in chunks and returns the logits of the last position.
pub fn prefill(model: &Llama, cache: &mut KvCache, tokens: &[u32]) -> Result<Vec<f32>> {
    let mut last = Vec::new();
    for chunk in tokens.chunks(PREFILL_CHUNK) {
        last = model.forward(chunk, cache, false)?.to_vec_f32()?;
    }
    Ok(last)
}

/// Generates up to `max_tokens` after `prompt` (appended to whatever `cache` holds).
/// `on_token(id)` sees each new token and returns false to stop early.
pub fn generate(
    model: &Llama,
    tokenizer: &LlmTokenizer,
    cache: &mut KvCache,
    prompt: &[u32],
    max_tokens: usize,
    sampler: &mut Sampler,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<Generation> {
    if prompt.is_empty() {
        return Err(Error::shape("generate", "the prompt has no tokens"));
    }
    let mut history: Vec<u32> = prompt.to_vec();
    let t0 = Instant::now();
    let mut logits = prefill(model, cache, prompt)?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let t_rec = Instant::now();
    if max_tokens > 1 {
        // The prefill's pooled activations are not reused by the decode steps: free them.
        if let Some(g) = model.device().gpu() {
            g.release_pooled()?;
        }
        model.prepare_decode(cache);
    }
    let record_s = t_rec.elapsed().as_secs_f64();
    let mut generated = Vec::new();
    let mut stop = StopReason::Length;
    let t1 = Instant::now();
    // Takes token `id`; whether generation goes on (then `id` is fed to the next step).
    let capacity = cache.capacity();
    let mut accept =
        |id: u32, generated: &mut Vec<u32>, history: &mut Vec<u32>, stop: &mut StopReason, cache_len: usize| {
            generated.push(id);
            history.push(id);
            if tokenizer.is_eog(id) {
                *stop = StopReason::EndOfGeneration;
                return false;
            }
            if !on_token(id) {
                *stop = StopReason::Stopped;
                return false;
            }
            if generated.len() >= max_tokens {
                return false;
            }
            if cache_len >= capacity {
                *stop = StopReason::ContextFull;
                return false;
            }
            true
        };
    let greedy = sampler.is_greedy();
    while generated.len() < max_tokens {
        let id = sampler.sample(&logits, &history);
        if !accept(id, &mut generated, &mut history, &mut stop, cache.len()) {
            break;
        }
        if greedy {
            // The GPU picks the argmax itself and runs ahead of the host (one position per
            // token made; `accept` sees the cache length each next step would start from).
            let start = cache.len();
            let left = (max_tokens - generated.len()).min(cache.capacity() - start);
            let mut made = 0;
            model.decode_greedy(id, left, cache, &mut |next| {
                made += 1;
                accept(next, &mut generated, &mut history, &mut stop, start + made)
            })?;
            break;
        }
        logits = model.decode(id, cache)?;
    }
    let decode_s = t1.elapsed().as_secs_f64();
    // The first token comes from the prefill logits: decode speed counts the forward passes.
    let decode_steps = generated.len().saturating_sub(1);
    let timings = Timings {
        prompt_tokens: prompt.len(),
        prefill_ms: prefill_s * 1e3,
        prefill_tokens_per_s: prompt.len() as f64 / prefill_s.max(1e-9),
        generated_tokens: generated.len(),
        decode_ms: decode_s * 1e3,
        decode_tokens_per_s: if decode_steps > 0 { decode_steps as f64 / decode_s.max(1e-9) } else { 0.0 },
        record_ms: record_s * 1e3,
    };
    Ok(Generation { generated_ids: generated, stop, timings })
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct Perplexity {
    pub mean_nll: f64,
    pub perplexity: f64,
    pub n_scored: usize,
    pub n_chunks: usize,
}

/// Scores `tokens` as one sequence (chunked at `n_ctx` when longer): every token after the
/// first of its chunk is scored from the logits at the previous position.
pub fn perplexity(
    model: &Llama,
    tokens: &[u32],
    n_ctx: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Perplexity> {
    if tokens.len() < 2 {
        return Err(Error::shape("perplexity", "need at least 2 tokens to score"));
    }
    let n_ctx = n_ctx.max(2);
    let mut total = 0f64;
    let mut n = 0usize;
    let chunks: Vec<&[u32]> = tokens.chunks(n_ctx).filter(|c| c.len() >= 2).collect();
    let mut cache = model.new_cache(n_ctx)?;
    for (ci, chunk) in chunks.iter().enumerate() {
        cache.clear();
        let v = model.config.n_vocab;
        let mut logits = Vec::with_capacity(chunk.len() * v);
        for part in chunk.chunks(PREFILL_CHUNK) {
            logits.extend(model.forward(part, &mut cache, true)?.to_vec_f32()?);
        }
        let nll: f64 = (0..chunk.len() - 1)
            .into_par_iter()
            .map(|i| {
                let row = &logits[i * v..(i + 1) * v];
                let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
                let lse = max + row.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
                lse - row[chunk[i + 1] as usize] as f64
            })
            .sum();
        total += nll;
        n += chunk.len() - 1;
        progress(ci + 1, chunks.len());
    }
    let mean = total / n as f64;
    Ok(Perplexity { mean_nll: mean, perplexity: mean.exp(), n_scored: n, n_chunks: chunks.len() })
}
