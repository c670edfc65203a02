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
//! x comes as f16 where its rows are whole runs of 8: rounded by `x_to_f16` (which can apply
//! an RMSNorm on the way), or already f16 from the op that wrote it (the SwiGLU epilogue's f16
//! output, `Plan::with_half_out`, or the tensor-core attention's), with the same values.
//! Likewise W: from `dequant_f16::DEQUANT_MIN_N` x rows (and `DEQUANT_MIN_WEIGHTS` weights),
//! quantized weights come as an f16 copy made first or beside an earlier product
//! (copy_ahead.rs; `qmatmul_with` runs the product on that F16 matrix: `WLoad::F16Vec`),
//! holding the values the staging would round them to.
//!
//! # Tiles
//!
//! A workgroup of 8 subgroups of 32 owns BX x rows by 128 W rows (or 192: the wide tile,
//! [`WIDE_BW`], where it takes fewer rounds of workgroups) and walks K 64 at a time
//! through one buffer where W runs are loaded before the products, 32 at a time through two
//! otherwise ([`step_k`]; at most 48 KiB of workgroup memory, see the WGSL header). BX = 128
//! decodes each W tile for twice the x rows, but for n = 512 gives only 4 x tiles: shapes with
//! fewer than [`MIN_WIDE_GROUPS`] such workgroups (most of a small model's matrices) take BX = 64,
//! which doubles the workgroups that share the GPU. `ANYGPU_QMATMUL_TILE=64|128` (read once)
//! forces one, for tuning.
//!
//! # Speed (H100, n = 512; `coop_prefill_speed`, BENCHMARKS.md)
//!
//! 85-145 TFLOP/s on the 4096-wide shapes of 1B-8B models with BX = 128 (x rounded to f16
//! first, W runs loaded before the products where the type allows, whole tiles stored straight
//! from the accumulators: see the WGSL header), 6-28 on SmolLM2's 576-wide ones, which fill a
//! fraction of the GPU; ~10-12 for the tiled f32 kernel. `ANYGPU_COOP_XF32=1`,
//! `ANYGPU_COOP_WLATE=1` and `ANYGPU_COOP_DIRECT=0` (read once) bring back the f32 x runs, the
//! late W loads and the drain of every tile through workgroup memory, for comparisons;
//! `ANYGPU_COOP_BW=128|192` forces the W tile. Bigger still (W 256 rows, 64 x 64 per subgroup)
//! and smaller (128 invocations) workgroup tiles lost by 1.4-2x (BENCHMARKS.md, tenth session).

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::OnceLock;

use super::gpu::{keep_sections, wgsl_name, QKernel, COMMON_WGSL};
use super::GgmlType;
use crate::error::{Error, Result};
use crate::gpu::{Bind, GpuContext, KernelSpec, Pipeline};
use crate::ops::{to_u32, TO_F16_WGSL};

const OP: &str = "qmatmul";
const COOP_WGSL: &str = include_str!("matmul_coop.wgsl");

/// W rows per workgroup tile (BW in the kernel): 128, or [`WIDE_BW`] for the wide tile.
const BW: usize = 128;

/// W rows of the wide tile: BX = 128 by 192 W rows (each subgroup 64 x 48: three B matrices
/// against four A, 12 accumulators), K 64 at a time through one buffer. Its tiles take all but
/// 3 KiB of the 48 KiB, so edge tiles drain through a scratch of three slots in turns (the
/// WGSL's `turn8`), and it never carries the GLU epilogue (whose drain pairs every accumulator
/// through the scratch). Per flop it stages a sixth fewer rows and loads a fifth fewer
/// matrices: H100, n = 512, Q4_0 [24576, 4096] 724-731 -> 597-649 us, F16 640-643 -> 575-580;
/// and a grid of fewer, longer workgroups where the 128-row one leaves most of a last round
/// idle: Q4_0 [6144, 4096] (the 8B's Q|K|V, 192 -> 128 workgroups) 255-262 -> 176-184 us.
const WIDE_BW: usize = 192;

/// Workgroups of either tile that run at once in the rule for the wide one ([`wide_w_pays`]):
/// an H100's, 132 SMs with one workgroup each (their registers). A GPU with fewer SMs runs
/// more rounds of either grid, where the wide tile's lower cost per flop counts more.
const ROUND_GROUPS: usize = 132;

/// A wide workgroup's time over a 128-row one's, in hundredths: H100, n = 512, 1.24-1.35 per
/// round (Q4_0 [24576, 4096]: 4 rounds 597-657 us against 6 rounds 717-732).
const WIDE_ROUND_COST: usize = 135;

/// Whether the wide tile beats the 128-row one for `n` x rows by `rows` W rows, counted in
/// rounds of [`ROUND_GROUPS`] workgroups, a wide round costing [`WIDE_ROUND_COST`]: it does
/// where its rounds cost less so (Q4_0, n = 512: the 8B's Q|K|V [6144, 4096] 2 -> 1 round,
/// 256-272 -> 167-193 us; [4608, 3584] 2 -> 1, 215-221 -> 148-151; [24576, 4096] 6 -> 4), not
/// where both take as many (8192 x 4096, 2 and 2: 257-259 -> 358-368 us; 4096 x 4096, 1 and 1:
/// 134-140 -> 165-176; 15360 x 5120, 4 and 3: 589 -> 605-611, a tie the rule leaves to the
/// 128-row tile).
fn wide_w_pays(n: usize, rows: usize) -> bool {
    let rounds = |bw: usize| (n.div_ceil(128) * rows.div_ceil(bw)).div_ceil(ROUND_GROUPS);
    rounds(WIDE_BW) * WIDE_ROUND_COST < rounds(BW) * 100
}

