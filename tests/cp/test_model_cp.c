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

/* The GatedDeltaNet layers' CP strategy of the runs below (gdn_model_run.rule_cp). */
static gdn_cp_strategy rule_strategy = GDN_CP_SCAN;

static double model_cp_run(gdn_cp *cp, const gdn_model_config *c, const float *w, float *dw,
                           const gdn_token *tok, int64_t B, int64_t T, int64_t t0, int64_t tn,
                           int recompute, int fault, int attn_cp) {
    gdn_model_run r = {.B = B, .T = tn, .threads = 1, .recompute = recompute, .check_finite = 1, .attn_cp = attn_cp,
                       .rule_cp = rule_strategy};
    gdn_model_plan *p = NULL;
    int rc = gdn_model_plan_create(&p, c, &r, cp);
    gdn_token *mine = malloc(sizeof *mine * (size_t)(B * (tn + 1)));
    for (int64_t b = 0; b < B; b++) memcpy(mine + b * (tn + 1), tok + b * (T + 1) + t0, sizeof *mine * (size_t)(tn + 1));
    double ls = NAN, total = NAN;
    test_mutation = cp_site[fault];
    if (!rc) rc = dw ? model_train_step(p, w, dw, mine, (double)(B * T), &ls)
                     : gdn_model_forward(p, w, mine, (double)(B * T), &ls, 0);
    test_mutation = cp_site[CP_FAULT_NONE];
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
                            const gdn_token *tok, int64_t B, int64_t T, int64_t t0, int64_t tn,
                            const int64_t *cu, const int64_t *nd, double denom, int fault, int attn_cp) {
    gdn_model_run r = {.B = B, .T = tn, .threads = 1, .check_finite = 1, .pack = 1, .attn_cp = attn_cp,
                       .rule_cp = rule_strategy};
    gdn_model_plan *p = NULL;
    int rc = gdn_model_plan_create(&p, c, &r, cp);
    gdn_token *mine = malloc(sizeof *mine * (size_t)(B * (tn + 1)));
    for (int64_t b = 0; b < B; b++) memcpy(mine + b * (tn + 1), tok + b * (T + 1) + t0, sizeof *mine * (size_t)(tn + 1));
    double ls = NAN, total = NAN;
    int64_t targets = 0;
    if (!rc) rc = gdn_model_set_docs(p, cu, nd, t0, &targets);
    test_mutation = cp_site[fault];
    if (!rc) rc = model_train_step(p, w, dw, mine, denom, &ls);
    test_mutation = cp_site[CP_FAULT_NONE];
    if (rc) ls = NAN, check(0, "packed model step over ranks: %s", gdn_errmsg());
    MPI_Allreduce(&ls, &total, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, dw, (int)gdn_model_param_floats(c), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    free(mine);
    gdn_model_plan_destroy(p);
    return total;
}

/* The rows' documents (windows of T + 1 tokens): row 0 starts documents at 1, around the first
 * and last rank cuts (23 tokens a rank) and at the last target; row 1 is one document. */
static void cp_docs(int64_t T, int D, int64_t cu[16], int64_t nd[2]) {
    const int64_t want[] = {1, 22, 23, 24, 23 * (D - 1), 23 * (D - 1) + 1, T};
    nd[0] = 0, nd[1] = 1;
    cu[0] = 0;
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        if (want[i] > cu[nd[0]] && want[i] <= T) cu[++nd[0]] = want[i];
    cu[++nd[0]] = T + 1;
    cu[nd[0] + 1] = 0, cu[nd[0] + 2] = T + 1;
}

static void test_model_cp_packed(const gdn_model_config *c, const float *w, const gdn_token *tok, int64_t B,
                                 int64_t T, int64_t t0, int64_t tn, int D) {
    int64_t cu[16], nd[2];
    cp_docs(T, D, cu, nd);
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
        rule_strategy = strategies[s];
        if (gdn_cp_create(&cp, MPI_COMM_WORLD)) continue;
        const char *sn = gdn_cp_strategy_name(strategies[s]);
        double got = packed_cp_run(cp, c, w, dw, tok, B, T, t0, tn, cu, nd, denom, 0, 0);
        expect_close(fabs(got - ref) / fabs(ref), TOL_MODEL_CP, "packed model loss over %d ranks (%s) vs one rank, "
                     "%lld documents", D, sn, (long long)nd[0] + 1);
        expect_close(rel_err_ff(dw, dw_ref, (int64_t)nw), TOL_MODEL_CP,
                     "packed model gradient over %d ranks (%s) vs one rank", D, sn);
        if (D > 1 && !s) {
            packed_cp_run(cp, c, w, dw, tok, B, T, t0, tn, cu, nd, denom, CP_FAULT_DROP_INCOMING, 0);
            expect_far(rel_err_ff(dw, dw_ref, (int64_t)nw), TOL_MODEL_CP,
                       "packed model gradient over %d ranks with the incoming state dropped", D);
        }
        gdn_cp_destroy(cp);
    }
    rule_strategy = GDN_CP_SCAN;
    free(dw), free(dw_ref);
}

