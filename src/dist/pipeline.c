// The pipeline schedules declared in pipeline.h. One chunk a stage: Megatron-LM's non-interleaved
// 1F1B, written out with paired exchanges. Several: Megatron-LM's interleaved order of forwards and
// backwards for each stage, with the transfers placed by running all stages together: each round
// every stage whose next computation has its inputs runs it, then the transfers that round produced
// are appended to both ends' lists in one global order. Every list is the part of one sequence
// that concerns its stage, so blocking transfers cannot deadlock (the earliest transfer not yet
// done always has both ends waiting at it), and between two ranks transfers keep their order.
#include "dist/pipeline.h"

#include <stdlib.h>

// The schedule under construction for one stage.
typedef struct {
    int stage, stages, v;
    PipeAction *out;
    size_t n, cap;
} PipeBuilder;

static int virtual_stage(int stages, int stage, int chunk) { return chunk * stages + stage; }

// The virtual stage an action's transfer faces: -1 (the previous), +1 (the next), or 0 for compute.
// Both halves of an exchange face the same neighbour, so an exchange is wholly present or absent.
static int pipeline_peer_offset(PipeActionKind kind) {
    switch (kind) {
    case PIPE_RECV_FORWARD:
    case PIPE_SEND_BACKWARD:
    case PIPE_SEND_BACKWARD_RECV_FORWARD: return -1;
    case PIPE_SEND_FORWARD:
    case PIPE_RECV_BACKWARD:
    case PIPE_SEND_FORWARD_RECV_BACKWARD: return +1;
    default: return 0;
    }
}

// Appends an action, dropping transfers toward a virtual stage that does not exist (the first reads
// its input from data, the last computes the loss gradient itself).
static void pipeline_push(PipeBuilder *b, PipeActionKind kind, int chunk, int micro, int micro2) {
    int peer = virtual_stage(b->stages, b->stage, chunk) + pipeline_peer_offset(kind);
    if (peer < 0 || peer >= b->stages * b->v) return;
    MOE_ASSERT(b->n < b->cap);
    b->out[b->n++] = (PipeAction){kind, micro, micro2, chunk};
}

int pipeline_check(int stages, int v, int micro_batches, MoeErr err) {
    if (stages < 1 || micro_batches < 1)
        return moe_err(err, "the pipeline needs at least one stage and one micro-batch (parallel.pp = %d, "
                       "train.micro_batches = %d)", stages, micro_batches);
    if (v < 1 || v > PIPE_MAX_CHUNKS)
        return moe_err(err, "parallel.virtual_stages = %d must be between 1 and %d", v, PIPE_MAX_CHUNKS);
    if (v > 1 && stages < 2)
        return moe_err(err, "parallel.virtual_stages = %d interleaves pipeline stages: it needs parallel.pp >= 2 "
                       "(one stage has no bubble to fill; use parallel.virtual_stages=1)", v);
    if (v > 1 && micro_batches % stages)
        return moe_err(err, "parallel.virtual_stages = %d (interleaved 1F1B) runs micro-batches in groups of "
                       "parallel.pp = %d: train.micro_batches = %d must be a multiple of %d", v, stages,
                       micro_batches, stages);
    return 0;
}

static void pipeline_check_args(int stages, int v, int stage, int micro_batches) {
    MoeErr err;
    if (pipeline_check(stages, v, micro_batches, err)) moe_fatal("%s", err);
    MOE_CHECK(stage >= 0 && stage < stages, "pipeline stage %d of %d is out of range", stage, stages);
}

static PipeTransfer pipeline_half(int stages, int v, int stage, PipeActionKind kind, int chunk, int micro) {
    bool send = kind == PIPE_SEND_FORWARD || kind == PIPE_SEND_BACKWARD;
    bool backward = kind == PIPE_SEND_BACKWARD || kind == PIPE_RECV_BACKWARD;
    int peer = virtual_stage(stages, stage, chunk) + pipeline_peer_offset(kind);
    return (PipeTransfer){peer % stages, send, backward, micro};
}

