// Calibration files (see calib.h): reading, checking, writing and interpolating them.
#include "plan/calib.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "io/fsutil.h"

#define CALIB_FORMAT "moe.c calibration 1"
static const double GIB = 1073741824.0;

// The file's units: TFLOP/s for matrix families, GB/s for the rest.
static double unit(KernelFamily f) { return kernel_family_is_matrix(f) ? 1e12 : 1e9; }

// The bf16 family whose points FP8 family f takes where it has none (calib_fill_fallbacks); f itself
// for the families every file must have.
static KernelFamily fallback_of(KernelFamily f) {
    switch (f) {
    case KERNEL_FP8_GROUPED: return KERNEL_GROUPED_FWD;
    case KERNEL_FP8_GROUPED_WGRAD: return KERNEL_GROUPED_WGRAD;
    case KERNEL_FP8_DENSE: return KERNEL_DENSE_GEMM;
    case KERNEL_FP8_QUANTIZE: return KERNEL_ELEMENTWISE;
    default: return f;
    }
}

static int read_text(json_t *obj, const char *key, char *out, size_t len, bool required, const char *path,
                     MoeErr err) {
    json_t *v = json_object_get(obj, key);
    if (!v && !required) return 0;
    if (!json_is_string(v) || strlen(json_string_value(v)) >= len)
        return moe_err(err, "%s: '%s' must be a string of fewer than %zu characters", path, key, len);
    snprintf(out, len, "%s", json_string_value(v));
    return 0;
}

static int read_number(json_t *obj, const char *section, const char *key, double *out, const char *path,
                       MoeErr err) {
    json_t *v = json_object_get(obj, key);
    if (!json_is_number(v) || !(json_number_value(v) >= 0))
        return moe_err(err, "%s: '%s%s%s' must be a number >= 0", path, section, *section ? "." : "", key);
    *out = json_number_value(v);
    return 0;
}

static int read_curve(json_t *kernels, KernelFamily f, Calib *c, const char *path, MoeErr err) {
    const char *name = KERNEL_FAMILY_NAMES[f];
    json_t *fam = json_object_get(kernels, name), *pts = json_object_get(fam, "points");
    if (!fam && fallback_of(f) != f) return 0; // an optional family: calib_fill_fallbacks
    if (!json_is_array(pts) || !json_array_size(pts))
        return moe_err(err, "%s: kernels.%s.points is missing or empty (a list of [size, rate] pairs; %s)", path, name,
                       kernel_family_is_matrix(f) ? "FLOPs and TFLOP/s" : "bytes and GB/s");
    CalibCurve *k = &c->family[f];
    size_t i;
    json_t *p;
    json_array_foreach(pts, i, p) {
        if (i >= CALIB_MAX_POINTS)
            return moe_err(err, "%s: kernels.%s has more than %d points", path, name, CALIB_MAX_POINTS);
        json_t *s = json_array_get(p, 0), *r = json_array_get(p, 1);
        if (json_array_size(p) != 2 || !json_is_number(s) || !json_is_number(r))
            return moe_err(err, "%s: kernels.%s.points[%zu] must be a pair [size, rate]", path, name, i);
        k->size[i] = json_number_value(s), k->rate[i] = json_number_value(r) * unit(f);
        k->n = (int)i + 1;
    }
    return read_text(fam, "from", k->from, sizeof k->from, false, path, err);
}

static int read_comm(json_t *comm, Calib *c, const char *path, MoeErr err) {
    c->has_comm = json_is_object(comm);
    if (!c->has_comm) return 0;
    double us = 0, coll = 0, p2p = 0, ex = 0;
    if (read_number(comm, "comm", "latency_us", &us, path, err) ||
        read_number(comm, "comm", "collective_GBps", &coll, path, err) ||
        read_number(comm, "comm", "p2p_GBps", &p2p, path, err) ||
        read_number(comm, "comm", "exchange_GBps", &ex, path, err) ||
        read_number(comm, "comm", "grad_reduce_hidden", &c->grad_reduce_hidden, path, err) ||
        read_text(comm, "from", c->comm_from, sizeof c->comm_from, false, path, err))
        return -1;
    if (!(coll > 0 && p2p > 0 && ex > 0) || c->grad_reduce_hidden > 1)
        return moe_err(err, "%s: comm rates must be > 0 and comm.grad_reduce_hidden in [0, 1]", path);
    c->latency_s = us * 1e-6, c->collective_bps = coll * 1e9, c->p2p_bps = p2p * 1e9, c->exchange_bps = ex * 1e9;
    return 0;
}

