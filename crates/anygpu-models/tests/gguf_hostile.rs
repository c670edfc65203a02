//! Hand-made hostile GGUF files (tests/data/gguf-hostile/, written by
//! scripts/make_hostile_gguf.py): each must give an error naming what is wrong, never a panic.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

use anygpu_models::gguf::GgufFile;

/// What to do with a file after opening it.
enum Check {
    /// Opening must fail with the text.
    Fails(&'static str),
    /// Opening must succeed.
    Opens,
    /// Opening succeeds; `get_f32_array(key)` fails with the text.
    F32Array(&'static str, &'static str),
    /// Opening succeeds; `get_u32(key)` fails with the text.
    U32(&'static str, &'static str),
}
use Check::*;

const CASES: &[(&str, Check)] = &[
    ("control.gguf", Opens),
    // header
    ("empty.gguf", Fails("magic at byte 0: needs 4 bytes but only 0")),
    ("bad_magic.gguf", Fails("magic at byte 0: expected \"GGUF\", found \"GGML\"")),
    ("version_1.gguf", Fails("version 1 is not supported")),
    ("version_4.gguf", Fails("version 4 is not supported")),
    ("version_big_endian.gguf", Fails("big-endian")),
    ("huge_tensor_count.gguf", Fails("tensor count at byte 8: 9223372036854775808 tensors")),
    ("huge_metadata_count.gguf", Fails("metadata count at byte 16: 4611686018427387904 key-value pairs")),
    ("counts_too_big_together.gguf", Fails("metadata count at byte 16")),
    // metadata
    ("huge_key_length.gguf", Fails("metadata key 0 at byte 32: needs 9223372036854775808 bytes")),
    ("huge_string_length.gguf", Fails("metadata 'general.name' at byte 101: needs 18446744073709551615 bytes")),
    ("huge_array_length.gguf", Fails("metadata 'tokenizer.ggml.scores' array length at byte 106")),
    ("huge_string_array_length.gguf", Fails("metadata 'tokenizer.ggml.tokens' array length")),
    ("huge_string_in_array.gguf", Fails("metadata 'tokenizer.ggml.tokens'[1]")),
    ("unknown_value_type.gguf", Fails("'general.weird' value type at byte 90: unknown value type 13")),
    ("unknown_array_type.gguf", Fails("'general.weird' array type at byte 94: unknown value type 200")),
    ("nested_array.gguf", Fails("arrays of arrays are not supported")),
    ("bool_2.gguf", Fails("bool byte 2 is neither 0 nor 1")),
    ("bool_array_2.gguf", Fails("'general.flags'[2] at byte 108: bool byte 7")),
    ("key_not_utf8.gguf", Fails("metadata key 1 at byte 77: the 10-byte string is not UTF-8")),
    ("string_not_utf8.gguf", Fails("'general.name' at byte 101: the 3-byte string is not UTF-8")),
    ("duplicate_key.gguf", Fails("'llama.block_count' at byte 102: duplicate key")),
    ("alignment_0.gguf", Fails("general.alignment at byte 98: alignment 0 is not a non-zero power of two")),
    ("alignment_3.gguf", Fails("alignment 3 is not a non-zero power of two")),
    ("alignment_u64.gguf", Fails("general.alignment at byte 98: expected u32, found u64")),
    ("alignment_string.gguf", Fails("general.alignment at byte 98: expected u32, found string")),
    ("alignment_huge.gguf", Fails("(byte 2147483648) run past the end")),
    // tensor infos
    ("huge_tensor_name_length.gguf", Fails("tensor 0 name at byte 77: needs 9223372036854775808 bytes")),
    ("n_dims_5.gguf", Fails("tensor 'a' n_dims at byte 78: n_dims 5 is not in 1..=4")),
    ("n_dims_0.gguf", Fails("n_dims 0 is not in 1..=4")),
    ("n_dims_huge.gguf", Fails("n_dims 4294967295 is not in 1..=4")),
    ("zero_dim.gguf", Fails("tensor 'a' dims at byte 82: dimension 1 is 0")),
    ("huge_dims.gguf", Fails("element count of dims [4294967296, 4294967296] overflows")),
    ("dim_over_i64.gguf", Fails("element count of dims [9223372036854775808] overflows")),
    ("byte_size_overflow.gguf", Fails("byte size of 4611686018427387904 F32 elements overflows")),
    ("unknown_tensor_type.gguf", Fails("tensor 'a' type at byte 90: unsupported: ggml tensor type id 99")),
    ("removed_tensor_type.gguf", Fails("ggml tensor type id 4 is not supported")),
    ("row_not_block_multiple.gguf", Fails("row length 33 is not a multiple of the Q4_0 block size 32")),
    ("duplicate_tensor_name.gguf", Fails("tensor 'a' at byte 102: duplicate tensor name")),
    ("misaligned_offset.gguf", Fails("tensor 'b' offset at byte 127: offset 36 is not a multiple of the alignment 32")),
    ("overlapping_tensors.gguf", Fails("bytes 192..224 overlaps tensor 'a' at bytes 160..224")),
    ("same_offset_tensors.gguf", Fails("bytes 160..192 overlaps tensor 'a'")),
    ("offset_out_of_file.gguf", Fails("tensor 'b' offset at byte 127: 32 bytes at offset 1024")),
    ("offset_overflow.gguf", Fails("at offset 18446744073709551584 from the data section")),
    ("data_past_end.gguf", Fails("256 bytes at offset 32 from the data section (byte 160) run past the end")),
    // truncations
    ("truncated_magic.gguf", Fails("magic at byte 0: needs 4 bytes but only 3")),
    ("truncated_version.gguf", Fails("version at byte 4: needs 4 bytes but only 2")),
    ("truncated_counts.gguf", Fails("metadata count at byte 16: needs 8 bytes but only 4")),
    ("truncated_string.gguf", Fails("'general.description' at byte 63: needs 120 bytes but only 80")),
    ("truncated_key.gguf", Fails("metadata key 1 at byte 191: needs 20 bytes but only 5")),
    ("truncated_value.gguf", Fails("'general.architecture' at byte 223: needs 5 bytes but only 2")),
    ("truncated_tensor_info.gguf", Fails("tensor 'a' n_dims at byte 237: needs 4 bytes")),
    ("truncated_tensor_dims.gguf", Fails("tensor 'a' dims at byte 241: needs 8 bytes")),
    ("truncated_data.gguf", Fails("run past the end of the 383-byte file")),
    // loaders asking for the wrong type
    ("scores_wrong_type.gguf", F32Array("tokenizer.ggml.scores", "expected array of f32, found array of i32")),
    ("block_count_string.gguf", U32("llama.block_count", "expected u32, found string")),
    ("block_count_negative.gguf", U32("llama.block_count", "expected u32, found i32 -1 (out of range)")),
];

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/gguf-hostile")
}

