// Checkpoints: a directory step-N/ holding model.safetensors (global FP32 parameters and expert
// biases, Hugging Face OLMoE names), optimizer.safetensors (AdamW moments) and train_state.json
// (step, data position, config). Written to a temporary directory, fsynced and renamed, so a crash
// or a full disk mid-save leaves the previous checkpoint whole.
#pragma once
#include <stdint.h>

#include "config.h"
#include "model/model.h"

typedef struct {
    int step;               // optimizer steps done
    uint64_t data_position; // training sequences consumed (index of the next one)
} TrainState;

int ckpt_save(const char *run_dir, Model *m, const Config *cfg, const TrainState *st, int keep,
              MoeErr err);
// The newest checkpoint directory of run_dir into path; returns its step, or -1 if none.
int ckpt_latest(const char *run_dir, char *path, size_t len);
// Removes temporary directories left by saves that crashed.
void ckpt_clean_partial(const char *run_dir);
// A --ckpt argument: a checkpoint directory, or a run directory (its newest checkpoint).
int ckpt_resolve(const char *arg, char *path, size_t len, MoeErr err);
int ckpt_read_state(const char *ckpt_dir, Config *cfg, TrainState *st, MoeErr err);
// Loads every registered tensor (and the moments with_optimizer), checking names and shapes.
int ckpt_load(const char *ckpt_dir, Model *m, bool with_optimizer, MoeErr err);

// Resolves a --ckpt argument, reads its config into cfg, sizes a model for B x S (0: the config's
// micro_batch, seq_len) on the backend of cfg, and loads the weights. Exits on errors.
void ckpt_open_model(const char *arg, Config *cfg, Model *m, size_t B, size_t S);
