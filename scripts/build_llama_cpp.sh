#!/usr/bin/env bash
# Builds llama.cpp, the bar for CPU speed and the reference for logits, from the source vendored in
# the PyPI sdist llama-cpp-python==0.3.36 (vendor/llama.cpp), into the project's cache: the shared
# libraries (for llama-cpp-python's Python bindings, which python/llama_compare.py loads from the
# sdist's own `llama_cpp` folder), `llama-bench` and `llama-perplexity` (KV fidelity). On Intel explicit flags (AVX, AVX2, FMA, F16C,
# AVX-512 F/VNNI/BF16 on, AMX off); on AMD native, for the machine it runs on. About 10 minutes on
# 2 cores; a second run reuses the build. Prints the folder that holds the results.
#
#   bash scripts/build_llama_cpp.sh            # -> $SPECULA_CACHE/llama.cpp
#   WITH_SERVER=1 bash scripts/build_llama_cpp.sh   # also build/bin/llama-server (the serving benchmarks)
set -euo pipefail
SERVER=OFF TARGETS=(llama llama-bench llama-perplexity)
if [ -n "${WITH_SERVER:-}" ]; then SERVER=ON TARGETS+=(llama-server); fi
CACHE="${SPECULA_CACHE:-$HOME/.cache/specula}/llama.cpp"
VERSION=0.3.36
SRC="$CACHE/llama_cpp_python-$VERSION"
BUILD="$CACHE/build"
mkdir -p "$CACHE"
# cmake from its PyPI wheel when the machine has none
command -v cmake >/dev/null || python3 -m pip install -q cmake >&2
if [ ! -d "$SRC" ]; then
  # the sdist's build backend is not needed to unpack it
  python3 -m pip download --no-deps --no-binary llama-cpp-python --no-build-isolation -d "$CACHE" "llama-cpp-python==$VERSION" >&2 \
    || python3 -m pip download --no-deps --no-binary llama-cpp-python -d "$CACHE" "llama-cpp-python==$VERSION" >&2
  tar -xzf "$CACHE/llama_cpp_python-$VERSION.tar.gz" -C "$CACHE"
fi
# AMD: native (Zen 3 has no AVX-512 and an AVX-512 build dies with SIGILL; Zen 4 has no AVX_VNNI);
# Intel: the explicit flags with AMX off (the native build died in AMX prefill code on our Xeons)
if grep -q AuthenticAMD /proc/cpuinfo 2>/dev/null; then
  ISA=(-DGGML_NATIVE=ON)
else
  ISA=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
    -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
fi
cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
  "${ISA[@]}" \
  -DGGML_OPENMP=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=$SERVER >&2
cmake --build "$BUILD" -j "$(nproc)" --target "${TARGETS[@]}" >&2
echo "$CACHE"
