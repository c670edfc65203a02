//! WGSL kernels that read GGML blocks as stored: quantized matrix-vector / matrix-matrix
//! products and row gathers. The weights stay in VRAM exactly as the file holds them
//! (`QStorage::Gpu`, bound as `array<u32>`); kernels decode blocks in registers.
//!
//! # Decode (n = 1): memory-bound, the floor is weight bytes / bandwidth
//!
//! Bytes per row of `cols` weights: F32 4·cols, F16/BF16 2·cols, Q8_0 34·cols/32 (1.06 B per
//! weight), Q6_K 210·cols/256 (0.82), Q5_1 24/32 (0.75), Q5_0 22/32 and Q5_K 176/256 (0.69),
//! Q4_1 20/32 (0.625), Q4_0 18/32 and Q4_K 144/256 (0.5625), Q3_K 110/256 (0.43), Q2_K 84/256
//! (0.33). On an H100 (~3 TB/s): a 4096 x 4096 Q4_K matrix is 9.4 MB, 3.1 µs; a 32000 x 4096
//! one 74 MB, 25 µs; a 576 x 1536 Q4_1 one 0.55 MB, 0.18 µs, far below what a dispatch costs
//! (~9 µs of submit and GPU time per dispatch as the context records them today), so small
//! matrices are bound by dispatch overhead, not by these kernels. y is rows·4 bytes; x is
//! cols·4 bytes but read by every workgroup, which is what shaped the design:
//!
//! # Design (matvec.wgsl), and what the H100 measurements taught
//!
//! 256 invocations per workgroup, `TPR` = 32 per row (fewer for short rows, more for products
//! of few rows: see matvec_layout.rs), 8 rows per workgroup (1,024 invocations and 32 rows
//! under the rounding epilogue, `Epilogue::AddRound`, whose workgroups each round one 8-bit
//! block of their output for the next norm). A work unit is one 4-byte quant
//! word of a 32-weight block (4 units per block) or 16 weights of a k-quant super-block (16
//! units per block), plus the block's scales; invocation t takes units t, t + TPR, ... four at
//! a time (independent loads in flight), decodes them in registers and multiplies with x at
//! once; the min / offset terms fold per group as d·Σq·x − m·Σx; partial sums meet in a
//! workgroup tree. Byte lanes become floats through the exact `0x4B000000 | b` − 2^23 trick
//! instead of int-to-float conversions (quarter rate).
//! Blocks whose size is not a multiple of 4 bytes (18, 22, 34, 110, 210) are read as words and
//! funnel-shifted (common.wgsl). Earlier designs and why they lost (32000 x 4096, GPU time):
//! - one whole block per invocation: neighbouring invocations read x 128-256 bytes apart, so
//!   each vec4 load of a warp touched 32 cache lines: Q4_0 97 µs, Q8_0 180 µs at best;
//! - the same with x reused from registers across 4 rows: worse (Q4_0 247 µs at best; the
//!   lines, not the bytes, were the cost, and the extra registers cut occupancy);
//! - word-sized units (coalesced x and W): Q4_0 91 µs, Q8_0 91 µs; then four units per step:
//!   Q4_0 76 µs, Q8_0 89 µs, F16 123 µs.
//!
//! Measured with the parity_qmatmul bench (H100, Vulkan, 2026-11-22; GPU time per call, which
//! includes a per-dispatch floor: ~9 µs since the context's cheaper dispatch recording, ~20 µs
//! before), 32000 x 4096: Q8_0 76 µs (1.83 TB/s of weights), Q6_K 88 µs (1.22), Q4_0 64 µs
//! (1.16), Q4_K 72 µs (1.03); with the ~20 µs floor: F32 205 µs (2.56), F16 134 µs (1.96), Q5_1
//! 90 µs (1.10), Q4_1 78 µs (1.06), Q5_K 95 µs (0.95), Q5_0 100 µs (0.91), Q3_K 136 µs (0.41),
//! Q2_K 105 µs (0.41). Same machine, PyTorch (CUDA events, no floor): torch.mv f16 on that
//! matrix 100 µs (2.63 TB/s), copy 2.98 TB/s. Runs on different machines varied by up to 1.7x.
//! Q2_K / Q3_K, whose units do 4 scale extractions per word, are bound by instructions. For
//! the others, later H100 runs (BENCHMARKS.md, seventh and eighth sessions) point to loads, not
//! arithmetic: more workgroups per product (`MATVEC_MIN_GROUPS`, matvec_layout.rs) won; 8-bit x
//! staged in each workgroup's memory lost (every workgroup waits for its staging), while 8-bit
//! x read from memory won (below). The bench reads one
//! matrix over and over: its figures for matrices under 50 MB (the H100's L2) come from cache.
//!
//! Where x is normalised outside the kernel anyway, the 32-weight block types and Q4_K / Q5_K /
//! Q6_K take x rounded to 8-bit blocks in that dispatch and use integer dot products
//! (matvec_q8.wgsl, `x_q8`): their f32 x loads (two vec4 per unit, eight cache lines per warp
//! load) had cost more than their weight loads. Their units are then whole blocks, or 64-weight
//! chunks of the k-quants (Q4_0: 8 loads per 32 weights instead of about 30; H100, 8B Q4_0
//! decode step 3.98 -> 3.28 ms of GPU time).
//! `QBENCH_ROTATE=4` makes the bench take copies of W in turn, and its `kernels` column times
//! the dispatches on the GPU.
//!
//! # Prefill (n > 1)
//!
//! matmul.wgsl: 64 x 64 output tiles, K in steps of 32; each step dequantizes the W tile into
//! workgroup memory once and reuses it for 64 x rows (16 KiB of workgroup memory: WebGPU's
//! default); 4 x 4 outputs per invocation. 4096 x 4096 x 512 on the H100: 8.8-10.7 TFLOP/s for
//! the quantized types, 8.5 for F32, 7.7 for F16, 4.2 for BF16 (the f32 matmul figure of
//! `anygpu doctor` in BENCHMARKS.md: 0.35). Small batches
//! (n <= [`MATVEC_MAX_N`]) use the matvec kernel once per x row: a grid of 64-row tiles leaves
//! the GPU mostly idle there.
//!
//! # Limits
//!
//! A matrix larger than `max_storage_buffer_binding_size` (128 MiB under WebGPU's defaults) is
//! bound in row slices at offsets that are multiples of 256 bytes, one dispatch per slice; x and
//! the output are sliced the same way over x rows when they exceed the limit.

use std::sync::{Arc, OnceLock};

use super::matvec_layout::{matvec_units, paired_out_rows, MatvecLayout, Staging};
use super::{CpuMath, GgmlType, QStorage, QTensor};
use crate::error::{Error, Result};
use crate::gpu::{Bind, GpuBuffer, GpuContext, KernelSpec};
use crate::ops::attention::AttentionPartials;
use crate::ops::rope::{RopeOpts, ROPE_MATH_WGSL};
use crate::ops::to_u32;
use crate::tensor::{DType, Tensor};

pub(super) const COMMON_WGSL: &str = include_str!("common.wgsl");
const MATVEC_WGSL: &str = include_str!("matvec.wgsl");
const MATVEC_ROPE_WGSL: &str = include_str!("matvec_rope.wgsl");
const MATVEC_COMBINE_WGSL: &str = include_str!("matvec_combine.wgsl");
const MATVEC_Q8_WGSL: &str = include_str!("matvec_q8.wgsl");
const QUANTIZE_Q8_WGSL: &str = include_str!("quantize_q8.wgsl");
/// The rounding to 8-bit blocks (`q8_round`, `q8_store`, `q8_round_lanes`), for kernels with a
/// binding `xq` (see the file).
pub(crate) const ROUND_Q8_WGSL: &str = include_str!("round_q8.wgsl");
const MATMUL_WGSL: &str = include_str!("matmul.wgsl");
const GATHER_WGSL: &str = include_str!("gather.wgsl");
const DEQUANT_F16_WGSL: &str = include_str!("dequant_f16.wgsl");

/// Invocations per workgroup of every kernel here (WebGPU's default maximum).
pub(super) const WG: usize = 256;

/// Binding offsets are rounded down to this (WebGPU caps min_storage_buffer_offset_alignment
/// at 256, and every power of two up to it divides it).
const BIND_ALIGN: u64 = 256;

/// Up to this many x rows, the matvec kernel (run once per x row) beats the tiled one, whose
/// 64 x 64 tiles leave a GPU mostly idle at small n (H100, 4096 x 4096 Q4_K: 154 µs against
/// 565 µs at n = 16).
pub const MATVEC_MAX_N: usize = 16;

/// The widest x row the matvec kernel's RMSNorm prologue takes (see `qmatvec_fused`). H100,
/// with the shuffle reductions and the prefetch: 1B F16 (2048-wide) tg128 592-594 -> 600 tok/s
/// at 2048 (16 rms_norm dispatches fewer); 8B Q4_0 at 4096 202.6 -> 199.1 (its gate|up has too
/// many workgroups for the prologue anyway, Q|K|V alone got it and lost).
pub const NORM_PROLOGUE_MAX_COLS: usize = 2048;

/// SGW of [`lane_reductions_wgsl`]: the lanes its shuffles reduce over (the device's
/// smallest subgroup, at most 32), 1 without subgroups.
pub(crate) fn lane_width(ctx: &GpuContext) -> usize {
    match (ctx.caps.subgroup, ctx.caps.subgroup_min_size) {
        (true, n) if n >= 32 => 32,
        (true, n) if n >= 16 => 16,
        (true, n) if n >= 8 => 8,
        (true, n) if n >= 4 => 4,
        _ => 1,
    }
}

/// The matvec kernel's `SGW`, `lanes_sum` and `lanes_max` (see matvec.wgsl): subgroup
/// shuffles (naga takes them without an `enable` directive, which it rejects, once the device
/// has SUBGROUP) over up to 32 lanes where every subgroup has at least that many, else the
/// identity (SGW = 1). H100, SmolLM2 decode (row sums, the RMSNorm prologue and the combine
/// prologue's max and sum): GPU time per token 1.015 -> 0.971 ms, tg128 961 -> 1,015 tok/s.
pub(crate) fn lane_reductions_wgsl(ctx: &GpuContext) -> &'static str {
    macro_rules! shuffles {
        ($w:literal) => {
            concat!(
                "const SGW: u32 = ",
                $w,
                "u;
fn lanes_sum(v: f32, width: u32) -> f32 {
    var s = v;
    for (var o = width / 2u; o > 0u; o >>= 1u) {
        s += subgroupShuffleXor(s, o);
    }
    return s;
}
fn lanes_max(v: f32, width: u32) -> f32 {
    var s = v;
    for (var o = width / 2u; o > 0u; o >>= 1u) {
        s = max(s, subgroupShuffleXor(s, o));
    }
    return s;
}"
            )
        };
    }
    match lane_width(ctx) {
        32 => shuffles!("32"),
        16 => shuffles!("16"),
        8 => shuffles!("8"),
        4 => shuffles!("4"),
        _ => {
            "const SGW: u32 = 1u;
fn lanes_sum(v: f32, width: u32) -> f32 {
    return v;
}
fn lanes_max(v: f32, width: u32) -> f32 {
    return v;
}"
        }
    }
}

/// The most workgroups a product with the RMSNorm prologue may have (see `qmatvec_fused`).
pub const NORM_PROLOGUE_MAX_GROUPS: usize = 1024;

/// The most bytes of attention partials that the workgroups of one product may read in all
/// under the combine prologue (`Prologue::Combine`: every workgroup re-reads all of its x row's
/// partials, n_splits x H x (D + 2) floats, from the cache); above it the separate combine
/// dispatch runs. SmolLM2's wo product (72 workgroups, H = 9, D = 64) reads 171 KB per split:
/// 2.7 MB at the 16 splits of a 512-position cache, 22 MB at the 128 of a 4096-position one;
/// at ~5-7 TB/s of H100 L2 bandwidth the budget should cost ~3-5 µs spread over the
/// workgroups, less than the ~7.7 µs of the combine dispatch it replaces (an estimate, not yet
/// measured). 8B shapes (4096 x 4096 wo: 512 workgroups, H = 32, D = 128) would read 8.5 MB
/// per split (545 MB at the 64 splits of a 4096-position cache): they keep the separate
/// dispatch.
pub const COMBINE_PROLOGUE_MAX_BYTES: u64 = 24 << 20;

/// Which kernel a product uses (tests force each one on every shape).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QKernel {
    /// The matrix-vector kernel, once per x row.
    Matvec,
    /// The tiled matrix-matrix kernel.
    Tiled,
    /// The tiled product on cooperative matrices (tensor cores; quant/coop.rs): x and the
    /// dequantized weights rounded to f16, f32 accumulation. The default for more than
    /// [`MATVEC_MAX_N`] x rows where the device runs it (quantized and F16 weights only);
    /// forcing it elsewhere is `Error::Unsupported`.
    Coop,
}

/// Knobs for tests and benchmarks; `Default` is what `QTensor::qmatmul` uses.
#[derive(Clone, Copy, Debug, Default)]
pub struct QOptions {
    /// Force a kernel instead of choosing by the number of x rows.
    pub kernel: Option<QKernel>,
    /// Bind at most this many bytes at once (tests of the row slicing); the device's
    /// `max_storage_buffer_binding_size` when `None`.
    pub max_binding: Option<u64>,
    /// Invocations per row of the matvec kernel (a power of two up to 256), for tuning;
    /// chosen from the row length when `None`.
    pub threads_per_row: Option<usize>,
    /// W rows per row slot of the matvec kernel (1 or 2, see matvec_layout.rs), for tests;
    /// chosen by the weights' type when `None`.
    pub rows_per_slot: Option<usize>,
    /// Whether the matvec rounds x to 8-bit blocks first (matvec_q8.wgsl; the 32-weight block
    /// types and Q4_K / Q5_K / Q6_K): `Some(true)` forces it, `Some(false)` never; `None`: where
    /// a matrix marked [`CpuMath::Q8`] has x normalised outside the matvec (see `x_q8` in this
    /// module).
    pub x_q8: Option<bool>,
    /// Where the coop kernel runs a GLU product ([`QTensor::qmatmul_glu_opts`] of many x rows)
    /// and its output rows are whole runs of 8, the output is f16, rounded and clamped as a
    /// product that reads x as f16 rounds its x: the FFN's down projection then reads it as it
    /// is (no f32 output written and read back, no rounding dispatch between the two).
    /// Elsewhere the output stays f32. (The products without a norm prologue take f16 x:
    /// `QTensor::qmatmul`, `qmatmul_add`, `qmatmul_add_rounding`, `qmatmul_glu`; widened to
    /// f32, exactly, where their kernel does not read x as f16.)
    pub f16_out: bool,
}

