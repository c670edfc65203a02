//! The GGUF tokenizer of SmolLM2-135M-Instruct against llama.cpp's own results
//! (tests/data/smollm2/*.json, made by scripts/reference/make_smollm2_refs.py).
//!
//! Needs models/SmolLM2-135M-Instruct.Q4_1.gguf: `scripts/fetch-models.sh smollm2`.

use std::path::PathBuf;
use std::sync::OnceLock;

use anygpu_models::gguf::GgufFile;
use anygpu_models::tokenizer::{build, LlmTokenizer, TokenizerSpec, VocabKind};
use serde_json::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn model_path() -> PathBuf {
    root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

fn spec() -> TokenizerSpec {
    let path = model_path();
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-models.sh (or scripts/fetch-models.sh smollm2) first",
        path.display()
    );
    let file = GgufFile::open(&path).expect("open GGUF");
    TokenizerSpec::from_gguf(&file).expect("tokenizer metadata")
}

fn tok() -> &'static LlmTokenizer {
    static TOK: OnceLock<LlmTokenizer> = OnceLock::new();
    TOK.get_or_init(|| build(&spec()).expect("build tokenizer"))
}

fn fixture(name: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/smollm2").join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("id list").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

#[test]
fn spec_from_gguf() {
    let s = spec();
    assert_eq!(s.model, "gpt2");
    assert_eq!(s.pre.as_deref(), Some("smollm"));
    assert_eq!(s.tokens.len(), 49152);
    assert_eq!(s.merges.as_ref().map(Vec::len), Some(48900));
    assert_eq!(s.token_types.as_ref().map(Vec::len), Some(49152));
    assert_eq!((s.bos_token_id, s.eos_token_id, s.unknown_token_id), (Some(1), Some(2), Some(0)));
    assert_eq!(s.add_bos_token, Some(false));
    assert_eq!(s.add_space_prefix, Some(false));
}

#[test]
fn vocab_matches_llama_cpp() {
    let fx = fixture("tokenize.json");
    let v = &fx["vocab"];
    let t = tok();
    assert_eq!(t.kind(), VocabKind::Bpe);
    assert_eq!(t.vocab_size() as u64, v["n_vocab"].as_u64().unwrap());
    assert_eq!(t.bos_id().map(u64::from), v["bos"].as_u64());
    assert_eq!(t.eos_id().map(u64::from), v["eos"].as_u64());
    assert_eq!(t.eot_id().map(u64::from), v["eot"].as_u64());
    assert_eq!(t.add_bos(), v["add_bos"].as_bool().unwrap());
    assert_eq!(t.add_eos(), v["add_eos"].as_bool().unwrap());
    assert_eq!(t.eog_ids(), ids(&v["eog_ids"]), "end-of-generation ids");
    for id in t.eog_ids() {
        assert!(t.is_eog(id));
    }
    assert!(!t.is_eog(1) && !t.is_eog(198));
}

#[test]
fn tokenize_matches_llama_cpp() {
    let fx = fixture("tokenize.json");
    let t = tok();
    let mut failures = Vec::new();
    for case in fx["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want = ids(&case["ids"]);
        let got = t.encode(text, true).unwrap();
        if got != want {
            failures.push(format!("{text:?}\n  llama.cpp {want:?}\n  anygpu    {got:?}"));
        }
        let want_plain = ids(&case["ids_parse_special_false"]);
        let got_plain = t.encode_with(text, true, false).unwrap();
        if got_plain != want_plain {
            failures
                .push(format!("{text:?} (parse_special=false)\n  llama.cpp {want_plain:?}\n  anygpu    {got_plain:?}"));
        }
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn decode_round_trips() {
    let fx = fixture("tokenize.json");
    let t = tok();
    for case in fx["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let ids = t.encode(text, true).unwrap();
        let back = t.decode(&ids);
        assert_eq!(back, text, "decode(encode({text:?}))");
        assert_eq!(back, case["detokenized"].as_str().unwrap(), "llama.cpp detokenize of {text:?}");
    }
}

#[test]
fn special_tokens_parse_as_one_id() {
    let t = tok();
    assert_eq!(t.token_text(1), Some("<|im_start|>"));
    assert_eq!(t.token_id("<|im_end|>"), Some(2));
    let ids = t.encode("<|im_start|>user\nHi<|im_end|>\n", true).unwrap();
    assert_eq!(ids.first(), Some(&1));
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 1);
    assert!(t.is_control(1) && t.is_special(2) && !t.is_control(198));
    // Without special parsing the markers are ordinary text.
    let plain = t.encode_with("<|im_start|>", true, false).unwrap();
    assert!(plain.len() > 1 && !plain.contains(&1), "{plain:?}");
    // Control tokens are text only when asked for.
    assert_eq!(t.decode_with(&ids, false), "user\nHi\n");
    assert_eq!(t.decode(&ids), "<|im_start|>user\nHi<|im_end|>\n");
    // add_bos_token is false in this file: no BOS is added.
    assert_eq!(t.encode("Hello", true).unwrap(), t.encode("Hello", false).unwrap());
}

#[test]
fn stream_decoder_never_breaks_utf8() {
    let t = tok();
    let texts = [
        "你好，世界！日本語のテキストです。한국어 문장입니다",
        "I ❤️ Rust 🦀 and 🐍 👨‍👩‍👧‍👦 👍🏽 😀",
        "café naïve résumé Ångström Ω≈ç√∫˜µ≤≥÷",
        "mixed: 12 émojis 🎉🎉 and CJK 漢字 <|im_end|> end",
    ];
    let mut held_back = 0;
    for text in texts {
        let ids = t.encode(text, false).unwrap();
        let mut dec = t.stream_decoder().with_special(true);
        let mut out = String::new();
        for &id in &ids {
            let chunk = dec.push(id);
            assert!(!chunk.contains('\u{FFFD}'), "replacement char in {chunk:?} for {text:?}");
            if !dec.pending_bytes().is_empty() {
                held_back += 1;
            }
            out.push_str(&chunk);
        }
        out.push_str(&dec.finish());
        assert_eq!(out, text);
    }
    // The texts above do split characters across tokens: the decoder had to hold bytes back.
    assert!(held_back > 0, "no token ended inside a character; the test lost its point");

    // Without `with_special`, control tokens give no text.
    let ids = t.encode("Hi<|im_end|>", false).unwrap();
    let mut dec = t.stream_decoder();
    let s: String = ids.iter().map(|&id| dec.push(id)).collect();
    assert_eq!(s, "Hi");
}

#[test]
fn stream_decoder_replaces_invalid_bytes() {
    let t = tok();
    // A lone UTF-8 lead byte followed by ASCII: the byte-level token for 0xE4 alone, then "a".
    let lead = t.token_id("ä").expect("byte token for 0xE4");
    let a = t.encode("a", false).unwrap()[0];
    let mut dec = t.stream_decoder();
    assert_eq!(dec.push(lead), "");
    assert_eq!(dec.push(a), "\u{FFFD}a");
    assert_eq!(dec.push(lead), "");
    assert_eq!(dec.finish(), "\u{FFFD}");
}

#[test]
fn prompts_and_generations_match_llama_cpp() {
    let fx = fixture("generate.json");
    let t = tok();
    for item in fx["items"].as_array().unwrap() {
        let prompt = item["prompt_text"].as_str().unwrap();
        assert_eq!(t.encode(prompt, true).unwrap(), ids(&item["prompt_ids"]), "prompt {prompt:?}");
        let gen = ids(&item["generated_ids"]);
        assert_eq!(t.decode_with(&gen, false), item["text"].as_str().unwrap(), "generation for {prompt:?}");
        let mut dec = t.stream_decoder();
        let mut streamed: String = gen.iter().map(|&id| dec.push(id)).collect();
        streamed.push_str(&dec.finish());
        assert_eq!(streamed, item["text"].as_str().unwrap());
    }
}

#[test]
fn perplexity_text_tokenizes_like_llama_cpp() {
    let fx = fixture("perplexity.json");
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/smollm2/ppl.txt");
    let text = std::fs::read_to_string(path).unwrap();
    let got = tok().encode(&text, true).unwrap();
    assert_eq!(got, ids(&fx["ids"]));
    assert_eq!(got.len() as u64, fx["n_tokens"].as_u64().unwrap());
}

#[test]
fn unknown_pre_tokenizer_is_a_clear_error() {
    let mut s = spec();
    s.pre = Some("no-such-pre".into());
    let err = build(&s).unwrap_err().to_string();
    assert!(err.contains("tokenizer.ggml.pre") && err.contains("no-such-pre"), "{err}");

    let mut s = spec();
    s.model = "bert".into();
    let err = build(&s).unwrap_err().to_string();
    assert!(err.contains("tokenizer.ggml.model"), "{err}");

    let mut s = spec();
    s.merges = None;
    let err = build(&s).unwrap_err().to_string();
    assert!(err.contains("tokenizer.ggml.merges"), "{err}");
}
