// The training loop (see train.h). One step runs the stage's 1F1B pipeline schedule over the
// step's micro-batches (forward, backward and the transfers between stages; a single stage is
// the plain forward/backward loop), sums the metrics over all ranks, then runs one optimizer
// update. The host queues a step's work, then (train.launch_ahead) the next step's, and only then
// waits for the first one's metrics. Only rank 0 prints and writes logs.
#include "train.h"

#include <inttypes.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "dist/comm_nccl.h"
#include "dist/launch_env.h"
#include "dist/pipeline.h"
#include "dist/watchdog.h"
#include "ops/profile_ops.h"
#include "io/fsutil.h"
#include "metrics.h"
#include "optim.h"
#include "setup.h"

// When the latest steps of a run began (their evaluations and checkpoints included): the pace for
// the ETA on the progress line.
#define CLOCK_STEPS 32
typedef struct {
    double began[CLOCK_STEPS]; // ring buffer
    int64_t n;                 // steps begun
} StepClock;

static void clock_step_begins(StepClock *c, double now) { c->began[c->n++ % CLOCK_STEPS] = now; }

// Seconds to the run's end at the pace of the steps in the window, the current one included (at
// least one has begun).
static double clock_eta(const StepClock *c, double now, int64_t remaining) {
    int64_t k = c->n < CLOCK_STEPS ? c->n : CLOCK_STEPS;
    return (now - c->began[(c->n - k) % CLOCK_STEPS]) / (double)k * (double)remaining;
}

static const char *const STARTUP_NAMES[STARTUP_N] = {"backend", "config + plan", "allocation", "init",
                                                     "first step"};
static const char *const STARTUP_KEYS[STARTUP_N] = {"backend_s", "config_plan_s", "allocation_s", "init_s",
                                                    "first_step_s"};

// A step on its way: the host memory its queued uploads read and its metrics come back to (two
// slots: step N + 1 is queued while step N's metrics are still on their way), and events around
// its work on the backend.
typedef struct {
    int32_t *batches;   // (micro_batches, 2 B S) host (Ops.host_alloc): each micro-batch's inputs, targets
    StepInfo *info;     // host (Ops.host_alloc)
    float *metrics;     // (model_metrics_len) host (Ops.host_alloc): the step's totals once `done` is passed
    uint64_t *fp8_counts; // (MODEL_FP8_COUNTS) host (Ops.host_alloc): the same for the FP8 counters
    void *began, *done; // events: before its work; after its metrics' download
    double comm_wait;   // seconds of the step spent in pipeline transfers
} StepSlot;

typedef struct {
    Config cfg;
    Parallel par;
    Model model;
    Optimizer opt;
    Dataset train, val;
    bool has_val, root;
    TrainState state;
    void *metrics;        // f32 (model_metrics_len) backend accumulators of the step queued last
    const float *metrics_host; // the latest finished step's metrics (in its slot)
    const uint64_t *fp8_counts_host; // and its FP8 counters (NULL: not in FP8)
    StepSlot slot[2];     // step s in slot[s % 2]
    int64_t queued;       // the latest step queued (state.step, or one more while a step runs ahead)
    StepTimes times;      // where the steps' time went, summed since the last reset (but whole steps)
    size_t nccl_calls;    // NCCL operations of the latest step that queued its work itself (not a replay)
    double device_s;      // the latest finished step's work on the backend, start to end
    int32_t *seqs;        // (B, S + 1) host batch of this rank
    PipeAction *sched;    // this stage's actions for one step
    size_t n_sched;
    double comm_wait;     // seconds of the step being queued spent in pipeline transfers
    bool synthetic;       // benchmark: random token ids, no files written
    Comm *host, *world;   // the ranks as started, and as this run talks (an NCCL world on GPUs)
    int64_t first_step;   // the step this process started from
    uint64_t first_position; // and its data position
    int64_t last_step;    // the step this process stops at (train.steps, or --stop-at)
    double start;         // when its training loop began
    StepClock clock;      // rank 0: the pace of the latest steps
    double final_loss, final_ce; // rank 0: the loss and cross-entropy of the latest step
    void *graph;          // the step's work recorded once for replay (backends that record)
    double startup[STARTUP_N]; // when each phase of the startup ended, seconds since the program was loaded
    double capture_s;     // seconds recording and instantiating the graph took (0 once reported)
    MetricsLog log;       // metrics.jsonl (rank 0)
    DeviceMonitor *clocks; // rank 0 of a run (not a benchmark) on a GPU: its clock and power, step by step
    Watchdog *watchdog;   // several ranks: ends this one when its peers stop answering
} Trainer;

static void read_batch(Dataset *ds, uint64_t first, size_t count, int32_t *seqs, size_t S) {
    MoeErr err;
    for (size_t b = 0; b < count; b++)
        if (dataset_read(ds, first + b, seqs + b * (S + 1), err)) moe_fatal("%s", err);
}

// Index of this rank's first sequence of micro-batch `micro` within a batch of micro-batches.
static uint64_t first_sequence(const Model *m, int micro) {
    const Layout *l = &m->par->lay;
    return (uint64_t)micro * (uint64_t)(l->micro_per_rank * l->dp) + (uint64_t)l->dp_rank * (uint64_t)l->micro_per_rank;
}

static size_t stage_elems(const Model *m) { return m->B * m->S * (size_t)m->cfg.d_model; }
// The rank of this data-parallel position on stage `stage`.
static int stage_rank(const Model *m, int stage) { return layout_rank_of(&m->par->lay, stage, m->par->lay.dp_rank); }

