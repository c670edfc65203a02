//! Kernels and the pipeline cache. A kernel is a WGSL source (one file per op family,
//! embedded with `include_str!`), an entry point, and a specialisation: constants prepended
//! to the source. Pipelines are built lazily, once per (kernel, specialisation), each on a
//! worker thread of its own where the backend allows (see [`Pipeline`]).

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};

use crate::error::{Error, Result};

/// A kernel to dispatch: which WGSL, which entry point, which specialisation.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KernelSpec {
    /// A name for cache keys and error messages, e.g. `binary_add`.
    pub name: String,
    pub source: &'static str,
    pub entry: &'static str,
    /// WGSL text prepended to the source: `const` values, `enable f16;`, aliases.
    pub header: String,
    /// Whether wgpu clamps this kernel's array indices (see [`KernelSpec::bounded_by_design`]).
    pub index_checks: bool,
}

impl KernelSpec {
    pub fn new(name: impl Into<String>, source: &'static str, entry: &'static str) -> KernelSpec {
        KernelSpec { name: name.into(), source, entry, header: String::new(), index_checks: true }
    }
    /// Compiles the kernel without wgpu's bounds checks on Vulkan, for kernels whose every
    /// workgroup and private array index is a tile offset that its own constants keep in range.
    ///
    /// With the checks, naga clamps each dynamic index into such an array (`min(i, len - 1)`),
    /// which the prefill's tensor-core kernels pay for in their staging and drains (H100, 8B
    /// Q4_0 pp512: the attention 3.92 -> 3.10 ms of a 60.9 ms prefill; 1B F16 pp512 ~41,000 ->
    /// ~44,000 tok/s, its attention -23% and gate|up product -6%: BENCHMARKS.md, twenty-third
    /// session). Only on Vulkan: there wgpu enables the driver's robust buffer access, so a
    /// storage read past a binding (which some kernels make and leave unused: common.wgsl's
    /// `u32_at`) stays inside the buffer without naga's clamp; on Metal, DX12 and GL naga's
    /// checks are the only guard, and stay. `ANYGPU_BOUNDS_CHECKS=1` keeps them for every kernel.
    pub fn bounded_by_design(mut self) -> KernelSpec {
        self.index_checks = false;
        self
    }
    /// Adds `const NAME: u32 = value;` to the header.
    pub fn constant_u32(mut self, name: &str, value: u32) -> KernelSpec {
        self.header.push_str(&format!("const {name}: u32 = {value}u;\n"));
        self
    }
    /// Adds raw WGSL to the header (an `enable` directive, an alias, a function).
    pub fn with(mut self, wgsl: &str) -> KernelSpec {
        self.header.push_str(wgsl);
        self.header.push('\n');
        self
    }
    /// Replaces `{{KEY}}` placeholders in the source; used for op expressions.
    pub fn source_text(&self, replacements: &[(&str, &str)]) -> String {
        // `enable` directives must come first in a WGSL module.
        let (enables, rest): (Vec<&str>, Vec<&str>) =
            self.header.lines().partition(|l| l.trim_start().starts_with("enable "));
        let mut src = format!("{}\n{}\n{}", enables.join("\n"), rest.join("\n"), self.source);
        for (k, v) in replacements {
            src = src.replace(&format!("{{{{{k}}}}}"), v);
        }
        src
    }
}

/// What identifies a compiled pipeline. The WGSL source is identified by its address (it is
/// a `&'static str` from `include_str!`): hashing kilobytes of text on every dispatch showed up
/// as a real cost of recording.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PipelineKey {
    source: (usize, usize),
    entry: &'static str,
    name: String,
    header: String,
    replacements: String,
    index_checks: bool,
}

impl PipelineKey {
    pub fn new(spec: &KernelSpec, replacements: &[(&str, &str)]) -> PipelineKey {
        PipelineKey {
            source: (spec.source.as_ptr() as usize, spec.source.len()),
            entry: spec.entry,
            name: spec.name.clone(),
            header: spec.header.clone(),
            replacements: replacements.iter().map(|(k, v)| format!("{k}={v};")).collect(),
            index_checks: spec.index_checks,
        }
    }
}

