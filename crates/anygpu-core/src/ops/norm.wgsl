// layer_norm and rms_norm over contiguous rows of length C: one workgroup of WG threads per
// row, any C (the threads stride over the row), f32 accumulation.
//
// layer_norm's statistics use Welford's update per thread and Chan's merge across threads:
// E[x^2] - E[x]^2 in f32 would cancel catastrophically for rows with a large mean. The values
// are also shifted by the row's first element K before anything else (x - K is exact for x
// near K), so a large common offset costs no precision in the mean either: the output is
// ((x - K) - mean(x - K)) / std. The row is read twice (statistics, then output).

struct Params {
    rows: u32,
    len: u32,    // C
    x_off: u32,
    w_off: u32,
    b_off: u32,
    has_w: u32,
    has_b: u32,
    eps: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
// Without a weight or bias the x buffer is bound in its place and never read.
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read> b: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

var<workgroup> red_n: array<f32, WG>;
var<workgroup> red_mean: array<f32, WG>;
var<workgroup> red_m2: array<f32, WG>;

fn affine_out(row: u32, j: u32, y: f32) {
    var r = y;
    if (p.has_w != 0u) {
        r = r * w[p.w_off + j];
    }
    if (p.has_b != 0u) {
        r = r + b[p.b_off + j];
    }
    out[row * p.len + j] = r;
}

@compute @workgroup_size(WG)
fn layer_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;
    // Uniform over the workgroup, so the barriers below stay uniform.
    if (row >= p.rows) {
        return;
    }
    let base = p.x_off + row * p.len;
    let shift = x[base];
    var n = 0.0;
    var mean = 0.0;
    var m2 = 0.0;
    for (var j = lid; j < p.len; j = j + WG) {
        let v = x[base + j] - shift;
        n = n + 1.0;
        let d = v - mean;
        mean = mean + d / n;
        m2 = m2 + d * (v - mean);
    }
    red_n[lid] = n;
    red_mean[lid] = mean;
    red_m2[lid] = m2;
    workgroupBarrier();
    for (var k = WG / 2u; k > 0u; k = k / 2u) {
        if (lid < k) {
            // Chan et al.: merge (n_a, mean_a, M2_a) with (n_b, mean_b, M2_b).
            let na = red_n[lid];
            let nb = red_n[lid + k];
            let nt = na + nb;
            if (nb > 0.0) {
                let d = red_mean[lid + k] - red_mean[lid];
                red_mean[lid] = red_mean[lid] + d * (nb / nt);
                red_m2[lid] = red_m2[lid] + red_m2[lid + k] + d * d * (na * nb / nt);
                red_n[lid] = nt;
            }
        }
        workgroupBarrier();
    }
    let row_mean = red_mean[0];
    let inv_std = inverseSqrt(red_m2[0] / f32(p.len) + p.eps);
    for (var j = lid; j < p.len; j = j + WG) {
        affine_out(row, j, ((x[base + j] - shift) - row_mean) * inv_std);
    }
}

@compute @workgroup_size(WG)
fn rms_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.rows) {
        return;
    }
    let base = p.x_off + row * p.len;
    var ss = 0.0;
    for (var j = lid; j < p.len; j = j + WG) {
        let v = x[base + j];
        ss = ss + v * v;
    }
    red_m2[lid] = ss;
    workgroupBarrier();
    for (var k = WG / 2u; k > 0u; k = k / 2u) {
        if (lid < k) {
            red_m2[lid] = red_m2[lid] + red_m2[lid + k];
        }
        workgroupBarrier();
    }
    let inv_rms = inverseSqrt(red_m2[0] / f32(p.len) + p.eps);
    for (var j = lid; j < p.len; j = j + WG) {
        affine_out(row, j, x[base + j] * inv_rms);
    }
}