/// Below this many workgroups of the BX = 128 tile, the BX = 64 one is used. Measured on an
/// H100 (132 SMs) at n = 512 (`coop_prefill_speed`, BENCHMARKS.md): BX = 128 wins from 96
/// workgroups (e.g. 3072 x 2048: 132 vs 159 us; 4096 x 4096: 217 vs 314), BX = 64 below (2048 x
/// 2048, 64 workgroups: 90 vs 117 us).
pub const MIN_WIDE_GROUPS: usize = 96;

/// f32 slots of 16 x 16 in the kernel's scratch for a W tile of `bw` rows: one per subgroup, or
/// three taken in turns beside the wide tile's (`SCR` in the kernel is this times 256).
fn scratch_slots(bw: usize) -> u32 {
    if bw == WIDE_BW {
        3
    } else {
        8
    }
}

/// Workgroup memory of the kernel for x tiles of `bx` rows by W tiles of `bw` rows: one (K 64)
/// or two (K 32) buffers of the X and W tiles (rows of K + 8 halves) and the f32 scratch
/// (private memory when emulated).
fn workgroup_bytes(bx: u32, bk: u32, bw: usize) -> u32 {
    let scratch = if emulated() { 0 } else { scratch_slots(bw) * 1024 };
    (64 / bk) * (bx + bw as u32) * (bk + 8) * 2 + scratch
}

/// Workgroup memory of the smallest configuration (BX = 64 and the K step that needs least).
fn smallest_tiles() -> u32 {
    workgroup_bytes(64, 32, BW).min(workgroup_bytes(64, 64, BW))
}

