//! The `anygpu` binary: one module per subcommand under `cmd/`.

mod cmd;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "anygpu",
    version,
    about = "Run neural networks on whatever GPU this machine has (WebGPU: Vulkan, Metal, DX12, GL)"
)]
struct Cli {
    /// Device to use: an index from `anygpu devices`, a name substring, or `cpu`
    /// (default: the best hardware GPU, else the CPU). Also ANYGPU_DEVICE; ANYGPU_BACKEND
    /// restricts the backend (vulkan, metal, dx12, gl, cpu).
    #[arg(long, global = true, env = "ANYGPU_DEVICE")]
    device: Option<String>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List every adapter on every backend, and which one is used and why.
    Devices(cmd::devices::Args),
    /// Run a smoke test and a short benchmark on every adapter, with fix-it hints.
    Doctor(cmd::doctor::Args),
    /// Generate text from a prompt with a GGUF model (streams to stdout).
    Generate(cmd::generate::Args),
    /// Chat interactively with a GGUF model.
    Chat(cmd::chat::Args),
    /// Print the token ids of a text (or a file's content).
    Tokenize(cmd::tokenize::Args),
    /// Perplexity of a GGUF model over a text file.
    Perplexity(cmd::perplexity::Args),
    /// Sentence embeddings from a BERT model folder (sentence-transformers), one per input.
    Embed(cmd::embed::Args),
    /// Cosine similarity matrix of two or more texts under a BERT model folder.
    Similarity(cmd::similarity::Args),
    /// Write a synthetic llama-shaped GGUF model (random weights) for benchmarks.
    Synth(cmd::synth::Args),
    /// Benchmarks: `bench llm` (prefill/decode tokens per second), `bench ops` (kernels),
    /// `bench embed` (sentence embeddings per second).
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Prefill and decode tokens/s of a GGUF model, like llama-bench.
    Llm(cmd::bench_llm::Args),
    /// Time every kernel; GFLOP/s, GB/s and the fraction of the device's ceilings.
    Ops(cmd::bench_ops::Args),
    /// Sentences per second of a BERT embedding model on a batch of fixed-length inputs.
    Embed(cmd::bench_embed::Args),
}

fn main() -> ExitCode {
    // `anygpu devices | head` should end quietly, as other Unix tools do, not panic.
    #[cfg(unix)]
    // SAFETY: restoring the default SIGPIPE action before any thread is spawned.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // wgpu logs driver probing failures (e.g. GL without compute) as errors; `doctor` reports
    // those in words, so they are silenced unless RUST_LOG asks for them.
    env_logger::Builder::from_env(
        env_logger::Env::default().default_filter_or("error,wgpu_core=off,wgpu_hal=off,naga=off"),
    )
    .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Devices(args) => cmd::devices::run(cli.device.as_deref(), args),
        Command::Doctor(args) => cmd::doctor::run(cli.device.as_deref(), args),
        Command::Generate(args) => cmd::generate::run(cli.device.as_deref(), args),
        Command::Chat(args) => cmd::chat::run(cli.device.as_deref(), args),
        Command::Tokenize(args) => cmd::tokenize::run(args),
        Command::Synth(args) => cmd::synth::run(args),
        Command::Perplexity(args) => cmd::perplexity::run(cli.device.as_deref(), args),
        Command::Embed(args) => cmd::embed::run(cli.device.as_deref(), args),
        Command::Similarity(args) => cmd::similarity::run(cli.device.as_deref(), args),
        Command::Bench(BenchCommand::Llm(args)) => cmd::bench_llm::run(cli.device.as_deref(), args),
        Command::Bench(BenchCommand::Ops(args)) => cmd::bench_ops::run(cli.device.as_deref(), args),
        Command::Bench(BenchCommand::Embed(args)) => cmd::bench_embed::run(cli.device.as_deref(), args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
