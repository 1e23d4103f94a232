// Tests: token files (headerless uint16/uint32, real .npy), data lists, the Dataset's sequences and
// per-epoch shuffle, and `moe data prepare`'s byte-level output. Every test works in its own
// mkdtemp folder under /tmp and removes it afterwards.
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io/tokens.h"
#include "test.h"
#include "test_files.h"
#include "text/prepare.h"

// ---------------------------------------------------------------------------------------------
// Helpers

// `moe data prepare IN OUT [--val-out VAL --val-fraction F]` without a tokenizer.
static int prepare_bytes(const char *in, const char *train, const char *val, double val_fraction, MoeErr err) {
    PrepareSpec s = {.inputs = &in, .n_inputs = 1, .train_path = train, .val_path = val,
                     .val_fraction = val_fraction, .eos = BYTE_EOS, .threads = 1};
    PrepareStats stats;
    return data_prepare(&s, &stats, err);
}

// Little-endian ids of `token_bytes` each, spelled out byte by byte so the test does not depend on
// the host's byte order.
static size_t encode_ids(uint8_t *out, const uint32_t *ids, size_t n, int token_bytes) {
    for (size_t i = 0; i < n; i++)
        for (int b = 0; b < token_bytes; b++)
            out[i * (size_t)token_bytes + (size_t)b] = (uint8_t)(ids[i] >> (8 * b));
    return n * (size_t)token_bytes;
}

static void write_ids(const char *path, const uint32_t *ids, size_t n, int token_bytes) {
    uint8_t *buf = moe_malloc(n * (size_t)token_bytes);
    write_bytes(path, buf, encode_ids(buf, ids, n, token_bytes));
    free(buf);
}

// A .npy file: magic, version, header length, `dict` padded with spaces and ended by '\n' so that
// magic + header take `total` bytes (0: no padding). With total = 128 the bytes are identical to
// what numpy 2.4's np.save writes for a short 1-D array (checked once against numpy).
static void write_npy(const char *path, int major, const char *dict, size_t total,
                      const uint8_t *data, size_t data_bytes) {
    size_t prefix = major == 1 ? 10 : 12, dict_len = strlen(dict);
    size_t header_len = total ? total - prefix : dict_len + 1;
    uint8_t *buf = moe_malloc(prefix + header_len + data_bytes);
    memcpy(buf, "\x93NUMPY", 6);
    buf[6] = (uint8_t)major, buf[7] = 0;
    for (size_t b = 0; b < prefix - 8; b++) buf[8 + b] = (uint8_t)(header_len >> (8 * b));
    memset(buf + prefix, ' ', header_len);
    memcpy(buf + prefix, dict, dict_len);
    buf[prefix + header_len - 1] = '\n';
    memcpy(buf + prefix + header_len, data, data_bytes);
    write_bytes(path, buf, prefix + header_len + data_bytes);
    free(buf);
}

static uint8_t *read_whole(const char *path, size_t *n) {
    FILE *fp = fopen(path, "rb");
    *n = 0;
    if (!fp) return NULL;
    uint8_t *buf = moe_malloc(1 << 16);
    *n = fread(buf, 1, 1 << 16, fp);
    fclose(fp);
    return buf;
}

// Index of the first token of `f` that differs from `want` (n: the file's length, then all match).
static size_t first_token_diff(const TokenFile *f, const uint32_t *want, size_t n) {
    size_t i = 0;
    while (i < n && i < f->n_tokens && token_file_get(f, i) == want[i]) i++;
    return i;
}

#define CHECK_TOKENS(f, want, n)                                                                   \
    do {                                                                                           \
        size_t n_ = (n), d_ = first_token_diff(f, want, n_);                                       \
        CHECK_MSG((f)->n_tokens == n_, "%s: %zu tokens, expected %zu", (f)->path, (f)->n_tokens,   \
                  n_);                                                                             \
        if (d_ < n_ && d_ < (f)->n_tokens)                                                         \
            TEST_FAIL("%s: token %zu is %u, expected %u", (f)->path, d_, token_file_get(f, d_),    \
                      (want)[d_]);                                                                 \
    } while (0)

