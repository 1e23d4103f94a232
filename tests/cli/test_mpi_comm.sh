#!/usr/bin/env bash
# MPI tests of the communication layer: build/test_comm under mpirun on 1 to 4 ranks (and with
# transfers cut into tiny pieces), and a failure on one rank that must end every rank promptly.
# Prints one line per test and ends with "N passed, N failed".
set -u
cd "$(dirname "$0")/../.."
source tests/testlib.sh

require_mpi
MPIRUN="timeout 120 mpirun --oversubscribe"

# run_comm_tests NAME NP [CHUNK]: every test of test_comm must pass on every rank; CHUNK: the most
# elements per MPI call (MOE_COMM_CHUNK, which the ranks inherit from mpirun).
run_comm_tests() {
    local name=$1 np=$2 chunk=${3:-}
    local env=(-u MOE_COMM_CHUNK); [ -n "$chunk" ] && env=(MOE_COMM_CHUNK="$chunk")
    local out; out=$(env "${env[@]}" $MPIRUN -np "$np" build/test_comm 2>&1); local rc=$?
    local summary; summary=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' <<<"$out" | tail -n 1)
    if [ $rc -eq 0 ] && [[ "$summary" =~ ^[1-9][0-9]*\ passed,\ 0\ failed$ ]]; then
        ok "$name ($summary)"
    else bad "$name" "exit code $rc, summary '$summary'" "$(grep -vE ' ok$' <<<"$out" | tail -20)"; fi
}

for np in 1 2 3 4; do run_comm_tests "comm operations on $np rank(s)" "$np"; done
# Pieces of 3 elements: every long transfer and all_reduce goes as many MPI calls.
run_comm_tests "comm operations on 3 ranks in 3-element pieces" 3 3

# A piece size that is no count is refused with a message naming the variable and its range.
expect_error "MOE_COMM_CHUNK of no count is refused" "MOE_COMM_CHUNK = '0x10' must be an integer from 1 to 2147483647" \
    env MOE_COMM_CHUNK=0x10 $MPIRUN -np 1 build/test_comm
# Rank 1 fails while rank 0 waits in a receive from it and rank 2 in a barrier. mpirun would itself
# end the job on a rank's non-zero exit (srun and others need not): turned off, only the abort of
# the fatal hook can free the waiting ranks.
start=$(date +%s)
out=$(timeout 60 mpirun --oversubscribe --mca orte_abort_on_non_zero_status 0 -np 3 \
      build/test_comm --fatal-on-rank 1 2>&1); rc=$?
took=$(($(date +%s) - start))
name="moe_fatal on rank 1 ends every rank"
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $took -lt 20 ] && grep -q "error: \[rank 1\] boom" <<<"$out"
then ok "$name (${took}s)"
else bad "$name" "exit code $rc after ${took}s (124: hung)" "$(tail -5 <<<"$out")"; fi

summary
