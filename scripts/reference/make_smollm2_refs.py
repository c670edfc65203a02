#!/usr/bin/env python3
"""Reference fixtures from llama.cpp (through llama-cpp-python) for SmolLM2-135M-Instruct Q4_1.

Writes into crates/anygpu-models/tests/data/smollm2/:
  tokenize.json    hard strings -> ids (add_bos as the file says, parse_special on and off),
                   llama.cpp's detokenization, the vocabulary's special ids and EOG set
  generate.json    greedy 32-token continuations of raw and chat prompts, with the top logits
                   of every step
  perplexity.json  mean NLL / perplexity of ppl.txt read as one sequence

See README.md beside this file for how to set up the environment and re-run it.
"""

import argparse
import ctypes
import json
import math
import os
import sys

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np

import llama_cpp
from llama_cpp import Llama

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
OUT = os.path.join(ROOT, "crates", "anygpu-models", "tests", "data", "smollm2")

N_THREADS = int(os.environ.get("N_THREADS", "2"))
SEED = 1234
GEN_TOKENS = 32
TOP_K_LOGITS = 5

TOKENIZE_CASES = [
    "",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    " \n ",
    "Hello world",
    " Hello world",
    "Hello  world",
    "Hello   world   ",
    "   leading spaces",
    "trailing spaces   ",
    "hello\tworld",
    "tabs\t\tand\tspaces  \t ",
    "line1\nline2\n\nline3\n",
    "1",
    "12",
    "123",
    "1234567890",
    "3.14159",
    "In 2024, 1,000,000 people paid $19.99 each.",
    "0x1F 007 42nd 1e-9",
    "mixed123abc456",
    "def foo(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    'fn main() { println!("{}", 1 + 1); }',
    "snake_case_name camelCaseName SCREAMING_CASE",
    "https://example.com/path?q=1&r=2#frag",
    "email@example.com",
    "I'm don't we'll they've she'd it's",
    "DON'T I'M YOU'RE",
    "Hello!!! ??? ... --- ;;",
    "\"quoted\" 'single' `back`",
    "a+b=c; x<y>z | p^q ~r",
    "café naïve résumé Ångström",
    "straße Ünïcödé",
    "Ω≈ç√∫˜µ≤≥÷",
    "ﬁ ligature",
    "Greek: αβγ, Cyrillic: привет мир",
    "Arabic: مرحبا بالعالم",
    "Hindi: नमस्ते दुनिया",
    "你好，世界！",
    "日本語のテキストです。",
    "한국어 문장입니다",
    "😀",
    "👍🏽",
    "👨‍👩‍👧‍👦 family",
    "I ❤️ Rust 🦀 and 🐍",
    "\u00a0nbsp\u00a0here",
    "zero\u200bwidth",
    "a\u0000b",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "<|im_start|><|im_end|>",
    "a <|im_start|> b",
    "text<|endoftext|>more",
    "<|im_start",
    "<|im_start|>assistant\n",
    "<reponame>repo<file_sep>file.py<filename>",
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX!",
]

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
]

CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a pirate. Answer like one."},
        {"role": "user", "content": "Tell me about the sea."},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "What is 2+2?"},
    ],
]


def meta():
    return {
        "llama_cpp_python": llama_cpp.__version__,
        "model": os.path.basename(MODEL),
        "generator": "scripts/reference/make_smollm2_refs.py",
    }


def vocab_of(llm):
    return llama_cpp.llama_model_get_vocab(llm._model.model)


def detokenize(llm, ids, special=True):
    vocab = vocab_of(llm)
    arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
    size = 64 + 64 * len(ids)
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, False, special)
    if n < 0:
        raise RuntimeError("detokenize buffer too small")
    return buf.raw[:n]


def is_eog(llm, tok):
    return bool(llama_cpp.llama_vocab_is_eog(vocab_of(llm), tok))


