/* Packed documents (cu_seqlens) over ranks: forward and backward under every strategy equal each
 * document run alone through the single-rank path, with cuts inside documents, exactly at chunk
 * boundaries and one token from them, at document boundaries, many documents on one rank and one
 * document over all ranks; negative controls through the real CP path (dropped incoming state,
 * dropped state gradient, resets disabled); inconsistent offsets refused. Every strategy reads
 * document d's h0 on the rank where d starts and its dht where d ends: the other ranks' copies
 * of those rows are scrambled and must not matter (the owners' scrambled: the control). The
 * heads strategy runs with Hk = D (it needs D | Hk); Hk = 1 over D > 1 ranks is refused. */
#include "gdncp/cp.h"
#include "harness.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* CP vs the documents run alone on one rank in fp32: the same arithmetic up to the composition
 * of affine maps across ranks (rounding only), DESIGN §6's CP class; gradients as test_cp's. */
#define TOL_PACK_CP_FWD 1e-5
#define TOL_PACK_CP_BWD 2e-5

static int rank, D;

typedef struct {
    const char *label;
    int chunk;
    int64_t T, n_docs;
    int64_t *cu, *sizes; /* offsets; tokens per rank */
} cp_pack_case;

/* Offsets from document lengths repeated (cycling through `lens`) until T tokens. */
static int64_t *offsets_from_lengths(int64_t T, const int64_t *lens, int nlens, int64_t *n_docs) {
    int64_t *cu = malloc(sizeof(int64_t) * (size_t)(T + 1)), n = 0;
    cu[0] = 0;
    while (cu[n] < T) {
        const int64_t next = cu[n] + lens[n % nlens];
        cu[n + 1] = next < T ? next : T;
        n++;
    }
    *n_docs = n;
    return cu;
}

