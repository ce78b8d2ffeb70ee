/* Packed variable-length sequences (cu_seqlens) on one rank: the packed forward and backward
 * equal each document run on its own through the single-rank path (and the packed double
 * oracle), documents starting anywhere within a chunk; the same comparison without the resets
 * must fail it; bad offsets are refused with a message. */
#include "harness.h"
#include "layer_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Packed vs per-document runs: the same chunks over the same tokens, so the differences are
 * rounding (column blocking, the order of head items); DESIGN §6's fp32 class. */
#define TOL_PACK 1e-5
/* Packed fp32 vs the packed double oracle: forward DESIGN §6 (1e-5), backward 1e-4. */
#define TOL_ORACLE_FWD 1e-5
#define TOL_ORACLE_BWD 1e-4

typedef struct {
    const char *label;
    int64_t T, Hk, Hv, K, V;
    const int64_t *cu;
    int64_t n_docs;
    int chunk, ckpt_chunks;
    gate_kind gate;
} pack_case;

/* Largest relative error over the eight tensors (each against its own scale). */
static double results_err(const pack_results *a, const pack_results *b, const gdn_config *c, int64_t ndocs, double *fwd) {
    const int64_t ns = ndocs * c->Hv * c->K * c->V;
    const double eo = fmax(rel_err_ff(a->o, b->o, n_v(c)), rel_err_ff(a->ht, b->ht, ns));
    double e = eo;
    e = fmax(e, rel_err_ff(a->dq, b->dq, n_qk(c)));
    e = fmax(e, rel_err_ff(a->dk, b->dk, n_qk(c)));
    e = fmax(e, rel_err_ff(a->dv, b->dv, n_v(c)));
    e = fmax(e, rel_err_ff(a->dg, b->dg, n_g(c)));
    e = fmax(e, rel_err_ff(a->dbeta, b->dbeta, n_g(c)));
    e = fmax(e, rel_err_ff(a->dh0, b->dh0, ns));
    if (fwd) *fwd = eo;
    return e;
}

static double *to_double(const float *x, int64_t n) {
    if (!x) return NULL;
    double *d = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
    for (int64_t i = 0; i < n; i++) d[i] = x[i];
    return d;
}

/* The packed double oracle (forward and backward) against the packed fp32 results. */
static void against_oracle(const pack_case *pc, const gdn_config *cfg, const problem *p, const float *h0,
                           const float *dout, const float *dht, const pack_results *r) {
    const int64_t ns = pc->n_docs * cfg->Hv * cfg->K * cfg->V;
    double *q = to_double(p->q, n_qk(cfg)), *k = to_double(p->k, n_qk(cfg)), *v = to_double(p->v, n_v(cfg));
    double *g = to_double(p->g, n_g(cfg)), *b = to_double(p->beta, n_g(cfg)), *h = to_double(h0, ns);
    double *ddo = to_double(dout, n_v(cfg)), *ddht = to_double(dht, ns);
    double *o = malloc(sizeof(double) * n_v(cfg)), *ht = malloc(sizeof(double) * ns);
    double *gq = malloc(sizeof(double) * n_qk(cfg)), *gk = malloc(sizeof(double) * n_qk(cfg));
    double *gv = malloc(sizeof(double) * n_v(cfg)), *gg = malloc(sizeof(double) * n_g(cfg));
    double *gb = malloc(sizeof(double) * n_g(cfg)), *gh = malloc(sizeof(double) * ns);
    int rc = gdn_reference_forward(cfg, o, ht,
                                   &(gdn_rule_inputs_f64){.q = q, .k = k, .v = v, .g = g, .beta = b,
                                                          .h0 = h});
    if (!rc) rc = gdn_reference_backward(cfg,
                                         &(gdn_rule_grads_f64){.dq = gq, .dk = gk, .dv = gv, .dg = gg,
                                                               .dbeta = gb, .dh0 = gh},
                                         &(gdn_rule_inputs_f64){.q = q, .k = k, .v = v, .g = g, .beta = b,
                                                                .h0 = h}, ddo, ddht);
    double ef = INFINITY, eb = INFINITY;
    if (!rc) {
        ef = fmax(rel_err_f32(r->o, o, n_v(cfg)), rel_err_f32(r->ht, ht, ns));
        eb = fmax(fmax(rel_err_f32(r->dq, gq, n_qk(cfg)), rel_err_f32(r->dk, gk, n_qk(cfg))),
                  fmax(rel_err_f32(r->dv, gv, n_v(cfg)), rel_err_f32(r->dg, gg, n_g(cfg))));
        eb = fmax(eb, fmax(rel_err_f32(r->dbeta, gb, n_g(cfg)), rel_err_f32(r->dh0, gh, ns)));
    }
    expect_close(ef, TOL_ORACLE_FWD, "%s: packed fp32 forward (o, ht per document) vs the packed double oracle",
                 pc->label);
    expect_close(eb, TOL_ORACLE_BWD, "%s: packed fp32 backward (dq dk dv dg dbeta, dh0 per document) vs the "
                 "packed double oracle", pc->label);
    free(q), free(k), free(v), free(g), free(b), free(h), free(ddo), free(ddht), free(o), free(ht);
    free(gq), free(gk), free(gv), free(gg), free(gb), free(gh);
}

