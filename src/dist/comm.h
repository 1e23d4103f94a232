// The communication interface of the distributed layer: collectives and point-to-point transfers
// on backend memory, over a group of ranks. Implementations: MPI (CPU ranks; comm_mpi.c), a single
// process without MPI (comm_self.c), and NCCL (GPU buffers on the backend's stream; comm_nccl.c).
// Counts are element counts, never bytes. Errors end every rank with a message (no hang).
#pragma once
#include <stdbool.h>
#include <stddef.h>

#include "common/util.h"

// Element kinds, as in ops.h: act and f32 buffers of the backend, int32, uint64 and bytes (FP8 codes).
typedef enum { COMM_ACT, COMM_F32, COMM_I32, COMM_U64, COMM_U8, COMM_TYPES } CommType;

typedef struct Comm Comm;

// Memory of one rank that every rank of a communicator can write directly (CUDA IPC between GPUs
// of one node, an MPI shared-memory window between CPU processes of one node).
typedef struct {
    void *base;   // this rank's bytes, in its backend's memory
    void **peers; // (size) host array: rank j's base as this process addresses it (peers[rank] = base)
    size_t bytes;
    void *impl;
} PeerMem;

typedef struct {
    void (*all_reduce_sum)(Comm *c, void *buf, size_t n, CommType t);
    // buf (n) f32 on every rank = the largest over ranks, element by element (in place)
    void (*all_reduce_max)(Comm *c, void *buf, size_t n);
    // recv (n) = this rank's n-element block of the sum over ranks of send (size x n); in place
    // when recv == send + rank * n
    void (*reduce_scatter_sum)(Comm *c, const void *send, void *recv, size_t n, CommType t);
    // recv (n) on rank `root` = the sum over ranks of send (n); recv is not touched elsewhere
    void (*reduce_sum)(Comm *c, const void *send, void *recv, size_t n, CommType t, int root);
    // buf (n) on every rank = buf on rank `root` (in place)
    void (*broadcast)(Comm *c, void *buf, size_t n, CommType t, int root);
    // recv (size x n) = every rank's send (n) in rank order; in place when send == recv + rank * n
    void (*all_gather)(Comm *c, const void *send, void *recv, size_t n, CommType t);
    // send holds size blocks (block j: send_counts[j] elements for rank j, back to back); recv gets
    // block i (recv_counts[i] elements) from rank i, back to back. Counts live in host memory.
    void (*all_to_all_v)(Comm *c, const void *send, const size_t *send_counts, void *recv,
                         const size_t *recv_counts, CommType t);
    void (*send)(Comm *c, const void *buf, size_t n, CommType t, int peer);
    void (*recv)(Comm *c, void *buf, size_t n, CommType t, int peer);
    // Sends to `to` and receives from `from` at once (deadlock-free pairwise exchange).
    void (*sendrecv)(Comm *c, const void *send, size_t n_send, int to, void *recv, size_t n_recv,
                     int from, CommType t);
    void (*barrier)(Comm *c);
    // Calls between these two may run at once (NCCL groups); NULL where calls run one by one.
    void (*group_begin)(void);
    void (*group_end)(void);
    // Logical AND of `ok` over the ranks (host value): lets ranks agree that a step succeeded.
    bool (*all_ok)(Comm *c, bool ok);
    // Sub-communicator of the ranks with the same color, ordered by key.
    Comm *(*split)(Comm *c, int color, int key);
    // Collective: `bytes` of this rank's memory that every rank can write, with every rank's base
    // (peer_free releases it, collectively). Returns -1 on every rank, allocating nothing, when
    // the ranks cannot reach each other's memory (other nodes, no peer access). Optional.
    int (*peer_alloc)(Comm *c, size_t bytes, PeerMem *pm);
    void (*peer_free)(Comm *c, PeerMem *pm);
    // Collective, in stream order and without a host wait on GPUs: no rank passes it before every
    // rank reaches it, and writes into peer memory made before it are visible to all after it.
    // Present with peer_alloc.
    void (*fence)(Comm *c);
    // An error the transport found on its own (NCCL: a failed network peer), as text, or NULL.
    // Optional (NULL: none can happen); safe to call from another thread (the watchdog).
    const char *(*async_error)(Comm *c);
    void (*free)(Comm *c);
} CommOps;

struct Comm {
    const CommOps *ops;
    int rank, size;
    size_t elem_bytes[COMM_TYPES]; // bytes of one element of each CommType
    void *impl;
};

// Element i of a buffer of type t.
static inline void *comm_at(const Comm *c, const void *buf, size_t i, CommType t) {
    return (char *)buf + i * c->elem_bytes[t];
}

// Part of a reduce-scatter: of the elements [a, b) of send (size x n), rank r receives the sum of
// those inside its block [r n, (r + 1) n), at recv + (their start - r n); the rest of recv is not
// touched. [0, size n) is the whole reduce_scatter_sum. Lets a reduction start on the part of a
// buffer that is final while the rest is still being written.
void comm_reduce_scatter_part(Comm *c, const void *send, void *recv, size_t n, size_t a, size_t b,
                              CommType t);

// Part of an in-place all-gather, into a window that holds elements [a, b) of the gathered buffer
// (size x n; window[i] is element a + i): those inside rank r's block [r n, (r + 1) n) come from rank
// r (this rank's own must be there already); nothing else is touched. [0, size n) is the whole
// all_gather (rank r's block its send). Lets a gather deliver what is final first, into the buffer
// itself (window = its element a) or into one of the part's size (the staged experts' compute
// weights).
void comm_all_gather_window(Comm *c, void *window, size_t n, size_t a, size_t b, CommType t);

// Collective on host memory: whether every rank holds the same `text` (lines such as "key = value").
// The ranks compare 64-bit digests; when one differs, every rank receives every text and returns
// -1 with a message naming the first rank that differs from rank 0 and its first differing line.
int comm_agree_text(Comm *c, const char *text, MoeErr err);

// Starts the world communicator: MPI when the build has it (mpirun, srun or a plain start), else a
// single process. Installs a fatal-error hook that aborts every rank. elem_size: bytes of a
// backend act/f32 element (the CPU backend: sizeof(real)).
Comm *comm_world_init(int *argc, char ***argv, size_t elem_size);
void comm_world_finalize(Comm *world);
// True when this build can run several ranks.
bool comm_has_mpi(void);
// A communicator of one rank (no MPI): every collective is a copy or nothing.
Comm *comm_self(size_t elem_size);
