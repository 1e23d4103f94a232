// safetensors reader and writer (format in docs/FORMATS.md). The reader checks the whole header
// before any data is used, so a corrupt or truncated checkpoint fails with a message naming the
// file and the offending entry instead of loading garbage; the writer streams and fsyncs.
#define _FILE_OFFSET_BITS 64 // files above 2 GiB on 32-bit hosts too

#include "io/safetensors.h"

#include <errno.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>
#include <xxhash.h>

#include "io/fsutil.h"

// The upstream library refuses larger headers; a bogus length must not turn into a huge malloc.
#define ST_MAX_HEADER_BYTES 100000000ULL
#define ST_READ_CHUNK 65536 // elements converted per fread in st_read_f32
#define ST_META_KEY "__metadata__"
#define ST_CHECKSUM_KEY "xxh3_64:" // + tensor name: "__metadata__" key of a tensor's checksum
#define ST_CHECKSUM_DIGITS 16

static const struct {
    const char *name;
    size_t size;
} st_dtypes[ST_N_DTYPES] = {
    [ST_F64] = {"F64", 8},  [ST_F32] = {"F32", 4},         [ST_F16] = {"F16", 2},
    [ST_BF16] = {"BF16", 2}, [ST_I64] = {"I64", 8},        [ST_I32] = {"I32", 4},
    [ST_I16] = {"I16", 2},  [ST_I8] = {"I8", 1},           [ST_U8] = {"U8", 1},
    [ST_BOOL] = {"BOOL", 1}, [ST_F8_E4M3] = {"F8_E4M3", 1}, [ST_F8_E5M2] = {"F8_E5M2", 1},
};

const char *st_dtype_name(StDtype dtype) {
    MOE_ASSERT((unsigned)dtype < ST_N_DTYPES);
    return st_dtypes[dtype].name;
}

size_t st_dtype_size(StDtype dtype) {
    MOE_ASSERT((unsigned)dtype < ST_N_DTYPES);
    return st_dtypes[dtype].size;
}

static const char *st_enospc_hint(int errnum) {
    return errnum == ENOSPC || errnum == EDQUOT ? " (disk full?)" : "";
}

// ---------------------------------------------------------------------------------------------
// Reader: header validation

// "an array", "-3", "2.5", ... : how a JSON value is named in a message about the wrong type.
static const char *st_json_desc(const json_t *v, char *buf, size_t len) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: snprintf(buf, len, "the string \"%s\"", json_string_value(v)); return buf;
    case JSON_INTEGER: snprintf(buf, len, "%lld", (long long)json_integer_value(v)); return buf;
    case JSON_REAL: snprintf(buf, len, "%g", json_real_value(v)); return buf;
    case JSON_TRUE: return "true";
    case JSON_FALSE: return "false";
    default: return "null";
    }
}

static int st_json_u64(const json_t *v, uint64_t *out) {
    if (!json_is_integer(v) || json_integer_value(v) < 0) return 0;
    *out = (uint64_t)json_integer_value(v);
    return 1;
}

void st_format_shape(const size_t *shape, int ndim, char *buf, size_t len) {
    size_t o = (size_t)snprintf(buf, len, "[");
    for (int i = 0; i < ndim && o < len; i++)
        o += (size_t)snprintf(buf + o, len - o, "%s%zu", i ? ", " : "", shape[i]);
    if (o < len) snprintf(buf + o, len - o, "]");
}

// A required member of a tensor entry, of the given JSON type.
static const json_t *st_field(const SafeTensors *st, const char *name, const json_t *entry,
                              const char *key, json_type type, const char *want, MoeErr err) {
    const json_t *v = json_object_get(entry, key);
    char buf[64];
    if (!v) {
        moe_err(err, "%s: tensor '%s' has no \"%s\" (entries need dtype, shape and data_offsets)",
                st->path, name, key);
        return NULL;
    }
    if (json_typeof(v) != type) {
        moe_err(err, "%s: tensor '%s': \"%s\" is %s, expected %s", st->path, name, key,
                st_json_desc(v, buf, sizeof buf), want);
        return NULL;
    }
    return v;
}

