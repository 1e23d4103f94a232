// Byte-pair encoding of one piece with a heap of candidate merges, its per-thread cache, and the
// hash maps of vocabulary and merges (see bpe.h).
#include "bpe.h"

#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

// Pieces up to this many bytes are cached (as tokenizers does; longer ones are rare and unique).
#define BPE_CACHE_MAX_PIECE 255
// The cache starts over when it holds this many pieces or ids (memory stays bounded per thread).
#define BPE_CACHE_MAX_PIECES 65536
#define BPE_CACHE_MAX_IDS (1u << 22)

static size_t table_size(size_t expected) {
    size_t n = 16;
    while (n < 2 * expected) n *= 2;
    return n;
}

// ---------------------------------------------------------------------------------------------
// ByteMap

static uint64_t byte_map_hash(const uint8_t *key, size_t len) {
    return XXH3_64bits(key, len) | 1; // never 0, the mark of an empty slot
}

void byte_map_init(ByteMap *m, size_t expected) {
    memset(m, 0, sizeof *m);
    size_t n = table_size(expected);
    m->slots = moe_calloc(n, sizeof(ByteMapSlot));
    m->mask = n - 1;
}

void byte_map_free(ByteMap *m) {
    free(m->slots);
    free(m->keys);
    memset(m, 0, sizeof *m);
}

void byte_map_clear(ByteMap *m) {
    memset(m->slots, 0, (m->mask + 1) * sizeof(ByteMapSlot));
    m->n = 0;
    m->keys_len = 0;
}

static ByteMapSlot *byte_map_find(const ByteMap *m, const uint8_t *key, size_t len, uint64_t h) {
    for (size_t i = h & m->mask;; i = (i + 1) & m->mask) {
        ByteMapSlot *s = &m->slots[i];
        if (!s->hash || (s->hash == h && s->key_len == len && !memcmp(m->keys + s->key_off, key, len)))
            return s;
    }
}

bool byte_map_get(const ByteMap *m, const uint8_t *key, size_t len, uint64_t *value) {
    const ByteMapSlot *s = byte_map_find(m, key, len, byte_map_hash(key, len));
    if (!s->hash) return false;
    *value = s->value;
    return true;
}

static void byte_map_grow(ByteMap *m) {
    ByteMapSlot *old = m->slots;
    size_t old_n = m->mask + 1, n = 2 * old_n;
    m->slots = moe_calloc(n, sizeof(ByteMapSlot));
    m->mask = n - 1;
    for (size_t i = 0; i < old_n; i++) {
        if (!old[i].hash) continue;
        size_t j = old[i].hash & m->mask;
        while (m->slots[j].hash) j = (j + 1) & m->mask;
        m->slots[j] = old[i];
    }
    free(old);
}

void byte_map_put(ByteMap *m, const uint8_t *key, size_t len, uint64_t value) {
    if (2 * (m->n + 1) > m->mask + 1) byte_map_grow(m);
    uint64_t h = byte_map_hash(key, len);
    ByteMapSlot *s = byte_map_find(m, key, len, h);
    if (s->hash) {
        s->value = value;
        return;
    }
    if (m->keys_len + len > m->keys_cap) {
        m->keys_cap = 2 * (m->keys_len + len) + 1024;
        m->keys = moe_realloc(m->keys, m->keys_cap);
    }
    if (len) memcpy(m->keys + m->keys_len, key, len);
    *s = (ByteMapSlot){.hash = h, .value = value, .key_off = m->keys_len, .key_len = len};
    m->keys_len += len;
    m->n++;
}

// ---------------------------------------------------------------------------------------------
// PairMap

#define PAIR_EMPTY UINT64_MAX

static uint64_t pair_key(uint32_t left, uint32_t right) { return (uint64_t)left << 32 | right; }

static size_t pair_slot(const PairMap *m, uint64_t key) {
    uint64_t h = (key ^ key >> 29) * 0x9E3779B97F4A7C15ull; // Fibonacci hashing of the pair
    size_t i = (size_t)(h >> 32 & m->mask);
    while (m->slots[i].key != PAIR_EMPTY && m->slots[i].key != key) i = (i + 1) & m->mask;
    return i;
}

void pair_map_init(PairMap *m, size_t expected) {
    size_t n = table_size(expected);
    m->slots = moe_malloc(n * sizeof(PairSlot));
    for (size_t i = 0; i < n; i++) m->slots[i].key = PAIR_EMPTY;
    m->mask = n - 1;
    m->n = 0;
}

