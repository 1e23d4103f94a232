// libFuzzer harness of the config parser (src/train/config.c, src/model/config.c). An input is a
// JSON config file, then optionally a NUL byte and key=value overrides, one per line. Bad input
// must fail with a message; a config that validates must survive the trip through config.json
// (config_to_json, then read back) unchanged, as a resumed run relies on.
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"
#include "train/config.h"

#define CONFIG_PATH "fuzz.json"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fuzz_init();
    return 0;
}

// Applies the overrides of text[0, len) (lines); returns -1 at the first that fails.
static int apply_overrides(Config *c, const char *text, size_t len, MoeErr err) {
    char *copy = malloc(len + 1);
    memcpy(copy, text, len);
    copy[len] = 0;
    int rc = 0;
    for (char *line = copy, *next; line && !rc; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = 0;
        if (*line) rc = config_apply_override(c, line, err);
    }
    free(copy);
    return rc;
}

// Every key of a valid config, written as config.json writes it and read back, is the same.
static void check_round_trip(const Config *c) {
    json_t *saved = config_to_json(c);
    Config back;
    MoeErr err = "";
    config_defaults(&back);
    if (config_apply_json(&back, saved, "saved", err) || config_validate(&back, err)) {
        fprintf(stderr, "saved config does not load: %s\n", err);
        abort();
    }
    json_t *again = config_to_json(&back);
    if (!json_equal(saved, again)) abort();
    json_decref(saved), json_decref(again);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *text = (const char *)data;
    const char *nul = memchr(text, 0, size);
    size_t json_len = nul ? (size_t)(nul - text) : size;
    Config c;
    MoeErr err = "";
    config_defaults(&c);
    json_error_t jerr;
    json_t *root = json_loadb(text, json_len, JSON_REJECT_DUPLICATES, &jerr);
    int rc = root ? config_apply_json(&c, root, CONFIG_PATH, err) : 0;
    json_decref(root);
    if (rc) fuzz_check_message(err, CONFIG_PATH);
    if (!rc && nul) rc = apply_overrides(&c, nul + 1, size - json_len - 1, err);
    if (!rc && config_validate(&c, err)) rc = -1;
    if (rc) {
        if (!err[0]) abort();
        return 0;
    }
    ParamCounts p = model_param_counts(&c.model);
    if (!(p.active <= p.total)) abort();
    model_forward_flops_per_token(&c.model, (size_t)c.train.seq_len);
    check_round_trip(&c);
    return 0;
}
