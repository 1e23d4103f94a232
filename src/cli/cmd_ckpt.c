// `moe ckpt verify DIR`: checks a checkpoint (every shard, the indexes, every tensor's checksum)
// without loading a model; exits non-zero when anything is wrong.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "train/ckpt.h"

static const CliSpec SPEC = {
    .command = "moe ckpt",
    .usage = "verify DIR",
    .summary = "Checks the checkpoint DIR (or the newest checkpoint of the run directory DIR):\n"
               "every tensor of every shard against the checksum stored with it, each index\n"
               "against its shards, and train_state.json. Prints a summary; exits with 1 if\n"
               "anything is damaged or inconsistent. Checkpoints written before checksums\n"
               "existed are checked for structure only (the summary says how many tensors).",
    .opts = (const CliOption[]){{NULL}},
};

int cmd_ckpt(int argc, char **argv, Comm *world) {
    const char *values[1] = {0};
    int n_pos;
    char **pos = cli_parse_one_rank(&SPEC, argc, argv, values, &n_pos, world);
    if (n_pos != 2 || strcmp(pos[0], "verify")) return cli_misuse(&SPEC, pos);
    char dir[4200];
    MoeErr err;
    if (ckpt_resolve(pos[1], dir, sizeof dir, err)) moe_fatal("%s", err);
    free(pos);
    size_t problems = ckpt_verify(dir, stdout);
    if (problems) printf("%zu problem%s found\n", problems, problems == 1 ? "" : "s");
    else printf("checkpoint verified: no problems\n");
    return problems ? 1 : 0;
}
