// Reductions. `reduce_axis`: one workgroup per output element reduces `len` values spaced
// `inner` apart (the input viewed as [outer, len, inner]). `dot_partial` + `sum_final`: the
// two-pass dot product / full sum — pass one leaves one partial per workgroup, pass two adds
// the partials in a single workgroup, so no atomics and a deterministic order.

struct Params {
    outer: u32,
    len: u32,
    inner: u32,
    n_out: u32,
    scale: f32,
    offset: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<storage, read_write> out_idx: array<u32>;

const WG: u32 = 256u;
const UNROLL: u32 = 8u;
var<workgroup> vals: array<f32, WG>;
var<workgroup> idxs: array<u32, WG>;

// Combine (value, index) pairs; ties keep the lower index (as numpy's argmax does).
fn better(a: f32, ia: u32, b: f32, ib: u32) -> bool {
    {{BETTER}}
}

@compute @workgroup_size(256)
fn reduce_axis(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let o = wid.x + wid.y * nwg.x;
    if (o >= p.n_out) {
        return;
    }
    let base = p.offset + (o / p.inner) * p.len * p.inner + (o % p.inner);
    // UNROLL independent accumulators per invocation: their loads are in flight together (one
    // long row, e.g. the argmax over a 49,152-token vocabulary in one workgroup, was bound by
    // the latency of one load after another: 49 µs on an H100, ~8 µs unrolled).
    var acc: array<f32, UNROLL>;
    var acc_i: array<u32, UNROLL>;
    for (var u = 0u; u < UNROLL; u++) {
        acc[u] = {{INIT}};
        acc_i[u] = 0xffffffffu;
    }
    for (var r0 = lid; r0 < p.len; r0 = r0 + UNROLL * WG) {
        for (var u = 0u; u < UNROLL; u++) {
            let r = r0 + u * WG;
            if (r < p.len) {
                let v = x[base + r * p.inner];
                if ({{IS_SUM}}) {
                    acc[u] = acc[u] + v;
                } else if (better(v, r, acc[u], acc_i[u])) {
                    acc[u] = v;
                    acc_i[u] = r;
                }
            }
        }
    }
    var a = acc[0];
    var a_i = acc_i[0];
    for (var u = 1u; u < UNROLL; u++) {
        if ({{IS_SUM}}) {
            a = a + acc[u];
        } else if (better(acc[u], acc_i[u], a, a_i)) {
            a = acc[u];
            a_i = acc_i[u];
        }
    }
    vals[lid] = a;
    idxs[lid] = a_i;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s / 2u) {
        if (lid < s) {
            if ({{IS_SUM}}) {
                vals[lid] = vals[lid] + vals[lid + s];
            } else if (better(vals[lid + s], idxs[lid + s], vals[lid], idxs[lid])) {
                vals[lid] = vals[lid + s];
                idxs[lid] = idxs[lid + s];
            }
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        out[o] = vals[0] * p.scale;
        out_idx[o] = idxs[0];
    }
}
