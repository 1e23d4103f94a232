// `moe import HF_DIR OUT_DIR`: a Hugging Face OlmoeForCausalLM or FlexOlmoForCausalLM model as a run
// directory whose step-0 checkpoint `moe train` resumes from (train/hf.h).
#include <stdio.h>
#include <stdlib.h>

#include "cli.h"
#include "train/hf.h"

static const CliSpec SPEC = {
    .command = "moe import",
    .usage = "HF_DIR OUT_DIR [--max-shard-size SIZE] [--force]",
    .summary = "Reads a Hugging Face model directory (config.json with model_type olmoe or\n"
               "flex_olmo; model.safetensors or a sharded index; F32, BF16, F16 or F64) into the\n"
               "run directory OUT_DIR: step-0/ holds its FP32 weights and no optimizer state.\n"
               "`moe train train.out=OUT_DIR` then trains on from it (AdamW moments from zero),\n"
               "`moe eval --ckpt OUT_DIR` and `moe sample --ckpt OUT_DIR` run it. Training keys\n"
               "come from an export's moe_c_config, else moe.c's defaults; override them as usual.",
    .opts = (const CliOption[]){
        {"--max-shard-size", "SIZE", "most bytes per checkpoint file (default 5GB)"},
        {"--force", NULL, "replace OUT_DIR when it holds an earlier import"},
        {NULL}},
};

int cmd_import(int argc, char **argv, Comm *world) {
    const char *values[2] = {0};
    char **pos = cli_parse_exact(&SPEC, argc, argv, values, 2, world);
    HfOptions o = {.max_shard_bytes = values[0] ? cli_bytes("--max-shard-size", values[0]) : HF_SHARD_BYTES,
                   .force = values[1] != NULL};
    MoeErr err;
    if (hf_import(pos[0], pos[1], &o, err)) moe_fatal("%s", err);
    free(pos);
    return 0;
}
