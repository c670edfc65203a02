//! Parity tests for the matmul paths (simple, tiled, f16, coop) against the CPU reference, on
//! odd shapes, transposed and offset views, batches, bias, and f16 data; plus offline
//! validation of every kernel specialisation with naga (the coop kernel cannot run on
//! lavapipe, but it must parse, validate and translate to SPIR-V).

use anygpu_core::ops::matmul::{
    blocked_wgsl_variants, gpu_matmul_path, gpu_matmul_supports, gpu_matmul_using, MatmulPath,
};
use anygpu_core::ops::unary::UnaryOp;
use anygpu_core::testing::{check_close, gpu_devices, parity, parity_err, rand_vec, validate_wgsl_for_vulkan};
use anygpu_core::{DType, Device, Result, Tensor};
use half::f16;
use wgpu::naga;

/// Tests of this file take turns on the devices: wgpu's GL backend gives up (panics) when its
/// context stays locked by another thread for 6 s, which slow software rasterizers on a
/// loaded machine reach.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A random tensor of `dims` on `d`, f32 or f16 (the f16 values are what both sides see).
fn t(seed: u64, dims: &[usize], dtype: DType, d: &Device) -> Tensor {
    let v = rand_vec(seed, dims.iter().product());
    let host = match dtype {
        DType::F16 => Tensor::from_vec(v.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>(), dims, &Device::Cpu),
        _ => Tensor::from_vec(v, dims, &Device::Cpu),
    };
    host.and_then(|t| t.to_device(d)).expect("upload")
}

/// `a x b (+ bias)` on the CPU reference, or on a GPU through `path` when that path can run it
/// there (otherwise through the default choice, e.g. `f16` under the WebGPU profile).
fn mm(d: &Device, a: &Tensor, b: &Tensor, bias: Option<&Tensor>, path: MatmulPath) -> Result<Vec<f32>> {
    let out = if !d.is_cpu() && gpu_matmul_supports(a, b, path)? {
        gpu_matmul_using(a, b, bias, path)?
    } else if let Some(bias) = bias {
        a.matmul_bias(b, bias)?
    } else {
        a.matmul(b)?
    };
    let want = if a.dtype() == DType::F16 && b.dtype() == DType::F16 { DType::F16 } else { DType::F32 };
    assert_eq!(out.dtype(), want, "output dtype of {} x {}", a.dtype(), b.dtype());
    out.to_vec_f32()
}

/// Tolerances: f32 accumulation differs from the reference's order by ~1e-4 sqrt(K); an f16
/// output may round to the neighbouring f16 (2^-10 relative).
fn tol(k: usize, out_f16: bool) -> (f32, f32) {
    let atol = 1e-4 * (k as f32).sqrt() + 1e-5;
    if out_f16 {
        (atol + 1e-3, 2e-3)
    } else {
        (atol, 1e-4)
    }
}

const SHAPES: [(usize, usize, usize); 7] =
    [(1, 1, 1), (7, 13, 5), (65, 257, 33), (129, 64, 200), (130, 37, 131), (3, 300, 260), (33, 1000, 65)];

/// The operand layouts every path is checked on: plain, A^T, B^T (weights stored [N, K]),
/// both, and offset views whose rows are not 4-aligned (scalar loads).
#[derive(Clone, Copy, Debug)]
enum View {
    Plain,
    TransA,
    TransB,
    TransBoth,
    Offset,
}

const VIEWS: [View; 5] = [View::Plain, View::TransA, View::TransB, View::TransBoth, View::Offset];

fn operands(v: View, m: usize, k: usize, n: usize, da: DType, db: DType, d: &Device) -> Result<(Tensor, Tensor)> {
    Ok(match v {
        View::Plain => (t(1, &[m, k], da, d), t(2, &[k, n], db, d)),
        View::TransA => (t(3, &[k, m], da, d).transpose(0, 1)?, t(4, &[k, n], db, d)),
        View::TransB => (t(5, &[m, k], da, d), t(6, &[n, k], db, d).transpose(0, 1)?),
        View::TransBoth => (t(7, &[k, m], da, d).transpose(0, 1)?, t(8, &[n, k], db, d).transpose(0, 1)?),
        View::Offset => {
            (t(9, &[m, k + 3], da, d).narrow(1, 1, k)?, t(10, &[k + 1, n + 2], db, d).narrow(0, 1, k)?.narrow(1, 2, n)?)
        }
    })
}

