// Y = X W^T for prefill on cooperative matrices (tensor cores): X f32 [n, cols], W [rows, cols]
// in GGML blocks (every quantized type, or F16), Y f32 [n, rows]. Products are 16x16x16 f16 x
// f16 with f32 accumulators: X is rounded to f16 (clamped to f16's range, so an outlier
// activation saturates instead of becoming inf), W is dequantized to f32 by the type's decoder
// (common.wgsl, as the tiled kernel does) and rounded to f16 (not clamped: the host gives this
// kernel only types whose real weights lie far inside f16's range). llama.cpp's coopmat path
// rounds both the same way. Where rows are a multiple of 8 long, the host rounds X to f16 in a
// dispatch of its own first (coop.rs, `x_to_f16`; the `xhalf` section): half the bytes and
// registers of the staged runs (H100, n = 512, 4096-wide Q4_0: 1303 -> 1234 us for the 8B's
// gate|up, 646 -> 585 for its down projection).
//
// In the products' terms: A = the X tile (M = x rows), B = W^T (N = W rows), C[x row][W row],
// which is the output's own layout (`out_off + x row * out_stride + W row`).
//
// One workgroup of 256 invocations (8 subgroups of 32) owns BX x rows (64 or 128, the host's
// choice) by BW W rows (128; or 192, the host's wide tile, with BX = 128 and BK = 64, never under
// GLU). The subgroups form a 2 x 4 grid, each owning BX/2 x rows by BW/4 W rows: XV x WB
// accumulators (XV = BX/32: 2 or 4 A matrices against WB = BW/64: 2 or 3 B matrices; the wide
// tile stages a sixth fewer rows and loads a fifth fewer matrices per product). K advances BK
// at a time (the host's KB): 32 through double-buffered workgroup tiles, one barrier per step,
// or 64 through single-buffered ones, two barriers per step (the host's choice where W runs are
// loaded before the products: twice the loads in flight across a step's products).
//
// As in ops/matmul_coop.wgsl (whose header says why this is what makes it fast), each
// invocation stages fixed runs of 8 elements whose addresses, workgroup slots and edge tests are
// worked out before the K loop, and the next step's x runs are loaded into registers before the
// current products and converted only after them. W runs are loaded raw the same way
// (`W_EARLY`) where they are plain f16 words (F16 rows of even length: one 16-byte load per run
// where rows are whole runs, else four word loads) or a type's few raw
// words (`raw8_<type>`: Q4_0, Q4_1, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), decoded after the products
// (H100, 8B Q4_0 pp512 4,896 -> 5,486 tok/s); the other types' runs (Q5_0, Q2_K, Q3_K) are
// loaded and decoded after the products, so each step waits for their loads once.
//
// Workgroup tiles: both are stored K-contiguous, row r of a tile at r * SK halves, SK = BK + 8:
// the 8 halves of padding (16 bytes) put the 8 rows a matrix load touches at once in different
// banks. The X tile is read as a row-major A ([m][k], coopLoadT), the W tile as a column-major
// B (B[k][n] = W[n][k] sits at n * SK + k: coopLoad). The arrays hold vec4<f16>, so a run of 8
// is two of them and the matrix loads' stride counts vec4s (SK4 = SK / 4). A tile row holds
// RPR = BK / 8 runs; invocation i stages runs at rows i / RPR + j RSTEP (RSTEP = 256 / RPR),
// columns 8 (i % RPR) ..: RX of the X tile (1, 2 or 4) and RW of the W tile (2, 4 or 6).
//
// Workgroup memory: NB buffers (2 for BK = 32, 1 for 64) x (BX + BW) rows x SK halves + an f32
// scratch of SCR floats: 8 KiB (one 16 x 16 matrix per subgroup) beside the 128-row W tile, 48
// KiB in all for BX = 128 and BK = 32, 44 KiB for BK = 64; beside the wide tile (45 KiB of
// tiles) the 3 KiB left, three matrices that the subgroups take in turns (`turn8`).
//
// Edges: x rows past n, W rows past `rows` and columns past `cols` are staged as zeros (quantized
// rows are whole 32-weight blocks, so only F16 rows end mid-step); outputs past them are not
// written. Tiles wholly inside the output store their accumulators straight to it (coopStoreT,
// row-major; the residual epilogue's residual is loaded into them first), the others and the
// GLU's through the scratch, from which each invocation writes 8 outputs of one x row (the wide
// tile's edge tiles one accumulator at a time, the subgroups taking turns).
//
// GLU epilogue (the host's GLU = 1, for the FFN's gate|up stack of 2f rows): each W tile holds
// the gate and up rows of 64 output columns, so that a subgroup's accumulators pair them, and
// the drain writes silu(gate) * up, [n, f]: no [n, 2f] product written and read back, no silu
// and mul dispatches (H100, 8B Q4_0 pp512 5,129 / 6,133 -> 6,475 / 6,798 tok/s, 1B F16 31,248
// / 31,720 -> 35,211 / 35,300). Before a down projection that reads x as f16, the drain writes
// f16 (the host's `output_wgsl`), the values that projection would round x to: half the bytes
// out, and no f32 output read back and rounded by a dispatch of its own (H100, 8B Q4_0 pp512
// 8,706-8,826 -> 9,153-9,216, 1B F16 43.2-43.8k -> 46.5-46.7k).
//
// The header constant BX comes from the host (quant/coop.rs), which assembles the kernel with
// common.wgsl (one type's sections; none for F16 rows read as 16-byte words), one of the three
// x sections below (xhalf where x goes in as f16, else xvec where cols and x_off are multiples
// of 4, else xscalar) and the W loader (the weights' binding, `W_EARLY`, `Raw_w`,
// `ld_w(rb, c, n)`, `st_w(at, r, n)`: coop.rs, `w_loader`). The `*_emu` sections are the tests' variant without
// cooperative matrices (the end of this file).