/// The WGSL suffix of a type's functions (`mv_q4_0`, `deq8_q4_0`).
pub(super) fn wgsl_name(ty: GgmlType) -> &'static str {
    match ty {
        GgmlType::F32 => "f32",
        GgmlType::F16 => "f16",
        GgmlType::BF16 => "bf16",
        GgmlType::Q4_0 => "q4_0",
        GgmlType::Q4_1 => "q4_1",
        GgmlType::Q5_0 => "q5_0",
        GgmlType::Q5_1 => "q5_1",
        GgmlType::Q8_0 => "q8_0",
        GgmlType::Q2K => "q2k",
        GgmlType::Q3K => "q3k",
        GgmlType::Q4K => "q4k",
        GgmlType::Q5K => "q5k",
        GgmlType::Q6K => "q6k",
    }
}

/// Whether a product of `ty` reads its weights as `array<vec4<u32>>` (matvec.wgsl's `w4_at`
/// as one 16-byte load instead of four word loads; see [`vec4_weights`]): the Q8 units of Q4_K
/// and Q5_K, whose super-blocks (144 and 176 bytes) keep every run of four words they read
/// 16-byte aligned when each row, and so each slice's first row, starts on a 16-byte boundary
/// of its binding. `ANYGPU_W_VEC4=0` (read once) keeps every product on words, for comparisons.
fn w_vec4_view(ty: GgmlType, q8: bool, row_bytes: usize, slices: &[RowSlice]) -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("ANYGPU_W_VEC4").map_or(true, |v| v != "0"))
        && q8
        && matches!(ty, GgmlType::Q4K | GgmlType::Q5K)
        && row_bytes.is_multiple_of(16)
        && slices.iter().all(|s| s.w_off.is_multiple_of(16))
}

/// A run of W rows bound on their own: `rows` rows from `r0`, bound at byte `bind_off` of the
/// weight buffer for `bind_len` bytes; row r0 starts `w_off` bytes into the binding.
struct RowSlice {
    r0: usize,
    rows: usize,
    bind_off: u64,
    bind_len: u64,
    w_off: u32,
}

/// Splits W into row slices that each fit in one binding of at most `max_binding` bytes.
fn row_slices(op: &'static str, w: &QTensor, max_binding: u64) -> Result<Vec<RowSlice>> {
    let rb = w.row_bytes() as u64;
    let total = w.byte_len() as u64;
    if total <= max_binding {
        return Ok(vec![RowSlice { r0: 0, rows: w.rows(), bind_off: 0, bind_len: total, w_off: 0 }]);
    }
    // Each slice may start up to BIND_ALIGN - 1 bytes into its binding.
    let per = max_binding.saturating_sub(BIND_ALIGN) / rb.max(1);
    if per == 0 {
        return Err(Error::Unsupported(format!(
            "{op}: one row of the {} [{}, {}] matrix is {rb} bytes, more than this device binds at once \
             (max_storage_buffer_binding_size {max_binding} bytes)",
            w.ggml_type(),
            w.rows(),
            w.cols()
        )));
    }
    let mut out = Vec::new();
    let mut r0 = 0usize;
    while r0 < w.rows() {
        let rows = (per as usize).min(w.rows() - r0);
        let start = r0 as u64 * rb;
        let bind_off = start / BIND_ALIGN * BIND_ALIGN;
        let w_off = (start - bind_off) as u32;
        out.push(RowSlice { r0, rows, bind_off, bind_len: w_off as u64 + rows as u64 * rb, w_off });
        r0 += rows;
    }
    Ok(out)
}

/// The weight buffer and its context.
pub(super) fn gpu_weights(op: &'static str, w: &QTensor) -> Result<(Arc<GpuBuffer>, Arc<GpuContext>)> {
    match w.storage() {
        QStorage::Gpu(b) => Ok((b.clone(), b.context().clone())),
        QStorage::Cpu { .. } => Err(Error::mismatch(op, "weights are not on a GPU")),
    }
}

/// The largest binding to use: the device's limit (or a test's), kept within the kernels' u32
/// byte offsets.
pub(super) fn binding_limit(ctx: &GpuContext, opts: &QOptions) -> u64 {
    opts.max_binding.unwrap_or(ctx.caps.max_storage_buffer_binding_size).min(u32::MAX as u64)
}