/// K per step for W staged by `load`: 64 through one buffer where W runs are loaded before the
/// products (twice the loads in flight across them: H100, n = 512, 8B Q4_0 gate|up 1247 ->
/// 1027 us, F16 1113 -> 927; 8B Q4_0 pp512 5,508 -> 6,356 tok/s), 32 through two buffers where
/// they are loaded after them (Q4_K 1434 -> 1505 with 64: twice the loads waited for per step).
/// `ANYGPU_COOP_BK=32|64` (read once) forces one, for comparisons.
fn step_k(load: WLoad) -> u32 {
    static V: OnceLock<Option<u32>> = OnceLock::new();
    let forced = *V.get_or_init(|| match std::env::var("ANYGPU_COOP_BK").ok().as_deref() {
        Some("32") => Some(32),
        Some("64") => Some(64),
        None | Some("") => None,
        Some(v) => {
            log::warn!("ANYGPU_COOP_BK={v:?} is not 32 or 64; ignored");
            None
        }
    });
    forced.unwrap_or(if load == WLoad::Late { 32 } else { 64 })
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

/// Whether the kernel takes weights of `ty` (the quantized types and F16: F32 and BF16 weights
/// do not round safely to f16).
pub fn takes_type(ty: GgmlType) -> bool {
    !matches!(ty, GgmlType::F32 | GgmlType::BF16)
}

/// Why the coop kernel cannot run `ty` on this device, or `None` when it can.
pub fn unsupported_reason(ctx: &GpuContext, ty: GgmlType) -> Option<String> {
    let c = &ctx.caps;
    let emulated = emulated();
    let why = if !takes_type(ty) {
        format!("{ty} weights do not round safely to f16 (it takes the quantized types and F16)")
    } else if emulated && !c.shader_f16 {
        "the device has no f16 shaders (SHADER_F16), which the emulated kernel needs".to_string()
    } else if emulated {
        if c.max_compute_invocations_per_workgroup >= 256 && c.max_compute_workgroup_storage_size >= smallest_tiles() {
            return None;
        }
        format!("the emulated kernel needs 256 invocations and {} bytes of workgroup memory", smallest_tiles())
    } else {
        c.coop_f16_unsupported(smallest_tiles())?
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

/// A tile size forced by a test (`set`), else by the environment variable `var` (read once
/// into `env`), else 0 (chosen by shape). Only the two sizes in `allowed` are taken.
struct TileOverride {
    set: AtomicU32,
    env: OnceLock<u32>,
    var: &'static str,
    allowed: [u32; 2],
}

impl TileOverride {
    const fn new(var: &'static str, allowed: [u32; 2]) -> TileOverride {
        TileOverride { set: AtomicU32::new(u32::MAX), env: OnceLock::new(), var, allowed }
    }

    fn force(&self, v: Option<u32>) {
        self.set.store(v.filter(|v| self.allowed.contains(v)).unwrap_or(u32::MAX), Ordering::Relaxed);
    }

    fn get(&self) -> u32 {
        let v = self.set.load(Ordering::Relaxed);
        if v != u32::MAX {
            return v;
        }
        *self.env.get_or_init(|| {
            let v = std::env::var(self.var).unwrap_or_default();
            match v.parse() {
                Ok(n) if self.allowed.contains(&n) => n,
                _ if v.is_empty() => 0,
                _ => {
                    let [a, b] = self.allowed;
                    log::warn!("{}={v:?} is not {a} or {b}; ignored", self.var);
                    0
                }
            }
        })
    }
}

/// The x tile: `ANYGPU_QMATMUL_TILE=64|128`.
static X_TILE: TileOverride = TileOverride::new("ANYGPU_QMATMUL_TILE", [64, 128]);

/// The W tile: `ANYGPU_COOP_BW=128|192`.
static W_TILE: TileOverride = TileOverride::new("ANYGPU_COOP_BW", [128, 192]);

/// Forces the x tile of later coop products (`Some(64 | 128)`), or returns the choice to
/// `ANYGPU_QMATMUL_TILE` and the shape (`None`). For tests and benchmarks; it applies
/// process-wide, so tests that use it take turns.
#[doc(hidden)]
pub fn set_tile_override(bx: Option<u32>) {
    X_TILE.force(bx);
}

/// Forces the W tile of later coop products (`Some(128 | 192)`; 192 where the plan allows it:
/// BX = 128, K 64, no GLU, the memory), or returns the choice to `ANYGPU_COOP_BW` and the
/// shape (`None`). For tests and benchmarks, process-wide as [`set_tile_override`].
#[doc(hidden)]
pub fn set_w_tile_override(bw: Option<u32>) {
    W_TILE.force(bw);
}

/// How one product runs on the coop kernel: the x tile and x's access, fixed for the call.
#[derive(Clone, Copy, Debug)]
pub(super) struct Plan {
    /// x rows per workgroup tile: 64 or 128.
    bx: u32,
    /// W rows per workgroup tile: 128, or [`WIDE_BW`] (only with BX = 128 and K 64, no GLU).
    bw: usize,
    /// K per step: 32 or 64.
    bk: u32,
    /// How x is read.
    x: XAccess,
    /// How W runs are staged.
    w_load: WLoad,
    /// The GLU epilogue: W is a gate|up stack of 2f rows and the output [n, f] is
    /// silu(gate) * up (see the WGSL's `GLU`).
    glu: bool,
    /// The residual epilogue: the output is the product plus `resid` (binding 4), shaped alike.
    add: bool,
    /// The output as f16 (GLU only: see [`Plan::with_half_out`]).
    half_out: bool,
}

/// How the kernel reads x (its WGSL section).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum XAccess {
    /// f32 elements, masked as read: any `cols` and offset.
    Scalar,
    /// f32 vec4s: `cols` and x's element offset are multiples of 4 (then so is every
    /// dispatch's x_off: bindings start at multiples of 256 bytes).
    Vec,
    /// f16, rounded (and clamped) by [`x_to_f16`] before the product: one 16-byte load per run
    /// of 8 instead of two, half the bytes and registers. `cols` a multiple of 8, x's offset
    /// of 4.
    Half,
}

impl XAccess {
    const ALL: [XAccess; 3] = [XAccess::Scalar, XAccess::Vec, XAccess::Half];

    fn for_shape(cols: usize, x_offset: usize) -> XAccess {
        if cols.is_multiple_of(8) && x_offset.is_multiple_of(4) && !x_f32_forced() {
            XAccess::Half
        } else if cols.is_multiple_of(4) && x_offset.is_multiple_of(4) {
            XAccess::Vec
        } else {
            XAccess::Scalar
        }
    }

    /// The kernel's x section.
    fn tag(self, emulated: bool) -> &'static str {
        match (self, emulated) {
            (XAccess::Scalar, false) => "xscalar",
            (XAccess::Vec, false) => "xvec",
            (XAccess::Half, false) => "xhalf",
            (XAccess::Scalar, true) => "xscalar_emu",
            (XAccess::Vec, true) => "xvec_emu",
            (XAccess::Half, true) => "xhalf_emu",
        }
    }
}

/// Whether the kernel reads x [.., cols] that starts at element `x_offset` of its buffer as f16
/// ([`XAccess::Half`]: [`x_to_f16`] rounds it first, and can normalise it on the way).
pub(super) fn takes_half_x(cols: usize, x_offset: usize) -> bool {
    XAccess::for_shape(cols, x_offset) == XAccess::Half
}

/// `ANYGPU_COOP_XF32=1` (read once): x read as f32 and rounded as staged, as before the f16
/// copy (for A/B measurements).
fn x_f32_forced() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| std::env::var("ANYGPU_COOP_XF32").is_ok_and(|v| v == "1"))
}

/// How the kernel stages its runs of 8 weights (see [`w_loader`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum WLoad {
    /// A run's 16 bytes in one 16-byte load before the products, converted after them: F16
    /// rows of a multiple of 8 weights (so every run starts at a 16-byte boundary), through a
    /// `vec4<u32>` view of the weights. One load where [`WLoad::F16Raw`] issues four (H100, n =
    /// 512, F16 [28672, 4096] 702-710 -> 612-616 us, [4096, 14336] 370-387 -> 321-335).
    F16Vec,
    /// Raw f16 words loaded before the products, converted after them: F16 rows of even
    /// length (which start at 4-byte boundaries).
    F16Raw,
    /// The type's raw words (`raw8_<type>`) loaded before the products, decoded
    /// (`dec8_<type>`) after them: the types whose runs lie in a few words ([`has_raw8`]).
    Early,
    /// Loaded and decoded (`deq8`) after the products, which wait for nothing then: the rest.
    Late,
}

