//! CPU products with quantized weights and f32 activations: `matvec` for decode (one token),
//! `matmul` for prefill (many tokens). They equal dequantize-then-dot up to summation order,
//! so they are the reference the GPU kernels are checked against. `matmul_q8` is the CPU
//! backend's faster product for running models (activations rounded to 8 bits, integer dot
//! products: `q8.rs`), chosen per weight with `QTensor::with_cpu_math`.
//!
//! `matvec` reads each weight block once and multiplies it with `x` while it is in registers: the
//! row is never expanded to f32. `x` stays f32 (no Q8 rounding of the activations), so the result
//! equals the dequantize-then-dot reference up to float summation order. Each type's dot product
//! is written as fixed-width lane loops the compiler vectorises; on x86-64 the row loop is also
//! compiled a second time with AVX2 + FMA + F16C and picked at run time, since the portable
//! baseline (SSE2) has no FMA and no 256-bit integer ops.
//!
//! Weight-independent work on `x` is done once per call: per-group sums of `x` turn the
//! minimum term of Q4_1, Q5_1, Q2_K, Q4_K and Q5_K into one multiply per group
//! (`d*sum(q*x) + m*sum(x)`).
//!
//! `matmul` dequantizes a chunk of rows once (into a small f32 buffer that stays in cache) and
//! multiplies it with all `n` inputs through the `gemm` crate.

// The kernels index several fixed-size arrays in step (`acc[l]`, `q[l]`, `x[l]`): that is the
// shape the vectoriser turns into vector registers, so iterator rewrites are not wanted here.
#![allow(clippy::needless_range_loop)]

use rayon::prelude::*;

use super::blocks::*;
use super::dequant;
use super::GgmlType;
use crate::error::{Error, Result};

/// y = W x, with W `rows` x `cols` in `ty` blocks, row-major as ggml stores it (row r is bytes
/// `[r * row_bytes, (r + 1) * row_bytes)`), `x.len() == cols`, `y.len() == rows`.
pub fn matvec(ty: GgmlType, weights: &[u8], rows: usize, cols: usize, x: &[f32], y: &mut [f32]) -> Result<()> {
    matvec_on(Isa::Best, ty, weights, rows, cols, x, y)
}

/// Which compiled variant of the row loop runs: the best this CPU has, or the portable one (so
/// tests cover it on machines that always take the AVX2 path).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Isa {
    Best,
    #[cfg_attr(not(test), allow(dead_code))]
    Portable,
}

fn matvec_on(isa: Isa, ty: GgmlType, weights: &[u8], rows: usize, cols: usize, x: &[f32], y: &mut [f32]) -> Result<()> {
    check("matvec", ty, weights, rows, cols, x.len(), rows, y.len())?;
    if rows == 0 {
        return Ok(());
    }
    if cols == 0 {
        y.fill(0.0);
        return Ok(());
    }
    match ty {
        GgmlType::F32 => drive(isa, &F32Kernel { x }, weights, cols, y),
        GgmlType::F16 => drive(isa, &F16Kernel { x }, weights, cols, y),
        GgmlType::BF16 => drive(isa, &Bf16Kernel { x }, weights, cols, y),
        GgmlType::Q4_0 => drive(isa, &Q4_0Kernel { x }, weights, cols, y),
        GgmlType::Q4_1 => drive(isa, &Q4_1Kernel { x, sums: group_sums(x, QK) }, weights, cols, y),
        GgmlType::Q5_0 => drive(isa, &Q5_0Kernel { x }, weights, cols, y),
        GgmlType::Q5_1 => drive(isa, &Q5_1Kernel { x, sums: group_sums(x, QK) }, weights, cols, y),
        GgmlType::Q8_0 => drive(isa, &Q8_0Kernel { x }, weights, cols, y),
        GgmlType::Q2K => drive(isa, &Q2KKernel { x, sums: group_sums(x, 16) }, weights, cols, y),
        GgmlType::Q3K => drive(isa, &Q3KKernel { x }, weights, cols, y),
        GgmlType::Q4K => drive(isa, &Q4KKernel { x, sums: group_sums(x, 32) }, weights, cols, y),
        GgmlType::Q5K => drive(isa, &Q5KKernel { x, sums: group_sums(x, 32) }, weights, cols, y),
        GgmlType::Q6K => drive(isa, &Q6KKernel { x }, weights, cols, y),
    }
}

