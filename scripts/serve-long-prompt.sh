#!/usr/bin/env bash
# A long prompt arriving while 7 requests stream (scripts/serve-long-prompt.py), against
# `probespec serve --parallel 8` with its prefill chunk (auto) and without one (0: a prompt goes in whole
# between steps), and against `llama-server -np 8`, on the same GGUF (default: the Llama-3.2-1B shape in
# Q4_K_M that scripts/real-shapes.sh writes), greedy, plain decoding.
#   scripts/serve-long-prompt.sh [OUT_DIR]   (env: GGUF, THREADS, WORDS, MAX_TOKENS)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-serve-long-prompt-out}
mkdir -p "$OUT"
GGUF=${GGUF:-$HOME/.cache/probespec/shapes/llama3.2-1b.q4_k_m.gguf}
THREADS=${THREADS:-2}
WORDS=${WORDS:-1800}
MAX_TOKENS=${MAX_TOKENS:-400}
LLAMA_SERVER=${LLAMA_SERVER:-$HOME/.cache/llamacpp-tools/bin/llama-server}
PROBESPEC=target/release/probespec

[ -f "$GGUF" ] || { echo "no model at $GGUF: run scripts/real-shapes.sh (or set GGUF)" >&2; exit 1; }
[ -x "$PROBESPEC" ] || cargo build --release
[ -x "$LLAMA_SERVER" ] || { echo "no llama-server at $LLAMA_SERVER: run scripts/llamacpp-tools.sh" >&2; exit 1; }

python3 scripts/provenance.py "$OUT/results.jsonl" "GGUF=$GGUF THREADS=$THREADS WORDS=$WORDS MAX_TOKENS=$MAX_TOKENS scripts/serve-long-prompt.sh"

run() { # label port log -- server command...
  local label=$1 port=$2 log=$3; shift 4
  "$@" >"$log" 2>&1 &
  local pid=$!
  for _ in $(seq 900); do curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break; sleep 0.2; done
  python3 scripts/serve-long-prompt.py --url "http://127.0.0.1:$port" --label "$label" --words "$WORDS" \
    --max-tokens "$MAX_TOKENS" | tee -a "$OUT/results.jsonl" || true
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

for chunk in auto 0; do
  run "probespec serve --parallel 8 --prefill-chunk $chunk" 18092 "$OUT/probespec-$chunk.log" -- \
    env RAYON_NUM_THREADS="$THREADS" "$PROBESPEC" serve --port 18092 --model "$GGUF" --method ar --parallel 8 \
    --prefill-chunk "$chunk"
done
run "llama-server -np 8" 18093 "$OUT/llama-server.log" -- \
  "$LLAMA_SERVER" -m "$GGUF" --port 18093 -t "$THREADS" -np 8 -c 32768 --no-webui
