// Shared by the libFuzzer harnesses (tests/fuzz/fuzz_*.c, built and run by `make fuzz`): the
// readers under test take file paths, so each input is written to an in-memory file first.
#pragma once
#include <stddef.h>
#include <stdint.h>

// A path ("/proc/self/fd/N") to an in-memory file that now holds exactly data[0, size).
const char *fuzz_file(const uint8_t *data, size_t size);
// Makes moe_fatal abort, so that a reader exiting on bad input counts as a crash (readers must
// return errors), and checks that an error message is there and names `path`.
void fuzz_init(void);
void fuzz_check_message(const char *err, const char *path);
