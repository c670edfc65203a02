//! The parity harness: a test body is written once and runs on every available device
//! against the CPU reference (candle's `test_device!`, ggml's `test-backend-ops`).
//!
//! Devices under test: every adapter wgpu finds, software rasterizers included (that is how
//! CI without a GPU runs the WGSL for real, on lavapipe), each GPU also under the WebGPU
//! default-limits profile. `ANYGPU_REQUIRE_GPU=1` turns "no adapter found" into a failure.
//! `ANYGPU_TEST_DEVICES=N` keeps only the first N adapters (quicker local runs).

use std::sync::OnceLock;

use crate::device::{discovery, Device};
use crate::error::Result;

/// Sizes every parity test covers: 1, primes, and sizes around workgroup multiples.
pub const ODD_SIZES: [usize; 6] = [1, 7, 64, 257, 1000, 4099];

/// The GPU devices to test on (opened once per test binary).
pub fn gpu_devices() -> &'static [Device] {
    static DEVICES: OnceLock<Vec<Device>> = OnceLock::new();
    DEVICES.get_or_init(|| {
        let instance = discovery::instance();
        let mut entries = discovery::enumerate(&instance);
        if let Some(n) = std::env::var("ANYGPU_TEST_DEVICES").ok().and_then(|v| v.parse::<usize>().ok()) {
            entries.truncate(n);
        }
        let mut out = Vec::new();
        for e in &entries {
            for constrained in [false, true] {
                match Device::open_adapter(e, constrained) {
                    Ok(d) => {
                        eprintln!("[anygpu test] device: {}", d.name());
                        out.push(d)
                    }
                    Err(err) => eprintln!("[anygpu test] skipping adapter {} ({}): {err}", e.info.name, e.info.backend),
                }
            }
        }
        if out.is_empty() && require_gpu() {
            panic!(
                "ANYGPU_REQUIRE_GPU=1 but no GPU adapter could be opened. On a machine without a GPU install \
                 Mesa's lavapipe: apt-get install -y mesa-vulkan-drivers"
            );
        }
        out
    })
}

pub fn require_gpu() -> bool {
    std::env::var("ANYGPU_REQUIRE_GPU").map(|v| v == "1" || v.eq_ignore_ascii_case("true")).unwrap_or(false)
}

/// Deterministic pseudo-random values in [-1, 1) (xorshift; tests need no RNG crate).
pub fn rand_vec(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Checks `got` against `want` elementwise: |g - w| <= atol + rtol * |w|, NaN/inf must match.
pub fn check_close(what: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) -> std::result::Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{what}: length {} != reference {}", got.len(), want.len()));
    }
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = if w.is_nan() {
            g.is_nan()
        } else if w.is_infinite() {
            g == w
        } else {
            (g - w).abs() <= atol + rtol * w.abs()
        };
        if !ok {
            return Err(format!("{what}: element {i}: got {g}, reference {w} (atol {atol}, rtol {rtol})"));
        }
    }
    Ok(())
}

/// Runs `body` on the CPU (the reference) and on every GPU device, and compares.
/// `body` returns the values to compare; an `Err` from a GPU where the CPU succeeded fails.
pub fn parity(name: &str, atol: f32, rtol: f32, body: impl Fn(&Device) -> Result<Vec<f32>>) {
    let want = body(&Device::Cpu).unwrap_or_else(|e| panic!("{name}: CPU reference failed: {e}"));
    let devices = gpu_devices();
    for d in devices {
        let got = body(d).unwrap_or_else(|e| panic!("{name} on {}: {e}", d.name()));
        if let Err(msg) = check_close(name, &got, &want, atol, rtol) {
            panic!("{msg} on {}", d.name());
        }
    }
}

/// Runs `body` on every GPU device and expects the same error kind as the CPU reference
/// (a message containing `needle` on each).
pub fn parity_err<T>(name: &str, needle: &str, body: impl Fn(&Device) -> Result<T>) {
    for d in std::iter::once(&Device::Cpu).chain(gpu_devices()) {
        match body(d) {
            Ok(_) => panic!("{name} on {}: expected an error containing {needle:?}, got Ok", d.name()),
            Err(e) => assert!(
                e.to_string().contains(needle),
                "{name} on {}: error {e:?} does not contain {needle:?}",
                d.name()
            ),
        }
    }
}

/// Parses, validates (with `caps`) and translates one WGSL module to SPIR-V the way wgpu does
/// for Vulkan: the offline check of kernels a test machine cannot run (cooperative matrices on
/// lavapipe, say). Errors carry naga's rendering of the problem.
pub fn validate_wgsl_for_vulkan(src: &str, caps: wgpu::naga::valid::Capabilities) -> std::result::Result<(), String> {
    use wgpu::naga;
    let module = naga::front::wgsl::parse_str(src).map_err(|e| e.emit_to_string(src))?;
    let mut v = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), caps);
    v.subgroup_stages(naga::valid::ShaderStages::COMPUTE);
    v.subgroup_operations(naga::valid::SubgroupOperationSet::all());
    let info = v.validate(&module).map_err(|e| e.emit_to_string(src))?;
    let opts = naga::back::spv::Options {
        lang_version: (1, 6),
        bounds_check_policies: naga::proc::BoundsCheckPolicies {
            index: naga::proc::BoundsCheckPolicy::Restrict,
            buffer: naga::proc::BoundsCheckPolicy::Restrict,
            ..Default::default()
        },
        force_loop_bounding: true,
        ..Default::default()
    };
    naga::back::spv::write_vec(&module, &info, &opts, None).map_err(|e| format!("SPIR-V: {e:?}"))?;
    Ok(())
}
