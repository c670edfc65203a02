//! `anygpu embed -m DIR [TEXT ...] [-f FILE] [--batch-size N] [--json]`: one sentence embedding
//! per input (each TEXT argument, then each line of FILE), computed in padded batches with the
//! folder's sentence-transformers pipeline (pooling, normalisation, max_seq_length).

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anygpu_models::bert::{SentenceEmbedder, WeightDType};

use super::llm::describe;
use super::{open_device, CliError, CliResult};

#[derive(clap::Args)]
pub struct Args {
    /// Model folder (sentence-transformers or Hugging Face BERT): config.json, model.safetensors,
    /// tokenizer.json, and modules.json, 1_Pooling/config.json, sentence_bert_config.json when
    /// present (e.g. models/all-MiniLM-L6-v2 from scripts/fetch-models.sh minilm).
    #[arg(short = 'm', long = "model")]
    model: PathBuf,
    /// Texts to embed, one embedding each.
    texts: Vec<String>,
    /// Also embed each line of this file (`-` reads standard input), after the TEXT arguments.
    #[arg(short = 'f', long = "file")]
    file: Option<PathBuf>,
    /// Inputs per forward pass (each batch is padded to its longest input; inputs are sorted by
    /// length first, so batches pad little).
    #[arg(long = "batch-size", default_value_t = 32)]
    batch_size: usize,
    /// Print one JSON array of floats per line, in input order (nothing else on stdout).
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    weights: WeightsArg,
}

/// `--dtype`: the dtype of the encoder's linear weights on the device.
#[derive(clap::Args)]
pub struct WeightsArg {
    /// Linear weights on the device: `auto` (f16 on a GPU with tensor cores reachable through
    /// cooperative matrices, where the products then run with f16 inputs and f32 accumulation;
    /// f32 elsewhere), `f32` or `f16`.
    #[arg(long = "dtype", default_value = "auto", value_parser = ["auto", "f32", "f16"])]
    dtype: String,
}

impl WeightsArg {
    fn choice(&self) -> WeightDType {
        WeightDType::parse(&self.dtype).unwrap_or_default()
    }
}

/// Selects the device and loads the model folder onto it; reports what was loaded on stderr
/// unless `quiet`.
pub fn load_embedder(
    device: Option<&str>,
    dir: &Path,
    weights: &WeightsArg,
    quiet: bool,
) -> CliResult<SentenceEmbedder> {
    if !dir.is_dir() {
        return Err(CliError::usage(format!(
            "model folder {} does not exist (scripts/fetch-models.sh minilm fetches all-MiniLM-L6-v2 into models/)",
            dir.display()
        )));
    }
    let t0 = Instant::now();
    let dev = open_device(device)?;
    let m = SentenceEmbedder::load_with(dir, &dev, weights.choice())?;
    if !quiet {
        let c = &m.model.config;
        eprintln!(
            "anygpu: {} (BERT, {} layers, {}-dim, {} pooling{}, max {} tokens, {} weights) on {} — loaded in {:.2} s",
            dir.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default(),
            c.num_hidden_layers,
            m.dim(),
            m.sentence.pooling.name(),
            if m.sentence.normalize { ", normalized" } else { "" },
            m.max_len,
            m.model.weight_dtype,
            describe(&dev),
            t0.elapsed().as_secs_f64()
        );
    }
    Ok(m)
}

/// Embeds `texts`, warning on stderr about each input cut to max_seq_length.
pub fn embed_texts(m: &SentenceEmbedder, texts: &[String], batch_size: usize) -> CliResult<Vec<Vec<f32>>> {
    if batch_size == 0 {
        return Err(CliError::usage("--batch-size must be at least 1"));
    }
    let out = m.embed(texts, batch_size)?;
    for &i in &out.truncated {
        eprintln!(
            "anygpu: warning: input {i} ({}) is longer than max_seq_length and was truncated to {} tokens",
            preview(&texts[i], 40),
            m.max_len
        );
    }
    Ok(out.vectors)
}

/// The first `n` characters of a text, quoted, for messages.
pub fn preview(text: &str, n: usize) -> String {
    let mut s: String = text.chars().take(n).collect();
    if text.chars().count() > n {
        s.push('…');
    }
    format!("{s:?}")
}

fn read_inputs(args: &Args) -> CliResult<Vec<String>> {
    let mut texts = args.texts.clone();
    if let Some(p) = &args.file {
        let lines: Vec<String> = if p.as_os_str() == "-" {
            std::io::stdin().lock().lines().collect::<Result<_, _>>()?
        } else {
            let text = std::fs::read_to_string(p).map_err(|e| CliError::usage(format!("{}: {e}", p.display())))?;
            text.lines().map(str::to_string).collect()
        };
        texts.extend(lines);
    }
    if texts.is_empty() {
        return Err(CliError::usage("nothing to embed: give TEXT arguments or -f FILE"));
    }
    Ok(texts)
}

pub fn run(device: Option<&str>, args: Args) -> CliResult {
    let texts = read_inputs(&args)?;
    let m = load_embedder(device, &args.model, &args.weights, args.json)?;
    let t0 = Instant::now();
    let vectors = embed_texts(&m, &texts, args.batch_size)?;
    let secs = t0.elapsed().as_secs_f64();
    let mut out = std::io::stdout().lock();
    if args.json {
        for v in &vectors {
            writeln!(out, "{}", serde_json::to_string(v)?)?;
        }
    } else {
        for (i, (v, t)) in vectors.iter().zip(&texts).enumerate() {
            let head: Vec<String> = v.iter().take(4).map(|x| format!("{x:+.4}")).collect();
            writeln!(out, "{i:>4}  [{}, … ] ({} floats)  {}", head.join(", "), v.len(), preview(t, 60))?;
        }
        eprintln!("anygpu: {} embeddings in {:.3} s ({:.1} inputs/s)", vectors.len(), secs, texts.len() as f64 / secs);
    }
    Ok(ExitCode::SUCCESS)
}
