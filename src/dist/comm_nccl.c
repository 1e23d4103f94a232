// The communication interface over NCCL (CUDA builds): collectives and transfers on GPU buffers,
// queued on the compute backend's current stream (asked at each call: the backend switches between
// its main and side streams). The world is bootstrapped from a host communicator (MPI:
// rank 0's unique id reaches the others through it) or from the environment `moe train --nproc`
// gives the processes it starts. NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
#include "comm_nccl.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "comm_cuda.h"
#include "common/gpu_check.h"
#include "common/util.h"

typedef struct {
    ncclComm_t nccl;
    CommStreamFn stream; // the compute backend's current stream
    int *flag;  // one device int for all_ok
    int *fence; // one device int for the fence by all-reduce
    // The fence through peer memory, set up with the first peer memory (NULL table until then):
    PeerMem fence_mem;      // (size) flag words of this rank that every rank writes
    unsigned **fence_table; // device (size): every rank's flag words
    unsigned *epoch;        // device: fences passed
} NcclImpl;

static ncclComm_t nc(Comm *c) { return ((NcclImpl *)c->impl)->nccl; }
static cudaStream_t stream(Comm *c) { return (cudaStream_t)((NcclImpl *)c->impl)->stream(); }

static size_t n_queued; // NCCL operations this process has queued (comm_nccl_queued)

// The stream of one NCCL operation, counted.
static cudaStream_t op_stream(Comm *c) {
    n_queued++;
    return stream(c);
}

size_t comm_nccl_queued(void) { return n_queued; }

// bf16 act, fp32, int32, uint64 and byte elements
static ncclDataType_t dtype(CommType t) {
    return t == COMM_ACT ? ncclBfloat16 : t == COMM_F32 ? ncclFloat32 : t == COMM_I32 ? ncclInt32
         : t == COMM_U64 ? ncclUint64 : ncclUint8;
}


static void nccl_all_reduce_sum(Comm *c, void *buf, size_t n, CommType t) {
    if (n) NCCL_CHECK(ncclAllReduce(buf, buf, n, dtype(t), ncclSum, nc(c), op_stream(c)));
}

static void nccl_all_reduce_max(Comm *c, void *buf, size_t n) {
    if (n) NCCL_CHECK(ncclAllReduce(buf, buf, n, ncclFloat32, ncclMax, nc(c), op_stream(c)));
}

static void nccl_reduce_scatter_sum(Comm *c, const void *send, void *recv, size_t n, CommType t) {
    if (n) NCCL_CHECK(ncclReduceScatter(send, recv, n, dtype(t), ncclSum, nc(c), op_stream(c)));
}

static void nccl_reduce_sum(Comm *c, const void *send, void *recv, size_t n, CommType t, int root) {
    if (n) NCCL_CHECK(ncclReduce(send, recv, n, dtype(t), ncclSum, root, nc(c), op_stream(c)));
}

static void nccl_broadcast(Comm *c, void *buf, size_t n, CommType t, int root) {
    if (n) NCCL_CHECK(ncclBroadcast(buf, buf, n, dtype(t), root, nc(c), op_stream(c)));
}

static void nccl_group_begin(void) { NCCL_CHECK(ncclGroupStart()); }
static void nccl_group_end(void) { NCCL_CHECK(ncclGroupEnd()); }

static void nccl_all_gather(Comm *c, const void *send, void *recv, size_t n, CommType t) {
    if (n) NCCL_CHECK(ncclAllGather(send, recv, n, dtype(t), nc(c), op_stream(c)));
}

// Per-peer sends and receives in one group: NCCL's all-to-all with uneven counts.
static void nccl_all_to_all_v(Comm *c, const void *send, const size_t *send_counts, void *recv,
                              const size_t *recv_counts, CommType t) {
    size_t es = c->elem_bytes[t], so = 0, ro = 0;
    NCCL_CHECK(ncclGroupStart());
    for (int j = 0; j < c->size; j++) {
        if (send_counts[j])
            NCCL_CHECK(ncclSend((const char *)send + so * es, send_counts[j], dtype(t), j, nc(c), op_stream(c)));
        if (recv_counts[j])
            NCCL_CHECK(ncclRecv((char *)recv + ro * es, recv_counts[j], dtype(t), j, nc(c), op_stream(c)));
        so += send_counts[j], ro += recv_counts[j];
    }
    NCCL_CHECK(ncclGroupEnd());
}