int pipeline_transfers(int stages, int v, int stage, PipeAction a, PipeTransfer out[2]) {
    switch (a.kind) {
    case PIPE_FORWARD:
    case PIPE_BACKWARD: return 0;
    case PIPE_SEND_FORWARD_RECV_BACKWARD:
        out[0] = pipeline_half(stages, v, stage, PIPE_SEND_FORWARD, a.chunk, a.micro);
        out[1] = pipeline_half(stages, v, stage, PIPE_RECV_BACKWARD, a.chunk, a.micro2);
        return 2;
    case PIPE_SEND_BACKWARD_RECV_FORWARD:
        out[0] = pipeline_half(stages, v, stage, PIPE_SEND_BACKWARD, a.chunk, a.micro);
        out[1] = pipeline_half(stages, v, stage, PIPE_RECV_FORWARD, a.chunk, a.micro2);
        return 2;
    default: out[0] = pipeline_half(stages, v, stage, a.kind, a.chunk, a.micro); return 1;
    }
}

size_t pipeline_max_actions(int v, int micro_batches) {
    // Each micro-batch is forwarded and backwarded once per chunk and its activation and gradient
    // each cross a virtual stage at most once in and once out: six items, fewer actions where
    // exchanges pair them. (Warmup and cooldown micro-batches use all six, so 4M + const is not enough.)
    return 6 * (size_t)(v > 0 ? v : 0) * (size_t)(micro_batches > 0 ? micro_batches : 0);
}

// ---------------------------------------------------------------- one chunk a stage

static size_t pipeline_1f1b(int stages, int stage, int micro_batches, PipeAction *out) {
    PipeBuilder b = {stage, stages, 1, out, 0, pipeline_max_actions(1, micro_batches)};
    int m = micro_batches;
    // Stage s forwards P - s - 1 micro-batches ahead so that later stages have work while the
    // first backward travels back.
    int warmup = stages - stage - 1 < m ? stages - stage - 1 : m;
    int remaining = m - warmup;
    for (int i = 0; i < warmup; i++) {
        pipeline_push(&b, PIPE_RECV_FORWARD, 0, i, 0);
        pipeline_push(&b, PIPE_FORWARD, 0, i, 0);
        pipeline_push(&b, PIPE_SEND_FORWARD, 0, i, 0);
    }
    if (remaining > 0) pipeline_push(&b, PIPE_RECV_FORWARD, 0, warmup, 0);
    for (int i = 0; i < remaining; i++) {
        pipeline_push(&b, PIPE_FORWARD, 0, warmup + i, 0);
        // An exchange, not a send then a receive: both halves are posted at once, so a neighbour
        // that itself sends first (plain or in its own exchange) is never left waiting.
        pipeline_push(&b, PIPE_SEND_FORWARD_RECV_BACKWARD, 0, warmup + i, i);
        pipeline_push(&b, PIPE_BACKWARD, 0, i, 0);
        if (i == remaining - 1)
            pipeline_push(&b, PIPE_SEND_BACKWARD, 0, i, 0);
        else
            pipeline_push(&b, PIPE_SEND_BACKWARD_RECV_FORWARD, 0, i, warmup + i + 1);
    }
    for (int i = remaining; i < m; i++) {
        pipeline_push(&b, PIPE_RECV_BACKWARD, 0, i, 0);
        pipeline_push(&b, PIPE_BACKWARD, 0, i, 0);
        pipeline_push(&b, PIPE_SEND_BACKWARD, 0, i, 0);
    }
    return b.n;
}

// ---------------------------------------------------------------- several chunks a stage

