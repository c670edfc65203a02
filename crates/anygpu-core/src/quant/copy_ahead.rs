//! The prefill's f16 copies (dequant_f16.rs) made while an earlier, longer product runs,
//! instead of right before their own product.
//!
//! Why: a copy streams memory while a long coop product is bound by its staging and tensor
//! cores, so the two can share the GPU. Inside a compute pass wgpu puts a barrier before a
//! dispatch that uses a buffer an earlier dispatch of the pass wrote (or writes one it used),
//! and a barrier waits for all earlier work; the barriers a pass needs at its start it records
//! before the pass. So the product that hosts copies begins a new pass (it waited for its
//! inputs anyway), and the copies follow it, into buffers the pass has not used: they run
//! beside it, and the barrier before the next dependent dispatch waits for all of them.
//! (A submit instead of a new pass cost more than the copies saved: H100, 8B Q4_0 pp512 ~9,600
//! against ~10,300 with 128 submits per prefill.)
//!
//! How much of a copy hides depends on the product beside it and on what else runs, and the
//! parts do not add up: alone (H100, `copy_beside_product` in parity_qmatmul) the gate|up
//! copy hid 79-89% beside a Q|K|V product and 24-39% beside a down projection, the down
//! projection's copy 48-52% beside a gate|up-sized product; in the 8B model the placement of
//! `AHEAD_RATIO` gained ~3% (pp512 10,262-10,411 -> 10,629-10,764: ~1.8 ms of the copies'
//! 7.9 in a 49.7 ms prefill), the gate|up copy beside Q|K|V less.
//!
//! The model says in which order its products read their weights ([`CopyAhead::begin`], for
//! one forward pass on this thread); a product whose copy was not made ahead (the first one,
//! or weights out of that order) makes its own as before. The copy is the same either way.

use std::cell::{Cell, RefCell};
use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};

use super::gpu::{kernel_for, QKernel, QOptions};
use super::{QStorage, QTensor};
use crate::error::Result;
use crate::gpu::{GpuBuffer, GpuContext};

thread_local! {
    static SCHEDULE: RefCell<Option<Schedule>> = const { RefCell::new(None) };
    static TAKEN: Cell<usize> = const { Cell::new(0) };
}

/// Copies made ahead that products on this thread have taken so far (for tests).
#[doc(hidden)]
pub fn copies_taken_ahead() -> usize {
    TAKEN.with(Cell::get)
}

/// Copies made ahead on this thread and not yet taken (for tests).
#[doc(hidden)]
pub fn copies_waiting() -> usize {
    SCHEDULE.with(|s| s.borrow().as_ref().map_or(0, |s| s.ready.len()))
}

/// One forward pass's products in order, and the copies made ahead for the next ones.
struct Schedule {
    n: usize,
    order: Vec<QTensor>,
    /// Where the search for the next product starts (the one after the last found).
    cursor: usize,
    /// For each product, the earlier one beside which its copy is made (see [`hosts`]):
    /// worked out at the first product that asks.
    host: Option<Vec<Option<usize>>>,
    /// Copies made ahead and not yet taken: (weights, copy).
    ready: Vec<(QTensor, QTensor)>,
}

/// `ANYGPU_COPY_AHEAD=0` (read once): every copy made right before its product, for comparisons.
fn enabled() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| std::env::var("ANYGPU_COPY_AHEAD").map_or(true, |v| v != "0"))
}

/// While alive, the products of `n` x rows on this thread make later scheduled products' f16
/// copies as they run (see the module docs). Dropping it drops copies made ahead and not used.
pub struct CopyAhead {
    active: bool,
    _thread: PhantomData<*const ()>,
}

impl CopyAhead {
    /// Schedules the products of one forward pass of `n` x rows: `order` (called only where an
    /// f16 copy can pay at this `n`) lists their weights in the order the pass multiplies by
    /// them.
    pub fn begin(n: usize, order: impl FnOnce() -> Vec<QTensor>) -> CopyAhead {
        let active = enabled() && super::dequant_f16::may_pay(n);
        if active {
            let schedule = Schedule { n, order: order(), cursor: 0, host: None, ready: Vec::new() };
            SCHEDULE.with(|s| *s.borrow_mut() = Some(schedule));
        }
        CopyAhead { active, _thread: PhantomData }
    }
}

