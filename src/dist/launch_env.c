// What a process learns from its launcher's environment (launch_env.h), and the two questions the
// rest of moe.c asks of it: its rank when `moe train --nproc` started it, and its rank on the node
// (which GPU it takes) under any launcher.
#include "dist/launch_env.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm_nccl.h"

static int env_int(const char *name) {
    const char *v = getenv(name);
    char *end;
    long x = v && *v ? strtol(v, &end, 10) : -1;
    return v && *v && !*end && x >= 0 && x < 1 << 30 ? (int)x : -1;
}

void comm_first_host(const char *nodelist, char *out, int len) {
    size_t n = strcspn(nodelist, ",["), digits = 0;
    const char *range = nodelist[n] == '[' ? nodelist + n + 1 : NULL;
    if (range) digits = strspn(range, "0123456789"); // the first number of the first range, padding kept
    const char *rest = range ? strchr(range, ']') : NULL;
    size_t suffix = rest ? strcspn(rest + 1, ",") : 0;
    snprintf(out, (size_t)len, "%.*s%.*s%.*s", (int)n, nodelist, (int)digits, range ? range : "", (int)suffix,
             rest ? rest + 1 : "");
}

// One launcher's variables: rank, world, local rank, local world, node, nodes (NULL: not set).
typedef struct {
    const char *name, *vars[6];
} LauncherVars;

static const LauncherVars LAUNCHERS[] = { // in order of precedence
    {"moe --nproc", {"MOE_RANK", "MOE_WORLD_SIZE", "MOE_LOCAL_RANK", "MOE_WORLD_SIZE", NULL, NULL}},
    {"mpirun", {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_NODE_RANK", NULL}},
    {"slurm", {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", NULL, "SLURM_NODEID", "SLURM_NNODES"}},
    {"pmi", {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", NULL, NULL}},
};

void comm_launch_env(LaunchEnv *e) {
    *e = (LaunchEnv){NULL, -1, -1, -1, -1, -1, -1, ""};
    for (size_t i = 0; i < sizeof LAUNCHERS / sizeof LAUNCHERS[0] && !e->launcher; i++) {
        const LauncherVars *l = &LAUNCHERS[i];
        if (env_int(l->vars[0]) < 0) continue;
        int *field[6] = {&e->rank, &e->world, &e->local_rank, &e->local_world, &e->node, &e->nodes};
        for (int k = 0; k < 6; k++)
            if (l->vars[k]) *field[k] = env_int(l->vars[k]);
        e->launcher = l->name;
    }
    const char *tasks = getenv("SLURM_TASKS_PER_NODE"); // "8(x2)", or "8,4": the first node's count first
    if (e->launcher && !strcmp(e->launcher, "slurm") && tasks && atoi(tasks) > 0) e->local_world = atoi(tasks);
    if (e->launcher && !strcmp(e->launcher, "moe --nproc")) e->node = 0, e->nodes = 1;
    const char *master = getenv("MASTER_ADDR"), *nodes = getenv("SLURM_JOB_NODELIST");
    if (master) snprintf(e->master, sizeof e->master, "%s", master);
    else if (nodes) comm_first_host(nodes, e->master, sizeof e->master);
}

int comm_launch_rank(int *world_size) {
    const char *r = getenv("MOE_RANK"), *n = getenv("MOE_WORLD_SIZE");
    if (!r || !n) return -1;
    *world_size = atoi(n);
    return atoi(r);
}

int comm_local_rank(int fallback) {
    LaunchEnv e;
    comm_launch_env(&e);
    return e.local_rank >= 0 ? e.local_rank : fallback;
}
