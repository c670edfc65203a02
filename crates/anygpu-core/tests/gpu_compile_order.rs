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