// Forward-only pass of one micro-batch through the pipeline (evaluation): each chunk in turn, the
// virtual stages one after another.
static void pipeline_forward(Model *m, ForwardArgs *a) {
    Comm *w = m->par->world;
    const Layout *l = &m->par->lay;
    for (int c = 0; c < m->n_chunks; c++) {
        const ModelChunk *k = &m->chunk[c];
        a->chunk = c;
        int prev = (l->stage + l->pp - 1) % l->pp, next = (l->stage + 1) % l->pp;
        if (!k->first) w->ops->recv(w, model_stage_input(m, c, a->slot), stage_elems(m), COMM_ACT, stage_rank(m, prev));
        model_forward(m, a);
        if (!k->last) w->ops->send(w, model_stage_output(m, c, a->slot), stage_elems(m), COMM_ACT, stage_rank(m, next));
    }
}

double eval_loss(Model *m, Dataset *ds, size_t max_seqs, size_t *evaluated) {
    const Ops *ops = m->ops;
    size_t B = m->B, S = m->S, MB = B * (size_t)m->par->lay.dp;
    size_t n = (max_seqs < ds->n_seqs ? max_seqs : ds->n_seqs) / MB * MB;
    size_t len = model_metrics_len(&m->cfg);
    int32_t *seqs = moe_malloc(B * (S + 1) * sizeof(int32_t));
    ops->zero(m->metrics_scratch, len * ops->f32_size);
    for (size_t j = 0; j < n / MB; j++) {
        uint64_t first = first_sequence(m, (int)j);
        read_batch(ds, first, B, seqs, S);
        model_set_batch(m, 0, seqs, B, S);
        ForwardArgs a = {.B = B, .S = S, .train = false, .token_base = first * S,
                         .metrics = m->metrics_scratch};
        pipeline_forward(m, &a);
    }
    Comm *w = m->par->world;
    w->ops->all_reduce_sum(w, m->metrics_scratch, 1, COMM_F32); // CE lives on the last stage
    float ce;
    ops->download_f32(&ce, model_f32(m, m->metrics_scratch, METRIC_CE), 1);
    free(seqs);
    *evaluated = n;
    return n ? ce / (double)(n * S) : NAN;
}

int eval_check_data(const Dataset *ds, const Config *cfg, const char *what, MoeErr err) {
    if (ds->n_seqs >= (size_t)cfg->train.micro_batch) return 0;
    return moe_err(err, "%s has %zu sequences of %d tokens, fewer than one micro-batch (train.micro_batch "
                   "= %d), so no loss can be evaluated", what, ds->n_seqs, cfg->train.seq_len,
                   cfg->train.micro_batch);
}

static LossScales loss_scales(const Config *cfg) {
    const ModelConfig *c = &cfg->model;
    double tokens = (double)cfg->train.micro_batches * cfg->train.micro_batch * cfg->train.seq_len;
    double calls = (double)cfg->train.micro_batches * model_n_moe_layers(c);
    return (LossScales){.ce = (float)(1 / tokens), .lm_z = (float)(c->lm_z_coef / tokens),
                        .lb = calls > 0 ? (float)(c->lb_coef / calls) : 0,
                        .z = calls > 0 ? (float)(c->z_coef / calls) : 0};
}

static void unit_begins(void *trainer, int unit) {
    Trainer *t = trainer;
    optim_unit_begins(&t->opt, &t->model, unit);
}

static void grads_ready(void *trainer, int layer) {
    Trainer *t = trainer;
    size_t min_bucket = (size_t)(t->cfg.parallel.grad_bucket_mb * 1e6 / (double)t->model.ops->f32_size);
    optim_grads_ready(&t->opt, &t->model, layer, min_bucket);
}

// The step's last micro-batch hands each layer's finished gradients to the optimizer's reduction
// (each chunk's backward of it comes after every other use of the chunk's layers, the later chunks'
// first, so what is final is always the tail of a parameter region). Each forward lets the pending
// update of the step before finish the weights it is about to read (train.optimizer_overlap).
static ForwardArgs micro_args(Trainer *t, int chunk, int micro) {
    Model *m = &t->model;
    bool last = micro == m->n_micro - 1 && t->cfg.parallel.overlap_grad_reduce;
    return (ForwardArgs){.B = m->B, .S = m->S, .micro = micro, .chunk = chunk,
                         .slot = micro % m->chunk[chunk].n_slots, .train = true,
                         .token_base = first_sequence(m, micro) * m->S, .scales = loss_scales(&t->cfg),
                         .metrics = t->metrics, .layer_done = last ? grads_ready : NULL,
                         .unit_begins = unit_begins, .hook_ctx = t};
}

// Random token ids for benchmarks (the data only decides the routing, like random real text).
static void random_batch(int32_t *seqs, size_t n, uint64_t first, size_t vocab) {
    for (size_t i = 0; i < n; i++) seqs[i] = (int32_t)(rng_hash64(first, i) % vocab);
}

// Sequences of a step over all data-parallel ranks.
static uint64_t step_sequences(const TrainConfig *tc) { return (uint64_t)tc->micro_batches * tc->micro_batch; }

// Host work before a step: its batches read, its StepInfo written, both into the step's slot and
// their uploads queued (behind the work of the step before, which may still be running).
static void stage_step(Trainer *t, StepSlot *s, int64_t step) {
    Model *m = &t->model;
    uint64_t position = t->state.data_position + (uint64_t)(step - 1 - t->state.step) * step_sequences(&t->cfg.train);
    for (int micro = 0; micro < m->n_micro; micro++) {
        uint64_t first = position + first_sequence(m, micro);
        int32_t *split = s->batches + (size_t)micro * 2 * m->B * m->S;
        if (t->synthetic) random_batch(t->seqs, m->B * (m->S + 1), first, (size_t)m->cfg.vocab_size);
        else read_batch(&t->train, first, m->B, t->seqs, m->S);
        model_split_batch(t->seqs, m->B, m->S, split);
        model_queue_batch(m, micro, split, m->B, m->S);
    }
    *s->info = optim_step_info(&t->cfg.train, step);
    m->ops->upload_queued(m->step_info, s->info, sizeof *s->info);
}

