#!/usr/bin/env python3
"""Full-size random-weight GGUF files with real models' metadata, tensor names, shapes and
quantization layouts, for speed benchmarks (specula against llama.cpp on the same file).

    python3 python/make_shape_gguf.py --shape qwen3-30b-a3b --output F.gguf [--layers N] [--seed S]
    python3 python/make_shape_gguf.py --shape gpt-oss-20b --output F.gguf --print-plan   # no file

Shapes (architecture, format as the published / llama-quantize files lay it out):

* ``qwen3-30b-a3b`` (``qwen3moe``, "Q4_K_M"): Q4_K everywhere, except ``attn_v`` and
  ``ffn_down_exps`` in Q6_K on the layers llama.cpp's ``use_more_bits(i, n)`` picks
  (``i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2``: 24 of 48 layers), ``output`` Q6_K,
  ``token_embd`` Q4_K; router ``ffn_gate_inp`` and norms F32.
* ``gpt-oss-20b`` (``gpt-oss``, "MXFP4_MOE" as ggml-org's gpt-oss-20b-mxfp4.gguf): expert stacks
  MXFP4, every other matrix (attention, ``token_embd``, ``output``) Q8_0 — llama-quantize's
  MXFP4_MOE rule (``src/llama-quant.cpp``: 3-D MoE tensors MXFP4, other tensors and the output
  Q8_0); router, biases, sinks and norms F32.
* ``phi-4-mini`` (``phi3``, "Q4_K_M"): Q4_K, except ``attn_qkv`` Q5_K (llama-quantize's Q4_K_M
  rule for a fused QKV), ``ffn_down`` Q6_K on the ``use_more_bits`` layers, and the tied
  ``token_embd`` Q6_K (llama-quantize gives a tied embedding the output's type); norms and
  LongRoPE factors F32.
* ``qwen3.5-4b`` (``qwen35``, "Q4_K_M"): a Qwen3.5-4B-like hybrid, its numbers following the
  published Qwen3.5 / Qwen3-Next configs' proportions (hidden 2560, 32 layers, FFN 9216, vocabulary
  248320, untied output). Every 4th layer (3, 7, 11, ...; ``full_attention_interval`` 4) is gated
  full attention: 16 query heads of 256 (``attn_q`` holds each head's queries and its output
  gate: 2 x 16 x 256 rows), 4 KV heads, Q/K norms, partial interleaved RoPE (64 of 256 dimensions,
  ``rope.dimension_sections`` [11, 11, 10, 0]). The other layers are Gated DeltaNet (``ssm.*``:
  16 query/key heads and 32 value heads of 128, a 4-tap causal convolution): a fused ``attn_qkv``
  (2 x 16 x 128 + 32 x 128 rows), the output gate ``attn_gate``, the per-head ``ssm_beta`` /
  ``ssm_alpha`` projections, ``ssm_out``; F32 ``ssm_conv1d``, ``ssm_dt.bias``, ``ssm_a`` (negative:
  it is -exp(A_log)) and ``ssm_norm``. Formats: Q4_K, except ``attn_qkv`` Q5_K (llama-quantize's
  Q4_K_M rule for a fused QKV), ``attn_v`` and ``ffn_down`` Q6_K on the ``use_more_bits`` layers,
  ``ssm_beta`` / ``ssm_alpha`` Q8_0 (small matrices: 32 rows each), ``output`` Q6_K, ``token_embd``
  Q4_K; norms and the recurrent layers' small vectors F32. The pre-FFN norm is
  ``post_attention_norm`` (as llama.cpp names it for ``qwen35``). It is a "-like" shape, not a
  copy of a released file's header: tokenizer and specials are the script's own (below, with
  Qwen's ChatML specials and the ``qwen2`` pre-tokenizer as the qwen3 shape has).
* ``qwen3.5-35b-a3b`` (``qwen35moe``, "Q4_K_M"): a Qwen3.5-35B-A3B-like hybrid mixture of experts,
  its numbers following the published Qwen3.5 / Qwen3-Next MoE configs' proportions (hidden 2048,
  40 layers, vocabulary 248320, untied output). Layers as in ``qwen3.5-4b`` (same tensors, widths
  from hidden 2048): every 4th gated full attention (16 query heads of 256, 2 KV heads, partial
  interleaved RoPE 64 of 256, sections [11, 11, 10, 0]), the others Gated DeltaNet (16 query/key
  heads and 32 value heads of 128). Every layer's FFN is a mixture of 256 experts, 8 used per
  token, each 512 wide (``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps`` 3-D stacks, F32
  router ``ffn_gate_inp``), plus one always-on shared expert 512 wide (``ffn_gate_shexp`` /
  ``ffn_up_shexp`` / ``ffn_down_shexp``) scaled by a sigmoid gate whose F32 weights
  ``ffn_gate_inp_shexp`` hold one value per hidden unit. Formats: as ``qwen3.5-4b`` for the
  attention and recurrent tensors; the expert and shared-expert matrices Q4_K, except
  ``ffn_down_exps`` and ``ffn_down_shexp`` Q6_K on the ``use_more_bits`` layers (llama-quantize
  reads the layer from the tensor name for MoE models, so both follow the layer rule).

``--layers N`` writes a shallower file with the same per-layer shapes; ``use_more_bits`` is then
applied over N layers. Values are random but every block is valid: f16 scales are finite normal
numbers, E8M0 exponents are far from 0 and 255, Q8_0 never uses -128; the scales are chosen so
each dequantized weight has a standard deviation of ``min(0.02, 1/sqrt(fan_in))`` around a zero
mean (so each projection roughly keeps the scale of its normalised input and the hidden state
stays finite through the layers). Norm weights are ~1, biases small, the router F32 with
std 1/sqrt(hidden); Gated DeltaNet's ``ssm_a`` is -exp(uniform(-1, 1.5)), ``ssm_dt.bias`` has std
0.5 and the convolution taps std 0.3.

The file is streamed: the header, metadata and tensor directory first, then each tensor
generated right before it is written (the largest, gpt-oss's Q8_0 embedding, is ~0.6 GB), with
the written pages synced and dropped from the page cache every ~1 GB.

Tokenizer: byte-level BPE ("gpt2") with the model's pre-tokenizer name, the 256 GPT-2 byte tokens,
a few merges whose results are in the vocabulary, NORMAL filler tokens ``Ġtok<N>`` and the model's
special tokens as CONTROL tokens at the end, for exactly the real vocabulary size.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES

F32 = QT.F32


# ---------------------------------------------------------------------------------------------
# shapes


@dataclass
class Shape:
    name: str
    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context: int
    rope_base: float
    rms_eps: float
    ffn: int  # feed_forward_length
    file_type: int  # general.file_type (llama_ftype)
    pre: str  # tokenizer.ggml.pre
    specials: list[str]
    bos: str
    eos: str
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0
    rope_dims: int | None = None
    extra: dict = field(default_factory=dict)


SHAPES = {
    "qwen3-30b-a3b": Shape(
        name="qwen3-30b-a3b", arch="qwen3moe", hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128,
        vocab=151936, context=40960, rope_base=1e6, rms_eps=1e-6, ffn=6144,
        file_type=int(gguf.LlamaFileType.MOSTLY_Q4_K_M), pre="qwen2",
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos="<|endoftext|>", eos="<|im_end|>",
        experts=128, experts_used=8, expert_ffn=768,
    ),
    "gpt-oss-20b": Shape(
        name="gpt-oss-20b", arch="gpt-oss", hidden=2880, layers=24, heads=64, kv_heads=8, head_dim=64,
        vocab=201088, context=131072, rope_base=150000.0, rms_eps=1e-5, ffn=2880,
        file_type=int(gguf.LlamaFileType.MOSTLY_MXFP4_MOE), pre="gpt-4o",
        specials=["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                  "<|return|>", "<|call|>", "<|constrain|>"],
        bos="<|startoftext|>", eos="<|return|>",
        experts=32, experts_used=4, expert_ffn=2880,
        extra={"sliding_window": 128, "yarn_factor": 32.0, "yarn_orig_ctx": 4096},
    ),
    "phi-4-mini": Shape(
        name="phi-4-mini", arch="phi3", hidden=3072, layers=32, heads=24, kv_heads=8, head_dim=128,
        vocab=200064, context=131072, rope_base=10000.0, rms_eps=1e-5, ffn=8192,
        file_type=int(gguf.LlamaFileType.MOSTLY_Q4_K_M), pre="gpt-4o",
        specials=["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
        bos="<|endoftext|>", eos="<|endoftext|>",
        rope_dims=96, extra={"attn_factor": 1.1902381, "orig_ctx": 4096},
    ),
    "qwen3.5-4b": Shape(
        name="qwen3.5-4b", arch="qwen35", hidden=2560, layers=32, heads=16, kv_heads=4, head_dim=256,
        vocab=248320, context=262144, rope_base=1e7, rms_eps=1e-6, ffn=9216,
        file_type=int(gguf.LlamaFileType.MOSTLY_Q4_K_M), pre="qwen2",
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos="<|endoftext|>", eos="<|im_end|>",
        rope_dims=64,
        extra={"rope_sections": [11, 11, 10, 0], "full_attention_interval": 4,
               "ssm_conv_kernel": 4, "ssm_state": 128, "ssm_groups": 16, "ssm_v_heads": 32},
    ),
    "qwen3.5-35b-a3b": Shape(
        name="qwen3.5-35b-a3b", arch="qwen35moe", hidden=2048, layers=40, heads=16, kv_heads=2, head_dim=256,
        vocab=248320, context=262144, rope_base=1e7, rms_eps=1e-6, ffn=512,
        file_type=int(gguf.LlamaFileType.MOSTLY_Q4_K_M), pre="qwen2",
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos="<|endoftext|>", eos="<|im_end|>",
        experts=256, experts_used=8, expert_ffn=512, rope_dims=64,
        extra={"rope_sections": [11, 11, 10, 0], "full_attention_interval": 4,
               "ssm_conv_kernel": 4, "ssm_state": 128, "ssm_groups": 16, "ssm_v_heads": 32,
               "shared_expert_ffn": 512},
    ),
}


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp src/llama-quant.cpp: the layers Q4_K_M gives more bits (attn_v, ffn_down)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


@dataclass
class TensorPlan:
    name: str
    shape: tuple[int, ...]  # numpy order: (experts,) rows, cols; ggml ne is the reverse
    qtype: QT
    kind: str  # weight | norm | bias | router | sinks | rope_short | rope_long | ssm_a | dt_bias | conv
    expert: bool = False  # part of the routed experts (for the active-parameter count)
    layer: int = -1

    @property
    def n(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        assert self.shape[-1] % block == 0, f"{self.name}: {self.shape[-1]} columns are not whole {self.qtype.name} blocks"
        return self.n // block * size


def plan(s: Shape, n_layers: int, nextn: bool = False) -> list[TensorPlan]:
    h, qw, kvw = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    out: list[TensorPlan] = []

    def add(name, shape, qtype, kind="weight", expert=False, layer=-1):
        out.append(TensorPlan(name, tuple(shape), qtype, kind, expert, layer))

    if s.arch == "qwen3moe":
        add("token_embd.weight", (s.vocab, h), QT.Q4_K)
        for i in range(n_layers):
            t, more = f"blk.{i}.", use_more_bits(i, n_layers)
            add(t + "attn_norm.weight", (h,), F32, "norm", layer=i)
            add(t + "attn_q.weight", (qw, h), QT.Q4_K, layer=i)
            add(t + "attn_k.weight", (kvw, h), QT.Q4_K, layer=i)
            add(t + "attn_v.weight", (kvw, h), QT.Q6_K if more else QT.Q4_K, layer=i)
            add(t + "attn_output.weight", (h, qw), QT.Q4_K, layer=i)
            add(t + "attn_q_norm.weight", (s.head_dim,), F32, "norm", layer=i)
            add(t + "attn_k_norm.weight", (s.head_dim,), F32, "norm", layer=i)
            add(t + "ffn_norm.weight", (h,), F32, "norm", layer=i)
            add(t + "ffn_gate_inp.weight", (s.experts, h), F32, "router", layer=i)
            add(t + "ffn_gate_exps.weight", (s.experts, s.expert_ffn, h), QT.Q4_K, expert=True, layer=i)
            add(t + "ffn_up_exps.weight", (s.experts, s.expert_ffn, h), QT.Q4_K, expert=True, layer=i)
            add(t + "ffn_down_exps.weight", (s.experts, h, s.expert_ffn), QT.Q6_K if more else QT.Q4_K, expert=True, layer=i)
        add("output_norm.weight", (h,), F32, "norm")
        add("output.weight", (s.vocab, h), QT.Q6_K)
    elif s.arch == "gpt-oss":
        add("token_embd.weight", (s.vocab, h), QT.Q8_0)
        for i in range(n_layers):
            t = f"blk.{i}."
            add(t + "attn_norm.weight", (h,), F32, "norm", layer=i)
            add(t + "attn_q.weight", (qw, h), QT.Q8_0, layer=i)
            add(t + "attn_q.bias", (qw,), F32, "bias", layer=i)
            add(t + "attn_k.weight", (kvw, h), QT.Q8_0, layer=i)
            add(t + "attn_k.bias", (kvw,), F32, "bias", layer=i)
            add(t + "attn_v.weight", (kvw, h), QT.Q8_0, layer=i)
            add(t + "attn_v.bias", (kvw,), F32, "bias", layer=i)
            add(t + "attn_output.weight", (h, qw), QT.Q8_0, layer=i)
            add(t + "attn_output.bias", (h,), F32, "bias", layer=i)
            add(t + "attn_sinks.weight", (s.heads,), F32, "sinks", layer=i)
            add(t + "post_attention_norm.weight", (h,), F32, "norm", layer=i)
            add(t + "ffn_gate_inp.weight", (s.experts, h), F32, "router", layer=i)
            add(t + "ffn_gate_inp.bias", (s.experts,), F32, "router_bias", layer=i)
            add(t + "ffn_gate_exps.weight", (s.experts, s.expert_ffn, h), QT.MXFP4, expert=True, layer=i)
            add(t + "ffn_gate_exps.bias", (s.experts, s.expert_ffn), F32, "bias", expert=True, layer=i)
            add(t + "ffn_up_exps.weight", (s.experts, s.expert_ffn, h), QT.MXFP4, expert=True, layer=i)
            add(t + "ffn_up_exps.bias", (s.experts, s.expert_ffn), F32, "bias", expert=True, layer=i)
            add(t + "ffn_down_exps.weight", (s.experts, h, s.expert_ffn), QT.MXFP4, expert=True, layer=i)
            add(t + "ffn_down_exps.bias", (s.experts, h), F32, "bias", expert=True, layer=i)
        add("output_norm.weight", (h,), F32, "norm")
        add("output.weight", (s.vocab, h), QT.Q8_0)
    elif s.arch == "phi3":
        # tied embeddings: llama-quantize quantizes a tied token_embd with the output's type (Q6_K)
        add("token_embd.weight", (s.vocab, h), QT.Q6_K)
        for i in range(n_layers):
            t = f"blk.{i}."
            add(t + "attn_norm.weight", (h,), F32, "norm", layer=i)
            add(t + "attn_qkv.weight", (qw + 2 * kvw, h), QT.Q5_K, layer=i)
            add(t + "attn_output.weight", (h, qw), QT.Q4_K, layer=i)
            add(t + "ffn_norm.weight", (h,), F32, "norm", layer=i)
            add(t + "ffn_up.weight", (2 * s.ffn, h), QT.Q4_K, layer=i)  # gate rows, then up rows
            add(t + "ffn_down.weight", (h, s.ffn), QT.Q6_K if use_more_bits(i, n_layers) else QT.Q4_K, layer=i)
        rot = s.rope_dims or s.head_dim
        add("rope_factors_long.weight", (rot // 2,), F32, "rope_long")
        add("rope_factors_short.weight", (rot // 2,), F32, "rope_short")
        add("output_norm.weight", (h,), F32, "norm")
    elif s.arch in ("qwen35", "qwen35moe"):  # the same layers; the FFN dense or a mixture of experts
        x = s.extra
        interval, d_state, v_heads = x["full_attention_interval"], x["ssm_state"], x["ssm_v_heads"]
        key_dim, value_dim = x["ssm_groups"] * d_state, v_heads * d_state
        conv_dim = 2 * key_dim + value_dim  # the convolution runs over q, k and v alike
        add("token_embd.weight", (s.vocab, h), QT.Q4_K)
        # with `nextn`, the prediction layer after the trunk: a full-attention block with its
        # input projection and norms (llama.cpp's names; it shares the embedding and output head)
        for i in range(n_layers + int(nextn)):
            t, more = f"blk.{i}.", use_more_bits(i, n_layers)
            if i == n_layers:
                add(t + "nextn.eh_proj.weight", (h, 2 * h), QT.Q4_K, layer=i)
                add(t + "nextn.enorm.weight", (h,), F32, "norm", layer=i)
                add(t + "nextn.hnorm.weight", (h,), F32, "norm", layer=i)
                add(t + "nextn.shared_head_norm.weight", (h,), F32, "norm", layer=i)
            add(t + "attn_norm.weight", (h,), F32, "norm", layer=i)
            if (i + 1) % interval == 0 or i == n_layers:  # full attention, gated: queries and a gate per head
                add(t + "attn_q.weight", (2 * qw, h), QT.Q4_K, layer=i)
                add(t + "attn_k.weight", (kvw, h), QT.Q4_K, layer=i)
                add(t + "attn_v.weight", (kvw, h), QT.Q6_K if more else QT.Q4_K, layer=i)
                add(t + "attn_output.weight", (h, qw), QT.Q4_K, layer=i)
                add(t + "attn_q_norm.weight", (s.head_dim,), F32, "norm", layer=i)
                add(t + "attn_k_norm.weight", (s.head_dim,), F32, "norm", layer=i)
            else:  # Gated DeltaNet
                add(t + "attn_qkv.weight", (conv_dim, h), QT.Q5_K, layer=i)
                add(t + "attn_gate.weight", (value_dim, h), QT.Q4_K, layer=i)
                add(t + "ssm_beta.weight", (v_heads, h), QT.Q8_0, layer=i)
                add(t + "ssm_alpha.weight", (v_heads, h), QT.Q8_0, layer=i)
                add(t + "ssm_conv1d.weight", (conv_dim, x["ssm_conv_kernel"]), F32, "conv", layer=i)
                add(t + "ssm_dt.bias", (v_heads,), F32, "dt_bias", layer=i)
                add(t + "ssm_a", (v_heads,), F32, "ssm_a", layer=i)
                add(t + "ssm_norm.weight", (d_state,), F32, "norm", layer=i)
                add(t + "ssm_out.weight", (h, value_dim), QT.Q4_K, layer=i)
            add(t + "post_attention_norm.weight", (h,), F32, "norm", layer=i)  # the pre-FFN norm
            if s.arch == "qwen35":
                add(t + "ffn_gate.weight", (s.ffn, h), QT.Q4_K, layer=i)
                add(t + "ffn_up.weight", (s.ffn, h), QT.Q4_K, layer=i)
                add(t + "ffn_down.weight", (h, s.ffn), QT.Q6_K if more else QT.Q4_K, layer=i)
            else:  # routed experts, then the shared expert and its sigmoid gate (one weight per hidden unit)
                sh = x["shared_expert_ffn"]
                add(t + "ffn_gate_inp.weight", (s.experts, h), F32, "router", layer=i)
                add(t + "ffn_gate_exps.weight", (s.experts, s.expert_ffn, h), QT.Q4_K, expert=True, layer=i)
                add(t + "ffn_up_exps.weight", (s.experts, s.expert_ffn, h), QT.Q4_K, expert=True, layer=i)
                add(t + "ffn_down_exps.weight", (s.experts, h, s.expert_ffn), QT.Q6_K if more else QT.Q4_K, expert=True, layer=i)
                add(t + "ffn_gate_inp_shexp.weight", (h,), F32, "router", layer=i)
                add(t + "ffn_gate_shexp.weight", (sh, h), QT.Q4_K, layer=i)
                add(t + "ffn_up_shexp.weight", (sh, h), QT.Q4_K, layer=i)
                add(t + "ffn_down_shexp.weight", (h, sh), QT.Q6_K if more else QT.Q4_K, layer=i)
        add("output_norm.weight", (h,), F32, "norm")
        add("output.weight", (s.vocab, h), QT.Q6_K)
    else:
        raise ValueError(s.arch)
    return out


# ---------------------------------------------------------------------------------------------
# random valid blocks

CHUNK_BLOCKS = 1 << 20  # blocks generated per step (bounded temporaries)


def random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    words = rng.integers(0, np.iinfo(np.uint64).max, (n + 7) // 8, dtype=np.uint64, endpoint=True)
    return words.view(np.uint8)[:n]


def f16_bytes(x: np.ndarray) -> np.ndarray:
    h = x.astype(np.float16)
    if not (np.all(np.isfinite(h)) and np.all(np.abs(h) >= np.float16(6.104e-05))):
        raise AssertionError("a block scale is not a finite normal f16")
    return h.view(np.uint8).reshape(-1, 2)


def jitter(rng, n):
    return rng.uniform(0.8, 1.2, n)


def fill_q4_k(blk: np.ndarray, sigma: float, rng) -> None:
    """block_q4_K: d f16, dmin f16, scales[12] (6-bit sc/m packed), qs[128]; w = d*sc*q - dmin*m.
    d == dmin and m = 7.5 sc make every sub-block zero-mean (q uniform on 0..15, mean 7.5)."""
    n = blk.shape[0]
    sc = rng.choice(np.array([4, 6, 8], dtype=np.uint8), size=(n, 8))
    m = (sc.astype(np.uint16) * 15 // 2).astype(np.uint8)  # 30, 45, 60
    d = sigma / (math.sqrt((16 + 36 + 64) / 3) * math.sqrt((16 * 16 - 1) / 12)) * jitter(rng, n)
    blk[:, 0:2] = f16_bytes(d)
    blk[:, 2:4] = f16_bytes(d)
    blk[:, 4:16] = pack_k_scales(sc, m)


def fill_q5_k(blk: np.ndarray, sigma: float, rng) -> None:
    """block_q5_K: d, dmin, scales[12], qh[32], qs[128]; q on 0..31 (mean 15.5), m = 15.5 sc."""
    n = blk.shape[0]
    sc = rng.choice(np.array([2, 4], dtype=np.uint8), size=(n, 8))
    m = (sc.astype(np.uint16) * 31 // 2).astype(np.uint8)  # 31, 62
    d = sigma / (math.sqrt((4 + 16) / 2) * math.sqrt((32 * 32 - 1) / 12)) * jitter(rng, n)
    blk[:, 0:2] = f16_bytes(d)
    blk[:, 2:4] = f16_bytes(d)
    blk[:, 4:16] = pack_k_scales(sc, m)


def pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """ggml's get_scale_min_k4 layout: bytes 0-3 sc[0-3] (+ bits 4-5 of sc[4-7] on top),
    4-7 m[0-3] (+ bits 4-5 of m[4-7]), 8-11 low nibbles of sc[4-7] | m[4-7] << 4."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 0x3F) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    return out


