#!/usr/bin/env bash
# Issue 12's measurements: what each train.recompute mode buys, and the real OLMoE-1B-7B shape.
#   bash scripts/gpu_memory.sh [PART ...]
# PART (default: all three, with the GPUs of the machine):
#   sweep    for scale-E8 and olmoe-L8 and each mode, the largest micro-batch of 4096-token sequences
#            whose memory plan fits the GPU (2 GiB kept free), benchmarked; the sweeps of the two
#            configs run side by side on two GPUs when the machine has them
#   olmoe1   configs/olmoe-1b-7b.json (16 layers) on one GPU with full recompute, 8 x 4096 tokens
#   olmoe2   the same on two GPUs, ep = 2 (dp = 2 for the dense weights), 8 x 4096 tokens per GPU
# Rows of markdown tables to $OUT/memory.md: tokens/s, the device's peak memory and the plan.
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
        echo "| $2 | FAILED: $(grep -m2 -iE 'error|fatal|out of' "$1" | tr '\n' ' ') | | |"
        return
    fi
    echo "| $2 | $(grep -oE '^throughput +[0-9,]+' "$1" | grep -oE '[0-9,]+$') | $(grep -oE 'peak [0-9.]+ GiB' "$1" | grep -oE '[0-9.]+') GiB | $(grep -oE '^memory +plan [0-9.]+' "$1" | grep -oE '[0-9.]+$') GiB |"
}

# sweep CONFIG GPU: every mode at its largest micro-batch on one GPU
sweep() {
    local cfg=$1 gpu=$2 free mode mb log
    free=$(nvidia-smi -i "$gpu" --query-gpu=memory.free --format=csv,noheader,nounits | awk '{ print $1 / 1024 }')
    for mode in none selective full; do
        mb=$(largest_micro configs/bench/"$cfg".json "$mode" "$free")
        log=runs/memory-$cfg-$mode.txt
        CUDA_VISIBLE_DEVICES=$gpu timeout 300 ./moe bench configs/bench/"$cfg".json train.recompute="$mode" \
            train.micro_batch="$mb" --warmup 2 --steps 4 > "$log" 2>&1
        cp "$log" "$OUT/"
        row "$log" "$cfg, $mode, micro-batch $mb"
    done
}

{
    echo "| run | tokens/s | device peak | plan |"
    echo "|---|---|---|---|"
} > "$OUT/memory.md"
if has sweep; then
    if [ "$GPUS" -ge 2 ]; then
        sweep scale-E8 0 > runs/sweep0.md &
        sweep olmoe-L8 1 > runs/sweep1.md
        wait
    else
        sweep scale-E8 0 > runs/sweep0.md
        sweep olmoe-L8 0 > runs/sweep1.md
    fi
    cat runs/sweep0.md runs/sweep1.md >> "$OUT/memory.md"
fi
OLMOE="configs/olmoe-1b-7b.json train.micro_batches=1 train.recompute=full"
if has olmoe1; then
    CUDA_VISIBLE_DEVICES=0 timeout 400 ./moe bench $OLMOE train.micro_batch=8 --warmup 2 --steps 4 > runs/olmoe1.txt 2>&1
    cp runs/olmoe1.txt "$OUT/"
    row runs/olmoe1.txt "OLMoE-1B-7B, 1 GPU, full, 8 x 4096" >> "$OUT/memory.md"
fi
if has olmoe2 && [ "$GPUS" -ge 2 ]; then
    timeout 400 mpirun -np 2 ./moe bench $OLMOE train.micro_batch=16 parallel.ep=2 --warmup 2 --steps 4 > runs/olmoe2.txt 2>&1
    cp runs/olmoe2.txt "$OUT/"
    row runs/olmoe2.txt "OLMoE-1B-7B, 2 GPUs ep=2, full, 8 x 4096 per GPU" >> "$OUT/memory.md"
fi
cat "$OUT/memory.md"
