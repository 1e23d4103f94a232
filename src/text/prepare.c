// Token files from text files for `moe data prepare` (see prepare.h): reading the inputs, the
// validation cut, encoding, and writing each output to a temporary name renamed into place.
#include "prepare.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "io/fsutil.h"

// Outputs are renamed over their paths: one that is an input would destroy the text it is made
// from, and two that are one file would leave only the second.
static int check_outputs(const PrepareSpec *s, MoeErr err) {
    const char *outputs[2] = {s->train_path, s->val_path};
    for (size_t i = 0; i < s->n_inputs; i++)
        for (int o = 0; o < 2; o++)
            if (outputs[o] && fs_same_file(outputs[o], s->inputs[i]))
                return moe_err(err, "output %s is the input file %s: writing it would destroy the text; "
                               "choose another output path", outputs[o], s->inputs[i]);
    if (s->val_path && fs_same_file(s->train_path, s->val_path))
        return moe_err(err, "train output %s and validation output %s are the same file; give two paths",
                       s->train_path, s->val_path);
    return 0;
}

static int read_inputs(const PrepareSpec *s, TextSpan *docs, size_t *total, MoeErr err) {
    for (size_t i = 0; i < s->n_inputs; i++) {
        uint8_t *text;
        docs[i].name = s->inputs[i];
        if (fs_read_file(s->inputs[i], "text file", &text, &docs[i].len, err)) return -1;
        docs[i].text = text;
        if (!docs[i].len) return moe_err(err, "%s: empty text file; nothing to tokenize", s->inputs[i]);
        *total += docs[i].len;
    }
    return 0;
}

// Cuts the documents into those of the train file and those of the validation file: the
// validation text starts at the line holding byte floor((1 - F) * total) of all the text (a
// document's start is a line start), which may split a document in two. spans gets the train
// documents, then the validation ones; returns the number of train documents.
static int split_documents(const PrepareSpec *s, const TextSpan *docs, size_t total, TextSpan *spans,
                           size_t *n_train, size_t *n_spans, MoeErr err) {
    size_t d = 0, at = 0;
    if (s->val_fraction > 0) {
        size_t cut = (size_t)floor((1.0 - s->val_fraction) * (double)total);
        while (d + 1 < s->n_inputs && cut >= docs[d].len) cut -= docs[d].len, d++;
        while (cut > 0 && docs[d].text[cut - 1] != '\n') cut--;
        at = cut;
        if (d == 0 && at == 0)
            return moe_err(err, "%s: cannot split off the last %g of the text at a line start: the first line "
                           "reaches past that point; add line breaks or use val_fraction 0", docs[0].name,
                           s->val_fraction);
    } else d = s->n_inputs;
    size_t n = 0;
    for (size_t i = 0; i < d; i++) spans[n++] = docs[i];
    if (at > 0) spans[n++] = (TextSpan){docs[d].text, at, docs[d].name};
    *n_train = n;
    if (d < s->n_inputs) spans[n++] = (TextSpan){docs[d].text + at, docs[d].len - at, docs[d].name};
    for (size_t i = d + 1; i < s->n_inputs; i++) spans[n++] = docs[i];
    *n_spans = n;
    return 0;
}

// Each document's ids (without a tokenizer: its bytes), then EOS, as little-endian integers of
// `width` bytes.
static bool write_documents(FILE *fp, const TextSpan *docs, const TokenIds *ids, size_t n, int width,
                            uint32_t eos, size_t *tokens) {
    enum { CHUNK = 4096 };
    uint8_t buf[4 * CHUNK];
    size_t used = 0;
    for (size_t d = 0; d < n; d++) {
        size_t count = ids ? ids[d].n : docs[d].len;
        for (size_t i = 0; i <= count; i++) {
            uint32_t id = i == count ? eos : ids ? ids[d].ids[i] : docs[d].text[i];
            for (int b = 0; b < width; b++) buf[used++] = (uint8_t)(id >> (8 * b));
            if (used == sizeof buf) {
                if (fwrite(buf, 1, used, fp) != used) return false;
                used = 0;
            }
        }
        *tokens += count + 1;
    }
    return fwrite(buf, 1, used, fp) == used;
}

// Writes to PATH.tmp and renames, so an interrupted or failed run never leaves a half file at
// PATH that a later training run would read as valid data.
static int write_tokens(const char *path, const TextSpan *docs, const TokenIds *ids, size_t n, int width,
                        uint32_t eos, size_t *tokens, MoeErr err) {
    size_t len = strlen(path);
    char *tmp = moe_malloc(len + 5);
    memcpy(tmp, path, len);
    memcpy(tmp + len, ".tmp", 5);
    int rc = 0;
    FILE *fp = fopen(tmp, "wb");
    if (!fp) rc = moe_err(err, "cannot write %s: %s", tmp, strerror(errno));
    else {
        bool ok = write_documents(fp, docs, ids, n, width, eos, tokens) && fflush(fp) == 0 &&
                  fsync(fileno(fp)) == 0;
        int saved = errno;
        if (fclose(fp) != 0 && ok) ok = false, saved = errno;
        if (!ok) rc = moe_err(err, "cannot write %s: %s", tmp, strerror(saved));
        else if (rename(tmp, path) != 0)
            rc = moe_err(err, "cannot rename %s to %s: %s", tmp, path, strerror(errno));
        if (rc) unlink(tmp);
    }
    free(tmp);
    return rc;
}

static int check_spec(const PrepareSpec *s, MoeErr err) {
    if (!(s->val_fraction >= 0 && s->val_fraction <= 0.5))
        return moe_err(err, "val_fraction %g is out of range: use 0 (no validation file) to 0.5", s->val_fraction);
    if (s->val_fraction > 0 && !s->val_path)
        return moe_err(err, "val_fraction %g needs a validation output path", s->val_fraction);
    if (!s->n_inputs) return moe_err(err, "no text file to prepare");
    return check_outputs(s, err);
}

int data_prepare(const PrepareSpec *s, PrepareStats *stats, MoeErr err) {
    memset(stats, 0, sizeof *stats);
    if (check_spec(s, err)) return -1;
    TextSpan *docs = moe_calloc(s->n_inputs, sizeof *docs), *spans = moe_calloc(s->n_inputs + 1, sizeof *spans);
    TokenIds *ids = NULL;
    size_t n_train = 0, n_spans = 0;
    int rc = read_inputs(s, docs, &stats->text_bytes, err);
    if (rc == 0) rc = split_documents(s, docs, stats->text_bytes, spans, &n_train, &n_spans, err);
    stats->token_bytes = s->tokenizer && tokenizer_vocab_size(s->tokenizer) > 65536 ? 4 : 2;
    if (rc == 0 && s->tokenizer) {
        ids = moe_calloc(n_spans, sizeof *ids);
        double t0 = moe_time_sec();
        rc = tokenizer_encode(s->tokenizer, spans, n_spans, s->threads, 0, ids, err);
        stats->encode_sec = moe_time_sec() - t0;
    }
    if (rc == 0)
        rc = write_tokens(s->train_path, spans, ids, n_train, stats->token_bytes, s->eos, &stats->tokens[0], err);
    if (rc == 0 && n_spans > n_train)
        rc = write_tokens(s->val_path, spans + n_train, ids ? ids + n_train : NULL, n_spans - n_train,
                          stats->token_bytes, s->eos, &stats->tokens[1], err);
    for (size_t i = 0; ids && i < n_spans; i++) token_ids_free(&ids[i]);
    for (size_t i = 0; i < s->n_inputs; i++) free((void *)docs[i].text);
    free(ids);
    free(spans);
    free(docs);
    return rc;
}
