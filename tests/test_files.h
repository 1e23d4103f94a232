// Helpers of the unit tests that work with files: a temporary folder per test, files written
// whole, and checks that a call fails with a message holding given fragments (or succeeds).
#pragma once
#include <limits.h>
#include <stdbool.h>
#include <stddef.h>

#include "test.h"

// A new folder /tmp/moe_test_XXXXXX into dir; tmp_dir_remove deletes it with what it holds.
void tmp_dir_make(char *dir, size_t len);
void tmp_dir_remove(const char *path);
// dir/name into buf (PATH_MAX bytes); returns buf.
const char *tmp_path(char *buf, const char *dir, const char *name);
void write_bytes(const char *path, const void *data, size_t n);
void write_text(const char *path, const char *text);
bool file_exists(const char *path);
// The first of the NULL-terminated fragments that `msg` lacks, or NULL if it has them all.
const char *missing_fragment(const char *msg, const char *const *fragments);

// `call` must fail with a message in `err` holding every fragment.
#define CHECK_ERR(call, err, ...)                                                                  \
    do {                                                                                           \
        (err)[0] = 0;                                                                              \
        int rc_ = (call);                                                                          \
        const char *lacks_ = missing_fragment(err, (const char *const[]){__VA_ARGS__, NULL});      \
        if (rc_ == 0 || lacks_)                                                                    \
            TEST_FAIL("%s returned %d, message \"%s\"; expected a failure mentioning \"%s\"",      \
                      #call, rc_, err, lacks_ ? lacks_ : "(all fragments present)");               \
    } while (0)

#define CHECK_OK(call, err)                                                                        \
    do {                                                                                           \
        (err)[0] = 0;                                                                              \
        int rc_ = (call);                                                                          \
        CHECK_MSG(rc_ == 0, "%s failed: %s", #call, err);                                          \
    } while (0)