void pair_map_free(PairMap *m) {
    free(m->slots);
    memset(m, 0, sizeof *m);
}

const PairSlot *pair_map_get(const PairMap *m, uint32_t left, uint32_t right) {
    const PairSlot *s = &m->slots[pair_slot(m, pair_key(left, right))];
    return s->key == PAIR_EMPTY ? NULL : s;
}

void pair_map_put(PairMap *m, uint32_t left, uint32_t right, uint32_t rank, uint32_t id) {
    if (2 * (m->n + 1) > m->mask + 1) {
        PairMap bigger;
        pair_map_init(&bigger, m->mask + 1);
        for (size_t i = 0; i <= m->mask; i++)
            if (m->slots[i].key != PAIR_EMPTY) bigger.slots[pair_slot(&bigger, m->slots[i].key)] = m->slots[i];
        bigger.n = m->n;
        free(m->slots);
        *m = bigger;
    }
    uint64_t key = pair_key(left, right);
    PairSlot *s = &m->slots[pair_slot(m, key)];
    if (s->key == PAIR_EMPTY) m->n++;
    *s = (PairSlot){.key = key, .rank = rank, .id = id}; // a pair listed twice keeps its last rank
}

// ---------------------------------------------------------------------------------------------
// The byte-level alphabet (GPT-2's bytes_to_unicode)

static bool byte_is_printable(uint8_t b) {
    return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
}

uint32_t bpe_byte_char(uint8_t b) {
    if (byte_is_printable(b)) return b;
    uint32_t n = 0; // the others take U+0100, U+0101, ... in byte order
    for (int c = 0; c < b; c++) n += !byte_is_printable((uint8_t)c);
    return 256 + n;
}

int bpe_char_byte(const Bpe *b, uint32_t c) { return c < 512 ? b->byte_of_char[c] : -1; }

