//! How the matvec kernel (matvec.wgsl) lays out a product's rows: work units per row,
//! invocations per row, output rows per workgroup. The dispatch (gpu.rs) and the rules that
//! judge a product by its workgroup count (the RMSNorm and combine prologues') take them from
//! here, so they agree.

use super::gpu::{Epilogue, QOptions, ROUND_WG, WG};
use super::GgmlType;
use crate::error::{Error, Result};

/// Work units per row of the matvec kernel (see the `mv_*` functions in matvec.wgsl and
/// matvec_q8.wgsl): 4 elements of the plain float types, one quant word of the 32-weight blocks
/// (4 per block) except a whole block with Q8 x (`q8`), 16 weights of the k-quants (16 per
/// super-block) except the 64-weight chunks of Q4_K, Q5_K and Q6_K with Q8 x.
pub(super) fn matvec_units(ty: GgmlType, cols: usize, q8: bool) -> usize {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 if q8 => cols / 32,
        GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K if q8 => cols / 64,
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => cols.div_ceil(4),
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => cols / 8,
        GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => cols / 16,
    }
}

/// Invocations per row: 32 (one warp on NVIDIA), fewer for short rows (about four units each).
/// Measured on an H100 over 8..256 for every type: 32 was best or within a few percent for
/// rows of 4096 weights and 4096 to 32000 rows. A matrix of few rows would then leave most of
/// a large GPU idle (SmolLM2's 576 x 1536 down projection: 72 workgroups for 132 SMs), so the
/// row's invocations double while that gives fewer than `min_groups` workgroups (see
/// [`min_groups`]) and each invocation keeps at least 1.5 units: that product 128 per row, 288
/// workgroups (decode step GPU time 1.106 -> 1.063 ms; 64 per row on the 576-wide rows gained
/// nothing).
fn threads_per_row(units: usize, rows: usize, rps: usize, min_groups: usize) -> usize {
    let mut tpr = units.div_ceil(4).next_power_of_two().clamp(1, 32);
    while tpr < WG && rows.div_ceil(rps * WG / tpr) < min_groups && 2 * units >= 3 * (2 * tpr) {
        tpr *= 2;
    }
    tpr
}

/// The workgroup count below which [`threads_per_row`] spreads a row over more invocations:
/// about a full H100 (132 SMs x 8 resident workgroups of 256), so that enough loads are in
/// flight. H100, tg128 with 256 / 512 / 1024 / 2048 here (same binary, two runs each): 1B F16
/// 605-607 / 630-633 / 669 / 656 tok/s (its 2048-row products: 256 -> 1024 workgroups); 8B
/// Q4_0 203-204 / 203-204 / 202-211 / 208; 1B Q4_0 839 / 880 / 809 +- 48 (one run).
const MATVEC_MIN_GROUPS: usize = 1024;

/// What a product stages before its rows (its prologue, see gpu.rs), which moves the workgroup
/// threshold.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Staging {
    None,
    RmsNorm,
    Combine,
}

/// The workgroup threshold of [`threads_per_row`]. Quantized products with a prologue keep
/// fewer workgroups: every workgroup stages x first, and their rows are short to read, so the
/// staging outweighs the parallelism (and more workgroups would exceed the prologues' limits,
/// leaving a separate rms_norm or attention_combine dispatch). H100, 1B Q4_0 tg128 (19:50,
/// one binary): all at 1024 843.9 / 838.9; the combine prologue's products at 512 857.4; the
/// RMSNorm prologue's at 256 892.5; both 909.5. The same for 1B F16: 689.0 / 689.3 -> 679.5
/// (its longer rows want the workgroups), 8B Q4_0 (4096-wide rows: its norms run apart
/// anyway) unchanged.
fn min_groups(ty: GgmlType, staging: Staging) -> usize {
    match (ty.is_quantized(), staging) {
        (true, Staging::RmsNorm) => 256,
        (true, Staging::Combine) => 512,
        _ => MATVEC_MIN_GROUPS,
    }
}

/// `ANYGPU_MATVEC_TPR=N` (read once): every matvec with N invocations per row (a power of two
/// up to 256), for sweeps.
fn tpr_env() -> Option<usize> {
    static V: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::env::var("ANYGPU_MATVEC_TPR").ok().and_then(|v| v.parse().ok()))
}