/// Y = X W^T for `n` inputs at once: `x` is `n` x `cols` (row-major), `y` is `n` x `rows`
/// (row-major), W as in [`matvec`]. Each weight block is dequantized once per call, not once per
/// input; two inputs or fewer go through [`matvec`] one by one instead, which is faster there
/// (measured: 1536x576 Q4_1, n = 2: 0.24 ms as matvecs, 0.33 ms dequantized).
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    ty: GgmlType,
    weights: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    y: &mut [f32],
) -> Result<()> {
    if !product_shapes(ty, weights, rows, cols, x, n, y)? {
        return Ok(());
    }
    if n <= MATVEC_UP_TO {
        for (xi, yi) in x.chunks_exact(cols).zip(y.chunks_exact_mut(rows)) {
            matvec(ty, weights, rows, cols, xi, yi)?;
        }
        return Ok(());
    }
    let row_bytes = weights.len() / rows;
    // ~128 KiB of f32 rows per chunk: big enough for gemm to reach speed, small enough for L2.
    let chunk_rows = (32 * 1024 / cols).clamp(8, 256).min(rows);
    let chunks: Vec<Vec<f32>> = weights
        .par_chunks(chunk_rows * row_bytes)
        .map(|w| -> Result<Vec<f32>> {
            let rc = w.len() / row_bytes;
            let mut wf = vec![0f32; rc * cols];
            dequant::dequantize(ty, w, &mut wf)?;
            let mut out = vec![0f32; n * rc];
            gemm_xwt(n, rc, cols, x, &wf, &mut out);
            Ok(out)
        })
        .collect::<Result<_>>()?;
    for (c, out) in chunks.iter().enumerate() {
        let r0 = c * chunk_rows;
        let rc = out.len() / n;
        for i in 0..n {
            y[i * rows + r0..][..rc].copy_from_slice(&out[i * rc..][..rc]);
        }
    }
    Ok(())
}

/// Y = X W^T as [`matmul`] (any `n`, 1 included), but with the activations rounded to 8-bit
/// blocks and integer dot products where `ty` has such a kernel (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0:
/// `q8.rs`; Q4_K, Q5_K, Q6_K: `q8k.rs`): llama.cpp's CPU arithmetic, several times faster
/// than f32 activations. Other types take the exact f32 path. Results differ from
/// dequantize-then-dot by the rounding of x (up to 1/254 of each block's largest |x|), so this
/// is for running models, not a reference.
#[allow(clippy::too_many_arguments)]
pub fn matmul_q8(
    ty: GgmlType,
    weights: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    y: &mut [f32],
) -> Result<()> {
    if !super::q8::supports(ty) && !super::q8k::supports(ty) {
        return if n == 1 { matvec(ty, weights, rows, cols, x, y) } else { matmul(ty, weights, rows, cols, x, n, y) };
    }
    if !product_shapes(ty, weights, rows, cols, x, n, y)? {
        return Ok(());
    }
    let path = super::q8::Path::best();
    if super::q8k::supports(ty) {
        super::q8k::matmul(path, ty, weights, rows, cols, x, n, y);
    } else {
        super::q8::matmul(path, ty, weights, rows, cols, x, n, y);
    }
    Ok(())
}

/// Checks the shapes of Y = X W^T ([`matmul`], [`matmul_q8`]) and settles the empty cases
/// (zero columns: Y = 0); true when there is a product left to compute.
#[allow(clippy::too_many_arguments)]
fn product_shapes(
    ty: GgmlType,
    weights: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    y: &mut [f32],
) -> Result<bool> {
    let x_len =
        n.checked_mul(cols).ok_or_else(|| Error::shape("matmul", format!("{n} x {cols} inputs overflow usize")))?;
    let y_len =
        n.checked_mul(rows).ok_or_else(|| Error::shape("matmul", format!("{n} x {rows} outputs overflow usize")))?;
    if x.len() != x_len {
        return Err(Error::shape("matmul", format!("x has {} elements, expected n x cols = {n} x {cols}", x.len())));
    }
    check("matmul", ty, weights, rows, cols, cols, y_len, y.len())?;
    if rows == 0 || n == 0 {
        return Ok(false);
    }
    if cols == 0 {
        y.fill(0.0);
        return Ok(false);
    }
    Ok(true)
}

