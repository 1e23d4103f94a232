// Tests: safetensors reader and writer. Files live in a mkdtemp folder under /tmp; some come from
// the writer, others are built byte by byte here so that the reader is checked against the format
// itself rather than against the writer's idea of it.
#define _FILE_OFFSET_BITS 64

#include <dirent.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include "io/safetensors.h"
#include "test.h"

#define PATH_LEN 512

// ---------------------------------------------------------------------------------------------
// Helpers

static int make_tmp_dir(char *dir) {
    strcpy(dir, "/tmp/moe_st_test_XXXXXX");
    if (mkdtemp(dir)) return 1;
    TEST_FAIL("mkdtemp failed");
    return 0;
}

static void remove_tmp_dir(const char *dir) {
    DIR *d = opendir(dir);
    char path[PATH_LEN];
    for (struct dirent *e; d && (e = readdir(d));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (remove(path) != 0) TEST_FAIL("cannot remove %s", path);
    }
    if (d) closedir(d);
    if (rmdir(dir) != 0) TEST_FAIL("cannot remove %s", dir);
}

static void put_le(uint8_t *p, uint64_t v, size_t bytes) {
    for (size_t i = 0; i < bytes; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static void put_f32_le(uint8_t *p, float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    put_le(p, bits, 4);
}

static int write_file(const char *path, const void *data, size_t bytes) {
    FILE *f = fopen(path, "wb");
    int ok = f && fwrite(data, 1, bytes, f) == bytes;
    if (f && fclose(f) != 0) ok = 0;
    if (!ok) TEST_FAIL("cannot write %s", path);
    return ok;
}

// A safetensors file built by hand: 8-byte little-endian header length, the header text as
// given (no padding), then `data` (or zeros when NULL).
static int write_st_file(const char *path, const char *header, const uint8_t *data,
                         size_t data_len) {
    size_t hlen = strlen(header), total = 8 + hlen + data_len;
    uint8_t *buf = calloc(total, 1);
    put_le(buf, hlen, 8);
    memcpy(buf + 8, header, hlen);
    if (data) memcpy(buf + 8 + hlen, data, data_len);
    int ok = write_file(path, buf, total);
    free(buf);
    return ok;
}

static uint8_t *read_whole_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseeko(f, 0, SEEK_END);
    *len = (size_t)ftello(f);
    rewind(f);
    uint8_t *buf = malloc(*len ? *len : 1);
    if (fread(buf, 1, *len, f) != *len) free(buf), buf = NULL;
    fclose(f);
    return buf;
}

// Reads a whole tensor (or a slice) and compares it with `expected`.
static void check_tensor_values(const SafeTensors *st, const char *name, size_t offset,
                                size_t count, const float *expected) {
    const StTensor *t = st_find(st, name);
    if (!t) {
        TEST_FAIL("tensor '%s' not found", name);
        return;
    }
    float *got = malloc((count ? count : 1) * sizeof(float));
    double *g = malloc((count ? count : 1) * sizeof(double));
    double *e = malloc((count ? count : 1) * sizeof(double));
    MoeErr err = "";
    if (st_read_f32(st, t, offset, count, got, err) != 0) {
        TEST_FAIL("st_read_f32(%s, %zu, %zu) failed: %s", name, offset, count, err);
    } else {
        for (size_t i = 0; i < count; i++) g[i] = got[i], e[i] = expected[i];
        char what[128];
        snprintf(what, sizeof what, "%s[%zu:%zu]", name, offset, offset + count);
        test_check_arrays(what, g, e, count, 0, 0);
    }
    free(got), free(g), free(e);
}

static void check_tensor_header(const StTensor *t, const char *name, StDtype dtype, int ndim,
                                const size_t *shape, size_t numel, uint64_t begin, uint64_t end) {
    CHECK_MSG(!strcmp(t->name, name), "tensor name '%s', expected '%s'", t->name, name);
    CHECK_MSG(t->dtype == dtype, "%s: dtype %d, expected %d", name, (int)t->dtype, (int)dtype);
    CHECK_MSG(t->ndim == ndim, "%s: ndim %d, expected %d", name, t->ndim, ndim);
    for (int i = 0; i < ndim && t->ndim == ndim; i++)
        CHECK_MSG(t->shape[i] == shape[i], "%s: shape[%d] = %zu, expected %zu", name, i,
                  t->shape[i], shape[i]);
    CHECK_MSG(t->numel == numel, "%s: numel %zu, expected %zu", name, t->numel, numel);
    CHECK_MSG(t->begin == begin && t->end == end, "%s: data_offsets [%llu, %llu], expected "
              "[%llu, %llu]", name, (unsigned long long)t->begin, (unsigned long long)t->end,
              (unsigned long long)begin, (unsigned long long)end);
}

static void check_meta(const SafeTensors *st, const char *key, const char *expected) {
    const char *got = st_meta_get(st, key);
    if (!expected) CHECK_MSG(!got, "metadata '%s' = '%s', expected absent", key, got);
    else CHECK_MSG(got && !strcmp(got, expected), "metadata '%s' = '%s', expected '%s'", key,
                   got ? got : "(absent)", expected);
}

static void check_err(int rc, const char *err, const char *path, const char *word,
                      const char *what) {
    CHECK_MSG(rc == -1, "%s: returned %d, expected -1", what, rc);
    CHECK_MSG(strstr(err, path) && strstr(err, word),
              "%s: message should name %s and contain \"%s\"; got: %s", what, path, word, err);
}

// st_open must fail, name the file and the problem, and leave nothing open.
static void expect_reject(const char *path, const char *word, const char *what) {
    SafeTensors st;
    MoeErr err = "";
    int rc = st_open(&st, path, err);
    check_err(rc, err, path, word, what);
    CHECK_MSG(!st.file && !st.tensors && !st.path, "%s: a failed st_open left state behind", what);
    if (rc == 0) st_close(&st);
}

// ---------------------------------------------------------------------------------------------
// Round trip through the writer and reader

enum { RT_W2D = 12, RT_W3D = 12, RT_BF = 4, RT_IDS = 3 };

// Every tensor's little-endian bytes, in declaration order; returns the byte count.
static size_t roundtrip_data(uint8_t *buf, float *w2d, float *w3d, float scalar,
                             const uint16_t *bf) {
    size_t o = 0;
    for (int i = 0; i < RT_W2D; i++, o += 4) put_f32_le(buf + o, w2d[i]);
    for (int i = 0; i < RT_W3D; i++, o += 4) put_f32_le(buf + o, w3d[i]);
    put_f32_le(buf + o, scalar), o += 4;
    for (int i = 0; i < RT_BF; i++, o += 2) put_le(buf + o, bf[i], 2);
    for (int i = 0; i < RT_IDS; i++, o += 4) put_le(buf + o, (uint64_t)(7 + i), 4);
    return o;
}

static int roundtrip_write(const char *path, const uint8_t *data, size_t bytes) {
    static const size_t s2[] = {3, 4}, s3[] = {2, 3, 2}, s0[] = {0}, s50[] = {5, 0}, sbf[] = {4},
                        sid[] = {3};
    StWriter w;
    MoeErr err = "";
    int ok = st_writer_open(&w, path, err) == 0;
    if (!ok) {
        TEST_FAIL("writer open: %s", err);
        return 0;
    }
    st_writer_add(&w, "layer.w2d", ST_F32, 2, s2);
    st_writer_add(&w, "layer.w3d", ST_F32, 3, s3);
    st_writer_add(&w, "scalar", ST_F32, 0, NULL);
    st_writer_add(&w, "empty", ST_F32, 1, s0);
    st_writer_add(&w, "empty2", ST_F32, 2, s50);
    st_writer_add(&w, "bf", ST_BF16, 1, sbf);
    st_writer_add(&w, "ids", ST_I32, 1, sid);
    st_writer_meta(&w, "format", "pt");
    st_writer_meta(&w, "step", "10");
    st_writer_meta(&w, "step", "11"); // replaces
    // Irregular chunks that straddle tensor boundaries, plus an empty write.
    static const size_t chunks[] = {1, 2, 0, 45, 7, 41, 13};
    size_t o = 0;
    for (size_t c = 0; ok && c < sizeof chunks / sizeof chunks[0] && o < bytes; c++) {
        size_t n = chunks[c] < bytes - o ? chunks[c] : bytes - o;
        ok = st_writer_write(&w, data + o, n, err) == 0;
        o += n;
    }
    ok = ok && st_writer_write(&w, data + o, bytes - o, err) == 0;
    if (ok) ok = st_writer_close(&w, err) == 0;
    else st_writer_abort(&w);
    CHECK_MSG(ok, "writing %s failed: %s", path, err);
    return ok;
}

static void roundtrip_check_header(const SafeTensors *st, uint64_t bytes) {
    static const size_t s2[] = {3, 4}, s3[] = {2, 3, 2}, s0[] = {0}, s50[] = {5, 0}, s4[] = {4},
                        s1[] = {3};
    CHECK_MSG(st->n_tensors == 7, "n_tensors %zu, expected 7", st->n_tensors);
    if (st->n_tensors != 7) return;
    const StTensor *t = st->tensors; // offset order, which is declaration order here
    check_tensor_header(&t[0], "layer.w2d", ST_F32, 2, s2, 12, 0, 48);
    check_tensor_header(&t[1], "layer.w3d", ST_F32, 3, s3, 12, 48, 96);
    check_tensor_header(&t[2], "scalar", ST_F32, 0, NULL, 1, 96, 100);
    check_tensor_header(&t[3], "empty", ST_F32, 1, s0, 0, 100, 100);
    check_tensor_header(&t[4], "empty2", ST_F32, 2, s50, 0, 100, 100);
    check_tensor_header(&t[5], "bf", ST_BF16, 1, s4, 4, 100, 108);
    check_tensor_header(&t[6], "ids", ST_I32, 1, s1, 3, 108, 120);
    CHECK_MSG(st->data_start % 8 == 0, "data starts at byte %llu, not 8-aligned",
              (unsigned long long)st->data_start);
    CHECK_MSG(st->file_size == st->data_start + bytes, "file size %llu, expected %llu",
              (unsigned long long)st->file_size, (unsigned long long)(st->data_start + bytes));
    CHECK_MSG(st->n_meta == 2 + 7, "n_meta %zu, expected 2 + a checksum per tensor", st->n_meta);
    check_meta(st, "format", "pt");
    check_meta(st, "step", "11");
    check_meta(st, "absent", NULL);
    CHECK(st_find(st, "absent") == NULL);
}

// Every tensor carries the XXH3-64 of its bytes, empty ones included.
static void roundtrip_check_checksums(const SafeTensors *st, const uint8_t *data) {
    for (size_t i = 0; i < st->n_tensors; i++) {
        const StTensor *t = &st->tensors[i];
        uint64_t want = XXH3_64bits(data + t->begin, t->end - t->begin);
        CHECK_MSG(t->has_checksum && t->checksum == want, "%s: checksum %016llx (%s), expected "
                  "%016llx", t->name, (unsigned long long)t->checksum,
                  t->has_checksum ? "present" : "absent", (unsigned long long)want);
        MoeErr err = "";
        CHECK_MSG(st_verify(st, t, err) == 0, "st_verify(%s): %s", t->name, err);
    }
}

static void roundtrip_check_errors(const SafeTensors *st) {
    float out[16];
    MoeErr err = "";
    int rc = st_read_f32(st, st_find(st, "ids"), 0, 3, out, err);
    check_err(rc, err, st->path, "I32", "reading an I32 tensor as float");
    rc = st_read_f32(st, st_find(st, "layer.w2d"), 10, 3, out, err);
    check_err(rc, err, st->path, "layer.w2d", "reading past the end of a tensor");
    rc = st_read_f32(st, st_find(st, "layer.w2d"), 13, 0, out, err);
    check_err(rc, err, st->path, "cannot read elements", "an offset past the end");
    rc = st_read_f32(st, st_find(st, "layer.w2d"), 12, 0, out, err);
    CHECK_MSG(rc == 0, "reading 0 elements at the end failed: %s", err);
}

static void test_roundtrip(void) {
    char dir[64], path[PATH_LEN];
    if (!make_tmp_dir(dir)) return;
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    float w2d[RT_W2D], w3d[RT_W3D], scalar = 3.25f;
    for (int i = 0; i < RT_W2D; i++) w2d[i] = 0.5f * (float)i - 2.0f;
    for (int i = 0; i < RT_W3D; i++) w3d[i] = 100.0f + (float)i / 3.0f;
    static const uint16_t bf[RT_BF] = {0x3F80, 0xC040, 0x4049, 0x0001}; // BF16 by hand
    static const float bf_expected[RT_BF] = {1.0f, -3.0f, 3.140625f, 0x1p-133f};
    uint8_t data[256];
    size_t bytes = roundtrip_data(data, w2d, w3d, scalar, bf);
    SafeTensors st;
    MoeErr err = "";
    if (roundtrip_write(path, data, bytes)) {
        if (st_open(&st, path, err) != 0) {
            TEST_FAIL("st_open: %s", err);
        } else {
            roundtrip_check_header(&st, bytes);
            roundtrip_check_checksums(&st, data);
            check_tensor_values(&st, "layer.w2d", 0, RT_W2D, w2d);
            check_tensor_values(&st, "layer.w2d", 4, 4, w2d + 4); // row 1: a rank's slice
            check_tensor_values(&st, "layer.w3d", 0, RT_W3D, w3d);
            check_tensor_values(&st, "layer.w3d", 6, 6, w3d + 6);
            check_tensor_values(&st, "scalar", 0, 1, &scalar);
            check_tensor_values(&st, "empty", 0, 0, NULL);
            check_tensor_values(&st, "bf", 0, RT_BF, bf_expected);
            check_tensor_values(&st, "bf", 1, 2, bf_expected + 1);
            roundtrip_check_errors(&st);
            st_close(&st);
        }
    }
    remove_tmp_dir(dir);
}

// ---------------------------------------------------------------------------------------------
// Exact bytes of the writer's output, and a reader check on a file built by hand

static void test_writer_layout(void) {
    char dir[64], path[PATH_LEN];
    if (!make_tmp_dir(dir)) return;
    snprintf(path, sizeof path, "%s/layout.safetensors", dir);
    static const size_t shape[] = {2};
    const float x[2] = {1.0f, -2.0f};
    StWriter w;
    MoeErr err = "";
    int ok = st_writer_open(&w, path, err) == 0;
    if (ok) {
        st_writer_add(&w, "x", ST_F32, 1, shape);
        st_writer_meta(&w, "k", "v");
        uint8_t le[8];
        put_f32_le(le, x[0]), put_f32_le(le + 4, x[1]);
        ok = st_writer_write(&w, le, 8, err) == 0 && st_writer_close(&w, err) == 0;
    }
    CHECK_MSG(ok, "writing failed: %s", err);
    // 28a0ba9c345d3723: XXH3_64bits (seed 0) of the 8 data bytes below.
    const char *json =
        "{\"__metadata__\":{\"k\":\"v\",\"xxh3_64:x\":\"28a0ba9c345d3723\"},"
        "\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";
    size_t jlen = strlen(json), padded = (jlen + 7) / 8 * 8, len = 0;
    uint8_t expected[256];
    put_le(expected, padded, 8);
    memcpy(expected + 8, json, jlen);
    memset(expected + 8 + jlen, ' ', padded - jlen);
    static const uint8_t data[8] = {0x00, 0x00, 0x80, 0x3F, 0x00, 0x00, 0x00, 0xC0};
    memcpy(expected + 8 + padded, data, 8);
    size_t total = 8 + padded + 8;
    uint8_t *got = ok ? read_whole_file(path, &len) : NULL;
    if (got) {
        CHECK_MSG(len == total, "file is %zu bytes, expected %zu", len, total);
        for (size_t i = 0; i < len && i < total; i++) {
            if (got[i] == expected[i]) continue;
            TEST_FAIL("byte %zu is 0x%02x ('%c'), expected 0x%02x ('%c')", i, got[i],
                      got[i] >= 32 && got[i] < 127 ? got[i] : '?', expected[i],
                      expected[i] >= 32 && expected[i] < 127 ? expected[i] : '?');
            break;
        }
        free(got);
    }
    remove_tmp_dir(dir);
}

static int read_all(const SafeTensors *st, const char *name, size_t count, float *out) {
    const StTensor *t = st_find(st, name);
    MoeErr err = "tensor not found";
    int ok = t && st_read_f32(st, t, 0, count, out, err) == 0;
    CHECK_MSG(ok, "reading '%s': %s", name, err);
    return ok;
}

// Exact comparison that also accepts matching infinities and tells -0 from +0.
static void check_exact(const char *what, size_t i, float got, float expected) {
    int same = got == expected && signbit(got) == signbit(expected);
    CHECK_MSG(same, "%s[%zu] = %.9g, expected %.9g", what, i, (double)got, (double)expected);
}

static void hand_file_check_values(const SafeTensors *st) {
    static const float h_expected[8] = {1.0f, -2.0f, 65504.0f, 0x1p-24f, 1023 * 0x1p-24f,
                                        INFINITY, -INFINITY, -0.0f};
    static const float b_expected[3] = {1.0f, -3.0f, 0x1p-133f};
    float out[8];
    if (read_all(st, "h", 8, out))
        for (size_t i = 0; i < 8; i++) check_exact("h (F16)", i, out[i], h_expected[i]);
    if (read_all(st, "b", 3, out))
        for (size_t i = 0; i < 3; i++) check_exact("b (BF16)", i, out[i], b_expected[i]);
    if (read_all(st, "n", 1, out))
        CHECK_MSG(isnan(out[0]), "F16 0x7e00 read as %g, expected NaN", (double)out[0]);
    if (read_all(st, "d", 1, out)) check_exact("d (F64)", 0, out[0], (float)0.1);
}

static void test_hand_written_file(void) {
    char dir[64], path[PATH_LEN];
    if (!make_tmp_dir(dir)) return;
    snprintf(path, sizeof path, "%s/hand.safetensors", dir);
    // Entries out of offset order, metadata last, header length not a multiple of 8.
    const char *header =
        "{\"h\":{\"dtype\":\"F16\",\"shape\":[2,4],\"data_offsets\":[8,24]},"
        "\"b\":{\"dtype\":\"BF16\",\"shape\":[3],\"data_offsets\":[26,32]},"
        "\"d\":{\"dtype\":\"F64\",\"shape\":[],\"data_offsets\":[0,8]},"
        "\"n\":{\"dtype\":\"F16\",\"shape\":[1],\"data_offsets\":[24,26]},"
        "\"__metadata__\":{\"who\":\"hand\"}}";
    uint8_t data[32];
    put_le(data, 0x3FB999999999999AULL, 8); // 0.1 as a double
    static const uint16_t h[8] = {0x3C00, 0xC000, 0x7BFF, 0x0001, 0x03FF, 0x7C00, 0xFC00, 0x8000};
    for (int i = 0; i < 8; i++) put_le(data + 8 + 2 * i, h[i], 2);
    put_le(data + 24, 0x7E00, 2);
    static const uint16_t b[3] = {0x3F80, 0xC040, 0x0001};
    for (int i = 0; i < 3; i++) put_le(data + 26 + 2 * i, b[i], 2);
    SafeTensors st;
    MoeErr err = "";
    if (write_st_file(path, header, data, sizeof data)) {
        if (st_open(&st, path, err) != 0) {
            TEST_FAIL("st_open: %s", err);
        } else {
            static const size_t sh[] = {2, 4}, sb[] = {3}, sn[] = {1};
            CHECK_MSG(st.n_tensors == 4, "n_tensors %zu, expected 4", st.n_tensors);
            CHECK_MSG(st.data_start == 8 + strlen(header), "data_start %llu, expected %zu",
                      (unsigned long long)st.data_start, 8 + strlen(header));
            if (st.n_tensors == 4) { // sorted by offset
                check_tensor_header(&st.tensors[0], "d", ST_F64, 0, NULL, 1, 0, 8);
                check_tensor_header(&st.tensors[1], "h", ST_F16, 2, sh, 8, 8, 24);
                check_tensor_header(&st.tensors[2], "n", ST_F16, 1, sn, 1, 24, 26);
                check_tensor_header(&st.tensors[3], "b", ST_BF16, 1, sb, 3, 26, 32);
            }
            check_meta(&st, "who", "hand");
            for (size_t i = 0; i < st.n_tensors; i++) // files without checksums still load
                CHECK_MSG(!st.tensors[i].has_checksum, "%s: a checksum out of nowhere",
                          st.tensors[i].name);
            hand_file_check_values(&st);
            st_close(&st);
        }
    }
    remove_tmp_dir(dir);
}

// A tensor past the 4 GiB mark in a sparse file: offsets and seeks must be 64-bit.
static void test_large_offsets(void) {
    char dir[64], path[PATH_LEN];
    if (!make_tmp_dir(dir)) return;
    snprintf(path, sizeof path, "%s/big.safetensors", dir);
    const char *header =
        "{\"pad\":{\"dtype\":\"U8\",\"shape\":[5368709120],\"data_offsets\":[0,5368709120]},"
        "\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[5368709120,5368709128]}}";
    uint8_t tail[8];
    put_f32_le(tail, 1.5f), put_f32_le(tail + 4, -7.0f);
    FILE *f = NULL;
    if (write_st_file(path, header, NULL, 0) && (f = fopen(path, "r+b"))) {
        int ok = fseeko(f, (off_t)(8 + strlen(header)) + 5368709120LL, SEEK_SET) == 0 &&
                 fwrite(tail, 1, 8, f) == 8;
        ok &= fclose(f) == 0;
        CHECK_MSG(ok, "cannot extend %s to 5 GiB (sparse)", path);
        SafeTensors st;
        MoeErr err = "";
        if (ok && st_open(&st, path, err) != 0) {
            TEST_FAIL("st_open: %s", err);
        } else if (ok) {
            const float expected[2] = {1.5f, -7.0f};
            check_tensor_values(&st, "x", 0, 2, expected);
            check_tensor_values(&st, "x", 1, 1, expected + 1);
            st_close(&st);
        }
    }
    remove_tmp_dir(dir);
}

// ---------------------------------------------------------------------------------------------
// Rejections

typedef struct {
    const char *what;
    const char *header;
    size_t data_len;
    const char *word; // the message must contain it (besides the path)
} BadHeader;

#define T4(name, off) "\"" name "\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":" off "}"

static const BadHeader bad_headers[] = {
    {"bad JSON", "{\n\"a\": [1,\n}", 0, "line 3"},
    {"invalid UTF-8", "{\"\xff\":1}", 0, "not valid JSON"},
    {"top level array", "[1, 2]", 0, "is an array, expected a JSON object"},
    {"entry not an object", "{\"a\":3}", 0, "'a' is 3, expected an object"},
    {"missing dtype", "{\"a\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "no \"dtype\""},
    {"missing shape", "{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4, "no \"shape\""},
    {"missing data_offsets", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4,
     "no \"data_offsets\""},
    {"dtype not a string", "{\"a\":{\"dtype\":32,\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
     "\"dtype\" is 32"},
    {"shape not an array", "{\"a\":{\"dtype\":\"F32\",\"shape\":\"1\",\"data_offsets\":[0,4]}}",
     4, "\"shape\" is the string \"1\""},
    {"data_offsets not an array",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":{\"begin\":0}}}", 4,
     "\"data_offsets\" is an object"},
    {"unknown dtype", "{\"a\":{\"dtype\":\"FP32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
     "unknown dtype \"FP32\", did you mean \"F32\""},
    {"negative dim", "{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4,
     "shape[0] is -1"},
    {"non-integer dim", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2.5],\"data_offsets\":[0,4]}}", 4,
     "shape[1] is 2.5"},
    {"too many dims",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", 4,
     "9 dimensions"},
    {"element count overflow",
     "{\"a\":{\"dtype\":\"U8\",\"shape\":[4294967296,4294967296,2],\"data_offsets\":[0,4]}}", 4,
     "too large"},
    {"shape vs bytes", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", 4,
     "tensor 'a' has shape [2] (8 bytes as F32) but data_offsets span 4 bytes"},
    {"three offsets", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}", 8,
     "3 entries"},
    {"negative offset", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}", 4,
     "data_offsets[0] is -4"},
    {"begin after end", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,4]}}", 8,
     "begin is after end"},
    {"offsets out of range", "{" T4("a", "[0,4]") "," T4("b", "[100,104]") "}", 4,
     "'b' has data_offsets [100, 104] past the end"},
    {"data shorter than declared", "{" T4("a", "[0,4]") "," T4("b", "[4,8]") "}", 6,
     "past the end of the 6-byte data buffer"},
    {"overlap", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12,
     "overlap"},
    {"empty tensor inside another",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
     "\"z\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[4,4]}}",
     8, "overlap"},
    {"hole", "{" T4("a", "[0,4]") "," T4("b", "[8,12]") "}", 12, "[4, 8) belong to no tensor"},
    {"hole at start", "{" T4("a", "[4,8]") "}", 8, "hole before tensor 'a'"},
    {"trailing bytes", "{" T4("a", "[0,4]") "}", 8, "4 trailing bytes"},
    {"trailing bytes, no tensors", "{}", 3, "3 trailing bytes"},
    {"duplicate names", "{" T4("a", "[0,4]") "," T4("a", "[4,8]") "}", 8, "duplicate"},
    {"metadata not an object", "{\"__metadata__\":[1]}", 0, "\"__metadata__\" is an array"},
    {"metadata value not a string", "{\"__metadata__\":{\"k\":\"v\",\"step\":10}}", 0,
     "key 'step' is 10, expected a string"},
    {"checksum not hex", "{\"__metadata__\":{\"xxh3_64:a\":\"28a0ba9c345d372g\"}," T4("a", "[0,4]") "}",
     4, "key 'xxh3_64:a' is \"28a0ba9c345d372g\", expected 16 hex digits"},
    {"checksum too short", "{\"__metadata__\":{\"xxh3_64:a\":\"28a0\"}," T4("a", "[0,4]") "}", 4,
     "expected 16 hex digits"},
    {"checksum of no tensor", "{\"__metadata__\":{\"xxh3_64:b\":\"28a0ba9c345d3723\"},"
     T4("a", "[0,4]") "}", 4, "'xxh3_64:b' is the checksum of a tensor the file does not hold"},
    {0},
};

