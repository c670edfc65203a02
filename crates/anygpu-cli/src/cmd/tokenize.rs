//! `anygpu tokenize -m FILE (TEXT | -f PATH) [--json]`: the token ids of a text, with the
//! model's own tokenizer (no weights are loaded).

use std::path::PathBuf;
use std::process::ExitCode;

use super::llm::open_vocab;
use super::{CliError, CliResult};

#[derive(clap::Args)]
pub struct Args {
    /// GGUF model file.
    #[arg(short = 'm', long = "model")]
    model: PathBuf,
    /// Text to tokenize.
    #[arg(conflicts_with = "file")]
    text: Option<String>,
    /// Tokenize the whole content of this file instead.
    #[arg(short = 'f', long = "file")]
    file: Option<PathBuf>,
    /// Add BOS/EOS as the model file asks (default: add none).
    #[arg(long)]
    add_special: bool,
    /// Print a JSON array of ids.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> CliResult {
    let text = match (&args.text, &args.file) {
        (Some(t), None) => t.clone(),
        (None, Some(p)) => std::fs::read_to_string(p).map_err(|e| CliError::usage(format!("{}: {e}", p.display())))?,
        _ => return Err(CliError::usage("give the text to tokenize, or -f FILE")),
    };
    let (_, tok) = open_vocab(&args.model)?;
    let ids = tok.encode(&text, args.add_special)?;
    if args.json {
        println!("{}", serde_json::to_string(&ids)?);
    } else {
        for id in &ids {
            let piece = String::from_utf8_lossy(tok.piece(*id, true)).to_string();
            println!("{id:>7} -> {piece:?}");
        }
        eprintln!("{} tokens", ids.len());
    }
    Ok(ExitCode::SUCCESS)
}
