// Communication built from the CommOps primitives, the same for every transport (see comm.h).
#include "comm.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void comm_reduce_scatter_part(Comm *c, const void *send, void *recv, size_t n, size_t a, size_t b,
                              CommType t) {
    size_t total = (size_t)c->size * n;
    if (a >= b) return;
    if (a == 0 && b == total) {
        c->ops->reduce_scatter_sum(c, send, recv, n, t);
        return;
    }
    if (c->ops->group_begin) c->ops->group_begin();
    for (int r = (int)(a / n); r < c->size && (size_t)r * n < b; r++) {
        size_t first = (size_t)r * n, end = first + n; // rank r's block
        size_t lo = a > first ? a : first, hi = b < end ? b : end;
        c->ops->reduce_sum(c, comm_at(c, send, lo, t), comm_at(c, recv, lo - first, t), hi - lo, t, r);
    }
    if (c->ops->group_end) c->ops->group_end();
}

void comm_all_gather_window(Comm *c, void *window, size_t n, size_t a, size_t b, CommType t) {
    size_t total = (size_t)c->size * n;
    if (a >= b) return;
    if (a == 0 && b == total) {
        c->ops->all_gather(c, comm_at(c, window, (size_t)c->rank * n, t), window, n, t);
        return;
    }
    if (c->ops->group_begin) c->ops->group_begin();
    for (int r = (int)(a / n); r < c->size && (size_t)r * n < b; r++) {
        size_t lo = a > (size_t)r * n ? a : (size_t)r * n, hi = b < (size_t)(r + 1) * n ? b : (size_t)(r + 1) * n;
        c->ops->broadcast(c, comm_at(c, window, lo - a, t), hi - lo, t, r);
    }
    if (c->ops->group_end) c->ops->group_end();
}

// Every rank's text, each padded with NULs to the longest: (size, *width) bytes.
static char *comm_gather_texts(Comm *c, const char *text, size_t *width) {
    int32_t len = (int32_t)strlen(text) + 1, *lens = moe_malloc((size_t)c->size * sizeof(int32_t));
    c->ops->all_gather(c, &len, lens, 1, COMM_I32);
    size_t words = 0;
    for (int r = 0; r < c->size; r++) words = (size_t)lens[r] > 4 * words ? ((size_t)lens[r] + 3) / 4 : words;
    char *mine = moe_calloc(words, 4), *all = moe_malloc((size_t)c->size * words * 4);
    memcpy(mine, text, (size_t)len);
    c->ops->all_gather(c, mine, all, words, COMM_I32);
    free(mine), free(lens);
    *width = 4 * words;
    return all;
}

// The first line where a and b differ, as "a's line" and "b's line" into the buffers.
static void comm_first_diff(const char *a, const char *b, char *line_a, char *line_b, size_t len) {
    while (*a && *b) {
        size_t na = strcspn(a, "\n"), nb = strcspn(b, "\n");
        if (na != nb || memcmp(a, b, na)) break;
        a += na + (a[na] != 0), b += nb + (b[nb] != 0);
    }
    snprintf(line_a, len, "%.*s", (int)strcspn(a, "\n"), a);
    snprintf(line_b, len, "%.*s", (int)strcspn(b, "\n"), b);
}

int comm_agree_text(Comm *c, const char *text, MoeErr err) {
    if (c->size == 1) return 0;
    uint64_t h = rng_hash_str(0, text);
    int32_t mine[2] = {(int32_t)(h >> 32), (int32_t)h}, *all = moe_malloc(2 * (size_t)c->size * sizeof(int32_t));
    c->ops->all_gather(c, mine, all, 2, COMM_I32);
    int first = 1;
    while (first < c->size && !memcmp(&all[2 * first], all, 2 * sizeof(int32_t))) first++;
    free(all);
    if (first == c->size) return 0;
    size_t width;
    char *texts = comm_gather_texts(c, text, &width), theirs[200], root[200];
    comm_first_diff(texts + (size_t)first * width, texts, theirs, root, sizeof root);
    free(texts);
    return moe_err(err, "rank %d has '%s' where rank 0 has '%s'", first, theirs[0] ? theirs : "(nothing)",
                   root[0] ? root : "(nothing)");
}
