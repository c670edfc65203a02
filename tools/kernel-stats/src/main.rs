//! The driver's statistics of compiled kernels: register count, shared memory, ... as the
//! Vulkan driver reports them through VK_KHR_pipeline_executable_properties (NVIDIA's and
//! AMD's drivers do). Occupancy follows from the registers: an NVIDIA SM holds 65,536, so a
//! 256-invocation workgroup of more than 128 registers per invocation runs alone on its SM.
//!
//! Usage: run anygpu with `ANYGPU_DUMP_KERNELS=DIR`, then `kernel-stats DIR/*.wgsl`. Each file
//! (`<name>.<entry>.<hash>.wgsl`) is compiled to SPIR-V by naga with the options wgpu uses on
//! such a device (index bounds checks, buffers left to the robust-access hardware, no loop
//! bound and no zeroing of workgroup memory, as anygpu asks; no bounds checks at all for a
//! file whose first line says it was compiled without them), so the driver sees what it sees
//! under anygpu.

use std::ffi::{c_char, CStr};

use ash::vk;
use naga::back::spv;

fn main() {
    let files: Vec<String> = std::env::args().skip(1).collect();
    if files.is_empty() {
        eprintln!("usage: kernel-stats FILE.wgsl... (files written by ANYGPU_DUMP_KERNELS)");
        std::process::exit(2);
    }
    let vk = match Vulkan::new() {
        Ok(v) => v,
        Err(e) => {
            eprintln!("kernel-stats: {e}");
            std::process::exit(1);
        }
    };
    println!("device: {}", vk.name);
    let mut failed = false;
    for f in &files {
        match stats(&vk, f) {
            Ok(lines) => println!("{f}\n{lines}"),
            Err(e) => {
                failed = true;
                println!("{f}\n  error: {e}");
            }
        }
    }
    std::process::exit(failed as i32);
}

/// `<name>.<entry>.<hash>.wgsl` -> entry.
fn entry_of(path: &str) -> Result<String, String> {
    let base = std::path::Path::new(path).file_name().and_then(|b| b.to_str()).ok_or("bad file name")?;
    let parts: Vec<&str> = base.split('.').collect();
    if parts.len() < 4 {
        return Err(format!("{base}: not <name>.<entry>.<hash>.wgsl"));
    }
    Ok(parts[parts.len() - 3].to_string())
}

fn spirv(src: &str, entry: &str) -> Result<(Vec<u32>, naga::Module), String> {
    let module = naga::front::wgsl::parse_str(src).map_err(|e| e.emit_to_string(src))?;
    let info = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), naga::valid::Capabilities::all())
        .validate(&module)
        .map_err(|e| format!("{e:?}"))?;
    let mut options =
        spv::Options { lang_version: (1, 6), capabilities: None, force_loop_bounding: false, ..Default::default() };
    // A kernel anygpu compiles without bounds checks (gpu/context.rs, `dump_kernel`) gets
    // none here either.
    let checked = !src.starts_with("// anygpu: compiled without bounds checks");
    options.bounds_check_policies = naga::proc::BoundsCheckPolicies {
        index: if checked { naga::proc::BoundsCheckPolicy::Restrict } else { naga::proc::BoundsCheckPolicy::Unchecked },
        buffer: naga::proc::BoundsCheckPolicy::Unchecked,
        image_load: naga::proc::BoundsCheckPolicy::Unchecked,
        binding_array: naga::proc::BoundsCheckPolicy::Unchecked,
    };
    // anygpu turns wgpu's zeroing of workgroup memory off (gpu/context.rs).
    options.zero_initialize_workgroup_memory = spv::ZeroInitializeWorkgroupMemoryMode::None;
    let pipeline = spv::PipelineOptions { shader_stage: naga::ShaderStage::Compute, entry_point: entry.to_string() };
    let words = spv::write_vec(&module, &info, &options, Some(&pipeline)).map_err(|e| format!("{e}"))?;
    Ok((words, module))
}

struct Vulkan {
    _entry: ash::Entry,
    instance: ash::Instance,
    device: ash::Device,
    exec: ash::khr::pipeline_executable_properties::Device,
    name: String,
}

