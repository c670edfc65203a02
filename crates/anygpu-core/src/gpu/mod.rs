//! The GPU runtime: device context, pipeline cache, buffer pool, batched submission.

mod compile_threads;
mod context;
pub mod kernel;
pub mod pool;
pub mod profile;
pub mod replay;

pub use compile_threads::{compiles_running, wait_for_compiles};
pub use context::{Bind, GpuBuffer, GpuContext, WeightLoading, QUEUED_WRITES_MAX};
pub use kernel::{Compiled, KernelSpec, Pipeline};
pub use replay::{next_run_steps, Recording, Replay, ReplayTimes, Ticket, MAX_STEPS_PER_RUN};