static void test_reject_headers(void) {
    char dir[64], path[PATH_LEN];
    if (!make_tmp_dir(dir)) return;
    for (const BadHeader *c = bad_headers; c->what; c++) {
        snprintf(path, sizeof path, "%s/bad%d.safetensors", dir, (int)(c - bad_headers));
        if (write_st_file(path, c->header, NULL, c->data_len))
            expect_reject(path, c->word, c->what);
    }
    remove_tmp_dir(dir);
}

static void test_reject_files(void) {
    char dir[64], path[PATH_LEN];
    if (!make_tmp_dir(dir)) return;
    snprintf(path, sizeof path, "%s/absent.safetensors", dir);
    expect_reject(path, "No such file", "missing file");
    expect_reject(dir, "not a regular file", "a directory");
    snprintf(path, sizeof path, "%s/empty.safetensors", dir);
    if (write_file(path, "", 0)) expect_reject(path, "shorter than the 8-byte", "empty file");
    snprintf(path, sizeof path, "%s/short.safetensors", dir);
    if (write_file(path, "\x02\0\0\0\0", 5)) expect_reject(path, "5 bytes", "5-byte file");
    uint8_t lying[8 + 12];
    put_le(lying, 1000, 8);
    memcpy(lying + 8, "{}          ", 12);
    snprintf(path, sizeof path, "%s/lying.safetensors", dir);
    if (write_file(path, lying, sizeof lying))
        expect_reject(path, "header length 1000", "header length larger than the file");
    put_le(lying, 1ULL << 63, 8);
    if (write_file(path, lying, sizeof lying))
        expect_reject(path, "header length 9223372036854775808", "header length 2^63");
    remove_tmp_dir(dir);
}

