// Concat: one dispatch per input, each writing its slab of the output.
//
// Elements are copied as bits. 4-byte dtypes move one element per thread; 2-byte dtypes
// (f16, bf16) are packed two per u32 word (see concat_u16). Inputs may be any strided view.

struct ConcatParams {
    n: u32,        // threads: input elements (4-byte) or output words covered (2-byte)
    rank: u32,     // of the input
    offset: u32,   // input offset in elements
    len: u32,      // input size along dim
    inner: u32,    // elements after dim
    out_dim: u32,  // output size along dim
    start: u32,    // where this input starts along dim in the output
    out_n: u32,    // output elements
    w0: u32,       // first output word touched (2-byte)
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
    shape: array<vec4<u32>, 2>,
    strides: array<vec4<u32>, 2>,
}

@group(0) @binding(0) var<uniform> q: ConcatParams;
@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;

@compute @workgroup_size(256)
fn concat_u32(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (i >= q.n) {
        return;
    }
    let run = q.len * q.inner;
    let o = (i / run) * q.out_dim * q.inner + q.start * q.inner + i % run;
    dst[o] = src[strided_index(i, q.rank, q.shape, q.strides, q.offset)];
}

// One output word per thread, over the words this input touches. A word whose other half
// belongs to another input is read-modify-written: the dispatches of the inputs run one after
// another, and within one dispatch each word has one owner.
@compute @workgroup_size(256)
fn concat_u16(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (t >= q.n) {
        return;
    }
    let w = q.w0 + t;
    var word = 0u;
    var mask = 0u;
    for (var h = 0u; h < 2u; h = h + 1u) {
        let e = w * 2u + h;
        if (e >= q.out_n) {
            break;
        }
        let r = e % (q.out_dim * q.inner);
        let c = r / q.inner;
        if (c >= q.start && c < q.start + q.len) {
            let outer = e / (q.out_dim * q.inner);
            let li = (outer * q.len + (c - q.start)) * q.inner + r % q.inner;
            let si = strided_index(li, q.rank, q.shape, q.strides, q.offset);
            let v = (src[si / 2u] >> ((si % 2u) * 16u)) & 0xffffu;
            word = word | (v << (h * 16u));
            mask = mask | (0xffffu << (h * 16u));
        }
    }
    if (mask == 0xffffffffu) {
        dst[w] = word;
    } else if (mask != 0u) {
        dst[w] = (dst[w] & ~mask) | word;
    }
}
