//! `anygpu synth`'s writer (`anygpu_models::synthetic`): a tiny random-weight model of every
//! type it writes loads and runs, and the GPU's logits are the CPU's within the activations'
//! 8-bit rounding (a misplaced tensor or a wrong block layout moves them by their whole size).
//! Needs models/SmolLM2-135M-Instruct.Q4_1.gguf for the vocabulary (`scripts/fetch-models.sh`).

use std::path::PathBuf;
use std::sync::Arc;

use anygpu_core::quant::GgmlType;
use anygpu_core::testing::gpu_devices;
use anygpu_core::Device;
use anygpu_models::gguf::GgufFile;
use anygpu_models::llama::Llama;
use anygpu_models::synthetic::{write_synthetic, SyntheticSpec};

fn logits(file: &Arc<GgufFile>, dev: &Device, tokens: &[u32]) -> Vec<f32> {
    let model = Llama::load(file, dev, &mut |_, _| {}).expect("load");
    let mut cache = model.new_cache(tokens.len()).expect("cache");
    model.forward(tokens, &mut cache, true).expect("forward").to_vec_f32().expect("read")
}

/// SmolLM2's file, whose tokenizer the synthetic models copy.
fn vocabulary() -> GgufFile {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let vocab_path = root.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(vocab_path.exists(), "{} is missing: run scripts/fetch-models.sh", vocab_path.display());
    GgufFile::open(&vocab_path).expect("open vocabulary model")
}

#[test]
fn synthetic_models_of_every_type_run_alike_on_cpu_and_gpu() {
    let vocab = vocabulary();
    let tokens = [1u32, 17, 400, 9000, 42];
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4K] {
        let spec = SyntheticSpec::preset("tiny", ty).expect("preset");
        let path = std::env::temp_dir().join(format!("anygpu-synth-{}-{ty}.gguf", std::process::id()));
        let out = std::fs::File::create(&path).expect("create");
        write_synthetic(&spec, &vocab, std::io::BufWriter::new(out)).expect("write");
        let file = Arc::new(GgufFile::open(&path).expect("the written file reads back"));
        let want = logits(&file, &Device::Cpu, &tokens);
        assert!(want.iter().all(|v| v.is_finite()), "{ty}: non-finite CPU logits");
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(scale > 0.0, "{ty}: all-zero logits");
        for dev in gpu_devices().iter().take(1) {
            let got = logits(&file, dev, &tokens);
            let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst <= 0.05 * scale, "{ty} on {}: logits differ by {worst} (largest {scale})", dev.name());
        }
        let _ = std::fs::remove_file(&path);
    }
}

/// A model wider than the staged RMSNorm takes (2,304 columns, Q4_0, the 8B's layout in small):
/// on a GPU its output and down projections round the next norm's input for the products after
/// them (`QTensor::qmatmul_add_rounding`; the kernels' own test is parity_qmatmul's
/// `add_rounding_feeds_the_next_norm`). A prefill of five tokens (the matvec path, five x rows)
/// and decode steps, replayed and per-op, give the CPU's logits within the 8-bit rounding, and the
/// replay gives the per-op path's; a recorded decode step keeps one rounding dispatch (the first
/// norm's) where the rounding epilogue runs.
#[test]
fn wide_model_rounds_the_norms_in_its_residual_products() {
    let vocab = vocabulary();
    let spec = SyntheticSpec {
        n_layer: 2,
        n_embd: 2304,
        n_ff: 512,
        n_head: 18,
        n_head_kv: 6,
        n_ctx: 64,
        rope_base: 10000.0,
        ty: GgmlType::Q4_0,
        seed: 7,
    };
    let path = std::env::temp_dir().join(format!("anygpu-synth-wide-{}.gguf", std::process::id()));
    let out = std::fs::File::create(&path).expect("create");
    write_synthetic(&spec, &vocab, std::io::BufWriter::new(out)).expect("write");
    let file = Arc::new(GgufFile::open(&path).expect("the written file reads back"));
    let prompt = [1u32, 17, 400, 9000, 42];
    let steps = [5u32, 600, 7000];
    // Prefill logits of every prompt token, then each step's.
    let run = |dev: &Device, replay: bool| -> Vec<Vec<f32>> {
        let model = Llama::load(&file, dev, &mut |_, _| {}).expect("load");
        let mut cache = model.new_cache(16).expect("cache");
        let mut all = vec![model.forward(&prompt, &mut cache, true).and_then(|t| t.to_vec_f32()).expect("prefill")];
        for &id in &steps {
            all.push(match replay {
                true => model.decode(id, &mut cache).expect("replayed step"),
                false => model.forward(&[id], &mut cache, false).and_then(|t| t.to_vec_f32()).expect("step"),
            });
        }
        if replay {
            assert!(cache.decode_stats().is_some_and(|s| s.steps == steps.len()), "the replay ran on {}", dev.name());
        }
        all
    };
    let want = run(&Device::Cpu, false);
    for dev in gpu_devices().iter().take(1) {
        // Where the rounding epilogue runs (1,024-invocation workgroups, subgroups of 8), the
        // only rounding dispatch left in a decode step is the first layer's attention norm's
        // (the others, and the output norm's, are made by the products before them).
        if let Some(ctx) = dev.gpu() {
            let c = &ctx.caps;
            let off = std::env::var("ANYGPU_NORM_ROUNDING").is_ok_and(|v| v == "0");
            let folds =
                !off && c.subgroup && c.subgroup_min_size >= 8 && c.max_compute_invocations_per_workgroup >= 1024;
            let model = Llama::load(&file, dev, &mut |_, _| {}).expect("load");
            let mut cache = model.new_cache(16).expect("cache");
            model.forward(&prompt, &mut cache, false).expect("prefill");
            let (_, rec) = ctx.record(|| model.forward(&[5], &mut cache, false)).expect("recorded step");
            let roundings = rec.ops().filter(|op| *op == "quantize_q8").count();
            let want_roundings = if folds { 1 } else { 2 * spec.n_layer + 1 };
            assert_eq!(roundings, want_roundings, "rounding dispatches of a decode step on {}", dev.name());
        }
        let (replayed, per_op) = (run(dev, true), run(dev, false));
        for (i, ((r, p), w)) in replayed.iter().zip(&per_op).zip(&want).enumerate() {
            let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
            let diff = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            assert!(diff(r, p) <= 1e-4 * scale.max(1.0), "pass {i} on {}: replay vs per-op {}", dev.name(), diff(r, p));
            assert!(
                diff(r, w) <= 0.05 * scale,
                "pass {i} on {}: logits differ by {} (largest {scale})",
                dev.name(),
                diff(r, w)
            );
        }
    }
    let _ = std::fs::remove_file(&path);
}

