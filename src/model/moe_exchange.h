// The expert exchange (what Megatron's token dispatcher does between the local permutation and
// the experts): moves each MoE call's routed rows from this rank's dispatch order to the
// expert-major order of the expert-parallel ranks that own their experts, and the experts' results
// back; the backward moves gradients along the same routes. Two transports, by parallel.exchange:
// - direct: every buffer peers write is carved from one block of peer memory; the plan is made on
//   the device from every rank's dispatch offsets and rows are written into the owners' memory
//   between two fences (no host wait);
// - send/recv: counts go through the host to plan all-to-all-v transfers (NCCL or MPI).
// With one expert-parallel rank every row stays where it is.
// Direct with parallel.exchange_chunks = N > 1: a call's local experts are split into N chunks
// whose rows travel on the ops' side queue while the previous chunk's experts compute on the main
// one (moe_exchange_pipeline; docs/ARCHITECTURE.md, "The expert exchange behind compute").
#pragma once
#include <stdbool.h>
#include <stdint.h>

#include "config.h"
#include "dist/parallel.h"
#include "ops/ops.h"
#include "pool.h"

// The routes of one MoE call (kept from its forward for its backward). The plan is the identity
// with one expert-parallel rank.
typedef struct {
    int32_t *offsets;                 // (El + 1) backend: expert-major row offsets of the received
    int32_t *all_offsets;             // direct: (ep, E + 1) backend, every ep rank's dispatch offsets
    int32_t *plan;                    // direct: backend, ops.h moe_exchange_plan (offsets == plan)
    size_t kept_rows;                 // direct: rows each receive buffer holds under this plan
    size_t *send_rows, *recv_rows;    // send/recv: (ep) rows to and from each rank of the ep group
    int32_t *send_counts;             // send/recv: (ep, El) backend, rows per (destination, expert)
    int32_t *recv_counts;             // send/recv: (ep, El) backend, rows per (source, local expert)
} ExchangeRoutes;

// The exchange of one model: its transport and the memory rows travel through.
typedef struct {
    ModelConfig cfg;          // the model's
    const Ops *ops;
    const Parallel *par;      // ep: the ranks the experts are split over
    MemPool *mem;             // the model's memory, which the exchange's buffers come from
    size_t T;                 // tokens of a call the buffers are sized for
    size_t El;                // experts of each MoE layer held here
    bool direct;              // rows are written into their owners' memory
    PeerMem peer;             // direct: what peers write into (each call's xe and y, dxe, dxp)
    size_t peer_used;         // bytes of it handed out
    void *peer_bases;         // direct: backend array (ep) of every rank's peer.base
    void *xfer;               // send/recv: act (max(R, Rr), D) rows in transit
    size_t chunks;            // direct: chunks of a call's experts (parallel.exchange_chunks, lowered
                              // to a divisor of El: equal chunks); else 1
    size_t push_ctas;         // thread blocks of a push beside compute (0: no bound)
    size_t send_row_bytes;    // bytes a row of the rows sent to the experts takes (ExchangeRows)
} MoeExchange;

// The expert computation of one chunk of a call (local experts [e0, e1)) on the main queue: it
// reads the rows moved to the experts and writes the rows to move back, of those experts only.
typedef void (*ExchangeCompute)(void *ctx, size_t e0, size_t e1);

// Sizes the exchange for calls of up to T tokens whose rows to the experts take send_row_bytes
// each (act rows, or FP8 ones) and, with several expert-parallel ranks, picks the transport:
// direct where the ranks can write each other's memory (peer memory for n_calls MoE calls'
// buffers and one set of gradient scratch), else send/recv unless parallel.exchange asked for
// direct (an error). Without communicators (`moe inspect`) a direct plan is sized as if the ranks
// shared a node.
void moe_exchange_init(MoeExchange *x, const ModelConfig *c, const Ops *ops, const Parallel *par,
                       MemPool *mem, size_t T, int n_calls, size_t send_row_bytes);
// The first local expert of chunk i of a call (i <= chunks).
size_t moe_exchange_chunk_expert(const MoeExchange *x, size_t i);
void moe_exchange_free(MoeExchange *x);
// A buffer of `rows` rows that peers write into: a piece of peer memory (direct), else ordinary;
// of act rows, or (recv) of the rows sent to the experts (send_row_bytes each).
void *moe_exchange_buf(MoeExchange *x, size_t rows);
void *moe_exchange_recv_buf(MoeExchange *x, size_t rows);
// Rows this rank's experts can receive in a call of T tokens: at worst every ep rank sends all
// its kept rows here; parallel.recv_capacity can bound it (rows past it are dropped).
size_t moe_exchange_received_rows(const MoeExchange *x, size_t T);
// The route buffers of one MoE call (several ranks) and their host arrays' release.
void moe_exchange_routes_init(MoeExchange *x, ExchangeRoutes *r);
void moe_exchange_routes_free(ExchangeRoutes *r);
// Plans a call of T tokens from this rank's dispatch offsets (E + 1, backend). Direct: every
// rank's offsets gathered and turned into block lists on the device; rows past a receive buffer
// are added to *dropped (f32). Send/recv: counts exchanged through the host.
void moe_exchange_route(MoeExchange *x, ExchangeRoutes *r, const int32_t *offsets, void *dropped,
                        size_t T);
// Row tensors that travel together: toward the experts a call's act rows (d_model wide), or with
// train.fp8_exchange the rows' FP8 codes and their scales in row-major order (ops.h
// fp8_regroup_scales); back, the experts' act results. Each travels as rows of act elements of
// its bytes (moe_exchange_width), so both transports move any of them as they move act rows.
typedef struct {
    int n;               // tensors (1 or 2)
    const void *rows[2]; // (rows, width[i]) in the order they leave: toward the experts this rank's
                         // dispatch order (R rows), back the experts' expert-major order
    void *at[2];         // where they land, in the other order (the direct transport: peer memory)
    size_t width[2];     // act elements a row
} ExchangeRows;

// The act rows `rows` to `at` (one tensor d_model wide).
ExchangeRows moe_exchange_act_rows(const MoeExchange *x, const void *rows, void *at);
// Act elements of a row of `bytes` bytes (a multiple of the act size).
size_t moe_exchange_width(const MoeExchange *x, size_t bytes);
// A call's rows to its experts and back: the tensors of s go from this rank's dispatch order to
// the experts' expert-major order, compute runs chunk by chunk and writes `back` (act, expert-major),
// which returns to `out` (dispatch order). With one chunk, or without the direct transport, the three
// steps run one after the other on the main queue; with one expert-parallel rank nothing moves: s
// must be one tensor whose `at` is its `rows`, and `back` must be `out`. A tensor's rows and out may
// be one buffer (a chunk's rows leave before its results come back to the same rows). With chunks,
// the rows of s and back are read on the side queue while compute runs: nothing compute writes may
// alias them.
void moe_exchange_pipeline(MoeExchange *x, const ExchangeRoutes *r, const ExchangeRows *s, void *back, void *out,
                           ExchangeCompute compute, void *ctx);