// One transfer of an action: the buffer it reads or fills and the rank it faces.
static void run_transfer(Trainer *t, const PipeAction *act, const PipeTransfer *x) {
    Model *m = &t->model;
    Comm *w = m->par->world;
    int slot = x->micro % m->chunk[act->chunk].n_slots, peer = stage_rank(m, x->peer);
    void *buf = x->backward ? (x->send ? m->s.dres : model_stage_grad(m, act->chunk, slot))
                            : (x->send ? model_stage_output(m, act->chunk, slot) : model_stage_input(m, act->chunk, slot));
    if (x->send) w->ops->send(w, buf, stage_elems(m), COMM_ACT, peer);
    else w->ops->recv(w, buf, stage_elems(m), COMM_ACT, peer);
}

// One action of the schedule; transfers are timed to report the time stages spend waiting. The
// two halves of an exchange (one chunk a stage) go to one neighbour at once.
static void run_action(Trainer *t, const PipeAction *act) {
    Model *m = &t->model;
    const Layout *l = &m->par->lay;
    ForwardArgs a = micro_args(t, act->chunk, act->micro);
    if (act->kind == PIPE_FORWARD || act->kind == PIPE_BACKWARD) {
        (act->kind == PIPE_FORWARD ? model_forward : model_backward)(m, &a);
        return;
    }
    PipeTransfer x[2];
    int n = pipeline_transfers(l->pp, l->v, l->stage, *act, x);
    double t0 = moe_time_sec();
    if (n == 1) {
        run_transfer(t, act, &x[0]);
    } else {
        Comm *w = m->par->world;
        int slot = x[1].micro % m->chunk[act->chunk].n_slots;
        void *out = x[0].backward ? m->s.dres : model_stage_output(m, act->chunk, x[0].micro % m->chunk[act->chunk].n_slots);
        void *in = x[1].backward ? model_stage_grad(m, act->chunk, slot) : model_stage_input(m, act->chunk, slot);
        w->ops->sendrecv(w, out, stage_elems(m), stage_rank(m, x[0].peer), in, stage_elems(m), stage_rank(m, x[1].peer),
                         COMM_ACT);
    }
    t->comm_wait += moe_time_sec() - t0;
}

// The device part of a step: nothing here waits for the host, so a backend can record it once
// and replay it. The gradients are zero already: the update of the step before zeroes them once
// it has read them (with train.optimizer_overlap, during this step's forward, before any backward).
static void compute_step(Trainer *t) {
    Model *m = &t->model;
    const Ops *ops = m->ops;
    size_t len = model_metrics_len(&t->cfg.model), nccl = comm_nccl_queued();
    ops->zero(t->metrics, len * ops->f32_size);
    if (m->fp8) ops->zero(m->fp8->counts, MODEL_FP8_COUNTS * sizeof(uint64_t));
    t->comm_wait = 0;
    for (size_t i = 0; i < t->n_sched; i++) run_action(t, &t->sched[i]);
    Comm *w = m->par->world;
    w->ops->all_reduce_sum(w, t->metrics, len, COMM_F32);
    optim_step(&t->opt, m, &t->cfg.train, t->metrics); // its update at once, or pending (train.optimizer_overlap)
    if (m->fp8) w->ops->all_reduce_sum(w, m->fp8->counts, MODEL_FP8_COUNTS, COMM_U64);
    t->nccl_calls = comm_nccl_queued() - nccl;
}

// Recording needs a backend that records and a step without host waits. The first step runs
// directly: it sizes the kernels' scratch buffers and library plans. Expert rows moved by send/recv
// need their counts on the host, so those steps run as queued; so do pipeline stages, whose
// measured transfer wait (a host clock) would mean nothing in a replay. The graph is freed before
// the communicators (trainer_close): NCCL's teardown waits for the work a live graph holds. With
// train.optimizer_overlap the graph holds the update of the step before, so a step that has none
// pending (the first, one after an evaluation or a checkpoint, which flushed it) runs as queued.
static bool replay_step(const Trainer *t, int64_t step) {
    const Model *m = &t->model;
    bool host_planned = m->par->ep->size > 1 && !m->xchg.direct;
    bool as_recorded = optim_pending(&t->opt, m) == t->opt.overlap;
    return m->ops->capture_begin && !host_planned && t->par.lay.pp == 1 && step > t->first_step && as_recorded;
}

static void startup_done(Trainer *t, StartupPhase p) { t->startup[p] = moe_process_seconds(); }

// The device part of step `step`: queued as it runs, or recorded (once) and replayed.
static void launch_step(Trainer *t, int64_t step) {
    const Ops *ops = t->model.ops;
    if (!replay_step(t, step)) {
        compute_step(t);
        return;
    }
    if (!t->graph) {
        double t0 = moe_time_sec();
        ops->capture_begin();
        compute_step(t);
        t->graph = ops->capture_end();
        t->capture_s = moe_time_sec() - t0;
    }
    ops->graph_launch(t->graph);
}

// Queues the step after the latest queued one: its host part, its work, its metrics' download.
static void queue_step(Trainer *t) {
    const Ops *ops = t->model.ops;
    int64_t step = ++t->queued;
    StepSlot *s = &t->slot[step % 2];
    double t0 = moe_time_sec();
    stage_step(t, s, step);
    double t1 = moe_time_sec();
    ops->event_record(s->began);
    launch_step(t, step);
    s->comm_wait = t->comm_wait;
    ops->download_f32_queued(s->metrics, t->metrics, model_metrics_len(&t->cfg.model));
    if (t->model.fp8) ops->download_queued(s->fp8_counts, t->model.fp8->counts, MODEL_FP8_COUNTS * sizeof(uint64_t));
    ops->event_record(s->done);
    t->times.stage_ms += 1e3 * (t1 - t0);
    t->times.launch_ms += 1e3 * (moe_time_sec() - t1);
}