// ---------------------------------------------------------------------------------------------
// Writer errors

static void test_writer_missing_bytes(void) {
    char dir[64], path[PATH_LEN];
    if (!make_tmp_dir(dir)) return;
    snprintf(path, sizeof path, "%s/short.safetensors", dir);
    static const size_t s4[] = {4};
    const float x[4] = {0};
    StWriter w;
    MoeErr err = "";
    if (st_writer_open(&w, path, err) == 0) {
        st_writer_add(&w, "a", ST_F32, 1, s4);
        st_writer_add(&w, "t", ST_F32, 1, s4);
        CHECK_MSG(st_writer_write(&w, x, 16, err) == 0, "write: %s", err);
        CHECK_MSG(st_writer_write(&w, x, 8, err) == 0, "write: %s", err);
        check_err(st_writer_close(&w, err), err, path, "24 of 32 declared",
                  "closing with missing bytes");
        CHECK_MSG(strstr(err, "tensor 't' is incomplete"), "message should name tensor 't': %s",
                  err);
        // The incomplete file must not pass the reader either.
        expect_reject(path, "past the end", "reading an incomplete file");
    } else {
        TEST_FAIL("writer open: %s", err);
    }
    remove_tmp_dir(dir);
}

static void test_writer_too_many_bytes(void) {
    char dir[64], path[PATH_LEN];
    if (!make_tmp_dir(dir)) return;
    snprintf(path, sizeof path, "%s/long.safetensors", dir);
    static const size_t s2[] = {2};
    const float x[4] = {0};
    StWriter w;
    MoeErr err = "";
    if (st_writer_open(&w, path, err) == 0) {
        st_writer_add(&w, "a", ST_F32, 1, s2);
        CHECK_MSG(st_writer_write(&w, x, 4, err) == 0, "write: %s", err);
        check_err(st_writer_write(&w, x, 8, err), err, path, "only 4 of the 8 declared",
                  "writing past the declared bytes");
        st_writer_abort(&w);
        CHECK_MSG(access(path, F_OK) != 0, "st_writer_abort left %s behind", path);
    } else {
        TEST_FAIL("writer open: %s", err);
    }
    remove_tmp_dir(dir);
}

