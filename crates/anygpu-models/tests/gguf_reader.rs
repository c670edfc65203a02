//! GGUF writer -> reader round trips, typed getters, alignment, streaming.

use std::path::PathBuf;

use anygpu_models::gguf::{Array, GgmlType, GgufError, GgufFile, GgufWriter, Value, DEFAULT_ALIGNMENT};

/// Deterministic bytes for tensor data.
fn bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn every_value() -> Vec<(&'static str, Value)> {
    vec![
        ("t.u8", Value::U8(200)),
        ("t.i8", Value::I8(-100)),
        ("t.u16", Value::U16(60_000)),
        ("t.i16", Value::I16(-30_000)),
        ("t.u32", Value::U32(4_000_000_000)),
        ("t.i32", Value::I32(-2_000_000_000)),
        ("t.u64", Value::U64(u64::MAX)),
        ("t.i64", Value::I64(i64::MIN)),
        ("t.f32", Value::F32(-1.5e-5)),
        ("t.f64", Value::F64(std::f64::consts::PI)),
        ("t.bool", Value::Bool(true)),
        ("t.string", Value::String("héllo ▁world 🦙".into())),
        ("t.empty_string", Value::String(String::new())),
        ("a.u8", Value::Array(Array::U8(vec![0, 1, 255]))),
        ("a.i8", Value::Array(Array::I8(vec![-128, 0, 127]))),
        ("a.u16", Value::Array(Array::U16(vec![0, 65_535]))),
        ("a.i16", Value::Array(Array::I16(vec![-32_768, 32_767]))),
        ("a.u32", Value::Array(Array::U32(vec![1, 2, u32::MAX]))),
        ("a.i32", Value::Array(Array::I32(vec![-1, 0, 1]))),
        ("a.u64", Value::Array(Array::U64(vec![u64::MAX, 0]))),
        ("a.i64", Value::Array(Array::I64(vec![i64::MIN, i64::MAX]))),
        ("a.f32", Value::Array(Array::F32(vec![0.0, -0.0, 1.0, f32::MAX, f32::INFINITY]))),
        ("a.f64", Value::Array(Array::F64(vec![1e300, -1e-300]))),
        ("a.bool", Value::Array(Array::Bool(vec![true, false, true]))),
        ("a.string", Value::Array(Array::String(vec!["<s>".into(), "".into(), "Ġthe".into()]))),
        ("a.empty", Value::Array(Array::F32(vec![]))),
    ]
}

#[test]
fn every_value_type_round_trips_in_order() {
    let mut w = GgufWriter::new();
    for (k, v) in every_value() {
        w.add(k, v);
    }
    let f = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    assert_eq!(f.version(), 3);
    let got: Vec<(&str, &Value)> = f.metadata().iter().map(|kv| (kv.key.as_str(), &kv.value)).collect();
    let want = every_value();
    assert_eq!(got.len(), want.len());
    for ((gk, gv), (wk, wv)) in got.iter().zip(&want) {
        assert_eq!(gk, wk);
        assert_eq!(*gv, wv, "{wk}");
    }
    assert_eq!(f.get("t.f64"), Some(&Value::F64(std::f64::consts::PI)));
    assert!(f.tensors().is_empty());
}

#[test]
fn floats_round_trip_bit_exactly() {
    let mut w = GgufWriter::new();
    w.add("nan", f32::from_bits(0x7fc0_1234));
    let f = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    assert_eq!(f.get_f32("nan").unwrap().to_bits(), 0x7fc0_1234);
}

#[test]
fn tensors_of_several_types_round_trip_aligned() {
    let specs: &[(&str, &[u64], GgmlType)] = &[
        ("f32.weight", &[7], GgmlType::F32),
        ("f16.weight", &[3, 5], GgmlType::F16),
        ("bf16.weight", &[1, 1, 3], GgmlType::BF16),
        ("q4_0.weight", &[64, 3], GgmlType::Q4_0),
        ("q4_1.weight", &[32, 1, 1, 2], GgmlType::Q4_1),
        ("q8_0.weight", &[96, 2], GgmlType::Q8_0),
        ("q4_k.weight", &[256, 2], GgmlType::Q4K),
        ("q6_k.weight", &[512], GgmlType::Q6K),
    ];
    let mut w = GgufWriter::new();
    w.add_string("general.architecture", "test");
    let mut expected = Vec::new();
    for (i, (name, dims, ty)) in specs.iter().enumerate() {
        let n: u64 = dims.iter().product();
        let size = (n / ty.block_size() as u64 * ty.type_size() as u64) as usize;
        let data = bytes(size, i as u64);
        w.add_tensor(name, dims, *ty, data.clone()).unwrap();
        expected.push((name, dims, ty, n, data));
    }
    let f = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    assert_eq!(f.alignment(), DEFAULT_ALIGNMENT);
    assert_eq!(f.data_offset() % 32, 0);
    assert_eq!(f.tensors().len(), specs.len());
    for ((name, dims, ty, n, data), info) in expected.iter().zip(f.tensors()) {
        assert_eq!(&info.name, *name);
        assert_eq!(info.dims, **dims);
        assert_eq!(info.ggml_type, **ty);
        assert_eq!(info.n_elements, *n);
        assert_eq!(info.n_bytes as usize, data.len());
        assert_eq!(info.offset % 32, 0, "{name} offset {}", info.offset);
        assert!(info.offset >= f.data_offset());
        assert_eq!(f.tensor_data(info).unwrap(), data.as_slice());
        assert_eq!(f.tensor_data_by_name(name).unwrap(), data.as_slice());
        assert_eq!(f.tensor(name), Some(info));
    }
    assert!(matches!(f.tensor_data_by_name("nope"), Err(GgufError::MissingTensor(n)) if n == "nope"));
}

