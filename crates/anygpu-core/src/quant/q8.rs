//! The CPU backend's fast product for the 32-weight block formats (Q4_0, Q4_1, Q5_0, Q5_1,
//! Q8_0): the activations are rounded to 8-bit blocks once per call, then every weight block
//! meets them in integer dot products, as llama.cpp's CPU backend does (`quantize_row_q8_0` /
//! `_q8_1`, `ggml_vec_dot_q4_1_q8_1` ...).
//!
//! Why: with f32 activations every weight costs a convert and an FMA (8 per AVX2 instruction);
//! with Q8 activations `_mm256_maddubs_epi16` multiplies and pair-adds 32 byte pairs in one
//! instruction (and AVX-VNNI's `vpdpbusd` also does the widening add), so a 32-weight block is
//! a handful of instructions: about 4x less work per weight, which is what lets decode run at
//! memory speed and prefill several times faster.
//!
//! The price is the rounding of the activations to 8 bits per block (relative error up to
//! 1/254 of the block's largest |x|): results are not the dequantize-then-dot reference, so
//! this path is opt-in ([`super::CpuMath::Q8`]) and the GPU kernels keep being checked against
//! the exact f32 path. llama.cpp's CPU results carry the same kind of rounding, but not the same
//! rounding errors unless the activations match it bit for bit (they do not: its KV cache is f16,
//! its attention differs), so on SmolLM2 the logits are about as far from llama.cpp's fixtures
//! as the exact path's (perplexity 25.04 vs 25.05 exact, llama.cpp 25.19).
//!
//! The rounding follows llama.cpp's AVX2 quantizer: `d = max|x| / 127`, `q = round_even(x *
//! 127 / max|x|)`, `d` kept as f16 (and, for the formats with a minimum, `s = d * sum(q)` as
//! f16), so a product sees the same numbers llama.cpp's does. Integer sums are exact; only the
//! float accumulation order differs from ggml.

// Kernels index fixed-size arrays in step (`acc[t]`, `xs[t]`): the shape the compiler keeps in
// registers.
#![allow(clippy::needless_range_loop)]

use half::f16;
use rayon::prelude::*;

use super::blocks::*;
use super::GgmlType;

/// 32 activations as llama.cpp's Q8_0 / Q8_1 blocks hold them: x ~ d * qs, s = d * sum(qs).
/// `d` and `s` are the f16-rounded values, widened once here instead of once per weight row.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub(crate) struct Q8Block {
    pub qs: [i8; QK],
    pub d: f32,
    pub s: f32,
}

/// Whether [`matmul`] has a kernel for `ty`.
pub(crate) fn supports(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0)
}

/// The instruction set a product runs on.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Path {
    /// Plain Rust loops (any CPU).
    Portable,
    /// AVX2 + FMA + F16C: `maddubs` + `madd` per block.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX2 plus AVX-VNNI: `vpdpbusd` does both steps.
    #[cfg(target_arch = "x86_64")]
    AvxVnni,
}

impl Path {
    /// The best path this CPU runs.
    pub(crate) fn best() -> Path {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx2") && has!("fma") && has!("f16c") {
                return if has!("avxvnni") { Path::AvxVnni } else { Path::Avx2 };
            }
        }
        Path::Portable
    }

    /// Every path this CPU runs (tests).
    #[cfg(test)]
    pub(crate) fn all_available() -> Vec<Path> {
        let mut v = vec![Path::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if matches!(Path::best(), Path::Avx2 | Path::AvxVnni) {
                v.push(Path::Avx2);
            }
            if Path::best() == Path::AvxVnni {
                v.push(Path::AvxVnni);
            }
        }
        v
    }
}

// ---------------------------------------------------------------------------------------------
// Quantizing the activations.

/// One 32-element block rounded to 8 bits, as plain values: for the tests that check the GPU's
/// rounding (round_q8.wgsl) against this CPU path's, and the GPU's words read back
/// ([`super::gpu::Q8Rows::host_blocks`]).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HostQ8Block {
    pub q: [i8; QK],
    /// max|x| / 127 and d * sum(q), as f16 values.
    pub d: f32,
    pub s: f32,
}

