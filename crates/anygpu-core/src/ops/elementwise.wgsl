// Elementwise kernels. `{{EXPR}}` is the op, written over `x` (and `y` for binary ops) and
// the scalars `p.s0`, `p.s1`. Strided entry points read any view (broadcast = stride 0);
// contiguous ones are the fast path.

struct Params {
    n: u32,
    rank: u32,
    a_off: u32,
    b_off: u32,
    s0: f32,
    s1: f32,
    _pad0: u32,
    _pad1: u32,
    shape: array<vec4<u32>, 2>,
    a_strides: array<vec4<u32>, 2>,
    b_strides: array<vec4<u32>, 2>,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

fn binary_op(x: f32, y: f32) -> f32 {
    return {{EXPR}};
}

fn linear_id(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.x + wid.y * nwg.x) * 256u + lid;
}

@compute @workgroup_size(256)
fn binary_strided(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = linear_id(wid, nwg, lid);
    if (i >= p.n) {
        return;
    }
    let ia = strided_index(i, p.rank, p.shape, p.a_strides, p.a_off);
    let ib = strided_index(i, p.rank, p.shape, p.b_strides, p.b_off);
    out[i] = binary_op(a[ia], b[ib]);
}

@compute @workgroup_size(256)
fn binary_contiguous(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = linear_id(wid, nwg, lid);
    if (i >= p.n) {
        return;
    }
    out[i] = binary_op(a[p.a_off + i], b[p.b_off + i]);
}
