// Fused scaled dot-product attention, flash style: a workgroup owns BQ query rows of one KV
// head and walks that head's keys BK at a time through workgroup memory, keeping a running
// max (m) and sum (l) per row (online softmax), so Tq x Tk scores never exist in memory.
//
// Rows: the G = Hq / Hkv query heads that share a KV head are stacked into one row space of
// G * Tq rows (row vr is head hk * G + vr / Tq, query vr % Tq). For prefill a block is a run of
// queries of one head; for decode (Tq = 1) a block holds the G heads of a group, which then
// read each K/V tile once.
//
// Splits (flash-decoding): the key range may be cut into n_splits pieces, one workgroup each.
// With n_splits = 1 the kernel writes the normalised output; otherwise it writes, per row and
// split, (m, l, unnormalised acc[D]) and attention_combine.wgsl merges the splits.
//
// Threads: NT = TR * CT. Thread (tr, tc) owns rows tr + TR * i (i < SR), and
//   - for the scores, keys tc + CT * j (j < SC) of the tile;
//   - for the output, vec4 columns tc + CT * c (c < OC4) of D.
// Scores live in registers; their row max is reduced through red_s, probabilities go through
// s_s to the threads that own the output columns.
//
// Every workgroup array is of vec4: wgpu's GL backend zero-fills workgroup memory with one
// store per element from a single invocation, which llvmpipe compiles slowly (per-lane
// branches): vec4 elements make four times fewer stores. It also gives 16-byte reads of P.
//
// Specialisation (header): D, D4 = ceil(D / 4), BQ, BK (a multiple of 4), TR, CT (a multiple
// of 4), NT, SR, SC, OC4, KW4 = OC4 * CT (vec4 columns of a K/V tile row, zero past D4), QS4 and
// KS4 (row strides in vec4 of the Q and K/V tiles: odd, so rows fall in different banks), SS4
// (row stride of s_s in vec4: BK / 4 + 2, staggering rows across banks), CT4 = CT / 4,
// LD = ceil(BK * KW4 / NT) (vec4 of a K/V tile per thread), KV_VEC (K and V rows are 4-element
// aligned with unit stride: loaded a vec4 at a time). Replaced in the source: KV_T, the K/V element
// type (f32, or f16 packed two per u32 word; vec4<f32> / vec2<u32> under KV_VEC), and KV_AT,
// its loaders k_at / v_at (one element) and k_at4 / v_at4 (4 aligned elements).
// Scores are in the log2 domain: Q is pre-multiplied by scale * log2(e), so exp2 replaces exp.