static void nccl_send(Comm *c, const void *buf, size_t n, CommType t, int peer) {
    if (n) NCCL_CHECK(ncclSend(buf, n, dtype(t), peer, nc(c), op_stream(c)));
}

static void nccl_recv(Comm *c, void *buf, size_t n, CommType t, int peer) {
    if (n) NCCL_CHECK(ncclRecv(buf, n, dtype(t), peer, nc(c), op_stream(c)));
}

static void nccl_sendrecv(Comm *c, const void *send, size_t n_send, int to, void *recv, size_t n_recv,
                          int from, CommType t) {
    NCCL_CHECK(ncclGroupStart());
    nccl_send(c, send, n_send, t, to);
    nccl_recv(c, recv, n_recv, t, from);
    NCCL_CHECK(ncclGroupEnd());
}

// Host-side agreement through one device int (min over ranks); waits for the stream.
static bool nccl_all_ok(Comm *c, bool ok) {
    NcclImpl *im = c->impl;
    int v = ok ? 1 : 0;
    CUDA_CHECK(cudaMemcpyAsync(im->flag, &v, sizeof v, cudaMemcpyHostToDevice, stream(c)));
    NCCL_CHECK(ncclAllReduce(im->flag, im->flag, 1, ncclInt32, ncclMin, im->nccl, op_stream(c)));
    CUDA_CHECK(cudaMemcpyAsync(&v, im->flag, sizeof v, cudaMemcpyDeviceToHost, stream(c)));
    CUDA_CHECK(cudaStreamSynchronize(stream(c)));
    return v == 1;
}

static void nccl_barrier(Comm *c) { nccl_all_ok(c, true); }

// A stream-ordered fence: flag words in peer memory once the ranks share some (a one-warp kernel,
// comm_cuda_fence), else a one-int all-reduce. Neither finishes on any rank before every rank's
// stream reaches it; the peer writes before it are fenced (__threadfence_system) by the kernels
// that made them.
static void nccl_fence(Comm *c) {
    NcclImpl *im = c->impl;
    if (im->fence_table) comm_cuda_fence(stream(c), im->fence_table, c->rank, c->size, im->epoch);
    else NCCL_CHECK(ncclAllReduce(im->fence, im->fence, 1, ncclInt32, ncclMax, im->nccl, op_stream(c)));
}

// What a rank publishes for peer memory: its IPC handle and a hash of its host name (IPC handles
// open only on the node that made them).
typedef struct {
    cudaIpcMemHandle_t handle;
    uint32_t host[2];
} PeerCard;

static void host_hash(uint32_t out[2]) {
    char name[256] = "";
    gethostname(name, sizeof name - 1);
    uint64_t h = 1469598103934665603ull; // FNV-1a
    for (const char *p = name; *p; p++) h = (h ^ (unsigned char)*p) * 1099511628211ull;
    out[0] = (uint32_t)h, out[1] = (uint32_t)(h >> 32);
}

// Every rank's card, gathered through the device (NCCL moves device memory only).
static PeerCard *gather_cards(Comm *c, const PeerCard *mine) {
    size_t words = sizeof(PeerCard) / 4, n = (size_t)c->size;
    PeerCard *all = moe_calloc(n, sizeof(PeerCard));
    int32_t *dev;
    CUDA_CHECK(cudaMalloc((void **)&dev, n * sizeof(PeerCard)));
    CUDA_CHECK(cudaMemcpy(dev + (size_t)c->rank * words, mine, sizeof *mine, cudaMemcpyHostToDevice));
    nccl_all_gather(c, dev + (size_t)c->rank * words, dev, words, COMM_I32);
    CUDA_CHECK(cudaMemcpyAsync(all, dev, n * sizeof(PeerCard), cudaMemcpyDeviceToHost, stream(c)));
    CUDA_CHECK(cudaStreamSynchronize(stream(c)));
    CUDA_CHECK(cudaFree(dev));
    return all;
}

