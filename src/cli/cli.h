// Command-line plumbing shared by the commands: option tables with help and suggestions, and the
// entry points of each command (one file per command).
#pragma once
#include <stdbool.h>
#include <stdint.h>

#include "dist/comm.h"
#include "train/config.h"

typedef struct {
    const char *name;  // "--ckpt"
    const char *value; // value placeholder ("DIR"), NULL for a flag
    const char *help;
} CliOption;

#define CLI_OPTION_CKPT {"--ckpt", "DIR", "checkpoint directory, or a run directory (its newest checkpoint)"}

typedef struct {
    const char *command;    // "moe eval"
    const char *usage;      // after the command name
    const char *summary;
    const CliOption *opts;  // NULL-terminated by name
} CliSpec;

// Parses argv (after the command name). Option values land in values[i] (flags: "1"); other
// arguments are collected as positionals. `--help` prints the usage and exits 0; an unknown
// option exits with a suggestion.
void cli_parse(const CliSpec *spec, int argc, char **argv, const char **values, char ***positional,
               int *n_positional);
void cli_usage(const CliSpec *spec, bool keys);
// cli_parse for a one-process command (cli_single_rank): returns its positional arguments (free the
// array with free()), their count in *n_positional.
char **cli_parse_one_rank(const CliSpec *spec, int argc, char **argv, const char **values, int *n_positional,
                          const Comm *world);
// A command's answer to arguments it cannot take: prints the usage, frees positional, returns 1.
int cli_misuse(const CliSpec *spec, char **positional);
// cli_parse_one_rank for a command that takes exactly n positional arguments: prints the usage and
// exits 1 for another count. Returns them (free the array with free()).
char **cli_parse_exact(const CliSpec *spec, int argc, char **argv, const char **values, int n, const Comm *world);
double cli_number(const char *option, const char *text, double lo, double hi);
// A size in bytes: a number with an optional unit, B, KB, MB, GB, TB (powers of 1000, as Hugging
// Face counts shard sizes) or KiB, MiB, GiB, TiB (powers of 1024); "5GB", "200MiB", "65536".
uint64_t cli_bytes(const char *option, const char *text);

// Every command gets the world communicator (one rank unless started by mpirun or srun).
int cmd_train(int argc, char **argv, Comm *world);
int cmd_eval(int argc, char **argv, Comm *world);
int cmd_sample(int argc, char **argv, Comm *world);
int cmd_inspect(int argc, char **argv, Comm *world);
int cmd_data(int argc, char **argv, Comm *world);
int cmd_bench(int argc, char **argv, Comm *world);
int cmd_ckpt(int argc, char **argv, Comm *world);
int cmd_plot(int argc, char **argv, Comm *world);
int cmd_export(int argc, char **argv, Comm *world);
int cmd_import(int argc, char **argv, Comm *world);
int cmd_plan(int argc, char **argv, Comm *world);
// `moe bench --kernels [--only FAMILIES]`: each component kernel of the families in the mask
// (bench_kernel_families) timed alone on cfg's shapes (bench_kernels.c).
void bench_kernels(const Config *cfg, unsigned families);
// The mask of a comma list of kernel families (attention, grouped, dense, memory); NULL: all of
// them. Exits naming the one it does not know.
unsigned bench_kernel_families(const char *list);
// The config of a config file, a run directory (its config.json) or a checkpoint directory; exits
// with the message when it cannot be read.
void cli_load_config(const char *arg, Config *cfg);
// A one-process command whose arguments are a config (as cli_load_config reads it) and key=value
// overrides: parses them (options into values), loads and validates cfg, and returns the positional
// arguments (the caller frees them; [0] names the config), or NULL after printing the usage.
char **cli_config_command(const CliSpec *spec, int argc, char **argv, const char **values, const Comm *world,
                          Config *cfg);
// Applies key=value overrides to cfg, then validates it; exits with the message on an error.
void cli_override_and_validate(Config *cfg, int n, char **assignments);
// Runs `moe train ARGS` as n processes on this node (GPU ranks joined by NCCL); returns the first
// failing rank's exit code, or 0.
int cli_launch_local(int n, int argc, char **argv);
// Exits with a message when a one-process command was started on several ranks.
void cli_single_rank(const char *command, const Comm *world);
