// What a process learns from the environment its launcher set: `moe train --nproc` (MOE_*), Open MPI's
// mpirun (OMPI_COMM_WORLD_*), Slurm's srun (SLURM_*) or another PMI launcher (PMI_*). The world the
// ranks actually form comes from MPI (or NCCL); this is what the launcher meant, to pick a process's
// GPU, to say where a multi-node run was started and to catch a launch that went wrong (srun starting
// singleton MPI processes that would each train alone).
#pragma once

typedef struct {
    const char *launcher; // "moe --nproc", "mpirun", "slurm", "pmi", or NULL when none is seen
    int rank, world;      // this process among all (-1: not known)
    int local_rank;       // among the processes of its node (-1: not known)
    int local_world;      // processes on its node (-1: not known)
    int node, nodes;      // its node among the job's nodes (-1: not known)
    char master[256];     // the job's first node: MASTER_ADDR, else the first of Slurm's node list ("")
} LaunchEnv;

void comm_launch_env(LaunchEnv *e);
// The first host of a Slurm node list ("gpu[007-012,020],cpu1" -> "gpu007") into out; "" when empty.
void comm_first_host(const char *nodelist, char *out, int len);
