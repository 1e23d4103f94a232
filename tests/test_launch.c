// The launcher's environment as each rank of a multi-node job sees it, without the job: Slurm's
// variables of 2 nodes x 8 tasks faked rank by rank, the precedence of launchers that set theirs at
// once, and Slurm's node lists.
#include <stdlib.h>
#include <string.h>

#include "dist/comm_nccl.h"
#include "dist/launch_env.h"
#include "test.h"

static const char *const LAUNCH_VARS[] = {
    "MOE_RANK", "MOE_WORLD_SIZE", "MOE_LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_NODE_RANK", "SLURM_PROCID",
    "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_TASKS_PER_NODE", "SLURM_NODEID", "SLURM_NNODES", "SLURM_JOB_NODELIST",
    "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "MASTER_ADDR"};
#define N_LAUNCH_VARS (sizeof LAUNCH_VARS / sizeof LAUNCH_VARS[0])

// Clears every launcher variable (saving the values this process was started with into saved).
static void launch_env_clear(char **saved) {
    for (size_t i = 0; i < N_LAUNCH_VARS; i++) {
        const char *v = getenv(LAUNCH_VARS[i]);
        if (saved) saved[i] = v ? strdup(v) : NULL;
        unsetenv(LAUNCH_VARS[i]);
    }
}

static void launch_env_restore(char **saved) {
    launch_env_clear(NULL);
    for (size_t i = 0; i < N_LAUNCH_VARS; i++) {
        if (saved[i]) setenv(LAUNCH_VARS[i], saved[i], 1);
        free(saved[i]);
    }
}

static void set_int(const char *name, int v) {
    char buf[16];
    snprintf(buf, sizeof buf, "%d", v);
    setenv(name, buf, 1);
}

// What srun sets in task `rank` of a job of `nodes` nodes with `per_node` tasks each.
static void fake_slurm_task(int rank, int nodes, int per_node) {
    char tasks[32];
    snprintf(tasks, sizeof tasks, "%d(x%d)", per_node, nodes);
    set_int("SLURM_PROCID", rank), set_int("SLURM_NTASKS", nodes * per_node), set_int("SLURM_LOCALID", rank % per_node);
    set_int("SLURM_NODEID", rank / per_node), set_int("SLURM_NNODES", nodes);
    setenv("SLURM_TASKS_PER_NODE", tasks, 1), setenv("SLURM_JOB_NODELIST", "gpu[007-008]", 1);
}

static void test_slurm_two_nodes_of_eight(void) {
    char *saved[N_LAUNCH_VARS];
    launch_env_clear(saved);
    LaunchEnv e;
    comm_launch_env(&e);
    CHECK(e.launcher == NULL && e.rank == -1 && e.world == -1 && comm_local_rank(5) == 5 && !e.master[0]);
    for (int r = 0; r < 16; r++) {
        fake_slurm_task(r, 2, 8);
        comm_launch_env(&e);
        bool ok = e.launcher && !strcmp(e.launcher, "slurm") && e.rank == r && e.world == 16 &&
                  e.local_rank == r % 8 && e.local_world == 8 && e.node == r / 8 && e.nodes == 2 &&
                  !strcmp(e.master, "gpu007") && comm_local_rank(-1) == r % 8;
        CHECK_MSG(ok, "task %d: %s rank %d of %d, local %d of %d, node %d of %d, first node '%s', GPU %d", r,
                  e.launcher ? e.launcher : "(none)", e.rank, e.world, e.local_rank, e.local_world, e.node,
                  e.nodes, e.master, comm_local_rank(-1));
    }
    setenv("MASTER_ADDR", "10.0.0.7", 1); // an explicit address wins over the node list
    comm_launch_env(&e);
    CHECK(!strcmp(e.master, "10.0.0.7"));
    launch_env_restore(saved);
}

// mpirun inside a Slurm allocation, and `moe train --nproc` anywhere, say who the process is.
static void test_launcher_precedence(void) {
    char *saved[N_LAUNCH_VARS];
    launch_env_clear(saved);
    LaunchEnv e;
    fake_slurm_task(3, 2, 8);
    set_int("OMPI_COMM_WORLD_RANK", 1), set_int("OMPI_COMM_WORLD_SIZE", 4), set_int("OMPI_COMM_WORLD_LOCAL_RANK", 1);
    comm_launch_env(&e);
    CHECK(!strcmp(e.launcher, "mpirun") && e.rank == 1 && e.world == 4 && comm_local_rank(-1) == 1);
    set_int("MOE_RANK", 2), set_int("MOE_WORLD_SIZE", 3), set_int("MOE_LOCAL_RANK", 2);
    comm_launch_env(&e);
    int n = 0;
    CHECK(!strcmp(e.launcher, "moe --nproc") && e.rank == 2 && e.world == 3 && e.nodes == 1 && comm_launch_rank(&n) == 2 &&
          n == 3);
    launch_env_clear(NULL);
    set_int("PMI_RANK", 6), set_int("PMI_SIZE", 8), set_int("MPI_LOCALRANKID", 2);
    comm_launch_env(&e);
    CHECK(!strcmp(e.launcher, "pmi") && e.rank == 6 && e.world == 8 && comm_local_rank(-1) == 2);
    setenv("SLURM_PROCID", "x", 1); // not a number: not Slurm's
    comm_launch_env(&e);
    CHECK(!strcmp(e.launcher, "pmi"));
    launch_env_restore(saved);
}

static void test_slurm_node_lists(void) {
    static const char *cases[][2] = {
        {"gpu007", "gpu007"}, {"gpu[007-012,020],cpu1", "gpu007"}, {"a[1-2]-ib", "a1-ib"},
        {"node-01,node-02", "node-01"}, {"n[3,5]", "n3"}, {"", ""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char got[64];
        comm_first_host(cases[i][0], got, sizeof got);
        CHECK_MSG(!strcmp(got, cases[i][1]), "'%s': '%s', expected '%s'", cases[i][0], got, cases[i][1]);
    }
}

const TestCase launch_tests[] = {
    {"launch_slurm_two_nodes_of_eight", test_slurm_two_nodes_of_eight},
    {"launch_launcher_precedence", test_launcher_precedence},
    {"launch_slurm_node_lists", test_slurm_node_lists},
    {0},
};
