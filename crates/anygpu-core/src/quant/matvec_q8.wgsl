// The Q8 unit functions of matvec.wgsl (`mv_<type>_q8`) for the 32-weight block types and
// Q4_K / Q5_K / Q6_K (whose 32-weight groups, 16-weight for Q6_K's scales, fall inside x's
// blocks), appended when x comes as 8-bit blocks (quantize_q8.wgsl; x_side in gpu.rs binds them
// as `xq4`): integer dot products of byte pairs (`dot4I8Packed`: one DP4A on NVIDIA) instead of
// float FMAs, and 8-bit x instead of f32 vec4s (which, at eight lines per warp load, cost more
// than the weights' own loads: see BENCHMARKS.md, eighth session). H100, parity bench, 57344 x
// 4096 Q4_0 (GPU µs, one call): 75.9 with f32 x, 61.5 with Q8 x, its rounding dispatch
// included; the same Q8 bytes widened to f32 and multiplied as floats 81-107 (the integer
// products matter as much as the bytes).
//
// Units are larger here than the f32-x kernel's (`matvec_units`): a whole block of the 32-weight
// types, a chunk of 64 weights of the k-quants, whose words are read with as few loads as their
// alignment allows (x's as 16-byte loads). A warp's loads were the bound: about 30 per Q4_0
// block for four word units (two per misaligned word, the scale's, two x words and two for the
// scale pair each), 8 now. H100, 8B Q4_0 decode, rotating copies of W so that they come from
// DRAM, GPU µs per product: [28672, 4096] 50.7 -> 43.2, [4096, 14336] 33.8 -> 26.3, [4096, 4096]
// 18.0 -> 15.2; the decode step 3.98 -> 3.28 ms (BENCHMARKS.md, tenth session).
//
// x row's words: xq4 holds the row's bytes from word xb, block b's at words xb + 8b .. + 8 (so
// x word i holds weights 4i..4i + 4 of the row), and the blocks' (d, s) pairs, s = d * sum(q),
// at `x_block_ds` (sum(q) itself in the low bits of d's word: `x_block`). Sections per type, as
// in matvec.wgsl.

// @@ q4_0
// Q4_0 unit = a whole block b (`matvec_units`: cols / 32 per row), unlike the f32-x kernel's
// quant-word units: its 18 bytes come from the five words that hold them (the scale and the four
// quant words shifted out of them where the block starts on a word, its quant words then
// mid-word; blocks start on even bytes), x's 32 bytes as two 16-byte loads and the (d, s) pair
// as one: 8 loads per 32 weights instead of about 30 for four word units (two per misaligned
// word, the scale's, two x words and the scale pair each). On an H100 the word units read W at
// about half the rate the F16 matvec does (per byte of weights). Not words4_at + f16_at: that
// loads a sixth word for half the blocks (H100, 8B Q4_0 decode step 3.285 -> 3.343 ms).
fn mv_q4_0_q8(rb: u32, b: u32, xb: u32) -> f32 {
    let off = rb + b * 18u;
    let i = off >> 2u;
    let w0 = w[i];
    let a = vec4<u32>(w[i + 1u], w[i + 2u], w[i + 3u], w[i + 4u]);
    let at_word = (off & 2u) == 0u;
    let d = unpack2x16float(select(w0 >> 16u, w0, at_word)).x;
    let prev = vec4<u32>(w0, a.x, a.y, a.z);
    let q = select(a, (prev >> vec4<u32>(16u)) | (a << vec4<u32>(16u)), vec4<bool>(at_word));
    let xw = xb + 8u * b;
    let m = vec4<u32>(0x0F0F0F0Fu);
    // The nibbles as they are (0..15, read the same as signed bytes) and the offset of 8 taken
    // out once, with x's sum(q): sum((q - 8) x) = sum(q x) - 8 sum(x), exactly, in integers
    // (24 fewer operations a block than 8 taken from every byte first).
    let s = dot16(q & m, x_words4(xw)) + dot16((q >> vec4<u32>(4u)) & m, x_words4(xw + 4u));
    let xd = x_block(xb, b);
    return d * xd.d * f32(s - 8 * xd.sum);
}

// @@ q4_0 q4_1 q5_0 q5_1 q8_0 q4k q5k q6k
// Block b's (d, s) of the x row at word xb, through the one view of x these kernels may use
// (see x_words4): both in one 16-byte load (rows are cols / 4 words of bytes, then cols / 16
// words of (d, s) pairs from xd_off, so the pairs' row offset is a quarter of the bytes', and
// pairs start at even words).
fn x_block_ds(xb: u32, b: u32) -> vec2<f32> {
    let v = x_block_words(xb, b);
    return vec2<f32>(d_of(v.x), bitcast<f32>(v.y));
}
// d from its word: the low 13 bits carry sum(q) (round_q8.wgsl, `q8_store`).
fn d_of(word: u32) -> f32 {
    return bitcast<f32>(word & 0xFFFFE000u);
}
fn x_block_words(xb: u32, b: u32) -> vec2<u32> {
    let di = p.xd_off + ((xb - p.x_off) >> 2u) + 2u * b;
    let v = xq4[di >> 2u];
    return select(v.xy, v.zw, (di & 2u) != 0u);
}

