//! The k-quant side of the CPU backend's fast product (Q4_K, Q5_K, Q6_K; see `q8.rs` for the
//! why): activations rounded to llama.cpp's Q8_K blocks (256 values, one f32 scale, sums per
//! 16), then integer dot products per super-block, as `ggml_vec_dot_q4_K_q8_K` and friends do.
//!
//! Per super-block the integer part needs one scale multiply per 16 or 32 weights, which
//! `_mm256_madd_epi16` does in the same instruction that widens the byte-pair sums to i32, so a
//! whole super-block is accumulated in integers and converted to float once. The minimum terms
//! (Q4_K, Q5_K) and Q6_K's -32 offset use the activation sums per 16 (`bsums`).
//!
//! Q2_K and Q3_K keep the exact f32 path (rare in LLM files; left for later).

#![allow(clippy::needless_range_loop)]

use rayon::prelude::*;

use super::blocks::*;
#[cfg(target_arch = "x86_64")]
use super::q8::PREFETCH_BYTES;
use super::q8::{Out, Path, SERIAL_BYTES};
use super::GgmlType;

/// 256 activations as llama.cpp's Q8_K holds them: x ~ d * qs, `bsums[g]` = sum of qs over
/// values 16g..16g+16.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub(crate) struct Q8KBlock {
    pub qs: [i8; QK_K],
    pub d: f32,
    pub bsums: [i16; QK_K / 16],
}

impl Default for Q8KBlock {
    fn default() -> Self {
        Q8KBlock { qs: [0; QK_K], d: 0.0, bsums: [0; QK_K / 16] }
    }
}

/// Whether [`matmul`] has a kernel for `ty`.
pub(crate) fn supports(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K)
}

/// ggml's `quantize_row_q8_K_ref`: the scale comes from the value of largest magnitude, with
/// its sign (`iscale = -127 / max`, so that value becomes -127); round half to even; `d` stays
/// f32.
pub(crate) fn quantize(x: &[f32], out: &mut [Q8KBlock]) {
    debug_assert_eq!(x.len(), out.len() * QK_K);
    for (xb, o) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        let (mut max, mut amax) = (0f32, 0f32);
        for &v in xb {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            *o = Q8KBlock::default();
            continue;
        }
        let iscale = -127.0 / max;
        for (q, &v) in o.qs.iter_mut().zip(xb) {
            // Saturating conversion: a NaN becomes 0, nothing panics.
            *q = ((iscale * v).round_ties_even() as i32).min(127) as i8;
        }
        for (g, s) in o.bsums.iter_mut().enumerate() {
            *s = o.qs[16 * g..16 * g + 16].iter().map(|&q| q as i16).sum();
        }
        o.d = 1.0 / iscale;
    }
}

// ---------------------------------------------------------------------------------------------
// Per-format super-block products.

/// A k-quant format with an integer dot product against [`Q8KBlock`]s.
pub(crate) trait KWeights: bytemuck::Pod + Sync {
    /// `sum(w * x)` over one super-block, plain Rust.
    fn dot(&self, y: &Q8KBlock) -> f32;
    /// The same for NT inputs: the scaled integer part is added to `acc[t]` (8 lanes), the
    /// rest (minimum / offset terms) to `rest[t]`.
    #[cfg(target_arch = "x86_64")]
    unsafe fn dot_avx2<const NT: usize>(
        &self,
        ys: [&Q8KBlock; NT],
        acc: &mut [std::arch::x86_64::__m256; NT],
        rest: &mut [f32; NT],
    );
}

/// The eight 6-bit scales and mins of a Q4_K / Q5_K block.
#[inline(always)]
fn scales_mins(s: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut m) = ([0u8; 8], [0u8; 8]);
    for j in 0..8 {
        (sc[j], m[j]) = scale_min_k4(j, s);
    }
    (sc, m)
}

/// `sum_j mins[j] * (sum of y over sub-block j of 32)`, from the sums per 16.
#[inline(always)]
fn min_term(mins: &[u8; 8], y: &Q8KBlock) -> i32 {
    let mut s = 0i32;
    for j in 0..8 {
        s += mins[j] as i32 * (y.bsums[2 * j] as i32 + y.bsums[2 * j + 1] as i32);
    }
    s
}

#[inline(always)]
fn f16v(b: [u8; 2]) -> f32 {
    half::f16::from_bits(u16::from_le_bytes(b)).to_f32()
}

