// Tests of the tokenizer (src/text): the ids Hugging Face tokenizers gives for varied text
// (tests/data/tokenizers, made by scripts/make_tokenizer_tests.py), the same ids whatever the
// threads and chunks, decoding back to the bytes, bad tokenizer files, the EOS lookup, and the
// token files `moe data prepare --tokenizer` writes (uint16 and uint32).
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "io/fsutil.h"
#include "io/tokens.h"
#include "test.h"
#include "test_files.h"
#include "text/prepare.h"
#include "text/tokenizer.h"

#define TOK_DIR "tests/data/tokenizers/"
static const char *const TOKENIZERS[] = {"gpt2-style.json", "cl100k-style.json", "extras.json"};
#define N_TOKENIZERS 3

typedef struct {
    const char *name;
    uint8_t *text;
    size_t len;
    const json_t *ids; // {tokenizer file: [ids]}
} Case;

typedef struct {
    json_t *root;
    Case *cases;
    size_t n;
} Cases;

static Cases load_cases(void) {
    MoeErr err;
    Cases c = {fs_load_json(TOK_DIR "cases.json", "test cases", err), NULL, 0};
    MOE_CHECK(c.root, "%s", err);
    const json_t *list = json_object_get(c.root, "cases");
    c.n = json_array_size(list);
    c.cases = moe_calloc(c.n, sizeof *c.cases);
    for (size_t i = 0; i < c.n; i++) {
        const json_t *j = json_array_get(list, i);
        const char *hex = json_string_value(json_object_get(j, "hex"));
        Case *k = &c.cases[i];
        k->name = json_string_value(json_object_get(j, "name"));
        k->ids = json_object_get(j, "ids");
        k->len = strlen(hex) / 2;
        k->text = moe_malloc(k->len + 1);
        for (size_t b = 0; b < k->len; b++) sscanf(hex + 2 * b, "%2hhx", &k->text[b]);
    }
    return c;
}

static void free_cases(Cases *c) {
    for (size_t i = 0; i < c->n; i++) free(c->cases[i].text);
    free(c->cases);
    json_decref(c->root);
}

static Tokenizer *load_tokenizer(const char *name) {
    char path[256];
    MoeErr err;
    snprintf(path, sizeof path, TOK_DIR "%s", name);
    Tokenizer *t = tokenizer_load(path, err);
    MOE_CHECK(t, "%s", err);
    return t;
}

static TextSpan case_span(const Case *k) { return (TextSpan){k->text, k->len, k->name}; }

// got must be exactly `want` (a JSON list); names the first difference.
static void check_ids(const TokenIds *got, const json_t *want, const char *what) {
    size_t n = json_array_size(want), i = 0;
    while (i < n && i < got->n && got->ids[i] == (uint32_t)json_integer_value(json_array_get(want, i))) i++;
    if (i == n && got->n == n) return;
    TEST_FAIL("%s: %zu ids, expected %zu; first difference at %zu: got %lld, expected %lld", what, got->n, n, i,
              i < got->n ? (long long)got->ids[i] : -1LL,
              i < n ? (long long)json_integer_value(json_array_get(want, i)) : -1LL);
}

