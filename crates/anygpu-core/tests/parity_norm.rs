//! Parity tests for softmax / log_softmax (plain and causal), layer_norm / rms_norm and the
//! fused add_layer_norm: odd row lengths (1, 7, 257, 50,000), views, -inf and huge values, and
//! the error cases. Each body runs
//! on the CPU reference and on every GPU device (see anygpu_core::testing).
//! `bench_norm_bandwidth` (ignored) measures them on a real GPU.

use anygpu_core::ops::softmax::SoftmaxOpts;
use anygpu_core::testing::{gpu_devices, parity, parity_err, rand_vec};
use anygpu_core::{DType, Device, Result, Tensor};

fn from(vals: Vec<f32>, dims: &[usize], d: &Device) -> Result<Tensor> {
    Tensor::from_vec(vals, dims, &Device::Cpu)?.to_device(d)
}

/// Random values in [-scale, scale).
fn t(seed: u64, dims: &[usize], scale: f32, d: &Device) -> Result<Tensor> {
    let n = dims.iter().product();
    from(rand_vec(seed, n).into_iter().map(|v| v * scale).collect(), dims, d)
}

const SOFTMAX: SoftmaxOpts = SoftmaxOpts { log: false, causal: false };
const LOG_SOFTMAX: SoftmaxOpts = SoftmaxOpts { log: true, causal: false };

fn tol(opts: SoftmaxOpts) -> (f32, f32) {
    if opts.log {
        (2e-5, 1e-5)
    } else {
        (1e-6, 1e-5)
    }
}

#[test]
fn softmax_odd_rows() {
    for opts in [SOFTMAX, LOG_SOFTMAX] {
        let (atol, rtol) = tol(opts);
        for dims in [vec![1], vec![1, 1], vec![3, 7], vec![5, 257], vec![4099], vec![2, 3, 300], vec![2, 50_000]] {
            parity("softmax", atol, rtol, |d| t(1, &dims, 10.0, d)?.softmax(opts)?.to_vec_f32());
        }
        parity("softmax transposed", atol, rtol, |d| {
            t(2, &[300, 5], 10.0, d)?.transpose(0, 1)?.softmax(opts)?.to_vec_f32()
        });
        parity("softmax narrow", atol, rtol, |d| {
            t(3, &[9, 40], 10.0, d)?.narrow(1, 3, 33)?.softmax(opts)?.to_vec_f32()
        });
        parity("softmax zero rows", 0.0, 0.0, |d| t(4, &[0, 5], 1.0, d)?.softmax(opts)?.to_vec_f32());
    }
}

#[test]
fn softmax_infinities_and_huge_values() {
    let ninf = f32::NEG_INFINITY;
    let rows: Vec<Vec<f32>> = vec![
        vec![ninf; 7],                                     // all -inf: 0 / -inf, no NaN
        vec![1e30, -1e30, 0.0, 1e30, 5.0, ninf, -3.0],     // huge values
        vec![ninf, 0.5, ninf, ninf, -0.5, ninf, ninf],     // masked entries
        vec![-1e30; 7],                                    // uniform, huge negative
        vec![3.0e38, 3.0e38, -3.0e38, 0.0, 1.0, 2.0, 3.0], // near f32 max
    ];
    for opts in [SOFTMAX, LOG_SOFTMAX] {
        let (atol, rtol) = tol(opts);
        let flat: Vec<f32> = rows.concat();
        parity("softmax special rows", atol, rtol, |d| {
            let out = from(flat.clone(), &[rows.len(), 7], d)?.softmax(opts)?.to_vec_f32()?;
            assert!(out.iter().all(|v| !v.is_nan()), "NaN on {}: {out:?}", d.name());
            Ok(out)
        });
        // The same rows, long: the masked values fall in different threads' strides.
        parity("softmax special long rows", atol, rtol, |d| {
            let long: Vec<f32> = rows.iter().flat_map(|r| r.iter().cycle().take(1031).copied()).collect();
            from(long, &[rows.len(), 1031], d)?.softmax(opts)?.to_vec_f32()
        });
    }
    // Defined outputs of an all -inf row.
    for d in std::iter::once(&Device::Cpu).chain(gpu_devices()) {
        let x = from(vec![ninf; 5], &[5], d).unwrap();
        assert_eq!(x.softmax(SOFTMAX).unwrap().to_vec_f32().unwrap(), vec![0.0; 5], "{}", d.name());
        assert_eq!(x.softmax(LOG_SOFTMAX).unwrap().to_vec_f32().unwrap(), vec![ninf; 5], "{}", d.name());
    }
}

