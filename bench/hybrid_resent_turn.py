"""A resent agent turn on a hybrid model, with and without its prefix cache.

Starts `specula serve` twice on the same file (`--enable-prefix-caching false`, then the
default, which for a hybrid keeps recurrent-state checkpoints), sends each a two-turn
conversation as agents send it (a long system prompt and a request; then the same with the
answer and a new request appended, resent whole), and prints a table: each turn's prompt tokens,
cached tokens and time to the answer (8 tokens). `--rules` sets the system prompt's length.

    python3 bench/hybrid_resent_turn.py --model /tmp/q35-4b-nextn.gguf [--specula target/release/specula]
"""

import argparse
import json
import subprocess
import time

try:
    import httpx
except ImportError:  # newer openai releases ship its successor
    import httpx2 as httpx

def turn1(rules: int) -> list:
    text = " ".join(f"Rule {i}: keep edits small and run the tests after each change." for i in range(rules))
    return [
        {"role": "system", "content": "You are a coding agent working in a repository. " + text},
        {"role": "user", "content": "List the files and read main.rs."},
    ]


def ask(base: str, messages: list) -> tuple[float, int, int, str]:
    t = time.time()
    r = httpx.post(base + "/v1/chat/completions", json={"messages": messages, "max_tokens": 8, "temperature": 0}, timeout=3600)
    r.raise_for_status()
    j = r.json()
    cached = (j["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return time.time() - t, j["usage"]["prompt_tokens"], cached, j["choices"][0]["message"].get("content") or ""


def session(specula: str, model: str, port: int, flags: list[str], rules: int) -> list[tuple[float, int, int, str]]:
    proc = subprocess.Popen([specula, "serve", "--model", model, "--port", str(port), "--max-model-len", "32768", *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        first = ask(base, turn1(rules))
        turn2 = turn1(rules) + [{"role": "assistant", "content": first[3] or "ok"}, {"role": "user", "content": "Now run the tests and report."}]
        return [first, ask(base, turn2)]
    finally:
        proc.terminate()
        proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--specula", default="target/release/specula")
    ap.add_argument("--port", type=int, default=8093)
    ap.add_argument("--rules", type=int, default=60, help="lines of the system prompt (60: about 3.4k tokens; 290: about 16k)")
    ap.add_argument("--cached-only", action="store_true",
                    help="only the server with the cache (its cold first turn is the baseline: a long prompt takes minutes a turn)")
    a = ap.parse_args()
    rows = []
    servers = [("no prefix cache", ["--enable-prefix-caching", "false"]), ("state checkpoints (default)", [])]
    for name, flags in servers[1:] if a.cached_only else servers:
        for turn, (secs, prompt, cached, _) in enumerate(session(a.specula, a.model, a.port, flags, a.rules), 1):
            rows.append((name, turn, prompt, cached, secs))
    print("| server | turn | prompt tokens | cached | time to the answer, s |")
    print("|---|---:|---:|---:|---:|")
    for name, turn, prompt, cached, secs in rows:
        print(f"| {name} | {turn} | {prompt} | {cached} | {secs:.2f} |")
    print(json.dumps([dict(zip(("server", "turn", "prompt", "cached", "seconds"), r)) for r in rows]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