/// `x` (a whole number of 32-blocks) rounded by the CPU backend's Q8 path (llama.cpp's
/// `quantize_row_q8_1`): the reference for the GPU's rounding.
#[doc(hidden)]
pub fn round_blocks(x: &[f32]) -> crate::Result<Vec<HostQ8Block>> {
    if !x.len().is_multiple_of(QK) {
        return Err(crate::Error::shape("q8 rounding", format!("{} values are not whole blocks of {QK}", x.len())));
    }
    let mut out = vec![Q8Block::default(); x.len() / QK];
    quantize(Path::best(), x, &mut out);
    Ok(out.iter().map(|b| HostQ8Block { q: b.qs, d: b.d, s: b.s }).collect())
}

/// Rounds `x` (a whole number of 32-blocks) into `out`, one block per 32 values.
pub(crate) fn quantize(path: Path, x: &[f32], out: &mut [Q8Block]) {
    debug_assert_eq!(x.len(), out.len() * QK);
    #[cfg(target_arch = "x86_64")]
    if path != Path::Portable {
        // SAFETY: the AVX2 paths are only chosen after AVX2, FMA and F16C were detected.
        unsafe { quantize_avx2(x, out) };
        return;
    }
    let _ = path;
    quantize_portable(x, out)
}

/// ggml's AVX2 `quantize_row_q8_1`, block by block: the same rounding as the portable loop
/// (round half to even of x * 127 / max|x|), ~8x faster than what the vectoriser makes of
/// the portable loop (7.6% of a SmolLM2 prefill profile before, 0.9% after: prefill quantizes
/// ~10 M activations per 64 tokens).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn quantize_avx2(x: &[f32], out: &mut [Q8Block]) {
    use std::arch::x86_64::*;
    for (xb, o) in x.chunks_exact(QK).zip(out.iter_mut()) {
        // SAFETY: xb holds 32 f32 (four unaligned 8-lane loads); o.qs 32 bytes (one store).
        unsafe {
            let p = xb.as_ptr();
            let v =
                [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)), _mm256_loadu_ps(p.add(16)), _mm256_loadu_ps(p.add(24))];
            let sign = _mm256_set1_ps(-0.0);
            let mut m = _mm256_andnot_ps(sign, v[0]);
            for vi in &v[1..] {
                m = _mm256_max_ps(m, _mm256_andnot_ps(sign, *vi));
            }
            let m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
            let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
            let d = amax / 127.0;
            let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
            const RN: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            let r = |vi: __m256| _mm256_cvtps_epi32(_mm256_round_ps::<RN>(_mm256_mul_ps(vi, id)));
            let i = [r(v[0]), r(v[1]), r(v[2]), r(v[3])];
            let s = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
            let s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            let s4 = _mm_hadd_epi32(s4, s4);
            let sum = _mm_cvtsi128_si32(_mm_hadd_epi32(s4, s4));
            // Saturating packs interleave the 128-bit halves; the permute puts them back.
            let p16 = [_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3])];
            let p8 = _mm256_packs_epi16(p16[0], p16[1]);
            let q = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(o.qs.as_mut_ptr() as *mut __m256i, q);
            // d and s through f16 and back, both in one F16C round trip (round to nearest even,
            // as `f16::from_f32`).
            let ds = _mm_cvtph_ps(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_setr_ps(d, d * sum as f32, 0.0, 0.0)));
            o.d = _mm_cvtss_f32(ds);
            o.s = _mm_cvtss_f32(_mm_movehdup_ps(ds));
        }
    }
}

#[inline(always)]
fn quantize_portable(x: &[f32], out: &mut [Q8Block]) {
    for (xb, o) in x.chunks_exact(QK).zip(out.iter_mut()) {
        let mut amax = 0f32;
        for &v in xb {
            amax = amax.max(v.abs());
        }
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut q = [0i32; QK];
        for j in 0..QK {
            // Saturating conversion: a NaN becomes 0, nothing panics.
            q[j] = (xb[j] * id).round_ties_even() as i32;
        }
        let mut sum = 0i32;
        for j in 0..QK {
            o.qs[j] = q[j].clamp(-127, 127) as i8;
            sum += q[j].clamp(-127, 127);
        }
        o.d = f16::from_f32(d).to_f32();
        o.s = f16::from_f32(d * sum as f32).to_f32();
    }
}

// ---------------------------------------------------------------------------------------------
// The weight side: how each format becomes 32 bytes.

