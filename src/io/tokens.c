// Token data: maps OLMo-core style token files (headerless arrays or real .npy) read-only and groups
// them into a Dataset of fixed-length sequences served in a seeded per-epoch shuffled order. (The
// files `moe data prepare` writes come from src/text/prepare.c.)
#include "tokens.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io/fsutil.h"

#define NPY_MAGIC "\x93NUMPY"
#define NPY_MAGIC_LEN 6
#define NPY_MAX_DIMS 8

// Little-endian read that works on any host and any alignment (.npy headers are not padded to
// the token size in older numpy versions).
static uint32_t token_le(const uint8_t *p, int bytes) {
    uint32_t v = 0;
    for (int i = bytes - 1; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static const char *token_type_name(int token_bytes) {
    return token_bytes == 2 ? "uint16" : "uint32";
}

// ---------------------------------------------------------------------------------------------
// .npy header: a Python dict literal such as
//   {'descr': '<u2', 'fortran_order': False, 'shape': (1000,), }
// parsed strictly: exactly the three keys numpy writes, plain quoted strings, no expressions.

typedef struct {
    const char *p, *end;
} NpyText;

typedef struct {
    char descr[16];
    bool fortran_order;
    int ndim;
    uint64_t dims[NPY_MAX_DIMS];
    bool have_descr, have_order, have_shape;
} NpyDict;

static void npy_skip_space(NpyText *t) {
    while (t->p < t->end && (*t->p == ' ' || *t->p == '\t' || *t->p == '\n' || *t->p == '\r'))
        t->p++;
}

static bool npy_accept(NpyText *t, char c) {
    npy_skip_space(t);
    if (t->p >= t->end || *t->p != c) return false;
    t->p++;
    return true;
}

// A bare word (True, False) must not run on into further identifier characters.
static bool npy_word(NpyText *t, const char *word) {
    npy_skip_space(t);
    size_t n = strlen(word);
    if ((size_t)(t->end - t->p) < n || memcmp(t->p, word, n) != 0) return false;
    if (t->p + n < t->end && (isalnum((unsigned char)t->p[n]) || t->p[n] == '_')) return false;
    t->p += n;
    return true;
}

// Keys and dtype strings never need escapes, so a backslash is rejected rather than decoded.
static bool npy_string(NpyText *t, char *out, size_t cap) {
    npy_skip_space(t);
    if (t->p >= t->end || (*t->p != '\'' && *t->p != '"')) return false;
    char quote = *t->p++;
    size_t n = 0;
    while (t->p < t->end && *t->p != quote) {
        if (*t->p == '\\' || n + 1 >= cap) return false;
        out[n++] = *t->p++;
    }
    if (t->p >= t->end) return false;
    t->p++;
    out[n] = 0;
    return true;
}

// Python 2 numpy wrote long dimensions with an 'L' suffix, e.g. (1000L,).
static bool npy_uint(NpyText *t, uint64_t *value) {
    npy_skip_space(t);
    if (t->p >= t->end || !isdigit((unsigned char)*t->p)) return false;
    uint64_t v = 0;
    while (t->p < t->end && isdigit((unsigned char)*t->p)) {
        uint64_t digit = (uint64_t)(*t->p++ - '0');
        if (v > (UINT64_MAX - digit) / 10) return false;
        v = v * 10 + digit;
    }
    if (t->p < t->end && *t->p == 'L') t->p++;
    *value = v;
    return true;
}

// A tuple: "()", "(n,)" or "(a, b[, ...][,])"; "(n)" is a plain int in Python, so it is rejected.
static const char *npy_shape(NpyText *t, NpyDict *d) {
    if (!npy_accept(t, '(')) return "'shape' must be a tuple such as (1000,)";
    d->ndim = 0;
    if (npy_accept(t, ')')) return NULL;
    for (;;) {
        if (d->ndim == NPY_MAX_DIMS) return "'shape' has too many dimensions";
        if (!npy_uint(t, &d->dims[d->ndim++])) return "'shape' must hold non-negative integers";
        bool comma = npy_accept(t, ',');
        if (npy_accept(t, ')'))
            return comma || d->ndim > 1 ? NULL : "'shape' (n) lacks the comma of (n,)";
        if (!comma) return "'shape' tuple is malformed (expected ',' or ')')";
    }
}

static const char *npy_value(NpyText *t, const char *key, NpyDict *d) {
    if (!strcmp(key, "descr")) {
        if (d->have_descr) return "duplicate key 'descr'";
        d->have_descr = true;
        if (!npy_string(t, d->descr, sizeof d->descr))
            return "'descr' must be a dtype string such as '<u2'";
        return NULL;
    }
    if (!strcmp(key, "fortran_order")) {
        if (d->have_order) return "duplicate key 'fortran_order'";
        d->have_order = true;
        d->fortran_order = npy_word(t, "True");
        if (!d->fortran_order && !npy_word(t, "False"))
            return "'fortran_order' must be True or False";
        return NULL;
    }
    if (!strcmp(key, "shape")) {
        if (d->have_shape) return "duplicate key 'shape'";
        d->have_shape = true;
        return npy_shape(t, d);
    }
    return "unknown key (expected only 'descr', 'fortran_order' and 'shape')";
}

// Returns NULL on success, else why the text is not a valid header dict.
static const char *npy_parse_dict(const char *text, size_t len, NpyDict *d) {
    NpyText t = {text, text + len};
    memset(d, 0, sizeof *d);
    if (!npy_accept(&t, '{')) return "the header does not start with '{'";
    for (;;) {
        if (npy_accept(&t, '}')) break;
        char key[32];
        if (!npy_string(&t, key, sizeof key)) return "expected a quoted key";
        if (!npy_accept(&t, ':')) return "expected ':' after a key";
        const char *why = npy_value(&t, key, d);
        if (why) return why;
        if (npy_accept(&t, '}')) break;
        if (!npy_accept(&t, ',')) return "expected ',' or '}' after a value";
    }
    npy_skip_space(&t);
    if (t.p != t.end) return "unexpected text after the closing '}'";
    if (!d->have_descr || !d->have_order || !d->have_shape)
        return "missing key (needs 'descr', 'fortran_order' and 'shape')";
    return NULL;
}

// The header's meaning: only flat little-endian uint16/uint32 arrays are token files.
static int npy_check_dict(const TokenFile *f, const NpyDict *d, MoeErr err) {
    if (strcmp(d->descr, "<u2") != 0 && strcmp(d->descr, "<u4") != 0)
        return moe_err(err,
                       "%s: .npy dtype '%s' is not supported; token files must be '<u2' (uint16) "
                       "or '<u4' (uint32): convert with arr.astype(numpy.uint16 or numpy.uint32)",
                       f->path, d->descr);
    if (d->fortran_order)
        return moe_err(err, "%s: .npy array is in Fortran order; save a C-order 1-D array",
                       f->path);
    if (d->ndim != 1)
        return moe_err(err,
                       "%s: .npy array has %d dimensions; token files must be 1-D "
                       "(save arr.reshape(-1))",
                       f->path, d->ndim);
    return 0;
}

// Reads the magic, version and header length, then the dict; sets token_bytes, data_offset and
// n_tokens, checking that the data after the header is exactly `shape` tokens.
static int npy_read_header(TokenFile *f, MoeErr err) {
    if (f->map_bytes < 8)
        return moe_err(err, "%s: truncated .npy header (file of %zu bytes)", f->path, f->map_bytes);
    int major = f->base[6], minor = f->base[7];
    if (major < 1 || major > 3 || minor != 0)
        return moe_err(err, "%s: unsupported .npy format version %d.%d (expected 1.0, 2.0 or 3.0)",
                       f->path, major, minor);
    // Version 1 stores the header length in 2 bytes, later versions in 4.
    size_t prefix = major == 1 ? 10 : 12;
    if (f->map_bytes < prefix)
        return moe_err(err, "%s: truncated .npy header (file of %zu bytes)", f->path, f->map_bytes);
    size_t header_len = token_le(f->base + 8, major == 1 ? 2 : 4);
    if (header_len > f->map_bytes - prefix)
        return moe_err(err,
                       "%s: truncated .npy header: it claims %zu bytes but the file has %zu in all",
                       f->path, header_len, f->map_bytes);
    NpyDict d;
    const char *text = (const char *)f->base + prefix, *nul = memchr(text, 0, header_len);
    if (nul)
        return moe_err(err, "%s: malformed .npy header: a NUL byte at header offset %zu (a damaged file?)",
                       f->path, (size_t)(nul - text));
    const char *why = npy_parse_dict(text, header_len, &d);
    if (why)
        return moe_err(err, "%s: malformed .npy header: %s (header: %.*s)", f->path, why,
                       (int)(header_len < 120 ? header_len : 120), text);
    if (npy_check_dict(f, &d, err)) return -1;
    f->token_bytes = d.descr[2] - '0';
    f->data_offset = prefix + header_len;
    size_t data_bytes = f->map_bytes - f->data_offset;
    if (d.dims[0] != data_bytes / (size_t)f->token_bytes || data_bytes % (size_t)f->token_bytes) {
        char want[32], have[32];
        return moe_err(err,
                       "%s: .npy header says %s tokens but %s bytes follow the header "
                       "(a truncated or damaged copy?)",
                       f->path, moe_fmt_count(want, sizeof want, d.dims[0]),
                       moe_fmt_count(have, sizeof have, data_bytes));
    }
    f->n_tokens = (size_t)d.dims[0];
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Token files

static int token_file_map(TokenFile *f, const char *path, MoeErr err) {
    int fd = fs_open_regular(path, "token file", err);
    if (fd < 0) return -1;
    struct stat st;
    int rc = 0;
    if (fstat(fd, &st) != 0)
        rc = moe_err(err, "%s: cannot stat token file: %s", path, strerror(errno));
    else if (st.st_size == 0)
        rc = moe_err(err, "%s: empty token file; regenerate it or drop it from the list", path);
    if (rc == 0) {
        void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED)
            rc = moe_err(err, "%s: cannot map token file: %s", path, strerror(errno));
        else f->base = p, f->map_bytes = (size_t)st.st_size;
    }
    close(fd);
    return rc;
}

static int token_file_headerless(TokenFile *f, int token_bytes, MoeErr err) {
    f->token_bytes = token_bytes;
    f->data_offset = 0;
    if (f->map_bytes % (size_t)token_bytes) {
        char bytes[32];
        return moe_err(err, "%s: %s bytes is not a whole number of %s tokens (%d bytes each)",
                       f->path, moe_fmt_count(bytes, sizeof bytes, f->map_bytes),
                       token_type_name(token_bytes), token_bytes);
    }
    f->n_tokens = f->map_bytes / (size_t)token_bytes;
    return 0;
}

int token_file_open(TokenFile *f, const char *path, int token_bytes, size_t vocab_size,
                    MoeErr err) {
    memset(f, 0, sizeof *f);
    if (token_bytes != 0 && token_bytes != 2 && token_bytes != 4)
        return moe_err(err, "%s: token_bytes must be 0 (choose from vocab_size), 2 or 4, not %d",
                       path, token_bytes);
    if (token_file_map(f, path, err)) return -1;
    f->path = moe_strdup(path);
    int rc;
    if (f->map_bytes >= NPY_MAGIC_LEN && memcmp(f->base, NPY_MAGIC, NPY_MAGIC_LEN) == 0)
        rc = npy_read_header(f, err);
    else
        rc = token_file_headerless(f, token_bytes ? token_bytes : vocab_size <= 65536 ? 2 : 4, err);
    if (rc) token_file_close(f);
    return rc;
}

void token_file_unmap(TokenFile *f) {
    if (f->base) munmap((void *)f->base, f->map_bytes);
    f->base = NULL;
}

// Maps a file opened before and unmapped since, which must not have changed size meanwhile.
static int token_file_remap(TokenFile *f, MoeErr err) {
    size_t bytes = f->map_bytes;
    if (token_file_map(f, f->path, err)) return -1;
    if (f->map_bytes == bytes) return 0;
    token_file_unmap(f);
    return moe_err(err, "%s: the token file changed size while in use (%zu bytes, %zu when it was "
                   "opened); data must not change during a run", f->path, f->map_bytes, bytes);
}

void token_file_close(TokenFile *f) {
    token_file_unmap(f);
    free(f->path);
    memset(f, 0, sizeof *f);
}

uint32_t token_file_get(const TokenFile *f, size_t i) {
    return token_le(f->base + f->data_offset + i * (size_t)f->token_bytes, f->token_bytes);
}

// ---------------------------------------------------------------------------------------------
// Dataset: the list of files

static bool dataset_ends_with(const char *path, const char *ext) {
    size_t n = strlen(path), e = strlen(ext);
    return n >= e && !strcmp(path + n - e, ext);
}

static bool dataset_is_mix(const char *path) {
    return dataset_ends_with(path, ".txt") || dataset_ends_with(path, ".mix") ||
           dataset_ends_with(path, ".list");
}

static int dataset_add_file(Dataset *ds, size_t *cap, const char *path, int token_bytes,
                            MoeErr err) {
    if (ds->n_files == *cap) {
        *cap = *cap ? 2 * *cap : 4;
        ds->files = moe_realloc(ds->files, *cap * sizeof *ds->files);
    }
    if (token_file_open(&ds->files[ds->n_files], path, token_bytes, ds->vocab_size, err)) return -1;
    token_file_unmap(&ds->files[ds->n_files++]); // mapped again when read (dataset_map)
    return 0;
}

// Strips the comment and surrounding whitespace of a data-list line in place.
static char *dataset_mix_entry(char *line) {
    char *hash = strchr(line, '#');
    if (hash) *hash = 0;
    while (*line == ' ' || *line == '\t') line++;
    size_t n = strlen(line);
    while (n && (line[n - 1] == ' ' || line[n - 1] == '\t' || line[n - 1] == '\n' ||
                 line[n - 1] == '\r'))
        line[--n] = 0;
    return line;
}

// Relative entries are relative to the list's folder so that a list travels with its data.
static char *dataset_resolve(const char *mix_path, const char *entry) {
    const char *slash = strrchr(mix_path, '/');
    if (entry[0] == '/' || !slash) return moe_strdup(entry);
    size_t dir_len = (size_t)(slash - mix_path) + 1, n = strlen(entry) + 1;
    char *path = moe_malloc(dir_len + n);
    memcpy(path, mix_path, dir_len);
    memcpy(path + dir_len, entry, n);
    return path;
}

static int dataset_add_mix_entry(Dataset *ds, size_t *cap, const char *mix_path, size_t line_no,
                                 const char *path, bool first, int token_bytes, MoeErr err) {
    struct stat st;
    const char *why = NULL;
    if (stat(path, &st) != 0) why = strerror(errno);
    else if (!S_ISREG(st.st_mode)) why = "not a regular file";
    if (why) {
        // A .txt whose first line is no file is most likely raw text given where tokens belong.
        char hint[MOE_ERR_LEN / 2] = "";
        if (first && dataset_ends_with(mix_path, ".txt"))
            snprintf(hint, sizeof hint,
                     "; if %s is raw text rather than a list of token files, "
                     "run `moe data prepare %s OUT.npy` first to train on it",
                     mix_path, mix_path);
        return moe_err(err, "%s:%zu: '%.200s' is not a token file (%s)%s", mix_path, line_no, path,
                       why, hint);
    }
    if (dataset_is_mix(path))
        return moe_err(err,
                       "%s:%zu: '%s' is itself a data list; nested lists are not supported, "
                       "list its token files directly",
                       mix_path, line_no, path);
    MoeErr inner;
    if (dataset_add_file(ds, cap, path, token_bytes, inner))
        return moe_err(err, "%s:%zu: %s", mix_path, line_no, inner);
    return 0;
}

// A data-list line as text: NULL with a message when it holds a NUL byte (C strings would cut the
// path there); the UTF-8 byte-order mark some editors write at the start of a file is skipped.
static char *dataset_list_text(char *line, size_t len, const char *mix_path, size_t line_no, MoeErr err) {
    if (memchr(line, 0, len)) {
        moe_err(err, "%s:%zu: the line holds a NUL byte; a data list is text, one path per line", mix_path,
                line_no);
        return NULL;
    }
    return line_no == 1 && !strncmp(line, "\xEF\xBB\xBF", 3) ? line + 3 : line;
}

static int dataset_add_mix(Dataset *ds, size_t *cap, const char *mix_path, int token_bytes,
                           MoeErr err) {
    FILE *fp = fs_fopen_regular(mix_path, "data list", err);
    if (!fp) return -1;
    char *line = NULL;
    size_t line_cap = 0, line_no = 0, n_entries = 0;
    ssize_t len;
    int rc = 0;
    while (rc == 0 && (len = getline(&line, &line_cap, fp)) != -1) {
        char *text = dataset_list_text(line, (size_t)len, mix_path, ++line_no, err);
        if (!text) {
            rc = -1;
            break;
        }
        char *entry = dataset_mix_entry(text);
        if (!*entry) continue;
        char *path = dataset_resolve(mix_path, entry);
        rc = dataset_add_mix_entry(ds, cap, mix_path, line_no, path, n_entries++ == 0, token_bytes,
                                   err);
        free(path);
    }
    if (rc == 0 && ferror(fp))
        rc = moe_err(err, "%s: cannot read data list: %s", mix_path, strerror(errno));
    if (rc == 0 && n_entries == 0)
        rc = moe_err(err,
                     "%s: data list names no token files; list one per line ('#' starts a comment)",
                     mix_path);
    free(line);
    fclose(fp);
    return rc;
}

static int dataset_add_spec(Dataset *ds, const char *spec, int token_bytes, MoeErr err) {
    char *copy = moe_strdup(spec);
    size_t cap = 0;
    int rc = 0;
    for (char *item = copy, *next; rc == 0 && item; item = next) {
        next = strchr(item, ',');
        if (next) *next++ = 0;
        item = dataset_mix_entry(item); // trims the spaces people put after commas
        if (!*item)
            rc = moe_err(
                err, "data list '%s' has an empty entry; separate paths with single commas", spec);
        else if (dataset_is_mix(item)) rc = dataset_add_mix(ds, &cap, item, token_bytes, err);
        else rc = dataset_add_file(ds, &cap, item, token_bytes, err);
    }
    free(copy);
    return rc;
}

// ---------------------------------------------------------------------------------------------
// Dataset: sequences

static int dataset_err_too_short(const Dataset *ds, MoeErr err) {
    char n[32];
    size_t need = ds->seq_len + 1;
    if (ds->n_files == 1)
        return moe_err(err,
                       "%s: %s tokens is fewer than seq_len + 1 = %zu; lower train.seq_len or use "
                       "more data",
                       ds->files[0].path, moe_fmt_count(n, sizeof n, ds->files[0].n_tokens), need);
    char list[320];
    size_t o = 0, shown = ds->n_files < 4 ? ds->n_files : 4;
    list[0] = 0;
    for (size_t i = 0; i < shown && o < sizeof list; i++)
        o += (size_t)snprintf(list + o, sizeof list - o, "%s%.60s: %s", i ? ", " : "",
                              ds->files[i].path, moe_fmt_count(n, sizeof n, ds->files[i].n_tokens));
    if (shown < ds->n_files && o < sizeof list)
        snprintf(list + o, sizeof list - o, ", and %zu more", ds->n_files - shown);
    return moe_err(err,
                   "no token file holds seq_len + 1 = %zu tokens (%s); lower train.seq_len or use "
                   "more data",
                   need, list);
}

#define DATASET_FEISTEL_ROUNDS 6

// A keyed bijection of [0, 4^h): a balanced Feistel network on the two h-bit halves of x.
static uint64_t dataset_feistel(uint64_t x, unsigned h, uint64_t key) {
    uint64_t mask = h ? (uint64_t)-1 >> (64 - h) : 0, left = h ? x >> h : 0, right = x & mask;
    for (uint64_t r = 0; r < DATASET_FEISTEL_ROUNDS; r++) {
        uint64_t next = left ^ (rng_hash64(key + r, right) & mask);
        left = right, right = next;
    }
    return left << h | right;
}

// The Feistel network over the smallest 4^h >= n, applied again until the value falls inside
// [0, n) (cycle-walking: the walk from a point of [0, n) returns to [0, n) on its own cycle, so this
// is a bijection of [0, n); 4^h < 4n, so it takes fewer than 4 steps on average). Keyed by (seed,
// epoch) alone: any rank rebuilds any epoch's order, after a restart too, without storing it.
uint64_t dataset_permute(uint64_t seed, uint64_t epoch, uint64_t n, uint64_t k) {
    unsigned bits = 0;
    while (bits < 64 && (n - 1) >> bits) bits++;
    unsigned h = (bits + 1) / 2;
    uint64_t key = rng_hash64(seed, epoch), x = k;
    do x = dataset_feistel(x, h, key);
    while (x >= n);
    return x;
}

int dataset_open(Dataset *ds, const char *spec, size_t seq_len, size_t vocab_size, int token_bytes,
                 uint64_t seed, bool shuffle, MoeErr err) {
    memset(ds, 0, sizeof *ds);
    if (seq_len == 0) return moe_err(err, "seq_len must be at least 1");
    if (vocab_size == 0 || vocab_size > (size_t)INT32_MAX + 1)
        return moe_err(err, "vocab_size %zu is out of range (1 to 2^31, so that ids fit in int32)",
                       vocab_size);
    ds->seq_len = seq_len, ds->vocab_size = vocab_size, ds->seed = seed, ds->shuffle = shuffle;
    if (dataset_add_spec(ds, spec, token_bytes, err)) {
        dataset_close(ds);
        return -1;
    }
    ds->first_seq = moe_malloc((ds->n_files + 1) * sizeof *ds->first_seq);
    ds->first_seq[0] = 0;
    for (size_t f = 0; f < ds->n_files; f++) {
        size_t n = ds->files[f].n_tokens;
        ds->first_seq[f + 1] = ds->first_seq[f] + (n ? (n - 1) / seq_len : 0);
    }
    ds->n_seqs = ds->first_seq[ds->n_files];
    if (ds->n_seqs == 0) {
        dataset_err_too_short(ds, err);
        dataset_close(ds);
        return -1;
    }
    return 0;
}

void dataset_close(Dataset *ds) {
    for (size_t f = 0; f < ds->n_files; f++) token_file_close(&ds->files[f]);
    free(ds->files);
    free(ds->first_seq);
    memset(ds, 0, sizeof *ds);
}

// The file holding global sequence k: the last f with first_seq[f] <= k (files that give no
// sequence share their successor's first_seq and are skipped by taking the last).
static size_t dataset_file_of(const Dataset *ds, size_t k) {
    size_t lo = 0, hi = ds->n_files; // answer in [lo, hi)
    while (hi - lo > 1) {
        size_t mid = lo + (hi - lo) / 2;
        if (ds->first_seq[mid] <= k) lo = mid;
        else hi = mid;
    }
    return lo;
}

// Maps file f for reading. At most DATASET_MAX_MAPS files stay mapped, the least recently read
// unmapped first: a list of many files must not exhaust the process's mappings (vm.max_map_count,
// 65530 by default) nor its address space.
static int dataset_map(Dataset *ds, size_t f, MoeErr err) {
    TokenFile *tf = &ds->files[f];
    tf->last_read = ++ds->clock;
    if (tf->base) return 0;
    size_t slot = ds->n_mapped;
    if (slot == DATASET_MAX_MAPS) {
        slot = 0;
        for (size_t i = 1; i < DATASET_MAX_MAPS; i++)
            if (ds->files[ds->mapped[i]].last_read < ds->files[ds->mapped[slot]].last_read) slot = i;
        token_file_unmap(&ds->files[ds->mapped[slot]]);
    } else {
        ds->n_mapped++;
    }
    ds->mapped[slot] = f;
    return token_file_remap(tf, err);
}

int dataset_read(Dataset *ds, uint64_t index, int32_t *out, MoeErr err) {
    uint64_t epoch = index / ds->n_seqs;
    size_t k = (size_t)(index % ds->n_seqs);
    if (ds->shuffle) k = (size_t)dataset_permute(ds->seed, epoch, ds->n_seqs, k);
    size_t f = dataset_file_of(ds, k);
    if (dataset_map(ds, f, err)) return -1;
    const TokenFile *tf = &ds->files[f];
    size_t start = (k - ds->first_seq[f]) * ds->seq_len;
    for (size_t i = 0; i <= ds->seq_len; i++) {
        uint32_t id = token_file_get(tf, start + i);
        if (id >= ds->vocab_size) {
            char pos[32];
            return moe_err(err,
                           "%s: token %u at position %s is >= vocab_size %zu (wrong tokenizer or "
                           "model.vocab_size?)",
                           tf->path, id, moe_fmt_count(pos, sizeof pos, start + i), ds->vocab_size);
        }
        out[i] = (int32_t)id;
    }
    return 0;
}
