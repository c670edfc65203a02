// Batched matmul C[b] = A[b] x B[b] (+ bias) on cooperative matrices (tensor cores): 16x16x16
// f16 products accumulated in f32. f16 x f16 gives f16 (rounded once at the end); with an f32
// operand (rounded to f16 as it is staged) the output is f32.
//
// One workgroup of 256 invocations (8 subgroups of 32) computes a 128 x 128 tile of C; the
// subgroups form a 2 x 4 grid, each owning 64 x 32 of C: 4 x 2 accumulator matrices. K is
// staged through workgroup memory 32 at a time, double-buffered: one barrier per step.
// Tiles past the edges of M, N or K are filled with zeros, so any shape works.
//
// What makes it fast (H100, f16 4096^3: 36.7 -> ~175 TFLOP/s when this structure replaced a
// first version with the same tiles): each invocation moves fixed 16-byte chunks (8 elements
// along the operand's contiguous dimension) whose addresses, workgroup slots and edge tests
// are worked out once, before the K loop; the next step's chunks are loaded into registers
// before the current step's products and left untouched (no conversion, no masking) until
// after them, when they are converted to f16, masked and stored. Anything that consumes a
// loaded value early makes the invocation wait for the load right there, and the products no
// longer hide its latency.
//
// Workgroup tiles, by operand: K-contiguous (A with LA = 1, B with LB = 2) as 128 rows (M or N)
// x 32 (K), rows of 40 halves; else as 32 rows (K) x 128 (M or N), rows of 136 halves. The
// 8 halves of padding (16 bytes) put the 8 rows a matrix load touches at once in different
// banks. A is read row-major ([m][k], coopLoadT) or column-major ([k][m], coopLoad); B as
// [k][n] row-major or [n][k] column-major. Each tile is 512 chunks, 2 per invocation: chunk v
// is row v / 4, column 8 (v % 4) of a K-contiguous tile, or row v / 16, column 8 (v % 16).
// Workgroup arrays hold vec4<f16>: a chunk is two of them, and coopLoad's stride counts them.
//
// The accumulators leave through a per-subgroup f32 scratch (coopStoreT), from which each
// invocation adds the bias, rounds and writes 8 outputs.
//
// Header constants: LA (1: K contiguous, 2: M contiguous), LB (1: N contiguous, 2: K
// contiguous), SA / SB (row strides of the workgroup tiles, in halves), SA4 / SB4 (vec4s per
// buffered tile), VEC_OUT (N % 4 == 0). The IO placeholder declares, per operand x = a (binding
// 1) or b (binding 2): a type Raw_x (a chunk as loaded), `ld_x(i, n) -> Raw_x` (the chunk at
// element i with its first n elements valid, n = 0 to 8) and `st_x(at, r, n)` (converts it to
// f16, zero past n, into vec4s at and at + 1 of sa or sb); then bias (binding 3) and c
// (binding 4) with ld_bias, st_c4 and st_c, and `fn act(x: f32) -> f32` (see emit8).

