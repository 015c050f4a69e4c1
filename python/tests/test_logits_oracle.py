"""`specula debug logits` vs the independent NumPy reference (python/reference_forward.py).

Contract: input {"prompts": [[ids...], ...]}; output little-endian f32, for each prompt in order a
[len(prompt), vocab] matrix of logits at every position, concatenated.

Tolerances, and why
-------------------
The reference computes in float32 with the exact dequantized weights and *unquantized*
activations (its own float32-vs-float64 noise is ~1e-4 max abs).  The engine, like llama.cpp,
rounds the input of every weight matmul to 8-bit blocks of 32 (Q8_1-style) before integer dot
products.  Each rounding perturbs a vector by ~0.3% relative; over 30 layers x 7 matmuls the
perturbations compound, and the logits (std ~4, max ~40 here) move by a few tenths.

We measured that envelope *without the engine*, by running the reference with the same
activation rounding simulated (`forward(..., act_quant="q8")`) against the exact reference, and
compared it with the engine (SmolLM2-135M-Instruct Q4_1, the six prompts below):

                            max|d|      mean|d|     max|d|/max|ref| per row   KL mean    KL max    top-1 agree
    reference+q8 sim       1.28-2.08   0.15-0.23        <= 0.10             <= 0.0062   <= 0.040   94-100%
    engine (first run)     0.97-2.00   0.13-0.21        <= 0.074            <= 0.0058   <= 0.036   94-100%

The engine sits inside the simulated envelope, so its error is what 8-bit activations explain.
Real bugs, injected into the reference and measured the same way, are far outside it:

    NeoX RoPE pairing      max|d| 18-44, mean|d| 2.4-9.4, KL mean 1.0-2.3, top-1 23-50%
    wrong GQA head map     max|d| 44-55, mean|d| 7-17,  KL mean 9-12,     top-1 0-5%
    attend to j < i only   max|d| 15-32, mean|d| 1.2-3.6, KL mean 0.25-0.97, top-1 60-86%
    rope theta 1e4 (not 1e5, a metadata-reading bug) max|d| 3.6-10, mean|d| 0.47-1.07,
                           KL mean 0.036-0.12, KL max 0.29-1.6, top-1 80-100%

So the limits below sit at ~1.5-3x the measured quantization error and still below the subtlest
bug above (the theta bug fails the mean|d|, KL-mean and KL-max checks on every prompt).

"Same top-1 at every position" cannot be demanded literally: even the q8-simulated reference
picks a different top-1 than the exact reference at 0-6% of positions, always where the
reference's two best logits are within 0.52 of each other (engine: within 0.52 as well).  So we
require: the engine's top-1 is a token whose reference logit is within TOP1_TIE of the
reference's best (i.e. identical top-1 wherever the reference is not near a tie), and >= 90%
exact agreement overall.
"""

import functools

import numpy as np
import pytest

import reference_forward as rf
import tokenizer_oracle as to
from conftest import run_specula, write_json
from prompts import PROMPTS

MAX_ABS = 3.5  # measured <= 2.08 (q8 simulation), <= 2.00 (engine)
MAX_ROW_REL = 0.15  # max|d| / max|ref logit| per position; measured <= 0.10
MEAN_ABS = 0.35  # measured <= 0.23; theta bug >= 0.47
KL_MEAN = 0.02  # nats, KL(ref || engine) averaged over positions; measured <= 0.0062; theta bug >= 0.036
KL_MAX = 0.15  # nats, worst position; measured <= 0.040; theta bug >= 0.29
TOP1_TIE = 1.0  # reference-logit gap allowed for a differing top-1; measured <= 0.52
TOP1_MIN_AGREE = 0.90  # measured >= 0.94
# The limits above as `compare` takes them (other models' tests pass their own, measured likewise).
LIMITS = {"top1_tie": TOP1_TIE, "top1_min": TOP1_MIN_AGREE, "max_abs": MAX_ABS, "row_rel": MAX_ROW_REL, "mean_abs": MEAN_ABS, "kl_mean": KL_MEAN, "kl_max": KL_MAX}

NAMES = list(PROMPTS)


@functools.lru_cache(maxsize=None)
def reference_logits(model_path: str, ids: tuple) -> np.ndarray:
    return rf.forward(model_path, list(ids))


@pytest.fixture(scope="module")
def prompt_ids(model_path):
    ids = {k: to.encode(model_path, v) for k, v in PROMPTS.items()}
    assert len(ids["long"]) > 300, len(ids["long"])
    return ids


