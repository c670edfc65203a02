// Pass two of the two-pass dot product / sum: one workgroup adds the partials.

struct Params {
    n: u32,
    a_off: u32,
    b_off: u32,
    n_partials: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> parts: array<f32>;
@group(0) @binding(2) var<storage, read_write> result: array<f32>;

const WG: u32 = 256u;
var<workgroup> sums: array<f32, WG>;

@compute @workgroup_size(256)
fn sum_final(@builtin(local_invocation_index) lid: u32) {
    var acc = 0.0;
    for (var i = lid; i < p.n_partials; i = i + WG) {
        acc = acc + parts[i];
    }
    sums[lid] = acc;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s / 2u) {
        if (lid < s) {
            sums[lid] = sums[lid] + sums[lid + s];
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        result[0] = sums[0];
    }
}
