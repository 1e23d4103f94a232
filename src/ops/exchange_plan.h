// The arithmetic of the direct expert exchange (ops.h: moe_exchange_plan), shared by the CPU and
// CUDA backends: from every expert-parallel rank's dispatch offsets, where each block of rows
// starts in its owner's expert-major receive buffer and where it returns to in its source's
// dispatch order. n ranks own El experts each (E = n El): global expert g lives on rank g / El.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __CUDACC__
#define EXCHANGE_HD __host__ __device__
#else
#define EXCHANGE_HD
#endif

// Rows source rank s routed to global expert g. all_offsets: (n, E + 1).
static inline EXCHANGE_HD int32_t exchange_count(const int32_t *all_offsets, size_t E, size_t s, size_t g) {
    const int32_t *o = all_offsets + s * (E + 1);
    return o[g + 1] - o[g];
}

// Row of rank j's receive buffer where source s's rows for j's local expert e start: all rows of
// j's experts before e, then those of sources before s for e.
static inline EXCHANGE_HD int32_t exchange_recv_row(const int32_t *all_offsets, size_t n, size_t El, size_t j,
                                                    size_t e, size_t s) {
    size_t E = n * El;
    int32_t row = 0;
    for (size_t e2 = 0; e2 < e; e2++)
        for (size_t s2 = 0; s2 < n; s2++) row += exchange_count(all_offsets, E, s2, j * El + e2);
    for (size_t s2 = 0; s2 < s; s2++) row += exchange_count(all_offsets, E, s2, j * El + e);
    return row;
}

// Entry i of rank `rank`'s plan (i <= E): receive offset i (i <= El), dispatch block i and return
// block i (i < E; return block i = e n + s). Layout as in ops.h. Each rank's receive buffer holds
// `cap` rows: dispatch blocks are cut where they would pass it, return blocks keep their counts
// (their rows past cap were dropped and go back as zeros), receive offsets stop at cap. Returns
// the rows of dispatch block i that were dropped (0 for i = E).
static inline EXCHANGE_HD int32_t exchange_plan_entry(int32_t *plan, const int32_t *all_offsets, size_t n,
                                                      size_t El, size_t rank, size_t i, size_t cap) {
    size_t E = n * El;
    int32_t *dispatch = plan + El + 1, *ret = dispatch + 4 * E, room;
    if (i <= El) {
        int32_t start = exchange_recv_row(all_offsets, n, El, rank, i, 0);
        plan[i] = (size_t)start < cap ? start : (int32_t)cap;
    }
    if (i >= E) return 0;
    int32_t *b = dispatch + 4 * i;
    b[0] = all_offsets[rank * (E + 1) + i];
    b[1] = exchange_count(all_offsets, E, rank, i);
    b[2] = (int32_t)(i / El);
    b[3] = exchange_recv_row(all_offsets, n, El, i / El, i % El, rank);
    room = (size_t)b[3] < cap ? (int32_t)cap - b[3] : 0;
    int32_t dropped = b[1] > room ? b[1] - room : 0;
    b[1] -= dropped;
    size_t e = i / n, s = i % n, g = rank * El + e;
    b = ret + 4 * i;
    b[0] = exchange_recv_row(all_offsets, n, El, rank, e, s);
    b[1] = exchange_count(all_offsets, E, s, g);
    b[2] = (int32_t)s;
    b[3] = all_offsets[s * (E + 1) + g];
    return dropped;
}

// Length of a plan in int32.
static inline size_t exchange_plan_len(size_t n, size_t El) { return El + 1 + 8 * n * El; }
