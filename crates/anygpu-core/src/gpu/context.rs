//! The GPU runtime: one wgpu device with its capability profile, pipeline cache, buffer pool
//! and a pending command encoder into which dispatches are batched until the host needs a
//! result (read-back or `sync`).

use std::cell::Cell;
use std::sync::{Arc, Mutex};

use super::kernel::{Compiled, KernelSpec, Pipeline, PipelineCache, PipelineKey};
use super::pool::{size_class, BufferPool, STORAGE_USAGE};
use super::profile::{self, DispatchProfile};
use super::replay::{Recorded, Recording};
use crate::device::{AdapterEntry, Capabilities, DeviceInfo};
use crate::error::{Error, Result};

/// Dispatches recorded before the encoder is submitted on its own. Besides bounding the memory
/// held by recorded-but-unsubmitted work, this lets the GPU start on a long graph while the
/// host encodes the rest: a MiniLM forward pass (~70 dispatches, ~1 ms of host encoding) in
/// one submit left the GPU idle for that millisecond; submitted every 32 it overlaps (H100:
/// 8,190 -> 8,970 sentences/s in one run; 16 and 64 did no better). Replayed recordings (LLM
/// decode) are unaffected.
const MAX_PENDING_DISPATCHES: usize = 32;

/// After the host waited for the GPU (which is then idle), the first batch is submitted after
/// this many dispatches and each next one after twice as many, up to MAX_PENDING_DISPATCHES:
/// the GPU starts after a few dispatches' encoding instead of 32 (~0.6 ms of a MiniLM forward
/// pass: H100, 64 x 128 tokens, 10,050-10,200 -> 10,500-10,600 sentences/s; first batches of
/// 1, 2 and 8 did no better than 4).
const FIRST_SUBMIT_AFTER: usize = 4;

/// Compiles one WGSL kernel inside an error scope (scopes are per thread): the driver's or
/// wgpu's rejection comes back as the error text.
fn compile_pipeline(
    device: &wgpu::Device,
    name: &str,
    entry: &'static str,
    source: String,
    bounds_checks: bool,
) -> std::result::Result<wgpu::ComputePipeline, String> {
    let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
    dump_kernel(name, entry, &source, bounds_checks);
    let desc = wgpu::ShaderModuleDescriptor { label: Some(name), source: wgpu::ShaderSource::Wgsl(source.into()) };
    // SAFETY: the checks left out are the loop bound, and our kernels' loops all end (see
    // `runtime_checks`); and the bounds checks of kernels whose indices stay in range by
    // design, on Vulkan only (`KernelSpec::bounded_by_design`).
    let module = unsafe { device.create_shader_module_trusted(desc, runtime_checks(bounds_checks)) };
    let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some(name),
        layout: None,
        module: &module,
        entry_point: Some(entry),
        compilation_options: wgpu::PipelineCompilationOptions {
            zero_initialize_workgroup_memory: zero_workgroup_memory(),
            ..Default::default()
        },
        cache: None,
    });
    match pollster::block_on(scope.pop()) {
        Some(e) => Err(error_text(&e)),
        None => Ok(pipeline),
    }
}

/// The checks wgpu compiles into our kernels: all of them (bounds, integer division) except
/// the loop bound. naga gives every loop a second, 64-bit counter and exit so that a driver may
/// not assume it terminates; NVIDIA's compiler then keeps loops it would unroll (fixed-count
/// loops over a run's 8 elements, a tile's K steps) as loops, with their private arrays in
/// memory. Without it, on an H100: 8B Q4_0 tg128 301 -> 329 tok/s, pp512 7,000 -> 7,660; 1B F16
/// tg128 692 -> 736, pp512 35,000 -> 38,500 (BENCHMARKS.md, eleventh session).
///
/// Safe because every loop of our kernels ends: each counts up to a bound taken from a buffer's
/// length or a constant, by a step that cannot wrap below it (buffers stay far under 2^32
/// elements: wgpu caps a binding at `max_storage_buffer_binding_size`). A kernel with a `loop`
/// or a `while` whose end depends on data must not be added without bringing the check back.
/// `ANYGPU_LOOP_BOUNDING=1` (read once) does, for comparisons.
fn runtime_checks(bounds_checks: bool) -> wgpu::ShaderRuntimeChecks {
    static BOUNDED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let bounded = *BOUNDED.get_or_init(|| std::env::var("ANYGPU_LOOP_BOUNDING").is_ok_and(|v| v == "1"));
    let mut checks = wgpu::ShaderRuntimeChecks::checked();
    checks.force_loop_bounding = bounded;
    checks.bounds_checks = bounds_checks;
    checks
}

/// Whether a kernel is compiled with wgpu's bounds checks: always, except a kernel that is
/// [`KernelSpec::bounded_by_design`] on Vulkan. `ANYGPU_BOUNDS_CHECKS=1` (read once) keeps
/// them for every kernel, for comparisons and for hunting a wrong index.
fn bounds_checks(spec: &KernelSpec, backend: &str) -> bool {
    static FORCED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let forced = *FORCED.get_or_init(|| std::env::var("ANYGPU_BOUNDS_CHECKS").is_ok_and(|v| v == "1"));
    spec.index_checks || backend != "vulkan" || forced
}

/// Whether wgpu zeroes each workgroup's memory before the kernel runs: not for ours, which
/// write every element of their workgroup arrays before they read it (staged tiles, reduction
/// trees, scratch). WebGPU asks for it so that no kernel can read what another left there;
/// its cost here: on GL, naga zeroes an array with one constructor of every element, which
/// llvmpipe took 8 s to compile for a 1,024-element array and 98 s for a 4,096-element one (16
/// ms without), so a cold test run spent most of its time compiling; on an H100 (Vulkan,
/// zeroed by the driver) 8B Q4_0 decode 3.011 / 3.022 -> 2.986 / 3.002 ms per token.
/// `ANYGPU_ZERO_WORKGROUP=1` (read once) zeroes it again.
fn zero_workgroup_memory() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var("ANYGPU_ZERO_WORKGROUP").is_ok_and(|v| v == "1"))
}

