//! Rotary position embedding, normal (interleaved pairs) and NeoX (split halves) layouts.
//! CPU reference and WGSL (`rope.wgsl`) side by side.
//!
//! Matches llama.cpp's `ggml_rope_ext` with mode 0 (normal) / 2 (NeoX), `n_dims = rotary_dim`,
//! no YaRN (ext_factor 0, attn_factor 1). x is [.., T, H, D]; row t sits at position
//! `start_pos + t`. For pair i (0 <= i < rotary_dim / 2) the angle is computed in f32 exactly
//! the way ggml's CPU backend does it:
//!
//! ```text
//! theta_scale = powf(base, -2 / rotary_dim)
//! theta_i     = (float) pos, multiplied by theta_scale i times   // pos * theta_scale^i
//! angle_i     = freq_scale * (theta_i / freq_factors[i])
//! ```
//!
//! The angle is never formed as `pos * inv_freq` from a separately rounded `base^(-2i/d)`:
//! starting from the exact f32 position and multiplying keeps the large angles of long
//! positions as accurate as f32 allows, and multiplication is correctly rounded on every WGSL
//! device, so the GPU's angles are the CPU's bit for bit (the freq_factors division is made
//! correctly rounded on the GPU too, see `div_rn` in rope.wgsl, and `opaque` there keeps
//! compilers from contracting a rounded product into an fma). The GPU then reduces the angle
//! modulo pi/2 itself before its own sin/cos polynomials: GPU sin/cos builtins lose accuracy
//! quickly outside [-pi, pi]. Measured GPU vs CPU (lavapipe, H100): ~1e-7 up to position 1e6.
//!
//! The normal layout rotates (x[2i], x[2i+1]), NeoX rotates (x[i], x[i + rotary_dim/2]):
//! `out0 = x0 cos - x1 sin`, `out1 = x0 sin + x1 cos`. Dims >= rotary_dim pass through.

use rayon::prelude::*;

use super::{expect_dtype, gpu_of, to_u32, Dims8, STRIDED_WGSL};
use crate::error::{Error, Result};
use crate::gpu::{Bind, KernelSpec};
use crate::tensor::{CpuStorage, DType, Shape, Tensor};

/// The angle arithmetic of the rope kernels (rope.wgsl, rope_kv.wgsl).
pub(crate) const ROPE_MATH_WGSL: &str = include_str!("rope_math.wgsl");

#[derive(Clone, Debug, PartialEq)]
pub struct RopeOpts {
    /// Frequency base (theta), e.g. 10000 or 500000.
    pub base: f32,
    /// NeoX layout: rotate (x[i], x[i + d/2]) instead of (x[2i], x[2i + 1]).
    pub neox: bool,
    /// Rotated dims per head (the rest pass through); 0 means all of D.
    pub rotary_dim: usize,
    /// Linear position scaling: angle uses `pos * freq_scale` (1.0 = none).
    pub freq_scale: f32,
    /// Optional per-pair frequency divisors [rotary_dim / 2] (llama3's `rope_freqs`).
    pub freq_factors: Option<Vec<f32>>,
}

impl Default for RopeOpts {
    /// base 10000, normal layout, all of D rotated, no scaling.
    fn default() -> Self {
        RopeOpts { base: 10000.0, neox: false, rotary_dim: 0, freq_scale: 1.0, freq_factors: None }
    }
}

/// Validated geometry of one rope call.
pub(crate) struct Plan {
    /// Positions (T), heads (H), head dim (D), rotated pairs (rotary_dim / 2).
    pub(crate) t: usize,
    pub(crate) h: usize,
    pub(crate) d: usize,
    pub(crate) half: usize,
    pub(crate) theta_scale: f32,
}

pub(crate) fn plan(x: &Tensor, start_pos: usize, o: &RopeOpts) -> Result<Plan> {
    const OP: &str = "rope";
    expect_dtype(OP, x, DType::F32)?;
    let dims = x.dims();
    if dims.len() < 3 {
        return Err(Error::shape(OP, format!("x must be [.., T, H, D], got {}", x.shape())));
    }
    let (t, h, d) = (dims[dims.len() - 3], dims[dims.len() - 2], dims[dims.len() - 1]);
    let rd = if o.rotary_dim == 0 { d } else { o.rotary_dim };
    if rd % 2 != 0 || rd > d {
        return Err(Error::shape(OP, format!("rotary_dim {rd} must be even and at most D = {d} (x {})", x.shape())));
    }
    if let Some(ff) = &o.freq_factors {
        if ff.len() != rd / 2 {
            return Err(Error::shape(
                OP,
                format!("freq_factors has {} entries, rotary_dim {rd} needs {}", ff.len(), rd / 2),
            ));
        }
        if let Some(bad) = ff.iter().find(|f| !(f.is_finite() && **f != 0.0)) {
            return Err(Error::shape(OP, format!("freq_factors must be finite and non-zero, got {bad}")));
        }
    }
    if !(o.base.is_finite() && o.base > 0.0 && o.freq_scale.is_finite()) {
        return Err(Error::shape(
            OP,
            format!("base {} and freq_scale {} must be finite, base > 0", o.base, o.freq_scale),
        ));
    }
    // f32 positions are exact up to 2^24, as in ggml (which takes int32 positions to float).
    if start_pos.saturating_add(t) > 1 << 24 {
        return Err(Error::shape(OP, format!("positions {start_pos}..{} exceed 2^24", start_pos.saturating_add(t))));
    }
    let theta_scale = if rd == 0 { 1.0 } else { o.base.powf(-2.0 / rd as f32) };
    Ok(Plan { t, h, d, half: rd / 2, theta_scale })
}