static void run_case(const pack_case *pc, int with_oracle) {
    gdn_config cfg = gdn_config_default(1, pc->T, pc->Hk, pc->Hv, pc->K, pc->V);
    cfg.chunk = pc->chunk, cfg.threads = 2, cfg.checkpoint_chunks = pc->ckpt_chunks;
    cfg.cu_seqlens = pc->cu, cfg.n_docs = pc->n_docs;
    const int64_t ns = pc->n_docs * pc->Hv * pc->K * pc->V;
    problem p;
    problem_make(&p, cfg, pc->gate, BETA_RANDOM, 0, 9000 + pc->T + pc->n_docs);
    float *h0 = random_floats((size_t)ns), *dht = random_floats((size_t)ns), *dout = random_floats((size_t)n_v(&cfg));
    pack_results sep = pack_results_alloc(&cfg, pc->n_docs), pk = pack_results_alloc(&cfg, pc->n_docs),
            sv = pack_results_alloc(&cfg, pc->n_docs), bad = pack_results_alloc(&cfg, pc->n_docs);
    char shape[160];
    snprintf(shape, sizeof shape, "T=%lld docs=%lld Hk=%lld Hv=%lld K=%lld V=%lld C=%d", (long long)pc->T,
             (long long)pc->n_docs, (long long)pc->Hk, (long long)pc->Hv, (long long)pc->K, (long long)pc->V,
             pc->chunk);

    int rc = pack_run_separately(&cfg, &p, h0, dout, dht, &sep);
    check(rc == GDN_OK, "%s: every document alone through the single-rank path (%s)", pc->label, gdn_strerror(rc));
    double ef = INFINITY, e = INFINITY;
    rc = pack_run_plan(&cfg, &p, h0, dout, dht, 0, &pk);
    if (!rc) e = results_err(&pk, &sep, &cfg, pc->n_docs, &ef);
    expect_close(ef, TOL_PACK, "%s %s: packed forward (o, ht per document) == documents run separately", pc->label, shape);
    expect_close(e, TOL_PACK, "%s %s: packed forward + backward (all gradients, dh0 per document) == documents "
                 "run separately", pc->label, shape);
    /* The forward's saved states, checkpoint segments restarting within each document. */
    rc = pack_run_plan(&cfg, &p, h0, dout, dht, 1, &sv);
    e = rc ? INFINITY : results_err(&sv, &sep, &cfg, pc->n_docs, NULL);
    expect_close(e, TOL_PACK, "%s: gdn_forward_save + gdn_backward_saved packed (checkpoint every %d chunks) == "
                 "documents run separately", pc->label, pc->ckpt_chunks);
    /* Negative control: the same stream with the resets disabled (one dense sequence from the
     * first document's h0) through the same comparison. */
    if (pc->n_docs > 1) {
        gdn_config dense = cfg;
        dense.cu_seqlens = NULL, dense.n_docs = 0;
        rc = pack_run_plan(&dense, &p, h0, dout, dht, 0, &bad);
        ef = 0.0;
        if (!rc) results_err(&bad, &sep, &cfg, 1, &ef); /* the states of document 0 only */
        expect_far(ef, TOL_PACK, "%s: resets disabled (the stream as one dense sequence) vs documents run "
                   "separately", pc->label);
    }
    if (with_oracle) against_oracle(pc, &cfg, &p, h0, dout, dht, &pk);
    pack_results_free(&sep), pack_results_free(&pk), pack_results_free(&sv), pack_results_free(&bad);
    free(h0), free(dht), free(dout);
    problem_free(&p);
}

