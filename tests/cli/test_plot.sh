#!/usr/bin/env bash
# Command-line tests of the training console (elapsed time and ETA on the progress line, the
# summary at the end of a run) and of `moe plot`: the pictures of a resumed run, of several runs
# and of a one-step run have their sizes, are not blank and show the runs' colours; a dense run has
# no expert picture, an fp8 run its FP8 counters' picture and a bf16 run none; bad run directories and metrics logs are errors naming the file. The pictures
# are read by build/png_stats (a build with cairo; without it the plot tests are skipped).
# Prints one line per test and ends with "N passed, N failed".
set -u
cd "$(dirname "$0")/../.."
MOE=./moe
source tests/testlib.sh
make_tmp plot
TINY="$TINY model.n_layers=1 train.log_every=2 train.warmup=2 train.eval_every=4 train.ckpt_every=6"

# ---------------------------------------------------------------- the training console
$MOE train $TINY train.steps=12 train.out="$tmp/run" --stop-at 6 > "$tmp/first.log" 2>&1
$MOE train $TINY train.steps=12 train.out="$tmp/run" > "$tmp/second.log" 2>&1
grep -qE "^step +6/12 \| .* tok/s \| [0-9]+s elapsed, ETA [0-9]+s$" "$tmp/first.log" &&
    ok "progress line: elapsed time and ETA" || bad "progress line: elapsed time and ETA" "$(grep '^step' "$tmp/first.log" | head -3)"
grep -q "^done: steps 1-6 of 12 in [0-9]*s" "$tmp/first.log" && grep -q "^stopped by --stop-at" "$tmp/first.log" &&
    grep -q "the last good one: $tmp/run/step-6\.$" "$tmp/first.log" &&
    ok "summary of a run stopped by --stop-at" || bad "summary of a run stopped by --stop-at" "$(tail -6 "$tmp/first.log")"
# The resumed run's summary covers the whole run (12 steps of 4 x 32 tokens): its best validation
# loss may be the first run's.
best=$(grep -o '"val_loss":[0-9.]*' "$tmp/run/metrics.jsonl" | cut -d: -f2 | sort -g | head -1)
best_step=$(grep "\"val_loss\":$best," "$tmp/run/metrics.jsonl" | grep -o '"step":[0-9]*' | cut -d: -f2)
if grep -q "^done: steps 7-12 of 12 in .*; 1,536 tokens seen, 768 of them by this run\.$" "$tmp/second.log" &&
   grep -qE "^final training loss [0-9.]+ \(cross-entropy [0-9.]+\); best validation loss $(printf %.4f "$best") at step $best_step \(latest [0-9.]+ at step 12\)\.$" "$tmp/second.log" &&
   grep -q "^checkpoints in $tmp/run; the last good one: $tmp/run/step-12\.$" "$tmp/second.log"; then
    ok "summary of a resumed run: tokens, best validation, checkpoint"
else bad "summary of a resumed run: tokens, best validation, checkpoint" "best $best at $best_step" "$(tail -5 "$tmp/second.log")"; fi

# ---------------------------------------------------------------- moe plot
out=$($MOE plot "$tmp/run/" 2>&1)
first_plot=$out
if grep -q "built without cairo" <<<"$out" || [ ! -x build/png_stats ]; then
    echo "  skipped the plot tests: a build without cairo (make PLOT=0, or libcairo2-dev missing)"
    summary; exit
fi

# check_png NAME FILE WIDTH HEIGHT [RRGGBB MIN]: FILE is a WIDTH x HEIGHT PNG, not blank (many colours,
# at least 3% of its pixels inked), with at least MIN pixels near colour RRGGBB.
check_png() {
    local name=$1 file=$2 w=$3 h=$4 colour=${5:-000000} min=${6:-0} stats
    if ! stats=$(build/png_stats "$file" "$colour" 2>&1); then bad "$name" "$stats"; return; fi
    read -r gw gh colours inked near <<<"$stats"
    if [ "$gw $gh" = "$w $h" ] && [ "$colours" -ge 40 ] && [ $((inked * 100)) -ge $((3 * w * h)) ] && [ "$near" -ge "$min" ]; then
        ok "$name"
    else bad "$name" "$file: ${gw}x$gh (want ${w}x$h), $colours colours, $inked inked, $near near #$colour (want >= $min)"; fi
}
BLUE=1f77b4   # the first run's colour
ORANGE=ff7f0e # the second's

[ "$(grep -c '^wrote ' <<<"$out")" = 3 ] &&
    ok "plot of one run writes three pictures" || bad "plot of one run writes three pictures" "$out"