/// A binding that starts `start` bytes into `buf` and spans `len` bytes, at an offset rounded
/// down to [`BIND_ALIGN`]; returns it with the distance from its start to `start`.
pub(super) fn window(buf: &wgpu::Buffer, start: u64, len: u64) -> (Bind<'_>, u64) {
    let off = start / BIND_ALIGN * BIND_ALIGN;
    (Bind::Slice(buf, off, start - off + len), start - off)
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct MatvecParams {
    rows: u32,
    cols: u32,
    row_bytes: u32,
    w_off: u32,
    units: u32,
    x_off: u32,
    x_stride: u32,
    out_off: u32,
    out_stride: u32,
    groups: u32,
    n: u32,
    r_off: u32,
    eps: f32,
    _pad0: u32,
    /// Q8 x: the word of x row 0's block scales (matvec_q8.wgsl).
    xd_off: u32,
    _pad2: u32,
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct MatmulParams {
    rows: u32,
    cols: u32,
    row_bytes: u32,
    w_off: u32,
    n: u32,
    x_off: u32,
    out_off: u32,
    out_stride: u32,
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct GatherParams {
    cols: u32,
    row_bytes: u32,
    w_off: u32,
    n_ids: u32,
    r0: u32,
    rows: u32,
    _pad: [u32; 2],
}

/// `src` without the `// @@` sections of other types than `tag` (see common.wgsl).
pub(super) fn keep_sections(src: &str, tag: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut keep = true;
    for line in src.lines() {
        if let Some(tags) = line.trim_start().strip_prefix("// @@") {
            let tags: Vec<&str> = tags.split_whitespace().collect();
            keep = tags == ["end"] || tags.contains(&tag);
            continue;
        }
        if keep {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The kernels of this module.
#[derive(Clone, Copy)]
pub(super) enum Source {
    Matvec = 0,
    Matmul = 1,
    Gather = 2,
    /// The matvec with Q8 x (matvec_q8.wgsl's unit functions).
    MatvecQ8 = 3,
    /// MatvecQ8 with the weights bound as vec4s ([`vec4_weights`]).
    MatvecQ8Vec4 = 4,
    /// W dequantized to an f16 copy (dequant_f16.wgsl).
    DequantF16 = 5,
}

/// matvec.wgsl's W_VIEW for weights bound as words: `w4_at` as four word loads.
const W_VIEW_WORDS: &str =
    "fn w4_at(i: u32) -> vec4<u32> {\n    return vec4<u32>(w[i], w[i + 1u], w[i + 2u], w[i + 3u]);\n}";

/// The weights' declaration in matvec.wgsl.
const W_DECL_WORDS: &str = "@group(0) @binding(1) var<storage, read> w: array<u32>;";

/// A matvec kernel's text with its weights bound as `array<vec4<u32>>` instead of words (WGSL
/// binds a buffer as one type per entry point): `w4_at` one 16-byte load, and every word read
/// `w[i]` rewritten as `w_word(i)` (the word's vec4, one lane of it). A Q4_K chunk's quant words
/// then take 2 loads instead of 8, its scales 1 instead of 4; a warp's word loads at the chunks'
/// 32-byte stride each spanned ~9 cache lines for 128 bytes (H100, 8B-shape Q4_K decode 300-308
/// -> 347-349 tok/s: BENCHMARKS.md, twenty-second session). For the types of [`w_vec4_view`].
fn vec4_weights(text: &str) -> String {
    let decl = "@group(0) @binding(1) var<storage, read> wv: array<vec4<u32>>;\n\
                fn w_word(i: u32) -> u32 {\n    return wv[i >> 2u][i & 3u];\n}\n\
                fn w4_at(i: u32) -> vec4<u32> {\n    return wv[i >> 2u];\n}";
    word_reads_as_calls(&text.replacen(W_DECL_WORDS, decl, 1).replacen(W_VIEW_WORDS, "", 1))
}

/// `w[i]` as `w_word(i)` throughout `text` (for [`vec4_weights`]); `i` rewritten likewise.
fn word_reads_as_calls(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len() + 256);
    let mut i = 0;
    while i < b.len() {
        let word_start = i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_');
        if word_start && b[i] == b'w' && b.get(i + 1) == Some(&b'[') {
            // The matching bracket of `w[`.
            let (mut depth, mut j) = (1, i + 2);
            while j < b.len() && depth > 0 {
                depth += match b[j] {
                    b'[' => 1,
                    b']' => -1,
                    _ => 0,
                };
                j += 1;
            }
            if depth != 0 {
                // Unbalanced (not in our kernels): left as it is, for the compiler to report.
                out.push_str(&text[i..]);
                break;
            }
            out.push_str("w_word(");
            out.push_str(&word_reads_as_calls(&text[i + 2..j - 1]));
            out.push(')');
            i = j;
        } else {
            let c = text[i..].chars().next().unwrap_or(' ');
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// matvec.wgsl's unit of two rows (RPS = 2): the unit of each row, whose x loads (the same
/// addresses) the compiler may share. (A Q4_0 unit loading x once by hand for both rows did
/// not make two rows per slot pay for Q4_0: see `rows_per_slot` in matvec_layout.rs.)
const UNIT2_GENERIC: &str =
    "fn mv_unit2(rb: u32, rb2: u32, u: u32, xb: u32) -> vec2<f32> { return vec2<f32>(mv_unit(rb, u, xb), mv_unit(rb2, u, xb)); }";

/// The WGSL of one kernel for one type: common.wgsl and the kernel's file with that type's
/// sections only, and the forwarding function the entry point calls. Built once per
/// (kernel, type) and kept for the life of the process (78 strings at most), so the pipeline
/// cache can key on a `&'static str` as it does for the other kernels.
pub(super) fn type_source(kind: Source, ty: GgmlType) -> &'static str {
    static SOURCES: [[OnceLock<&'static str>; 13]; 6] = [const { [const { OnceLock::new() }; 13] }; 6];
    let ti = GgmlType::ALL.iter().position(|&t| t == ty).unwrap_or(0);
    SOURCES[kind as usize][ti].get_or_init(|| {
        let name = wgsl_name(ty);
        let (file, forward) = match kind {
            Source::Matvec => (
                MATVEC_WGSL.to_string(),
                format!("fn mv_unit(rb: u32, u: u32, xb: u32) -> f32 {{ return mv_{name}(rb, u, xb); }}\n{UNIT2_GENERIC}"),
            ),
            Source::MatvecQ8Vec4 => return Box::leak(vec4_weights(type_source(Source::MatvecQ8, ty)).into_boxed_str()),
            Source::MatvecQ8 => (
                format!("{MATVEC_WGSL}\n{MATVEC_Q8_WGSL}"),
                format!("fn mv_unit(rb: u32, u: u32, xb: u32) -> f32 {{ return mv_{name}_q8(rb, u, xb); }}\n{UNIT2_GENERIC}"),
            ),
            Source::Matmul | Source::Gather | Source::DequantF16 => (
                match kind {
                    Source::Matmul => MATMUL_WGSL,
                    Source::Gather => GATHER_WGSL,
                    _ => DEQUANT_F16_WGSL,
                }
                .to_string(),
                format!("fn deq8(rb: u32, c: u32, cols: u32) -> V8 {{ return deq8_{name}(rb, c, cols); }}"),
            ),
        };
        let text = format!("{}\n{}\n{forward}\n", keep_sections(COMMON_WGSL, name), keep_sections(&file, name));
        Box::leak(text.replace("{{W_VIEW}}", W_VIEW_WORDS).into_boxed_str())
    })
}

/// What the matvec kernel does with each row's dot product (see matvec.wgsl).
#[derive(Clone, Copy)]
pub(crate) enum Epilogue<'a> {
    Store,
    /// `out = W x + resid`, resid shaped like the output.
    Add(&'a Tensor),
    /// W is [2F, cols], gate rows over up rows: `out = silu(gate) * up`, [.., F].
    Glu,
    /// W is a Q|K|V stack [(H + 2 Hkv) D, cols]: rope of Q and K, Q to the output [n, H, D], K
    /// and V into the caches (matvec_rope.wgsl).
    RopeKv(&'a RopeKvEpilogue<'a>),
    /// `Add`, and the sum h also rounded for the next product's RMSNorm: `h * weight` in 8-bit
    /// blocks and each block's sum of h^2 into `words` (see [`NormRounding`]).
    AddRound(&'a Tensor, &'a NormRounding<'a>),
}

/// The rounding half of [`Epilogue::AddRound`]: the residual sum h [n, rows] leaves the product
/// a second time as the next RMSNorm's input rounded to 8-bit blocks, so that the product after
/// it reads that instead of normalising and rounding h in a dispatch of its own (the 8B's
/// `quantize_q8` before its Q|K|V and gate|up products). The norm's 1 / rms(h) is a factor
/// common to a whole row, and the rounding of a block does not depend on a common factor (d
/// scales with it, q does not), so the blocks of `h * weight` are the blocks of the normalised
/// row, their d unscaled; the reader scales its dot products by 1 / rms(h), which it adds up
/// from the blocks' sums of squares. Each workgroup owns one block: 32 rows, 1,024
/// invocations (see [`ROUND_WG`]).
pub(crate) struct NormRounding<'a> {
    /// The next norm's weight [rows], f32.
    pub weight: &'a Tensor,
    /// [`Q8Rows::normed_words_for`] n * rows elements: the bytes, the blocks' (d, s), then the
    /// blocks' sums of squares.
    pub words: &'a Tensor,
}

/// Invocations per workgroup of the rounding epilogue (32 rows of 32 invocations: one 8-bit
/// block of the output per workgroup, so that no workgroup waits for another).
pub(super) const ROUND_WG: usize = 1024;

/// The arguments of [`Epilogue::RopeKv`], checked by the caller (`QTensor::qmatmul_rms_rope_kv`):
/// the caches are contiguous f32 [hkv, cap, d] with room for positions start_pos..start_pos + n,
/// `half` and `theta_scale` come from the rope plan, d is even.
pub(crate) struct RopeKvEpilogue<'a> {
    pub h: usize,
    pub hkv: usize,
    pub d: usize,
    /// The position of x row 0.
    pub start_pos: usize,
    pub opts: &'a RopeOpts,
    /// rotary_dim / 2.
    pub half: usize,
    pub theta_scale: f32,
    pub k_cache: &'a Tensor,
    pub v_cache: &'a Tensor,
    /// [(H + 2 Hkv) D] f32, added to W x before the rotation (Qwen2's q/k/v bias).
    pub bias: Option<&'a Tensor>,
}

/// The params words the rope epilogue adds after [`MatvecParams`] (PARAMS_EXT in matvec.wgsl).
/// `start_pos` is the only one that moves with the position, linearly, as a replayed decode
/// step needs.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct RopeKvParams {
    start_pos: u32,
    h: u32,
    hkv: u32,
    d: u32,
    half: u32,
    neox: u32,
    theta_scale: f32,
    freq_scale: f32,
    zero: u32,
    cap: u32,
    k_off: u32,
    v_off: u32,
    b_off: u32,
    _pad: [u32; 3],
}

const ROPE_PARAMS_WGSL: &str = "    start_pos: u32,
    h: u32,
    hkv: u32,
    d: u32,
    half: u32,
    neox: u32,
    theta_scale: f32,
    freq_scale: f32,
    zero: u32,     // always 0 (rope_math.wgsl's opaque())
    cap: u32,      // cache positions
    k_off: u32,    // cache layout offsets
    v_off: u32,
    b_off: u32,    // bias layout offset
    _pad3: u32,
    _pad4: u32,
    _pad5: u32,";

/// The rope epilogue's bindings (the caches, then the freq_factors and the bias when given),
/// after the norm weight's binding when `norm`, with `rope_ff` and `rope_bias` (see
/// matvec_rope.wgsl). One static string per variant, built once.
fn rope_kv_decl(norm: bool, ff: bool, bias: bool) -> &'static str {
    static DECLS: [OnceLock<&'static str>; 8] = [const { OnceLock::new() }; 8];
    DECLS[4 * norm as usize + 2 * ff as usize + bias as usize].get_or_init(|| {
        let mut b = 4 + norm as u32;
        let mut next = || {
            b += 1;
            b - 1
        };
        let mut text = format!(
            "@group(0) @binding({}) var<storage, read_write> kc: array<f32>;\n\
             @group(0) @binding({}) var<storage, read_write> vc: array<f32>;\n",
            next(),
            next()
        );
        text.push_str(&match ff {
            true => format!(
                "@group(0) @binding({}) var<storage, read> ff: array<f32>;\n\
                 fn rope_ff(theta: f32, i: u32) -> f32 {{ return div_rn(theta, ff[i]); }}\n",
                next()
            ),
            false => "fn rope_ff(theta: f32, i: u32) -> f32 { return theta; }\n".to_string(),
        });
        text.push_str(&match bias {
            true => format!(
                "@group(0) @binding({}) var<storage, read> qkv_bias: array<f32>;\n\
                 fn rope_bias(r: vec2<u32>) -> vec2<f32> {{ return vec2<f32>(qkv_bias[p.b_off + r.x], qkv_bias[p.b_off + r.y]); }}\n",
                next()
            ),
            false => "fn rope_bias(r: vec2<u32>) -> vec2<f32> { return vec2<f32>(0.0); }\n".to_string(),
        });
        Box::leak(text.into_boxed_str())
    })
}

/// The matvec source `base` of `ty` with the rope epilogue's functions and the rope angle math
/// appended (static per source and type, as [`type_source`]).
fn rope_source(base: Source, ty: GgmlType) -> &'static str {
    static SOURCES: [[OnceLock<&'static str>; 13]; 5] = [const { [const { OnceLock::new() }; 13] }; 5];
    let ti = GgmlType::ALL.iter().position(|&t| t == ty).unwrap_or(0);
    SOURCES[base as usize][ti].get_or_init(|| {
        let base = type_source(base, ty);
        let text = format!("{base}\n{MATVEC_ROPE_WGSL}\n{ROPE_MATH_WGSL}\n");
        Box::leak(text.into_boxed_str())
    })
}

/// What the matvec kernel does to x before its products (see [`x_side`]).
#[derive(Clone, Copy)]
pub(crate) enum Prologue<'a> {
    /// x read as bound.
    None,
    /// `rms_norm(x) * weight`, (weight [cols], eps), staged in workgroup memory.
    RmsNorm(&'a Tensor, f32),
    /// The same norm without staging, for the float types (f32 x read as vec4 from its
    /// binding): the products take `x * weight` as they read it, and each row's sum is scaled by
    /// 1 / rms(x) at the end, the sum of squares gathered by the same loads (`qmatvec_fused`
    /// turns `RmsNorm` into this where it applies; see matvec.wgsl's NORM_SCALE).
    ScaledNorm(&'a Tensor, f32),
    /// x [B * Tq, H * D] merged in workgroup memory from a split attention's partials, which
    /// are bound in its place (matvec_combine.wgsl). Checked by `qmatvec_fused`: H * D = cols,
    /// D a multiple of 4, H <= 256, at most `MATVEC_MAX_N` x rows in one dispatch.
    Combine(&'a AttentionPartials),
    /// x rounded to 8-bit blocks already, by the kernel that wrote it (`Q8Rows`): the Q8
    /// matvec reads the blocks, no rounding dispatch (x itself, f32, is passed for the shapes).
    Rounded(&'a Q8Rows),
    /// `RmsNorm(weight, eps)` of x whose producer rounded `x * weight` already
    /// ([`Epilogue::AddRound`]): the Q8 matvec reads those blocks and scales its sums by
    /// 1 / rms(x) from the blocks' sums of squares. `qmatvec_fused` turns it back into
    /// `RmsNorm` where the product would not round x apart.
    RoundedNorm(&'a Q8Rows, &'a Tensor, f32),
}

impl Prologue<'_> {
    fn staging(&self) -> Staging {
        match self {
            Prologue::None => Staging::None,
            Prologue::RmsNorm(..) => Staging::RmsNorm,
            Prologue::ScaledNorm(..) => Staging::None,
            Prologue::Combine(_) => Staging::Combine,
            Prologue::Rounded(_) | Prologue::RoundedNorm(..) => Staging::None,
        }
    }
    fn name(&self) -> &'static str {
        match self {
            Prologue::None => "",
            Prologue::RmsNorm(..) => "_norm",
            Prologue::ScaledNorm(..) => "_snorm",
            Prologue::Combine(_) => "_comb",
            Prologue::Rounded(_) => "",
            Prologue::RoundedNorm(..) => "_rnorm",
        }
    }
}

/// The params words the combine prologue adds after [`MatvecParams`] (PARAMS_EXT in
/// matvec.wgsl; never together with the rope epilogue's). `keys` moves with the position.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct CombineParams {
    tq: u32,
    off: u32,
    keys: u32,
    split_len: u32,
}

const COMBINE_PARAMS_WGSL: &str = "    c_tq: u32,     // Tq of the attention: x row b * Tq + i
    c_off: u32,    // the partials' first element
    c_keys: u32,   // Tk: the splits past ceil(c_keys / c_split_len) hold no keys
    c_split_len: u32,";

/// The matvec source of `ty` with the combine prologue's functions appended (static per type,
/// as [`type_source`]).
fn combine_source(ty: GgmlType) -> &'static str {
    static SOURCES: [OnceLock<&'static str>; 13] = [const { OnceLock::new() }; 13];
    let ti = GgmlType::ALL.iter().position(|&t| t == ty).unwrap_or(0);
    SOURCES[ti].get_or_init(|| {
        let text = format!("{}\n{MATVEC_COMBINE_WGSL}\n", type_source(Source::Matvec, ty));
        Box::leak(text.into_boxed_str())
    })
}

impl Epilogue<'_> {
    fn name(&self) -> &'static str {
        match self {
            Epilogue::Store => "",
            Epilogue::Add(_) => "_add",
            Epilogue::Glu => "_glu",
            Epilogue::RopeKv(_) => "_rope_kv",
            Epilogue::AddRound(..) => "_add_round",
        }
    }
    /// Whether each workgroup's row slots pair up (first half with second half).
    pub(super) fn paired(&self) -> bool {
        matches!(self, Epilogue::Glu | Epilogue::RopeKv(_))
    }
    /// (EPILOGUE_DECL, ROWS, STORE, PARAMS_EXT) replacements of matvec.wgsl; `norm`: the x side
    /// binds the RMSNorm weight (the epilogue's bindings come after it); `two`: two rows per
    /// row slot (RPS = 2, see [`MatvecLayout`]): adjacent rows for Store and Add, the gate row
    /// and its up row for GLU, a rope pair's two rows for RopeKv (the pairs then meet in one
    /// invocation instead of two slots).
    fn wgsl(&self, norm: bool, two: bool) -> [(&'static str, &'static str); 4] {
        const ROWS: &str = "    let orow = (g - xr * p.groups) * RPW + slot;\n    let row = orow;\n    let row2 = row;";
        // Two adjacent rows per slot (the row count is even: see MatvecLayout).
        const ROWS2: &str =
            "    let orow = ((g - xr * p.groups) * RPW + slot) * 2u;\n    let row = orow;\n    let row2 = orow + 1u;";
        const STORE: &str =
            "    if (live && t == 0u) {\n        out[p.out_off + xr * p.out_stride + orow] = sum0;\n    }";
        const STORE2: &str = "    if (live && t == 0u) {\n        let o = p.out_off + xr * p.out_stride + orow;\n        out[o] = sum0;\n        out[o + 1u] = sum1;\n    }";
        // Paired slots: slot s and s + RPW / 2 work on output row (GLU) or rope pair orow.
        macro_rules! pair_rows {
            () => {
                "    let half = RPW / 2u;\n    let orow = (g - xr * p.groups) * half + slot % half;\n"
            };
        }
        // The GLU stores: gate and up rows in two slots, or in one with two rows per slot.
        macro_rules! glu_store {
            (1) => {
                "    if (live && t == 0u && slot < RPW / 2u) {\n        let gate = red[lid];\n        let up = red[lid + (RPW / 2u) * TPR];\n        out[p.out_off + xr * p.out_stride + orow] = gate / (1.0 + exp(-gate)) * up;\n    }"
            };
            (2) => {
                "    if (live && t == 0u) {\n        let gate = sum0;\n        let up = sum1;\n        out[p.out_off + xr * p.out_stride + orow] = gate / (1.0 + exp(-gate)) * up;\n    }"
            };
        }
        match (self, two) {
            (Epilogue::Store, false) => [("EPILOGUE_DECL", ""), ("ROWS", ROWS), ("STORE", STORE), ("PARAMS_EXT", "")],
            (Epilogue::Store, true) => [("EPILOGUE_DECL", ""), ("ROWS", ROWS2), ("STORE", STORE2), ("PARAMS_EXT", "")],
            (Epilogue::Add(_), false) => [
                ("EPILOGUE_DECL", "@group(0) @binding(4) var<storage, read> resid: array<f32>;"),
                ("ROWS", ROWS),
                (
                    "STORE",
                    "    if (live && t == 0u) {\n        out[p.out_off + xr * p.out_stride + orow] = sum0 + resid[p.r_off + xr * p.out_stride + orow];\n    }",
                ),
                ("PARAMS_EXT", ""),
            ],
            (Epilogue::Add(_), true) => [
                ("EPILOGUE_DECL", "@group(0) @binding(4) var<storage, read> resid: array<f32>;"),
                ("ROWS", ROWS2),
                (
                    "STORE",
                    "    if (live && t == 0u) {\n        let o = xr * p.out_stride + orow;\n        let r = vec2<f32>(resid[p.r_off + o], resid[p.r_off + o + 1u]);\n        out[p.out_off + o] = sum0 + r.x;\n        out[p.out_off + o + 1u] = sum1 + r.y;\n    }",
                ),
                ("PARAMS_EXT", ""),
            ],
            // One row per slot, 32 slots: the workgroup's rows are one block of the rounding.
            (Epilogue::AddRound(..), _) => [
                ("EPILOGUE_DECL", ADD_ROUND_DECL),
                ("ROWS", ROWS),
                ("STORE", ADD_ROUND_STORE),
                ("PARAMS_EXT", ""),
            ],
            (Epilogue::Glu, false) => [
                ("EPILOGUE_DECL", ""),
                (
                    "ROWS",
                    concat!(pair_rows!(), "    let row = orow + select(0u, p.rows, slot >= half);\n    let row2 = row;"),
                ),
                ("STORE", glu_store!(1)),
                ("PARAMS_EXT", ""),
            ],
            (Epilogue::Glu, true) => [
                ("EPILOGUE_DECL", ""),
                ("ROWS", concat!("    let orow = (g - xr * p.groups) * RPW + slot;\n", "    let row = orow;\n    let row2 = orow + p.rows;")),
                ("STORE", glu_store!(2)),
                ("PARAMS_EXT", ""),
            ],
            (Epilogue::RopeKv(r), false) => [
                ("EPILOGUE_DECL", rope_kv_decl(norm, r.opts.freq_factors.is_some(), r.bias.is_some())),
                ("ROWS", concat!(pair_rows!(), "    let row = rope_row(orow, slot >= half);\n    let row2 = row;")),
                (
                    "STORE",
                    "    if (live && t == 0u && slot < RPW / 2u) {\n        rope_store(xr, orow, vec2<f32>(red[lid], red[lid + (RPW / 2u) * TPR]));\n    }",
                ),
                ("PARAMS_EXT", ROPE_PARAMS_WGSL),
            ],
            (Epilogue::RopeKv(r), true) => [
                ("EPILOGUE_DECL", rope_kv_decl(norm, r.opts.freq_factors.is_some(), r.bias.is_some())),
                (
                    "ROWS",
                    concat!("    let orow = (g - xr * p.groups) * RPW + slot;\n", "    let row = rope_row(orow, false);\n    let row2 = rope_row(orow, true);"),
                ),
                ("STORE", "    if (live && t == 0u) {\n        rope_store(xr, orow, vec2<f32>(sum0, sum1));\n    }"),
                ("PARAMS_EXT", ROPE_PARAMS_WGSL),
            ],
        }
    }
}

/// [`Epilogue::AddRound`]'s bindings (after the residual's) and the staged block.
const ADD_ROUND_DECL: &str = "@group(0) @binding(4) var<storage, read> resid: array<f32>;
@group(0) @binding(5) var<storage, read_write> xq: array<u32>;
@group(0) @binding(6) var<storage, read> rnw: array<vec4<f32>>;
var<workgroup> hblk: array<f32, 32>;";

/// [`Epilogue::AddRound`]'s store: h = W x + resid as `Add` stores it, then the workgroup's 32
/// rows (RPW = 32, one row per slot) rounded as one 8-bit block of `h * weight` by the first
/// eight lanes (round_q8.wgsl's `q8_round_lanes`: rows 4l .. 4l + 4 in lane l; every
/// invocation calls it, the shuffles want uniform control flow), with the block's sum of h^2.
/// The rounded row is `out_stride` wide (one row slice: the whole output), its words laid out
/// as quantize_q8.wgsl's for the dispatch's n rows, the sums after the (d, s) pairs.
const ADD_ROUND_STORE: &str = "    var hv = 0.0;
    if (live && t == 0u) {
        let o = xr * p.out_stride + orow;
        hv = sum0 + resid[p.r_off + o];
        out[p.out_off + o] = hv;
    }
    if (t == 0u) {
        hblk[slot] = hv;
    }
    workgroupBarrier();
    let l = lid & 7u;
    let blk = g - xr * p.groups;
    let h4 = vec4<f32>(hblk[4u * l], hblk[4u * l + 1u], hblk[4u * l + 2u], hblk[4u * l + 3u]);
    let ok = lid < 8u && xr < p.n;
    let nb = p.out_stride / 32u;
    let ds = (p.n * p.out_stride) / 4u;
    q8_round_lanes(h4 * rnw[8u * blk + l], xr * (p.out_stride / 4u) + 8u * blk + l, ds + 2u * (xr * nb + blk), ok, lid == 0u);
    let ss = lanes_sum(dot(h4, h4), 8u);
    if (ok && lid == 0u) {
        xq[ds + (p.n * p.out_stride) / 16u + xr * nb + blk] = bitcast<u32>(ss);
    }";

/// The x-side replacements of matvec.wgsl (X_DECL, PROLOGUE, XB): x read from its binding,
/// or (`norm_binding` = Some(4 or 5)) x staged in workgroup memory RMS-normalised and scaled by
/// the norm weight bound there; the staged row's size is the header constant `XN` (vec4
/// units for the quantized types, whose rows are whole 32-weight blocks; elements rounded up to
/// 4 otherwise, of which the first `p.cols` are read).
/// With `combine`, x is merged from attention partials into workgroup memory instead (the
/// combine prologue, matvec_combine.wgsl; the same `XN`, `norm_binding` is None).
/// Static text: built per dispatch, it would cost host time on every product.
/// Put around a prologue: a load of one word of this invocation's share of its W row is
/// issued before the prologue and consumed after it (`p._pad0` is 0), so the row's first
/// cache lines are on their way while the prologue reads and reduces x (the main loop's loads
/// then find them in cache) instead of after it. SmolLM2's decode step (90 products with a
/// prologue): GPU time per token 1.054 -> 1.035 ms on the H100.
macro_rules! prefetched {
    ($prologue:expr) => {
        concat!(
            "    var pf = 0u;
    if (live) {
        pf = w[((p.w_off + row * p.row_bytes) >> 2u) + min(t * ((p.row_bytes >> 2u) / TPR), (p.row_bytes >> 2u) - 1u)];
    }
",
            $prologue,
            "
    acc = f32(pf & p._pad0);"
        )
    };
}

/// X_DECL of x as 8-bit blocks (quantize_q8.wgsl), XB in words: `xq4`, and x4 / x1 for the
/// f32-x unit functions, which stay in the source unused (naga takes several views of one
/// binding when an entry point uses one).
const Q8_X_DECL: &str = "@group(0) @binding(2) var<storage, read> xq4: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> x4: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> x1: array<f32>;";

fn x_side(quantized: bool, norm_binding: Option<u32>, combine: bool, q8: bool) -> [(&'static str, &'static str); 3] {
    if q8 {
        return [("X_DECL", Q8_X_DECL), ("PROLOGUE", ""), ("XB", "p.x_off + xr * p.x_stride")];
    }
    if combine {
        // The partials in x's binding; the per-split weights and the merged row in workgroup
        // memory (XN vec4 units for the quantized types, elements otherwise: H * D, a multiple
        // of 4).
        const PROLOGUE_Q: &str = prefetched!(
            "    // x row xr merged from the attention partials (matvec_combine.wgsl).
    let cxr = min(xr, p.n - 1u);
    comb_weights(cxr, lid);
    for (var i = lid; i < XN; i += WGS) {
        x4[i] = comb_x4(cxr, i);
    }
    workgroupBarrier();"
        );
        const PROLOGUE_F: &str = prefetched!(
            "    // x row xr merged from the attention partials (matvec_combine.wgsl).
    let cxr = min(xr, p.n - 1u);
    comb_weights(cxr, lid);
    for (var i = lid; i < XN / 4u; i += WGS) {
        let v = comb_x4(cxr, i);
        x1[4u * i] = v.x;
        x1[4u * i + 1u] = v.y;
        x1[4u * i + 2u] = v.z;
        x1[4u * i + 3u] = v.w;
    }
    workgroupBarrier();"
        );
        return match quantized {
            true => [
                (
                    "X_DECL",
                    "@group(0) @binding(2) var<storage, read> part: array<f32>;\n\
                     var<workgroup> cw: array<f32, CH * CS>;\nvar<workgroup> x4: array<vec4<f32>, XN>;",
                ),
                ("PROLOGUE", PROLOGUE_Q),
                ("XB", "0u"),
            ],
            false => [
                (
                    "X_DECL",
                    "@group(0) @binding(2) var<storage, read> part: array<f32>;\n\
                     var<workgroup> cw: array<f32, CH * CS>;\nvar<workgroup> x1: array<f32, XN>;",
                ),
                ("PROLOGUE", PROLOGUE_F),
                ("XB", "0u"),
            ],
        };
    }
    // The RMSNorm of x row xr into workgroup memory, as the rms_norm kernel computes it; the
    // two variants differ in the row length, the square and the store.
    macro_rules! prologue {
        ($len:literal, $square:literal, $store:literal) => {
            prefetched!(concat!(
                "    // RMSNorm of x row xr into workgroup memory (x_side in gpu.rs).
    let xrow = p.x_off + min(xr, p.n - 1u) * p.x_stride;
    var ss = 0.0;
    for (var i = lid; i < ",
                $len,
                "; i += WGS) {
        let v = xin[xrow + i];
        ss += ",
                $square,
                ";
    }
    red[lid] = lanes_sum(ss, SGW);
    workgroupBarrier();
    for (var s = WGS / 2u; s >= SGW; s >>= 1u) {
        if (lid < s) {
            red[lid] += red[lid + s];
        }
        workgroupBarrier();
    }
    let inv_rms = inverseSqrt(red[0] / f32(p.cols) + p.eps);
    for (var i = lid; i < ",
                $len,
                "; i += WGS) {
        ",
                $store,
                ";
    }
    workgroupBarrier();"
            ))
        };
    }
    const PROLOGUE_Q: &str = prologue!(
        "XN",
        "dot(v, v)",
        "x4[i] = xin[xrow + i] * inv_rms * vec4<f32>(nw[4u * i], nw[4u * i + 1u], nw[4u * i + 2u], nw[4u * i + 3u])"
    );
    const PROLOGUE_F: &str = prologue!("p.cols", "v * v", "x1[i] = xin[xrow + i] * inv_rms * nw[i]");
    let decl = match (quantized, norm_binding) {
        (_, None) => {
            return [
                (
                    "X_DECL",
                    "@group(0) @binding(2) var<storage, read> x4: array<vec4<f32>>;\n\
                     @group(0) @binding(2) var<storage, read> x1: array<f32>;",
                ),
                ("PROLOGUE", ""),
                ("XB", "p.x_off + xr * p.x_stride"),
            ]
        }
        (true, Some(4)) => {
            "@group(0) @binding(2) var<storage, read> xin: array<vec4<f32>>;\n\
             var<workgroup> x4: array<vec4<f32>, XN>;\n@group(0) @binding(4) var<storage, read> nw: array<f32>;"
        }
        (true, _) => {
            "@group(0) @binding(2) var<storage, read> xin: array<vec4<f32>>;\n\
             var<workgroup> x4: array<vec4<f32>, XN>;\n@group(0) @binding(5) var<storage, read> nw: array<f32>;"
        }
        (false, Some(4)) => {
            "@group(0) @binding(2) var<storage, read> xin: array<f32>;\n\
             var<workgroup> x1: array<f32, XN>;\n@group(0) @binding(4) var<storage, read> nw: array<f32>;"
        }
        (false, _) => {
            "@group(0) @binding(2) var<storage, read> xin: array<f32>;\n\
             var<workgroup> x1: array<f32, XN>;\n@group(0) @binding(5) var<storage, read> nw: array<f32>;"
        }
    };
    [("X_DECL", decl), ("PROLOGUE", if quantized { PROLOGUE_Q } else { PROLOGUE_F }), ("XB", "0u")]
}

/// The x side of [`Prologue::RoundedNorm`] (X_DECL, PROLOGUE, XB): x as 8-bit blocks, as
/// under `q8`, and this invocation's first vec4 of the row's block sums of squares loaded
/// before the products (used after them: [`ROUNDED_NORM_SCALE_WGSL`]). The host takes rows of a
/// multiple of 128 (whole vec4s of sums per row); x row r's sums start at word
/// xd_off + n cols / 16 + r cols / 32.
const ROUNDED_NORM_X_SIDE: [(&str, &str); 3] = [
    ("X_DECL", Q8_X_DECL),
    (
        "PROLOGUE",
        "    let ssn = p.cols / 128u;
    let ss0 = (p.xd_off + (p.n * p.cols) / 16u) / 4u + min(xr, p.n - 1u) * ssn;
    var ssv = vec4<f32>(0.0);
    if (t < ssn) {
        ssv = bitcast<vec4<f32>>(xq4[ss0 + t]);
    }",
    ),
    ("XB", "p.x_off + xr * p.x_stride"),
];

/// matvec.wgsl's NORM_SCALE under [`Prologue::RoundedNorm`]: the rest of this invocation's
/// share of the block sums, the row's total (in shuffles where a row lies in one subgroup, else
/// through `row_sums` as NORM_SCALE_WGSL), and each share of the dot products scaled by
/// 1 / rms(x).
const ROUNDED_NORM_SCALE_WGSL: &str = "    for (var i = t + TPR; i < ssn; i += TPR) {
        ssv += bitcast<vec4<f32>>(xq4[ss0 + i]);
    }
    var ss = ssv.x + ssv.y + ssv.z + ssv.w;
    if (TPR <= SGW) {
        ss = lanes_sum(ss, TPR);
    } else {
        row_sums(ss, lid, t);
        ss = red[lid - t];
        workgroupBarrier();
    }
    let inv_rms = inverseSqrt(ss / f32(p.cols) + p.eps);
    acc *= inv_rms;
    acc2 *= inv_rms;";

/// Whether the matvec reads float x (F32 / F16 / BF16 weights) as whole vec4s (X1_4): every x
/// row starts on a 16-byte boundary and holds a multiple of 4 elements. The scaled norm needs
/// it.
fn float_x_vec4(ty: GgmlType, cols: usize, x_offset: usize) -> bool {
    !ty.is_quantized() && cols.is_multiple_of(4) && x_offset.is_multiple_of(4)
}

/// `ANYGPU_STAGED_NORM=1` (read once): the float types' fused RMSNorm staged in workgroup
/// memory (where it fits) instead of applied by scaling, as before the scaling (for comparisons).
fn staged_norm_forced() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| std::env::var("ANYGPU_STAGED_NORM").is_ok_and(|v| v == "1"))
}

/// The x side of [`Prologue::ScaledNorm`] (matvec.wgsl's X_DECL, PROLOGUE, XB): x from its
/// binding, the norm weight as vec4s at `norm_binding`, and `nx4`, which X1_4 wraps around
/// each vec4 of x: it adds the vec4's squares to this invocation's share of the row's sum of
/// squares and returns it times the weight.
fn scaled_norm_x_side(norm_binding: Option<u32>) -> [(&'static str, &'static str); 3] {
    macro_rules! decl {
        ($binding:literal) => {
            concat!(
                "@group(0) @binding(2) var<storage, read> x4: array<vec4<f32>>;\n",
                "@group(0) @binding(2) var<storage, read> x1: array<f32>;\n",
                "@group(0) @binding(",
                $binding,
                ") var<storage, read> nw4: array<vec4<f32>>;\n",
                "var<private> ss: f32;\n",
                "fn nx4(e: u32, v: vec4<f32>) -> vec4<f32> {\n    ss += dot(v, v);\n    return v * nw4[e >> 2u];\n}"
            )
        };
    }
    let decl = if norm_binding == Some(4) { decl!("4") } else { decl!("5") };
    [("X_DECL", decl), ("PROLOGUE", ""), ("XB", "p.x_off + xr * p.x_stride")]
}

/// matvec.wgsl's NORM_SCALE under [`Prologue::ScaledNorm`]: a row's invocations together read
/// all of x, so their shares of the sum of squares (`ss`) add up, through the same `row_sums`
/// as the dot products, to the row's; each invocation then scales its share of the dot product
/// by 1 / rms(x) before the row sum (the scale is common to the row, so the sum comes out
/// scaled; with two rows per slot, RPS = 2, every vec4 of x adds its squares once per row, hence
/// the division by RPS). Inactive rows add nothing and are not stored. (Skipping workgroup memory and
/// barriers where a row lies within one subgroup's shuffles measured slower: H100, 1B F16
/// decode 1.288 -> 1.314 ms per token.)
const NORM_SCALE_WGSL: &str = "    row_sums(ss, lid, t);
    let inv_rms = inverseSqrt(red[lid - t] / (f32(p.cols) * f32(RPS)) + p.eps);
    acc *= inv_rms;
    acc2 *= inv_rms;
    workgroupBarrier();";

/// `x @ W^T` for x [n, cols] f32 (any leading shape, flattened to n rows) -> `out_shape`.
pub fn qmatmul(w: &QTensor, x: &Tensor, n: usize, out_shape: Vec<usize>) -> Result<Tensor> {
    qmatmul_with(w, x, n, out_shape, QOptions::default(), Epilogue::Store, Prologue::None)
}

/// Whether products of `w` may round x to 8-bit blocks and use integer dot products
/// (matvec_q8.wgsl): where the matrix asks for it ([`CpuMath::Q8`], as model loaders mark their
/// weights; the CPU's products then round alike) unless `opts` says no, for the types with Q8
/// units. The GPU takes it where x is RMS-normalised before the product and the matvec's
/// RMSNorm prologue does not fit (4096-wide rows and output heads): the rounding then rides in
/// the norm's dispatch. H100, tg128: 8B Q4_0 209.3 / 210.9 -> 231.1 / 230.8 tok/s (its Q|K|V and
/// gate|up products, the head), 1B Q4_0 887 -> 975 (its head). A rounding dispatch of its own
/// before every product instead (390 dispatches per token, not 261) lost: 210 -> 192 (for wo and
/// down the dispatch costs more than the product saves).
pub(crate) fn x_q8(w: &QTensor, opts: &QOptions) -> bool {
    opts.x_q8.unwrap_or(w.cpu_math() == CpuMath::Q8) && has_q8_units(w.ggml_type())
}

/// The weight bytes from which a fused product without a prologue (the output projection's and
/// the down projection's `qmatmul_add`) rounds x to 8-bit blocks in a dispatch of its own: the
/// dispatch costs ~4 µs, the integer products save about 0.6 µs per MB of weights over f32 x
/// (worked out from the 8B figures below: 32 dispatches more, 0.054 ms less per step). H100,
/// GPU pass per decode step, thresholds 24 MiB / 8 MiB / 0 (one binary, alternated twice,
/// BENCHMARKS.md thirteenth session): 8B Q4_0 (wo 9.4 MB, down 33 MB) 2.832 / 2.778 / 2.777
/// ms; 1B Q4_0 (wo 2.4 MB, down 9.4 MB) 0.820 / 0.798 / 0.798 ms. (In the eighth session, with
/// slower Q8 units, the 1B's down lost with it: 986 -> 974 tok/s.)
pub const Q8_OWN_DISPATCH_MIN_BYTES: u64 = 8 << 20;

/// The types with Q8 unit functions (matvec_q8.wgsl; listed here, not taken from the CPU's
/// Q8 list, which may grow apart). The k-quants round x to 32-element blocks here, while the
/// CPU's Q8 path uses llama.cpp's 256-element Q8_K blocks for them: the two differ by
/// rounding, not by method.
fn has_q8_units(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(ty, Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q4K | Q5K | Q6K)
}

/// The matvec kernel with a fused epilogue, for x [.., cols] with at most [`MATVEC_MAX_N`] rows;
/// `Ok(None)` when the shapes need the unfused path (more x rows, or a GLU matrix too large for
/// one binding). Shapes are checked by the caller (`QTensor::qmatmul_add` / `qmatmul_glu`).
/// The prologue `pro`: `RmsNorm` = (weight [cols], eps) applies RMSNorm to x first, when a row
/// fits in workgroup memory; `Combine` merges x [B * Tq, H * D] from attention partials (then x
/// is not read: pass the partials' tensor), when they are small enough for every workgroup to
/// re-read (see [`COMBINE_PROLOGUE_MAX_BYTES`]).
pub(crate) fn qmatvec_fused(
    w: &QTensor,
    x: &Tensor,
    epi: Epilogue<'_>,
    pro: Prologue<'_>,
    opts: QOptions,
) -> Result<Option<Tensor>> {
    let (_, ctx) = gpu_weights("qmatmul", w)?;
    // The matvec kernels read f32 x: f16 x (see `QOptions::f16_out`) widened first, exactly,
    // where they run (not for a prefill's rows, which the coop kernel may read as they are).
    if x.dtype() == DType::F16 {
        let n = x.numel() / w.cols().max(1);
        if n == 0 || n > MATVEC_MAX_N || opts.kernel == Some(QKernel::Tiled) {
            return Ok(None);
        }
        return qmatvec_fused(w, &x.to_dtype(DType::F32)?, epi, pro, opts);
    }
    // Rows rounded for the norm by x's producer serve products that take Q8 x only.
    let pro = match pro {
        Prologue::RoundedNorm(_, g, e) if !x_q8(w, &opts) => Prologue::RmsNorm(g, e),
        other => other,
    };
    // The float types take the norm by scaling (no staged row, so no limit on the row's width
    // or the workgroups) where x is read as vec4. H100, 1B F16 decode: its 33 rms_norm
    // dispatches gone (BENCHMARKS.md, eleventh session).
    let pro = match pro {
        Prologue::RmsNorm(g, e)
            if float_x_vec4(w.ggml_type(), w.cols(), x.layout().offset) && !staged_norm_forced() =>
        {
            Prologue::ScaledNorm(g, e)
        }
        other => other,
    };
    let (n, out_dims) = match pro {
        Prologue::Combine(pa) => {
            let [b, _, tq, _] = pa.shape;
            (b * tq, vec![b * tq, w.cols()])
        }
        _ => (x.numel() / w.cols().max(1), x.dims().to_vec()),
    };
    if n == 0 || n > MATVEC_MAX_N || opts.kernel == Some(QKernel::Tiled) {
        return Ok(None);
    }
    let groups = prologue_groups(w, epi, pro.staging(), &opts)?;
    if let Prologue::Combine(pa) = pro {
        if !combine_fits(w, pa.shape, pa.n_splits, &ctx, epi, &opts, groups) {
            return Ok(None);
        }
    }
    let norm = match pro {
        Prologue::RmsNorm(g, e) | Prologue::RoundedNorm(_, g, e) => Some((g, e)),
        _ => None,
    };
    // The staged row and the reduction array must fit in workgroup memory, and the row must be
    // short: every workgroup stages it before its first product, which on the H100 cost more
    // than the separate rms_norm dispatch it saves for 4096-wide rows (8B shapes: the gate|up
    // product 58 -> 102 µs), and less for 576-wide ones (SmolLM2: 242 dispatches instead of
    // 303, GPU time per token 1.58 -> 1.36 ms) and, barely, for 2048-wide ones (see
    // NORM_PROLOGUE_MAX_COLS).
    // Nor may the product have too many workgroups: SmolLM2's output head (49,152 rows, 6,144
    // workgroups) took 45 µs with the prologue (each workgroup reads and reduces x first),
    // 33 + 9 µs as a plain product after an rms_norm dispatch (decode GPU time per token
    // 1.049 -> 1.035 ms, H100).
    // Where the prologue does not fit, a matrix that takes Q8 x (`x_q8`) has the norm and the
    // rounding to 8 bits in one dispatch before the product instead of a separate rms_norm.
    let mut opts = opts;
    if norm.is_some() && norm_apart(&ctx, w, epi, &opts)? {
        if !x_q8(w, &opts) {
            return Ok(None);
        }
        opts.x_q8 = Some(true);
    } else if let Prologue::RoundedNorm(_, g, e) = pro {
        // The norm fits the staging prologue: that, rather than the rounded rows.
        return qmatvec_fused(w, x, epi, Prologue::RmsNorm(g, e), opts);
    }
    // The rounded rows where they are whole and were made from this x for this weight (else
    // the norm's own rounding).
    if let Prologue::RoundedNorm(r, g, e) = pro {
        let made_for = same_view(&r.x, x) && r.norm_weight.as_ref().is_some_and(|nw| same_view(nw, g));
        if !made_for || !w.cols().is_multiple_of(128) {
            return qmatvec_fused(w, x, epi, Prologue::RmsNorm(g, e), opts);
        }
    }
    // The rounding epilogue where its layout fits (else the caller adds without rounding).
    if let Epilogue::AddRound(..) = epi {
        let slices = row_slices("qmatmul", w, binding_limit(&ctx, &opts))?.len();
        let n_per = x_rows_per_dispatch(binding_limit(&ctx, &opts), w.cols(), w.rows()).min(n);
        if !add_round_fits(&ctx, w.rows(), n, slices, n_per, &pro) {
            return Ok(None);
        }
    }
    // A product without a prologue pays a rounding dispatch of its own: worth it for large
    // matrices only (see Q8_OWN_DISPATCH_MIN_BYTES).
    if matches!(pro, Prologue::None)
        && opts.x_q8.is_none()
        && w.byte_len() as u64 >= Q8_OWN_DISPATCH_MIN_BYTES
        && x_q8(w, &opts)
    {
        opts.x_q8 = Some(true);
    }
    // Paired rows must sit in one binding.
    if epi.paired() && row_slices("qmatmul", w, binding_limit(&ctx, &opts))?.len() > 1 {
        return Ok(None);
    }
    let mut out_shape = out_dims;
    match epi {
        Epilogue::RopeKv(r) => {
            if r.d == 0 || !r.d.is_multiple_of(2) || w.rows() != (r.h + 2 * r.hkv) * r.d {
                return Ok(None);
            }
            out_shape = vec![n, r.h, r.d];
        }
        _ => {
            if let Some(last) = out_shape.last_mut() {
                *last = if matches!(epi, Epilogue::Glu) { w.rows() / 2 } else { w.rows() };
            }
        }
    }
    let opts = QOptions { kernel: Some(QKernel::Matvec), ..opts };
    qmatmul_with(w, x, n, out_shape, opts, epi, pro).map(Some)
}

/// Whether a product of W with the epilogue `epi` normalises x apart from its products (see
/// `qmatvec_fused`): the staged row would not fit workgroup memory, the row is wider than
/// [`NORM_PROLOGUE_MAX_COLS`], or the product has more than [`NORM_PROLOGUE_MAX_GROUPS`]
/// workgroups.
fn norm_apart(ctx: &GpuContext, w: &QTensor, epi: Epilogue<'_>, opts: &QOptions) -> Result<bool> {
    let staged = (w.cols().next_multiple_of(4) * 4 + WG * 4) as u64;
    let groups = prologue_groups(w, epi, Staging::RmsNorm, opts)?;
    Ok(w.cols() > NORM_PROLOGUE_MAX_COLS
        || staged > ctx.caps.max_compute_workgroup_storage_size as u64
        || groups > NORM_PROLOGUE_MAX_GROUPS)
}

/// Whether a decode product of W after an RMSNorm (`paired`: the GLU or rope epilogue's row
/// pairs, else a plain store) would read x rounded for the norm by x's producer
/// (`Prologue::RoundedNorm`) rather than round it in a dispatch of its own: on a GPU, where W
/// takes 8-bit x, its rows are whole vec4s of block sums (a multiple of 128 wide) and the norm
/// runs apart ([`norm_apart`]).
pub(crate) fn reads_rounded_norm(w: &QTensor, paired: bool) -> Result<bool> {
    let Some(ctx) = w.device().gpu() else { return Ok(false) };
    let opts = QOptions::default();
    let epi = if paired { Epilogue::Glu } else { Epilogue::Store };
    Ok(x_q8(w, &opts) && w.cols().is_multiple_of(128) && norm_apart(ctx, w, epi, &opts)?)
}

/// Whether the combine prologue takes these partials for W: x is [B * Tq, H * D] with
/// H * D = cols and D a multiple of 4 (a vec4 of x in one head), the heads fit the workgroup
/// (H <= 256), the merged row, the split weights and the reduction array fit in workgroup
/// memory, x and the output fit one binding (one dispatch per row slice, no chunks over x
/// rows), the epilogue is not the rope one (their params would collide), and the re-reads of
/// the partials by the product's `groups` workgroups per x row stay within
/// [`COMBINE_PROLOGUE_MAX_BYTES`].
fn combine_fits(
    w: &QTensor,
    shape: [usize; 4],
    s: usize,
    ctx: &GpuContext,
    epi: Epilogue<'_>,
    opts: &QOptions,
    groups: usize,
) -> bool {
    let [b, h, tq, d] = shape;
    let (rows, cols) = (w.rows(), w.cols());
    let n = b * tq;
    let max_binding = binding_limit(ctx, opts);
    let smem = (cols * 4 + h * s * 4 + WG * 4) as u64;
    if h * d != cols
        || !d.is_multiple_of(4)
        || h == 0
        || h > WG
        || s == 0
        || matches!(epi, Epilogue::RopeKv(_))
        || smem > ctx.caps.max_compute_workgroup_storage_size as u64
        || (cols.max(rows) * n * 4) as u64 + BIND_ALIGN > max_binding
        || (n * h * s * (d + 2) * 4) as u64 + BIND_ALIGN > max_binding
    {
        return false;
    }
    // Each workgroup reads its x row's partials.
    let reread = (groups * n) as u64 * (s * h * (d + 2) * 4) as u64;
    reread <= COMBINE_PROLOGUE_MAX_BYTES
}

/// x rows a product of `cols` columns and `rows` rows takes per dispatch: as many as x and the
/// output fit one binding of `max_binding` bytes (each may start up to BIND_ALIGN - 1 bytes
/// into its binding).
fn x_rows_per_dispatch(max_binding: u64, cols: usize, rows: usize) -> usize {
    (max_binding.saturating_sub(BIND_ALIGN) / (cols.max(rows).max(1) as u64 * 4)) as usize
}

/// Whether two tensors are the same view of one GPU buffer (rounded rows serve the x, and the
/// norm weight, they were made from).
fn same_view(a: &Tensor, b: &Tensor) -> bool {
    match (a.gpu_buffer(), b.gpu_buffer()) {
        (Some(p), Some(q)) => {
            p.buffer() == q.buffer() && a.layout().offset == b.layout().offset && a.numel() == b.numel()
        }
        _ => false,
    }
}

/// Whether [`Epilogue::AddRound`] takes a product of `rows` output rows over `n` x rows: whole
/// 32-row blocks, one row slice and one chunk of x rows (the words are laid out for the whole
/// output), workgroups of [`ROUND_WG`] invocations, subgroups of at least 8 lanes
/// (`q8_round_lanes`), x read as bound or rounded already (no staging prologue).
fn add_round_fits(ctx: &GpuContext, rows: usize, n: usize, slices: usize, n_per: usize, pro: &Prologue<'_>) -> bool {
    let c = &ctx.caps;
    rows > 0
        && rows.is_multiple_of(32)
        && slices == 1
        && n_per == n
        && (c.max_compute_invocations_per_workgroup as usize) >= ROUND_WG
        && (c.max_compute_workgroup_size_x as usize) >= ROUND_WG
        && lane_width(ctx) >= 8
        && matches!(pro, Prologue::None | Prologue::Rounded(_))
}

/// Workgroups per x row of a fused product (see qmatmul_with), by which the prologues' rules
/// judge it; with f32 x's units, since the prologues read f32 x.
fn prologue_groups(w: &QTensor, epi: Epilogue<'_>, staging: Staging, opts: &QOptions) -> Result<usize> {
    let units = matvec_units(w.ggml_type(), w.cols(), false);
    let layout = MatvecLayout::new("qmatmul", w.ggml_type(), w.rows(), units, epi, staging, opts)?;
    Ok(layout.groups(paired_out_rows(w.rows(), epi)))
}

/// Whether `QTensor::qmatmul_add_combined` on W would merge attention partials of `shape`
/// [B, H, Tq, D] split `n_splits` ways in its prologue (one dispatch), rather than through the
/// combine dispatch: asked before the attention runs, to choose how it splits.
pub(crate) fn combine_prologue_takes(w: &QTensor, shape: [usize; 4], n_splits: usize) -> Result<bool> {
    let (_, ctx) = gpu_weights("qmatmul", w)?;
    let n = shape[0] * shape[2];
    if n == 0 || n > MATVEC_MAX_N || n_splits < 2 {
        return Ok(false);
    }
    // That product's workgroups (its residual epilogue lays rows out as Store does).
    let opts = QOptions::default();
    let groups = prologue_groups(w, Epilogue::Store, Staging::Combine, &opts)?;
    Ok(combine_fits(w, shape, n_splits, &ctx, Epilogue::Store, &opts, groups))
}

/// [`qmatmul`] with the kernel choice and binding limit of `opts` (tests, benchmarks). Shapes
/// are checked as `QTensor::qmatmul` does.
pub fn qmatmul_opts(w: &QTensor, x: &Tensor, opts: QOptions) -> Result<Tensor> {
    const OP: &str = "qmatmul";
    let dtype_ok = matches!(x.dtype(), DType::F32 | DType::F16);
    if !x.device().same(w.device()) || !dtype_ok || x.dims().last() != Some(&w.cols()) {
        return Err(Error::shape(
            OP,
            format!("input {} ({}) does not match weights [{}, {}]", x.shape(), x.dtype(), w.rows(), w.cols()),
        ));
    }
    let n = x.numel() / w.cols().max(1);
    let mut out_shape = x.dims().to_vec();
    if let Some(last) = out_shape.last_mut() {
        *last = w.rows();
    }
    qmatmul_with(w, x, n, out_shape, opts, Epilogue::Store, Prologue::None)
}

/// The product of x [.., cols] with W through an epilogue of the coop prefill kernel in one
/// dispatch: `Epilogue::Glu` (W a gate|up stack [2F, cols]: silu(gate) * up, [.., F]; the stack
/// in one binding), `Epilogue::Add` (plus the residual, shaped like the product) or, with a
/// `norm`, `Epilogue::Store`. With `norm` = (weight [cols], eps) the product is of
/// `rms_norm(x) * weight`, normalised as x is rounded to f16 for the kernel (`coop::x_to_f16`):
/// no norm dispatch and no f32 copy of the normalised rows. None where that kernel would not
/// run the product (few x rows, a device without cooperative matrices, a type it does not
/// take), where a norm is asked and x would not go in as f16, or where
/// `ANYGPU_COOP_EPILOGUES=0` / `ANYGPU_COOP_NORM=0` keep the epilogue / norm apart: the caller
/// then applies them apart.
pub(crate) fn qmatmul_coop_epilogue(
    w: &QTensor,
    x: &Tensor,
    epi: Epilogue<'_>,
    norm: Option<(&Tensor, f32)>,
    opts: QOptions,
) -> Result<Option<Tensor>> {
    const OP: &str = "qmatmul";
    let (_, ctx) = gpu_weights(OP, w)?;
    let (rows, cols) = (w.rows(), w.cols());
    let n = x.numel() / cols.max(1);
    if kernel_for(&ctx, w.ggml_type(), n, &opts) != QKernel::Coop || !matches!(x.dtype(), DType::F32 | DType::F16) {
        return Ok(None);
    }
    let out_cols = match epi {
        _ if norm.is_some() && norms_apart() => return Ok(None),
        Epilogue::Glu | Epilogue::Add(_) if epilogues_apart() => return Ok(None),
        Epilogue::Glu if row_slices(OP, w, binding_limit(&ctx, &opts))?.len() > 1 => return Ok(None),
        Epilogue::Glu => rows / 2,
        Epilogue::Add(_) => rows,
        Epilogue::Store if norm.is_some() => rows,
        _ => return Ok(None),
    };
    let x = x.contiguous()?;
    // The norm rides on x's rounding to f16, which x gets only where its rows allow.
    if norm.is_some() && !super::coop::takes_half_x(cols, x.layout().offset) {
        return Ok(None);
    }
    let mut out_shape = x.dims().to_vec();
    if let Some(last) = out_shape.last_mut() {
        *last = out_cols;
    }
    let pro = match norm {
        Some((g, eps)) => Prologue::RmsNorm(g, eps),
        None => Prologue::None,
    };
    qmatmul_with(w, &x, n, out_shape, opts, epi, pro).map(Some)
}

/// The kernel of a product of `n` x rows: the one `opts` forces, else the matvec for a few rows
/// and the prefill kernel for more.
pub(super) fn kernel_for(ctx: &GpuContext, ty: GgmlType, n: usize, opts: &QOptions) -> QKernel {
    match opts.kernel {
        Some(k) => k,
        None if n <= MATVEC_MAX_N => QKernel::Matvec,
        None => super::coop::prefill_kernel(ctx, ty, n),
    }
}

/// `ANYGPU_COOP_EPILOGUES=0` (read once): the prefill's GLU and residual add apart from its
/// products, for comparisons.
fn epilogues_apart() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| std::env::var("ANYGPU_COOP_EPILOGUES").is_ok_and(|v| v == "0"))
}

/// `ANYGPU_COOP_NORM=0` (read once): the prefill's RMSNorm in a dispatch of its own before the
/// product (and x rounded to f16 in another), for comparisons.
fn norms_apart() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| std::env::var("ANYGPU_COOP_NORM").is_ok_and(|v| v == "0"))
}