// @@ q4_0 q5_0
// Block b's d and sum(q), the sum from the low 13 bits of d's word (round_q8.wgsl, `q8_store`):
// for the types whose offset (Q4_0's 8, Q5_0's 16) is taken out after the products.
struct XBlock {
    d: f32,
    sum: i32,
}
fn x_block(xb: u32, b: u32) -> XBlock {
    let w = x_block_words(xb, b).x;
    return XBlock(d_of(w), bitcast<i32>(w << 19u) >> 19u);
}

// @@ q4_0 q4_1 q5_0 q5_1 q8_0 q4k q5k q6k
// x words xw .. xw + 4 through the vec4 view of x (an entry point may use one view of a
// binding, so every type reads every x word through it): one 16-byte load where xw is a multiple of
// 4 (x rows are, when the rounded x starts its binding: every decode step's), else four.
fn x_words4(xw: u32) -> vec4<u32> {
    if ((xw & 3u) == 0u) {
        return xq4[xw >> 2u];
    }
    let e = vec4<u32>(xw, xw + 1u, xw + 2u, xw + 3u);
    return vec4<u32>(xq4[e.x >> 2u][e.x & 3u], xq4[e.y >> 2u][e.y & 3u], xq4[e.z >> 2u][e.z & 3u], xq4[e.w >> 2u][e.w & 3u]);
}

// @@ q4_1
// Q4_1 unit = a whole block b (20 bytes: five aligned words), as Q4_0's. w = d q + m: the m
// part meets the block's x sum s, as llama.cpp's q8_1.
fn mv_q4_1_q8(rb: u32, b: u32, xb: u32) -> f32 {
    let i = (rb + b * 20u) >> 2u;
    let dm = unpack2x16float(w[i]);
    let q = vec4<u32>(w[i + 1u], w[i + 2u], w[i + 3u], w[i + 4u]);
    let xw = xb + 8u * b;
    let m = vec4<u32>(0x0F0F0F0Fu);
    // Nibbles 0..15 read the same as signed bytes.
    let s = dot16(q & m, x_words4(xw)) + dot16((q >> vec4<u32>(4u)) & m, x_words4(xw + 4u));
    let ds = x_block_ds(xb, b);
    return dm.x * ds.x * f32(s) + dm.y * ds.y;
}

// @@ q5_0 q5_1
// The 5-bit values (0..31, read the same as signed bytes) of a Q5_0 / Q5_1 block's four quant
// words q (high bits qh), a byte each: the low nibbles' (weights 0..16, x words 0..4) and the
// high nibbles' (16..32, x words 4..8). Q5_0's offset of 16 is taken out after the products.
fn q5_block(q: vec4<u32>, qh: u32) -> array<vec4<u32>, 2> {
    let m = vec4<u32>(0x0F0F0F0Fu);
    let hl = vec4<u32>(spread4(qh), spread4(qh >> 4u), spread4(qh >> 8u), spread4(qh >> 12u));
    let hh = vec4<u32>(spread4(qh >> 16u), spread4(qh >> 20u), spread4(qh >> 24u), spread4(qh >> 28u));
    return array<vec4<u32>, 2>((q & m) | hl, ((q >> vec4<u32>(4u)) & m) | hh);
}

// @@ q5_0
// Q5_0 unit = a whole block b (22 bytes from offset 0 or 2 of a word: the quant words through
// words4_at), as Q4_0's.
fn mv_q5_0_q8(rb: u32, b: u32, xb: u32) -> f32 {
    let off = rb + b * 22u;
    let v = q5_block(words4_at(off + 6u), u32_at(off + 2u));
    let xw = xb + 8u * b;
    let s = dot16(v[0], x_words4(xw)) + dot16(v[1], x_words4(xw + 4u));
    let xd = x_block(xb, b);
    return f16_at(off) * xd.d * f32(s - 16 * xd.sum);
}

