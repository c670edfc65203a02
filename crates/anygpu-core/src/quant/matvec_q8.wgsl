// The Q8 unit functions of matvec.wgsl (`mv_<type>_q8`) for the 32-weight block types and
// Q4_K / Q5_K / Q6_K (whose 32-weight groups, 16-weight for Q6_K's scales, fall inside x's
// blocks), appended when x comes as 8-bit blocks (quantize_q8.wgsl; x_side in gpu.rs binds them
// as `xq`): a 32-weight block's unit (b, j) is two integer dot products of four byte pairs (`dot4I8Packed`: one DP4A on NVIDIA)
// instead of eight float FMAs, and reads 8 bytes of x instead of two 16-byte vec4s (which, at
// eight lines per warp load, cost more than the weights' own loads: see BENCHMARKS.md, eighth
// session). H100, parity bench, 57344 x 4096 Q4_0 (GPU µs, one call): 75.9 with f32 x, 61.5
// with Q8 x, its rounding dispatch included; an experiment without that dispatch 47-56, and
// with the same Q8 bytes widened to f32 and multiplied as floats 81-107 (the integer products
// matter as much as the bytes).
//
// x row's words: xq[xb + 8b + k] holds x's bytes 4k..4k+4 of block b; the block's (d, s), s =
// d * sum(q), at `xds`. Sections per type, as in matvec.wgsl. Q4_0's unit is a whole block
// (`mv_q4_0_q8`: 9 loads per block instead of about 30 for its four word units; H100, 8B Q4_0
// decode, rotating copies of W so that they come from DRAM, GPU µs per product: [28672, 4096]
// 50.7 -> 43.2, [4096, 14336] 33.8 -> 26.3, [4096, 4096] 18.0 -> 15.2; the decode step 3.98 ->
// 3.28 ms).

// @@ q4_0 q4_1 q5_0 q5_1 q8_0 q4k q5k q6k
// Block b's (d, s) of the x row whose bytes start at word xb (rows are cols / 4 words of bytes
// and cols / 16 words of (d, s) pairs, so the pairs' row offset is a quarter of the bytes').
fn xds(xb: u32, b: u32) -> vec2<f32> {
    let i = p.xd_off + ((xb - p.x_off) >> 2u) + 2u * b;
    return vec2<f32>(bitcast<f32>(xq[i]), bitcast<f32>(xq[i + 1u]));
}

// @@ q4_0 q5_0 q6k
// Bytes of `v` minus `m` (m <= v's bytes' bias, each byte of v < 128), as signed bytes: bit 7 set
// first keeps the subtraction from borrowing across bytes, the XOR clears it again.
fn bytes_minus(v: u32, m: u32) -> u32 {
    return ((v | 0x80808080u) - m) ^ 0x80808080u;
}

