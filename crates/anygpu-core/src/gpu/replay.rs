//! Replay of recorded dispatches: the decode step of an LLM runs the same few hundred kernels
//! on the same buffers for every token, only a handful of parameters (the position) change.
//! Recording them once and replaying costs a set_pipeline / set_bind_group / dispatch per
//! kernel and one submit per step, instead of building every tensor op's parameters, buffers
//! and bind group again (~8 µs of host time per dispatch on the H100 machine).
//!
//! How the varying parameters are found: the same work is recorded at two or more positions
//! (e.g. the KV-cache length). Every recording must have the same kernels, workgroup counts and
//! binding ranges; a 32-bit word of a dispatch's parameters that differs between them must be
//! linear in the position (a start position, a key count, an offset of pos * stride), and
//! is patched as `slope * pos + intercept` before each replay. With three or more recordings
//! the fit is checked against the others, so a parameter that is not linear (or a structure
//! that changes with the position) is an error at build time, never a wrong result.

use std::sync::Arc;

use super::context::{owned_binds, Bind, GpuBuffer, GpuContext};
use super::kernel::Pipeline;
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
    bind_group: wgpu::BindGroup,
    workgroups: [u32; 3],
}

/// Recorded work, ready to be issued again at any position.
pub struct Replay {
    ctx: Arc<GpuContext>,
    steps: Vec<Step>,
    params: wgpu::Buffer,
    params_data: Vec<u8>,
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
    next_slot: usize,
    /// The next run's command buffer, its read-back slot and the output buffer it reads.
    prepared: Option<(wgpu::CommandBuffer, usize, wgpu::Buffer)>,
    /// Runs submitted and not yet waited for (at most two).
    in_flight: usize,
}

