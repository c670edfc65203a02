//! GPU kernels that read GGML blocks as stored (quant/gpu.rs) against the CPU QTensor path:
//! `qmatmul` for decode (n = 1) and prefill (n > 1) with both kernels forced on every shape,
//! `gather_rows` (embeddings), the row-sliced binding path, and input views.
//!
//! The decode benchmark is ignored by default (run it on a real GPU):
//! `cargo test --release -p anygpu-core --test parity_qmatmul -- --ignored --nocapture bench`

use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use anygpu_core::quant::gpu::{
    gather_rows_opts, qmatmul_opts, QKernel, QOptions, MATVEC_MAX_N, NORM_PROLOGUE_MAX_COLS,
};
use anygpu_core::quant::{dequantize_to_vec, GgmlType, QTensor, RmsNorm};
use anygpu_core::testing::{check_close, gpu_devices, parity, parity_err, rand_vec};
use anygpu_core::{Device, Result, Tensor};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Byte offsets of each block's f16 scale fields, overwritten with sane values so random
/// blocks decode to finite weights.
fn f16_fields(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q2K => &[80, 82],
        GgmlType::Q3K => &[108],
        GgmlType::Q6K => &[208],
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => &[],
    }
}

/// Random, valid bytes for a [rows, cols] matrix of `ty`.
fn random_weights(seed: u64, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed);
    let n = rows * cols;
    let mut out = Vec::with_capacity(ty.byte_size(n as u64).unwrap() as usize);
    match ty {
        GgmlType::F32 => (0..n).for_each(|_| out.extend(rng.random_range(-1.0f32..1.0).to_le_bytes())),
        GgmlType::F16 => (0..n).for_each(|_| out.extend(f16::from_f32(rng.random_range(-1.0f32..1.0)).to_le_bytes())),
        GgmlType::BF16 => (0..n).for_each(|_| out.extend(bf16::from_f32(rng.random_range(-1.0f32..1.0)).to_le_bytes())),
        _ => {
            let ts = ty.type_size();
            let mut block = vec![0u8; ts];
            for _ in 0..n / ty.block_size() {
                rng.fill(&mut block[..]);
                for &off in f16_fields(ty) {
                    let s = f16::from_f32(rng.random_range(-0.1f32..0.1));
                    block[off..off + 2].copy_from_slice(&s.to_le_bytes());
                }
                out.extend_from_slice(&block);
            }
        }
    }
    out
}

/// Column counts to test: one block, a few blocks, and 576 (18 Q4 blocks) where it divides;
/// odd counts for the plain float types (F16 rows then start mid-word).
fn col_cases(ty: GgmlType) -> Vec<usize> {
    let bs = ty.block_size();
    match bs {
        1 => vec![1, 7, 576],
        32 => vec![32, 96, 576],
        _ => vec![256, 768],
    }
}

/// Tolerance for a product: f32 sums in another order differ by a few ulps of sum |w x|.
fn atol_for(ty: GgmlType, bytes: &[u8], rows: usize, cols: usize) -> f32 {
    let w = dequantize_to_vec(ty, bytes, rows * cols).unwrap();
    let max_abs_row = w.chunks(cols.max(1)).map(|r| r.iter().map(|v| v.abs()).sum::<f32>()).fold(0f32, f32::max);
    2e-6 * max_abs_row.max(1.0)
}

fn upload_x(seed: u64, n: usize, cols: usize, d: &Device) -> Result<Tensor> {
    Tensor::from_vec(rand_vec(seed, n * cols), [n, cols], &Device::Cpu)?.to_device(d)
}

const TYPES: [GgmlType; 13] = GgmlType::ALL;

/// The tests of this file take turns on the devices: wgpu's GL backend panics when a thread
/// waits over a second for its context lock, which a parallel test compiling a large shader on
/// a loaded llvmpipe can hold that long.
fn one_at_a_time() -> MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::new(());
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn qmatmul_matches_cpu_all_types() {
    let _turn = one_at_a_time();
    for ty in TYPES {
        for cols in col_cases(ty) {
            for rows in [1usize, 7, 33] {
                let bytes = random_weights(ty.id() as u64 * 1000 + (rows * cols) as u64, ty, rows, cols);
                let atol = atol_for(ty, &bytes, rows, cols);
                let name = format!("qmatmul {ty} [{rows}, {cols}]");
                // For each n: the default kernel, then the other one forced (on the CPU both
                // are the CPU product).
                parity(&name, atol, 1e-5, |d| {
                    let w = QTensor::from_vec(ty, rows, cols, bytes.clone(), d)?;
                    let mut all = Vec::new();
                    for n in [1usize, 3, 17] {
                        let x = upload_x(n as u64 + 7, n, cols, d)?;
                        all.extend(w.qmatmul(&x)?.to_vec_f32()?);
                        let forced = if n <= MATVEC_MAX_N { QKernel::Tiled } else { QKernel::Matvec };
                        let y = if d.is_cpu() {
                            w.qmatmul(&x)?
                        } else {
                            qmatmul_opts(&w, &x, QOptions { kernel: Some(forced), ..Default::default() })?
                        };
                        all.extend(y.to_vec_f32()?);
                    }
                    Ok(all)
                });
            }
        }
    }
}