// @@ q4_0
// Q4_0 unit = a whole block b (`matvec_units`: cols / 32 per row), unlike the other types'
// quant-word units: its 18 bytes come from the five words that hold them (the scale and the four
// quant words shifted out of them where the block starts mid-word; blocks start on even bytes)
// and x's 32 bytes as two 16-byte loads, so 9 loads per 32 weights instead of about 30 for four
// word units (two per misaligned word, the scale's, two x words and the scale pair each). On an
// H100 the word units read W at about half the rate the F16 matvec does (per byte of weights).
fn mv_q4_0_q8(rb: u32, b: u32, xb: u32) -> f32 {
    let off = rb + b * 18u;
    let i = off >> 2u;
    let w0 = w[i];
    let w1 = w[i + 1u];
    let w2 = w[i + 2u];
    let w3 = w[i + 3u];
    let w4 = w[i + 4u];
    // The block starts at byte 0 or 2 of w0: its scale is w0's low or high half, its quant
    // words start 2 bytes on.
    let mid = (off & 2u) == 0u;
    let d = unpack2x16float(select(w0 >> 16u, w0, mid)).x;
    let q = vec4<u32>(
        select(w1, (w0 >> 16u) | (w1 << 16u), mid),
        select(w2, (w1 >> 16u) | (w2 << 16u), mid),
        select(w3, (w2 >> 16u) | (w3 << 16u), mid),
        select(w4, (w3 >> 16u) | (w4 << 16u), mid),
    );
    let xw = xb + 8u * b;
    let lo = x_words4(xw);
    let hi = x_words4(xw + 4u);
    let m = vec4<u32>(0x0F0F0F0Fu);
    let ql = q & m;
    let qh = (q >> vec4<u32>(4u)) & m;
    let s = dot4I8Packed(bytes_minus(ql.x, 0x08080808u), lo.x) + dot4I8Packed(bytes_minus(ql.y, 0x08080808u), lo.y)
        + dot4I8Packed(bytes_minus(ql.z, 0x08080808u), lo.z) + dot4I8Packed(bytes_minus(ql.w, 0x08080808u), lo.w)
        + dot4I8Packed(bytes_minus(qh.x, 0x08080808u), hi.x) + dot4I8Packed(bytes_minus(qh.y, 0x08080808u), hi.y)
        + dot4I8Packed(bytes_minus(qh.z, 0x08080808u), hi.z) + dot4I8Packed(bytes_minus(qh.w, 0x08080808u), hi.w);
    return d * x_block_ds(xb, b).x * f32(s);
}

// @@ q4_0 q8_0 q4k
// Block b's (d, s) of the x row at word xb, as xds reads it, through the one view of x these
// kernels may use (see x_words4): both in one 16-byte load (pairs start at even words).
fn x_block_ds(xb: u32, b: u32) -> vec2<f32> {
    let di = p.xd_off + ((xb - p.x_off) >> 2u) + 2u * b;
    let v = xq4[di >> 2u];
    return bitcast<vec2<f32>>(select(v.xy, v.zw, (di & 2u) != 0u));
}

// @@ q4_0 q8_0 q4k
// x words xw .. xw + 4 through the vec4 view of x (an entry point may use one view of a
// binding, so Q4_0, Q8_0 and Q4_K read every x word through it): one 16-byte load where xw is a multiple of
// 4 (x rows are, when the rounded x starts its binding: every decode step's), else four.
fn x_words4(xw: u32) -> vec4<u32> {
    if ((xw & 3u) == 0u) {
        return xq4[xw >> 2u];
    }
    let e = vec4<u32>(xw, xw + 1u, xw + 2u, xw + 3u);
    return vec4<u32>(xq4[e.x >> 2u][e.x & 3u], xq4[e.y >> 2u][e.y & 3u], xq4[e.z >> 2u][e.z & 3u], xq4[e.w >> 2u][e.w & 3u]);
}

// @@ q4_1
// w = d q + m: the m part meets the block's x sum s (a quarter per unit), as llama.cpp's q8_1.
fn mv_q4_1_q8(rb: u32, u: u32, xb: u32) -> f32 {
    let b = u >> 2u;
    let i = (rb + b * 20u) >> 2u;
    let dm = unpack2x16float(w[i]);
    let q = w[i + 1u + (u & 3u)];
    let xi = xb + 8u * b + (u & 3u);
    // Nibbles 0..15 read the same as signed bytes.
    let s = dot4I8Packed(q & 0x0F0F0F0Fu, xq[xi]) + dot4I8Packed((q >> 4u) & 0x0F0F0F0Fu, xq[xi + 4u]);
    let ds = xds(xb, b);
    return dm.x * ds.x * f32(s) + 0.25 * dm.y * ds.y;
}

// @@ q5_0
fn mv_q5_0_q8(rb: u32, u: u32, xb: u32) -> f32 {
    let b = u >> 2u;
    let j = u & 3u;
    let off = rb + b * 22u;
    let v = q5_bytes(u32_at(off + 6u + 4u * j), u32_at(off + 2u), j);
    let xi = xb + 8u * b + j;
    let s = dot4I8Packed(bytes_minus(v.x, 0x10101010u), xq[xi]) + dot4I8Packed(bytes_minus(v.y, 0x10101010u), xq[xi + 4u]);
    return f16_at(off) * xds(xb, b).x * f32(s);
}

