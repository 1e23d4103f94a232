// Clock and power readings of a backend's device taken on a thread of their own while work runs
// (Ops.device_clocks), summarised for the benchmarks and each training step's report: a GPU held at
// its power limit lowers its clock, so the same kernel runs slower inside a training step than
// timed alone.
#pragma once
#include <stdbool.h>
#include <stddef.h>

#include "ops/ops.h"

typedef struct {
    bool queried;                 // the backend has the query (Ops.device_clocks)
    size_t samples;               // readings taken (0: none; the device's clocks could not be read)
    double sm_mhz_median, sm_mhz_min;
    double sm_max_mhz;            // the highest clock the device can run at
    double power_w_mean;          // the energy counter's increase over the readings' span (a second or
                                  // more), else the mean of their draws (each a one-second average)
    double power_limit_w;
    double power_capped_share;    // of the readings: the clock held back by the power limit
    double thermal_share;         // ... by temperature
} ClockSummary;

// The summary of n readings (n 0: all zero), queried set.
void clock_summary_of(const DeviceClocks *s, size_t n, ClockSummary *out);

typedef struct DeviceMonitor DeviceMonitor;

// Starts reading o's device clocks every period_ms; NULL when the backend has no such query.
DeviceMonitor *device_monitor_start(const Ops *o, double period_ms);
// Summarises the readings taken since the start or the last take and drops them; the readings go
// on (m NULL: all zero).
void device_monitor_take(DeviceMonitor *m, ClockSummary *out);
// Stops the readings and summarises those not taken yet into out (m NULL: all zero; out NULL: not
// summarised); frees m.
void device_monitor_stop(DeviceMonitor *m, ClockSummary *out);

// One report line, "clocks       <what>: ...", "not read" when the summary has no readings, nothing
// when the backend has no such query.
void clock_summary_print(const char *what, const ClockSummary *s);