impl Vulkan {
    fn new() -> Result<Vulkan, String> {
        let entry = unsafe { ash::Entry::load() }.map_err(|e| format!("no Vulkan loader: {e}"))?;
        let app = vk::ApplicationInfo::default().api_version(vk::API_VERSION_1_3);
        let instance =
            unsafe { entry.create_instance(&vk::InstanceCreateInfo::default().application_info(&app), None) }
                .map_err(|e| format!("vkCreateInstance: {e}"))?;
        let phys = unsafe { instance.enumerate_physical_devices() }.map_err(|e| format!("{e}"))?;
        let pd = *phys
            .iter()
            .find(
                |&&p| unsafe { instance.get_physical_device_properties(p) }.device_type != vk::PhysicalDeviceType::CPU,
            )
            .or(phys.first())
            .ok_or("no Vulkan device")?;
        let props = unsafe { instance.get_physical_device_properties(pd) };
        let name = unsafe { CStr::from_ptr(props.device_name.as_ptr()) }.to_string_lossy().into_owned();
        let exts = unsafe { instance.enumerate_device_extension_properties(pd) }.map_err(|e| format!("{e}"))?;
        let has = |n: &CStr| exts.iter().any(|e| unsafe { CStr::from_ptr(e.extension_name.as_ptr()) } == n);
        if !has(ash::khr::pipeline_executable_properties::NAME) {
            return Err(format!("{name} has no VK_KHR_pipeline_executable_properties"));
        }
        let mut names: Vec<*const c_char> = vec![ash::khr::pipeline_executable_properties::NAME.as_ptr()];
        let coop = has(ash::khr::cooperative_matrix::NAME);
        if coop {
            names.push(ash::khr::cooperative_matrix::NAME.as_ptr());
        }
        // Every feature the device has, enabled (the kernels use f16, 16-bit storage,
        // subgroups, the memory model, cooperative matrices).
        let mut f11 = vk::PhysicalDeviceVulkan11Features::default();
        let mut f12 = vk::PhysicalDeviceVulkan12Features::default();
        let mut f13 = vk::PhysicalDeviceVulkan13Features::default();
        let mut fcoop = vk::PhysicalDeviceCooperativeMatrixFeaturesKHR::default();
        let mut fexec = vk::PhysicalDevicePipelineExecutablePropertiesFeaturesKHR::default();
        let mut f2 = vk::PhysicalDeviceFeatures2::default()
            .push_next(&mut f11)
            .push_next(&mut f12)
            .push_next(&mut f13)
            .push_next(&mut fexec);
        if coop {
            f2 = f2.push_next(&mut fcoop);
        }
        unsafe { instance.get_physical_device_features2(pd, &mut f2) };
        let queue_family = unsafe { instance.get_physical_device_queue_family_properties(pd) }
            .iter()
            .position(|q| q.queue_flags.contains(vk::QueueFlags::COMPUTE))
            .ok_or("no compute queue")? as u32;
        let prio = [1.0f32];
        let queues = [vk::DeviceQueueCreateInfo::default().queue_family_index(queue_family).queue_priorities(&prio)];
        let info = vk::DeviceCreateInfo::default()
            .queue_create_infos(&queues)
            .enabled_extension_names(&names)
            .push_next(&mut f2);
        let device = unsafe { instance.create_device(pd, &info, None) }.map_err(|e| format!("vkCreateDevice: {e}"))?;
        let exec = ash::khr::pipeline_executable_properties::Device::new(&instance, &device);
        Ok(Vulkan { _entry: entry, instance, device, exec, name })
    }
}

impl Drop for Vulkan {
    fn drop(&mut self) {
        unsafe {
            self.device.destroy_device(None);
            self.instance.destroy_instance(None);
        }
    }
}

