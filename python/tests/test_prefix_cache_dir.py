"""The prefix cache's disk tier through the binary (`--prefix-cache-dir`), as an agent meets it: a
long system prompt prefilled by one `specula serve` process is loaded, not computed, by the next
process on the same folder; the answer and its logprobs are the same; the `openai` SDK's usage
and `/metrics` say where the prompt came from; corrupt files are ignored with a warning and the
answer is still the same; another KV type never reads the first one's files.
"""

from __future__ import annotations

from pathlib import Path

import openai

from server_fixture import running_server

# an agent-style system prompt of about 1500 tokens, unique to this test
SYSTEM = "You are a coding agent for the specula repository. " + " ".join(
    f"Rule {i}: before editing module number {i}, read its tests, keep its public names, and run the checks." for i in range(60))
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which rule is about module 7?"}]


def _ask(srv):
    oa = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", timeout=300)
    r = oa.chat.completions.create(model=srv.model_name, messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    lps = [(t.token, t.logprob) for t in r.choices[0].logprobs.content]
    return r.choices[0].message.content, lps, r.usage


def _files(root: Path) -> list[Path]:
    return sorted(root.glob("*/*.kvb"))


def test_a_prompt_prefilled_by_one_process_is_loaded_by_the_next(tmp_path):
    cache = tmp_path / "prefix-cache"
    with running_server("--prefix-cache-dir", str(cache)) as a:
        assert f"then {cache}" in a.log_tail(20000), a.log_tail(3000)
        text, lps, usage = _ask(a)
        assert usage.prompt_tokens > 1000 and usage.prompt_tokens_details.cached_tokens == 0, usage
        a.wait_idle()
    files = _files(cache)
    # every whole block of the prompt (16 tokens each) is on disk once the first server is gone
    assert len(files) >= usage.prompt_tokens // 16, (len(files), usage.prompt_tokens)
    assert len({f.parent for f in files}) == 1, "one namespace folder for one model and KV type"

    with running_server("--prefix-cache-dir", str(cache)) as b:
        text2, lps2, usage2 = _ask(b)
        assert usage2.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16, usage2
        assert (text2, lps2) == (text, lps), "the loaded KV gives the same answer and logprobs"
        m = b.wait_idle()
        assert m["specula:prefix_cache_disk_hits"] == usage2.prompt_tokens_details.cached_tokens, m

    # another KV type: its own namespace, nothing read from the f16 files
    with running_server("--prefix-cache-dir", str(cache), "--kv-cache-dtype", "f32") as c:
        _, _, usage3 = _ask(c)
        assert usage3.prompt_tokens_details.cached_tokens == 0, usage3

    # a byte flipped in every f16 file: each is refused with a warning, never loaded
    for f in _files(cache):
        if f.parent == files[0].parent:
            b = bytearray(f.read_bytes())
            b[len(b) // 2] ^= 0x10
            f.write_bytes(bytes(b))
    with running_server("--prefix-cache-dir", str(cache)) as d:
        text4, lps4, usage4 = _ask(d)
        assert usage4.prompt_tokens_details.cached_tokens == 0, usage4
        assert (text4, lps4) == (text, lps)
        assert "prefix cache file ignored: corrupt: checksum mismatch" in d.log_tail(200000), d.log_tail(3000)
