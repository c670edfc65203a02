// Y = X W^T for prefill on cooperative matrices (tensor cores): X f32 [n, cols], W [rows, cols]
// in GGML blocks (every quantized type, or F16), Y f32 [n, rows]. Products are 16x16x16 f16 x
// f16 with f32 accumulators: X is rounded to f16 as it is staged (clamped to f16's range, so an
// outlier activation saturates instead of becoming inf), W is dequantized to f32 by the type's
// `deq8` (common.wgsl, as the tiled kernel does) and rounded to f16 (not clamped: the host gives
// this kernel only types whose real weights lie far inside f16's range). llama.cpp's coopmat
// path rounds both the same way.
//
// In the products' terms: A = the X tile (M = x rows), B = W^T (N = W rows), C[x row][W row],
// which is the output's own layout (`out_off + x row * out_stride + W row`).
//
// One workgroup of 256 invocations (8 subgroups of 32) owns BX x rows (64 or 128, the host's
// choice) by BW = 128 W rows. The subgroups form a 2 x 4 grid, each owning BX/2 x rows by 32 W
// rows: XV x 2 accumulators (XV = BX/32: 2 or 4 A matrices against 2 B matrices). K advances 32
// at a time through double-buffered workgroup tiles: the next step's x loads are issued before
// the current products (their latency hides behind them; converted and stored after), the next
// W tile is dequantized after them, and one barrier per step separates the buffers (a buffer
// is written one step after its last read, with a barrier in between).
//
// Workgroup tiles: both are stored K-contiguous, row r of a tile at r * SK halves, SK = 32 + 8:
// the 8 halves of padding (16 bytes) put the 8 rows a matrix load touches at once in different
// banks. The X tile is read as a row-major A ([m][k], coopLoadT), the W tile as a column-major
// B (B[k][n] = W[n][k] sits at n * SK + k: coopLoad). The arrays hold vec4<f16>, so loads and
// stores move 8 bytes and the matrix loads' stride counts vec4s (SK4 = SK / 4).
//
// Workgroup memory: 2 buffers x (BX + 128) rows x 80 bytes + an 8 KiB f32 scratch (one 16 x 16
// matrix per subgroup) = 48 KiB for BX = 128, 38 KiB for BX = 64.
//
// Edges: x rows past n, W rows past `rows` and columns past `cols` are staged as zeros (quantized
// rows are whole 32-weight blocks, so only F16 rows end mid-step); outputs past them are not
// written. The accumulators leave through the scratch (coopStoreT, row-major), from which each
// invocation writes 8 outputs of one x row.
//
// The header constant BX comes from the host (quant/coop.rs), which assembles the kernel with
// common.wgsl (one type's sections), one of the two x sections below (xvec where cols and x_off
// are multiples of 4, else xscalar) and `fn deq8(rb, c, cols) -> V8` forwarding to the type's
// expansion. The `*_emu` sections are the tests' variant without cooperative matrices (the end
// of this file).

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
    tiles_w: u32,    // ceil(rows / BW)
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

// x (binding 2) and `x_four(i, k)`: elements i .. i + 4 of x, which are columns k .. k + 4 of
// one row (k < cols), those past the row's end zero.
// @@ xvec xvec_emu
// cols and i are multiples of 4: one vec4 load, all four inside the row.
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
fn x_four(i: u32, k: u32) -> vec4<f32> {
    return x[i >> 2u];
}
// @@ xscalar xscalar_emu
@group(0) @binding(2) var<storage, read> x: array<f32>;
fn x_four(i: u32, k: u32) -> vec4<f32> {
    var v = vec4<f32>(0.0);
    for (var e = 0u; e < 4u; e++) {
        if (k + e < p.cols) {
            v[e] = x[i + e];
        }
    }
    return v;
}
// @@ end

const BW: u32 = 128u;
const BK: u32 = 32u;
const SK: u32 = 40u;
const SK4: u32 = 10u;
const XV: u32 = BX / 32u;   // x vec4s each invocation stages per step = A matrices per subgroup
const SX4: u32 = BX * SK4;  // vec4s per buffered X tile
const SW4: u32 = BW * SK4;  // vec4s per buffered W tile

var<workgroup> sx: array<vec4<f16>, 2u * SX4>;
var<workgroup> sw: array<vec4<f16>, 2u * SW4>;
var<workgroup> scratch: array<f32, 2048>;

// ---- staging -------------------------------------------------------------------------------

// The X tile of one step: BX rows x 32 columns = BX * 8 vec4s, XV per invocation; slot s is
// vec4 v = tid + 256 s: row v / 8, columns (v % 8) * 4 .. + 4 (8 invocations read one row's
// 128 contiguous bytes). Raw f32 here; rounded in store_x.
fn load_x(tid: u32, x0: u32, k0: u32) -> array<vec4<f32>, 4> {
    var r: array<vec4<f32>, 4>;
    for (var s = 0u; s < XV; s++) {
        let v = tid + s * 256u;
        let row = x0 + v / 8u;
        let k = k0 + (v % 8u) * 4u;
        var v4 = vec4<f32>(0.0);
        if (row < p.n && k < p.cols) {
            v4 = x_four(p.x_off + row * p.cols + k, k);
        }
        r[s] = v4;
    }
    return r;
}

