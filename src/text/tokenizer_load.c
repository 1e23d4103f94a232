// Reads a Hugging Face tokenizer.json into a Tokenizer (tokenizer_impl.h): the BPE vocabulary and
// merges, the added tokens with the ids tokenizers gives them, and the pre-tokenizer steps with
// their patterns compiled by PCRE2 (after rewriting the escapes that Oniguruma, the engine of
// tokenizers, reads otherwise). Anything it cannot encode exactly as tokenizers does is refused
// with a message naming the file and the key.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "io/fsutil.h"
#include "tokenizer_impl.h"

// The pattern ByteLevel splits with when use_regex is true (GPT-2's).
static const char GPT2_PATTERN[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
// One character of Rust regex's Unicode \s and \w (tokenizers' lstrip, rstrip and single_word).
static const char SPACE_CLASS[] = "[\\s\\x{85}]";
static const char WORD_CLASS[] = "[\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\p{Join_Control}]";

// A JSON value as short text for messages.
static const char *json_text(const json_t *v, char *buf, size_t len) {
    char *s = v ? json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT) : NULL;
    snprintf(buf, len, "%.60s%s", s ? s : "(missing)", s && strlen(s) > 60 ? "..." : "");
    free(s);
    return buf;
}

// A key tokenizers requires (it refuses the file without it).
static int require_key(const Tokenizer *t, const json_t *obj, const char *what, const char *key, MoeErr err) {
    return json_object_get(obj, key) ? 0 : moe_err(err, "%s: %s has no \"%s\"", t->path, what, key);
}