// @@ q5_1
// Q5_1 unit = a whole block b (24 bytes: six aligned words), as Q4_1's.
fn mv_q5_1_q8(rb: u32, b: u32, xb: u32) -> f32 {
    let i = (rb + b * 24u) >> 2u;
    let dm = unpack2x16float(w[i]);
    let v = q5_block(vec4<u32>(w[i + 2u], w[i + 3u], w[i + 4u], w[i + 5u]), w[i + 1u]);
    let xw = xb + 8u * b;
    let s = dot16(v[0], x_words4(xw)) + dot16(v[1], x_words4(xw + 4u));
    let ds = x_block_ds(xb, b);
    return dm.x * ds.x * f32(s) + dm.y * ds.y;
}

// @@ q8_0
// Q8_0 unit = a whole block b, as Q4_0's: its 32 quant bytes through words4_at twice and its
// scale through f16_at (nine or ten word loads), x's 32 bytes as two 16-byte loads and the (d,
// s) pair as one: 12-13 loads per block instead of about 36 for four word units.
fn mv_q8_0_q8(rb: u32, b: u32, xb: u32) -> f32 {
    let off = rb + b * 34u;
    let xw = xb + 8u * b;
    let s = dot16(words4_at(off + 2u), x_words4(xw)) + dot16(words4_at(off + 18u), x_words4(xw + 4u));
    return f16_at(off) * x_block_ds(xb, b).x * f32(s);
}

// ---- k-quants: 32-weight groups of a super-block meet x's 8-bit blocks one to one ----------
// x word i of a row holds the weights 4i.. of that row, as x4[i] does for matvec.wgsl's units.

// @@ q4k q5k
// A Q4_K / Q5_K chunk's sum from its integer dot products with the low group's x block (lo,
// block xblk) and the high group's (hi, xblk + 1); the mins meet each block's s.
fn k_chunk_q8(sc: KScales, lo: i32, hi: i32, xb: u32, xblk: u32) -> f32 {
    let dl = x_block_ds(xb, xblk);
    let dh = x_block_ds(xb, xblk + 1u);
    let dot_q = sc.lo.x * dl.x * f32(lo) + sc.hi.x * dh.x * f32(hi);
    let dot_m = sc.lo.y * dl.y + sc.hi.y * dh.y;
    return sc.dd.x * dot_q - sc.dd.y * dot_m;
}

// @@ q4k
// Q4_K unit = chunk k of 64 weights of super-block b (`matvec_units`: cols / 64 per row), unlike
// the f32-x kernel's 16-weight units: quant words m = 0..8 of the chunk hold weights 64k + 4m..
// (low nibbles: group 2k, x words xw + m) and 64k + 32 + 4m.. (high nibbles: group 2k + 1, x
// words xw + 8 + m); 18 loads per chunk instead of about 50 for four 16-weight units.
fn mv_q4k_q8(rb: u32, u: u32, xb: u32) -> f32 {
    let b = u >> 2u;
    let k = u & 3u;
    let i = (rb + b * 144u) >> 2u;
    let qi = i + 4u + 8u * k;
    let qa = w4_at(qi);
    let qb = w4_at(qi + 4u);
    let xw = xb + 64u * b + 16u * k;
    let m = vec4<u32>(0x0F0F0F0Fu);
    let sh = vec4<u32>(4u);
    let lo = dot16(qa & m, x_words4(xw)) + dot16(qb & m, x_words4(xw + 4u));
    let hi = dot16((qa >> sh) & m, x_words4(xw + 8u)) + dot16((qb >> sh) & m, x_words4(xw + 12u));
    return k_chunk_q8(k_scales(i, k), lo, hi, xb, 8u * b + 2u * k);
}

// @@ q4_0 q4_1 q5_0 q5_1 q8_0 q4k q5k q6k
// The integer dot product of 16 byte pairs (four words each).
fn dot16(a: vec4<u32>, b: vec4<u32>) -> i32 {
    return dot4I8Packed(a.x, b.x) + dot4I8Packed(a.y, b.y) + dot4I8Packed(a.z, b.z) + dot4I8Packed(a.w, b.w);
}

// @@ q5k
// Q5_K unit = chunk k of 64 weights, as Q4_K's: quant words m = 0..8 of the chunk with the fifth
// bits from qh word m (bit 2k for the low group, 2k + 1 for the high); 26 loads per chunk
// instead of about 60 for four 16-weight units.
fn mv_q5k_q8(rb: u32, u: u32, xb: u32) -> f32 {
    let b = u >> 2u;
    let k = u & 3u;
    let i = (rb + b * 176u) >> 2u;
    let qi = i + 12u + 8u * k;
    let qa = w4_at(qi);
    let qb = w4_at(qi + 4u);
    let s2k = vec4<u32>(2u * k);
    let ha = w4_at(i + 4u) >> s2k;
    let hb = w4_at(i + 8u) >> s2k;
    let m4 = vec4<u32>(0x0F0F0F0Fu);
    let b0 = vec4<u32>(0x01010101u);
    let b1 = vec4<u32>(0x02020202u);
    let sh4 = vec4<u32>(4u);
    let sh3 = vec4<u32>(3u);
    let xw = xb + 64u * b + 16u * k;
    let lo = dot16((qa & m4) | ((ha & b0) << sh4), x_words4(xw)) + dot16((qb & m4) | ((hb & b0) << sh4), x_words4(xw + 4u));
    let hi = dot16(((qa >> sh4) & m4) | ((ha & b1) << sh3), x_words4(xw + 8u))
        + dot16(((qb >> sh4) & m4) | ((hb & b1) << sh3), x_words4(xw + 12u));
    return k_chunk_q8(k_scales(i, k), lo, hi, xb, 8u * b + 2u * k);
}

