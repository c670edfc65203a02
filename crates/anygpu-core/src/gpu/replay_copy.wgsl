// Copies the first p.len words of a replayed step's output into word p.dst of the run's
// results buffer (replay.rs): a dispatch in the same compute pass as the steps, where a
// buffer copy between steps would end the pass (a transfer between compute passes cost
// ~35 µs of GPU time each on the H100 machine).

struct Params {
    len: u32,
    dst: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<u32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 64u;
    if (i < p.len) {
        dst[p.dst + i] = src[i];
    }
}
