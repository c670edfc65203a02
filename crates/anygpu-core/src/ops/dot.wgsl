// The two-pass dot product. Pass one: each workgroup strides over the vectors and leaves one
// partial sum. Pass two: one workgroup adds the partials. No atomics, deterministic order.

struct Params {
    n: u32,
    a_off: u32,
    b_off: u32,
    n_partials: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> partials: array<f32>;

const WG: u32 = 256u;
var<workgroup> sums: array<f32, WG>;

fn tree_sum(lid: u32) -> f32 {
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s / 2u) {
        if (lid < s) {
            sums[lid] = sums[lid] + sums[lid + s];
        }
        workgroupBarrier();
    }
    return sums[0];
}

@compute @workgroup_size(256)
fn dot_partial(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    var acc = 0.0;
    let stride = nwg.x * WG;
    for (var i = wid.x * WG + lid; i < p.n; i = i + stride) {
        acc = acc + a[p.a_off + i] * b[p.b_off + i];
    }
    sums[lid] = acc;
    let total = tree_sum(lid);
    if (lid == 0u) {
        partials[wid.x] = total;
    }
}
