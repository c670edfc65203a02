//! Fused weight products for the decode step, where every dispatch costs more than the small
//! matrices it multiplies (~4-5 µs of GPU time each on the H100, back to back): row-stacked
//! matrices (Q|K|V, gate|up) read in one dispatch, the matvec kernel's prologues (RMSNorm of x;
//! the merge of a split attention's partials into x, flash-decoding's second pass) and
//! epilogues (the residual add, the SwiGLU gate, rope + the KV-cache store). Every fused
//! product equals its unfused composition, which is also what runs where the fused kernel does
//! not apply (the CPU, more than `MATVEC_MAX_N` x rows, a paired-row matrix split over several
//! bindings, partials too large to re-read in every workgroup).

use super::gpu::{qmatvec_fused, Epilogue, NormRounding, Prologue, Q8Rows, QOptions, RopeKvEpilogue, MATVEC_MAX_N};
use super::{QStorage, QTensor};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::ops::attention::{gpu_attention_partial_splits, AttentionOpts, AttentionPartials};
use crate::ops::rope::{plan, RopeOpts};
use crate::ops::rope_kv::{check_caches, rope_qkv_store};
use crate::tensor::{DType, Tensor};

/// An RMSNorm applied to a product's input: `x / sqrt(mean(x^2) + eps) * weight`.
#[derive(Clone, Copy)]
pub struct RmsNorm<'a> {
    /// [cols] f32, on the weights' device.
    pub weight: &'a Tensor,
    pub eps: f32,
    /// x rounded for this norm by the product that wrote x ([`QTensor::qmatmul_add_rounding`]
    /// with this weight), which a product that takes 8-bit x then reads instead of rounding
    /// x itself; ignored elsewhere, and where the rows were made from another tensor or for
    /// another weight.
    pub rounded: Option<&'a Q8Rows>,
}

impl<'a> RmsNorm<'a> {
    /// The norm of x with no rounding made for it.
    pub fn new(weight: &'a Tensor, eps: f32) -> RmsNorm<'a> {
        RmsNorm { weight, eps, rounded: None }
    }
}

/// The attention side of [`QTensor::qmatmul_rms_rope_kv`]: the rope of Q and K, and the KV
/// caches the keys and values of the new positions are written into.
pub struct RopeKvStore<'a> {
    pub rope: &'a RopeOpts,
    /// (H, Hkv, D): Q heads, key/value heads, head dim. W stacks Q|K|V, [(H + 2 Hkv) D, cols].
    pub heads: (usize, usize, usize),
    /// The position of x's first row.
    pub start_pos: usize,
    /// [Hkv, cap, D] f32, contiguous (views of a larger buffer are fine).
    pub k_cache: &'a mut Tensor,
    pub v_cache: &'a mut Tensor,
}

/// Fails unless `resid` has the product's shape: x [n, cols] @ W^T is [n, rows], rows last.
fn check_residual(op: &'static str, w: &QTensor, x: &Tensor, resid: &Tensor) -> Result<()> {
    let n = x.numel() / w.cols().max(1);
    if resid.numel() != n * w.rows() || resid.dims().last() != Some(&w.rows()) || resid.dtype() != DType::F32 {
        return Err(Error::shape(
            op,
            format!("residual {} does not match the product [{n}, {}]", resid.shape(), w.rows()),
        ));
    }
    Ok(())
}

