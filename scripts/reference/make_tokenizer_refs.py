#!/usr/bin/env python3
"""Tokenizer fixtures beyond SmolLM2's own pre-tokenizer, from llama.cpp (llama-cpp-python).

Writes into crates/anygpu-models/tests/data/smollm2/:
  pretokenizers.json  random hard strings tokenized by llama.cpp with SmolLM2's vocabulary and
                      merges under other `tokenizer.ggml.pre` names (llama3, qwen2, gpt-2, ...):
                      checks every pre-tokenizer regex set against llama.cpp's own splitting.
  spm_synthetic.json  a small SentencePiece BPE vocabulary trained here (byte fallback,
                      user-defined and control symbols), stored whole (tokens, scores, types),
                      and the ids llama.cpp gives random strings with it, with and without
                      add_space_prefix: checks the "llama" (SPM) tokenizer.

Vocabulary-only GGUF files are written to a temporary folder with the `gguf` package and
loaded by llama.cpp with vocab_only=True. Needs the venv of README.md plus
`pip install gguf sentencepiece`.
"""

import io
import json
import os
import random
import sys
import tempfile

import llama_cpp
from gguf import GGUFReader, GGUFWriter
from llama_cpp import Llama

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
OUT = os.path.join(ROOT, "crates", "anygpu-models", "tests", "data", "smollm2")

# Pre-tokenizer names to check (each stands for a family in llama-vocab.cpp).
PRESETS = [
    "llama3", "qwen2", "gpt-2", "default", "starcoder", "tekken", "gpt-4o", "deepseek-v3",
    "deepseek-coder", "deepseek-llm", "falcon", "bloom", "viking", "qwen35", "seed-coder",
    "bailingmoe", "minicpm5", "exaone-moe", "laguna", "jais-2", "chatglm-bpe",
]
N_TEXTS = 300
N_SPM_TEXTS = 400

POOL = [
    " ", "  ", "   ", "\t", "\n", "\n\n", "\r", "\r\n", "\u00a0", "\u3000", "\u2009", "\u200b",
    "\u0085", "\x0b", "\x0c",
    "a", "b", "Z", "é", "ß", "Ω", "ж", "ñ", "ǅ", "ﬁ",
    "0", "1", "9", "٣", "½", "²", "Ⅻ", "①",
    "'", "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'LL",
    ".", ",", "!", "?", "-", "_", "(", ")", "{", "}", "[", "]", "<", ">", "$", "+", "=", "^", "~",
    "|", "`", "\\", "/", "#", "@", "%", "&", "*", ";", ":", '"',
    "你", "好", "日本", "한", "😀", "👍🏽", "❤️", "🦀", "\u0301", "\u064e", "्",
    "hello", "World", "the", "ing", "123", "4567", "x1", "HTTPServer", "camelCase",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<", "|", "im_start",
    "[INST]", "<|user|>", "<s>", "</s>", "<|end|>", "▁", " [INST] ",
    "\U0010ffff", "\ue000", "\x00", "\x01", "\x7f",
]

HP_KEYS = [
    "llama.block_count", "llama.context_length", "llama.embedding_length",
    "llama.feed_forward_length", "llama.attention.head_count", "llama.attention.head_count_kv",
    "llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon", "llama.rope.dimension_count",
]


def random_texts(n, seed):
    rng = random.Random(seed)
    return ["".join(rng.choice(POOL) for _ in range(rng.randint(1, 12))) for _ in range(n)]


def writer_with_hparams(path, src, n_vocab, name):
    w = GGUFWriter(path, "llama")
    for k in HP_KEYS:
        f = src.fields[k]
        w.add_key_value(k, f.contents(), f.types[0])
    w.add_uint32("llama.vocab_size", n_vocab)
    w.add_string("general.name", name)
    return w


