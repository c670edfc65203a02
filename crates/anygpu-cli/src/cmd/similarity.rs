//! `anygpu similarity -m DIR TEXT TEXT... [--json]`: the cosine similarity of every pair of
//! texts, as a matrix (rows and columns in argument order).

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anygpu_models::bert::cosine_matrix;

use super::embed::{embed_texts, load_embedder, preview, WeightsArg};
use super::{CliError, CliResult};

#[derive(clap::Args)]
pub struct Args {
    /// Model folder (sentence-transformers or Hugging Face BERT), as for `anygpu embed`.
    #[arg(short = 'm', long = "model")]
    model: PathBuf,
    /// Two or more texts.
    texts: Vec<String>,
    /// Inputs per forward pass.
    #[arg(long = "batch-size", default_value_t = 32)]
    batch_size: usize,
    /// Print the matrix as a JSON array of rows.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    weights: WeightsArg,
}

pub fn run(device: Option<&str>, args: Args) -> CliResult {
    if args.texts.len() < 2 {
        return Err(CliError::usage("give at least two texts to compare"));
    }
    let m = load_embedder(device, &args.model, &args.weights, args.json)?;
    let vectors = embed_texts(&m, &args.texts, args.batch_size)?;
    let sim = cosine_matrix(&vectors);
    let mut out = std::io::stdout().lock();
    if args.json {
        writeln!(out, "{}", serde_json::to_string(&sim)?)?;
        return Ok(ExitCode::SUCCESS);
    }
    let n = sim.len();
    let head: Vec<String> = (0..n).map(|j| format!("{:>7}", format!("[{j}]"))).collect();
    writeln!(out, "{:>5} {}", "", head.join(" "))?;
    for (i, row) in sim.iter().enumerate() {
        let cells: Vec<String> = row.iter().map(|c| format!("{c:>7.4}")).collect();
        writeln!(out, "{:>5} {}  {}", format!("[{i}]"), cells.join(" "), preview(&args.texts[i], 50))?;
    }
    Ok(ExitCode::SUCCESS)
}
