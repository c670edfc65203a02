//! What one data dependency between two memory-bound products costs on a GPU, and whether
//! waiting inside one dispatch costs less than wgpu's barrier between two.
//!
//! A decode step is a chain of products each of which reads the whole output of the one before
//! (Q|K|V -> attention -> wo -> gate|up -> down -> the next layer's Q|K|V), so its time is the
//! weights' bytes over the bandwidth plus what each such dependency adds. This runs SEGMENTS
//! F16 products y = W x of N x N weights (each its own matrix, so none is read from L2), the
//! output of each the input of the next, four ways, and prints the GPU time per product:
//!
//! - `independent`: the products in separate dispatches that share no data (each its own x
//!   and y), so wgpu puts no barrier between them: the streaming rate, no dependency.
//! - `dependent`: the chain, one dispatch each, wgpu's barrier between them.
//! - `chained`: the chain in one dispatch; each product's workgroups load their W rows, then
//!   wait for the product before to count itself done (see product.wgsl).
//! - `chained-l1`: `chained` with x read through the L1 (no `@coherent`): shows whether a
//!   device-scope barrier makes another multiprocessor's writes visible to plain loads.
//!
//! The same kernel runs in every mode (W rows loaded into registers up front, x staged in
//! workgroup memory); the chained results must equal the dependent ones bit for bit.
//!
//! Run: cargo run --release --manifest-path tools/dependency-cost/Cargo.toml -- [N] [SEGMENTS] [REPS]
//! (N a multiple of 128 up to 4096; defaults 4096 16 30). Vulkan, DX12 or Metal, with timestamp
//! queries, subgroups and `@coherent` (MEMORY_DECORATION_COHERENT).

use std::collections::HashMap;

use wgpu::util::DeviceExt;

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Independent,
    Dependent,
    Chained,
    ChainedL1,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Independent => "independent",
            Mode::Dependent => "dependent",
            Mode::Chained => "chained",
            Mode::ChainedL1 => "chained-l1",
        }
    }

    fn chained(self) -> bool {
        matches!(self, Mode::Chained | Mode::ChainedL1)
    }
}

const MODES: [Mode; 4] = [Mode::Independent, Mode::Dependent, Mode::Chained, Mode::ChainedL1];

