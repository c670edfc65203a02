//! The kernel benchmark suite behind `anygpu bench ops`: each kernel at sizes that fill the
//! device (small ones on the CPU backend and software rasterizers, so a full run stays under
//! two minutes there), a warm-up (a first run, then half a second of runs: see [`warm_up`]),
//! then the median of N runs, timed with GPU timestamps when the device has them (wall clock
//! around a full sync otherwise). Each result carries GFLOP/s, GB/s, and the fraction of this
//! device's own ceilings measured in the same run: its copy bandwidth and its best matmul.

use std::time::Instant;

use crate::ops::attention::AttentionOpts;
use crate::ops::softmax::SoftmaxOpts;
use crate::ops::unary::UnaryOp;
use crate::quant::{GgmlType, QTensor};
use crate::testing::rand_vec;
use crate::{DType, Device, Result, Tensor};

#[derive(Clone, Debug, serde::Serialize)]
pub struct BenchResult {
    pub op: String,
    pub shape: String,
    pub dtype: String,
    /// Median time of one run, milliseconds.
    pub ms: f64,
    pub gflops: f64,
    pub gbps: f64,
    /// gbps / this device's copy bandwidth (the `copy` row), when measured.
    pub frac_copy_bandwidth: Option<f64>,
    /// gflops / this device's best matmul in this run, for matmul-like ops.
    pub frac_best_matmul: Option<f64>,
    /// "gpu-timestamp" or "wall-clock".
    pub timer: &'static str,
}

/// How long every benchmark keeps the device busy before it times anything (seconds). A GPU
/// left idle for a few seconds (a model loading, a test uploading its weights) lowers its clocks,
/// and raises them again only after a while of steady work: on the H100 its SM clock fell from
/// 1,980 to 345 MHz after ~3 s with little to do and came back ~0.2 s into steady work, kernels
/// 3-5x slower until then (BENCHMARKS.md, twenty-second session). One untimed run, as
/// llama-bench does, is not that while: a pp512 of SmolLM2 takes 7 ms there.
pub const WARM_UP_S: f64 = 0.5;

/// [`WARM_UP_S`], or `ANYGPU_BENCH_WARMUP_S` (read once; 0: a single untimed run, for
/// comparisons).
fn warm_up_seconds() -> f64 {
    static V: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *V.get_or_init(|| {
        std::env::var("ANYGPU_BENCH_WARMUP_S")
            .ok()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite() && *v >= 0.0)
            .unwrap_or(WARM_UP_S)
    })
}

/// The untimed warm-up of a benchmark: `run` once (it compiles the kernels and fills the
/// pools: host work, during which the GPU idles), then again until [`WARM_UP_S`] seconds (or
/// `ANYGPU_BENCH_WARMUP_S`) have passed since that first run ended, the device synced after
/// each run so that the GPU works steadily rather than queueing. Returns the runs made. (Timed
/// from the start instead, an 8B's first prefill, its kernels compiling, took most of the half
/// second: one of three repetitions after it ran slow, pp512 6,718 ± 1,940.)
pub fn warm_up<T>(dev: &Device, run: impl FnMut() -> Result<T>) -> Result<usize> {
    warm_up_for(dev, warm_up_seconds(), run)
}

/// [`warm_up`] for at least `min` seconds after the first run.
fn warm_up_for<T>(dev: &Device, min: f64, mut run: impl FnMut() -> Result<T>) -> Result<usize> {
    drop(run()?);
    dev.sync()?;
    let t0 = Instant::now();
    let mut runs = 1;
    while t0.elapsed().as_secs_f64() < min {
        drop(run()?);
        dev.sync()?;
        runs += 1;
    }
    Ok(runs)
}

/// One benchmark: how to make its inputs, run it once, and count its work.
struct Case {
    op: &'static str,
    shape: String,
    dtype: &'static str,
    flops: f64,
    bytes: f64,
    run: Box<dyn Fn() -> Result<Tensor>>,
}

fn rand(dims: &[usize], seed: u64, dev: &Device) -> Result<Tensor> {
    Tensor::from_vec(rand_vec(seed, dims.iter().product()), dims, &Device::Cpu)?.to_device(dev)
}

/// Whether this device gets the big sizes (a hardware GPU) or the small ones.
fn is_big(dev: &Device) -> bool {
    matches!(dev, Device::Gpu(ctx) if !ctx.info.software)
}

