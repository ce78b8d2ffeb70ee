/* The oracle: the gated delta rule token by token in double precision (DESIGN §2).
 * Deliberately plain — every fast path is tested against this. */
#include "kernel_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Normalised (optional) and scaled copy of one head vector. */
static void prep(double *dst, const double *src, int64_t n, int l2norm, double scale) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += src[i] * src[i];
    double inv = l2norm ? 1.0 / sqrt(ss + 1e-6) : 1.0;
    for (int64_t i = 0; i < n; i++) dst[i] = src[i] * inv * scale;
}

static int check_inputs_f64(const gdn_config *c, const double *q, const double *k,
                            const double *v, const double *g, const double *beta,
                            const double *h0) {
    const struct { const char *name; const double *p; int64_t n; } t[] = {
        {"q", q, c->B * c->T * c->Hk * c->K}, {"k", k, c->B * c->T * c->Hk * c->K},
        {"v", v, c->B * c->T * c->Hv * c->V}, {"g", g, c->B * c->T * c->Hv},
        {"beta", beta, c->B * c->T * c->Hv}, {"h0", h0, gdn_state_floats(c)}};
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        if (!t[i].p) {
            if (i == 5) continue; /* h0 is optional */
            return gdn_fail(GDN_ERR_ARG, "input '%s' is NULL", t[i].name);
        }
        if (c->check_finite) {
            int64_t at = gdn_find_nonfinite_f64(t[i].p, t[i].n);
            if (at >= 0)
                return gdn_fail_nonfinite("input", t[i].name, t[i].p[at], at);
        }
    }
    return GDN_OK;
}

int gdn_reference_forward(const gdn_config *cfg, double *o, double *ht, const gdn_rule_inputs_f64 *in) {
    int rc = gdn_config_check(cfg);
    if (rc || (rc = gdn_pack_check_whole(cfg))) return rc;
    if (!o) return gdn_fail(GDN_ERR_ARG, "output 'o' is NULL");
    if (!in) return gdn_fail(GDN_ERR_ARG, "inputs 'in' (gdn_rule_inputs_f64) is NULL");
    const double *q = in->q, *k = in->k, *v = in->v, *g = in->g, *beta = in->beta, *h0 = in->h0;
    rc = check_inputs_f64(cfg, q, k, v, g, beta, h0);
    if (rc) return rc;
    if (cfg->compute == GDN_COMPUTE_BF16) return gdn_reference_forward_bf16(cfg, o, ht, in);
    const int64_t B = cfg->B, T = cfg->T, Hk = cfg->Hk, Hv = cfg->Hv, K = cfg->K, V = cfg->V;
    const int64_t r = Hv / Hk;
    const double scale = cfg->scale != 0.0f ? (double)cfg->scale : 1.0 / sqrt((double)K);
    double *S = gdn_malloc("reference: S", sizeof(double) * (K * V + 2 * K + V));
    if (!S) return gdn_fail(GDN_ERR_NOMEM, "oracle state (%lld doubles)", (long long)(K * V));
    double *qt = S + K * V, *kt = qt + K, *d = kt + K;
    /* A packed stream (B = 1) restarts the state at every document start, from that document's
     * h0 (or zeros), and ends each document with its own final state; dense: one per row. */
    const int64_t *cu = cfg->cu_seqlens, nseq = cu ? cfg->n_docs : 1;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hv; h++)
          for (int64_t sq = 0; sq < nseq; sq++) {
            const int64_t hk = h / r, sidx = cu ? sq : b, t_begin = cu ? cu[sq] : 0, t_end = cu ? cu[sq + 1] : T;
            if (h0) memcpy(S, h0 + (sidx * Hv + h) * K * V, sizeof(double) * K * V);
            else memset(S, 0, sizeof(double) * K * V);
            for (int64_t t = t_begin; t < t_end; t++) {
                const int64_t row = b * T + t;
                prep(qt, q + (row * Hk + hk) * K, K, cfg->l2norm, scale);
                prep(kt, k + (row * Hk + hk) * K, K, cfg->l2norm, 1.0);
                const double *vt = v + (row * Hv + h) * V;
                const double decay = exp(g[row * Hv + h]), bt = beta[row * Hv + h];
                for (int64_t i = 0; i < K * V; i++) S[i] *= decay;
                for (int64_t j = 0; j < V; j++) {
                    double ks = 0.0;
                    for (int64_t i = 0; i < K; i++) ks += kt[i] * S[i * V + j];
                    d[j] = bt * (vt[j] - ks);
                }
                for (int64_t i = 0; i < K; i++)
                    for (int64_t j = 0; j < V; j++) S[i * V + j] += kt[i] * d[j];
                double *ot = o + (row * Hv + h) * V;
                for (int64_t j = 0; j < V; j++) {
                    double acc = 0.0;
                    for (int64_t i = 0; i < K; i++) acc += qt[i] * S[i * V + j];
                    ot[j] = acc;
                }
            }
            if (ht) memcpy(ht + (sidx * Hv + h) * K * V, S, sizeof(double) * K * V);
        }
    free(S);
    return GDN_OK;
}
