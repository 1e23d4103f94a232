// The expert exchange between expert-parallel ranks: its memory, its plans and its two
// transports (see moe_exchange.h).
#include "moe_exchange.h"

#include <math.h>
#include <stdlib.h>

#include "common/util.h"
#include "ops/exchange_plan.h"

static Comm *ep_group(const MoeExchange *x) { return x->par->ep; }

size_t moe_exchange_received_rows(const MoeExchange *x, size_t T) {
    const ModelConfig *c = &x->cfg;
    size_t ep = (size_t)ep_group(x)->size, slots = T * c->top_k, cap = model_expert_capacity(c, T);
    if (ep == 1) return model_routed_rows(c, T);
    size_t per_source = cap && cap * x->El < slots ? cap * x->El : slots;
    size_t worst = ep * per_source, bound = (size_t)ceil(x->par->recv_capacity * (double)model_routed_rows(c, T));
    return x->par->recv_capacity > 0 && bound < worst ? bound : worst;
}

// Bytes of peer memory for `rows` rows of row_bytes (256-byte aligned pieces).
static size_t peer_piece(size_t rows, size_t row_bytes) { return (rows * row_bytes + 255) / 256 * 256; }

// Bytes of an act row.
static size_t act_row(const MoeExchange *x) { return x->cfg.d_model * x->ops->act_size; }

// Direct: one block of peer memory holds every buffer the peers write (each call's xe and y, the
// scratch dxe and dxp: act rows, but xe's of send_row_bytes; rows sent as FP8 have a receive buffer
// of their own in the backward too). Where the ranks cannot share memory, rows go by send/recv,
// unless parallel.exchange asked for direct.
static void open_direct(MoeExchange *x, int n_calls) {
    Comm *ep = ep_group(x);
    ExchangeMode mode = x->par->exchange;
    if (ep->size == 1 || n_calls == 0 || mode == EXCHANGE_SENDRECV) return;
    size_t R = model_routed_rows(&x->cfg, x->T), Rr = moe_exchange_received_rows(x, x->T);
    size_t y = peer_piece(R, act_row(x)), xe = peer_piece(Rr, x->send_row_bytes);
    size_t grads = y + peer_piece(Rr, act_row(x)) + (x->send_row_bytes != act_row(x) ? xe : 0);
    size_t bytes = (size_t)n_calls * (y + xe) + grads;
    if (!ep->ops) {
        x->peer = (PeerMem){.base = pool_alloc(x->mem, bytes), .bytes = bytes};
    } else if (ep->ops->peer_alloc && ep->ops->peer_alloc(ep, bytes, &x->peer) == 0) {
        x->mem->bytes += bytes;
    } else {
        const char *why = "cannot write into each other's memory (not all on one node, or no peer "
                          "access between their devices)";
        if (mode == EXCHANGE_DIRECT)
            moe_fatal("parallel.exchange = direct: the %d expert-parallel ranks %s; use parallel.exchange="
                      "auto or sendrecv", ep->size, why);
        if (x->par->recv_capacity > 0)
            moe_fatal("parallel.recv_capacity = %g bounds the direct exchange, but the %d expert-parallel "
                      "ranks %s; set parallel.recv_capacity=0", x->par->recv_capacity, ep->size, why);
        return;
    }
    x->direct = true;
    x->peer_bases = pool_alloc(x->mem, (size_t)ep->size * sizeof(void *));
    x->ops->upload(x->peer_bases, x->peer.peers, (size_t)ep->size * sizeof(void *));
}

// Chunks of El experts: the most that divide them evenly, up to `want`. Every chunk then has the
// same number of experts, so a GPU's grouped GEMM keeps one set of launch parameters (CUTLASS's
// are made per expert count, outside a recorded step).
static size_t even_chunks(size_t El, int want) {
    size_t n = want > 0 && (size_t)want < El ? (size_t)want : El;
    while (El % n) n--;
    return n;
}