#define CHECK_SEQ(got, want, n)                                                                    \
    do {                                                                                           \
        for (size_t i_ = 0; i_ < (size_t)(n); i_++)                                                \
            if ((got)[i_] != (int32_t)(want)[i_]) {                                                \
                TEST_FAIL("%s[%zu] = %d, expected %d", #got, i_, (int)(got)[i_], (int)(want)[i_]); \
                break;                                                                             \
            }                                                                                      \
    } while (0)

static void iota(uint32_t *ids, size_t n, uint32_t first) {
    for (size_t i = 0; i < n; i++) ids[i] = first + (uint32_t)i;
}

// ---------------------------------------------------------------------------------------------
// Token files

static void test_headerless_u16(void) {
    char dir[64], path[PATH_MAX];
    MoeErr err;
    TokenFile f;
    tmp_dir_make(dir, sizeof dir);
    const uint32_t ids[] = {0, 1, 2, 65535, 300, 256};
    write_ids(tmp_path(path, dir, "a.npy"), ids, 6, 2);

    CHECK_OK(token_file_open(&f, path, 0, 50304, err), err);
    CHECK_MSG(f.token_bytes == 2 && f.data_offset == 0, "token_bytes %d, data_offset %zu",
              f.token_bytes, f.data_offset);
    CHECK_TOKENS(&f, ids, 6);
    token_file_close(&f);

    CHECK_OK(token_file_open(&f, path, 0, 65536, err), err); // the largest vocabulary uint16 holds
    CHECK_MSG(f.token_bytes == 2, "vocab 65536 chose token_bytes %d", f.token_bytes);
    token_file_close(&f);

    CHECK_OK(token_file_open(&f, path, 2, 100000, err), err); // explicit width beats the vocabulary
    CHECK_TOKENS(&f, ids, 6);
    token_file_close(&f);

    CHECK_OK(token_file_open(&f, path, 0, 65537, err), err); // now read as 3 uint32
    const uint32_t as_u32[] = {1u << 16, 2u | (65535u << 16), 300u | (256u << 16)};
    CHECK_MSG(f.token_bytes == 4, "vocab 65537 chose token_bytes %d", f.token_bytes);
    CHECK_TOKENS(&f, as_u32, 3);
    token_file_close(&f);
    tmp_dir_remove(dir);
}

static void test_headerless_u32(void) {
    char dir[64], path[PATH_MAX];
    MoeErr err;
    TokenFile f;
    tmp_dir_make(dir, sizeof dir);
    const uint32_t ids[] = {1, 70000, 4294967295u, 65536};
    write_ids(tmp_path(path, dir, "b.npy"), ids, 4, 4);

    CHECK_OK(token_file_open(&f, path, 0, 100278, err), err);
    CHECK_MSG(f.token_bytes == 4, "token_bytes %d", f.token_bytes);
    CHECK_TOKENS(&f, ids, 4);
    token_file_close(&f);

    CHECK_OK(token_file_open(&f, path, 2, 100278, err), err); // halves, low half first
    const uint32_t halves[] = {1, 0, 70000 & 0xffff, 1, 0xffff, 0xffff, 0, 1};
    CHECK_TOKENS(&f, halves, 8);
    token_file_close(&f);
    tmp_dir_remove(dir);
}

static const char NPY_DICT_U2_5[] = "{'descr': '<u2', 'fortran_order': False, 'shape': (5,), }";

static void test_npy_real(void) {
    char dir[64], path[PATH_MAX];
    MoeErr err;
    TokenFile f;
    tmp_dir_make(dir, sizeof dir);
    const uint32_t ids[] = {0, 1, 2, 65535, 300};
    uint8_t data[20];

    // np.save(np.array([0, 1, 2, 65535, 300], dtype=np.uint16)); the token width argument is
    // ignored because the header names the dtype.
    write_npy(tmp_path(path, dir, "v1.npy"), 1, NPY_DICT_U2_5, 128, data,
              encode_ids(data, ids, 5, 2));
    CHECK_OK(token_file_open(&f, path, 4, 100278, err), err);
    CHECK_MSG(f.token_bytes == 2 && f.data_offset == 128, "token_bytes %d, data_offset %zu",
              f.token_bytes, f.data_offset);
    CHECK_TOKENS(&f, ids, 5);
    token_file_close(&f);

    const uint32_t ids32[] = {1, 70000, 4294967295u};
    const char *dict32 = "{'descr': '<u4', 'fortran_order': False, 'shape': (3,), }";
    for (int major = 2; major <= 3; major++) {
        write_npy(tmp_path(path, dir, "v2.npy"), major, dict32, 128, data,
                  encode_ids(data, ids32, 3, 4));
        CHECK_OK(token_file_open(&f, path, 0, 50304, err), err);
        CHECK_MSG(f.token_bytes == 4 && f.data_offset == 128,
                  "v%d: token_bytes %d, data_offset %zu", major, f.token_bytes, f.data_offset);
        CHECK_TOKENS(&f, ids32, 3);
        token_file_close(&f);
    }

    // Python 2 numpy: double quotes, a long 'L' dimension, no trailing comma, and an odd data
    // offset (10 + 63 bytes) that leaves the tokens unaligned.
    const char *py2 = "{\"descr\": \"<u2\", \"fortran_order\": False, \"shape\": (5L,)}";
    write_npy(tmp_path(path, dir, "py2.npy"), 1, py2, 73, data, encode_ids(data, ids, 5, 2));
    CHECK_OK(token_file_open(&f, path, 0, 50304, err), err);
    CHECK_MSG(f.data_offset == 73, "data_offset %zu", f.data_offset);
    CHECK_TOKENS(&f, ids, 5);
    token_file_close(&f);

    write_npy(tmp_path(path, dir, "empty_array.npy"), 1,
              "{'descr': '<u2', 'fortran_order': False, 'shape': (0,), }", 128, data, 0);
    CHECK_OK(token_file_open(&f, path, 0, 50304, err), err);
    CHECK_MSG(f.n_tokens == 0, "n_tokens %zu", f.n_tokens);
    token_file_close(&f);
    tmp_dir_remove(dir);
}

static void test_npy_malformed(void) {
    static const struct {
        const char *dict, *fragment;
    } cases[] = {
        {"{'descr': '<i4', 'fortran_order': False, 'shape': (5,), }",
         "dtype '<i4' is not supported"},
        {"{'descr': '|u1', 'fortran_order': False, 'shape': (5,), }", "'|u1'"},
        {"{'descr': '>u2', 'fortran_order': False, 'shape': (5,), }", "'>u2'"},
        {"{'descr': '<u2', 'fortran_order': True, 'shape': (5,), }", "Fortran order"},
        {"{'descr': '<u2', 'fortran_order': False, 'shape': (1, 5), }", "2 dimensions"},
        {"{'descr': '<u2', 'fortran_order': False, 'shape': (), }", "0 dimensions"},
        {"{'descr': '<u2', 'fortran_order': False, 'shape': (5), }", "lacks the comma"},
        {"{'descr': '<u2', 'fortran_order': False, 'shape': (-5,), }", "non-negative"},
        {"{'descr': '<u2', 'fortran_order': False, 'shape': (5 6)}", "expected ',' or ')'"},
        {"{'descr': '<u2', 'shape': (5,), }", "missing key"},
        {"{'descr': '<u2', 'fortran_order': False, 'shape': (5,), 'x': 1}", "unknown key"},
        {"{'descr': '<u2', 'descr': '<u2', 'fortran_order': False, 'shape': (5,)}",
         "duplicate key 'descr'"},
        {"{'descr': <u2, 'fortran_order': False, 'shape': (5,)}", "'descr' must be"},
        {"{'descr': '<u2', 'fortran_order': Falsey, 'shape': (5,)}", "True or False"},
        {"{'descr': '<u2' 'fortran_order': False, 'shape': (5,)}", "expected ',' or '}'"},
        {"{'descr' '<u2', 'fortran_order': False, 'shape': (5,)}", "expected ':'"},
        {"['descr', '<u2']", "does not start with '{'"},
        {"{'descr': '<u2', 'fortran_order': False, 'shape': (5,)} x", "after the closing"},
        {"{'descr': '<u2', 'fortran_order': False, 'shape': (6,), }",
         "header says 6 tokens but 10 bytes"},
        {"{'descr': '<u2', 'fortran_order': False, 'shape': (4,), }",
         "header says 4 tokens but 10 bytes"},
    };
    char dir[64], path[PATH_MAX];
    MoeErr err;
    TokenFile f;
    tmp_dir_make(dir, sizeof dir);
    const uint32_t ids[] = {0, 1, 2, 3, 4};
    uint8_t data[10];
    size_t data_bytes = encode_ids(data, ids, 5, 2);
    tmp_path(path, dir, "bad.npy");
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        write_npy(path, 1, cases[c].dict, 128, data, data_bytes);
        CHECK_ERR(token_file_open(&f, path, 0, 50304, err), err, path, cases[c].fragment);
        token_file_close(&f);
    }

    uint8_t raw[64] = "\x93NUMPY\x01\x00\xff\x00{'descr'"; // header length 255 > file
    write_bytes(path, raw, 20);
    CHECK_ERR(token_file_open(&f, path, 0, 50304, err), err, path, "truncated .npy header");
    write_bytes(path, raw, 7);
    CHECK_ERR(token_file_open(&f, path, 0, 50304, err), err, path, "truncated .npy header");
    write_npy(path, 1, NPY_DICT_U2_5, 128, data, data_bytes);
    FILE *fp = fopen(path, "r+b"); // patch the version byte to 4.0
    MOE_CHECK(fp && fseek(fp, 6, SEEK_SET) == 0 && fputc(4, fp) == 4 && fclose(fp) == 0, "patch %s",
              path);
    CHECK_ERR(token_file_open(&f, path, 0, 50304, err), err, path,
              "unsupported .npy format version 4.0");

    // A NUL byte inside the header: not read as the end of the dtype string ('<u2' + junk).
    write_npy(path, 1, "{'descr': '<u2#', 'fortran_order': False, 'shape': (5,), }", 128, data, data_bytes);
    fp = fopen(path, "r+b");
    MOE_CHECK(fp && fseek(fp, 10 + 14, SEEK_SET) == 0 && fputc(0, fp) == 0 && fclose(fp) == 0, "patch %s", path);
    CHECK_ERR(token_file_open(&f, path, 0, 50304, err), err, path, "a NUL byte at header offset 14");
    token_file_close(&f);
    tmp_dir_remove(dir);
}

