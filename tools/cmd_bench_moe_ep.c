/* mpiexec -n N gdncp bench moe --ep N: the sparse MoE block with its experts split over the N ranks
 * (gdn_moe_ep_*, ep.h, DESIGN §14), each rank with its own T token rows, against the one-rank block
 * on the same rows (every rank holding every expert), forward and forward + backward, fp32.
 *
 * The two sides alternate rep by rep (which goes first too), each run between barriers; a run's
 * time is the slowest rank's. Per EP run each rank reads its group's counters (gdn_ep_get_stats):
 * the time inside the all-to-alls (the counts, the statuses, the rows both ways, waiting for the
 * slowest included), the bytes it sent and received, the time of the GEMMs on the rows its experts
 * own, and those rows (the imbalance: the busiest rank's over the mean). GFLOP/s count the rank's
 * own tokens' FLOPs (the one-rank block's formula, bench_moe_flops_per_token) over the slowest
 * rank's time; the fraction is of the fp32 peak every rank measures at once before the runs (the
 * ranks share the machine's cores). Errors: y of the EP block against the one-rank block on every
 * rank (the largest), and rank 0's first rows against the float64 reference. */
#include "cli/cli.h"
#include "commands.h"
#include "cli/parse.h"
#include "bench_moe.h"

#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gdncp/cp.h"
#include "gdncp/ep.h"

enum { SIDE_EP, SIDE_ONE, MODE_FWD = 0, MODE_FWD_BWD = 1 };

typedef struct {
    int rank, D, threads, reps, json;
    const char *cpu;
    double peak;
    gdn_ep *ep;
} ep_bench;

