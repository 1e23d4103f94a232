// What a run sets up from its config before it trains, evaluates or samples: the backend
// (train.device), the parallel layout, datasets, the check that the model fits the machine, and a
// model loaded from a checkpoint. Shared by
// the training loop (train.c) and the commands that only run a model; built on checkpoints
// (ckpt.c), which need none of it.
#pragma once
#include "config.h"
#include "dist/parallel.h"
#include "io/tokens.h"
#include "model/model.h"
#include "optim.h"

// The backend named by train.device (cpu-sharded: ops_cpu_sharded); sets the CPU thread count.
const Ops *setup_backend(const Config *cfg);
// Opens a dataset from the data section, exiting with the loader's message on failure.
void setup_dataset(Dataset *ds, const Config *cfg, const char *spec, bool shuffle);
// Checks data.tokenizer, when set: the file loads, has no id past model.vocab_size, and is the file
// data.tokenizer_xxh3 records (filled in when empty, so that the run's config names the file and
// its contents for moe sample). Exits with a message naming the file otherwise.
void setup_tokenizer(Config *cfg);
// The layout and exchange the parallel section asks for, with what they must fit.
ParallelSpec setup_parallel_spec(const Config *cfg);
// A one-process layout (every layer and expert here), for the commands that do not train.
void setup_single_process(Parallel *par, const Config *cfg);

// What a training model of cfg allocates beyond its shape (model_init): train.recompute, and the number
// format of its expert GEMMs and dense linear layers (train.precision, train.fp8_recipe, train.fp8_dense).
ModelModes setup_model_modes(const Config *cfg);

typedef struct {
    double params, optimizer, total; // per rank: parameters held, optimizer state bytes, all bytes
    double activations;              // bytes of them for activations (Model.act_bytes, exchange included)
    // All bytes by purpose (with optimizer and activations they add up to total):
    double weights, compute_weights; // fp32 master weights (where there is a copy: this rank's shard);
                                     // their act copy (0 where they are the same)
    double fp8_weights;              // FP8 copies of the expert (and dense) weights (train.precision = fp8; else 0)
    double grads;                    // fp32 gradients, with the optimizer's reduced shards
    double exchange;                 // of activations: the expert exchange's buffers (Model.exchange_bytes)
    double scratch;                  // the rest: gradient scratch, LM-head chunk, tokens, tables, metrics
} TrainMemory;

// Rank `rank`'s model and optimizer for training cfg on `world` ranks, sized on `ops` (a backend that
// only counts, or one that prices: ops_costing) with communicators that carry only rank and size
// (groups: world, dp, ep, edp), which a caller may turn into costing ones. model_free releases it.
void setup_plan_rank(const Config *cfg, int world, int rank, const Ops *ops, Parallel *par, Comm groups[4],
                     Model *m, Optimizer *o);
// What such a model and optimizer hold.
TrainMemory setup_memory_of(const Model *m, const Optimizer *o);
// A table of a rank's memory by purpose in GiB, one column per plan (heads: their titles), each line
// led by `indent`; the activations line shows those kept, the exchange's buffers on a line of theirs.
void setup_print_memory(const char *indent, const TrainMemory *plans, const char *const *heads, int n);
// The same rows as a JSON object of bytes: weights, compute_weights, fp8_weights, grads, optimizer,
// activations (kept), exchange, scratch, total.
json_t *setup_memory_json(const TrainMemory *p);

// Rank `rank`'s memory for training cfg on `world` ranks, measured by sizing its model and
// optimizer on a backend that only counts allocations (bf16: activations as a GPU keeps them).
// cfg must pass config_check_sizable.
TrainMemory setup_memory_plan(const Config *cfg, int world, int rank, bool bf16);
// The same on a given counting backend (ops_counting_like: the plan of a backend at hand).
TrainMemory setup_memory_plan_on(const Config *cfg, int world, int rank, const Ops *counting);

// Exits with a message giving both numbers when a model is more than the backend can hold, before
// anything is allocated (Linux grants an allocation past the machine's memory, then kills the
// process that touches it): the arithmetic floor (model_memory_floor; for a model that is only
// evaluated, its fp32 weights), the sizes (config_check_sizable), then, for training, this rank's
// exact plan.
void setup_check_memory(const Config *cfg, const Ops *ops, int world, int rank, bool training);

// Resolves a --ckpt argument, reads its config into cfg, sizes a one-process model for B x S
// sequences (0: the config's micro_batch, seq_len) and loads the weights. Exits on errors.
void setup_model_from_ckpt(const char *arg, Config *cfg, Parallel *par, Model *m, size_t B, size_t S);
