#!/usr/bin/env python3
"""A long prompt arriving while other requests decode, against an OpenAI-compatible server.

First the long prompt's time to first token alone (idle). Then D clients stream answers (greedy,
ignore_eos, max_tokens M); once each has had a few tokens another long prompt of the same length
arrives. Reports its time to first token over the idle one, and the gaps between two chunks of text of
the decoding clients while it went in (what a reader of those streams notices): the longest, and the
median over the clients of each one's longest (a slow step shows in every client's). Standard library only;
one JSON line on stdout.

  scripts/serve-long-prompt.py --url http://127.0.0.1:8080 --label "probespec --parallel 8"
"""

import argparse
import json
import random
import statistics
import threading
import time
import urllib.request

WORDS = ("river stone light garden paper window music winter table cloud orange silver market "
         "engine letter forest bridge candle harbor meadow violin planet copper lantern").split()


def long_prompt(words, seed):
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def stream(url, body, on_chunk):
    """Posts a streamed completion request; calls on_chunk(time) for every chunk with text."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(dict(body, stream=True)).encode(),
                                 headers={"Content-Type": "application/json"})
    usage = None
    with urllib.request.urlopen(req, timeout=3600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any(c.get("text") for c in chunk.get("choices", [])):
                on_chunk(time.monotonic())
    return usage


def first_token_seconds(url, prompt):
    t0 = time.monotonic()
    firsts = []
    usage = stream(url, {"model": "default", "prompt": prompt, "max_tokens": 4, "temperature": 0,
                         "stream_options": {"include_usage": True}}, firsts.append)
    return firsts[0] - t0, (usage or {}).get("prompt_tokens")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--label", default="server")
    ap.add_argument("--decoders", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, default=256, help="each decoding client's answer")
    ap.add_argument("--words", type=int, default=1800, help="words of the long prompt (about 2,000 tokens)")
    a = ap.parse_args()

    idle, prompt_tokens = first_token_seconds(a.url, long_prompt(a.words, 1))
    times = [[] for _ in range(a.decoders)]
    usages = [None] * a.decoders
    threads = []

    def decode(i):
        body = {"model": "default", "prompt": f"Story number {i}: once upon a time", "max_tokens": a.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
        usages[i] = stream(a.url, body, times[i].append)

    for i in range(a.decoders):
        t = threading.Thread(target=decode, args=(i,))
        t.start()
        threads.append(t)
    while min(len(t) for t in times) < 3:
        time.sleep(0.01)
    start = time.monotonic()
    busy, _ = first_token_seconds(a.url, long_prompt(a.words, 2))
    end = start + busy
    for t in threads:
        t.join()
    gaps, gaps_during, late, longest = [], [], [], []
    for ts in times:
        during = []
        for x, y in zip(ts, ts[1:]):
            gaps.append(y - x)
            if y > start and x < end:
                during.append(y - x)
                if y - x > 0.5:
                    late.append(round((x - start) / (end - start), 2))
        gaps_during += during
        longest.append(max(during, default=0.0))
    short = [len(ts) for ts in times if len(ts) < 2 or ts[-1] < end]
    print(json.dumps({
        "label": a.label, "decoders": a.decoders, "prompt_tokens": prompt_tokens,
        "idle_first_token_s": round(idle, 3), "busy_first_token_s": round(busy, 3),
        "busy_over_idle": round(busy / idle, 2),
        "max_gap_while_prefilling_s": round(max(gaps_during, default=float("nan")), 3),
        "median_gap_while_prefilling_s": round(statistics.median(gaps_during), 3) if gaps_during else None,
        "median_gap_s": round(statistics.median(gaps), 3),
        # A slow step delays every decoding client; a gap that one client alone sees is its text held back
        # (below): the median over the clients of each one's longest gap is the slowest step they shared.
        "median_longest_gap_s": round(statistics.median(longest), 3) if longest else None,
        "gaps_over_half_a_second": len(late), "where_in_the_prefill": sorted(set(late)),
        "decoders_done_before_the_prompt": len(short),
        # A token whose text is not whole UTF-8 yet comes in the next token's chunk: its gap spans two.
        "tokens_without_a_chunk": sum((u or {}).get("completion_tokens", 0) for u in usages) - sum(map(len, times)),
    }))


if __name__ == "__main__":
    main()
