#!/usr/bin/env bash
# Issue 12's measurements: what each train.recompute mode buys, the planner's validation rows, and the
# real OLMoE-1B-7B shape.
#   bash scripts/gpu_memory.sh [PART ...]
# PART (default: sweep olmoe1 olmoe2, with the GPUs of the machine):
#   sweep    for scale-E8 and olmoe-L8 and each mode, the largest micro-batch of 4096-token sequences
#            whose memory plan fits the GPU (2 GiB kept free), benchmarked
#   rows     the bench configs in each recompute mode at their own micro-batch: the step times and
#            peaks tests/data/plan-measured.tsv checks `moe plan` against
#   olmoe1   configs/olmoe-1b-7b.json (16 layers) on one GPU with full recompute, 8 x 4096 tokens
#   olmoe2   the same on two GPUs, ep = 2 (dp = 2 for the dense weights), 8 x 4096 tokens per GPU
# sweep and rows run their two halves side by side, one on each GPU, when the machine has two.
# Rows of a markdown table to $OUT/memory.md: tokens/s, step time, the device's peak memory and the plan.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export OMP_NUM_THREADS=16
PARTS=${*:-sweep olmoe1 olmoe2}
has() { [[ " $PARTS " == *" $1 "* ]]; }
GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
build_cuda

# plan_gib CONFIG [overrides...]: rank 0's plan on the GPU (bf16 activations and compute copy), GiB
plan_gib() { ./moe inspect "$@" | grep -m1 -E '^ +total ' | grep -oE '[0-9.]+ GiB' | sed -n 2p | grep -oE '[0-9.]+'; }

# largest_micro CONFIG MODE FREE_GIB: the largest micro-batch (a multiple of 4) whose plan fits
largest_micro() {
    local best=0 mb
    for mb in $(seq 4 4 256); do
        awk -v p="$(plan_gib "$1" train.recompute="$2" train.micro_batch="$mb")" -v f="$3" 'BEGIN { exit !(p + 2 <= f) }' || break
        best=$mb
    done
    echo "$best"
}

# row LOG NAME: one table row from a bench log
row() {
    if ! grep -q '^throughput' "$1"; then
        echo "| $2 | FAILED: $(grep -m2 -iE 'error|fatal|out of' "$1" | tr '\n' ' ') | | | |"
        return
    fi
    echo "| $2 | $(grep -oE '^throughput +[0-9,]+' "$1" | grep -oE '[0-9,]+$') | $(grep -E '^step' "$1" | grep -oE '[0-9.]+ ms' | head -1) | $(grep -oE 'peak [0-9.]+ GiB' "$1" | grep -oE '[0-9.]+') GiB | $(grep -oE '^memory +plan [0-9.]+' "$1" | grep -oE '[0-9.]+$') GiB |"
}

# bench_row GPU NAME SECONDS ARGS...: `moe bench ARGS` on that GPU (its log to $OUT too), one table row
bench_row() {
    local gpu=$1 name=$2 limit=$3 log
    shift 3
    log=runs/memory-$(echo "$name" | tr ' =/,' '_-__').txt
    CUDA_VISIBLE_DEVICES=$gpu timeout "$limit" ./moe bench "$@" > "$log" 2>&1
    cp "$log" "$OUT/"
    row "$log" "$name"
}

# sweep GPU CONFIG: every mode at its largest micro-batch on one GPU
sweep() {
    local gpu=$1 cfg=$2 free mode mb
    free=$(nvidia-smi -i "$gpu" --query-gpu=memory.free --format=csv,noheader,nounits | awk '{ print $1 / 1024 }')
    for mode in none selective full; do
        mb=$(largest_micro configs/bench/"$cfg".json "$mode" "$free")
        bench_row "$gpu" "$cfg, $mode, micro-batch $mb" 300 configs/bench/"$cfg".json train.recompute="$mode" \
            train.micro_batch="$mb" --warmup 2 --steps 4
    done
}

# rows GPU "CONFIG [overrides];...": each run at the config's own micro-batch on one GPU
rows() {
    local gpu=$1 run runs
    IFS=';' read -ra runs <<< "$2"
    for run in "${runs[@]}"; do bench_row "$gpu" "$run" 200 $run; done
}

# pair F A B: `F 0 A` and `F 1 B` side by side (one after the other on GPU 0 of a one-GPU machine)
pair() {
    local second=$((GPUS >= 2 ? 1 : 0))
    "$1" 0 "$2" > runs/pair0.md &
    [ "$second" = 1 ] || wait
    "$1" "$second" "$3" > runs/pair1.md
    wait
    cat runs/pair0.md runs/pair1.md >> "$OUT/memory.md"
}

{
    echo "| run | tokens/s | step | device peak | plan |"
    echo "|---|---|---|---|---|"
} > "$OUT/memory.md"
has sweep && pair sweep scale-E8 olmoe-L8
has rows && pair rows \
    "configs/bench/scale-E64.json train.recompute=none;configs/bench/scale-E64.json train.recompute=selective;configs/bench/scale-E64.json train.recompute=full" \
    "configs/bench/olmoe-L8.json train.recompute=selective;configs/bench/olmoe-L8.json train.recompute=full;configs/bench/scale-E8.json"
OLMOE="configs/olmoe-1b-7b.json train.micro_batches=1 train.recompute=full"
has olmoe1 && bench_row 0 "OLMoE-1B-7B, 1 GPU, full, 8 x 4096" 400 $OLMOE train.micro_batch=8 --warmup 2 --steps 4 \
    >> "$OUT/memory.md"
if has olmoe2 && [ "$GPUS" -ge 2 ]; then
    timeout 400 mpirun -np 2 ./moe bench $OLMOE train.micro_batch=16 parallel.ep=2 --warmup 2 --steps 4 > runs/olmoe2.txt 2>&1
    cp runs/olmoe2.txt "$OUT/"
    row runs/olmoe2.txt "OLMoE-1B-7B, 2 GPUs ep=2, full, 8 x 4096 per GPU" >> "$OUT/memory.md"
fi
cat "$OUT/memory.md"