static int st_parse_dtype(const SafeTensors *st, const char *name, const json_t *v, StDtype *out,
                          MoeErr err) {
    const char *s = json_string_value(v);
    const char *names[ST_N_DTYPES];
    for (int d = 0; d < ST_N_DTYPES; d++) {
        names[d] = st_dtypes[d].name;
        if (!strcmp(s, names[d])) return *out = (StDtype)d, 0;
    }
    const char *hint = moe_suggest(s, names, ST_N_DTYPES);
    return moe_err(err, "%s: tensor '%s' has unknown dtype \"%s\"%s%s%s (known: F64 F32 F16 BF16 "
                   "I64 I32 I16 I8 U8 BOOL F8_E4M3 F8_E5M2)", st->path, name, s,
                   hint ? ", did you mean \"" : "", hint ? hint : "", hint ? "\"?" : "");
}

static int st_parse_shape(const SafeTensors *st, const char *name, const json_t *v, StTensor *t,
                          MoeErr err) {
    char buf[64];
    if (json_array_size(v) > ST_MAX_DIMS)
        return moe_err(err, "%s: tensor '%s' has %zu dimensions; at most %d are supported",
                       st->path, name, json_array_size(v), ST_MAX_DIMS);
    t->ndim = (int)json_array_size(v);
    t->numel = 1; // a scalar has shape []
    for (int i = 0; i < t->ndim; i++) {
        const json_t *d = json_array_get(v, (size_t)i);
        uint64_t dim;
        if (!st_json_u64(d, &dim))
            return moe_err(err, "%s: tensor '%s': shape[%d] is %s, expected a non-negative integer",
                           st->path, name, i, st_json_desc(d, buf, sizeof buf));
        t->shape[i] = (size_t)dim;
        if (dim && t->numel > SIZE_MAX / dim)
            return moe_err(err, "%s: tensor '%s': shape is too large (element count overflows)",
                           st->path, name);
        t->numel *= (size_t)dim;
    }
    return 0;
}

static int st_parse_offsets(const SafeTensors *st, const char *name, const json_t *v,
                            StTensor *t, MoeErr err) {
    char buf[64];
    if (json_array_size(v) != 2)
        return moe_err(err, "%s: tensor '%s': data_offsets has %zu entries, expected [begin, end]",
                       st->path, name, json_array_size(v));
    uint64_t *ends[2] = {&t->begin, &t->end};
    for (size_t i = 0; i < 2; i++) {
        const json_t *o = json_array_get(v, i);
        if (!st_json_u64(o, ends[i]))
            return moe_err(err, "%s: tensor '%s': data_offsets[%zu] is %s, expected a "
                           "non-negative integer", st->path, name, i,
                           st_json_desc(o, buf, sizeof buf));
    }
    if (t->begin > t->end)
        return moe_err(err, "%s: tensor '%s' has data_offsets [%llu, %llu]: begin is after end",
                       st->path, name, (unsigned long long)t->begin, (unsigned long long)t->end);
    return 0;
}

// One "name": {"dtype", "shape", "data_offsets"} entry, checked on its own (the tiling of the
// data buffer is checked once all entries are known).
static int st_parse_tensor(const SafeTensors *st, const char *name, const json_t *entry,
                           StTensor *t, MoeErr err) {
    char buf[64];
    if (!json_is_object(entry))
        return moe_err(err, "%s: tensor '%s' is %s, expected an object with dtype, shape and "
                       "data_offsets", st->path, name, st_json_desc(entry, buf, sizeof buf));
    const json_t *dtype = st_field(st, name, entry, "dtype", JSON_STRING, "a string", err);
    const json_t *shape = dtype ? st_field(st, name, entry, "shape", JSON_ARRAY, "an array", err)
                                : NULL;
    const json_t *offs = shape ? st_field(st, name, entry, "data_offsets", JSON_ARRAY,
                                          "an array [begin, end]", err) : NULL;
    if (!offs || st_parse_dtype(st, name, dtype, &t->dtype, err) ||
        st_parse_shape(st, name, shape, t, err) || st_parse_offsets(st, name, offs, t, err))
        return -1;
    size_t esize = st_dtype_size(t->dtype);
    if (t->numel > UINT64_MAX / esize || t->numel * esize != t->end - t->begin) {
        st_format_shape(t->shape, t->ndim, buf, sizeof buf);
        return moe_err(err, "%s: tensor '%s' has shape %s (%llu bytes as %s) but data_offsets "
                       "span %llu bytes", st->path, name, buf,
                       (unsigned long long)((uint64_t)t->numel * esize), st_dtype_name(t->dtype),
                       (unsigned long long)(t->end - t->begin));
    }
    return 0;
}

