// Attention for prefill on cooperative matrices (tensor cores): S = Q K^T and O = P V as 16x16x16
// f16 products with f32 accumulators; Q (scaled), K, V and P rounded to f16, the softmax in f32.
//
// A workgroup of 128 invocations (4 subgroups of 32) owns BQ = 64 queries of one head, 16 per
// subgroup, and walks the keys its queries may see BK = 32 at a time through workgroup memory,
// twice: the first walk finds each row's max score, the second sums exp2(s - max) and
// accumulates P V. Two walks instead of flash attention's running max because the products'
// accumulators cannot be rescaled row by row (they are opaque matrices): the second walk
// recomputes Q K^T (cheap on tensor cores; the K tiles come from cache) and O never leaves the
// accumulators until the end.
//
// Queries are rows of the head's [Tq, D] block; head h reads KV head h / (Hq / Hkv). Causal:
// query i sees keys j <= i + (Tk - Tq). Scores are in the log2 domain (Q is pre-scaled by
// scale * log2(e) on the host), as attention.wgsl's.
//
// Workgroup tiles hold vec4<f16>: Q [BQ][SD], K and V [BK][SD] (SD = D + 8 halves: the padding
// puts the rows a matrix load touches in different banks), each subgroup's P [16][SP] (SP =
// BK + 8). Q is a row-major A (coopLoadT), K^T a column-major B (B[d][key] = K[key][d]:
// coopLoad), P a row-major A, V a row-major B. The scores and the final O leave the
// accumulators through a per-subgroup f32 scratch (coopStoreT), from which lane l reads row
// l / 2, columns (l % 2) * 8 .. + 8 of each 16 x 16 matrix; the two lanes of a row meet in
// `xch`. The emulated variant (attention.rs, tests on devices without cooperative matrices)
// swaps the matrix calls for the `emu_*` functions of the last section, which keep to that
// ownership (its scratch is private).
//
// Host constant: D (16, 32, ..., 128); host functions: `to_f16` (ops::TO_F16_WGSL, the rounding
// of activations for the tensor cores) and the output's `out8` (attention_coop.rs).

