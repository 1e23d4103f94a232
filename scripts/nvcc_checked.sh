#!/usr/bin/env bash
# nvcc for the Makefile's CUDA objects, with ptxas's per-kernel report read: `nvcc_checked.sh
# [--warn] [--no-spills] NVCC-ARGUMENTS...` compiles as nvcc would (NVCC names the compiler,
# default nvcc), passes every message on but ptxas's per-kernel lines, and reports, naming the
# function, where ptxas says "Potential Performance Loss" (its C75xx messages: wgmma instructions
# serialised, so a Hopper kernel written to overlap its tensor-core batches with other work would
# run without the overlap and only a benchmark would show it) or, with --no-spills, where a function
# spills registers to local memory. It fails then, removing the object (-o); with --warn it only
# warns (another toolkit's register allocation is no reason to refuse a build; CI fails).
set -uo pipefail
warn=0
no_spills=0
while [ $# -gt 0 ]; do
    case "$1" in
    --warn) warn=1 ;;
    --no-spills) no_spills=1 ;;
    *) break ;;
    esac
    shift
done
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
if [ $warn = 1 ]; then
    echo "nvcc_checked.sh: warning: in ${out:-the object}, ptxas reports" >&2
else
    echo "nvcc_checked.sh: ${out:-the object} not built: ptxas reports" >&2
fi
{
    sed 's/^/  /' <<<"$problems" | cut -c1-400
    echo "  (ptxas's whole report: the nvcc line with -Xptxas -v)"
} >&2
[ $warn = 1 ] && exit 0
[ -n "$out" ] && rm -f "$out"
exit 1