// Waits for the oldest queued step's metrics: it becomes the trainer's state.
static void finish_step(Trainer *t) {
    const Ops *ops = t->model.ops;
    int64_t step = t->state.step + 1;
    StepSlot *s = &t->slot[step % 2];
    double t0 = moe_time_sec();
    ops->event_wait(s->done);
    t->times.wait_ms += 1e3 * (moe_time_sec() - t0);
    t->device_s = ops->event_elapsed_ms(s->began, s->done) / 1e3;
    t->times.device_ms += 1e3 * t->device_s;
    t->metrics_host = s->metrics;
    t->fp8_counts_host = t->model.fp8 ? s->fp8_counts : NULL;
    t->state.step = step;
    t->state.data_position += step_sequences(&t->cfg.train);
    if (step == t->first_step) startup_done(t, STARTUP_STEP);
}

// One optimizer step; leaves its metrics (totals over all ranks) on the host. With `ahead`, the
// step after it is queued before they are waited for, unless that step records the graph: its
// recording (seconds) is its own, in the startup and the capture's report.
static void train_step(Trainer *t, bool ahead) {
    if (t->queued == t->state.step) queue_step(t);
    if (ahead && (t->graph || !replay_step(t, t->queued + 1))) queue_step(t);
    finish_step(t);
}

static void save_checkpoint(Trainer *t) {
    MoeErr err;
    optim_flush(&t->opt, &t->model);
    if (ckpt_save(t->cfg.train.out, &t->model, &t->opt, &t->cfg, &t->state,
                  t->cfg.train.keep_ckpts, err))
        moe_fatal("checkpoint at step %" PRId64 " not written: %s (the previous checkpoint is intact)",
                  t->state.step, err);
    if (t->root) printf("saved %s/step-%" PRId64 "\n", t->cfg.train.out, t->state.step);
}

// Every record reaches metrics.jsonl or the run stops: a full disk must not lose metrics silently.
static void log_record(Trainer *t, json_t *record) {
    MoeErr err;
    if (metrics_log_write(&t->log, record, err))
        moe_fatal("step %" PRId64 ": %s; stopping (the checkpoints so far are whole: make room, then run "
                  "again to resume)", t->state.step, err);
}

static void run_eval(Trainer *t) {
    size_t max_seqs = (size_t)t->cfg.train.eval_batches * t->cfg.train.micro_batch, n;
    optim_flush(&t->opt, &t->model);
    double loss = eval_loss(&t->model, &t->val, max_seqs, &n);
    if (!t->root) return;
    printf("step %5" PRId64 " | val loss %.4f\n", t->state.step, loss);
    log_record(t, metrics_val_record(t->state.step, loss, n));
    if (!isfinite(loss)) moe_fatal("step %" PRId64 ": validation loss is %g; stopping", t->state.step, loss);
}

void train_report_startup(const double end[STARTUP_N], int64_t step, json_t *record) {
    json_t *o = json_object();
    printf("startup | %.1f s from the start of the process to the end of step %" PRId64 ":", end[STARTUP_STEP], step);
    for (int p = 0; p < STARTUP_N; p++) {
        double s = end[p] - (p ? end[p - 1] : 0);
        printf("%s %s %.2f s", p ? "," : "", STARTUP_NAMES[p], s);
        json_object_set_new(o, STARTUP_KEYS[p], json_real(s));
    }
    printf("\n");
    json_object_set_new(o, "total_s", json_real(end[STARTUP_STEP]));
    json_object_set_new(record, "startup", o);
}

// The step that recorded the graph: how long recording and instantiating it took.
static void report_capture(Trainer *t, json_t *record) {
    printf("graph | step %" PRId64 "'s work recorded for replay in %.2f s\n", t->state.step, t->capture_s);
    json_object_set_new(record, "graph_capture_s", json_real(t->capture_s));
    t->capture_s = 0;
}

static void report_step(Trainer *t, double seconds) {
    const TrainConfig *tc = &t->cfg.train;
    StepReport r = {.step = t->state.step, .steps = tc->steps};
    size_t T = (size_t)tc->micro_batch * tc->seq_len;
    report_build(&r, &t->cfg.model, t->metrics_host, tc->micro_batches, T);
    r.fp8 = t->fp8_counts_host;
    r.lr = optim_lr(tc, t->state.step);
    r.tokens = (double)t->state.data_position * tc->seq_len;
    r.tokens_per_sec = (double)tc->micro_batches * T / seconds;
    double now = moe_time_sec();
    r.elapsed_s = now - t->start;
    r.eta_s = clock_eta(&t->clock, now, t->last_step - t->state.step);
    r.pipeline_wait = t->par.lay.pp > 1 ? t->slot[t->state.step % 2].comm_wait / seconds : 0;
    ClockSummary clocks;
    device_monitor_take(t->clocks, &clocks); // the readings since the step before's report
    r.clocks = &clocks;
    if (!report_finite(&r)) {
        char last[4200] = "none";
        ckpt_latest(tc->out, last, sizeof last);
        moe_fatal("step %" PRId64 ": loss %g, gradient norm %g: training diverged; stopping (last good "
                  "checkpoint: %s; try a lower train.lr)", r.step, r.loss, r.grad_norm, last);
    }
    if (r.step % tc->log_every == 0 || r.step == tc->steps || r.step == 1) report_print(&r, stdout);
    json_t *record = report_to_json(&r);
    if (r.step == t->first_step) train_report_startup(t->startup, r.step, record);
    if (t->capture_s > 0) report_capture(t, record);
    log_record(t, record);
    t->final_loss = r.loss, t->final_ce = r.ce;
    report_free(&r);
}

