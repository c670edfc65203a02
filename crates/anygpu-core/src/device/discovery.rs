//! Adapter discovery: every adapter on every backend compiled for this platform, translation
//! layers included, duplicates dropped, software rasterizers recognised.

use serde::Serialize;

use super::profile::Capabilities;

/// One row of `anygpu devices`: a GPU adapter, or the CPU backend.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceInfo {
    pub index: usize,
    pub name: String,
    /// vulkan, metal, dx12, gl, or cpu.
    pub backend: String,
    /// discrete, integrated, virtual, cpu (a software adapter), other; `cpu` for the CPU backend.
    pub device_type: String,
    pub driver: String,
    pub driver_info: String,
    pub vendor_id: u32,
    pub device_id: u32,
    /// A software rasterizer (llvmpipe/lavapipe, SwiftShader, WARP): never auto-selected.
    pub software: bool,
    pub selected: bool,
    /// Why this row was (or was not) the one selected.
    pub note: String,
    pub features: FeatureFlags,
    pub limits: LimitSummary,
}

#[derive(Clone, Debug, Serialize)]
pub struct FeatureFlags {
    pub shader_f16: bool,
    pub subgroup: bool,
    pub cooperative_matrix: bool,
    pub timestamp_query: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct LimitSummary {
    pub max_buffer_size: u64,
    pub max_storage_buffer_binding_size: u64,
    pub max_compute_workgroup_storage_size: u32,
    pub max_compute_invocations_per_workgroup: u32,
}

/// A discovered adapter with what we report about it.
pub struct AdapterEntry {
    pub adapter: wgpu::Adapter,
    pub info: DeviceInfo,
    pub caps: Capabilities,
}

/// Sets what the drivers read from the environment. Call it before starting threads that may
/// read the environment while devices are discovered (`instance` calls it too; it is cheap to
/// repeat).
pub fn prepare_environment() {
    // We never present to a window: EGL's surfaceless platform avoids Mesa probing Wayland/X11
    // (and printing errors about XDG_RUNTIME_DIR) on headless machines.
    #[cfg(target_os = "linux")]
    if std::env::var_os("EGL_PLATFORM").is_none() {
        // SAFETY: the first call comes before any thread of ours reads the environment.
        unsafe { std::env::set_var("EGL_PLATFORM", "surfaceless") };
    }
    // Mesa's implicit Vulkan layer VK_LAYER_MESA_device_select only reorders adapters to put the
    // display's GPU first (anygpu ranks adapters itself), and to find that display it connects
    // to Wayland: with no XDG_RUNTIME_DIR (headless machines, containers, CI) libwayland prints
    // "error: XDG_RUNTIME_DIR is invalid or not set" on every Vulkan start, which reads as ours.
    // Disabled then, the way the layer's manifest offers; a user's own setting wins.
    #[cfg(target_os = "linux")]
    if std::env::var_os("XDG_RUNTIME_DIR").is_none()
        && std::env::var_os("NODEVICE_SELECT").is_none()
        && std::env::var_os("MESA_VK_DEVICE_SELECT").is_none()
    {
        // SAFETY: as above.
        unsafe { std::env::set_var("NODEVICE_SELECT", "1") };
    }
}

/// The instance every anygpu device comes from. Non-compliant adapters are allowed on purpose:
/// Mesa Dozen (Vulkan on D3D12 under WSL2) is exactly such an adapter and often the only GPU a
/// WSL2 user has.
pub fn instance() -> wgpu::Instance {
    instance_with(wgpu::Backends::all() - wgpu::Backends::BROWSER_WEBGPU)
}

/// wgpu's `WGPU_BACKEND` (a comma list, replacing `default`), except that a value naming no
/// backend (empty, or misspelt) is ignored with a warning: wgpu would enable none, and every
/// run would silently fall back to the CPU backend.
pub fn backends_from_env(default: wgpu::Backends, env: Option<&str>) -> wgpu::Backends {
    let Some(v) = env else { return default };
    let named = wgpu::Backends::from_comma_list(v);
    if named.is_empty() {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            eprintln!(
                "anygpu: WGPU_BACKEND={v:?} names no backend (vulkan, metal, dx12, gl): ignored; \
                 ANYGPU_BACKEND chooses one"
            )
        });
        return default;
    }
    named
}

/// An instance of only `backends` (`WGPU_BACKEND` replaces them, see `backends_from_env`).
pub fn instance_with(backends: wgpu::Backends) -> wgpu::Instance {
    prepare_environment();
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = backends_from_env(backends, std::env::var("WGPU_BACKEND").ok().as_deref());
    desc.flags =
        (wgpu::InstanceFlags::default() | wgpu::InstanceFlags::ALLOW_UNDERLYING_NONCOMPLIANT_ADAPTER).with_env();
    wgpu::Instance::new(desc)
}

