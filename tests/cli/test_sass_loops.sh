#!/usr/bin/env bash
# scripts/sass_loops.py on a listing written here in cuobjdump -sass's format: a kernel whose
# innermost loop holds its MMAs inside an outer loop that starts after it, a kernel without MMAs,
# the kernel filter, the identifiers of a mangled name; scripts/sass_same.py on that listing and
# copies with an operand changed and a kernel left out. Prints one line per test and ends with
# "N passed, N failed".
set -u
cd "$(dirname "$0")/../.."
source tests/testlib.sh
if ! command -v python3 >/dev/null; then echo "no python3: skipped"; summary; exit; fi
make_tmp sass-loops

cat >"$tmp/k.sass" <<'EOF'
	code for sm_90a
		Function : _ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalINS1_17GroupProblemShapeILi128EEE8MainloopEEvNT_6ParamsE
	.headerflags	@"EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   MOV R1, c[0x0][0x28] ;                      /* 0x00000a0000017a02 */
        /*0010*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R88, gdesc[UR20], RZ, !UPT ;  /* 0x0 */
        /*0020*/                   FFMA R2, R3, R4, R2 ;                        /* 0x0 */
        /*0030*/                   WARPGROUP.ARRIVE ;                           /* 0x0 */
        /*0040*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R88, gdesc[UR20], R88 ;  /* 0x0 */
        /*0050*/                   QGMMA.64x96x32.F32.E4M3.E4M3 R40, gdesc[UR20], R40, gsb0 ;  /* 0x0 */
        /*0060*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;              /* 0x0 */
        /*0070*/                   FFMA R5, R88, R6, R5 ;                       /* 0x0 */
        /*0080*/                   FFMA R7, R89, R6, R7 ;                       /* 0x0 */
        /*0090*/                   FMUL R6, R8, R9 ;                            /* 0x0 */
        /*00a0*/                   LDL R10, [R1+0x8] ;                          /* 0x0 */
        /*00b0*/                   R2UR UR4, R10 ;                              /* 0x0 */
        /*00c0*/              @!P2 BRA 0x40 ;                                   /* 0x0 */
        /*00d0*/                   STL [R1+0x8], R5 ;                           /* 0x0 */
        /*00e0*/               @P0 BRA 0x50 ;                                   /* 0x0 */
        /*00f0*/                   EXIT ;                                       /* 0x0 */
		..........
		Function : _Z12plain_kernelPf
        /*0000*/                   FFMA R2, R3, R4, R2 ;                        /* 0x0 */
        /*0010*/              @!P0 BRA 0x0 ;                                    /* 0x0 */
        /*0020*/                   EXIT ;                                       /* 0x0 */
EOF

out=$(python3 scripts/sass_loops.py "$tmp/k.sass" 2>&1)
rc=$?
want_loop="  loop 4-12: 2 QGMMA.64x128x32/QGMMA.64x96x32, FFMA 2, FMUL 1, R2UR 1, LDL 1, STL 0, all 9"
if [ $rc -eq 0 ] && grep -qxF "$want_loop" <<<"$out" && [ "$(grep -c '^  loop' <<<"$out")" = 1 ]; then
    ok "the innermost MMA loop and its counts (the outer one not shown)"
else bad "the innermost MMA loop" "rc $rc, wanted the line: $want_loop" "got: $out"; fi
if grep -qx "GemmUniversal GroupProblemShape Mainloop" <<<"$out"; then
    ok "the kernel's identifiers (no substitutions, literals, generic names)"
else bad "the kernel's identifiers" "got: $out"; fi
if ! grep -q plain_kernel <<<"$out"; then ok "a kernel without MMAs not shown"
else bad "a kernel without MMAs" "got: $out"; fi
expect_error "no kernel matching the filter" "no kernel with warpgroup MMAs matches 'Nothing'" \
    python3 scripts/sass_loops.py "$tmp/k.sass" Nothing
expect_error "a missing file, named" "$tmp/none.o: no such file" python3 scripts/sass_loops.py "$tmp/none.o"
expect_error "usage without an object" "sass_loops.py OBJECT" python3 scripts/sass_loops.py

# sass_same.py: a copy is the same; one operand changed, or a kernel gone, is not (exit 1).
cp "$tmp/k.sass" "$tmp/copy.sass"
sed 's/FFMA R7, R89, R6, R7/FFMA R7, R89, R6, R9/' "$tmp/k.sass" >"$tmp/operand.sass"
sed '/Function : _Z12plain_kernelPf/,$d' "$tmp/k.sass" >"$tmp/fewer.sass"
out=$(python3 scripts/sass_same.py "$tmp/k.sass" "$tmp/copy.sass" 2>&1)
if [ $? -eq 0 ] && grep -qx "2 of 2 kernels the same: the machine code is unchanged" <<<"$out"; then
    ok "sass_same: a copy's kernels the same, exit 0"
else bad "sass_same: a copy" "got: $out"; fi
out=$(python3 scripts/sass_same.py "$tmp/k.sass" "$tmp/operand.sass" 2>&1)
if [ $? -eq 1 ] && grep -q "^changed (16 -> 16 instructions): _ZN7cutlass" <<<"$out" &&
    grep -qx "same: _Z12plain_kernelPf" <<<"$out" && grep -qx "1 of 2 kernels the same" <<<"$out"; then
    ok "sass_same: one operand changed names its kernel, exit 1"
else bad "sass_same: one operand changed" "got: $out"; fi
out=$(python3 scripts/sass_same.py "$tmp/k.sass" "$tmp/fewer.sass" 2>&1)
if [ $? -eq 1 ] && grep -qx "only in OLD: _Z12plain_kernelPf" <<<"$out"; then
    ok "sass_same: a kernel in one build only, exit 1"
else bad "sass_same: a kernel in one build only" "got: $out"; fi
expect_error "sass_same: a missing file, named" "$tmp/none.o: no such file" \
    python3 scripts/sass_same.py "$tmp/k.sass" "$tmp/none.o"
expect_error "sass_same: usage" "sass_same.py OLD NEW" python3 scripts/sass_same.py "$tmp/k.sass"
summary
