#!/usr/bin/env bash
# Builds the `cuda` binary on a machine without a GPU or system CUDA, from NVIDIA's PyPI wheels (CUDA 13.0,
# sm_90a PTX for H100/H200), with the toolkit that scripts/cuda-toolkit-from-wheels.sh assembles. Checked on 2026-11-29: builds in about
# 11 minutes on 2 cores into target-cuda/release/probespec (66 MB unstripped). At run time the binary needs
# the driver's libcuda.so.1 and libcublas/libcublasLt/libcudart .so.13, libcurand .so.10 (LD_LIBRARY_PATH).
#
#   scripts/build-cuda.sh            the binary only
#   scripts/build-cuda.sh --bundle   also the CUDA build of the lossless and half-precision tests, all
#                                    stripped and packed into .device/bundle.tar.xz for
#                                    scripts/gpu-check.sh on a GPU machine
set -euo pipefail
cd "$(dirname "$0")/.."
toolkit=${CUDA_WHEELS_SCRIPT:-scripts/cuda-toolkit-from-wheels.sh}
[ -x "$toolkit" ] || { echo "toolkit script not found at $toolkit (set CUDA_WHEELS_SCRIPT)" >&2; exit 1; }
cargo fetch
exports=$("$toolkit" | tail -1)
eval "$exports"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target-cuda}
cargo build --release --features cuda
[ "${1:-}" = "--bundle" ] || exit 0

# The test binaries the check runs (tiny models written by the tests themselves; the device comes from
# PROBESPEC_TEST_DEVICE), located through cargo's JSON messages.
tests=$(cargo test --release --features cuda --test lossless --test half --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])')
stage=$(mktemp -d)
strip -o "$stage/probespec" "$CARGO_TARGET_DIR/release/probespec"
for name in lossless half; do
  path=$(awk -v n="$name" '$1 == n { print $2 }' <<<"$tests")
  [ -x "$path" ] || { echo "$name test binary not found" >&2; exit 1; }
  strip -o "$stage/$name" "$path"
done
mkdir -p .device
tar -C "$stage" -cJf .device/bundle.tar.xz probespec lossless half
rm -r "$stage"
ls -l .device/bundle.tar.xz