// Every case must give the ids of tokenizers: encoded alone on one thread, then all together as
// the documents of one call on two or three threads with chunks so small that most cuts fall inside
// a match (those chunks are swept again). (Chunks of 3 bytes only for the cases
// under 4,000 bytes: the long ones would take seconds.)
static void test_matches_hf(void) {
    static const struct {
        int threads;
        size_t chunk;
    } RUNS[] = {{2, 3}, {2, 50}, {3, 1000}};
    Cases c = load_cases();
    MoeErr err;
    TextSpan *spans = moe_calloc(c.n, sizeof *spans), *sub = moe_calloc(c.n, sizeof *sub);
    const json_t **want = moe_calloc(c.n, sizeof *want), **sub_want = moe_calloc(c.n, sizeof *sub_want);
    TokenIds *ids = moe_calloc(c.n, sizeof *ids);
    char what[160];
    for (int k = 0; k < N_TOKENIZERS; k++) {
        Tokenizer *t = load_tokenizer(TOKENIZERS[k]);
        size_t n = 0;
        for (size_t i = 0; i < c.n; i++) {
            const json_t *w = json_object_get(c.cases[i].ids, TOKENIZERS[k]);
            if (!w) continue;
            spans[n] = case_span(&c.cases[i]), want[n++] = w;
            TokenIds got = {0};
            snprintf(what, sizeof what, "%s, case '%s', alone", TOKENIZERS[k], c.cases[i].name);
            CHECK_OK(tokenizer_encode(t, &spans[n - 1], 1, 1, 0, &got, err), err);
            check_ids(&got, w, what);
            token_ids_free(&got);
        }
        CHECK_MSG(n >= 30, "%s: only %zu cases", TOKENIZERS[k], n);
        for (size_t r = 0; r < sizeof RUNS / sizeof RUNS[0]; r++) {
            size_t m = 0;
            for (size_t i = 0; i < n; i++)
                if (RUNS[r].chunk >= 10 || spans[i].len <= 4000) sub[m] = spans[i], sub_want[m++] = want[i];
            CHECK_OK(tokenizer_encode(t, sub, m, RUNS[r].threads, RUNS[r].chunk, ids, err), err);
            for (size_t i = 0; i < m; i++) {
                snprintf(what, sizeof what, "%s, case '%s' of %zu, %d threads, chunks of %zu", TOKENIZERS[k],
                         sub[i].name, m, RUNS[r].threads, RUNS[r].chunk);
                check_ids(&ids[i], sub_want[i], what);
                token_ids_free(&ids[i]);
            }
        }
        tokenizer_free(t);
    }
    free(ids);
    free(want);
    free(sub_want);
    free(spans);
    free(sub);
    free_cases(&c);
}

// Decoding gives back every byte, invalid UTF-8 included, for tokenizers that keep all the text.
static void test_round_trip(void) {
    Cases c = load_cases();
    MoeErr err;
    for (int k = 0; k < N_TOKENIZERS; k++) {
        Tokenizer *t = load_tokenizer(TOKENIZERS[k]);
        bool lossless = strcmp(TOKENIZERS[k], "extras.json") != 0; // Removed split, stripping tokens
        CHECK_MSG(tokenizer_lossless(t) == lossless, "%s: lossless is %d", TOKENIZERS[k], tokenizer_lossless(t));
        for (size_t i = 0; lossless && i < c.n; i++) {
            TextSpan span = case_span(&c.cases[i]);
            TokenIds ids = {0};
            CHECK_OK(tokenizer_encode(t, &span, 1, 1, 0, &ids, err), err);
            uint8_t *back = moe_malloc(span.len + 1);
            size_t n = 0, len;
            for (size_t j = 0; j < ids.n; j++) {
                const uint8_t *b = tokenizer_token_bytes(t, ids.ids[j], &len);
                if (b && n + len <= span.len) memcpy(back + n, b, len);
                n += b ? len : span.len + 1;
            }
            CHECK_MSG(n == span.len && !memcmp(back, span.text, n), "%s, case '%s': decodes to %zu bytes of %zu",
                      TOKENIZERS[k], c.cases[i].name, n, span.len);
            free(back);
            token_ids_free(&ids);
        }
        tokenizer_free(t);
    }
    free_cases(&c);
}

// A changed copy of gpt2-style.json: `value` (JSON text; NULL removes the key) at section.key
// (section "" is the top level).
typedef struct {
    const char *section, *key, *value, *fragment;
} BadEdit;