/// out (m x n) = x (m x k) * w^T, w being n x k; all row-major and contiguous.
fn gemm_xwt(m: usize, n: usize, k: usize, x: &[f32], w: &[f32], out: &mut [f32]) {
    assert!(x.len() >= m * k && w.len() >= n * k && out.len() >= m * n);
    // SAFETY: the assert above keeps every element gemm touches inside the three slices: dst is
    // m x n with strides (n, 1), lhs m x k with strides (k, 1), rhs k x n with strides (1, k).
    // `out` is borrowed mutably, so nothing else aliases it.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            x.as_ptr(),
            1,
            k as isize,
            w.as_ptr(),
            k as isize,
            1,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// Inputs up to which [`matmul`] runs one [`matvec`] per input.
const MATVEC_UP_TO: usize = 2;

/// Validates the shapes of a product with `rows` x `cols` weights of type `ty`.
#[allow(clippy::too_many_arguments)]
fn check(
    op: &'static str,
    ty: GgmlType,
    weights: &[u8],
    rows: usize,
    cols: usize,
    x_len: usize,
    y_want: usize,
    y_len: usize,
) -> Result<()> {
    let bs = ty.block_size();
    if !cols.is_multiple_of(bs) {
        return Err(Error::shape(op, format!("{cols} columns is not a multiple of the {ty} block size {bs}")));
    }
    if x_len != cols {
        return Err(Error::shape(op, format!("x has {x_len} elements, expected cols = {cols}")));
    }
    if y_len != y_want {
        return Err(Error::shape(op, format!("y has {y_len} elements, expected {y_want}")));
    }
    let row_bytes = cols / bs * ty.type_size();
    let want = (row_bytes as u64)
        .checked_mul(rows as u64)
        .ok_or_else(|| Error::shape(op, format!("{rows} x {cols} {ty} weights overflow")))?;
    if weights.len() as u64 != want {
        return Err(Error::shape(op, format!("{rows} x {cols} {ty} weights need {want} bytes, got {}", weights.len())));
    }
    Ok(())
}

/// Sums of `x` over consecutive groups of `g` elements.
fn group_sums(x: &[f32], g: usize) -> Vec<f32> {
    x.chunks(g).map(|c| c.iter().sum()).collect()
}

// ---------------------------------------------------------------------------------------------
// Row driver: threads, chunking and the run-time choice of instruction set.

/// One weight type's fused dot product of a row of blocks with `x` (held by the kernel).
trait RowDot: Sync {
    /// A block (or a single element, for the float types), viewed in place from the bytes.
    type B: bytemuck::Pod + Sync;
    /// Weights per `B`.
    const PER: usize;
    /// `dot(row, x)`. `FMA = true` means the AVX2 + FMA + F16C variant (or a baseline build
    /// with those, or aarch64): `mul_add` is one instruction and, on x86-64, F16C may be used.
    fn dot<const FMA: bool>(&self, row: &[Self::B]) -> f32;
}

/// Below this many weight bytes a product runs on the calling thread: handing work to the pool
/// costs microseconds, as much as reading ~50 KiB.
const SERIAL_BYTES: usize = 48 * 1024;
/// Smallest piece of work a task gets.
const MIN_TASK_BYTES: usize = 16 * 1024;

fn drive<K: RowDot>(isa: Isa, k: &K, weights: &[u8], cols: usize, y: &mut [f32]) -> Result<()> {
    let blocks: &[K::B] = bytemuck::try_cast_slice(weights)
        .map_err(|e| Error::Format(format!("matvec: weight bytes do not form whole blocks ({e})")))?;
    let per_row = cols / K::PER;
    let rows = y.len();
    if per_row == 0 || blocks.len() != per_row * rows {
        return Err(Error::shape("matvec", "weights do not match rows x cols"));
    }
    if weights.len() <= SERIAL_BYTES {
        run_rows(isa, k, blocks, per_row, y);
        return Ok(());
    }
    let row_bytes = weights.len() / rows;
    let tasks = 4 * rayon::current_num_threads();
    let rows_per_task = rows.div_ceil(tasks).max(MIN_TASK_BYTES.div_ceil(row_bytes)).max(1);
    y.par_chunks_mut(rows_per_task)
        .zip(blocks.par_chunks(rows_per_task * per_row))
        .for_each(|(yc, bc)| run_rows(isa, k, bc, per_row, yc));
    Ok(())
}

/// The row loop of one task, on the best instruction set this CPU has.
fn run_rows<K: RowDot>(isa: Isa, k: &K, blocks: &[K::B], per_row: usize, y: &mut [f32]) {
    let _ = isa; // only x86-64 has a second variant
    #[cfg(target_arch = "x86_64")]
    {
        if isa == Isa::Best
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            // SAFETY: the features this function is compiled for were just detected.
            unsafe { run_rows_avx2(k, blocks, per_row, y) };
            return;
        }
    }
    rows_loop::<K, NATIVE_FMA>(k, blocks, per_row, y)
}

/// Whether the baseline build has what `FMA = true` promises: `mul_add` as one instruction
/// (always on aarch64) and, on x86-64, F16C too (see [`f16x8`]).
const NATIVE_FMA: bool = cfg!(any(target_arch = "aarch64", all(target_feature = "fma", target_feature = "f16c")));

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn run_rows_avx2<K: RowDot>(k: &K, blocks: &[K::B], per_row: usize, y: &mut [f32]) {
    rows_loop::<K, true>(k, blocks, per_row, y)
}

#[inline(always)]
fn rows_loop<K: RowDot, const FMA: bool>(k: &K, blocks: &[K::B], per_row: usize, y: &mut [f32]) {
    for (yr, row) in y.iter_mut().zip(blocks.chunks_exact(per_row)) {
        *yr = k.dot::<FMA>(row);
    }
}

// ---------------------------------------------------------------------------------------------
// Per-type dot products.
//
// Each keeps a fixed number of f32 lanes (16 or 32: two or four AVX2 registers) as accumulators
// so the compiler maps them onto vector registers; a block's partial sums are scaled once per
// block (or group) into them. Lessons from reading the generated code, kept as rules:
// - every helper is `#[inline(always)]` and written as plain `for` loops: a helper LLVM leaves
//   out of line is compiled without AVX2/FMA, and `mul_add` there becomes a libm call;
// - no scalar accumulator beside the lane arrays in a block loop (the min terms get loops of
//   their own): the SLP vectoriser otherwise packs it into the lanes with a pile of shuffles;
// - f16 scales of the 32-weight formats are converted a batch at a time, before the block loop
//   (eight per F16C instruction on AVX2), not one by one inside it;
// - k-quant loops use 16 lanes: 32 lanes plus temporaries spilled to the stack.

/// a * b + c, fused where that is one instruction.
#[inline(always)]
fn fmadd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

#[inline(always)]
fn hsum<const N: usize>(v: &[f32; N]) -> f32 {
    let mut s = 0f32;
    for x in v {
        s += x;
    }
    s
}

