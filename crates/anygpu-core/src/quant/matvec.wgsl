// y = W x with W in GGML blocks, read as stored (decode: one token, memory-bound).
//
// A workgroup of 256 invocations handles RPW = 256 / TPR rows; the TPR invocations of a row walk
// its work units (`mv_unit`, one per type below) with stride TPR, so neighbouring invocations read
// neighbouring bytes of the row and each unit's words are decoded in registers and multiplied with
// x at once. Partial sums are reduced with a workgroup tree. x is read through the cache (as vec4
// for the quantized types, whose rows are whole 32-weight blocks); it is too large for workgroup
// memory under WebGPU's 16 KiB in general, and every workgroup reads the same x, so it stays hot
// in L1/L2. Several x rows (small batches) are supported by extra workgroups: workgroup g handles
// row group g % groups of x row g / groups.
//
// Prepended by the host: common.wgsl, `const TPR`, `const RPW`, and
// `fn mv_unit(rb, u, xb) -> f32` forwarding to the type's function; for the quantized types `xb`
// is the x row's first vec4, for F32/F16/BF16 its first element.

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
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> w: array<u32>;
// One of the two views of x is used, depending on the type (never both in one pipeline).
@group(0) @binding(2) var<storage, read> x4: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> x1: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

var<workgroup> red: array<f32, 256>;

// ---- plain float rows ----------------------------------------------------------------------

// F32: 4 elements per unit, masked at the row end.
fn mv_f32(rb: u32, u: u32, xb: u32) -> f32 {
    var s = 0.0;
    for (var i = 0u; i < 4u; i++) {
        let e = 4u * u + i;
        s += select(0.0, bitcast<f32>(w[(rb >> 2u) + e]) * x1[xb + e], e < p.cols);
    }
    return s;
}

// F16: 8 elements (16 bytes) per unit; rows of odd length start mid-word, hence u32_at.
fn mv_f16(rb: u32, u: u32, xb: u32) -> f32 {
    var s = 0.0;
    for (var i = 0u; i < 4u; i++) {
        let e = 8u * u + 2u * i;
        let v = unpack2x16float(u32_at(rb + 2u * e));
        s += select(0.0, v.x * x1[xb + e], e < p.cols) + select(0.0, v.y * x1[xb + e + 1u], e + 1u < p.cols);
    }
    return s;
}

fn mv_bf16(rb: u32, u: u32, xb: u32) -> f32 {
    var s = 0.0;
    for (var i = 0u; i < 4u; i++) {
        let e = 8u * u + 2u * i;
        let q = u32_at(rb + 2u * e);
        let a = bitcast<f32>(q << 16u);
        let b = bitcast<f32>(q & 0xFFFF0000u);
        s += select(0.0, a * x1[xb + e], e < p.cols) + select(0.0, b * x1[xb + e + 1u], e + 1u < p.cols);
    }
    return s;
}

// ---- 32-weight blocks: one block per unit ----------------------------------------------------

// Word k of a 16-byte field that starts 2 bytes into word `a` (odd == false) or at word `b`
// (odd == true): blocks of 18, 22 and 34 bytes alternate between the two alignments.
fn qw(a: u32, b: u32, odd: bool) -> u32 {
    return select((a >> 16u) | (b << 16u), b, odd);
}

// Low nibbles of q: weights 4k..4k+4 with x4[xo + k]; high nibbles: weights 16+4k.. with x4[xo+4+k].
fn q4_lo_hi(q: u32, xo: u32, k: u32, bias: f32, acc: vec4<f32>) -> vec4<f32> {
    let a = fma(nib4(q) - bias, x4[xo + k], acc);
    return fma(nib4(q >> 4u) - bias, x4[xo + 4u + k], a);
}

