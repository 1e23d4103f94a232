// Helpers of the fuzz harnesses (see fuzz.h).
#define _GNU_SOURCE
#include "fuzz.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/util.h"

static int fuzz_fd = -1;
static char fuzz_path[64];

const char *fuzz_file(const uint8_t *data, size_t size) {
    if (fuzz_fd < 0) {
        fuzz_fd = memfd_create("moe-fuzz", 0);
        if (fuzz_fd < 0) perror("memfd_create"), abort();
        snprintf(fuzz_path, sizeof fuzz_path, "/proc/self/fd/%d", fuzz_fd);
    }
    if (ftruncate(fuzz_fd, 0) != 0 || (size && pwrite(fuzz_fd, data, size, 0) != (ssize_t)size))
        perror("writing the in-memory input"), abort();
    return fuzz_path;
}

void fuzz_init(void) { moe_set_fatal_hook(abort); }

void fuzz_check_message(const char *err, const char *path) {
    if (!err[0] || !strstr(err, path)) {
        fprintf(stderr, "error message does not name %s: '%s'\n", path, err);
        abort();
    }
}
