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

// 1 / (1 + e^-x) without overflow: e^-|x| is in (0, 1] for every x.
fn sigmoid_f(x: f32) -> f32 {
    let e = exp(-abs(x));
    let r = 1.0 / (1.0 + e);
    return select(e * r, r, x >= 0.0);
}

// tanh after Cephes' tanhf: an odd polynomial below |x| = 0.625 (where 1 - e^-2|x| would lose
// relative precision), 1 - 2 / (e^2|x| + 1) above, |x| clamped to 10 where tanh is 1.0 in f32.
// Relative error about 2e-7 (the polynomial) to a few ulp (the exp branch).
fn tanh_f(x: f32) -> f32 {
    let ax = min(abs(x), 10.0);
    var r: f32;
    if (ax < 0.625) {
        let z = x * x;
        r = ax + ax * z * ((((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z
            + 1.33314422036e-1) * z - 3.33332819422e-1);
    } else {
        r = 1.0 - 2.0 / (exp(2.0 * ax) + 1.0);
    }
    return select(r, -r, x < 0.0);
}

// erfc(z) for z >= 0, Numerical Recipes' Chebyshev fit `erfcc`: fractional error below 1.2e-7
// everywhere (so the tail stays relatively accurate, unlike 1 - erf), plus f32 rounding.
fn erfc_pos(z: f32) -> f32 {
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806
        + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))));
    return t * exp(poly - z * z);
}

// GELU, erf form: x * Phi(x), Phi(x) = erfc(-x / sqrt 2) / 2. For x < 0 Phi comes straight from
// erfc (relative error ~1.2e-7 carries over); for x >= 0 it is 1 - erfc/2 (absolute error
// below 6e-8).
fn gelu_erf_f(x: f32) -> f32 {
    let h = 0.5 * erfc_pos(abs(x) * 0.70710678118654752);
    return x * select(1.0 - h, h, x < 0.0);
}

// GELU, tanh form: 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3);
// the sigmoid form has no cancellation for large negative x.
fn gelu_tanh_f(x: f32) -> f32 {
    let u = 0.7978845608028654 * (x + 0.044715 * x * x * x);
    return x * sigmoid_f(2.0 * u);
}

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
