//! The BERT encoder against sentence-transformers on the real all-MiniLM-L6-v2: token ids
//! identical, embeddings with cosine >= 0.999, on the CPU and every GPU device.
//! Fixture: tests/data/minilm/embeddings.json, made by scripts/reference/make_minilm_refs.py.
//! The model comes from scripts/fetch-models.sh (the README's test command runs it).

use std::path::PathBuf;

use anygpu_core::testing::gpu_devices;
use anygpu_core::{Device, Tensor};
use anygpu_models::bert::{cosine, pool, profile_forward, Batch, Pooling, SentenceEmbedder, WeightDType};
use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn model_dir() -> PathBuf {
    let dir = root().join("models/all-MiniLM-L6-v2");
    assert!(
        dir.join("model.safetensors").exists() && dir.join("tokenizer.json").exists(),
        "{} is missing or incomplete: run scripts/fetch-models.sh minilm (the README's test command does)",
        dir.display()
    );
    dir
}

fn load(dev: &Device) -> SentenceEmbedder {
    SentenceEmbedder::load(&model_dir(), dev).expect("load all-MiniLM-L6-v2")
}

fn fixture() -> Value {
    let p = root().join("crates/anygpu-models/tests/data/minilm/embeddings.json");
    serde_json::from_str(&std::fs::read_to_string(&p).expect("fixture")).expect("json")
}

struct Case {
    text: String,
    ids: Vec<u32>,
    truncated: bool,
    embedding: Vec<f32>,
}

fn cases() -> Vec<Case> {
    fixture()["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| Case {
            text: c["text"].as_str().expect("text").to_string(),
            ids: c["ids"].as_array().expect("ids").iter().map(|x| x.as_u64().expect("id") as u32).collect(),
            truncated: c["truncated"].as_bool().expect("truncated"),
            embedding: c["embedding"].as_array().expect("emb").iter().map(|x| x.as_f64().expect("f") as f32).collect(),
        })
        .collect()
}

/// The CPU and every GPU under test (lavapipe in CI; the WebGPU-default profile included).
fn devices() -> Vec<Device> {
    std::iter::once(Device::Cpu).chain(gpu_devices().iter().cloned()).collect()
}

#[test]
fn sentence_config_of_minilm() {
    let m = load(&Device::Cpu);
    assert_eq!(m.sentence.pooling, Pooling::MEAN);
    assert!(m.sentence.normalize);
    // sentence_bert_config.json says 256; tokenizer.json's own truncation (128) must not apply.
    assert_eq!(m.max_len, 256);
    assert_eq!(m.dim(), 384);
    assert_eq!(m.model.config.num_hidden_layers, 6);
}

#[test]
fn token_ids_match_sentence_transformers() {
    let m = load(&Device::Cpu);
    for c in cases() {
        let e = m.tokenize(&c.text).expect("tokenize");
        assert_eq!(e.ids, c.ids, "ids of {:?}", c.text);
        assert_eq!(e.truncated, c.truncated, "truncation of {:?}", c.text);
    }
}

/// On the CPU every case, in padded batches of 8. On each GPU device (lavapipe is slow: about
/// 3 s per forward pass here) a subset in two calls, which between them cover both attention
/// paths: the 256-token truncated input alone (no padding: the fused attention op), then short
/// inputs with accents, CJK, emoji and the empty string in one padded batch (explicit scores
/// + mask).
#[test]
fn embeddings_match_sentence_transformers() {
    let cases = cases();
    // worst: the largest element difference, and its text.
    let check = |dev: &Device, idx: &[usize], out: &anygpu_models::bert::Embeddings, worst: &mut (f32, String)| {
        let want_trunc: Vec<usize> =
            idx.iter().enumerate().filter(|(_, &i)| cases[i].truncated).map(|(k, _)| k).collect();
        assert_eq!(out.truncated, want_trunc, "truncated inputs on {}", dev.name());
        for (&i, v) in idx.iter().zip(&out.vectors) {
            let c = &cases[i];
            assert_eq!(v.len(), 384);
            let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
            assert!((norm - 1.0).abs() < 1e-4, "{:?} on {}: norm {norm}", c.text, dev.name());
            let cos = cosine(v, &c.embedding);
            let diff = v.iter().zip(&c.embedding).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            if diff > worst.0 {
                *worst = (diff, c.text.chars().take(40).collect());
            }
            assert!(cos >= 0.999, "{:?} on {}: cosine {cos} against sentence-transformers", c.text, dev.name());
        }
    };
    let find = |prefix: &str| cases.iter().position(|c| c.text.starts_with(prefix)).expect("case");
    let long = find("word word");
    assert!(cases[long].truncated || cases[long + 1].truncated);
    let long = if cases[long].truncated { long } else { long + 1 };
    let short: Vec<usize> =
        ["A man is eating food", "Café", "东京", "I love pizza", "Hello world", ""].iter().map(|p| find(p)).collect();
    for dev in devices() {
        let t0 = std::time::Instant::now();
        let m = load(&dev);
        let mut worst = (0f32, String::new());
        let groups: Vec<(Vec<usize>, usize)> = if matches!(dev, Device::Cpu) {
            vec![((0..cases.len()).collect(), 8)]
        } else {
            vec![(vec![long], 1), (short.clone(), 8)]
        };
        for (idx, batch) in groups {
            let texts: Vec<&str> = idx.iter().map(|&i| cases[i].text.as_str()).collect();
            let out = m.embed(&texts, batch).expect("embed");
            check(&dev, &idx, &out, &mut worst);
        }
        eprintln!(
            "{}: all cosines >= 0.999; largest element difference {:.1e} ({:?}); {:.1} s",
            dev.name(),
            worst.0,
            worst.1,
            t0.elapsed().as_secs_f64()
        );
    }
}