// @@ q5_1
fn mv_q5_1_q8(rb: u32, u: u32, xb: u32) -> f32 {
    let b = u >> 2u;
    let j = u & 3u;
    let i = (rb + b * 24u) >> 2u;
    let dm = unpack2x16float(w[i]);
    let v = q5_bytes(w[i + 2u + j], w[i + 1u], j);
    let xi = xb + 8u * b + j;
    let s = dot4I8Packed(v.x, xq[xi]) + dot4I8Packed(v.y, xq[xi + 4u]);
    let ds = xds(xb, b);
    return dm.x * ds.x * f32(s) + 0.25 * dm.y * ds.y;
}

// @@ q8_0
// Q8_0 unit = a whole block b, as Q4_0's: its 34 bytes from the nine words that hold them (the
// 32 quant bytes shifted out of them where the block starts mid-word), x's 32 bytes as two
// 16-byte loads: 12 loads per block instead of about 36 for four word units.
fn mv_q8_0_q8(rb: u32, b: u32, xb: u32) -> f32 {
    let off = rb + b * 34u;
    let i = off >> 2u;
    let w0 = w[i];
    let a = vec4<u32>(w[i + 1u], w[i + 2u], w[i + 3u], w[i + 4u]);
    let c = vec4<u32>(w[i + 5u], w[i + 6u], w[i + 7u], w[i + 8u]);
    let mid = (off & 2u) == 0u;
    let d = unpack2x16float(select(w0 >> 16u, w0, mid)).x;
    // Quant words: a, c where the block starts at byte 2 of w0; else each word's high half
    // joined with the next word's low half.
    let prev_a = vec4<u32>(w0, a.x, a.y, a.z);
    let prev_c = vec4<u32>(a.w, c.x, c.y, c.z);
    let sh = vec4<u32>(16u);
    let qa = select(a, (prev_a >> sh) | (a << sh), vec4<bool>(mid));
    let qc = select(c, (prev_c >> sh) | (c << sh), vec4<bool>(mid));
    let xw = xb + 8u * b;
    let lo = x_words4(xw);
    let hi = x_words4(xw + 4u);
    let s = dot4I8Packed(qa.x, lo.x) + dot4I8Packed(qa.y, lo.y) + dot4I8Packed(qa.z, lo.z) + dot4I8Packed(qa.w, lo.w)
        + dot4I8Packed(qc.x, hi.x) + dot4I8Packed(qc.y, hi.y) + dot4I8Packed(qc.z, hi.z) + dot4I8Packed(qc.w, hi.w);
    return d * x_block_ds(xb, b).x * f32(s);
}

// ---- k-quants: 32-weight groups of a super-block meet x's 8-bit blocks one to one ----------
// x word i of a row holds the weights 4i.. of that row, as x4[i] does for matvec.wgsl's units.

// @@ q4k q5k
// A Q4_K / Q5_K unit's sum from its integer dot products with the low group's x block (lo,
// block 8b + 2k) and the high group's (hi, 8b + 2k + 1); the min term meets a quarter of each
// block's s (the unit holds 8 of its 32 weights).
fn k_unit_q8(sc: KScales, lo: i32, hi: i32, xb: u32, xblk: u32) -> f32 {
    let dl = xds(xb, xblk);
    let dh = xds(xb, xblk + 1u);
    let dot_q = sc.lo.x * dl.x * f32(lo) + sc.hi.x * dh.x * f32(hi);
    let dot_m = 0.25 * (sc.lo.y * dl.y + sc.hi.y * dh.y);
    return sc.dd.x * dot_q - sc.dd.y * dot_m;
}

