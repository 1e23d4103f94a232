// The whole run configuration: model, train and data sections, read from a JSON file and from
// dotted `key=value` overrides. One table of keys drives parsing, overrides, help, the saved
// config.json and the "did you mean" suggestions, so a key exists in exactly one place.
#pragma once
#include <jansson.h>
#include <stdio.h>

#include "model/config.h"

typedef enum { SCHED_COSINE, SCHED_LINEAR, SCHED_CONSTANT } LrSchedule;
// Number format of the expert GEMMs and, with train.fp8_dense, the dense linear layers
// (train.precision): bf16 (fp32 on the CPU) or the FP8 recipe of train.fp8_recipe (docs/FP8.md), which
// the CPU backend emulates.
typedef enum { PRECISION_BF16, PRECISION_FP8 } Precision;
// FP8 scaling recipes: DeepSeek-V3's blocks (1x128 activations, 128x128 weights) with scales
// amax / 448, or the same blocks with power-of-two scales.
typedef enum { FP8_RECIPE_BLOCKWISE, FP8_RECIPE_BLOCKWISE_POW2 } Fp8Recipe;

#define CONFIG_PATH_LEN 1024
#define CONFIG_MAX_THREADS 4096          // train.threads above this is refused (the OpenMP runtime fails)
#define CONFIG_MAX_ELEMENTS 17592186044416.0 // 2^44: the most elements of one buffer

typedef struct {
    int steps;           // optimizer steps of the whole run
    int micro_batch;     // sequences per micro-batch, all data-parallel ranks together
    int micro_batches;   // micro-batches per optimizer step (gradient accumulation)
    int seq_len;         // S
    double lr;           // peak learning rate
    double min_lr_ratio; // final learning rate = lr * min_lr_ratio
    int warmup;          // linear warmup steps
    LrSchedule schedule; // decay after warmup
    double weight_decay, beta1, beta2, eps, clip;
    int seed;
    int log_every, eval_every, eval_batches, ckpt_every, keep_ckpts;
    char out[CONFIG_PATH_LEN]; // run directory
    char device[32];           // "cpu"
    int threads;               // OpenMP threads (0: all cores)
    bool deterministic;        // GPU: bitwise-reproducible steps (the CPU backend always is)
    Recompute recompute;       // activations recomputed in the backward instead of kept
    Precision precision;       // the expert GEMMs' (and dense layers') number format
    Fp8Recipe fp8_recipe;      // with precision fp8: the scaling recipe
    bool fp8_dense;            // with precision fp8: the dense linear layers in FP8 too (else act precision)
    bool fp8_dense_qkv;        // with fp8_dense: the attention's QKV projection in FP8 too (else act precision)
    bool fp8_dense_out;        // with fp8_dense: the attention's output projection in FP8 too (else act precision)
    bool fp8_qkv_forward;      // with the QKV projection in FP8: its forward product too (else act precision,
                               // its backward's in FP8)
    bool fp8_fused_dispatch;   // with precision fp8: expert operands quantised from the tokens' rows
    bool fp8_fused_swiglu;     // with precision fp8: the experts' SwiGLU backward writes FP8 operands
    bool fp8_exchange;         // with precision fp8: rows travel to the experts (and inputs are kept) as FP8
    bool fp8_wgrad_blocks;     // with precision fp8: the weight gradients read their inputs in 128x128 blocks
    bool fp8_fused_update;     // with precision fp8: the experts' update writes their FP8 copies itself
    double comm_timeout;       // seconds without progress before a multi-rank run ends (0: never)
    bool launch_ahead;         // each step queued before the previous one's metrics are read
    bool optimizer_overlap;    // each step's parameter update runs beside the next step's forward
} TrainConfig;

typedef struct {
    char train[CONFIG_PATH_LEN]; // token file, comma list or mix file
    char val[CONFIG_PATH_LEN];   // held-out data ("" : no validation)
    int token_bytes;             // 2 or 4 for headerless files; 0: from the vocabulary size
    char tokenizer[CONFIG_PATH_LEN]; // tokenizer.json the token files were made with ("": bytes)
    char tokenizer_xxh3[17];     // XXH3-64 of that file (16 hex digits), filled in by moe train
} DataConfig;

typedef struct {
    int pp; // pipeline stages (the data-parallel size is the number of ranks / pp)
    int ep; // expert-parallel ranks per MoE layer (divides the data-parallel size)
    int virtual_stages; // model chunks per pipeline stage (interleaved 1F1B when > 1)
    int exchange; // ExchangeMode (dist/parallel.h): how expert rows travel between ranks
    bool overlap_grad_reduce; // gradient buckets reduced during the backward
    double grad_bucket_mb;    // their least size (MB of fp32 gradients; 0: a layer each)
    double recv_capacity;     // direct exchange receive rows / routed rows (0: worst case)
    int exchange_chunks;      // direct exchange: expert chunks whose rows travel behind compute
    int push_ctas;            // thread blocks of a row push beside compute (0: no bound)
} ParallelConfig;

typedef struct {
    ModelConfig model;
    TrainConfig train;
    DataConfig data;
    ParallelConfig parallel;
} Config;

void config_defaults(Config *c);
// Applies every key of a JSON config file on top of c (unknown keys are errors).
int config_load_file(Config *c, const char *path, MoeErr err);
// Applies a JSON object (as written by config_to_json); `source` names it in messages.
int config_apply_json(Config *c, json_t *root, const char *source, MoeErr err);
// Applies one "section.key=value" override.
int config_apply_override(Config *c, const char *assignment, MoeErr err);
int config_validate(Config *c, MoeErr err);
// Whether a valid config can be sized: every buffer's element count is a product of config values,
// and each must stay far below what size_t counts (at most CONFIG_MAX_ELEMENTS), so that no size
// computed from them wraps around. -1 with a message naming the product that is too large.
int config_check_sizable(const Config *c, MoeErr err);
// Back to the defaults for what a resumed run takes from its own command line, not from the
// checkpoint: the parallel layout, device, threads, communication timeout, launch ahead and
// optimizer overlap.
void config_reset_placement(Config *c);
json_t *config_to_json(const Config *c);
// Every key as a "section.key = value" line (values as JSON), in table order: a canonical text of
// the config that ranks compare line by line.
void config_write_text(const Config *c, FILE *f);
// The first model.* key whose value differs; NULL if the model sections match. Values into a, b.
const char *config_model_diff(const Config *x, const Config *y, char *a, char *b, size_t len);
void config_print_keys(FILE *f); // every key with its type, default and meaning
// The train.recompute value of a mode ("none", "selective", "full").
const char *config_recompute_name(Recompute r);