struct Params {
    rows: u32,       // W rows in this dispatch (one row slice)
    cols: u32,
    row_bytes: u32,
    w_off: u32,      // byte offset of the slice's first row inside the weight binding
    n: u32,          // x rows in this dispatch
    x_off: u32,      // first x element inside the x binding; x rows are `cols` apart
    out_off: u32,    // output index of (x row 0, W row 0)
    out_stride: u32, // output elements per x row
    tiles_x: u32,    // ceil(n / BX)
    tiles_w: u32,    // ceil(rows / BW) (under GLU: ceil(rows / 2 / 64))
    r_off: u32,      // residual index of (x row 0, W row 0): the residual epilogue's
    direct: u32,     // 1: out_off, out_stride (and r_off) are multiples of 4 (see the drain)
}

@group(0) @binding(0) var<uniform> p: Params;
// The weights (binding 1) come with the host's W loader (coop.rs, `w_loader`): u32 words, or
// 16-byte words where F16 rows are whole runs of 8 (one load per run).
// The output (binding 3) comes from the host (coop.rs, `output_wgsl`): f32, or under GLU f16 for
// a next product that reads x as f16 (`QOptions::f16_out`), with `out8(o, v, n)` (elements o ..
// o + n of v, n <= 8) and `store16(c, i)` (the direct drain's store).

// x (binding 2) as runs of 8: `Raw_x`, `ld_x(i, n)` (the run at element i with its first n
// elements inside the row, n = 0 to 8) and `st_x(at, r, n)` (rounded to f16, zero past n, into
// vec4s at and at + 1 of sx).
// @@ xvec xvec_emu
// cols and i are multiples of 4 (so n is 0, 4 or 8): two vec4 loads, kept raw until stored.
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
alias Raw_x = Raw8;
fn ld_x(i: u32, n: u32) -> Raw8 {
    return Raw8(x[i >> 2u], x[(i >> 2u) + 1u]);
}
fn st_x(at: u32, r: Raw8, n: u32) {
    sx[at] = select(vec4<f16>(0.0h), to_f16(r.lo), n >= 4u);
    sx[at + 1u] = select(vec4<f16>(0.0h), to_f16(r.hi), n >= 8u);
}
// @@ xscalar xscalar_emu
// Any cols and offset: element loads, masked as they are read.
@group(0) @binding(2) var<storage, read> x: array<f32>;
alias Raw_x = Raw8;
fn ld_x(i: u32, n: u32) -> Raw8 {
    var r = Raw8(vec4<f32>(0.0), vec4<f32>(0.0));
    for (var e = 0u; e < 4u; e++) {
        if (e < n) {
            r.lo[e] = x[i + e];
        }
        if (e + 4u < n) {
            r.hi[e] = x[i + 4u + e];
        }
    }
    return r;
}
fn st_x(at: u32, r: Raw8, n: u32) {
    sx[at] = to_f16(r.lo);
    sx[at + 1u] = to_f16(r.hi);
}
// @@ xhalf xhalf_emu
// x already f16 (rounded and clamped by coop.rs's x_to_f16), cols and i multiples of 8 (so n is
// 0 or 8): one 16-byte load per run, kept raw until stored.
@group(0) @binding(2) var<storage, read> x: array<vec4<u32>>;
alias Raw_x = vec4<u32>;
fn ld_x(i: u32, n: u32) -> vec4<u32> {
    return x[i >> 3u];
}
fn st_x(at: u32, r: vec4<u32>, n: u32) {
    sx[at] = select(vec4<f16>(0.0h), u2h(r.xy), n >= 4u);
    sx[at + 1u] = select(vec4<f16>(0.0h), u2h(r.zw), n >= 8u);
}
// @@ end

