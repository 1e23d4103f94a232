// The device table declared in device.h. Sources: NVIDIA's H100, H200 and HGX B200 datasheets
// (SXM parts); memory is the total the driver reports (nvidia-smi: 81,559 / 143,771 / 183,359 MiB);
// the network is one 400 Gb/s ConnectX-7 NIC per GPU, as in DGX H100, H200 and B200 systems.
#include "plan/device.h"

#include <stdio.h>
#include <string.h>

#include "common/util.h"

static PlanDevice DEVICES[] = {
    {"h100", 79.65, 989, 3350, 450, 50, "NVIDIA H100 SXM 80 GB"},
    {"h200", 140.40, 989, 4800, 450, 50, "NVIDIA H200 SXM 141 GB"},
    {"b200", 179.06, 2250, 8000, 900, 50, "NVIDIA B200 (HGX) 180 GB"},
    {"cpu", 0, 0, 0, 0, 0, "CPU ranks of this host"},
};
#define N_DEVICES (sizeof DEVICES / sizeof DEVICES[0])

const PlanDevice *plan_device_find(const char *name) {
    for (size_t i = 0; i < N_DEVICES; i++)
        if (!strcmp(DEVICES[i].name, name)) {
            if (!strcmp(name, "cpu")) DEVICES[i].memory_gib = (double)moe_host_memory_available() / 1073741824.0;
            return &DEVICES[i];
        }
    return NULL;
}

const char *plan_device_names(void) {
    static char names[64];
    if (!names[0])
        for (size_t i = 0; i < N_DEVICES; i++)
            snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s", i ? ", " : "", DEVICES[i].name);
    return names;
}
