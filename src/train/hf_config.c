// moe.c's model config and transformers' config.json of OlmoeForCausalLM / FlexOlmoForCausalLM,
// both ways (see hf.h): which options each class can express, the keys of an export, and the
// checks of an import.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "io/fsutil.h"
#include "train/hf.h"

static const struct {
    const char *class_name, *model_type;
    double eps, theta; // transformers' defaults of rms_norm_eps and rope_theta
} HF_CLASSES[] = {
    [HF_OLMOE] = {"OlmoeForCausalLM", "olmoe", 1e-5, 10000},
    [HF_FLEX_OLMO] = {"FlexOlmoForCausalLM", "flex_olmo", 1e-6, 500000},
};

#define HF_BYTE_VOCAB 257 // `moe data prepare`: bytes 0..255 and EOS 256

const char *hf_class_name(HfClass cls) { return HF_CLASSES[cls].class_name; }

int hf_byte_eos(const ModelConfig *c) { return c->vocab_size == HF_BYTE_VOCAB ? 256 : -1; }

// ---------------------------------------------------------------- export

static int hf_refuse(MoeErr err, HfClass cls, const char *option, const char *why) {
    return moe_err(err, "cannot export to Hugging Face: %s cannot express %s (%s)", hf_class_name(cls), option,
                   why);
}

int hf_class_of(const ModelConfig *c, HfClass *cls, MoeErr err) {
    *cls = c->norm_placement == NORM_PRE ? HF_OLMOE : HF_FLEX_OLMO;
    char option[128];
    if (c->router != ROUTER_SOFTMAX)
        return hf_refuse(err, *cls, "model.router = sigmoid", "it scores the experts with a softmax");
    if (c->shared_hidden) {
        snprintf(option, sizeof option, "model.shared_hidden = %d", c->shared_hidden);
        return hf_refuse(err, *cls, option, "it has no shared expert");
    }
    if (c->n_dense_layers) {
        snprintf(option, sizeof option, "model.n_dense_layers = %d", c->n_dense_layers);
        return hf_refuse(err, *cls, option, "every layer of it is a mixture of experts");
    }
    if (c->qk_norm != QK_NORM_FULL) {
        snprintf(option, sizeof option, "model.qk_norm = %s", c->qk_norm == QK_NORM_HEAD ? "head" : "none");
        return hf_refuse(err, *cls, option, "it normalises q and k over their full width, model.qk_norm = full");
    }
    if (*cls == HF_OLMOE && (size_t)c->head_dim * c->n_heads != (size_t)c->d_model) {
        snprintf(option, sizeof option, "model.head_dim = %d with model.d_model / model.n_heads = %d", c->head_dim,
                 c->d_model / c->n_heads);
        return hf_refuse(err, *cls, option, "it sizes its QK-norm weights from d_model");
    }
    if (c->capacity_factor > 0) {
        snprintf(option, sizeof option, "model.capacity_factor = %g", c->capacity_factor);
        return hf_refuse(err, *cls, option, "it computes every routed slot: dropless routing");
    }
    if (c->random_routing)
        return hf_refuse(err, *cls, "model.random_routing = true", "it routes by the router's scores");
    return 0;
}

static void set_int(json_t *j, const char *key, int v) { json_object_set_new(j, key, json_integer(v)); }
static void set_real(json_t *j, const char *key, double v) { json_object_set_new(j, key, json_real(v)); }
static void set_bool(json_t *j, const char *key, bool v) { json_object_set_new(j, key, json_boolean(v)); }

static json_t *eos_json(const ModelConfig *c) {
    int eos = hf_byte_eos(c);
    return eos >= 0 ? json_integer(eos) : json_null();
}

// The keys in the order transformers' own config.json has them.
json_t *hf_config_json(const Config *cfg, HfClass cls, bool bf16) {
    const ModelConfig *c = &cfg->model;
    json_t *j = json_object();
    json_object_set_new(j, "architectures", json_pack("[s]", hf_class_name(cls)));
    set_bool(j, "attention_bias", false);
    set_real(j, "attention_dropout", 0.0);
    json_object_set_new(j, "bos_token_id", json_null());
    if (cls == HF_OLMOE) json_object_set_new(j, "clip_qkv", json_null());
    json_object_set_new(j, "dtype", json_string(bf16 ? "bfloat16" : "float32"));
    json_object_set_new(j, "eos_token_id", eos_json(c));
    set_int(j, "head_dim", c->head_dim);
    json_object_set_new(j, "hidden_act", json_string("silu"));
    set_int(j, "hidden_size", c->d_model);
    set_real(j, "initializer_range", c->init_std);
    set_int(j, "intermediate_size", c->expert_hidden);
    set_int(j, "max_position_embeddings", cfg->train.seq_len); // the trained length; RoPE has no limit
    json_object_set_new(j, "model_type", json_string(HF_CLASSES[cls].model_type));
    set_bool(j, "norm_topk_prob", c->norm_topk_prob);
    set_int(j, "num_attention_heads", c->n_heads);
    set_int(j, "num_experts", c->n_experts);
    set_int(j, "num_experts_per_tok", c->top_k);
    set_int(j, "num_hidden_layers", c->n_layers);
    set_int(j, "num_key_value_heads", c->n_kv_heads);
    set_bool(j, "output_router_logits", false);
    json_object_set_new(j, "pad_token_id", json_null());
    set_real(j, "rms_norm_eps", c->norm_eps);
    json_object_set_new(j, "rope_parameters", json_pack("{s:f, s:s}", "rope_theta", c->rope_theta, "rope_type", "default"));
    set_real(j, "rope_theta", c->rope_theta); // transformers 4 reads this one
    // transformers' balance loss is E sum_e f_e P_e with f summing to K: K times moe.c's (MODEL.md).
    set_real(j, "router_aux_loss_coef", c->lb_coef / c->top_k);
    set_bool(j, "tie_word_embeddings", false);
    set_bool(j, "use_cache", true);
    set_int(j, "vocab_size", c->vocab_size);
    json_object_set_new(j, "moe_c_config", config_to_json(cfg));
    return j;
}

