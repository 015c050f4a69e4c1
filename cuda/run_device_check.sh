#!/usr/bin/env bash
# On a machine with nvcc and a GPU: builds cuda/q4k_group.cu and runs it on the case files under
# cuda/cases/ (written here by `cargo run --release -p specula-kernels --example device_case --
# cuda/cases/NAME.case [rows] [cols]`): every output bit against the CPU kernel's, then the
# matvec's read bandwidth beside a device-to-device copy. Exit 1 on any differing bit.
set -euo pipefail
cd "$(dirname "$0")"
out=${OUT:-/tmp}
nvcc --version | tail -1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
nvcc -O3 -arch=sm_90 -o "$out/q4k_group" q4k_group.cu
status=0
for c in cases/*.case; do
  echo "== $c"
  "$out/q4k_group" "$c" "${COPIES:-200}" || status=1
done
exit $status
