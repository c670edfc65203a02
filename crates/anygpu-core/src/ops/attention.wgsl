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
// With n_splits = 1 the kernel writes the normalised output, each row (b, h, i) at
// b * os.x + h * os.y + i * os.z (attention.rs stores it in [B, Tq, Hq, D] order); otherwise it
// writes, per row (in [B, Hq, Tq] order) and split, (m, l, unnormalised acc[D]) and
// attention_combine.wgsl merges the splits.
//
// Threads: NT = TR * CT. Thread (tr, tc) owns rows tr + TR * i (i < SR = BQ / TR), and
//   - for the scores, keys tc + CT * j (j < SC = BK / CT) of the tile;
//   - for the output, vec4 columns tc + CT * c (c < OC4 = KW4 / CT) of D.
// Scores live in registers; their row max is reduced through red_s, probabilities go through
// s_s to the threads that own the output columns.
//
// The per-thread state (row max / sum / limit, scores, accumulators, staged K/V slots) is a
// set of named variables, and the code touching it is unrolled by attention.rs into the
// generated blocks (DECLS, SCORE_STEP, PV_STEP, ...): drivers keep private arrays in registers
// only when every index is a literal (NVIDIA's Vulkan compiler otherwise puts them in local
// memory; this kernel ran 7x slower that way on an H100).
//
// Every workgroup array is of vec4: wgpu's GL backend zero-fills workgroup memory with one
// store per element from a single invocation, which llvmpipe compiles slowly (per-lane
// branches): vec4 elements make four times fewer stores. It also gives 16-byte reads of P.
//
// Specialisation (header): D, D4 = ceil(D / 4), BQ, BK (a multiple of 4), TR, CT (a multiple
// of 4), NT, KW4 (vec4 columns of a K/V tile row: OC4 * CT >= D4, zero past D4), QS4 and KS4
// (row strides in vec4 of the Q and K/V tiles: odd, so rows fall in different banks), SS4 (row
// stride of s_s in vec4: BK / 4 + 2, staggering rows across banks), CT4 = CT / 4, KV_VEC (K and
// V rows are 4-element aligned with unit stride: loaded a vec4 at a time). Replaced in the
// source: KV_T, the K/V element type (f32, or f16 packed two per u32 word; vec4<f32> /
// vec2<u32> under KV_VEC), KV_AT, its loaders k_at / v_at (one element) and k_at4 / v_at4 (4
// aligned elements), D4_LOOP / NK4_LOOP (loop bounds, see below), the generated blocks, and
// ROUND_Q8: nothing, or (unsplit decode for `Tensor::attention_q8`) the output rows read back
// and rounded to 8-bit blocks for the output projection (ROUND_Q8_ATTENTION in attention.rs).
// Scores are in the log2 domain: Q is pre-multiplied by scale * log2(e), so exp2 replaces exp.

// struct Params: attention_params.wgsl (the header).

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> qb: array<f32>;
@group(0) @binding(2) var<storage, read> kb: array<{{KV_T}}>;
@group(0) @binding(3) var<storage, read> vb: array<{{KV_T}}>;
@group(0) @binding(4) var<storage, read_write> ob: array<f32>;

{{KV_AT}}

// f16 element `e` (its parity picks the half) of a word of two, and 4 halves of two words.
fn half_at(w: u32, e: u32) -> f32 {
    let h = unpack2x16float(w);
    return select(h.x, h.y, (e & 1u) != 0u);
}

fn halves4(w: vec2<u32>) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
}

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

