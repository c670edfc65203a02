//! The threads that compile pipelines (see `GpuContext::pipeline`), counted so that the process
//! does not end while one of them is inside the driver.
//!
//! A kernel is compiled on a thread of its own and nobody waits for it unless a dispatch needs
//! it, so a program can finish while a compile it will never use is still running (or, we
//! suppose, while the thread drops the last handle of the device). When the process then
//! exits, the driver's exit handlers tear the driver down under that thread. On the H100
//! machine (NVIDIA 580, Vulkan; BENCHMARKS.md, twentieth session) 25 of 2,150 short `generate`
//! runs ended so, in a segmentation fault in an `anygpu-compile-*` thread inside
//! `libnvidia-eglcore.so` after everything was printed; 10 of 1,000 still did with the Vulkan
//! instance never destroyed. So the first compile registers an exit handler (registered after
//! the driver was loaded, it runs before the driver's) that waits for the compiler threads
//! still running: none of 2,200 runs crashed with it, and 13 of 1,600 traced ones waited
//! (52-490 ms) for one compile.

use std::sync::{Condvar, Mutex, Once};
use std::time::{Duration, Instant};

/// Compiler threads started and not yet ended.
static RUNNING: Mutex<usize> = Mutex::new(0);
static ENDED: Condvar = Condvar::new();

/// How long the exit waits at most: a compile that takes longer is a driver fault, and a hang
/// at exit would be worse than the crash this prevents.
const EXIT_WAIT: Duration = Duration::from_secs(30);

/// Runs `job` on a new thread named `name`, counted until everything it owns is dropped.
pub(crate) fn spawn(name: String, job: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
    static HOOK: Once = Once::new();
    HOOK.call_once(register_exit_wait);
    *RUNNING.lock().unwrap_or_else(|e| e.into_inner()) += 1;
    let spawned = std::thread::Builder::new().name(name).spawn(move || {
        let _count = Counted;
        // `job` is consumed by the call: what it captured (a wgpu device among it, whose last
        // drop goes into the driver) is dropped inside it, before `_count`, also if it panics.
        job();
    });
    if spawned.is_err() {
        drop(Counted);
    }
    spawned.map(|_| ())
}

/// One running compiler thread: dropping it counts the thread as ended.
struct Counted;

impl Drop for Counted {
    fn drop(&mut self) {
        let mut running = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
        *running -= 1;
        if *running == 0 {
            ENDED.notify_all();
        }
    }
}

/// Waits until no compiler thread is running, at most `timeout`; true if none is.
pub fn wait_for_compiles(timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    let mut running = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
    while *running > 0 {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        running = ENDED.wait_timeout(running, left).unwrap_or_else(|e| e.into_inner()).0;
    }
    true
}

/// Compiler threads running now.
pub fn compiles_running() -> usize {
    *RUNNING.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(unix)]
fn register_exit_wait() {
    extern "C" fn wait_at_exit() {
        let (running, t0) = (compiles_running(), Instant::now());
        if !wait_for_compiles(EXIT_WAIT) {
            eprintln!("anygpu: a pipeline compile was still running at exit after {EXIT_WAIT:?}");
        } else if running > 0 && super::context::trace_pipelines() {
            eprintln!(
                "anygpu: waited {:.1} ms at exit for {running} pipeline compiles",
                t0.elapsed().as_secs_f64() * 1e3
            );
        }
    }
    extern "C" {
        fn atexit(f: extern "C" fn()) -> std::os::raw::c_int;
    }
    // SAFETY: registers a plain function with the C library; it touches only this module's
    // statics, which live for the whole process.
    unsafe {
        atexit(wait_at_exit);
    }
}

#[cfg(not(unix))]
fn register_exit_wait() {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    /// Sets its flag when dropped, slowly: stands in for a wgpu device whose last drop goes
    /// into the driver.
    struct SlowDrop(Arc<AtomicBool>);
    impl Drop for SlowDrop {
        fn drop(&mut self) {
            std::thread::sleep(Duration::from_millis(100));
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn the_wait_outlasts_the_job_and_what_it_owns() {
        let dropped = Arc::new(AtomicBool::new(false));
        let owned = SlowDrop(dropped.clone());
        spawn("compile-threads-test".into(), move || {
            let _keep = &owned;
            std::thread::sleep(Duration::from_millis(200));
        })
        .expect("spawn");
        assert!(!wait_for_compiles(Duration::from_millis(1)), "the job is still running");
        assert!(wait_for_compiles(Duration::from_secs(20)));
        assert!(dropped.load(Ordering::SeqCst), "the count went down before the job's captures were dropped");
    }

    #[test]
    fn a_job_that_panics_still_ends() {
        spawn("compile-threads-panic-test".into(), || panic!("a compiler thread's panic (expected)")).expect("spawn");
        assert!(wait_for_compiles(Duration::from_secs(20)), "a panicking job was never counted as ended");
    }
}
