//! Synthetic llama-shaped GGUF models for benchmarks: the shapes of real models (1B, 8B...)
//! with N(0, 0.02) random weights and all-ones norms, and the tokenizer of an existing GGUF
//! file. They let the GPU machine build a 4 GB model locally instead of receiving one.

use std::io::Write;

use anygpu_core::quant::{quantize_into, GgmlType};
use anygpu_core::{Error, Result};
use rayon::prelude::*;

use crate::gguf::{GgufFile, GgufWriter};

#[derive(Clone, Debug)]
pub struct SyntheticSpec {
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub n_ctx: usize,
    pub rope_base: f32,
    /// Type of the 2-D weights (norms are always F32).
    pub ty: GgmlType,
    pub seed: u64,
}

impl SyntheticSpec {
    /// Named shapes: `1b` (16 layers, 2048 wide, 8192 FFN, 32/8 heads) and `8b` (32 layers,
    /// 4096 wide, 14336 FFN, 32/8 heads), as in BASELINES.md.
    pub fn preset(name: &str, ty: GgmlType) -> Option<SyntheticSpec> {
        let (n_layer, n_embd, n_ff) = match name {
            "1b" => (16, 2048, 8192),
            "8b" => (32, 4096, 14336),
            "tiny" => (2, 256, 512),
            _ => return None,
        };
        Some(SyntheticSpec {
            n_layer,
            n_embd,
            n_ff,
            n_head: 32.min(n_embd / 64),
            n_head_kv: 8.min(n_embd / 64),
            n_ctx: 4096,
            rope_base: 500_000.0,
            ty,
            seed: 0,
        })
    }
}

/// N(0, 0.02) values for one tensor chunk, deterministic in (seed, tensor, chunk).
fn normals(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    (0..n)
        .map(|_| {
            let (u1, u2) = (next(), next());
            ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos() * 0.02) as f32
        })
        .collect()
}

/// Quantized random rows of a [rows, cols] matrix, generated in parallel.
fn random_matrix(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Result<Vec<u8>> {
    const ROWS_PER_CHUNK: usize = 64;
    let parts: Vec<Result<Vec<u8>>> = (0..rows.div_ceil(ROWS_PER_CHUNK))
        .into_par_iter()
        .map(|c| {
            let r = ROWS_PER_CHUNK.min(rows - c * ROWS_PER_CHUNK);
            let mut out = Vec::new();
            quantize_into(ty, &normals(r * cols, seed ^ (c as u64) << 20), &mut out)?;
            Ok(out)
        })
        .collect();
    let mut bytes = Vec::new();
    for p in parts {
        bytes.extend(p?);
    }
    Ok(bytes)
}

/// Writes the model to `out`, tensor by tensor (never all in memory).
pub fn write_synthetic(spec: &SyntheticSpec, vocab_from: &GgufFile, out: impl Write) -> Result<()> {
    let s = spec;
    if !s.n_embd.is_multiple_of(s.n_head) || !s.n_head.is_multiple_of(s.n_head_kv) {
        return Err(Error::shape("synthetic model", "heads must divide the width and the kv heads the heads"));
    }
    let n_vocab = vocab_from.get_string_array("tokenizer.ggml.tokens")?.len();
    let d = s.n_embd / s.n_head;
    let kv = s.n_head_kv * d;
    let mut w = GgufWriter::new();
    w.add_string("general.architecture", "llama");
    w.add_string("general.name", &format!("synthetic-{}L-{}-{}", s.n_layer, s.n_embd, s.ty));
    w.add_u32("llama.context_length", s.n_ctx as u32);
    w.add_u32("llama.embedding_length", s.n_embd as u32);
    w.add_u32("llama.block_count", s.n_layer as u32);
    w.add_u32("llama.feed_forward_length", s.n_ff as u32);
    w.add_u32("llama.attention.head_count", s.n_head as u32);
    w.add_u32("llama.attention.head_count_kv", s.n_head_kv as u32);
    w.add_u32("llama.rope.dimension_count", d as u32);
    w.add_f32("llama.rope.freq_base", s.rope_base);
    w.add_f32("llama.attention.layer_norm_rms_epsilon", 1e-5);
    for kv in vocab_from.metadata().iter().filter(|kv| kv.key.starts_with("tokenizer.")) {
        w.add(&kv.key, kv.value.clone());
    }
    let (c, v, ff) = (s.n_embd as u64, n_vocab as u64, s.n_ff as u64);
    // (name, rows, cols, type): GGUF dims are [cols, rows].
    let mut plan: Vec<(String, u64, u64, GgmlType)> = vec![("token_embd.weight".into(), v, c, s.ty)];
    for i in 0..s.n_layer {
        let b = |n: &str| format!("blk.{i}.{n}");
        plan.push((b("attn_norm.weight"), 1, c, GgmlType::F32));
        plan.push((b("attn_q.weight"), c, c, s.ty));
        plan.push((b("attn_k.weight"), kv as u64, c, s.ty));
        plan.push((b("attn_v.weight"), kv as u64, c, s.ty));
        plan.push((b("attn_output.weight"), c, c, s.ty));
        plan.push((b("ffn_norm.weight"), 1, c, GgmlType::F32));
        plan.push((b("ffn_gate.weight"), ff, c, s.ty));
        plan.push((b("ffn_up.weight"), ff, c, s.ty));
        plan.push((b("ffn_down.weight"), c, ff, s.ty));
    }
    plan.push(("output_norm.weight".into(), 1, c, GgmlType::F32));
    plan.push(("output.weight".into(), v, c, s.ty));
    for (name, rows, cols, ty) in &plan {
        let dims: Vec<u64> = if *rows == 1 { vec![*cols] } else { vec![*cols, *rows] };
        w.declare_tensor(name, &dims, *ty)?;
    }
    let mut stream = w.start(out)?;
    for (i, (name, rows, cols, ty)) in plan.iter().enumerate() {
        let bytes = if *rows == 1 {
            let mut b = Vec::new();
            quantize_into(*ty, &vec![1.0; *cols as usize], &mut b)?;
            b
        } else {
            random_matrix(*ty, *rows as usize, *cols as usize, s.seed ^ (i as u64) << 40)?
        };
        stream.write_tensor(name, &bytes)?;
    }
    stream.finish()?;
    Ok(())
}