static void close_peers(Comm *c, PeerMem *pm) {
    for (int j = 0; j < c->size; j++)
        if (j != c->rank && pm->peers[j]) CUDA_CHECK(cudaIpcCloseMemHandle(pm->peers[j]));
}

// CUDA IPC: each rank's buffer opened in every other rank of the same node (zeroed).
static int open_peer_mem(Comm *c, size_t bytes, PeerMem *pm) {
    PeerCard mine;
    memset(&mine, 0, sizeof mine);
    host_hash(mine.host);
    *pm = (PeerMem){.peers = moe_calloc((size_t)c->size, sizeof(void *)), .bytes = bytes};
    CUDA_CHECK(cudaMalloc(&pm->base, bytes ? bytes : 1));
    CUDA_CHECK(cudaMemset(pm->base, 0, bytes));
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaIpcGetMemHandle(&mine.handle, pm->base));
    PeerCard *all = gather_cards(c, &mine);
    bool ok = true;
    for (int j = 0; j < c->size && ok; j++) {
        if (j == c->rank) { pm->peers[j] = pm->base; continue; }
        ok = !memcmp(all[j].host, mine.host, sizeof mine.host) &&
             cudaIpcOpenMemHandle(&pm->peers[j], all[j].handle, cudaIpcMemLazyEnablePeerAccess) == cudaSuccess;
        if (!ok) pm->peers[j] = NULL, (void)cudaGetLastError();
    }
    free(all);
    if (nccl_all_ok(c, ok)) return 0;
    close_peers(c, pm);
    CUDA_CHECK(cudaFree(pm->base));
    free(pm->peers);
    memset(pm, 0, sizeof *pm);
    return -1;
}

static void nccl_peer_free(Comm *c, PeerMem *pm) {
    close_peers(c, pm);
    nccl_barrier(c); // no peer still maps this rank's buffer
    CUDA_CHECK(cudaFree(pm->base));
    free(pm->peers);
    memset(pm, 0, sizeof *pm);
}

