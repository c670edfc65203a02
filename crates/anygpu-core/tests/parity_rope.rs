//! Parity tests for rotary position embeddings (normal and NeoX layouts, partial rotary dims,
//! long positions, llama3 frequency factors, linear scaling), plus hand-computed values and an
//! independent f64 reference for the CPU implementation itself.

use anygpu_core::ops::rope::RopeOpts;
use anygpu_core::ops::rope_kv::rope_qkv_store;
use anygpu_core::testing::{check_close, gpu_devices, parity, parity_err, rand_vec};
use anygpu_core::{Device, Tensor};

fn t(seed: u64, dims: &[usize], d: &Device) -> Tensor {
    Tensor::from_vec(rand_vec(seed, dims.iter().product()), dims, &Device::Cpu)
        .and_then(|t| t.to_device(d))
        .expect("upload")
}

fn opts(neox: bool, rotary_dim: usize) -> RopeOpts {
    RopeOpts { neox, rotary_dim, ..RopeOpts::default() }
}

/// llama3-style factors: 1 for high frequencies, up to 8 for low ones.
fn llama3_factors(half: usize) -> Vec<f32> {
    (0..half).map(|i| 1.0 + 7.0 * (i as f32 / half.max(1) as f32).powi(2)).collect()
}

/// An independent f64 reference: angle = pos * freq_scale / ff[i] * base^(-2i / rotary_dim).
fn rope_f64(x: &[f32], dims: &[usize], start_pos: usize, o: &RopeOpts) -> Vec<f32> {
    let r = dims.len();
    let (tn, h, d) = (dims[r - 3], dims[r - 2], dims[r - 1]);
    let rd = if o.rotary_dim == 0 { d } else { o.rotary_dim };
    let half = rd / 2;
    let mut out = x.to_vec();
    for (row, head) in out.chunks_mut(d).enumerate() {
        let pos = (start_pos + (row / h) % tn) as f64;
        for i in 0..half {
            let ff = o.freq_factors.as_ref().map_or(1.0, |f| f[i] as f64);
            let a = pos * o.freq_scale as f64 / ff * (o.base as f64).powf(-2.0 * i as f64 / rd as f64);
            let (i0, i1) = if o.neox { (i, i + half) } else { (2 * i, 2 * i + 1) };
            let (x0, x1) = (head[i0] as f64, head[i1] as f64);
            head[i0] = (x0 * a.cos() - x1 * a.sin()) as f32;
            head[i1] = (x0 * a.sin() + x1 * a.cos()) as f32;
        }
    }
    out
}

#[test]
fn a_gpu_adapter_is_tested() {
    let names: Vec<String> = gpu_devices().iter().map(|d| d.name()).collect();
    eprintln!("GPU devices under test: {names:?}");
    if anygpu_core::testing::require_gpu() {
        assert!(!names.is_empty(), "no GPU device under test");
    }
}

#[test]
fn rope_hand_computed() {
    let (c1, s1) = (1f32.cos(), 1f32.sin());
    let (c2, s2) = (2f32.cos(), 2f32.sin());
    for d in std::iter::once(&Device::Cpu).chain(gpu_devices()) {
        // D = 2, positions 1 and 2: rotations by 1 and 2 rad.
        let x = Tensor::from_slice(&[1.0f32, 0.0, 0.0, 1.0], [2, 1, 2], d).unwrap();
        let y = x.rope(1, &RopeOpts::default()).unwrap().to_vec::<f32>().unwrap();
        check_close("rope D=2", &y, &[c1, s1, -s2, c2], 1e-6, 0.0).unwrap_or_else(|e| panic!("{e} on {}", d.name()));
        // D = 4 at position 1, base 10000: pair 0 turns by 1 rad, pair 1 by 10000^(-1/2) = 0.01.
        let (c, s) = (0.01f32.cos(), 0.01f32.sin());
        let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], [1, 1, 4], d).unwrap();
        let y = x.rope(1, &opts(false, 0)).unwrap().to_vec::<f32>().unwrap();
        let want = [c1 - 2.0 * s1, s1 + 2.0 * c1, 3.0 * c - 4.0 * s, 3.0 * s + 4.0 * c];
        check_close("rope normal D=4", &y, &want, 1e-6, 1e-6).unwrap_or_else(|e| panic!("{e} on {}", d.name()));
        // NeoX pairs (x0, x2) and (x1, x3).
        let y = x.rope(1, &opts(true, 0)).unwrap().to_vec::<f32>().unwrap();
        let want = [c1 - 3.0 * s1, 2.0 * c - 4.0 * s, s1 + 3.0 * c1, 2.0 * s + 4.0 * c];
        check_close("rope neox D=4", &y, &want, 1e-6, 1e-6).unwrap_or_else(|e| panic!("{e} on {}", d.name()));
        // Position 0 is the identity; dims past rotary_dim pass through.
        let x = t(1, &[1, 3, 6], d);
        let y = x.rope(0, &opts(false, 4)).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(y, x.to_vec::<f32>().unwrap(), "{}", d.name());
        // freq_scale 0.5 and a factor 2 at position 4: angle 4 * 0.5 / 2 = 1 rad.
        let o = RopeOpts { freq_scale: 0.5, freq_factors: Some(vec![2.0]), ..RopeOpts::default() };
        let x = Tensor::from_slice(&[1.0f32, 0.0], [1, 1, 2], d).unwrap();
        let y = x.rope(4, &o).unwrap().to_vec::<f32>().unwrap();
        check_close("rope scaled", &y, &[c1, s1], 1e-6, 0.0).unwrap_or_else(|e| panic!("{e} on {}", d.name()));
    }
}

