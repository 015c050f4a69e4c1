"""Qwen3-Next (llama.cpp's `qwen3next`) vs the independent NumPy reference (python/reference_forward.py).

`specula debug write-tiny-moe --arch qwen3next` writes a tiny random hybrid as llama.cpp's
src/models/qwen3next.cpp loads it: three Gated DeltaNet layers to one gated-attention layer, every
FFN a renormalised top-k MoE plus a sigmoid-gated shared expert.  What sets it apart from qwen35moe
(and what these cases check the engine on):
  * beta and alpha in one matrix `ssm_ba` [2 Hv, hidden], rows grouped per key head g as
    [beta of value heads g r..g r + r - 1, their alpha] (r = Hv / Hk);
  * the Hk key heads shared by the Hv value heads *interleaved*: value head h reads key head h // r
    (ggml_repeat_4d on [d, 1, Hk] -> [d, r, Hk]), where qwen35 tiles (h % Hk);
  * plain NeoX RoPE (ggml_rope_ext), no M-RoPE sections;
  * in older files, q, k, v and z in one `ssm_in` [Hk (2 d + 2 r d), hidden], per key head g the
    rows [q_g, k_g, v of heads g r.., z of heads g r..] (`--fused-ssm-in`).
The trunk (`debug logits`) and, on a `--nextn` file, the multi-token-prediction block (`debug
logits --nextn`, llama.cpp's graph_mtp, as qwen35moe's) must match `forward` / `mtp_forward`.

Tolerances as tests/test_nextn_oracle.py's F32 cases: F32 weights, an f32 KV cache, no activation
rounding on either side, so the logits agree to float32 noise (F32_BOUND) and the top-1 is the
reference's wherever its two best are not within that.  The reference itself was checked against
llama.cpp's qwen3next graph on hand-converted files (fused ssm_ba, the legacy fused ssm_in, value
heads permuted or not, partial RoPE): max |d| <= 7e-5 (python/llama_compare.py runs the engine's
files through llama.cpp: `--arch-filter qwen3next`).  Reading the interleaved file with qwen35's
tiling instead moves the logits by O(1) (the last test), far beyond the bound.
"""

import numpy as np
import pytest

import reference_forward as rf
from conftest import run_specula
from test_nextn_oracle import F32_BOUND, PROMPTS, check_rows, engine_logits

FLAGS = ["--arch", "qwen3next", "--layers", "4", "--experts", "8", "--experts-used", "2", "--shared-ffn", "32", "--format", "f32"]


@pytest.fixture(scope="module")
def files(specula_bin, tmp_path_factory):
    """name -> path: a trunk-only file, one with the prediction layer after the trunk, and one in
    the legacy form (q, k, v and z fused per key head in ssm_in)."""
    d = tmp_path_factory.mktemp("qwen3next")
    out = {}
    for name, extra in (("seed5_nextn", ["--seed", "5", "--nextn"]), ("seed3", ["--seed", "3"]), ("seed7_ssm_in", ["--seed", "7", "--fused-ssm-in"])):
        out[name] = str(d / f"{name}.gguf")
        run_specula(specula_bin, ["debug", "write-tiny-moe", "--output", out[name], *FLAGS, *extra])
    return out


def test_written_file_is_llama_cpp_qwen3next(files):
    """The writer's file has llama.cpp's qwen3next layout (so the cases below test that form)."""
    for name, path in files.items():
        r = rf.open_reader(path)
        names = {t.name for t in r.tensors}
        assert "blk.0.ssm_ba.weight" in names, f"{name}: no blk.0.ssm_ba.weight (llama.cpp's LLM_TENSOR_SSM_BETA_ALPHA is named ssm_ba)"
        assert not names & {"blk.0.ssm_beta.weight", "blk.0.ssm_alpha.weight"}
        legacy = name.endswith("_ssm_in")
        assert ("blk.0.ssm_in.weight" in names) == legacy and ("blk.0.attn_qkv.weight" in names) != legacy
        assert "qwen3next.rope.dimension_sections" not in r.fields, "llama.cpp's qwen3next reads no sections: the writer should not write any"
        W = rf.load_weights(path)
        c = W.cfg
        assert c.arch == "qwen3next" and c.rope_sections is None and c.neox and c.ssm_interleave
        assert c.ssm_heads > c.ssm_groups, "Hv == Hk: the key-head interleave would not be exercised"
        assert sum(c.recurrent) == 3 and not c.recurrent[3]
        assert c.n_experts == 8 and c.n_experts_used == 2 and "gate_inp_sh" in W.layers[0]
        assert (W.nextn is not None) == name.endswith("_nextn")


@pytest.mark.parametrize("name", ["seed3", "seed5_nextn", "seed7_ssm_in"])
def test_qwen3next_trunk_logits_match_reference(specula_bin, files, tmp_path, name):
    model = files[name]
    ours = engine_logits(specula_bin, model, tmp_path, PROMPTS, nextn=False)
    for p, got in zip(PROMPTS, ours):
        check_rows(f"qwen3next {name} trunk, prompt of {len(p)}", got, rf.forward(model, p), F32_BOUND)


def test_qwen3next_nextn_logits_match_reference(specula_bin, files, tmp_path):
    model = files["seed5_nextn"]
    ours = engine_logits(specula_bin, model, tmp_path, PROMPTS, nextn=True)
    for p, got in zip(PROMPTS, ours):
        check_rows(f"qwen3next nextn, prompt of {len(p)}", got, rf.mtp_forward(model, p), F32_BOUND)


def test_reference_tells_interleaved_from_tiled_key_heads(files):
    """The cases above can fail on the qwen3next-specific sharing: the reference reading the same
    file with qwen35's tiled key heads (h % Hk) moves the logits by far more than the bound."""
    model = files["seed3"]
    c = rf.load_weights(model).cfg
    p = PROMPTS[2]
    right = rf.forward(model, p)
    try:
        c.ssm_interleave = False
        tiled = rf.forward(model, p)
    finally:
        c.ssm_interleave = True
    assert np.abs(tiled - right).max() > 0.1, np.abs(tiled - right).max()
