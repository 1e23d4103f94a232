// Byte-level BPE tokenizers read from Hugging Face tokenizer.json files (GPT-2, cl100k, OLMo 2/3's
// dolma2, Llama 3 and the like): added and special tokens, the pre-tokenizer (Split patterns run
// by PCRE2, ByteLevel with its GPT-2 pattern), the byte-to-unicode alphabet, the vocabulary and the
// merges. Encoding gives the ids Hugging Face `tokenizers` gives (encode without special tokens);
// decoding gives back the exact bytes. docs/FORMATS.md ("Tokenizers") says what is read, what is
// refused, and how bytes that are not UTF-8 are encoded.
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/util.h"

// Without a tokenizer, tokens are bytes: ids 0..255 are bytes, 256 ends a document.
#define BYTE_VOCAB 257
#define BYTE_EOS 256

typedef struct Tokenizer Tokenizer;

// A growing array of token ids.
typedef struct {
    uint32_t *ids;
    size_t n, cap;
} TokenIds;

void token_ids_push(TokenIds *v, uint32_t id);
void token_ids_append(TokenIds *v, const uint32_t *ids, size_t n);
void token_ids_free(TokenIds *v);

// Reads and checks a tokenizer.json; NULL with a message naming the file and the key on failure.
Tokenizer *tokenizer_load(const char *path, MoeErr err);
void tokenizer_free(Tokenizer *t);

const char *tokenizer_path(const Tokenizer *t);
// XXH3-64 of the file's bytes, as 16 lowercase hex digits: what a run records to recognise it.
const char *tokenizer_hash(const Tokenizer *t);
// Largest id (vocabulary or added token) + 1.
size_t tokenizer_vocab_size(const Tokenizer *t);
// The id of a token given by its text: an added token's content or a vocabulary entry (in the
// file's spelling, e.g. "Ġthe"). false if there is none.
bool tokenizer_token_id(const Tokenizer *t, const char *text, uint32_t *id);
// The end-of-document id: `spec` is a token's text or a decimal id; NULL asks for the first special
// token named like an end of text ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>").
int tokenizer_eos(const Tokenizer *t, const char *spec, uint32_t *id, MoeErr err);
// The bytes a token decodes to (byte-level alphabet mapped back; an added token's content);
// NULL for an id that names no token.
const uint8_t *tokenizer_token_bytes(const Tokenizer *t, uint32_t id, size_t *len);
// Whether decoding gives back every input byte (no Removed split, no stripping added token).
bool tokenizer_lossless(const Tokenizer *t);

typedef struct {
    const uint8_t *text;
    size_t len;
    const char *name; // what messages call it (its file)
} TextSpan;

// Encodes each of n_docs documents into ids[d] (appended; no EOS) with `threads` threads (OpenMP).
// Long stretches of text are cut into pieces of about chunk_bytes (0: chosen from the sizes) that
// threads encode at once; the result is exactly a single pass's, whatever the threads and pieces.
// Fails, naming the file, the document and the byte, when a pattern exceeds PCRE2's match limits.
int tokenizer_encode(const Tokenizer *t, const TextSpan *docs, size_t n_docs, int threads,
                     size_t chunk_bytes, TokenIds *ids, MoeErr err);
