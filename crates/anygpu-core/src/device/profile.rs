//! The capability profile: the one place kernels look to decide which path they may take.

use serde::Serialize;

/// What the device offers that kernels care about. Built from the adapter's real features and
/// limits, or constrained to WebGPU's defaults to mimic mobile/browser users.
#[derive(Clone, Debug, Serialize)]
pub struct Capabilities {
    pub shader_f16: bool,
    pub subgroup: bool,
    pub subgroup_min_size: u32,
    pub subgroup_max_size: u32,
    pub cooperative_matrix: bool,
    /// Cooperative matrix shapes usable with f16 inputs and f32 accumulators, as (M, N, K).
    pub coop_f16_f32_shapes: Vec<(u32, u32, u32)>,
    pub timestamp_query: bool,
    pub max_buffer_size: u64,
    pub max_storage_buffer_binding_size: u64,
    pub max_compute_workgroup_storage_size: u32,
    pub max_compute_invocations_per_workgroup: u32,
    pub max_compute_workgroup_size_x: u32,
    pub max_compute_workgroups_per_dimension: u32,
    pub max_storage_buffers_per_shader_stage: u32,
    /// True when this profile was clamped to WebGPU's default limits.
    pub constrained: bool,
}

impl Capabilities {
    /// Why the 256-invocation cooperative-matrix kernels (the f16 matmul, the quantized
    /// prefill) cannot run here with `workgroup_bytes` of workgroup memory, or None when they
    /// can: 16x16x16 f16 x f16 -> f32 matrices, f16 shaders, subgroups of exactly 32.
    pub fn coop_f16_unsupported(&self, workgroup_bytes: u32) -> Option<String> {
        Some(if !self.cooperative_matrix {
            "the device has no cooperative matrices (EXPERIMENTAL_COOPERATIVE_MATRIX)".to_string()
        } else if !self.coop_f16_f32_shapes.contains(&(16, 16, 16)) {
            "the device has no 16x16x16 f16 x f16 -> f32 cooperative-matrix shape".to_string()
        } else if !self.shader_f16 {
            "the device has no f16 shaders (SHADER_F16)".to_string()
        } else if !self.subgroup || self.subgroup_min_size != 32 || self.subgroup_max_size != 32 {
            format!(
                "it needs subgroups of exactly 32 invocations (the device's: {}..{})",
                self.subgroup_min_size, self.subgroup_max_size
            )
        } else if self.max_compute_invocations_per_workgroup < 256 {
            format!(
                "it needs 256 invocations per workgroup (the device: {})",
                self.max_compute_invocations_per_workgroup
            )
        } else if self.max_compute_workgroup_storage_size < workgroup_bytes {
            format!(
                "it needs {workgroup_bytes} bytes of workgroup memory (the device: {})",
                self.max_compute_workgroup_storage_size
            )
        } else {
            return None;
        })
    }

    /// WebGPU's default limits with no optional features: what an Adreno phone, a browser, or
    /// an old integrated GPU gives. Kernels must work under it.
    pub fn webgpu_defaults() -> Capabilities {
        let l = wgpu::Limits::default();
        Capabilities {
            shader_f16: false,
            subgroup: false,
            subgroup_min_size: 0,
            subgroup_max_size: 0,
            cooperative_matrix: false,
            coop_f16_f32_shapes: vec![],
            timestamp_query: false,
            max_buffer_size: l.max_buffer_size,
            max_storage_buffer_binding_size: l.max_storage_buffer_binding_size,
            max_compute_workgroup_storage_size: l.max_compute_workgroup_storage_size,
            max_compute_invocations_per_workgroup: l.max_compute_invocations_per_workgroup,
            max_compute_workgroup_size_x: l.max_compute_workgroup_size_x,
            max_compute_workgroups_per_dimension: l.max_compute_workgroups_per_dimension,
            max_storage_buffers_per_shader_stage: l.max_storage_buffers_per_shader_stage,
            constrained: true,
        }
    }

    /// The profile of an adapter, from its features and limits.
    pub fn from_adapter(adapter: &wgpu::Adapter) -> Capabilities {
        let f = adapter.features();
        let l = adapter.limits();
        let info = adapter.get_info();
        let coop = f.contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX);
        let coop_f16_f32_shapes = if coop {
            adapter
                .cooperative_matrix_properties()
                .iter()
                .filter(|p| {
                    p.ab_type == wgpu::CooperativeScalarType::F16 && p.cr_type == wgpu::CooperativeScalarType::F32
                })
                .map(|p| (p.m_size, p.n_size, p.k_size))
                .collect()
        } else {
            vec![]
        };
        Capabilities {
            shader_f16: f.contains(wgpu::Features::SHADER_F16),
            subgroup: f.contains(wgpu::Features::SUBGROUP),
            subgroup_min_size: info.subgroup_min_size,
            subgroup_max_size: info.subgroup_max_size,
            cooperative_matrix: coop,
            coop_f16_f32_shapes,
            timestamp_query: f.contains(wgpu::Features::TIMESTAMP_QUERY),
            max_buffer_size: l.max_buffer_size,
            max_storage_buffer_binding_size: l.max_storage_buffer_binding_size,
            max_compute_workgroup_storage_size: l.max_compute_workgroup_storage_size,
            max_compute_invocations_per_workgroup: l.max_compute_invocations_per_workgroup,
            max_compute_workgroup_size_x: l.max_compute_workgroup_size_x,
            max_compute_workgroups_per_dimension: l.max_compute_workgroups_per_dimension,
            max_storage_buffers_per_shader_stage: l.max_storage_buffers_per_shader_stage,
            constrained: false,
        }
    }

    /// The features to request from the device for this profile.
    pub fn wgpu_features(&self) -> wgpu::Features {
        let mut f = wgpu::Features::empty();
        if self.shader_f16 {
            f |= wgpu::Features::SHADER_F16;
        }
        if self.subgroup {
            f |= wgpu::Features::SUBGROUP;
        }
        if self.cooperative_matrix {
            f |= wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
        }
        if self.timestamp_query {
            f |= wgpu::Features::TIMESTAMP_QUERY;
        }
        f
    }

    /// The limits to request: the adapter's real ones (wgpu's defaults are far lower than most
    /// hardware offers), clamped when this profile is constrained.
    pub fn wgpu_limits(&self, adapter_limits: &wgpu::Limits) -> wgpu::Limits {
        if self.constrained {
            return wgpu::Limits::default();
        }
        adapter_limits.clone()
    }

    /// Clamp a real profile down to WebGPU's defaults (features off, limits lowered).
    pub fn constrain(&self) -> Capabilities {
        let mut c = Capabilities::webgpu_defaults();
        c.max_buffer_size = c.max_buffer_size.min(self.max_buffer_size);
        c.max_storage_buffer_binding_size = c.max_storage_buffer_binding_size.min(self.max_storage_buffer_binding_size);
        c
    }

    /// Workgroups per dispatch dimension this device accepts.
    pub fn max_workgroups(&self) -> u32 {
        self.max_compute_workgroups_per_dimension.max(1)
    }
}
