// MPI tests of the communication layer (src/dist/comm.h): under `mpirun -np N` every rank checks
// the exact results of each operation; rank 0 prints one line per test and "N passed, N failed".
// `test_comm --fatal-on-rank R`: rank R fails while the others block, which must end every rank.
#ifndef MOE_MPI
#error "test_comm runs under mpirun: build it with MPI=1"
#endif
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/real.h"
#include "common/util.h"
#include "dist/comm.h"

#define POISON (-999.0) // in every output element before a call; exact in every type

static int failures; // failed checks on this rank in the running test
static int my_rank;

#define CHECK(cond, ...)                                                                         \
    do {                                                                                         \
        if (!(cond)) {                                                                           \
            failures++;                                                                          \
            fprintf(stderr, "    [rank %d] %s:%d: ", my_rank, __FILE__, __LINE__);               \
            fprintf(stderr, __VA_ARGS__);                                                        \
            fputc('\n', stderr);                                                                 \
        }                                                                                        \
    } while (0)

typedef struct {
    const char *name;
    void (*typed)(Comm *w, CommType t); // run once per element kind, or
    void (*plain)(Comm *w);             // once
    int min_ranks;
} TestCase;

static const CommType TYPES[] = {COMM_F32, COMM_ACT, COMM_I32};

static const char *type_name(CommType t) {
    return t == COMM_I32 ? "i32" : t == COMM_F32 ? "f32" : "act";
}

static size_t type_bytes(CommType t) { return t == COMM_I32 ? sizeof(int32_t) : sizeof(real); }

static void put(CommType t, void *buf, size_t i, double v) {
    if (t == COMM_I32) ((int32_t *)buf)[i] = (int32_t)v;
    else ((real *)buf)[i] = (real)v;
}

static double get(CommType t, const void *buf, size_t i) {
    return t == COMM_I32 ? ((const int32_t *)buf)[i] : ((const real *)buf)[i];
}

// n elements of kind t, all POISON.
static void *poisoned(CommType t, size_t n) {
    void *buf = moe_malloc(n * type_bytes(t));
    for (size_t i = 0; i < n; i++) put(t, buf, i, POISON);
    return buf;
}

// A small integer, distinct per (rank, block, index), of both signs: sums over 4 ranks stay exact.
static double val(int rank, size_t block, size_t i) {
    double v = (rank + 1) * 1000.0 + (double)block * 37.0 + (double)i;
    return i % 2 ? -v : v;
}

// Compares got[0..n) with want[0..n); reports the first difference.
static void expect(const char *what, CommType t, const void *got, const double *want, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (get(t, got, i) == want[i]) continue;
        CHECK(0, "%s (%s): element %zu = %g, expected %g", what, type_name(t), i, get(t, got, i),
              want[i]);
        return;
    }
}

static void expect_poison(const char *what, CommType t, const void *buf, size_t i) {
    CHECK(get(t, buf, i) == POISON, "%s (%s): wrote past its output (element %zu)", what,
          type_name(t), i);
}

// ---------------------------------------------------------------- collectives

static void test_all_reduce_sum(Comm *w, CommType t) {
    static const size_t sizes[] = {0, 1, 7, 1001}; // 1001: several pieces under MOE_COMM_CHUNK
    for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
        size_t n = sizes[s];
        void *buf = poisoned(t, n + 1);
        double *want = moe_calloc(n + 1, sizeof *want);
        for (size_t i = 0; i < n; i++) {
            put(t, buf, i, val(w->rank, s, i));
            for (int r = 0; r < w->size; r++) want[i] += val(r, s, i);
        }
        w->ops->all_reduce_sum(w, buf, n, t);
        expect("all_reduce_sum", t, buf, want, n);
        expect_poison("all_reduce_sum", t, buf, n);
        free(want);
        free(buf);
    }
}