fn expect_err<T>(file: &str, result: Result<T, anygpu_models::gguf::GgufError>, want: &str) -> Option<String> {
    match result {
        Ok(_) => Some(format!("{file}: expected an error containing {want:?}, got Ok")),
        Err(e) if e.to_string().contains(want) => None,
        Err(e) => Some(format!("{file}: expected an error containing {want:?}, got {e}")),
    }
}

fn check(file: &str, check: &Check) -> Option<String> {
    let path = dir().join(file);
    let opened = GgufFile::open(&path);
    match check {
        Fails(want) => {
            // Errors from a path name the path.
            if let Err(e) = &opened {
                if !e.to_string().contains(file) {
                    return Some(format!("{file}: error does not name the file: {e}"));
                }
            }
            expect_err(file, opened, want)
        }
        Opens => opened.err().map(|e| format!("{file}: expected Ok, got {e}")),
        F32Array(key, want) | U32(key, want) => {
            let f = match opened {
                Ok(f) => f,
                Err(e) => return Some(format!("{file}: expected it to open, got {e}")),
            };
            if let F32Array(..) = check {
                expect_err(file, f.get_f32_array(key), want)
            } else {
                expect_err(file, f.get_u32(key), want)
            }
        }
    }
}

#[test]
fn hostile_files_give_errors_not_panics() {
    let mut failures = Vec::new();
    for (file, c) in CASES {
        match catch_unwind(AssertUnwindSafe(|| check(file, c))) {
            Ok(None) => {}
            Ok(Some(msg)) => failures.push(msg),
            Err(_) => failures.push(format!("{file}: PANICKED")),
        }
    }
    assert!(failures.is_empty(), "{} of {} cases failed:\n{}", failures.len(), CASES.len(), failures.join("\n"));
}

#[test]
fn every_file_in_the_folder_is_in_the_table() {
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(dir()).expect("tests/data/gguf-hostile exists") {
        let name = entry.expect("readable entry").file_name().to_string_lossy().into_owned();
        if !CASES.iter().any(|(f, _)| *f == name) {
            missing.push(name);
        }
    }
    assert!(missing.is_empty(), "files without an expected error: {missing:?}");
    for (file, _) in CASES {
        assert!(dir().join(file).exists(), "{file} is in the table but not in the folder");
    }
}

#[test]
fn hostile_files_fail_the_same_from_memory() {
    for (file, c) in CASES {
        let Fails(want) = c else { continue };
        let bytes = std::fs::read(dir().join(file)).expect("readable");
        let result = catch_unwind(|| GgufFile::from_bytes(bytes).map(|_| ()));
        let result = result.unwrap_or_else(|_| panic!("{file}: panicked"));
        if let Some(msg) = expect_err(file, result, want) {
            panic!("{msg}");
        }
    }
}

#[test]
fn errors_convert_to_core_format_errors() {
    let err = GgufFile::open(dir().join("version_1.gguf")).expect_err("version 1 is refused");
    let core: anygpu_core::Error = err.into();
    match core {
        anygpu_core::Error::Format(msg) => {
            assert!(msg.contains("version_1.gguf") && msg.contains("version 1"), "{msg}")
        }
        other => panic!("expected Error::Format, got {other:?}"),
    }
}

#[test]
fn a_directory_or_a_missing_path_is_an_error_saying_so() {
    let err = GgufFile::open(dir()).expect_err("a directory is not a GGUF file").to_string();
    assert!(err.contains("a directory, not a GGUF file"), "{err}");
    let missing = dir().join("no_such_file.gguf");
    let err = GgufFile::open(&missing).expect_err("missing").to_string();
    assert!(err.contains("no_such_file.gguf"), "{err}");
}
