// The parts of a Tokenizer: what tokenizer_load.c builds from tokenizer.json and
// tokenizer_encode.c runs. Not for use outside src/text.
#pragma once
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "text/bpe.h"
#include "text/tokenizer.h"

#define TOK_MAX_STEPS 8
#define TOK_MAX_IDS (1u << 22) // ids at or above are refused (the largest real vocabularies are ~2^18)
#define TOK_MATCH_LIMIT 10000000 // PCRE2 steps one match may take before encoding fails

// One pre-tokenizer, applied to every piece the previous one made (the first to each stretch of
// text between added tokens).
typedef struct {
    pcre2_code *re;          // the split pattern; NULL: this step does not split
    bool keep_matches;       // Isolated keeps both the matches and the text between them;
    bool keep_gaps;          // Removed keeps the side that is not the delimiter
    bool prefix_space;       // ByteLevel add_prefix_space: " " before a piece not starting with one
    bool byte_level;         // a ByteLevel step (the last one)
    char what[48];           // its key, for messages ("pre_tokenizer.pretokenizers[0]")
} PretokStep;

typedef struct {
    uint8_t *content;
    size_t len;
    uint32_t id;
    bool lstrip, rstrip, single_word; // take the whitespace before / after; only between non-words
    bool normalized;                  // matched in the second pass (no normalizer: the same text)
} AddedToken;

// Added tokens of one matching pass, by first byte, longest first: tokens first[b] .. first[b+1]-1
// of `order` start with byte b.
typedef struct {
    uint32_t *order;
    size_t first[257];
    bool starts[256]; // some token starts with this byte
} AddedPass;

// The UTF-8 character at s[0 .. n): its length, and its code point into *c; -1 for bytes that are
// not a valid character (a stray byte, a truncated or overlong sequence, a surrogate).
static inline int tok_utf8_char(const uint8_t *s, size_t n, uint32_t *c) {
    if (n == 0) return -1;
    if (s[0] < 0x80) return *c = s[0], 1;
    int len = s[0] >= 0xF0 ? 4 : s[0] >= 0xE0 ? 3 : s[0] >= 0xC2 ? 2 : 0;
    if (!len || s[0] > 0xF4 || (size_t)len > n) return -1;
    uint32_t v = s[0] & (0x7F >> len);
    for (int i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80) return -1;
        v = v << 6 | (s[i] & 0x3F);
    }
    static const uint32_t least[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (v < least[len] || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) return -1;
    return *c = v, len;
}

struct Tokenizer {
    char *path;
    char hash[17];
    Bpe bpe;
    size_t n_ids;            // largest id + 1
    uint8_t *token_bytes;    // what each id decodes to: token_bytes[token_off[id] ..][token_len[id]]
    size_t *token_off;       // (n_ids)
    uint32_t *token_len;     // (n_ids); UINT32_MAX: no token has this id
    AddedToken *added;
    size_t n_added;
    AddedPass pass[2];       // tokens with normalized = false first, then the normalized ones
    PretokStep steps[TOK_MAX_STEPS];
    int n_steps;
    pcre2_code *is_space;    // one Unicode White_Space character (lstrip, rstrip)
    pcre2_code *is_word;     // one \w character of Rust's regex (single_word)
    bool lossless;
};
