//! Parity tests for unary ops, binary ops (arithmetic and comparisons), `where` and casts,
//! on odd shapes, views and extreme values. Each body runs on the CPU reference and on every
//! GPU device (see anygpu_core::testing). `bench_elementwise_bandwidth` (ignored) measures the
//! bandwidth paths on a real GPU.

use anygpu_core::ops::elementwise::BinaryOp;
use anygpu_core::ops::unary::UnaryOp;
use anygpu_core::testing::{gpu_devices, parity, parity_err, rand_vec, ODD_SIZES};
use anygpu_core::{DType, Device, Result, Tensor};
use half::{bf16, f16};

/// A tensor of `vals` on `d` (built on the CPU, then uploaded).
fn from(vals: Vec<f32>, dims: &[usize], d: &Device) -> Result<Tensor> {
    Tensor::from_vec(vals, dims, &Device::Cpu)?.to_device(d)
}

/// Random values in [-scale, scale).
fn t(seed: u64, dims: &[usize], scale: f32, d: &Device) -> Result<Tensor> {
    let n = dims.iter().product();
    from(rand_vec(seed, n).into_iter().map(|v| v * scale).collect(), dims, d)
}

/// Inputs suited to each op's domain, and the op's tolerance (atol, rtol) against the f64-based
/// CPU reference.
fn domain(op: UnaryOp) -> (f32, f32, f32, f32) {
    // (offset, scale, atol, rtol): inputs are offset + scale * [-1, 1).
    match op {
        UnaryOp::Relu | UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Square => (0.0, 10.0, 0.0, 0.0),
        UnaryOp::Exp => (0.0, 20.0, 0.0, 4e-6),
        UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt => (50.5, 50.0, 1e-6, 1e-6),
        UnaryOp::GeluErf | UnaryOp::GeluTanh | UnaryOp::Silu => (0.0, 8.0, 1e-6, 2e-6),
        UnaryOp::Sigmoid | UnaryOp::Tanh => (0.0, 8.0, 1e-7, 1e-6),
    }
}

#[test]
fn unary_ops_odd_sizes() {
    for op in UnaryOp::ALL {
        let (off, scale, atol, rtol) = domain(op);
        for n in ODD_SIZES {
            parity(op.name(), atol, rtol, |d| {
                from(rand_vec(n as u64, n).iter().map(|v| off + scale * v).collect(), &[n], d)?.unary(op)?.to_vec_f32()
            });
        }
        // A transposed view (strided kernel) and views at offsets 1 (scalar contiguous) and 4
        // (vec4) into a larger buffer.
        parity("unary transposed", atol, rtol, |d| {
            let x = t(3, &[33, 7], scale, d)?.affine(1.0, off)?;
            x.transpose(0, 1)?.unary(op)?.to_vec_f32()
        });
        for start in [1, 4] {
            parity("unary narrow", atol, rtol, |d| {
                let x = t(4, &[3, 260], scale, d)?.affine(1.0, off)?;
                x.reshape([780])?.narrow(0, start, 256)?.unary(op)?.to_vec_f32()
            });
        }
    }
}

#[test]
fn unary_extreme_values() {
    let big: Vec<f32> = vec![
        -1e30, -1e5, -100.0, -88.0, -30.0, -20.0, -10.0, -9.0, -5.0, -3.0, -1.0, -0.7, -0.5, -1e-3, -1e-6, -1e-20, 0.0,
        1e-20, 1e-6, 1e-3, 0.5, 0.62, 0.63, 0.7, 1.0, 3.0, 5.0, 9.0, 10.0, 20.0, 30.0, 88.0, 100.0, 1e5, 1e30,
    ];
    let n = big.len();
    for op in [UnaryOp::Sigmoid, UnaryOp::Silu, UnaryOp::Tanh, UnaryOp::GeluErf, UnaryOp::GeluTanh, UnaryOp::Relu] {
        // Relative accuracy everywhere: tanh near 0 and GELU's negative tail are where naive
        // forms lose digits, large |x| where they overflow into NaN.
        parity(op.name(), 1e-30, 2e-5, |d| {
            let out = from(big.clone(), &[n], d)?.unary(op)?.to_vec_f32()?;
            assert!(out.iter().all(|v| !v.is_nan()), "{} gave NaN on {}: {out:?}", op.name(), d.name());
            Ok(out)
        });
    }
}

