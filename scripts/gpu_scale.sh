#!/usr/bin/env bash
# Expert-pool scaling on one node (OLMo-core 3's headline run): the baseline shape (d_model 2048,
# 16 heads, expert hidden 1024, sequence 4096, 8 layers, top-4) with E experts per layer, active
# parameters fixed, one rank per GPU, dp = the GPU count, ep = min(GPUs, E), 8 sequences of 4096
# (32,768 tokens) per GPU. Then E = 128 with random routing, and ep = 1 (experts replicated) at
# E = 8 to show what expert parallelism costs. One markdown table to $OUT/scale.md.
#   bash scripts/gpu_scale.sh [E ...]      (default: 8 16 32 64 128)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/moe-gpu-out}
mkdir -p "$OUT" runs
export NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=8
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
say() { echo "== $*" | tee -a "$OUT/summary.txt"; }
EXPERTS=${*:-8 16 32 64 128}

bash scripts/gpu_check.sh build > /dev/null 2>&1 || { say "build FAILED"; tail -20 "$OUT/build.log"; exit 1; }
GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
say "build ok; $GPUS GPUs"

phase() { grep -E "^  $2 " "$1" | awk '{ print $(NF) }'; }

# bench NAME EP [overrides...]: one row of the table.
bench() {
    local name=$1 ep=$2 log=runs/scale-$1.txt; shift 2
    timeout 400 mpirun -np "$GPUS" ./moe bench configs/bench/scale-E8.json train.micro_batch=$((8 * GPUS)) \
        parallel.ep="$ep" "$@" > "$log" 2>&1
    cp "$log" "$OUT/"
    if ! grep -q '^throughput' "$log"; then
        say "$name FAILED: $(grep -m3 -iE 'error|fatal|out of' "$log")"
        return
    fi
    printf '| %s | dp=%d ep=%d | %s | %s | %s GiB | %s | %s | %s |\n' "$name" "$GPUS" "$ep" \
        "$(grep -oE 'per rank: [0-9]+ tokens/s' "$log" | grep -oE '[0-9]+')" \
        "$(grep -oE 'per rank: [0-9]+ tokens/s, [0-9.]+ TFLOP/s' "$log" | grep -oE '[0-9.]+ TFLOP' | grep -oE '[0-9.]+')" \
        "$(grep -oE 'memory +[0-9.]+ GiB' "$log" | grep -oE '[0-9.]+')" \
        "$(phase "$log" 'expert row pushes')" "$(phase "$log" 'routing and permutation')" \
        "$(grep -oE 'load max/mean [0-9.]+' "$log" | grep -oE '[0-9.]+$')" | tee -a "$OUT/scale.md"
}

{
    echo "| run | layout | tokens/s per GPU | TFLOP/s per GPU | memory per GPU | row pushes (share of kernel time) | routing and permutation | load max/mean |"
    echo "|---|---|---|---|---|---|---|---|"
} > "$OUT/scale.md"
for E in $EXPERTS; do
    ep=$((E < GPUS ? E : GPUS))
    bench "E=$E" "$ep" model.n_experts="$E"
done
bench "E=128 random routing" "$GPUS" model.n_experts=128 model.random_routing=true
bench "E=8 experts replicated" 1 model.n_experts=8
cat "$OUT/scale.md"