/// A 32-weight block format with an integer dot product against [`Q8Block`]s.
pub(crate) trait Q8Weights: bytemuck::Pod + Sync {
    /// Unpacked weights are signed (`q - 8`, `q - 16`, Q8_0) rather than `0..=31`.
    const SIGNED: bool;
    /// w = d * q + m: the product gains `m * s` per block.
    const MIN: bool;
    /// The 32 integer weights, in order.
    fn unpack(&self) -> [i8; QK];
    /// Scale and minimum (0 without one) as f32.
    fn dm(&self) -> (f32, f32);
    /// The 32 integer weights in one register (bytes, signed or not as `SIGNED` says).
    #[cfg(target_arch = "x86_64")]
    unsafe fn unpack_avx2(&self) -> std::arch::x86_64::__m256i;
}

#[inline(always)]
fn f16v(b: [u8; 2]) -> f32 {
    f16::from_bits(u16::from_le_bytes(b)).to_f32()
}

/// Both nibble halves of 16 bytes: weight j in the low nibble of byte j, weight j + 16 in its
/// high nibble (ggml's layout), as 32 bytes 0..=15.
#[inline(always)]
fn nibbles(qs: &[u8; 16]) -> [u8; QK] {
    let mut out = [0u8; QK];
    for j in 0..16 {
        out[j] = qs[j] & 0x0F;
        out[j + 16] = qs[j] >> 4;
    }
    out
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// ggml's `bytes_from_nibbles_32`: 16 bytes of nibble pairs to 32 bytes 0..=15.
    #[inline(always)]
    pub(super) unsafe fn nibbles(qs: &[u8; 16]) -> __m256i {
        let lo = _mm_loadu_si128(qs.as_ptr() as *const __m128i);
        let hi = _mm_srli_epi16(lo, 4);
        _mm256_and_si256(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(0x0F))
    }

    /// ggml's `bytes_from_bits_32`: bit j of `qh` to byte j, 0xFF where set, 0 where clear.
    #[inline(always)]
    pub(super) unsafe fn bits(qh: [u8; 4]) -> __m256i {
        let x = _mm256_set1_epi32(i32::from_le_bytes(qh));
        let shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
        let bytes = _mm256_shuffle_epi8(x, shuf);
        let mask = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
        _mm256_cmpeq_epi8(_mm256_or_si256(bytes, mask), _mm256_set1_epi64x(-1))
    }

    /// One or two f16 values (the low 4 bytes) to f32, by F16C.
    #[inline(always)]
    pub(super) unsafe fn f16_pair(bits: u32) -> (f32, f32) {
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32));
        (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
    }
}

impl Q8Weights for BlockQ4_0 {
    const SIGNED: bool = true;
    const MIN: bool = false;
    #[inline(always)]
    fn unpack(&self) -> [i8; QK] {
        nibbles(&self.qs).map(|q| q as i8 - 8)
    }
    #[inline(always)]
    fn dm(&self) -> (f32, f32) {
        (f16v(self.d), 0.0)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn unpack_avx2(&self) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        _mm256_sub_epi8(x86::nibbles(&self.qs), _mm256_set1_epi8(8))
    }
}

