// moe: the command-line entry point. Dispatches to one command per file in src/cli/.
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "common/real.h"
#include "common/util.h"

typedef struct {
    const char *name;
    int (*run)(int argc, char **argv, Comm *world);
    const char *summary;
} Command;

static const Command COMMANDS[] = {
    {"train", cmd_train, "train or resume a model (no config: the bundled tinyshakespeare MoE)"},
    {"eval", cmd_eval, "validation loss of a checkpoint"},
    {"sample", cmd_sample, "generate text from a checkpoint"},
    {"inspect", cmd_inspect, "parameters, FLOPs per token and memory of a config or run"},
    {"data", cmd_data, "prepare token files (`moe data prepare IN.txt OUT.npy`)"},
    {"ckpt", cmd_ckpt, "check a checkpoint's files and checksums (`moe ckpt verify DIR`)"},
    {"plan", cmd_plan, "predicted memory and step time of a config's layouts on N GPUs"},
    {"plot", cmd_plot, "pictures of runs from their metrics (`moe plot RUN_DIR [RUN_DIR ...]`)"},
    {"export", cmd_export, "a checkpoint as a Hugging Face transformers model directory"},
    {"import", cmd_import, "a Hugging Face OLMoE or FlexOlmo model as a checkpoint to train or evaluate"},
    {"bench", cmd_bench, "training throughput, TFLOP/s, MFU and a per-phase breakdown of a config"},
};
#define N_COMMANDS (sizeof COMMANDS / sizeof COMMANDS[0])

static void usage(void) {
    printf("usage: moe COMMAND [ARGS]   (moe COMMAND --help for details)\n\ncommands:\n");
    for (size_t i = 0; i < N_COMMANDS; i++) printf("  %-8s %s\n", COMMANDS[i].name, COMMANDS[i].summary);
}

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage();
        return argc < 2 ? 1 : 0;
    }
    const char *names[N_COMMANDS];
    for (size_t i = 0; i < N_COMMANDS; i++) {
        if (!strcmp(argv[1], COMMANDS[i].name)) {
            Comm *world = comm_world_init(&argc, &argv, sizeof(real));
            int rc = COMMANDS[i].run(argc - 2, argv + 2, world);
            comm_world_finalize(world);
            return rc;
        }
        names[i] = COMMANDS[i].name;
    }
    const char *guess = moe_suggest(argv[1], names, N_COMMANDS);
    if (guess) moe_fatal("unknown command '%s' (did you mean '%s'?)", argv[1], guess);
    moe_fatal("unknown command '%s' (run `moe --help` for the list)", argv[1]);
}
