#!/usr/bin/env bash
# The GPU check, run ON a GPU machine (the `device` tool's H200: no Rust, no network there), from the repo
# root, with .device/bundle.tar.xz made here by `scripts/build-cuda.sh --bundle` carried along:
#   1. the lossless tests (tests/lossless.rs: every drafter against plain greedy decoding, tiny random
#      LLaMA and Qwen 3 checkpoints written by the test) on CUDA, in f32;
#   2. `probespec cost` for LLaMA 3.1 8B and Qwen 3 8B shapes with random bf16 weights created on the GPU:
#      one decoding step (block of 1..64 rows after 256 / 1024 cached tokens) and its ratio to one row.
# Results: $OUT (the device tool's output folder) or ./gpu-check-out. About 5 minutes on an H200.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-check-out}
mkdir -p "$out"
work=$(mktemp -d)
tar -C "$work" -xJf .device/bundle.tar.xz || { echo "no .device/bundle.tar.xz: run scripts/build-cuda.sh --bundle" >&2; exit 1; }
# CUDA 13 runtime libraries: the machine's PyTorch wheels carry them; the driver's libcuda is under
# /usr/local/nvidia there.
libdirs=$(python3 - <<'PY'
import glob, os, site, sys
names = ["libcublas.so.13", "libcublasLt.so.13", "libcudart.so.13", "libcurand.so.10", "libcuda.so.1"]
dirs = set()
for root in site.getsitepackages() + [sys.prefix, "/usr/local/cuda", "/usr/local/nvidia"]:
    for n in names:
        dirs.update(os.path.dirname(p) for p in glob.glob(os.path.join(root, "**", n), recursive=True))
print(":".join(sorted(dirs)))
PY
)
export LD_LIBRARY_PATH="$libdirs:${LD_LIBRARY_PATH:-}"
if ldd "$work/probespec" | grep "not found"; then
  echo "missing shared libraries (searched: $libdirs)" >&2
  exit 1
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
status=0
echo "== lossless tests on CUDA"
PROBESPEC_TEST_DEVICE=cuda timeout 240 "$work/lossless" --test-threads 1 2>&1 | tee "$out/lossless.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
for shape in llama3-8b qwen3-8b; do
  echo "== cost curve, $shape, random bf16 weights"
  timeout 150 "$work/probespec" cost --shape "$shape" --device cuda --dtype bf16 \
    --rows 1,2,4,8,16,32,64 --cache 256,1024 --repeats 5 2>&1 | tee "$out/cost-$shape.txt"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
done
exit $status
