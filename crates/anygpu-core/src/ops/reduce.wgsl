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
    // Four independent accumulators per invocation, in plain registers: their loads are in
    // flight together. (One long row, e.g. the argmax over a 49,152-token vocabulary in one
    // workgroup, was bound by the latency of one load after another: 49 µs on an H100.
    // Accumulators in an indexed array went to local memory and took longer still.) Lanes past
    // the row read as INIT with index 0xffffffff, which never wins.
    var a0: f32 = {{INIT}};
    var a1: f32 = {{INIT}};
    var a2: f32 = {{INIT}};
    var a3: f32 = {{INIT}};
    var i0 = 0xffffffffu;
    var i1 = 0xffffffffu;
    var i2 = 0xffffffffu;
    var i3 = 0xffffffffu;
    let last = p.len - 1u;
    for (var r = lid; r < p.len; r = r + 4u * WG) {
        let r1 = r + WG;
        let r2 = r + 2u * WG;
        let r3 = r + 3u * WG;
        let v0 = x[base + r * p.inner];
        let v1 = select({{INIT}}, x[base + min(r1, last) * p.inner], r1 < p.len);
        let v2 = select({{INIT}}, x[base + min(r2, last) * p.inner], r2 < p.len);
        let v3 = select({{INIT}}, x[base + min(r3, last) * p.inner], r3 < p.len);
        if ({{IS_SUM}}) {
            a0 = a0 + v0;
            a1 = a1 + v1;
            a2 = a2 + v2;
            a3 = a3 + v3;
        } else {
            if (better(v0, r, a0, i0)) { a0 = v0; i0 = r; }
            if (better(v1, select(0xffffffffu, r1, r1 < p.len), a1, i1)) { a1 = v1; i1 = r1; }
            if (better(v2, select(0xffffffffu, r2, r2 < p.len), a2, i2)) { a2 = v2; i2 = r2; }
            if (better(v3, select(0xffffffffu, r3, r3 < p.len), a3, i3)) { a3 = v3; i3 = r3; }
        }
    }
    var a = a0;
    var a_i = i0;
    if ({{IS_SUM}}) {
        a = (a0 + a1) + (a2 + a3);
    } else {
        if (better(a1, i1, a, a_i)) { a = a1; a_i = i1; }
        if (better(a2, i2, a, a_i)) { a = a2; a_i = i2; }
        if (better(a3, i3, a, a_i)) { a = a3; a_i = i3; }
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