static void test_bad_sizes(void) {
    char dir[64], path[PATH_MAX];
    MoeErr err;
    TokenFile f;
    tmp_dir_make(dir, sizeof dir);
    write_bytes(tmp_path(path, dir, "odd.npy"), "1234567", 7);
    CHECK_ERR(token_file_open(&f, path, 0, 50304, err), err, path,
              "7 bytes is not a whole number of uint16 tokens (2 bytes each)");
    write_bytes(path, "123456", 6);
    CHECK_ERR(token_file_open(&f, path, 4, 50304, err), err, path,
              "6 bytes is not a whole number of uint32 tokens (4 bytes each)");
    CHECK_ERR(token_file_open(&f, path, 3, 50304, err), err, path, "token_bytes must be");

    // A sparse file: the size is what matters, and thousands separators help read it.
    MOE_CHECK(truncate(path, 1000001) == 0, "truncate %s: %s", path, strerror(errno));
    CHECK_ERR(token_file_open(&f, path, 0, 50304, err), err, path,
              "1,000,001 bytes is not a whole number");

    write_bytes(tmp_path(path, dir, "empty.npy"), "", 0);
    CHECK_ERR(token_file_open(&f, path, 0, 50304, err), err, path, "empty token file");
    token_file_close(&f);
    tmp_dir_remove(dir);
}

static void test_missing_file(void) {
    char dir[64], path[PATH_MAX];
    MoeErr err;
    TokenFile f;
    tmp_dir_make(dir, sizeof dir);
    CHECK_ERR(token_file_open(&f, tmp_path(path, dir, "nope.npy"), 0, 50304, err), err, path,
              strerror(ENOENT));
    CHECK_ERR(token_file_open(&f, dir, 0, 50304, err), err, dir, "not a regular file");
    Dataset ds;
    CHECK_ERR(dataset_open(&ds, path, 4, 50304, 0, 1, false, err), err, path, strerror(ENOENT));
    dataset_close(&ds);
    token_file_close(&f);
    tmp_dir_remove(dir);
}

// ---------------------------------------------------------------------------------------------
// Dataset

static void test_token_over_vocab(void) {
    char dir[64], path[PATH_MAX];
    MoeErr err;
    Dataset ds;
    tmp_dir_make(dir, sizeof dir);
    enum { N = 20000, S = 100 };
    uint32_t *ids = moe_malloc(N * sizeof *ids);
    for (size_t i = 0; i < N; i++) ids[i] = (uint32_t)(i % 50000);
    ids[12345] = 70000;
    write_ids(tmp_path(path, dir, "c.npy"), ids, N, 4);
    int32_t seq[S + 1];
    CHECK_OK(dataset_open(&ds, path, S, 50304, 4, 1, false, err), err);
    CHECK_OK(dataset_read(&ds, 122, seq, err), err); // tokens 12200..12300
    CHECK_ERR(dataset_read(&ds, 123, seq, err), err, path,
              "token 70000 at position 12,345 is >= vocab_size 50304",
              "wrong tokenizer or model.vocab_size?");
    CHECK_OK(dataset_read(&ds, 124, seq, err), err); // tokens 12400..12500
    CHECK_SEQ(seq, ids + 12400, S + 1);
    dataset_close(&ds);

    // The bound is exclusive: id 70000 needs vocab_size 70001.
    CHECK_OK(dataset_open(&ds, path, S, 70000, 4, 1, false, err), err);
    CHECK_ERR(dataset_read(&ds, 123, seq, err), err, "token 70000 at position 12,345");
    dataset_close(&ds);
    CHECK_OK(dataset_open(&ds, path, S, 70001, 4, 1, false, err), err);
    CHECK_OK(dataset_read(&ds, 123, seq, err), err);
    CHECK_SEQ(seq, ids + 12300, S + 1);
    dataset_close(&ds);
    free(ids);
    tmp_dir_remove(dir);
}