/// The rope epilogue's buffers and params for one product.
struct RopeKvBinds<'a> {
    epi: &'a RopeKvEpilogue<'a>,
    k: &'a GpuBuffer,
    v: &'a GpuBuffer,
    ff: Option<GpuBuffer>,
    /// The bias, contiguous.
    bias: Option<Tensor>,
}

impl<'a> RopeKvBinds<'a> {
    fn new(ctx: &Arc<GpuContext>, epi: &'a RopeKvEpilogue<'a>) -> Result<RopeKvBinds<'a>> {
        const OP: &str = "qmatmul_rope_kv";
        let gpu = |t: &'a Tensor| t.gpu_buffer().ok_or_else(|| Error::mismatch(OP, "a KV cache is not on a GPU"));
        let ff = match &epi.opts.freq_factors {
            Some(f) => Some(ctx.upload(bytemuck::cast_slice(f))?),
            None => None,
        };
        let bias = match epi.bias {
            Some(b) => {
                let b = b.contiguous()?;
                b.gpu_buffer().ok_or_else(|| Error::mismatch(OP, "the bias is not on a GPU"))?;
                Some(b)
            }
            None => None,
        };
        Ok(RopeKvBinds { epi, k: gpu(epi.k_cache)?, v: gpu(epi.v_cache)?, ff, bias })
    }

    /// Binds the caches, then the freq_factors and the bias when given (see `rope_kv_decl`).
    fn push_binds<'b>(&'b self, binds: &mut Vec<Bind<'b>>) {
        binds.push(Bind::Whole(self.k));
        binds.push(Bind::Whole(self.v));
        if let Some(f) = &self.ff {
            binds.push(Bind::Whole(f));
        }
        if let Some(b) = self.bias.as_ref().and_then(|b| b.gpu_buffer()) {
            binds.push(Bind::Whole(b));
        }
    }

    /// The params words for x rows from `n0` on.
    fn params(&self, n0: usize) -> Result<RopeKvParams> {
        let u = |v: usize| to_u32("qmatmul_rope_kv", v);
        let e = self.epi;
        u(e.k_cache.numel().max(e.v_cache.numel()))?;
        Ok(RopeKvParams {
            start_pos: u(e.start_pos + n0)?,
            h: u(e.h)?,
            hkv: u(e.hkv)?,
            d: u(e.d)?,
            half: u(e.half)?,
            neox: e.opts.neox as u32,
            theta_scale: e.theta_scale,
            freq_scale: e.opts.freq_scale,
            zero: 0,
            cap: u(e.k_cache.dims().get(1).copied().unwrap_or(0))?,
            k_off: u(e.k_cache.layout().offset)?,
            v_off: u(e.v_cache.layout().offset)?,
            b_off: u(self.bias.as_ref().map_or(0, |b| b.layout().offset))?,
            _pad: [0; 3],
        })
    }
}

