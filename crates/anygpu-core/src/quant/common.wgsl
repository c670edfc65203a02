// GGML block decoding shared by the quantized kernels (prepended to matvec.wgsl, matmul.wgsl and
// gather.wgsl). Each kernel declares the weights as `w: array<u32>`: the blocks' bytes exactly as
// GGUF stores them (little-endian), uploaded unchanged. Several block types are not a multiple of
// 4 bytes (Q4_0 18 B, Q5_0 22 B, Q8_0 34 B, Q3_K 110 B, Q6_K 210 B, F16 rows of odd length), so
// fields are read at byte offsets through the helpers below.
//
// Lines from `// @@ tag ...` to the next `// @@` line belong to the listed types only
// (`// @@ end` closes a section): the host keeps the sections of the type it compiles for
// (quant/gpu.rs, `type_source`), so a pipeline carries one type's decoder, not thirteen.
//
// `deq8_<type>(rb, c, cols)` expands the 8 consecutive weights at columns c..c+8 (c a multiple of
// 8) of the row whose first byte is `rb`; the tiled matmul and the row gather use it. The float
// operations follow quant/dequant.rs (the CPU reference), e.g. (q - 8) * d for Q4_0.
//
// Types whose run of 8 lies in a few words (Q4_0, Q4_1, Q5_1, Q8_0: four; Q4_K: six; Q5_K, Q6_K:
// eight) split it in
// two: `raw8_<type>(rb, c) -> Raw8_<type>` loads the words and `dec8_<type>(r, rb, c)` decodes
// them, so a kernel can issue the loads early and decode once they have arrived (the coop
// prefill kernel loads the next step's runs before its products); `deq8_<type>` is the two in
// a row.

struct V8 {
    lo: vec4<f32>,
    hi: vec4<f32>,
}

// Byte `off` of the weights.
fn byte_at(off: u32) -> u32 {
    return (w[off >> 2u] >> ((off & 3u) * 8u)) & 0xFFu;
}

// The u16 at an even byte offset (every f16 field and F16/BF16 element is at one: all block
// sizes and field offsets are even), so it never straddles two words.
fn u16_at(off: u32) -> u32 {
    return (w[off >> 2u] >> ((off & 2u) * 8u)) & 0xFFFFu;
}

fn f16_at(off: u32) -> f32 {
    return unpack2x16float(u16_at(off)).x;
}

// The u32 at byte `s / 8` of the 8 bytes `lo`, `hi` (s a multiple of 8 below 32). WGSL takes
// shift amounts modulo 32, hence the select for the aligned case rather than `hi << 32`.
fn funnel(lo: u32, hi: u32, s: u32) -> u32 {
    return select((lo >> s) | (hi << (32u - s)), lo, s == 0u);
}

// The u32 at any byte offset: a funnel shift of the two words it spans. Reading `w[i + 1]` past
// the end of the binding is clamped by WGSL's bounds rules, and then unused.
fn u32_at(off: u32) -> u32 {
    let i = off >> 2u;
    return funnel(w[i], w[i + 1u], (off & 3u) * 8u);
}

// The four bytes of `q` as floats, minus `bias`. Exact: a byte b placed in the mantissa of
// 2^23 (bits 0x4B000000) is the float 2^23 + b, so one OR and one subtraction replace the
// int-to-float conversions, which run at a quarter of the FMA rate on NVIDIA and AMD GPUs.
fn u8x4b(q: u32, bias: f32) -> vec4<f32> {
    let v = (vec4<u32>(q, q >> 8u, q >> 16u, q >> 24u) & vec4<u32>(0xFFu)) | vec4<u32>(0x4B000000u);
    return bitcast<vec4<f32>>(v) - (8388608.0 + bias);
}

fn u8x4(q: u32) -> vec4<f32> {
    return u8x4b(q, 0.0);
}

// The low nibble of each byte of `q`.
fn nib4(q: u32) -> vec4<f32> {
    return u8x4b(q & 0x0F0F0F0Fu, 0.0);
}

// Four signed bytes: flipping the sign bit maps -128..127 to 0..255.
fn i8x4(q: u32) -> vec4<f32> {
    return u8x4b(q ^ 0x80808080u, 128.0);
}

// Bits 0..3 of `h` moved to bit 4 of bytes 0..3: the fifth bit of four Q5 weights.
fn spread4(h: u32) -> u32 {
    return ((h & 1u) << 4u) | ((h & 2u) << 11u) | ((h & 4u) << 18u) | ((h & 8u) << 25u);
}