/// The matvec prologue of an optional RMSNorm.
fn prologue(norm: Option<RmsNorm<'_>>) -> Prologue<'_> {
    match norm {
        Some(RmsNorm { weight, eps, rounded: Some(r) }) => Prologue::RoundedNorm(r, weight, eps),
        Some(n) => Prologue::RmsNorm(n.weight, n.eps),
        None => Prologue::None,
    }
}

impl QTensor {
    /// Host matrices (memory-mapped file bytes, say) of one type and width stacked row-wise
    /// into one [Σ rows, cols] matrix on `device`: one product instead of several. The bytes
    /// are joined on the host and uploaded once (rows of 18-byte Q4_0 blocks may start at any
    /// byte, which GPU buffer copies cannot do).
    pub fn stack_rows(parts: &[&QTensor], device: &Device) -> Result<QTensor> {
        const OP: &str = "stack_rows";
        let first = parts.first().ok_or_else(|| Error::shape(OP, "no matrices"))?;
        let (ty, cols) = (first.ggml_type(), first.cols());
        if let Some(bad) = parts.iter().find(|p| p.ggml_type() != ty || p.cols() != cols) {
            return Err(Error::shape(
                OP,
                format!("cannot stack {} [{}, {}] on {ty} [_, {cols}]", bad.ggml_type(), bad.rows(), bad.cols()),
            ));
        }
        let mut data = Vec::with_capacity(parts.iter().map(|p| p.byte_len()).sum());
        for p in parts {
            match p.storage() {
                QStorage::Cpu { bytes, offset, len } => {
                    data.extend_from_slice(&(**bytes).as_ref()[*offset..*offset + *len])
                }
                QStorage::Gpu(_) => return Err(Error::mismatch(OP, "the parts must be host matrices")),
            }
        }
        QTensor::from_vec(ty, parts.iter().map(|p| p.rows()).sum(), cols, data, device)
    }

    /// x [.., cols] on the weights' device: f32, or f16 where `f16_ok` (the products without a
    /// norm: see `QOptions::f16_out`).
    fn check_input(&self, op: &'static str, x: &Tensor, f16_ok: bool) -> Result<()> {
        let dtype_ok = x.dtype() == DType::F32 || (f16_ok && x.dtype() == DType::F16);
        if !x.device().same(self.device()) || !dtype_ok || x.dims().last() != Some(&self.cols()) {
            return Err(Error::shape(
                op,
                format!(
                    "input {} ({}) does not match weights [{}, {}]",
                    x.shape(),
                    x.dtype(),
                    self.rows(),
                    self.cols()
                ),
            ));
        }
        Ok(())
    }

    /// `resid + x @ W^T` (a residual connection): x [.., cols], resid [.., rows].
    pub fn qmatmul_add(&self, x: &Tensor, resid: &Tensor) -> Result<Tensor> {
        self.qmatmul_add_opts(x, resid, QOptions::default())
    }

    /// [`QTensor::qmatmul_add`] with the kernel knobs of `opts` (tests of the kernels and the
    /// binding split).
    pub fn qmatmul_add_opts(&self, x: &Tensor, resid: &Tensor, opts: QOptions) -> Result<Tensor> {
        const OP: &str = "qmatmul_add";
        self.check_input(OP, x, true)?;
        check_residual(OP, self, x, resid)?;
        if self.device().gpu().is_some() && resid.device().same(self.device()) {
            if let Some(y) = qmatvec_fused(self, x, Epilogue::Add(resid), Prologue::None, opts)? {
                return y.reshape(resid.shape().clone());
            }
            // Prefill: the coop kernel's residual epilogue, where it runs the product.
            if let Some(y) = super::gpu::qmatmul_coop_epilogue(self, x, Epilogue::Add(resid), None, opts)? {
                return y.reshape(resid.shape().clone());
            }
        }
        let y = match self.device() {
            Device::Gpu(_) => super::gpu::qmatmul_opts(self, x, opts)?,
            Device::Cpu => self.qmatmul(x)?,
        };
        resid.add(&y.reshape(resid.shape().clone())?)
    }

    /// `resid + x @ W^T` for x that comes rounded to 8-bit blocks by the kernel that wrote it
    /// (the decode attention: `Tensor::attention_q8`): on a GPU, where the matrix takes Q8 x
    /// (see [`QTensor::takes_q8_rows`]), the product reads the blocks and no rounding dispatch
    /// runs; otherwise it is [`QTensor::qmatmul_add`] of the f32 x.
    pub fn qmatmul_add_q8(&self, x: &Q8Rows, resid: &Tensor) -> Result<Tensor> {
        if self.takes_q8_rows() && resid.device().same(self.device()) {
            self.check_input("qmatmul_add_q8", x.x(), false)?;
            check_residual("qmatmul_add_q8", self, x.x(), resid)?;
            let opts = QOptions { x_q8: Some(true), ..QOptions::default() };
            if let Some(y) = qmatvec_fused(self, x.x(), Epilogue::Add(resid), Prologue::Rounded(x), opts)? {
                return y.reshape(resid.shape().clone());
            }
        }
        self.qmatmul_add(x.x(), resid)
    }

    /// [`QTensor::qmatmul_add`] that also rounds the sum h for the next product's RMSNorm with
    /// weight `next` [rows] (see [`QTensor::reads_rounded_norm`]), in the same dispatch: h, and
    /// `Some` rounding to pass as that norm's [`RmsNorm::rounded`] where the product ran so on a
    /// GPU (one dispatch fewer per norm: the decode step's rounding of x for the Q|K|V and
    /// gate|up products); `None` where it did not (the CPU, more x rows than the matvec takes,
    /// a device without 1,024-invocation workgroups or subgroups of 8, rows not whole 32-row
    /// blocks).
    pub fn qmatmul_add_rounding(&self, x: &Tensor, resid: &Tensor, next: &Tensor) -> Result<(Tensor, Option<Q8Rows>)> {
        const OP: &str = "qmatmul_add_rounding";
        self.check_input(OP, x, true)?;
        check_residual(OP, self, x, resid)?;
        if let Some((h, r)) = self.add_rounding(x, resid, next, Prologue::None, QOptions::default())? {
            return Ok((h, Some(r)));
        }
        Ok((self.qmatmul_add(x, resid)?, None))
    }

    /// [`QTensor::qmatmul_add_q8`] with the rounding of [`QTensor::qmatmul_add_rounding`].
    pub fn qmatmul_add_q8_rounding(
        &self,
        x: &Q8Rows,
        resid: &Tensor,
        next: &Tensor,
    ) -> Result<(Tensor, Option<Q8Rows>)> {
        const OP: &str = "qmatmul_add_q8_rounding";
        if self.takes_q8_rows() && resid.device().same(self.device()) {
            self.check_input(OP, x.x(), false)?;
            check_residual(OP, self, x.x(), resid)?;
            let opts = QOptions { x_q8: Some(true), ..QOptions::default() };
            if let Some((h, r)) = self.add_rounding(x.x(), resid, next, Prologue::Rounded(x), opts)? {
                return Ok((h, Some(r)));
            }
        }
        Ok((self.qmatmul_add_q8(x, resid)?, None))
    }

    /// The rounding epilogue's product, `None` where it does not run.
    fn add_rounding(
        &self,
        x: &Tensor,
        resid: &Tensor,
        next: &Tensor,
        pro: Prologue<'_>,
        opts: QOptions,
    ) -> Result<Option<(Tensor, Q8Rows)>> {
        if next.numel() != self.rows() || next.dtype() != DType::F32 || !next.device().same(self.device()) {
            return Err(Error::shape(
                "qmatmul_add_rounding",
                format!("norm weight {} does not match the {} rows", next.shape(), self.rows()),
            ));
        }
        // Decode and short prompts only (the matvec's rows): nothing allocated for a prefill.
        let n = resid.numel() / self.rows().max(1);
        if self.device().gpu().is_none() || !resid.device().same(self.device()) || n > MATVEC_MAX_N {
            return Ok(None);
        }
        let words = Q8Rows::normed_words_for(resid.numel(), self.device())?;
        let nr = NormRounding { weight: next, words: &words };
        match qmatvec_fused(self, x, Epilogue::AddRound(resid, &nr), pro, opts)? {
            Some(h) => {
                let h = h.reshape(resid.shape().clone())?;
                Ok(Some((h.clone(), Q8Rows { x: h, q: words, norm_weight: Some(next.clone()) })))
            }
            None => Ok(None),
        }
    }

    /// Whether a decode product of this matrix after an RMSNorm would read x rounded for the
    /// norm by x's producer ([`RmsNorm::rounded`]) rather than round x in a dispatch of its
    /// own: on a GPU, for a matrix that takes 8-bit x (as [`QTensor::takes_q8_rows`]) whose
    /// product normalises x apart (rows too wide to stage it in every workgroup, or too many
    /// workgroups: the 8B's Q|K|V, gate|up and output head, the 1B's gate|up and head), rows a
    /// multiple of 128 wide. `paired`: the product is `qmatmul_glu_rms` or
    /// `qmatmul_rms_rope_kv` (their epilogues pair rows), else `qmatmul_rms`. A decode step asks
    /// before it runs the product that writes x. `ANYGPU_NORM_ROUNDING=0` says no everywhere
    /// (the rounding dispatches as before, for comparisons).
    pub fn reads_rounded_norm(&self, paired: bool) -> Result<bool> {
        static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let off = *OFF.get_or_init(|| std::env::var("ANYGPU_NORM_ROUNDING").is_ok_and(|v| v == "0"));
        Ok(!off && self.takes_q8_rows() && super::gpu::reads_rounded_norm(self, paired)?)
    }

    /// Whether [`QTensor::qmatmul_add_q8`] reads the rounded rows rather than the f32 ones: on
    /// a GPU, for a matrix that takes Q8 x (marked `CpuMath::Q8`, of a type with Q8 units). A
    /// decode step asks before its attention runs.
    pub fn takes_q8_rows(&self) -> bool {
        self.device().gpu().is_some() && super::gpu::x_q8(self, &QOptions::default())
    }

    /// `resid + x @ W^T` where x is the output of a split attention still in its partials:
    /// x = `a.combine()` [B, H, Tq, D] seen as [B * Tq, H * D] (the heads of a token side by
    /// side, as `permute([0, 2, 1, 3])` + reshape lays them out), resid [B * Tq, rows] (any
    /// shape with that many elements and rows last; the result takes it). The decode step's
    /// output projection: on a GPU, one dispatch whose workgroups each merge the partials
    /// (`attention_combine.wgsl`'s work) into workgroup memory before their products, where
    /// the partials are small enough to re-read per workgroup (SmolLM2: yes; 8B shapes: no, see
    /// `quant::gpu::COMBINE_PROLOGUE_MAX_BYTES`); otherwise (and on the CPU, where there are no
    /// partials) the combine, then [`QTensor::qmatmul_add`].
    pub fn qmatmul_add_combined(&self, a: &AttentionPartials, resid: &Tensor) -> Result<Tensor> {
        const OP: &str = "qmatmul_add_combined";
        let [b, h, tq, d] = a.shape();
        let n = b * tq;
        if !a.part().device().same(self.device()) {
            return Err(Error::mismatch(OP, "the attention partials are not on the weights' device"));
        }
        if h * d != self.cols() {
            return Err(Error::shape(
                OP,
                format!(
                    "attention output [{b}, {h}, {tq}, {d}] does not match weights [{}, {}]",
                    self.rows(),
                    self.cols()
                ),
            ));
        }
        if resid.numel() != n * self.rows() || resid.dims().last() != Some(&self.rows()) || resid.dtype() != DType::F32
        {
            return Err(Error::shape(
                OP,
                format!("residual {} does not match the product [{n}, {}]", resid.shape(), self.rows()),
            ));
        }
        if self.device().gpu().is_some() && resid.device().same(self.device()) {
            let epi = Epilogue::Add(resid);
            if let Some(y) = qmatvec_fused(self, a.part(), epi, Prologue::Combine(a), QOptions::default())? {
                return y.reshape(resid.shape().clone());
            }
        }
        let x = a.combine()?.permute(&[0, 2, 1, 3])?.reshape([n, h * d])?;
        self.qmatmul_add(&x, resid)
    }

    /// Whether [`QTensor::qmatmul_add_combined`] would merge, in its own dispatch (the combine
    /// prologue), the partials that `q.attention_partials(k, v, opts)` makes: asked before the
    /// decode step's attention runs. Where it would not, the whole attention is better: a short
    /// cache is then walked unsplit, a long one split and merged by a dispatch either way. False
    /// on the CPU and where the attention would not split.
    pub fn merges_attention_partials(&self, q: &Tensor, k: &Tensor, v: &Tensor, opts: &AttentionOpts) -> Result<bool> {
        if self.device().gpu().is_none() || !q.device().same(self.device()) || q.rank() != 4 {
            return Ok(false);
        }
        let shape = [q.dims()[0], q.dims()[1], q.dims()[2], q.dims()[3]];
        let splits = gpu_attention_partial_splits(q, k, v, opts)?;
        super::gpu::combine_prologue_takes(self, shape, splits)
    }

    /// `rms_norm(x, norm) @ W^T`.
    pub fn qmatmul_rms(&self, x: &Tensor, norm: RmsNorm<'_>) -> Result<Tensor> {
        const OP: &str = "qmatmul_rms";
        self.check_input(OP, x, false)?;
        if self.device().gpu().is_some() {
            if let Some(y) = qmatvec_fused(self, x, Epilogue::Store, prologue(Some(norm)), QOptions::default())? {
                return Ok(y);
            }
            let n = Some((norm.weight, norm.eps));
            if let Some(y) = super::gpu::qmatmul_coop_epilogue(self, x, Epilogue::Store, n, QOptions::default())? {
                return Ok(y);
            }
        }
        self.qmatmul(&x.rms_norm(Some(norm.weight), norm.eps)?)
    }

    /// SwiGLU over a gate|up stack W [2F, cols]: `silu(x @ W_gate^T) * (x @ W_up^T)`, [.., F].
    pub fn qmatmul_glu(&self, x: &Tensor) -> Result<Tensor> {
        self.qmatmul_glu_opts(x, None, QOptions::default())
    }

    /// [`QTensor::qmatmul_glu`] of `rms_norm(x, norm)`.
    pub fn qmatmul_glu_rms(&self, x: &Tensor, norm: RmsNorm<'_>) -> Result<Tensor> {
        self.qmatmul_glu_opts(x, Some(norm), QOptions::default())
    }

    /// [`QTensor::qmatmul_glu`] (of `rms_norm(x, norm)` if given) with the kernel knobs of
    /// `opts` (tests of the binding split).
    pub fn qmatmul_glu_opts(&self, x: &Tensor, norm: Option<RmsNorm<'_>>, opts: QOptions) -> Result<Tensor> {
        const OP: &str = "qmatmul_glu";
        self.check_input(OP, x, norm.is_none())?;
        if !self.rows().is_multiple_of(2) {
            return Err(Error::shape(OP, format!("a gate|up stack needs an even row count, got {}", self.rows())));
        }
        if self.device().gpu().is_some() {
            if let Some(y) = qmatvec_fused(self, x, Epilogue::Glu, prologue(norm), opts)? {
                return Ok(y);
            }
        }
        let normed;
        let x = match norm {
            Some(n) => {
                // Prefill: the coop kernel's GLU epilogue, the norm applied as x is rounded.
                if self.device().gpu().is_some() {
                    let norm = Some((n.weight, n.eps));
                    if let Some(y) = super::gpu::qmatmul_coop_epilogue(self, x, Epilogue::Glu, norm, opts)? {
                        return Ok(y);
                    }
                }
                normed = x.rms_norm(Some(n.weight), n.eps)?;
                // The norm could not be fused (a wide row): the GLU epilogue still can.
                if self.device().gpu().is_some() {
                    if let Some(y) = qmatvec_fused(self, &normed, Epilogue::Glu, Prologue::None, opts)? {
                        return Ok(y);
                    }
                }
                &normed
            }
            None => x,
        };
        let f = self.rows() / 2;
        let y = match self.device() {
            Device::Gpu(_) => {
                // Prefill: the coop kernel's GLU epilogue, where it runs the product.
                if let Some(y) = super::gpu::qmatmul_coop_epilogue(self, x, Epilogue::Glu, None, opts)? {
                    return Ok(y);
                }
                super::gpu::qmatmul_opts(self, x, opts)?
            }
            Device::Cpu => self.qmatmul(x)?,
        };
        let last = y.rank() - 1;
        y.narrow(last, 0, f)?.silu()?.mul(&y.narrow(last, f, f)?)
    }

    /// The attention input of T tokens x [T, cols] at positions `start_pos..start_pos + T`:
    /// `y = rms_norm(x, norm) @ W^T (+ bias)` over the Q|K|V stack W, seen as [T, H + 2 Hkv, D];
    /// rope of its Q and K heads; K and V written into the caches at those positions. Returns Q
    /// [T, H, D]. Equals `qmatmul_rms`, the bias add and `ops::rope_kv::rope_qkv_store`; on a GPU
    /// for up to `MATVEC_MAX_N` tokens, one dispatch (the matvec kernel's rope epilogue) instead
    /// of two or three.
    pub fn qmatmul_rms_rope_kv(
        &self,
        x: &Tensor,
        norm: RmsNorm<'_>,
        bias: Option<&Tensor>,
        kv: RopeKvStore<'_>,
    ) -> Result<Tensor> {
        const OP: &str = "qmatmul_rms_rope_kv";
        self.check_input(OP, x, false)?;
        let (h, hkv, d) = kv.heads;
        let t = x.numel() / self.cols().max(1);
        let heads = hkv.checked_mul(2).and_then(|k| k.checked_add(h));
        if heads.and_then(|n| n.checked_mul(d)) != Some(self.rows()) {
            return Err(Error::shape(
                OP,
                format!("weights [{}, {}] are not a Q|K|V stack of H {h}, Hkv {hkv}, D {d}", self.rows(), self.cols()),
            ));
        }
        if let Some(b) = bias {
            if b.numel() != self.rows() || b.dtype() != DType::F32 || !b.device().same(self.device()) {
                return Err(Error::shape(
                    OP,
                    format!("bias {} ({}) does not match the {} rows", b.shape(), b.dtype(), self.rows()),
                ));
            }
        }
        check_caches(OP, t, hkv, d, kv.start_pos, kv.k_cache, kv.v_cache)?;
        if !kv.k_cache.device().same(self.device()) {
            return Err(Error::mismatch(OP, "the KV caches are not on the weights' device"));
        }
        let y = if self.device().gpu().is_some() {
            // The rope plan (checks the options) of the [T, Hkv, D] positions written.
            let p = plan(&kv.k_cache.narrow(1, kv.start_pos, t)?.permute(&[1, 0, 2])?, kv.start_pos, kv.rope)?;
            let epi = RopeKvEpilogue {
                h,
                hkv,
                d,
                start_pos: kv.start_pos,
                opts: kv.rope,
                half: p.half,
                theta_scale: p.theta_scale,
                k_cache: kv.k_cache,
                v_cache: kv.v_cache,
                bias,
            };
            if let Some(q) = qmatvec_fused(self, x, Epilogue::RopeKv(&epi), prologue(Some(norm)), QOptions::default())?
            {
                return Ok(q);
            }
            // Prefill: the coop kernel's product, the norm applied as x is rounded (the rope
            // and the KV store follow in a dispatch of their own).
            let n = Some((norm.weight, norm.eps));
            if let Some(y) = super::gpu::qmatmul_coop_epilogue(self, x, Epilogue::Store, n, QOptions::default())? {
                y
            } else {
                // A row too wide for the RMSNorm prologue: the norm runs on its own, the rope
                // epilogue still can.
                let normed = x.rms_norm(Some(norm.weight), norm.eps)?;
                if let Some(q) =
                    qmatvec_fused(self, &normed, Epilogue::RopeKv(&epi), Prologue::None, QOptions::default())?
                {
                    return Ok(q);
                }
                self.qmatmul(&normed)?
            }
        } else {
            self.qmatmul_rms(x, norm)?
        };
        let y = match bias {
            Some(b) => y.add(b)?,
            None => y,
        };
        rope_qkv_store(&y.reshape([t, h + 2 * hkv, d])?, h, kv.start_pos, kv.rope, kv.k_cache, kv.v_cache)
    }
}
