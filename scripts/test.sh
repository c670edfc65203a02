#!/usr/bin/env bash
# The README's test command: fetches the test models when missing, then runs every test in
# release mode (the same build the main job uses). Set ANYGPU_REQUIRE_GPU=1 to fail when no
# GPU adapter (lavapipe counts) can be opened.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/fetch-models.sh
cargo test --release --workspace "$@"
