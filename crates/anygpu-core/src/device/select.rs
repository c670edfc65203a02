//! Device selection: an explicit override first, else the best hardware GPU, else the CPU
//! backend. A software rasterizer is never chosen unless asked for by index or name.

use super::discovery::{self, AdapterEntry, DeviceInfo};
use crate::error::{Error, Result};

/// What the user asked for with `--device` / `ANYGPU_DEVICE`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceRequest {
    Auto,
    Cpu,
    Index(usize),
    /// A case-insensitive substring of the adapter name.
    Name(String),
}

impl DeviceRequest {
    pub fn parse(s: &str) -> DeviceRequest {
        let s = s.trim();
        if s.is_empty() || s.eq_ignore_ascii_case("auto") {
            DeviceRequest::Auto
        } else if s.eq_ignore_ascii_case("cpu") {
            DeviceRequest::Cpu
        } else if let Ok(i) = s.parse::<usize>() {
            DeviceRequest::Index(i)
        } else {
            DeviceRequest::Name(s.to_string())
        }
    }
}

/// The whole selection input: `--device`/`ANYGPU_DEVICE`, `ANYGPU_BACKEND`, `ANYGPU_PROFILE`.
#[derive(Clone, Debug)]
pub struct SelectOptions {
    pub device: DeviceRequest,
    /// vulkan, metal, dx12, gl or cpu: only adapters of this backend are candidates.
    pub backend: Option<String>,
    /// Clamp the device to WebGPU's default limits and no optional features.
    pub webgpu_defaults: bool,
}

impl SelectOptions {
    /// The options the environment gives (`ANYGPU_DEVICE`, `ANYGPU_BACKEND`,
    /// `ANYGPU_PROFILE=webgpu`); `device` overrides `ANYGPU_DEVICE` when given.
    pub fn from_env(device: Option<&str>) -> SelectOptions {
        let env_device = std::env::var("ANYGPU_DEVICE").ok();
        let device = device.map(str::to_string).or(env_device);
        SelectOptions {
            device: device.as_deref().map(DeviceRequest::parse).unwrap_or(DeviceRequest::Auto),
            backend: std::env::var("ANYGPU_BACKEND")
                .ok()
                .filter(|b| !b.trim().is_empty())
                .map(|b| b.trim().to_lowercase()),
            webgpu_defaults: std::env::var("ANYGPU_PROFILE").map(|p| p.eq_ignore_ascii_case("webgpu")).unwrap_or(false),
        }
    }
}

const BACKENDS: [&str; 5] = ["vulkan", "metal", "dx12", "gl", "cpu"];

/// A higher score is a better automatic choice; None means never chosen automatically.
fn auto_score(e: &AdapterEntry) -> Option<u64> {
    if e.info.software {
        return None;
    }
    let kind = match e.info.device_type.as_str() {
        "discrete" => 3,
        "integrated" => 2,
        "virtual" => 1,
        _ => 0,
    };
    // GL has no subgroups, no f16 storage and weak compute drivers: a last resort.
    let backend = match e.info.backend.as_str() {
        "vulkan" | "metal" | "dx12" => 1,
        _ => 0,
    };
    let c = &e.caps;
    let features = c.shader_f16 as u64 + c.subgroup as u64 + c.cooperative_matrix as u64;
    Some(kind << 40 | backend << 36 | features << 32 | (c.max_storage_buffer_binding_size >> 20).min(0xffff_ffff))
}