def engine_logits(specula_bin, model_path, prompts: list, workdir, threads=None) -> list:
    inp = write_json(workdir / "in.json", {"prompts": prompts})
    out = workdir / "out.bin"
    args = ["debug", "logits", "--model", model_path, "--input", str(inp), "--output", str(out)]
    if threads is not None:
        args += ["--threads", str(threads)]
    run_specula(specula_bin, args)
    vocab = rf.load_weights(model_path).cfg.vocab
    raw = np.fromfile(out, dtype="<f4")
    total = sum(len(p) for p in prompts) * vocab
    assert raw.size == total, f"output has {raw.size} floats, expected {total} (sum of lengths x vocab {vocab})"
    res, off = [], 0
    for p in prompts:
        res.append(raw[off : off + len(p) * vocab].reshape(len(p), vocab))
        off += len(p) * vocab
    return res


@pytest.fixture(scope="module")
def engine(model_path, specula_bin, prompt_ids, tmp_path_factory):
    out = engine_logits(specula_bin, model_path, [prompt_ids[k] for k in NAMES], tmp_path_factory.mktemp("logits"))
    return dict(zip(NAMES, out))


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def logit_stats(name: str, got: np.ndarray, ref: np.ndarray) -> tuple[dict, str]:
    """The engine-vs-reference figures every logits oracle test checks (per-position |d|, KL(ref ||
    engine), top-1 agreement and the reference's gap where the top-1 differs), and their summary."""
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert np.isfinite(got).all(), f"{name}: non-finite logits"
    d = np.abs(got.astype(np.float64) - ref)
    lp, lq = log_softmax(ref), log_softmax(got)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    rows = np.arange(len(ref))
    ref_top, got_top = ref.argmax(-1), got.argmax(-1)
    gap = ref[rows, ref_top] - ref[rows, got_top]  # how much worse the engine's pick is, by the reference
    row_rel = d.max(-1) / np.abs(ref).max(-1)
    summary = (
        f"{name} ({len(ref)} tokens): max|d|={d.max():.3f} mean|d|={d.mean():.4f} row_rel={row_rel.max():.4f} "
        f"KL mean={kl.mean():.5f} max={kl.max():.4f} top1 agree={np.mean(ref_top == got_top):.3f} max gap={gap.max():.3f}"
    )
    print(summary)
    return {"d": d, "kl": kl, "gap": gap, "row_rel": row_rel, "ref_top": ref_top, "got_top": got_top}, summary


def assert_within(st: dict, summary: str, lim: dict) -> None:
    """Every figure of `logit_stats` inside its limit (keys as in LIMITS)."""
    gap = st["gap"]
    assert gap.max() <= lim["top1_tie"], f"{summary}: a different top-1 where the reference is not near a tie (position {int(gap.argmax())})"
    assert np.mean(st["ref_top"] == st["got_top"]) >= lim["top1_min"], summary
    assert st["d"].max() <= lim["max_abs"], summary
    assert st["d"].mean() <= lim["mean_abs"], summary
    assert st["row_rel"].max() <= lim["row_rel"], summary
    assert st["kl"].mean() <= lim["kl_mean"], summary
    assert st["kl"].max() <= lim["kl_max"], summary


def compare(name: str, got: np.ndarray, ref: np.ndarray, lim: dict) -> str:
    """`logit_stats` then `assert_within`; returns the summary."""
    st, summary = logit_stats(name, got, ref)
    assert_within(st, summary, lim)
    return summary


@pytest.mark.parametrize("name", NAMES)
def test_engine_logits_match_reference(model_path, oracle_tokenizer, prompt_ids, engine, name):
    ids = prompt_ids[name]
    ref = reference_logits(model_path, tuple(ids))
    got = engine[name]
    st, summary = logit_stats(name, got, ref)
    gap, ref_top, got_top = st["gap"], st["ref_top"], st["got_top"]

    bad = np.nonzero(gap > TOP1_TIE)[0]
    if len(bad):
        i = int(bad[0])
        tok = lambda t: repr(oracle_tokenizer.decode([int(t)]))  # noqa: E731
        pytest.fail(
            f"{summary}\nposition {i}: engine top-1 {tok(got_top[i])} but reference top-1 {tok(ref_top[i])} "
            f"(reference prefers it by {gap[i]:.3f} > {TOP1_TIE})"
        )
    assert_within(st, summary, LIMITS)


def test_engine_logits_independent_of_threads(model_path, specula_bin, prompt_ids, tmp_path):
    """Design invariant 1: logits do not depend on the thread count (bitwise)."""
    prompts = [prompt_ids["english"], prompt_ids["chat"]]
    a = engine_logits(specula_bin, model_path, prompts, tmp_path, threads=1)
    b = engine_logits(specula_bin, model_path, prompts, tmp_path, threads=2)
    for x, y in zip(a, b):
        assert np.array_equal(x, y), f"max diff {np.abs(x - y).max()}"


def test_engine_logits_independent_of_other_prompts(model_path, specula_bin, prompt_ids, engine, tmp_path):
    """A prompt's logits are the same alone as next to others in the input file."""
    alone = engine_logits(specula_bin, model_path, [prompt_ids["code"]], tmp_path)[0]
    assert np.array_equal(alone, engine["code"])
