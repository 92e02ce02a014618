#!/usr/bin/env bash
# Prints the machine's read bandwidth with OMP_NUM_THREADS threads (default 2): docs/BENCHMARKS.md's
# "bandwidth used" is a GGUF file's size x tok/s over this. `read-bandwidth.sh MiB` reads an array of that
# size instead of 2 GiB (one that fits in the last-level cache gives the bound of a model that does).
# Needs gcc with OpenMP and an AVX2 or AVX-512 CPU.
# `read-bandwidth.sh --build FILE` only builds the loop, as FILE, for callers that run it many times
# (scripts/shapes_table.py, twice per file and round).
set -euo pipefail
cd "$(dirname "$0")"
isa=-mavx2
grep -qw avx512f /proc/cpuinfo && isa=-mavx512f
if [ "${1:-}" = --build ]; then
  bin=$2
else
  bin=$(mktemp)
  trap 'rm -f "$bin"' EXIT
fi
gcc -O3 "$isa" -fopenmp read-bandwidth.c -o "$bin"
[ "${1:-}" = --build ] && exit 0
OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$bin" "$@"
