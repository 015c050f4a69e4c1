"""End to end through the new integer kernels: the llama model of SPECULA_MODEL (e.g. SmolLM2-135M
Q4_1) re-encoded with its matrices in Q5_0 / Q5_1 (width 576: not a multiple of 256) and Q4_K /
Q6_K / Q5_K (ffn_down, width 1536), then `specula debug logits` against the NumPy reference
(python/reference_forward.py, which dequantizes with gguf-py), with test_logits_oracle's limits.

gguf-py cannot quantize k-quants, so they are encoded here by plain round-to-nearest (not
llama.cpp's search: the weights are worse, which does not matter, the reference reads the same
bytes); `test_hand_encoders_round_trip_through_gguf_py` checks those encoders against gguf-py's
dequantization.

Measured (re-encoded SmolLM2-135M, the six prompts): the engine's max|d| 1.27-2.57, mean|d|
0.18-0.31, KL mean <= 0.0125, KL max <= 0.109, top-1 agreement 0.911-1.0 with every differing top-1
within 0.62 of the reference's best (ffn_down's Q4_K / Q5_K inputs on super-block scales where
a row allows it; with blocks of 32 everywhere: max|d| 1.10-2.51, mean|d| 0.16-0.29, KL max
<= 0.183). The reference with 8-bit activations simulated, against the
exact reference, on the same model: top-1 agreement 0.900 (non_latin), 0.953 (chat), mean|d| up to
0.256, max|d| up to 2.34 -- this model sits nearer ties than the Q4_1 one, so the top-1 agreement
floor here is 0.85 instead of 0.90.

The worst single position is fragile too. The simulated reference with a two-ulp jitter on every
activation before its 8-bit rounding (four seeds; what changing an exp or a summation order in
the engine amounts to) reaches KL max 0.115-0.171 on chat and 0.017-0.174 on english, and two
engine builds that differ only that way measured 0.092 and 0.183 at one position of chat. So the
KL max limit here is 0.25 instead of 0.15 (the rope-theta bug of test_logits_oracle gives
0.29-1.6 and fails its mean|d| and KL-mean limits, which stay); every other limit is
test_logits_oracle's but one.

The mean|d| of chat moves the same way. Scored with keys stored by dimension (one fused
multiply-add chain per score instead of eight lanes summed: a summation order), the engine
measured chat's mean|d| 0.341 / 0.358 / 0.312 with f32 / f16 / bf16 KV where the build before
measured 0.318 / 0.296 / 0.237 (q8_0, whose path did not change: 0.287 in both; the other five
prompts 0.176-0.296 in both builds), and the two builds' logits differ by a mean of 0.16 with f32
KV, as much as one build's f32 and f16 KV do (0.17): this re-encoded model's 8-bit activations
turn any rounding change into that much logit noise. So its mean|d| limit is 0.40, above that
envelope (0.24-0.36) and below the rope-theta bug's 0.47.
"""

import numpy as np
import pytest
import gguf
from gguf import GGUFReader, GGUFWriter, GGMLQuantizationType as T, quants

import test_logits_oracle as lo
import tokenizer_oracle as to
from prompts import PROMPTS

def f16b(x):
    return np.asarray(x, dtype=np.float16).view(np.uint8).reshape(*np.shape(x), 2)


def kq_scales(x, levels):
    # x: (n, 8, 32) -> d, dmin, sc (n,8), mn (n,8), q (n,8,32)
    mn_v = np.minimum(x.min(-1), 0)
    mx_v = x.max(-1)
    scale = (mx_v - mn_v) / levels
    mins = -mn_v
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (mins.max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d == 0, 1, d)[:, None]), 0, 63).astype(np.int32)
    mn = np.clip(np.round(mins / np.where(dmin == 0, 1, dmin)[:, None]), 0, 63).astype(np.int32)
    ds = d[:, None] * sc
    q = np.clip(np.round((x + (dmin[:, None] * mn)[..., None]) / np.where(ds == 0, 1, ds)[..., None]), 0, levels).astype(np.uint8)
    return d, dmin, sc, mn, q


def pack_scales(sc, mn):
    n = sc.shape[0]
    s = np.zeros((n, 12), dtype=np.uint8)
    for j in range(4):
        s[:, j] = sc[:, j] & 63
        s[:, j + 4] = mn[:, j] & 63
    for j in range(4, 8):
        s[:, j + 4] = (sc[:, j] & 0xF) | ((mn[:, j] & 0xF) << 4)
        s[:, j - 4] |= ((sc[:, j] >> 4) << 6).astype(np.uint8)
        s[:, j] |= ((mn[:, j] >> 4) << 6).astype(np.uint8)
    return s


def q4_k(x):
    x = x.reshape(-1, 8, 32)
    d, dmin, sc, mn, q = kq_scales(x, 15)
    q = q.reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([f16b(d), f16b(dmin), pack_scales(sc, mn), qs], axis=1)


