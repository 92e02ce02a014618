#!/usr/bin/env bash
# The load run of docs/BENCHMARKS.md: scripts/serve-load.py (8 clients x 20 streamed requests, 32 tokens,
# greedy) against `probespec serve --parallel 1` (one request at a time) on the default GGUF, each answer
# checked against the one-shot CLI's;
# then, when llama.cpp's llama-server is there (scripts/llamacpp-tools.sh builds it), the same run against
# it on the same GGUF, plain and with each --spec-type ngram-* given in NGRAM_TYPES, each speculative run's
# answers checked against its plain run's.
#   scripts/serve-load.sh [OUT_DIR]     (env: CLIENTS, REQUESTS, MAX_TOKENS, THREADS, LLAMA_SERVER, NGRAM_TYPES)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-serve-load-out}
mkdir -p "$OUT"
CLIENTS=${CLIENTS:-8}
REQUESTS=${REQUESTS:-20}
MAX_TOKENS=${MAX_TOKENS:-32}
THREADS=${THREADS:-2}
GGUF=${GGUF:-$HOME/.cache/probespec/SmolLM2-135M-Instruct.Q4_1.gguf}
LLAMA_SERVER=${LLAMA_SERVER:-$HOME/.cache/llamacpp-tools/bin/llama-server}
NGRAM_TYPES=${NGRAM_TYPES:-ngram-simple ngram-map-k}
PROBESPEC=target/release/probespec
LOAD=(python3 scripts/serve-load.py --clients "$CLIENTS" --requests "$REQUESTS" --max-tokens "$MAX_TOKENS")

[ -f "$GGUF" ] || { echo "no model at $GGUF: run make model" >&2; exit 1; }
[ -x "$PROBESPEC" ] || cargo build --release

# Where the numbers come from: date, commit, CPU and the command (the first line of results.jsonl).
python3 scripts/provenance.py "$OUT/results.jsonl" "CLIENTS=$CLIENTS REQUESTS=$REQUESTS MAX_TOKENS=$MAX_TOKENS THREADS=$THREADS scripts/serve-load.sh"

wait_health() {
  for _ in $(seq 600); do
    curl -sf "$1/health" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  echo "the server at $1 did not come up" >&2
  return 1
}

run_server() { # label url log -- command...
  local label=$1 url=$2 log=$3; shift 4
  "$@" >"$log" 2>&1 &
  local pid=$!
  if wait_health "$url"; then
    "${LOAD[@]}" --url "$url" --label "$label" "${EXTRA[@]}" | tee -a "$OUT/results.jsonl" || true
  fi
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}

for method in hybrid pld ar; do
  EXTRA=(--cli "$PROBESPEC" "--cli-args=--model $GGUF --method $method")
  run_server "probespec serve --method $method" http://127.0.0.1:18080 "$OUT/probespec-$method.log" -- \
    env RAYON_NUM_THREADS="$THREADS" "$PROBESPEC" serve --port 18080 --model "$GGUF" --method "$method" --parallel 1
done

if [ -x "$LLAMA_SERVER" ]; then
  LS=("$LLAMA_SERVER" -m "$GGUF" --port 18081 -t "$THREADS" -c 4096 --no-webui)
  EXTRA=(--save "$OUT/llama-plain.json")
  run_server "llama-server" http://127.0.0.1:18081 "$OUT/llama-plain.log" -- "${LS[@]}"
  for t in $NGRAM_TYPES; do
    EXTRA=(--check "$OUT/llama-plain.json")
    run_server "llama-server --spec-type $t" http://127.0.0.1:18081 "$OUT/llama-$t.log" -- "${LS[@]}" --spec-type "$t"
  done
else
  echo "no llama-server at $LLAMA_SERVER (scripts/llamacpp-tools.sh builds it): peer runs skipped" >&2
fi
