// Decode attention over a short cache: one query position, the G query heads of one KV head per
// workgroup, every key of the cache walked at once instead of in flash tiles.
//
// Why a kernel of its own: the flash kernel (attention.wgsl) walks a decode step's keys 32 at a
// time, each tile a chain of loads and four barriers, ~1.5 µs a tile on an H100, so a
// 129-position cache took ~10 µs in one workgroup per KV head. Here the loads come in a few
// batches of many independent ones: every key's K row (eight invocations a key) before its
// scores, V's rows before the softmax is done with, then P V over interleaved runs of keys.
// Only for caches the host plans short (`attention_decode.rs`: every key's scores live in
// workgroup memory).
//
// Specialisation (header): D (a multiple of 32), D4 = D / 4, G query heads per KV head, NT
// invocations, KMAX (the planned keys: p_s's row length), KPP = NT / 8 keys scored per pass, UK
// passes per batch, R (a power of two <= NT / G and <= SGW) invocations per row in the softmax,
// PARTS (a power of two) runs of keys in P V, UV keys per run and batch; SGW (at least 8) and
// lanes_max / lanes_sum from the lane reductions header. Replaced in the source (generated unrolled, as
// named variables: a private array indexed by a loop variable would go to local memory on
// NVIDIA): K_DECL / K_LOAD / SCORES (a batch's K vec4s, then its scores), V_DECL / V_LOAD (a
// batch's V vec4s), ACC_DECL / ACC_STEP / ACC_STORE (the G accumulators of P V over a batch);
// ROUND_Q8 (nothing, or for `Tensor::attention_q8` the output rows rounded to 8-bit blocks as
// they are written, see attention_decode.rs).
//
// Bindings and params as attention.wgsl's (the host fills the same struct): q f32, K and V as
// vec4<f32> (rows 4-element aligned, unit stride), the output, optionally the 8-bit words.

// struct Params: attention_params.wgsl (the header).

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> qb: array<f32>;
@group(0) @binding(2) var<storage, read> kb: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> vb: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> ob: array<f32>;

// The queries, scaled (log2 domain: scale * log2(e)); the scores, then probabilities, of each
// row's keys; each row's 1 / sum; the P V runs' partial rows.
var<workgroup> q_s: array<vec4<f32>, G * D4>;
var<workgroup> p_s: array<f32, G * KMAX>;
var<workgroup> inv_l: array<f32, G>;
var<workgroup> acc_s: array<vec4<f32>, PARTS * G * D4>;

@compute @workgroup_size(NT)
fn attention_decode(
    @builtin(local_invocation_index) t: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let wg = wid.x + wid.y * nwg.x;
    // Whole workgroups past the end return together (no barrier is skipped by part of one).
    if (wg >= p.batch * p.hkv) {
        return;
    }
    let bi = wg / p.hkv;
    let hk = wg % p.hkv;
    let tk = p.tk;

    // Scores: eight invocations per key (c: vec4 columns c, c + 8, ... of its row), KPP keys
    // a pass, UK passes a batch; the first batch's K loads are issued before the queries are
    // staged (they do not depend on them), every batch's before its products. The partial dot
    // products meet in shuffles of 8 lanes.
    let c = t % 8u;
    let kq = t / 8u;
    let kbase = (p.k_off + bi * p.ks.x + hk * p.ks.y) >> 2u;
    let kst = p.ks.z >> 2u;
    var k0 = 0u;
{{K_DECL}}
{{K_LOAD}}

    // The G query rows, scaled.
    for (var e = t; e < G * D4; e += NT) {
        let h = hk * G + e / D4;
        let sw = p.qs.w;
        let base = p.q_off + bi * p.qs.x + h * p.qs.y + (e % D4) * 4u * sw;
        q_s[e] = vec4<f32>(qb[base], qb[base + sw], qb[base + 2u * sw], qb[base + 3u * sw]) * p.scale;
    }
    workgroupBarrier();

    loop {
{{SCORES}}
        k0 += UK * KPP;
        if (k0 >= tk) {
            break;
        }
{{K_LOAD}}
    }

    // V's first batch for P V, in flight during the softmax (it does not depend on it).
    let d4 = t % D4;
    let part = t / D4;
    let vbase = (p.v_off + bi * p.vs.x + hk * p.vs.y) >> 2u;
    let vst = p.vs.z >> 2u;
    var v0k = 0u;
{{V_DECL}}
{{V_LOAD}}
    workgroupBarrier();

    // Softmax of each row over R invocations (aligned lanes of one subgroup: R <= SGW): its
    // max, exp2 of the scores less it, their sum, all in shuffles.
    let g2 = t / R;
    let j = t % R;
    let row_live = g2 < G;
    var m = -1.0e30;
    if (row_live) {
        for (var k = j; k < tk; k += R) {
            m = max(m, p_s[g2 * KMAX + k]);
        }
    }
    m = lanes_max(m, R);
    var l = 0.0;
    if (row_live) {
        for (var k = j; k < tk; k += R) {
            let e = exp2(p_s[g2 * KMAX + k] - m);
            p_s[g2 * KMAX + k] = e;
            l += e;
        }
    }
    l = lanes_sum(l, R);
    if (row_live && j == 0u) {
        inv_l[g2] = select(0.0, 1.0 / l, l > 0.0);
    }
    workgroupBarrier();

    // P V: invocation (run `part`, vec4 column d4) sums keys part, part + PARTS, ... for all G
    // rows (a subgroup reads whole V rows), UV keys a batch, the batch's V loads first.
{{ACC_DECL}}
    loop {
{{ACC_STEP}}
        v0k += UV * PARTS;
        if (v0k >= tk) {
            break;
        }
{{V_LOAD}}
    }
    if (part < PARTS) {
{{ACC_STORE}}
    }
    workgroupBarrier();

    // The rows: the runs added up and normalised, written (and rounded: ROUND_Q8). The trip
    // count is the same for every invocation (the rounding's lanes meet in shuffles).
    let qc4 = p.hkv * G * D4;
    for (var it = 0u; it < (G * D4 + NT - 1u) / NT; it++) {
        let e = t + it * NT;
        let live = e < G * D4;
        let g = min(e / D4, G - 1u);
        let c4 = e % D4;
        let h = hk * G + g;
        var o = vec4<f32>(0.0);
        if (live) {
            for (var r = 0u; r < PARTS; r++) {
                o += acc_s[(r * G + g) * D4 + c4];
            }
            o *= inv_l[g];
            let at = bi * p.os.x + h * p.os.y + c4 * 4u;
            ob[at] = o.x;
            ob[at + 1u] = o.y;
            ob[at + 2u] = o.z;
            ob[at + 3u] = o.w;
        }
{{ROUND_Q8}}
    }
}
