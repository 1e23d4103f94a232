// `moe export CKPT_DIR OUT_DIR`: a checkpoint as a directory that Hugging Face transformers loads
// with AutoModelForCausalLM.from_pretrained (train/hf.h).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "train/hf.h"

static const CliSpec SPEC = {
    .command = "moe export",
    .usage = "CKPT_DIR OUT_DIR [--dtype bf16|fp32] [--max-shard-size SIZE] [--tokenizer FILE] [--force]",
    .summary = "Writes the checkpoint CKPT_DIR (or the newest of a run directory) to OUT_DIR as a\n"
               "Hugging Face model: OlmoeForCausalLM for model.norm_placement = pre,\n"
               "FlexOlmoForCausalLM for reordered; config.json, generation_config.json,\n"
               "model.safetensors (sharded with an index past --max-shard-size) and, for the byte\n"
               "vocabulary of `moe data prepare`, a byte-level tokenizer. Options the class cannot\n"
               "express (sigmoid router, shared expert, dense layers, ...) are refused by name.",
    .opts = (const CliOption[]){
        {"--dtype", "T", "tensor type: fp32 (default, exact) or bf16"},
        {"--max-shard-size", "SIZE", "most bytes per safetensors file (default 5GB; 1GB = 10^9 bytes)"},
        {"--tokenizer", "FILE", "a tokenizer.json to copy (the one the run's data was made with)"},
        {"--force", NULL, "replace OUT_DIR when it holds an earlier export"},
        {NULL}},
};

int cmd_export(int argc, char **argv, Comm *world) {
    const char *values[4] = {0};
    char **pos = cli_parse_exact(&SPEC, argc, argv, values, 2, world);
    const char *dtype = values[0] ? values[0] : "fp32";
    if (strcmp(dtype, "fp32") && strcmp(dtype, "bf16"))
        moe_fatal("moe export: --dtype '%s' is not one of fp32, bf16", dtype);
    HfOptions o = {.bf16 = !strcmp(dtype, "bf16"),
                   .max_shard_bytes = values[1] ? cli_bytes("--max-shard-size", values[1]) : HF_SHARD_BYTES,
                   .tokenizer = values[2], .force = values[3] != NULL};
    MoeErr err;
    if (hf_export(pos[0], pos[1], &o, err)) moe_fatal("%s", err);
    free(pos);
    return 0;
}
