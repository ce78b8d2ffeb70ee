/* The subcommands of gdncp, one file each (tools/cmd_*.c), called by tools/main.c's dispatch
 * table with the arguments after the command's own words. Each returns the process exit
 * status: 0, 1 (the run failed, the message printed) or 2 (called wrongly). */
#ifndef GDNCP_COMMANDS_H
#define GDNCP_COMMANDS_H

int cmd_run(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_diff(int argc, char **argv);
int cmd_bench_cp(int argc, char **argv);
int cmd_bench_decode(int argc, char **argv);
int cmd_bench_matmul(int argc, char **argv);
int cmd_gen(int argc, char **argv);
int cmd_train(int argc, char **argv);
int cmd_sample(int argc, char **argv);
int cmd_bench_train(int argc, char **argv);
int cmd_layer(int argc, char **argv);
int cmd_bench_layer(int argc, char **argv);
int cmd_bench_attention_cp(int argc, char **argv);
int cmd_attention(int argc, char **argv);
int cmd_bench_attention(int argc, char **argv);

#endif