fn mv_q4_0(rb: u32, u: u32, xb: u32) -> f32 {
    let off = rb + u * 18u;
    let i = off >> 2u;
    let odd = (off & 2u) != 0u;
    let w0 = w[i];
    let w1 = w[i + 1u];
    let w2 = w[i + 2u];
    let w3 = w[i + 3u];
    let w4 = w[i + 4u];
    let d = unpack2x16float(select(w0, w0 >> 16u, odd)).x;
    let xo = xb + u * 8u;
    var acc = q4_lo_hi(qw(w0, w1, odd), xo, 0u, 8.0, vec4<f32>(0.0));
    acc = q4_lo_hi(qw(w1, w2, odd), xo, 1u, 8.0, acc);
    acc = q4_lo_hi(qw(w2, w3, odd), xo, 2u, 8.0, acc);
    acc = q4_lo_hi(qw(w3, w4, odd), xo, 3u, 8.0, acc);
    return d * (acc.x + acc.y + acc.z + acc.w);
}

fn mv_q4_1(rb: u32, u: u32, xb: u32) -> f32 {
    let i = (rb + u * 20u) >> 2u;
    let dm = unpack2x16float(w[i]);
    let xo = xb + u * 8u;
    var acc = vec4<f32>(0.0);
    var sx = vec4<f32>(0.0);
    for (var k = 0u; k < 4u; k++) {
        acc = q4_lo_hi(w[i + 1u + k], xo, k, 0.0, acc);
        sx += x4[xo + k] + x4[xo + 4u + k];
    }
    return dm.x * (acc.x + acc.y + acc.z + acc.w) + dm.y * (sx.x + sx.y + sx.z + sx.w);
}

// Q5: low nibbles | fifth bits from qh, for weights 4k.. (lo) and 16+4k.. (hi).
fn q5_lo_hi(q: u32, qh: u32, xo: u32, k: u32, bias: f32, acc: vec4<f32>) -> vec4<f32> {
    let lo = (q & 0x0F0F0F0Fu) | spread4(qh >> (4u * k));
    let hi = ((q >> 4u) & 0x0F0F0F0Fu) | spread4(qh >> (16u + 4u * k));
    let a = fma(u8x4(lo) - bias, x4[xo + k], acc);
    return fma(u8x4(hi) - bias, x4[xo + 4u + k], a);
}

fn mv_q5_0(rb: u32, u: u32, xb: u32) -> f32 {
    let off = rb + u * 22u;
    let i = off >> 2u;
    let odd = (off & 2u) != 0u;
    let w0 = w[i];
    let w1 = w[i + 1u];
    let w2 = w[i + 2u];
    let w3 = w[i + 3u];
    let w4 = w[i + 4u];
    let w5 = w[i + 5u];
    let d = unpack2x16float(select(w0, w0 >> 16u, odd)).x;
    let qh = qw(w0, w1, odd);
    let xo = xb + u * 8u;
    var acc = q5_lo_hi(qw(w1, w2, odd), qh, xo, 0u, 16.0, vec4<f32>(0.0));
    acc = q5_lo_hi(qw(w2, w3, odd), qh, xo, 1u, 16.0, acc);
    acc = q5_lo_hi(qw(w3, w4, odd), qh, xo, 2u, 16.0, acc);
    acc = q5_lo_hi(qw(w4, w5, odd), qh, xo, 3u, 16.0, acc);
    return d * (acc.x + acc.y + acc.z + acc.w);
}

fn mv_q5_1(rb: u32, u: u32, xb: u32) -> f32 {
    let i = (rb + u * 24u) >> 2u;
    let dm = unpack2x16float(w[i]);
    let qh = w[i + 1u];
    let xo = xb + u * 8u;
    var acc = vec4<f32>(0.0);
    var sx = vec4<f32>(0.0);
    for (var k = 0u; k < 4u; k++) {
        acc = q5_lo_hi(w[i + 2u + k], qh, xo, k, 0.0, acc);
        sx += x4[xo + k] + x4[xo + 4u + k];
    }
    return dm.x * (acc.x + acc.y + acc.z + acc.w) + dm.y * (sx.x + sx.y + sx.z + sx.w);
}