fn store_x(tid: u32, buf: u32, r: array<vec4<f32>, 4>) {
    for (var s = 0u; s < XV; s++) {
        let v = tid + s * 256u;
        sx[buf * SX4 + (v / 8u) * SK4 + v % 8u] = vec4<f16>(clamp(r[s], vec4<f32>(-65504.0), vec4<f32>(65504.0)));
    }
}

// The W tile of one step: 128 rows x 32 columns = 512 runs of 8 weights, 2 per invocation;
// run u = tid + 256 s covers row u / 4, columns (u % 4) * 8 .. + 8 (4 invocations decode one
// row's 32 columns, mostly one block: a subgroup reads 8 rows' blocks).
fn load_w(tid: u32, w0: u32, k0: u32) -> array<vec4<f16>, 4> {
    var r: array<vec4<f16>, 4>;
    for (var s = 0u; s < 2u; s++) {
        let u = tid + s * 256u;
        let row = w0 + u / 4u;
        let c = k0 + (u % 4u) * 8u;
        var v = V8(vec4<f32>(0.0), vec4<f32>(0.0));
        if (row < p.rows && c < p.cols) {
            v = deq8(p.w_off + row * p.row_bytes, c, p.cols);
        }
        r[2u * s] = vec4<f16>(v.lo);
        r[2u * s + 1u] = vec4<f16>(v.hi);
    }
    return r;
}

