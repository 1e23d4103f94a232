// The MPI implementation of comm.h: one CPU process per rank, started by mpirun, srun or plainly
// (one rank). Every MPI call is checked, and an MPI error or a moe_fatal on any rank ends all ranks
// at once, so that no rank waits forever in a collective its failed peer will never join.
#include "dist/comm.h"

#include <limits.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

// One tag for every point-to-point message: MPI delivers messages of one tag between two ranks in
// the order they were sent, which is all the pieces of a long transfer need.
#define COMM_MPI_TAG 7

static void comm_mpi_fail(const char *file, int line, const char *call, int rc)
    __attribute__((noreturn));

// Runs an MPI call; on failure prints where, the call and MPI's own words, then aborts every rank.
#define MPI_CHECK(call)                                                                          \
    do {                                                                                         \
        int rc_ = (call);                                                                        \
        if (rc_ != MPI_SUCCESS) comm_mpi_fail(__FILE__, __LINE__, #call, rc_);                   \
    } while (0)

typedef struct {
    MPI_Comm comm;
    size_t elem_size; // bytes of an act/f32 element: 4 (float) or 8 (double)
    size_t chunk;     // most elements in one MPI call (MPI counts are int)
} MpiComm;

static const CommOps comm_mpi_ops;

static void comm_mpi_fail(const char *file, int line, const char *call, int rc) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) snprintf(msg, sizeof msg, "code %d", rc);
    moe_fatal("%s:%d: %s failed: %s", file, line, call, msg);
}

// moe_fatal's hook: the other ranks may be blocked in a collective with this one; only an abort
// frees them.
static void comm_mpi_abort(void) { MPI_Abort(MPI_COMM_WORLD, 1); }

static MPI_Datatype comm_mpi_type(const MpiComm *m, CommType t) {
    if (t == COMM_I32) return MPI_INT32_T;
    if (t == COMM_U64) return MPI_UINT64_T;
    if (t == COMM_U8) return MPI_UINT8_T;
    MOE_ASSERT(t == COMM_ACT || t == COMM_F32);
    return m->elem_size == sizeof(double) ? MPI_DOUBLE : MPI_FLOAT;
}

static size_t comm_mpi_bytes(MPI_Datatype dt) {
    int bytes = 0;
    MPI_CHECK(MPI_Type_size(dt, &bytes));
    return (size_t)bytes;
}

static char *comm_mpi_at(const void *buf, size_t i, MPI_Datatype dt) {
    return (char *)buf + i * comm_mpi_bytes(dt);
}

// Elements of the piece of an n-element transfer that starts at element o (MPI counts are int).
static int comm_mpi_piece(const MpiComm *m, size_t n, size_t o) {
    return (int)(n - o < m->chunk ? n - o : m->chunk);
}

// A count for an MPI call that cannot be split into pieces.
static int comm_mpi_count(size_t n, const char *what) {
    MOE_CHECK(n <= INT_MAX, "%s of %zu elements is more than MPI's limit of %d per call: use more "
              "ranks or smaller buffers", what, n, INT_MAX);
    return (int)n;
}

static bool comm_mpi_overlap(const void *a, size_t a_bytes, const void *b, size_t b_bytes) {
    uintptr_t pa = (uintptr_t)a, pb = (uintptr_t)b;
    return a_bytes && b_bytes && pa < pb + b_bytes && pb < pa + a_bytes;
}

// MPI's int counts and displacements of `size` blocks of `counts` elements laid back to back;
// returns the total.
static size_t comm_mpi_layout(const size_t *counts, int size, int *mpi_counts, int *displs) {
    size_t total = 0;
    for (int i = 0; i < size; i++) {
        mpi_counts[i] = comm_mpi_count(counts[i], "all_to_all_v block");
        displs[i] = comm_mpi_count(total, "all_to_all_v offset");
        total += counts[i];
    }
    return total;
}

static Comm *comm_mpi_wrap(MPI_Comm comm, size_t elem_size, size_t chunk) {
    MPI_CHECK(MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN));
    MpiComm *m = moe_malloc(sizeof *m);
    *m = (MpiComm){.comm = comm, .elem_size = elem_size, .chunk = chunk};
    Comm *c = moe_malloc(sizeof *c);
    *c = (Comm){.ops = &comm_mpi_ops, .elem_bytes = {elem_size, elem_size, sizeof(int32_t), sizeof(uint64_t), 1},
               .impl = m};
    MPI_CHECK(MPI_Comm_rank(comm, &c->rank));
    MPI_CHECK(MPI_Comm_size(comm, &c->size));
    return c;
}