// @@ q6k
// Q6_K unit = chunk u of 64 weights of super-block b = u / 4 (`matvec_units`: cols / 64 per
// row): half n = (u / 2) % 2, l = 16h .. 16h + 16 for h = u % 2, so its four runs i (weights
// 128n + 32i + l) take q6k_unit's words for m = 4h .. 4h + 4 as runs of four words (ql, ql + 32,
// qh), the four scales of bytes 8n + 2i + h, and x words xw + 8i (x block 8b + 4n + i): about
// 28 loads per 64 weights instead of about 90 for four 16-weight units.
fn mv_q6k_q8(rb: u32, u: u32, xb: u32) -> f32 {
    let b = u >> 2u;
    let n = (u >> 1u) & 1u;
    let h = u & 1u;
    let off = rb + b * 210u;
    let qa = words4_at(off + 64u * n + 16u * h);
    let qb = words4_at(off + 64u * n + 32u + 16u * h);
    let qh = words4_at(off + 128u + 32u * n + 16u * h);
    let so = off + 192u + 8u * n;
    let s0 = u32_at(so);
    let s1 = u32_at(so + 4u);
    let m4 = vec4<u32>(0x0F0F0F0Fu);
    let m2 = vec4<u32>(0x03030303u);
    let c = vec4<u32>(0x20202020u);
    let v0 = (qa & m4) | ((qh & m2) << vec4<u32>(4u));
    let v1 = (qb & m4) | (((qh >> vec4<u32>(2u)) & m2) << vec4<u32>(4u));
    let v2 = ((qa >> vec4<u32>(4u)) & m4) | (((qh >> vec4<u32>(4u)) & m2) << vec4<u32>(4u));
    let v3 = ((qb >> vec4<u32>(4u)) & m4) | (((qh >> vec4<u32>(6u)) & m2) << vec4<u32>(4u));
    let sh = 8u * h;
    let sc = vec4<f32>(
        f32(i8_of((s0 >> sh) & 0xFFu)),
        f32(i8_of((s0 >> (sh + 16u)) & 0xFFu)),
        f32(i8_of((s1 >> sh) & 0xFFu)),
        f32(i8_of((s1 >> (sh + 16u)) & 0xFFu)),
    );
    let xw = xb + 64u * b + 32u * n + 4u * h;
    let xd = 8u * b + 4u * n;
    let a = vec4<f32>(
        x_block_ds(xb, xd).x * f32(dot16(bytes_minus4(v0, c), x_words4(xw))),
        x_block_ds(xb, xd + 1u).x * f32(dot16(bytes_minus4(v1, c), x_words4(xw + 8u))),
        x_block_ds(xb, xd + 2u).x * f32(dot16(bytes_minus4(v2, c), x_words4(xw + 16u))),
        x_block_ds(xb, xd + 3u).x * f32(dot16(bytes_minus4(v3, c), x_words4(xw + 24u))),
    );
    return f16_at(off + 208u) * dot(sc, a);
}

// @@ q5_0 q8_0 q6k
// The four words at byte o (even): four loads where o is a word boundary, else five shifted
// by half a word (branch-free: neighbouring invocations take blocks of either alignment).
fn words4_at(o: u32) -> vec4<u32> {
    let i = o >> 2u;
    let a = vec4<u32>(w[i], w[i + 1u], w[i + 2u], w[i + 3u]);
    let next = vec4<u32>(a.y, a.z, a.w, w[i + 4u]);
    return select(a, (a >> vec4<u32>(16u)) | (next << vec4<u32>(16u)), vec4<bool>((o & 2u) != 0u));
}

// @@ q6k
// The bytes of v minus m's (m <= v's bytes' bias, each byte of v < 128), as signed bytes: bit 7
// set first keeps the subtraction from borrowing across bytes, the XOR clears it again.
fn bytes_minus4(v: vec4<u32>, m: vec4<u32>) -> vec4<u32> {
    let top = vec4<u32>(0x80808080u);
    return ((v | top) - m) ^ top;
}
// @@ end
