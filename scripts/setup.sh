#!/usr/bin/env bash
# Installs what moe.c needs to build and test on Debian/Ubuntu: a C compiler with OpenMP, make,
# the jansson JSON library, the xxHash library (checkpoint checksums), PCRE2 (tokenizers' split
# patterns), Open MPI (several ranks), cairo with pkg-config and the DejaVu fonts (the pictures of
# `moe plot`), and clang with its libFuzzer runtime (`make fuzz`). Where the CUDA toolkit is
# installed (nvcc on PATH) it also fetches the header-only libraries of the CUDA build into
# .deps/include: CUTLASS (the Hopper grouped GEMM), the cuDNN frontend (attention) and NVML's header
# (the benchmarks' clock and power readings), pinned and checksummed, from their PyPI wheels, and
# the Debian packages of the libraries that the GPU machines lack (JSON, xxHash, PCRE2) into
# .deps/debs, for scripts/gpu_check.sh to unpack there.
# Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(build-essential libjansson-dev libxxhash-dev libpcre2-dev libopenmpi-dev openmpi-bin pkg-config
          libcairo2-dev fonts-dejavu-core clang libclang-rt-dev)
missing=()
for p in "${packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
if [ ${#missing[@]} -gt 0 ]; then
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
fi
command -v nvcc >/dev/null || exit 0

# The GPU machines have no package registry: carry these (see scripts/gpu_check.sh).
gpu_debs=(libjansson4 libjansson-dev libxxhash0 libxxhash-dev libpcre2-8-0 libpcre2-dev)
mkdir -p .deps/debs
for p in "${gpu_debs[@]}"; do
    ls .deps/debs/"${p}"_*.deb >/dev/null 2>&1 || (cd .deps/debs && apt-get download -q "$p" 2>/dev/null)
done

# wheel file name, sha256, folder inside the wheel whose contents go to .deps/include
headers=(
    "nvidia_cutlass-4.2.0.0-py3-none-any.whl f9599ada45c7bcb6bf53f7d3f0a7d154183e53451c01bfa59eecd37dd4a693f6 cutlass_library/source/include/"
    "nvidia_cudnn_frontend-1.32.0-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl 8b354a8e550c083eb247f1eb39a7d69a4a269075f5a01e4fcbd2531680b17239 include/"
    "nvidia_nvml_dev_cu12-12.9.79-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl 8bb367913c62cb65be9ae386c58dbf573f1f9e2f01cae54abb87bf5f63c6069e nvidia/nvml_dev/include/"
)
[ -e .deps/include/cutlass/version.h ] && [ -e .deps/include/cudnn_frontend.h ] && [ -e .deps/include/nvml.h ] && exit 0
python3 -m pip --version >/dev/null 2>&1 || { $sudo apt-get update -qq; $sudo apt-get install -y -qq python3-pip; }
mkdir -p .deps/wheels .deps/include
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .deps/wheels \
    nvidia-cutlass==4.2.0.0 nvidia-cudnn-frontend==1.32.0 nvidia-nvml-dev-cu12==12.9.79
for h in "${headers[@]}"; do
    set -- $h
    echo "$2  .deps/wheels/$1" | sha256sum --check --quiet
    python3 - ".deps/wheels/$1" "$3" <<'PY'
import sys, zipfile, os
wheel, prefix = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            out = os.path.join(".deps/include", name[len(prefix):])
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with open(out, "wb") as f:
                f.write(z.read(name))
PY
done
echo "CUTLASS, cuDNN frontend and NVML headers in .deps/include"