impl Drop for CopyAhead {
    fn drop(&mut self) {
        if self.active {
            SCHEDULE.with(|s| s.borrow_mut().take());
        }
    }
}

/// A matrix's weights: the size its f16 copy takes, in halves.
fn weights(q: &QTensor) -> usize {
    q.rows() * q.cols()
}

/// Whether two matrices are the same weights on the same GPU buffer.
fn same(a: &QTensor, b: &QTensor) -> bool {
    match (a.storage(), b.storage()) {
        (QStorage::Gpu(x), QStorage::Gpu(y)) => {
            Arc::ptr_eq(x, y) && a.ggml_type() == b.ggml_type() && a.rows() == b.rows() && a.cols() == b.cols()
        }
        _ => false,
    }
}

/// The copy of `w` made ahead, if there is one.
pub(super) fn take(w: &QTensor) -> Option<QTensor> {
    SCHEDULE.with(|s| {
        let mut s = s.borrow_mut();
        let s = s.as_mut()?;
        let i = s.ready.iter().position(|(src, _)| same(src, w))?;
        TAKEN.with(|t| t.set(t.get() + 1));
        Some(s.ready.swap_remove(i).1)
    })
}

/// Weights whose copies a product hosts: at most this many times its own. A product of W
/// weights at n = 512 takes ~5x as long as W's copy alone (H100, Q4_0 [28672, 4096]: 623 µs
/// against 122), so the copies beside it would take ~60% of it alone. Over a llama layer this
/// puts the next Q|K|V's and gate|up's copies beside the down projection, the down
/// projection's beside the gate|up product and the output projection's beside Q|K|V. H100, 8B
/// Q4_0 pp512 (BENCHMARKS.md, twenty-eighth session): 10,381 / 10,411 tok/s with every copy
/// made before its product, 10,628 / 10,504 with 2 (no gate|up copy ahead), 10,764 / 10,711
/// with 3, 10,453 / 10,363 with 6 (the gate|up copy beside Q|K|V instead).
const AHEAD_RATIO: usize = 3;

/// Where each product's copy is made: beside the latest earlier product whose weights, times
/// [`AHEAD_RATIO`], still cover it beside the copies already placed there, so that a copy is
/// made as late as it can hide; `None` (made right before its own product) where the search
/// meets a product of the same size first (two copies of one size alive at once would need a
/// second pooled buffer of that size) or finds no room. Only products whose copy pays
/// (`pays`) host or get one.
fn hosts(order: &[QTensor], pays: impl Fn(&QTensor) -> bool) -> Vec<Option<usize>> {
    let paying: Vec<bool> = order.iter().map(&pays).collect();
    let mut room: Vec<usize> = order.iter().map(|q| AHEAD_RATIO * weights(q)).collect();
    let mut host = vec![None; order.len()];
    for j in 0..order.len() {
        if !paying[j] {
            continue;
        }
        let size = weights(&order[j]);
        for k in (0..j).rev() {
            if weights(&order[k]) == size {
                break;
            }
            if paying[k] && room[k] >= size {
                room[k] -= size;
                host[j] = Some(k);
                break;
            }
        }
    }
    host
}

