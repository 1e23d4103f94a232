#!/usr/bin/env bash
# The two-GPU machine's one call: build, then train the same small model on one GPU and on two
# (data, expert and pipeline parallel over NCCL, under mpirun and under moe's own --nproc launcher),
# compare the loss curves with the one-GPU run, and move an expert-parallel checkpoint to one GPU
# and to CPU ranks. Modes: bench, exchange, watchdog, direct, overlap, ctas, capacity, chunks, fp8exchange,
# fp8parts (see each);
# "all" runs the default checks and then overlap. Numbers and logs go to $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export OMP_NUM_THREADS=8
source tests/testlib.sh
# scale-E64 on two GPUs, experts split (8 sequences per GPU, as on one GPU with micro_batch 8).
bench_ep2() { # SECONDS [overrides...]
    local limit=$1; shift
    timeout "$limit" mpirun -np 2 ./moe bench configs/bench/scale-E64.json train.micro_batch=16 parallel.ep=2 "$@" > runs/bench2.txt 2>&1
}
losses() { grep -o '"loss":[^,]*' "$1/metrics.jsonl" | cut -d: -f2; }

build_cuda
say "build ok; $(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l) GPUs; $(nvidia-smi topo -m | grep -m1 GPU1 | tr -s ' ')"

if [ "${1:-}" = bench ]; then # expert parallelism on the benchmark shape: 8 sequences per GPU either way
    timeout 200 ./moe bench configs/bench/scale-E64.json > runs/bench1.txt 2>&1
    bench_ep2 300
    cat runs/bench1.txt runs/bench2.txt | tee "$OUT/bench.txt"
    say "E64 1 GPU: $(grep throughput runs/bench1.txt)"
    say "E64 2 GPUs ep=2: $(grep throughput runs/bench2.txt)"
    exit 0
fi

if [ "${1:-}" = exchange ]; then
    timeout 120 mpirun -np 2 build/bench_exchange 2>&1 | tee -a "$OUT/summary.txt"
    exit 0
fi

# Data parallelism on the benchmark shape with every parameter replicated (scale-E8, dp=2, 8
# sequences per GPU): the gradient reduce-scatter per layer during the backward against all of it
# after the backward, and one GPU. NCCL's channel count (an SM each) comes from its own log.
overlap_bench() {
    timeout 150 ./moe bench configs/bench/scale-E8.json > runs/e8_1.txt 2>&1
    say "E8 1 GPU: $(grep throughput runs/e8_1.txt)"
    for overlap in true false; do
        timeout 200 mpirun -np 2 -x NCCL_DEBUG=INFO ./moe bench configs/bench/scale-E8.json train.micro_batch=16 \
            parallel.overlap_grad_reduce=$overlap > runs/e8_dp2_$overlap.txt 2>&1
        grep -v NCCL runs/e8_dp2_$overlap.txt > "$OUT/bench_e8_dp2_overlap_$overlap.txt"
        say "E8 dp=2 overlap_grad_reduce=$overlap: $(grep -E '^step|throughput' runs/e8_dp2_$overlap.txt | tr -s ' ' | tr '\n' ' ')"
    done
    say "NCCL: $(grep -m2 -o 'NCCL INFO [0-9]* coll channels.*' runs/e8_dp2_true.txt | tr '\n' ' ')"
}
if [ "${1:-}" = overlap ]; then overlap_bench; exit 0; fi

# The same with NCCL held to fewer CTAs (SMs), which leaves the overlapped backward more of the
# GPU; and scale-E64 at ep=2 with and without the overlap.
if [ "${1:-}" = ctas ]; then
    for run in "8 true" "8 false" "4 true" "16 true"; do
        set -- $run
        timeout 200 mpirun -np 2 -x NCCL_MAX_CTAS=$1 ./moe bench configs/bench/scale-E8.json train.micro_batch=16 \
            parallel.overlap_grad_reduce=$2 > runs/e8_ctas.txt 2>&1
        say "E8 dp=2 NCCL_MAX_CTAS=$1 overlap_grad_reduce=$2: $(grep -E '^step|throughput|of kernels' runs/e8_ctas.txt | tr -s ' ' | tr '\n' ' ')"
    done
    for overlap in true false; do
        bench_ep2 200 parallel.overlap_grad_reduce=$overlap
        say "E64 ep=2 overlap_grad_reduce=$overlap: $(grep -E '^step|throughput|of kernels' runs/bench2.txt | tr -s ' ' | tr '\n' ' ')"
    done
    exit 0
