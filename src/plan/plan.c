// The layout search declared in plan.h. The knobs are a table: a new mode (a precision, another
// recompute policy) that the config system gains becomes one more row, with the values to try and
// the PlanLayout field it sets (plan_apply writes it into the config).
#include "plan/plan.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PLAN_MAX_VALUES 64

typedef struct {
    const char *key; // in --layout
    // Candidate values for cfg's model on `world` devices (the layout so far set by earlier knobs).
    int (*values)(const Config *cfg, int world, const PlanLayout *l, int *out);
    size_t member; // the PlanLayout field it sets: offsetof(PlanLayout, ...)
} PlanKnob;

static int divisors(int n, int limit, int *out) {
    int k = 0;
    for (int d = 1; d <= n && d <= limit && k < PLAN_MAX_VALUES; d++)
        if (n % d == 0) out[k++] = d;
    return k;
}

static int pp_values(const Config *cfg, int world, const PlanLayout *l, int *out) {
    return divisors(world, cfg->model.n_layers, out);
}

static int ep_values(const Config *cfg, int world, const PlanLayout *l, int *out) {
    if (!model_n_moe_layers(&cfg->model)) return out[0] = 1, 1;
    int k = 0, dp = world / l->pp;
    for (int d = 1; d <= dp && k < PLAN_MAX_VALUES; d++)
        if (dp % d == 0 && cfg->model.n_experts % d == 0) out[k++] = d;
    return k;
}

static int global_sequences(const Config *cfg) { return cfg->train.micro_batch * cfg->train.micro_batches; }

// Sequences per rank in a micro-batch: those dividing the rank's share of the global batch.
static int micro_values(const Config *cfg, int world, const PlanLayout *l, int *out) {
    int dp = world / l->pp, global = global_sequences(cfg);
    return global % dp ? 0 : divisors(global / dp, global, out);
}

// Model chunks a stage: 1 to 4 where the layers go round (a pipeline of one stage has one).
static int v_values(const Config *cfg, int world, const PlanLayout *l, int *out) {
    int k = 0;
    for (int v = 1; v <= (l->pp > 1 ? 4 : 1) && l->pp * v <= cfg->model.n_layers; v++) out[k++] = v;
    return k;
}

// train.recompute: none, selective (the cheap activations) or full (each layer's input only).
static int recompute_values(const Config *cfg, int world, const PlanLayout *l, int *out) {
    out[0] = RECOMPUTE_NONE, out[1] = RECOMPUTE_SELECTIVE, out[2] = RECOMPUTE_FULL;
    return 3;
}

#define KNOB(name, fn, fld) {name, fn, offsetof(PlanLayout, fld)}
static const PlanKnob KNOBS[] = {
    KNOB("pp", pp_values, pp),
    KNOB("ep", ep_values, ep),
    KNOB("micro", micro_values, micro_per_rank),
    KNOB("v", v_values, v),
    KNOB("recompute", recompute_values, recompute),
};
#define N_KNOBS (sizeof KNOBS / sizeof KNOBS[0])

static int *knob_field(PlanLayout *l, const PlanKnob *k) { return (int *)((char *)l + k->member); }

void plan_apply(Config *c, const PlanLayout *l) {
    int global = global_sequences(c);
    c->parallel.pp = l->pp, c->parallel.ep = l->ep, c->parallel.virtual_stages = l->v;
    c->train.recompute = (Recompute)l->recompute;
    c->train.micro_batch = l->micro_per_rank * l->dp;
    c->train.micro_batches = global / c->train.micro_batch;
}

static void plan_derive(PlanLayout *l, const Config *cfg, int world) {
    l->dp = world / l->pp;
    int per_micro = l->micro_per_rank * l->dp;
    l->micro_batches = per_micro > 0 && global_sequences(cfg) % per_micro == 0 ? global_sequences(cfg) / per_micro : 0;
}

