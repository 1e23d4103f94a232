// Byte-pair encoding of one piece of text, as the BPE model of Hugging Face tokenizers does it:
// every byte starts as the token of its byte-level character, then the pair of neighbours with the
// lowest merge rank is merged (the leftmost of equal ranks first) until no pair has a merge. A
// binary heap of candidate pairs makes a piece of n bytes cost O(n log n); a cache per thread keeps
// the ids of short pieces already encoded. Also the hash maps the tokenizer is built from.
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "text/tokenizer.h"

// Byte strings -> 64-bit values, open addressing; keys are copied into an arena of the map.
typedef struct {
    uint64_t hash; // 0: an empty slot
    uint64_t value;
    size_t key_off;
    size_t key_len;
} ByteMapSlot;

typedef struct {
    ByteMapSlot *slots;
    size_t mask, n;
    uint8_t *keys;
    size_t keys_len, keys_cap;
} ByteMap;

void byte_map_init(ByteMap *m, size_t expected);
void byte_map_free(ByteMap *m);
void byte_map_clear(ByteMap *m);
bool byte_map_get(const ByteMap *m, const uint8_t *key, size_t len, uint64_t *value);
void byte_map_put(ByteMap *m, const uint8_t *key, size_t len, uint64_t value); // inserts or replaces

// (left id, right id) -> (merge rank, merged id).
typedef struct {
    uint64_t key; // left << 32 | right; UINT64_MAX: an empty slot
    uint32_t rank, id;
} PairSlot;

typedef struct {
    PairSlot *slots;
    size_t mask, n;
} PairMap;

void pair_map_init(PairMap *m, size_t expected);
void pair_map_free(PairMap *m);
const PairSlot *pair_map_get(const PairMap *m, uint32_t left, uint32_t right);
void pair_map_put(PairMap *m, uint32_t left, uint32_t right, uint32_t rank, uint32_t id);

// The byte-level alphabet of GPT-2: byte b is written as the character bpe_byte_char(b) (printable
// bytes as themselves, the others from U+0100 on).
uint32_t bpe_byte_char(uint8_t b);

typedef struct {
    uint32_t byte_id[256];  // the token of each byte's one-character string
    uint8_t spelled[256][2]; // UTF-8 of each byte's character
    uint8_t spelled_len[256];
    int16_t byte_of_char[512]; // the alphabet inverted (-1: not in it)
    ByteMap vocab;          // the vocabulary, keyed by the file's spelling (byte-level characters)
    PairMap merges;
    bool ignore_merges;     // a piece that is a vocabulary entry as a whole is that one token
} Bpe;

void bpe_init_alphabet(Bpe *b);
// The byte written as character c, or -1 when c is not in the alphabet.
int bpe_char_byte(const Bpe *b, uint32_t c);

typedef struct {
    uint64_t key; // merge rank << 32 | position
    uint32_t id;  // the merged token
} BpeCandidate;

// One thread's scratch: the symbols of the piece being merged, the heap of candidate merges, the
// piece spelled in the byte-level alphabet, and the cache of pieces already encoded.
typedef struct {
    uint32_t *id;
    int32_t *prev, *next;
    bool *alive;
    size_t cap;
    BpeCandidate *heap;
    size_t heap_n, heap_cap;
    uint8_t *spelled;
    size_t spelled_cap;
    ByteMap cache;   // piece -> ids_off << 8 | count (into cache_ids)
    TokenIds cache_ids;
} BpeWork;

void bpe_work_init(BpeWork *w);
void bpe_work_free(BpeWork *w);
// Appends the ids of one piece (raw bytes, n > 0) to out.
void bpe_encode(const Bpe *b, BpeWork *w, const uint8_t *piece, size_t n, TokenIds *out);
