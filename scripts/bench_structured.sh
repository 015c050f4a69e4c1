#!/usr/bin/env bash
# Structured outputs (not a test): the same server and prompts (bench/json_tasks.jsonl, asking for
# a JSON object) with and without a JSON-schema constraint (response_format json_schema), one
# after the other at each concurrency level, greedy. Prints both bench serve tables and one line
# per level: constrained tok/s / unconstrained tok/s.
#
#   scripts/bench_structured.sh [OUTDIR]
#   MODEL=qwen2.5-coder-0.5b-instruct CONCURRENCY="1 8" NUM_PROMPTS=16 SPEC="--speculative-method ngram" ...
set -u
cd "$(dirname "$0")/.."
OUT=${1:-target/bench-structured}
mkdir -p "$OUT"
BIN=${SPECULA_BIN:-$PWD/target/release/specula}
MODEL=$("$BIN" fetch-model ${MODEL:-} --print-path)
THREADS=${THREADS:-2}
CONC=${CONCURRENCY:-1 8}
N=${NUM_PROMPTS:-16}
PORT=${PORT:-18568}
SCHEMA='{"type":"object","properties":{"name":{"type":"string"},"year":{"type":"integer"},"tags":{"type":"array","items":{"type":"string"},"minItems":3,"maxItems":3},"summary":{"type":"string"}},"required":["name","year","tags","summary"],"additionalProperties":false}'
BODY="{\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"thing\",\"schema\":$SCHEMA}}}"

# shellcheck source=bench_common.sh
source scripts/bench_common.sh

# shellcheck disable=SC2086
"$BIN" serve --model "$MODEL" --port "$PORT" --threads "$THREADS" --max-num-seqs 8 ${SPEC:-} >"$OUT/server.log" 2>&1 &
pid=$!
if ! wait_up; then echo "server did not come up (see $OUT/server.log)"; kill "$pid"; exit 1; fi
BENCH=("$BIN" bench serve --base-url "http://127.0.0.1:$PORT" --endpoint /v1/chat/completions --dataset file --dataset-path bench/json_tasks.jsonl --no-progress --temperature 0)
"${BENCH[@]}" --num-prompts 2 --seed 1 >/dev/null 2>&1 # warm-up
for c in $CONC; do
  "${BENCH[@]}" --num-prompts "$N" --max-concurrency "$c" --label "free-c$c" --output-json "$OUT/free-c$c.json" | tee "$OUT/free-c$c.txt"
  "${BENCH[@]}" --num-prompts "$N" --max-concurrency "$c" --label "schema-c$c" --extra-body "$BODY" --output-json "$OUT/schema-c$c.json" | tee "$OUT/schema-c$c.txt"
done
kill -INT "$pid"; wait "$pid"
python3 - "$OUT" $CONC <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
print(f"\n{'conc':>4} {'free tok/s':>11} {'schema tok/s':>13} {'ratio':>6} {'free TPOT':>10} {'schema TPOT':>12}")
for c in sys.argv[2:]:
    f = json.loads((out / f"free-c{c}.json").read_text())["results"][0]
    s = json.loads((out / f"schema-c{c}.json").read_text())["results"][0]
    print(f"{c:>4} {f['output_throughput']:>11.1f} {s['output_throughput']:>13.1f} {s['output_throughput'] / f['output_throughput']:>5.2f}x {f['tpot_ms']['mean']:>10.1f} {s['tpot_ms']['mean']:>12.1f}")
PY