#[test]
fn softmax_causal() {
    for log in [false, true] {
        let opts = SoftmaxOpts { log, causal: true };
        let (atol, rtol) = tol(opts);
        // Tq == Tk, Tk > Tq (a KV cache: query i sees i + Tk - Tq keys), Tk < Tq (the first
        // rows see nothing), one query, long rows.
        for dims in [vec![7, 7], vec![2, 3, 5, 5], vec![3, 5, 9], vec![6, 4], vec![2, 1, 257], vec![2, 3, 600]] {
            parity("causal softmax", atol, rtol, |d| t(5, &dims, 5.0, d)?.softmax(opts)?.to_vec_f32());
        }
        parity("causal transposed", atol, rtol, |d| {
            t(6, &[2, 9, 7], 5.0, d)?.transpose(1, 2)?.softmax(opts)?.to_vec_f32()
        });
    }
    // The mask itself: row i of a square block keeps i + 1 entries.
    for d in std::iter::once(&Device::Cpu).chain(gpu_devices()) {
        let out = Tensor::zeros([3, 3], DType::F32, d)
            .unwrap()
            .softmax(SoftmaxOpts { log: false, causal: true })
            .unwrap()
            .to_vec_f32()
            .unwrap();
        let want = [1.0, 0.0, 0.0, 0.5, 0.5, 0.0, 1.0 / 3.0, 1.0 / 3.0, 1.0 / 3.0];
        assert!(out.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-6), "{}: {out:?}", d.name());
    }
}

#[test]
fn softmax_errors() {
    parity_err("softmax scalar", "at least one dimension", |d| from(vec![1.0], &[], d)?.softmax(SOFTMAX));
    parity_err("softmax empty axis", "empty last axis", |d| Tensor::zeros([3, 0], DType::F32, d)?.softmax(SOFTMAX));
    parity_err("causal rank 1", "rank >= 2", |d| t(1, &[5], 1.0, d)?.softmax(SoftmaxOpts { log: false, causal: true }));
    parity_err("softmax dtype", "expected f32", |d| t(1, &[4], 1.0, d)?.to_dtype(DType::F16)?.softmax(SOFTMAX));
}

type NormFn = fn(&Tensor, Option<&Tensor>, Option<&Tensor>) -> Result<Tensor>;

fn ln(x: &Tensor, w: Option<&Tensor>, b: Option<&Tensor>) -> Result<Tensor> {
    x.layer_norm(w, b, 1e-5)
}

fn rms(x: &Tensor, w: Option<&Tensor>, _b: Option<&Tensor>) -> Result<Tensor> {
    x.rms_norm(w, 1e-6)
}

