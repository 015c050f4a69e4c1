#!/usr/bin/env python3
"""Writes long coding-agent sessions (16k-64k prompt tokens) as a `bench serve` chat dataset:

    python3 bench/make_long_agent_sessions.py --output /tmp/long_agent.jsonl --max-tokens 32768
    specula bench serve --endpoint /v1/chat/completions --dataset file \\
        --dataset-path /tmp/long_agent.jsonl --max-concurrency 1 --base-url http://127.0.0.1:8000

A session is what a Claude-Code-style agent sends: a long system prompt (instructions and the
schemas of its tools, written here), a task, then turns that each append the agent's previous
tool call and the tool's result: whole source files read from this machine's Python standard
library, a directory listing, a test run's output. Every line of the file is the conversation up
to a turn the server under test writes (a tool call or a short answer), so each line resends the
one before it whole, as agents do, and the prefix cache should serve all but the new part.

The agent's own turns are written here (tool calls in JSON), not recorded from a model: the
benchmark measures time to first token, the cached share and decode at depth, which do not
depend on what the model would have said. Sizes are counted with 3.2 characters per token (code
through a byte-level BPE); the server reports the exact counts (`usage.prompt_tokens`).
"""
import argparse
import json
import sysconfig
from pathlib import Path

CHARS_PER_TOKEN = 3.2

TOOLS = [
    ("read_file", "Read a file from the repository. Returns the whole file with line numbers. Use it before editing a "
     "file; never guess a file's contents. Paths are relative to the repository root.",
     {"path": "string: the file to read", "offset": "integer: first line (optional)", "limit": "integer: lines (optional)"}),
    ("edit_file", "Replace an exact span of a file with new text. The old text must appear exactly once in the file, "
     "with its indentation; include enough context lines to make it unique. Returns the diff.",
     {"path": "string", "old_text": "string: the exact text to replace", "new_text": "string: its replacement"}),
    ("write_file", "Create a file or overwrite one whole. Prefer edit_file for changes to existing files.",
     {"path": "string", "content": "string: the whole file"}),
    ("run_command", "Run a shell command in the repository root and return its exit status, standard output and "
     "standard error (each cut to 30000 characters). Commands time out after 120 seconds. Do not start servers.",
     {"command": "string", "timeout": "integer: seconds (optional)"}),
    ("search", "Search the repository's files for a regular expression; returns matching lines with file:line.",
     {"pattern": "string: a Rust-syntax regular expression", "path": "string: a folder to search (optional)",
      "glob": "string: e.g. *.py (optional)"}),
    ("list_dir", "List a folder's entries with sizes; folders end in a slash.", {"path": "string"}),
    ("todo", "Keep the task list: add, start, finish or drop items. Keep exactly one item in progress.",
     {"action": "string: add | start | finish | drop", "item": "string"}),
]

INSTRUCTIONS = """You are a coding agent working in the user's repository through the tools below.

# How you work
- Understand before you change: read the files involved, search for the names you will touch,
  and run the tests that cover them before and after your change.
- Make the smallest change that solves the task. Keep the code's existing style, naming and
  structure; do not reformat lines you do not change; do not add dependencies without need.
- Every change is verified: run the relevant tests; if none exist, write one that fails before
  your change and passes after it.
- Never invent file contents, APIs or command output. When a tool fails, read its error and adapt.
- Keep the user informed in one or two sentences per step; no long explanations.

# Tool use
- Call one tool at a time as a JSON object {"tool": NAME, "arguments": {...}} and wait for its result.
- Paths are relative to the repository root. Quote exact text when editing.
- Long outputs are cut; narrow the command rather than reading everything.

# Safety
- Do not run destructive commands (rm -rf, git reset --hard, force pushes) without being asked.
- Do not read or print secrets (.env files, keys, tokens).
- Stay inside the repository.

# Style of answers
- Tool calls only while working; a final answer of at most three sentences naming what changed.
"""


def system_prompt() -> str:
    parts = [INSTRUCTIONS, "\n# Tools\n"]
    for name, desc, params in TOOLS:
        schema = {"type": "object", "properties": {k: {"type": v.split(":")[0], "description": v} for k, v in params.items()},
                  "required": [k for k, v in params.items() if "optional" not in v]}
        parts.append(f"## {name}\n{desc}\nParameters (JSON schema):\n{json.dumps(schema, indent=2)}\n")
    return "\n".join(parts)


def sources() -> list[Path]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in sorted(lib.glob("*.py")) if 3000 < p.stat().st_size < 20000]


def call(tool: str, **args) -> str:
    return json.dumps({"tool": tool, "arguments": args})


def session(files: list[Path], budget_tokens: int, turn_tokens: int, sid: int):
    """Yields (messages, kind) at each turn the server writes, until the prompt passes the budget."""
    msgs = [{"role": "system", "content": system_prompt()},
            {"role": "user", "content": f"The tests in test_{files[0].stem}.py fail after the last refactoring. "
                                        "Find out why and fix the code, not the tests."}]
    size = sum(len(m["content"]) for m in msgs) / CHARS_PER_TOKEN
    fi = 0
    next_turn = turn_tokens
    kinds = ["tool call", "tool call", "answer"]
    turn = 0
    while size < budget_tokens and fi < len(files):
        f = files[fi]
        fi += 1
        msgs.append({"role": "assistant", "content": call("read_file", path=f"lib/{f.name}")})
        text = f.read_text(errors="replace")
        numbered = "\n".join(f"{i + 1:5}\t{line}" for i, line in enumerate(text.splitlines()))
        msgs.append({"role": "user", "content": f"<tool_result tool=\"read_file\" path=\"lib/{f.name}\">\n{numbered}\n</tool_result>"})
        size += (len(msgs[-1]["content"]) + len(msgs[-2]["content"])) / CHARS_PER_TOKEN
        if size >= next_turn:
            kind = kinds[turn % len(kinds)]
            ask = list(msgs)
            if kind == "answer":
                ask.append({"role": "user", "content": "Before you go on: in one sentence, what have you found so far?"})
            yield ask, kind, int(size)
            turn += 1
            next_turn = size + turn_tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output", required=True)
    ap.add_argument("--min-tokens", type=int, default=16384, help="the first turn the server writes comes at this size")
    ap.add_argument("--max-tokens", type=int, default=32768, help="the session ends past this size")
    ap.add_argument("--turn-tokens", type=int, default=4096, help="new tokens between two turns the server writes")
    ap.add_argument("--sessions", type=int, default=1)
    ap.add_argument("--answer-tokens", type=int, default=64)
    a = ap.parse_args()
    files = sources()
    n = 0
    with open(a.output, "w") as out:
        for s in range(a.sessions):
            # each session its own files (rotated), so sessions share only the system prompt
            rot = files[s * 7 % len(files):] + files[:s * 7 % len(files)]
            for msgs, kind, size in session(rot, a.max_tokens, a.turn_tokens, s):
                if size < a.min_tokens:
                    continue
                out.write(json.dumps({"messages": msgs, "max_tokens": a.answer_tokens, "conversation": s, "kind": kind}) + "\n")
                n += 1
    print(f"{n} turns written to {a.output}")


if __name__ == "__main__":
    main()