// send (size x n): block j holds val(rank, j, .); this rank's result is the sum of block `rank`.
static void check_reduce_scatter(Comm *w, CommType t, bool in_place) {
    size_t n = 5, p = (size_t)w->size;
    void *send = poisoned(t, p * n + 1);
    for (size_t j = 0; j < p; j++)
        for (size_t i = 0; i < n; i++) put(t, send, j * n + i, val(w->rank, j, i));
    void *out = in_place ? (char *)send + (size_t)w->rank * n * type_bytes(t) : poisoned(t, n + 1);
    double want[5] = {0};
    for (size_t i = 0; i < n; i++)
        for (int r = 0; r < w->size; r++) want[i] += val(r, (size_t)w->rank, i);
    w->ops->reduce_scatter_sum(w, send, out, n, t);
    expect("reduce_scatter_sum", t, out, want, n);
    expect_poison("reduce_scatter_sum", t, out, n + (in_place ? (p - 1 - w->rank) * n : 0));
    if (!in_place) free(out);
    free(send);
}

static void test_reduce_scatter(Comm *w, CommType t) { check_reduce_scatter(w, t, false); }
static void test_reduce_scatter_in_place(Comm *w, CommType t) { check_reduce_scatter(w, t, true); }

// To each root in turn: the root gets the sum; recv stays untouched everywhere else.
static void test_reduce_sum(Comm *w, CommType t) {
    static const size_t sizes[] = {0, 1, 1001};
    for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++)
        for (int root = 0; root < w->size; root++) {
            size_t n = sizes[s];
            void *send = poisoned(t, n), *recv = poisoned(t, n + 1);
            double *want = moe_calloc(n + 1, sizeof *want);
            for (size_t i = 0; i < n; i++) {
                put(t, send, i, val(w->rank, s, i));
                for (int r = 0; r < w->size; r++) want[i] += val(r, s, i);
                if (w->rank != root) want[i] = POISON;
            }
            w->ops->reduce_sum(w, send, recv, n, t, root);
            expect("reduce_sum", t, recv, want, n);
            expect_poison("reduce_sum", t, recv, n);
            free(want), free(send), free(recv);
        }
}

// Parts [a, b) of a reduce-scatter of size blocks of n: inside one block, across blocks, empty,
// whole, and pseudo-random ones (the same on every rank). Elements of this rank's block outside
// [a, b) stay untouched.
static void part_ranges(size_t n, size_t total, size_t parts[12][2]) {
    const size_t fixed[6][2] = {{0, total}, {0, 0}, {3, 4}, {5, total < 2 * n + 3 ? total : 2 * n + 3},
                                {n - 1, total}, {0, 1}};
    memcpy(parts, fixed, sizeof fixed);
    uint64_t x = 12345;
    for (int k = 6; k < 12; k++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        size_t a = (size_t)(x >> 33) % (total + 1), b = (size_t)(x >> 13) % (total + 1);
        parts[k][0] = a < b ? a : b, parts[k][1] = a < b ? b : a;
    }
}

static void test_reduce_scatter_part(Comm *w, CommType t) {
    size_t n = 7, p = (size_t)w->size, total = p * n, parts[12][2];
    part_ranges(n, total, parts);
    void *send = poisoned(t, total);
    for (size_t j = 0; j < total; j++) put(t, send, j, val(w->rank, j / n, j % n));
    for (int k = 0; k < 12; k++) {
        size_t a = parts[k][0], b = parts[k][1], lo = (size_t)w->rank * n;
        void *recv = poisoned(t, n + 1);
        double want[7];
        for (size_t i = 0; i < n; i++) {
            double sum = 0;
            for (int r = 0; r < w->size; r++) sum += val(r, (size_t)w->rank, i);
            want[i] = lo + i >= a && lo + i < b ? sum : POISON;
        }
        comm_reduce_scatter_part(w, send, recv, n, a, b, t);
        expect("comm_reduce_scatter_part", t, recv, want, n);
        expect_poison("comm_reduce_scatter_part", t, recv, n);
        free(recv);
    }
    free(send);
}