static void test_bad_files(void) {
    static const BadEdit EDITS[] = {
        {"", "model", NULL, "no \"model\" object"},
        {"", "normalizer", "{\"type\":\"NFC\"}", "normalizer {\"type\":\"NFC\"} is not supported"},
        {"", "pre_tokenizer", "null", "no pre_tokenizer"},
        {"", "pre_tokenizer", "{\"type\":\"Digits\"}", "pre_tokenizer.type 'Digits' is not supported"},
        {"", "pre_tokenizer", "{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":"
         "{\"Regex\":\"(a\"},\"behavior\":\"Isolated\",\"invert\":false},{\"type\":\"ByteLevel\",\"add_prefix_space\":false}]}",
         "pre_tokenizer.pretokenizers[0].pattern does not compile with PCRE2"},
        {"", "pre_tokenizer", "{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":"
         "{\"Regex\":\"\\\\s+\"},\"behavior\":\"MergedWithPrevious\",\"invert\":false},{\"type\":\"ByteLevel\",\"add_prefix_space\":false}]}",
         "pre_tokenizer.pretokenizers[0].behavior = \"MergedWithPrevious\" is not supported"},
        {"", "pre_tokenizer", "{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"ByteLevel\",\"add_prefix_space\":false},{\"type\":"
         "\"Split\",\"pattern\":{\"String\":\"x\"},\"behavior\":\"Isolated\",\"invert\":false}]}",
         "pre_tokenizer.pretokenizers[0]: the pre-tokenizer must end with ByteLevel"},
        {"", "pre_tokenizer", "{\"type\":\"Sequence\",\"pretokenizers\":[]}", "must end with ByteLevel"},
        {"", "pre_tokenizer", "{\"type\":\"ByteLevel\",\"use_regex\":true}", "pre_tokenizer has no \"add_prefix_space\""},
        {"", "pre_tokenizer", "{\"type\":\"ByteLevel\",\"add_prefix_space\":1}",
         "pre_tokenizer.add_prefix_space = 1 must be true or false"},
        {"", "added_tokens", "[{\"content\":5}]", "added_tokens[0].content = 5 must be a string"},
        {"", "added_tokens", "[{\"content\":\"x\",\"special\":\"yes\"}]", "added_tokens[0].special = \"yes\" must be true or false"},
        {"model", "type", "\"WordPiece\"", "model.type 'WordPiece' is not supported"},
        {"model", "dropout", "0.1", "model.dropout = 0.1"},
        {"model", "continuing_subword_prefix", "\"##\"", "model.continuing_subword_prefix = \"##\" is not supported"},
        {"model", "vocab", "{\"a\":-3}", "model.vocab[\"a\"] = -3 is not a token id"},
        {"model", "vocab", "{\"a\":\"one\"}", "model.vocab[\"a\"] = \"one\" is not a token id"},
        {"model", "vocab", "{\"a\":0}", "model.vocab has no token for byte 0x00"},
        {"model", "merges", "[\"a b c\"]", "model.merges[0] = \"a b c\" is not two tokens"},
        {"model", "merges", "[\"#version: 0.2\",[\"zz\",\"q\"]]", "model.merges[1]: \"zz\" is not in model.vocab"},
        {"model", "merges", "[7]", "model.merges[0] = 7 is not two tokens"},
        {"model", "merges", "{}", "model.merges must be a list"},
    };
    char dir[64], path[PATH_MAX];
    MoeErr err;
    tmp_dir_make(dir, sizeof dir);
    tmp_path(path, dir, "bad.json");
    json_t *base = fs_load_json(TOK_DIR "gpt2-style.json", "tokenizer", err);
    MOE_CHECK(base, "%s", err);
    for (size_t i = 0; i < sizeof EDITS / sizeof EDITS[0]; i++) {
        const BadEdit *e = &EDITS[i];
        json_t *root = json_deep_copy(base), *obj = e->section[0] ? json_object_get(root, e->section) : root;
        if (e->value) json_object_set_new(obj, e->key, json_loads(e->value, JSON_DECODE_ANY, NULL));
        else json_object_del(obj, e->key);
        MOE_CHECK(json_dump_file(root, path, 0) == 0, "cannot write %s", path);
        json_decref(root);
        Tokenizer *t = tokenizer_load(path, err);
        CHECK_MSG(!t && strstr(err, path) && strstr(err, e->fragment),
                  "edit %zu (%s.%s): loaded %d, message \"%s\"; expected one naming the file and \"%s\"", i,
                  e->section, e->key, t != NULL, t ? "" : err, e->fragment);
        tokenizer_free(t);
    }
    json_decref(base);
    write_text(path, "{\"model\": ");
    CHECK_MSG(!tokenizer_load(path, err) && strstr(err, "malformed JSON"), "got \"%s\"", err);
    CHECK_MSG(!tokenizer_load(tmp_path(path, dir, "none.json"), err) && strstr(err, "none.json: cannot open tokenizer file"),
              "got \"%s\"", err);
    tmp_dir_remove(dir);
}

