// W dequantized to f16 rows, laid out as GGUF's F16 tensors (quant/dequant_f16.rs): the
// prefill's tensor-core product then reads this copy through its F16 loader, one 16-byte load
// per run of 8 weights, instead of decoding the blocks in its staging. Each invocation expands
// one run (deq8) and rounds it to f16 as the coop kernel's W staging rounds it (`vec4<f16>` of
// the f32 weights, not clamped), so the product sees the very values it would have decoded.
//
// Assembled by the host with common.wgsl (one type's sections) and `fn deq8(rb, c, cols) -> V8`
// forwarding to the type's expansion.

struct Params {
    row_runs: u32,  // runs of 8 weights per row (cols / 8)
    row_bytes: u32,
    w_off: u32,     // byte offset of this dispatch's first row inside the weight binding
    runs: u32,      // runs in this dispatch (its rows times row_runs)
    out_off: u32,   // this dispatch's first run inside the output binding
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<vec4<f16>>;

// Each invocation expands RPI runs (from the host), 256 apart, their loads all issued before
// the first store: more bytes in flight per invocation (see RUNS_PER_INVOCATION in the host).
@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let base = (wid.x + wid.y * nwg.x) * (256u * RPI) + lid;
    var v: array<V8, RPI>;
    for (var j = 0u; j < RPI; j++) {
        let r = base + 256u * j;
        if (r < p.runs) {
            let row = r / p.row_runs;
            let c = (r - row * p.row_runs) * 8u;
            v[j] = deq8(p.w_off + row * p.row_bytes, c, p.row_runs * 8u);
        }
    }
    for (var j = 0u; j < RPI; j++) {
        let r = base + 256u * j;
        if (r < p.runs) {
            let o = 2u * (p.out_off + r);
            out[o] = vec4<f16>(v[j].lo);
            out[o + 1u] = vec4<f16>(v[j].hi);
        }
    }
}