fn store_w(tid: u32, buf: u32, r: array<vec4<f16>, 4>) {
    for (var s = 0u; s < 2u; s++) {
        let u = tid + s * 256u;
        let at = buf * SW4 + (u / 4u) * SK4 + (u % 4u) * 2u;
        sw[at] = r[2u * s];
        sw[at + 1u] = r[2u * s + 1u];
    }
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

// Writes the 16 x 16 block at (x row xr0, W row wr0) that this subgroup just stored in its
// scratch matrix: lane l writes W rows wr0 + (l % 2) * 8 .. + 8 of x row xr0 + l / 2. Called by
// every invocation of the workgroup in the same order (it holds barriers).
fn drain(sg: u32, lane: u32, xr0: u32, wr0: u32) {
    workgroupBarrier();
    let r = lane / 2u;
    let c = (lane % 2u) * 8u;
    let s = sg * 256u + r * 16u + c;
    let xrow = xr0 + r;
    let wrow = wr0 + c;
    if (xrow < p.n) {
        let o = p.out_off + xrow * p.out_stride + wrow;
        for (var e = 0u; e < 8u; e++) {
            if (wrow + e < p.rows) {
                out[o + e] = scratch[s + e];
            }
        }
    }
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
    if (lin >= p.tiles_x * p.tiles_w) {
        return;
    }
    // x tiles vary fastest: the tiles_x workgroups that share a W tile run side by side, so
    // each W block is read from DRAM about once and decoded from L2 by the others.
    let x0 = (lin % p.tiles_x) * BX;
    let w0 = (lin / p.tiles_x) * BW;
    // This subgroup's BX/2 x rows and 32 W rows of the tile.
    let wx = (sg / 4u) * (BX / 2u);
    let ww = (sg % 4u) * 32u;

    // c<i><j>: x rows wx + 16i .., W rows ww + 16j ..; c2* and c3* only when XV = 4.
    var c00 = coop_mat16x16<f32, C>();
    var c01 = coop_mat16x16<f32, C>();
    var c10 = coop_mat16x16<f32, C>();
    var c11 = coop_mat16x16<f32, C>();
    var c20 = coop_mat16x16<f32, C>();
    var c21 = coop_mat16x16<f32, C>();
    var c30 = coop_mat16x16<f32, C>();
    var c31 = coop_mat16x16<f32, C>();

    let ntiles = (p.cols + BK - 1u) / BK;
    var rx = load_x(tid, x0, 0u);
    var rw = load_w(tid, w0, 0u);
    store_x(tid, 0u, rx);
    store_w(tid, 0u, rw);
    workgroupBarrier();
    for (var t = 0u; t < ntiles; t++) {
        let cur = t % 2u;
        let more = t + 1u < ntiles;
        if (more) {
            rx = load_x(tid, x0, (t + 1u) * BK);
        }
        for (var kk = 0u; kk < BK; kk += 16u) {
            var a0: coop_mat16x16<f16, A>;
            var a1: coop_mat16x16<f16, A>;
            var b0: coop_mat16x16<f16, B>;
            var b1: coop_mat16x16<f16, B>;
            a0 = coopLoadT<coop_mat16x16<f16, A>>(&sx[x_at(cur, wx, kk)], SK4);
            a1 = coopLoadT<coop_mat16x16<f16, A>>(&sx[x_at(cur, wx + 16u, kk)], SK4);
            b0 = coopLoad<coop_mat16x16<f16, B>>(&sw[w_at(cur, ww, kk)], SK4);
            b1 = coopLoad<coop_mat16x16<f16, B>>(&sw[w_at(cur, ww + 16u, kk)], SK4);
            c00 = coopMultiplyAdd(a0, b0, c00);
            c01 = coopMultiplyAdd(a0, b1, c01);
            c10 = coopMultiplyAdd(a1, b0, c10);
            c11 = coopMultiplyAdd(a1, b1, c11);
            if (XV == 4u) {
                var a2: coop_mat16x16<f16, A>;
                var a3: coop_mat16x16<f16, A>;
                a2 = coopLoadT<coop_mat16x16<f16, A>>(&sx[x_at(cur, wx + 32u, kk)], SK4);
                a3 = coopLoadT<coop_mat16x16<f16, A>>(&sx[x_at(cur, wx + 48u, kk)], SK4);
                c20 = coopMultiplyAdd(a2, b0, c20);
                c21 = coopMultiplyAdd(a2, b1, c21);
                c30 = coopMultiplyAdd(a3, b0, c30);
                c31 = coopMultiplyAdd(a3, b1, c31);
            }
        }
        if (more) {
            rw = load_w(tid, w0, (t + 1u) * BK);
            store_x(tid, 1u - cur, rx);
            store_w(tid, 1u - cur, rw);
        }
        workgroupBarrier();
    }

    let xr = x0 + wx;
    let wr = w0 + ww;
    coopStoreT(c00, &scratch[sg * 256u], 16u);
    drain(sg, lane, xr, wr);
    coopStoreT(c01, &scratch[sg * 256u], 16u);
    drain(sg, lane, xr, wr + 16u);
    coopStoreT(c10, &scratch[sg * 256u], 16u);
    drain(sg, lane, xr + 16u, wr);
    coopStoreT(c11, &scratch[sg * 256u], 16u);
    drain(sg, lane, xr + 16u, wr + 16u);
    if (XV == 4u) {
        coopStoreT(c20, &scratch[sg * 256u], 16u);
        drain(sg, lane, xr + 32u, wr);
        coopStoreT(c21, &scratch[sg * 256u], 16u);
        drain(sg, lane, xr + 32u, wr + 16u);
        coopStoreT(c30, &scratch[sg * 256u], 16u);
        drain(sg, lane, xr + 48u, wr);
        coopStoreT(c31, &scratch[sg * 256u], 16u);
        drain(sg, lane, xr + 48u, wr + 16u);
    }
}

// @@ xvec_emu xscalar_emu
// ---- tests only: cooperative matrices emulated in plain WGSL ---------------------------------
// quant/coop.rs (`set_emulated`) rewrites the coop types and calls above into these, so the
// kernel's staging, indexing, edges and drain run on devices without cooperative matrices
// (lavapipe). `sg` and `lane` come from the invocation index (subgroups of 32 consecutive
// invocations). An A or B "matrix" is where it lies in sx or sw (the kernel consumes them before
// the next barrier, as the emulation requires); an accumulator is spread over its subgroup, lane
// l holding row l / 2, columns (l % 2) * 8 .. + 8, and the scratch is private: each invocation
// stores its own 8 elements there, so the drain reads back only what it stored, and an element
// it reads at any other index is a zero that the tests catch.
struct EmuA {
    at: u32,
    stride: u32,
}
struct EmuB {
    at: u32,
    stride: u32,
}
struct EmuC {
    v: array<f32, 8>,
}

var<private> emu_lane: u32;

// coopLoadT from sx: A[r][k] is lane k % 4 of sx[at + r * stride + k / 4] (row-major).
fn emu_load_x(at: u32, stride: u32) -> EmuA {
    return EmuA(at, stride);
}

// coopLoad from sw: B[k][c] is lane k % 4 of sw[at + c * stride + k / 4] (column-major).
fn emu_load_w(at: u32, stride: u32) -> EmuB {
    return EmuB(at, stride);
}

// coopMultiplyAdd: acc + A B, this lane's 8 elements.
fn emu_mad(a: EmuA, b: EmuB, acc: EmuC) -> EmuC {
    var m = acc;
    let r = emu_lane / 2u;
    for (var j = 0u; j < 8u; j++) {
        let c = (emu_lane % 2u) * 8u + j;
        var s = m.v[j];
        for (var k = 0u; k < 16u; k++) {
            let av = f32(sx[a.at + r * a.stride + k / 4u][k % 4u]);
            let bv = f32(sw[b.at + c * b.stride + k / 4u][k % 4u]);
            s = fma(av, bv, s);
        }
        m.v[j] = s;
    }
    return m;
}

// coopStoreT (row-major): element (r, c) at at + r * stride + c.
fn emu_store(m: EmuC, at: u32, stride: u32) {
    let r = emu_lane / 2u;
    for (var j = 0u; j < 8u; j++) {
        scratch[at + r * stride + (emu_lane % 2u) * 8u + j] = m.v[j];
    }
}
// @@ end
