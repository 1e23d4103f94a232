// libFuzzer harness of the tokenizer (src/text): loading a tokenizer.json, then encoding and
// decoding a text with it. The input is the tokenizer.json, a NUL byte, then the text; the first
// byte of the text part picks the chunk size. A file either loads or fails with a message naming
// it; a loaded tokenizer gives ids that name tokens, the same ids in chunks of 1 to 16 bytes as in
// one piece, and, when it keeps every byte (tokenizer_lossless), decodes them back to the text.
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"
#include "text/tokenizer.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fuzz_init();
    return 0;
}

static void check_decoding(const Tokenizer *t, const TokenIds *ids, const TextSpan *text) {
    size_t n = 0, len;
    for (size_t i = 0; i < ids->n; i++) {
        const uint8_t *b = tokenizer_token_bytes(t, ids->ids[i], &len);
        if (!b) abort(); // an id that names no token
        if (tokenizer_lossless(t) && (n + len > text->len || memcmp(text->text + n, b, len))) abort();
        n += len;
    }
    if (tokenizer_lossless(t) && n != text->len) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *nul = memchr(data, 0, size);
    size_t json_len = nul ? (size_t)(nul - data) : size;
    const char *path = fuzz_file(data, json_len);
    MoeErr err = "";
    Tokenizer *t = tokenizer_load(path, err);
    if (!t) {
        fuzz_check_message(err, path);
        return 0;
    }
    size_t rest = nul ? size - json_len - 1 : 0, chunk = rest ? 1 + nul[1] % 16 : 1;
    TextSpan text = {rest > 1 ? nul + 2 : NULL, rest > 1 ? rest - 2 : 0, "fuzz text"};
    TokenIds whole = {0}, chunked = {0};
    int rc = tokenizer_encode(t, &text, 1, 1, 0, &whole, err);
    if (rc) fuzz_check_message(err, "fuzz text");
    else {
        if (tokenizer_encode(t, &text, 1, 1, chunk, &chunked, err)) abort(); // the same sweeps, in pieces
        if (chunked.n != whole.n || (whole.n && memcmp(chunked.ids, whole.ids, whole.n * sizeof *whole.ids))) abort();
        check_decoding(t, &whole, &text);
    }
    token_ids_free(&whole);
    token_ids_free(&chunked);
    tokenizer_free(t);
    return 0;
}
