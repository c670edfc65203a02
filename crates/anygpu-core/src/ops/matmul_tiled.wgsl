// Register-blocked batched matmul C[b] = A[b] x B[b] (+ bias), f32 arithmetic.
//
// One workgroup of 256 threads (16 x 16) computes a 128 x 128 tile of C; each thread owns an
// 8 x 8 block of it (64 accumulators in registers) made of two 4-row and two 4-column strips,
// rows {ty*4 .. ty*4+3, 64+ty*4 .. 64+ty*4+3} and columns {tx*4 .., 64+tx*4 ..}. Strips 64 apart
// (rather than 8 contiguous rows) keep every workgroup-memory read a vec4 that 16 threads of a
// half-warp take from 16 consecutive vec4s: no bank conflicts, and 4 vec4 reads feed 64 FMAs.
//
// K is staged through workgroup memory BK at a time, as [k][m] and [k][n] (vec4 over m / n),
// double-buffered: the next tile's global loads are issued into registers before the current
// tile's FMAs and stored afterwards, so one barrier per tile suffices. BK = 8 uses exactly
// 16 KiB (WebGPU's default limit); BK = 16 (32 KiB) when the device allows.
//
// The header supplies the specialisation:
//   BK          8 or 16
//   LA          how A is read: 0 any strides (scalar loads), 1 K contiguous (vec4 along K),
//               2 M contiguous (vec4 along M)
//   LB          how B is read: 0 any strides, 1 N contiguous (vec4 along N), 2 K contiguous
//   VEC_OUT     1 when N % 4 == 0: output rows are vec4-aligned
// and the IO placeholder the bindings and element access for the operand/output storage types:
//   ld_a4(i) / ld_b4(i)  elements i..i+3 as vec4<f32> (i a multiple of 4)
//   ld_a(i) / ld_b(i)    element i as f32
//   ld_bias(i)           bias element i as f32
//   st_c4(i, v)          outputs i..i+3 (i a multiple of 4)
//   st_c(i, v)           output i

