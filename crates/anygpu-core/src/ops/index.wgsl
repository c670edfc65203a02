// Gather / index_select / repeat_interleave ("remap"): output slice c along one dim is the
// source's slice MAP(c), MAP being `ids[c]` or `c / repeat`. Concat is in index_concat.wgsl.
//
// Elements are copied as bits. 4-byte dtypes move one element per thread. 2-byte dtypes
// (f16, bf16) are packed two per u32 word, so the `_u16` kernels give each thread one whole
// output word: no two threads of a dispatch ever write the same word. Sources may be any
// strided view (strided_index from strided.wgsl, starting at the view's offset).

struct RemapParams {
    n: u32,        // output elements
    rank: u32,     // of the source
    offset: u32,   // source offset in elements
    out_len: u32,  // output size along the remapped dim
    inner: u32,    // elements after the remapped dim
    src_len: u32,  // source size along the remapped dim
    repeat: u32,
    _pad: u32,
    shape: array<vec4<u32>, 2>,
    strides: array<vec4<u32>, 2>,
}

@group(0) @binding(0) var<uniform> p: RemapParams;
@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;
// Only the select variant binds ids (validated on the host, clamped again here).
@group(0) @binding(3) var<storage, read> ids: array<u32>;

// ---- remap ------------------------------------------------------------------------------

// Source element index (in elements) of output element o.
fn remap_src(o: u32) -> u32 {
    let k = o % p.inner;
    let r = o / p.inner;
    let c = r % p.out_len;
    let outer = r / p.out_len;
    let m = {{MAP}};
    let li = (outer * p.src_len + m) * p.inner + k;
    return strided_index(li, p.rank, p.shape, p.strides, p.offset);
}

@compute @workgroup_size(256)
fn remap_u32(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let o = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (o >= p.n) {
        return;
    }
    dst[o] = src[remap_src(o)];
}

fn half_of(si: u32) -> u32 {
    return (src[si / 2u] >> ((si % 2u) * 16u)) & 0xffffu;
}

@compute @workgroup_size(256)
fn remap_u16(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let w = (wid.x + wid.y * nwg.x) * 256u + lid;
    let e = w * 2u;
    if (e >= p.n) {
        return;
    }
    var word = half_of(remap_src(e));
    if (e + 1u < p.n) {
        word = word | (half_of(remap_src(e + 1u)) << 16u);
    }
    dst[w] = word;
}
