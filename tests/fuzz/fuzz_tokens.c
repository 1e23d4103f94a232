// libFuzzer harness of the token-file reader and its .npy header parser (src/io/tokens.c). The
// first input byte picks token_bytes and the vocabulary, the second the sequence length; the rest
// is the file. A file either opens with exactly n_tokens tokens after its header, or fails with a
// message naming it; an opened file then serves sequences through a Dataset.
#include <stdlib.h>

#include "fuzz.h"
#include "io/tokens.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fuzz_init();
    return 0;
}

static volatile uint32_t sink; // keeps the reads

static void read_tokens(const TokenFile *f) {
    if (f->data_offset + f->n_tokens * (size_t)f->token_bytes != f->map_bytes) abort();
    for (size_t i = 0; i < f->n_tokens; i++) sink = token_file_get(f, i);
}

static void read_sequences(const char *path, int token_bytes, size_t vocab, size_t seq_len) {
    Dataset ds;
    MoeErr err = "";
    if (dataset_open(&ds, path, seq_len, vocab, token_bytes, 7, true, err)) {
        fuzz_check_message(err, path);
        return;
    }
    int32_t *seq = malloc((seq_len + 1) * sizeof(int32_t));
    uint64_t picks[3] = {0, ds.n_seqs - 1, 3 * ds.n_seqs + 1}; // the last one: epoch 3
    for (int i = 0; i < 3; i++)
        if (dataset_read(&ds, picks[i], seq, err)) fuzz_check_message(err, path);
    free(seq);
    dataset_close(&ds);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2) return 0;
    static const int TOKEN_BYTES[4] = {0, 2, 4, 3}; // 3 must be refused
    int token_bytes = TOKEN_BYTES[data[0] & 3];
    size_t vocab = data[0] & 4 ? 100000 : 257, seq_len = 1 + data[1] % 16;
    const char *path = fuzz_file(data + 2, size - 2);
    TokenFile f;
    MoeErr err = "";
    if (token_file_open(&f, path, token_bytes, vocab, err)) {
        fuzz_check_message(err, path);
        return 0;
    }
    read_tokens(&f);
    token_file_close(&f);
    read_sequences(path, token_bytes, vocab, seq_len);
    return 0;
}
