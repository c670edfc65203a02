#!/usr/bin/env python3
"""Writes the hostile safetensors files of crates/anygpu-models/tests/data/safetensors-hostile/.

Each file breaks one rule of the format (or lies about one size); the test
crates/anygpu-models/tests/safetensors_hostile.rs holds the table of file -> expected error text.
Also a tiny BERT checkpoint (tiny_bert_config.json + tiny_bert.safetensors, hidden size 4, one
layer) and broken copies of it (a tensor missing, a tensor of the wrong shape) for the model
loader's errors. Stdlib only. Run from anywhere: python3 scripts/make_hostile_safetensors.py
"""

import json
import os
import struct

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "anygpu-models", "tests",
                   "data", "safetensors-hostile")


def header_bytes(header):
    h = json.dumps(header, separators=(",", ":")).encode() if not isinstance(header, bytes) else header
    h += b" " * (-len(h) % 8)  # pad to 8 bytes as the reference writer does
    return h


def st(header, data=b"", n=None):
    """A file: 8-byte header length (n overrides it), the header, the data."""
    h = header_bytes(header)
    return struct.pack("<Q", len(h) if n is None else n) + h + data


def f32s(*vals):
    return struct.pack(f"<{len(vals)}f", *vals)


def info(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def two(a=None, b=None, data=None):
    """The control file's two tensors, with overrides: 'a' F32 [2, 2] then 'b' F32 [3]."""
    hdr = {"__metadata__": {"format": "pt"},
           "a": a or info("F32", [2, 2], 0, 16),
           "b": b or info("F32", [3], 16, 28)}
    return st(hdr, f32s(1, 2, 3, 4, 5, 6, 7) if data is None else data)


def tiny_bert():
    """A valid 1-layer BERT (vocab 8, hidden 4, 2 heads, intermediate 8, 6 positions)."""
    v, c, f, p = 8, 4, 8, 6
    shapes = {
        "embeddings.word_embeddings.weight": [v, c],
        "embeddings.position_embeddings.weight": [p, c],
        "embeddings.token_type_embeddings.weight": [2, c],
        "embeddings.LayerNorm.weight": [c],
        "embeddings.LayerNorm.bias": [c],
    }
    pre = "encoder.layer.0."
    for n in ("query", "key", "value"):
        shapes[f"{pre}attention.self.{n}.weight"] = [c, c]
        shapes[f"{pre}attention.self.{n}.bias"] = [c]
    shapes.update({
        f"{pre}attention.output.dense.weight": [c, c],
        f"{pre}attention.output.dense.bias": [c],
        f"{pre}attention.output.LayerNorm.weight": [c],
        f"{pre}attention.output.LayerNorm.bias": [c],
        f"{pre}intermediate.dense.weight": [f, c],
        f"{pre}intermediate.dense.bias": [f],
        f"{pre}output.dense.weight": [c, f],
        f"{pre}output.dense.bias": [c],
        f"{pre}output.LayerNorm.weight": [c],
        f"{pre}output.LayerNorm.bias": [c],
    })
    config = {"model_type": "bert", "vocab_size": v, "hidden_size": c, "num_hidden_layers": 1,
              "num_attention_heads": 2, "intermediate_size": f, "hidden_act": "gelu",
              "max_position_embeddings": p, "type_vocab_size": 2, "layer_norm_eps": 1e-12}
    return config, shapes


def tiny_bert_file(shapes):
    header, data, seed = {"__metadata__": {"format": "pt"}}, b"", 1
    for name, shape in shapes.items():
        n = 1
        for d in shape:
            n *= d
        vals = []
        for _ in range(n):
            seed = (seed * 1103515245 + 12345) % (1 << 31)
            vals.append((seed % 1000) / 1000.0 - 0.5)
        if name.endswith("LayerNorm.weight"):
            vals = [1.0] * n
        header[name] = info("F32", shape, len(data), len(data) + 4 * n)
        data += f32s(*vals)
    return st(header, data)


def main():
    os.makedirs(OUT, exist_ok=True)
    files = {
        "control.safetensors": two(),
        "empty.safetensors": b"",
        "short.safetensors": b"\x05\x00\x00\x00\x00",
        "header_len_huge.safetensors": st({}, n=1 << 63),
        "header_len_past_end.safetensors": st({"a": info("F32", [1], 0, 4)}, f32s(1), n=1000),
        "header_not_utf8.safetensors": st(b'{"\xff\xfe":1}'),
        "header_not_json.safetensors": st(b'{"a": {"dtype": "F32",'),
        "header_not_object.safetensors": st(b"[1, 2, 3]"),
        "unknown_dtype.safetensors": two(a=info("F33", [2, 2], 0, 16)),
        "negative_dim.safetensors": two(a=info("F32", [2, -2], 0, 16)),
        "offsets_not_pair.safetensors": two(a={"dtype": "F32", "shape": [2, 2], "data_offsets": [0]}),
        "size_mismatch.safetensors": two(a=info("F32", [2, 3], 0, 16)),
        "overlapping_offsets.safetensors": two(b=info("F32", [3], 8, 20), data=f32s(1, 2, 3, 4, 5)),
        "gap_between_tensors.safetensors": two(b=info("F32", [3], 20, 32), data=f32s(*range(8))),
        "reversed_offsets.safetensors": two(b=info("F32", [3], 28, 16)),
        "offsets_past_end.safetensors": two(b=info("F32", [3], 16, 28), data=f32s(1, 2, 3, 4, 5, 6)),
        "trailing_bytes.safetensors": two(data=f32s(*range(9))),
        "shape_overflow.safetensors": two(b=info("F32", [1 << 40, 1 << 40], 16, 28)),
        "duplicate_name.safetensors": st(b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
                                         b'"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', f32s(1, 2)),
        # the same name twice with the same offsets: consistent, but ambiguous
        "duplicate_name_same_offsets.safetensors": st(b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
                                                      b'"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
                                                      f32s(1)),
        "metadata_not_strings.safetensors": st({"__metadata__": {"n": 1}, "a": info("F32", [1], 0, 4)}, f32s(1)),
        "int64_tensor.safetensors": st({"a": info("I64", [2], 0, 16)}, struct.pack("<2q", 1, 2)),
    }
    config, shapes = tiny_bert()
    files["tiny_bert.safetensors"] = tiny_bert_file(shapes)
    missing = dict(shapes)
    del missing["encoder.layer.0.output.dense.bias"]
    files["tiny_bert_missing_tensor.safetensors"] = tiny_bert_file(missing)
    wrong = dict(shapes)
    wrong["encoder.layer.0.intermediate.dense.weight"] = [4, 8]  # transposed: [in, out]
    files["tiny_bert_wrong_shape.safetensors"] = tiny_bert_file(wrong)
    for name, data in files.items():
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data)
    with open(os.path.join(OUT, "tiny_bert_config.json"), "w") as f:
        json.dump(config, f, indent=1)
        f.write("\n")
    print(f"wrote {len(files) + 1} files to {os.path.normpath(OUT)}")


if __name__ == "__main__":
    main()
