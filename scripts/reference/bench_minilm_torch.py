#!/usr/bin/env python3
"""PyTorch baseline for `anygpu bench embed`: sentences per second of sentence-transformers'
all-MiniLM-L6-v2 (fp32) for BATCH sentences of exactly SEQ tokens ([CLS] + random word pieces +
[SEP], no padding), like `anygpu bench embed` (anygpu_models::bert::bench_embed).

Two figures: `model` (the encoder + pooling + normalisation on pre-tokenized ids, what
bench_embed times) and `encode` (SentenceTransformer.encode on texts that tokenize to SEQ
tokens: tokenization included).

    .venv/bin/python scripts/reference/bench_minilm_torch.py --batch 64 --seq 128 --reps 5 --threads 2
    MODEL_DIR=.dev/minilm-f16 python3 scripts/reference/bench_minilm_torch.py --device cuda   # an F16 copy works

scripts/gpu/minilm_torch.py is the same forward in plain PyTorch, for machines without
sentence-transformers; scripts/gpu/run_embed_bench.sh runs both beside `anygpu bench embed`.
"""

import argparse
import os
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MODEL = os.environ.get("MODEL_DIR", os.path.join(ROOT, "models", "all-MiniLM-L6-v2"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder: never reach the network
    import torch
    from sentence_transformers import SentenceTransformer

    if args.threads:
        torch.set_num_threads(args.threads)
    # fp32 means fp32: no TF32 tensor-core products (PyTorch's default for matmul, said again).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:  # load straight in fp32 (transformers >= 4.56 calls it `dtype`)
        model = SentenceTransformer(MODEL, device=args.device, model_kwargs={"dtype": torch.float32})
    except (TypeError, ValueError):
        model = SentenceTransformer(MODEL, device=args.device)
    model = model.float().eval()  # fp32 whatever the checkpoint's dtype
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, model.tokenizer.vocab_size, (args.batch, args.seq), generator=g)
    ids[:, 0], ids[:, -1] = model.tokenizer.cls_token_id, model.tokenizer.sep_token_id
    feats = {
        "input_ids": ids.to(args.device),
        "attention_mask": torch.ones_like(ids).to(args.device),
        "token_type_ids": torch.zeros_like(ids).to(args.device),
    }
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    def run_model():
        with torch.inference_mode():
            out = model(dict(feats))["sentence_embedding"]
            return out.cpu()

    run_model()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.reps):
        run_model()
    sync()
    model_sps = args.batch * args.reps / (time.perf_counter() - t0)

    # Texts of SEQ tokens: the ids decoded, each word piece re-tokenizing to itself is not
    # guaranteed, so use a word that is one piece.
    texts = [" ".join(["word"] * (args.seq - 2))] * args.batch
    model.encode(texts, batch_size=args.batch)
    t0 = time.perf_counter()
    for _ in range(args.reps):
        model.encode(texts, batch_size=args.batch)
    sync()
    encode_sps = args.batch * args.reps / (time.perf_counter() - t0)
    print(f"torch {torch.__version__} on {args.device}, {torch.get_num_threads()} threads: "
          f"{args.batch} x {args.seq} tokens: model {model_sps:.1f} sentences/s, encode {encode_sps:.1f} sentences/s")


if __name__ == "__main__":
    main()
