//! Parity tests for fused attention: odd shapes, grouped-query heads, causal prefill and
//! continuation (Tq < Tk), strided views, f16 K/V, the split-key (flash-decoding) path, and the
//! errors. Each body runs on the CPU reference and on every GPU device (see anygpu_core::testing).

use anygpu_core::ops::attention::{gpu_attention_tuned, AttentionOpts, AttentionTiles, AttentionTuning};
use anygpu_core::testing::{check_close, gpu_devices, parity, parity_err, rand_vec};
use anygpu_core::{Device, Result, Tensor};

/// Tests run one at a time: wgpu's GL backend panics when another thread holds its context for
/// over a second, which a long llvmpipe dispatch or shader compile can.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn t(seed: u64, dims: &[usize], d: &Device) -> Tensor {
    Tensor::from_vec(rand_vec(seed, dims.iter().product()), dims, &Device::Cpu)
        .and_then(|t| t.to_device(d))
        .expect("upload")
}

fn f16(seed: u64, dims: &[usize], d: &Device) -> Tensor {
    let h: Vec<half::f16> = rand_vec(seed, dims.iter().product()).iter().map(|&x| half::f16::from_f32(x)).collect();
    Tensor::from_slice(&h, dims, d).expect("upload")
}

/// q/k/v as the transposes of [B, T, H, D] that an LLM produces.
fn bthd(seed: u64, b: usize, h: usize, tt: usize, dd: usize, d: &Device) -> Tensor {
    t(seed, &[b, tt, h, dd], d).transpose(1, 2).expect("transpose")
}

/// One case: shapes and options (the tuning overrides of a check apply to GPU runs only).
#[derive(Clone, Copy)]
struct Case {
    b: usize,
    hq: usize,
    hkv: usize,
    tq: usize,
    tk: usize,
    d: usize,
    causal: bool,
}

impl Case {
    fn name(&self) -> String {
        format!(
            "attention B{} Hq{} Hkv{} Tq{} Tk{} D{}{}",
            self.b,
            self.hq,
            self.hkv,
            self.tq,
            self.tk,
            self.d,
            if self.causal { " causal" } else { "" }
        )
    }
    fn opts(&self) -> AttentionOpts {
        AttentionOpts::new(self.d, self.causal)
    }
    fn run(&self, dev: &Device, tuning: Option<AttentionTuning>, layout: Layout) -> Result<Vec<f32>> {
        let (q, k, v) = self.inputs(dev, layout);
        let o = match (dev, tuning) {
            (Device::Gpu(_), Some(mut tn)) => {
                // Forced tiles are skipped on GL: each kernel variant costs llvmpipe's GL
                // compiler seconds (see pick_tiles in attention.rs).
                if dev.name().starts_with("gl:") {
                    tn.tiles = None;
                }
                gpu_attention_tuned(&q, &k, &v, &self.opts(), tn)?
            }
            _ => q.attention(&k, &v, &self.opts())?,
        };
        assert_eq!(o.dims(), &[self.b, self.hq, self.tq, self.d]);
        o.to_vec_f32()
    }
    fn inputs(&self, dev: &Device, layout: Layout) -> (Tensor, Tensor, Tensor) {
        match layout {
            Layout::Contiguous => (
                t(1, &[self.b, self.hq, self.tq, self.d], dev),
                t(2, &[self.b, self.hkv, self.tk, self.d], dev),
                t(3, &[self.b, self.hkv, self.tk, self.d], dev),
            ),
            Layout::Bthd => (
                bthd(1, self.b, self.hq, self.tq, self.d, dev),
                bthd(2, self.b, self.hkv, self.tk, self.d, dev),
                bthd(3, self.b, self.hkv, self.tk, self.d, dev),
            ),
            Layout::F16Kv => (
                t(1, &[self.b, self.hq, self.tq, self.d], dev),
                f16(2, &[self.b, self.hkv, self.tk, self.d], dev),
                f16(3, &[self.b, self.hkv, self.tk, self.d], dev),
            ),
        }
    }
    /// Checks every GPU device against the CPU: to f32 accuracy, or, where the default path
    /// takes the tensor-core prefill kernel (f16 operands), to its tolerance as in
    /// `coop_prefill_matches_cpu`.
    fn check(&self, tuning: Option<AttentionTuning>, layout: Layout) {
        let name = format!("{} {layout:?} {tuning:?}", self.name());
        let want = self.run(&Device::Cpu, None, layout).unwrap_or_else(|e| panic!("{name}: CPU reference failed: {e}"));
        for dev in gpu_devices() {
            let got = self.run(dev, tuning, layout).unwrap_or_else(|e| panic!("{name} on {}: {e}", dev.name()));
            let (q, k, v) = self.inputs(dev, layout);
            let coop = tuning.is_none() && anygpu_core::ops::attention_coop::takes(&q, &k, &v).unwrap();
            let (atol, rtol) = if coop { (4e-3, 1e-2) } else { (2e-5, 2e-4) };
            check_close(&name, &got, &want, atol, rtol).unwrap_or_else(|m| panic!("{m} on {}", dev.name()));
        }
    }
}