struct Params {
    batch: u32,
    hkv: u32,
    g: u32,
    tq: u32,
    tk: u32,
    rows: u32,
    n_rblocks: u32,
    n_splits: u32,
    split_len: u32,
    causal: u32,
    scale: f32,
    d4: u32,
    q_off: u32,
    k_off: u32,
    v_off: u32,
    _pad1: u32,
    // strides (b, h, t, d) in elements
    qs: vec4<u32>,
    ks: vec4<u32>,
    vs: vec4<u32>,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> qb: array<f32>;
@group(0) @binding(2) var<storage, read> kb: array<{{KV_T}}>;
@group(0) @binding(3) var<storage, read> vb: array<{{KV_T}}>;
@group(0) @binding(4) var<storage, read_write> ob: array<f32>;

{{KV_AT}}

// Masked scores are set to NEG (finite: WGSL does not promise IEEE infinities); any score
// above VALID is a real one.
const NEG: f32 = -1.0e30;
const VALID: f32 = -5.0e29;

var<workgroup> q_s: array<vec4<f32>, BQ * QS4>;
var<workgroup> kv_s: array<vec4<f32>, BK * KS4>;
var<workgroup> s_s: array<vec4<f32>, BQ * SS4>;
var<workgroup> red_s: array<vec4<f32>, BQ * CT4>;

// red_s as a [BQ][CT] array of f32.
fn red_store(r: u32, c: u32, x: f32) {
    red_s[r * CT4 + c / 4u][c % 4u] = x;
}

// A K/V tile moves in two steps so that its global loads overlap other work: `fetch` issues
// the loads into registers (LD vec4 per thread), `stash` writes them to kv_s after a barrier.
// Rows k0 .. k0 + BK of K (is_v = false) or V; zeros past `hi` and in the columns D4 .. KW4
// that the output threads' last vec4 column covers.
fn fetch(t: u32, is_v: bool, bi: u32, hk: u32, k0: u32, hi: u32) -> array<vec4<f32>, LD> {
    var st = p.ks;
    var off = p.k_off;
    if (is_v) {
        st = p.vs;
        off = p.v_off;
    }
    var regs: array<vec4<f32>, LD>;
    for (var it = 0u; it < LD; it++) {
        let idx = t + it * NT;
        let kr = idx / KW4;
        let c4 = idx % KW4;
        let j = k0 + kr;
        // Branch-free: out-of-range elements read element `off` (in bounds) and are zeroed.
        // (llvmpipe's compile time grows fast with the branches between barriers.)
        let row_ok = idx < BK * KW4 && j < hi && c4 < D4;
        let base = off + bi * st.x + hk * st.y + j * st.z;
        if ((EXP & 4u) != 0u) {
            regs[it] = vec4<f32>(f32(j));
        } else if (KV_VEC) {
            // Aligned rows with unit stride: one 16-byte (f32) or 8-byte (f16) load.
            let at = select(off, base + c4 * 4u, row_ok);
            var x: vec4<f32>;
            if (is_v) {
                x = v_at4(at);
            } else {
                x = k_at4(at);
            }
            regs[it] = select(vec4<f32>(0.0), x, row_ok);
        } else {
            var val: vec4<f32>;
            for (var e = 0u; e < 4u; e++) {
                let d = c4 * 4u + e;
                let ok = row_ok && d < D;
                let at = select(off, base + d * st.w, ok);
                var x: f32;
                if (is_v) {
                    x = v_at(at);
                } else {
                    x = k_at(at);
                }
                val[e] = select(0.0, x, ok);
            }
            regs[it] = val;
        }
    }
    return regs;
}

fn stash(t: u32, regs: array<vec4<f32>, LD>) {
    for (var it = 0u; it < LD; it++) {
        let idx = t + it * NT;
        if (idx < BK * KW4) {
            kv_s[(idx / KW4) * KS4 + idx % KW4] = regs[it];
        }
    }
}

@compute @workgroup_size(NT)
fn attention(
    @builtin(local_invocation_index) t: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    // Workgroup -> (split, batch x kv head, row block). Row blocks are the slowest index, in
    // reverse: under a causal mask the last blocks have the most keys, so they start first.
    let wg = wid.x + wid.y * nwg.x;
    let split = wg % p.n_splits;
    let rest = wg / p.n_splits;
    let nbh = p.batch * p.hkv;
    if (rest >= nbh * p.n_rblocks) {
        return;
    }
    let bh = rest % nbh;
    let rb = p.n_rblocks - 1u - rest / nbh;
    let bi = bh / p.hkv;
    let hk = bh % p.hkv;
    let row0 = rb * BQ;
    let row_last = min(row0 + BQ, p.rows) - 1u;
    let tr = t / CT;
    let tc = t % CT;

    // This workgroup's keys: its split, cut at the last key any of its rows may see.
    let kv_lo = split * p.split_len;
    var kv_hi = min(p.tk, kv_lo + p.split_len);
    if (p.causal != 0u) {
        var imax = row_last % p.tq;
        if (row0 / p.tq != row_last / p.tq) {
            imax = p.tq - 1u;
        }
        let lim = i32(imax) + i32(p.tk) - i32(p.tq) + 1;
        kv_hi = u32(max(i32(kv_lo), min(lim, i32(kv_hi))));
    }

    // Per owned row: the end (exclusive) of its visible keys.
    var lim: array<u32, SR>;
    for (var i = 0u; i < SR; i++) {
        lim[i] = kv_hi;
        if (p.causal != 0u) {
            let pos = (row0 + tr + TR * i) % p.tq;
            let l = i32(pos) + i32(p.tk) - i32(p.tq) + 1;
            lim[i] = u32(clamp(l, 0, i32(kv_hi)));
        }
    }

    // Stage the block's queries, scaled (zeros for rows past the end and columns past D).
    for (var idx = t; idx < BQ * D4; idx += NT) {
        let r = idx / D4;
        let c4 = idx % D4;
        let vr = row0 + r;
        var val = vec4<f32>(0.0);
        if (vr < p.rows) {
            let h = hk * p.g + vr / p.tq;
            let base = p.q_off + bi * p.qs.x + h * p.qs.y + (vr % p.tq) * p.qs.z;
            for (var e = 0u; e < 4u; e++) {
                let d = c4 * 4u + e;
                if (d < D) {
                    val[e] = qb[base + d * p.qs.w];
                }
            }
        }
        q_s[r * QS4 + c4] = val * p.scale;
    }

    var m: array<f32, SR>;
    var l: array<f32, SR>;
    var alpha: array<f32, SR>;
    var acc: array<vec4<f32>, SR * OC4>;
    var s: array<f32, SR * SC>;
    for (var i = 0u; i < SR; i++) {
        m[i] = NEG;
        l[i] = 0.0;
    }
    for (var x = 0u; x < SR * OC4; x++) {
        acc[x] = vec4<f32>(0.0);
    }

    // Software pipeline: K of the next tile and V of this one are in flight while this tile's
    // scores and output are computed.
    var kregs = fetch(t, false, bi, hk, kv_lo, kv_hi);
    for (var k0 = kv_lo; k0 < kv_hi; k0 += BK) {
        // The previous tile's readers of kv_s / s_s are done (first pass: q_s is complete).
        workgroupBarrier();
        stash(t, kregs);
        let vregs = fetch(t, true, bi, hk, k0, kv_hi);
        workgroupBarrier();

        // S = Q K^T for the owned (row, key) pairs, accumulated as vec4 partial sums: 4
        // independent FMA chains per score instead of one dependent dot() chain.
        var s4: array<vec4<f32>, SR * SC>;
        // D4_LOOP is D4, or on GL and software rasterizers p.d4 (the same value from the
        // uniform) so that the compiler does not unroll the head dim: llvmpipe's compile time
        // grows with it.
        for (var d4 = 0u; d4 < select({{D4_LOOP}}, 0u, (EXP & 1u) != 0u); d4++) {
            var qv: array<vec4<f32>, SR>;
            for (var i = 0u; i < SR; i++) {
                qv[i] = q_s[(tr + TR * i) * QS4 + d4];
            }
            for (var j = 0u; j < SC; j++) {
                let kv = kv_s[(tc + CT * j) * KS4 + d4];
                for (var i = 0u; i < SR; i++) {
                    s4[i * SC + j] += qv[i] * kv;
                }
            }
        }
        for (var x = 0u; x < SR * SC; x++) {
            s[x] = (s4[x].x + s4[x].y) + (s4[x].z + s4[x].w);
        }
        // Mask, and each thread's share of the row max.
        for (var i = 0u; i < SR; i++) {
            var mx = NEG;
            for (var j = 0u; j < SC; j++) {
                let key = k0 + tc + CT * j;
                if (key >= lim[i]) {
                    s[i * SC + j] = NEG;
                }
                mx = max(mx, s[i * SC + j]);
            }
            red_store(tr + TR * i, tc, mx);
        }
        workgroupBarrier();

        // K is consumed (scores are in registers): V takes its place, the next K is fetched.
        stash(t, vregs);
        kregs = fetch(t, false, bi, hk, k0 + BK, kv_hi);
        // Online softmax: new row max, rescale factor, probabilities of the owned keys.
        for (var i = 0u; i < SR; i++) {
            let r = tr + TR * i;
            var mx4 = vec4<f32>(m[i]);
            for (var c = 0u; c < CT4; c++) {
                mx4 = max(mx4, red_s[r * CT4 + c]);
            }
            let mx = max(max(mx4.x, mx4.y), max(mx4.z, mx4.w));
            alpha[i] = exp2(m[i] - mx);
            m[i] = mx;
            var sum = 0.0;
            for (var j = 0u; j < SC; j++) {
                let sv = s[i * SC + j];
                let pj = select(0.0, exp2(sv - mx), sv > VALID);
                sum += pj;
                let key = tc + CT * j;
                s_s[r * SS4 + key / 4u][key % 4u] = pj;
            }
            // l is this thread's partial sum over its keys; the CT partials of a row share m.
            l[i] = l[i] * alpha[i] + sum;
        }
        workgroupBarrier();

        // acc = alpha * acc + P V for the owned (row, column) pairs.
        for (var i = 0u; i < SR; i++) {
            for (var c = 0u; c < OC4; c++) {
                acc[i * OC4 + c] *= alpha[i];
            }
        }
        // Four keys per step; a runtime bound (the tile's real keys, rounded up to 4: past them
        // P is 0 and V is 0) skips the padding of a partial tile.
        let nk4 = select((min(BK, kv_hi - k0) + 3u) / 4u, 0u, (EXP & 2u) != 0u);
        for (var k4 = 0u; k4 < nk4; k4++) {
            var pv: array<vec4<f32>, SR>;
            for (var i = 0u; i < SR; i++) {
                pv[i] = s_s[(tr + TR * i) * SS4 + k4];
            }
            for (var e = 0u; e < 4u; e++) {
                let kk = k4 * 4u + e;
                for (var c = 0u; c < OC4; c++) {
                    // Columns past D4 read the tile's zero padding (no branch in the hot loop).
                    let vv = kv_s[kk * KS4 + tc + CT * c];
                    for (var i = 0u; i < SR; i++) {
                        acc[i * OC4 + c] += pv[i][e] * vv;
                    }
                }
            }
        }
    }

    // Row sums: add up the CT partials of each row.
    workgroupBarrier();
    for (var i = 0u; i < SR; i++) {
        red_store(tr + TR * i, tc, l[i]);
    }
    workgroupBarrier();
    for (var i = 0u; i < SR; i++) {
        let r = tr + TR * i;
        let vr = row0 + r;
        if (vr >= p.rows) {
            continue;
        }
        var t4 = vec4<f32>(0.0);
        for (var c = 0u; c < CT4; c++) {
            t4 += red_s[r * CT4 + c];
        }
        let total = t4.x + t4.y + t4.z + t4.w;
        // (b * Hkv + hk) * G * Tq + vr == (b * Hq + h) * Tq + i: the output row.
        let orow = bh * p.rows + vr;
        var base = orow * D;
        var norm = select(0.0, 1.0 / total, total > 0.0);
        if (p.n_splits > 1u) {
            base = (orow * p.n_splits + split) * (D + 2u);
            if (tc == 0u) {
                ob[base] = m[i];
                ob[base + 1u] = total;
            }
            base += 2u;
            norm = 1.0;
        }
        for (var c = 0u; c < OC4; c++) {
            let c4 = tc + CT * c;
            if (c4 < D4) {
                let o = acc[i * OC4 + c] * norm;
                for (var e = 0u; e < 4u; e++) {
                    let d = c4 * 4u + e;
                    if (d < D) {
                        ob[base + d] = o[e];
                    }
                }
            }
        }
    }
}