// One vec4 slot `v` of a K (is_v = false) or V tile of rows k0 .. k0 + BK: global loads only
// (the caller keeps it in a register and stashes it after a barrier, so loads overlap other
// work). Zeros past `hi` and in the columns D4 .. KW4 that the output threads' last vec4 column
// covers. Branch-free: out-of-range elements read element `off` (in bounds) and are zeroed
// (llvmpipe's compile time grows fast with the branches between barriers).
fn fetch(v: u32, is_v: bool, bi: u32, hk: u32, k0: u32, hi: u32) -> vec4<f32> {
    var st = p.ks;
    var off = p.k_off;
    if (is_v) {
        st = p.vs;
        off = p.v_off;
    }
    let c4 = v % KW4;
    let j = k0 + v / KW4;
    let row_ok = v < BK * KW4 && j < hi && c4 < D4;
    let base = off + bi * st.x + hk * st.y + j * st.z;
    if (KV_VEC) {
        let at = select(off, base + c4 * 4u, row_ok);
        var x: vec4<f32>;
        if (is_v) {
            x = v_at4(at);
        } else {
            x = k_at4(at);
        }
        return select(vec4<f32>(0.0), x, row_ok);
    }
    let d = c4 * 4u;
    return vec4<f32>(
        kv_elem(is_v, off, base + d * st.w, row_ok && d < D),
        kv_elem(is_v, off, base + (d + 1u) * st.w, row_ok && d + 1u < D),
        kv_elem(is_v, off, base + (d + 2u) * st.w, row_ok && d + 2u < D),
        kv_elem(is_v, off, base + (d + 3u) * st.w, row_ok && d + 3u < D),
    );
}

fn kv_elem(is_v: bool, off: u32, at: u32, ok: bool) -> f32 {
    let e = select(off, at, ok);
    var x: f32;
    if (is_v) {
        x = v_at(e);
    } else {
        x = k_at(e);
    }
    return select(0.0, x, ok);
}

fn stash(v: u32, x: vec4<f32>) {
    if (v < BK * KW4) {
        kv_s[(v / KW4) * KS4 + v % KW4] = x;
    }
}

// Exclusive end of the keys row `vr` (of the G * Tq row space) sees, within kv_hi.
fn row_limit(vr: u32, kv_hi: u32) -> u32 {
    if (p.causal == 0u) {
        return kv_hi;
    }
    let l = i32(vr % p.tq) + i32(p.tk) - i32(p.tq) + 1;
    return u32(clamp(l, 0, i32(kv_hi)));
}

// Row r's max over the CT partial maxes in red_s, and m.
fn row_max(r: u32, m: f32) -> f32 {
    var mx = vec4<f32>(m);
    for (var c = 0u; c < CT4; c++) {
        mx = max(mx, red_s[r * CT4 + c]);
    }
    return max(max(mx.x, mx.y), max(mx.z, mx.w));
}

// Row r's sum of the CT partial sums in red_s.
fn row_sum(r: u32) -> f32 {
    var t4 = vec4<f32>(0.0);
    for (var c = 0u; c < CT4; c++) {
        t4 += red_s[r * CT4 + c];
    }
    return (t4.x + t4.y) + (t4.z + t4.w);
}

// Stores s_s[r][key] (s_s as a [BQ][SS4 * 4] array of f32).
fn p_store(r: u32, key: u32, x: f32) {
    s_s[r * SS4 + key / 4u][key % 4u] = x;
}