impl KWeights for BlockQ4K {
    #[inline(always)]
    fn dot(&self, y: &Q8KBlock) -> f32 {
        let (sc, mins) = scales_mins(&self.scales);
        let mut sumi = 0i32;
        for k in 0..4 {
            let q = &self.qs[32 * k..][..32];
            let (ya, yb) = (&y.qs[64 * k..][..32], &y.qs[64 * k + 32..][..32]);
            let (mut lo, mut hi) = (0i32, 0i32);
            for l in 0..32 {
                lo += (q[l] & 0x0F) as i32 * ya[l] as i32;
                hi += (q[l] >> 4) as i32 * yb[l] as i32;
            }
            sumi += sc[2 * k] as i32 * lo + sc[2 * k + 1] as i32 * hi;
        }
        y.d * (f16v(self.d) * sumi as f32 - f16v(self.dmin) * min_term(&mins, y) as f32)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot_avx2<const NT: usize>(
        &self,
        ys: [&Q8KBlock; NT],
        acc: &mut [std::arch::x86_64::__m256; NT],
        rest: &mut [f32; NT],
    ) {
        use std::arch::x86_64::*;
        let (sc, mins) = scales_mins(&self.scales);
        let (d, dmin) = (f16v(self.d), f16v(self.dmin));
        let mask = _mm256_set1_epi8(0x0F);
        let mut sumi = [_mm256_setzero_si256(); NT];
        for k in 0..4 {
            let q = _mm256_loadu_si256(self.qs.as_ptr().add(32 * k) as *const __m256i);
            let lo = _mm256_and_si256(q, mask);
            let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), mask);
            let (sa, sb) = (_mm256_set1_epi16(sc[2 * k] as i16), _mm256_set1_epi16(sc[2 * k + 1] as i16));
            for t in 0..NT {
                let ya = _mm256_loadu_si256(ys[t].qs.as_ptr().add(64 * k) as *const __m256i);
                let yb = _mm256_loadu_si256(ys[t].qs.as_ptr().add(64 * k + 32) as *const __m256i);
                // Byte pairs: 2 * 15 * 127 fits i16; times a 6-bit scale, pairs of those fit i32.
                let pa = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, ya), sa);
                let pb = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, yb), sb);
                sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(pa, pb));
            }
        }
        for t in 0..NT {
            let dy = ys[t].d;
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * dy), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
            rest[t] -= dmin * dy * min_term(&mins, ys[t]) as f32;
        }
    }
}

impl KWeights for BlockQ5K {
    #[inline(always)]
    fn dot(&self, y: &Q8KBlock) -> f32 {
        let (sc, mins) = scales_mins(&self.scales);
        let mut sumi = 0i32;
        for k in 0..4 {
            let q = &self.qs[32 * k..][..32];
            let (ya, yb) = (&y.qs[64 * k..][..32], &y.qs[64 * k + 32..][..32]);
            let (mut lo, mut hi) = (0i32, 0i32);
            for l in 0..32 {
                let h0 = ((self.qh[l] >> (2 * k)) & 1) << 4;
                let h1 = ((self.qh[l] >> (2 * k + 1)) & 1) << 4;
                lo += ((q[l] & 0x0F) | h0) as i32 * ya[l] as i32;
                hi += ((q[l] >> 4) | h1) as i32 * yb[l] as i32;
            }
            sumi += sc[2 * k] as i32 * lo + sc[2 * k + 1] as i32 * hi;
        }
        y.d * (f16v(self.d) * sumi as f32 - f16v(self.dmin) * min_term(&mins, y) as f32)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot_avx2<const NT: usize>(
        &self,
        ys: [&Q8KBlock; NT],
        acc: &mut [std::arch::x86_64::__m256; NT],
        rest: &mut [f32; NT],
    ) {
        use std::arch::x86_64::*;
        let (sc, mins) = scales_mins(&self.scales);
        let (d, dmin) = (f16v(self.d), f16v(self.dmin));
        let mask = _mm256_set1_epi8(0x0F);
        let one = _mm256_set1_epi8(1);
        // Bits 0 and 1 of `qh` (shifted right by 2 per chunk) are the fifth bits of chunk k's
        // low and high nibbles (qh[l] bit 2k, 2k + 1). 16-bit shifts: what leaks in from the
        // neighbour byte lands in the top bits, which are masked off.
        let mut qh = _mm256_loadu_si256(self.qh.as_ptr() as *const __m256i);
        let mut sumi = [_mm256_setzero_si256(); NT];
        for k in 0..4 {
            let q = _mm256_loadu_si256(self.qs.as_ptr().add(32 * k) as *const __m256i);
            let h0 = _mm256_and_si256(qh, one);
            let h1 = _mm256_and_si256(_mm256_srli_epi16(qh, 1), one);
            qh = _mm256_srli_epi16(qh, 2);
            let lo = _mm256_or_si256(_mm256_and_si256(q, mask), _mm256_slli_epi16(h0, 4));
            let hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), mask), _mm256_slli_epi16(h1, 4));
            let (sa, sb) = (_mm256_set1_epi16(sc[2 * k] as i16), _mm256_set1_epi16(sc[2 * k + 1] as i16));
            for t in 0..NT {
                let ya = _mm256_loadu_si256(ys[t].qs.as_ptr().add(64 * k) as *const __m256i);
                let yb = _mm256_loadu_si256(ys[t].qs.as_ptr().add(64 * k + 32) as *const __m256i);
                // 2 * 31 * 127 fits i16.
                let pa = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, ya), sa);
                let pb = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, yb), sb);
                sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(pa, pb));
            }
        }
        for t in 0..NT {
            let dy = ys[t].d;
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * dy), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
            rest[t] -= dmin * dy * min_term(&mins, ys[t]) as f32;
        }
    }
}

