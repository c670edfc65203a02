// Rope of Q and K and the KV-cache store, in one dispatch (decode: three dispatches fewer per
// layer). y holds the stacked Q|K|V projections of T tokens, [T, H + 2 Hkv, D] contiguous
// from y_off. Q heads are rotated into `q` [T, H, D]; K heads rotated and V heads copied into
// the caches [Hkv, cap, D] at positions start_pos.. . One thread per rotated pair of one head,
// or per pass-through dim (>= rotary_dim) of it (V heads: every pair and dim passes through).
// The angle is rope.wgsl's, bit for bit (rope_math.wgsl).

struct Params {
    n: u32,        // threads: T * (H + 2 Hkv) * units
    units: u32,    // per head: half pairs + (D - rotary_dim) pass-through dims
    half: u32,     // rotary_dim / 2
    d: u32,
    h: u32,
    hkv: u32,
    t: u32,
    start_pos: u32,
    neox: u32,
    theta_scale: f32,
    freq_scale: f32,
    zero: u32,     // always 0; see opaque()
    y_off: u32,
    cap: u32,      // cache positions
    k_off: u32,    // cache layout offsets
    v_off: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> y: array<f32>;
@group(0) @binding(2) var<storage, read_write> q: array<f32>;
@group(0) @binding(3) var<storage, read_write> kc: array<f32>;
@group(0) @binding(4) var<storage, read_write> vc: array<f32>;
// Bound only when freq_factors are given (the FREQ_FACTORS placeholder divides by them).
@group(0) @binding(5) var<storage, read> ff: array<f32>;

// Writes element e of head `head` of token `tok` to its destination.
fn put(tok: u32, head: u32, e: u32, v: f32) {
    if (head < p.h) {
        q[(tok * p.h + head) * p.d + e] = v;
    } else if (head < p.h + p.hkv) {
        kc[p.k_off + ((head - p.h) * p.cap + p.start_pos + tok) * p.d + e] = v;
    } else {
        vc[p.v_off + ((head - p.h - p.hkv) * p.cap + p.start_pos + tok) * p.d + e] = v;
    }
}

@compute @workgroup_size(256)
fn rope_kv(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let g = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (g >= p.n) {
        return;
    }
    let heads = p.h + 2u * p.hkv;
    let row = g / p.units;
    let u = g % p.units;
    let tok = row / heads;
    let head = row % heads;
    let sb = p.y_off + row * p.d;
    if (u >= p.half) {
        let d = u + p.half; // 2 * half + (u - half)
        put(tok, head, d, y[sb + d]);
        return;
    }
    let i = u;
    var i0 = 2u * i;
    var i1 = 2u * i + 1u;
    if (p.neox != 0u) {
        i0 = i;
        i1 = i + p.half;
    }
    let x0 = y[sb + i0];
    let x1 = y[sb + i1];
    if (head >= p.h + p.hkv) {
        put(tok, head, i0, x0);
        put(tok, head, i1, x1);
        return;
    }
    var theta = f32(p.start_pos + tok);
    for (var j = 0u; j < i; j = j + 1u) {
        theta = theta * p.theta_scale;
    }
    theta = opaque(theta);
    {{FREQ_FACTORS}}
    let sc = sin_cos(opaque(theta * p.freq_scale));
    put(tok, head, i0, x0 * sc.y - x1 * sc.x);
    put(tok, head, i1, x0 * sc.x + x1 * sc.y);
}
