// Encoding with a Tokenizer, as tokenizers' encode does it: added tokens are cut out of the text
// first (two passes: tokens with normalized = false, then the others), each stretch of text between
// them goes through the pre-tokenizer steps (each Split a PCRE2 sweep over its piece, matches and
// the text between them becoming pieces of the next step), and every final piece through BPE.
// Long stretches are cut into chunks that threads sweep at once. A chunk's sweep starts at its cut
// as if the sweep before had stopped there; the chunk before takes every match that starts before
// the cut, and where its last one ran past the cut (or text it could not match lies across it),
// the next chunk is swept again from where it really stopped. So the ids are those of one sweep,
// whatever the threads and chunks. Also decoding and the tokenizer's accessors.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer_impl.h"

void token_ids_push(TokenIds *v, uint32_t id) {
    if (v->n == v->cap) {
        v->cap = v->cap ? 2 * v->cap : 64;
        v->ids = moe_realloc(v->ids, v->cap * sizeof *v->ids);
    }
    v->ids[v->n++] = id;
}

void token_ids_append(TokenIds *v, const uint32_t *ids, size_t n) {
    if (!n) return;
    if (v->n + n > v->cap) {
        v->cap = 2 * (v->n + n);
        v->ids = moe_realloc(v->ids, v->cap * sizeof *v->ids);
    }
    memcpy(v->ids + v->n, ids, n * sizeof *ids);
    v->n += n;
}

void token_ids_free(TokenIds *v) {
    free(v->ids);
    memset(v, 0, sizeof *v);
}

// ---------------------------------------------------------------------------------------------
// Accessors and decoding

const char *tokenizer_path(const Tokenizer *t) { return t->path; }
const char *tokenizer_hash(const Tokenizer *t) { return t->hash; }
size_t tokenizer_vocab_size(const Tokenizer *t) { return t->n_ids; }
bool tokenizer_lossless(const Tokenizer *t) { return t->lossless; }

const uint8_t *tokenizer_token_bytes(const Tokenizer *t, uint32_t id, size_t *len) {
    if (id >= t->n_ids || t->token_len[id] == UINT32_MAX) return NULL;
    *len = t->token_len[id];
    return t->token_bytes + t->token_off[id];
}

bool tokenizer_token_id(const Tokenizer *t, const char *text, uint32_t *id) {
    size_t len = strlen(text);
    for (size_t i = 0; i < t->n_added; i++)
        if (t->added[i].len == len && !memcmp(t->added[i].content, text, len)) return *id = t->added[i].id, true;
    uint64_t v;
    if (!byte_map_get(&t->bpe.vocab, (const uint8_t *)text, len, &v)) return false;
    *id = (uint32_t)v;
    return true;
}

int tokenizer_eos(const Tokenizer *t, const char *spec, uint32_t *id, MoeErr err) {
    static const char *const NAMES[] = {"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"};
    if (!spec) {
        for (size_t i = 0; i < sizeof NAMES / sizeof NAMES[0]; i++)
            if (tokenizer_token_id(t, NAMES[i], id)) return 0;
        return moe_err(err, "%s has no end-of-text token (none of <|endoftext|>, <|end_of_text|>, </s>, <eos>): "
                       "name the one that ends a document with --eos TOKEN or --eos ID", t->path);
    }
    char *end;
    unsigned long long v = strtoull(spec, &end, 10);
    size_t len;
    if (spec[0] >= '0' && spec[0] <= '9' && !*end) {
        if (v >= t->n_ids || !tokenizer_token_bytes(t, (uint32_t)v, &len))
            return moe_err(err, "--eos %s: %s has no token with this id (ids below %zu)", spec, t->path, t->n_ids);
        *id = (uint32_t)v;
        return 0;
    }
    if (!tokenizer_token_id(t, spec, id))
        return moe_err(err, "--eos %s: %s has no such token (give an added token's content, a vocabulary entry "
                       "as the file spells it, or an id)", spec, t->path);
    return 0;
}

