/* The layer over ranks against the single-rank layer: every strategy, uneven shards including
 * shards shorter than the conv's halo (a rank's halo then spans several predecessors), forward
 * and backward in both memory modes, with the halo and its gradient dropped as negative
 * controls injected into the real exchange. */
#include "cp_internal.h"
#include "cp_util.h"
#include "harness.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Rounding only: the single-rank and split runs differ in summation order. */
#define TOL_LAYER_CP 2e-5

static int rank, D;

/* The first token of this rank's shard; *T the whole sequence's length. */
static int64_t shard_start(const int64_t *sizes, int64_t *T) {
    int64_t t0 = 0;
    *T = 0;
    for (int r = 0; r < D; r++) {
        if (r < rank) t0 += sizes[r];
        *T += sizes[r];
    }
    return t0;
}

/* One layer call over ranks: forward and backward of the local plan `loc` under `strategy` with
 * `fault` injected, the weight gradient summed over ranks into dwsum. Returns this rank's status
 * (*any: the worst over ranks). Plan and context are made and freed here. */
static int layer_cp_run(const gdn_layer_config *loc, int strategy, int fault, float *y, float *dx, float *dw,
                        float *dwsum, size_t nw, const float *xl, const float *w, const float *dyl, int *any) {
    gdn_layer_plan *lp = NULL;
    gdn_cp *cp = NULL;
    gdn_layer_config with = *loc;
    with.cp = strategy;
    int rc = gdn_layer_plan_create(&lp, &with);
    if (!rc) rc = gdn_cp_create(&cp, MPI_COMM_WORLD);
    float *saved = lp ? malloc(sizeof(float) * (gdn_layer_saved_floats(lp) + 1)) : NULL;
    if (cp) test_mutation = cp_site[fault];
    if (!rc) rc = gdn_layer_cp_forward(cp, lp, y, saved, xl, w);
    if (!rc) rc = gdn_layer_cp_backward(cp, lp, dx, dw, xl, w, saved, dyl);
    if (!rc) rc = MPI_Allreduce(dw, dwsum, (int)nw, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    *any = rc;
    MPI_Allreduce(&rc, any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    free(saved);
    test_mutation = NULL;
    gdn_cp_destroy(cp);
    gdn_layer_plan_destroy(lp);
    return rc;
}

/* One layer case: shard sizes per rank; runs every strategy (heads where D divides Hk). */
static void layer_cp_case(const char *label, gdn_layer_config full, const int64_t *sizes) {
    const int64_t B = full.B, E = full.E;
    int64_t T;
    const int64_t t0 = shard_start(sizes, &T);
    const int64_t tn = sizes[rank];
    full.T = T, full.threads = 1;
    const size_t nw = gdn_layer_param_floats(&full);
    rng_seed(99);
    float *w = layer_random_weights(&full, 0.05, 1.0); /* mild gates: the state carries far */
    float *x = malloc(sizeof(float) * B * T * E), *dy = malloc(sizeof(float) * B * T * E);
    for (int64_t i = 0; i < B * T * E; i++) x[i] = (float)rng_uniform(-1, 1), dy[i] = (float)rng_uniform(-1, 1);
    /* the single-rank layer on the whole sequence (every rank: small shapes) */
    float *y1 = malloc(sizeof(float) * B * T * E), *dx1 = malloc(sizeof(float) * B * T * E),
          *dw1 = malloc(sizeof(float) * nw);
    gdn_layer_plan *lp1;
    if (gdn_layer_plan_create(&lp1, &full) || gdn_layer_forward(lp1, y1, NULL, x, w, NULL, NULL) ||
        gdn_layer_backward(lp1, dx1, dw1, x, w, NULL, dy)) {
        check(0, "%s: single-rank layer: %s", label, gdn_errmsg());
        return;
    }
    gdn_layer_plan_destroy(lp1);
    float *yr = rows_of(y1, B, T, t0, tn, E), *dxr = rows_of(dx1, B, T, t0, tn, E);
    float *xl = rows_of(x, B, T, t0, tn, E), *dyl = rows_of(dy, B, T, t0, tn, E);
    gdn_layer_config loc = full;
    loc.T = tn;
    float *y = malloc(sizeof(float) * B * tn * E), *dx = malloc(sizeof(float) * B * tn * E),
          *dw = malloc(sizeof(float) * nw), *dwsum = malloc(sizeof(float) * nw);
    for (int strategy = 0; strategy < 4; strategy++) {
        if (strategy == GDN_CP_HEADS && full.Hk % D) continue; /* not run, not counted */
        for (int keep = 0; keep < 2; keep++)
            for (int fault = 0; fault < 3; fault++) {
                if (fault && (keep || strategy != GDN_CP_SCAN || D == 1)) continue;
                loc.keep = keep;
                int any;
                const int rc = layer_cp_run(&loc, strategy,
                                            fault == 1 ? CP_FAULT_DROP_HALO : fault == 2 ? CP_FAULT_DROP_HALO_GRAD : 0,
                                            y, dx, dw, dwsum, nw, xl, w, dyl, &any);
                char what[200];
                snprintf(what, sizeof what, "%s D=%d %s %s", label, D, gdn_cp_strategy_name(strategy),
                         keep ? "keep-proj" : "keep-min");
                if (any) {
                    check(0, "%s: %s", what, rc ? gdn_errmsg() : "failed on another rank");
                } else if (fault == 1) {
                    expect_far(err_over_ranks(y, yr, B * tn * E), TOL_LAYER_CP, "%s y with the conv halo dropped", what);
                } else if (fault == 2) {
                    expect_close(err_over_ranks(y, yr, B * tn * E), TOL_LAYER_CP, "%s y (halo gradient dropped)", what);
                    expect_far(err_over_ranks(dx, dxr, B * tn * E), TOL_LAYER_CP, "%s dx with the halo gradient dropped", what);
                } else {
                    expect_close(err_over_ranks(y, yr, B * tn * E), TOL_LAYER_CP, "%s y", what);
                    expect_close(err_over_ranks(dx, dxr, B * tn * E), TOL_LAYER_CP, "%s dx", what);
                    double worst = 0;
                    for (int i = 0; i < GDN_P_COUNT; i++)
                        worst = fmax(worst, err_over_ranks(dwsum + gdn_layer_param_offset(&full, i),
                                                           dw1 + gdn_layer_param_offset(&full, i),
                                                           (int64_t)gdn_layer_param_numel(&full, i)));
                    expect_close(worst, TOL_LAYER_CP, "%s every weight gradient (summed over ranks), worst", what);
                }
            }
    }
    free(w), free(x), free(dy), free(y1), free(dx1), free(dw1), free(yr), free(dxr), free(xl), free(dyl);
    free(y), free(dx), free(dw), free(dwsum);
}

/* The layer in BF16 compute over ranks: every rank replays its shard's chunk products in bf16
 * from the incoming state that the fp32 summaries composed, so the split run is not the one-rank
 * BF16 run's rounding: both are checked against the fp32 one-rank layer, norm-wise, within
 * TOL_BF16 (the mode's accuracy; the worst printed), and against each other within the same
 * bound, except head-parallel, whose ranks run the one-rank products on whole sequences: equal
 * to the one-rank BF16 layer within TOL_LAYER_CP. Control through the first check: the incoming
 * state dropped (D > 1; the scan). */
#define TOL_BF16 5e-2
static void layer_cp_bf16_case(const char *label, gdn_layer_config full, const int64_t *sizes) {
    const int64_t B = full.B, E = full.E;
    int64_t T;
    const int64_t t0 = shard_start(sizes, &T);
    const int64_t tn = sizes[rank], nx = B * T * E, nl = B * tn * E;
    full.T = T, full.threads = 1;
    const size_t nw = gdn_layer_param_floats(&full);
    rng_seed(98);
    float *w = layer_random_weights(&full, 0.05, 0.1); /* weak gates: the state carries across shards */
    float *x = malloc(sizeof(float) * nx), *dy = malloc(sizeof(float) * nx);
    for (int64_t i = 0; i < nx; i++) x[i] = (float)rng_uniform(-1, 1), dy[i] = (float)rng_uniform(-1, 1);
    /* one rank's layer in fp32 (the reference) and in BF16, on the whole sequence */
    float *y1[2], *dx1[2], *dw1[2];
    for (int m = 0; m < 2; m++) {
        gdn_layer_config c1 = full;
        c1.compute = m ? GDN_COMPUTE_BF16 : GDN_COMPUTE_FP32;
        y1[m] = malloc(sizeof(float) * nx), dx1[m] = malloc(sizeof(float) * nx), dw1[m] = malloc(sizeof(float) * nw);
        gdn_layer_plan *lp1 = NULL;
        if (gdn_layer_plan_create(&lp1, &c1) || gdn_layer_forward(lp1, y1[m], NULL, x, w, NULL, NULL) ||
            gdn_layer_backward(lp1, dx1[m], dw1[m], x, w, NULL, dy)) {
            check(0, "%s: single-rank layer: %s", label, gdn_errmsg());
            return;
        }
        gdn_layer_plan_destroy(lp1);
    }
    float *yr[2], *dxr[2];
    for (int m = 0; m < 2; m++) yr[m] = rows_of(y1[m], B, T, t0, tn, E), dxr[m] = rows_of(dx1[m], B, T, t0, tn, E);
    float *xl = rows_of(x, B, T, t0, tn, E), *dyl = rows_of(dy, B, T, t0, tn, E);
    gdn_layer_config loc = full;
    loc.T = tn, loc.compute = GDN_COMPUTE_BF16;
    float *y = malloc(sizeof(float) * nl), *dx = malloc(sizeof(float) * nl), *dw = malloc(sizeof(float) * nw),
          *dwsum = malloc(sizeof(float) * nw);
    double worst = 0;
    for (int strategy = 0; strategy < 4; strategy++) {
        if (strategy == GDN_CP_HEADS && full.Hk % D) continue; /* not run, not counted */
        for (int fault = 0; fault < 2; fault++) {
            if (fault && (strategy != GDN_CP_SCAN || D == 1)) continue;
            int any;
            const int rc = layer_cp_run(&loc, strategy, fault ? CP_FAULT_DROP_INCOMING : 0, y, dx, dw, dwsum, nw, xl,
                                        w, dyl, &any);
            char what[200];
            snprintf(what, sizeof what, "%s D=%d %s", label, D, gdn_cp_strategy_name(strategy));
            if (any) {
                check(0, "%s: %s", what, rc ? gdn_errmsg() : "failed on another rank");
            } else if (fault) {
                expect_far(l2_err_over_ranks(y, yr[0], nl), TOL_BF16, "%s y with the incoming state dropped, vs fp32", what);
            } else {
                for (int m = 0; m < 2; m++) {
                    const char *vs = m ? "vs the one-rank BF16 layer" : "vs the one-rank fp32 layer";
                    const double tol = m && strategy == GDN_CP_HEADS ? TOL_LAYER_CP : TOL_BF16;
                    double e = l2_err_over_ranks(y, yr[m], nl);
                    expect_close(e, tol, "%s y %s", what, vs);
                    worst = fmax(worst, e);
                    e = l2_err_over_ranks(dx, dxr[m], nl);
                    expect_close(e, tol, "%s dx %s", what, vs);
                    worst = fmax(worst, e);
                    double ew = 0; /* dwsum is the same on every rank: summing over ranks keeps the ratio */
                    for (int i = 0; i < GDN_P_COUNT; i++)
                        ew = fmax(ew, l2_err_over_ranks(dwsum + gdn_layer_param_offset(&full, i),
                                                   dw1[m] + gdn_layer_param_offset(&full, i),
                                                   (int64_t)gdn_layer_param_numel(&full, i)));
                    expect_close(ew, tol, "%s every weight gradient (summed over ranks) %s, worst", what, vs);
                    worst = fmax(worst, ew);
                }
            }
        }
    }
    if (!tests_quiet && rank == 0) printf("      %s D=%d: worst norm-wise error %.2e\n", label, D, worst);
    for (int m = 0; m < 2; m++) free(y1[m]), free(dx1[m]), free(dw1[m]), free(yr[m]), free(dxr[m]);
    free(w), free(x), free(dy), free(xl), free(dyl), free(y), free(dx), free(dw), free(dwsum);
}

/* Ranks that disagree on the layer call stop together with one message (no hang). */
static void layer_cp_disagree(void) {
    if (D < 2) return;
    gdn_layer_config c = gdn_layer_config_default(1, 5, 16, 2, 4, 8, 6);
    c.threads = 1;
    rng_seed(5);
    float *w = layer_random_weights(&c, 0.05, 1.0);
    float *x = malloc(sizeof(float) * 5 * 16), *y = malloc(sizeof(float) * 5 * 16), *dx = malloc(sizeof(float) * 5 * 16);
    float *dw = malloc(sizeof(float) * gdn_layer_param_floats(&c));
    for (int i = 0; i < 5 * 16; i++) x[i] = (float)rng_uniform(-1, 1);
    gdn_layer_plan *lp;
    gdn_cp *cp;
    gdn_layer_plan_create(&lp, &c);
    gdn_cp_create(&cp, MPI_COMM_WORLD);
    float *saved = malloc(sizeof(float) * (gdn_layer_saved_floats(lp) + 1));
    int rc = gdn_layer_cp_forward(cp, lp, y, saved, x, w), ok, all;
    const struct { const char *what, *needle; } cases[] = {
        {"layer backward with saved states on rank 0 only", "saved given"},
        {"layer forward on rank 0, backward on the others", "the layer call"},
    };
    for (int i = 0; i < 2 && !rc; i++) {
        int r = i == 0 ? gdn_layer_cp_backward(cp, lp, dx, dw, x, w, rank ? NULL : saved, y)
                       : rank ? gdn_layer_cp_backward(cp, lp, dx, dw, x, w, saved, y)
                              : gdn_layer_cp_forward(cp, lp, y, saved, x, w);
        ok = r == GDN_ERR_MPI && strstr(gdn_errmsg(), cases[i].needle);
        MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
        check(all, "%s: every rank returns an error naming %s (\"%s\")", cases[i].what, cases[i].needle, gdn_errmsg());
    }
    /* a NULL layer plan on rank 1 only: every rank returns an error, forward and backward (the
     * control: the same calls with every plan succeed) */
    for (int i = 0; i < 4 && !rc; i++) {
        gdn_layer_plan *mine = i < 2 && rank == 1 ? NULL : lp;
        const int bwd = i % 2;
        int r = bwd ? gdn_layer_cp_backward(cp, mine, dx, dw, x, w, saved, y) : gdn_layer_cp_forward(cp, mine, y, saved, x, w);
        ok = i < 2 ? r != GDN_OK && strstr(gdn_errmsg(), rank == 1 ? "layer plan is NULL" : "rank 1") != NULL : r == GDN_OK;
        MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
        check(all, "layer %s with %s: every rank returns %s (\"%s\")", bwd ? "backward" : "forward",
              i < 2 ? "a NULL layer plan on rank 1" : "every plan (control)", i < 2 ? "an error naming rank 1" : "ok",
              r ? gdn_errmsg() : "ok");
    }
    if (rc) check(0, "layer disagreement setup: %s", gdn_errmsg());
    gdn_cp_destroy(cp);
    gdn_layer_plan_destroy(lp);
    free(w), free(x), free(y), free(dx), free(dw), free(saved);
}

void test_layer_cp(void) {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &D);
    int64_t *sizes = malloc(sizeof(int64_t) * D);
    gdn_layer_config c = gdn_layer_config_default(2, 0, 16, 2, 4, 8, 6);
    /* 1- and 2-token shards between longer ones: halos span up to three predecessors */
    for (int r = 0; r < D; r++) sizes[r] = r % 3 == 1 ? 1 : r % 3 == 2 ? 2 : 9 + r;
    layer_cp_case("layer, shards 9/1/2/..", c, sizes);
    for (int r = 0; r < D; r++) sizes[r] = 1; /* every shard shorter than the halo */
    c.Kc = 5;
    layer_cp_case("layer, one token per rank, Kc=5", c, sizes);
    /* BF16: shards over two chunks and ragged, products above 16 rows */
    gdn_layer_config cb = gdn_layer_config_default(1, 0, 32, 2, 4, 16, 16);
    cb.chunk = 16;
    for (int r = 0; r < D; r++) sizes[r] = 24 + 5 * r;
    layer_cp_bf16_case("bf16 layer, shards 24/29/..", cb, sizes);
    free(sizes);
    layer_cp_disagree();
}
