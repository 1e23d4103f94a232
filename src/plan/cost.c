// The predicted step of one layout (see cost.h).
#include "plan/cost.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dist/comm_cost.h"
#include "dist/pipeline.h"
#include "plan/pipe_time.h"
#include "train/setup.h"

const char *const PLAN_COMM_NAMES[PLAN_N_COMM] = {"dp reduce-scatter", "dp all-gather", "all-reduce",
                                                  "pp transfers", "expert exchange"};

// The efficiency assumed for a NIC when no calibration measured one (docs/SCALING.md).
#define PLAN_NIC_EFFICIENCY 0.8

int plan_machine_init(PlanMachine *m, const PlanDevice *dev, const Calib *c, int per_node, double intra_gbps,
                      double inter_gbps, MoeErr err) {
    const PlanDevice *cal = plan_device_find(c->device);
    bool same = !strcmp(dev->name, c->device);
    if (!same && (!cal || !cal->bf16_tflops || !dev->bf16_tflops))
        return moe_err(err, "the calibration is for '%s'; it cannot be carried to '%s' by datasheet ratios (use a "
                       "calibration measured on %s: moe bench --calibrate)", c->device, dev->name, dev->name);
    *m = (PlanMachine){.dev = dev, .calib = c, .per_node = per_node, .matrix_scale = 1, .memory_scale = 1};
    if (!same) m->matrix_scale = dev->bf16_tflops / cal->bf16_tflops, m->memory_scale = dev->hbm_gbps / cal->hbm_gbps;
    double link_scale = same || !cal->nvlink_gbps ? 1 : dev->nvlink_gbps / cal->nvlink_gbps;
    m->intra_bps = intra_gbps > 0 ? intra_gbps * 1e9 : c->collective_bps * link_scale;
    m->exchange_bps = intra_gbps > 0 ? intra_gbps * 1e9 : c->exchange_bps * link_scale;
    m->p2p_bps = intra_gbps > 0 ? intra_gbps * 1e9 : c->p2p_bps * link_scale;
    m->inter_bps = inter_gbps > 0 ? inter_gbps * 1e9 : dev->nic_gbps * 1e9 * PLAN_NIC_EFFICIENCY;
    m->latency_s = c->latency_s, m->latency_inter_s = 2 * c->latency_s;
    return 0;
}

int plan_machine_check(const PlanMachine *m, int world, MoeErr err) {
    if (world > m->per_node && !(m->inter_bps > 0))
        return moe_err(err, "%d devices span nodes of %d, but no network bandwidth is known for '%s': give "
                       "--inter-bw GB/s", world, m->per_node, m->dev->name);
    if (world > 1 && !m->calib->has_comm)
        return moe_err(err, "the calibration has no communication rates, so %d ranks cannot be planned (measure "
                       "them on several ranks: mpirun -np 2 moe bench --calibrate OUT.json)", world);
    return 0;
}

// ---------------------------------------------------------------- one stage on the costing backend

enum { GROUP_WORLD, GROUP_DP, GROUP_EP, GROUP_EDP, N_GROUPS };

// Prices the calls of one rank's model as they are made.
typedef struct {
    const PlanMachine *mach;
    Comm groups[N_GROUPS];
    CommCost cost;
    int first[N_GROUPS], stride[N_GROUPS]; // global rank of member i: first + i stride
    int rank;
    bool overlap;                           // gradient reduction overlapped with the backward
    double total;                           // seconds so far
    double kernel[KERNEL_N_FAMILIES], comm[PLAN_N_COMM];
    CostSink sink;
} Coster;

// A kernel takes its work at its family's rate plus the fixed cost of a call; a matrix kernel at
// least the time its bytes take at the device's copy rate (the roofline: a thin product such as
// the router's is bound by reading its input).
static void charge_kernel(void *ctx, KernelFamily f, double work, double size, double bytes) {
    Coster *c = ctx;
    const PlanMachine *m = c->mach;
    bool matrix = kernel_family_is_matrix(f);
    double t = work / (calib_rate(m->calib, f, size) * (matrix ? m->matrix_scale : m->memory_scale));
    double floor = matrix ? bytes / (m->calib->copy_bps * m->memory_scale) : 0;
    t = (t > floor ? t : floor) + m->calib->kernel_overhead_s;
    c->kernel[f] += t, c->total += t;
}