static void test_too_short(void) {
    char dir[64], a[PATH_MAX], b[PATH_MAX], spec[2 * PATH_MAX + 2];
    MoeErr err;
    Dataset ds;
    tmp_dir_make(dir, sizeof dir);
    uint32_t ids[100];
    iota(ids, 100, 0);
    write_ids(tmp_path(a, dir, "a.npy"), ids, 100, 2);
    write_ids(tmp_path(b, dir, "b.npy"), ids, 50, 2);

    CHECK_ERR(dataset_open(&ds, a, 128, 50304, 0, 1, false, err), err, a,
              "100 tokens is fewer than seq_len + 1 = 129", "lower train.seq_len or use more data");
    CHECK_ERR(dataset_open(&ds, a, 100, 50304, 0, 1, false, err), err,
              "fewer than seq_len + 1 = 101");
    CHECK_OK(dataset_open(&ds, a, 99, 50304, 0, 1, false, err),
             err); // exactly S + 1 tokens: one sequence
    CHECK_MSG(ds.n_seqs == 1, "n_seqs %zu, expected 1", ds.n_seqs);
    dataset_close(&ds);

    snprintf(spec, sizeof spec, "%s,%s", a, b);
    CHECK_ERR(dataset_open(&ds, spec, 128, 50304, 0, 1, false, err), err, "seq_len + 1 = 129",
              "a.npy: 100", "b.npy: 50", "lower train.seq_len");
    CHECK_ERR(dataset_open(&ds, a, 0, 50304, 0, 1, false, err), err, "seq_len must be");
    dataset_close(&ds);
    tmp_dir_remove(dir);
}

static void test_mix_file(void) {
    char dir[64], path[PATH_MAX], sub[PATH_MAX], mix[PATH_MAX], want[PATH_MAX], text[3 * PATH_MAX];
    MoeErr err;
    Dataset ds;
    tmp_dir_make(dir, sizeof dir);
    uint32_t ids[10];
    iota(ids, 10, 0);
    MOE_CHECK(mkdir(tmp_path(sub, dir, "sub"), 0700) == 0, "mkdir %s", sub);
    write_ids(tmp_path(path, dir, "sub/a.npy"), ids, 10, 2);
    write_ids(tmp_path(path, dir, "sub/b.npy"), ids, 7, 2);

    // Relative to the list's folder (not the working directory), comments, blank lines, CRLF.
    write_text(tmp_path(mix, dir, "mix.txt"),
               "# token files\n\n  sub/a.npy   # first\nsub/b.npy\r\n# end\n");
    CHECK_OK(dataset_open(&ds, mix, 3, 50304, 0, 1, false, err), err);
    CHECK_MSG(ds.n_files == 2, "n_files %zu, expected 2", ds.n_files);
    if (ds.n_files == 2) {
        CHECK_MSG(!strcmp(ds.files[0].path, tmp_path(want, dir, "sub/a.npy")), "files[0] = %s",
                  ds.files[0].path);
        CHECK_MSG(!strcmp(ds.files[1].path, tmp_path(want, dir, "sub/b.npy")), "files[1] = %s",
                  ds.files[1].path);
    }
    CHECK_MSG(ds.n_seqs == 3 + 2, "n_seqs %zu, expected 5", ds.n_seqs);
    dataset_close(&ds);

    // .list extension, an absolute path, a list named inside a comma list.
    snprintf(text, sizeof text, "%s/sub/b.npy\n", dir);
    write_text(tmp_path(mix, dir, "sub/abs.list"), text);
    snprintf(text, sizeof text, "%s, %s/sub/a.npy", mix, dir);
    CHECK_OK(dataset_open(&ds, text, 3, 50304, 0, 1, false, err), err);
    CHECK_MSG(ds.n_files == 2 && ds.n_seqs == 2 + 3, "n_files %zu, n_seqs %zu", ds.n_files,
              ds.n_seqs);
    dataset_close(&ds);

    write_text(tmp_path(mix, dir, "bad.mix"), "sub/a.npy\n# ok so far\nsub/missing.npy\n");
    CHECK_ERR(dataset_open(&ds, mix, 3, 50304, 0, 1, false, err), err,
              "bad.mix:3:", "sub/missing.npy", strerror(ENOENT));
    write_text(mix, "sub\n");
    CHECK_ERR(dataset_open(&ds, mix, 3, 50304, 0, 1, false, err), err,
              "bad.mix:1:", "not a regular file");
    CHECK_MSG(!strstr(err, "moe data prepare"), "a .mix list is never raw text, yet: %s", err);
    write_text(mix, "# nothing here\n\n");
    CHECK_ERR(dataset_open(&ds, mix, 3, 50304, 0, 1, false, err), err, "bad.mix",
              "names no token files");
    write_text(mix, "sub/abs.list\n");
    CHECK_ERR(dataset_open(&ds, mix, 3, 50304, 0, 1, false, err), err, "bad.mix:1:", "nested");
    write_text(mix, "sub/a.npy\n\nsub/odd.npy\n");
    write_bytes(tmp_path(path, dir, "sub/odd.npy"), "abc", 3);
    CHECK_ERR(dataset_open(&ds, mix, 3, 50304, 0, 1, false, err), err,
              "bad.mix:3:", "sub/odd.npy: 3 bytes");

    // A NUL byte ends no path early (here it would leave the valid "sub/a.npy"); a UTF-8 byte-order
    // mark at the start of the list is not part of the first path.
    write_bytes(mix, "sub/a.npy\0junk\n", 15);
    CHECK_ERR(dataset_open(&ds, mix, 3, 50304, 0, 1, false, err), err, "bad.mix:1:", "NUL byte");
    write_text(mix, "\xEF\xBB\xBFsub/a.npy\nsub/b.npy\n");
    CHECK_OK(dataset_open(&ds, mix, 3, 50304, 0, 1, false, err), err);
    CHECK_MSG(ds.n_files == 2, "a list starting with a byte-order mark: %zu files", ds.n_files);
    dataset_close(&ds);

    // Raw text handed over as data: the message says how to tokenize it.
    write_text(tmp_path(mix, dir, "shakespeare.txt"),
               "First Citizen:\nBefore we proceed any further, hear me speak.\n");
    CHECK_ERR(dataset_open(&ds, mix, 3, 50304, 0, 1, false, err), err,
              "shakespeare.txt:1:", "First Citizen:", "moe data prepare",
              "shakespeare.txt OUT.npy");
    CHECK_ERR(dataset_open(&ds, tmp_path(mix, dir, "none.txt"), 3, 50304, 0, 1, false, err), err,
              mix, "cannot open data list");
    dataset_close(&ds);
    tmp_dir_remove(dir);
}

