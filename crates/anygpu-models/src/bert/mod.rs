//! BERT sentence embeddings from a Hugging Face / sentence-transformers folder
//! (all-MiniLM-L6-v2 and its kind).
//!
//! What decides what, as in sentence-transformers:
//! - `config.json`: the encoder's sizes ([`BertConfig`]);
//! - `model.safetensors`: the weights, memory-mapped and validated
//!   ([`crate::safetensors_file`]);
//! - `tokenizer.json`: WordPiece through the `tokenizers` crate. The file may carry its own
//!   truncation and padding (all-MiniLM-L6-v2's says truncate and pad to 128): both are
//!   replaced, truncation by max_seq_length and padding by our own per-batch padding;
//! - `modules.json`, `1_Pooling/config.json`, `sentence_bert_config.json`: pooling (mean, CLS,
//!   max), L2 normalisation, max_seq_length ([`SentenceConfig`]).
//!
//! ```no_run
//! use anygpu_core::Device;
//! use anygpu_models::bert::SentenceEmbedder;
//! let model = SentenceEmbedder::load("models/all-MiniLM-L6-v2".as_ref(), &Device::Cpu)?;
//! let out = model.embed(&["A man is eating food.", "A man is eating bread."], 32)?;
//! let sim = anygpu_models::bert::cosine(&out.vectors[0], &out.vectors[1]);
//! # let _ = sim; Ok::<(), anygpu_core::Error>(())
//! ```

mod config;
mod model;
mod pooling;

use std::path::{Path, PathBuf};
use std::time::Instant;

use anygpu_core::{Device, Error, Result};
use tokenizers::{Tokenizer, TruncationDirection, TruncationParams, TruncationStrategy};

pub use config::{BertConfig, Pooling, SentenceConfig};
pub use model::{AttentionPath, Batch, BertModel, WeightDType};
pub use pooling::{cosine, cosine_matrix, normalize_in_place, pool};

/// One input after tokenization.
#[derive(Clone, Debug, PartialEq)]
pub struct Encoded {
    /// [CLS] ... [SEP], at most max_seq_length ids.
    pub ids: Vec<u32>,
    /// The input was longer than max_seq_length and lost its end.
    pub truncated: bool,
}

/// Embeddings of a list of inputs, in input order.
pub struct Embeddings {
    pub vectors: Vec<Vec<f32>>,
    /// Indices of the inputs that were truncated to max_seq_length.
    pub truncated: Vec<usize>,
}

/// A BERT encoder with its tokenizer and sentence-transformers pipeline.
pub struct SentenceEmbedder {
    pub model: BertModel,
    pub tokenizer: Tokenizer,
    pub sentence: SentenceConfig,
    /// The effective truncation length (max_seq_length capped at the position table).
    pub max_len: usize,
    pub dir: PathBuf,
}

impl SentenceEmbedder {
    /// Loads a sentence-transformers folder (or a plain BERT folder: mean pooling, no
    /// normalisation) onto `device`.
    pub fn load(dir: &Path, device: &Device) -> Result<SentenceEmbedder> {
        Self::load_with(dir, device, WeightDType::Auto)
    }

    /// [`SentenceEmbedder::load`] with the linear weights' dtype chosen.
    pub fn load_with(dir: &Path, device: &Device, weights: WeightDType) -> Result<SentenceEmbedder> {
        if !dir.is_dir() {
            return Err(Error::Format(format!("{}: not a model folder", dir.display())));
        }
        let sentence = SentenceConfig::from_dir(dir)?;
        let tdir = dir.join(&sentence.transformer_path);
        let model = BertModel::load_dir(&tdir, device, weights)?;
        let max_len = sentence.max_len(&model.config)?;
        let tokenizer = load_tokenizer(&tdir.join("tokenizer.json"), max_len)?;
        Ok(SentenceEmbedder { model, tokenizer, sentence, max_len, dir: dir.to_path_buf() })
    }

    /// Floats per embedding.
    pub fn dim(&self) -> usize {
        self.model.hidden_size() * self.sentence.pooling.n_modes()
    }

    /// Token ids as the model sees them: special tokens added, truncated to max_seq_length.
    pub fn tokenize(&self, text: &str) -> Result<Encoded> {
        let lowered;
        let text = if self.sentence.do_lower_case {
            lowered = text.to_lowercase();
            lowered.as_str()
        } else {
            text
        };
        let enc = self.tokenizer.encode(text, true).map_err(|e| Error::Format(format!("tokenizer: {e}")))?;
        let mut ids = enc.get_ids().to_vec();
        let truncated = !enc.get_overflowing().is_empty();
        // The tokenizer's truncation already did this; kept as a guard for odd tokenizer files.
        ids.truncate(self.max_len);
        if ids.is_empty() {
            return Err(Error::Format("tokenizer: no tokens (the tokenizer adds no [CLS]/[SEP])".into()));
        }
        Ok(Encoded { ids, truncated })
    }

    /// Embeds one padded batch of token id sequences (each 1..=max_len ids), in order.
    pub fn embed_ids(&self, seqs: &[&[u32]]) -> Result<Vec<Vec<f32>>> {
        if seqs.is_empty() {
            return Ok(Vec::new());
        }
        let t = seqs.iter().map(|s| s.len()).max().unwrap_or(0);
        if t > self.max_len {
            return Err(Error::shape(
                "embed",
                format!("a sequence of {t} tokens exceeds max_seq_length {}", self.max_len),
            ));
        }
        let lengths: Vec<usize> = seqs.iter().map(|s| s.len()).collect();
        let mut ids = vec![0u32; seqs.len() * t]; // padding: id 0 ([PAD]), never attended to
        for (row, s) in ids.chunks_mut(t.max(1)).zip(seqs) {
            row[..s.len()].copy_from_slice(s);
        }
        let hidden = self.model.forward(&Batch { ids: &ids, type_ids: None, lengths: &lengths, t })?;
        pool(&hidden, &lengths, &self.sentence.pooling, self.sentence.normalize)
    }

