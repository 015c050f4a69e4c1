#!/usr/bin/env bash
# Serving benchmark (not a test): `specula bench serve` against `specula serve` and, when
# LLAMA_SERVER points at a llama.cpp `llama-server` binary, against it with the same model, threads
# and parallel slots, one after the other in the same run. Prints each bench serve table.
#
#   scripts/bench_serve_vs_llama.sh [OUTDIR]
#   LLAMA_SERVER=/path/to/llama-server THREADS=2 CONCURRENCY=1,4,8 NUM_PROMPTS=16 scripts/bench_serve_vs_llama.sh
#   WORKLOAD=copy  SPEC="none ngram" ...   # the input-grounded chat workload (bench/copy_passages.jsonl)
#   ASYNC="off on" ...                      # each specula run without and with --async-scheduling
#   SPECULA_FLAGS="--prefix-cache-dir D" ... # more flags for every specula run
#   WORKLOAD=long CONCURRENCY=1 NUM_PROMPTS=4 ...  # coding-agent sessions of 16k-32k tokens
#                                           # (bench/make_long_agent_sessions.py; LONG_MAX=65536 for longer),
#                                           # llama-server with -fa on and its context set to hold them
#
# WORKLOAD=random: 128-token prompts, 128 output tokens (ignore_eos). SPEC lists specula's
# speculative methods to run (none, ngram, mtp); K is --num-speculative-tokens.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-target/bench-serve}
mkdir -p "$OUT"
BIN=${SPECULA_BIN:-$PWD/target/release/specula}
# shellcheck source=bench_common.sh
source scripts/bench_common.sh
MODEL=${SPECULA_MODEL:-$(model_path)}
THREADS=${THREADS:-2}
CONC=${CONCURRENCY:-1,4,8}
N=${NUM_PROMPTS:-16}
SPEC=${SPEC:-none}
K=${K:-3}
ASYNC=${ASYNC:-off}
WORKLOAD=${WORKLOAD:-random}
PORT=${PORT:-18566}
case "$WORKLOAD" in
  random) LOAD=(--random-input-len 128 --random-output-len 128 --ignore-eos) ;;
  copy) LOAD=(--endpoint /v1/chat/completions --dataset file --dataset-path bench/copy_passages.jsonl) ;;
  long)
    python3 bench/make_long_agent_sessions.py --output "$OUT/long_agent.jsonl" --min-tokens "${LONG_MIN:-16384}" --max-tokens "${LONG_MAX:-32768}" >&2
    LOAD=(--endpoint /v1/chat/completions --dataset file --dataset-path "$OUT/long_agent.jsonl") ;;
  *) echo "WORKLOAD must be random, copy or long" >&2; exit 2 ;;
esac
# llama-server's slots and context (each slot holds its share of -c): one slot the size of a
# whole session for the long workload (run it at concurrency 1)
PARALLEL=8 LLAMA_CTX=16384
if [ "$WORKLOAD" = long ]; then PARALLEL=1 LLAMA_CTX=$(( ${LONG_MAX:-32768} + 8192 )); fi
LLAMA_CTX=${CONTEXT:-$LLAMA_CTX} # CONTEXT=N: llama-server's -c (e.g. 32768, specula's default for a 32k model)
BENCH=("$BIN" bench serve --base-url "http://127.0.0.1:$PORT" --max-concurrency "$CONC" "${LOAD[@]}" --no-progress)


one() {
  local name=$1; shift
  echo "== $name (load average $(cut -d' ' -f1-3 /proc/loadavg))"
  "$@" >"$OUT/$name.server.log" 2>&1 &
  local pid=$!
  if ! wait_up; then echo "   server did not come up (see $OUT/$name.server.log)"; kill "$pid"; wait "$pid"; return; fi
  if [ "$WORKLOAD" = long ]; then
    # a warm-up that shares nothing with the sessions: their first turn is measured cold
    "$BIN" bench serve --base-url "http://127.0.0.1:$PORT" --random-input-len 64 --random-output-len 8 --num-prompts 2 --no-progress >/dev/null 2>&1
  else
    "${BENCH[@]}" --num-prompts 4 --seed 1 >/dev/null 2>&1 # warm-up
  fi
  "${BENCH[@]}" --num-prompts "$N" --seed 0 --label "$name" --output-json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.bench.txt"
  # the server's peak resident memory over the run
  echo "   peak RSS $(awk '/VmHWM/ {printf "%.0f MiB", $2 / 1024}' "/proc/$pid/status")" | tee "$OUT/$name.rss"
  kill -INT "$pid"; wait "$pid"
}

for m in $SPEC; do
  for a in $ASYNC; do
    flags=(); suffix=""
    if [ "$a" = on ]; then flags=(--async-scheduling); suffix="-async"; fi
    if [ "$m" = none ]; then
      one "specula$suffix" "$BIN" serve --model "$MODEL" --port "$PORT" --threads "$THREADS" --max-num-seqs 8 --speculative-method none "${flags[@]}" ${SPECULA_FLAGS:-}
    else
      one "specula-$m-k$K$suffix" "$BIN" serve --model "$MODEL" --port "$PORT" --threads "$THREADS" --max-num-seqs 8 \
        --speculative-method "$m" --num-speculative-tokens "$K" "${flags[@]}" ${SPECULA_FLAGS:-}
    fi
  done
done
if [ -n "${LLAMA_SERVER:-}" ]; then
  one "llama-server" "$LLAMA_SERVER" -m "$MODEL" --port "$PORT" -t "$THREADS" --parallel "$PARALLEL" -c "$LLAMA_CTX" -fa on --no-webui \
    ${LLAMA_KV:+-ctk "$LLAMA_KV" -ctv "$LLAMA_KV"}
fi
