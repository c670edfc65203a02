//! Prefill attention on cooperative matrices (attention_coop.wgsl): Q K^T and P V on tensor
//! cores in f16 with f32 accumulation, the softmax in f32. `gpu_attention` takes it for runs of
//! at least [`COOP_MIN_TQ`] queries where the device has 16x16x16 f16 cooperative matrices and
//! the shapes suit it (head dim a multiple of 16 up to 128, f32 K / V with contiguous 16-byte
//! aligned rows); elsewhere the flash kernel (attention.wgsl), exact in f32, runs.
//! `ANYGPU_ATTN_COOP=0` keeps the flash kernel everywhere (for comparisons).

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

use super::attention::{check, gpu_output, out_strides, AttentionOpts, Dims};
use super::elementwise::buf;
use super::{gpu_of, to_u32};
use crate::error::Result;
use crate::gpu::{Bind, GpuContext, KernelSpec};
use crate::tensor::{DType, Tensor};

const OP: &str = "attention";

/// Queries from which prefill attention runs here: below, the 64-query block is mostly
/// padding, and the short prompts of chat turns stay exact in f32 on the flash kernel.
pub const COOP_MIN_TQ: usize = 64;

/// Queries per workgroup (attention_coop.wgsl's BQ) and keys per step (BK).
const BQ: usize = 64;
const BK: usize = 32;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    batch: u32,
    hq: u32,
    hkv: u32,
    tq: u32,
    tk: u32,
    causal: u32,
    scale: f32,
    n_qb: u32,
    q_off: u32,
    k_off: u32,
    v_off: u32,
    paired: u32,
    qs: [u32; 4],
    ks: [u32; 4],
    vs: [u32; 4],
    os: [u32; 4],
}

/// See [`set_emulated`].
static EMULATED: AtomicBool = AtomicBool::new(false);

/// Tests only: run the kernel with its cooperative matrices emulated in plain WGSL (see the
/// shader's last section), so that it runs on devices without them, such as lavapipe (it needs
/// SHADER_F16). Process-wide until turned off.
#[doc(hidden)]
pub fn set_emulated(on: bool) {
    EMULATED.store(on, Ordering::Relaxed);
}

fn off_by_env() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| std::env::var("ANYGPU_ATTN_COOP").is_ok_and(|v| v == "0"))
}

/// Workgroup memory of the kernel for head dim `d`: the Q, K, V and P tiles of vec4<f16>, the
/// f32 scratch (private when emulated) and the row exchange.
fn workgroup_bytes(d: usize, emulated: bool) -> u32 {
    let row = (d + 8) * 2;
    ((BQ + 2 * BK) * row + BQ * (BK + 8) * 2 + if emulated { 0 } else { 8192 } + 512) as u32
}

/// Whether this device and these operands take the kernel.
fn usable(ctx: &GpuContext, s: &Dims, k: &Tensor, v: &Tensor, emulated: bool) -> bool {
    // K and V rows: f32, contiguous, starting on 16 bytes (vec4 loads).
    let rows_ok = |t: &Tensor| {
        let l = t.layout();
        t.dtype() == DType::F32
            && l.strides[3] == 1
            && l.offset.is_multiple_of(4)
            && l.strides[..3].iter().all(|x| x.is_multiple_of(4))
    };
    let c = &ctx.caps;
    let device_ok = match emulated {
        true => c.shader_f16 && c.max_compute_invocations_per_workgroup >= 128,
        false => c.coop_f16_unsupported(workgroup_bytes(s.d, false)).is_none(),
    };
    device_ok
        && s.tq >= COOP_MIN_TQ
        && s.tk > 0
        && s.d.is_multiple_of(16)
        && (16..=128).contains(&s.d)
        && rows_ok(k)
        && rows_ok(v)
        && workgroup_bytes(s.d, emulated) <= c.max_compute_workgroup_storage_size
}

/// Query blocks (workgroups, unpaired) from which a causal run pairs them: a workgroup then
/// runs a late block and an early one, whose keys add up alike for every pair (see the
/// kernel's `attention`), instead of the last blocks walking twice the average while the
/// first ones' SMs idle. With fewer blocks every one has an SM to itself, and a pair would
/// only lengthen the longest. H100, 32 / 8 heads, kernel alone (`parity_attention bench`):
/// 512 queries (256 blocks) 98.0 -> 75.0 µs at D = 128, 65.7 -> 47.9 at D = 64; 2,048
/// queries 841.5 -> 793.6; but 128 queries (64 blocks) 16.9 -> 25.3.
const PAIR_MIN_BLOCKS: usize = 256;

