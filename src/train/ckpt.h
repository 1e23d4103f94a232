// Checkpoints: a directory step-N/ of global FP32 tensors with Hugging Face OLMoE names, sharded
// like Hugging Face checkpoints: model-0000k-of-0000n.safetensors files plus
// model.safetensors.index.json (parameters and expert biases), the same for optimizer (AdamW
// moments), and train_state.json (step, data position, config). Every rank writes the tensors it
// owns (one file per pipeline stage and expert-parallel rank); any layout reads any checkpoint,
// each rank taking the tensors and moment slices it holds. Written into a temporary directory,
// fsynced and renamed, so a crash or a full disk mid-save leaves the previous checkpoint whole.
#pragma once
#include <stdint.h>
#include <stdio.h>

#include "config.h"
#include "model/model.h"
#include "optim.h"

#define CKPT_FORMAT "moe.c checkpoint 1" // train_state.json "format", and the shards' metadata

typedef struct {
    int64_t step;           // optimizer steps done
    uint64_t data_position; // training sequences consumed (index of the next one)
} TrainState;

// Collective over every rank of m->par->world.
int ckpt_save(const char *run_dir, Model *m, const Optimizer *o, const Config *cfg,
              const TrainState *st, int keep, MoeErr err);
// The newest checkpoint directory of run_dir into path; returns its step, or -1 if none.
int64_t ckpt_latest(const char *run_dir, char *path, size_t len);
// Removes temporary directories left by saves that crashed.
void ckpt_clean_partial(const char *run_dir);
// A --ckpt argument: a checkpoint directory, or a run directory (its newest checkpoint).
int ckpt_resolve(const char *arg, char *path, size_t len, MoeErr err);
int ckpt_read_state(const char *ckpt_dir, Config *cfg, TrainState *st, MoeErr err);
// Writes CKPT_DIR/train_state.json (fsynced, not renamed: the directory is a temporary one).
// `lay`: the layout that wrote the tensors; NULL for a checkpoint made by `moe import`.
int ckpt_write_state(const char *ckpt_dir, const Config *cfg, const TrainState *st, const Layout *lay,
                     MoeErr err);
// Whether a checkpoint holds AdamW moments (`moe import` writes weights only).
bool ckpt_has_moments(const char *ckpt_dir);
// Loads the tensors this rank holds (of each, the part its master weights hold; with an optimizer,
// its moment shards), checking names and shapes, then refreshes the compute copy (collective over
// the regions' groups: model_sync_compute_weights). Also reads a single model.safetensors (e.g.
// converted from Hugging Face).
int ckpt_load(const char *ckpt_dir, Model *m, const Optimizer *o, MoeErr err);

// Checks a checkpoint directory without loading it (`moe ckpt verify`): each index against its
// shards, every tensor against its checksum, train_state.json. Prints each problem and a summary
// per kind of file to `out`; returns the number of problems.
size_t ckpt_verify(const char *ckpt_dir, FILE *out);