struct Raw8 {
    lo: vec4<f32>,
    hi: vec4<f32>,
}

// `to_f16` (rounded to f16, clamped to its range) comes from the host: ops::TO_F16_WGSL, the
// rounding every op that hands f16 to this kernel shares.

// Four f16 packed in two u32 words, as a vec4<f16> (exact: through f32).
fn u2h(x: vec2<u32>) -> vec4<f16> {
    return vec4<f16>(vec4<f32>(unpack2x16float(x.x), unpack2x16float(x.y)));
}

// Zero past the first n of 4 elements.
fn mask4(v: vec4<f16>, n: u32) -> vec4<f16> {
    return select(vec4<f16>(0.0h), v, vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(n));
}

{{W_LOADER}}

const BW: u32 = BWC;
const WB: u32 = BW / 64u;      // B matrices per subgroup: 2 or 3
// K per step (the host's KB): 32 through two buffers (one barrier per step), or 64 through one
// (two barriers per step, and twice the loads in flight across a step's products).
const BK: u32 = KB;
const NB: u32 = 64u / BK;       // buffers
const SK: u32 = BK + 8u;        // halves per tile row
const SK4: u32 = SK / 4u;
const RPR: u32 = BK / 8u;       // runs per tile row
const RSTEP: u32 = 256u / RPR;  // tile rows from one of an invocation's runs to its next
const RX: u32 = BX / RSTEP;     // x runs per invocation: 1, 2 or 4
const RW: u32 = BW / RSTEP;     // W runs per invocation: 2, 4 or 6
const XV: u32 = BX / 32u;       // A matrices per subgroup
const SX4: u32 = BX * SK4;      // vec4s per buffered X tile
const SW4: u32 = BW * SK4;      // vec4s per buffered W tile
// The host's invariants: the staging takes W runs in pairs (so the wide tile needs BK = 64:
// RW = 6), and the GLU layout pairs a subgroup's two B matrices (the 128-row tile only).
const_assert RW % 2u == 0u;
const_assert GLU == 0u || WB == 2u;

var<workgroup> sx: array<vec4<f16>, NB * SX4>;
var<workgroup> sw: array<vec4<f16>, NB * SW4>;
var<workgroup> scratch: array<f32, SCR>;

// n elements of a run whose row is inside the matrix (`ok`), else none.
fn nv(ok: bool, n: u32) -> u32 {
    return select(0u, n, ok);
}

// Valid elements of the run at column c of a row: 0 past the row's end or a row past `len`.
fn run_len(row_ok: bool, c: u32) -> u32 {
    return select(0u, min(p.cols - c, 8u), row_ok && c < p.cols);
}

// vec4 index of the 16 x 16 block at (tile row, k) of a buffer: X rows (A, row-major) or W rows
// (B, column-major); both tiles are [row][k].
fn x_at(buf: u32, row: u32, k: u32) -> u32 {
    return buf * SX4 + (row * SK + k) / 4u;
}
fn w_at(buf: u32, row: u32, k: u32) -> u32 {
    return buf * SW4 + (row * SK + k) / 4u;
}

// ---- output --------------------------------------------------------------------------------

// The 8 elements lane l drains from its subgroup's scratch matrix (just stored by coopStoreT,
// row-major 16 x 16): row l / 2, columns (l % 2) * 8 .. + 8. Called by every invocation of the
// workgroup in the same order (it holds barriers: after it, the scratch can be reused).
fn scratch8(sg: u32, lane: u32) -> array<f32, 8> {
    workgroupBarrier();
    let v = lane8(sg * 256u, lane);
    workgroupBarrier();
    return v;
}