#[test]
fn f32_paths_on_odd_shapes_and_views() {
    let _turn = serial();
    for &(m, k, n) in &SHAPES {
        let (atol, rtol) = tol(k, false);
        for v in VIEWS {
            for path in [MatmulPath::Simple, MatmulPath::Tiled] {
                let name = format!("matmul f32 {m}x{k}x{n} {v:?} {}", path.name());
                parity(&name, atol, rtol, |d| {
                    let (a, b) = operands(v, m, k, n, DType::F32, DType::F32, d)?;
                    mm(d, &a, &b, None, path)
                });
            }
        }
    }
}

#[test]
fn f16_paths_on_odd_shapes_and_views() {
    let _turn = serial();
    let pairs = [(DType::F16, DType::F16), (DType::F32, DType::F16), (DType::F16, DType::F32)];
    for &(m, k, n) in &[(7, 13, 5), (65, 257, 33), (130, 36, 131)] {
        for (da, db) in pairs {
            let (atol, rtol) = tol(k, da == DType::F16 && db == DType::F16);
            for v in [View::Plain, View::TransA, View::TransB, View::Offset] {
                for path in [MatmulPath::Tiled, MatmulPath::TiledF16] {
                    let name = format!("matmul {da}x{db} {m}x{k}x{n} {v:?} {}", path.name());
                    parity(&name, atol, rtol, |d| {
                        let (a, b) = operands(v, m, k, n, da, db, d)?;
                        mm(d, &a, &b, None, path)
                    });
                }
            }
        }
    }
}

/// The tensor-core path against the CPU reference on the devices that have it (an H100 under
/// Vulkan): odd shapes, every contiguous view, mixed f32/f16 operands, a batch, a shared
/// operand and a bias. Devices without cooperative matrices (lavapipe) are skipped with a note:
/// their f16 paths are checked above, and the kernel's WGSL is validated for every
/// specialisation below.
#[test]
fn coop_path_where_the_device_has_it() {
    let _turn = serial();
    let (h, f, c) = (DType::F16, DType::F32, MatmulPath::Coop);
    let mut checked = 0;
    for d in gpu_devices() {
        let probe = (t(1, &[64, 64], h, d), t(2, &[64, 64], h, d));
        if !gpu_matmul_supports(&probe.0, &probe.1, c).unwrap() {
            eprintln!("{}: no cooperative matrices, coop path not checked here", d.name());
            continue;
        }
        let check = |name: &str, atol: f32, rtol: f32, body: &dyn Fn(&Device) -> Result<Vec<f32>>| {
            let want = body(&Device::Cpu).unwrap_or_else(|e| panic!("{name}: CPU reference failed: {e}"));
            let got = body(d).unwrap_or_else(|e| panic!("{name} on {}: {e}", d.name()));
            check_close(name, &got, &want, atol, rtol).unwrap_or_else(|m| panic!("{m} on {}", d.name()));
        };
        for &(m, k, n) in &[
            (1, 16, 16),
            (7, 13, 5),
            (65, 257, 33),
            (129, 64, 200),
            (130, 37, 131),
            (33, 1000, 65),
            (256, 384, 1536),
            (130, 96, 136),
            (200, 8, 64),
        ] {
            for (da, db) in [(h, h), (f, h), (h, f)] {
                // An f32 operand is rounded to f16 on the coop path: each product then carries
                // a relative error up to 2^-11, ~2^-11 sqrt(K) over a random-signed sum of K of
                // them (|a|, |b| < 1 here); f16 x f16 outputs round once more.
                let (atol, rtol) = if da == db { tol(k, true) } else { (5e-4 * (k as f32).sqrt() + 1e-4, 1e-3) };
                for v in VIEWS {
                    check(&format!("matmul coop {da}x{db} {m}x{k}x{n} {v:?}"), atol, rtol, &|d| {
                        let (a, b) = operands(v, m, k, n, da, db, d)?;
                        mm(d, &a, &b, None, c)
                    });
                }
            }
        }
        let (atol, rtol) = tol(129, true);
        check("coop batched", atol, rtol, &|d| {
            mm(d, &t(50, &[3, 2, 33, 129], h, d), &t(51, &[3, 2, 129, 70], h, d), None, c)
        });
        check("coop batched x shared", atol, rtol, &|d| {
            mm(d, &t(52, &[4, 70, 129], h, d), &t(53, &[129, 33], h, d), None, c)
        });
        // The activation epilogue (BERT's FFN: f32 tokens x f16 weights, GELU) against the
        // CPU's product then unary op.
        for act in [UnaryOp::GeluErf, UnaryOp::Silu, UnaryOp::Relu] {
            for &(m, k, n) in &[(130, 96, 136), (65, 37, 33)] {
                let (atol, rtol) = (5e-4 * (k as f32).sqrt() + 1e-4, 1e-3);
                check(&format!("coop {act:?} epilogue {m}x{k}x{n}"), atol, rtol, &|d| {
                    let bias = t(57, &[n], DType::F32, d);
                    t(58, &[m, k], f, d).matmul_bias_act(&t(59, &[k, n], h, d), &bias, act)?.to_vec_f32()
                });
            }
        }
        check("coop bias", atol, rtol, &|d| {
            let bias = t(54, &[131], DType::F32, d).narrow(0, 1, 130)?;
            mm(d, &t(55, &[129, 129], h, d), &t(56, &[129, 130], h, d), Some(&bias), c)
        });
        checked += 1;
    }
    eprintln!("coop path checked on {checked} device(s)");
}

