//! The `anygpu` binary as a user meets it: bad input is a message and a non-zero exit (2 for a
//! wrong command line, 1 for a file or device that fails), never a panic; `--json` outputs
//! parse. Runs on the CPU backend (`ANYGPU_BACKEND=cpu`): the GPU paths have their own tests.
//! The model comes from scripts/fetch-models.sh (the README's test command runs it).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn smollm2() -> PathBuf {
    let path = root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.exists(),
        "{} is missing: run scripts/fetch-models.sh (the README's test command does)",
        path.display()
    );
    path
}

fn anygpu(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_anygpu"))
        .args(args)
        .env("ANYGPU_BACKEND", "cpu")
        .output()
        .expect("the anygpu binary runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs `args`, expecting exit code `code` and `want` in stderr, and no panic.
fn expect_failure(args: &[&str], code: i32, want: &str) {
    let o = anygpu(args);
    let err = stderr(&o);
    assert!(!err.contains("panicked"), "{args:?} panicked:\n{err}");
    assert_eq!(o.status.code(), Some(code), "{args:?}: exit status {:?}, stderr:\n{err}", o.status);
    assert!(err.contains(want), "{args:?}: stderr does not say {want:?}:\n{err}");
}

fn s(p: &Path) -> &str {
    p.to_str().expect("a UTF-8 path")
}

#[test]
fn wrong_command_lines_exit_2_saying_what_is_wrong() {
    let m = smollm2();
    let m = s(&m);
    let models = root().join("models");
    let readme = root().join("README.md");
    let cases: &[(&[&str], &str)] = &[
        (&["generate", "-m", "/nonexistent/model.gguf", "-p", "hi"], "does not exist"),
        (&["generate", "-m", s(&models), "-p", "hi"], "is a directory"),
        (&["generate", "-m", m, "-p", "hi", "--top-p", "2"], "--top-p must be in (0, 1]"),
        (&["generate", "-m", m, "-p", "hi", "--temp=-1"], "--temp must be >= 0"),
        (&["generate", "-m", m, "-p", "hi", "--top-k", "many"], "invalid value 'many'"),
        (&["bench", "llm", "-m", m, "-p", "0", "-n", "0"], "nothing to measure"),
        (&["bench", "llm", "-m", m, "-r", "0"], "--repetitions must be at least 1"),
        (&["tokenize", "-m", m, "-f", "/nonexistent/text.txt"], "/nonexistent/text.txt"),
        (&["perplexity", "-m", m, "-f", s(&readme), "-c", "1"], "--ctx-size of at least 2"),
        (&["frobnicate"], "unrecognized subcommand"),
    ];
    for (args, want) in cases {
        expect_failure(args, 2, want);
    }
}

#[test]
fn a_corrupt_model_file_exits_1_naming_the_file_and_the_field() {
    let data = root().join("crates/anygpu-models/tests/data/gguf-hostile");
    for (file, want) in [
        ("huge_string_length.gguf", "GGUF metadata 'general.name' at byte 101"),
        ("truncated_data.gguf", "run past the end of the 383-byte file"),
        ("bad_magic.gguf", "not a GGUF file"),
    ] {
        let path = data.join(file);
        let o = anygpu(&["generate", "-m", s(&path), "-p", "hi", "-n", "1"]);
        let err = stderr(&o);
        assert!(!err.contains("panicked") && o.status.code() == Some(1), "{file}: {:?}\n{err}", o.status);
        assert!(err.contains(file) && err.contains(want), "{file}: stderr does not name it and say {want:?}:\n{err}");
    }
}

#[test]
fn generate_json_is_one_object_with_the_ids_and_text() {
    let m = smollm2();
    let o = anygpu(&["generate", "-m", s(&m), "-p", "The capital of France is", "-n", "4", "--temp", "0", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("stdout is one JSON object");
    let prompt = v["prompt_ids"].as_array().expect("prompt_ids");
    let generated = v["generated_ids"].as_array().expect("generated_ids");
    assert!(!prompt.is_empty() && (1..=4).contains(&generated.len()), "{v}");
    assert!(v["text"].is_string() && v["timings"].is_object(), "{v}");
    // The prompt ids are the tokenizer's.
    let t = anygpu(&["tokenize", "-m", s(&m), "The capital of France is", "--json"]);
    assert!(t.status.success(), "{}", stderr(&t));
    let ids: serde_json::Value = serde_json::from_slice(&t.stdout).expect("tokenize --json is a JSON array");
    assert_eq!(&ids, &v["prompt_ids"]);
    // Greedy decoding is deterministic.
    let again =
        anygpu(&["generate", "-m", s(&m), "-p", "The capital of France is", "-n", "4", "--temp", "0", "--json"]);
    let w: serde_json::Value = serde_json::from_slice(&again.stdout).expect("JSON");
    assert_eq!(v["generated_ids"], w["generated_ids"]);
}

/// `bench llm -d` (llama-bench's depth) names its rows `pp8 @ d16`, measures after the prefilled
/// tokens, and refuses a depth past the model's context.
#[test]
fn bench_llm_at_a_depth() {
    let m = smollm2();
    let o = anygpu(&["bench", "llm", "-m", s(&m), "-p", "8", "-n", "4", "-d", "16", "-r", "1", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("bench llm --json is JSON");
    let rows = v.as_array().expect("an array of rows");
    let tests: Vec<&str> = rows.iter().map(|r| r["test"].as_str().expect("test")).collect();
    assert_eq!(tests, ["pp8 @ d16", "tg4 @ d16"], "{v}");
    assert!(rows.iter().all(|r| r["tokens_per_s"].as_f64().is_some_and(|t| t > 0.0)), "{v}");
    expect_failure(
        &["bench", "llm", "-m", s(&m), "-p", "8", "-n", "0", "-d", "100000"],
        2,
        "exceeds the model's training context",
    );
}

#[test]
fn devices_json_lists_the_cpu_backend_as_selected() {
    let o = anygpu(&["devices", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("devices --json is JSON");
    let list = v.as_array().expect("an array of devices");
    let selected: Vec<_> = list.iter().filter(|d| d["selected"] == true).collect();
    assert_eq!(selected.len(), 1, "exactly one selected device: {v}");
    assert_eq!(selected[0]["backend"], "cpu", "ANYGPU_BACKEND=cpu selects the CPU backend: {v}");
}