static void write_run_config(const Trainer *t) {
    MoeErr err;
    char path[CONFIG_PATH_LEN + 16];
    snprintf(path, sizeof path, "%s/config.json", t->cfg.train.out);
    json_t *j = config_to_json(&t->cfg);
    if (fs_write_json_atomic(path, j, err)) moe_fatal("train.out: %s", err);
    json_decref(j);
}

static void open_log(Trainer *t, bool resume) {
    MoeErr err;
    if (metrics_log_open(&t->log, t->cfg.train.out, resume, t->state.step, err)) moe_fatal("%s", err);
    if (t->log.dropped)
        printf("%s: dropped %zu lines after step %" PRId64 " (steps this run redoes, or a line cut short)\n",
               t->log.path, t->log.dropped, t->state.step);
}

// GPU ranks talk through NCCL on the backend's stream: a world of its own, bootstrapped from the
// host one (or the launcher).
static Comm *device_world(const Config *cfg, const Ops *ops, Comm *host) {
    int launched = 0;
    bool gpu = !strcmp(cfg->train.device, "cuda");
    if (!gpu && comm_launch_rank(&launched) >= 0)
        moe_fatal("moe train --nproc starts GPU ranks (train.device=cuda); for CPU ranks use mpirun");
    return gpu && (host->size > 1 || comm_launch_rank(&launched) >= 0) ? comm_nccl_world(host, ops->stream) : host;
}

// The training and validation data (none for a benchmark).
static void open_data(Trainer *t) {
    const Config *cfg = &t->cfg;
    MoeErr err;
    char what[CONFIG_PATH_LEN + 16];
    if (t->synthetic) return;
    setup_dataset(&t->train, cfg, cfg->data.train, true);
    t->has_val = cfg->data.val[0] && cfg->train.eval_every > 0;
    if (!t->has_val) return;
    snprintf(what, sizeof what, "data.val %s", cfg->data.val);
    setup_dataset(&t->val, cfg, cfg->data.val, false);
    if (eval_check_data(&t->val, cfg, what, err))
        moe_fatal("%s: use more validation data, or train.eval_every=0 for none", err);
}

static void write_files(FILE *f, const char *what, const Dataset *ds) {
    for (size_t i = 0; i < ds->n_files; i++)
        fprintf(f, "%s file %zu = %s (%zu bytes)\n", what, i, ds->files[i].path, ds->files[i].map_bytes);
}

// Ranks started with different settings would size different buffers and corrupt each other's
// memory in their first collective: before any, every rank must hold rank 0's config, data files
// (names and sizes), checkpoint and stop step.
static void check_same_run(const Trainer *t, Comm *host, const char *resume, int64_t stop_at) {
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    MOE_CHECK(f, "out of host memory comparing the ranks' settings");
    config_write_text(&t->cfg, f);
    write_files(f, "data.train", &t->train);
    if (t->has_val) write_files(f, "data.val", &t->val);
    fprintf(f, "resumed from = %s\n--stop-at = %" PRId64 "\n", resume ? resume : "(none)", stop_at);
    fclose(f);
    MoeErr err;
    if (comm_agree_text(host, text, err))
        moe_fatal("the ranks were started with different settings: %s; start every rank with the same "
                  "command line, config and data", err);
    free(text);
}

// A launcher that meant more ranks than the world has started processes that cannot see each other
// (srun without MPI's process-management support starts singletons that would each train alone).
static void check_launch(const Comm *world) {
    LaunchEnv e;
    comm_launch_env(&e);
    if (e.world > 1 && world->size != e.world)
        moe_fatal("%s started %d processes, but they formed a world of %d rank(s): each would train alone. Build "
                  "with MPI (mpicc installed) and, under Slurm, start with srun --mpi=pmix (scripts/slurm/moe.sbatch)",
                  e.launcher, e.world, world->size);
}

static void slot_open(StepSlot *s, const Model *m, size_t n_metrics) {
    const Ops *ops = m->ops;
    s->batches = ops->host_alloc((size_t)m->n_micro * 2 * m->B * m->S * sizeof(int32_t));
    s->info = ops->host_alloc(sizeof(StepInfo));
    s->metrics = ops->host_alloc(n_metrics * sizeof(float));
    s->fp8_counts = ops->host_alloc(MODEL_FP8_COUNTS * sizeof(uint64_t));
    s->began = ops->event_create(), s->done = ops->event_create();
}

static void slot_close(StepSlot *s, const Ops *ops) {
    ops->host_free(s->batches), ops->host_free(s->info), ops->host_free(s->metrics), ops->host_free(s->fp8_counts);
    ops->event_free(s->began), ops->event_free(s->done);
}

