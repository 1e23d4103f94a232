// Clock and power readings on a thread of their own while a benchmark's work runs, and their
// summary (device_monitor.h).
#include "ops/device_monitor.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/util.h"

#define MONITOR_MAX_SAMPLES 65536 // ~11 minutes at 10 ms between takes; readings past it are not kept
#define MONITOR_COUNTER_SPAN_S 1.0 // the shortest span whose mean power comes from the energy counter

struct DeviceMonitor {
    const Ops *o;
    double period_ms;
    atomic_bool stop;
    pthread_t thread;
    pthread_mutex_t lock;  // samples and n: the thread appends, device_monitor_take reads and drops
    DeviceClocks *samples; // (MONITOR_MAX_SAMPLES)
    size_t n;
};

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

void clock_summary_of(const DeviceClocks *s, size_t n, ClockSummary *out) {
    memset(out, 0, sizeof *out);
    out->queried = true;
    if (n == 0) return;
    double *mhz = moe_malloc(n * sizeof *mhz), watts = 0;
    size_t capped = 0, thermal = 0;
    for (size_t i = 0; i < n; i++) {
        mhz[i] = s[i].sm_mhz, watts += s[i].power_w, capped += s[i].power_capped, thermal += s[i].thermal;
        if (s[i].sm_max_mhz > out->sm_max_mhz) out->sm_max_mhz = s[i].sm_max_mhz;
        if (s[i].power_limit_w > out->power_limit_w) out->power_limit_w = s[i].power_limit_w;
    }
    qsort(mhz, n, sizeof *mhz, cmp_double);
    double span = s[n - 1].t_s - s[0].t_s, used = s[n - 1].energy_j - s[0].energy_j;
    // the counter moves in coarse steps: over a step of ~0.2 s it read 454-1036 W at a 700 W limit
    bool counted = s[0].energy_j >= 0 && s[n - 1].energy_j >= 0 && span >= MONITOR_COUNTER_SPAN_S && used >= 0;
    out->samples = n, out->power_w_mean = counted ? used / span : watts / (double)n;
    out->power_capped_share = (double)capped / (double)n, out->thermal_share = (double)thermal / (double)n;
    out->sm_mhz_min = mhz[0];
    out->sm_mhz_median = n % 2 ? mhz[n / 2] : (mhz[n / 2 - 1] + mhz[n / 2]) / 2;
    free(mhz);
}

static void *monitor_loop(void *arg) {
    DeviceMonitor *m = arg;
    struct timespec pause = {.tv_sec = (time_t)(m->period_ms / 1e3),
                             .tv_nsec = (long)(m->period_ms * 1e6) % 1000000000L};
    while (!atomic_load(&m->stop)) {
        DeviceClocks c;
        bool read = m->o->device_clocks(&c);
        pthread_mutex_lock(&m->lock);
        if (read && m->n < MONITOR_MAX_SAMPLES) m->samples[m->n++] = c;
        pthread_mutex_unlock(&m->lock);
        nanosleep(&pause, NULL);
    }
    return NULL;
}

DeviceMonitor *device_monitor_start(const Ops *o, double period_ms) {
    if (!o->device_clocks) return NULL;
    DeviceMonitor *m = moe_calloc(1, sizeof *m);
    m->o = o, m->period_ms = period_ms;
    m->samples = moe_malloc(MONITOR_MAX_SAMPLES * sizeof *m->samples);
    atomic_init(&m->stop, false);
    pthread_mutex_init(&m->lock, NULL);
    if (pthread_create(&m->thread, NULL, monitor_loop, m)) moe_fatal("device monitor: cannot start a thread");
    return m;
}

void device_monitor_take(DeviceMonitor *m, ClockSummary *out) {
    memset(out, 0, sizeof *out);
    if (!m) return;
    pthread_mutex_lock(&m->lock);
    clock_summary_of(m->samples, m->n, out);
    m->n = 0;
    pthread_mutex_unlock(&m->lock);
}

void device_monitor_stop(DeviceMonitor *m, ClockSummary *out) {
    if (out) memset(out, 0, sizeof *out);
    if (!m) return;
    atomic_store(&m->stop, true);
    pthread_join(m->thread, NULL);
    if (out) device_monitor_take(m, out);
    pthread_mutex_destroy(&m->lock);
    free(m->samples);
    free(m);
}

void clock_summary_print(const char *what, const ClockSummary *s) {
    if (!s->queried) return;
    if (!s->samples) {
        printf("clocks       %s: not read (the device reports no clocks)\n", what);
        return;
    }
    printf("clocks       %s: SM clock median %.0f MHz (lowest %.0f, highest possible %.0f), power %.0f W on "
           "average of a %.0f W limit; held back by the power limit in %.0f%% of %zu readings, by temperature in "
           "%.0f%%\n", what, s->sm_mhz_median, s->sm_mhz_min, s->sm_max_mhz, s->power_w_mean, s->power_limit_w,
           100 * s->power_capped_share, s->samples, 100 * s->thermal_share);
}