/// The products whose f16 copies are made while `w`'s product runs ([`hosts`]), each with a
/// new buffer for its copy (`opts`: this product's): the caller ends the compute pass, records
/// the product of `w`, then the copies ([`fill_ahead`]). None where `w` is not scheduled or
/// no room is left.
pub(super) fn plan_after(w: &QTensor, ctx: &Arc<GpuContext>, opts: &QOptions) -> Vec<(QTensor, GpuBuffer)> {
    if ctx.recording_here() {
        return Vec::new(); // a recording replays its dispatches as recorded
    }
    let next = SCHEDULE.with(|s| {
        let mut s = s.borrow_mut();
        let Some(s) = s.as_mut() else { return Vec::new() };
        let len = s.order.len();
        let Some(at) = (0..len).map(|i| (s.cursor + i) % len).find(|&i| same(&s.order[i], w)) else {
            return Vec::new();
        };
        s.cursor = at + 1;
        let n = s.n;
        let host = s.host.get_or_insert_with(|| {
            // The later products take the kernel forced on this one, if any.
            let kernel_opts = QOptions { kernel: opts.kernel, ..QOptions::default() };
            hosts(&s.order, |q| {
                kernel_for(ctx, q.ggml_type(), n, &kernel_opts) == QKernel::Coop
                    && super::dequant_f16::pays(q.ggml_type(), n, weights(q))
            })
        });
        // Never a second copy of a size alive, even where a copy made ahead was not taken
        // (its product read none after all, or ran out of order): the memory stays the pool's
        // one buffer per size.
        let mut alive: Vec<usize> = s.ready.iter().map(|(src, _)| weights(src)).collect();
        alive.push(weights(w));
        let mut next = Vec::new();
        for j in (at + 1..len).filter(|&j| host[j] == Some(at)) {
            if !alive.contains(&weights(&s.order[j])) {
                alive.push(weights(&s.order[j]));
                next.push(s.order[j].clone());
            }
        }
        next
    });
    // Where the device has no room (or the weights cannot be copied), the rest are made
    // before their products, which try again.
    let mut out = Vec::with_capacity(next.len());
    for q in next {
        let Ok(Some(buf)) = super::dequant_f16::copy_buffer(&q) else { break };
        out.push((q, buf));
    }
    out
}

/// Records the copy of `w` into `buf` (from [`plan_after`]) and keeps it for its product.
pub(super) fn fill_ahead(w: QTensor, buf: GpuBuffer, opts: &QOptions) -> Result<()> {
    let copy = super::dequant_f16::fill(&w, buf, opts)?;
    SCHEDULE.with(|s| {
        if let Some(s) = s.borrow_mut().as_mut() {
            s.ready.push((w, copy));
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{hosts, AHEAD_RATIO};
    use crate::quant::{GgmlType, QTensor};
    use crate::Device;

    fn matrix(ty: GgmlType, rows: usize) -> QTensor {
        let bytes = ty.byte_size(rows as u64 * 32).unwrap() as usize;
        QTensor::from_vec(ty, rows, 32, vec![0u8; bytes], &Device::Cpu).unwrap()
    }

    /// Two llama layers with the 8B's proportions (Q|K|V 24, output 16, gate|up 112, down 56
    /// rows): the placement the AHEAD_RATIO docs describe.
    #[test]
    fn copies_go_beside_the_latest_product_with_room() {
        assert_eq!(AHEAD_RATIO, 3, "the expectations below assume a ratio of 3");
        let order: Vec<QTensor> = [24, 16, 112, 56, 24, 16, 112, 56].map(|r| matrix(GgmlType::Q4_0, r)).into();
        let host = hosts(&order, |_| true);
        // The first gate|up finds no room (Q|K|V hosts the output projection's copy already).
        assert_eq!(host, [None, Some(0), None, Some(2), Some(3), Some(4), Some(3), Some(6)]);
    }

    /// A product whose copy does not pay neither gets one nor hosts any (the down projection's
    /// copy goes beside Q|K|V), and the search for a host stops at a product of the same size
    /// (the last one, whose copy would be alive beside the one before's).
    #[test]
    fn hosts_pay_and_differ_in_size() {
        let order: Vec<QTensor> = vec![
            matrix(GgmlType::Q4_0, 24),
            matrix(GgmlType::Q4_0, 16),
            matrix(GgmlType::F16, 112),
            matrix(GgmlType::Q4_0, 56),
            matrix(GgmlType::Q4_0, 56),
        ];
        let host = hosts(&order, |q| q.ggml_type().is_quantized());
        assert_eq!(host, [None, Some(0), None, Some(0), None]);
    }
}
