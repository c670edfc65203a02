// Unary elementwise kernels over f32: `{{EXPR}}` is written over `x`, the scalars `p.s0`,
// `p.s1`, and the helper functions below. The strided entry reads any view, so a transpose
// costs no extra copy; `unary_vec4` is the bandwidth path for contiguous data whose length and
// offset are multiples of 4.
//
// Precision: WGSL gives no accuracy guarantee for tanh and some drivers compute it as
// (e^2x - 1) / (e^2x + 1), which is NaN for large |x|; WGSL has no erf. Both are written here
// from exp, with the errors stated beside them.

struct Params {
    n: u32,
    rank: u32,
    a_off: u32,
    _pad: u32,
    s0: f32,
    s1: f32,
    _pad0: u32,
    _pad1: u32,
    shape: array<vec4<u32>, 2>,
    a_strides: array<vec4<u32>, 2>,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

// The same buffers seen as vec4, for `unary_vec4` only (WGSL allows two variables at one
// binding when no entry point uses both).
@group(0) @binding(1) var<storage, read> a4: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> out4: array<vec4<f32>>;

// sigmoid_f, tanh_f, erfc_pos, gelu_erf_f, gelu_tanh_f: unary_math.wgsl, prepended by the host
// (the matmul's activation epilogue uses the same functions).

fn unary_op(x: f32) -> f32 {
    return {{EXPR}};
}

@compute @workgroup_size(256)
fn unary_strided(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (i >= p.n) {
        return;
    }
    out[i] = unary_op(a[strided_index(i, p.rank, p.shape, p.a_strides, p.a_off)]);
}

@compute @workgroup_size(256)
fn unary_contiguous(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (i >= p.n) {
        return;
    }
    out[i] = unary_op(a[p.a_off + i]);
}

// `p.n` and `p.a_off` count vec4s here. Each workgroup covers 256 * VPT vec4s, its threads
// striding by 256 so that each load instruction of the workgroup reads one contiguous 4 KiB.
@compute @workgroup_size(256)
fn unary_vec4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let base = (wid.x + wid.y * nwg.x) * (256u * VPT) + lid;
    for (var k = 0u; k < VPT; k = k + 1u) {
        let i = base + k * 256u;
        if (i < p.n) {
            let v = a4[p.a_off + i];
            out4[i] = vec4<f32>(unary_op(v.x), unary_op(v.y), unary_op(v.z), unary_op(v.w));
        }
    }
}
