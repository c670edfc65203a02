//! Device memory taken by a model's weights: about their own size, not whole blocks of the
//! allocator's (`memory_hints` in gpu/context.rs), and no staging copies piling up while they
//! upload (`QUEUED_WRITES_MAX`, `WeightLoading`). A test binary of its own, so that no other test allocates or
//! frees device memory while it measures.

use anygpu_core::testing::gpu_devices;
use std::sync::Mutex;

/// The tests measure the same devices: one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

/// Five weight-like buffers of 100 MiB each (104 MiB with the pool's size class), uploaded as
/// a model loads: before any other command. Seen to fail with `ANYGPU_MEMORY_BLOCKS=large`
/// (256 MiB blocks hold two of them each: 768 MiB reserved for three) and without the bound
/// on queued writes (every upload's staging copy still allocated after the fifth).
#[test]
fn weights_take_about_their_own_size() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let bytes = vec![0x3cu8; 100 << 20];
    for d in gpu_devices() {
        let Some(ctx) = d.gpu() else { continue };
        let Some((alloc0, reserved0)) = ctx.memory_use() else {
            eprintln!("{}: the backend reports no allocator figures", d.name());
            continue;
        };
        let mut weights = Vec::new();
        for i in 1..=5u64 {
            weights.push(ctx.upload(&bytes).expect("upload"));
            let (alloc, _) = ctx.memory_use().expect("allocator figures");
            let extra = mib(alloc.saturating_sub(alloc0)) - 104.0 * i as f64;
            // Queued staging copies: at most 256 MiB before they are submitted, plus this one.
            assert!(extra <= 256.0 + 104.0, "{}: {extra:.0} MiB beside {i} weights while uploading", d.name());
        }
        d.sync().expect("sync");
        let (alloc1, reserved1) = ctx.memory_use().expect("allocator figures");
        let (allocated, reserved) = (mib(alloc1.saturating_sub(alloc0)), mib(reserved1.saturating_sub(reserved0)));
        eprintln!(
            "{}: 5 x 100 MiB uploaded: {allocated:.0} MiB allocated in {reserved:.0} MiB of new blocks",
            d.name()
        );
        assert!(
            (510.0..=530.0).contains(&allocated),
            "{}: {allocated:.0} MiB allocated for 5 x 104 MiB of weights once uploaded",
            d.name()
        );
        assert!(
            reserved <= allocated + 8.0,
            "{}: {reserved:.0} MiB of blocks for {allocated:.0} MiB of weights",
            d.name()
        );
        drop(weights);
    }
}

/// 300 small weights (300 KiB each, 320 with the pool's size class) loaded in a
/// `WeightLoading` scope. Where the queue's staging copies share the weights' memory type
/// (lavapipe) they sat between the weights and left holes once freed: seen to fail without the
/// scope (~2x the weights' blocks reserved).
#[test]
fn small_weights_leave_no_holes() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let bytes = vec![0x3cu8; 300 << 10];
    for d in gpu_devices() {
        let Some(ctx) = d.gpu() else { continue };
        let Some((alloc0, reserved0)) = ctx.memory_use() else { continue };
        let loading = ctx.loading_weights();
        let weights: Vec<_> = (0..300).map(|_| ctx.upload(&bytes).expect("upload")).collect();
        drop(loading);
        d.sync().expect("sync");
        let (alloc1, reserved1) = ctx.memory_use().expect("allocator figures");
        let (allocated, reserved) = (mib(alloc1.saturating_sub(alloc0)), mib(reserved1.saturating_sub(reserved0)));
        eprintln!(
            "{}: 300 x 300 KiB loaded: {allocated:.0} MiB allocated in {reserved:.0} MiB of new blocks",
            d.name()
        );
        assert!((90.0..=96.0).contains(&allocated), "{}: {allocated:.0} MiB allocated for 300 x 320 KiB", d.name());
        assert!(
            reserved <= allocated * 1.05 + 8.0,
            "{}: {reserved:.0} MiB of blocks for {allocated:.0} MiB of small weights",
            d.name()
        );
        drop(weights);
    }
}
