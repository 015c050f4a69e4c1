#!/usr/bin/env python3
"""Benchmark of the shipped mtp head (heads/README.md): `specula bench serve` against `specula serve`
on the held-out chat prompts, with no speculation, n-gram and mtp, at concurrency 1 and 8 and
k = 1..4. Prints a markdown table (output tok/s, acceptance per position, mean tokens per verify
step) and writes every run's JSON under --out. Not a test: timings depend on the machine's load.

    python3 heads/bench_mtp.py --specula target/release/specula --num-prompts 16
    # compare head files in one run (each as mtp(NAME)); --no-adaptive drafts k every step
    python3 heads/bench_mtp.py --methods mtp --head a.safetensors --head b.safetensors --no-adaptive
    # a configuration with extra serve flags: METHOD+--flag=value
    python3 heads/bench_mtp.py --methods none,mtp,mtp+--speculative-min-confidence=0.4 --ks 3 --concurrency 1
    # concurrency 1 on a noisy machine: all servers up, each prompt to every configuration in turn
    python3 heads/bench_mtp.py --methods none,ngram,mtp --ks 3 --num-prompts 16 --repeat 2 --paired
    # throughput on a noisy machine: every configuration --repeat times in interleaved rounds,
    # the table gives the median, the range and the median of the per-round ratios to `none`
    python3 heads/bench_mtp.py --methods none,ngram,mtp --ks 3 --concurrency 1,8 --repeat 5
"""
import statistics
import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))