#[test]
fn alignment_is_honoured() {
    for alignment in [1u32, 8, 64, 4096] {
        let mut w = GgufWriter::new();
        w.set_alignment(alignment);
        w.add_tensor("a", &[3], GgmlType::F32, bytes(12, 1)).unwrap();
        w.add_tensor("b", &[5], GgmlType::F16, bytes(10, 2)).unwrap();
        w.add_tensor("c", &[32], GgmlType::Q8_0, bytes(34, 3)).unwrap();
        let file = w.to_bytes().unwrap();
        assert_eq!(file.len() % alignment as usize, 0, "the file is padded to the alignment");
        let f = GgufFile::from_bytes(file).unwrap();
        assert_eq!(f.alignment(), u64::from(alignment));
        assert_eq!(f.data_offset() % u64::from(alignment), 0);
        for t in f.tensors() {
            assert_eq!(t.offset % u64::from(alignment), 0, "{} at {} with alignment {alignment}", t.name, t.offset);
        }
        assert_eq!(f.tensor_data_by_name("c").unwrap(), bytes(34, 3).as_slice());
    }
}

#[test]
fn version_2_files_read_the_same() {
    let mut w = GgufWriter::new();
    w.add_u32("llama.block_count", 2).add_tensor("a", &[4], GgmlType::F32, bytes(16, 4)).unwrap();
    let mut file = w.to_bytes().unwrap();
    file[4..8].copy_from_slice(&2u32.to_le_bytes());
    let f = GgufFile::from_bytes(file).unwrap();
    assert_eq!(f.version(), 2);
    assert_eq!(f.get_u32("llama.block_count").unwrap(), 2);
    assert_eq!(f.tensor_data_by_name("a").unwrap(), bytes(16, 4).as_slice());
}

fn getter_file() -> GgufFile {
    let mut w = GgufWriter::new();
    w.add("u8", 7u8)
        .add("i32_pos", 12i32)
        .add("i32_neg", -1i32)
        .add("u64_small", 5u64)
        .add("u64_big", u64::MAX)
        .add_f32("f32", 0.5)
        .add("f64", 0.25f64)
        .add_bool("bool", true)
        .add_string("name", "llama")
        .add_string_array("tokens", &["a", "b"])
        .add_f32_array("scores", &[0.0, -1.0])
        .add_i32_array("types", &[1, 3])
        .add("scores_i32", vec![1i32, 2]);
    GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap()
}

#[test]
fn typed_getters_accept_lossless_conversions() {
    let f = getter_file();
    assert_eq!(f.get_u32("u8").unwrap(), 7);
    assert_eq!(f.get_u32("i32_pos").unwrap(), 12);
    assert_eq!(f.get_u32("u64_small").unwrap(), 5);
    assert_eq!(f.get_u64("u64_big").unwrap(), u64::MAX);
    assert_eq!(f.get_i32("i32_neg").unwrap(), -1);
    assert_eq!(f.get_i64("u8").unwrap(), 7);
    assert_eq!(f.get_f32("f32").unwrap(), 0.5);
    assert_eq!(f.get_f32("f64").unwrap(), 0.25);
    assert!(f.get_bool("bool").unwrap());
    assert_eq!(f.get_str("name").unwrap(), "llama");
    assert_eq!(f.get_string_array("tokens").unwrap(), ["a", "b"]);
    assert_eq!(f.get_f32_array("scores").unwrap(), [0.0, -1.0]);
    assert_eq!(f.get_i32_array("types").unwrap(), [1, 3]);
    assert_eq!(f.get_u32_or("absent", 9).unwrap(), 9);
    assert_eq!(f.get_u32_or("u8", 9).unwrap(), 7);
    assert_eq!(f.get_f32_or("absent", 1e-5).unwrap(), 1e-5);
    assert!(!f.get_bool_or("absent", false).unwrap());
}

