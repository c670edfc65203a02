//! Scaled dot-product attention with causal masking and grouped-query heads; fused on the GPU
//! (flash-style online softmax), so long sequences never materialise T x T scores.
//!
//! `attention(q [B, Hq, Tq, D], k [B, Hkv, Tk, D], v [B, Hkv, Tk, D]) -> [B, Hq, Tq, D]`, query
//! head h reading KV head h / (Hq / Hkv). Under the causal mask the queries are the last Tq
//! positions: query i sees keys j <= i + (Tk - Tq) (decode with Tq = 1 sees every key). A query
//! that sees no key at all (causal with Tq > Tk) gets zeros, as in FlashAttention.
//!
//! Q is f32; K and V are f32 or f16 (an f16 KV cache halves decode bandwidth). Any strided
//! view is read in place (q/k/v are usually transposes of [B, T, H, D]).
//!
//! The output is stored in [B, Tq, Hq, D] order and returned as the [B, Hq, Tq, D] view of it
//! (strides [Tq·Hq·D, D, Hq·D, 1]), on every device: the caller's next step is nearly always
//! `permute([0, 2, 1, 3])` + `reshape([B·Tq, Hq·D])` (the heads of a token side by side, the
//! output projection's input), which is then a view, not a copy.
//!
//! GPU: `attention.wgsl` (one workgroup per block of query rows of one KV head, K/V tiles
//! through workgroup memory, online softmax), with the key range optionally split over several
//! workgroups and merged by `attention_combine.wgsl` (flash-decoding) when the rows alone do not
//! fill the GPU, as in decode. [`Tensor::attention_partials`] stops after the first pass, for
//! a consumer that merges the splits itself (the decode step's output projection,
//! `QTensor::qmatmul_add_combined`). Runs of at least 64 queries (prefill) take the
//! tensor-core kernel of `attention_coop.rs` instead where the device has cooperative matrices;
//! a decode step over a short cache (at most `DECODE_KERNEL_MAX_KEYS` planned keys, not split)
//! takes the kernel of `attention_decode.rs`, which scores every key at once.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use rayon::prelude::*;

use super::attention_decode;
use super::elementwise::buf;
use super::{gpu_of, same_device, to_u32};
use crate::error::{Error, Result};
use crate::gpu::{Bind, GpuContext, KernelSpec, Pipeline};
use crate::quant::gpu::Q8Rows;
use crate::tensor::{CpuStorage, DType, Tensor};

const OP: &str = "attention";

/// The kernels' `Params` struct (attention.wgsl, attention_decode.wgsl), in their headers.
pub(super) const ATTENTION_PARAMS_WGSL: &str = include_str!("attention_params.wgsl");

#[derive(Clone, Debug, PartialEq)]
pub struct AttentionOpts {
    /// Softmax scale, usually 1/sqrt(D).
    pub scale: f32,
    /// Query i (of Tq) sees keys j <= i + (Tk - Tq): the queries are the last Tq positions.
    pub causal: bool,
    /// On a GPU, the most keys this call will ever see if it is recorded and replayed at other
    /// positions (a decode step recorded for the first positions of a long cache): the key
    /// split is planned for that many keys instead of the cache's capacity (so a short horizon
    /// walks the keys unsplit, see [`DECODE_WHOLE_KEYS`]). More keys than this is an error.
    /// None: the capacity.
    pub max_keys: Option<usize>,
    /// Where the prefill's tensor-core kernel runs the call (`ops::attention_coop`), the
    /// output is f16, rounded and clamped as a product that reads x as f16 rounds its x (the
    /// output projection then reads it as it is: no f32 output written and read back, no
    /// rounding dispatch); elsewhere f32.
    pub f16_out: bool,
}

impl AttentionOpts {
    /// The usual options: scale 1/sqrt(D).
    pub fn new(head_dim: usize, causal: bool) -> AttentionOpts {
        AttentionOpts { scale: 1.0 / (head_dim.max(1) as f32).sqrt(), causal, max_keys: None, f16_out: false }
    }
}

/// The shape facts of one attention call.
#[derive(Clone, Copy, Debug)]
pub(super) struct Dims {
    pub b: usize,
    pub hq: usize,
    pub hkv: usize,
    pub tq: usize,
    pub tk: usize,
    pub d: usize,
}

impl Dims {
    fn out_shape(&self) -> Vec<usize> {
        vec![self.b, self.hq, self.tq, self.d]
    }
    /// The output's storage order, [B, Tq, Hq, D] (see the module doc).
    fn stored_shape(&self) -> Vec<usize> {
        vec![self.b, self.tq, self.hq, self.d]
    }
    /// Exclusive end of the keys query `i` sees.
    fn visible(&self, i: usize, causal: bool) -> usize {
        if causal {
            (i + 1 + self.tk).saturating_sub(self.tq).min(self.tk)
        } else {
            self.tk
        }
    }
}

pub(super) fn check(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Dims> {
    same_device(OP, q, k)?;
    same_device(OP, q, v)?;
    let shapes = || format!("q {}, k {}, v {}", q.shape(), k.shape(), v.shape());
    if q.rank() != 4 || k.rank() != 4 || v.rank() != 4 {
        return Err(Error::shape(OP, format!("expected 4-D [B, H, T, D] tensors, got {}", shapes())));
    }
    let (qd, kd) = (q.dims(), k.dims());
    if k.dims() != v.dims() {
        return Err(Error::shape(OP, format!("k and v shapes differ: {}", shapes())));
    }
    if qd[0] != kd[0] {
        return Err(Error::shape(OP, format!("batch sizes differ: {}", shapes())));
    }
    if qd[3] != kd[3] {
        return Err(Error::shape(OP, format!("head dims differ: {}", shapes())));
    }
    let (hq, hkv) = (qd[1], kd[1]);
    if hkv == 0 || hq % hkv != 0 {
        return Err(Error::shape(OP, format!("{hq} query heads are not a multiple of {hkv} kv heads: {}", shapes())));
    }
    if q.dtype() != DType::F32 {
        return Err(Error::mismatch(OP, format!("q must be f32, got {}", q.dtype())));
    }
    if k.dtype() != v.dtype() || !matches!(k.dtype(), DType::F32 | DType::F16) {
        return Err(Error::mismatch(
            OP,
            format!("k and v must both be f32 or both f16, got {} and {}", k.dtype(), v.dtype()),
        ));
    }
    Ok(Dims { b: qd[0], hq, hkv, tq: qd[2], tk: kd[2], d: qd[3] })
}

// ---- CPU reference ------------------------------------------------------------------------

/// A read-only [B, H, T, D] view of f32 host data.
struct View<'a> {
    data: Cow<'a, [f32]>,
    off: usize,
    st: [usize; 4],
}