// ---------------------------------------------------------------------------------------------
// One thread's state

typedef struct {
    const Tokenizer *t;
    BpeWork bpe;
    pcre2_match_data *md;
    pcre2_match_context *plain, *limited; // the second with an offset limit (first step's chunks)
    pcre2_jit_stack *stack;
    uint8_t *prefixed[TOK_MAX_STEPS];     // a piece with ByteLevel's prefix space, per step
    size_t prefixed_cap[TOK_MAX_STEPS];
    TokenIds *out;
    int fail_step;                        // the step whose pattern failed
} EncodeWork;

static pcre2_match_context *match_context(pcre2_jit_stack *stack) {
    pcre2_match_context *c = pcre2_match_context_create(NULL);
    MOE_CHECK(c, "out of host memory for a PCRE2 match context");
    pcre2_set_match_limit(c, TOK_MATCH_LIMIT);
    pcre2_jit_stack_assign(c, NULL, stack);
    return c;
}

static void work_init(EncodeWork *w, const Tokenizer *t) {
    memset(w, 0, sizeof *w);
    w->t = t;
    bpe_work_init(&w->bpe);
    w->md = pcre2_match_data_create(1, NULL);
    w->stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, NULL);
    MOE_CHECK(w->md && w->stack, "out of host memory for PCRE2 match data");
    w->plain = match_context(w->stack);
    w->limited = match_context(w->stack);
}

static void work_free(EncodeWork *w) {
    bpe_work_free(&w->bpe);
    pcre2_match_data_free(w->md);
    pcre2_match_context_free(w->plain);
    pcre2_match_context_free(w->limited);
    pcre2_jit_stack_free(w->stack);
    for (int i = 0; i < TOK_MAX_STEPS; i++) free(w->prefixed[i]);
}

// ---------------------------------------------------------------------------------------------
// Pre-tokenization and BPE

static int sweep(EncodeWork *w, int step, const uint8_t *subj, size_t n, size_t from, size_t stop,
                 size_t *reached);

// Runs one piece through steps `step`.. and BPE. Empty pieces are dropped, as tokenizers does.
static int piece(EncodeWork *w, int step, const uint8_t *s, size_t n) {
    const Tokenizer *t = w->t;
    if (n == 0) return 0;
    if (step == t->n_steps) {
        bpe_encode(&t->bpe, &w->bpe, s, n, w->out);
        return 0;
    }
    const PretokStep *st = &t->steps[step];
    if (st->prefix_space && s[0] != ' ') {
        if (n + 1 > w->prefixed_cap[step])
            w->prefixed[step] = moe_realloc(w->prefixed[step], w->prefixed_cap[step] = 2 * (n + 1));
        w->prefixed[step][0] = ' ';
        memcpy(w->prefixed[step] + 1, s, n);
        s = w->prefixed[step], n++;
    }
    if (!st->re) return piece(w, step + 1, s, n);
    size_t reached;
    return sweep(w, step, s, n, 0, n, &reached);
}