fn mv_q8_0(rb: u32, u: u32, xb: u32) -> f32 {
    let off = rb + u * 34u;
    let i = off >> 2u;
    let odd = (off & 2u) != 0u;
    let w0 = w[i];
    let d = unpack2x16float(select(w0, w0 >> 16u, odd)).x;
    let xo = xb + u * 8u;
    var acc = vec4<f32>(0.0);
    var prev = w0;
    for (var k = 0u; k < 8u; k++) {
        let next = w[i + 1u + k];
        acc = fma(vec4<f32>(unpack4xI8(qw(prev, next, odd))), x4[xo + k], acc);
        prev = next;
    }
    return d * (acc.x + acc.y + acc.z + acc.w);
}

// ---- k-quants: four units per 256-weight block -----------------------------------------------

// Q2_K unit (n, h) = 64 weights 128n + 32jj + 16h + l (jj 0..4, l 0..16): 16 qs bytes, 4 scales.
fn mv_q2k(rb: u32, u: u32, xb: u32) -> f32 {
    let sub = u & 3u;
    let n = sub >> 1u;
    let h = sub & 1u;
    let i = (rb + (u >> 2u) * 84u) >> 2u;
    let dd = unpack2x16float(w[i + 20u]);
    // Scales of groups 8n + 2jj + h: bytes 8n + h + 2jj, i.e. byte h (jj even) or 2 + h (jj odd)
    // of the words 2n (jj 0, 1) and 2n + 1 (jj 2, 3).
    let s01 = w[i + 2u * n];
    let s23 = w[i + 2u * n + 1u];
    let q0 = w[i + 4u + 8u * n + 4u * h];
    let q1 = w[i + 5u + 8u * n + 4u * h];
    let q2 = w[i + 6u + 8u * n + 4u * h];
    let q3 = w[i + 7u + 8u * n + 4u * h];
    let xo = xb + (u >> 2u) * 64u + 32u * n + 4u * h;
    var sq = 0.0;
    var sm = 0.0;
    for (var jj = 0u; jj < 4u; jj++) {
        let sh = 2u * jj;
        let x0 = x4[xo + 8u * jj];
        let x1v = x4[xo + 8u * jj + 1u];
        let x2 = x4[xo + 8u * jj + 2u];
        let x3 = x4[xo + 8u * jj + 3u];
        var a = u8x4((q0 >> sh) & 0x03030303u) * x0;
        a = fma(u8x4((q1 >> sh) & 0x03030303u), x1v, a);
        a = fma(u8x4((q2 >> sh) & 0x03030303u), x2, a);
        a = fma(u8x4((q3 >> sh) & 0x03030303u), x3, a);
        let sx = x0 + x1v + x2 + x3;
        let sc = (select(s01, s23, jj >= 2u) >> (8u * h + 16u * (jj & 1u))) & 0xFFu;
        sq += f32(sc & 15u) * (a.x + a.y + a.z + a.w);
        sm += f32(sc >> 4u) * (sx.x + sx.y + sx.z + sx.w);
    }
    return dd.x * sq - dd.y * sm;
}