impl WLoad {
    const ALL: [WLoad; 4] = [WLoad::F16Vec, WLoad::F16Raw, WLoad::Early, WLoad::Late];

    /// The loader for `ty` with rows of `cols` weights.
    fn for_type(ty: GgmlType, cols: usize) -> WLoad {
        match ty {
            GgmlType::F16 if cols.is_multiple_of(8) => WLoad::F16Vec,
            GgmlType::F16 if cols.is_multiple_of(2) => WLoad::F16Raw,
            _ if has_raw8(ty) && !late_forced() => WLoad::Early,
            _ => WLoad::Late,
        }
    }
}

/// Types with `raw8_<type>` / `dec8_<type>` in common.wgsl.
fn has_raw8(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_1
            | GgmlType::Q8_0
            | GgmlType::Q4K
            | GgmlType::Q5K
            | GgmlType::Q6K
    )
}

/// `ANYGPU_COOP_WLATE=1` (read once): every quantized type decoded after the products, as
/// before the early loads (for A/B measurements).
fn late_forced() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| std::env::var("ANYGPU_COOP_WLATE").is_ok_and(|v| v == "1"))
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
        let w_load = WLoad::for_type(ty, cols);
        let limit = ctx.caps.max_compute_workgroup_storage_size;
        // The other K step where the preferred one does not fit (one does: see unsupported_reason).
        let bk = match step_k(w_load) {
            k if workgroup_bytes(64, k, BW) > limit => 96 - k,
            k => k,
        };
        let wide_fits = workgroup_bytes(128, bk, BW) <= limit;
        let bx = match X_TILE.get() {
            128 if wide_fits => 128,
            64 | 128 => 64,
            _ if wide_fits && n >= 128 && n.div_ceil(128) * rows.div_ceil(BW) >= MIN_WIDE_GROUPS => 128,
            _ => 64,
        };
        let wide_w_fits = bx == 128 && bk == 64 && workgroup_bytes(128, 64, WIDE_BW) <= limit;
        let bw = match W_TILE.get() {
            192 if wide_w_fits => WIDE_BW,
            128 | 192 => BW,
            _ if wide_w_fits && wide_w_pays(n, rows) => WIDE_BW,
            _ => BW,
        };
        Ok(Plan { bx, bw, bk, x: XAccess::for_shape(cols, x_offset), w_load, glu: false, add: false, half_out: false })
    }

    /// This plan with the GLU epilogue: the output is silu(gate) * up of the gate|up stack (on
    /// the 128-row W tile: see [`WIDE_BW`]).
    pub(super) fn with_glu(self) -> Plan {
        Plan { glu: true, bw: BW, ..self }
    }

    /// This plan with the residual epilogue: the output is the product plus a residual.
    pub(super) fn with_add(self) -> Plan {
        Plan { add: true, ..self }
    }

    /// This GLU plan writing its output [n, f] as f16, rounded and clamped as [`x_to_f16`]
    /// rounds x, for a next product that reads x as f16 (the FFN's down projection): the same
    /// values it would read, without the f32 output written and read back and the rounding
    /// dispatch between the two. `None` where the output's rows are not whole runs of 8 (each
    /// invocation of the drain writes 8 elements of one row, two `vec4<f16>` stores).
    pub(super) fn with_half_out(self, f: usize) -> Option<Plan> {
        (self.glu && f.is_multiple_of(8)).then_some(Plan { half_out: true, ..self })
    }

    /// Whether the output is f16.
    pub(super) fn half_out(&self) -> bool {
        self.half_out
    }

    /// Whether x goes in as f16 ([`x_to_f16`] first).
    pub(super) fn x_half(&self) -> bool {
        self.x == XAccess::Half
    }

    /// The kernel for `ty` with this plan's tile and x access.
    pub(super) fn spec(&self, ty: GgmlType) -> KernelSpec {
        self.spec_as(ty, emulated())
    }

    fn spec_as(&self, ty: GgmlType, emulated: bool) -> KernelSpec {
        let name = format!("qmatmul_coop{}_{}", if emulated { "_emu" } else { "" }, wgsl_name(ty));
        // Its tiles', scratch's and staged runs' indices are offsets the tile constants bound.
        let spec = KernelSpec::new(name, source(ty, self.x, self.w_load, emulated), "matmul")
            .with("enable f16;")
            .bounded_by_design();
        let spec = match emulated {
            true => spec.with(crate::ops::COOP_EMU_WGSL),
            false => spec.with("enable wgpu_cooperative_matrix;"),
        };
        let spec = spec
            .constant_u32("BX", self.bx)
            .constant_u32("BWC", self.bw as u32)
            .constant_u32("SCR", scratch_slots(self.bw) * 256)
            .constant_u32("KB", self.bk)
            .constant_u32("GLU", self.glu as u32)
            .constant_u32("ADD", self.add as u32);
        // The residual's binding exists only where it is bound; `add16(i)` is its 16 x 16 block
        // from element i (rows p.out_stride apart) as an accumulator (the direct drain's start).
        let resid = if self.add {
            "@group(0) @binding(4) var<storage, read> resid: array<f32>;\n\
             fn resid_at(i: u32) -> f32 { return resid[i]; }"
        } else {
            "fn resid_at(i: u32) -> f32 { return 0.0; }"
        };
        spec.with(TO_F16_WGSL)
            .with(output_wgsl(self.half_out))
            .with(store16_wgsl(self.half_out, emulated))
            .with(resid)
            .with(match (self.add, emulated) {
                (false, false) => "fn add16(i: u32) -> coop_mat16x16<f32, C> { return coop_mat16x16<f32, C>(); }",
                (false, true) => "fn add16(i: u32) -> EmuC { return EmuC(); }",
                (true, false) => {
                    "fn add16(i: u32) -> coop_mat16x16<f32, C> {\n\
                     let stride = p.out_stride;\n\
                     return coopLoadT<coop_mat16x16<f32, C>>(&resid[i], stride);\n}"
                }
                (true, true) => {
                    "fn add16(i: u32) -> EmuC {\n\
                     var m: EmuC;\n\
                     let at = i + (emu_lane / 2u) * p.out_stride + (emu_lane % 2u) * 8u;\n\
                     for (var j = 0u; j < 8u; j++) { m.v[j] = resid[at + j]; }\n\
                     return m;\n}"
                }
            })
    }

    /// Records the product of one row slice of W with `d.n` x rows; `binds` are the weight
    /// slice, x and the output, as for the tiled kernel.
    pub(super) fn dispatch(&self, ctx: &GpuContext, pipeline: &Pipeline, d: Dims, binds: &[Bind<'_>]) -> Result<()> {
        let u = |v: usize| to_u32(OP, v);
        let tiles_x = d.n.div_ceil(self.bx as usize);
        // Under GLU a tile holds the gate and up rows of BW / 2 output columns.
        let tiles_w = if self.glu { (d.rows / 2).div_ceil(BW / 2) } else { d.rows.div_ceil(self.bw) };
        let groups = tiles_x.checked_mul(tiles_w).ok_or_else(|| Error::shape(OP, "grid overflows"))?;
        // The 16-byte view of F16 rows needs every run at a 16-byte boundary of its binding.
        if self.w_load == WLoad::F16Vec && (!d.w_off.is_multiple_of(16) || !d.row_bytes.is_multiple_of(16)) {
            return Err(Error::gpu(OP, "F16 rows read as 16-byte words must start at 16-byte boundaries"));
        }
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
            r_off: d.r_off,
            // The cooperative-matrix stores and loads of the direct drain need 16-byte
            // aligned rows.
            direct: (d.out_off.is_multiple_of(4)
                && d.out_stride.is_multiple_of(4)
                && (!self.add || d.r_off.is_multiple_of(4))
                && !direct_off()) as u32,
        };
        ctx.dispatch(pipeline, OP, bytemuck::bytes_of(&params), binds, ctx.grid_1d(u(groups)?))
    }
}