/// A k-quant super-block scale (one per 256 weights) to f32, in integer and float ops only.
#[inline(always)]
fn f16_1(a: [u8; 2]) -> f32 {
    f16_bits_to_f32(u16::from_le_bytes(a))
}

/// f16 bits to f32 without a table or a call (after Fabian Giesen's `half_to_float`); exact
/// for every finite and infinite input, NaN stays NaN.
#[inline(always)]
fn f16_bits_to_f32(h: u16) -> f32 {
    const SHIFTED_EXP: u32 = 0x7c00 << 13;
    let h = h as u32;
    let em = (h & 0x7fff) << 13;
    let exp = em & SHIFTED_EXP;
    let normal = em + ((127 - 15) << 23);
    let inf_nan = normal + ((128 - 16) << 23);
    let subnormal = (f32::from_bits(normal + (1 << 23)) - f32::from_bits(113 << 23)).to_bits();
    let o = if exp == SHIFTED_EXP {
        inf_nan
    } else if exp == 0 {
        subnormal
    } else {
        normal
    };
    f32::from_bits(o | ((h & 0x8000) << 16))
}

/// Blocks whose f16 scales are converted together, ahead of the block loop.
const SB: usize = 32;

/// Eight little-endian f16 values to f32: one F16C instruction on the AVX2 path (from a full
/// 16-byte load, so nothing merges into a live register), the portable bit conversion elsewhere.
#[inline(always)]
fn f16x8<const FMA: bool>(b: &[u8; 16]) -> [f32; 8] {
    let mut out = [0f32; 8];
    #[cfg(target_arch = "x86_64")]
    if FMA {
        use std::arch::x86_64::{_mm256_cvtph_ps, _mm256_storeu_ps, _mm_loadu_si128};
        // SAFETY: on x86-64 `FMA` is true only inside `run_rows_avx2`, entered after AVX2, FMA
        // and F16C were detected, or in a build whose baseline has FMA and F16C
        // (`NATIVE_FMA`). The load reads the 16 bytes of `b`, the store writes the 8 f32 of
        // `out`; neither needs alignment.
        unsafe {
            let h = _mm_loadu_si128(b.as_ptr().cast());
            _mm256_storeu_ps(out.as_mut_ptr(), _mm256_cvtph_ps(h));
        }
        return out;
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = f16_bits_to_f32(u16::from_le_bytes([b[2 * i], b[2 * i + 1]]));
    }
    out
}

/// `out[i] = f32(field(blocks[i]))` for the f16 field `field`, for up to [`SB`] blocks.
#[inline(always)]
fn block_scales<const FMA: bool, B>(blocks: &[B], field: impl Fn(&B) -> [u8; 2], out: &mut [f32; SB]) {
    let mut bytes = [0u8; 2 * SB];
    for (o, b) in bytes.chunks_exact_mut(2).zip(blocks) {
        o.copy_from_slice(&field(b));
    }
    for k in 0..SB / 8 {
        let mut c = [0u8; 16];
        c.copy_from_slice(&bytes[16 * k..16 * k + 16]);
        out[8 * k..8 * k + 8].copy_from_slice(&f16x8::<FMA>(&c));
    }
}

/// `sum(m[i] * s[i])` over up to [`SB`] blocks: the min term of Q4_1 / Q5_1.
#[inline(always)]
fn min_dot<const FMA: bool>(m: &[f32; SB], s: &[f32]) -> f32 {
    let mut acc = 0f32;
    for (m, s) in m.iter().zip(s) {
        acc = fmadd::<FMA>(*m, *s, acc);
    }
    acc
}

struct F32Kernel<'a> {
    x: &'a [f32],
}
impl RowDot for F32Kernel<'_> {
    type B = [u8; 4];
    const PER: usize = 1;
    #[inline(always)]
    fn dot<const FMA: bool>(&self, row: &[[u8; 4]]) -> f32 {
        let mut acc = [0f32; 32];
        let (rc, xc) = (row.chunks_exact(32), self.x.chunks_exact(32));
        let (rr, xr) = (rc.remainder(), xc.remainder());
        for (w, xv) in rc.zip(xc) {
            for l in 0..32 {
                acc[l] = fmadd::<FMA>(f32::from_le_bytes(w[l]), xv[l], acc[l]);
            }
        }
        let mut tail = 0f32;
        for (w, xv) in rr.iter().zip(xr) {
            tail = fmadd::<FMA>(f32::from_le_bytes(*w), *xv, tail);
        }
        hsum(&acc) + tail
    }
}

struct F16Kernel<'a> {
    x: &'a [f32],
}
impl RowDot for F16Kernel<'_> {
    type B = [u8; 2];
    const PER: usize = 1;
    #[inline(always)]
    fn dot<const FMA: bool>(&self, row: &[[u8; 2]]) -> f32 {
        let mut acc = [0f32; 32];
        let (rc, xc) = (row.chunks_exact(32), self.x.chunks_exact(32));
        let (rr, xr) = (rc.remainder(), xc.remainder());
        for (w, xv) in rc.zip(xc) {
            let bytes: &[u8] = bytemuck::cast_slice(w);
            for k in 0..4 {
                let mut c = [0u8; 16];
                c.copy_from_slice(&bytes[16 * k..16 * k + 16]);
                let f = f16x8::<FMA>(&c);
                for i in 0..8 {
                    acc[8 * k + i] = fmadd::<FMA>(f[i], xv[8 * k + i], acc[8 * k + i]);
                }
            }
        }
        let mut tail = 0f32;
        for (w, xv) in rr.iter().zip(xr) {
            tail = fmadd::<FMA>(f16_bits_to_f32(u16::from_le_bytes(*w)), *xv, tail);
        }
        hsum(&acc) + tail
    }
}

