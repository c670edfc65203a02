//! Indexing and layout ops: gather (embedding), index_select, concat, repeat_interleave.
//! CPU reference and WGSL (`index.wgsl`: gather/select/repeat, `index_concat.wgsl`) side by side.
//!
//! All four copy elements bit for bit, so they work for every dtype. On the GPU 2-byte dtypes
//! (f16, bf16) are packed two per u32 word: the `_u16` kernels give each thread whole output
//! words, so no two threads ever write halves of one word.
//!
//! Out-of-range ids are reported as `Error::Index` on every device. The ids are small, so
//! they are always brought to the host and validated there (ids on a GPU are read back, which
//! flushes pending work); the validated ids are then uploaded as u32. The kernels still clamp
//! each id to the table, so even a bad id could never make a GPU read out of bounds.

use super::{gpu_of, to_u32, Dims8, STRIDED_WGSL};
use crate::error::{Error, Result};
use crate::gpu::{Bind, KernelSpec};
use crate::tensor::{CpuStorage, DType, Shape, Tensor};

// ---- shared shape rules -----------------------------------------------------------------

/// The ids as validated u32 indices into a dimension of `len`; `ids` may live on any device.
fn host_ids(op: &'static str, ids: &Tensor, len: usize) -> Result<Vec<u32>> {
    let raw: Vec<i64> = match ids.dtype() {
        DType::U32 => ids.to_vec::<u32>()?.into_iter().map(i64::from).collect(),
        DType::I32 => ids.to_vec::<i32>()?.into_iter().map(i64::from).collect(),
        other => return Err(Error::mismatch(op, format!("ids must be u32 or i32, got {other}"))),
    };
    raw.into_iter()
        .map(|i| match usize::try_from(i) {
            Ok(u) if u < len => Ok(u as u32),
            _ => Err(Error::Index { op, index: i, len }),
        })
        .collect()
}

/// `(outer, dim size, inner)` of `dims` around `dim`.
fn split_at_dim(dims: &[usize], dim: usize) -> (usize, usize, usize) {
    (dims[..dim].iter().product(), dims[dim], dims[dim + 1..].iter().product())
}

fn check_dim(op: &'static str, x: &Tensor, dim: usize) -> Result<()> {
    if dim < x.rank() {
        Ok(())
    } else {
        Err(Error::shape(op, format!("dimension {dim} out of range for shape {}", x.shape())))
    }
}

/// Shape rules of concat: the output shape.
fn concat_shape(xs: &[&Tensor], dim: usize) -> Result<Vec<usize>> {
    const OP: &str = "concat";
    let first = xs.first().ok_or_else(|| Error::shape(OP, "no tensors to concatenate"))?;
    check_dim(OP, first, dim)?;
    let mut out = first.dims().to_vec();
    out[dim] = 0;
    for x in xs {
        if x.dtype() != first.dtype() {
            return Err(Error::mismatch(OP, format!("dtypes differ ({} and {})", first.dtype(), x.dtype())));
        }
        if !x.device().same(first.device()) {
            return Err(Error::mismatch(
                OP,
                format!("tensors on different devices ({} and {})", first.device().name(), x.device().name()),
            ));
        }
        let same_rest = x.rank() == first.rank()
            && x.dims().iter().zip(first.dims()).enumerate().all(|(d, (a, b))| d == dim || a == b);
        if !same_rest {
            return Err(Error::shape(
                OP,
                format!("shapes {} and {} differ outside dimension {dim}", first.shape(), x.shape()),
            ));
        }
        out[dim] = out[dim]
            .checked_add(x.dims()[dim])
            .ok_or_else(|| Error::shape(OP, format!("dimension {dim} overflows")))?;
    }
    Shape::checked_numel(&out)?;
    Ok(out)
}

fn repeat_shape(x: &Tensor, dim: usize, n: usize) -> Result<Vec<usize>> {
    const OP: &str = "repeat_interleave";
    check_dim(OP, x, dim)?;
    let mut out = x.dims().to_vec();
    out[dim] = out[dim]
        .checked_mul(n)
        .ok_or_else(|| Error::shape(OP, format!("{} x {n} overflows on dimension {dim}", x.shape())))?;
    Shape::checked_numel(&out)?;
    Ok(out)
}

// ---- CPU reference ----------------------------------------------------------------------
//
// Every op here builds its output from runs of contiguous source elements: `pieces` lists
// them as (source tensor, start, len), in output order.