void bpe_init_alphabet(Bpe *b) {
    for (int c = 0; c < 512; c++) b->byte_of_char[c] = -1; // the alphabet is below U+0200
    for (int i = 0; i < 256; i++) {
        b->byte_of_char[bpe_byte_char((uint8_t)i)] = (int16_t)i;
        uint32_t c = bpe_byte_char((uint8_t)i); // below U+0800: one or two UTF-8 bytes
        if (c < 0x80) b->spelled[i][0] = (uint8_t)c, b->spelled_len[i] = 1;
        else {
            b->spelled[i][0] = (uint8_t)(0xC0 | c >> 6);
            b->spelled[i][1] = (uint8_t)(0x80 | (c & 0x3F));
            b->spelled_len[i] = 2;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The merge loop

void bpe_work_init(BpeWork *w) {
    memset(w, 0, sizeof *w);
    byte_map_init(&w->cache, 1024);
}

void bpe_work_free(BpeWork *w) {
    free(w->id);
    free(w->prev);
    free(w->next);
    free(w->alive);
    free(w->heap);
    free(w->spelled);
    byte_map_free(&w->cache);
    token_ids_free(&w->cache_ids);
}

static void bpe_reserve(BpeWork *w, size_t n) {
    if (n <= w->cap) return;
    w->cap = 2 * n;
    w->id = moe_realloc(w->id, w->cap * sizeof *w->id);
    w->prev = moe_realloc(w->prev, w->cap * sizeof *w->prev);
    w->next = moe_realloc(w->next, w->cap * sizeof *w->next);
    w->alive = moe_realloc(w->alive, w->cap * sizeof *w->alive);
    w->heap = moe_realloc(w->heap, 2 * w->cap * sizeof *w->heap);
    w->heap_cap = 2 * w->cap;
}

static void heap_push(BpeWork *w, uint32_t rank, size_t pos, uint32_t id) {
    if (w->heap_n == w->heap_cap) {
        w->heap_cap *= 2;
        w->heap = moe_realloc(w->heap, w->heap_cap * sizeof *w->heap);
    }
    BpeCandidate c = {(uint64_t)rank << 32 | pos, id};
    size_t i = w->heap_n++;
    while (i > 0 && w->heap[(i - 1) / 2].key > c.key) {
        w->heap[i] = w->heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    w->heap[i] = c;
}

static BpeCandidate heap_pop(BpeWork *w) {
    BpeCandidate top = w->heap[0], last = w->heap[--w->heap_n];
    size_t i = 0, n = w->heap_n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && w->heap[c + 1].key < w->heap[c].key) c++;
        if (w->heap[c].key >= last.key) break;
        w->heap[i] = w->heap[c];
        i = c;
    }
    if (n) w->heap[i] = last;
    return top;
}

static void push_pair(const Bpe *b, BpeWork *w, size_t left, size_t right) {
    const PairSlot *m = pair_map_get(&b->merges, w->id[left], w->id[right]);
    if (m) heap_push(w, m->rank, left, m->id);
}

// tokenizers' Word::merge_all: a candidate is stale when its symbol was merged away, has no right
// neighbour any more, or its pair now merges into another token.
static void bpe_merge(const Bpe *b, BpeWork *w, size_t n) {
    w->heap_n = 0;
    for (size_t i = 0; i + 1 < n; i++) push_pair(b, w, i, i + 1);
    while (w->heap_n) {
        BpeCandidate top = heap_pop(w);
        size_t pos = (size_t)(top.key & 0xffffffffu);
        if (!w->alive[pos] || w->next[pos] < 0) continue;
        size_t right = (size_t)w->next[pos];
        const PairSlot *m = pair_map_get(&b->merges, w->id[pos], w->id[right]);
        if (!m || m->id != top.id) continue;
        w->id[pos] = top.id;
        w->alive[right] = false;
        w->next[pos] = w->next[right];
        if (w->next[right] >= 0) w->prev[w->next[right]] = (int32_t)pos;
        if (w->prev[pos] >= 0) push_pair(b, w, (size_t)w->prev[pos], pos);
        if (w->next[pos] >= 0) push_pair(b, w, pos, (size_t)w->next[pos]);
    }
}

static bool bpe_whole_piece(const Bpe *b, BpeWork *w, const uint8_t *piece, size_t n, uint32_t *id) {
    if (2 * n > w->spelled_cap) {
        w->spelled_cap = 4 * n;
        w->spelled = moe_realloc(w->spelled, w->spelled_cap);
    }
    size_t len = 0;
    for (size_t i = 0; i < n; i++) {
        memcpy(w->spelled + len, b->spelled[piece[i]], b->spelled_len[piece[i]]);
        len += b->spelled_len[piece[i]];
    }
    uint64_t v;
    if (!byte_map_get(&b->vocab, w->spelled, len, &v)) return false;
    *id = (uint32_t)v;
    return true;
}

static void bpe_cache_put(BpeWork *w, const uint8_t *piece, size_t n, const uint32_t *ids, size_t count) {
    if (w->cache.n >= BPE_CACHE_MAX_PIECES || w->cache_ids.n + count > BPE_CACHE_MAX_IDS) {
        byte_map_clear(&w->cache);
        w->cache_ids.n = 0;
    }
    byte_map_put(&w->cache, piece, n, (uint64_t)w->cache_ids.n << 8 | count);
    token_ids_append(&w->cache_ids, ids, count);
}

void bpe_encode(const Bpe *b, BpeWork *w, const uint8_t *piece, size_t n, TokenIds *out) {
    bool cached = n <= BPE_CACHE_MAX_PIECE;
    uint64_t hit;
    if (cached && byte_map_get(&w->cache, piece, n, &hit)) {
        token_ids_append(out, w->cache_ids.ids + (hit >> 8), (size_t)(hit & 0xff));
        return;
    }
    size_t first = out->n;
    uint32_t whole;
    if (b->ignore_merges && bpe_whole_piece(b, w, piece, n, &whole)) token_ids_push(out, whole);
    else {
        MOE_CHECK(n <= INT32_MAX, "a pre-tokenized piece of %zu bytes is more than the 2^31 - 1 bytes BPE "
                  "merges at once", n);
        bpe_reserve(w, n);
        for (size_t i = 0; i < n; i++) {
            w->id[i] = b->byte_id[piece[i]];
            w->prev[i] = (int32_t)i - 1;
            w->next[i] = i + 1 < n ? (int32_t)i + 1 : -1;
            w->alive[i] = true;
        }
        bpe_merge(b, w, n);
        for (size_t i = 0; i < n; i++)
            if (w->alive[i]) token_ids_push(out, w->id[i]);
    }
    if (cached) bpe_cache_put(w, piece, n, out->ids + first, out->n - first);
}
