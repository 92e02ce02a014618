#!/usr/bin/env python3
"""Renders the measured tables of README.md and docs/BENCHMARKS.md from the records in docs/results.

Every table of measurements in those files sits between two markers and is written by this script from
one record (or, for the README's results table, from one CPU kind's records), so that a number cannot
differ between the two files or from its record:

    <!-- table KIND/RECORD VIEW -->        a shapes record (compare-llamacpp.py --shapes --json):
    ...                                    VIEW is A (plain decoding), B (block cost) or C (loading);
    <!-- /table -->                        a Spec-Bench run folder (probespec bench --out): VIEW is groups;
                                           a serve-load record (serve-load.py --json): VIEW is load, or
                                           batch (serve-batch.sh: tokens/s by clients, per server)
    <!-- table KIND readme -->             the README's results table: KIND/shapes.json's plain decoding
                                           and KIND/spec-bench-*-gguf's methods

Usage: scripts/results-tables.py          rewrite the tables in place
       scripts/results-tables.py --check  exit 1, naming the table, where a file differs from its records
       (--root DIR: the docs of another copy of the repository, as tests/docs.rs uses)
"""
import json, os, re, statistics, sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = sys.argv[sys.argv.index("--root") + 1] if "--root" in sys.argv else os.path.dirname(HERE)
RESULTS = os.path.join(ROOT, "docs", "results")
FILES = ["README.md", "docs/BENCHMARKS.md"]
MARKER = re.compile(r"(<!-- table (\S+) (\S+) -->\n)(.*?)(<!-- /table -->)", re.S)
GROUPS = ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]
GROUP_NAMES = ["MT-bench", "translation", "summarisation", "QA", "math", "RAG"]
METHODS = ["pld", "hybrid", "lookahead", "esp"]
# The CPU of each kind's folder, as the README's results table names it (a record says only "AMD EPYC").
KINDS = {
    "zen3-avx2": "AMD EPYC Zen 3 (AVX2, no VNNI)",
    "zen4-avx512": "AMD EPYC Zen 4 (AVX-512 VNNI)",
    "zen5-avx512": "AMD EPYC Zen 5 (AVX-512 VNNI)",
    "xeon-amx": "Intel Xeon (AVX-512 VNNI, AMX)",
}
sys.path.insert(0, HERE)
import shapes_table  # noqa: E402  (the same renderers compare-llamacpp.py prints with)


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def quartiles(xs):
    """The 25th and 75th percentiles (inclusive method: defined for any number of values)."""
    if len(xs) < 2:
        return (xs[0], xs[0]) if xs else (float("nan"),) * 2
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def load_json(path):
    with open(path) as f:
        return json.load(f)


def provenance_line(p, extra=""):
    """Where a record came from: date, commit, CPU and the command that reproduces it."""
    feats = ", ".join(p.get("cpu_features", []))
    cpu = f"{p.get('cpu', '?')} ({feats})" if feats else p.get("cpu", "?")
    line = f"Measured {p['date'][:10]}, commit {p['repo_commit']}, {cpu}{extra}."
    if p.get("command"):
        line += f" Command: `{p['command']}`."
    return line


# --- shapes records (compare-llamacpp.py --shapes --json) ---------------------------------------------

def shapes_view(path, view):
    rec = load_json(path)
    p = rec["provenance"]
    rounds = p.get("rounds") or max(len(x.get("lc_tps") or x.get("lc_load") or [0]) for x in rec["shapes"].values())
    amx = ", against llama.cpp built with AMX" if p.get("llamacpp_amx") else ""
    table = shapes_table.TABLES[view](rec["shapes"], rounds, rec.get("threads", 2))
    return provenance_line(p, amx) + "\n\n" + table


def round_ratios(x):
    """probespec's tok/s over llama.cpp's, round by round (both ran in the same round)."""
    return [p / l for l, p in zip(x["lc_tps"], x["ps_tps"])]


# --- Spec-Bench run folders (probespec bench --out) ---------------------------------------------------