def render_chat(template, messages, bos_token, eos_token):
    """Hugging Face's apply_chat_template rendering (transformers' chat template utils)."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=messages,
        add_generation_prompt=True,
        bos_token=bos_token,
        eos_token=eos_token,
    )


def make_tokenize(llm):
    vocab = vocab_of(llm)
    n_vocab = llm.n_vocab()
    cases = []
    for text in TOKENIZE_CASES:
        b = text.encode("utf-8")
        ids = llm.tokenize(b, add_bos=True, special=True)
        ids_plain = llm.tokenize(b, add_bos=True, special=False)
        detok = detokenize(llm, ids, special=True)
        cases.append(
            {
                "text": text,
                "ids": ids,
                "ids_parse_special_false": ids_plain,
                "detokenized": detok.decode("utf-8", errors="replace"),
                "detokenized_is_valid_utf8": _valid_utf8(detok),
            }
        )
    eog = [i for i in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)]
    return {
        **meta(),
        "add_special": True,
        "parse_special": True,
        "vocab": {
            "n_vocab": n_vocab,
            "bos": llama_cpp.llama_vocab_bos(vocab),
            "eos": llama_cpp.llama_vocab_eos(vocab),
            "eot": llama_cpp.llama_vocab_eot(vocab),
            "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
            "add_eos": bool(llama_cpp.llama_vocab_get_add_eos(vocab)),
            "eog_ids": eog,
        },
        "cases": cases,
    }


def _valid_utf8(b):
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def top_logits(row, k=TOP_K_LOGITS):
    idx = np.argsort(-row, kind="stable")[:k]
    return [[int(i), float(row[i])] for i in idx]


def last_logits(llm):
    # Without logits_all, llama-cpp-python does not copy logits into llm.scores.
    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).astype(np.float32).copy()


def greedy(llm, prompt_ids):
    llm.reset()
    llm.eval(prompt_ids)
    out, steps = [], []
    for _ in range(GEN_TOKENS):
        row = last_logits(llm)
        tok = int(np.argmax(row))
        steps.append(top_logits(row))
        out.append(tok)
        if is_eog(llm, tok):
            break
        llm.eval([tok])
    return out, steps


def make_generate(llm, template, bos_text, eos_text):
    items = []
    for p in RAW_PROMPTS:
        ids = llm.tokenize(p.encode("utf-8"), add_bos=True, special=True)
        gen, steps = greedy(llm, ids)
        items.append(_gen_item(llm, "raw", None, p, ids, gen, steps))
    for msgs in CHAT_PROMPTS:
        text = render_chat(template, msgs, bos_text, eos_text)
        ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        gen, steps = greedy(llm, ids)
        items.append(_gen_item(llm, "chat", msgs, text, ids, gen, steps))
    return {
        **meta(),
        "sampling": "greedy (argmax of the logits, temperature 0), stop at end-of-generation",
        "max_new_tokens": GEN_TOKENS,
        "seed": SEED,
        "n_ctx": llm.n_ctx(),
        "chat_template_rendering": "jinja2 ImmutableSandboxedEnvironment(trim_blocks, lstrip_blocks, loopcontrols), add_generation_prompt=True",
        "items": items,
    }


def _gen_item(llm, kind, messages, prompt_text, prompt_ids, gen, steps):
    text = detokenize(llm, gen, special=False)
    return {
        "kind": kind,
        "messages": messages,
        "prompt_text": prompt_text,
        "prompt_ids": prompt_ids,
        "generated_ids": gen,
        "stopped_at_eog": bool(gen) and is_eog(llm, gen[-1]),
        "text": text.decode("utf-8", errors="replace"),
        "top_logits": steps,
    }


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def make_perplexity(text):
    probe = Llama(MODEL, vocab_only=True, verbose=False)
    ids = probe.tokenize(text.encode("utf-8"), add_bos=True, special=True)
    del probe
    n = len(ids)
    n_ctx = max(512, 1 << (n - 1).bit_length())
    llm = Llama(
        MODEL,
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_ubatch=n_ctx,
        logits_all=True,
        seed=SEED,
        n_threads=N_THREADS,
        n_threads_batch=N_THREADS,
        verbose=False,
    )
    llm.reset()
    llm.eval(ids)
    logits = np.array(llm.scores[:n], dtype=np.float32)
    lsm = log_softmax(logits[:-1])
    nll = -lsm[np.arange(n - 1), np.array(ids[1:])]
    mean = float(nll.mean())
    return {
        **meta(),
        "text_file": "ppl.txt",
        "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab_of(llm))),
        "method": "one sequence; token i (i >= 1) scored by log-softmax of the logits at i-1",
        "n_ctx": n_ctx,
        "n_tokens": n,
        "n_scored": int(n - 1),
        "mean_nll": mean,
        "perplexity": math.exp(mean),
        "ids": ids,
        "nll": [round(float(v), 6) for v in nll],
    }


def write(name, obj):
    path = os.path.join(OUT, name)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {os.path.relpath(path, ROOT)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["tokenize", "generate", "perplexity"], action="append")
    args = ap.parse_args()
    only = set(args.only or ["tokenize", "generate", "perplexity"])
    if not os.path.exists(MODEL):
        sys.exit(f"{MODEL} is missing: run scripts/fetch-models.sh smollm2")
    os.makedirs(OUT, exist_ok=True)

    llm = Llama(
        MODEL,
        n_ctx=2048,
        n_batch=512,
        seed=SEED,
        n_threads=N_THREADS,
        n_threads_batch=N_THREADS,
        verbose=False,
    )
    if "tokenize" in only:
        write("tokenize.json", make_tokenize(llm))
    if "generate" in only:
        template = llm.metadata["tokenizer.chat_template"]
        vocab = vocab_of(llm)
        bos = llm._model.token_get_text(llama_cpp.llama_vocab_bos(vocab))
        eos = llm._model.token_get_text(llama_cpp.llama_vocab_eos(vocab))
        write("generate.json", make_generate(llm, template, bos, eos))
    if "perplexity" in only:
        with open(os.path.join(OUT, "ppl.txt"), encoding="utf-8") as f:
            text = f.read()
        write("perplexity.json", make_perplexity(text))


if __name__ == "__main__":
    main()