static int st_parse_meta(SafeTensors *st, const json_t *meta, MoeErr err) {
    char buf[64];
    if (!json_is_object(meta))
        return moe_err(err, "%s: \"" ST_META_KEY "\" is %s, expected an object of strings",
                       st->path, st_json_desc(meta, buf, sizeof buf));
    st->meta = moe_calloc(json_object_size(meta), sizeof(StMeta));
    const char *key;
    const json_t *value;
    json_object_foreach((json_t *)meta, key, value) {
        if (!json_is_string(value))
            return moe_err(err, "%s: \"" ST_META_KEY "\" key '%s' is %s, expected a string",
                           st->path, key, st_json_desc(value, buf, sizeof buf));
        st->meta[st->n_meta].key = moe_strdup(key);
        st->meta[st->n_meta++].value = moe_strdup(json_string_value(value));
    }
    return 0;
}

static int st_parse_entries(SafeTensors *st, const json_t *root, MoeErr err) {
    char buf[64];
    if (!json_is_object(root))
        return moe_err(err, "%s: the header is %s, expected a JSON object of tensors", st->path,
                       st_json_desc(root, buf, sizeof buf));
    st->tensors = moe_calloc(json_object_size(root), sizeof(StTensor));
    const char *key;
    const json_t *value;
    json_object_foreach((json_t *)root, key, value) {
        if (!strcmp(key, ST_META_KEY)) {
            if (st_parse_meta(st, value, err)) return -1;
            continue;
        }
        StTensor t = {0};
        if (st_parse_tensor(st, key, value, &t, err)) return -1;
        t.name = moe_strdup(key);
        st->tensors[st->n_tensors++] = t;
    }
    return 0;
}

static bool st_is_checksum_key(const char *key) {
    return !strncmp(key, ST_CHECKSUM_KEY, strlen(ST_CHECKSUM_KEY));
}

// "0123456789abcdef": exactly 16 hex digits, nothing else.
static bool st_parse_hex64(const char *s, uint64_t *out) {
    uint64_t v = 0;
    size_t i = 0;
    for (; s[i] && i < ST_CHECKSUM_DIGITS; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
                : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return false;
        v = v << 4 | (uint64_t)d;
    }
    *out = v;
    return i == ST_CHECKSUM_DIGITS && !s[i];
}

// Attaches the "xxh3_64:NAME" checksums of "__metadata__" to their tensors (looked up in the
// header's JSON objects: files hold thousands of tensors). A checksum of no tensor of the file
// means the header was edited or mixed up.
static int st_parse_checksums(SafeTensors *st, const json_t *root, MoeErr err) {
    const json_t *meta = json_object_get(root, ST_META_KEY);
    size_t found = 0, keys = 0, prefix = strlen(ST_CHECKSUM_KEY);
    for (size_t i = 0; i < st->n_meta; i++) keys += st_is_checksum_key(st->meta[i].key);
    for (size_t i = 0; i < st->n_tensors && keys; i++) {
        StTensor *t = &st->tensors[i];
        char *key = moe_malloc(prefix + strlen(t->name) + 1);
        strcpy(key, ST_CHECKSUM_KEY), strcpy(key + prefix, t->name);
        const char *v = json_string_value(json_object_get(meta, key));
        int rc = v && !st_parse_hex64(v, &t->checksum)
                     ? moe_err(err, "%s: \"" ST_META_KEY "\" key '%s' is \"%.40s\", expected %d "
                               "hex digits", st->path, key, v, ST_CHECKSUM_DIGITS) : 0;
        free(key);
        if (rc) return rc;
        if (v) t->has_checksum = true, found++;
    }
    for (size_t i = 0; i < st->n_meta && found < keys; i++) {
        const char *key = st->meta[i].key;
        if (st_is_checksum_key(key) && (!json_is_object(json_object_get(root, key + prefix)) ||
                                        !strcmp(key + prefix, ST_META_KEY)))
            return moe_err(err, "%s: \"" ST_META_KEY "\" key '%s' is the checksum of a tensor the "
                           "file does not hold", st->path, key);
    }
    return 0;
}

static int st_cmp_offsets(const void *pa, const void *pb) {
    const StTensor *a = pa, *b = pb;
    if (a->begin != b->begin) return a->begin < b->begin ? -1 : 1;
    if (a->end != b->end) return a->end < b->end ? -1 : 1;
    return strcmp(a->name, b->name);
}

