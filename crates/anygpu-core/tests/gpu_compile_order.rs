//! Kernels compile on worker threads; commands issued while one compiles wait in a queue and
//! must still run in issue order, host writes included (`GpuContext::dispatch`, `write`).
//! A test binary of its own: its first dispatches find an empty pipeline cache.
use anygpu_core::testing::parity;
use anygpu_core::{Device, Result, Tensor};

/// The tests take turns: they share each device, and a device's errors are the device's (as
/// a WebGPU device's are), so the broken kernel's compile error, found while encoding queued
/// commands, could otherwise be reported to the other test's next command (seen once: both
/// tests failed, each with the other's outcome).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn commands_behind_a_compiling_kernel_keep_their_order() {
    let _turn = one_at_a_time();
    let n = 1000;
    let first: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
    let second: Vec<f32> = (0..n).map(|i| 3.0 - i as f32).collect();
    let waited = std::sync::Mutex::new(Vec::new());
    parity("dispatch, write, dispatch behind a compiling kernel", 0.0, 0.0, |d: &Device| -> Result<Vec<f32>> {
        let x = Tensor::from_slice(&first, [n], d)?;
        // New kernels: on a backend that compiles on worker threads this dispatch waits.
        let y = x.affine(2.0, 1.0)?;
        let z = y.mul(&y)?;
        if let (Device::Gpu(ctx), Some(buf)) = (d, x.gpu_buffer()) {
            waited.lock().unwrap().push((d.name(), ctx.commands_waiting_for_kernels()));
            // Overwrites x: the dispatches above must still read the first values.
            ctx.write(buf, 0, bytemuck::cast_slice(&second))?;
        } else {
            // The CPU reference: the same values the GPU must produce.
            let x2 = Tensor::from_slice(&second, [n], d)?;
            let w = x2.add(&z)?;
            return Ok([y.to_vec_f32()?, w.to_vec_f32()?].concat());
        }
        let w = x.add(&z)?;
        Ok([y.to_vec_f32()?, w.to_vec_f32()?].concat())
    });
    for (name, waiting) in waited.into_inner().unwrap() {
        eprintln!("{name}: {waiting} command(s) waited for a kernel to compile");
    }
}

#[test]
fn a_kernel_that_fails_to_compile_is_an_error_naming_it_and_the_device_goes_on() {
    let _turn = one_at_a_time();
    const BAD: &str = "@group(0) @binding(1) var<storage, read_write> o: array<f32>;
@compute @workgroup_size(64) fn main(@builtin(global_invocation_id) i: vec3<u32>) { o[i.x] = undefined_name; }";
    for d in anygpu_core::testing::gpu_devices() {
        let ctx = d.gpu().expect("a GPU device");
        let out = Tensor::zeros([64], anygpu_core::DType::F32, d).expect("zeros");
        // pipeline() returns at once; the compile error comes back from the dispatch, or (when
        // the dispatch waited behind the compile) from the next wait.
        let spec = anygpu_core::gpu::KernelSpec::new("broken_kernel", BAD, "main");
        let err = ctx
            .pipeline(&spec, &[])
            .and_then(|p| {
                ctx.dispatch(
                    &p,
                    "broken",
                    &[],
                    &[anygpu_core::gpu::Bind::Whole(out.gpu_buffer().expect("gpu"))],
                    [1, 1, 1],
                )
            })
            .and_then(|()| ctx.sync())
            .err()
            .unwrap_or_else(|| panic!("{}: a kernel that cannot compile ran", d.name()))
            .to_string();
        assert!(err.contains("broken_kernel"), "{}: {err}", d.name());
        // Nothing else is lost: the device still runs work (an op the other test does not use,
        // so that its kernels still find the cache empty when it runs second).
        let x = Tensor::from_slice(&[1f32, 2.0, 3.0], [3], d).expect("upload");
        assert_eq!(x.neg().and_then(|y| y.to_vec_f32()).expect("after the error"), vec![-1.0, -2.0, -3.0]);
    }
}

