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
    var acc: f32 = {{INIT}};
    var acc_i: u32 = 0xffffffffu;
    for (var r = lid; r < p.len; r = r + WG) {
        let v = x[base + r * p.inner];
        if ({{IS_SUM}}) {
            acc = acc + v;
        } else if (better(v, r, acc, acc_i)) {
            acc = v;
            acc_i = r;
        }
    }
    vals[lid] = acc;
    idxs[lid] = acc_i;
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