/// The RMSNorm weight `g` of rows of `cols` elements, checked (f32, on x's device) and contiguous.
pub(super) fn norm_weight(op: &'static str, g: &Tensor, cols: usize, x: &Tensor) -> Result<Tensor> {
    if g.numel() != cols || g.dtype() != DType::F32 || !g.device().same(x.device()) {
        return Err(Error::shape(op, format!("norm weight {} does not match {cols} columns", g.shape())));
    }
    g.contiguous()
}

/// The binding of a [`norm_weight`], which kernels index from 0.
fn norm_weight_bind<'a>(op: &'static str, g: &'a Tensor, cols: usize) -> Result<Bind<'a>> {
    let gb = g.gpu_buffer().ok_or_else(|| Error::mismatch(op, "norm weight is not on a GPU"))?;
    let (bind, g_delta) = window(gb.buffer(), g.layout().offset as u64 * 4, cols as u64 * 4);
    if g_delta != 0 {
        return Err(Error::Unsupported(format!("{op}: a norm weight view off a 256-byte boundary")));
    }
    Ok(bind)
}

/// x [n, cols] (contiguous, cols a multiple of 32, n <= MATVEC_MAX_N) rounded to 8-bit blocks
/// on the GPU, RMS-normalised first with `norm` = (weight [cols], eps) (quantize_q8.wgsl): a
/// scratch buffer of n * cols / 4 words of bytes, then n * cols / 16 words of block scales, and
/// its length in words.
fn quantize_x_q8(
    ctx: &Arc<GpuContext>,
    x: &Tensor,
    n: usize,
    cols: usize,
    norm: Option<(&Tensor, f32)>,
) -> Result<(GpuBuffer, usize)> {
    const OP: &str = "quantize_q8";
    #[repr(C)]
    #[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
    struct Params {
        cols: u32,
        blocks: u32,
        x_off: u32,
        ds_off: u32,
        norm: u32,
        eps: f32,
        _pad: [u32; 2],
    }
    let xbuf = x.gpu_buffer().ok_or_else(|| Error::mismatch(OP, "input is not on a GPU"))?;
    let words = Q8Rows::word_count(n * cols);
    let out = ctx.alloc((words * 4) as u64)?;
    let (xbind, delta) = window(xbuf.buffer(), x.layout().offset as u64 * 4, (n * cols) as u64 * 4);
    // The kernel reads x as vec4 (qmatmul_with moves quantized products' x onto 16 bytes).
    if delta % 16 != 0 {
        return Err(Error::Unsupported(format!("{OP}: x off a 16-byte boundary")));
    }
    let params = Params {
        cols: to_u32(OP, cols)?,
        blocks: to_u32(OP, cols / 32)?,
        x_off: to_u32(OP, delta as usize / 16)?,
        ds_off: to_u32(OP, n * cols / 4)?,
        norm: norm.is_some() as u32,
        eps: norm.map_or(0.0, |(_, e)| e),
        _pad: [0; 2],
    };
    let g = norm.map(|(g, _)| norm_weight(OP, g, cols, x)).transpose()?;
    let gbind = match &g {
        Some(g) => norm_weight_bind(OP, g, cols)?,
        // Unread without the norm: x's binding stands in.
        None => window(xbuf.buffer(), x.layout().offset as u64 * 4, (n * cols) as u64 * 4).0,
    };
    let spec = KernelSpec::new("quantize_q8", QUANTIZE_Q8_WGSL, "quantize")
        .with(lane_reductions_wgsl(ctx))
        .with(ROUND_Q8_WGSL);
    let pipeline = ctx.pipeline(&spec, &[])?;
    let binds = [xbind, Bind::Slice(out.buffer(), 0, (words * 4) as u64), gbind];
    let grid = [to_u32(OP, cols.div_ceil(1024))?, to_u32(OP, n)?, 1];
    ctx.dispatch(&pipeline, OP, bytemuck::bytes_of(&params), &binds, grid)?;
    Ok((out, words))
}