static double max_over(double v) {
    double m = v;
    MPI_Allreduce(&v, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return m;
}

static double mean_over(double v, int D) {
    double s = v;
    MPI_Allreduce(&v, &s, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    return s / D;
}

/* This rank's slice of the whole block's weights (the router and the shared expert whole). */
static void slice_weights(const gdn_moe_config *whole, const gdn_moe_config *mine, const float *w, float *wl) {
    int64_t first = 0;
    const int64_t count = gdn_moe_local_experts(mine, &first);
    for (int i = 0; i < GDN_MOE_COUNT; i++) {
        gdn_param_info pm, pw;
        if (gdn_moe_param(mine, i, &pm) || gdn_moe_param(whole, i, &pw)) return;
        const size_t ne = pm.numel;
        const int expert = i == GDN_MOE_GATE_UP || i == GDN_MOE_DOWN;
        const size_t skip = expert ? (size_t)first * (ne / (size_t)count) : 0;
        memcpy(wl + pm.offset, w + pw.offset + skip, sizeof(float) * ne);
    }
}

static int bench_T(const ep_bench *b, const moe_shape *s, int64_t T) {
    gdn_moe_config one = gdn_moe_config_default(T, s->E, s->n, s->k, s->I, s->Is), mine = one;
    one.threads = mine.threads = b->threads;
    int rc = gdn_ep_moe_config(b->ep, &mine);
    const size_t nw = gdn_moe_param_floats(&one), nwl = gdn_moe_param_floats(&mine), nx = (size_t)(T * s->E);
    const int64_t tp = T < 4 ? T : 4; /* the reference's rows */
    float *w = rc ? NULL : calloc(nw, sizeof(float)), *wl = malloc(sizeof(float) * nwl);
    float *dw = malloc(sizeof(float) * nw), *x = malloc(sizeof(float) * nx), *dy = malloc(sizeof(float) * nx);
    float *y[2] = {malloc(sizeof(float) * nx), malloc(sizeof(float) * nx)}, *dx = malloc(sizeof(float) * nx);
    double *yref = malloc(sizeof(double) * (size_t)(tp * s->E));
    gdn_moe_plan *p[2] = {NULL, NULL};
    float *saved[2] = {NULL, NULL};
    const int R = b->reps;
    /* every rank of this node holds the whole block (the one-rank side), its slice and a gradient
     * of the whole block's size, the rows' buffers of both sides (about 12 floats a row each way
     * per unit of E, the experts' received rows as many again) and the reference's touched weights */
    const double per_rank = 4.0 * (2.0 * (double)nw + (double)nwl) +
                            4.0 * (double)(T * s->k) * (12.0 * (double)s->E + 8.0 * (double)s->I);
    char what[160];
    snprintf(what, sizeof what, "bench moe --ep %d at T = %lld per rank: the whole block beside its slice on every rank",
             b->D, (long long)T);
    if (!rc) rc = gdn_check_fits(what, 1.25 * per_rank * b->D); /* (all ranks on this node; a quarter more for the rest) */
    double *t = malloc(sizeof(double) * 2 * 2 * (size_t)R), *xs = malloc(sizeof(double) * 4 * 2 * (size_t)R);
    int no_mem = !rc && (!w || !wl || !dw || !x || !dy || !y[0] || !y[1] || !dx || !yref || !t || !xs);
    if (no_mem) rc = GDN_ERR_NOMEM;
    if (!rc) {
        for (int i = 0; i < GDN_MOE_COUNT; i++) { /* the same weights on every rank */
            const float sd = i == GDN_MOE_ROUTER ? 1.0f / sqrtf((float)s->E) : 0.02f;
            gdn_param_info p;
            if (!gdn_moe_param(&one, i, &p)) cli_fill_normal(w + p.offset, p.numel, sd, 0x5EED0000u + (uint64_t)i);
        }
        slice_weights(&one, &mine, w, wl);
        cli_fill_normal(x, nx, 1.0f, 0xA11CEu + (uint64_t)b->rank); /* each rank its own tokens */
        cli_fill_normal(dy, nx, 1.0f, 0xB0Bu + (uint64_t)b->rank);
        rc = gdn_moe_plan_create(&p[SIDE_EP], &mine);
        if (!rc) rc = gdn_moe_plan_create(&p[SIDE_ONE], &one);
    }
    for (int k = 0; k < 2 && !rc; k++)
        if (!(saved[k] = malloc(sizeof(float) * (cli_moe_plan(p[k]).saved_floats + 1)))) rc = GDN_ERR_NOMEM, no_mem = 1;
    if (!rc && b->rank == 0) rc = bench_moe_reference_rows(&one, w, x, tp, yref);
    /* a rank that could not set up stops them all before any exchange */
    int worst = rc;
    MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (worst) {
        if (rc) fprintf(stderr, "gdncp bench moe --ep: %s T=%lld: %s\n", s->label, (long long)T,
                        no_mem ? "out of memory" : gdn_errmsg());
        rc = worst;
    }
    /* t[mode][side][rep]: the slowest rank's time; xs[mode][what][rep]: this rank's exchange
     * seconds, expert seconds, bytes, rows owned (EP side) */
    for (int mode = MODE_FWD; mode <= MODE_FWD_BWD && !rc; mode++)
        for (int r = 0; r <= R && !rc; r++) /* r = 0 warms up */
            for (int kk = 0; kk < 2 && !rc; kk++) {
                const int side = (r + kk) % 2;
                const float *ww = side == SIDE_EP ? wl : w;
                gdn_ep_get_stats(b->ep, NULL, 1);
                MPI_Barrier(MPI_COMM_WORLD);
                const double t0 = MPI_Wtime();
                float *sv = mode == MODE_FWD_BWD ? saved[side] : NULL;
                rc = side == SIDE_EP ? gdn_moe_ep_forward(b->ep, p[side], y[side], sv, x, ww, NULL)
                                     : gdn_moe_forward(p[side], y[side], sv, x, ww, NULL, NULL, NULL);
                if (!rc && mode == MODE_FWD_BWD)
                    rc = side == SIDE_EP ? gdn_moe_ep_backward(b->ep, p[side], dx, dw, x, ww, sv, dy, NULL)
                                         : gdn_moe_backward(p[side], dx, dw, x, ww, sv, dy, NULL);
                const double dt = max_over(MPI_Wtime() - t0);
                if (rc || !r) continue;
                t[(mode * 2 + side) * R + r - 1] = dt;
                if (side == SIDE_EP) {
                    gdn_ep_stats st;
                    gdn_ep_get_stats(b->ep, &st, 0);
                    const double v[4] = {st.exchange_s, st.experts_s, st.bytes_sent + st.bytes_recv,
                                         st.rows_owned / (double)st.calls};
                    for (int q = 0; q < 4; q++) xs[(mode * 4 + q) * R + r - 1] = v[q];
                }
            }
    if (rc && !worst) fprintf(stderr, "gdncp bench moe --ep: %s T=%lld: %s\n", s->label, (long long)T, gdn_errmsg());
    if (!rc) {
        /* the last runs of each side were forward + backward on the same rows: y of both */
        const double e_one = max_over(cli_rel_err_f32(y[SIDE_EP], y[SIDE_ONE], T * s->E));
        const double e_ref = b->rank == 0 ? cli_rel_err(y[SIDE_EP], yref, tp * s->E) : 0;
        for (int mode = MODE_FWD; mode <= MODE_FWD_BWD; mode++) {
            const double flops = (mode == MODE_FWD_BWD ? 3.0 : 1.0) * (double)T * bench_moe_flops_per_token(s);
            const double ms_ep = 1e3 * cli_median(t + (mode * 2 + SIDE_EP) * R, R);
            const double ms_one = 1e3 * cli_median(t + (mode * 2 + SIDE_ONE) * R, R);
            const double ex = 1e3 * cli_median(xs + (mode * 4 + 0) * R, R), gm = 1e3 * cli_median(xs + (mode * 4 + 1) * R, R);
            const double by = cli_median(xs + (mode * 4 + 2) * R, R), rows = cli_median(xs + (mode * 4 + 3) * R, R);
            const double ex_max = max_over(ex), ex_mean = mean_over(ex, b->D), gm_max = max_over(gm),
                         gm_mean = mean_over(gm, b->D), by_mean = mean_over(by, b->D), rows_max = max_over(rows),
                         rows_mean = mean_over(rows, b->D);
            if (b->rank) continue;
            const double gf = flops / (ms_ep * 1e-3) / 1e9;
            CLI_ROW(b->json, CLI_S("direction", "%s", "%-14s", mode ? "moe_ep_fwd_bwd" : "moe_ep_forward"),
                    CLI_S("shape", "%s", " %-7s", s->label), CLI_I("E", "%lld", NULL, s->E),
                    CLI_I("n_experts", "%lld", NULL, s->n), CLI_I("top_k", "%lld", NULL, s->k),
                    CLI_I("I", "%lld", NULL, s->I), CLI_I("Is", "%lld", NULL, s->Is),
                    CLI_I("ranks", "%lld", " ep=%lld", b->D), cli_at(CLI_I("T_per_rank", "%lld", " T=%-5lld", T), 2),
                    CLI_I("threads", "%lld", " thr=%lld", b->threads), CLI_I("reps", "%lld", NULL, R),
                    CLI_F("ms", "%.3f", " %8.1f ms", ms_ep), CLI_F("ms_ep1", "%.3f", " (ep 1: %.1f ms,", ms_one),
                    CLI_F("speedup_vs_ep1", "%.3f", " %.2fx)", ms_one / ms_ep),
                    CLI_F("exchange_ms_max", "%.3f", "  all-to-all %.1f ms", ex_max),
                    CLI_F("exchange_ms_mean", "%.3f", NULL, ex_mean),
                    cli_x(CLI_F("exchange_fraction", "%.4f", " (%.1f %% of the block)", ex_max / ms_ep), 100),
                    cli_x(CLI_F("bytes_per_rank", "%.0f", " %.1f MB/rank", by_mean), 1e-6),
                    CLI_F("expert_gemm_ms_max", "%.3f", "  experts %.1f", gm_max),
                    CLI_F("expert_gemm_ms_mean", "%.3f", "/%.1f ms (max/mean)", gm_mean),
                    CLI_F("imbalance", "%.3f", "  imbalance %.2fx", rows_mean > 0 ? rows_max / rows_mean : 0.0),
                    CLI_F("gflops", "%.3f", "  %.1f GFLOP/s", gf), CLI_F("peak_gflops", "%.3f", NULL, b->peak),
                    cli_x(CLI_F("fraction_of_peak", "%.4f", " %.1f %% of peak", gf / b->peak), 100),
                    CLI_F("rel_err_vs_ep1", "%.3e", "  err %.1e vs ep 1", e_one),
                    CLI_F("rel_err_vs_reference", "%.3e", ", %.1e vs ref", e_ref), CLI_I("ref_rows", "%lld", NULL, tp),
                    CLI_S("gemm_path", "%s", NULL, gdn_compute_path(GDN_COMPUTE_FP32)), CLI_S("cpu", "%s", NULL, b->cpu));
        }
        if (b->rank == 0) fflush(stdout);
    }
    for (int k = 0; k < 2; k++) gdn_moe_plan_destroy(p[k]), free(saved[k]), free(y[k]);
    free(w), free(wl), free(dw), free(x), free(dy), free(dx), free(yref), free(t), free(xs);
    return rc ? 1 : 0;
}

int bench_moe_ep(const bench_moe_cli *c, int reps_set) {
    ep_bench b = {.json = c->json, .reps = c->quick && !reps_set ? 1 : c->reps};
    MPI_Comm_rank(MPI_COMM_WORLD, &b.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &b.D);
    /* the ranks agree on what decides the collectives before any (an MPMD launch may differ) */
    gdn_cp *agree = NULL;
    if (gdn_cp_create(&agree, MPI_COMM_WORLD)) return cli_error("bench moe", GDN_ERR_MPI);
    const int64_t vals[] = {c->ep, c->shape, c->quick, b.reps, c->Ts ? c->nT : 0,
                            gdn_cp_digest(c->Ts, sizeof *c->Ts * (size_t)(c->Ts ? c->nT : 0)), c->threads};
    static const char *const names[] = {"--ep", "the shape", "--quick", "--reps", "the number of --T values",
                                        "--T (a digest)", "--threads"};
    const int arc = gdn_cp_agree_values(agree, vals, (int)(sizeof vals / sizeof vals[0]), names, GDN_OK);
    gdn_cp_destroy(agree);
    if (arc) {
        if (b.rank == 0) cli_error("bench moe", arc);
        return CLI_USAGE_ERROR;
    }
    if (b.D != c->ep) {
        if (b.rank == 0)
            fprintf(stderr, "gdncp bench moe: --ep %lld runs on that many ranks (mpiexec -n %lld), not %d\n",
                    (long long)c->ep, (long long)c->ep, b.D);
        return CLI_USAGE_ERROR;
    }
    const moe_shape *s = c->quick ? &bench_moe_shapes[2] : c->shape & 1 ? &bench_moe_shapes[0] : &bench_moe_shapes[1];
    if (s->n % b.D) {
        if (b.rank == 0) fprintf(stderr, "gdncp bench moe: --ep %d does not divide the %lld experts of %s\n", b.D,
                                 (long long)s->n, s->label);
        return CLI_USAGE_ERROR;
    }
    int64_t T_default = c->quick ? 256 : 4096;
    const int64_t *Ts = c->Ts ? c->Ts : &T_default, nT = c->Ts ? c->nT : 1;
    /* the cores shared by the ranks (one node) unless --threads */
    b.threads = c->threads ? c->threads : cli_max_threads() / b.D > 0 ? cli_max_threads() / b.D : 1;
    b.cpu = cli_cpu();
    b.peak = gdn_measure_peak_gflops(b.threads); /* every rank at once: the cores as the runs share them */
    b.peak = max_over(b.peak) > 0 ? mean_over(b.peak, b.D) : b.peak;
    if (b.rank == 0 && !b.json)
        printf("gdncp bench moe --ep %d — CPU: %s\nshape %s: E %lld, %lld experts (%lld per rank), top %lld, I %lld, "
               "shared %lld; fp32 peak %.1f GFLOP/s per rank (%d threads, all ranks measuring at once); medians of %d "
               "after a warm-up, EP and one-rank blocks alternating, each the slowest rank's time; all-to-all: the "
               "slowest rank's time in the exchanges (waits included), of the EP block's\n",
               b.D, b.cpu, s->label, (long long)s->E, (long long)s->n, (long long)(s->n / b.D), (long long)s->k,
               (long long)s->I, (long long)s->Is, b.peak, b.threads, b.reps);
    int rc = gdn_ep_create(&b.ep, MPI_COMM_WORLD);
    for (int64_t i = 0; i < nT && !rc; i++) rc = bench_T(&b, s, Ts[i]);
    gdn_ep_destroy(b.ep);
    return rc ? 1 : 0;
}