#[test]
fn gelu_erf_accuracy_over_range() {
    // A dense sweep of [-10, 10]: the erfc fit's relative error (1.2e-7) plus f32 rounding.
    let n = 4001;
    let xs: Vec<f32> = (0..n).map(|i| -10.0 + 20.0 * i as f32 / (n - 1) as f32).collect();
    parity("gelu_erf sweep", 1e-30, 1e-5, |d| from(xs.clone(), &[n], d)?.gelu()?.to_vec_f32());
    parity("gelu_tanh sweep", 1e-30, 1e-5, |d| from(xs.clone(), &[n], d)?.gelu_tanh()?.to_vec_f32());
    parity("tanh sweep", 1e-30, 2e-6, |d| from(xs.clone(), &[n], d)?.tanh()?.to_vec_f32());
}

#[test]
fn empty_tensors_and_dtype_errors() {
    // Zero elements: every op returns an empty tensor of the right shape, no dispatch.
    parity("empty unary", 0.0, 0.0, |d| t(1, &[0, 3], 1.0, d)?.gelu()?.to_vec_f32());
    parity("empty binary", 0.0, 0.0, |d| t(1, &[0, 3], 1.0, d)?.add(&t(2, &[3], 1.0, d)?)?.to_vec_f32());
    parity("empty where", 0.0, 0.0, |d| {
        t(1, &[2, 0], 1.0, d)?.where_cond(&t(2, &[1], 1.0, d)?, &t(3, &[0], 1.0, d)?)?.to_vec_f32()
    });
    parity("empty cast", 0.0, 0.0, |d| t(1, &[0], 1.0, d)?.to_dtype(DType::BF16)?.to_vec_f32());
    parity_err("unary dtype", "expected f32", |d| Tensor::from_slice(&[1i32, 2], [2], d)?.relu());
    parity_err("unary f16", "expected f32", |d| t(1, &[4], 1.0, d)?.to_dtype(DType::F16)?.exp());
}

/// Values on a coarse grid, so that comparisons see ties.
fn grid(seed: u64, dims: &[usize], d: &Device) -> Result<Tensor> {
    let n = dims.iter().product();
    from(rand_vec(seed, n).into_iter().map(|v| (v * 4.0).round() / 2.0).collect(), dims, d)
}

#[test]
fn binary_ops_all_paths() {
    for op in BinaryOp::ALL {
        for n in ODD_SIZES {
            parity(op.name(), 1e-6, 1e-6, |d| grid(10, &[n], d)?.binary(op, &grid(11, &[n], d)?)?.to_vec_f32());
        }
        parity("broadcast row", 1e-6, 1e-6, |d| {
            grid(12, &[7, 257], d)?.binary(op, &grid(13, &[257], d)?)?.to_vec_f32()
        });
        // Broadcast along leading dims only: the contiguous kernels' `i % numel` path (vec4
        // when the operand's size is a multiple of 4), either operand.
        for (da, db) in [(vec![5, 64], vec![64]), (vec![64], vec![5, 64]), (vec![2, 3, 8], vec![1, 3, 8])] {
            parity("broadcast leading", 1e-6, 1e-6, |d| grid(21, &da, d)?.binary(op, &grid(22, &db, d)?)?.to_vec_f32());
        }
        parity("broadcast both", 1e-6, 1e-6, |d| {
            grid(14, &[3, 1, 5], d)?.binary(op, &grid(15, &[7, 1], d)?)?.to_vec_f32()
        });
        parity("broadcast scalar", 1e-6, 1e-6, |d| {
            grid(16, &[4, 9], d)?.binary(op, &from(vec![0.5], &[], d)?)?.to_vec_f32()
        });
        parity("strided operand", 1e-6, 1e-6, |d| {
            grid(17, &[9, 4], d)?.transpose(0, 1)?.binary(op, &grid(18, &[4, 9], d)?)?.to_vec_f32()
        });
        // Offsets 4 and 8 take the vec4 path, 1 and 3 the scalar contiguous one.
        for (sa, sb) in [(4, 8), (1, 3), (4, 1)] {
            parity("offset views", 1e-6, 1e-6, |d| {
                let a = grid(19, &[1100], d)?.narrow(0, sa, 1024)?;
                let b = grid(20, &[1100], d)?.narrow(0, sb, 1024)?;
                a.binary(op, &b)?.to_vec_f32()
            });
        }
    }
    parity_err("broadcast mismatch", "do not broadcast", |d| t(1, &[3, 4], 1.0, d)?.lt(&t(2, &[5], 1.0, d)?));
    parity_err("binary dtype", "expected f32", |d| {
        t(1, &[4], 1.0, d)?.add(&Tensor::from_slice(&[1i32, 2, 3, 4], [4], d)?)
    });
}