def fill_q6_k(blk: np.ndarray, sigma: float, rng) -> None:
    """block_q6_K: ql[128], qh[64], scales[16] int8, d f16; w = d*sc*(q - 32), q on 0..63.
    Scales of random sign cancel the -0.5 mean of q - 32 on average."""
    n = blk.shape[0]
    mag = rng.choice(np.array([2, 3, 4], dtype=np.int8), size=(n, 16))
    sign = np.where(rng.integers(0, 2, size=(n, 16), dtype=np.int8) == 0, 1, -1).astype(np.int8)
    blk[:, 192:208] = (mag * sign).view(np.uint8)
    d = sigma / (math.sqrt((4 + 9 + 16) / 3) * math.sqrt((64 * 64 - 1) / 12 + 0.25)) * jitter(rng, n)
    blk[:, 208:210] = f16_bytes(d)


def fill_q8_0(blk: np.ndarray, sigma: float, rng) -> None:
    """block_q8_0: d f16, qs[32] int8 (-127..127 as ggml's quantizer writes; -128 becomes -127)."""
    n = blk.shape[0]
    qs = blk[:, 2:34]
    qs[qs == 0x80] = 0x81
    d = sigma / math.sqrt(127 * 128 / 3) * jitter(rng, n)
    blk[:, 0:2] = f16_bytes(d)


