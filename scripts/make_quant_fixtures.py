#!/usr/bin/env python3
"""Fixtures for anygpu's GGML block-format tests, made by an independent implementation.

For every type anygpu reads, writes to crates/anygpu-core/tests/data/quant/:
  <TYPE>.bin  raw block bytes: ROWS rows of BLOCKS_PER_ROW blocks, random but valid
              (random bytes, with every f16 scale field replaced by a sane finite value so the
              weights are finite and not all huge);
  <TYPE>.f32  gguf-py's dequantization of those bytes, little-endian f32.
And where gguf-py can quantize a type:
  <TYPE>.quant.bin  gguf-py's quantization of random floats (<TYPE>.quant.f32 is its
                    dequantization), so the tests check our dequantizer against bytes made by
                    a real quantizer as well as by the random generator.

Usage: pip install gguf numpy && python3 scripts/make_quant_fixtures.py
The seed is fixed, so rerunning rewrites the same files.
"""

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants

OUT = Path(__file__).resolve().parent.parent / "crates/anygpu-core/tests/data/quant"
ROWS = 2

# name -> (type, bytes per block, weights per block, blocks per row, byte offsets of f16 fields)
TYPES = {
    "F32": (T.F32, 4, 1, 64, []),
    "F16": (T.F16, 2, 1, 64, []),
    "BF16": (T.BF16, 2, 1, 64, []),
    "Q4_0": (T.Q4_0, 18, 32, 4, [0]),
    "Q4_1": (T.Q4_1, 20, 32, 4, [0, 2]),
    "Q5_0": (T.Q5_0, 22, 32, 4, [0]),
    "Q5_1": (T.Q5_1, 24, 32, 4, [0, 2]),
    "Q8_0": (T.Q8_0, 34, 32, 4, [0]),
    "Q2_K": (T.Q2_K, 84, 256, 2, [80, 82]),
    "Q3_K": (T.Q3_K, 110, 256, 2, [108]),
    "Q4_K": (T.Q4_K, 144, 256, 2, [0, 2]),
    "Q5_K": (T.Q5_K, 176, 256, 2, [0, 2]),
    "Q6_K": (T.Q6_K, 210, 256, 2, [208]),
}

QUANTIZABLE = ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]


def random_blocks(rng, name):
    qtype, type_size, block_size, per_row, f16_fields = TYPES[name]
    n_blocks = ROWS * per_row
    if name == "F32":
        return rng.normal(0, 1, n_blocks).astype("<f4").view(np.uint8)
    if name == "F16":
        values = rng.normal(0, 1, n_blocks).astype("<f2")
        # Zeros of both signs, subnormals and the largest finite value, for the edge cases of
        # f16 -> f32 conversion.
        values[:6] = np.array([0.0, -0.0, 6e-8, -3.05e-5, 65504.0, -65504.0], dtype="<f2")
        return values.view(np.uint8)
    if name == "BF16":
        return quants.quantize(rng.normal(0, 1, n_blocks).astype(np.float32), qtype).view(np.uint8)
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for off in f16_fields:
        scale = rng.normal(0, 0.05, n_blocks).astype("<f2")
        raw[:, off : off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(-1)


def write(name, data, values):
    (OUT / f"{name}.bin").write_bytes(np.ascontiguousarray(data).tobytes())
    (OUT / f"{name}.f32").write_bytes(np.asarray(values, dtype="<f4").tobytes())


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(20240611)
    for name, (qtype, type_size, block_size, per_row, _) in TYPES.items():
        data = random_blocks(rng, name)
        assert data.size == ROWS * per_row * type_size, name
        values = quants.dequantize(data.reshape(ROWS, per_row * type_size), qtype).reshape(-1)
        assert values.size == ROWS * per_row * block_size, name
        assert np.all(np.isfinite(values)), name
        write(name, data, values)
        print(f"{name:5} {data.size:5} bytes -> {values.size:4} values, max |w| {np.abs(values).max():.3g}")

    for name in QUANTIZABLE:
        qtype, _, block_size, per_row, _ = TYPES[name]
        floats = rng.normal(0, 1, (ROWS, per_row * block_size)).astype(np.float32)
        data = quants.quantize(floats, qtype).view(np.uint8).reshape(-1)
        values = quants.dequantize(data.reshape(ROWS, -1), qtype).reshape(-1)
        err = np.abs(values - floats.reshape(-1)).max()
        write(f"{name}.quant", data, values)
        print(f"{name:5} quantized by gguf-py: {data.size:5} bytes, max |error| {err:.3g}")


if __name__ == "__main__":
    main()