/// The descriptor set layouts the module's resources need (uniform and storage buffers).
fn set_layouts(vk: &Vulkan, module: &naga::Module) -> Result<Vec<vk::DescriptorSetLayout>, String> {
    let mut groups: Vec<Vec<vk::DescriptorSetLayoutBinding>> = Vec::new();
    for (_, var) in module.global_variables.iter() {
        let Some(b) = &var.binding else { continue };
        let ty = match var.space {
            naga::AddressSpace::Uniform => vk::DescriptorType::UNIFORM_BUFFER,
            naga::AddressSpace::Storage { .. } => vk::DescriptorType::STORAGE_BUFFER,
            _ => return Err(format!("binding {}:{} of an unsupported kind", b.group, b.binding)),
        };
        let g = b.group as usize;
        if groups.len() <= g {
            groups.resize(g + 1, Vec::new());
        }
        groups[g].push(
            vk::DescriptorSetLayoutBinding::default()
                .binding(b.binding)
                .descriptor_type(ty)
                .descriptor_count(1)
                .stage_flags(vk::ShaderStageFlags::COMPUTE),
        );
    }
    groups
        .iter()
        .map(|bs| {
            unsafe {
                vk.device.create_descriptor_set_layout(&vk::DescriptorSetLayoutCreateInfo::default().bindings(bs), None)
            }
            .map_err(|e| format!("{e}"))
        })
        .collect()
}

fn stats(vk: &Vulkan, path: &str) -> Result<String, String> {
    let src = std::fs::read_to_string(path).map_err(|e| format!("{e}"))?;
    let entry = entry_of(path)?;
    let (words, module) = spirv(&src, &entry)?;
    let d = &vk.device;
    let shader = unsafe { d.create_shader_module(&vk::ShaderModuleCreateInfo::default().code(&words), None) }
        .map_err(|e| format!("vkCreateShaderModule: {e}"))?;
    let layouts = set_layouts(vk, &module)?;
    let layout =
        unsafe { d.create_pipeline_layout(&vk::PipelineLayoutCreateInfo::default().set_layouts(&layouts), None) }
            .map_err(|e| format!("{e}"))?;
    let cname = std::ffi::CString::new(entry.clone()).map_err(|e| format!("{e}"))?;
    let stage =
        vk::PipelineShaderStageCreateInfo::default().stage(vk::ShaderStageFlags::COMPUTE).module(shader).name(&cname);
    let info = [vk::ComputePipelineCreateInfo::default()
        .stage(stage)
        .layout(layout)
        .flags(vk::PipelineCreateFlags::CAPTURE_STATISTICS_KHR)];
    let pipeline = unsafe { d.create_compute_pipelines(vk::PipelineCache::null(), &info, None) }
        .map_err(|(_, e)| format!("vkCreateComputePipelines: {e}"))?[0];
    let mut out = String::new();
    let pinfo = vk::PipelineInfoKHR::default().pipeline(pipeline);
    let execs = unsafe { vk.exec.get_pipeline_executable_properties(&pinfo) }.map_err(|e| format!("{e}"))?;
    for (i, ex) in execs.iter().enumerate() {
        let ename = unsafe { CStr::from_ptr(ex.name.as_ptr()) }.to_string_lossy().into_owned();
        out.push_str(&format!("  executable {i} ({ename}, subgroup {})\n", ex.subgroup_size));
        let einfo = vk::PipelineExecutableInfoKHR::default().pipeline(pipeline).executable_index(i as u32);
        let st = unsafe { vk.exec.get_pipeline_executable_statistics(&einfo) }.map_err(|e| format!("{e}"))?;
        for s in &st {
            let sname = unsafe { CStr::from_ptr(s.name.as_ptr()) }.to_string_lossy();
            let v = unsafe {
                match s.format {
                    vk::PipelineExecutableStatisticFormatKHR::BOOL32 => format!("{}", s.value.b32 != 0),
                    vk::PipelineExecutableStatisticFormatKHR::INT64 => format!("{}", s.value.i64),
                    vk::PipelineExecutableStatisticFormatKHR::UINT64 => format!("{}", s.value.u64),
                    _ => format!("{}", s.value.f64),
                }
            };
            out.push_str(&format!("    {sname}: {v}\n"));
        }
    }
    unsafe {
        d.destroy_pipeline(pipeline, None);
        d.destroy_pipeline_layout(layout, None);
        for l in layouts {
            d.destroy_descriptor_set_layout(l, None);
        }
        d.destroy_shader_module(shader, None);
    }
    Ok(out)
}
