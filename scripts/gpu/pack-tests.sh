#!/usr/bin/env bash
# Pack the workspace's test binaries, the `anygpu` binary the CLI tests run, and models/ into
# parts small enough to travel to a GPU machine that takes only so much per call (the H100
# machine: 64 MiB, working tree included), there to be run by scripts/gpu/run-tests.sh.
#
#   bash scripts/gpu/pack-tests.sh                       # every test binary and models/
#   bash scripts/gpu/pack-tests.sh --no-models parity_qmatmul safetensors_hostile
#   bash scripts/gpu/pack-tests.sh --part-mib 40
#
# Test binaries are named as cargo names them (the file under tests/, or the crate for its unit
# tests: anygpu_core, anygpu_models, anygpu). Writes .dev/tests/ID-K-of-N (git-ignored; ID, the
# time of packing, names this pack). Carry one part per call (carry=[".gl",
# ".dev/tests/ID-K-of-N"]) and run `bash scripts/gpu/run-tests.sh` in each call, after the
# Vulkan set-up: it keeps the parts in /tmp while the machine stays warm and runs the tests once
# it has all N. The binaries are built here; the working tree that travels must be the one built.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
OUT=.dev/tests
die() { echo "pack-tests: $*" >&2; exit 1; }

part_mib=56
models=1
only=()
while [ $# -gt 0 ]; do
    case "$1" in
    --part-mib)
        [[ "${2:-}" =~ ^[1-9][0-9]*$ ]] || die "--part-mib takes a whole number of MiB, got '${2:-}'"
        part_mib=$2
        shift 2
        ;;
    --no-models) models=0; shift ;;
    -h | --help) sed -n 2,15p "$0"; exit 0 ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) only+=("$1"); shift ;;
    esac
done

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/root/bin"

echo "pack-tests: building the test binaries (cargo test --release --workspace --no-run)" >&2
cargo test --release --workspace --no-run --message-format=json >"$stage/build.json"

# One line per test binary: its name, its package's folder relative to the root (cargo runs a
# test binary from its package's folder, and some tests read files relative to it), its path.
python3 - "$stage/build.json" "$ROOT" >"$stage/list" <<'EOF'
import json, os, sys
root = sys.argv[2]
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        pkg = os.path.relpath(os.path.dirname(m["manifest_path"]), root)
        print(m["target"]["name"], pkg, m["executable"])
EOF
[ -s "$stage/list" ] || die "cargo built no test binaries"
for name in "${only[@]}"; do
    grep -q "^$name " "$stage/list" || die "no test binary named $name; there are: $(cut -d' ' -f1 "$stage/list" | sort | tr '\n' ' ')"
done

: >"$stage/root/manifest"
while read -r name pkg exe; do
    if [ ${#only[@]} -gt 0 ] && ! printf '%s\n' "${only[@]}" | grep -qx "$name"; then
        continue
    fi
    [ -e "$stage/root/bin/$name" ] && die "two test binaries named $name"
    strip -o "$stage/root/bin/$name" "$exe"
    echo "$name $pkg" >>"$stage/root/manifest"
done <"$stage/list"
# The CLI tests run the binary cargo built beside them (CARGO_BIN_EXE_anygpu).
strip -o "$stage/root/anygpu" target/release/anygpu
# The tests find the repository (fixtures, models/) through the path they were built at.
echo "$ROOT" >"$stage/root/build-root"
# The build itself, by path, time and size: where it is found, the CLI binary and models/ the
# tests use are already in place.
stat -c '%n %Y %s' "$ROOT/target/release/anygpu" >"$stage/root/build-stamp"
echo "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo '+changes')" \
    >"$stage/root/commit"
if [ $models = 1 ]; then
    if [ -d models ]; then
        cp -rL models "$stage/root/models"
    else
        echo "pack-tests: no models/ here (bash scripts/fetch-models.sh): the model tests will fail there" >&2
    fi
fi

rm -rf "$OUT"
mkdir -p "$OUT"
tar -C "$stage/root" -czf - . | split -b "${part_mib}M" -d -a 3 - "$stage/part-"
# The pack's id keeps the parts of an earlier pack, still kept on the machine, out of this one.
id=$(date -u +%Y%m%d%H%M%S)
parts=("$stage"/part-*)
n=${#parts[@]}
k=1
for p in "${parts[@]}"; do
    mv "$p" "$OUT/$id-$k-of-$n"
    k=$((k + 1))
done
echo "pack-tests: $(wc -l <"$stage/root/manifest") test binaries, $(cat "$stage/root/commit"), in $n parts:" >&2
ls -l "$OUT" >&2