static int read_memory(json_t *mem, Calib *c, const char *path, MoeErr err) {
    double runtime = 0, comm = 0;
    if (read_number(mem, "memory", "runtime_GiB", &runtime, path, err) ||
        read_number(mem, "memory", "communicator_GiB", &comm, path, err) ||
        read_text(mem, "from", c->memory_from, sizeof c->memory_from, false, path, err))
        return -1;
    c->runtime_bytes = runtime * GIB, c->communicator_bytes = comm * GIB;
    return 0;
}

static int read_root(json_t *root, Calib *c, const char *path, MoeErr err) {
    json_t *format = json_object_get(root, "format");
    if (!json_is_string(format) || strcmp(json_string_value(format), CALIB_FORMAT))
        return moe_err(err, "%s: not a calibration file (\"format\": \"%s\" is missing); write one with "
                       "moe bench --calibrate", path, CALIB_FORMAT);
    double us = 0, copy = 0;
    if (read_text(root, "device", c->device, sizeof c->device, true, path, err) ||
        read_text(root, "backend", c->backend, sizeof c->backend, true, path, err) ||
        read_text(root, "source", c->source, sizeof c->source, true, path, err) ||
        read_number(root, "", "kernel_overhead_us", &us, path, err) || read_number(root, "", "copy_GBps", &copy, path, err))
        return -1;
    if (!(copy > 0)) return moe_err(err, "%s: copy_GBps must be > 0", path);
    c->kernel_overhead_s = us * 1e-6, c->copy_bps = copy * 1e9;
    if (strcmp(c->backend, "cuda") && strcmp(c->backend, "cpu"))
        return moe_err(err, "%s: backend '%s' must be cuda or cpu", path, c->backend);
    for (int f = 0; f < KERNEL_N_FAMILIES; f++)
        if (read_curve(json_object_get(root, "kernels"), (KernelFamily)f, c, path, err)) return -1;
    calib_fill_fallbacks(c);
    if (read_comm(json_object_get(root, "comm"), c, path, err) ||
        read_memory(json_object_get(root, "memory"), c, path, err))
        return -1;
    return calib_check(c, path, err);
}

int calib_load(Calib *c, const char *path, MoeErr err) {
    memset(c, 0, sizeof *c);
    json_t *root = fs_load_json(path, "calibration file", err);
    if (!root) return -1;
    int rc = read_root(root, c, path, err);
    json_decref(root);
    return rc;
}

int calib_check(const Calib *c, const char *source, MoeErr err) {
    for (int f = 0; f < KERNEL_N_FAMILIES; f++) {
        const CalibCurve *k = &c->family[f];
        if (k->n < 1)
            return moe_err(err, "%s: kernels.%s has no points", source, KERNEL_FAMILY_NAMES[f]);
        for (int i = 0; i < k->n; i++)
            if (!(k->size[i] > 0 && k->rate[i] > 0 && isfinite(k->rate[i])) || (i && !(k->size[i] > k->size[i - 1])))
                return moe_err(err, "%s: kernels.%s point %d: sizes and rates must be > 0, sizes increasing", source,
                               KERNEL_FAMILY_NAMES[f], i);
    }
    return 0;
}

void calib_fill_fallbacks(Calib *c) {
    for (int f = 0; f < KERNEL_N_FAMILIES; f++) {
        KernelFamily from = fallback_of((KernelFamily)f);
        CalibCurve *k = &c->family[f];
        if (from == (KernelFamily)f || k->n) continue;
        *k = c->family[from];
        k->fallback = true;
        snprintf(k->from, sizeof k->from, "no rates of its own: the points of %s", KERNEL_FAMILY_NAMES[from]);
    }
}

