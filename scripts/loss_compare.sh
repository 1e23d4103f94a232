#!/usr/bin/env bash
# Compares training runs against reference runs from the same start (issue 13's FP8 loss check: fp8
# against bf16, one pair a seed). Arguments: REF:RUN pairs of `moe train` output directories (their
# metrics.jsonl: training losses, and validation losses where evaluated). WARMUP (default 200) is
# where the per-run bound starts, WINDOW (default 100) the steps averaged together over the pairs.
# Prints per pair: the final validation loss of each and their difference, the 20-step averages'
# worst relative gap after warm-up, the per-step losses' relative gaps after warm-up as a root mean
# square (how far the run strays from its reference step by step: a finer yardstick than the bounds'
# verdict, for comparing recipes and run-to-run noise), the relative gap of its last full WINDOW steps
# summed (a late drift, as when a run memorises a corpus read again less; none without a full window),
# and whether the first two lie within
# FINAL_BOUND and AVG_BOUND percent (defaults 0.5 and 1: issue 13's per-run bounds; a pair without
# validation losses is judged on the averages alone), then how many pairs did and the range and mean
# of the rms gaps; the pairs pooled: the final validation gaps' mean and standard deviation, the
# worst 20-step gaps' mean magnitude and largest (a recipe's spread, to set beside a rerun's with other
# roundings); then, over all pairs, the mean relative gap of each WINDOW-step window: the recipe's
# systematic cost, which single runs resolve only to a fraction of a percent (docs/FP8.md).
# Example: scripts/loss_compare.sh runs/bf16-s1:runs/fp8-s1 runs/bf16-s2:runs/fp8-s2
set -euo pipefail
WARMUP=${WARMUP:-200} WINDOW=${WINDOW:-100} FINAL_BOUND=${FINAL_BOUND:-0.5} AVG_BOUND=${AVG_BOUND:-1}
[ $# -ge 1 ] || { echo "usage: $0 REF_DIR:RUN_DIR [REF_DIR:RUN_DIR ...]" >&2; exit 2; }

losses() { # the training losses of run directory $1, one a line
    grep -o '"loss":[^,}]*' "$1/metrics.jsonl" | cut -d: -f2
}
final_val() { # the last validation loss in run directory $1, or "-" (none evaluated)
    local v
    v=$(grep -o '"val_loss":[^,}]*' "$1/metrics.jsonl" | tail -1 | cut -d: -f2 || true)
    if [ -n "$v" ]; then printf '%.4f\n' "$v"; else echo -; fi
}

windows=$(mktemp) held=$(mktemp); trap 'rm -f "$windows" "$held"' EXIT
for pair in "$@"; do
    ref=${pair%%:*} run=${pair#*:}
    [ "$ref" != "$pair" ] || { echo "$0: '$pair' is not REF_DIR:RUN_DIR" >&2; exit 2; }
    for d in "$ref" "$run"; do
        [ -f "$d/metrics.jsonl" ] || { echo "$0: $d/metrics.jsonl not found: give moe train output directories" >&2; exit 1; }
    done
    paste <(losses "$ref") <(losses "$run") | awk -v warmup="$WARMUP" -v win="$WINDOW" -v name="$run against $ref" \
        -v vr="$(final_val "$ref")" -v vn="$(final_val "$run")" -v windows="$windows" -v held="$held" \
        -v fb="$FINAL_BOUND" -v ab="$AVG_BOUND" '
        NF < 2 { next }
        { n++; a[n] = $1; b[n] = $2; sa += $1; sb += $2
          if (n > 20) { sa -= a[n - 20]; sb -= b[n - 20] }
          if (n > warmup) { g = ($2 - $1) / $1; sq += g * g; m++ }
          if (n > warmup && n >= 20) { d = (sb - sa) / sa; if (d * d > w * w) { w = d; at = n } }
          wa += $1; wb += $2
          if (n % win == 0) { last = (wb - wa) / wa; printf "%d %.6f\n", n, last >> windows; wa = 0; wb = 0 } }
        function within(x, bound) { x = sprintf("%.2f", 100 * (x < 0 ? -x : x)); return x + 0 <= bound + 0 }
        END { printf "%s: %d steps; final validation %s against %s", name, n, vn, vr
              ok = within(w, ab); fg = "-"
              if (vr != "-" && vn != "-") {
                  f = (vn - vr) / vr; fg = sprintf("%.6f", 100 * f); printf " (%+.2f%%)", 100 * f; ok = ok && within(f, fb) }
              rms = m ? 100 * sqrt(sq / m) : 0
              late = n >= win ? sprintf("the last %d steps %+.2f%%; ", win, 100 * last) : ""
              printf "; 20-step averages after step %d at worst %+.2f%% (step %d); steps after it %.2f%% rms apart; %s%s\n",
                     warmup, 100 * w, at, rms, late, ok ? "within the bounds" : "OUTSIDE the bounds"
              printf "%d %.6f %.6f %s\n", ok, rms, 100 * (w < 0 ? -w : w), fg >> held }'
done
awk -v fb="$FINAL_BOUND" -v ab="$AVG_BOUND" '
    { n++; k += $1; r = $2; rs += r; if (n == 1 || r < lo) lo = r; if (n == 1 || r > hi) hi = r
      ws += $3; if ($3 > wmax) wmax = $3
      if ($4 != "-") { f++; fs += $4; fq += $4 * $4 } }
    END { printf "%d of %d pair(s) within the bounds (final validation %s%%, 20-step averages %s%%); ", k, n, fb, ab
          printf "per-step gaps %.2f-%.2f%% rms (mean %.2f%%)\n", lo, hi, rs / n
          printf "pooled: worst 20-step gaps %.2f%% on average, largest %.2f%%", ws / n, wmax
          if (f) printf "; final validation gaps %+.2f%% on average", fs / f
          if (f > 1) { v = (fq - fs * fs / f) / (f - 1); printf ", sd %.2f%% (%d pairs)", sqrt(v > 0 ? v : 0), f }
          printf "\n" }' "$held"
sort -n -s -k1,1 "$windows" | awk -v runs=$# -v win="$WINDOW" '
    { s[$1] += $2; c[$1]++; if (!($1 in lo) || $2 < lo[$1]) lo[$1] = $2; if (!($1 in hi) || $2 > hi[$1]) hi[$1] = $2 }
    $1 != last { order[++k] = $1; last = $1 }
    END { printf "%d-step windows, mean relative gap over %d pair(s) [lowest, highest pair]:\n", win, runs
          for (i = 1; i <= k; i++) { x = order[i]
              printf "  steps %5d-%5d: %+.2f%% [%+.2f%%, %+.2f%%]\n", x - win + 1, x, 100 * s[x] / c[x], 100 * lo[x], 100 * hi[x] } }'