def q5_k(x):
    x = x.reshape(-1, 8, 32)
    d, dmin, sc, mn, q = kq_scales(x, 31)
    q = q.reshape(-1, 4, 2, 32)
    qs = ((q[:, :, 0] & 0xF) | ((q[:, :, 1] & 0xF) << 4)).reshape(-1, 128)
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for c in range(4):
        qh |= ((q[:, c, 0] >> 4) << (2 * c)).astype(np.uint8)
        qh |= ((q[:, c, 1] >> 4) << (2 * c + 1)).astype(np.uint8)
    return np.concatenate([f16b(d), f16b(dmin), pack_scales(sc, mn), qh, qs], axis=1)


def q6_k(x):
    x = x.reshape(-1, 16, 16)
    amax = np.abs(x).max(-1)
    s = amax / 31
    d = (s.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(s / np.where(d == 0, 1, d)[:, None]), -128, 127).astype(np.int32)
    ds = d[:, None] * sc
    q = (np.clip(np.round(x / np.where(ds == 0, 1, ds)[..., None]), -32, 31) + 32).astype(np.uint8).reshape(-1, 256)
    n = q.shape[0]
    ql = np.zeros((n, 128), dtype=np.uint8)
    qh = np.zeros((n, 64), dtype=np.uint8)
    for h in range(2):
        q1, q2, q3, q4 = (q[:, 128 * h + 32 * i:128 * h + 32 * i + 32] for i in range(4))
        ql[:, 64 * h:64 * h + 32] = (q1 & 0xF) | ((q3 & 0xF) << 4)
        ql[:, 64 * h + 32:64 * h + 64] = (q2 & 0xF) | ((q4 & 0xF) << 4)
        qh[:, 32 * h:32 * h + 32] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), f16b(d)], axis=1)


HAND = {T.Q4_K: (q4_k, 144), T.Q5_K: (q5_k, 176), T.Q6_K: (q6_k, 210)}


def encode(w, t):
    rows, cols = w.shape
    if t in HAND:
        f, nb = HAND[t]
        return f(w.astype(np.float32)).reshape(rows, cols // 256 * nb)
    return quants.quantize(w.astype(np.float32), t)


def choose(name, cols, layer):
    if not name.startswith("blk.") or not name.endswith(".weight"):
        return None
    if cols % 256 == 0:
        return [T.Q4_K, T.Q6_K, T.Q5_K][layer % 3]
    return [T.Q5_0, T.Q5_1][layer % 2]



def requantize(src: str, dst: str) -> dict:
    r = GGUFReader(src)
    arch = r.fields[gguf.Keys.General.ARCHITECTURE].contents()
    w = GGUFWriter(dst, arch)
    for field in r.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        vt = field.types[0]
        st = field.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), vt, sub_type=st)
    counts = {}
    for t in r.tensors:
        data, tt = np.asarray(t.data), t.tensor_type
        if len(t.shape) == 2:
            layer = int(t.name.split(".")[1]) if t.name.startswith("blk.") else 0
            nt = choose(t.name, int(t.shape[0]), layer)
            if nt is not None:
                data, tt = encode(quants.dequantize(data, t.tensor_type), nt), nt
        counts[tt.name] = counts.get(tt.name, 0) + 1
        w.add_tensor(t.name, data, raw_dtype=tt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return counts


@pytest.mark.parametrize("gtype", [T.Q4_K, T.Q5_K, T.Q6_K])
def test_hand_encoders_round_trip_through_gguf_py(gtype):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 512)).astype(np.float32)
    x[1] = np.abs(x[1])  # all positive: min 0
    x[2] *= 1e-3
    back = quants.dequantize(encode(x, gtype), gtype)
    amax = np.abs(x).max(-1, keepdims=True)
    # a step is at most 2 amax / 15 (Q4_K), / 31 (Q5_K), amax / 31 (Q6_K), plus the 6-bit scales'
    # and f16 scale's rounding: half a step and a margin
    step = {T.Q4_K: 2 / 15, T.Q5_K: 2 / 31, T.Q6_K: 1 / 31}[gtype]
    assert (np.abs(back - x) <= amax * step * 0.5 * 1.6).all()


@pytest.fixture(scope="module")
def kq_model(model_path, tmp_path_factory):
    if GGUFReader(model_path).fields[gguf.Keys.General.ARCHITECTURE].contents() != "llama":
        pytest.skip("needs a llama-family SPECULA_MODEL")
    dst = str(tmp_path_factory.mktemp("kq") / "model_kq.gguf")
    counts = requantize(model_path, dst)
    assert all(counts.get(t, 0) > 0 for t in ["Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]), counts
    return dst


def test_requantized_model_logits_match_reference(kq_model, specula_bin, tmp_path):
    names = list(PROMPTS)
    ids = [to.encode(kq_model, PROMPTS[k]) for k in names]
    got_all = lo.engine_logits(specula_bin, kq_model, ids, tmp_path)
    for name, p, got in zip(names, ids, got_all):
        ref = lo.reference_logits(kq_model, tuple(p))
        # the Q4_1 model's limits, with the top-1 floor this re-encoding measured (0.889 on one prompt;
        # the reference with simulated 8-bit activations agrees only 0.900 here) and the KL max and
        # mean|d| of its rounding envelope (see the module docstring)
        lo.compare(name, got, ref, {**lo.LIMITS, "top1_min": 0.85, "kl_max": 0.25, "mean_abs": 0.40})