/// `sum_g scale_g * bsums_g`: with the factor 32, Q6_K's offset term.
#[inline(always)]
fn q6_offset(scales: &[i8; 16], y: &Q8KBlock) -> i32 {
    let mut s = 0i32;
    for g in 0..16 {
        s += scales[g] as i32 * y.bsums[g] as i32;
    }
    s
}

impl KWeights for BlockQ6K {
    #[inline(always)]
    fn dot(&self, y: &Q8KBlock) -> f32 {
        // sum over groups of sc_g * sum((q - 32) * y) = sum(sc_g * q * y) - 32 sum(sc_g * bsum_g).
        let mut sumi = 0i32;
        for n in 0..2 {
            let (ql, qh) = (&self.ql[64 * n..][..64], &self.qh[32 * n..][..32]);
            let sc = &self.scales[8 * n..][..8];
            let ys = &y.qs[128 * n..][..128];
            for l in 0..32 {
                let is = l / 16;
                let q1 = (ql[l] & 0x0F) | ((qh[l] & 3) << 4);
                let q2 = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
                let q3 = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                let q4 = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
                sumi += sc[is] as i32 * q1 as i32 * ys[l] as i32
                    + sc[is + 2] as i32 * q2 as i32 * ys[l + 32] as i32
                    + sc[is + 4] as i32 * q3 as i32 * ys[l + 64] as i32
                    + sc[is + 6] as i32 * q4 as i32 * ys[l + 96] as i32;
            }
        }
        y.d * f16v(self.d) * (sumi - 32 * q6_offset(&self.scales, y)) as f32
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot_avx2<const NT: usize>(
        &self,
        ys: [&Q8KBlock; NT],
        acc: &mut [std::arch::x86_64::__m256; NT],
        rest: &mut [f32; NT],
    ) {
        use std::arch::x86_64::*;
        let d = f16v(self.d);
        let m4 = _mm256_set1_epi8(0x0F);
        let m2 = _mm256_set1_epi8(0x30);
        let mut sumi = [_mm256_setzero_si256(); NT];
        for n in 0..2 {
            let ql0 = _mm256_loadu_si256(self.ql.as_ptr().add(64 * n) as *const __m256i);
            let ql1 = _mm256_loadu_si256(self.ql.as_ptr().add(64 * n + 32) as *const __m256i);
            let qh = _mm256_loadu_si256(self.qh.as_ptr().add(32 * n) as *const __m256i);
            // The four 32-weight rows of this half, 0..=63 each: low nibble | two high bits << 4
            // (16-bit shifts; the 0x30 mask drops what leaks in from the neighbour byte).
            let q = [
                _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m2)),
                _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m2)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, m2)),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                    _mm256_and_si256(_mm256_srli_epi16(qh, 2), m2),
                ),
            ];
            // Row i's weights 0..16 use scale 8n + 2i, weights 16..32 scale 8n + 2i + 1: the
            // two 128-bit halves of the pair sums.
            let sc = &self.scales[8 * n..][..8];
            for i in 0..4 {
                let s = _mm256_set_m128i(_mm_set1_epi16(sc[2 * i + 1] as i16), _mm_set1_epi16(sc[2 * i] as i16));
                for t in 0..NT {
                    let y = _mm256_loadu_si256(ys[t].qs.as_ptr().add(128 * n + 32 * i) as *const __m256i);
                    // 2 * 63 * 127 fits i16; times an i8 scale, pairs of those fit i32.
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(q[i], y), s);
                    sumi[t] = _mm256_add_epi32(sumi[t], p);
                }
            }
        }
        for t in 0..NT {
            let dy = ys[t].d;
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * dy), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
            rest[t] -= d * dy * (32 * q6_offset(&self.scales, ys[t])) as f32;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Rows and tasks.

