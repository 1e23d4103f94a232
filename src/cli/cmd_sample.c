// `moe sample --ckpt DIR`: generates bytes from a checkpoint trained on byte tokens.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "io/tokens.h"
#include "train/setup.h"

static const CliSpec SPEC = {
    .command = "moe sample",
    .usage = "--ckpt DIR [--prompt TEXT] [--tokens N] [--temperature T] [--seed S]",
    .summary = "Generates text token by token (byte-level vocabulary: ids 0..255 are bytes,\n"
               "256 is end of document). The context is the last train.seq_len tokens.",
    .opts = (const CliOption[]){
        CLI_OPTION_CKPT,
        {"--prompt", "TEXT", "text to continue (default: a new document)"},
        {"--tokens", "N", "tokens to generate (default 500)"},
        {"--temperature", "T", "softmax temperature, 0 = greedy (default 0.8)"},
        {"--seed", "S", "sampling seed (default 1)"},
        {NULL}},
};

// Draws from softmax(logits / temperature); temperature 0 takes the most likely token.
static int32_t sample_token(const float *logits, size_t V, double temperature, Rng *rng) {
    size_t best = 0;
    for (size_t v = 1; v < V; v++) best = logits[v] > logits[best] ? v : best;
    if (temperature <= 0) return (int32_t)best;
    double sum = 0, *p = malloc(V * sizeof(double));
    for (size_t v = 0; v < V; v++) sum += p[v] = exp((logits[v] - logits[best]) / temperature);
    double u = rng_next_uniform(rng) * sum;
    size_t v = 0;
    while (v + 1 < V && (u -= p[v]) > 0) v++;
    free(p);
    return (int32_t)v;
}

// NaN logits would be sampled as token 0 (a NUL byte): a model that gives them is an error.
static void check_logits(const float *logits, size_t V, const char *ckpt) {
    for (size_t v = 0; v < V; v++)
        if (!isfinite(logits[v]))
            moe_fatal("moe sample: the model of %s gives a logit of %g (token %zu): its outputs overflow (a "
                      "diverged or damaged checkpoint)", ckpt, logits[v], v);
}

static void emit(int32_t token) {
    if (token < 256) putchar(token);
    else if (token == BYTE_EOS) fputs("\n<|eos|>\n", stdout);
    else printf("<%d>", token);
    fflush(stdout);
}

int cmd_sample(int argc, char **argv, Comm *world) {
    const char *values[5] = {0};
    char **pos;
    int n_pos;
    cli_parse(&SPEC, argc, argv, values, &pos, &n_pos);
    cli_single_rank(SPEC.command, world);
    if (!values[0] || n_pos) {
        cli_usage(&SPEC, false);
        free(pos);
        return 1;
    }
    size_t n_new = values[2] ? (size_t)cli_number("--tokens", values[2], 1, 1e9) : 500;
    double temperature = values[3] ? cli_number("--temperature", values[3], 0, 100) : 0.8;
    Rng rng = {.state = values[4] ? (uint64_t)cli_number("--seed", values[4], 0, 1e18) : 1};
    Config cfg;
    Parallel par;
    Model m;
    setup_model_from_ckpt(values[0], &cfg, &par, &m, 1, 0);
    size_t V = cfg.model.vocab_size, S = cfg.train.seq_len;
    if (V < BYTE_VOCAB) moe_fatal("moe sample: vocab_size %zu is not a byte-level vocabulary", V);
    const char *prompt = values[1] ? values[1] : "";
    size_t n = strlen(prompt), cap = n + n_new + 1;
    int32_t *tokens = malloc(cap * sizeof(int32_t));
    tokens[0] = BYTE_EOS; // a new document starts after an end of document
    for (size_t i = 0; i < n; i++) tokens[1 + i] = (unsigned char)prompt[i];
    n += 1;
    fputs(prompt, stdout);
    float *logits = malloc(V * sizeof(float));
    for (size_t i = 0; i < n_new; i++) {
        size_t ctx = n < S ? n : S;
        model_last_logits(&m, tokens + n - ctx, ctx, logits);
        check_logits(logits, V, values[0]);
        tokens[n] = sample_token(logits, V, temperature, &rng);
        emit(tokens[n++]);
    }
    putchar('\n');
    free(logits);
    free(tokens);
    model_free(&m);
    parallel_free(&par);
    free(pos);
    return 0;
}
