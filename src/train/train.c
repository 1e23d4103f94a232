// The training loop (see train.h). One step = micro_batches forward/backward passes accumulating
// gradients, then one optimizer update; metrics come back once per step.
#include "train.h"

#include <errno.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "io/fsutil.h"
#include "metrics.h"
#include "optim.h"

typedef struct {
    Config cfg;
    Model model;
    Dataset train, val;
    bool has_val;
    TrainState state;
    void *metrics;        // f32 (model_metrics_len) backend accumulators of the current step
    float *metrics_host;  // host copy
    int32_t *seqs;        // (B, S + 1) host batch
    FILE *log;            // metrics.jsonl
} Trainer;

const Ops *train_backend(const Config *cfg) {
    if (cfg->train.threads > 0) omp_set_num_threads(cfg->train.threads);
    return ops_cpu(); // config_validate admits only the backends this build has
}

void train_open_dataset(Dataset *ds, const Config *cfg, const char *spec, bool shuffle) {
    MoeErr err;
    if (dataset_open(ds, spec, (size_t)cfg->train.seq_len, (size_t)cfg->model.vocab_size,
                     cfg->data.token_bytes, (uint64_t)cfg->train.seed, shuffle, err))
        moe_fatal("%s", err);
}

static void read_batch(Dataset *ds, uint64_t first, size_t count, int32_t *seqs, size_t S) {
    MoeErr err;
    for (size_t b = 0; b < count; b++)
        if (dataset_read(ds, first + b, seqs + b * (S + 1), err)) moe_fatal("%s", err);
}

double eval_loss(Model *m, Dataset *ds, size_t max_seqs) {
    const Ops *ops = m->ops;
    size_t B = m->B, S = m->S, n = max_seqs < ds->n_seqs ? max_seqs : ds->n_seqs;
    size_t len = model_metrics_len(&m->cfg);
    int32_t *seqs = moe_malloc(B * (S + 1) * sizeof(int32_t));
    ops->zero(m->metrics_scratch, len * ops->f32_size);
    for (size_t first = 0; first < n; first += B) {
        size_t b = n - first < B ? n - first : B;
        read_batch(ds, first, b, seqs, S);
        model_set_batch(m, seqs, b, S);
        ForwardArgs a = {.B = b, .S = S, .train = false, .batch_id = first,
                         .metrics = m->metrics_scratch};
        model_forward(m, &a);
    }
    float ce;
    ops->download_f32(&ce, model_f32(m, m->metrics_scratch, METRIC_CE), 1);
    free(seqs);
    return ce / (double)(n * S);
}

static LossScales loss_scales(const Config *cfg) {
    const ModelConfig *c = &cfg->model;
    double tokens = (double)cfg->train.micro_batches * cfg->train.micro_batch * cfg->train.seq_len;
    double calls = (double)cfg->train.micro_batches * model_n_moe_layers(c);
    return (LossScales){.ce = (float)(1 / tokens), .lm_z = (float)(c->lm_z_coef / tokens),
                        .lb = calls > 0 ? (float)(c->lb_coef / calls) : 0,
                        .z = calls > 0 ? (float)(c->z_coef / calls) : 0};
}

// One optimizer step over micro_batches micro-batches; leaves the step's metrics on the host.
static void train_step(Trainer *t) {
    const Ops *ops = t->model.ops;
    const TrainConfig *tc = &t->cfg.train;
    size_t B = tc->micro_batch, S = tc->seq_len, len = model_metrics_len(&t->cfg.model);
    int step = t->state.step + 1;
    ops->zero(t->model.grads, t->model.reg.total * ops->f32_size);
    ops->zero(t->metrics, len * ops->f32_size);
    optim_begin_step(&t->model, tc, step);
    for (int micro = 0; micro < tc->micro_batches; micro++) {
        uint64_t first = t->state.data_position + (uint64_t)micro * B;
        read_batch(&t->train, first, B, t->seqs, S);
        model_set_batch(&t->model, t->seqs, B, S);
        ForwardArgs a = {.B = B, .S = S, .train = true, .batch_id = first,
                         .scales = loss_scales(&t->cfg), .metrics = t->metrics};
        model_forward(&t->model, &a);
        model_backward(&t->model, &a);
    }
    optim_step(&t->model, tc, t->metrics);
    ops->download_f32(t->metrics_host, t->metrics, len);
    t->state.step = step;
    t->state.data_position += (uint64_t)tc->micro_batches * B;
}

static void save_checkpoint(Trainer *t) {
    MoeErr err;
    if (ckpt_save(t->cfg.train.out, &t->model, &t->cfg, &t->state, t->cfg.train.keep_ckpts, err))
        moe_fatal("checkpoint at step %d not written: %s (the previous checkpoint is intact)",
                  t->state.step, err);
    printf("saved %s/step-%d\n", t->cfg.train.out, t->state.step);
}

static void run_eval(Trainer *t) {
    size_t max_seqs = (size_t)t->cfg.train.eval_batches * t->cfg.train.micro_batch;
    double loss = eval_loss(&t->model, &t->val, max_seqs);
    printf("step %5d | val loss %.4f\n", t->state.step, loss);
    fprintf(t->log, "{\"step\": %d, \"val_loss\": %.9g}\n", t->state.step, loss);
    fflush(t->log);
    if (!isfinite(loss)) moe_fatal("step %d: validation loss is %g; stopping", t->state.step, loss);
}

