#!/usr/bin/env bash
# Parallel layouts on MPI ranks of this CPU: each layout trains the same tiny model on the same
# global batch and must give the losses of one rank; checkpoints move between layouts; optimizer
# memory falls with the data-parallel size; impossible layouts and failures end every rank.
# Prints one line per test and ends with "N passed, N failed".
set -u
cd "$(dirname "$0")/../.."
source tests/testlib.sh

require_mpi
MPIRUN="timeout 300 mpirun --oversubscribe"
make_tmp par

# 2 layers (pp 2), 4 experts (ep up to 4), 4 sequences per micro-batch (dp up to 4), 4 micro-
# batches (a real 1F1B schedule), dropless routing, loss-free bias on: every part is exercised.
TINY="model.d_model=32 model.n_layers=2 model.n_heads=2 model.n_kv_heads=1 model.n_experts=4
      model.top_k=2 model.expert_hidden=32 model.shared_hidden=16 model.bias_gamma=0.001
      train.seq_len=32 train.micro_batch=4 train.micro_batches=4 train.steps=10 train.warmup=3
      train.lr=3e-3 train.eval_every=5 train.eval_batches=2 train.ckpt_every=5 train.log_every=1
      train.threads=1 parallel.grad_bucket_mb=0"
losses() { grep -o '"loss":[^,]*' "$1/metrics.jsonl" | cut -d: -f2; }
val_losses() { grep -o '"val_loss":[^,]*' "$1/metrics.jsonl" | cut -d: -f2; }

# same_losses A B: every step's loss (and validation loss) agree within a relative 1e-5.
same_losses() {
    paste <(losses "$1"; val_losses "$1") <(losses "$2"; val_losses "$2") | awk '
        NF != 2 { bad = 1; print "missing value at line " NR; next }
        { d = $1 - $2; if (d < 0) d = -d; r = d / ($1 < 0 ? -$1 : $1); if (r > worst) { worst = r; at = NR }
          if (r > 1e-5) bad = 1 }
        END { printf "worst relative difference %.2e at line %d\n", worst, at; exit bad }'
}

train() { # NP OUT [args...]
    local np=$1 out=$2; shift 2
    $MPIRUN -np "$np" ./moe train $TINY train.out="$out" "$@" > "$out.log" 2>&1
}

train 1 "$tmp/single" || bad "one rank trains" "$(tail -5 "$tmp/single.log")"
[ "$(losses "$tmp/single" | wc -l)" -eq 10 ] && ok "one rank: 10 steps logged" || bad "one rank: 10 steps logged" "$(tail -3 "$tmp/single.log")"

layout_matches() { # NAME NP [overrides...]; the run's directory in $layout_out
    local name=$1 np=$2 out="$tmp/layout-$RANDOM"; shift 2
    layout_out=$out
    if ! train "$np" "$out" "$@"; then bad "$name" "$(tail -5 "$out.log")"; return; fi
    local cmp; cmp=$(same_losses "$tmp/single" "$out") && ok "$name: same losses ($cmp)" || bad "$name" "$cmp"
}
# Recomputing activations in the backward (train.recompute) gives the same numbers, bit for bit, as
# keeping them on the same layout; with expert parallelism, full recompute reruns each MoE layer's
# expert exchange on every ep rank (direct writes here, send/recv below).
same_bits() { [ "$(losses "$1"; val_losses "$1")" = "$(losses "$2"; val_losses "$2")" ]; } # REFERENCE_DIR DIR
first_diffs() { paste <(losses "$1") <(losses "$2") | awk '$1 != $2' | head -3; }
bitwise_as() { # NAME REFERENCE_DIR REFERENCE_NAME NP [overrides...]
    local name=$1 ref=$2 what=$3 np=$4 out="$tmp/bitwise-$RANDOM"; shift 4
    if ! train "$np" "$out" "$@"; then bad "$name" "$(tail -5 "$out.log")"; return; fi
    same_bits "$ref" "$out" && ok "$name: bitwise the losses of $what" || bad "$name" "$(first_diffs "$ref" "$out")"
}
recompute_bitwise() { # NAME REFERENCE_DIR NP [overrides...]
    bitwise_as "$1" "$2" train.recompute=none "${@:3}"
}
for mode in selective full; do recompute_bitwise "one rank, train.recompute=$mode" "$tmp/single" 1 train.recompute=$mode; done
layout_matches "dp=2" 2
dp2=$layout_out
layout_matches "dp=2 ep=2" 2 parallel.ep=2
layout_matches "pp=2" 2 parallel.pp=2
layout_matches "pp=2 x dp=2 ep=2" 4 parallel.pp=2 parallel.ep=2
pp2dp2=$layout_out
for mode in selective full; do
    recompute_bitwise "pp=2 x dp=2 ep=2, train.recompute=$mode" "$layout_out" 4 parallel.pp=2 parallel.ep=2 train.recompute=$mode