impl<'a> View<'a> {
    fn of(t: &'a Tensor) -> Result<View<'a>> {
        let l = t.layout();
        match t.cpu_storage() {
            Some(CpuStorage::F32(v)) => Ok(View {
                data: Cow::Borrowed(v.as_slice()),
                off: l.offset,
                st: [l.strides[0], l.strides[1], l.strides[2], l.strides[3]],
            }),
            Some(_) => {
                // f16: widen once into a contiguous copy.
                let d = t.dims();
                Ok(View { data: Cow::Owned(t.to_vec_f32()?), off: 0, st: [d[1] * d[2] * d[3], d[2] * d[3], d[3], 1] })
            }
            None => Err(Error::mismatch(OP, "tensor is not on the CPU")),
        }
    }
    /// (start, stride) of row (b, h, t) along D.
    fn row(&self, b: usize, h: usize, t: usize) -> (usize, usize) {
        (self.off + b * self.st[0] + h * self.st[1] + t * self.st[2], self.st[3])
    }
}

/// Reference: scores, max-subtracted softmax, weighted sum, one query row (b, h, i) at a time
/// (in the output's [B, Tq, Hq, D] storage order);
/// rows go to rayon tasks when there is enough work to pay for the hand-off (a decode step's
/// few heads over a short context run on the calling thread). Rows whose D elements are
/// contiguous (the usual case: views of a KV cache, permuted queries) take slice loops the
/// compiler vectorises; other strides take the indexed loop.
pub fn cpu_attention(q: &Tensor, k: &Tensor, v: &Tensor, opts: &AttentionOpts) -> Result<Tensor> {
    let s = check(q, k, v)?;
    let (qv, kv, vv) = (View::of(q)?, View::of(k)?, View::of(v)?);
    let (qd, kd, vd) = (&*qv.data, &*kv.data, &*vv.data);
    let g = s.hq / s.hkv;
    let d = s.d;
    let mut out = vec![0f32; s.b * s.hq * s.tq * d];
    let fma = has_avx2_fma();
    let row = |scores: &mut Vec<f32>, (row, o): (usize, &mut [f32])| {
        let h = row % s.hq;
        let i = (row / s.hq) % s.tq;
        let b = row / (s.tq * s.hq);
        let n = s.visible(i, opts.causal);
        if n == 0 {
            return;
        }
        let (q0, qs) = qv.row(b, h, i);
        scores.clear();
        for j in 0..n {
            let (k0, ks) = kv.row(b, h / g, j);
            let dot = if qs == 1 && ks == 1 {
                dot_f32(&qd[q0..q0 + d], &kd[k0..k0 + d], fma)
            } else {
                (0..d).map(|x| qd[q0 + x * qs] * kd[k0 + x * ks]).sum()
            };
            scores.push(dot * opts.scale);
        }
        let mx = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for x in scores.iter_mut() {
            *x = (*x - mx).exp();
            sum += *x;
        }
        for (j, &pj) in scores.iter().enumerate() {
            let (v0, vs) = vv.row(b, h / g, j);
            if vs == 1 {
                axpy_f32(pj, &vd[v0..v0 + d], o, fma);
            } else {
                for (x, ox) in o.iter_mut().enumerate() {
                    *ox += pj * vd[v0 + x * vs];
                }
            }
        }
        for ox in o.iter_mut() {
            *ox /= sum;
        }
    };
    if d > 0 {
        // Multiply-adds of the scores and the weighted sum (an upper bound under a causal
        // mask). A rayon hand-off from outside the pool costs tens of microseconds on a loaded
        // 2-core machine, as much as ~1M of them: a decode step's 9 heads over a few hundred
        // positions stay on the calling thread.
        let work = (s.b * s.hq * s.tq * d).saturating_mul(s.tk).saturating_mul(2);
        if work < 1 << 20 {
            let mut scores = Vec::with_capacity(s.tk);
            out.chunks_mut(d).enumerate().for_each(|r| row(&mut scores, r));
        } else {
            out.par_chunks_mut(d).enumerate().for_each_init(Vec::new, row);
        }
    }
    as_bhtd(Tensor::cpu(CpuStorage::F32(out), s.stored_shape().into()))
}

/// The [B, Hq, Tq, D] view of an output stored [B, Tq, Hq, D].
fn as_bhtd(stored: Tensor) -> Result<Tensor> {
    stored.permute(&[0, 2, 1, 3])
}

/// A new (uninitialised) GPU output, stored [B, Tq, Hq, D], seen as [B, Hq, Tq, D].
pub(super) fn gpu_output(shape: [usize; 4], half: bool, device: &crate::Device) -> Result<Tensor> {
    let [b, h, t, d] = shape;
    as_bhtd(Tensor::gpu_empty(vec![b, t, h, d], if half { DType::F16 } else { DType::F32 }, device)?)
}

/// The output's strides (b, h, t, d) in elements, for the kernels.
pub(super) fn out_strides(out: &Tensor) -> Result<[u32; 4]> {
    let l = &out.layout().strides;
    Ok([to_u32(OP, l[0])?, to_u32(OP, l[1])?, to_u32(OP, l[2])?, to_u32(OP, l[3])?])
}

/// Whether the AVX2 + FMA variants of [`dot_f32`] / [`axpy_f32`] can run (the portable build
/// has neither 256-bit lanes nor FMA).
fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `sum(a[i] * b[i])`; `fma`: [`has_avx2_fma`] said yes.
fn dot_f32(a: &[f32], b: &[f32], fma: bool) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if fma {
        #[target_feature(enable = "avx2,fma")]
        fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
            dot_lanes::<true>(a, b)
        }
        // SAFETY: `fma` is only true when AVX2 and FMA were detected (`has_avx2_fma`).
        return unsafe { dot_avx2(a, b) };
    }
    let _ = fma;
    dot_lanes::<false>(a, b)
}

/// Sixteen running partial sums: a shape the compiler turns into two vector accumulators.
/// `FMA`: fused multiply-adds, one instruction inside `dot_avx2` (outside a function compiled
/// with FMA, `mul_add` would be a libm call).
#[inline(always)]
#[allow(clippy::needless_range_loop)]
fn dot_lanes<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..16 {
            acc[l] = if FMA { x[l].mul_add(y[l], acc[l]) } else { x[l] * y[l] + acc[l] };
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `o[i] += p * v[i]`; `fma` as in [`dot_f32`].
fn axpy_f32(p: f32, v: &[f32], o: &mut [f32], fma: bool) {
    #[cfg(target_arch = "x86_64")]
    if fma {
        #[target_feature(enable = "avx2,fma")]
        fn axpy_avx2(p: f32, v: &[f32], o: &mut [f32]) {
            for (ox, &vx) in o.iter_mut().zip(v) {
                *ox = p.mul_add(vx, *ox);
            }
        }
        // SAFETY: as in `dot_f32`.
        return unsafe { axpy_avx2(p, v, o) };
    }
    let _ = fma;
    for (ox, &vx) in o.iter_mut().zip(v) {
        *ox += p * vx;
    }
}

// ---- GPU ----------------------------------------------------------------------------------

/// Tile shape of attention.wgsl: BQ query rows and BK keys per step, NT = TR x CT threads.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttentionTiles {
    pub bq: u32,
    pub bk: u32,
    pub tr: u32,
    pub ct: u32,
}