static void trainer_open(Trainer *t, const Config *cfg, Comm *host, const char *resume, int64_t stop_at,
                         bool synthetic) {
    MoeErr err;
    memset(t, 0, sizeof *t);
    t->cfg = *cfg;
    t->synthetic = synthetic;
    const Ops *ops = setup_backend(cfg); // picks this process's GPU before NCCL starts
    startup_done(t, STARTUP_BACKEND);
    t->host = host;
    if (!synthetic) setup_tokenizer(&t->cfg);
    open_data(t);
    check_same_run(t, host, resume, stop_at);
    Comm *world = t->world = device_world(cfg, ops, host);
    check_launch(world);
    setup_check_memory(cfg, ops, world->size, world->rank, true);
    const TrainConfig *tc = &t->cfg.train;
    const ModelConfig *mc = &t->cfg.model;
    ParallelSpec spec = setup_parallel_spec(cfg);
    parallel_init(&t->par, world, &spec);
    const Layout *l = &t->par.lay;
    t->root = world->rank == 0;
    if (t->root && !synthetic && fs_mkdir_p(tc->out, err)) moe_fatal("train.out: %s", err);
    startup_done(t, STARTUP_PLAN);
    model_init(&t->model, mc, ops, &t->par, (size_t)l->micro_per_rank, (size_t)tc->seq_len, 0, tc->micro_batches,
               setup_model_modes(&t->cfg));
    optim_init(&t->opt, &t->model);
    t->opt.overlap = tc->optimizer_overlap;
    ops->sync();
    startup_done(t, STARTUP_ALLOC);
    if (resume) {
        Config saved;
        bool moments = ckpt_has_moments(resume); // none in a checkpoint made by `moe import`
        if (ckpt_read_state(resume, &saved, &t->state, err) ||
            ckpt_load(resume, &t->model, moments ? &t->opt : NULL, err))
            moe_fatal("%s", err);
        if (t->root) printf("resumed from %s (step %" PRId64 ")%s\n", resume, t->state.step,
                            moments ? "" : " without optimizer state: the AdamW moments start from zero");
        t->first_step = t->state.step + 1;
    } else {
        t->first_step = 1;
        model_init_weights(&t->model, (unsigned)tc->seed);
        if (t->root && !synthetic) write_run_config(t);
    }
    ops->sync();
    startup_done(t, STARTUP_INIT);
    if (t->root && !synthetic) open_log(t, resume != NULL);
    if (t->root && !synthetic) t->clocks = device_monitor_start(ops, 10);
    size_t len = model_metrics_len(mc);
    t->metrics = model_alloc(&t->model, len * ops->f32_size);
    for (int i = 0; i < 2; i++) slot_open(&t->slot[i], &t->model, len);
    t->queued = t->state.step;
    t->seqs = moe_malloc((size_t)l->micro_per_rank * (tc->seq_len + 1) * sizeof(int32_t));
    t->sched = moe_malloc(pipeline_max_actions(l->v, tc->micro_batches) * sizeof(PipeAction));
    t->n_sched = pipeline_schedule(l->pp, l->v, l->stage, tc->micro_batches, t->sched);
}

static void trainer_close(Trainer *t) {
    if (t->graph) t->model.ops->graph_free(t->graph); // before the communicators its NCCL work uses
    metrics_log_close(&t->log);
    device_monitor_stop(t->clocks, NULL); // readings since the last step's report are not reported
    for (int i = 0; i < 2; i++) slot_close(&t->slot[i], t->model.ops);
    free(t->seqs);
    free(t->sched);
    model_free(&t->model);
    parallel_free(&t->par);
    if (t->world != t->host) t->world->ops->free(t->world);
    if (!t->synthetic) dataset_close(&t->train);
    if (t->has_val) dataset_close(&t->val);
}

static void print_banner(const Trainer *t) {
    const Config *c = &t->cfg;
    const Layout *l = &t->par.lay;
    ParamCounts p = model_param_counts(&c->model);
    char tok[32], seqs[32], opt[32];
    moe_fmt_count(tok, sizeof tok, (uint64_t)c->train.micro_batches * c->train.micro_batch * c->train.seq_len);
    moe_fmt_count(seqs, sizeof seqs, t->train.n_seqs);
    moe_fmt_count(opt, sizeof opt, t->opt.state_bytes);
    printf("moe.c | %.2fM params (%.2fM active) | %d layers, %d experts, top-%d | %s tokens/step | "
           "%s sequences of %d tokens per epoch | device %s, %d threads\n",
           p.total / 1e6, p.active / 1e6, c->model.n_layers, c->model.n_experts, c->model.top_k,
           tok, seqs, c->train.seq_len, c->train.device, omp_get_max_threads());
    printf("layout | %d ranks: pp %d x dp %d (ep %d, expert-dp %d) | rank 0 holds %zu parameters (%zu in its "
           "fp32 master weights), optimizer state %s bytes", l->world, l->pp, l->dp, l->ep, l->edp,
           t->model.reg.total, t->model.master_len, opt);
    if (l->dp > 1 && c->parallel.overlap_grad_reduce)
        printf(" | gradients reduced during the backward in buckets of whole layers >= %g MB",
               c->parallel.grad_bucket_mb);
    else if (l->dp > 1) printf(" | gradients reduced after the backward");
    const MoeExchange *x = &t->model.xchg;
    if (l->ep > 1) printf(" | expert rows %s", x->direct ? "written into peers' memory" : "by send/recv");
    if (x->chunks > 1) printf(" in %zu chunks behind the experts' compute", x->chunks);
    if (x->push_ctas) printf(" (pushes of <= %zu thread blocks)", x->push_ctas);
    if (l->ep > 1)
        printf(", %zu bytes a row to the experts%s (%zu back)", model_exchange_row_bytes(&t->model),
               t->model.fp8 && t->model.fp8->exchange ? " as FP8 codes and scales" : "",
               (size_t)c->model.d_model * t->model.ops->act_size);
    if (t->model.fp8 && t->model.fp8->amax)
        printf(" | the experts' FP8 codes quantised by parts on the %d expert-dp ranks and gathered as codes", l->edp);
    LaunchEnv e;
    comm_launch_env(&e);
    if (e.nodes > 1)
        printf(" | started by %s on %d nodes (first: %s)", e.launcher, e.nodes, e.master[0] ? e.master : "?");
    if (l->pp > 1 && l->v > 1)
        printf(" | interleaved 1F1B, %d chunks a stage: bubble %.1f%% (%d micro-batches)", l->v,
               100 * pipeline_bubble_fraction(l->pp, l->v, c->train.micro_batches), c->train.micro_batches);
    else if (l->pp > 1)
        printf(" | 1F1B bubble %.1f%% (%d micro-batches)",
               100 * pipeline_bubble_fraction(l->pp, 1, c->train.micro_batches), c->train.micro_batches);
    printf("\n");
}

