// Tests only: what the emulated variants of the cooperative-matrix kernels share
// (quant/matmul_coop.wgsl, ops/attention_coop.wgsl; their hosts' `set_emulated` rewrite the
// coop types and calls into these and append this file), so that a kernel's staging, indexing,
// masking and drain run on devices without cooperative matrices (lavapipe). A loaded A or B
// matrix is an `EmuM`: where it lies in workgroup memory (`src` picks the array, each kernel's
// `emu_el(m, r, c)` reads element (r, c); the kernel consumes it before the next barrier). An
// accumulator is spread over its subgroup, lane l (`emu_lane`) holding row l / 2, columns
// (l % 2) * 8 .. + 8; the kernels' scratch is private, so a lane that reads an element it did
// not store reads a zero, which the tests catch.

struct EmuM {
    src: u32,
    at: u32,
    stride: u32,
}

struct EmuC {
    v: array<f32, 8>,
}

var<private> emu_lane: u32;

// coopMultiplyAdd: acc + A B, this lane's 8 elements.
fn emu_mad(a: EmuM, b: EmuM, acc: EmuC) -> EmuC {
    var m = acc;
    let r = emu_lane / 2u;
    for (var j = 0u; j < 8u; j++) {
        let c = (emu_lane % 2u) * 8u + j;
        var s = m.v[j];
        for (var k = 0u; k < 16u; k++) {
            s = fma(emu_el(a, r, k), emu_el(b, k, c), s);
        }
        m.v[j] = s;
    }
    return m;
}

// coopStoreT (row-major) into the kernel's scratch: element (r, c) at at + r * stride + c.
fn emu_store(m: EmuC, at: u32, stride: u32) {
    let r = emu_lane / 2u;
    for (var j = 0u; j < 8u; j++) {
        scratch[at + r * stride + (emu_lane % 2u) * 8u + j] = m.v[j];
    }
}
