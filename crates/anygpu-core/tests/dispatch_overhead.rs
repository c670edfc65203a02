//! Host-side cost of recording one dispatch (not a timed test: prints, asserts nothing about
//! speed). Run: cargo test --release -p anygpu-core --test dispatch_overhead -- --ignored --nocapture
use anygpu_core::testing::gpu_devices;
use anygpu_core::Tensor;

#[test]
#[ignore]
fn host_cost_of_recording_dispatches() {
    for d in gpu_devices() {
        let x = Tensor::from_slice(&[1f32; 64], [64], d).unwrap();
        let y = x.affine(1.0, 1.0).unwrap();
        d.sync().unwrap();
        let t0 = std::time::Instant::now();
        for _ in 0..1000 {
            // Dropped at once: its buffer goes back to the pool for the next one, as in a forward pass.
            drop(x.add(&y).unwrap());
        }
        let rec = t0.elapsed();
        d.sync().unwrap();
        eprintln!(
            "{}: {:.1} us per dispatch recorded, {:.1} us incl. execution",
            d.name(),
            rec.as_secs_f64() * 1e3,
            t0.elapsed().as_secs_f64() * 1e3
        );
    }
}