static void test_eos(void) {
    MoeErr err;
    Tokenizer *t = load_tokenizer("cl100k-style.json");
    uint32_t id = 99, pad;
    CHECK_OK(tokenizer_eos(t, NULL, &id, err), err);
    CHECK_MSG(tokenizer_token_id(t, "<|endoftext|>", &pad) && id == pad, "default EOS %u", id);
    CHECK_OK(tokenizer_eos(t, "<|pad|>", &id, err), err);
    CHECK_MSG(tokenizer_token_id(t, "<|pad|>", &pad) && id == pad && pad != 0, "<|pad|> is %u", id);
    CHECK_OK(tokenizer_eos(t, "300", &id, err), err);
    CHECK(id == 300);
    CHECK_ERR(tokenizer_eos(t, "<|nope|>", &id, err), err, "--eos <|nope|>", "cl100k-style.json has no such token");
    CHECK_ERR(tokenizer_eos(t, "99999", &id, err), err, "has no token with this id");
    size_t len;
    const uint8_t *b = tokenizer_token_bytes(t, pad, &len);
    CHECK_MSG(b && len == 7 && !memcmp(b, "<|pad|>", 7), "<|pad|> decodes to %zu bytes", b ? len : 0);
    CHECK(!tokenizer_token_bytes(t, (uint32_t)tokenizer_vocab_size(t), &len));
    tokenizer_free(t);
}

// The ids of a token file from `first` on must be `want` (a JSON list), then `eos`.
static size_t check_file_ids(const TokenFile *f, size_t first, const json_t *want, uint32_t eos) {
    size_t n = json_array_size(want), i = 0;
    while (i < n && first + i < f->n_tokens &&
           token_file_get(f, first + i) == (uint32_t)json_integer_value(json_array_get(want, i)))
        i++;
    CHECK_MSG(i == n && first + n < f->n_tokens && token_file_get(f, first + n) == eos,
              "%s: tokens from %zu differ at %zu (or no EOS after them)", f->path, first, i);
    return first + n + 1;
}

static const Case *find_case(const Cases *c, const char *name) {
    for (size_t i = 0; i < c->n; i++)
        if (!strcmp(c->cases[i].name, name)) return &c->cases[i];
    MOE_CHECK(0, "no test case '%s'", name);
}

// Two input files give two documents, each ending with EOS; one thread or two write the same file.
static void test_prepare(void) {
    Cases c = load_cases();
    char dir[64], in[2][PATH_MAX], out[2][PATH_MAX];
    MoeErr err;
    tmp_dir_make(dir, sizeof dir);
    const Case *docs[2] = {find_case(&c, "long document"), find_case(&c, "cjk")};
    write_bytes(tmp_path(in[0], dir, "a.txt"), docs[0]->text, docs[0]->len);
    write_bytes(tmp_path(in[1], dir, "b.txt"), docs[1]->text, docs[1]->len);
    const char *inputs[2] = {in[0], in[1]};
    Tokenizer *t = load_tokenizer("cl100k-style.json");
    PrepareSpec s = {.inputs = inputs, .n_inputs = 2, .tokenizer = t, .threads = 1};
    PrepareStats st;
    CHECK_OK(tokenizer_eos(t, NULL, &s.eos, err), err);
    for (int run = 0; run < 2; run++) {
        s.train_path = tmp_path(out[run], dir, run ? "two.npy" : "one.npy");
        s.threads = 1 + run;
        CHECK_OK(data_prepare(&s, &st, err), err);
        CHECK(st.token_bytes == 2);
        TokenFile f;
        CHECK_OK(token_file_open(&f, s.train_path, 0, tokenizer_vocab_size(t), err), err);
        size_t at = 0;
        for (int d = 0; f.base && d < 2; d++) at = check_file_ids(&f, at, json_object_get(docs[d]->ids, "cl100k-style.json"), s.eos);
        CHECK_MSG(at == f.n_tokens && st.tokens[0] == f.n_tokens, "%zu tokens, %zu written", f.n_tokens, st.tokens[0]);
        token_file_close(&f);
    }
    size_t n[2];
    uint8_t *bytes[2];
    CHECK_OK(fs_read_file(out[0], "token file", &bytes[0], &n[0], err), err);
    CHECK_OK(fs_read_file(out[1], "token file", &bytes[1], &n[1], err), err);
    CHECK_MSG(n[0] == n[1] && !memcmp(bytes[0], bytes[1], n[0]), "1 and 2 threads wrote different files");
    free(bytes[0]);
    free(bytes[1]);
    tokenizer_free(t);
    tmp_dir_remove(dir);
    free_cases(&c);
}

