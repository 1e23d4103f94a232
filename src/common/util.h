// Small helpers every layer uses: fatal errors with a hint, checked allocation, timing, and
// "did you mean" suggestions for mistyped names. Random numbers live in rng.h.
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/rng.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MOE_ERR_LEN 512
typedef char MoeErr[MOE_ERR_LEN]; // filled by functions that report bad input instead of exiting

// Prints "error: <message>" and ends the process (all ranks, once a fatal hook is installed).
void moe_fatal(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
// Called by moe_fatal before exiting; the distributed layer installs one that aborts every rank.
void moe_set_fatal_hook(void (*hook)(void));
// Makes moe_fatal name this process ("error: [rank 3] ..."); the distributed layer sets it when
// several ranks run, so that the one failing message among many ranks' output says which failed.
void moe_set_rank_label(int rank);
// Formats into an MoeErr; returns -1 so that `return moe_err(err, ...)` reads naturally.
int moe_err(MoeErr err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define MOE_CHECK(cond, ...)                                                                     \
    do {                                                                                         \
        if (!(cond)) moe_fatal(__VA_ARGS__);                                                     \
    } while (0)

// Internal invariants (a bug in moe.c, not bad input): file and line help the report.
#define MOE_ASSERT(cond)                                                                         \
    do {                                                                                         \
        if (!(cond)) moe_fatal("%s:%d: internal check failed: %s", __FILE__, __LINE__, #cond);   \
    } while (0)

void *moe_malloc(size_t bytes);
void *moe_calloc(size_t count, size_t size);
void *moe_realloc(void *p, size_t bytes);
char *moe_strdup(const char *s);

double moe_time_sec(void); // monotonic wall clock
double moe_process_seconds(void); // wall-clock seconds since the program was loaded

// Bytes of host memory this process can still take: MemAvailable of /proc/meminfo, lowered to the
// room left under a cgroup memory limit (a container's); 0 when not known.
size_t moe_host_memory_available(void);
size_t moe_process_peak_memory(void); // the process's peak resident memory (0 when unknown)
// Online CPU cores (at least 1).
int moe_cpu_cores(void);

// Environment variable `name` as an integer from min to max (fallback where it is unset); any other
// value is fatal, naming the variable and the range (the experiment and test knobs MOE_COMM_CHUNK
// and MOE_GROUPED_*).
long moe_env_int(const char *name, long fallback, long min, long max);

// Mixes a name into an RNG key (e.g. a tensor name for its initial values).
uint64_t rng_hash_str(uint64_t seed, const char *s);

// The candidate closest to `name` by edit distance, or NULL if none is close enough to suggest.
const char *moe_suggest(const char *name, const char *const *candidates, size_t n);

// Index of the first NaN or infinity of x (n), or n when every value is finite.
size_t moe_first_non_finite(const float *x, size_t n);

// Thousands separators for user-facing numbers ("1,115,394"); returns buf.
char *moe_fmt_count(char *buf, size_t len, uint64_t n);
// A duration for people: "42s", "3m05s", "2h07m", "3d04h" ("?" when not finite or negative);
// returns buf.
char *moe_fmt_duration(char *buf, size_t len, double seconds);

// Size arithmetic: the smaller and larger of two sizes, x / m rounded up, x up to a multiple of m.
static inline size_t size_min(size_t a, size_t b) { return a < b ? a : b; }
static inline size_t size_max(size_t a, size_t b) { return a > b ? a : b; }
static inline size_t size_ceil_div(size_t x, size_t m) { return (x + m - 1) / m; }
static inline size_t size_round_up(size_t x, size_t m) { return size_ceil_div(x, m) * m; }

#ifdef __cplusplus
}
#endif
