// Tests of the config table: defaults, overrides of every type, JSON files, validation messages,
// the saved form, and model comparison for resumes.
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "test.h"
#include "train/config.h"

static void expect_error(int rc, const char *err, const char *needle) {
    CHECK_MSG(rc != 0, "accepted input that should fail (wanted '%s')", needle);
    if (rc) CHECK_MSG(strstr(err, needle), "message '%s' lacks '%s'", err, needle);
}

static void test_defaults_validate(void) {
    Config c;
    MoeErr err;
    config_defaults(&c);
    CHECK_MSG(config_validate(&c, err) == 0, "defaults invalid: %s", err);
    CHECK(c.model.head_dim == c.model.d_model / c.model.n_heads);
}

static void test_overrides_each_type(void) {
    Config c;
    MoeErr err;
    config_defaults(&c);
    CHECK(config_apply_override(&c, "model.d_model=64", err) == 0 && c.model.d_model == 64);
    CHECK(config_apply_override(&c, "train.lr=1e-4", err) == 0 && c.train.lr == 1e-4);
    CHECK(config_apply_override(&c, "model.norm_topk_prob=true", err) == 0 && c.model.norm_topk_prob);
    CHECK(config_apply_override(&c, "model.router=sigmoid", err) == 0 && c.model.router == ROUTER_SIGMOID);
    CHECK(config_apply_override(&c, "model.qk_norm=head", err) == 0 && c.model.qk_norm == QK_NORM_HEAD);
    CHECK(config_apply_override(&c, "train.out=runs/x", err) == 0 && !strcmp(c.train.out, "runs/x"));
    expect_error(config_apply_override(&c, "model.d_model=6x", err), err, "must be an integer");
    // Found by fuzz_config: a path that is not UTF-8 vanished from the saved config.json.
    expect_error(config_apply_override(&c, "data.train=a\xe9.npy", err), err,
                 "'data.train' is not UTF-8 text");
    expect_error(config_apply_override(&c, "train.lr=nan", err), err, "must be a number");
    expect_error(config_apply_override(&c, "model.norm_topk_prob=yes", err), err, "true or false");
    expect_error(config_apply_override(&c, "model.router=soft", err), err, "one of softmax, sigmoid");
    expect_error(config_apply_override(&c, "model.n_expertz=4", err), err, "did you mean 'model.n_experts'");
    expect_error(config_apply_override(&c, "steps", err), err, "not a key=value");
}

static void test_validation_messages(void) {
    struct { const char *kv, *needle; } cases[] = {
        {"model.d_model=130", "not divisible by model.n_heads"},
        {"model.top_k=9", "larger than model.n_experts"},
        {"model.n_kv_heads=3", "must divide model.n_heads"},
        {"model.n_layers=0", "positive integer"},
        {"model.n_dense_layers=9", "between 0 and model.n_layers"},
        {"model.head_dim=3", "must be even"},
        {"model.capacity_factor=-1", "must be >= 0"},
        {"train.seq_len=0", "train.seq_len"},
        {"train.beta2=1", "beta2"},
        {"data.token_bytes=3", "data.token_bytes"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        Config c;
        MoeErr err = "";
        config_defaults(&c);
        if (config_apply_override(&c, cases[i].kv, err)) TEST_FAIL("%s: %s", cases[i].kv, err);
        expect_error(config_validate(&c, err), err, cases[i].needle);
    }
}

// A backend's declared limits refuse what its kernels cannot run, naming the key and the limit,
// and only widths the model uses count.
static void test_backend_limits(void) {
    const OpsLimits gpu = {.max_experts = 256, .max_top_k = 16, .width_multiple = 8, .head_dims = {16, 32, 64, 128}};
    struct { const char *kv, *needle; } cases[] = {
        {"model.n_experts=300", "dev supports model.n_experts up to 256 (it is 300)"},
        {"model.top_k=17", "dev supports model.top_k up to 16 (it is 17)"},
        {"model.d_model=132", "dev needs model.d_model to be a multiple of 8 (it is 132)"},
        {"model.expert_hidden=100", "model.expert_hidden to be a multiple of 8"},
        {"model.shared_hidden=12", "model.shared_hidden to be a multiple of 8"},
        {"model.head_dim=48", "dev supports model.head_dim 16, 32, 64 or 128 (it is 48)"},
    };
    Config base, c;
    MoeErr err = "";
    config_defaults(&base);
    config_apply_override(&base, "model.n_experts=32", err);
    config_apply_override(&base, "model.top_k=16", err);
    config_apply_override(&base, "model.head_dim=32", err);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        c = base;
        if (config_apply_override(&c, cases[i].kv, err) || config_validate(&c, err))
            TEST_FAIL("%s: %s", cases[i].kv, err);
        expect_error(model_config_check_limits(&c.model, &gpu, "dev", err), err, cases[i].needle);
    }
    c = base;
    config_apply_override(&c, "model.dense_hidden=100", err); // no dense layer uses it
    CHECK_MSG(config_validate(&c, err) == 0 && model_config_check_limits(&c.model, &gpu, "dev", err) == 0, "%s", err);
    const OpsLimits none = {0};
    config_apply_override(&c, "model.head_dim=6", err);
    CHECK_MSG(config_validate(&c, err) == 0 && model_config_check_limits(&c.model, &none, "dev", err) == 0, "%s", err);
}

