"""A file's own multi-token-prediction layer (qwen35 / qwen35moe `nextn`) vs the independent NumPy
reference (python/reference_forward.py, `mtp_forward`).

`specula debug write-tiny --nextn` (write-tiny-moe for qwen35moe) writes a tiny random hybrid with
the MTP block after the trunk (`blk.{n}.*`, nextn_predict_layers = 1); `specula debug logits
--nextn` writes, for each prompt of T tokens, the block's teacher-forced logits [T - 1, vocab]:
row i from the trunk's final state after tokens 0..=i (output-normed) and the embedding of token
i + 1, the rows passing the block as one causal sequence (llama.cpp's graph_mtp).  The reference
computes the same from the definition.

Tolerances: with F32 weights and an f32 KV cache both sides compute in float32 without activation
rounding, so the logits agree to float32 noise (measured <= 4e-5, as the reference's own float32
vs float64 difference) and the top-1 is the same wherever the reference's two best are not within
that.  With Q8_0 weights the engine rounds every matmul input to 8-bit blocks of 32
(crates/kernels/src/q8.rs); the reference does the same (`specula_q8`), and then a prompt's rows
agree to ~2e-6 until a value that sits within float32 noise of a rounding boundary lands on the
other 8-bit level in one of the two, a step that this tiny random model carries to every later
row (measured on seeds 1, 2, 3, 5: at most 0.20, in 0-2 of the 4 prompts).  So a quantized case
bounds every row by Q8_FLIP_BOUND and requires half of the prompts to agree to F32_BOUND
throughout.  Real bugs, injected into the reference: the eh_proj halves swapped moves the logits
by 5-12; a missing enorm or hnorm weight, or output_norm in place of shared_head_norm, by 0.26-0.6,
and by at least 0.1 at every row (so no prompt would agree to F32_BOUND).  Without the engine's
rounding the logits sit 0.3-2.2 from the exact reference, and 0.2-0.6 from its act_quant="q8"
(whose scales are rounded to f16, as ggml's Q8_0 / Q8_1 store them; the engine keeps them in f32).

The trunk must not see the block: `debug logits` without --nextn on the same file matches
`forward`, which runs block_count - nextn_predict_layers layers.
"""

import numpy as np
import pytest

import reference_forward as rf
from conftest import run_specula, write_json

PROMPTS = [
    [257, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100],
    list(range(40, 90, 3)),
    [(37 * i + 11) % 256 for i in range(40)],
    [258, 10, 10, 32, 32, 97, 98, 99],
]

F32_BOUND = 1e-3
Q8_FLIP_BOUND = 0.35  # measured <= 0.20 after a rounding flip

QWEN35 = ("write-tiny", ["--arch", "qwen35", "--layers", "4"])
QWEN35MOE = ("write-tiny-moe", ["--arch", "qwen35moe", "--layers", "4", "--experts", "8", "--experts-used", "2", "--shared-ffn", "32"])

CASES = {
    # name: (writer, its arch flags, format and seed)
    "qwen35_f32": (*QWEN35, ["--format", "f32", "--seed", "5"]),
    "qwen35moe_f32": (*QWEN35MOE, ["--format", "f32", "--seed", "5"]),
    "qwen35_q8_0": (*QWEN35, ["--format", "q8_0", "--seed", "5"]),
}
QUANT_CASES = ["qwen35_q8_0"]


