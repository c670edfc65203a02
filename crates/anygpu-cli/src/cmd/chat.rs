//! `anygpu chat -m FILE`: an interactive conversation in the model's chat template. The KV
//! cache keeps the conversation; each turn only the new tokens are run. `/clear` starts over,
//! `/exit` (or end of input) quits.

use std::io::{BufRead, Write};
use std::process::ExitCode;

use anygpu_models::chat_template::Message;
use anygpu_models::generate::generate;
use anygpu_models::sampling::Sampler;

use super::llm::{load, ModelArgs, SamplingArgs};
use super::{CliError, CliResult};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Tokens per reply at most.
    #[arg(short = 'n', long = "n-predict", default_value_t = 512)]
    n_predict: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// System message (default: the template's own).
    #[arg(long)]
    system: Option<String>,
}

pub fn run(device: Option<&str>, args: Args) -> CliResult {
    let params = args.sampling.params()?;
    let lm = load(device, &args.model, false)?;
    let template =
        lm.template.as_ref().ok_or_else(|| CliError::usage("the model file has no tokenizer.chat_template"))?;
    let mut sampler = Sampler::new(params);
    let mut cache = lm.model.new_cache(lm.n_ctx)?;
    let mut messages: Vec<Message> = args.system.iter().map(|s| Message::system(s.clone())).collect();
    let mut fed: Vec<u32> = Vec::new(); // tokens in the cache
    eprintln!("anygpu: chat ready. /clear starts over, /exit quits.");
    let stdin = std::io::stdin();
    let mut out = std::io::stdout().lock();
    loop {
        eprint!("> ");
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            break;
        }
        let line = line.trim_end_matches(['\n', '\r']);
        match line.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/clear" => {
                messages.retain(|m| m.role == "system");
                cache.clear();
                fed.clear();
                continue;
            }
            _ => {}
        }
        messages.push(Message::user(line.to_string()));
        let ids = lm.tokenizer.encode(&template.render(&messages, true)?, true)?;
        // Reuse the cached prefix; run only what is new.
        let common = fed.iter().zip(&ids).take_while(|(a, b)| a == b).count();
        cache.truncate(common);
        fed.truncate(common);
        if ids.len() + 1 >= lm.n_ctx {
            messages.pop();
            eprintln!(
                "anygpu: the conversation no longer fits the context ({} tokens); /clear to start over",
                ids.len()
            );
            continue;
        }
        let mut stream = lm.tokenizer.stream_decoder();
        let mut on_token = |id: u32| {
            let piece = stream.push(id);
            out.write_all(piece.as_bytes()).and_then(|()| out.flush()).is_ok()
        };
        let budget = args.n_predict.min(lm.n_ctx - ids.len() - 1);
        let g = generate(&lm.model, &lm.tokenizer, &mut cache, &ids[common..], budget, &mut sampler, &mut on_token)?;
        writeln!(out)?;
        fed = ids;
        // The cache holds every generated token but the last, which was sampled and never run.
        fed.extend(&g.generated_ids[..g.generated_ids.len().saturating_sub(1)]);
        cache.truncate(fed.len());
        messages.push(Message::assistant(lm.tokenizer.decode(&g.generated_ids)));
    }
    Ok(ExitCode::SUCCESS)
}
