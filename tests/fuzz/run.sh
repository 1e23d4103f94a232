#!/usr/bin/env bash
# Runs each libFuzzer harness build/fuzz/fuzz_TARGET for SECONDS (`make fuzz FUZZ_SECONDS=N`) and
# prints one line per harness: executions, executions per second, and whether it crashed. New
# inputs go to build/fuzz/corpus/TARGET (the committed seeds in tests/fuzz/corpus stay as they
# are); a crashing input is saved as build/fuzz/TARGET-crash-* and ends the run with exit code 1.
# Usage: tests/fuzz/run.sh SECONDS TARGET...
set -u
cd "$(dirname "$0")/../.."
seconds=$1; shift
failed=0
for t in "$@"; do
    mkdir -p "build/fuzz/corpus/$t"
    log="build/fuzz/$t.log"
    build/fuzz/fuzz_"$t" -max_total_time="$seconds" -print_final_stats=1 -timeout=10 \
        -rss_limit_mb=2048 -artifact_prefix="build/fuzz/$t-" \
        "build/fuzz/corpus/$t" "tests/fuzz/corpus/$t" > "$log" 2>&1
    rc=$?
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$')
    speed=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$log" | grep -o '[0-9]*$')
    if [ $rc -eq 0 ]; then
        printf '  fuzz_%-12s %12s executions in %s s (%s/s), no crash\n' "$t" "${runs:-?}" "$seconds" "${speed:-?}"
    else
        failed=$((failed + 1))
        printf '  fuzz_%-12s CRASH (exit code %d); the input and report:\n' "$t" "$rc"
        grep -E 'ERROR|SUMMARY|Test unit written|runtime error|error message' "$log" | head -5 | sed 's/^/    /'
    fi
done
[ "$failed" -eq 0 ] && echo "fuzz: $# harnesses, no crash" || echo "fuzz: $failed of $# harnesses crashed"
[ "$failed" -eq 0 ]