/// `ANYGPU_DUMP_KERNELS=DIR`: each kernel's final WGSL (the header and sections as compiled)
/// written to `DIR/<name>.<entry>.<hash>.wgsl`, for reading and for `tools/kernel-stats`
/// (which asks the driver for the compiled kernel's register count). A kernel compiled without
/// bounds checks starts with the line [`UNCHECKED_MARK`], which kernel-stats follows. A failed
/// write is logged, never fatal.
fn dump_kernel(name: &str, entry: &str, source: &str, bounds_checks: bool) {
    static DIR: std::sync::OnceLock<Option<std::path::PathBuf>> = std::sync::OnceLock::new();
    let Some(dir) =
        DIR.get_or_init(|| std::env::var_os("ANYGPU_DUMP_KERNELS").filter(|d| !d.is_empty()).map(Into::into))
    else {
        return;
    };
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    source.hash(&mut h);
    let file = dir.join(format!("{name}.{entry}.{:08x}.wgsl", h.finish() as u32));
    let text = if bounds_checks { source.to_string() } else { format!("{UNCHECKED_MARK}\n{source}") };
    if let Err(e) = std::fs::create_dir_all(dir).and_then(|_| std::fs::write(&file, text)) {
        log::warn!("ANYGPU_DUMP_KERNELS: could not write {}: {e}", file.display());
    }
}

/// The first line of a dumped kernel compiled without bounds checks (tools/kernel-stats reads it).
const UNCHECKED_MARK: &str = "// anygpu: compiled without bounds checks";

/// `ANYGPU_TRACE_PIPELINES=1`: each kernel's compile time on stderr (a slow first run is
/// mostly the driver compiling kernels; its shader cache makes later runs faster).
pub(super) fn trace_pipelines() -> bool {
    static V: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var("ANYGPU_TRACE_PIPELINES").is_ok_and(|v| !v.is_empty() && v != "0"))
}

pub struct GpuContext {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: DeviceInfo,
    pub caps: Capabilities,
    pipelines: PipelineCache,
    pool: BufferPool,
    pending: Mutex<Pending>,
    /// The first uncaptured wgpu error since the last check.
    error: Arc<Mutex<Option<String>>>,
    /// Set once the device is lost; every later call fails with it.
    lost: Arc<Mutex<Option<String>>>,
    /// Held for the whole of a recording: threads that record on one device take turns.
    record_turn: Mutex<()>,
    /// Buffers the recording thread freed while recording (see `GpuBuffer`'s drop).
    recorded_drops: Mutex<Vec<wgpu::Buffer>>,
    /// Mappable buffers of earlier read-backs, kept for the next ones: creating one per read
    /// (host-visible memory) cost ~0.3 ms of a 98 KB read on the H100.
    readback: Mutex<Vec<wgpu::Buffer>>,
    /// Live [`WeightLoading`] scopes (see there).
    weight_loads: std::sync::atomic::AtomicUsize,
}

/// While one is alive (a model loading its weights, see [`GpuContext::loading_weights`]), every
/// upload smaller than a memory block is submitted and waited for at once, so that its staging
/// copy is freed before the next weight is allocated. Where staging and device-local buffers
/// share one memory type (lavapipe; integrated GPUs whose first device-local type is also
/// host-visible) the staging copies of small weights otherwise sat between them in the blocks
/// and left holes when freed: SmolLM2 on lavapipe held 166 MiB of blocks for 98 MiB of buffers,
/// 102 with this. Only while loading: a wait elsewhere could stall work in flight.
pub struct WeightLoading {
    ctx: Arc<GpuContext>,
}

impl Drop for WeightLoading {
    fn drop(&mut self) {
        self.ctx.weight_loads.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Read-back buffers kept for reuse, and the largest one kept.
const READBACK_KEPT: usize = 4;
const READBACK_MAX_KEPT_BYTES: u64 = 64 << 20;

#[derive(Default)]
pub(super) struct Pending {
    encoder: Option<wgpu::CommandEncoder>,
    /// Commands recorded into `encoder` (dispatches and copies).
    commands: usize,
    /// Dispatches after which the encoder is submitted (see `FIRST_SUBMIT_AFTER`); 0 = not
    /// set since the last wait.
    submit_at: usize,
    /// The uniform buffer holding every dispatch's params for this batch (one slot each),
    /// filled from `params_data` with one write just before the batch is submitted. One
    /// buffer per batch instead of one per dispatch keeps recording cheap.
    params: Option<wgpu::Buffer>,
    params_data: Vec<u8>,
    /// The compute pass dispatches go into. Dispatches share one pass until another kind of
    /// command (a copy, a timestamp) needs the encoder: on an H100 a pass per dispatch cost
    /// ~60 us of GPU time each, a dispatch inside a pass ~5 us.
    pass: Option<wgpu::ComputePass<'static>>,
    /// Set while a thread records (see [`GpuContext::record`]).
    recording: Option<Recording>,
    /// Set while dispatches are timed one by one (see [`GpuContext::profile_dispatches`]).
    profile: Option<DispatchProfile>,
    /// Commands waiting, in order, for a kernel still compiling (see [`GpuContext::pipeline`]);
    /// counted in `commands`. Every later command joins the queue until it drains.
    deferred: std::collections::VecDeque<Deferred>,
    /// Bytes written through `queue.write_buffer` since the last submit: the queue holds each
    /// write's staging copy until a submit runs it (see [`QUEUED_WRITES_MAX`]).
    queued_write_bytes: u64,
}

/// A command issued while an earlier kernel was still compiling, with what it binds owned.
enum Deferred {
    Dispatch {
        pipeline: Pipeline,
        op: String,
        /// (offset, size) of its params in the batch's uniform buffer.
        params: Option<(u64, u64)>,
        binds: Vec<(wgpu::Buffer, u64, u64)>,
        workgroups: [u32; 3],
    },
    Copy {
        src: wgpu::Buffer,
        dst: wgpu::Buffer,
        offset: u64,
        len: u64,
    },
}

/// (buffer, offset, bound size) of each binding, the size rounded up to whole words.
pub(super) fn owned_binds(binds: &[Bind<'_>]) -> Vec<(wgpu::Buffer, u64, u64)> {
    binds
        .iter()
        .map(|b| {
            let (buf, off, size) = b.range();
            (buf.clone(), off, size)
        })
        .collect()
}

thread_local! {
    /// The context this thread is recording on (its address), if any. Recording is per
    /// thread: another thread's work on the same device runs as usual meanwhile.
    static RECORDING_ON: Cell<usize> = const { Cell::new(0) };
}

/// The pending state, locked (and, on GL, the process-wide GL lock taken before it).
pub(super) struct PendingGuard<'a> {
    pending: std::sync::MutexGuard<'a, Pending>,
    _gl: Option<std::sync::MutexGuard<'static, ()>>,
}

impl std::ops::Deref for PendingGuard<'_> {
    type Target = Pending;
    fn deref(&self) -> &Pending {
        &self.pending
    }
}

impl std::ops::DerefMut for PendingGuard<'_> {
    fn deref_mut(&mut self) -> &mut Pending {
        &mut self.pending
    }
}

