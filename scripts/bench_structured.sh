#!/usr/bin/env bash
# Structured outputs (not a test): the same prompts (bench/json_tasks.jsonl, asking for a JSON
# object) without a constraint, with a JSON-schema constraint (response_format json_schema), and
# with the same constraint on a second, identical server started with
# --structured-jump-forward=false, interleaved at each concurrency level, greedy. Prints the
# bench serve tables and one line per level and round: constrained / unconstrained tok/s, and
# jump-forward's gain (the schema run with it against the schema run without it; the outputs are
# the same tokens), with the engine steps per output token and the server's CPU time per token
# beside the wall-clock rates (less disturbed by a busy machine).
#
#   scripts/bench_structured.sh [OUTDIR]
#   MODEL=qwen2.5-coder-0.5b-instruct CONCURRENCY="1 8" NUM_PROMPTS=16 ROUNDS=2 SCHEMA=heavy SPEC="--speculative-method ngram" ...
set -u
cd "$(dirname "$0")/.."
OUT=${1:-target/bench-structured}
mkdir -p "$OUT"
BIN=${SPECULA_BIN:-$PWD/target/release/specula}
# shellcheck source=bench_common.sh
source scripts/bench_common.sh
MODEL=$(model_path ${MODEL:-})
THREADS=${THREADS:-2}
CONC=${CONCURRENCY:-1 8}
N=${NUM_PROMPTS:-16}
ROUNDS=${ROUNDS:-1}
PORT_JF=${PORT:-18568}
PORT_NOJF=$((PORT_JF + 1))
# SCHEMA=light (default): the four fields the prompts ask for, free strings (about 12% of the output
# is forced); SCHEMA=heavy: longer keys, bounded strings, a boolean and a constant field, as API
# payloads have (about a third forced)
if [ "${SCHEMA:-light}" = heavy ]; then
  SCHEMA='{"type":"object","properties":{"item_display_name":{"type":"string","maxLength":32},"first_release_year":{"type":"integer"},"category_tags":{"type":"array","items":{"type":"string","maxLength":16},"minItems":3,"maxItems":3},"one_line_summary":{"type":"string","maxLength":80},"is_available_worldwide":{"type":"boolean"},"record_source":{"enum":["synthetic_benchmark_record"]}},"required":["item_display_name","first_release_year","category_tags","one_line_summary","is_available_worldwide","record_source"],"additionalProperties":false}'
else
  SCHEMA='{"type":"object","properties":{"name":{"type":"string"},"year":{"type":"integer"},"tags":{"type":"array","items":{"type":"string"},"minItems":3,"maxItems":3},"summary":{"type":"string"}},"required":["name","year","tags","summary"],"additionalProperties":false}'
fi
BODY="{\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"thing\",\"schema\":$SCHEMA}}}"


pids=()
for jf in true false; do
  PORT=$([ "$jf" = true ] && echo "$PORT_JF" || echo "$PORT_NOJF")
  # shellcheck disable=SC2086
  "$BIN" serve --model "$MODEL" --port "$PORT" --threads "$THREADS" --max-num-seqs 8 --structured-jump-forward="$jf" ${SPEC:---speculative-method none} >"$OUT/server-jf-$jf.log" 2>&1 &
  pids+=($!)
  if ! wait_up; then echo "server did not come up (see $OUT/server-jf-$jf.log)"; kill "${pids[@]}"; exit 1; fi
done
# engine steps (forward passes), forced tokens and the server's CPU seconds so far, as JSON
probe() { # PORT PID
  local cpu
  cpu=$(awk -v hz="$(getconf CLK_TCK)" '{print ($14 + $15) / hz}' "/proc/$2/stat")
  curl -s "http://127.0.0.1:$1/metrics" | awk -v cpu="$cpu" '
    /^specula:step_phase_seconds_count\{phase="forward"\}/ {steps = $2}
    /^specula:spec_forced_accepted_tokens_total / {forced = $2}
    END {printf "{\"steps\": %d, \"forced\": %d, \"cpu\": %s}\n", steps, forced, cpu}'
}
bench() { # PORT PID LABEL [EXTRA...]
  local port=$1 pid=$2 label=$3
  shift 3
  probe "$port" "$pid" >"$OUT/$label.before"
  "$BIN" bench serve --base-url "http://127.0.0.1:$port" --endpoint /v1/chat/completions --dataset file --dataset-path bench/json_tasks.jsonl \
    --no-progress --temperature 0 --num-prompts "$N" --max-concurrency "$c" --label "$label" --output-json "$OUT/$label.json" "$@" | tee "$OUT/$label.txt"
  probe "$port" "$pid" >"$OUT/$label.after"
}
for port in "$PORT_JF" "$PORT_NOJF"; do # warm-up
  "$BIN" bench serve --base-url "http://127.0.0.1:$port" --endpoint /v1/chat/completions --dataset file --dataset-path bench/json_tasks.jsonl \
    --no-progress --temperature 0 --num-prompts 2 --seed 1 --extra-body "$BODY" >/dev/null 2>&1
done
for r in $(seq 1 "$ROUNDS"); do
  for c in $CONC; do
    bench "$PORT_JF" "${pids[0]}" "free-c$c-r$r"
    bench "$PORT_JF" "${pids[0]}" "schema-c$c-r$r" --extra-body "$BODY"
    bench "$PORT_NOJF" "${pids[1]}" "schema-nojf-c$c-r$r" --extra-body "$BODY"
  done
done
for p in "${pids[@]}"; do kill -INT "$p"; done
wait
python3 - "$OUT" "$ROUNDS" $CONC <<'PY'
import json, sys, pathlib
out, rounds = pathlib.Path(sys.argv[1]), int(sys.argv[2])
def res(label):
    r = json.loads((out / f"{label}.json").read_text())["results"][0]
    a, b = (json.loads((out / f"{label}.{x}").read_text()) for x in ("before", "after"))
    tokens = r["total_output_tokens"]
    # tok/s (wall), output tokens per engine step, forced tokens' share, server CPU ms per token
    return r["output_throughput"], tokens / max(1, b["steps"] - a["steps"]), (b["forced"] - a["forced"]) / tokens, 1000 * (b["cpu"] - a["cpu"]) / tokens
print("\ntok/s: output tokens per second (wall clock); tok/step: output tokens per engine step (all requests);")
print("forced: share of the output drafted by jump-forward; cpu ms/tok: the server's CPU time per output token")
print(f"\n{'conc':>4} {'round':>5} | {'free tok/s':>10} {'cpu ms/tok':>10} | {'schema tok/s':>12} {'ratio':>6} {'tok/step':>8} {'forced':>6} {'cpu ms/tok':>10} | {'no-jf tok/s':>11} {'ratio':>6} {'tok/step':>8} {'cpu ms/tok':>10} | {'jf gain':>7} {'cpu':>6}")
for c in sys.argv[3:]:
    for r in range(1, rounds + 1):
        f, s, n = res(f"free-c{c}-r{r}"), res(f"schema-c{c}-r{r}"), res(f"schema-nojf-c{c}-r{r}")
        print(f"{c:>4} {r:>5} | {f[0]:>10.1f} {f[3]:>10.2f} | {s[0]:>12.1f} {s[0] / f[0]:>5.2f}x {s[1]:>8.2f} {s[2]:>6.0%} {s[3]:>10.2f} | "
              f"{n[0]:>11.1f} {n[0] / f[0]:>5.2f}x {n[1]:>8.2f} {n[3]:>10.2f} | {s[0] / n[0]:>6.2f}x {n[3] / s[3]:>5.2f}x")
PY
