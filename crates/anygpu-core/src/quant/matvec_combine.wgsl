// The combine prologue of matvec.wgsl (`Prologue::Combine` in gpu.rs), appended to the kernel's
// source. x is the output of a split attention (flash-decoding) whose splits attention.wgsl left
// unmerged: instead of a separate attention_combine dispatch writing x to memory, every
// workgroup merges the x row it needs into workgroup memory before its products (as the RMSNorm
// prologue stages a normalised row). Each workgroup re-reads all of that row's partials, so
// the host only takes this path when the partials are small (see qmatvec_fused).
//
// The partials are bound at binding 2 as `part`: per attention output row (b, h, i) of
// [B, H, Tq, D] and per key split s, the D + 2 floats (m, l, acc[D]) at
// p.c_off + (row * CS + s) * (CD + 2), with m the split's row max (log2 domain), l its sum of
// exp2(score - m) and acc its unnormalised weighted sum of V; splits a row may not see hold
// (-1e30, 0, 0), those past the last key are not written (and not read: comb_live).
// x row xr (token b * Tq + i) has H * D elements: element h * D + c is column c of output row
// (b, h, i), as attention_combine.wgsl would write it:
//   x = sum_s exp2(m_s - M) acc_s / sum_s exp2(m_s - M) l_s,  M = max_s m_s (0 where l sums to 0).
// Host constants: CH heads, CD head dim (a multiple of 4: a vec4 of x lies in one head), CS
// splits, CTPH = 256 / (the next power of two >= CH) invocations per head in phase 1; the host
// declares `part` and the workgroup arrays (x4 or x1, and cw: array<f32, CH * CS>).

// The splits that can hold keys: the first ceil(Tk / split_len) (a decode step's grid has the
// splits of the cache's capacity, most of them empty early on; the replay patches c_keys).
fn comb_live() -> u32 {
    return min(CS, (p.c_keys + p.c_split_len - 1u) / p.c_split_len);
}

// Index of (row, split 0, m) for head h of x row xr.
fn comb_base(xr: u32, h: u32) -> u32 {
    let b = xr / p.c_tq;
    let i = xr - b * p.c_tq;
    return p.c_off + ((b * CH + h) * p.c_tq + i) * CS * (CD + 2u);
}

// Phase 1: each split's weight in the merged row, exp2(m_s - M) / sum_s' exp2(m_s' - M) l_s',
// into cw[h * CS + s]. CTPH invocations per head stride over the splits; their maxima and sums
// meet in shuffles and trees over `red`. Called by the whole workgroup (it has barriers); ends with one.
fn comb_weights(xr: u32, lid: u32) {
    let h = lid / CTPH;
    let j = lid % CTPH;
    let live = h < CH;
    let base = comb_base(xr, min(h, CH - 1u));
    let ns = comb_live();
    var mx = -1.0e30;
    if (live) {
        for (var s = j; s < ns; s += CTPH) {
            mx = max(mx, part[base + s * (CD + 2u)]);
        }
    }
    // Groups of min(CTPH, SGW) lanes reduce in registers (lanes_max / lanes_sum: matvec.wgsl),
    // the trees the rest.
    red[lid] = lanes_max(mx, min(CTPH, SGW));
    workgroupBarrier();
    for (var st = CTPH / 2u; st >= SGW; st >>= 1u) {
        if (j < st) {
            red[lid] = max(red[lid], red[lid + st]);
        }
        workgroupBarrier();
    }
    let m = red[lid - j];
    // Every invocation has its head's max before `red` takes the sums.
    workgroupBarrier();
    var total = 0.0;
    if (live) {
        for (var s = j; s < ns; s += CTPH) {
            let b = base + s * (CD + 2u);
            let wt = exp2(part[b] - m);
            cw[h * CS + s] = wt;
            total += wt * part[b + 1u];
        }
    }
    red[lid] = lanes_sum(total, min(CTPH, SGW));
    workgroupBarrier();
    for (var st = CTPH / 2u; st >= SGW; st >>= 1u) {
        if (j < st) {
            red[lid] += red[lid + st];
        }
        workgroupBarrier();
    }
    let sum = red[lid - j];
    let inv = select(0.0, 1.0 / sum, sum > 0.0);
    if (live) {
        // The same invocation wrote these weights: no barrier needed before the rescale.
        for (var s = j; s < ns; s += CTPH) {
            cw[h * CS + s] *= inv;
        }
    }
    workgroupBarrier();
}

// Phase 2: elements 4i .. 4i + 3 of x row xr (one head), the weighted sum of the live splits'
// acc.
fn comb_x4(xr: u32, i: u32) -> vec4<f32> {
    let e = 4u * i;
    let h = e / CD;
    let b0 = comb_base(xr, h) + 2u + (e - h * CD);
    let ns = comb_live();
    var o = vec4<f32>(0.0);
    for (var s = 0u; s < ns; s++) {
        let b = b0 + s * (CD + 2u);
        o += cw[h * CS + s] * vec4<f32>(part[b], part[b + 1u], part[b + 2u], part[b + 3u]);
    }
    return o;
}
