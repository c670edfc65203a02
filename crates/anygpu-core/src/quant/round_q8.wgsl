// Rounding to 8-bit blocks of 32 in the layout the Q8 matvec reads (matvec_q8.wgsl): an x
// row's bytes, four to a word in order, then the blocks' (d, s) as f32 bits, with
// d = max|x| / 127 and s = d * sum(q) rounded to f16 values (`f16_round`),
// q = round_half_even(x * 127 / max|x|): the CPU's Q8 path (q8.rs) and llama.cpp's
// quantize_row_q8_1; sum(q) itself in d's low bits (`q8_store`). Shared by
// quantize_q8.wgsl and by the kernels that also write their output rounded for the next
// product (the decode attention and its split merge: ops/attention.rs, `Tensor::attention_q8`).
// Needs a binding `xq: array<u32>` (read_write).

// This invocation's four elements v of a block whose largest magnitude is amax.
fn q8_round(v: vec4<f32>, amax: f32) -> vec4<i32> {
    let id = select(0.0, 127.0 / amax, amax != 0.0);
    // WGSL's round() breaks ties to even, as the CPU's round_ties_even.
    return clamp(vec4<i32>(round(v * id)), vec4<i32>(-127), vec4<i32>(127));
}

// Stores four rounded elements q at word `word`, and from the block's first invocation (`first`)
// the block's (d, s) at words ds_word, ds_word + 1 (sum: the block's sum of q). d is an f16
// value, so the low 13 bits of its f32 word are zero: they carry sum(q) (-4064..4064, two's
// complement), which the Q4_0 product needs exactly (matvec_q8.wgsl, `x_block`); readers mask
// them off d.
fn q8_store(q: vec4<i32>, amax: f32, sum: f32, word: u32, ds_word: u32, first: bool) {
    xq[word] = pack4xI8(q);
    if (first) {
        let d = amax / 127.0;
        xq[ds_word] = bitcast<u32>(f16_round(d)) | (bitcast<u32>(i32(sum)) & 0x1FFFu);
        xq[ds_word + 1u] = bitcast<u32>(f16_round(d * sum));
    }
}

// x rounded to the nearest f16 value (ties to even), as an f32: round() of x scaled to units of
// the f16 step at x's binade, 2^(e - 10) with e >= -14 (so f16's subnormals keep their 2^-24
// steps); both scalings are by powers of two, so exact. Past f16's largest finite (65504):
// inf. Written out rather than as unpack2x16float(pack2x16float(x)), which NVIDIA's driver
// folds into x (BENCHMARKS.md, eighteenth session), leaving the scales unrounded there.
fn f16_round(x: f32) -> f32 {
    let bits = bitcast<u32>(x);
    let e = i32((bits >> 23u) & 0xFFu) - 127;
    let step = max(e, -14) - 10;
    let r = round(x * bitcast<f32>(u32(127 - step) << 23u)) * bitcast<f32>(u32(127 + step) << 23u);
    return select(r, bitcast<f32>((bits & 0x80000000u) | 0x7F800000u), abs(r) > 65504.0);
}

// Rounds and stores this invocation's four consecutive elements v of an x row (at word `word`;
// the block's (d, s) at ds_word) where the 8 invocations of a block are 8 aligned lanes of one
// subgroup calling this together (so the caller's host makes sure that SGW >= 8, see
// lane_reductions_wgsl in gpu.rs). `live`: whether the elements exist (v is then 0 where not);
// only live ones are stored, but every lane must call.
fn q8_round_lanes(v: vec4<f32>, word: u32, ds_word: u32, live: bool, first: bool) {
    let a = abs(v);
    let amax = lanes_max(max(max(a.x, a.y), max(a.z, a.w)), 8u);
    let q = q8_round(v, amax);
    let sum = lanes_sum(f32(q.x + q.y + q.z + q.w), 8u);
    if (live) {
        q8_store(q, amax, sum, word, ds_word, first);
    }
}
