//! GGML block formats: our dequantizer against gguf-py's (fixtures made by
//! scripts/make_quant_fixtures.py), and the fast matvec / matmul against dequantize-then-dot.
//!
//! The benchmark is ignored by default:
//! `cargo test --release -p anygpu-core --test quant_parity -- --ignored --nocapture bench`

use std::path::PathBuf;
use std::time::Instant;

use anygpu_core::quant::{dequantize, dequantize_to_vec, matmul, matmul_q8, matvec, GgmlType};
use anygpu_core::Error;
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/quant")
}

fn read_fixture(name: &str) -> (Vec<u8>, Vec<f32>) {
    let dir = fixture_dir();
    let bin =
        std::fs::read(dir.join(format!("{name}.bin"))).expect("fixture .bin (run scripts/make_quant_fixtures.py)");
    let raw = std::fs::read(dir.join(format!("{name}.f32"))).expect("fixture .f32");
    let values = raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    (bin, values)
}

/// Compares element-wise; returns the number of elements that were not bit-identical.
fn assert_close(what: &str, got: &[f32], want: &[f32], rel: f32) -> usize {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut inexact = 0;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        if g.to_bits() != w.to_bits() {
            inexact += 1;
            assert!((g - w).abs() <= rel * w.abs(), "{what}[{i}]: got {g}, want {w}");
        }
    }
    inexact
}

#[test]
fn dequantize_matches_gguf_py() {
    for ty in GgmlType::ALL {
        let (bin, want) = read_fixture(ty.name());
        let got = dequantize_to_vec(ty, &bin, want.len()).unwrap();
        let inexact = assert_close(ty.name(), &got, &want, 1e-6);
        assert_eq!(inexact, 0, "{ty}: {inexact} of {} values differ from gguf-py in the last bits", want.len());
    }
}

#[test]
fn dequantize_matches_gguf_py_quantizer_output() {
    for name in ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"] {
        let ty = GgmlType::ALL.into_iter().find(|t| t.name() == name).unwrap();
        let (bin, want) = read_fixture(&format!("{name}.quant"));
        let got = dequantize_to_vec(ty, &bin, want.len()).unwrap();
        let inexact = assert_close(name, &got, &want, 1e-6);
        assert_eq!(inexact, 0, "{name}: {inexact} values differ from gguf-py");
    }
}

#[test]
fn dequantize_does_not_assume_alignment() {
    for ty in GgmlType::ALL {
        let (bin, want) = read_fixture(ty.name());
        let mut shifted = vec![0u8; bin.len() + 3];
        for off in 1..4 {
            shifted[off..off + bin.len()].copy_from_slice(&bin);
            let got = dequantize_to_vec(ty, &shifted[off..off + bin.len()], want.len()).unwrap();
            assert_close(ty.name(), &got, &want, 1e-6);
        }
    }
}

/// Byte offsets of each block's f16 scale fields, overwritten with sane values so random blocks
/// decode to finite weights.
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

/// `n` elements' worth of random, valid bytes of type `ty`.
fn random_weights(rng: &mut StdRng, ty: GgmlType, n: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(ty.byte_size(n as u64).unwrap() as usize);
    match ty {
        GgmlType::F32 => (0..n).for_each(|_| out.extend(rng.random_range(-1.0f32..1.0).to_le_bytes())),
        GgmlType::F16 => (0..n).for_each(|_| out.extend(f16::from_f32(rng.random_range(-1.0f32..1.0)).to_le_bytes())),
        GgmlType::BF16 => (0..n).for_each(|_| out.extend(bf16::from_f32(rng.random_range(-1.0f32..1.0)).to_le_bytes())),
        _ => {
            let ts = ty.type_size();
            for _ in 0..n / ty.block_size() {
                let mut block = vec![0u8; ts];
                rng.fill(&mut block[..]);
                for &off in f16_fields(ty) {
                    let s = f16::from_f32(rng.random_range(-0.1f32..0.1));
                    block[off..off + 2].copy_from_slice(&s.to_le_bytes());
                }
                out.extend(block);
            }
        }
    }
    out
}