static int node_of(const Coster *c, int rank) { return c->mach->per_node > 0 ? rank / c->mach->per_node : 0; }

// Members of group g that share this rank's node (itself included).
static int same_node(const Coster *c, int g) {
    int n = 0;
    for (int i = 0; i < c->groups[g].size; i++) n += node_of(c, c->first[g] + i * c->stride[g]) == node_of(c, c->rank);
    return n;
}

static void charge_comm(Coster *c, PlanComm kind, double t) { c->comm[kind] += t, c->total += t; }

// Rows leaving this rank toward its expert-parallel peers (an even share to each): NVLink for those
// on its node, the network for the others, both at once.
static double exchange_seconds(const Coster *c, double bytes) {
    int ep = c->groups[GROUP_EP].size, near = same_node(c, GROUP_EP) - 1, far = ep - 1 - near;
    double per_peer = bytes / ep;
    double t_near = near * per_peer / c->mach->exchange_bps, t_far = far ? far * per_peer / c->mach->inter_bps : 0;
    return t_near > t_far ? t_near : t_far;
}

static void charge_push(void *ctx, double bytes) {
    Coster *c = ctx;
    charge_comm(c, PLAN_COMM_EXCHANGE, exchange_seconds(c, bytes));
}

static int group_index(const Coster *c, const Comm *g) {
    for (int i = 0; i < N_GROUPS; i++)
        if (g == &c->groups[i]) return i;
    MOE_ASSERT(0);
    return 0;
}

// Alpha-beta: latency per step of a tree (log2 p steps), bandwidth of a ring ((p - 1) / p of the
// bytes through each rank's link); a group that spans nodes runs at the network's rate.
static void charge_collective(void *ctx, const Comm *g, CommCostKind kind, CommType t, double bytes) {
    Coster *c = ctx;
    int i = group_index(c, g), p = g->size;
    if (p == 1) return;
    bool spans = same_node(c, i) < p;
    double bw = spans ? c->mach->inter_bps : c->mach->intra_bps;
    double lat = (spans ? c->mach->latency_inter_s : c->mach->latency_s) * ceil(log2((double)p) + 1);
    double ring = (double)(p - 1) / p * bytes / bw, sec = lat;
    PlanComm what = PLAN_COMM_ALL_REDUCE;
    switch (kind) {
    case COMM_COST_ALL_REDUCE: sec += 2 * ring; break;
    case COMM_COST_REDUCE_SCATTER:
        sec += ring, what = PLAN_COMM_DP_REDUCE_SCATTER;
        if (c->overlap) sec *= 1 - c->mach->calib->grad_reduce_hidden;
        break;
    case COMM_COST_ALL_GATHER: sec += ring, what = i == GROUP_EP ? PLAN_COMM_EXCHANGE : PLAN_COMM_DP_ALL_GATHER; break;
    case COMM_COST_ALL_TO_ALL: sec += exchange_seconds(c, bytes * p / (p - 1)), what = PLAN_COMM_EXCHANGE; break;
    case COMM_COST_P2P: sec = lat + bytes / (spans ? bw : c->mach->p2p_bps), what = PLAN_COMM_PP; break;
    case COMM_COST_SYNC: what = i == GROUP_EP ? PLAN_COMM_EXCHANGE : PLAN_COMM_ALL_REDUCE; break;
    }
    charge_comm(c, what, sec);
}

static void coster_reset(Coster *c) {
    c->total = 0;
    memset(c->kernel, 0, sizeof c->kernel), memset(c->comm, 0, sizeof c->comm);
}

// Member layout of each group of a rank (layout.h: rank = stage dp + edp_rank ep + ep_rank).
static void coster_groups(Coster *c, const Layout *l) {
    int stage0 = l->stage * l->dp;
    int first[N_GROUPS] = {0, stage0, stage0 + l->edp_rank * l->ep, stage0 + l->ep_rank};
    int stride[N_GROUPS] = {1, 1, 1, l->ep};
    memcpy(c->first, first, sizeof first), memcpy(c->stride, stride, sizeof stride);
    c->rank = l->rank;
}

