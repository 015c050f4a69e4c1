#!/usr/bin/env bash
# Speculative decoding on a real draft/target pair (not a test): specula without speculation, with
# n-gram and with a draft model, against llama.cpp's llama-server on the same GGUFs without
# speculation, with its n-gram speculation and with --model-draft, one after the other in one run,
# at each concurrency level, greedy. Prints one table (output tok/s, TPOT, speed-up over the same
# server without speculation, in output tok/s (prefill included: the time to the first token is
# the same with and without speculation) and in TPOT (decode only), acceptance rate, mean accepted
# length per verify step).
#
#   LLAMA_SERVER=/path/to/llama-server scripts/bench_spec_real.sh [OUTDIR]
#   DATA=bench/code_gen.jsonl CONCURRENCY=1 NUM_PROMPTS=8 RUNS="specula-none specula-ngram" ...
#
# Defaults: target qwen2.5-coder-1.5b-instruct, draft qwen2.5-coder-0.5b-instruct (fetched by name),
# DATA=bench/code_edit.jsonl (bench/make_code_bench.py), CONCURRENCY="1 8", NUM_PROMPTS=16, 2 threads.
# DATA=bench/agent_traces.jsonl: multi-turn agent conversations (bench/make_agent_traces.py); a
# conversation's turns go one after another and hold one concurrency slot; the per-kind table is in
# OUTDIR/rN/*.bench.txt. RUNS may add specula-ngram_own (n-gram without the cross-request index)
# and specula-ngram+draft (both, chosen per sequence and step).
# DRAFT_VOCAB=N: --draft-vocab-size N for specula's draft (0: its whole vocabulary; default 32768).
# DRAFT_WEIGHTS=stored|q4_0: --draft-weights for specula's draft (default q4_0: re-encoded smaller).
# K_NGRAM / K_DRAFT: most draft tokens per step (specula's adaptive k picks fewer when its
# measured cost model says so; llama-server drafts up to them).
# AUDIT=F: specula's speculative runs serve with --speculative-audit F; after each run the script
# waits (up to AUDIT_WAIT seconds, default 1800) for every audited request's replay and a last
# table gives identical / diverged / skipped per run. The replays share the engine with the run
# (in its idle gaps), so take speed from a run without AUDIT.
# TEMPERATURE=T: the measured requests sample at T (default 0, greedy; the warm-up stays greedy).
# ROUNDS=N: the whole sequence of runs N times (results in OUTDIR/rN). The host's memory bandwidth
# moves within minutes and the unspeculated decode moves with it, so each round's speed-ups are
# taken against that round's own baseline, and the last table gives their medians. The "verify 8"
# column is the cost of verifying 8 tokens against one that specula's server measured at start-up
# (its cost model): about 2.3 when the bandwidth is low, 3.0 when it is high.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-target/bench-spec}
mkdir -p "$OUT"
BIN=${SPECULA_BIN:-$PWD/target/release/specula}
# shellcheck source=bench_common.sh
source scripts/bench_common.sh
TARGET=${TARGET:-$(model_path qwen2.5-coder-1.5b-instruct)}
DRAFT=${DRAFT:-$(model_path qwen2.5-coder-0.5b-instruct)}
THREADS=${THREADS:-2}
CONC=${CONCURRENCY:-1 8}
N=${NUM_PROMPTS:-16}
DATA=${DATA:-bench/code_edit.jsonl}
K_NGRAM=${K_NGRAM:-16}
K_DRAFT=${K_DRAFT:-4}
PORT=${PORT:-18567}
RUNS=${RUNS:-specula-none specula-ngram specula-draft llama-none llama-ngram llama-draft}