/// `ANYGPU_MATVEC_RPS=1|2` (read once): W rows per row slot for every matvec (see
/// [`MatvecLayout`] and [`rows_per_slot`]), for comparisons.
fn rps_env() -> Option<usize> {
    static V: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *V.get_or_init(|| {
        std::env::var("ANYGPU_MATVEC_RPS").ok().and_then(|v| v.parse().ok()).filter(|&v| v == 1 || v == 2)
    })
}

/// W rows per row slot: two for the float types, whose f32 x (16 bytes per 4 weights) is read
/// twice as much as their F16 weights, one for the quantized types. H100, decode step, one row
/// per slot / two (BENCHMARKS.md, fourteenth session): 1B F16 1.202 / 1.132 ms; 8B Q4_0 2.70
/// / 2.77 (2.71 / 2.75 with a Q4_0 unit loading x once by hand for both rows: its products
/// alone gained 0.7-1.5 µs each, the step lost); 1B Q4_0 0.80 / 0.90.
fn rows_per_slot(ty: GgmlType) -> usize {
    rps_env().unwrap_or(if ty.is_quantized() { 1 } else { 2 })
}

/// How the matvec lays out W's rows: `units` work units per row ([`matvec_units`]), `tpr`
/// invocations per row (`opts.threads_per_row` when forced, else [`threads_per_row`]; at most
/// half a workgroup when the epilogue pairs rows over two slots), `rps` W rows per row slot
/// (`opts.rows_per_slot` when forced, else [`rows_per_slot`]; the kernel's RPS: 2 shares each
/// unit's x between two rows, a paired epilogue's two rows or two adjacent ones) and the output
/// rows per workgroup (the kernel's RPW = wg / tpr row slots,
/// two per output row when paired over slots, two output rows per slot with rps 2 unpaired),
/// `wg` invocations per workgroup (the kernel's WGS: [`WG`], or [`ROUND_WG`] under the
/// rounding epilogue, whose workgroups own 32 rows of 32 invocations, one row per slot).
#[derive(Clone, Copy)]
pub(super) struct MatvecLayout {
    pub units: usize,
    pub tpr: usize,
    pub rps: usize,
    pub wg: usize,
    pub out_rows_per_group: usize,
}

impl MatvecLayout {
    /// The layout of a product of `ty` with `units` work units per row.
    pub fn new(
        op: &'static str,
        ty: GgmlType,
        rows: usize,
        units: usize,
        epi: Epilogue<'_>,
        staging: Staging,
        opts: &QOptions,
    ) -> Result<MatvecLayout> {
        if let Epilogue::AddRound(..) = epi {
            return Ok(MatvecLayout { units, tpr: 32, rps: 1, wg: ROUND_WG, out_rows_per_group: ROUND_WG / 32 });
        }
        // Two adjacent rows per slot need an even row count (paired rows always come in twos).
        let rps = match opts.rows_per_slot.unwrap_or_else(|| rows_per_slot(ty)) {
            2 if epi.paired() || rows.is_multiple_of(2) => 2,
            _ => 1,
        };
        let tpr = match opts.threads_per_row.or_else(tpr_env) {
            Some(t) if t.is_power_of_two() && t <= WG => t,
            Some(t) => return Err(Error::shape(op, format!("threads_per_row {t} is not a power of two up to {WG}"))),
            None => threads_per_row(units, rows, rps, min_groups(ty, staging)),
        };
        Ok(match (epi.paired(), rps) {
            (true, 1) => {
                let tpr = tpr.min(WG / 2);
                MatvecLayout { units, tpr, rps, wg: WG, out_rows_per_group: WG / tpr / 2 }
            }
            (true, _) => MatvecLayout { units, tpr, rps, wg: WG, out_rows_per_group: WG / tpr },
            (false, _) => MatvecLayout { units, tpr, rps, wg: WG, out_rows_per_group: rps * WG / tpr },
        })
    }

    /// Workgroups per x row for `out_rows` output rows (pairs of W rows when paired).
    pub fn groups(&self, out_rows: usize) -> usize {
        out_rows.div_ceil(self.out_rows_per_group)
    }
}

/// Output rows of a product of W's `rows` rows: half when the epilogue pairs them.
pub(super) fn paired_out_rows(rows: usize, epi: Epilogue<'_>) -> usize {
    if epi.paired() {
        rows / 2
    } else {
        rows
    }
}