#[test]
fn comparisons_define_nan_and_infinity() {
    let a = vec![f32::NAN, 1.0, f32::INFINITY, f32::NEG_INFINITY, -0.0, 2.0, f32::NAN, 3.0];
    let b = vec![1.0, f32::NAN, f32::INFINITY, 0.0, 0.0, 2.0, f32::NAN, -3.0];
    for op in [BinaryOp::Eq, BinaryOp::Ne, BinaryOp::Lt, BinaryOp::Le, BinaryOp::Gt, BinaryOp::Ge] {
        parity(op.name(), 0.0, 0.0, |d| {
            let out = from(a.clone(), &[8], d)?.binary(op, &from(b.clone(), &[8], d)?)?.to_vec_f32()?;
            let want: Vec<f32> = a.iter().zip(&b).map(|(&x, &y)| op.apply(x, y)).collect();
            assert_eq!(out, want, "{} on {}", op.name(), d.name());
            Ok(out)
        });
    }
}

#[test]
fn where_broadcasts_all_three() {
    for n in ODD_SIZES {
        parity("where", 0.0, 0.0, |d| {
            let cond = grid(30, &[n], d)?.gt(&from(vec![0.0], &[1], d)?)?;
            cond.where_cond(&t(31, &[n], 1.0, d)?, &t(32, &[n], 1.0, d)?)?.to_vec_f32()
        });
    }
    parity("where broadcast", 0.0, 0.0, |d| {
        let cond = grid(33, &[7, 1], d)?; // nonzero (including negative values) is true
        cond.where_cond(&t(34, &[1, 257], 1.0, d)?, &from(vec![-5.0], &[], d)?)?.to_vec_f32()
    });
    parity("where strided", 0.0, 0.0, |d| {
        let cond = grid(35, &[9, 5], d)?.transpose(0, 1)?;
        cond.where_cond(&t(36, &[5, 9], 1.0, d)?, &t(37, &[3, 5, 1], 1.0, d)?.narrow(0, 1, 2)?)?.to_vec_f32()
    });
    parity("where nan cond", 0.0, 0.0, |d| {
        let cond = from(vec![f32::NAN, 0.0, -0.0, 1e-30], &[4], d)?;
        cond.where_cond(&from(vec![1.0; 4], &[4], d)?, &from(vec![2.0; 4], &[4], d)?)?.to_vec_f32()
    });
    parity_err("where shapes", "do not broadcast", |d| {
        t(1, &[3], 1.0, d)?.where_cond(&t(2, &[4], 1.0, d)?, &t(3, &[1], 1.0, d)?)
    });
    parity_err("where dtype", "expected f32", |d| {
        Tensor::from_slice(&[1u32, 0, 1], [3], d)?.where_cond(&t(2, &[3], 1.0, d)?, &t(3, &[3], 1.0, d)?)
    });
}

fn tensor_of(dtype: DType, vals: &[f32], dims: &[usize], d: &Device) -> Result<Tensor> {
    match dtype {
        DType::F16 => {
            let v: Vec<f16> = vals.iter().map(|&x| f16::from_f32(x)).collect();
            Tensor::from_slice(&v, dims, d)
        }
        DType::BF16 => {
            let v: Vec<bf16> = vals.iter().map(|&x| bf16::from_f32(x)).collect();
            Tensor::from_slice(&v, dims, d)
        }
        _ => Tensor::from_slice(vals, dims, d),
    }
}

const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

#[test]
fn cast_between_float_types() {
    for from_t in FLOATS {
        for to in FLOATS {
            for n in ODD_SIZES {
                // Round to nearest even, bit for bit with `half`.
                parity("cast", 0.0, 0.0, |d| {
                    let v: Vec<f32> = rand_vec(n as u64, n).iter().map(|x| x * 300.0).collect();
                    let out = tensor_of(from_t, &v, &[n], d)?.to_dtype(to)?;
                    assert_eq!(out.dtype(), to);
                    out.to_vec_f32()
                });
            }
            // Strided sources, odd offsets into 2-byte packed words.
            parity("cast transposed", 0.0, 0.0, |d| {
                let v: Vec<f32> = rand_vec(5, 7 * 33).iter().map(|x| x * 3.0).collect();
                tensor_of(from_t, &v, &[7, 33], d)?.transpose(0, 1)?.to_dtype(to)?.to_vec_f32()
            });
            parity("cast narrow", 0.0, 0.0, |d| {
                let v: Vec<f32> = rand_vec(6, 515).iter().map(|x| x * 3.0).collect();
                tensor_of(from_t, &v, &[515], d)?.narrow(0, 3, 511)?.to_dtype(to)?.to_vec_f32()
            });
        }
    }
}

