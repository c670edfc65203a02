//! Prefill on tensor cores: the cooperative-matrix kernel of the quantized matmul
//! (matmul_coop.wgsl; `QKernel::Coop`). `gpu::qmatmul_with` picks it for n > `MATVEC_MAX_N`
//! x rows where the device can run it, and binds and slices exactly as for the tiled kernel;
//! this module says whether it can run ([`unsupported_reason`]), chooses its tile (`Plan`),
//! builds its pipeline source and dispatches one row slice.
//!
//! # Numerics
//!
//! The products are f16 x f16 with f32 accumulation: x is rounded to f16 (clamped to ±65504),
//! and so is each dequantized weight, as llama.cpp's cooperative-matrix path does. Each product
//! then carries a relative error of at most 2·2^-11 against the f32 reference, so an output is
//! within about 2^-10 · Σ|x·w| of it (far less in practice: the roundings have random signs).
//! Hence only weights that round safely to f16 take this path: every quantized type (f16 scales
//! times small integers) and F16 itself; F32 and BF16 weights (wider range or precision than
//! f16) stay on the tiled kernel.
//!
//! # Tiles
//!
//! A workgroup of 8 subgroups of 32 owns BX x rows by 128 W rows and walks K 32 at a time
//! (48 KiB of workgroup memory for BX = 128, 38 KiB for BX = 64; see the WGSL header). BX = 128
//! decodes each W tile for twice the x rows, but for n = 512 gives only 4 x tiles: shapes with
//! fewer than [`MIN_WIDE_GROUPS`] such workgroups (most of a small model's matrices) take BX = 64,
//! which doubles the workgroups that share the GPU. `ANYGPU_QMATMUL_TILE=64|128` (read once)
//! forces one, for tuning.
//!
//! # Speed (H100, n = 512; `coop_prefill_speed`, BENCHMARKS.md)
//!
//! 60-102 TFLOP/s on the 4096-wide shapes of 1B-8B models with BX = 128 (F16 weights fastest:
//! their runs are raw words, converted after the products; quantized runs are decoded after
//! them), 6-28 on SmolLM2's 576-wide ones, which fill a fraction of the GPU; ~10-12 for the
//! tiled f32 kernel. At n = 512 a 4096-row matrix gives only 128 workgroups, about one per SM,
//! so nothing overlaps a workgroup's barriers and load waits: that, not the tensor cores (a few
//! hundred TFLOP/s), is what bounds it there.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::OnceLock;

use super::gpu::{keep_sections, wgsl_name, QKernel, COMMON_WGSL};
use super::GgmlType;
use crate::error::{Error, Result};
use crate::gpu::{Bind, GpuContext, KernelSpec, Pipeline};
use crate::ops::to_u32;

const OP: &str = "qmatmul";
const COOP_WGSL: &str = include_str!("matmul_coop.wgsl");

/// W rows per workgroup tile (BW in the kernel).
const BW: usize = 128;

/// Below this many workgroups of the BX = 128 tile, the BX = 64 one is used. Measured on an
/// H100 (132 SMs) at n = 512 (`coop_prefill_speed`, BENCHMARKS.md): BX = 128 wins from 96
/// workgroups (e.g. 3072 x 2048: 132 vs 159 us; 4096 x 4096: 217 vs 314), BX = 64 below (2048 x
/// 2048, 64 workgroups: 90 vs 117 us).
pub const MIN_WIDE_GROUPS: usize = 96;

/// Workgroup memory of the kernel for x tiles of `bx` rows: two buffers of the X and W tiles
/// (rows of 32 + 8 halves) and the 8 KiB f32 scratch (private memory when emulated).
fn workgroup_bytes(bx: u32) -> u32 {
    2 * (bx + BW as u32) * 40 * 2 + if emulated() { 0 } else { 8192 }
}

/// See [`set_emulated`].
static EMULATED: AtomicBool = AtomicBool::new(false);

/// Tests only: emulate the cooperative matrices in plain WGSL (each invocation computing its 8
/// elements of a 16 x 16 product from workgroup memory) so the kernel's staging, indexing,
/// edges, drain and this module's dispatches run on devices without them, such as lavapipe;
/// it needs SHADER_F16 and 30 KiB of workgroup memory (so BX = 64 only on lavapipe's 32 KiB).
/// Applies process-wide (tests that use it take turns) until turned off.
#[doc(hidden)]
pub fn set_emulated(on: bool) {
    EMULATED.store(on, Ordering::Relaxed);
}

fn emulated() -> bool {
    EMULATED.load(Ordering::Relaxed)
}