// The run in a paragraph at its end (rank 0): how far and how fast, its losses, its checkpoints.
static void print_summary(const Trainer *t) {
    const TrainConfig *tc = &t->cfg.train;
    const MetricsLog *log = &t->log;
    char wall[32], rate[32], seen[32], mine[32], ckpt[4200] = "none";
    double seconds = moe_time_sec() - t->start;
    uint64_t run_tokens = (t->state.data_position - t->first_position) * (uint64_t)tc->seq_len;
    moe_fmt_count(seen, sizeof seen, t->state.data_position * (uint64_t)tc->seq_len);
    moe_fmt_count(mine, sizeof mine, run_tokens);
    moe_fmt_count(rate, sizeof rate, (uint64_t)(run_tokens / (seconds > 0 ? seconds : 1) + 0.5));
    ckpt_latest(tc->out, ckpt, sizeof ckpt);
    printf("\ndone: steps %" PRId64 "-%" PRId64 " of %d in %s (%s tokens/s); %s tokens seen, %s of them by "
           "this run.\nfinal training loss %.4f (cross-entropy %.4f); ", t->first_step, t->state.step, tc->steps,
           moe_fmt_duration(wall, sizeof wall, seconds), rate, seen, mine, t->final_loss, t->final_ce);
    if (log->best_val_step >= 0)
        printf("best validation loss %.4f at step %" PRId64 " (latest %.4f at step %" PRId64 ").\n", log->best_val,
               log->best_val_step, log->last_val, log->last_val_step);
    else printf("no validation loss (data.val is empty or train.eval_every=0).\n");
    printf("checkpoints in %s; the last good one: %s.\n", tc->out, ckpt);
    if (t->state.step < tc->steps)
        printf("stopped by --stop-at: run the same command again to go on to step %d.\n", tc->steps);
    printf("pictures of the run: ./moe plot %s\n", tc->out);
}

// After step s: a validation loss; a checkpoint (the run's last step has one). Both need the
// weights of step s, so no step is queued ahead of one that has them.
static bool eval_due(const Trainer *t, int64_t s) {
    const TrainConfig *tc = &t->cfg.train;
    return t->has_val && (s % tc->eval_every == 0 || s == tc->steps);
}

static bool ckpt_due(const Trainer *t, int64_t s) {
    const TrainConfig *tc = &t->cfg.train;
    return (tc->ckpt_every > 0 && s % tc->ckpt_every == 0) || s == t->last_step;
}

void train_run(const Config *cfg, Comm *world, const char *resume, int64_t stop_at) {
    Trainer t;
    trainer_open(&t, cfg, world, resume, stop_at, false);
    if (t.root) print_banner(&t);
    const TrainConfig *tc = &t.cfg.train;
    Comm *groups[4] = {t.par.world, t.par.dp, t.par.ep, t.par.edp};
    if (t.par.world->size > 1) t.watchdog = watchdog_start(tc->comm_timeout, t.par.world->rank, groups, 4);
    t.start = moe_time_sec();
    t.first_position = t.state.data_position;
    t.last_step = stop_at > 0 && stop_at < tc->steps ? stop_at : tc->steps;
    while (t.state.step < t.last_step) {
        double t0 = moe_time_sec();
        int64_t s = t.state.step + 1;
        clock_step_begins(&t.clock, t0);
        watchdog_beat(t.watchdog, s, "training step");
        train_step(&t, tc->launch_ahead && !eval_due(&t, s) && !ckpt_due(&t, s));
        // At least its work's time: a backend that runs work as it is queued ran this step's in the
        // loop before when it was queued ahead.
        if (t.root) report_step(&t, fmax(moe_time_sec() - t0, t.device_s));
        if (eval_due(&t, s)) {
            watchdog_beat(t.watchdog, s, "evaluation");
            run_eval(&t);
        }
        if (ckpt_due(&t, s)) {
            watchdog_beat(t.watchdog, s, "checkpoint");
            save_checkpoint(&t);
        }
    }
    if (t.root) print_summary(&t);
    watchdog_closing(t.watchdog, t.state.step);
    trainer_close(&t);
    watchdog_stop(t.watchdog);
}

// The side of the square product that measures the backend's matrix-multiply rate: bf16 on a GPU,
// fp32 on the CPU.
static size_t matmul_n(const Ops *ops) { return ops->stream ? 8192 : 1024; }

// The rate (TFLOP/s) of that product on random values from the backend's events, timed over `reps`
// products after `warm` untimed ones (with `clocks` non-NULL, the device's clocks read meanwhile).
static double matmul_rate(const Ops *ops, int warm, int reps, ClockSummary *clocks) {
    size_t n = matmul_n(ops), bytes = n * n * ops->act_size;
    void *a = ops->alloc(bytes), *b = ops->alloc(bytes), *c = ops->alloc(bytes);
    ops_fill_random(ops, a, n * n, 1, 1.0f), ops_fill_random(ops, b, n * n, 2, 1.0f);
    void *e0 = ops->event_create(), *e1 = ops->event_create();
    for (int i = 0; i < warm; i++) ops->matmul_forward(c, a, b, n, n, n, false);
    ops->sync();
    DeviceMonitor *m = clocks ? device_monitor_start(ops, 10) : NULL;
    ops->event_record(e0);
    for (int i = 0; i < reps; i++) ops->matmul_forward(c, a, b, n, n, n, false);
    ops->event_record(e1);
    double ms = ops->event_elapsed_ms(e0, e1) / reps;
    device_monitor_stop(m, clocks);
    ops->free(a), ops->free(b), ops->free(c);
    ops->event_free(e0), ops->event_free(e1);
    return 2.0 * n * n * (double)n / (ms * 1e-3) / 1e12;
}

double train_matmul_tflops(const Ops *ops) { return matmul_rate(ops, 3, ops->stream ? 10 : 2, NULL); }