#[test]
fn rope_cpu_matches_f64_formula() {
    for (dims, rd, neox, start, scale, ff) in [
        (vec![2, 3, 4, 64], 0, false, 0, 1.0, false),
        (vec![2, 3, 4, 64], 32, true, 1000, 1.0, false),
        (vec![3, 2, 128], 0, true, 1000, 0.25, true),
        (vec![5, 1, 128], 96, false, 4000, 1.0, true),
    ] {
        let half = if rd == 0 { dims[dims.len() - 1] / 2 } else { rd / 2 };
        let o = RopeOpts {
            neox,
            rotary_dim: rd,
            freq_scale: scale,
            freq_factors: ff.then(|| llama3_factors(half)),
            base: 500000.0,
        };
        let x = t(7, &dims, &Device::Cpu);
        let got = x.rope(start, &o).unwrap().to_vec::<f32>().unwrap();
        let want = rope_f64(&x.to_vec::<f32>().unwrap(), &dims, start, &o);
        // f32 angles of ~1e3 rad carry ~1e-4 rad of rounding, in llama.cpp as here.
        let atol = 1e-5 + 2e-7 * (start + dims[dims.len() - 3]) as f32;
        check_close("rope vs f64", &got, &want, atol, 1e-5).unwrap();
    }
}

#[test]
fn rope_parity_layouts_and_positions() {
    for d_head in [64usize, 128] {
        for rd in [0usize, d_head / 2, 24] {
            for neox in [false, true] {
                for start in [0usize, 1000] {
                    let o = opts(neox, rd);
                    parity("rope", 1e-5, 1e-5, |d| t(10, &[2, 3, 4, d_head], d).rope(start, &o)?.to_vec_f32());
                }
            }
        }
    }
}

#[test]
fn rope_parity_scaling_and_factors() {
    for (d_head, rd, neox) in [(64usize, 0usize, false), (128, 0, true), (128, 64, false), (64, 32, true)] {
        let half = if rd == 0 { d_head / 2 } else { rd / 2 };
        for start in [0usize, 1000] {
            for scale in [1.0f32, 0.3] {
                let o = RopeOpts { neox, rotary_dim: rd, freq_scale: scale, freq_factors: None, base: 500000.0 };
                parity("rope freq_scale", 1e-5, 1e-5, |d| t(20, &[1, 5, 3, d_head], d).rope(start, &o)?.to_vec_f32());
                // Exact to an ulp: the GPU's theta / freq_factor is correctly rounded too.
                let o = RopeOpts { freq_factors: Some(llama3_factors(half)), ..o };
                parity("rope freq_factors", 1e-5, 1e-5, |d| t(21, &[1, 5, 3, d_head], d).rope(start, &o)?.to_vec_f32());
            }
        }
    }
}

#[test]
fn rope_parity_shapes_and_views() {
    let o = opts(true, 0);
    // [T, H, D] without a batch dim, one head, one position, and a rank-5 input.
    parity("rope rank 3", 1e-5, 1e-5, |d| t(30, &[7, 2, 64], d).rope(3, &o)?.to_vec_f32());
    parity("rope T=1 H=1", 1e-5, 1e-5, |d| t(31, &[1, 1, 128], d).rope(1000, &o)?.to_vec_f32());
    parity("rope rank 5", 1e-5, 1e-5, |d| t(32, &[2, 1, 3, 2, 64], d).rope(5, &opts(false, 0))?.to_vec_f32());
    // A [B, H, T, D] tensor viewed as [B, T, H, D], and a view starting mid-buffer.
    parity("rope permuted view", 1e-5, 1e-5, |d| {
        t(33, &[2, 4, 3, 64], d).permute(&[0, 2, 1, 3])?.rope(1000, &o)?.to_vec_f32()
    });
    parity("rope narrowed view", 1e-5, 1e-5, |d| {
        t(34, &[2, 3, 4, 66], d).narrow(3, 1, 64)?.narrow(1, 1, 2)?.rope(7, &opts(false, 32))?.to_vec_f32()
    });
    // Long positions: 2^17 rad-scale angles still reduce accurately on the GPU.
    parity("rope long position", 1e-5, 1e-5, |d| t(35, &[2, 2, 64], d).rope(131_000, &o)?.to_vec_f32());
    // ... and with frequency factors and scaling (a plain GPU division, or one contracted into
    // an fma, was off by up to 7e-3 here on an H100).
    let o = RopeOpts { freq_factors: Some(llama3_factors(32)), freq_scale: 0.3, base: 500000.0, ..RopeOpts::default() };
    parity("rope long position factors", 1e-5, 1e-5, |d| t(36, &[2, 2, 64], d).rope(131_000, &o)?.to_vec_f32());
    parity("rope 1e6 position", 1e-5, 1e-5, |d| t(37, &[1, 2, 64], d).rope(1_000_000, &o)?.to_vec_f32());
}