// The same parts of an in-place all-gather: inside [a, b) each rank's block from its owner, the
// rest of the buffer as it was.
static void test_all_gather_part(Comm *w, CommType t) {
    size_t n = 7, p = (size_t)w->size, total = p * n, parts[12][2];
    part_ranges(n, total, parts);
    for (int k = 0; k < 12; k++) {
        size_t a = parts[k][0], b = parts[k][1];
        void *buf = poisoned(t, total + 1);
        double *want = moe_malloc(total * sizeof *want);
        for (size_t j = 0; j < total; j++) {
            bool mine = j / n == (size_t)w->rank;
            if (mine) put(t, buf, j, val(w->rank, 0, j));
            want[j] = mine || (j >= a && j < b) ? val((int)(j / n), 0, j) : POISON;
        }
        comm_all_gather_window(w, (char *)buf + a * type_bytes(t), n, a, b, t); // in place
        expect("comm_all_gather_window in place", t, buf, want, total);
        expect_poison("comm_all_gather_window in place", t, buf, total);
        // the same part into a window of its own size: this rank's elements of [a, b) put there
        void *window = poisoned(t, b - a + 1);
        for (size_t j = a; j < b; j++)
            if (j / n == (size_t)w->rank) put(t, window, j - a, val(w->rank, 0, j));
        comm_all_gather_window(w, window, n, a, b, t);
        expect("comm_all_gather_window", t, window, want + a, b - a);
        expect_poison("comm_all_gather_window", t, window, b - a);
        free(want), free(buf), free(window);
    }
}

// Every rank contributes val(rank, 0, .); recv gets them in rank order.
static void check_all_gather(Comm *w, CommType t, bool in_place) {
    size_t n = 3, p = (size_t)w->size;
    void *recv = poisoned(t, p * n + 1);
    void *send = in_place ? (char *)recv + (size_t)w->rank * n * type_bytes(t) : poisoned(t, n);
    double *want = moe_malloc(p * n * sizeof *want);
    for (size_t i = 0; i < n; i++) put(t, send, i, val(w->rank, 0, i));
    for (size_t j = 0; j < p; j++)
        for (size_t i = 0; i < n; i++) want[j * n + i] = val((int)j, 0, i);
    w->ops->all_gather(w, send, recv, n, t);
    expect("all_gather", t, recv, want, p * n);
    expect_poison("all_gather", t, recv, p * n);
    if (!in_place) free(send);
    free(want);
    free(recv);
}

static void test_all_gather(Comm *w, CommType t) { check_all_gather(w, t, false); }
static void test_all_gather_in_place(Comm *w, CommType t) { check_all_gather(w, t, true); }

// Elements rank `from` sends to rank `to`: 0 to 3, zero for some pairs at every size >= 2.
static size_t a2a_count(int from, int to) { return (size_t)(from + 2 * to + 1) % 4; }

static void test_all_to_all_v(Comm *w, CommType t) {
    int p = w->size;
    size_t *send_counts = moe_malloc((size_t)p * sizeof(size_t));
    size_t *recv_counts = moe_malloc((size_t)p * sizeof(size_t));
    size_t n_send = 0, n_recv = 0;
    for (int j = 0; j < p; j++) {
        n_send += send_counts[j] = a2a_count(w->rank, j);
        n_recv += recv_counts[j] = a2a_count(j, w->rank);
    }
    void *send = poisoned(t, n_send + 1), *recv = poisoned(t, n_recv + 1);
    double *want = moe_malloc((n_recv + 1) * sizeof *want);
    for (int j = 0, o = 0; j < p; j++)
        for (size_t k = 0; k < send_counts[j]; k++) put(t, send, (size_t)o++, val(w->rank, j, k));
    for (int j = 0, o = 0; j < p; j++)
        for (size_t k = 0; k < recv_counts[j]; k++) want[o++] = val(j, (size_t)w->rank, k);
    w->ops->all_to_all_v(w, send, send_counts, recv, recv_counts, t);
    expect("all_to_all_v", t, recv, want, n_recv);
    expect_poison("all_to_all_v", t, recv, n_recv);
    free(want);
    free(recv);
    free(send);
    free(recv_counts);
    free(send_counts);
}

// ---------------------------------------------------------------- point to point

