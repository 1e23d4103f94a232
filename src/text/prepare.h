// `moe data prepare`: token files from text files. Each input file is one document, and every
// document ends with the EOS id. Without a tokenizer each byte is its own id (0..255, EOS 256);
// with one, the text is encoded by it (several threads, the same ids whatever their number). The
// outputs are headerless little-endian arrays (uint16 when every id fits, else uint32), written to
// a temporary name, fsynced and renamed.
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "text/tokenizer.h"

typedef struct {
    const char *const *inputs;  // text files, one document each, in order
    size_t n_inputs;
    const char *train_path;
    const char *val_path;       // NULL: no validation file
    double val_fraction;        // the last share of the text (cut at a line start) goes to val_path
    const Tokenizer *tokenizer; // NULL: bytes
    uint32_t eos;               // the id ending each document (BYTE_EOS without a tokenizer)
    int threads;
} PrepareSpec;

typedef struct {
    size_t text_bytes;
    size_t tokens[2];  // written to the train and validation files
    int token_bytes;   // 2 (uint16) or 4 (uint32)
    double encode_sec; // time spent encoding (tokenizer only)
} PrepareStats;

int data_prepare(const PrepareSpec *spec, PrepareStats *stats, MoeErr err);