fn cases(dev: &Device) -> Result<Vec<Case>> {
    let big = is_big(dev);
    let n: usize = if big { 64 << 20 } else { 1 << 20 }; // 256 MiB of f32 on a GPU
    let row = 4096;
    let s = if big { 4096 } else { 256 }; // matmul side
    let mv = if big { 8192 } else { 1024 }; // matvec side
    let (t, h, d) = if big { (4096, 32, 128) } else { (256, 4, 64) };
    let mut v: Vec<Case> = Vec::new();
    let x = rand(&[n], 1, dev)?;
    let y = rand(&[n], 2, dev)?;
    let nb = (n * 4) as f64;
    let xs = x.clone();
    v.push(Case {
        op: "copy",
        shape: format!("[{n}]"),
        dtype: "f32",
        flops: 0.0,
        bytes: 2.0 * nb,
        run: Box::new(move || xs.affine(1.0, 0.0)),
    });
    let (a, b) = (x.clone(), y.clone());
    v.push(Case {
        op: "add",
        shape: format!("[{n}]"),
        dtype: "f32",
        flops: n as f64,
        bytes: 3.0 * nb,
        run: Box::new(move || a.add(&b)),
    });
    for (name, op) in [("gelu", UnaryOp::GeluTanh), ("silu", UnaryOp::Silu), ("exp", UnaryOp::Exp)] {
        let a = x.clone();
        v.push(Case {
            op: name,
            shape: format!("[{n}]"),
            dtype: "f32",
            flops: 8.0 * n as f64,
            bytes: 2.0 * nb,
            run: Box::new(move || a.device().backend().unary(op, &a)),
        });
    }
    let rows = x.reshape([n / row, row])?;
    let w = rand(&[row], 3, dev)?;
    let bias = rand(&[row], 4, dev)?;
    let shape = format!("[{}, {row}]", n / row);
    let r = rows.clone();
    v.push(Case {
        op: "softmax",
        shape: shape.clone(),
        dtype: "f32",
        flops: 5.0 * n as f64,
        bytes: 2.0 * nb,
        run: Box::new(move || r.device().backend().softmax(&r, SoftmaxOpts::default())),
    });
    let (r, ww, bb) = (rows.clone(), w.clone(), bias.clone());
    v.push(Case {
        op: "layer_norm",
        shape: shape.clone(),
        dtype: "f32",
        flops: 8.0 * n as f64,
        bytes: 2.0 * nb,
        run: Box::new(move || r.device().backend().layer_norm(&r, Some(&ww), Some(&bb), 1e-5)),
    });
    let (r, ww) = (rows.clone(), w.clone());
    v.push(Case {
        op: "rms_norm",
        shape,
        dtype: "f32",
        flops: 4.0 * n as f64,
        bytes: 2.0 * nb,
        run: Box::new(move || r.device().backend().rms_norm(&r, Some(&ww), 1e-5)),
    });
    drop((x, y, rows));
    let a = rand(&[s, s], 5, dev)?;
    let b = rand(&[s, s], 6, dev)?;
    let flops = 2.0 * (s as f64).powi(3);
    let (aa, bb) = (a.clone(), b.clone());
    v.push(Case {
        op: "matmul",
        shape: format!("[{s}, {s}] x [{s}, {s}]"),
        dtype: "f32",
        flops,
        bytes: 12.0 * (s * s) as f64,
        run: Box::new(move || aa.matmul(&bb)),
    });
    if let (Ok(ah), Ok(bh)) = (a.device().backend().cast(&a, DType::F16), b.device().backend().cast(&b, DType::F16)) {
        v.push(Case {
            op: "matmul",
            shape: format!("[{s}, {s}] x [{s}, {s}]"),
            dtype: "f16",
            flops,
            bytes: 6.0 * (s * s) as f64,
            run: Box::new(move || ah.matmul(&bh)),
        });
    }
    // Decode shape: an f16 weight matrix times one vector (memory-bound: the weight bytes).
    let wbytes: Vec<u8> =
        rand_vec(7, mv * mv).iter().flat_map(|&f| half::f16::from_f32(f * 0.05).to_le_bytes()).collect();
    let wq = QTensor::from_vec(GgmlType::F16, mv, mv, wbytes, dev)?;
    let xv = rand(&[1, mv], 8, dev)?;
    v.push(Case {
        op: "matvec",
        shape: format!("[{mv}, {mv}] x [{mv}]"),
        dtype: "f16",
        flops: 2.0 * (mv * mv) as f64,
        bytes: 2.0 * (mv * mv) as f64,
        run: Box::new(move || wq.qmatmul(&xv)),
    });
    let q = rand(&[1, h, t, d], 9, dev)?;
    let k = rand(&[1, h, t, d], 10, dev)?;
    let vv = rand(&[1, h, t, d], 11, dev)?;
    let opts = AttentionOpts::new(d, true);
    // Causal: about half the T x T scores are visible; 4 flops per (query, key, dim).
    let att_flops = 4.0 * h as f64 * (t as f64 * (t as f64 + 1.0) / 2.0) * d as f64;
    v.push(Case {
        op: "attention",
        shape: format!("B=1 H={h} T={t} D={d} causal"),
        dtype: "f32",
        flops: att_flops,
        bytes: 16.0 * (h * t * d) as f64,
        run: Box::new(move || q.attention(&k, &vv, &opts)),
    });
    Ok(v)
}