// One stage's model on the costing backend and what its work costs: a micro-batch's forward and
// backward, the step's optimizer.
typedef struct {
    Coster c;
    Parallel par;
    Model m;
    Optimizer o;
    double fwd[PIPE_MAX_CHUNKS], bwd[PIPE_MAX_CHUNKS], optimizer, plan;
    double fwd_kernel[KERNEL_N_FAMILIES], bwd_kernel[KERNEL_N_FAMILIES], opt_kernel[KERNEL_N_FAMILIES];
    double fwd_comm[PLAN_N_COMM], bwd_comm[PLAN_N_COMM], opt_comm[PLAN_N_COMM];
    int multi_rank_groups;
} StageCost;

static double run_phase(Coster *c, double *kernel, double *comm) {
    memcpy(kernel, c->kernel, sizeof c->kernel), memcpy(comm, c->comm, sizeof c->comm);
    double t = c->total;
    coster_reset(c);
    return t;
}

static double stage_memory(const PlanMachine *m, const StageCost *sc) {
    return sc->plan + m->calib->runtime_bytes + sc->multi_rank_groups * m->calib->communicator_bytes;
}

static const Ops *stage_ops(StageCost *sc) {
    return ops_costing(!strcmp(sc->c.mach->calib->backend, "cuda"), &sc->c.sink);
}

// Sizes the model of stage `rank` (sc must stay where it is: its model points into it).
static void stage_open(const Config *cfg, int world, int rank, const PlanMachine *mach, StageCost *sc) {
    Coster *c = &sc->c;
    *c = (Coster){.mach = mach, .overlap = cfg->parallel.overlap_grad_reduce};
    c->cost = (CommCost){charge_collective, c};
    c->sink = (CostSink){.kernel = charge_kernel, .push_rows = charge_push, .ctx = c};
    const Ops *ops = stage_ops(sc);
    setup_plan_rank(cfg, world, rank, ops, &sc->par, c->groups, &sc->m, &sc->o);
    sc->plan = setup_memory_of(&sc->m, &sc->o).total;
    coster_groups(c, &sc->par.lay);
    for (int i = 0; i < N_GROUPS; i++) {
        comm_costing(&c->groups[i], &c->cost, ops->act_size);
        sc->multi_rank_groups += c->groups[i].size > 1;
    }
}

// Prices the stage's work, as the trainer runs it around the schedule.
static void stage_price(const Config *cfg, StageCost *sc) {
    Coster *c = &sc->c;
    Model *m = &sc->m;
    coster_reset(c);
    c->sink.routed_rows = model_n_moe_layers(&cfg->model) ? model_routed_rows(&cfg->model, m->B * m->S) : 0;
    c->sink.local_experts = (size_t)m->n_experts_local, c->sink.experts = (size_t)cfg->model.n_experts;
    for (int k = 0; k < m->n_chunks; k++) { // the chunks' kernels and calls add up
        ForwardArgs a = {.B = m->B, .S = m->S, .chunk = k, .train = true, .metrics = m->metrics_scratch};
        double seconds = c->total;
        model_forward(m, &a);
        sc->fwd[k] = c->total - seconds;
    }
    run_phase(c, sc->fwd_kernel, sc->fwd_comm);
    for (int k = m->n_chunks - 1; k >= 0; k--) {
        ForwardArgs a = {.B = m->B, .S = m->S, .chunk = k, .train = true, .metrics = m->metrics_scratch};
        double seconds = c->total;
        model_backward(m, &a);
        sc->bwd[k] = c->total - seconds;
    }
    run_phase(c, sc->bwd_kernel, sc->bwd_comm);
    Comm *w = sc->par.world;
    w->ops->all_reduce_sum(w, m->metrics_scratch, model_metrics_len(&cfg->model), COMM_F32);
    optim_step(&sc->o, m, &cfg->train, m->metrics_scratch);
    sc->optimizer = run_phase(c, sc->opt_kernel, sc->opt_comm);
}

// ---------------------------------------------------------------- the whole step

// One pipeline transfer between stage `stage` and the next (the last stage's: to the first).
static double transfer_seconds(const PlanMachine *m, const Config *cfg, const Layout *l, int stage) {
    double bytes = (double)l->micro_per_rank * cfg->train.seq_len * cfg->model.d_model *
                   (strcmp(m->calib->backend, "cuda") ? 4 : 2);
    int a = stage * l->dp, b = (stage + 1) % l->pp * l->dp; // dp rank 0 of both stages (the others alike)
    bool spans = m->per_node > 0 && a / m->per_node != b / m->per_node;
    return spans ? m->latency_inter_s + bytes / m->inter_bps : m->latency_s + bytes / m->p2p_bps;
}