static void cases(void) {
    /* Documents ending exactly at chunk boundaries (C = 16), one token before and after them,
     * mid-chunk, of length 1, and a single document (packed == dense). */
    static const int64_t at_bounds[] = {0, 16, 48, 64};
    static const int64_t off_by_one[] = {0, 15, 33, 47, 64, 65, 81};
    static const int64_t mid_and_ones[] = {0, 7, 8, 9, 30, 31, 70, 71};
    static const int64_t ones[] = {0, 1, 2, 3, 4, 5, 6, 7, 8};
    static const int64_t one_doc[] = {0, 90};
    static const int64_t long_docs[] = {0, 100, 133, 250};
    const pack_case cs[] = {
        {"chunk boundaries", 64, 1, 2, 16, 24, at_bounds, 3, 16, 1, GATE_MILD},
        {"one token from chunk boundaries", 81, 2, 4, 16, 16, off_by_one, 6, 16, 1, GATE_MILD},
        {"mid-chunk and length-1 documents", 71, 1, 1, 24, 16, mid_and_ones, 7, 16, 2, GATE_STRONG},
        {"eight documents of one token", 8, 1, 2, 16, 16, ones, 8, 16, 1, GATE_MILD},
        {"a single document", 90, 1, 2, 16, 16, one_doc, 1, 32, 1, GATE_MILD},
        {"long documents, C=64", 250, 2, 4, 32, 32, long_docs, 3, 64, 1, GATE_MILD},
    };
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) run_case(&cs[i], 1);
}

