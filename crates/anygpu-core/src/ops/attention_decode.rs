//! The decode attention over a short cache (`attention_decode.wgsl`): one query position, one
//! workgroup per KV head, every key scored at once. [`attention::plan`](super::attention) takes
//! it instead of the flash kernel where a decode call is not split and its planned keys (the
//! cache's capacity, or a recording's horizon) fit the kernel's workgroup memory; the CPU
//! reference and the parity tests are the attention's (`tests/parity_attention.rs`).

use std::collections::HashMap;
use std::fmt::Write;
use std::sync::{Arc, Mutex, OnceLock};

use super::attention::Dims;
use super::to_u32;
use crate::error::Result;
use crate::gpu::{GpuContext, KernelSpec, Pipeline};
use crate::tensor::{DType, Tensor};

/// Invocations per workgroup (WebGPU's default limit: every adapter has it).
const NT: usize = 256;

/// The most keys the kernel is planned for: their scores, G rows of them, live in workgroup
/// memory. Past this a decode splits the keys (flash-decoding) anyway.
pub const DECODE_KERNEL_MAX_KEYS: usize = 256;

/// The kernel's shape constants for one call (see the header of attention_decode.wgsl).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct Shape {
    d: usize,
    d4: usize,
    g: usize,
    kmax: usize,
    /// Passes of KPP = NT / 8 keys per scores batch.
    uk: usize,
    r: usize,
    parts: usize,
    /// Keys per P V run and batch.
    uv: usize,
}

impl Shape {
    /// Workgroup bytes: q_s, p_s, inv_l, acc_s.
    fn smem(&self) -> usize {
        16 * self.g * self.d4 + 4 * self.g * self.kmax + 4 * self.g + 16 * self.parts * self.g * self.d4
    }
}

/// `ANYGPU_ATTN_DECODE=0` (read once): decode steps take the flash kernel, as before this
/// kernel (for comparisons).
fn decode_kernel_off() -> bool {
    static OFF: OnceLock<bool> = OnceLock::new();
    *OFF.get_or_init(|| std::env::var("ANYGPU_ATTN_DECODE").is_ok_and(|v| v == "0"))
}

/// K vec4s in flight per invocation in a scores batch, V vec4s in a P V batch: enough for a
/// 160-key cache in one batch of each at D = 128, few enough to stay in registers.
const K_IN_FLIGHT: usize = 24;
const V_IN_FLIGHT: usize = 20;

/// The shape of the kernel for a call of `s` planned for `keys` keys, or None where it does not
/// apply: not one query position, K / V not f32 rows of whole aligned vec4s (`kv_vec`), D not a
/// multiple of 32 (eight invocations read a key's row), no subgroups of at least 8 (they add up
/// a key's partial scores), more keys than [`DECODE_KERNEL_MAX_KEYS`], or more workgroup memory
/// than the device has.
pub(super) fn shape(ctx: &GpuContext, s: &Dims, keys: usize, k: &Tensor, kv_vec: bool) -> Option<Shape> {
    if s.tq != 1 || k.dtype() != DType::F32 || !kv_vec {
        return None;
    }
    shape_for(ctx, s.d, s.hq / s.hkv.max(1), keys)
}