void calib_fallback_names(const Calib *c, char *out, size_t len) {
    out[0] = '\0';
    for (int f = 0; f < KERNEL_N_FAMILIES; f++)
        if (c->family[f].fallback)
            snprintf(out + strlen(out), len - strlen(out), "%s%s as %s", out[0] ? ", " : "", KERNEL_FAMILY_NAMES[f],
                     KERNEL_FAMILY_NAMES[fallback_of((KernelFamily)f)]);
}

void calib_add_point(Calib *c, KernelFamily f, double size, double rate) {
    CalibCurve *k = &c->family[f];
    int i = 0;
    while (i < k->n && k->size[i] < size) i++;
    if (i < k->n && k->size[i] == size) {
        k->rate[i] = rate > k->rate[i] ? rate : k->rate[i];
        return;
    }
    MOE_CHECK(k->n < CALIB_MAX_POINTS, "calibration: more than %d sizes of %s", CALIB_MAX_POINTS,
              KERNEL_FAMILY_NAMES[f]);
    memmove(&k->size[i + 1], &k->size[i], (size_t)(k->n - i) * sizeof(double));
    memmove(&k->rate[i + 1], &k->rate[i], (size_t)(k->n - i) * sizeof(double));
    k->size[i] = size, k->rate[i] = rate, k->n++;
}

double calib_rate(const Calib *c, KernelFamily f, double size) {
    const CalibCurve *k = &c->family[f];
    if (size <= k->size[0]) return k->rate[0];
    if (size >= k->size[k->n - 1]) return k->rate[k->n - 1];
    int i = 1;
    while (k->size[i] < size) i++;
    double t = log(size / k->size[i - 1]) / log(k->size[i] / k->size[i - 1]);
    return exp(log(k->rate[i - 1]) + t * log(k->rate[i] / k->rate[i - 1]));
}

// ---------------------------------------------------------------- writing

static json_t *curve_json(const Calib *c, KernelFamily f) {
    const CalibCurve *k = &c->family[f];
    json_t *pts = json_array();
    for (int i = 0; i < k->n; i++)
        json_array_append_new(pts, json_pack("[f, f]", k->size[i], k->rate[i] / unit(f)));
    json_t *fam = json_pack("{s: s, s: o}", "units", kernel_family_is_matrix(f) ? "[FLOP, TFLOP/s]" : "[bytes, GB/s]",
                            "points", pts);
    if (k->from[0]) json_object_set_new(fam, "from", json_string(k->from));
    return fam;
}

int calib_save(const Calib *c, const char *path, MoeErr err) {
    json_t *kernels = json_object();
    for (int f = 0; f < KERNEL_N_FAMILIES; f++)
        json_object_set_new(kernels, KERNEL_FAMILY_NAMES[f], curve_json(c, (KernelFamily)f));
    json_t *comm = !c->has_comm ? json_null()
                   : json_pack("{s: f, s: f, s: f, s: f, s: f, s: s}", "latency_us", c->latency_s * 1e6,
                               "collective_GBps", c->collective_bps / 1e9, "p2p_GBps", c->p2p_bps / 1e9,
                               "exchange_GBps", c->exchange_bps / 1e9, "grad_reduce_hidden", c->grad_reduce_hidden,
                               "from", c->comm_from);
    json_t *root = json_pack("{s: s, s: s, s: s, s: s, s: f, s: f, s: o, s: o, s: {s: f, s: f, s: s}}", "format",
                             CALIB_FORMAT, "device", c->device, "backend", c->backend, "source", c->source,
                             "kernel_overhead_us", c->kernel_overhead_s * 1e6, "copy_GBps", c->copy_bps / 1e9,
                             "kernels", kernels, "comm", comm,
                             "memory", "runtime_GiB", c->runtime_bytes / GIB, "communicator_GiB",
                             c->communicator_bytes / GIB, "from", c->memory_from);
    int rc = fs_write_json_atomic(path, root, err);
    json_decref(root);
    return rc;
}