static void comm_mpi_all_reduce(Comm *c, void *buf, size_t n, CommType t, MPI_Op op) {
    MpiComm *m = c->impl;
    MPI_Datatype dt = comm_mpi_type(m, t);
    for (size_t o = 0; o < n; o += m->chunk) {
        int k = comm_mpi_piece(m, n, o);
        MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, comm_mpi_at(buf, o, dt), k, dt, op, m->comm));
    }
}

static void comm_mpi_all_reduce_sum(Comm *c, void *buf, size_t n, CommType t) {
    comm_mpi_all_reduce(c, buf, n, t, MPI_SUM);
}
static void comm_mpi_all_reduce_max(Comm *c, void *buf, size_t n) { comm_mpi_all_reduce(c, buf, n, COMM_F32, MPI_MAX); }

static void comm_mpi_reduce_scatter_sum(Comm *c, const void *send, void *recv, size_t n,
                                        CommType t) {
    MpiComm *m = c->impl;
    MPI_Datatype dt = comm_mpi_type(m, t);
    size_t bytes = n * comm_mpi_bytes(dt);
    int count = comm_mpi_count(n, "reduce_scatter_sum");
    bool in_place = recv == comm_mpi_at(send, (size_t)c->rank * n, dt);
    MOE_ASSERT(in_place || !comm_mpi_overlap(send, bytes * (size_t)c->size, recv, bytes));
    // MPI forbids aliased buffers, and its MPI_IN_PLACE form would leave the result in block 0,
    // overwriting another block of the caller's buffer: reduce into a scratch block instead.
    void *out = in_place ? moe_malloc(bytes) : recv;
    MPI_CHECK(MPI_Reduce_scatter_block(send, out, count, dt, MPI_SUM, m->comm));
    if (in_place) {
        memcpy(recv, out, bytes);
        free(out);
    }
}

static void comm_mpi_reduce_sum(Comm *c, const void *send, void *recv, size_t n, CommType t, int root) {
    MpiComm *m = c->impl;
    MPI_Datatype dt = comm_mpi_type(m, t);
    MOE_ASSERT(c->rank != root || !comm_mpi_overlap(send, n * comm_mpi_bytes(dt), recv, n * comm_mpi_bytes(dt)));
    for (size_t o = 0; o < n; o += m->chunk)
        MPI_CHECK(MPI_Reduce(comm_mpi_at(send, o, dt), comm_mpi_at(recv, o, dt), comm_mpi_piece(m, n, o), dt,
                             MPI_SUM, root, m->comm));
}

static void comm_mpi_broadcast(Comm *c, void *buf, size_t n, CommType t, int root) {
    MpiComm *m = c->impl;
    MPI_Datatype dt = comm_mpi_type(m, t);
    for (size_t o = 0; o < n; o += m->chunk)
        MPI_CHECK(MPI_Bcast(comm_mpi_at(buf, o, dt), comm_mpi_piece(m, n, o), dt, root, m->comm));
}

static void comm_mpi_all_gather(Comm *c, const void *send, void *recv, size_t n, CommType t) {
    MpiComm *m = c->impl;
    MPI_Datatype dt = comm_mpi_type(m, t);
    size_t bytes = n * comm_mpi_bytes(dt);
    int count = comm_mpi_count(n, "all_gather");
    if (send == comm_mpi_at(recv, (size_t)c->rank * n, dt)) {
        MPI_CHECK(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv, count, dt, m->comm));
        return;
    }
    MOE_ASSERT(!comm_mpi_overlap(send, bytes, recv, bytes * (size_t)c->size));
    MPI_CHECK(MPI_Allgather(send, count, dt, recv, count, dt, m->comm));
}

static void comm_mpi_all_to_all_v(Comm *c, const void *send, const size_t *send_counts,
                                  void *recv, const size_t *recv_counts, CommType t) {
    MpiComm *m = c->impl;
    MPI_Datatype dt = comm_mpi_type(m, t);
    int p = c->size;
    int *v = moe_malloc(4 * (size_t)p * sizeof *v); // send counts, send displs, recv counts, displs
    size_t n_send = comm_mpi_layout(send_counts, p, v, v + p);
    size_t n_recv = comm_mpi_layout(recv_counts, p, v + 2 * p, v + 3 * p);
    size_t bytes = comm_mpi_bytes(dt);
    MOE_ASSERT(!comm_mpi_overlap(send, n_send * bytes, recv, n_recv * bytes));
    MPI_CHECK(MPI_Alltoallv(send, v, v + p, dt, recv, v + 2 * p, v + 3 * p, dt, m->comm));
    free(v);
}