fn main() {
    let arg = |i: usize, default: u32| -> u32 {
        std::env::args()
            .nth(i)
            .map(|s| s.parse().unwrap_or_else(|_| fail(&format!("not a number: {s}"))))
            .unwrap_or(default)
    };
    let (n, segments, reps) = (arg(1, 4096), arg(2, 16), arg(3, 30) as usize);
    if n == 0 || n % 128 != 0 || n > 4096 || segments == 0 || reps == 0 {
        fail("N must be a multiple of 128 up to 4096 (every row's words live in registers), SEGMENTS and REPS at least 1");
    }
    let gpu = Gpu::new();
    let (rows, cols, groups) = (n, n, n / 8);
    let weight_bytes = 2 * (rows as u64) * (cols as u64) * (segments as u64);
    if weight_bytes > gpu.max_binding {
        fail(&format!(
            "{segments} products of {n} x {n} F16 take {} MiB, more than this device binds at once ({} MiB): fewer SEGMENTS",
            weight_bytes >> 20,
            gpu.max_binding >> 20
        ));
    }

    // Weights in [-1, 1) from a small LCG, one N x N matrix per segment.
    let mut state = 12345u32;
    let halves: Vec<u16> = (0..weight_bytes / 2)
        .map(|_| {
            state = state.wrapping_mul(1664525).wrapping_add(1013904223);
            f16_bits((state >> 8) as f32 / (1u32 << 23) as f32 - 1.0)
        })
        .collect();
    let storage = wgpu::BufferUsages::STORAGE;
    let w = gpu.buffer_with(bytemuck::cast_slice(&halves), storage);
    drop(halves);
    let x0: Vec<f32> = (0..2 * cols).map(|i| if i < cols { ((i * 7 % 13) as f32 - 6.0) / 6.0 } else { 0.0 }).collect();
    let copy = wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC;
    let xy = gpu.buffer_with(bytemuck::cast_slice(&x0), storage | copy);
    // Tickets, one done count per segment, the gave-up flag.
    let counter_bytes = 4 * (segments as u64 + 2);
    let counters = gpu.buffer(counter_bytes, storage | copy);
    // The independent mode's: every segment its own x, y and counters (no hazards, no barriers).
    let own: Vec<_> = (0..segments)
        .map(|_| (gpu.buffer_with(bytemuck::cast_slice(&x0), storage), gpu.buffer(counter_bytes, storage)))
        .collect();
    let cfgs: Vec<_> = (0..segments)
        .map(|s| gpu.buffer_with(bytemuck::cast_slice(&[rows, cols, groups, s]), wgpu::BufferUsages::UNIFORM))
        .collect();

    let bytes = rows as f64 * cols as f64 * 2.0;
    println!(
        "{}: {segments} products of {n} x {n} F16 ({:.1} MB each), {reps} repetitions, GPU time per product (median of the repetitions)",
        gpu.name,
        bytes / 1e6
    );
    let mut outputs: HashMap<&str, Vec<u8>> = HashMap::new();
    for mode in MODES {
        let pipeline = gpu.pipeline(&kernel_source(mode, n, gpu.subgroups_of_32));
        let layout = pipeline.get_bind_group_layout(0);
        let groups_of: Vec<_> = (0..segments as usize)
            .map(|s| {
                let (x, c) = if mode == Mode::Independent { (&own[s].0, &own[s].1) } else { (&xy, &counters) };
                gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
                    label: None,
                    layout: &layout,
                    entries: &[
                        wgpu::BindGroupEntry { binding: 0, resource: cfgs[s].as_entire_binding() },
                        wgpu::BindGroupEntry { binding: 1, resource: w.as_entire_binding() },
                        wgpu::BindGroupEntry { binding: 2, resource: x.as_entire_binding() },
                        wgpu::BindGroupEntry { binding: 3, resource: c.as_entire_binding() },
                    ],
                })
            })
            .collect();
        let mut times = Vec::new();
        let mut gave_up = false;
        for rep in 0..reps + 2 {
            gpu.queue.write_buffer(&xy, 0, bytemuck::cast_slice(&x0));
            let mut enc = gpu.device.create_command_encoder(&Default::default());
            enc.clear_buffer(&counters, 0, None);
            {
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: None,
                    timestamp_writes: Some(gpu.pass_timestamps()),
                });
                pass.set_pipeline(&pipeline);
                if mode.chained() {
                    pass.set_bind_group(0, &groups_of[0], &[]);
                    pass.dispatch_workgroups(groups * segments, 1, 1);
                } else {
                    for g in &groups_of {
                        pass.set_bind_group(0, g, &[]);
                        pass.dispatch_workgroups(groups, 1, 1);
                    }
                }
            }
            let (us, out, ctr) = gpu.finish(enc, &xy, &counters);
            gave_up |= ctr[ctr.len() - 4..] != [0; 4];
            // Two warm-up runs.
            if rep >= 2 {
                times.push(us);
            }
            if rep == reps + 1 && mode != Mode::Independent {
                outputs.insert(mode.name(), out);
            }
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2] / segments as f64;
        let check = match (outputs.get(mode.name()), outputs.get(Mode::Dependent.name())) {
            _ if gave_up => "  A WAIT GAVE UP: results wrong".to_string(),
            (Some(a), Some(b)) if mode.chained() => {
                let (a, b): (&[f32], &[f32]) = (bytemuck::cast_slice(a), bytemuck::cast_slice(b));
                match a.iter().zip(b).filter(|(p, q)| p.to_bits() != q.to_bits()).count() {
                    0 => "  (= dependent)".to_string(),
                    bad => format!("  {bad} of {} values differ from dependent's: stale reads", a.len()),
                }
            }
            _ => String::new(),
        };
        println!("{:>14}: {median:7.2} us per product, {:5.2} TB/s{check}", mode.name(), bytes / median / 1e6);
    }
}

/// The kernel of `mode` for N x N products (see product.wgsl).
fn kernel_source(mode: Mode, n: u32, subgroups_of_32: bool) -> String {
    let (mut loads, mut dots) = (String::new(), String::new());
    for j in 0..n / 128 {
        loads += &format!("    let w{j} = w[wb + lane + {}u];\n", 32 * j);
        dots += &format!("    acc += dot(f16x4(w{j}), xs[lane + {}u]);\n", 32 * j);
    }
    let flag = |b: bool| if b { "true" } else { "false" };
    include_str!("product.wgsl")
        .replace("{{LOADS}}", &loads)
        .replace("{{DOTS}}", &dots)
        .replace("{{N4}}", &format!("{}u", n / 4))
        .replace("{{CHAIN}}", flag(mode.chained()))
        .replace("{{COHERENT}}", if mode == Mode::ChainedL1 { "" } else { "@coherent" })
        .replace("{{ROW_SUM}}", if subgroups_of_32 { "subgroupAdd(acc)" } else { "row_sum(acc, lid)" })
}

struct Gpu {
    device: wgpu::Device,
    queue: wgpu::Queue,
    name: String,
    /// The largest storage binding (and buffer) this device was opened with, in bytes.
    max_binding: u64,
    subgroups_of_32: bool,
    queries: wgpu::QuerySet,
    resolved: wgpu::Buffer,
}

