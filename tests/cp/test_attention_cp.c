/* The gated attention layer over ranks (gdn_attn_cp_*) against the single-rank layer on the
 * whole sequence: both strategies (heads where the head counts allow), uneven shards (a 1-token
 * shard, shards shorter than a tile), dense and packed documents crossing ranks, saved and
 * recomputed backward. Negative controls are faults injected into the real exchange: the
 * earlier ranks' keys and values dropped, their gradients not returned. Bad input and ranks
 * that disagree stop every rank with one message. */
#include "cp_internal.h"
#include "cp_util.h"
#include "harness.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Rounding only: the split runs merge partial softmaxes and sum gradients in another order. */
#define TOL_ATTN_CP 2e-5

static int rank, D;

static int heads_allowed(const gdn_attn_config *c) {
    if (c->H % D) return 0;
    const int64_t Hp = c->H / D, grp = c->H / c->Hkv;
    return Hp % grp == 0 || grp % Hp == 0;
}

static int all_ok(int rc) {
    int any = rc;
    MPI_Allreduce(&rc, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    return !any;
}

/* One case: shard sizes per rank, cu (NULL: dense) over the whole stream. */
static void attn_cp_case(const char *label, gdn_attn_config full, const int64_t *sizes, const int64_t *cu,
                         int64_t n_docs) {
    const int64_t B = full.B, E = full.E;
    int64_t T = 0, t0 = 0;
    for (int r = 0; r < D; r++) {
        if (r < rank) t0 += sizes[r];
        T += sizes[r];
    }
    const int64_t tn = sizes[rank];
    full.T = T, full.threads = 1, full.cu_seqlens = cu, full.n_docs = n_docs;
    const size_t nw = gdn_attn_param_floats(&full);
    rng_seed(4242);
    float *w = malloc(sizeof(float) * nw), *x = malloc(sizeof(float) * B * T * E), *dy = malloc(sizeof(float) * B * T * E);
    for (size_t i = 0; i < nw; i++) w[i] = (float)rng_uniform(-0.3, 0.3);
    for (int64_t i = 0; i < B * T * E; i++) x[i] = (float)rng_uniform(-1, 1), dy[i] = (float)rng_uniform(-1, 1);
    float *y1 = malloc(sizeof(float) * B * T * E), *dx1 = malloc(sizeof(float) * B * T * E), *dw1 = malloc(sizeof(float) * nw);
    gdn_attn_plan *p1 = NULL;
    int rc = gdn_attn_plan_create(&p1, &full);
    if (!rc) rc = gdn_attn_forward(p1, y1, NULL, x, w);
    if (!rc) rc = gdn_attn_backward(p1, dx1, dw1, x, w, NULL, dy);
    gdn_attn_plan_destroy(p1);
    if (!all_ok(rc)) {
        check(0, "%s: single-rank attention: %s", label, gdn_errmsg());
        free(w), free(x), free(dy), free(y1), free(dx1), free(dw1);
        return;
    }
    float *yr = rows_of(y1, B, T, t0, tn, E), *dxr = rows_of(dx1, B, T, t0, tn, E);
    float *xl = rows_of(x, B, T, t0, tn, E), *dyl = rows_of(dy, B, T, t0, tn, E);
    gdn_attn_config loc = full;
    loc.T = tn, loc.seq_offset = t0;
    float *y = malloc(sizeof(float) * B * tn * E), *dx = malloc(sizeof(float) * B * tn * E);
    float *dw = malloc(sizeof(float) * nw), *dwsum = malloc(sizeof(float) * nw);
    for (int strategy = GDN_ATTN_CP_KV; strategy <= GDN_ATTN_CP_HEADS; strategy++) {
        loc.cp = strategy;
        if (strategy == GDN_ATTN_CP_HEADS && !heads_allowed(&loc)) continue; /* refused: errors() checks that */
        const int replicated = strategy == GDN_ATTN_CP_HEADS && D > loc.Hkv;
        for (int keep = 2; keep >= 0; keep--) /* 2: the core's output only; 1: everything; 0: recompute */
            for (int fault = 0; fault < 3; fault++) {
                if (fault && (keep != 1 || D == 1)) continue;
                if (fault == 2 && strategy == GDN_ATTN_CP_HEADS && !replicated) continue; /* nothing to skip */
                gdn_attn_plan *lp = NULL;
                gdn_cp *cp = NULL;
                loc.keep = keep == 2 ? GDN_ATTN_KEEP_CORE : GDN_ATTN_KEEP_ALL;
                rc = gdn_attn_plan_create(&lp, &loc);
                if (!rc) rc = gdn_cp_create(&cp, MPI_COMM_WORLD);
                float *saved = lp && keep ? malloc(sizeof(float) * (gdn_attn_saved_floats(lp) + 1)) : NULL;
                if (cp) test_mutation = cp_site[fault == 1 ? CP_FAULT_ATTN_DROP_KV : fault == 2 ? CP_FAULT_ATTN_DROP_KV_GRAD : 0];
                if (!rc) rc = gdn_attn_cp_forward(cp, lp, y, saved, xl, w);
                if (!rc) rc = gdn_attn_cp_backward(cp, lp, dx, dw, xl, w, saved, dyl);
                if (!rc) rc = MPI_Allreduce(dw, dwsum, (int)nw, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
                char what[200];
                snprintf(what, sizeof what, "%s D=%d %s %s", label, D, gdn_attn_cp_strategy_name(strategy),
                         keep == 2 ? "saved core" : keep ? "saved" : "recomputed");
                if (!all_ok(rc)) {
                    check(0, "%s: %s", what, rc ? gdn_errmsg() : "failed on another rank");
                } else if (fault == 1) {
                    expect_far(err_over_ranks(y, yr, B * tn * E), TOL_ATTN_CP, "%s y with the other ranks' keys dropped", what);
                } else if (fault == 2) {
                    expect_close(err_over_ranks(y, yr, B * tn * E), TOL_ATTN_CP, "%s y (key gradients not returned)", what);
                    expect_far(err_over_ranks(dx, dxr, B * tn * E), TOL_ATTN_CP,
                               "%s dx with the key/value gradients not returned", what);
                } else {
                    expect_close(err_over_ranks(y, yr, B * tn * E), TOL_ATTN_CP, "%s y", what);
                    expect_close(err_over_ranks(dx, dxr, B * tn * E), TOL_ATTN_CP, "%s dx", what);
                    double worst = 0;
                    for (int i = 0; i < GDN_A_COUNT; i++)
                        worst = fmax(worst, err_over_ranks(dwsum + gdn_attn_param_offset(&full, i),
                                                           dw1 + gdn_attn_param_offset(&full, i),
                                                           (int64_t)gdn_attn_param_numel(&full, i)));
                    expect_close(worst, TOL_ATTN_CP, "%s every weight gradient (summed over ranks), worst", what);
                    gdn_cp_stats st = gdn_cp_last_stats(cp);
                    if (D > 1 && strategy == GDN_ATTN_CP_KV && rank == D - 1)
                        check(st.rounds == (keep ? 1 : 2) * (D - 1) && st.bytes_recv > 0,
                              "%s: the last rank's backward attended %d earlier blocks%s (%d rounds, %llu bytes "
                              "received)", what, D - 1, keep ? "" : ", twice (the forward again)", st.rounds,
                              (unsigned long long)st.bytes_recv);
                }
                free(saved);
                test_mutation = NULL;
                gdn_cp_destroy(cp);
                gdn_attn_plan_destroy(lp);
            }
    }
    free(w), free(x), free(dy), free(y1), free(dx1), free(dw1), free(yr), free(dxr), free(xl), free(dyl);
    free(y), free(dx), free(dw), free(dwsum);
}

/* Generation over ranks: a CP prefill of the prompt's shards, then new tokens (one at a time and
 * a piece of 3) with each rank's cache part, against one rank's forward over the whole sequence;
 * the other ranks' cache parts dropped as the control; x differing on one rank and a full cache
 * on the last rank refused everywhere. */
static void attn_cp_generate(const int64_t *sizes) {
    const int64_t B = 2, E = 24, steps[] = {1, 1, 3, 1, 1}, nsteps = 5, added = 7;
    int64_t P = 0, t0 = 0;
    for (int r = 0; r < D; r++) {
        if (r < rank) t0 += sizes[r];
        P += sizes[r];
    }
    const int64_t tn = sizes[rank], T = P + added;
    gdn_attn_config full = gdn_attn_config_default(B, T, E, 8, 2, 16);
    full.R = 8, full.rope_theta = 1e4, full.threads = 1, full.pos_offset = 5;
    const size_t nw = gdn_attn_param_floats(&full);
    rng_seed(777);
    float *w = malloc(sizeof(float) * nw), *x = malloc(sizeof(float) * B * T * E), *y1 = malloc(sizeof(float) * B * T * E);
    for (size_t i = 0; i < nw; i++) w[i] = (float)rng_uniform(-0.3, 0.3);
    for (int64_t i = 0; i < B * T * E; i++) x[i] = (float)rng_uniform(-1, 1);
    gdn_attn_plan *p1 = NULL;
    int rc = gdn_attn_plan_create(&p1, &full);
    if (!rc) rc = gdn_attn_forward(p1, y1, NULL, x, w);
    gdn_attn_plan_destroy(p1);
    float *yr = rows_of(y1, B, T, P, added, E), *xl = rows_of(x, B, T, t0, tn, E), *yp = malloc(sizeof(float) * B * tn * E);
    float *ypr = rows_of(y1, B, T, t0, tn, E), *yn = malloc(sizeof(float) * B * added * E), *ys = malloc(sizeof(float) * B * 3 * E);
    for (int fault = 0; fault < 2 && all_ok(rc); fault++) {
        if (fault && D == 1) break;
        gdn_attn_config pre = full;
        pre.T = tn, pre.seq_offset = t0;
        gdn_attn_plan *pp = NULL, *pd[4] = {NULL};
        gdn_attn_cache *cache = NULL;
        gdn_cp *cp = NULL;
        rc = gdn_attn_plan_create(&pp, &pre);
        for (int64_t k = 1; k <= 3 && !rc; k++) {
            gdn_attn_config dc = full;
            dc.T = k;
            rc = gdn_attn_plan_create(&pd[k], &dc);
        }
        if (!rc) rc = gdn_attn_cache_create(&cache, B, 2, 16, tn + (rank == D - 1 ? added + 1 : 0), GDN_F32);
        if (!rc) rc = gdn_cp_create(&cp, MPI_COMM_WORLD);
        if (!rc) rc = gdn_attn_cp_prefill(cp, pp, cache, yp, xl, w);
        if (cp) test_mutation = cp_site[fault ? CP_FAULT_ATTN_DROP_KV : 0];
        for (int64_t s = 0, at = 0; s < nsteps && !rc; at += steps[s], s++) {
            float *xs = rows_of(x, B, T, P + at, steps[s], E);
            rc = gdn_attn_cp_decode(cp, pd[steps[s]], cache, ys, xs, w);
            for (int64_t b = 0; b < B && !rc; b++)
                memcpy(yn + (b * added + at) * E, ys + b * steps[s] * E, sizeof(float) * steps[s] * E);
            free(xs);
        }
        char what[160];
        snprintf(what, sizeof what, "attention cp generate D=%d (prompt %lld over the ranks, %lld new tokens)", D,
                 (long long)P, (long long)added);
        if (!all_ok(rc)) {
            check(0, "%s: %s", what, rc ? gdn_errmsg() : "failed on another rank");
        } else if (fault) {
            expect_far(err_over_ranks(yn, yr, B * added * E), TOL_ATTN_CP, "%s y with the other ranks' cache parts dropped",
                       what);
        } else {
            expect_close(err_over_ranks(yp, ypr, B * tn * E), TOL_ATTN_CP, "%s prefill y", what);
            expect_close(err_over_ranks(yn, yr, B * added * E), TOL_ATTN_CP, "%s decoded y == the whole forward", what);
            /* refusals: x differing on the last rank, then the last rank's cache full */
            float *xs = rows_of(x, B, T, 0, 1, E);
            const float x3 = xs[3];
            if (rank == D - 1 && D > 1) xs[3] += 1.0f;
            const int r1 = gdn_attn_cp_decode(cp, pd[1], cache, ys, xs, w);
            if (D > 1)
                expect_status(r1, GDN_ERR_MPI, "x (a hash)", "%s: x differing on one rank refused (rank %d)", what, rank);
            xs[3] = x3;
            const int r_fill = D > 1 ? gdn_attn_cp_decode(cp, pd[1], cache, ys, xs, w) : r1; /* the last free slot */
            check(all_ok(r_fill), "%s: a decode into the last free slot runs (control)", what);
            const int r2 = gdn_attn_cp_decode(cp, pd[1], cache, ys, xs, w);
            expect_status(r2, GDN_ERR_SHAPE, rank == D - 1 ? "capacity" : "rank", "%s: the last rank's full cache refused "
                          "on every rank (rank %d)", what, rank);
            free(xs);
        }
        test_mutation = NULL;
        gdn_cp_destroy(cp);
        gdn_attn_cache_destroy(cache);
        gdn_attn_plan_destroy(pp);
        for (int k = 1; k <= 3; k++) gdn_attn_plan_destroy(pd[k]);
    }
    free(w), free(x), free(y1), free(yr), free(xl), free(yp), free(ypr), free(yn), free(ys);
}

/* Bad input and disagreement: every rank returns an error naming it, none hangs. */
static void errors(void) {
    gdn_attn_config c = gdn_attn_config_default(1, 6, 16, 4, 2, 8);
    c.threads = 1, c.R = 4, c.seq_offset = 6 * (int64_t)rank;
    const size_t nw = gdn_attn_param_floats(&c);
    float *w = calloc(nw, 4), *x = calloc(6 * 16, 4), *y = calloc(6 * 16, 4);
    struct { const char *what, *needle; int strategy, bad_offset, nan_rank, other_strategy_rank; } cases[] = {
        {"a valid call (control)", NULL, GDN_ATTN_CP_KV, 0, -1, -1},
        {"heads with D not dividing H", "divide H", GDN_ATTN_CP_HEADS, 0, -1, -1},
        {"seq_offset not the tokens before", "seq_offset", GDN_ATTN_CP_KV, 1, -1, -1},
        {"NaN in x on the last rank", NULL, GDN_ATTN_CP_KV, 0, D - 1, -1},
        {"ranks disagreeing on the strategy", "strategy", GDN_ATTN_CP_KV, 0, -1, D - 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (i == 1 && 4 % D == 0) continue; /* heads allowed at this D */
        if ((i == 2 || i == 4) && D < 2) continue;
        gdn_attn_config b = c;
        b.cp = rank == cases[i].other_strategy_rank ? GDN_ATTN_CP_HEADS : cases[i].strategy;
        if (cases[i].bad_offset && rank == D - 1) b.seq_offset += 1;
        gdn_attn_plan *p = NULL;
        gdn_cp *cp = NULL;
        int rc = gdn_attn_plan_create(&p, &b);
        if (!rc) rc = gdn_cp_create(&cp, MPI_COMM_WORLD);
        x[5] = rank == cases[i].nan_rank ? NAN : 0.0f;
        if (!rc) rc = gdn_attn_cp_forward(cp, p, y, NULL, x, w);
        const int want = i == 0 ? GDN_OK : i == 1 || i == 2 ? GDN_ERR_SHAPE : i == 3 ? GDN_ERR_NONFINITE : GDN_ERR_MPI;
        /* the rank that failed names the tensor; the others name that rank */
        const int own = i == 3 && rank == D - 1;
        expect_status(rc, i == 3 && !own ? GDN_ERR_NONFINITE : want, own ? "'x'" : i == 3 ? "rank" : cases[i].needle,
                      "attention cp refuses %s (rank %d of %d)", cases[i].what, rank, D);
        int codes[2] = {rc, -rc}, ext[2];
        MPI_Allreduce(codes, ext, 2, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
        check(ext[0] == -ext[1], "attention cp: every rank returns the same status for %s", cases[i].what);
        gdn_cp_destroy(cp);
        gdn_attn_plan_destroy(p);
    }
    free(w), free(x), free(y);
}

void test_attention_cp(void) {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &D);
    static const int64_t pattern[8] = {37, 1, 70, 5, 64, 3, 20, 9}; /* a 1-token shard, shards below a tile */
    int64_t sizes[8] = {0}, total = 0;
    for (int r = 0; r < D && r < 8; r++) sizes[r] = pattern[r], total += pattern[r];
    if (D > 8) return;
    gdn_attn_config c = gdn_attn_config_default(2, 0, 24, 8, 2, 16);
    c.R = 8, c.rope_theta = 1e4, c.pos_offset = 3;
    attn_cp_case("attention dense B=2 H=8 Hkv=2", c, sizes, NULL, 0);
    /* documents crossing ranks, one of 1 token, positions restarting */
    int64_t cu[8] = {0}, n = 0;
    const int64_t cuts[6] = {20, 21, 60, 110, 150, 200};
    for (int i = 0; i < 6; i++)
        if (cuts[i] < total) cu[++n] = cuts[i];
    cu[++n] = total;
    gdn_attn_config pk = gdn_attn_config_default(1, 0, 24, 4, 4, 16);
    pk.R = 16, pk.rope_theta = 1e4;
    attn_cp_case("attention packed H=Hkv=4", pk, sizes, cu, n);
    gdn_attn_config mq = gdn_attn_config_default(1, 0, 16, 4, 1, 8);
    mq.R = 4;
    attn_cp_case("attention MQA H=4 Hkv=1", mq, sizes, NULL, 0);
    attn_cp_generate(sizes);
    errors();
}
