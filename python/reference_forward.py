#!/usr/bin/env python3
"""Independent NumPy reference forward pass for Llama-family, Qwen2, Qwen3, Qwen3.5, Qwen3-Next and Gemma 3 GGUF models.

It shares no code with the Rust engine: the GGUF is read with the `gguf` Python package
(GGUFReader), every weight is dequantized with `gguf.quants.dequantize`, and the forward is
written from the Llama definition:

    h = embed[tokens]
    for each layer:
        x  = rmsnorm(h) * attn_norm
        q, k, v = x Wq^T, x Wk^T, x Wv^T            (GQA: n_kv_heads < n_heads)
        q, k = rope(q), rope(k)                      (llama.cpp "normal" mode, see below)
        a  = softmax(q k^T / sqrt(d) + causal_mask) v
        h += a Wo^T
        x  = rmsnorm(h) * ffn_norm
        h += (silu(x Wgate^T) * (x Wup^T)) Wdown^T      (dense), or for a mixture of experts:
        p  = softmax(x Wrouter^T); S = top-k experts of p (ties: lower index)
        w  = p[S] / sum(p[S])  (expert_weights_norm, default on: Mixtral's softmax over the k)
        h += sum_{e in S} w_e * FFN_e(x)  [+ sigmoid(x . g_sh) * FFN_shared(x), Qwen2-MoE]
    logits = (rmsnorm(h) * output_norm) Wout^T       (Wout = token_embd when tied)

Other architectures, as llama.cpp builds them (src/models/*.cpp), on top of that block:

    qwen2   q, k, v += attn_{q,k,v}.bias; NeoX RoPE (the converter does not permute Q/K)
    qwen3   q, k = rmsnorm per head (attn_q_norm / attn_k_norm, [head_dim]) before RoPE; NeoX
    gemma3  h = embed[tokens] * sqrt(hidden); per-head q/k norms; NeoX RoPE;
            h += rmsnorm(attention out) * post_attention_norm
            h += rmsnorm(gelu_tanh(x Wgate^T) * (x Wup^T) Wdown^T) * post_ffw_norm
            layer i is local unless i % P == P - 1 (P = attention.sliding_window_pattern,
            default 6): a local layer's query at position p sees keys p - W < j <= p only
            (W = attention.sliding_window; llama.cpp masks j when p - j >= W) and rotates with
            base 10000 (rope.local.freq_base if given) instead of rope.freq_base.
            The converter already added 1 to Gemma's norm weights, so they multiply as stored.
    smollm3 llama's block; layer i applies no RoPE when (i + 1) % 4 == 0 (llama.cpp's
            n_no_rope_layer_step, fixed for the architecture)
    qwen2moe qwen2's attention; MoE with softmax weights NOT renormalised over the chosen experts
            and the shared expert gated by sigmoid(x . ffn_gate_inp_shexp)
    qwen3moe qwen3's attention; MoE with the chosen experts' weights renormalised
    phi3    attn_qkv holds Wq, Wk, Wv stacked (rows); ffn_up holds gate then up (ggml swiglu
            split: silu(first half) * second half); NeoX RoPE over the first
            rope.dimension_count dimensions only (partial RoPE), frequencies divided by
            rope_factors_short.weight, cos and sin multiplied by rope.scaling.attn_factor
            (ggml's mscale: the rotated dimensions grow by it, the rest do not)
    llama3  RoPE frequency i divided by rope_freqs.weight[i] when the tensor exists, else by the
            factors of rope.scaling.type = "llama3" (factor, low/high_freq_factor,
            original_context_length; HF's _compute_llama3_parameters).
    gpt-oss q, k, v += biases; o += attn_output.bias; NeoX RoPE with YaRN (below) on every layer;
            layer i is local when i % P < P - 1 (P = attention.sliding_window_pattern, default
            2: the even layers), window attention.sliding_window; each head h has a sink logit
            s_h that joins its softmax's denominator: p_j = exp(z_j) / (sum_i exp(z_i) +
            exp(s_h)); the pre-FFN norm is called post_attention_norm; MoE: router logits
            l = x Wr^T + b, S = top-k of l, w = softmax(l[S]); each expert
            (clamped SwiGLU with biases): g = min(x Wg^T + bg, 7), u = clamp(x Wu^T + bu, -7, 7),
            y = (g * sigmoid(1.702 g) * (u + 1)) Wd^T + bd.
    yarn    (rope.scaling.type = "yarn", HF's _compute_yarn_parameters with llama.cpp's
            rounding): frequency f_i = theta^(-2i/d); d_c(b) = d ln(L / (2 pi b)) / (2 ln theta)
            with L = rope.scaling.original_context_length; low = max(0, floor(d_c(32))),
            high = min(d - 1, ceil(d_c(1))); ramp_i = 1 - clamp((i - low) / (high - low), 0, 1);
            f'_i = f_i / factor * (1 - ramp_i) + f_i * ramp_i; cos and sin times
            1 + 0.1 ln(factor).
    qwen35  (Qwen3.5, llama.cpp src/models/qwen35.cpp) hybrid: the trunk is block_count -
            nextn_predict_layers layers (the MTP layer after it: nextn below); layer i is a Gated
            DeltaNet layer when attention.recurrent_layers[i] says so, else when
            (i + 1) % full_attention_interval (default 4) != 0, otherwise a gated attention
            layer.  Every layer: h += mixer(rmsnorm(h) * attn_norm);
            h += SwiGLU(rmsnorm(h) * post_attention_norm) (the pre-FFN norm, as in gpt-oss).
            Attention: attn_q holds, per head, head_dim query rows then head_dim gate rows;
            qwen3's per-head q/k norms; interleaved M-RoPE (below); a *= sigmoid(gate) before
            attn_output.
            Gated DeltaNet (d = ssm.state_size, Hk = ssm.group_count key heads, Hv =
            ssm.time_step_rank value heads, K = ssm.conv_kernel):
              [q; k; v] = silu(causal depthwise conv_K(x Wqkv^T))  (ssm_conv1d [C, K], tap K-1
                          is the current token, zeros before the first), q, k: Hk heads of d,
                          v: Hv heads of d; z = x Wgate^T (attn_gate)
              q, k = x / sqrt(sum x^2 + eps) per head (ggml: rms_norm(eps / d) / sqrt(d))
              g = softplus(x Walpha^T + ssm_dt.bias) * ssm_a  (ssm_a = -exp(A_log) as stored)
              beta = sigmoid(x Wbeta^T)
              per value head h, with key head h % Hk (ggml_repeat tiles), state S[i][j] = 0:
                S = exp(g_h) S;  S += k (beta_h (v - S^T k))^T;  o = S^T q / sqrt(d)
              o_h = rmsnorm(o_h) * ssm_norm * silu(z_h);  out = concat(o_h) Wssm_out^T
    qwen3next (llama.cpp src/models/qwen3next.cpp) qwen35moe's hybrid (routed experts renormalised,
            sigmoid-gated shared expert; the same gated attention and nextn block), except:
              ssm_ba [2 Hv, hidden] replaces ssm_beta and ssm_alpha: with r = Hv / Hk its rows
                come per key head g as [beta of value heads g r..g r + r - 1, their alpha];
              legacy files: ssm_in [Hk (2 d + 2 r d), hidden] in place of attn_qkv and attn_gate,
                per key head g the rows [q_g, k_g, v of heads g r.., z of heads g r..]
                (qkv = [all q; all k; all v] in that order, z likewise);
              value head h reads key head h // r (ggml_repeat_4d on [d, 1, Hk] -> [d, r, Hk]
                interleaves; qwen35's repeat on [d, Hk] -> [d, Hv] tiles: h % Hk);
              RoPE: plain NeoX (ggml_rope_ext) over rope.dimension_count dims, no sections.
    imrope  (qwen35, rope.dimension_sections [s0, s1, s2, s3]) NeoX pairs (i, i + n_rot/2) over
            the first n_rot = rope.dimension_count dims; pair i is in sector
            m = i % (s0 + s1 + s2 + s3) and takes position t, h, w or e by ggml_mrope_cache_init's
            interleaved rule: h if m % 3 == 1 and m < 3 s1, w if m % 3 == 2 and m < 3 s2, t if
            m % 3 == 0 and m < 3 s0, else e.  For text t = h = w = the token's position and
            e = 0 (llm_graph_input_pos::set_input), so those pairs are not rotated.
    nextn   (qwen35 / qwen35moe / qwen3next multi-token prediction, llama.cpp's graph_mtp; `mtp_forward`)
            layer n = block_count - nextn_predict_layers (blk.n.*): one gated attention layer as
            the trunk's (never recurrent) with the trunk's kind of FFN, and nextn.eh_proj
            [H, 2H], nextn.enorm, nextn.hnorm, optional nextn.shared_head_norm (else
            output_norm), nextn.embed_tokens (else token_embd), nextn.shared_head_head (else
            the output head).  Teacher-forced over tokens t_0..t_{T-1}: with hn = the trunk's
            final state after output_norm, row i < T - 1 has the input
            [rmsnorm(embed[t_{i+1}]) * enorm, rmsnorm(hn_i) * hnorm] Weh^T; the T - 1 rows
            then pass the block as one causal sequence at RoPE positions 1..T-1 (row i at the
            position of t_{i+1}), and logits = (rmsnorm(x) * shared_head_norm) Whead^T.

RoPE: the HF->GGUF converter permutes the rows of Wq / Wk so that the two halves that HF's
`rotate_half` (NeoX style) pairs up become adjacent elements.  A GGUF llama model is therefore
rotated in llama.cpp's "normal" mode: the pairs are (x[2i], x[2i+1]) with angle
pos * theta^(-2i/head_dim).  (Using NeoX pairs (i, i + d/2) on GGUF weights gives garbage; the
sanity test `tests/test_reference_sanity.py` catches that through " Paris".)

Optional `act_quant="q8"` mimics what a llama.cpp-style engine does before integer dot
products: the input of every weight matmul is rounded to 8-bit blocks of 32 values
(d = max|x| / 127, q = round(x / d)), like ggml's Q8_0/Q8_1.  It is used to estimate how far
an exact-arithmetic engine with quantized activations may legitimately drift from the exact
float reference.  `act_quant="q8k"` is what specula's kernels read: as "q8", except that the
inputs of Q4_K / Q5_K matrices take one scale per super-block of 256 (like ggml's Q8_K) in every
row where no value carries more than SUPER_PEAK_ENERGY of its super-block's energy (specula's
`q8::quantize_rows_super`).

CLI:
    python3 python/reference_forward.py --model M.gguf --tokens 1,2,3 --out logits.npy
writes a float32 [n_tokens, vocab] array (logits at every position); with --nextn, the
multi-token-prediction layer's [n_tokens - 1, vocab].
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from dataclasses import dataclass

import numpy as np

try:
    import gguf
    from gguf import GGUFReader
except ImportError as e:  # pragma: no cover
    raise SystemExit("reference_forward.py needs the `gguf` package (pip install gguf)") from e


# ----------------------------------------------------------------------------- GGUF reading


@functools.lru_cache(maxsize=2)
def open_reader(path: str) -> GGUFReader:
    """One reader per file and process: building its fields reads every vocabulary string (about
    30 s for Gemma's 262k tokens), and the weights, the config and the tests' tokenizing all ask."""
    return GGUFReader(path)


def field_value(reader: GGUFReader, key: str, default=None):
    """Scalar / string / array value of a GGUF metadata field (None-safe)."""
    f = reader.fields.get(key)
    if f is None:
        return default
    if hasattr(f, "contents"):
        return f.contents()
    # Older gguf versions: decode by hand.
    if len(f.data) == 1:
        part = f.parts[f.data[0]]
        if f.types and f.types[0] == gguf.GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        return part.tolist()[0]
    return [bytes(f.parts[i]).decode("utf-8") if f.types[-1] == gguf.GGUFValueType.STRING else f.parts[i].tolist()[0] for i in f.data]


# llama.cpp's Gated DeltaNet hybrids (src/models/qwen35.cpp, qwen35moe.cpp, qwen3next.cpp)
HYBRIDS = ("qwen35", "qwen35moe", "qwen3next")


@dataclass
class Config:
    arch: str
    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_dim: int
    vocab: int
    rope_theta: float
    rms_eps: float
    n_experts: int = 0
    n_experts_used: int = 0
    expert_weights_norm: bool = True
    neox: bool = False
    embed_scale: float = 1.0
    gelu: bool = False
    sliding_window: int = 0  # 0: no local layers
    sliding_period: int = 0
    rope_theta_local: float = 10000.0
    attn_scale: float | None = None
    llama3: tuple | None = None  # (factor, low_freq_factor, high_freq_factor, original_context_length)
    no_rope_period: int = 0  # smollm3: layer i skips RoPE when (i + 1) % period == 0
    rope_mscale: float = 1.0  # phi3: cos and sin multiplied by rope.scaling.attn_factor
    yarn: tuple | None = None  # (factor, original_context_length)
    local_rope_own: bool = True  # gemma3: local layers rotate with their own base, unscaled
    recurrent: tuple = ()  # qwen35: per layer, whether it is a Gated DeltaNet layer
    rope_sections: tuple | None = None  # qwen35: interleaved M-RoPE sections (imrope)
    attn_out_gate: bool = False  # qwen35: attn_q holds each head's queries then its output gate
    ssm_state: int = 0  # qwen35 Gated DeltaNet: head width d (keys and values)
    ssm_groups: int = 0  # key heads Hk
    ssm_heads: int = 0  # value heads Hv
    ssm_interleave: bool = False  # qwen3next: value head h reads key head h // (Hv / Hk) (qwen35: h % Hk)
    n_nextn: int = 0  # qwen35: multi-token-prediction layers stored after the trunk (blk.{n_layers}.*)

    def uses_rope(self, layer: int) -> bool:
        return self.no_rope_period == 0 or (layer + 1) % self.no_rope_period != 0

    def is_recurrent(self, layer: int) -> bool:
        return bool(self.recurrent) and self.recurrent[layer]

    def is_local(self, layer: int) -> bool:
        return self.sliding_window > 0 and layer % self.sliding_period < self.sliding_period - 1


def read_config(reader: GGUFReader) -> Config:
    arch = field_value(reader, "general.architecture")
    g = lambda k, d=None: field_value(reader, f"{arch}.{k}", d)  # noqa: E731
    hidden = int(g("embedding_length"))
    n_heads = int(g("attention.head_count"))
    n_kv = int(g("attention.head_count_kv", n_heads))
    head_dim = int(g("attention.key_length", hidden // n_heads))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(g("vocab_size", len(tokens.data) if tokens is not None else 0))
    if arch not in ("llama", "mistral", "smollm3", "qwen2", "qwen2moe", "qwen3", "qwen3moe", *HYBRIDS, "gemma3", "phi3", "gpt-oss"):
        raise NotImplementedError(f"architecture {arch!r} is not modelled by this reference")
    gemma = arch == "gemma3"
    oss = arch == "gpt-oss"
    llama3 = None
    yarn = None
    if g("rope.scaling.type") == "llama3":
        llama3 = (
            float(g("rope.scaling.factor", 8.0)),
            float(g("rope.scaling.low_freq_factor", 1.0)),
            float(g("rope.scaling.high_freq_factor", 4.0)),
            int(g("rope.scaling.original_context_length", 8192)),
        )
    elif g("rope.scaling.type") == "yarn":
        yarn = (float(g("rope.scaling.factor")), int(g("rope.scaling.original_context_length", g("context_length"))))
    elif g("rope.scaling.type") not in (None, "none", "longrope"):
        raise NotImplementedError(f"rope scaling {g('rope.scaling.type')!r}")
    # the trunk: llama.cpp loads nextn_predict_layers MTP layers after it (`mtp_forward` runs them)
    n_layers = int(g("block_count")) - int(g("nextn_predict_layers", 0))
    q35 = arch in HYBRIDS
    recurrent, sections, ssm = (), None, (0, 0, 0)
    if q35:
        if llama3 is not None or yarn is not None:
            raise NotImplementedError(f"rope scaling on {arch}")
        flags = g("attention.recurrent_layers")
        period = int(g("full_attention_interval", 4))
        recurrent = tuple(bool(flags[i]) if flags is not None else (i + 1) % period != 0 for i in range(n_layers))
        if arch != "qwen3next":  # qwen3next: plain NeoX (ggml_rope_ext); llama.cpp reads no sections
            sections = tuple(int(s) for s in g("rope.dimension_sections"))
            sections = (sections + (0, 0, 0, 0))[:4]
        ssm = (int(g("ssm.state_size")), int(g("ssm.group_count")), int(g("ssm.time_step_rank")))
        # llama.cpp sizes the tensors with d_state and the state with d_inner / Hv: one width
        assert int(g("ssm.inner_size")) == ssm[0] * ssm[2], f"{arch}: ssm.inner_size != state_size * time_step_rank"
        assert ssm[2] % ssm[1] == 0, f"{arch}: ssm.time_step_rank (value heads) not a multiple of ssm.group_count (key heads)"
    return Config(
        arch=arch,
        n_layers=n_layers,
        hidden=hidden,
        ffn=int(g("feed_forward_length")),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        rope_dim=int(g("rope.dimension_count", head_dim)),
        vocab=vocab,
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rms_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        n_experts=int(g("expert_count", 0)),
        n_experts_used=int(g("expert_used_count", 0)),
        expert_weights_norm={"qwen2moe": False, "qwen3moe": True, "qwen35moe": True, "qwen3next": True, "gpt-oss": True}.get(arch, bool(g("expert_weights_norm", True))),
        neox=arch in ("qwen2", "qwen2moe", "qwen3", "qwen3moe", *HYBRIDS, "gemma3", "phi3", "gpt-oss"),
        embed_scale=float(np.sqrt(np.float32(hidden))) if gemma else 1.0,
        gelu=gemma,
        sliding_window=int(g("attention.sliding_window", 0)) if gemma or oss else 0,
        sliding_period=int(g("attention.sliding_window_pattern", 2 if oss else 6)) if gemma or oss else 0,
        local_rope_own=not oss,
        yarn=yarn,
        rope_theta_local=float(g("rope.local.freq_base", 10000.0)),
        attn_scale=None if g("attention.scale") is None else float(g("attention.scale")),
        llama3=llama3,
        no_rope_period=4 if arch == "smollm3" else 0,
        rope_mscale=float(g("rope.scaling.attn_factor", 1.0)) if arch == "phi3" else 1.0,
        recurrent=recurrent,
        rope_sections=sections,
        attn_out_gate=q35,
        ssm_state=ssm[0],
        ssm_groups=ssm[1],
        ssm_heads=ssm[2],
        ssm_interleave=arch == "qwen3next",
        n_nextn=int(g("nextn_predict_layers", 0)),
    )


def dequant(t, dtype) -> np.ndarray:
    """Tensor -> dense [rows, cols] (GGUF ne = [cols, rows], so rows = output features)."""
    w = gguf.quants.dequantize(t.data, t.tensor_type)
    ne = [int(x) for x in t.shape]  # ggml order: ne[0] is the contiguous (input) dimension
    w = np.asarray(w).reshape(list(reversed(ne)) if len(ne) > 1 else ne)
    return np.ascontiguousarray(w, dtype=dtype)


class Weights:
    def __init__(self, path: str, dtype=np.float32):
        reader = open_reader(os.path.realpath(path))
        self.cfg = read_config(reader)
        self.dtype = dtype
        t = {x.name: x for x in reader.tensors}
        # ids of the matrices stored as Q4_K / Q5_K (their inputs: `quantize_q8_super`)
        self.super_scaled: set[int] = set()

        def d(name):
            w = dequant(t[name], dtype)
            if t[name].tensor_type in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K):
                b = w
                while isinstance(b, np.ndarray):  # and the array owning its memory
                    self.super_scaled.add(id(b))
                    b = b.base
            return w

        self.embd = d("token_embd.weight")  # [vocab, hidden]
        self.output = d("output.weight") if "output.weight" in t else self.embd  # tied
        self.output_norm = d("output_norm.weight")

        def load_layer(i: int, recurrent: bool) -> dict:
            p = f"blk.{i}."
            c = self.cfg
            # gpt-oss and the qwen35 / qwen3next hybrids call their pre-FFN norm post_attention_norm
            ffn_norm = d(p + ("post_attention_norm.weight" if c.arch in ("gpt-oss", *HYBRIDS) else "ffn_norm.weight"))
            if recurrent:  # a Gated DeltaNet layer: no attention tensors
                layer = dict(
                    attn_norm=d(p + "attn_norm.weight"),
                    ffn_norm=ffn_norm,
                    ssm_conv=d(p + "ssm_conv1d.weight"),  # [channels, K] (ggml ne = [K, channels])
                    ssm_dt=d(p + "ssm_dt.bias").reshape(-1),  # [Hv]
                    ssm_a=d(p + "ssm_a").reshape(-1),  # [Hv], -exp(A_log)
                    ssm_norm=d(p + "ssm_norm.weight").reshape(-1),  # [d]
                    ssm_out=d(p + "ssm_out.weight"),  # [hidden, Hv d]
                )
                dk, Hk, Hv = c.ssm_state, c.ssm_groups, c.ssm_heads
                r = Hv // Hk
                if p + "attn_qkv.weight" in t:  # llama.cpp prefers these when present (qwen3next too)
                    layer["ssm_qkv"] = d(p + "attn_qkv.weight")  # [2 Hk d + Hv d, hidden]: q, k, v rows
                    layer["ssm_z"] = d(p + "attn_gate.weight")  # [Hv d, hidden]
                    assert layer["ssm_qkv"].shape == ((2 * Hk + Hv) * dk, c.hidden), layer["ssm_qkv"].shape
                    assert layer["ssm_z"].shape == (Hv * dk, c.hidden), layer["ssm_z"].shape
                elif c.arch == "qwen3next" and p + "ssm_in.weight" in t:
                    # legacy qwen3next: per key head g, rows [q_g (d), k_g (d), v (r d), z (r d)]
                    layer["ssm_in"] = d(p + "ssm_in.weight")
                    assert layer["ssm_in"].shape == (Hk * (2 * dk + 2 * r * dk), c.hidden), layer["ssm_in"].shape
                else:
                    raise KeyError(f"{p[:-1]}: a recurrent layer without attn_qkv.weight" + (" or ssm_in.weight" if c.arch == "qwen3next" else ""))
                if c.arch == "qwen3next":
                    if p + "ssm_ba.weight" not in t:  # llama.cpp's LLM_TENSOR_SSM_BETA_ALPHA: "blk.%d.ssm_ba"
                        other = [n for n in t if n.startswith(p) and ("beta" in n or "alpha" in n)]
                        raise KeyError(f"{p}ssm_ba.weight (qwen3next's fused beta / alpha, as llama.cpp names it) is missing; the layer has {other}")
                    # per key head g, rows [beta of value heads g r..g r + r - 1, then their alpha]
                    layer["ssm_ba"] = d(p + "ssm_ba.weight")  # [2 Hv, hidden]
                    assert layer["ssm_ba"].shape == (2 * Hv, c.hidden), layer["ssm_ba"].shape
                else:
                    layer["ssm_beta"] = d(p + "ssm_beta.weight")  # [Hv, hidden]
                    layer["ssm_alpha"] = d(p + "ssm_alpha.weight")  # [Hv, hidden]
                C = (2 * c.ssm_groups + c.ssm_heads) * c.ssm_state
                assert layer["ssm_conv"].shape[0] == C, layer["ssm_conv"].shape
                assert layer["ssm_norm"].shape == (c.ssm_state,), layer["ssm_norm"].shape
                assert layer["ssm_out"].shape == (c.hidden, c.ssm_heads * c.ssm_state), layer["ssm_out"].shape
            else:
                if p + "attn_qkv.weight" in t:  # phi3: Q, K, V rows stacked in one tensor
                    qkv = d(p + "attn_qkv.weight")
                    qw, kvw = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
                    wq, wk, wv = qkv[:qw], qkv[qw : qw + kvw], qkv[qw + kvw : qw + 2 * kvw]
                else:
                    # qwen35: wq has 2 n_heads head_dim rows (queries and output gate, split in `forward`)
                    wq, wk, wv = d(p + "attn_q.weight"), d(p + "attn_k.weight"), d(p + "attn_v.weight")
                layer = dict(
                    attn_norm=d(p + "attn_norm.weight"),
                    wq=wq,
                    wk=wk,
                    wv=wv,
                    wo=d(p + "attn_output.weight"),
                    ffn_norm=ffn_norm,
                )
            # Architecture extras: present in the file -> used (qwen2 biases, qwen3/gemma3 q/k
            # norms, gemma3 post norms).
            for key, name in [
                ("bq", "attn_q.bias"),
                ("bk", "attn_k.bias"),
                ("bv", "attn_v.bias"),
                ("q_norm", "attn_q_norm.weight"),
                ("k_norm", "attn_k_norm.weight"),
                ("post_attn_norm", "post_attention_norm.weight"),
                ("post_ffn_norm", "post_ffw_norm.weight"),
                ("bo", "attn_output.bias"),
                ("sinks", "attn_sinks.weight"),
                ("router_b", "ffn_gate_inp.bias"),
            ]:
                if p + name in t and not (c.arch in ("gpt-oss", *HYBRIDS) and key == "post_attn_norm"):
                    layer[key] = d(p + name).reshape(-1)
            for key, name in [("gate_exps_b", "ffn_gate_exps.bias"), ("up_exps_b", "ffn_up_exps.bias"), ("down_exps_b", "ffn_down_exps.bias")]:
                if p + name in t:
                    layer[key] = d(p + name)  # [E, width]
            if self.cfg.n_experts:
                E = self.cfg.n_experts
                layer["router"] = d(p + "ffn_gate_inp.weight")  # [E, hidden]
                # 3-D stacks: ggml ne = [cols, rows, E] -> [E, rows, cols]
                layer["gate_exps"] = d(p + "ffn_gate_exps.weight")
                layer["up_exps"] = d(p + "ffn_up_exps.weight")
                layer["down_exps"] = d(p + "ffn_down_exps.weight")
                assert layer["router"].shape == (E, self.cfg.hidden), layer["router"].shape
                assert layer["gate_exps"].shape[0] == E and layer["gate_exps"].shape[2] == self.cfg.hidden
                assert layer["down_exps"].shape[0] == E and layer["down_exps"].shape[1] == self.cfg.hidden
                if p + "ffn_up_shexp.weight" in t:
                    layer["gate_sh"] = d(p + "ffn_gate_shexp.weight")
                    layer["up_sh"] = d(p + "ffn_up_shexp.weight")
                    layer["down_sh"] = d(p + "ffn_down_shexp.weight")
                    if p + "ffn_gate_inp_shexp.weight" in t:
                        layer["gate_inp_sh"] = d(p + "ffn_gate_inp_shexp.weight").reshape(-1)
            elif p + "ffn_gate.weight" not in t:  # phi3: ffn_up = [gate; up]
                gu = d(p + "ffn_up.weight")
                layer.update(gate=gu[: c.ffn], up=gu[c.ffn :], down=d(p + "ffn_down.weight"))
            else:
                layer.update(gate=d(p + "ffn_gate.weight"), up=d(p + "ffn_up.weight"), down=d(p + "ffn_down.weight"))
            return layer

        self.layers = [load_layer(i, self.cfg.is_recurrent(i)) for i in range(self.cfg.n_layers)]
        c = self.cfg
        # qwen35's multi-token-prediction (nextn) block, right after the trunk: one gated attention
        # layer (never recurrent) with the trunk's kind of FFN, plus its input projection and norms
        # (llama.cpp's load_block_mtp); `mtp_forward` runs it, `forward` does not.
        self.nextn = None
        n = c.n_layers
        if c.n_nextn and f"blk.{n}.nextn.eh_proj.weight" in t:
            p = f"blk.{n}.nextn."
            self.nextn = load_layer(n, False)
            self.nextn.update(
                eh_proj=d(p + "eh_proj.weight"),  # [hidden, 2 hidden]: (embedding half, hidden half) columns
                enorm=d(p + "enorm.weight").reshape(-1),
                hnorm=d(p + "hnorm.weight").reshape(-1),
                head_norm=d(p + "shared_head_norm.weight").reshape(-1) if p + "shared_head_norm.weight" in t else self.output_norm,
                embed=d(p + "embed_tokens.weight") if p + "embed_tokens.weight" in t else self.embd,
                head=d(p + "shared_head_head.weight") if p + "shared_head_head.weight" in t else self.output,
            )
            N = self.nextn
            assert "wq" in N and "q_norm" in N, "nextn block without gated attention tensors"
            assert N["eh_proj"].shape == (c.hidden, 2 * c.hidden), N["eh_proj"].shape
            assert N["wq"].shape == (2 * c.n_heads * c.head_dim, c.hidden), N["wq"].shape
            assert N["embed"].shape == (c.vocab, c.hidden) and N["head"].shape == (c.vocab, c.hidden)
            assert N["enorm"].shape == N["hnorm"].shape == N["head_norm"].shape == (c.hidden,)
        assert self.embd.shape == (c.vocab, c.hidden), self.embd.shape
        attn0 = next(L for L in self.layers if "wq" in L)  # qwen35: layer 0 is recurrent
        assert attn0["wq"].shape == ((2 if c.attn_out_gate else 1) * c.n_heads * c.head_dim, c.hidden), attn0["wq"].shape
        assert attn0["wk"].shape == (c.n_kv_heads * c.head_dim, c.hidden)
        if not c.n_experts:
            assert self.layers[0]["down"].shape == (c.hidden, c.ffn)
        # Llama 3's factors, or LongRoPE's short ones (the context here is within the original one)
        factors = next((n for n in ("rope_freqs.weight", "rope_factors_short.weight") if n in t), None)
        self.rope_freqs = d(factors).reshape(-1).astype(np.float64) if factors else None
        if c.arch == "qwen2":
            assert "bq" in self.layers[0], "qwen2 without attn_q.bias"
        if c.arch in ("qwen3", *HYBRIDS, "gemma3"):
            assert "q_norm" in attn0, f"{c.arch} without attn_q_norm"
        if c.arch == "gemma3":
            assert "post_ffn_norm" in self.layers[0], "gemma3 without post_ffw_norm"


def load_weights(path: str, dtype: str = "float32") -> Weights:
    """Dequantized weights, cached per process (loading takes a few seconds)."""
    return _load_weights(os.path.realpath(path), np.dtype(dtype).name)


@functools.lru_cache(maxsize=4)
def _load_weights(path: str, dtype_name: str) -> Weights:
    return Weights(path, np.dtype(dtype_name).type)


# ----------------------------------------------------------------------------- math


def quantize_q8_blocks(x: np.ndarray, block: int = 32) -> np.ndarray:
    """Round-trip x (last axis a multiple of `block`) through ggml Q8_0/Q8_1 8-bit blocks."""
    shape = x.shape
    xb = x.reshape(-1, shape[-1] // block, block).astype(np.float32)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    d = amax / 127.0
    # ggml stores d as fp16 (Q8_0) or fp16 d and s (Q8_1).
    d16 = d.astype(np.float16).astype(np.float32)
    inv = np.where(d > 0, 1.0 / np.where(d > 0, d, 1.0), 0.0)
    q = np.clip(np.round(xb * inv), -127, 127)
    return (q * d16).reshape(shape).astype(x.dtype)


SUPER_SPAN = 256
SUPER_PEAK_ENERGY = 0.75  # specula's q8::SUPER_PEAK_ENERGY


def quantize_q8_super(x: np.ndarray) -> np.ndarray:
    """Round-trip x as specula's Q4_K / Q5_K kernels read it: a row gets one 8-bit scale per
    super-block of 256 where, in every super-block, max x^2 <= SUPER_PEAK_ENERGY * sum x^2, and
    one per block of 32 otherwise (a row with a massive activation)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).astype(np.float32)
    sq = x2.reshape(x2.shape[0], -1, SUPER_SPAN) ** 2
    fits = (sq.max(axis=-1) <= np.float32(SUPER_PEAK_ENERGY) * sq.sum(axis=-1)).all(axis=-1)
    out = quantize_q8_blocks(x2)
    if fits.any():
        out[fits] = quantize_q8_blocks(x2[fits], block=SUPER_SPAN)
    return out.reshape(shape).astype(x.dtype)


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    ms = np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True)
    return (x / np.sqrt(ms + eps)).astype(x.dtype) * w


