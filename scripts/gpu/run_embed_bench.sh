#!/usr/bin/env bash
# Issue #5's speed target on the GPU machine: sentence embeddings per second of
# all-MiniLM-L6-v2, 64 sentences x 128 tokens, anygpu (`anygpu bench embed`) against PyTorch
# fp32 on the same GPU, measured in the same run, printed side by side.
#
# Prepare here (the GPU machine has no network, and a call carries at most 64 MiB):
#   cargo build --release -p anygpu-cli && strip -o .dev/anygpu target/release/anygpu   # ~13 MB
#   python3 scripts/gpu/pack_minilm.py        # .dev/minilm-f16: F16 weights, ~44 MiB
#   (.gl/: the Vulkan/EGL loader packages, ../shared/gpu/prepare.sh)
# Run there from the repo root, carrying .gl, .dev/anygpu and .dev/minilm-f16:
#   scripts/gpu/run_embed_bench.sh
# Here (no GPU): ANYGPU_DEVICE=cpu TORCH_DEVICE=cpu REPS=2 scripts/gpu/run_embed_bench.sh
#
# PyTorch side: scripts/gpu/minilm_torch.py (plain PyTorch BertModel forward + pooling, needs
# only torch; checked against sentence-transformers first when that is installed), and
# sentence-transformers itself (scripts/reference/bench_minilm_torch.py) when installed.
# Both sides read the same F16 file and compute in f32 (TF32 off on the PyTorch side).
#
# Settings (environment): BATCH (64), SEQ (128), REPS (20), MODEL (.dev/minilm-f16), DTYPE
# (anygpu's --dtype: auto = f16 linear weights where tensor cores are reachable, else f32),
# ANYGPU (.dev/anygpu, else target/release/anygpu), ANYGPU_DEVICE (anygpu's choice: the
# best GPU), TORCH_DEVICE (cuda if torch sees one, else cpu), TORCH_THREADS (CPU runs; 0 = torch's
# default), PYTHON (python3). Results also go to $OUT (or ./bench-out).
set -uo pipefail
BATCH=${BATCH:-64}
SEQ=${SEQ:-128}
REPS=${REPS:-20}
MODEL=${MODEL:-.dev/minilm-f16}
PYTHON=${PYTHON:-python3}
TORCH_THREADS=${TORCH_THREADS:-0}
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
A=${ANYGPU:-.dev/anygpu}
[ -x "$A" ] || A=target/release/anygpu
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

fail() { echo "run_embed_bench: $*" >&2; exit 2; }
[ -x "$A" ] || fail "no anygpu binary (.dev/anygpu or target/release/anygpu)"
[ -f "$MODEL/model.safetensors" ] || fail "$MODEL/model.safetensors missing: python3 scripts/gpu/pack_minilm.py"