/// Time of one run of `f`, in seconds, and which clock measured it.
fn time_once(dev: &Device, f: &dyn Fn() -> Result<Tensor>) -> Result<(f64, &'static str)> {
    match dev {
        Device::Gpu(ctx) if ctx.caps.timestamp_query => {
            ctx.sync()?;
            let (out, secs) = ctx.gpu_time(f)?;
            drop(out);
            Ok((secs.unwrap_or(0.0), "gpu-timestamp"))
        }
        _ => {
            dev.sync()?;
            let t0 = Instant::now();
            let out = f()?;
            dev.sync()?;
            drop(out);
            Ok((t0.elapsed().as_secs_f64(), "wall-clock"))
        }
    }
}

/// Runs every case whose op name contains `filter`; `reps` timed runs each after the warm-up
/// ([`warm_up`]).
pub fn run_ops(
    dev: &Device,
    filter: Option<&str>,
    reps: usize,
    on_result: &mut dyn FnMut(&BenchResult),
) -> Result<Vec<BenchResult>> {
    let mut out: Vec<BenchResult> = Vec::new();
    for c in cases(dev)? {
        if filter.is_some_and(|f| !c.op.contains(f)) {
            continue;
        }
        warm_up(dev, || time_once(dev, &c.run))?;
        let mut times = Vec::with_capacity(reps.max(1));
        let mut timer = "wall-clock";
        for _ in 0..reps.max(1) {
            let (t, which) = time_once(dev, &c.run)?;
            times.push(t);
            timer = which;
        }
        times.sort_by(|a, b| a.total_cmp(b));
        let secs = times[times.len() / 2].max(1e-12);
        let r = BenchResult {
            op: c.op.to_string(),
            shape: c.shape.clone(),
            dtype: c.dtype.to_string(),
            ms: secs * 1e3,
            gflops: c.flops / secs / 1e9,
            gbps: c.bytes / secs / 1e9,
            frac_copy_bandwidth: None,
            frac_best_matmul: None,
            timer,
        };
        on_result(&r);
        out.push(r);
    }
    // Fractions of the ceilings measured in this run.
    let copy = out.iter().find(|r| r.op == "copy").map(|r| r.gbps);
    let best_mm = out
        .iter()
        .filter(|r| r.op == "matmul")
        .map(|r| r.gflops)
        .fold(None, |m: Option<f64>, g| Some(m.map_or(g, |m| m.max(g))));
    // Compute-bound ops are compared with the best matmul, the rest with the copy bandwidth.
    let compute_ops = ["matmul", "attention"];
    for r in &mut out {
        if compute_ops.contains(&r.op.as_str()) {
            r.frac_best_matmul = best_mm.map(|b| r.gflops / b);
        } else {
            r.frac_copy_bandwidth = copy.map(|c| r.gbps / c);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::warm_up_for;
    use crate::{Device, Error};
    use std::time::Duration;

    #[test]
    fn warm_up_runs_once_then_until_the_time_has_passed() {
        let mut runs = 0;
        let made = warm_up_for(&Device::Cpu, 0.0, || -> crate::Result<()> {
            runs += 1;
            Ok(())
        });
        assert_eq!((made.unwrap(), runs), (1, 1));

        // A first run of 50 ms (compiling, say), then runs of at least 10 ms each for 0.2 s
        // after it: more than one, and none begun after the time had passed (at most 21).
        let t0 = std::time::Instant::now();
        let mut first = true;
        let made = warm_up_for(&Device::Cpu, 0.2, || -> crate::Result<()> {
            std::thread::sleep(Duration::from_millis(if first { 50 } else { 10 }));
            first = false;
            Ok(())
        })
        .unwrap();
        assert!(t0.elapsed() >= Duration::from_millis(250), "{:?}", t0.elapsed());
        assert!((2..=21).contains(&made), "{made} runs: one of 50 ms, then runs of 10 ms for 0.2 s");
    }

    #[test]
    fn warm_up_stops_at_the_first_error() {
        let mut runs = 0;
        let err = warm_up_for(&Device::Cpu, 10.0, || -> crate::Result<()> {
            runs += 1;
            match runs {
                3 => Err(Error::Unsupported("third run".into())),
                _ => Ok(()),
            }
        });
        assert!(matches!(err, Err(Error::Unsupported(m)) if m == "third run"));
        assert_eq!(runs, 3);
    }
}
