#!/usr/bin/env bash
# moe plan and moe bench --calibrate: the planner against every recorded measurement in
# tests/data/plan-measured.tsv (prints each prediction's error; fails when memory is off by more than
# 3%, or a GPU step time by more than 10%), the calibration file format written on the CPU (one rank
# and, with MPI, two) and read without its optional FP8 families, the layout search and its errors.
# Prints one line per test and ends with "N passed, N failed".
set -u
cd "$(dirname "$0")/../.."
source tests/testlib.sh

tmp=$(mktemp -d /tmp/moe-plan-XXXXXX)
trap 'rm -rf "$tmp"' EXIT

# field NAME OUTPUT: the number after "NAME" at the start of a line of moe plan's detail block.
field() { grep -E "^$1 " <<<"$2" | head -1 | grep -oE '[0-9]+\.[0-9]+' | head -1; }
# pct PREDICTED MEASURED: the relative error in percent, as printed; within PREDICTED MEASURED LIMIT:
# whether it is at most LIMIT percent either way, unrounded (a miss by 0.04% is not rounded to the bound).
pct() { awk -v p="$1" -v m="$2" 'BEGIN { printf "%+.2f", 100 * (p - m) / m }'; }
within() { awk -v p="$1" -v m="$2" -v lim="$3" 'BEGIN { e = 100 * (p - m) / m; exit !(e <= lim && e >= -lim) }'; }

while IFS=$'\t' read -r name config overrides gpus gpu calib layout step_ms mem_gib source; do
    [[ -z "$name" || "$name" == \#* ]] && continue
    [ "$overrides" = "-" ] && overrides=""
    out=$(./moe plan "$config" $overrides --gpus "$gpus" --gpu "$gpu" --calibration "$calib" --layout "$layout" 2>&1)
    step=$(field step "$out"); mem=$(field memory "$out")
    if [ -z "$step" ] || [ -z "$mem" ]; then bad "plan: $name" "$out"; continue; fi
    t_err=$(pct "$step" "$step_ms")
    line="$name: step $step vs $step_ms ms ($t_err%)"
    ok_time=1
    [ "$gpu" != cpu ] && ! within "$step" "$step_ms" 10 && ok_time=0
    ok_mem=1
    if [ "$mem_gib" != "-" ]; then
        m_err=$(pct "$mem" "$mem_gib")
        line="$line, memory $mem vs $mem_gib GiB ($m_err%)"
        within "$mem" "$mem_gib" 3 || ok_mem=0
    fi
    if [ $ok_time = 1 ] && [ $ok_mem = 1 ]; then ok "plan: $line"; else bad "plan: $line" "$source"; fi
done < tests/data/plan-measured.tsv

# The calibration format, written on this CPU from a tiny model (seconds), read back by moe plan.
TINY="model.d_model=32 model.n_layers=2 model.n_heads=2 model.n_kv_heads=1 model.n_experts=4 model.top_k=2
      model.expert_hidden=32 train.seq_len=32 train.micro_batch=4 train.threads=1"
out=$(./moe bench --calibrate "$tmp/cpu.json" $TINY 2>&1)
families=$(grep -oE '"(dense_gemm|grouped_fwd|grouped_dgrad|grouped_wgrad|attention_fwd|attention_bwd|fp8_grouped|fp8_grouped_wgrad|fp8_dense|elementwise|qk_norm_rope|routing|optimizer|fp8_quantize)"' "$tmp/cpu.json" 2>/dev/null | sort -u | wc -l)
if [ "$families" -eq 14 ] && ! grep -q "no rates of its own" "$tmp/cpu.json" && grep -q '"comm": null' "$tmp/cpu.json"; then
    ok "bench --calibrate on one CPU rank: 14 kernel families, no comm"
else bad "bench --calibrate on one CPU rank" "$out"; fi
out=$(./moe plan configs/bench/scale-E8.json $TINY --gpu cpu --calibration "$tmp/cpu.json" --gpus 1 --layout pp=1 2>&1)
[ -n "$(field step "$out")" ] && ok "plan reads a calibration written here" || bad "plan reads a calibration written here" "$out"

# The FP8 families are optional: a calibration from before them (the one written here less those
# families) prices fp8 exactly as one whose FP8 families are the bf16 ones they replace, and says so;
# the FP8 families measured here (the CPU's emulation: far slower) change the fp8 step, not bf16's.
without_fp8() { # the calibration $1 less its FP8 families (the comma of the block before a removed last one too)
    awk '/^    "fp8_[a-z_]+": \{$/ { skip = 1; next }
         skip { if (/^    \},?$/) skip = 0; next }
         { if (n++) { if (/^  \},?$/) sub(/,$/, "", prev); print prev } prev = $0 }
         END { print prev }' "$1"
}
fp8_as_bf16() { # the calibration $1 (no FP8 families) with each FP8 family a copy of the bf16 one it replaces
    awk 'BEGIN { m["grouped_fwd"] = "fp8_grouped"; m["grouped_wgrad"] = "fp8_grouped_wgrad"
                 m["dense_gemm"] = "fp8_dense"; m["elementwise"] = "fp8_quantize" }
         { print }
         /^    "[a-z0-9_]+": \{$/ { split($0, q, "\""); copy = q[2] in m; if (copy) block = "    \"" m[q[2]] "\": {"; next }
         copy { block = block "\n" $0; if (/^    \},$/) { print block; copy = 0 } }' "$1"
}
without_fp8 "$tmp/cpu.json" > "$tmp/old.json"
fp8_as_bf16 "$tmp/old.json" > "$tmp/copied.json"
plan_tiny() { ./moe plan configs/bench/scale-E8.json $TINY "$@" --gpu cpu --gpus 1 --layout pp=1 2>&1; }
old=$(plan_tiny train.precision=fp8 --calibration "$tmp/old.json")
copied=$(plan_tiny train.precision=fp8 --calibration "$tmp/copied.json")
measured=$(plan_tiny train.precision=fp8 --calibration "$tmp/cpu.json")
if ! grep -q fp8_ "$tmp/old.json" && [ -n "$(field step "$old")" ] && [ "$(field step "$old")" = "$(field step "$copied")" ] &&
    grep -qE "^ +FP8 families not in it, .*: fp8_grouped as grouped_fwd, fp8_grouped_wgrad as grouped_wgrad, fp8_dense as dense_gemm, fp8_quantize as elementwise$" <<<"$old" &&
    ! grep -q "FP8 families not in it" <<<"$copied"; then
    ok "a calibration without FP8 families prices them as bf16"
