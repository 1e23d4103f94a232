// `moe train --nproc N`: starts N copies of the command on this node, one per GPU, that find each
// other through an NCCL id passed in their environment (no MPI needed); when one fails, the others
// are stopped, so a failure never leaves ranks waiting for a peer that is gone.
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cli.h"
#include "common/util.h"
#include "dist/comm_nccl.h"

static void set_env_int(const char *key, int v) {
    char buf[32];
    snprintf(buf, sizeof buf, "%d", v);
    setenv(key, buf, 1);
}

static pid_t start_rank(int rank, int n, const char *id, char **child_argv) {
    pid_t pid = fork();
    MOE_CHECK(pid >= 0, "moe train --nproc: cannot start rank %d (%s)", rank, strerror(errno));
    if (pid == 0) {
        set_env_int("MOE_RANK", rank), set_env_int("MOE_WORLD_SIZE", n), set_env_int("MOE_LOCAL_RANK", rank);
        setenv("MOE_NCCL_ID", id, 1);
        execv("/proc/self/exe", child_argv);
        fprintf(stderr, "error: moe train --nproc: cannot run rank %d (%s)\n", rank, strerror(errno));
        _exit(127);
    }
    return pid;
}

int cli_launch_local(int n, int argc, char **argv) {
    char *id = moe_malloc(comm_nccl_id_hex_len());
    comm_nccl_new_id(id); // its bootstrap root lives in this process, which waits for the ranks
    char **child_argv = moe_calloc((size_t)argc + 3, sizeof(char *));
    child_argv[0] = "moe", child_argv[1] = "train";
    for (int i = 0; i < argc; i++) child_argv[2 + i] = argv[i];
    pid_t *pids = moe_calloc((size_t)n, sizeof(pid_t));
    for (int r = 0; r < n; r++) pids[r] = start_rank(r, n, id, child_argv);
    int rc = 0;
    for (int left = n; left > 0; left--) {
        int status;
        pid_t pid = wait(&status);
        if (pid < 0) break;
        int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        for (int r = 0; r < n; r++)
            if (pids[r] == pid) pids[r] = 0;
        if (code && !rc) { // the first failure stops every other rank (stopped ones too)
            rc = code;
            for (int r = 0; r < n; r++)
                if (pids[r]) kill(pids[r], SIGTERM), kill(pids[r], SIGCONT);
        }
    }
    free(pids), free(child_argv), free(id);
    return rc;
}
