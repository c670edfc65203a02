//! Rope of the stacked Q|K|V projections and the KV-cache store in one op: Q comes back
//! rotated, K (rotated) and V land in the caches at `start_pos..`. On a GPU this is one
//! dispatch (rope_kv.wgsl) where rope + two cache writes took three; on the CPU, and as the
//! reference of the parity tests, it is exactly that composition (`rope` of views, `write_at`).

use super::elementwise::buf;
use super::rope::{plan, RopeOpts, ROPE_MATH_WGSL};
use super::{gpu_of, to_u32};
use crate::error::{Error, Result};
use crate::gpu::{Bind, KernelSpec};
use crate::tensor::{DType, Tensor};

const OP: &str = "rope_kv";

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n: u32,
    units: u32,
    half: u32,
    d: u32,
    h: u32,
    hkv: u32,
    t: u32,
    start_pos: u32,
    neox: u32,
    theta_scale: f32,
    freq_scale: f32,
    zero: u32,
    y_off: u32,
    cap: u32,
    k_off: u32,
    v_off: u32,
}

/// For y [T, H + 2 Hkv, D] (Q|K|V heads of T tokens, f32): rotates Q and K for positions
/// `start_pos..start_pos + T`, writes K and V into `k_cache` / `v_cache` [Hkv, cap, D] (f32,
/// contiguous) at those positions and returns Q rotated, [T, H, D].
pub fn rope_qkv_store(
    y: &Tensor,
    h: usize,
    start_pos: usize,
    opts: &RopeOpts,
    k_cache: &mut Tensor,
    v_cache: &mut Tensor,
) -> Result<Tensor> {
    let dims = y.dims();
    if dims.len() != 3 || dims[1] < h || !(dims[1] - h).is_multiple_of(2) {
        return Err(Error::shape(OP, format!("y must be [T, H + 2 Hkv, D] with H = {h}, got {}", y.shape())));
    }
    let (t, hkv, d) = (dims[0], (dims[1] - h) / 2, dims[2]);
    check_caches(OP, t, hkv, d, start_pos, k_cache, v_cache)?;
    if y.device().gpu().is_some() {
        gpu_rope_qkv_store(y, h, hkv, start_pos, opts, k_cache, v_cache)
    } else {
        let q = y.narrow(1, 0, h)?.rope(start_pos, opts)?;
        let k = y.narrow(1, h, hkv)?.rope(start_pos, opts)?;
        let v = y.narrow(1, h + hkv, hkv)?;
        k_cache.write_at(1, start_pos, &k.permute(&[1, 0, 2])?)?;
        v_cache.write_at(1, start_pos, &v.permute(&[1, 0, 2])?)?;
        Ok(q)
    }
}

/// Checks that `k_cache` and `v_cache` are contiguous f32 [hkv, cap, d] with room for positions
/// `start_pos..start_pos + t`.
pub(crate) fn check_caches(
    op: &'static str,
    t: usize,
    hkv: usize,
    d: usize,
    start_pos: usize,
    k_cache: &Tensor,
    v_cache: &Tensor,
) -> Result<()> {
    for c in [k_cache, v_cache] {
        let cd = c.dims();
        if cd.len() != 3 || cd[0] != hkv || cd[2] != d || c.dtype() != DType::F32 || !c.is_contiguous() {
            return Err(Error::shape(
                op,
                format!("cache {} ({}) is not a contiguous f32 [{hkv}, cap, {d}]", c.shape(), c.dtype()),
            ));
        }
        if start_pos.saturating_add(t) > cd[1] {
            return Err(Error::shape(
                op,
                format!("positions {start_pos}..{} exceed the cache's {}", start_pos.saturating_add(t), cd[1]),
            ));
        }
    }
    if !k_cache.device().same(v_cache.device()) {
        return Err(Error::mismatch(op, "the key and value caches are on different devices"));
    }
    Ok(())
}

fn gpu_rope_qkv_store(
    y: &Tensor,
    h: usize,
    hkv: usize,
    start_pos: usize,
    opts: &RopeOpts,
    k_cache: &Tensor,
    v_cache: &Tensor,
) -> Result<Tensor> {
    let y = y.contiguous()?;
    let p = plan(&y, start_pos, opts)?;
    let ctx = gpu_of(OP, &y)?;
    let q = Tensor::gpu_empty([p.t, h, p.d], DType::F32, y.device())?;
    if y.numel() == 0 {
        return Ok(q);
    }
    let units = p.half + (p.d - 2 * p.half);
    let u = |v: usize| to_u32(OP, v);
    let n = (p.t * (h + 2 * hkv)).checked_mul(units).ok_or_else(|| Error::shape(OP, "too many elements"))?;
    u(k_cache.numel())?;
    let params = Params {
        n: u(n)?,
        units: u(units)?,
        half: u(p.half)?,
        d: u(p.d)?,
        h: u(h)?,
        hkv: u(hkv)?,
        t: u(p.t)?,
        start_pos: u(start_pos)?,
        neox: opts.neox as u32,
        theta_scale: p.theta_scale,
        freq_scale: opts.freq_scale,
        zero: 0,
        y_off: u(y.layout().offset)?,
        cap: u(k_cache.dims()[1])?,
        k_off: u(k_cache.layout().offset)?,
        v_off: u(v_cache.layout().offset)?,
    };
    let (name, divide) = match opts.freq_factors {
        Some(_) => ("rope_kv_ff", "theta = div_rn(theta, ff[i]);"),
        None => ("rope_kv", ""),
    };
    let spec = KernelSpec::new(name, include_str!("rope_kv.wgsl"), "rope_kv").with(ROPE_MATH_WGSL);
    let pipeline = ctx.pipeline(&spec, &[("FREQ_FACTORS", divide)])?;
    let ff = match &opts.freq_factors {
        Some(f) => Some(ctx.upload(bytemuck::cast_slice(f))?),
        None => None,
    };
    let mut binds =
        vec![Bind::Whole(buf(&y)?), Bind::Whole(buf(&q)?), Bind::Whole(buf(k_cache)?), Bind::Whole(buf(v_cache)?)];
    if let Some(b) = &ff {
        binds.push(Bind::Whole(b));
    }
    ctx.dispatch(&pipeline, OP, bytemuck::bytes_of(&params), &binds, ctx.grid_1d(params.n.div_ceil(256)))?;
    Ok(q)
}