fn random_vec(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// Reference y = W x from the dequantized weights, in f64, and the scale sum |w| |x| that bounds
/// rounding error.
fn reference(w: &[f32], cols: usize, x: &[f32]) -> Vec<(f64, f64)> {
    w.chunks_exact(cols)
        .map(|row| {
            row.iter()
                .zip(x)
                .fold((0f64, 0f64), |(s, a), (&w, &x)| (s + w as f64 * x as f64, a + (w as f64 * x as f64).abs()))
        })
        .collect()
}

fn check_product(what: &str, got: &[f32], want: &[(f64, f64)]) {
    assert_eq!(got.len(), want.len());
    for (r, (g, (w, scale))) in got.iter().zip(want).enumerate() {
        let err = (*g as f64 - w).abs();
        assert!(err <= 1e-5 * scale + 1e-30, "{what} row {r}: got {g}, want {w} (error {err:.3e}, scale {scale:.3e})");
    }
}

/// Column counts: several blocks, odd block counts, and one wide enough to split a row of
/// blocks over several accumulator passes.
fn col_cases(ty: GgmlType) -> Vec<usize> {
    let bs = ty.block_size();
    if bs == 1 {
        vec![1, 7, 33, 257, 1000]
    } else if bs == 32 {
        vec![32, 3 * 32, 37 * 32]
    } else {
        vec![256, 3 * 256, 5 * 256]
    }
}

#[test]
fn matvec_matches_dequantize_then_dot() {
    let mut rng = StdRng::seed_from_u64(7);
    for ty in GgmlType::ALL {
        for cols in col_cases(ty) {
            for rows in [1, 7, 257] {
                let wb = random_weights(&mut rng, ty, rows * cols);
                let w = dequantize_to_vec(ty, &wb, rows * cols).unwrap();
                let x = random_vec(&mut rng, cols);
                let want = reference(&w, cols, &x);

                let mut y = vec![f32::NAN; rows];
                matvec(ty, &wb, rows, cols, &x, &mut y).unwrap();
                check_product(&format!("matvec {ty} {rows}x{cols}"), &y, &want);

                // The same bytes at an odd address.
                let mut shifted = vec![0u8; wb.len() + 1];
                shifted[1..].copy_from_slice(&wb);
                let mut y2 = vec![f32::NAN; rows];
                matvec(ty, &shifted[1..], rows, cols, &x, &mut y2).unwrap();
                assert_eq!(y, y2, "matvec {ty} {rows}x{cols}: result depends on alignment");
            }
        }
    }
}

#[test]
fn matmul_matches_dequantize_then_dot() {
    let mut rng = StdRng::seed_from_u64(8);
    for ty in GgmlType::ALL {
        for cols in col_cases(ty) {
            for rows in [1, 7, 257] {
                for n in [1, 2, 5] {
                    let wb = random_weights(&mut rng, ty, rows * cols);
                    let w = dequantize_to_vec(ty, &wb, rows * cols).unwrap();
                    let x = random_vec(&mut rng, n * cols);
                    let mut y = vec![f32::NAN; n * rows];
                    matmul(ty, &wb, rows, cols, &x, n, &mut y).unwrap();
                    for i in 0..n {
                        let want = reference(&w, cols, &x[i * cols..][..cols]);
                        check_product(
                            &format!("matmul {ty} {rows}x{cols} n={n} input {i}"),
                            &y[i * rows..][..rows],
                            &want,
                        );
                    }
                }
            }
        }
    }
}

/// The fast product rounds x to 8-bit blocks (as llama.cpp's CPU backend does): per block of
/// x (32 values, or 256 for the k-quants), each value moves by at most half a step
/// (max|x| / 254) plus the f16 rounding of the block scale (2^-11 relative), and the block's
/// `d * sum(q)` (f16) adds the same again to the minimum term of Q4_1 / Q5_1. So |error| <=
/// sum over blocks of (sum |w| + 32 |w_max|) * max|x_block| * (1/254 + 2^-10), plus f32
/// rounding. Types without an integer kernel (floats, Q2_K, Q3_K) take the exact path and meet
/// the exact tolerance.
#[test]
fn matmul_q8_is_within_activation_rounding_of_dequantize_then_dot() {
    let mut rng = StdRng::seed_from_u64(14);
    for ty in GgmlType::ALL {
        for cols in col_cases(ty) {
            for (rows, n) in [(1, 1), (7, 1), (257, 1), (7, 2), (33, 5), (65, 9), (9, 17)] {
                let wb = random_weights(&mut rng, ty, rows * cols);
                let w = dequantize_to_vec(ty, &wb, rows * cols).unwrap();
                let x = random_vec(&mut rng, n * cols);
                let mut y = vec![f32::NAN; n * rows];
                matmul_q8(ty, &wb, rows, cols, &x, n, &mut y).unwrap();
                // Activations are rounded per 32 values for the legacy formats, per 256 (Q8_K)
                // for the k-quants that have an integer kernel.
                let qb = match ty {
                    GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => 32,
                    GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => 256,
                    _ => 0,
                };
                let q8 = qb > 0;
                for i in 0..n {
                    let xi = &x[i * cols..][..cols];
                    let want = reference(&w, cols, xi);
                    let got = &y[i * rows..][..rows];
                    let what = format!("matmul_q8 {ty} {rows}x{cols} n={n} input {i}");
                    if !q8 {
                        check_product(&what, got, &want);
                        continue;
                    }
                    for (r, (g, (wv, scale))) in got.iter().zip(&want).enumerate() {
                        let row = &w[r * cols..][..cols];
                        let mut bound = 1e-5 * scale;
                        for (wb32, xb32) in row.chunks(qb).zip(xi.chunks(qb)) {
                            let amax = xb32.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
                            // The block's minimum is its smallest weight or below; |m| <= max |w|.
                            let wabs: f64 = wb32.iter().map(|v| v.abs() as f64).sum();
                            let wmax = wb32.iter().fold(0f64, |m, v| m.max(v.abs() as f64));
                            bound += (wabs + 32.0 * wmax) * amax * (1.0 / 254.0 + 1.0 / 1024.0);
                        }
                        let err = (*g as f64 - wv).abs();
                        assert!(
                            err <= bound,
                            "{what} row {r}: got {g}, want {wv} (error {err:.3e}, bound {bound:.3e})"
                        );
                    }
                }
                // The same bytes at an odd address give the same result.
                let mut shifted = vec![0u8; wb.len() + 1];
                shifted[1..].copy_from_slice(&wb);
                let mut y2 = vec![f32::NAN; n * rows];
                matmul_q8(ty, &shifted[1..], rows, cols, &x, n, &mut y2).unwrap();
                assert_eq!(y, y2, "matmul_q8 {ty} {rows}x{cols}: result depends on alignment");
            }
        }
    }
}

#[test]
fn matmul_spans_several_row_chunks() {
    // Enough rows that matmul splits them into several chunks, with a ragged last one.
    let mut rng = StdRng::seed_from_u64(9);
    let (ty, rows, cols, n) = (GgmlType::Q4K, 1031, 512, 3);
    let wb = random_weights(&mut rng, ty, rows * cols);
    let w = dequantize_to_vec(ty, &wb, rows * cols).unwrap();
    let x = random_vec(&mut rng, n * cols);
    let mut y = vec![f32::NAN; n * rows];
    matmul(ty, &wb, rows, cols, &x, n, &mut y).unwrap();
    for i in 0..n {
        let want = reference(&w, cols, &x[i * cols..][..cols]);
        check_product(&format!("matmul {ty} input {i}"), &y[i * rows..][..rows], &want);
    }
}

#[test]
fn empty_shapes_are_fine() {
    for ty in GgmlType::ALL {
        let mut y = vec![1.0f32; 3];
        matvec(ty, &[], 3, 0, &[], &mut y).unwrap();
        assert_eq!(y, [0.0; 3]);
        let mut y: Vec<f32> = vec![];
        let cols = ty.block_size();
        matvec(ty, &[], 0, cols, &vec![0.0; cols], &mut y).unwrap();
        matmul(ty, &[], 0, cols, &[], 0, &mut y).unwrap();
        matmul_q8(ty, &[], 0, cols, &vec![0.0; cols], 1, &mut y).unwrap();
        matmul_q8(ty, &[], 0, cols, &[], 0, &mut y).unwrap();
        let mut y = vec![1.0f32; 6];
        matmul_q8(ty, &[], 3, 0, &[], 2, &mut y).unwrap();
        assert_eq!(y, [0.0; 6]);
        assert!(dequantize_to_vec(ty, &[], 0).unwrap().is_empty());
    }
}

#[test]
fn wrong_lengths_are_errors_not_panics() {
    let mut rng = StdRng::seed_from_u64(10);
    for ty in GgmlType::ALL {
        let bs = ty.block_size();
        let (rows, cols) = (3, 2 * bs);
        let wb = random_weights(&mut rng, ty, rows * cols);
        let x = vec![0.5f32; cols];
        let mut y = vec![0f32; rows];

        // dequantize: too few / too many bytes, and a count that is not whole blocks.
        let mut out = vec![0f32; rows * cols];
        assert!(matches!(dequantize(ty, &wb[..wb.len() - 1], &mut out), Err(Error::Format(_))));
        let mut longer = wb.clone();
        longer.push(0);
        assert!(matches!(dequantize(ty, &longer, &mut out), Err(Error::Format(_))));
        if bs > 1 {
            let mut odd = vec![0f32; bs + 1];
            assert!(matches!(dequantize(ty, &wb, &mut odd), Err(Error::Format(_))));
        }

        // matvec: weights, x and y of the wrong size; columns that are not whole blocks.
        assert!(matches!(matvec(ty, &wb[1..], rows, cols, &x, &mut y), Err(Error::Shape { .. })));
        assert!(matches!(matvec(ty, &wb, rows + 1, cols, &x, &mut [0.0; 4]), Err(Error::Shape { .. })));
        assert!(matches!(matvec(ty, &wb, rows, cols, &x[1..], &mut y), Err(Error::Shape { .. })));
        assert!(matches!(matvec(ty, &wb, rows, cols, &x, &mut y[1..]), Err(Error::Shape { .. })));
        if bs > 1 {
            assert!(matches!(matvec(ty, &wb, rows, cols - 1, &x[1..], &mut y), Err(Error::Shape { .. })));
        }
        matvec(ty, &wb, rows, cols, &x, &mut y).unwrap();

        // matmul: the same, plus x and y that do not hold n rows.
        let x2 = vec![0.5f32; 2 * cols];
        let mut y2 = vec![0f32; 2 * rows];
        assert!(matches!(matmul(ty, &wb[1..], rows, cols, &x2, 2, &mut y2), Err(Error::Shape { .. })));
        assert!(matches!(matmul(ty, &wb, rows, cols, &x2[1..], 2, &mut y2), Err(Error::Shape { .. })));
        assert!(matches!(matmul(ty, &wb, rows, cols, &x2, 2, &mut y2[1..]), Err(Error::Shape { .. })));
        assert!(matches!(matmul(ty, &wb, rows, cols, &x2, usize::MAX, &mut y2), Err(Error::Shape { .. })));
        matmul(ty, &wb, rows, cols, &x2, 2, &mut y2).unwrap();

        // matmul_q8: the same checks, for n = 1 and n = 2.
        for n in [1usize, 2] {
            let (xs, ys) = (&x2[..n * cols], &mut y2[..n * rows]);
            assert!(matches!(matmul_q8(ty, &wb[1..], rows, cols, xs, n, ys), Err(Error::Shape { .. })));
            assert!(matches!(matmul_q8(ty, &wb, rows, cols, &xs[1..], n, ys), Err(Error::Shape { .. })));
            assert!(matches!(matmul_q8(ty, &wb, rows, cols, xs, n, &mut ys[1..]), Err(Error::Shape { .. })));
            if bs > 1 {
                let r = matmul_q8(ty, &wb, rows, cols - 1, &xs[..n * (cols - 1)], n, &mut ys[..]);
                assert!(matches!(r, Err(Error::Shape { .. })));
            }
            matmul_q8(ty, &wb, rows, cols, xs, n, ys).unwrap();
        }
        assert!(matches!(matmul_q8(ty, &wb, rows, cols, &x2, usize::MAX, &mut y2), Err(Error::Shape { .. })));
    }
}

/// Decode-shaped products, exact (f32 activations) and Q8 (`matmul_q8`); prints GB/s of weight
/// bytes read. SmolLM2-135M (Q4_1, Q8_0 output) reads ~91 MiB of weights per token, so 68 tok/s
/// needs ~6.5 GB/s over the whole model. Then prefill: one matrix against n inputs.
#[test]
#[ignore]
fn bench_matvec() {
    let mut rng = StdRng::seed_from_u64(11);
    // SmolLM2's shapes, then two that k-quant rows (multiples of 256) fit.
    let shapes = [(576, 1536), (1536, 576), (576, 576), (192, 576), (49152, 576), (1536, 768), (16384, 768)];
    let mut types = vec![GgmlType::Q4_1, GgmlType::Q8_0];
    if std::env::var("QUANT_BENCH_ALL").is_ok() {
        types = GgmlType::ALL.to_vec();
    }
    println!("rayon threads: {}", rayon::current_num_threads());
    let time = |iters: usize, f: &mut dyn FnMut()| -> (f64, f64) {
        for _ in 0..3 {
            f();
        }
        let (mut best, mut total) = (f64::MAX, 0.0);
        for _ in 0..iters {
            let t = Instant::now();
            f();
            let s = t.elapsed().as_secs_f64();
            best = best.min(s);
            total += s;
        }
        (total / iters as f64, best)
    };
    for ty in types {
        for (rows, cols) in shapes {
            if cols % ty.block_size() != 0 {
                continue;
            }
            let wb = random_weights(&mut rng, ty, rows * cols);
            let x = random_vec(&mut rng, cols);
            let mut y = vec![0f32; rows];
            let bytes = wb.len() as f64;
            let iters = ((2e9 / bytes) as usize).clamp(5, 2000);
            let (mean, best) = time(iters, &mut || matvec(ty, &wb, rows, cols, &x, &mut y).unwrap());
            let (mean8, best8) = time(iters, &mut || matmul_q8(ty, &wb, rows, cols, &x, 1, &mut y).unwrap());
            println!(
                "matvec {:5} {rows:5}x{cols:5}: exact {:7.1} us mean ({:5.1} GB/s) {:7.1} best; q8 {:7.1} us mean ({:5.1} GB/s) {:7.1} best",
                ty.name(),
                mean * 1e6,
                bytes / mean / 1e9,
                best * 1e6,
                mean8 * 1e6,
                bytes / mean8 / 1e9,
                best8 * 1e6,
            );
        }
    }
}

/// One decode step's products over SmolLM2-135M's weights (30 layers of Q4_1 q, k, v, o, gate,
/// up, down, then the 49152 x 576 Q8_0 output), every matrix in its own memory as in the model:
/// the products' share of a token, with the weights streaming from memory or L3, not L2.
#[test]
#[ignore]
fn bench_decode_sweep() {
    let mut rng = StdRng::seed_from_u64(13);
    let layer = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)];
    let mut mats: Vec<(GgmlType, usize, usize, Vec<u8>)> = Vec::new();
    for _ in 0..30 {
        for (rows, cols) in layer {
            mats.push((GgmlType::Q4_1, rows, cols, random_weights(&mut rng, GgmlType::Q4_1, rows * cols)));
        }
    }
    mats.push((GgmlType::Q8_0, 49152, 576, random_weights(&mut rng, GgmlType::Q8_0, 49152 * 576)));
    let bytes: usize = mats.iter().map(|m| m.3.len()).sum();
    let x = random_vec(&mut rng, 1536);
    let mut y = vec![0f32; 49152];
    let mut pass = |q8: bool| {
        let t = Instant::now();
        for (ty, rows, cols, w) in &mats {
            let (x, y) = (&x[..*cols], &mut y[..*rows]);
            if q8 {
                matmul_q8(*ty, w, *rows, *cols, x, 1, y).unwrap();
            } else {
                matvec(*ty, w, *rows, *cols, x, y).unwrap();
            }
        }
        t.elapsed().as_secs_f64()
    };
    // Interleaved, so both see the same machine load.
    let iters = 30;
    let mut times = [Vec::new(), Vec::new()];
    for _ in 0..iters + 1 {
        for q8 in [false, true] {
            times[q8 as usize].push(pass(q8));
        }
    }
    for (q8, t) in times.iter_mut().enumerate() {
        t.remove(0);
        t.sort_by(|a, b| a.total_cmp(b));
        let med = t[iters / 2];
        println!(
            "decode sweep {}: median {:6.2} ms, best {:6.2} ms per token ({:5.1} GB/s over {:.1} MB)",
            if q8 == 1 { "q8   " } else { "exact" },
            med * 1e3,
            t[0] * 1e3,
            bytes as f64 / med / 1e9,
            bytes as f64 / 1e6
        );
    }
}