static int get_bool(const Tokenizer *t, const json_t *obj, const char *what, const char *key, bool dflt,
                    bool *out, MoeErr err) {
    const json_t *v = json_object_get(obj, key);
    char buf[80];
    if (!v || json_is_null(v)) *out = dflt;
    else if (json_is_boolean(v)) *out = json_is_true(v);
    else return moe_err(err, "%s: %s.%s = %s must be true or false", t->path, what, key, json_text(v, buf, sizeof buf));
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Patterns

// Oniguruma's \s also takes U+0085, its \w is letters, marks, numbers and connectors, and its \h is
// a hex digit; PCRE2's differ. Inside a class the negated ones stay as PCRE2 reads them.
static const char *onig_escape(char e, bool in_class) {
    switch (e) {
    case 's': return in_class ? "\\s\\x{85}" : "[\\s\\x{85}]";
    case 'S': return in_class ? NULL : "[^\\s\\x{85}]";
    case 'w': return in_class ? "\\p{L}\\p{M}\\p{N}\\p{Pc}" : "[\\p{L}\\p{M}\\p{N}\\p{Pc}]";
    case 'W': return in_class ? NULL : "[^\\p{L}\\p{M}\\p{N}\\p{Pc}]";
    case 'h': return in_class ? "0-9A-Fa-f" : "[0-9A-Fa-f]";
    case 'H': return in_class ? NULL : "[^0-9A-Fa-f]";
    default: return NULL;
    }
}

static char *onig_to_pcre2(const char *p, size_t n) {
    char *out = moe_malloc(16 * n + 1), *o = out;
    bool in_class = false;
    for (size_t i = 0; i < n; i++) {
        if (p[i] == '\\' && i + 1 < n) {
            if (p[i + 1] == 'Q') { // quoted text, verbatim through \E
                const char *end = NULL;
                for (size_t j = i + 2; j + 1 < n && !end; j++)
                    if (p[j] == '\\' && p[j + 1] == 'E') end = p + j + 2;
                size_t len = end ? (size_t)(end - (p + i)) : n - i;
                memcpy(o, p + i, len), o += len, i += len - 1;
                continue;
            }
            const char *rep = onig_escape(p[i + 1], in_class);
            if (rep) o += sprintf(o, "%s", rep);
            else *o++ = p[i], *o++ = p[i + 1];
            i++;
            continue;
        }
        if (!in_class && p[i] == '[') {
            in_class = true;
            *o++ = p[i];
            if (i + 1 < n && p[i + 1] == '^') *o++ = p[++i];
            if (i + 1 < n && p[i + 1] == ']') *o++ = p[++i]; // a ']' first in a class is itself
            continue;
        }
        if (in_class && p[i] == ']') in_class = false;
        *o++ = p[i];
    }
    *o = 0;
    return out;
}

static int compile_pattern(const Tokenizer *t, const char *key, const char *pattern, size_t len,
                           bool literal, bool offset_limit, pcre2_code **out, MoeErr err) {
    uint32_t opts = PCRE2_UTF | PCRE2_MATCH_INVALID_UTF | (offset_limit ? PCRE2_USE_OFFSET_LIMIT : 0);
    if (literal) opts |= PCRE2_LITERAL;
    else opts |= PCRE2_UCP | PCRE2_MULTILINE | PCRE2_NEVER_BACKSLASH_C; // Oniguruma's ^ $ are per line
    char *text = literal ? NULL : onig_to_pcre2(pattern, len);
    pcre2_compile_context *cc = pcre2_compile_context_create(NULL);
    MOE_CHECK(cc, "out of host memory compiling a pattern");
    pcre2_set_newline(cc, PCRE2_NEWLINE_LF);
    int code;
    PCRE2_SIZE at;
    *out = pcre2_compile((PCRE2_SPTR)(text ? text : pattern), text ? PCRE2_ZERO_TERMINATED : len, opts,
                         &code, &at, cc);
    pcre2_compile_context_free(cc);
    free(text);
    if (!*out) {
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(code, msg, sizeof msg);
        return moe_err(err, "%s: %s does not compile with PCRE2: %s (at character %zu of the pattern)",
                       t->path, key, (const char *)msg, (size_t)at);
    }
    pcre2_jit_compile(*out, PCRE2_JIT_COMPLETE); // where JIT is not available, the interpreter runs it
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Pre-tokenizer

static int load_split(Tokenizer *t, const json_t *p, PretokStep *s, MoeErr err) {
    const json_t *pat = json_object_get(p, "pattern");
    const json_t *re = json_object_get(pat, "Regex"), *lit = json_object_get(pat, "String");
    const char *behavior = json_string_value(json_object_get(p, "behavior"));
    char buf[80], key[80];
    bool invert;
    if (!json_is_string(re) && !json_is_string(lit))
        return moe_err(err, "%s: %s.pattern = %s must be {\"Regex\": \"...\"} or {\"String\": \"...\"}", t->path,
                       s->what, json_text(pat, buf, sizeof buf));
    if (require_key(t, p, s->what, "invert", err) || get_bool(t, p, s->what, "invert", false, &invert, err))
        return -1;
    if (!behavior || (strcmp(behavior, "Isolated") && strcmp(behavior, "Removed")))
        return moe_err(err, "%s: %s.behavior = %s is not supported (moe.c reads \"Isolated\" and \"Removed\")",
                       t->path, s->what, json_text(json_object_get(p, "behavior"), buf, sizeof buf));
    bool removed = !strcmp(behavior, "Removed");
    s->keep_matches = !removed || invert; // Removed drops the delimiters: the matches, or with
    s->keep_gaps = !removed || !invert;   // invert the text between them
    const json_t *text = re ? re : lit;
    snprintf(key, sizeof key, "%s.pattern", s->what);
    return compile_pattern(t, key, json_string_value(text), json_string_length(text), !re, t->n_steps == 0,
                           &s->re, err);
}

static int load_byte_level(Tokenizer *t, const json_t *p, PretokStep *s, MoeErr err) {
    bool use_regex;
    s->byte_level = s->keep_matches = s->keep_gaps = true; // its split is Isolated
    if (require_key(t, p, s->what, "add_prefix_space", err) ||
        get_bool(t, p, s->what, "add_prefix_space", true, &s->prefix_space, err) ||
        get_bool(t, p, s->what, "use_regex", true, &use_regex, err))
        return -1;
    if (!use_regex) return 0;
    char key[80];
    snprintf(key, sizeof key, "%s (GPT-2's pattern)", s->what);
    return compile_pattern(t, key, GPT2_PATTERN, strlen(GPT2_PATTERN), false, t->n_steps == 0, &s->re, err);
}

static int load_pretok(Tokenizer *t, const json_t *p, const char *what, MoeErr err) {
    const char *type = json_string_value(json_object_get(p, "type"));
    char buf[80];
    if (!type)
        return moe_err(err, "%s: %s = %s has no \"type\"; moe.c reads byte-level BPE tokenizers, whose "
                       "pre_tokenizer is ByteLevel or a Sequence ending with it", t->path, what,
                       json_text(p, buf, sizeof buf));
    if (!strcmp(type, "Sequence")) {
        const json_t *list = json_object_get(p, "pretokenizers");
        if (!json_is_array(list)) return moe_err(err, "%s: %s.pretokenizers must be a list", t->path, what);
        for (size_t i = 0; i < json_array_size(list); i++) {
            char sub[48];
            snprintf(sub, sizeof sub, "%s.pretokenizers[%zu]", what, i);
            if (load_pretok(t, json_array_get(list, i), sub, err)) return -1;
        }
        return 0;
    }
    if (t->n_steps == TOK_MAX_STEPS)
        return moe_err(err, "%s: %s: more than %d pre-tokenizers", t->path, what, TOK_MAX_STEPS);
    PretokStep *s = &t->steps[t->n_steps];
    snprintf(s->what, sizeof s->what, "%s", what);
    int rc;
    if (!strcmp(type, "Split")) rc = load_split(t, p, s, err);
    else if (!strcmp(type, "ByteLevel")) rc = load_byte_level(t, p, s, err);
    else
        return moe_err(err, "%s: %s.type '%s' is not supported: moe.c reads byte-level BPE pre-tokenizers "
                       "(Sequence, Split, ByteLevel)", t->path, what, type);
    t->n_steps++; // counted even on failure, so that tokenizer_free releases its pattern
    return rc;
}

static int load_pretokenizer(Tokenizer *t, const json_t *root, MoeErr err) {
    const json_t *norm = json_object_get(root, "normalizer");
    char buf[80];
    if (norm && !json_is_null(norm))
        return moe_err(err, "%s: normalizer %s is not supported: moe.c reads tokenizers without a normalizer "
                       "(byte-level BPE ones: GPT-2, cl100k, dolma2, Llama 3)", t->path, json_text(norm, buf, sizeof buf));
    const json_t *p = json_object_get(root, "pre_tokenizer");
    if (!p || json_is_null(p))
        return moe_err(err, "%s: no pre_tokenizer: moe.c reads byte-level BPE tokenizers, whose pre_tokenizer "
                       "is ByteLevel or a Sequence ending with it", t->path);
    if (load_pretok(t, p, "pre_tokenizer", err)) return -1;
    for (int i = 0; i < t->n_steps || i == 0; i++)
        if (i == t->n_steps || t->steps[i].byte_level != (i == t->n_steps - 1))
            return moe_err(err, "%s: %s: the pre-tokenizer must end with ByteLevel, and only there (moe.c "
                           "reads byte-level BPE tokenizers)", t->path, i < t->n_steps ? t->steps[i].what : "pre_tokenizer");
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Vocabulary, merges and added tokens

static int load_vocab(Tokenizer *t, const json_t *vocab, MoeErr err) {
    if (!json_is_object(vocab)) return moe_err(err, "%s: model.vocab must be an object {token: id}", t->path);
    byte_map_init(&t->bpe.vocab, json_object_size(vocab));
    const char *key;
    json_t *v;
    char buf[80];
    json_object_foreach((json_t *)vocab, key, v) {
        json_int_t id = json_is_integer(v) ? json_integer_value(v) : -1;
        if (id < 0 || id >= TOK_MAX_IDS)
            return moe_err(err, "%s: model.vocab[\"%.40s\"] = %s is not a token id (an integer from 0 to %u)",
                           t->path, key, json_text(v, buf, sizeof buf), TOK_MAX_IDS - 1);
        byte_map_put(&t->bpe.vocab, (const uint8_t *)key, strlen(key), (uint64_t)id);
        if ((size_t)id >= t->n_ids) t->n_ids = (size_t)id + 1;
    }
    for (int b = 0; b < 256; b++) {
        uint64_t id;
        if (!byte_map_get(&t->bpe.vocab, t->bpe.spelled[b], t->bpe.spelled_len[b], &id))
            return moe_err(err, "%s: model.vocab has no token for byte 0x%02x (\"%.*s\"): a byte-level BPE "
                           "vocabulary has one for each of the 256 bytes", t->path, b, t->bpe.spelled_len[b],
                           (const char *)t->bpe.spelled[b]);
        t->bpe.byte_id[b] = (uint32_t)id;
    }
    return 0;
}

// Merge i as its two tokens: "a b" (one space) or ["a", "b"]. 1: a "#version" line to skip.
static int merge_parts(const Tokenizer *t, const json_t *m, size_t i, const char **a, size_t *la,
                       const char **b, size_t *lb, MoeErr err) {
    char buf[80];
    if (json_is_array(m) && json_array_size(m) == 2 && json_is_string(json_array_get(m, 0)) &&
        json_is_string(json_array_get(m, 1))) {
        *a = json_string_value(json_array_get(m, 0)), *la = json_string_length(json_array_get(m, 0));
        *b = json_string_value(json_array_get(m, 1)), *lb = json_string_length(json_array_get(m, 1));
        return 0;
    }
    const char *s = json_string_value(m);
    size_t len = json_string_length(m);
    if (s && !strncmp(s, "#version", 8)) return 1;
    const char *space = s ? memchr(s, ' ', len) : NULL;
    if (!space || memchr(space + 1, ' ', len - (size_t)(space + 1 - s)))
        return moe_err(err, "%s: model.merges[%zu] = %s is not two tokens: \"a b\" (one space) or [\"a\", \"b\"]",
                       t->path, i, json_text(m, buf, sizeof buf));
    *a = s, *la = (size_t)(space - s), *b = space + 1, *lb = len - *la - 1;
    return 0;
}

static int vocab_id(const Tokenizer *t, const char *s, size_t len, size_t i, uint32_t *id, MoeErr err) {
    uint64_t v;
    if (!byte_map_get(&t->bpe.vocab, (const uint8_t *)s, len, &v))
        return moe_err(err, "%s: model.merges[%zu]: \"%.*s\" is not in model.vocab", t->path, i,
                       (int)(len < 60 ? len : 60), s);
    *id = (uint32_t)v;
    return 0;
}

static int load_merges(Tokenizer *t, const json_t *merges, MoeErr err) {
    if (!json_is_array(merges)) return moe_err(err, "%s: model.merges must be a list", t->path);
    size_t n = json_array_size(merges), cap = 0;
    pair_map_init(&t->bpe.merges, n);
    char *joined = NULL;
    uint32_t rank = 0;
    int rc = 0;
    for (size_t i = 0; i < n && rc == 0; i++) {
        const char *a = NULL, *b = NULL;
        size_t la = 0, lb = 0;
        uint32_t ia = 0, ib = 0, merged = 0;
        rc = merge_parts(t, json_array_get(merges, i), i, &a, &la, &b, &lb, err);
        if (rc == 1) { // tokenizers skips it without counting a rank
            rc = 0;
            continue;
        }
        if (rc) break;
        if (la + lb > cap) joined = moe_realloc(joined, cap = 2 * (la + lb));
        memcpy(joined, a, la);
        memcpy(joined + la, b, lb);
        rc = vocab_id(t, a, la, i, &ia, err) || vocab_id(t, b, lb, i, &ib, err) ||
             vocab_id(t, joined, la + lb, i, &merged, err) ? -1 : 0;
        if (rc == 0) pair_map_put(&t->bpe.merges, ia, ib, rank++, merged);
    }
    free(joined);
    return rc;
}

static int load_model(Tokenizer *t, const json_t *root, MoeErr err) {
    const json_t *model = json_object_get(root, "model");
    char buf[80];
    if (!json_is_object(model)) return moe_err(err, "%s: no \"model\" object: not a tokenizer.json", t->path);
    const char *type = json_string_value(json_object_get(model, "type"));
    if (type && strcmp(type, "BPE"))
        return moe_err(err, "%s: model.type '%s' is not supported: moe.c reads byte-level BPE tokenizers", t->path, type);
    const json_t *dropout = json_object_get(model, "dropout");
    if (dropout && !json_is_null(dropout) && json_number_value(dropout) != 0)
        return moe_err(err, "%s: model.dropout = %s: BPE dropout is random; moe.c encodes without it (null)",
                       t->path, json_text(dropout, buf, sizeof buf));
    static const char *const AFFIXES[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int i = 0; i < 2; i++) {
        const json_t *v = json_object_get(model, AFFIXES[i]);
        if (v && !json_is_null(v) && !(json_is_string(v) && json_string_length(v) == 0))
            return moe_err(err, "%s: model.%s = %s is not supported (byte-level BPE has none)", t->path,
                           AFFIXES[i], json_text(v, buf, sizeof buf));
    }
    if (get_bool(t, model, "model", "ignore_merges", false, &t->bpe.ignore_merges, err)) return -1;
    return load_vocab(t, json_object_get(model, "vocab"), err) ||
           load_merges(t, json_object_get(model, "merges"), err) ? -1 : 0;
}

// tokenizers gives an added token the id of the same text in the vocabulary or among the added
// tokens before it (whose properties it then replaces), else the next id after the vocabulary's
// entries; the file's "id" is not used.
static int load_added_token(Tokenizer *t, const json_t *a, size_t i, ByteMap *seen, uint32_t *next_id,
                            MoeErr err) {
    const json_t *content = json_object_get(a, "content");
    char what[40], buf[80];
    snprintf(what, sizeof what, "added_tokens[%zu]", i);
    if (!json_is_string(content))
        return moe_err(err, "%s: %s.content = %s must be a string", t->path, what, json_text(content, buf, sizeof buf));
    AddedToken tok = {.len = json_string_length(content)};
    bool special = false;
    if (get_bool(t, a, what, "special", false, &special, err) ||
        get_bool(t, a, what, "normalized", !special, &tok.normalized, err) ||
        get_bool(t, a, what, "lstrip", false, &tok.lstrip, err) ||
        get_bool(t, a, what, "rstrip", false, &tok.rstrip, err) ||
        get_bool(t, a, what, "single_word", false, &tok.single_word, err))
        return -1;
    if (!tok.len) return 0; // tokenizers ignores empty tokens
    const uint8_t *text = (const uint8_t *)json_string_value(content);
    uint64_t k = t->n_added, id;
    if (byte_map_get(seen, text, tok.len, &k)) tok.id = t->added[k].id, tok.content = t->added[k].content;
    else if (byte_map_get(&t->bpe.vocab, text, tok.len, &id)) tok.id = (uint32_t)id;
    else if (*next_id >= TOK_MAX_IDS) return moe_err(err, "%s: %s: more than %u ids", t->path, what, TOK_MAX_IDS);
    else tok.id = (*next_id)++;
    if (k == t->n_added) {
        tok.content = moe_malloc(tok.len);
        memcpy(tok.content, text, tok.len);
        byte_map_put(seen, text, tok.len, t->n_added++);
    }
    t->added[k] = tok;
    if ((size_t)tok.id >= t->n_ids) t->n_ids = (size_t)tok.id + 1;
    return 0;
}

typedef struct {
    uint8_t first;
    size_t len;
    uint32_t index;
} AddedKey;

static int added_key_order(const void *pa, const void *pb) {
    const AddedKey *a = pa, *b = pb;
    if (a->first != b->first) return a->first < b->first ? -1 : 1;
    if (a->len != b->len) return a->len > b->len ? -1 : 1; // longest first
    return a->index < b->index ? -1 : a->index > b->index;
}

// The tokens of pass p (0: normalized = false, 1: true) by first byte, longest first.
static void build_pass(Tokenizer *t, int p) {
    AddedPass *pass = &t->pass[p];
    AddedKey *keys = moe_malloc((t->n_added + 1) * sizeof *keys);
    size_t n = 0;
    for (size_t i = 0; i < t->n_added; i++)
        if (t->added[i].normalized == (p == 1))
            keys[n++] = (AddedKey){t->added[i].content[0], t->added[i].len, (uint32_t)i};
    qsort(keys, n, sizeof *keys, added_key_order);
    pass->order = moe_malloc((n + 1) * sizeof *pass->order);
    for (size_t i = 0; i < n; i++) pass->order[i] = keys[i].index;
    for (int b = 0, i = 0; b <= 256; b++) {
        while ((size_t)i < n && keys[i].first < b) i++;
        pass->first[b] = (size_t)i;
    }
    for (int b = 0; b < 256; b++) pass->starts[b] = pass->first[b + 1] > pass->first[b];
    free(keys);
}

static int load_added(Tokenizer *t, const json_t *root, MoeErr err) {
    const json_t *list = json_object_get(root, "added_tokens");
    if (list && !json_is_null(list) && !json_is_array(list))
        return moe_err(err, "%s: added_tokens must be a list", t->path);
    size_t n = json_array_size(list);
    t->added = moe_calloc(n + 1, sizeof *t->added);
    uint32_t next_id = (uint32_t)t->bpe.vocab.n;
    ByteMap seen; // content -> index in t->added
    byte_map_init(&seen, n);
    int rc = 0;
    for (size_t i = 0; i < n && rc == 0; i++) {
        const json_t *a = json_array_get(list, i);
        rc = json_is_object(a) ? load_added_token(t, a, i, &seen, &next_id, err)
                               : moe_err(err, "%s: added_tokens[%zu] must be an object", t->path, i);
    }
    byte_map_free(&seen);
    build_pass(t, 0);
    build_pass(t, 1);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// Decoding table

// What a token decodes to (tokenizers' ByteLevel decoder): its characters mapped back to bytes when
// all are in the byte-level alphabet, else its own UTF-8 text. Returns the length written to out.
static size_t decoded_bytes(const Bpe *bpe, const uint8_t *s, size_t n, uint8_t *out) {
    size_t len = 0;
    for (size_t i = 0; i < n;) {
        uint32_t c;
        int l = tok_utf8_char(s + i, n - i, &c), b = l > 0 ? bpe_char_byte(bpe, c) : -1;
        if (b < 0) {
            memcpy(out, s, n);
            return n;
        }
        out[len++] = (uint8_t)b;
        i += (size_t)l;
    }
    return len;
}

// An id given to two texts that decode differently (a file may do so) decodes as the last one,
// the added token where there is one, as in tokenizers; then decoding is not the inverse of encoding.
static void set_decoded(Tokenizer *t, size_t *used, uint32_t id, const uint8_t *s, size_t n) {
    size_t len = decoded_bytes(&t->bpe, s, n, t->token_bytes + *used);
    if (t->token_len[id] != UINT32_MAX &&
        (t->token_len[id] != len || memcmp(t->token_bytes + t->token_off[id], t->token_bytes + *used, len)))
        t->lossless = false;
    t->token_off[id] = *used;
    t->token_len[id] = (uint32_t)len;
    *used += len;
}

static void build_decoding(Tokenizer *t, const json_t *vocab) {
    size_t total = 0, used = 0;
    for (size_t i = 0; i < t->n_added; i++) total += t->added[i].len;
    t->token_bytes = moe_malloc(total + t->bpe.vocab.keys_len + 1);
    t->token_off = moe_calloc(t->n_ids, sizeof *t->token_off);
    t->token_len = moe_malloc(t->n_ids * sizeof *t->token_len);
    for (size_t i = 0; i < t->n_ids; i++) t->token_len[i] = UINT32_MAX;
    const char *key;
    json_t *v;
    t->lossless = true;
    json_object_foreach((json_t *)vocab, key, v)
        set_decoded(t, &used, (uint32_t)json_integer_value(v), (const uint8_t *)key, strlen(key));
    for (size_t i = 0; i < t->n_added; i++) { // an added token decodes as its content goes through
        const AddedToken *a = &t->added[i];  // the decoder, which may not give the content back
        set_decoded(t, &used, a->id, a->content, a->len);
        t->lossless &= !a->lstrip && !a->rstrip && t->token_len[a->id] == a->len &&
                       !memcmp(t->token_bytes + t->token_off[a->id], a->content, a->len);
    }
    for (int i = 0; i < t->n_steps; i++)
        t->lossless &= t->steps[i].keep_matches && t->steps[i].keep_gaps && !t->steps[i].prefix_space;
}

// ---------------------------------------------------------------------------------------------

static int load_classes(Tokenizer *t, MoeErr err) {
    bool space = false, word = false;
    for (size_t i = 0; i < t->n_added; i++) {
        space |= t->added[i].lstrip || t->added[i].rstrip;
        word |= t->added[i].single_word;
    }
    return (space && compile_pattern(t, "(lstrip/rstrip class)", SPACE_CLASS, strlen(SPACE_CLASS), false,
                                     false, &t->is_space, err)) ||
           (word && compile_pattern(t, "(single_word class)", WORD_CLASS, strlen(WORD_CLASS), false, false,
                                    &t->is_word, err)) ? -1 : 0;
}

Tokenizer *tokenizer_load(const char *path, MoeErr err) {
    uint8_t *text;
    size_t len;
    if (fs_read_file(path, "tokenizer file", &text, &len, err)) return NULL;
    Tokenizer *t = moe_calloc(1, sizeof *t);
    t->path = moe_strdup(path);
    snprintf(t->hash, sizeof t->hash, "%016llx", (unsigned long long)XXH3_64bits(text, len));
    bpe_init_alphabet(&t->bpe);
    json_t *root = fs_parse_json(path, (const char *)text, len, err);
    free(text);
    int rc = root ? 0 : -1;
    if (rc == 0 && !json_is_object(root)) rc = moe_err(err, "%s: not a tokenizer.json (not a JSON object)", path);
    if (rc == 0) rc = load_model(t, root, err);
    if (rc == 0) rc = load_added(t, root, err);
    if (rc == 0) rc = load_pretokenizer(t, root, err);
    if (rc == 0) rc = load_classes(t, err);
    if (rc == 0) build_decoding(t, json_object_get(json_object_get(root, "model"), "vocab"));
    json_decref(root);
    if (rc == 0) return t;
    tokenizer_free(t);
    return NULL;
}

void tokenizer_free(Tokenizer *t) {
    if (!t) return;
    free(t->path);
    byte_map_free(&t->bpe.vocab);
    pair_map_free(&t->bpe.merges);
    free(t->token_bytes);
    free(t->token_off);
    free(t->token_len);
    for (size_t i = 0; i < t->n_added; i++) free(t->added[i].content);
    free(t->added);
    for (int p = 0; p < 2; p++) free(t->pass[p].order);
    for (int i = 0; i < t->n_steps; i++) pcre2_code_free(t->steps[i].re);
    pcre2_code_free(t->is_space);
    pcre2_code_free(t->is_word);
    free(t);
}
