#!/usr/bin/env bash
# Expert-pool scaling on one node (OLMo-core 3's headline run): the baseline shape (d_model 2048,
# 16 heads, expert hidden 1024, sequence 4096, 8 layers, top-4) with E experts per layer, active
# parameters fixed, one rank per GPU, dp = the GPU count, ep = min(GPUs, E), 8 sequences of 4096
# (32,768 tokens) per GPU. Then E = 128 with random routing, and ep = 1 (experts replicated) at
# E = 8 to show what expert parallelism costs. Rows of one markdown table to $OUT/scale.md.
#   [EXTRA="key=value ..."] bash scripts/gpu_scale.sh [RUN ...]
#     RUN: an expert count, random (E = 128, random routing) or replicated (E = 8, ep = 1); default:
#     all seven. EXTRA: overrides for every run, e.g. parallel.recv_capacity=2 (the receive buffers
#     sized for twice an even share instead of the worst case: at ep = 8 that is 64 instead of
#     131 GiB per GPU for E = 128, `moe inspect`; rows past them are dropped and reported).
# Each run takes 1-2 minutes (E = 128 mostly initialising 6.4B parameters), so on 8 GPUs split
# them over calls of the device tool's 10 minutes, e.g. "8 16 32 64", then "128 random replicated".
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export OMP_NUM_THREADS=8
RUNS=${*:-8 16 32 64 128 random replicated}

build_cuda
GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
say "build ok; $GPUS GPUs; overrides: ${EXTRA:-none}"

phase() { grep -E "^  $2 " "$1" | awk '{ print $(NF) }'; }

# bench NAME FILE EP [overrides...]: one row of the table.
bench() {
    local name=$1 log=runs/scale-$2.txt ep=$3; shift 3
    timeout 400 mpirun -np "$GPUS" ./moe bench configs/bench/scale-E8.json train.micro_batch=$((8 * GPUS)) \
        parallel.ep="$ep" "$@" ${EXTRA:-} > "$log" 2>&1
    cp "$log" "$OUT/"
    if ! grep -q '^throughput' "$log"; then
        say "$name FAILED: $(grep -m3 -iE 'error|fatal|out of' "$log")"
        return
    fi
    printf '| %s | dp=%d ep=%d | %s | %s | %s GiB | %s | %s | %s | %s | %s |\n' "$name" "$GPUS" "$ep" \
        "$(grep -oE 'per rank: [0-9]+ tokens/s' "$log" | grep -oE '[0-9]+')" \
        "$(grep -oE 'per rank: [0-9]+ tokens/s, [0-9.]+ TFLOP/s' "$log" | grep -oE '[0-9.]+ TFLOP' | grep -oE '[0-9.]+')" \
        "$(grep -oE 'peak [0-9.]+ GiB' "$log" | grep -oE '[0-9.]+')" \
        "$(phase "$log" 'expert row pushes')" "$(phase "$log" 'routing and permutation')" \
        "$(grep -oE 'load max/mean [0-9.]+' "$log" | grep -oE '[0-9.]+$')" \
        "$(grep -oE '[0-9.]+% of slots dropped' "$log" | grep -oE '^[0-9.]+%')" \
        "$(awk '$1 == 0 && $2 == "each" { w = $5 } $1 == 0 && $2 == "one" { a = $5 } /^graph alone/ { g = $3 }
                END { print w " / " a " / " g }' "$log")" | tee -a "$OUT/scale.md"
}

{
    echo "| run | layout | tokens/s per GPU | TFLOP/s per GPU | memory per GPU | row pushes (share of kernel time) | routing and permutation | load max/mean | dropped | step ms: waited / ahead / graph alone (rank 0) |"
    echo "|---|---|---|---|---|---|---|---|---|---|"
} > "$OUT/scale.md"
for run in $RUNS; do
    case $run in
    random) bench "E=128 random routing" E128-random "$GPUS" model.n_experts=128 model.random_routing=true ;;
    replicated) bench "E=8 experts replicated" E8-replicated 1 model.n_experts=8 ;;
    *) bench "E=$run" "E$run" $((run < GPUS ? run : GPUS)) model.n_experts="$run" ;;
    esac
done
cat "$OUT/scale.md"