struct Bf16Kernel<'a> {
    x: &'a [f32],
}
impl RowDot for Bf16Kernel<'_> {
    type B = [u8; 2];
    const PER: usize = 1;
    #[inline(always)]
    fn dot<const FMA: bool>(&self, row: &[[u8; 2]]) -> f32 {
        let conv = |b: [u8; 2]| f32::from_bits((u16::from_le_bytes(b) as u32) << 16);
        let mut acc = [0f32; 32];
        let (rc, xc) = (row.chunks_exact(32), self.x.chunks_exact(32));
        let (rr, xr) = (rc.remainder(), xc.remainder());
        for (w, xv) in rc.zip(xc) {
            for l in 0..32 {
                acc[l] = fmadd::<FMA>(conv(w[l]), xv[l], acc[l]);
            }
        }
        let mut tail = 0f32;
        for (w, xv) in rr.iter().zip(xr) {
            tail = fmadd::<FMA>(conv(*w), *xv, tail);
        }
        hsum(&acc) + tail
    }
}

struct Q4_0Kernel<'a> {
    x: &'a [f32],
}
impl RowDot for Q4_0Kernel<'_> {
    type B = BlockQ4_0;
    const PER: usize = QK;
    #[inline(always)]
    fn dot<const FMA: bool>(&self, row: &[BlockQ4_0]) -> f32 {
        let mut acc = [0f32; 16];
        let mut ds = [0f32; SB];
        for (bc, xc) in row.chunks(SB).zip(self.x.chunks(SB * QK)) {
            block_scales::<FMA, _>(bc, |b| b.d, &mut ds);
            for ((b, xb), d) in bc.iter().zip(xc.chunks_exact(QK)).zip(&ds) {
                let (xl, xh) = (&xb[..16], &xb[16..32]);
                let mut p = [0f32; 16];
                for j in 0..16 {
                    let lo = ((b.qs[j] & 0x0F) as i32 - 8) as f32;
                    let hi = ((b.qs[j] >> 4) as i32 - 8) as f32;
                    p[j] = fmadd::<FMA>(hi, xh[j], lo * xl[j]);
                }
                for j in 0..16 {
                    acc[j] = fmadd::<FMA>(*d, p[j], acc[j]);
                }
            }
        }
        hsum(&acc)
    }
}

struct Q4_1Kernel<'a> {
    x: &'a [f32],
    /// Sums of x per 32-block, for the `m` term.
    sums: Vec<f32>,
}
impl RowDot for Q4_1Kernel<'_> {
    type B = BlockQ4_1;
    const PER: usize = QK;
    #[inline(always)]
    fn dot<const FMA: bool>(&self, row: &[BlockQ4_1]) -> f32 {
        let mut acc = [0f32; 16];
        let mut mins = 0f32;
        let (mut ds, mut ms) = ([0f32; SB], [0f32; SB]);
        for ((bc, xc), sc) in row.chunks(SB).zip(self.x.chunks(SB * QK)).zip(self.sums.chunks(SB)) {
            block_scales::<FMA, _>(bc, |b| b.d, &mut ds);
            block_scales::<FMA, _>(bc, |b| b.m, &mut ms);
            for ((b, xb), d) in bc.iter().zip(xc.chunks_exact(QK)).zip(&ds) {
                let (xl, xh) = (&xb[..16], &xb[16..32]);
                let mut p = [0f32; 16];
                for j in 0..16 {
                    let lo = (b.qs[j] & 0x0F) as f32;
                    let hi = (b.qs[j] >> 4) as f32;
                    p[j] = fmadd::<FMA>(hi, xh[j], lo * xl[j]);
                }
                for j in 0..16 {
                    acc[j] = fmadd::<FMA>(*d, p[j], acc[j]);
                }
            }
            mins += min_dot::<FMA>(&ms, sc);
        }
        hsum(&acc) + mins
    }
}