MXFP4_RMS = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)  # of random e2m1 codes


def fill_mxfp4(blk: np.ndarray, sigma: float, rng) -> None:
    """block_mxfp4: e (E8M0), qs[16] (two e2m1 codes a byte); w = e2m1 * 2^(e - 127)
    (ggml: kvalues doubled times ggml_e8m0_to_fp32_half(e) = 2^(e - 128)). e is one of two
    neighbouring exponents so the rms is sigma."""
    n = blk.shape[0]
    e0 = int(round(127 + math.log2(sigma / (MXFP4_RMS * math.sqrt(2.5)))))
    assert 2 < e0 < 250
    blk[:, 0] = e0 + rng.integers(0, 2, size=n, dtype=np.uint8)


FILL = {QT.Q4_K: fill_q4_k, QT.Q5_K: fill_q5_k, QT.Q6_K: fill_q6_k, QT.Q8_0: fill_q8_0, QT.MXFP4: fill_mxfp4}


def weight_sigma(t: TensorPlan) -> float:
    return min(0.02, 1.0 / math.sqrt(t.shape[-1]))


def quant_tensor(t: TensorPlan, rng) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[t.qtype]
    nb = t.n // block
    out = np.empty((nb, size), dtype=np.uint8)
    sigma = weight_sigma(t)
    for a in range(0, nb, CHUNK_BLOCKS):
        b = min(nb, a + CHUNK_BLOCKS)
        out[a:b] = random_bytes(rng, (b - a) * size).reshape(b - a, size)
        FILL[t.qtype](out[a:b], sigma, rng)
    return out.reshape(-1)


