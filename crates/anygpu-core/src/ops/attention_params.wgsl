// The parameters of the attention kernels (attention.wgsl, attention_decode.wgsl), shared as
// the host fills them (`Params` in attention.rs): shapes, key splits, offsets and strides in
// elements (b, h, t, d).
struct Params {
    batch: u32,
    hkv: u32,
    g: u32,
    tq: u32,
    tk: u32,
    rows: u32,
    n_rblocks: u32,
    n_splits: u32,
    split_len: u32,
    causal: u32,
    scale: f32,
    d4: u32,
    q_off: u32,
    k_off: u32,
    v_off: u32,
    _pad1: u32,
    // strides (b, h, t, d) in elements
    qs: vec4<u32>,
    ks: vec4<u32>,
    vs: vec4<u32>,
    os: vec4<u32>, // the output's (n_splits = 1); its d stride is 1
}