/// Concatenates runs of the (contiguous) storages `srcs` into a new storage of their dtype.
fn assemble(op: &'static str, srcs: &[&CpuStorage], pieces: &[(usize, usize, usize)]) -> Result<CpuStorage> {
    macro_rules! gather_runs {
        ($variant:ident) => {{
            let vs = srcs
                .iter()
                .map(|s| match s {
                    CpuStorage::$variant(v) => Ok(v.as_slice()),
                    other => Err(Error::mismatch(op, format!("dtypes differ ({})", other.dtype()))),
                })
                .collect::<Result<Vec<_>>>()?;
            let mut out = Vec::with_capacity(pieces.iter().map(|p| p.2).sum());
            for &(s, start, len) in pieces {
                out.extend_from_slice(&vs[s][start..start + len]);
            }
            CpuStorage::$variant(out)
        }};
    }
    let first = srcs.first().ok_or_else(|| Error::shape(op, "no inputs"))?;
    Ok(match first {
        CpuStorage::F32(_) => gather_runs!(F32),
        CpuStorage::F16(_) => gather_runs!(F16),
        CpuStorage::BF16(_) => gather_runs!(BF16),
        CpuStorage::I32(_) => gather_runs!(I32),
        CpuStorage::U32(_) => gather_runs!(U32),
    })
}

/// A contiguous CPU copy of `x` and the storage offset where its elements start.
fn cpu_contig(op: &'static str, x: &Tensor) -> Result<(Tensor, usize)> {
    if x.cpu_storage().is_none() {
        return Err(Error::mismatch(op, "tensor is not on the CPU"));
    }
    let c = x.contiguous()?;
    let off = c.layout().offset;
    Ok((c, off))
}

fn storage_of<'a>(op: &'static str, t: &'a Tensor) -> Result<&'a CpuStorage> {
    t.cpu_storage().ok_or_else(|| Error::mismatch(op, "tensor is not on the CPU"))
}

/// Slices `ids` of `x` along `dim`; `ids` already validated.
fn cpu_select(op: &'static str, x: &Tensor, dim: usize, ids: &[u32], out_shape: Vec<usize>) -> Result<Tensor> {
    let (c, off) = cpu_contig(op, x)?;
    let (outer, len, inner) = split_at_dim(x.dims(), dim);
    let mut pieces = Vec::with_capacity(outer * ids.len());
    for o in 0..outer {
        for &i in ids {
            pieces.push((0, off + (o * len + i as usize) * inner, inner));
        }
    }
    let s = assemble(op, &[storage_of(op, &c)?], &pieces)?;
    Ok(Tensor::cpu(s, Shape(out_shape)))
}

fn gather_check(table: &Tensor) -> Result<()> {
    if table.rank() != 2 {
        return Err(Error::shape("gather", format!("table must be [V, C], got {}", table.shape())));
    }
    Ok(())
}

fn gather_shape(table: &Tensor, ids: &Tensor) -> Vec<usize> {
    let mut out = ids.dims().to_vec();
    out.push(table.dims()[1]);
    out
}

fn index_select_check(x: &Tensor, dim: usize, ids: &Tensor) -> Result<Vec<usize>> {
    const OP: &str = "index_select";
    check_dim(OP, x, dim)?;
    if ids.rank() != 1 {
        return Err(Error::shape(OP, format!("ids must be [N], got {}", ids.shape())));
    }
    let mut out = x.dims().to_vec();
    out[dim] = ids.numel();
    Ok(out)
}

pub fn cpu_gather(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    gather_check(table)?;
    let idx = host_ids("gather", ids, table.dims()[0])?;
    cpu_select("gather", table, 0, &idx, gather_shape(table, ids))
}

pub fn gpu_gather(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    gather_check(table)?;
    let idx = host_ids("gather", ids, table.dims()[0])?;
    gpu_remap("gather", table, 0, Remap::Select(&idx), gather_shape(table, ids))
}

pub fn cpu_index_select(x: &Tensor, dim: usize, ids: &Tensor) -> Result<Tensor> {
    let out = index_select_check(x, dim, ids)?;
    let idx = host_ids("index_select", ids, x.dims()[dim])?;
    cpu_select("index_select", x, dim, &idx, out)
}

pub fn gpu_index_select(x: &Tensor, dim: usize, ids: &Tensor) -> Result<Tensor> {
    let out = index_select_check(x, dim, ids)?;
    let idx = host_ids("index_select", ids, x.dims()[dim])?;
    gpu_remap("index_select", x, dim, Remap::Select(&idx), out)
}

pub fn cpu_concat(xs: &[&Tensor], dim: usize) -> Result<Tensor> {
    const OP: &str = "concat";
    let out = concat_shape(xs, dim)?;
    let contig = xs.iter().map(|x| cpu_contig(OP, x)).collect::<Result<Vec<_>>>()?;
    let (outer, _, inner) = split_at_dim(&out, dim);
    let mut pieces = Vec::with_capacity(outer * xs.len());
    for o in 0..outer {
        for (s, (x, (_, off))) in xs.iter().zip(&contig).enumerate() {
            let run = x.dims()[dim] * inner;
            pieces.push((s, off + o * run, run));
        }
    }
    let stores = contig.iter().map(|(c, _)| storage_of(OP, c)).collect::<Result<Vec<_>>>()?;
    Ok(Tensor::cpu(assemble(OP, &stores, &pieces)?, Shape(out)))
}