static void add_scaled(double *dst, const double *src, int n, double k) {
    for (int i = 0; i < n; i++) dst[i] += k * src[i];
}

// The result of the stage whose pipeline work and optimizer take longest.
static void fill_result(const Config *cfg, int world, const PlanMachine *m, const StageCost *sc,
                        const double *busy, const double *transfer, double makespan, PlanResult *r) {
    int pp = cfg->parallel.pp, M = cfg->train.micro_batches, worst = 0;
    double opt = 0;
    for (int s = 0; s < pp; s++) {
        opt = sc[s].optimizer > opt ? sc[s].optimizer : opt;
        if (busy[s] + sc[s].optimizer > busy[worst] + sc[worst].optimizer) worst = s;
    }
    const StageCost *w = &sc[worst];
    r->step_s = makespan + opt;
    r->bubble = makespan > 0 ? 1 - busy[worst] / makespan : 0;
    r->ideal_bubble = pipeline_bubble_fraction(pp, cfg->parallel.virtual_stages, M);
    add_scaled(r->kernel_s, w->fwd_kernel, KERNEL_N_FAMILIES, M);
    add_scaled(r->kernel_s, w->bwd_kernel, KERNEL_N_FAMILIES, M);
    add_scaled(r->kernel_s, w->opt_kernel, KERNEL_N_FAMILIES, 1);
    add_scaled(r->comm_s, w->fwd_comm, PLAN_N_COMM, M);
    add_scaled(r->comm_s, w->bwd_comm, PLAN_N_COMM, M);
    add_scaled(r->comm_s, w->opt_comm, PLAN_N_COMM, 1);
    r->comm_s[PLAN_COMM_PP] += transfer[worst];
    double tokens = (double)M * cfg->train.micro_batch * cfg->train.seq_len;
    r->tokens_per_s = tokens / r->step_s / world;
    r->tflops = 3 * model_forward_flops_per_token(&cfg->model, (size_t)cfg->train.seq_len) * r->tokens_per_s / 1e12;
}

// The largest rank's memory; whether it fits.
static bool fill_memory(const PlanMachine *m, const StageCost *sc, int n, PlanResult *r) {
    for (int s = 0; s < n; s++)
        if (stage_memory(m, &sc[s]) > r->memory_bytes) r->memory_bytes = stage_memory(m, &sc[s]), r->plan_bytes = sc[s].plan;
    return r->fits = r->memory_bytes <= m->dev->memory_gib * 1073741824.0;
}

int plan_evaluate(const Config *cfg, int world, const PlanMachine *m, bool fitting_only, PlanResult *r, MoeErr err) {
    memset(r, 0, sizeof *r);
    ParallelSpec spec = setup_parallel_spec(cfg);
    Layout lay;
    if (layout_init(&lay, world, 0, &spec.layout, err)) return -1;
    if (plan_machine_check(m, world, err)) return -1;
    int pp = lay.pp;
    StageCost *sc = moe_calloc((size_t)pp, sizeof *sc);
    PipeStageTime *t = moe_calloc((size_t)pp, sizeof *t);
    double *busy = moe_calloc(2 * (size_t)pp, sizeof(double)), *transfer = busy + pp;
    for (int s = 0; s < pp; s++) stage_open(cfg, world, s * lay.dp, m, &sc[s]);
    if (fill_memory(m, sc, pp, r) || !fitting_only) {
        for (int s = 0; s < pp; s++) {
            stage_price(cfg, &sc[s]);
            memcpy(t[s].fwd, sc[s].fwd, sizeof t[s].fwd), memcpy(t[s].bwd, sc[s].bwd, sizeof t[s].bwd);
            t[s].link_next = pp > 1 ? transfer_seconds(m, cfg, &lay, s) : 0;
        }
        double makespan = pipe_time_run(pp, lay.v, cfg->train.micro_batches, t, busy, transfer);
        fill_result(cfg, world, m, sc, busy, transfer, makespan, r);
    }
    for (int s = 0; s < pp; s++) model_free(&sc[s].m);
    free(sc), free(t), free(busy);
    return 0;
}
