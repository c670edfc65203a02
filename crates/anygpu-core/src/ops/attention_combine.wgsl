// Merges the key splits of attention.wgsl (flash-decoding's second pass). Each split wrote,
// per output row, (m, l, acc[D]) with m its row max in the log2 domain, l its sum of
// exp2(s - m) and acc the unnormalised weighted sum of V. Rescaled to the common max M:
//   out = sum_s exp2(m_s - M) acc_s / sum_s exp2(m_s - M) l_s
// One workgroup per output row, in [B, Hq, Tq] order (the partials'): its invocations find M
// and the denominator over the splits together, then each column's sum is split over
// 256 / D groups of splits (D <= 256; wider rows take their columns 256 at a time) and the
// groups' sums meet in workgroup memory. (One invocation per output element walking every
// split, as before, took 33.7 µs for an 8B decode step's 32 rows at 64 splits on an H100:
// each walked 64 dependent steps.) Output row (b, h, i) is written at its strides (attention.rs
// stores it in [B, Tq, Hq, D] order). The decode step's output projection can do this merge
// itself: the combine prologue of quant/matvec.wgsl, see x_side in quant/gpu.rs. ROUND_Q8: the
// rows also rounded to 8-bit blocks for the output projection (`Tensor::attention_q8`), or
// nothing.

struct Params {
    rows: u32,
    d: u32,
    n_splits: u32,
    off: u32, // the partials' first element
    tq: u32,
    hq: u32,
    keys: u32,      // Tk: splits past the first ceil(keys / split_len) hold no keys
    split_len: u32,
    os: vec4<u32>, // the output's strides (b, h, t, d); d is 1
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> part: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

var<workgroup> red: array<f32, 256>;

// The max (is_max) or the sum of every invocation's v, in every invocation (holds barriers).
fn reduce(v: f32, lid: u32, is_max: bool) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s >>= 1u) {
        if (lid < s) {
            red[lid] = select(red[lid] + red[lid + s], max(red[lid], red[lid + s]), is_max);
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

@compute @workgroup_size(256)
fn attention_combine(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.rows) {
        return;
    }
    let stride = p.d + 2u;
    let base = p.off + row * p.n_splits * stride;
    // Only the splits that can hold keys: a decode step's grid has the splits of the cache's
    // capacity, and those past the last key are not written (attention.wgsl returns at once).
    let live = min(p.n_splits, (p.keys + p.split_len - 1u) / p.split_len);
    var m = -1.0e30;
    for (var s = lid; s < live; s += 256u) {
        m = max(m, part[base + s * stride]);
    }
    let mx = reduce(m, lid, true);
    var l = 0.0;
    for (var s = lid; s < live; s += 256u) {
        let b = base + s * stride;
        l += exp2(part[b] - mx) * part[b + 1u];
    }
    let total = reduce(l, lid, false);

    // Invocation lid = g * dc + c0 sums column c0 (+ dc, ...) over the splits s = g mod groups.
    let dc = min(p.d, 256u);
    let groups = 256u / dc;
    let g = lid / dc;
    let c0 = lid % dc;
    let i = row % p.tq;
    let bh = row / p.tq;
    let orow = (bh / p.hq) * p.os.x + (bh % p.hq) * p.os.y + i * p.os.z;
    for (var cb = 0u; cb < p.d; cb += dc) {
        let c = cb + c0;
        var o = 0.0;
        if (g < groups && c < p.d) {
            for (var s = g; s < live; s += groups) {
                let b = base + s * stride;
                o += exp2(part[b] - mx) * part[b + 2u + c];
            }
        }
        red[lid] = o;
        workgroupBarrier();
        if (g == 0u && c < p.d) {
            var sum = 0.0;
            for (var k = 0u; k < groups; k++) {
                sum += red[k * dc + c0];
            }
            out[orow + c] = select(0.0, sum / total, total > 0.0);
        }
        workgroupBarrier();
    }
{{ROUND_Q8}}
}