// Parses "pp=2,ep=8,micro=2,v=2" onto l (keys not given keep their values).
static int parse_layout(const char *text, PlanLayout *l, MoeErr err) {
    char *copy = moe_strdup(text), *save = NULL;
    int rc = 0;
    for (char *item = strtok_r(copy, ",", &save); item && !rc; item = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(item, '=');
        const PlanKnob *k = NULL;
        for (size_t i = 0; eq && i < N_KNOBS; i++)
            if (!strncmp(item, KNOBS[i].key, (size_t)(eq - item)) && strlen(KNOBS[i].key) == (size_t)(eq - item))
                k = &KNOBS[i];
        char *end = NULL;
        long v = eq ? strtol(eq + 1, &end, 10) : 0;
        if (!k || !*(eq + 1) || *end || v < (k->member == offsetof(PlanLayout, recompute) ? 0 : 1) || v > 1 << 20)
            rc = moe_err(err, "--layout: '%s' is not KEY=N with KEY one of pp, ep, micro, v, recompute (e.g. "
                         "pp=2,ep=8,micro=1,v=2,recompute=1)", item);
        else *knob_field(l, k) = (int)v;
    }
    free(copy);
    return rc;
}

int plan_layout_from(const Config *cfg, int world, const char *spec, PlanLayout *l, MoeErr err) {
    *l = (PlanLayout){.pp = cfg->parallel.pp, .v = cfg->parallel.virtual_stages, .ep = cfg->parallel.ep,
                      .recompute = (int)cfg->train.recompute};
    if (parse_layout(spec, l, err)) return -1;
    if (world % l->pp) return moe_err(err, "--layout: pp = %d does not divide the %d devices", l->pp, world);
    int dp = world / l->pp;
    if (!l->micro_per_rank && cfg->train.micro_batch % dp)
        return moe_err(err, "--layout: train.micro_batch = %d sequences do not split over dp = %d ranks: give "
                       "micro=N (sequences per rank)", cfg->train.micro_batch, dp);
    if (!l->micro_per_rank) l->micro_per_rank = cfg->train.micro_batch / dp;
    plan_derive(l, cfg, world);
    if (!l->micro_batches)
        return moe_err(err, "--layout: micro=%d sequences on each of %d ranks do not divide the global batch of %d "
                       "sequences", l->micro_per_rank, dp, global_sequences(cfg));
    return 0;
}

// ---------------------------------------------------------------- the search

typedef struct {
    const Config *cfg;
    int world;
    const PlanMachine *m;
    PlanCandidate *out;
    size_t n, cap;
    PlanStats *stats;
} Search;

static void evaluate(Search *s, PlanLayout l) {
    MoeErr err;
    Config c = *s->cfg;
    plan_derive(&l, s->cfg, s->world);
    s->stats->tried++;
    plan_apply(&c, &l);
    PlanCandidate cand = {.lay = l};
    if (!l.micro_batches || config_validate(&c, err) || plan_evaluate(&c, s->world, s->m, true, &cand.res, err)) {
        s->stats->invalid++;
        return;
    }
    s->stats->too_large += !cand.res.fits;
    if (s->n == s->cap) s->out = moe_realloc(s->out, (s->cap = 2 * s->cap + 16) * sizeof *s->out);
    s->out[s->n++] = cand;
}

// Sets knob k and the ones after it in every combination.
static void enumerate(Search *s, size_t k, PlanLayout l) {
    if (k == N_KNOBS) {
        evaluate(s, l);
        return;
    }
    int values[PLAN_MAX_VALUES];
    plan_derive(&l, s->cfg, s->world);
    int n = KNOBS[k].values(s->cfg, s->world, &l, values);
    for (int i = 0; i < n; i++) {
        *knob_field(&l, &KNOBS[k]) = values[i];
        enumerate(s, k + 1, l);
    }
}

static int by_fit_then_time(const void *a, const void *b) {
    const PlanCandidate *x = a, *y = b;
    if (x->res.fits != y->res.fits) return x->res.fits ? -1 : 1;
    if (!x->res.fits) return (x->res.memory_bytes > y->res.memory_bytes) - (x->res.memory_bytes < y->res.memory_bytes);
    return (x->res.step_s > y->res.step_s) - (x->res.step_s < y->res.step_s);
}

void plan_search(const Config *cfg, int world, const PlanMachine *m, PlanCandidate **out, size_t *n,
                 PlanStats *stats) {
    memset(stats, 0, sizeof *stats);
    Search s = {.cfg = cfg, .world = world, .m = m, .stats = stats};
    enumerate(&s, 0, (PlanLayout){.pp = 1, .v = 1, .ep = 1, .micro_per_rank = 1, .recompute = RECOMPUTE_NONE});
    qsort(s.out, s.n, sizeof *s.out, by_fit_then_time);
    *out = s.out, *n = s.n;
}