impl Gpu {
    fn new() -> Gpu {
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
            backends: wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12,
            ..wgpu::InstanceDescriptor::new_without_display_handle()
        });
        let adapter = pollster::block_on(instance.request_adapter(&wgpu::RequestAdapterOptions {
            power_preference: wgpu::PowerPreference::HighPerformance,
            ..Default::default()
        }))
        .unwrap_or_else(|e| fail(&format!("no GPU adapter: {e}")));
        let needed =
            wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::SUBGROUP | wgpu::Features::MEMORY_DECORATION_COHERENT;
        if !adapter.features().contains(needed) {
            fail(&format!("{} lacks {:?}", adapter.get_info().name, needed - adapter.features()));
        }
        let limits = wgpu::Limits {
            max_storage_buffer_binding_size: adapter.limits().max_storage_buffer_binding_size,
            max_buffer_size: adapter.limits().max_buffer_size,
            ..Default::default()
        };
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            required_features: needed,
            required_limits: limits.clone(),
            ..Default::default()
        }))
        .unwrap_or_else(|e| fail(&format!("could not open the device: {e}")));
        let queries = device.create_query_set(&wgpu::QuerySetDescriptor {
            label: None,
            ty: wgpu::QueryType::Timestamp,
            count: 2,
        });
        let resolved = device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: 16,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let info = adapter.get_info();
        Gpu {
            name: format!("{} ({:?})", info.name, info.backend),
            max_binding: limits.max_storage_buffer_binding_size.min(limits.max_buffer_size),
            subgroups_of_32: info.subgroup_min_size >= 32,
            device,
            queue,
            queries,
            resolved,
        }
    }

    fn buffer(&self, size: u64, usage: wgpu::BufferUsages) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor { label: None, size, usage, mapped_at_creation: false })
    }

    fn buffer_with(&self, contents: &[u8], usage: wgpu::BufferUsages) -> wgpu::Buffer {
        self.device.create_buffer_init(&wgpu::util::BufferInitDescriptor { label: None, contents, usage })
    }

    fn pipeline(&self, source: &str) -> wgpu::ComputePipeline {
        let desc = wgpu::ShaderModuleDescriptor { label: None, source: wgpu::ShaderSource::Wgsl(source.into()) };
        // SAFETY: the kernel's only data-dependent loop (the wait) has its own bound.
        let module = unsafe { self.device.create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked()) };
        self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: None,
            layout: None,
            module: &module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        })
    }

    fn pass_timestamps(&self) -> wgpu::ComputePassTimestampWrites<'_> {
        wgpu::ComputePassTimestampWrites {
            query_set: &self.queries,
            beginning_of_pass_write_index: Some(0),
            end_of_pass_write_index: Some(1),
        }
    }

    /// Submits `enc` with the pass's timestamps resolved; returns the pass's GPU time in µs
    /// and the contents of `xy` and `counters` after it.
    fn finish(
        &self,
        mut enc: wgpu::CommandEncoder,
        xy: &wgpu::Buffer,
        counters: &wgpu::Buffer,
    ) -> (f64, Vec<u8>, Vec<u8>) {
        let read = |size| self.buffer(size, wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST);
        let (ts, out, ctr) = (read(16), read(xy.size()), read(counters.size()));
        enc.resolve_query_set(&self.queries, 0..2, &self.resolved, 0);
        enc.copy_buffer_to_buffer(&self.resolved, 0, &ts, 0, 16);
        enc.copy_buffer_to_buffer(xy, 0, &out, 0, xy.size());
        enc.copy_buffer_to_buffer(counters, 0, &ctr, 0, counters.size());
        self.queue.submit([enc.finish()]);
        let bytes = |b: &wgpu::Buffer| {
            b.slice(..)
                .map_async(wgpu::MapMode::Read, |r| r.unwrap_or_else(|e| fail(&format!("read-back failed: {e}"))));
            self.device
                .poll(wgpu::PollType::wait_indefinitely())
                .unwrap_or_else(|e| fail(&format!("device lost: {e}")));
            let v = b.slice(..).get_mapped_range().unwrap_or_else(|e| fail(&format!("read-back failed: {e}"))).to_vec();
            b.unmap();
            v
        };
        let t = bytes(&ts);
        let tick = |i: usize| u64::from_le_bytes(t[8 * i..8 * i + 8].try_into().unwrap());
        let us = tick(1).saturating_sub(tick(0)) as f64 * self.queue.get_timestamp_period() as f64 / 1e3;
        (us, bytes(&out), bytes(&ctr))
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("dependency-cost: {msg}");
    std::process::exit(1)
}

/// f32 -> f16 bits, truncating (the weights only need to be some f16 values).
fn f16_bits(f: f32) -> u16 {
    let b = f.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let e = ((b >> 23) & 0xff) as i32 - 127 + 15;
    match e {
        ..=0 => sign,
        31.. => sign | 0x7c00,
        _ => sign | ((e as u16) << 10) | ((b >> 13) & 0x3ff) as u16,
    }
}
