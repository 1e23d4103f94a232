// `moe eval --ckpt DIR [--data FILE]`: validation loss of a checkpoint.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "cli.h"
#include "train/setup.h"
#include "train/train.h"

static const CliSpec SPEC = {
    .command = "moe eval",
    .usage = "--ckpt DIR [--data FILE] [--max-seqs N]",
    .summary = "Prints the mean cross-entropy (nats per token) of a checkpoint on held-out data:\n"
               "the run's data.val unless --data names other token files.",
    .opts = (const CliOption[]){
        CLI_OPTION_CKPT,
        {"--data", "FILE", "token file, comma list or mix file"},
        {"--max-seqs", "N", "evaluate at most N sequences (default: all)"},
        {NULL}},
};

int cmd_eval(int argc, char **argv, Comm *world) {
    const char *values[3] = {0};
    int n_pos;
    char **pos = cli_parse_one_rank(&SPEC, argc, argv, values, &n_pos, world);
    if (!values[0] || n_pos) return cli_misuse(&SPEC, pos);
    Config cfg;
    Parallel par;
    Model m;
    setup_model_from_ckpt(values[0], &cfg, &par, &m, 0, 0);
    const char *data = values[1] ? values[1] : cfg.data.val;
    if (!data[0]) moe_fatal("moe eval: the run has no data.val; pass --data FILE");
    size_t max_seqs = values[2] ? (size_t)cli_number("--max-seqs", values[2], 1, 1e15) : SIZE_MAX;
    if (max_seqs < (size_t)cfg.train.micro_batch)
        moe_fatal("moe eval: --max-seqs %zu is fewer than one micro-batch (the checkpoint's train.micro_batch "
                  "= %d sequences, evaluated whole); pass at least %d", max_seqs, cfg.train.micro_batch,
                  cfg.train.micro_batch);
    Dataset ds;
    MoeErr err;
    setup_dataset(&ds, &cfg, data, false);
    if (eval_check_data(&ds, &cfg, data, err)) moe_fatal("moe eval: %s", err);
    size_t n;
    double loss = eval_loss(&m, &ds, max_seqs, &n);
    if (!isfinite(loss))
        moe_fatal("moe eval: the loss of %s on %s is %g: the model's outputs overflow (a diverged or "
                  "damaged checkpoint)", values[0], data, loss);
    printf("val loss %.6f nats/token (%zu sequences of %d tokens from %s)\n", loss, n,
           cfg.train.seq_len, data);
    dataset_close(&ds);
    model_free(&m);
    parallel_free(&par);
    free(pos);
    return 0;
}