/// Inputs that share one unpacking of each super-block.
const NT_MAX: usize = 4;

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn row_avx2<B: KWeights, const NT: usize>(row: &[B], xs: [&[Q8KBlock]; NT]) -> [f32; NT] {
    use std::arch::x86_64::*;
    for t in 0..NT {
        assert_eq!(xs[t].len(), row.len());
    }
    let mut acc = [_mm256_setzero_ps(); NT];
    let mut rest = [0f32; NT];
    for (i, b) in row.iter().enumerate() {
        // Ahead into the next rows too (see `PREFETCH_BYTES`).
        _mm_prefetch::<_MM_HINT_T0>((b as *const B as *const i8).wrapping_add(PREFETCH_BYTES));
        let ys: [&Q8KBlock; NT] = std::array::from_fn(|t| xs[t].get_unchecked(i));
        b.dot_avx2::<NT>(ys, &mut acc, &mut rest);
    }
    let mut out = [0f32; NT];
    for t in 0..NT {
        let s = _mm_add_ps(_mm256_castps256_ps128(acc[t]), _mm256_extractf128_ps(acc[t], 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        out[t] = _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s))) + rest[t];
    }
    out
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn task_avx2<B: KWeights>(w: &[B], per_row: usize, xq: &[Q8KBlock], n: usize, out: Out, r0: usize) {
    let rows_here = w.len() / per_row;
    let x = |t: usize| &xq[t * per_row..(t + 1) * per_row];
    let mut t0 = 0;
    while t0 < n {
        let nt = (n - t0).min(NT_MAX);
        for r in 0..rows_here {
            let row = &w[r * per_row..(r + 1) * per_row];
            macro_rules! group {
                ($k:literal) => {{
                    let xs: [&[Q8KBlock]; $k] = std::array::from_fn(|i| x(t0 + i));
                    // SAFETY: this function runs only after AVX2, FMA and F16C were detected.
                    let v = unsafe { row_avx2::<B, $k>(row, xs) };
                    for i in 0..$k {
                        out.put(t0 + i, r0 + r, v[i]);
                    }
                }};
            }
            match nt {
                1 => group!(1),
                2 => group!(2),
                3 => group!(3),
                _ => group!(4),
            }
        }
        t0 += nt;
    }
}

fn task_portable<B: KWeights>(w: &[B], per_row: usize, xq: &[Q8KBlock], n: usize, out: Out, r0: usize) {
    for (r, row) in w.chunks_exact(per_row).enumerate() {
        for t in 0..n {
            let x = &xq[t * per_row..(t + 1) * per_row];
            let v: f32 = row.iter().zip(x).map(|(b, y)| b.dot(y)).sum();
            out.put(t, r0 + r, v);
        }
    }
}

fn task<B: KWeights>(path: Path, w: &[B], per_row: usize, xq: &[Q8KBlock], n: usize, out: Out, r0: usize) {
    match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the AVX2 paths are only chosen after AVX2, FMA and F16C were detected
        // (`Path::best`); AVX-VNNI does not help here (every step scales by a sub-block scale).
        Path::Avx2 | Path::AvxVnni => unsafe { task_avx2::<B>(w, per_row, xq, n, out, r0) },
        Path::Portable => task_portable::<B>(w, per_row, xq, n, out, r0),
    }
}

/// Y = X W^T (y is n x rows) with X rounded to Q8_K blocks. Shapes are checked by the caller;
/// `ty` must be one of [`supports`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    path: Path,
    ty: GgmlType,
    weights: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    y: &mut [f32],
) {
    match ty {
        GgmlType::Q4K => run::<BlockQ4K>(path, weights, rows, cols, x, n, y),
        GgmlType::Q5K => run::<BlockQ5K>(path, weights, rows, cols, x, n, y),
        GgmlType::Q6K => run::<BlockQ6K>(path, weights, rows, cols, x, n, y),
        _ => unreachable!("q8k::matmul called for {ty}, which `supports` rejects"),
    }
}

