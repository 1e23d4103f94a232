// `moe train [CONFIG.json] [key=value ...]`: starts a run, or resumes the newest checkpoint in
// train.out. A resumed run takes its model from the checkpoint (which must match any model keys
// given) and its run length, device and layout from this command line.
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "dist/comm_nccl.h"
#include "io/fsutil.h"
#include "train/train.h"

static const CliSpec SPEC = {
    .command = "moe train",
    .usage = "[CONFIG.json] [key=value ...]",
    .summary = "Trains the model of CONFIG.json (default: a small MoE on tinyshakespeare) with\n"
               "dotted overrides such as train.steps=50 model.n_experts=8. If train.out already\n"
               "holds a checkpoint, training resumes from the newest one.",
    .opts = (const CliOption[]){
        {"--stop-at", "STEP", "stop at this step with a checkpoint (the schedule still follows "
                              "train.steps); run again to continue"},
        {"--nproc", "N", "start N GPU ranks on this node (one per GPU, joined by NCCL; no MPI needed)"},
        {NULL}},
};

static void apply_overrides(Config *cfg, int n, char **kv) {
    MoeErr err;
    for (int i = 0; i < n; i++)
        if (config_apply_override(cfg, kv[i], err)) moe_fatal("%s", err);
}

// Splits positionals into an optional config path and key=value overrides.
static const char *split_args(int n, char **pos, char **kv, int *n_kv) {
    const char *config = NULL;
    *n_kv = 0;
    for (int i = 0; i < n; i++) {
        if (strchr(pos[i], '=')) kv[(*n_kv)++] = pos[i];
        else if (!config) config = pos[i];
        else moe_fatal("moe train: more than one config file ('%s' and '%s'); overrides are "
                       "key=value", config, pos[i]);
    }
    return config;
}

static void check_resumable(const Config *cfg, const Config *saved, const char *ckpt) {
    char a[256], b[256];
    const char *key = config_model_diff(saved, cfg, a, b, sizeof a);
    if (key)
        moe_fatal("%s: the checkpoint has %s = %s but this run asks for %s; the model must match "
                  "to resume (choose another train.out to start a new run)", ckpt, key, a, b);
}

// The writing rank holds train.out's lock for the whole run, so that a second run on the same
// directory cannot mix its checkpoints and logs into this one or delete its save in progress.
// Partial saves of crashed runs are removed once the lock is ours. A directory is created only for
// a command line that is valid on its own (nothing to resume yet).
static int lock_run(Config *cfg) {
    MoeErr err;
    if (!fs_is_dir(cfg->train.out) && config_validate(cfg, err)) moe_fatal("%s", err);
    int lock = fs_lock_dir(cfg->train.out, err);
    if (lock < 0) moe_fatal("train.out: %s", err);
    ckpt_clean_partial(cfg->train.out);
    return lock;
}

// Whether a run resumed at st has steps to do; says so when it has none (`speaks`: the rank that
// prints). A --stop-at before the checkpoint's step is an error: the run cannot go back.
static bool resume_has_work(const Config *cfg, const TrainState *st, const char *ckpt, int64_t stop_at,
                            bool speaks) {
    if (stop_at && stop_at < st->step)
        moe_fatal("moe train: --stop-at %" PRId64 " is before step %" PRId64 " of the checkpoint %s; pass a "
                  "later step (a run cannot go back)", stop_at, st->step, ckpt);
    if (st->step >= cfg->train.steps) {
        if (speaks)
            printf("%s: already at step %" PRId64 " of train.steps = %d; pass a larger train.steps to continue\n",
                   ckpt, st->step, cfg->train.steps);
        return false;
    }
    bool at_stop = stop_at && st->step == stop_at; // 0: no --stop-at (an import's checkpoint is step 0)
    if (at_stop && speaks)
        printf("%s: already at step %" PRId64 " (--stop-at); pass a later --stop-at, or none, to continue\n",
               ckpt, st->step);
    return !at_stop;
}

// The arguments without `--nproc N`: what each started rank runs.
static int drop_nproc(int argc, char **argv, char **out) {
    int n = 0;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--nproc")) i++;
        else out[n++] = argv[i];
    }
    return n;
}

int cmd_train(int argc, char **argv, Comm *world) {
    const char *values[2] = {0};
    char **pos;
    int n_pos, n_kv;
    cli_parse(&SPEC, argc, argv, values, &pos, &n_pos);
    if (values[1]) {
        int n = (int)cli_number("--nproc", values[1], 1, 1024);
        char **rest = moe_calloc((size_t)argc + 1, sizeof(char *));
        int rc = cli_launch_local(n, drop_nproc(argc, argv, rest), rest);
        free(rest);
        free(pos);
        return rc;
    }
    char **kv = moe_calloc((size_t)n_pos + 1, sizeof(char *));
    const char *config_path = split_args(n_pos, pos, kv, &n_kv);
    MoeErr err;
    Config cfg;
    config_defaults(&cfg);
    if (config_path && fs_is_dir(config_path))
        moe_fatal("moe train: %s is a directory, not a config file; to resume the run it holds, pass "
                  "train.out=%s", config_path, config_path);
    if (config_path && config_load_file(&cfg, config_path, err)) moe_fatal("%s", err);
    apply_overrides(&cfg, n_kv, kv);
    int launched_size, launched = comm_launch_rank(&launched_size);
    int lock = world->rank == 0 && launched <= 0 ? lock_run(&cfg) : -1;
    if (launched < 0) world->ops->barrier(world); // no rank looks for checkpoints while rank 0 cleans
    char ckpt[4200];
    bool resume = ckpt_latest(cfg.train.out, ckpt, sizeof ckpt) >= 0;
    Config saved;
    TrainState state;
    if (resume && ckpt_read_state(ckpt, &saved, &state, err)) moe_fatal("%s", err);
    if (resume && !config_path) { // the run's own config, then this command line's overrides
        cfg = saved;
        config_reset_placement(&cfg);
        apply_overrides(&cfg, n_kv, kv);
    }
    if (config_validate(&cfg, err)) moe_fatal("%s", err);
    int64_t stop_at = values[0] ? (int64_t)cli_number("--stop-at", values[0], 1, 9007199254740992.0) : 0;
    if (resume) check_resumable(&cfg, &saved, ckpt);
    if (!resume || resume_has_work(&cfg, &state, ckpt, stop_at, world->rank == 0 && launched <= 0))
        train_run(&cfg, world, resume ? ckpt : NULL, stop_at);
    if (lock >= 0) close(lock);
    free(kv);
    free(pos);
    return 0;
}