/* A token id outside the vocabulary in the last rank's shard: every rank returns an error (none
 * waits for the others: the test would hang), the last rank's names the id, row and position;
 * then the same plan on good tokens gives the single-rank loss (control: the check passes good
 * ids, and the failure left nothing behind). */
static void test_model_cp_bad_token(const gdn_model_config *c, const float *w, const gdn_token *tok, int64_t B,
                                    int64_t T, int64_t t0, int64_t tn, int D, double ref) {
    int rank;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    gdn_cp *cp = NULL;
    if (gdn_cp_create(&cp, MPI_COMM_WORLD)) return;
    gdn_model_run r = {.B = B, .T = tn, .threads = 1, .check_finite = 1};
    gdn_model_plan *p = NULL;
    gdn_token *mine = malloc(sizeof *mine * (size_t)(B * (tn + 1)));
    if (!gdn_model_plan_create(&p, c, &r, D > 1 ? cp : NULL)) {
        for (int64_t b = 0; b < B; b++) memcpy(mine + b * (tn + 1), tok + b * (T + 1) + t0, sizeof *mine * (size_t)(tn + 1));
        const int last = rank == D - 1;
        if (last) mine[1 * (tn + 1) + 3] = (gdn_token)c->vocab;
        double ls = 0;
        const int rc = gdn_model_forward(p, w, mine, (double)(B * T), &ls, 0);
        char want[160];
        snprintf(want, sizeof want, "token id %lld at row 1 position 3", (long long)c->vocab);
        if (last) expect_status(rc, GDN_ERR_ARG, want, "CP %d ranks: the last rank's bad token id refused, named", D);
        else check(rc != GDN_OK, "CP %d ranks: rank %d stops too when the last rank's token is bad (%s)", D, rank,
                   rc ? gdn_errmsg() : "returned OK");
        if (last) mine[1 * (tn + 1) + 3] = tok[1 * (T + 1) + t0 + 3];
        double good = NAN, total = NAN;
        if (gdn_model_forward(p, w, mine, (double)(B * T), &ls, 0) == GDN_OK) good = ls;
        MPI_Allreduce(&good, &total, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
        expect_close(fabs(total - ref) / fabs(ref), TOL_MODEL_CP, "CP %d ranks: after the refusal, good ids give the "
                     "single-rank loss", D);
        gdn_model_plan_destroy(p);
    }
    free(mine);
    gdn_cp_destroy(cp);
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
    gdn_token *tok = malloc(sizeof *tok * (size_t)(B * (T + 1)));
    rng_seed(77);
    for (int64_t i = 0; i < B * (T + 1); i++) tok[i] = (gdn_token)(97 + (int)rng_uniform(0, 8));
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
        rule_strategy = strategies[s];
        if (gdn_cp_create(&cp, MPI_COMM_WORLD)) {
            check(0, "gdn_cp_create: %s", gdn_errmsg());
            continue;
        }
        const char *sn = gdn_cp_strategy_name(strategies[s]);
        for (int recompute = 0; recompute < 2; recompute++) {
            if (recompute && s) continue; /* recompute is strategy-independent: once */
            const double got = model_cp_run(cp, &c, w, dw, tok, B, T, t0, tn, recompute, 0, 0);
            expect_close(fabs(got - ref) / fabs(ref), TOL_MODEL_CP,
                         "model loss over %d ranks (%s%s) vs one rank, B=2 T=%lld", D, sn,
                         recompute ? ", recompute" : "", (long long)T);
            expect_close(rel_err_ff(dw, dw_ref, (int64_t)nw), TOL_MODEL_CP,
                         "model gradient over %d ranks (%s%s) vs one rank", D, sn, recompute ? ", recompute" : "");
        }
        if (D > 1) {
            const double dropped = model_cp_run(cp, &c, w, NULL, tok, B, T, t0, tn, 0, CP_FAULT_DROP_INCOMING, 0);
            expect_far(fabs(dropped - ref) / fabs(ref), TOL_MODEL_CP,
                       "model loss over %d ranks (%s) with the incoming state dropped", D, sn);
            if (!s) {
                const double nohalo = model_cp_run(cp, &c, w, NULL, tok, B, T, t0, tn, 0, CP_FAULT_DROP_HALO, 0);
                expect_far(fabs(nohalo - ref) / fabs(ref), TOL_MODEL_CP,
                           "model loss over %d ranks with the conv halo dropped", D);
            }
        }
        gdn_cp_destroy(cp);
    }
    rule_strategy = GDN_CP_SCAN;
    test_model_cp_packed(&c, w, tok, B, T, t0, tn, D);
    test_model_cp_bad_token(&c, w, tok, B, T, t0, tn, D, ref);
    free(w), free(dw), free(dw_ref), free(tok);
}