fn run<B: KWeights>(path: Path, weights: &[u8], rows: usize, cols: usize, x: &[f32], n: usize, y: &mut [f32]) {
    let per_row = cols / QK_K;
    let blocks: &[B] = bytemuck::cast_slice(weights);
    assert_eq!(blocks.len(), rows * per_row);
    assert!(x.len() == n * cols && y.len() == n * rows);
    let mut xq = vec![Q8KBlock::default(); n * per_row];
    if n * cols >= 16 * 1024 {
        xq.par_chunks_mut(per_row).zip(x.par_chunks(cols)).for_each(|(q, xi)| quantize(xi, q));
    } else {
        quantize(x, &mut xq);
    }
    let out = Out::new(y, rows);
    let row_bytes = weights.len() / rows;
    if weights.len() * n.min(8) <= SERIAL_BYTES {
        task(path, blocks, per_row, &xq, n, out, 0);
        return;
    }
    let tasks = 4 * rayon::current_num_threads();
    let mut rows_per_task = rows.div_ceil(tasks).max((16 * 1024 / n.min(8)).div_ceil(row_bytes)).max(1);
    if n > 1 {
        rows_per_task = rows_per_task.min((16 * 1024 / row_bytes).max(4));
    }
    blocks.par_chunks(rows_per_task * per_row).enumerate().for_each(|(i, w)| {
        task(path, w, per_row, &xq, n, out, i * rows_per_task);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dequantize_to_vec;
    use half::f16;

    /// Every path against dequantize-then-dot of the weights with the quantized activations
    /// (in f64): the integer part is exact, so only float rounding separates them.
    #[test]
    fn every_path_matches_the_q8k_reference() {
        let mut s = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        for ty in GgmlType::ALL.into_iter().filter(|t| supports(*t)) {
            for (rows, cols, n) in [(3, 256, 1), (5, 512, 2), (9, 768, 5), (40, 256, 9)] {
                let ts = ty.type_size();
                let mut w = Vec::new();
                for _ in 0..rows * cols / QK_K {
                    let mut block: Vec<u8> = (0..ts).map(|_| next() as u8).collect();
                    let offs: &[usize] = if ty == GgmlType::Q6K { &[208] } else { &[0, 2] };
                    for &o in offs {
                        let v = f16::from_f32((next() % 2000) as f32 / 20000.0 - 0.05);
                        block[o..o + 2].copy_from_slice(&v.to_le_bytes());
                    }
                    w.extend(block);
                }
                let x: Vec<f32> = (0..n * cols).map(|_| (next() % 2001) as f32 / 1000.0 - 1.0).collect();
                let wf = dequantize_to_vec(ty, &w, rows * cols).unwrap();
                let mut xq = vec![Q8KBlock::default(); n * cols / QK_K];
                quantize(&x, &mut xq);
                for path in Path::all_available() {
                    let mut y = vec![f32::NAN; n * rows];
                    matmul(path, ty, &w, rows, cols, &x, n, &mut y);
                    for t in 0..n {
                        for r in 0..rows {
                            let (mut want, mut scale) = (0f64, 0f64);
                            for (k, blk) in xq[t * cols / QK_K..(t + 1) * cols / QK_K].iter().enumerate() {
                                for j in 0..QK_K {
                                    let v = wf[r * cols + k * QK_K + j] as f64 * blk.d as f64 * blk.qs[j] as f64;
                                    want += v;
                                    scale += v.abs();
                                }
                            }
                            let got = y[t * rows + r] as f64;
                            assert!(
                                (got - want).abs() <= 2e-5 * scale + 1e-30,
                                "{ty} {path:?} {rows}x{cols} n={n} t={t} r={r}: got {got}, want {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn quantize_follows_llama_cpp() {
        let mut x = [0f32; QK_K];
        for (j, v) in x.iter_mut().enumerate() {
            *v = (j as f32 - 128.0) / 64.0;
        }
        // The largest magnitude is x[0] = -2: iscale = -127 / -2 = 63.5, so -2 maps to -127.
        let mut q = [Q8KBlock::default()];
        quantize(&x, &mut q);
        assert_eq!(q[0].d, 1.0 / 63.5);
        assert_eq!(q[0].qs[0], -127);
        assert_eq!(q[0].qs[128], 0);
        assert_eq!(q[0].qs[192], 64); // 63.5: ties to even
        assert_eq!(q[0].qs[255], 126); // 126.008
        let sum: i16 = q[0].qs[..16].iter().map(|&v| v as i16).sum();
        assert_eq!(q[0].bsums[0], sum);
        quantize(&[0.0; QK_K], &mut q);
        assert_eq!((q[0].d, q[0].qs, q[0].bsums), (0.0, [0; QK_K], [0; 16]));
    }
}
