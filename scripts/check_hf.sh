#!/usr/bin/env bash
# Checks `moe export` / `moe import` against Hugging Face transformers (scripts/check_hf.py): makes
# a Python environment with torch and transformers in build/hfvenv (or HF_VENV) unless one is
# there, builds ./moe and the tinyshakespeare tokens, and runs the check; exits non-zero on any
# mismatch. Versions: TORCH_VERSION and TRANSFORMERS_VERSION (the ones last recorded in
# docs/PERF.md by default; "latest" for the newest). Exit codes: 0 all match, 1 a mismatch, 3 the
# Python environment could not be installed (nothing was checked).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${HF_VENV:-build/hfvenv}
torch_pin=${TORCH_VERSION:-2.15.0}
transformers_pin=${TRANSFORMERS_VERSION:-5.24.0}
spec() { if [ "$2" = latest ]; then echo "$1"; else echo "$1==$2"; fi; }
start=$SECONDS
if ! "$venv/bin/python" -c "import torch, transformers" 2>/dev/null; then
    # PyPI's Linux wheel of torch brings its CUDA libraries along (about 5.6 GB); only the CPU is used.
    if ! python3 -m venv "$venv" || ! "$venv/bin/pip" install --quiet "$(spec torch "$torch_pin")" \
            "$(spec transformers "$transformers_pin")"; then
        echo "check_hf: could not install torch and transformers into $venv (no network?)" >&2
        exit 3
    fi
fi
echo "python environment ready: $((SECONDS - start)) s"
make -j"$(nproc)" moe data/tinyshakespeare_train.npy > /dev/null
"$venv/bin/python" scripts/check_hf.py
echo "check_hf: $((SECONDS - start)) s in all"
