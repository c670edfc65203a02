//! Fuzzes the GGUF reader: any bytes must give an error or a self-consistent file, never a
//! panic. Seed the corpus with the hostile files:
//! `cargo +nightly fuzz run gguf_reader ../crates/anygpu-models/tests/data/gguf-hostile`
#![no_main]

use anygpu_models::gguf::GgufFile;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_bytes(data.to_vec()) else {
        return;
    };
    let len = file.bytes().len() as u64;
    for t in file.tensors() {
        let bytes = file.tensor_data(t).expect("an accepted file's tensors are in bounds");
        assert_eq!(bytes.len() as u64, t.n_bytes);
        assert!(t.offset.is_multiple_of(file.alignment()) && t.offset + t.n_bytes <= len);
    }
    for kv in file.metadata() {
        let k = &kv.key;
        let _ = (file.get_u32(k), file.get_f32(k), file.get_str(k), file.get_bool(k));
        let _ = (file.get_string_array(k), file.get_f32_array(k), file.get_i32_array(k));
    }
});
