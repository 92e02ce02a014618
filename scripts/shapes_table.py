"""`compare-llamacpp.py --shapes`: probespec against llama.cpp per GGUF file, in interleaved rounds.

For every file and round (`--tables` picks some of the three): plain decoding (probespec --method ar, 64
new tokens, against llama-bench -n 64, each right after a run of the read loop of scripts/read-bandwidth.sh),
the block cost after 256 cached tokens (probespec cost against llama-bench -p 1,4,8,16 -n 0 -d 256), and
loading (wall time to the first token and peak RSS of probespec --max-new-tokens 1 against
llama-completion -c 4096 -n 1, both under /usr/bin/time). A round takes every file and every tool in turn,
so a drift of the machine hits all of them. Files of scripts/real-shapes.sh have random weights: their
speeds stand for the shape, their text is noise.

Bandwidth used is the file's bytes x tok/s over the read loop run just before that engine's plain decoding
(a shared host's read bandwidth moves: on an EPYC Zen 4 it switched between about 35 and 60 GB/s within
seconds; a decoding step reads every weight once,
and with untied embeddings all but the token embeddings, so the file's size overstates it a little), the
median over the rounds. The read loop sums an array of the file's size: a file that fits in the last-level
cache (SmolLM2's 98 MB on a CPU with more L3) stays there between tokens, and its bound is the cache's
read bandwidth, not memory's. The loop runs once more after probespec's run, and a round whose three
readings (before llama.cpp, between the engines, after probespec) lie within 15% of each other is a
steady one: both engines met the same host there. The steady rounds' paired ratios (probespec's tok/s
over llama.cpp's in the same round) are the column that compares the engines rather than the host's
moments.
"""
import json, os, statistics, subprocess, sys, tempfile, time

ROWS = [1, 4, 8, 16]
NEW_TOKENS = 64


