//! `anygpu perplexity -m FILE -f TEXTFILE [--json]`: the file as one sequence (chunked at the
//! context size if longer); every token after the first is scored from the logits at the
//! previous position.

use std::path::PathBuf;
use std::process::ExitCode;

use anygpu_models::generate::perplexity;

use super::llm::{load, ModelArgs};
use super::{CliError, CliResult};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Text file to score.
    #[arg(short = 'f', long = "file")]
    file: PathBuf,
    /// Print {"mean_nll", "perplexity", "n_scored"} as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(device: Option<&str>, args: Args) -> CliResult {
    // A chunk scores every token but its first from the ones before it: one token scores none.
    if args.model.ctx_size.is_some_and(|c| c < 2) {
        return Err(CliError::usage(
            "perplexity needs --ctx-size of at least 2 (each chunk's first token is not scored)",
        ));
    }
    let text =
        std::fs::read_to_string(&args.file).map_err(|e| CliError::usage(format!("{}: {e}", args.file.display())))?;
    let lm = load(device, &args.model, args.json)?;
    let ids = lm.tokenizer.encode(&text, true)?;
    let quiet = args.json;
    let mut progress = |done: usize, total: usize| {
        if !quiet {
            eprintln!("anygpu: chunk {done}/{total}");
        }
    };
    let p = perplexity(&lm.model, &ids, lm.n_ctx, &mut progress)?;
    if args.json {
        println!(
            "{}",
            serde_json::json!({"mean_nll": p.mean_nll, "perplexity": p.perplexity, "n_scored": p.n_scored, "n_chunks": p.n_chunks})
        );
    } else {
        println!("tokens scored: {}  mean NLL: {:.6}  perplexity: {:.4}", p.n_scored, p.mean_nll, p.perplexity);
    }
    Ok(ExitCode::SUCCESS)
}
