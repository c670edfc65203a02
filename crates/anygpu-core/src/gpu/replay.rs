//! Replay of recorded dispatches: the decode step of an LLM runs the same few hundred kernels
//! on the same buffers for every token, only a handful of parameters (the position) change.
//! Recording them once and replaying costs a set_pipeline / set_bind_group / dispatch per
//! kernel and one submit per run of up to MAX_STEPS_PER_RUN steps, instead of building every
//! tensor op's parameters, buffers and bind group again (~8 µs of host time per dispatch on the
//! H100 machine).
//!
//! How the varying parameters are found: the same work is recorded at two or more positions
//! (e.g. the KV-cache length). Every recording must have the same kernels, workgroup counts and
//! binding ranges; a 32-bit word of a dispatch's parameters that differs between them must be
//! linear in the position (a start position, a key count, an offset of pos * stride), and
//! is patched as `slope * pos + intercept` before each replay. With three or more recordings
//! the fit is checked against the others, so a parameter that is not linear (or a structure
//! that changes with the position) is an error at build time, never a wrong result.

use std::sync::Arc;

use super::context::{make_bind_group, owned_binds, Bind, GpuBuffer, GpuContext};
use super::kernel::{Compiled, Pipeline};
use crate::error::{Error, Result};

/// One recorded dispatch: everything needed to issue it again.
pub(crate) struct Recorded {
    /// Possibly still compiling: [`Replay::new`] waits for it.
    pipeline: Pipeline,
    op: String,
    params: Vec<u8>,
    /// (buffer, offset, size) of bindings 1, 2, ...
    binds: Vec<(wgpu::Buffer, u64, u64)>,
    workgroups: [u32; 3],
}

impl Recorded {
    pub(crate) fn new(
        pipeline: &Pipeline,
        op: &str,
        params: &[u8],
        binds: &[Bind<'_>],
        workgroups: [u32; 3],
    ) -> Recorded {
        let binds = owned_binds(binds);
        Recorded { pipeline: pipeline.clone(), op: op.to_string(), params: params.to_vec(), binds, workgroups }
    }
}

/// What [`GpuContext::record`] captured.
#[derive(Default)]
pub struct Recording {
    pub(crate) dispatches: Vec<Recorded>,
    /// Buffers freed while recording that recorded dispatches may bind.
    pub(crate) keep: Vec<wgpu::Buffer>,
    /// A digest of each upload made while recording, to check recordings agree.
    uploads: Vec<u64>,
}

impl Recording {
    pub(crate) fn note_upload(&mut self, bytes: &[u8]) {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        bytes.hash(&mut h);
        self.uploads.push(h.finish());
    }
    pub fn len(&self) -> usize {
        self.dispatches.len()
    }
    pub fn is_empty(&self) -> bool {
        self.dispatches.is_empty()
    }
    /// The recorded dispatches' ops, in order (named as in the decode profile).
    pub fn ops(&self) -> impl Iterator<Item = &str> {
        self.dispatches.iter().map(|d| d.op.as_str())
    }
}

/// A params word that depends on the position: `slope * pos + intercept` (wrapping u32).
struct Patch {
    byte: usize,
    slope: u32,
    intercept: u32,
}

struct Step {
    op: String,
    pipeline: wgpu::ComputePipeline,
    layout: wgpu::BindGroupLayout,
    /// (offset, size) of its params within a region, if it has params.
    params: Option<(u64, u64)>,
    /// (buffer, offset, size) of bindings 1, 2, ...
    binds: Vec<(wgpu::Buffer, u64, u64)>,
    /// Whether a parameter word of it depends on the position: then step j of a run reads
    /// params region j (one bind group each), else region 0 (the others hold the same words).
    /// A bind group per step and region cost ~30 µs each to make on the H100 (SmolLM2, one for
    /// each of 155 steps in each of 16 regions: 82 ms before the second token).
    patched: bool,
    /// Per params region, for the regions it reads (see `Replay::params`).
    bind_groups: Vec<Option<wgpu::BindGroup>>,
    workgroups: [u32; 3],
}

/// Ops left out of every replayed run, for finding what an op costs in a real pass (its
/// kernel and the gap its dispatch adds): `ANYGPU_REPLAY_SKIP=attention,quantize_q8[4]` names
/// ops as the decode profile does, bare (every grid) or with the grid's first count in
/// brackets. The results are then wrong; only the GPU pass time means anything. Read once.
fn skipped_ops() -> &'static [String] {
    static SKIP: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    SKIP.get_or_init(|| {
        std::env::var("ANYGPU_REPLAY_SKIP")
            .map(|v| v.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect())
            .unwrap_or_default()
    })
}

