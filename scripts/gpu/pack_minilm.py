#!/usr/bin/env python3
"""Packs all-MiniLM-L6-v2 for the GPU machine, whose calls carry at most 64 MiB.

The folder is 87 MiB, nearly all of it model.safetensors in f32 (90.9 MB). This writes
.dev/minilm-f16/ (git-ignored, ~46 MB): model.safetensors with the same tensor names and
shapes in F16, and the small files both sides read (config.json, tokenizer.json,
tokenizer_config.json, special_tokens_map.json, modules.json, sentence_bert_config.json,
config_sentence_transformers.json, 1_Pooling/config.json). vocab.txt, the README and
data_config.json stay behind (tokenizer.json holds the vocabulary).

Both sides compute in f32 from these weights: anygpu's safetensors loader upcasts F16 to f32
at load, scripts/gpu/minilm_torch.py and sentence-transformers (`model.float()`) do the same.
The weights differ from the f32 checkpoint by f16 rounding (relative 2^-11), which changes
the embeddings in the 3rd-4th digit and the speed not at all: fine for the throughput
benchmark, not for parity tests.

    python3 scripts/gpu/pack_minilm.py [--src models/all-MiniLM-L6-v2] [--out .dev/minilm-f16]

Needs only the standard library (numpy, when present, makes it faster); no network.
"""

import argparse
import json
import os
import shutil
import struct
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SMALL = [
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
    os.path.join("1_Pooling", "config.json"),
]


def read_safetensors(path):
    """(header dict without __metadata__, metadata, data bytes) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", None)
    return header, meta, data


def f32_to_f16(raw):
    """Little-endian f32 bytes to little-endian f16 bytes (round to nearest even)."""
    try:
        import numpy as np

        a = np.frombuffer(raw, dtype="<f4")
        if np.isfinite(a).all() and np.abs(a).max(initial=0) > 65504:
            raise SystemExit("a weight exceeds the f16 range (65504): packing in f16 would give inf")
        return a.astype("<f2").tobytes()
    except ImportError:
        n = len(raw) // 4
        vals = struct.unpack(f"<{n}f", raw)
        if any(abs(v) > 65504 for v in vals):
            raise SystemExit("a weight exceeds the f16 range (65504): packing in f16 would give inf")
        return struct.pack(f"<{n}e", *vals)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", default=os.path.join(ROOT, "models", "all-MiniLM-L6-v2"))
    ap.add_argument("--out", default=os.path.join(ROOT, ".dev", "minilm-f16"))
    args = ap.parse_args()

    src = os.path.join(args.src, "model.safetensors")
    if not os.path.exists(src):
        sys.exit(f"{src} is missing: run scripts/fetch-models.sh minilm first")
    header, meta, data = read_safetensors(src)
    out_header, chunks, off = {}, [], 0
    # Keep the file's order of tensors (by offset), converting F32 and copying anything else.
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        b, e = info["data_offsets"]
        raw = data[b:e]
        dtype = info["dtype"]
        if dtype == "F32":
            raw, dtype = f32_to_f16(raw), "F16"
        out_header[name] = {"dtype": dtype, "shape": info["shape"], "data_offsets": [off, off + len(raw)]}
        chunks.append(raw)
        off += len(raw)
    meta = dict(meta or {})
    meta["anygpu_note"] = "F16 copy of an F32 checkpoint made by scripts/gpu/pack_minilm.py (benchmarks only)"
    out_header["__metadata__"] = meta
    hjson = json.dumps(out_header, separators=(",", ":")).encode()
    hjson += b" " * (-len(hjson) % 8)  # the data section starts 8-byte aligned

    os.makedirs(os.path.join(args.out, "1_Pooling"), exist_ok=True)
    dst = os.path.join(args.out, "model.safetensors")
    with open(dst + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for c in chunks:
            f.write(c)
    os.replace(dst + ".tmp", dst)
    for rel in SMALL:
        p = os.path.join(args.src, rel)
        if os.path.exists(p):
            shutil.copyfile(p, os.path.join(args.out, rel))
        elif rel in ("config.json", "tokenizer.json"):
            sys.exit(f"{p} is missing")
    total = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(args.out) for f in fs)
    print(f"wrote {args.out}: {len(header)} tensors in F16, {os.path.getsize(dst) / 1e6:.1f} MB "
          f"(from {os.path.getsize(src) / 1e6:.1f} MB); folder {total / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
