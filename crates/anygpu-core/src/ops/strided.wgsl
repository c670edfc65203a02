// Strided indexing shared by kernels that read non-contiguous views. A logical row-major
// index `i` over `shape` maps to `offset + sum(coord[d] * strides[d])`.
fn dim8(v: array<vec4<u32>, 2>, d: u32) -> u32 {
    return v[d / 4u][d % 4u];
}

fn strided_index(i: u32, rank: u32, shape: array<vec4<u32>, 2>, strides: array<vec4<u32>, 2>, offset: u32) -> u32 {
    var rem = i;
    var idx = offset;
    for (var d = i32(rank) - 1; d >= 0; d = d - 1) {
        let du = u32(d);
        let n = dim8(shape, du);
        idx = idx + (rem % n) * dim8(strides, du);
        rem = rem / n;
    }
    return idx;
}
