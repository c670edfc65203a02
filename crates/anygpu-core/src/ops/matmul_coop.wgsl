// Batched matmul C[b] = A[b] x B[b] (+ bias) on cooperative matrices (tensor cores): 16x16x16
// f16 products accumulated in f32. f16 x f16 gives f16 (rounded once at the end); with an f32
// operand (rounded to f16 as it is staged) the output is f32.
//
// One workgroup of 256 invocations (8 subgroups of 32) computes a 128 x 128 tile of C; the
// subgroups form a 2 x 4 grid, each owning 64 x 32 of C: 4 x 2 accumulator matrices. K is
// staged through workgroup memory 32 at a time, double-buffered (the next tile's global
// loads are issued into registers before the current tile's products, one barrier per tile).
// Tiles past the edges of M, N or K are filled with zeros, so any shape works.
//
// Workgroup layout: A as [m][k] when K is contiguous in memory (read with row-major coopLoadT)
// or [k][m] when M is (column-major coopLoad); B as [k][n] (row-major) or [n][k] (column-major).
// Rows are padded by 8 halves (16 bytes) so the 8 rows a matrix load touches at once fall in
// different banks. Workgroup arrays hold vec4<f16> so global loads and stores move 8 bytes;
// coopLoad's stride counts those vec4s.
//
// The accumulators leave through a per-subgroup f32 scratch (coopStoreT), from which each
// invocation adds the bias, rounds to f16 and writes 8 outputs.
//
// Header constants: LA (1: K contiguous, 2: M contiguous), LB (1: N contiguous, 2: K
// contiguous), SA / SB (row strides of the workgroup tiles, in halves), SA4 / SB4 (vec4s per
// buffered tile), VEC_OUT (N % 4 == 0). The IO placeholder declares bias (binding 3) and c (binding 4) with
// ld_bias, st_c4 and st_c, after the operands' a_vec and b_vec.

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
// IO: the operands a and b (bindings 1, 2) with a_vec / b_vec (four consecutive elements of one
// row or column at element i, `len` of them valid, as vec4<f16>; an f32 operand is rounded to
// f16 here, as it is staged: the (f32, f16) products of an encoder's activations and f16
// weights), then bias and c (see the header).
{{IO}}

const BM: u32 = 128u;
const BN: u32 = 128u;
const BK: u32 = 32u;
const GROUP_M: u32 = 8u;

var<workgroup> sa: array<vec4<f16>, 2u * SA4>;
var<workgroup> sb: array<vec4<f16>, 2u * SB4>;
var<workgroup> scratch: array<f32, 2048>; // one 16 x 16 f32 matrix per subgroup

// Global loads of one K-tile: 1024 vec4 per operand, 4 per invocation; slot s (0..3) is vec4
// v = tid + 256 s of the tile in its workgroup layout (see the header). One slot per call,
// with a literal s, into a plain register: the next tile's loads then stay in flight while
// the current tile's products run. (Loops over an array of 4 put the loaded values in local
// memory, which waited for every load before the products: 30 TFLOP/s at 4096^3 on an H100,
// the products alone 238.)
fn load_a(tid: u32, s: u32, m0: u32, k0: u32, base: u32) -> vec4<f16> {
    let v = tid + s * 256u;
    if (LA == 1u) {
        let m = m0 + v / 8u;
        let k = k0 + (v % 8u) * 4u;
        if (m < p.m && k < p.k) {
            return a_vec(base + m * p.a_sm + k, p.k - k);
        }
    } else {
        let k = k0 + v / 32u;
        let m = m0 + (v % 32u) * 4u;
        if (k < p.k && m < p.m) {
            return a_vec(base + k * p.a_sk + m, p.m - m);
        }
    }
    return vec4<f16>(0.0h);
}

fn store_a(tid: u32, s: u32, buf: u32, x: vec4<f16>) {
    let v = tid + s * 256u;
    var at: u32;
    if (LA == 1u) {
        at = (v / 8u) * (SA / 4u) + v % 8u;
    } else {
        at = (v / 32u) * (SA / 4u) + v % 32u;
    }
    sa[buf * SA4 + at] = x;
}

fn load_b(tid: u32, s: u32, n0: u32, k0: u32, base: u32) -> vec4<f16> {
    let v = tid + s * 256u;
    if (LB == 1u) {
        let k = k0 + v / 32u;
        let n = n0 + (v % 32u) * 4u;
        if (k < p.k && n < p.n) {
            return b_vec(base + k * p.b_sk + n, p.n - n);
        }
    } else {
        let n = n0 + v / 8u;
        let k = k0 + (v % 8u) * 4u;
        if (n < p.n && k < p.k) {
            return b_vec(base + n * p.b_sn + k, p.k - k);
        }
    }
    return vec4<f16>(0.0h);
}

