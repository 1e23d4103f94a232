// What a process learns from its launcher's environment: its rank when `moe train --nproc`
// started it, and its rank on the node (which GPU it takes) under any launcher.
#include <stdlib.h>

#include "comm_nccl.h"

int comm_launch_rank(int *world_size) {
    const char *r = getenv("MOE_RANK"), *n = getenv("MOE_WORLD_SIZE");
    if (!r || !n) return -1;
    *world_size = atoi(n);
    return atoi(r);
}

int comm_local_rank(int fallback) {
    const char *vars[] = {"MOE_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++)
        if (getenv(vars[i])) return atoi(getenv(vars[i]));
    return fallback;
}
