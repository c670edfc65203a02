// softmax / log_softmax over contiguous rows: one workgroup of WG threads per row, any row
// length (the threads stride over the row).
//
// Pass 1 reads the row once, each thread keeping an online (max m, sum s of e^(x - m)) pair;
// the pairs are merged in a tree through workgroup memory. Pass 2 reads the row again and
// writes. -inf (masked) inputs are skipped instead of computed with, so no -inf - -inf = NaN
// can arise; s == 0 marks "nothing finite seen", and a row with nothing finite (all -inf, or
// fully masked) gives 0 (softmax) or -inf (log_softmax). -inf is recognised on the bits:
// WGSL lets a compiler assume floats are finite, so `v < -FLT_MAX` could be folded away.

struct Params {
    rows: u32,
    len: u32,    // Tk, the row length
    offset: u32, // input offset in elements
    tq: u32,     // rows per causal block (the second-last dim)
    causal: u32,
    log: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

var<workgroup> red_m: array<f32, WG>;
var<workgroup> red_s: array<f32, WG>;

fn neg_inf() -> f32 {
    return bitcast<f32>(0xff800000u);
}

fn is_neg_inf(v: f32) -> bool {
    return bitcast<u32>(v) == 0xff800000u;
}

// Merges two online-softmax pairs; a pair with s == 0 holds nothing.
fn merge(m1: f32, s1: f32, m2: f32, s2: f32) -> vec2<f32> {
    if (s2 == 0.0) {
        return vec2<f32>(m1, s1);
    }
    if (s1 == 0.0) {
        return vec2<f32>(m2, s2);
    }
    let m = max(m1, m2);
    return vec2<f32>(m, s1 * exp(m1 - m) + s2 * exp(m2 - m));
}

@compute @workgroup_size(WG)
fn softmax_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;
    // Uniform over the workgroup: whole workgroups leave, so the barriers below stay uniform.
    if (row >= p.rows) {
        return;
    }
    let base = p.offset + row * p.len;
    let obase = row * p.len;
    // Causal: query i (row % Tq) sees keys j <= i + (Tk - Tq).
    var visible = p.len;
    if (p.causal != 0u) {
        let v = i32(row % p.tq) + 1 + i32(p.len) - i32(p.tq);
        visible = u32(clamp(v, 0, i32(p.len)));
    }

    var m = neg_inf();
    var s = 0.0;
    for (var j = lid; j < visible; j = j + WG) {
        let v = x[base + j];
        if (is_neg_inf(v)) {
            continue;
        }
        if (s == 0.0) {
            m = v;
            s = 1.0;
        } else if (v > m) {
            s = s * exp(m - v) + 1.0;
            m = v;
        } else {
            s = s + exp(v - m);
        }
    }
    red_m[lid] = m;
    red_s[lid] = s;
    workgroupBarrier();
    for (var k = WG / 2u; k > 0u; k = k / 2u) {
        if (lid < k) {
            let r = merge(red_m[lid], red_s[lid], red_m[lid + k], red_s[lid + k]);
            red_m[lid] = r.x;
            red_s[lid] = r.y;
        }
        workgroupBarrier();
    }
    let row_m = red_m[0];
    let row_s = red_s[0];
    let empty = row_s == 0.0;
    let log_s = log(row_s);
    let inv_s = 1.0 / row_s;
    // What a masked (or -inf) entry becomes.
    let zero = select(0.0, neg_inf(), p.log != 0u);

    for (var j = lid; j < p.len; j = j + WG) {
        var y = zero;
        if (!empty && j < visible) {
            let v = x[base + j];
            if (!is_neg_inf(v)) {
                let d = v - row_m;
                y = select(exp(d) * inv_s, d - log_s, p.log != 0u);
            }
        }
        out[obase + j] = y;
    }
}