done
# train.precision=fp8 (expert and dense products in FP8, the CPU emulation) across stages and expert
# ranks: the first step's loss is one rank's bit for bit (a forward quantises each row alone); the
# weight gradients' token-major blocks of 128 rows start at each rank's own rows, so later losses
# differ a little (within 1e-3; measured 1e-4). A full recompute gives the layout's losses bit for bit.
near_fp8() { # REFERENCE_DIR DIR: the first loss bit for bit, the rest within 1e-3 (10 steps)
    paste <(losses "$1") <(losses "$2") |
        awk '{ d = $1 - $2; if (d < 0) d = -d; if (d > 1e-3 * $1 || (NR == 1 && d > 0)) bad = 1 } END { exit bad || NR != 10 }'
}
train 1 "$tmp/fp8_single" train.precision=fp8 || bad "fp8: one rank trains" "$(tail -5 "$tmp/fp8_single.log")"
if train 4 "$tmp/fp8_pp2" train.precision=fp8 parallel.pp=2 parallel.ep=2 && near_fp8 "$tmp/fp8_single" "$tmp/fp8_pp2"; then
    ok "fp8 pp=2 x dp=2 ep=2: one rank's first loss, the rest within 1e-3"
else bad "fp8 pp=2 x dp=2 ep=2 near one rank" "$(paste <(losses "$tmp/fp8_single") <(losses "$tmp/fp8_pp2") | head -10)"; fi
bitwise_as "fp8 pp=2 x dp=2 ep=2, train.recompute=full" "$tmp/fp8_pp2" train.recompute=none 4 train.precision=fp8 \
    parallel.pp=2 parallel.ep=2 train.recompute=full
# train.fp8_fused_update with two ranks in the experts' data-parallel group, on train.device=cpu-sharded
# (a compute copy apart from the master weights, as on GPUs): each rank quantises its part of the
# experts' weights under the whole tensor's block scales and the group gathers the codes. The same
# losses bit for bit as gathering the compute weights and quantising them whole (false); each rank
# counts only its part, so fewer weight values are counted.
f8u="train.precision=fp8 train.device=cpu-sharded"
weight_values() { grep -o '"weights":{"values":[0-9]*' "$1/metrics.jsonl" | head -1 | grep -o '[0-9]*$'; }
fp8_parts() { # NAME NP [overrides...]: the layout with the experts' codes by parts, then gathered whole
    local name=$1 np=$2 parts="$tmp/fp8_parts-$RANDOM" whole="$tmp/fp8_whole-$RANDOM"; shift 2
    if ! train "$np" "$parts" $f8u "$@" || ! train "$np" "$whole" $f8u train.fp8_fused_update=false "$@"; then
        bad "$name trains" "$(tail -5 "$parts.log" "$whole.log")"; return
    fi
    local said="the experts' FP8 codes quantised by parts"
    if same_bits "$whole" "$parts" && [ "$(weight_values "$parts")" -lt "$(weight_values "$whole")" ] &&
        grep -q "$said" "$parts.log" && ! grep -q "$said" "$whole.log"; then
        ok "$name, the experts' codes quantised by parts: bitwise the losses of the whole tensors"
    else bad "$name, the experts' codes by parts" "$(first_diffs "$whole" "$parts")" \
        "weight values $(weight_values "$parts") vs $(weight_values "$whole")"; fi
}
fp8_parts "fp8 dp=2" 2
fp8_parts "fp8 dp=4 ep=2" 4 parallel.ep=2
fp8_parts "fp8 pp=2 x dp=2" 4 parallel.pp=2
# train.fp8_fused_swiglu with several expert ranks and an expert_hidden of 128: the SwiGLU backward
# writes the gate|up gradient's FP8 operands (no row dots there), bitwise the passes apart
f8h="train.precision=fp8 parallel.ep=2 model.expert_hidden=128"
if train 2 "$tmp/fp8_swiglu_apart" $f8h train.fp8_fused_swiglu=false; then
    bitwise_as "fp8 dp=2 ep=2, expert_hidden 128, fused SwiGLU backward" "$tmp/fp8_swiglu_apart" "the passes apart" 2 $f8h
else bad "fp8 dp=2 ep=2, expert_hidden 128, the passes apart" "$(tail -5 "$tmp/fp8_swiglu_apart.log")"; fi
# Every run above queues each step before the previous one's metrics are read (train.launch_ahead);
# waiting for them first changes nothing, on one rank and across stages and expert ranks.
bitwise_as "one rank, train.launch_ahead=false" "$tmp/single" "launching ahead" 1 train.launch_ahead=false
bitwise_as "pp=2 x dp=2 ep=2, train.launch_ahead=false" "$pp2dp2" "launching ahead" 4 parallel.pp=2 parallel.ep=2 \
    train.launch_ahead=false
# train.optimizer_overlap: each step's update runs layer by layer during the next step's forward
# (the ZeRO-1 shards' weights gathered a layer at a time), flushed before the evaluations and
# checkpoints: the same operations on the same values, so bitwise the losses of the same layout
# without it, on one rank, across data-parallel and expert ranks and across stages.
bitwise_as "one rank, train.optimizer_overlap" "$tmp/single" "no overlap" 1 train.optimizer_overlap=true
bitwise_as "dp=2, train.optimizer_overlap" "$dp2" "no overlap" 2 train.optimizer_overlap=true
layout_matches "dp=2 ep=2, train.optimizer_overlap" 2 parallel.ep=2 train.optimizer_overlap=true
layout_matches "pp=2, train.optimizer_overlap" 2 parallel.pp=2 train.optimizer_overlap=true
bitwise_as "pp=2 x dp=2 ep=2, train.optimizer_overlap" "$pp2dp2" "no overlap" 4 parallel.pp=2 parallel.ep=2 \
    train.optimizer_overlap=true