#[test]
fn gather_rows_matches_cpu_all_types() {
    let _turn = one_at_a_time();
    for ty in TYPES {
        for cols in col_cases(ty) {
            let rows = 33;
            let bytes = random_weights(ty.id() as u64 + 99, ty, rows, cols);
            let ids = [0u32, 32, 5, 5, 17, 1];
            parity(&format!("gather_rows {ty} [{rows}, {cols}]"), 1e-6, 1e-6, |d| {
                let w = QTensor::from_vec(ty, rows, cols, bytes.clone(), d)?;
                let mut all = w.gather_rows(&ids)?.to_vec_f32()?;
                all.extend(w.gather_rows(&[])?.to_vec_f32()?);
                all.extend(w.dequantize()?.to_vec_f32()?);
                Ok(all)
            });
        }
    }
}

#[test]
fn gather_rows_out_of_range_is_an_error() {
    let _turn = one_at_a_time();
    let bytes = random_weights(5, GgmlType::Q4_0, 7, 64);
    parity_err("gather_rows out of range", "out of range", |d| {
        QTensor::from_vec(GgmlType::Q4_0, 7, 64, bytes.clone(), d)?.gather_rows(&[0, 7])
    });
}

#[test]
fn qmatmul_shape_errors() {
    let _turn = one_at_a_time();
    let bytes = random_weights(6, GgmlType::Q8_0, 7, 64);
    parity_err("qmatmul wrong cols", "does not match", |d| {
        let w = QTensor::from_vec(GgmlType::Q8_0, 7, 64, bytes.clone(), d)?;
        w.qmatmul(&upload_x(1, 2, 32, d)?)
    });
}

/// Leading dims are kept, and views (an x starting mid-buffer, off the vec4 grid) are read
/// from their offset.
#[test]
fn qmatmul_views_and_batch_dims() {
    let _turn = one_at_a_time();
    for ty in [GgmlType::Q4_0, GgmlType::Q6K, GgmlType::F16, GgmlType::F32] {
        let (rows, cols) = (9, ty.block_size().max(32) * 2 + if ty.is_quantized() { 0 } else { 3 });
        let bytes = random_weights(11, ty, rows, cols);
        let atol = atol_for(ty, &bytes, rows, cols);
        parity(&format!("qmatmul views {ty}"), atol, 1e-5, |d| {
            let w = QTensor::from_vec(ty, rows, cols, bytes.clone(), d)?;
            let x3 = Tensor::from_vec(rand_vec(3, 2 * 3 * cols), [2, 3, cols], &Device::Cpu)?.to_device(d)?;
            let y3 = w.qmatmul(&x3)?;
            assert_eq!(y3.dims(), &[2, 3, rows]);
            let mut all = y3.to_vec_f32()?;
            // One x row at element offset 1 of its buffer, then 5 rows at offset 1.
            for n in [1usize, 5] {
                let flat = Tensor::from_vec(rand_vec(4 + n as u64, n * cols + 1), [n * cols + 1], &Device::Cpu)?;
                let x = flat.to_device(d)?.narrow(0, 1, n * cols)?.reshape([n, cols])?;
                all.extend(w.qmatmul(&x)?.to_vec_f32()?);
            }
            // A transposed (strided) input.
            let xt = Tensor::from_vec(rand_vec(8, cols * 4), [cols, 4], &Device::Cpu)?.to_device(d)?.transpose(0, 1)?;
            all.extend(w.qmatmul(&xt)?.to_vec_f32()?);
            Ok(all)
        });
    }
}

