// Casts between f32, f16 and bf16. Buffers are words (array<u32>): 2-byte elements sit two per
// word, the element at index e in the low half when e is even. A 4-byte output gets one
// element per thread; a 2-byte output one word (two elements) per thread, so no two threads
// write the same word.
//
// `{{LOAD}}` turns the element at storage index `si` into f32 (exact for every source type);
// `{{STORE}}` turns an f32 into the 16 output bits, or into the output word for f32 output.
// f16 uses the core `unpack2x16float` / `pack2x16float` (no shader-f16 feature needed); bf16 is
// the top half of an f32, rounded to nearest even on the way down, as `half::bf16::from_f32`.

struct Params {
    n: u32,          // output elements
    rank: u32,
    offset: u32,     // source offset in elements
    contiguous: u32, // 1: source index = offset + e
    shape: array<vec4<u32>, 2>,
    strides: array<vec4<u32>, 2>,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;

fn half_bits(si: u32) -> u32 {
    return (src[si / 2u] >> ((si % 2u) * 16u)) & 0xffffu;
}

fn load_f32(si: u32) -> f32 {
    return bitcast<f32>(src[si]);
}

fn load_f16(si: u32) -> f32 {
    return unpack2x16float(half_bits(si)).x;
}

fn load_bf16(si: u32) -> f32 {
    return bitcast<f32>(half_bits(si) << 16u);
}

// f32 -> f16 bits. WGSL leaves pack2x16float undefined outside f16's finite range and lets it
// flush f16 subnormals, so those cases are decided here on the bits (integer compares, which
// no fast-math assumption can remove): NaN stays a quiet NaN, |x| >= 65520 (the rounding
// threshold) is inf, (65504, 65520) is 65504, and below 2^-14 the subnormal is counted in
// units of 2^-24 with round(), which WGSL defines as round-half-to-even. The normal range goes
// through pack2x16float.
fn store_f16(v: f32) -> u32 {
    let bits = bitcast<u32>(v);
    let sign = (bits >> 16u) & 0x8000u;
    let mag = bits & 0x7fffffffu;
    if (mag > 0x7f800000u) {
        return sign | 0x7e00u;
    }
    if (mag >= 0x477ff000u) {
        return sign | 0x7c00u;
    }
    if (mag > 0x477fe000u) {
        return sign | 0x7bffu;
    }
    if (mag < 0x38800000u) {
        return sign | u32(round(bitcast<f32>(mag) * 16777216.0));
    }
    return pack2x16float(vec2<f32>(v, 0.0)) & 0xffffu;
}

// f32 -> bf16 bits, round to nearest even; NaN stays NaN (quieted), overflow rounds to inf.
fn store_bf16(v: f32) -> u32 {
    let bits = bitcast<u32>(v);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        return (bits >> 16u) | 0x40u;
    }
    return (bits + 0x7fffu + ((bits >> 16u) & 1u)) >> 16u;
}

fn load(e: u32) -> f32 {
    var si = p.offset + e;
    if (p.contiguous == 0u) {
        si = strided_index(e, p.rank, p.shape, p.strides, p.offset);
    }
    return {{LOAD}}(si);
}

@compute @workgroup_size(256)
fn cast_to32(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let e = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (e >= p.n) {
        return;
    }
    dst[e] = bitcast<u32>(load(e));
}

@compute @workgroup_size(256)
fn cast_to16(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let w = (wid.x + wid.y * nwg.x) * 256u + lid;
    let e = w * 2u;
    if (e >= p.n) {
        return;
    }
    var word = {{STORE}}(load(e));
    if (e + 1u < p.n) {
        word = word | ({{STORE}}(load(e + 1u)) << 16u);
    }
    dst[w] = word;
}
