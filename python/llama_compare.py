#!/usr/bin/env python3
r"""specula's logits against llama.cpp's, on the same GGUF files and the same token ids.

    bash scripts/llama_compare.sh                      # the 113 tiny cases (1-4 min on 2 cores)
    bash scripts/llama_compare.sh --real               # and the cached real models (+1 min)
    bash scripts/llama_compare.sh --real --real-ref    # with the NumPy reference on them too (+3 min)
    bash scripts/llama_compare.sh --model F.gguf ...   # any GGUF (repeatable)
    bash scripts/llama_compare.sh --arch-filter qwen3  # only cases whose name contains "qwen3"

(the wrapper builds llama.cpp with scripts/build_llama_cpp.sh, then runs this file with
PYTHONPATH = the llama-cpp-python sdist and LLAMA_CPP_LIB_PATH = its build/bin).

Both engines compute the logits at every position of a few token-id prompts: no tokenization on
either side; llama.cpp gets the ids in one `llama_batch` (one sequence, every position marked for
output), specula through `specula debug logits`.  Per case the Markdown table gives: positions
compared; top-1 agreement; KL(llama.cpp || specula) per position (softmax of each side in
float64), mean, its bound, and max; max|logit difference|; and, where the NumPy reference
(python/reference_forward.py, exact float32 activations) runs the file, KL(ref || specula) next
to KL(ref || llama.cpp) ("is specula no worse than llama.cpp against the float reference"), and
KL(ref || ref+q8), the reference again with each engine's activation rounding simulated.  Exit
status 1 when a case fails or errors, 0 when all pass.

Cases
-----
* writer files (hidden 64, 259-token vocabulary: the bytes, <|endoftext|>, <|im_start|>,
  <|im_end|>): `specula debug write-tiny` for llama, smollm3 (4 layers, so that layer 3 is a
  NoPE layer), qwen2, qwen3, gemma3 (sliding window 4 every other layer), phi3 (fused QKV and
  gate/up, LongRoPE factors) and `write-tiny-moe` for llama (Mixtral-style), qwen2moe (with its
  shared expert) and qwen3moe, each in f32, q8_0 and q4_0 (and f16 for llama); plus Llama-3 RoPE
  scaling, phi3 partial RoPE (8 of 16 dims), a qwen3 head wider than hidden/heads and a qwen3moe
  top-3-of-8, in q8_0.
* llama.cpp-quantized files: Q4_K, Q5_K, Q6_K, Q2_K, Q3_K, IQ4_NL, IQ4_XS, Q5_0, Q5_1 for each
  of the 9 architectures, made by llama.cpp's own quantizer (`llama_model_quantize`, the library
  function behind `llama-quantize`, through the bindings: no tool to build) with `pure` (every
  quantizable tensor gets the type; llama.cpp keeps the MoE router in F32) from the F32 file.
  The writers have no hidden-size flag, and hidden 64 is below the 256-value super-block of the
  K and IQ4_XS types: llama.cpp would silently fall back (Q4_K -> Q5_0, Q6_K -> Q8_0,
  Q2_K/Q3_K -> Q4_0, IQ4_XS -> IQ4_NL).  So the F32 file is first *widened* x4 here (hidden
  256, FFN 512 / expert FFN 256, head width x4; same layer, head and expert counts and
  vocabulary; every weight drawn from the original tensor's own values, matrices scaled by 1/2
  so activations keep their size, gemma3's embedding by 1/4), and the quantized file is checked
  to hold exactly the requested type (no fallback).
* `--real`: the cached SmolLM2-135M-Instruct Q4_1, Qwen2.5-Coder-0.5B-Instruct Q4_K_M and
  Gemma-3-270M Q4_K_M on the texts of python/tests/prompts.py (English, code, ChatML, non-Latin),
  turned into ids by llama.cpp's tokenizer (its BOS where the model asks for one); `--model F`
  any other file (treated like the real ones).
* Every tiny file is rewritten once (same tensor bytes) into the form llama.cpp loads, and that
  one file is what llama.cpp, specula and the reference read.  What llama.cpp refuses in the
  writers' files as written: `tokenizer.ggml.merges` is an empty array typed UINT32 ("invalid
  gguf type for tokenizer.ggml.merges": an array of strings is required, even empty); Llama-3
  scaling as `rope.scaling.type = "llama3"` metadata (GGML_ASSERT on the unknown type, which
  aborts the process: real Llama-3 GGUFs carry the `rope_freqs.weight` tensor instead, so the
  rewrite computes it); qwen2moe / qwen3moe without `expert_feed_forward_length` (llama.cpp then
  assumes feed_forward_length / n_expert_used and rejects the tensor shapes;
  `expert_shared_feed_forward_length` likewise); qwen2moe without `output.weight` or without a
  shared expert (llama.cpp's qwen2moe requires both; the rewrite adds output.weight = the
  embedding, identical logits, and the case is written with --shared-ffn 64).  llama.cpp runs
  in a child process per call, so that an abort is reported as that case's error.

llama.cpp settings (what changes numerics and can be controlled)
----------------------------------------------------------------
n_threads 2; n_ctx = n_batch = n_ubatch >= the prompt (the whole prompt in one ubatch, as
`specula debug logits` with --chunk 0); one sequence; a fresh context per prompt; KV cache F32
(llama.cpp's default F16 would round every key and value; specula keeps f32); flash attention
off (ggml's CPU flash-attention kernel converts Q to the K-cache type and accumulates
differently; off, attention is an F32 matmul and softmax, as in specula and the reference); no
weight repacking (`use_extra_bufts` off: the CPU "extra" buffers re-lay Q4_0 / IQ4_NL / Q4_K /
Q2_K ... into interleaved blocks with another summation order; `--repack` turns it back on).
What llama.cpp does to activations and cannot be switched off: ggml_mul_mat converts the input
of every weight matmul to the weight type's vec_dot_type before the dot products: Q8_0 (8-bit
blocks of 32, one f16 scale) for Q4_0 / Q5_0 / Q8_0 / IQ4_NL, Q8_1 (f16 scale and sum) for
Q4_1 / Q5_1, Q8_K (8-bit, one f32 scale per 256) for Q2_K..Q6_K and IQ4_XS, F16 for F16
weights (F32 stays F32); GELU (gemma3) is read from a table indexed by the f16-rounded input
(GGML_GELU_FP16), which is why even gemma3 F32 differs by ~2e-8 nats.  specula rounds matmul
inputs to 8-bit blocks of 32, except Q4_K / Q5_K (one scale per 256 unless a value dominates its
super-block: `reference_forward.quantize_q8_super`), and keeps f32 for F32 / F16 weights.

Pass bounds, and why
--------------------
Each engine rounds activations its own way, so the two cannot agree to float precision; how far
apart rounding alone puts them is measured without either engine: the reference run exactly and
with each engine's rounding simulated (`simulated_forward`: `act_quant="q8"` for llama.cpp's
32-blocks, `"q8k"` for specula, 256-blocks everywhere for Q8_K, f16 for F16), per case:
env = KL(ref || ref+simulated) mean.  On the default tiny cases (164 positions each):

    files                                    env (specula's rounding)   env (llama.cpp's)
    F32 / F16                                0 / 0                      0 / 9.0e-7
    dense q8_0 q4_0 Q5_0 Q5_1 IQ4_NL  (33)   6.2e-5 .. 1.4e-3           the same scheme
    dense Q4_K Q5_K                   (12)   1.3e-4 .. 2.4e-3           the same scheme
    dense Q2_K Q3_K Q6_K IQ4_XS       (24)   6.0e-5 .. 1.5e-3           1.2e-4 .. 2.6e-3 (Q8_K: ~2x)
    MoE, all quantized types          (34)   4.9e-4 .. 1.7e-2           (routing flips included)

KL(llama.cpp || specula) mean <= K_ENV x (max(env_llama, KL(ref || llama.cpp)) + env_specula) + KL_FLOOR
    If the two roundings were independent the logit errors would add in quadrature (KL is
    quadratic in them): KL(l||s) ~ env_l + env_s; opposite in sign, up to 2x that.  llama.cpp's
    measured distance to the reference stands in for its simulated one when larger (the
    simulation rounds the MoE router, which llama.cpp keeps F32, and knows nothing of Q8_1
    details).  K_ENV = 3.  Measured: KL(l||s) / bound <= 0.32 dense, <= 0.52 MoE, <= 0.29 on
    the three real models with --real-ref; F32 files agree to ~1e-12 (KL_FLOOR = 1e-6).
KL(ref || specula) <= NO_WORSE_MAX x max(KL(ref || llama.cpp), env_specula) + KL_FLOOR
    "no worse than llama.cpp", allowing for the rounding specula is designed with.
    NO_WORSE_MAX = 3; measured ratio <= 1.05 dense (specula is ~2x closer to the reference than
    llama.cpp on Q2_K / Q3_K / Q6_K / IQ4_XS, where it keeps 32-blocks), <= 1.83 MoE.
Top-1: tiny random models have flat logits (std ~1-1.6 over 259 tokens) and near-ties are
    common, so as in test_logits_oracle.py a differing top-1 is accepted where llama.cpp's own
    logits put the two tokens within a tie margin, here TIE_SIGMAS = 6 sigma with sigma =
    hypot(std(sim_llama - ref), std(sim_specula - ref)) over all logits (0.02 .. 0.09 on the
    dense tiny files).  Measured gaps at differing top-1s: <= 4.05 sigma (engines), <= 3.5 sigma
    (either simulation against the exact reference).  Exact agreement >= TOP1_MIN_AGREE = 85%
    (measured >= 89.0%; simulations vs exact >= 89.6%).  MoE: one routing decision taken the
    other way near a router tie moves every later position of the prompt (gaps up to 26 sigma in
    the engines, 16 sigma in the simulations), so no tie rule, and agreement >= 80% (measured
    >= 87.8%, simulations likewise).

What the bounds catch, measured by injecting bugs into the reference and comparing it with
llama.cpp's logits as if it were specula (bound = the case's own bound; quantized tiny cases):

    NeoX / normal RoPE pairing swapped        KL >= 6.9x the bound (median 40-210x)
    rope theta x10 (a metadata bug)           KL >= 1.8x (median 14-60x)
    MoE weights renormalised or not (toggled) KL >= 0.6x, KL(ref||.) >= 1.0x the no-worse bound: all caught
    rms eps x100                              caught in about half of the cases
    one matrix (blk.0 attn_output) x1.02      never: below the activation rounding noise
F32 and F16 files have no rounding to hide behind (bound ~1e-6): every one of the bugs above is
caught there by 5x to 1e6x (but the x1.02 on gemma3, whose post-attention norm undoes it).  So
the quantized cases guard the formats' kernels and layouts against gross errors, and the F32 /
F16 cases guard the architecture against fine ones.

Without the reference (`--no-ref`; real models unless --real-ref): fixed bounds.  Tiny: KL mean
<= TINY_KL_MEAN = 0.05 (4x the largest measured, 1.3e-2) and tie 0.5.  Real: KL mean <=
REAL_KL_MEAN = 0.025 = K_ENV x 2 x SmolLM2 Q4_1's measured envelope (4.2e-3; measured KL(l||s):
1.4e-3 qwen2.5-coder, 4.9e-3 SmolLM2, 8.5e-3 gemma-3), tie 1.0 (test_logits_oracle.py's
TOP1_TIE; measured gaps <= 0.36), agreement >= 85% (measured 97.5-99.0%).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

# Single-threaded BLAS for the reference (see python/tests/conftest.py); before numpy is imported.
for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import numpy as np  # noqa: E402
import gguf  # noqa: E402
from gguf import GGMLQuantizationType as QT, GGUFReader, GGUFValueType  # noqa: E402

PY_DIR = Path(__file__).resolve().parent
REPO = PY_DIR.parent
sys.path.insert(0, str(PY_DIR))
import reference_forward as rf  # noqa: E402

# Bounds, justified in the module docstring.  With the reference (every tiny case by default):
K_ENV = 3.0  # KL(llama.cpp||specula) <= K_ENV x (max(env_llama, KL(ref||llama.cpp)) + env_specula) + KL_FLOOR
KL_FLOOR = 1e-6  # nats: float32 summation-order noise (F32 files have no rounding to simulate)
TIE_SIGMAS = 6.0  # dense: a differing top-1 within TIE_SIGMAS x sigma of llama.cpp's best
TIE_FLOOR = 1e-3
NO_WORSE_MAX = 3.0  # KL(ref||specula) <= NO_WORSE_MAX x max(KL(ref||llama.cpp), env_specula) + KL_FLOOR
TOP1_MIN_AGREE = 0.85  # dense
MOE_TOP1_MIN_AGREE = 0.80  # MoE (routing flips; no tie rule)
# Without the reference: tiny files (--no-ref) and real models (no --real-ref)
TINY_KL_MEAN, TINY_TOP1_TIE = 0.05, 0.5
REAL_KL_MEAN, REAL_TOP1_TIE = 0.025, 1.0

DENSE_ARCHS = ["llama", "smollm3", "qwen2", "qwen3", "gemma3", "phi3"]
MOE_ARCHS = ["llama", "qwen2moe", "qwen3moe"]
# llama.cpp ftype (include/llama.h) giving each format under `pure`; the ggml type it must produce
LLAMA_FORMATS = {
    "Q4_K": (15, QT.Q4_K),  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    "Q5_K": (17, QT.Q5_K),  # Q5_K_M
    "Q6_K": (18, QT.Q6_K),
    "Q2_K": (10, QT.Q2_K),
    "Q3_K": (12, QT.Q3_K),  # Q3_K_M
    "IQ4_NL": (25, QT.IQ4_NL),
    "IQ4_XS": (30, QT.IQ4_XS),
    "Q5_0": (8, QT.Q5_0),
    "Q5_1": (9, QT.Q5_1),
}
WIDEN = 4

TINY_IM_START, TINY_IM_END = 257, 258  # the writers' BOS / EOS (<|endoftext|> is 256)
TINY_BOS = TINY_IM_START


def _bytes(s: str) -> list[int]:
    return list(s.encode())


TINY_PROMPTS = [
    [TINY_BOS] + _bytes("Hello, world"),
    list(range(40, 90, 3)),
    [TINY_IM_START] + _bytes("user\nWhat is 12 + 30?") + [TINY_IM_END, 10, TINY_IM_START] + _bytes("assistant\n"),
    _bytes("The capital of France is Paris. It is known for the Eiffel Tower, the Louvre museum and its cafes."),
    [7],
]

REAL_MODELS = ["SmolLM2-135M-Instruct.Q4_1.gguf", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "gemma-3-270m-q4_k_m.gguf"]


# ----------------------------------------------------------------------------- llama.cpp


def default_llama_dir() -> Path:
    return Path(os.environ.get("SPECULA_CACHE", Path.home() / ".cache" / "specula")) / "llama.cpp"


def load_llama_bindings(llama_dir: Path):
    """llama-cpp-python's low-level module `llama_cpp.llama_cpp` (ctypes over libllama), loaded
    from the sdist's own package folder with the library from $LLAMA_CPP_LIB_PATH (default
    <llama_dir>/build/bin).  The package's __init__ is not run: it imports the high-level API,
    which needs `diskcache` and more; the low-level module needs nothing beyond ctypes."""
    spec = importlib.util.find_spec("llama_cpp")  # on PYTHONPATH (scripts/llama_compare.sh sets it)
    if spec is not None and spec.submodule_search_locations:
        pkg_dir = Path(list(spec.submodule_search_locations)[0])
    else:
        found = sorted(llama_dir.glob("llama_cpp_python-*/llama_cpp"))
        if not found:
            raise SystemExit(f"no llama_cpp package: run scripts/build_llama_cpp.sh (looked in {llama_dir})")
        pkg_dir = found[-1]
    os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(llama_dir / "build" / "bin"))
    lib = Path(os.environ["LLAMA_CPP_LIB_PATH"]) / "libllama.so"
    if not lib.exists():
        raise SystemExit(f"{lib} does not exist: run scripts/build_llama_cpp.sh")
    if "llama_cpp" not in sys.modules:
        pkg = types.ModuleType("llama_cpp")
        pkg.__path__ = [str(pkg_dir)]
        sys.modules["llama_cpp"] = pkg
    return importlib.import_module("llama_cpp.llama_cpp")


class LlamaCpp:
    GGML_TYPE_F32 = 0
    FLASH_ATTN_DISABLED = 0

    def __init__(self, llama_dir: Path, threads: int, repack: bool):
        self.L = load_llama_bindings(llama_dir)
        self.threads = threads
        self.repack = repack
        self.log: list[str] = []

        @self.L.llama_log_callback
        def _log(level, text, user_data):  # keep llama.cpp quiet; kept for error messages
            self.log.append(text.decode(errors="replace"))
            del self.log[:-200]

        self._log_cb = _log  # must outlive every call into the library
        self.L.llama_log_set(_log, None)
        self.L.llama_backend_init()

    def _error(self, what: str) -> RuntimeError:
        tail = [x.strip() for x in self.log if "error" in x.lower() or "failed" in x.lower()]
        return RuntimeError(f"{what}: {' | '.join(tail[-3:]) or 'see llama.cpp log'}")

    def _load(self, path: str):
        L = self.L
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        mp.use_extra_bufts = self.repack
        self.log.clear()
        model = L.llama_model_load_from_file(str(path).encode(), mp)
        if not model:
            raise self._error("llama.cpp could not load the model")
        return model

    def tokenize(self, path: str, texts: list[str]) -> list[list[int]]:
        L = self.L
        model = self._load(path)
        try:
            vocab = L.llama_model_get_vocab(model)
            out = []
            for t in texts:
                b = t.encode()
                buf = (L.llama_token * (len(b) + 8))()
                n = L.llama_tokenize(vocab, b, len(b), buf, len(buf), True, True)
                if n < 0:
                    raise RuntimeError("llama_tokenize failed")
                out.append(list(buf[:n]))
            return out
        finally:
            L.llama_model_free(model)

    def logits(self, path: str, prompts: list[list[int]]) -> list[np.ndarray]:
        L = self.L
        model = self._load(path)
        try:
            n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
            out = []
            for prompt in prompts:
                n = len(prompt)
                cp = L.llama_context_default_params()
                cp.n_ctx = max(256, -(-n // 256) * 256)
                cp.n_batch = cp.n_ubatch = cp.n_ctx
                cp.n_seq_max = 1
                cp.n_threads = cp.n_threads_batch = self.threads
                cp.flash_attn_type = self.FLASH_ATTN_DISABLED
                cp.type_k = cp.type_v = self.GGML_TYPE_F32
                cp.swa_full = True
                cp.no_perf = True
                ctx = L.llama_init_from_model(model, cp)
                if not ctx:
                    raise self._error("llama.cpp could not create a context")
                batch = L.llama_batch_init(n, 0, 1)
                try:
                    for i, tok in enumerate(prompt):
                        batch.token[i] = tok
                        batch.pos[i] = i
                        batch.n_seq_id[i] = 1
                        batch.seq_id[i][0] = 0
                        batch.logits[i] = 1
                    batch.n_tokens = n
                    rc = L.llama_decode(ctx, batch)
                    if rc != 0:
                        raise self._error(f"llama_decode returned {rc}")
                    rows = [np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy() for i in range(n)]
                    out.append(np.stack(rows))
                finally:
                    L.llama_batch_free(batch)
                    L.llama_free(ctx)
            return out
        finally:
            L.llama_model_free(model)

    def quantize(self, src: Path, dst: Path, ftype: int) -> None:
        L = self.L
        p = L.llama_model_quantize_default_params()
        p.nthread = self.threads
        p.ftype = ftype
        p.pure = True
        p.allow_requantize = True
        self.log.clear()
        if L.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p)) != 0:
            raise self._error(f"llama_model_quantize to ftype {ftype} failed")


class LlamaProc:
    """LlamaCpp's calls, each in a child process (this script with --llama-worker): a
    GGML_ASSERT in llama.cpp aborts the process, and a file it refuses that way must not end
    the whole comparison."""

    def __init__(self, llama_dir: Path, threads: int, repack: bool, workdir: Path):
        lib = Path(os.environ.get("LLAMA_CPP_LIB_PATH", llama_dir / "build" / "bin")) / "libllama.so"
        if not lib.exists():
            raise SystemExit(f"{lib} does not exist: run scripts/build_llama_cpp.sh")
        self.cfg = {"llama_dir": str(llama_dir), "threads": threads, "repack": repack}
        self.workdir = workdir

    def _run(self, job: dict):
        jp, out = self.workdir / "llama_job.json", self.workdir / "llama_out.npz"
        out.unlink(missing_ok=True)
        jp.write_text(json.dumps({**self.cfg, **job, "out": str(out)}))
        env = {**os.environ, "GGML_NO_BACKTRACE": "1"}
        p = subprocess.run([sys.executable, __file__, "--llama-worker", str(jp)], capture_output=True, text=True, env=env)
        if p.returncode != 0:
            lines = [x.strip() for x in p.stderr.splitlines() if x.strip()]
            key = [x for x in lines if any(w in x for w in ("error", "failed", "GGML_ASSERT", "Error"))]
            raise RuntimeError(f"exit {p.returncode}: " + " | ".join((key or lines)[-3:]))
        return np.load(out, allow_pickle=False)

    def logits(self, path: str, prompts: list[list[int]]) -> list[np.ndarray]:
        z = self._run({"op": "logits", "model": str(path), "prompts": prompts})
        return [z[f"p{i}"] for i in range(len(prompts))]

    def tokenize(self, path: str, texts: list[str]) -> list[list[int]]:
        z = self._run({"op": "tokenize", "model": str(path), "texts": texts})
        return [z[f"p{i}"].tolist() for i in range(len(texts))]

    def quantize(self, src: Path, dst: Path, ftype: int) -> None:
        self._run({"op": "quantize", "src": str(src), "dst": str(dst), "ftype": ftype})


def llama_worker(job_path: str) -> int:
    """The child's side of LlamaProc: one job, results in an .npz."""
    job = json.loads(Path(job_path).read_text())
    lc = LlamaCpp(Path(job["llama_dir"]), job["threads"], job["repack"])
    try:
        if job["op"] == "logits":
            res = lc.logits(job["model"], job["prompts"])
        elif job["op"] == "tokenize":
            res = [np.asarray(x, dtype=np.int64) for x in lc.tokenize(job["model"], job["texts"])]
        elif job["op"] == "quantize":
            lc.quantize(Path(job["src"]), Path(job["dst"]), job["ftype"])
            res = []
        else:
            raise ValueError(job["op"])
    except Exception as e:  # noqa: BLE001
        print(f"error: {e}", file=sys.stderr)
        return 1
    np.savez(job["out"], **{f"p{i}": x for i, x in enumerate(res)})
    return 0