// The raw words of a run whose block has its f16 d at byte `off` and whose 8 quant bytes start
// at byte `qo` (both even): d's word, then the three words spanning the bytes (Q4_0, Q8_0).
fn raw_d_q8b(off: u32, qo: u32) -> vec4<u32> {
    let i = qo >> 2u;
    return vec4<u32>(w[off >> 2u], w[i], w[i + 1u], w[i + 2u]);
}

// A signed byte (Q6_K scales).
fn i8_of(b: u32) -> i32 {
    return bitcast<i32>(b << 24u) >> 24u;
}

// @@ q4k q5k
// 6-bit scale and min of Q4_K / Q5_K group g from the 12 scale bytes in words s0, s1, s2
// (get_scale_min_k4 on words: bytes g & 3 of s0, s1, s2 are bytes g & 3, 4 + (g & 3), 8 + (g & 3)).
fn scale_min_k4_w(s0: u32, s1: u32, s2: u32, g: u32) -> vec2<f32> {
    let sh = 8u * (g & 3u);
    let a = (s0 >> sh) & 0xFFu;
    let b = (s1 >> sh) & 0xFFu;
    let c = (s2 >> sh) & 0xFFu;
    let sc = select((c & 15u) | ((a >> 6u) << 4u), a & 63u, g < 4u);
    let m = select((c >> 4u) | ((b >> 6u) << 4u), b & 63u, g < 4u);
    return vec2<f32>(f32(sc), f32(m));
}

// Group g's scale d * sc and offset dmin * m of a Q4_K / Q5_K block from its first four words
// (d and dmin, the 12 scale bytes): w = scale * q - offset.
fn k_group_scale(a: vec4<u32>, g: u32) -> vec2<f32> {
    let dd = unpack2x16float(a.x);
    let sm = scale_min_k4_w(a.y, a.z, a.w, g);
    return vec2<f32>(dd.x * sm.x, dd.y * sm.y);
}

// @@ q3k
// Signed 6-bit scale of group g (0..16) of a Q3_K block, scale bytes at `sb` (bias 32 removed).
fn scale_q3k(sb: u32, g: u32) -> f32 {
    let low = (byte_at(sb + (g & 7u)) >> (4u * (g >> 3u))) & 15u;
    let high = (byte_at(sb + 8u + (g & 3u)) >> (2u * (g >> 2u))) & 3u;
    return f32(i32(low | (high << 4u)) - 32);
}
// @@ end

// ---- plain float rows: masked at the row end (any number of columns) --------------------------

// @@ f32
fn deq8_f32(rb: u32, c: u32, cols: u32) -> V8 {
    var v: array<f32, 8>;
    for (var i = 0u; i < 8u; i++) {
        v[i] = select(0.0, bitcast<f32>(w[(rb >> 2u) + c + i]), c + i < cols);
    }
    return V8(vec4<f32>(v[0], v[1], v[2], v[3]), vec4<f32>(v[4], v[5], v[6], v[7]));
}

// @@ f16
fn deq8_f16(rb: u32, c: u32, cols: u32) -> V8 {
    var v: array<f32, 8>;
    for (var i = 0u; i < 8u; i++) {
        v[i] = select(0.0, f16_at(rb + 2u * (c + i)), c + i < cols);
    }
    return V8(vec4<f32>(v[0], v[1], v[2], v[3]), vec4<f32>(v[4], v[5], v[6], v[7]));
}

// @@ bf16
fn deq8_bf16(rb: u32, c: u32, cols: u32) -> V8 {
    var v: array<f32, 8>;
    for (var i = 0u; i < 8u; i++) {
        v[i] = select(0.0, bitcast<f32>(u16_at(rb + 2u * (c + i)) << 16u), c + i < cols);
    }
    return V8(vec4<f32>(v[0], v[1], v[2], v[3]), vec4<f32>(v[4], v[5], v[6], v[7]));
}
// @@ end

// ---- 32-weight blocks --------------------------------------------------------------------------

// @@ q4_0
// Q4_0 (18 B: d, qs[16]): byte l holds weight l (low nibble) and l + 16 (high nibble). A run's
// words: the one holding d, then the three spanning its 8 quant bytes (at an even offset).
alias Raw8_q4_0 = vec4<u32>;
fn raw8_q4_0(rb: u32, c: u32) -> vec4<u32> {
    let off = rb + (c >> 5u) * 18u;
    return raw_d_q8b(off, off + 2u + (c & 15u));
}
fn dec8_q4_0(r: vec4<u32>, rb: u32, c: u32) -> V8 {
    let off = rb + (c >> 5u) * 18u;
    let d = unpack2x16float(r.x >> ((off & 2u) * 8u)).x;
    let s = ((off + 2u + (c & 15u)) & 3u) * 8u;
    let sh = ((c >> 4u) & 1u) * 4u;
    return V8((nib4(funnel(r.y, r.z, s) >> sh) - 8.0) * d, (nib4(funnel(r.z, r.w, s) >> sh) - 8.0) * d);
}
fn deq8_q4_0(rb: u32, c: u32, cols: u32) -> V8 {
    return dec8_q4_0(raw8_q4_0(rb, c), rb, c);
}