/// x [n, cols] (f32) together with its rounding to 8-bit blocks, made by the kernel that wrote
/// x (the decode attention: `Tensor::attention_q8`), so that a product whose matrix takes Q8 x
/// reads the blocks without a rounding dispatch of its own (`QTensor::qmatmul_add_q8`). The
/// words are laid out as quantize_q8.wgsl writes them (round_q8.wgsl): n * cols / 4 words of
/// bytes, then n * cols / 16 words of the blocks' (d, s).
///
/// Rounded for an RMSNorm (`norm_weight`, by [`Epilogue::AddRound`]), the blocks are those of
/// `x * weight`, d not scaled by 1 / rms(x), and each block's sum of x^2 follows the (d, s)
/// words (see [`NormRounding`]).
pub struct Q8Rows {
    pub(crate) x: Tensor,
    pub(crate) q: Tensor,
    pub(crate) norm_weight: Option<Tensor>,
}

impl Q8Rows {
    /// x [n, cols] (f32, contiguous, cols a multiple of 32) rounded by the rounding dispatch
    /// the Q8 products use (quantize_q8.wgsl): for tests, which read the words back and check
    /// them against the CPU's rounding.
    #[doc(hidden)]
    pub fn round(x: &Tensor) -> Result<Q8Rows> {
        const OP: &str = "quantize_q8";
        let ctx = x.device().gpu().ok_or_else(|| Error::mismatch(OP, "input is not on a GPU"))?;
        let (n, cols) = match x.dims() {
            &[n, cols] if cols % 32 == 0 => (n, cols),
            d => return Err(Error::shape(OP, format!("x {d:?} is not [n, cols] with cols a multiple of 32"))),
        };
        let x = x.contiguous()?;
        let (buf, words) = quantize_x_q8(ctx, &x, n, cols, None)?;
        let q = Tensor::gpu(buf, DType::U32, vec![words].into(), x.device().clone());
        Ok(Q8Rows { x, q, norm_weight: None })
    }
    /// The words read back as blocks (bytes, then the (d, s) pairs, d's word masked of the
    /// sum(q) its low 13 bits carry): for tests. An error where that sum is not the bytes'.
    #[doc(hidden)]
    pub fn host_blocks(&self) -> Result<Vec<super::HostQ8Block>> {
        let words: Vec<u32> = self.q.to_vec()?;
        let n_blocks = self.x.numel() / 32;
        let (bytes, ds) = words.split_at(n_blocks * 8);
        (0..n_blocks)
            .map(|b| {
                let mut q = [0i8; 32];
                for (i, w) in bytes[b * 8..b * 8 + 8].iter().enumerate() {
                    q[i * 4..i * 4 + 4].copy_from_slice(&w.to_le_bytes().map(|c| c as i8));
                }
                let (dw, sw) = (ds[2 * b], ds[2 * b + 1]);
                let carried = ((dw << 19) as i32) >> 19;
                let sum: i32 = q.iter().map(|&v| v as i32).sum();
                if carried != sum {
                    return Err(Error::gpu(
                        "q8 words",
                        format!("block {b}: d's word carries sum {carried}, bytes sum {sum}"),
                    ));
                }
                Ok(super::HostQ8Block { q, d: f32::from_bits(dw & !0x1FFF), s: f32::from_bits(sw) })
            })
            .collect()
    }
    /// A pair for x [n, cols] (cols a multiple of 32), its words not yet written.
    pub(crate) fn for_x(x: Tensor) -> Result<Q8Rows> {
        let q = Q8Rows::words_for(x.numel(), x.device())?;
        Ok(Q8Rows { x, q, norm_weight: None })
    }
    /// The (unwritten) words for `numel` elements of x on `device`.
    pub(crate) fn words_for(numel: usize, device: &crate::device::Device) -> Result<Tensor> {
        Tensor::gpu_empty(vec![Q8Rows::word_count(numel)], DType::U32, device)
    }
    /// Words of the rounding of `numel` elements: bytes, then (d, s) pairs, rounded up to whole
    /// 16-byte vec4s: the products read the pairs 16 bytes at a time, and with an odd number of
    /// blocks the last pair sits in the first half of a vec4 that would otherwise end past the
    /// binding (read as zeros on NVIDIA: that block dropped from every product).
    pub(crate) fn word_count(numel: usize) -> usize {
        (numel / 4 + numel / 16).next_multiple_of(4)
    }
    /// The (unwritten) words of a normed rounding of `numel` elements on `device`.
    pub(crate) fn normed_words_for(numel: usize, device: &crate::device::Device) -> Result<Tensor> {
        Tensor::gpu_empty(vec![Q8Rows::normed_word_count(numel)], DType::U32, device)
    }
    /// Words of a normed rounding of `numel` elements: bytes, (d, s) pairs, sums of squares
    /// (whole vec4s, as [`Q8Rows::word_count`]).
    pub(crate) fn normed_word_count(numel: usize) -> usize {
        (numel / 4 + numel / 16 + numel / 32).next_multiple_of(4)
    }
    /// x, f32 [n, cols].
    pub fn x(&self) -> &Tensor {
        &self.x
    }
    /// The rounded rows, u32 words (see the type's docs).
    pub fn words(&self) -> &Tensor {
        &self.q
    }
}

