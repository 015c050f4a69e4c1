#!/usr/bin/env bash
# Data-parallel serving benchmark (not a test): `specula bench serve` at concurrency 8 against
# DP=1, DP=2 replicas (in-process threads and MPI processes) and DP=2 lockstep (in-process and
# MPI), one compute thread per rank, the same binary for all. Prints output tok/s, TTFT p99, TPOT
# and, for lockstep, the share of wall time each rank spent in the step-metadata collective
# (waiting for the slower rank included) from the ranks' /metrics counters.
#
#   cargo build --release -p specula --features mpi && cp target/release/specula target/release/specula-mpi
#   scripts/bench_dp.sh [OUTDIR]          # CONFIGS="dp1 dp2-mpi" to run a subset
#
# Needs mpirun (Open MPI). mpirun binds each rank to a core by default; CONFIGS may add
# dp2-mpi-nobind / dp2-lock-mpi-nobind (--bind-to none) and dp1-pinned (taskset -c 0) to compare.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-target/bench-dp}
mkdir -p "$OUT"
BIN=${SPECULA_MPI_BIN:-$PWD/target/release/specula-mpi}
# shellcheck source=bench_common.sh
source scripts/bench_common.sh
MODEL=${SPECULA_MODEL:-$(model_path)}
PORT=${PORT:-18555}
BENCH=("$BIN" bench serve --base-url "http://127.0.0.1:$PORT" --max-concurrency 8 --random-input-len 128 --random-output-len 64 --no-progress)
MPIRUN=(mpirun --allow-run-as-root --oversubscribe -np 2)


one() {
  local name=$1; shift
  echo "== $name: $* (load average $(cut -d' ' -f1-3 /proc/loadavg))"
  "$@" --model "$MODEL" --port "$PORT" >"$OUT/$name.server.log" 2>&1 &
  local pid=$!
  if ! wait_up; then echo "   server did not come up (see $OUT/$name.server.log)"; kill "$pid"; wait "$pid"; return; fi
  "${BENCH[@]}" --num-prompts 8 --seed 1 >/dev/null 2>&1 # warm-up
  curl -s "http://127.0.0.1:$PORT/metrics" >"$OUT/$name.metrics.before"
  local t0 t1; t0=$(date +%s.%N)
  "${BENCH[@]}" --num-prompts 32 --seed 0 --label "$name" --output-json "$OUT/$name.json" >"$OUT/$name.bench.txt" 2>&1
  t1=$(date +%s.%N)
  curl -s "http://127.0.0.1:$PORT/metrics" >"$OUT/$name.metrics.after"
  echo "$t0 $t1" >"$OUT/$name.wall"
  kill -TERM "$pid"; wait "$pid"
}

run() {
  case $1 in
    dp1)                 one "$1" "$BIN" serve --speculative-method none --threads 1 ;;
    dp1-pinned)          one "$1" taskset -c 0 "$BIN" serve --speculative-method none --threads 1 ;;
    dp2-local)           one "$1" "$BIN" serve --speculative-method none --threads 2 --data-parallel-size 2 ;;
    dp2-mpi)             one "$1" "${MPIRUN[@]}" "$BIN" serve --speculative-method none --threads 1 --data-parallel-backend mpi ;;
    dp2-mpi-nobind)      one "$1" "${MPIRUN[@]}" --bind-to none "$BIN" serve --speculative-method none --threads 1 --data-parallel-backend mpi ;;
    dp2-lock-local)      one "$1" "$BIN" serve --speculative-method none --threads 2 --data-parallel-size 2 --data-parallel-mode lockstep ;;
    dp2-lock-mpi)        one "$1" "${MPIRUN[@]}" "$BIN" serve --speculative-method none --threads 1 --data-parallel-backend mpi --data-parallel-mode lockstep ;;
    dp2-lock-mpi-nobind) one "$1" "${MPIRUN[@]}" --bind-to none "$BIN" serve --speculative-method none --threads 1 --data-parallel-backend mpi --data-parallel-mode lockstep ;;
    *) echo "unknown config $1" ;;
  esac
}

CONFIGS=${CONFIGS:-dp1 dp2-local dp2-mpi dp2-lock-local dp2-lock-mpi}
for c in $CONFIGS; do run "$c"; done

python3 - "$OUT" $CONFIGS <<'EOF'
import json, re, sys
out, names = sys.argv[1], sys.argv[2:]

def counters(path):
    d = {}
    for line in open(path):
        m = re.match(r'^(specula:dp_\w+)\{rank="(\d+)"\}\s+(\S+)', line)
        if m:
            d[(m.group(1), int(m.group(2)))] = float(m.group(3))
    return d

print("| config | output tok/s | TTFT p99 (ms) | TPOT mean (ms) | metadata collective share of wall time, rank 0 / 1 | per agreement (us), rank 0 / 1 |")
print("|---|---|---|---|---|---|")
for name in names:
    try:
        r = json.load(open(f"{out}/{name}.json"))["results"][0]
    except (OSError, KeyError, IndexError, ValueError) as e:
        print(f"| {name} | no result ({e}) | | | | |")
        continue
    share = per = "-"
    if "lock" in name:
        b, a = counters(f"{out}/{name}.metrics.before"), counters(f"{out}/{name}.metrics.after")
        t0, t1 = map(float, open(f"{out}/{name}.wall").read().split())
        cells = []
        for rank in (0, 1):
            dc = a[("specula:dp_collective_seconds_total", rank)] - b[("specula:dp_collective_seconds_total", rank)]
            dn = a[("specula:dp_agreements_total", rank)] - b[("specula:dp_agreements_total", rank)]
            cells.append((f"{100 * dc / (t1 - t0):.1f}%", f"{1e6 * dc / max(dn, 1):.0f}"))
        share, per = " / ".join(c[0] for c in cells), " / ".join(c[1] for c in cells)
    print(f"| {name} | {r['output_throughput']:.1f} | {r['ttft_ms']['p99']:.0f} | {r['tpot_ms']['mean']:.1f} | {share} | {per} |")
EOF