def bench_run(folder):
    """(settings, last invocation, summary, per-question speed-ups: config -> group -> [ratio])."""
    run = load_json(os.path.join(folder, "run.json"))
    summary = load_json(os.path.join(folder, "summary.json"))
    per = {}
    with open(os.path.join(folder, "records.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            k = per.setdefault((r["config"], r["question_id"]), {"group": r["group"], "tokens": 0, "wall": 0.0,
                                                                 "turns": 0, "of": r["turns"]})
            k["tokens"] += r["new_tokens"]
            k["wall"] += r["wall_seconds"]
            k["turns"] += 1
    ratios = {}
    for (config, qid), k in per.items():
        base = per.get(("ar", qid))
        if config == "ar" or not base or k["turns"] != k["of"] or base["turns"] != base["of"]:
            continue
        ratio = (k["tokens"] / k["wall"]) / (base["tokens"] / base["wall"])
        ratios.setdefault(config, {}).setdefault(k["group"], []).append(ratio)
    return run["settings"], run["invocations"][-1], summary, ratios


def method_of(config):
    return config.split("-")[0]


def bench_provenance(inv):
    return {"date": inv["date"], "repo_commit": inv["git_commit"], "cpu": inv["cpu"],
            "command": "probespec " + inv["command"].split("probespec ", 1)[-1].split(" --out ")[0]}


def groups_view(folder, view):
    settings, inv, summary, ratios = bench_run(folder)
    weights = "f32 weights (--dequantize)" if settings.get("dequantize") or "--dequantize" in inv["command"] \
        else "GGUF weights"
    n = next(c for c in summary["configs"] if c["config"] == "ar")["groups"]["overall"]["questions"]
    head = (provenance_line(bench_provenance(inv)) + f" {settings['max_new_tokens']} new tokens, {weights}, "
            f"{n} questions.")
    lines = [head, "",
             "| method | " + " | ".join(GROUP_NAMES) + " | overall | speed.py | plain steps | mismatches |",
             "|---|" + "---|" * (len(GROUPS) + 4)]
    for c in summary["configs"]:
        if c["config"] == "ar":
            continue
        r = ratios.get(c["config"], {})
        cells = []
        for g in GROUPS:
            s = c["groups"].get(g)
            cells.append(f"{s['tau']:.2f} / {med(r.get(g, [])):.2f}x" if s else "-")
        every = [x for g in GROUPS for x in r.get(g, [])]
        lo, hi = quartiles(every)
        o = c["groups"]["overall"]
        lines.append(f"| {c['config']} | " + " | ".join(cells) +
                     f" | {o['tau']:.2f} / {med(every):.2f}x ({lo:.2f}-{hi:.2f}) | {o['speedup']:.2f}x | "
                     f"{c.get('plain_share', float('nan')):.0%} | {o['mismatches']} |")
    return "\n".join(lines)


# --- serve-load records (serve-load.py --json, one line per server run) --------------------------------

def load_view(path, view):
    with open(path) as f:
        runs = [json.loads(line) for line in f if line.strip()]
    meta = next((r for r in runs if "provenance" in r), None)
    runs = [r for r in runs if "label" in r]
    lines = [provenance_line(meta["provenance"]) if meta else "", "",
             "| server | clients | requests/s | latency p50 / p99 (s) | time to first token p50 / p99 (s) | "
             "answers that differ |", "|---|---|---|---|---|---|"]
    for r in runs:
        differ = f"{r['mismatches']} of {r['requests']}" if r.get("mismatches") is not None else "n/a"
        lines.append(f"| {r['label']} | {r['clients']} | {r['requests_per_s']:.2f} | {r['latency_p50_s']:.2f} / "
                     f"{r['latency_p99_s']:.2f} | {r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f} | {differ} |")
    return "\n".join(lines).lstrip("\n")