struct Params {
    batch: u32,
    hq: u32,
    hkv: u32,
    tq: u32,
    tk: u32,
    causal: u32,
    scale: f32, // softmax scale * log2(e)
    n_qb: u32,  // query blocks per head: ceil(Tq / BQ)
    q_off: u32,
    k_off: u32,
    v_off: u32,
    paired: u32, // 1: a workgroup runs query blocks n_qb - 1 - u and u (see `attention`)
    // strides (b, h, t, d) in elements; K and V rows are contiguous (d stride 1)
    qs: vec4<u32>,
    ks: vec4<u32>,
    vs: vec4<u32>,
    os: vec4<u32>, // the output's; its d stride is 1
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> qb: array<f32>;
@group(0) @binding(2) var<storage, read> kb: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> vb: array<vec4<f32>>;
// The output (binding 4) comes from the host (attention_coop.rs, `OUT_F32` / `OUT_F16`): f32,
// or f16 for an output projection that reads x as f16 (`AttentionOpts::f16_out`), with
// `out8(at, s, inv)`: elements at .. at + 8 of the output from scratch[s ..] times inv.

const BQ: u32 = 64u;
const BK: u32 = 32u;
const NT: u32 = 128u;
const SP4: u32 = (BK + 8u) / 4u;
const D4: u32 = D / 4u;
const DT: u32 = D / 16u; // 16-wide blocks of D: O's accumulators, Q K^T's K steps
const SD4: u32 = (D + 8u) / 4u; // row stride of the Q, K, V tiles in vec4<f16>

var<workgroup> sq: array<vec4<f16>, BQ * SD4>;
var<workgroup> sk: array<vec4<f16>, BK * SD4>;
var<workgroup> sv: array<vec4<f16>, BK * SD4>;
var<workgroup> sp: array<vec4<f16>, BQ * SP4>;
var<workgroup> scratch: array<f32, 2048>; // per subgroup: 16 x 32 scores, or a 16 x 16 O block
var<workgroup> xch: array<f32, NT>;

// Masked scores: finite (WGSL does not promise infinities).
const NEG: f32 = -1.0e30;

// A K / V tile is BK x D4 = NT x DT vec4s: invocation t moves vec4s t + j NT (j < DT), key
// (t + j NT) / D4, column (t + j NT) % D4. They are loaded into registers (`fetch`) a tile
// ahead and stored as f16 (`stash`) after the barrier, so the loads of the next tile are in
// flight while this one's products run. K and V rows are contiguous and 16-byte aligned (the
// host checks): vec4 loads; keys past tk read as zeros.
struct Kv {
    k: array<vec4<f32>, DT>,
    v: array<vec4<f32>, DT>,
}

fn fetch(tid: u32, bi: u32, hk: u32, k0: u32, with_v: bool) -> Kv {
    var r: Kv;
    for (var j = 0u; j < DT; j++) {
        let i = tid + j * NT;
        let key = k0 + i / D4;
        let ok = key < p.tk;
        let at = min(key, p.tk - 1u);
        r.k[j] = select(vec4<f32>(0.0), kb[(p.k_off + bi * p.ks.x + hk * p.ks.y + at * p.ks.z) / 4u + i % D4], ok);
        if (with_v) {
            r.v[j] = select(vec4<f32>(0.0), vb[(p.v_off + bi * p.vs.x + hk * p.vs.y + at * p.vs.z) / 4u + i % D4], ok);
        }
    }
    return r;
}

fn stash(tid: u32, r: Kv, with_v: bool) {
    for (var j = 0u; j < DT; j++) {
        let i = tid + j * NT;
        let at = (i / D4) * SD4 + i % D4;
        sk[at] = vec4<f16>(r.k[j]);
        if (with_v) {
            sv[at] = vec4<f16>(r.v[j]);
        }
    }
}

// This subgroup's scores of the staged K tile, S = Q K^T (16 queries x 32 keys), into its
// scratch (row-major, 32 wide). Called by every invocation (it ends with a barrier).
fn scores(sg: u32) {
    var s0 = coop_mat16x16<f32, C>();
    var s1 = coop_mat16x16<f32, C>();
    for (var ks = 0u; ks < DT; ks++) {
        let a = coopLoadT<coop_mat16x16<f16, A>>(&sq[(sg * 16u) * SD4 + ks * 4u], SD4);
        let b0 = coopLoad<coop_mat16x16<f16, B>>(&sk[ks * 4u], SD4);
        let b1 = coopLoad<coop_mat16x16<f16, B>>(&sk[16u * SD4 + ks * 4u], SD4);
        s0 = coopMultiplyAdd(a, b0, s0);
        s1 = coopMultiplyAdd(a, b1, s1);
    }
    coopStoreT(s0, &scratch[sg * 512u], 32u);
    coopStoreT(s1, &scratch[sg * 512u + 16u], 32u);
    workgroupBarrier();
}

// The row partner's value (lanes 2r and 2r + 1 of a subgroup hold row r). Every invocation.
fn partner(tid: u32, v: f32) -> f32 {
    xch[tid] = v;
    workgroupBarrier();
    let o = xch[tid ^ 1u];
    workgroupBarrier();
    return o;
}

// O block j (16 queries x 16 dims) through the scratch: lane l's row l / 2, dims 16 j +
// (l % 2) * 8 .. + 8, divided by the row's sum, written where the row is a real query.
fn emit(o: coop_mat16x16<f32, C>, j: u32, sg: u32, lane: u32, base: u32, live: bool, inv: f32) {
    coopStoreT(o, &scratch[sg * 512u], 16u);
    workgroupBarrier();
    let s = sg * 512u + (lane / 2u) * 16u + (lane % 2u) * 8u;
    if (live) {
        out8(base + 16u * j + (lane % 2u) * 8u, s, inv);
    }
    workgroupBarrier();
}

// A workgroup's query blocks. Unpaired: block n_qb - 1 - u of its head (under a causal mask the
// last blocks see the most keys, so they start first). Paired (the host's choice for many
// blocks under a causal mask, attention_coop.rs `PAIR_MIN_BLOCKS`): blocks n_qb - 1 - u and then
// u, whose keys add up to the same count for every u, so that no workgroup walks twice as many
// keys as the average while others idle (H100, 32 / 8 heads, D = 128, 512 queries: 98 -> 75 us).
@compute @workgroup_size(128)
fn attention(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let wg = wid.x + wid.y * nwg.x;
    let units = select(p.n_qb, (p.n_qb + 1u) / 2u, p.paired == 1u);
    if (wg >= p.batch * p.hq * units) {
        return;
    }
    let u = wg % units;
    let bh = wg / units;
    query_block(p.n_qb - 1u - u, bh, tid, sg, lane);
    if (p.paired == 1u && u != p.n_qb - 1u - u) {
        query_block(u, bh, tid, sg, lane);
    }
}

// Query block qblk of (batch, head) bh: every invocation of the workgroup (it holds barriers).
fn query_block(qblk: u32, bh: u32, tid: u32, sg: u32, lane: u32) {
    let bi = bh / p.hq;
    let h = bh % p.hq;
    let hk = h / (p.hq / p.hkv);
    let q0 = qblk * BQ;
    // The keys any of the block's queries sees.
    var kv_end = p.tk;
    if (p.causal != 0u) {
        kv_end = u32(clamp(i32(p.tk) - i32(p.tq) + i32(min(q0 + BQ, p.tq)), 0, i32(p.tk)));
    }

    // Stage the block's queries, scaled, as f16 (zeros past Tq).
    for (var i = tid; i < BQ * D4; i += NT) {
        let r = i / D4;
        let d = (i % D4) * 4u;
        let qi = q0 + r;
        let ok = qi < p.tq;
        let base = p.q_off + bi * p.qs.x + h * p.qs.y + min(qi, p.tq - 1u) * p.qs.z + d * p.qs.w;
        let v = vec4<f32>(qb[base], qb[base + p.qs.w], qb[base + 2u * p.qs.w], qb[base + 3u * p.qs.w]);
        sq[r * SD4 + i % D4] = to_f16(select(vec4<f32>(0.0), v * p.scale, ok));
    }

    // This lane's row (query) and its columns in each 16-key half of a tile.
    let r = lane / 2u;
    let c0 = (lane % 2u) * 8u;
    let qi = q0 + sg * 16u + r;
    var lim = p.tk;
    if (p.causal != 0u) {
        lim = u32(clamp(i32(qi) + i32(p.tk) - i32(p.tq) + 1, 0, i32(p.tk)));
    }
    let srow = sg * 512u + r * 32u;

    // First walk: the row max.
    var m = NEG;
    var kv = fetch(tid, bi, hk, 0u, false);
    for (var k0 = 0u; k0 < kv_end; k0 += BK) {
        workgroupBarrier();
        stash(tid, kv, false);
        workgroupBarrier();
        if (k0 + BK < kv_end) {
            kv = fetch(tid, bi, hk, k0 + BK, false);
        }
        scores(sg);
        for (var e = 0u; e < 8u; e++) {
            let ka = k0 + c0 + e;
            m = max(m, select(NEG, scratch[srow + c0 + e], ka < lim));
            m = max(m, select(NEG, scratch[srow + 16u + c0 + e], ka + 16u < lim));
        }
    }
    m = max(m, partner(tid, m));

    // Second walk: P = exp2(S - max) (0 where masked), its row sum, O += P V.
    var l = 0.0;
    var o0 = coop_mat16x16<f32, C>();
    var o1 = coop_mat16x16<f32, C>();
    var o2 = coop_mat16x16<f32, C>();
    var o3 = coop_mat16x16<f32, C>();
    var o4 = coop_mat16x16<f32, C>();
    var o5 = coop_mat16x16<f32, C>();
    var o6 = coop_mat16x16<f32, C>();
    var o7 = coop_mat16x16<f32, C>();
    let prow = (sg * 16u + r) * SP4;
    kv = fetch(tid, bi, hk, 0u, true);
    for (var k0 = 0u; k0 < kv_end; k0 += BK) {
        workgroupBarrier();
        stash(tid, kv, true);
        workgroupBarrier();
        if (k0 + BK < kv_end) {
            kv = fetch(tid, bi, hk, k0 + BK, true);
        }
        scores(sg);
        var pa: array<f32, 8>;
        var pb: array<f32, 8>;
        for (var e = 0u; e < 8u; e++) {
            let ka = k0 + c0 + e;
            pa[e] = select(0.0, exp2(scratch[srow + c0 + e] - m), ka < lim);
            pb[e] = select(0.0, exp2(scratch[srow + 16u + c0 + e] - m), ka + 16u < lim);
            l += pa[e] + pb[e];
        }
        sp[prow + c0 / 4u] = vec4<f16>(vec4<f32>(pa[0], pa[1], pa[2], pa[3]));
        sp[prow + c0 / 4u + 1u] = vec4<f16>(vec4<f32>(pa[4], pa[5], pa[6], pa[7]));
        sp[prow + (16u + c0) / 4u] = vec4<f16>(vec4<f32>(pb[0], pb[1], pb[2], pb[3]));
        sp[prow + (16u + c0) / 4u + 1u] = vec4<f16>(vec4<f32>(pb[4], pb[5], pb[6], pb[7]));
        workgroupBarrier();
        for (var kk = 0u; kk < 2u; kk++) {
            let a = coopLoadT<coop_mat16x16<f16, A>>(&sp[(sg * 16u) * SP4 + kk * 4u], SP4);
            let vrow = (kk * 16u) * SD4;
            o0 = coopMultiplyAdd(a, coopLoadT<coop_mat16x16<f16, B>>(&sv[vrow], SD4), o0);
            if (DT > 1u) {
                o1 = coopMultiplyAdd(a, coopLoadT<coop_mat16x16<f16, B>>(&sv[vrow + 4u], SD4), o1);
            }
            if (DT > 2u) {
                o2 = coopMultiplyAdd(a, coopLoadT<coop_mat16x16<f16, B>>(&sv[vrow + 8u], SD4), o2);
                o3 = coopMultiplyAdd(a, coopLoadT<coop_mat16x16<f16, B>>(&sv[vrow + 12u], SD4), o3);
            }
            if (DT > 4u) {
                o4 = coopMultiplyAdd(a, coopLoadT<coop_mat16x16<f16, B>>(&sv[vrow + 16u], SD4), o4);
                o5 = coopMultiplyAdd(a, coopLoadT<coop_mat16x16<f16, B>>(&sv[vrow + 20u], SD4), o5);
                o6 = coopMultiplyAdd(a, coopLoadT<coop_mat16x16<f16, B>>(&sv[vrow + 24u], SD4), o6);
                o7 = coopMultiplyAdd(a, coopLoadT<coop_mat16x16<f16, B>>(&sv[vrow + 28u], SD4), o7);
            }
        }
    }
    l += partner(tid, l);

    // The output rows (b, h, query) at b * os.x + h * os.y + query * os.z.
    let live = qi < p.tq;
    let base = bi * p.os.x + h * p.os.y + min(qi, p.tq - 1u) * p.os.z;
    let inv = select(0.0, 1.0 / l, l > 0.0);
    emit(o0, 0u, sg, lane, base, live, inv);
    if (DT > 1u) {
        emit(o1, 1u, sg, lane, base, live, inv);
    }
    if (DT > 2u) {
        emit(o2, 2u, sg, lane, base, live, inv);
        emit(o3, 3u, sg, lane, base, live, inv);
    }
    if (DT > 4u) {
        emit(o4, 4u, sg, lane, base, live, inv);
        emit(o5, 5u, sg, lane, base, live, inv);
        emit(o6, 6u, sg, lane, base, live, inv);
        emit(o7, 7u, sg, lane, base, live, inv);
    }
}
// @@ emu
// ---- tests only: cooperative matrices emulated (with ops/coop_emu.wgsl) ----------------------
// attention_coop.rs (`set_emulated`) rewrites the matrix types and calls above; `sg` and `lane`
// come from the invocation index (subgroups of 32 consecutive invocations). EmuM.src: 0 A in
// sq, 1 A in sp (row-major), 2 B in sk (column-major), 3 B in sv (row-major).

fn emu_ld(src: u32, at: u32, stride: u32) -> EmuM {
    return EmuM(src, at, stride);
}

// Element (r, c) of a loaded matrix (halves; the arrays hold vec4<f16>, strides count vec4s).
fn emu_el(m: EmuM, r: u32, c: u32) -> f32 {
    switch m.src {
        case 0u: {
            return f32(sq[m.at + r * m.stride + c / 4u][c % 4u]);
        }
        case 1u: {
            return f32(sp[m.at + r * m.stride + c / 4u][c % 4u]);
        }
        case 2u: {
            return f32(sk[m.at + c * m.stride + r / 4u][r % 4u]);
        }
        default: {
            return f32(sv[m.at + r * m.stride + c / 4u][c % 4u]);
        }
    }
}
