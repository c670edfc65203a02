//! GPU kernels that read GGML blocks as stored (quant/gpu.rs) against the CPU QTensor path:
//! `qmatmul` for decode (n = 1) and prefill (n > 1) with both kernels forced on every shape,
//! `gather_rows` (embeddings), the row-sliced binding path, and input views.
//!
//! The decode benchmark is ignored by default (run it on a real GPU):
//! `cargo test --release -p anygpu-core --test parity_qmatmul -- --ignored --nocapture bench`

use std::sync::{Mutex, MutexGuard};
use std::time::Instant;

use anygpu_core::ops::attention::AttentionOpts;
use anygpu_core::ops::rope::RopeOpts;
use anygpu_core::ops::rope_kv::rope_qkv_store;
use anygpu_core::quant::fused::RopeKvStore;
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
/// from their offset; for the float types also rows a multiple of 4 long starting 4 elements
/// into their buffer (on the vec4 grid, not at its start: the 16-byte x loads of x1_4).
#[test]
fn qmatmul_views_and_batch_dims() {
    let _turn = one_at_a_time();
    for ty in [GgmlType::F16, GgmlType::BF16, GgmlType::F32] {
        let (rows, cols) = (9, 68);
        let bytes = random_weights(12, ty, rows, cols);
        parity(&format!("qmatmul aligned views {ty}"), atol_for(ty, &bytes, rows, cols), 1e-5, |d| {
            let w = QTensor::from_vec(ty, rows, cols, bytes.clone(), d)?;
            let mut all = Vec::new();
            for n in [1usize, 3] {
                let flat = Tensor::from_vec(rand_vec(5 + n as u64, n * cols + 4), [n * cols + 4], &Device::Cpu)?;
                let x = flat.to_device(d)?.narrow(0, 4, n * cols)?.reshape([n, cols])?;
                all.extend(w.qmatmul(&x)?.to_vec_f32()?);
            }
            Ok(all)
        });
    }
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
/// `qmatmul_glu` (SwiGLU epilogue) and the RMSNorm prologue (`qmatmul_rms`, `qmatmul_glu_rms`), with one
/// and two W rows per row slot, on the fused matvec path (n <= MATVEC_MAX_N), the unfused
/// path (n = 17) and, for GLU, a binding limit that forces the unfused path; against the CPU's
/// composition of plain products. Odd row counts; Q4_0 with 18-byte blocks stacks parts at offsets
/// that are not multiples of 4 when a part has an odd number of blocks.
#[test]
fn fused_products_match_composition() {
    let _turn = one_at_a_time();
    // Odd rows for the float types: the RMSNorm prologue stages them by element; rows of a
    // multiple of 4 take the norm by scaling instead (ScaledNorm), at every row width per
    // invocation count below.
    let cases = [
        (GgmlType::Q4_0, 96),
        (GgmlType::Q4_1, 96),
        (GgmlType::Q6K, 256),
        (GgmlType::F16, 97),
        (GgmlType::F32, 97),
        (GgmlType::F16, 100),
        (GgmlType::F32, 100),
        (GgmlType::BF16, 100),
    ];
    for (ty, cols) in cases {
        let (f, rq, rk) = (13usize, 9usize, 5usize);
        let wg = random_weights(51, ty, f, cols);
        let wu = random_weights(52, ty, f, cols);
        let (bq, bk) = (random_weights(53, ty, rq, cols), random_weights(54, ty, rk, cols));
        let atol = 4.0 * atol_for(ty, &wg, f, cols).max(atol_for(ty, &wu, f, cols)) + 1e-5;
        parity(&format!("fused {ty} cols {cols}"), atol, 1e-4, |d| {
            let q = |b: &Vec<u8>, r| QTensor::from_vec(ty, r, cols, b.clone(), &Device::Cpu);
            let gate_up = QTensor::stack_rows(&[&q(&wg, f)?, &q(&wu, f)?], d)?;
            let qk = QTensor::stack_rows(&[&q(&bq, rq)?, &q(&bk, rk)?], d)?;
            assert_eq!((gate_up.rows(), qk.rows()), (2 * f, rq + rk));
            let mut all = Vec::new();
            for n in [1usize, 3, 17] {
                let x = upload_x(60 + n as u64, n, cols, d)?;
                let resid = upload_x(70 + n as u64, n, rq + rk, d)?;
                let g = Tensor::from_vec(rand_vec(80, cols), [cols], &Device::Cpu)?.to_device(d)?;
                let norm = RmsNorm::new(&g, 1e-5);
                all.extend(qk.qmatmul(&x)?.to_vec_f32()?);
                all.extend(qk.qmatmul_add(&x, &resid)?.to_vec_f32()?);
                all.extend(gate_up.qmatmul_glu(&x)?.to_vec_f32()?);
                all.extend(qk.qmatmul_rms(&x, norm)?.to_vec_f32()?);
                all.extend(gate_up.qmatmul_glu_rms(&x, norm)?.to_vec_f32()?);
                if !ty.is_quantized() && cols % 4 == 0 {
                    // The scaled norm's sum of squares over 1 to 64 invocations per row (the
                    // lanes' shuffles, then the workgroup tree).
                    for tpr in [1usize, 4, 64] {
                        let opts = QOptions { threads_per_row: Some(tpr), ..Default::default() };
                        all.extend(gate_up.qmatmul_glu_opts(&x, Some(norm), opts)?.to_vec_f32()?);
                    }
                }
                // One and two W rows per row slot (the default is two for the float types,
                // one for the quantized ones): adjacent rows (residual), gate and up rows (GLU).
                for rps in [1usize, 2] {
                    let opts = QOptions { rows_per_slot: Some(rps), ..Default::default() };
                    all.extend(qk.qmatmul_add_opts(&x, &resid, opts)?.to_vec_f32()?);
                    all.extend(gate_up.qmatmul_glu_opts(&x, Some(norm), opts)?.to_vec_f32()?);
                }
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
        let mut all = gate_up.qmatmul_glu_rms(&x, RmsNorm::new(&g, 1e-6))?.to_vec_f32()?;
        let wg_on = QTensor::from_vec(GgmlType::Q8_0, 5, cols, wg.clone(), d)?;
        all.extend(wg_on.qmatmul_rms(&x, RmsNorm::new(&g, 1e-6))?.to_vec_f32()?);
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

/// The Q8 matvec (x rounded to 8-bit blocks on the GPU, integer dot products) against the CPU's
/// Q8 products (q8.rs, the same rounding; weights marked `CpuMath::Q8`, as model loaders mark
/// them), for the five 32-weight block types: odd row counts, 1 and 3 x rows, an x view that
/// starts mid-buffer; plain and GLU products forced onto it (`x_q8: Some(true)`), and, on rows
/// wider than the RMSNorm prologue takes (14336: the 8B down projection's width), the fused
/// `qmatmul_rms` / `qmatmul_glu_rms`, which take it by themselves with the norm in the rounding
/// dispatch. On the GPU the Q8 result must differ from the exact one (the path is taken), and
/// `x_q8: Some(false)` must give the exact one.
#[test]
fn q8_matvec_matches_cpu_q8() {
    use anygpu_core::quant::CpuMath;
    let _turn = one_at_a_time();
    let q8 = QOptions { x_q8: Some(true), ..Default::default() };
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0] {
        for (rows, cols) in [(37usize, 96usize), (10, 14336), (258, 64)] {
            let bytes = random_weights(300 + rows as u64, ty, rows, cols);
            // Both sides round x alike; a last-bit difference in x can still move one byte.
            let atol = 4.0 * atol_for(ty, &bytes, rows, cols) + 0.02;
            let name = format!("q8 matvec {ty} [{rows}, {cols}]");
            let run = |d: &Device| -> Result<Vec<f32>> {
                let w = QTensor::from_vec(ty, rows, cols, bytes.clone(), d)?.with_cpu_math(CpuMath::Q8);
                let g = Tensor::from_vec(rand_vec(301, cols), [cols], &Device::Cpu)?.to_device(d)?;
                let norm = RmsNorm::new(&g, 1e-5);
                let mut all = Vec::new();
                for n in [1usize, 3] {
                    let x = upload_x(302 + n as u64, n, cols, d)?;
                    all.extend(if d.is_cpu() { w.qmatmul(&x)? } else { qmatmul_opts(&w, &x, q8)? }.to_vec_f32()?);
                    if rows % 2 == 0 {
                        all.extend(w.qmatmul_glu_opts(&x, None, q8)?.to_vec_f32()?);
                    }
                    if cols > NORM_PROLOGUE_MAX_COLS {
                        all.extend(w.qmatmul_rms(&x, norm)?.to_vec_f32()?);
                        if rows % 2 == 0 {
                            all.extend(w.qmatmul_glu_rms(&x, norm)?.to_vec_f32()?);
                        }
                    }
                }
                // Row 1 of a 3-row x: a view 1 row into its buffer.
                let x = upload_x(306, 3, cols, d)?.narrow(0, 1, 1)?;
                all.extend(if d.is_cpu() { w.qmatmul(&x)? } else { qmatmul_opts(&w, &x, q8)? }.to_vec_f32()?);
                if !d.is_cpu() {
                    let x = upload_x(303, 1, cols, d)?;
                    let exact_opts = QOptions { x_q8: Some(false), ..Default::default() };
                    let got = qmatmul_opts(&w, &x, q8)?.to_vec_f32()?;
                    let forced = qmatmul_opts(&w, &x, exact_opts)?.to_vec_f32()?;
                    let exact = QTensor::from_vec(ty, rows, cols, bytes.clone(), d)?.qmatmul(&x)?.to_vec_f32()?;
                    assert!(got.iter().zip(&exact).any(|(a, b)| a != b), "{name}: the Q8 path gave the exact result");
                    assert_eq!(forced, exact, "{name}: x_q8 Some(false) is not the exact path");
                }
                Ok(all)
            };
            let want = run(&Device::Cpu).unwrap_or_else(|e| panic!("{name}: CPU reference failed: {e}"));
            for d in gpu_devices().iter() {
                let got = run(d).unwrap_or_else(|e| panic!("{name} on {}: {e}", d.name()));
                check_close(&name, &got, &want, atol, 1e-3).unwrap_or_else(|m| panic!("{m} on {}", d.name()));
            }
        }
    }
}

/// A fused product without a prologue on a matrix of at least `Q8_OWN_DISPATCH_MIN_BYTES`
/// (the 8B's output and down projections: `qmatmul_add`) rounds x to 8-bit blocks in a dispatch of its own
/// when the matrix asks for Q8 math: against the CPU's Q8 product, and different from the
/// exact GPU product; a smaller one stays exact.
#[test]
fn q8_own_dispatch_for_large_plain_products() {
    use anygpu_core::quant::gpu::Q8_OWN_DISPATCH_MIN_BYTES;
    use anygpu_core::quant::CpuMath;
    let _turn = one_at_a_time();
    let ty = GgmlType::Q4_0;
    let cols = 32768;
    let rows = (Q8_OWN_DISPATCH_MIN_BYTES as usize).div_ceil(ty.type_size() * cols / 32) + 3;
    let bytes = random_weights(320, ty, rows, cols);
    let atol = 4.0 * atol_for(ty, &bytes, rows, cols) + 0.02;
    let run = |d: &Device, math: CpuMath, rows: usize| -> Result<Vec<f32>> {
        let len = ty.type_size() * cols / 32 * rows;
        let w = QTensor::from_vec(ty, rows, cols, bytes[..len].to_vec(), d)?.with_cpu_math(math);
        let x = upload_x(321, 1, cols, d)?;
        let resid = upload_x(322, 1, rows, d)?;
        w.qmatmul_add(&x, &resid)?.to_vec_f32()
    };
    let want = run(&Device::Cpu, CpuMath::Q8, rows).unwrap();
    for d in gpu_devices().iter().take(1) {
        let got = run(d, CpuMath::Q8, rows).unwrap();
        check_close("q8 own dispatch", &got, &want, atol, 1e-3).unwrap_or_else(|m| panic!("{m} on {}", d.name()));
        let exact = run(d, CpuMath::Exact, rows).unwrap();
        assert!(got.iter().zip(&exact).any(|(a, b)| a != b), "the large product did not take the Q8 path");
        // Below the threshold: the exact path whatever the marking.
        let small = rows / 4;
        assert_eq!(run(d, CpuMath::Q8, small).unwrap(), run(d, CpuMath::Exact, small).unwrap());
    }
}

/// The GPU's rounding to 8-bit blocks (round_q8.wgsl) against the CPU's (llama.cpp's
/// quantize_row_q8_1): every block's d = max|x| / 127 and s = d * sum(q) are f16 values (the
/// Q8 products' numerics: NVIDIA's driver once folded the f16 rounding away, leaving them f32)
/// within one f16 step of the host's (WGSL's division need not be correctly rounded), every
/// byte within 1 of the host's, and the sum(q) carried in d's low bits that of the bytes.
/// Blocks at scales across f16's range: ordinary, f16 subnormal scales (max|x| 1e-3 to 1e-6),
/// all zeros, and large enough that s overflows f16 (inf).
#[test]
fn q8_rounding_scales_are_f16_values() {
    use anygpu_core::quant::gpu::Q8Rows;
    use anygpu_core::quant::q8_round_blocks;
    let _turn = one_at_a_time();
    let scales = [1.0f32, 3.7, 1e-3, 2e-5, 1e-6, 0.0, 50.0, 3e5];
    let (n, cols) = (3usize, 32 * 2 * scales.len());
    let mut x = rand_vec(330, n * cols);
    for (b, block) in x.chunks_mut(32).enumerate() {
        let scale = scales[(b / 2) % scales.len()];
        block.iter_mut().for_each(|v| *v *= scale);
    }
    let f16_step = |v: f32| {
        let h = f16::from_f32(v.abs());
        (f16::from_bits(h.to_bits() + 1).to_f32() - h.to_f32())
            .max(h.to_f32() - f16::from_bits(h.to_bits().max(1) - 1).to_f32())
    };
    let want = q8_round_blocks(&x).unwrap();
    for d in gpu_devices() {
        // host_blocks also checks the sum(q) that d's word carries (the Q4_0 product's offset
        // term) against the bytes.
        let got = Q8Rows::round(&Tensor::from_vec(x.clone(), [n, cols], &Device::Cpu).unwrap().to_device(d).unwrap())
            .and_then(|r| r.host_blocks())
            .unwrap_or_else(|e| panic!("rounding on {}: {e}", d.name()));
        for (b, ((g, w), block)) in got.iter().zip(&want).zip(x.chunks(32)).enumerate() {
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            let at = format!("block {b} (max|x| {amax:e}) on {}", d.name());
            for (what, got, want) in [("d", g.d, w.d), ("s", g.s, w.s)] {
                assert_eq!(
                    f16::from_f32(got).to_f32().to_bits(),
                    got.to_bits(),
                    "{at}: {what} = {got:e} is not an f16 value"
                );
                assert!(
                    got == want || (got - want).abs() <= f16_step(want),
                    "{at}: {what} = {got:e}, the host's {want:e}"
                );
            }
            for (i, (gq, wq)) in g.q.iter().zip(&w.q).enumerate() {
                assert!((*gq as i32 - *wq as i32).abs() <= 1, "{at}: byte {i} = {gq}, the host's {wq}");
            }
        }
    }
}

/// x rounded as the GPU's quantize_q8.wgsl rounds it (the CPU backend's Q8 rounding,
/// `quant::q8_round_blocks`), back in f32, with each block's d.
fn q8_blocks_rounded(x: &[f32]) -> (Vec<f32>, Vec<f32>) {
    use anygpu_core::quant::q8_round_blocks;
    let blocks = q8_round_blocks(x).unwrap();
    let out = blocks.iter().flat_map(|b| b.q.map(|q| b.d * q as f32)).collect();
    (out, blocks.iter().map(|b| b.d).collect())
}

/// The Q8 matvec of the k-quants (Q4_K, Q5_K, Q6_K), forced on (`x_q8: Some(true)`), against a
/// host product of the same rounded x: the GPU rounds x to 32-element blocks (the CPU's Q8
/// path uses 256-element Q8_K blocks for these types, so it is not the reference). Allowed: f32
/// summation order, a few x bytes rounded the other way (WGSL's division need not be correctly
/// rounded: max |w| * d each), and the f16 rounding of the blocks' sums s that the min terms
/// use (2^-10 of sum |w x|). Odd row counts, 1 and 3 x rows, 1 and 16 super-blocks per row; the
/// result must differ from the exact GPU product (the path is taken).
#[test]
fn q8_matvec_kquants_match_rounded_x() {
    let _turn = one_at_a_time();
    let q8 = QOptions { x_q8: Some(true), ..Default::default() };
    for ty in [GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K] {
        for (rows, cols) in [(37usize, 256usize), (9, 4096)] {
            let bytes = random_weights(310 + rows as u64, ty, rows, cols);
            let wv = dequantize_to_vec(ty, &bytes, rows * cols).unwrap();
            let max_w = wv.iter().fold(0f32, |m, v| m.max(v.abs()));
            for n in [1usize, 3] {
                let xv = rand_vec(311 + n as u64, n * cols);
                let (xr, ds) = q8_blocks_rounded(&xv);
                let max_d = ds.iter().fold(0f32, |m, v| m.max(*v));
                let mut want = Vec::new();
                let mut mag = 0f32;
                for xrow in xr.chunks(cols) {
                    for wr in wv.chunks(cols) {
                        want.push(wr.iter().zip(xrow).map(|(w, x)| *w as f64 * *x as f64).sum::<f64>() as f32);
                        mag = mag.max(wr.iter().zip(xrow).map(|(w, x)| (w * x).abs()).sum());
                    }
                }
                let atol = atol_for(ty, &bytes, rows, cols) + 4.0 * max_w * max_d + mag / 1024.0;
                let name = format!("q8 matvec {ty} [{rows}, {cols}] n {n}");
                for d in gpu_devices().iter() {
                    // Also with a binding limit that splits the 256-column rows (about 20 a
                    // binding): rows start mid-binding (the Q4_K / Q5_K products read their
                    // weights as vec4s, which needs them 16-byte aligned).
                    let run = || -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
                        let w = QTensor::from_vec(ty, rows, cols, bytes.clone(), d)?;
                        let x = Tensor::from_vec(xv.clone(), [n, cols], &Device::Cpu)?.to_device(d)?;
                        let limit = 256 + 3 * w.row_bytes().max(4 * rows.max(cols)) as u64;
                        let sliced = QOptions { max_binding: Some(limit), ..q8 };
                        Ok((
                            qmatmul_opts(&w, &x, q8)?.to_vec_f32()?,
                            qmatmul_opts(&w, &x, sliced)?.to_vec_f32()?,
                            w.qmatmul(&x)?.to_vec_f32()?,
                        ))
                    };
                    let (got, sliced, exact) = run().unwrap_or_else(|e| panic!("{name} on {}: {e}", d.name()));
                    assert!(got.iter().zip(&exact).any(|(a, b)| a != b), "{name}: the Q8 path gave the exact result");
                    check_close(&name, &got, &want, atol, 0.0).unwrap_or_else(|m| panic!("{m} on {}", d.name()));
                    check_close(&format!("{name} sliced"), &sliced, &want, atol, 0.0)
                        .unwrap_or_else(|m| panic!("{m} on {}", d.name()));
                }
            }
        }
    }
}

/// The rope + KV-cache store epilogue (`qmatmul_rms_rope_kv`: RMSNorm, Q|K|V product, bias, rope
/// of Q and K, K and V into the caches) against its composition (`qmatmul_rms`, the bias add,
/// `rope_qkv_store`) run on the same device, both against the CPU's composition: Q and both
/// whole caches (views one head into a larger buffer, so untouched positions are checked too),
/// for several types, normal and NeoX rope, rotary_dim < D, freq_factors, a bias, odd head
/// counts, one token (decode: one dispatch, checked by recording it) and 3 tokens (fused) at
/// start positions > 0, and 17 tokens (the unfused path); rows wider than the RMSNorm prologue
/// takes (the norm on its own, the epilogue fused).
#[test]
fn rope_kv_epilogue_matches_composition() {
    let _turn = one_at_a_time();
    // (type, cols, H, Hkv, D, rotary_dim, neox, freq_factors, bias)
    let cases = [
        (GgmlType::Q4_1, 96, 9, 3, 64, 0, false, false, false),
        (GgmlType::Q4_0, 96, 3, 1, 64, 0, true, false, true),
        (GgmlType::Q8_0, 64, 3, 1, 64, 32, false, true, false),
        (GgmlType::Q6K, 256, 9, 3, 64, 32, true, true, true),
        (GgmlType::Q4K, 256, 2, 1, 16, 0, true, false, false),
        (GgmlType::F16, 97, 5, 1, 10, 6, true, false, true),
        // A multiple of 4: the norm by scaling, also on a row wider than the staged one takes.
        (GgmlType::F16, 96, 5, 1, 10, 6, true, false, true),
        (GgmlType::F32, NORM_PROLOGUE_MAX_COLS + 64, 3, 1, 8, 0, false, false, false),
        (GgmlType::Q8_0, NORM_PROLOGUE_MAX_COLS + 64, 1, 1, 8, 0, false, false, true),
        // Marked for Q8 math below: the wide row's product rounds x to 8-bit blocks.
        (GgmlType::Q4_0, NORM_PROLOGUE_MAX_COLS + 64, 3, 1, 16, 0, true, false, true),
    ];
    for (ci, (ty, cols, h, hkv, d, rd, neox, ff, with_bias)) in cases.into_iter().enumerate() {
        let rows = (h + 2 * hkv) * d;
        let rot = if rd == 0 { d } else { rd };
        let opts = RopeOpts {
            base: 10000.0,
            neox,
            rotary_dim: rd,
            freq_scale: 0.5,
            freq_factors: ff.then(|| (0..rot / 2).map(|i| 1.0 + i as f32 * 0.25).collect()),
        };
        let wb = random_weights(90 + ci as u64, ty, rows, cols);
        let q8 = ci == cases.len() - 1;
        let atol = 4.0 * atol_for(ty, &wb, rows, cols) + if q8 { 0.02 } else { 1e-5 };
        let name =
            format!("rope_kv {ty} cols {cols} H{h} Hkv{hkv} D{d} rd{rd} neox{neox} ff{ff} bias{with_bias} q8 {q8}");
        parity(&name, atol, 1e-4, |dev| {
            let math = if q8 { anygpu_core::quant::CpuMath::Q8 } else { Default::default() };
            let w = QTensor::from_vec(ty, rows, cols, wb.clone(), dev)?.with_cpu_math(math);
            let g = Tensor::from_vec(rand_vec(91, cols), [cols], &Device::Cpu)?.to_device(dev)?;
            let norm = RmsNorm::new(&g, 1e-5);
            let bias = match with_bias {
                true => Some(Tensor::from_vec(rand_vec(92, rows), [rows], &Device::Cpu)?.to_device(dev)?),
                false => None,
            };
            let cap = 24;
            // Caches one head into a larger buffer: their layout offsets are honoured.
            let cache = |seed| -> Result<Tensor> {
                Tensor::from_vec(rand_vec(seed, (hkv + 1) * cap * d), [hkv + 1, cap, d], &Device::Cpu)?
                    .to_device(dev)?
                    .narrow(0, 1, hkv)
            };
            let mut all = Vec::new();
            for (t, start_pos) in [(1usize, 5usize), (3, 11), (17, 2)] {
                // 17 tokens take the prefill kernels, which do not round x to 8 bits as the
                // CPU's Q8 path does.
                if q8 && t > 3 {
                    continue;
                }
                let x = upload_x(93 + t as u64, t, cols, dev)?;
                let (mut kc, mut vc) = (cache(94)?, cache(95)?);
                let kv = RopeKvStore { rope: &opts, heads: (h, hkv, d), start_pos, k_cache: &mut kc, v_cache: &mut vc };
                let q = w.qmatmul_rms_rope_kv(&x, norm, bias.as_ref(), kv)?;
                assert_eq!(q.dims(), &[t, h, d]);
                all.extend(q.to_vec_f32()?);
                all.extend(kc.to_vec_f32()?);
                all.extend(vc.to_vec_f32()?);

                let (mut kc, mut vc) = (cache(94)?, cache(95)?);
                let mut y = w.qmatmul_rms(&x, norm)?;
                if let Some(b) = &bias {
                    y = y.add(b)?;
                }
                let q = rope_qkv_store(&y.reshape([t, h + 2 * hkv, d])?, h, start_pos, &opts, &mut kc, &mut vc)?;
                all.extend(q.to_vec_f32()?);
                all.extend(kc.to_vec_f32()?);
                all.extend(vc.to_vec_f32()?);

                if let (Some(ctx), 1) = (dev.gpu(), t) {
                    // Decode is one dispatch (two when the row of a quantized matrix is too wide
                    // for the prologue: the norm, or the norm and the rounding of x to 8 bits,
                    // runs first; float rows of a multiple of 4 take the norm by scaling).
                    let (mut kc, mut vc) = (cache(94)?, cache(95)?);
                    let kv =
                        RopeKvStore { rope: &opts, heads: (h, hkv, d), start_pos, k_cache: &mut kc, v_cache: &mut vc };
                    let (_, rec) = ctx.record(|| w.qmatmul_rms_rope_kv(&x, norm, bias.as_ref(), kv))?;
                    let want = if cols > NORM_PROLOGUE_MAX_COLS && ty.is_quantized() { 2 } else { 1 };
                    assert_eq!(rec.len(), want, "{name}: dispatches of one decode step on {}", dev.name());
                }
            }
            Ok(all)
        });
    }
    // Bad calls on a Q8_0 matrix of `rows` x 64 with heads (2, 1, 8) and a 4-position cache:
    // `tokens` x rows from `start_pos`, with a bias of `bias_len` when given.
    let bad_call = |rows: usize, tokens: usize, start_pos: usize, bias_len: Option<usize>, dev: &Device| {
        let zeros = |shape: &[usize]| Tensor::zeros(shape.to_vec(), anygpu_core::DType::F32, dev);
        let w = QTensor::from_vec(GgmlType::Q8_0, rows, 64, random_weights(6, GgmlType::Q8_0, rows, 64), dev)?;
        let (g, mut kc, mut vc) = (zeros(&[64])?, zeros(&[1, 4, 8])?, zeros(&[1, 4, 8])?);
        let bias = bias_len.map(|n| zeros(&[n])).transpose()?;
        let kv =
            RopeKvStore { rope: &RopeOpts::default(), heads: (2, 1, 8), start_pos, k_cache: &mut kc, v_cache: &mut vc };
        let x = upload_x(1, tokens, 64, dev)?;
        w.qmatmul_rms_rope_kv(&x, RmsNorm::new(&g, 1e-5), bias.as_ref(), kv)
    };
    parity_err("qmatmul_rms_rope_kv not a Q|K|V stack", "not a Q|K|V stack", |dev| bad_call(40, 1, 0, None, dev));
    parity_err("qmatmul_rms_rope_kv past the cache", "exceed the cache", |dev| bad_call(32, 2, 3, None, dev));
    parity_err("qmatmul_rms_rope_kv bad bias", "does not match", |dev| bad_call(32, 1, 0, Some(31), dev));
}

/// The rounding epilogue (`qmatmul_add_rounding`: a residual product that also rounds its sum h
/// for the next RMSNorm, 32 rows per workgroup) against the composition, the CPU's `qmatmul_add`
/// and then the next products on `rms_norm(h)` rounded to 8-bit blocks (the CPU's Q8 path): the
/// plain product, the GLU and the rope + KV store epilogues, each reading the rounded rows
/// through `RmsNorm::rounded`, over 1 and 3 x rows, producers of three types (one on 8-bit x
/// rounded by the attention: `qmatmul_add_q8_rounding`). Where the device runs the epilogue
/// (1,024 invocations per workgroup, subgroups of 8), each next product is one dispatch (two
/// with its own rounding), as close to the exact product (f32 x) as its own rounding is, and
/// rows made for another weight or from another x are refused (the product rounds x itself).
#[test]
fn add_rounding_feeds_the_next_norm() {
    use anygpu_core::quant::CpuMath;
    let _turn = one_at_a_time();
    let (cols, rows) = (96usize, NORM_PROLOGUE_MAX_COLS + 256);
    let (h, hkv, d) = (3usize, 1usize, 16usize);
    let qkv_rows = (h + 2 * hkv) * d;
    let rope = RopeOpts { base: 10000.0, ..Default::default() };
    for (ci, (pty, cty)) in
        [(GgmlType::Q4_0, GgmlType::Q4_0), (GgmlType::F16, GgmlType::Q4_1), (GgmlType::Q8_0, GgmlType::Q4K)]
            .into_iter()
            .enumerate()
    {
        let seed = 400 + 10 * ci as u64;
        let wp = random_weights(seed, pty, rows, cols);
        let shapes = [37, 26, qkv_rows];
        let wn: Vec<Vec<u8>> =
            shapes.iter().enumerate().map(|(i, &r)| random_weights(seed + 1 + i as u64, cty, r, rows)).collect();
        let atol = 4.0 * atol_for(cty, &wn[0], 37, rows).max(atol_for(cty, &wn[1], 26, rows)) + 0.02;
        let name = format!("add rounding {pty} -> {cty}");
        // The next products (plain, GLU, rope + KV store) of h under `norm`, their matrices
        // marked for `math` (Q8: 8-bit x where the norm is not staged, as on the CPU).
        let next = |dev: &Device, math: CpuMath, hsum: &Tensor, norm: RmsNorm<'_>| -> Result<Vec<f32>> {
            let m = |i: usize| {
                Ok::<_, anygpu_core::Error>(
                    QTensor::from_vec(cty, shapes[i], rows, wn[i].clone(), dev)?.with_cpu_math(math),
                )
            };
            let mut out = m(0)?.qmatmul_rms(hsum, norm)?.to_vec_f32()?;
            out.extend(m(1)?.qmatmul_glu_rms(hsum, norm)?.to_vec_f32()?);
            let cache = |s| Tensor::from_vec(rand_vec(s, hkv * 8 * d), [hkv, 8, d], &Device::Cpu)?.to_device(dev);
            let (mut kc, mut vc) = (cache(seed + 8)?, cache(seed + 9)?);
            let kv = RopeKvStore { rope: &rope, heads: (h, hkv, d), start_pos: 2, k_cache: &mut kc, v_cache: &mut vc };
            out.extend(m(2)?.qmatmul_rms_rope_kv(hsum, norm, None, kv)?.to_vec_f32()?);
            out.extend(kc.to_vec_f32()?);
            out.extend(vc.to_vec_f32()?);
            Ok(out)
        };
        let max_diff = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        let run = |dev: &Device| -> Result<(Vec<f32>, Option<Vec<f32>>, f32)> {
            // Exact products of f32 x (as the GPU's for a matrix this small), and one on 8-bit x
            // for the attention's rounded rows.
            let producer = QTensor::from_vec(pty, rows, cols, wp.clone(), dev)?;
            let producer_q8 = QTensor::from_vec(pty, rows, cols, wp.clone(), dev)?.with_cpu_math(CpuMath::Q8);
            let g = Tensor::from_vec(rand_vec(seed + 4, rows), [rows], &Device::Cpu)?.to_device(dev)?;
            let g2 = Tensor::from_vec(rand_vec(seed + 5, rows), [rows], &Device::Cpu)?.to_device(dev)?;
            let (mut all, mut q8_err) = (Vec::new(), 0f32);
            for n in [1usize, 3] {
                let x = upload_x(seed + 6 + n as u64, n, cols, dev)?;
                let resid = upload_x(seed + 7 + n as u64, n, rows, dev)?;
                let (hsum, rounded) = producer.qmatmul_add_rounding(&x, &resid, &g)?;
                all.extend(hsum.to_vec_f32()?);
                let norm = RmsNorm { weight: &g, eps: 1e-5, rounded: rounded.as_ref() };
                let got = next(dev, CpuMath::Q8, &hsum, norm)?;
                let exact = next(dev, CpuMath::Exact, &hsum, RmsNorm::new(&g, 1e-5))?;
                q8_err = q8_err.max(max_diff(&got, &exact));
                all.extend(got);
                let Some(ctx) = dev.gpu() else {
                    assert!(rounded.is_none(), "{name}: the CPU rounded");
                    continue;
                };
                let c = &ctx.caps;
                let runs = c.subgroup
                    && c.subgroup_min_size >= 8
                    && c.max_compute_invocations_per_workgroup >= 1024
                    && c.max_compute_workgroup_size_x >= 1024;
                assert_eq!(rounded.is_some(), runs, "{name} on {}: the rounding epilogue", dev.name());
                if !runs {
                    continue;
                }
                // As close to the exact products as the next products' own rounding: the same
                // blocks, their scales rounded to f16 before or after 1 / rms.
                let own = next(dev, CpuMath::Q8, &hsum, RmsNorm::new(&g, 1e-5))?;
                let (e_fold, e_own) = (max_diff(&all[all.len() - own.len()..], &exact), max_diff(&own, &exact));
                assert!(
                    e_fold <= 1.5 * e_own + atol,
                    "{name} n {n}: {e_fold} off the exact products, own rounding {e_own}"
                );
                // One dispatch each with the rows, two without (the norm's rounding).
                let wc = QTensor::from_vec(cty, 37, rows, wn[0].clone(), dev)?.with_cpu_math(CpuMath::Q8);
                assert!(wc.reads_rounded_norm(false)?, "{name}: the product reads rounded rows");
                for (rows_given, want) in [(true, 1usize), (false, 2)] {
                    let nm = RmsNorm { rounded: if rows_given { rounded.as_ref() } else { None }, ..norm };
                    let (_, rec) = ctx.record(|| wc.qmatmul_rms(&hsum, nm))?;
                    assert_eq!(rec.len(), want, "{name}: dispatches of the next product, rows given {rows_given}");
                }
                let (_, rec) = ctx.record(|| producer.qmatmul_add_rounding(&x, &resid, &g))?;
                assert_eq!(rec.len(), 1, "{name}: the producer's dispatches");
                // Rows made for another weight, or from another x of the same shape, are not
                // taken: the product rounds x itself (two dispatches) and computes what it
                // computes without rows.
                let (_, other_w) = producer.qmatmul_add_rounding(&x, &resid, &g2)?;
                let (_, other_h) = producer.qmatmul_add_rounding(&x, &resid, &g)?;
                let own_plain = wc.qmatmul_rms(&hsum, RmsNorm::new(&g, 1e-5))?.to_vec_f32()?;
                for (what, rows) in [("another weight", &other_w), ("another x", &other_h)] {
                    let nm = RmsNorm { rounded: rows.as_ref(), ..norm };
                    let (_, rec) = ctx.record(|| wc.qmatmul_rms(&hsum, nm))?;
                    assert_eq!(rec.len(), 2, "{name}: rows made for {what} were taken");
                    assert_eq!(wc.qmatmul_rms(&hsum, nm)?.to_vec_f32()?, own_plain, "{name}: rows made for {what}");
                }
            }
            // On x rounded by the attention (the output projection's `qmatmul_add_q8_rounding`):
            // 3 heads of 32 = the producer's 96 columns; where the device rounds it (the CPU
            // rounds x for the Q8 product likewise), else nothing.
            let t = |s: u64, shape: [usize; 4]| {
                Tensor::from_vec(rand_vec(s, shape.iter().product()), shape, &Device::Cpu)?.to_device(dev)
            };
            let (q, k, v) = (t(seed + 12, [1, 3, 1, 32])?, t(seed + 13, [1, 3, 5, 32])?, t(seed + 14, [1, 3, 5, 32])?);
            let opts = AttentionOpts::new(32, true);
            let resid = upload_x(seed + 15, 1, rows, dev)?;
            let (hsum, rounded) = match (q.attention_q8(&k, &v, &opts)?, dev.is_cpu()) {
                (Some(a), _) => producer_q8.qmatmul_add_q8_rounding(&a, &resid, &g)?,
                (None, true) => {
                    let a = q.attention(&k, &v, &opts)?.permute(&[0, 2, 1, 3])?.reshape([1, 96])?;
                    producer_q8.qmatmul_add_rounding(&a, &resid, &g)?
                }
                (None, false) => return Ok((all, None, q8_err)),
            };
            let mut att = hsum.to_vec_f32()?;
            att.extend(next(dev, CpuMath::Q8, &hsum, RmsNorm { weight: &g, eps: 1e-5, rounded: rounded.as_ref() })?);
            Ok((all, Some(att), q8_err))
        };
        // Against the CPU's rounding of the same x: the blocks' scales differ by their f16
        // rounding (2^-11 relative, before or after 1 / rms), which sums over many blocks of
        // either sign show at the size of the 8-bit rounding's own error: twice the CPU's
        // (against f32 x) is allowed.
        let (want, want_att, q8_err) =
            run(&Device::Cpu).unwrap_or_else(|e| panic!("{name}: CPU reference failed: {e}"));
        let tol = atol + 2.0 * q8_err;
        for dev in gpu_devices().iter() {
            let (got, got_att, _) = run(dev).unwrap_or_else(|e| panic!("{name} on {}: {e}", dev.name()));
            check_close(&name, &got, &want, tol, 1e-3).unwrap_or_else(|m| panic!("{m} on {}", dev.name()));
            if let (Some(got), Some(want)) = (got_att, &want_att) {
                check_close(&format!("{name} on the attention's rows"), &got, want, tol, 1e-3)
                    .unwrap_or_else(|m| panic!("{m} on {}", dev.name()));
            }
        }
    }
}

/// The combine prologue (`qmatmul_add_combined`: flash-decoding's merge of a split attention
/// inside the output projection) against its composition on the same device (attention with
/// the same forced splits, merged by attention_combine, then `qmatmul_add`), both against the
/// CPU's attention + `qmatmul_add`: several types, head counts (9 x 64 as SmolLM2, 3 x 16, 4 x
/// 64 for the k-quants), split counts (default, forced, and more splits than the current
/// length fills: the empty ones must not count, even holding another call's partials), two query rows (the x row -> partials row
/// mapping), and a head dim that is not a multiple of 4 (the prologue declines: the combine
/// runs apart). Decode is one dispatch after the attention (checked by recording it).
#[test]
fn combine_prologue_matches_composition() {
    use anygpu_core::ops::attention::{
        gpu_attention_partials_tuned, gpu_attention_tuned, AttentionOpts, AttentionTiles, AttentionTuning,
    };
    let _turn = one_at_a_time();
    let tiny = Some(AttentionTiles { bq: 4, bk: 4, tr: 4, ct: 4 });
    // (type, H, Hkv, D, W rows, Tq, keys, cache capacity, tuning, fused)
    let cases = [
        // A cache past the decode kernel's 256 keys (shorter ones are walked unsplit where it
        // runs), 50 of them live.
        (GgmlType::Q4_1, 9, 3, 64, 37, 1, 50, 300, AttentionTuning::default(), true),
        // A longer cache, most of its splits live.
        (GgmlType::Q4_1, 9, 3, 64, 37, 1, 1500, 2048, AttentionTuning::default(), true),
        (GgmlType::Q8_0, 9, 3, 64, 21, 1, 6, 40, AttentionTuning { splits: Some(10), tiles: tiny }, true),
        (GgmlType::Q4_0, 9, 3, 64, 9, 1, 37, 40, AttentionTuning { splits: Some(3), tiles: tiny }, true),
        (GgmlType::Q6K, 4, 2, 64, 19, 1, 23, 64, AttentionTuning { splits: Some(5), tiles: None }, true),
        (GgmlType::F16, 3, 1, 16, 13, 1, 9, 40, AttentionTuning { splits: Some(7), tiles: tiny }, true),
        (GgmlType::F32, 3, 3, 16, 7, 2, 17, 40, AttentionTuning { splits: Some(4), tiles: tiny }, true),
        (GgmlType::BF16, 3, 1, 10, 11, 1, 9, 40, AttentionTuning { splits: Some(3), tiles: tiny }, false),
    ];
    for (ci, (ty, h, hkv, d, rows, tq, tk, cap, tuning, fused)) in cases.into_iter().enumerate() {
        let cols = h * d;
        let wb = random_weights(200 + ci as u64, ty, rows, cols);
        let atol = 8.0 * atol_for(ty, &wb, rows, cols) + 1e-4;
        let name = format!("combine prologue {ty} H{h} Hkv{hkv} D{d} rows {rows} Tq{tq} Tk{tk} cap {cap} {tuning:?}");
        let opts = AttentionOpts::new(d, true);
        parity(&name, atol, 1e-4, |dev| {
            let w = QTensor::from_vec(ty, rows, cols, wb.clone(), dev)?;
            let q = upload_x(201, h * tq, d, dev)?.reshape([1, h, tq, d])?;
            // Keys and values: views of the first tk positions of [Hkv, cap, D] caches, as a
            // decode step reads them (the splits are planned on the capacity).
            let cache = |seed| -> Result<Tensor> {
                upload_x(seed, hkv * cap, d, dev)?.reshape([hkv, cap, d])?.narrow(1, 0, tk)?.unsqueeze(0)
            };
            let (k, v) = (cache(202)?, cache(203)?);
            let resid = upload_x(204, tq, rows, dev)?;
            let merged = |a: Tensor| a.permute(&[0, 2, 1, 3])?.reshape([tq, cols]);
            let Some(ctx) = dev.gpu() else {
                // The CPU reference, twice (the fused op and its composition on a GPU).
                let y = w.qmatmul_add(&merged(q.attention(&k, &v, &opts)?)?, &resid)?.to_vec_f32()?;
                return Ok([y.clone(), y].concat());
            };
            if tk > 1024 {
                // Poison the pool: partials of the whole cache with large scores fill every
                // split; their buffer, dropped, serves the run below, whose splits past its keys
                // the merge must not read.
                let full = |seed| -> Result<Tensor> { upload_x(seed, hkv * cap, d, dev)?.reshape([1, hkv, cap, d]) };
                let big = q.affine(64.0, 0.0)?;
                drop(gpu_attention_partials_tuned(&big, &full(205)?, &full(206)?, &opts, tuning)?);
            }
            let parts = gpu_attention_partials_tuned(&q, &k, &v, &opts, tuning)?.expect("the keys are split");
            assert!(parts.n_splits() > 1, "{name}");
            let mut all = w.qmatmul_add_combined(&parts, &resid)?.to_vec_f32()?;
            let a = gpu_attention_tuned(&q, &k, &v, &opts, tuning)?;
            all.extend(w.qmatmul_add(&merged(a)?, &resid)?.to_vec_f32()?);
            // One dispatch (the product) after the attention's, or the combine and the
            // product where the prologue declines.
            let (_, rec) = ctx.record(|| w.qmatmul_add_combined(&parts, &resid))?;
            assert_eq!(rec.len(), if fused { 1 } else { 2 }, "{name}: dispatches on {}", dev.name());
            Ok(all)
        });
    }
    // A partials / weights mismatch is an error, not a panic.
    for dev in gpu_devices() {
        let opts = AttentionOpts::new(16, true);
        let q = upload_x(1, 3, 16, dev).and_then(|q| q.reshape([1, 3, 1, 16])).unwrap();
        let k = upload_x(2, 40, 16, dev).and_then(|k| k.reshape([1, 1, 40, 16])).unwrap();
        let tuning = AttentionTuning { splits: Some(4), tiles: tiny };
        let parts = gpu_attention_partials_tuned(&q, &k, &k, &opts, tuning).unwrap().expect("split");
        let w = QTensor::from_vec(GgmlType::F32, 5, 40, random_weights(3, GgmlType::F32, 5, 40), dev).unwrap();
        let err = w.qmatmul_add_combined(&parts, &upload_x(4, 1, 5, dev).unwrap()).expect_err("cols").to_string();
        assert!(err.contains("does not match"), "{err}");
        let w = QTensor::from_vec(GgmlType::F32, 5, 48, random_weights(3, GgmlType::F32, 5, 48), dev).unwrap();
        let err = w.qmatmul_add_combined(&parts, &upload_x(4, 1, 6, dev).unwrap()).expect_err("resid").to_string();
        assert!(err.contains("does not match"), "{err}");
    }
}

/// Per call of `f` (after the benchmarks' warm-up, `anygpu_core::bench::warm_up`: without it a
/// case that follows seconds of uploads ran at the clocks the GPU idled at), in µs: the host time
/// recording `iters` calls, and the GPU time running them (the batch is submitted at the sync,
/// so that time is the device's alone, plus one submit).
fn time_us(d: &Device, iters: usize, f: impl Fn() -> Result<Tensor>) -> (f64, f64) {
    // Twenty calls per sync, so that the GPU is kept busy by calls of a few µs too.
    anygpu_core::bench::warm_up(d, || (0..20).try_for_each(|_| f().map(drop))).unwrap();
    let t0 = Instant::now();
    for _ in 0..iters {
        f().unwrap();
    }
    let t1 = Instant::now();
    d.sync().unwrap();
    let per = |s: f64| s * 1e6 / iters as f64;
    (per((t1 - t0).as_secs_f64()), per(t1.elapsed().as_secs_f64()))
}

/// The GPU the benchmarks time: the first one that is not a constrained (software) device.
fn bench_gpu() -> Option<&'static Device> {
    gpu_devices().iter().find(|d| d.gpu().is_some_and(|c| !c.caps.constrained))
}

fn env_list(name: &str) -> Option<Vec<String>> {
    std::env::var(name).ok().map(|v| v.split(',').map(str::to_string).collect())
}

/// `QBENCH_SHAPES=ROWSxCOLS,...`: the shapes a bench runs instead of its own.
fn env_shapes() -> Option<Vec<(usize, usize)>> {
    let parse = |s: &String| {
        let (r, c) = s.split_once('x').unwrap_or_else(|| panic!("QBENCH_SHAPES: {s} is not ROWSxCOLS"));
        (r.parse().expect("rows"), c.parse().expect("cols"))
    };
    env_list("QBENCH_SHAPES").map(|v| v.iter().map(parse).collect())
}

/// Decode and prefill throughput on the first GPU: GB/s of weights for n = 1 (the floor is the
/// device's copy bandwidth), GFLOP/s for n = 512. `QBENCH_TYPES=Q4_0,Q4_K` picks types,
/// `QBENCH_TPR=16,32,64` sweeps the matvec's invocations per row, `QBENCH_SHAPES=2048x8192,...`
/// replaces the decode shapes (rows x cols; the 1B model's: 3072x2048 Q|K|V, 2048x2048 wo,
/// 16384x2048 gate|up, 2048x8192 down), `QBENCH_Q8=0,1` compares the exact and the Q8 matvec
/// (x rounded to 8-bit blocks; the bench's weights ask for neither, so `auto` is exact),
/// `QBENCH_SMALLN=1` compares both kernels for n = 2..16, `QBENCH_ROTATE=4` takes four copies of
/// each decode matrix in turn (matrices below the L2's size are otherwise read from it).
#[test]
#[ignore]
fn bench() {
    let _turn = one_at_a_time();
    let Some(d) = bench_gpu() else {
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
    let q8s = list("QBENCH_Q8");
    let rotate = std::env::var("QBENCH_ROTATE").ok().and_then(|v| v.parse().ok()).unwrap_or(1usize).max(1);
    let shapes = env_shapes().unwrap_or_else(|| vec![(576, 1536), (4096, 4096), (14336, 4096), (32000, 4096)]);
    for ty in TYPES {
        if types.as_ref().is_some_and(|o| !o.iter().any(|t| t == ty.name())) {
            continue;
        }
        for &(rows, cols) in &shapes {
            let bytes = random_weights(1, ty, rows, cols);
            let mb = bytes.len() as f64 / 1e6;
            // Copies of W taken in turn, so that each call reads its weights from DRAM as a
            // decode step does, not from the previous call's L2 (50 MB on an H100).
            let ws: Vec<QTensor> =
                (0..rotate).map(|_| QTensor::from_vec(ty, rows, cols, bytes.clone(), d).unwrap()).collect();
            let turn = std::cell::Cell::new(0usize);
            let next = || {
                turn.set(turn.get() + 1);
                &ws[turn.get() % ws.len()]
            };
            let x = upload_x(2, 1, cols, d).unwrap();
            for &tpr in &tprs {
                for &q8 in &q8s {
                    let opts = QOptions { threads_per_row: tpr, x_q8: q8.map(|v| v == 1), ..Default::default() };
                    let (host, gpu) = time_us(d, 200, || qmatmul_opts(next(), &x, opts));
                    // The kernel alone (its dispatches timed on the GPU, each in a pass of its
                    // own): the loop above is bound by the host for matrices this small.
                    let kernel_us = d
                        .gpu()
                        .expect("a GPU device")
                        .profile_dispatches(|| (0..20).try_for_each(|_| qmatmul_opts(next(), &x, opts).map(drop)))
                        .unwrap()
                        .1
                        .map(|ops| ops.iter().map(|o| o.2).sum::<f64>() * 1e6 / 20.0);
                    eprintln!(
                        "decode  {:5} [{rows:5}, {cols}] tpr {:>4} q8 {:>4} {mb:8.2} MB  gpu {gpu:7.1} us  host {host:5.1} us  kernels {}",
                        ty.name(),
                        tpr.map_or("auto".to_string(), |t| t.to_string()),
                        q8.map_or("auto".to_string(), |t| t.to_string()),
                        kernel_us.map_or("(no timestamps)".to_string(), |k| format!(
                            "{k:6.1} us {:6.0} GB/s",
                            mb * 1e3 / k
                        )),
                    );
                }
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

// ---- the cooperative-matrix prefill kernel (quant/coop.rs) ----------------------------------

/// The types the coop kernel takes (F32 and BF16 weights do not round safely to f16).
fn coop_types() -> Vec<GgmlType> {
    TYPES.into_iter().filter(|t| !matches!(t, GgmlType::F32 | GgmlType::BF16)).collect()
}

/// Columns for the coop tests: several 32-column K steps, an odd count of them (the double
/// buffer ends on either side); F16 rows that end mid-step, read by scalar (97) or vec4 (100)
/// x loads.
fn coop_cols(ty: GgmlType) -> Vec<usize> {
    match ty.block_size() {
        1 => vec![97, 100, 104],
        32 => vec![160],
        _ => vec![512],
    }
}

/// The coop kernel's test knobs (x tile, emulation) are process-wide; this puts them back when a
/// test ends, panics included.
struct CoopReset;
impl Drop for CoopReset {
    fn drop(&mut self) {
        anygpu_core::quant::coop::set_tile_override(None);
        anygpu_core::quant::coop::set_w_tile_override(None);
        anygpu_core::quant::coop::set_emulated(false);
        anygpu_core::quant::dequant_f16::set_override(None);
    }
}

/// The coop tiles (x rows, W rows) a device can run: BX = 64 and 128 by 128 W rows, and the
/// wide tile (128 by 192 W rows, where the plan allows it: K 64, no GLU; else the override
/// falls back to 128 rows). Emulated, BX = 128 needs 40 KiB of workgroup memory and the wide
/// tile 45 KiB (lavapipe: 32), which real cooperative matrices need as well, plus the scratch.
fn coop_tiles(ctx: &anygpu_core::gpu::GpuContext, emulated: bool) -> Vec<(u32, u32)> {
    let limit = ctx.caps.max_compute_workgroup_storage_size;
    let needs = |bytes: u32| !emulated || limit >= bytes;
    [(64, 128, 0), (128, 128, 40960), (128, 192, 46080)]
        .into_iter()
        .filter(|&(_, _, bytes)| needs(bytes))
        .map(|(bx, bw, _)| (bx, bw))
        .collect()
}

fn coop_opts(max_binding: Option<u64>) -> QOptions {
    QOptions { kernel: Some(QKernel::Coop), max_binding, ..Default::default() }
}

/// Weights whose every dequantized value is a multiple of 2^-6 below 2048 · 2^-6 in magnitude,
/// so exact in f16: the block scales (d, dmin) are 2^-6, the Q4_1 / Q5_1 offsets -2^-3, Q6_K's
/// signed scales within ±63 (|sc·(q - 32)| <= 2016), F16 values k/64.
fn f16_exact_weights(seed: u64, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    if ty == GgmlType::F16 {
        let mut rng = StdRng::seed_from_u64(seed);
        let v = (0..rows * cols).map(|_| f16::from_f32(rng.random_range(-64i32..=64) as f32 / 64.0));
        return v.flat_map(|h| h.to_le_bytes()).collect();
    }
    let mut bytes = random_weights(seed, ty, rows, cols);
    let d = f16::from_f32(1.0 / 64.0).to_le_bytes();
    let m = f16::from_f32(-0.125).to_le_bytes();
    for block in bytes.chunks_mut(ty.type_size()) {
        for (i, &off) in f16_fields(ty).iter().enumerate() {
            let is_offset = i == 1 && matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1);
            block[off..off + 2].copy_from_slice(if is_offset { &m } else { &d });
        }
        if ty == GgmlType::Q6K {
            for s in &mut block[192..208] {
                *s = ((*s as i8) % 64) as u8;
            }
        }
    }
    bytes
}

/// x of multiples of 1/8 in [-2, 2]: exact in f16.
fn f16_exact_x(seed: u64, n: usize) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-16i32..=16) as f32 / 8.0).collect()
}

/// The coop kernel on f16-exact data equals the CPU product: every dequantized weight and x is
/// exact in f16, every product x·w is a multiple of 2^-9 of magnitude <= 63, and every partial
/// sum (at most 512 terms: < 2^15) then fits f32's 24 bits, so both sides compute the exact
/// sum whatever the order or the rounding mode. Any indexing slip (a lost column, a wrong row,
/// a stale buffer) changes an output by at least 2^-9, above the 1e-3 allowed. For every type:
/// both x tiles (64, 128) and the wide W tile (192 rows), odd shapes (rows 260: two whole
/// 128-row W tiles, which leave straight from the accumulators where their x tile is whole too,
/// and a third of 4 rows, which leaves through the scratch; or a whole 192-row tile and one of
/// 68 rows, which drains through the wide tile's scratch slots in turns; n 130 and 5), one
/// binding and row slices of ~48 rows (the x rows then come in chunks too, at offsets inside
/// their bindings), and the default kernel choice.
///
/// On devices with cooperative matrices the kernel runs as it is; elsewhere (lavapipe) forcing
/// it must fail with `Unsupported` and the reason, and the kernel runs with the cooperative
/// matrices emulated (`coop::set_emulated`) for Q4_0, Q4_K and F16 (97, 100 and 104 columns): everything but
/// the coop operations themselves, whose conventions are those of ops/matmul_coop.wgsl; the
/// tiles that fit the device's workgroup memory ([`coop_tiles`]; lavapipe: BX = 64 only).
#[test]
fn coop_kernel_matches_cpu_exactly() {
    use anygpu_core::quant::coop;
    let _turn = one_at_a_time();
    let _reset = CoopReset;
    let mut ran = Vec::new();
    for ty in coop_types() {
        for cols in coop_cols(ty) {
            let rows = 260;
            let bytes = f16_exact_weights(ty.id() as u64 + 300, ty, rows, cols);
            let w_cpu = QTensor::from_vec(ty, rows, cols, bytes.clone(), &Device::Cpu).unwrap();
            let sliced = 256 + 48 * w_cpu.row_bytes() as u64;
            for n in [130usize, 5] {
                let x_cpu = Tensor::from_vec(f16_exact_x(n as u64, n * cols), [n, cols], &Device::Cpu).unwrap();
                let want = w_cpu.qmatmul(&x_cpu).unwrap().to_vec_f32().unwrap();
                for d in gpu_devices() {
                    let ctx = d.gpu().expect("a GPU device");
                    let w = QTensor::from_vec(ty, rows, cols, bytes.clone(), d).unwrap();
                    let x = x_cpu.to_device(d).unwrap();
                    for emulated in [false, true] {
                        // Emulated pipelines take seconds each to compile on lavapipe: a few
                        // types cover the kernel's paths (x by f16 runs and by element, F16
                        // rows read as 16-byte words (104 columns), raw words (100) or decoded
                        // (97), 18-byte blocks loaded
                        // early, k-quant super-blocks loaded early (Q4_K, Q5_K, Q6_K) and late
                        // (Q3_K)).
                        if emulated
                            && !matches!(
                                ty,
                                GgmlType::Q4_0
                                    | GgmlType::Q4K
                                    | GgmlType::Q5K
                                    | GgmlType::Q6K
                                    | GgmlType::Q3K
                                    | GgmlType::F16
                            )
                        {
                            continue;
                        }
                        coop::set_emulated(emulated);
                        let what = format!("coop {ty} [{rows}, {cols}] n={n} on {} (emulated: {emulated})", d.name());
                        if let Some(why) = coop::unsupported_reason(ctx, ty) {
                            let err = qmatmul_opts(&w, &x, coop_opts(None)).expect_err(&what);
                            assert!(matches!(err, anygpu_core::Error::Unsupported(_)), "{what}: {err}");
                            assert!(err.to_string().contains(&why), "{what}: {err}");
                            continue;
                        }
                        if emulated && ctx.caps.cooperative_matrix {
                            continue; // ran as it is
                        }
                        for (bx, bw) in coop_tiles(ctx, emulated) {
                            coop::set_tile_override(Some(bx));
                            coop::set_w_tile_override(Some(bw));
                            for limit in [None, Some(sliced)] {
                                let got = qmatmul_opts(&w, &x, coop_opts(limit)).and_then(|y| y.to_vec_f32());
                                let got = got.unwrap_or_else(|e| panic!("{what} BX={bx} BW={bw} {limit:?}: {e}"));
                                check_close(
                                    &format!("{what} BX={bx} BW={bw} binding {limit:?}"),
                                    &got,
                                    &want,
                                    1e-3,
                                    0.0,
                                )
                                .unwrap_or_else(|m| panic!("{m}"));
                            }
                        }
                        coop::set_tile_override(None);
                        coop::set_w_tile_override(None);
                        let got = w.qmatmul(&x).unwrap().to_vec_f32().unwrap();
                        check_close(&format!("{what} default kernel"), &got, &want, 1e-3, 0.0)
                            .unwrap_or_else(|m| panic!("{m}"));
                        ran.push(format!(
                            "{ty} cols={cols} n={n} on {}{}",
                            d.name(),
                            if emulated { " emulated" } else { "" }
                        ));
                    }
                    coop::set_emulated(false);
                }
            }
        }
    }
    // F32 and BF16 weights never take it, on any device.
    for ty in [GgmlType::F32, GgmlType::BF16] {
        for d in gpu_devices() {
            let w = QTensor::from_vec(ty, 7, 64, random_weights(9, ty, 7, 64), d).unwrap();
            let err = qmatmul_opts(&w, &upload_x(3, 20, 64, d).unwrap(), coop_opts(None)).expect_err("F32 / BF16");
            assert!(err.to_string().contains("do not round safely to f16"), "{err}");
        }
    }
    eprintln!("coop kernel ran: {}", if ran.is_empty() { "nowhere".to_string() } else { ran.join("; ") });
}

/// The bound that `coop_kernel_within_f16_rounding_of_cpu` (below) explains, for every output of
/// x [n, cols] times W [rows, cols] (row-major f32 values): (2^-9 + 2^-20 + 3 · cols · 2^-23) ·
/// Σ|x||w| per output, plus `slack`.
fn f16_rounding_bound(xs: &[f32], wf: &[f32], cols: usize, slack: f32) -> Vec<f32> {
    let k = 2f64.powi(-9) + 2f64.powi(-20) + 3.0 * cols as f64 * 2f64.powi(-23);
    let mut bound = Vec::with_capacity(xs.len() / cols * (wf.len() / cols));
    for xr in xs.chunks(cols) {
        for wr in wf.chunks(cols) {
            let s: f64 = xr.iter().zip(wr).map(|(a, b)| (a.abs() * b.abs()) as f64).sum();
            bound.push((k * s) as f32 + slack);
        }
    }
    bound
}

/// The coop kernel on random data against the CPU's f32 product, within the error that
/// rounding x and w to f16 allows. Per output y = Σ x_k w_k, with S = Σ |x_k| |w_k|:
/// - x̂ = x(1 + δ), ŵ = w(1 + ε) with |δ|, |ε| < 2^-10 (one f16 ulp: any rounding mode; 2^-11
///   under round-to-nearest), so |x̂ŵ - xw| < (2^-9 + 2^-20) |xw|;
/// - a product of two f16 is exact in f32 (11 + 11 significant bits); the GPU's f32
///   accumulation (tensor cores align and truncate within each 16-term step) and the CPU's, in
///   another order, each add at most ~cols · 2^-23 · S.
///
/// Bound: (2^-9 + 2^-20 + 3 · cols · 2^-23) · S, checked per output (x in [-1, 1] is never
/// clamped). Typical errors are far smaller (the roundings have random signs); the exact test
/// above is the sharp one.
#[test]
fn coop_kernel_within_f16_rounding_of_cpu() {
    use anygpu_core::quant::coop;
    let _turn = one_at_a_time();
    let (rows, n) = (131usize, 130usize);
    for ty in coop_types() {
        for cols in coop_cols(ty) {
            let bytes = random_weights(ty.id() as u64 + 500, ty, rows, cols);
            let w_cpu = QTensor::from_vec(ty, rows, cols, bytes.clone(), &Device::Cpu).unwrap();
            let xs = rand_vec(77, n * cols);
            let x_cpu = Tensor::from_vec(xs.clone(), [n, cols], &Device::Cpu).unwrap();
            let mut want = None;
            for d in gpu_devices() {
                if coop::unsupported_reason(d.gpu().expect("a GPU device"), ty).is_some() {
                    continue; // checked by coop_kernel_matches_cpu_exactly
                }
                let (want, bound) = want.get_or_insert_with(|| {
                    let y = w_cpu.qmatmul(&x_cpu).unwrap().to_vec_f32().unwrap();
                    let wf = dequantize_to_vec(ty, &bytes, rows * cols).unwrap();
                    (y, f16_rounding_bound(&xs, &wf, cols, 1e-6))
                });
                let w = QTensor::from_vec(ty, rows, cols, bytes.clone(), d).unwrap();
                let got = qmatmul_opts(&w, &x_cpu.to_device(d).unwrap(), coop_opts(None))
                    .and_then(|y| y.to_vec_f32())
                    .unwrap_or_else(|e| panic!("coop {ty} on {}: {e}", d.name()));
                for (i, ((g, r), b)) in got.iter().zip(want.iter()).zip(bound.iter()).enumerate() {
                    assert!(
                        (g - r).abs() <= *b,
                        "coop {ty} [{rows}, {cols}] on {}: output {i} (x row {}, W row {}): got {g}, CPU {r}, bound {b}",
                        d.name(),
                        i / rows,
                        i % rows
                    );
                }
            }
        }
    }
}

/// Parses, validates and translates to SPIR-V with the capabilities wgpu grants a device with
/// SHADER_F16, SUBGROUP and EXPERIMENTAL_COOPERATIVE_MATRIX, or (`emulated`) with SHADER_F16
/// only: the tests' emulated variant must not use the others.
fn validate_coop_wgsl(src: &str, emulated: bool) -> std::result::Result<(), String> {
    use wgpu::naga::valid::Capabilities as C;
    let mut caps = C::SHADER_FLOAT16_IN_FLOAT32 | C::SHADER_FLOAT16;
    if !emulated {
        caps |= C::COOPERATIVE_MATRIX | C::SUBGROUP;
    }
    anygpu_core::testing::validate_wgsl_for_vulkan(src, caps)
}

/// Runs `f(device, x tile)` on every GPU device that can run the coop kernel for `ty`
/// (emulated where it has no cooperative matrices) for each tile that fits it ([`coop_tiles`];
/// `f` is told the x tile; the wide W tile applies where the product allows it), then checks
/// that the profile `f` returns (where the device has timestamps) holds only the product's own
/// dispatches; returns where it ran.
fn on_coop_devices(
    ty: GgmlType,
    mut f: impl FnMut(&Device, u32) -> Option<anygpu_core::gpu::profile::OpTimes>,
) -> Vec<String> {
    use anygpu_core::quant::coop;
    let mut ran = Vec::new();
    for d in gpu_devices() {
        let ctx = d.gpu().expect("a GPU device");
        let emulated = !ctx.caps.cooperative_matrix;
        coop::set_emulated(emulated);
        if coop::unsupported_reason(ctx, ty).is_some() {
            coop::set_emulated(false);
            continue;
        }
        for (bx, bw) in coop_tiles(ctx, emulated) {
            coop::set_tile_override(Some(bx));
            coop::set_w_tile_override(Some(bw));
            if let Some(ops) = f(d, bx) {
                let what = format!("{ty} BX={bx} BW={bw} on {}", d.name());
                assert!(ops.iter().all(|o| o.0.starts_with("qmatmul")), "{what}: {ops:?}");
            }
        }
        coop::set_tile_override(None);
        coop::set_w_tile_override(None);
        coop::set_emulated(false);
        ran.push(format!("{ty} on {}{}", d.name(), if emulated { " emulated" } else { "" }));
    }
    ran
}

/// The coop kernel's GLU epilogue (`qmatmul_glu` of many x rows): silu(gate) * up of the
/// gate|up stack in the product's own dispatch, against the CPU's product and a host SiLU, on
/// f16-exact data (the products are exact, only exp differs). F = 131 output columns (three
/// tiles of 64, the last mostly empty), n = 130 and 70, both x tiles, for an early-loaded type
/// (Q4_0), a late-decoded one (Q3_K) and raw F16 words; emulated where the device has no
/// cooperative matrices. Where timestamps allow, the profile shows the product alone: no
/// separate silu or mul dispatch.
#[test]
fn coop_glu_epilogue_matches_composition() {
    let _turn = one_at_a_time();
    let _reset = CoopReset;
    let f = 131usize;
    let mut ran = Vec::new();
    for ty in [GgmlType::Q4_0, GgmlType::Q3K, GgmlType::F16] {
        let cols = coop_cols(ty)[coop_cols(ty).len() - 1];
        let bytes = f16_exact_weights(ty.id() as u64 + 700, ty, 2 * f, cols);
        let w_cpu = QTensor::from_vec(ty, 2 * f, cols, bytes.clone(), &Device::Cpu).unwrap();
        for n in [130usize, 70] {
            let x_cpu = Tensor::from_vec(f16_exact_x(n as u64 + 9, n * cols), [n, cols], &Device::Cpu).unwrap();
            let y = w_cpu.qmatmul(&x_cpu).unwrap().to_vec_f32().unwrap();
            let want: Vec<f32> = (0..n * f)
                .map(|i| {
                    let (r, c) = (i / f, i % f);
                    let (g, u) = (y[r * 2 * f + c] as f64, y[r * 2 * f + f + c] as f64);
                    (g / (1.0 + (-g).exp()) * u) as f32
                })
                .collect();
            ran.extend(on_coop_devices(ty, |d, bx| {
                let w = QTensor::from_vec(ty, 2 * f, cols, bytes.clone(), d).unwrap();
                let x = x_cpu.to_device(d).unwrap();
                let what = format!("coop GLU {ty} [{}, {cols}] n={n} BX={bx} on {}", 2 * f, d.name());
                let (got, ops) = d
                    .gpu()
                    .expect("a GPU device")
                    .profile_dispatches(|| w.qmatmul_glu_opts(&x, None, coop_opts(None)))
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(got.dims(), &[n, f], "{what}");
                check_close(&what, &got.to_vec_f32().unwrap(), &want, 1e-4, 1e-4).unwrap_or_else(|m| panic!("{m}"));
                ops
            }));
        }
    }
    eprintln!("coop GLU ran: {}", if ran.is_empty() { "nowhere".to_string() } else { ran.join("; ") });
}

/// The RMSNorm prologue on the coop path (`qmatmul_glu_rms` and `qmatmul_rms` of many x rows):
/// the norm applied as x is rounded to f16 for the kernel (`coop::x_to_f16`), one dispatch
/// before the product and none of its own (the profile, where timestamps allow, shows only the
/// product's), against the CPU's composition (norm, plain products, host SiLU). The only
/// difference is x's rounding to f16, so each output must lie within
/// `coop_kernel_within_f16_rounding_of_cpu`'s bound of its product (for the GLU output, that
/// bound carried through silu(g) * u). Q4_0 (early-loaded), Q4_K and F16 (raw words), odd row
/// counts (partial tiles), both x tiles; emulated where the device has no cooperative matrices.
#[test]
fn coop_norm_prologue_matches_composition() {
    let _turn = one_at_a_time();
    let _reset = CoopReset;
    let (f, rows, n, eps) = (67usize, 131usize, 130usize, 1e-5f32);
    let mut ran = Vec::new();
    for (ty, cols) in [(GgmlType::Q4_0, 160usize), (GgmlType::Q4K, 512), (GgmlType::F16, 104)] {
        let gu_bytes = random_weights(ty.id() as u64 + 800, ty, 2 * f, cols);
        let w_bytes = random_weights(ty.id() as u64 + 850, ty, rows, cols);
        // A row scale far from 1 (the norm must be applied) and a weight of both signs.
        let xs: Vec<f32> = rand_vec(81, n * cols).iter().map(|v| 7.0 * v).collect();
        let gs = rand_vec(82, cols);
        let x_cpu = Tensor::from_vec(xs, [n, cols], &Device::Cpu).unwrap();
        let g_cpu = Tensor::from_vec(gs, [cols], &Device::Cpu).unwrap();
        let xn = x_cpu.rms_norm(Some(&g_cpu), eps).unwrap().to_vec_f32().unwrap();
        // Each product of the normalised x with its f16 rounding bound.
        let products = |bytes: &[u8], r: usize| -> (Vec<f32>, Vec<f32>) {
            let w = QTensor::from_vec(ty, r, cols, bytes.to_vec(), &Device::Cpu).unwrap();
            let x = Tensor::from_vec(xn.clone(), [n, cols], &Device::Cpu).unwrap();
            let y = w.qmatmul(&x).unwrap().to_vec_f32().unwrap();
            let wf = dequantize_to_vec(ty, bytes, r * cols).unwrap();
            (y, f16_rounding_bound(&xn, &wf, cols, 1e-5))
        };
        let (y, yb) = products(&w_bytes, rows);
        let (gu, gub) = products(&gu_bytes, 2 * f);
        let silu = |v: f64| v / (1.0 + (-v).exp());
        let (mut glu, mut glub) = (Vec::new(), Vec::new());
        for i in 0..n * f {
            let (r, c) = (i / f, i % f);
            let (g, u) = (gu[r * 2 * f + c] as f64, gu[r * 2 * f + f + c] as f64);
            let (bg, bu) = (gub[r * 2 * f + c] as f64, gub[r * 2 * f + f + c] as f64);
            glu.push((silu(g) * u) as f32);
            // |silu'| <= 1.1; the second-order term bg * bu is far below the slack.
            glub.push((1.1 * bg * (u.abs() + bu) + silu(g).abs() * bu) as f32 + 1e-5);
        }
        let within = |what: &str, got: &[f32], want: &[f32], bound: &[f32]| {
            assert_eq!(got.len(), want.len(), "{what}");
            for (i, ((g, w), b)) in got.iter().zip(want).zip(bound).enumerate() {
                assert!((g - w).abs() <= *b, "{what}: output {i}: got {g}, CPU {w}, bound {b}");
            }
        };
        ran.extend(on_coop_devices(ty, |d, bx| {
            let ctx = d.gpu().expect("a GPU device");
            let x = x_cpu.to_device(d).unwrap();
            let g = g_cpu.to_device(d).unwrap();
            let norm = RmsNorm::new(&g, eps);
            let w = QTensor::from_vec(ty, rows, cols, w_bytes.clone(), d).unwrap();
            let what = format!("coop rms {ty} [{rows}, {cols}] n={n} BX={bx} on {}", d.name());
            let (got, ops) =
                ctx.profile_dispatches(|| w.qmatmul_rms(&x, norm)).unwrap_or_else(|e| panic!("{what}: {e}"));
            within(&what, &got.to_vec_f32().unwrap(), &y, &yb);
            if let Some(ops) = &ops {
                assert!(ops.iter().any(|o| o.0.starts_with("qmatmul x to f16")), "{what}: {ops:?}");
            }
            let gate_up = QTensor::from_vec(ty, 2 * f, cols, gu_bytes.clone(), d).unwrap();
            let what = format!("coop GLU rms {ty} [{}, {cols}] n={n} BX={bx} on {}", 2 * f, d.name());
            let (got, ops) = ctx
                .profile_dispatches(|| gate_up.qmatmul_glu_opts(&x, Some(norm), coop_opts(None)))
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(got.dims(), &[n, f], "{what}");
            within(&what, &got.to_vec_f32().unwrap(), &glu, &glub);
            ops
        }));
    }
    eprintln!("coop norm prologue ran: {}", if ran.is_empty() { "nowhere".to_string() } else { ran.join("; ") });
}

/// The coop kernel's residual epilogue (`qmatmul_add` of many x rows): resid + x W^T in the
/// product's own dispatch, exactly the CPU's on f16-exact data (residuals multiples of 1/8),
/// for Q4_0 (loaded early), Q3_K (late) and F16, both x tiles and the wide W tile (Q4_0, F16:
/// a whole 192-row tile and a partial one, drained in turns), one binding and row slices of
/// ~48 rows (the residual's offset per slice), emulated where the device has no cooperative
/// matrices. Where timestamps allow, the profile shows no separate add dispatch.
#[test]
fn coop_add_epilogue_matches_composition() {
    let _turn = one_at_a_time();
    let _reset = CoopReset;
    // Rows 260: whole W tiles (the residual loaded into the accumulators) and a partial one
    // (added in the scratch drain).
    let (rows, n) = (260usize, 130usize);
    let mut ran = Vec::new();
    for ty in [GgmlType::Q4_0, GgmlType::Q3K, GgmlType::F16] {
        let cols = coop_cols(ty)[coop_cols(ty).len() - 1];
        let bytes = f16_exact_weights(ty.id() as u64 + 900, ty, rows, cols);
        let w_cpu = QTensor::from_vec(ty, rows, cols, bytes.clone(), &Device::Cpu).unwrap();
        let sliced = 256 + 48 * w_cpu.row_bytes() as u64;
        let x_cpu = Tensor::from_vec(f16_exact_x(31, n * cols), [n, cols], &Device::Cpu).unwrap();
        let r_cpu = Tensor::from_vec(f16_exact_x(32, n * rows), [n, rows], &Device::Cpu).unwrap();
        let want = w_cpu.qmatmul_add(&x_cpu, &r_cpu).unwrap().to_vec_f32().unwrap();
        ran.extend(on_coop_devices(ty, |d, bx| {
            let w = QTensor::from_vec(ty, rows, cols, bytes.clone(), d).unwrap();
            let (x, r) = (x_cpu.to_device(d).unwrap(), r_cpu.to_device(d).unwrap());
            let mut last = None;
            for limit in [None, Some(sliced)] {
                let what = format!("coop add {ty} [{rows}, {cols}] n={n} BX={bx} {limit:?} on {}", d.name());
                let (got, ops) = d
                    .gpu()
                    .expect("a GPU device")
                    .profile_dispatches(|| w.qmatmul_add_opts(&x, &r, coop_opts(limit)))
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                check_close(&what, &got.to_vec_f32().unwrap(), &want, 1e-3, 0.0).unwrap_or_else(|m| panic!("{m}"));
                last = ops;
            }
            last
        }));
    }
    eprintln!("coop add ran: {}", if ran.is_empty() { "nowhere".to_string() } else { ran.join("; ") });
}

/// The GLU epilogue's f16 output (`QOptions::f16_out`) and the down projection that reads it:
/// the output is the f32 GLU output rounded to f16 (within half an f16 step of it), and the
/// down projection of it equals, bit for bit, the down projection of the f32 output (which the
/// product rounds to f16 itself, in a dispatch of its own that the f16 input skips: the
/// profile, where timestamps allow, shows it for the one and not the other). F a multiple of 8
/// and of the type's block (the down projection's rows): 136 for F16 and 160 for Q4_0 (partial
/// 64-column tiles), 256 for Q3_K; n 130 and 70, both x tiles; emulated where the device has
/// no cooperative matrices. Also: products that do not read x as f16 (tiled, matvec, the CPU)
/// take the f16 output widened to f32, exactly.
#[test]
fn coop_glu_f16_out_feeds_the_down_product() {
    let _turn = one_at_a_time();
    let _reset = CoopReset;
    let down_rows = 72usize;
    let mut ran = Vec::new();
    for ty in [GgmlType::Q4_0, GgmlType::Q3K, GgmlType::F16] {
        let cols = coop_cols(ty)[coop_cols(ty).len() - 1];
        let f = match ty.block_size() {
            1 => 136usize,
            32 => 160,
            _ => 256,
        };
        let gu_bytes = f16_exact_weights(ty.id() as u64 + 1100, ty, 2 * f, cols);
        let down_bytes = f16_exact_weights(ty.id() as u64 + 1200, ty, down_rows, f);
        for n in [130usize, 70] {
            let x_cpu = Tensor::from_vec(f16_exact_x(n as u64 + 41, n * cols), [n, cols], &Device::Cpu).unwrap();
            ran.extend(on_coop_devices(ty, |d, bx| {
                let what = format!("coop GLU f16 out {ty} [{}, {cols}] n={n} BX={bx} on {}", 2 * f, d.name());
                let ctx = d.gpu().expect("a GPU device");
                let gu = QTensor::from_vec(ty, 2 * f, cols, gu_bytes.clone(), d).unwrap();
                let down = QTensor::from_vec(ty, down_rows, f, down_bytes.clone(), d).unwrap();
                let x = x_cpu.to_device(d).unwrap();
                let g32 = gu.qmatmul_glu_opts(&x, None, coop_opts(None)).unwrap();
                let half = QOptions { f16_out: true, ..coop_opts(None) };
                let g16 = gu.qmatmul_glu_opts(&x, None, half).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert_eq!(g16.dtype(), anygpu_core::DType::F16, "{what}");
                assert_eq!(g16.dims(), &[n, f], "{what}");
                let (w32, w16) = (g32.to_vec_f32().unwrap(), g16.to_dtype(anygpu_core::DType::F32).unwrap());
                let w16 = w16.to_vec_f32().unwrap();
                for (i, (&a, &b)) in w32.iter().zip(&w16).enumerate() {
                    let step = f16::from_f32(a).to_f32() - a;
                    assert!((a - b).abs() <= step.abs().max(a.abs() * 4.9e-4), "{what} [{i}]: f32 {a}, f16 {b}");
                }
                // The model's path: the residual add (qmatmul_add), and the plain product.
                let r = Tensor::from_vec(f16_exact_x(n as u64 + 43, n * down_rows), [n, down_rows], d).unwrap();
                for add in [true, false] {
                    let down_of = |g: &Tensor| match add {
                        true => down.qmatmul_add_opts(g, &r, coop_opts(None)),
                        false => qmatmul_opts(&down, g, coop_opts(None)),
                    };
                    let (y32, ops32) = ctx.profile_dispatches(|| down_of(&g32)).unwrap();
                    let (y16, ops16) =
                        ctx.profile_dispatches(|| down_of(&g16)).unwrap_or_else(|e| panic!("{what}: {e}"));
                    let y = (y32.to_vec_f32().unwrap(), y16.to_vec_f32().unwrap());
                    assert_eq!(y.0, y.1, "{what}: the down projections (add {add})");
                    // f32 x: the rounding dispatch and the product; f16 x: the product alone.
                    if let (Some(o32), Some(o16)) = (ops32, ops16) {
                        let rounds = o32.iter().any(|o| o.0.contains("to f16"));
                        assert!(rounds && o16.len() == 1, "{what} (add {add}): {o32:?} / {o16:?}");
                    }
                }
                // Kernels that read f32 x widen the f16 output first.
                let g16_wide = g16.to_dtype(anygpu_core::DType::F32).unwrap();
                for k in [QKernel::Tiled, QKernel::Matvec] {
                    let rows = if k == QKernel::Matvec { g16.narrow(0, 0, 1).unwrap() } else { g16.clone() };
                    let wide = if k == QKernel::Matvec { g16_wide.narrow(0, 0, 1).unwrap() } else { g16_wide.clone() };
                    let opts = QOptions { kernel: Some(k), ..Default::default() };
                    let (a, b) = (qmatmul_opts(&down, &rows, opts).unwrap(), qmatmul_opts(&down, &wide, opts).unwrap());
                    assert_eq!(a.to_vec_f32().unwrap(), b.to_vec_f32().unwrap(), "{what}: {k:?} on f16 x");
                }
                let down_cpu = QTensor::from_vec(ty, down_rows, f, down_bytes.clone(), &Device::Cpu).unwrap();
                let (g16_cpu, wide_cpu) =
                    (g16.to_device(&Device::Cpu).unwrap(), g16_wide.to_device(&Device::Cpu).unwrap());
                assert_eq!(
                    down_cpu.qmatmul(&g16_cpu).unwrap().to_vec_f32().unwrap(),
                    down_cpu.qmatmul(&wide_cpu).unwrap().to_vec_f32().unwrap(),
                    "{what}: the CPU on f16 x"
                );
                None
            }));
        }
    }
    eprintln!("coop GLU f16 out ran: {}", if ran.is_empty() { "nowhere".to_string() } else { ran.join("; ") });
}

/// The f16 copy of quantized weights (quant/dequant_f16.rs) against the CPU's dequantization
/// rounded to f16, for every quantized type, rows of 1, 7 and 33 of each type's column cases,
/// in one dispatch and in dispatches of three rows (a binding limit that slices the copy, each
/// slice's blocks bound at an offset). The GPU's f32 decoding may fuse a multiply and an add
/// where the CPU's rounds twice, so a value may sit one f16 step away, never more.
#[test]
fn dequant_f16_matches_cpu() {
    use anygpu_core::quant::dequant_f16::dequantize_to_f16;
    let _turn = one_at_a_time();
    let mut ran = Vec::new();
    for d in gpu_devices().iter().filter(|d| d.gpu().is_some_and(|c| c.caps.shader_f16)) {
        for ty in TYPES.into_iter().filter(|t| t.is_quantized()) {
            for cols in col_cases(ty) {
                for rows in [1usize, 7, 33] {
                    let bytes = random_weights(ty.id() as u64 * 77 + (rows * cols) as u64, ty, rows, cols);
                    let want: Vec<f32> = dequantize_to_vec(ty, &bytes, rows * cols)
                        .unwrap()
                        .into_iter()
                        .map(|v| f16::from_f32(v).to_f32())
                        .collect();
                    let w = QTensor::from_vec(ty, rows, cols, bytes, d).unwrap();
                    for limit in [None, Some(256 + 3 * 2 * cols as u64)] {
                        let what = format!("f16 copy of {ty} [{rows}, {cols}] {limit:?} on {}", d.name());
                        let opts = QOptions { max_binding: limit, ..Default::default() };
                        let copy = dequantize_to_f16(&w, &opts).unwrap_or_else(|e| panic!("{what}: {e}"));
                        assert_eq!((copy.ggml_type(), copy.rows(), copy.cols()), (GgmlType::F16, rows, cols), "{what}");
                        let got = copy.dequantize().unwrap().to_vec_f32().unwrap();
                        assert_eq!(got.len(), want.len(), "{what}");
                        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                            // One f16 step at w's magnitude (w is f16 already).
                            let step = w.abs() * 2f32.powi(-10) + 2f32.powi(-24);
                            assert!((g - w).abs() <= step, "{what}: element {i}: got {g}, reference {w}");
                        }
                    }
                }
            }
        }
        ran.push(d.name());
    }
    assert!(
        !ran.is_empty() || std::env::var("ANYGPU_REQUIRE_GPU").is_err(),
        "no GPU with f16 shaders ran the f16 copy"
    );
    eprintln!("f16 copy ran on: {}", if ran.is_empty() { "nothing".to_string() } else { ran.join("; ") });
}

/// A coop product of quantized weights through their f16 copy equals the same product
/// decoding the blocks in its staging: the copy holds the f16 values the staging rounds to,
/// and the F16 kernel adds them up in the same order, so bit for bit for the types whose runs
/// are loaded before the products (K steps of 64, as F16's). The others step K by 32, where
/// the wide W tile does not fit, which the copy's plan may take: a residual is then added at
/// another point of the sum for some rows (the H100 showed one f32 ulp for Q5_0), so those
/// agree to 1e-6 of the largest output. Past the copy (every type's: `dequant_f16_matches_cpu`)
/// the product is the F16 one whatever the type, so three types: Q4_0 and Q6_K (early, 32- and
/// 256-weight blocks) and Q3_K (late); plain and with the GLU (f16 output) and residual
/// epilogues, n = 130 (forced on: the default copies from `DEQUANT_MIN_N` rows), every tile,
/// emulated where the device has no cooperative matrices.
#[test]
fn coop_f16_copy_equals_decoded_product() {
    use anygpu_core::quant::dequant_f16;
    let _turn = one_at_a_time();
    let _reset = CoopReset;
    let (rows, n) = (260usize, 130usize);
    let mut ran = Vec::new();
    for ty in [GgmlType::Q4_0, GgmlType::Q6K, GgmlType::Q3K] {
        let cols = coop_cols(ty)[0];
        let bytes = random_weights(ty.id() as u64 + 1300, ty, rows, cols);
        let x_cpu = Tensor::from_vec(rand_vec(41, n * cols), [n, cols], &Device::Cpu).unwrap();
        let r_cpu = Tensor::from_vec(rand_vec(42, n * rows), [n, rows], &Device::Cpu).unwrap();
        ran.extend(on_coop_devices(ty, |d, bx| {
            let w = QTensor::from_vec(ty, rows, cols, bytes.clone(), d).unwrap();
            let (x, r) = (x_cpu.to_device(d).unwrap(), r_cpu.to_device(d).unwrap());
            let glu = QOptions { f16_out: true, ..coop_opts(None) };
            for (epi, run) in [
                ("plain", &(|| qmatmul_opts(&w, &x, coop_opts(None))) as &dyn Fn() -> Result<Tensor>),
                ("glu", &|| w.qmatmul_glu_opts(&x, None, glu)),
                ("add", &|| w.qmatmul_add_opts(&x, &r, coop_opts(None))),
            ] {
                let what = format!("coop {ty} [{rows}, {cols}] n={n} BX={bx} {epi} on {}", d.name());
                let mut outs = Vec::new();
                for copy in [false, true] {
                    dequant_f16::set_override(Some(copy));
                    let ctx = d.gpu().expect("a GPU device");
                    let (out, ops) =
                        ctx.profile_dispatches(run).unwrap_or_else(|e| panic!("{what} (copy {copy}): {e}"));
                    // Where timestamps allow, the profile shows the copy taken, or not.
                    if let Some(ops) = ops {
                        let copied = ops.iter().any(|o| o.0.starts_with("dequantize to f16"));
                        assert_eq!(copied, copy, "{what} (copy {copy}): {ops:?}");
                    }
                    outs.push(out.to_dtype(anygpu_core::DType::F32).unwrap().to_vec_f32().unwrap());
                }
                dequant_f16::set_override(None);
                assert!(outs.iter().flatten().all(|v| v.is_finite()), "{what}: non-finite output");
                let early = !matches!(ty, GgmlType::Q5_0 | GgmlType::Q2K | GgmlType::Q3K);
                let tol = if early { 0.0 } else { 1e-6 * outs[0].iter().fold(0f32, |m, v| m.max(v.abs())) };
                if let Some(i) = (0..outs[0].len()).find(|&i| (outs[0][i] - outs[1][i]).abs() > tol) {
                    panic!("{what}: element {i}: decoded {} but through the f16 copy {}", outs[0][i], outs[1][i]);
                }
            }
            None
        }));
    }
    eprintln!("coop f16 copy ran: {}", if ran.is_empty() { "nowhere".to_string() } else { ran.join("; ") });
}

/// Copies made ahead (quant::copy_ahead: later products' f16 copies recorded beside an
/// earlier product, in its compute pass) give the very products that copies made right before
/// them give. Q4_0 weights of 260, 132 and 68 rows: each later copy fits beside the product
/// before it (at most three times its weights), so the schedule makes it there; the products
/// run in the schedule's order, out of it, and with the tiled kernel forced on the second
/// (which then drops the copy made for it); n = 130 (the copy forced on), plain and GLU
/// (f16 output) products, every tile, emulated where the device has no cooperative matrices.
#[test]
fn coop_copies_made_ahead_equal_copies_made_before() {
    use anygpu_core::quant::{copy_ahead, dequant_f16, CopyAhead};
    let _turn = one_at_a_time();
    let _reset = CoopReset;
    let (ty, n) = (GgmlType::Q4_0, 130usize);
    let cols = coop_cols(ty)[0];
    let x_cpu = Tensor::from_vec(rand_vec(43, n * cols), [n, cols], &Device::Cpu).unwrap();
    let ran = on_coop_devices(ty, |d, bx| {
        let ws: Vec<QTensor> = [260usize, 132, 68]
            .iter()
            .enumerate()
            .map(|(i, &rows)| {
                QTensor::from_vec(ty, rows, cols, random_weights(1400 + i as u64, ty, rows, cols), d).unwrap()
            })
            .collect();
        let x = x_cpu.to_device(d).unwrap();
        let glu = QOptions { f16_out: true, ..coop_opts(None) };
        let products = |order: [usize; 3]| -> Vec<Vec<f32>> {
            let mut outs = vec![Vec::new(); 3];
            for i in order {
                let y = match i {
                    0 => ws[0].qmatmul_glu_opts(&x, None, glu),
                    _ => qmatmul_opts(&ws[i], &x, coop_opts(None)),
                };
                outs[i] = y.and_then(|y| y.to_dtype(anygpu_core::DType::F32)?.to_vec_f32()).unwrap();
            }
            outs
        };
        dequant_f16::set_override(Some(true));
        let before = products([0, 1, 2]);
        let what = format!("{ty} n={n} BX={bx} on {}", d.name());
        // In the schedule's order each later copy is made beside the product before it; out of
        // it, the third product makes its own copy and the second takes the one made ahead.
        for (order, made_ahead) in [([0, 1, 2], 2), ([0, 2, 1], 1)] {
            let taken = copy_ahead::copies_taken_ahead();
            let ahead = {
                let _copies = CopyAhead::begin(n, || ws.clone());
                products(order)
            };
            let what = format!("{what}, products in the order {order:?}");
            assert_eq!(copy_ahead::copies_taken_ahead() - taken, made_ahead, "{what}: copies taken ahead");
            for i in 0..3 {
                assert!(before[i].iter().all(|v| v.is_finite()), "{what}: non-finite output");
                assert_eq!(before[i], ahead[i], "{what}: product {i}");
            }
        }
        // A product that reads no copy after all (the tiled kernel forced on it) drops the one
        // made for it, so that none is left alive beside the next ones; the others still
        // match.
        let (waiting, outs) = {
            let _copies = CopyAhead::begin(n, || ws.clone());
            let first = ws[0].qmatmul_glu_opts(&x, None, glu).and_then(|y| y.to_dtype(anygpu_core::DType::F32));
            let waiting = copy_ahead::copies_waiting();
            let tiled = QOptions { kernel: Some(QKernel::Tiled), ..Default::default() };
            qmatmul_opts(&ws[1], &x, tiled).unwrap();
            let dropped = copy_ahead::copies_waiting();
            let third = qmatmul_opts(&ws[2], &x, coop_opts(None));
            ((waiting, dropped), [first, third].map(|y| y.and_then(|y| y.to_vec_f32()).unwrap()))
        };
        assert_eq!(waiting, (1, 0), "{what}: copies waiting before and after the tiled product");
        assert_eq!([&before[0], &before[2]], [&outs[0], &outs[1]], "{what}: products beside a tiled one");
        dequant_f16::set_override(None);
        None
    });
    eprintln!("copies made ahead ran: {}", if ran.is_empty() { "nowhere".to_string() } else { ran.join("; ") });
}

/// How much of an f16 copy made ahead hides behind the product it runs beside: the first
/// shape's product (copy made first, as its own) with and without the second shape's copy
/// recorded beside it, and that copy alone, Q4_0, n = 512, GPU µs per call. `QBENCH_SHAPES=
/// 6144x4096,28672x4096` (the default: a Q|K|V product, the gate|up copy).
/// `cargo test --release -p anygpu-core --test parity_qmatmul -- --ignored --nocapture copy_beside_product`
#[test]
#[ignore]
fn copy_beside_product() {
    use anygpu_core::quant::{dequant_f16, CopyAhead};
    let _turn = one_at_a_time();
    let _reset = CoopReset;
    let Some(d) = bench_gpu() else {
        eprintln!("no GPU");
        return;
    };
    let n = 512;
    let shapes = env_shapes().unwrap_or_else(|| vec![(6144, 4096), (28672, 4096)]);
    let ty = GgmlType::Q4_0;
    let [(r1, c1), (r2, c2)] = shapes[..] else { panic!("QBENCH_SHAPES: two shapes") };
    let w1 = QTensor::from_vec(ty, r1, c1, random_weights(3, ty, r1, c1), d).unwrap();
    let w2 = QTensor::from_vec(ty, r2, c2, random_weights(5, ty, r2, c2), d).unwrap();
    let x = upload_x(4, n, c1, d).unwrap();
    dequant_f16::set_override(Some(true));
    let opts = QOptions { kernel: Some(QKernel::Coop), ..Default::default() };
    let product = |order: Vec<QTensor>| {
        let _copies = CopyAhead::begin(n, || order);
        qmatmul_opts(&w1, &x, opts)
    };
    for _ in 0..3 {
        let (_, alone) = time_us(d, 10, || product(vec![w1.clone()]));
        let (_, copy) = time_us(d, 10, || dequant_f16::dequantize_to_f16(&w2, &QOptions::default()).map(|_| x.clone()));
        let (_, serial) = time_us(d, 10, || {
            let y = product(vec![w1.clone()]);
            dequant_f16::dequantize_to_f16(&w2, &QOptions::default())?;
            y
        });
        let (_, beside) = time_us(d, 10, || product(vec![w1.clone(), w2.clone()]));
        eprintln!(
            "[{r1}, {c1}] product {alone:7.1} us, [{r2}, {c2}] copy {copy:7.1}: one after the other {serial:7.1}, beside {beside:7.1} ({:.0}% of the copy hidden)",
            (serial - beside) / copy * 100.0
        );
    }
}

/// Every specialisation of the coop kernel (11 types x 2 x tiles x 2 K steps x 3 x accesses x 4
/// epilogues, and the wide W tile's, for each W loader a type has) parses,
/// validates with the capabilities wgpu grants a device with cooperative matrices, and
/// translates to SPIR-V: the kernel cannot run on most machines, so this is its check there.
/// Its emulated variants (tests) likewise, without cooperative matrices or subgroups.
#[test]
fn coop_kernel_validates_with_naga() {
    let variants = anygpu_core::quant::coop::wgsl_variants();
    // 108 per (type, loader): two x tiles, two K steps, three x accesses, four epilogues (none,
    // GLU, GLU with an f16 output, residual), real and emulated (96), and the wide W tile beside
    // BX = 128 and K 64 for the two epilogues it takes (12). F16 has three loaders (16-byte
    // words, raw words, decoded), the seven types whose runs lie in a few words two (early, late).
    assert_eq!(variants.len(), (coop_types().len() + 2 + 7) * 108);
    for (label, src, emulated) in &variants {
        if let Err(e) = validate_coop_wgsl(src, *emulated) {
            panic!("{label}:\n{e}");
        }
    }
}

/// Prefill speed of the tiled and coop kernels at n = 512 on the first GPU, for the shapes of
/// the target models (SmolLM2-135M, a 1B and an 8B llama): GFLOP/s per kernel and coop tile.
/// Also, for the quantized types, the product reading the f16 copy of W made first (column `f16
/// copy`, the copy's time included) and the copy alone (`copy`, with its bytes read and written
/// over its time), and the SwiGLU epilogue's product of the same matrix as a gate|up stack
/// (column `glu`, the copy where the default rule takes it).
/// `QBENCH_TYPES=Q4_0,F16` picks types, `QBENCH_SHAPES=6144x4096,...` the shapes (rows x cols),
/// `QBENCH_N=2048` the x rows (512).
/// `cargo test --release -p anygpu-core --test parity_qmatmul -- --ignored --nocapture coop_prefill_speed`
#[test]
#[ignore]
fn coop_prefill_speed() {
    use anygpu_core::quant::{coop, dequant_f16};
    let _turn = one_at_a_time();
    let _reset = CoopReset;
    let Some(d) = bench_gpu() else {
        eprintln!("no GPU");
        return;
    };
    eprintln!("device: {}", d.name());
    let types = env_list("QBENCH_TYPES");
    let shapes = env_shapes().unwrap_or_else(|| {
        vec![
            (576, 576),
            (960, 576),
            (3072, 576),
            (576, 1536),
            (3072, 2048),
            (2048, 2048),
            (16384, 2048),
            (2048, 8192),
            (6144, 4096),
            (4096, 4096),
            (28672, 4096),
            (4096, 14336),
        ]
    });
    let n = std::env::var("QBENCH_N").ok().and_then(|v| v.parse().ok()).unwrap_or(512usize);
    for ty in
        [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K, GgmlType::F16]
    {
        if types.as_ref().is_some_and(|o| !o.iter().any(|t| t == ty.name())) {
            continue;
        }
        if let Some(why) = coop::unsupported_reason(d.gpu().expect("a GPU device"), ty) {
            eprintln!("{why}");
            return;
        }
        for &(rows, cols) in &shapes {
            if cols % ty.block_size() != 0 {
                continue; // K-quants need rows of whole 256-weight blocks
            }
            let w = QTensor::from_vec(ty, rows, cols, random_weights(3, ty, rows, cols), d).unwrap();
            let x = upload_x(4, n, cols, d).unwrap();
            let flop = 2.0 * (rows * cols * n) as f64;
            let mut line = format!("prefill {:5} [{rows:5}, {cols:5}] n={n}:", ty.name());
            // The coop columns decode the blocks in the product; "f16 copy" is "coop auto"
            // reading the f16 copy of W made first (quantized types; its time included).
            let copy = ty.is_quantized().then_some(("f16 copy", QKernel::Coop, None, true));
            for (label, kernel, bx, deq) in [
                ("tiled", QKernel::Tiled, None, false),
                ("coop64", QKernel::Coop, Some(64), false),
                ("coop128", QKernel::Coop, Some(128), false),
                ("coop auto", QKernel::Coop, None, false),
            ]
            .into_iter()
            .chain(copy)
            {
                coop::set_tile_override(bx);
                dequant_f16::set_override(Some(deq));
                let opts = QOptions { kernel: Some(kernel), ..Default::default() };
                let (_, us) = time_us(d, 10, || qmatmul_opts(&w, &x, opts));
                line.push_str(&format!("  {label} {us:7.1} us {:6.1} TFLOP/s", flop / us / 1e6));
            }
            // The f16 copy alone, its bytes read and written over its time.
            if ty.is_quantized() {
                let copy = || dequant_f16::dequantize_to_f16(&w, &QOptions::default()).map(|_| x.clone());
                let (_, us) = time_us(d, 10, copy);
                let bytes = (w.byte_len() + rows * cols * 2) as f64;
                line.push_str(&format!("  copy {us:7.1} us {:5.2} TB/s", bytes / us / 1e6));
            }
            // The same product as a gate|up stack through the SwiGLU epilogue, its output f16
            // (as the FFN runs it): beside "coop auto", what the epilogue's drain costs.
            if rows % 16 == 0 {
                dequant_f16::set_override(None);
                let opts = QOptions { kernel: Some(QKernel::Coop), f16_out: true, ..Default::default() };
                let (_, us) = time_us(d, 10, || w.qmatmul_glu_opts(&x, None, opts));
                line.push_str(&format!("  glu {us:7.1} us {:6.1} TFLOP/s", flop / us / 1e6));
            }
            eprintln!("{line}");
        }
    }
}
