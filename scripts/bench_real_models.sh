#!/usr/bin/env bash
# Kernel-level speed on the real models (not a test): `specula bench offline` on each known model,
# prefill and decode at batch 1/4/16, 1 and 2 threads, beside llama.cpp's `llama-bench` on the same
# file in the same run when LLAMA_BENCH points at one (build llama.cpp with -DGGML_NATIVE=OFF and
# the AVX/AVX2/FMA/F16C/AVX512* flags your CPU has, AMX off). Run it on a quiet machine.
#
#   LLAMA_BENCH=/path/to/llama-bench scripts/bench_real_models.sh [OUTDIR]
#   MODELS="qwen2.5-coder-1.5b-instruct" THREADS=2 BATCH=1,4,16 REPS=2 scripts/bench_real_models.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-target/bench-real}
mkdir -p "$OUT"
BIN=${SPECULA_BIN:-$PWD/target/release/specula}
MODELS=${MODELS:-"qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct gemma-3-270m"}
THREADS=${THREADS:-1,2}
BATCH=${BATCH:-1,4,16}
REPS=${REPS:-2}
for m in $MODELS; do
  extra=()
  [ -n "${LLAMA_BENCH:-}" ] && extra=(--llama-bench "$LLAMA_BENCH")
  echo "== $m (load average $(cut -d' ' -f1-3 /proc/loadavg))"
  "$BIN" bench offline --model "$m" --threads "$THREADS" --batch "$BATCH" --prefill-len 512 --decode-steps 64 \
    --reps "$REPS" --output-json "$OUT/$m.json" "${extra[@]}" 2>"$OUT/$m.log"
done