/// Queued writes past this many bytes are submitted and waited for, which frees their staging
/// copies: a model's weights are uploaded through the queue before any other command, so
/// without this every weight's staging copy stayed allocated until the first dispatch, twice
/// the model in all (pinned host memory on a discrete GPU, the GPU's own on an integrated one).
pub const QUEUED_WRITES_MAX: u64 = 256 << 20;

/// Bytes of params one batch can hold (slots are 256-byte aligned: 1024 dispatches).
const PARAMS_CAPACITY: u64 = 256 << 10;

/// How the device's memory is carved: wgpu sub-allocates buffers from blocks of memory it
/// reserves, 128-256 MiB each by default (`MemoryHints::Performance`), and a buffer larger than
/// the current block gets a block of its own size. A model's weight buffers of tens of MiB then
/// leave gaps in the big blocks that stay reserved: on an H100 the synthetic 1B F16 took 2,880
/// MiB of blocks for 2,250 MiB of buffers (1.28x), the 8B Q4_0 4,672 for 4,071. With 4 MiB
/// blocks every buffer larger than that gets exactly its size and only small ones share
/// blocks: 2,260 and 4,084 MiB (SmolLM2: 320 -> 118). Measured beside the big blocks in one
/// call (BENCHMARKS.md, seventeenth session): the 8B's decode step 2.64 -> 2.59 ms, the 1B
/// F16's 1.122 -> 1.127, the prefills unchanged within the noise. `ANYGPU_MEMORY_BLOCKS=large`
/// (read as a device opens) brings back the big blocks, for comparisons.
fn memory_hints() -> wgpu::MemoryHints {
    match std::env::var("ANYGPU_MEMORY_BLOCKS").as_deref() {
        Ok("large") => wgpu::MemoryHints::Performance,
        _ => wgpu::MemoryHints::Manual { suballocated_device_memory_block_size: MEMORY_BLOCK..MEMORY_BLOCK },
    }
}

/// The device memory blocks small buffers share (see `memory_hints`).
const MEMORY_BLOCK: u64 = 4 << 20;

/// A GPU allocation owned by a tensor; goes back to the pool when dropped.
pub struct GpuBuffer {
    buffer: Option<wgpu::Buffer>,
    /// Bytes requested (the wgpu buffer may be larger: its size class).
    pub len: u64,
    ctx: Arc<GpuContext>,
}

impl GpuBuffer {
    pub fn buffer(&self) -> &wgpu::Buffer {
        // Only `Drop` takes the buffer out.
        self.buffer.as_ref().expect("GpuBuffer used after drop")
    }
    pub fn context(&self) -> &Arc<GpuContext> {
        &self.ctx
    }
}

impl Drop for GpuBuffer {
    fn drop(&mut self) {
        if let Some(b) = self.buffer.take() {
            // Freed by the recording thread while it records: a recorded dispatch may bind it,
            // so it is parked with the recording instead of going back to the pool.
            if self.ctx.recording_here() {
                if let Ok(mut parked) = self.ctx.recorded_drops.lock() {
                    parked.push(b);
                    return;
                }
            }
            self.ctx.pool.give_back(b);
        }
    }
}

/// One binding of a dispatch: a tensor buffer, or a slice of one (`offset`, `size` in bytes).
pub enum Bind<'a> {
    Whole(&'a GpuBuffer),
    Slice(&'a wgpu::Buffer, u64, u64),
}

impl Bind<'_> {
    /// (buffer, offset, bound size): a tensor's first `len` bytes, or the slice; the size
    /// rounded up to whole words.
    pub(super) fn range(&self) -> (&wgpu::Buffer, u64, u64) {
        match self {
            Bind::Whole(g) => (g.buffer(), 0, g.len.max(4).next_multiple_of(4)),
            Bind::Slice(buf, off, size) => (buf, *off, (*size).max(4).next_multiple_of(4)),
        }
    }
}

/// A kernel's bind group: its params (buffer, offset, size) at binding 0 when it has any, then
/// `binds` (buffer, offset, size) at 1, 2, ... (the direct dispatch path and the replay's).
pub(super) fn make_bind_group<'p, 'b>(
    device: &wgpu::Device,
    layout: &wgpu::BindGroupLayout,
    label: &str,
    params: Option<(&'p wgpu::Buffer, u64, u64)>,
    binds: impl IntoIterator<Item = (&'b wgpu::Buffer, u64, u64)>,
) -> wgpu::BindGroup {
    fn entry(binding: u32, (buffer, offset, size): (&wgpu::Buffer, u64, u64)) -> wgpu::BindGroupEntry<'_> {
        let size = wgpu::BufferSize::new(size);
        wgpu::BindGroupEntry {
            binding,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding { buffer, offset, size }),
        }
    }
    let mut entries: Vec<wgpu::BindGroupEntry<'_>> = params.map(|p| entry(0, p)).into_iter().collect();
    entries.extend(binds.into_iter().enumerate().map(|(i, b)| entry(i as u32 + 1, b)));
    device.create_bind_group(&wgpu::BindGroupDescriptor { label: Some(label), layout, entries: &entries })
}