#[test]
fn bias_of_each_dtype_on_each_path() {
    let _turn = serial();
    let cases = [
        (DType::F32, DType::F32, MatmulPath::Simple),
        (DType::F32, DType::F32, MatmulPath::Tiled),
        (DType::F16, DType::F16, MatmulPath::Tiled),
        (DType::F16, DType::F16, MatmulPath::TiledF16),
        (DType::F32, DType::F16, MatmulPath::TiledF16),
    ];
    for (da, db, path) in cases {
        for bias_dtype in [DType::F32, DType::F16] {
            for &(m, k, n) in &[(7, 13, 5), (129, 40, 132)] {
                let (atol, rtol) = tol(k, da == DType::F16 && db == DType::F16);
                let name = format!("matmul+bias({bias_dtype}) {da}x{db} {m}x{k}x{n} {}", path.name());
                parity(&name, atol, rtol, |d| {
                    let (a, b) = (t(20, &[m, k], da, d), t(21, &[k, n], db, d));
                    // A bias view with an offset: the kernels read it from its layout.
                    let bias = t(22, &[n + 1], bias_dtype, d).narrow(0, 1, n)?;
                    mm(d, &a, &b, Some(&bias), path)
                });
            }
        }
    }
}

#[test]
fn batched_and_shared_operands() {
    let _turn = serial();
    for path in [MatmulPath::Simple, MatmulPath::Tiled, MatmulPath::TiledF16] {
        for (da, db) in [(DType::F32, DType::F32), (DType::F16, DType::F16)] {
            let (atol, rtol) = tol(33, da == DType::F16);
            let p = path.name();
            parity(&format!("batched {da} {p}"), atol, rtol, |d| {
                mm(d, &t(30, &[3, 2, 9, 33], da, d), &t(31, &[3, 2, 33, 130], db, d), None, path)
            });
            parity(&format!("batched x shared {da} {p}"), atol, rtol, |d| {
                mm(d, &t(32, &[4, 7, 33], da, d), &t(33, &[33, 5], db, d), None, path)
            });
            parity(&format!("shared x batched {da} {p}"), atol, rtol, |d| {
                mm(d, &t(34, &[130, 33], da, d), &t(35, &[2, 33, 6], db, d), None, path)
            });
            // Attention-like: per-head products of a permuted view ([B, T, H, D] -> [B, H, T, D]).
            parity(&format!("batched permuted {da} {p}"), atol, rtol, |d| {
                let q = t(36, &[2, 65, 3, 12], da, d).permute(&[0, 2, 1, 3])?;
                let kt = t(37, &[2, 3, 12, 70], db, d);
                mm(d, &q, &kt, None, path)
            });
        }
    }
}

/// `matmul_bias_act` on every device: fused into the coop kernel where it runs (checked in
/// `coop_path_where_the_device_has_it`), else the product then the unary op.
#[test]
fn matmul_bias_act_matches_composition() {
    let _turn = serial();
    for act in [UnaryOp::GeluErf, UnaryOp::Silu] {
        for (da, db) in [(DType::F32, DType::F32), (DType::F32, DType::F16)] {
            let (atol, rtol) = (5e-4 * 8.0 + 1e-4, 1e-3);
            parity(&format!("matmul_bias_act {act:?} {da}x{db}"), atol, rtol, |d| {
                let bias = t(60, &[70], DType::F32, d);
                t(61, &[33, 64], da, d).matmul_bias_act(&t(62, &[64, 70], db, d), &bias, act)?.to_vec_f32()
            });
        }
    }
}