fn qmatmul_with(
    w: &QTensor,
    x: &Tensor,
    n: usize,
    out_shape: Vec<usize>,
    opts: QOptions,
    epi: Epilogue<'_>,
    pro: Prologue<'_>,
) -> Result<Tensor> {
    const OP: &str = "qmatmul";
    let norm = match pro {
        Prologue::RmsNorm(g, e) | Prologue::ScaledNorm(g, e) => Some((g, e)),
        _ => None,
    };
    let scaled = matches!(pro, Prologue::ScaledNorm(..));
    // The combine prologue reads the partials (passed as x) whole, in elements.
    let combine = match pro {
        Prologue::Combine(pa) => Some(pa),
        _ => None,
    };
    let (wbuf, ctx) = gpu_weights(OP, w)?;
    let (rows, cols, ty) = (w.rows(), w.cols(), w.ggml_type());
    // Output elements per x row (half of W's rows under GLU, the Q heads under RopeKv).
    let out_rows = match epi {
        Epilogue::Glu => rows / 2,
        Epilogue::RopeKv(r) => r.h * r.d,
        _ => rows,
    };
    if n == 0 || rows == 0 || cols == 0 {
        return Tensor::zeros(out_shape, DType::F32, w.device());
    }
    let kernel = kernel_for(&ctx, ty, n, &opts);
    // A copy of W made ahead (copy_ahead.rs) is taken by W's product, and dropped here where
    // the product does not read it after all.
    let made_ahead = super::copy_ahead::take(w);
    // Long products of quantized weights read an f16 copy of them (see dequant_f16.rs), where
    // it fits the bindings the epilogue needs.
    if kernel == QKernel::Coop
        && super::dequant_f16::pays(ty, n, rows * cols)
        && !(epi.paired() && rows as u64 * cols as u64 * 2 > binding_limit(&ctx, &opts))
    {
        let w16 = match made_ahead {
            Some(copy) => Some(copy),
            None => super::dequant_f16::copy_for_product(w, &opts)?,
        };
        if let Some(w16) = w16 {
            // Later products' copies run beside this one (copy_ahead.rs): it begins a compute
            // pass, and they follow it into buffers the pass has not used (no barrier).
            let ahead = super::copy_ahead::plan_after(w, &ctx, &opts);
            if !ahead.is_empty() {
                ctx.end_pass()?;
            }
            let y = qmatmul_with(&w16, x, n, out_shape, opts, epi, pro)?;
            for (next, buf) in ahead {
                super::copy_ahead::fill_ahead(next, buf, &opts)?;
            }
            return Ok(y);
        }
    }
    let mut x = x.contiguous()?;
    // f16 x (a GLU product's f16 output, see `QOptions::f16_out`) goes in as it is where the
    // coop kernel reads x as f16 (whole 16-byte runs) and no prologue reads it; elsewhere it is
    // widened to f32 first, exactly.
    let x_f16 = x.dtype() == DType::F16;
    if x_f16
        && !(kernel == QKernel::Coop
            && matches!(pro, Prologue::None)
            && x.layout().offset.is_multiple_of(8)
            && super::coop::takes_half_x(cols, x.layout().offset))
    {
        x = x.to_dtype(DType::F32)?;
    }
    let x_f16 = x_f16 && x.dtype() == DType::F16;
    // The quantized kernels read x as vec4: its first element must sit on a 16-byte boundary
    // (rows are whole 32-weight blocks, so every row then does).
    if ty.is_quantized() && x.layout().offset % 4 != 0 && combine.is_none() {
        x = crate::ops::copy::gpu_contiguous(&x)?;
    }
    let xbuf = x.gpu_buffer().ok_or_else(|| Error::mismatch(OP, "input is not on a GPU"))?;
    let max_binding = binding_limit(&ctx, &opts);
    let slices = row_slices(OP, w, max_binding)?;
    let coop_plan = match kernel {
        QKernel::Coop => {
            let plan = super::coop::Plan::new(&ctx, ty, n, rows, cols, x.layout().offset)?;
            Some(match epi {
                Epilogue::Glu if opts.f16_out => {
                    let glu = plan.with_glu();
                    glu.with_half_out(out_rows).unwrap_or(glu)
                }
                Epilogue::Glu => plan.with_glu(),
                Epilogue::Add(_) => plan.with_add(),
                _ => plan,
            })
        }
        _ => None,
    };
    if x_f16 && !coop_plan.as_ref().is_some_and(|c| c.x_half()) {
        return Err(Error::gpu(OP, "f16 x where the coop kernel does not read it as f16"));
    }
    // The output's element type and bytes per element.
    let (out_dtype, out_elem) = match coop_plan.as_ref().is_some_and(|c| c.half_out()) {
        true => (DType::F16, 2),
        false => (DType::F32, 4),
    };
    let out = Tensor::gpu_empty(out_shape, out_dtype, w.device())?;
    let obuf = out.gpu_buffer().ok_or_else(|| Error::mismatch(OP, "output is not on a GPU"))?;
    let resid = match epi {
        Epilogue::Add(r) | Epilogue::AddRound(r, _) => {
            let r = r.contiguous()?;
            if r.numel() != n * rows {
                return Err(Error::shape(
                    OP,
                    format!("residual {} does not match the output [{n}, {rows}]", r.shape()),
                ));
            }
            Some(r)
        }
        _ => None,
    };
    // The coop kernel takes the RMSNorm prologue where x goes in as f16: the norm is applied
    // as x is rounded (`coop::x_to_f16`).
    let coop_norm = match (&coop_plan, pro) {
        (Some(plan), Prologue::RmsNorm(g, e)) if plan.x_half() => Some((g, e)),
        _ => None,
    };
    let fused = !matches!(epi, Epilogue::Store) || !matches!(pro, Prologue::None);
    // The coop kernel has the GLU and residual epilogues and that prologue; the matvec kernel
    // every one.
    let coop_epi = kernel == QKernel::Coop
        && matches!(epi, Epilogue::Store | Epilogue::Glu | Epilogue::Add(_))
        && (matches!(pro, Prologue::None) || coop_norm.is_some());
    if fused && ((kernel != QKernel::Matvec && !coop_epi) || (epi.paired() && slices.len() > 1)) {
        return Err(Error::Unsupported(format!(
            "{OP}: fused epilogues need the matvec kernel (the coop kernel: GLU, residual and, with f16 x, RMSNorm only) and one binding"
        )));
    }

    // x rows per dispatch: all of them unless x or the output exceeds one binding.
    let n_per = x_rows_per_dispatch(max_binding, cols, rows).min(n);
    if n_per == 0 {
        return Err(Error::Unsupported(format!(
            "{OP}: one row of input or output ({cols} or {rows} floats) exceeds this device's \
             max_storage_buffer_binding_size of {max_binding} bytes"
        )));
    }
    if combine.is_some() && (n_per < n || matches!(epi, Epilogue::RopeKv(_))) {
        return Err(Error::Unsupported(format!(
            "{OP}: the combine prologue needs every x row in one dispatch, no rope"
        )));
    }
    let u = |v: usize| to_u32(OP, v);
    // Every element index the kernels form must fit u32.
    u(n.checked_mul(rows.max(cols)).ok_or_else(|| Error::shape(OP, "size overflows"))?)?;
    // x rounded to 8-bit blocks first (RMS-normalised on the way when the prologue asks for it,
    // which the matvec kernel then skips), when the caller asks for it (see `qmatvec_fused`).
    let q8 = opts.x_q8 == Some(true)
        && kernel == QKernel::Matvec
        && combine.is_none()
        && has_q8_units(ty)
        && n <= MATVEC_MAX_N
        && n_per == n;
    // x rounded already by its producer (read only under q8; otherwise the f32 x is), and
    // under RoundedNorm normalised by the kernel (`normed`: the norm's eps).
    if matches!(pro, Prologue::Rounded(r) if r.norm_weight.is_some()) {
        return Err(Error::gpu(OP, "rows rounded for a norm read as plain rounded x"));
    }
    let rounded = match pro {
        Prologue::Rounded(r) | Prologue::RoundedNorm(r, ..) if q8 => {
            Some(r.q.gpu_buffer().ok_or_else(|| Error::mismatch(OP, "Q8 rows not on a GPU"))?)
        }
        _ => None,
    };
    let normed = match pro {
        Prologue::RoundedNorm(r, _, e) => {
            if !q8
                || r.norm_weight.is_none()
                || !cols.is_multiple_of(128)
                || r.q.numel() < Q8Rows::normed_word_count(n * cols)
            {
                return Err(Error::gpu(OP, "rows rounded for a norm need the Q8 matvec on whole 128-column vec4s"));
            }
            Some(e)
        }
        _ => None,
    };
    let round = match epi {
        Epilogue::AddRound(_, nr) => {
            let words = nr.words.gpu_buffer().ok_or_else(|| Error::mismatch(OP, "rounding words not on a GPU"))?;
            if !add_round_fits(&ctx, rows, n, slices.len(), n_per, &pro)
                || nr.words.numel() < Q8Rows::normed_word_count(n * rows)
            {
                return Err(Error::gpu(OP, "the rounding epilogue does not fit this product"));
            }
            Some((words, norm_weight(OP, nr.weight, rows, &x)?))
        }
        _ => None,
    };
    // The rounding's norm; the matvec then has no prologue.
    let q8_norm = norm.filter(|_| q8);
    // (RoundedNorm stays: the kernel scales by its norm, and its name says so.)
    let (pro, norm) = match pro {
        Prologue::RoundedNorm(..) => (pro, None),
        _ if q8 || coop_norm.is_some() => (Prologue::None, None),
        Prologue::Rounded(_) => (Prologue::None, None),
        other => (other, norm),
    };

    let name = wgsl_name(ty);
    // The matvec's text (the rope epilogue's appended to it): Q8 units where x comes as 8-bit
    // blocks, their weights read as vec4s where the type and rows allow (the combine prologue
    // has word units of its own).
    let w_vec4 = kernel == QKernel::Matvec && combine.is_none() && w_vec4_view(ty, q8, w.row_bytes(), &slices);
    let matvec_source = match (q8, w_vec4) {
        (true, true) => Source::MatvecQ8Vec4,
        (true, false) => Source::MatvecQ8,
        (false, _) => Source::Matvec,
    };
    // GLU and RopeKv pair two row slots per output row.
    let layout = MatvecLayout::new(OP, ty, rows, matvec_units(ty, cols, q8), epi, pro.staging(), &opts)?;
    let tpr = layout.tpr;
    let spec = match kernel {
        QKernel::Matvec => KernelSpec::new(
            format!(
                "qmatvec_{name}_t{tpr}{}{}{}{}",
                if layout.rps == 2 { "_r2" } else { "" },
                epi.name(),
                pro.name(),
                match (q8, w_vec4) {
                    (true, true) => "_q8_w4",
                    (true, false) => "_q8",
                    _ => "",
                }
            ),
            match (epi, pro) {
                (Epilogue::RopeKv(_), _) => rope_source(matvec_source, ty),
                (_, Prologue::Combine(_)) => combine_source(ty),
                _ => type_source(matvec_source, ty),
            },
            "matvec",
        )
        .constant_u32("TPR", tpr as u32)
        .with(lane_reductions_wgsl(&ctx))
        .constant_u32("WGS", layout.wg as u32)
        .constant_u32("RPW", (layout.wg / tpr) as u32)
        .constant_u32("RPS", layout.rps as u32)
        .with(if round.is_some() { ROUND_Q8_WGSL } else { "" })
        // The staged row of the RMSNorm prologue (vec4 units for the quantized types, elements
        // rounded up to 4 otherwise); only then, so that the plain kernels stay one pipeline for
        // every width.
        .with(&match pro {
            Prologue::None | Prologue::ScaledNorm(..) | Prologue::RoundedNorm(..) => String::new(),
            _ => format!("const XN: u32 = {}u;", if ty.is_quantized() { cols / 4 } else { cols.next_multiple_of(4) }),
        })
        // The combine prologue's shape: heads, head dim, splits, invocations per head.
        .with(&match combine {
            Some(pa) => {
                let h = pa.shape[1];
                format!(
                    "const CH: u32 = {h}u;\nconst CD: u32 = {}u;\nconst CS: u32 = {}u;\nconst CTPH: u32 = {}u;",
                    pa.shape[3],
                    pa.n_splits,
                    WG / h.next_power_of_two()
                )
            }
            None => String::new(),
        }),
        QKernel::Tiled => KernelSpec::new(format!("qmatmul_{name}"), type_source(Source::Matmul, ty), "matmul"),
        QKernel::Coop => coop_plan.as_ref().ok_or_else(|| Error::gpu(OP, "no coop plan"))?.spec(ty),
    };
    let norm_binding = norm.map(|_| if resid.is_some() { 5 } else { 4 });
    let pipeline = match kernel {
        QKernel::Matvec => {
            let [e0, e1, e2, e3] = epi.wgsl(norm.is_some(), layout.rps == 2);
            // The combine prologue's params words (the epilogue then has none, see above).
            let e3 = if combine.is_some() { ("PARAMS_EXT", COMBINE_PARAMS_WGSL) } else { e3 };
            let [x0, x1, x2] = match (scaled, normed) {
                (true, _) => scaled_norm_x_side(norm_binding),
                (false, Some(_)) => ROUNDED_NORM_X_SIDE,
                (false, None) => x_side(ty.is_quantized(), norm_binding, combine.is_some(), q8),
            };
            // Whole 16-byte loads of x for the float types where its rows allow (see x1_4 in
            // matvec.wgsl). H100, tg128: 1B F16 669.3 -> 690.3 tok/s, 1B BF16 630.9 -> 648.1.
            let x4 =
                matches!(pro, Prologue::None | Prologue::ScaledNorm(..)) && float_x_vec4(ty, cols, x.layout().offset);
            let x3 = match (scaled, x4) {
                (true, true) => ("X1_4", "nx4(e, x4[(xb + e) >> 2u])"),
                (false, true) => ("X1_4", "x4[(xb + e) >> 2u]"),
                (false, false) => ("X1_4", "x1_4_scalar(xb, e)"),
                // qmatvec_fused chose the scaled norm by the same rule on x before it was made
                // contiguous (which keeps a contiguous x's offset and gives a copy offset 0).
                (true, false) => return Err(Error::gpu(OP, "the scaled norm needs x read as vec4")),
            };
            let x5 = match (scaled, normed) {
                (true, _) => ("NORM_SCALE", NORM_SCALE_WGSL),
                (false, Some(_)) => ("NORM_SCALE", ROUNDED_NORM_SCALE_WGSL),
                (false, None) => ("NORM_SCALE", ""),
            };
            ctx.pipeline(&spec, &[e0, e1, e2, e3, x0, x1, x2, x3, x5])?
        }
        QKernel::Tiled | QKernel::Coop => ctx.pipeline(&spec, &[])?,
    };
    let norm_w = norm.map(|(g, _)| norm_weight(OP, g, cols, &x)).transpose()?;
    // Dispatched once the product's pipeline exists (a kernel that fails to compile leaves no
    // stray dispatch behind).
    let xq_own = if q8 && rounded.is_none() { Some(quantize_x_q8(&ctx, &x, n, cols, q8_norm)?) } else { None };
    let words = if normed.is_some() { Q8Rows::normed_word_count(n * cols) } else { Q8Rows::word_count(n * cols) };
    let xq = xq_own.as_ref().map(|(b, w)| (b, *w)).or(rounded.map(|b| (b, words)));
    // The coop kernel's x as f16 (see coop::XAccess::Half): as it came, or rounded now.
    let xh = match coop_plan.as_ref().is_some_and(|c| c.x_half()) {
        true if x_f16 => Some(x.clone()),
        true => Some(super::coop::x_to_f16(&ctx, &x, coop_norm)?),
        false => None,
    };
    let resid_buf = match &resid {
        Some(r) => {
            Some((r.gpu_buffer().ok_or_else(|| Error::mismatch(OP, "residual is not on a GPU"))?, r.layout().offset))
        }
        None => None,
    };
    let rope = match epi {
        Epilogue::RopeKv(r) => Some(RopeKvBinds::new(&ctx, r)?),
        _ => None,
    };
    // x's bytes per element (f16 for the coop kernel's Half access), its first byte.
    let (xbuf, x_elem, x_start) = match &xh {
        Some(h) => (
            h.gpu_buffer().ok_or_else(|| Error::mismatch(OP, "input is not on a GPU"))?,
            2,
            h.layout().offset as u64 * 2,
        ),
        None => (xbuf, 4, x.layout().offset as u64 * 4),
    };
    // The matvec kernel reads x in vec4 units for the quantized types, in elements otherwise.
    let x_unit = if kernel == QKernel::Matvec && ty.is_quantized() { 16 } else { x_elem as usize };
    let mut n0 = 0;
    while n0 < n {
        let nc = n_per.min(n - n0);
        for s in &slices {
            let (xbind, x_delta) = match (combine, &xq) {
                // The partials, whole (one chunk: n0 = 0).
                (Some(_), _) => window(xbuf.buffer(), x_start, x.numel() as u64 * 4),
                // Q8 x, whole (one chunk), from its buffer's start: x_off 0 below.
                (None, Some((qbuf, words))) => (Bind::Slice(qbuf.buffer(), 0, *words as u64 * 4), 0),
                (None, None) => {
                    window(xbuf.buffer(), x_start + (n0 * cols) as u64 * x_elem, (nc * cols) as u64 * x_elem)
                }
            };
            let (obind, o_delta) =
                window(obuf.buffer(), (n0 * out_rows * out_elem) as u64, (nc * out_rows * out_elem) as u64);
            let mut binds = vec![Bind::Slice(wbuf.buffer(), s.bind_off, s.bind_len), xbind, obind];
            let mut r_off = 0;
            if let Some((rbuf, roff)) = resid_buf {
                let (rbind, r_delta) = window(rbuf.buffer(), (roff + n0 * rows) as u64 * 4, (nc * rows) as u64 * 4);
                binds.push(rbind);
                r_off = u(r_delta as usize / 4 + s.r0)?;
            }
            if let Some(g) = &norm_w {
                binds.push(norm_weight_bind(OP, g, cols)?);
            }
            if let Some((words, g)) = &round {
                binds.push(Bind::Slice(words.buffer(), 0, Q8Rows::normed_word_count(n * rows) as u64 * 4));
                binds.push(norm_weight_bind(OP, g, rows)?);
            }
            if let Some(r) = &rope {
                r.push_binds(&mut binds);
            }
            let out_off = u(o_delta as usize / out_elem + s.r0)?;
            let x_off = u(x_delta as usize / x_unit)?;
            match kernel {
                QKernel::Matvec => {
                    let slice_rows = match epi {
                        Epilogue::Glu => out_rows,
                        // Rope pairs (one slice: see qmatvec_fused).
                        Epilogue::RopeKv(_) => rows / 2,
                        _ => s.rows,
                    };
                    let groups = layout.groups(slice_rows);
                    let params = MatvecParams {
                        rows: u(slice_rows)?,
                        cols: u(cols)?,
                        row_bytes: u(w.row_bytes())?,
                        w_off: s.w_off,
                        units: u(layout.units)?,
                        x_off,
                        // Q8 x: a row is cols / 4 words of bytes (then the scales, at xd_off).
                        x_stride: u(if q8 { cols / 4 } else { cols * 4 / x_unit })?,
                        out_off,
                        out_stride: u(out_rows)?,
                        groups: u(groups)?,
                        n: u(nc)?,
                        r_off,
                        eps: norm.map_or(normed.unwrap_or(0.0), |(_, e)| e),
                        _pad0: 0,
                        xd_off: u(n * cols / 4)?,
                        _pad2: 0,
                    };
                    let wgs = groups.checked_mul(nc).ok_or_else(|| Error::shape(OP, "grid overflows"))?;
                    let grid = ctx.grid_1d(u(wgs)?);
                    match (&rope, combine) {
                        (Some(r), _) => {
                            // This chunk's x row 0 sits at position start_pos + n0.
                            let mut bytes = bytemuck::bytes_of(&params).to_vec();
                            bytes.extend_from_slice(bytemuck::bytes_of(&r.params(n0)?));
                            ctx.dispatch(&pipeline, OP, &bytes, &binds, grid)?;
                        }
                        (None, Some(pa)) => {
                            let c = CombineParams {
                                tq: u(pa.shape[2])?,
                                off: u(x_delta as usize / 4)?,
                                keys: u(pa.keys)?,
                                split_len: u(pa.split_len.max(1))?,
                            };
                            let mut bytes = bytemuck::bytes_of(&params).to_vec();
                            bytes.extend_from_slice(bytemuck::bytes_of(&c));
                            ctx.dispatch(&pipeline, OP, &bytes, &binds, grid)?;
                        }
                        (None, None) => ctx.dispatch(&pipeline, OP, bytemuck::bytes_of(&params), &binds, grid)?,
                    }
                }
                QKernel::Tiled => {
                    let params = MatmulParams {
                        rows: u(s.rows)?,
                        cols: u(cols)?,
                        row_bytes: u(w.row_bytes())?,
                        w_off: s.w_off,
                        n: u(nc)?,
                        x_off,
                        out_off,
                        out_stride: u(rows)?,
                    };
                    let grid = [u(s.rows.div_ceil(64))?, u(nc.div_ceil(64))?, 1];
                    ctx.dispatch(&pipeline, OP, bytemuck::bytes_of(&params), &binds, grid)?;
                }
                QKernel::Coop => {
                    let d = super::coop::Dims {
                        rows: s.rows,
                        cols,
                        row_bytes: w.row_bytes(),
                        w_off: s.w_off,
                        n: nc,
                        x_off,
                        out_off,
                        out_stride: out_rows,
                        r_off,
                    };
                    coop_plan
                        .as_ref()
                        .ok_or_else(|| Error::gpu(OP, "no coop plan"))?
                        .dispatch(&ctx, &pipeline, d, &binds)?;
                }
            }
        }
        n0 += nc;
    }
    Ok(out)
}