// Sorted by offset, the tensors must tile [0, data size) exactly: a gap or an overlap means the
// header and the data disagree, and reading on would silently load the wrong bytes.
static int st_check_tiling(SafeTensors *st, MoeErr err) {
    uint64_t data_size = st->file_size - st->data_start, pos = 0;
    qsort(st->tensors, st->n_tensors, sizeof(StTensor), st_cmp_offsets);
    for (size_t i = 0; i < st->n_tensors; i++) {
        const StTensor *t = &st->tensors[i];
        if (t->end > data_size)
            return moe_err(err, "%s: tensor '%s' has data_offsets [%llu, %llu] past the end of "
                           "the %llu-byte data buffer (file truncated?)", st->path, t->name,
                           (unsigned long long)t->begin, (unsigned long long)t->end,
                           (unsigned long long)data_size);
        if (t->begin < pos)
            return moe_err(err, "%s: tensors '%s' [%llu, %llu] and '%s' [%llu, %llu] overlap",
                           st->path, st->tensors[i - 1].name,
                           (unsigned long long)st->tensors[i - 1].begin,
                           (unsigned long long)st->tensors[i - 1].end, t->name,
                           (unsigned long long)t->begin, (unsigned long long)t->end);
        if (t->begin > pos)
            return moe_err(err, "%s: data bytes [%llu, %llu) belong to no tensor (a hole before "
                           "tensor '%s')", st->path, (unsigned long long)pos,
                           (unsigned long long)t->begin, t->name);
        pos = t->end;
    }
    if (pos != data_size)
        return moe_err(err, "%s: the data buffer has %llu bytes but the tensors end at byte %llu: "
                       "%llu trailing bytes belong to no tensor", st->path,
                       (unsigned long long)data_size, (unsigned long long)pos,
                       (unsigned long long)(data_size - pos));
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Reader: file access

static int st_open_file(SafeTensors *st, MoeErr err) {
    struct stat sb;
    st->file = fs_fopen_regular(st->path, "safetensors file", err);
    if (!st->file) return -1;
    if (fstat(fileno(st->file), &sb) != 0)
        return moe_err(err, "%s: cannot stat: %s", st->path, strerror(errno));
    st->file_size = (uint64_t)sb.st_size;
    return 0;
}

static int st_read_header(SafeTensors *st, json_t **root, MoeErr err) {
    uint8_t len_le[8];
    uint64_t len = 0;
    if (st->file_size < 8)
        return moe_err(err, "%s: file is %llu bytes, shorter than the 8-byte header length; not a "
                       "safetensors file", st->path, (unsigned long long)st->file_size);
    if (fread(len_le, 1, 8, st->file) != 8)
        return moe_err(err, "%s: cannot read the header length: %s", st->path, strerror(errno));
    for (int i = 0; i < 8; i++) len |= (uint64_t)len_le[i] << (8 * i);
    if (len > st->file_size - 8 || len > ST_MAX_HEADER_BYTES)
        return moe_err(err, "%s: header length %llu does not fit the %llu-byte file (limit %llu); "
                       "not a safetensors file or truncated", st->path, (unsigned long long)len,
                       (unsigned long long)st->file_size, ST_MAX_HEADER_BYTES);
    st->data_start = 8 + len;
    char *text = moe_malloc((size_t)len);
    if (fread(text, 1, (size_t)len, st->file) != (size_t)len) {
        free(text);
        return moe_err(err, "%s: cannot read the %llu-byte header: %s", st->path,
                       (unsigned long long)len, strerror(errno));
    }
    json_error_t jerr;
    *root = json_loadb(text, (size_t)len, JSON_REJECT_DUPLICATES, &jerr);
    free(text);
    if (!*root)
        return moe_err(err, "%s: header is not valid JSON (line %d, column %d): %s", st->path,
                       jerr.line, jerr.column, jerr.text);
    return 0;
}

int st_open(SafeTensors *st, const char *path, MoeErr err) {
    memset(st, 0, sizeof *st);
    st->path = moe_strdup(path);
    json_t *root = NULL;
    int rc = st_open_file(st, err);
    if (!rc) rc = st_read_header(st, &root, err);
    if (!rc) rc = st_parse_entries(st, root, err);
    if (!rc) rc = st_check_tiling(st, err);
    if (!rc) rc = st_parse_checksums(st, root, err);
    json_decref(root);
    if (rc) st_close(st);
    return rc;
}

void st_close(SafeTensors *st) {
    if (st->file) fclose(st->file);
    for (size_t i = 0; i < st->n_tensors; i++) free(st->tensors[i].name);
    for (size_t i = 0; i < st->n_meta; i++) free(st->meta[i].key), free(st->meta[i].value);
    free(st->tensors);
    free(st->meta);
    free(st->path);
    memset(st, 0, sizeof *st);
}

// Linear: files hold at most thousands of tensors and lookups happen once per load.
const StTensor *st_find(const SafeTensors *st, const char *name) {
    for (size_t i = 0; i < st->n_tensors; i++)
        if (!strcmp(st->tensors[i].name, name)) return &st->tensors[i];
    return NULL;
}

const char *st_meta_get(const SafeTensors *st, const char *key) {
    for (size_t i = 0; i < st->n_meta; i++)
        if (!strcmp(st->meta[i].key, key)) return st->meta[i].value;
    return NULL;
}

// ---------------------------------------------------------------------------------------------
// Reader: conversion to float (explicit little-endian, independent of the host's byte order)

static uint64_t st_load_le(const uint8_t *p, size_t bytes) {
    uint64_t v = 0;
    for (size_t i = 0; i < bytes; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static float st_bits_to_f32(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static float st_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    if (exp == 0) { // zero or subnormal: mant * 2^-24 is exact in float
        float mag = (float)mant * 0x1p-24f;
        return sign ? -mag : mag;
    }
    if (exp == 31) return st_bits_to_f32(sign | 0x7f800000u | mant << 13); // inf, NaN
    return st_bits_to_f32(sign | (exp + 112) << 23 | mant << 13);         // rebias 15 -> 127
}

static float st_bf16_to_f32(uint16_t b) { return st_bits_to_f32((uint32_t)b << 16); }

uint16_t st_f32_to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)(bits >> 16 | 0x40); // NaN: keep it quiet
    return (uint16_t)((bits + 0x7fffu + (bits >> 16 & 1)) >> 16);               // nearest, ties to even
}

static float st_elem_to_f32(StDtype dtype, const uint8_t *p) {
    switch (dtype) {
    case ST_F32: return st_bits_to_f32((uint32_t)st_load_le(p, 4));
    case ST_F16: return st_f16_to_f32((uint16_t)st_load_le(p, 2));
    case ST_BF16: return st_bf16_to_f32((uint16_t)st_load_le(p, 2));
    default: {
        uint64_t bits = st_load_le(p, 8);
        double d;
        memcpy(&d, &bits, sizeof d);
        return (float)d;
    }
    }
}

// Reads bytes [first, first + bytes) of t's data in chunks of whole elements, handing each to fn.
typedef void (*StChunkFn)(void *ctx, const uint8_t *buf, size_t bytes);

static int st_read_chunks(const SafeTensors *st, const StTensor *t, uint64_t first,
                          uint64_t bytes, StChunkFn fn, void *ctx, MoeErr err) {
    uint64_t pos = st->data_start + t->begin + first;
    if (fseeko(st->file, (off_t)pos, SEEK_SET) != 0)
        return moe_err(err, "%s: tensor '%s': cannot seek to byte %llu: %s", st->path, t->name,
                       (unsigned long long)pos, strerror(errno));
    size_t chunk = ST_READ_CHUNK * st_dtype_size(t->dtype);
    uint8_t *buf = moe_malloc(bytes < chunk ? (size_t)bytes : chunk);
    for (uint64_t done = 0; done < bytes;) {
        size_t n = bytes - done < chunk ? (size_t)(bytes - done) : chunk;
        size_t got = fread(buf, 1, n, st->file);
        if (got != n) {
            int e = ferror(st->file) ? errno : 0;
            free(buf);
            return moe_err(err, "%s: tensor '%s': short read at byte %llu: got %zu of %zu bytes "
                           "(%s)", st->path, t->name, (unsigned long long)(pos + done), got, n,
                           e ? strerror(e) : "file shrank after it was opened?");
        }
        fn(ctx, buf, n);
        done += n;
    }
    free(buf);
    return 0;
}

static int st_checksum_err(const SafeTensors *st, const StTensor *t, uint64_t got, MoeErr err) {
    return moe_err(err, "%s: tensor '%s' does not match its checksum (xxh3_64 %016llx in the "
                   "header, %016llx of the data): the file is damaged; restore it from a copy or "
                   "use an older checkpoint", st->path, t->name,
                   (unsigned long long)t->checksum, (unsigned long long)got);
}

static XXH3_state_t *st_hash_new(void) {
    XXH3_state_t *h = XXH3_createState();
    MOE_CHECK(h, "out of host memory allocating a checksum state");
    XXH3_64bits_reset(h);
    return h;
}

static void st_hash_chunk(void *hash, const uint8_t *buf, size_t bytes) {
    XXH3_64bits_update(hash, buf, bytes);
}

// Compares the digest of `hash` (then freed) with t's checksum.
static int st_hash_check(const SafeTensors *st, const StTensor *t, XXH3_state_t *hash, MoeErr err) {
    uint64_t got = XXH3_64bits_digest(hash);
    XXH3_freeState(hash);
    return got == t->checksum ? 0 : st_checksum_err(st, t, got, err);
}

int st_verify(const SafeTensors *st, const StTensor *t, MoeErr err) {
    MOE_ASSERT(st->file);
    if (!t->has_checksum) return 0;
    XXH3_state_t *hash = st_hash_new();
    if (st_read_chunks(st, t, 0, t->end - t->begin, st_hash_chunk, hash, err)) {
        XXH3_freeState(hash);
        return -1;
    }
    return st_hash_check(st, t, hash, err);
}

typedef struct {
    StDtype dtype;
    float *dst;          // the next element goes here
    XXH3_state_t *hash;  // NULL: a slice, not checked
} StF32Reader;

static void st_f32_chunk(void *ctx, const uint8_t *buf, size_t bytes) {
    StF32Reader *r = ctx;
    size_t esize = st_dtype_size(r->dtype);
    for (size_t i = 0; i < bytes / esize; i++) *r->dst++ = st_elem_to_f32(r->dtype, buf + i * esize);
    if (r->hash) XXH3_64bits_update(r->hash, buf, bytes);
}

int st_read_f32(const SafeTensors *st, const StTensor *t, size_t offset, size_t count,
                float *dst, MoeErr err) {
    MOE_ASSERT(st->file);
    if (t->dtype != ST_F32 && t->dtype != ST_F64 && t->dtype != ST_F16 && t->dtype != ST_BF16)
        return moe_err(err, "%s: tensor '%s' is %s; only F32, F64, F16 and BF16 can be read as "
                       "float", st->path, t->name, st_dtype_name(t->dtype));
    if (offset > t->numel || count > t->numel - offset)
        return moe_err(err, "%s: tensor '%s': cannot read elements [%zu, %zu + %zu) of %zu",
                       st->path, t->name, offset, offset, count, t->numel);
    if (count == 0) return 0;
    size_t esize = st_dtype_size(t->dtype);
    bool whole = count == t->numel && t->has_checksum;
    StF32Reader r = {t->dtype, dst, whole ? st_hash_new() : NULL};
    int rc = st_read_chunks(st, t, (uint64_t)offset * esize, (uint64_t)count * esize,
                            st_f32_chunk, &r, err);
    if (rc && r.hash) XXH3_freeState(r.hash);
    return rc || !r.hash ? rc : st_hash_check(st, t, r.hash, err);
}

// ---------------------------------------------------------------------------------------------
// Writer

static int st_writer_io_err(const StWriter *w, const char *what, int errnum, MoeErr err) {
    return moe_err(err, "%s: %s failed: %s%s", w->path, what, strerror(errnum),
                   st_enospc_hint(errnum));
}

int st_writer_open(StWriter *w, const char *path, MoeErr err) {
    memset(w, 0, sizeof *w);
    w->file = fopen(path, "wb");
    if (!w->file) {
        int e = errno;
        return moe_err(err, "%s: cannot create: %s%s", path, strerror(e), st_enospc_hint(e));
    }
    w->path = moe_strdup(path);
    w->hash = st_hash_new();
    return 0;
}

void st_writer_add(StWriter *w, const char *name, StDtype dtype, int ndim, const size_t *shape) {
    MOE_ASSERT(w->file && !w->header_written); // every tensor is declared before the first write
    MOE_ASSERT(ndim >= 0 && ndim <= ST_MAX_DIMS && (unsigned)dtype < ST_N_DTYPES);
    if (w->n_tensors == w->cap_tensors) {
        w->cap_tensors = w->cap_tensors ? 2 * w->cap_tensors : 16;
        w->tensors = moe_realloc(w->tensors, w->cap_tensors * sizeof(StTensor));
    }
    StTensor *t = &w->tensors[w->n_tensors++];
    memset(t, 0, sizeof *t);
    t->name = moe_strdup(name);
    t->dtype = dtype;
    t->ndim = ndim;
    t->numel = 1;
    for (int i = 0; i < ndim; i++) t->shape[i] = shape[i], t->numel *= shape[i];
    t->begin = w->data_bytes;
    t->end = t->begin + (uint64_t)t->numel * st_dtype_size(dtype);
    w->data_bytes = t->end;
}

void st_writer_meta(StWriter *w, const char *key, const char *value) {
    MOE_ASSERT(w->file && !w->header_written && !st_is_checksum_key(key)); // checksums: the writer's
    for (size_t i = 0; i < w->n_meta; i++) {
        if (!strcmp(w->meta[i].key, key)) { // a repeated key replaces the value
            free(w->meta[i].value);
            w->meta[i].value = moe_strdup(value);
            return;
        }
    }
    w->meta = moe_realloc(w->meta, (w->n_meta + 1) * sizeof(StMeta));
    w->meta[w->n_meta].key = moe_strdup(key);
    w->meta[w->n_meta++].value = moe_strdup(value);
}

static json_t *st_writer_tensor_json(const StTensor *t) {
    json_t *shape = json_array(), *offsets = json_array();
    for (int i = 0; i < t->ndim; i++)
        json_array_append_new(shape, json_integer((json_int_t)t->shape[i]));
    json_array_append_new(offsets, json_integer((json_int_t)t->begin));
    json_array_append_new(offsets, json_integer((json_int_t)t->end));
    json_t *entry = json_object();
    json_object_set_new(entry, "dtype", json_string(st_dtype_name(t->dtype)));
    json_object_set_new(entry, "shape", shape);
    json_object_set_new(entry, "data_offsets", offsets);
    return entry;
}

// Adds t's "xxh3_64:NAME" entry (zeros until its bytes are written: the header is rewritten at
// close with the same length). Returns -1 when the name is not UTF-8.
static int st_writer_checksum_json(json_t *meta, const StTensor *t) {
    size_t prefix = strlen(ST_CHECKSUM_KEY);
    char *key = moe_malloc(prefix + strlen(t->name) + 1), hex[ST_CHECKSUM_DIGITS + 1];
    strcpy(key, ST_CHECKSUM_KEY), strcpy(key + prefix, t->name);
    snprintf(hex, sizeof hex, "%016llx", (unsigned long long)t->checksum);
    int rc = json_object_set_new(meta, key, json_string(hex));
    free(key);
    return rc;
}

// The header JSON (malloc'd), tensors in declaration order; NULL with a message when a name is
// repeated or reserved, or a string is not UTF-8, since such a file could not be read back.
static char *st_writer_header_json(const StWriter *w, MoeErr err) {
    json_t *root = json_object();
    const char *bad = NULL;
    if (w->n_meta || w->n_tensors) {
        json_t *meta = json_object();
        for (size_t i = 0; i < w->n_meta && !bad; i++)
            if (json_object_set_new(meta, w->meta[i].key, json_string(w->meta[i].value)))
                bad = w->meta[i].key;
        for (size_t i = 0; i < w->n_tensors && !bad; i++)
            if (st_writer_checksum_json(meta, &w->tensors[i])) bad = w->tensors[i].name;
        json_object_set_new(root, ST_META_KEY, meta);
    }
    for (size_t i = 0; i < w->n_tensors && !bad; i++) {
        const char *name = w->tensors[i].name;
        if (!strcmp(name, ST_META_KEY) || json_object_get(root, name) ||
            json_object_set_new(root, name, st_writer_tensor_json(&w->tensors[i])))
            bad = name;
    }
    char *text = bad ? NULL : json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(root);
    if (bad)
        moe_err(err, "%s: cannot write the header: name '%s' is repeated, reserved or not UTF-8 "
                "(or its metadata value is not UTF-8)", w->path, bad);
    else if (!text)
        moe_err(err, "%s: cannot encode the header as JSON", w->path);
    return text;
}

static int st_writer_emit_header(StWriter *w, MoeErr err) {
    static const char spaces[8] = "        ";
    char *json = st_writer_header_json(w, err);
    if (!json) return -1;
    w->header_written = 1;
    size_t len = strlen(json), padded = (len + 7) / 8 * 8; // data then starts 8-byte aligned
    w->header_len = len;
    uint8_t len_le[8];
    for (int i = 0; i < 8; i++) len_le[i] = (uint8_t)((uint64_t)padded >> (8 * i));
    int ok = fwrite(len_le, 1, 8, w->file) == 8 && fwrite(json, 1, len, w->file) == len &&
             fwrite(spaces, 1, padded - len, w->file) == padded - len;
    int e = errno;
    free(json);
    return ok ? 0 : st_writer_io_err(w, "writing the header", e, err);
}

// Feeds bytes written at written_bytes to the checksums of the tensors they belong to. A tensor's
// checksum is complete once the data reaches its end (an empty tensor: its start).
static void st_writer_hash(StWriter *w, const uint8_t *p, size_t bytes) {
    uint64_t pos = w->written_bytes;
    for (;;) {
        while (w->hashed < w->n_tensors && w->tensors[w->hashed].end == pos) {
            w->tensors[w->hashed++].checksum = XXH3_64bits_digest(w->hash);
            XXH3_64bits_reset(w->hash);
        }
        if (!bytes) return;
        uint64_t left = w->tensors[w->hashed].end - pos;
        size_t n = bytes < left ? bytes : (size_t)left;
        XXH3_64bits_update(w->hash, p, n);
        p += n, bytes -= n, pos += n;
    }
}

// The header again, now with every checksum: the same length, since each is 16 hex digits.
static int st_writer_rewrite_header(StWriter *w, MoeErr err) {
    st_writer_hash(w, NULL, 0); // completes empty tensors at the end
    char *json = st_writer_header_json(w, err);
    if (!json) return -1;
    MOE_ASSERT(strlen(json) == w->header_len);
    int ok = fseeko(w->file, 8, SEEK_SET) == 0 && fwrite(json, 1, w->header_len, w->file) == w->header_len;
    int e = errno;
    free(json);
    return ok ? 0 : st_writer_io_err(w, "writing the checksums into the header", e, err);
}

// The tensor that data byte `pos` falls in (NULL past the last one), to name it in messages.
static const char *st_writer_tensor_at(const StWriter *w, uint64_t pos) {
    for (size_t i = 0; i < w->n_tensors; i++)
        if (w->tensors[i].end > pos) return w->tensors[i].name;
    return NULL;
}

int st_writer_write(StWriter *w, const void *data, size_t bytes, MoeErr err) {
    MOE_ASSERT(w->file);
    if (!w->header_written && st_writer_emit_header(w, err)) return -1;
    uint64_t left = w->data_bytes - w->written_bytes;
    if (bytes > left) {
        const char *at = st_writer_tensor_at(w, w->written_bytes);
        return moe_err(err, "%s: writing %zu bytes but only %llu of the %llu declared data bytes "
                       "remain (at tensor '%s'); the data does not match the declared shapes",
                       w->path, bytes, (unsigned long long)left,
                       (unsigned long long)w->data_bytes, at ? at : "(none left)");
    }
    if (bytes && fwrite(data, 1, bytes, w->file) != bytes)
        return st_writer_io_err(w, "writing tensor data", errno, err);
    st_writer_hash(w, data, bytes);
    w->written_bytes += bytes;
    return 0;
}

static void st_writer_free(StWriter *w) {
    if (w->file) fclose(w->file);
    if (w->hash) XXH3_freeState(w->hash);
    for (size_t i = 0; i < w->n_tensors; i++) free(w->tensors[i].name);
    for (size_t i = 0; i < w->n_meta; i++) free(w->meta[i].key), free(w->meta[i].value);
    free(w->tensors);
    free(w->meta);
    free(w->path);
    memset(w, 0, sizeof *w);
}

static int st_writer_finish(StWriter *w, MoeErr err) {
    if (!w->header_written && st_writer_emit_header(w, err)) return -1;
    if (w->written_bytes != w->data_bytes) {
        const char *at = st_writer_tensor_at(w, w->written_bytes);
        return moe_err(err, "%s: closed after %llu of %llu declared data bytes; tensor '%s' is "
                       "incomplete", w->path, (unsigned long long)w->written_bytes,
                       (unsigned long long)w->data_bytes, at);
    }
    if (w->n_tensors && st_writer_rewrite_header(w, err)) return -1;
    if (fflush(w->file) != 0) return st_writer_io_err(w, "flushing", errno, err);
    // EINVAL: the target (a pipe, /dev/null) has nothing to sync, which is not a failure.
    if (fsync(fileno(w->file)) != 0 && errno != EINVAL)
        return st_writer_io_err(w, "fsync", errno, err);
    FILE *f = w->file;
    w->file = NULL;
    if (fclose(f) != 0) return st_writer_io_err(w, "closing", errno, err);
    return 0;
}

int st_writer_close(StWriter *w, MoeErr err) {
    int rc = st_writer_finish(w, err);
    st_writer_free(w);
    return rc;
}

void st_writer_abort(StWriter *w) {
    if (w->file) fclose(w->file), w->file = NULL;
    if (w->path) unlink(w->path);
    st_writer_free(w);
}