fi

# A rank that goes silent (SIGSTOP) mid-run: the other's watchdog must end the job, under moe's
# own launcher and under mpirun, within train.comm_timeout (5 s) plus a poll.
if [ "${1:-}" = watchdog ]; then
    for launcher in "./moe train --nproc 2" "mpirun -np 2 ./moe train"; do
        rm -rf runs/hang
        timeout 120 $launcher train.device=cuda train.steps=1000000 train.eval_every=0 train.ckpt_every=0 \
            train.log_every=100000 train.comm_timeout=5 parallel.ep=2 train.out=runs/hang > runs/hang.log 2>&1 &
        job=$!
        for _ in $(seq 600); do [ -s runs/hang/metrics.jsonl ] && break; sleep 0.1; done
        victim=$(newest_moe_pid "train.out=runs/hang")
        start=$SECONDS; kill -STOP "$victim"; wait $job; rc=$?
        say "$launcher, one rank stopped: exit $rc after $((SECONDS - start)) s: $(grep -m1 'no progress' runs/hang.log)"
        pkill -9 -f "train.out=runs/hang"
    done
    exit 0
fi

SMALL="train.device=cuda train.steps=100 train.micro_batch=16 train.micro_batches=2 train.eval_every=50
       train.ckpt_every=50 train.log_every=25"
run() { # NAME COMMAND...: runs it with train.out=runs/NAME (resuming whatever is there)
    local name=$1; shift
    timeout 240 "$@" train.out=runs/$name > runs/$name.log 2>&1
    local rc=$?
    cat runs/$name.log >> "$OUT/train.log"
    return $rc
}
compare() { # A B: per-step and 20-step moving-average relative differences
    paste <(losses "$1") <(losses "$2") | awk '{ d = $1 - $2; if (d < 0) d = -d; r = d / $2; if (r > w) w = r; s += r
        g[NR] = $1; c[NR] = $2; sg += $1; sc += $2; if (NR > 20) { sg -= g[NR - 20]; sc -= c[NR - 20] }
        if (NR >= 20) { m = sg - sc; if (m < 0) m = -m; m /= sc; if (m > wm) wm = m } }
        END { printf "%d steps: per step worst %.4f mean %.4f, 20-step average worst %.4f", NR, w, s / NR, wm }'
}
one_gpu() {
    rm -rf runs/g1
    run g1 ./moe train $SMALL || say "one GPU FAILED: $(tail -3 runs/g1.log)"
}
layouts_match() { # "NAME [overrides...]"...: each on two GPUs under mpirun, its curve against one GPU's
    for layout in "$@"; do
        set -- $layout
        local name=$1; shift
        rm -rf runs/$name
        if run $name mpirun -np 2 ./moe train $SMALL "$@"; then
            say "$name (mpirun, NCCL) vs one GPU: $(compare runs/$name runs/g1); $(grep -o 'expert rows [a-z/ ]*' runs/$name.log | head -1); $(grep -m1 'step   100' runs/$name.log | grep -o '[0-9,]* tok/s')"
        else say "$name FAILED: $(grep -m3 -i error runs/$name.log)"; fi
    done
}

# The FP8 expert exchange (train.fp8_exchange): scale-E64 in fp8 at ep=2 with the experts' inputs
# sent as bf16 rows and as FP8 codes and scales (half the bytes), the pushes' time from the profile;
# and the training curve of ep=2 with it against one GPU with it.
if [ "${1:-}" = fp8exchange ]; then
    for x in false true; do
        bench_ep2 200 train.precision=fp8 train.fp8_exchange=$x
        cp runs/bench2.txt "$OUT/bench_ep2_fp8_exchange_$x.txt"
        say "E64 fp8 ep=2 fp8_exchange=$x: $(grep -E 'throughput|expert row pushes|bytes a row' runs/bench2.txt | tr -s ' ' | tr '\n' ' ')"
    done
    rm -rf runs/g1
    run g1 ./moe train $SMALL train.precision=fp8 train.fp8_exchange=true || say "one GPU FAILED: $(tail -3 runs/g1.log)"
    layouts_match "ep2fp8x parallel.ep=2 train.precision=fp8 train.fp8_exchange=true"
    exit 0
fi

