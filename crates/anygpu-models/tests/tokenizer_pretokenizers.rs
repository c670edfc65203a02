//! Every supported `tokenizer.ggml.pre` family against llama.cpp: SmolLM2's vocabulary and
//! merges with the pre-tokenizer name replaced, on random hard strings
//! (tests/data/smollm2/pretokenizers.json, made by scripts/reference/make_tokenizer_refs.py).
//!
//! Needs models/SmolLM2-135M-Instruct.Q4_1.gguf: `scripts/fetch-models.sh smollm2`.

use std::path::PathBuf;

use anygpu_models::gguf::GgufFile;
use anygpu_models::tokenizer::{build, TokenizerSpec};
use serde_json::Value;

#[test]
fn pre_tokenizers_match_llama_cpp() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let model = root.join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        model.exists(),
        "{} is missing: run scripts/fetch-models.sh (or scripts/fetch-models.sh smollm2) first",
        model.display()
    );
    let base = TokenizerSpec::from_gguf(&GgufFile::open(&model).unwrap()).unwrap();
    let fx: Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("tests/data/smollm2/pretokenizers.json")).unwrap())
            .unwrap();
    let texts: Vec<&str> = fx["texts"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    let presets = fx["presets"].as_object().unwrap();
    assert!(presets.len() >= 20);

    let mut report = Vec::new();
    for (pre, want) in presets {
        // The fixture files had no add_bos_token, padding or unknown token keys.
        let spec = TokenizerSpec {
            pre: Some(pre.clone()),
            bos_token_id: Some(1),
            eos_token_id: Some(2),
            add_bos_token: None,
            add_eos_token: None,
            add_space_prefix: None,
            unknown_token_id: None,
            padding_token_id: None,
            model_name: Some("vocab test".into()),
            ..base.clone()
        };
        let tok = build(&spec).unwrap_or_else(|e| panic!("{pre}: {e}"));
        assert_eq!(tok.add_bos(), want["add_bos"].as_bool().unwrap(), "{pre}: add_bos default");
        let mut bad = 0;
        for (text, ids) in texts.iter().zip(want["ids"].as_array().unwrap()) {
            let ids: Vec<u32> = ids.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
            let got = tok.encode(text, true).unwrap();
            if got != ids {
                bad += 1;
                if bad <= 3 {
                    report.push(format!("{pre}: {text:?}\n  llama.cpp {ids:?}\n  anygpu    {got:?}"));
                }
            }
        }
        if bad > 0 {
            report.push(format!("{pre}: {bad}/{} mismatches", texts.len()));
        }
    }
    assert!(report.is_empty(), "\n{}", report.join("\n"));
}
