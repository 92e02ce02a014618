#!/usr/bin/env python3
"""Writes where a run's numbers come from (date, commit, CPU and its features, the command) as the first
line of a JSON-lines results file, in the shape scripts/results-tables.py reads.

Usage: scripts/provenance.py OUT.jsonl "COMMAND"
"""
import json, subprocess, sys, time


def main():
    out, command = sys.argv[1], sys.argv[2]
    git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True).stdout  # noqa: E731
    commit = git("rev-parse", "--short", "HEAD").strip()
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += "-dirty"
    cpu, flags = "", set()
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name") and not cpu:
            cpu = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    with open(out, "w") as f:
        f.write(json.dumps({"provenance": {
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "repo_commit": commit, "cpu": cpu,
            "cpu_features": sorted(flags & {"avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8"}),
            "command": command}}) + "\n")


if __name__ == "__main__":
    main()