#[test]
fn typed_getters_name_the_key_and_both_types() {
    let f = getter_file();
    let err = |r: Result<(), GgufError>| r.unwrap_err().to_string();
    let e = err(f.get_u32("name").map(drop));
    assert!(e.contains("'name'") && e.contains("expected u32") && e.contains("found string"), "{e}");
    assert!(e.contains("at byte "), "{e}");
    let e = err(f.get_u32("i32_neg").map(drop));
    assert!(e.contains("expected u32, found i32 -1 (out of range)"), "{e}");
    let e = err(f.get_u32("u64_big").map(drop));
    assert!(e.contains("expected u32, found u64 18446744073709551615"), "{e}");
    let e = err(f.get_f32_array("scores_i32").map(drop));
    assert!(e.contains("'scores_i32'") && e.contains("expected array of f32, found array of i32"), "{e}");
    let e = err(f.get_string_array("scores").map(drop));
    assert!(e.contains("expected array of string, found array of f32"), "{e}");
    let e = err(f.get_str("tokens").map(drop));
    assert!(e.contains("expected string, found array of string"), "{e}");
    let e = err(f.get_bool("u8").map(drop));
    assert!(e.contains("expected bool, found u8 7"), "{e}");
    let e = err(f.get_f32("i32_pos").map(drop));
    assert!(e.contains("expected f32, found i32"), "{e}");
    // A present key of the wrong type is an error, not the default.
    let e = err(f.get_u32_or("name", 1).map(drop));
    assert!(e.contains("expected u32, found string"), "{e}");
    assert!(matches!(f.get_u32("absent"), Err(GgufError::MissingKey(k)) if k == "absent"));
    assert_eq!(err(f.get_str("absent").map(drop)), "GGUF metadata key 'absent' is missing");
}

#[test]
fn streaming_writer_checks_order_and_sizes() {
    let mut w = GgufWriter::new();
    w.declare_tensor("a", &[8], GgmlType::F32).unwrap();
    w.declare_tensor("b", &[32, 2], GgmlType::Q8_0).unwrap();
    w.declare_tensor("c", &[2], GgmlType::F16).unwrap();
    assert!(w.to_bytes().unwrap_err().to_string().contains("declared without data"));

    let mut s = w.start(Vec::new()).unwrap();
    assert_eq!(s.next_tensor(), Some("a"));
    let e = s.write_tensor("b", &bytes(68, 0)).unwrap_err().to_string();
    assert!(e.contains("out of order; 'a' comes next"), "{e}");
    let e = s.write_tensor("a", &bytes(31, 0)).unwrap_err().to_string();
    assert!(e.contains("needs 32 bytes, got 31"), "{e}");
    s.write_tensor("a", &bytes(32, 1)).unwrap();
    let data_b = bytes(68, 2);
    s.write_tensor_from("b", &data_b[..]).unwrap();
    let unfinished = s.finish().unwrap_err().to_string();
    assert!(unfinished.contains("before tensor 'c'"), "{unfinished}");

    let mut s = w.start(Vec::new()).unwrap();
    s.write_tensor("a", &bytes(32, 1)).unwrap();
    // A reader with more bytes than the tensor: only the tensor's bytes are taken.
    s.write_tensor_from("b", std::io::Cursor::new([data_b.clone(), vec![9; 100]].concat())).unwrap();
    let e = s.write_tensor_from("c", &[1u8, 2][..]).unwrap_err().to_string();
    assert!(e.contains("needs 4 bytes but its reader gave 2"), "{e}");

    let mut s = w.start(Vec::new()).unwrap();
    s.write_tensor("a", &bytes(32, 1)).unwrap();
    s.write_tensor_from("b", &data_b[..]).unwrap();
    s.write_tensor("c", &[1, 2, 3, 4]).unwrap();
    assert!(s.write_tensor("d", &[]).unwrap_err().to_string().contains("after all declared tensors"));
    let f = GgufFile::from_bytes(s.finish().unwrap()).unwrap();
    assert_eq!(f.tensor_data_by_name("a").unwrap(), bytes(32, 1).as_slice());
    assert_eq!(f.tensor_data_by_name("b").unwrap(), data_b.as_slice());
    assert_eq!(f.tensor_data_by_name("c").unwrap(), [1, 2, 3, 4]);
}