// The k-th forward or backward of a stage in Megatron-LM's interleaved order: micro-batches in
// groups of P, the chunks in turn (backwards from the last chunk).
static PipeAction interleaved_compute(int stages, int v, int k, bool backward) {
    int group = k / stages, chunk = group % v;
    return (PipeAction){backward ? PIPE_BACKWARD : PIPE_FORWARD, (group / v) * stages + k % stages, 0,
                        backward ? v - 1 - chunk : chunk};
}

// A stage's computations: warmup forwards, then one forward and one backward in turn, then the
// remaining backwards. A steady-state backward is marked to run in the same round as the forward
// before it (Megatron's loop exchanges data once per forward-backward pair).
static int interleaved_computes(int stages, int v, int stage, int m, PipeAction *out, bool *joined) {
    int total = m * v, warmup = (stages - stage - 1) * 2 + (v - 1) * stages, n = 0;
    warmup = warmup < total ? warmup : total;
    for (int k = 0; k < warmup; k++) joined[n] = false, out[n++] = interleaved_compute(stages, v, k, false);
    for (int i = 0; i < total - warmup; i++) {
        joined[n] = false, out[n++] = interleaved_compute(stages, v, warmup + i, false);
        joined[n] = true, out[n++] = interleaved_compute(stages, v, i, true);
    }
    for (int i = total - warmup; i < total; i++) joined[n] = false, out[n++] = interleaved_compute(stages, v, i, true);
    return n;
}

// All stages run together in rounds (see the top of the file).
typedef struct {
    int stages, v, m, V;          // V = stages x v virtual stages
    PipeAction *comp;             // (stages, 2 m v) each stage's computations
    bool *joined;                 // (stages, 2 m v) runs in the round of the computation before it
    int *next;                    // (stages) index of its next computation
    bool *act, *grad, *fwd;       // (V, m) input arrived, output gradient arrived, forward done
    PipeBuilder *lists;           // (stages)
} Interleave;

static bool *cell(const Interleave *x, bool *table, int vs, int micro) { return &table[vs * x->m + micro]; }

// Runs stage s's next computation if its inputs are there; returns the virtual stage it ran on, or -1.
static int interleave_run(Interleave *x, int s, PipeAction *ran) {
    if (x->next[s] == 2 * x->m * x->v) return -1;
    PipeAction a = x->comp[s * 2 * x->m * x->v + x->next[s]];
    int vs = virtual_stage(x->stages, s, a.chunk);
    bool ready = a.kind == PIPE_FORWARD ? vs == 0 || *cell(x, x->act, vs, a.micro)
                                        : *cell(x, x->fwd, vs, a.micro) && (vs == x->V - 1 || *cell(x, x->grad, vs, a.micro));
    if (!ready) return -1;
    if (a.kind == PIPE_FORWARD) *cell(x, x->fwd, vs, a.micro) = true;
    pipeline_push(&x->lists[s], a.kind, a.chunk, a.micro, 0);
    x->next[s]++;
    *ran = a;
    return vs;
}

// Stage s's round: its next computation and the ones joined to it, as far as their inputs are
// there; writes what ran (at most 2) and the virtual stages it ran on; returns how many.
static int interleave_step(Interleave *x, int s, PipeAction ran[2], int on[2]) {
    int n = 0, per = 2 * x->m * x->v;
    do on[n] = interleave_run(x, s, &ran[n]);
    while (on[n] >= 0 && ++n < 2 && x->next[s] < per && x->joined[s * per + x->next[s]]);
    return n;
}

// The transfer a computation on virtual stage vs produced, appended to both ends' lists.
static void interleave_transfer(Interleave *x, int vs, PipeAction a) {
    bool fwd = a.kind == PIPE_FORWARD;
    int to = fwd ? vs + 1 : vs - 1;
    if (to < 0 || to >= x->V) return;
    pipeline_push(&x->lists[vs % x->stages], fwd ? PIPE_SEND_FORWARD : PIPE_SEND_BACKWARD, vs / x->stages, a.micro, 0);
    pipeline_push(&x->lists[to % x->stages], fwd ? PIPE_RECV_FORWARD : PIPE_RECV_BACKWARD, to / x->stages, a.micro, 0);
    *cell(x, fwd ? x->act : x->grad, to, a.micro) = true;
}