void moe_exchange_init(MoeExchange *x, const ModelConfig *c, const Ops *ops, const Parallel *par,
                       MemPool *mem, size_t T, int n_calls, size_t send_row_bytes) {
    *x = (MoeExchange){.cfg = *c, .ops = ops, .par = par, .mem = mem, .T = T,
                       .El = (size_t)(par->lay.expert_end - par->lay.expert_begin), .send_row_bytes = send_row_bytes};
    open_direct(x, n_calls);
    x->chunks = x->direct ? even_chunks(x->El, par->exchange_chunks) : 1;
    x->push_ctas = x->chunks > 1 ? (size_t)par->push_ctas : 0;
    if (model_n_moe_layers(c) > 0 && ep_group(x)->size > 1 && !x->direct) {
        size_t R = model_routed_rows(c, T), Rr = moe_exchange_received_rows(x, T);
        x->xfer = pool_act(mem, (R > Rr ? R : Rr) * c->d_model);
    }
}

void moe_exchange_free(MoeExchange *x) {
    Comm *ep = ep_group(x);
    if (x->direct && ep->ops) ep->ops->peer_free(ep, &x->peer);
}

// A buffer of `rows` rows of row_bytes that peers write into.
static void *exchange_buf(MoeExchange *x, size_t rows, size_t row_bytes) {
    if (!x->direct) return pool_alloc(x->mem, rows * row_bytes);
    size_t bytes = peer_piece(rows, row_bytes);
    MOE_ASSERT(x->peer_used + bytes <= x->peer.bytes);
    void *p = (char *)x->peer.base + x->peer_used;
    x->peer_used += bytes;
    return p;
}

void *moe_exchange_buf(MoeExchange *x, size_t rows) { return exchange_buf(x, rows, act_row(x)); }
void *moe_exchange_recv_buf(MoeExchange *x, size_t rows) { return exchange_buf(x, rows, x->send_row_bytes); }

void moe_exchange_routes_init(MoeExchange *x, ExchangeRoutes *r) {
    size_t ep = (size_t)ep_group(x)->size, El = x->El;
    if (x->direct) {
        r->all_offsets = pool_i32(x->mem, ep * (size_t)(x->cfg.n_experts + 1));
        r->plan = r->offsets = pool_i32(x->mem, exchange_plan_len(ep, El));
        return;
    }
    r->send_rows = moe_calloc(ep, sizeof(size_t));
    r->recv_rows = moe_calloc(ep, sizeof(size_t));
    r->send_counts = pool_i32(x->mem, ep * El);
    r->recv_counts = pool_i32(x->mem, ep * El);
    r->offsets = pool_i32(x->mem, El + 1);
}

void moe_exchange_routes_free(ExchangeRoutes *r) {
    free(r->send_rows);
    free(r->recv_rows);
}

// Send/recv: counts of the rows this rank sends to each expert-parallel rank, exchanged through
// the host for the counts it will receive.
static void route_sendrecv(MoeExchange *x, ExchangeRoutes *r, const int32_t *offsets) {
    const Ops *ops = x->ops;
    Comm *ep = ep_group(x);
    size_t n = (size_t)ep->size, El = x->El, E = n * El;
    int32_t *off = moe_malloc((E + 1) * sizeof(int32_t)), *cnt = moe_malloc(E * sizeof(int32_t));
    int32_t *eoff = moe_malloc((El + 1) * sizeof(int32_t));
    size_t *blocks = moe_malloc(n * sizeof(size_t));
    ops->download(off, offsets, (E + 1) * sizeof(int32_t));
    for (size_t e = 0; e < E; e++) cnt[e] = off[e + 1] - off[e];
    for (size_t j = 0; j < n; j++) blocks[j] = El, r->send_rows[j] = (size_t)(off[(j + 1) * El] - off[j * El]);
    ops->upload(r->send_counts, cnt, E * sizeof(int32_t));
    ep->ops->all_to_all_v(ep, r->send_counts, blocks, r->recv_counts, blocks, COMM_I32);
    ops->download(cnt, r->recv_counts, E * sizeof(int32_t)); // now (ep, El) received
    eoff[0] = 0;
    for (size_t e = 0; e < El; e++) {
        eoff[e + 1] = eoff[e];
        for (size_t j = 0; j < n; j++) eoff[e + 1] += cnt[j * El + e];
    }
    for (size_t j = 0; j < n; j++) {
        r->recv_rows[j] = 0;
        for (size_t e = 0; e < El; e++) r->recv_rows[j] += (size_t)cnt[j * El + e];
    }
    ops->upload(r->offsets, eoff, (El + 1) * sizeof(int32_t));
    free(off), free(cnt), free(eoff), free(blocks);
}

