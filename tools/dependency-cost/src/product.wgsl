// One F16 product y = W x per segment (W square, N x N, rows of N f16 packed in pairs), one
// warp-sized group of 32 invocations per row, 8 rows per workgroup of 256. The host replaces
// the placeholders CHAIN, COHERENT, N4 (N / 4), ROW_SUM (`subgroupAdd(acc)` where
// subgroups have 32 lanes, else `row_sum(acc, lid)`), LOADS and DOTS (LOADS: the row's words, all of them,
// as named registers; DOTS: their products with x; generated unrolled so that they stay in
// registers).
//
// CHAIN = false: one dispatch per segment (`cfg.seg`), workgroup g takes rows 8g..8g+8.
// CHAIN = true: one dispatch runs every segment. Workgroups take tickets from an atomic
// counter in the order they start, and ticket t is segment t / groups. A workgroup of segment s > 0 loads its W rows
// first, then waits until every workgroup of segment s - 1 has counted itself done, so
// that the wait overlaps the load. Starting order makes the wait safe: all of segment s - 1
// started before any of segment s, and started workgroups run to their end.
// x is read once per workgroup into workgroup memory; with COHERENT its binding is `@coherent`,
// so those reads skip the multiprocessor's L1, which may hold lines of the same addresses from
// an earlier segment (without it the chained results come out stale on NVIDIA).
struct Cfg { rows: u32, cols: u32, groups: u32, seg: u32 }
@group(0) @binding(0) var<uniform> cfg: Cfg;
@group(0) @binding(1) var<storage, read> w: array<vec2<u32>>;
// x and y alternate between the two halves of xy, segment after segment.
@group(0) @binding(2) {{COHERENT}} var<storage, read_write> xy: array<vec4<f32>>;
// [0]: tickets; [s + 1]: workgroups of segment s done; the last: set when a wait gave up.
@group(0) @binding(3) var<storage, read_write> ctr: array<atomic<u32>>;

var<workgroup> ticket: u32;
var<workgroup> xs: array<vec4<f32>, {{N4}}>;
var<workgroup> red: array<f32, 256>;

fn f16x4(q: vec2<u32>) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(q.x), unpack2x16float(q.y));
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    var seg = cfg.seg;
    var g = wid.x;
    if ({{CHAIN}}) {
        if (lid == 0u) {
            ticket = atomicAdd(&ctr[0], 1u);
        }
        let t = workgroupUniformLoad(&ticket);
        seg = t / cfg.groups;
        g = t % cfg.groups;
    }
    let lane = lid % 32u;
    let row = g * 8u + lid / 32u;
    let wb = (seg * cfg.rows + row) * (cfg.cols / 4u);
    let xb = (seg % 2u) * {{N4}};
    let yb = ((seg + 1u) % 2u) * {{N4}} * 4u;
{{LOADS}}
    if ({{CHAIN}} && seg > 0u) {
        if (lid == 0u) {
            // Bounded, so that a GPU without the forward progress assumed above reports
            // instead of hanging.
            for (var n = 0u; atomicLoad(&ctr[seg]) < cfg.groups; n += 1u) {
                if (n > 100000000u) {
                    atomicStore(&ctr[arrayLength(&ctr) - 1u], 1u);
                    break;
                }
            }
        }
        workgroupBarrier();
        storageBarrier();
    }
    for (var i = lid; i < {{N4}}; i += 256u) {
        xs[i] = xy[xb + i];
    }
    workgroupBarrier();
    var acc = 0.0;
{{DOTS}}
    let s = {{ROW_SUM}};
    if (lane == 0u) {
        let i = yb + row;
        // Scaled so that a chain of products stays in range.
        xy[i >> 2u][i & 3u] = s / 32.0;
    }
    if ({{CHAIN}}) {
        storageBarrier();
        workgroupBarrier();
        if (lid == 0u) {
            atomicAdd(&ctr[seg + 1u], 1u);
        }
    }
}

// The sum of v over the 32 invocations of a row, through workgroup memory (called by all).
fn row_sum(v: f32, lid: u32) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var s = 16u; s > 0u; s >>= 1u) {
        if (lid % 32u < s) {
            red[lid] += red[lid + s];
        }
        workgroupBarrier();
    }
    return red[lid - lid % 32u];
}