layout_matches "dp=4 ep=4" 4 parallel.ep=4
layout_matches "dp=4 ep=2" 4 parallel.ep=2
dp4ep2=$layout_out
layout_matches "dp=4 ep=2, gradients reduced after the backward" 4 parallel.ep=2 parallel.overlap_grad_reduce=false
layout_matches "dp=4 ep=2, gradient buckets of at least 0.04 MB" 4 parallel.ep=2 parallel.grad_bucket_mb=0.04

# Interleaved 1F1B (parallel.virtual_stages): 4 layers as 4 virtual stages of one layer on 2 stages,
# against one rank of the same 4-layer model; with dp=2 ep=2 too (overlapped per-layer gradient
# reduction across the chunks), and a checkpoint saved interleaved resumed on one rank.
DEEP="model.n_layers=4"
train 1 "$tmp/single4" $DEEP || bad "one rank, 4 layers" "$(tail -5 "$tmp/single4.log")"
interleaved_matches() { # NAME NP [overrides...]
    local name=$1 np=$2 out="$tmp/interleaved-$RANDOM"; shift 2
    if ! train "$np" "$out" $DEEP parallel.pp=2 parallel.virtual_stages=2 "$@"; then bad "$name" "$(tail -5 "$out.log")"; return; fi
    grep -q "interleaved 1F1B, 2 chunks a stage" "$out.log" || { bad "$name" "not interleaved: $(grep layout "$out.log")"; return; }
    local cmp; cmp=$(same_losses "$tmp/single4" "$out") && ok "$name: same losses ($cmp)" || bad "$name" "$cmp"
}
interleaved_matches "pp=2 interleaved (2 chunks a stage)" 2
interleaved_matches "pp=2 interleaved x dp=2 ep=2" 4 parallel.ep=2
interleaved_matches "pp=2 interleaved x dp=2 ep=2, train.optimizer_overlap" 4 parallel.ep=2 train.optimizer_overlap=true
out="$tmp/interleaved-move"
if train 2 "$out" $DEEP parallel.pp=2 parallel.virtual_stages=2 --stop-at 5 && train 1 "$out" $DEEP; then
    cmp=$(same_losses "$tmp/single4" "$out") && ok "save interleaved, resume on 1 rank ($cmp)" || bad "save interleaved, resume on 1 rank" "$cmp"
else bad "save interleaved, resume on 1 rank" "$(tail -5 "$out.log")"; fi

# The two ways expert rows travel give the same numbers: direct writes into the owners' shared
# memory (the default on one node) and MPI transfers planned on the host.
out="$tmp/sendrecv"
if train 4 "$out" parallel.ep=4 parallel.exchange=sendrecv && grep -q "expert rows by send/recv" "$out.log"; then
    direct=$(grep -l "dp 4 (ep 4" "$tmp"/layout-*.log | head -1)
    if [ -n "$direct" ] && grep -q "expert rows written into peers' memory" "$direct" && \
       cmp -s <(losses "${direct%.log}") <(losses "$out"); then
        ok "dp=4 ep=4: direct writes and send/recv give identical losses"
    else bad "dp=4 ep=4: direct writes and send/recv give identical losses" "direct log: '$direct'"; fi
else bad "dp=4 ep=4 by send/recv" "$(tail -3 "$out.log")"; fi
recompute_bitwise "dp=4 ep=4 by send/recv, train.recompute=full" "$tmp/sendrecv" 4 parallel.ep=4 parallel.exchange=sendrecv \
    train.recompute=full

# Random routing draws the same noise for a token whatever rank holds it.
train 1 "$tmp/random1" model.random_routing=true || bad "random routing on one rank" "$(tail -3 "$tmp/random1.log")"
out="$tmp/random4"
if train 4 "$out" model.random_routing=true parallel.pp=2 parallel.ep=2; then
    cmp=$(same_losses "$tmp/random1" "$out") && ok "random routing, pp=2 x dp=2 ep=2: same losses" || bad "random routing, pp=2 x dp=2 ep=2" "$cmp"
else bad "random routing, pp=2 x dp=2 ep=2" "$(tail -3 "$out.log")"; fi

# Capacity mode: each rank drops by its own capacity (so no single-rank equivalent); it must run
# and report drops summed over the ranks.
out="$tmp/capacity"
if train 4 "$out" parallel.ep=4 model.capacity_factor=0.5 model.bias_gamma=0; then
    grep -q '"drop_rate":0\.[0-9]*[1-9]' "$out/metrics.jsonl" && ok "capacity 0.5 at dp=4 ep=4: runs, reports drops" \
        || bad "capacity 0.5 at dp=4 ep=4: runs, reports drops" "no non-zero drop_rate"
else bad "capacity 0.5 at dp=4 ep=4: runs, reports drops" "$(tail -3 "$out.log")"; fi