/// Restores the coop kernel's emulation and the f16 copy's rule when a test ends.
struct CoopDefaults;
impl Drop for CoopDefaults {
    fn drop(&mut self) {
        anygpu_core::quant::coop::set_emulated(false);
        anygpu_core::quant::dequant_f16::set_override(None);
    }
}

/// A prefill long enough for the tensor-core products (70 tokens), every one forced to read an
/// f16 copy of its weights: the model lists its products in the order it runs them
/// (`CopyAhead`), so the copies made beside earlier products are all taken, and the logits
/// (of every position: the head's product too) are the CPU's within the activations' f16 and
/// 8-bit roundings. Emulated cooperative matrices where
/// the device has none.
#[test]
fn prefill_takes_the_copies_made_ahead() {
    use anygpu_core::quant::{coop, copy_ahead, dequant_f16};
    let vocab = vocabulary();
    let spec = SyntheticSpec::preset("tiny", GgmlType::Q4_0).expect("preset");
    let path = std::env::temp_dir().join(format!("anygpu-synth-ahead-{}.gguf", std::process::id()));
    let out = std::fs::File::create(&path).expect("create");
    write_synthetic(&spec, &vocab, std::io::BufWriter::new(out)).expect("write");
    let file = Arc::new(GgufFile::open(&path).expect("the written file reads back"));
    let tokens: Vec<u32> = (0..70u32).map(|i| 1 + i * 331 % 9000).collect();
    let want = logits(&file, &Device::Cpu, &tokens);
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let mut ran = false;
    for dev in gpu_devices().iter().take(1) {
        let _restore = CoopDefaults;
        let ctx = dev.gpu().expect("a GPU device");
        coop::set_emulated(!ctx.caps.cooperative_matrix);
        if let Some(why) = coop::unsupported_reason(ctx, GgmlType::Q4_0) {
            eprintln!("{why}");
            continue;
        }
        dequant_f16::set_override(Some(true));
        let taken = copy_ahead::copies_taken_ahead();
        let got = logits(&file, dev, &tokens);
        let taken = copy_ahead::copies_taken_ahead() - taken;
        // Every layer product's but the first's (the first Q|K|V's copy is made before it, the
        // first gate|up's beside it); the head's finds no product with room (49,152 rows).
        assert_eq!(taken, 4 * spec.n_layer - 1, "{}: copies taken ahead", dev.name());
        let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst <= 0.05 * scale, "{}: logits differ by {worst} (largest {scale})", dev.name());
        ran = true;
    }
    let _ = std::fs::remove_file(&path);
    assert!(ran || std::env::var("ANYGPU_REQUIRE_GPU").is_err(), "no GPU ran the prefill with copies made ahead");
}
