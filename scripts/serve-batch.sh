#!/usr/bin/env bash
# Batched serving against llama.cpp's: scripts/serve-load.py at 1, 2, 4 and 8 concurrent clients against
# `probespec serve --parallel 8` and `llama-server -np 8` on the same GGUF (default: the Llama-3.2-1B shape
# in Q4_K_M that scripts/real-shapes.sh writes), greedy, plain decoding, the two servers alternating at
# each concurrency. Every run sends the same TOTAL requests (the same prompts), split over its clients.
# At 1 client `probespec serve --parallel 1` (one request at a time, the one-shot path) runs too: what
# the batch costs a lone request. probespec's answers at 1 client are checked against the one-shot CLI's
# and every later run against those; llama-server's against its own answers at 1 client (its answers
# change with what else is in the batch).
# SPEC_BENCH=1 sends the first turns of the bundled Spec-Bench questions instead of serve-load.py's short tasks.
#   scripts/serve-batch.sh [OUT_DIR]   (env: GGUF, CONCURRENCY, TOTAL, MAX_TOKENS, PARALLEL, THREADS, METHOD,
#   SPEC_BENCH)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-serve-batch-out}
mkdir -p "$OUT"
GGUF=${GGUF:-$HOME/.cache/probespec/shapes/llama3.2-1b.q4_k_m.gguf}
CONCURRENCY=${CONCURRENCY:-1 2 4 8}
TOTAL=${TOTAL:-24}
MAX_TOKENS=${MAX_TOKENS:-64}
PARALLEL=${PARALLEL:-8}
THREADS=${THREADS:-2}
METHOD=${METHOD:-ar}
SPEC_BENCH=${SPEC_BENCH:-}
LLAMA_SERVER=${LLAMA_SERVER:-$HOME/.cache/llamacpp-tools/bin/llama-server}
PROBESPEC=target/release/probespec

[ -f "$GGUF" ] || { echo "no model at $GGUF: run scripts/real-shapes.sh (or set GGUF)" >&2; exit 1; }
[ -x "$PROBESPEC" ] || cargo build --release
[ -x "$LLAMA_SERVER" ] || { echo "no llama-server at $LLAMA_SERVER: run scripts/llamacpp-tools.sh" >&2; exit 1; }

python3 scripts/provenance.py "$OUT/results.jsonl" "GGUF=$GGUF CONCURRENCY='$CONCURRENCY' TOTAL=$TOTAL MAX_TOKENS=$MAX_TOKENS PARALLEL=$PARALLEL THREADS=$THREADS METHOD=$METHOD${SPEC_BENCH:+ SPEC_BENCH=1} scripts/serve-batch.sh"

wait_health() {
  for _ in $(seq 900); do
    curl -sf "$1/health" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  echo "the server at $1 did not come up" >&2
  return 1
}

run() { # label port clients log -- server command...
  local label=$1 port=$2 clients=$3 log=$4; shift 5
  "$@" >"$log" 2>&1 &
  local pid=$!
  if wait_health "http://127.0.0.1:$port"; then
    python3 scripts/serve-load.py --url "http://127.0.0.1:$port" --label "$label" --clients "$clients" \
      --requests $((TOTAL / clients)) --max-tokens "$MAX_TOKENS" ${SPEC_BENCH:+--spec-bench} "${CHECK[@]}" \
      | tee -a "$OUT/results.jsonl" || true
  fi
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

PS=(env RAYON_NUM_THREADS="$THREADS" "$PROBESPEC" serve --port 18090 --model "$GGUF" --method "$METHOD"
    --queue 64)
LS=("$LLAMA_SERVER" -m "$GGUF" --port 18091 -t "$THREADS" -np "$PARALLEL" -c $((PARALLEL * 2048)) --no-webui)
for c in $CONCURRENCY; do
  if [ -f "$OUT/probespec-answers.json" ]; then
    CHECK=(--check "$OUT/probespec-answers.json")
  else
    CHECK=(--cli "$PROBESPEC" "--cli-args=--model $GGUF --method $METHOD" --save "$OUT/probespec-answers.json")
  fi
  run "probespec serve --parallel $PARALLEL" 18090 "$c" "$OUT/probespec-$c.log" -- "${PS[@]}" --parallel "$PARALLEL"
  if [ "$c" = 1 ]; then
    CHECK=(--check "$OUT/probespec-answers.json")
    run "probespec serve --parallel 1" 18090 1 "$OUT/probespec-alone.log" -- "${PS[@]}" --parallel 1
  fi
  if [ -f "$OUT/llama-answers.json" ]; then
    CHECK=(--check "$OUT/llama-answers.json")
  else
    CHECK=(--save "$OUT/llama-answers.json")
  fi
  run "llama-server -np $PARALLEL" 18091 "$c" "$OUT/llama-$c.log" -- "${LS[@]}"
done
