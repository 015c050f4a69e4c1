#!/usr/bin/env bash
# Runs every test: formatting and lints, the Rust workspace (unit, integration, property tests,
# MPI across processes), and the Python oracles and OpenAI-client tests against the real binary,
# on the default model and on the real models (Qwen2.5-Coder-0.5B-Instruct, Gemma-3-270m; about
# 750 MB fetched once into the cache). Installs the Python packages it needs.
#   SPECULA_SKIP_PY=1   skips the Python part
#   SPECULA_SKIP_LINT=1 skips rustfmt and clippy
#   SPECULA_FUZZ_RELEASE=1 also runs the GGUF fuzz test in a release build
# Under CI (the CI variable set) nothing is skipped for want of a tool: a missing model, binary,
# mpirun or oracle package fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m pip install -q --disable-pip-version-check -r python/requirements.txt

# MPI data parallelism across processes needs Open MPI, and libclang for the mpi crate's
# bindings (.ci/run installs both). Where they are, everything below is built once with the
# `mpi` feature: it only adds the `--data-parallel-backend mpi` path (MPI starts only there), so
# the same binary serves the plain tests and the MPI ones, and nothing is compiled twice.
# `specula/testing`: the binary's tiny GGUF writer (`specula debug write-tiny`, candle's GGUF
# writer), which the Python oracles use; the crates' own tests turn on the same feature of
# specula-model, so the build and the tests share one compilation of it
features=(--features specula/testing)
if command -v mpirun >/dev/null && ls /usr/lib/llvm-*/lib/libclang.so* >/dev/null 2>&1; then
  features+=(--features specula/mpi)
elif [ -n "${CI:-}" ]; then
  echo "error: mpirun or libclang is missing, so the MPI tests cannot run (.ci/run installs openmpi-bin, libopenmpi-dev, libclang-dev)" >&2
  exit 1
else
  echo "warning: mpirun or libclang missing: skipping the MPI tests" >&2
fi

if [ "${SPECULA_SKIP_LINT:-0}" != "1" ]; then
  cargo fmt --all -- --check
  # one pass over everything, with bench offline's candle baseline (behind a feature: the serving
  # binary does not compile candle-transformers) on, so that it still builds (only its stand-in,
  # offline.rs, is compiled without the feature, by the build below), and the MPI backend where
  # it builds
  cargo clippy --workspace --all-targets --features specula/candle-baseline "${features[@]}" -- -D warnings
  # no import cycle between the top-level modules of any crate, and docs/architecture.md names
  # only what the code has
  python3 scripts/check_structure.py
fi

# One build for everything below: the `ci` profile is release with debug assertions and overflow
# checks on (Cargo.toml), so the invariant checks run in the Rust tests and in the binary the
# Python tests drive.
profile=ci
cargo build --profile $profile --workspace --bins "${features[@]}"
bin=./target/$profile/specula
$bin fetch-model
$bin fetch-model qwen2.5-coder-0.5b-instruct
$bin fetch-model gemma-3-270m
export SPECULA_MODEL="${SPECULA_MODEL:-$($bin fetch-model --print-path)}"
export SPECULA_MODEL_QWEN05="${SPECULA_MODEL_QWEN05:-$($bin fetch-model qwen2.5-coder-0.5b-instruct --print-path)}"
export SPECULA_MODEL_GEMMA="${SPECULA_MODEL_GEMMA:-$($bin fetch-model gemma-3-270m --print-path)}"
export SPECULA_BIN="$PWD/target/$profile/specula"

# with the mpi feature this includes the engine's dp_mpi test (ranks as processes under mpirun)
cargo test --profile $profile --workspace "${features[@]}"
# the GGUF fuzz test again in release (no overflow checks): opt-in, as it builds everything a
# second time; the parser's `clippy::arithmetic_side_effects` denial keeps the two the same
if [ "${SPECULA_FUZZ_RELEASE:-0}" = "1" ]; then
  cargo test --release -p specula --test gguf_fuzz
fi
# the kernels again with the AVX-512 path switched off: on a CPU with AVX-512 VNNI the run above
# dispatched to it, this one to AVX2 (the kernel tests print which paths ran and, under CI, fail
# when a path the CPU has and the environment allows was not exercised)
SPECULA_NO_VNNI=1 cargo test --profile $profile -p specula-kernels

# python/tests/test_server_mpi.py runs the same binary under mpirun
if [[ " ${features[*]} " == *" specula/mpi "* ]]; then
  export SPECULA_MPI_BIN="$SPECULA_BIN"
fi

if [ "${SPECULA_SKIP_PY:-0}" != "1" ]; then
  # -rs lists every skipped test with its reason
  python3 -m pytest -q -rs python/tests
fi