check_png "loss.png: size, drawn, the run's colour" "$tmp/run/plots/loss.png" 1200 480 $BLUE 500
check_png "training.png: size, drawn, the run's colour" "$tmp/run/plots/training.png" 1200 800 $BLUE 1000
check_png "experts.png: size, drawn" "$tmp/run/plots/experts.png" 1200 300
[ "$(build/png_stats "$tmp/run/plots/experts.png" | cut -d' ' -f3)" -ge 100 ] &&
    ok "experts.png: a heatmap of many colours" || bad "experts.png: a heatmap of many colours" "$(build/png_stats "$tmp/run/plots/experts.png")"

$MOE train $TINY train.steps=12 train.lr=1e-3 train.out="$tmp/other" > /dev/null 2>&1
out=$($MOE plot "$tmp/run" "$tmp/other" --out "$tmp/cmp" --svg 2>&1)
ls "$tmp"/cmp/{loss,training,experts-1,experts-2}.{png,svg} > /dev/null 2>&1 && grep -q "<svg" "$tmp/cmp/loss.svg" &&
    ok "two runs: shared pictures, one expert picture each, SVG" || bad "two runs: shared pictures, one expert picture each, SVG" "$out" "$(ls "$tmp/cmp")"
check_png "two runs: loss.png with their difference below, the second run's colour" "$tmp/cmp/loss.png" 1200 800 $ORANGE 1000

$MOE train $TINY train.steps=1 train.out="$tmp/one" > /dev/null 2>&1
$MOE plot "$tmp/one" > /dev/null 2>&1 && check_png "a one-step run: its point is drawn" "$tmp/one/plots/loss.png" 1200 480 $BLUE 20 ||
    bad "a one-step run: its point is drawn" "moe plot failed"

# An fp8 run (the CPU emulates the recipe): its counters drawn in fp8.png; the bf16 run above has none.
$MOE train $TINY train.steps=6 train.precision=fp8 train.out="$tmp/fp8" > /dev/null 2>&1
$MOE plot "$tmp/fp8" > /dev/null 2>&1 && check_png "an fp8 run: fp8.png, drawn, the run's colour" "$tmp/fp8/plots/fp8.png" 1200 640 $BLUE 300 ||
    bad "an fp8 run: fp8.png, drawn, the run's colour" "moe plot failed"
grep -q "no FP8 counters recorded (no fp8 run): no fp8.png" <<<"$first_plot" && [ ! -e "$tmp/run/plots/fp8.png" ] &&
    ok "a bf16 run: no fp8.png, says so" || bad "a bf16 run: no fp8.png, says so" "$first_plot"

$MOE train $TINY model.n_dense_layers=1 train.steps=3 train.out="$tmp/dense" > /dev/null 2>&1
out=$($MOE plot "$tmp/dense" 2>&1) && grep -q "no expert loads recorded (no MoE layer): no experts.png" <<<"$out" &&
    [ ! -e "$tmp/dense/plots/experts.png" ] && [ -e "$tmp/dense/plots/training.png" ] &&
    ok "a dense run: no expert picture, says so" || bad "a dense run: no expert picture, says so" "$out"

# Losses over nine decades (a log axis), huge gradient norms, no tokens field, no config.json.
mkdir -p "$tmp/huge"
for s in 1 2 3 4 5 6 7 8 9 10; do
    echo "{\"step\":$s,\"ce\":1e$((6 - s)),\"lr\":0.001,\"grad_norm\":1e$((30 * (s % 2))),\"tokens_per_sec\":5}"
done > "$tmp/huge/metrics.jsonl"
out=$($MOE plot "$tmp/huge" 2>&1) && grep -q "config.json" <<<"$out" &&
    check_png "huge ranges, no token counts: drawn, with a warning" "$tmp/huge/plots/loss.png" 1200 480 $BLUE 300 ||
    bad "huge ranges, no token counts: drawn, with a warning" "$out"

mkdir -p "$tmp/nolog" "$tmp/empty" && : > "$tmp/empty/metrics.jsonl"
expect_error "plot: not a directory" "$tmp/nowhere is not a directory" $MOE plot "$tmp/nowhere"
expect_error "plot: no metrics.jsonl" "$tmp/nolog/metrics.jsonl: cannot open metrics log" $MOE plot "$tmp/nolog"
expect_error "plot: an empty metrics.jsonl" "$tmp/empty/metrics.jsonl: no training step recorded \(the file is empty\)" $MOE plot "$tmp/empty"
expect_error "plot: one bad run among several" "$tmp/empty/metrics.jsonl" $MOE plot "$tmp/run" "$tmp/empty" --out "$tmp/never"
[ ! -e "$tmp/never" ] && ok "plot: nothing written when a run is bad" || bad "plot: nothing written when a run is bad" "$(ls "$tmp/never")"
expect_error "plot without a run shows usage" "" $MOE plot

summary
