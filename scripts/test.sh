#!/usr/bin/env bash
# Runs every test: the Rust workspace (unit, integration, property tests) and the Python oracles
# and OpenAI-client tests against the real binary. Installs the Python packages it needs.
# SPECULA_SKIP_PY=1 skips the Python part.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install -q --disable-pip-version-check -r python/requirements.txt

cargo build --release --workspace --bins
./target/release/specula fetch-model
export SPECULA_MODEL="${SPECULA_MODEL:-$(./target/release/specula fetch-model --print-path)}"
export SPECULA_BIN="$PWD/target/release/specula"

cargo test --release --workspace

if [ "${SPECULA_SKIP_PY:-0}" != "1" ]; then
  python3 -m pytest -q python/tests
fi
