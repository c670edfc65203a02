//! What the LLM subcommands share: the model flags, loading a GGUF file onto the selected
//! device with a progress bar, and the sampling flags.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anygpu_core::Device;
use anygpu_models::chat_template::ChatTemplate;
use anygpu_models::gguf::GgufFile;
use anygpu_models::llama::Llama;
use anygpu_models::sampling::SamplingParams;
use anygpu_models::tokenizer::{LlmTokenizer, TokenizerSpec};

use super::{open_device, CliError, CliResult};

#[derive(clap::Args, Clone)]
pub struct ModelArgs {
    /// GGUF model file (llama family: Llama 2/3, SmolLM, Mistral, TinyLlama, Qwen2).
    #[arg(short = 'm', long = "model")]
    pub model: PathBuf,
    /// Context size in tokens (default: the model's training context, at most 4096).
    #[arg(short = 'c', long = "ctx-size")]
    pub ctx_size: Option<usize>,
}

#[derive(clap::Args, Clone)]
pub struct SamplingArgs {
    /// Temperature; 0 is greedy.
    #[arg(long = "temp", default_value_t = 0.8)]
    pub temp: f32,
    /// Keep the K most likely tokens (0 = off).
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability adds up to P (1.0 = off).
    #[arg(long = "top-p", default_value_t = 0.95)]
    pub top_p: f32,
    /// Drop tokens less likely than P x the most likely one (0 = off).
    #[arg(long = "min-p", default_value_t = 0.05)]
    pub min_p: f32,
    /// Penalise tokens seen in the last --repeat-last-n tokens (1.0 = off).
    #[arg(long = "repeat-penalty", default_value_t = 1.0)]
    pub repeat_penalty: f32,
    #[arg(long = "repeat-last-n", default_value_t = 64)]
    pub repeat_last_n: usize,
    /// Random seed (default: a new one each run, printed on stderr).
    #[arg(long = "seed", short = 's')]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    pub fn params(&self) -> CliResult<SamplingParams> {
        let seed = self.seed.unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
        });
        let p = SamplingParams {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            seed,
        };
        p.validate().map_err(CliError::usage)?;
        Ok(p)
    }
}

/// A model ready to run, with its tokenizer and chat template.
pub struct Loaded {
    pub model: Llama,
    pub tokenizer: LlmTokenizer,
    pub template: Option<ChatTemplate>,
    pub n_ctx: usize,
}

/// Opens the GGUF file (validated, memory-mapped) and builds its tokenizer, without weights.
pub fn open_vocab(path: &PathBuf) -> CliResult<(Arc<GgufFile>, LlmTokenizer)> {
    check_exists(path)?;
    let file = Arc::new(GgufFile::open(path).map_err(anygpu_core::Error::from)?);
    let tokenizer = LlmTokenizer::from_spec(&TokenizerSpec::from_gguf(&file)?)?;
    Ok((file, tokenizer))
}

fn check_exists(path: &std::path::Path) -> CliResult<()> {
    if !path.exists() {
        return Err(CliError::usage(format!(
            "model file {} does not exist (the README's first command fetches SmolLM2 into models/)",
            path.display()
        )));
    }
    if path.is_dir() {
        return Err(CliError::usage(format!(
            "{} is a directory: -m takes a .gguf file (e.g. models/SmolLM2-135M-Instruct.Q4_1.gguf)",
            path.display()
        )));
    }
    Ok(())
}

/// Selects the device, loads the model onto it with a progress bar (on a terminal), and
/// reports device and load time on stderr.
pub fn load(device: Option<&str>, args: &ModelArgs, quiet: bool) -> CliResult<Loaded> {
    let t0 = Instant::now();
    // The tokenizer (~0.1 s for a 49k vocabulary) is built while the device is found and
    // opened (0.3-0.7 s on a cold start): both are on the way to the first token.
    check_exists(&args.model)?; // before the drivers start printing
    anygpu_core::device::discovery::prepare_environment();
    let (vocab, dev) = std::thread::scope(|s| {
        let vocab = s.spawn(|| open_vocab(&args.model));
        let dev = open_device(device);
        (vocab.join(), dev)
    });
    let (file, tokenizer) = vocab.unwrap_or_else(|panic| std::panic::resume_unwind(panic))?;
    let dev = dev?;
    let total: u64 = file.tensors().iter().map(|t| t.n_bytes).sum();
    let bar = (!quiet && std::io::stderr().is_terminal()).then(|| {
        let b = indicatif::ProgressBar::new(total);
        b.set_style(
            indicatif::ProgressStyle::with_template("loading {bar:40} {bytes}/{total_bytes} ({eta})")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b
    });
    let mut progress = |_: usize, bytes: u64| {
        if let Some(b) = &bar {
            b.set_position(bytes);
        }
    };
    let model = Llama::load(&file, &dev, &mut progress)?;
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let n_ctx_train = model.config.n_ctx_train.max(1);
    let n_ctx = match args.ctx_size {
        Some(0) => return Err(CliError::usage("--ctx-size must be at least 1")),
        Some(n) if n > n_ctx_train => {
            return Err(CliError::usage(format!(
                "--ctx-size {n} exceeds the model's training context of {n_ctx_train}"
            )))
        }
        Some(n) => n,
        None => n_ctx_train.min(4096),
    };
    let template = match file.get("tokenizer.chat_template") {
        Some(_) => Some(ChatTemplate::for_tokenizer(
            file.get_str("tokenizer.chat_template").map_err(anygpu_core::Error::from)?,
            &tokenizer,
        )?),
        None => None,
    };
    if !quiet {
        let c = &model.config;
        eprintln!(
            "anygpu: {} ({}, {} layers, {} MiB of weights) on {} — loaded in {:.2} s",
            args.model.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default(),
            c.arch,
            c.n_layer,
            model.weight_bytes() >> 20,
            describe(&dev),
            t0.elapsed().as_secs_f64()
        );
    }
    Ok(Loaded { model, tokenizer, template, n_ctx })
}

pub fn describe(dev: &Device) -> String {
    match dev {
        Device::Cpu => format!("the CPU backend ({} threads)", rayon_threads()),
        Device::Gpu(ctx) => format!("{} ({})", ctx.info.name, ctx.info.backend),
    }
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}
