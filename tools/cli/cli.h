/* The helpers every gdncp subcommand shares (in tools/cli/): errors, option numbers, the clock,
 * the input files, the pieces of a --cp run (shards, the first agreement, the memory check,
 * per-rank output) and the benchmarks' support (CPU name, peaks, medians, random inputs, errors,
 * FLOP counts, the row printer). They use only the public API (include/gdncp*). */
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
/* A split run (argv has --cp or --ep: main started MPI) that fails before its first agreement
 * step (bad options): join the other ranks' first collectives with a failure, so they stop too
 * instead of waiting. Every --cp / --ep command's first collectives are gdn_cp_create then
 * gdn_cp_agree_values (one fixed-width row, whatever the values). Returns 1. */
int cli_cp_fail_early(int argc, char **argv);
/* The start of a --cp run of `cmd` (gdncp run, layer, attention): this rank's place (*rank, *D)
 * and the context over MPI_COMM_WORLD (the strategy, parsed from `name` by the caller, goes in
 * its plan's config). strategy < 0: the --cp value `name` is unknown, named here with the `known` ones, and this rank joins the other
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
double cli_now(void);
/* This rank's token rows [t0, t0 + tn) of T: "--shards a,b,c" (D positive sizes summing to T)
 * or, with spec NULL, the even split. Prints the problem (rank 0) and returns 1 when invalid. */
int cli_shard_of(const char *spec, int D, int rank, int64_t T, int64_t *t0, int64_t *tn);

/* Benchmark support (tools/cli/bench.c): the CPU's model name (read once; "unknown CPU" when
 * /proc/cpuinfo does not say); this machine's native-width fp32 FMA peak with `threads` threads
 * (measured again while a busy neighbour makes the all-thread peak look low; printed as a line,
 * or a JSON row); the median of n samples (reordered). */
const char *cli_cpu(void);
/* The threads an OpenMP region would use (1 without OpenMP). */
int cli_max_threads(void);
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
/* x[i] = a (2u - 1), u uniform in [0, 1) with 24 bits, from the same kind of counter-based hash
 * (a stream of its own for each seed, not cli_fill_normal's): U(-a, a) filled in parallel. */
void cli_fill_uniform_sym(float *x, size_t n, float a, uint64_t seed);
/* The benchmarks' sequential generator (xorshift64, *s its state, nonzero): the next 64 bits; a
 * float lo + (hi - lo) u with u uniform in [0, 1) on 24 bits (its top 24); n of those in a new
 * array (malloc'ed; NULL when out of memory). */
uint64_t cli_rng_next(uint64_t *s);
float cli_uniform(uint64_t *s, float lo, float hi);
float *cli_random_floats(size_t n, float lo, float hi, uint64_t *s);

/* The benchmarks' error against a reference: max|x - ref| / max|ref| over n (the absolute error
 * when ref is all zeros; NaN when x holds a NaN). _f32: a float reference. */
double cli_rel_err(const float *x, const double *ref, int64_t n);
double cli_rel_err_f32(const float *x, const float *ref, int64_t n);

/* FLOPs the benchmarks count (DESIGN §3, §10): the chunked rule's over `head_tokens` (value head,
 * token) pairs at key and value widths K, V and chunk C (gdn_rule_flops_per_head_token): the
 * forward (dirs 1), the backward with its recompute (2) or both (3); the causal attention core
 * over T tokens of H heads of width d, 2 T^2 d H forward, x3.5 with the backward. */
double cli_rule_flops(int64_t K, int64_t V, int chunk, double head_tokens, int dirs);
double cli_attn_core_flops(int64_t T, int64_t d, int64_t H, int backward);

/* One row of a benchmark: a list of fields, written either as a JSON line ({"key":value,...},
 * the fields with a key, in list order) or as a text line (the fields' text pieces, each with
 * its own words and spacing, then a newline), by cli_row. The text pieces print in ascending
 * `at` (a field whose at is 0 takes the one before it, the first 1; list order among equals), so
 * the text may order its columns unlike the JSON. */
typedef struct {
    const char *key;  /* the JSON key; NULL: text only */
    const char *json; /* the JSON value's printf format (a string's quotes are added); NULL: text only */
    const char *text; /* the text piece's printf format; NULL: JSON only */
    char kind;        /* 's' a string, 'r' a string written into JSON as it is (true, [1,2], 1.5),
                         'i' a long long, 'f' or 'n' a double (JSON's null when it is not
                         finite: JSON has no Inf or NaN);
                         0: no value (a text piece of words, or nothing at all) */
    int at;           /* the text's order, above */
    double scale;     /* the text shows the double times scale (0: 1) */
    const char *s;
    long long i;
    double f;
} cli_field;
#define CLI_S(k, j, t, v) ((cli_field){.key = (k), .json = (j), .text = (t), .kind = 's', .s = (v)})
#define CLI_R(k, t, v) ((cli_field){.key = (k), .json = "%s", .text = (t), .kind = 'r', .s = (v)})
#define CLI_I(k, j, t, v) ((cli_field){.key = (k), .json = (j), .text = (t), .kind = 'i', .i = (long long)(v)})
#define CLI_F(k, j, t, v) ((cli_field){.key = (k), .json = (j), .text = (t), .kind = 'f', .f = (v)})
#define CLI_N(k, j, t, v) ((cli_field){.key = (k), .json = (j), .text = (t), .kind = 'n', .f = (v)})
#define CLI_T(t) ((cli_field){.text = (t)})
#define CLI_NONE ((cli_field){.kind = 0})
/* A field with its text moved (at) or scaled (the text shows the value times x); a field that is
 * JSON's null and has no text unless `have` (what a row does not have: JSON has no NaN). */
cli_field cli_at(cli_field f, int at);
cli_field cli_x(cli_field f, double x);
cli_field cli_or_null(int have, cli_field f);
/* f when have, else no field at all (CLI_NONE). */
cli_field cli_if(int have, cli_field f);
/* Print the row of n fields (n <= 128; stdout, flushed): JSON when json, else text. */
void cli_row(int json, const cli_field *f, int n);
#define CLI_ROW(json, ...) cli_row((json), (const cli_field[]){__VA_ARGS__}, \
                                   (int)(sizeof((const cli_field[]){__VA_ARGS__}) / sizeof(cli_field)))
/* A plan's description (gdn_plan_describe and the layers' _plan_describe); zeroed for a NULL plan. */
gdn_plan_info cli_plan(const gdn_plan *p);
gdn_layer_plan_info cli_layer_plan(const gdn_layer_plan *p);
gdn_attn_plan_info cli_attn_plan(const gdn_attn_plan *p);
gdn_moe_plan_info cli_moe_plan(const gdn_moe_plan *p);
/* gdn_bench_bf16's description of BF16 path `path` (0: this CPU's), its peak measured on
 * `threads` threads when threads >= 1 (a refused path: zeroed, as the call leaves it). */
gdn_bf16_path_info cli_bf16(int path, int threads);
/* This machine's BF16 instruction peak on `path` with `threads` threads
 * (gdn_bench_bf16's peak_gflops), printed as a JSON row, or as a text line ending in `note` (NULL:
 * no text line). */
double cli_bf16_peak(int path, int threads, int json, const char *note);
/* Both peaks of a benchmark that runs BF16 rows when bf16: the fp32 one (cli_peak_gflops)
 * returned, the BF16 one of this CPU's path (cli_bf16_peak with note) in *bf16_peak, NaN when not
 * bf16. */
double cli_peaks(int threads, int json, int bf16, const char *note, double *bf16_peak);

#endif