def q8_f32_scales(x: np.ndarray, block: int = 32) -> np.ndarray:
    """x through the engine's activation blocks: d = max|x| / 127 in f32, q = round_half_even(x / d)
    (`rf.quantize_q8_blocks`, but without rounding d to f16)."""
    xb = x.reshape(-1, x.shape[-1] // block, block).astype(np.float32)
    d = np.abs(xb).max(axis=-1, keepdims=True) / np.float32(127.0)
    inv = np.where(d > 0, np.float32(1.0) / np.where(d > 0, d, np.float32(1.0)), np.float32(0.0))
    return (np.clip(np.round(xb * inv), -127, 127) * d).reshape(x.shape).astype(x.dtype)


def specula_q8(fn, *args):
    """`fn(*args, act_quant="q8")` with the engine's f32 scales (swapped in for the call, as
    python/llama_compare.py's simulated_forward does)."""
    saved = rf.quantize_q8_blocks
    rf.quantize_q8_blocks = q8_f32_scales
    try:
        return fn(*args, act_quant="q8")
    finally:
        rf.quantize_q8_blocks = saved


def write_model(specula_bin, tmp_path, case: str):
    writer, arch_flags, flags = CASES[case]
    model = tmp_path / f"{case}.gguf"
    run_specula(specula_bin, ["debug", writer, "--output", str(model), *arch_flags, *flags, "--nextn"])
    return str(model)


def engine_logits(specula_bin, model, tmp_path, prompts, nextn: bool) -> list:
    """`debug logits` (with --nextn: the MTP layer's [T - 1, vocab] per prompt) as one array per prompt."""
    inp = write_json(tmp_path / "in.json", {"prompts": prompts})
    out = tmp_path / "out.bin"
    args = ["debug", "logits", "--model", model, "--input", str(inp), "--output", str(out), "--kv-cache-dtype", "f32"]
    run_specula(specula_bin, args + (["--nextn"] if nextn else []))
    vocab = rf.load_weights(model).cfg.vocab
    rows = [len(p) - 1 if nextn else len(p) for p in prompts]
    flat = np.fromfile(out, dtype="<f4")
    assert flat.size == sum(rows) * vocab, f"output has {flat.size} floats, expected {sum(rows)} rows x vocab {vocab}"
    return np.split(flat.reshape(sum(rows), vocab), np.cumsum(rows)[:-1])


def row_stats(name: str, got: np.ndarray, ref: np.ndarray) -> tuple[np.ndarray, np.ndarray, str]:
    """Per row: max |d|, and how much worse the engine's top-1 is than the reference's best, by the
    reference's logits (0 where they agree); and their summary."""
    assert got.shape == ref.shape, f"{name}: shape {got.shape}, reference {ref.shape}"
    assert np.isfinite(got).all(), f"{name}: non-finite logits"
    d = np.abs(got.astype(np.float64) - ref).max(-1)
    rows = np.arange(len(ref))
    gap = ref[rows, ref.argmax(-1)] - ref[rows, got.argmax(-1)]
    summary = f"{name}: max|d| {d.max():.3g} (row {int(d.argmax())}), top-1 agree {np.mean(gap == 0):.3f}, max gap {gap.max():.3g}"
    print(summary)
    return d, gap, summary


def check_rows(name: str, got: np.ndarray, ref: np.ndarray, bound: float) -> np.ndarray:
    """Every row's max |d| within bound, and its top-1 the reference's or within bound of it; the
    rows' max |d|."""
    d, gap, summary = row_stats(name, got, ref)
    assert d.max() <= bound, f"{summary}; bound {bound}"
    assert gap.max() <= bound, f"{summary}: row {int(gap.argmax())} has another top-1 where the reference's best leads by {gap.max():.3g}"
    return d


@pytest.mark.parametrize("case", [c for c in CASES if c not in QUANT_CASES])
def test_nextn_logits_match_reference(specula_bin, tmp_path, case):
    model = write_model(specula_bin, tmp_path, case)
    W = rf.load_weights(model)
    assert W.cfg.n_nextn == 1 and W.nextn is not None, "write-tiny --nextn wrote no nextn block"
    ours = engine_logits(specula_bin, model, tmp_path, PROMPTS, nextn=True)
    for p, got in zip(PROMPTS, ours):
        check_rows(f"{case}, prompt of {len(p)}", got, rf.mtp_forward(model, p), F32_BOUND)


@pytest.mark.parametrize("case", QUANT_CASES)
def test_quantized_nextn_logits_match_reference_up_to_rounding_flips(specula_bin, tmp_path, case):
    model = write_model(specula_bin, tmp_path, case)
    ours = engine_logits(specula_bin, model, tmp_path, PROMPTS, nextn=True)
    exact = 0
    for p, got in zip(PROMPTS, ours):
        d = check_rows(f"{case}, prompt of {len(p)}", got, specula_q8(rf.mtp_forward, model, p), Q8_FLIP_BOUND)
        exact += bool(d.max() <= F32_BOUND)
    assert 2 * exact >= len(PROMPTS), f"{case}: only {exact} of {len(PROMPTS)} prompts agree to {F32_BOUND} at every row"


@pytest.mark.parametrize("case", ["qwen35_f32", "qwen35moe_f32"])
def test_trunk_logits_ignore_the_nextn_block(specula_bin, tmp_path, case):
    model = write_model(specula_bin, tmp_path, case)
    ours = engine_logits(specula_bin, model, tmp_path, PROMPTS[:2], nextn=False)
    for p, got in zip(PROMPTS, ours):
        check_rows(f"{case} trunk, prompt of {len(p)}", got, rf.forward(model, p), F32_BOUND)


def test_reference_nextn_is_causal_and_can_fail(specula_bin, tmp_path):
    """The reference on its own: row i depends on tokens 0..=i + 1 only (a prefix gives the same
    rows, a change of token j + 1 leaves rows < j as they are); float32 and float64 agree; and a
    plausible bug (the eh_proj input halves swapped) moves the logits by far more than the bound."""
    model = write_model(specula_bin, tmp_path, "qwen35_f32")
    p = PROMPTS[2]
    full = rf.mtp_forward(model, p)
    for k in (1, 5, 17):
        np.testing.assert_allclose(rf.mtp_forward(model, p[: k + 1]), full[:k], atol=1e-4)
    q = list(p)
    q[11] = (q[11] + 7) % 256
    moved = np.abs(rf.mtp_forward(model, q) - full).max(-1)
    assert (moved[:10] == 0).all() and moved[10] > 1e-3, moved
    assert np.abs(rf.mtp_forward(model, p, dtype="float64") - full).max() < 2e-4
    N = rf.load_weights(model).nextn
    saved = N["eh_proj"]
    try:
        H = saved.shape[0]
        N["eh_proj"] = np.ascontiguousarray(np.concatenate([saved[:, H:], saved[:, :H]], axis=1))  # hidden half first
        bad = rf.mtp_forward(model, p)
    finally:
        N["eh_proj"] = saved
    assert np.abs(bad - full).max() > 0.1
