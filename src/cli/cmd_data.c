// `moe data prepare IN.txt... OUT.npy`: token files from text files, as bytes or with a tokenizer.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "text/prepare.h"

static const CliSpec SPEC = {
    .command = "moe data",
    .usage = "prepare IN.txt [IN2.txt ...] OUT.npy [--tokenizer tokenizer.json] [--val-out VAL.npy]\n"
             "       [--val-fraction F] [--eos TOKEN|ID] [--threads N]",
    .summary = "Writes the text files as one headerless token file, each file one document ending with\n"
               "EOS. Without --tokenizer the ids are the bytes 0..255 (EOS = 256, vocab_size 257,\n"
               "uint16); with a Hugging Face tokenizer.json (byte-level BPE) they are its ids\n"
               "(uint16 when its vocabulary has at most 65,536 ids, else uint32). With --val-out, the\n"
               "last F of the text (cut at a line start) goes to a validation file instead.",
    .opts = (const CliOption[]){
        {"--tokenizer", "FILE", "a tokenizer.json to encode with (default: bytes)"},
        {"--val-out", "VAL.npy", "validation output"},
        {"--val-fraction", "F", "share of the text for validation (default 0.1 with --val-out)"},
        {"--eos", "TOKEN|ID", "the token ending each document (default: the tokenizer's end of text)"},
        {"--threads", "N", "encoding threads (default: all cores); the output does not depend on it"},
        {NULL}},
};

static void print_result(const PrepareSpec *s, const PrepareStats *st) {
    char n[2][32];
    moe_fmt_count(n[0], sizeof n[0], st->tokens[0]);
    moe_fmt_count(n[1], sizeof n[1], st->tokens[1]);
    printf("wrote %s (%s tokens)", s->train_path, n[0]);
    if (s->val_path) printf(" and %s (%s tokens)", s->val_path, n[1]);
    printf(", %s\n", st->token_bytes == 2 ? "uint16" : "uint32");
    if (!s->tokenizer) return;
    size_t len;
    const uint8_t *eos = tokenizer_token_bytes(s->tokenizer, s->eos, &len);
    printf("encoded %.1f MB in %.2f s (%.1f MB/s, %d threads); EOS %u (%.*s)\n", st->text_bytes / 1e6,
           st->encode_sec, st->text_bytes / 1e6 / (st->encode_sec > 0 ? st->encode_sec : 1e-9), s->threads,
           s->eos, (int)len, (const char *)eos);
    printf("train with model.vocab_size=%zu (or more) data.tokenizer=%s\n", tokenizer_vocab_size(s->tokenizer),
           tokenizer_path(s->tokenizer));
}

int cmd_data(int argc, char **argv, Comm *world) {
    const char *values[5] = {0};
    int n_pos;
    char **pos = cli_parse_one_rank(&SPEC, argc, argv, values, &n_pos, world);
    if (n_pos < 3 || strcmp(pos[0], "prepare")) return cli_misuse(&SPEC, pos);
    PrepareSpec s = {.inputs = (const char *const *)pos + 1, .n_inputs = (size_t)n_pos - 2,
                     .train_path = pos[n_pos - 1], .val_path = values[1], .eos = BYTE_EOS,
                     .threads = values[4] ? (int)cli_number("--threads", values[4], 1, 4096) : moe_cpu_cores()};
    if (values[1]) s.val_fraction = values[2] ? cli_number("--val-fraction", values[2], 0, 0.5) : 0.1;
    else if (values[2]) moe_fatal("moe data: --val-fraction needs --val-out");
    if (values[3] && !values[0]) moe_fatal("moe data: --eos needs --tokenizer (byte-level EOS is %d)", BYTE_EOS);
    MoeErr err;
    Tokenizer *tok = NULL;
    if (values[0] && (!(tok = tokenizer_load(values[0], err)) || tokenizer_eos(tok, values[3], &s.eos, err)))
        moe_fatal("%s", err);
    s.tokenizer = tok;
    PrepareStats stats;
    if (data_prepare(&s, &stats, err)) moe_fatal("%s", err);
    print_result(&s, &stats);
    tokenizer_free(tok);
    free(pos);
    return 0;
}