impl Step {
    fn skipped(&self, skip: &[String]) -> bool {
        skip.iter().any(|n| *n == self.op || *n == format!("{}[{}]", self.op, self.workgroups[0]))
    }

    fn region(&self, j: usize) -> usize {
        if self.patched {
            j
        } else {
            0
        }
    }
}

/// The steps of the run after one of `steps`, as [`Replay::submit_steps`] prepares it: twice
/// as many, up to MAX_STEPS_PER_RUN. Callers that chain runs grow them this way, so that the
/// first one (whose command buffer is encoded while the GPU idles) is short and every later
/// one finds its command buffer prepared.
pub fn next_run_steps(steps: usize) -> usize {
    (2 * steps).clamp(1, MAX_STEPS_PER_RUN)
}

/// Results regions: one per step of a run. Both runs that may be in flight use the same ones,
/// as they use the same params regions: the queue runs a run's copies into them after the run
/// before has copied them out to its read-back buffer.
const REGIONS: usize = MAX_STEPS_PER_RUN;

/// Where each step's output goes within a run: the copy dispatch after each step (same pass)
/// and the buffer it fills, for one output buffer and read length.
struct Results {
    output: wgpu::Buffer,
    read_len: u64,
    pipeline: wgpu::ComputePipeline,
    /// REGIONS x read_len bytes: region r's copy at r * read_len.
    buffer: wgpu::Buffer,
    bind_groups: Vec<wgpu::BindGroup>,
    workgroups: [u32; 3],
    _params: wgpu::Buffer,
}

/// Recorded work, ready to be issued again at any position.
pub struct Replay {
    ctx: Arc<GpuContext>,
    steps: Vec<Step>,
    /// MAX_STEPS_PER_RUN regions of `params_len` bytes: step j of a run reads region j (bind
    /// groups per region), so the steps of a run need no copy of their params between them.
    /// Every run writes them before it starts: the write waits for the run before (the
    /// queue's barrier on the buffer), as one params buffer for one step did.
    params: wgpu::Buffer,
    params_len: usize,
    params_data: Vec<u8>,
    results: Option<Results>,
    patches: Vec<Patch>,
    /// Buffers the steps bind that nothing else owns any more.
    _keep: Vec<wgpu::Buffer>,
    /// Timestamps at the start and end of the replayed pass, where the device has them.
    timing: Option<(wgpu::QuerySet, wgpu::Buffer)>,
    last: ReplayTimes,
    /// Two read-back buffers used in turn (one may be mapped while the other is written),
    /// of `staging_size` bytes.
    staging: [Option<wgpu::Buffer>; 2],
    staging_size: u64,
    /// The patched params of each step of a run, written to the params regions.
    run_params: Vec<u8>,
    next_slot: usize,
    /// The next run's command buffer, its slot and its number of steps (for the output of
    /// `results`).
    prepared: Option<(wgpu::CommandBuffer, usize, usize)>,
    /// Runs submitted and not yet waited for (at most two).
    in_flight: usize,
}

/// Steps one run (one submit, one compute pass) may chain ([`Replay::submit_steps`]). Each
/// submit cost ~68 µs of GPU time beyond its pass on the H100 machine (SmolLM2's decode step:
/// 1.112 ms per token one step per submit, 1.044 with four passes per submit); chained steps
/// share it. SmolLM2 tg128, same binary: 897 tok/s with runs of one step, 918 up to 4, 921
/// up to 8.
pub const MAX_STEPS_PER_RUN: usize = 8;

/// A submitted run ([`Replay::submit_steps`]), to be passed to [`Replay::wait`].
#[must_use = "a submitted run must be waited for"]
pub struct Ticket {
    slot: usize,
    steps: usize,
    index: wgpu::SubmissionIndex,
    read_len: u64,
    ts_at: u64,
    t0: std::time::Instant,
    encode_s: f64,
    submitted_s: f64,
}

