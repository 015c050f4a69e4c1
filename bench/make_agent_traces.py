#!/usr/bin/env python3
"""Records bench/agent_traces.jsonl: multi-turn coding-agent conversations for
`specula bench serve --endpoint /v1/chat/completions --dataset file` (scripts/bench_agent.sh).

Each conversation is one agent session on one file of bench/make_code_bench.py, in aider's
manner (the harness shows the file, the model answers with whole files): a shared system prompt,
then turns that each append the agent's previous answer and the next request or tool result: an
edit (copies the file), a tool call (a JSON object), a second edit (copies the edited file), a
new test file (new code), a commit message (a short answer), a search (a tool call). The agent's answers are recorded from a
live server (greedy), so the history each turn carries is what a model really wrote; every line
holds the conversation up to the turn the server under test writes, so every server answers the
same prompts.

    specula serve --model qwen2.5-coder-0.5b-instruct --port 8000 &
    python3 bench/make_agent_traces.py --base-url http://127.0.0.1:8000

Recorded for the committed file with Qwen2.5-Coder-0.5B-Instruct (Q4_K_M), greedy.
"""
import argparse
import importlib.util
import json
import pathlib
import urllib.request

HERE = pathlib.Path(__file__).parent

SYSTEM = """Act as an expert software developer working in the user's repository.
The user shows you the files they want changed and asks for changes, one request after another.
Always use best practices when coding. Respect and use existing conventions, libraries and code
style that are already present in the code base.

When you change a file, reply with the complete updated file in one fenced code block, keeping every
line you do not need to change exactly as it was, and nothing else: no explanation before or after
the block. When you write a new file, reply with the whole file in one fenced code block.

When the user asks a question, answer in at most two sentences.
"""

TEST_CMD = {"py": "python -m pytest -q", "rs": "cargo test", "js": "npm test", "ts": "npm test", "go": "go test ./..."}


def load_code_bench():
    spec = importlib.util.spec_from_file_location("make_code_bench", HERE / "make_code_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.SNIPPETS, mod.EDITS


def chat(base_url, messages, max_tokens):
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(base_url.rstrip("/") + "/v1/chat/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.load(resp)["choices"][0]["message"]["content"] or ""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--out", default=str(HERE / "agent_traces.jsonl"))
    args = ap.parse_args()
    snippets, edits = load_code_bench()
    lines = []
    for n, (name, code) in enumerate(snippets.items()):
        ext = name.rsplit(".", 1)[1]
        test_name = f"test_{name.rsplit('.', 1)[0]}.{ext}" if ext == "py" else f"{name.rsplit('.', 1)[0]}_test.{ext}"
        # (what the user says, the kind of turn the agent then writes, its max_tokens)
        fence = {"py": "python", "rs": "rust", "js": "javascript", "ts": "typescript", "go": "go"}[ext]
        turns = [
            (f"`{name}`:\n```{fence}\n{code}```\n\n{edits[name][0]}", "edit", 640),
            ('Run the tests: reply only with a JSON object {"tool": "run", "command": COMMAND} on one line.', "tool_call", 48),
            (f"Output of `{TEST_CMD[ext]}`: exit code 0, all tests passed.\n\n{edits[name][1]}", "edit", 640),
            (f"Write unit tests for every function and method of `{name}` in a new file `{test_name}`.", "new_code", 384),
            ("Write the commit message for these changes: one line, at most 72 characters.", "answer", 48),
            ('Search the repository for other uses of the names you changed: reply only with a JSON object '
             '{"tool": "search", "pattern": REGEX} on one line.', "tool_call", 48),
        ]
        messages = [{"role": "system", "content": SYSTEM}]
        for i, (said, kind, max_tokens) in enumerate(turns):
            messages.append({"role": "user", "content": said})
            lines.append({"messages": list(messages), "max_tokens": max_tokens, "conversation": f"agent-{n}", "kind": kind})
            answer = chat(args.base_url, messages, max_tokens)
            print(f"{name} turn {i + 1} ({kind}): {len(answer)} chars")
            messages.append({"role": "assistant", "content": answer})
    with open(args.out, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    print(f"wrote {len(lines)} turns to {args.out}")


if __name__ == "__main__":
    main()