// Lane l's 8 elements of the row-major 16 x 16 matrix stored in the scratch from `at`: row
// l / 2, columns (l % 2) * 8 .. + 8.
fn lane8(at: u32, lane: u32) -> array<f32, 8> {
    var v: array<f32, 8>;
    let s = at + (lane / 2u) * 16u + (lane % 2u) * 8u;
    for (var e = 0u; e < 8u; e++) {
        v[e] = scratch[s + e];
    }
    return v;
}

// Writes lane l's 8 elements of the 16 x 16 output block at (x row xr0, output column oc0):
// x row xr0 + l / 2, columns oc0 + (l % 2) * 8 .. + 8, those below `cols`; plus the residual's
// element where the host declares one (`resid_at`; else 0).
fn put8(lane: u32, xr0: u32, oc0: u32, v: array<f32, 8>, cols: u32) {
    let xrow = xr0 + lane / 2u;
    let oc = oc0 + (lane % 2u) * 8u;
    if (xrow < p.n && oc < cols) {
        let r = p.r_off + xrow * p.out_stride + oc;
        let n = min(cols - oc, 8u);
        var s = v;
        for (var e = 0u; e < 8u; e++) {
            if (e < n) {
                s[e] += resid_at(r + e);
            }
        }
        out8(p.out_off + xrow * p.out_stride + oc, s, n);
    }
}

// silu(gate) * up, elementwise (the GLU epilogue; ops/unary_math.wgsl's SiLU).
fn glu8(g: array<f32, 8>, u: array<f32, 8>) -> array<f32, 8> {
    var v: array<f32, 8>;
    for (var e = 0u; e < 8u; e++) {
        v[e] = g[e] / (1.0 + exp(-g[e])) * u[e];
    }
    return v;
}

