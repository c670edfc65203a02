#!/usr/bin/env bash
# On the GPU machine, from the repository root: keep the part that scripts/gpu/pack-tests.sh
# made and this call carried (.dev/tests/ID-K-of-N) in $STASH, and once all N parts are
# there, unpack them and run every test binary with ANYGPU_REQUIRE_GPU=1, as `cargo test
# --release --workspace` would (doctests aside: they need a Rust toolchain).
#
#   bash scripts/gpu/run-tests.sh [ARGS...]       # ARGS go to every test binary (e.g. --skip NAME)
#
# ANYGPU_TEST_TIMEOUT: seconds one test binary may take (default 240; the slowest on the H100,
# parity_qmatmul, takes ~70). ANYGPU_TEST_STASH: where the parts are kept (/tmp/anygpu-tests).
# Exit 0: every binary passed; 1: some failed (their output is printed); 3: parts still missing
# (nothing run). The Vulkan loader and driver must be set up first (see run_benchmarks.sh).
set -uo pipefail

STASH=${ANYGPU_TEST_STASH:-/tmp/anygpu-tests}
die() { echo "run-tests: $*" >&2; exit 2; }
mkdir -p "$STASH/parts"
for p in .dev/tests/*-*-of-*; do
    [ -f "$p" ] && cp "$p" "$STASH/parts/"
done

# The newest pack's parts (the id is the time it was made); older packs' are dropped.
newest=$(ls "$STASH/parts" 2>/dev/null | sort | tail -1)
[ -n "$newest" ] || die "no parts: carry .dev/tests/ID-K-of-N (made by scripts/gpu/pack-tests.sh)"
id=${newest%%-*}
n=${newest##*-of-}
find "$STASH/parts" -type f ! -name "$id-*" -delete
missing=()
for k in $(seq 1 "$n"); do
    [ -f "$STASH/parts/$id-$k-of-$n" ] || missing+=("$id-$k-of-$n")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "run-tests: NOT RUN, have $((n - ${#missing[@]})) of $n parts; carry next: ${missing[*]}"
    exit 3
fi

root="$STASH/root"
rm -rf "$root"
mkdir -p "$root"
for k in $(seq 1 "$n"); do cat "$STASH/parts/$id-$k-of-$n"; done | tar -C "$root" -xzf - \
    || die "the parts do not unpack: pack again and carry them all (rm -rf $STASH to start over)"
echo "run-tests: $(wc -l <"$root/manifest") test binaries of $(cat "$root/commit")"

# The tests find fixtures, models/ and the CLI binary through the path they were built at: on
# another machine that path is linked to this checkout (unless it is this checkout's path), and
# away from the build the packed CLI binary and models are put in place (models that are real
# files here are kept).
build_root=$(cat "$root/build-root")
if [ "$(cd "$build_root" 2>/dev/null && pwd -P)" != "$(pwd -P)" ]; then
    if [ -e "$build_root" ] && [ ! -L "$build_root" ]; then
        die "$build_root (where the tests were built) exists here and is not this checkout"
    fi
    mkdir -p "$(dirname "$build_root")"
    ln -sfn "$PWD" "$build_root"
fi
# target/tmp: CARGO_TARGET_TMPDIR, which cargo makes before it runs tests.
mkdir -p target/release target/tmp models
read -r built _ <"$root/build-stamp"
if [ "$(stat -c '%n %Y %s' "$built" 2>/dev/null)" != "$(cat "$root/build-stamp")" ]; then
    cp "$root/anygpu" target/release/anygpu
    if [ -d "$root/models" ]; then
        for m in "$root/models"/*; do
            t="models/$(basename "$m")"
            [ -e "$t" ] && [ ! -L "$t" ] || ln -sfn "$m" "$t"
        done
    fi
fi
./target/release/anygpu devices 2>&1 | head -20

export ANYGPU_REQUIRE_GPU=1
per_binary=${ANYGPU_TEST_TIMEOUT:-240}
failed=()
while read -r name pkg; do
    log="$STASH/$name.log"
    # A hung binary must not take the whole call (the H100 machine's: 10 minutes) with it.
    (cd "$pkg" && timeout -k 10 "$per_binary" "$root/bin/$name" "$@") </dev/null >"$log" 2>&1
    rc=$?
    summary=$(grep -E '^test result:' "$log" | tail -1)
    [ $rc -eq 124 ] && summary="TIMED OUT after ${per_binary} s; $summary"
    printf '%-26s exit %3d  %s\n' "$name" "$rc" "${summary:-(no test result line)}"
    if [ $rc -ne 0 ]; then
        failed+=("$name")
        grep -vE '^test .* \.\.\. ok$' "$log" | tail -60
    fi
done <"$root/manifest"

if [ ${#failed[@]} -gt 0 ]; then
    echo "run-tests: FAILED: ${failed[*]} (logs in $STASH)"
    exit 1
fi
echo "run-tests: every test binary passed"