# Receive buffers of the direct exchange bounded by parallel.recv_capacity: at 2 (what a rank can
# receive at most here: 1 expert per rank, top-2 of 4) nothing is dropped and the losses are one
# rank's; at 0.5 rows are dropped, counted and reported.
layout_matches "dp=4 ep=4, receive buffers of 2 x routed rows" 4 parallel.ep=4 parallel.recv_capacity=2
out="$tmp/recvcap"
if train 4 "$out" parallel.ep=4 parallel.recv_capacity=0.5 model.bias_gamma=0; then
    grep -q '"drop_rate":0\.[0-9]*[1-9]' "$out/metrics.jsonl" && ok "receive buffers of 0.5 x routed rows: runs, reports drops" \
        || bad "receive buffers of 0.5 x routed rows: runs, reports drops" "no non-zero drop_rate"
else bad "receive buffers of 0.5 x routed rows: runs, reports drops" "$(tail -3 "$out.log")"; fi

# The expert exchange behind compute (parallel.exchange_chunks): an MoE layer's experts in chunks
# whose rows travel (direct writes, fences between the ranks) while the previous chunk computes,
# at ep 2, 4 and 8. The CPU runs the side queue in order, so the schedule's chunks, pushes and
# fences are the GPU's, while every value must be the one-chunk exchange's, bit for bit. 16 experts
# (8, 4 and 2 per rank), 8 sequences per micro-batch (dp up to 8).
CHUNKY="model.n_experts=16 train.micro_batch=8 train.micro_batches=2 train.steps=4 train.eval_every=4
        train.eval_batches=1 train.ckpt_every=0"
train 1 "$tmp/chunky" $CHUNKY || bad "one rank, 16 experts" "$(tail -5 "$tmp/chunky.log")"
chunked() { # NAME NP EP CHUNKS REFERENCE [overrides...]: REFERENCE's losses bitwise (one rank's
            # within 1e-5 when it is that run); the run's directory in $run_out
    local name=$1 np=$2 ep=$3 chunks=$4 ref=$5 out="$tmp/chunks-$RANDOM"; shift 5
    run_out=$out
    if ! train "$np" "$out" $CHUNKY parallel.ep=$ep parallel.exchange_chunks=$chunks "$@"; then
        bad "$name" "$(tail -5 "$out.log")"; return
    fi
    if [ "$chunks" -gt 1 ] && ! grep -q "written into peers' memory in $chunks chunks" "$out.log"; then
        bad "$name" "not chunked: $(grep -o 'expert rows.*' "$out.log")"; return
    fi
    local cmp
    if [ "$ref" = "$tmp/chunky" ]; then
        cmp=$(same_losses "$ref" "$out") && ok "$name: one rank's losses ($cmp)" || bad "$name" "$cmp"
    elif [ "$(losses "$ref"; val_losses "$ref")" = "$(losses "$out"; val_losses "$out")" ]; then
        ok "$name: bitwise the one-chunk losses"
    else bad "$name" "$(paste <(losses "$ref") <(losses "$out") | head -3)"; fi
}
declare -A one_chunk
for layout in "2 2 8" "4 4 4" "8 8 2" "4 2 8"; do # ranks, ep, experts per rank (the most chunks)
    set -- $layout
    chunked "dp=$1 ep=$2, 16 experts, the exchange in one piece" "$1" "$2" 1 "$tmp/chunky"
    one_chunk[$1.$2]=$run_out
    for chunks in $(printf '%s\n' 2 "$3" | sort -u); do
        chunked "dp=$1 ep=$2, experts in $chunks chunks" "$1" "$2" "$chunks" "${one_chunk[$1.$2]}"
    done
done
# Recomputing activations in the backward (full recompute reruns each chunked exchange); pushes
# bounded to a GPU's SM budget (no effect on values); chunks that do not divide the experts held
# are lowered to the most that do (3 of 8: 2; 16 of 2: 2).
for mode in selective full; do
    chunked "dp=4 ep=4, 4 chunks, train.recompute=$mode" 4 4 4 "${one_chunk[4.4]}" train.recompute=$mode
done
chunked "dp=8 ep=8, 2 chunks, pushes of 1 thread block" 8 8 2 "${one_chunk[8.8]}" parallel.push_ctas=1
for ask in "2 3" "8 16"; do # ranks (= ep), chunks asked
    set -- $ask
    out="$tmp/chunks-asked-$2"
    if train "$1" "$out" $CHUNKY parallel.ep=$1 parallel.exchange_chunks=$2 train.steps=1 && grep -q "in 2 chunks" "$out.log"; then
        ok "dp=$1 ep=$1, $2 chunks asked: 2"
    else bad "dp=$1 ep=$1, $2 chunks asked: 2" "$(grep -o 'expert rows.*' "$out.log"; tail -2 "$out.log")"; fi
done