void moe_exchange_route(MoeExchange *x, ExchangeRoutes *r, const int32_t *offsets, void *dropped,
                        size_t T) {
    Comm *ep = ep_group(x);
    if (ep->size == 1) return;
    if (!x->direct) {
        route_sendrecv(x, r, offsets);
        return;
    }
    size_t n = (size_t)ep->size, E = (size_t)x->cfg.n_experts;
    ep->ops->all_gather(ep, offsets, r->all_offsets, E + 1, COMM_I32);
    r->kept_rows = moe_exchange_received_rows(x, T);
    x->ops->moe_exchange_plan(r->plan, r->all_offsets, n, x->El, (size_t)ep->rank, r->kept_rows, dropped);
}

// Direct: the blocks of chunk `chunk` of `rows` (width act elements a row) written into their
// owners' `out`: toward the experts, this rank's rows for the chunk's experts on every rank (a run
// of blocks per rank); back, what each source sent the chunk's experts here (one run). Source rows
// of `rows`: R.
static void push_chunk(MoeExchange *x, const ExchangeRoutes *r, const void *rows, void *out, size_t width,
                       bool to_experts, size_t chunk) {
    size_t n = (size_t)ep_group(x)->size, E = (size_t)x->cfg.n_experts;
    size_t e0 = moe_exchange_chunk_expert(x, chunk), e1 = moe_exchange_chunk_expert(x, chunk + 1);
    size_t offset = (size_t)((char *)out - (char *)x->peer.base);
    MOE_ASSERT((char *)out >= (char *)x->peer.base && offset < x->peer.bytes);
    const int32_t *dispatch = r->plan + x->El + 1, *ret = dispatch + 4 * E;
    PushBlocks b = to_experts ? (PushBlocks){dispatch + 4 * e0, e1 - e0, n, x->El}
                              : (PushBlocks){ret + 4 * e0 * n, (e1 - e0) * n, 1, 0};
    size_t R = to_experts ? model_routed_rows(&x->cfg, x->T) : r->kept_rows; // rows of `rows`
    x->ops->moe_push_rows(x->peer_bases, offset, rows, b, width, R, x->push_ctas);
}

// Send/recv: one all-to-all-v of rank-major blocks of rows (width act elements a row), regrouped to
// or from expert-major order.
static void transfer_rows(MoeExchange *x, const ExchangeRoutes *r, const void *rows, void *out, size_t width,
                          bool to_experts) {
    Comm *ep = ep_group(x);
    size_t n = (size_t)ep->size, El = x->El;
    size_t *send = moe_malloc(2 * n * sizeof(size_t)), *recv = send + n;
    for (size_t j = 0; j < n; j++) {
        send[j] = (to_experts ? r->send_rows[j] : r->recv_rows[j]) * width;
        recv[j] = (to_experts ? r->recv_rows[j] : r->send_rows[j]) * width;
    }
    if (to_experts) {
        ep->ops->all_to_all_v(ep, rows, send, x->xfer, recv, COMM_ACT);
        x->ops->moe_regroup(out, x->xfer, r->recv_counts, n, El, width, true);
    } else {
        x->ops->moe_regroup(x->xfer, rows, r->recv_counts, n, El, width, false);
        ep->ops->all_to_all_v(ep, x->xfer, send, out, recv, COMM_ACT);
    }
    free(send);
}

