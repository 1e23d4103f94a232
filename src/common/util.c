// Implementation of the shared helpers declared in util.h.
#include "util.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static void (*fatal_hook)(void);
static int fatal_rank = -1; // < 0: a single process, no label

void moe_set_fatal_hook(void (*hook)(void)) { fatal_hook = hook; }

void moe_set_rank_label(int rank) { fatal_rank = rank; }

void moe_fatal(const char *fmt, ...) {
    char msg[4096], rank[32] = "";
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fflush(stdout);
    if (fatal_rank >= 0) snprintf(rank, sizeof rank, "[rank %d] ", fatal_rank);
    // one write: unbuffered stderr would otherwise go out in pieces, which a launcher collecting
    // several ranks' output (mpirun) may interleave with other lines
    fprintf(stderr, "error: %s%s\n", rank, msg);
    fflush(stderr);
    if (fatal_hook) fatal_hook();
    exit(1);
}

int moe_err(MoeErr err, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, MOE_ERR_LEN, fmt, ap);
    va_end(ap);
    return -1;
}

void *moe_malloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    MOE_CHECK(p, "out of host memory allocating %zu bytes", bytes);
    return p;
}

void *moe_calloc(size_t count, size_t size) {
    void *p = calloc(count ? count : 1, size ? size : 1);
    MOE_CHECK(p, "out of host memory allocating %zu x %zu bytes", count, size);
    return p;
}

void *moe_realloc(void *p, size_t bytes) {
    void *q = realloc(p, bytes ? bytes : 1);
    MOE_CHECK(q, "out of host memory growing a buffer to %zu bytes", bytes);
    return q;
}

char *moe_strdup(const char *s) {
    size_t n = strlen(s) + 1;
    return memcpy(moe_malloc(n), s, n);
}

double moe_time_sec(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double process_start;
__attribute__((constructor)) static void note_process_start(void) { process_start = moe_time_sec(); }
double moe_process_seconds(void) { return moe_time_sec() - process_start; }

// The number in a file of one number (cgroup files), or `absent` when it is missing or not a number
// ("max": no limit).
static double read_number(const char *path, double absent) {
    FILE *f = fopen(path, "r");
    double v;
    bool ok = f && fscanf(f, "%lf", &v) == 1;
    if (f) fclose(f);
    return ok ? v : absent;
}

// A line such as "MemAvailable:  20092208 kB" of a /proc file, in bytes, matched by `format` (e.g.
// "MemAvailable: %lf kB"); 0 when not found.
static double proc_kb(const char *path, const char *format) {
    FILE *f = fopen(path, "r");
    char line[256];
    double kb = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, format, &kb) == 1) break;
    if (f) fclose(f);
    return kb * 1024;
}

size_t moe_process_peak_memory(void) { return (size_t)proc_kb("/proc/self/status", "VmHWM: %lf kB"); }

size_t moe_host_memory_available(void) {
    double avail = proc_kb("/proc/meminfo", "MemAvailable: %lf kB");
    if (avail <= 0) avail = (double)sysconf(_SC_AVPHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
    const char *limits[2][2] = {{"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"},
                                {"/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                 "/sys/fs/cgroup/memory/memory.usage_in_bytes"}};
    for (int i = 0; i < 2; i++) {
        double limit = read_number(limits[i][0], INFINITY), used = read_number(limits[i][1], 0);
        if (limit < 1e18 && limit - used < avail) avail = limit > used ? limit - used : 0;
    }
    return avail > 0 ? (size_t)avail : 0;
}

int moe_cpu_cores(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

long moe_env_int(const char *name, long fallback, long min, long max) {
    const char *v = getenv(name);
    if (!v) return fallback;
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    MOE_CHECK(*v && !*end && !errno && x >= min && x <= max, "%s = '%s' must be an integer from %ld to %ld", name, v,
              min, max);
    return x;
}

uint64_t rng_hash_str(uint64_t seed, const char *s) {
    uint64_t h = 0xcbf29ce484222325ULL; // FNV-1a, then mixed with the seed
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 0x100000001b3ULL;
    return rng_hash64(seed, h);
}

static size_t edit_distance(const char *a, const char *b) {
    size_t la = strlen(a), lb = strlen(b);
    size_t *row = moe_malloc((lb + 1) * sizeof(size_t));
    for (size_t j = 0; j <= lb; j++) row[j] = j;
    for (size_t i = 1; i <= la; i++) {
        size_t diag = row[0];
        row[0] = i;
        for (size_t j = 1; j <= lb; j++) {
            size_t up = row[j];
            size_t best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best) best = up + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    size_t d = row[lb];
    free(row);
    return d;
}

// The edit distance is at least the difference in length: candidates that differ in length by
// more than the limit are skipped (a long mistyped name costs no quadratic work).
const char *moe_suggest(const char *name, const char *const *candidates, size_t n) {
    const char *best = NULL;
    size_t best_d = (size_t)-1, len = strlen(name);
    size_t limit = len < 6 ? 2 : len / 3;
    for (size_t i = 0; i < n; i++) {
        size_t clen = strlen(candidates[i]);
        if ((clen > len ? clen - len : len - clen) > limit) continue;
        size_t d = edit_distance(name, candidates[i]);
        if (d < best_d) best_d = d, best = candidates[i];
    }
    return best_d <= limit ? best : NULL;
}

char *moe_fmt_count(char *buf, size_t len, uint64_t n) {
    char digits[32];
    int nd = snprintf(digits, sizeof digits, "%llu", (unsigned long long)n);
    size_t o = 0;
    for (int i = 0; i < nd && o + 1 < len; i++) {
        if (i > 0 && (nd - i) % 3 == 0 && o + 2 < len) buf[o++] = ',';
        buf[o++] = digits[i];
    }
    buf[o] = 0;
    return buf;
}

char *moe_fmt_duration(char *buf, size_t len, double seconds) {
    static const struct {
        unsigned long long unit, sub;
        const char *name, *sub_name;
    } UNITS[] = {{86400, 3600, "d", "h"}, {3600, 60, "h", "m"}, {60, 1, "m", "s"}};
    if (!(seconds >= 0 && seconds < 1e15)) {
        snprintf(buf, len, "?");
        return buf;
    }
    unsigned long long s = (unsigned long long)(seconds + 0.5);
    snprintf(buf, len, "%llus", s);
    for (size_t i = 0; i < sizeof UNITS / sizeof UNITS[0]; i++) {
        if (s < UNITS[i].unit) continue;
        snprintf(buf, len, "%llu%s%02llu%s", s / UNITS[i].unit, UNITS[i].name, s % UNITS[i].unit / UNITS[i].sub,
                 UNITS[i].sub_name);
        break;
    }
    return buf;
}

size_t moe_first_non_finite(const float *x, size_t n) {
    size_t i = 0;
    while (i < n && isfinite(x[i])) i++;
    return i;
}