/// `ANYGPU_ATTN_PAIRS=0|1` (read once), or the tests' [`set_pairs`]: unpaired or paired
/// blocks under a causal mask whatever their count (for comparisons and tests).
static PAIRS_FORCED: AtomicU8 = AtomicU8::new(u8::MAX);

/// Tests only: force the pairing of causal query blocks on (`Some(true)`) or off, or leave it
/// to the rule (`None`). Process-wide until reset.
#[doc(hidden)]
pub fn set_pairs(v: Option<bool>) {
    PAIRS_FORCED.store(v.map_or(u8::MAX, u8::from), Ordering::Relaxed);
}

/// Whether a run of `blocks` query blocks (batch x heads x blocks per head) pairs them.
fn pairs_blocks(causal: bool, blocks: usize) -> bool {
    static ENV: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    let env = *ENV.get_or_init(|| std::env::var("ANYGPU_ATTN_PAIRS").ok().map(|v| v != "0"));
    let forced = match PAIRS_FORCED.load(Ordering::Relaxed) {
        u8::MAX => env,
        v => Some(v == 1),
    };
    causal && forced.unwrap_or(blocks >= PAIR_MIN_BLOCKS)
}

/// The kernel's source: as written, or with its matrices emulated (the tests' variant).
fn source(emulated: bool) -> String {
    let text = include_str!("attention_coop.wgsl");
    let (kernel, emu) = text.split_once("// @@ emu").unwrap_or((text, ""));
    if !emulated {
        return kernel.to_string();
    }
    const SWAPS: [(&str, &str); 17] = [
        ("coopLoadT<coop_mat16x16<f16, A>>(&sq[", "emu_ld(0u, "),
        ("coopLoadT<coop_mat16x16<f16, A>>(&sp[", "emu_ld(1u, "),
        ("coopLoad<coop_mat16x16<f16, B>>(&sk[", "emu_ld(2u, "),
        ("coopLoadT<coop_mat16x16<f16, B>>(&sv[", "emu_ld(3u, "),
        ("], SD4)", ", SD4)"),
        ("], SP4)", ", SP4)"),
        ("coopMultiplyAdd(", "emu_mad("),
        ("coopStoreT(", "emu_store("),
        ("&scratch[sg * 512u], 32u)", "sg * 512u, 32u)"),
        ("&scratch[sg * 512u + 16u], 32u)", "sg * 512u + 16u, 32u)"),
        ("&scratch[sg * 512u], 16u)", "sg * 512u, 16u)"),
        ("coop_mat16x16<f32, C>()", "EmuC()"),
        ("coop_mat16x16<f32, C>", "EmuC"),
        ("var<workgroup> scratch", "var<private> scratch"),
        ("@builtin(subgroup_id) sg: u32,", ""),
        ("@builtin(subgroup_invocation_id) lane: u32,", ""),
        (
            "    let wg = wid.x + wid.y * nwg.x;",
            "    let sg = tid / 32u;\n    let lane = tid % 32u;\n    emu_lane = lane;\n    let wg = wid.x + wid.y * nwg.x;",
        ),
    ];
    let mut s = kernel.to_string();
    for (from, to) in SWAPS {
        s = s.replace(from, to);
    }
    s + super::COOP_EMU_WGSL + emu
}

/// The kernel's f32 output and its `out8` (elements at .. at + 8 from the scratch, scaled).
const OUT_F32: &str = "@group(0) @binding(4) var<storage, read_write> ob: array<f32>;
fn out8(at: u32, s: u32, inv: f32) {
    for (var e = 0u; e < 8u; e++) {
        ob[at + e] = scratch[s + e] * inv;
    }
}";

/// The f16 output: rounded as a product that reads x as f16 rounds it (`to_f16`,
/// super::TO_F16_WGSL); at is a multiple of 8 (D is a multiple of 16).
const OUT_F16: &str = "@group(0) @binding(4) var<storage, read_write> ob: array<vec4<f16>>;
fn out8(at: u32, s: u32, inv: f32) {
    let lo = vec4<f32>(scratch[s], scratch[s + 1u], scratch[s + 2u], scratch[s + 3u]) * inv;
    let hi = vec4<f32>(scratch[s + 4u], scratch[s + 5u], scratch[s + 6u], scratch[s + 7u]) * inv;
    ob[at / 4u] = to_f16(lo);
    ob[at / 4u + 1u] = to_f16(hi);
}";