// Writes lane l's part of a pair of accumulators drained as v0, v1 (x rows xr0 ..): the W rows
// col0 .. and col0 + 16 .. of the output; under GLU, silu(v0) * v1 at output columns col0 ..
// (the gate|up stack's f = rows / 2 of them).
fn put_pair(lane: u32, xr0: u32, col0: u32, v0: array<f32, 8>, v1: array<f32, 8>) {
    if (GLU == 1u) {
        put8(lane, xr0, col0, glu8(v0, v1), p.rows / 2u);
    } else {
        put8(lane, xr0, col0, v0, p.rows);
        put8(lane, xr0, col0 + 16u, v1, p.rows);
    }
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
    if (lin >= p.tiles_x * p.tiles_w) {
        return;
    }
    // x tiles vary fastest: the tiles_x workgroups that share a W tile run side by side, so
    // each W block is read from DRAM about once and decoded from L2 by the others.
    let x0 = (lin % p.tiles_x) * BX;
    let w0 = (lin / p.tiles_x) * BW;
    // This subgroup's BX/2 x rows and BW/4 W rows of the tile.
    let wx = (sg / 4u) * (BX / 2u);
    let ww = (sg % 4u) * (BW / 4u);

    // c<i><j>: x rows wx + 16i .., W rows ww + 16j ..; c2* and c3* only when XV = 4, c*2 only
    // when WB = 3.
    var c00 = coop_mat16x16<f32, C>();
    var c01 = coop_mat16x16<f32, C>();
    var c10 = coop_mat16x16<f32, C>();
    var c11 = coop_mat16x16<f32, C>();
    var c20 = coop_mat16x16<f32, C>();
    var c21 = coop_mat16x16<f32, C>();
    var c30 = coop_mat16x16<f32, C>();
    var c31 = coop_mat16x16<f32, C>();
    var c02 = coop_mat16x16<f32, C>();
    var c12 = coop_mat16x16<f32, C>();
    var c22 = coop_mat16x16<f32, C>();
    var c32 = coop_mat16x16<f32, C>();

    // A whole tile inside the output (and no GLU) leaves straight from the accumulators to
    // memory (`store16`), the residual epilogue's residual loaded into them first (`add16`):
    // no trip through the scratch. (H100, n = 512: the scratch drain's barriers and 4-byte
    // stores cost 118 of a Q4_0 [28672, 4096] product's 1032 us.) `direct` is the same for the
    // whole workgroup, so the scratch drain's barriers stay in uniform control flow.
    let direct = GLU == 0u && p.direct == 1u && x0 + BX <= p.n && w0 + BW <= p.rows;
    let o16 = 16u * p.out_stride;
    if (direct && ADD == 1u) {
        let r = p.r_off + (x0 + wx) * p.out_stride + w0 + ww;
        c00 = add16(r);
        c01 = add16(r + 16u);
        c10 = add16(r + o16);
        c11 = add16(r + o16 + 16u);
        if (XV == 4u) {
            c20 = add16(r + 2u * o16);
            c21 = add16(r + 2u * o16 + 16u);
            c30 = add16(r + 3u * o16);
            c31 = add16(r + 3u * o16 + 16u);
        }
        if (WB == 3u) {
            c02 = add16(r + 32u);
            c12 = add16(r + o16 + 32u);
            if (XV == 4u) {
                c22 = add16(r + 2u * o16 + 32u);
                c32 = add16(r + 3u * o16 + 32u);
            }
        }
    }

    // This invocation's runs: tile rows rr + j RSTEP (j < RX of the X tile, j < RW of the W
    // tile), columns xc .. xc + 8 of each step. Both tiles are [row][SK]: run j of either sits
    // at slot s0 + j ds.
    let rr = tid / RPR;
    let xc = (tid % RPR) * 8u;
    let s0 = rr * SK4 + (tid % RPR) * 2u;
    let ds = RSTEP * SK4;
    let xr = x0 + rr;
    let xi = p.x_off + xr * p.cols + xc;
    let dxi = RSTEP * p.cols;
    // GLU (the host's GLU = 1): W is a gate|up stack of 2f rows, and the tile's 128 W rows are
    // the gate and up rows of 64 output columns from oc0: tile row r is column oc0 + 16 (r / 32)
    // + r % 16, its gate row where r % 32 < 16, else its up row (f rows on). So run j's row is
    // RSTEP / 2 rows past run 0's, and subgroup g's accumulators c*0 hold the gate products and
    // c*1 the up products of the same 16 columns.
    let f = p.rows / 2u;
    let oc0 = (lin / p.tiles_x) * 64u;
    // The W row of run 0 (its output column under GLU), and where rows end.
    let wcol = select(w0 + rr, oc0 + 16u * (rr / 32u) + rr % 16u, GLU == 1u);
    let wr = select(wcol, wcol + select(0u, f, rr % 32u >= 16u), GLU == 1u);
    let dw = select(RSTEP, RSTEP / 2u, GLU == 1u);
    let wlim = select(p.rows, f, GLU == 1u);
    let rb = p.w_off + wr * p.row_bytes;
    let drb = dw * p.row_bytes;
    let xok0 = xr < p.n;
    let xok1 = RX > 1u && xr + RSTEP < p.n;
    let xok2 = RX > 2u && xr + 2u * RSTEP < p.n;
    let xok3 = RX > 3u && xr + 3u * RSTEP < p.n;
    let wok0 = wcol < wlim;
    let wok1 = wcol + dw < wlim;
    let wok2 = RW > 2u && wcol + 2u * dw < wlim;
    let wok3 = RW > 3u && wcol + 3u * dw < wlim;
    let wok4 = RW > 4u && wcol + 4u * dw < wlim;
    let wok5 = RW > 5u && wcol + 5u * dw < wlim;

    let ntiles = (p.cols + BK - 1u) / BK;
    var nl = run_len(true, xc);
    var rx0 = ld_x(xi, nv(xok0, nl));
    var rx1 = rx0;
    var rx2 = rx0;
    var rx3 = rx0;
    if (RX > 1u) {
        rx1 = ld_x(xi + dxi, nv(xok1, nl));
    }
    if (RX > 2u) {
        rx2 = ld_x(xi + 2u * dxi, nv(xok2, nl));
        rx3 = ld_x(xi + 3u * dxi, nv(xok3, nl));
    }
    var rw0 = ld_w(rb, xc, nv(wok0, nl));
    var rw1 = ld_w(rb + drb, xc, nv(wok1, nl));
    var rw2 = rw0;
    var rw3 = rw0;
    var rw4 = rw0;
    var rw5 = rw0;
    if (RW > 2u) {
        rw2 = ld_w(rb + 2u * drb, xc, nv(wok2, nl));
        rw3 = ld_w(rb + 3u * drb, xc, nv(wok3, nl));
    }
    if (RW > 4u) {
        rw4 = ld_w(rb + 4u * drb, xc, nv(wok4, nl));
        rw5 = ld_w(rb + 5u * drb, xc, nv(wok5, nl));
    }
    st_x(s0, rx0, nv(xok0, nl));
    if (RX > 1u) {
        st_x(s0 + ds, rx1, nv(xok1, nl));
    }
    if (RX > 2u) {
        st_x(s0 + 2u * ds, rx2, nv(xok2, nl));
        st_x(s0 + 3u * ds, rx3, nv(xok3, nl));
    }
    st_w(s0, rw0, nv(wok0, nl), rb, xc);
    st_w(s0 + ds, rw1, nv(wok1, nl), rb + drb, xc);
    if (RW > 2u) {
        st_w(s0 + 2u * ds, rw2, nv(wok2, nl), rb + 2u * drb, xc);
        st_w(s0 + 3u * ds, rw3, nv(wok3, nl), rb + 3u * drb, xc);
    }
    if (RW > 4u) {
        st_w(s0 + 4u * ds, rw4, nv(wok4, nl), rb + 4u * drb, xc);
        st_w(s0 + 5u * ds, rw5, nv(wok5, nl), rb + 5u * drb, xc);
    }
    workgroupBarrier();
    for (var t = 0u; t < ntiles; t++) {
        let cur = select(0u, t % 2u, NB == 2u);
        let more = t + 1u < ntiles;
        let c1 = (t + 1u) * BK + xc;
        nl = run_len(true, c1);
        if (more) {
            // The next step's runs: loaded now, first used after this step's products.
            let xs = (t + 1u) * BK;
            rx0 = ld_x(xi + xs, nv(xok0, nl));
            if (RX > 1u) {
                rx1 = ld_x(xi + dxi + xs, nv(xok1, nl));
            }
            if (RX > 2u) {
                rx2 = ld_x(xi + 2u * dxi + xs, nv(xok2, nl));
                rx3 = ld_x(xi + 3u * dxi + xs, nv(xok3, nl));
            }
            if (W_EARLY == 1u) {
                rw0 = ld_w(rb, c1, nv(wok0, nl));
                rw1 = ld_w(rb + drb, c1, nv(wok1, nl));
                if (RW > 2u) {
                    rw2 = ld_w(rb + 2u * drb, c1, nv(wok2, nl));
                    rw3 = ld_w(rb + 3u * drb, c1, nv(wok3, nl));
                }
                if (RW > 4u) {
                    rw4 = ld_w(rb + 4u * drb, c1, nv(wok4, nl));
                    rw5 = ld_w(rb + 5u * drb, c1, nv(wok5, nl));
                }
            }
        }
        // BK / 16 K-steps of 16.
        for (var k = 0u; k < BK; k += 16u) {
            let a0 = coopLoadT<coop_mat16x16<f16, A>>(&sx[x_at(cur, wx, k)], SK4);
            let a1 = coopLoadT<coop_mat16x16<f16, A>>(&sx[x_at(cur, wx + 16u, k)], SK4);
            let b0 = coopLoad<coop_mat16x16<f16, B>>(&sw[w_at(cur, ww, k)], SK4);
            let b1 = coopLoad<coop_mat16x16<f16, B>>(&sw[w_at(cur, ww + 16u, k)], SK4);
            c00 = coopMultiplyAdd(a0, b0, c00);
            c01 = coopMultiplyAdd(a0, b1, c01);
            c10 = coopMultiplyAdd(a1, b0, c10);
            c11 = coopMultiplyAdd(a1, b1, c11);
            if (XV == 4u) {
                let a2 = coopLoadT<coop_mat16x16<f16, A>>(&sx[x_at(cur, wx + 32u, k)], SK4);
                let a3 = coopLoadT<coop_mat16x16<f16, A>>(&sx[x_at(cur, wx + 48u, k)], SK4);
                c20 = coopMultiplyAdd(a2, b0, c20);
                c21 = coopMultiplyAdd(a2, b1, c21);
                c30 = coopMultiplyAdd(a3, b0, c30);
                c31 = coopMultiplyAdd(a3, b1, c31);
                if (WB == 3u) {
                    let b2 = coopLoad<coop_mat16x16<f16, B>>(&sw[w_at(cur, ww + 32u, k)], SK4);
                    c02 = coopMultiplyAdd(a0, b2, c02);
                    c12 = coopMultiplyAdd(a1, b2, c12);
                    c22 = coopMultiplyAdd(a2, b2, c22);
                    c32 = coopMultiplyAdd(a3, b2, c32);
                }
            } else if (WB == 3u) {
                let b2 = coopLoad<coop_mat16x16<f16, B>>(&sw[w_at(cur, ww + 32u, k)], SK4);
                c02 = coopMultiplyAdd(a0, b2, c02);
                c12 = coopMultiplyAdd(a1, b2, c12);
            }
        }
        if (NB == 1u) {
            // One buffer: every subgroup is done reading it before it is overwritten.
            workgroupBarrier();
        }
        if (more) {
            if (W_EARLY == 0u) {
                rw0 = ld_w(rb, c1, nv(wok0, nl));
                rw1 = ld_w(rb + drb, c1, nv(wok1, nl));
                if (RW > 2u) {
                    rw2 = ld_w(rb + 2u * drb, c1, nv(wok2, nl));
                    rw3 = ld_w(rb + 3u * drb, c1, nv(wok3, nl));
                }
                if (RW > 4u) {
                    rw4 = ld_w(rb + 4u * drb, c1, nv(wok4, nl));
                    rw5 = ld_w(rb + 5u * drb, c1, nv(wok5, nl));
                }
            }
            let bx = select(0u, 1u - cur, NB == 2u) * SX4 + s0;
            let bw = select(0u, 1u - cur, NB == 2u) * SW4 + s0;
            st_x(bx, rx0, nv(xok0, nl));
            if (RX > 1u) {
                st_x(bx + ds, rx1, nv(xok1, nl));
            }
            if (RX > 2u) {
                st_x(bx + 2u * ds, rx2, nv(xok2, nl));
                st_x(bx + 3u * ds, rx3, nv(xok3, nl));
            }
            st_w(bw, rw0, nv(wok0, nl), rb, c1);
            st_w(bw + ds, rw1, nv(wok1, nl), rb + drb, c1);
            if (RW > 2u) {
                st_w(bw + 2u * ds, rw2, nv(wok2, nl), rb + 2u * drb, c1);
                st_w(bw + 3u * ds, rw3, nv(wok3, nl), rb + 3u * drb, c1);
            }
            if (RW > 4u) {
                st_w(bw + 4u * ds, rw4, nv(wok4, nl), rb + 4u * drb, c1);
                st_w(bw + 5u * ds, rw5, nv(wok5, nl), rb + 5u * drb, c1);
            }
        }
        workgroupBarrier();
    }

    if (direct) {
        let o = p.out_off + (x0 + wx) * p.out_stride + w0 + ww;
        store16(c00, o);
        store16(c01, o + 16u);
        store16(c10, o + o16);
        store16(c11, o + o16 + 16u);
        if (XV == 4u) {
            store16(c20, o + 2u * o16);
            store16(c21, o + 2u * o16 + 16u);
            store16(c30, o + 3u * o16);
            store16(c31, o + 3u * o16 + 16u);
        }
        if (WB == 3u) {
            store16(c02, o + 32u);
            store16(c12, o + o16 + 32u);
            if (XV == 4u) {
                store16(c22, o + 2u * o16 + 32u);
                store16(c32, o + 3u * o16 + 32u);
            }
        }
        return;
    }

    let xo = x0 + wx;
    let col0 = select(w0 + ww, oc0 + 16u * (sg % 4u), GLU == 1u);
    if (WB == 3u) {
        // The wide W tile (never under GLU): each accumulator on its own, through the scratch's
        // three slots in turns.
        put8(lane, xo, col0, turn8(c00, sg, lane), p.rows);
        put8(lane, xo, col0 + 16u, turn8(c01, sg, lane), p.rows);
        put8(lane, xo, col0 + 32u, turn8(c02, sg, lane), p.rows);
        put8(lane, xo + 16u, col0, turn8(c10, sg, lane), p.rows);
        put8(lane, xo + 16u, col0 + 16u, turn8(c11, sg, lane), p.rows);
        put8(lane, xo + 16u, col0 + 32u, turn8(c12, sg, lane), p.rows);
        if (XV == 4u) {
            put8(lane, xo + 32u, col0, turn8(c20, sg, lane), p.rows);
            put8(lane, xo + 32u, col0 + 16u, turn8(c21, sg, lane), p.rows);
            put8(lane, xo + 32u, col0 + 32u, turn8(c22, sg, lane), p.rows);
            put8(lane, xo + 48u, col0, turn8(c30, sg, lane), p.rows);
            put8(lane, xo + 48u, col0 + 16u, turn8(c31, sg, lane), p.rows);
            put8(lane, xo + 48u, col0 + 32u, turn8(c32, sg, lane), p.rows);
        }
        return;
    }
    // Otherwise the accumulators leave through the scratch in pairs (c<i>0, c<i>1): 16 x rows
    // by the subgroup's two 16-column W blocks, or under GLU by its 16 output columns' gate and
    // up products.
    coopStoreT(c00, &scratch[sg * 256u], 16u);
    let v00 = scratch8(sg, lane);
    coopStoreT(c01, &scratch[sg * 256u], 16u);
    put_pair(lane, xo, col0, v00, scratch8(sg, lane));
    coopStoreT(c10, &scratch[sg * 256u], 16u);
    let v10 = scratch8(sg, lane);
    coopStoreT(c11, &scratch[sg * 256u], 16u);
    put_pair(lane, xo + 16u, col0, v10, scratch8(sg, lane));
    if (XV == 4u) {
        coopStoreT(c20, &scratch[sg * 256u], 16u);
        let v20 = scratch8(sg, lane);
        coopStoreT(c21, &scratch[sg * 256u], 16u);
        put_pair(lane, xo + 32u, col0, v20, scratch8(sg, lane));
        coopStoreT(c30, &scratch[sg * 256u], 16u);
        let v30 = scratch8(sg, lane);
        coopStoreT(c31, &scratch[sg * 256u], 16u);
        put_pair(lane, xo + 48u, col0, v30, scratch8(sg, lane));
    }
}