static void test_writer_open_and_names(void) {
    char dir[64], path[PATH_LEN];
    if (!make_tmp_dir(dir)) return;
    StWriter w;
    MoeErr err = "";
    snprintf(path, sizeof path, "%s/no/such/dir.safetensors", dir);
    check_err(st_writer_open(&w, path, err), err, path, "No such file",
              "creating in a missing folder");
    snprintf(path, sizeof path, "%s/dup.safetensors", dir);
    static const size_t s1[] = {1};
    const float x = 0;
    if (st_writer_open(&w, path, err) == 0) {
        st_writer_add(&w, "a", ST_F32, 1, s1);
        st_writer_add(&w, "a", ST_F32, 1, s1);
        check_err(st_writer_write(&w, &x, 4, err), err, path, "'a' is repeated",
                  "a tensor declared twice");
        st_writer_abort(&w);
        CHECK_MSG(access(path, F_OK) != 0, "st_writer_abort left %s behind", path);
    }
    remove_tmp_dir(dir);
}

// A file with no tensors, closed without any write: the header alone, still a valid file.
static void test_writer_no_tensors(void) {
    char dir[64], path[PATH_LEN];
    if (!make_tmp_dir(dir)) return;
    snprintf(path, sizeof path, "%s/none.safetensors", dir);
    StWriter w;
    SafeTensors st;
    MoeErr err = "";
    int ok = st_writer_open(&w, path, err) == 0 && st_writer_close(&w, err) == 0;
    CHECK_MSG(ok, "writing an empty file failed: %s", err);
    size_t len = 0;
    uint8_t *got = ok ? read_whole_file(path, &len) : NULL;
    static const uint8_t expected[16] = {8,   0,   0,   0,   0,   0,   0,   0,
                                         '{', '}', ' ', ' ', ' ', ' ', ' ', ' '};
    CHECK_MSG(got && len == 16 && !memcmp(got, expected, 16), "empty file is %zu bytes: '%.*s'",
              len, got ? (int)len : 0, got ? (const char *)got : "");
    free(got);
    if (ok && st_open(&st, path, err) == 0) {
        CHECK_MSG(st.n_tensors == 0 && st.n_meta == 0, "%zu tensors and %zu metadata entries",
                  st.n_tensors, st.n_meta);
        st_close(&st);
    } else if (ok) {
        TEST_FAIL("st_open: %s", err);
    }
    remove_tmp_dir(dir);
}

