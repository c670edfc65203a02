//! A stable-Rust stand-in for fuzzing: thousands of deterministic random mutations of a valid
//! file (bit flips, interesting values, truncations, insertions, deletions). The reader must
//! never panic, and a file it accepts must be self-consistent.

use std::panic::{catch_unwind, AssertUnwindSafe};

use anygpu_models::gguf::{GgmlType, GgufFile, GgufWriter, Value};

const CASES: u64 = 10_000;

/// xorshift64*: small, deterministic, good enough to pick mutations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn seed_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add_string("general.architecture", "llama")
        .add_u32("llama.block_count", 2)
        .add_f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        .add_bool("tokenizer.ggml.add_bos_token", true)
        .add_string_array("tokenizer.ggml.tokens", &["<s>", "</s>", "a", "b", "ab"])
        .add_f32_array("tokenizer.ggml.scores", &[0.0, 0.0, -1.0, -2.0, -3.0])
        .add_i32_array("tokenizer.ggml.token_type", &[3, 3, 1, 1, 1])
        .add("general.ratio", 0.5f64)
        .add("general.count", 7u64);
    w.add_tensor("token_embd.weight", &[4, 5], GgmlType::F32, vec![1; 80]).unwrap();
    w.add_tensor("blk.0.attn_q.weight", &[32, 2], GgmlType::Q8_0, vec![2; 68]).unwrap();
    w.add_tensor("blk.0.ffn_up.weight", &[256], GgmlType::Q4K, vec![3; 144]).unwrap();
    w.add_tensor("output_norm.weight", &[4], GgmlType::F16, vec![4; 8]).unwrap();
    w.to_bytes().unwrap()
}

const INTERESTING_U64: [u64; 10] = [0, 1, 4, 5, 31, 32, 0x7fff_ffff, 1 << 32, 1 << 63, u64::MAX];
const INTERESTING_U8: [u8; 6] = [0, 1, 0x7f, 0x80, 0xfe, 0xff];

fn mutate(rng: &mut Rng, file: &mut Vec<u8>) {
    for _ in 0..1 + rng.below(3) {
        let len = file.len();
        match rng.below(7) {
            0 => {
                let i = rng.below(len);
                if let Some(b) = file.get_mut(i) {
                    *b ^= 1 << rng.below(8);
                }
            }
            1 => {
                let i = rng.below(len);
                if let Some(b) = file.get_mut(i) {
                    *b = INTERESTING_U8[rng.below(INTERESTING_U8.len())];
                }
            }
            2 => {
                // An interesting u64 (or its low half) over a length, count or offset.
                let v = INTERESTING_U64[rng.below(INTERESTING_U64.len())].to_le_bytes();
                let width = if rng.below(2) == 0 { 8 } else { 4 };
                let i = rng.below(len.saturating_sub(width));
                if i + width <= len {
                    file[i..i + width].copy_from_slice(&v[..width]);
                }
            }
            3 => file.truncate(rng.below(len + 1)),
            4 => {
                let i = rng.below(len + 1);
                let n = 1 + rng.below(16);
                let junk: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                file.splice(i..i, junk);
            }
            5 => {
                let i = rng.below(len);
                let n = (1 + rng.below(16)).min(len - i.min(len));
                file.drain(i..i + n);
            }
            _ => {
                // Duplicate a chunk elsewhere (repeats keys, tensor infos).
                let i = rng.below(len);
                let n = (1 + rng.below(64)).min(len - i.min(len));
                let chunk = file[i..i + n].to_vec();
                let at = rng.below(len + 1);
                file.splice(at..at, chunk);
            }
        }
    }
}

/// Everything a caller might do with an accepted file must be safe and consistent.
fn check_consistent(f: &GgufFile) -> Result<(), String> {
    let len = f.bytes().len() as u64;
    if !f.alignment().is_power_of_two() || !f.data_offset().is_multiple_of(f.alignment()) {
        return Err(format!("alignment {} data offset {}", f.alignment(), f.data_offset()));
    }
    let mut ranges = Vec::new();
    for t in f.tensors() {
        let data = f.tensor_data(t).map_err(|e| format!("tensor_data failed on an accepted file: {e}"))?;
        let n: u64 = t.dims.iter().product();
        if data.len() as u64 != t.n_bytes
            || n != t.n_elements
            || t.ggml_type.byte_size(n).ok() != Some(t.n_bytes)
            || !t.offset.is_multiple_of(f.alignment())
            || t.offset < f.data_offset()
            || t.offset + t.n_bytes > len
            || t.dims.is_empty()
            || t.dims.len() > 4
        {
            return Err(format!("inconsistent tensor {t:?}"));
        }
        if f.tensor(&t.name) != Some(t) {
            return Err(format!("tensor lookup of {:?} differs", t.name));
        }
        ranges.push((t.offset, t.offset + t.n_bytes));
    }
    ranges.sort();
    if ranges.windows(2).any(|w| w[0].1 > w[1].0) {
        return Err(format!("overlapping tensors {ranges:?}"));
    }
    for kv in f.metadata() {
        let k = &kv.key;
        // (By address: a mutated float may be NaN, which is not equal to itself.)
        if !f.get(k).is_some_and(|v| std::ptr::eq(v, &kv.value)) {
            return Err(format!("lookup of key {k:?} differs"));
        }
        // Every getter on every key: Ok or Err, never a panic.
        let _ = (f.get_u32(k), f.get_u64(k), f.get_i32(k), f.get_i64(k), f.get_f32(k), f.get_bool(k));
        let _ = (f.get_str(k), f.get_string_array(k), f.get_f32_array(k), f.get_i32_array(k));
        let _ = kv.value.type_name();
        if let Value::Array(a) = &kv.value {
            let _ = a.len();
        }
    }
    Ok(())
}

#[test]
fn mutated_files_never_panic_and_accepted_ones_are_consistent() {
    let seed = seed_file();
    assert!(GgufFile::from_bytes(seed.clone()).is_ok());
    let (mut accepted, mut rejected) = (0, 0);
    let mut failures = Vec::new();
    for case in 0..CASES {
        let mut rng = Rng(0x5EED_0000 + case * 0x9E37_79B9);
        let mut file = seed.clone();
        mutate(&mut rng, &mut file);
        let outcome =
            catch_unwind(AssertUnwindSafe(|| GgufFile::from_bytes(file.clone()).map(|f| check_consistent(&f))));
        match outcome {
            Err(_) => failures.push(format!("case {case}: PANIC on {} bytes", file.len())),
            Ok(Err(_)) => rejected += 1,
            Ok(Ok(Ok(()))) => accepted += 1,
            Ok(Ok(Err(msg))) => failures.push(format!("case {case}: {msg}")),
        }
    }
    assert!(failures.is_empty(), "{} failures:\n{}", failures.len(), failures.join("\n"));
    eprintln!("{CASES} mutations: {accepted} accepted, {rejected} rejected");
    // Both outcomes must be common, or the mutations are not exercising the reader.
    assert!(accepted > CASES / 20 && rejected > CASES / 4, "accepted {accepted}, rejected {rejected}");
}
