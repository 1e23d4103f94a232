# Shared by the command-line test scripts (tests/cli/*.sh): pass/fail counting with one line per
# test and the final "N passed, N failed", expected failures, and the MPI setup of the multi-rank
# tests.
pass=0; fail=0

# make_tmp NAME: $tmp becomes a fresh folder /tmp/moe-NAME-XXXXXX, removed when the script exits.
make_tmp() { tmp=$(mktemp -d "/tmp/moe-$1-XXXXXX"); trap 'rm -rf "$tmp"' EXIT; }
ok()  { pass=$((pass + 1)); printf '  %-58s ok\n' "$1"; }
bad() { fail=$((fail + 1)); printf '  %-58s FAIL\n' "$1"; shift; printf '    %s\n' "$@" >&2; }
summary() { echo "$pass passed, $fail failed"; [ "$fail" -eq 0 ]; }

# expect_error NAME PATTERN CMD...: CMD must exit non-zero and its stderr must match PATTERN.
expect_error() {
    local name=$1 pattern=$2; shift 2
    local out; out=$("$@" 2>&1 >/dev/null); local rc=$?
    if [ $rc -ne 0 ] && grep -qiE -- "$pattern" <<<"$out"; then ok "$name"
    else bad "$name" "exit code $rc, wanted non-zero and a message matching: $pattern" "got: $out"; fi
}

# The newest ./moe process whose command line matches PATTERN: a rank (under moe train --nproc the
# launcher is older than the ranks it starts; mpirun is not ./moe).
newest_moe_pid() {
    pgrep -f "$1" | while read -r p; do [ "$(readlink "/proc/$p/exe")" = "$PWD/moe" ] && echo "$p"; done | tail -1
}

# Skips the calling script (exit 0, "0 passed, 0 failed") when the build has no MPI; otherwise sets
# up mpirun for CI: root in containers, no single-copy shared memory, one OpenMP thread per rank.
require_mpi() {
    if [ ! -x build/test_comm ] || ! command -v mpirun >/dev/null; then
        echo "  skipped: a build without MPI (build/test_comm or mpirun missing)"
        echo "0 passed, 0 failed"
        exit 0
    fi
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    export OMPI_MCA_btl_vader_single_copy_mechanism=none OMP_NUM_THREADS=1
}
