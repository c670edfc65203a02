//! Subcommands, one file each, and the error type they share.

pub mod bench_embed;
pub mod bench_llm;
pub mod bench_ops;
pub mod chat;
pub mod devices;
pub mod doctor;
pub mod embed;
pub mod generate;
pub mod llm;
pub mod perplexity;
pub mod similarity;
pub mod synth;
pub mod tokenize;

/// A failure to report to the user: the message, and the exit code (2 for bad usage such as an
/// unknown device, 1 for everything else).
#[derive(Debug)]
pub struct CliError {
    pub msg: String,
    pub code: u8,
}

impl CliError {
    /// Bad usage: a wrong flag value, a missing file. Exit code 2.
    pub fn usage(msg: impl Into<String>) -> CliError {
        CliError { msg: msg.into(), code: 2 }
    }
    pub fn exit_code(&self) -> u8 {
        self.code
    }
}

impl std::fmt::Display for CliError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.msg)
    }
}

impl From<anygpu_core::Error> for CliError {
    fn from(e: anygpu_core::Error) -> CliError {
        let code = if matches!(e, anygpu_core::Error::Device(_)) { 2 } else { 1 };
        CliError { msg: e.to_string(), code }
    }
}

impl From<std::io::Error> for CliError {
    fn from(e: std::io::Error) -> CliError {
        CliError { msg: e.to_string(), code: 1 }
    }
}

impl From<serde_json::Error> for CliError {
    fn from(e: serde_json::Error) -> CliError {
        CliError { msg: e.to_string(), code: 1 }
    }
}

pub type CliResult<T = std::process::ExitCode> = Result<T, CliError>;

/// Opens the device the global `--device` flag and the ANYGPU_* environment select (GL is
/// started only when needed: see `Discovery::run_to_open`).
pub fn open_device(device: Option<&str>) -> CliResult<anygpu_core::Device> {
    let opts = anygpu_core::device::SelectOptions::from_env(device);
    Ok(anygpu_core::device::Discovery::run_to_open(opts)?.open_selected()?)
}

/// Discovers devices with the global `--device` flag and the ANYGPU_* environment applied.
pub fn discover(device: Option<&str>) -> CliResult<anygpu_core::device::Discovery> {
    Ok(anygpu_core::device::Discovery::run(anygpu_core::device::SelectOptions::from_env(device))?)
}