/// Why the coop kernel cannot run `ty` on this device, or `None` when it can.
pub fn unsupported_reason(ctx: &GpuContext, ty: GgmlType) -> Option<String> {
    let c = &ctx.caps;
    let emulated = emulated();
    let why = if matches!(ty, GgmlType::F32 | GgmlType::BF16) {
        format!("{ty} weights do not round safely to f16 (it takes the quantized types and F16)")
    } else if emulated && !c.shader_f16 {
        "the device has no f16 shaders (SHADER_F16), which the emulated kernel needs".to_string()
    } else if emulated {
        if c.max_compute_invocations_per_workgroup >= 256 && c.max_compute_workgroup_storage_size >= workgroup_bytes(64)
        {
            return None;
        }
        format!("the emulated kernel needs 256 invocations and {} bytes of workgroup memory", workgroup_bytes(64))
    } else {
        c.coop_f16_unsupported(workgroup_bytes(64))?
    };
    Some(format!("{OP}: the cooperative-matrix kernel cannot run on {}: {why}", ctx.info.name))
}

/// x rows from which the default is the coop kernel: below, its 64-row x tile is mostly
/// padding, and the tiled kernel stays exact in f32 for the short prompts of chat turns (and
/// for the tests, whose f32 tolerances assume it; the coop kernel has its own).
pub const COOP_MIN_N: usize = 64;

/// The prefill kernel (n > MATVEC_MAX_N) when none is forced: coop where it runs and n >=
/// [`COOP_MIN_N`], else tiled; `ANYGPU_QMATMUL=tiled|coop` (read once) overrides, a forced coop
/// falling back to tiled where it cannot run.
pub(super) fn prefill_kernel(ctx: &GpuContext, ty: GgmlType, n: usize) -> QKernel {
    static FORCED: OnceLock<Option<QKernel>> = OnceLock::new();
    let forced = *FORCED.get_or_init(|| {
        let v = std::env::var("ANYGPU_QMATMUL").ok()?;
        match v.to_ascii_lowercase().as_str() {
            "tiled" => Some(QKernel::Tiled),
            "coop" => Some(QKernel::Coop),
            "" | "auto" => None,
            _ => {
                log::warn!("ANYGPU_QMATMUL={v:?} is not one of tiled, coop, auto; ignored");
                None
            }
        }
    });
    if forced == Some(QKernel::Tiled)
        || unsupported_reason(ctx, ty).is_some()
        || (n < COOP_MIN_N && forced != Some(QKernel::Coop))
    {
        QKernel::Tiled
    } else {
        QKernel::Coop
    }
}

/// A test's forced tile (64 or 128), or `u32::MAX`: `ANYGPU_QMATMUL_TILE` decides (0 when
/// unset: chosen by shape).
static TILE_OVERRIDE: AtomicU32 = AtomicU32::new(u32::MAX);

/// Forces the x tile of later coop products (`Some(64 | 128)`), or returns the choice to
/// `ANYGPU_QMATMUL_TILE` and the shape (`None`). For tests and benchmarks; it applies
/// process-wide, so tests that use it take turns.
#[doc(hidden)]
pub fn set_tile_override(bx: Option<u32>) {
    TILE_OVERRIDE.store(bx.filter(|b| *b == 64 || *b == 128).unwrap_or(u32::MAX), Ordering::Relaxed);
}

fn tile_override() -> u32 {
    let v = TILE_OVERRIDE.load(Ordering::Relaxed);
    if v != u32::MAX {
        return v;
    }
    static ENV: OnceLock<u32> = OnceLock::new();
    *ENV.get_or_init(|| match std::env::var("ANYGPU_QMATMUL_TILE").ok().as_deref() {
        Some("64") => 64,
        Some("128") => 128,
        None | Some("") => 0,
        Some(v) => {
            log::warn!("ANYGPU_QMATMUL_TILE={v:?} is not 64 or 128; ignored");
            0
        }
    })
}

/// How one product runs on the coop kernel: the x tile and x's access, fixed for the call.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Plan {
    /// x rows per workgroup tile: 64 or 128.
    bx: u32,
    /// x read as vec4: `cols` and x's element offset are multiples of 4 (then so is every
    /// dispatch's x_off: bindings start at multiples of 256 bytes).
    x_vec: bool,
    /// W read as raw f16 words, converted after the products (F16 rows of even length, which
    /// start at 4-byte boundaries); otherwise each run of 8 is decoded by `deq8`.
    w_raw: bool,
}