// Direct: chunk `chunk` of every tensor of t pushed, toward the experts or back.
static void push_tensors(MoeExchange *x, const ExchangeRoutes *r, const ExchangeRows *t, bool to_experts,
                         size_t chunk) {
    for (int i = 0; i < t->n; i++) push_chunk(x, r, t->rows[i], t->at[i], t->width[i], to_experts, chunk);
}

// Every tensor of t toward the experts or back, in one step: by send/recv, or one direct push of
// every block between two fences (peers are done with the destination before, rows landed after).
static void exchange_tensors(MoeExchange *x, const ExchangeRoutes *r, const ExchangeRows *t, bool to_experts) {
    Comm *ep = ep_group(x);
    if (!x->direct) {
        for (int i = 0; i < t->n; i++) transfer_rows(x, r, t->rows[i], t->at[i], t->width[i], to_experts);
        return;
    }
    ep->ops->fence(ep);
    push_tensors(x, r, t, to_experts, 0);
    ep->ops->fence(ep);
}

ExchangeRows moe_exchange_act_rows(const MoeExchange *x, const void *rows, void *at) {
    return (ExchangeRows){.n = 1, .rows = {rows}, .at = {at}, .width = {x->cfg.d_model}};
}

size_t moe_exchange_width(const MoeExchange *x, size_t bytes) {
    MOE_ASSERT(bytes % x->ops->act_size == 0);
    return bytes / x->ops->act_size;
}

size_t moe_exchange_chunk_expert(const MoeExchange *x, size_t i) { return i * (x->El / x->chunks); }

// The ops' side queue, where there is one (else work runs in order).
static void side_begin(const Ops *o) { if (o->side_begin) o->side_begin(); }
static void side_end(const Ops *o) { if (o->side_end) o->side_end(); }
static void side_join(const Ops *o) { if (o->side_join) o->side_join(); }

// Chunks by stream: on the side queue a fence (peers are done with `at` and `out`), chunk 0's rows
// out and a fence (landed); the main queue waits. Then for each chunk i on the main queue, the side
// queue, from there, sends chunk i - 1's results back and chunk i + 1's rows out and fences while
// chunk i computes; the main queue waits for it before chunk i + 1. Last, chunk N - 1's results go
// back behind a fence. Every rank queues the same fences in the same order, on one queue.
static void pipeline_chunks(MoeExchange *x, const ExchangeRoutes *r, const ExchangeRows *s, void *back, void *out,
                            ExchangeCompute compute, void *ctx) {
    const Ops *o = x->ops;
    Comm *ep = ep_group(x);
    size_t N = x->chunks;
    ExchangeRows ret = moe_exchange_act_rows(x, back, out);
    side_begin(o);
    ep->ops->fence(ep);
    push_tensors(x, r, s, true, 0);
    ep->ops->fence(ep);
    side_end(o), side_join(o);
    for (size_t i = 0; i < N; i++) {
        side_begin(o);
        if (i > 0) push_tensors(x, r, &ret, false, i - 1);
        if (i + 1 < N) push_tensors(x, r, s, true, i + 1);
        ep->ops->fence(ep);
        side_end(o);
        compute(ctx, moe_exchange_chunk_expert(x, i), moe_exchange_chunk_expert(x, i + 1));
        side_join(o);
    }
    side_begin(o);
    push_tensors(x, r, &ret, false, N - 1);
    ep->ops->fence(ep);
    side_end(o), side_join(o);
}

void moe_exchange_pipeline(MoeExchange *x, const ExchangeRoutes *r, const ExchangeRows *s, void *back, void *out,
                           ExchangeCompute compute, void *ctx) {
    if (ep_group(x)->size == 1) {
        MOE_ASSERT(s->n == 1 && s->at[0] == s->rows[0] && back == out);
        compute(ctx, 0, x->El);
        return;
    }
    if (x->chunks > 1) {
        pipeline_chunks(x, r, s, back, out, compute, ctx);
        return;
    }
    ExchangeRows ret = moe_exchange_act_rows(x, back, out);
    exchange_tensors(x, r, s, true);
    compute(ctx, 0, x->El);
    exchange_tensors(x, r, &ret, false);
}