static void test_comma_list(void) {
    char dir[64], a[PATH_MAX], b[PATH_MAX], spec[3 * PATH_MAX + 8];
    MoeErr err;
    Dataset ds;
    tmp_dir_make(dir, sizeof dir);
    uint32_t ids[10];
    iota(ids, 10, 0);
    write_ids(tmp_path(a, dir, "a.npy"), ids, 10, 2);
    write_ids(tmp_path(b, dir, "b.npy"), ids, 7, 2);
    snprintf(spec, sizeof spec, "%s, %s,%s", a, b, a);
    CHECK_OK(dataset_open(&ds, spec, 3, 50304, 0, 1, false, err), err);
    CHECK_MSG(ds.n_files == 3 && ds.n_seqs == 3 + 2 + 3, "n_files %zu, n_seqs %zu", ds.n_files,
              ds.n_seqs);
    if (ds.n_files == 3) CHECK_MSG(!strcmp(ds.files[1].path, b), "files[1] = %s", ds.files[1].path);
    dataset_close(&ds);
    snprintf(spec, sizeof spec, "%s,,%s", a, b);
    CHECK_ERR(dataset_open(&ds, spec, 3, 50304, 0, 1, false, err), err, "empty entry");
    snprintf(spec, sizeof spec, "%s,", a);
    CHECK_ERR(dataset_open(&ds, spec, 3, 50304, 0, 1, false, err), err, "empty entry");
    dataset_close(&ds);
    tmp_dir_remove(dir);
}

// Sequence j of a file is tokens [j*S, j*S + S]; files too short for one sequence are skipped;
// the stream wraps into the next epoch.
static void test_sequence_boundaries(void) {
    char dir[64], a[PATH_MAX], b[PATH_MAX], c[PATH_MAX], spec[3 * PATH_MAX + 3];
    MoeErr err;
    Dataset ds;
    tmp_dir_make(dir, sizeof dir);
    uint32_t ids_a[10], ids_b[8], ids_c[3];
    iota(ids_a, 10, 100), iota(ids_b, 8, 200), iota(ids_c, 3, 300);
    write_ids(tmp_path(a, dir, "a.npy"), ids_a, 10, 2);
    write_ids(tmp_path(c, dir, "c.npy"), ids_c, 3, 2);
    uint8_t data[32];
    write_npy(tmp_path(b, dir, "b.npy"), 1,
              "{'descr': '<u4', 'fortran_order': False, 'shape': (8,), }", 128, data,
              encode_ids(data, ids_b, 8, 4));
    snprintf(spec, sizeof spec, "%s,%s,%s", a, c, b);
    CHECK_OK(dataset_open(&ds, spec, 3, 50304, 0, 7, false, err), err);
    const size_t want_first[] = {0, 3, 3, 5};
    for (size_t f = 0; f < 4 && ds.first_seq && ds.n_files == 3; f++)
        CHECK_MSG(ds.first_seq[f] == want_first[f], "first_seq[%zu] = %zu, expected %zu", f,
                  ds.first_seq[f], want_first[f]);
    CHECK_MSG(ds.n_seqs == 5, "n_seqs %zu, expected 5", ds.n_seqs);
    static const int32_t want[5][4] = {{100, 101, 102, 103},
                                       {103, 104, 105, 106},
                                       {106, 107, 108, 109},
                                       {200, 201, 202, 203},
                                       {203, 204, 205, 206}};
    for (uint64_t index = 0; index < 15 && ds.n_seqs == 5; index++) {
        int32_t seq[4] = {-1, -1, -1, -1};
        CHECK_OK(dataset_read(&ds, index, seq, err), err);
        const int32_t *w = want[index % 5];
        CHECK_MSG(
            !memcmp(seq, w, sizeof seq), "index %llu: got {%d %d %d %d}, expected {%d %d %d %d}",
            (unsigned long long)index, seq[0], seq[1], seq[2], seq[3], w[0], w[1], w[2], w[3]);
    }
    dataset_close(&ds);
    tmp_dir_remove(dir);
}

// Mappings of this process of files under `dir` (lines of /proc/self/maps naming it): the data
// files the dataset maps, not whatever else the process maps meanwhile (allocator arenas, stacks).
static size_t count_maps(const char *dir) {
    FILE *fp = fopen("/proc/self/maps", "r");
    char line[4096 + PATH_MAX];
    size_t n = 0;
    while (fp && fgets(line, sizeof line, fp)) n += strstr(line, dir) != NULL;
    if (fp) fclose(fp);
    return n;
}

// A list of many files keeps only a few mapped: 70,000 files used to exhaust vm.max_map_count.
static void test_many_files(void) {
    enum { N_FILES = 300, S = 2 };
    char dir[64], path[PATH_MAX], mix[PATH_MAX], name[32];
    MoeErr err;
    tmp_dir_make(dir, sizeof dir);
    FILE *list = fopen(tmp_path(mix, dir, "many.list"), "w");
    for (int i = 0; i < N_FILES; i++) {
        uint32_t ids[2 * S + 1];
        iota(ids, 2 * S + 1, (uint32_t)(10 * i));
        snprintf(name, sizeof name, "f%03d.npy", i);
        write_ids(tmp_path(path, dir, name), ids, 2 * S + 1, 2);
        fprintf(list, "%s\n", name);
    }
    fclose(list);
    size_t most = 0;
    Dataset ds;
    int32_t seq[S + 1];
    CHECK_OK(dataset_open(&ds, mix, S, 50304, 0, 1, true, err), err);
    for (uint64_t i = 0; i < 2 * (uint64_t)ds.n_seqs && !test_failures; i++) {
        CHECK_OK(dataset_read(&ds, i, seq, err), err);
        size_t k = dataset_permute(1, i / ds.n_seqs, ds.n_seqs, i % ds.n_seqs); // file k / 2, half k % 2
        CHECK_MSG(seq[0] == (int32_t)(10 * (k / 2) + S * (k % 2)), "index %llu: sequence starts at %d",
                  (unsigned long long)i, seq[0]);
        size_t now = count_maps(dir);
        most = now > most ? now : most;
    }
    CHECK_MSG(most >= 1 && most <= DATASET_MAX_MAPS, "%zu files mapped at once while reading %d (at most %d)", most,
              N_FILES, DATASET_MAX_MAPS);
    dataset_close(&ds);
    tmp_dir_remove(dir);
}