#[test]
fn cast_special_values_bit_exact() {
    let vals: Vec<f32> = vec![
        0.0,
        -0.0,
        1.0,
        -2.5,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        65504.0,            // f16 max
        65519.99,           // rounds down to f16 max
        65520.0,            // rounds to inf
        -1e6,               // f16 overflow -> -inf
        3.4e38,             // bf16 rounding overflow -> inf
        1.0 + 1.0 / 2048.0, // f16 tie -> even (1.0)
        1.0 + 3.0 / 2048.0, // f16 tie -> even (1.0 + 2/1024)
        1.0 + 1.0 / 256.0,  // bf16 tie -> even
        1.0 + 3.0 / 256.0,  // bf16 tie -> even, upwards
        6.0e-5,             // f16 subnormal
        -3.0e-8,            // f16 subnormal round-to-nearest (2^-24 = 5.96e-8)
        2.9802322e-8,       // exactly half of the smallest f16 subnormal: ties to 0
        1e-10,              // below f16 range -> 0; bf16 keeps it
        1e-39,              // f32 subnormal (a GPU may flush it to 0 first)
    ];
    let n = vals.len();
    let want16: Vec<u16> = vals.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
    let wantb: Vec<u16> = vals.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
    for d in std::iter::once(&Device::Cpu).chain(gpu_devices()) {
        let x = Tensor::from_slice(&vals, [n], d).unwrap();
        let h: Vec<u16> =
            x.to_dtype(DType::F16).unwrap().to_vec::<f16>().unwrap().iter().map(|v| v.to_bits()).collect();
        let b: Vec<u16> =
            x.to_dtype(DType::BF16).unwrap().to_vec::<bf16>().unwrap().iter().map(|v| v.to_bits()).collect();
        for i in 0..n {
            // NaN payloads may differ; f32 subnormals may be flushed before the cast on a GPU.
            let nan = vals[i].is_nan();
            let flushable = vals[i] != 0.0 && vals[i].abs() < f32::MIN_POSITIVE && !d.is_cpu();
            let ok16 = if nan { f16::from_bits(h[i]).is_nan() } else { h[i] == want16[i] || (flushable && h[i] == 0) };
            let okb = if nan { bf16::from_bits(b[i]).is_nan() } else { b[i] == wantb[i] || (flushable && b[i] == 0) };
            assert!(ok16, "f16 of {} on {}: {:#06x}, want {:#06x}", vals[i], d.name(), h[i], want16[i]);
            assert!(okb, "bf16 of {} on {}: {:#06x}, want {:#06x}", vals[i], d.name(), b[i], wantb[i]);
        }
        // Widening back is exact.
        let back = x.to_dtype(DType::F16).unwrap().to_dtype(DType::F32).unwrap().to_vec_f32().unwrap();
        for i in 0..n {
            let w = f16::from_bits(want16[i]).to_f32();
            assert!(back[i] == w || (w.is_nan() && back[i].is_nan()), "f16->f32 on {}: {} vs {w}", d.name(), back[i]);
        }
    }
    parity_err("cast to int", "only f32, f16 and bf16", |d| t(1, &[3], 1.0, d)?.to_dtype(DType::I32));
}

// ---- benchmark -------------------------------------------------------------------------------

const COPY_VEC4: &str = "
@group(0) @binding(1) var<storage, read> src: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> dst: array<vec4<f32>>;
@compute @workgroup_size(256)
fn copy_vec4(@builtin(global_invocation_id) g: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = g.x + g.y * nwg.x * 256u;
    if (i < arrayLength(&dst)) {
        dst[i] = src[i];
    }
}";

