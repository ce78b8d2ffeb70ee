/* The helpers every gdncp subcommand shares (in tools/cli/): errors, option numbers, the clock,
 * the input files, the pieces of a --cp run (shards, the first agreement, the memory check,
 * per-rank output) and the benchmarks' CPU name, peak and medians. They use only the public API
 * (include/gdncp*). */
#ifndef GDNCP_CLI_H
#define GDNCP_CLI_H

#include "gdncp.h"

/* An output tensor of a split run: `rows` tensors are [B, T_full, ...] of which this rank holds
 * rows [t0, t0 + tn) in data ([B, tn, ...]; a 2-D one is [T_full, inner] with B = 1); the others
 * are whole-sequence tensors held by rank 0 (data NULL: not written). */
typedef struct {
    const char *name;
    int ndim;
    int64_t shape[4];
    int rows;
    const float *data;
} cli_out_tensor;
/* Write one safetensors file from every rank's rows at their offsets (atomically: a temporary
 * file, renamed by rank 0 once every rank's rows are on disk). add_more (may be NULL) adds more
 * whole-sequence tensors after t: with data on rank 0, reserved (NULL) elsewhere. Collective
 * (over cp's ranks, which must be MPI_COMM_WORLD's). */
typedef struct gdn_cp gdn_cp;
int cli_cp_write_rows(gdn_cp *cp, const char *path, const char *producer, int64_t B, int64_t T_full,
                      int64_t t0, int64_t tn, const cli_out_tensor *t, int n,
                      int (*add_more)(gdn_st_writer *w, int rank, void *ctx), void *ctx);
/* A split run (argv has --cp) that fails before its first agreement step (bad options): join the
 * other ranks' first collectives with a failure, so they stop too instead of waiting. Every --cp
 * command's first collectives are gdn_cp_create then gdn_cp_agree_values (one fixed-width row,
 * whatever the values). Returns 1. */
int cli_cp_fail_early(int argc, char **argv);
/* The start of a --cp run of `cmd` (gdncp run, layer, attention): this rank's place (*rank, *D)
 * and the context over MPI_COMM_WORLD for `strategy` (a gdn_cp_strategy). strategy < 0: the
 * --cp value `name` is unknown, named here with the `known` ones, and this rank joins the other
 * ranks' first collectives with the failure. 0 when *cp is ready, else the exit status. */
int cli_cp_begin(const char *cmd, const char *name, int strategy, const char *known, int argc, char **argv,
                 gdn_cp **cp, int *rank, int *D);
/* The first agreement step of a --cp run: every rank's values (what decides the collectives that
 * follow) and its local status. A failure that is not this rank's own (another rank's, or a
 * disagreement) is printed here as "gdncp <cmd>: ...", and *reported set. Collective. */
int cli_cp_agree_first(gdn_cp *cp, const char *cmd, const int64_t *vals, int n, const char *const *names, int local,
                       int *reported);
/* Every rank's weight gradients dw [n] summed on rank 0 into *sum (allocated there, NULL
 * elsewhere; the caller frees): rank 0's allocation agreed before the reduction. A failure of
 * this rank's is printed as "gdncp <cmd>: ..." and *reported set. Collective. */
int cli_cp_sum_to_root(gdn_cp *cp, const char *cmd, const float *dw, size_t n, float **sum, int *reported);
/* A digest of a string (gdn_cp_digest; 0 for NULL), for agreeing on option strings across ranks. */
int64_t cli_hash(const char *s);
/* A split run's weights (or another input every rank holds whole) the same on every rank, before any
 * exchange: one agreement step on their configuration (n <= 16 values, names[i] naming each; a name
 * ending " (its bits)" a double, cli_f64_bits) and a digest of their bytes (gdn_cp_digest, named
 * `what`). On a difference every rank prints "gdncp CMD: ... ranks disagree on NAME: rank r has ..,
 * rank 0 has .." and gets the same failure. Collective. */
int cli_cp_agree_weights(gdn_cp *cp, const char *cmd, const int64_t *vals, const char *const *names, int n,
                         const void *w, size_t bytes, const char *what);
/* A double's bits, for gdn_cp_agree_values' " (its bits)" values. */
int64_t cli_f64_bits(double x);
/* A split run's memory check before its large allocations: `bytes` (this rank's need) summed over
 * the ranks that share this machine, against its memory (gdn_check_fits). Collective (over
 * MPI_COMM_WORLD, whose ranks cp must hold); the verdict is agreed, so every rank returns the
 * same status; the first rank of each machine that cannot fit prints what was needed, as
 * "gdncp <cmd>: ...". */
