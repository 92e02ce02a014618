#!/usr/bin/env python3
"""Plain-decoding speed of probespec against llama.cpp on the same GGUF, same thread count, one process run,
interleaved (llama.cpp, probespec, llama.cpp, ...), medians reported. llama.cpp comes from the PyPI package
llama-cpp-python (a benchmark-only peer, not a dependency of the crate): pip install llama-cpp-python.
On CPUs that list AMX in a sandbox that does not enable it, a native build dies with an illegal instruction;
build without AMX instead (how docs/BENCHMARKS.md's figures were made):
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON
  -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" pip install llama-cpp-python

Usage: scripts/compare-llamacpp.py [--model PATH] [--threads 2] [--tokens 128] [--rounds 5]
"""
import argparse, json, os, statistics, subprocess, time

p = argparse.ArgumentParser()
home = os.environ.get("PROBESPEC_MODEL_DIR") or os.path.join(
    os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "probespec")
p.add_argument("--model", default=os.path.join(home, "SmolLM2-135M-Instruct.Q4_1.gguf"))
p.add_argument("--binary", default="target/release/probespec")
p.add_argument("--threads", type=int, default=2)
p.add_argument("--tokens", type=int, default=128)
p.add_argument("--rounds", type=int, default=5)
p.add_argument("--prompt", default="Write a long story about a lighthouse keeper and the sea.")
a = p.parse_args()

from llama_cpp import Llama  # noqa: E402

llm = Llama(model_path=a.model, n_threads=a.threads, n_ctx=1024, verbose=False)
prompt_ids = llm.tokenize(a.prompt.encode(), add_bos=False)


def llamacpp_tps():
    llm.reset()
    llm.eval(prompt_ids)  # prefill, not timed
    t = time.perf_counter()
    for _ in range(a.tokens):
        tok = llm.sample(temp=0.0)
        llm.eval([tok])
    return a.tokens / (time.perf_counter() - t)


def probespec_tps():
    env = dict(os.environ, RAYON_NUM_THREADS=str(a.threads))
    out = subprocess.run([a.binary, "--model", a.model, "--method", "ar", "--json",
                          "--max-new-tokens", str(a.tokens), a.prompt], capture_output=True, text=True, env=env,
                         check=True)
    # Through the chat template, so the reply is long; decode tokens/s excludes the prefill like above.
    return json.loads(out.stdout)["stats"]["tokens_per_second"]


llamacpp_tps(); probespec_tps()  # warm-up
ours, theirs = [], []
for _ in range(a.rounds):
    theirs.append(llamacpp_tps())
    ours.append(probespec_tps())
mo, mt = statistics.median(ours), statistics.median(theirs)
print(json.dumps({"threads": a.threads, "tokens": a.tokens, "rounds": a.rounds,
                  "probespec_tokens_per_second": round(mo, 2), "llamacpp_tokens_per_second": round(mt, 2),
                  "ratio_probespec_over_llamacpp": round(mo / mt, 3)}))