struct Params {
    m: u32,
    n: u32,
    k: u32,
    has_bias: u32,
    bias_off: u32,
    batch0: u32,
    tiles_m: u32,
    tiles_n: u32,
    a_off: u32,
    a_sb: u32,
    a_sm: u32,
    a_sk: u32,
    b_off: u32,
    b_sb: u32,
    b_sk: u32,
    b_sn: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
{{IO}}

const BM: u32 = 128u;
const BN: u32 = 128u;
const BK: u32 = 32u;
const GROUP_M: u32 = 8u;

var<workgroup> sa: array<vec4<f16>, 2u * SA4>;
var<workgroup> sb: array<vec4<f16>, 2u * SB4>;
var<workgroup> scratch: array<f32, 2048>; // one 16 x 16 f32 matrix per subgroup

// Eight f16 packed in two u32 words, as two vec4<f16> (exact: through f32).
fn u2h(x: vec2<u32>) -> vec4<f16> {
    return vec4<f16>(vec4<f32>(unpack2x16float(x.x), unpack2x16float(x.y)));
}

// Chunk v of a tile: (row, column) in the tile's own layout (see the header), and its vec4
// index in one buffer of the workgroup tile.
fn chunk_rc(v: u32, k_contiguous: bool) -> vec2<u32> {
    if (k_contiguous) {
        return vec2<u32>(v / 4u, (v % 4u) * 8u);
    }
    return vec2<u32>(v / 16u, (v % 16u) * 8u);
}
fn chunk_slot(v: u32, k_contiguous: bool, stride: u32) -> u32 {
    let rc = chunk_rc(v, k_contiguous);
    return rc.x * (stride / 4u) + rc.y / 4u;
}

// One operand's chunk: where it starts at step 0, how far a step moves it, where it goes in
// workgroup memory, and its coordinates (outer: M or N; k) at step 0.
struct Chunk {
    at: u32,
    step: u32,
    slot: u32,
    outer: u32,
    k: u32,
}

// The chunk v of an operand's tile whose outer dim (M for A, N for B) starts at `origin`; it
// covers elements [k, k + 8) of an outer row (K-contiguous) or [outer, outer + 8) of a K row.
// `s_outer` / `s_k`: the operand's strides; `tile_stride`: its workgroup tile's row stride.
fn chunk(v: u32, kc: bool, origin: u32, base: u32, s_outer: u32, s_k: u32, tile_stride: u32) -> Chunk {
    let rc = chunk_rc(v, kc);
    var outer = origin + rc.y;
    var k = rc.x;
    if (kc) {
        outer = origin + rc.x;
        k = rc.y;
    }
    return Chunk(base + outer * s_outer + k * s_k, BK * s_k, chunk_slot(v, kc, tile_stride), outer, k);
}

// Valid elements of a chunk at step t: 0 past the edges, else up to 8 along the contiguous dim.
fn valid(c: Chunk, t: u32, outer_len: u32, k_contiguous: bool) -> u32 {
    let k = c.k + t * BK;
    if (c.outer >= outer_len || k >= p.k) {
        return 0u;
    }
    if (k_contiguous) {
        return min(p.k - k, 8u);
    }
    return min(outer_len - c.outer, 8u);
}

// vec4 index in `sa` of the 16 x 16 A block at (row, k) of buffer `buf`.
fn a_at(buf: u32, row: u32, k: u32) -> u32 {
    if (LA == 1u) {
        return buf * SA4 + (row * SA + k) / 4u;
    }
    return buf * SA4 + (k * SA + row) / 4u;
}
fn b_at(buf: u32, k: u32, col: u32) -> u32 {
    if (LB == 1u) {
        return buf * SB4 + (k * SB + col) / 4u;
    }
    return buf * SB4 + (col * SB + k) / 4u;
}

fn ld_fa(at: u32) -> coop_mat16x16<f16, A> {
    if (LA == 1u) {
        return coopLoadT<coop_mat16x16<f16, A>>(&sa[at], SA / 4u);
    }
    return coopLoad<coop_mat16x16<f16, A>>(&sa[at], SA / 4u);
}
fn ld_fb(at: u32) -> coop_mat16x16<f16, B> {
    if (LB == 1u) {
        return coopLoadT<coop_mat16x16<f16, B>>(&sb[at], SB / 4u);
    }
    return coopLoad<coop_mat16x16<f16, B>>(&sb[at], SB / 4u);
}

// Adds the bias to 8 consecutive outputs of row r from columns col.., applies the activation
// (`act`, from the host: the identity, or one of unary_math.wgsl's functions), rounds and
// writes them.
fn emit8(o: u32, r: u32, col: u32, v0: vec4<f32>, v1: vec4<f32>) {
    if (r >= p.m || col >= p.n) {
        return;
    }
    var x0 = v0;
    var x1 = v1;
    if (p.has_bias != 0u) {
        for (var e = 0u; e < 4u; e = e + 1u) {
            if (col + e < p.n) {
                x0[e] = x0[e] + ld_bias(p.bias_off + col + e);
            }
            if (col + 4u + e < p.n) {
                x1[e] = x1[e] + ld_bias(p.bias_off + col + 4u + e);
            }
        }
    }
    x0 = vec4<f32>(act(x0.x), act(x0.y), act(x0.z), act(x0.w));
    x1 = vec4<f32>(act(x1.x), act(x1.y), act(x1.z), act(x1.w));
    if (VEC_OUT == 1u && col + 8u <= p.n) {
        st_c4(o, x0);
        st_c4(o + 4u, x1);
        return;
    }
    for (var e = 0u; e < 4u; e = e + 1u) {
        if (col + e < p.n) {
            st_c(o + e, x0[e]);
        }
        if (col + 4u + e < p.n) {
            st_c(o + 4u + e, x1[e]);
        }
    }
}

// Writes the 16 x 16 block at (row0, col0) that this subgroup just stored in its scratch
// matrix. Called by every invocation of the workgroup in the same order (it holds barriers).
fn drain(sg: u32, lane: u32, out_base: u32, row0: u32, col0: u32) {
    workgroupBarrier();
    let r = lane / 2u;
    let c = (lane % 2u) * 8u;
    let s = sg * 256u + r * 16u + c;
    let v0 = vec4<f32>(scratch[s], scratch[s + 1u], scratch[s + 2u], scratch[s + 3u]);
    let v1 = vec4<f32>(scratch[s + 4u], scratch[s + 5u], scratch[s + 6u], scratch[s + 7u]);
    emit8(out_base + (row0 + r) * p.n + col0 + c, row0 + r, col0 + c, v0, v1);
    workgroupBarrier();
}

@compute @workgroup_size(256)
fn matmul(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let lin = wid.x + wid.y * nwg.x;
    if (lin >= p.tiles_m * p.tiles_n) {
        return;
    }
    let per_group = GROUP_M * p.tiles_n;
    let first_m = (lin / per_group) * GROUP_M;
    let group_rows = min(p.tiles_m - first_m, GROUP_M);
    let m0 = (first_m + (lin % per_group) % group_rows) * BM;
    let n0 = ((lin % per_group) / group_rows) * BN;
    let batch = p.batch0 + wid.z;
    // This subgroup's 64 x 32 block of the tile.
    let wm = (sg / 4u) * 64u;
    let wn = (sg % 4u) * 32u;

    var c00 = coop_mat16x16<f32, C>();
    var c01 = coop_mat16x16<f32, C>();
    var c10 = coop_mat16x16<f32, C>();
    var c11 = coop_mat16x16<f32, C>();
    var c20 = coop_mat16x16<f32, C>();
    var c21 = coop_mat16x16<f32, C>();
    var c30 = coop_mat16x16<f32, C>();
    var c31 = coop_mat16x16<f32, C>();

    // This invocation's two chunks of each operand.
    let ka = LA == 1u;
    let kb = LB == 2u;
    let a_base = p.a_off + batch * p.a_sb;
    let b_base = p.b_off + batch * p.b_sb;
    let a0 = chunk(tid, ka, m0, a_base, p.a_sm, p.a_sk, SA);
    let a1 = chunk(tid + 256u, ka, m0, a_base, p.a_sm, p.a_sk, SA);
    let b0 = chunk(tid, kb, n0, b_base, p.b_sn, p.b_sk, SB);
    let b1 = chunk(tid + 256u, kb, n0, b_base, p.b_sn, p.b_sk, SB);

    let ntiles = (p.k + BK - 1u) / BK;
    var na0 = valid(a0, 0u, p.m, ka);
    var na1 = valid(a1, 0u, p.m, ka);
    var nb0 = valid(b0, 0u, p.n, kb);
    var nb1 = valid(b1, 0u, p.n, kb);
    var ra0 = ld_a(a0.at, na0);
    var ra1 = ld_a(a1.at, na1);
    var rb0 = ld_b(b0.at, nb0);
    var rb1 = ld_b(b1.at, nb1);
    st_a(a0.slot, ra0, na0);
    st_a(a1.slot, ra1, na1);
    st_b(b0.slot, rb0, nb0);
    st_b(b1.slot, rb1, nb1);
    workgroupBarrier();
    for (var t = 0u; t < ntiles; t = t + 1u) {
        let cur = t % 2u;
        let more = t + 1u < ntiles;
        if (more) {
            // The next step's chunks: loaded now, first used after this step's products.
            let t1 = t + 1u;
            na0 = valid(a0, t1, p.m, ka);
            na1 = valid(a1, t1, p.m, ka);
            nb0 = valid(b0, t1, p.n, kb);
            nb1 = valid(b1, t1, p.n, kb);
            ra0 = ld_a(a0.at + t1 * a0.step, na0);
            ra1 = ld_a(a1.at + t1 * a1.step, na1);
            rb0 = ld_b(b0.at + t1 * b0.step, nb0);
            rb1 = ld_b(b1.at + t1 * b1.step, nb1);
        }
        // Two K-steps of 16, written out (a loop here was not unrolled by every compiler).
        var fa0 = ld_fa(a_at(cur, wm, 0u));
        var fa1 = ld_fa(a_at(cur, wm + 16u, 0u));
        var fa2 = ld_fa(a_at(cur, wm + 32u, 0u));
        var fa3 = ld_fa(a_at(cur, wm + 48u, 0u));
        var fb0 = ld_fb(b_at(cur, 0u, wn));
        var fb1 = ld_fb(b_at(cur, 0u, wn + 16u));
        c00 = coopMultiplyAdd(fa0, fb0, c00);
        c01 = coopMultiplyAdd(fa0, fb1, c01);
        c10 = coopMultiplyAdd(fa1, fb0, c10);
        c11 = coopMultiplyAdd(fa1, fb1, c11);
        c20 = coopMultiplyAdd(fa2, fb0, c20);
        c21 = coopMultiplyAdd(fa2, fb1, c21);
        c30 = coopMultiplyAdd(fa3, fb0, c30);
        c31 = coopMultiplyAdd(fa3, fb1, c31);
        fa0 = ld_fa(a_at(cur, wm, 16u));
        fa1 = ld_fa(a_at(cur, wm + 16u, 16u));
        fa2 = ld_fa(a_at(cur, wm + 32u, 16u));
        fa3 = ld_fa(a_at(cur, wm + 48u, 16u));
        fb0 = ld_fb(b_at(cur, 16u, wn));
        fb1 = ld_fb(b_at(cur, 16u, wn + 16u));
        c00 = coopMultiplyAdd(fa0, fb0, c00);
        c01 = coopMultiplyAdd(fa0, fb1, c01);
        c10 = coopMultiplyAdd(fa1, fb0, c10);
        c11 = coopMultiplyAdd(fa1, fb1, c11);
        c20 = coopMultiplyAdd(fa2, fb0, c20);
        c21 = coopMultiplyAdd(fa2, fb1, c21);
        c30 = coopMultiplyAdd(fa3, fb0, c30);
        c31 = coopMultiplyAdd(fa3, fb1, c31);
        if (more) {
            let nxt = 1u - cur;
            st_a(nxt * SA4 + a0.slot, ra0, na0);
            st_a(nxt * SA4 + a1.slot, ra1, na1);
            st_b(nxt * SB4 + b0.slot, rb0, nb0);
            st_b(nxt * SB4 + b1.slot, rb1, nb1);
        }
        workgroupBarrier();
    }

    let out_base = batch * p.m * p.n;
    let r0 = m0 + wm;
    let q0 = n0 + wn;
    coopStoreT(c00, &scratch[sg * 256u], 16u);
    drain(sg, lane, out_base, r0, q0);
    coopStoreT(c01, &scratch[sg * 256u], 16u);
    drain(sg, lane, out_base, r0, q0 + 16u);
    coopStoreT(c10, &scratch[sg * 256u], 16u);
    drain(sg, lane, out_base, r0 + 16u, q0);
    coopStoreT(c11, &scratch[sg * 256u], 16u);
    drain(sg, lane, out_base, r0 + 16u, q0 + 16u);
    coopStoreT(c20, &scratch[sg * 256u], 16u);
    drain(sg, lane, out_base, r0 + 32u, q0);
    coopStoreT(c21, &scratch[sg * 256u], 16u);
    drain(sg, lane, out_base, r0 + 32u, q0 + 16u);
    coopStoreT(c30, &scratch[sg * 256u], 16u);
    drain(sg, lane, out_base, r0 + 48u, q0);
    coopStoreT(c31, &scratch[sg * 256u], 16u);
    drain(sg, lane, out_base, r0 + 48u, q0 + 16u);
}
