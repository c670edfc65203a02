#!/usr/bin/env python3
"""Writes the hostile GGUF files of crates/anygpu-models/tests/data/gguf-hostile/.

Each file breaks one rule of the format (or lies about one size); the test
crates/anygpu-models/tests/gguf_hostile.rs holds the table of file -> expected error text.
Stdlib only. Run from anywhere: python3 scripts/make_hostile_gguf.py
"""

import os
import struct

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "anygpu-models", "tests",
                   "data", "gguf-hostile")

# gguf value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
# ggml tensor types
T_F32, T_F16, T_Q4_0 = 0, 1, 2


def u32(v):
    return struct.pack("<I", v)


def i32(v):
    return struct.pack("<i", v)


def u64(v):
    return struct.pack("<Q", v)


def f32(v):
    return struct.pack("<f", v)


def gstr(s):
    b = s.encode() if isinstance(s, str) else s
    return u64(len(b)) + b


def kv(key, vtype, payload):
    return gstr(key) + u32(vtype) + payload


def arr(elem_type, count, payload):
    return u32(elem_type) + u64(count) + payload


def tinfo(name, dims, ttype, offset, n_dims=None):
    n = len(dims) if n_dims is None else n_dims
    return gstr(name) + u32(n) + b"".join(u64(d) for d in dims) + u32(ttype) + u64(offset)