// Posts the pieces of one transfer into req (a piece per `chunk` elements, matched in order by
// the peer's pieces of the same size); returns how many.
static int comm_mpi_post(const MpiComm *m, bool is_send, const void *buf, size_t n,
                         MPI_Datatype dt, int peer, MPI_Request *req) {
    int pieces = 0;
    for (size_t o = 0; o < n; o += m->chunk, pieces++) {
        int k = comm_mpi_piece(m, n, o);
        if (is_send)
            MPI_CHECK(MPI_Isend(comm_mpi_at(buf, o, dt), k, dt, peer, COMM_MPI_TAG, m->comm,
                                &req[pieces]));
        else
            MPI_CHECK(MPI_Irecv(comm_mpi_at(buf, o, dt), k, dt, peer, COMM_MPI_TAG, m->comm,
                                &req[pieces]));
    }
    return pieces;
}

// Sends n_send elements to `to` while receiving n_recv from `from` (either count may be 0). Both
// directions are posted before waiting, so a pair or a ring of ranks cannot deadlock, and a
// message of another length than the receiver expects is reported instead of silently accepted.
static void comm_mpi_transfer(Comm *c, const void *send, size_t n_send, int to, void *recv,
                              size_t n_recv, int from, CommType t) {
    MpiComm *m = c->impl;
    MPI_Datatype dt = comm_mpi_type(m, t);
    MOE_ASSERT(!n_send || (to >= 0 && to < c->size));
    MOE_ASSERT(!n_recv || (from >= 0 && from < c->size));
    size_t max_req = size_ceil_div(n_send, m->chunk) + size_ceil_div(n_recv, m->chunk);
    MPI_Request *req = moe_malloc(max_req * sizeof *req);
    MPI_Status *st = moe_malloc(max_req * sizeof *st);
    int n_recv_req = comm_mpi_post(m, false, recv, n_recv, dt, from, req);
    int n_req = n_recv_req + comm_mpi_post(m, true, send, n_send, dt, to, req + n_recv_req);
    int rc = MPI_Waitall(n_req, req, st);
    for (int i = 0; rc == MPI_ERR_IN_STATUS && i < n_req; i++) { // the cause is in a status
        int e = st[i].MPI_ERROR;
        if (e != MPI_SUCCESS && e != MPI_ERR_PENDING) rc = e;
    }
    if (rc != MPI_SUCCESS) comm_mpi_fail(__FILE__, __LINE__, "MPI_Waitall(sends and receives)", rc);
    for (int i = 0; i < n_recv_req; i++) {
        int got = 0, want = comm_mpi_piece(m, n_recv, (size_t)i * m->chunk);
        MPI_CHECK(MPI_Get_count(&st[i], dt, &got));
        MOE_CHECK(got == want, "internal error: rank %d received %d elements from rank %d, "
                  "expected %d", c->rank, got, from, want);
    }
    free(st);
    free(req);
}

// A blocking send or receive with oneself would wait for a call that can never come.
static void comm_mpi_send(Comm *c, const void *buf, size_t n, CommType t, int peer) {
    MOE_ASSERT(peer != c->rank);
    comm_mpi_transfer(c, buf, n, peer, NULL, 0, -1, t);
}

static void comm_mpi_recv(Comm *c, void *buf, size_t n, CommType t, int peer) {
    MOE_ASSERT(peer != c->rank);
    comm_mpi_transfer(c, NULL, 0, -1, buf, n, peer, t);
}

static void comm_mpi_barrier(Comm *c) { MPI_CHECK(MPI_Barrier(((MpiComm *)c->impl)->comm)); }

static bool comm_mpi_all_ok(Comm *c, bool ok) {
    int v = ok;
    MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_INT, MPI_LAND, ((MpiComm *)c->impl)->comm));
    return v != 0;
}

// A shared-memory window over the communicator when all its ranks are on this node.
static int comm_mpi_peer_alloc(Comm *c, size_t bytes, PeerMem *pm) {
    MpiComm *m = c->impl;
    MPI_Comm node;
    int node_size = 0;
    MPI_CHECK(MPI_Comm_split_type(m->comm, MPI_COMM_TYPE_SHARED, c->rank, MPI_INFO_NULL, &node));
    MPI_CHECK(MPI_Comm_size(node, &node_size));
    MPI_CHECK(MPI_Comm_free(&node));
    if (!comm_mpi_all_ok(c, node_size == c->size)) return -1;
    MPI_Win *win = moe_malloc(sizeof *win);
    *pm = (PeerMem){.peers = moe_calloc((size_t)c->size, sizeof(void *)), .bytes = bytes, .impl = win};
    // The ranks' parts of the window are contiguous: a size in whole cache lines keeps every
    // rank's base aligned for any element type (and ranks off each other's lines).
    size_t padded = (bytes + 63) / 64 * 64;
    MPI_CHECK(MPI_Win_allocate_shared((MPI_Aint)padded, 1, MPI_INFO_NULL, m->comm, &pm->base, win));
    for (int j = 0; j < c->size; j++) {
        MPI_Aint size;
        int disp;
        MPI_CHECK(MPI_Win_shared_query(*win, j, &size, &disp, &pm->peers[j]));
    }
    return 0;
}

