#!/usr/bin/env python3
"""Issue #52's floors from interleaved rounds: us beside llama.cpp and ik_llama.cpp.

Each round runs `specula bench offline` once per model (llama.cpp's and ik_llama.cpp's
`llama-bench` inside the same process run, on the same file and thread counts), the models
alternating, so a drift of the shared host hits every engine of a round alike. Prints each
round's figures, then the medians over the rounds and the floors with their verdicts: a floor is
met when the median of the per-round ratios meets it, and the table says in how many rounds it did.
Each round's own bounds (the best read kernel's GB/s, the int8 peak, every engine's share of
them) go to stderr as `bench offline` prints them: what a miss is explained against.

  python3 scripts/bench_floors.py --rounds 3 --llama-bench PATH/llama-bench \\
      --ik-bench "$(bash scripts/build_ik_llama.sh)" \\
      dense=qwen2.5-coder-1.5b-instruct moe=/tmp/q3moe12.gguf

A model is `KIND=MODEL`: KIND `dense` (prefill 512 >= 1.3x ik_llama.cpp) or `moe` (decode at
batch 1 >= 1.1x ik_llama.cpp and >= 1.3x llama.cpp, prefill 512 >= 1.2x ik_llama.cpp; two
threads >= 1.8x one for prefill and >= 1.3x for decode); MODEL a name `specula` knows or a GGUF
path (`python/make_shape_gguf.py --shape qwen3-30b-a3b --layers 12` writes the MoE shape).
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PREFILL = "prefill"
DECODE = "decode"
ENGINES = ("specula", "llama.cpp", "ik_llama")
# (kind, what, against, floor): ours / theirs at the same thread count
RATIO_FLOORS = [
    ("dense", PREFILL, "ik_llama", 1.3),
    ("moe", DECODE, "ik_llama", 1.1),
    ("moe", DECODE, "llama.cpp", 1.3),
    ("moe", PREFILL, "ik_llama", 1.2),
]
# (kind, what, floor): ours at two threads / ours at one
SCALING_FLOORS = [("moe", PREFILL, 1.8), ("moe", DECODE, 1.3)]


def one_run(args, model: str) -> dict:
    """{(what, threads): {engine: tok/s}} of one `bench offline` process."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [
            args.specula, "bench", "offline", "--model", model, "--threads", args.threads, "--batch", "1",
            "--decode-steps", str(args.decode_steps), "--reps", str(args.reps), "--no-baseline",
            "--output-json", out.name,
        ]
        if args.llama_bench:
            cmd += ["--llama-bench", args.llama_bench]
        if args.ik_bench:
            cmd += ["--ik-bench", args.ik_bench]
        print("$", " ".join(cmd), file=sys.stderr, flush=True)
        shown = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout.splitlines()
        rows = json.loads(Path(out.name).read_text())
    # the run's own bounds (read GB/s of the best read kernel, the int8 peak, each engine's share
    # of them): what a floor's miss is explained against, measured beside the figures
    at = next((i for i, line in enumerate(shown) if line.startswith("memory bound")), len(shown))
    print("\n".join(shown[at:]), file=sys.stderr, flush=True)
    got = {}
    for r in rows:
        m = r["measurement"]
        what = PREFILL if m.startswith("prefill") else DECODE if m == "decode batch 1" else None
        if what is None:
            continue
        got[(what, r["threads"])] = {"specula": r["specula_tok_s"], "llama.cpp": r.get("llama_cpp_tok_s"), "ik_llama": r.get("ik_llama_cpp_tok_s")}
    return got


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", help="KIND=MODEL, KIND dense or moe")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--specula", default=str(Path(__file__).resolve().parent.parent / "target/release/specula"))
    p.add_argument("--llama-bench")
    p.add_argument("--ik-bench")
    args = p.parse_args()
    models = []
    for m in args.models:
        kind, sep, model = m.partition("=")
        if not sep or kind not in ("dense", "moe"):
            p.error(f"{m!r}: expected dense=MODEL or moe=MODEL")
        models.append((kind, model))
    threads = [int(t) for t in args.threads.split(",")]

    # runs[model][round] = one_run(...)
    runs = {model: [] for _, model in models}
    for r in range(args.rounds):
        for _, model in models:
            runs[model].append(one_run(args, model))
            print(f"round {r + 1}: {model} done", file=sys.stderr, flush=True)

    print("| model | measurement | threads | round | specula | llama.cpp | ik_llama.cpp |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for _, model in models:
        for what in (PREFILL, DECODE):
            for t in threads:
                for r, run in enumerate(runs[model]):
                    e = run.get((what, t), {})
                    print(f"| {Path(model).name} | {what} | {t} | {r + 1} | " + " | ".join(fmt(e.get(n)) for n in ENGINES) + " |")
                med = [median([run.get((what, t), {}).get(n) for run in runs[model]]) for n in ENGINES]
                print(f"| {Path(model).name} | {what} | {t} | **median** | " + " | ".join(f"**{fmt(x)}**" for x in med) + " |")

    print("\n| model | floor | threads | per-round ratios | median | rounds meeting it | verdict |")
    print("|---|---|---:|---|---:|---:|---|")
    for kind, model in models:
        name = Path(model).name
        for k, what, other, floor in RATIO_FLOORS:
            if k != kind:
                continue
            for t in threads:
                ratios = [
                    run[(what, t)]["specula"] / run[(what, t)][other]
                    for run in runs[model]
                    if (what, t) in run and run[(what, t)].get(other)
                ]
                verdict(name, f"{what} >= {floor}x {other}", t, ratios, floor)
        for k, what, floor in SCALING_FLOORS:
            if k != kind or not {1, 2} <= set(threads):
                continue
            ratios = [run[(what, 2)]["specula"] / run[(what, 1)]["specula"] for run in runs[model] if (what, 1) in run and (what, 2) in run]
            verdict(name, f"{what} two threads >= {floor}x one", 2, ratios, floor)
    return 0


def verdict(name, what, t, ratios, floor):
    if not ratios:
        print(f"| {name} | {what} | {t} | - | - | - | not measured |")
        return
    med = statistics.median(ratios)
    meeting = sum(r >= floor for r in ratios)
    print(
        f"| {name} | {what} | {t} | {', '.join(f'{r:.2f}' for r in ratios)} | {med:.2f} | {meeting} of {len(ratios)} | "
        + ("met" if med >= floor else "**missed**")
        + " |"
    )


if __name__ == "__main__":
    sys.exit(main())
