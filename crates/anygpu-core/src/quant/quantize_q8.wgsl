// x [n, cols] f32 -> 8-bit blocks of 32 for the Q8 matvec (matvec_q8.wgsl), optionally
// RMS-normalised and scaled by the norm weight g first (the rms_norm kernel's math), rounded as
// the CPU's Q8 path (q8.rs) and llama.cpp's quantize_row_q8_1 round (round_q8.wgsl, which the
// host appends: d = max|x| / 127, q = round_half_even(x * 127 / max|x|), d and s = d * sum(q)
// rounded to f16).
// Workgroups: 1024 elements of one x row each (the matvec takes at most 16 rows).
// Output words: x row r's bytes at xq[r * cols / 4 ..] (block b: words 8b .. 8b + 8, four
// bytes each, in order), then the blocks' (d, s) as f32 bits at xq[p.ds_off + 2 (r blocks +
// b) ..].

struct Params {
    cols: u32,
    blocks: u32, // blocks per row (cols / 32)
    x_off: u32,  // first x vec4
    ds_off: u32, // first (d, s) word
    norm: u32,   // 1: RMSNorm with the weight g first; 0: x as it is (g unread)
    eps: f32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> xq: array<u32>;
@group(0) @binding(3) var<storage, read> g: array<vec4<f32>>;

var<workgroup> red: array<f32, 256>;

// Four elements c..c+4 (c = 4 i) of x row r after the optional norm.
fn xv(xrow: u32, i: u32, inv: f32) -> vec4<f32> {
    if (p.norm != 0u) {
        return x[xrow + i] * inv * g[i];
    }
    return x[xrow + i];
}

// Invocation t holds four consecutive elements, eight neighbours a block: every load is one
// 16-byte load of a warp-wide contiguous run, and a block's max and sum meet in workgroup
// memory or subgroup shuffles (H100, decode profile of the 8B: one block per invocation, 32
// scalar loads each, 20 µs per 4096-wide row; this way with workgroup memory, 12.5 µs).
// Workgroup (c, r) rounds elements 1024c .. 1024c + 1024 of row r (with the norm, every
// workgroup of a row sums the whole row's squares, from cache: 16 KB for a 4096-wide row); one
// workgroup looping over a row took 10.3 µs per 4096-wide row in the 8B's profile (now 7.7),
// 16.6 for a 14336-wide one (now 6.7).
// SGW, lanes_sum and lanes_max come with the header (see lane_reductions_wgsl in gpu.rs).
@compute @workgroup_size(256)
fn quantize(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = wid.y;
    let xrow = p.x_off + r * (p.cols / 4u);
    var inv = 1.0;
    if (p.norm != 0u) {
        var ss = 0.0;
        for (var i = lid; i < p.cols / 4u; i += 256u) {
            let v = x[xrow + i];
            ss += dot(v, v);
        }
        red[lid] = lanes_sum(ss, SGW);
        workgroupBarrier();
        for (var s = 128u; s >= SGW; s >>= 1u) {
            if (lid < s) {
                red[lid] += red[lid + s];
            }
            workgroupBarrier();
        }
        inv = inverseSqrt(red[0] / f32(p.cols) + p.eps);
        workgroupBarrier();
    }
    let first = lid & ~7u;
    // cols / 4 is a multiple of 8 (whole blocks): a block's invocations are all live or none.
    let i = 256u * wid.x + lid;
    let live = i < p.cols / 4u;
    var v = vec4<f32>(0.0);
    if (live) {
        v = xv(xrow, i, inv);
    }
    let a = abs(v);
    var amax = max(max(a.x, a.y), max(a.z, a.w));
    // A block's eight invocations: subgroup shuffles where subgroups hold them (SGW >= 8:
    // no barrier), else workgroup memory.
    if (SGW >= 8u) {
        amax = lanes_max(amax, 8u);
    } else {
        red[lid] = amax;
        workgroupBarrier();
        for (var k = 0u; k < 8u; k++) {
            amax = max(amax, red[first + k]);
        }
        workgroupBarrier();
    }
    let q = q8_round(v, amax);
    var sum = f32(q.x + q.y + q.z + q.w);
    if (SGW >= 8u) {
        sum = lanes_sum(sum, 8u);
    } else {
        red[lid] = sum;
        workgroupBarrier();
        sum = 0.0;
        for (var k = 0u; k < 8u; k++) {
            sum += red[first + k];
        }
        workgroupBarrier();
    }
    if (live) {
        q8_store(q, amax, sum, r * (p.cols / 4u) + i, p.ds_off + 2u * (r * p.blocks + i / 8u), lid == first);
    }
}
