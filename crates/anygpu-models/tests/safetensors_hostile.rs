//! Hand-made hostile safetensors files (tests/data/safetensors-hostile/, written by
//! scripts/make_hostile_safetensors.py): each must give an error naming the file and what is
//! wrong (the tensor, where there is one), never a panic. Also a tiny BERT checkpoint and
//! broken copies of it: the model loader names the missing or misshapen tensor.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use anygpu_core::testing::gpu_devices;
use anygpu_core::Device;
use anygpu_models::bert::{Batch, BertConfig, BertModel, WeightDType};
use anygpu_models::safetensors_file::SafetensorsFile;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/safetensors-hostile")
}

/// (file, None if it must open, Some(text the error must contain)).
const CASES: &[(&str, Option<&str>)] = &[
    ("control.safetensors", None),
    ("int64_tensor.safetensors", None),
    ("empty.safetensors", Some("the file is 0 bytes, too short for the 8-byte header length")),
    ("short.safetensors", Some("the file is 5 bytes, too short")),
    ("header_len_huge.safetensors", Some("header length 9223372036854775808 is larger than the 100 MB")),
    ("header_len_past_end.safetensors", Some("header length 1000 runs past the end of the 68-byte file")),
    ("header_not_utf8.safetensors", Some("the JSON header is not UTF-8")),
    ("header_not_json.safetensors", Some("the JSON header is malformed: EOF while parsing")),
    ("header_not_object.safetensors", Some("the JSON header is malformed: invalid type: sequence")),
    ("metadata_not_strings.safetensors", Some("the JSON header is malformed: invalid type: integer `1`")),
    ("unknown_dtype.safetensors", Some("unknown variant `F33`")),
    ("negative_dim.safetensors", Some("invalid value: integer `-2`")),
    ("offsets_not_pair.safetensors", Some("invalid length 1, expected a tuple of size 2")),
    (
        "size_mismatch.safetensors",
        Some("tensor 'a': data_offsets [0, 16] hold 16 bytes, but shape [2, 3] x F32 needs 24"),
    ),
    ("overlapping_offsets.safetensors", Some("tensor 'b': data_offsets [8, 20] overlap tensor 'a' at [0, 16]")),
    (
        "gap_between_tensors.safetensors",
        Some("tensor 'b': data_offsets [20, 32] leave a gap of 4 bytes after tensor 'a'"),
    ),
    ("reversed_offsets.safetensors", Some("tensor 'b': data_offsets [28, 16] end before they begin")),
    (
        "offsets_past_end.safetensors",
        Some("the tensors cover 28 bytes of data but the file holds 24 after the header (truncated)"),
    ),
    (
        "trailing_bytes.safetensors",
        Some("cover 28 bytes of data but the file holds 36 after the header (trailing bytes)"),
    ),
    (
        "shape_overflow.safetensors",
        Some("tensor 'b': the byte size of shape [1099511627776, 1099511627776] x F32 overflows"),
    ),
    ("duplicate_name.safetensors", Some("tensor 'a' appears twice in the header")),
    ("duplicate_name_same_offsets.safetensors", Some("tensor 'a' appears twice in the header")),
];

fn open_quietly(path: &Path) -> Result<SafetensorsFile, String> {
    match catch_unwind(AssertUnwindSafe(|| SafetensorsFile::open(path))) {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => panic!("{}: opening panicked", path.display()),
    }
}

