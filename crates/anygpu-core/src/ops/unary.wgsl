// Unary elementwise kernels over f32: `{{EXPR}}` is written over `x` and the scalars
// `p.s0`, `p.s1`. The strided entry reads any view, so a transpose costs no extra copy.

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