/* Bad offsets are refused by the plan (and by the oracle) with a message naming the problem. */
static void bad_offsets(void) {
    gdn_config c = gdn_config_default(1, 10, 1, 1, 8, 8);
    gdn_plan *plan = NULL;
    static const int64_t not_increasing[] = {0, 6, 4, 10}, repeated[] = {0, 5, 5, 10};
    static const int64_t not_zero[] = {1, 5, 10}, short_end[] = {0, 5, 9}, long_end[] = {0, 5, 11};
    static const int64_t good[] = {0, 5, 10};
    const struct { const int64_t *cu; int64_t n; const char *needle, *what; } bad[] = {
        {not_increasing, 3, "strictly increasing", "cu_seqlens not increasing (0, 6, 4, 10)"},
        {repeated, 3, "strictly increasing", "cu_seqlens with an empty document (0, 5, 5, 10)"},
        {not_zero, 2, "start at 0", "cu_seqlens not starting at 0"},
        {short_end, 2, "cu_seqlens ends at 9 but the tokens reach 10", "cu_seqlens ending before T (0, 5, 9)"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        c.cu_seqlens = bad[i].cu, c.n_docs = bad[i].n;
        expect_status(gdn_plan_create(&plan, &c), GDN_ERR_SHAPE, bad[i].needle, "%s", bad[i].what);
        gdn_plan_destroy(plan), plan = NULL;
    }
    /* Ending past T: the plan may be a CP shard's, so the single-rank calls refuse it. */
    c.cu_seqlens = long_end, c.n_docs = 2;
    problem p;
    problem_make(&p, c, GATE_MILD, BETA_RANDOM, 0, 5);
    float o[10 * 8];
    int rc = gdn_plan_create(&plan, &c);
    expect_status(rc ? rc : gdn_forward(plan, o, NULL, RULE_INPUTS(&p, NULL)), GDN_ERR_SHAPE,
                  "must end at T = 10, it ends at 11", "cu_seqlens ending past T (0, 5, 11 with T = 10)");
    gdn_plan_destroy(plan), plan = NULL;
    c.cu_seqlens = good, c.n_docs = 2;
    c.B = 2;
    expect_status(gdn_plan_create(&plan, &c), GDN_ERR_SHAPE, "need B = 1", "cu_seqlens with B = 2");
    c.B = 1, c.n_docs = 0;
    expect_status(gdn_plan_create(&plan, &c), GDN_ERR_SHAPE, "n_docs must be >= 1", "cu_seqlens with n_docs 0");
    c.cu_seqlens = NULL, c.n_docs = 2;
    expect_status(gdn_plan_create(&plan, &c), GDN_ERR_ARG, "without cu_seqlens", "n_docs without cu_seqlens");
    double dq[80], dsrc[80] = {0};
    c.cu_seqlens = short_end, c.n_docs = 2;
    expect_status(gdn_reference_forward(&c, dq, NULL,
                                        &(gdn_rule_inputs_f64){.q = dsrc, .k = dsrc, .v = dsrc, .g = dsrc,
                                                               .beta = dsrc}), GDN_ERR_SHAPE,
                  "ends at 9 but the tokens reach 10", "oracle: cu_seqlens ending before T");
    /* The control: good offsets plan and run. */
    c.cu_seqlens = good, c.n_docs = 2;
    rc = gdn_plan_create(&plan, &c);
    expect_status(rc ? rc : gdn_forward(plan, o, NULL, RULE_INPUTS(&p, NULL)), GDN_OK, NULL,
                  "control: cu_seqlens (0, 5, 10) with T = 10, B = 1");
    gdn_plan_destroy(plan);
    problem_free(&p);
}

/* The packed layer vs its documents run alone: the same GEMMs row by row and the same kernel
 * chunks, so y and dx differ by rounding; dw sums the documents' in another order. */
#define TOL_LAYER 1e-5
#define TOL_LAYER_DW 2e-5

enum { LAYER_PACKED, LAYER_DENSE, LAYER_NO_CONV_RESTART };

/* One packed layer call (forward with saved, backward) in `mode`; its errors against ref. */
static void layer_errors(const gdn_layer_config *c, int mode, const float *w, const float *x, const float *dy,
                         const float *y_ref, const float *dx_ref, const float *dw_ref, double *ey, double *edx,
                         double *edw) {
    gdn_layer_config lc = *c;
    if (mode == LAYER_DENSE) lc.cu_seqlens = NULL, lc.n_docs = 0;
    const int64_t N = c->T * c->E, nw = (int64_t)gdn_layer_param_floats(c);
    float *y = calloc((size_t)N, sizeof(float)), *dx = calloc((size_t)N, sizeof(float));
    float *dw = calloc((size_t)nw, sizeof(float)), *saved = NULL;
    gdn_layer_plan *lp = NULL;
    int rc = gdn_layer_plan_create(&lp, &lc);
    int64_t *doc_begin = lp ? lp->doc_begin : NULL;
    if (!rc && mode == LAYER_NO_CONV_RESTART) lp->doc_begin = NULL; /* the recurrence resets, the conv not */
    if (!rc) saved = calloc(gdn_layer_saved_floats(lp) + 1, sizeof(float));
    if (!rc) rc = gdn_layer_forward(lp, y, saved, x, w, NULL, NULL);
    if (!rc) rc = gdn_layer_backward(lp, dx, dw, x, w, saved, dy);
    *ey = rc ? INFINITY : rel_err_ff(y, y_ref, N);
    *edx = rc ? INFINITY : rel_err_ff(dx, dx_ref, N);
    *edw = rc ? INFINITY : rel_err_ff(dw, dw_ref, nw);
    if (lp) lp->doc_begin = doc_begin;
    gdn_layer_plan_destroy(lp);
    free(y), free(dx), free(dw), free(saved);
}

/* A packed prefill returns every document's final caches (conv_state [n_docs, cd, Kc], rec_state
 * [n_docs, Hv, K, V]) equal to each document run alone through the dense layer from zero caches,
 * documents shorter than the conv included (zero columns before their start); then one decode
 * step with B = n_docs from those caches equals each document's next token run alone. Control:
 * the caches of a dense layer over the whole stream. Non-zero caches on entry are refused. */
static void packed_caches(const int64_t *cu, int64_t nd) {
    gdn_layer_config c = gdn_layer_config_default(1, cu[nd], 24, 1, 2, 16, 16);
    c.cu_seqlens = cu, c.n_docs = nd, c.threads = 1;
    rng_seed(41);
    float *w = layer_random_weights(&c, 0.05, 1);
    const int64_t T = c.T, E = c.E, nc = c.Kc * gdn_layer_conv_dim(&c), ns = c.Hv * c.K * c.V;
    float *x = random_floats((size_t)(T * E)), *y = calloc((size_t)(T * E), sizeof(float));
    float *conv = calloc((size_t)(nd * nc), sizeof(float)), *rec = calloc((size_t)(nd * ns), sizeof(float));
    float *conv_ref = calloc((size_t)(nd * nc), sizeof(float)), *rec_ref = calloc((size_t)(nd * ns), sizeof(float));
    float *conv_dense = calloc((size_t)nc, sizeof(float)), *rec_dense = calloc((size_t)ns, sizeof(float));
    float *xn = random_floats((size_t)(nd * E)), *yn = calloc((size_t)(nd * E), sizeof(float));
    float *yn_ref = calloc((size_t)(nd * E), sizeof(float));
    gdn_layer_plan *lp = NULL;
    int rc = gdn_layer_plan_create(&lp, &c);
    if (!rc) rc = gdn_layer_forward(lp, y, NULL, x, w, conv, rec);
    check(rc == GDN_OK, "packed layer prefill returning per-document caches (%s)", rc ? gdn_errmsg() : "ok");
    /* each document alone (dense, zero caches), then its next token (decode, B = 1) */
    int ok = 1;
    for (int64_t d = 0; d < nd; d++) {
        gdn_layer_config cd = c;
        cd.cu_seqlens = NULL, cd.n_docs = 0, cd.T = cu[d + 1] - cu[d];
        gdn_layer_plan *pd = NULL;
        float *yd = calloc((size_t)(cd.T * E), sizeof(float));
        ok &= gdn_layer_plan_create(&pd, &cd) == GDN_OK &&
              gdn_layer_forward(pd, yd, NULL, x + cu[d] * E, w, conv_ref + d * nc, rec_ref + d * ns) == GDN_OK;
        gdn_layer_plan_destroy(pd);
        cd.T = 1;
        ok &= gdn_layer_plan_create(&pd, &cd) == GDN_OK &&
              gdn_layer_decode(pd, yn_ref + d * E, xn + d * E, w, conv_ref + d * nc, rec_ref + d * ns) == GDN_OK;
        gdn_layer_plan_destroy(pd);
        free(yd);
    }
    check(ok, "each document alone through the dense layer with caches, then one decode step");
    /* the caches after the prefill: compare before decoding moves them */
    gdn_layer_config cb = c;
    cb.cu_seqlens = NULL, cb.n_docs = 0, cb.B = nd, cb.T = 1;
    gdn_layer_plan *pb = NULL;
    float *conv_pre = malloc(sizeof(float) * (size_t)(nd * nc)), *rec_pre = malloc(sizeof(float) * (size_t)(nd * ns));
    memcpy(conv_pre, conv, sizeof(float) * (size_t)(nd * nc)), memcpy(rec_pre, rec, sizeof(float) * (size_t)(nd * ns));
    rc = gdn_layer_plan_create(&pb, &cb);
    if (!rc) rc = gdn_layer_decode(pb, yn, xn, w, conv, rec);
    check(rc == GDN_OK, "one decode step with B = %lld from the packed caches", (long long)nd);
    expect_close(rel_err_ff(conv, conv_ref, nd * nc), TOL_LAYER, "packed prefill + decode: conv caches == each "
                 "document alone (documents of 1 and 2 tokens, Kc = %lld)", (long long)c.Kc);
    expect_close(rel_err_ff(rec, rec_ref, nd * ns), TOL_LAYER, "packed prefill + decode: recurrent states == each "
                 "document alone");
    expect_close(rel_err_ff(yn, yn_ref, nd * E), TOL_LAYER, "decode after the packed prefill: y == each document's");
    /* control: the first document start left out (documents 0 and 1 merged): the merged
     * document's caches vs document 1's alone (it ends where document 1 ends) */
    int64_t merged[16];
    merged[0] = 0;
    for (int64_t d = 2; d <= nd; d++) merged[d - 1] = cu[d];
    gdn_layer_config cm = c;
    cm.cu_seqlens = merged, cm.n_docs = nd - 1;
    gdn_layer_plan *pm = NULL;
    memset(conv_dense, 0, sizeof(float) * (size_t)nc), memset(rec_dense, 0, sizeof(float) * (size_t)ns);
    float *conv_m = calloc((size_t)(nd * nc), sizeof(float)), *rec_m = calloc((size_t)(nd * ns), sizeof(float));
    if (!gdn_layer_plan_create(&pm, &cm)) gdn_layer_forward(pm, y, NULL, x, w, conv_m, rec_m);
    gdn_layer_plan_destroy(pm);
    /* conv_ref / rec_ref were moved on by the decode step: the packed ones before it are conv_pre */
    float *conv_one = calloc((size_t)nc, sizeof(float)), *rec_one = calloc((size_t)ns, sizeof(float));
    {
        gdn_layer_config c1 = cm;
        c1.cu_seqlens = NULL, c1.n_docs = 0, c1.T = cu[2] - cu[1];
        gdn_layer_plan *p1 = NULL;
        float *y1 = calloc((size_t)(c1.T * E), sizeof(float));
        if (!gdn_layer_plan_create(&p1, &c1)) gdn_layer_forward(p1, y1, NULL, x + cu[1] * E, w, conv_one, rec_one);
        gdn_layer_plan_destroy(p1);
        free(y1);
    }
    expect_close(fmax(rel_err_ff(conv_pre + nc, conv_one, nc), rel_err_ff(rec_pre + ns, rec_one, ns)), TOL_LAYER,
                 "packed prefill: document 1's (1 token) caches == it alone");
    expect_far(fmax(rel_err_ff(conv_m, conv_one, nc), rel_err_ff(rec_m, rec_one, ns)), TOL_LAYER,
               "documents 0 and 1 merged (no reset): the merged caches vs document 1 alone");
    free(conv_m), free(rec_m), free(conv_one), free(rec_one);
    /* non-zero caches on entry are refused, naming the tensor */
    memset(conv_pre, 0, sizeof(float) * (size_t)(nd * nc)), memset(rec_pre, 0, sizeof(float) * (size_t)(nd * ns));
    conv_pre[3] = 0.5f, rec_pre[ns + 2] = 1.0f;
    expect_status(gdn_layer_forward(lp, y, NULL, x, w, conv_pre, NULL), GDN_ERR_ARG, "conv_state[3]",
                  "packed layer forward with a non-zero conv_state on entry");
    expect_status(gdn_layer_forward(lp, y, NULL, x, w, NULL, rec_pre), GDN_ERR_ARG, "rec_state[",
                  "packed layer forward with a non-zero rec_state on entry");
    gdn_layer_plan_destroy(lp), gdn_layer_plan_destroy(pb);
    free(w), free(x), free(y), free(conv), free(rec), free(conv_ref), free(rec_ref), free(conv_dense), free(rec_dense);
    free(xn), free(yn), free(yn_ref), free(conv_pre), free(rec_pre);
}

static void layer_cases(void) {
    /* Documents shorter than the conv (1, 2 tokens), one starting mid-chunk, C = 16, Kc = 4. */
    static const int64_t cu[] = {0, 5, 6, 8, 23, 40};
    for (int keep = 0; keep < 2; keep++) {
        gdn_layer_config c = gdn_layer_config_default(1, 40, 24, 1, 2, 16, 16);
        c.threads = 2, c.chunk = 16, c.keep = keep, c.cu_seqlens = cu, c.n_docs = 5;
        rng_seed(31 + keep);
        float *w = layer_random_weights(&c, 0.05, 1);
        const int64_t N = c.T * c.E, nw = (int64_t)gdn_layer_param_floats(&c);
        float *x = random_floats((size_t)N), *dy = random_floats((size_t)N);
        float *y_ref = calloc((size_t)N, sizeof(float)), *dx_ref = calloc((size_t)N, sizeof(float));
        float *dw_ref = calloc((size_t)nw, sizeof(float));
        int rc = pack_layer_separately(&c, w, x, dy, y_ref, dx_ref, dw_ref);
        check(rc == GDN_OK, "layer: every document alone through the dense layer (%s)", gdn_strerror(rc));
        double ey, edx, edw;
        const char *kname = keep ? "KEEP_PROJ" : "KEEP_MIN";
        layer_errors(&c, LAYER_PACKED, w, x, dy, y_ref, dx_ref, dw_ref, &ey, &edx, &edw);
        expect_close(ey, TOL_LAYER, "layer %s T=40 docs 5,1,2,15,17 Kc=4: packed y == documents run alone", kname);
        expect_close(edx, TOL_LAYER, "layer %s: packed dx == documents run alone", kname);
        expect_close(edw, TOL_LAYER_DW, "layer %s: packed dw == sum of the documents' dw", kname);
        layer_errors(&c, LAYER_DENSE, w, x, dy, y_ref, dx_ref, dw_ref, &ey, &edx, &edw);
        expect_far(ey, TOL_LAYER, "layer %s: no resets at all (dense layer on the stream) vs documents alone", kname);
        layer_errors(&c, LAYER_NO_CONV_RESTART, w, x, dy, y_ref, dx_ref, dw_ref, &ey, &edx, &edw);
        expect_far(ey, TOL_LAYER, "layer %s: the conv reading across document starts (recurrence reset) vs "
                   "documents alone", kname);
        expect_far(edx, TOL_LAYER, "layer %s: the conv's backward across document starts, dx", kname);
        free(w), free(x), free(dy), free(y_ref), free(dx_ref), free(dw_ref);
    }
    packed_caches(cu, 5);
}

/* One packed plan given a step's documents with gdn_plan_set_docs (the trainer's use): made with
 * one document, then set to five (starts mid-chunk, at a chunk boundary and one past it, a
 * one-token document), its saved-state forward and backward equal every document run alone,
 * within the checkpoint buffer sized when the plan was made. Control: the plan set back to one
 * document. Refusals: a dense plan; bad offsets, after which the plan keeps its documents. */
static void set_docs(void) {
    enum { T = 200 };
    gdn_config c = gdn_config_default(1, T, 1, 2, 16, 16);
    static const int64_t one[] = {0, T}, five[] = {0, 3, 64, 65, 130, T}, bad[] = {0, 70, 70, T};
    c.cu_seqlens = one, c.n_docs = 1;
    problem p;
    problem_make(&p, c, GATE_MILD, BETA_RANDOM, 0, 31);
    float *dout = malloc(sizeof(float) * (size_t)n_v(&c));
    for (int64_t i = 0; i < n_v(&c); i++) dout[i] = (float)rng_uniform(-1, 1);
    gdn_plan *plan = NULL;
    if (gdn_plan_create(&plan, &c)) {
        check(0, "packed plan with one document: %s", gdn_errmsg());
        problem_free(&p), free(dout);
        return;
    }
    const size_t ckpt_floats = gdn_plan_checkpoint_floats(plan);
    float *ckpt = calloc(ckpt_floats + 1, sizeof(float));
    gdn_config c5 = c;
    c5.cu_seqlens = five, c5.n_docs = 5;
    pack_results ref = pack_results_alloc(&c5, 5), got = pack_results_alloc(&c5, 5);
    check(pack_run_separately(&c5, &p, NULL, dout, NULL, &ref) == GDN_OK, "five documents run alone");
    double err[2];
    for (int control = 0; control < 2; control++) {
        int rc = control ? gdn_plan_set_docs(plan, one, 1, 0) : gdn_plan_set_docs(plan, five, 5, 0);
        if (!rc) rc = gdn_forward_save(plan, got.o, got.ht, ckpt, RULE_INPUTS(&p, NULL));
        if (!rc) rc = gdn_backward_saved(plan,
                                         &(gdn_rule_grads){.dq = got.dq, .dk = got.dk, .dv = got.dv,
                                                           .dg = got.dg, .dbeta = got.dbeta, .dh0 = got.dh0},
                                         RULE_INPUTS(&p, NULL), ckpt, dout, NULL);
        check(rc == GDN_OK && gdn_plan_checkpoint_floats(plan) <= ckpt_floats,
              "gdn_plan_set_docs to %s document%s: forward_save + backward_saved within the plan's first %zu "
              "saved floats", control ? "one" : "five", control ? "" : "s", ckpt_floats);
        /* ht and dh0 of the one-document run are its document 0's: compare the token tensors */
        got.ht[0] = ref.ht[0];
        err[control] = results_err(&got, &ref, &c, control ? 1 : 5, NULL);
    }
    expect_close(err[0], TOL_PACK, "a plan made with one document, set to five, vs each run alone");
    expect_far(err[1], TOL_PACK, "the same plan set back to one document (no resets) vs the five run alone");

    gdn_plan_set_docs(plan, five, 5, 0);
    float *o_before = malloc(sizeof(float) * (size_t)n_v(&c)), *o_after = malloc(sizeof(float) * (size_t)n_v(&c));
    gdn_forward(plan, o_before, NULL, RULE_INPUTS(&p, NULL));
    expect_status(gdn_plan_set_docs(plan, bad, 3, 0), GDN_ERR_SHAPE, "strictly increasing",
                  "gdn_plan_set_docs with an empty document (0, 70, 70, T)");
    expect_status(gdn_plan_set_docs(plan, five, 5, 1), GDN_ERR_SHAPE, "seq_offset",
                  "gdn_plan_set_docs with tokens past the offsets' end (seq_offset 1)");
    gdn_forward(plan, o_after, NULL, RULE_INPUTS(&p, NULL));
    expect_close(rel_err_ff(o_after, o_before, n_v(&c)), 0.0, "after refused offsets the plan keeps its five documents");
    gdn_plan_destroy(plan), plan = NULL;
    c.cu_seqlens = NULL, c.n_docs = 0;
    if (!gdn_plan_create(&plan, &c))
        expect_status(gdn_plan_set_docs(plan, five, 5, 0), GDN_ERR_ARG, "made dense", "gdn_plan_set_docs on a dense plan");
    gdn_plan_destroy(plan);
    pack_results_free(&ref), pack_results_free(&got);
    free(ckpt), free(dout), free(o_before), free(o_after);
    problem_free(&p);
}

void test_pack(void) {
    cases();
    bad_offsets();
    set_docs();
    layer_cases();
}