# ----------------------------------------------------------------------------- GGUF rewriting


class _Writer(gguf.GGUFWriter):
    """GGUFWriter that can also write an empty array (its element type given)."""

    def _pack_val(self, val, vtype, add_vtype, sub_type=None):
        if vtype == GGUFValueType.ARRAY and sub_type is not None and len(val) == 0:
            head = self._pack("I", vtype) if add_vtype else b""
            return head + self._pack("I", sub_type) + self._pack("Q", 0)
        return super()._pack_val(val, vtype, add_vtype, sub_type=sub_type)


WIDENED_KEYS = ("embedding_length", "feed_forward_length", "expert_feed_forward_length", "expert_shared_feed_forward_length",
                "attention.key_length", "attention.value_length", "rope.dimension_count")


def rewrite_gguf(src: Path, dst: Path, widen: int = 1, seed: int = 0) -> None:
    """Copies a GGUF (tensor bytes as they are) in the form llama.cpp loads:
    * `tokenizer.ggml.merges` as an array of strings (llama.cpp's loader demands the string type,
      even for an empty array; the tiny writers' empty array is typed UINT32);
    * Llama 3 RoPE scaling given as metadata (`rope.scaling.type = "llama3"` and its factor, low /
      high frequency factors and original context, as `write-tiny --rope-llama3` writes it) becomes
      the `rope_freqs.weight` tensor of divisors, the form llama.cpp's converter writes and its
      loader reads (it aborts on the unknown scaling type "llama3").
    widen > 1 (F32 files only): every width times `widen` (see the module docstring), weights
    resampled from each tensor's own values, matrices scaled by 1/sqrt(widen)."""
    r = GGUFReader(str(src))
    arch = rf.field_value(r, "general.architecture")
    llama3 = rf.read_config(r).llama3
    w = _Writer(str(dst), arch)
    for f in r.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF.") or f.name == "general.alignment":
            continue
        if llama3 is not None and f.name.startswith(f"{arch}.rope.scaling."):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == GGUFValueType.ARRAY and len(f.types) > 1 else None
        val = f.contents()
        if f.name == "tokenizer.ggml.merges":
            sub = GGUFValueType.STRING
        elif vtype == GGUFValueType.ARRAY and sub is None:
            raise ValueError(f"{src}: empty array {f.name} of unknown type")
        if widen > 1 and f.name.startswith(arch + ".") and f.name[len(arch) + 1:] in WIDENED_KEYS:
            val = int(val) * widen
        w.add_key_value(f.name, val, vtype, sub_type=sub)
    rng = np.random.default_rng(seed)
    tensors, ne_of = [], {}
    for t in r.tensors:
        ne_of[t.name] = [int(x) for x in t.shape]
        if widen == 1:
            tensors.append((t.name, t.data, t.tensor_type))
            continue
        if t.tensor_type != QT.F32:
            raise ValueError(f"widening needs an F32 file ({t.name} is {t.tensor_type.name})")
        ne = [int(x) for x in t.shape]
        # kept: the vocabulary of the embedding / output, the expert count of the MoE stacks
        keep_last = t.name in ("token_embd.weight", "output.weight") or t.name.endswith(("_exps.weight", "ffn_gate_inp.weight"))
        new = [d if (i == len(ne) - 1 and keep_last) else d * widen for i, d in enumerate(ne)]
        vals = np.asarray(t.data, dtype=np.float32).ravel()
        data = rng.choice(vals, size=int(np.prod(new))).astype(np.float32).reshape(list(reversed(new)))
        ne_of[t.name] = new
        if t.name == "token_embd.weight" and arch == "gemma3":
            # gemma3 scales the embedding by sqrt(hidden), so the current token's own row
            # dominates the residual and, tied, its logit grows with hidden x |e|^2: at 1/sqrt(4)
            # the softmax saturates (top probability 0.9997, KL blind); at 1/4 it stays as native
            data *= np.float32(1.0 / widen)
        elif len(ne) >= 2:
            data *= np.float32(1.0 / np.sqrt(widen))  # fan-in x widen: each output keeps its size
        tensors.append((t.name, data, QT.F32))
    # What llama.cpp's loader needs and the tiny MoE writer leaves out (specula infers it from
    # the tensors): the expert widths as metadata, and for qwen2moe an untied output matrix.
    if arch in ("qwen2moe", "qwen3moe", "qwen35moe", "qwen3next"):
        for key, tensor in (("expert_feed_forward_length", "blk.0.ffn_gate_exps.weight"), ("expert_shared_feed_forward_length", "blk.0.ffn_gate_shexp.weight")):
            if f"{arch}.{key}" not in r.fields and tensor in ne_of:
                w.add_key_value(f"{arch}.{key}", ne_of[tensor][1], GGUFValueType.UINT32)
    if arch == "qwen2moe" and "output.weight" not in ne_of:
        embd = next(x for x in tensors if x[0] == "token_embd.weight")
        tensors.append(("output.weight", embd[1], embd[2]))
    if llama3 is not None:
        c = rf.read_config(r)
        rot = c.rope_dim * (widen if widen > 1 else 1)
        tensors.append(("rope_freqs.weight", rf.llama3_freq_factors(llama3, rot, c.rope_theta).astype(np.float32), QT.F32))
    for name, data, qt in tensors:
        w.add_tensor_info(name, data.shape, data.dtype, data.nbytes, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, data, _ in tensors:
        w.write_tensor_data(np.ascontiguousarray(data))
    w.close()


def matrix_types(path: Path) -> dict[str, int]:
    """ggml type name -> count, over the tensors of 2 or more dimensions."""
    out: dict[str, int] = {}
    for t in GGUFReader(str(path)).tensors:
        if len(t.shape) >= 2:
            out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + 1
    return out


# ----------------------------------------------------------------------------- specula


def specula_bin() -> str:
    b = os.environ.get("SPECULA_BIN") or str(REPO / "target" / "ci" / "specula")
    if not os.access(b, os.X_OK):
        b2 = str(REPO / "target" / "release" / "specula")
        if os.access(b2, os.X_OK) and not os.environ.get("SPECULA_BIN"):
            return b2
        raise SystemExit(f"specula binary not found at {b} (set SPECULA_BIN)")
    return b


def run_specula(args: list[str]) -> None:
    p = subprocess.run([specula_bin(), *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"specula {' '.join(args[:2])} failed ({p.returncode}): {p.stderr.strip()[-500:]}")


def specula_logits(path: Path, prompts: list[list[int]], workdir: Path, threads: int) -> list[np.ndarray]:
    inp, out = workdir / "in.json", workdir / "out.bin"
    inp.write_text(json.dumps({"prompts": prompts}))
    # KV in f32 as llama.cpp's here (the served default, f16, would round every key and value)
    run_specula(["debug", "logits", "--model", str(path), "--input", str(inp), "--output", str(out), "--threads", str(threads), "--kv-cache-dtype", "f32"])
    flat = np.fromfile(out, dtype="<f4")
    rows = sum(len(p) for p in prompts)
    if flat.size % rows:
        raise RuntimeError(f"specula wrote {flat.size} floats, not a multiple of {rows} positions")
    return np.split(flat.reshape(rows, -1), np.cumsum([len(p) for p in prompts])[:-1])


# ----------------------------------------------------------------------------- simulated rounding

# How each engine rounds the input of a weight matmul, by the type of the weight.
Q8_K_CONSUMERS = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"}  # ggml vec_dot_type Q8_K


def llama_scheme(types_: dict[str, int]) -> str | None:
    """llama.cpp's activation rounding for a file whose matrices all have one type (the MoE router
    aside, F32 in both engines); None for a mix of types (then specula's scheme stands in)."""
    t = set(types_) - {"F32"} or {"F32"}
    if len(t) != 1:
        return None
    (t,) = t
    return {"F32": "none", "F16": "f16", "BF16": "f16"}.get(t, "q8_256" if t in Q8_K_CONSUMERS else "q8_32")


def specula_scheme(types_: dict[str, int]) -> str:
    """specula: f32 activations for F32 / F16 weights, else `reference_forward`'s "q8k" model of
    its kernels (8-bit blocks of 32; one scale per 256 for Q4_K / Q5_K unless a value dominates)."""
    return "none" if set(types_) <= {"F32", "F16", "BF16"} else "q8k_specula"


def simulated_forward(path: str, prompt: list[int], scheme: str) -> np.ndarray:
    """The reference with the matmul inputs rounded as `scheme` says:
    none         exact float32 (the reference itself)
    q8_32        8-bit blocks of 32, f16 scale (ggml Q8_0 / Q8_1)      act_quant="q8"
    q8k_specula  specula's kernels                                      act_quant="q8k"
    q8_256       8-bit blocks of 256 for every matrix (ggml Q8_K, one scale per super-block)
    f16          every matmul input rounded to half precision (ggml's F16 vec_dot_type)
    The last two swap functions of `reference_forward` for the duration of the call."""
    if scheme == "none":
        return rf.forward(path, prompt)
    if scheme == "q8_32":
        return rf.forward(path, prompt, act_quant="q8")
    if scheme == "q8k_specula":
        return rf.forward(path, prompt, act_quant="q8k")
    saved = rf._reads_super, rf.quantize_q8_super, rf.quantize_q8_blocks
    try:
        if scheme == "q8_256":
            q32 = rf.quantize_q8_blocks
            rf._reads_super = lambda W, w: True
            rf.quantize_q8_super = lambda x: q32(x, block=256) if x.shape[-1] % 256 == 0 else q32(x)
            return rf.forward(path, prompt, act_quant="q8k")
        if scheme == "f16":
            rf.quantize_q8_blocks = lambda x, block=32: x.astype(np.float16).astype(x.dtype)
            return rf.forward(path, prompt, act_quant="q8")
        raise ValueError(scheme)
    finally:
        rf._reads_super, rf.quantize_q8_super, rf.quantize_q8_blocks = saved


# ----------------------------------------------------------------------------- metrics


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(softmax p || softmax q) per row, float64."""
    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return (np.exp(lp) * (lp - lq)).sum(-1)


def top1(a: np.ndarray, b: np.ndarray) -> tuple[float, float, int]:
    """(exact agreement, the largest gap by a's logits where b's pick differs, that row)."""
    rows = np.arange(len(a))
    ta, tb = a.argmax(-1), b.argmax(-1)
    gap = a[rows, ta] - a[rows, tb]
    return float(np.mean(ta == tb)), float(gap.max()), int(gap.argmax())


@dataclass
class Case:
    name: str
    path: Path | None = None
    prompts: list = field(default_factory=list)
    real: bool = False
    moe: bool = False
    note: str = ""
    # results
    skip: str = ""
    error: str = ""
    stats: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)
    seconds: float = 0.0


def cat(xs: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(xs).astype(np.float64)


def compare(case: Case, llama: list[np.ndarray], ours: list[np.ndarray], refs: dict | None) -> None:
    """Fills case.stats and case.failures.  refs: {"ref", "sim_llama", "sim_specula"} lists of
    logits (the reference exact and with each engine's rounding simulated), or None."""
    a, b = cat(llama), cat(ours)
    if a.shape != b.shape:
        raise RuntimeError(f"shapes differ: llama.cpp {a.shape}, specula {b.shape}")
    if not np.isfinite(b).all():
        raise RuntimeError("specula produced non-finite logits")
    k = kl(a, b)
    agree, gap, gap_row = top1(a, b)
    s = case.stats
    s.update({"positions": len(a), "top1": agree, "top1_gap": gap, "kl_mean": float(k.mean()), "kl_max": float(k.max()),
              "max_abs": float(np.abs(a - b).max()), "logit_std": float(a.std(-1).mean())})
    if refs is not None:
        r, sl, ss = cat(refs["ref"]), cat(refs["sim_llama"]), cat(refs["sim_specula"])
        s["kl_ref_specula"] = float(kl(r, b).mean())
        s["kl_ref_llama"] = float(kl(r, a).mean())
        s["env_llama"] = float(kl(r, sl).mean())
        s["env_specula"] = float(kl(r, ss).mean())
        s["sigma"] = float(np.hypot((sl - r).std(), (ss - r).std()))
        # the bounds of the module docstring
        lim_kl = K_ENV * (max(s["env_llama"], s["kl_ref_llama"]) + s["env_specula"]) + KL_FLOOR
        lim_tie = max(TIE_SIGMAS * s["sigma"], TIE_FLOOR)
    elif case.real:
        lim_kl, lim_tie = REAL_KL_MEAN, REAL_TOP1_TIE
    else:
        lim_kl, lim_tie = TINY_KL_MEAN, TINY_TOP1_TIE
    lim_agree = MOE_TOP1_MIN_AGREE if case.moe else TOP1_MIN_AGREE
    s["kl_bound"] = lim_kl
    if s["kl_mean"] > lim_kl:
        case.failures.append(f"KL mean {s['kl_mean']:.2e} > bound {lim_kl:.1e}")
    if agree < lim_agree:
        case.failures.append(f"top-1 agreement {agree:.1%} < {lim_agree:.0%}")
    if gap > lim_tie and not case.moe:
        case.failures.append(f"position {gap_row}: specula's top-1 is {gap:.3f} below llama.cpp's best by llama.cpp's logits (tie margin {lim_tie:.3f})")
    if refs is not None and s["kl_ref_specula"] > NO_WORSE_MAX * max(s["kl_ref_llama"], s["env_specula"]) + KL_FLOOR:
        case.failures.append(f"KL(ref||specula) {s['kl_ref_specula']:.2e} > {NO_WORSE_MAX:g} x max(KL(ref||llama.cpp) {s['kl_ref_llama']:.2e}, "
                             f"KL(ref||ref+q8) {s['env_specula']:.2e})")


# ----------------------------------------------------------------------------- cases


# (label, writer command, extra writer flags, formats written by specula's writer, and whether
# llama.cpp's quantizer also makes LLAMA_FORMATS from the widened F32 file)
TINY_SPECS = [
    (f"dense-{a}", "write-tiny", ["--layers", "4"] if a == "smollm3" else [], ["f32"] + (["f16"] if a == "llama" else []) + ["q8_0", "q4_0"], True)
    for a in DENSE_ARCHS
]
TINY_SPECS += [
    ("dense-llama-rope-llama3", "write-tiny", ["--rope-llama3"], ["q8_0"], False),
    ("dense-phi3-partial-rope", "write-tiny", ["--rope-dims", "8"], ["q8_0"], False),
    ("dense-qwen3-head32", "write-tiny", ["--head-dim", "32"], ["q8_0"], False),
]
# qwen2moe with its shared expert: llama.cpp's qwen2moe requires one (as every real Qwen2-MoE has)
TINY_SPECS += [(f"moe-{a}", "write-tiny-moe", ["--shared-ffn", "64"] if a == "qwen2moe" else [], ["f32", "q8_0", "q4_0"], True) for a in MOE_ARCHS]
TINY_SPECS += [("moe-qwen3moe-top3-of-8", "write-tiny-moe", ["--experts", "8", "--experts-used", "3", "--head-dim", "32"], ["q8_0"], False)]
# qwen35: three Gated DeltaNet layers to one gated-attention layer (not widened: the convolution's
# taps and the state width are not widths); rope dims 8 puts a RoPE pair in the unrotated section
TINY_SPECS += [
    ("dense-qwen35", "write-tiny", ["--layers", "4"], ["f32", "q8_0", "q4_0"], False),
    ("dense-qwen35-rope8", "write-tiny", ["--layers", "8", "--rope-dims", "8"], ["q8_0"], False),
    # with the prediction layer after the trunk (nextn, as the files ship): the trunk is unchanged
    ("dense-qwen35-nextn", "write-tiny", ["--layers", "4", "--nextn"], ["q8_0"], False),
    # the MoE hybrid: routed experts renormalised and a sigmoid-gated shared expert (required)
    ("moe-qwen35moe", "write-tiny-moe", ["--layers", "4", "--experts", "8", "--experts-used", "2", "--shared-ffn", "64"], ["f32", "q8_0", "q4_0"], False),
    # Qwen3-Next: qwen35moe's hybrid with beta and alpha fused per key head (ssm_ba), the key
    # heads shared by value heads interleaved (h // r, not h % Hk), plain NeoX RoPE (no sections)
    ("moe-qwen3next", "write-tiny-moe", ["--layers", "4", "--experts", "8", "--experts-used", "2", "--shared-ffn", "64"], ["f32", "q8_0", "q4_0"], False),
    # older Qwen3-Next files: q, k, v and z fused per key head in ssm_in; and the prediction layer
    ("moe-qwen3next-ssm-in", "write-tiny-moe", ["--layers", "4", "--experts", "8", "--experts-used", "2", "--shared-ffn", "64", "--fused-ssm-in"], ["q8_0"], False),
    ("moe-qwen3next-nextn", "write-tiny-moe", ["--layers", "4", "--experts", "8", "--experts-used", "2", "--shared-ffn", "64", "--nextn"], ["q8_0"], False),
]
# gpt-oss: attention sinks, biases, alternating sliding layers, YaRN, clamped-SwiGLU experts
TINY_SPECS += [("moe-gpt-oss-top4-of-8", "write-tiny-moe", ["--experts", "8", "--experts-used", "4", "--layers", "3"], ["f32", "q8_0", "q4_0"], False)]


def tiny_cases(tmp: Path, lc: LlamaProc, want_llama_formats: bool, flt) -> list[Case]:
    cases: list[Case] = []
    for label, cmd, flags, formats, llama_formats in TINY_SPECS:
        arch = "gpt-oss" if "-gpt-oss" in label else label.split("-")[1]
        write = lambda out, fmt: run_specula(["debug", cmd, "--output", str(out), "--arch", arch, "--format", fmt, *flags])  # noqa: E731
        for fmt in formats:
            c = Case(f"{label} {fmt}", prompts=TINY_PROMPTS)
            if not flt(c.name):
                continue
            raw, c.path = tmp / f"{label}-{fmt}.raw.gguf", tmp / f"{label}-{fmt}.gguf"
            try:
                write(raw, fmt)
                rewrite_gguf(raw, c.path)
            except Exception as e:  # noqa: BLE001
                c.error = f"writing the file: {e}"
            cases.append(c)
        if not (want_llama_formats and llama_formats) or not any(flt(f"{label} {fmt} (h256)") for fmt in LLAMA_FORMATS):
            continue
        f32, wide = tmp / f"{label}-f32.raw.gguf", tmp / f"{label}-f32-wide.gguf"
        wide_err = ""
        try:
            write(f32, "f32")
            rewrite_gguf(f32, wide, widen=WIDEN, seed=1)
        except Exception as e:  # noqa: BLE001
            wide_err = f"writing the widened F32 file: {e}"
        for fmt, (ftype, gtype) in LLAMA_FORMATS.items():
            c = Case(f"{label} {fmt} (h256)", prompts=TINY_PROMPTS)  # widened to hidden 256, quantized by llama.cpp
            if not flt(c.name):
                continue
            c.path = tmp / f"{label}-{fmt}.gguf"
            c.error = wide_err
            if not c.error:
                try:
                    lc.quantize(wide, c.path, ftype)
                    got = matrix_types(c.path)
                    # the MoE router (ffn_gate_inp) stays F32 by llama.cpp's rule
                    if gtype.name not in got or set(got) - {gtype.name, "F32"}:
                        c.error = f"quantizer produced {got}, not {gtype.name} (fallback?)"
                except Exception as e:  # noqa: BLE001
                    c.error = f"quantizing: {e}"
            cases.append(c)
    return cases


def real_cases(paths: list[Path], lc: LlamaProc) -> list[Case]:
    """Real models (and --model files): the texts of python/tests/prompts.py, tokenized by llama.cpp."""
    sys.path.insert(0, str(PY_DIR / "tests"))
    from prompts import CHAT, CODE, ENGLISH, NON_LATIN  # noqa: E402

    cases = []
    for p in paths:
        c = Case(p.name, path=p, real=True)
        if not p.exists():
            c.skip = f"{p} does not exist"
        else:
            try:
                c.prompts = lc.tokenize(str(p), [ENGLISH, CODE, CHAT, NON_LATIN])
            except Exception as e:  # noqa: BLE001
                c.error = f"llama.cpp: {e}"
        cases.append(c)
    return cases


def run_case(c: Case, lc: LlamaProc, workdir: Path, threads: int, use_ref: bool) -> None:
    t0 = time.time()
    try:
        try:
            llama = lc.logits(str(c.path), c.prompts)
        except Exception as e:  # noqa: BLE001
            c.error = f"llama.cpp: {e}"
            return
        try:
            ours = specula_logits(c.path, c.prompts, workdir, threads)
        except Exception as e:  # noqa: BLE001
            c.error = f"specula: {e}"
            return
        refs = None
        c.moe = any(t.name.endswith("_exps.weight") for t in GGUFReader(str(c.path)).tensors)
        if use_ref:
            got = matrix_types(c.path)
            sl, ss = llama_scheme(got), specula_scheme(got)
            if sl is None:
                c.note = (c.note + "; " if c.note else "") + "mixed types: specula's rounding stands in for llama.cpp's"
                sl = ss
            c.stats["schemes"] = (sl, ss)
            try:
                refs = {"ref": [rf.forward(str(c.path), p) for p in c.prompts]}
                refs["sim_llama"] = [simulated_forward(str(c.path), p, sl) for p in c.prompts]
                refs["sim_specula"] = refs["sim_llama"] if ss == sl else [simulated_forward(str(c.path), p, ss) for p in c.prompts]
            except Exception as e:  # noqa: BLE001  (an architecture or type the reference does not model)
                c.note = (c.note + "; " if c.note else "") + f"no reference: {type(e).__name__}: {e}"
                refs = None
        compare(c, llama, ours, refs)
    except Exception as e:  # noqa: BLE001
        c.error = str(e)
    finally:
        c.seconds = time.time() - t0


# ----------------------------------------------------------------------------- report


def fmt_e(x) -> str:
    return "—" if x is None else f"{x:.1e}"


def table(cases: list[Case]) -> str:
    head = ("| case | positions | top-1 agree | KL(llama.cpp‖specula) mean | bound | KL max | max\\|Δlogit\\| "
            "| KL(ref‖specula) | KL(ref‖llama.cpp) | KL(ref‖ref+q8): specula / llama.cpp rounding | result |")
    lines = [head, "|" + "---|" * 11]
    for c in cases:
        s = c.stats
        if c.skip or c.error or not s.get("positions"):
            what = f"SKIP: {c.skip}" if c.skip else f"ERROR: {c.error}"
            lines.append(f"| {c.name} |" + " |" * 9 + f" {what.replace('|', '/')} |")
            continue
        res = "PASS" if not c.failures else "FAIL: " + "; ".join(c.failures)
        env = f"{fmt_e(s['env_specula'])} / {fmt_e(s['env_llama'])}" if "env_llama" in s else "—"
        lines.append(
            f"| {c.name} | {s['positions']} | {s['top1']:.1%} | {fmt_e(s['kl_mean'])} | {fmt_e(s['kl_bound'])} | {fmt_e(s['kl_max'])} | {s['max_abs']:.3f} "
            f"| {fmt_e(s.get('kl_ref_specula'))} | {fmt_e(s.get('kl_ref_llama'))} | {env} | {res} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--llama-worker"]:
        return llama_worker(argv[1])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", default=[], type=Path, help="also compare this GGUF (repeatable)")
    ap.add_argument("--real", action="store_true", help="also the cached real models (SmolLM2, Qwen2.5-Coder, Gemma 3)")
    ap.add_argument("--no-tiny", action="store_true", help="skip the tiny generated files")
    ap.add_argument("--arch-filter", default="", help="only cases whose name contains this (e.g. qwen3, moe-, Q4_K)")
    ap.add_argument("--no-llama-quant", action="store_true", help="skip the files quantized by llama.cpp (K / IQ formats)")
    ap.add_argument("--no-ref", action="store_true", help="skip the NumPy reference columns")
    ap.add_argument("--real-ref", action="store_true", help="run the NumPy reference on real models too (minutes, GBs of RAM)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repack", action="store_true", help="let llama.cpp repack weights (its default; off here)")
    ap.add_argument("--llama-dir", type=Path, default=default_llama_dir(), help="where scripts/build_llama_cpp.sh built llama.cpp")
    ap.add_argument("--keep", type=Path, help="write the generated files here and keep them")
    ap.add_argument("--json", type=Path, help="also write the per-case figures as JSON")
    a = ap.parse_args(argv)

    flt = lambda name: a.arch_filter.lower() in name.lower()  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="llama_compare.") as td:
        tmp = a.keep or Path(td)
        tmp.mkdir(parents=True, exist_ok=True)
        lc = LlamaProc(a.llama_dir, a.threads, a.repack, tmp)
        cases: list[Case] = []
        if not a.no_tiny:
            cases += tiny_cases(tmp, lc, not a.no_llama_quant, flt)
        cache = Path(os.environ.get("SPECULA_CACHE", Path.home() / ".cache" / "specula"))
        if a.real:
            cases += [c for c in real_cases([cache / m for m in REAL_MODELS], lc) if flt(c.name)]
        cases += real_cases(a.model, lc)
        if not cases:
            print("no case matches", file=sys.stderr)
            return 2
        for c in cases:
            if not (c.skip or c.error):
                run_case(c, lc, tmp, a.threads, use_ref=not a.no_ref and (not c.real or a.real_ref))
            status = "SKIP" if c.skip else "ERROR" if c.error else ("PASS" if not c.failures else "FAIL")
            s = c.stats
            detail = c.skip or c.error or "; ".join(c.failures) or (
                f"top-1 {s['top1']:.1%}, KL mean {s['kl_mean']:.1e}, max {s['kl_max']:.1e}, max|d| {s['max_abs']:.3f}")
            print(f"[{status}] {c.name} ({c.seconds:.1f}s): {detail}", file=sys.stderr, flush=True)

    print()
    print(table(cases))
    notes = [f"* {c.name}: {c.note}" for c in cases if c.note]
    if notes:
        print()
        print("\n".join(notes))
    passed = [c for c in cases if "positions" in c.stats and not c.failures and not c.error]
    failed = [c for c in cases if c.failures or c.error]
    skipped = [c for c in cases if c.skip]
    print()
    print(
        f"{len(passed)}/{len(cases)} cases pass, {len(failed)} fail or error, {len(skipped)} skipped "
        f"(bounds: KL(llama.cpp||specula) mean <= {K_ENV:g} x (llama.cpp's + specula's simulated rounding KL) + {KL_FLOOR:.0e}; "
        f"KL(ref||specula) <= {NO_WORSE_MAX:g} x max(KL(ref||llama.cpp), specula's simulated); top-1 >= {TOP1_MIN_AGREE:.0%} "
        f"(MoE {MOE_TOP1_MIN_AGREE:.0%}), a differing dense top-1 within {TIE_SIGMAS:g} sigma of llama.cpp's best)"
    )
    if a.json:
        rows = [{"case": c.name, "note": c.note, "skip": c.skip, "error": c.error, "failures": c.failures, **c.stats} for c in cases]
        a.json.write_text(json.dumps(rows, indent=1))
    return 1 if failed else (0 if passed else 2)


if __name__ == "__main__":
    sys.exit(main())