# train.fp8_exchange: the experts' inputs and the down projections' output gradients travel as FP8
# codes and row-major scales (48 bytes a row here against 128), and the weight gradients read their
# values dequantised, on one rank too. At a learning rate of 1e-30 the weights never move, so every
# step's loss is its forward's: through the FP8 exchange, bitwise the act-precision exchange's, with
# as many values quantised (the shares flushed may differ: the token-major copies are made from the
# dequantised values). In training: one rank's first loss (with the switch), within 1e-3 after, as
# fp8 above; every recompute mode, chunk count and transport gives the layout's losses bit for bit.
FP8X="train.precision=fp8 train.fp8_exchange=true"
still() { train 2 "$1" train.precision=fp8 parallel.ep=2 train.lr=1e-30 "${@:2}"; } # DIR [overrides...]
fp8_values() { grep -o '"values":[0-9.e+]*' "$1/metrics.jsonl"; }
name="fp8 exchange, dp=2 ep=2, weights still"
if still "$tmp/fp8x-act" && still "$tmp/fp8x-still" train.fp8_exchange=true &&
    grep -q "48 bytes a row to the experts as FP8 codes and scales (128 back)" "$tmp/fp8x-still.log"; then
    if same_bits "$tmp/fp8x-act" "$tmp/fp8x-still" && [ "$(fp8_values "$tmp/fp8x-act")" = "$(fp8_values "$tmp/fp8x-still")" ]
    then ok "$name: 48 bytes a row; bitwise the act-precision exchange's losses, as many values quantised"
    else bad "$name" "$(first_diffs "$tmp/fp8x-act" "$tmp/fp8x-still")"; fi
else bad "$name" "$(grep -o 'expert rows.*' "$tmp/fp8x-still.log"; tail -3 "$tmp/fp8x-still.log")"; fi
# ... and with receive buffers bounded (parallel.recv_capacity): the same rows dropped both ways.
drops() { grep -o '"drop_rate":[0-9.e+-]*' "$1/metrics.jsonl"; }
name="fp8 exchange, dp=2 ep=2, weights still, receive capacity 0.6"
if still "$tmp/fp8x-act-cap" parallel.recv_capacity=0.6 &&
    still "$tmp/fp8x-still-cap" train.fp8_exchange=true parallel.recv_capacity=0.6 &&
    same_bits "$tmp/fp8x-act-cap" "$tmp/fp8x-still-cap" && [ "$(drops "$tmp/fp8x-act-cap")" = "$(drops "$tmp/fp8x-still-cap")" ] &&
    drops "$tmp/fp8x-still-cap" | grep -qv '"drop_rate":0\.0$'; then
    ok "$name: bitwise the act-precision exchange's losses and drop rates (some rows dropped)"
else bad "$name" "$(first_diffs "$tmp/fp8x-act-cap" "$tmp/fp8x-still-cap"; drops "$tmp/fp8x-still-cap" | sort | uniq -c | head -3)"; fi
train 1 "$tmp/fp8x_single" $FP8X || bad "fp8 exchange: one rank trains" "$(tail -5 "$tmp/fp8x_single.log")"
if train 4 "$tmp/fp8x_pp2" $FP8X parallel.pp=2 parallel.ep=2 && near_fp8 "$tmp/fp8x_single" "$tmp/fp8x_pp2"; then
    ok "fp8 exchange, pp=2 x dp=2 ep=2: one rank's first loss, the rest within 1e-3"
else bad "fp8 exchange, pp=2 x dp=2 ep=2 near one rank" "$(paste <(losses "$tmp/fp8x_single") <(losses "$tmp/fp8x_pp2") | head -10)"; fi
for mode in selective full; do
    bitwise_as "fp8 exchange, one rank, train.recompute=$mode" "$tmp/fp8x_single" train.recompute=none 1 $FP8X \
        train.recompute=$mode
    bitwise_as "fp8 exchange, pp=2 x dp=2 ep=2, train.recompute=$mode" "$tmp/fp8x_pp2" train.recompute=none 4 $FP8X \
        parallel.pp=2 parallel.ep=2 train.recompute=$mode
done
train 4 "$tmp/fp8x_chunky" $CHUNKY $FP8X parallel.ep=2 || bad "fp8 exchange, 16 experts" "$(tail -5 "$tmp/fp8x_chunky.log")"
chunked "fp8 exchange, dp=4 ep=2, experts in 8 chunks" 4 2 8 "$tmp/fp8x_chunky" $FP8X
bitwise_as "fp8 exchange, dp=4 ep=2 by send/recv" "$tmp/fp8x_chunky" "direct writes" 4 $CHUNKY $FP8X parallel.ep=2 \
    parallel.exchange=sendrecv

# Checkpoints move between layouts: stop at step 5 on one layout, finish on another.
resume_matches() { # NAME NP_FIRST "ARGS_FIRST" NP_SECOND "ARGS_SECOND"
    local name=$1 out="$tmp/move-$RANDOM"
    if ! train "$2" "$out" $3 --stop-at 5 || ! train "$4" "$out" $5; then bad "$name" "$(tail -5 "$out.log")"; return; fi
    grep -q "resumed from .*step-5" "$out.log" || { bad "$name" "did not resume: $(head -3 "$out.log")"; return; }
    local cmp; cmp=$(same_losses "$tmp/single" "$out") && ok "$name ($cmp)" || bad "$name" "$cmp"
}
resume_matches "save at pp=2 x dp=2 ep=2, resume on 1 rank" 4 "parallel.pp=2 parallel.ep=2" 1 ""
resume_matches "save on 1 rank, resume at pp=2 x dp=2 ep=2" 1 "" 4 "parallel.pp=2 parallel.ep=2"
resume_matches "save at dp=4 ep=4, resume at pp=2 dp=2" 4 "parallel.ep=4" 4 "parallel.pp=2"

