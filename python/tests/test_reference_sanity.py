"""The oracles validated on their own (no Rust binary needed).

If the NumPy reference were wrong (e.g. NeoX instead of llama.cpp-normal RoPE pairing on GGUF's
permuted Q/K weights, a wrong GQA head mapping, a missing norm), a 135M model would stop
completing obvious facts and its perplexity on plain English would jump.
"""

import functools

import numpy as np
import pytest

import reference_forward as rf
import tokenizer_oracle as to
from prompts import LONG


@functools.lru_cache(maxsize=None)
def _ref(model_path, ids, **kw):
    return rf.forward(model_path, list(ids), **kw)


def ref(model_path, ids, **kw):
    return _ref(model_path, tuple(ids), **kw)


def mean_nll(logits, ids):
    lg = logits.astype(np.float64)
    m = lg.max(-1, keepdims=True)
    lse = (np.log(np.exp(lg - m).sum(-1, keepdims=True)) + m)[:, 0]
    n = len(ids) - 1
    return float(np.mean(lse[:n] - lg[np.arange(n), np.asarray(ids[1:])]))


@pytest.mark.parametrize(
    "prompt,expected",
    [
        ("The capital of France is", " Paris"),
        ("The opposite of hot is", " cold"),
        ("Water freezes at 0 degrees", " Celsius"),
        ("The chemical symbol for gold is", " Au"),
        ("The largest planet in the solar system is", " Jupiter"),
    ],
)
def test_reference_completes_obvious_facts(model_path, oracle_tokenizer, prompt, expected):
    ids = to.encode(model_path, prompt)
    logits = ref(model_path, ids, last_only=True)[-1]
    top = [oracle_tokenizer.decode([int(i)]) for i in np.argsort(-logits)[:5]]
    assert top[0] == expected, f"{prompt!r}: reference top-5 {top}"


def test_reference_greedy_chat_answer(model_path, oracle_tokenizer):
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    ids = to.encode(model_path, prompt)
    im_end = oracle_tokenizer.token_to_id("<|im_end|>")
    out = []
    for _ in range(12):
        nxt = int(np.argmax(rf.forward(model_path, ids + out, last_only=True)[-1]))
        if nxt == im_end:
            break
        out.append(nxt)
    text = oracle_tokenizer.decode(out)
    assert "Paris" in text, f"greedy answer {text!r}"


def test_reference_perplexity_and_rope_pairing(model_path):
    """Plain English has low NLL; the NeoX pairing (wrong for GGUF llama) is clearly worse.
    Measured: normal-mode RoPE 2.76 nats/token on LONG, NeoX pairing 5.13."""
    ids = to.encode(model_path, LONG)
    good = mean_nll(ref(model_path, ids), ids)
    bad = mean_nll(ref(model_path, ids, rope="neox"), ids)
    assert good < 3.3, good
    assert bad > good + 1.0, (good, bad)


def test_reference_is_causal_and_float32_is_accurate(model_path):
    ids = to.encode(model_path, "Numbers: 1234567, and a URL https://example.com/x?y=1 <|im_end|>")
    full = ref(model_path, ids)
    prefix = rf.forward(model_path, ids[:7])
    # Rows of a prefix only depend on the prefix (float32 BLAS may block sums differently).
    np.testing.assert_allclose(prefix, full[:7], atol=2e-3, rtol=0)
    # float32 vs float64 reference: the reference's own numerical noise floor (measured ~1e-4 max abs),
    # four orders of magnitude below the engine tolerance in test_logits_oracle.py.
    f64 = rf.forward(model_path, ids, dtype="float64")
    assert np.abs(full - f64).max() < 2e-3


def test_reference_cli(model_path, tmp_path):
    out = tmp_path / "l.npy"
    assert rf.main(["--model", model_path, "--tokens", "504,3575,282,4649,314", "--out", str(out)]) == 0
    a = np.load(out)
    assert a.shape == (5, rf.load_weights(model_path).cfg.vocab) and a.dtype == np.float32
