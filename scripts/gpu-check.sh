#!/usr/bin/env bash
# The GPU check. Runs the same steps on a CUDA device or on the CPU; only the device differs:
#   scripts/gpu-check.sh [--device cuda]   ON a GPU machine (the `device` tool's H200: no Rust, no network
#                                          there), from the repo root, with .device/bundle.tar.xz made here
#                                          by `scripts/build-cuda.sh --bundle` carried along;
#   scripts/gpu-check.sh --device cpu      anywhere with cargo: the test binaries are built here, and the
#                                          CPU takes a GPU device's code path (PROBESPEC_OPS=candle:
#                                          candle's ops, keys kept as rows, attention as two products and a
#                                          softmax, GGUF quantised weights through candle's quantised
#                                          matmul). `make test` runs it after the test suite.
# Steps, with PROBESPEC_OPS=candle and PROBESPEC_TEST_DEVICE set to the device on both:
#   1. the lossless tests (tests/lossless.rs: every drafter against plain greedy decoding, tiny random
#      LLaMA and Qwen 3 checkpoints written by the test) in f32, but for the GGUF ones, which test the CPU
#      kernels on the CPU whatever the device;
#   2. half precision (tests/half.rs): how often candle's ops in bf16 / f16 leave each method
#      token-identical to plain decoding (printed, lines starting DIVERGENCE), and that they round by block
#      size; on the CPU also that the row-invariant products are token-identical;
#   3. the same lossless and half-precision tests with the row-invariant products (PROBESPEC_OPS=exact:
#      on CUDA src/kernels/cuda/exact.cu, unproven until this runs on a GPU), which must be bit-exact;
#   4. `probespec cost` with random bf16 weights, candle's ops and the row-invariant ones: LLaMA 3.1 8B and
#      Qwen 3 8B shapes on CUDA, SmolLM2-135M's on the CPU (one decoding step of 1..64 rows after 256 /
#      1024 cached tokens, its ratio to one row).
#   On the CPU also the chat and sampling suites (tests/chat.rs, tests/sampling.rs) through that path.
# Results: $OUT (the device tool's output folder) or ./gpu-check-out. About 5 minutes on an H200.
set -uo pipefail
cd "$(dirname "$0")/.."
device=cuda
if [ "${1:-}" = "--device" ]; then
  device=${2:-}
  shift 2
fi
case "$device" in
  cuda | cpu) ;;
  *) echo "usage: scripts/gpu-check.sh [--device cuda|cpu]" >&2; exit 2 ;;
esac
out=${OUT:-gpu-check-out}
mkdir -p "$out"
export PROBESPEC_OPS=candle PROBESPEC_TEST_DEVICE=$device

# The binaries: probespec and the test binaries, from the bundle on CUDA, built by cargo on the CPU.
declare -A bin
if [ "$device" = cuda ]; then
  work=$(mktemp -d)
  tar -C "$work" -xJf .device/bundle.tar.xz || { echo "no .device/bundle.tar.xz: run scripts/build-cuda.sh --bundle" >&2; exit 1; }
  for b in probespec lossless half; do bin[$b]=$work/$b; done
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
  if ldd "${bin[probespec]}" | grep "not found"; then
    echo "missing shared libraries (searched: $libdirs)" >&2
    exit 1
  fi
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
  shapes="llama3-8b qwen3-8b"
else
  cargo build --release --quiet || exit 1
  bin[probespec]=target/release/probespec
  tests=$(cargo test --release --test lossless --test half --test chat --test sampling --no-run \
    --message-format=json 2>/dev/null | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["target"]["name"], m["executable"])')
  while read -r name path; do bin[$name]=$path; done <<<"$tests"
  for b in lossless half chat sampling; do
    [ -x "${bin[$b]:-}" ] || { echo "test binary $b not built" >&2; exit 1; }
  done
  # The chat suite runs the probespec binary that cargo built for it.
  shapes="smollm2-135m"
fi
status=0
# Time limits: an H200 runs the tiny models' tests in a few seconds each; 2 shared CPU cores take up to
# 10-20 minutes for the whole check.
scale=1
[ "$device" = cpu ] && scale=4
step() { # name, log file, seconds allowed (on CUDA), command...
  local name=$1 log=$2 limit=$(($3 * scale)) start=$SECONDS
  shift 3
  echo "== $name"
  timeout "$limit" "$@" 2>&1 | tee "$out/$log"
  local rc=${PIPESTATUS[0]}
  echo "-- $name: exit $rc after $((SECONDS - start)) s" | tee -a "$out/times.txt"
  [ "$rc" = 0 ] || { echo "FAILED: $name" | tee -a "$out/failed.txt"; status=1; }
}
step "lossless tests on $device through the GPU path, f32" lossless.log 400 \
  "${bin[lossless]}" --test-threads 1 --skip gguf
step "half precision on $device: candle's ops' divergence" half.log 300 \
  "${bin[half]}" --test-threads 1 --nocapture candle_ops_in_half_precision_divergence_measured
# The row-invariant products (PROBESPEC_OPS=exact: on CUDA the kernels of src/kernels/cuda/exact.cu, on
# the CPU the f32 kernels on the dtype's values): every method bit-exact in f32, bf16 and f16.
step "lossless tests on $device, row-invariant products, f32" lossless-exact.log 400 \
  env PROBESPEC_OPS=exact "${bin[lossless]}" --test-threads 1 --skip gguf
step "half precision on $device, row-invariant products" half-exact.log 400 \
  env PROBESPEC_OPS=exact "${bin[half]}" --test-threads 1 --nocapture in_half_precision_is_row_invariant \
  in_half_precision_are_row_invariant
if [ "$device" = cpu ]; then
  # The terminal tests run the default SmolLM2 model, whose cost curve is timed first on this path.
  step "chat tests through the GPU path" chat.log 150 "${bin[chat]}" --test-threads 1
  step "sampling tests through the GPU path" sampling.log 150 "${bin[sampling]}" --test-threads 1
fi
grep -h '^DIVERGENCE' "$out/half.log" >"$out/divergence.txt"
for shape in $shapes; do
  rows=1,2,4,8,16,32,64 cache=256,1024 repeats=5
  [ "$device" = cpu ] && { rows=1,2,4,8 cache=256 repeats=2; }
  for ops in candle exact; do
    step "cost curve, $shape, random bf16 weights, $ops ops" "cost-$shape-$ops.txt" 150 \
      env PROBESPEC_OPS=$ops "${bin[probespec]}" cost --shape "$shape" --device "$device" --dtype bf16 \
      --rows "$rows" --cache "$cache" --repeats "$repeats"
  done
done
echo "== summary ($device)"
cat "$out/divergence.txt"
[ "$status" = 0 ] && echo "gpu-check on $device: passed" || echo "gpu-check on $device: FAILED (see $out/failed.txt)"
exit $status