/// [`shape`] for head dim `d`, `g` query heads per KV head and `keys` planned keys, the
/// operands aside (f32 K / V rows of whole aligned vec4s, one query position).
fn shape_for(ctx: &GpuContext, d: usize, g: usize, keys: usize) -> Option<Shape> {
    let c = &ctx.caps;
    if decode_kernel_off() || !d.is_multiple_of(32) || keys > DECODE_KERNEL_MAX_KEYS {
        return None;
    }
    if !c.subgroup || c.subgroup_min_size < 8 || NT > c.max_compute_invocations_per_workgroup as usize {
        return None;
    }
    let d4 = d / 4;
    if g == 0 || g > NT || g * d4 > 1024 {
        return None;
    }
    let kmax = keys.next_multiple_of(32);
    // P V's runs: as many as the invocations cover, at most 16 KiB of partial rows.
    let parts = prev_power_of_two((NT / d4).min(1024 / (g * d4)));
    if parts == 0 {
        return None;
    }
    let uk = kmax.div_ceil(NT / 8).min((K_IN_FLIGHT / (d4 / 8)).max(1));
    let uv = kmax.div_ceil(parts).min(V_IN_FLIGHT);
    // The softmax's lanes per row: one subgroup's aligned lanes (SGW of the lane reductions).
    let sgw = crate::quant::gpu::lane_width(ctx);
    let shape = Shape { d, d4, g, kmax, uk, r: prev_power_of_two(NT / g).min(sgw), parts, uv };
    (shape.smem() <= c.max_compute_workgroup_storage_size as usize).then_some(shape)
}

fn prev_power_of_two(x: usize) -> usize {
    if x == 0 {
        0
    } else {
        1 << (usize::BITS - 1 - x.leading_zeros())
    }
}

/// The most keys a decode step over a cache of f32 rows is planned for unsplit on `ctx`, for
/// head dim `d` and `g` query heads per KV head: [`DECODE_KERNEL_MAX_KEYS`] where this kernel
/// takes them, else the flash kernel's `DECODE_WHOLE_KEYS`.
pub fn short_decode_keys(ctx: &GpuContext, d: usize, g: usize) -> usize {
    match shape_for(ctx, d, g, DECODE_KERNEL_MAX_KEYS) {
        Some(_) => DECODE_KERNEL_MAX_KEYS,
        None => super::attention::DECODE_WHOLE_KEYS,
    }
}