def f32_tensor(t: TensorPlan, s: Shape, rng) -> np.ndarray:
    n = t.n
    if t.kind == "norm":
        x = 1.0 + 0.05 * rng.standard_normal(n)
    elif t.kind == "bias":
        x = 0.02 * rng.standard_normal(n)
    elif t.kind == "router":
        x = rng.standard_normal(n) / math.sqrt(s.hidden)
    elif t.kind == "router_bias":
        x = 0.1 * rng.standard_normal(n)
    elif t.kind == "sinks":
        x = 0.5 * rng.standard_normal(n)
    elif t.kind in ("rope_short", "rope_long"):
        # LongRoPE divisors: 1 for the fastest pairs up to ~4 (short) / ~8 (long) for the slowest
        x = np.linspace(1.0, 4.0 if t.kind == "rope_short" else 8.0, n)
    elif t.kind == "ssm_a":
        # -exp(A_log): each head's decay rate, negative
        x = -np.exp(rng.uniform(-1.0, 1.5, n))
    elif t.kind == "dt_bias":
        x = 0.5 * rng.standard_normal(n)
    elif t.kind == "conv":
        x = 0.3 * rng.standard_normal(n)
    else:
        x = rng.standard_normal(n) * weight_sigma(t)
    x = x.astype(np.float32).reshape(t.shape)
    assert np.all(np.isfinite(x)), t.name
    return x