static size_t pipeline_interleaved(int stages, int v, int stage, int m, PipeAction *out) {
    int V = stages * v, per = 2 * m * v;
    Interleave x = {stages, v, m, V, moe_malloc((size_t)stages * (size_t)per * sizeof(PipeAction)),
                    moe_malloc((size_t)stages * (size_t)per * sizeof(bool)), moe_calloc((size_t)stages, sizeof(int)),
                    moe_calloc(3 * (size_t)V * (size_t)m, sizeof(bool)), NULL, NULL,
                    moe_calloc((size_t)stages, sizeof(PipeBuilder))};
    x.grad = x.act + V * m, x.fwd = x.grad + V * m;
    PipeAction *ran = moe_malloc(2 * (size_t)stages * sizeof(PipeAction));
    int *on = moe_malloc(2 * (size_t)stages * sizeof(int)), *count = moe_malloc((size_t)stages * sizeof(int));
    for (int s = 0; s < stages; s++) {
        interleaved_computes(stages, v, s, m, x.comp + (size_t)s * per, x.joined + (size_t)s * per);
        size_t cap = pipeline_max_actions(v, m);
        x.lists[s] = (PipeBuilder){s, stages, v, s == stage ? out : moe_malloc(cap * sizeof(PipeAction)), 0, cap};
    }
    for (int done = 0, moved = 1; moved;) {
        moved = 0;
        for (int s = 0; s < stages; s++) moved += count[s] = interleave_step(&x, s, &ran[2 * s], &on[2 * s]);
        for (int s = 0; s < stages; s++)
            for (int k = 0; k < count[s]; k++) interleave_transfer(&x, on[2 * s + k], ran[2 * s + k]);
        done += moved;
        MOE_ASSERT(moved || done == stages * per); // Megatron's order never waits on itself
    }
    size_t n = x.lists[stage].n;
    for (int s = 0; s < stages; s++)
        if (s != stage) free(x.lists[s].out);
    free(x.comp), free(x.joined), free(x.next), free(x.act), free(x.lists), free(ran), free(on), free(count);
    return n;
}

size_t pipeline_schedule(int stages, int v, int stage, int micro_batches, PipeAction *out) {
    pipeline_check_args(stages, v, stage, micro_batches);
    return v == 1 ? pipeline_1f1b(stages, stage, micro_batches, out)
                  : pipeline_interleaved(stages, v, stage, micro_batches, out);
}

// The most activations of a chunk held at once: one arrives with its input (or its forward, on the
// first virtual stage, which reads data) and leaves with its backward.
int pipeline_slots(int stages, int v, int stage, int chunk, int micro_batches) {
    PipeAction *a = moe_malloc(pipeline_max_actions(v, micro_batches) * sizeof(PipeAction));
    size_t n = pipeline_schedule(stages, v, stage, micro_batches, a);
    bool first = virtual_stage(stages, stage, chunk) == 0;
    int held = 0, peak = 0;
    for (size_t i = 0; i < n; i++) {
        PipeTransfer t[2];
        int nt = a[i].chunk == chunk ? pipeline_transfers(stages, v, stage, a[i], t) : 0;
        for (int k = 0; k < nt; k++) held += !t[k].send && !t[k].backward;
        if (a[i].chunk == chunk) held += (a[i].kind == PIPE_FORWARD && first) - (a[i].kind == PIPE_BACKWARD);
        peak = held > peak ? held : peak;
    }
    free(a);
    return peak;
}

double pipeline_bubble_fraction(int stages, int v, int micro_batches) {
    pipeline_check_args(stages, v, 0, micro_batches);
    return (double)(stages - 1) / (v * micro_batches + stages - 1);
}