// The first peer memory brings the fence's flag words with it.
static int nccl_peer_alloc(Comm *c, size_t bytes, PeerMem *pm) {
    NcclImpl *im = c->impl;
    if (open_peer_mem(c, bytes, pm)) return -1;
    if (im->fence_table || open_peer_mem(c, (size_t)c->size * sizeof(unsigned), &im->fence_mem)) return 0;
    CUDA_CHECK(cudaMalloc((void **)&im->epoch, sizeof(unsigned)));
    CUDA_CHECK(cudaMemset(im->epoch, 0, sizeof(unsigned)));
    CUDA_CHECK(cudaMalloc((void **)&im->fence_table, (size_t)c->size * sizeof(void *)));
    CUDA_CHECK(cudaMemcpy(im->fence_table, im->fence_mem.peers, (size_t)c->size * sizeof(void *),
                          cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaDeviceSynchronize()); // the fence's stream does not wait for the legacy one
    return 0;
}

static Comm *wrap(ncclComm_t comm, CommStreamFn stream);

static Comm *nccl_split(Comm *c, int color, int key) {
    ncclComm_t sub;
    NCCL_CHECK(ncclCommSplit(nc(c), color, key, &sub, NULL));
    return wrap(sub, ((NcclImpl *)c->impl)->stream);
}

static const char *nccl_async_error(Comm *c) {
    ncclResult_t r = ncclSuccess;
    if (ncclCommGetAsyncError(nc(c), &r) != ncclSuccess) return "ncclCommGetAsyncError failed";
    return r == ncclSuccess || r == ncclInProgress ? NULL : ncclGetErrorString(r);
}

static void nccl_free(Comm *c) {
    NcclImpl *im = c->impl;
    if (im->fence_table) {
        nccl_peer_free(c, &im->fence_mem);
        CUDA_CHECK(cudaFree(im->fence_table));
        CUDA_CHECK(cudaFree(im->epoch));
    }
    NCCL_CHECK(ncclCommDestroy(im->nccl));
    CUDA_CHECK(cudaFree(im->flag));
    CUDA_CHECK(cudaFree(im->fence));
    free(im);
    free(c);
}

static const CommOps NCCL_OPS = {
    .all_reduce_sum = nccl_all_reduce_sum, .all_reduce_max = nccl_all_reduce_max,
    .reduce_scatter_sum = nccl_reduce_scatter_sum,
    .reduce_sum = nccl_reduce_sum, .broadcast = nccl_broadcast, .group_begin = nccl_group_begin, .group_end = nccl_group_end,
    .all_gather = nccl_all_gather, .all_to_all_v = nccl_all_to_all_v, .send = nccl_send,
    .recv = nccl_recv, .sendrecv = nccl_sendrecv, .barrier = nccl_barrier, .all_ok = nccl_all_ok,
    .split = nccl_split, .peer_alloc = nccl_peer_alloc, .peer_free = nccl_peer_free,
    .fence = nccl_fence, .async_error = nccl_async_error, .free = nccl_free,
};

static Comm *wrap(ncclComm_t comm, CommStreamFn stream) {
    Comm *c = moe_calloc(1, sizeof(Comm));
    NcclImpl *im = moe_calloc(1, sizeof(NcclImpl));
    im->nccl = comm, im->stream = stream;
    CUDA_CHECK(cudaMalloc((void **)&im->flag, sizeof(int)));
    CUDA_CHECK(cudaMalloc((void **)&im->fence, sizeof(int)));
    CUDA_CHECK(cudaMemset(im->fence, 0, sizeof(int)));
    CUDA_CHECK(cudaDeviceSynchronize()); // the backend's stream does not wait for the legacy one
    NCCL_CHECK(ncclCommUserRank(comm, &c->rank));
    NCCL_CHECK(ncclCommCount(comm, &c->size));
    c->ops = &NCCL_OPS;
    c->elem_bytes[COMM_ACT] = 2, c->elem_bytes[COMM_F32] = 4, c->elem_bytes[COMM_I32] = 4, c->elem_bytes[COMM_U64] = 8;
    c->elem_bytes[COMM_U8] = 1;
    c->impl = im;
    return c;
}

static void id_to_hex(const ncclUniqueId *id, char *hex) {
    const unsigned char *b = (const unsigned char *)id->internal;
    for (size_t i = 0; i < sizeof id->internal; i++) sprintf(hex + 2 * i, "%02x", b[i]);
}

static int hex_to_id(const char *hex, ncclUniqueId *id) {
    unsigned char *b = (unsigned char *)id->internal;
    if (strlen(hex) != 2 * sizeof id->internal) return -1;
    for (size_t i = 0; i < sizeof id->internal; i++)
        if (sscanf(hex + 2 * i, "%2hhx", &b[i]) != 1) return -1;
    return 0;
}

size_t comm_nccl_id_hex_len(void) { return 2 * sizeof(((ncclUniqueId *)0)->internal) + 1; }

// Before any NCCL call: never NVLink multicast.
static void nccl_environment(void) { setenv("NCCL_NVLS_ENABLE", "0", 1); }

void comm_nccl_new_id(char *hex) {
    nccl_environment();
    ncclUniqueId id;
    NCCL_CHECK(ncclGetUniqueId(&id));
    id_to_hex(&id, hex);
}

Comm *comm_nccl_world(Comm *host, CommStreamFn stream) {
    nccl_environment();
    ncclUniqueId id;
    int size = 0, rank = comm_launch_rank(&size);
    if (rank >= 0) { // started by `moe train --nproc`: the id came with the environment
        const char *hex = getenv("MOE_NCCL_ID");
        MOE_CHECK(hex && hex_to_id(hex, &id) == 0, "MOE_NCCL_ID is missing or malformed (start ranks with moe train --nproc N)");
    } else { // through the host communicator: rank 0's id summed with everyone else's zeros
        rank = host->rank, size = host->size;
        int32_t words[sizeof id.internal / 4] = {0};
        if (rank == 0) {
            NCCL_CHECK(ncclGetUniqueId(&id));
            memcpy(words, id.internal, sizeof words);
        }
        host->ops->all_reduce_sum(host, words, sizeof words / 4, COMM_I32);
        memcpy(id.internal, words, sizeof words);
    }
    ncclComm_t comm;
    NCCL_CHECK(ncclCommInitRank(&comm, size, id, rank));
    return wrap(comm, stream);
}