// /dev/full fails every flush with ENOSPC: the message must say so. (Never abort here: that would
// unlink the path.)
static void test_writer_disk_full(void) {
    if (access("/dev/full", W_OK) != 0) return;
    static const size_t s4[] = {4};
    const float x[4] = {0};
    StWriter w;
    MoeErr err = "";
    MoeErr scratch;
    int rc = st_writer_open(&w, "/dev/full", err);
    CHECK_MSG(rc == 0, "opening /dev/full: %s", err);
    if (rc != 0) return;
    st_writer_add(&w, "a", ST_F32, 1, s4);
    rc = st_writer_write(&w, x, sizeof x, err); // buffered: succeeds or fails with ENOSPC
    if (rc == 0) rc = st_writer_close(&w, err);
    else st_writer_close(&w, scratch);
    check_err(rc, err, "/dev/full", "disk full?", "writing to /dev/full");
}

// ---------------------------------------------------------------------------------------------
// Checksums: a flipped byte in a tensor's data

static int write_two_tensors(const char *path) {
    static const size_t s4[] = {4};
    const float x[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    StWriter w;
    MoeErr err = "";
    int ok = st_writer_open(&w, path, err) == 0;
    if (ok) {
        st_writer_add(&w, "a", ST_F32, 1, s4);
        st_writer_add(&w, "b", ST_F32, 1, s4);
        ok = st_writer_write(&w, x, sizeof x, err) == 0 && st_writer_close(&w, err) == 0;
    }
    CHECK_MSG(ok, "writing %s: %s", path, err);
    return ok;
}

// Flips one bit of byte `at` of the file.
static int flip_byte(const char *path, long at) {
    FILE *f = fopen(path, "r+b");
    int c = f && fseek(f, at, SEEK_SET) == 0 ? fgetc(f) : EOF;
    int ok = c != EOF && fseek(f, at, SEEK_SET) == 0 && fputc(c ^ 0x10, f) != EOF;
    if (f) ok &= fclose(f) == 0;
    CHECK_MSG(ok, "cannot change byte %ld of %s", at, path);
    return ok;
}

static void test_checksum_damage(void) {
    char dir[64], path[PATH_LEN];
    if (!make_tmp_dir(dir)) return;
    snprintf(path, sizeof path, "%s/damaged.safetensors", dir);
    SafeTensors st;
    MoeErr err = "";
    float out[4];
    if (write_two_tensors(path) && st_open(&st, path, err) == 0) {
        long at = (long)(st.data_start + st_find(&st, "b")->begin + 5);
        st_close(&st);
        if (flip_byte(path, at) && st_open(&st, path, err) == 0) {
            const StTensor *a = st_find(&st, "a"), *b = st_find(&st, "b");
            CHECK_MSG(st_read_f32(&st, a, 0, 4, out, err) == 0, "the intact tensor: %s", err);
            check_err(st_read_f32(&st, b, 0, 4, out, err), err, path,
                      "tensor 'b' does not match its checksum", "reading a damaged tensor");
            check_err(st_verify(&st, b, err), err, path, "tensor 'b' does not match",
                      "st_verify of a damaged tensor");
            CHECK_MSG(st_verify(&st, a, err) == 0, "st_verify of the intact tensor: %s", err);
            // A slice is not checked by the read itself (the caller runs st_verify).
            CHECK_MSG(st_read_f32(&st, b, 2, 2, out, err) == 0, "a slice: %s", err);
            st_close(&st);
        } else {
            TEST_FAIL("st_open of the damaged file: %s", err);
        }
    } else {
        TEST_FAIL("st_open: %s", err);
    }
    remove_tmp_dir(dir);
}

const TestCase safetensors_tests[] = {
    {"safetensors_roundtrip", test_roundtrip},
    {"safetensors_writer_layout", test_writer_layout},
    {"safetensors_hand_written_file", test_hand_written_file},
    {"safetensors_large_offsets", test_large_offsets},
    {"safetensors_reject_headers", test_reject_headers},
    {"safetensors_reject_files", test_reject_files},
    {"safetensors_writer_missing_bytes", test_writer_missing_bytes},
    {"safetensors_writer_too_many_bytes", test_writer_too_many_bytes},
    {"safetensors_writer_open_and_names", test_writer_open_and_names},
    {"safetensors_writer_no_tensors", test_writer_no_tensors},
    {"safetensors_writer_disk_full", test_writer_disk_full},
    {"safetensors_checksum_damage", test_checksum_damage},
    {0},
};