// The first 4 * c4 .. output elements of a row that exist (D need not be a multiple of 4).
fn emit(base: u32, c4: u32, o: vec4<f32>) {
    if (c4 >= D4) {
        return;
    }
    let d = c4 * 4u;
    ob[base + d] = o.x;
    if (d + 1u < D) {
        ob[base + d + 1u] = o.y;
    }
    if (d + 2u < D) {
        ob[base + d + 2u] = o.z;
    }
    if (d + 3u < D) {
        ob[base + d + 3u] = o.w;
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
    // A split past the last key holds nothing, and neither merge reads it (they stop at
    // ceil(Tk / split_len)): a decode step's grid covers the cache's whole capacity, most of it
    // unwritten early on.
    if (p.n_splits > 1u && kv_lo >= p.tk) {
        return;
    }
    var kv_hi = min(p.tk, kv_lo + p.split_len);
    if (p.causal != 0u) {
        var imax = row_last % p.tq;
        if (row0 / p.tq != row_last / p.tq) {
            imax = p.tq - 1u;
        }
        let lim = i32(imax) + i32(p.tk) - i32(p.tq) + 1;
        kv_hi = u32(max(i32(kv_lo), min(lim, i32(kv_hi))));
    }

    // Stage the block's queries, scaled (zeros for rows past the end and columns past D).
    for (var idx = t; idx < BQ * D4; idx += NT) {
        let r = idx / D4;
        let d = (idx % D4) * 4u;
        let vr = row0 + r;
        let ok = vr < p.rows;
        let h = hk * p.g + vr / p.tq;
        let base = p.q_off + bi * p.qs.x + h * p.qs.y + (vr % p.tq) * p.qs.z;
        let sw = p.qs.w;
        let q4 = vec4<f32>(
            select(0.0, qb[select(0u, base + d * sw, ok && d < D)], ok && d < D),
            select(0.0, qb[select(0u, base + (d + 1u) * sw, ok && d + 1u < D)], ok && d + 1u < D),
            select(0.0, qb[select(0u, base + (d + 2u) * sw, ok && d + 2u < D)], ok && d + 2u < D),
            select(0.0, qb[select(0u, base + (d + 3u) * sw, ok && d + 3u < D)], ok && d + 3u < D),
        );
        q_s[r * QS4 + idx % D4] = q4 * p.scale;
    }

    // Per owned row i: lim_i (end of its visible keys), m_i (running max), l_i (this thread's
    // share of the running sum), al_i (rescale factor); scores sc_i_j and their vec4 partial
    // sums sa_i_j; accumulators acc_i_c; staged K / V slots rk_s / rv_s.
{{DECLS}}

    // Software pipeline: K of the next tile and V of this one are in flight while this tile's
    // scores and output are computed.
{{FETCH_K_FIRST}}
    for (var k0 = kv_lo; k0 < kv_hi; k0 += BK) {
        // The previous tile's readers of kv_s / s_s are done (first pass: q_s is complete).
        workgroupBarrier();
{{STASH_K}}
{{FETCH_V}}
        workgroupBarrier();

        // S = Q K^T for the owned (row, key) pairs, as vec4 partial sums (independent FMA
        // chains). D4_LOOP is D4, or on GL and software rasterizers p.d4 (the same value from
        // the uniform) so that their compilers do not unroll the head dim: llvmpipe's compile
        // time grows with it.
{{ZERO_PARTIALS}}
        for (var d4 = 0u; d4 < {{D4_LOOP}}; d4++) {
{{SCORE_STEP}}
        }
        // Mask, and each thread's share of the row max.
{{MASK}}
        workgroupBarrier();

        // K is consumed (scores are in registers): V takes its place, the next K is fetched.
{{STASH_V}}
{{FETCH_K_NEXT}}
        // Online softmax: new row max, rescale factor, probabilities of the owned keys.
{{SOFTMAX}}
        workgroupBarrier();

        // acc = alpha * acc + P V, four keys per step. NK4_LOOP: BK / 4, or on GL and software
        // rasterizers the tile's real keys rounded up to 4 (past them P and V are 0).
        let nk4 = (min(BK, kv_hi - k0) + 3u) / 4u;
{{RESCALE}}
        for (var k4 = 0u; k4 < {{NK4_LOOP}}; k4++) {
{{PV_STEP}}
        }
    }

    // Row sums: add up the CT partials of each row; write the rows (or this split's partials).
    workgroupBarrier();
{{L_STORE}}
    workgroupBarrier();
{{OUTPUT}}
{{ROUND_Q8}}
}

// One output row: normalised, or (n_splits > 1) this split's m, l and unnormalised acc.
// Returns the row's element base and the factor to apply to its accumulators.
fn out_row(vr: u32, bh: u32, split: u32, m: f32, total: f32, first: bool) -> vec2<u32> {
    if (p.n_splits == 1u) {
        // Row vr of KV head hk's group is query head hk * G + vr / Tq, query vr % Tq.
        let h = (bh % p.hkv) * p.g + vr / p.tq;
        let base = (bh / p.hkv) * p.os.x + h * p.os.y + (vr % p.tq) * p.os.z;
        return vec2<u32>(base, bitcast<u32>(select(0.0, 1.0 / total, total > 0.0)));
    }
    // (b * Hkv + hk) * G * Tq + vr == (b * Hq + h) * Tq + i: the partials row.
    let orow = bh * p.rows + vr;
    let base = (orow * p.n_splits + split) * (D + 2u);
    if (first) {
        ob[base] = m;
        ob[base + 1u] = total;
    }
    return vec2<u32>(base + 2u, bitcast<u32>(1.0));
}