// Splits subj[from ..) with step's pattern, as Oniguruma's find_iter walks it (an empty match right
// where the last match ended is skipped), passing the kept pieces to the next step. With stop < n
// it takes only the matches that start before stop (and the text before each), leaving the rest;
// *reached is where the next sweep must start (the end of the last match taken, or n).
static int sweep(EncodeWork *w, int step, const uint8_t *subj, size_t n, size_t from, size_t stop,
                 size_t *reached) {
    const PretokStep *st = &w->t->steps[step];
    pcre2_match_context *ctx = w->plain;
    if (stop < n) {
        if (from >= stop) return *reached = from, 0;
        ctx = w->limited;
        pcre2_set_offset_limit(ctx, stop - 1);
    }
    size_t pos = from, search = from, last_end = from > 0 ? from : SIZE_MAX;
    int rc = 0;
    while (search <= n && rc == 0) {
        rc = pcre2_match(st->re, subj, n, search, 0, w->md, ctx);
        if (rc == PCRE2_ERROR_NOMATCH) {
            rc = 0;
            break;
        }
        if (rc < 0) {
            w->fail_step = step;
            return rc;
        }
        const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(w->md);
        size_t e = ov[1], s = ov[0] < e ? ov[0] : e;
        if (s == e && e == last_end) {
            uint32_t c;
            int len = tok_utf8_char(subj + s, n - s, &c);
            search = s + (len > 0 ? (size_t)len : 1);
            rc = 0;
            continue;
        }
        rc = s > pos && st->keep_gaps ? piece(w, step + 1, subj + pos, s - pos) : 0;
        if (rc == 0 && e > s && st->keep_matches) rc = piece(w, step + 1, subj + s, e - s);
        pos = search = last_end = e;
    }
    if (rc == 0 && stop >= n) {
        if (pos < n && st->keep_gaps) rc = piece(w, step + 1, subj + pos, n - pos);
        pos = n;
    }
    *reached = pos;
    return rc;
}

// ---------------------------------------------------------------------------------------------
// Added tokens

typedef struct {
    size_t start, end; // bytes of the document
    int64_t token;     // an added token's id, or -1: text
} Segment;

typedef struct {
    Segment *s;
    size_t n, cap;
} Segments;

static void segments_push(Segments *v, size_t start, size_t end, int64_t token) {
    if (v->n == v->cap) v->s = moe_realloc(v->s, (v->cap = 2 * v->cap + 16) * sizeof *v->s);
    v->s[v->n++] = (Segment){start, end, token};
}

// Whether the character at s[0 .. n) is in the class `cls`.
static bool char_in(const EncodeWork *w, const pcre2_code *cls, const uint8_t *s, size_t n, size_t *len) {
    uint32_t c;
    int l = tok_utf8_char(s, n, &c);
    *len = l > 0 ? (size_t)l : 1;
    return l > 0 && pcre2_match(cls, s, (size_t)l, 0, PCRE2_ANCHORED, w->md, NULL) >= 0;
}

// The start of the character that ends at p (a byte that ends none counts as one).
static size_t char_before(const uint8_t *doc, size_t lo, size_t p) {
    uint32_t c;
    for (size_t k = 1; k <= 4 && k <= p - lo; k++)
        if (tok_utf8_char(doc + p - k, k, &c) == (int)k) return p - k;
    return p - 1;
}

// The leftmost, then longest, token of pass `p` that starts in doc[from .. end).
static const AddedToken *added_next(const Tokenizer *t, const AddedPass *pass, const uint8_t *doc,
                                    size_t from, size_t end, size_t *at) {
    for (size_t i = from; i < end; i++) {
        if (!pass->starts[doc[i]]) continue;
        for (size_t k = pass->first[doc[i]]; k < pass->first[doc[i] + 1]; k++) {
            const AddedToken *a = &t->added[pass->order[k]];
            if (a->len <= end - i && !memcmp(doc + i, a->content, a->len)) return *at = i, a;
        }
    }
    return NULL;
}

static bool single_word_ok(const EncodeWork *w, const uint8_t *doc, size_t lo, size_t hi, size_t start,
                           size_t stop) {
    size_t len, before = start > lo ? char_before(doc, lo, start) : start;
    bool open = start == lo || !char_in(w, w->t->is_word, doc + before, start - before, &len);
    return open && (stop == hi || !char_in(w, w->t->is_word, doc + stop, hi - stop, &len));
}