#[test]
fn norms_odd_rows() {
    let norms: [(&str, NormFn); 2] = [("layer_norm", ln), ("rms_norm", rms)];
    for (name, f) in norms {
        for dims in [vec![1], vec![1, 1], vec![7, 7], vec![5, 257], vec![2, 4099], vec![2, 3, 300], vec![2, 50_000]] {
            let c = *dims.last().unwrap();
            for (with_w, with_b) in [(false, false), (true, false), (true, true), (false, true)] {
                parity(name, 2e-5, 1e-5, |d| {
                    let w = if with_w { Some(t(11, &[c], 2.0, d)?) } else { None };
                    let b = if with_b { Some(t(12, &[c], 1.0, d)?) } else { None };
                    f(&t(10, &dims, 3.0, d)?, w.as_ref(), b.as_ref())?.to_vec_f32()
                });
            }
        }
        parity("norm transposed", 2e-5, 1e-5, |d| {
            f(&t(13, &[300, 5], 1.0, d)?.transpose(0, 1)?, Some(&t(14, &[300], 1.0, d)?), None)?.to_vec_f32()
        });
        parity("norm narrow weight", 2e-5, 1e-5, |d| {
            let w = t(15, &[40], 1.0, d)?.narrow(0, 5, 33)?;
            let b = t(16, &[40], 1.0, d)?.narrow(0, 1, 33)?;
            f(&t(17, &[9, 33], 1.0, d)?, Some(&w), Some(&b))?.to_vec_f32()
        });
        parity("norm zero rows", 0.0, 0.0, |d| f(&t(18, &[0, 8], 1.0, d)?, None, None)?.to_vec_f32());
    }
}

#[test]
fn layer_norm_large_mean_does_not_cancel() {
    // Rows with mean 1e4 and spread 1: E[x^2] - E[x]^2 in f32 would lose every digit of the
    // variance (1e8 vs a variance of ~0.33 at f32's 2^-24 relative spacing), and even a
    // Welford mean of unshifted values is off by ~ulp(1e4) = 1e-3. The kernel shifts by the
    // row's first element, so the same tolerance as ordinary rows holds.
    for c in [7, 257, 4099] {
        parity("layer_norm large mean", 2e-5, 1e-5, |d| {
            let x = from(rand_vec(20, 3 * c).iter().map(|v| 1e4 + v).collect(), &[3, c], d)?;
            x.layer_norm(None, None, 1e-5)?.to_vec_f32()
        });
    }
    // A constant row: variance 0, output 0 (or the bias), no NaN.
    parity("layer_norm constant row", 0.0, 0.0, |d| {
        from(vec![3.5; 300], &[300], d)?.layer_norm(None, Some(&from(vec![0.25; 300], &[300], d)?), 1e-5)?.to_vec_f32()
    });
}

#[test]
fn norm_errors() {
    parity_err("layer_norm weight shape", "does not match [8]", |d| {
        t(1, &[3, 8], 1.0, d)?.layer_norm(Some(&t(2, &[7], 1.0, d)?), None, 1e-5)
    });
    parity_err("layer_norm bias shape", "bias shape [2, 8]", |d| {
        t(1, &[3, 8], 1.0, d)?.layer_norm(None, Some(&t(2, &[2, 8], 1.0, d)?), 1e-5)
    });
    parity_err("rms_norm weight shape", "does not match [8]", |d| {
        t(1, &[3, 8], 1.0, d)?.rms_norm(Some(&t(2, &[9], 1.0, d)?), 1e-5)
    });
    parity_err("rms_norm weight dtype", "weight must be f32", |d| {
        t(1, &[3, 8], 1.0, d)?.rms_norm(Some(&t(2, &[8], 1.0, d)?.to_dtype(DType::BF16)?), 1e-5)
    });
    parity_err("layer_norm x dtype", "expected f32", |d| {
        t(1, &[3, 8], 1.0, d)?.to_dtype(DType::F16)?.layer_norm(None, None, 1e-5)
    });
    parity_err("norm scalar", "non-empty last axis", |d| from(vec![1.0], &[], d)?.rms_norm(None, 1e-5));
    parity_err("norm empty axis", "non-empty last axis", |d| {
        Tensor::zeros([4, 0], DType::F32, d)?.rms_norm(None, 1e-5)
    });
}

/// `x.add_layer_norm(r)` and the composition `x.add(r)?.layer_norm()`, concatenated: the GPU's
/// fused kernel and its composition both against the CPU's. The CPU reference is the
/// composition itself: there the two agree exactly.
fn add_ln_and_composition(
    d: &Device,
    x: &Tensor,
    r: &Tensor,
    w: Option<&Tensor>,
    b: Option<&Tensor>,
    eps: f32,
) -> Result<Vec<f32>> {
    let fused = x.add_layer_norm(r, w, b, eps)?;
    assert_eq!(fused.dims(), x.dims());
    let fused = fused.to_vec_f32()?;
    let composed = x.add(r)?.layer_norm(w, b, eps)?.to_vec_f32()?;
    if matches!(d, Device::Cpu) {
        assert_eq!(fused, composed, "CPU add_layer_norm differs from add + layer_norm");
    }
    Ok([fused, composed].concat())
}

