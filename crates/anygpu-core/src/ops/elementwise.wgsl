// Elementwise kernels. `{{EXPR}}` is the op, written over `x` (and `y` for binary ops) and
// the scalars `p.s0`, `p.s1`. Strided entry points read any view (broadcast = stride 0);
// contiguous ones are the fast path, and `binary_vec4` the fastest: 16-byte loads and stores
// reach the copy bandwidth where 4-byte ones do not.
//
// Entry points declare different variables at the same bindings (scalar and vec4 views, the
// `where` parameters): WGSL allows that as long as no single entry point uses both.

struct Params {
    n: u32,
    rank: u32,
    a_off: u32,
    b_off: u32,
    s0: f32,
    s1: f32,
    a_mod: u32,  // contiguous kernels: operand element (or vec4) count; output i reads i % mod
    b_mod: u32,
    shape: array<vec4<u32>, 2>,
    a_strides: array<vec4<u32>, 2>,
    b_strides: array<vec4<u32>, 2>,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

// The same buffers seen as vec4 (used by `binary_vec4` only; offsets are then in vec4s).
@group(0) @binding(1) var<storage, read> a4: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> b4: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out4: array<vec4<f32>>;

// NaN tests on the bits: WGSL allows a compiler to assume floats are never NaN, and some do
// (lavapipe evaluates `NaN != y` as false), so comparisons must not rely on IEEE semantics.
fn is_nan_f(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}

fn ordered(x: f32, y: f32) -> bool {
    return !(is_nan_f(x) || is_nan_f(y));
}

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
    out[i] = binary_op(a[p.a_off + i % p.a_mod], b[p.b_off + i % p.b_mod]);
}

// Contiguous operands whose element counts and offsets are multiples of 4; `p.n`, `p.*_off`
// and `p.*_mod` count vec4s here. Each workgroup covers 256 * VPT vec4s, the threads striding
// by 256 so that every load instruction of the workgroup is one contiguous 4 KiB run. (Loading
// all VPT vec4s into a local array before storing was measured slower on an H100: the array
// spilled at VPT 8.)
@compute @workgroup_size(256)
fn binary_vec4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let base = (wid.x + wid.y * nwg.x) * (256u * VPT) + lid;
    for (var k = 0u; k < VPT; k = k + 1u) {
        let i = base + k * 256u;
        if (i < p.n) {
            let x = a4[p.a_off + i % p.a_mod];
            let y = b4[p.b_off + i % p.b_mod];
            out4[i] = vec4<f32>(binary_op(x.x, y.x), binary_op(x.y, y.y), binary_op(x.z, y.z), binary_op(x.w, y.w));
        }
    }
}

// ---- where(cond, a, b): cond != 0 ? a : b, all three broadcast to `shape` ----------------

struct WhereParams {
    n: u32,
    rank: u32,
    c_off: u32,
    a_off: u32,
    b_off: u32,
    contiguous: u32,
    _pad0: u32,
    _pad1: u32,
    shape: array<vec4<u32>, 2>,
    c_strides: array<vec4<u32>, 2>,
    a_strides: array<vec4<u32>, 2>,
    b_strides: array<vec4<u32>, 2>,
}

@group(0) @binding(0) var<uniform> wp: WhereParams;
@group(0) @binding(1) var<storage, read> w_cond: array<f32>;
@group(0) @binding(2) var<storage, read> w_a: array<f32>;
@group(0) @binding(3) var<storage, read> w_b: array<f32>;
@group(0) @binding(4) var<storage, read_write> w_out: array<f32>;

@compute @workgroup_size(256)
fn where_cond(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = linear_id(wid, nwg, lid);
    if (i >= wp.n) {
        return;
    }
    var ic = wp.c_off + i;
    var ia = wp.a_off + i;
    var ib = wp.b_off + i;
    if (wp.contiguous == 0u) {
        ic = strided_index(i, wp.rank, wp.shape, wp.c_strides, wp.c_off);
        ia = strided_index(i, wp.rank, wp.shape, wp.a_strides, wp.a_off);
        ib = strided_index(i, wp.rank, wp.shape, wp.b_strides, wp.b_off);
    }
    // Nonzero on the bits (NaN is true, -0.0 false; see is_nan_f for why not `!= 0.0`).
    // Read only the chosen side: a select() would read both.
    if ((bitcast<u32>(w_cond[ic]) & 0x7fffffffu) != 0u) {
        w_out[i] = w_a[ia];
    } else {
        w_out[i] = w_b[ib];
    }
}
