// Merges the key splits of attention.wgsl (flash-decoding's second pass). Each split wrote,
// per output row, (m, l, acc[D]) with m its row max in the log2 domain, l its sum of
// exp2(s - m) and acc the unnormalised weighted sum of V. Rescaled to the common max M:
//   out = sum_s exp2(m_s - M) acc_s / sum_s exp2(m_s - M) l_s
// One thread per output element, in [B, Hq, Tq, D] order (the partials'); output row (b, h, i)
// is written at its strides (attention.rs stores it in [B, Tq, Hq, D] order). The few (m, l)
// reads a thread repeats hit the cache. (The decode step's output projection can do this
// merge itself: the combine prologue of quant/matvec.wgsl, see x_side in quant/gpu.rs.)

struct Params {
    n: u32,
    d: u32,
    n_splits: u32,
    off: u32, // the partials' first element
    tq: u32,
    hq: u32,
    _p0: u32,
    _p1: u32,
    os: vec4<u32>, // the output's strides (b, h, t, d); d is 1
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> part: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(256)
fn attention_combine(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let idx = gid.x + gid.y * nwg.x * 256u;
    if (idx >= p.n) {
        return;
    }
    let row = idx / p.d;
    let col = idx % p.d;
    let stride = p.d + 2u;
    let base = p.off + row * p.n_splits * stride;
    var mx = -1.0e30;
    for (var s = 0u; s < p.n_splits; s++) {
        mx = max(mx, part[base + s * stride]);
    }
    var total = 0.0;
    var o = 0.0;
    for (var s = 0u; s < p.n_splits; s++) {
        let b = base + s * stride;
        let w = exp2(part[b] - mx);
        total += w * part[b + 1u];
        o += w * part[b + 2u + col];
    }
    let i = row % p.tq;
    let bh = row / p.tq;
    let at = (bh / p.hq) * p.os.x + (bh % p.hq) * p.os.y + i * p.os.z + col;
    out[at] = select(0.0, o / total, total > 0.0);
}
