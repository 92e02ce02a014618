#!/usr/bin/env bash
# Builds the `cuda` binary on a machine without a GPU or system CUDA, from NVIDIA's PyPI wheels (CUDA 13.0,
# sm_90a PTX for H100/H200), as ../shared/docs/CUDA.md describes. Checked on 2026-11-29: builds in about
# 11 minutes on 2 cores into target-cuda/release/probespec (66 MB unstripped). At run time the binary needs
# the driver's libcuda.so.1 and libcublas/libcublasLt/libcudart .so.13, libcurand .so.10 (LD_LIBRARY_PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
toolkit=${CUDA_WHEELS_SCRIPT:-../shared/tools/cuda-toolkit-from-wheels.sh}
[ -x "$toolkit" ] || { echo "toolkit script not found at $toolkit (set CUDA_WHEELS_SCRIPT)" >&2; exit 1; }
cargo fetch
exports=$("$toolkit" | tail -1)
eval "$exports"
CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target-cuda} cargo build --release --features cuda