// Q3_K unit (n, h) as Q2_K, plus the high bits from hmask[16h + l] at bit 4n + jj.
fn mv_q3k(rb: u32, u: u32, xb: u32) -> f32 {
    let sub = u & 3u;
    let n = sub >> 1u;
    let h = sub & 1u;
    let off = rb + (u >> 2u) * 110u;
    let qo = off + 32u + 32u * n + 16u * h;
    let ho = off + 16u * h;
    let q0 = u32_at(qo);
    let q1 = u32_at(qo + 4u);
    let q2 = u32_at(qo + 8u);
    let q3 = u32_at(qo + 12u);
    let h0 = u32_at(ho);
    let h1 = u32_at(ho + 4u);
    let h2 = u32_at(ho + 8u);
    let h3 = u32_at(ho + 12u);
    let xo = xb + (u >> 2u) * 64u + 32u * n + 4u * h;
    var s = 0.0;
    for (var jj = 0u; jj < 4u; jj++) {
        let sh = 2u * jj;
        let hs = 4u * n + jj;
        var a = (u8x4(((q0 >> sh) & 0x03030303u) | (((h0 >> hs) & 0x01010101u) << 2u)) - 4.0) * x4[xo + 8u * jj];
        a = fma(u8x4(((q1 >> sh) & 0x03030303u) | (((h1 >> hs) & 0x01010101u) << 2u)) - 4.0, x4[xo + 8u * jj + 1u], a);
        a = fma(u8x4(((q2 >> sh) & 0x03030303u) | (((h2 >> hs) & 0x01010101u) << 2u)) - 4.0, x4[xo + 8u * jj + 2u], a);
        a = fma(u8x4(((q3 >> sh) & 0x03030303u) | (((h3 >> hs) & 0x01010101u) << 2u)) - 4.0, x4[xo + 8u * jj + 3u], a);
        s += scale_q3k(off + 96u, 8u * n + 2u * jj + h) * (a.x + a.y + a.z + a.w);
    }
    return f16_at(off + 108u) * s;
}

// Q4_K unit k = one 32-byte chunk: 64 weights, groups 2k (low nibbles) and 2k + 1 (high).
fn mv_q4k(rb: u32, u: u32, xb: u32) -> f32 {
    let k = u & 3u;
    let off = rb + (u >> 2u) * 144u;
    let i = off >> 2u;
    let dd = unpack2x16float(w[i]);
    let sm0 = scale_min_k4(off + 4u, 2u * k);
    let sm1 = scale_min_k4(off + 4u, 2u * k + 1u);
    let qi = i + 4u + 8u * k;
    let xo = xb + (u >> 2u) * 64u + 16u * k;
    var a = vec4<f32>(0.0);
    var b = vec4<f32>(0.0);
    var sa = vec4<f32>(0.0);
    var sb = vec4<f32>(0.0);
    for (var m = 0u; m < 8u; m++) {
        let q = w[qi + m];
        let xa = x4[xo + m];
        let xb2 = x4[xo + 8u + m];
        a = fma(nib4(q), xa, a);
        b = fma(nib4(q >> 4u), xb2, b);
        sa += xa;
        sb += xb2;
    }
    let dot_q = sm0.x * (a.x + a.y + a.z + a.w) + sm1.x * (b.x + b.y + b.z + b.w);
    let dot_m = sm0.y * (sa.x + sa.y + sa.z + sa.w) + sm1.y * (sb.x + sb.y + sb.z + sb.w);
    return dd.x * dot_q - dd.y * dot_m;
}

// Q5_K unit k as Q4_K, with the fifth bits at bits 2k / 2k + 1 of the 32 qh bytes.
fn mv_q5k(rb: u32, u: u32, xb: u32) -> f32 {
    let k = u & 3u;
    let off = rb + (u >> 2u) * 176u;
    let i = off >> 2u;
    let dd = unpack2x16float(w[i]);
    let sm0 = scale_min_k4(off + 4u, 2u * k);
    let sm1 = scale_min_k4(off + 4u, 2u * k + 1u);
    let qi = i + 12u + 8u * k;
    let xo = xb + (u >> 2u) * 64u + 16u * k;
    var a = vec4<f32>(0.0);
    var b = vec4<f32>(0.0);
    var sa = vec4<f32>(0.0);
    var sb = vec4<f32>(0.0);
    for (var m = 0u; m < 8u; m++) {
        let q = w[qi + m];
        let qh = w[i + 4u + m] >> (2u * k);
        let xa = x4[xo + m];
        let xb2 = x4[xo + 8u + m];
        a = fma(u8x4((q & 0x0F0F0F0Fu) | ((qh & 0x01010101u) << 4u)), xa, a);
        b = fma(u8x4(((q >> 4u) & 0x0F0F0F0Fu) | ((qh & 0x02020202u) << 3u)), xb2, b);
        sa += xa;
        sb += xb2;
    }
    let dot_q = sm0.x * (a.x + a.y + a.z + a.w) + sm1.x * (b.x + b.y + b.z + b.w);
    let dot_m = sm0.y * (sa.x + sa.y + sa.z + sa.w) + sm1.y * (sb.x + sb.y + sb.z + sb.w);
    return dd.x * dot_q - dd.y * dot_m;
}