/// The matvec kernel with other invocation counts per row than the default (1 invocation
/// walking a whole row; more invocations than work units).
#[test]
fn matvec_threads_per_row_variants() {
    let _turn = one_at_a_time();
    for ty in [GgmlType::Q4_0, GgmlType::Q5_0, GgmlType::Q4K, GgmlType::Q6K, GgmlType::F16] {
        let (rows, cols) = (7, if ty.block_size() == 256 { 512 } else { 96 + if ty.is_quantized() { 0 } else { 3 } });
        let bytes = random_weights(41, ty, rows, cols);
        let atol = atol_for(ty, &bytes, rows, cols);
        parity(&format!("matvec tpr {ty}"), atol, 1e-5, |d| {
            let w = QTensor::from_vec(ty, rows, cols, bytes.clone(), d)?;
            let x = upload_x(42, 2, cols, d)?;
            let mut all = Vec::new();
            for tpr in [1usize, 2, 64, 256] {
                let y = if d.is_cpu() {
                    w.qmatmul(&x)?
                } else {
                    let opts =
                        QOptions { kernel: Some(QKernel::Matvec), threads_per_row: Some(tpr), ..Default::default() };
                    qmatmul_opts(&w, &x, opts)?
                };
                all.extend(y.to_vec_f32()?);
            }
            Ok(all)
        });
    }
}

/// A tiny binding limit forces the row-sliced path (weights bound at 256-byte-aligned offsets,
/// rows starting mid-binding) and the x-row chunking, for both kernels and the gather.
#[test]
fn row_sliced_bindings_match() {
    let _turn = one_at_a_time();
    for ty in [GgmlType::Q4_0, GgmlType::Q5_1, GgmlType::Q6K, GgmlType::Q3K, GgmlType::F16] {
        let rows = 33;
        let cols = if ty.block_size() == 256 { 512 } else { 96 + if ty.is_quantized() { 0 } else { 1 } };
        let bytes = random_weights(21, ty, rows, cols);
        let atol = atol_for(ty, &bytes, rows, cols);
        let w_cpu = QTensor::from_vec(ty, rows, cols, bytes.clone(), &Device::Cpu).unwrap();
        // About 3 weight rows or 3 x / output rows per binding.
        let limit = 256 + 3 * (w_cpu.row_bytes().max(4 * rows.max(cols))) as u64;
        let ids = [32u32, 0, 16, 3, 31];
        for n in [1usize, 3, 17] {
            let x_cpu = upload_x(31, n, cols, &Device::Cpu).unwrap();
            let want = w_cpu.qmatmul(&x_cpu).unwrap().to_vec_f32().unwrap();
            let want_g = w_cpu.gather_rows(&ids).unwrap().to_vec_f32().unwrap();
            for d in gpu_devices() {
                let w = QTensor::from_vec(ty, rows, cols, bytes.clone(), d).unwrap();
                let x = x_cpu.to_device(d).unwrap();
                for kernel in [QKernel::Matvec, QKernel::Tiled] {
                    let opts = QOptions { kernel: Some(kernel), max_binding: Some(limit), ..Default::default() };
                    let got = qmatmul_opts(&w, &x, opts).and_then(|y| y.to_vec_f32()).unwrap();
                    check_close(&format!("sliced {ty} n={n} {kernel:?}"), &got, &want, atol, 1e-5)
                        .unwrap_or_else(|m| panic!("{m} on {}", d.name()));
                }
                let opts = QOptions { max_binding: Some(limit), ..Default::default() };
                let got = gather_rows_opts(&w, &ids, opts).and_then(|y| y.to_vec_f32()).unwrap();
                check_close(&format!("sliced gather {ty}"), &got, &want_g, 1e-6, 1e-6)
                    .unwrap_or_else(|m| panic!("{m} on {}", d.name()));
            }
        }
    }
}