// @@ q4_1
// Q4_1 (20 B: d, m, qs[16]): w = d * q + m. Blocks start at words (rows too: whole blocks).
alias Raw8_q4_1 = vec4<u32>;
fn raw8_q4_1(rb: u32, c: u32) -> vec4<u32> {
    let off = rb + (c >> 5u) * 20u;
    let qi = (off + 4u + (c & 15u)) >> 2u;
    return vec4<u32>(w[off >> 2u], w[qi], w[qi + 1u], 0u);
}
fn dec8_q4_1(r: vec4<u32>, rb: u32, c: u32) -> V8 {
    let dm = unpack2x16float(r.x);
    let sh = ((c >> 4u) & 1u) * 4u;
    return V8(nib4(r.y >> sh) * dm.x + dm.y, nib4(r.z >> sh) * dm.x + dm.y);
}
fn deq8_q4_1(rb: u32, c: u32, cols: u32) -> V8 {
    return dec8_q4_1(raw8_q4_1(rb, c), rb, c);
}

// @@ q5_0
// Q5_0 (22 B: d, qh u32, qs[16]): fifth bit of weight j is bit j of qh; w = d * (q - 16).
fn deq8_q5_0(rb: u32, c: u32, cols: u32) -> V8 {
    let off = rb + (c >> 5u) * 22u;
    let j = c & 31u;
    let d = f16_at(off);
    let qh = u32_at(off + 2u);
    let qo = off + 6u + (j & 15u);
    let sh = (j >> 4u) * 4u;
    let a = ((u32_at(qo) >> sh) & 0x0F0F0F0Fu) | spread4(qh >> j);
    let b = ((u32_at(qo + 4u) >> sh) & 0x0F0F0F0Fu) | spread4(qh >> (j + 4u));
    return V8((u8x4(a) - 16.0) * d, (u8x4(b) - 16.0) * d);
}

// @@ q5_1
// Q5_1 (24 B: d, m, qh, qs[16]): w = d * q + m.
alias Raw8_q5_1 = vec4<u32>;
fn raw8_q5_1(rb: u32, c: u32) -> vec4<u32> {
    let off = rb + (c >> 5u) * 24u;
    let i = off >> 2u;
    let qi = (off + 8u + (c & 15u)) >> 2u;
    return vec4<u32>(w[i], w[i + 1u], w[qi], w[qi + 1u]);
}
fn dec8_q5_1(r: vec4<u32>, rb: u32, c: u32) -> V8 {
    let j = c & 31u;
    let dm = unpack2x16float(r.x);
    let sh = (j >> 4u) * 4u;
    let a = ((r.z >> sh) & 0x0F0F0F0Fu) | spread4(r.y >> j);
    let b = ((r.w >> sh) & 0x0F0F0F0Fu) | spread4(r.y >> (j + 4u));
    return V8(u8x4(a) * dm.x + dm.y, u8x4(b) * dm.x + dm.y);
}
fn deq8_q5_1(rb: u32, c: u32, cols: u32) -> V8 {
    return dec8_q5_1(raw8_q5_1(rb, c), rb, c);
}

// @@ q8_0
// Q8_0 (34 B: d, qs[32] signed): w = d * q. A run's words: the one holding d, then the three
// spanning its 8 quant bytes (at an even offset).
alias Raw8_q8_0 = vec4<u32>;
fn raw8_q8_0(rb: u32, c: u32) -> vec4<u32> {
    let off = rb + (c >> 5u) * 34u;
    return raw_d_q8b(off, off + 2u + (c & 31u));
}
fn dec8_q8_0(r: vec4<u32>, rb: u32, c: u32) -> V8 {
    let off = rb + (c >> 5u) * 34u;
    let d = unpack2x16float(r.x >> ((off & 2u) * 8u)).x;
    let s = ((off + 2u + (c & 31u)) & 3u) * 8u;
    return V8(i8x4(funnel(r.y, r.z, s)) * d, i8x4(funnel(r.z, r.w, s)) * d);
}
fn deq8_q8_0(rb: u32, c: u32, cols: u32) -> V8 {
    return dec8_q8_0(raw8_q8_0(rb, c), rb, c);
}
// @@ end

