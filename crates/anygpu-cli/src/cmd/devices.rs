//! `anygpu devices [--json]`: every adapter, the CPU backend, and the selection.

use std::process::ExitCode;

use anygpu_core::device::DeviceInfo;

use super::{discover, CliResult};

#[derive(clap::Args)]
pub struct Args {
    /// Print a JSON array of objects instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(device: Option<&str>, args: Args) -> CliResult {
    let d = discover(device)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&d.rows)?);
        return Ok(ExitCode::SUCCESS);
    }
    print_table(&d.rows);
    if let Some(sel) = d.rows.iter().find(|r| r.selected) {
        println!(
            "\nSelected: [{}] {} ({}) — {}",
            sel.index,
            sel.name,
            sel.backend,
            sel.note.trim_start_matches("selected: ")
        );
    }
    if d.options.webgpu_defaults {
        println!("ANYGPU_PROFILE=webgpu: the device is opened with WebGPU's default limits and no optional features.");
    }
    Ok(ExitCode::SUCCESS)
}

fn mib(b: u64) -> String {
    if b == u64::MAX {
        "-".into()
    } else {
        format!("{}", b >> 20)
    }
}

fn yes(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "-"
    }
}

pub fn print_table(rows: &[DeviceInfo]) {
    println!(
        "{:>3}  {:<1} {:<38} {:<7} {:<10} {:<4} {:<4} {:<4} {:<4} {:<4} {:>9} {:>9}  driver",
        "#", "", "name", "backend", "type", "soft", "f16", "sg", "coop", "ts", "buf MiB", "bind MiB"
    );
    for r in rows {
        let name: String = r.name.chars().take(38).collect();
        println!(
            "{:>3}  {:<1} {:<38} {:<7} {:<10} {:<4} {:<4} {:<4} {:<4} {:<4} {:>9} {:>9}  {}",
            r.index,
            if r.selected { "*" } else { "" },
            name,
            r.backend,
            r.device_type,
            yes(r.software),
            yes(r.features.shader_f16),
            yes(r.features.subgroup),
            yes(r.features.cooperative_matrix),
            yes(r.features.timestamp_query),
            mib(r.limits.max_buffer_size),
            mib(r.limits.max_storage_buffer_binding_size),
            format!("{} {}", r.driver, r.driver_info).trim()
        );
        if !r.note.is_empty() && !r.selected {
            println!("     {}", r.note);
        }
    }
    println!("\nsoft: software rasterizer; sg: subgroups; coop: cooperative matrix; ts: timestamp queries");
}
