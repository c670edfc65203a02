// y = W x with W in GGML blocks, read as stored (decode: one token, memory-bound).
//
// A workgroup of WGS invocations (256; 1024 under the rounding epilogue, see gpu.rs) has RPW =
// WGS / TPR row slots, TPR invocations per slot, and
// each slot computes RPS (1 or 2) rows of W: two share each unit's x loads (`mv_unit2`; the
// float types' choice, see matvec_layout.rs). Invocation t of a slot takes the row's work
// units t, t + TPR, ... A unit is one or two 4-byte words of a block's quants (8 to 16 weights) plus the block's scales, so neighbouring
// invocations read neighbouring words of W *and* neighbouring vec4s of x: a warp's loads touch
// a few cache lines each. (Whole blocks per invocation put neighbours' x reads 128-256 bytes
// apart: every vec4 load of a warp touched 32 lines, and the kernel ran at a quarter of the
// bandwidth on an H100.) The scales are re-read by the invocations sharing a block, from the
// same cache line. Each unit is decoded in registers and multiplied with x at once; the
// min / offset terms are folded per group as d * sum(q x) - m * sum(x). Partial sums meet in a
// workgroup tree. Small batches run extra workgroups: workgroup g handles row group
// g % groups of x row g / groups.
//
// Assembled by the host from common.wgsl and this file, keeping the `// @@` sections of one type
// (see common.wgsl), with `const WGS`, `const TPR`, `const RPW`, `const RPS`, and `fn mv_unit(rb, u, xb)`
// forwarding to the type's function (and `mv_unit2(rb, rb2, u, xb)`, both rows' units). `rb`
// is the row's first byte; `xb` the x row's first vec4 for the quantized types (whose rows are whole 32-weight blocks), its first element for
// F32/F16/BF16.