struct Q5_0Kernel<'a> {
    x: &'a [f32],
}
impl RowDot for Q5_0Kernel<'_> {
    type B = BlockQ5_0;
    const PER: usize = QK;
    #[inline(always)]
    fn dot<const FMA: bool>(&self, row: &[BlockQ5_0]) -> f32 {
        let mut acc = [0f32; 16];
        let mut ds = [0f32; SB];
        for (bc, xc) in row.chunks(SB).zip(self.x.chunks(SB * QK)) {
            block_scales::<FMA, _>(bc, |b| b.d, &mut ds);
            for ((b, xb), d) in bc.iter().zip(xc.chunks_exact(QK)).zip(&ds) {
                let (xl, xh) = (&xb[..16], &xb[16..32]);
                let qh = b.qh();
                let mut p = [0f32; 16];
                for j in 0..16 {
                    let h0 = ((qh >> j) & 1) << 4;
                    let h1 = ((qh >> (j + 16)) & 1) << 4;
                    let lo = ((b.qs[j] as u32 & 0x0F | h0) as i32 - 16) as f32;
                    let hi = ((b.qs[j] as u32 >> 4 | h1) as i32 - 16) as f32;
                    p[j] = fmadd::<FMA>(hi, xh[j], lo * xl[j]);
                }
                for j in 0..16 {
                    acc[j] = fmadd::<FMA>(*d, p[j], acc[j]);
                }
            }
        }
        hsum(&acc)
    }
}

struct Q5_1Kernel<'a> {
    x: &'a [f32],
    sums: Vec<f32>,
}
impl RowDot for Q5_1Kernel<'_> {
    type B = BlockQ5_1;
    const PER: usize = QK;
    #[inline(always)]
    fn dot<const FMA: bool>(&self, row: &[BlockQ5_1]) -> f32 {
        let mut acc = [0f32; 16];
        let mut mins = 0f32;
        let (mut ds, mut ms) = ([0f32; SB], [0f32; SB]);
        for ((bc, xc), sc) in row.chunks(SB).zip(self.x.chunks(SB * QK)).zip(self.sums.chunks(SB)) {
            block_scales::<FMA, _>(bc, |b| b.d, &mut ds);
            block_scales::<FMA, _>(bc, |b| b.m, &mut ms);
            for ((b, xb), d) in bc.iter().zip(xc.chunks_exact(QK)).zip(&ds) {
                let (xl, xh) = (&xb[..16], &xb[16..32]);
                let qh = b.qh();
                let mut p = [0f32; 16];
                for j in 0..16 {
                    let h0 = ((qh >> j) & 1) << 4;
                    let h1 = ((qh >> (j + 16)) & 1) << 4;
                    let lo = (b.qs[j] as u32 & 0x0F | h0) as f32;
                    let hi = (b.qs[j] as u32 >> 4 | h1) as f32;
                    p[j] = fmadd::<FMA>(hi, xh[j], lo * xl[j]);
                }
                for j in 0..16 {
                    acc[j] = fmadd::<FMA>(*d, p[j], acc[j]);
                }
            }
            mins += min_dot::<FMA>(&ms, sc);
        }
        hsum(&acc) + mins
    }
}

struct Q8_0Kernel<'a> {
    x: &'a [f32],
}
impl RowDot for Q8_0Kernel<'_> {
    type B = BlockQ8_0;
    const PER: usize = QK;
    #[inline(always)]
    fn dot<const FMA: bool>(&self, row: &[BlockQ8_0]) -> f32 {
        let mut acc = [0f32; 32];
        let mut ds = [0f32; SB];
        for (bc, xc) in row.chunks(SB).zip(self.x.chunks(SB * QK)) {
            block_scales::<FMA, _>(bc, |b| b.d, &mut ds);
            for ((b, xb), d) in bc.iter().zip(xc.chunks_exact(QK)).zip(&ds) {
                let xb = &xb[..32];
                let mut p = [0f32; 32];
                for j in 0..32 {
                    p[j] = b.qs[j] as f32 * xb[j];
                }
                for j in 0..32 {
                    acc[j] = fmadd::<FMA>(*d, p[j], acc[j]);
                }
            }
        }
        hsum(&acc)
    }
}

struct Q2KKernel<'a> {
    x: &'a [f32],
    /// Sums of x per 16-group, for the min term.
    sums: Vec<f32>,
}
impl RowDot for Q2KKernel<'_> {
    type B = BlockQ2K;
    const PER: usize = QK_K;
    #[inline(always)]
    fn dot<const FMA: bool>(&self, row: &[BlockQ2K]) -> f32 {
        let mut acc = [0f32; 16];
        for (b, xb) in row.iter().zip(self.x.chunks_exact(QK_K)) {
            let mut bacc = [0f32; 16];
            for n in 0..2 {
                for j in 0..4 {
                    for h in 0..2 {
                        let q = &b.qs[32 * n + 16 * h..][..16];
                        let xg = &xb[128 * n + 32 * j + 16 * h..][..16];
                        let sc = (b.scales[8 * n + 2 * j + h] & 0x0F) as f32;
                        for l in 0..16 {
                            let w = ((q[l] >> (2 * j)) & 3) as f32;
                            bacc[l] = fmadd::<FMA>(sc, w * xg[l], bacc[l]);
                        }
                    }
                }
            }
            let d = f16_1(b.d);
            for l in 0..16 {
                acc[l] = fmadd::<FMA>(d, bacc[l], acc[l]);
            }
        }
        let mut mins = 0f32;
        for (b, s) in row.iter().zip(self.sums.chunks_exact(16)) {
            let mut m = 0f32;
            for g in 0..16 {
                m = fmadd::<FMA>((b.scales[g] >> 4) as f32, s[g], m);
            }
            mins = fmadd::<FMA>(f16_1(b.dmin), m, mins);
        }
        hsum(&acc) - mins
    }
}