/// `--dtype f16`: the linear weights rounded to f16 (on a GPU with cooperative matrices the
/// activations too, inside the products) still give cosine >= 0.999, on the CPU and every GPU.
/// `auto` resolves to f32 where no tensor cores are reachable (the CPU, lavapipe).
#[test]
fn f16_weights_match_sentence_transformers() {
    let cases = cases();
    let picked: Vec<usize> = ["A man is eating food", "Café", "东京", "I love pizza", ""]
        .iter()
        .map(|p| cases.iter().position(|c| c.text.starts_with(p)).expect("case"))
        .collect();
    let texts: Vec<&str> = picked.iter().map(|&i| cases[i].text.as_str()).collect();
    for dev in devices() {
        let m = SentenceEmbedder::load_with(&model_dir(), &dev, WeightDType::F16).expect("load f16");
        assert_eq!(m.model.weight_dtype, anygpu_core::DType::F16);
        let out = m.embed(&texts, 8).expect("embed");
        let worst =
            picked.iter().zip(&out.vectors).map(|(&i, v)| cosine(v, &cases[i].embedding)).fold(f32::INFINITY, f32::min);
        assert!(worst >= 0.999, "f16 weights on {}: worst cosine {worst}", dev.name());
        eprintln!("{}: f16 weights, worst cosine {worst:.6}", dev.name());
        let auto = WeightDType::Auto.resolve(&dev);
        let has_coop = dev.gpu().is_some_and(|c| anygpu_core::ops::matmul::gpu_has_coop_matmul(c));
        assert_eq!(auto == anygpu_core::DType::F16, has_coop, "auto on {}", dev.name());
    }
}

/// CLS, max, mean and mean/sqrt(len) pooling of a padded batch against a hand computation.
#[test]
fn pooling_modes_ignore_padding() {
    let (b, t, c) = (3, 4, 5);
    let hidden: Vec<f32> = (0..b * t * c).map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0).collect();
    let lengths = [4, 1, 2];
    let at = |bi: usize, ti: usize, ci: usize| hidden[(bi * t + ti) * c + ci];
    let all = Pooling { cls: true, max: true, mean: true, mean_sqrt_len: true };
    for dev in devices() {
        let h = Tensor::from_slice(&hidden, [b, t, c], &dev).expect("upload");
        let got = pool(&h, &lengths, &all, false).expect("pool");
        for (bi, &len) in lengths.iter().enumerate() {
            let mut want = Vec::new();
            want.extend((0..c).map(|ci| at(bi, 0, ci)));
            want.extend((0..c).map(|ci| (0..len).map(|ti| at(bi, ti, ci)).fold(f32::MIN, f32::max)));
            want.extend((0..c).map(|ci| (0..len).map(|ti| at(bi, ti, ci)).sum::<f32>() / len as f32));
            want.extend((0..c).map(|ci| (0..len).map(|ti| at(bi, ti, ci)).sum::<f32>() / (len as f32).sqrt()));
            assert_eq!(got[bi].len(), want.len());
            for (g, w) in got[bi].iter().zip(&want) {
                assert!((g - w).abs() < 1e-4, "row {bi} on {}: {g} vs {w}", dev.name());
            }
        }
        let normed = pool(&h, &lengths, &Pooling::CLS, true).expect("pool");
        let norm = normed[1].iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5);
    }
}

/// The fused GPU forward (no padding) moves no activation twice: the output projection reads
/// the attention output in place (no `contiguous` copy) and each residual add is part of its
/// layer norm (`add_layer_norm`, two per layer; the one `add` left is the embeddings'). Counted
/// by op name in a profiled forward, on each GPU device with timestamp queries.
#[test]
fn fused_forward_makes_no_copies_or_residual_adds() {
    for dev in gpu_devices() {
        let m = load(dev);
        let Some(ops) = profile_forward(&m, 2, 16).expect("profile") else { continue };
        let count = |name: &str| -> usize {
            ops.iter().filter(|(op, ..)| op.split(" [").next() == Some(name)).map(|(_, n, _)| n).sum()
        };
        let layers = m.model.config.num_hidden_layers;
        let all: Vec<(&str, usize)> = ops.iter().map(|(op, n, _)| (op.as_str(), *n)).collect();
        assert_eq!(count("contiguous"), 0, "copies on {}: {all:?}", dev.name());
        assert_eq!(count("attention"), layers, "on {}: {all:?}", dev.name());
        assert_eq!(count("add_layer_norm"), 2 * layers, "on {}: {all:?}", dev.name());
        assert_eq!(count("add"), 1, "on {}: {all:?}", dev.name());
    }
}

#[test]
fn bad_inputs_are_errors() {
    let m = load(&Device::Cpu);
    let err = m.embed_ids(&[&[101, 40000, 102]]).expect_err("id past the vocabulary");
    assert!(err.to_string().contains("token id: index 40000 out of range 0..30522"), "{err}");
    let long = vec![101u32; 300];
    let err = m.embed_ids(&[&long]).expect_err("too long");
    assert!(err.to_string().contains("exceeds max_seq_length 256"), "{err}");
    let err =
        m.model.forward(&Batch { ids: &[101, 102, 0], type_ids: None, lengths: &[2, 0], t: 3 }).expect_err("bad batch");
    assert!(err.to_string().contains("ids for 2 sequences of 3 tokens"), "{err}");
    let err = SentenceEmbedder::load(&root().join("models/no-such-model"), &Device::Cpu).err().expect("no folder");
    assert!(err.to_string().contains("not a model folder"), "{err}");
}