impl AttentionTiles {
    fn nt(&self) -> u32 {
        self.tr * self.ct
    }
    /// Workgroup memory in bytes for head dim `d`.
    fn smem(&self, d: usize) -> u64 {
        let s = self.strides(d);
        16 * (self.bq as u64 * (s.qs4 + s.ss4) + self.bk as u64 * s.ks4 + self.bq as u64 * self.ct as u64 / 4)
    }
    fn strides(&self, d: usize) -> TileStrides {
        let d4 = d.div_ceil(4) as u64;
        let kw4 = d4.div_ceil(self.ct as u64) * self.ct as u64;
        // Odd vec4 strides put the rows that neighbouring threads read in different banks;
        // BK / 4 + 2 staggers the probability rows the same way.
        TileStrides { d4, kw4, qs4: d4 | 1, ks4: kw4 | 1, ss4: self.bk as u64 / 4 + 2 }
    }
    fn valid(&self) -> bool {
        self.bq > 0
            && self.bk > 0
            && self.tr > 0
            && self.ct > 0
            && self.bq.is_multiple_of(self.tr)
            && self.bk.is_multiple_of(self.ct)
            && self.ct.is_multiple_of(4)
            && self.tr <= self.bq
    }
    fn fits(&self, ctx: &GpuContext, d: usize, smem_budget: u64) -> bool {
        let c = &ctx.caps;
        self.valid()
            && self.nt() <= c.max_compute_invocations_per_workgroup.min(c.max_compute_workgroup_size_x)
            && self.smem(d) <= smem_budget.min(c.max_compute_workgroup_storage_size as u64)
    }
}

/// Row widths and strides of the workgroup tiles, in vec4.
struct TileStrides {
    d4: u64,
    kw4: u64,
    qs4: u64,
    ks4: u64,
    ss4: u64,
}

/// Overrides for tests and benchmarks; the defaults pick everything from the shapes and the
/// device's capabilities.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default)]
pub struct AttentionTuning {
    /// Number of key splits (1 = no split).
    pub splits: Option<usize>,
    pub tiles: Option<AttentionTiles>,
}

/// Workgroup memory the GL backend's tiles aim at (see `pick_tiles`).
const GL_SMEM_BUDGET: u64 = 5 << 10;

/// The first tile shape that fits the device: large blocks for long query runs, blocks of the
/// whole row group for decode (few rows per KV head).
///
/// On GL the budget is kept small: wgpu's GL backend zero-fills workgroup memory from one
/// invocation before the kernel starts (a serial cost per workgroup on any GL driver, and a
/// compile time on llvmpipe that grows faster than the size).
fn pick_tiles(ctx: &GpuContext, rows: usize, d: usize) -> Result<AttentionTiles> {
    let budget = if ctx.info.backend == "gl" { GL_SMEM_BUDGET } else { u64::MAX };
    let t = |bq, bk, tr, ct| AttentionTiles { bq, bk, tr, ct };
    let mut cands = Vec::new();
    let gl = ctx.info.backend == "gl";
    if rows <= 16 && !gl {
        // Few sizes (4, 8, 16 rows): decode is bandwidth-bound, spare rows cost little.
        let bq = rows.clamp(4, 16).next_power_of_two() as u32;
        for (bk, ct) in [(32, 32), (16, 16), (8, 8), (4, 4)] {
            cands.push(t(bq, bk, bq.min(256 / ct), ct));
        }
    }
    if gl {
        // Small shapes, the same for every row count: fewer kernel variants to compile.
        cands.extend([t(4, 8, 4, 8), t(4, 4, 4, 4), t(1, 8, 1, 8)]);
    }
    cands.extend([
        t(64, 32, 32, 8),
        // Where 64 rows do not fit (D = 128): 16 threads per row's keys and columns rather
        // than 8 (H100, 8B prefill shape, 32 heads x 512 causal queries: 0.235 -> 0.210 ms
        // alone, 211 -> 185 µs per layer in the 8B prefill's profile).
        t(32, 32, 16, 16),
        t(32, 32, 32, 8),
        t(32, 16, 32, 8),
        t(16, 16, 16, 8),
        t(16, 8, 16, 8),
        t(8, 8, 8, 8),
        t(4, 8, 4, 8),
        t(4, 4, 4, 4),
        t(2, 4, 2, 4),
        t(1, 4, 1, 4),
    ]);
    // Over the GL budget, the smallest shape the device takes.
    let pick =
        cands.iter().find(|c| c.fits(ctx, d, budget)).or_else(|| cands.iter().rev().find(|c| c.fits(ctx, d, u64::MAX)));
    pick.copied().ok_or_else(|| {
        Error::Unsupported(format!(
            "{OP}: head dim {d} needs more workgroup memory than this device's {} bytes",
            ctx.caps.max_compute_workgroup_storage_size
        ))
    })
}