impl Q8Weights for BlockQ4_1 {
    const SIGNED: bool = false;
    const MIN: bool = true;
    #[inline(always)]
    fn unpack(&self) -> [i8; QK] {
        nibbles(&self.qs).map(|q| q as i8)
    }
    #[inline(always)]
    fn dm(&self) -> (f32, f32) {
        (f16v(self.d), f16v(self.m))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn unpack_avx2(&self) -> std::arch::x86_64::__m256i {
        x86::nibbles(&self.qs)
    }
}

impl Q8Weights for BlockQ5_0 {
    const SIGNED: bool = true;
    const MIN: bool = false;
    #[inline(always)]
    fn unpack(&self) -> [i8; QK] {
        let qh = self.qh();
        let mut w = nibbles(&self.qs).map(|q| q as i8);
        for (j, v) in w.iter_mut().enumerate() {
            *v = (*v | (((qh >> j) & 1) << 4) as i8) - 16;
        }
        w
    }
    #[inline(always)]
    fn dm(&self) -> (f32, f32) {
        (f16v(self.d), 0.0)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn unpack_avx2(&self) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        // A clear fifth bit means q - 16: OR-ing 0xF0 into the nibble is exactly that in i8.
        let high = _mm256_andnot_si256(x86::bits(self.qh), _mm256_set1_epi8(0xF0u8 as i8));
        _mm256_or_si256(x86::nibbles(&self.qs), high)
    }
}

impl Q8Weights for BlockQ5_1 {
    const SIGNED: bool = false;
    const MIN: bool = true;
    #[inline(always)]
    fn unpack(&self) -> [i8; QK] {
        let qh = self.qh();
        let mut w = nibbles(&self.qs).map(|q| q as i8);
        for (j, v) in w.iter_mut().enumerate() {
            *v |= (((qh >> j) & 1) << 4) as i8;
        }
        w
    }
    #[inline(always)]
    fn dm(&self) -> (f32, f32) {
        (f16v(self.d), f16v(self.m))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn unpack_avx2(&self) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        let high = _mm256_and_si256(x86::bits(self.qh), _mm256_set1_epi8(0x10));
        _mm256_or_si256(x86::nibbles(&self.qs), high)
    }
}

impl Q8Weights for BlockQ8_0 {
    const SIGNED: bool = true;
    const MIN: bool = false;
    #[inline(always)]
    fn unpack(&self) -> [i8; QK] {
        self.qs
    }
    #[inline(always)]
    fn dm(&self) -> (f32, f32) {
        (f16v(self.d), 0.0)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn unpack_avx2(&self) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        _mm256_loadu_si256(self.qs.as_ptr() as *const __m256i)
    }
}

/// Scale and minimum of a block by F16C: d (and m, which follows it in Q4_1 / Q5_1) are the
/// first 2 (4) bytes of every format here.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn dm_f16c<B: Q8Weights>(b: &B) -> (f32, f32) {
    let bytes: &[u8] = bytemuck::bytes_of(b);
    if B::MIN {
        x86::f16_pair(u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
    } else {
        (x86::f16_pair(u16::from_le_bytes([bytes[0], bytes[1]]) as u32).0, 0.0)
    }
}

// ---------------------------------------------------------------------------------------------
// Row kernels: one weight row against NT quantized inputs.

/// `out[t] = sum over blocks of d_w d_x[t] <q_w, q_x[t]> (+ m_w s_x[t])`, plain Rust.
#[inline(always)]
fn row_portable<B: Q8Weights, const NT: usize>(row: &[B], xs: [&[Q8Block]; NT]) -> [f32; NT] {
    let mut acc = [0f32; NT];
    let mut mins = [0f32; NT];
    for t in 0..NT {
        assert_eq!(xs[t].len(), row.len());
    }
    for (i, b) in row.iter().enumerate() {
        let w = b.unpack();
        let (d, m) = b.dm();
        for t in 0..NT {
            let y = &xs[t][i];
            let mut isum = 0i32;
            for j in 0..QK {
                isum += w[j] as i32 * y.qs[j] as i32;
            }
            acc[t] += d * y.d * isum as f32;
            if B::MIN {
                mins[t] += m * y.s;
            }
        }
    }
    let mut out = [0f32; NT];
    for t in 0..NT {
        out[t] = acc[t] + mins[t];
    }
    out
}

/// How far ahead of the block being read a decode row loop prefetches. The hardware
/// prefetchers stop at 4 KiB page boundaries, and memory-mapped weights come in 4 KiB
/// pages: on this project's 2-core VM a software prefetch 2 KiB ahead took the decode
/// products over SmolLM2's 96 MB of weights from ~21 to ~13 ms per token (1024 B and
/// 3072 B did about as well, 256 B and 4096 B less; `bench_decode_sweep` in
/// tests/quant_parity.rs measures it).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(super) const PREFETCH_BYTES: usize = 2048;

#[cfg(target_arch = "x86_64")]
mod avx {
    use super::*;
    use std::arch::x86_64::*;

