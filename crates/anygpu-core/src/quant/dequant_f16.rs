//! Quantized weights dequantized to an f16 copy before a long prefill product
//! (dequant_f16.wgsl): the coop kernel then stages them through its F16 loader (one 16-byte
//! load per run of 8 weights) instead of decoding blocks in its staging, which costs it more
//! than the products do. The copy is one pooled buffer per product, made right before it or
//! beside an earlier product (copy_ahead.rs) and dropped with it; it holds the very f16 values the kernel's W staging rounds the decoded weights to, so the product is
//! the same, bit for bit, either way.
//!
//! It pays where a product's decoding costs more than writing and reading the copy and the
//! dispatch between them, i.e. for enough x rows and weights: see `pays`.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

use super::gpu::{binding_limit, gpu_weights, type_source, window, QOptions, Source};
use super::{GgmlType, QTensor};
use crate::error::{Error, Result};
use crate::gpu::Bind;
use crate::ops::to_u32;

const OP: &str = "dequantize to f16";

/// x rows from which the coop kernel's products of quantized weights read an f16 copy. H100,
/// n = 256, Q4_0 (copy of one invocation per run, since made faster): [4096, 14336] 359 ->
/// 318 us, [4096, 4096] 104 -> 92, [28672, 4096] 511 -> 521 and [6144, 4096] 133 -> 135; at n
/// = 512 the Q4_0 and Q4_K products of 4096-wide models gain 9-19% (BENCHMARKS.md,
/// twenty-seventh session).
pub const DEQUANT_MIN_N: usize = 256;

/// Weights from which a product reads an f16 copy (2048 x 2048): each copy is a dispatch and a
/// dependency more, and SmolLM2's products (1.8M weights at most, a few µs each) lost with it
/// (H100, pp512 92.9-99.5k -> 65-97k tok/s).
pub const DEQUANT_MIN_WEIGHTS: usize = 1 << 22;

/// See [`set_override`]: 0 none, 1 never, 2 always.
static FORCED: AtomicU8 = AtomicU8::new(0);

/// Forces the f16 copy on (`Some(true)`: every quantized coop product, whatever its n) or off
/// (`Some(false)`), or returns the choice to `ANYGPU_COOP_DEQUANT` and [`pays`] (`None`). For
/// tests and benchmarks; it applies process-wide, so tests that use it take turns.
#[doc(hidden)]
pub fn set_override(on: Option<bool>) {
    FORCED.store(on.map_or(0, |v| 1 + v as u8), Ordering::Relaxed);
}

/// `ANYGPU_COOP_DEQUANT=0|1` (read once): never / always, for comparisons.
fn env_forced() -> Option<bool> {
    static V: OnceLock<Option<bool>> = OnceLock::new();
    *V.get_or_init(|| match std::env::var("ANYGPU_COOP_DEQUANT").ok().as_deref() {
        Some("0") => Some(false),
        Some("1") => Some(true),
        None | Some("") => None,
        Some(v) => {
            log::warn!("ANYGPU_COOP_DEQUANT={v:?} is not 0 or 1; ignored");
            None
        }
    })
}

/// The copy forced on or off: by [`set_override`], else by `ANYGPU_COOP_DEQUANT`.
fn forced() -> Option<bool> {
    match FORCED.load(Ordering::Relaxed) {
        1 => Some(false),
        2 => Some(true),
        _ => env_forced(),
    }
}

/// Whether a coop product of `n` x rows with quantized weights of `ty` (`weights` of them)
/// reads an f16 copy of them ([`dequantize_to_f16`] first).
pub(super) fn pays(ty: GgmlType, n: usize, weights: usize) -> bool {
    ty.is_quantized() && forced().unwrap_or(n >= DEQUANT_MIN_N && weights >= DEQUANT_MIN_WEIGHTS)
}

/// Whether a product of `n` x rows may read an f16 copy at all (whatever its weights).
pub(super) fn may_pay(n: usize) -> bool {
    forced().unwrap_or(n >= DEQUANT_MIN_N)
}

/// Runs of 8 weights each invocation expands (256 apart, loads first): H100, Q4_0 [28672,
/// 4096] 162 us (1.86 TB/s read and written) with one, 131 with two, 126 (2.39 TB/s) with four,
/// 161 with eight; Q4_K and Q6_K alike within ~10%. The stores set the floor: the same kernel
/// storing without loading or decoding took 97-104 us (235 MB written, ~2.35 TB/s), decoding
/// without storing 59-64. Also measured: a run's 16 bytes in one store (`pack2x16float`)
/// instead of two `vec4<f16>` stores, 120-121 us against 125-126, mixed on [4096, 14336] (not
/// kept: its rounding is the driver's packing, not the `vec4<f16>` conversion the product's
/// staging uses); an invocation's runs consecutive instead of 256 apart, 0.86 TB/s (each store
/// instruction of a warp then spans 2 KiB).
const RUNS_PER_INVOCATION: u32 = 4;

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    row_runs: u32,
    row_bytes: u32,
    w_off: u32,
    runs: u32,
    out_off: u32,
    _pad: [u32; 3],
}

