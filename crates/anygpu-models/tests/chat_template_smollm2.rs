//! SmolLM2's chat template (from its GGUF) renders the same prompts as Hugging Face's Jinja2
//! rendering that made tests/data/smollm2/generate.json.
//!
//! Needs models/SmolLM2-135M-Instruct.Q4_1.gguf: `scripts/fetch-models.sh smollm2`.

use std::path::PathBuf;

use anygpu_models::chat_template::{ChatTemplate, Message, CHAT_TEMPLATE_KEY};
use anygpu_models::gguf::GgufFile;
use anygpu_models::tokenizer::{build, TokenizerSpec};
use serde_json::Value;

fn open_model() -> GgufFile {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-models.sh (or scripts/fetch-models.sh smollm2) first",
        path.display()
    );
    GgufFile::open(&path).expect("open GGUF")
}

#[test]
fn smollm2_template_matches_jinja2() {
    let file = open_model();
    let tok = build(&TokenizerSpec::from_gguf(&file).unwrap()).unwrap();
    let src = file.get_str(CHAT_TEMPLATE_KEY).unwrap();
    let tmpl = ChatTemplate::for_tokenizer(src, &tok).unwrap();

    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/smollm2/generate.json");
    let fx: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut n = 0;
    for item in fx["items"].as_array().unwrap() {
        if item["kind"] != "chat" {
            continue;
        }
        let messages: Vec<Message> = serde_json::from_value(item["messages"].clone()).unwrap();
        let want = item["prompt_text"].as_str().unwrap();
        assert_eq!(tmpl.render(&messages, true).unwrap(), want);
        // The rendered prompt tokenizes to llama.cpp's ids.
        let ids: Vec<u32> = item["prompt_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
        assert_eq!(tok.encode(want, true).unwrap(), ids);
        n += 1;
    }
    assert_eq!(n, 3);
}

#[test]
fn smollm2_default_system_prompt_and_generation_prompt() {
    let file = open_model();
    let tmpl = ChatTemplate::new(file.get_str(CHAT_TEMPLATE_KEY).unwrap()).unwrap();
    let no_system = tmpl.render(&[Message::user("Hi")], false).unwrap();
    assert!(no_system.starts_with("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"));
    assert!(no_system.ends_with("<|im_start|>user\nHi<|im_end|>\n"));
    let with_system = tmpl.render(&[Message::system("Be brief."), Message::user("Hi")], true).unwrap();
    assert_eq!(
        with_system,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
}