#[test]
fn auto_choice_matches_the_reference() {
    let _turn = serial();
    for (da, db) in [(DType::F32, DType::F32), (DType::F16, DType::F16), (DType::F32, DType::F16)] {
        for &(m, k, n) in &[(1, 64, 300), (200, 70, 256), (128, 128, 128)] {
            // f32 x f16 takes the coop path where the device has it, rounding the f32 operand
            // to f16 (the tolerance of `coop_path_where_the_device_has_it`).
            let (atol, rtol) = if da != db {
                (5e-4 * (k as f32).sqrt() + 1e-4, 1e-3)
            } else {
                tol(k, da == DType::F16 && db == DType::F16)
            };
            parity(&format!("auto {da}x{db} {m}x{k}x{n}"), atol, rtol, |d| {
                let (a, b) = (t(40, &[m, k], da, d), t(41, &[k, n], db, d));
                a.matmul(&b)?.to_vec_f32()
            });
        }
    }
}

#[test]
fn path_report_and_support() {
    let _turn = serial();
    for d in gpu_devices() {
        let ctx = d.gpu().expect("gpu");
        let (a, b) = (t(1, &[256, 64], DType::F32, d), t(2, &[64, 256], DType::F32, d));
        let path = gpu_matmul_path(&a, &b, None).expect("path");
        eprintln!("{}: f32 256x64x256 -> {path}", d.name());
        // `simple` only when forced: `tiled` beat it at every shape measured, M = 1 included.
        let forced = std::env::var("ANYGPU_MATMUL").is_ok();
        assert!(path == "tiled" || forced, "{path}");
        let (pool_w, hidden) = (t(3, &[4, 1, 9], DType::F32, d), t(4, &[4, 9, 24], DType::F32, d));
        let small = gpu_matmul_path(&pool_w, &hidden, None).expect("path");
        assert!(small == "tiled" || forced, "[4, 1, 9] x [4, 9, 24] -> {small}");
        let (h, g) = (t(1, &[256, 64], DType::F16, d), t(2, &[64, 256], DType::F16, d));
        let path = gpu_matmul_path(&h, &g, None).expect("path");
        eprintln!("{}: f16 256x64x256 -> {path}", d.name());
        assert!(gpu_matmul_supports(&a, &b, MatmulPath::Simple).unwrap());
        assert!(!gpu_matmul_supports(&h, &g, MatmulPath::Simple).unwrap());
        assert_eq!(gpu_matmul_supports(&h, &g, MatmulPath::TiledF16).unwrap(), ctx.caps.shader_f16);
        assert_eq!(
            gpu_matmul_supports(&h, &g, MatmulPath::Coop).unwrap(),
            ctx.caps.cooperative_matrix && ctx.caps.coop_f16_f32_shapes.contains(&(16, 16, 16))
        );
        // Asking for a path that cannot run is an error, not a silent fallback.
        let e = gpu_matmul_using(&h, &g, None, MatmulPath::Simple).unwrap_err().to_string();
        assert!(e.contains("simple path cannot run"), "{e}");
    }
    for p in MatmulPath::ALL {
        assert_eq!(MatmulPath::parse(p.name()), Some(p));
    }
}

#[test]
fn errors_name_the_op_and_shapes() {
    let _turn = serial();
    parity_err("matmul inner mismatch", "inner dimensions differ", |d| {
        t(1, &[2, 3], DType::F16, d).matmul(&t(2, &[4, 5], DType::F16, d))
    });
    parity_err("matmul bias mismatch", "does not match N=5", |d| {
        t(1, &[2, 3], DType::F32, d).matmul_bias(&t(2, &[3, 5], DType::F32, d), &t(3, &[4], DType::F32, d))
    });
    parity_err("matmul i32", "no kernel for", |d| {
        let a = Tensor::from_vec(vec![1i32; 6], [2, 3], &Device::Cpu)?.to_device(d)?;
        a.matmul(&a.transpose(0, 1)?)
    });
}

#[test]
fn every_kernel_specialisation_validates_with_naga() {
    let _turn = serial();
    use naga::valid::Capabilities as C;
    let variants = blocked_wgsl_variants();
    assert!(variants.iter().any(|(_, p, _)| *p == MatmulPath::Coop));
    for (label, path, src) in &variants {
        // The portable path needs no optional feature: only unpack2x16float's capability,
        // which wgpu grants on every backend with compute shaders (a downlevel flag, not a
        // feature). The f16 path adds SHADER_F16; coop also cooperative matrices and subgroups.
        let base = C::SHADER_FLOAT16_IN_FLOAT32;
        let caps = match path {
            MatmulPath::Coop => base | C::SHADER_FLOAT16 | C::COOPERATIVE_MATRIX | C::SUBGROUP,
            MatmulPath::TiledF16 => base | C::SHADER_FLOAT16,
            _ => base,
        };
        if let Err(e) = validate_wgsl_for_vulkan(src, caps) {
            panic!("{label}:\n{e}");
        }
    }
    eprintln!("{} specialisations validated", variants.len());
}