#[test]
fn writer_refuses_what_the_reader_would() {
    let mut w = GgufWriter::new();
    let e = |r: Result<&mut GgufWriter, GgufError>| r.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e(w.declare_tensor("a", &[], GgmlType::F32)).contains("n_dims 0"));
    assert!(e(w.declare_tensor("a", &[1, 1, 1, 1, 1], GgmlType::F32)).contains("n_dims 5"));
    assert!(e(w.declare_tensor("a", &[4, 0], GgmlType::F32)).contains("dimension 1 is 0"));
    assert!(e(w.declare_tensor("a", &[1 << 40, 1 << 40], GgmlType::F32)).contains("overflows"));
    assert!(e(w.declare_tensor("a", &[48], GgmlType::Q4_0)).contains("not a multiple of the Q4_0 block size 32"));
    assert!(e(w.add_tensor("a", &[4], GgmlType::F32, vec![0; 15])).contains("needs 16 bytes, got 15"));
    w.declare_tensor("a", &[4], GgmlType::F32).unwrap();
    assert!(e(w.declare_tensor("a", &[4], GgmlType::F32)).contains("added twice"));

    for (value, want) in
        [(Value::U32(0), "alignment 0"), (Value::U32(48), "alignment 48"), (Value::U64(32), "must be a u32")]
    {
        let mut w = GgufWriter::new();
        w.add("general.alignment", value);
        let err = w.to_bytes().unwrap_err().to_string();
        assert!(err.contains(want), "{err}");
    }
}

#[test]
fn adding_a_key_twice_keeps_one_entry() {
    let mut w = GgufWriter::new();
    w.add_u32("a", 1).add_u32("b", 2).add_string("a", "x");
    let f = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    let keys: Vec<&str> = f.metadata().iter().map(|kv| kv.key.as_str()).collect();
    assert_eq!(keys, ["a", "b"]);
    assert_eq!(f.get_str("a").unwrap(), "x");
}

#[test]
fn large_vocabularies_round_trip() {
    let tokens: Vec<String> = (0..49_152).map(|i| format!("tok{i}▁")).collect();
    let scores: Vec<f32> = (0..49_152).map(|i| -(i as f32)).collect();
    let mut w = GgufWriter::new();
    w.add_string_array("tokenizer.ggml.tokens", &tokens).add_f32_array("tokenizer.ggml.scores", &scores);
    let f = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    assert_eq!(f.get_string_array("tokenizer.ggml.tokens").unwrap(), tokens.as_slice());
    assert_eq!(f.get_f32_array("tokenizer.ggml.scores").unwrap(), scores.as_slice());
}

fn tmp(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("gguf_reader-{}-{name}", std::process::id()))
}

#[test]
fn files_on_disk_are_mapped_and_errors_name_the_path() {
    let path = tmp("ok.gguf");
    let mut w = GgufWriter::new();
    w.add_string("general.architecture", "llama").add_tensor("a", &[8], GgmlType::F32, bytes(32, 7)).unwrap();
    w.write_file(&path).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.get_str("general.architecture").unwrap(), "llama");
    let data = f.tensor_data_by_name("a").unwrap();
    assert_eq!(data, bytes(32, 7).as_slice());
    // Zero-copy: the slice points into the file's bytes.
    assert!(f.bytes().as_ptr_range().contains(&data.as_ptr()));

    let bad = tmp("bad.gguf");
    std::fs::write(&bad, b"GGUF\x01\x00\x00\x00").unwrap();
    let e = GgufFile::open(&bad).unwrap_err().to_string();
    assert!(e.starts_with(&bad.display().to_string()) && e.contains("version 1"), "{e}");
    let e = GgufFile::open(tmp("absent.gguf")).unwrap_err().to_string();
    assert!(e.contains("absent.gguf") && e.contains("I/O"), "{e}");
    let empty = tmp("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    assert!(GgufFile::open(&empty).unwrap_err().to_string().contains("magic"));
    for p in [path, bad, empty] {
        let _ = std::fs::remove_file(p);
    }
}

/// The real model the project downloads (scripts/fetch-models.sh), when it is there.
#[test]
fn reads_the_smollm2_model_when_present() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.exists() {
        eprintln!("skipped: {} not found", path.display());
        return;
    }
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(f.get_u32("llama.block_count").unwrap(), 30);
    assert_eq!(f.get_string_array("tokenizer.ggml.tokens").unwrap().len(), 49_152);
    assert_eq!(f.get_i32_array("tokenizer.ggml.token_type").unwrap().len(), 49_152);
    let embd = f.tensor("token_embd.weight").unwrap();
    assert_eq!(embd.dims, [576, 49_152]);
    assert_eq!(f.tensor_data(embd).unwrap().len() as u64, embd.n_bytes);
    let last = f.tensors().iter().map(|t| t.offset + t.n_bytes).max().unwrap();
    assert!(last <= f.bytes().len() as u64);
}
