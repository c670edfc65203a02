// Rotary position embedding (llama.cpp's ggml_rope_ext, modes 0 and 2; see rope.rs).
// One thread per rotated pair of one head, or per pass-through dim (>= rotary_dim) of it.
// x may be any strided view of [.., T, H, D]; the output is contiguous.

struct Params {
    n: u32,        // threads: rows * units
    units: u32,    // per row (one head of D): half pairs + (D - rotary_dim) pass-through dims
    half: u32,     // rotary_dim / 2
    d: u32,
    h: u32,
    t: u32,
    start_pos: u32,
    neox: u32,
    theta_scale: f32,
    freq_scale: f32,
    rank: u32,
    offset: u32,
    stride_d: u32, // x's stride along D
    zero: u32,     // always 0; see opaque()
    _pad1: u32,
    _pad2: u32,
    shape: array<vec4<u32>, 2>,
    strides: array<vec4<u32>, 2>,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;
// Bound only when freq_factors are given (the FREQ_FACTORS placeholder divides by them).
@group(0) @binding(3) var<storage, read> ff: array<f32>;

// opaque, hi12, sin_cos, div_rn: rope_math.wgsl, prepended by the host.

@compute @workgroup_size(256)
fn rope(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let g = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (g >= p.n) {
        return;
    }
    let row = g / p.units;
    let u = g % p.units;
    let sb = strided_index(row * p.d, p.rank, p.shape, p.strides, p.offset); // source of x[row, 0]
    let ob = row * p.d;
    if (u >= p.half) {
        let d = u + p.half; // 2 * half + (u - half)
        dst[ob + d] = src[sb + d * p.stride_d];
        return;
    }
    let i = u;
    let t = (row / p.h) % p.t;
    // ggml's CPU angle, step for step: (float) pos times theta_scale i times (each product
    // correctly rounded in WGSL, so this equals the CPU reference bit for bit).
    var theta = f32(p.start_pos + t);
    for (var j = 0u; j < i; j = j + 1u) {
        theta = theta * p.theta_scale;
    }
    theta = opaque(theta);
    {{FREQ_FACTORS}}
    let sc = sin_cos(opaque(theta * p.freq_scale));
    var i0 = 2u * i;
    var i1 = 2u * i + 1u;
    if (p.neox != 0u) {
        i0 = i;
        i1 = i + p.half;
    }
    let x0 = src[sb + i0 * p.stride_d];
    let x1 = src[sb + i1 * p.stride_d];
    dst[ob + i0] = x0 * sc.y - x1 * sc.x;
    dst[ob + i1] = x0 * sc.x + x1 * sc.y;
}