# ZeRO-1 done fully: where the compute weights are a copy of their own (a GPU's bf16; on CPU ranks
# train.device=cpu-sharded), each rank's fp32 master weights are only its shard of each region. The
# losses and the checkpoint files are bitwise those of whole master weights on the same layout, and
# checkpoints move between the two, both ways, with bitwise the same continuation.
master_held() { sed -nE 's/.*holds ([0-9]+) parameters \(([0-9]+) in its fp32 master.*/\1 \2/p' "$1" | head -1; }
sharded_out="$tmp/none" # the dp=2 run's directory
sharded_matches() { # NAME REFERENCE_DIR (whole master weights) NP [overrides...]
    local name=$1 ref=$2 np=$3 out="$tmp/sharded-$RANDOM" f held master held_ref master_ref; shift 3
    if ! train "$np" "$out" train.device=cpu-sharded "$@"; then bad "$name" "$(tail -5 "$out.log")"; return; fi
    read -r held master <<<"$(master_held "$out.log")"; read -r held_ref master_ref <<<"$(master_held "$ref.log")"
    if ! [ "${master:-0}" -gt 0 ] || ! [ "$master" -lt "$held" ] || [ "$master_ref" != "$held_ref" ]; then
        bad "$name" "rank 0's master weights: $master of $held sharded, $master_ref of $held_ref whole"; return; fi
    same_bits "$ref" "$out" || { bad "$name" "$(first_diffs "$ref" "$out")"; return; }
    for f in "$ref"/step-10/*.safetensors; do
        cmp -s "$f" "$out/step-10/${f##*/}" || { bad "$name" "step-10/${f##*/} differs"; return; }
    done
    ok "$name: rank 0's master weights $master of $held; bitwise the losses and checkpoint of whole ones"
    sharded_out=$out
}
sharded_matches "dp=2, sharded fp32 master weights" "$dp2" 2
want=$(./moe eval --ckpt "$dp2" 2>&1); got=$(./moe eval --ckpt "$sharded_out" 2>&1) # its config's train.device
grep -q "val loss" <<<"$got" && [ "$got" = "$want" ] && ok "moe eval of that checkpoint on train.device=cpu-sharded: the same loss" \
    || bad "moe eval of that checkpoint on train.device=cpu-sharded: the same loss" "$got vs $want"
sharded_matches "dp=4 ep=2 (experts sharded over 2), sharded fp32 master weights" "$dp4ep2" 4 parallel.ep=2
sharded_matches "pp=2 x dp=2 ep=2, sharded fp32 master weights" "$pp2dp2" 4 parallel.pp=2 parallel.ep=2
sharded_matches "dp=4 ep=2, sharded, train.optimizer_overlap" "$dp4ep2" 4 parallel.ep=2 train.optimizer_overlap=true
# FP8 with a compute copy of its own: the experts' compute weights are staged a tensor at a time and
# gathered there over the ranks holding the same experts (dp 4 over ep 2: pairs), beside the forward,
# or with one rank holding each expert (pp 2 x dp 2 over ep 2) with nothing to gather.
train 4 "$tmp/fp8_dp4ep2" train.precision=fp8 parallel.ep=2 || bad "fp8 dp=4 ep=2 trains" "$(tail -5 "$tmp/fp8_dp4ep2.log")"
sharded_matches "fp8 dp=4 ep=2, sharded, the experts' compute weights staged, train.optimizer_overlap" \
    "$tmp/fp8_dp4ep2" 4 train.precision=fp8 parallel.ep=2 train.optimizer_overlap=true
sharded_matches "fp8 pp=2 x dp=2 ep=2, sharded, the experts' compute weights staged" "$tmp/fp8_pp2" 4 \
    train.precision=fp8 parallel.pp=2 parallel.ep=2
resume_bitwise() { # NAME REFERENCE_DIR NP "ARGS_FIRST" "ARGS_SECOND"
    local name=$1 ref=$2 np=$3 out="$tmp/reshard-$RANDOM"
    if ! train "$np" "$out" $4 --stop-at 5 || ! train "$np" "$out" $5; then bad "$name" "$(tail -5 "$out.log")"; return; fi
    grep -q "resumed from .*step-5" "$out.log" || { bad "$name" "did not resume: $(head -3 "$out.log")"; return; }
    same_bits "$ref" "$out" && ok "$name: bitwise the uninterrupted run" || bad "$name" "$(first_diffs "$ref" "$out")"
}
resume_bitwise "dp=2: save with sharded master weights, resume with whole ones" "$dp2" 2 "train.device=cpu-sharded" ""
resume_bitwise "dp=4 ep=2: save with whole master weights, resume with sharded ones" "$dp4ep2" 4 "parallel.ep=2" \
    "parallel.ep=2 train.device=cpu-sharded"
