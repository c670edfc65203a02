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
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