// ---- 256-weight super-blocks (k-quants) --------------------------------------------------------
// Weight j of a Q2_K/Q3_K block is 128n + 32jj + 16h + l: 2 bits at shift 2jj of qs[32n + 16h + l],
// group 8n + 2jj + h.

// @@ q2k
// Q2_K (84 B: scales[16], qs[64], d, dmin): w = d * (sc & 15) * q - dmin * (sc >> 4).
fn deq8_q2k(rb: u32, c: u32, cols: u32) -> V8 {
    let off = rb + (c >> 8u) * 84u;
    let j = c & 255u;
    let n = j >> 7u;
    let jj = (j >> 5u) & 3u;
    let h = (j >> 4u) & 1u;
    let sc = byte_at(off + 8u * n + 2u * jj + h);
    let dd = unpack2x16float(w[(off + 80u) >> 2u]);
    let dl = dd.x * f32(sc & 15u);
    let ml = dd.y * f32(sc >> 4u);
    let qi = (off + 16u + 32u * n + 16u * h + (j & 15u)) >> 2u;
    let a = (w[qi] >> (2u * jj)) & 0x03030303u;
    let b = (w[qi + 1u] >> (2u * jj)) & 0x03030303u;
    return V8(dl * u8x4(a) - ml, dl * u8x4(b) - ml);
}

// @@ q3k
// Q3_K (110 B: hmask[32], qs[64], scales[12], d): q = low 2 bits | high bit << 2, w = d*sc*(q - 4).
fn deq8_q3k(rb: u32, c: u32, cols: u32) -> V8 {
    let off = rb + (c >> 8u) * 110u;
    let j = c & 255u;
    let n = j >> 7u;
    let jj = (j >> 5u) & 3u;
    let h = (j >> 4u) & 1u;
    let l = j & 15u;
    let dl = f16_at(off + 108u) * scale_q3k(off + 96u, 8u * n + 2u * jj + h);
    let qo = off + 32u + 32u * n + 16u * h + l;
    let ho = off + 16u * h + l;
    let hs = 4u * n + jj;
    let a = ((u32_at(qo) >> (2u * jj)) & 0x03030303u) | (((u32_at(ho) >> hs) & 0x01010101u) << 2u);
    let b = ((u32_at(qo + 4u) >> (2u * jj)) & 0x03030303u) | (((u32_at(ho + 4u) >> hs) & 0x01010101u) << 2u);
    return V8(dl * (u8x4(a) - 4.0), dl * (u8x4(b) - 4.0));
}

// @@ q4k
// Q4_K (144 B: d, dmin, scales[12], qs[128]): byte l of chunk k holds weight 64k + l (low nibble,
// group 2k) and 64k + 32 + l (high nibble, group 2k + 1); w = d * sc * q - dmin * m.
// A run's raw words: (d, dmin) and the 12 scale bytes (a), its two quant words (b). Blocks and
// rows start at words (144-byte blocks).
struct Raw8_q4k {
    a: vec4<u32>,
    b: vec2<u32>,
}
fn raw8_q4k(rb: u32, c: u32) -> Raw8_q4k {
    let off = rb + (c >> 8u) * 144u;
    let i = off >> 2u;
    let qi = (off + 16u + 32u * ((c & 255u) >> 6u) + (c & 31u)) >> 2u;
    return Raw8_q4k(vec4<u32>(w[i], w[i + 1u], w[i + 2u], w[i + 3u]), vec2<u32>(w[qi], w[qi + 1u]));
}
fn dec8_q4k(r: Raw8_q4k, rb: u32, c: u32) -> V8 {
    let j = c & 255u;
    let hh = (j >> 5u) & 1u;
    let s = k_group_scale(r.a, 2u * (j >> 6u) + hh);
    return V8(s.x * nib4(r.b.x >> (4u * hh)) - s.y, s.x * nib4(r.b.y >> (4u * hh)) - s.y);
}
fn deq8_q4k(rb: u32, c: u32, cols: u32) -> V8 {
    return dec8_q4k(raw8_q4k(rb, c), rb, c);
}