impl Plan {
    /// The plan for W [rows, cols] of `ty` times x [n, cols] starting at element `x_offset` of
    /// its buffer; `Error::Unsupported` (naming the reason) where the device or type cannot run
    /// the kernel.
    pub(super) fn new(
        ctx: &GpuContext,
        ty: GgmlType,
        n: usize,
        rows: usize,
        cols: usize,
        x_offset: usize,
    ) -> Result<Plan> {
        if let Some(why) = unsupported_reason(ctx, ty) {
            return Err(Error::Unsupported(why));
        }
        let wide_fits = workgroup_bytes(128) <= ctx.caps.max_compute_workgroup_storage_size;
        let bx = match tile_override() {
            128 if wide_fits => 128,
            64 | 128 => 64,
            _ if wide_fits && n >= 128 && n.div_ceil(128) * rows.div_ceil(BW) >= MIN_WIDE_GROUPS => 128,
            _ => 64,
        };
        Ok(Plan {
            bx,
            x_vec: cols.is_multiple_of(4) && x_offset.is_multiple_of(4),
            w_raw: ty == GgmlType::F16 && cols.is_multiple_of(2),
        })
    }

    /// The kernel for `ty` with this plan's tile and x access.
    pub(super) fn spec(&self, ty: GgmlType) -> KernelSpec {
        self.spec_as(ty, emulated())
    }

    fn spec_as(&self, ty: GgmlType, emulated: bool) -> KernelSpec {
        let name = format!("qmatmul_coop{}_{}", if emulated { "_emu" } else { "" }, wgsl_name(ty));
        let spec = KernelSpec::new(name, source(ty, self.x_vec, self.w_raw, emulated), "matmul").with("enable f16;");
        let spec = if emulated { spec } else { spec.with("enable wgpu_cooperative_matrix;") };
        spec.constant_u32("BX", self.bx)
    }

    /// Records the product of one row slice of W with `d.n` x rows; `binds` are the weight
    /// slice, x and the output, as for the tiled kernel.
    pub(super) fn dispatch(&self, ctx: &GpuContext, pipeline: &Pipeline, d: Dims, binds: &[Bind<'_>]) -> Result<()> {
        let u = |v: usize| to_u32(OP, v);
        let tiles_x = d.n.div_ceil(self.bx as usize);
        let tiles_w = d.rows.div_ceil(BW);
        let groups = tiles_x.checked_mul(tiles_w).ok_or_else(|| Error::shape(OP, "grid overflows"))?;
        let params = CoopParams {
            rows: u(d.rows)?,
            cols: u(d.cols)?,
            row_bytes: u(d.row_bytes)?,
            w_off: d.w_off,
            n: u(d.n)?,
            x_off: d.x_off,
            out_off: d.out_off,
            out_stride: u(d.out_stride)?,
            tiles_x: u(tiles_x)?,
            tiles_w: u(tiles_w)?,
            _pad: [0; 2],
        };
        ctx.dispatch(pipeline, OP, bytemuck::bytes_of(&params), binds, ctx.grid_1d(u(groups)?))
    }
}

/// One dispatch's shape, as `qmatmul_with` binds it (the tiled kernel's parameters).
pub(super) struct Dims {
    /// W rows of this row slice.
    pub rows: usize,
    pub cols: usize,
    pub row_bytes: usize,
    /// Byte offset of the slice's first row inside the weight binding.
    pub w_off: u32,
    /// x rows of this dispatch.
    pub n: usize,
    /// First x element inside the x binding.
    pub x_off: u32,
    /// Output index of (x row 0, W row 0).
    pub out_off: u32,
    /// Output elements per x row.
    pub out_stride: usize,
}

/// The WGSL `Params` of matmul_coop.wgsl.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct CoopParams {
    rows: u32,
    cols: u32,
    row_bytes: u32,
    w_off: u32,
    n: u32,
    x_off: u32,
    out_off: u32,
    out_stride: u32,
    tiles_x: u32,
    tiles_w: u32,
    _pad: [u32; 2],
}