/// Where the time of the last [`Replay::run`] went.
#[derive(Clone, Copy, Debug, Default)]
pub struct ReplayTimes {
    /// Host time until the command buffer was ready (encoded now, or prepared by the last run).
    pub encode_s: f64,
    /// GPU time of the run's pass, all its steps (None without timestamp queries).
    pub gpu_s: Option<f64>,
    /// Host time of the whole run, from the call to the data back.
    pub total_s: f64,
    /// Of which: until the submit returned, and until the wait for the GPU returned.
    pub submitted_s: f64,
    pub waited_s: f64,
    /// Steps chained in the run (the times above cover all of them).
    pub steps: usize,
}

fn word(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

impl Replay {
    /// Builds a replay from recordings of the same work at positions `recs[i].0` (at least two,
    /// distinct). The first recording's buffers are the ones replayed; the others only serve
    /// to find and check the position-dependent parameters.
    pub fn new(ctx: &Arc<GpuContext>, recs: Vec<(u32, Recording)>) -> Result<Replay> {
        const OP: &str = "replay";
        let mismatch = |i: usize, what: &str| {
            Err(Error::gpu(
                OP,
                format!("dispatch {i} differs between positions ({what}): this work cannot be replayed"),
            ))
        };
        if recs.len() < 2 || recs[0].0 == recs[1].0 {
            return Err(Error::gpu(OP, "need recordings at two different positions"));
        }
        let (p0, base) = &recs[0];
        let (p1, other) = &recs[1];
        for (_, r) in &recs[1..] {
            if r.dispatches.len() != base.dispatches.len() {
                return Err(Error::gpu(
                    OP,
                    format!("{} dispatches at one position, {} at another", base.len(), r.len()),
                ));
            }
            if r.uploads != base.uploads {
                return Err(Error::gpu(OP, "uploaded data depends on the position"));
            }
        }
        let align = (ctx.device.limits().min_uniform_buffer_offset_alignment as usize).max(16);
        let mut params_data: Vec<u8> = Vec::new();
        let mut patches = Vec::new();
        let mut slots = Vec::with_capacity(base.len());
        for (i, d) in base.dispatches.iter().enumerate() {
            for (_, r) in &recs[1..] {
                let e = &r.dispatches[i];
                if e.op != d.op || e.pipeline != d.pipeline {
                    return mismatch(i, &format!("kernel {} vs {}", d.op, e.op));
                }
                if e.workgroups != d.workgroups {
                    return mismatch(i, &format!("{} workgroups {:?} vs {:?}", d.op, d.workgroups, e.workgroups));
                }
                if e.params.len() != d.params.len()
                    || e.binds.len() != d.binds.len()
                    || e.binds.iter().zip(&d.binds).any(|(a, b)| (a.1, a.2) != (b.1, b.2))
                {
                    return mismatch(i, &format!("{} bindings", d.op));
                }
            }
            let offset = params_data.len().next_multiple_of(align);
            params_data.resize(offset, 0);
            params_data.extend_from_slice(&d.params);
            params_data.resize(offset + d.params.len().next_multiple_of(16), 0);
            slots.push((offset as u64, d.params.len().next_multiple_of(16) as u64));
            for w in (0..d.params.len() / 4 * 4).step_by(4) {
                let (v0, v1) = (word(&d.params, w), word(&other.dispatches[i].params, w));
                if v0 == v1 && recs[2..].iter().all(|(_, r)| word(&r.dispatches[i].params, w) == v0) {
                    continue;
                }
                // v = slope * pos + intercept through (p0, v0) and (p1, v1), in wrapping u32.
                let dp = p1.wrapping_sub(*p0);
                let dv = v1.wrapping_sub(v0);
                if dp == 0 || dv % dp != 0 {
                    return mismatch(i, &format!("{} parameter word {} is not linear in the position", d.op, w / 4));
                }
                let slope = dv / dp;
                let intercept = v0.wrapping_sub(slope.wrapping_mul(*p0));
                for (p, r) in &recs[2..] {
                    if word(&r.dispatches[i].params, w) != slope.wrapping_mul(*p).wrapping_add(intercept) {
                        return mismatch(
                            i,
                            &format!("{} parameter word {} is not linear in the position", d.op, w / 4),
                        );
                    }
                }
                patches.push(Patch { byte: offset + w, slope, intercept });
            }
        }
        // Regions start on the uniform offset alignment.
        let params_len = params_data.len().next_multiple_of(align).max(align);
        params_data.resize(params_len, 0);
        let params = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("replay params"),
            size: (params_len * MAX_STEPS_PER_RUN) as u64,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut steps = Vec::with_capacity(base.len());
        for (d, (off, size)) in base.dispatches.iter().zip(slots) {
            let Compiled { pipeline, layout } = d.pipeline.get()?;
            let range = off as usize..(off + size) as usize;
            steps.push(Step {
                op: d.op.clone(),
                pipeline,
                layout,
                params: (!d.params.is_empty()).then_some((off, size)),
                binds: d.binds.clone(),
                patched: patches.iter().any(|p| range.contains(&p.byte)),
                bind_groups: vec![None; MAX_STEPS_PER_RUN],
                workgroups: d.workgroups,
            });
        }
        ctx.check(OP)?;
        let keep = recs.into_iter().next().map(|(_, r)| r.keep).unwrap_or_default();
        let timing = ctx.caps.timestamp_query.then(|| {
            let set = ctx.device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("replay timing"),
                ty: wgpu::QueryType::Timestamp,
                count: 2,
            });
            let resolve = ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("replay timing"),
                size: 16,
                usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            });
            (set, resolve)
        });
        let mut replay = Replay {
            ctx: ctx.clone(),
            steps,
            params,
            params_len,
            params_data,
            results: None,
            patches,
            _keep: keep,
            timing,
            last: ReplayTimes::default(),
            staging: [None, None],
            staging_size: 0,
            run_params: Vec::new(),
            next_slot: 0,
            prepared: None,
            in_flight: 0,
        };
        replay.make_bind_groups();
        ctx.check(OP)?;
        Ok(replay)
    }

    /// Makes each step's bind groups: one per params region it reads.
    fn make_bind_groups(&mut self) {
        let device = &self.ctx.device;
        for j in 0..MAX_STEPS_PER_RUN {
            let at = (j * self.params_len) as u64;
            for s in self.steps.iter_mut().filter(|s| s.region(j) == j) {
                let params = s.params.map(|(off, size)| (&self.params, at + off, size));
                let binds = s.binds.iter().map(|(b, o, size)| (b, *o, *size));
                let bg = make_bind_group(device, &s.layout, &s.op, params, binds);
                s.bind_groups[j] = Some(bg);
            }
        }
    }

    /// Dispatches replayed per run.
    pub fn len(&self) -> usize {
        self.steps.len()
    }
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }
    /// Parameter words patched per run.
    pub fn patched_words(&self) -> usize {
        self.patches.len()
    }

    /// Sets the position-dependent parameter words for `pos` (written before each run).
    fn patch(&mut self, pos: u32) {
        for p in &self.patches {
            let v = p.slope.wrapping_mul(pos).wrapping_add(p.intercept);
            self.params_data[p.byte..p.byte + 4].copy_from_slice(&v.to_le_bytes());
        }
    }

    /// Where the time of the last run went.
    pub fn last_times(&self) -> ReplayTimes {
        self.last
    }

    /// Records `steps` replayed steps in one compute pass, each followed by the
    /// copy of its output into its region of the results buffer; then the copy of those
    /// `steps` x `read_len` bytes into `staging` and the two timestamps (start and end of the
    /// pass) at `ts_at`, and finishes the command buffer. This is the host's main cost per run
    /// (wgpu validates and translates the pass in `finish`: ~3 µs per dispatch on the H100
    /// machine), which is why `submit_steps` does it for the next run while the GPU works on
    /// this one.
    fn encode(&self, steps: usize, staging: &wgpu::Buffer, ts_at: u64) -> wgpu::CommandBuffer {
        let ctx = &self.ctx;
        let mut enc = ctx.device.create_command_encoder(&Default::default());
        {
            let timestamp_writes = self.timing.as_ref().map(|(set, _)| wgpu::ComputePassTimestampWrites {
                query_set: set,
                beginning_of_pass_write_index: Some(0),
                end_of_pass_write_index: Some(1),
            });
            let mut pass =
                enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("replay"), timestamp_writes });
            let skip = skipped_ops();
            for j in 0..steps {
                let mut last: Option<&wgpu::ComputePipeline> = None;
                for s in self.steps.iter().filter(|s| !s.skipped(skip)) {
                    if last.is_none_or(|l| *l != s.pipeline) {
                        pass.set_pipeline(&s.pipeline);
                        last = Some(&s.pipeline);
                    }
                    // Made by `make_bind_groups` for every region the step reads.
                    pass.set_bind_group(0, s.bind_groups[s.region(j)].as_ref(), &[]);
                    pass.dispatch_workgroups(s.workgroups[0], s.workgroups[1], s.workgroups[2]);
                }
                if let Some(r) = &self.results {
                    pass.set_pipeline(&r.pipeline);
                    pass.set_bind_group(0, &r.bind_groups[j], &[]);
                    pass.dispatch_workgroups(r.workgroups[0], r.workgroups[1], r.workgroups[2]);
                }
            }
        }
        if let Some(r) = &self.results {
            enc.copy_buffer_to_buffer(&r.buffer, 0, staging, 0, steps as u64 * r.read_len);
        }
        if let Some((set, resolve)) = &self.timing {
            enc.resolve_query_set(set, 0..2, resolve, 0);
            enc.copy_buffer_to_buffer(resolve, 0, staging, ts_at, 16);
        }
        enc.finish()
    }

    /// Whether the results regions and their copy dispatches already serve the first
    /// `read_len` bytes of `output` (none are needed when `read_len` is 0).
    fn results_match(&self, output: &wgpu::Buffer, read_len: u64) -> bool {
        match &self.results {
            Some(r) => r.output == *output && r.read_len == read_len,
            None => read_len == 0,
        }
    }

    /// The copy dispatches and results buffer for `read_len` bytes of `output` (made on first
    /// use, again when either changes; nothing may be in flight then).
    fn set_results(&mut self, output: &wgpu::Buffer, read_len: u64) -> Result<()> {
        if self.results_match(output, read_len) {
            return Ok(());
        }
        if read_len == 0 {
            self.results = None;
            return Ok(());
        }
        let ctx = self.ctx.clone();
        let Compiled { pipeline, layout } = ctx
            .pipeline(&super::KernelSpec::new("replay_copy", include_str!("replay_copy.wgsl"), "main"), &[])?
            .get()?;
        let words = (read_len / 4) as u32;
        let align = (ctx.device.limits().min_uniform_buffer_offset_alignment as u64).max(16);
        let mut pdata = vec![0u8; align as usize * REGIONS];
        for r in 0..REGIONS {
            let at = r * align as usize;
            pdata[at..at + 4].copy_from_slice(&words.to_le_bytes());
            pdata[at + 4..at + 8].copy_from_slice(&(r as u32 * words).to_le_bytes());
        }
        let params = ctx.filled_buffer("replay copy params", wgpu::BufferUsages::UNIFORM, &pdata, 4)?;
        let buffer = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("replay results"),
            size: read_len * REGIONS as u64,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let bind_groups = (0..REGIONS as u64)
            .map(|r| {
                let binds = [(output, 0, read_len), (&buffer, 0, buffer.size())];
                make_bind_group(&ctx.device, &layout, "replay copy", Some((&params, r * align, 16)), binds)
            })
            .collect();
        let workgroups = ctx.grid_1d(words.div_ceil(64));
        ctx.check("replay")?;
        self.results = Some(Results {
            output: output.clone(),
            read_len,
            pipeline,
            buffer,
            bind_groups,
            workgroups,
            _params: params,
        });
        Ok(())
    }

    /// GPU time per op name and grid over one run at `pos` (inputs as they were last written), each
    /// dispatch in a compute pass of its own between two timestamps: (op, dispatches, seconds),
    /// largest first. The separate passes add their own cost (~tens of µs each on the H100
    /// machine), so the figures rank the ops, they do not add up to a normal run. None without
    /// timestamp queries.
    pub fn profile(&mut self, pos: u32) -> Result<Option<super::profile::OpTimes>> {
        const OP: &str = "replay profile";
        if !self.ctx.caps.timestamp_query || self.steps.is_empty() {
            return Ok(None);
        }
        self.patch(pos);
        let ctx = self.ctx.clone();
        let n = self.steps.len() as u32;
        let set = ctx.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("replay profile"),
            ty: wgpu::QueryType::Timestamp,
            count: 2 * n,
        });
        let resolve = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("replay profile"),
            size: 16 * n as u64,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        {
            let mut pending = ctx.lock(OP)?;
            ctx.not_recording(OP)?;
            ctx.submit_locked(&mut pending);
            ctx.queue.write_buffer(&self.params, 0, &self.params_data);
            let mut enc = ctx.device.create_command_encoder(&Default::default());
            for (i, s) in self.steps.iter().enumerate() {
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("replay profile"),
                    timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                        query_set: &set,
                        beginning_of_pass_write_index: Some(2 * i as u32),
                        end_of_pass_write_index: Some(2 * i as u32 + 1),
                    }),
                });
                pass.set_pipeline(&s.pipeline);
                pass.set_bind_group(0, s.bind_groups[0].as_ref(), &[]);
                pass.dispatch_workgroups(s.workgroups[0], s.workgroups[1], s.workgroups[2]);
            }
            enc.resolve_query_set(&set, 0..2 * n, &resolve, 0);
            ctx.queue.submit([enc.finish()]);
        }
        let bytes = ctx.read(&resolve, 0, 16 * n as u64)?;
        let secs = super::profile::pair_seconds(&bytes, n as usize, ctx.queue.get_timestamp_period() as f64);
        Ok(Some(super::profile::tally(self.steps.iter().zip(secs).map(|(s, dt)| (s.op.to_string(), s.workgroups, dt)))))
    }

    /// The read-back buffer `i` (of two, used in turn), at least `size` bytes.
    fn staging(&mut self, i: usize, size: u64) -> wgpu::Buffer {
        let ctx = &self.ctx;
        self.staging[i]
            .get_or_insert_with(|| {
                ctx.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("replay readback"),
                    size,
                    usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                })
            })
            .clone()
    }

    /// Issues the recorded work at position `pos`, after writing `inputs` (buffer, bytes) and
    /// before copying the first `read_len` bytes of `output` back, in one submit; returns them.
    /// While the GPU runs it, the command buffer of the next run is prepared.
    pub fn run(
        &mut self,
        pos: u32,
        inputs: &[(&GpuBuffer, &[u8])],
        output: &GpuBuffer,
        read_len: u64,
    ) -> Result<Vec<u8>> {
        let ticket = self.submit_steps(pos, 1, inputs, output, read_len)?;
        self.wait(ticket)
    }

    /// The first half of [`Replay::run`], for `steps` consecutive positions from `pos` (at most
    /// [`MAX_STEPS_PER_RUN`]) in one submit: writes the inputs (read by the first step) and the
    /// patched parameters of each step, submits, and prepares the next run's command buffer,
    /// without waiting. [`Replay::wait`] returns each step's `read_len` bytes of `output`, in
    /// order. At most two runs may be in flight (the two read-back buffers): wait for the older
    /// before a third submit. Steps and runs execute in order, so a step may read what the
    /// previous one wrote (the next token id, chosen on the GPU) before the host has seen it.
    pub fn submit_steps(
        &mut self,
        pos: u32,
        steps: usize,
        inputs: &[(&GpuBuffer, &[u8])],
        output: &GpuBuffer,
        read_len: u64,
    ) -> Result<Ticket> {
        const OP: &str = "replay";
        let t0 = std::time::Instant::now();
        if steps == 0 || steps > MAX_STEPS_PER_RUN {
            return Err(Error::gpu(OP, format!("{steps} steps in one run (1 to {MAX_STEPS_PER_RUN})")));
        }
        let ctx = self.ctx.clone();
        let read_len = read_len.min(output.len).next_multiple_of(4);
        // The data of every step, then the two timestamps.
        let ts_at = (read_len * MAX_STEPS_PER_RUN as u64).next_multiple_of(8);
        if self.staging_size != ts_at + 16 || !self.results_match(output.buffer(), read_len) {
            if self.in_flight > 0 {
                return Err(Error::gpu(OP, "a run with another output or read-back size is still in flight"));
            }
            // Another output: the buffers and any prepared command buffer are stale.
            self.staging = [None, None];
            self.prepared = None;
            self.staging_size = ts_at + 16;
            self.set_results(output.buffer(), read_len)?;
        }
        if self.in_flight >= 2 {
            return Err(Error::gpu(OP, "two runs are in flight: wait for one before submitting another"));
        }
        let mut run_params = std::mem::take(&mut self.run_params);
        run_params.clear();
        for j in 0..steps as u32 {
            self.patch(pos.wrapping_add(j));
            run_params.extend_from_slice(&self.params_data);
        }
        let (cb, slot) = match self.prepared.take() {
            Some((cb, slot, n)) if n == steps => (cb, slot),
            _ => {
                let slot = self.next_slot;
                let staging = self.staging(slot, ts_at + 16);
                (self.encode(steps, &staging, ts_at), slot)
            }
        };
        let mut pending = ctx.lock(OP)?;
        ctx.not_recording(OP)?;
        // Earlier work first: the writes below are queued ahead of every later submit.
        ctx.submit_locked(&mut pending);
        if !run_params.is_empty() {
            ctx.queue.write_buffer(&self.params, 0, &run_params);
        }
        self.run_params = run_params;
        for (buf, bytes) in inputs {
            let mut v = bytes.to_vec();
            v.resize(bytes.len().next_multiple_of(4), 0);
            ctx.queue.write_buffer(buf.buffer(), 0, &v);
        }
        let encode_s = t0.elapsed().as_secs_f64();
        let index = ctx.queue.submit([cb]);
        let submitted_s = t0.elapsed().as_secs_f64();
        drop(pending);
        ctx.check(OP)?;
        self.in_flight += 1;
        // The next run's command buffer, into the other slot, while the GPU works. (That slot's
        // read-back buffer is not mapped now: a run is waited for, mapped and unmapped before
        // the next one is submitted into its slot.)
        let other = 1 - slot;
        self.next_slot = other;
        let next_staging = self.staging(other, ts_at + 16);
        let next_steps = next_run_steps(steps);
        let cb = self.encode(next_steps, &next_staging, ts_at);
        self.prepared = Some((cb, other, next_steps));
        Ok(Ticket { slot, steps, index, read_len, ts_at, t0, encode_s, submitted_s })
    }

    /// The second half of [`Replay::run`]: waits for the run of `ticket` and returns its bytes.
    pub fn wait(&mut self, ticket: Ticket) -> Result<Vec<u8>> {
        const OP: &str = "replay";
        let Ticket { slot, steps, index, read_len, ts_at, t0, encode_s, submitted_s } = ticket;
        let ctx = self.ctx.clone();
        self.in_flight = self.in_flight.saturating_sub(1);
        let staging = self.staging(slot, ts_at + 16);
        // Held like every other submit-and-wait (the GL backend's context is not shared).
        let _turn = ctx.lock(OP)?;
        let (tx, rx) = std::sync::mpsc::channel();
        staging.slice(..).map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        ctx.device
            .poll(wgpu::PollType::Wait { submission_index: Some(index), timeout: None })
            .map_err(|e| Error::gpu(OP, e.to_string()))?;
        let waited_s = t0.elapsed().as_secs_f64();
        ctx.check(OP)?;
        match rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(Error::gpu(OP, e.to_string())),
            Err(_) => return Err(Error::gpu(OP, "the map callback never ran")),
        }
        let mapped = staging.slice(..).get_mapped_range().map_err(|e| Error::gpu(OP, e.to_string()))?;
        let data = mapped[..read_len as usize * steps].to_vec();
        let gpu_s = self.timing.as_ref().map(|_| {
            let at = ts_at as usize;
            let t = |i: usize| u64::from_le_bytes(mapped[at + 8 * i..at + 8 * i + 8].try_into().unwrap_or_default());
            t(1).saturating_sub(t(0)) as f64 * ctx.queue.get_timestamp_period() as f64 * 1e-9
        });
        drop(mapped);
        staging.unmap();
        self.last = ReplayTimes { encode_s, gpu_s, total_s: t0.elapsed().as_secs_f64(), submitted_s, waited_s, steps };
        Ok(data)
    }
}