def llama3_freq_factors(llama3: tuple, rope_dim: int, theta: float) -> np.ndarray:
    """Divisors of the RoPE frequencies for Llama 3.x scaling (HF _compute_llama3_parameters)."""
    factor, low, high, old = llama3
    freq = theta ** (-np.arange(rope_dim // 2, dtype=np.float64) * 2.0 / rope_dim)
    wavelen = 2 * np.pi / freq
    smooth = (old / wavelen - low) / (high - low)
    new = np.where(wavelen < old / high, freq, np.where(wavelen > old / low, freq / factor, (1 - smooth) * freq / factor + smooth * freq))
    return freq / new


def yarn_freq_factors(yarn: tuple, rope_dim: int, theta: float) -> np.ndarray:
    """Divisors of the RoPE frequencies for YaRN (see the module docstring)."""
    factor, orig = yarn
    freq = theta ** (-np.arange(rope_dim // 2, dtype=np.float64) * 2.0 / rope_dim)

    def corr_dim(beta):
        return rope_dim * np.log(orig / (beta * 2 * np.pi)) / (2 * np.log(theta))

    low, high = max(0.0, np.floor(corr_dim(32.0))), min(rope_dim - 1.0, np.ceil(corr_dim(1.0)))
    ramp = 1.0 - np.clip((np.arange(rope_dim // 2) - low) / max(high - low, 0.001), 0.0, 1.0)
    new = freq / factor * (1.0 - ramp) + freq * ramp
    return freq / new


def _inv_freq(theta: float, rope_dim: int, freq_factors) -> np.ndarray:
    inv = theta ** (-np.arange(rope_dim // 2, dtype=np.float64) * 2.0 / rope_dim)
    return inv if freq_factors is None else inv / freq_factors


def rope_normal(x: np.ndarray, pos: np.ndarray, theta: float, rope_dim: int, freq_factors=None) -> np.ndarray:
    """llama.cpp normal-mode RoPE on [T, heads, head_dim]: rotates pairs (2i, 2i+1)."""
    T = x.shape[0]
    inv_freq = _inv_freq(theta, rope_dim, freq_factors)
    ang = pos.astype(np.float64)[:, None] * inv_freq[None, :]  # [T, half]
    cos = np.cos(ang)[:, None, :].astype(x.dtype)
    sin = np.sin(ang)[:, None, :].astype(x.dtype)
    out = x.copy()
    x0 = x[..., 0:rope_dim:2]
    x1 = x[..., 1:rope_dim:2]
    out[..., 0:rope_dim:2] = x0 * cos - x1 * sin
    out[..., 1:rope_dim:2] = x0 * sin + x1 * cos
    assert out.shape[0] == T
    return out


def rope_neox(x: np.ndarray, pos: np.ndarray, theta: float, rope_dim: int, freq_factors=None) -> np.ndarray:
    """NeoX/HF rotate_half RoPE: pairs (i, i + rope_dim/2).  WRONG for GGUF llama weights, right
    for qwen2 / qwen3 / gemma3 (llama.cpp's LLAMA_ROPE_TYPE_NEOX)."""
    half = rope_dim // 2
    inv_freq = _inv_freq(theta, rope_dim, freq_factors)
    ang = pos.astype(np.float64)[:, None] * inv_freq[None, :]
    cos = np.cos(ang)[:, None, :].astype(x.dtype)
    sin = np.sin(ang)[:, None, :].astype(x.dtype)
    out = x.copy()
    x0 = x[..., :half]
    x1 = x[..., half:rope_dim]
    out[..., :half] = x0 * cos - x1 * sin
    out[..., half:rope_dim] = x0 * sin + x1 * cos
    return out


def imrope_rotated(rope_dim: int, sections: tuple) -> np.ndarray:
    """[rope_dim / 2] bools: which NeoX pairs of a text token rotate with its position under
    interleaved M-RoPE (ggml_mrope_cache_init, is_imrope); the others take the 4th position, 0."""
    s0, s1, s2, s3 = sections
    rotated = []
    for i in range(rope_dim // 2):
        m = i % (s0 + s1 + s2 + s3)
        rotated.append((m % 3 == 1 and m < 3 * s1) or (m % 3 == 2 and m < 3 * s2) or (m % 3 == 0 and m < 3 * s0))
    return np.array(rotated)


def rope_imrope(x: np.ndarray, pos: np.ndarray, theta: float, rope_dim: int, freq_factors=None, sections=None) -> np.ndarray:
    """qwen35's interleaved M-RoPE for text: NeoX pairs (i, i + rope_dim/2); pair i rotates by
    pos * theta^(-2i/rope_dim) when `imrope_rotated` says so, else by 0 (left as it is): NeoX
    RoPE with an infinite divisor for the pairs that do not rotate."""
    rotated = imrope_rotated(rope_dim, sections)
    divisors = np.where(rotated, 1.0, np.inf) if freq_factors is None else np.where(rotated, np.asarray(freq_factors, dtype=np.float64), np.inf)
    return rope_neox(x, pos, theta, rope_dim, divisors)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)  # log(1 + exp(x)), without overflow


def gated_delta_net(x: np.ndarray, L: dict, c: Config, lin) -> np.ndarray:
    """qwen35's (and qwen3next's) Gated DeltaNet mixer on [T, hidden] (one sequence, state from zero), float64
    inside, written token by token from the recurrence (see the module docstring)."""
    T = x.shape[0]
    d, Hk, Hv = c.ssm_state, c.ssm_groups, c.ssm_heads
    kw, vw = Hk * d, Hv * d
    r = Hv // Hk
    if "ssm_qkv" in L:
        qkv = lin(x, L["ssm_qkv"]).astype(np.float64)  # [T, 2 kw + vw]
        z = lin(x, L["ssm_z"]).astype(np.float64).reshape(T, Hv, d)
    else:  # qwen3next's legacy ssm_in: per key head g, [q_g, k_g, v of heads g r.., z of heads g r..]
        m = lin(x, L["ssm_in"]).astype(np.float64).reshape(T, Hk, 2 * d + 2 * r * d)
        qkv = np.concatenate([m[..., :d].reshape(T, kw), m[..., d : 2 * d].reshape(T, kw), m[..., 2 * d : 2 * d + r * d].reshape(T, vw)], axis=-1)
        z = m[..., 2 * d + r * d :].reshape(T, Hv, d)
    if "ssm_ba" in L:  # qwen3next: per key head g, [beta of value heads g r..g r + r - 1, their alpha]
        ba = lin(x, L["ssm_ba"]).astype(np.float64).reshape(T, Hk, 2 * r)
        b, a = ba[..., :r].reshape(T, Hv), ba[..., r:].reshape(T, Hv)
    else:
        b, a = lin(x, L["ssm_beta"]).astype(np.float64), lin(x, L["ssm_alpha"]).astype(np.float64)
    beta = sigmoid(b)  # [T, Hv]
    g = softplus(a + L["ssm_dt"]) * L["ssm_a"]  # [T, Hv]
    # causal depthwise conv: y_t[c] = sum_j x_{t-(K-1)+j}[c] w[c, j], zeros before position 0
    w = L["ssm_conv"].astype(np.float64)  # [C, K]
    K = w.shape[1]
    xp = np.concatenate([np.zeros((K - 1, qkv.shape[1])), qkv])
    y = silu(sum(xp[j : j + T] * w[:, j] for j in range(K)))
    q = y[:, :kw].reshape(T, Hk, d)
    k = y[:, kw : 2 * kw].reshape(T, Hk, d)
    v = y[:, 2 * kw :].reshape(T, Hv, d)
    eps = c.rms_eps
    q = q / np.sqrt((q**2).sum(-1, keepdims=True) + eps)
    k = k / np.sqrt((k**2).sum(-1, keepdims=True) + eps)
    # value head h reads key head h % Hk (qwen35: ggml_repeat_4d tiles the Hk heads) or, in
    # qwen3next, h // r (its repeat on [d, 1, Hk] -> [d, r, Hk] interleaves them)
    kh = np.arange(Hv) // r if c.ssm_interleave else np.arange(Hv) % Hk
    q, k = q[:, kh], k[:, kh]  # [T, Hv, d]
    S = np.zeros((Hv, d, d))  # S[h, i (key dim), j (value dim)]
    o = np.zeros((T, Hv, d))
    for t in range(T):
        S = S * np.exp(g[t])[:, None, None]
        delta = beta[t][:, None] * (v[t] - np.einsum("hij,hi->hj", S, k[t]))  # [Hv, d]
        S = S + k[t][:, :, None] * delta[:, None, :]
        o[t] = np.einsum("hij,hi->hj", S, q[t]) / np.sqrt(d)
    o = rmsnorm(o, L["ssm_norm"].astype(np.float64), eps) * silu(z)
    return lin(o.reshape(T, vw).astype(x.dtype), L["ssm_out"])


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (ggml_gelu, HF gelu_pytorch_tanh)."""
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def moe_ffn(x: np.ndarray, L: dict, c: Config, lin, margins=None) -> np.ndarray:
    """Mixture-of-experts FFN on [T, hidden], one token at a time, written from the definition.

    `margins` (optional [T] array) is lowered to each token's router margin: the gap between
    its k-th and (k+1)-th largest logit, i.e. how close the routing was to a different choice.
    """
    logits = lin(x, L["router"]).astype(np.float64)  # [T, E]
    if "router_b" in L:
        logits = logits + L["router_b"]
    oss = c.arch == "gpt-oss"
    out = np.zeros_like(x)
    for i in range(x.shape[0]):
        if margins is not None and c.n_experts_used < c.n_experts:
            srt = np.sort(logits[i])[::-1]
            margins[i] = min(margins[i], srt[c.n_experts_used - 1] - srt[c.n_experts_used])
        p = np.exp(logits[i] - logits[i].max())
        p /= p.sum()
        chosen = sorted(range(c.n_experts), key=lambda e: (-logits[i, e], e))[: c.n_experts_used]
        w = p[chosen] / p[chosen].sum() if c.expert_weights_norm else p[chosen]
        xi = x[i : i + 1]
        for e, we in zip(chosen, w):
            if oss:  # clamped SwiGLU with biases; w above is the softmax over the chosen logits
                gate = np.minimum(lin(xi, L["gate_exps"][e]) + L["gate_exps_b"][e], 7.0)
                up = np.clip(lin(xi, L["up_exps"][e]) + L["up_exps_b"][e], -7.0, 7.0)
                g = (gate / (1.0 + np.exp(-1.702 * gate)) * (up + 1.0)).astype(x.dtype)
                y = lin(g, L["down_exps"][e])[0] + L["down_exps_b"][e]
            else:
                g = silu(lin(xi, L["gate_exps"][e])) * lin(xi, L["up_exps"][e])
                y = lin(g, L["down_exps"][e])[0]
            out[i] += (we * y).astype(x.dtype)
    if "up_sh" in L:
        g = silu(lin(x, L["gate_sh"])) * lin(x, L["up_sh"])
        y = lin(g, L["down_sh"])
        if "gate_inp_sh" in L:
            y = y * (1.0 / (1.0 + np.exp(-(lin(x, L["gate_inp_sh"][None, :]))))).astype(x.dtype)
        out += y
    return out


def _reads_super(W: Weights, w: np.ndarray) -> bool:
    """Whether `w` (a matrix of W, or a view of one: an expert of a stacked MoE tensor) is stored
    as Q4_K / Q5_K."""
    while w is not None:
        if id(w) in W.super_scaled:
            return True
        w = w.base if isinstance(w.base, np.ndarray) else None
    return False


@dataclass
class Pass:
    """What every block of one forward pass shares: the weights, the matmul (with the activation
    rounding `act_quant` asks for), the RoPE and its options."""

    W: Weights
    act_quant: str | None = None
    rope: str | None = None
    moe_margins: np.ndarray | None = None

    def __post_init__(self):
        W, c = self.W, self.W.cfg
        if self.act_quant not in (None, "none", "q8", "q8k"):
            raise ValueError(f"unknown act_quant {self.act_quant!r}")
        self.c = c
        self.ft = W.dtype
        if self.rope is None:
            self.rope = "imrope" if c.rope_sections else "neox" if c.neox else "normal"
        self.rope_fn = {"normal": rope_normal, "neox": rope_neox, "imrope": functools.partial(rope_imrope, sections=c.rope_sections)}[self.rope]
        self.freq_factors = W.rope_freqs
        if self.freq_factors is None and c.llama3 is not None:
            self.freq_factors = llama3_freq_factors(c.llama3, c.rope_dim, c.rope_theta)
        self.rope_mscale = c.rope_mscale
        if self.freq_factors is None and c.yarn is not None:
            self.freq_factors = yarn_freq_factors(c.yarn, c.rope_dim, c.rope_theta)
            self.rope_mscale *= 1.0 + 0.1 * np.log(c.yarn[0])

    def aq(self, a, w):
        if self.act_quant == "q8k" and _reads_super(self.W, w):
            return quantize_q8_super(a)
        return quantize_q8_blocks(a) if self.act_quant in ("q8", "q8k") else a

    def lin(self, x, w):
        return self.aq(x, w) @ w.T

    def check_tokens(self, tokens) -> np.ndarray:
        tokens = np.asarray(list(tokens), dtype=np.int64)
        if tokens.ndim != 1 or len(tokens) == 0:
            raise ValueError("tokens must be a non-empty 1-D list of ids")
        if tokens.min() < 0 or tokens.max() >= self.c.vocab:
            raise ValueError(f"token id out of range [0, {self.c.vocab})")
        return tokens


def attention(P: Pass, x: np.ndarray, L: dict, li: int, pos: np.ndarray) -> np.ndarray:
    """Layer li's attention mixer (after its input norm) on the rows x [T, hidden] of one causal
    sequence at RoPE positions pos [T] (increasing: row i attends to rows 0..=i); the output
    projection's result (with its bias and gemma3's post norm), before the residual add."""
    c, ft, lin = P.c, P.ft, P.lin
    T = x.shape[0]
    local = c.is_local(li)
    group = c.n_heads // c.n_kv_heads
    scale = c.attn_scale if c.attn_scale is not None else 1.0 / np.sqrt(c.head_dim)
    mask = np.triu(np.full((T, T), -np.inf, dtype=ft), k=1)
    if local:  # key j is hidden from query i when i - j >= window
        dist = pos[:, None] - pos[None, :]
        mask = np.where(dist >= c.sliding_window, -np.inf, 0.0).astype(ft) + mask
    q = lin(x, L["wq"])
    k = lin(x, L["wk"])
    v = lin(x, L["wv"])
    if "bq" in L:
        q, k, v = q + L["bq"], k + L["bk"], v + L["bv"]
    gate = None
    if c.attn_out_gate:  # qwen35: per head, head_dim query rows then head_dim gate rows
        qg = q.reshape(T, c.n_heads, 2, c.head_dim)
        q, gate = qg[:, :, 0], qg[:, :, 1].reshape(T, c.n_heads * c.head_dim)
    q = q.reshape(T, c.n_heads, c.head_dim)
    k = k.reshape(T, c.n_kv_heads, c.head_dim)
    v = v.reshape(T, c.n_kv_heads, c.head_dim)
    if "q_norm" in L:
        q = rmsnorm(q, L["q_norm"], c.rms_eps)
        k = rmsnorm(k, L["k_norm"], c.rms_eps)
    rope_fn = P.rope_fn
    if not c.uses_rope(li):
        pass  # smollm3's NoPE layers
    elif local and c.local_rope_own:  # own base, no frequency scaling (llama.cpp: rope_freq_scale_train_swa = 1)
        q = rope_fn(q, pos, c.rope_theta_local, c.rope_dim)
        k = rope_fn(k, pos, c.rope_theta_local, c.rope_dim)
    else:
        q = rope_fn(q, pos, c.rope_theta, c.rope_dim, P.freq_factors)
        k = rope_fn(k, pos, c.rope_theta, c.rope_dim, P.freq_factors)
        if P.rope_mscale != 1.0:  # ggml's mscale: cos and sin scaled, so the rotated dims
            q[..., : c.rope_dim] *= ft(P.rope_mscale)
            k[..., : c.rope_dim] *= ft(P.rope_mscale)
    # GQA: query head j uses kv head j // group.
    kh = np.repeat(k.transpose(1, 0, 2), group, axis=0)  # [H, T, d]
    vh = np.repeat(v.transpose(1, 0, 2), group, axis=0)
    qh = q.transpose(1, 0, 2)  # [H, T, d]
    s = (qh @ kh.transpose(0, 2, 1)) * ft(scale) + mask  # [H, T, T]
    if "sinks" in L:  # one more logit per head in every row's softmax, whose share is dropped
        s = np.concatenate([s, np.broadcast_to(L["sinks"][:, None, None], (c.n_heads, T, 1)).astype(ft)], axis=-1)
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    if "sinks" in L:
        p = p[..., :T]
    a = (p @ vh).transpose(1, 0, 2).reshape(T, c.n_heads * c.head_dim)
    if gate is not None:
        a = a * sigmoid(gate)
    o = lin(a, L["wo"])
    if "bo" in L:
        o = o + L["bo"]
    if "post_attn_norm" in L:
        o = rmsnorm(o, L["post_attn_norm"], c.rms_eps)
    return o


def ffn_block(P: Pass, h: np.ndarray, L: dict, moe_margins=None) -> np.ndarray:
    """h + the layer's FFN block (dense or MoE), as in llama.cpp's graphs."""
    c, lin = P.c, P.lin
    x = rmsnorm(h, L["ffn_norm"], c.rms_eps)
    if c.n_experts:
        f = moe_ffn(x, L, c, lin, moe_margins)
    else:
        g = (gelu_tanh if c.gelu else silu)(lin(x, L["gate"])) * lin(x, L["up"])
        f = lin(g, L["down"])
    if "post_ffn_norm" in L:
        f = rmsnorm(f, L["post_ffn_norm"], c.rms_eps)
    return h + f


def trunk(P: Pass, tokens: np.ndarray) -> np.ndarray:
    """The final hidden state [T, hidden] (before the output norm) of every position."""
    c = P.c
    pos = np.arange(len(tokens))
    h = P.W.embd[tokens].astype(P.ft) * P.ft(c.embed_scale)  # [T, hidden]
    for li, L in enumerate(P.W.layers):
        x = rmsnorm(h, L["attn_norm"], c.rms_eps)
        if c.is_recurrent(li):  # qwen35: a Gated DeltaNet layer in place of attention
            h = ffn_block(P, h + gated_delta_net(x, L, c, P.lin), L, P.moe_margins)
        else:
            h = ffn_block(P, h + attention(P, x, L, li, pos), L, P.moe_margins)
    return h


def forward(
    model_path: str,
    tokens,
    dtype: str = "float32",
    act_quant: str | None = None,
    last_only: bool = False,
    rope: str | None = None,
    moe_margins: np.ndarray | None = None,
) -> np.ndarray:
    """Logits [len(tokens), vocab] (or [1, vocab] with last_only) for one causal sequence.

    moe_margins: optional float64 [len(tokens)] array, lowered to each token's smallest router
    margin over the layers (see `moe_ffn`).

    rope: None picks the architecture's pairing (normal for llama/mistral, NeoX for qwen2, qwen3,
    gemma3, qwen3next, interleaved M-RoPE for qwen35); rope="neox" on a llama file exists so the sanity test
    can show it is wrong there.
    """
    W = load_weights(model_path, dtype)
    P = Pass(W, act_quant, rope, moe_margins)
    h = trunk(P, P.check_tokens(tokens))
    if last_only:
        h = h[-1:]
    x = rmsnorm(h, W.output_norm, W.cfg.rms_eps)
    return P.lin(x, W.output)


def mtp_forward(
    model_path: str,
    tokens,
    dtype: str = "float32",
    act_quant: str | None = None,
    moe_margins: np.ndarray | None = None,
) -> np.ndarray:
    """Teacher-forced logits [len(tokens) - 1, vocab] of the file's multi-token-prediction (nextn)
    layer (qwen35 / qwen35moe / qwen3next; llama.cpp's graph_mtp): row i, from the trunk's state after
    tokens[0..=i] and the embedding of tokens[i + 1], scores the token after that (tokens[i + 2]).

        hn  = rmsnorm(trunk hidden) * output_norm                    (llama.cpp's h_nextn)
        x_i = [rmsnorm(embed[t_{i+1}]) * enorm, rmsnorm(hn_i) * hnorm] Weh^T   (embedding half first)
        x  += gated attention(rmsnorm(x) * attn_norm)   rows 0..T-2 one causal sequence, row i at
                                                        RoPE position i + 1 (the position of t_{i+1})
        x  += FFN(rmsnorm(x) * post_attention_norm)     (the trunk's kind: dense or MoE)
        logits = (rmsnorm(x) * shared_head_norm) Whead^T   (output_norm, output if the block has none)

    moe_margins: optional float64 [len(tokens) - 1] array, lowered to row i's smallest router
    margin in the trunk at position i and in the block's row i (`moe_ffn`); row i also depends on
    the rows before it, so its margin is the prefix minimum (np.minimum.accumulate) of this.
    act_quant: as `forward` (every matmul input, eh_proj's included, rounded)."""
    W = load_weights(model_path, dtype)
    c = W.cfg
    N = W.nextn
    if N is None:
        raise ValueError(f"{model_path}: no multi-token-prediction layer (nextn_predict_layers = {c.n_nextn}, or no blk.{c.n_layers}.nextn.* tensors)")
    trunk_margins = None if moe_margins is None else np.full(len(tokens), np.inf)
    P = Pass(W, act_quant, None, trunk_margins)
    tokens = P.check_tokens(tokens)
    T = len(tokens)
    h = trunk(P, tokens)
    if T == 1:
        return np.zeros((0, c.vocab), dtype=P.ft)
    hn = rmsnorm(h[:-1], W.output_norm, c.rms_eps)  # h_nextn of rows 0..T-2
    e = N["embed"][tokens[1:]].astype(P.ft)
    x = np.concatenate([rmsnorm(e, N["enorm"], c.rms_eps), rmsnorm(hn, N["hnorm"], c.rms_eps)], axis=-1)
    x = P.lin(x, N["eh_proj"])  # [T - 1, hidden]
    block_margins = None if moe_margins is None else np.full(T - 1, np.inf)
    x = x + attention(P, rmsnorm(x, N["attn_norm"], c.rms_eps), N, c.n_layers, np.arange(1, T))
    x = ffn_block(P, x, N, block_margins)
    if moe_margins is not None:
        np.minimum(moe_margins, np.minimum(trunk_margins[:-1], block_margins), out=moe_margins)
    return P.lin(rmsnorm(x, N["head_norm"], c.rms_eps), N["head"])


# ----------------------------------------------------------------------------- CLI


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.environ.get("SPECULA_MODEL"), help="GGUF file (default $SPECULA_MODEL)")
    ap.add_argument("--tokens", required=True, help="comma-separated token ids, e.g. 1,2,3")
    ap.add_argument("--out", required=True, help="output .npy: float32 [n_tokens, vocab]")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="compute precision")
    ap.add_argument("--act-quant", default="none", choices=["none", "q8", "q8k"], help="simulate 8-bit activation blocks (q8k: as specula's kernels)")
    ap.add_argument("--last-only", action="store_true", help="only the last position's logits")
    ap.add_argument("--nextn", action="store_true", help="the multi-token-prediction layer's logits instead: [n_tokens - 1, vocab]")
    a = ap.parse_args(argv)
    if not a.model:
        ap.error("--model (or $SPECULA_MODEL) is required")
    toks = [int(t) for t in a.tokens.replace(" ", "").split(",") if t]
    if a.nextn:
        logits = mtp_forward(a.model, toks, dtype=a.dtype, act_quant=a.act_quant)
        if a.last_only:
            logits = logits[-1:]
    else:
        logits = forward(a.model, toks, dtype=a.dtype, act_quant=a.act_quant, last_only=a.last_only)
    np.save(a.out, logits.astype(np.float32))
    top = int(np.argmax(logits[-1])) if len(logits) else None
    print(f"wrote {a.out}: shape {logits.shape}, last-position argmax {top}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