/// W as an F16 matrix of the same shape, in a new GPU buffer (rows whose every run of 8 starts
/// at a 16-byte boundary: the coop kernel's F16 loader). Each dispatch covers the rows whose
/// f16 copy fits one binding (`opts.max_binding` or the device's), their blocks bound beside it.
pub fn dequantize_to_f16(w: &QTensor, opts: &QOptions) -> Result<QTensor> {
    fill(w, gpu_weights(OP, w)?.1.alloc(copy_bytes(w)?)?, opts)
}

/// The f16 copy for a product, or `None` where the device has no room for it (the product
/// then decodes the blocks itself, as it would for fewer x rows).
pub(super) fn copy_for_product(w: &QTensor, opts: &QOptions) -> Result<Option<QTensor>> {
    copy_buffer(w)?.map(|out| fill(w, out, opts)).transpose()
}

/// A new buffer for W's f16 copy, or `None` (logged) where the device has no room for it; an
/// error for weights that are not quantized.
pub(super) fn copy_buffer(w: &QTensor) -> Result<Option<crate::gpu::GpuBuffer>> {
    let bytes = copy_bytes(w)?;
    match gpu_weights(OP, w)?.1.alloc(bytes) {
        Ok(out) => Ok(Some(out)),
        Err(e) => {
            log::info!("{OP}: no room for the f16 copy of {w:?} ({e}); its product decodes the blocks");
            Ok(None)
        }
    }
}

/// Bytes of W's f16 copy; an error for weights that are not quantized.
fn copy_bytes(w: &QTensor) -> Result<u64> {
    if !w.ggml_type().is_quantized() {
        return Err(Error::mismatch(OP, format!("{} weights are not quantized", w.ggml_type())));
    }
    let n = (w.rows() as u64).checked_mul(w.cols() as u64).ok_or_else(|| Error::shape(OP, "size overflows"))?;
    GgmlType::F16.byte_size(n)
}

/// Dequantizes W into `out` (its f16 copy's bytes) and wraps that as the copy.
pub(super) fn fill(w: &QTensor, out: crate::gpu::GpuBuffer, opts: &QOptions) -> Result<QTensor> {
    let (wbuf, ctx) = gpu_weights(OP, w)?;
    // Quantized rows are whole blocks of 32 or 256 weights (copy_bytes checked the type), so
    // whole runs of 8, and each f16 row starts at a 16-byte boundary.
    let (rows, cols, ty) = (w.rows(), w.cols(), w.ggml_type());
    let u = |v: usize| to_u32(OP, v);
    let (f16_row, row_bytes) = (cols as u64 * 2, w.row_bytes() as u64);
    // Rows per dispatch: their copy (and so their blocks, fewer bytes) in one binding.
    let per = (binding_limit(&ctx, opts).saturating_sub(256) / f16_row.max(1)) as usize;
    if per == 0 {
        return Err(Error::Unsupported(format!(
            "{OP}: an f16 row of {cols} weights exceeds this device's max_storage_buffer_binding_size"
        )));
    }
    let spec = crate::gpu::KernelSpec::new(
        format!("qdequant_f16_{}", super::gpu::wgsl_name(ty)),
        type_source(Source::DequantF16, ty),
        "main",
    )
    .with("enable f16;")
    .constant_u32("RPI", RUNS_PER_INVOCATION);
    let pipeline = ctx.pipeline(&spec, &[])?;
    let mut r0 = 0;
    while r0 < rows {
        let nr = per.min(rows - r0);
        let (wbind, w_off) = window(wbuf.buffer(), r0 as u64 * row_bytes, nr as u64 * row_bytes);
        let (obind, o_off) = window(out.buffer(), r0 as u64 * f16_row, nr as u64 * f16_row);
        let runs = nr * (cols / 8);
        let params = Params {
            row_runs: u(cols / 8)?,
            row_bytes: u(row_bytes as usize)?,
            w_off: u(w_off as usize)?,
            runs: u(runs)?,
            // Rows start at 16-byte boundaries (cols a multiple of 8), so does the window.
            out_off: u(o_off as usize / 16)?,
            _pad: [0; 3],
        };
        let binds: [Bind<'_>; 2] = [wbind, obind];
        ctx.dispatch(
            &pipeline,
            OP,
            bytemuck::bytes_of(&params),
            &binds,
            ctx.grid_1d(u(runs.div_ceil(256 * RUNS_PER_INVOCATION as usize))?),
        )?;
        r0 += nr;
    }
    QTensor::from_gpu_buffer(GgmlType::F16, rows, cols, out, w.device())
}
