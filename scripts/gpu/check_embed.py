#!/usr/bin/env python3
"""Embeddings of the test fixture's sentences by `anygpu embed` against sentence-transformers'
own vectors (crates/anygpu-models/tests/data/minilm/embeddings.json, made by
scripts/reference/make_minilm_refs.py): the issue's accuracy bar, cosine >= 0.999, checked on
whatever device anygpu picks (the GPU machine: the tensor-core path). Plain Python, no numpy.

usage: check_embed.py ANYGPU MODEL_DIR [extra anygpu embed args...]
"""
import json
import math
import subprocess
import sys

FIXTURE = "crates/anygpu-models/tests/data/minilm/embeddings.json"


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    anygpu, model, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
    cases = json.load(open(FIXTURE))["cases"]
    texts = [c["text"] for c in cases]
    cmd = [anygpu, "embed", "-m", model, "--json", "--batch-size", "8", *extra, "--", *texts]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"anygpu embed failed ({out.returncode}): {out.stderr[-2000:]}")
    got = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    if len(got) != len(cases):
        sys.exit(f"{len(got)} embeddings for {len(cases)} inputs")
    worst = (2.0, "")
    for c, v in zip(cases, got):
        w = c["embedding"]
        dot = sum(a * b for a, b in zip(v, w))
        cos = dot / (math.sqrt(sum(a * a for a in v)) * math.sqrt(sum(b * b for b in w)))
        worst = min(worst, (cos, c["text"][:40]))
    info = [l for l in out.stderr.splitlines() if "loaded in" in l]
    print(info[-1] if info else "")
    print(f"check_embed: {len(cases)} sentences, worst cosine {worst[0]:.6f} ({worst[1]!r}) against sentence-transformers")
    sys.exit(0 if worst[0] >= 0.999 else 1)


if __name__ == "__main__":
    main()