def check_dequant(t: TensorPlan, data: np.ndarray) -> str:
    """Dequantizes the first rows (of the first expert) with gguf-py and reports them."""
    block, size = GGML_QUANT_SIZES[t.qtype]
    row_bytes = t.shape[-1] // block * size
    rows = min(8, t.n // t.shape[-1])
    x = gguf.quants.dequantize(data[: rows * row_bytes].reshape(rows, row_bytes), t.qtype)
    finite = bool(np.all(np.isfinite(x)))
    if not finite:
        raise AssertionError(f"{t.name}: non-finite dequantized values")
    return (f"check {t.name} {t.qtype.name}: {rows}x{x.shape[-1]} dequantized by gguf-py: finite, "
            f"mean {x.mean():+.2e} std {x.std():.4f} (target {weight_sigma(t):.4f}) max|w| {np.abs(x).max():.3f}")


# ---------------------------------------------------------------------------------------------
# tokenizer


def bytes_to_unicode() -> list[str]:
    """GPT-2's printable spelling of each byte value, indexed by the byte."""
    from tokenizer_oracle import byte_chars  # python/, beside this script

    return byte_chars()


MERGES = ["Ġ t", "Ġ a", "i n", "t h", "e r", "Ġt h", "Ġth e"]


def vocabulary(s: Shape) -> tuple[list[str], list[int], list[str]]:
    tokens = bytes_to_unicode()
    merged = [m.replace(" ", "") for m in MERGES]
    tokens += merged
    n_fill = s.vocab - len(tokens) - len(s.specials)
    tokens += [f"Ġtok{i}" for i in range(n_fill)]
    types = [int(gguf.TokenType.NORMAL)] * len(tokens)
    tokens += s.specials
    types += [int(gguf.TokenType.CONTROL)] * len(s.specials)
    assert len(tokens) == s.vocab and len(set(tokens)) == s.vocab
    return tokens, types, MERGES


# ---------------------------------------------------------------------------------------------


def write_metadata(w: gguf.GGUFWriter, s: Shape, n_layers: int, nextn: bool = False) -> None:
    w.add_name(f"{s.name} (random weights, real shapes)")
    w.add_file_type(s.file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_block_count(n_layers + int(nextn))
    if nextn:
        w.add_nextn_predict_layers(1)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.rope_dims or s.head_dim)
    w.add_rope_freq_base(s.rope_base)
    w.add_layer_norm_rms_eps(s.rms_eps)
    if s.experts:
        w.add_expert_count(s.experts)
        w.add_expert_used_count(s.experts_used)
        w.add_expert_feed_forward_length(s.expert_ffn)
    if s.arch == "gpt-oss":
        w.add_sliding_window(s.extra["sliding_window"])
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(s.extra["yarn_factor"])
        w.add_rope_scaling_orig_ctx_len(s.extra["yarn_orig_ctx"])
    if s.arch == "phi3":
        w.add_rope_scaling_attn_factors(s.extra["attn_factor"])
        w.add_rope_scaling_orig_ctx_len(s.extra["orig_ctx"])
    if s.arch in ("qwen35", "qwen35moe"):
        x = s.extra
        w.add_rope_dimension_sections(x["rope_sections"])  # int32 array
        w.add_full_attention_interval(x["full_attention_interval"])
        w.add_ssm_conv_kernel(x["ssm_conv_kernel"])
        w.add_ssm_state_size(x["ssm_state"])
        w.add_ssm_group_count(x["ssm_groups"])
        w.add_ssm_time_step_rank(x["ssm_v_heads"])
        w.add_ssm_inner_size(x["ssm_v_heads"] * x["ssm_state"])
    if s.arch == "qwen35moe":
        w.add_expert_shared_feed_forward_length(s.extra["shared_expert_ffn"])

    tokens, types, merges = vocabulary(s)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(s.pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index(s.bos))
    w.add_eos_token_id(tokens.index(s.eos))
    w.add_add_bos_token(False)


def params(s: Shape, tensors: list[TensorPlan]) -> tuple[int, int]:
    """Total parameters, and those one token touches: everything but the routed experts and the
    embedding, plus one embedding row (the whole embedding when tied: it is the output matrix),
    the output matrix and top-k of the experts."""
    total = sum(t.n for t in tensors)
    expert = sum(t.n for t in tensors if t.expert)
    embd = next(t for t in tensors if t.name == "token_embd.weight")
    tied = not any(t.name == "output.weight" for t in tensors)
    active = total - expert - embd.n + (embd.n if tied else s.hidden)
    if s.experts:
        active += expert * s.experts_used // s.experts
    return total, active


def human(n: float) -> str:
    return f"{n / 1e9:.3f} B"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", required=True, choices=sorted(SHAPES))
    ap.add_argument("--output", help="the GGUF file to write")
    ap.add_argument("--layers", type=int, help="layers to write (default: the real count)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--print-plan", action="store_true", help="list the tensors, formats and sizes; write nothing")
    ap.add_argument("--nextn", action="store_true", help="qwen3.5 shapes: append the prediction (MTP) layer the real files ship")
    a = ap.parse_args()

    s = SHAPES[a.shape]
    n_layers = a.layers or s.layers
    if n_layers < 1:
        ap.error("--layers must be at least 1")
    if a.nextn and s.arch not in ("qwen35", "qwen35moe"):
        ap.error("--nextn is for the qwen3.5 shapes")
    tensors = plan(s, n_layers, a.nextn)
    data_bytes = sum(t.nbytes for t in tensors)
    total, active = params(s, tensors)
    if a.print_plan:
        for t in tensors:
            print(f"{t.name:32s} {t.qtype.name:6s} ne={list(reversed(t.shape))} {t.nbytes} bytes")
        print(f"{len(tensors)} tensors, {data_bytes / 2**30:.2f} GiB of tensor data; "
              f"params total {human(total)}, active per token {human(active)}")
        return 0
    if not a.output:
        ap.error("--output is required (or --print-plan)")

    w = gguf.GGUFWriter(a.output, s.arch)
    write_metadata(w, s, n_layers, a.nextn)
    for t in tensors:
        # numpy-order element shape; tensor_dtype float32 so gguf-py takes the shape as elements
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]

    start = time.time()
    written = since_sync = 0
    checked: set[tuple[str, QT]] = set()
    last_layer = None
    for idx, t in enumerate(tensors):
        rng = np.random.Generator(np.random.SFC64([a.seed, idx]))
        if t.qtype == F32:
            data = f32_tensor(t, s, rng)
        else:
            data = quant_tensor(t, rng)
            # check the first tensor of each (role, format): its first rows, dequantized by gguf-py
            role = t.name.split(".")[2] if t.layer >= 0 else t.name
            if (role, t.qtype) not in checked:
                checked.add((role, t.qtype))
                print(check_dequant(t, data), file=sys.stderr)
        assert data.nbytes == t.nbytes, (t.name, data.nbytes, t.nbytes)
        w.write_tensor_data(data)
        written += data.nbytes
        since_sync += data.nbytes
        del data
        if since_sync >= 1 << 30:
            # keep dirty pages and this file's page cache small (the machine is shared)
            fout.flush()
            os.fdatasync(fout.fileno())
            os.posix_fadvise(fout.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            since_sync = 0
        layer_done = t.layer >= 0 and (idx + 1 == len(tensors) or tensors[idx + 1].layer != t.layer)
        if layer_done and t.layer != last_layer:
            last_layer = t.layer
            el = time.time() - start
            print(f"layer {t.layer + 1}/{n_layers}: {written / 2**30:.2f} of {data_bytes / 2**30:.2f} GiB, {el:.0f} s",
                  file=sys.stderr, flush=True)
    fout.flush()
    os.fdatasync(fout.fileno())
    os.posix_fadvise(fout.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    w.close()
    size = os.path.getsize(a.output)
    print(f"wrote {a.output}: {size} bytes ({size / 2**30:.2f} GiB), {len(tensors)} tensors, {n_layers} layers; "
          f"params total {human(total)} ({total}), active per token {human(active)} ({active}); "
          f"{time.time() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