/// A compute pipeline that may still be compiling on a worker thread. A driver takes
/// 10-150 ms per kernel on a cold start (NVIDIA, SmolLM2's prefill: ten kernels, ~450 ms one
/// after another); dispatches of a kernel still compiling are encoded once it is ready (see
/// `GpuContext::dispatch`), so the kernels a graph needs compile side by side while the host
/// encodes the rest of it.
#[derive(Clone)]
pub struct Pipeline(Arc<Slot>);

/// A compiled kernel: the pipeline and its bind group layout, asked of wgpu once here rather
/// than for every dispatch.
#[derive(Clone)]
pub struct Compiled {
    pub pipeline: wgpu::ComputePipeline,
    pub layout: wgpu::BindGroupLayout,
}

struct Slot {
    name: String,
    state: Mutex<Option<std::result::Result<Compiled, String>>>,
    done: Condvar,
}

impl Pipeline {
    /// A pipeline whose compilation has not finished; [`Pipeline::finish`] completes it.
    pub(crate) fn compiling(name: &str) -> Pipeline {
        Pipeline(Arc::new(Slot { name: name.to_string(), state: Mutex::new(None), done: Condvar::new() }))
    }

    /// Sets the compile result (the first one counts) and wakes the waiters.
    pub(crate) fn finish(&self, r: std::result::Result<wgpu::ComputePipeline, String>) {
        let compiled = r.map(|pipeline| Compiled { layout: pipeline.get_bind_group_layout(0), pipeline });
        let mut st = self.0.state.lock().unwrap_or_else(|e| e.into_inner());
        if st.is_none() {
            *st = Some(compiled);
        }
        self.0.done.notify_all();
    }

    /// Whether compilation has finished (successfully or not): `get` will not block.
    pub fn is_ready(&self) -> bool {
        self.0.state.lock().map(|s| s.is_some()).unwrap_or(true)
    }

    /// The compiled pipeline, waiting for its compilation; a compile error names the kernel.
    pub fn get(&self) -> Result<Compiled> {
        let mut st = self.0.state.lock().unwrap_or_else(|e| e.into_inner());
        while st.is_none() {
            st = self.0.done.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        self.outcome(st.as_ref()).unwrap_or_else(|| unreachable!("waited above until set"))
    }

    /// [`Pipeline::get`] if compilation has finished, without waiting (one lock: the
    /// dispatch path asks this for every dispatch).
    pub fn try_get(&self) -> Option<Result<Compiled>> {
        let st = self.0.state.lock().unwrap_or_else(|e| e.into_inner());
        self.outcome(st.as_ref())
    }

    fn outcome(&self, state: Option<&std::result::Result<Compiled, String>>) -> Option<Result<Compiled>> {
        state.map(|r| match r {
            Ok(p) => Ok(p.clone()),
            Err(msg) => Err(Error::gpu(format!("compiling kernel {}", self.0.name), msg.clone())),
        })
    }

    pub fn name(&self) -> &str {
        &self.0.name
    }
}

/// Two handles are equal when they are the same cache entry (the same kernel and
/// specialisation on the same device).
impl PartialEq for Pipeline {
    fn eq(&self, other: &Pipeline) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

#[derive(Default)]
pub struct PipelineCache {
    pipelines: Mutex<HashMap<PipelineKey, Pipeline>>,
}

impl PipelineCache {
    /// The entry for `key`, and whether it was created by this call (the caller then compiles
    /// it and calls [`Pipeline::finish`]); one lookup, so a kernel is compiled once.
    pub fn get_or_create(&self, key: &PipelineKey, name: &str) -> (Pipeline, bool) {
        let mut m = self.pipelines.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = m.get(key) {
            return (p.clone(), false);
        }
        let p = Pipeline::compiling(name);
        m.insert(key.clone(), p.clone());
        (p, true)
    }
    /// The entry for `key` if there is one (compiled or compiling).
    pub fn get(&self, key: &PipelineKey) -> Option<Pipeline> {
        self.pipelines.lock().unwrap_or_else(|e| e.into_inner()).get(key).cloned()
    }
    pub fn len(&self) -> usize {
        self.pipelines.lock().map(|m| m.len()).unwrap_or(0)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