    /// Embeds `texts` in batches of up to `batch_size`, sorted by length so that each batch
    /// pads little; results come back in input order.
    pub fn embed<S: AsRef<str>>(&self, texts: &[S], batch_size: usize) -> Result<Embeddings> {
        let enc: Vec<Encoded> = texts.iter().map(|t| self.tokenize(t.as_ref())).collect::<Result<_>>()?;
        let truncated = enc.iter().enumerate().filter(|(_, e)| e.truncated).map(|(i, _)| i).collect();
        let mut order: Vec<usize> = (0..enc.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(enc[i].ids.len()));
        let mut vectors = vec![Vec::new(); enc.len()];
        for chunk in order.chunks(batch_size.max(1)) {
            let seqs: Vec<&[u32]> = chunk.iter().map(|&i| enc[i].ids.as_slice()).collect();
            for (&i, v) in chunk.iter().zip(self.embed_ids(&seqs)?) {
                vectors[i] = v;
            }
        }
        Ok(Embeddings { vectors, truncated })
    }
}

/// Reads tokenizer.json and puts our truncation (max_len, special tokens included, the end
/// cut off) in place of the file's, and no padding.
fn load_tokenizer(path: &Path, max_len: usize) -> Result<Tokenizer> {
    let fail = |e: &dyn std::fmt::Display| Error::Format(format!("{}: {e}", path.display()));
    let mut tok = Tokenizer::from_file(path).map_err(|e| fail(&e))?;
    tok.with_padding(None);
    tok.with_truncation(Some(TruncationParams {
        max_length: max_len,
        strategy: TruncationStrategy::LongestFirst,
        stride: 0,
        direction: TruncationDirection::Right,
    }))
    .map_err(|e| fail(&e))?;
    Ok(tok)
}

/// Sentences per second of the whole embedding path (upload of ids, encoder, pooling, read
/// back of the vectors) for `batch` sentences of exactly `seq` tokens ([CLS], random word
/// pieces, [SEP]; no padding), the mean over `reps` timed runs after one untimed warm-up.
pub fn bench_embed(model: &SentenceEmbedder, batch: usize, seq: usize, reps: usize) -> Result<f64> {
    let secs = bench_embed_runs(model, batch, seq, reps)?;
    Ok((batch.max(1) * secs.len()) as f64 / secs.iter().sum::<f64>())
}

/// The ids [`bench_embed`] embeds: `batch` sequences of `seq` tokens (clamped to 2..=max_len),
/// [CLS], word pieces from a fixed LCG (ids from 1000 up: no [PAD], [unusedN], [CLS] ...), [SEP].
/// scripts/gpu/minilm_torch.py draws its own ids; the speed does not depend on which.
pub fn bench_ids(model: &SentenceEmbedder, batch: usize, seq: usize) -> Vec<Vec<u32>> {
    let seq = seq.clamp(2, model.max_len.max(2));
    let vocab = model.model.config.vocab_size as u64;
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (1000 + (s >> 33) % (vocab.saturating_sub(1000).max(1))) as u32
    };
    let special = |name: &str, default: u32| model.tokenizer.token_to_id(name).unwrap_or(default);
    let (cls, sep) = (special("[CLS]", 101), special("[SEP]", 102));
    (0..batch.max(1))
        .map(|_| {
            let mut v: Vec<u32> = (0..seq).map(|_| next()).collect();
            v[0] = cls;
            v[seq - 1] = sep;
            v
        })
        .collect()
}

/// Seconds of each of `reps` timed runs of [`bench_embed`]'s batch, after one untimed warm-up
/// (which also compiles a GPU's pipelines). Each run ends with the vectors on the host.
/// GPU time per op (name and grid) of one forward pass of `batch` sentences of `seq` tokens,
/// each dispatch timed in a compute pass of its own (`Replay::profile`: the figures rank the
/// ops, each carries a pass's overhead): (op, dispatches, seconds), largest first. None on the
/// CPU or without timestamp queries.
pub fn profile_forward(
    model: &SentenceEmbedder,
    batch: usize,
    seq: usize,
) -> Result<Option<Vec<(String, usize, f64)>>> {
    let Some(ctx) = model.model.device().gpu().cloned() else { return Ok(None) };
    let ids: Vec<u32> = bench_ids(model, batch, seq).concat();
    let lengths = vec![seq; batch];
    let batch = Batch { ids: &ids, type_ids: None, lengths: &lengths, t: seq };
    // The same pass recorded twice (a replay is built from two recordings; nothing differs).
    let recs = (0..2u32)
        .map(|i| ctx.record(|| model.model.forward(&batch)).map(|(_, rec)| (i, rec)))
        .collect::<Result<Vec<_>>>()?;
    anygpu_core::gpu::Replay::new(&ctx, recs)?.profile(0)
}

pub fn bench_embed_runs(model: &SentenceEmbedder, batch: usize, seq: usize, reps: usize) -> Result<Vec<f64>> {
    let seqs = bench_ids(model, batch, seq);
    let refs: Vec<&[u32]> = seqs.iter().map(|v| v.as_slice()).collect();
    model.embed_ids(&refs)?;
    (0..reps.max(1))
        .map(|_| {
            let t0 = Instant::now();
            model.embed_ids(&refs)?;
            Ok(t0.elapsed().as_secs_f64())
        })
        .collect()
}