/// The kernel's output binding (3) and `out8(o, v, n)`, which writes elements o .. o + n (n <= 8)
/// of the output from v: f32, or f16 (GLU only; o is then a multiple of 8 and n is 8, see
/// `Plan::with_half_out`), rounded as x is rounded for this kernel.
fn output_wgsl(half: bool) -> &'static str {
    match half {
        false => {
            "@group(0) @binding(3) var<storage, read_write> out: array<f32>;\n\
             fn out8(o: u32, v: array<f32, 8>, n: u32) {\n\
                 for (var e = 0u; e < 8u; e++) { if (e < n) { out[o + e] = v[e]; } }\n}"
        }
        true => {
            "@group(0) @binding(3) var<storage, read_write> out: array<vec4<f16>>;\n\
             fn out8(o: u32, v: array<f32, 8>, n: u32) {\n\
                 out[o / 4u] = to_f16(vec4<f32>(v[0], v[1], v[2], v[3]));\n\
                 out[o / 4u + 1u] = to_f16(vec4<f32>(v[4], v[5], v[6], v[7]));\n}"
        }
    }
}

/// `store16(c, i)`: the 16 x 16 accumulator c into the output from element i, rows
/// p.out_stride apart (the direct drain: 16-byte aligned, which the cooperative-matrix stores
/// need). An f16 output has none: its GLU tiles all drain through the scratch, so it is never
/// called.
fn store16_wgsl(half: bool, emulated: bool) -> &'static str {
    match (half, emulated) {
        (false, false) => {
            "fn store16(c: coop_mat16x16<f32, C>, i: u32) {\n\
                 // The stride through a `let`: naga 30's SPIR-V writer does not emit a stride\n\
                 // expression written inline in the call (an internal error).\n\
                 let stride = p.out_stride;\n\
                 coopStoreT(c, &out[i], stride);\n}"
        }
        // This lane's 8 elements (row lane / 2, columns (lane % 2) * 8 ..).
        (false, true) => {
            "fn store16(c: EmuC, i: u32) {\n\
                 let at = i + (emu_lane / 2u) * p.out_stride + (emu_lane % 2u) * 8u;\n\
                 for (var j = 0u; j < 8u; j++) { out[at + j] = c.v[j]; }\n}"
        }
        (true, false) => "fn store16(c: coop_mat16x16<f32, C>, i: u32) {}",
        (true, true) => "fn store16(c: EmuC, i: u32) {}",
    }
}

