// The rope + KV-cache store epilogue of matvec.wgsl (`Epilogue::RopeKv` in gpu.rs), appended to
// the kernel's source together with ops/rope_math.wgsl, the angle math of the rope kernels: the
// angles are rope_kv.wgsl's bit for bit.
//
// W is the Q|K|V stack, [(H + 2 Hkv) D, cols]. The workgroup's row slots pair up as under the
// GLU epilogue (slot s of the first half with slot s of the second half) over the two rows that
// one rotation mixes, so the invocation that stores a pair holds both dot products; p.rows
// counts the pairs, (H + 2 Hkv) D / 2. The host declares in EPILOGUE_DECL, after the x side's
// bindings: `kc`, `vc` (the caches, [Hkv, cap, D] from p.k_off / p.v_off), `rope_ff` (the
// freq_factors division, or none) and `rope_bias` (the projections' bias, or zero).

// The elements of a head that pair i mixes: (2i, 2i + 1), or (i, i + rotary_dim / 2) for the
// rotated pairs of the NeoX layout. The pairs from rotary_dim / 2 on (and all of a V head)
// pass through; they pair (2i, 2i + 1) then, which covers the dims from rotary_dim on in both
// layouts.
fn rope_pair(i: u32) -> vec2<u32> {
    if (p.neox != 0u && i < p.half) {
        return vec2<u32>(i, i + p.half);
    }
    return vec2<u32>(2u * i, 2u * i + 1u);
}

// The W row of pair `pair` (over all heads) that a row slot computes: the pair's first element
// in the first half of the slots, its second in the second half.
fn rope_row(pair: u32, second: bool) -> u32 {
    let hd = p.d / 2u;
    let e = rope_pair(pair % hd);
    return (pair / hd) * p.d + select(e.x, e.y, second);
}

// v rotated by pair i's angle at position pos, computed exactly as rope_kv.wgsl does.
fn rope_rotate(v: vec2<f32>, pos: u32, i: u32) -> vec2<f32> {
    var theta = f32(pos);
    for (var j = 0u; j < i; j = j + 1u) {
        theta = theta * p.theta_scale;
    }
    theta = rope_ff(opaque(theta), i);
    let sc = sin_cos(opaque(theta * p.freq_scale));
    return vec2<f32>(v.x * sc.y - v.y * sc.x, v.x * sc.x + v.y * sc.y);
}

// Element e of head `head` of x row (token) xr: a Q head to the output [n, H, D], a K or V head
// into its cache at position start_pos + xr.
fn rope_put(xr: u32, head: u32, e: u32, v: f32) {
    if (head < p.h) {
        out[p.out_off + xr * p.out_stride + head * p.d + e] = v;
    } else if (head < p.h + p.hkv) {
        kc[p.k_off + ((head - p.h) * p.cap + p.start_pos + xr) * p.d + e] = v;
    } else {
        vc[p.v_off + ((head - p.h - p.hkv) * p.cap + p.start_pos + xr) * p.d + e] = v;
    }
}

// Pair `pair` of x row xr, whose two dot products are v: bias added, rotated where it is a
// rotated pair of a Q or K head, stored.
fn rope_store(xr: u32, pair: u32, v: vec2<f32>) {
    let hd = p.d / 2u;
    let head = pair / hd;
    let i = pair % hd;
    let e = rope_pair(i);
    var r = v + rope_bias(head * p.d + e);
    if (head < p.h + p.hkv && i < p.half) {
        r = rope_rotate(r, p.start_pos + xr, i);
    }
    rope_put(xr, head, e.x, r.x);
    rope_put(xr, head, e.y, r.y);
}