// Q6_K unit (n, lh) = l in 16lh..16lh+16 of half n: 64 weights 128n + 32i + l, i 0..4.
fn mv_q6k(rb: u32, u: u32, xb: u32) -> f32 {
    let sub = u & 3u;
    let n = sub >> 1u;
    let lh = sub & 1u;
    let off = rb + (u >> 2u) * 210u;
    let la = off + 64u * n + 16u * lh;
    let ho = off + 128u + 32u * n + 16u * lh;
    // Scales 8n + lh + 2i (i 0..4): bytes lh, lh + 2 of the first word, of the second word.
    let s0 = u32_at(off + 192u + 8u * n);
    let s1 = u32_at(off + 196u + 8u * n);
    let xo = xb + (u >> 2u) * 64u + 32u * n + 4u * lh;
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    for (var m = 0u; m < 4u; m++) {
        let qa = u32_at(la + 4u * m);
        let qb = u32_at(la + 32u + 4u * m);
        let qh = u32_at(ho + 4u * m);
        a0 = fma(u8x4((qa & 0x0F0F0F0Fu) | ((qh & 0x03030303u) << 4u)) - 32.0, x4[xo + m], a0);
        a1 = fma(u8x4((qb & 0x0F0F0F0Fu) | (((qh >> 2u) & 0x03030303u) << 4u)) - 32.0, x4[xo + 8u + m], a1);
        a2 = fma(u8x4(((qa >> 4u) & 0x0F0F0F0Fu) | (((qh >> 4u) & 0x03030303u) << 4u)) - 32.0, x4[xo + 16u + m], a2);
        a3 = fma(u8x4(((qb >> 4u) & 0x0F0F0F0Fu) | (((qh >> 6u) & 0x03030303u) << 4u)) - 32.0, x4[xo + 24u + m], a3);
    }
    let sh = 8u * lh;
    let s = f32(i8_of((s0 >> sh) & 0xFFu)) * (a0.x + a0.y + a0.z + a0.w)
        + f32(i8_of((s0 >> (sh + 16u)) & 0xFFu)) * (a1.x + a1.y + a1.z + a1.w)
        + f32(i8_of((s1 >> sh) & 0xFFu)) * (a2.x + a2.y + a2.z + a2.w)
        + f32(i8_of((s1 >> (sh + 16u)) & 0xFFu)) * (a3.x + a3.y + a3.z + a3.w);
    return f16_at(off + 208u) * s;
}

// ---- entry point -------------------------------------------------------------------------------

@compute @workgroup_size(256)
fn matvec(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let g = wid.x + wid.y * nwg.x;
    let xr = g / p.groups;
    let row = (g - xr * p.groups) * RPW + lid / TPR;
    let t = lid % TPR;
    let live = row < p.rows && xr < p.n;
    var acc = 0.0;
    if (live) {
        let rb = p.w_off + row * p.row_bytes;
        let xb = p.x_off + xr * p.x_stride;
        for (var u = t; u < p.units; u += TPR) {
            acc += mv_unit(rb, u, xb);
        }
    }
    red[lid] = acc;
    workgroupBarrier();
    // Tree over each row's TPR slots (TPR is a constant: the loop is uniform).
    for (var s = TPR / 2u; s > 0u; s >>= 1u) {
        if (t < s) {
            red[lid] += red[lid + s];
        }
        workgroupBarrier();
    }
    if (live && t == 0u) {
        out[p.out_off + xr * p.out_stride + row] = red[lid];
    }
}