/// x [n, cols] (f32, contiguous from its buffer's element `offset`, a multiple of 4) rounded to
/// f16 as the kernel's xvec section rounds it (clamped to ±65504), into a new f16 tensor for
/// the `Half` access: one dispatch, a few µs against the product's hundreds. With `norm` =
/// (weight [cols], eps) each row is RMS-normalised on the way (`rms_norm(x) * weight`, as
/// ops/norm.wgsl computes it, then rounded): the prefill's norm and rounding in one dispatch
/// instead of two, and no f32 copy of the normalised rows.
pub(super) fn x_to_f16(
    ctx: &GpuContext,
    x: &crate::Tensor,
    norm: Option<(&crate::Tensor, f32)>,
) -> Result<crate::Tensor> {
    const OP: &str = "qmatmul x to f16";
    let len = x.numel();
    let cols = x.dims().last().copied().unwrap_or(0);
    let out = crate::Tensor::gpu_empty(x.shape().clone(), crate::DType::F16, x.device())?;
    let xbuf = x.gpu_buffer().ok_or_else(|| Error::mismatch(OP, "input is not on a GPU"))?;
    let obuf = out.gpu_buffer().ok_or_else(|| Error::mismatch(OP, "output is not on a GPU"))?;
    let offset = x.layout().offset;
    if !len.is_multiple_of(8) || !cols.is_multiple_of(8) || !offset.is_multiple_of(4) {
        return Err(Error::shape(OP, format!("{len} elements at offset {offset} are not whole runs of 8")));
    }
    let u = |v: usize| to_u32(OP, v);
    let Some((g, eps)) = norm else {
        let spec = KernelSpec::new("qmatmul_x_f16", X_F16_WGSL, "main").with("enable f16;").with(TO_F16_WGSL);
        let pipeline = ctx.pipeline(&spec, &[])?;
        let runs = u(len / 8)?;
        let params = XF16Params { runs, off4: u(offset / 4)?, ..Default::default() };
        let binds = [Bind::Whole(xbuf), Bind::Whole(obuf)];
        ctx.dispatch(&pipeline, OP, bytemuck::bytes_of(&params), &binds, ctx.grid_1d(runs.div_ceil(256)))?;
        return Ok(out);
    };
    let g = super::gpu::norm_weight(OP, g, cols, x)?;
    if !g.layout().offset.is_multiple_of(4) {
        return Err(Error::Unsupported(format!("{OP}: a norm weight view off a 16-byte boundary")));
    }
    let gbuf = g.gpu_buffer().ok_or_else(|| Error::mismatch(OP, "norm weight is not on a GPU"))?;
    let rows = len / cols.max(1);
    let spec = KernelSpec::new("qmatmul_x_f16_rms", X_F16_WGSL, "rms").with("enable f16;").with(TO_F16_WGSL);
    let pipeline = ctx.pipeline(&spec, &[])?;
    let params = XF16Params {
        runs: u(len / 8)?,
        off4: u(offset / 4)?,
        rows: u(rows)?,
        row_runs: u(cols / 8)?,
        g_off4: u(g.layout().offset / 4)?,
        eps,
        ..Default::default()
    };
    let binds = [Bind::Whole(xbuf), Bind::Whole(obuf), Bind::Whole(gbuf)];
    ctx.dispatch(&pipeline, OP, bytemuck::bytes_of(&params), &binds, ctx.grid_1d(params.rows))?;
    Ok(out)
}

#[repr(C)]
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct XF16Params {
    runs: u32,
    off4: u32,
    rows: u32,
    row_runs: u32,
    g_off4: u32,
    eps: f32,
    _pad: [u32; 2],
}

const X_F16_WGSL: &str = "// x rounded to f16 for the coop kernel's xhalf section (quant/coop.rs, x_to_f16); `rms`
// RMS-normalises each row first.
struct Params {
    runs: u32,     // runs of 8 elements
    off4: u32,     // x's first element / 4
    rows: u32,     // rms: rows of row_runs runs
    row_runs: u32,
    g_off4: u32,   // rms: the norm weight's first element / 4
    eps: f32,
    _pad0: u32,
    _pad1: u32,
}
@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> y: array<vec4<f16>>;
@group(0) @binding(3) var<storage, read> g: array<vec4<f32>>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let r = gid.x + gid.y * nwg.x * 256u;
    if (r >= p.runs) {
        return;
    }
    y[2u * r] = to_f16(x[p.off4 + 2u * r]);
    y[2u * r + 1u] = to_f16(x[p.off4 + 2u * r + 1u]);
}

var<workgroup> red: array<f32, 256>;

