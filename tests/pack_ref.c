/* Packed documents (cu_seqlens): the reference the packed tests compare with — every document
 * run alone through the dense single-rank path — shared by the single-rank and CP tests. */
#include "harness.h"

#include <stdlib.h>
#include <string.h>

static float *zalloc(int64_t n) { return calloc((size_t)(n > 0 ? n : 1), sizeof(float)); }

pack_results pack_results_alloc(const gdn_config *c, int64_t ndocs) {
    const int64_t ns = ndocs * c->Hv * c->K * c->V;
    pack_results r = {zalloc(n_v(c)), zalloc(ns), zalloc(n_qk(c)), zalloc(n_qk(c)), zalloc(n_v(c)),
                      zalloc(n_g(c)), zalloc(n_g(c)), zalloc(ns)};
    return r;
}
void pack_results_free(pack_results *r) {
    free(r->o), free(r->ht), free(r->dq), free(r->dk), free(r->dv), free(r->dg), free(r->dbeta), free(r->dh0);
}

/* Rows [t0, t0 + n) of a [1, T, inner] tensor, copied out or back in. */
static float *rows_of(const float *x, int64_t t0, int64_t n, int64_t inner) {
    float *out = zalloc(n * inner);
    memcpy(out, x + t0 * inner, sizeof(float) * n * inner);
    return out;
}
static void rows_into(float *dst, const float *src, int64_t t0, int64_t n, int64_t inner) {
    memcpy(dst + t0 * inner, src, sizeof(float) * n * inner);
}

/* One plan for cfg: forward (o, ht), then the backward (with the forward's saved states when
 * saved is set). h0, dht: [states, Hv, K, V] or NULL. */
int pack_run_plan(const gdn_config *cfg, const problem *p, const float *h0, const float *dout,
                  const float *dht, int saved, pack_results *r) {
    gdn_plan *plan = NULL;
    int rc = gdn_plan_create(&plan, cfg);
    float *ckpt = NULL;
    if (!rc && saved) {
        ckpt = zalloc((int64_t)gdn_plan_checkpoint_floats(plan));
        rc = gdn_forward_save(plan, r->o, r->ht, ckpt, RULE_INPUTS(p, h0));
        if (!rc)
            rc = gdn_backward_saved(plan,
                                    &(gdn_rule_grads){.dq = r->dq, .dk = r->dk, .dv = r->dv, .dg = r->dg,
                                                      .dbeta = r->dbeta, .dh0 = r->dh0}, RULE_INPUTS(p, h0),
                                    ckpt, dout, dht);
    } else if (!rc) {
        rc = gdn_forward(plan, r->o, r->ht, RULE_INPUTS(p, h0));
        if (!rc)
            rc = gdn_backward(plan,
                              &(gdn_rule_grads){.dq = r->dq, .dk = r->dk, .dv = r->dv, .dg = r->dg,
                                                .dbeta = r->dbeta, .dh0 = r->dh0}, RULE_INPUTS(p, h0), dout,
                              dht);
    }
    free(ckpt);
    gdn_plan_destroy(plan);
    return rc;
}

/* The reference: every document alone through the dense single-rank path, from its h0, with
 * its dht, the results placed back at the document's rows and state index. */
int pack_run_separately(const gdn_config *full, const problem *p, const float *h0, const float *dout,
                        const float *dht, pack_results *r) {
    const int64_t Hk = full->Hk, Hv = full->Hv, K = full->K, V = full->V, ns = Hv * K * V;
    for (int64_t d = 0; d < full->n_docs; d++) {
        const int64_t t0 = full->cu_seqlens[d], n = full->cu_seqlens[d + 1] - t0;
        gdn_config c = *full;
        c.cu_seqlens = NULL, c.n_docs = 0, c.T = n;
        problem pd = {c, rows_of(p->q, t0, n, Hk * K), rows_of(p->k, t0, n, Hk * K), rows_of(p->v, t0, n, Hv * V),
                      rows_of(p->g, t0, n, Hv), rows_of(p->beta, t0, n, Hv), NULL};
        float *dod = rows_of(dout, t0, n, Hv * V);
        pack_results rd = pack_results_alloc(&c, 1);
        const int rc = pack_run_plan(&c, &pd, h0 ? h0 + d * ns : NULL, dod, dht ? dht + d * ns : NULL, 0, &rd);
        rows_into(r->o, rd.o, t0, n, Hv * V), rows_into(r->dv, rd.dv, t0, n, Hv * V);
        rows_into(r->dq, rd.dq, t0, n, Hk * K), rows_into(r->dk, rd.dk, t0, n, Hk * K);
        rows_into(r->dg, rd.dg, t0, n, Hv), rows_into(r->dbeta, rd.dbeta, t0, n, Hv);
        memcpy(r->ht + d * ns, rd.ht, sizeof(float) * ns), memcpy(r->dh0 + d * ns, rd.dh0, sizeof(float) * ns);
        pack_results_free(&rd);
        free(dod), free(pd.q), free(pd.k), free(pd.v), free(pd.g), free(pd.beta);
        if (rc) return rc;
    }
    return GDN_OK;
}


int pack_layer_separately(const gdn_layer_config *full, const float *w, const float *x, const float *dy,
                          float *y, float *dx, float *dw) {
    const int64_t E = full->E, nw = (int64_t)gdn_layer_param_floats(full);
    float *dwd = zalloc(nw);
    memset(dw, 0, sizeof(float) * (size_t)nw);
    int rc = GDN_OK;
    for (int64_t d = 0; d < full->n_docs && !rc; d++) {
        const int64_t t0 = full->cu_seqlens[d], n = full->cu_seqlens[d + 1] - t0;
        gdn_layer_config c = *full;
        c.cu_seqlens = NULL, c.n_docs = 0, c.seq_offset = 0, c.T = n;
        gdn_layer_plan *lp = NULL;
        rc = gdn_layer_plan_create(&lp, &c);
        float *saved = rc ? NULL : zalloc((int64_t)gdn_layer_saved_floats(lp));
        if (!rc) rc = gdn_layer_forward(lp, y + t0 * E, saved, x + t0 * E, w, NULL, NULL);
        if (!rc) rc = gdn_layer_backward(lp, dx + t0 * E, dwd, x + t0 * E, w, saved, dy + t0 * E);
        for (int64_t i = 0; !rc && i < nw; i++) dw[i] += dwd[i];
        free(saved);
        gdn_layer_plan_destroy(lp);
    }
    free(dwd);
    return rc;
}