/// Seconds per call of `f`, over `iters` calls queued back to back.
fn time(d: &Device, iters: usize, f: &dyn Fn() -> Result<Tensor>) -> f64 {
    let keep = f().unwrap(); // warm-up: pipelines compiled, pool primed
    drop(keep);
    d.sync().unwrap();
    let t0 = std::time::Instant::now();
    for _ in 0..iters {
        f().unwrap();
    }
    d.sync().unwrap();
    t0.elapsed().as_secs_f64() / iters as f64
}

/// `cargo test --release -p anygpu-core --test parity_elementwise -- --ignored --nocapture bench`
#[test]
#[ignore]
fn bench_elementwise_bandwidth() {
    use anygpu_core::gpu::{Bind, KernelSpec};
    let Some(d) = gpu_devices().first() else {
        eprintln!("no GPU");
        return;
    };
    let ctx = d.gpu().unwrap().clone();
    let n: usize = std::env::var("BENCH_ELEMS").ok().and_then(|v| v.parse().ok()).unwrap_or(1 << 28); // 1 GiB
    let iters = 20;
    let x = Tensor::zeros([n], DType::F32, d).unwrap();
    let y = Tensor::zeros([n], DType::F32, d).unwrap();
    let gbs = |bytes: f64, s: f64| bytes / s / 1e9;
    let rw = 2.0 * 4.0 * n as f64; // bytes read + written by a unary f32 op

    let spec = KernelSpec::new("bench_copy_vec4", COPY_VEC4, "copy_vec4");
    let pipe = ctx.pipeline(&spec, &[]).unwrap();
    let copy = || {
        let out = Tensor::gpu_empty([n], DType::F32, d)?;
        let groups = ctx.grid_1d((n as u32 / 4).div_ceil(256));
        ctx.dispatch(
            &pipe,
            "copy_vec4",
            &[],
            &[Bind::Whole(x.gpu_buffer().unwrap()), Bind::Whole(out.gpu_buffer().unwrap())],
            groups,
        )?;
        Ok(out)
    };
    let base = time(d, iters, &copy);
    println!("device: {}  elements: {n} ({} MiB)", d.name(), (n * 4) >> 20);
    println!("{:<34} {:>9.1} GB/s", "baseline WGSL vec4 copy", gbs(rw, base));
    let report = |name: &str, bytes: f64, f: &dyn Fn() -> Result<Tensor>| {
        let s = time(d, iters, f);
        println!("{name:<34} {:>9.1} GB/s  {:>6.3}x copy  {:>8.1} us", gbs(bytes, s), base / s * (bytes / rw), s * 1e6);
    };
    report("affine (unary vec4)", rw, &|| x.affine(1.0, 0.0));
    report("relu (unary vec4)", rw, &|| x.relu());
    report("gelu erf (unary vec4)", rw, &|| x.gelu());
    report("silu (unary vec4)", rw, &|| x.silu());
    report("add (binary vec4)", 1.5 * rw, &|| x.add(&y));
    report("lt (binary vec4)", 1.5 * rw, &|| x.lt(&y));
    let xo = x.narrow(0, 1, n - 4).unwrap();
    let yo = y.narrow(0, 1, n - 4).unwrap();
    report("affine (scalar, offset 1)", rw, &|| xo.affine(1.0, 0.0));
    report("add (scalar, offset 1)", 1.5 * rw, &|| xo.add(&yo));
    let rows = x.reshape([n / 4096, 4096]).unwrap();
    let bias = Tensor::zeros([4096], DType::F32, d).unwrap();
    report("add [T,C]+[C] (vec4, i % C)", rw, &|| rows.add(&bias));
    let bias_odd = Tensor::zeros([4095], DType::F32, d).unwrap();
    let rows_odd = x.narrow(0, 0, n / 4096 * 4095).unwrap().reshape([n / 4096, 4095]).unwrap();
    report("add [T,C]+[C], C odd (scalar)", rw, &|| rows_odd.add(&bias_odd));
    let col = Tensor::zeros([n / 4096, 1], DType::F32, d).unwrap();
    report("add [T,C]+[T,1] (strided)", rw, &|| rows.add(&col));
    let sq = x.reshape([1 << 14, n >> 14]).unwrap();
    report("affine of transpose (strided)", rw, &|| sq.transpose(0, 1)?.affine(1.0, 0.0));
    report("where (contiguous)", 2.0 * rw, &|| x.where_cond(&x, &y));
    report("cast f32->f16", 0.75 * rw, &|| x.to_dtype(DType::F16));
    report("cast f32->bf16", 0.75 * rw, &|| x.to_dtype(DType::BF16));
}