json_t *hf_generation_config_json(const Config *cfg) {
    json_t *j = json_object();
    set_bool(j, "_from_model_config", true);
    json_object_set_new(j, "eos_token_id", eos_json(&cfg->model));
    json_object_set_new(j, "pad_token_id", eos_json(&cfg->model)); // no padding token: generate pads with EOS
    return j;
}

void hf_tensor_name(HfClass cls, const char *moe_name, char *out, size_t len) {
    // FlexOlmo: the norm after attention, then the one after the MLP. moe.c keeps OLMoE's two names
    // for its reordered norms in that order (FORMATS.md).
    static const struct { const char *moe, *flex; } RENAMES[] = {
        {".input_layernorm.weight", ".post_attention_layernorm.weight"},
        {".post_attention_layernorm.weight", ".post_feedforward_layernorm.weight"},
    };
    snprintf(out, len, "%s", moe_name);
    if (cls != HF_FLEX_OLMO || strncmp(moe_name, "model.layers.", 13)) return;
    for (size_t i = 0; i < sizeof RENAMES / sizeof RENAMES[0]; i++) {
        const char *suffix = strstr(moe_name, RENAMES[i].moe);
        if (suffix && !strcmp(suffix, RENAMES[i].moe)) {
            snprintf(out, len, "%.*s%s", (int)(suffix - moe_name), moe_name, RENAMES[i].flex);
            return;
        }
    }
}

// ---------------------------------------------------------------- import

typedef struct {
    const char *path; // config.json, for messages
    json_t *root;
    char *err;
} HfReader;

// A key's value; NULL when it is absent or null (transformers writes null for "not set").
static json_t *get_set(json_t *obj, const char *key) {
    json_t *v = json_object_get(obj, key);
    return json_is_null(v) ? NULL : v;
}

// A positive integer key into *dst (unchanged when absent and not required).
static int read_int(const HfReader *r, const char *key, int *dst, bool required) {
    json_t *v = get_set(r->root, key);
    if (!v && !required) return 0;
    if (!v) return moe_err(r->err, "%s: key '%s' is missing", r->path, key);
    if (!json_is_integer(v) || json_integer_value(v) < 1 || json_integer_value(v) > 2147483647)
        return moe_err(r->err, "%s: key '%s' must be a positive integer", r->path, key);
    *dst = (int)json_integer_value(v);
    return 0;
}

static int read_real(const HfReader *r, json_t *obj, const char *key, double *dst) {
    json_t *v = get_set(obj, key);
    if (!v) return 0;
    if (!json_is_number(v)) return moe_err(r->err, "%s: key '%s' must be a number", r->path, key);
    *dst = json_number_value(v);
    return 0;
}

static int read_bool(const HfReader *r, const char *key, bool *dst) {
    json_t *v = get_set(r->root, key);
    if (!v) return 0;
    if (!json_is_boolean(v)) return moe_err(r->err, "%s: key '%s' must be true or false", r->path, key);
    *dst = json_is_true(v);
    return 0;
}

static int hf_unsupported(const HfReader *r, const char *key, const json_t *v, const char *why) {
    char *text = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
    int rc = moe_err(r->err, "%s: key '%s' = %.100s is not supported: %s", r->path, key, text ? text : "?", why);
    free(text);
    return rc;
}

// Settings of these classes that moe.c's model does not have.
static int check_supported(const HfReader *r) {
    const struct { const char *key, *want, *why; } rules[] = {
        {"attention_bias", "false", "moe.c's projections have no bias"},
        {"clip_qkv", "null", "moe.c does not clip q, k and v"},
        {"sliding_window", "null", "moe.c's attention is over the whole sequence"},
        {"rope_scaling", "null", "moe.c's RoPE is the default one"},
        {"hidden_act", "\"silu\"", "moe.c's experts are SwiGLU"},
    };
    for (size_t i = 0; i < sizeof rules / sizeof rules[0]; i++) {
        json_t *v = get_set(r->root, rules[i].key), *want = json_loads(rules[i].want, JSON_DECODE_ANY, NULL);
        bool ok = !v || json_equal(v, want);
        json_decref(want);
        if (!ok) return hf_unsupported(r, rules[i].key, v, rules[i].why);
    }
    json_t *rope = get_set(r->root, "rope_parameters"), *type = get_set(rope, "rope_type");
    if (rope && !json_is_object(rope))
        return moe_err(r->err, "%s: key 'rope_parameters' must be an object", r->path);
    if (type && (!json_is_string(type) || strcmp(json_string_value(type), "default")))
        return hf_unsupported(r, "rope_parameters.rope_type", type, "moe.c's RoPE is the default one");
    return 0;
}