// Two messages around the ring (the second longer than MOE_COMM_CHUNK): each rank receives its
// left neighbour's, in order. Rank 0 sends first so that the ring of blocking calls cannot stall.
static void test_send_recv_ring(Comm *w, CommType t) {
    static const size_t sizes[] = {5, 1001};
    int next = (w->rank + 1) % w->size, prev = (w->rank + w->size - 1) % w->size;
    void *out[2], *in[2];
    for (size_t m = 0; m < 2; m++) {
        out[m] = poisoned(t, sizes[m]);
        in[m] = poisoned(t, sizes[m] + 1);
        for (size_t i = 0; i < sizes[m]; i++) put(t, out[m], i, val(w->rank, m, i));
    }
    for (int turn = 0; turn < 2; turn++) {
        bool sending = (turn == 0) == (w->rank == 0);
        for (size_t m = 0; m < 2; m++) {
            if (sending) w->ops->send(w, out[m], sizes[m], t, next);
            else w->ops->recv(w, in[m], sizes[m], t, prev);
        }
    }
    for (size_t m = 0; m < 2; m++) {
        double *want = moe_malloc(sizes[m] * sizeof *want);
        for (size_t i = 0; i < sizes[m]; i++) want[i] = val(prev, m, i);
        expect("send/recv", t, in[m], want, sizes[m]);
        expect_poison("send/recv", t, in[m], sizes[m]);
        free(want);
        free(out[m]);
        free(in[m]);
    }
}

// One exchange: n_send of val(rank, 0, .) to `to`, n_recv of val(from, 0, .) from `from`.
static void check_sendrecv(Comm *w, CommType t, int to, size_t n_send, int from, size_t n_recv) {
    void *send = poisoned(t, n_send), *recv = poisoned(t, n_recv + 1);
    double *want = moe_malloc((n_recv + 1) * sizeof *want);
    for (size_t i = 0; i < n_send; i++) put(t, send, i, val(w->rank, 0, i));
    for (size_t i = 0; i < n_recv; i++) want[i] = val(from, 0, i);
    w->ops->sendrecv(w, send, n_send, to, recv, n_recv, from, t);
    expect("sendrecv", t, recv, want, n_recv);
    expect_poison("sendrecv", t, recv, n_recv);
    free(want);
    free(recv);
    free(send);
}

// Pairs (0,1), (2,3)... exchange different lengths; then a ring shift (with oneself on 1 rank).
static void test_sendrecv(Comm *w, CommType t) {
    int partner = w->rank ^ 1;
    if (partner < w->size) check_sendrecv(w, t, partner, 3 + w->rank, partner, 3 + partner);
    int next = (w->rank + 1) % w->size, prev = (w->rank + w->size - 1) % w->size;
    check_sendrecv(w, t, next, 1001, prev, 1001);
}

// ---------------------------------------------------------------- agreement and sub-communicators

static void test_all_ok(Comm *w) {
    CHECK(w->ops->all_ok(w, true), "all_ok: every rank true gave false");
    CHECK(!w->ops->all_ok(w, w->rank != w->size - 1), "all_ok: rank %d false gave true",
          w->size - 1);
    w->ops->barrier(w);
    CHECK(!w->ops->all_ok(w, false), "all_ok: every rank false gave true");
}

// Peer memory (the ranks here share one node, so it must be granted): in each of two rounds every
// rank writes round * 100 + its rank into its slot of every rank's buffer; after a fence each rank
// must see all the slots of its own buffer filled.
static void test_peer_memory(Comm *w) {
    PeerMem pm;
    size_t n = (size_t)w->size;
    bool ok = w->ops->peer_alloc && w->ops->peer_alloc(w, 2 * n * sizeof(int32_t) + 5, &pm) == 0;
    CHECK(ok, "peer_alloc refused ranks of one node");
    if (!ok) return;
    CHECK(pm.peers[w->rank] == pm.base, "peers[rank] is not this rank's base");
    for (int round = 0; round < 2; round++) {
        for (size_t j = 0; j < n; j++) ((int32_t *)pm.peers[j])[round * n + (size_t)w->rank] = 100 * round + w->rank;
        w->ops->fence(w);
        for (size_t i = 0; i < n; i++) {
            int32_t got = ((int32_t *)pm.base)[round * n + i];
            CHECK(got == 100 * round + (int32_t)i, "round %d: slot %zu holds %d", round, i, got);
        }
    }
    w->ops->peer_free(w, &pm);
}

// Gathers the world ranks of sub's members (int32) in sub's rank order; want[j] = world rank of
// sub rank j.
static void expect_members(Comm *sub, int world_rank, const double *want) {
    int32_t me = world_rank;
    int32_t *got = moe_malloc((size_t)sub->size * sizeof *got);
    sub->ops->all_gather(sub, &me, got, 1, COMM_I32);
    expect("members of the split", COMM_I32, got, want, (size_t)sub->size);
    free(got);
}