    /// The 8 partial sums of `<w, y>` (4 byte pairs each) as f32, exact: |sum| <= 4 * 128 * 127.
    #[inline(always)]
    pub(super) unsafe fn block_dot<const VNNI: bool>(w: __m256i, y: &Q8Block, signed: bool) -> __m256 {
        let qy = _mm256_loadu_si256(y.qs.as_ptr() as *const __m256i);
        // maddubs wants unsigned x signed: for signed weights move the sign onto y (ggml's
        // `mul_sum_i8_pairs`). Pairs stay within i16: 2 * 128 * 127 < 32767.
        let (ux, sy) = if signed { (_mm256_sign_epi8(w, w), _mm256_sign_epi8(qy, w)) } else { (w, qy) };
        let i32s = if VNNI {
            _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), ux, sy)
        } else {
            _mm256_madd_epi16(_mm256_maddubs_epi16(ux, sy), _mm256_set1_epi16(1))
        };
        _mm256_cvtepi32_ps(i32s)
    }

    #[inline(always)]
    pub(super) unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    /// One input: two accumulators (even and odd blocks), so the FMA latency chain does not
    /// bound the loop.
    #[inline(always)]
    pub(super) unsafe fn row1<B: Q8Weights, const VNNI: bool>(row: &[B], x: &[Q8Block]) -> f32 {
        assert_eq!(x.len(), row.len());
        let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut mins = 0f32;
        let pairs = row.len() / 2;
        for i in 0..pairs {
            let (b0, b1) = (&row[2 * i], &row[2 * i + 1]);
            // Rows of a task are contiguous, so this runs ahead into the next rows too.
            _mm_prefetch::<_MM_HINT_T0>((b0 as *const B as *const i8).wrapping_add(PREFETCH_BYTES));
            let (y0, y1) = (&x[2 * i], &x[2 * i + 1]);
            let (w0, w1) = (b0.unpack_avx2(), b1.unpack_avx2());
            let ((d0, m0), (d1, m1)) = (dm_f16c(b0), dm_f16c(b1));
            a0 = _mm256_fmadd_ps(_mm256_set1_ps(d0 * y0.d), block_dot::<VNNI>(w0, y0, B::SIGNED), a0);
            a1 = _mm256_fmadd_ps(_mm256_set1_ps(d1 * y1.d), block_dot::<VNNI>(w1, y1, B::SIGNED), a1);
            if B::MIN {
                mins += m0 * y0.s + m1 * y1.s;
            }
        }
        if row.len() % 2 == 1 {
            let (b, y) = (&row[row.len() - 1], &x[row.len() - 1]);
            let (d, m) = dm_f16c(b);
            a0 = _mm256_fmadd_ps(_mm256_set1_ps(d * y.d), block_dot::<VNNI>(b.unpack_avx2(), y, B::SIGNED), a0);
            if B::MIN {
                mins += m * y.s;
            }
        }
        hsum(_mm256_add_ps(a0, a1)) + mins
    }

    /// NT inputs: each weight block is unpacked once and used NT times. `sums[i]` holds the
    /// NT inputs' `s` of block i side by side (zero-padded to [`NT_MAX`]), so the minimum term
    /// of all of them is one 8-lane FMA per block.
    #[inline(always)]
    pub(super) unsafe fn row_n<B: Q8Weights, const NT: usize, const VNNI: bool>(
        row: &[B],
        xs: [&[Q8Block]; NT],
        sums: &[[f32; NT_MAX]],
    ) -> [f32; NT] {
        for t in 0..NT {
            assert_eq!(xs[t].len(), row.len());
        }
        assert!(!B::MIN || sums.len() == row.len());
        let mut acc = [_mm256_setzero_ps(); NT];
        let mut macc = _mm256_setzero_ps();
        for (i, b) in row.iter().enumerate() {
            let w = b.unpack_avx2();
            let (d, m) = dm_f16c(b);
            let dv = _mm256_set1_ps(d);
            for t in 0..NT {
                let y = xs[t].get_unchecked(i);
                let scale = _mm256_mul_ps(dv, _mm256_broadcast_ss(&y.d));
                acc[t] = _mm256_fmadd_ps(scale, block_dot::<VNNI>(w, y, B::SIGNED), acc[t]);
            }
            if B::MIN {
                macc = _mm256_fmadd_ps(_mm256_set1_ps(m), _mm256_loadu_ps(sums.get_unchecked(i).as_ptr()), macc);
            }
        }
        let mut mins = [0f32; NT_MAX];
        _mm256_storeu_ps(mins.as_mut_ptr(), macc);
        let mut out = [0f32; NT];
        for t in 0..NT {
            out[t] = hsum(acc[t]) + mins[t];
        }
        out
    }
}

// ---------------------------------------------------------------------------------------------
// Tasks: a range of weight rows against every input.

/// Inputs per group that share one unpacking of each weight block. Per block and input the
/// AVX2 loop is ~7 instructions (scale, dot, convert, FMA); the unpacking and scales are ~10
/// per block, so 8 inputs spread them thin. Measured with callgrind on 1536 x 576 Q4_1,
/// n = 64: 11% fewer instructions than groups of 4 (16 accumulators would spill).
const NT_MAX: usize = 8;