/// The kernel's WGSL for one type, x access and W loader: common.wgsl with that type's
/// sections, matmul_coop.wgsl with its `xvec` or `xscalar` section and the W loader
/// ([`w_loader`]), and the `deq8` forward; or the tests' emulated variant. Built once per
/// (type, access, loader, variant) and kept (104 strings at most), so the pipeline cache can
/// key on a `&'static str`.
fn source(ty: GgmlType, x_vec: bool, w_raw: bool, emulated: bool) -> &'static str {
    static SOURCES: [[[[OnceLock<&'static str>; 2]; 2]; 2]; 13] =
        [const { [const { [const { [const { OnceLock::new() }; 2] }; 2] }; 2] }; 13];
    let ti = GgmlType::ALL.iter().position(|&t| t == ty).unwrap_or(0);
    SOURCES[ti][x_vec as usize][w_raw as usize][emulated as usize].get_or_init(|| {
        let name = wgsl_name(ty);
        let tag = match (x_vec, emulated) {
            (true, false) => "xvec",
            (false, false) => "xscalar",
            (true, true) => "xvec_emu",
            (false, true) => "xscalar_emu",
        };
        let mut kernel = keep_sections(COOP_WGSL, tag).replace("{{W_LOADER}}", w_loader(w_raw));
        if emulated {
            kernel = emulate(&kernel);
        }
        let text = format!(
            "{}\n{kernel}\nfn deq8(rb: u32, c: u32, cols: u32) -> V8 {{ return deq8_{name}(rb, c, cols); }}\n",
            keep_sections(COMMON_WGSL, name)
        );
        Box::leak(text.into_boxed_str())
    })
}

/// How the kernel stages a run of 8 weights (row byte `rb`, column `c`, `n` of them valid):
/// `ld_w` reads it into a `Raw_w`, `st_w` puts it in the W tile as f16, and `W_EARLY` says
/// whether `ld_w` can be issued before the products (its loads are left untouched until
/// `st_w`) or must come after them (it decodes, waiting for its loads).
fn w_loader(raw: bool) -> &'static str {
    if raw {
        "const W_EARLY: u32 = 1u;\n\
         alias Raw_w = vec4<u32>;\n\
         fn ld_w(rb: u32, c: u32, n: u32) -> Raw_w {\n    \
             let i = (rb + 2u * c) >> 2u;\n    \
             return vec4<u32>(w[i], w[i + 1u], w[i + 2u], w[i + 3u]);\n}\n\
         fn st_w(at: u32, r: Raw_w, n: u32) {\n    \
             sw[at] = mask4(u2h(r.xy), n);\n    \
             sw[at + 1u] = mask4(u2h(r.zw), max(n, 4u) - 4u);\n}\n"
    } else {
        "const W_EARLY: u32 = 0u;\n\
         alias Raw_w = V8;\n\
         fn ld_w(rb: u32, c: u32, n: u32) -> Raw_w {\n    \
             if (n == 0u) {\n        return V8(vec4<f32>(0.0), vec4<f32>(0.0));\n    }\n    \
             return deq8(rb, c, p.cols);\n}\n\
         fn st_w(at: u32, r: Raw_w, n: u32) {\n    \
             sw[at] = vec4<f16>(r.lo);\n    \
             sw[at + 1u] = vec4<f16>(r.hi);\n}\n"
    }
}

/// The tests' variant of the kernel: its cooperative-matrix types and calls rewritten into the
/// `emu_*` functions of its last section, the subgroup builtins into the invocation index's
/// (subgroups of 32 consecutive invocations), the scratch into private memory. What the
/// rewrite misses fails to compile (no `enable wgpu_cooperative_matrix;`), which the naga test
/// checks.
fn emulate(kernel: &str) -> String {
    const SWAPS: [(&str, &str); 12] = [
        ("coopLoadT<coop_mat16x16<f16, A>>(&sx[", "emu_load_x("),
        ("coopLoad<coop_mat16x16<f16, B>>(&sw[", "emu_load_w("),
        ("], SK4)", ", SK4)"),
        ("coopMultiplyAdd(", "emu_mad("),
        ("coopStoreT(", "emu_store("),
        ("&scratch[sg * 256u], 16u)", "sg * 256u, 16u)"),
        ("coop_mat16x16<f32, C>()", "EmuC()"),
        ("coop_mat16x16<f16, A>", "EmuA"),
        ("coop_mat16x16<f16, B>", "EmuB"),
        ("var<workgroup> scratch", "var<private> scratch"),
        ("@builtin(subgroup_id) sg: u32,", ""),
        ("@builtin(subgroup_invocation_id) lane: u32,", ""),
    ];
    let mut s = kernel.to_string();
    for (from, to) in SWAPS {
        s = s.replace(from, to);
    }
    s.replace(
        "    let lin = wid.x + wid.y * nwg.x;",
        "    let sg = tid / 32u;\n    let lane = tid % 32u;\n    emu_lane = lane;\n    let lin = wid.x + wid.y * nwg.x;",
    )
}

/// Every specialisation of the kernel (each type it takes, both tiles, both x accesses) as
/// (label, WGSL, emulated), the tests' emulated variants included, for offline validation: most
/// machines cannot run the kernel.
#[doc(hidden)]
pub fn wgsl_variants() -> Vec<(String, String, bool)> {
    let mut v = Vec::new();
    for ty in GgmlType::ALL.into_iter().filter(|t| !matches!(t, GgmlType::F32 | GgmlType::BF16)) {
        for bx in [64, 128] {
            for x_vec in [false, true] {
                for w_raw in if ty == GgmlType::F16 { vec![false, true] } else { vec![false] } {
                    for emulated in [false, true] {
                        let spec = Plan { bx, x_vec, w_raw }.spec_as(ty, emulated);
                        let label = format!("{} BX={bx} x_vec={x_vec} w_raw={w_raw}", spec.name);
                        v.push((label, spec.source_text(&[]), emulated));
                    }
                }
            }
        }
    }
    v
}