fn error_text(e: &wgpu::Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

impl GpuContext {
    /// Creates the device with the adapter's real limits and the helpful optional features it
    /// has, or with WebGPU's defaults when `webgpu_defaults` is set.
    pub fn open(entry: &AdapterEntry, webgpu_defaults: bool) -> Result<GpuContext> {
        let adapter = &entry.adapter;
        let caps = if webgpu_defaults { entry.caps.constrain() } else { entry.caps.clone() };
        let desc = wgpu::DeviceDescriptor {
            label: Some("anygpu"),
            required_features: caps.wgpu_features(),
            required_limits: caps.wgpu_limits(&adapter.limits()),
            // SAFETY: cooperative matrices are requested only when the adapter reports them,
            // and our kernels use them only as the extension specifies.
            experimental_features: if caps.cooperative_matrix {
                unsafe { wgpu::ExperimentalFeatures::enabled() }
            } else {
                wgpu::ExperimentalFeatures::disabled()
            },
            memory_hints: memory_hints(),
            trace: wgpu::Trace::Off,
        };
        // Some drivers panic inside device creation; a user must get a message instead.
        let created = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pollster::block_on(adapter.request_device(&desc))
        }));
        let (device, queue) = match created {
            Ok(Ok(dq)) => dq,
            Ok(Err(e)) => {
                return Err(Error::Device(format!(
                    "could not create a device on {} ({}): {e}",
                    entry.info.name, entry.info.backend
                )))
            }
            Err(_) => {
                return Err(Error::Device(format!(
                    "the {} driver crashed while creating a device on {}",
                    entry.info.backend, entry.info.name
                )))
            }
        };
        let error = Arc::new(Mutex::new(None::<String>));
        let lost = Arc::new(Mutex::new(None::<String>));
        {
            let error = error.clone();
            device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
                if let Ok(mut slot) = error.lock() {
                    slot.get_or_insert_with(|| error_text(&e));
                }
            }));
            let lost = lost.clone();
            device.set_device_lost_callback(move |reason, msg| {
                if let Ok(mut slot) = lost.lock() {
                    slot.get_or_insert_with(|| format!("{reason:?}: {msg}"));
                }
            });
        }
        Ok(GpuContext {
            device,
            queue,
            info: entry.info.clone(),
            caps,
            pipelines: PipelineCache::default(),
            pool: BufferPool::default(),
            pending: Mutex::new(Pending::default()),
            error,
            lost,
            record_turn: Mutex::new(()),
            recorded_drops: Mutex::new(Vec::new()),
            readback: Mutex::new(Vec::new()),
            weight_loads: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    /// A scope in which this context's uploads are a model's weights (see [`WeightLoading`]).
    pub fn loading_weights(self: &Arc<Self>) -> WeightLoading {
        self.weight_loads.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        WeightLoading { ctx: self.clone() }
    }

    /// Fails if the device was lost or a wgpu error was raised since the last check.
    pub fn check(&self, op: &str) -> Result<()> {
        if let Some(msg) = self.lost.lock().ok().and_then(|s| s.clone()) {
            return Err(Error::gpu(
                op,
                format!("the GPU device was lost ({msg}). The driver may have reset; restart the program, or use --device cpu"),
            ));
        }
        if let Some(msg) = self.error.lock().ok().and_then(|mut s| s.take()) {
            return Err(Error::gpu(op, msg));
        }
        Ok(())
    }

    /// The compute pipeline for a kernel, compiled on first use inside an error scope so a
    /// shader the driver rejects becomes an error naming the kernel. The compile runs on a
    /// worker thread (not on GL, whose context is one per process): this returns at once and
    /// [`GpuContext::dispatch`] encodes the kernel's dispatches when it is ready, so the
    /// kernels of a graph compile side by side.
    pub fn pipeline(&self, spec: &KernelSpec, replacements: &[(&str, &str)]) -> Result<Pipeline> {
        let key = PipelineKey::new(spec, replacements);
        if let Some(pipeline) = self.pipelines.get(&key) {
            return Ok(pipeline);
        }
        let source = spec.source_text(replacements);
        let checked = bounds_checks(spec, &self.info.backend);
        let (device, name, entry) = (self.device.clone(), spec.name.clone(), spec.entry);
        let compile = move || {
            let t0 = std::time::Instant::now();
            // A panic in the driver or in wgpu must not leave waiters blocked forever.
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                compile_pipeline(&device, &name, entry, source, checked)
            }))
            .unwrap_or_else(|_| Err("the compiler panicked".to_string()));
            if trace_pipelines() {
                eprintln!("anygpu: compiled kernel {name} in {:.1} ms", t0.elapsed().as_secs_f64() * 1e3);
            }
            r
        };
        if self.info.backend == "gl" {
            // GL compiles here, under the state lock, and the entry appears only while the lock
            // is held: a thread that holds the lock while it waits for a kernel (encoding work
            // deferred behind it) must never wait for a compile that waits for the lock. (Two
            // tests on llvmpipe's GL hung so: the entry was published, then the lock awaited.)
            let _serial = self.lock("pipeline")?;
            let (pipeline, created) = self.pipelines.get_or_create(&key, &spec.name);
            if created {
                pipeline.finish(compile());
            }
            return Ok(pipeline);
        }
        let (pipeline, created) = self.pipelines.get_or_create(&key, &spec.name);
        if !created {
            return Ok(pipeline);
        }
        let worker = pipeline.clone();
        let spawned = super::compile_threads::spawn(format!("anygpu-compile-{}", spec.name), move || {
            worker.finish(compile());
        });
        if let Err(e) = spawned {
            pipeline.finish(Err(format!("could not start a compiler thread: {e}")));
        }
        Ok(pipeline)
    }

    /// Device memory of this device's live allocations (every buffer, pooled ones included)
    /// and the memory blocks reserved to hold them, in bytes, where the backend reports it
    /// (Vulkan, DX12).
    pub fn memory_use(&self) -> Option<(u64, u64)> {
        self.device.generate_allocator_report().map(|r| (r.total_allocated_bytes, r.total_reserved_bytes))
    }

    /// Destroys the free buffers the pool keeps. After a prefill, whose activations the
    /// decode steps never reuse, this gives their memory back (SmolLM2 on the H100: 157 MiB
    /// allocated after pp512 runs); the next prefill allocates again.
    /// Other threads' encoded work that binds pooled buffers is submitted first, under the
    /// lock every encoder takes (a destroyed buffer in an unsubmitted command buffer would fail
    /// that submit; submitted work keeps it alive until done).
    pub fn release_pooled(&self) -> Result<()> {
        let mut pending = self.lock("release pooled buffers")?;
        self.submit_locked(&mut pending);
        self.pool.clear();
        Ok(())
    }

    /// Commands encoded later because a kernel before them is still compiling (diagnostics
    /// and tests).
    pub fn commands_waiting_for_kernels(&self) -> usize {
        self.pending.lock().map(|p| p.deferred.len()).unwrap_or(0)
    }

    pub fn pipelines_compiled(&self) -> usize {
        self.pipelines.len()
    }

    /// A storage buffer of at least `bytes` bytes (contents undefined), from the pool when
    /// one of its size class is free.
    pub fn alloc(self: &Arc<Self>, bytes: u64) -> Result<GpuBuffer> {
        self.check("alloc")?;
        if bytes > self.caps.max_buffer_size {
            return Err(Error::Unsupported(format!(
                "a tensor of {} MiB does not fit in one buffer on {} (max_buffer_size {} MiB)",
                bytes >> 20,
                self.info.name,
                self.caps.max_buffer_size >> 20
            )));
        }
        let class = size_class(bytes).min(self.caps.max_buffer_size.max(4) / 4 * 4);
        let buffer = match self.pool.take(class) {
            Some(b) => b,
            None => {
                let mut serial = self.lock("alloc")?;
                let scope = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
                let b = self.device.create_buffer(&wgpu::BufferDescriptor {
                    label: None,
                    size: class,
                    usage: STORAGE_USAGE,
                    mapped_at_creation: false,
                });
                if let Some(e) = pollster::block_on(scope.pop()) {
                    // Encoded work may bind pooled buffers: submitted first (see release_pooled).
                    self.submit_locked(&mut serial);
                    self.pool.clear();
                    return Err(Error::gpu(
                        "alloc",
                        format!("out of GPU memory allocating {} MiB: {}", class >> 20, error_text(&e)),
                    ));
                }
                b
            }
        };
        Ok(GpuBuffer { buffer: Some(buffer), len: bytes, ctx: self.clone() })
    }

    /// Uploads bytes into a new buffer. Ordered after every op recorded so far, so a pooled
    /// buffer that pending work still reads is never overwritten early.
    pub fn upload(self: &Arc<Self>, bytes: &[u8]) -> Result<GpuBuffer> {
        let buf = self.alloc(bytes.len() as u64)?;
        {
            let mut pending = self.lock("upload")?;
            if let Some(rec) = pending.recording.as_mut().filter(|_| self.recording_here()) {
                // A fresh buffer no recorded work has touched: writing it now is in order with
                // every replay. The bytes are noted so that recordings can be compared.
                rec.note_upload(bytes);
                let mut v = bytes.to_vec();
                v.resize(bytes.len().next_multiple_of(4), 0);
                self.queue_write(&mut pending, buf.buffer(), 0, &v);
                return Ok(buf);
            }
        }
        self.write(&buf, 0, bytes)?;
        Ok(buf)
    }

    /// Writes bytes into a buffer at `offset`, in order with the recorded work.
    pub fn write(&self, buf: &GpuBuffer, offset: u64, bytes: &[u8]) -> Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        let padded_len = (bytes.len() as u64).next_multiple_of(4);
        let mut pending = self.lock("write")?;
        if self.recording_here() {
            return Err(Error::gpu("write", "a host write into a GPU buffer cannot be recorded for replay"));
        }
        if pending.commands == 0 {
            // Nothing recorded yet: the queue's own staging is ordered correctly.
            if padded_len == bytes.len() as u64 {
                self.queue_write(&mut pending, buf.buffer(), offset, bytes);
            } else {
                let mut v = bytes.to_vec();
                v.resize(padded_len as usize, 0);
                self.queue_write(&mut pending, buf.buffer(), offset, &v);
            }
        } else {
            let staging = self.filled_buffer("upload staging", wgpu::BufferUsages::COPY_SRC, bytes, 4)?;
            if pending.deferred.is_empty() {
                let enc = self.encoder_for_commands(&mut pending);
                enc.copy_buffer_to_buffer(&staging, 0, buf.buffer(), offset, padded_len);
            } else {
                let dst = buf.buffer().clone();
                pending.deferred.push_back(Deferred::Copy { src: staging, dst, offset, len: padded_len });
            }
            pending.commands += 1;
        }
        drop(pending);
        self.check("upload")
    }

    /// A new buffer holding `bytes`, zero-padded to a multiple of `align`, written through a
    /// mapping at creation (so it is ready before any queued work runs).
    pub(super) fn filled_buffer(
        &self,
        label: &str,
        usage: wgpu::BufferUsages,
        bytes: &[u8],
        align: usize,
    ) -> Result<wgpu::Buffer> {
        let mut padded = bytes.to_vec();
        padded.resize(bytes.len().next_multiple_of(align), 0);
        let b = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: padded.len() as u64,
            usage,
            mapped_at_creation: true,
        });
        b.slice(..).get_mapped_range_mut().map_err(|e| Error::gpu(label, e.to_string()))?.copy_from_slice(&padded);
        b.unmap();
        Ok(b)
    }

    /// Records one dispatch into the pending encoder. `params` (if not empty) is bound as a
    /// uniform at binding 0, then `binds` at 1, 2, ...
    pub fn dispatch(
        &self,
        pipeline: &Pipeline,
        op: &str,
        params: &[u8],
        binds: &[Bind<'_>],
        workgroups: [u32; 3],
    ) -> Result<()> {
        if workgroups.contains(&0) {
            return Ok(());
        }
        let max = self.caps.max_workgroups();
        if workgroups.iter().any(|&w| w > max) {
            return Err(Error::gpu(
                op,
                format!("dispatch of {workgroups:?} workgroups exceeds the device's {max} per dimension"),
            ));
        }
        let max_binding = self.caps.max_storage_buffer_binding_size;
        for b in binds {
            let size = match b {
                Bind::Whole(g) => g.len,
                Bind::Slice(_, _, s) => *s,
            };
            if size > max_binding {
                return Err(Error::Unsupported(format!(
                    "{op}: a binding of {} MiB exceeds this device's max_storage_buffer_binding_size of {} MiB",
                    size >> 20,
                    max_binding >> 20
                )));
            }
        }
        let mut pending = self.lock(op)?;
        if let Some(rec) = pending.recording.as_mut().filter(|_| self.recording_here()) {
            rec.dispatches.push(Recorded::new(pipeline, op, params, binds, workgroups));
            return Ok(());
        }
        let slot = if params.is_empty() { None } else { Some(self.params_slot(&mut pending, params)?) };
        let ready = if pending.deferred.is_empty() { pipeline.try_get() } else { None };
        if let Some(p) = ready {
            self.encode_dispatch(&mut pending, &p?, op, slot, binds.iter().map(Bind::range), workgroups);
        } else {
            pending.deferred.push_back(Deferred::Dispatch {
                pipeline: pipeline.clone(),
                op: op.to_string(),
                params: slot,
                binds: owned_binds(binds),
                workgroups,
            });
            self.encode_deferred(&mut pending, false);
        }
        pending.commands += 1;
        if pending.submit_at == 0 {
            pending.submit_at = FIRST_SUBMIT_AFTER;
        }
        // Not while commands wait for a compiling kernel: submitting would wait for it here.
        if pending.commands >= pending.submit_at && pending.deferred.is_empty() {
            pending.submit_at = (pending.submit_at * 2).min(MAX_PENDING_DISPATCHES);
            self.submit_locked(&mut pending);
        }
        drop(pending);
        self.check(op)
    }

    /// Encodes one dispatch into the open compute pass.
    fn encode_dispatch<'b>(
        &self,
        pending: &mut Pending,
        kernel: &Compiled,
        op: &str,
        params: Option<(u64, u64)>,
        binds: impl IntoIterator<Item = (&'b wgpu::Buffer, u64, u64)>,
        workgroups: [u32; 3],
    ) {
        let params = params.zip(pending.params.as_ref()).map(|((offset, size), buf)| (buf, offset, size));
        let bind_group = make_bind_group(&self.device, &kernel.layout, op, params, binds);
        if self.has_error() {
            return; // an invalid bind group would invalidate the whole batch; `check` reports it
        }
        if let Some((set, i)) = pending.profile.as_mut().and_then(|p| Some((p.set.clone(), p.next(op, workgroups)?))) {
            let enc = self.open_encoder(pending);
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("profiled dispatch"),
                timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                    query_set: &set,
                    beginning_of_pass_write_index: Some(2 * i),
                    end_of_pass_write_index: Some(2 * i + 1),
                }),
            });
            pass.set_pipeline(&kernel.pipeline);
            pass.set_bind_group(0, &bind_group, &[]);
            pass.dispatch_workgroups(workgroups[0], workgroups[1], workgroups[2]);
            return;
        }
        let pass = self.open_pass(pending);
        pass.set_pipeline(&kernel.pipeline);
        pass.set_bind_group(0, &bind_group, &[]);
        pass.dispatch_workgroups(workgroups[0], workgroups[1], workgroups[2]);
    }

    /// Encodes the deferred commands in order: all of them, waiting for their kernels
    /// (`wait`), or those before the first kernel still compiling. A kernel that failed to
    /// compile drops its dispatch and leaves the error for the next `check`.
    fn encode_deferred(&self, pending: &mut Pending, wait: bool) {
        while let Some(front) = pending.deferred.front() {
            if let Deferred::Dispatch { pipeline, .. } = front {
                if !wait && !pipeline.is_ready() {
                    break;
                }
            }
            let Some(d) = pending.deferred.pop_front() else { break };
            match d {
                Deferred::Dispatch { pipeline, op, params, binds, workgroups } => match pipeline.get() {
                    Ok(p) => {
                        let binds = binds.iter().map(|(b, o, s)| (b, *o, *s));
                        self.encode_dispatch(pending, &p, &op, params, binds, workgroups);
                    }
                    Err(e) => self.set_error(format!("{op}: {e}")),
                },
                Deferred::Copy { src, dst, offset, len } => {
                    self.open_encoder(pending).copy_buffer_to_buffer(&src, 0, &dst, offset, len);
                }
            }
        }
    }

    fn has_error(&self) -> bool {
        self.error.lock().map(|e| e.is_some()).unwrap_or(true) || self.lost.lock().map(|l| l.is_some()).unwrap_or(true)
    }

    /// Keeps the first error for the next `check`.
    fn set_error(&self, msg: String) {
        if let Ok(mut e) = self.error.lock() {
            e.get_or_insert(msg);
        }
    }

    /// Workgroup counts for `n` workgroups in a line: split over x and y when `n` exceeds the
    /// per-dimension limit. Kernels recover the linear index as `wid.x + wid.y * nwg.x`.
    pub fn grid_1d(&self, n: u32) -> [u32; 3] {
        let max = self.caps.max_workgroups();
        if n <= max {
            [n, 1, 1]
        } else {
            [max, n.div_ceil(max), 1]
        }
    }

    /// Ends the open compute pass: the next dispatch begins a new one. wgpu records the
    /// barriers a pass needs before it (they wait for all earlier work) and, inside it, a
    /// barrier only before a dispatch that uses a buffer an earlier dispatch of the pass used
    /// (and not where both only read it): so two dispatches at the start of a pass that share
    /// no written buffer run side by side (quant/copy_ahead.rs).
    pub(crate) fn end_pass(&self) -> Result<()> {
        let mut pending = self.lock("end_pass")?;
        pending.pass = None;
        Ok(())
    }

    /// Submits the pending encoder, if any (does not wait).
    pub fn submit(&self) -> Result<()> {
        let mut pending = self.lock("submit")?;
        self.not_recording("submit")?;
        self.submit_locked(&mut pending);
        drop(pending);
        self.check("submit")
    }

    /// Submits under the state lock: a `queue.write_buffer` from another thread in between
    /// would otherwise land before this encoder's commands.
    pub(super) fn submit_locked(&self, pending: &mut Pending) {
        self.encode_deferred(pending, true);
        if let Some(buf) = pending.params.take() {
            // Staged by the queue before the command buffer below runs.
            self.queue.write_buffer(&buf, 0, &pending.params_data);
            pending.params_data.clear();
        }
        pending.commands = 0;
        pending.pass = None; // ends the open compute pass
        if let Some(enc) = pending.encoder.take() {
            self.queue.submit([enc.finish()]);
        } else if pending.queued_write_bytes > 0 {
            self.queue.submit([]); // runs the queued writes
        }
        pending.queued_write_bytes = 0;
    }

    /// `queue.write_buffer`, counted; past [`QUEUED_WRITES_MAX`], or for a small weight (see
    /// [`WeightLoading`]), the writes are submitted and waited for. Only where no command is
    /// recorded yet (which the writes would overtake).
    fn queue_write(&self, pending: &mut Pending, buf: &wgpu::Buffer, offset: u64, data: &[u8]) {
        self.queue.write_buffer(buf, offset, data);
        pending.queued_write_bytes += data.len() as u64;
        let small_weight =
            (data.len() as u64) < MEMORY_BLOCK && self.weight_loads.load(std::sync::atomic::Ordering::Relaxed) > 0;
        if (pending.queued_write_bytes > QUEUED_WRITES_MAX || small_weight) && pending.encoder.is_none() {
            self.queue.submit([]);
            pending.queued_write_bytes = 0;
            // An error here shows at the next check; the staging is then freed later.
            let _ = self.device.poll(wgpu::PollType::wait_indefinitely());
        }
    }

    /// The open compute pass, begun if needed.
    fn open_pass<'a>(&self, pending: &'a mut Pending) -> &'a mut wgpu::ComputePass<'static> {
        if pending.pass.is_none() {
            let enc = pending.encoder.get_or_insert_with(|| self.device.create_command_encoder(&Default::default()));
            let pass =
                enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("anygpu"), timestamp_writes: None });
            pending.pass = Some(pass.forget_lifetime());
        }
        pending.pass.as_mut().expect("set just above")
    }

    /// The encoder, for commands other than dispatches: ends the open compute pass first.
    fn encoder_for_commands<'a>(&self, pending: &'a mut Pending) -> &'a mut wgpu::CommandEncoder {
        self.encode_deferred(pending, true);
        self.open_encoder(pending)
    }

    /// The batch's encoder with no compute pass open (commands in the order they were issued).
    fn open_encoder<'a>(&self, pending: &'a mut Pending) -> &'a mut wgpu::CommandEncoder {
        pending.pass = None;
        pending.encoder.get_or_insert_with(|| self.device.create_command_encoder(&Default::default()))
    }

    /// Reserves a slot for `params` in this batch's uniform buffer: (offset, bound size).
    fn params_slot(&self, pending: &mut Pending, params: &[u8]) -> Result<(u64, u64)> {
        let align = (self.device.limits().min_uniform_buffer_offset_alignment as usize).max(16);
        let size = params.len().next_multiple_of(16);
        let mut offset = pending.params_data.len().next_multiple_of(align);
        if (offset + size) as u64 > PARAMS_CAPACITY {
            self.submit_locked(pending);
            offset = 0;
        }
        if pending.params.is_none() {
            pending.params = Some(self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("params"),
                size: PARAMS_CAPACITY,
                usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }));
        }
        pending.params_data.resize(offset, 0);
        pending.params_data.extend_from_slice(params);
        pending.params_data.resize(offset + size, 0);
        Ok((offset as u64, size as u64))
    }

    /// The state lock. Every call into wgpu goes through it, one thread at a time: recorded
    /// work must stay ordered, and wgpu's GL backend panics when a thread waits more than a
    /// second for its context. Devices on GL share one EGL context per process, so GL devices
    /// also take a process-wide lock.
    pub(super) fn lock(&self, op: &str) -> Result<PendingGuard<'_>> {
        static GL_LOCK: Mutex<()> = Mutex::new(());
        let gl = if self.info.backend == "gl" {
            Some(GL_LOCK.lock().map_err(|_| Error::gpu(op, "GL state poisoned by an earlier panic"))?)
        } else {
            None
        };
        let pending = self.pending.lock().map_err(|_| Error::gpu(op, "GPU state poisoned by an earlier panic"))?;
        Ok(PendingGuard { pending, _gl: gl })
    }

    /// Whether this thread is recording on this context.
    pub(crate) fn recording_here(&self) -> bool {
        RECORDING_ON.with(|r| r.get() == self as *const GpuContext as usize)
    }

    /// Fails when this thread is recording: `op` needs the GPU to run now.
    pub(super) fn not_recording(&self, op: &str) -> Result<()> {
        if self.recording_here() {
            return Err(Error::gpu(op, "the GPU cannot wait or read back while work is being recorded for replay"));
        }
        Ok(())
    }

    /// Runs `f` with dispatches recorded instead of executed (see [`super::replay`]); returns
    /// its result and the recording. Work recorded before is submitted first. Every buffer a
    /// recorded dispatch binds stays alive in the recording; `f` may upload into new buffers
    /// but not write into existing ones, wait, or read back.
    pub fn record<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<(T, Recording)> {
        if self.recording_here() {
            return Err(Error::gpu("record", "a recording cannot start inside another"));
        }
        // Another thread's recording finishes first (it takes milliseconds).
        let _turn = self.record_turn.lock().unwrap_or_else(|e| e.into_inner());
        {
            let mut pending = self.lock("record")?;
            if pending.recording.is_some() {
                // Only after a recording that panicked: the turn above serialises the others.
                return Err(Error::gpu("record", "an earlier recording on this device did not finish"));
            }
            self.submit_locked(&mut pending);
            pending.recording = Some(Recording::default());
            RECORDING_ON.with(|r| r.set(self as *const GpuContext as usize));
        }
        let out = f();
        let mut rec = {
            let mut pending = self.lock("record")?;
            RECORDING_ON.with(|r| r.set(0));
            pending.recording.take().unwrap_or_default()
        };
        if let Ok(mut parked) = self.recorded_drops.lock() {
            rec.keep.append(&mut parked);
        }
        self.check("record")?;
        Ok((out?, rec))
    }

    /// Submits pending work and waits for the device to finish it.
    pub fn sync(&self) -> Result<()> {
        let mut pending = self.lock("sync")?;
        self.not_recording("sync")?;
        self.submit_locked(&mut pending);
        self.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| Error::gpu("sync", e.to_string()))?;
        pending.submit_at = 0; // the GPU is idle: the next batch goes early
        drop(pending);
        self.check("sync")
    }

    /// Runs `f` (which records GPU work) between two GPU timestamps and returns its result with
    /// the GPU time in seconds, or None when the device has no timestamp queries.
    pub fn gpu_time<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<(T, Option<f64>)> {
        if !self.caps.timestamp_query {
            return f().map(|t| (t, None));
        }
        let set = self.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("timing"),
            ty: wgpu::QueryType::Timestamp,
            count: 2,
        });
        let resolve = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("timing resolve"),
            size: 16,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        self.mark_timestamp(&set, 0)?;
        let out = f()?;
        self.mark_timestamp(&set, 1)?;
        {
            let mut pending = self.lock("timing")?;
            let enc = self.encoder_for_commands(&mut pending);
            enc.resolve_query_set(&set, 0..2, &resolve, 0);
            pending.commands += 1;
        }
        let bytes = self.read(&resolve, 0, 16)?;
        let t: [u64; 2] = [
            u64::from_le_bytes(bytes[0..8].try_into().unwrap_or_default()),
            u64::from_le_bytes(bytes[8..16].try_into().unwrap_or_default()),
        ];
        let ns = t[1].saturating_sub(t[0]) as f64 * self.queue.get_timestamp_period() as f64;
        Ok((out, Some(ns * 1e-9)))
    }

    /// Runs `f` (which issues GPU work on the direct path, not recorded for replay) with each
    /// dispatch in a compute pass of its own between two timestamps; returns its result and the
    /// GPU time per op and grid (`profile::tally`), or None without timestamp queries. Only the
    /// first `profile::MAX_TIMED` dispatches are timed. For ranking where a workload's time
    /// goes (`anygpu bench llm` with `ANYGPU_PROFILE_PREFILL=1`): the passes add their own
    /// cost.
    pub fn profile_dispatches<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<(T, Option<profile::OpTimes>)> {
        const OP: &str = "dispatch profile";
        if !self.caps.timestamp_query {
            return f().map(|t| (t, None));
        }
        {
            let mut pending = self.lock(OP)?;
            self.not_recording(OP)?;
            if pending.profile.is_some() {
                return Err(Error::gpu(OP, "a dispatch profile is already being taken on this device"));
            }
            self.submit_locked(&mut pending);
            pending.profile = Some(DispatchProfile::new(&self.device));
        }
        let out = f();
        let prof = {
            let mut pending = self.lock(OP)?;
            self.encode_deferred(&mut pending, true);
            pending.profile.take()
        };
        let out = out?;
        let Some(prof) = prof.filter(|p| !p.ops.is_empty()) else {
            return Ok((out, Some(Vec::new())));
        };
        let n = prof.ops.len() as u64;
        let resolve = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(OP),
            size: 16 * n,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        {
            let mut pending = self.lock(OP)?;
            let enc = self.encoder_for_commands(&mut pending);
            enc.resolve_query_set(&prof.set, 0..2 * n as u32, &resolve, 0);
            pending.commands += 1;
        }
        let bytes = self.read(&resolve, 0, 16 * n)?;
        let secs = profile::pair_seconds(&bytes, n as usize, self.queue.get_timestamp_period() as f64);
        let timed = prof.ops.into_iter().zip(secs).map(|((op, grid), s)| (op, grid, s));
        Ok((out, Some(profile::tally(timed))))
    }

    /// An empty compute pass that writes timestamp `index` of `set` when the GPU reaches it.
    fn mark_timestamp(&self, set: &wgpu::QuerySet, index: u32) -> Result<()> {
        let mut pending = self.lock("timing")?;
        self.not_recording("timing")?;
        let enc = self.encoder_for_commands(&mut pending);
        drop(enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some("timestamp"),
            timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                query_set: set,
                beginning_of_pass_write_index: Some(index),
                end_of_pass_write_index: None,
            }),
        }));
        pending.commands += 1;
        Ok(())
    }

    /// Reads `len` bytes at `offset` of a buffer back to the host (flushes pending work).
    pub fn read(&self, buffer: &wgpu::Buffer, offset: u64, len: u64) -> Result<Vec<u8>> {
        if len == 0 {
            return Ok(vec![]);
        }
        let aligned_off = offset / 4 * 4;
        let skip = (offset - aligned_off) as usize;
        let copy_len = (len + skip as u64).next_multiple_of(4);
        // The whole read holds the state lock: on GL even mapping and unmapping the staging
        // buffer take the context, and another thread must not wait on it for long.
        let mut pending = self.lock("read")?;
        self.not_recording("read")?;
        let staging = self.readback_buffer(copy_len);
        let enc = self.encoder_for_commands(&mut pending);
        enc.copy_buffer_to_buffer(buffer, aligned_off, &staging, 0, copy_len);
        self.submit_locked(&mut pending);
        let (tx, rx) = std::sync::mpsc::channel();
        staging.slice(..).map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| Error::gpu("read", e.to_string()))?;
        pending.submit_at = 0; // the GPU is idle: the next batch goes early
        self.check("read")?;
        match rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(Error::gpu("read", e.to_string())),
            Err(_) => return Err(Error::gpu("read", "the map callback never ran")),
        }
        let data = staging.slice(..).get_mapped_range().map_err(|e| Error::gpu("read", e.to_string()))?
            [skip..skip + len as usize]
            .to_vec();
        staging.unmap();
        self.keep_readback_buffer(staging);
        drop(pending);
        Ok(data)
    }

    /// A mappable buffer of at least `len` bytes: a kept one of the same size class, or new.
    fn readback_buffer(&self, len: u64) -> wgpu::Buffer {
        let class = size_class(len);
        if let Ok(mut kept) = self.readback.lock() {
            if let Some(i) = kept.iter().position(|b| b.size() == class) {
                return kept.swap_remove(i);
            }
        }
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size: class,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    /// Keeps an unmapped read-back buffer for the next read (the oldest goes when full).
    fn keep_readback_buffer(&self, b: wgpu::Buffer) {
        if b.size() > READBACK_MAX_KEPT_BYTES {
            return;
        }
        if let Ok(mut kept) = self.readback.lock() {
            if kept.len() >= READBACK_KEPT {
                kept.remove(0);
            }
            kept.push(b);
        }
    }
}
