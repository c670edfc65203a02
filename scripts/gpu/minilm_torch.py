#!/usr/bin/env python3
"""all-MiniLM-L6-v2 in plain PyTorch (no transformers, no sentence-transformers, no safetensors
package): the PyTorch fp32 baseline of `anygpu bench embed` where those packages may be missing.

It is Hugging Face's BertModel forward (embeddings + LayerNorm, post-norm encoder layers with
erf GELU, attention through F.scaled_dot_product_attention as transformers' default "sdpa"
path does) followed by sentence-transformers' pooling (mean over tokens, L2 normalisation,
as modules.json and 1_Pooling/config.json say), on weights read straight from
model.safetensors (F32, F16 or BF16, computed in f32).

    python3 scripts/gpu/minilm_torch.py -m .dev/minilm-f16 --device cuda --batch 64 --seq 128 --reps 20
    python3 scripts/gpu/minilm_torch.py -m models/all-MiniLM-L6-v2 --check   # vs sentence-transformers

The timed work matches anygpu's `bench embed` (anygpu_models::bert::bench_embed): BATCH
sentences of exactly SEQ tokens ([CLS], word pieces with ids >= 1000, [SEP]; no padding),
ids copied to the device, forward, pooling, normalisation, vectors copied back; one untimed
warm-up, then REPS timed runs. `--check` embeds a padded batch with this code and with
sentence-transformers (when installed) and prints the largest difference.
"""

import argparse
import json
import math
import os
import struct
import sys
import time

import torch
import torch.nn.functional as F

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def load_safetensors(path):
    """{name: f32 tensor on the CPU} from a safetensors file, parsed by hand."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = bytearray(f.read())
    header.pop("__metadata__", None)
    out = {}
    for name, info in header.items():
        if info["dtype"] not in DTYPES:
            continue
        b, e = info["data_offsets"]
        t = torch.frombuffer(data, dtype=DTYPES[info["dtype"]], count=(e - b) // DTYPES[info["dtype"]].itemsize,
                             offset=b) if e > b else torch.empty(0, dtype=DTYPES[info["dtype"]])
        out[name] = t.reshape(info["shape"]).to(torch.float32)
    return out


class MiniLM:
    """BERT encoder + sentence-transformers pooling, from a model folder."""

    def __init__(self, folder, device):
        with open(os.path.join(folder, "config.json")) as f:
            cfg = json.load(f)
        self.c = cfg["hidden_size"]
        self.h = cfg["num_attention_heads"]
        self.d = self.c // self.h
        self.eps = cfg.get("layer_norm_eps", 1e-12)
        act = cfg.get("hidden_act", "gelu")
        self.act = {"gelu": F.gelu, "relu": F.relu}.get(act, lambda x: F.gelu(x, approximate="tanh"))
        w = load_safetensors(os.path.join(folder, "model.safetensors"))
        pre = "bert." if "bert.embeddings.word_embeddings.weight" in w else ""

        def get(name):
            t = w.get(pre + name)
            if t is None and name.endswith(".weight") and "LayerNorm" in name:
                t = w.get(pre + name[: -len("weight")] + "gamma")
            if t is None and name.endswith(".bias") and "LayerNorm" in name:
                t = w.get(pre + name[: -len("bias")] + "beta")
            if t is None:
                sys.exit(f"{folder}: tensor {pre + name} missing")
            return t.to(device)

        self.word = get("embeddings.word_embeddings.weight")
        self.pos = get("embeddings.position_embeddings.weight")
        self.typ = get("embeddings.token_type_embeddings.weight")
        self.emb_ln = (get("embeddings.LayerNorm.weight"), get("embeddings.LayerNorm.bias"))
        self.layers = []
        for i in range(cfg["num_hidden_layers"]):
            p = f"encoder.layer.{i}."
            self.layers.append({
                # Q, K, V stacked: one product, as anygpu does (and as fast as three here).
                "w_qkv": torch.cat([get(p + f"attention.self.{n}.weight") for n in ("query", "key", "value")]),
                "b_qkv": torch.cat([get(p + f"attention.self.{n}.bias") for n in ("query", "key", "value")]),
                "w_o": get(p + "attention.output.dense.weight"), "b_o": get(p + "attention.output.dense.bias"),
                "ln1": (get(p + "attention.output.LayerNorm.weight"), get(p + "attention.output.LayerNorm.bias")),
                "w_in": get(p + "intermediate.dense.weight"), "b_in": get(p + "intermediate.dense.bias"),
                "w_out": get(p + "output.dense.weight"), "b_out": get(p + "output.dense.bias"),
                "ln2": (get(p + "output.LayerNorm.weight"), get(p + "output.LayerNorm.bias")),
            })
        self.pooling, self.normalize = read_pipeline(folder)
        with open(os.path.join(folder, "tokenizer.json")) as f:
            vocab = json.load(f)["model"]["vocab"]
        self.vocab_size = cfg["vocab_size"]
        self.cls, self.sep = vocab.get("[CLS]", 101), vocab.get("[SEP]", 102)

    @torch.inference_mode()
    def embed(self, ids, mask=None):
        """[B, T] int64 ids (and a [B, T] 0/1 mask for padded batches) -> [B, dim] embeddings."""
        b, t = ids.shape
        c, h, d = self.c, self.h, self.d
        x = self.word[ids] + self.pos[:t] + self.typ[0]
        x = F.layer_norm(x, (c,), *self.emb_ln, self.eps)
        attn_mask = None
        if mask is not None:
            attn_mask = torch.zeros(b, 1, 1, t, device=ids.device)
            attn_mask.masked_fill_(mask[:, None, None, :] == 0, torch.finfo(torch.float32).min)
        for L in self.layers:
            qkv = F.linear(x, L["w_qkv"], L["b_qkv"]).view(b, t, 3, h, d).permute(2, 0, 3, 1, 4)
            ctx = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=attn_mask)
            ctx = ctx.transpose(1, 2).reshape(b, t, c)
            x = F.layer_norm(x + F.linear(ctx, L["w_o"], L["b_o"]), (c,), *L["ln1"], self.eps)
            inner = self.act(F.linear(x, L["w_in"], L["b_in"]))
            x = F.layer_norm(x + F.linear(inner, L["w_out"], L["b_out"]), (c,), *L["ln2"], self.eps)
        m = torch.ones(b, t, device=x.device) if mask is None else mask.to(x.dtype)
        parts = []
        if self.pooling.get("pooling_mode_cls_token"):
            parts.append(x[:, 0])
        if self.pooling.get("pooling_mode_max_tokens"):
            parts.append(x.masked_fill(m[..., None] == 0, -1e9).max(dim=1).values)
        lens = m.sum(1, keepdim=True).clamp(min=1e-9)
        if self.pooling.get("pooling_mode_mean_tokens"):
            parts.append((x * m[..., None]).sum(1) / lens)
        if self.pooling.get("pooling_mode_mean_sqrt_len_tokens"):
            parts.append((x * m[..., None]).sum(1) / lens.sqrt())
        out = torch.cat(parts, dim=1)
        return F.normalize(out, dim=-1) if self.normalize else out


def read_pipeline(folder):
    """(pooling config dict, normalize?) from modules.json / 1_Pooling/config.json; mean pooling
    without normalisation for a plain BERT folder."""
    pooling, normalize = {"pooling_mode_mean_tokens": True}, False
    mpath = os.path.join(folder, "modules.json")
    if os.path.exists(mpath):
        with open(mpath) as f:
            modules = json.load(f)
        for mod in modules:
            kind = mod.get("type", "")
            if kind.endswith("Pooling"):
                with open(os.path.join(folder, mod.get("path", "1_Pooling"), "config.json")) as f:
                    pooling = json.load(f)
            if kind.endswith("Normalize"):
                normalize = True
    return pooling, normalize


def bench_ids(model, batch, seq, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, model.vocab_size, (batch, seq), generator=g)
    ids[:, 0], ids[:, -1] = model.cls, model.sep
    return ids


def check(model, folder, device):
    """This forward against sentence-transformers' on a padded batch of random ids."""
    try:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer
    except ImportError:
        print("check: sentence-transformers is not installed; nothing to compare with")
        return
    st = SentenceTransformer(folder, device=device).float().eval()
    lens = [128, 100, 37, 5, 2, 128, 64, 90]
    ids = bench_ids(model, len(lens), max(lens), seed=1)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lens):
        mask[i, :n] = 1
        ids[i, n - 1] = model.sep
        ids[i, n:] = 0
    ours = model.embed(ids.to(device), mask.to(device)).cpu()
    with torch.inference_mode():
        feats = {"input_ids": ids.to(device), "attention_mask": mask.to(device),
                 "token_type_ids": torch.zeros_like(ids).to(device)}
        theirs = st(feats)["sentence_embedding"].float().cpu()
    diff = (ours - theirs).abs().max().item()
    cos = F.cosine_similarity(ours, theirs, dim=1).min().item()
    print(f"check vs sentence-transformers on {device} (padded batch, lengths {lens}): "
          f"largest element difference {diff:.2e}, smallest cosine {cos:.8f}")
    if cos < 0.99999:
        sys.exit("check FAILED: the plain-PyTorch forward does not match sentence-transformers")


