"""Our dequantization of every supported ggml type against the `gguf` package's NumPy
implementation, on random blocks (k-quants cannot be quantized by gguf-py, so we feed random
bytes with sane f16 scales, and MXFP4 E8M0 scales between 2^-10 and 4). Exact equality up to
float rounding: both compute d * q - m (IQ4_NL / IQ4_XS / MXFP4: d times a table value)."""
import os
import subprocess
import numpy as np
import pytest
from conftest import missing
from gguf import quants, GGMLQuantizationType as T

BIN = os.environ.get("SPECULA_BIN", os.path.join(os.path.dirname(__file__), "..", "..", "target", "release", "specula"))

# (name for specula, gguf type, block elements, block bytes, byte offsets of f16 scale fields)
TYPES = [
    ("q4_0", T.Q4_0, 32, 18, [0]),
    ("q4_1", T.Q4_1, 32, 20, [0, 2]),
    ("q8_0", T.Q8_0, 32, 34, [0]),
    ("q5_0", T.Q5_0, 32, 22, [0]),
    ("q5_1", T.Q5_1, 32, 24, [0, 2]),
    ("q4_k", T.Q4_K, 256, 144, [0, 2]),
    ("q5_k", T.Q5_K, 256, 176, [0, 2]),
    ("q6_k", T.Q6_K, 256, 210, [208]),
    ("q2_k", T.Q2_K, 256, 84, [80, 82]),
    ("q3_k", T.Q3_K, 256, 110, [108]),
    ("iq4_nl", T.IQ4_NL, 32, 18, [0]),
    ("iq4_xs", T.IQ4_XS, 256, 136, [0]),
    ("mxfp4", T.MXFP4, 32, 17, []),
]


def require_binary():
    """Skips locally without the binary; under CI a missing binary fails the run."""
    if not os.path.exists(BIN):
        missing(f"specula binary missing at {BIN}")


def random_blocks(rng, n_blocks, block_bytes, scale_offsets):
    raw = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for off in scale_offsets:
        scales = (rng.uniform(0.001, 0.05, size=n_blocks)).astype(np.float16)
        raw[:, off:off + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return raw


def dequantize_both(tmp_path, name, gtype, raw, rows, cols):
    """(ours, gguf-py's) dequantization of `raw` (rows x row bytes) as `rows x cols` f32."""
    src = tmp_path / "raw.bin"
    out = tmp_path / "out.f32"
    raw.tofile(src)
    subprocess.run([BIN, "debug", "dequant", "--format", name, "--cols", str(cols), "--input", str(src), "--output", str(out)], check=True)
    ours = np.fromfile(out, dtype="<f4").reshape(rows, cols)
    want = quants.dequantize(raw.reshape(rows, -1), gtype).reshape(rows, cols)
    return ours, want


@pytest.mark.parametrize("name,gtype,blk,nbytes,scales", TYPES)
def test_dequantization_matches_gguf_py(tmp_path, name, gtype, blk, nbytes, scales):
    require_binary()
    rng = np.random.default_rng(1234)
    rows, blocks_per_row = 3, 2
    raw = random_blocks(rng, rows * blocks_per_row, nbytes, scales)
    if name == "mxfp4":
        raw[:, 0] = rng.integers(118, 131, size=rows * blocks_per_row, dtype=np.uint8)
    ours, want = dequantize_both(tmp_path, name, gtype, raw, rows, blocks_per_row * blk)
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(ours, want, rtol=1e-6, atol=1e-6)


def test_mxfp4_e8m0_scales_at_both_ends_match_gguf_py(tmp_path):
    """E8M0 bytes 0 and 1 (subnormal halves), 2, 127, 128 and 254-255 (no NaN: ggml's half is
    2^127 at 255, so 12 x 2^127 overflows to inf in both)."""
    require_binary()
    rng = np.random.default_rng(7)
    es = np.array([0, 1, 2, 127, 128, 254, 255], dtype=np.uint8)
    raw = random_blocks(rng, len(es), 17, [])
    raw[:, 0] = es
    ours, want = dequantize_both(tmp_path, "mxfp4", T.MXFP4, raw, len(es), 32)
    assert not np.isnan(want).any()
    np.testing.assert_array_equal(ours, want)


def test_bad_dequant_arguments_fail_cleanly(tmp_path):
    require_binary()
    src = tmp_path / "raw.bin"
    src.write_bytes(b"\x00" * 10)
    r = subprocess.run([BIN, "debug", "dequant", "--format", "q4_k", "--cols", "256", "--input", str(src), "--output", str(tmp_path / "o")], capture_output=True, text=True)
    assert r.returncode != 0
    assert "row" in r.stderr and "panicked" not in r.stderr