else bad "a calibration without FP8 families prices them as bf16" "$old" "$copied"; fi
if [ "$(field step "$measured")" != "$(field step "$old")" ] &&
    [ "$(field step "$(plan_tiny --calibration "$tmp/cpu.json")")" = "$(field step "$(plan_tiny --calibration "$tmp/old.json")")" ]; then
    ok "measured FP8 families change the fp8 step only"
else bad "measured FP8 families change the fp8 step only" "$measured" "$old"; fi
out=$(./moe plan configs/bench/scale-E8.json $TINY --gpu cpu --calibration "$tmp/cpu.json" --gpus 2 2>&1)
grep -q "no communication rates" <<<"$out" && ok "plan refuses ranks a calibration has no links for" \
    || bad "plan refuses ranks a calibration has no links for" "$out"
if [ -x build/test_comm ] && command -v mpirun >/dev/null; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none OMP_NUM_THREADS=1
    out=$(timeout 120 mpirun --oversubscribe -np 2 ./moe bench --calibrate "$tmp/cpu2.json" $TINY 2>&1)
    plan=$(./moe plan configs/bench/scale-E8.json $TINY --gpu cpu --calibration "$tmp/cpu2.json" --gpus 2 2>&1)
    if grep -q '"collective_GBps"' "$tmp/cpu2.json" && grep -qE "^  1 " <<<"$plan"; then
        ok "bench --calibrate on two CPU ranks measures links; plan uses them"
    else bad "bench --calibrate on two CPU ranks" "$out" "$plan"; fi
fi

# The search: layouts ranked, the best in detail; impossible requests refused with the reason.
out=$(./moe plan configs/bench/scale-E64.json --gpus 8 --top 3 2>&1)
rows=$(grep -cE "^ +[1-3] +[0-9]+ +[0-9]+ +[0-9]+ " <<<"$out")
[ "$rows" -eq 3 ] && grep -q "^layout " <<<"$out" && ok "search on 8 GPUs ranks 3 layouts" || bad "search on 8 GPUs ranks 3 layouts" "$out"
out=$(./moe plan configs/olmoe-1b-7b.json --gpus 1 --gpu h100 2>&1)
grep -q "no layout fits" <<<"$out" && ok "OLMoE-1B-7B on one H100: no layout fits" || bad "OLMoE-1B-7B on one H100: no layout fits" "$out"
expect_error() { # NAME PATTERN ARGS...
    local name=$1 pattern=$2; shift 2
    local out; out=$(./moe plan "$@" 2>&1) && { bad "$name" "exit 0: $out"; return; }
    grep -qE -- "$pattern" <<<"$out" && ok "$name" || bad "$name" "$out"
}
expect_error "unknown device" "--gpu a100 is not in the device table \(h100, h200, b200, cpu\)" configs/bench/scale-E8.json --gpus 8 --gpu a100
expect_error "bad --layout key" "'tp=2' is not KEY=N" configs/bench/scale-E8.json --gpus 8 --layout tp=2
expect_error "impossible layout" "parallel.ep = 3 must divide the data-parallel size 8" configs/bench/scale-E8.json --gpus 8 --layout ep=3
printf '{"format": "moe.c calibration 1", "device": "h200"}' > "$tmp/broken.json"
expect_error "calibration without its keys" "broken.json: 'backend' must be a string" configs/bench/scale-E8.json --gpus 1 --calibration "$tmp/broken.json"
sed 's/"points": \[\[2.749e+11, 790.0\], \[1.1e+12, 801.0\]/"points": [[1.1e+12, 790.0], [2.749e+11, 801.0]/' \
    configs/calibration/h200.json > "$tmp/unsorted.json"
expect_error "calibration sizes out of order" "kernels.dense_gemm point 1: .* sizes increasing" configs/bench/scale-E8.json --gpus 1 --calibration "$tmp/unsorted.json"

summary
