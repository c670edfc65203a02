// Y = X W^T with W in GGML blocks (prefill, perplexity: many x rows). Tiled: a workgroup owns a
// 64 (W rows) x 64 (x rows) output tile and walks K in steps of 32. Each step dequantizes the
// 64 x 32 tile of W into workgroup memory once (deq8: every invocation expands 8 weights of one
// row) and stages the 64 x 32 tile of x beside it, then every invocation accumulates a 4 x 4
// block of outputs from the two tiles: W is decoded once per 64 x rows instead of once per row.
// Both tiles are stored K-major as vec4 (16 KiB in all: exactly WebGPU's default limit) so the
// inner loop reads one vec4 of each per k.
//
// Assembled by the host with common.wgsl (one type's sections) and `fn deq8(rb, c, cols) -> V8`
// forwarding to the type's expansion.

struct Params {
    rows: u32,       // rows of W in this dispatch
    cols: u32,
    row_bytes: u32,
    w_off: u32,      // byte offset of this dispatch's first row inside the weight binding
    n: u32,          // x rows in this dispatch
    x_off: u32,      // first x element inside the x binding; x rows are `cols` apart
    out_off: u32,    // output index of (x row 0, W row 0)
    out_stride: u32, // output elements per x row
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

const BM: u32 = 64u;
const BN: u32 = 64u;
const BK: u32 = 32u;

// ws[k * 16 + m / 4][m % 4] = W[m0 + m, k0 + k]; xs likewise for x.
var<workgroup> ws: array<vec4<f32>, 512>;
var<workgroup> xs: array<vec4<f32>, 512>;

@compute @workgroup_size(256)
fn matmul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let m0 = wid.x * BM;
    let n0 = wid.y * BN;
    // Loading: invocation lid fills row lr of both tiles, columns lk..lk+8. A warp covers 32
    // consecutive rows at one k, so its workgroup-memory stores hit 32 distinct banks.
    let lr = lid % 64u;
    let lk = (lid / 64u) * 8u;
    let w_ok = m0 + lr < p.rows;
    let x_ok = n0 + lr < p.n;
    let rb = p.w_off + select(0u, (m0 + lr) * p.row_bytes, w_ok);
    let xb = p.x_off + select(0u, (n0 + lr) * p.cols, x_ok);
    let sv = lr / 4u;
    let sc = lr % 4u;
    // Computing: invocation (tm, tn) owns W rows m0 + 4tm.. and x rows n0 + 4tn..
    let tm = lid % 16u;
    let tn = lid / 16u;
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    for (var k0 = 0u; k0 < p.cols; k0 += BK) {
        var v = V8(vec4<f32>(0.0), vec4<f32>(0.0));
        if (w_ok) {
            v = deq8(rb, k0 + lk, p.cols);
        }
        for (var i = 0u; i < 4u; i++) {
            ws[(lk + i) * 16u + sv][sc] = v.lo[i];
            ws[(lk + 4u + i) * 16u + sv][sc] = v.hi[i];
        }
        for (var i = 0u; i < 8u; i++) {
            let kk = k0 + lk + i;
            xs[(lk + i) * 16u + sv][sc] = select(0.0, x[xb + kk], x_ok && kk < p.cols);
        }
        workgroupBarrier();
        for (var k = 0u; k < BK; k++) {
            let a = ws[k * 16u + tm];
            let b = xs[k * 16u + tn];
            acc0 = fma(a, vec4<f32>(b.x), acc0);
            acc1 = fma(a, vec4<f32>(b.y), acc1);
            acc2 = fma(a, vec4<f32>(b.z), acc2);
            acc3 = fma(a, vec4<f32>(b.w), acc3);
        }
        workgroupBarrier();
    }
    let m = m0 + 4u * tm;
    let nb = n0 + 4u * tn;
    let accs = array<vec4<f32>, 4>(acc0, acc1, acc2, acc3);
    for (var j = 0u; j < 4u; j++) {
        if (nb + j < p.n) {
            let o = p.out_off + (nb + j) * p.out_stride + m;
            for (var i = 0u; i < 4u; i++) {
                if (m + i < p.rows) {
                    out[o + i] = accs[j][i];
                }
            }
        }
    }
}