#[derive(Clone, Copy, Debug)]
enum Layout {
    Contiguous,
    Bthd,
    F16Kv,
}

fn case(b: usize, hq: usize, hkv: usize, tq: usize, tk: usize, d: usize, causal: bool) -> Case {
    Case { b, hq, hkv, tq, tk, d, causal }
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
fn odd_shapes() {
    let _serial = serial();
    for &(tq, tk) in &[(1, 1), (7, 7), (33, 33), (7, 33), (33, 7)] {
        for causal in [false, true] {
            case(1, 2, 1, tq, tk, 64, causal).check(None, Layout::Contiguous);
        }
    }
    // Head dims that are not a multiple of 4 (or of the tile), a few shapes each.
    for &d in &[1, 8, 80] {
        case(1, 2, 1, 7, 33, d, true).check(None, Layout::Contiguous);
        case(1, 2, 1, 33, 7, d, false).check(None, Layout::Contiguous);
    }
}

#[test]
fn long_keys_and_head_dim_128() {
    let _serial = serial();
    // Tk = 257 splits the keys over several workgroups by default (few rows, few blocks).
    for &(tq, causal) in &[(1, false), (7, true), (257, true)] {
        case(1, 1, 1, tq, 257, 128, causal).check(None, Layout::Contiguous);
    }
    case(1, 2, 2, 257, 257, 64, false).check(None, Layout::Contiguous);
}

#[test]
fn grouped_query_heads() {
    let _serial = serial();
    for &(hq, hkv) in &[(4, 2), (8, 1)] {
        for &(tq, tk) in &[(1, 33), (7, 33), (33, 33)] {
            case(2, hq, hkv, tq, tk, 64, true).check(None, Layout::Contiguous);
        }
    }
    case(1, 8, 1, 1, 257, 80, false).check(None, Layout::Contiguous);
}

#[test]
fn strided_views_and_f16_kv() {
    let _serial = serial();
    // Transposes of [B, T, H, D]; D = 7 takes the element-wise (unaligned) loads.
    for &(tq, tk, d) in &[(7, 33, 64), (33, 33, 80), (7, 33, 7)] {
        case(2, 4, 2, tq, tk, d, true).check(None, Layout::Bthd);
    }
    // f16 K/V: the CPU reference widens the same f16 values, so the tolerance stays tight.
    for &(tq, tk, d) in &[(7, 33, 64), (1, 257, 128), (7, 33, 7)] {
        case(2, 4, 2, tq, tk, d, true).check(None, Layout::F16Kv);
    }
    // Views that start mid-buffer; k and v rows off the 4-element grid.
    parity("attention narrowed views", 2e-5, 2e-4, |dev| {
        let q = t(4, &[1, 3, 9, 16], dev).narrow(2, 2, 7)?;
        let k = t(5, &[1, 1, 40, 17], dev).narrow(2, 5, 33)?.narrow(3, 1, 16)?;
        let v = t(6, &[1, 1, 40, 16], dev).narrow(2, 3, 33)?;
        q.attention(&k, &v, &AttentionOpts::new(16, true))?.to_vec_f32()
    });
}

/// A decode step reads its keys from a view of a KV cache longer than them: the key splits are
/// planned for the cache's capacity (so that a recorded step replays at every position), and
/// the merge reads only those that can hold keys (the others hold another call's partials
/// here). Capacities of 512 with 1, 33 and 70 keys, and of 2048 with 1500, both merges (the combine pass, and the output projection's prologue is checked in
/// parity_qmatmul), against the CPU.
#[test]
fn keys_in_a_longer_cache() {
    let _serial = serial();
    for (tk, cap) in [(1usize, 512usize), (33, 512), (70, 512), (1500, 2048)] {
        for d in [64usize, 128] {
            let name = format!("attention Tq 1 Tk {tk} of {cap} cached, D {d}");
            parity(&name, 2e-5, 2e-4, |dev| {
                let q = t(7, &[1, 8, 1, d], dev);
                if dev.gpu().is_some() {
                    // Poison the pool: the whole cache with large scores fills every split of
                    // the partials, whose buffer then serves the call below (its merge must read
                    // only the splits that hold its keys).
                    let full = t(8, &[1, 2, cap, d], dev);
                    drop(q.affine(64.0, 0.0)?.attention(&full, &full, &AttentionOpts::new(d, false))?);
                }
                let k = t(8, &[1, 2, cap, d], dev).narrow(2, 0, tk)?;
                let v = t(9, &[1, 2, cap, d], dev).narrow(2, 0, tk)?;
                q.attention(&k, &v, &AttentionOpts::new(d, false))?.to_vec_f32()
            });
        }
    }
}

/// The decode kernel (one query position over a short cache, every key at once) against the
/// CPU: query heads per KV head 1 to 8, head dims 32 to 256, batches of two, keys from one to
/// the planned 160, so that its scores and P V take one batch of loads or several (wide heads,
/// many query heads), and rows of a cache longer than they are (the cache's strides).
#[test]
fn decode_kernel_matches_cpu() {
    use anygpu_core::ops::attention::takes_decode_kernel;
    let _serial = serial();
    // (B, Hq, Hkv, D)
    for (b, hq, hkv, d) in [(2usize, 8usize, 1usize, 128usize), (1, 4, 2, 256), (2, 5, 5, 32), (1, 9, 3, 64)] {
        for tk in [1usize, 33, 97, 160] {
            let name = format!("decode kernel B{b} Hq{hq} Hkv{hkv} D{d} Tk {tk} of 160");
            parity(&name, 2e-5, 2e-4, |dev| {
                let q = t(51, &[b, hq, 1, d], dev);
                let k = t(52, &[b, hkv, 160, d], dev).narrow(2, 0, tk)?;
                let v = t(53, &[b, hkv, 160, d], dev).narrow(2, 0, tk)?;
                let opts = AttentionOpts::new(d, true);
                if let Some(ctx) = dev.gpu() {
                    let wide_lanes = ctx.caps.subgroup && ctx.caps.subgroup_min_size >= 8;
                    let taken = takes_decode_kernel(&q, &k, &v, &opts)?;
                    assert_eq!(taken, wide_lanes, "{name} on {}: the decode kernel", dev.name());
                }
                q.attention(&k, &v, &opts)?.to_vec_f32()
            });
        }
    }
}

/// Decode over a short cache (capacity 160, `DECODE_WHOLE_KEYS`) runs unsplit, one dispatch,
/// where a longer one (512) is split and merged by a second; the partials a caller merges
/// itself stay split at either length, except where the short cache takes the decode kernel
/// (subgroups of at least 8: every key at once, unsplit for every caller). Results against the
/// CPU at 1, 37 and 150 keys.
#[test]
fn short_caches_are_walked_whole() {
    use anygpu_core::ops::attention::{gpu_attention_partial_splits, takes_decode_kernel};
    let _serial = serial();
    for (cap, want_dispatches) in [(160usize, 1usize), (512, 2)] {
        for tk in [1usize, 37, 150] {
            let name = format!("attention Tq 1 Tk {tk} of {cap} cached");
            parity(&name, 2e-5, 2e-4, |dev| {
                let q = t(17, &[1, 8, 1, 64], dev);
                let k = t(18, &[1, 2, cap, 64], dev).narrow(2, 0, tk)?;
                let v = t(19, &[1, 2, cap, 64], dev).narrow(2, 0, tk)?;
                let opts = AttentionOpts::new(64, true);
                if let Some(ctx) = dev.gpu() {
                    let (_, rec) = ctx.record(|| q.attention(&k, &v, &opts))?;
                    assert_eq!(rec.len(), want_dispatches, "{name} on {}: dispatches", dev.name());
                    let decode = takes_decode_kernel(&q, &k, &v, &opts)?;
                    let wide_lanes = ctx.caps.subgroup && ctx.caps.subgroup_min_size >= 8;
                    assert_eq!(decode, cap == 160 && wide_lanes, "{name} on {}: the decode kernel", dev.name());
                    let splits = gpu_attention_partial_splits(&q, &k, &v, &opts)?;
                    assert_eq!(splits == 1, decode, "{name} on {}: partials split {splits} ways", dev.name());
                }
                q.attention(&k, &v, &opts)?.to_vec_f32()
            });
        }
    }
}

/// `Tensor::attention_q8` (the decode step's attention rounding its output for the output
/// projection): its f32 rows are the attention's [B * Tq, Hq * D] (against the CPU), its words
/// are those rows rounded to 8-bit blocks (against a host rounding of the rows it returned:
/// bytes within 1 of the reference, for the GPU's division, d and s to f16's precision), and
/// the product of those words equals, bit for bit, the product that rounds the same rows in a
/// dispatch of its own. Unsplit (short caches) and split (its merge rounds), several rows,
/// batches, head dims 32-128, cache views. Devices without subgroups of 8 return None.
#[test]
fn q8_rows_are_the_output_rounded() {
    use anygpu_core::quant::gpu::QOptions;
    use anygpu_core::quant::{quantize_into, CpuMath, GgmlType, QTensor};
    let _serial = serial();
    // (B, Hq, Hkv, Tq, Tk, capacity, D)
    let cases = [
        (1usize, 8usize, 2usize, 1usize, 37usize, 37usize, 64usize),
        (1, 8, 2, 1, 300, 300, 64),
        (1, 4, 4, 3, 50, 50, 32),
        (2, 4, 2, 1, 20, 20, 32),
        (1, 32, 8, 1, 129, 160, 128),
        (1, 32, 8, 1, 1000, 2048, 128),
    ];
    for (b, hq, hkv, tq, tk, cap, d) in cases {
        let name = format!("attention_q8 B{b} Hq{hq} Hkv{hkv} Tq{tq} Tk{tk} of {cap} D{d}");
        let opts = AttentionOpts::new(d, true);
        let inputs = |dev: &Device| -> Result<(Tensor, Tensor, Tensor)> {
            let q = t(41, &[b, hq, tq, d], dev);
            let k = t(42, &[b, hkv, cap, d], dev).narrow(2, 0, tk)?;
            let v = t(43, &[b, hkv, cap, d], dev).narrow(2, 0, tk)?;
            Ok((q, k, v))
        };
        let (q, k, v) = inputs(&Device::Cpu).unwrap();
        let want = q.attention(&k, &v, &opts).unwrap().permute(&[0, 2, 1, 3]).unwrap().to_vec_f32().unwrap();
        let (rows, cols) = (b * tq, hq * d);
        let wq = rand_vec(44, 96 * cols);
        let mut wbytes = Vec::new();
        quantize_into(GgmlType::Q4_0, &wq, &mut wbytes).unwrap();
        for dev in gpu_devices() {
            let ctx = dev.gpu().expect("a GPU device");
            let (q, k, v) = inputs(dev).unwrap();
            let got = q.attention_q8(&k, &v, &opts).unwrap_or_else(|e| panic!("{name} on {}: {e}", dev.name()));
            let Some(r) = got else {
                assert!(
                    !ctx.caps.subgroup || ctx.caps.subgroup_min_size < 8,
                    "{name} on {}: no Q8 rows where subgroups of 8 exist",
                    dev.name()
                );
                continue;
            };
            let x = r.x().to_vec_f32().unwrap();
            assert_eq!(r.x().dims(), &[rows, cols], "{name}: x shape");
            check_close(&name, &x, &want, 2e-5, 2e-4).unwrap_or_else(|m| panic!("{m} on {}", dev.name()));
            let words: Vec<u32> = r.words().to_vec().unwrap();
            assert_eq!(words.len(), rows * cols / 4 + rows * cols / 16, "{name}: words");
            // The CPU backend's rounding of the rows returned; host_blocks also checks the
            // sum(q) that d's word carries against the bytes.
            let want_blocks = anygpu_core::quant::q8_round_blocks(&x).unwrap();
            let got_blocks = r.host_blocks().unwrap_or_else(|e| panic!("{name} on {}: {e}", dev.name()));
            for (at, (g, w)) in got_blocks.iter().zip(&want_blocks).enumerate() {
                let (row, blk) = (at / (cols / 32), at % (cols / 32));
                let near = g.q.iter().zip(&w.q).all(|(a, b)| (*a as i32 - *b as i32).abs() <= 1);
                assert!(
                    near && (g.d - w.d).abs() <= 1e-3 * w.d.abs()
                        && (g.s - w.s).abs() <= 2e-3 * w.s.abs().max(g.d * 4.0),
                    "{name} on {}: row {row} block {blk}: bytes {:?} vs {:?}, d {} vs {}, s {} vs {}",
                    dev.name(),
                    g.q,
                    w.q,
                    g.d,
                    w.d,
                    g.s,
                    w.s
                );
            }
            // The product of the rounded rows, as the output projection's.
            let w =
                QTensor::from_vec(GgmlType::Q4_0, 96, cols, wbytes.clone(), dev).unwrap().with_cpu_math(CpuMath::Q8);
            let resid = t(45, &[rows, 96], dev);
            let y = w.qmatmul_add_q8(&r, &resid).unwrap().to_vec_f32().unwrap();
            let opts8 = QOptions { x_q8: Some(true), ..Default::default() };
            let y_own = w.qmatmul_add_opts(r.x(), &resid, opts8).unwrap().to_vec_f32().unwrap();
            assert!(w.takes_q8_rows(), "{name}: a Q8 matrix takes the rows");
            assert_eq!(y, y_own, "{name} on {}: product of the attention's words vs of its own rounding", dev.name());
        }
    }
}

/// `AttentionOpts::max_keys` (a decode step recorded for the first positions of a long cache):
/// planned for that many keys instead of the cache's capacity (unsplit under
/// DECODE_WHOLE_KEYS), the result is the CPU's; more keys than the horizon is an error.
#[test]
fn planned_horizon_matches_and_is_enforced() {
    let _serial = serial();
    let (hq, hkv, d, cap) = (8usize, 2usize, 64usize, 1024usize);
    for tk in [1usize, 37, 160] {
        let name = format!("attention horizon 160, Tk {tk} of {cap}");
        let inputs = |dev: &Device| -> Result<(Tensor, Tensor, Tensor)> {
            let q = t(51, &[1, hq, 1, d], dev);
            let k = t(52, &[1, hkv, cap, d], dev).narrow(2, 0, tk)?;
            let v = t(53, &[1, hkv, cap, d], dev).narrow(2, 0, tk)?;
            Ok((q, k, v))
        };
        let opts = AttentionOpts { max_keys: Some(160), ..AttentionOpts::new(d, true) };
        parity(&name, 2e-5, 2e-4, |dev| {
            let (q, k, v) = inputs(dev)?;
            if let Some(ctx) = dev.gpu() {
                let (_, rec) = ctx.record(|| q.attention(&k, &v, &opts))?;
                assert_eq!(rec.len(), 1, "{name} on {}: one dispatch (unsplit)", dev.name());
            }
            q.attention(&k, &v, &opts)?.to_vec_f32()
        });
    }
    for dev in gpu_devices() {
        let q = t(51, &[1, hq, 1, d], dev);
        let k = t(52, &[1, hkv, cap, d], dev).narrow(2, 0, 100).unwrap();
        let v = t(53, &[1, hkv, cap, d], dev).narrow(2, 0, 100).unwrap();
        let opts = AttentionOpts { max_keys: Some(64), ..AttentionOpts::new(d, true) };
        let err = q.attention(&k, &v, &opts).expect_err("keys past the horizon");
        assert!(err.to_string().contains("horizon"), "{err} on {}", dev.name());
    }
}

#[test]
fn forced_splits_and_tiles() {
    let _serial = serial();
    // The split path and the single-pass path on the same shapes, and small tile shapes.
    let tiny = AttentionTiles { bq: 4, bk: 4, tr: 4, ct: 4 };
    let wide = AttentionTiles { bq: 2, bk: 16, tr: 2, ct: 16 };
    for c in [case(1, 4, 2, 7, 257, 64, true), case(1, 2, 1, 33, 100, 80, false)] {
        for splits in [1, 3, 64] {
            c.check(Some(AttentionTuning { splits: Some(splits), tiles: None }), Layout::Contiguous);
        }
        for tiles in [tiny, wide] {
            c.check(Some(AttentionTuning { splits: Some(2), tiles: Some(tiles) }), Layout::Contiguous);
            c.check(Some(AttentionTuning { splits: Some(1), tiles: Some(tiles) }), Layout::Bthd);
        }
    }
}

#[test]
fn head_dim_256_and_no_keys() {
    let _serial = serial();
    // D = 256 runs on every device but GL: llvmpipe's GL compiler takes about a minute for this
    // kernel variant (wgpu zero-fills workgroup memory there with per-element stores).
    let c = case(1, 2, 1, 7, 33, 256, true);
    let want = c.run(&Device::Cpu, None, Layout::Contiguous).expect("CPU reference");
    for dev in gpu_devices().iter().filter(|d| !d.name().starts_with("gl:")) {
        let got =
            c.run(dev, None, Layout::Contiguous).unwrap_or_else(|e| panic!("{} on {}: {e}", c.name(), dev.name()));
        if let Err(msg) = check_close(&c.name(), &got, &want, 2e-5, 2e-4) {
            panic!("{msg} on {}", dev.name());
        }
    }
    // Causal with Tq > Tk: the first queries see no key and get zeros.
    case(1, 1, 1, 9, 4, 8, true).check(None, Layout::Contiguous);
    // Tk = 0: zeros.
    case(1, 2, 1, 3, 0, 8, false).check(None, Layout::Contiguous);
}

/// The output is stored in [B, Tq, Hq, D] order on every device: the returned [B, Hq, Tq, D]
/// tensor's strides say so, and the `permute([0, 2, 1, 3])` + `reshape([B·Tq, Hq·D])` callers
/// make of it is a view of the same storage (no dispatch) holding the CPU's values. Single-pass
/// and split (combine) paths, a decode-like Tq = 1, GQA, and no keys (zeros).
#[test]
fn output_stored_in_bthd_order() {
    let _serial = serial();
    let cases = [
        (case(2, 4, 2, 7, 33, 16, true), 1),
        (case(2, 4, 2, 7, 33, 16, true), 3),
        (case(1, 3, 3, 5, 9, 7, false), 2),
        (case(1, 6, 2, 1, 40, 8, true), 4),
        (case(2, 3, 1, 4, 0, 8, false), 1),
    ];
    for (c, splits) in cases {
        let name = format!("{} splits {splits}: output layout", c.name());
        let (b, hq, tq, d) = (c.b, c.hq, c.tq, c.d);
        parity(&name, 2e-5, 2e-4, |dev| {
            let q = bthd(1, b, hq, tq, d, dev);
            let (k, v) = (bthd(2, b, c.hkv, c.tk, d, dev), bthd(3, b, c.hkv, c.tk, d, dev));
            let tuning = AttentionTuning { splits: Some(splits), tiles: None };
            let o = match dev {
                Device::Gpu(_) => gpu_attention_tuned(&q, &k, &v, &c.opts(), tuning)?,
                _ => q.attention(&k, &v, &c.opts())?,
            };
            assert_eq!(o.dims(), &[b, hq, tq, d], "{name} on {}", dev.name());
            assert_eq!(o.layout().strides, [tq * hq * d, d, hq * d, 1], "{name} on {}", dev.name());
            let merge = || o.permute(&[0, 2, 1, 3])?.reshape([b * tq, hq * d]);
            let merged = match dev.gpu() {
                Some(ctx) => {
                    let (m, rec) = ctx.record(merge)?;
                    assert!(rec.is_empty(), "{name} on {}: the merge dispatched {} kernels", dev.name(), rec.len());
                    assert!(std::ptr::eq(m.gpu_buffer().expect("gpu"), o.gpu_buffer().expect("gpu")), "{name}");
                    m
                }
                None => {
                    let m = merge()?;
                    assert!(std::ptr::eq(m.cpu_storage().expect("cpu"), o.cpu_storage().expect("cpu")), "{name}");
                    m
                }
            };
            assert_eq!(merged.layout().offset, o.layout().offset, "{name}");
            merged.to_vec_f32()
        });
    }
}

#[test]
fn shape_errors() {
    let _serial = serial();
    let opts = AttentionOpts::new(8, false);
    parity_err("heads not a multiple", "not a multiple", |d| {
        t(1, &[1, 3, 4, 8], d).attention(&t(2, &[1, 2, 5, 8], d), &t(3, &[1, 2, 5, 8], d), &opts)
    });
    parity_err("head dims differ", "head dims differ", |d| {
        t(1, &[1, 2, 4, 8], d).attention(&t(2, &[1, 2, 5, 16], d), &t(3, &[1, 2, 5, 16], d), &opts)
    });
    parity_err("k v differ", "k and v shapes differ", |d| {
        t(1, &[1, 2, 4, 8], d).attention(&t(2, &[1, 2, 5, 8], d), &t(3, &[1, 2, 6, 8], d), &opts)
    });
    parity_err("batch differs", "batch sizes differ", |d| {
        t(1, &[2, 2, 4, 8], d).attention(&t(2, &[1, 2, 5, 8], d), &t(3, &[1, 2, 5, 8], d), &opts)
    });
    parity_err("rank", "4-D", |d| t(1, &[2, 4, 8], d).attention(&t(2, &[2, 5, 8], d), &t(3, &[2, 5, 8], d), &opts));
    parity_err("dtype", "must be f32", |d| {
        f16(1, &[1, 2, 4, 8], d).attention(&t(2, &[1, 2, 5, 8], d), &t(3, &[1, 2, 5, 8], d), &opts)
    });
    parity_err("zero kv heads", "not a multiple", |d| {
        t(1, &[1, 2, 4, 8], d).attention(&t(2, &[1, 0, 5, 8], d), &t(3, &[1, 0, 5, 8], d), &opts)
    });
}

/// Benchmark (not part of the suite): `ATTN_BENCH="B,Hq,Hkv,Tq,Tk,D,causal[,f16][,splits=N][,tiles=bq/bk/tr/ct]";...`
/// `cargo test --release -p anygpu-core --test parity_attention bench -- --ignored --nocapture`.
/// Runs on the first GPU device; flops counted as 4 * B * Hq * D * (visible query-key pairs).
#[test]
#[ignore]
fn bench() {
    let spec = std::env::var("ATTN_BENCH").unwrap_or_else(|_| "1,32,32,4096,4096,128,1".into());
    let iters: usize = std::env::var("ATTN_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(10);
    let idx: usize = std::env::var("ATTN_DEV").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
    let dev = gpu_devices().get(idx).expect("no such GPU device").clone();
    eprintln!("device: {}", dev.name());
    for one in spec.split(';').filter(|s| !s.is_empty()) {
        let f: Vec<&str> = one.split(',').collect();
        let n = |i: usize| f[i].trim().parse::<usize>().expect("number");
        let c = case(n(0), n(1), n(2), n(3), n(4), n(5), n(6) != 0);
        let mut tuning = AttentionTuning::default();
        let mut layout = Layout::Contiguous;
        for extra in &f[7..] {
            if *extra == "f16" {
                layout = Layout::F16Kv;
            } else if let Some(v) = extra.strip_prefix("splits=") {
                tuning.splits = v.parse().ok();
            } else if let Some(v) = extra.strip_prefix("tiles=") {
                let x: Vec<u32> = v.split('/').map(|y| y.parse().expect("tile")).collect();
                tuning.tiles = Some(AttentionTiles { bq: x[0], bk: x[1], tr: x[2], ct: x[3] });
            } else if *extra == "bthd" {
                layout = Layout::Bthd;
            }
        }
        let (q, k, v) = match layout {
            Layout::F16Kv => (
                t(1, &[c.b, c.hq, c.tq, c.d], &dev),
                f16(2, &[c.b, c.hkv, c.tk, c.d], &dev),
                f16(3, &[c.b, c.hkv, c.tk, c.d], &dev),
            ),
            Layout::Bthd => (
                bthd(1, c.b, c.hq, c.tq, c.d, &dev),
                bthd(2, c.b, c.hkv, c.tk, c.d, &dev),
                bthd(3, c.b, c.hkv, c.tk, c.d, &dev),
            ),
            Layout::Contiguous => (
                t(1, &[c.b, c.hq, c.tq, c.d], &dev),
                t(2, &[c.b, c.hkv, c.tk, c.d], &dev),
                t(3, &[c.b, c.hkv, c.tk, c.d], &dev),
            ),
        };
        let t0 = std::time::Instant::now();
        let first = match gpu_attention_tuned(&q, &k, &v, &c.opts(), tuning) {
            Ok(y) => y,
            // A sweep goes on past tiles the device cannot take.
            Err(e @ anygpu_core::Error::Unsupported(_)) => {
                eprintln!("{} {tuning:?}: {e}", c.name());
                continue;
            }
            Err(e) => panic!("attention: {e}"),
        };
        dev.sync().expect("sync");
        let warm = t0.elapsed();
        let t1 = std::time::Instant::now();
        for _ in 0..iters {
            drop(gpu_attention_tuned(&q, &k, &v, &c.opts(), tuning).expect("attention"));
        }
        dev.sync().expect("sync");
        let dt = t1.elapsed().as_secs_f64() / iters as f64;
        // The kernels alone, timed on the GPU (each dispatch in a pass of its own, so a few µs of
        // pass overhead each): the loop above is bound by the host for decode shapes.
        let kernels = dev
            .gpu()
            .expect("a GPU device")
            .profile_dispatches(|| {
                (0..iters).try_for_each(|_| gpu_attention_tuned(&q, &k, &v, &c.opts(), tuning).map(drop))
            })
            .expect("profile")
            .1
            .map_or("(no timestamps)".to_string(), |ops| {
                let per: Vec<String> =
                    ops.iter().map(|(op, n, s)| format!("{op} {:.1} us", s * 1e6 / (*n).max(1) as f64)).collect();
                format!(
                    "kernels {:.1} us/call ({})",
                    ops.iter().map(|o| o.2).sum::<f64>() * 1e6 / iters as f64,
                    per.join(", ")
                )
            });
        let pairs: usize =
            (0..c.tq).map(|i| if c.causal { (i + 1 + c.tk).saturating_sub(c.tq).min(c.tk) } else { c.tk }).sum();
        let flops = 4.0 * (c.b * c.hq * c.d * pairs) as f64;
        let bytes = (c.b * c.hkv * c.tk * c.d * 2 * if matches!(layout, Layout::F16Kv) { 2 } else { 4 }) as f64;
        eprintln!(
            "{} {layout:?} {tuning:?}: first {:.1} ms, {:.3} ms/iter, {:.2} TFLOP/s, KV {:.0} GB/s; {kernels}",
            c.name(),
            warm.as_secs_f64() * 1e3,
            dt * 1e3,
            flops / dt / 1e12,
            bytes / dt / 1e9
        );
        if std::env::var("ATTN_CHECK").is_ok() {
            let want = q.to_device(&Device::Cpu).unwrap().attention(
                &k.to_device(&Device::Cpu).unwrap(),
                &v.to_device(&Device::Cpu).unwrap(),
                &c.opts(),
            );
            let got = first.to_vec_f32().unwrap();
            let want = want.unwrap().to_vec_f32().unwrap();
            let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            eprintln!("  max abs error vs CPU: {err:e}");
        }
    }
}

/// Prefill on cooperative matrices (attention_coop.wgsl) against the CPU, within the f16
/// rounding of Q, K, V and P: causal runs longer than one 64-query block and not a multiple of
/// it (their workgroups run a late and an early block each: 2, 4 and an odd 5 blocks, the
/// middle one alone), continuations (Tq < Tk) in a batch of two and over three blocks,
/// grouped-query heads, no mask, head dims 16 to 128; on every GPU device that takes it (its matrices emulated where it has none: every
/// device with f16 shaders runs it, the 128-wide heads where workgroup memory allows); and Q,
/// K, V as strided views of one product.
#[test]
fn coop_prefill_matches_cpu() {
    use anygpu_core::ops::attention_coop::{gpu_attention_coop, set_emulated, set_pairs};
    let _serial = serial();
    // Causal query blocks paired in every workgroup, and not, whatever their count (the rule
    // pairs only runs of many blocks).
    struct Unforce;
    impl Drop for Unforce {
        fn drop(&mut self) {
            anygpu_core::ops::attention_coop::set_pairs(None);
        }
    }
    let _unforce = Unforce;
    let cases = [
        case(1, 4, 2, 70, 70, 64, true),
        case(2, 2, 1, 64, 100, 32, true),
        case(1, 3, 3, 130, 130, 16, false),
        case(1, 2, 1, 200, 200, 64, true),
        case(1, 2, 1, 65, 65, 128, true),
        case(1, 2, 1, 300, 300, 32, true),
        case(1, 2, 2, 150, 260, 32, true),
    ];
    for dev in gpu_devices() {
        let ctx = dev.gpu().expect("a GPU device");
        let emulated = !ctx.caps.cooperative_matrix;
        set_emulated(emulated);
        let mut ran = 0;
        for (c, pairs) in cases.iter().flat_map(|c| [(c, true), (c, false)]) {
            set_pairs(Some(pairs));
            let name = format!(
                "coop {} on {}{}{}",
                c.name(),
                dev.name(),
                if emulated { " (emulated)" } else { "" },
                if pairs { " paired" } else { "" }
            );
            let (q, k, v) = (
                t(31, &[c.b, c.hq, c.tq, c.d], dev),
                t(32, &[c.b, c.hkv, c.tk, c.d], dev),
                t(33, &[c.b, c.hkv, c.tk, c.d], dev),
            );
            let got = match gpu_attention_coop(&q, &k, &v, &c.opts()) {
                Ok(Some(o)) => o.to_vec_f32().unwrap(),
                Ok(None) => continue,
                Err(e) => panic!("{name}: {e}"),
            };
            ran += 1;
            let host = |x: &Tensor| x.to_device(&Device::Cpu).unwrap();
            let want = host(&q).attention(&host(&k), &host(&v), &c.opts()).unwrap().to_vec_f32().unwrap();
            check_close(&name, &got, &want, 4e-3, 1e-2).unwrap_or_else(|m| panic!("{m}"));
            // The f16 output (for an output projection that reads x as f16): the f32 output
            // rounded to f16, in the same [B, T, H, D] storage (emulated, for one head dim
            // only: a kernel variant more is slow to compile on lavapipe).
            if emulated && c.d != 32 {
                continue;
            }
            let half = AttentionOpts { f16_out: true, ..c.opts() };
            let h = gpu_attention_coop(&q, &k, &v, &half).unwrap().expect("the f16 run takes the kernel too");
            assert_eq!((h.dtype(), h.dims()), (anygpu_core::DType::F16, &[c.b, c.hq, c.tq, c.d][..]), "{name}");
            let h = h.to_dtype(anygpu_core::DType::F32).unwrap().to_vec_f32().unwrap();
            for (i, (&a, &b)) in got.iter().zip(&h).enumerate() {
                assert!((a - b).abs() <= a.abs() / 2048.0 + 6e-8, "{name} f16 output [{i}]: {b} for {a}");
            }
        }
        // Q, K and V read in place from one [B, T, 3H, D] product (BERT's fused path): strided
        // views, K and V rows still contiguous.
        let (b, tt, h, d) = (2usize, 80usize, 3usize, 32usize);
        let qkv = t(34, &[b, tt, 3 * h, d], dev).permute(&[0, 2, 1, 3]).unwrap();
        let (q, k, v) = (qkv.narrow(1, 0, h).unwrap(), qkv.narrow(1, h, h).unwrap(), qkv.narrow(1, 2 * h, h).unwrap());
        let opts = AttentionOpts::new(d, false);
        if let Some(o) = gpu_attention_coop(&q, &k, &v, &opts).unwrap() {
            ran += 1;
            let host = |x: &Tensor| x.to_device(&Device::Cpu).unwrap();
            let want = host(&q).attention(&host(&k), &host(&v), &opts).unwrap().to_vec_f32().unwrap();
            check_close(
                &format!("coop in-place qkv views on {}", dev.name()),
                &o.to_vec_f32().unwrap(),
                &want,
                4e-3,
                1e-2,
            )
            .unwrap_or_else(|m| panic!("{m}"));
        }
        set_emulated(false);
        // Head dims up to 64 fit every device with f16 shaders (lavapipe's 32 KiB included):
        // every case but the one of 128, paired and not, and the views.
        if ctx.caps.shader_f16 {
            let want = 2 * (cases.len() - 1) + 1;
            assert!(ran >= want, "the coop attention ran {ran} of {} cases on {}", 2 * cases.len() + 1, dev.name());
        }
    }
}

/// The coop attention kernel and its emulated variant parse, validate and translate to SPIR-V
/// for every head dim it takes, with an f32 and an f16 output (most machines cannot run the
/// real one).
#[test]
fn coop_kernel_validates_with_naga() {
    use anygpu_core::ops::attention_coop::spec;
    use wgpu::naga::valid::Capabilities as C;
    for d in [16usize, 32, 48, 64, 80, 96, 112, 128] {
        for (emulated, half_out) in [(false, false), (true, false), (false, true), (true, true)] {
            let mut caps = C::SHADER_FLOAT16_IN_FLOAT32 | C::SHADER_FLOAT16;
            if !emulated {
                caps |= C::COOPERATIVE_MATRIX | C::SUBGROUP;
            }
            let src = spec(d, emulated, half_out).source_text(&[]);
            if let Err(e) = anygpu_core::testing::validate_wgsl_for_vulkan(&src, caps) {
                panic!("attention_coop D={d} emulated={emulated} half_out={half_out}:\n{e}");
            }
        }
    }
}