static double max_over_ranks(double e) {
    double g;
    if (isnan(e)) e = INFINITY;
    MPI_Allreduce(&e, &g, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return g;
}

/* This rank's rows [t0, t0+tn) of a [1, T, inner] tensor against the reference's, relative to
 * the whole reference tensor's largest value, reduced over ranks. */
static double rows_err(const float *ours, const float *ref, int64_t T, int64_t t0, int64_t tn, int64_t inner) {
    double num = 0.0, den = 0.0;
    for (int64_t i = 0; i < T * inner; i++) den = fmax(den, fabs(ref[i]));
    for (int64_t i = 0; i < tn * inner; i++) {
        const double d = fabs((double)ours[i] - ref[t0 * inner + i]);
        if (!(d <= num)) num = d;
    }
    return max_over_ranks(num / fmax(den, REL_ERR_FLOOR));
}

static float *slice(const float *x, int64_t t0, int64_t tn, int64_t inner) {
    float *out = malloc(sizeof(float) * (size_t)(tn * inner + 1));
    memcpy(out, x + t0 * inner, sizeof(float) * tn * inner);
    return out;
}

enum {
    PACKED = 0,
    RESETS_DISABLED = 1, /* dense plans on the packed stream (negative control) */
    OWNED_ONLY = 2,      /* packed; each rank's h0 / dht rows of documents it does not own scrambled */
    OWNED_SCRAMBLED = 3, /* packed; the rows it owns scrambled instead (negative control) */
    HK_ONE = 4           /* packed with Hk = 1 whatever the strategy (heads then refused for D > 1) */
};

/* x -> 1.5 - 2x on the rows [d, d+1) of a per-document state where `pick` is set. */
static void scramble_docs(float *x, int64_t n_docs, int64_t ns, const int *pick) {
    for (int64_t d = 0; d < n_docs; d++)
        for (int64_t i = 0; pick[d] && i < ns; i++) x[d * ns + i] = 1.5f - 2.0f * x[d * ns + i];
}

/* One case through one strategy: forward and backward errors against the documents run alone
 * (both INFINITY when a call fails). fault: a CP_FAULT_* negative control. */
static int run_case(const cp_pack_case *cc, gdn_cp_strategy strategy, int fault, int mode, double *ef,
                    double *eb) {
    /* heads needs D | Hk: Hk = D there (two value heads per key head as elsewhere) */
    const int64_t Hk = strategy == GDN_CP_HEADS && mode != HK_ONE ? D : 1;
    gdn_config full = gdn_config_default(1, cc->T, Hk, 2 * Hk, 16, 16);
    full.chunk = cc->chunk, full.threads = 1, full.cu_seqlens = cc->cu, full.n_docs = cc->n_docs;
    const int64_t ns = full.Hv * full.K * full.V, nst = cc->n_docs * ns, Hv = full.Hv, V = full.V,
                  QK = Hk * full.K; /* a token's row of q or k */
    problem p;
    problem_make(&p, full, GATE_MILD, BETA_RANDOM, 0, 777 + cc->T + cc->n_docs);
    float *h0 = random_floats((size_t)nst), *dht = random_floats((size_t)nst), *dout = random_floats((size_t)n_v(&full));
    pack_results ref = pack_results_alloc(&full, cc->n_docs);
    /* (a case whose offsets do not end at T is a refusal test: it has no reference) */
    int rc = cc->cu[cc->n_docs] == cc->T ? pack_run_separately(&full, &p, h0, dout, dht, &ref) : GDN_OK;

    int64_t t0 = 0;
    for (int r = 0; r < rank; r++) t0 += cc->sizes[r];
    const int64_t tn = cc->sizes[rank];
    gdn_config loc = full;
    loc.T = tn, loc.seq_offset = t0;
    if (mode == RESETS_DISABLED) loc.cu_seqlens = NULL, loc.n_docs = 0, loc.seq_offset = 0;
    if (mode == OWNED_ONLY || mode == OWNED_SCRAMBLED) { /* (the reference has run: copies change) */
        int *starts = calloc((size_t)cc->n_docs, sizeof(int)), *ends = calloc((size_t)cc->n_docs, sizeof(int));
        for (int64_t d = 0; d < cc->n_docs; d++) {
            const int owns_start = cc->cu[d] >= t0 && cc->cu[d] < t0 + tn;
            const int owns_end = cc->cu[d + 1] > t0 && cc->cu[d + 1] <= t0 + tn;
            starts[d] = mode == OWNED_ONLY ? !owns_start : owns_start;
            ends[d] = mode == OWNED_ONLY ? !owns_end : owns_end;
        }
        scramble_docs(h0, cc->n_docs, ns, starts), scramble_docs(dht, cc->n_docs, ns, ends);
        free(starts), free(ends);
    }
    float *q = slice(p.q, t0, tn, QK), *k = slice(p.k, t0, tn, QK), *v = slice(p.v, t0, tn, Hv * V);
    float *g = slice(p.g, t0, tn, Hv), *beta = slice(p.beta, t0, tn, Hv), *ldo = slice(dout, t0, tn, Hv * V);
    float *o = calloc((size_t)(tn * Hv * V), sizeof(float)), *ht = calloc((size_t)nst, sizeof(float));
    float *s_in = calloc((size_t)ns, sizeof(float)), *dh0 = calloc((size_t)nst, sizeof(float));
    float *gq = calloc((size_t)(tn * QK), sizeof(float)), *gk = calloc((size_t)(tn * QK), sizeof(float));
    float *gv = calloc((size_t)(tn * Hv * V), sizeof(float)), *gg = calloc((size_t)(tn * Hv), sizeof(float));
    float *gb = calloc((size_t)(tn * Hv), sizeof(float));
    gdn_plan *plan = NULL;
    gdn_cp *cp = NULL;
    loc.cp = strategy;
    if (!rc) rc = gdn_plan_create(&plan, &loc);
    if (!rc) rc = gdn_cp_create(&cp, MPI_COMM_WORLD);
    if (!rc) test_mutation = cp_site[fault];
    if (!rc) rc = gdn_cp_forward(cp, plan, o, ht, s_in,
                                 &(gdn_rule_inputs){.q = q, .k = k, .v = v, .g = g, .beta = beta, .h0 = h0});
    const int fwd_rc = rc;
    if (!rc) rc = gdn_cp_backward(cp, plan,
                                  &(gdn_rule_grads){.dq = gq, .dk = gk, .dv = gv, .dg = gg, .dbeta = gb,
                                                    .dh0 = dh0},
                                  &(gdn_rule_inputs){.q = q, .k = k, .v = v, .g = g, .beta = beta, .h0 = h0},
                                  s_in, ldo, dht);
    *ef = *eb = INFINITY;
    if (!fwd_rc) {
        *ef = rows_err(o, ref.o, cc->T, t0, tn, Hv * V);
        if (mode != RESETS_DISABLED) *ef = fmax(*ef, max_over_ranks(rel_err_ff(ht, ref.ht, nst)));
    }
    if (!rc) {
        *eb = fmax(rows_err(gq, ref.dq, cc->T, t0, tn, QK), rows_err(gk, ref.dk, cc->T, t0, tn, QK));
        *eb = fmax(*eb, fmax(rows_err(gv, ref.dv, cc->T, t0, tn, Hv * V), rows_err(gg, ref.dg, cc->T, t0, tn, Hv)));
        *eb = fmax(*eb, rows_err(gb, ref.dbeta, cc->T, t0, tn, Hv));
        if (mode != RESETS_DISABLED) *eb = fmax(*eb, max_over_ranks(rel_err_ff(dh0, ref.dh0, nst)));
    }
    test_mutation = NULL;
    gdn_cp_destroy(cp);
    gdn_plan_destroy(plan);
    free(q), free(k), free(v), free(g), free(beta), free(ldo), free(o), free(ht), free(s_in), free(dh0);
    free(gq), free(gk), free(gv), free(gg), free(gb), free(h0), free(dht), free(dout);
    pack_results_free(&ref);
    problem_free(&p);
    return rc;
}

static void describe(char *buf, size_t n, const cp_pack_case *cc, gdn_cp_strategy s) {
    int len = snprintf(buf, n, "%s %s D=%d T=%lld docs=%lld C=%d shards", gdn_cp_strategy_name(s), cc->label, D,
                       (long long)cc->T, (long long)cc->n_docs, cc->chunk);
    for (int r = 0; r < D && len < (int)n - 8; r++)
        len += snprintf(buf + len, n - (size_t)len, "%s%lld", r ? "," : " ", (long long)cc->sizes[r]);
}

static void check_case(const cp_pack_case *cc) {
    const gdn_cp_strategy strategies[] = {GDN_CP_SCAN, GDN_CP_ALLGATHER, GDN_CP_RELAY, GDN_CP_HEADS};
    char what[256];
    double ef, eb;
    for (int s = 0; s < 4; s++) {
        run_case(cc, strategies[s], CP_FAULT_NONE, PACKED, &ef, &eb);
        describe(what, sizeof what, cc, strategies[s]);
        expect_close(ef, TOL_PACK_CP_FWD, "%s: forward (o, ht per document) == documents run alone", what);
        expect_close(eb, TOL_PACK_CP_BWD, "%s: backward (all gradients, dh0 per document) == documents run alone",
                     what);
    }
    /* Per-document states read from their owners only: the scan's and the heads' way. */
    const gdn_cp_strategy owners[] = {GDN_CP_SCAN, GDN_CP_HEADS};
    for (int s = 0; s < 2; s++) {
        describe(what, sizeof what, cc, owners[s]);
        run_case(cc, owners[s], CP_FAULT_NONE, OWNED_ONLY, &ef, &eb);
        expect_close(ef, TOL_PACK_CP_FWD, "%s: h0 rows of documents not starting on a rank scrambled there: "
                     "forward unchanged", what);
        expect_close(eb, TOL_PACK_CP_BWD, "%s: dht rows of documents not ending on a rank scrambled there: "
                     "backward unchanged", what);
        run_case(cc, owners[s], CP_FAULT_NONE, OWNED_SCRAMBLED, &ef, &eb);
        expect_far(ef, TOL_PACK_CP_FWD, "%s: the owners' h0 rows scrambled: forward differs (negative control)", what);
        expect_far(eb, TOL_PACK_CP_BWD, "%s: the owners' dht rows scrambled: backward differs (negative control)",
                   what);
    }
    if (cc->n_docs > 1) { /* (one document: a dense run is the same run) */
        describe(what, sizeof what, cc, GDN_CP_HEADS);
        run_case(cc, GDN_CP_HEADS, CP_FAULT_NONE, RESETS_DISABLED, &ef, &eb);
        expect_far(ef, TOL_PACK_CP_FWD, "%s: resets disabled (dense plans): forward differs (negative control)", what);
        expect_far(eb, TOL_PACK_CP_BWD, "%s: resets disabled (dense plans): backward differs (negative control)",
                   what);
    }
}

static cp_pack_case make_case(const char *label, int chunk, const int64_t *sizes, const int64_t *lens, int nlens) {
    cp_pack_case cc = {label, chunk, 0, 0, NULL, malloc(sizeof(int64_t) * (size_t)D)};
    for (int r = 0; r < D; r++) cc.sizes[r] = sizes[r], cc.T += sizes[r];
    cc.cu = offsets_from_lengths(cc.T, lens, nlens, &cc.n_docs);
    return cc;
}
static void free_case(cp_pack_case *cc) { free(cc->cu), free(cc->sizes); }

/* The packed layer over ranks vs its documents run alone on one rank: y, dx rows and dw summed
 * over ranks; the halo and the recurrence cross ranks, the projections are row-local (rounding
 * only; dw sums in another order). */
#define TOL_PACK_LAYER 2e-5

enum { LAYER_PACKED, LAYER_DENSE };

static void layer_cp_errors(const cp_pack_case *cc, gdn_cp_strategy strategy, int fault, int mode, double *ey,
                            double *edx, double *edw) {
    const int64_t Hk = strategy == GDN_CP_HEADS ? D : 1; /* heads needs D | Hk */
    gdn_layer_config full = gdn_layer_config_default(1, cc->T, 24, Hk, 2 * Hk, 16, 16);
    full.threads = 1, full.chunk = cc->chunk, full.cu_seqlens = cc->cu, full.n_docs = cc->n_docs;
    const int64_t E = full.E, N = cc->T * E, nw = (int64_t)gdn_layer_param_floats(&full);
    rng_seed(606 + cc->T);
    float *w = layer_random_weights(&full, 0.05, 1), *x = random_floats((size_t)N), *dy = random_floats((size_t)N);
    float *y_ref = calloc((size_t)N, sizeof(float)), *dx_ref = calloc((size_t)N, sizeof(float));
    float *dw_ref = calloc((size_t)nw, sizeof(float)), *dw_all = calloc((size_t)nw, sizeof(float));
    int rc = pack_layer_separately(&full, w, x, dy, y_ref, dx_ref, dw_ref);
    int64_t t0 = 0;
    for (int r = 0; r < rank; r++) t0 += cc->sizes[r];
    const int64_t tn = cc->sizes[rank];
    gdn_layer_config loc = full;
    loc.T = tn, loc.seq_offset = t0;
    if (mode == LAYER_DENSE) loc.cu_seqlens = NULL, loc.n_docs = 0, loc.seq_offset = 0;
    float *y = calloc((size_t)(tn * E), sizeof(float)), *dx = calloc((size_t)(tn * E), sizeof(float));
    float *dw = calloc((size_t)nw, sizeof(float)), *saved = NULL;
    gdn_layer_plan *lp = NULL;
    gdn_cp *cp = NULL;
    loc.cp = strategy;
    if (!rc) rc = gdn_layer_plan_create(&lp, &loc);
    if (!rc) rc = gdn_cp_create(&cp, MPI_COMM_WORLD);
    test_mutation = cp_site[fault];
    if (!rc) saved = calloc(gdn_layer_saved_floats(lp) + 1, sizeof(float));
    if (!rc) rc = gdn_layer_cp_forward(cp, lp, y, saved, x + t0 * E, w);
    if (!rc) rc = gdn_layer_cp_backward(cp, lp, dx, dw, x + t0 * E, w, saved, dy + t0 * E);
    if (!rc) MPI_Allreduce(dw, dw_all, (int)nw, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    *ey = *edx = *edw = INFINITY;
    if (!rc) {
        *ey = rows_err(y, y_ref, cc->T, t0, tn, E), *edx = rows_err(dx, dx_ref, cc->T, t0, tn, E);
        *edw = max_over_ranks(rel_err_ff(dw_all, dw_ref, nw));
    }
    test_mutation = NULL;
    gdn_cp_destroy(cp);
    gdn_layer_plan_destroy(lp);
    free(w), free(x), free(dy), free(y_ref), free(dx_ref), free(dw_ref), free(dw_all), free(y), free(dx), free(dw);
    free(saved);
}

static void layer_cp_check(void) {
    /* Shards of 7, 2, 1, 9 tokens (the 3-row halo spans up to three ranks), documents of 4, 1,
     * 6, 2 and 9 tokens: cuts inside documents, at their starts and within a halo's reach. */
    int64_t *sizes = malloc(sizeof(int64_t) * (size_t)D);
    static const int64_t shard_pattern[] = {7, 2, 1, 9}, lens[] = {4, 1, 6, 2, 9};
    for (int r = 0; r < D; r++) sizes[r] = shard_pattern[r % 4];
    cp_pack_case cc = make_case("layer, halo across documents", 16, sizes, lens, 5);
    const gdn_cp_strategy strategies[] = {GDN_CP_SCAN, GDN_CP_ALLGATHER, GDN_CP_RELAY, GDN_CP_HEADS};
    char what[256];
    double ey, edx, edw;
    for (int s = 0; s < 4; s++) {
        layer_cp_errors(&cc, strategies[s], CP_FAULT_NONE, LAYER_PACKED, &ey, &edx, &edw);
        describe(what, sizeof what, &cc, strategies[s]);
        expect_close(fmax(ey, edx), TOL_PACK_LAYER, "%s: packed layer y, dx == documents run alone", what);
        expect_close(edw, TOL_PACK_LAYER, "%s: packed layer dw (summed over ranks) == documents' dw summed", what);
    }
    if (D > 1) {
        layer_cp_errors(&cc, GDN_CP_SCAN, CP_FAULT_DROP_HALO, LAYER_PACKED, &ey, &edx, &edw);
        expect_far(ey, TOL_PACK_LAYER, "scan %s D=%d: conv halo dropped (forward)", cc.label, D);
        layer_cp_errors(&cc, GDN_CP_SCAN, CP_FAULT_DROP_HALO_GRAD, LAYER_PACKED, &ey, &edx, &edw);
        expect_far(edx, TOL_PACK_LAYER, "scan %s D=%d: halo gradient not returned (backward)", cc.label, D);
    }
    layer_cp_errors(&cc, GDN_CP_SCAN, CP_FAULT_NONE, LAYER_DENSE, &ey, &edx, &edw);
    expect_far(ey, TOL_PACK_LAYER, "scan %s D=%d: resets disabled (dense layer plans)", cc.label, D);
    layer_cp_errors(&cc, GDN_CP_HEADS, CP_FAULT_NONE, LAYER_DENSE, &ey, &edx, &edw);
    expect_far(fmin(ey, edx), TOL_PACK_LAYER, "heads %s D=%d: resets disabled (dense layer plans): y and dx differ",
               cc.label, D);
    expect_far(edw, TOL_PACK_LAYER, "heads %s D=%d: resets disabled (dense layer plans): dw differs", cc.label, D);
    free_case(&cc);
    free(sizes);
}

void test_pack_cp(void) {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &D);
    int64_t *sizes = malloc(sizeof(int64_t) * (size_t)D);

    /* Cuts inside documents (an even split of irregular documents). */
    const int64_t T1 = 23 * D + 7;
    for (int r = 0; r < D; r++) sizes[r] = T1 / D + (r < T1 % D);
    static const int64_t irregular[] = {13, 37, 1, 39, 16, 17, 5, 2};
    cp_pack_case inside = make_case("cuts inside documents", 16, sizes, irregular, 8);
    check_case(&inside);

    /* Cuts exactly at chunk boundaries (C = 16) and one token from them; documents likewise. */
    for (int r = 0; r < D; r++) sizes[r] = 32 + (r % 3 == 1 ? -1 : r % 3 == 2 ? 1 : 0);
    static const int64_t at_chunks[] = {16, 16, 15, 1, 17, 31, 33};
    cp_pack_case chunks = make_case("cuts at and one token from chunk boundaries", 16, sizes, at_chunks, 7);
    check_case(&chunks);

    /* Many documents on rank 0, then one document over all the other ranks. */
    for (int r = 0; r < D; r++) sizes[r] = r ? 9 : 24;
    int64_t many_lens[9] = {3, 3, 3, 3, 3, 3, 3, 3, 9 * (D - 1) > 0 ? 9 * (D - 1) : 3};
    cp_pack_case many = make_case("many documents on one rank, one over the others", 16, sizes, many_lens, 9);
    check_case(&many);

    /* One document over all ranks, shards uneven, the last one token long. */
    for (int r = 0; r < D; r++) sizes[r] = r + 1 == D && D > 1 ? 1 : 5 + 3 * (r % 2) + (r ? 0 : 7);
    int64_t whole[1] = {0};
    for (int r = 0; r < D; r++) whole[0] += sizes[r];
    cp_pack_case one = make_case("one document over all ranks", 16, sizes, whole, 1);
    check_case(&one);

    /* Cuts at document boundaries, documents of one token at both ends of every shard. */
    for (int r = 0; r < D; r++) sizes[r] = 6;
    static const int64_t edge_lens[] = {5, 1, 1, 4, 1, 1, 4, 1, 1, 4, 1, 1, 4, 1, 1, 4, 1, 1, 4, 1, 1, 4, 1, 1, 4, 1};
    cp_pack_case edges = make_case("length-1 documents at every cut", 16, sizes, edge_lens, 26);
    check_case(&edges);

    /* Negative controls through the same comparison. */
    if (D > 1) {
        double ef, eb;
        char what[256];
        describe(what, sizeof what, &inside, GDN_CP_SCAN);
        run_case(&inside, GDN_CP_SCAN, CP_FAULT_DROP_INCOMING, PACKED, &ef, &eb);
        expect_far(ef, TOL_PACK_CP_FWD, "%s: incoming state dropped in the replay (forward)", what);
        run_case(&inside, GDN_CP_SCAN, CP_FAULT_DROP_GRADIENT, PACKED, &ef, &eb);
        expect_far(eb, TOL_PACK_CP_BWD, "%s: received state gradient dropped (backward)", what);
        run_case(&inside, GDN_CP_RELAY, CP_FAULT_DROP_INCOMING, PACKED, &ef, &eb);
        expect_far(ef, TOL_PACK_CP_FWD, "relay %s: incoming state dropped (forward)", inside.label);
    }
    {
        double ef, eb;
        run_case(&inside, GDN_CP_SCAN, CP_FAULT_NONE, RESETS_DISABLED, &ef, &eb);
        expect_far(ef, TOL_PACK_CP_FWD, "scan %s D=%d: resets disabled (dense plans on the packed stream)",
                   inside.label, D);
    }

    /* Refusals, on every rank alike. */
    double ef, eb;
    int rc = run_case(&inside, GDN_CP_HEADS, CP_FAULT_NONE, HK_ONE, &ef, &eb);
    if (D > 1)
        expect_status(rc, GDN_ERR_SHAPE, "to divide Hk", "heads with cu_seqlens, Hk = 1 over %d ranks, is refused", D);
    else
        expect_close(fmax(ef, eb), TOL_PACK_CP_BWD, "heads with cu_seqlens, Hk = 1 on one rank == documents alone "
                     "(forward and backward)");
    int64_t *past = malloc(sizeof(int64_t) * (size_t)(inside.n_docs + 1));
    memcpy(past, inside.cu, sizeof(int64_t) * (size_t)(inside.n_docs + 1));
    past[inside.n_docs] += 1; /* one token more than the ranks hold */
    cp_pack_case longer = inside;
    longer.cu = past;
    rc = run_case(&longer, GDN_CP_SCAN, CP_FAULT_NONE, PACKED, &ef, &eb);
    expect_status(rc, GDN_ERR_SHAPE, "but the", "cu_seqlens ending past the ranks' tokens is refused");
    free(past);
    if (D > 1) { /* every rank claiming to start the stream */
        gdn_config c = gdn_config_default(1, 4, 1, 1, 8, 8);
        const int64_t cu[] = {0, 3, 4 * D};
        c.cu_seqlens = cu, c.n_docs = 2, c.threads = 1;
        gdn_plan *plan = NULL;
        gdn_cp *cp = NULL;
        float x[64] = {0}, o[64];
        rc = gdn_plan_create(&plan, &c);
        if (!rc) rc = gdn_cp_create(&cp, MPI_COMM_WORLD);
        if (!rc) rc = gdn_cp_forward(cp, plan, o, NULL, NULL,
                                     &(gdn_rule_inputs){.q = x, .k = x, .v = x, .g = x, .beta = x});
        expect_status(rc, GDN_ERR_SHAPE, "seq_offset 0 but the ranks before it hold 4",
                      "seq_offset 0 on every rank is refused");
        gdn_cp_destroy(cp);
        gdn_plan_destroy(plan);
    }
    free_case(&inside), free_case(&chunks), free_case(&many), free_case(&one), free_case(&edges);
    free(sizes);
    layer_cp_check();
}