#[test]
#[ignore]
fn probe() {
    let only: usize = std::env::var("PROBE_DEV").ok().and_then(|v| v.parse().ok()).unwrap_or(2);
    let d = &gpu_devices()[only];
    let pairs = [(DType::F16, DType::F32), (DType::F32, DType::F32)];
    for &(m, k, n) in &[(7, 13, 5), (65, 257, 33), (130, 36, 131)] {
        for (da, db) in pairs {
            for v in [View::Plain, View::TransA, View::TransB, View::Offset] {
                eprintln!("start {da}x{db} {m}x{k}x{n} {v:?}");
                let t0 = std::time::Instant::now();
                let (a, b) = operands(v, m, k, n, da, db, d).unwrap();
                let _ = mm(d, &a, &b, None, MatmulPath::Tiled).unwrap();
                eprintln!("  {:?}", t0.elapsed());
            }
        }
    }
}

#[test]
#[ignore]
fn dump_glsl() {
    let want = std::env::var("VARIANT").unwrap();
    for (label, _, src) in blocked_wgsl_variants() {
        if label != want {
            continue;
        }
        let module = naga::front::wgsl::parse_str(&src).unwrap();
        let mut v = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), naga::valid::Capabilities::all());
        let info = v.validate(&module).unwrap();
        let opts = naga::back::glsl::Options { version: naga::back::glsl::Version::Desktop(430), ..Default::default() };
        let popts = naga::back::glsl::PipelineOptions {
            shader_stage: naga::ShaderStage::Compute,
            entry_point: "matmul".into(),
            multiview: None,
        };
        let mut out = String::new();
        let policies = naga::proc::BoundsCheckPolicies {
            index: naga::proc::BoundsCheckPolicy::Restrict,
            buffer: naga::proc::BoundsCheckPolicy::Restrict,
            ..Default::default()
        };
        let mut w = naga::back::glsl::Writer::new(&mut out, &module, &info, &opts, &popts, policies).unwrap();
        w.write().unwrap();
        std::fs::write("/tmp/mm/dump.glsl", &out).unwrap();
        std::fs::write("/tmp/mm/dump.wgsl", &src).unwrap();
    }
}

#[test]
#[ignore]
fn probe_gl_compile() {
    let d = &gpu_devices()[2];
    let ctx = d.gpu().unwrap();
    let variants: &[(&str, &str)] = &[
        ("vec4x1024", "var<workgroup> s: array<vec4<f32>, 1024>;\n@group(0) @binding(1) var<storage, read_write> o: array<f32>;\n@compute @workgroup_size(256) fn main(@builtin(local_invocation_index) i: u32) { s[i] = vec4<f32>(f32(i)); workgroupBarrier(); o[i] = s[(i + 1u) % 1024u].x; }"),
        ("f32x4096", "var<workgroup> s: array<f32, 4096>;\n@group(0) @binding(1) var<storage, read_write> o: array<f32>;\n@compute @workgroup_size(256) fn main(@builtin(local_invocation_index) i: u32) { s[i] = f32(i); workgroupBarrier(); o[i] = s[(i + 1u) % 4096u]; }"),
        ("f32x1024", "var<workgroup> s: array<f32, 1024>;\n@group(0) @binding(1) var<storage, read_write> o: array<f32>;\n@compute @workgroup_size(256) fn main(@builtin(local_invocation_index) i: u32) { s[i] = f32(i); workgroupBarrier(); o[i] = s[(i + 1u) % 1024u]; }"),
    ];
    for (name, src) in variants {
        let t0 = std::time::Instant::now();
        let src: &'static str = Box::leak(src.to_string().into_boxed_str());
        let p = ctx.pipeline(&anygpu_core::gpu::KernelSpec::new(*name, src, "main"), &[]).unwrap();
        p.get().unwrap(); // compiled on a worker thread: wait for it
        let t1 = t0.elapsed();
        let out = Tensor::zeros([256], DType::F32, d).unwrap();
        ctx.dispatch(&p, "probe", &[], &[anygpu_core::gpu::Bind::Whole(out.gpu_buffer().unwrap())], [1, 1, 1]).unwrap();
        let _ = out.to_vec_f32().unwrap();
        eprintln!("{name}: pipeline {t1:?}, first run {:?}", t0.elapsed());
    }
}