static void comm_mpi_peer_free(Comm *c, PeerMem *pm) {
    MPI_CHECK(MPI_Win_free((MPI_Win *)pm->impl));
    free(pm->impl);
    free(pm->peers);
    memset(pm, 0, sizeof *pm);
}

// CPU ops finish before they return: a barrier between two full memory fences orders the stores
// each rank made into the shared window before it against every load after it.
static void comm_mpi_fence(Comm *c) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    comm_mpi_barrier(c);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

static Comm *comm_mpi_split(Comm *c, int color, int key) {
    MpiComm *m = c->impl;
    MOE_ASSERT(color >= 0); // MPI_UNDEFINED (negative) would give no communicator at all
    MPI_Comm sub;
    MPI_CHECK(MPI_Comm_split(m->comm, color, key, &sub));
    return comm_mpi_wrap(sub, m->elem_size, m->chunk);
}

static void comm_mpi_free(Comm *c) {
    MpiComm *m = c->impl;
    if (m->comm != MPI_COMM_WORLD) MPI_CHECK(MPI_Comm_free(&m->comm));
    free(m);
    free(c);
}

static const CommOps comm_mpi_ops = {
    .all_reduce_sum = comm_mpi_all_reduce_sum,
    .all_reduce_max = comm_mpi_all_reduce_max,
    .reduce_scatter_sum = comm_mpi_reduce_scatter_sum,
    .reduce_sum = comm_mpi_reduce_sum,
    .broadcast = comm_mpi_broadcast,
    .all_gather = comm_mpi_all_gather,
    .all_to_all_v = comm_mpi_all_to_all_v,
    .send = comm_mpi_send,
    .recv = comm_mpi_recv,
    .sendrecv = comm_mpi_transfer,
    .barrier = comm_mpi_barrier,
    .all_ok = comm_mpi_all_ok,
    .split = comm_mpi_split,
    .peer_alloc = comm_mpi_peer_alloc,
    .peer_free = comm_mpi_peer_free,
    .fence = comm_mpi_fence,
    .free = comm_mpi_free,
};

// Elements per MPI call: MPI counts are int. MOE_COMM_CHUNK lowers it so that the tests exercise
// transfers in several pieces without gigabyte buffers.
static size_t comm_mpi_chunk_limit(void) { return (size_t)moe_env_int("MOE_COMM_CHUNK", INT_MAX, 1, INT_MAX); }

// Started by a launcher (mpirun, srun, a PMI/PMIx job)? A plain `./moe` skips MPI altogether: a
// singleton MPI start forks a runtime daemon, slower and more fragile than one process needs.
static bool comm_mpi_launched(void) {
    const char *vars[] = {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE",
                          "MPI_LOCALNRANKS", "SLURM_STEP_ID"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++)
        if (getenv(vars[i])) return true;
    return false;
}

static bool comm_mpi_started; // MPI_Init ran (so MPI_Finalize must)

Comm *comm_world_init(int *argc, char ***argv, size_t elem_size) {
    MOE_ASSERT(elem_size == sizeof(float) || elem_size == sizeof(double));
    if (!comm_mpi_launched()) return comm_self(elem_size);
    comm_mpi_started = true;
    size_t chunk = comm_mpi_chunk_limit();
    // OpenMP threads run the kernels; only the main thread calls MPI.
    int provided = 0;
    MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided));
    MOE_CHECK(provided >= MPI_THREAD_FUNNELED,
              "this MPI library does not allow OpenMP threads beside MPI (MPI_THREAD_FUNNELED)");
    Comm *world = comm_mpi_wrap(MPI_COMM_WORLD, elem_size, chunk);
    // One rank needs no abort (a plain exit ends it) and no label.
    if (world->size > 1) {
        moe_set_rank_label(world->rank);
        moe_set_fatal_hook(comm_mpi_abort);
    }
    return world;
}

void comm_world_finalize(Comm *world) {
    if (!comm_mpi_started) {
        world->ops->free(world);
        return;
    }
    comm_mpi_free(world);
    moe_set_fatal_hook(NULL); // MPI_Abort is not allowed after MPI_Finalize
    MPI_CHECK(MPI_Finalize());
}

bool comm_has_mpi(void) { return true; }