def batch_view(path, view):
    with open(path) as f:
        runs = [json.loads(line) for line in f if line.strip()]
    meta = next((r for r in runs if "provenance" in r), None)
    runs = [r for r in runs if "label" in r]
    one = {r["label"]: r["tokens_per_s"] for r in runs if r["clients"] == 1 and r.get("tokens_per_s")}
    lines = [provenance_line(meta["provenance"]) if meta else "", "",
             "| server | clients | tokens/s | over 1 client | latency p50 / p99 (s) | "
             "time to first token p50 (s) | mismatches |", "|---|---|---|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: (r["label"], r["clients"])):
        tps = r.get("tokens_per_s")
        base = one.get(r["label"])
        over = f"{tps / base:.2f}x" if tps and base else "n/a"
        differ = r.get("mismatches", "n/a")
        lines.append(f"| {r['label']} | {r['clients']} | {tps:.1f} | {over} | {r['latency_p50_s']:.2f} / "
                     f"{r['latency_p99_s']:.2f} | {r['ttft_p50_s']:.2f} | {differ} |")
    return "\n".join(lines).lstrip("\n")


# --- the README's results table -----------------------------------------------------------------------

def readme_view(kind):
    folder = os.path.join(RESULTS, kind)
    shapes = load_json(os.path.join(folder, "shapes.json"))
    runs = {}
    for tokens in (64, 256):
        path = os.path.join(folder, f"spec-bench-{tokens}-gguf")
        if os.path.isdir(path):
            runs[tokens] = bench_run(path)
    dates = {shapes["provenance"]["date"][:10]} | {r[1]["date"][:10] for r in runs.values()}
    commits = [shapes["provenance"]["repo_commit"]] + [r[1]["git_commit"] for r in runs.values()]
    commits = sorted(set(commits), key=commits.index)
    p = shapes["provenance"]
    feats = ", ".join(p.get("cpu_features", []))
    cpu = KINDS.get(kind, f"{p['cpu']} ({feats})")
    lines = [f"{cpu}, 2 threads; {', '.join(sorted(dates))}; commit {', '.join(commits)}. "
             "Plain decoding: probespec's tok/s over llama.cpp's `llama-bench` on the same file, median of "
             f"{p['rounds']} interleaved rounds (range of the rounds' ratios). Methods: median speed-up over "
             "plain decoding per Spec-Bench question, "
             + " / ".join(f"{t}" for t in runs) + " new tokens, under `--bc auto` (25th-75th percentiles).", "",
             "| model (GGUF) | plain decoding against llama.cpp | " + " | ".join(METHODS) + " |",
             "|---|---|" + "---|" * len(METHODS)]
    for i, (name, x) in enumerate(shapes["shapes"].items()):
        rr = round_ratios(x)
        plain = f"{med(x['ps_tps']) / med(x['lc_tps']):.2f}x ({min(rr):.2f}-{max(rr):.2f})"
        cells = []
        for m in METHODS:
            parts = []
            for tokens, (_, _, summary, ratios) in runs.items():
                config = next((c for c in ratios if method_of(c) == m), None)
                every = [v for g in ratios.get(config, {}).values() for v in g]
                if i == 0 and every:
                    lo, hi = quartiles(every)
                    parts.append(f"{med(every):.2f}x ({lo:.2f}-{hi:.2f})")
            cells.append(" / ".join(parts) if parts else "")
        shown = name.replace(" (random weights)", ", random weights")
        lines.append(f"| {shown} | {plain} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render(source, view):
    if view == "readme":
        return readme_view(source)
    path = os.path.join(RESULTS, source)
    if view in shapes_table.TABLES:
        return shapes_view(path, view)
    if view == "groups":
        return groups_view(path, view)
    if view == "load":
        return load_view(path, view)
    if view == "batch":
        return batch_view(path, view)
    sys.exit(f"unknown table view {view!r} for {source}")


def main():
    check = "--check" in sys.argv[1:]
    stale = []
    for rel in FILES:
        path = os.path.join(ROOT, rel)
        text = open(path).read()

        def fill(m):
            body = render(m.group(2), m.group(3)) + "\n"
            if body != m.group(4):
                stale.append(f"{rel}: table {m.group(2)} {m.group(3)}")
            return m.group(1) + body + m.group(5)
        new = MARKER.sub(fill, text)
        if not check and new != text:
            with open(path, "w") as f:
                f.write(new)
    if check and stale:
        print("tables that differ from their records (scripts/results-tables.py rewrites them):", file=sys.stderr)
        for s in stale:
            print(f"  {s}", file=sys.stderr)
        sys.exit(1)
    if not check:
        for s in stale:
            print(f"rewrote {s}")


if __name__ == "__main__":
    main()