resume_matches "save sharded at dp=4 ep=2, resume on 1 rank" 4 "parallel.ep=2 train.device=cpu-sharded" 1 ""
resume_bitwise "fp8 dp=4 ep=2, sharded: save and resume, the experts' compute weights staged from the load" \
    "$tmp/fp8_dp4ep2" 4 "train.precision=fp8 parallel.ep=2 train.device=cpu-sharded" \
    "train.precision=fp8 parallel.ep=2 train.device=cpu-sharded"
resume_matches "save on 1 rank, resume sharded at pp=2 x dp=2 ep=2" 1 "" 4 "parallel.pp=2 parallel.ep=2 train.device=cpu-sharded"

out=$(./moe eval --ckpt "$tmp/single" 2>&1) && grep -q "val loss" <<<"$out" && ok "one-process eval reads a checkpoint" || bad "one-process eval reads a checkpoint" "$out"
ls "$tmp"/move-*/step-10/ | grep -q "model-00002-of-00002.safetensors" && ok "pp=2 checkpoint has one file per stage" \
    || bad "pp=2 checkpoint has one file per stage" "$(ls "$tmp"/move-*/step-10/)"

# ZeRO-1: optimizer state per rank at dp=4 is a quarter of dp=1 (experts replicated: ep=1).
state_bytes() { grep -o 'optimizer state [0-9,]* bytes' "$1" | tr -dc '0-9'; }
train 4 "$tmp/dp4" train.steps=1 train.eval_every=0 || bad "dp=4 runs" "$(tail -3 "$tmp/dp4.log")"
one=$(state_bytes "$tmp/single.log"); four=$(state_bytes "$tmp/dp4.log")
if [ -n "$one" ] && [ -n "$four" ] && awk -v a="$one" -v b="$four" 'BEGIN { r = 4 * b / a; exit !(r > 0.99 && r < 1.02) }'; then
    ok "optimizer state per rank: dp=4 is 1/4 of dp=1 ($four vs $one bytes)"
else bad "optimizer state per rank: dp=4 is 1/4 of dp=1" "dp=1: '$one', dp=4: '$four'"; fi
inspect=$(./moe inspect "$tmp/single" --world 4 2>&1)
grep -q "optimizer state" <<<"$inspect" && ok "inspect prints per-rank memory for a layout" || bad "inspect prints per-rank memory for a layout" "$inspect"
inspect=$(./moe inspect "$tmp/single" parallel.ep=4 --world 4 2>&1)
whole=$(grep -E "^ +total +[0-9]" <<<"$inspect" | grep -oE "[0-9.]+ GiB" | sed -n 2p | grep -oE "^[0-9.]+")
bounded=$(grep -oE "recv_capacity=2 +[0-9.]+" <<<"$inspect" | grep -oE "[0-9.]+$")
if awk -v a="${whole:-0}" -v b="${bounded:-0}" 'BEGIN { exit !(b > 0 && b < a) }'; then
    ok "inspect at ep=4: bounded receive buffers plan less ($bounded < $whole GiB)"
else bad "inspect at ep=4: bounded receive buffers plan less" "$inspect"; fi
exchange_gib() { # [overrides...]: the GPU column of an fp8 plan's exchange buffers at ep=2, d_model 128
    ./moe inspect "$tmp/single" train.precision=fp8 parallel.ep=2 model.d_model=128 --world 2 "$@" 2>&1 |
        awk '/expert exchange buffers/ { print $(NF - 1) }'
}
act=$(exchange_gib) fp8=$(exchange_gib train.fp8_exchange=true)
if awk -v a="${act:-0}" -v b="${fp8:-0}" 'BEGIN { exit !(b > 0 && b < a) }'; then
    ok "inspect at ep=2: FP8 exchange buffers plan less ($fp8 < $act GiB)"
else bad "inspect at ep=2: FP8 exchange buffers plan less" "act '$act', fp8 '$fp8'"; fi

# Impossible layouts are refused before any work, by every rank, promptly.
expect_refused() { # NAME PATTERN NP [overrides...]
    local name=$1 pattern=$2 np=$3; shift 3
    local start=$SECONDS out; out=$($MPIRUN -np "$np" ./moe train $TINY train.out="$tmp/never" "$@" 2>&1); local rc=$?
    if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -qE -- "$pattern" <<<"$out" && [ ! -e "$tmp/never/config.json" ]; then
        ok "$name ($((SECONDS - start)) s)"
    else bad "$name" "exit $rc: $(grep -m2 error <<<"$out")"; fi
}
expect_refused "world not divisible by pp" "3 ranks cannot form parallel.pp = 2" 3 parallel.pp=2
expect_refused "ep does not divide dp" "parallel.ep = 4 must divide the data-parallel size 2" 2 parallel.ep=4
expect_refused "more stages than layers" "parallel.pp = 4 stages is more than model.n_layers = 2" 4 parallel.pp=4
expect_refused "interleaving with micro-batches not in groups of pp" "train.micro_batches = 3 must be a multiple of 2" \
    2 parallel.pp=2 parallel.virtual_stages=2 train.micro_batches=3 $DEEP
