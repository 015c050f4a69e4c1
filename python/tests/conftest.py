"""Shared fixtures for the Python oracle tests.

Environment:
  SPECULA_MODEL  path of the GGUF model (tests needing it skip when unset or missing)
  SPECULA_BIN    the specula binary (default: <repo>/target/release/specula); the engine-vs-oracle
                 tests skip when it does not exist.
  CI             when set, a missing model or binary fails the run instead of skipping it
"""

import os
import sys

# Single-threaded BLAS: on a 2-core box shared with cargo, OpenBLAS's spinning worker threads make
# the small matmuls of the reference 10-20x slower.  Must be set before numpy is imported.
for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import json  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

PY_DIR = Path(__file__).resolve().parent.parent
REPO = PY_DIR.parent
sys.path.insert(0, str(PY_DIR))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def missing(reason: str):
    """Skips the calling test locally; under CI (the `CI` variable set) a missing model, binary or
    oracle package is a broken run, so it fails."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set, so this is a failure, not a skip)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def model_path() -> str:
    p = os.environ.get("SPECULA_MODEL")
    if not p:
        missing("SPECULA_MODEL is not set (path of the GGUF model, e.g. SmolLM2-135M-Instruct.Q4_1.gguf)")
    if not os.path.isfile(p):
        missing(f"SPECULA_MODEL={p} does not exist")
    return p


@pytest.fixture(scope="session")
def specula_bin() -> str:
    p = os.environ.get("SPECULA_BIN") or str(REPO / "target" / "release" / "specula")
    if not os.path.isfile(p) or not os.access(p, os.X_OK):
        missing(f"specula binary not found at {p} (build with `cargo build --release -p specula --features testing` or set SPECULA_BIN)")
    return p


@pytest.fixture(scope="session")
def oracle_tokenizer(model_path):
    import tokenizer_oracle

    return tokenizer_oracle.build_tokenizer(model_path)


def run_specula(bin_path: str, args: list[str], timeout: float = 600) -> None:
    r = subprocess.run([bin_path, *args], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise AssertionError(f"`specula {' '.join(args)}` failed with {r.returncode}:\n{r.stderr[-4000:]}")


def write_json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj, ensure_ascii=False), encoding="utf-8")
    return path