static void test_split_parity(Comm *w) {
    int parity = w->rank % 2;
    Comm *sub = w->ops->split(w, parity, w->rank);
    int want_size = (w->size - parity + 1) / 2;
    CHECK(sub->size == want_size && sub->rank == w->rank / 2,
          "split by parity: rank %d of %d, expected %d of %d", sub->rank, sub->size,
          w->rank / 2, want_size);
    if (sub->size == want_size) {
        double *want = moe_malloc((size_t)want_size * sizeof *want);
        for (int j = 0; j < want_size; j++) want[j] = 2 * j + parity;
        expect_members(sub, w->rank, want);
        free(want);
    }
    int32_t sum = w->rank;
    sub->ops->all_reduce_sum(sub, &sum, 1, COMM_I32);
    int want_sum = 0;
    for (int r = parity; r < w->size; r += 2) want_sum += r;
    CHECK(sum == want_sum, "all_reduce_sum in the parity split: %d, expected %d", sum, want_sum);
    sub->ops->free(sub);
}

// Counters past 2^32 (the FP8 quantisation's, train.c) sum exactly.
static void test_all_reduce_u64(Comm *w) {
    uint64_t v[2] = {((uint64_t)1 << 40) + (uint64_t)w->rank, ((uint64_t)w->rank << 53) + 1}, want[2] = {0, 0};
    for (int r = 0; r < w->size; r++) want[0] += ((uint64_t)1 << 40) + (uint64_t)r, want[1] += ((uint64_t)r << 53) + 1;
    w->ops->all_reduce_sum(w, v, 2, COMM_U64);
    CHECK(v[0] == want[0] && v[1] == want[1], "all_reduce_sum u64: %llu %llu, expected %llu %llu",
          (unsigned long long)v[0], (unsigned long long)v[1], (unsigned long long)want[0], (unsigned long long)want[1]);
}

// The largest over ranks, element by element (the FP8 weights' block maxima, model.c): values of both
// signs whose largest is on a different rank per element.
static void test_all_reduce_max(Comm *w) {
    static const size_t sizes[] = {0, 1, 7, 1001}; // 1001: several pieces under MOE_COMM_CHUNK
    for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
        size_t n = sizes[s];
        void *buf = poisoned(COMM_F32, n + 1);
        double *want = moe_malloc((n + 1) * sizeof *want);
        for (size_t i = 0; i < n; i++) {
            put(COMM_F32, buf, i, val(w->rank, s, i));
            want[i] = val(0, s, i);
            for (int r = 1; r < w->size; r++) want[i] = val(r, s, i) > want[i] ? val(r, s, i) : want[i];
        }
        w->ops->all_reduce_max(w, buf, n);
        expect("all_reduce_max", COMM_F32, buf, want, n);
        expect_poison("all_reduce_max", COMM_F32, buf, n);
        free(want), free(buf);
    }
}

// Parts of a buffer of bytes (the FP8 weights' codes, model.c) gathered in place: inside [a, b) each
// rank's block from its owner, the rest as it was.
static void test_all_gather_part_bytes(Comm *w) {
    size_t n = 7, total = (size_t)w->size * n, parts[12][2];
    part_ranges(n, total, parts);
    uint8_t *buf = moe_malloc(total + 1), *want = moe_malloc(total + 1);
    for (int k = 0; k < 12; k++) {
        size_t a = parts[k][0], b = parts[k][1];
        for (size_t j = 0; j <= total; j++) {
            bool mine = j / n == (size_t)w->rank, in = j >= a && j < b;
            uint8_t v = (uint8_t)(j / n * 37 + j * 5 + 200); // past 127: unsigned bytes
            buf[j] = mine && j < total ? v : 0xee;
            want[j] = (mine || in) && j < total ? v : 0xee;
        }
        comm_all_gather_window(w, buf + a, n, a, b, COMM_U8);
        size_t bad = total + 1;
        for (size_t j = total + 1; j-- > 0;) bad = buf[j] != want[j] ? j : bad;
        CHECK(bad > total, "comm_all_gather_window of bytes [%zu, %zu): byte %zu = %u, expected %u", a, b, bad,
              bad <= total ? buf[bad] : 0, bad <= total ? want[bad] : 0);
    }
    free(buf), free(want);
}