def main():
    ap = argparse.ArgumentParser(description="all-MiniLM-L6-v2 in plain PyTorch: throughput (or --check)")
    ap.add_argument("-m", "--model", required=True, help="model folder (config.json, model.safetensors, tokenizer.json)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--check", action="store_true", help="compare with sentence-transformers instead of timing")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    # fp32 means fp32: no TF32 tensor-core products (PyTorch's default for matmul, said again).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    model = MiniLM(args.model, args.device)
    if args.check:
        check(model, args.model, args.device)
        return
    ids = bench_ids(model, args.batch, args.seq)
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def run():
        return model.embed(ids.to(args.device)).cpu()

    run()
    sync()
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - t0)
    sps = args.batch * len(times) / sum(times)
    name = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads"
    row = {"impl": "plain PyTorch", "torch": torch.__version__, "device": name, "batch": args.batch,
           "seq": args.seq, "reps": len(times), "sentences_per_s": sps,
           "ms_mean": 1e3 * sum(times) / len(times), "ms_min": 1e3 * min(times), "ms_max": 1e3 * max(times)}
    if args.json:
        print(json.dumps(row))
    else:
        print(f"plain PyTorch {torch.__version__} fp32 on {name}: {args.batch} x {args.seq} tokens: "
              f"{sps:.1f} sentences/s ({row['ms_mean']:.1f} ms per batch, best {row['ms_min']:.1f}, "
              f"worst {row['ms_max']:.1f}; {len(times)} runs)")


if __name__ == "__main__":
    main()