/// The fused products (quant/fused.rs): row stacks, `qmatmul_add` (residual epilogue),
/// `qmatmul_glu` (SwiGLU epilogue) and the RMSNorm prologue (`qmatmul_rms`, `qmatmul_glu_rms`), on the fused matvec path (n <= MATVEC_MAX_N), the unfused
/// path (n = 17) and, for GLU, a binding limit that forces the unfused path; against the CPU's
/// composition of plain products. Odd row counts; Q4_0 with 18-byte blocks stacks parts at offsets
/// that are not multiples of 4 when a part has an odd number of blocks.
#[test]
fn fused_products_match_composition() {
    let _turn = one_at_a_time();
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q6K, GgmlType::F16, GgmlType::F32] {
        // Odd rows for the float types: the RMSNorm prologue stages them by element.
        let cols = if ty.block_size() == 256 {
            256
        } else if ty.is_quantized() {
            32 * 3
        } else {
            97
        };
        let (f, rq, rk) = (13usize, 9usize, 5usize);
        let wg = random_weights(51, ty, f, cols);
        let wu = random_weights(52, ty, f, cols);
        let (bq, bk) = (random_weights(53, ty, rq, cols), random_weights(54, ty, rk, cols));
        let atol = 4.0 * atol_for(ty, &wg, f, cols).max(atol_for(ty, &wu, f, cols)) + 1e-5;
        parity(&format!("fused {ty}"), atol, 1e-4, |d| {
            let q = |b: &Vec<u8>, r| QTensor::from_vec(ty, r, cols, b.clone(), &Device::Cpu);
            let gate_up = QTensor::stack_rows(&[&q(&wg, f)?, &q(&wu, f)?], d)?;
            let qk = QTensor::stack_rows(&[&q(&bq, rq)?, &q(&bk, rk)?], d)?;
            assert_eq!((gate_up.rows(), qk.rows()), (2 * f, rq + rk));
            let mut all = Vec::new();
            for n in [1usize, 3, 17] {
                let x = upload_x(60 + n as u64, n, cols, d)?;
                let resid = upload_x(70 + n as u64, n, rq + rk, d)?;
                let g = Tensor::from_vec(rand_vec(80, cols), [cols], &Device::Cpu)?.to_device(d)?;
                let norm = RmsNorm { weight: &g, eps: 1e-5 };
                all.extend(qk.qmatmul(&x)?.to_vec_f32()?);
                all.extend(qk.qmatmul_add(&x, &resid)?.to_vec_f32()?);
                all.extend(gate_up.qmatmul_glu(&x)?.to_vec_f32()?);
                all.extend(qk.qmatmul_rms(&x, norm)?.to_vec_f32()?);
                all.extend(gate_up.qmatmul_glu_rms(&x, norm)?.to_vec_f32()?);
                if !d.is_cpu() {
                    // GLU over two bindings: the unfused path on the GPU.
                    let limit = 256 + (3 * gate_up.row_bytes()).max(4 * cols.max(2 * f)) as u64;
                    let opts = QOptions { max_binding: Some(limit), ..Default::default() };
                    all.extend(gate_up.qmatmul_glu_opts(&x, None, opts)?.to_vec_f32()?);
                } else {
                    all.extend(gate_up.qmatmul_glu(&x)?.to_vec_f32()?);
                }
            }
            Ok(all)
        });
    }
    // Rows wider than NORM_PROLOGUE_MAX_COLS: the norm runs on its own, the GLU stays fused.
    let cols = NORM_PROLOGUE_MAX_COLS + 64;
    let (wg, wu) = (random_weights(55, GgmlType::Q8_0, 5, cols), random_weights(56, GgmlType::Q8_0, 5, cols));
    let atol = 4.0 * atol_for(GgmlType::Q8_0, &wg, 5, cols).max(atol_for(GgmlType::Q8_0, &wu, 5, cols));
    parity("fused wide rows", atol, 1e-4, |d| {
        let q = |b: &Vec<u8>| QTensor::from_vec(GgmlType::Q8_0, 5, cols, b.clone(), &Device::Cpu);
        let gate_up = QTensor::stack_rows(&[&q(&wg)?, &q(&wu)?], d)?;
        let g = Tensor::from_vec(rand_vec(81, cols), [cols], &Device::Cpu)?.to_device(d)?;
        let x = upload_x(82, 2, cols, d)?;
        let mut all = gate_up.qmatmul_glu_rms(&x, RmsNorm { weight: &g, eps: 1e-6 })?.to_vec_f32()?;
        let wg_on = QTensor::from_vec(GgmlType::Q8_0, 5, cols, wg.clone(), d)?;
        all.extend(wg_on.qmatmul_rms(&x, RmsNorm { weight: &g, eps: 1e-6 })?.to_vec_f32()?);
        Ok(all)
    });
    parity_err("qmatmul_add wrong residual", "does not match", |d| {
        let w = QTensor::from_vec(GgmlType::Q8_0, 7, 64, random_weights(6, GgmlType::Q8_0, 7, 64), d)?;
        w.qmatmul_add(&upload_x(1, 2, 64, d)?, &upload_x(2, 2, 6, d)?)
    });
    parity_err("qmatmul_glu odd rows", "even row count", |d| {
        QTensor::from_vec(GgmlType::Q8_0, 7, 64, random_weights(6, GgmlType::Q8_0, 7, 64), d)?
            .qmatmul_glu(&upload_x(1, 1, 64, d)?)
    });
    parity_err("stack_rows mixed types", "cannot stack", |d| {
        let a = QTensor::from_vec(GgmlType::Q8_0, 2, 64, random_weights(7, GgmlType::Q8_0, 2, 64), &Device::Cpu)?;
        let b = QTensor::from_vec(GgmlType::Q4_0, 2, 64, random_weights(8, GgmlType::Q4_0, 2, 64), &Device::Cpu)?;
        QTensor::stack_rows(&[&a, &b], d)
    });
    // Parts already on a GPU are refused: stacking reads host bytes.
    for d in gpu_devices() {
        let a = QTensor::from_vec(GgmlType::Q8_0, 2, 64, random_weights(7, GgmlType::Q8_0, 2, 64), d).unwrap();
        let err = QTensor::stack_rows(&[&a, &a], d).expect_err("device parts").to_string();
        assert!(err.contains("host matrices"), "{err}");
    }
}

