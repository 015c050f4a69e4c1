#!/usr/bin/env bash
# specula's logits against llama.cpp's on the same GGUF files (python/llama_compare.py; its
# docstring says what is compared and why the bounds are what they are). Builds llama.cpp first
# (scripts/build_llama_cpp.sh, a no-op when already built), then runs the comparison with the
# llama-cpp-python sdist's bindings on PYTHONPATH and the built libllama in LLAMA_CPP_LIB_PATH.
# Arguments go to the Python script; prints a Markdown table; exit status 1 if a case fails.
#
#   bash scripts/llama_compare.sh                    # tiny generated files, every architecture and format
#   bash scripts/llama_compare.sh --real             # and the cached real models
#   bash scripts/llama_compare.sh --model F.gguf     # any GGUF (repeatable)
#   SPECULA_BIN=target/release/specula bash scripts/llama_compare.sh --arch-filter qwen3
# The tiny files come from the binary's `debug write-tiny`: a binary built with `--features testing`
# (scripts/test.sh's target/ci/specula is; `cargo build --release -p specula --features testing`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="$(bash "$ROOT/scripts/build_llama_cpp.sh" | tail -n 1)"
SDIST="$(ls -d "$CACHE"/llama_cpp_python-*/ | tail -n 1)"
export PYTHONPATH="${SDIST%/}${PYTHONPATH:+:$PYTHONPATH}"
export LLAMA_CPP_LIB_PATH="$CACHE/build/bin"
exec python3 "$ROOT/python/llama_compare.py" --llama-dir "$CACHE" "$@"