// FIFOs are refused at once, wherever a file is expected (opening one would wait for a writer).
static void test_fifo(void) {
    char dir[64], fifo[PATH_MAX], mix[PATH_MAX], out[PATH_MAX];
    MoeErr err;
    Dataset ds;
    tmp_dir_make(dir, sizeof dir);
    MOE_CHECK(mkfifo(tmp_path(fifo, dir, "pipe.npy"), 0600) == 0, "mkfifo: %s", strerror(errno));
    alarm(20); // a hang becomes a failure of the whole run, not a silent wait
    CHECK_ERR(dataset_open(&ds, fifo, 3, 50304, 0, 1, false, err), err, "pipe.npy", "FIFO");
    write_text(tmp_path(mix, dir, "list.txt"), "pipe.npy\n");
    CHECK_ERR(dataset_open(&ds, mix, 3, 50304, 0, 1, false, err), err, "list.txt:1:", "not a regular file");
    MOE_CHECK(mkfifo(tmp_path(mix, dir, "pipe.list"), 0600) == 0, "mkfifo: %s", strerror(errno));
    CHECK_ERR(dataset_open(&ds, mix, 3, 50304, 0, 1, false, err), err, "pipe.list", "data list is a FIFO");
    CHECK_ERR(prepare_bytes(fifo, tmp_path(out, dir, "out.npy"), NULL, 0, err), err, "text file is a FIFO");
    alarm(0);
    tmp_dir_remove(dir);
}

// The underlying sequence of each index of one epoch (ids equal positions, so seq[0] / S names it).
static void epoch_order(Dataset *ds, uint64_t epoch, size_t *order) {
    int32_t seq[3];
    MoeErr err;
    for (size_t i = 0; i < ds->n_seqs; i++) {
        order[i] = (size_t)-1;
        CHECK_OK(dataset_read(ds, epoch * ds->n_seqs + i, seq, err), err);
        CHECK_MSG(seq[1] == seq[0] + 1 && seq[2] == seq[0] + 2,
                  "epoch %llu index %zu: got {%d %d %d}", (unsigned long long)epoch, i, seq[0],
                  seq[1], seq[2]);
        order[i] = (size_t)seq[0] / 2;
    }
}

static bool is_permutation(const size_t *order, size_t n) {
    bool seen[64] = {0};
    for (size_t i = 0; i < n; i++) {
        if (order[i] >= n || seen[order[i]]) return false;
        seen[order[i]] = true;
    }
    return true;
}

static bool same_order(const size_t *x, const size_t *y, size_t n) {
    return !memcmp(x, y, n * sizeof *x);
}

static void test_shuffle(void) {
    enum { N_SEQS = 40, S = 2 };
    char dir[64], path[PATH_MAX];
    MoeErr err;
    Dataset ds1, ds2, ds_seed2, ds_plain;
    tmp_dir_make(dir, sizeof dir);
    uint32_t ids[N_SEQS * S + 1];
    iota(ids, N_SEQS * S + 1, 0);
    write_ids(tmp_path(path, dir, "s.npy"), ids, N_SEQS * S + 1, 2);
    CHECK_OK(dataset_open(&ds1, path, S, 50304, 0, 1, true, err), err);
    CHECK_OK(dataset_open(&ds2, path, S, 50304, 0, 1, true, err), err);
    CHECK_OK(dataset_open(&ds_seed2, path, S, 50304, 0, 2, true, err), err);
    CHECK_OK(dataset_open(&ds_plain, path, S, 50304, 0, 1, false, err), err);
    if (test_failures) goto done;
    size_t e0[N_SEQS], e1[N_SEQS], again0[N_SEQS], again1[N_SEQS], seed2[N_SEQS], plain[N_SEQS],
        identity[N_SEQS];
    for (size_t i = 0; i < N_SEQS; i++) identity[i] = i;
    epoch_order(&ds1, 0, e0);
    epoch_order(&ds1, 1, e1);
    epoch_order(&ds2, 1, again1); // the other order: ds2 must rebuild epoch 0 after epoch 1
    epoch_order(&ds2, 0, again0);
    epoch_order(&ds_seed2, 0, seed2);
    epoch_order(&ds_plain, 3, plain);
    CHECK_MSG(is_permutation(e0, N_SEQS) && is_permutation(e1, N_SEQS),
              "an epoch is not a permutation");
    CHECK_MSG(!same_order(e0, identity, N_SEQS), "epoch 0 is not shuffled");
    CHECK_MSG(!same_order(e0, e1, N_SEQS), "epochs 0 and 1 have the same order");
    CHECK_MSG(!same_order(e0, seed2, N_SEQS), "seeds 1 and 2 give the same order");
    CHECK_MSG(same_order(e0, again0, N_SEQS) && same_order(e1, again1, N_SEQS),
              "two Datasets with one seed disagree (first differing index 0: %zu vs %zu)", e0[0],
              again0[0]);
    CHECK_MSG(same_order(plain, identity, N_SEQS), "without shuffle the order is not the identity");
    // Pinned: checkpoints store only the stream index, so a changed shuffle would silently resume
    // a run on different data. Update these only together with a note in docs/FORMATS.md.
    CHECK_MSG(e0[0] == 11 && e0[1] == 18 && e0[2] == 3 && e1[0] == 33 && e1[1] == 1 && e1[2] == 39,
              "seed 1 order changed: epoch 0 starts %zu %zu %zu (was 11 18 3), epoch 1 starts "
              "%zu %zu %zu (was 33 1 39)",
              e0[0], e0[1], e0[2], e1[0], e1[1], e1[2]);

    // Far into the stream (epoch 10^6) both objects still agree.
    int32_t x[S + 1], y[S + 1];
    uint64_t far = 1000000ull * N_SEQS + 17;
    CHECK_OK(dataset_read(&ds1, far, x, err), err);
    CHECK_OK(dataset_read(&ds2, far, y, err), err);
    CHECK_SEQ(x, y, S + 1);
done:
    dataset_close(&ds1);
    dataset_close(&ds2);
    dataset_close(&ds_seed2);
    dataset_close(&ds_plain);
    tmp_dir_remove(dir);
}

