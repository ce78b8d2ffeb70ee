/* The language model with its sequence split over the ranks against the same model on one
 * rank (every rank computes that reference itself): loss and every weight gradient, uneven
 * shards, each strategy with an incoming state; negative controls: the incoming state dropped
 * and the conv halo dropped, injected into the real exchange, must change the loss. */
#include "harness.h"

#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gdncp/train.h"

/* Rounding only (summation order differs between the split and single runs). */
#define TOL_MODEL_CP 2e-5

static double model_cp_run(gdn_cp *cp, const gdn_model_config *c, const float *w, float *dw,
                           const uint8_t *tok, int64_t B, int64_t T, int64_t t0, int64_t tn,
                           int recompute, int fault) {
    gdn_model_run r = {.B = B, .T = tn, .threads = 1, .recompute = recompute, .check_finite = 1};
    gdn_model_plan *p = NULL;
    int rc = gdn_model_plan_create(&p, c, &r, cp);
    uint8_t *mine = malloc((size_t)(B * (tn + 1)));
    for (int64_t b = 0; b < B; b++) memcpy(mine + b * (tn + 1), tok + b * (T + 1) + t0, (size_t)(tn + 1));
    double ls = NAN, total = NAN;
    gdn_cp_set_fault(cp, fault);
    if (!rc) rc = dw ? model_train_step(p, w, dw, mine, (double)(B * T), &ls)
                     : gdn_model_forward(p, w, mine, (double)(B * T), &ls, 0);
    gdn_cp_set_fault(cp, GDN_CP_FAULT_NONE);
    if (rc) ls = NAN;
    MPI_Allreduce(&ls, &total, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    if (dw) MPI_Allreduce(MPI_IN_PLACE, dw, (int)gdn_model_param_floats(c), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    free(mine);
    gdn_model_plan_destroy(p);
    return total;
}

/* Packed documents over the ranks (each row its own packed stream, one layer call per row)
 * against the packed model on one rank (itself tested against documents run alone): document
 * starts at a rank cut and one token either side, one-token documents, a row that is one
 * document over every rank. Negative control: the incoming state dropped. */
static double packed_cp_run(gdn_cp *cp, const gdn_model_config *c, const float *w, float *dw,
                            const uint8_t *tok, int64_t B, int64_t T, int64_t t0, int64_t tn,
                            const int64_t *cu, const int64_t *nd, double denom, int fault) {
    gdn_model_run r = {.B = B, .T = tn, .threads = 1, .check_finite = 1, .pack = 1};
    gdn_model_plan *p = NULL;
    int rc = gdn_model_plan_create(&p, c, &r, cp);
    uint8_t *mine = malloc((size_t)(B * (tn + 1)));
    for (int64_t b = 0; b < B; b++) memcpy(mine + b * (tn + 1), tok + b * (T + 1) + t0, (size_t)(tn + 1));
    double ls = NAN, total = NAN;
    int64_t targets = 0;
    if (!rc) rc = gdn_model_set_docs(p, cu, nd, t0, &targets);
    gdn_cp_set_fault(cp, fault);
    if (!rc) rc = model_train_step(p, w, dw, mine, denom, &ls);
    gdn_cp_set_fault(cp, GDN_CP_FAULT_NONE);
    if (rc) ls = NAN, check(0, "packed model step over ranks: %s", gdn_errmsg());
    MPI_Allreduce(&ls, &total, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, dw, (int)gdn_model_param_floats(c), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    free(mine);
    gdn_model_plan_destroy(p);
    return total;
}

static void test_model_cp_packed(const gdn_model_config *c, const float *w, const uint8_t *tok, int64_t B,
                                 int64_t T, int64_t t0, int64_t tn, int D) {
    /* row 0: starts at 1, around the first and last rank cuts, and at the last target; row 1:
     * one document */
    const int64_t want[] = {1, 22, 23, 24, 23 * (D - 1), 23 * (D - 1) + 1, T};
    int64_t cu[16], nd[2] = {0, 1};
    cu[0] = 0;
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        if (want[i] > cu[nd[0]] && want[i] <= T) cu[++nd[0]] = want[i];
    cu[++nd[0]] = T + 1;
    cu[nd[0] + 1] = 0, cu[nd[0] + 2] = T + 1;
    const size_t nw = gdn_model_param_floats(c);
    float *dw = aligned_alloc(64, sizeof(float) * nw), *dw_ref = aligned_alloc(64, sizeof(float) * nw);
    const double denom = (double)(B * T);
    double ref = NAN;
    {
        const gdn_model_run r = {.B = B, .T = T, .threads = 1, .check_finite = 1, .pack = 1};
        gdn_model_plan *p = NULL;
        int64_t targets = 0;
        if (!gdn_model_plan_create(&p, c, &r, NULL) && !gdn_model_set_docs(p, cu, nd, 0, &targets))
            model_train_step(p, w, dw_ref, tok, denom, &ref);
        gdn_model_plan_destroy(p);
    }
    const gdn_cp_strategy strategies[] = {GDN_CP_SCAN, GDN_CP_ALLGATHER, GDN_CP_RELAY};
    for (int s = 0; s < 3; s++) {
        gdn_cp *cp = NULL;
        if (gdn_cp_create(&cp, MPI_COMM_WORLD, strategies[s])) continue;
        const char *sn = gdn_cp_strategy_name(strategies[s]);
        double got = packed_cp_run(cp, c, w, dw, tok, B, T, t0, tn, cu, nd, denom, 0);
        expect_close(fabs(got - ref) / fabs(ref), TOL_MODEL_CP, "packed model loss over %d ranks (%s) vs one rank, "
                     "%lld documents", D, sn, (long long)nd[0] + 1);
        expect_close(rel_err_ff(dw, dw_ref, (int64_t)nw), TOL_MODEL_CP,
                     "packed model gradient over %d ranks (%s) vs one rank", D, sn);
        if (D > 1 && !s) {
            packed_cp_run(cp, c, w, dw, tok, B, T, t0, tn, cu, nd, denom, GDN_CP_FAULT_DROP_INCOMING);
            expect_far(rel_err_ff(dw, dw_ref, (int64_t)nw), TOL_MODEL_CP,
                       "packed model gradient over %d ranks with the incoming state dropped", D);
        }
        gdn_cp_destroy(cp);
    }
    free(dw), free(dw_ref);
}

void test_model_cp(void) {
    int rank, D;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &D);
    const gdn_model_config c = {.vocab = 256, .E = 32, .L = 2, .I = 48, .Hk = 1, .Hv = 2, .K = 16, .V = 16, .Kc = 4, .eps = 1e-6f};
    const int64_t B = 2, T = 23 * D + 5; /* uneven: the last rank gets 5 more */
    const size_t nw = gdn_model_param_floats(&c);
    float *w = aligned_alloc(64, sizeof(float) * nw), *dw_ref = aligned_alloc(64, sizeof(float) * nw);
    float *dw = aligned_alloc(64, sizeof(float) * nw);
    gdn_model_init(&c, w, 21);
    /* slow gates (A small), so the state carried across ranks matters */
    gdn_model_tensor_info t;
    for (int i = 0; i < gdn_model_tensor_count(&c); i++) {
        gdn_model_tensor(&c, i, &t);
        if (strstr(t.name, "A_log")) for (size_t k = 0; k < t.numel; k++) w[t.offset + k] = -3.0f;
        if (t.ndim == 2) for (size_t k = 0; k < t.numel; k++) w[t.offset + k] *= 10.0f;
    }
    uint8_t *tok = malloc((size_t)(B * (T + 1)));
    rng_seed(77);
    for (int64_t i = 0; i < B * (T + 1); i++) tok[i] = (uint8_t)(97 + (int)rng_uniform(0, 8));
    /* the single-rank reference, computed on every rank */
    double ref = NAN;
    {
        gdn_model_run r = {.B = B, .T = T, .threads = 1, .recompute = 0, .check_finite = 1};
        gdn_model_plan *p = NULL;
        if (!gdn_model_plan_create(&p, &c, &r, NULL)) model_train_step(p, w, dw_ref, tok, (double)(B * T), &ref);
        gdn_model_plan_destroy(p);
    }
    const int64_t t0 = 23 * rank, tn = rank == D - 1 ? 28 : 23;
    const gdn_cp_strategy strategies[] = {GDN_CP_SCAN, GDN_CP_ALLGATHER, GDN_CP_RELAY};
    for (int s = 0; s < 3; s++) {
        gdn_cp *cp = NULL;
        if (gdn_cp_create(&cp, MPI_COMM_WORLD, strategies[s])) {
            check(0, "gdn_cp_create: %s", gdn_errmsg());
            continue;
        }
        const char *sn = gdn_cp_strategy_name(strategies[s]);
        for (int recompute = 0; recompute < 2; recompute++) {
            if (recompute && s) continue; /* recompute is strategy-independent: once */
            const double got = model_cp_run(cp, &c, w, dw, tok, B, T, t0, tn, recompute, 0);
            expect_close(fabs(got - ref) / fabs(ref), TOL_MODEL_CP,
                         "model loss over %d ranks (%s%s) vs one rank, B=2 T=%lld", D, sn,
                         recompute ? ", recompute" : "", (long long)T);
            expect_close(rel_err_ff(dw, dw_ref, (int64_t)nw), TOL_MODEL_CP,
                         "model gradient over %d ranks (%s%s) vs one rank", D, sn, recompute ? ", recompute" : "");
        }
        if (D > 1) {
            const double dropped = model_cp_run(cp, &c, w, NULL, tok, B, T, t0, tn, 0, GDN_CP_FAULT_DROP_INCOMING);
            expect_far(fabs(dropped - ref) / fabs(ref), TOL_MODEL_CP,
                       "model loss over %d ranks (%s) with the incoming state dropped", D, sn);
            if (!s) {
                const double nohalo = model_cp_run(cp, &c, w, NULL, tok, B, T, t0, tn, 0, GDN_CP_FAULT_DROP_HALO);
                expect_far(fabs(nohalo - ref) / fabs(ref), TOL_MODEL_CP,
                           "model loss over %d ranks with the conv halo dropped", D);
            }
        }
        gdn_cp_destroy(cp);
    }
    test_model_cp_packed(&c, w, tok, B, T, t0, tn, D);
    free(w), free(dw), free(dw_ref), free(tok);
}
