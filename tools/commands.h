/* The subcommands of gdncp, one file each (tools/cmd_*.c), called by tools/main.c's dispatch
 * table with the arguments after the command's own words. Each returns the process exit
 * status: 0, 1 (the run failed, the message printed) or 2 (called wrongly). Each has its option
 * table, cmd_*_cli (cli/parse.h): what it parses, what `gdncp COMMAND [SUB] --help` (or -h)
 * prints and what `gdncp help --markdown` writes into docs/cli.md. */
#ifndef GDNCP_COMMANDS_H
#define GDNCP_COMMANDS_H

#include "cli/parse.h"

int cmd_run(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_diff(int argc, char **argv);
int cmd_bench_cp(int argc, char **argv);
int cmd_bench_decode(int argc, char **argv);
int cmd_bench_matmul(int argc, char **argv);
int cmd_bench_moe(int argc, char **argv);
int cmd_gen(int argc, char **argv);
int cmd_train(int argc, char **argv);
int cmd_sample(int argc, char **argv);
int cmd_bench_train(int argc, char **argv);
int cmd_layer(int argc, char **argv);
int cmd_bench_layer(int argc, char **argv);
int cmd_bench_attention_cp(int argc, char **argv);
int cmd_attention(int argc, char **argv);
int cmd_bench_attention(int argc, char **argv);

extern const cli_command cmd_run_cli;
extern const cli_command cmd_bench_cli;
extern const cli_command cmd_diff_cli;
extern const cli_command cmd_bench_cp_cli;
extern const cli_command cmd_bench_decode_cli;
extern const cli_command cmd_bench_matmul_cli;
extern const cli_command cmd_bench_moe_cli;
extern const cli_command cmd_gen_cli;
extern const cli_command cmd_train_cli;
extern const cli_command cmd_sample_cli;
extern const cli_command cmd_bench_train_cli;
extern const cli_command cmd_layer_cli;
extern const cli_command cmd_bench_layer_cli;
extern const cli_command cmd_bench_attention_cp_cli;
extern const cli_command cmd_attention_cli;
extern const cli_command cmd_bench_attention_cli;

#endif
