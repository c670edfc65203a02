// Strided -> contiguous copies. 4-byte elements copy one per thread; 2-byte elements (f16,
// bf16) are packed two per u32 word, so each thread writes one whole output word and no two
// threads touch the same word.

struct Params {
    n: u32,        // output elements
    rank: u32,
    offset: u32,   // source offset in elements
    _pad: u32,
    shape: array<vec4<u32>, 2>,
    strides: array<vec4<u32>, 2>,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;

@compute @workgroup_size(256)
fn copy_u32(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (i >= p.n) {
        return;
    }
    dst[i] = src[strided_index(i, p.rank, p.shape, p.strides, p.offset)];
}

fn half_at(e: u32) -> u32 {
    let si = strided_index(e, p.rank, p.shape, p.strides, p.offset);
    return (src[si / 2u] >> ((si % 2u) * 16u)) & 0xffffu;
}

@compute @workgroup_size(256)
fn copy_u16(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let w = (wid.x + wid.y * nwg.x) * 256u + lid;
    let e = w * 2u;
    if (e >= p.n) {
        return;
    }
    var word = half_at(e);
    if (e + 1u < p.n) {
        word = word | (half_at(e + 1u) << 16u);
    }
    dst[w] = word;
}

// Strided -> strided copy of 4-byte elements: writes `src` into a view of an existing tensor
// (a KV cache slot). Separate bindings because here `dst` is a view, not a fresh buffer.
struct WriteParams {
    n: u32,
    rank: u32,
    src_offset: u32,
    dst_offset: u32,
    shape: array<vec4<u32>, 2>,
    src_strides: array<vec4<u32>, 2>,
    dst_strides: array<vec4<u32>, 2>,
}

@group(0) @binding(0) var<uniform> wp: WriteParams;
@group(0) @binding(1) var<storage, read> wsrc: array<u32>;
@group(0) @binding(2) var<storage, read_write> wdst: array<u32>;

@compute @workgroup_size(256)
fn write_u32(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (i >= wp.n) {
        return;
    }
    let s = strided_index(i, wp.rank, wp.shape, wp.src_strides, wp.src_offset);
    let d = strided_index(i, wp.rank, wp.shape, wp.dst_strides, wp.dst_offset);
    wdst[d] = wsrc[s];
}