/// (cos, sin) of every pair's angle at position `pos`, computed as ggml's CPU backend does.
fn cos_sin(pos: usize, p: &Plan, o: &RopeOpts) -> Vec<(f32, f32)> {
    let mut theta = pos as f32;
    (0..p.half)
        .map(|i| {
            let mut a = theta;
            if let Some(ff) = &o.freq_factors {
                a /= ff[i];
            }
            a *= o.freq_scale;
            theta *= p.theta_scale;
            let (s, c) = a.sin_cos();
            (c, s)
        })
        .collect()
}

/// Indices of pair i's two elements in a head.
fn pair(i: usize, half: usize, neox: bool) -> (usize, usize) {
    if neox {
        (i, i + half)
    } else {
        (2 * i, 2 * i + 1)
    }
}

pub fn cpu_rope(x: &Tensor, start_pos: usize, opts: &RopeOpts) -> Result<Tensor> {
    let p = plan(x, start_pos, opts)?;
    let c = x.contiguous()?;
    let v = match c.cpu_storage() {
        Some(CpuStorage::F32(v)) => v,
        _ => return Err(Error::mismatch("rope", "expected an f32 tensor on the CPU")),
    };
    let off = c.layout().offset;
    let mut out = v[off..off + x.numel()].to_vec();
    let row = p.h * p.d;
    if row > 0 {
        // One block per (leading index, t): the angles are shared by its H heads.
        out.par_chunks_mut(row).enumerate().for_each(|(blk, xs)| {
            let cs = cos_sin(start_pos + blk % p.t, &p, opts);
            for head in xs.chunks_mut(p.d) {
                for (i, &(cos, sin)) in cs.iter().enumerate() {
                    let (i0, i1) = pair(i, p.half, opts.neox);
                    let (x0, x1) = (head[i0], head[i1]);
                    head[i0] = x0 * cos - x1 * sin;
                    head[i1] = x0 * sin + x1 * cos;
                }
            }
        });
    }
    Ok(Tensor::cpu(CpuStorage::F32(out), Shape(x.dims().to_vec())))
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    n: u32,     // threads: rows * units
    units: u32, // per row (one head of D): half pairs + (D - rotary_dim) pass-through dims
    half: u32,  // rotary_dim / 2
    d: u32,
    h: u32,
    t: u32,
    start_pos: u32,
    neox: u32,
    theta_scale: f32,
    freq_scale: f32,
    rank: u32,
    offset: u32,
    stride_d: u32, // x's stride along D
    zero: u32,     // always 0: an optimisation barrier in rope.wgsl
    _pad: [u32; 2],
    shape: Dims8,
    strides: Dims8,
}

pub fn gpu_rope(x: &Tensor, start_pos: usize, opts: &RopeOpts) -> Result<Tensor> {
    const OP: &str = "rope";
    let p = plan(x, start_pos, opts)?;
    let ctx = gpu_of(OP, x)?;
    let out = Tensor::gpu_empty(x.shape().clone(), DType::F32, x.device())?;
    if out.numel() == 0 {
        return Ok(out);
    }
    to_u32(OP, x.numel())?;
    let rows = x.numel() / p.d;
    let units = p.half + (p.d - 2 * p.half);
    let l = x.layout();
    let params = Params {
        n: to_u32(OP, rows.checked_mul(units).ok_or_else(|| Error::shape(OP, "too many elements"))?)?,
        units: to_u32(OP, units)?,
        half: to_u32(OP, p.half)?,
        d: to_u32(OP, p.d)?,
        h: to_u32(OP, p.h)?,
        t: to_u32(OP, p.t)?,
        start_pos: to_u32(OP, start_pos)?,
        neox: opts.neox as u32,
        theta_scale: p.theta_scale,
        freq_scale: opts.freq_scale,
        rank: l.dims().len() as u32,
        offset: to_u32(OP, l.offset)?,
        stride_d: to_u32(OP, l.strides[l.strides.len() - 1])?,
        zero: 0,
        _pad: [0; 2],
        shape: Dims8::new(OP, l.dims())?,
        strides: Dims8::new(OP, &l.strides)?,
    };
    let (name, divide) = match opts.freq_factors {
        Some(_) => ("rope_ff", "theta = div_rn(theta, ff[i]);"),
        None => ("rope", ""),
    };
    let spec = KernelSpec::new(name, include_str!("rope.wgsl"), "rope").with(STRIDED_WGSL).with(ROPE_MATH_WGSL);
    let pipeline = ctx.pipeline(&spec, &[("FREQ_FACTORS", divide)])?;
    let src = x.gpu_buffer().ok_or_else(|| Error::mismatch(OP, "no GPU buffer"))?;
    let dst = out.gpu_buffer().ok_or_else(|| Error::mismatch(OP, "no GPU buffer"))?;
    let ff = match &opts.freq_factors {
        Some(f) => Some(ctx.upload(bytemuck::cast_slice(f))?),
        None => None,
    };
    let mut binds = vec![Bind::Whole(src), Bind::Whole(dst)];
    if let Some(b) = &ff {
        binds.push(Bind::Whole(b));
    }
    ctx.dispatch(&pipeline, OP, bytemuck::bytes_of(&params), &binds, ctx.grid_1d(params.n.div_ceil(256)))?;
    Ok(out)
}

impl Tensor {
    /// Rotary position embedding of this [.., T, H, D] f32 tensor for positions
    /// `start_pos..start_pos + T` (llama.cpp's `ggml_rope_ext`, see the module docs).
    pub fn rope(&self, start_pos: usize, opts: &RopeOpts) -> Result<Tensor> {
        self.device().backend().rope(self, start_pos, opts)
    }
}
