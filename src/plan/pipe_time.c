// The timed run of the pipeline schedule declared in pipe_time.h.
#include "plan/pipe_time.h"

#include <stdlib.h>

#include "common/util.h"

typedef struct {
    PipeAction *a;
    size_t n, pc;
    double clock;        // when the stage reached its current action
    bool done[2];        // halves of the current action already carried
    double end[2];       // when they ended
} TimedStage;

typedef struct {
    TimedStage *st;
    int pp, v;
    const PipeStageTime *t;
    double *busy, *transfer;
} Timed;

static int halves(const Timed *x, int s, PipeTransfer h[2]) {
    const TimedStage *st = &x->st[s];
    return st->pc < st->n ? pipeline_transfers(x->pp, x->v, s, st->a[st->pc], h) : 0;
}

// One transfer between neighbouring stages s and p (the last stage and the first are neighbours).
static double link(const Timed *x, int s, int p) { return x->t[(s + 1) % x->pp == p ? s : p].link_next; }

// Carries half k of stage s's current action if the peer's current action has the other side.
static bool match(Timed *x, int s, int k) {
    PipeTransfer mine[2], theirs[2];
    TimedStage *st = x->st;
    halves(x, s, mine);
    int p = mine[k].peer, np = halves(x, p, theirs);
    for (int j = 0; j < np; j++) {
        if (st[p].done[j] || theirs[j].peer != s || theirs[j].send == mine[k].send) continue;
        double start = st[s].clock > st[p].clock ? st[s].clock : st[p].clock;
        double end = start + link(x, s, p);
        st[s].done[k] = st[p].done[j] = true;
        st[s].end[k] = st[p].end[j] = end;
        return true;
    }
    return false;
}

// Advances stage s by one action if it can finish; returns whether anything happened.
static bool advance(Timed *x, int s) {
    TimedStage *st = &x->st[s];
    if (st->pc >= st->n) return false;
    PipeAction a = st->a[st->pc];
    PipeTransfer h[2];
    int nh = halves(x, s, h);
    bool moved = false;
    for (int k = 0; k < nh; k++)
        if (!st->done[k]) moved |= match(x, s, k);
    if (nh && !(st->done[0] && (nh < 2 || st->done[1]))) return moved;
    double end = st->clock;
    if (a.kind == PIPE_FORWARD || a.kind == PIPE_BACKWARD) {
        end += (a.kind == PIPE_FORWARD ? x->t[s].fwd : x->t[s].bwd)[a.chunk];
        x->busy[s] += end - st->clock;
    } else {
        for (int k = 0; k < nh; k++) end = st->end[k] > end ? st->end[k] : end;
        x->busy[s] += link(x, s, h[0].peer), x->transfer[s] += link(x, s, h[0].peer);
    }
    st->clock = end, st->pc++, st->done[0] = st->done[1] = false;
    return true;
}

double pipe_time_run(int pp, int v, int micro_batches, const PipeStageTime *t, double *busy, double *transfer) {
    TimedStage *st = moe_calloc((size_t)pp, sizeof *st);
    double *b = moe_calloc(2 * (size_t)pp, sizeof(double)), *tr = b + pp;
    Timed x = {st, pp, v, t, b, tr};
    for (int s = 0; s < pp; s++) {
        st[s].a = moe_malloc(pipeline_max_actions(v, micro_batches) * sizeof(PipeAction));
        st[s].n = pipeline_schedule(pp, v, s, micro_batches, st[s].a);
    }
    for (bool moved = true; moved;) {
        moved = false;
        for (int s = 0; s < pp; s++) moved |= advance(&x, s);
    }
    double makespan = 0;
    for (int s = 0; s < pp; s++) {
        MOE_ASSERT(st[s].pc == st[s].n); // the schedules are proven to pair up (tests/test_pipeline.c)
        makespan = st[s].clock > makespan ? st[s].clock : makespan;
        if (busy) busy[s] = b[s];
        if (transfer) transfer[s] = tr[s];
        free(st[s].a);
    }
    free(st), free(b);
    return makespan;
}