/// Picks a row: Ok(Some(i)) for adapter i, Ok(None) for the CPU backend. Also fills every row's
/// `selected` and `note`.
pub fn select(entries: &[AdapterEntry], rows: &mut [DeviceInfo], opts: &SelectOptions) -> Result<Option<usize>> {
    let cpu_index = entries.len();
    if let Some(b) = &opts.backend {
        if !BACKENDS.contains(&b.as_str()) {
            return Err(Error::Device(format!(
                "ANYGPU_BACKEND={b} is not a backend; use one of {}",
                BACKENDS.join(", ")
            )));
        }
    }
    let backend_ok = |e: &AdapterEntry| opts.backend.as_deref().is_none_or(|b| e.info.backend == b);
    let choice: Option<usize> = match &opts.device {
        DeviceRequest::Cpu => None,
        DeviceRequest::Index(i) if *i == cpu_index => None,
        DeviceRequest::Index(i) if *i < entries.len() => Some(*i),
        DeviceRequest::Index(i) => {
            return Err(Error::Device(format!(
                "--device {i}: no such device (valid indices are 0..={cpu_index}).\n{}",
                list_rows(rows)
            )))
        }
        DeviceRequest::Name(n) => {
            let needle = n.to_lowercase();
            let found = entries.iter().position(|e| backend_ok(e) && e.info.name.to_lowercase().contains(&needle));
            match found {
                Some(i) => Some(i),
                None => {
                    return Err(Error::Device(format!(
                        "--device {n:?}: no device name contains {n:?}{}.\n{}",
                        opts.backend.as_ref().map(|b| format!(" on backend {b}")).unwrap_or_default(),
                        list_rows(rows)
                    )))
                }
            }
        }
        DeviceRequest::Auto if opts.backend.as_deref() == Some("cpu") => None,
        DeviceRequest::Auto => {
            let best = entries
                .iter()
                .enumerate()
                .filter(|(_, e)| backend_ok(e))
                .filter_map(|(i, e)| auto_score(e).map(|s| (s, std::cmp::Reverse(i))))
                .max();
            match best {
                Some((_, std::cmp::Reverse(i))) => Some(i),
                None if opts.backend.is_some() && !entries.iter().any(&backend_ok) => {
                    return Err(Error::Device(format!(
                        "ANYGPU_BACKEND={}: no adapter on that backend.\n{}",
                        opts.backend.as_deref().unwrap_or_default(),
                        list_rows(rows)
                    )))
                }
                None => None,
            }
        }
    };
    let why_explicit = match &opts.device {
        DeviceRequest::Auto => None,
        _ => Some("selected: requested with --device/ANYGPU_DEVICE"),
    };
    for (i, row) in rows.iter_mut().enumerate() {
        let is_choice = choice == Some(i) || (choice.is_none() && i == cpu_index);
        row.selected = is_choice;
        row.note = if is_choice {
            match (why_explicit, i == cpu_index) {
                (Some(w), _) => w.to_string(),
                (None, true) if entries.is_empty() => "selected: no GPU adapter was found".into(),
                (None, true) => {
                    "selected: no hardware GPU adapter was found (software adapters are never auto-selected)".into()
                }
                (None, false) => "selected: best hardware GPU (type, backend, features)".into(),
            }
        } else if i < entries.len() && entries[i].info.software {
            "software rasterizer: slower than the CPU backend; force with --device".into()
        } else if i < entries.len() && !backend_ok(&entries[i]) {
            "excluded by ANYGPU_BACKEND".into()
        } else {
            String::new()
        };
    }
    Ok(choice)
}

/// The device table as plain text, for error messages.
pub fn list_rows(rows: &[DeviceInfo]) -> String {
    let mut s = String::from("Available devices:");
    for r in rows {
        s.push_str(&format!(
            "\n  [{}] {} ({}, {}{})",
            r.index,
            r.name,
            r.backend,
            r.device_type,
            if r.software { ", software" } else { "" }
        ));
    }
    s
}

/// Discovers every adapter and the CPU row, and applies the selection.
pub struct Discovery {
    pub instance: wgpu::Instance,
    pub entries: Vec<AdapterEntry>,
    pub rows: Vec<DeviceInfo>,
    /// Index into `entries`, or None for the CPU backend.
    pub selected: Option<usize>,
    pub options: SelectOptions,
}

impl Discovery {
    pub fn run(opts: SelectOptions) -> Result<Discovery> {
        let instance = discovery::instance();
        let entries = discovery::enumerate(&instance);
        Self::select_from(instance, entries, opts)
    }

    /// Discovery for opening a device rather than listing them: with no device or backend
    /// asked for, the primary backends (Vulkan, Metal, DX12) are looked at first, and GL only
    /// when they have no hardware adapter (GL is the automatic choice's last resort anyway).
    /// Starting GL (EGL and its driver libraries) cost 0.2-0.4 s of a cold start on the NVIDIA
    /// machine, on the way to an LLM's first token. The rows then list the primary adapters
    /// only; `anygpu devices` uses [`Discovery::run`].
    pub fn run_to_open(opts: SelectOptions) -> Result<Discovery> {
        if opts.device == DeviceRequest::Auto && opts.backend.is_none() {
            let instance = discovery::instance_with(wgpu::Backends::PRIMARY);
            let entries = discovery::enumerate(&instance);
            if entries.iter().any(|e| auto_score(e).is_some()) {
                return Self::select_from(instance, entries, opts);
            }
        }
        Self::run(opts)
    }

    fn select_from(instance: wgpu::Instance, entries: Vec<AdapterEntry>, opts: SelectOptions) -> Result<Discovery> {
        let mut rows: Vec<DeviceInfo> = entries.iter().map(|e| e.info.clone()).collect();
        rows.push(discovery::cpu_row(entries.len()));
        let selected = select(&entries, &mut rows, &opts)?;
        Ok(Discovery { instance, entries, rows, selected, options: opts })
    }

    /// Opens the selected device (the CPU backend, or a GPU device with its real limits or the
    /// WebGPU-default profile).
    pub fn open_selected(&self) -> Result<super::Device> {
        match self.selected {
            None => Ok(super::Device::Cpu),
            Some(i) => super::Device::open_adapter(&self.entries[i], self.options.webgpu_defaults),
        }
    }
}
