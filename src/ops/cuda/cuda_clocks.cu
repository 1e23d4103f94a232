// The GPU's clock and power as NVML reads them (Ops.device_clocks), so that a benchmark can say
// what held the clock back while it timed: at its power limit an H200 runs a training step at
// ~1,620 MHz, not the ~1,980 it runs one kernel at. NVML is opened at run time (libnvidia-ml.so.1
// comes with the driver, not the toolkit), so a CUDA build still starts where there is none; the
// query then reports nothing. nvml.h comes from NVIDIA's nvml-dev wheel (scripts/setup.sh).
#include <dlfcn.h>
#include <nvml.h>

#include "cuda_common.cuh"
#include "cuda_ops.h"

// The NVML entry points used here, looked up by their versioned names (nvml.h maps the plain ones).
typedef struct {
    nvmlDevice_t device;
    decltype(&nvmlDeviceGetClockInfo) clock_info;
    decltype(&nvmlDeviceGetMaxClockInfo) max_clock_info;
    decltype(&nvmlDeviceGetPowerUsage) power_usage;
    decltype(&nvmlDeviceGetEnforcedPowerLimit) power_limit;
    decltype(&nvmlDeviceGetCurrentClocksEventReasons) event_reasons;
    decltype(&nvmlDeviceGetTotalEnergyConsumption) energy; // NULL: not in this driver's NVML
} Nvml;

static Nvml nvml; // device NULL: not opened

template <typename F> static bool nvml_sym(void *lib, const char *name, F *fn) {
    *fn = (F)dlsym(lib, name);
    return *fn != NULL;
}

// Opens NVML on the GPU of `device` (a CUDA ordinal); false, and the query stays off, when the
// library, a symbol or the device is missing.
extern "C" bool cuda_clocks_open(int device) {
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) return false;
    decltype(&nvmlInit_v2) init;
    decltype(&nvmlDeviceGetHandleByPciBusId_v2) by_bus;
    char bus[32];
    Nvml n = {};
    bool ok = nvml_sym(lib, "nvmlInit_v2", &init) && nvml_sym(lib, "nvmlDeviceGetHandleByPciBusId_v2", &by_bus) &&
              nvml_sym(lib, "nvmlDeviceGetClockInfo", &n.clock_info) &&
              nvml_sym(lib, "nvmlDeviceGetMaxClockInfo", &n.max_clock_info) &&
              nvml_sym(lib, "nvmlDeviceGetPowerUsage", &n.power_usage) &&
              nvml_sym(lib, "nvmlDeviceGetEnforcedPowerLimit", &n.power_limit) &&
              nvml_sym(lib, "nvmlDeviceGetCurrentClocksEventReasons", &n.event_reasons) &&
              cudaDeviceGetPCIBusId(bus, sizeof bus, device) == cudaSuccess && init() == NVML_SUCCESS &&
              by_bus(bus, &n.device) == NVML_SUCCESS;
    if (!ok) {
        dlclose(lib);
        return false;
    }
    nvml_sym(lib, "nvmlDeviceGetTotalEnergyConsumption", &n.energy);
    nvml = n; // the library stays open for the process
    return true;
}

extern "C" bool cuda_device_clocks(DeviceClocks *out) {
    if (!nvml.device) return false;
    unsigned sm = 0, sm_max = 0, mw = 0, limit_mw = 0;
    unsigned long long why = 0;
    if (nvml.clock_info(nvml.device, NVML_CLOCK_SM, &sm) != NVML_SUCCESS ||
        nvml.max_clock_info(nvml.device, NVML_CLOCK_SM, &sm_max) != NVML_SUCCESS ||
        nvml.power_usage(nvml.device, &mw) != NVML_SUCCESS ||
        nvml.power_limit(nvml.device, &limit_mw) != NVML_SUCCESS ||
        nvml.event_reasons(nvml.device, &why) != NVML_SUCCESS)
        return false;
    unsigned long long thermal = nvmlClocksEventReasonSwThermalSlowdown | nvmlClocksThrottleReasonHwThermalSlowdown;
    unsigned long long mj = 0;
    bool energy = nvml.energy && nvml.energy(nvml.device, &mj) == NVML_SUCCESS;
    out->t_s = moe_time_sec(), out->energy_j = energy ? mj / 1e3 : -1;
    out->sm_mhz = sm, out->sm_max_mhz = sm_max, out->power_w = mw / 1e3, out->power_limit_w = limit_mw / 1e3;
    out->power_capped = (why & nvmlClocksEventReasonSwPowerCap) != 0, out->thermal = (why & thermal) != 0;
    return true;
}
