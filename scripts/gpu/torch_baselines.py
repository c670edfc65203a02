"""PyTorch baselines measured in the same session as `anygpu bench ops` on the GPU machine.

Prints one JSON object per measurement: {"op", "shape", "dtype", "ms", "gflops", "gbps"} with
the same byte and flop counting as anygpu's bench (read + write bytes; 2*M*N*K for matmul;
4*H*T*(T+1)/2*D for causal attention). Run: python3 scripts/gpu/torch_baselines.py
"""
import json

import torch
import torch.nn.functional as F

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = "cuda"


def bench(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def emit(op, shape, dtype, ms, flops, nbytes):
    print(json.dumps({"op": op, "shape": shape, "dtype": dtype, "ms": ms,
                      "gflops": flops / ms / 1e6, "gbps": nbytes / ms / 1e6}), flush=True)


n = 64 << 20
x = torch.randn(n, device=dev)
y = torch.randn(n, device=dev)
emit("copy", f"[{n}]", "f32", bench(lambda: x.clone()), 0, 8 * n)
emit("add", f"[{n}]", "f32", bench(lambda: x + y), n, 12 * n)
emit("gelu", f"[{n}]", "f32", bench(lambda: F.gelu(x, approximate="tanh")), 8 * n, 8 * n)
emit("silu", f"[{n}]", "f32", bench(lambda: F.silu(x)), 8 * n, 8 * n)
emit("exp", f"[{n}]", "f32", bench(lambda: torch.exp(x)), 8 * n, 8 * n)
rows = x.view(-1, 4096)
w = torch.randn(4096, device=dev)
b = torch.randn(4096, device=dev)
shape = f"[{rows.shape[0]}, 4096]"
emit("softmax", shape, "f32", bench(lambda: torch.softmax(rows, -1)), 5 * n, 8 * n)
emit("layer_norm", shape, "f32", bench(lambda: F.layer_norm(rows, (4096,), w, b, 1e-5)), 8 * n, 8 * n)
emit("rms_norm", shape, "f32", bench(lambda: F.rms_norm(rows, (4096,), w, 1e-5)), 4 * n, 8 * n)
del x, y, rows
s = 4096
a = torch.randn(s, s, device=dev)
bb = torch.randn(s, s, device=dev)
emit("matmul", f"[{s}, {s}] x [{s}, {s}]", "f32", bench(lambda: a @ bb), 2 * s**3, 12 * s * s)
ah, bh = a.half(), bb.half()
emit("matmul", f"[{s}, {s}] x [{s}, {s}]", "f16", bench(lambda: ah @ bh), 2 * s**3, 6 * s * s)
mv = 8192
wm = torch.randn(mv, mv, device=dev).half()
xv = torch.randn(mv, device=dev).half()
emit("matvec", f"[{mv}, {mv}] x [{mv}]", "f16", bench(lambda: wm @ xv), 2 * mv * mv, 2 * mv * mv)
h, t, d = 32, 4096, 128
q = torch.randn(1, h, t, d, device=dev).half()
k = torch.randn(1, h, t, d, device=dev).half()
v = torch.randn(1, h, t, d, device=dev).half()
att = 4 * h * (t * (t + 1) / 2) * d
emit("attention", f"B=1 H={h} T={t} D={d} causal", "f16",
     bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)), att, 8 * h * t * d)
qf, kf, vf = q.float(), k.float(), v.float()
emit("attention", f"B=1 H={h} T={t} D={d} causal", "f32",
     bench(lambda: F.scaled_dot_product_attention(qf, kf, vf, is_causal=True)), att, 16 * h * t * d)