struct Q3KKernel<'a> {
    x: &'a [f32],
}
impl RowDot for Q3KKernel<'_> {
    type B = BlockQ3K;
    const PER: usize = QK_K;
    #[inline(always)]
    fn dot<const FMA: bool>(&self, row: &[BlockQ3K]) -> f32 {
        let mut acc = [0f32; 16];
        for (b, xb) in row.iter().zip(self.x.chunks_exact(QK_K)) {
            let scales = q3k_scales(&b.scales);
            let mut bacc = [0f32; 16];
            for n in 0..2 {
                for j in 0..4 {
                    for h in 0..2 {
                        let q = &b.qs[32 * n + 16 * h..][..16];
                        let hm = &b.hmask[16 * h..][..16];
                        let xg = &xb[128 * n + 32 * j + 16 * h..][..16];
                        let sc = scales[8 * n + 2 * j + h] as f32;
                        for l in 0..16 {
                            // low 2 bits | high bit << 2, minus 4: a clear high bit means q - 4.
                            let low = (q[l] >> (2 * j)) & 3;
                            let high = (hm[l] >> (4 * n + j)) & 1;
                            let w = ((low | (high << 2)) as i32 - 4) as f32;
                            bacc[l] = fmadd::<FMA>(sc, w * xg[l], bacc[l]);
                        }
                    }
                }
            }
            let d = f16_1(b.d);
            for l in 0..16 {
                acc[l] = fmadd::<FMA>(d, bacc[l], acc[l]);
            }
        }
        hsum(&acc)
    }
}

/// The 8 six-bit scales of a Q4_K / Q5_K block as f32.
#[inline(always)]
fn k4_scales(s: &[u8; 12]) -> [f32; 8] {
    let mut out = [0f32; 8];
    for (g, o) in out.iter_mut().enumerate() {
        *o = scale_min_k4(g, s).0 as f32;
    }
    out
}

/// `sum over blocks of dmin * sum_g(m_g * sums_g)`: the min term of a Q4_K / Q5_K row.
#[inline(always)]
fn k4_min_term<const FMA: bool>(blocks: impl Iterator<Item = ([u8; 2], [u8; 12])>, sums: &[f32]) -> f32 {
    let mut mins = 0f32;
    for ((dmin, scales), s) in blocks.zip(sums.chunks_exact(8)) {
        let mut m = 0f32;
        for g in 0..8 {
            m = fmadd::<FMA>(scale_min_k4(g, &scales).1 as f32, s[g], m);
        }
        mins = fmadd::<FMA>(f16_1(dmin), m, mins);
    }
    mins
}

struct Q4KKernel<'a> {
    x: &'a [f32],
    /// Sums of x per 32-group, for the min term.
    sums: Vec<f32>,
}
impl RowDot for Q4KKernel<'_> {
    type B = BlockQ4K;
    const PER: usize = QK_K;
    #[inline(always)]
    fn dot<const FMA: bool>(&self, row: &[BlockQ4K]) -> f32 {
        let mut acc = [0f32; 16];
        for (b, xb) in row.iter().zip(self.x.chunks_exact(QK_K)) {
            let sc = k4_scales(&b.scales);
            let mut bacc = [0f32; 16];
            for k in 0..4 {
                for h in 0..2 {
                    let q = &b.qs[32 * k + 16 * h..][..16];
                    let xa = &xb[64 * k + 16 * h..][..16];
                    let xc = &xb[64 * k + 32 + 16 * h..][..16];
                    for l in 0..16 {
                        let lo = (q[l] & 0x0F) as f32 * xa[l];
                        let hi = (q[l] >> 4) as f32 * xc[l];
                        bacc[l] = fmadd::<FMA>(sc[2 * k + 1], hi, fmadd::<FMA>(sc[2 * k], lo, bacc[l]));
                    }
                }
            }
            let d = f16_1(b.d);
            for l in 0..16 {
                acc[l] = fmadd::<FMA>(d, bacc[l], acc[l]);
            }
        }
        hsum(&acc) - k4_min_term::<FMA>(row.iter().map(|b| (b.dmin, b.scales)), &self.sums)
    }
}

struct Q5KKernel<'a> {
    x: &'a [f32],
    sums: Vec<f32>,
}
impl RowDot for Q5KKernel<'_> {
    type B = BlockQ5K;
    const PER: usize = QK_K;
    #[inline(always)]
    fn dot<const FMA: bool>(&self, row: &[BlockQ5K]) -> f32 {
        let mut acc = [0f32; 16];
        for (b, xb) in row.iter().zip(self.x.chunks_exact(QK_K)) {
            let sc = k4_scales(&b.scales);
            let mut bacc = [0f32; 16];
            for k in 0..4 {
                for h in 0..2 {
                    let q = &b.qs[32 * k + 16 * h..][..16];
                    let qh = &b.qh[16 * h..][..16];
                    let xa = &xb[64 * k + 16 * h..][..16];
                    let xc = &xb[64 * k + 32 + 16 * h..][..16];
                    for l in 0..16 {
                        let h1 = ((qh[l] >> (2 * k)) & 1) << 4;
                        let h2 = ((qh[l] >> (2 * k + 1)) & 1) << 4;
                        let lo = ((q[l] & 0x0F) | h1) as f32 * xa[l];
                        let hi = ((q[l] >> 4) | h2) as f32 * xc[l];
                        bacc[l] = fmadd::<FMA>(sc[2 * k + 1], hi, fmadd::<FMA>(sc[2 * k], lo, bacc[l]));
                    }
                }
            }
            let d = f16_1(b.d);
            for l in 0..16 {
                acc[l] = fmadd::<FMA>(d, bacc[l], acc[l]);
            }
        }
        hsum(&acc) - k4_min_term::<FMA>(row.iter().map(|b| (b.dmin, b.scales)), &self.sums)
    }
}