fn store_b(tid: u32, s: u32, buf: u32, x: vec4<f16>) {
    let v = tid + s * 256u;
    var at: u32;
    if (LB == 1u) {
        at = (v / 32u) * (SB / 4u) + v % 32u;
    } else {
        at = (v / 8u) * (SB / 4u) + v % 8u;
    }
    sb[buf * SB4 + at] = x;
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

// Adds the bias to 8 consecutive outputs of row r from columns col.., rounds and writes them.
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
    let a_base = p.a_off + batch * p.a_sb;
    let b_base = p.b_off + batch * p.b_sb;
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

    let ntiles = (p.k + BK - 1u) / BK;
    var ra0 = load_a(tid, 0u, m0, 0u, a_base);
    var ra1 = load_a(tid, 1u, m0, 0u, a_base);
    var ra2 = load_a(tid, 2u, m0, 0u, a_base);
    var ra3 = load_a(tid, 3u, m0, 0u, a_base);
    var rb0 = load_b(tid, 0u, n0, 0u, b_base);
    var rb1 = load_b(tid, 1u, n0, 0u, b_base);
    var rb2 = load_b(tid, 2u, n0, 0u, b_base);
    var rb3 = load_b(tid, 3u, n0, 0u, b_base);
    store_a(tid, 0u, 0u, ra0);
    store_a(tid, 1u, 0u, ra1);
    store_a(tid, 2u, 0u, ra2);
    store_a(tid, 3u, 0u, ra3);
    store_b(tid, 0u, 0u, rb0);
    store_b(tid, 1u, 0u, rb1);
    store_b(tid, 2u, 0u, rb2);
    store_b(tid, 3u, 0u, rb3);
    workgroupBarrier();
    for (var t = 0u; t < ntiles; t = t + 1u) {
        let cur = t % 2u;
        let more = t + 1u < ntiles;
        if (more) {
            let k1 = (t + 1u) * BK;
            ra0 = load_a(tid, 0u, m0, k1, a_base);
            ra1 = load_a(tid, 1u, m0, k1, a_base);
            ra2 = load_a(tid, 2u, m0, k1, a_base);
            ra3 = load_a(tid, 3u, m0, k1, a_base);
            rb0 = load_b(tid, 0u, n0, k1, b_base);
            rb1 = load_b(tid, 1u, n0, k1, b_base);
            rb2 = load_b(tid, 2u, n0, k1, b_base);
            rb3 = load_b(tid, 3u, n0, k1, b_base);
        }
        for (var kk = 0u; kk < BK; kk = kk + 16u) {
            var a0: coop_mat16x16<f16, A>;
            var a1: coop_mat16x16<f16, A>;
            var a2: coop_mat16x16<f16, A>;
            var a3: coop_mat16x16<f16, A>;
            var b0: coop_mat16x16<f16, B>;
            var b1: coop_mat16x16<f16, B>;
            if (LA == 1u) {
                a0 = coopLoadT<coop_mat16x16<f16, A>>(&sa[a_at(cur, wm, kk)], SA / 4u);
                a1 = coopLoadT<coop_mat16x16<f16, A>>(&sa[a_at(cur, wm + 16u, kk)], SA / 4u);
                a2 = coopLoadT<coop_mat16x16<f16, A>>(&sa[a_at(cur, wm + 32u, kk)], SA / 4u);
                a3 = coopLoadT<coop_mat16x16<f16, A>>(&sa[a_at(cur, wm + 48u, kk)], SA / 4u);
            } else {
                a0 = coopLoad<coop_mat16x16<f16, A>>(&sa[a_at(cur, wm, kk)], SA / 4u);
                a1 = coopLoad<coop_mat16x16<f16, A>>(&sa[a_at(cur, wm + 16u, kk)], SA / 4u);
                a2 = coopLoad<coop_mat16x16<f16, A>>(&sa[a_at(cur, wm + 32u, kk)], SA / 4u);
                a3 = coopLoad<coop_mat16x16<f16, A>>(&sa[a_at(cur, wm + 48u, kk)], SA / 4u);
            }
            if (LB == 1u) {
                b0 = coopLoadT<coop_mat16x16<f16, B>>(&sb[b_at(cur, kk, wn)], SB / 4u);
                b1 = coopLoadT<coop_mat16x16<f16, B>>(&sb[b_at(cur, kk, wn + 16u)], SB / 4u);
            } else {
                b0 = coopLoad<coop_mat16x16<f16, B>>(&sb[b_at(cur, kk, wn)], SB / 4u);
                b1 = coopLoad<coop_mat16x16<f16, B>>(&sb[b_at(cur, kk, wn + 16u)], SB / 4u);
            }
            c00 = coopMultiplyAdd(a0, b0, c00);
            c01 = coopMultiplyAdd(a0, b1, c01);
            c10 = coopMultiplyAdd(a1, b0, c10);
            c11 = coopMultiplyAdd(a1, b1, c11);
            c20 = coopMultiplyAdd(a2, b0, c20);
            c21 = coopMultiplyAdd(a2, b1, c21);
            c30 = coopMultiplyAdd(a3, b0, c30);
            c31 = coopMultiplyAdd(a3, b1, c31);
        }
        if (more) {
            let nxt = 1u - cur;
            store_a(tid, 0u, nxt, ra0);
            store_a(tid, 1u, nxt, ra1);
            store_a(tid, 2u, nxt, ra2);
            store_a(tid, 3u, nxt, ra3);
            store_b(tid, 0u, nxt, rb0);
            store_b(tid, 1u, nxt, rb1);
            store_b(tid, 2u, nxt, rb2);
            store_b(tid, 3u, nxt, rb3);
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
