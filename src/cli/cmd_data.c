// `moe data prepare IN.txt OUT.npy`: byte-level token files from any text file.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "io/tokens.h"

static const CliSpec SPEC = {
    .command = "moe data",
    .usage = "prepare IN.txt OUT.npy [--val-out VAL.npy] [--val-fraction F]",
    .summary = "Writes the bytes of IN.txt as token ids 0..255 (EOS = 256, vocab_size 257) to a\n"
               "headerless uint16 file; with --val-out, the last F of the text (cut at a line\n"
               "start) goes to a validation file instead.",
    .opts = (const CliOption[]){
        {"--val-out", "VAL.npy", "validation output"},
        {"--val-fraction", "F", "share of the text for validation (default 0.1 with --val-out)"},
        {NULL}},
};

int cmd_data(int argc, char **argv, Comm *world) {
    const char *values[2] = {0};
    char **pos;
    int n_pos;
    cli_parse(&SPEC, argc, argv, values, &pos, &n_pos);
    cli_single_rank(SPEC.command, world);
    if (n_pos != 3 || strcmp(pos[0], "prepare")) {
        cli_usage(&SPEC, false);
        free(pos);
        return 1;
    }
    double frac = 0;
    if (values[0]) frac = values[1] ? cli_number("--val-fraction", values[1], 0, 0.5) : 0.1;
    else if (values[1]) moe_fatal("moe data: --val-fraction needs --val-out");
    MoeErr err;
    if (data_prepare_bytes(pos[1], pos[2], values[0], frac, err)) moe_fatal("%s", err);
    printf("wrote %s%s%s\n", pos[2], values[0] ? " and " : "", values[0] ? values[0] : "");
    free(pos);
    return 0;
}