#[test]
fn rope_rejects_bad_input() {
    parity_err("rope odd rotary_dim", "rotary_dim 7 must be even", |d| t(1, &[1, 2, 8], d).rope(0, &opts(false, 7)));
    parity_err("rope rotary_dim > D", "rotary_dim 10 must be even and at most D = 8", |d| {
        t(1, &[1, 2, 8], d).rope(0, &opts(false, 10))
    });
    parity_err("rope freq_factors length", "freq_factors has 3 entries", |d| {
        let o = RopeOpts { freq_factors: Some(vec![1.0; 3]), ..RopeOpts::default() };
        t(1, &[1, 2, 8], d).rope(0, &o)
    });
    parity_err("rope zero freq_factor", "freq_factors must be finite and non-zero", |d| {
        let o = RopeOpts { freq_factors: Some(vec![1.0, 0.0, 2.0, 3.0]), ..RopeOpts::default() };
        t(1, &[1, 2, 8], d).rope(0, &o)
    });
    parity_err("rope rank 2", "must be [.., T, H, D]", |d| t(1, &[2, 8], d).rope(0, &RopeOpts::default()));
    parity_err("rope f16", "expected f32", |d| {
        let h: Vec<half::f16> = vec![half::f16::ZERO; 16];
        Tensor::from_slice(&h, [1, 2, 8], d)?.rope(0, &RopeOpts::default())
    });
}

/// Rope of stacked Q|K|V with the KV-cache store in one op (`rope_qkv_store`, one dispatch on a
/// GPU) against its CPU composition (rope of views + write_at): Q and both whole caches, odd
/// head counts and head dims, partial rotary dims, both layouts, frequency factors, several
/// tokens at a start position, and a cache view starting mid-buffer.
#[test]
fn rope_qkv_store_matches_composition() {
    let cases: [(usize, usize, usize, usize, usize, bool, bool); 5] = [
        // (T, H, Hkv, D, rotary_dim, neox, freq_factors)
        (1, 3, 1, 8, 0, false, false),
        (3, 4, 2, 6, 4, true, false),
        (2, 5, 5, 10, 0, true, true),
        (1, 9, 3, 64, 0, false, false),
        (4, 2, 1, 7 + 1, 6, false, true),
    ];
    for (t, h, hkv, d, rd, neox, ff) in cases {
        let rot = if rd == 0 { d } else { rd };
        let opts = RopeOpts {
            base: 10000.0,
            neox,
            rotary_dim: rd,
            freq_scale: 0.5,
            freq_factors: ff.then(|| (0..rot / 2).map(|i| 1.0 + i as f32 * 0.25).collect()),
        };
        let cap = 13;
        let heads = h + 2 * hkv;
        parity(&format!("rope_qkv_store T{t} H{h} Hkv{hkv} D{d} rd{rd} neox{neox} ff{ff}"), 1e-5, 1e-5, |dev| {
            let y = Tensor::from_vec(rand_vec(7, t * heads * d), [t, heads, d], &Device::Cpu)?.to_device(dev)?;
            // The caches are views one head into a larger buffer: layout offsets are honoured.
            let big = |seed| -> anygpu_core::Result<Tensor> {
                Tensor::from_vec(rand_vec(seed, (hkv + 1) * cap * d), [hkv + 1, cap, d], &Device::Cpu)?
                    .to_device(dev)?
                    .narrow(0, 1, hkv)
            };
            let (mut kc, mut vc) = (big(8)?, big(9)?);
            let q = rope_qkv_store(&y, h, 5, &opts, &mut kc, &mut vc)?;
            assert_eq!(q.dims(), &[t, h, d]);
            let mut all = q.to_vec_f32()?;
            all.extend(kc.to_vec_f32()?);
            all.extend(vc.to_vec_f32()?);
            Ok(all)
        });
    }
    parity_err("rope_qkv_store past the cache", "exceed the cache", |dev| {
        let y = Tensor::zeros([2, 5, 4], anygpu_core::DType::F32, dev)?;
        let (mut kc, mut vc) = (
            Tensor::zeros([1, 4, 4], anygpu_core::DType::F32, dev)?,
            Tensor::zeros([1, 4, 4], anygpu_core::DType::F32, dev)?,
        );
        rope_qkv_store(&y, 3, 3, &RopeOpts::default(), &mut kc, &mut vc)
    });
}