static int read_class(const HfReader *r, HfClass *cls) {
    const char *type = json_string_value(json_object_get(r->root, "model_type"));
    for (int c = 0; c < (int)(sizeof HF_CLASSES / sizeof HF_CLASSES[0]); c++)
        if (type && !strcmp(type, HF_CLASSES[c].model_type)) return *cls = (HfClass)c, 0;
    return moe_err(r->err, "%s: model_type \"%s\" is not one moe.c imports (olmoe: OlmoeForCausalLM, "
                   "flex_olmo: FlexOlmoForCausalLM)", r->path, type ? type : "(missing)");
}

// The moe.c config an export stored ("moe_c_config"): what transformers has no key for. One that
// this moe.c cannot read (another version's keys) is left out with a note.
static bool apply_moe_block(const HfReader *r, Config *cfg) {
    json_t *block = json_object_get(r->root, "moe_c_config");
    if (!block) return false;
    MoeErr why;
    char source[4200];
    snprintf(source, sizeof source, "%s: moe_c_config", r->path);
    if (!config_apply_json(cfg, block, source, why)) return true;
    printf("note: %.400s; its moe.c settings are left out (defaults instead)\n", why);
    config_defaults(cfg);
    return false;
}

static int read_model(const HfReader *r, HfClass cls, bool block, ModelConfig *c) {
    double theta = HF_CLASSES[cls].theta, eps = HF_CLASSES[cls].eps, aux = 0.01;
    c->n_kv_heads = c->head_dim = 0;
    if (read_int(r, "vocab_size", &c->vocab_size, true) || read_int(r, "hidden_size", &c->d_model, true) ||
        read_int(r, "intermediate_size", &c->expert_hidden, true) ||
        read_int(r, "num_hidden_layers", &c->n_layers, true) ||
        read_int(r, "num_attention_heads", &c->n_heads, true) ||
        read_int(r, "num_key_value_heads", &c->n_kv_heads, false) || read_int(r, "head_dim", &c->head_dim, false) ||
        read_int(r, json_object_get(r->root, "num_local_experts") ? "num_local_experts" : "num_experts",
                 &c->n_experts, true) ||
        read_int(r, "num_experts_per_tok", &c->top_k, true) || read_real(r, r->root, "rms_norm_eps", &eps) ||
        read_real(r, r->root, "rope_theta", &theta) ||
        read_real(r, json_object_get(r->root, "rope_parameters"), "rope_theta", &theta) ||
        read_real(r, r->root, "router_aux_loss_coef", &aux) || read_real(r, r->root, "initializer_range", &c->init_std) ||
        read_bool(r, "norm_topk_prob", &c->norm_topk_prob))
        return -1;
    if (!c->n_kv_heads) c->n_kv_heads = c->n_heads;
    if (cls == HF_OLMOE && c->head_dim && (size_t)c->head_dim * c->n_heads != (size_t)c->d_model)
        return moe_err(r->err, "%s: key 'head_dim' = %d is not supported: OlmoeForCausalLM sizes its QK-norm "
                       "weights from hidden_size / num_attention_heads = %d", r->path, c->head_dim,
                       c->d_model / c->n_heads);
    c->norm_eps = eps, c->rope_theta = theta;
    c->norm_placement = cls == HF_OLMOE ? NORM_PRE : NORM_REORDERED;
    c->qk_norm = QK_NORM_FULL, c->router = ROUTER_SOFTMAX;
    c->n_dense_layers = c->shared_hidden = 0, c->capacity_factor = 0, c->random_routing = false;
    // The export's own coefficient when it is the one this key was written from, else aux x K.
    if (!(block && c->lb_coef / c->top_k == aux)) c->lb_coef = aux * c->top_k;
    return 0;
}

int hf_config_read(const char *path, Config *cfg, HfClass *cls, bool *tied, MoeErr err) {
    json_t *root = fs_load_json(path, "Hugging Face config", err);
    if (!root) return -1;
    HfReader r = {path, root, err};
    config_defaults(cfg);
    *tied = false;
    int rc = read_class(&r, cls) || check_supported(&r) || read_bool(&r, "tie_word_embeddings", tied) ? -1 : 0;
    if (!rc) rc = read_model(&r, *cls, apply_moe_block(&r, cfg), &cfg->model);
    config_reset_placement(cfg);
    MoeErr why;
    if (!rc && config_validate(cfg, why)) rc = moe_err(err, "%s: %.400s", path, why);
    json_decref(root);
    return rc;
}