// @@ q5k
// Q5_K (176 B: d, dmin, scales[12], qh[32], qs[128]): Q4_K plus bit g of qh[l] as the fifth bit.
// A run's raw words: (d, dmin) and the 12 scale bytes (a), its two high-bit words and its two
// quant words (b). Blocks and rows start at words (176-byte blocks).
struct Raw8_q5k {
    a: vec4<u32>,
    b: vec4<u32>,
}
fn raw8_q5k(rb: u32, c: u32) -> Raw8_q5k {
    let off = rb + (c >> 8u) * 176u;
    let j = c & 255u;
    let i = off >> 2u;
    let hi = (off + 16u + (j & 31u)) >> 2u;
    let qi = (off + 48u + 32u * (j >> 6u) + (j & 31u)) >> 2u;
    return Raw8_q5k(vec4<u32>(w[i], w[i + 1u], w[i + 2u], w[i + 3u]), vec4<u32>(w[hi], w[hi + 1u], w[qi], w[qi + 1u]));
}
fn dec8_q5k(r: Raw8_q5k, rb: u32, c: u32) -> V8 {
    let j = c & 255u;
    let hh = (j >> 5u) & 1u;
    let g = 2u * (j >> 6u) + hh;
    let s = k_group_scale(r.a, g);
    let a = ((r.b.z >> (4u * hh)) & 0x0F0F0F0Fu) | (((r.b.x >> g) & 0x01010101u) << 4u);
    let b = ((r.b.w >> (4u * hh)) & 0x0F0F0F0Fu) | (((r.b.y >> g) & 0x01010101u) << 4u);
    return V8(s.x * u8x4(a) - s.y, s.x * u8x4(b) - s.y);
}
fn deq8_q5k(rb: u32, c: u32, cols: u32) -> V8 {
    return dec8_q5k(raw8_q5k(rb, c), rb, c);
}

// @@ q6k
// Q6_K (210 B: ql[128], qh[64], scales[16] signed, d): in half n, weight 128n + 32i + l takes 4 bits
// from ql[64n + 32(i % 2) + l] (nibble i / 2), 2 bits from qh[32n + l] at shift 2i, scale
// 8n + l / 16 + 2i; w = d * sc * (q - 32).
// A run's raw words: its 8 low-bit bytes' three words and the word of its scale byte (a), its
// 8 high-bit bytes' three words and the word of d (b).
struct Raw8_q6k {
    a: vec4<u32>,
    b: vec4<u32>,
}
fn raw8_q6k(rb: u32, c: u32) -> Raw8_q6k {
    let off = rb + (c >> 8u) * 210u;
    let j = c & 255u;
    let n = j >> 7u;
    let i = (j >> 5u) & 3u;
    let l = j & 31u;
    let ql = (off + 64u * n + 32u * (i & 1u) + l) >> 2u;
    let qh = (off + 128u + 32u * n + l) >> 2u;
    let sc = (off + 192u + 8u * n + (l >> 4u) + 2u * i) >> 2u;
    return Raw8_q6k(vec4<u32>(w[ql], w[ql + 1u], w[ql + 2u], w[sc]), vec4<u32>(w[qh], w[qh + 1u], w[qh + 2u], w[(off + 208u) >> 2u]));
}
fn dec8_q6k(r: Raw8_q6k, rb: u32, c: u32) -> V8 {
    let off = rb + (c >> 8u) * 210u;
    let j = c & 255u;
    let n = j >> 7u;
    let i = (j >> 5u) & 3u;
    let l = j & 31u;
    let sl = ((off + 64u * n + 32u * (i & 1u) + l) & 3u) * 8u;
    let sh = ((off + 128u + 32u * n + l) & 3u) * 8u;
    let so = off + 192u + 8u * n + (l >> 4u) + 2u * i;
    let d = unpack2x16float(r.b.w >> (((off + 208u) & 2u) * 8u)).x;
    let dl = d * f32(i8_of((r.a.w >> ((so & 3u) * 8u)) & 0xFFu));
    let ns = 4u * (i >> 1u);
    let hs = 2u * i;
    let a = ((funnel(r.a.x, r.a.y, sl) >> ns) & 0x0F0F0F0Fu) | (((funnel(r.b.x, r.b.y, sh) >> hs) & 0x03030303u) << 4u);
    let b = ((funnel(r.a.y, r.a.z, sl) >> ns) & 0x0F0F0F0Fu) | (((funnel(r.b.y, r.b.z, sh) >> hs) & 0x03030303u) << 4u);
    return V8(dl * (u8x4(a) - 32.0), dl * (u8x4(b) - 32.0));
}
fn deq8_q6k(rb: u32, c: u32, cols: u32) -> V8 {
    return dec8_q6k(raw8_q6k(rb, c), rb, c);
}
// @@ end