/// Rows `ids` of W dequantized to f32 [len(ids), cols] (ids already range-checked).
pub fn gather_rows(w: &QTensor, ids: &[u32]) -> Result<Tensor> {
    gather_rows_opts(w, ids, QOptions::default())
}

/// [`gather_rows`] with the binding limit of `opts` (tests of the row slicing).
pub fn gather_rows_opts(w: &QTensor, ids: &[u32], opts: QOptions) -> Result<Tensor> {
    const OP: &str = "embedding";
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= w.rows()) {
        return Err(Error::Index { op: OP, index: bad as i64, len: w.rows() });
    }
    let (_, ctx) = gpu_weights(OP, w)?;
    if ids.is_empty() || w.cols() == 0 {
        return Tensor::gpu_empty(vec![ids.len(), w.cols()], DType::F32, w.device());
    }
    let idbuf = ctx.upload(bytemuck::cast_slice(ids))?;
    gather_rows_from(w, &idbuf, ids.len(), opts)
}

/// Rows of W whose ids are the first `n_ids` u32 of `idbuf` (on the GPU: a recorded decode
/// step reads the token id from a buffer written before each replay), dequantized to f32
/// [n_ids, cols]. The caller checks the ids are in range (the row of an id past W is not written).
pub fn gather_rows_by_buffer(w: &QTensor, idbuf: &GpuBuffer, n_ids: usize) -> Result<Tensor> {
    if idbuf.len < n_ids as u64 * 4 {
        return Err(Error::shape("embedding", format!("{n_ids} ids requested from a buffer of {} bytes", idbuf.len)));
    }
    gather_rows_from(w, idbuf, n_ids, QOptions::default())
}

fn gather_rows_from(w: &QTensor, idbuf: &GpuBuffer, n_ids: usize, opts: QOptions) -> Result<Tensor> {
    const OP: &str = "embedding";
    let (wbuf, ctx) = gpu_weights(OP, w)?;
    let (cols, ty) = (w.cols(), w.ggml_type());
    let out = Tensor::gpu_empty(vec![n_ids, cols], DType::F32, w.device())?;
    if n_ids == 0 || cols == 0 {
        return Ok(out);
    }
    let u = |v: usize| to_u32(OP, v);
    u(n_ids.checked_mul(cols).ok_or_else(|| Error::shape(OP, "output size overflows"))?)?;
    let obuf = out.gpu_buffer().ok_or_else(|| Error::mismatch(OP, "output is not on a GPU"))?;
    let spec = KernelSpec::new(format!("qgather_{}", wgsl_name(ty)), type_source(Source::Gather, ty), "gather");
    let pipeline = ctx.pipeline(&spec, &[])?;
    for s in row_slices(OP, w, binding_limit(&ctx, &opts))? {
        let params = GatherParams {
            cols: u(cols)?,
            row_bytes: u(w.row_bytes())?,
            w_off: s.w_off,
            n_ids: u(n_ids)?,
            r0: u(s.r0)?,
            rows: u(s.rows)?,
            _pad: [0; 2],
        };
        let binds = [Bind::Slice(wbuf.buffer(), s.bind_off, s.bind_len), Bind::Whole(idbuf), Bind::Whole(obuf)];
        ctx.dispatch(&pipeline, OP, bytemuck::bytes_of(&params), &binds, ctx.grid_1d(u(n_ids)?))?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::{type_source, vec4_weights, GgmlType, Q8Rows, Source, W_DECL_WORDS, W_VIEW_WORDS};

    /// The vec4 view rewrites every word read of W, nested ones included, and nothing else (x's
    /// `xw[..]`, words that end in w); the matvec kernels' text holds the declaration and
    /// `w4_at` it replaces.
    #[test]
    fn vec4_weights_rewrites_every_word_read() {
        let text = format!(
            "{W_DECL_WORDS}\n{W_VIEW_WORDS}\nfn f(i: u32) -> u32 {{ return w[i + w[i >> 2u]] + xw[i] + w[3u]; }}\n// w[i] in a comment\n"
        );
        let out = vec4_weights(&text);
        assert!(out.contains("return w_word(i + w_word(i >> 2u)) + xw[i] + w_word(3u);"), "{out}");
        assert!(out.contains("// w_word(i) in a comment"));
        assert!(out.contains("var<storage, read> wv: array<vec4<u32>>;") && !out.contains(W_DECL_WORDS));
        assert!(out.contains("return wv[i >> 2u];") && !out.contains(W_VIEW_WORDS));

        for ty in [GgmlType::Q4K, GgmlType::Q5K] {
            let words = type_source(Source::MatvecQ8, ty);
            assert!(words.contains(W_DECL_WORDS) && words.contains(W_VIEW_WORDS) && !words.contains("{{W_VIEW}}"));
            let vec4 = type_source(Source::MatvecQ8Vec4, ty);
            assert!(!vec4.contains(W_DECL_WORDS) && !vec4.contains("w[") && vec4.contains("w4_at(qi)"));
        }
    }

    /// The Q8 products read the (d, s) pairs 16 bytes at a time, so the rounded words must be
    /// whole vec4s even for an odd number of blocks (1 x 96: three blocks, 30 words of data),
    /// where a device that reads past a binding as zeros (NVIDIA) dropped the last block. The
    /// H100 run of q8_matvec_matches_cpu_q8 is the end-to-end check; lavapipe reads the pool
    /// buffer's bytes past the binding and cannot show it.
    #[test]
    fn q8_words_are_whole_vec4s() {
        for blocks in [1usize, 3, 7, 128, 449] {
            let numel = 32 * blocks;
            let data = numel / 4 + numel / 16;
            for (count, used) in
                [(Q8Rows::word_count(numel), data), (Q8Rows::normed_word_count(numel), data + numel / 32)]
            {
                assert_eq!(count % 4, 0, "{blocks} blocks: {count} words");
                assert!(count >= used && count < used + 4, "{blocks} blocks: {count} words for {used}");
            }
        }
    }
}
