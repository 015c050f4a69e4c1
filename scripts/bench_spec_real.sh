#!/usr/bin/env bash
# Speculative decoding on a real draft/target pair (not a test): specula without speculation, with
# n-gram and with a draft model, against llama.cpp's llama-server on the same GGUFs without
# speculation, with its n-gram speculation and with --model-draft, one after the other in one run,
# at each concurrency level, greedy. Prints one table (output tok/s, TPOT, speed-up over the same
# server without speculation, acceptance rate, mean accepted length per verify step).
#
#   LLAMA_SERVER=/path/to/llama-server scripts/bench_spec_real.sh [OUTDIR]
#   DATA=bench/code_gen.jsonl CONCURRENCY=1 NUM_PROMPTS=8 RUNS="specula-none specula-ngram" ...
#
# Defaults: target qwen2.5-coder-1.5b-instruct, draft qwen2.5-coder-0.5b-instruct (fetched by name),
# DATA=bench/code_edit.jsonl (bench/make_code_bench.py), CONCURRENCY="1 8", NUM_PROMPTS=16, 2 threads.
# DRAFT_VOCAB=N: --draft-vocab-size N for specula's draft (0: its whole vocabulary; default 32768).
# K_NGRAM / K_DRAFT: most draft tokens per step (specula's adaptive k picks fewer when its
# measured cost model says so; llama-server drafts up to them).
set -u
cd "$(dirname "$0")/.."
OUT=${1:-target/bench-spec}
mkdir -p "$OUT"
BIN=${SPECULA_BIN:-$PWD/target/release/specula}
TARGET=${TARGET:-$("$BIN" fetch-model qwen2.5-coder-1.5b-instruct --print-path)}
DRAFT=${DRAFT:-$("$BIN" fetch-model qwen2.5-coder-0.5b-instruct --print-path)}
THREADS=${THREADS:-2}
CONC=${CONCURRENCY:-1 8}
N=${NUM_PROMPTS:-16}
DATA=${DATA:-bench/code_edit.jsonl}
K_NGRAM=${K_NGRAM:-16}
K_DRAFT=${K_DRAFT:-4}
PORT=${PORT:-18567}
RUNS=${RUNS:-specula-none specula-ngram specula-draft llama-none llama-ngram llama-draft}

# shellcheck source=bench_common.sh
source scripts/bench_common.sh

server_cmd() {
  local s=(--port "$PORT" --threads "$THREADS" --max-num-seqs 8)
  local l=(-m "$TARGET" --port "$PORT" -t "$THREADS" --parallel 8 -c 32768 --no-webui --temp 0)
  case $1 in
    specula-none) echo "$BIN" serve --model "$TARGET" "${s[@]}" ;;
    specula-ngram) echo "$BIN" serve --model "$TARGET" "${s[@]}" --speculative-method ngram --num-speculative-tokens "$K_NGRAM" ;;
    specula-draft) echo "$BIN" serve --model "$TARGET" "${s[@]}" --speculative-method draft --draft-model "$DRAFT" --num-speculative-tokens "$K_DRAFT" ${DRAFT_VOCAB:+--draft-vocab-size "$DRAFT_VOCAB"} ;;
    llama-none) echo "$LLAMA_SERVER" "${l[@]}" ;;
    llama-ngram) echo "$LLAMA_SERVER" "${l[@]}" --spec-type "${LLAMA_NGRAM_TYPE:-ngram-simple}" --spec-ngram-simple-size-m "$K_NGRAM" ;;
    llama-draft) echo "$LLAMA_SERVER" "${l[@]}" --model-draft "$DRAFT" --spec-draft-n-max "$K_DRAFT" ;;
    *) echo "unknown run $1" >&2; return 1 ;;
  esac
}

for run in $RUNS; do
  case $run in llama-*) [ -n "${LLAMA_SERVER:-}" ] || { echo "== $run skipped (LLAMA_SERVER not set)"; continue; } ;; esac
  for c in $CONC; do
    name="$run-c$c"
    echo "== $name (load average $(cut -d' ' -f1-3 /proc/loadavg))"
    # shellcheck disable=SC2046
    $(server_cmd "$run") >"$OUT/$name.server.log" 2>&1 &
    pid=$!
    if ! wait_up; then echo "   server did not come up (see $OUT/$name.server.log)"; kill "$pid"; wait "$pid"; continue; fi
    BENCH=("$BIN" bench serve --base-url "http://127.0.0.1:$PORT" --endpoint /v1/chat/completions --dataset file --dataset-path "$DATA" --no-progress --temperature 0)
    "${BENCH[@]}" --num-prompts 2 --max-concurrency 2 --seed 1 >/dev/null 2>&1 # warm-up
    "${BENCH[@]}" --num-prompts "$N" --max-concurrency "$c" --seed 0 --label "$name" --output-json "$OUT/$name.json" >"$OUT/$name.bench.txt" 2>&1
    kill -INT "$pid"; wait "$pid"
  done
done

python3 - "$OUT" $RUNS <<'PY'
import json, sys, pathlib
out, runs = pathlib.Path(sys.argv[1]), sys.argv[2:]
rows = {}
for f in sorted(out.glob("*.json")):
    d = json.loads(f.read_text())
    for r in d["results"]:
        rows[(d["label"].rsplit("-c", 1)[0], r["max_concurrency"])] = r
print(f"\n{'server':<16} {'conc':>4} {'ok':>4} {'tok/s':>7} {'TPOT ms':>8} {'speed-up':>8} {'accept':>7} {'acc.len':>7}")
for run in runs:
    for (name, c), r in sorted(rows.items(), key=lambda kv: kv[0][1]):
        if name != run:
            continue
        base = rows.get((name.split("-")[0] + "-none", c))
        up = f"{r['output_throughput'] / base['output_throughput']:.2f}x" if base and base["output_throughput"] else "-"
        s = r.get("spec_decode_metrics") or r.get("spec_decode") or {}
        acc = s.get("acceptance_rate")
        alen = s.get("mean_acceptance_length")
        f = lambda v, p: "-" if v is None else f"{v:.{p}f}"
        print(f"{name:<16} {c:>4} {r['completed']:>4} {r['output_throughput']:>7.1f} {r['tpot_ms']['mean']:>8.1f} {up:>8} {f(acc, 3):>7} {f(alen, 2):>7}")
PY