expect_refused "more chunks than layers" "parallel.pp = 2 stages x parallel.virtual_stages = 2 chunks is more than model.n_layers = 2" \
    2 parallel.pp=2 parallel.virtual_stages=2
expect_refused "negative watchdog timeout" "train.comm_timeout = -1 must be >= 0" 2 train.comm_timeout=-1
expect_refused "receive capacity with send/recv" "parallel.recv_capacity bounds the direct exchange" 2 \
    parallel.ep=2 parallel.exchange=sendrecv parallel.recv_capacity=1.5
expect_refused "negative gradient bucket" "parallel.grad_bucket_mb = -2 must be >= 0" 2 parallel.grad_bucket_mb=-2
expect_refused "negative receive capacity" "parallel.recv_capacity = -1 must be >= 0" 2 parallel.recv_capacity=-1
expect_refused "no exchange chunks" "parallel.exchange_chunks = 0 must be at least 1" 2 parallel.exchange_chunks=0
expect_refused "micro-batch not divisible by dp" "train.micro_batch = 4 .* multiple of the data-parallel size 3" 3
# Ranks started with different settings (mpirun MPMD: A : B) are refused before any collective that
# they would size differently (that corrupted the heap in the reduce-scatter), naming the setting.
mpmd_refused() { # NAME PATTERN "RANK 0: [mpirun options] program args" "RANK 1: the same"
    local name=$1 pattern=$2 out rc
    out=$($MPIRUN -np 1 $3 : -np 1 $4 2>&1); rc=$?
    if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -q -- "$pattern" <<<"$out" && [ ! -e "$tmp/mpmd/config.json" ]; then ok "$name"
    else bad "$name" "exit $rc: $(grep -m3 -iE "error|signal|corrupt" <<<"$out")"; fi
}
mpmd_refused "ranks with different learning rates" "rank 1 has 'train.lr = 0.01' where rank 0 has 'train.lr = 0.003" \
    "./moe train $TINY train.out=$tmp/mpmd" "./moe train $TINY train.out=$tmp/mpmd train.lr=0.01"
mpmd_refused "ranks with different seeds" "rank 1 has 'train.seed = 2' where rank 0 has 'train.seed = 1'" \
    "./moe train $TINY train.out=$tmp/mpmd" "./moe train $TINY train.out=$tmp/mpmd train.seed=2"
mkdir -p "$tmp/wa/data" "$tmp/wb/data"
head -c 40000 data/tinyshakespeare_train.npy > "$tmp/wa/data/d.npy"
head -c 30000 data/tinyshakespeare_train.npy > "$tmp/wb/data/d.npy"
mpmd_refused "ranks whose data file differs in size" "rank 1 has 'data.train file 0 = data/d.npy (30000 bytes)' where rank 0 has 'data.train file 0 = data/d.npy (40000 bytes)'" \
    "--wdir $tmp/wa $PWD/moe train $TINY data.train=data/d.npy data.val= train.out=$tmp/mpmd" \
    "--wdir $tmp/wb $PWD/moe train $TINY data.train=data/d.npy data.val= train.out=$tmp/mpmd"
mpmd_refused "ranks with different --stop-at" "rank 1 has '--stop-at = 3' where rank 0 has '--stop-at = 0'" \
    "./moe train $TINY train.out=$tmp/mpmd" "./moe train $TINY train.out=$tmp/mpmd --stop-at 3"

start=$SECONDS
out=$($MPIRUN -np 4 ./moe train $TINY train.out="$tmp/nan" parallel.pp=2 train.lr=1e30 train.warmup=0 train.clip=0 train.steps=20 2>&1); rc=$?
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -q "training diverged" <<<"$out"; then ok "divergence on 4 ranks ends all of them ($((SECONDS - start)) s)"
else bad "divergence on 4 ranks ends all of them" "exit $rc: $(tail -3 <<<"$out")"; fi

# A rank that stops answering (SIGSTOP: alive, silent, as in a hang) must not leave its peers
# waiting forever: their watchdog ends them after train.comm_timeout and mpirun stops the job.
out="$tmp/hang"
$MPIRUN -np 2 ./moe train $TINY train.out="$out" train.steps=1000000 train.eval_every=0 \
    train.ckpt_every=0 train.log_every=100000 train.comm_timeout=3 > "$out.log" 2>&1 &
job=$!
for _ in $(seq 300); do [ -s "$out/metrics.jsonl" ] && break; sleep 0.1; done
victim=$(newest_moe_pid "train.out=$out ")
start=$SECONDS
if [ -n "$victim" ] && kill -STOP "$victim"; then
    wait $job; rc=$?; took=$((SECONDS - start))
    if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $took -ge 3 ] && grep -q "no progress for [0-9]* s at step [0-9]* (training step)" "$out.log"; then
        ok "a silent rank: the watchdog ends the job after ${took} s (timeout 3 s)"
    else bad "a silent rank: the watchdog ends the job" "exit $rc after $took s: $(grep -m2 error "$out.log")"; fi
else bad "a silent rank: the watchdog ends the job" "no rank process found to stop"; kill $job; fi
pkill -9 -f "train.out=$out " 2>/dev/null

summary