struct Params {
    rows: u32,       // rows of W in this dispatch
    cols: u32,
    row_bytes: u32,
    w_off: u32,      // byte offset of this dispatch's first row inside the weight binding
    units: u32,      // work units per row
    x_off: u32,      // first x element (vec4 units for quantized types)
    x_stride: u32,   // x row stride, same units
    out_off: u32,    // output index of (x row 0, W row 0 of this dispatch)
    out_stride: u32, // output elements per x row
    groups: u32,     // workgroups per x row
    n: u32,          // x rows
    r_off: u32,      // residual index of (x row 0, row 0) when the epilogue adds one
    eps: f32,        // RMSNorm epsilon when the prologue normalises x
    _pad0: u32,      // always 0 (the prologues' prefetch)
    xd_off: u32,     // Q8 x: the word of x row 0's block scales (matvec_q8.wgsl)
    _pad2: u32,
    // More fields where needed: the rope epilogue's or the combine prologue's (see gpu.rs).
{{PARAMS_EXT}}
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> w: array<u32>;
// `w4_at(i)`: the four words of W from word i (a multiple of 4 wherever a type reads them so):
// four word loads here, one 16-byte load where the host binds W as vec4s instead (Q4_K / Q5_K
// with Q8 x: gpu.rs, `vec4_weights` replaces the declaration above and rewrites every `w[i]`).
{{W_VIEW}}
// x: one of two views of binding 2 is used, depending on the type (never both in one
// pipeline). With the RMSNorm prologue, x4 / x1 are instead workgroup arrays holding the
// normalised x row (see PROLOGUE), and binding 2 is `xin`; with the combine prologue they hold
// the x row merged from a split attention's partials, bound at binding 2 as `part`
// (matvec_combine.wgsl).
{{X_DECL}}
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
// Epilogues (chosen by the host): `out = W x` (STORE), `out = W x + resid` (ADD: the residual
// connection, saving a separate add dispatch), or GLU: W stacks gate rows [0, F) over up rows
// [F, 2F) and `out = silu(W_gate x) * (W_up x)` for F = p.rows (saving two dispatches and the
// round trip of both halves through memory). Each workgroup then takes RPW / 2 output rows:
// its first half of row slots computes the gate rows, the second half the matching up rows.
// ROPE_KV pairs rows the same way: W stacks the Q|K|V projections (H + 2 Hkv heads of D rows),
// and the two slots of a pair compute the two elements one rope rotation mixes (rows 2i and
// 2i + 1 of a head, or i and i + rotary_dim / 2 in the NeoX layout), so one invocation has both
// dot products: it rotates Q and K heads and writes Q to `out`, K and V into the KV caches
// (saving the rope_kv dispatch; see matvec_rope.wgsl).
{{EPILOGUE_DECL}}

var<workgroup> red: array<f32, WGS>;

// SGW, `fn lanes_sum(v, width) -> f32` (the sum of v over aligned groups of `width` <= SGW
// lanes, in every lane of a group) and `lanes_max` come with the header: subgroup shuffles where the device has subgroups of at least
// SGW lanes, else SGW = 1 and lanes_sum(v, 1) = v (the trees below then do all the work). A
// tree level costs a workgroup barrier; shuffles take SmolLM2's 576-wide products from 13
// levels (the RMSNorm prologue's 8, the row's 5) to 3.

fn hsum(v: vec4<f32>) -> f32 {
    return v.x + v.y + v.z + v.w;
}

// ---- plain float rows: 4 elements per unit, masked at the row end ----------------------------

// @@ f32 f16 bf16
// x[e..e+4] of the row starting at element xb, zero past the row end. X1_4: where every x row
// starts on a 16-byte boundary and holds a multiple of 4 elements (x read from its binding),
// the host makes this one 16-byte load, `x4[(xb + e) >> 2u]` (x4 views the same binding);
// else `x1_4_scalar(xb, e)`. A warp's four scalar loads at a 16-byte stride each touch 512
// bytes: four times the cache traffic of one vec4 load.
fn x1_4(xb: u32, e: u32) -> vec4<f32> {
    return {{X1_4}};
}

// @@ f32 f16 bf16
fn x1_4_scalar(xb: u32, e: u32) -> vec4<f32> {
    let ok = vec4<u32>(e, e + 1u, e + 2u, e + 3u) < vec4<u32>(p.cols);
    return select(vec4<f32>(0.0), vec4<f32>(x1[xb + e], x1[xb + e + 1u], x1[xb + e + 2u], x1[xb + e + 3u]), ok);
}

// @@ f32 f16 bf16
fn cols_ok(e: u32) -> vec4<bool> {
    return vec4<u32>(e, e + 1u, e + 2u, e + 3u) < vec4<u32>(p.cols);
}

// @@ f32
fn mv_f32(rb: u32, u: u32, xb: u32) -> f32 {
    let e = 4u * u;
    let i = (rb >> 2u) + e;
    let v = bitcast<vec4<f32>>(vec4<u32>(w[i], w[i + 1u], w[i + 2u], w[i + 3u]));
    // Masked with select, not by x = 0: bytes past the row may decode to NaN.
    return dot(select(vec4<f32>(0.0), v, cols_ok(e)), x1_4(xb, e));
}

// @@ f16
// F16 / BF16: 8 bytes per unit; rows of odd length start mid-word, hence u32_at there. Rows of
// even length (every real model's) start on a word: two plain loads (u32_at would make four
// loads and a funnel shift per unit, in a kernel bound by its loads).
fn mv_f16(rb: u32, u: u32, xb: u32) -> f32 {
    let e = 4u * u;
    let o = rb + 8u * u;
    var lo: u32;
    var hi: u32;
    if ((rb & 3u) == 0u) {
        lo = w[o >> 2u];
        hi = w[(o >> 2u) + 1u];
    } else {
        lo = u32_at(o);
        hi = u32_at(o + 4u);
    }
    let v = vec4<f32>(unpack2x16float(lo), unpack2x16float(hi));
    return dot(select(vec4<f32>(0.0), v, cols_ok(e)), x1_4(xb, e));
}

// @@ bf16
fn mv_bf16(rb: u32, u: u32, xb: u32) -> f32 {
    let e = 4u * u;
    let a = u32_at(rb + 8u * u);
    let b = u32_at(rb + 8u * u + 4u);
    let v = bitcast<vec4<f32>>(vec4<u32>(a << 16u, a & 0xFFFF0000u, b << 16u, b & 0xFFFF0000u));
    return dot(select(vec4<f32>(0.0), v, cols_ok(e)), x1_4(xb, e));
}
// @@ end

// ---- 32-weight blocks: 4 units per block -------------------------------------------------------
// Unit (b, j): qs word j = bytes 4j..4j+4, i.e. weights 4j.. (low nibbles, x4[8b + j]) and
// 16 + 4j.. (high nibbles, x4[8b + 4 + j]).

// @@ q4_0
fn mv_q4_0(rb: u32, u: u32, xb: u32) -> f32 {
    let b = u >> 2u;
    let j = u & 3u;
    let off = rb + b * 18u;
    let q = u32_at(off + 2u + 4u * j);
    let xo = xb + 8u * b + j;
    let s = dot(u8x4b(q & 0x0F0F0F0Fu, 8.0), x4[xo]) + dot(u8x4b((q >> 4u) & 0x0F0F0F0Fu, 8.0), x4[xo + 4u]);
    return f16_at(off) * s;
}

// @@ q4_1
fn mv_q4_1(rb: u32, u: u32, xb: u32) -> f32 {
    let b = u >> 2u;
    let i = (rb + b * 20u) >> 2u;
    let dm = unpack2x16float(w[i]);
    let q = w[i + 1u + (u & 3u)];
    let xo = xb + 8u * b + (u & 3u);
    let xl = x4[xo];
    let xh = x4[xo + 4u];
    return dm.x * (dot(nib4(q), xl) + dot(nib4(q >> 4u), xh)) + dm.y * hsum(xl + xh);
}

// @@ q5_0 q5_1
// The 5-bit values of Q5_0 / Q5_1 unit j (qs word q, high bits qh), a byte each: the low
// nibbles' (weights 4j..) and the high nibbles' (16 + 4j..).
fn q5_bytes(q: u32, qh: u32, j: u32) -> vec2<u32> {
    return vec2<u32>((q & 0x0F0F0F0Fu) | spread4(qh >> (4u * j)), ((q >> 4u) & 0x0F0F0F0Fu) | spread4(qh >> (16u + 4u * j)));
}

// @@ q5_0
fn mv_q5_0(rb: u32, u: u32, xb: u32) -> f32 {
    let b = u >> 2u;
    let j = u & 3u;
    let off = rb + b * 22u;
    let v = q5_bytes(u32_at(off + 6u + 4u * j), u32_at(off + 2u), j);
    let xo = xb + 8u * b + j;
    return f16_at(off) * (dot(u8x4b(v.x, 16.0), x4[xo]) + dot(u8x4b(v.y, 16.0), x4[xo + 4u]));
}

// @@ q5_1
fn mv_q5_1(rb: u32, u: u32, xb: u32) -> f32 {
    let b = u >> 2u;
    let j = u & 3u;
    let i = (rb + b * 24u) >> 2u;
    let dm = unpack2x16float(w[i]);
    let v = q5_bytes(w[i + 2u + j], w[i + 1u], j);
    let xo = xb + 8u * b + j;
    let xl = x4[xo];
    let xh = x4[xo + 4u];
    return dm.x * (dot(u8x4(v.x), xl) + dot(u8x4(v.y), xh)) + dm.y * hsum(xl + xh);
}

// @@ q8_0
// Q8_0 unit (b, j): bytes 8j..8j+8 of qs, weights 8j.. (x4[8b + 2j], x4[8b + 2j + 1]).
fn mv_q8_0(rb: u32, u: u32, xb: u32) -> f32 {
    let b = u >> 2u;
    let j = u & 3u;
    let off = rb + b * 34u;
    let qo = off + 2u + 8u * j;
    let xo = xb + 8u * b + 2u * j;
    return f16_at(off) * (dot(i8x4(u32_at(qo)), x4[xo]) + dot(i8x4(u32_at(qo + 4u)), x4[xo + 1u]));
}
// @@ end

// ---- k-quants: 16 units per 256-weight super-block ---------------------------------------------

// @@ q2k
// Q2_K unit (b, j), j = 8n + 4h + m: qs word j (bytes 32n + 16h + 4m..), which holds weights
// 128n + 32jj + 16h + 4m.. (jj 0..4, at shift 2jj) of groups 8n + 2jj + h: x4[32n + 8jj + 4h + m].
fn mv_q2k(rb: u32, u: u32, xb: u32) -> f32 {
    let b = u >> 4u;
    let j = u & 15u;
    let n = j >> 3u;
    let h = (j >> 2u) & 1u;
    let i = (rb + b * 84u) >> 2u;
    let dd = unpack2x16float(w[i + 20u]);
    let q = w[i + 4u + j];
    // Scale bytes 8n + 2jj + h: byte h (jj even) or 2 + h (jj odd) of word 2n (jj 0, 1) or
    // word 2n + 1 (jj 2, 3).
    let s01 = w[i + 2u * n];
    let s23 = w[i + 2u * n + 1u];
    let xo = xb + 64u * b + 32u * n + (j & 7u);
    var sq = 0.0;
    var sm = 0.0;
    for (var jj = 0u; jj < 4u; jj++) {
        let xv = x4[xo + 8u * jj];
        let sc = (select(s01, s23, jj >= 2u) >> (8u * h + 16u * (jj & 1u))) & 0xFFu;
        sq += f32(sc & 15u) * dot(u8x4((q >> (2u * jj)) & 0x03030303u), xv);
        sm += f32(sc >> 4u) * hsum(xv);
    }
    return dd.x * sq - dd.y * sm;
}

// @@ q3k
// Signed scale of Q3_K group g from the 12 scale bytes held in words s0, s1, s2.
fn q3k_scale_w(s0: u32, s1: u32, s2: u32, g: u32) -> f32 {
    let sh = 8u * (g & 3u);
    let low = ((select(s0, s1, (g & 7u) >= 4u) >> sh) >> (4u * (g >> 3u))) & 15u;
    let high = ((s2 >> sh) >> (2u * (g >> 2u))) & 3u;
    return f32(i32(low | (high << 4u)) - 32);
}

// @@ q3k
// Q3_K unit (b, j) as Q2_K, plus the high bits: hmask word 4h + m, bit 4n + jj of each byte.
fn mv_q3k(rb: u32, u: u32, xb: u32) -> f32 {
    let b = u >> 4u;
    let j = u & 15u;
    let n = j >> 3u;
    let h = (j >> 2u) & 1u;
    let off = rb + b * 110u;
    let q = u32_at(off + 32u + 4u * j);
    let hm = u32_at(off + 4u * (j & 7u));
    let s0 = u32_at(off + 96u);
    let s1 = u32_at(off + 100u);
    let s2 = u32_at(off + 104u);
    let xo = xb + 64u * b + 32u * n + (j & 7u);
    var s = 0.0;
    for (var jj = 0u; jj < 4u; jj++) {
        let v = ((q >> (2u * jj)) & 0x03030303u) | (((hm >> (4u * n + jj)) & 0x01010101u) << 2u);
        s += q3k_scale_w(s0, s1, s2, 8u * n + 2u * jj + h) * dot(u8x4b(v, 4.0), x4[xo + 8u * jj]);
    }
    return f16_at(off + 108u) * s;
}

// @@ q4k q5k
// The scales of a Q4_K / Q5_K unit of chunk k in the super-block starting at word i:
// (d, dmin), and the (scale, min) of its low-nibble group 2k and high-nibble group 2k + 1.
// Shared with matvec_q8.wgsl.
struct KScales {
    dd: vec2<f32>,
    lo: vec2<f32>,
    hi: vec2<f32>,
}

// @@ q4k q5k
fn k_scales(i: u32, k: u32) -> KScales {
    let s = w4_at(i);
    return KScales(unpack2x16float(s.x), scale_min_k4_w(s.y, s.z, s.w, 2u * k), scale_min_k4_w(s.y, s.z, s.w, 2u * k + 1u));
}

// @@ q5k
// The 5-bit values of Q5_K unit j = 4k + mm of the super-block at word i, a byte each: its two
// low-nibble words (group 2k) and its two high-nibble words (group 2k + 1).
fn q5k_bytes(i: u32, j: u32) -> vec4<u32> {
    let k = j >> 2u;
    let mm = j & 3u;
    let h0 = w[i + 4u + 2u * mm] >> (2u * k);
    let h1 = w[i + 5u + 2u * mm] >> (2u * k);
    let q0 = w[i + 12u + 2u * j];
    let q1 = w[i + 13u + 2u * j];
    return vec4<u32>(
        (q0 & 0x0F0F0F0Fu) | ((h0 & 0x01010101u) << 4u),
        (q1 & 0x0F0F0F0Fu) | ((h1 & 0x01010101u) << 4u),
        ((q0 >> 4u) & 0x0F0F0F0Fu) | ((h0 & 0x02020202u) << 3u),
        ((q1 >> 4u) & 0x0F0F0F0Fu) | ((h1 & 0x02020202u) << 3u),
    );
}

// @@ q4k
// Q4_K unit (b, j), j = 4k + mm: words 2mm, 2mm + 1 of chunk k, i.e. weights 64k + 8mm.. (low
// nibbles, group 2k, x4[16k + 2mm + 0..2]) and 64k + 32 + 8mm.. (high, group 2k + 1, x4[+8]).
fn mv_q4k(rb: u32, u: u32, xb: u32) -> f32 {
    let b = u >> 4u;
    let j = u & 15u;
    let k = j >> 2u;
    let i = (rb + b * 144u) >> 2u;
    let sc = k_scales(i, k);
    let qi = i + 4u + 2u * j;
    let q0 = w[qi];
    let q1 = w[qi + 1u];
    let xo = xb + 64u * b + 16u * k + 2u * (j & 3u);
    let xl0 = x4[xo];
    let xl1 = x4[xo + 1u];
    let xh0 = x4[xo + 8u];
    let xh1 = x4[xo + 9u];
    let dot_q = sc.lo.x * (dot(nib4(q0), xl0) + dot(nib4(q1), xl1))
        + sc.hi.x * (dot(nib4(q0 >> 4u), xh0) + dot(nib4(q1 >> 4u), xh1));
    let dot_m = sc.lo.y * hsum(xl0 + xl1) + sc.hi.y * hsum(xh0 + xh1);
    return sc.dd.x * dot_q - sc.dd.y * dot_m;
}

// @@ q5k
// Q5_K unit as Q4_K, with the fifth bits at bits 2k (low) / 2k + 1 (high) of qh words
// 2mm, 2mm + 1.
fn mv_q5k(rb: u32, u: u32, xb: u32) -> f32 {
    let b = u >> 4u;
    let j = u & 15u;
    let k = j >> 2u;
    let mm = j & 3u;
    let i = (rb + b * 176u) >> 2u;
    let sc = k_scales(i, k);
    let v = q5k_bytes(i, j);
    let xo = xb + 64u * b + 16u * k + 2u * mm;
    let xl0 = x4[xo];
    let xl1 = x4[xo + 1u];
    let xh0 = x4[xo + 8u];
    let xh1 = x4[xo + 9u];
    let dot_q = sc.lo.x * (dot(u8x4(v.x), xl0) + dot(u8x4(v.y), xl1)) + sc.hi.x * (dot(u8x4(v.z), xh0) + dot(u8x4(v.w), xh1));
    let dot_m = sc.lo.y * hsum(xl0 + xl1) + sc.hi.y * hsum(xh0 + xh1);
    return sc.dd.x * dot_q - sc.dd.y * dot_m;
}

// @@ q6k
// Q6_K unit j = 8n + m of the super-block at byte off: ql words at 64n + 4m and 64n + 32 + 4m,
// qh word at 128 + 32n + 4m hold weights 128n + 32i + 4m.. for runs i 0..4, whose 6-bit values
// (0..63, a byte each) come in v[i]; their signed scales (bytes 8n + m / 4 + 2i) in sc[i].
struct Q6kUnit {
    v: vec4<u32>,
    sc: vec4<f32>,
}

// @@ q6k
fn q6k_unit(off: u32, n: u32, m: u32) -> Q6kUnit {
    let qa = u32_at(off + 64u * n + 4u * m);
    let qb = u32_at(off + 64u * n + 32u + 4u * m);
    let qh = u32_at(off + 128u + 32u * n + 4u * m);
    let s0 = u32_at(off + 192u + 8u * n);
    let s1 = u32_at(off + 196u + 8u * n);
    let v = vec4<u32>(
        (qa & 0x0F0F0F0Fu) | ((qh & 0x03030303u) << 4u),
        (qb & 0x0F0F0F0Fu) | (((qh >> 2u) & 0x03030303u) << 4u),
        ((qa >> 4u) & 0x0F0F0F0Fu) | (((qh >> 4u) & 0x03030303u) << 4u),
        ((qb >> 4u) & 0x0F0F0F0Fu) | (((qh >> 6u) & 0x03030303u) << 4u),
    );
    let sh = 8u * (m >> 2u);
    let sc = vec4<f32>(
        f32(i8_of((s0 >> sh) & 0xFFu)),
        f32(i8_of((s0 >> (sh + 16u)) & 0xFFu)),
        f32(i8_of((s1 >> sh) & 0xFFu)),
        f32(i8_of((s1 >> (sh + 16u)) & 0xFFu)),
    );
    return Q6kUnit(v, sc);
}

// @@ q6k
// Q6_K unit (b, j), j = 8n + m: run i of q6k_unit meets x4[32n + 8i + m].
fn mv_q6k(rb: u32, u: u32, xb: u32) -> f32 {
    let b = u >> 4u;
    let j = u & 15u;
    let n = j >> 3u;
    let m = j & 7u;
    let off = rb + b * 210u;
    let q = q6k_unit(off, n, m);
    let xo = xb + 64u * b + 32u * n + m;
    let a = vec4<f32>(
        dot(u8x4b(q.v.x, 32.0), x4[xo]),
        dot(u8x4b(q.v.y, 32.0), x4[xo + 8u]),
        dot(u8x4b(q.v.z, 32.0), x4[xo + 16u]),
        dot(u8x4b(q.v.w, 32.0), x4[xo + 24u]),
    );
    return f16_at(off + 208u) * dot(q.sc, a);
}
// @@ end

// ---- entry point -------------------------------------------------------------------------------

@compute @workgroup_size(WGS)
fn matvec(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let g = wid.x + wid.y * nwg.x;
    let xr = g / p.groups;
    let slot = lid / TPR;
    // The output row, and the row of W this invocation reads.
{{ROWS}}
    let t = lid % TPR;
    let live = orow < p.rows && xr < p.n;
    var acc = 0.0;
    var acc2 = 0.0;
{{PROLOGUE}}
    if (live && RPS == 2u) {
        // Two rows per slot (`row`, `row2`): each unit's x is loaded once for both rows
        // (`mv_unit2`: the two rows' units, whose equal x loads the compiler shares), halving
        // the x traffic per weight byte.
        let rb = p.w_off + row * p.row_bytes;
        let rb2 = p.w_off + row2 * p.row_bytes;
        let xb = {{XB}};
        var u = t;
        for (; u + TPR < p.units; u += 2u * TPR) {
            let a = mv_unit2(rb, rb2, u, xb);
            let b = mv_unit2(rb, rb2, u + TPR, xb);
            acc += a.x + b.x;
            acc2 += a.y + b.y;
        }
        if (u < p.units) {
            let a = mv_unit2(rb, rb2, u, xb);
            acc += a.x;
            acc2 += a.y;
        }
    }
    if (live && RPS == 1u) {
        let rb = p.w_off + row * p.row_bytes;
        let xb = {{XB}};
        // Four units per step: their loads are independent, so each invocation keeps four
        // memory requests in flight instead of one (the kernel is latency-bound otherwise).
        var u = t;
        for (; u + 3u * TPR < p.units; u += 4u * TPR) {
            let a = mv_unit(rb, u, xb);
            let b = mv_unit(rb, u + TPR, xb);
            let c = mv_unit(rb, u + 2u * TPR, xb);
            let d = mv_unit(rb, u + 3u * TPR, xb);
            acc += (a + b) + (c + d);
        }
        // Short rows (a few units per invocation, e.g. 576-wide rows: 2.25) skip the loop
        // above: two units per step here keep two loads in flight for them (SmolLM2 decode:
        // 1.030 -> 1.021 ms of GPU time per token on the H100).
        for (; u + TPR < p.units; u += 2u * TPR) {
            let a = mv_unit(rb, u, xb);
            let b = mv_unit(rb, u + TPR, xb);
            acc += a + b;
        }
        if (u < p.units) {
            acc += mv_unit(rb, u, xb);
        }
    }
    // With the norm applied by scaling (the host's ScaledNorm), each share scaled by 1 / rms(x).
{{NORM_SCALE}}
    // The row sums, in the row's first lane (t = 0): sum0 of `row`, sum1 of `row2`.
    row_sums(acc, lid, t);
    let sum0 = red[lid];
    var sum1 = 0.0;
    if (RPS == 2u) {
        workgroupBarrier();
        row_sums(acc2, lid, t);
        sum1 = red[lid];
    }
{{STORE}}
}

// Row sums of v over each row's TPR lanes into `red`: lanes_sum adds up aligned groups of
// min(TPR, SGW) lanes in registers (subgroup shuffles; SGW = 1 without subgroups), the tree the
// rest (TPR and SGW are constants: the loops are uniform; called by every invocation). Every
// lane of a group holds its group's sum, the row's first lane (t = 0) the row's.
fn row_sums(v: f32, lid: u32, t: u32) {
    red[lid] = lanes_sum(v, min(TPR, SGW));
    workgroupBarrier();
    for (var s = TPR / 2u; s >= SGW; s >>= 1u) {
        if (t < s) {
            red[lid] += red[lid + s];
        }
        workgroupBarrier();
    }
}