// One workgroup per row: its sum of squares (f32, a tree over the invocations' partial sums, as
// ops/norm.wgsl's rms_norm), then x * (1 / rms) * weight rounded to f16.
@compute @workgroup_size(256)
fn rms(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.rows) {
        return;
    }
    let xr = p.off4 + 2u * row * p.row_runs;
    var ss = vec4<f32>(0.0);
    for (var j = lid; j < p.row_runs; j += 256u) {
        let a = x[xr + 2u * j];
        let b = x[xr + 2u * j + 1u];
        ss += a * a + b * b;
    }
    red[lid] = (ss.x + ss.y) + (ss.z + ss.w);
    workgroupBarrier();
    for (var k = 128u; k > 0u; k = k / 2u) {
        if (lid < k) {
            red[lid] = red[lid] + red[lid + k];
        }
        workgroupBarrier();
    }
    let inv_rms = inverseSqrt(red[0] / f32(8u * p.row_runs) + p.eps);
    let yr = 2u * row * p.row_runs;
    for (var j = lid; j < p.row_runs; j += 256u) {
        y[yr + 2u * j] = to_f16(x[xr + 2u * j] * inv_rms * g[p.g_off4 + 2u * j]);
        y[yr + 2u * j + 1u] = to_f16(x[xr + 2u * j + 1u] * inv_rms * g[p.g_off4 + 2u * j + 1u]);
    }
}
";

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
    /// Residual index of (x row 0, W row 0) (the residual epilogue).
    pub r_off: u32,
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
    r_off: u32,
    direct: u32,
}

/// `ANYGPU_COOP_DIRECT=0` (read once): every tile drains through the scratch, as before the
/// direct stores (for A/B measurements).
fn direct_off() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| std::env::var("ANYGPU_COOP_DIRECT").is_ok_and(|v| v == "0"))
}