/// Prefill-shaped products: one weight matrix against n inputs, exact and Q8.
#[test]
#[ignore]
fn bench_prefill() {
    let mut rng = StdRng::seed_from_u64(12);
    let time = |iters: usize, f: &mut dyn FnMut()| -> f64 {
        f();
        let t = Instant::now();
        for _ in 0..iters {
            f();
        }
        t.elapsed().as_secs_f64() / iters as f64
    };
    let ns: Vec<usize> = match std::env::var("QUANT_BENCH_N") {
        Ok(v) => v.split(',').map(|s| s.parse().expect("QUANT_BENCH_N: comma-separated counts")).collect(),
        Err(_) => vec![2, 4, 8, 16, 64],
    };
    let exact = std::env::var("QUANT_BENCH_Q8_ONLY").is_err();
    for (rows, cols) in [(1536, 576), (576, 1536)] {
        let ty = GgmlType::Q4_1;
        let wb = random_weights(&mut rng, ty, rows * cols);
        for &n in &ns {
            let x = random_vec(&mut rng, n * cols);
            let mut y = vec![0f32; n * rows];
            let mm = if exact { time(10, &mut || matmul(ty, &wb, rows, cols, &x, n, &mut y).unwrap()) } else { 1.0 };
            let q8 = time(20, &mut || matmul_q8(ty, &wb, rows, cols, &x, n, &mut y).unwrap());
            let gf = |s: f64| 2.0 * (rows * cols * n) as f64 / s / 1e9;
            println!(
                "matmul Q4_1 {rows}x{cols} n={n:2}: exact {:8.1} us ({:5.1} GFLOP/s); q8 {:8.1} us ({:5.1} GFLOP/s)",
                mm * 1e6,
                gf(mm),
                q8 * 1e6,
                gf(q8)
            );
        }
    }
}