// One color, keys in reverse: the sub-communicator orders the ranks backwards.
static void test_split_key_order(Comm *w) {
    Comm *sub = w->ops->split(w, 0, w->size - w->rank);
    CHECK(sub->size == w->size && sub->rank == w->size - 1 - w->rank,
          "split by key: rank %d of %d, expected %d of %d", sub->rank, sub->size,
          w->size - 1 - w->rank, w->size);
    if (sub->size == w->size) {
        double *want = moe_malloc((size_t)w->size * sizeof *want);
        for (int j = 0; j < w->size; j++) want[j] = w->size - 1 - j;
        expect_members(sub, w->rank, want);
        free(want);
    }
    sub->ops->free(sub);
}

// Same texts agree; a text that differs on the last rank (longer than the others, so the texts
// are padded) is named by rank and first differing line on every rank.
static void test_agree_text(Comm *w) {
    MoeErr err = "";
    CHECK(comm_agree_text(w, "a = 1\nb = 2\n", err) == 0, "same texts disagree: %s", err);
    bool last = w->rank == w->size - 1;
    int rc = comm_agree_text(w, last ? "a = 1\nb = 22222222222\nc = 3\n" : "a = 1\nb = 2\n", err);
    char want[128];
    snprintf(want, sizeof want, "rank %d has 'b = 22222222222' where rank 0 has 'b = 2'", w->size - 1);
    CHECK(rc != 0 && strstr(err, want), "a different text on rank %d: rc %d, message '%s'", w->size - 1, rc, err);
}

// ---------------------------------------------------------------- comm_self

static void check_self_copies(Comm *c, CommType t) {
    size_t n = 7;
    void *a = poisoned(t, 2 * n), *b = poisoned(t, n + 1);
    double want[7];
    for (size_t i = 0; i < n; i++) put(t, a, i, want[i] = val(0, 0, i));
    c->ops->all_reduce_sum(c, a, n, t);
    expect("comm_self all_reduce_sum", t, a, want, n);
    if (t == COMM_F32) {
        c->ops->all_reduce_max(c, a, n);
        expect("comm_self all_reduce_max", t, a, want, n);
    }
    c->ops->reduce_scatter_sum(c, a, b, n, t);
    expect("comm_self reduce_scatter_sum", t, b, want, n);
    c->ops->reduce_scatter_sum(c, a, a, n, t);
    expect("comm_self reduce_scatter_sum in place", t, a, want, n);
    for (size_t i = 0; i < n; i++) put(t, b, i, POISON);
    c->ops->reduce_sum(c, a, b, n, t, 0);
    expect("comm_self reduce_sum", t, b, want, n);
    for (size_t i = 0; i < n; i++) put(t, b, i, POISON);
    c->ops->all_gather(c, a, b, n, t);
    expect("comm_self all_gather", t, b, want, n);
    expect_poison("comm_self all_gather", t, b, n);
    size_t count = n;
    c->ops->all_to_all_v(c, a, &count, (char *)a + n * type_bytes(t), &count, t);
    expect("comm_self all_to_all_v", t, (char *)a + n * type_bytes(t), want, n);
    free(b);
    free(a);
}

static void test_comm_self(Comm *w) {
    Comm *c = comm_self(sizeof(real));
    CHECK(c->rank == 0 && c->size == 1, "comm_self: rank %d of %d", c->rank, c->size);
    for (size_t k = 0; k < sizeof TYPES / sizeof *TYPES; k++) check_self_copies(c, TYPES[k]);
    c->ops->barrier(c);
    CHECK(c->ops->all_ok(c, true) && !c->ops->all_ok(c, false), "comm_self all_ok");
    Comm *sub = c->ops->split(c, 3, 7);
    CHECK(sub != c && sub->rank == 0 && sub->size == 1, "comm_self split");
    sub->ops->free(sub);
    c->ops->free(c);
    // elem_size 8 (the double build's act and f32) copies whole doubles.
    Comm *d = comm_self(sizeof(double));
    double x[3] = {1.5, -2.25, 1e300}, y[3] = {0};
    d->ops->all_gather(d, x, y, 3, COMM_F32);
    CHECK(!memcmp(x, y, sizeof x), "comm_self with 8-byte elements");
    d->ops->free(d);
}

