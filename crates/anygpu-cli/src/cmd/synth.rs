//! `anygpu synth`: writes a synthetic llama-shaped GGUF model (random N(0, 0.02) weights, the
//! tokenizer of another GGUF file) for benchmarks at sizes that cannot be downloaded here.

use std::path::PathBuf;
use std::process::ExitCode;

use anygpu_models::gguf::{GgmlType, GgufFile};
use anygpu_models::synthetic::{write_synthetic, SyntheticSpec};

use super::{CliError, CliResult};

#[derive(clap::Args)]
pub struct Args {
    /// Output file.
    #[arg(short = 'o', long)]
    output: PathBuf,
    /// A GGUF file whose tokenizer metadata is copied (e.g. SmolLM2's).
    #[arg(long)]
    vocab_from: PathBuf,
    /// Shape: 1b (16 layers, 2048 wide, 8192 FFN) or 8b (32 layers, 4096 wide, 14336 FFN), 32/8 heads.
    #[arg(long, default_value = "1b")]
    preset: String,
    /// Weight type: f32, f16, bf16, q8_0, q4_0 or q4_k.
    #[arg(long = "type", default_value = "f16")]
    ty: String,
    /// Override the number of layers.
    #[arg(long)]
    layers: Option<usize>,
}

pub fn run(args: Args) -> CliResult {
    let ty = match args.ty.to_lowercase().as_str() {
        "f32" => GgmlType::F32,
        "f16" => GgmlType::F16,
        "bf16" => GgmlType::BF16,
        "q8_0" => GgmlType::Q8_0,
        "q4_0" => GgmlType::Q4_0,
        "q4_k" => GgmlType::Q4K,
        other => return Err(CliError::usage(format!("--type {other}: use f32, f16, bf16, q8_0, q4_0 or q4_k"))),
    };
    let mut spec = SyntheticSpec::preset(&args.preset, ty)
        .ok_or_else(|| CliError::usage(format!("--preset {}: use 1b, 8b or tiny", args.preset)))?;
    if let Some(l) = args.layers {
        spec.n_layer = l;
    }
    let vocab = GgufFile::open(&args.vocab_from).map_err(anygpu_core::Error::from)?;
    let file =
        std::fs::File::create(&args.output).map_err(|e| CliError::usage(format!("{}: {e}", args.output.display())))?;
    let t0 = std::time::Instant::now();
    write_synthetic(&spec, &vocab, std::io::BufWriter::with_capacity(8 << 20, file))?;
    let size = std::fs::metadata(&args.output).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "anygpu: wrote {} ({} MiB, {spec:?}) in {:.1} s",
        args.output.display(),
        size >> 20,
        t0.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}
