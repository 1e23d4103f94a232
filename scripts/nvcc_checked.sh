#!/usr/bin/env bash
# nvcc for the Makefile's CUDA objects, with ptxas's per-kernel report read: `nvcc_checked.sh
# [--no-spills] NVCC-ARGUMENTS...` compiles as nvcc would (NVCC names the compiler, default nvcc),
# passes every message on but ptxas's per-kernel lines, and fails, removing the object (-o), where
# ptxas reports a "Potential Performance Loss" (its C75xx messages: wgmma instructions serialised,
# so a Hopper kernel written to overlap its tensor-core batches with other work would run without
# the overlap and only a benchmark would show it) or, with --no-spills, a kernel that spills
# registers to local memory. Each failure names the kernel.
set -uo pipefail
no_spills=0
[ "${1:-}" = "--no-spills" ] && { no_spills=1; shift; }
out=""
prev=""
for a in "$@"; do
    [ "$prev" = "-o" ] && out=$a
    prev=$a
done
log=$(mktemp)
trap 'rm -f "$log"' EXIT
read -ra nvcc <<<"${NVCC:-nvcc}" # a command with arguments too, as make runs $(NVCC)
"${nvcc[@]}" -Xptxas -v "$@" 2>"$log"
rc=$?
grep -vE '^ptxas info    : |^    [0-9]+ bytes stack frame' "$log" >&2
[ $rc -eq 0 ] || exit $rc

# The functions at fault: a message naming its function, or a spill report after its "Function
# properties for" line (kernels and device functions alike).
problems=$(awk -v no_spills=$no_spills '
    /^ptxas info    : Function properties for / { fn = $0; sub(/.*Function properties for /, "", fn) }
    /Potential Performance Loss/ { msg = $0; sub(/^ptxas info    : /, "", msg); print msg }
    no_spills && /bytes spill stores/ && !/ 0 bytes spill stores, 0 bytes spill loads/ {
        line = $0; sub(/^ +/, "", line); print "spills (" line ") in " fn }' "$log")
[ -z "$problems" ] && exit 0
{
    echo "nvcc_checked.sh: ${out:-the object} not built: ptxas reports"
    sed 's/^/  /' <<<"$problems" | cut -c1-400
    echo "  (ptxas's whole report: the nvcc line with -Xptxas -v)"
} >&2
[ -n "$out" ] && rm -f "$out"
exit 1