def metrics(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    per_pos, totals = {}, {}
    for line in text.splitlines():
        if line.startswith("#") or "spec_decode_" not in line:
            continue
        name, value = line.rsplit(" ", 1)
        m = re.search(r'accepted_tokens_per_pos[a-z_]*\{.*position="(\d+)"', name)
        if m:
            per_pos[int(m.group(1))] = per_pos.get(int(m.group(1)), 0.0) + float(value)
            continue
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            if re.search(rf"spec_decode_{key}(_total)?(\{{|$)", name):
                totals[key] = totals.get(key, 0.0) + float(value)
    return per_pos, totals


def phases(port):
    """Per-phase step time sums and step counts from /metrics (`specula:step_phase_seconds`)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r'specula:step_phase_seconds_(sum|count)\{phase="(\w+)"\} (\S+)', line)
        if m:
            out.setdefault(m.group(2), {})[m.group(1)] = float(m.group(3))
    return out


def wait_ready(port, proc, timeout=120):
    start = time.time()
    while time.time() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except Exception:
            time.sleep(0.5)
    raise RuntimeError("server did not become ready")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--specula", default="target/release/specula")
    ap.add_argument("--prompts", default=os.path.join(HERE, "heldout-prompts.jsonl"))
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--methods", default="none,ngram,mtp")
    ap.add_argument("--port", type=int, default=8391)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="target/bench-mtp")
    ap.add_argument("--head", action="append", default=[],
                    help="mtp head file to compare (repeatable; default: the head built into the binary)")
    ap.add_argument("--no-adaptive", action="store_true", help="always draft k tokens (--no-speculative-adaptive)")
    ap.add_argument("--repeat", type=int, default=1, help="interleaved rounds over all configurations (medians in the table)")
    ap.add_argument("--paired", action="store_true",
                    help="concurrency 1 only: every configuration's server up at once, each prompt sent to all of them back to back")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rows = []
    configs = []
    for method in a.methods.split(","):
        if method == "none":
            configs.append((method, 0))
        elif method == "mtp" and a.head:
            configs.extend((f"mtp:{h}", int(k)) for h in a.head for k in a.ks.split(","))
        else:
            configs.extend((method, int(k)) for k in a.ks.split(","))
    if a.paired:
        return paired(a, configs)
    for rnd, (method, k) in ((r, c) for r in range(a.repeat) for c in configs):
        proc = subprocess.Popen(serve_cmd(a, method, k, a.port), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            wait_ready(a.port, proc)
            for c in a.concurrency.split(","):
                before = metrics(a.port)
                label = f"{short(method)}-k{k}-c{c}" + (f"-r{rnd}" if a.repeat > 1 else "")
                out_json = os.path.join(a.out, f"{label}.json")
                subprocess.run(bench_cmd(a, a.port, a.prompts, a.num_prompts, c, out_json) + ["--label", label], check=True, stdout=subprocess.DEVNULL)
                r = json.load(open(out_json))
                r = r[0] if isinstance(r, list) else r
                r = r.get("runs", [r])[0] if isinstance(r.get("runs"), list) else r
                st = spec_stats(before, metrics(a.port))
                rows.append((rnd, short(method), k, int(c), r, st))
                tps = find(r, "output_throughput")
                print(f"{label}: {tps:.1f} output tok/s, per position {[round(x, 3) for x in st['per_pos']]}, tokens per verify step {st['mean_len']}", file=sys.stderr)
        finally:
            proc.terminate()
            proc.wait()
    print_table(rows, a.repeat)


def bench_cmd(a, port, prompts, num_prompts, concurrency, out_json):
    """`specula bench serve` at concurrency `concurrency` on `num_prompts` of the JSONL `prompts`, greedy."""
    return [a.specula, "bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/chat/completions",
            "--dataset", "file", "--dataset-path", prompts, "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
            "--temperature", "0", "--output-json", out_json, "--no-progress"]


def spec_stats(before, after):
    """Speculation counters between two `metrics` readings: acceptance per position (of the
    drafts), tokens per verify step, drafts and the mean draft length."""
    pos = {p: after[0].get(p, 0) - before[0].get(p, 0) for p in after[0]}
    tot = {key: after[1].get(key, 0) - before[1].get(key, 0) for key in after[1]}
    drafts = tot.get("num_drafts", 0)
    return {
        "per_pos": [pos[p] / drafts for p in sorted(pos)] if drafts else [],
        "mean_len": 1 + tot.get("num_accepted_tokens", 0) / drafts if drafts else None,
        "mean_k": tot.get("num_draft_tokens", 0) / drafts if drafts else None,
        "drafts": int(drafts),
    }


def spec_cells(st):
    """The table's last four cells for `spec_stats`."""
    pp = ", ".join(f"{x:.2f}" for x in st["per_pos"]) or "-"
    ml = f"{st['mean_len']:.2f}" if st["mean_len"] else "-"
    mk = f"{st['mean_k']:.2f}" if st["mean_k"] else "-"
    return f"{pp} | {ml} | {st['drafts']} | {mk}"


def serve_cmd(a, method, k, port):
    cmd = [a.specula, "serve", "--port", str(port)]
    if a.threads:
        cmd += ["--threads", str(a.threads)]
    if method != "none":
        # adaptive k stays on (the shipped default): it drafts at most k, and nothing when
        # more than --speculative-max-batch sequences decode.
        # `mtp+--flag=value+...`: extra serve flags for this configuration
        method_name, *extra = method.split("+")
        name, _, head = method_name.partition(":")
        cmd += ["--speculative-method", name, "--num-speculative-tokens", str(k)] + extra
        if head:
            cmd += ["--draft-model", head]
        if a.no_adaptive:
            cmd.append("--no-speculative-adaptive")
    return cmd


def paired(a, configs):
    """Concurrency 1, one server per configuration, all running (idle ones cost nothing): each
    prompt goes to every configuration back to back, in an order that rotates, so the machine's
    drift (on shared hosts it moves throughput by 10-30% within a minute) hits every configuration
    alike. Throughput = output tokens / request time summed over the prompts; the ratio to `none`
    is the geometric mean of the per-prompt-and-round ratios."""
    prompts = [line for line in open(a.prompts) if line.strip()][: a.num_prompts]
    procs, before = [], {}
    try:
        for i, (method, k) in enumerate(configs):
            procs.append(subprocess.Popen(serve_cmd(a, method, k, a.port + i), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        for i, p in enumerate(procs):
            wait_ready(a.port + i, p)
            before[i] = metrics(a.port + i)
        tokens, secs, per = {}, {}, {}
        for rnd in range(a.repeat):
            for j, line in enumerate(prompts):
                path = os.path.join(a.out, f"prompt-{j}.jsonl")
                with open(path, "w") as f:
                    f.write(line)
                shift = (rnd * len(prompts) + j) % len(configs)
                for i in [(x + shift) % len(configs) for x in range(len(configs))]:
                    out_json = os.path.join(a.out, f"paired-{i}.json")
                    subprocess.run(bench_cmd(a, a.port + i, path, 1, 1, out_json), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    r = json.load(open(out_json))
                    n, t = find(r, "total_output_tokens"), find(r, "duration_s")
                    tokens[i] = tokens.get(i, 0) + n
                    secs[i] = secs.get(i, 0) + t
                    per[(i, rnd, j)] = n / t
        none = next((i for i, (m, _) in enumerate(configs) if m == "none"), None)
        print(f"| method | k | output tok/s (concurrency 1, {len(prompts)} prompts x {a.repeat} rounds, paired) | vs none (geometric mean of paired ratios) | accepted per position | tokens per verify step | drafts | mean draft length |")
        print("|---|---|---|---|---|---|---|---|")
        step_lines = []
        for i, (method, k) in enumerate(configs):
            ratio = "-"
            if none is not None and i != none:
                logs = [math.log(per[(i, r, j)] / per[(none, r, j)]) for r in range(a.repeat) for j in range(len(prompts))]
                ratio = f"{math.exp(sum(logs) / len(logs)):.3f}"
            print(f"| {short(method)} | {k or '-'} | {tokens[i] / secs[i]:.1f} | {ratio} | {spec_cells(spec_stats(before[i], metrics(a.port + i)))} |")
            ph = phases(a.port + i)
            steps = ph.get("forward", {}).get("count", 0)
            if steps:
                ms = ", ".join(f"{name} {v.get('sum', 0) / steps * 1e3:.3f}" for name, v in sorted(ph.items()))
                step_lines.append(f"{short(method)}: {int(steps)} steps, {tokens[i] / steps:.2f} output tokens per step; ms per step: {ms}")
        for line in step_lines:
            print(line, file=sys.stderr)
    finally:
        for p in procs:
            p.terminate()
            p.wait()


def print_table(rows, repeat):
    """One line per configuration; with several rounds the median output tok/s, its range and the
    median over rounds of the ratio to `none` at the same concurrency (drift hits both alike)."""
    tps = {}
    for rnd, method, k, c, r, *_ in rows:
        tps.setdefault((method, k, c), {})[rnd] = find(r, "output_throughput")
    print("| method | k | concurrency | output tok/s" + (f" (median of {repeat}, range) | vs none (median ratio)" if repeat > 1 else "")
          + " | accepted per position | tokens per verify step | drafts | mean draft length |")
    print("|---|---|---|---|" + ("---|" if repeat > 1 else "") + "---|---|---|---|")
    seen = set()
    for rnd, method, k, c, r, st in rows:
        if (method, k, c) in seen:
            continue
        seen.add((method, k, c))
        t = tps[(method, k, c)]
        cell = f"{statistics.median(t.values()):.1f}"
        if repeat > 1:
            cell += f" ({min(t.values()):.1f}-{max(t.values()):.1f})"
            base = tps.get(("none", 0, c), {})
            ratios = [t[i] / base[i] for i in t if i in base and base[i]]
            cell += f" | {statistics.median(ratios):.3f}" if ratios and method != "none" else " | -"
        print(f"| {method} | {k or '-'} | {c} | {cell} | {spec_cells(st)} |")


def short(method):
    """`mtp:DIR/NAME.safetensors` -> `mtp(NAME)`, `mtp+--flag=v` -> `mtp[flag=v]`; others unchanged."""
    method, *extra = method.split("+")
    if extra:
        return short(method) + "[" + ",".join(e.lstrip("-") for e in extra) + "]"
    name, _, head = method.partition(":")
    if not head:
        return name
    base = os.path.basename(head)
    return f"{name}({base[:-len('.safetensors')] if base.endswith('.safetensors') else base})"


def find(obj, key):
    """First value of `key` anywhere in a JSON tree."""
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        for v in obj.values():
            x = find(v, key)
            if x is not None:
                return x
    elif isinstance(obj, list):
        for v in obj:
            x = find(v, key)
            if x is not None:
                return x
    return None


if __name__ == "__main__":
    main()