def shapes_dir():
    return os.environ.get("PROBESPEC_SHAPES_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "probespec", "shapes")


def resolve(spec):
    """A GGUF path, or SHAPE:FORMAT -> the file scripts/real-shapes.sh writes."""
    if os.path.isfile(spec):
        return spec
    if ":" in spec:
        shape, fmt = spec.split(":", 1)
        path = os.path.join(shapes_dir(), f"{shape}.{fmt}.gguf")
        if os.path.isfile(path):
            return path
        sys.exit(f"{path} not found: scripts/real-shapes.sh {shape} {fmt} makes it")
    sys.exit(f"not a file or SHAPE:FORMAT: {spec}")


def label(path):
    """The file's name, marked when `probespec shape-gguf` wrote it (its description says so, among the
    first metadata keys)."""
    name = os.path.basename(path)
    name = name[:-5] if name.endswith(".gguf") else name
    with open(path, "rb") as f:
        random = b"written by probespec shape-gguf" in f.read(1 << 16)
    return f"{name} (random weights)" if random else name


def timed(cmd, run):
    """Runs cmd under /usr/bin/time: (seconds of wall time, peak RSS in MiB, the completed process)."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as t:
        t0 = time.perf_counter()
        r = run(["/usr/bin/time", "-f", "%M", "-o", t.name, *cmd])
        wall = time.perf_counter() - t0
        rss_kb = int(t.read().strip().splitlines()[-1])
    return wall, rss_kb / 1024, r


def read_loop(folder):
    """A function of a size in bytes that runs the read loop of scripts/read-bandwidth.sh (built once, into
    `folder`) over an array of that size and returns its GB/s (2 threads unless OMP_NUM_THREADS says), or
    None where it cannot be built (it needs gcc with OpenMP)."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "read-bandwidth.sh")
    binary = os.path.join(folder, "read-bandwidth")
    if subprocess.run([script, "--build", binary], capture_output=True).returncode != 0:
        print("read-bandwidth.sh could not build its loop (gcc with OpenMP?): no bandwidth column",
              file=sys.stderr)
        return lambda size: None

    def gbs(size):
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
        mib = str(max(1, -(-size // (1 << 20))))
        out = subprocess.run([binary, mib], capture_output=True, text=True, env=env, check=True).stdout
        return float(out.split(":")[1].split("GB/s")[0])
    return gbs


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def spread(xs):
    return f"{med(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})" if xs else "n/a"


def run(a, tools, run_cmd, prompt):
    files = [resolve(s) for s in a.shapes.split(",")]
    tables = set(a.tables.split(","))
    T = str(a.threads)
    bench = os.path.join(tools, "llama-bench")
    completion = os.path.join(tools, "llama-completion")
    loop_dir = tempfile.TemporaryDirectory()
    read_bandwidth = read_loop(loop_dir.name) if "A" in tables else None
    m = {f: {"lc_read": [], "ps_read": [], "ps_read_after": [], "lc_tps": [], "ps_tps": [], "ps_new": [],
             "lc_ms": {r: [] for r in ROWS}, "ps_ms": {r: [] for r in ROWS},
             "lc_load": [], "ps_load": [], "lc_rss": [], "ps_rss": []}
         for f in files}
    for rnd in range(a.rounds):
        for f in files:
            x = m[f]
            if "A" in tables:
                # plain decoding, each engine right after a reading of the read bandwidth
                x["lc_read"].append(read_bandwidth(os.path.getsize(f)))
                r = run_cmd([bench, "-m", f, "-t", T, "-r", "1", "-o", "json", "-p", "0", "-n", str(NEW_TOKENS)])
                x["lc_tps"].append(json.loads(r.stdout)[0]["avg_ts"])
                x["ps_read"].append(read_bandwidth(os.path.getsize(f)))
                r = run_cmd([a.binary, "--model", f, "-t", T, "--json", "--method", "ar", "--no-chat-template",
                             "--max-new-tokens", str(NEW_TOKENS), prompt])
                j = json.loads(r.stdout.strip().splitlines()[-1])
                x["ps_tps"].append(j["stats"]["tokens_per_second"])
                x["ps_new"].append(len(j["token_ids"]))
                x["ps_read_after"].append(read_bandwidth(os.path.getsize(f)))
            if "B" in tables:
                # block cost after 256 cached tokens
                r = run_cmd([bench, "-m", f, "-t", T, "-r", "1", "-o", "json", "-p", ",".join(map(str, ROWS)),
                             "-n", "0", "-d", "256"])
                for d in json.loads(r.stdout):
                    x["lc_ms"][d["n_prompt"]].append(d["avg_ns"] / 1e6)
                r = run_cmd([a.binary, "cost", "--model", f, "-t", T, "--rows", ",".join(map(str, ROWS)),
                             "--cache", "256", "--repeats", "3", "--json"])
                for pt in json.loads(r.stdout)["points"]:
                    x["ps_ms"][pt["rows"]].append(pt["median_ms"])
            if "C" in tables:
                # loading: time to the first token, peak RSS
                wall, rss, _ = timed([completion, "-m", f, "-t", T, "-c", "4096", "-n", "1", "--temp", "0",
                                      "-no-cnv", "--no-display-prompt", "-p", prompt], run_cmd)
                x["lc_load"].append(wall)
                x["lc_rss"].append(rss)
                wall, rss, _ = timed([a.binary, "--model", f, "-t", T, "--method", "ar", "--no-chat-template",
                                      "--max-new-tokens", "1", prompt], run_cmd)
                x["ps_load"].append(wall)
                x["ps_rss"].append(rss)
            print(f"shapes, round {rnd + 1}/{a.rounds}: {label(f)}", file=sys.stderr)

    record = {label(f): {**m[f], "bytes": os.path.getsize(f)} for f in files}
    for t in sorted(tables):
        print("\n" + TABLES[t](record, a.rounds, a.threads))
    return record


def steady_ratios(x):
    """Paired ratios (probespec / llama.cpp tok/s) of the rounds whose three read-loop readings lie within
    15% of each other."""
    rounds = zip(x["lc_tps"], x["ps_tps"], x.get("lc_read", []), x.get("ps_read", []), x.get("ps_read_after", []))
    return [p / l for l, p, *reads in rounds if None not in reads and min(reads) >= 0.85 * max(reads)]


def plain_table(record, n, threads):
    """Table A of a record (label -> measurements): plain decoding against llama-bench."""
    lines = [f"A. Plain decoding, {NEW_TOKENS} new tokens, {threads} threads: tok/s, median of {n} (min-max)", "",
             "| file | llama-bench -n 64 | probespec --method ar | ratio | read loop GB/s | "
             "bandwidth used, llama.cpp / probespec | ratio in steady rounds |",
             "|---|---|---|---|---|---|---|"]
    for name, x in record.items():
        if not x.get("ps_tps"):
            continue
        short = "" if min(x["ps_new"]) == NEW_TOKENS else f" (stopped at {min(x['ps_new'])} tokens)"
        reads = x.get("lc_read", []) + x.get("ps_read", [])
        readings, used = "n/a", "n/a"
        if reads and None not in reads and "bytes" in x:
            gb = x["bytes"] / 1e9
            readings = spread(reads)
            lc = med([gb * t / r for t, r in zip(x["lc_tps"], x["lc_read"])])
            ps = med([gb * t / r for t, r in zip(x["ps_tps"], x["ps_read"])])
            used = f"{lc:.0%} / {ps:.0%}"
        steady = steady_ratios(x)
        paired = ("n/a" if not x.get("ps_read_after") else
                  f"{med(steady):.2f}x ({min(steady):.2f}-{max(steady):.2f}), {len(steady)} of {n}" if steady
                  else f"none of {n}")
        lines.append(f"| {name} | {spread(x['lc_tps'])} | {spread(x['ps_tps'])}{short} | "
                     f"{med(x['ps_tps']) / med(x['lc_tps']):.2f}x | {readings} | {used} | {paired} |")
    return "\n".join(lines)


def cost_table(record, n, threads):
    """Table B of a record: the block cost after 256 cached tokens."""
    lines = [f"B. Block cost after 256 cached tokens: ms per block of 1 / 4 / 8 / 16 rows (median of {n}), "
             "and cost(8)/cost(1)", "",
             "| file | llama-bench -d 256 | cost(8)/cost(1) | probespec cost | cost(8)/cost(1) |",
             "|---|---|---|---|---|"]
    for name, x in record.items():
        ms = {k: {int(r): v for r, v in x[k].items()} for k in ("lc_ms", "ps_ms")}
        if not ms["ps_ms"].get(1):
            continue
        lc = " / ".join(f"{med(ms['lc_ms'][r]):.1f}" for r in ROWS)
        ps = " / ".join(f"{med(ms['ps_ms'][r]):.1f}" for r in ROWS)
        lines.append(f"| {name} | {lc} | {med(ms['lc_ms'][8]) / med(ms['lc_ms'][1]):.2f} | {ps} | "
                     f"{med(ms['ps_ms'][8]) / med(ms['ps_ms'][1]):.2f} |")
    return "\n".join(lines)


def loading_table(record, n, threads):
    """Table C of a record: wall time to the first token and peak RSS."""
    lines = [f"C. Loading: wall time to the first token (s) and peak RSS (MiB), median of {n} (min-max)", "",
             "| file | llama-completion -c 4096 -n 1 | probespec --max-new-tokens 1 | ratio | "
             "RSS llama.cpp | RSS probespec |",
             "|---|---|---|---|---|---|"]
    for name, x in record.items():
        if not x.get("ps_load"):
            continue
        lines.append(f"| {name} | {spread(x['lc_load'])} | {spread(x['ps_load'])} | "
                     f"{med(x['ps_load']) / med(x['lc_load']):.2f}x | {med(x['lc_rss']):.0f} | "
                     f"{med(x['ps_rss']):.0f} |")
    return "\n".join(lines)


TABLES = {"A": plain_table, "B": cost_table, "C": loading_table}
