// The watchdog thread (see watchdog.h). It sleeps on a condition variable between checks, so
// watchdog_stop returns at once; when it fires it writes its message and ends the process with
// _exit (no atexit handlers: the main thread may be blocked inside MPI, NCCL or the CUDA driver).
#include "watchdog.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "common/util.h"

#define WATCHDOG_MAX_COMMS 8

struct Watchdog {
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t wake;
    bool stopping;
    double timeout_s, last_beat; // CLOCK_MONOTONIC seconds
    int rank, n_watched;
    int64_t step;
    const char *phase;
    Comm *watched[WATCHDOG_MAX_COMMS];
};

static double monotonic_sec(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void watchdog_fire(const Watchdog *w, const char *why) {
    fflush(stdout);
    fprintf(stderr, "error: [rank %d] %s at step %" PRId64 " (%s); a peer rank has probably died or hangs "
            "in a collective, so this rank ends to stop the job (train.comm_timeout = %g s sets the "
            "limit; 0 turns the watchdog off)\n", w->rank, why, w->step, w->phase, w->timeout_s);
    fflush(stderr);
    _exit(1);
}

// The first asynchronous error among the watched communicators, or NULL.
static const char *watched_error(const Watchdog *w) {
    for (int i = 0; i < w->n_watched; i++) {
        Comm *c = w->watched[i];
        const char *e = c->ops->async_error ? c->ops->async_error(c) : NULL;
        if (e) return e;
    }
    return NULL;
}

static void *watchdog_main(void *arg) {
    Watchdog *w = arg;
    double poll = w->timeout_s < 4 ? w->timeout_s / 4 : 1.0;
    pthread_mutex_lock(&w->lock);
    while (!w->stopping) {
        double wake_at = monotonic_sec() + poll;
        struct timespec ts = {(time_t)wake_at, (long)((wake_at - (double)(time_t)wake_at) * 1e9)};
        pthread_cond_timedwait(&w->wake, &w->lock, &ts);
        if (w->stopping) break;
        char why[256];
        const char *e = watched_error(w);
        double idle = monotonic_sec() - w->last_beat;
        if (e) snprintf(why, sizeof why, "the communicator reported an error (%s)", e);
        else if (idle > w->timeout_s) snprintf(why, sizeof why, "no progress for %.0f s", idle);
        else continue;
        watchdog_fire(w, why);
    }
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

Watchdog *watchdog_start(double timeout_s, int rank, Comm *const *watched, int n) {
    if (!(timeout_s > 0)) return NULL;
    MOE_CHECK(n <= WATCHDOG_MAX_COMMS, "watchdog: %d communicators (at most %d)", n, WATCHDOG_MAX_COMMS);
    Watchdog *w = moe_calloc(1, sizeof *w);
    w->timeout_s = timeout_s, w->rank = rank, w->n_watched = n, w->phase = "start";
    for (int i = 0; i < n; i++) w->watched[i] = watched[i];
    w->last_beat = monotonic_sec();
    pthread_mutex_init(&w->lock, NULL);
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&w->wake, &attr);
    pthread_condattr_destroy(&attr);
    MOE_CHECK(pthread_create(&w->thread, NULL, watchdog_main, w) == 0, "watchdog: cannot start its thread");
    return w;
}

void watchdog_beat(Watchdog *w, int64_t step, const char *phase) {
    if (!w) return;
    pthread_mutex_lock(&w->lock);
    w->last_beat = monotonic_sec(), w->step = step, w->phase = phase;
    pthread_mutex_unlock(&w->lock);
}

void watchdog_closing(Watchdog *w, int64_t step) {
    if (!w) return;
    pthread_mutex_lock(&w->lock);
    w->n_watched = 0;
    w->last_beat = monotonic_sec(), w->step = step, w->phase = "closing the run";
    pthread_mutex_unlock(&w->lock);
}

void watchdog_stop(Watchdog *w) {
    if (!w) return;
    pthread_mutex_lock(&w->lock);
    w->stopping = true;
    pthread_cond_signal(&w->wake);
    pthread_mutex_unlock(&w->lock);
    pthread_join(w->thread, NULL);
    pthread_cond_destroy(&w->wake);
    pthread_mutex_destroy(&w->lock);
    free(w);
}
