#!/usr/bin/env bash
# Installs what moe.c needs to build and test on Debian/Ubuntu: a C compiler with OpenMP, make,
# the jansson JSON library, the xxHash library (checkpoint checksums), PCRE2 (tokenizers' split
# patterns), Open MPI (several ranks), cairo with pkg-config and the DejaVu fonts (the pictures of
# `moe plot`), and clang with its libFuzzer runtime (`make fuzz`). Where the CUDA toolkit is
# installed (nvcc on PATH) it also fetches the header-only libraries of the CUDA build into
# .deps/include: CUTLASS (the Hopper grouped GEMM), the cuDNN frontend (attention) and NVML's header
# (the benchmarks' clock and power readings), and into .deps/bin NVIDIA's cuobjdump and nvdisasm
# (scripts/sass_loops.py reads kernels' machine code with them), pinned and checksummed, from their
# PyPI wheels, and the Debian packages of the libraries that the GPU machines lack (JSON, xxHash,
# PCRE2) into .deps/debs, for scripts/gpu_check.sh to unpack there.
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

# wheel file name, sha256, folder inside the wheel, the .deps folder its contents go to
wheels=(
    "nvidia_cutlass-4.2.0.0-py3-none-any.whl f9599ada45c7bcb6bf53f7d3f0a7d154183e53451c01bfa59eecd37dd4a693f6 cutlass_library/source/include/ include"
    "nvidia_cudnn_frontend-1.32.0-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl 8b354a8e550c083eb247f1eb39a7d69a4a269075f5a01e4fcbd2531680b17239 include/ include"
    "nvidia_nvml_dev_cu12-12.9.79-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl 8bb367913c62cb65be9ae386c58dbf573f1f9e2f01cae54abb87bf5f63c6069e nvidia/nvml_dev/include/ include"
    "nvidia_cuda_cuobjdump-13.5.37-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl 38780fee50863252a0b8926357faa91615ca1c8346490563f33a06100cd73f58 nvidia/cu13/bin/ bin"
    "nvidia_cuda_nvdisasm-13.5.37-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl d3fdbdd49fa53e2e4aacd3db8259d052bd2b049ececdcb69e92e083c6728e7ca nvidia/cu13/bin/ bin"
)
[ -e .deps/include/cutlass/version.h ] && [ -e .deps/include/cudnn_frontend.h ] && [ -e .deps/include/nvml.h ] &&
    [ -x .deps/bin/cuobjdump ] && [ -x .deps/bin/nvdisasm ] && exit 0
python3 -m pip --version >/dev/null 2>&1 || { $sudo apt-get update -qq; $sudo apt-get install -y -qq python3-pip; }
mkdir -p .deps/wheels .deps/include .deps/bin
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .deps/wheels \
    nvidia-cutlass==4.2.0.0 nvidia-cudnn-frontend==1.32.0 nvidia-nvml-dev-cu12==12.9.79 \
    nvidia-cuda-cuobjdump==13.5.37 nvidia-cuda-nvdisasm==13.5.37
for w in "${wheels[@]}"; do
    set -- $w
    echo "$2  .deps/wheels/$1" | sha256sum --check --quiet
    python3 - ".deps/wheels/$1" "$3" ".deps/$4" <<'PY'
import sys, zipfile, os
wheel, prefix, dest = sys.argv[1], sys.argv[2], sys.argv[3]
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        if info.filename.startswith(prefix) and not info.filename.endswith("/"):
            out = os.path.join(dest, info.filename[len(prefix):])
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with open(out, "wb") as f:
                f.write(z.read(info))
            os.chmod(out, 0o755 if dest.endswith("bin") else 0o644)
PY
done
echo "CUTLASS, cuDNN frontend and NVML headers in .deps/include; cuobjdump and nvdisasm in .deps/bin"