/* ---------------------------------------------------------------- the hybrid model over ranks */

/* The worst relative error over the model's tensors (each against its own largest value). */
static double worst_tensor_err(const gdn_model_config *c, const float *dw, const float *ref, char *name) {
    double worst = 0;
    gdn_model_tensor_info t;
    snprintf(name, 96, "none: all equal");
    for (int i = 0; i < gdn_model_tensor_count(c); i++) {
        gdn_model_tensor(c, i, &t);
        const double e = rel_err_ff(dw + t.offset, ref + t.offset, (int64_t)t.numel);
        if (!(e <= worst)) worst = e, snprintf(name, 96, "%s", t.name);
    }
    return worst;
}

/* Whether the heads strategy takes D ranks for H query heads and Hkv kv heads: D | H, and H/D and
 * H/Hkv divide one another. */
static int heads_fit(int D, int64_t H, int64_t Hkv) {
    if (H % D) return 0;
    const int64_t hp = H / D, grp = H / Hkv;
    return hp % grp == 0 || grp % hp == 0;
}

/* One rank's packed or dense step on the whole sequence: the reference every rank computes. */
static double one_rank_step(const gdn_model_config *c, const float *w, float *dw, const gdn_token *tok, int64_t B,
                            int64_t T, const int64_t *cu, const int64_t *nd, double denom) {
    const gdn_model_run r = {.B = B, .T = T, .threads = 1, .check_finite = 1, .pack = cu != NULL};
    gdn_model_plan *p = NULL;
    int64_t targets = 0;
    double ls = NAN;
    int rc = gdn_model_plan_create(&p, c, &r, NULL);
    if (!rc && cu) rc = gdn_model_set_docs(p, cu, nd, 0, &targets);
    if (!rc) rc = model_train_step(p, w, dw, tok, denom, &ls);
    if (rc) check(0, "one-rank reference step: %s", gdn_errmsg());
    gdn_model_plan_destroy(p);
    return rc ? NAN : ls;
}

/* transformers' tiny Qwen3.5 (3 GatedDeltaNet layers, then gated attention with H 4, Hkv 2) with
 * its sequence over the ranks, each attention strategy (heads where the head counts allow),
 * dense (recompute too) and packed, against the same model on one rank (itself checked against
 * transformers in the model_hybrid suite): the loss and every gradient. Negative control: the
 * attention layer's earlier keys and values dropped (CP_FAULT_ATTN_DROP_KV on the cp object
 * the model runs its attention layers with). */
