#!/usr/bin/env bash
# aarch64 under emulation: cross-builds the test binaries for aarch64-unknown-linux-gnu and runs them under
# qemu-user, once per CPU model: the kernels' bit-identity and row-invariance tests (every variant the
# emulated CPU has against the portable code) and the GGUF lossless tests (tiny LLaMA and Qwen 3 models in
# every block format, 8-bit and f32 activations: row-invariant logits, ESP, PLD and the hybrid token-identical
# to plain decoding, on the variant the CPU picks, and once more on `max` with the portable kernels forced
# by PROBESPEC_ISA); with FULL=1, on the last CPU the whole of
# tests/lossless.rs (every method in every configuration, f32 weights: 15-25 minutes more under qemu).
# Emulation checks the bits, never the speed. Installs what is missing: the Rust target (rustup), the
# cross linker and qemu (apt).
#   scripts/test-aarch64.sh            (env: CPUS, the qemu CPU models; FULL=1)
# CPUS: cortex-a53 (ARMv8.0: NEON only), neoverse-n1 (ARMv8.2: + dot product), max (+ i8mm, SVE).
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=aarch64-unknown-linux-gnu
CPUS=${CPUS:-cortex-a53 max neoverse-n1}
FULL=${FULL:-0}

rustup target list --installed | grep -qx "$TARGET" || rustup target add "$TARGET"
if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64-static >/dev/null; then
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  $SUDO apt-get install -y gcc-aarch64-linux-gnu qemu-user-static >/dev/null ||
    { $SUDO apt-get update >/dev/null && $SUDO apt-get install -y gcc-aarch64-linux-gnu qemu-user-static >/dev/null; }
fi
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc
export CXX_aarch64_unknown_linux_gnu=aarch64-linux-gnu-g++

cargo test --release --target "$TARGET" --lib --test lossless --no-run
last=${CPUS##* }
for cpu in $CPUS; do
  echo "== aarch64, qemu -cpu $cpu"
  export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64-static -cpu $cpu -L /usr/aarch64-linux-gnu"
  cargo test --release --target "$TARGET" --lib -- kernels::
  if [ "$FULL" = 1 ] && [ "$cpu" = "$last" ]; then
    cargo test --release --target "$TARGET" --test lossless
  else
    cargo test --release --target "$TARGET" --test lossless -- gguf
  fi
done
# The portable kernels forced on a CPU that has better ones (kernels::isa::ISA_ENV).
echo "== aarch64, qemu -cpu max, PROBESPEC_ISA=portable"
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64-static -cpu max -L /usr/aarch64-linux-gnu"
PROBESPEC_ISA=portable cargo test --release --target "$TARGET" --test lossless -- gguf