/// The kernel's WGSL for one type, x access and W loader: common.wgsl with that type's
/// sections (none for [`WLoad::F16Vec`]), matmul_coop.wgsl with its `xvec`, `xscalar` or
/// `xhalf` section and the W loader ([`w_loader`]), and the forwards to the type's decoders;
/// or the tests' emulated variant. Built once per (type, access, loader, variant) and kept
/// (162 strings at most: two loaders per type, three for F16; three x accesses; real or
/// emulated), so the pipeline cache can key on a `&'static str`.
fn source(ty: GgmlType, x: XAccess, w_load: WLoad, emulated: bool) -> &'static str {
    static SOURCES: [[[[OnceLock<&'static str>; 2]; 4]; 3]; 13] =
        [const { [const { [const { [const { OnceLock::new() }; 2] }; 4] }; 3] }; 13];
    let ti = GgmlType::ALL.iter().position(|&t| t == ty).unwrap_or(0);
    let xi = XAccess::ALL.iter().position(|&a| a == x).unwrap_or(0);
    let li = WLoad::ALL.iter().position(|&l| l == w_load).unwrap_or(2);
    SOURCES[ti][xi][li][emulated as usize].get_or_init(|| {
        let name = wgsl_name(ty);
        let tag = x.tag(emulated);
        let mut kernel = keep_sections(COOP_WGSL, tag).replace("{{W_LOADER}}", &w_loader(w_load));
        if emulated {
            kernel = emulate(&kernel);
        }
        let forwards = match w_load {
            WLoad::Early => format!(
                "alias Raw_w = Raw8_{name};\n\
                 fn raw8(rb: u32, c: u32) -> Raw_w {{ return raw8_{name}(rb, c); }}\n\
                 fn dec8(r: Raw_w, rb: u32, c: u32) -> V8 {{ return dec8_{name}(r, rb, c); }}\n"
            ),
            _ => format!("fn deq8(rb: u32, c: u32, cols: u32) -> V8 {{ return deq8_{name}(rb, c, cols); }}\n"),
        };
        // The vec4 view of F16 rows needs none of common.wgsl, whose readers take the weights
        // as u32 words.
        let text = match w_load {
            WLoad::F16Vec => kernel,
            _ => format!("{}\n{kernel}\n{forwards}", keep_sections(COMMON_WGSL, name)),
        };
        Box::leak(text.into_boxed_str())
    })
}

/// How the kernel stages a run of 8 weights (row byte `rb`, column `c`, `n` of them valid):
/// `ld_w` reads it into a `Raw_w`, `st_w` puts it in the W tile as f16, and `W_EARLY` says
/// whether `ld_w` can be issued before the products (its loads are left untouched until
/// `st_w`) or must come after them (it decodes, waiting for its loads). A run of a quantized
/// row is 0 or 8 weights (rows are whole blocks), so `n` only says whether it is staged.
/// Each loader declares the weights' binding (1): u32 words, or 16-byte words for
/// [`WLoad::F16Vec`]. Built once per kernel source ([`source`]).
fn w_loader(load: WLoad) -> String {
    const WORDS: &str = "@group(0) @binding(1) var<storage, read> w: array<u32>;\n";
    // Both F16 loaders: a run's 16 raw bytes, converted after the products.
    const F16_STAGE: &str = "const W_EARLY: u32 = 1u;\n\
         alias Raw_w = vec4<u32>;\n\
         fn st_w(at: u32, r: Raw_w, n: u32, rb: u32, c: u32) {\n    \
             sw[at] = mask4(u2h(r.xy), n);\n    \
             sw[at + 1u] = mask4(u2h(r.zw), max(n, 4u) - 4u);\n}\n";
    match load {
        WLoad::Early => format!(
            "{WORDS}const W_EARLY: u32 = 1u;\n\
             fn ld_w(rb: u32, c: u32, n: u32) -> Raw_w {{\n    \
                 return raw8(rb, c);\n}}\n\
             fn st_w(at: u32, r: Raw_w, n: u32, rb: u32, c: u32) {{\n    \
                 let v = dec8(r, rb, c);\n    \
                 sw[at] = select(vec4<f16>(0.0h), vec4<f16>(v.lo), n > 0u);\n    \
                 sw[at + 1u] = select(vec4<f16>(0.0h), vec4<f16>(v.hi), n > 0u);\n}}\n"
        ),
        WLoad::F16Vec => format!(
            "@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;\n{F16_STAGE}\
             fn ld_w(rb: u32, c: u32, n: u32) -> Raw_w {{\n    \
                 return w[(rb + 2u * c) >> 4u];\n}}\n"
        ),
        WLoad::F16Raw => format!(
            "{WORDS}{F16_STAGE}\
             fn ld_w(rb: u32, c: u32, n: u32) -> Raw_w {{\n    \
                 let i = (rb + 2u * c) >> 2u;\n    \
                 return vec4<u32>(w[i], w[i + 1u], w[i + 2u], w[i + 3u]);\n}}\n"
        ),
        WLoad::Late => format!(
            "{WORDS}const W_EARLY: u32 = 0u;\n\
             alias Raw_w = V8;\n\
             fn ld_w(rb: u32, c: u32, n: u32) -> Raw_w {{\n    \
                 if (n == 0u) {{\n        return V8(vec4<f32>(0.0), vec4<f32>(0.0));\n    }}\n    \
                 return deq8(rb, c, p.cols);\n}}\n\
             fn st_w(at: u32, r: Raw_w, n: u32, rb: u32, c: u32) {{\n    \
                 sw[at] = vec4<f16>(r.lo);\n    \
                 sw[at + 1u] = vec4<f16>(r.hi);\n}}\n"
        ),
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
        ("coop_mat16x16<f16, A>", "EmuM"),
        ("coop_mat16x16<f16, B>", "EmuM"),
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

/// Every specialisation of the kernel (each type it takes, both tiles, the three x accesses) as
/// (label, WGSL, emulated), the tests' emulated variants included, for offline validation: most
/// machines cannot run the kernel.
#[doc(hidden)]
pub fn wgsl_variants() -> Vec<(String, String, bool)> {
    let mut v = Vec::new();
    for ty in GgmlType::ALL.into_iter().filter(|t| !matches!(t, GgmlType::F32 | GgmlType::BF16)) {
        for (bx, bk) in [(64, 32), (128, 32), (64, 64), (128, 64)] {
            for x in XAccess::ALL {
                for w_load in WLoad::ALL.into_iter().filter(|&l| match l {
                    WLoad::F16Vec | WLoad::F16Raw => ty == GgmlType::F16,
                    WLoad::Early => has_raw8(ty),
                    WLoad::Late => true,
                }) {
                    for emulated in [false, true] {
                        for (glu, add, half_out) in
                            [(false, false, false), (true, false, false), (true, false, true), (false, true, false)]
                        {
                            // The wide W tile: BX = 128, K 64, no GLU only.
                            let wide = bx == 128 && bk == 64 && !glu;
                            for bw in if wide { vec![BW, WIDE_BW] } else { vec![BW] } {
                                let plan = Plan { bx, bw, bk, x, w_load, glu, add, half_out };
                                let spec = plan.spec_as(ty, emulated);
                                let label = format!(
                                    "{} BX={bx} BW={bw} BK={bk} x={x:?} w_load={w_load:?} glu={glu} add={add} \
                                     half_out={half_out}",
                                    spec.name
                                );
                                v.push((label, spec.source_text(&[]), emulated));
                            }
                        }
                    }
                }
            }
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::wide_w_pays;

    /// The wide-tile rule against the H100 measurements it was made from (n = 512, Q4_0; see
    /// its doc): wide where it was faster, the 128-row tile where that was.
    #[test]
    fn wide_w_rule_matches_the_measured_shapes() {
        for (rows, wide_faster) in [
            (6144, true),   // the 8B's Q|K|V: 167-193 vs 256-272 us
            (4608, true),   // Qwen2-7B's Q|K|V: 148-151 vs 215-221
            (24576, true),  // 597-657 vs 717-732
            (12288, true),  // 339-341 vs 378-380
            (49152, true),  // a 49,152-token output head: 261-269 vs 283-285
            (8192, false),  // 358-368 vs 257-259
            (4096, false),  // 165-176 vs 134-140
            (15360, false), // 605-611 vs 589
            (3072, false),  // the 1B's Q|K|V: 83-93 vs 67-77
        ] {
            assert_eq!(wide_w_pays(512, rows), wide_faster, "{rows} rows");
        }
        // Short prompts: one round of 128-row workgroups leaves nothing to save.
        assert!(!wide_w_pays(100, 6144));
    }
}