void test_model_cp_hybrid(void) {
    int rank, D;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &D);
    gdn_model_config c;
    int rc = gdn_ckpt_load_config(GDN_GOLDEN_DIR "/qwen35_tiny", &c);
    const size_t nw = rc ? 1 : gdn_model_param_floats(&c);
    float *w = aligned_alloc(64, sizeof(float) * ((nw + 15) & ~(size_t)15));
    float *dw = aligned_alloc(64, sizeof(float) * nw), *dw_ref = aligned_alloc(64, sizeof(float) * nw);
    if (!rc) rc = gdn_ckpt_load(GDN_GOLDEN_DIR "/qwen35_tiny", &c, w, NULL, NULL, NULL);
    check(rc == GDN_OK && gdn_model_attn_layers(&c) == 1, "the hybrid tiny loads (%s)", rc ? gdn_errmsg() : "ok");
    if (rc) goto out;
    const int64_t B = 2, T = 23 * D + 5, t0 = 23 * rank, tn = rank == D - 1 ? 28 : 23;
    gdn_token *tok = malloc(sizeof *tok * (size_t)(B * (T + 1)));
    rng_seed(91);
    for (int64_t i = 0; i < B * (T + 1); i++) tok[i] = (gdn_token)(97 + (int)rng_uniform(0, 8));
    int64_t cu[16], nd[2];
    cp_docs(T, D, cu, nd);
    static const int strategies[2] = {GDN_ATTN_CP_KV, GDN_ATTN_CP_HEADS};
    gdn_cp *cp = NULL;
    if (gdn_cp_create(&cp, MPI_COMM_WORLD)) {
        check(0, "gdn_cp_create: %s", gdn_errmsg());
        free(tok);
        goto out;
    }
    char worst_name[96] = "";
    for (int packed = 0; packed < 2; packed++) {
        const double denom = (double)(B * T);
        const double ref = one_rank_step(&c, w, dw_ref, tok, B, T, packed ? cu : NULL, nd, denom);
        for (int s = 0; s < 2; s++) {
            const char *sn = gdn_attn_cp_strategy_name(strategies[s]);
            if (strategies[s] == GDN_ATTN_CP_HEADS && !heads_fit(D, c.H, c.Hkv)) continue;
            for (int recompute = 0; recompute < 2 - packed; recompute++) {
                const double got = packed ? packed_cp_run(cp, &c, w, dw, tok, B, T, t0, tn, cu, nd, denom, 0, strategies[s])
                                          : model_cp_run(cp, &c, w, dw, tok, B, T, t0, tn, recompute, 0, strategies[s]);
                expect_close(fabs(got - ref) / fabs(ref), TOL_MODEL_CP, "hybrid tiny%s over %d ranks (attention %s%s): "
                             "loss vs one rank", packed ? " packed" : "", D, sn, recompute ? ", recompute" : "");
                expect_close(worst_tensor_err(&c, dw, dw_ref, worst_name), TOL_MODEL_CP,
                             "... every gradient (worst %s)", worst_name);
            }
            if (D < 2) continue;
            const double dropped = packed
                                       ? packed_cp_run(cp, &c, w, dw, tok, B, T, t0, tn, cu, nd, denom,
                                                       CP_FAULT_ATTN_DROP_KV, strategies[s])
                                       : model_cp_run(cp, &c, w, dw, tok, B, T, t0, tn, 0, CP_FAULT_ATTN_DROP_KV,
                                                      strategies[s]);
            expect_far(fabs(dropped - ref) / fabs(ref), TOL_MODEL_CP,
                       "hybrid tiny%s over %d ranks (attention %s) with the attention's earlier keys and values "
                       "dropped: loss", packed ? " packed" : "", D, sn);
            expect_far(worst_tensor_err(&c, dw, dw_ref, worst_name), TOL_MODEL_CP, "... its gradients (worst %s)",
                       worst_name);
        }
    }
    gdn_cp_destroy(cp);
    free(tok);
out:
    free(w), free(dw), free(dw_ref);
}