type Blocks = Arc<Vec<(&'static str, String)>>;

/// [`blocks`], generated once per shape (the per-op decode plans every layer's attention for
/// every token: no need to rebuild some KiB of WGSL text each time).
fn blocks_cached(sh: Shape) -> Blocks {
    static CACHE: OnceLock<Mutex<HashMap<Shape, Blocks>>> = OnceLock::new();
    let mut map = CACHE.get_or_init(Default::default).lock().unwrap_or_else(|e| e.into_inner());
    map.entry(sh).or_insert_with(|| Arc::new(blocks(&sh))).clone()
}

/// The generated blocks of the kernel (see its header): the batches' loads, scores and P V
/// steps, unrolled over named variables.
fn blocks(sh: &Shape) -> Vec<(&'static str, String)> {
    let cols = sh.d4 / 8;
    let mut b: Vec<(&'static str, String)> = Vec::new();
    let mut out = |name: &'static str, f: &mut dyn FnMut(&mut String)| {
        let mut text = String::new();
        f(&mut text);
        b.push((name, text));
    };
    out("K_DECL", &mut |w| {
        for i in 0..sh.uk {
            let _ = writeln!(w, "    var kk{i} = 0u;");
            for j in 0..cols {
                let _ = writeln!(w, "    var kv{i}_{j} = vec4<f32>(0.0);");
            }
        }
    });
    out("K_LOAD", &mut |w| {
        for i in 0..sh.uk {
            let _ = writeln!(w, "        kk{i} = k0 + kq + {i}u * KPP;");
            for j in 0..cols {
                let _ = writeln!(w, "        kv{i}_{j} = kb[kbase + min(kk{i}, tk - 1u) * kst + c + {}u];", 8 * j);
            }
        }
    });
    out("SCORES", &mut |w| {
        for i in 0..sh.uk {
            for g in 0..sh.g {
                let terms: Vec<String> =
                    (0..cols).map(|j| format!("dot(q_s[{g}u * D4 + c + {}u], kv{i}_{j})", 8 * j)).collect();
                let _ = writeln!(w, "        let s{i}_{g} = lanes_sum({}, 8u);", terms.join(" + "));
            }
            let _ = writeln!(w, "        if (kk{i} < tk && c == 0u) {{");
            for g in 0..sh.g {
                let _ = writeln!(w, "            p_s[{g}u * KMAX + kk{i}] = s{i}_{g};");
            }
            let _ = writeln!(w, "        }}");
        }
    });
    out("V_DECL", &mut |w| {
        for i in 0..sh.uv {
            let _ = writeln!(w, "    var vk{i} = 0u;\n    var vv{i} = vec4<f32>(0.0);");
        }
    });
    out("V_LOAD", &mut |w| {
        for i in 0..sh.uv {
            let _ = writeln!(w, "    vk{i} = v0k + part + {i}u * PARTS;");
            let _ = writeln!(w, "    vv{i} = vb[vbase + min(vk{i}, tk - 1u) * vst + d4];");
        }
    });
    out("ACC_DECL", &mut |w| {
        for g in 0..sh.g {
            let _ = writeln!(w, "    var a{g} = vec4<f32>(0.0);");
        }
    });
    out("ACC_STEP", &mut |w| {
        for i in 0..sh.uv {
            let _ = writeln!(w, "        let in{i} = vk{i} < tk;");
            for g in 0..sh.g {
                let _ = writeln!(
                    w,
                    "        a{g} += select(0.0, p_s[{g}u * KMAX + min(vk{i}, KMAX - 1u)], in{i}) * vv{i};"
                );
            }
        }
    });
    out("ACC_STORE", &mut |w| {
        for g in 0..sh.g {
            let _ = writeln!(w, "        acc_s[(part * G + {g}u) * D4 + d4] = a{g};");
        }
    });
    b
}

/// Under `Tensor::attention_q8`: each written vec4 rounded to the 8-bit blocks of the output
/// projection's x [B, Hq * D] (round_q8.wgsl's layout, as ROUND_Q8_ATTENTION in attention.rs);
/// a block's eight vec4s are eight aligned lanes (D a multiple of 32 and subgroups of at least
/// 8: checked by `gpu_attention_q8`).
const ROUND_Q8_DECODE: &str = "        let w = h * D4 + c4;
        q8_round_lanes(o, bi * qc4 + w, p.batch * qc4 + 2u * (bi * (qc4 / 8u) + w / 8u), live, (e & 7u) == 0u);";

/// The decode kernel's pipeline for a call of shape `sh` (from [`shape`]); `q8_header`: the
/// rounding variant's header (its binding and functions). One workgroup per (batch, KV head).
pub(super) fn decode_pipeline(ctx: &GpuContext, sh: Shape, q8_header: Option<String>) -> Result<Pipeline> {
    let u = |x: usize| to_u32("attention", x);
    let q8 = q8_header.is_some();
    let spec = KernelSpec::new(
        format!("attention_decode_d{}_g{}_k{}{}", sh.d, sh.g, sh.kmax, if q8 { "_q8" } else { "" }),
        include_str!("attention_decode.wgsl"),
        "attention_decode",
    )
    .with(super::attention::ATTENTION_PARAMS_WGSL)
    .constant_u32("D", u(sh.d)?)
    .constant_u32("D4", u(sh.d4)?)
    .constant_u32("G", u(sh.g)?)
    .constant_u32("NT", NT as u32)
    .constant_u32("KMAX", u(sh.kmax)?)
    .constant_u32("KPP", u(NT / 8)?)
    .constant_u32("UK", u(sh.uk)?)
    .constant_u32("UV", u(sh.uv)?)
    .constant_u32("R", u(sh.r)?)
    .constant_u32("PARTS", u(sh.parts)?)
    .with(&q8_header.unwrap_or_else(|| crate::quant::gpu::lane_reductions_wgsl(ctx).to_string()));
    let blocks = blocks_cached(sh);
    let mut repl: Vec<(&str, &str)> = blocks.iter().map(|(k, v)| (*k, v.as_str())).collect();
    repl.push(("ROUND_Q8", if q8 { ROUND_Q8_DECODE } else { "" }));
    ctx.pipeline(&spec, &repl)
}
