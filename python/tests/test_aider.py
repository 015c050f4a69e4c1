"""A packaged coding agent against the real `specula serve`: aider (`pip install aider-chat`), run
non-interactively with a one-shot message on a small file, as a user would point it at a local
OpenAI-compatible server (`OPENAI_API_BASE`). Opt-in: `SPECULA_AIDER=1` (aider pulls in a few
hundred MB of packages the other tests do not need); `SPECULA_AIDER_BIN` names the `aider`
executable (default: the one on PATH), `SPECULA_AIDER_MODEL` the GGUF (default
Qwen2.5-Coder-0.5B-Instruct, as the other agent tests; the 1.5B writes a cleaner edit).

Oracles: aider itself (it parses the model's answer in its edit format and applies it to the file),
Python (the edited file must define a working `mul`), and the server without speculation (the same
agent run against a server with n-gram speculation and async scheduling must leave the same file
and the same token counts: aider asks for greedy decoding).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from server_fixture import SpeculaServer
from test_tokenizer_oracle import extra_model_path

pytestmark = pytest.mark.skipif(os.environ.get("SPECULA_AIDER") != "1", reason="opt-in: SPECULA_AIDER=1 (needs `pip install aider-chat`)")

CALC = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
MESSAGE = "Add a function mul(a, b) that returns a * b to calc.py."


def aider_bin() -> str:
    p = os.environ.get("SPECULA_AIDER_BIN") or shutil.which("aider")
    if not p:
        pytest.fail("SPECULA_AIDER=1 but no `aider` on PATH (pip install aider-chat, or set SPECULA_AIDER_BIN)")
    return p


def run_aider(srv: SpeculaServer, work: Path) -> tuple[str, str]:
    """aider's one-shot edit of calc.py in `work` against `srv`: (its output, the file after)."""
    work.mkdir()
    (work / "calc.py").write_text(CALC)
    env = {**os.environ, "OPENAI_API_BASE": f"{srv.base_url}/v1", "OPENAI_API_KEY": "none", "HOME": str(work)}
    cmd = [aider_bin(), "--model", f"openai/{srv.model_name}", "--no-git", "--yes-always", "--no-check-update",
           "--no-show-model-warnings", "--no-analytics", "--no-pretty", "--message", MESSAGE, "calc.py"]
    r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"aider exited {r.returncode}:\n{out[-3000:]}"
    return out, (work / "calc.py").read_text()


def test_aider_edits_a_file_through_the_server_and_speculation_changes_nothing(tmp_path):
    model = Path(os.environ.get("SPECULA_AIDER_MODEL") or extra_model_path("qwen05"))
    runs = {}
    for name, flags in {"plain": (), "ngram": ("--speculative-method", "ngram", "--async-scheduling")}.items():
        srv = SpeculaServer("--max-model-len", "4096", *flags)
        srv.model = model
        srv.start()
        try:
            runs[name] = run_aider(srv, tmp_path / name)
            assert srv.metrics().get('specula:request_success_total{finished_reason="stop"}', 0) >= 1, "aider's request never reached the engine"
        finally:
            srv.stop()
    out, edited = runs["plain"]
    assert "Applied edit to calc.py" in out, out[-3000:]
    scope: dict = {}
    exec(compile(edited, "calc.py", "exec"), scope)  # the agent's edit, as Python runs it
    assert scope["mul"](6, 7) == 42, edited
    # greedy through the whole agent: the same answer with speculation and async scheduling
    assert runs["ngram"][1] == edited
    tokens = [re.search(r"Tokens: (\S+) sent, (\S+) received", o) for o, _ in runs.values()]
    assert all(tokens) and len({t.groups() for t in tokens}) == 1, [t and t.group(0) for t in tokens]
    print(f"\naider on {model.name}: {tokens[0].group(0)}; calc.py after the edit:\n{edited}")