#[test]
fn hostile_files_give_errors_naming_the_problem() {
    let mut failures = Vec::new();
    for &(name, want) in CASES {
        let path = dir().join(name);
        assert!(path.exists(), "{} is missing: run scripts/make_hostile_safetensors.py", path.display());
        match (open_quietly(&path), want) {
            (Ok(_), None) => {}
            (Ok(_), Some(w)) => failures.push(format!("{name}: opened, expected an error containing {w:?}")),
            (Err(e), None) => failures.push(format!("{name}: expected to open, got {e}")),
            (Err(e), Some(w)) => {
                if !e.contains(w) || !e.contains(name) {
                    failures.push(format!("{name}: error {e:?} does not contain the file name and {w:?}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_hostile_file_is_in_the_table() {
    for entry in std::fs::read_dir(dir()).expect("dir") {
        let name = entry.expect("entry").file_name().into_string().expect("utf8");
        if name.ends_with(".safetensors") && !name.starts_with("tiny_bert") {
            assert!(CASES.iter().any(|(n, _)| *n == name), "{name} has no expected outcome in CASES");
        }
    }
}

#[test]
fn tensor_access_errors_name_the_tensor() {
    let f = SafetensorsFile::open(dir().join("control.safetensors")).expect("open");
    assert_eq!(f.names(), ["a", "b"]);
    let a = f.load_f32("a", Some(&[2, 2]), &Device::Cpu).expect("a");
    assert_eq!(a.to_vec_f32().expect("read"), [1.0, 2.0, 3.0, 4.0]);
    let err = f.load_f32("nope", None, &Device::Cpu).expect_err("missing");
    assert!(err.to_string().contains("tensor 'nope': missing from the file"), "{err}");
    let err = f.load_f32("a", Some(&[4]), &Device::Cpu).expect_err("shape");
    assert!(err.to_string().contains("tensor 'a': shape [2, 2] where the config implies [4]"), "{err}");
    let f = SafetensorsFile::open(dir().join("int64_tensor.safetensors")).expect("open");
    let err = f.load_f32("a", None, &Device::Cpu).expect_err("i64");
    assert!(err.to_string().contains("tensor 'a': dtype I64 is not a float type"), "{err}");
    let err = f.load("a", &Device::Cpu).expect_err("i64");
    assert!(err.to_string().contains("dtype I64 has no anygpu equivalent"), "{err}");
}

fn tiny_config() -> BertConfig {
    BertConfig::from_file(&dir().join("tiny_bert_config.json")).expect("config")
}

/// Both weight dtypes on every device against the CPU's run of the same dtype. F16 weights on
/// a GPU with tensor cores also round the activations to f16 inside the products (the CPU keeps
/// them f32), so they get an f16-sized bound: 1e-4 failed there (H100: 2.3e-4 off at one
/// element of these unit-scale LayerNorm outputs).
#[test]
fn tiny_bert_loads_and_runs_on_every_device() {
    let file = SafetensorsFile::open(dir().join("tiny_bert.safetensors")).expect("open");
    let ids = [2u32, 5, 7, 1, 3, 0];
    let run = |dev: &Device, dtype: WeightDType| -> Vec<f32> {
        let m = BertModel::load(tiny_config(), &file, dev, dtype).expect("load");
        let h = m.forward(&Batch { ids: &ids, type_ids: None, lengths: &[3, 2], t: 3 }).expect("forward");
        assert_eq!(h.dims(), [2, 3, 4]);
        h.to_vec_f32().expect("read")
    };
    for (dtype, bound) in [(WeightDType::F32, 1e-4), (WeightDType::F16, 2e-3)] {
        let want = run(&Device::Cpu, dtype);
        assert!(want.iter().all(|x| x.is_finite()));
        for dev in gpu_devices() {
            let got = run(dev, dtype);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                // Row 1's third token is padding: its values are not defined by the model.
                if i / 4 == 5 {
                    continue;
                }
                assert!((g - w).abs() < bound, "{} {dtype:?} element {i}: {g} vs CPU {w}", dev.name());
            }
        }
    }
}

#[test]
fn model_errors_name_the_tensor() {
    let missing = SafetensorsFile::open(dir().join("tiny_bert_missing_tensor.safetensors")).expect("open");
    let err = BertModel::load(tiny_config(), &missing, &Device::Cpu, WeightDType::Auto).err().expect("missing tensor");
    assert!(
        err.to_string()
            .contains("tiny_bert_missing_tensor.safetensors: tensor 'encoder.layer.0.output.dense.bias': missing"),
        "{err}"
    );
    let wrong = SafetensorsFile::open(dir().join("tiny_bert_wrong_shape.safetensors")).expect("open");
    let err = BertModel::load(tiny_config(), &wrong, &Device::Cpu, WeightDType::Auto).err().expect("wrong shape");
    assert!(
        err.to_string().contains(
            "tensor 'encoder.layer.0.intermediate.dense.weight': shape [4, 8] where the config implies [8, 4]"
        ),
        "{err}"
    );
}

#[test]
fn a_directory_is_an_error_saying_so() {
    let Err(err) = open_quietly(&dir()) else { panic!("a directory opened as a safetensors file") };
    assert!(err.contains("a directory, not a safetensors file"), "{err}");
}