server_cmd() {
  local s=(--port "$PORT" --threads "$THREADS" --max-num-seqs 8)
  local l=(-m "$TARGET" --port "$PORT" -t "$THREADS" --parallel 8 -c 32768 --no-webui --temp 0)
  case $1 in specula-none | llama-*) ;; specula-*) [ -n "${AUDIT:-}" ] && s+=(--speculative-audit "$AUDIT") ;; esac
  case $1 in
    specula-none) echo "$BIN" serve --model "$TARGET" "${s[@]}" --speculative-method none ;;
    specula-ngram) echo "$BIN" serve --model "$TARGET" "${s[@]}" --speculative-method ngram --num-speculative-tokens "$K_NGRAM" ;;
    specula-ngram_own) echo "$BIN" serve --model "$TARGET" "${s[@]}" --speculative-method ngram --num-speculative-tokens "$K_NGRAM" --speculative-corpus-tokens 0 ;;
    specula-ngram+draft) echo "$BIN" serve --model "$TARGET" "${s[@]}" --speculative-method ngram,draft --draft-model "$DRAFT" --num-speculative-tokens "$K_NGRAM" ${DRAFT_VOCAB:+--draft-vocab-size "$DRAFT_VOCAB"} ${DRAFT_WEIGHTS:+--draft-weights "$DRAFT_WEIGHTS"} ;;
    specula-draft) echo "$BIN" serve --model "$TARGET" "${s[@]}" --speculative-method draft --draft-model "$DRAFT" --num-speculative-tokens "$K_DRAFT" ${DRAFT_VOCAB:+--draft-vocab-size "$DRAFT_VOCAB"} ${DRAFT_WEIGHTS:+--draft-weights "$DRAFT_WEIGHTS"} ;;
    llama-none) echo "$LLAMA_SERVER" "${l[@]}" ;;
    llama-ngram) echo "$LLAMA_SERVER" "${l[@]}" --spec-type "${LLAMA_NGRAM_TYPE:-ngram-simple}" --spec-ngram-simple-size-m "$K_NGRAM" ;;
    llama-draft) echo "$LLAMA_SERVER" "${l[@]}" --model-draft "$DRAFT" --spec-draft-n-max "$K_DRAFT" ;;
    *) echo "unknown run $1" >&2; return 1 ;;
  esac
}

ROUNDS=${ROUNDS:-1}
for round in $(seq 1 "$ROUNDS"); do
  dir=$OUT/r$round
  mkdir -p "$dir"
  for run in $RUNS; do
    case $run in llama-*) [ -n "${LLAMA_SERVER:-}" ] || { echo "== $run skipped (LLAMA_SERVER not set)"; continue; } ;; esac
    for c in $CONC; do
      name="$run-c$c"
      echo "== round $round $name (load average $(cut -d' ' -f1-3 /proc/loadavg))"
      # shellcheck disable=SC2046
      $(server_cmd "$run") >"$dir/$name.server.log" 2>&1 &
      pid=$!
      if ! wait_up; then echo "   server did not come up (see $dir/$name.server.log)"; kill "$pid"; wait "$pid"; continue; fi
      BENCH=("$BIN" bench serve --base-url "http://127.0.0.1:$PORT" --endpoint /v1/chat/completions --dataset file --dataset-path "$DATA" --no-progress --temperature "${TEMPERATURE:-0}")
      # warm-up, on other prompts: the measured requests find nothing of it in the prefix cache or
      # in speculation's cross-request index
      "$BIN" bench serve --base-url "http://127.0.0.1:$PORT" --endpoint /v1/chat/completions --no-progress --temperature 0 \
        --random-input-len 64 --random-output-len 8 --num-prompts 2 --max-concurrency 2 --seed 1 >/dev/null 2>&1
      "${BENCH[@]}" --num-prompts "$N" --max-concurrency "$c" --seed 0 --label "$name" --output-json "$dir/$name.json" >"$dir/$name.bench.txt" 2>&1
      if [ -n "${AUDIT:-}" ] && [[ $run == specula-* && $run != specula-none ]]; then
        # the replays run once the server is idle: wait for the last one to be judged
        deadline=$((SECONDS + ${AUDIT_WAIT:-1800}))
        until curl -sf "http://127.0.0.1:$PORT/metrics" | grep -q '^specula:spec_audit_pending 0$' || ((SECONDS > deadline)); do sleep 2; done
      fi
      curl -sf "http://127.0.0.1:$PORT/metrics" >"$dir/$name.metrics.txt" 2>/dev/null || true
      kill -INT "$pid"; wait "$pid"
    done
  done