/// The quantized inputs of a product.
struct Inputs<'a> {
    /// n x per_row blocks.
    xq: &'a [Q8Block],
    /// For the formats with a minimum: per group of [`NT_MAX`] inputs, per block, their `s`
    /// side by side (see [`avx::row_n`]); empty otherwise.
    sums: &'a [[f32; NT_MAX]],
    n: usize,
    per_row: usize,
}

impl Inputs<'_> {
    fn x(&self, t: usize) -> &[Q8Block] {
        &self.xq[t * self.per_row..(t + 1) * self.per_row]
    }
    /// The sums of the group starting at input t0 (a multiple of NT_MAX).
    fn group_sums(&self, t0: usize) -> &[[f32; NT_MAX]] {
        if self.sums.is_empty() {
            return &[];
        }
        let g = t0 / NT_MAX;
        &self.sums[g * self.per_row..(g + 1) * self.per_row]
    }
}

/// Where the tasks of a product write: `y[t * rows + r]`, y being n x rows. Tasks own disjoint
/// row ranges, so they write disjoint elements.
#[derive(Clone, Copy)]
pub(super) struct Out {
    ptr: *mut f32,
    len: usize,
    rows: usize,
}
// SAFETY: `Out` is only used to write elements of rows a task owns (see `Out`); the slice it
// points into is borrowed mutably for the whole parallel section.
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

impl Out {
    pub(super) fn new(y: &mut [f32], rows: usize) -> Out {
        Out { ptr: y.as_mut_ptr(), len: y.len(), rows }
    }

    /// y[t][r] = v, for a row r of the calling task.
    #[inline(always)]
    pub(super) fn put(&self, t: usize, r: usize, v: f32) {
        let i = t * self.rows + r;
        assert!(r < self.rows && i < self.len);
        // SAFETY: i is inside y (checked above), which outlives the parallel section; row r
        // belongs to the calling task, so no other task writes element i.
        unsafe { *self.ptr.add(i) = v };
    }
}