// ---------------------------------------------------------------- runner

static const TestCase TESTS[] = {
    {"all_reduce_sum", test_all_reduce_sum, NULL, 1},
    {"reduce_scatter_sum", test_reduce_scatter, NULL, 1},
    {"reduce_scatter_sum in place", test_reduce_scatter_in_place, NULL, 1},
    {"reduce_sum to each root", test_reduce_sum, NULL, 1},
    {"reduce-scatter of parts of a buffer", test_reduce_scatter_part, NULL, 1},
    {"all_gather", test_all_gather, NULL, 1},
    {"all_gather in place", test_all_gather_in_place, NULL, 1},
    {"all-gather of parts of a buffer", test_all_gather_part, NULL, 1},
    {"all_to_all_v uneven counts, zero blocks", test_all_to_all_v, NULL, 1},
    {"send/recv ring", test_send_recv_ring, NULL, 2},
    {"sendrecv pairs and ring", test_sendrecv, NULL, 1},
    {"all_reduce_sum of u64 past 2^32", NULL, test_all_reduce_u64, 1},
    {"all_reduce_max of f32", NULL, test_all_reduce_max, 1},
    {"all-gather of parts of a buffer of bytes", NULL, test_all_gather_part_bytes, 1},
    {"all_ok with one rank false", NULL, test_all_ok, 1},
    {"texts compared across ranks", NULL, test_agree_text, 2},
    {"split by even/odd rank", NULL, test_split_parity, 1},
    {"split ordered by key", NULL, test_split_key_order, 1},
    {"comm_self", NULL, test_comm_self, 1},
    {"peer memory written by every rank, fenced", NULL, test_peer_memory, 1},
};

// Runs one test on every rank; returns 1 if it failed on any rank, 0 if it passed, -1 if skipped.
static int run_test(Comm *w, const TestCase *tc) {
    if (w->size < tc->min_ranks) {
        if (w->rank == 0) printf("  %-46s skipped (needs %d ranks)\n", tc->name, tc->min_ranks);
        return -1;
    }
    failures = 0;
    if (tc->typed)
        for (size_t k = 0; k < sizeof TYPES / sizeof *TYPES; k++) tc->typed(w, TYPES[k]);
    else tc->plain(w);
    fflush(stderr);
    int total = 0; // summed with MPI itself, not the layer under test
    MPI_Allreduce(&failures, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (w->rank == 0) printf("  %-46s %s\n", tc->name, total ? "FAIL" : "ok");
    fflush(stdout);
    return total != 0;
}

// Rank `bad` fails after the others have blocked (rank 0 in a receive from it, the rest in a
// barrier); the fatal hook must end them all.
static void run_fatal(Comm *w, int bad) {
    MOE_CHECK(bad >= 1 && bad < w->size, "--fatal-on-rank %d: wanted 1 to %d", bad, w->size - 1);
    if (w->rank == bad) {
        nanosleep(&(struct timespec){.tv_nsec = 300000000}, NULL);
        moe_fatal("boom");
    }
    int32_t x;
    if (w->rank == 0) w->ops->recv(w, &x, 1, COMM_I32, bad);
    else w->ops->barrier(w);
}

int main(int argc, char **argv) {
    Comm *w = comm_world_init(&argc, &argv, sizeof(real));
    my_rank = w->rank;
    if (argc == 3 && !strcmp(argv[1], "--fatal-on-rank")) {
        run_fatal(w, atoi(argv[2]));
        return 1; // not reached when the abort works: the shell test then sees a hang
    }
    MOE_CHECK(argc == 1, "usage: test_comm [--fatal-on-rank R]");
    int passed = 0, failed = 0;
    for (size_t i = 0; i < sizeof TESTS / sizeof *TESTS; i++) {
        int r = run_test(w, &TESTS[i]);
        passed += r == 0;
        failed += r == 1;
    }
    if (w->rank == 0) printf("%d passed, %d failed\n", passed, failed);
    comm_world_finalize(w);
    return failed != 0;
}
