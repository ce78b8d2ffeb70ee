/* gdncp bench moe's pieces shared by its one-rank rows (cmd_bench_moe.c) and its expert-parallel
 * rows (cmd_bench_moe_ep.c): the shapes, the FLOP count, the float64 reference on a few rows. */
#ifndef GDNCP_TOOLS_BENCH_MOE_H
#define GDNCP_TOOLS_BENCH_MOE_H

#include <stdint.h>

#include "gdncp.h"

typedef struct {
    const char *label;
    int64_t E, n, k, I, Is;
} moe_shape;

/* Qwen3.5-35B-A3B's, Qwen3-Next's, and a small one for --quick. */
extern const moe_shape bench_moe_shapes[3];

typedef struct {
    int json, quick, threads, reps, compute_mask;
    double peak, bf16_peak;
    const char *cpu;
} bench_opts;

/* The command line's options. */
typedef struct {
    int json, quick, threads, reps, compute_mask;
    int shape; /* bit 0: 35b, bit 1: next */
    int64_t *Ts, nT;
    int64_t ep;
} bench_moe_cli;

/* FLOPs of one token's forward: 2 k 3 E I (routed) + 2 3 E Is (shared) + 2 E n (router). */
double bench_moe_flops_per_token(const moe_shape *s);
/* The float64 reference block on the first tp rows of x (w: the whole block's weights). */
int bench_moe_reference_rows(const gdn_moe_config *cfg, const float *w, const float *x, int64_t tp, double *yref);
/* The expert-parallel rows (under mpiexec, --ep > 1). */
int bench_moe_ep(const bench_moe_cli *c, int reps_set);

#endif