static void report_step(Trainer *t, double seconds, double elapsed) {
    const TrainConfig *tc = &t->cfg.train;
    StepReport r = {.step = t->state.step, .steps = tc->steps};
    size_t T = (size_t)tc->micro_batch * tc->seq_len;
    report_build(&r, &t->cfg.model, t->metrics_host, tc->micro_batches, T);
    r.lr = optim_lr(tc, t->state.step);
    r.tokens_per_sec = (double)tc->micro_batches * T / seconds;
    r.elapsed_s = elapsed;
    if (!report_finite(&r)) {
        char last[4200] = "none";
        ckpt_latest(tc->out, last, sizeof last);
        moe_fatal("step %d: loss %g, gradient norm %g: training diverged; stopping (last good "
                  "checkpoint: %s; try a lower train.lr)", r.step, r.loss, r.grad_norm, last);
    }
    if (r.step % tc->log_every == 0 || r.step == tc->steps || r.step == 1) report_print(&r, stdout);
    report_write_json(&r, t->log);
    report_free(&r);
}

static void trainer_open(Trainer *t, const Config *cfg, const char *resume) {
    MoeErr err;
    memset(t, 0, sizeof *t);
    t->cfg = *cfg;
    const TrainConfig *tc = &t->cfg.train;
    const Ops *ops = train_backend(cfg);
    train_open_dataset(&t->train, cfg, cfg->data.train, true);
    t->has_val = cfg->data.val[0] && tc->eval_every > 0;
    if (t->has_val) train_open_dataset(&t->val, cfg, cfg->data.val, false);
    if (fs_mkdir_p(tc->out, err)) moe_fatal("train.out: %s", err);
    model_init(&t->model, &cfg->model, ops, (size_t)tc->micro_batch, (size_t)tc->seq_len);
    if (resume) {
        Config saved;
        if (ckpt_read_state(resume, &saved, &t->state, err) || ckpt_load(resume, &t->model, true, err))
            moe_fatal("%s", err);
        printf("resumed from %s (step %d)\n", resume, t->state.step);
    } else {
        model_init_weights(&t->model, (unsigned)tc->seed);
        char path[CONFIG_PATH_LEN + 16];
        snprintf(path, sizeof path, "%s/config.json", tc->out);
        json_t *j = config_to_json(cfg);
        if (fs_write_json_atomic(path, j, err)) moe_fatal("train.out: %s", err);
        json_decref(j);
    }
    char path[CONFIG_PATH_LEN + 16];
    snprintf(path, sizeof path, "%s/metrics.jsonl", tc->out);
    t->log = fopen(path, resume ? "a" : "w");
    if (!t->log) moe_fatal("%s: cannot write the metrics log (%s)", path, strerror(errno));
    size_t len = model_metrics_len(&cfg->model);
    t->metrics = model_alloc(&t->model, len * ops->f32_size);
    t->metrics_host = moe_malloc(len * sizeof(float));
    t->seqs = moe_malloc((size_t)tc->micro_batch * (tc->seq_len + 1) * sizeof(int32_t));
}

static void trainer_close(Trainer *t) {
    fclose(t->log);
    free(t->metrics_host);
    free(t->seqs);
    model_free(&t->model);
    dataset_close(&t->train);
    if (t->has_val) dataset_close(&t->val);
}

static void print_banner(const Trainer *t) {
    const Config *c = &t->cfg;
    ParamCounts p = model_param_counts(&c->model);
    char tok[32], seqs[32];
    moe_fmt_count(tok, sizeof tok, (uint64_t)c->train.micro_batches * c->train.micro_batch * c->train.seq_len);
    moe_fmt_count(seqs, sizeof seqs, t->train.n_seqs);
    printf("moe.c | %.2fM params (%.2fM active) | %d layers, %d experts, top-%d | %s tokens/step | "
           "%s sequences of %d tokens per epoch | device %s, %d threads\n",
           p.total / 1e6, p.active / 1e6, c->model.n_layers, c->model.n_experts, c->model.top_k,
           tok, seqs, c->train.seq_len, c->train.device, omp_get_max_threads());
}

void train_run(const Config *cfg, const char *resume, int stop_at) {
    Trainer t;
    trainer_open(&t, cfg, resume);
    print_banner(&t);
    const TrainConfig *tc = &t.cfg.train;
    double start = moe_time_sec();
    int last = stop_at > 0 && stop_at < tc->steps ? stop_at : tc->steps;
    while (t.state.step < last) {
        double t0 = moe_time_sec();
        train_step(&t);
        report_step(&t, moe_time_sec() - t0, moe_time_sec() - start);
        int s = t.state.step;
        if (t.has_val && (s % tc->eval_every == 0 || s == tc->steps)) run_eval(&t);
        if ((tc->ckpt_every > 0 && s % tc->ckpt_every == 0) || s == last) save_checkpoint(&t);
    }
    trainer_close(&t);
}
