//! `anygpu doctor [--json]`: for every adapter and the CPU backend, compile and run a smoke
//! kernel and check its result, then time a short matmul and a copy. Prints fix-it hints for
//! the situations our users hit, and exits non-zero when no device passed.

use std::process::ExitCode;
use std::time::Instant;

use anygpu_core::device::{DeviceInfo, Discovery};
use anygpu_core::testing::{check_close, rand_vec};
use anygpu_core::{Device, Tensor};
use serde::Serialize;

use super::{discover, CliResult};

#[derive(clap::Args)]
pub struct Args {
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct DeviceReport {
    index: usize,
    name: String,
    backend: String,
    software: bool,
    selected: bool,
    passed: bool,
    /// What failed: device creation, kernel compilation, a wrong result.
    error: Option<String>,
    matmul_size: usize,
    matmul_gflops: Option<f64>,
    copy_mib: usize,
    copy_gbps: Option<f64>,
}

#[derive(Serialize)]
struct Report {
    devices: Vec<DeviceReport>,
    hints: Vec<String>,
    passed: bool,
}

pub fn run(device: Option<&str>, args: Args) -> CliResult {
    let d = discover(device)?;
    if !args.json {
        eprintln!("Checking {} device(s)...", d.rows.len());
    }
    let mut devices = Vec::new();
    for row in &d.rows {
        let opened = if row.backend == "cpu" {
            Ok(Device::Cpu)
        } else {
            Device::open_adapter(&d.entries[row.index], d.options.webgpu_defaults)
        };
        let report = check_device(row, opened);
        if !args.json {
            print_line(&report);
        }
        devices.push(report);
    }
    let hints = hints(&d, &devices);
    let gpu_passed = devices.iter().any(|r| r.passed && r.backend != "cpu");
    let report = Report { passed: gpu_passed, devices, hints };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        for h in &report.hints {
            println!("\nhint: {h}");
        }
        if gpu_passed {
            println!("\nOK: at least one GPU adapter runs anygpu's kernels correctly.");
        } else {
            println!("\nFAIL: no GPU adapter passed; anygpu will run on the CPU backend.");
        }
    }
    Ok(if gpu_passed { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

fn print_line(r: &DeviceReport) {
    let status = if r.passed { "PASS" } else { "FAIL" };
    let perf = match (r.matmul_gflops, r.copy_gbps) {
        (Some(g), Some(b)) => {
            format!("matmul {}^3: {:.1} GFLOP/s, copy {} MiB: {:.1} GB/s", r.matmul_size, g, r.copy_mib, b)
        }
        _ => String::new(),
    };
    println!(
        "[{}] {} {} ({}{}){}  {}",
        r.index,
        status,
        r.name,
        r.backend,
        if r.software { ", software" } else { "" },
        if r.selected { " *selected*" } else { "" },
        r.error.as_deref().unwrap_or(&perf)
    );
}

fn check_device(row: &DeviceInfo, opened: anygpu_core::Result<Device>) -> DeviceReport {
    // Software rasterizers and the CPU get small problems so doctor stays quick.
    let small = row.software || row.backend == "cpu";
    let (matmul_size, copy_elems) = if small { (256, 1 << 20) } else { (2048, 64 << 20) };
    let mut r = DeviceReport {
        index: row.index,
        name: row.name.clone(),
        backend: row.backend.clone(),
        software: row.software,
        selected: row.selected,
        passed: false,
        error: None,
        matmul_size,
        matmul_gflops: None,
        copy_mib: (copy_elems * 4) >> 20,
        copy_gbps: None,
    };
    let dev = match opened {
        Ok(d) => d,
        Err(e) => {
            r.error = Some(format!("device creation failed: {e}"));
            return r;
        }
    };
    match smoke(&dev).and_then(|()| bench(&dev, matmul_size, copy_elems)) {
        Ok((gflops, gbps)) => {
            r.passed = true;
            r.matmul_gflops = Some(gflops);
            r.copy_gbps = Some(gbps);
        }
        Err(e) => r.error = Some(e),
    }
    r
}

/// Runs kernels of each family on odd sizes and checks them against the CPU reference.
fn smoke(dev: &Device) -> Result<(), String> {
    let e = |e: anygpu_core::Error| e.to_string();
    let a = rand_vec(1, 67 * 129);
    let b = rand_vec(2, 129 * 33);
    let run = |d: &Device| -> anygpu_core::Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let ta = Tensor::from_slice(&a, [67, 129], d)?;
        let tb = Tensor::from_slice(&b, [129, 33], d)?;
        let mm = ta.matmul(&tb)?.to_vec_f32()?;
        let ew = ta.affine(2.0, 0.5)?.add(&ta)?.to_vec_f32()?;
        let red = ta.sum(1)?.to_vec_f32()?;
        Ok((mm, ew, red))
    };
    let (mm, ew, red) = run(dev).map_err(|err| format!("kernel failed: {}", e(err)))?;
    let (mm0, ew0, red0) = run(&Device::Cpu).map_err(e)?;
    check_close("matmul", &mm, &mm0, 1e-3, 1e-3)
        .and_then(|()| check_close("elementwise", &ew, &ew0, 1e-5, 1e-5))
        .and_then(|()| check_close("sum", &red, &red0, 1e-3, 1e-4))
        .map_err(|m| format!("wrong result: {m}"))
}

/// Times a square matmul and a read+write pass over `copy_elems` floats; returns
/// (GFLOP/s, GB/s), each the best of a few runs after a warm-up.
fn bench(dev: &Device, n: usize, copy_elems: usize) -> Result<(f64, f64), String> {
    let e = |e: anygpu_core::Error| e.to_string();
    let a = Tensor::from_vec(rand_vec(3, n * n), [n, n], &Device::Cpu).and_then(|t| t.to_device(dev)).map_err(e)?;
    let x = Tensor::zeros([copy_elems], anygpu_core::DType::F32, dev).map_err(e)?;
    let time = |f: &dyn Fn() -> anygpu_core::Result<Tensor>, reps: usize| -> Result<f64, String> {
        let mut keep = Vec::new();
        keep.push(f().map_err(e)?); // warm-up (compiles the pipeline)
        dev.sync().map_err(e)?;
        let mut best = f64::MAX;
        for _ in 0..3 {
            keep.clear();
            let t0 = Instant::now();
            for _ in 0..reps {
                keep.push(f().map_err(e)?);
            }
            dev.sync().map_err(e)?;
            best = best.min(t0.elapsed().as_secs_f64() / reps as f64);
        }
        Ok(best)
    };
    let mm = time(&|| a.matmul(&a), 5)?;
    let copy = time(&|| x.affine(1.0, 0.0), 5)?;
    Ok((2.0 * (n as f64).powi(3) / mm / 1e9, 2.0 * copy_elems as f64 * 4.0 / copy / 1e9))
}

fn hints(d: &Discovery, reports: &[DeviceReport]) -> Vec<String> {
    let mut h = Vec::new();
    let hardware: Vec<&DeviceInfo> = d.rows.iter().filter(|r| r.backend != "cpu" && !r.software).collect();
    if hardware.is_empty() {
        h.push(if d.entries.is_empty() {
            "no GPU adapter is visible at all. Install a Vulkan driver (Mesa: apt-get install mesa-vulkan-drivers; NVIDIA/AMD/Intel: the vendor's driver) and the Vulkan loader (libvulkan1).".to_string()
        } else {
            "only software adapters are visible (llvmpipe/lavapipe, SwiftShader, WARP): they are slower than anygpu's CPU backend, so the CPU is used.".to_string()
        });
        h.extend(platform_hints());
    }
    for r in reports.iter().filter(|r| !r.passed && r.backend != "cpu") {
        let err = r.error.as_deref().unwrap_or("");
        if r.backend == "gl" {
            h.push(format!(
                "adapter [{}] {} on GL cannot run compute kernels (compute shaders need GL 4.3 / GLES 3.1; this driver {}). Use its Vulkan adapter instead (ANYGPU_BACKEND=vulkan).",
                r.index,
                r.name,
                d.rows.get(r.index).map(|row| format!("reports {}", row.driver_info)).unwrap_or_default()
            ));
        } else if err.starts_with("device creation failed") {
            h.push(format!(
                "adapter [{}] {} ({}) was found but refused to create a device. Update the driver, or pick another adapter with --device; with ANYGPU_PROFILE=webgpu anygpu asks for fewer limits and features.",
                r.index, r.name, r.backend
            ));
        } else {
            h.push(format!(
                "adapter [{}] {} ({}) failed the smoke test: {err}. Please report it with the output of `anygpu devices --json`.",
                r.index, r.name, r.backend
            ));
        }
    }
    h
}

/// Linux-specific checks: device nodes, groups, Vulkan ICD files (WSL2's Dozen, Turnip).
fn platform_hints() -> Vec<String> {
    let mut h = Vec::new();
    if !cfg!(target_os = "linux") {
        return h;
    }
    let exists = |p: &str| std::path::Path::new(p).exists();
    let icd_dirs = ["/usr/share/vulkan/icd.d", "/etc/vulkan/icd.d", "/usr/local/share/vulkan/icd.d"];
    let icds: Vec<String> = icd_dirs
        .iter()
        .filter_map(|d| std::fs::read_dir(d).ok())
        .flatten()
        .filter_map(|e| e.ok().map(|e| e.path().display().to_string()))
        .collect();
    let env_icd = std::env::var("VK_DRIVER_FILES").or_else(|_| std::env::var("VK_ICD_FILENAMES")).ok();
    if exists("/dev/dxg") {
        let dzn = icds.iter().find(|p| p.contains("dzn"));
        h.push(match dzn {
            Some(p) => format!(
                "WSL2 detected (/dev/dxg). Mesa's Dozen driver is installed ({p}) but produced no hardware adapter: point the loader at it with `export VK_DRIVER_FILES={p}`, and make sure Mesa is >= 23 (older Dozen builds lack compute features)."
            ),
            None => "WSL2 detected (/dev/dxg) but Mesa's Dozen Vulkan driver (dzn_icd.*.json) is not installed. Install a Mesa build with the d3d12/Dozen driver (e.g. Ubuntu 24.04's mesa-vulkan-drivers, or the kisak-mesa PPA), then `export VK_DRIVER_FILES=/usr/share/vulkan/icd.d/dzn_icd.x86_64.json`.".into(),
        });
    } else if !exists("/dev/dri") {
        h.push("/dev/dri is missing: no kernel GPU driver is loaded here (in a container, pass the device through, e.g. `docker run --device /dev/dri`).".into());
    } else {
        let render_nodes: Vec<String> = std::fs::read_dir("/dev/dri")
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .map(|e| e.path().display().to_string())
                    .filter(|p| p.contains("renderD"))
                    .collect()
            })
            .unwrap_or_default();
        let denied: Vec<&String> = render_nodes
            .iter()
            .filter(|p| std::fs::OpenOptions::new().read(true).write(true).open(p).is_err())
            .collect();
        if !denied.is_empty() {
            h.push(format!(
                "you cannot open {}: add yourself to the render and video groups (`sudo usermod -aG render,video $USER`, then log in again).",
                denied.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
            ));
        }
        let hw_icds: Vec<&String> = icds.iter().filter(|p| !p.contains("lvp")).collect();
        if hw_icds.is_empty() {
            h.push("no hardware Vulkan driver (ICD) is installed: apt-get install mesa-vulkan-drivers (AMD radv, Intel anv, Qualcomm Turnip/freedreno) or your vendor's driver.".into());
        } else {
            h.push(format!(
                "hardware Vulkan ICDs are installed ({}) but none produced an adapter: check that the kernel driver for your GPU is loaded (lsmod), or point the loader at one ICD with `export VK_DRIVER_FILES=/path/to/icd.json` (on Snapdragon Linux: freedreno_icd.*.json for Turnip).",
                hw_icds.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
            ));
        }
    }
    if let Some(v) = env_icd {
        h.push(format!("VK_DRIVER_FILES/VK_ICD_FILENAMES is set to {v}: make sure it names an ICD json for your hardware, or unset it."));
    }
    h
}