# FP8 with expert data parallelism (train.fp8_fused_update with dp=2, ep=1: each GPU quantises half of
# each expert tensor and the two gather codes instead of bf16 weights): the training curve bit for bit
# that of gathering bf16 and quantising whole tensors (train.deterministic), and scale-E8 at dp=2 in
# both ways, the step's throughput.
if [ "${1:-}" = fp8parts ]; then
    for u in true false; do
        rm -rf runs/dp2fp8u$u
        run dp2fp8u$u mpirun -np 2 ./moe train $SMALL train.precision=fp8 train.deterministic=true \
            train.fp8_fused_update=$u || say "dp=2 fp8 fused_update=$u FAILED: $(tail -3 runs/dp2fp8u$u.log)"
        timeout 200 mpirun -np 2 ./moe bench configs/bench/scale-E8.json train.micro_batch=16 train.precision=fp8 \
            train.fp8_fused_update=$u > runs/e8_dp2_fp8u$u.txt 2>&1
        cp runs/e8_dp2_fp8u$u.txt "$OUT/"
        say "E8 dp=2 fp8 fused_update=$u: $(grep -E '^step|throughput' runs/e8_dp2_fp8u$u.txt | tr -s ' ' | tr '\n' ' ')"
    done
    cmp -s <(losses runs/dp2fp8utrue) <(losses runs/dp2fp8ufalse) &&
        say "dp=2 fp8: the codes by parts give bitwise the losses of whole tensors ($(losses runs/dp2fp8utrue | wc -l) steps)" ||
        say "dp=2 fp8: by parts and whole DIFFER: $(paste <(losses runs/dp2fp8utrue) <(losses runs/dp2fp8ufalse) | head -3 | tr '\n' ' ')"
    exit 0
fi

# The direct expert exchange: its kernels against the CPU, its bandwidth, training curves of ep=2
# by direct writes and by send/recv against one GPU, and throughput.
if [ "${1:-}" = direct ]; then
    timeout 120 build/test_cuda exchange > "$OUT/test_cuda_moe.log" 2>&1
    say "CUDA vs CPU, MoE ops with the exchange: $(tail -1 "$OUT/test_cuda_moe.log")"; grep -B1 -A3 -i "fail\|exchange" "$OUT/test_cuda_moe.log" | head -30
    timeout 60 mpirun -np 2 build/bench_exchange 2>&1 | tee -a "$OUT/summary.txt"
    one_gpu
    layouts_match "ep2 parallel.ep=2" "ep2sr parallel.ep=2 parallel.exchange=sendrecv" "dp2"
    bench_ep2 150
    cp runs/bench2.txt "$OUT/bench_ep2_direct.txt"
    say "E64 2 GPUs ep=2 direct: $(grep -E '^step|throughput' runs/bench2.txt | tr -s ' ' | tr '\n' ' ')"
    exit 0
fi

