// `moe sample --ckpt DIR`: generates text from a checkpoint, decoded with the tokenizer its run was
// trained with (data.tokenizer) or as bytes.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "text/tokenizer.h"
#include "train/setup.h"

static const CliSpec SPEC = {
    .command = "moe sample",
    .usage = "--ckpt DIR [--prompt TEXT] [--tokens N] [--temperature T] [--seed S] [--tokenizer FILE]",
    .summary = "Generates text token by token. A run trained on data made with a tokenizer.json\n"
               "(data.tokenizer in its config) is decoded with it: the prompt is encoded, each new token\n"
               "printed as its bytes. Otherwise ids 0..255 are bytes and 256 ends a document. The\n"
               "context is the last train.seq_len tokens.",
    .opts = (const CliOption[]){
        CLI_OPTION_CKPT,
        {"--prompt", "TEXT", "text to continue (default: a new document)"},
        {"--tokens", "N", "tokens to generate (default 500)"},
        {"--temperature", "T", "softmax temperature, 0 = greedy (default 0.8)"},
        {"--seed", "S", "sampling seed (default 1)"},
        {"--tokenizer", "FILE", "the run's tokenizer.json where it is now (default: data.tokenizer)"},
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

// The vocabulary of the run: its tokenizer, or bytes (tok NULL).
typedef struct {
    Tokenizer *tok;
    bool has_eos;
    uint32_t eos;
} SampleVocab;

// The run's tokenizer: --tokenizer, else data.tokenizer; it must be the file the run recorded
// (data.tokenizer_xxh3; a file given with --tokenizer that differs is used with a note).
static SampleVocab sample_vocab(const Config *cfg, const char *option, const char *ckpt) {
    SampleVocab v = {.has_eos = true, .eos = BYTE_EOS};
    const char *path = option ? option : cfg->data.tokenizer, *recorded = cfg->data.tokenizer_xxh3;
    size_t V = (size_t)cfg->model.vocab_size;
    MoeErr err;
    if (!path[0]) {
        if (V < BYTE_VOCAB) moe_fatal("moe sample: vocab_size %zu is not a byte-level vocabulary; give the run's "
                                      "tokenizer with --tokenizer FILE", V);
        return v;
    }
    if (!(v.tok = tokenizer_load(path, err)))
        moe_fatal("moe sample: %s%s", err, option ? "" : "; the run recorded data.tokenizer; if the file moved, "
                  "pass --tokenizer FILE");
    if (recorded[0] && strcmp(recorded, tokenizer_hash(v.tok))) {
        if (!option)
            moe_fatal("moe sample: %s is not the tokenizer %s was trained with (XXH3-64 %s, the run recorded %s); "
                      "restore it, or pass --tokenizer FILE to decode with another file", path, ckpt,
                      tokenizer_hash(v.tok), recorded);
        fprintf(stderr, "note: %s is not the file the run recorded (XXH3-64 %s, recorded %s)\n", path,
                tokenizer_hash(v.tok), recorded);
    }
    if (tokenizer_vocab_size(v.tok) > V)
        moe_fatal("moe sample: %s has ids up to %zu but the model's vocab_size is %zu: not this run's tokenizer",
                  path, tokenizer_vocab_size(v.tok) - 1, V);
    v.has_eos = tokenizer_eos(v.tok, NULL, &v.eos, err) == 0;
    return v;
}

static void emit(const SampleVocab *v, int32_t token) {
    size_t len;
    const uint8_t *bytes = v->tok ? tokenizer_token_bytes(v->tok, (uint32_t)token, &len) : NULL;
    bool eos = v->has_eos && (uint32_t)token == v->eos;
    if (eos) printf("\n%.*s\n", v->tok ? (int)len : 7, v->tok ? (const char *)bytes : "<|eos|>");
    else if (bytes) fwrite(bytes, 1, len, stdout);
    else if (!v->tok && token < 256) putchar(token);
    else printf("<%d>", token);
    fflush(stdout);
}

// The context a generation starts from: an end of document (a new one starts), then the prompt.
static int32_t *sample_context(const SampleVocab *v, const char *prompt, size_t n_new, size_t *n) {
    TokenIds ids = {0};
    if (v->has_eos) token_ids_push(&ids, v->eos);
    TextSpan span = {(const uint8_t *)prompt, strlen(prompt), "--prompt"};
    MoeErr err;
    if (v->tok && tokenizer_encode(v->tok, &span, 1, 1, 0, &ids, err)) moe_fatal("moe sample: %s", err);
    for (size_t i = 0; !v->tok && i < span.len; i++) token_ids_push(&ids, (unsigned char)prompt[i]);
    if (!ids.n) moe_fatal("moe sample: %s has no end-of-text token to start a document from; give a --prompt",
                          tokenizer_path(v->tok));
    int32_t *tokens = malloc((ids.n + n_new) * sizeof(int32_t));
    for (size_t i = 0; i < ids.n; i++) tokens[i] = (int32_t)ids.ids[i];
    *n = ids.n;
    token_ids_free(&ids);
    return tokens;
}

int cmd_sample(int argc, char **argv, Comm *world) {
    const char *values[6] = {0};
    int n_pos;
    char **pos = cli_parse_one_rank(&SPEC, argc, argv, values, &n_pos, world);
    if (!values[0] || n_pos) return cli_misuse(&SPEC, pos);
    size_t n_new = values[2] ? (size_t)cli_number("--tokens", values[2], 1, 1e9) : 500;
    double temperature = values[3] ? cli_number("--temperature", values[3], 0, 100) : 0.8;
    Rng rng = {.state = values[4] ? (uint64_t)cli_number("--seed", values[4], 0, 1e18) : 1};
    Config cfg;
    Parallel par;
    Model m;
    setup_model_from_ckpt(values[0], &cfg, &par, &m, 1, 0);
    size_t V = cfg.model.vocab_size, S = cfg.train.seq_len, n;
    SampleVocab vocab = sample_vocab(&cfg, values[5], values[0]);
    const char *prompt = values[1] ? values[1] : "";
    int32_t *tokens = sample_context(&vocab, prompt, n_new, &n);
    fputs(prompt, stdout);
    float *logits = malloc(V * sizeof(float));
    for (size_t i = 0; i < n_new; i++) {
        size_t ctx = n < S ? n : S;
        model_last_logits(&m, tokens + n - ctx, ctx, logits);
        check_logits(logits, V, values[0]);
        tokens[n] = sample_token(logits, V, temperature, &rng);
        emit(&vocab, tokens[n++]);
    }
    putchar('\n');
    free(logits);
    free(tokens);
    tokenizer_free(vocab.tok);
    model_free(&m);
    parallel_free(&par);
    free(pos);
    return 0;
}
