/* Shared pieces of the gdncp command: one file per subcommand. */
#ifndef GDNCP_CLI_H
#define GDNCP_CLI_H

#include "gdncp.h"

int cmd_run(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_diff(int argc, char **argv);
int cmd_bench_cp(int argc, char **argv);
int cmd_bench_decode(int argc, char **argv);
int cmd_gen(int argc, char **argv);
int cmd_run_cp(const char *in, const char *out, const char *strategy, const char *shards,
               int backward, int stats, gdn_config opts);

/* Print "gdncp <what>: <status text>: <detail>" to stderr and return exit code 1. */
int cli_error(const char *what, int status);
/* Parse an int option value; prints an error naming the option on failure. */
int cli_int(const char *opt, const char *val, long lo, long hi, long *out);
double cli_now(void);

#endif
