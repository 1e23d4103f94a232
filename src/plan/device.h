// Datasheet facts of the accelerators `moe plan` can plan for, in one table: memory, peak dense
// bf16 rate, HBM bandwidth and the links (NVLink within a node, the network between nodes). A
// calibration measured on one of them is carried to another by the ratios of these numbers.
#pragma once
#include <stddef.h>

typedef struct {
    const char *name;      // "h200"; "cpu" is this host's CPU ranks
    double memory_gib;     // per device, as the driver reports its total
    double bf16_tflops;    // dense bf16 peak (datasheet)
    double hbm_gbps;       // memory bandwidth (datasheet)
    double nvlink_gbps;    // NVLink per device, per direction (datasheet)
    double nic_gbps;       // network per device, per direction (one 400 Gb/s NIC per GPU)
    const char *what;      // the part, for the printout
} PlanDevice;

// The entry named `name`, or NULL. The "cpu" entry's memory is this host's available memory.
const PlanDevice *plan_device_find(const char *name);
// Names of every entry, comma-separated (for messages).
const char *plan_device_names(void);
