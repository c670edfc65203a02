//! Kernels and the pipeline cache. A kernel is a WGSL source (one file per op family,
//! embedded with `include_str!`), an entry point, and a specialisation: constants prepended
//! to the source. Pipelines are built lazily, once per (kernel, specialisation).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// A kernel to dispatch: which WGSL, which entry point, which specialisation.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KernelSpec {
    /// A name for cache keys and error messages, e.g. `binary_add`.
    pub name: String,
    pub source: &'static str,
    pub entry: &'static str,
    /// WGSL text prepended to the source: `const` values, `enable f16;`, aliases.
    pub header: String,
}

impl KernelSpec {
    pub fn new(name: impl Into<String>, source: &'static str, entry: &'static str) -> KernelSpec {
        KernelSpec { name: name.into(), source, entry, header: String::new() }
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
}

impl PipelineKey {
    pub fn new(spec: &KernelSpec, replacements: &[(&str, &str)]) -> PipelineKey {
        PipelineKey {
            source: (spec.source.as_ptr() as usize, spec.source.len()),
            entry: spec.entry,
            name: spec.name.clone(),
            header: spec.header.clone(),
            replacements: replacements.iter().map(|(k, v)| format!("{k}={v};")).collect(),
        }
    }
}

#[derive(Default)]
pub struct PipelineCache {
    pipelines: Mutex<HashMap<PipelineKey, Arc<wgpu::ComputePipeline>>>,
}

impl PipelineCache {
    pub fn get(&self, key: &PipelineKey) -> Option<Arc<wgpu::ComputePipeline>> {
        self.pipelines.lock().ok()?.get(key).cloned()
    }
    pub fn insert(&self, key: PipelineKey, p: Arc<wgpu::ComputePipeline>) {
        if let Ok(mut m) = self.pipelines.lock() {
            m.insert(key, p);
        }
    }
    pub fn len(&self) -> usize {
        self.pipelines.lock().map(|m| m.len()).unwrap_or(0)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
