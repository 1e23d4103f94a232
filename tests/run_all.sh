#!/usr/bin/env bash
# Runs the unit tests (build/test_unit), the command-line tests (tests/cli/*.sh) and the check of
# the files the documentation cites (tests/check_doc_paths.sh), and prints one final line
# "N passed, N failed" summed over them.
set -u
cd "$(dirname "$0")/.."
total_pass=0; total_fail=0
count() { # reads a runner's output, adds its "N passed, N failed" line to the totals
    local line; line=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$1" | tail -n 1)
    if [ -z "$line" ]; then echo "  runner $2 printed no summary: counted as 1 failure"; total_fail=$((total_fail + 1)); return; fi
    total_pass=$((total_pass + $(echo "$line" | cut -d' ' -f1)))
    total_fail=$((total_fail + $(echo "$line" | cut -d' ' -f3)))
}
log=$(mktemp)
echo "unit tests (double precision build):"
build/test_unit | tee "$log"; count "$log" unit
for t in tests/cli/*.sh; do
    [ -e "$t" ] || continue
    echo "command-line tests: $t"
    bash "$t" | tee "$log"; count "$log" "$t"
done
echo "files cited by the documentation and the sources:"
bash tests/check_doc_paths.sh | tee "$log"; count "$log" tests/check_doc_paths.sh
rm -f "$log"
echo "$total_pass passed, $total_fail failed"
[ "$total_fail" -eq 0 ]