struct Q6KKernel<'a> {
    x: &'a [f32],
}
impl RowDot for Q6KKernel<'_> {
    type B = BlockQ6K;
    const PER: usize = QK_K;
    #[inline(always)]
    fn dot<const FMA: bool>(&self, row: &[BlockQ6K]) -> f32 {
        let mut acc = [0f32; 16];
        for (b, xb) in row.iter().zip(self.x.chunks_exact(QK_K)) {
            let mut bacc = [0f32; 16];
            for n in 0..2 {
                for h in 0..2 {
                    let ql1 = &b.ql[64 * n + 16 * h..][..16];
                    let ql2 = &b.ql[64 * n + 32 + 16 * h..][..16];
                    let qh = &b.qh[32 * n + 16 * h..][..16];
                    let xs = &xb[128 * n + 16 * h..][..112];
                    let sc = &b.scales[8 * n + h..][..7];
                    let (s1, s2, s3, s4) = (sc[0] as f32, sc[2] as f32, sc[4] as f32, sc[6] as f32);
                    for l in 0..16 {
                        let q1 = ((ql1[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
                        let q2 = ((ql2[l] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        let q3 = ((ql1[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        let q4 = ((ql2[l] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                        let mut v = bacc[l];
                        v = fmadd::<FMA>(s1, q1 as f32 * xs[l], v);
                        v = fmadd::<FMA>(s2, q2 as f32 * xs[l + 32], v);
                        v = fmadd::<FMA>(s3, q3 as f32 * xs[l + 64], v);
                        v = fmadd::<FMA>(s4, q4 as f32 * xs[l + 96], v);
                        bacc[l] = v;
                    }
                }
            }
            let d = f16_1(b.d);
            for l in 0..16 {
                acc[l] = fmadd::<FMA>(d, bacc[l], acc[l]);
            }
        }
        hsum(&acc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both row-loop variants against dequantize-then-dot, for every type: on an AVX2 machine
    /// the integration tests only ever reach the AVX2 one.
    #[test]
    fn portable_and_best_variants_match_reference() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for ty in GgmlType::ALL {
            let (rows, cols) = (5, 3 * ty.block_size().max(32));
            let n = rows * cols;
            let mut w = Vec::new();
            if ty.is_quantized() {
                // Random bytes, with every f16 scale field set to a small finite value.
                let ts = ty.type_size();
                for _ in 0..n / ty.block_size() {
                    let mut block: Vec<u8> = (0..ts).map(|_| next() as u8).collect();
                    for off in scale_offsets(ty) {
                        let v = half::f16::from_f32((next() % 2000) as f32 / 20000.0 - 0.05);
                        block[*off..off + 2].copy_from_slice(&v.to_le_bytes());
                    }
                    w.extend(block);
                }
            } else {
                for _ in 0..n {
                    let v = (next() % 2000) as f32 / 1000.0 - 1.0;
                    match ty {
                        GgmlType::F32 => w.extend(v.to_le_bytes()),
                        GgmlType::F16 => w.extend(half::f16::from_f32(v).to_le_bytes()),
                        _ => w.extend(half::bf16::from_f32(v).to_le_bytes()),
                    }
                }
            }
            let x: Vec<f32> = (0..cols).map(|_| (next() % 2000) as f32 / 1000.0 - 1.0).collect();
            let wf = dequant::dequantize_to_vec(ty, &w, n).unwrap();
            for isa in [Isa::Best, Isa::Portable] {
                let mut y = vec![f32::NAN; rows];
                matvec_on(isa, ty, &w, rows, cols, &x, &mut y).unwrap();
                for (r, got) in y.iter().enumerate() {
                    let row = &wf[r * cols..][..cols];
                    let want: f64 = row.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
                    let scale: f64 = row.iter().zip(&x).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
                    assert!((*got as f64 - want).abs() <= 1e-5 * scale, "{ty} {isa:?} row {r}: got {got}, want {want}");
                }
            }
        }
    }

    fn scale_offsets(ty: GgmlType) -> &'static [usize] {
        match ty {
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
            GgmlType::Q2K => &[80, 82],
            GgmlType::Q3K => &[108],
            GgmlType::Q6K => &[208],
            _ => &[],
        }
    }

    #[test]
    fn f16_bits_conversion_is_exact() {
        for h in 0..=u16::MAX {
            let want = half::f16::from_bits(h).to_f32();
            let got = f16_bits_to_f32(h);
            assert!(want.to_bits() == got.to_bits() || (want.is_nan() && got.is_nan()), "{h:#06x}: {want} vs {got}");
        }
    }
}