// @@ xvec xscalar xhalf
// The wide W tile's drain of accumulator c: lane l's 8 elements as `scratch8` reads them, through
// a scratch of three 16 x 16 slots (all the workgroup memory its tiles leave), the subgroups
// taking turns: 0-2, 3-5, 6-7. Its stores sit in branches on the subgroup: uniform within each
// subgroup, which is what a cooperative-matrix operation needs (its scope is the subgroup).
// Called by every invocation in the same order (it holds barriers).
fn turn8(c: coop_mat16x16<f32, C>, sg: u32, lane: u32) -> array<f32, 8> {
    var v: array<f32, 8>;
    let slot = (sg % 3u) * 256u;
    for (var t = 0u; t < 3u; t++) {
        if (sg / 3u == t) {
            coopStoreT(c, &scratch[slot], 16u);
        }
        workgroupBarrier();
        if (sg / 3u == t) {
            v = lane8(slot, lane);
        }
        workgroupBarrier();
    }
    return v;
}
// @@ xvec_emu xscalar_emu xhalf_emu
// The emulated turn8: the scratch is this invocation's own, so no turns are needed.
fn turn8(c: EmuC, sg: u32, lane: u32) -> array<f32, 8> {
    emu_store(c, 0u, 16u);
    return lane8(0u, lane);
}
// @@ end