/// Rows `r0..r0 + rows_here` (their blocks in `w`) against all inputs.
fn task<B: Q8Weights>(path: Path, w: &[B], inp: &Inputs, out: Out, r0: usize) {
    match path {
        Path::Portable => task_body::<B, 0>(w, inp, out, r0),
        // SAFETY: these paths are only chosen after their features were detected
        // (`Path::best`).
        #[cfg(target_arch = "x86_64")]
        Path::Avx2 => unsafe { task_avx2::<B>(w, inp, out, r0) },
        #[cfg(target_arch = "x86_64")]
        Path::AvxVnni => unsafe { task_vnni::<B>(w, inp, out, r0) },
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn task_avx2<B: Q8Weights>(w: &[B], inp: &Inputs, out: Out, r0: usize) {
    task_body::<B, 1>(w, inp, out, r0)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
fn task_vnni<B: Q8Weights>(w: &[B], inp: &Inputs, out: Out, r0: usize) {
    task_body::<B, 2>(w, inp, out, r0)
}

/// The loop nest of a task. `P`: 0 portable, 1 AVX2, 2 AVX-VNNI (a const so each variant is
/// compiled inside its own `target_feature` function). Inputs go in groups of [`NT_MAX`]; the
/// task's weight rows (a few KiB) stay in L1 while every group passes over them.
#[inline(always)]
fn task_body<B: Q8Weights, const P: u8>(w: &[B], inp: &Inputs, out: Out, r0: usize) {
    let per_row = inp.per_row;
    let rows_here = w.len() / per_row;
    let mut t0 = 0;
    while t0 < inp.n {
        let nt = (inp.n - t0).min(NT_MAX);
        let sums = inp.group_sums(t0);
        for r in 0..rows_here {
            let row = &w[r * per_row..(r + 1) * per_row];
            macro_rules! group {
                ($k:literal) => {{
                    let xs: [&[Q8Block]; $k] = std::array::from_fn(|i| inp.x(t0 + i));
                    let v: [f32; $k] = match P {
                        #[cfg(target_arch = "x86_64")]
                        // SAFETY: P = 1 / 2 only inside task_avx2 / task_vnni (features detected).
                        1 => unsafe {
                            if $k == 1 {
                                [avx::row1::<B, false>(row, xs[0]); $k]
                            } else {
                                avx::row_n::<B, $k, false>(row, xs, sums)
                            }
                        },
                        #[cfg(target_arch = "x86_64")]
                        // SAFETY: as above.
                        2 => unsafe {
                            if $k == 1 {
                                [avx::row1::<B, true>(row, xs[0]); $k]
                            } else {
                                avx::row_n::<B, $k, true>(row, xs, sums)
                            }
                        },
                        _ => row_portable::<B, $k>(row, xs),
                    };
                    for i in 0..$k {
                        out.put(t0 + i, r0 + r, v[i]);
                    }
                }};
            }
            match nt {
                1 => group!(1),
                2 => group!(2),
                3 => group!(3),
                4 => group!(4),
                5 => group!(5),
                6 => group!(6),
                7 => group!(7),
                _ => group!(8),
            }
        }
        t0 += nt;
    }
}

/// Below this many weight bytes a product runs on the calling thread: handing work to the pool
/// costs microseconds, as much as reading ~50 KiB.
pub(super) const SERIAL_BYTES: usize = 48 * 1024;

/// Y = X W^T (y is n x rows) with X rounded to Q8 blocks. Shapes are checked by the caller;
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
        GgmlType::Q4_0 => run::<BlockQ4_0>(path, weights, rows, cols, x, n, y),
        GgmlType::Q4_1 => run::<BlockQ4_1>(path, weights, rows, cols, x, n, y),
        GgmlType::Q5_0 => run::<BlockQ5_0>(path, weights, rows, cols, x, n, y),
        GgmlType::Q5_1 => run::<BlockQ5_1>(path, weights, rows, cols, x, n, y),
        GgmlType::Q8_0 => run::<BlockQ8_0>(path, weights, rows, cols, x, n, y),
        _ => unreachable!("q8::matmul called for {ty}, which `supports` rejects"),
    }
}

fn run<B: Q8Weights>(path: Path, weights: &[u8], rows: usize, cols: usize, x: &[f32], n: usize, y: &mut [f32]) {
    let per_row = cols / QK;
    // Shapes were checked by the caller: whole blocks, rows * per_row of them.
    let blocks: &[B] = bytemuck::cast_slice(weights);
    assert_eq!(blocks.len(), rows * per_row);
    assert!(x.len() == n * cols && y.len() == n * rows);
    let mut xq = vec![Q8Block::default(); n * per_row];
    if n * cols >= 16 * 1024 {
        xq.par_chunks_mut(per_row).zip(x.par_chunks(cols)).for_each(|(q, xi)| quantize(path, xi, q));
    } else {
        quantize(path, x, &mut xq);
    }
    // The minimum terms of a group of inputs, side by side (see `Inputs::sums`).
    let mut sums = Vec::new();
    if B::MIN && n > 1 {
        sums = vec![[0f32; NT_MAX]; n.div_ceil(NT_MAX) * per_row];
        for (t, xt) in xq.chunks_exact(per_row).enumerate() {
            let g = &mut sums[t / NT_MAX * per_row..][..per_row];
            for (s, blk) in g.iter_mut().zip(xt) {
                s[t % NT_MAX] = blk.s;
            }
        }
    }
    let inp = Inputs { xq: &xq, sums: &sums, n, per_row };
    let out = Out::new(y, rows);
    let row_bytes = weights.len() / rows;
    // Work per row grows with n: a task should read at least ~16 KiB of weights per input.
    if weights.len() * n.min(8) <= SERIAL_BYTES {
        task(path, blocks, &inp, out, 0);
        return;
    }
    let tasks = 4 * rayon::current_num_threads();
    // Rows per task: enough tasks to balance, each at least a few KiB of weights, and (for
    // prefill) few enough rows that they stay in L1 while the input groups pass over them.
    let mut rows_per_task = rows.div_ceil(tasks).max((16 * 1024 / n.min(8)).div_ceil(row_bytes)).max(1);
    if n > 1 {
        rows_per_task = rows_per_task.min((16 * 1024 / row_bytes).max(4));
    }
    blocks.par_chunks(rows_per_task * per_row).enumerate().for_each(|(i, w)| {
        task(path, w, &inp, out, i * rows_per_task);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dequantize_to_vec;

    fn rng(seed: u64) -> impl FnMut() -> u64 {
        let mut s = seed;
        move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        }
    }

    /// Every path against dequantize-then-dot of the weights with the *quantized* activations
    /// (in f64): the integer part is exact, so only float rounding separates them.
    #[test]
    fn every_path_matches_the_q8_reference() {
        let mut next = rng(0x9e37_79b9_7f4a_7c15);
        for ty in GgmlType::ALL.into_iter().filter(|t| supports(*t)) {
            for (rows, cols, n) in [(5, 32, 1), (7, 96, 1), (9, 160, 3), (33, 64, 6), (300, 256, 9), (2, 32, 4)] {
                let ts = ty.type_size();
                let mut w = Vec::new();
                for _ in 0..rows * cols / QK {
                    let mut block: Vec<u8> = (0..ts).map(|_| next() as u8).collect();
                    let offs: &[usize] = if matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1) { &[0, 2] } else { &[0] };
                    for &o in offs {
                        let v = f16::from_f32((next() % 2000) as f32 / 20000.0 - 0.05);
                        block[o..o + 2].copy_from_slice(&v.to_le_bytes());
                    }
                    w.extend(block);
                }
                let x: Vec<f32> = (0..n * cols).map(|_| (next() % 2001) as f32 / 1000.0 - 1.0).collect();
                let wf = dequantize_to_vec(ty, &w, rows * cols).unwrap();
                let mut xq = vec![Q8Block::default(); n * cols / QK];
                quantize(Path::Portable, &x, &mut xq);
                for path in Path::all_available() {
                    let mut xq2 = vec![Q8Block::default(); xq.len()];
                    quantize(path, &x, &mut xq2);
                    for (a, b) in xq.iter().zip(&xq2) {
                        assert_eq!((a.qs, a.d.to_bits(), a.s.to_bits()), (b.qs, b.d.to_bits(), b.s.to_bits()));
                    }
                    let mut y = vec![f32::NAN; n * rows];
                    matmul(path, ty, &w, rows, cols, &x, n, &mut y);
                    for t in 0..n {
                        for r in 0..rows {
                            let (mut want, mut scale) = (0f64, 0f64);
                            for (k, blk) in xq[t * cols / QK..(t + 1) * cols / QK].iter().enumerate() {
                                // w = d q + m: the m part meets s (the f16-rounded d * sum q),
                                // the d q part meets d_x * q_x.
                                let (db, mb) = dm_exact(ty, &w, r * cols / QK + k);
                                for j in 0..QK {
                                    let wq = wf[r * cols + k * QK + j] as f64 - mb;
                                    let v = wq * blk.d as f64 * blk.qs[j] as f64;
                                    want += v;
                                    scale += v.abs();
                                }
                                want += mb * blk.s as f64;
                                scale += (mb * blk.s as f64).abs();
                                let _ = db;
                            }
                            let got = y[t * rows + r] as f64;
                            assert!(
                                (got - want).abs() <= 1e-5 * scale + 1e-30,
                                "{ty} {path:?} {rows}x{cols} n={n} t={t} r={r}: got {got}, want {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// (d, m) of block `i` of `w` as f64 (m = 0 for the formats without one).
    fn dm_exact(ty: GgmlType, w: &[u8], i: usize) -> (f64, f64) {
        let b = &w[i * ty.type_size()..];
        let h = |o: usize| f16::from_le_bytes([b[o], b[o + 1]]).to_f64();
        match ty {
            GgmlType::Q4_1 | GgmlType::Q5_1 => (h(0), h(2)),
            _ => (h(0), 0.0),
        }
    }

    #[test]
    fn quantize_rounds_like_llama_cpp() {
        // max |x| = 127 makes the step exactly 1, so halves are exact ties.
        let mut x = [0f32; 32];
        for (j, v) in x.iter_mut().enumerate() {
            *v = (j as f32 - 15.5) * 127.0 / 15.5;
        }
        x[0] = -127.0;
        x[31] = 127.0;
        x[3] = 2.5; // ties to even: 2
        x[4] = 3.5; // 4
        x[5] = -2.5; // -2
        let mut q = [Q8Block::default()];
        for path in Path::all_available() {
            quantize(path, &x, &mut q);
            assert_eq!((q[0].qs[0], q[0].qs[31], q[0].qs[3], q[0].qs[4], q[0].qs[5]), (-127, 127, 2, 4, -2));
            assert_eq!(q[0].d, 1.0);
            let sum: i32 = q[0].qs.iter().map(|&v| v as i32).sum();
            assert_eq!(q[0].s, f16::from_f32(sum as f32).to_f32());
        }
        let zeros = [0f32; 32];
        quantize(Path::best(), &zeros, &mut q);
        assert_eq!((q[0].qs, q[0].d, q[0].s), ([0; 32], 0.0, 0.0));
    }
}
