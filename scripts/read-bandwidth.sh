#!/usr/bin/env bash
# Prints the machine's read bandwidth with OMP_NUM_THREADS threads (default 2): docs/BENCHMARKS.md's
# "bandwidth used" is a GGUF file's size x tok/s over this. Needs gcc with OpenMP and an AVX2 or AVX-512 CPU.
set -euo pipefail
cd "$(dirname "$0")"
bin=$(mktemp)
trap 'rm -f "$bin"' EXIT
isa=-mavx2
grep -qw avx512f /proc/cpuinfo && isa=-mavx512f
gcc -O3 "$isa" -fopenmp read-bandwidth.c -o "$bin"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$bin"