#[test]
fn add_layer_norm_odd_rows() {
    // Rows of 1, 3, 257 (past one workgroup's 256 threads), 384 (MiniLM's C) and 1000 columns,
    // several row counts, every weight / bias combination.
    for dims in [vec![1], vec![4, 1], vec![3], vec![5, 3], vec![3, 257], vec![2, 3, 384], vec![7, 1000]] {
        let c = *dims.last().unwrap();
        for (with_w, with_b) in [(false, false), (true, false), (true, true), (false, true)] {
            let name = format!("add_layer_norm {dims:?} weight {with_w} bias {with_b}");
            parity(&name, 2e-5, 1e-5, |d| {
                let w = if with_w { Some(t(31, &[c], 2.0, d)?) } else { None };
                let b = if with_b { Some(t(32, &[c], 1.0, d)?) } else { None };
                add_ln_and_composition(d, &t(33, &dims, 3.0, d)?, &t(34, &dims, 2.0, d)?, w.as_ref(), b.as_ref(), 1e-5)
            });
        }
    }
}

#[test]
fn add_layer_norm_views_and_large_values() {
    // Views that start mid-buffer and a transposed residual (made contiguous first), weight and
    // bias views.
    parity("add_layer_norm views", 2e-5, 1e-5, |d| {
        let x = t(40, &[9, 40], 2.0, d)?.narrow(1, 3, 33)?.narrow(0, 1, 7)?;
        let r = t(41, &[33, 7], 2.0, d)?.transpose(0, 1)?;
        let w = t(42, &[40], 1.0, d)?.narrow(0, 5, 33)?;
        let b = t(43, &[40], 1.0, d)?.narrow(0, 1, 33)?;
        add_ln_and_composition(d, &x, &r, Some(&w), Some(&b), 1e-5)
    });
    // A large common offset split between the operands (cancels nothing: the kernel shifts by
    // the row's first sum, as layer_norm does), and a residual that cancels x exactly (a
    // constant row: output 0 or the bias, no NaN).
    for c in [7, 384] {
        parity("add_layer_norm large mean", 2e-5, 1e-5, |d| {
            let x = from(rand_vec(44, 3 * c).iter().map(|v| 6e3 + v).collect(), &[3, c], d)?;
            let r = from(rand_vec(45, 3 * c).iter().map(|v| 4e3 + v).collect(), &[3, c], d)?;
            add_ln_and_composition(d, &x, &r, None, None, 1e-5)
        });
    }
    parity("add_layer_norm cancelling rows", 0.0, 0.0, |d| {
        let x = t(46, &[2, 300], 3.0, d)?;
        let out = add_ln_and_composition(d, &x, &x.neg()?, None, Some(&from(vec![0.25; 300], &[300], d)?), 1e-5)?;
        assert!(out.iter().all(|&v| v == 0.25), "{}: {:?}", d.name(), &out[..4]);
        Ok(out)
    });
    parity("add_layer_norm zero rows", 0.0, 0.0, |d| {
        t(47, &[0, 8], 1.0, d)?.add_layer_norm(&t(48, &[0, 8], 1.0, d)?, None, None, 1e-5)?.to_vec_f32()
    });
}