// @@ xvec_emu xscalar_emu xhalf_emu
// ---- tests only: cooperative matrices emulated (with ops/coop_emu.wgsl) ----------------------
// quant/coop.rs (`set_emulated`) rewrites the coop types and calls above; `sg` and `lane` come
// from the invocation index (subgroups of 32 consecutive invocations). Each invocation stores
// its own 8 elements in the (private) scratch, so the drain reads back only what it stored.
// EmuM.src: 0 an A in sx, 1 a B in sw.

// coopLoadT from sx: A[r][k] is lane k % 4 of sx[at + r * stride + k / 4] (row-major).
fn emu_load_x(at: u32, stride: u32) -> EmuM {
    return EmuM(0u, at, stride);
}

// coopLoad from sw: B[k][c] is lane k % 4 of sw[at + c * stride + k / 4] (column-major).
fn emu_load_w(at: u32, stride: u32) -> EmuM {
    return EmuM(1u, at, stride);
}

// Element (r, c) of a loaded matrix (halves; the arrays hold vec4<f16>, strides count vec4s).
fn emu_el(m: EmuM, r: u32, c: u32) -> f32 {
    if (m.src == 0u) {
        return f32(sx[m.at + r * m.stride + c / 4u][c % 4u]);
    }
    return f32(sw[m.at + c * m.stride + r / 4u][r % 4u]);
}
// @@ end
