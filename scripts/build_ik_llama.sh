#!/usr/bin/env bash
# Builds ik_llama.cpp's `llama-bench`, the second CPU bar (run-time repacking into row-interleaved
# layouts, fused MoE up/gate, its own CPU flash attention), into the project's cache, native for the
# machine it runs on (it is never committed, and nothing here ships it). The source is a snapshot of
# its public repository: a checkout or bare git directory given as IK_SRC, else a shallow clone.
# About 30 minutes on 2 cores (its iqk kernels are large templates); a second run reuses the build. Prints the llama-bench path, for
#   specula bench offline --model M --llama-bench .../llama-bench --ik-bench "$(bash scripts/build_ik_llama.sh)"
#
#   bash scripts/build_ik_llama.sh                    # clones github.com/ikawrakow/ik_llama.cpp
#   IK_SRC=/path/to/ik_llama.cpp bash scripts/build_ik_llama.sh
set -euo pipefail
CACHE="${SPECULA_CACHE:-$HOME/.cache/specula}/ik_llama.cpp"
SRC="$CACHE/src"
BUILD="$CACHE/build"
mkdir -p "$CACHE"
command -v cmake >/dev/null || python3 -m pip install -q cmake >&2
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  rm -rf "$SRC"
  if [ -n "${IK_SRC:-}" ] && [ -f "$IK_SRC/CMakeLists.txt" ]; then
    cp -r "$IK_SRC" "$SRC"
  elif [ -n "${IK_SRC:-}" ]; then
    # a bare repository (a mirror): its newest commit's tree, file by file, as a mirror may lack
    # the blobs of its largest files (the web UI's bundles, which llama-bench does not need:
    # those are left empty)
    mkdir -p "$SRC"
    git --git-dir="$IK_SRC" ls-tree -r HEAD | while read -r _ type obj path; do
      [ "$type" = blob ] || continue
      mkdir -p "$SRC/$(dirname "$path")"
      git --git-dir="$IK_SRC" cat-file blob "$obj" > "$SRC/$path" 2>/dev/null || : > "$SRC/$path"
    done
  else
    git clone --depth 1 https://github.com/ikawrakow/ik_llama.cpp "$SRC" >&2
  fi
fi
# its build embeds a few web-UI files that a snapshot may lack; llama-bench needs none of them
for f in $(grep -ho 'public/[A-Za-z0-9_./-]*' "$SRC/examples/server/CMakeLists.txt" 2>/dev/null | sort -u); do
  [ -e "$SRC/examples/server/$f" ] || { mkdir -p "$(dirname "$SRC/examples/server/$f")"; : > "$SRC/examples/server/$f"; }
done
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF >&2
cmake --build "$BUILD" -j "$(nproc)" --target llama-bench >&2
echo "$BUILD/bin/llama-bench"