double train_matmul_tflops_sustained(const Ops *ops, double burst_tflops, double seconds, ClockSummary *clocks) {
    double n = (double)matmul_n(ops), burst_ms = 2 * n * n * n / (burst_tflops * 1e12) * 1e3;
    int reps = (int)(0.5 * seconds * 1e3 / burst_ms) + 1, warm = reps;
    return matmul_rate(ops, warm, reps, clocks);
}

// Per-step means of `steps` steps timed from here: each step's metrics waited for before the next
// is queued, or (ahead) the next queued first. Whole steps from the backend's events.
static StepTimes time_steps(Trainer *t, int steps, bool ahead) {
    const Ops *ops = t->model.ops;
    void *e0 = ops->event_create(), *e1 = ops->event_create();
    int64_t end = t->state.step + steps;
    ops->sync();
    memset(&t->times, 0, sizeof t->times);
    ops->event_record(e0);
    while (t->state.step < end) train_step(t, ahead && t->state.step + 1 < end);
    ops->event_record(e1);
    StepTimes m = t->times;
    m.step_ms = ops->event_elapsed_ms(e0, e1);
    ops->event_free(e0), ops->event_free(e1);
    m.stage_ms /= steps, m.launch_ms /= steps, m.wait_ms /= steps, m.device_ms /= steps, m.step_ms /= steps;
    return m;
}

// Every rank's timings (both ways) for rank 0's report, as whole microseconds: int32 travels alike
// through every host communicator. Only this rank's where the host communicator is not the world
// (`moe train --nproc`).
static void gather_times(const Trainer *t, const StepTimes mine[2], BenchReport *r) {
    enum { FIELDS = 5 };
    Comm *c = t->host->size == t->world->size ? t->host : NULL;
    size_t n = c ? (size_t)c->size : 1;
    int32_t us[2 * FIELDS], *all = moe_malloc(n * sizeof us);
    for (int k = 0; k < 2; k++) {
        const double v[FIELDS] = {mine[k].step_ms, mine[k].stage_ms, mine[k].launch_ms, mine[k].wait_ms,
                                  mine[k].device_ms};
        for (int f = 0; f < FIELDS; f++) us[k * FIELDS + f] = (int32_t)lround(1e3 * v[f]);
    }
    if (c) c->ops->all_gather(c, us, all, 2 * FIELDS, COMM_I32);
    else memcpy(all, us, sizeof us);
    r->n_times = n < BENCH_RANKS ? (int)n : BENCH_RANKS;
    for (int j = 0; j < r->n_times; j++)
        for (int k = 0; k < 2; k++) {
            const int32_t *u = all + (size_t)j * 2 * FIELDS + k * FIELDS;
            r->times[k][j] = (StepTimes){.step_ms = u[0] / 1e3, .stage_ms = u[1] / 1e3, .launch_ms = u[2] / 1e3,
                                         .wait_ms = u[3] / 1e3, .device_ms = u[4] / 1e3};
        }
    free(all);
}

void train_bench(const Config *cfg, Comm *world, int warmup, int steps, BenchReport *r) {
    Trainer t;
    trainer_open(&t, cfg, world, NULL, 0, true);
    const Ops *ops = t.model.ops;
    memset(r, 0, sizeof *r);
    for (int i = 0; i < warmup; i++) train_step(&t, false);
    memcpy(r->startup, t.startup, sizeof r->startup);
    r->capture_s = t.capture_s;
    r->matmul_tflops = train_matmul_tflops(ops);
    if (ops->device_clocks)
        r->matmul_sustained_tflops = train_matmul_tflops_sustained(ops, r->matmul_tflops, 2.0, &r->matmul_clocks);
    DeviceMonitor *clocks = device_monitor_start(ops, 10);
    StepTimes mine[2] = {time_steps(&t, steps, false), time_steps(&t, steps, true)};
    device_monitor_stop(clocks, &r->clocks);
    gather_times(&t, mine, r);
    r->launch_ahead = cfg->train.launch_ahead;
    r->ms_per_step = mine[r->launch_ahead].step_ms;
    r->nccl_calls = t.nccl_calls;
    r->graph = t.graph != NULL;
    void *e0 = ops->event_create(), *e1 = ops->event_create();
    if (r->graph) { // the same graph replayed back to back: the step without the host's part
        if (ops->graph_count) ops->graph_count(t.graph, &r->graph_nodes);
        ops->event_record(e0);
        for (int i = 0; i < steps; i++) ops->graph_launch(t.graph);
        ops->event_record(e1);
        ops->sync();
        r->graph_only_ms = ops->event_elapsed_ms(e0, e1) / steps;
    }
    r->memory_in_use = ops->memory_in_use();
    r->memory_peak = ops->memory_peak ? ops->memory_peak() : 0;
    r->plan = setup_memory_plan_on(cfg, t.world->size, t.world->rank, ops_counting_like(ops));
    r->allocated = setup_memory_of(&t.model, &t.opt);
    StepReport sr = {0};
    report_build(&sr, &t.cfg.model, t.metrics_host, t.cfg.train.micro_batches,
                 (size_t)t.cfg.train.micro_batch * t.cfg.train.seq_len);
    r->loss = sr.ce;
    r->load_imbalance = report_worst_imbalance(&sr);
    r->drop_rate = report_drop_rate(&sr);
    report_free(&sr);
    t.model.ops = ops_profiled(ops); // one more step, every kernel timed (run as queued)
    ops->sync();
    ops->event_record(e0);
    train_step(&t, false);
    ops->event_record(e1);
    r->profiled_ms = ops->event_elapsed_ms(e0, e1);
    ops->event_free(e0), ops->event_free(e1);
    r->n_ops = profile_collect(r->phase_ms, r->ops);
    r->ranks = t.world->size;
    t.model.ops = ops;
    trainer_close(&t);
}
