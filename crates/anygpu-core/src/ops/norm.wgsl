// layer_norm and rms_norm over contiguous rows of length C: one workgroup of WG threads per
// row, any C (the threads stride over the row), f32 accumulation.
//
// layer_norm's statistics use Welford's update per thread and Chan's merge across threads:
// E[x^2] - E[x]^2 in f32 would cancel catastrophically for rows with a large mean. The values
// are also shifted by the row's first element K before anything else (x - K is exact for x
// near K), so a large common offset costs no precision in the mean either: the output is
// ((x - K) - mean(x - K)) / std. The row is read twice (statistics, then output).
//
// add_layer_norm is layer_norm of s = x + r (a post-norm residual), one kernel instead of an
// add and a norm: each element of x and r is read once; the statistics pass parks s (rounded
// to f32, as `add` would) in the output, and the output pass reads it back from there.

struct Params {
    rows: u32,
    len: u32,    // C
    x_off: u32,
    w_off: u32,
    b_off: u32,
    has_w: u32,
    has_b: u32,
    eps: f32,
    r_off: u32, // add_layer_norm's residual
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
// Without a weight or bias the x buffer is bound in its place and never read.
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read> b: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
// add_layer_norm only (after the output, so that the other kernels keep bindings 1-4).
@group(0) @binding(5) var<storage, read> r: array<f32>;

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

// One element v (of this thread's n so far) into its running (n, mean, M2): Welford's update.
fn welford(acc: vec3<f32>, v: f32) -> vec3<f32> {
    let n = acc.x + 1.0;
    let d = v - acc.y;
    let mean = acc.y + d / n;
    return vec3<f32>(n, mean, acc.z + d * (v - mean));
}

// The row's mean and 1 / sqrt(var + eps) from every thread's (n, mean, M2). Called from
// uniform control flow (it has barriers).
fn row_stats(lid: u32, acc: vec3<f32>) -> vec2<f32> {
    red_n[lid] = acc.x;
    red_mean[lid] = acc.y;
    red_m2[lid] = acc.z;
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
    return vec2<f32>(red_mean[0], inverseSqrt(red_m2[0] / f32(p.len) + p.eps));
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
    var acc = vec3<f32>(0.0);
    for (var j = lid; j < p.len; j = j + WG) {
        acc = welford(acc, x[base + j] - shift);
    }
    let st = row_stats(lid, acc);
    for (var j = lid; j < p.len; j = j + WG) {
        affine_out(row, j, ((x[base + j] - shift) - st.x) * st.y);
    }
}

@compute @workgroup_size(WG)
fn add_layer_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.rows) {
        return;
    }
    let xb = p.x_off + row * p.len;
    let rb = p.r_off + row * p.len;
    let ob = row * p.len;
    let shift = x[xb] + r[rb];
    var acc = vec3<f32>(0.0);
    for (var j = lid; j < p.len; j = j + WG) {
        let s = x[xb + j] + r[rb + j];
        // Read back below by this same thread (its own write: no barrier needed).
        out[ob + j] = s;
        acc = welford(acc, s - shift);
    }
    let st = row_stats(lid, acc);
    for (var j = lid; j < p.len; j = j + WG) {
        affine_out(row, j, ((out[ob + j] - shift) - st.x) * st.y);
    }
}

// Four elements per thread per step, their loads issued together (and, on the output side,
// all four loads before the first store: `out` might alias `x` as far as the compiler knows).
// One element per step waited a full load latency per element: a decode step's 4096-wide row
// (one workgroup, 16 elements per thread) took 11-17 us on an H100.
@compute @workgroup_size(WG)
fn rms_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= p.rows) {
        return;
    }
    let base = p.x_off + row * p.len;
    var ss = vec4<f32>(0.0);
    var j = lid;
    for (; j + 3u * WG < p.len; j = j + 4u * WG) {
        let v = vec4<f32>(x[base + j], x[base + j + WG], x[base + j + 2u * WG], x[base + j + 3u * WG]);
        ss = ss + v * v;
    }
    for (; j < p.len; j = j + WG) {
        let v = x[base + j];
        ss.x = ss.x + v * v;
    }
    red_m2[lid] = (ss.x + ss.y) + (ss.z + ss.w);
    workgroupBarrier();
    for (var k = WG / 2u; k > 0u; k = k / 2u) {
        if (lid < k) {
            red_m2[lid] = red_m2[lid] + red_m2[lid + k];
        }
        workgroupBarrier();
    }
    let inv_rms = inverseSqrt(red_m2[0] / f32(p.len) + p.eps);
    j = lid;
    for (; j + 3u * WG < p.len; j = j + 4u * WG) {
        var v = vec4<f32>(x[base + j], x[base + j + WG], x[base + j + 2u * WG], x[base + j + 3u * WG]) * inv_rms;
        if (p.has_w != 0u) {
            v = v * vec4<f32>(w[p.w_off + j], w[p.w_off + j + WG], w[p.w_off + j + 2u * WG], w[p.w_off + j + 3u * WG]);
        }
        let o = row * p.len + j;
        out[o] = v.x;
        out[o + WG] = v.y;
        out[o + 2u * WG] = v.z;
        out[o + 3u * WG] = v.w;
    }
    for (; j < p.len; j = j + WG) {
        affine_out(row, j, x[base + j] * inv_rms);
    }
}
