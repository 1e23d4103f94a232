// Option parsing and usage text shared by every command.
#include "cli.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/util.h"
#include "io/fsutil.h"
#include "train/ckpt.h"
#include "train/config.h"

void cli_usage(const CliSpec *spec, bool keys) {
    printf("usage: %s %s\n\n%s\n", spec->command, spec->usage, spec->summary);
    if (spec->opts && spec->opts[0].name) printf("\noptions:\n");
    for (const CliOption *o = spec->opts; o && o->name; o++) {
        char left[64];
        snprintf(left, sizeof left, "%s%s%s", o->name, o->value ? " " : "", o->value ? o->value : "");
        printf("  %-22s %s\n", left, o->help);
    }
    printf("  %-22s %s\n", "--help", "show this help");
    if (keys) {
        printf("\nconfig keys (JSON sections model/train/data, or key=value on the command line):\n");
        config_print_keys(stdout);
    }
}

static const CliOption *find_option(const CliSpec *spec, const char *name) {
    for (const CliOption *o = spec->opts; o && o->name; o++)
        if (!strcmp(o->name, name)) return o;
    return NULL;
}

static void unknown_option(const CliSpec *spec, const char *arg) {
    const char *names[64];
    size_t n = 0;
    for (const CliOption *o = spec->opts; o && o->name && n < 63; o++) names[n++] = o->name;
    names[n++] = "--help";
    const char *guess = moe_suggest(arg, names, n);
    if (guess) moe_fatal("%s: unknown option '%s' (did you mean '%s'?)", spec->command, arg, guess);
    moe_fatal("%s: unknown option '%s' (see `%s --help`)", spec->command, arg, spec->command);
}

void cli_parse(const CliSpec *spec, int argc, char **argv, const char **values, char ***positional,
               int *n_positional) {
    *positional = moe_calloc((size_t)argc + 1, sizeof(char *));
    *n_positional = 0;
    for (int i = 0; i < argc; i++) {
        const char *arg = argv[i];
        if (!strcmp(arg, "--help") || !strcmp(arg, "-h")) {
            cli_usage(spec, !strcmp(spec->command, "moe train"));
            exit(0);
        }
        if (strncmp(arg, "--", 2)) {
            (*positional)[(*n_positional)++] = argv[i];
            continue;
        }
        const CliOption *o = find_option(spec, arg);
        if (!o) unknown_option(spec, arg);
        if (o->value && i + 1 >= argc)
            moe_fatal("%s: option %s needs a value (%s)", spec->command, arg, o->value);
        values[o - spec->opts] = o->value ? argv[++i] : "1";
    }
}

char **cli_parse_one_rank(const CliSpec *spec, int argc, char **argv, const char **values, int *n_positional,
                          const Comm *world) {
    char **pos;
    cli_parse(spec, argc, argv, values, &pos, n_positional);
    cli_single_rank(spec->command, world);
    return pos;
}

int cli_misuse(const CliSpec *spec, char **positional) {
    cli_usage(spec, false);
    free(positional);
    return 1;
}

char **cli_parse_exact(const CliSpec *spec, int argc, char **argv, const char **values, int n, const Comm *world) {
    int n_pos;
    char **pos = cli_parse_one_rank(spec, argc, argv, values, &n_pos, world);
    if (n_pos != n) exit(cli_misuse(spec, pos));
    return pos;
}

double cli_number(const char *option, const char *text, double lo, double hi) {
    char *end;
    errno = 0;
    double v = strtod(text, &end);
    if (!*text || *end || errno || !(v >= lo && v <= hi))
        moe_fatal("option %s: '%s' is not a number between %g and %g", option, text, lo, hi);
    return v;
}

uint64_t cli_bytes(const char *option, const char *text) {
    static const struct { const char *unit; double scale; } UNITS[] = {
        {"", 1}, {"B", 1}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12},
        {"KIB", 1024.0}, {"MIB", 1048576.0}, {"GIB", 1073741824.0}, {"TIB", 1099511627776.0}};
    char *end;
    errno = 0;
    double v = strtod(text, &end);
    for (size_t i = 0; i < sizeof UNITS / sizeof UNITS[0] && end != text && !errno; i++)
        if (!strcasecmp(end, UNITS[i].unit) && v * UNITS[i].scale >= 1 && v * UNITS[i].scale < 1.8e19)
            return (uint64_t)(v * UNITS[i].scale);
    moe_fatal("option %s: '%s' is not a size in bytes of at least 1 (e.g. 5GB, 500MB, 2GiB or 65536)", option, text);
}

void cli_single_rank(const char *command, const Comm *world) {
    if (world->size > 1)
        moe_fatal("%s runs in one process; start it without mpirun/srun (%d ranks here)", command,
                  world->size);
}

void cli_override_and_validate(Config *cfg, int n, char **assignments) {
    MoeErr err;
    for (int i = 0; i < n; i++)
        if (config_apply_override(cfg, assignments[i], err)) moe_fatal("%s", err);
    if (config_validate(cfg, err)) moe_fatal("%s", err);
}

void cli_load_config(const char *arg, Config *cfg) {
    MoeErr err;
    char ckpt[4200], run_config[4200];
    config_defaults(cfg);
    snprintf(run_config, sizeof run_config, "%s/config.json", arg);
    if (!fs_is_dir(arg)) {
        if (config_load_file(cfg, arg, err)) moe_fatal("%s", err);
    } else if (fs_exists(run_config)) {
        if (config_load_file(cfg, run_config, err)) moe_fatal("%s", err);
    } else {
        TrainState st;
        if (ckpt_resolve(arg, ckpt, sizeof ckpt, err) || ckpt_read_state(ckpt, cfg, &st, err))
            moe_fatal("%s", err);
    }
}

char **cli_config_command(const CliSpec *spec, int argc, char **argv, const char **values, const Comm *world,
                          Config *cfg) {
    int n_pos;
    char **pos = cli_parse_one_rank(spec, argc, argv, values, &n_pos, world);
    if (n_pos < 1 || strchr(pos[0], '=')) {
        cli_misuse(spec, pos);
        return NULL;
    }
    cli_load_config(pos[0], cfg);
    cli_override_and_validate(cfg, n_pos - 1, pos + 1);
    return pos;
}