// tokenizers' AddedVocabulary::find_matches over the sentence doc[lo, hi): a token is taken where it
// starts leftmost (longest first); one that is not a single word where it must be is passed over.
static void added_split(const EncodeWork *w, int p, const uint8_t *doc, size_t lo, size_t hi, Segments *out) {
    const Tokenizer *t = w->t;
    size_t done = lo, at, len;
    for (size_t i = lo; i < hi;) {
        const AddedToken *a = added_next(t, &t->pass[p], doc, i, hi, &at);
        if (!a) break;
        size_t start = at, stop = at + a->len;
        i = stop;
        if (a->single_word && !single_word_ok(w, doc, lo, hi, start, stop)) continue;
        while (a->lstrip && start > done) { // the whitespace before it, back to the last token taken
            size_t b = char_before(doc, lo, start);
            if (b < done || !char_in(w, t->is_space, doc + b, start - b, &len)) break;
            start = b;
        }
        if (a->rstrip)
            while (stop < hi && char_in(w, t->is_space, doc + stop, hi - stop, &len)) stop += len;
        if (done < start) segments_push(out, done, start, -1);
        segments_push(out, start, stop, a->id);
        done = i = stop;
    }
    if (done < hi) segments_push(out, done, hi, -1);
}

// ---------------------------------------------------------------------------------------------
// Work items: an added token, or a chunk of a stretch of text

typedef struct {
    size_t doc;
    int64_t token;          // an added token's id (no text), else -1
    const uint8_t *subject; // the stretch of text, with ByteLevel's prefix space when it takes one
    size_t len;             // its bytes
    size_t at;              // where the stretch starts in its document (for messages)
    size_t from, stop;      // the chunk: see sweep()
    size_t reached;
    TokenIds ids;
    int rc, fail_step;      // a PCRE2 error
} EncodeItem;

typedef struct {
    EncodeItem *items;
    size_t n, cap;
    uint8_t **owned; // prefixed copies of stretches
    size_t n_owned;
} EncodePlan;

static EncodeItem *plan_item(EncodePlan *p, size_t doc, int64_t token) {
    if (p->n == p->cap) p->items = moe_realloc(p->items, (p->cap = 2 * p->cap + 64) * sizeof *p->items);
    EncodeItem *it = &p->items[p->n++];
    *it = (EncodeItem){.doc = doc, .token = token};
    return it;
}

// A cut near `at` where sweeps usually pass: after a newline, before a character that is not
// whitespace (within `window` bytes); else the next character start.
static size_t chunk_cut(const uint8_t *s, size_t n, size_t at, size_t window) {
    size_t end = window < n - at ? at + window : n;
    for (size_t i = at; i + 1 < end; i++)
        if (s[i] == '\n' && s[i + 1] != ' ' && s[i + 1] != '\t' && s[i + 1] != '\r' && s[i + 1] != '\n')
            return i + 1;
    while (at < n && (s[at] & 0xC0) == 0x80) at++;
    return at;
}

static void plan_stretch(EncodePlan *p, const Tokenizer *t, size_t doc, const uint8_t *text, size_t n,
                         size_t at, size_t chunk) {
    if (t->steps[0].prefix_space && text[0] != ' ') {
        uint8_t *copy = moe_malloc(n + 1);
        copy[0] = ' ';
        memcpy(copy + 1, text, n);
        p->owned = moe_realloc(p->owned, (p->n_owned + 1) * sizeof *p->owned);
        p->owned[p->n_owned++] = copy;
        text = copy, n++;
    }
    size_t from = 0;
    while (t->steps[0].re && n - from > chunk) {
        size_t cut = chunk_cut(text, n, from + chunk, chunk / 2);
        if (cut >= n) break;
        EncodeItem *it = plan_item(p, doc, -1);
        it->subject = text, it->len = n, it->at = at, it->from = from, it->stop = cut;
        from = cut;
    }
    EncodeItem *it = plan_item(p, doc, -1);
    it->subject = text, it->len = n, it->at = at, it->from = from, it->stop = n;
}

