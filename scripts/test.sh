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

# MPI data parallelism across processes (needs Open MPI, and libclang for the mpi crate's
# bindings; .ci/run installs both)
if command -v mpirun >/dev/null && ls /usr/lib/llvm-*/lib/libclang.so* >/dev/null 2>&1; then
  cargo test --release -p specula-engine --features mpi --test dp_mpi
  # the MPI-enabled binary for python/tests/test_server_mpi.py (only the engine, server and
  # binary crates build again with the feature), kept beside the plain one, which goes back in
  # place (both builds stay cached, so that is a copy, not a rebuild)
  cargo build --release -p specula --features mpi
  cp target/release/specula target/release/specula-mpi
  cargo build --release -p specula
  export SPECULA_MPI_BIN="$PWD/target/release/specula-mpi"
fi

if [ "${SPECULA_SKIP_PY:-0}" != "1" ]; then
  python3 -m pytest -q python/tests
fi
