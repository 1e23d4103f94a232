// Token data as OLMo-core writes it (docs/FORMATS.md): headerless little-endian uint16/uint32
// arrays (often named *.npy), real .npy files with a header, or a mix file listing such files.
// A Dataset cuts every file into fixed-length sequences of S+1 tokens (inputs plus the shifted
// targets) and serves them by global index in a seeded, per-epoch shuffled order, so every
// data-parallel rank can read its own slice of a batch without talking to the others.
#pragma once
#include <stdbool.h>
#include <stdint.h>

#include "common/util.h"

typedef struct {
    char *path;
    int token_bytes;     // 2 (uint16) or 4 (uint32)
    size_t n_tokens;
    const uint8_t *base; // mmap of the whole file (NULL while a Dataset keeps it unmapped)
    size_t map_bytes;    // the file's size
    size_t data_offset;  // bytes before the first token (the .npy header, else 0)
    uint64_t last_read;  // Dataset: when it was last read (which map to drop first)
} TokenFile;

// Opens a token file. A real .npy must be a 1-D C-order '<u2' or '<u4' array. A headerless file
// uses `token_bytes` (2 or 4; 0 = choose from the vocabulary: uint16 when vocab_size <= 65536).
// Errors name the file: missing, empty, not a whole number of tokens, bad .npy header.
int token_file_open(TokenFile *f, const char *path, int token_bytes, size_t vocab_size, MoeErr err);
void token_file_close(TokenFile *f);
void token_file_unmap(TokenFile *f); // keeps what was learnt (size, header); base becomes NULL
uint32_t token_file_get(const TokenFile *f, size_t i);

// Token files a Dataset keeps mapped at once; the others are known by their size only.
#define DATASET_MAX_MAPS 16

typedef struct {
    TokenFile *files;
    size_t n_files;
    size_t mapped[DATASET_MAX_MAPS]; // indices of the files mapped now (n_mapped of them)
    size_t n_mapped;
    uint64_t clock;       // reads so far (orders last_read)
    size_t seq_len;       // S
    size_t vocab_size;    // ids must be < vocab_size
    size_t *first_seq;    // (n_files + 1) prefix sums of sequences per file
    size_t n_seqs;        // sequences per epoch
    uint64_t seed;
    bool shuffle;
} Dataset;

// `spec` is one path or a comma-separated list. A path ending in .txt, .mix or .list is a mix
// file: token-file paths one per line, relative to the mix file's folder, '#' starts a comment.
// Sequences never cross file boundaries: a file of n tokens gives (n - 1) / S sequences.
int dataset_open(Dataset *ds, const char *spec, size_t seq_len, size_t vocab_size, int token_bytes,
                 uint64_t seed, bool shuffle, MoeErr err);
void dataset_close(Dataset *ds);

// Position k of epoch `epoch`'s order of n >= 1 sequences: a bijection of [0, n) that is a pure function
// of (seed, epoch, n, k), in O(1) time and memory (docs/FORMATS.md gives the algorithm).
uint64_t dataset_permute(uint64_t seed, uint64_t epoch, uint64_t n, uint64_t k);

// Writes sequence `index` of the endless stream (epoch = index / n_seqs) as S+1 int32 ids.
// Fails, naming file and position, on an id >= vocab_size.
int dataset_read(Dataset *ds, uint64_t index, int32_t *out, MoeErr err);