/// Per call of `f` (after warm-up), in µs: the host time recording `iters` calls, and the GPU
/// time running them (the batch is submitted at the sync, so that time is the device's alone,
/// plus one submit).
fn time_us(d: &Device, iters: usize, f: impl Fn() -> Result<Tensor>) -> (f64, f64) {
    for _ in 0..3 {
        f().unwrap();
    }
    d.sync().unwrap();
    let t0 = Instant::now();
    for _ in 0..iters {
        f().unwrap();
    }
    let t1 = Instant::now();
    d.sync().unwrap();
    let per = |s: f64| s * 1e6 / iters as f64;
    (per((t1 - t0).as_secs_f64()), per(t1.elapsed().as_secs_f64()))
}

fn env_list(name: &str) -> Option<Vec<String>> {
    std::env::var(name).ok().map(|v| v.split(',').map(str::to_string).collect())
}

/// Decode and prefill throughput on the first GPU: GB/s of weights for n = 1 (the floor is the
/// device's copy bandwidth), GFLOP/s for n = 512. `QBENCH_TYPES=Q4_0,Q4_K` picks types,
/// `QBENCH_TPR=16,32,64` sweeps the matvec's invocations per row, `QBENCH_SMALLN=1` compares
/// both kernels for n = 2..16.
#[test]
#[ignore]
fn bench() {
    let _turn = one_at_a_time();
    let Some(d) = gpu_devices().iter().find(|d| d.gpu().is_some_and(|c| !c.caps.constrained)) else {
        eprintln!("no GPU");
        return;
    };
    eprintln!("device: {}", d.name());
    let types = env_list("QBENCH_TYPES");
    let list = |name: &str| -> Vec<Option<usize>> {
        match env_list(name) {
            Some(v) => v.iter().filter_map(|t| t.parse().ok()).map(Some).collect(),
            None => vec![None],
        }
    };
    let tprs = list("QBENCH_TPR");
    for ty in TYPES {
        if types.as_ref().is_some_and(|o| !o.iter().any(|t| t == ty.name())) {
            continue;
        }
        for &(rows, cols) in &[(576usize, 1536usize), (4096, 4096), (14336, 4096), (32000, 4096)] {
            let bytes = random_weights(1, ty, rows, cols);
            let mb = bytes.len() as f64 / 1e6;
            let w = QTensor::from_vec(ty, rows, cols, bytes, d).unwrap();
            let x = upload_x(2, 1, cols, d).unwrap();
            for &tpr in &tprs {
                let opts = QOptions { threads_per_row: tpr, ..Default::default() };
                let (host, gpu) = time_us(d, 200, || qmatmul_opts(&w, &x, opts));
                eprintln!(
                    "decode  {:5} [{rows:5}, {cols}] tpr {:>4} {mb:8.2} MB  gpu {gpu:7.1} us {:6.0} GB/s  host {host:5.1} us",
                    ty.name(),
                    tpr.map_or("auto".to_string(), |t| t.to_string()),
                    mb * 1e3 / gpu
                );
            }
        }
        let (rows, cols) = (4096usize, 4096usize);
        let w = QTensor::from_vec(ty, rows, cols, random_weights(3, ty, rows, cols), d).unwrap();
        let mut ns = vec![512usize];
        if std::env::var("QBENCH_SMALLN").is_ok() {
            ns = vec![2, 4, 8, 16, 512];
        }
        for n in ns {
            let x = upload_x(4, n, cols, d).unwrap();
            for kernel in [QKernel::Matvec, QKernel::Tiled] {
                if n == 512 && kernel == QKernel::Matvec {
                    continue;
                }
                let opts = QOptions { kernel: Some(kernel), ..Default::default() };
                let (_, us) = time_us(d, if n > 64 { 10 } else { 50 }, || qmatmul_opts(&w, &x, opts));
                eprintln!(
                    "prefill {:5} [{rows}, {cols}] n={n:3} {kernel:?}: gpu {us:8.1} us {:7.0} GFLOP/s",
                    ty.name(),
                    2.0 * (rows * cols * n) as f64 / us / 1e3
                );
            }
        }
    }
}
