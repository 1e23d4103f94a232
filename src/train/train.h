// The training loop: data, micro-batch accumulation, optimizer, logging, validation and
// checkpoints, for any backend behind the ops interface.
#pragma once
#include "ckpt.h"
#include "config.h"
#include "io/tokens.h"
#include "model/model.h"

// Trains cfg from scratch, or from `resume` (a checkpoint directory) when non-NULL, up to
// train.steps or, when stop_at > 0, until step stop_at (saving a checkpoint there: for jobs with a
// time limit; the schedule still follows train.steps). Writes config.json, metrics.jsonl and
// checkpoints under cfg->train.out. Exits with a message on errors.
void train_run(const Config *cfg, const char *resume, int stop_at);

// Mean cross-entropy per token over the first `max_seqs` sequences of ds (in file order).
double eval_loss(Model *m, Dataset *ds, size_t max_seqs);

// Opens a dataset from the data section, exiting with the loader's message on failure.
void train_open_dataset(Dataset *ds, const Config *cfg, const char *spec, bool shuffle);

// The backend named by train.device; sets the CPU thread count.
const Ops *train_backend(const Config *cfg);