def gguf(kvs=(), tensors=(), data=b"", version=3, n_tensors=None, n_kv=None, magic=b"GGUF", alignment=32):
    head = magic + u32(version)
    head += u64(len(tensors) if n_tensors is None else n_tensors)
    head += u64(len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(tensors)
    body += b"\0" * (-len(body) % alignment)
    return body + data


ARCH = kv("general.architecture", STRING, gstr("llama"))
# Two f32 tensors of 8 elements (32 bytes each), back to back.
A = tinfo("a", [8], T_F32, 0)
B = tinfo("b", [8], T_F32, 32)
DATA = bytes(range(64))


def control():
    return gguf([ARCH], [A, B], DATA)


def files():
    valid = control()
    yield "control.gguf", valid

    # header
    yield "empty.gguf", b""
    yield "bad_magic.gguf", gguf([ARCH], [A, B], DATA, magic=b"GGML")
    yield "version_1.gguf", gguf([ARCH], [A, B], DATA, version=1)
    yield "version_4.gguf", gguf([ARCH], [A, B], DATA, version=4)
    yield "version_big_endian.gguf", gguf([ARCH], [A, B], DATA, version=0x03000000)
    yield "huge_tensor_count.gguf", gguf([ARCH], [A, B], DATA, n_tensors=2**63)
    yield "huge_metadata_count.gguf", gguf([ARCH], [A, B], DATA, n_kv=2**62)
    yield "counts_too_big_together.gguf", gguf([ARCH], [A, B], DATA, n_tensors=2, n_kv=(len(valid) - 24) // 13)

    # metadata
    yield "huge_key_length.gguf", gguf([u64(2**63) + b"general.architecture" + u32(STRING) + gstr("llama")])
    yield "huge_string_length.gguf", gguf([ARCH, kv("general.name", STRING, u64(2**64 - 1) + b"x")])
    yield "huge_array_length.gguf", gguf([ARCH, kv("tokenizer.ggml.scores", ARRAY, arr(F32, 2**62, f32(0.0)))])
    yield "huge_string_array_length.gguf", gguf([ARCH, kv("tokenizer.ggml.tokens", ARRAY,
                                                           arr(STRING, 2**40, gstr("a")))])
    yield "huge_string_in_array.gguf", gguf([ARCH, kv("tokenizer.ggml.tokens", ARRAY,
                                                      arr(STRING, 2, gstr("a") + u64(2**50) + b"b"))])
    yield "unknown_value_type.gguf", gguf([ARCH, kv("general.weird", 13, u32(0))])
    yield "unknown_array_type.gguf", gguf([ARCH, kv("general.weird", ARRAY, arr(200, 1, u32(0)))])
    yield "nested_array.gguf", gguf([ARCH, kv("general.nested", ARRAY, arr(ARRAY, 1, arr(U8, 1, b"\x01")))])
    yield "bool_2.gguf", gguf([ARCH, kv("tokenizer.ggml.add_bos_token", BOOL, b"\x02")])
    yield "bool_array_2.gguf", gguf([ARCH, kv("general.flags", ARRAY, arr(BOOL, 3, b"\x00\x01\x07"))])
    yield "key_not_utf8.gguf", gguf([ARCH, kv(b"general.\xff\xfe", U32, u32(1))])
    yield "string_not_utf8.gguf", gguf([ARCH, kv("general.name", STRING, gstr(b"ab\xc3"))])
    yield "duplicate_key.gguf", gguf([ARCH, kv("llama.block_count", U32, u32(2)),
                                      kv("llama.block_count", U32, u32(3))])
    yield "alignment_0.gguf", gguf([ARCH, kv("general.alignment", U32, u32(0))], [A, B], DATA)
    yield "alignment_3.gguf", gguf([ARCH, kv("general.alignment", U32, u32(3))], [A, B], DATA)
    yield "alignment_u64.gguf", gguf([ARCH, kv("general.alignment", U64, u64(32))], [A, B], DATA)
    yield "alignment_string.gguf", gguf([ARCH, kv("general.alignment", STRING, gstr("32"))], [A, B], DATA)
    yield "alignment_huge.gguf", gguf([ARCH, kv("general.alignment", U32, u32(2**31))], [A], DATA)

    # tensor infos
    yield "huge_tensor_name_length.gguf", gguf([ARCH], [u64(2**63) + b"a" + u32(1) + u64(8) + u32(T_F32) + u64(0)])
    yield "n_dims_5.gguf", gguf([ARCH], [tinfo("a", [1, 1, 1, 1, 8], T_F32, 0)], DATA)
    yield "n_dims_0.gguf", gguf([ARCH], [tinfo("a", [], T_F32, 0)], DATA)
    yield "n_dims_huge.gguf", gguf([ARCH], [tinfo("a", [8], T_F32, 0, n_dims=2**32 - 1)], DATA)
    yield "zero_dim.gguf", gguf([ARCH], [tinfo("a", [8, 0], T_F32, 0)], DATA)
    yield "huge_dims.gguf", gguf([ARCH], [tinfo("a", [2**32, 2**32], T_F32, 0)], DATA)
    yield "dim_over_i64.gguf", gguf([ARCH], [tinfo("a", [2**63], T_F32, 0)], DATA)
    yield "byte_size_overflow.gguf", gguf([ARCH], [tinfo("a", [2**62], T_F32, 0)], DATA)
    yield "unknown_tensor_type.gguf", gguf([ARCH], [tinfo("a", [8], 99, 0)], DATA)
    yield "removed_tensor_type.gguf", gguf([ARCH], [tinfo("a", [32], 4, 0)], DATA)
    yield "row_not_block_multiple.gguf", gguf([ARCH], [tinfo("a", [33, 2], T_Q4_0, 0)], DATA)
    yield "duplicate_tensor_name.gguf", gguf([ARCH], [A, tinfo("a", [8], T_F32, 32)], DATA)
    yield "misaligned_offset.gguf", gguf([ARCH], [A, tinfo("b", [4], T_F32, 36)], DATA + bytes(32))
    yield "overlapping_tensors.gguf", gguf([ARCH], [tinfo("a", [16], T_F32, 0), B], DATA)
    yield "same_offset_tensors.gguf", gguf([ARCH], [A, tinfo("b", [8], T_F32, 0)], DATA)
    yield "offset_out_of_file.gguf", gguf([ARCH], [A, tinfo("b", [8], T_F32, 1024)], DATA)
    yield "offset_overflow.gguf", gguf([ARCH], [A, tinfo("b", [8], T_F32, 2**64 - 32)], DATA)
    yield "data_past_end.gguf", gguf([ARCH], [A, tinfo("b", [64], T_F32, 32)], DATA)

    # truncations at several points: in the magic, the version, the counts, a string value, a
    # key, a value, a tensor info, and the tensor data. A long description keeps the minimum
    # sizes of the counts far below the real size, so the cuts after the header reach the reads.
    desc = kv("general.description", STRING, gstr("x" * 120))
    base = gguf([desc, ARCH], [A, B], DATA)
    arch_at = 24 + len(desc)
    info_at = arch_at + len(ARCH)
    for name, cut in [("magic", 3), ("version", 6), ("counts", 20), ("string", 24 + 8 + 19 + 4 + 8 + 80),
                      ("key", arch_at + 8 + 5), ("value", arch_at + 8 + 20 + 4 + 8 + 2),
                      ("tensor_info", info_at + 10), ("tensor_dims", info_at + 8 + 1 + 4 + 3),
                      ("data", len(base) - 1)]:
        yield "truncated_%s.gguf" % name, base[:cut]

    # well-formed files whose metadata has the wrong type for what a loader asks
    yield "scores_wrong_type.gguf", gguf([ARCH, kv("tokenizer.ggml.scores", ARRAY,
                                                   arr(I32, 3, i32(0) + i32(-1) + i32(-2)))])
    yield "block_count_string.gguf", gguf([ARCH, kv("llama.block_count", STRING, gstr("32"))])
    yield "block_count_negative.gguf", gguf([ARCH, kv("llama.block_count", I32, i32(-1))])


def main():
    os.makedirs(OUT, exist_ok=True)
    for name, data in files():
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data)
        print("%-34s %6d bytes" % (name, len(data)))


if __name__ == "__main__":
    main()
