#!/usr/bin/env bash
# The planner's validation rows on one machine (tests/data/plan-measured.tsv): the three bench configs
# and each recompute mode, one GPU each, two runs side by side on a two-GPU machine. Step time and the
# device's peak memory of each run to $OUT/rows.txt.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export OMP_NUM_THREADS=16
GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
# one GPU CONFIG [overrides...]: a bench run on that GPU, its line in rows.txt
one() {
    local gpu=$1 name; shift
    name=$(echo "$*" | tr ' =/' '_-_')
    CUDA_VISIBLE_DEVICES=$gpu timeout 200 ./moe bench "$@" > "runs/row-$name.txt" 2>&1
    echo "$* | $(grep -E '^step' "runs/row-$name.txt" | grep -oE '[0-9.]+ ms' | head -1) | $(grep -oE 'peak [0-9.]+ GiB' "runs/row-$name.txt") | $(grep -oE '^memory +plan [0-9.]+ GiB' "runs/row-$name.txt" | tr -s ' ')"
}
RUNS=("configs/bench/scale-E64.json train.recompute=none" "configs/bench/olmoe-L8.json train.recompute=selective"
      "configs/bench/scale-E64.json train.recompute=selective" "configs/bench/olmoe-L8.json train.recompute=full"
      "configs/bench/scale-E64.json train.recompute=full" "configs/bench/scale-E8.json")
for ((i = 0; i < ${#RUNS[@]}; i += GPUS)); do
    for ((g = 0; g < GPUS && i + g < ${#RUNS[@]}; g++)); do one "$g" ${RUNS[i + g]} > "runs/row$g.txt" & done
    wait
    for ((g = 0; g < GPUS && i + g < ${#RUNS[@]}; g++)); do cat "runs/row$g.txt"; done
done | tee "$OUT/rows.txt"