done

python3 - "$OUT" "$ROUNDS" $RUNS <<'PY'
import json, re, sys, pathlib, statistics
out, rounds, runs = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
f = lambda v, p: "-" if v is None else f"{v:.{p}f}"
# (name, conc, value) of a {(name, conc): value} dict, in the order of `runs`, then by concurrency
ordered = lambda d: [(n, c, v) for run in runs for (n, c), v in sorted(d.items(), key=lambda kv: kv[0][1]) if n == run]
ups = {}
for rnd in range(1, rounds + 1):
    rows = {}
    for p in sorted((out / f"r{rnd}").glob("*.json")):
        d = json.loads(p.read_text())
        for r in d["results"]:
            rows[(d["label"].rsplit("-c", 1)[0], r["max_concurrency"])] = r
    print(f"\n{'round ' + str(rnd) if rounds > 1 else ''}")
    print(f"{'server':<16} {'conc':>4} {'ok':>4} {'tok/s':>7} {'TPOT ms':>8} {'speed-up':>8} {'TPOT x':>7} {'accept':>7} {'acc.len':>7} {'verify 8':>8}")
    for name, c, r in ordered(rows):
        base = rows.get((name.split("-")[0] + "-none", c))
        up = r["output_throughput"] / base["output_throughput"] if base and base["output_throughput"] else None
        tx = base["tpot_ms"]["mean"] / r["tpot_ms"]["mean"] if base and r["tpot_ms"]["mean"] else None
        ups.setdefault((name, c), []).append((r["output_throughput"], up, tx))
        s = r.get("spec_decode_metrics") or r.get("spec_decode") or {}
        m = out / f"r{rnd}" / f"{name}-c{c}.metrics.txt"
        v8 = re.search(r'spec_verify_relative_cost\{rows="8"\} (\S+)', m.read_text()) if m.exists() else None
        print(f"{name:<16} {c:>4} {r['completed']:>4} {r['output_throughput']:>7.1f} {r['tpot_ms']['mean']:>8.1f} {f(up, 2) + 'x' if up else '-':>8} {f(tx, 2) + 'x' if tx else '-':>7} {f(s.get('acceptance_rate'), 3):>7} {f(s.get('mean_acceptance_length'), 2):>7} {f(float(v8.group(1)) if v8 else None, 2):>8}")
if rounds > 1:
    print(f"\nmedians over {rounds} rounds (speed-up: the median of each round's against its own baseline)")
    print(f"{'server':<16} {'conc':>4} {'tok/s':>7} {'speed-up':>8} {'TPOT x':>7}  per round (speed-up / TPOT x)")
    for name, c, v in ordered(ups):
        us = [u for _, u, _ in v if u is not None]
        txs = [x for _, _, x in v if x is not None]
        med = lambda xs: f(statistics.median(xs), 2) + "x" if xs else "-"
        rounds = ' '.join(f"{f(u, 2)}/{f(x, 2)}" for _, u, x in v if u is not None)
        print(f"{name:<16} {c:>4} {statistics.median(t for t, _, _ in v):>7.1f} {med(us):>8} {med(txs):>7}  {rounds}")
audits = sorted(out.glob("r*/*.metrics.txt"))
audits = [(p, dict(re.findall(r'spec_audit_requests_total\{result="(\w+)"\} (\S+)', p.read_text()))) for p in audits]
audits = [(p, a) for p, a in audits if a]
if audits:
    print("\nexactness audit (--speculative-audit): requests replayed without speculation and compared")
    print(f"{'run':<28} {'identical':>9} {'diverged':>8} {'skipped':>7} {'pending':>7}")
    for p, a in audits:
        pend = re.search(r'^specula:spec_audit_pending (\S+)', p.read_text(), re.M)
        n = lambda k: int(float(a.get(k, 0)))
        print(f"{p.parent.name + '/' + p.name.removesuffix('.metrics.txt'):<28} {n('identical'):>9} {n('diverged'):>8} {n('skipped'):>7} {int(float(pend.group(1))) if pend else '-':>7}")
PY