static int compare_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

// The order of an epoch is a bijection of [0, n) for every n (1, 2, primes, powers of 2 and their
// neighbours), the same on every call, and another for another epoch or seed.
static void test_permute(void) {
    static const uint64_t NS[] = {1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 31, 32, 33, 64, 97, 100, 127,
                                  128, 129, 1000, 1023, 1024, 4099, 65536, 65537};
    for (size_t t = 0; t < sizeof NS / sizeof NS[0]; t++) {
        uint64_t n = NS[t];
        uint8_t *seen = calloc(n, 1);
        size_t fixed = 0, same_epoch1 = 0, same_seed2 = 0, bad = 0;
        for (uint64_t k = 0; k < n; k++) {
            uint64_t p = dataset_permute(7, 3, n, k);
            if (p >= n || seen[p]++ || p != dataset_permute(7, 3, n, k)) bad++;
            fixed += p == k;
            same_epoch1 += p == dataset_permute(7, 4, n, k);
            same_seed2 += p == dataset_permute(8, 3, n, k);
        }
        CHECK_MSG(!bad, "n = %llu: %zu positions out of range, repeated or not deterministic",
                  (unsigned long long)n, bad);
        // a random permutation fixes about one point; allow a few where n is large enough to judge
        if (n >= 16)
            CHECK_MSG(fixed < n / 4 && same_epoch1 < n / 4 && same_seed2 < n / 4,
                      "n = %llu: %zu fixed points, %zu agree with the next epoch, %zu with seed 8",
                      (unsigned long long)n, fixed, same_epoch1, same_seed2);
        free(seen);
    }
    // Huge n needs no memory: distinct positions stay distinct and inside [0, n).
    enum { SAMPLE = 2000 };
    uint64_t n = (1ull << 40) + 7, p[SAMPLE];
    for (uint64_t k = 0; k < SAMPLE; k++) p[k] = dataset_permute(1, 0, n, k * 999983);
    qsort(p, SAMPLE, sizeof p[0], compare_u64);
    size_t bad = p[SAMPLE - 1] >= n;
    for (size_t i = 1; i < SAMPLE; i++) bad += p[i] == p[i - 1];
    CHECK_MSG(!bad, "n = 2^40 + 7: %zu of %d positions collide or fall outside", bad, SAMPLE);
}

// ---------------------------------------------------------------------------------------------
// data_prepare without a tokenizer

// The token file at `path` must hold exactly the bytes of `text` followed by EOS.
#define CHECK_BYTE_TOKENS(path, text, n)                                                           \
    do {                                                                                           \
        TokenFile f_;                                                                              \
        uint32_t want_[64];                                                                        \
        for (size_t i_ = 0; i_ < (size_t)(n); i_++) want_[i_] = (uint8_t)(text)[i_];               \
        want_[(n)] = BYTE_EOS;                                                                     \
        CHECK_OK(token_file_open(&f_, path, 0, BYTE_VOCAB, err), err);                             \
        if (f_.base) {                                                                             \
            CHECK_MSG(f_.token_bytes == 2, "%s: token_bytes %d", path, f_.token_bytes);            \
            CHECK_TOKENS(&f_, want_, (size_t)(n) + 1);                                             \
        }                                                                                          \
        token_file_close(&f_);                                                                     \
    } while (0)

static void test_prepare_round_trip(void) {
    char dir[64], in[PATH_MAX], train[PATH_MAX], val[PATH_MAX], tmp[PATH_MAX + 4];
    MoeErr err;
    tmp_dir_make(dir, sizeof dir);
    // 12 bytes; 0xff and 0x80 must come out as ids 255 and 128, not sign-extended.
    static const char text[] = "ab\ncd\n\xff\x80\ngh\n";
    write_text(tmp_path(in, dir, "in.txt"), text);
    tmp_path(train, dir, "train.npy"), tmp_path(val, dir, "val.npy");

    // floor(0.7 * 12) = 8 is the '\n' ending line "\xff\x80\n": the cut moves back to its start, 6.
    CHECK_OK(prepare_bytes(in, train, val, 0.3, err), err);
    CHECK_BYTE_TOKENS(train, text, 6);
    CHECK_BYTE_TOKENS(val, text + 6, 6);
    snprintf(tmp, sizeof tmp, "%s.tmp", train);
    CHECK_MSG(!file_exists(tmp), "%s was left behind", tmp);

    // floor(0.75 * 12) = 9 is already a line start.
    CHECK_OK(prepare_bytes(in, train, val, 0.25, err), err);
    CHECK_BYTE_TOKENS(train, text, 9);
    CHECK_BYTE_TOKENS(val, text + 9, 3);

    // No validation split: everything plus EOS, and the raw file is 13 little-endian uint16.
    unlink(val);
    CHECK_OK(prepare_bytes(in, train, NULL, 0, err), err);
    CHECK_BYTE_TOKENS(train, text, 12);
    CHECK_MSG(!file_exists(val), "val_fraction 0 wrote %s", val);
    size_t n;
    uint8_t *raw = read_whole(train, &n);
    CHECK_MSG(n == 26 && raw && raw[12] == 0xff && raw[13] == 0 && raw[24] == 0 && raw[25] == 1,
              "raw train file: %zu bytes, bytes 12-13 = %02x %02x, last two = %02x %02x", n,
              n > 13 ? raw[12] : 0, n > 13 ? raw[13] : 0, n > 1 ? raw[n - 2] : 0,
              n > 1 ? raw[n - 1] : 0);
    free(raw);

    // The output reads back as a Dataset over the byte vocabulary.
    Dataset ds;
    int32_t seq[13];
    CHECK_OK(dataset_open(&ds, train, 12, BYTE_VOCAB, 0, 1, false, err), err);
    if (ds.n_seqs == 1) {
        CHECK_OK(dataset_read(&ds, 0, seq, err), err);
        CHECK_MSG(seq[6] == 255 && seq[7] == 128 && seq[12] == BYTE_EOS,
                  "seq[6] %d, seq[7] %d, seq[12] %d", seq[6], seq[7], seq[12]);
    }
    dataset_close(&ds);
    tmp_dir_remove(dir);
}