/// Two threads asking for the same new kernels at the same moment, each then reading its
/// result back (a read encodes the commands deferred behind a compiling kernel, under the
/// device's lock): neither may wait forever, and each reads its own values. A watchdog turns a
/// hang into a failure. The hang this guards against: on GL, kernels compile under that lock,
/// and a kernel's entry used to become visible before the lock was taken; a thread preempted
/// in between left the other holding the lock while it waited for that compile (two parity
/// tests hung so on the 2-core machine). That window was microseconds wide: this test did not
/// reproduce it against the old code in seven runs (nor with a megabyte-long source and
/// spinning threads to force preemption); the fix holds by construction (GL entries appear
/// only under the lock, see `GpuContext::pipeline`), and this checks the concurrent path.
#[test]
fn two_threads_compiling_the_same_kernels_do_not_deadlock() {
    let _turn = one_at_a_time();
    const ROUNDS: u32 = 48;
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    for d in anygpu_core::testing::gpu_devices() {
        let start = std::sync::Arc::new(std::sync::Barrier::new(2));
        for t in 0..2 {
            let (d, start, done) = (d.clone(), start.clone(), done_tx.clone());
            std::thread::spawn(move || {
                let ctx = d.gpu().expect("a GPU device").clone();
                let result = (0..ROUNDS).try_for_each(|i| -> std::result::Result<(), String> {
                    let src = format!(
                        "@group(0) @binding(1) var<storage, read_write> o: array<f32>;
@compute @workgroup_size(64) fn main(@builtin(global_invocation_id) g: vec3<u32>) {{ o[g.x] = {i}.0; }}"
                    );
                    let src: &'static str = Box::leak(src.into_boxed_str());
                    let out = Tensor::zeros([64], anygpu_core::DType::F32, &d).map_err(|e| e.to_string())?;
                    let buf = out.gpu_buffer().expect("a GPU tensor");
                    start.wait();
                    let spec = anygpu_core::gpu::KernelSpec::new(format!("deadlock_probe_{i}"), src, "main");
                    let got = ctx
                        .pipeline(&spec, &[])
                        .and_then(|p| {
                            ctx.dispatch(&p, "deadlock probe", &[], &[anygpu_core::gpu::Bind::Whole(buf)], [1, 1, 1])
                        })
                        .and_then(|()| out.to_vec_f32())
                        .map_err(|e| format!("round {i}: {e}"))?;
                    match got.iter().all(|&v| v == i as f32) {
                        true => Ok(()),
                        false => Err(format!("round {i}: read {got:?}")),
                    }
                });
                let _ = done.send((d.name(), t, result));
            });
        }
    }
    drop(done_tx);
    let threads = 2 * anygpu_core::testing::gpu_devices().len();
    for _ in 0..threads {
        match done_rx.recv_timeout(std::time::Duration::from_secs(180)) {
            Ok((name, t, Ok(()))) => eprintln!("{name}: thread {t} done"),
            Ok((name, t, Err(e))) => panic!("{name}: thread {t}: {e}"),
            Err(_) => panic!("two threads compiling the same kernels made no progress for 180 s: a deadlock"),
        }
    }
}

/// Asking how an attention call would run (its key splits, whether it takes the decode kernel)
/// compiles nothing; running it does. The decode step asks before it records its attention, and
/// the kernel that the question compiled and nothing ran was a compile still running at exit
/// (BENCHMARKS.md, twentieth session).
#[test]
fn asking_how_an_attention_would_run_compiles_nothing() {
    use anygpu_core::ops::attention::{gpu_attention_partial_splits, takes_decode_kernel, AttentionOpts};
    let _turn = one_at_a_time();
    let t = |dims: &[usize], d: &Device| {
        let n: usize = dims.iter().product();
        Tensor::from_vec((0..n).map(|i| (i % 7) as f32 * 0.1).collect(), dims, d).expect("upload")
    };
    for d in anygpu_core::testing::gpu_devices() {
        let ctx = d.gpu().expect("a GPU device");
        let q = t(&[1, 8, 1, 64], d);
        let k = t(&[1, 2, 160, 64], d).narrow(2, 0, 37).expect("view");
        let v = t(&[1, 2, 160, 64], d).narrow(2, 0, 37).expect("view");
        let opts = AttentionOpts::new(64, true);
        let before = ctx.pipelines_compiled();
        takes_decode_kernel(&q, &k, &v, &opts).expect("plan");
        gpu_attention_partial_splits(&q, &k, &v, &opts).expect("plan");
        assert_eq!(ctx.pipelines_compiled(), before, "{}: planning compiled a kernel", d.name());
        q.attention(&k, &v, &opts).and_then(|o| o.to_vec_f32()).expect("attention");
        assert!(ctx.pipelines_compiled() > before, "{}: the attention compiled no kernel", d.name());
    }
}