def finish(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tokenize_all(path, texts):
    llm = Llama(path, vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    ids = [llm.tokenize(t.encode("utf-8"), add_bos=True, special=True) for t in texts]
    add_bos = bool(llama_cpp.llama_vocab_get_add_bos(vocab))
    del llm
    return ids, add_bos


def make_pretokenizers(tmp):
    src = GGUFReader(MODEL)
    tokens = src.fields["tokenizer.ggml.tokens"].contents()
    types = src.fields["tokenizer.ggml.token_type"].contents()
    merges = src.fields["tokenizer.ggml.merges"].contents()
    texts = random_texts(N_TEXTS, seed=7)
    presets = {}
    for pre in PRESETS:
        path = os.path.join(tmp, f"vocab-{pre}.gguf")
        w = writer_with_hparams(path, src, len(tokens), "vocab test")
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        finish(w)
        ids, add_bos = tokenize_all(path, texts)
        presets[pre] = {"add_bos": add_bos, "ids": ids}
        print(f"  {pre}: done", file=sys.stderr)
    return {
        "llama_cpp_python": llama_cpp.__version__,
        "generator": "scripts/reference/make_tokenizer_refs.py",
        "vocab": "tokens, token types and merges of " + os.path.basename(MODEL)
        + " with tokenizer.ggml.pre replaced; bos 1, eos 2, no add_bos_token key"
        + " (llama.cpp's default per pre-tokenizer applies)",
        "texts": texts,
        "presets": presets,
    }


def train_spm(corpus_path, **extra):
    import sentencepiece as spm

    m = io.BytesIO()
    spm.SentencePieceTrainer.train(
        input=corpus_path, model_writer=m, vocab_size=600, model_type="bpe",
        byte_fallback=True, character_coverage=1.0,
        user_defined_symbols=["<|user|>", "[INST]"], control_symbols=["<|end|>"],
        split_digits=True, allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        num_threads=1, minloglevel=2, **extra,
    )
    sp = spm.SentencePieceProcessor(model_proto=m.getvalue())
    toks, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        toks.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        t = 1
        if sp.is_unknown(i):
            t = 2
        elif sp.is_control(i):
            t = 3
        elif sp.is_unused(i):
            t = 5
        elif sp.is_byte(i):
            t = 6
        types.append(t)
    for u in ["<|user|>", "[INST]"]:
        types[sp.piece_to_id(u)] = 4
    return sp, toks, scores, types


def make_spm(tmp):
    src = GGUFReader(MODEL)
    with open(os.path.join(OUT, "ppl.txt"), encoding="utf-8") as f:
        text = f.read()
    extra = ("Hello world! Ünïcödé café naïve résumé. 你好，世界！日本語のテキスト。 "
             "def foo(x):\n    return x ** 2\n 1234567890 3.14 The quick brown fox. "
             "<b>bold</b> [INST] user [/INST]")
    corpus = os.path.join(tmp, "corpus.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        f.write((text + "\n" + extra + "\n") * 3)
    texts = random_texts(N_SPM_TEXTS, seed=11)
    vocabs = {}
    for name, space_prefix in [("spm", None), ("spm-no-space-prefix", False)]:
        kw = {} if space_prefix is None else {"add_dummy_prefix": False}
        sp, toks, scores, types = train_spm(corpus, **kw)
        path = os.path.join(tmp, f"vocab-{name}.gguf")
        w = writer_with_hparams(path, src, len(toks), "spm test")
        w.add_tokenizer_model("llama")
        w.add_token_list(toks)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(sp.bos_id())
        w.add_eos_token_id(sp.eos_id())
        w.add_unk_token_id(sp.unk_id())
        if space_prefix is not None:
            w.add_add_space_prefix(space_prefix)
        finish(w)
        ids, add_bos = tokenize_all(path, texts)
        vocabs[name] = {
            "spec": {
                "model": "llama",
                "tokens": toks,
                "scores": scores,
                "token_types": types,
                "bos_token_id": sp.bos_id(),
                "eos_token_id": sp.eos_id(),
                "unknown_token_id": sp.unk_id(),
                "add_space_prefix": space_prefix,
            },
            "add_bos": add_bos,
            "ids": ids,
        }
    return {
        "llama_cpp_python": llama_cpp.__version__,
        "generator": "scripts/reference/make_tokenizer_refs.py",
        "vocab": "SentencePiece BPE, 600 pieces, trained on ppl.txt and a few lines; byte fallback",
        "texts": texts,
        "vocabs": vocabs,
    }


def write(name, obj):
    path = os.path.join(OUT, name)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {os.path.relpath(path, ROOT)} ({os.path.getsize(path)} bytes)")


def main():
    if not os.path.exists(MODEL):
        sys.exit(f"{MODEL} is missing: run scripts/fetch-models.sh smollm2")
    with tempfile.TemporaryDirectory() as tmp:
        write("pretokenizers.json", make_pretokenizers(tmp))
        write("spm_synthetic.json", make_spm(tmp))


if __name__ == "__main__":
    main()