#[test]
fn add_layer_norm_errors() {
    let ln = |x: Tensor, r: Tensor, w: Option<Tensor>| x.add_layer_norm(&r, w.as_ref(), None, 1e-5);
    parity_err("add_layer_norm residual shape", "residual shape [3, 7] does not match input [3, 8]", |d| {
        ln(t(1, &[3, 8], 1.0, d)?, t(2, &[3, 7], 1.0, d)?, None)
    });
    // No broadcasting: a residual of one row is an error too.
    parity_err("add_layer_norm residual broadcast", "residual shape [8] does not match", |d| {
        ln(t(1, &[3, 8], 1.0, d)?, t(2, &[8], 1.0, d)?, None)
    });
    parity_err("add_layer_norm residual dtype", "expected f32", |d| {
        ln(t(1, &[3, 8], 1.0, d)?, t(2, &[3, 8], 1.0, d)?.to_dtype(DType::F16)?, None)
    });
    parity_err("add_layer_norm weight shape", "does not match [8]", |d| {
        ln(t(1, &[3, 8], 1.0, d)?, t(2, &[3, 8], 1.0, d)?, Some(t(3, &[7], 1.0, d)?))
    });
    parity_err("add_layer_norm empty axis", "non-empty last axis", |d| {
        ln(Tensor::zeros([4, 0], DType::F32, d)?, Tensor::zeros([4, 0], DType::F32, d)?, None)
    });
    for d in gpu_devices() {
        let err = ln(t(1, &[3, 8], 1.0, d).unwrap(), t(2, &[3, 8], 1.0, &Device::Cpu).unwrap(), None)
            .expect_err("residual on another device")
            .to_string();
        assert!(err.contains("different devices"), "{err}");
    }
}

/// Seconds per call of `f`, over `iters` calls queued back to back.
fn time(d: &Device, iters: usize, f: &dyn Fn() -> Result<Tensor>) -> f64 {
    // Each op starts with an empty buffer pool: the GiB-sized outputs of the ops before would
    // fill it, and a buffer given back to a full pool is destroyed at once, even while queued
    // work still binds it (gpu/pool.rs), which fails the submit.
    if let Some(ctx) = d.gpu() {
        ctx.release_pooled().unwrap();
    }
    drop(f().unwrap());
    d.sync().unwrap();
    let t0 = std::time::Instant::now();
    for _ in 0..iters {
        f().unwrap();
    }
    d.sync().unwrap();
    t0.elapsed().as_secs_f64() / iters as f64
}

/// `cargo test --release -p anygpu-core --test parity_norm -- --ignored --nocapture bench`
#[test]
#[ignore]
fn bench_norm_bandwidth() {
    let Some(d) = gpu_devices().first() else {
        eprintln!("no GPU");
        return;
    };
    println!("device: {}", d.name());
    // [8192, 384]: a MiniLM batch of 64 x 128 tokens.
    for (rows, c) in [(65536usize, 4096usize), (2048, 50_000), (1 << 20, 256), (4 << 20, 64), (8192, 384)] {
        let x = Tensor::zeros([rows, c], DType::F32, d).unwrap();
        let w = t(2, &[c], 1.0, d).unwrap();
        // Bytes moved: one read and one write per element; add_layer_norm reads two inputs
        // (its composition: add reads two and writes one, then the norm).
        let bytes = |streams: f64| streams * 4.0 * (rows * c) as f64;
        for (name, streams, f) in [
            ("softmax", 2.0, &(|| x.softmax(SOFTMAX)) as &dyn Fn() -> Result<Tensor>),
            ("causal softmax", 2.0, &|| x.reshape([rows / 8, 8, c])?.softmax(SoftmaxOpts { log: false, causal: true })),
            ("layer_norm w+b", 2.0, &|| x.layer_norm(Some(&w), Some(&w), 1e-5)),
            ("add + layer_norm", 5.0, &|| x.add(&x)?.layer_norm(Some(&w), Some(&w), 1e-5)),
            ("add_layer_norm", 3.0, &|| x.add_layer_norm(&x, Some(&w), Some(&w), 1e-5)),
            ("rms_norm w", 2.0, &|| x.rms_norm(Some(&w), 1e-5)),
        ] {
            let s = time(d, 10, f);
            println!("{name:<16} [{rows} x {c}]  {:>8.1} GB/s  {:>8.1} us", bytes(streams) / s / 1e9, s * 1e6);
        }
    }
}