pub fn backend_name(b: wgpu::Backend) -> &'static str {
    match b {
        wgpu::Backend::Vulkan => "vulkan",
        wgpu::Backend::Metal => "metal",
        wgpu::Backend::Dx12 => "dx12",
        wgpu::Backend::Gl => "gl",
        wgpu::Backend::BrowserWebGpu => "webgpu",
        _ => "other",
    }
}

fn device_type_name(t: wgpu::DeviceType) -> &'static str {
    match t {
        wgpu::DeviceType::DiscreteGpu => "discrete",
        wgpu::DeviceType::IntegratedGpu => "integrated",
        wgpu::DeviceType::VirtualGpu => "virtual",
        wgpu::DeviceType::Cpu => "cpu",
        wgpu::DeviceType::Other => "other",
    }
}

/// Software rasterizers: correct but slower than our own CPU backend.
pub fn is_software(info: &wgpu::AdapterInfo) -> bool {
    let name = info.name.to_lowercase();
    info.device_type == wgpu::DeviceType::Cpu
        || ["llvmpipe", "lavapipe", "softpipe", "swiftshader", "microsoft basic render", "warp"]
            .iter()
            .any(|s| name.contains(s))
}

/// Every adapter on every compiled backend, one row per physical GPU and backend.
pub fn enumerate(instance: &wgpu::Instance) -> Vec<AdapterEntry> {
    let adapters = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()));
    let mut entries: Vec<AdapterEntry> = Vec::new();
    for adapter in adapters {
        let raw = adapter.get_info();
        // One GPU can be reported twice on a backend (two ICDs for one card); the pair
        // (backend, vendor, device, name, driver) identifies it.
        let duplicate = entries.iter().any(|e| {
            let o = e.adapter.get_info();
            o.backend == raw.backend
                && o.vendor == raw.vendor
                && o.device == raw.device
                && o.name == raw.name
                && o.driver == raw.driver
        });
        if duplicate {
            continue;
        }
        let caps = Capabilities::from_adapter(&adapter);
        let info = DeviceInfo {
            index: entries.len(),
            name: raw.name.clone(),
            backend: backend_name(raw.backend).to_string(),
            device_type: device_type_name(raw.device_type).to_string(),
            driver: raw.driver.clone(),
            driver_info: raw.driver_info.clone(),
            vendor_id: raw.vendor,
            device_id: raw.device,
            software: is_software(&raw),
            selected: false,
            note: String::new(),
            features: FeatureFlags {
                shader_f16: caps.shader_f16,
                subgroup: caps.subgroup,
                cooperative_matrix: caps.cooperative_matrix,
                timestamp_query: caps.timestamp_query,
            },
            limits: LimitSummary {
                max_buffer_size: caps.max_buffer_size,
                max_storage_buffer_binding_size: caps.max_storage_buffer_binding_size,
                max_compute_workgroup_storage_size: caps.max_compute_workgroup_storage_size,
                max_compute_invocations_per_workgroup: caps.max_compute_invocations_per_workgroup,
            },
        };
        entries.push(AdapterEntry { adapter, info, caps });
    }
    entries
}

/// The row that stands for the CPU backend (always present, always last).
pub fn cpu_row(index: usize) -> DeviceInfo {
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    DeviceInfo {
        index,
        name: format!("CPU ({threads} threads)"),
        backend: "cpu".into(),
        device_type: "cpu".into(),
        driver: "anygpu".into(),
        driver_info: format!("{} {}", std::env::consts::OS, std::env::consts::ARCH),
        vendor_id: 0,
        device_id: 0,
        software: false,
        selected: false,
        note: String::new(),
        features: FeatureFlags {
            shader_f16: false,
            subgroup: false,
            cooperative_matrix: false,
            timestamp_query: false,
        },
        limits: LimitSummary {
            max_buffer_size: u64::MAX,
            max_storage_buffer_binding_size: u64::MAX,
            max_compute_workgroup_storage_size: 0,
            max_compute_invocations_per_workgroup: 0,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::backends_from_env;
    use wgpu::Backends;

    #[test]
    fn wgpu_backend_naming_nothing_is_ignored() {
        let all = Backends::all();
        assert_eq!(backends_from_env(all, None), all);
        assert_eq!(backends_from_env(Backends::PRIMARY, Some("")), Backends::PRIMARY);
        assert_eq!(backends_from_env(all, Some("vulcan")), all);
        assert_eq!(backends_from_env(all, Some("vulkan")), Backends::VULKAN);
        assert_eq!(backends_from_env(Backends::PRIMARY, Some("gl, vulkan")), Backends::GL | Backends::VULKAN);
    }
}
