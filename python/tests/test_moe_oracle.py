"""Mixture-of-experts forward vs the independent NumPy reference (python/reference_forward.py).

A tiny random MoE GGUF (llama.cpp tensor names: ffn_gate_inp router, ffn_{gate,up,down}_exps
3-D stacks, optional *_shexp shared expert) is written by `specula debug write-tiny-moe`; the
reference reads it with the `gguf` package and computes the routed FFN token by token from the
definition (softmax over all experts, top-k, renormalised unless expert_weights_norm=false,
weighted sum of SwiGLU experts).  The engine's logits (`specula debug logits`) must match.

Tolerances: with F32 weights both sides compute in float32 without activation rounding, so the
logits agree to float32 noise (bound 2e-3) and the top-1 is identical.  With quantized weights
the engine rounds every matmul input to 8-bit blocks (like llama.cpp), which moves the logits
by up to ~0.26 here, and can flip a routing decision where the router's k-th and (k+1)-th
logits nearly tie; a flip at one token reaches every later position through attention (we
measured jumps of 0.7-3.1, always after a prefix router margin < 0.02).  So quantized cases
check |d| <= 0.5 at positions whose prefix margin is >= 0.03, and require most positions to
be checked.  A routing bug (no renormalisation, wrong top-k or expert order) moves logits by O(1)
everywhere (see the last test).
"""

import numpy as np
import pytest

import reference_forward as rf
from conftest import run_specula, write_json

PROMPTS = [[257, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100], list(range(40, 90, 3)), [7]]

CASES = {
    # name: (write-tiny-moe flags, max abs diff)
    "f32_top2_of_4": (["--format", "f32", "--experts", "4", "--experts-used", "2"], 2e-3),
    "f32_top2_of_8_shared_no_norm": (["--format", "f32", "--experts", "8", "--experts-used", "2", "--shared-ffn", "32", "--norm-topk", "false"], 2e-3),
    "f32_top3_of_8": (["--format", "f32", "--experts", "8", "--experts-used", "3", "--seed", "5"], 2e-3),
    "f16_top2_of_4": (["--format", "f16", "--experts", "4", "--experts-used", "2", "--seed", "1"], 2e-3),
    # Qwen3-MoE: q/k norms, NeoX RoPE, a head wider than hidden / heads, top-k renormalised
    "f32_qwen3moe_top3_of_8": (["--arch", "qwen3moe", "--format", "f32", "--experts", "8", "--experts-used", "3", "--head-dim", "32", "--seed", "4"], 2e-3),
    # Qwen2-MoE: Q/K/V biases, softmax weights kept as they are, sigmoid-gated shared expert
    "f32_qwen2moe_shared": (["--arch", "qwen2moe", "--format", "f32", "--experts", "8", "--experts-used", "2", "--shared-ffn", "32", "--seed", "6"], 2e-3),
    # gpt-oss: biases everywhere, attention sinks, every other layer sliding (window 4), YaRN,
    # router bias, softmax over the chosen logits, clamped-SwiGLU experts with biases
    "f32_gptoss_top4_of_8": (["--arch", "gpt-oss", "--format", "f32", "--experts", "8", "--experts-used", "4", "--layers", "3", "--seed", "7"], 2e-3),
}
QUANT_CASES = {
    "q8_0_top2_of_4": ["--format", "q8_0", "--experts", "4", "--seed", "2"],
    "q4_0_top2_of_4": ["--format", "q4_0", "--experts", "4", "--seed", "0"],
    "q4_1_top2_of_8": ["--format", "q4_1", "--experts", "8", "--seed", "3"],
    "q8_0_gptoss_top2_of_4": ["--arch", "gpt-oss", "--format", "q8_0", "--experts", "4", "--experts-used", "2", "--seed", "9"],
}
QUANT_BOUND = 0.5  # measured <= 0.26 away from near-ties
NEAR_TIE = 0.03  # router logit margin; every measured flip followed a margin < 0.02
MIN_CHECKED = 0.6


def engine_logits(specula_bin, model, tmp_path, prompts):
    inp = write_json(tmp_path / "in.json", {"prompts": prompts})
    out = tmp_path / "out.bin"
    # an f32 KV cache: the f32 cases are checked to the reference's own rounding, which the served
    # f16 cache's rounding of keys and values would exceed (the KV types have their own tests)
    run_specula(specula_bin, ["debug", "logits", "--model", str(model), "--input", str(inp), "--output", str(out), "--kv-cache-dtype", "f32"])
    flat = np.fromfile(out, dtype="<f4")
    rows = sum(len(p) for p in prompts)
    return np.split(flat.reshape(rows, -1), np.cumsum([len(p) for p in prompts])[:-1])


@pytest.mark.parametrize("case", list(CASES))
def test_moe_logits_match_reference(specula_bin, tmp_path, case):
    flags, bound = CASES[case]
    model = tmp_path / "moe.gguf"
    run_specula(specula_bin, ["debug", "write-tiny-moe", "--output", str(model), *flags])
    ours = engine_logits(specula_bin, model, tmp_path, PROMPTS)
    for p, got in zip(PROMPTS, ours):
        ref = rf.forward(str(model), p)
        assert got.shape == ref.shape
        d = np.abs(got - ref).max()
        assert d < bound, f"{case}: prompt of {len(p)} tokens: max|d| = {d:.3g} (bound {bound})"
        assert (got.argmax(-1) == ref.argmax(-1)).all(), f"{case}: top-1 differs"


@pytest.mark.parametrize("case", list(QUANT_CASES))
def test_quantized_moe_logits_match_reference_away_from_routing_ties(specula_bin, tmp_path, case):
    model = tmp_path / "moe.gguf"
    run_specula(specula_bin, ["debug", "write-tiny-moe", "--output", str(model), *QUANT_CASES[case]])
    ours = engine_logits(specula_bin, model, tmp_path, PROMPTS)
    checked = total = 0
    for p, got in zip(PROMPTS, ours):
        margins = np.full(len(p), np.inf)
        ref = rf.forward(str(model), p, moe_margins=margins)
        prefix_margin = np.minimum.accumulate(margins)
        d = np.abs(got - ref).max(axis=-1)
        ok = prefix_margin >= NEAR_TIE
        assert (d[ok] <= QUANT_BOUND).all(), f"{case}: max|d| {d[ok].max():.3g} at positions with no routing near-tie"
        checked += int(ok.sum())
        total += len(p)
    assert checked >= MIN_CHECKED * total, f"{case}: only {checked}/{total} positions away from routing ties; pick another seed"


def test_reference_moe_is_not_a_dense_ffn(specula_bin, tmp_path):
    """The check above can fail: routing to the wrong experts changes logits by far more than the bound."""
    model = tmp_path / "moe.gguf"
    run_specula(specula_bin, ["debug", "write-tiny-moe", "--output", str(model), "--format", "f32"])
    good = rf.forward(str(model), PROMPTS[0])
    W = rf.load_weights(str(model))
    saved = W.cfg.expert_weights_norm
    try:
        W.cfg.expert_weights_norm = False  # an injected routing bug
        bad = rf.forward(str(model), PROMPTS[0])
    finally:
        W.cfg.expert_weights_norm = saved
    assert np.abs(good - bad).max() > 0.1