static void test_json_round_trip_and_diff(void) {
    Config a, b;
    MoeErr err;
    config_defaults(&a);
    config_apply_override(&a, "model.n_experts=16", err);
    config_apply_override(&a, "train.schedule=linear", err);
    config_apply_override(&a, "model.capacity_factor=1.25", err);
    json_t *j = config_to_json(&a);
    config_defaults(&b);
    CHECK_MSG(config_apply_json(&b, j, "test", err) == 0, "%s", err);
    json_decref(j);
    char x[64], y[64];
    CHECK_MSG(config_model_diff(&a, &b, x, y, sizeof x) == NULL, "model sections differ after a round trip");
    CHECK(b.train.schedule == SCHED_LINEAR && b.model.capacity_factor == 1.25);
    b.model.top_k = 3;
    const char *key = config_model_diff(&a, &b, x, y, sizeof x);
    CHECK_MSG(key && !strcmp(key, "model.top_k") && !strcmp(x, "2") && !strcmp(y, "3"),
              "diff gave %s (%s vs %s)", key ? key : "none", x, y);
}

static void test_json_file_errors(void) {
    char path[] = "/tmp/moe-config-XXXXXX";
    int fd = mkstemp(path);
    FILE *f = fdopen(fd, "w");
    fputs("{\"model\": {\"d_model\": 64}, \"train\": {\"steps\": 2.5}}", f);
    fclose(f);
    Config c;
    MoeErr err;
    config_defaults(&c);
    expect_error(config_load_file(&c, path, err), err, "'train.steps' must be an integer, got '2.5'");
    f = fopen(path, "w");
    fputs("{\"model\": {\"d_model\": 64,}}", f);
    fclose(f);
    expect_error(config_load_file(&c, path, err), err, "malformed JSON");
    f = fopen(path, "w");
    fputs("{\"modle\": {}}", f);
    fclose(f);
    expect_error(config_load_file(&c, path, err), err, "'modle' is unknown");
    f = fopen(path, "w");
    fputs("{\"model\": {\"rope_theta\": 500000}}", f); // an integer for a real key is fine
    fclose(f);
    CHECK_MSG(config_load_file(&c, path, err) == 0 && c.model.rope_theta == 500000, "%s", err);
    unlink(path);
}

const TestCase config_tests[] = {
    {"config_defaults_validate", test_defaults_validate},
    {"config_overrides_each_type", test_overrides_each_type},
    {"config_validation_messages", test_validation_messages},
    {"config_backend_limits", test_backend_limits},
    {"config_json_round_trip_and_diff", test_json_round_trip_and_diff},
    {"config_json_file_errors", test_json_file_errors},
    {0},
};