/// A submitted run ([`Replay::submit`]), to be passed to [`Replay::wait`].
#[must_use = "a submitted run must be waited for"]
pub struct Ticket {
    slot: usize,
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
    /// GPU time of the replayed pass (None without timestamp queries).
    pub gpu_s: Option<f64>,
    /// Host time of the whole run, from the call to the data back.
    pub total_s: f64,
    /// Of which: until the submit returned, and until the wait for the GPU returned.
    pub submitted_s: f64,
    pub waited_s: f64,
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
        let mut params_data = Vec::new();
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
        let params = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("replay params"),
            size: (params_data.len().max(16)) as u64,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut steps = Vec::with_capacity(base.len());
        for (d, (off, size)) in base.dispatches.iter().zip(slots) {
            let mut entries = Vec::with_capacity(d.binds.len() + 1);
            if !d.params.is_empty() {
                entries.push(wgpu::BindGroupEntry {
                    binding: 0,
                    resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                        buffer: &params,
                        offset: off,
                        size: wgpu::BufferSize::new(size),
                    }),
                });
            }
            for (i, (buf, off, size)) in d.binds.iter().enumerate() {
                entries.push(wgpu::BindGroupEntry {
                    binding: i as u32 + 1,
                    resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                        buffer: buf,
                        offset: *off,
                        size: wgpu::BufferSize::new(*size),
                    }),
                });
            }
            let pipeline = d.pipeline.get()?;
            let bind_group = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some(&d.op),
                layout: &pipeline.get_bind_group_layout(0),
                entries: &entries,
            });
            steps.push(Step { op: d.op.clone(), pipeline, bind_group, workgroups: d.workgroups });
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
        Ok(Replay {
            ctx: ctx.clone(),
            steps,
            params,
            params_data,
            patches,
            _keep: keep,
            timing,
            last: ReplayTimes::default(),
            staging: [None, None],
            staging_size: 0,
            next_slot: 0,
            prepared: None,
            in_flight: 0,
        })
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

    /// Records the replayed pass and the read-back of `read_len` bytes of `output` (then the
    /// two timestamps at `ts_at`) into `staging`, and finishes the command buffer. This is the
    /// host's main cost per run (wgpu validates and translates the pass in `finish`: ~3 µs per
    /// dispatch on the H100 machine), which is why `run` does it for the next run while the
    /// GPU works on this one.
    fn encode(&self, output: &wgpu::Buffer, read_len: u64, staging: &wgpu::Buffer, ts_at: u64) -> wgpu::CommandBuffer {
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
            let mut last: Option<&wgpu::ComputePipeline> = None;
            for s in &self.steps {
                if last.is_none_or(|l| *l != s.pipeline) {
                    pass.set_pipeline(&s.pipeline);
                    last = Some(&s.pipeline);
                }
                pass.set_bind_group(0, &s.bind_group, &[]);
                pass.dispatch_workgroups(s.workgroups[0], s.workgroups[1], s.workgroups[2]);
            }
        }
        if read_len > 0 {
            enc.copy_buffer_to_buffer(output, 0, staging, 0, read_len);
        }
        if let Some((set, resolve)) = &self.timing {
            enc.resolve_query_set(set, 0..2, resolve, 0);
            enc.copy_buffer_to_buffer(resolve, 0, staging, ts_at, 16);
        }
        enc.finish()
    }

    /// GPU time per op name and grid over one run at `pos` (inputs as they were last written), each
    /// dispatch in a compute pass of its own between two timestamps: (op, dispatches, seconds),
    /// largest first. The separate passes add their own cost (~tens of µs each on the H100
    /// machine), so the figures rank the ops, they do not add up to a normal run. None without
    /// timestamp queries.
    pub fn profile(&mut self, pos: u32) -> Result<Option<Vec<(String, usize, f64)>>> {
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
                pass.set_bind_group(0, &s.bind_group, &[]);
                pass.dispatch_workgroups(s.workgroups[0], s.workgroups[1], s.workgroups[2]);
            }
            enc.resolve_query_set(&set, 0..2 * n, &resolve, 0);
            ctx.queue.submit([enc.finish()]);
        }
        let bytes = ctx.read(&resolve, 0, 16 * n as u64)?;
        let period = ctx.queue.get_timestamp_period() as f64 * 1e-9;
        let mut by_op: Vec<(String, usize, f64)> = Vec::new();
        for (i, s) in self.steps.iter().enumerate() {
            let t = |k: usize| u64::from_le_bytes(bytes[8 * k..8 * k + 8].try_into().unwrap_or_default());
            let dt = t(2 * i + 1).saturating_sub(t(2 * i)) as f64 * period;
            // Named by op and grid: the products of different matrices are told apart.
            let key = format!("{} {:?}", s.op, s.workgroups);
            match by_op.iter_mut().find(|(op, _, _)| *op == key) {
                Some(e) => {
                    e.1 += 1;
                    e.2 += dt;
                }
                None => by_op.push((key, 1, dt)),
            }
        }
        by_op.sort_by(|a, b| b.2.total_cmp(&a.2));
        Ok(Some(by_op))
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
        let ticket = self.submit(pos, inputs, output, read_len)?;
        self.wait(ticket)
    }

    /// The first half of [`Replay::run`]: writes the inputs and the patched parameters, submits
    /// the run and prepares the next run's command buffer, without waiting. At most two runs
    /// may be in flight (the two read-back buffers): wait for the older before a third submit.
    /// Runs execute in submission order, so a run may read what the previous one wrote (the
    /// next token id, chosen on the GPU) before the host has seen it.
    pub fn submit(
        &mut self,
        pos: u32,
        inputs: &[(&GpuBuffer, &[u8])],
        output: &GpuBuffer,
        read_len: u64,
    ) -> Result<Ticket> {
        const OP: &str = "replay";
        let t0 = std::time::Instant::now();
        self.patch(pos);
        let ctx = self.ctx.clone();
        let read_len = read_len.min(output.len).next_multiple_of(4);
        // The data, then the two timestamps.
        let ts_at = read_len.next_multiple_of(8);
        if self.staging_size != ts_at + 16 {
            if self.in_flight > 0 {
                return Err(Error::gpu(OP, "a run with another read-back size is still in flight"));
            }
            // Another read-back size: the buffers and any prepared command buffer are stale.
            self.staging = [None, None];
            self.prepared = None;
            self.staging_size = ts_at + 16;
        }
        if self.in_flight >= 2 {
            return Err(Error::gpu(OP, "two runs are in flight: wait for one before submitting another"));
        }
        let mut pending = ctx.lock(OP)?;
        ctx.not_recording(OP)?;
        // Earlier work first: the writes below are queued ahead of every later submit.
        ctx.submit_locked(&mut pending);
        ctx.queue.write_buffer(&self.params, 0, &self.params_data);
        for (buf, bytes) in inputs {
            let mut v = bytes.to_vec();
            v.resize(bytes.len().next_multiple_of(4), 0);
            ctx.queue.write_buffer(buf.buffer(), 0, &v);
        }
        let (cb, slot) = match self.prepared.take() {
            Some((cb, slot, out)) if out == *output.buffer() => (cb, slot),
            _ => {
                let slot = self.next_slot;
                let staging = self.staging(slot, ts_at + 16);
                (self.encode(output.buffer(), read_len, &staging, ts_at), slot)
            }
        };
        let encode_s = t0.elapsed().as_secs_f64();
        let index = ctx.queue.submit([cb]);
        let submitted_s = t0.elapsed().as_secs_f64();
        drop(pending);
        self.in_flight += 1;
        // The next run's command buffer, into the other read-back buffer, while the GPU works.
        // (That buffer is not mapped now: a run is waited for, mapped and unmapped before the
        // next one is submitted into its slot.)
        let other = 1 - slot;
        self.next_slot = other;
        let next_staging = self.staging(other, ts_at + 16);
        self.prepared =
            Some((self.encode(output.buffer(), read_len, &next_staging, ts_at), other, output.buffer().clone()));
        Ok(Ticket { slot, index, read_len, ts_at, t0, encode_s, submitted_s })
    }

    /// The second half of [`Replay::run`]: waits for the run of `ticket` and returns its bytes.
    pub fn wait(&mut self, ticket: Ticket) -> Result<Vec<u8>> {
        const OP: &str = "replay";
        let Ticket { slot, index, read_len, ts_at, t0, encode_s, submitted_s } = ticket;
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
        let data = mapped[..read_len as usize].to_vec();
        let gpu_s = self.timing.as_ref().map(|_| {
            let at = ts_at as usize;
            let t = |i: usize| u64::from_le_bytes(mapped[at + 8 * i..at + 8 * i + 8].try_into().unwrap_or_default());
            t(1).saturating_sub(t(0)) as f64 * ctx.queue.get_timestamp_period() as f64 * 1e-9
        });
        drop(mapped);
        staging.unmap();
        self.last = ReplayTimes { encode_s, gpu_s, total_s: t0.elapsed().as_secs_f64(), submitted_s, waited_s };
        Ok(data)
    }
}
