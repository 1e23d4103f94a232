// A watchdog for runs of several ranks. The training loop reports progress (watchdog_beat); a
// thread ends this rank, with a message that says where it stood, when no progress comes for
// `timeout_s` seconds or when a communicator reports an asynchronous error (NCCL: a failed network
// peer). A rank waiting in a collective for a dead or stuck peer would otherwise wait forever;
// ending it lets mpirun or `moe train --nproc` stop the whole job.
#pragma once
#include <stdint.h>

#include "comm.h"

typedef struct Watchdog Watchdog;

// Starts the thread for this rank (label in messages); the n communicators in `watched` are polled
// for asynchronous errors (they must outlive the watchdog). timeout_s <= 0: nothing is started and
// NULL is returned (every function accepts NULL).
Watchdog *watchdog_start(double timeout_s, int rank, Comm *const *watched, int n);
// Progress: this rank is now at `step`, doing `phase` (a string literal such as "checkpoint").
void watchdog_beat(Watchdog *w, int64_t step, const char *phase);
// The run is closing: the communicators stop being polled (they are about to be freed); the
// timeout still covers the teardown (a peer that never reaches it).
void watchdog_closing(Watchdog *w, int64_t step);
void watchdog_stop(Watchdog *w);
