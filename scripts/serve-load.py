#!/usr/bin/env python3
"""A bounded load run against an OpenAI-compatible server (probespec serve, llama-server, ...).

N concurrent clients each send R streamed chat requests (greedy, max_tokens M) on loopback; reports
requests/s, completion tokens/s (from the servers' usage), p50/p99 latency and time to first token, and checks every answer: against the one-shot
CLI's (--cli: `probespec --json` on the same prompt) or against a saved run of the same server
(--check FILE, written by --save FILE). Standard library only.

  scripts/serve-load.py --url http://127.0.0.1:8080 --cli target/release/probespec --label probespec
  scripts/serve-load.py --url http://127.0.0.1:8081 --save /tmp/plain.json --label llama-server
  scripts/serve-load.py --url http://127.0.0.1:8081 --check /tmp/plain.json --label "llama-server ngram"
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

# Short tasks of the kinds Spec-Bench mixes: questions, and rewriting or extracting from a given text (what
# lookup speculation drafts from).
PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Explain in two sentences what a compiler does.",
    "Write a haiku about the sea.",
    "What is 17 times 23?",
    "Give me a synonym for 'happy'.",
    "Why is the sky blue? Answer briefly.",
    "List the days of the week.",
    "Translate 'good morning' into Spanish.",
    "What does HTTP stand for?",
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog.",
    "Rewrite in the past tense: I walk to the store and buy some bread.",
    "Summarize: The meeting was moved from Monday to Wednesday because the manager was travelling.",
    "Extract the names: Alice met Bob and Carol at the station in Paris.",
    "Correct the spelling: I recieved the pakage yesterday.",
    "Copy this list in reverse order: apple, banana, cherry, date.",
    "Turn into a question: The train leaves at noon.",
    "What is the boiling point of water in Celsius?",
    "Write one sentence about autumn.",
    "Who wrote Romeo and Juliet?",
]


def percentile(values, q):
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def one_request(url, prompt, max_tokens, extra):
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body.update(extra)
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    ttft = None
    text = []
    tokens = None
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk.get("usage"):
                tokens = chunk["usage"].get("completion_tokens", tokens)
            for c in chunk.get("choices", []):
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
    return "".join(text), ttft, time.perf_counter() - t0, tokens


def cli_answers(cli, prompts, max_tokens, cli_args):
    out = {}
    for p in prompts:
        r = subprocess.run(
            [cli, "--json", "--max-new-tokens", str(max_tokens), *cli_args, p],
            capture_output=True,
            text=True,
            check=True,
        )
        out[p] = json.loads(r.stdout)["text"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=20, help="per client")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--label", default="server")
    ap.add_argument("--cli", help="probespec binary: check every answer against its one-shot answer")
    ap.add_argument("--cli-args", default="", help="extra CLI flags (the server's model flags)")
    ap.add_argument("--save", help="write the answers (prompt -> text) to this file")
    ap.add_argument("--check", help="check every answer against answers saved by --save")
    ap.add_argument("--extra-body", default="{}", help="JSON merged into every request body")
    ap.add_argument("--spec-bench", action="store_true",
                    help="the first turns of the bundled Spec-Bench questions instead of the short tasks")
    a = ap.parse_args()
    extra = json.loads(a.extra_body)
    if a.spec_bench:
        questions = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "spec_bench",
                                 "question.jsonl")
        with open(questions) as f:
            PROMPTS[:] = [json.loads(line)["turns"][0] for line in f if line.strip()]

    # One warm-up request (model caches, cost curves) outside the measurement.
    one_request(a.url, PROMPTS[0], a.max_tokens, extra)

    results, errors = [], []
    lock = threading.Lock()

    def client(i):
        for j in range(a.requests):
            prompt = PROMPTS[(i * a.requests + j) % len(PROMPTS)]
            try:
                text, ttft, latency, tokens = one_request(a.url, prompt, a.max_tokens, extra)
                with lock:
                    results.append((prompt, text, ttft, latency, tokens))
            except Exception as e:  # noqa: BLE001 - every failure is reported
                with lock:
                    errors.append(f"{prompt!r}: {e}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0

    reference = None
    if a.cli:
        reference = cli_answers(a.cli, sorted({r[0] for r in results}), a.max_tokens, a.cli_args.split())
    elif a.check:
        with open(a.check) as f:
            reference = json.load(f)
    answers = {}
    mismatches = 0
    for prompt, text, *_ in results:
        # An answer that differs from the same prompt's first answer in the run, or from the reference.
        differs = answers.setdefault(prompt, text) != text
        if reference is not None and reference.get(prompt) != text:
            differs = True
        mismatches += differs
    if a.save:
        with open(a.save, "w") as f:
            json.dump(answers, f, indent=1)

    latencies = [r[3] for r in results]
    ttfts = [r[2] for r in results if r[2] is not None]
    counted = [r[4] for r in results if r[4] is not None]
    tokens = sum(counted) if len(counted) == len(results) else None
    summary = {
        "label": a.label,
        "clients": a.clients,
        "requests": len(results),
        "errors": len(errors),
        "max_tokens": a.max_tokens,
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(results) / wall, 2),
        # Every answer's completion tokens (the servers' usage), over the run's wall time.
        "tokens_per_s": round(tokens / wall, 2) if tokens is not None else None,
        "latency_p50_s": round(percentile(latencies, 0.5), 3),
        "latency_p99_s": round(percentile(latencies, 0.99), 3),
        "ttft_p50_s": round(percentile(ttfts, 0.5), 3),
        "ttft_p99_s": round(percentile(ttfts, 0.99), 3),
        "checked_against": "cli" if a.cli else (a.check or "none"),
        "mismatches": mismatches,
    }
    print(json.dumps(summary))
    for e in errors[:5]:
        print("error:", e, file=sys.stderr)
    sys.exit(1 if errors or mismatches else 0)


if __name__ == "__main__":
    main()