struct Params {
    m: u32,
    n: u32,
    k: u32,
    has_bias: u32,
    bias_off: u32,
    // First batch index of this dispatch (batches over 65,535 take several dispatches).
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

{{IO}}

const BM: u32 = 128u;
const BN: u32 = 128u;
// vec4 slots of one buffered K-tile of A (or B): BK rows of 128 / 4.
const TILE4: u32 = BK * 32u;
// vec4 loads per thread per K-tile, for A and for B.
const LOADS: u32 = BK / 8u;
// Tile rows grouped along M when walking the grid, so consecutive workgroups share B columns
// and A rows in L2.
const GROUP_M: u32 = 8u;

var<workgroup> sa: array<vec4<f32>, 2u * TILE4>; // [buffer][k][m / 4]
var<workgroup> sb: array<vec4<f32>, 2u * TILE4>; // [buffer][k][n / 4]

// Four consecutive elements of one row (or column) of A or B starting at element `i`: `len`
// of them exist (those beyond read as 0). Vectorised when the whole vec4 lies in the row.
fn a_vec(i: u32, len: u32) -> vec4<f32> {
    if (len >= 4u) {
        return ld_a4(i);
    }
    return select(vec4<f32>(0.0), ld_a4(i), vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(len));
}
fn b_vec(i: u32, len: u32) -> vec4<f32> {
    if (len >= 4u) {
        return ld_b4(i);
    }
    return select(vec4<f32>(0.0), ld_b4(i), vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(len));
}

// Global loads of one K-tile into registers. Slot s of this thread is vec4 index
// v = tid + s * 256 of the tile; which (row, k) it covers depends on the layout.
fn load_a(tid: u32, m0: u32, k0: u32, a_base: u32) -> array<vec4<f32>, LOADS> {
    var r: array<vec4<f32>, LOADS>;
    for (var s = 0u; s < LOADS; s = s + 1u) {
        let v = tid + s * 256u;
        var x = vec4<f32>(0.0);
        if (LA == 2u) {
            // [k][m/4]: four consecutive rows of one column k.
            let k = k0 + v / 32u;
            let m = m0 + (v % 32u) * 4u;
            if (k < p.k && m < p.m) {
                x = a_vec(a_base + m + k * p.a_sk, p.m - m);
            }
        } else {
            // [m][k/4]: four consecutive k of one row m.
            let m = m0 + v / (BK / 4u);
            let k = k0 + (v % (BK / 4u)) * 4u;
            if (m < p.m && k < p.k) {
                if (LA == 1u) {
                    x = a_vec(a_base + m * p.a_sm + k, p.k - k);
                } else {
                    let row = a_base + m * p.a_sm;
                    for (var e = 0u; e < 4u; e = e + 1u) {
                        if (k + e < p.k) {
                            x[e] = ld_a(row + (k + e) * p.a_sk);
                        }
                    }
                }
            }
        }
        r[s] = x;
    }
    return r;
}

fn store_a(tid: u32, buf: u32, r: array<vec4<f32>, LOADS>) {
    for (var s = 0u; s < LOADS; s = s + 1u) {
        let v = tid + s * 256u;
        if (LA == 2u) {
            sa[buf * TILE4 + v] = r[s];
        } else {
            // Transpose into [k][m]: four scalar stores (a 2-way bank conflict, once per tile).
            let m = v / (BK / 4u);
            let k = (v % (BK / 4u)) * 4u;
            let x = r[s];
            for (var e = 0u; e < 4u; e = e + 1u) {
                sa[buf * TILE4 + (k + e) * 32u + m / 4u][m % 4u] = x[e];
            }
        }
    }
}

fn load_b(tid: u32, n0: u32, k0: u32, b_base: u32) -> array<vec4<f32>, LOADS> {
    var r: array<vec4<f32>, LOADS>;
    for (var s = 0u; s < LOADS; s = s + 1u) {
        let v = tid + s * 256u;
        var x = vec4<f32>(0.0);
        if (LB == 2u) {
            // [n][k/4]: four consecutive k of one column n.
            let n = n0 + v / (BK / 4u);
            let k = k0 + (v % (BK / 4u)) * 4u;
            if (n < p.n && k < p.k) {
                x = b_vec(b_base + n * p.b_sn + k, p.k - k);
            }
        } else {
            // [k][n/4]: four consecutive columns of one row k.
            let k = k0 + v / 32u;
            let n = n0 + (v % 32u) * 4u;
            if (k < p.k && n < p.n) {
                if (LB == 1u) {
                    x = b_vec(b_base + k * p.b_sk + n, p.n - n);
                } else {
                    let row = b_base + k * p.b_sk;
                    for (var e = 0u; e < 4u; e = e + 1u) {
                        if (n + e < p.n) {
                            x[e] = ld_b(row + (n + e) * p.b_sn);
                        }
                    }
                }
            }
        }
        r[s] = x;
    }
    return r;
}

fn store_b(tid: u32, buf: u32, r: array<vec4<f32>, LOADS>) {
    for (var s = 0u; s < LOADS; s = s + 1u) {
        let v = tid + s * 256u;
        if (LB == 2u) {
            let n = v / (BK / 4u);
            let k = (v % (BK / 4u)) * 4u;
            let x = r[s];
            for (var e = 0u; e < 4u; e = e + 1u) {
                sb[buf * TILE4 + (k + e) * 32u + n / 4u][n % 4u] = x[e];
            }
        } else {
            sb[buf * TILE4 + v] = r[s];
        }
    }
}

@compute @workgroup_size(256)
fn matmul(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
) {
    // Tile coordinates from the linear workgroup index, in groups of GROUP_M tile rows.
    let lin = wid.x + wid.y * nwg.x;
    if (lin >= p.tiles_m * p.tiles_n) {
        return;
    }
    let per_group = GROUP_M * p.tiles_n;
    let first_m = (lin / per_group) * GROUP_M;
    let group_rows = min(p.tiles_m - first_m, GROUP_M);
    let tile_m = first_m + (lin % per_group) % group_rows;
    let tile_n = (lin % per_group) / group_rows;
    let m0 = tile_m * BM;
    let n0 = tile_n * BN;
    let batch = p.batch0 + wid.z;
    let a_base = p.a_off + batch * p.a_sb;
    let b_base = p.b_off + batch * p.b_sb;
    let tx = tid % 16u;
    let ty = tid / 16u;

    // acc[i * 2 + j]: row strip i (0..7, see the header), column strip j (0..1).
    var acc: array<vec4<f32>, 16>;
    let ntiles = (p.k + BK - 1u) / BK;
    var ra = load_a(tid, m0, 0u, a_base);
    var rb = load_b(tid, n0, 0u, b_base);
    store_a(tid, 0u, ra);
    store_b(tid, 0u, rb);
    workgroupBarrier();
    for (var t = 0u; t < ntiles; t = t + 1u) {
        let cur = t % 2u;
        let more = t + 1u < ntiles;
        if (more) {
            ra = load_a(tid, m0, (t + 1u) * BK, a_base);
            rb = load_b(tid, n0, (t + 1u) * BK, b_base);
        }
        let base = cur * TILE4;
        for (var kk = 0u; kk < BK; kk = kk + 1u) {
            let row = base + kk * 32u;
            let a0 = sa[row + ty];
            let a1 = sa[row + 16u + ty];
            let b0 = sb[row + tx];
            let b1 = sb[row + 16u + tx];
            acc[0] = fma(vec4<f32>(a0.x), b0, acc[0]);
            acc[1] = fma(vec4<f32>(a0.x), b1, acc[1]);
            acc[2] = fma(vec4<f32>(a0.y), b0, acc[2]);
            acc[3] = fma(vec4<f32>(a0.y), b1, acc[3]);
            acc[4] = fma(vec4<f32>(a0.z), b0, acc[4]);
            acc[5] = fma(vec4<f32>(a0.z), b1, acc[5]);
            acc[6] = fma(vec4<f32>(a0.w), b0, acc[6]);
            acc[7] = fma(vec4<f32>(a0.w), b1, acc[7]);
            acc[8] = fma(vec4<f32>(a1.x), b0, acc[8]);
            acc[9] = fma(vec4<f32>(a1.x), b1, acc[9]);
            acc[10] = fma(vec4<f32>(a1.y), b0, acc[10]);
            acc[11] = fma(vec4<f32>(a1.y), b1, acc[11]);
            acc[12] = fma(vec4<f32>(a1.z), b0, acc[12]);
            acc[13] = fma(vec4<f32>(a1.z), b1, acc[13]);
            acc[14] = fma(vec4<f32>(a1.w), b0, acc[14]);
            acc[15] = fma(vec4<f32>(a1.w), b1, acc[15]);
        }
        if (more) {
            store_a(tid, 1u - cur, ra);
            store_b(tid, 1u - cur, rb);
        }
        workgroupBarrier();
    }

    // Epilogue (accumulators indexed by constants only, so they stay in registers).
    let c0 = n0 + tx * 4u;
    let c1 = c0 + 64u;
    let b0 = bias4(c0);
    let b1 = bias4(c1);
    let r0 = m0 + ty * 4u;
    let r1 = r0 + 64u;
    let out_base = batch * p.m * p.n;
    emit(out_base, r0, c0, acc[0] + b0);
    emit(out_base, r0, c1, acc[1] + b1);
    emit(out_base, r0 + 1u, c0, acc[2] + b0);
    emit(out_base, r0 + 1u, c1, acc[3] + b1);
    emit(out_base, r0 + 2u, c0, acc[4] + b0);
    emit(out_base, r0 + 2u, c1, acc[5] + b1);
    emit(out_base, r0 + 3u, c0, acc[6] + b0);
    emit(out_base, r0 + 3u, c1, acc[7] + b1);
    emit(out_base, r1, c0, acc[8] + b0);
    emit(out_base, r1, c1, acc[9] + b1);
    emit(out_base, r1 + 1u, c0, acc[10] + b0);
    emit(out_base, r1 + 1u, c1, acc[11] + b1);
    emit(out_base, r1 + 2u, c0, acc[12] + b0);
    emit(out_base, r1 + 2u, c1, acc[13] + b1);
    emit(out_base, r1 + 3u, c0, acc[14] + b0);
    emit(out_base, r1 + 3u, c1, acc[15] + b1);
}

// The bias for columns col..col+3 (0 without a bias or past N).
fn bias4(col: u32) -> vec4<f32> {
    var b = vec4<f32>(0.0);
    if (p.has_bias != 0u) {
        for (var e = 0u; e < 4u; e = e + 1u) {
            if (col + e < p.n) {
                b[e] = ld_bias(p.bias_off + col + e);
            }
        }
    }
    return b;
}

// Writes outputs (r, col..col+3) that exist: one vec4 store when the row allows.
fn emit(out_base: u32, r: u32, col: u32, v: vec4<f32>) {
    if (r >= p.m || col >= p.n) {
        return;
    }
    let o = out_base + r * p.n + col;
    if (VEC_OUT == 1u && col + 4u <= p.n) {
        st_c4(o, v);
    } else {
        for (var e = 0u; e < 4u; e = e + 1u) {
            if (col + e < p.n) {
                st_c(o + e, v[e]);
            }
        }
    }
}