# The Vulkan loader, where the machine lacks one (the GPU machine: unpacked from .gl/).
if ! ldconfig -p 2>/dev/null | grep 'libvulkan.so.1' >/dev/null; then
    ls .gl/*.deb >/dev/null 2>&1 || fail "no Vulkan loader on this machine and no .gl/*.deb to unpack"
    for f in .gl/*.deb; do dpkg -x "$f" / 2>/dev/null; done
    ldconfig
fi
export EGL_PLATFORM=surfaceless
if [ -z "${TORCH_DEVICE:-}" ]; then
    TORCH_DEVICE=$($PYTHON -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")' 2>/dev/null) \
        || fail "$PYTHON cannot import torch"
fi

echo "== $(date -u +%Y-%m-%dT%H:%MZ) $(uname -n): ${BATCH} sentences x ${SEQ} tokens, ${REPS} timed runs each =="
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
$PYTHON -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
"$A" devices > "$OUT/devices.txt" 2>/dev/null
# PyTorch sees a GPU but anygpu picked the CPU: point the Vulkan loader at NVIDIA's driver
# (the device README's fix for "no driver found") and look again.
nv=/usr/local/nvidia/share
if [ "$TORCH_DEVICE" = cuda ] && [ -z "${ANYGPU_DEVICE:-}" ] && grep -q '^Selected: .*(cpu)' "$OUT/devices.txt" \
    && [ -f $nv/vulkan/icd.d/nvidia_icd.json ]; then
    export VK_DRIVER_FILES=$nv/vulkan/icd.d/nvidia_icd.json __EGL_VENDOR_LIBRARY_FILENAMES=$nv/glvnd/egl_vendor.d/10_nvidia.json
    "$A" devices > "$OUT/devices.txt" 2>/dev/null
fi
cat "$OUT/devices.txt"
if [ "$TORCH_DEVICE" = cuda ] && grep -q '^Selected: .*(cpu)' "$OUT/devices.txt"; then
    echo "WARNING: anygpu found no GPU and measures its CPU backend; the comparison below is not GPU vs GPU"
fi

echo "== anygpu accuracy (the test fixture's sentences against sentence-transformers, --dtype ${DTYPE:-auto}) =="
$PYTHON scripts/gpu/check_embed.py "$A" "$MODEL" --dtype "${DTYPE:-auto}" || echo "check_embed: FAILED"

echo "== anygpu =="
"$A" bench embed -m "$MODEL" --batch "$BATCH" --seq "$SEQ" -r "$REPS" --dtype "${DTYPE:-auto}" --json > "$OUT/embed_anygpu.json" 2> "$OUT/embed_anygpu.err"
rc=$?
grep -v XDG_RUNTIME_DIR "$OUT/embed_anygpu.err" | tail -3
cat "$OUT/embed_anygpu.json"
[ $rc -eq 0 ] || echo "anygpu bench embed exit $rc"

echo "== plain PyTorch fp32 ($TORCH_DEVICE) =="
T=(--device "$TORCH_DEVICE" --threads "$TORCH_THREADS")
$PYTHON scripts/gpu/minilm_torch.py -m "$MODEL" "${T[@]}" --check 2>&1 | grep -v -e 'Loading weights' -e 'loaded in torch.float16'
$PYTHON scripts/gpu/minilm_torch.py -m "$MODEL" "${T[@]}" --batch "$BATCH" --seq "$SEQ" --reps "$REPS" --json \
    > "$OUT/embed_torch.json" 2> "$OUT/embed_torch.err" || { echo "minilm_torch.py failed:"; tail -5 "$OUT/embed_torch.err"; }
cat "$OUT/embed_torch.json"

echo "== sentence-transformers fp32 ($TORCH_DEVICE) =="
if $PYTHON -c 'import sentence_transformers' 2>/dev/null; then
    MODEL_DIR="$MODEL" $PYTHON scripts/reference/bench_minilm_torch.py --device "$TORCH_DEVICE" --threads "$TORCH_THREADS" \
        --batch "$BATCH" --seq "$SEQ" --reps "$REPS" 2> "$OUT/embed_st.err" | tee "$OUT/embed_st.txt" \
        || { echo "bench_minilm_torch.py failed:"; tail -5 "$OUT/embed_st.err"; }
else
    echo "not installed: the plain PyTorch figure above stands for it"
fi

echo "== summary =="
$PYTHON - "$OUT" <<'EOF'
import json, re, sys, os
out = sys.argv[1]
def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.loads(f.read().strip().splitlines()[-1])
    except Exception:
        return None
a, t = load("embed_anygpu.json"), load("embed_torch.json")
st = None
try:
    m = re.search(r"model ([0-9.]+) sentences/s", open(os.path.join(out, "embed_st.txt")).read())
    st = float(m.group(1)) if m else None
except OSError:
    pass
if not a:
    sys.exit("no anygpu result")
print(f"{'anygpu':<27} {a['sentences_per_s']:9.1f} sentences/s  on {a['device']} "
      f"({a['checkpoint_dtype']} weights file, {a.get('weight_dtype', 'F32')} linear weights; {a['batch']} x {a['seq']} tokens)")
for name, v in (("plain PyTorch fp32", t and t["sentences_per_s"]), ("sentence-transformers fp32", st)):
    if v:
        print(f"{name:<27} {v:9.1f} sentences/s  -> anygpu / this = {a['sentences_per_s'] / v:.2f}x")
EOF
