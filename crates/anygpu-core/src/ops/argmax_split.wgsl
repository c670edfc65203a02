// The argmax of a few long rows (an LLM's logits: 49,152 to 152,064 per row) in two passes.
// One workgroup per row was bound by the latency of its loads, one after another (SmolLM2:
// 21 µs on the H100); here `argmax_partial` spreads each row over `p.groups` workgroups of
// 1,024 elements (four loads per invocation, all in flight at once) and `argmax_final` picks
// among their `p.groups` winners. Ties keep the lowest index (numpy's argmax); NaN never wins.

struct Params {
    rows: u32,
    len: u32,
    offset: u32, // x's first element
    groups: u32, // workgroups per row in the first pass
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
// Per (row, group): the winning value and index of the first pass.
@group(0) @binding(2) var<storage, read_write> part_val: array<f32>;
@group(0) @binding(3) var<storage, read_write> part_idx: array<u32>;
@group(0) @binding(4) var<storage, read_write> ids: array<u32>;

const WG: u32 = 256u;
const NONE: u32 = 0xffffffffu;
var<workgroup> vals: array<f32, WG>;
var<workgroup> idxs: array<u32, WG>;

// As reduce.wgsl's argmax: lanes past the row carry -inf and index NONE, which never win; a
// row of NaN only ends with NONE, as there.
// -inf (a function: naga takes no bitcast in a constant, nor an infinite literal).
fn neg_inf() -> f32 {
    return bitcast<f32>(0xff800000u);
}
fn better(a: f32, ia: u32, b: f32, ib: u32) -> bool {
    return a > b || (a == b && ia < ib);
}

// The workgroup's winner among (vals, idxs), left in slot 0.
fn tree(lid: u32) {
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s && better(vals[lid + s], idxs[lid + s], vals[lid], idxs[lid])) {
            vals[lid] = vals[lid + s];
            idxs[lid] = idxs[lid + s];
        }
        workgroupBarrier();
    }
}

@compute @workgroup_size(256)
fn argmax_partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    // Both entry points use every binding, so one bind group list serves both (layouts are
    // derived per entry point); rows is never 0 here.
    if (p.rows == 0u) {
        ids[0] = 0u;
    }
    let row = wid.y;
    let g = wid.x;
    let base = p.offset + row * p.len;
    let last = p.len - 1u;
    var best = neg_inf();
    var bi = NONE;
    // Four loads issued before any comparison (clamped in bounds; lanes past the row never win).
    let e0 = g * 4u * WG + lid;
    let v0 = x[base + min(e0, last)];
    let v1 = x[base + min(e0 + WG, last)];
    let v2 = x[base + min(e0 + 2u * WG, last)];
    let v3 = x[base + min(e0 + 3u * WG, last)];
    let vs = array<f32, 4>(v0, v1, v2, v3);
    for (var k = 0u; k < 4u; k++) {
        let e = e0 + k * WG;
        let v = select(neg_inf(), vs[k], e < p.len);
        let ie = select(NONE, e, e < p.len);
        if (better(v, ie, best, bi)) {
            best = v;
            bi = ie;
        }
    }
    vals[lid] = best;
    idxs[lid] = bi;
    tree(lid);
    if (lid == 0u) {
        part_val[row * p.groups + g] = vals[0];
        part_idx[row * p.groups + g] = idxs[0];
    }
}

@compute @workgroup_size(256)
fn argmax_final(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    if (p.rows == 0u) {
        ids[0] = u32(x[0]);
    }
    let row = wid.x;
    var best = neg_inf();
    var bi = NONE;
    for (var i = lid; i < p.groups; i += WG) {
        let v = part_val[row * p.groups + i];
        let iv = part_idx[row * p.groups + i];
        if (better(v, iv, best, bi)) {
            best = v;
            bi = iv;
        }
    }
    vals[lid] = best;
    idxs[lid] = bi;
    tree(lid);
    if (lid == 0u) {
        ids[row] = idxs[0];
    }
}
