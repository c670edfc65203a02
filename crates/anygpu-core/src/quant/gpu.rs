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
//! 256 invocations per workgroup, `TPR` = 32 per row (fewer for short rows), 8 rows per
//! workgroup. A work unit is one 4-byte quant word of a 32-weight block (4 units per block) or 16
//! weights of a k-quant super-block (16 units per block), plus the block's scales; invocation t
//! takes units t, t + TPR, ... four at a time (independent loads in flight), decodes them in
//! registers and multiplies with x at once; the min / offset terms fold per group as
//! d·Σq·x − m·Σx; partial sums meet in a workgroup tree. Byte lanes become floats through the
//! exact `0x4B000000 | b` − 2^23 trick instead of int-to-float conversions (quarter rate).
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
//! The quantized kernels are bound by instructions per unit (addressing, scale extraction), not
//! by DRAM; Q2_K / Q3_K, whose units do 4 scale extractions per word, most of all.
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

use super::{GgmlType, QStorage, QTensor};
use crate::error::{Error, Result};
use crate::gpu::{Bind, GpuBuffer, GpuContext, KernelSpec};
use crate::ops::to_u32;
use crate::tensor::{DType, Tensor};

const COMMON_WGSL: &str = include_str!("common.wgsl");
const MATVEC_WGSL: &str = include_str!("matvec.wgsl");
const MATMUL_WGSL: &str = include_str!("matmul.wgsl");
const GATHER_WGSL: &str = include_str!("gather.wgsl");

/// Invocations per workgroup of every kernel here (WebGPU's default maximum).
const WG: usize = 256;

/// Binding offsets are rounded down to this (WebGPU caps min_storage_buffer_offset_alignment
/// at 256, and every power of two up to it divides it).
const BIND_ALIGN: u64 = 256;

/// Up to this many x rows, the matvec kernel (run once per x row) beats the tiled one, whose
/// 64 x 64 tiles leave a GPU mostly idle at small n (H100, 4096 x 4096 Q4_K: 154 µs against
/// 565 µs at n = 16).
pub const MATVEC_MAX_N: usize = 16;

/// The widest x row the matvec kernel's RMSNorm prologue takes (see `qmatvec_fused`).
pub const NORM_PROLOGUE_MAX_COLS: usize = 1024;

/// Which kernel a product uses (tests force each one on every shape).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QKernel {
    /// The matrix-vector kernel, once per x row.
    Matvec,
    /// The tiled matrix-matrix kernel.
    Tiled,
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
}

/// The WGSL suffix of a type's functions (`mv_q4_0`, `deq8_q4_0`).
fn wgsl_name(ty: GgmlType) -> &'static str {
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

/// Work units per row of the matvec kernel (see the `mv_*` functions in matvec.wgsl): 4 elements
/// of the plain float types, one quant word of the 32-weight blocks (4 per block), 16 weights of
/// the k-quants (16 per super-block).
fn matvec_units(ty: GgmlType, cols: usize) -> usize {
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => cols.div_ceil(4),
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => cols / 8,
        GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => cols / 16,
    }
}