int cli_cp_check_fits(gdn_cp *cp, const char *cmd, const char *what, double bytes);
/* gdncp run's input file: T (q's dimension 1) and the bytes a run holds per token of it (the
 * input rows q k v g beta, and do with --backward; the output rows o, and dq dk dv dg dbeta with
 * --backward; all B batch rows). Prints what is wrong and returns its status when the file
 * cannot be opened or has no 4-D 'q'. */
int cli_run_header(const char *path, int backward, long long *T, double *bytes_per_token);
/* Packed documents for gdncp run, layer and attention: the offsets of --cu-seqlens (given, n_given
 * values; NULL when absent) and of the input file's "cu_seqlens" tensor (I64 or I32, 1-D), which
 * must agree when both are there, checked against the file's per-token tensor `rows` ([B, T, ...]:
 * run's q, layer's x; a 2-D one is [T, ...] with B = 1; B = 1, from 0 to T, strictly increasing). *cu: a malloc'ed copy (NULL:
 * dense, neither given), *n_docs its documents. Prints what is wrong, prefixed by `who`, and
 * returns 1; else 0. */
int cli_pack_offsets(const char *who, const char *path, const char *rows, const int64_t *given, int64_t n_given,
                     int64_t **cu, int64_t *n_docs);

/* The input file's position_ids, when it has them ([T], [1, T] or [B, T], I64 or I32; one row is every
 * row's): *p malloc'ed, NULL when absent. */
int cli_read_positions(const char *who, gdn_st_file *f, int64_t B, int64_t T, int64_t **p);
/* What position_ids p [B, T] say about the tokens' positions: dense (every row b holds off + t at t,
 * one *off for all rows) or packed (B = 1, counting from 0 and restarting at 0 at each document
 * start: *cu gets the offsets, malloc'ed, *n_docs their documents). Anything else is refused naming
 * the first token that fits neither. */
int cli_positions_meaning(const char *who, const int64_t *p, int64_t B, int64_t T, int64_t *off, int64_t **cu,
                          int64_t *n_docs);
/* Positions (cli_positions_meaning's: counting from off when pcu is NULL, else restarting at the
 * documents pcu, pdocs) that agree with packed documents cu, n_docs given otherwise (--cu-seqlens, a
 * cu_seqlens tensor): restarting ones at the same documents (else the first document whose start
 * differs is named), counting ones only as one document from 0. */
int cli_positions_match_documents(const char *who, int64_t T, int64_t off, const int64_t *pcu, int64_t pdocs,
                                  const int64_t *cu, int64_t n_docs);
/* (Each of the three prints "WHO: <status text>: <detail>" and returns the status on a failure.) */

/* Print "gdncp <what>: <status text>: <detail>" to stderr and return exit code 1. */
int cli_error(const char *what, int status);
/* Parse an int option value; prints an error naming the option on failure. (The subcommands
 * read their numbers with parse.h's helpers, which also name the command and the reason.) */
int cli_int(const char *opt, const char *val, long lo, long hi, long *out);
double cli_now(void);
/* This rank's token rows [t0, t0 + tn) of T: "--shards a,b,c" (D positive sizes summing to T)
 * or, with spec NULL, the even split. Prints the problem (rank 0) and returns 1 when invalid. */
int cli_shard_of(const char *spec, int D, int rank, int64_t T, int64_t *t0, int64_t *tn);

/* Benchmark support (tools/cli/bench.c): the CPU's model name; this machine's native-width fp32
 * FMA peak with `threads` threads (measured again while a busy neighbour makes the all-thread
 * peak look low; printed as a line, or a JSON row); the median of n samples (reordered). */
void cli_cpu_name(char *buf, size_t n);
double cli_peak_gflops(int threads, int json);
double cli_median(double *x, int n);
/* Seconds to stream `bytes` once (read-only, or read-modify-write when rmw) over a buffer of that
 * size with `threads` threads: best of several passes after a warm-up (the cache state a decode
 * step sees); the bound of a memory-bound step. */
double cli_stream_seconds(size_t bytes, int rmw, int threads);
/* x[i] ~ normal(0, std), approximately: a counter-based hash of (seed, i) split into four 16-bit
 * uniforms whose sum (Irwin-Hall, tails cut at 3.46 std) is scaled to the exact std. Filled in
 * parallel, fast enough for gigabytes of benchmark weights (sequential Box-Muller draws take
 * tens of seconds there), and the same values whatever the thread count. */
void cli_fill_normal(float *x, size_t n, float std, uint64_t seed);

#endif