static void test_prepare_errors(void) {
    char dir[64], in[PATH_MAX], out[PATH_MAX], val[PATH_MAX], tmp[PATH_MAX + 4];
    MoeErr err;
    tmp_dir_make(dir, sizeof dir);
    write_text(tmp_path(in, dir, "in.txt"), "one line\nanother line\n");
    tmp_path(out, dir, "out.npy"), tmp_path(val, dir, "val.npy");

    CHECK_ERR(prepare_bytes(tmp_path(tmp, dir, "missing.txt"), out, val, 0.1, err), err,
              "missing.txt", strerror(ENOENT));
    write_text(tmp_path(tmp, dir, "empty.txt"), "");
    CHECK_ERR(prepare_bytes(tmp, out, val, 0.1, err), err, "empty.txt", "empty text file");
    CHECK_ERR(prepare_bytes(in, out, val, 0.6, err), err, "val_fraction 0.6 is out of range");
    CHECK_ERR(prepare_bytes(in, out, val, -0.1, err), err, "out of range");
    CHECK_ERR(prepare_bytes(in, out, val, NAN, err), err, "out of range");
    CHECK_ERR(prepare_bytes(in, out, NULL, 0.1, err), err, "validation output path");
    CHECK_ERR(prepare_bytes(in, out, out, 0.1, err), err, "same file");
    write_text(tmp_path(tmp, dir, "one_line.txt"), "a single line without a break");
    CHECK_ERR(prepare_bytes(tmp, out, val, 0.1, err), err, "one_line.txt", "cannot split");

    // Unwritable output: the message names the file and the reason; nothing appears at the path.
    char nodir[PATH_MAX + 16];
    snprintf(nodir, sizeof nodir, "%s/no/such/out.npy", dir);
    CHECK_ERR(prepare_bytes(in, nodir, NULL, 0, err), err, nodir, strerror(ENOENT));
    CHECK_MSG(!file_exists(nodir), "%s exists after a failed write", nodir);

    // A failure keeps the previous file at PATH intact (PATH.tmp is a directory, so it cannot be
    // opened for writing).
    write_text(out, "old");
    snprintf(tmp, sizeof tmp, "%s.tmp", out);
    MOE_CHECK(mkdir(tmp, 0700) == 0, "mkdir %s", tmp);
    CHECK_ERR(prepare_bytes(in, out, NULL, 0, err), err, tmp);
    size_t n;
    uint8_t *old = read_whole(out, &n);
    CHECK_MSG(n == 3 && old && !memcmp(old, "old", 3), "%s changed by a failed run (%zu bytes)",
              out, n);
    free(old);
    tmp_dir_remove(dir);
}

// An output that is the input (by any path: the same name, "./", a hard or symbolic link), or two
// outputs that are one file, are refused before anything is written: the text stays whole.
static void test_prepare_own_input(void) {
    char dir[64], in[PATH_MAX], out[PATH_MAX], alias[PATH_MAX + 8], link_path[PATH_MAX];
    MoeErr err;
    tmp_dir_make(dir, sizeof dir);
    static const char text[] = "notes\nmore notes\n";
    write_text(tmp_path(in, dir, "notes.txt"), text);
    tmp_path(out, dir, "out.npy");
    snprintf(alias, sizeof alias, "%s/./notes.txt", dir);
    CHECK_ERR(prepare_bytes(in, in, NULL, 0, err), err, "is the input file", "notes.txt");
    CHECK_ERR(prepare_bytes(in, alias, NULL, 0, err), err, "is the input file");
    CHECK_ERR(prepare_bytes(in, out, alias, 0.5, err), err, "is the input file");
    MOE_CHECK(link(in, tmp_path(link_path, dir, "hard.npy")) == 0, "link: %s", strerror(errno));
    CHECK_ERR(prepare_bytes(in, link_path, NULL, 0, err), err, "hard.npy is the input file");
    MOE_CHECK(symlink(in, tmp_path(link_path, dir, "soft.npy")) == 0, "symlink: %s", strerror(errno));
    CHECK_ERR(prepare_bytes(in, out, link_path, 0.5, err), err, "soft.npy is the input file");
    snprintf(alias, sizeof alias, "%s/../%s/out.npy", dir, strrchr(dir, '/') + 1);
    CHECK_ERR(prepare_bytes(in, out, alias, 0.5, err), err, "are the same file");
    size_t n;
    uint8_t *kept = read_whole(in, &n);
    CHECK_MSG(n == strlen(text) && kept && !memcmp(kept, text, n), "the input changed (%zu bytes)", n);
    free(kept);
    CHECK_MSG(!file_exists(out), "%s written by a refused run", out);
    tmp_dir_remove(dir);
}

const TestCase data_tests[] = {
    {"data_headerless_u16", test_headerless_u16},
    {"data_headerless_u32", test_headerless_u32},
    {"data_npy_real", test_npy_real},
    {"data_npy_malformed", test_npy_malformed},
    {"data_bad_sizes", test_bad_sizes},
    {"data_missing_file", test_missing_file},
    {"data_token_over_vocab", test_token_over_vocab},
    {"data_too_short", test_too_short},
    {"data_mix_file", test_mix_file},
    {"data_comma_list", test_comma_list},
    {"data_sequence_boundaries", test_sequence_boundaries},
    {"data_shuffle", test_shuffle},
    {"data_many_files_few_maps", test_many_files},
    {"data_fifo_refused", test_fifo},
    {"data_permute", test_permute},
    {"data_prepare_round_trip", test_prepare_round_trip},
    {"data_prepare_errors", test_prepare_errors},
    {"data_prepare_own_input", test_prepare_own_input},
    {0},
};
