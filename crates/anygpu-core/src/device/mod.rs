//! Devices: discovery, selection, capability profiles, and the `Device` handle tensors live on.

pub mod discovery;
pub mod profile;
pub mod select;

use std::sync::Arc;

pub use discovery::{AdapterEntry, DeviceInfo};
pub use profile::Capabilities;
pub use select::{DeviceRequest, Discovery, SelectOptions};

use crate::backend::{cpu::CpuBackend, Backend};
use crate::error::Result;
use crate::gpu::GpuContext;

/// Where a tensor lives and its ops run.
#[derive(Clone)]
pub enum Device {
    /// The CPU backend: the reference every kernel is checked against, and the fallback.
    Cpu,
    Gpu(Arc<GpuContext>),
}

impl Device {
    /// Selects a device by the rules in the README (override, best hardware GPU, CPU).
    pub fn select(opts: SelectOptions) -> Result<Device> {
        Discovery::run_to_open(opts)?.open_selected()
    }

    /// Opens a GPU device on a discovered adapter.
    pub fn open_adapter(entry: &AdapterEntry, webgpu_defaults: bool) -> Result<Device> {
        Ok(Device::Gpu(Arc::new(GpuContext::open(entry, webgpu_defaults)?)))
    }

    pub fn backend(&self) -> &dyn Backend {
        match self {
            Device::Cpu => &CpuBackend,
            Device::Gpu(ctx) => ctx.as_ref(),
        }
    }

    pub fn is_cpu(&self) -> bool {
        matches!(self, Device::Cpu)
    }

    pub fn gpu(&self) -> Option<&Arc<GpuContext>> {
        match self {
            Device::Gpu(c) => Some(c),
            Device::Cpu => None,
        }
    }

    /// A short name for logs and test output, e.g. `vulkan:llvmpipe (LLVM 15.0.6, 256 bits)`.
    pub fn name(&self) -> String {
        match self {
            Device::Cpu => "cpu".to_string(),
            Device::Gpu(c) => format!(
                "{}:{}{}",
                c.info.backend,
                c.info.name,
                if c.caps.constrained { " [webgpu-default limits]" } else { "" }
            ),
        }
    }

    pub fn same(&self, other: &Device) -> bool {
        match (self, other) {
            (Device::Cpu, Device::Cpu) => true,
            (Device::Gpu(a), Device::Gpu(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    /// Waits until all queued GPU work has finished (no-op on the CPU).
    pub fn sync(&self) -> Result<()> {
        match self {
            Device::Cpu => Ok(()),
            Device::Gpu(c) => c.sync(),
        }
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}