static void plan_document(EncodePlan *p, const EncodeWork *w, size_t d, const TextSpan *doc, size_t chunk) {
    Segments first = {0}, all = {0};
    added_split(w, 0, doc->text, 0, doc->len, &first);
    for (size_t i = 0; i < first.n; i++) {
        const Segment *s = &first.s[i];
        if (s->token >= 0) segments_push(&all, s->start, s->end, s->token);
        else added_split(w, 1, doc->text, s->start, s->end, &all);
    }
    for (size_t i = 0; i < all.n; i++) {
        const Segment *s = &all.s[i];
        if (s->token >= 0) token_ids_push(&plan_item(p, d, s->token)->ids, (uint32_t)s->token);
        else plan_stretch(p, w->t, d, doc->text + s->start, s->end - s->start, s->start, chunk);
    }
    free(first.s);
    free(all.s);
}

static void run_item(EncodeWork *w, EncodeItem *it) {
    if (it->token >= 0) return;
    w->out = &it->ids;
    it->ids.n = 0;
    if (!w->t->steps[0].re) {
        it->rc = piece(w, 1, it->subject, it->len);
        it->reached = it->len;
    } else it->rc = sweep(w, 0, it->subject, it->len, it->from, it->stop, &it->reached);
    it->fail_step = w->fail_step;
}

// Sweeps again, one after another, the chunks whose cut the chunk before did not stop at.
static void resync_chunks(EncodeWork *w, EncodePlan *p) {
    for (size_t i = 1; i < p->n; i++) {
        EncodeItem *prev = &p->items[i - 1], *it = &p->items[i];
        if (it->token >= 0 || prev->token >= 0 || it->subject != prev->subject || prev->rc || it->from == prev->reached)
            continue;
        it->from = prev->reached;
        run_item(w, it);
    }
}

static int encode_failure(const Tokenizer *t, const EncodePlan *p, const TextSpan *docs, MoeErr err) {
    for (size_t i = 0; i < p->n; i++) {
        const EncodeItem *it = &p->items[i];
        if (!it->rc) continue;
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(it->rc, msg, sizeof msg);
        return moe_err(err, "%s: near byte %zu: the pattern of %s in %s failed: %s (PCRE2 allows a match "
                       "%d steps)", docs[it->doc].name, it->at + it->from, t->steps[it->fail_step].what,
                       t->path, (const char *)msg, TOK_MATCH_LIMIT);
    }
    return 0;
}

// Chunks of about a sixteenth of each thread's share of the text: enough to balance the threads.
static size_t default_chunk(const TextSpan *docs, size_t n_docs, int threads) {
    if (threads == 1) return SIZE_MAX;
    size_t total = 0;
    for (size_t d = 0; d < n_docs; d++) total += docs[d].len;
    size_t c = total / (16 * (size_t)threads);
    return c < 65536 ? 65536 : c > 16777216 ? 16777216 : c;
}

int tokenizer_encode(const Tokenizer *t, const TextSpan *docs, size_t n_docs, int threads,
                     size_t chunk_bytes, TokenIds *ids, MoeErr err) {
    threads = threads < 1 ? 1 : threads;
    size_t chunk = chunk_bytes ? chunk_bytes : default_chunk(docs, n_docs, threads);
    EncodeWork w0;
    work_init(&w0, t);
    EncodePlan p = {0};
    for (size_t d = 0; d < n_docs; d++) plan_document(&p, &w0, d, &docs[d], chunk);
#pragma omp parallel num_threads(threads)
    {
        EncodeWork w;
        work_init(&w, t);
#pragma omp for schedule(dynamic, 1)
        for (size_t i = 0; i < p.n; i++) run_item(&w, &p.items[i]);
        work_free(&w);
    }
    resync_chunks(&w0, &p);
    work_free(&w0);
    int rc = encode_failure(t, &p, docs, err);
    for (size_t i = 0; i < p.n; i++) {
        if (rc == 0) token_ids_append(&ids[p.items[i].doc], p.items[i].ids.ids, p.items[i].ids.n);
        token_ids_free(&p.items[i].ids);
    }
    for (size_t i = 0; i < p.n_owned; i++) free(p.owned[i]);
    free(p.owned);
    free(p.items);
    return rc;
}
