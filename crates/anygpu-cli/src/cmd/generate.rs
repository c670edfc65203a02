//! `anygpu generate`: complete a prompt (or answer it as a chat message), streaming the text
//! to stdout; device, load time and speeds go to stderr.

use std::io::Write;
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
    /// The prompt. Special-token text such as <|im_start|> is parsed as the special token.
    #[arg(short = 'p', long = "prompt")]
    prompt: String,
    /// Tokens to generate at most.
    #[arg(short = 'n', long = "n-predict", default_value_t = 128)]
    n_predict: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System message for --chat (default: the template's own).
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Print one JSON object {prompt_ids, generated_ids, text, timings} instead of the stream.
    #[arg(long)]
    json: bool,
}

pub fn run(device: Option<&str>, args: Args) -> CliResult {
    let params = args.sampling.params()?;
    let lm = load(device, &args.model, false)?;
    let text = if args.chat {
        let template = lm
            .template
            .as_ref()
            .ok_or_else(|| CliError::usage("--chat: the model file has no tokenizer.chat_template"))?;
        let mut messages = Vec::new();
        if let Some(s) = &args.system {
            messages.push(Message::system(s.clone()));
        }
        messages.push(Message::user(args.prompt.clone()));
        template.render(&messages, true)?
    } else {
        args.prompt.clone()
    };
    let prompt_ids = lm.tokenizer.encode(&text, true)?;
    if prompt_ids.len() >= lm.n_ctx {
        return Err(CliError::usage(format!(
            "the prompt has {} tokens but the context holds {}: shorten it or raise --ctx-size",
            prompt_ids.len(),
            lm.n_ctx
        )));
    }
    eprintln!("anygpu: prompt {} tokens, seed {}", prompt_ids.len(), params.seed);
    let mut cache = lm.model.new_cache(lm.n_ctx)?;
    let mut sampler = Sampler::new(params);
    let mut stream = lm.tokenizer.stream_decoder();
    let mut stdout = std::io::stdout().lock();
    let json = args.json;
    let mut on_token = |id: u32| {
        if !json {
            let piece = stream.push(id);
            // A closed stdout (e.g. `| head`) ends generation quietly.
            return stdout.write_all(piece.as_bytes()).and_then(|()| stdout.flush()).is_ok();
        }
        true
    };
    let g = generate(&lm.model, &lm.tokenizer, &mut cache, &prompt_ids, args.n_predict, &mut sampler, &mut on_token)?;
    let text = lm.tokenizer.decode(&g.generated_ids);
    if json {
        let out = serde_json::json!({
            "prompt_ids": prompt_ids,
            "generated_ids": g.generated_ids,
            "text": text,
            "stop": g.stop,
            "timings": g.timings,
        });
        println!("{out}");
    } else {
        let tail = stream.finish();
        let _ = stdout.write_all(tail.as_bytes());
        let _ = writeln!(stdout);
    }
    let t = &g.timings;
    let recorded =
        if t.record_ms > 0.05 { format!(" (decode step recorded in {:.1} ms)", t.record_ms) } else { String::new() };
    eprintln!(
        "anygpu: prefill {} tokens in {:.1} ms ({:.1} tok/s), decode {} tokens in {:.1} ms ({:.1} tok/s){recorded}, stop: {:?}",
        t.prompt_tokens,
        t.prefill_ms,
        t.prefill_tokens_per_s,
        t.generated_tokens,
        t.decode_ms,
        t.decode_tokens_per_s,
        g.stop
    );
    Ok(ExitCode::SUCCESS)
}
