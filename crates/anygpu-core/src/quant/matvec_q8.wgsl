// The Q8 unit functions of matvec.wgsl (`mv_<type>_q8`) for the 32-weight block types, appended
// when x comes as 8-bit blocks (quantize_q8.wgsl; x_side in gpu.rs binds them as `xq`): a unit
// (b, j) is two integer dot products of four byte pairs (`dot4I8Packed`: one DP4A on NVIDIA)
// instead of eight float FMAs, and reads 8 bytes of x instead of two 16-byte vec4s (which, at
// eight lines per warp load, cost more than the weights' own loads: see BENCHMARKS.md, eighth
// session). H100, parity bench, 57344 x 4096 Q4_0 (GPU µs, one call): 75.9 with f32 x, 61.5
// with Q8 x, its rounding dispatch included; an experiment without that dispatch 47-56, and
// with the same Q8 bytes widened to f32 and multiplied as floats 81-107 (the integer products
// matter as much as the bytes).
//
// x row's words: xq[xb + 8b + k] holds x's bytes 4k..4k+4 of block b; the block's (d, s), s =
// d * sum(q), at `xds`. Sections per type, as in matvec.wgsl.

// @@ q4_0 q4_1 q5_0 q5_1 q8_0
// Block b's (d, s) of the x row whose bytes start at word xb (rows are cols / 4 words of bytes
// and cols / 16 words of (d, s) pairs, so the pairs' row offset is a quarter of the bytes').
fn xds(xb: u32, b: u32) -> vec2<f32> {
    let i = p.xd_off + ((xb - p.x_off) >> 2u) + 2u * b;
    return vec2<f32>(bitcast<f32>(xq[i]), bitcast<f32>(xq[i + 1u]));
}

// @@ q4_0 q5_0
// Bytes of `v` minus `m` (m <= v's bytes' bias, each byte of v < 128), as signed bytes: bit 7 set
// first keeps the subtraction from borrowing across bytes, the XOR clears it again.
fn bytes_minus(v: u32, m: u32) -> u32 {
    return ((v | 0x80808080u) - m) ^ 0x80808080u;
}

// @@ q4_0
fn mv_q4_0_q8(rb: u32, u: u32, xb: u32) -> f32 {
    let b = u >> 2u;
    let j = u & 3u;
    let off = rb + b * 18u;
    let q = u32_at(off + 2u + 4u * j);
    let xi = xb + 8u * b + j;
    let s = dot4I8Packed(bytes_minus(q & 0x0F0F0F0Fu, 0x08080808u), xq[xi])
        + dot4I8Packed(bytes_minus((q >> 4u) & 0x0F0F0F0Fu, 0x08080808u), xq[xi + 4u]);
    return f16_at(off) * xds(xb, b).x * f32(s);
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
    let qh = u32_at(off + 2u);
    let q = u32_at(off + 6u + 4u * j);
    let lo = (q & 0x0F0F0F0Fu) | spread4(qh >> (4u * j));
    let hi = ((q >> 4u) & 0x0F0F0F0Fu) | spread4(qh >> (16u + 4u * j));
    let xi = xb + 8u * b + j;
    let s = dot4I8Packed(bytes_minus(lo, 0x10101010u), xq[xi]) + dot4I8Packed(bytes_minus(hi, 0x10101010u), xq[xi + 4u]);
    return f16_at(off) * xds(xb, b).x * f32(s);
}

// @@ q5_1
fn mv_q5_1_q8(rb: u32, u: u32, xb: u32) -> f32 {
    let b = u >> 2u;
    let j = u & 3u;
    let i = (rb + b * 24u) >> 2u;
    let dm = unpack2x16float(w[i]);
    let qh = w[i + 1u];
    let q = w[i + 2u + j];
    let lo = (q & 0x0F0F0F0Fu) | spread4(qh >> (4u * j));
    let hi = ((q >> 4u) & 0x0F0F0F0Fu) | spread4(qh >> (16u + 4u * j));
    let xi = xb + 8u * b + j;
    let s = dot4I8Packed(lo, xq[xi]) + dot4I8Packed(hi, xq[xi + 4u]);
    let ds = xds(xb, b);
    return dm.x * ds.x * f32(s) + 0.25 * dm.y * ds.y;
}

// @@ q8_0
// Q8_0 unit (b, j): bytes 8j..8j+8 of qs, x words 8b + 2j and 8b + 2j + 1.
fn mv_q8_0_q8(rb: u32, u: u32, xb: u32) -> f32 {
    let b = u >> 2u;
    let j = u & 3u;
    let off = rb + b * 34u;
    let qo = off + 2u + 8u * j;
    let xi = xb + 8u * b + 2u * j;
    let s = dot4I8Packed(u32_at(qo), xq[xi]) + dot4I8Packed(u32_at(qo + 4u), xq[xi + 1u]);
    return f16_at(off) * xds(xb, b).x * f32(s);
}
// @@ end
