//! `anygpu bench ops [--json] [--filter NAME]`: every kernel at sizes that fill the device, with
//! time, GFLOP/s, GB/s and the fraction of the device's own copy bandwidth and best matmul.

use std::process::ExitCode;

use anygpu_core::bench::{run_ops, BenchResult};

use super::llm::describe;
use super::{open_device, CliResult};

#[derive(clap::Args)]
pub struct Args {
    /// Only kernels whose name contains this (e.g. matmul, softmax).
    #[arg(long)]
    filter: Option<String>,
    /// Timed runs per kernel (the median is reported).
    #[arg(long, default_value_t = 10)]
    reps: usize,
    /// One JSON object per kernel instead of a table.
    #[arg(long)]
    json: bool,
}

fn pct(f: Option<f64>) -> String {
    f.map(|f| format!("{:.0}%", f * 100.0)).unwrap_or_else(|| "-".into())
}

pub fn run(device: Option<&str>, args: Args) -> CliResult {
    let dev = open_device(device)?;
    if !args.json {
        eprintln!("anygpu bench ops on {}", describe(&dev));
        println!("{:<10} {:<28} {:<5} {:>10} {:>10} {:>9}", "op", "shape", "dtype", "ms", "GFLOP/s", "GB/s");
    }
    let json = args.json;
    let mut print = |r: &BenchResult| {
        if !json {
            println!("{:<10} {:<28} {:<5} {:>10.3} {:>10.1} {:>9.1}", r.op, r.shape, r.dtype, r.ms, r.gflops, r.gbps);
        }
    };
    let results = run_ops(&dev, args.filter.as_deref(), args.reps, &mut print)?;
    if json {
        for r in &results {
            println!("{}", serde_json::to_string(r)?);
        }
    } else {
        println!("\nfraction of this device's ceilings measured above (copy bandwidth, best matmul):");
        for r in &results {
            println!(
                "  {:<10} {:<5} {:>5} of copy bandwidth, {:>5} of best matmul  [{}]",
                r.op,
                r.dtype,
                pct(r.frac_copy_bandwidth),
                pct(r.frac_best_matmul),
                r.timer
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