type Blocks = Arc<Vec<(&'static str, String)>>;

/// `unrolled_blocks`, generated once per tile shape (decode calls are short: no need to
/// rebuild some KiB of WGSL text each time).
fn unrolled_blocks_cached(t: AttentionTiles, oc4: u32, ld: u32) -> Blocks {
    type Cache = Mutex<HashMap<(AttentionTiles, u32, u32), Blocks>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let mut map = cache.lock().unwrap_or_else(|e| e.into_inner());
    map.entry((t, oc4, ld)).or_insert_with(|| Arc::new(unrolled_blocks(&t, oc4, ld))).clone()
}

/// The per-thread code of attention.wgsl, unrolled with literal indices (see the WGSL header:
/// private arrays indexed by loop counters end up in local memory on some drivers). `oc4`:
/// vec4 output columns per thread; `ld`: vec4 slots of a K/V tile per thread.
fn unrolled_blocks(t: &AttentionTiles, oc4: u32, ld: u32) -> Vec<(&'static str, String)> {
    use std::fmt::Write;
    let (sr, sc, tr, ct, nt) = (t.bq / t.tr, t.bk / t.ct, t.tr, t.ct, t.nt());
    let rows = || 0..sr;
    let mut b: Vec<(&'static str, String)> = Vec::new();
    let mut block = |name: &'static str, indent: usize, f: &mut dyn FnMut(&mut String)| {
        let mut text = String::new();
        f(&mut text);
        let pad = " ".repeat(indent);
        let text = text.lines().map(|l| format!("{pad}{l}\n")).collect::<String>();
        b.push((name, text.trim_end().to_string()));
    };
    // `writeln!` into a String cannot fail.
    macro_rules! w {
        ($s:expr, $($arg:tt)*) => { let _ = writeln!($s, $($arg)*); };
    }
    block("DECLS", 4, &mut |s| {
        for i in rows() {
            w!(s, "let lim_{i} = row_limit(row0 + tr + {}u, kv_hi);", tr * i);
            w!(s, "var m_{i} = NEG;\nvar l_{i} = 0.0;\nvar al_{i} = 0.0;");
            for j in 0..sc {
                w!(s, "var sa_{i}_{j}: vec4<f32>;\nvar sc_{i}_{j}: f32;");
            }
            for c in 0..oc4 {
                w!(s, "var acc_{i}_{c} = vec4<f32>(0.0);");
            }
        }
        for x in 0..ld {
            w!(s, "var rk_{x}: vec4<f32>;\nvar rv_{x}: vec4<f32>;");
        }
    });
    let fetch = |s: &mut String, reg: &str, is_v: bool, k0: &str| {
        for x in 0..ld {
            w!(s, "{reg}_{x} = fetch(t + {}u, {is_v}, bi, hk, {k0}, kv_hi);", x * nt);
        }
    };
    block("FETCH_K_FIRST", 4, &mut |s| fetch(s, "rk", false, "kv_lo"));
    block("FETCH_V", 8, &mut |s| fetch(s, "rv", true, "k0"));
    block("FETCH_K_NEXT", 8, &mut |s| fetch(s, "rk", false, "k0 + BK"));
    let stash = |s: &mut String, reg: &str| {
        for x in 0..ld {
            w!(s, "stash(t + {}u, {reg}_{x});", x * nt);
        }
    };
    block("STASH_K", 8, &mut |s| stash(s, "rk"));
    block("STASH_V", 8, &mut |s| stash(s, "rv"));
    block("ZERO_PARTIALS", 8, &mut |s| {
        for i in rows() {
            for j in 0..sc {
                w!(s, "sa_{i}_{j} = vec4<f32>(0.0);");
            }
        }
    });
    block("SCORE_STEP", 12, &mut |s| {
        for i in rows() {
            w!(s, "let q_{i} = q_s[(tr + {}u) * QS4 + d4];", tr * i);
        }
        for j in 0..sc {
            w!(s, "let k_{j} = kv_s[(tc + {}u) * KS4 + d4];", ct * j);
        }
        for i in rows() {
            for j in 0..sc {
                w!(s, "sa_{i}_{j} = fma(q_{i}, k_{j}, sa_{i}_{j});");
            }
        }
    });
    block("MASK", 8, &mut |s| {
        for i in rows() {
            w!(s, "{{\n    var mx = NEG;");
            for j in 0..sc {
                w!(s, "    let a_{j} = sa_{i}_{j};\n    let dot_{j} = (a_{j}.x + a_{j}.y) + (a_{j}.z + a_{j}.w);");
                w!(s, "    sc_{i}_{j} = select(dot_{j}, NEG, k0 + tc + {}u >= lim_{i});", ct * j);
                w!(s, "    mx = max(mx, sc_{i}_{j});");
            }
            w!(s, "    red_store(tr + {}u, tc, mx);\n}}", tr * i);
        }
    });
    block("SOFTMAX", 8, &mut |s| {
        for i in rows() {
            w!(s, "{{\n    let mx = row_max(tr + {}u, m_{i});", tr * i);
            w!(s, "    al_{i} = exp2(m_{i} - mx);\n    m_{i} = mx;\n    var sum = 0.0;");
            for j in 0..sc {
                w!(s, "    let p_{j} = select(0.0, exp2(sc_{i}_{j} - mx), sc_{i}_{j} > VALID);");
                w!(s, "    p_store(tr + {}u, tc + {}u, p_{j});\n    sum += p_{j};", tr * i, ct * j);
            }
            // l is this thread's partial sum over its keys; the CT partials of a row share m.
            w!(s, "    l_{i} = l_{i} * al_{i} + sum;\n}}");
        }
    });
    block("RESCALE", 8, &mut |s| {
        for i in rows() {
            for c in 0..oc4 {
                w!(s, "acc_{i}_{c} *= al_{i};");
            }
        }
    });
    block("PV_STEP", 12, &mut |s| {
        for i in rows() {
            w!(s, "let pb_{i} = s_s[(tr + {}u) * SS4 + k4];", tr * i);
        }
        for (e, comp) in ["x", "y", "z", "w"].iter().enumerate() {
            for c in 0..oc4 {
                // Columns past D4 read the tile's zero padding (no branch in the hot loop).
                w!(s, "let v_{e}_{c} = kv_s[(k4 * 4u + {e}u) * KS4 + tc + {}u];", ct * c);
                for i in rows() {
                    w!(s, "acc_{i}_{c} = fma(vec4<f32>(pb_{i}.{comp}), v_{e}_{c}, acc_{i}_{c});");
                }
            }
        }
    });
    block("L_STORE", 4, &mut |s| {
        for i in rows() {
            w!(s, "red_store(tr + {}u, tc, l_{i});", tr * i);
        }
    });
    block("OUTPUT", 4, &mut |s| {
        for i in rows() {
            let r = format!("tr + {}u", tr * i);
            w!(s, "if (row0 + {r} < p.rows) {{");
            w!(s, "    let o_{i} = out_row(row0 + {r}, bh, split, m_{i}, row_sum({r}), tc == 0u);");
            w!(s, "    let f_{i} = bitcast<f32>(o_{i}.y);");
            for c in 0..oc4 {
                w!(s, "    emit(o_{i}.x, tc + {}u, acc_{i}_{c} * f_{i});", ct * c);
            }
            w!(s, "}}");
        }
    });
    b
}

/// The K/V binding type and its loaders (`k_at`/`v_at`: one element; `k_at4`/`v_at4`: the 4
/// elements from an index that is a multiple of 4, only called when `vec`). f16 elements are
/// packed two per u32 word (`half_at` / `halves4` in attention.wgsl unpack them); with `vec`,
/// f32 is read as vec4<f32> and f16 as vec2<u32>.
fn kv_loaders(f16: bool, vec: bool) -> (&'static str, &'static str) {
    match (f16, vec) {
        (false, false) => (
            "f32",
            "fn k_at(e: u32) -> f32 { return kb[e]; }
             fn v_at(e: u32) -> f32 { return vb[e]; }
             fn k_at4(e: u32) -> vec4<f32> { return vec4<f32>(kb[e], kb[e + 1u], kb[e + 2u], kb[e + 3u]); }
             fn v_at4(e: u32) -> vec4<f32> { return vec4<f32>(vb[e], vb[e + 1u], vb[e + 2u], vb[e + 3u]); }",
        ),
        (false, true) => (
            "vec4<f32>",
            "fn k_at(e: u32) -> f32 { return kb[e >> 2u][e & 3u]; }
             fn v_at(e: u32) -> f32 { return vb[e >> 2u][e & 3u]; }
             fn k_at4(e: u32) -> vec4<f32> { return kb[e >> 2u]; }
             fn v_at4(e: u32) -> vec4<f32> { return vb[e >> 2u]; }",
        ),
        (true, false) => (
            "u32",
            "fn k_at(e: u32) -> f32 { return half_at(kb[e >> 1u], e); }
             fn v_at(e: u32) -> f32 { return half_at(vb[e >> 1u], e); }
             fn k_at4(e: u32) -> vec4<f32> { return vec4<f32>(k_at(e), k_at(e + 1u), k_at(e + 2u), k_at(e + 3u)); }
             fn v_at4(e: u32) -> vec4<f32> { return vec4<f32>(v_at(e), v_at(e + 1u), v_at(e + 2u), v_at(e + 3u)); }",
        ),
        (true, true) => (
            "vec2<u32>",
            "fn k_at(e: u32) -> f32 { return half_at(kb[e >> 2u][(e >> 1u) & 1u], e); }
             fn v_at(e: u32) -> f32 { return half_at(vb[e >> 2u][(e >> 1u) & 1u], e); }
             fn k_at4(e: u32) -> vec4<f32> { return halves4(kb[e >> 2u]); }
             fn v_at4(e: u32) -> vec4<f32> { return halves4(vb[e >> 2u]); }",
        ),
    }
}

/// The attention kernel specialised for head dim, tiles, K/V dtype and alignment.
/// The end of attention.wgsl under `Tensor::attention_q8` (one split: the rows are whole): each
/// output row read back once the workgroup has written it, and rounded to 8-bit blocks of the
/// output projection's x [B * Tq, Hq * D] (round_q8.wgsl's layout: a row's bytes, then every
/// block's (d, s) after all rows' bytes). Invocation t takes vec4 e = t + k NT of the
/// workgroup's BQ rows, so a block's eight vec4s are eight aligned lanes (D a multiple of 32, NT
/// of 8, subgroups of at least 8: checked by the host); the trip count is the same for all.
const ROUND_Q8_ATTENTION: &str = "    storageBarrier();
    {
    let qc4 = p.hkv * p.g * (D / 4u);
    let n4 = BQ * (D / 4u);
    for (var k = 0u; k < (n4 + NT - 1u) / NT; k++) {
        let e = t + k * NT;
        let vr = row0 + e / (D / 4u);
        let live = e < n4 && vr < p.rows;
        let h = hk * p.g + vr / p.tq;
        let i = vr % p.tq;
        let c4 = e % (D / 4u);
        var v = vec4<f32>(0.0);
        if (live) {
            let o = bi * p.os.x + h * p.os.y + i * p.os.z + c4 * 4u;
            v = vec4<f32>(ob[o], ob[o + 1u], ob[o + 2u], ob[o + 3u]);
        }
        let xr = bi * p.tq + i;
        let w = h * (D / 4u) + c4;
        q8_round_lanes(v, xr * qc4 + w, p.batch * p.tq * qc4 + 2u * (xr * (qc4 / 8u) + w / 8u), live, (e & 7u) == 0u);
    }
    }";

/// The end of attention_combine.wgsl under `Tensor::attention_q8`: the merged row read back
/// and rounded as ROUND_Q8_ATTENTION rounds (one vec4 per invocation: D / 4 <= 256).
const ROUND_Q8_COMBINE: &str = "    storageBarrier();
    {
    let qc4 = p.hq * (p.d / 4u);
    let live = lid < p.d / 4u;
    var v = vec4<f32>(0.0);
    if (live) {
        v = vec4<f32>(out[orow + 4u * lid], out[orow + 4u * lid + 1u], out[orow + 4u * lid + 2u], out[orow + 4u * lid + 3u]);
    }
    let xr = (bh / p.hq) * p.tq + i;
    let w = (bh % p.hq) * (p.d / 4u) + lid;
    q8_round_lanes(v, xr * qc4 + w, (p.rows / p.hq) * qc4 + 2u * (xr * (qc4 / 8u) + w / 8u), live, (lid & 7u) == 0u);
    }";

/// The header of a kernel that rounds its output (`Tensor::attention_q8`): the words' binding,
/// the lane reductions and the rounding functions.
fn round_q8_header(ctx: &GpuContext, binding: u32) -> String {
    format!(
        "@group(0) @binding({binding}) var<storage, read_write> xq: array<u32>;\n{}\n{}",
        crate::quant::gpu::lane_reductions_wgsl(ctx),
        crate::quant::gpu::ROUND_Q8_WGSL
    )
}

/// Whether the rows of K and V start on a 4-element boundary with unit stride (loaded a vec4 at a
/// time).
fn kv_vec(s: &Dims, k: &Tensor, v: &Tensor) -> bool {
    let aligned = |t: &Tensor| {
        let l = t.layout();
        l.strides[3] == 1 && l.offset.is_multiple_of(4) && l.strides[..3].iter().all(|x| x.is_multiple_of(4))
    };
    s.d.is_multiple_of(4) && aligned(k) && aligned(v)
}

fn attention_pipeline(
    ctx: &GpuContext,
    s: &Dims,
    tiles: AttentionTiles,
    k: &Tensor,
    v: &Tensor,
    q8: bool,
) -> Result<Pipeline> {
    let u = |x: usize| to_u32(OP, x);
    let ts = tiles.strides(s.d);
    let kv_f16 = k.dtype() == DType::F16;
    let kv_vec = kv_vec(s, k, v);
    let ld = (tiles.bk as u64 * ts.kw4).div_ceil(tiles.nt() as u64) as u32;
    let spec = KernelSpec::new(
        format!(
            "attention_d{}_{}x{}_{}x{}{}{}{}",
            s.d,
            tiles.bq,
            tiles.bk,
            tiles.tr,
            tiles.ct,
            if kv_f16 { "_f16kv" } else { "" },
            if kv_vec { "_vec" } else { "" },
            if q8 { "_q8" } else { "" }
        ),
        include_str!("attention.wgsl"),
        "attention",
    )
    .with(ATTENTION_PARAMS_WGSL)
    .constant_u32("D", u(s.d)?)
    .constant_u32("D4", ts.d4 as u32)
    .constant_u32("BQ", tiles.bq)
    .constant_u32("BK", tiles.bk)
    .constant_u32("TR", tiles.tr)
    .constant_u32("CT", tiles.ct)
    .constant_u32("NT", tiles.nt())
    .constant_u32("KW4", ts.kw4 as u32)
    .constant_u32("QS4", ts.qs4 as u32)
    .constant_u32("KS4", ts.ks4 as u32)
    .constant_u32("SS4", ts.ss4 as u32)
    .constant_u32("CT4", tiles.ct / 4)
    .with(&format!("const KV_VEC: bool = {kv_vec};"))
    .with(&if q8 { round_q8_header(ctx, 5) } else { String::new() });
    let (kv_t, kv_at) = kv_loaders(kv_f16, kv_vec);
    // Unrolling the head dim helps real GPUs; on GL and software rasterizers it costs compile
    // time (llvmpipe: seconds per kernel variant).
    let slow_compiler = ctx.info.backend == "gl" || ctx.info.software;
    let blocks = unrolled_blocks_cached(tiles, (ts.kw4 / tiles.ct as u64) as u32, ld);
    let mut repl: Vec<(&str, &str)> = vec![
        ("KV_T", kv_t),
        ("KV_AT", kv_at),
        ("D4_LOOP", if slow_compiler { "p.d4" } else { "D4" }),
        ("NK4_LOOP", if slow_compiler { "nk4" } else { "BK / 4u" }),
        ("ROUND_Q8", if q8 { ROUND_Q8_ATTENTION } else { "" }),
    ];
    repl.extend(blocks.iter().map(|(k, v)| (*k, v.as_str())));
    ctx.pipeline(&spec, &repl)
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    batch: u32,
    hkv: u32,
    g: u32,
    tq: u32,
    tk: u32,
    rows: u32,
    n_rblocks: u32,
    n_splits: u32,
    split_len: u32,
    causal: u32,
    scale: f32,
    d4: u32,
    q_off: u32,
    k_off: u32,
    v_off: u32,
    _pad1: u32,
    qs: [u32; 4],
    ks: [u32; 4],
    vs: [u32; 4],
    /// The output's strides (b, h, t, d); the partials of a split call are [B·Hq·Tq, splits,
    /// D + 2] whatever they say.
    os: [u32; 4],
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct CombineParams {
    /// Output rows (B * Hq * Tq): one workgroup each.
    rows: u32,
    d: u32,
    n_splits: u32,
    /// The partials' layout offset.
    off: u32,
    tq: u32,
    hq: u32,
    /// Tk and keys per split: only the first ceil(Tk / split_len) splits are read.
    keys: u32,
    split_len: u32,
    /// The output's strides (b, h, t, d).
    os: [u32; 4],
}

/// Workgroups that keep a large GPU busy; below this the keys are split (flash-decoding).
const TARGET_WORKGROUPS: usize = 512;

/// Decode (a few query rows) over at most this many keys (the cache's capacity) is not split:
/// a split costs the merge, a dispatch of its own or the output projection's prologue, more
/// than a workgroup walking the few tiles alone. H100, 32 query / 8 KV heads, kernels timed
/// each in a pass of its own (µs, one split vs split and merged): D = 128, 128 keys 14.8 vs
/// 10.0 + 7.5, 256 keys 21.3 vs 10.0 + 8.0; D = 64, 13.6 vs 9.6 + 7.3, 19.2 vs 9.6 + 7.5 (about
/// 1.5 µs more per 32-key tile walked alone). Decode step at a 129-position cache, GPU pass per
/// token (BENCHMARKS.md, twelfth session): 8B Q4_0 3.00 -> 2.91 ms, 1B F16 1.277 -> 1.229.
/// SmolLM2's output projection merges its splits in its prologue, no dispatch: it kept them
/// (walked whole by the flash kernel, 0.839 -> 0.850 ms) until the decode kernel
/// (attention_decode.rs) walked such caches faster than splits (SmolLM2 0.836 -> 0.806 ms, 1B
/// Q4_0 0.81 -> 0.75 ms; BENCHMARKS.md, fifteenth session): where it applies, every caller's
/// short cache is unsplit.
pub const DECODE_WHOLE_KEYS: usize = 160;

pub fn gpu_attention(q: &Tensor, k: &Tensor, v: &Tensor, opts: &AttentionOpts) -> Result<Tensor> {
    gpu_attention_tuned(q, k, v, opts, AttentionTuning::default())
}

/// The first pass of a split attention (flash-decoding), not yet merged: per output row
/// (b, h, i) of [B, Hq, Tq, D], in that order (not the output's storage order), and per key split s, the D + 2 floats
/// (m, l, acc[D]): m the split's row max of the scaled scores (log2 domain), l its sum of
/// exp2(score - m), acc its unnormalised weighted sum of V. Splits whose keys a row may not see
/// hold (-1e30, 0, zeros); splits past the last key (Tk, `keys`) are not written at all, and
/// the merges read only the first ceil(Tk / `split_len`). The output row is
///   sum_s exp2(m_s - M) acc_s / sum_s exp2(m_s - M) l_s  (M = max_s m_s; zeros when l sums to 0),
/// which [`AttentionPartials::combine`] computes (attention_combine.wgsl) and the quantized
/// matvec's combine prologue computes in workgroup memory (`QTensor::qmatmul_add_combined`:
/// the output projection of a decode step reads the partials directly, saving a dispatch).
pub struct AttentionPartials {
    /// [B * Hq * Tq, n_splits, D + 2] f32 on the GPU.
    pub(crate) part: Tensor,
    /// The attention output's shape [B, Hq, Tq, D].
    pub(crate) shape: [usize; 4],
    pub(crate) n_splits: usize,
    /// Keys the attention saw (Tk) and keys per split: the merges read only the splits that
    /// can hold keys (a decode step's grid is planned for the cache's whole capacity, and Tk
    /// moves with the position, so a replay patches it).
    pub(crate) keys: usize,
    pub(crate) split_len: usize,
}

impl AttentionPartials {
    /// The partials, [B * Hq * Tq, n_splits, D + 2] f32.
    pub fn part(&self) -> &Tensor {
        &self.part
    }
    /// The merged output's shape [B, Hq, Tq, D].
    pub fn shape(&self) -> [usize; 4] {
        self.shape
    }
    pub fn n_splits(&self) -> usize {
        self.n_splits
    }

    /// The second pass: the attention output [B, Hq, Tq, D] (f32, stored [B, Tq, Hq, D] as
    /// [`Tensor::attention`]'s), one dispatch.
    pub fn combine(&self) -> Result<Tensor> {
        let out = gpu_output(self.shape, false, self.part.device())?;
        self.combine_into(&out, None)?;
        Ok(out)
    }

    /// The merge into `out` (from [`gpu_output`]), and with `xq` its rows rounded to 8-bit
    /// blocks there as well (`Tensor::attention_q8`).
    fn combine_into(&self, out: &Tensor, xq: Option<&Tensor>) -> Result<()> {
        let ctx = gpu_of(OP, &self.part)?;
        let u = |x: usize| to_u32(OP, x);
        let n_out = out.numel();
        if n_out == 0 {
            return Ok(());
        }
        let rows = self.shape[0] * self.shape[1] * self.shape[2];
        let cparams = CombineParams {
            rows: u(rows)?,
            d: u(self.shape[3])?,
            n_splits: u(self.n_splits)?,
            off: u(self.part.layout().offset)?,
            tq: u(self.shape[2])?,
            hq: u(self.shape[1])?,
            keys: u(self.keys)?,
            split_len: u(self.split_len.max(1))?,
            os: out_strides(out)?,
        };
        let source = include_str!("attention_combine.wgsl");
        let spec = match xq {
            Some(_) => {
                KernelSpec::new("attention_combine_q8", source, "attention_combine").with(&round_q8_header(&ctx, 3))
            }
            None => KernelSpec::new("attention_combine", source, "attention_combine"),
        };
        let combine = ctx.pipeline(&spec, &[("ROUND_Q8", if xq.is_some() { ROUND_Q8_COMBINE } else { "" })])?;
        let mut binds = vec![Bind::Whole(buf(&self.part)?), Bind::Whole(buf(out)?)];
        if let Some(xq) = xq {
            binds.push(Bind::Whole(buf(xq)?));
        }
        ctx.dispatch(&combine, "attention_combine", bytemuck::bytes_of(&cparams), &binds, ctx.grid_1d(u(rows)?))
    }
}

/// The keys a call is planned for: the keys' allocated length (a KV cache view [B, Hkv, len,
/// D] of [.., capacity, D] has strides[1] / strides[2] == capacity), not `tk`, so that the grid
/// stays the same while the cache fills and a recorded decode step replays at every position
/// (splits past `tk` return at once and write nothing: the merges read only the first
/// ceil(tk / split_len) splits); a recording's horizon (AttentionOpts::max_keys) shortens it.
fn planned_keys(s: &Dims, k: &Tensor, v: &Tensor, opts: &AttentionOpts) -> Result<usize> {
    let st = &k.layout().strides;
    let capacity = match st[2] > 0 && st[1].is_multiple_of(st[2]) && st[1] / st[2] >= s.tk {
        true if st[1] == v.layout().strides[1] => st[1] / st[2],
        _ => s.tk,
    };
    match opts.max_keys {
        Some(m) if s.tk > m => Err(Error::shape(OP, format!("{} keys past the planned horizon of {m}", s.tk))),
        Some(m) => Ok(capacity.min(m)),
        None => Ok(capacity),
    }
}

/// Whether a call runs on the decode kernel (`attention_decode.wgsl`): a GPU, one query
/// position over a short planned range (see `plan`), operands it takes. For tests.
#[doc(hidden)]
pub fn takes_decode_kernel(q: &Tensor, k: &Tensor, v: &Tensor, opts: &AttentionOpts) -> Result<bool> {
    if q.device().gpu().is_none() {
        return Ok(false);
    }
    Ok(plan(q, k, v, opts, AttentionTuning::default(), Merge::Dispatch, false)?
        .is_some_and(|p| matches!(p.kernel, Kernel::Decode(_))))
}

/// What one attention call dispatches: its kernel, grid, params and key splits.
struct Plan {
    ctx: Arc<GpuContext>,
    s: Dims,
    params: Params,
    kernel: Kernel,
    n_wg: u32,
    splits: usize,
    /// The kernel also rounds the output rows to 8-bit blocks (its ROUND_Q8 variant: one
    /// split, asked for by `gpu_attention_q8`).
    rounds: bool,
}

/// The kernel a plan runs, whose pipeline is fetched (compiled on first use) only when the plan
/// dispatches: a caller that only asks how a call would be split or which kernel it takes
/// compiles nothing. (The decode step's output projection asks for the splits before the
/// attention runs; that compiled the decode kernel's plain variant, which the step, taking
/// the rounding one, never used: a compile thread that could still be running at exit.)
#[derive(Clone, Copy)]
enum Kernel {
    /// attention_decode.rs: every key at once, one workgroup per (batch, KV head).
    Decode(attention_decode::Shape),
    /// The flash kernel, tiled so.
    Flash(AttentionTiles),
}

/// Who merges a split attention's partials: the combine dispatch (`gpu_attention`), or the
/// caller (`gpu_attention_partials`: the decode step's output projection, in its prologue).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Merge {
    Dispatch,
    Caller,
}

/// Checks the inputs and plans the call; None when there is nothing to dispatch (no keys, or
/// an empty output). `round`: take the kernel that also rounds its output rows to 8-bit blocks
/// where it can (one split, invocations a multiple of 8: `Plan::rounds`).
fn plan(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &AttentionOpts,
    tuning: AttentionTuning,
    merge: Merge,
    round: bool,
) -> Result<Option<Plan>> {
    let s = check(q, k, v)?;
    let ctx = gpu_of(OP, q)?;
    if s.tk == 0 || s.out_shape().iter().product::<usize>() == 0 {
        return Ok(None);
    }
    let g = s.hq / s.hkv;
    let rows = g * s.tq;
    let tiles = match tuning.tiles {
        Some(t) if t.fits(&ctx, s.d, u64::MAX) => t,
        Some(t) => return Err(Error::Unsupported(format!("{OP}: tiles {t:?} do not fit this device for D={}", s.d))),
        None => pick_tiles(&ctx, rows, s.d)?,
    };
    let n_rblocks = rows.div_ceil(tiles.bq as usize);
    let base_wgs = s.b * s.hkv * n_rblocks;
    let bk = tiles.bk as usize;
    let capacity = planned_keys(&s, k, v, opts)?;
    let n_ktiles = capacity.div_ceil(bk);
    // The decode kernel's shape where it takes the call if not split (tuned calls keep the
    // flash kernel: tests compare them).
    let untuned = tuning.splits.is_none() && tuning.tiles.is_none();
    let decode_shape = attention_decode::shape(&ctx, &s, capacity, k, kv_vec(&s, k, v)).filter(|_| untuned);
    let splits = match tuning.splits {
        Some(n) => n.clamp(1, n_ktiles),
        // Decode over a short cache walks it whole where the splits would be merged by a
        // dispatch of their own: it costs more than the few tiles a workgroup walks alone (see
        // DECODE_WHOLE_KEYS). A caller that merges them itself takes them split. The decode
        // kernel, where it takes the call (up to DECODE_KERNEL_MAX_KEYS), beats the splits and
        // either merge (BENCHMARKS.md, fifteenth session).
        None if rows <= 16
            && ((capacity <= DECODE_WHOLE_KEYS && merge == Merge::Dispatch) || decode_shape.is_some()) =>
        {
            1
        }
        // Split only when the blocks leave the GPU idle, into pieces of at least 2 tiles (1 for
        // a few query rows: decode).
        None if base_wgs < TARGET_WORKGROUPS => {
            let min_piece = if rows <= 16 { 1 } else { 2 };
            TARGET_WORKGROUPS.div_ceil(base_wgs).min(n_ktiles / min_piece).max(1)
        }
        None => 1,
    };
    let split_len = n_ktiles.div_ceil(splits) * bk;
    let splits = capacity.div_ceil(split_len);

    let u = |x: usize| to_u32(OP, x);
    let st = |t: &Tensor| -> Result<[u32; 4]> {
        let l = &t.layout().strides;
        Ok([u(l[0])?, u(l[1])?, u(l[2])?, u(l[3])?])
    };
    let params = Params {
        batch: u(s.b)?,
        hkv: u(s.hkv)?,
        g: u(g)?,
        tq: u(s.tq)?,
        tk: u(s.tk)?,
        rows: u(rows)?,
        n_rblocks: u(n_rblocks)?,
        n_splits: u(splits)?,
        split_len: u(split_len)?,
        causal: opts.causal as u32,
        scale: opts.scale * std::f32::consts::LOG2_E,
        d4: u(s.d.div_ceil(4))?,
        q_off: u(q.layout().offset)?,
        k_off: u(k.layout().offset)?,
        v_off: u(v.layout().offset)?,
        _pad1: 0,
        qs: st(q)?,
        ks: st(k)?,
        vs: st(v)?,
        // The strides `gpu_output` gives (the partials ignore them).
        os: [u(s.hq * s.tq * s.d)?, u(s.d)?, u(s.hq * s.d)?, 1],
    };
    // A decode step not split takes the kernel that scores every key at once where its planned
    // keys fit (attention_decode.rs), one workgroup per (batch, KV head).
    let (kernel, n_wg, rounds) = match decode_shape.filter(|_| splits == 1) {
        Some(sh) => (Kernel::Decode(sh), u(s.b * s.hkv)?, round),
        None => {
            let rounds = round && splits == 1 && tiles.nt().is_multiple_of(8);
            (Kernel::Flash(tiles), u(splits * base_wgs)?, rounds)
        }
    };
    Ok(Some(Plan { ctx, s, params, kernel, n_wg, splits, rounds }))
}

impl Plan {
    /// Runs the attention kernel writing into `out`: the output rows (one split) or the
    /// partials; and, where the plan `rounds`, the rows' 8-bit blocks into `xq`.
    fn dispatch(&self, q: &Tensor, k: &Tensor, v: &Tensor, out: &Tensor, xq: Option<&Tensor>) -> Result<()> {
        let mut binds = vec![Bind::Whole(buf(q)?), Bind::Whole(buf(k)?), Bind::Whole(buf(v)?), Bind::Whole(buf(out)?)];
        match (self.rounds, xq) {
            (true, Some(xq)) => binds.push(Bind::Whole(buf(xq)?)),
            (false, None) => {}
            _ => return Err(Error::gpu(OP, "the rounding kernel and its words go together")),
        }
        let pipeline = match self.kernel {
            Kernel::Decode(sh) => {
                attention_decode::decode_pipeline(&self.ctx, sh, self.rounds.then(|| round_q8_header(&self.ctx, 5)))?
            }
            Kernel::Flash(tiles) => attention_pipeline(&self.ctx, &self.s, tiles, k, v, self.rounds)?,
        };
        self.ctx.dispatch(&pipeline, OP, bytemuck::bytes_of(&self.params), &binds, self.ctx.grid_1d(self.n_wg))
    }

    /// The first pass of a split call into a new partials tensor.
    fn partials(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<AttentionPartials> {
        let s = &self.s;
        let rows = s.b * s.hq * s.tq;
        let part = Tensor::gpu_empty(vec![rows, self.splits, s.d + 2], DType::F32, q.device())?;
        self.dispatch(q, k, v, &part, None)?;
        let split_len = self.params.split_len as usize;
        Ok(AttentionPartials { part, shape: [s.b, s.hq, s.tq, s.d], n_splits: self.splits, keys: s.tk, split_len })
    }
}

#[doc(hidden)]
pub fn gpu_attention_tuned(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &AttentionOpts,
    tuning: AttentionTuning,
) -> Result<Tensor> {
    // Prefill on cooperative matrices where the device has them (a tuned call is the flash
    // kernel's).
    if tuning.splits.is_none() && tuning.tiles.is_none() {
        if let Some(o) = super::attention_coop::gpu_attention_coop(q, k, v, opts)? {
            return Ok(o);
        }
    }
    let Some(plan) = plan(q, k, v, opts, tuning, Merge::Dispatch, false)? else {
        let s = check(q, k, v)?;
        if s.tk == 0 {
            // Softmax over no keys: every row is empty, the output zeros.
            return as_bhtd(Tensor::zeros(s.stored_shape(), DType::F32, q.device())?);
        }
        return as_bhtd(Tensor::gpu_empty(s.stored_shape(), DType::F32, q.device())?);
    };
    if plan.splits == 1 {
        let s = &plan.s;
        let out = gpu_output([s.b, s.hq, s.tq, s.d], false, q.device())?;
        debug_assert_eq!(out_strides(&out)?, plan.params.os);
        plan.dispatch(q, k, v, &out, None)?;
        return Ok(out);
    }
    // Flash-decoding: partial (m, l, acc) per row and split, then the combine pass.
    plan.partials(q, k, v)?.combine()
}

/// `ANYGPU_ATTN_Q8=0` (read once): [`gpu_attention_q8`] declines, so the output projection
/// rounds x in a dispatch of its own again (for comparisons).
fn q8_rows_off() -> bool {
    static OFF: OnceLock<bool> = OnceLock::new();
    *OFF.get_or_init(|| std::env::var("ANYGPU_ATTN_Q8").is_ok_and(|v| v == "0"))
}

/// The attention output as the x rows of the next product, f32 [B * Tq, Hq * D], together with
/// their rounding to 8-bit blocks written by the same dispatch (the kernel's last step, or the
/// split merge's): the decode step's output projection then needs no rounding dispatch of its
/// own (`QTensor::qmatmul_add_q8`). `None`, with nothing dispatched, where this does not apply:
/// more than `MATVEC_MAX_N` rows (the Q8 matvec's limit), D not a multiple of 32 (blocks would
/// straddle heads), a device without subgroups of at least 8 (a block's max and sum meet in
/// shuffles), a tile whose invocations are not a multiple of 8, no keys.
pub fn gpu_attention_q8(q: &Tensor, k: &Tensor, v: &Tensor, opts: &AttentionOpts) -> Result<Option<Q8Rows>> {
    let s = check(q, k, v)?;
    let ctx = gpu_of(OP, q)?;
    if q8_rows_off()
        || s.b * s.tq > crate::quant::gpu::MATVEC_MAX_N
        || !s.d.is_multiple_of(32)
        || !ctx.caps.subgroup
        || ctx.caps.subgroup_min_size < 8
    {
        return Ok(None);
    }
    let Some(plan) = plan(q, k, v, opts, AttentionTuning::default(), Merge::Dispatch, true)? else { return Ok(None) };
    if plan.splits == 1 && !plan.rounds {
        return Ok(None);
    }
    let out = gpu_output([s.b, s.hq, s.tq, s.d], false, q.device())?;
    let rows = Q8Rows::for_x(out.permute(&[0, 2, 1, 3])?.reshape([s.b * s.tq, s.hq * s.d])?)?;
    if plan.splits == 1 {
        plan.dispatch(q, k, v, &out, Some(rows.words()))?;
    } else {
        plan.partials(q, k, v)?.combine_into(&out, Some(rows.words()))?;
    }
    Ok(Some(rows))
}

/// The attention's first pass alone when it splits the keys (see [`AttentionPartials`]);
/// `None`, with nothing dispatched, when it would not split (then [`gpu_attention`] runs it
/// whole), when there are no keys or when the output is empty.
pub fn gpu_attention_partials(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &AttentionOpts,
) -> Result<Option<AttentionPartials>> {
    gpu_attention_partials_tuned(q, k, v, opts, AttentionTuning::default())
}

/// The key splits [`gpu_attention_partials`] would make (1: none, or nothing to attend), with
/// nothing dispatched: a caller that can merge partials asks first whether they fit it.
pub fn gpu_attention_partial_splits(q: &Tensor, k: &Tensor, v: &Tensor, opts: &AttentionOpts) -> Result<usize> {
    Ok(plan(q, k, v, opts, AttentionTuning::default(), Merge::Caller, false)?.map_or(1, |p| p.splits))
}

/// [`gpu_attention_partials`] with the overrides of `tuning` (tests force splits).
#[doc(hidden)]
pub fn gpu_attention_partials_tuned(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &AttentionOpts,
    tuning: AttentionTuning,
) -> Result<Option<AttentionPartials>> {
    match plan(q, k, v, opts, tuning, Merge::Caller, false)? {
        Some(plan) if plan.splits > 1 => plan.partials(q, k, v).map(Some),
        _ => Ok(None),
    }
}

impl Tensor {
    /// Scaled dot-product attention with `self` as the queries: `q.attention(k, v, opts)`.
    /// q [B, Hq, Tq, D] (f32), k/v [B, Hkv, Tk, D] (f32 or f16) -> [B, Hq, Tq, D] (f32), a view
    /// of storage in [B, Tq, Hq, D] order: `permute([0, 2, 1, 3])` of it is contiguous.
    pub fn attention(&self, k: &Tensor, v: &Tensor, opts: &AttentionOpts) -> Result<Tensor> {
        same_device(OP, self, k)?;
        same_device(OP, self, v)?;
        self.device().backend().attention(self, k, v, opts)
    }

    /// The attention output as the next product's x rows [B * Tq, Hq * D], rounded to 8-bit
    /// blocks in the same dispatch as well, on a GPU: see [`gpu_attention_q8`]. `None`, with
    /// nothing dispatched, on the CPU and where it does not apply: then run
    /// [`Tensor::attention`].
    pub fn attention_q8(&self, k: &Tensor, v: &Tensor, opts: &AttentionOpts) -> Result<Option<Q8Rows>> {
        same_device(OP, self, k)?;
        same_device(OP, self, v)?;
        if self.device().gpu().is_none() {
            return Ok(None);
        }
        gpu_attention_q8(self, k, v, opts)
    }

    /// The attention's first pass alone, when it runs on a GPU and splits the keys
    /// (flash-decoding): see [`AttentionPartials`]. `None`, with nothing dispatched, on the CPU
    /// or when the keys are not split: then run [`Tensor::attention`].
    pub fn attention_partials(
        &self,
        k: &Tensor,
        v: &Tensor,
        opts: &AttentionOpts,
    ) -> Result<Option<AttentionPartials>> {
        same_device(OP, self, k)?;
        same_device(OP, self, v)?;
        if self.device().gpu().is_none() {
            return Ok(None);
        }
        gpu_attention_partials(self, k, v, opts)
    }
}
