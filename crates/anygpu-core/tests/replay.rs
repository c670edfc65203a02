//! Recording and replaying dispatches (gpu/replay.rs): a replay at a new position equals the
//! op run directly there; what cannot be replayed is an error when the replay is built or while
//! recording, never a wrong result.

use anygpu_core::gpu::Replay;
use anygpu_core::testing::{check_close, gpu_devices, rand_vec};
use anygpu_core::{Device, Result, Tensor};

/// The tests take turns: a dispatch profile counts every dispatch on the device's context, the
/// other test's included when they run side by side (seen in CI: 5 dispatches for 3).
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn replay_matches_direct_runs_and_refuses_what_it_cannot_replay() -> Result<()> {
    let _turn = one_at_a_time();
    for dev in gpu_devices() {
        let ctx = dev.gpu().expect("a GPU device").clone();
        let x = Tensor::from_vec(rand_vec(1, 64), [64], &Device::Cpu)?.to_device(dev)?;
        // A window of x starting at the position: the kernel's offset parameter is `pos`. (7
        // elements: with 8, offsets that are multiples of 4 take a vec4 kernel, and recordings
        // at 0 and 1 differ in their kernels, which Replay::new refuses.)
        let window = |p: usize| x.narrow(0, p, 7)?.exp()?.scale(2.0);
        let mut recs = Vec::new();
        let mut out = None;
        for p in [0usize, 1, 40] {
            let (y, rec) = ctx.record(|| window(p))?;
            assert_eq!(rec.len(), 2, "exp and scale recorded on {}", dev.name());
            out.get_or_insert(y);
            recs.push((p as u32, rec));
        }
        let out = out.expect("recorded");
        let mut replay = Replay::new(&ctx, recs)?;
        assert!(replay.patched_words() >= 1);
        for p in [3usize, 17, 56, 3] {
            let bytes = replay.run(p as u32, &[], out.gpu_buffer().expect("gpu"), 28)?;
            let got: Vec<f32> = bytemuck::cast_slice(&bytes).to_vec();
            let want = window(p)?.to_vec_f32()?;
            check_close(&format!("replay at {p} on {}", dev.name()), &got, &want, 0.0, 0.0)
                .unwrap_or_else(|m| panic!("{m}"));
        }

        // Runs chaining several steps (one submit, one pass) return each step's output in
        // order, two runs in flight, and equal single runs.
        let buf = out.gpu_buffer().expect("gpu");
        let first = replay.submit_steps(2, 5, &[], buf, 28)?;
        let second = replay.submit_steps(7, anygpu_core::gpu::MAX_STEPS_PER_RUN, &[], buf, 28)?;
        for (ticket, start, steps) in [(first, 2usize, 5usize), (second, 7, anygpu_core::gpu::MAX_STEPS_PER_RUN)] {
            let bytes = replay.wait(ticket)?;
            assert_eq!(bytes.len(), 28 * steps);
            for j in 0..steps {
                let got: Vec<f32> = bytemuck::cast_slice(&bytes[28 * j..28 * (j + 1)]).to_vec();
                let want = window(start + j)?.to_vec_f32()?;
                check_close(&format!("step {j} of a run from {start} on {}", dev.name()), &got, &want, 0.0, 0.0)
                    .unwrap_or_else(|m| panic!("{m}"));
            }
        }
        assert!(replay.submit_steps(0, 0, &[], buf, 28).is_err(), "a run of no steps");
        assert!(replay.submit_steps(0, anygpu_core::gpu::MAX_STEPS_PER_RUN + 1, &[], buf, 28).is_err());

        // A parameter that is not linear in the position (an f32 scale) is refused.
        let mut recs = Vec::new();
        for p in [1u32, 2, 3] {
            recs.push((p, ctx.record(|| x.scale(p as f32))?.1));
        }
        let err = Replay::new(&ctx, recs).err().expect("not linear").to_string();
        assert!(err.contains("not linear"), "{err}");

        // Kernels that change with the position are refused (the vec4 case above).
        let recs =
            vec![(0, ctx.record(|| x.narrow(0, 0, 8)?.exp())?.1), (1, ctx.record(|| x.narrow(0, 1, 8)?.exp())?.1)];
        let err = Replay::new(&ctx, recs).err().expect("different kernels").to_string();
        assert!(err.contains("differs between positions"), "{err}");

        // A structure that changes with the position is refused.
        let recs = vec![(0, ctx.record(|| x.exp())?.1), (1, ctx.record(|| x.exp()?.exp())?.1)];
        let err = Replay::new(&ctx, recs).err().expect("different structure").to_string();
        assert!(err.contains("dispatches"), "{err}");

        // Waiting for the GPU inside a recording is an error, and the context works after it.
        let err = ctx.record(|| x.exp()?.to_vec_f32()).err().expect("read while recording").to_string();
        assert!(err.contains("recorded for replay"), "{err}");
        assert_eq!(x.exp()?.to_vec_f32()?.len(), 64);
    }
    Ok(())
}

/// The direct path's per-dispatch profile (`GpuContext::profile_dispatches`): every dispatch
/// counted under its op and grid, results unchanged, and the context usable afterwards.
#[test]
fn dispatch_profile_counts_each_dispatch() -> Result<()> {
    let _turn = one_at_a_time();
    for dev in gpu_devices() {
        let ctx = dev.gpu().expect("a GPU device").clone();
        let x = Tensor::from_vec(rand_vec(2, 1000), [1000], &Device::Cpu)?.to_device(dev)?;
        let want = x.exp()?.scale(2.0)?.exp()?.to_vec_f32()?;
        let (y, ops) = ctx.profile_dispatches(|| x.exp()?.scale(2.0)?.exp())?;
        check_close(&format!("profiled result on {}", dev.name()), &y.to_vec_f32()?, &want, 0.0, 0.0)
            .unwrap_or_else(|m| panic!("{m}"));
        let Some(ops) = ops else {
            eprintln!("{}: no timestamp queries, no profile", dev.name());
            continue;
        };
        let count = |name: &str| ops.iter().filter(|o| o.0.starts_with(name)).map(|o| o.1).sum::<usize>();
        assert_eq!(ops.iter().map(|o| o.1).sum::<usize>(), 3, "{ops:?} on {}", dev.name());
        assert_eq!(count("exp "), 2, "{ops:?}");
        assert!(ops.iter().all(|o| o.2 >= 0.0 && o.2 < 1.0), "{ops:?}");
        // A second profile, then normal work: nothing left behind.
        assert!(ctx.profile_dispatches(|| x.exp())?.1.is_some_and(|o| o.len() == 1));
        check_close("after the profile", &x.exp()?.scale(2.0)?.exp()?.to_vec_f32()?, &want, 0.0, 0.0)
            .unwrap_or_else(|m| panic!("{m}"));
    }
    Ok(())
}