pub fn cpu_repeat_interleave(x: &Tensor, dim: usize, n: usize) -> Result<Tensor> {
    const OP: &str = "repeat_interleave";
    let out = repeat_shape(x, dim, n)?;
    let (c, off) = cpu_contig(OP, x)?;
    let (outer, len, inner) = split_at_dim(x.dims(), dim);
    let mut pieces = Vec::with_capacity(outer * len * n);
    for o in 0..outer {
        for i in 0..len {
            for _ in 0..n {
                pieces.push((0, off + (o * len + i) * inner, inner));
            }
        }
    }
    let s = assemble(OP, &[storage_of(OP, &c)?], &pieces)?;
    Ok(Tensor::cpu(s, Shape(out)))
}

// ---- GPU --------------------------------------------------------------------------------

/// How output coordinate `c` along the remapped dim picks its source coordinate.
enum Remap<'a> {
    /// `ids[c]` (gather, index_select).
    Select(&'a [u32]),
    /// `c / n` (repeat_interleave).
    Repeat(u32),
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct RemapParams {
    n: u32,       // output elements
    rank: u32,    // of the source
    offset: u32,  // source offset in elements
    out_len: u32, // output size along the remapped dim
    inner: u32,   // elements after the remapped dim
    src_len: u32, // source size along the remapped dim
    repeat: u32,
    _pad: u32,
    shape: Dims8,   // source shape
    strides: Dims8, // source strides
}

/// The output `out_shape` whose slice `c` along `dim` is the source's slice `map(c)`.
fn gpu_remap(op: &'static str, x: &Tensor, dim: usize, map: Remap<'_>, out_shape: Vec<usize>) -> Result<Tensor> {
    let ctx = gpu_of(op, x)?;
    let out = Tensor::gpu_empty(out_shape.clone(), x.dtype(), x.device())?;
    let n = to_u32(op, out.numel())?;
    if n == 0 {
        return Ok(out);
    }
    let l = x.layout();
    let (_, src_len, inner) = split_at_dim(x.dims(), dim);
    let params = RemapParams {
        n,
        rank: l.dims().len() as u32,
        offset: to_u32(op, l.offset)?,
        // Not out_shape[dim]: gather's ids may have any shape, flattened here.
        out_len: to_u32(
            op,
            match map {
                Remap::Select(ids) => ids.len(),
                Remap::Repeat(r) => src_len * r as usize,
            },
        )?,
        inner: to_u32(op, inner)?,
        src_len: to_u32(op, src_len)?,
        repeat: if let Remap::Repeat(r) = map { r } else { 1 },
        _pad: 0,
        shape: Dims8::new(op, l.dims())?,
        strides: Dims8::new(op, &l.strides)?,
    };
    let (entry, threads) = match x.dtype().size_in_bytes() {
        4 => ("remap_u32", n),
        _ => ("remap_u16", n.div_ceil(2)),
    };
    let (kind, expr) = match map {
        // The clamp never fires for validated ids; it keeps the kernel in bounds regardless.
        Remap::Select(_) => ("select", "min(ids[c], p.src_len - 1u)"),
        Remap::Repeat(_) => ("repeat", "c / p.repeat"),
    };
    let spec = KernelSpec::new(format!("{entry}_{kind}"), include_str!("index.wgsl"), entry).with(STRIDED_WGSL);
    let pipeline = ctx.pipeline(&spec, &[("MAP", expr)])?;
    let src = x.gpu_buffer().ok_or_else(|| Error::mismatch(op, "no GPU buffer"))?;
    let dst = out.gpu_buffer().ok_or_else(|| Error::mismatch(op, "no GPU buffer"))?;
    let ids_buf = match map {
        Remap::Select(ids) => Some(ctx.upload(bytemuck::cast_slice(ids))?),
        Remap::Repeat(_) => None,
    };
    let mut binds = vec![Bind::Whole(src), Bind::Whole(dst)];
    if let Some(b) = &ids_buf {
        binds.push(Bind::Whole(b));
    }
    ctx.dispatch(&pipeline, op, bytemuck::bytes_of(&params), &binds, ctx.grid_1d(threads.div_ceil(256)))?;
    Ok(out)
}

pub fn gpu_repeat_interleave(x: &Tensor, dim: usize, n: usize) -> Result<Tensor> {
    const OP: &str = "repeat_interleave";
    let out = repeat_shape(x, dim, n)?;
    gpu_remap(OP, x, dim, Remap::Repeat(to_u32(OP, n)?.max(1)), out)
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct ConcatParams {
    n: u32,       // threads: input elements (4-byte) or output words covered (2-byte)
    rank: u32,    // of the input
    offset: u32,  // input offset in elements
    len: u32,     // input size along dim
    inner: u32,   // elements after dim
    out_dim: u32, // output size along dim
    start: u32,   // where this input starts along dim in the output
    out_n: u32,   // output elements
    w0: u32,      // first output word (2-byte)
    _pad: [u32; 3],
    shape: Dims8,   // input shape
    strides: Dims8, // input strides
}

/// One dispatch per input, each writing its slab of the output. Successive dispatches are
/// ordered by wgpu's barriers, so a 2-byte word shared by two inputs is filled by the second
/// dispatch keeping the half the first one wrote.
pub fn gpu_concat(xs: &[&Tensor], dim: usize) -> Result<Tensor> {
    const OP: &str = "concat";
    let out_shape = concat_shape(xs, dim)?;
    let first = xs[0];
    let ctx = gpu_of(OP, first)?;
    let out = Tensor::gpu_empty(out_shape.clone(), first.dtype(), first.device())?;
    let out_n = to_u32(OP, out.numel())?;
    if out_n == 0 {
        return Ok(out);
    }
    let (outer, out_dim, inner) = split_at_dim(&out_shape, dim);
    let two_byte = first.dtype().size_in_bytes() == 2;
    let entry = if two_byte { "concat_u16" } else { "concat_u32" };
    let spec = KernelSpec::new(entry, include_str!("index_concat.wgsl"), entry).with(STRIDED_WGSL);
    let pipeline = ctx.pipeline(&spec, &[])?;
    let dst = out.gpu_buffer().ok_or_else(|| Error::mismatch(OP, "no GPU buffer"))?;
    let mut start = 0usize;
    for x in xs {
        let len = x.dims()[dim];
        let this_start = start;
        start += len;
        if x.numel() == 0 {
            continue;
        }
        let (n, w0) = if two_byte {
            // The output words this input touches: from its first element to its last.
            let first_e = this_start * inner;
            let last_e = (outer - 1) * out_dim * inner + (this_start + len) * inner - 1;
            (last_e / 2 - first_e / 2 + 1, first_e / 2)
        } else {
            (x.numel(), 0)
        };
        let l = x.layout();
        let params = ConcatParams {
            n: to_u32(OP, n)?,
            rank: l.dims().len() as u32,
            offset: to_u32(OP, l.offset)?,
            len: to_u32(OP, len)?,
            inner: to_u32(OP, inner)?,
            out_dim: to_u32(OP, out_dim)?,
            start: to_u32(OP, this_start)?,
            out_n,
            w0: to_u32(OP, w0)?,
            _pad: [0; 3],
            shape: Dims8::new(OP, l.dims())?,
            strides: Dims8::new(OP, &l.strides)?,
        };
        let src = x.gpu_buffer().ok_or_else(|| Error::mismatch(OP, "no GPU buffer"))?;
        ctx.dispatch(
            &pipeline,
            OP,
            bytemuck::bytes_of(&params),
            &[Bind::Whole(src), Bind::Whole(dst)],
            ctx.grid_1d(params.n.div_ceil(256)),
        )?;
    }
    Ok(out)
}

// ---- convenience methods ----------------------------------------------------------------

impl Tensor {
    /// Embedding lookup: rows of this table [V, C] picked by integer `ids` [..] -> [.., C].
    /// `ids` (u32 or i32) may live on any device; an id outside 0..V is an `Error::Index`.
    pub fn gather(&self, ids: &Tensor) -> Result<Tensor> {
        self.device().backend().gather(self, ids)
    }

    /// The slices of this tensor along `dim` picked by integer `ids` [N] (u32 or i32).
    pub fn index_select(&self, dim: usize, ids: &Tensor) -> Result<Tensor> {
        self.device().backend().index_select(self, dim, ids)
    }

    /// Concatenation of `xs` (same dtype and device, equal shapes except along `dim`).
    pub fn concat(xs: &[&Tensor], dim: usize) -> Result<Tensor> {
        let first = xs.first().ok_or_else(|| Error::shape("concat", "no tensors to concatenate"))?;
        first.device().backend().concat(xs, dim)
    }

    /// Repeats every slice along `dim` `n` times in place: `[a, b] -> [a, a, b, b]`.
    pub fn repeat_interleave(&self, dim: usize, n: usize) -> Result<Tensor> {
        self.device().backend().repeat_interleave(self, dim, n)
    }
}