/// Invocations per row: 32 (one warp on NVIDIA), fewer for short rows (about four units each).
/// Measured on an H100 over 8..256 for every type: 32 was best or within a few percent for
/// rows of 4096 weights and 4096 to 32000 rows.
fn threads_per_row(units: usize) -> usize {
    units.div_ceil(4).next_power_of_two().clamp(1, 32)
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
fn gpu_weights(op: &'static str, w: &QTensor) -> Result<(Arc<GpuBuffer>, Arc<GpuContext>)> {
    match w.storage() {
        QStorage::Gpu(b) => Ok((b.clone(), b.context().clone())),
        QStorage::Cpu { .. } => Err(Error::mismatch(op, "weights are not on a GPU")),
    }
}

/// The largest binding to use: the device's limit (or a test's), kept within the kernels' u32
/// byte offsets.
fn binding_limit(ctx: &GpuContext, opts: &QOptions) -> u64 {
    opts.max_binding.unwrap_or(ctx.caps.max_storage_buffer_binding_size).min(u32::MAX as u64)
}

/// A binding that starts `start` bytes into `buf` and spans `len` bytes, at an offset rounded
/// down to [`BIND_ALIGN`]; returns it with the distance from its start to `start`.
fn window(buf: &wgpu::Buffer, start: u64, len: u64) -> (Bind<'_>, u64) {
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
    _pad: [u32; 3],
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
fn keep_sections(src: &str, tag: &str) -> String {
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
enum Source {
    Matvec = 0,
    Matmul = 1,
    Gather = 2,
}

/// The WGSL of one kernel for one type: common.wgsl and the kernel's file with that type's
/// sections only, and the forwarding function the entry point calls. Built once per
/// (kernel, type) and kept for the life of the process (39 strings at most), so the pipeline
/// cache can key on a `&'static str` as it does for the other kernels.
fn type_source(kind: Source, ty: GgmlType) -> &'static str {
    static SOURCES: [[OnceLock<&'static str>; 13]; 3] = [const { [const { OnceLock::new() }; 13] }; 3];
    let ti = GgmlType::ALL.iter().position(|&t| t == ty).unwrap_or(0);
    SOURCES[kind as usize][ti].get_or_init(|| {
        let name = wgsl_name(ty);
        let (file, forward) = match kind {
            Source::Matvec => {
                (MATVEC_WGSL, format!("fn mv_unit(rb: u32, u: u32, xb: u32) -> f32 {{ return mv_{name}(rb, u, xb); }}"))
            }
            Source::Matmul | Source::Gather => (
                if matches!(kind, Source::Matmul) { MATMUL_WGSL } else { GATHER_WGSL },
                format!("fn deq8(rb: u32, c: u32, cols: u32) -> V8 {{ return deq8_{name}(rb, c, cols); }}"),
            ),
        };
        let text = format!("{}\n{}\n{forward}\n", keep_sections(COMMON_WGSL, name), keep_sections(file, name));
        Box::leak(text.into_boxed_str())
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
}

impl Epilogue<'_> {
    fn name(&self) -> &'static str {
        match self {
            Epilogue::Store => "",
            Epilogue::Add(_) => "_add",
            Epilogue::Glu => "_glu",
        }
    }
    /// (EPILOGUE_DECL, ROWS, STORE) replacements of matvec.wgsl.
    fn wgsl(&self) -> [(&'static str, &'static str); 3] {
        const ROWS: &str = "    let orow = (g - xr * p.groups) * RPW + slot;\n    let row = orow;";
        const STORE: &str =
            "    if (live && t == 0u) {\n        out[p.out_off + xr * p.out_stride + orow] = red[lid];\n    }";
        match self {
            Epilogue::Store => [("EPILOGUE_DECL", ""), ("ROWS", ROWS), ("STORE", STORE)],
            Epilogue::Add(_) => [
                ("EPILOGUE_DECL", "@group(0) @binding(4) var<storage, read> resid: array<f32>;"),
                ("ROWS", ROWS),
                (
                    "STORE",
                    "    if (live && t == 0u) {\n        out[p.out_off + xr * p.out_stride + orow] = red[lid] + resid[p.r_off + xr * p.out_stride + orow];\n    }",
                ),
            ],
            Epilogue::Glu => [
                ("EPILOGUE_DECL", ""),
                (
                    "ROWS",
                    "    let half = RPW / 2u;\n    let orow = (g - xr * p.groups) * half + slot % half;\n    let row = orow + select(0u, p.rows, slot >= half);",
                ),
                (
                    "STORE",
                    "    if (live && t == 0u && slot < RPW / 2u) {\n        let gate = red[lid];\n        let up = red[lid + (RPW / 2u) * TPR];\n        out[p.out_off + xr * p.out_stride + orow] = gate / (1.0 + exp(-gate)) * up;\n    }",
                ),
            ],
        }
    }
}

/// The x-side replacements of matvec.wgsl (X_DECL, PROLOGUE, XB): x read from its binding,
/// or (`norm_binding` = Some(4 or 5)) x staged in workgroup memory RMS-normalised and scaled by
/// the norm weight bound there; the staged row's size is the header constant `XN` (vec4
/// units for the quantized types, whose rows are whole 32-weight blocks; elements rounded up to
/// 4 otherwise, of which the first `p.cols` are read).
/// Static text: built per dispatch, it would cost host time on every product.
fn x_side(quantized: bool, norm_binding: Option<u32>) -> [(&'static str, &'static str); 3] {
    // The RMSNorm of x row xr into workgroup memory, as the rms_norm kernel computes it; the
    // two variants differ in the row length, the square and the store.
    macro_rules! prologue {
        ($len:literal, $square:literal, $store:literal) => {
            concat!(
                "    // RMSNorm of x row xr into workgroup memory (x_side in gpu.rs).
    let xrow = p.x_off + min(xr, p.n - 1u) * p.x_stride;
    var ss = 0.0;
    for (var i = lid; i < ",
                $len,
                "; i += 256u) {
        let v = xin[xrow + i];
        ss += ",
                $square,
                ";
    }
    red[lid] = ss;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (lid < s) {
            red[lid] += red[lid + s];
        }
        workgroupBarrier();
    }
    let inv_rms = inverseSqrt(red[0] / f32(p.cols) + p.eps);
    for (var i = lid; i < ",
                $len,
                "; i += 256u) {
        ",
                $store,
                ";
    }
    workgroupBarrier();"
            )
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

/// `x @ W^T` for x [n, cols] f32 (any leading shape, flattened to n rows) -> `out_shape`.
pub fn qmatmul(w: &QTensor, x: &Tensor, n: usize, out_shape: Vec<usize>) -> Result<Tensor> {
    qmatmul_with(w, x, n, out_shape, QOptions::default(), Epilogue::Store, None)
}

/// The matvec kernel with a fused epilogue, for x [.., cols] with at most [`MATVEC_MAX_N`] rows;
/// `Ok(None)` when the shapes need the unfused path (more x rows, or a GLU matrix too large for
/// one binding). Shapes are checked by the caller (`QTensor::qmatmul_add` / `qmatmul_glu`).
/// `norm` = (weight [cols], eps) applies RMSNorm to x first (the prologue), when a row fits in
/// workgroup memory.
pub(crate) fn qmatvec_fused(
    w: &QTensor,
    x: &Tensor,
    epi: Epilogue<'_>,
    norm: Option<(&Tensor, f32)>,
    opts: QOptions,
) -> Result<Option<Tensor>> {
    let n = x.numel() / w.cols().max(1);
    let (_, ctx) = gpu_weights("qmatmul", w)?;
    if n == 0 || n > MATVEC_MAX_N || opts.kernel == Some(QKernel::Tiled) {
        return Ok(None);
    }
    // The staged row and the reduction array must fit in workgroup memory, and the row must be
    // short: every workgroup stages it before its first product, which on the H100 cost more
    // than the separate rms_norm dispatch it saves for 4096-wide rows (8B shapes: the gate|up
    // product 58 -> 102 µs), and less for 576-wide ones (SmolLM2: 242 dispatches instead of
    // 303, GPU time per token 1.58 -> 1.36 ms).
    let staged = (w.cols().next_multiple_of(4) * 4 + WG * 4) as u64;
    if norm.is_some()
        && (w.cols() > NORM_PROLOGUE_MAX_COLS || staged > ctx.caps.max_compute_workgroup_storage_size as u64)
    {
        return Ok(None);
    }
    let out_rows = match epi {
        Epilogue::Glu => {
            if row_slices("qmatmul", w, binding_limit(&ctx, &opts))?.len() > 1 {
                return Ok(None);
            }
            w.rows() / 2
        }
        _ => w.rows(),
    };
    let mut out_shape = x.dims().to_vec();
    if let Some(last) = out_shape.last_mut() {
        *last = out_rows;
    }
    let opts = QOptions { kernel: Some(QKernel::Matvec), ..opts };
    qmatmul_with(w, x, n, out_shape, opts, epi, norm).map(Some)
}

/// [`qmatmul`] with the kernel choice and binding limit of `opts` (tests, benchmarks). Shapes
/// are checked as `QTensor::qmatmul` does.
pub fn qmatmul_opts(w: &QTensor, x: &Tensor, opts: QOptions) -> Result<Tensor> {
    const OP: &str = "qmatmul";
    if !x.device().same(w.device()) || x.dtype() != DType::F32 || x.dims().last() != Some(&w.cols()) {
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
    qmatmul_with(w, x, n, out_shape, opts, Epilogue::Store, None)
}

fn qmatmul_with(
    w: &QTensor,
    x: &Tensor,
    n: usize,
    out_shape: Vec<usize>,
    opts: QOptions,
    epi: Epilogue<'_>,
    norm: Option<(&Tensor, f32)>,
) -> Result<Tensor> {
    const OP: &str = "qmatmul";
    let (wbuf, ctx) = gpu_weights(OP, w)?;
    let (rows, cols, ty) = (w.rows(), w.cols(), w.ggml_type());
    // Output elements per x row (half of W's rows under GLU).
    let out_rows = if matches!(epi, Epilogue::Glu) { rows / 2 } else { rows };
    if n == 0 || rows == 0 || cols == 0 {
        return Tensor::zeros(out_shape, DType::F32, w.device());
    }
    let out = Tensor::gpu_empty(out_shape, DType::F32, w.device())?;
    let mut x = x.contiguous()?;
    // The quantized kernels read x as vec4: its first element must sit on a 16-byte boundary
    // (rows are whole 32-weight blocks, so every row then does).
    if ty.is_quantized() && x.layout().offset % 4 != 0 {
        x = crate::ops::copy::gpu_contiguous(&x)?;
    }
    let xbuf = x.gpu_buffer().ok_or_else(|| Error::mismatch(OP, "input is not on a GPU"))?;
    let obuf = out.gpu_buffer().ok_or_else(|| Error::mismatch(OP, "output is not on a GPU"))?;
    let max_binding = binding_limit(&ctx, &opts);
    let slices = row_slices(OP, w, max_binding)?;
    let kernel = opts.kernel.unwrap_or(if n <= MATVEC_MAX_N { QKernel::Matvec } else { QKernel::Tiled });
    let resid = match epi {
        Epilogue::Add(r) => {
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
    let fused = !matches!(epi, Epilogue::Store) || norm.is_some();
    if fused && (kernel != QKernel::Matvec || (matches!(epi, Epilogue::Glu) && slices.len() > 1)) {
        return Err(Error::Unsupported(format!("{OP}: fused epilogues need the matvec kernel and one binding")));
    }

    // x rows per dispatch: all of them unless x or the output exceeds one binding.
    let widest = (cols.max(rows) as u64) * 4;
    let n_per = ((max_binding.saturating_sub(BIND_ALIGN) / widest) as usize).min(n);
    if n_per == 0 {
        return Err(Error::Unsupported(format!(
            "{OP}: one row of input or output ({cols} or {rows} floats) exceeds this device's \
             max_storage_buffer_binding_size of {max_binding} bytes"
        )));
    }
    let u = |v: usize| to_u32(OP, v);
    // Every element index the kernels form must fit u32.
    u(n.checked_mul(rows.max(cols)).ok_or_else(|| Error::shape(OP, "size overflows"))?)?;

    let name = wgsl_name(ty);
    let tpr = match opts.threads_per_row {
        Some(t) if t.is_power_of_two() && t <= WG => t,
        Some(t) => return Err(Error::shape(OP, format!("threads_per_row {t} is not a power of two up to {WG}"))),
        None => threads_per_row(matvec_units(ty, cols)),
    };

    // GLU pairs two row slots per output row.
    let tpr = if matches!(epi, Epilogue::Glu) { tpr.min(WG / 2) } else { tpr };
    let spec = match kernel {
        QKernel::Matvec => KernelSpec::new(
            format!("qmatvec_{name}_t{tpr}{}{}", epi.name(), if norm.is_some() { "_norm" } else { "" }),
            type_source(Source::Matvec, ty),
            "matvec",
        )
        .constant_u32("TPR", tpr as u32)
        .constant_u32("RPW", (WG / tpr) as u32)
        // The staged row of the RMSNorm prologue (vec4 units for the quantized types, elements
        // rounded up to 4 otherwise); only then, so that the plain kernels stay one pipeline for
        // every width.
        .with(&match norm {
            Some(_) => {
                format!("const XN: u32 = {}u;", if ty.is_quantized() { cols / 4 } else { cols.next_multiple_of(4) })
            }
            None => String::new(),
        }),
        QKernel::Tiled => KernelSpec::new(format!("qmatmul_{name}"), type_source(Source::Matmul, ty), "matmul"),
    };
    let norm_binding = norm.map(|_| if resid.is_some() { 5 } else { 4 });
    let pipeline = match kernel {
        QKernel::Matvec => {
            let [e0, e1, e2] = epi.wgsl();
            let [x0, x1, x2] = x_side(ty.is_quantized(), norm_binding);
            ctx.pipeline(&spec, &[e0, e1, e2, x0, x1, x2])?
        }
        QKernel::Tiled => ctx.pipeline(&spec, &[])?,
    };
    let norm_w = match norm {
        Some((g, _)) => {
            if g.numel() != cols || g.dtype() != DType::F32 || !g.device().same(w.device()) {
                return Err(Error::shape(OP, format!("norm weight {} does not match {cols} columns", g.shape())));
            }
            Some(g.contiguous()?)
        }
        None => None,
    };
    let resid_buf = match &resid {
        Some(r) => {
            Some((r.gpu_buffer().ok_or_else(|| Error::mismatch(OP, "residual is not on a GPU"))?, r.layout().offset))
        }
        None => None,
    };
    // The matvec kernel reads x in vec4 units for the quantized types, in elements otherwise.
    let x_unit = if kernel == QKernel::Matvec && ty.is_quantized() { 16 } else { 4 };
    let x_start = x.layout().offset as u64 * 4;
    let mut n0 = 0;
    while n0 < n {
        let nc = n_per.min(n - n0);
        for s in &slices {
            let (xbind, x_delta) = window(xbuf.buffer(), x_start + (n0 * cols) as u64 * 4, (nc * cols) as u64 * 4);
            let (obind, o_delta) = window(obuf.buffer(), (n0 * out_rows) as u64 * 4, (nc * out_rows) as u64 * 4);
            let mut binds = vec![Bind::Slice(wbuf.buffer(), s.bind_off, s.bind_len), xbind, obind];
            let mut r_off = 0;
            if let Some((rbuf, roff)) = resid_buf {
                let (rbind, r_delta) = window(rbuf.buffer(), (roff + n0 * rows) as u64 * 4, (nc * rows) as u64 * 4);
                binds.push(rbind);
                r_off = u(r_delta as usize / 4 + s.r0)?;
            }
            if let Some(g) = &norm_w {
                let gb = g.gpu_buffer().ok_or_else(|| Error::mismatch(OP, "norm weight is not on a GPU"))?;
                let (gbind, g_delta) = window(gb.buffer(), g.layout().offset as u64 * 4, cols as u64 * 4);
                if g_delta != 0 {
                    return Err(Error::Unsupported(format!("{OP}: a norm weight view off a 256-byte boundary")));
                }
                binds.push(gbind);
            }
            let out_off = u(o_delta as usize / 4 + s.r0)?;
            let x_off = u(x_delta as usize / x_unit)?;
            match kernel {
                QKernel::Matvec => {
                    let (rpw, slice_rows) = match epi {
                        Epilogue::Glu => (WG / tpr / 2, out_rows),
                        _ => (WG / tpr, s.rows),
                    };
                    let groups = slice_rows.div_ceil(rpw);
                    let params = MatvecParams {
                        rows: u(slice_rows)?,
                        cols: u(cols)?,
                        row_bytes: u(w.row_bytes())?,
                        w_off: s.w_off,
                        units: u(matvec_units(ty, cols))?,
                        x_off,
                        x_stride: u(cols * 4 / x_unit)?,
                        out_off,
                        out_stride: u(out_rows)?,
                        groups: u(groups)?,
                        n: u(nc)?,
                        r_off,
                        eps: norm.map_or(0.0, |(_, e)| e),
                        _pad: [0; 3],
                    };
                    let wgs = groups.checked_mul(nc).ok_or_else(|| Error::shape(OP, "grid overflows"))?;
                    ctx.dispatch(&pipeline, OP, bytemuck::bytes_of(&params), &binds, ctx.grid_1d(u(wgs)?))?;
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
