//! `anygpu bench embed -m DIR [--batch 64] [--seq 128] [-r 5] [--json]`: sentences per second
//! of the whole embedding path (ids up, encoder, pooling, normalisation, vectors back) for a
//! batch of sentences of exactly `--seq` tokens, no padding — issue #5's measurement, the
//! figure that scripts/reference/bench_minilm_torch.py and scripts/gpu/minilm_torch.py give
//! for PyTorch.

use std::path::PathBuf;
use std::process::ExitCode;

use anygpu_models::bert::{bench_embed_runs, profile_forward};
use serde::Serialize;

use super::embed::{load_embedder, WeightsArg};
use super::llm::describe;
use super::{CliError, CliResult};

#[derive(clap::Args)]
pub struct Args {
    /// Model folder (sentence-transformers or Hugging Face BERT), as for `anygpu embed`.
    #[arg(short = 'm', long = "model")]
    model: PathBuf,
    /// Sentences per forward pass.
    #[arg(short = 'b', long = "batch", default_value_t = 64)]
    batch: usize,
    /// Tokens per sentence, [CLS] and [SEP] included (at most the model's max_seq_length).
    #[arg(short = 's', long = "seq", default_value_t = 128)]
    seq: usize,
    /// Timed runs after one untimed warm-up (the mean, best and worst are reported).
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    reps: usize,
    /// One JSON object on stdout instead of a line of text.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    weights: WeightsArg,
}

#[derive(Serialize)]
struct Row {
    model: String,
    device: String,
    /// The checkpoint's float type.
    checkpoint_dtype: String,
    /// The linear weights' dtype on the device (`--dtype`).
    weight_dtype: String,
    batch: usize,
    seq: usize,
    reps: usize,
    /// Sentences per second over all timed runs.
    sentences_per_s: f64,
    /// Milliseconds per batch: mean, best, worst.
    ms_mean: f64,
    ms_min: f64,
    ms_max: f64,
}

pub fn run(device: Option<&str>, args: Args) -> CliResult {
    if args.batch == 0 || args.reps == 0 {
        return Err(CliError::usage("--batch and --repetitions must be at least 1"));
    }
    let m = load_embedder(device, &args.model, &args.weights, args.json)?;
    if args.seq < 2 || args.seq > m.max_len {
        return Err(CliError::usage(format!(
            "--seq {} is not in 2..={} (the model's max_seq_length)",
            args.seq, m.max_len
        )));
    }
    let secs = bench_embed_runs(&m, args.batch, args.seq, args.reps)?;
    if std::env::var("ANYGPU_PROFILE_EMBED").is_ok_and(|v| v == "1") {
        if let Some(ops) = profile_forward(&m, args.batch, args.seq)? {
            let total: f64 = ops.iter().map(|o| o.2).sum();
            eprintln!("anygpu: encoder forward GPU time by op (one pass per dispatch, {:.3} ms in all):", total * 1e3);
            for (op, count, s) in ops {
                eprintln!("  {op:<40} {count:>4} dispatches {:>9.1} µs {:>5.1}%", s * 1e6, 100.0 * s / total);
            }
        }
    }
    let total: f64 = secs.iter().sum();
    let ms = |f: fn(f64, f64) -> f64, init: f64| secs.iter().fold(init, |a, &b| f(a, b)) * 1e3;
    let row = Row {
        model: args.model.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default(),
        device: describe(m.model.device()),
        checkpoint_dtype: m.model.checkpoint_dtype.clone(),
        weight_dtype: m.model.weight_dtype.to_string(),
        batch: args.batch,
        seq: args.seq,
        reps: secs.len(),
        sentences_per_s: (args.batch * secs.len()) as f64 / total,
        ms_mean: total / secs.len() as f64 * 1e3,
        ms_min: ms(f64::min, f64::INFINITY),
        ms_max: ms(f64::max, 0.0),
    };
    if args.json {
        println!("{}", serde_json::to_string(&row)?);
    } else {
        println!(
            "anygpu {} on {}: {} x {} tokens: {:.1} sentences/s ({:.1} ms per batch, best {:.1}, worst {:.1}; \
             {} runs; {} checkpoint, {} linear weights)",
            row.model,
            row.device,
            row.batch,
            row.seq,
            row.sentences_per_s,
            row.ms_mean,
            row.ms_min,
            row.ms_max,
            row.reps,
            row.checkpoint_dtype,
            row.weight_dtype
        );
    }
    Ok(ExitCode::SUCCESS)
}
