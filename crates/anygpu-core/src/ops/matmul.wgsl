// Batched f32 matmul C[b] = A[b] x B[b] (+ bias), any strides (so transposed operands are
// free views). 64x64 output tile per workgroup, 16x16 threads each computing a 4x4 block,
// K staged through workgroup memory 16 at a time (8 KiB: fits WebGPU's 16 KiB default).

struct Params {
    m: u32,
    n: u32,
    k: u32,
    has_bias: u32,
    bias_off: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
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
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
@group(0) @binding(4) var<storage, read_write> c: array<f32>;

const TM: u32 = 64u;
const TN: u32 = 64u;
const TK: u32 = 16u;

var<workgroup> a_tile: array<f32, 1024>; // [TK][TM]
var<workgroup> b_tile: array<f32, 1024>; // [TK][TN]

@compute @workgroup_size(16, 16)
fn matmul(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let batch = wid.z;
    let row0 = wid.y * TM;
    let col0 = wid.x * TN;
    let tid = lid.y * 16u + lid.x;
    let a_base = p.a_off + batch * p.a_sb;
    let b_base = p.b_off + batch * p.b_sb;
    var acc: array<f32, 16>;
    for (var k0 = 0u; k0 < p.k; k0 = k0 + TK) {
        for (var i = 0u; i < 4u; i = i + 1u) {
            let e = tid + i * 256u;
            // A tile: consecutive threads walk k (coalesced for row-major A).
            let am = e / TK;
            let ak = e % TK;
            var av = 0.0;
            if (row0 + am < p.m && k0 + ak < p.k) {
                av = a[a_base + (row0 + am) * p.a_sm + (k0 + ak) * p.a_sk];
            }
            a_tile[ak * TM + am] = av;
            // B tile: consecutive threads walk n (coalesced for row-major B).
            let bk = e / TN;
            let bn = e % TN;
            var bv = 0.0;
            if (k0 + bk < p.k && col0 + bn < p.n) {
                bv = b[b_base + (k0 + bk) * p.b_sk + (col0 + bn) * p.b_sn];
            }
            b_tile[bk * TN + bn] = bv;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < TK; kk = kk + 1u) {
            var ar: array<f32, 4>;
            var br: array<f32, 4>;
            for (var i = 0u; i < 4u; i = i + 1u) {
                ar[i] = a_tile[kk * TM + lid.y + i * 16u];
                br[i] = b_tile[kk * TN + lid.x + i * 16u];
            }
            for (var i = 0u; i < 4u; i = i + 1u) {
                for (var j = 0u; j < 4u; j = j + 1u) {
                    acc[i * 4u + j] = acc[i * 4u + j] + ar[i] * br[j];
                }
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i = i + 1u) {
        let r = row0 + lid.y + i * 16u;
        for (var j = 0u; j < 4u; j = j + 1u) {
            let col = col0 + lid.x + j * 16u;
            if (r < p.m && col < p.n) {
                var v = acc[i * 4u + j];
                if (p.has_bias != 0u) {
                    v = v + bias[p.bias_off + col];
                }
                c[(batch * p.m + r) * p.n + col] = v;
            }
        }
    }
}
