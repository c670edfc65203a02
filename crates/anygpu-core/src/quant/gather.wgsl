// Embedding lookup: out[i, :] = dequantized row ids[i] of W. One workgroup per id; each
// invocation expands 8 consecutive weights at a time (deq8), so a workgroup's stores cover 2048
// consecutive floats. Ids were range-checked on the host; rows outside this dispatch's slice of W
// (weights bound in row slices when W exceeds the binding limit) are left to another dispatch.
//
// Assembled by the host with common.wgsl (one type's sections) and `fn deq8(rb, c, cols) -> V8`
// forwarding to the type's expansion.

struct Params {
    cols: u32,
    row_bytes: u32,
    w_off: u32, // byte offset of row r0 inside the weight binding
    n_ids: u32,
    r0: u32,    // first row of W in this dispatch
    rows: u32,  // rows of W in this dispatch
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(256)
fn gather(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = wid.x + wid.y * nwg.x;
    if (i >= p.n_ids) {
        return;
    }
    let id = ids[i];
    if (id < p.r0 || id - p.r0 >= p.rows) {
        return;
    }
    let rb = p.w_off + (id - p.r0) * p.row_bytes;
    let ob = i * p.cols;
    for (var c = lid * 8u; c < p.cols; c += 2048u) {
        let v = deq8(rb, c, p.cols);
        for (var j = 0u; j < 4u; j++) {
            if (c + j < p.cols) {
                out[ob + c + j] = v.lo[j];
            }
            if (c + 4u + j < p.cols) {
                out[ob + c + 4u + j] = v.hi[j];
            }
        }
    }
}
