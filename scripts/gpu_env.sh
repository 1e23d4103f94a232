# Sourced by the GPU scripts: the repository root as working directory, $OUT for numbers and logs
# (the device tool brings it back), runs/ for run directories, the environment every GPU run needs
# (never NVLink multicast; mpirun as root in the container), say() and build_cuda().
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/moe-gpu-out}
mkdir -p "$OUT" runs
export NCCL_NVLS_ENABLE=0
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
say() { echo "== $*" | tee -a "$OUT/summary.txt"; }
# The CUDA build of gpu_check.sh, or the end of the calling script with the build log's tail.
build_cuda() {
    bash scripts/gpu_check.sh build > /dev/null 2>&1 && return
    say "build FAILED"
    tail -20 "$OUT/build.log"
    exit 1
}
