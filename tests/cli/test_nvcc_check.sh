#!/usr/bin/env bash
# scripts/nvcc_checked.sh, the Makefile's nvcc: against a stand-in nvcc that prints a given ptxas
# report (a clean one, a serialised wgmma, spills with and without --warn, a failed compile), and,
# where nvcc is installed,
# on a kernel that spills for real. Prints one line per test and ends with "N passed, N failed".
set -u
cd "$(dirname "$0")/../.."
source tests/testlib.sh
make_tmp nvcc-check
check=$PWD/scripts/nvcc_checked.sh

# A stand-in nvcc: prints $tmp/report to stderr, creates the -o file, exits with $tmp/rc (0 if absent).
cat >"$tmp/nvcc" <<'EOF'
#!/usr/bin/env bash
dir=$(dirname "$0"); prev=""
for a in "$@"; do [ "$prev" = "-o" ] && touch "$a"; prev=$a; done
cat "$dir/report" >&2
exit "$(cat "$dir/rc" 2>/dev/null || echo 0)"
EOF
chmod +x "$tmp/nvcc"
entry="ptxas info    : Compiling entry function '_Z6kernelPf' for 'sm_90a'"
clean="$entry
ptxas info    : Function properties for _Z6kernelPf
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers"
warning="x.cu(3): warning #177-D: variable \"y\" was declared but never referenced"

# run [--no-spills]: the check on the stand-in's report; sets rc, err (stderr) and kept (the object's fate)
run() {
    rm -f "$tmp/x.o"
    err=$(NVCC="$tmp/nvcc" bash "$check" "$@" -c x.cu -o "$tmp/x.o" 2>&1 >/dev/null)
    rc=$?
    kept=$([ -e "$tmp/x.o" ] && echo yes || echo no)
}

printf '%s\n%s\n' "$warning" "$clean" >"$tmp/report"
run --no-spills
if [ $rc -eq 0 ] && [ $kept = yes ] && grep -q "warning #177" <<<"$err" && ! grep -q "ptxas info\|bytes stack" <<<"$err"; then
    ok "a clean report: built, warnings shown, ptxas info not"
else bad "a clean report" "rc $rc, object kept: $kept, stderr: $err"; fi

printf '%s\n%s\n' "ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma instructions reading accumulator registers of  a wgmma between start and end of the pipeline stage in the function '_Z6kernelPf'" "$clean" >"$tmp/report"
run
if [ $rc -ne 0 ] && [ $kept = no ] && grep -q "C7514.*_Z6kernelPf" <<<"$err" && grep -q "x.o not built" <<<"$err"; then
    ok "serialised wgmma: fails, object removed, kernel named"
else bad "serialised wgmma" "rc $rc, object kept: $kept, stderr: $err"; fi

sed 's/ 0 bytes spill stores, 0 bytes spill loads/ 24 bytes spill stores, 28 bytes spill loads/' <<<"$clean" >"$tmp/report"
run --no-spills
if [ $rc -ne 0 ] && [ $kept = no ] && grep -q "spills (.*24 bytes spill stores.*) in _Z6kernelPf" <<<"$err"; then
    ok "spills with --no-spills: fails, kernel named"
else bad "spills with --no-spills" "rc $rc, object kept: $kept, stderr: $err"; fi
run --warn --no-spills
if [ $rc -eq 0 ] && [ $kept = yes ] && grep -q "warning: in .*x.o, ptxas reports" <<<"$err" &&
    grep -q "spills (.*) in _Z6kernelPf" <<<"$err"; then
    ok "spills with --warn: built, kernel named in a warning"
else bad "spills with --warn" "rc $rc, object kept: $kept, stderr: $err"; fi
run
if [ $rc -eq 0 ] && [ $kept = yes ]; then ok "spills without --no-spills: built"
else bad "spills without --no-spills" "rc $rc, object kept: $kept, stderr: $err"; fi

printf 'x.cu(9): error: identifier "z" is undefined\n' >"$tmp/report"
echo 2 >"$tmp/rc"
run --no-spills
if [ $rc -eq 2 ] && grep -q 'identifier "z" is undefined' <<<"$err"; then ok "a failed compile: its exit code and errors"
else bad "a failed compile" "rc $rc, stderr: $err"; fi
rm -f "$tmp/rc"

if command -v nvcc >/dev/null; then
    # 64 values live at 32 registers a thread (1,024 threads, two blocks an SM): it spills.
    cat >"$tmp/spill.cu" <<'EOF'
__global__ void __launch_bounds__(1024, 2) spill_kernel(float *p) {
    float v[64];
#pragma unroll
    for (int i = 0; i < 64; i++) v[i] = p[i * 1024 + threadIdx.x];
    float s = 0;
#pragma unroll
    for (int i = 0; i < 64; i++)
#pragma unroll
        for (int j = 0; j < 64; j++) s += v[i] * v[j];
    p[threadIdx.x] = s;
}
EOF
    arch="-gencode=arch=compute_90a,code=sm_90a"
    err=$(bash "$check" --no-spills $arch -c "$tmp/spill.cu" -o "$tmp/spill.o" 2>&1)
    rc=$?
    if [ $rc -ne 0 ] && [ ! -e "$tmp/spill.o" ] && grep -q "spills (.*) in _Z12spill_kernelPf" <<<"$err"; then
        ok "nvcc: a spilling kernel fails with --no-spills"
    else bad "nvcc: a spilling kernel with --no-spills" "rc $rc, stderr: $err"; fi
    err=$(bash "$check" $arch -c "$tmp/spill.cu" -o "$tmp/spill.o" 2>&1)
    rc=$?
    if [ $rc -eq 0 ] && [ -e "$tmp/spill.o" ]; then ok "nvcc: the same kernel builds without --no-spills"
    else bad "nvcc: the spilling kernel without --no-spills" "rc $rc, stderr: $err"; fi
fi
summary
