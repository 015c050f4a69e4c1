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


def test_imrope_sections_follow_ggml_interleaving():
    """qwen35's interleaved M-RoPE (ggml_mrope_cache_init, is_imrope): for text the 4th position
    is 0, so a pair whose sector falls outside the t/h/w rule is left unrotated."""
    # Qwen3.5's own sections cover every pair of its 64 rotated dims
    assert rf.imrope_rotated(64, (11, 11, 10, 0)).all()
    # sectors m = 0..15 of (6, 6, 4, 0): w takes m % 3 == 2 only below 3 * 4 = 12, so m = 14 is e
    want = np.ones(16, bool)
    want[14] = False
    np.testing.assert_array_equal(rf.imrope_rotated(32, (6, 6, 4, 0)), want)
    # sectors wrap around modulo s0 + s1 + s2 + s3
    np.testing.assert_array_equal(rf.imrope_rotated(8, (1, 1, 0, 0)), [True, True, True, True])
    np.testing.assert_array_equal(rf.imrope_rotated(8, (1, 0, 1, 0)), [True, False, True, False])
    # an unrotated pair keeps its values; a rotated one turns by pos * theta^(-2i/n)
    x = np.random.default_rng(0).standard_normal((3, 1, 32))
    out = rf.rope_imrope(x, np.arange(3), 10000.0, 32, sections=(6, 6, 4, 0))
    np.testing.assert_array_equal(out[..., [14, 30]], x[..., [14, 30]])
    rotated = [i for i in range(32) if i % 16 != 14]
    np.testing.assert_allclose(out[..., rotated], rf.rope_neox(x, np.arange(3), 10000.0, 32)[..., rotated])
    ang = 2 * 10000.0 ** (-2 * 3 / 32)
    np.testing.assert_allclose(out[2, 0, 3], x[2, 0, 3] * np.cos(ang) - x[2, 0, 19] * np.sin(ang))


def test_gated_delta_net_matches_its_chunked_matrix_form():
    """The reference's token-by-token Gated DeltaNet against the same recurrence solved as one
    chunk in matrix form (as llama.cpp's build_delta_net_chunking derives it): with G = cumsum(g)
    per value head, D[t, j] = exp(G_t - G_j) for j <= t, the deltas U solve
    (I + strict_lower(beta_t D[t, j] k_t.k_j)) U = beta V, and o_t = sum_{j<=t} D[t, j] (q_t.k_j) U_j / sqrt(d)."""
    rng = np.random.default_rng(1)
    T, hidden, d, Hk, Hv, K = 9, 24, 8, 2, 4, 4
    C = (2 * Hk + Hv) * d
    c = rf.Config(arch="qwen35", n_layers=1, hidden=hidden, ffn=0, n_heads=1, n_kv_heads=1, head_dim=d, rope_dim=d,
                  vocab=1, rope_theta=1e4, rms_eps=1e-6, ssm_state=d, ssm_groups=Hk, ssm_heads=Hv)
    L = dict(
        ssm_qkv=rng.standard_normal((C, hidden)) / np.sqrt(hidden),
        ssm_z=rng.standard_normal((Hv * d, hidden)) / np.sqrt(hidden),
        ssm_beta=rng.standard_normal((Hv, hidden)),
        ssm_alpha=rng.standard_normal((Hv, hidden)),
        ssm_conv=rng.standard_normal((C, K)),
        ssm_dt=rng.standard_normal(Hv),
        ssm_a=-np.exp(rng.standard_normal(Hv)),
        ssm_norm=1 + 0.1 * rng.standard_normal(d),
        ssm_out=rng.standard_normal((hidden, Hv * d)) / np.sqrt(Hv * d),
    )
    x = rng.standard_normal((T, hidden))
    got = rf.gated_delta_net(x, L, c, lambda a, w: a @ w.T)

    # the same inputs, written independently: the conv as a banded matrix per channel
    qkv = x @ L["ssm_qkv"].T
    y = np.zeros_like(qkv)
    for t in range(T):
        for j in range(K):  # tap j reads token t - (K - 1) + j
            if t - (K - 1) + j >= 0:
                y[t] += qkv[t - (K - 1) + j] * L["ssm_conv"][:, j]
    y = y / (1 + np.exp(-y))
    q, k, v = y[:, : Hk * d], y[:, Hk * d : 2 * Hk * d], y[:, 2 * Hk * d :]
    beta = 1 / (1 + np.exp(-(x @ L["ssm_beta"].T)))
    g = np.log1p(np.exp(x @ L["ssm_alpha"].T + L["ssm_dt"])) * L["ssm_a"]
    z = x @ L["ssm_z"].T
    outs = []
    for h in range(Hv):
        kh = h % Hk
        qh, khv = q[:, kh * d : (kh + 1) * d], k[:, kh * d : (kh + 1) * d]
        qh = qh / np.sqrt((qh**2).sum(-1, keepdims=True) + c.rms_eps)
        khv = khv / np.sqrt((khv**2).sum(-1, keepdims=True) + c.rms_eps)
        vh = v[:, h * d : (h + 1) * d]
        G = np.cumsum(g[:, h])
        D = np.tril(np.exp(G[:, None] - G[None, :]))
        A = np.tril(beta[:, h, None] * D * (khv @ khv.T), k=-1)
        U = np.linalg.solve(np.eye(T) + A, beta[:, h, None] * vh)
        o = (D * (qh @ khv.T)) @ U / np.sqrt(d)
        o = o / np.sqrt((o**2).mean(-1, keepdims=True) + c.rms_eps) * L["ssm_norm"]
        zh = z[:, h * d : (h + 1) * d]
        outs.append(o * zh / (1 + np.exp(-zh)))
    want = np.concatenate(outs, axis=1) @ L["ssm_out"].T
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-10)
