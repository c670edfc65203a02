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

#[test]
fn synthetic_models_of_every_type_run_alike_on_cpu_and_gpu() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let vocab_path = root.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(vocab_path.exists(), "{} is missing: run scripts/fetch-models.sh", vocab_path.display());
    let vocab = GgufFile::open(&vocab_path).expect("open vocabulary model");
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