// A vocabulary past 65,536 ids gives a uint32 file.
static void test_prepare_uint32(void) {
    char dir[64], tok[PATH_MAX], in[PATH_MAX], out[PATH_MAX];
    MoeErr err;
    tmp_dir_make(dir, sizeof dir);
    json_t *root = fs_load_json(TOK_DIR "gpt2-style.json", "tokenizer", err);
    MOE_CHECK(root, "%s", err);
    json_object_set_new(json_object_get(json_object_get(root, "model"), "vocab"), "<|big|>", json_integer(70000));
    json_array_append_new(json_object_get(root, "added_tokens"),
                          json_pack("{s:s, s:i, s:b}", "content", "<|big|>", "id", 70000, "special", 1));
    MOE_CHECK(json_dump_file(root, tmp_path(tok, dir, "big.json"), 0) == 0, "cannot write %s", tok);
    json_decref(root);
    write_text(tmp_path(in, dir, "in.txt"), "a<|big|>b");
    Tokenizer *t = tokenizer_load(tok, err);
    CHECK_MSG(t, "%s", err);
    if (!t) return;
    const char *inputs[1] = {in};
    PrepareSpec s = {.inputs = inputs, .n_inputs = 1, .train_path = tmp_path(out, dir, "out.npy"), .tokenizer = t,
                     .threads = 2};
    PrepareStats st;
    CHECK_OK(tokenizer_eos(t, "<|big|>", &s.eos, err), err);
    CHECK_OK(data_prepare(&s, &st, err), err);
    CHECK(st.token_bytes == 4 && tokenizer_vocab_size(t) == 70001);
    uint32_t a, b;
    CHECK(tokenizer_token_id(t, "a", &a) && tokenizer_token_id(t, "b", &b));
    TokenFile f;
    CHECK_OK(token_file_open(&f, out, 0, tokenizer_vocab_size(t), err), err);
    uint32_t want[4] = {a, 70000, b, 70000};
    CHECK_MSG(f.base && f.token_bytes == 4 && f.n_tokens == 4, "%zu tokens of %d bytes", f.n_tokens, f.token_bytes);
    for (size_t i = 0; f.base && i < 4 && i < f.n_tokens; i++)
        CHECK_MSG(token_file_get(&f, i) == want[i], "token %zu is %u, expected %u", i, token_file_get(&f, i), want[i]);
    token_file_close(&f);
    tokenizer_free(t);
    tmp_dir_remove(dir);
}

const TestCase tokenizer_tests[] = {
    {"tokenizer_matches_hf", test_matches_hf},
    {"tokenizer_round_trip", test_round_trip},
    {"tokenizer_bad_files", test_bad_files},
    {"tokenizer_eos", test_eos},
    {"tokenizer_prepare", test_prepare},
    {"tokenizer_prepare_uint32", test_prepare_uint32},
    {0},
};