# The expert exchange behind compute (parallel.exchange_chunks, parallel.push_ctas): every kernel
# against the CPU (chunked, bounded pushes, SwiGLU row ranges), the exchange's bandwidth on every SM
# and on 24 thread blocks, training curves of ep=2 in 4 chunks and in one against one GPU and
# against each other (deterministic kernels: bitwise), and scale-E64 at ep=2 per chunk count, push
# bound and CUTLASS grid (MOE_GROUPED_WAVES) against one GPU: a table in $OUT/chunks.md.
if [ "${1:-}" = chunks ]; then
    for t in dense exchange; do # SwiGLU row ranges; chunked grouped products and pushes
        timeout 180 build/test_cuda $t > "$OUT/test_cuda_$t.log" 2>&1
        say "CUDA vs CPU, $t: $(tail -1 "$OUT/test_cuda_$t.log")"; grep -i "fail" "$OUT/test_cuda_$t.log" | head
    done
    timeout 60 mpirun -np 2 build/bench_exchange 24 2>&1 | tee -a "$OUT/summary.txt"
    one_gpu
    layouts_match "ep2c4 parallel.ep=2 parallel.exchange_chunks=4 train.deterministic=true" \
        "ep2c1 parallel.ep=2 parallel.exchange_chunks=1 train.deterministic=true"
    cmp -s <(losses runs/ep2c4) <(losses runs/ep2c1) && say "ep2: 4 chunks and 1 give bitwise the same losses" \
        || say "ep2: 4 chunks and 1 DIFFER: $(paste <(losses runs/ep2c4) <(losses runs/ep2c1) | head -3 | tr '\n' ' ')"
    timeout 150 ./moe bench configs/bench/scale-E64.json > runs/bench1.txt 2>&1
    tps() { grep -m1 '^throughput' "$1" | grep -oE 'per rank: [0-9]+' | grep -oE '[0-9]+$'; } # tokens/s per GPU
    one=$(tps runs/bench1.txt)
    { echo "| scale-E64 | tokens/s per GPU | of one GPU | kernel time |"; echo "|---|---|---|---|"
      echo "| 1 GPU | $one | 100% | $(grep -o '[0-9.]* ms of kernels in [0-9.]* ms' runs/bench1.txt) |"; } > "$OUT/chunks.md"
    for run in "1 24 1" "2 24 1" "4 24 1" "8 24 1" "4 0 1" "4 24 2"; do # chunks, push thread blocks, GEMM waves
        set -- $run
        MOE_GROUPED_WAVES=$3 bench_ep2 150 parallel.exchange_chunks=$1 parallel.push_ctas=$2
        cp runs/bench2.txt "$OUT/bench_ep2_chunks$1_ctas$2_waves$3.txt"
        per=$(tps runs/bench2.txt)
        echo "| ep=2, exchange_chunks=$1, push_ctas=$2, MOE_GROUPED_WAVES=$3 | $per | $(awk -v a="${per:-0}" -v b="${one:-1}" 'BEGIN { printf "%.1f%%", 100 * a / b }') | $(grep -o '[0-9.]* ms of kernels in [0-9.]* ms' runs/bench2.txt) |" >> "$OUT/chunks.md"
    done
    cat "$OUT/chunks.md" | tee -a "$OUT/summary.txt"
    exit 0
fi

# Receive buffers bounded by parallel.recv_capacity: kernels against the CPU with rows dropped,
# a training curve against one GPU, and scale-E64's memory and speed at ep=2.
if [ "${1:-}" = capacity ]; then
    timeout 120 build/test_cuda exchange > "$OUT/test_cuda_moe.log" 2>&1
    say "CUDA vs CPU, MoE ops with the exchange: $(tail -1 "$OUT/test_cuda_moe.log")"; grep -i "fail" "$OUT/test_cuda_moe.log" | head
    timeout 60 mpirun -np 2 build/bench_exchange 2>&1 | tee -a "$OUT/summary.txt"
    one_gpu
    layouts_match "ep2cap parallel.ep=2 parallel.recv_capacity=1.25"
    say "ep2cap drop rate per MoE layer, last step: $(grep '"loss"' runs/ep2cap/metrics.jsonl | tail -1 | grep -o '"drop_rate":[^,}]*' | cut -d: -f2 | tr '\n' ' ')"
    bench_ep2 200 parallel.recv_capacity=1.25
    cp runs/bench2.txt "$OUT/bench_ep2_cap.txt"
    say "E64 ep=2 recv_capacity=1.25: $(grep -E '^step|throughput|^memory|^experts' runs/bench2.txt | tr -s ' ' | tr '\n' ' ')"
    exit 0
fi

rm -rf runs/launch runs/move1 runs/move2
one_gpu
say "one GPU: $(grep -m1 'step   100' runs/g1.log)"
layouts_match "dp2" "dp2after parallel.overlap_grad_reduce=false" "ep2 parallel.ep=2" "pp2 parallel.pp=2"
if run launch ./moe train --nproc 2 $SMALL parallel.ep=2; then
    say "ep2 (moe --nproc 2) vs one GPU: $(compare runs/launch runs/g1)"
else say "--nproc FAILED: $(grep -m3 -i error runs/launch.log)"; fi

# An expert-parallel checkpoint continues on one GPU and on CPU ranks.
if run move1 mpirun -np 2 ./moe train $SMALL parallel.ep=2 --stop-at 50; then
    cp -r runs/move1 runs/move2
    run move1 ./moe train $SMALL || true
    say "ep2 -> one GPU: $(grep -c 'resumed from' runs/move1.log) resume; $(compare runs/move1 runs/g1)"
    run move2 mpirun -np 2 ./moe train $SMALL train.device=cpu train.threads=8 || true
    say "ep2 -> CPU ranks: $(grep -c 'resumed from' runs/move2.log) resume; $(compare runs/move2 runs/g1)"
fi
[ "${1:-}" = all ] && overlap_bench
cat "$OUT/summary.txt"