// @@ q4k
// Q4_K unit = chunk k of 64 weights of super-block b (`matvec_units`: cols / 64 per row), unlike
// the f32-x kernel's 16-weight units: quant words m = 0..8 of the chunk hold weights 64k + 4m..
// (low nibbles: group 2k, x words xw + m) and 64k + 32 + 4m.. (high nibbles: group 2k + 1, x
// words xw + 8 + m); 17 loads per chunk instead of about 50 for four 16-weight units.
fn mv_q4k_q8(rb: u32, u: u32, xb: u32) -> f32 {
    let b = u >> 2u;
    let k = u & 3u;
    let i = (rb + b * 144u) >> 2u;
    let qi = i + 4u + 8u * k;
    let qa = vec4<u32>(w[qi], w[qi + 1u], w[qi + 2u], w[qi + 3u]);
    let qb = vec4<u32>(w[qi + 4u], w[qi + 5u], w[qi + 6u], w[qi + 7u]);
    let xw = xb + 64u * b + 16u * k;
    let m = vec4<u32>(0x0F0F0F0Fu);
    let sh = vec4<u32>(4u);
    let lo = dot16(qa & m, x_words4(xw)) + dot16(qb & m, x_words4(xw + 4u));
    let hi = dot16((qa >> sh) & m, x_words4(xw + 8u)) + dot16((qb >> sh) & m, x_words4(xw + 12u));
    let sc = k_scales(i, k);
    let dl = x_block_ds(xb, 8u * b + 2u * k);
    let dh = x_block_ds(xb, 8u * b + 2u * k + 1u);
    let dot_q = sc.lo.x * dl.x * f32(lo) + sc.hi.x * dh.x * f32(hi);
    let dot_m = sc.lo.y * dl.y + sc.hi.y * dh.y;
    return sc.dd.x * dot_q - sc.dd.y * dot_m;
}

// @@ q4k
// The integer dot product of 16 byte pairs (four words each).
fn dot16(a: vec4<u32>, b: vec4<u32>) -> i32 {
    return dot4I8Packed(a.x, b.x) + dot4I8Packed(a.y, b.y) + dot4I8Packed(a.z, b.z) + dot4I8Packed(a.w, b.w);
}

// @@ q5k
// Q5_K unit as mv_q4k_q8, with the fifth bits (q5k_bytes).
fn mv_q5k_q8(rb: u32, u: u32, xb: u32) -> f32 {
    let b = u >> 4u;
    let j = u & 15u;
    let k = j >> 2u;
    let i = (rb + b * 176u) >> 2u;
    let v = q5k_bytes(i, j);
    let xw = xb + 64u * b + 16u * k + 2u * (j & 3u);
    let lo = dot4I8Packed(v.x, xq[xw]) + dot4I8Packed(v.y, xq[xw + 1u]);
    let hi = dot4I8Packed(v.z, xq[xw + 8u]) + dot4I8Packed(v.w, xq[xw + 9u]);
    return k_unit_q8(k_scales(i, k), lo, hi, xb, 8u * b + 2u * k);
}

// @@ q6k
// Q6_K unit (b, j) as mv_q6k: run i lies in x block 8b + 4n + i (x words xw + 8i).
fn mv_q6k_q8(rb: u32, u: u32, xb: u32) -> f32 {
    let b = u >> 4u;
    let j = u & 15u;
    let n = j >> 3u;
    let m = j & 7u;
    let off = rb + b * 210u;
    let q = q6k_unit(off, n, m);
    let xw = xb + 64u * b + 32u * n + m;
    let xd = 8u * b + 4u * n;
    let a = vec4<f32>(
        xds(xb, xd).x * f32(dot4I8Packed(bytes_minus(q.v.x, 0x20202020u), xq[xw])),
        xds(xb, xd + 1u).x * f32(dot4I8Packed(bytes_minus(q.v.y, 0x20202020u), xq[xw + 8u])),
        xds(xb, xd + 2u).x * f32(dot4I8Packed(bytes_minus(q.v.z, 0x20202020u), xq[xw + 16u])),
        xds(xb, xd + 3u).x * f32(dot4I8Packed(bytes_minus(q.v.w, 0x20202020u), xq[xw + 24u])),
    );
    return f16_at(off + 208u) * dot(q.sc, a);
}
// @@ end