/// The kernel's WGSL for head dim `d`, its output f16 or f32 (tests validate every variant
/// offline).
#[doc(hidden)]
pub fn spec(d: usize, emulated: bool, half_out: bool) -> KernelSpec {
    // Built once per variant: the pipeline cache knows a source by its address.
    static SOURCES: [std::sync::OnceLock<String>; 2] = [std::sync::OnceLock::new(), std::sync::OnceLock::new()];
    let text: &'static str = SOURCES[emulated as usize].get_or_init(|| source(emulated));
    let d = d as u32;
    // Its tiles', scratch's and staged K / V registers' indices are offsets that BQ, BK, NT
    // and D bound.
    let spec = KernelSpec::new(format!("attention_coop{}_d{d}", if emulated { "_emu" } else { "" }), text, "attention")
        .with("enable f16;")
        .bounded_by_design();
    let spec = if emulated { spec } else { spec.with("enable wgpu_cooperative_matrix;") };
    spec.constant_u32("D", d).with(super::TO_F16_WGSL).with(if half_out { OUT_F16 } else { OUT_F32 })
}

/// Whether [`gpu_attention_coop`] runs this call (a GPU, the device and operands it takes): its
/// f16 operands round the scores, so tests compare it to the CPU with a wider tolerance.
pub fn takes(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<bool> {
    let s = check(q, k, v)?;
    let Some(ctx) = q.device().gpu() else { return Ok(false) };
    Ok(!off_by_env() && usable(ctx, &s, k, v, EMULATED.load(Ordering::Relaxed)))
}

/// Attention on cooperative matrices, or `None` where it does not apply (see the module docs).
pub fn gpu_attention_coop(q: &Tensor, k: &Tensor, v: &Tensor, opts: &AttentionOpts) -> Result<Option<Tensor>> {
    let s = check(q, k, v)?;
    let ctx = gpu_of(OP, q)?;
    let emulated = EMULATED.load(Ordering::Relaxed);
    if off_by_env() || !usable(&ctx, &s, k, v, emulated) {
        return Ok(None);
    }
    let out = gpu_output([s.b, s.hq, s.tq, s.d], opts.f16_out, q.device())?;
    let u = |x: usize| to_u32(OP, x);
    let st = |t: &Tensor| -> Result<[u32; 4]> {
        let l = &t.layout().strides;
        Ok([u(l[0])?, u(l[1])?, u(l[2])?, u(l[3])?])
    };
    // Every element index the kernel forms must fit u32.
    for t in [q, k, v, &out] {
        u(t.layout().offset + t.dims().iter().zip(&t.layout().strides).map(|(n, s)| (n - 1) * s).sum::<usize>())?;
    }
    let n_qb = s.tq.div_ceil(BQ);
    let paired = pairs_blocks(opts.causal, s.b * s.hq * n_qb);
    let units = if paired { n_qb.div_ceil(2) } else { n_qb };
    let params = Params {
        batch: u(s.b)?,
        hq: u(s.hq)?,
        hkv: u(s.hkv)?,
        tq: u(s.tq)?,
        tk: u(s.tk)?,
        causal: opts.causal as u32,
        scale: opts.scale * std::f32::consts::LOG2_E,
        n_qb: u(n_qb)?,
        q_off: u(q.layout().offset)?,
        k_off: u(k.layout().offset)?,
        v_off: u(v.layout().offset)?,
        paired: paired as u32,
        qs: st(q)?,
        ks: st(k)?,
        vs: st(v)?,
        os: out_strides(&out)?,
    };
    let pipeline = ctx.pipeline(&spec(s.d, emulated, opts.f16_out), &[])?;
    let binds = [Bind::Whole(buf(q)?), Bind::Whole(buf(k)?), Bind::Whole(buf(v)?), Bind::Whole(buf(&out)?)];
    let wgs = u(s.b * s.hq * units)?;
    ctx.dispatch(&pipeline, OP, bytemuck::bytes_of(&params), &binds, ctx.grid_1d(wgs))?;
    Ok(Some(out))
}
