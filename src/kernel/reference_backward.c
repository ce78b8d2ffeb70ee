/* The oracle's backward: the reverse token loop in double precision, the adjoint of
 * reference.c step by step. States are kept for every token of one (batch row, value head)
 * stream at a time — simple, not frugal: this is the reference, not the fast path. */
#include "kernel_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* x_hat = scale * x / n, n = sqrt(|x|^2 + eps) (or scale * x without the norm). */
static double prep_norm(double *dst, const double *src, int64_t n, int l2norm, double scale) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += src[i] * src[i];
    double nrm = l2norm ? sqrt(ss + 1e-6) : 1.0;
    for (int64_t i = 0; i < n; i++) dst[i] = src[i] / nrm * scale;
    return nrm;
}

/* Gradient with respect to the raw x, given dxh with respect to x_hat, added into dx. */
static void norm_backward(double *dx, const double *dxh, const double *x, int64_t n, int l2norm,
                          double scale, double nrm) {
    if (!l2norm) {
        for (int64_t i = 0; i < n; i++) dx[i] += scale * dxh[i];
        return;
    }
    double dot = 0.0;
    for (int64_t i = 0; i < n; i++) dot += x[i] * dxh[i];
    const double n3 = nrm * nrm * nrm;
    for (int64_t i = 0; i < n; i++) dx[i] += scale * (dxh[i] / nrm - x[i] * dot / n3);
}

int gdn_reference_backward(const gdn_config *cfg, const gdn_rule_grads_f64 *grads,
                           const gdn_rule_inputs_f64 *in, const double *dout, const double *dht) {
    int rc = gdn_config_check(cfg);
    if (rc || (rc = gdn_pack_check_whole(cfg))) return rc;
    if (!grads) return gdn_fail(GDN_ERR_ARG, "gradients 'grads' (gdn_rule_grads_f64) is NULL");
    if (!in) return gdn_fail(GDN_ERR_ARG, "inputs 'in' (gdn_rule_inputs_f64) is NULL");
    double *dq = grads->dq, *dk = grads->dk, *dv = grads->dv, *dg = grads->dg, *dbeta = grads->dbeta,
           *dh0 = grads->dh0;
    const double *q = in->q, *k = in->k, *v = in->v, *g = in->g, *beta = in->beta, *h0 = in->h0;
    const char *miss = !dq ? "dq" : !dk ? "dk" : !dv ? "dv" : !dg ? "dg" : !dbeta ? "dbeta" : NULL;
    if (miss) return gdn_fail(GDN_ERR_ARG, "gradient output '%s' is NULL", miss);
    miss = !q ? "q" : !k ? "k" : !v ? "v" : !g ? "g" : !beta ? "beta" : !dout ? "do" : NULL;
    if (miss) return gdn_fail(GDN_ERR_ARG, "input '%s' is NULL", miss);
    const int64_t B = cfg->B, T = cfg->T, Hk = cfg->Hk, Hv = cfg->Hv, K = cfg->K, V = cfg->V;
    const int64_t r = Hv / Hk, KV = K * V;
    const double scale = cfg->scale != 0.0f ? (double)cfg->scale : 1.0 / sqrt((double)K);
    /* states[t] = S_t (after token t), states[0] = S_0; plus per-token scratch. */
    double *states = gdn_malloc("reference_backward: states", sizeof(double) * ((T + 1) * KV + KV + 4 * K + 3 * V));
    if (!states) return gdn_fail(GDN_ERR_NOMEM, "oracle backward states (%lld doubles)", (long long)((T + 1) * KV));
    double *dS = states + (T + 1) * KV, *qh = dS + KV, *kh = qh + K, *dqh = kh + K, *dkh = dqh + K;
    double *d = dkh + K, *dd = d + V, *kS = dd + V;
    memset(dq, 0, sizeof(double) * B * T * Hk * K);
    memset(dk, 0, sizeof(double) * B * T * Hk * K);
    /* A packed stream (B = 1): each document from its own h0 (or zeros) to its own final
     * state, the states of a document indexed from its first token; dense: one per row. */
    const int64_t *cu = cfg->cu_seqlens, nseq = cu ? cfg->n_docs : 1;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hv; h++)
          for (int64_t sq = 0; sq < nseq; sq++) {
            const int64_t hk = h / r, sidx = cu ? sq : b, t_begin = cu ? cu[sq] : 0, t_end = cu ? cu[sq + 1] : T;
            double *S0 = states;
            if (h0) memcpy(S0, h0 + (sidx * Hv + h) * KV, sizeof(double) * KV);
            else memset(S0, 0, sizeof(double) * KV);
            for (int64_t t = t_begin; t < t_end; t++) { /* forward, keeping every state */
                const int64_t row = b * T + t;
                prep_norm(kh, k + (row * Hk + hk) * K, K, cfg->l2norm, 1.0);
                const double *vt = v + (row * Hv + h) * V;
                const double decay = exp(g[row * Hv + h]), bt = beta[row * Hv + h];
                const double *Sp = states + (t - t_begin) * KV;
                double *Sn = states + (t - t_begin + 1) * KV;
                for (int64_t i = 0; i < KV; i++) Sn[i] = decay * Sp[i];
                for (int64_t j = 0; j < V; j++) {
                    double acc = 0.0;
                    for (int64_t i = 0; i < K; i++) acc += kh[i] * Sn[i * V + j];
                    d[j] = bt * (vt[j] - acc);
                }
                for (int64_t i = 0; i < K; i++)
                    for (int64_t j = 0; j < V; j++) Sn[i * V + j] += kh[i] * d[j];
            }
            if (dht) memcpy(dS, dht + (sidx * Hv + h) * KV, sizeof(double) * KV);
            else memset(dS, 0, sizeof(double) * KV);
            for (int64_t t = t_end - 1; t >= t_begin; t--) { /* reverse */
                const int64_t row = b * T + t;
                const double *qraw = q + (row * Hk + hk) * K, *kraw = k + (row * Hk + hk) * K;
                const double qn = prep_norm(qh, qraw, K, cfg->l2norm, scale);
                const double kn = prep_norm(kh, kraw, K, cfg->l2norm, 1.0);
                const double *vt = v + (row * Hv + h) * V, *dot = dout + (row * Hv + h) * V;
                const double gt = g[row * Hv + h], decay = exp(gt), bt = beta[row * Hv + h];
                const double *Sp = states + (t - t_begin) * KV, *St = states + (t - t_begin + 1) * KV;
                /* o = S_t^T qh */
                for (int64_t i = 0; i < K; i++) {
                    double acc = 0.0;
                    for (int64_t j = 0; j < V; j++) acc += St[i * V + j] * dot[j];
                    dqh[i] = acc;
                }
                for (int64_t i = 0; i < K; i++)
                    for (int64_t j = 0; j < V; j++) dS[i * V + j] += qh[i] * dot[j];
                /* S_t = Sa + kh d^T with Sa = decay S_{t-1}, d = beta (v - Sa^T kh) */
                for (int64_t j = 0; j < V; j++) {
                    double acc = 0.0;
                    for (int64_t i = 0; i < K; i++) acc += kh[i] * Sp[i * V + j];
                    kS[j] = decay * acc;
                    d[j] = bt * (vt[j] - kS[j]);
                }
                double dbt = 0.0;
                for (int64_t i = 0; i < K; i++) {
                    double acc = 0.0;
                    for (int64_t j = 0; j < V; j++) acc += dS[i * V + j] * d[j];
                    dkh[i] = acc;
                }
                for (int64_t j = 0; j < V; j++) {
                    double acc = 0.0;
                    for (int64_t i = 0; i < K; i++) acc += dS[i * V + j] * kh[i];
                    dd[j] = acc;
                    dbt += acc * (vt[j] - kS[j]);
                    dv[(row * Hv + h) * V + j] = bt * acc;
                }
                /* through -beta Sa^T kh: dSa += kh (-beta dd)^T, dkh += Sa (-beta dd) */
                for (int64_t i = 0; i < K; i++) {
                    double acc = 0.0;
                    for (int64_t j = 0; j < V; j++) acc += decay * Sp[i * V + j] * dd[j];
                    dkh[i] -= bt * acc;
                }
                for (int64_t i = 0; i < K; i++)
                    for (int64_t j = 0; j < V; j++) dS[i * V + j] -= bt * kh[i] * dd[j];
                /* Sa = decay S_{t-1}: dg = <Sa, dSa>, dS_{t-1} = decay dSa */
                double dgt = 0.0;
                for (int64_t i = 0; i < KV; i++) {
                    dgt += decay * Sp[i] * dS[i];
                    dS[i] *= decay;
                }
                dg[row * Hv + h] = dgt;
                dbeta[row * Hv + h] = dbt;
                norm_backward(dq + (row * Hk + hk) * K, dqh, qraw, K, cfg->l2norm, scale, qn);
                norm_backward(dk + (row * Hk + hk) * K, dkh, kraw, K, cfg->l2norm, 1.0, kn);
            }
            if (dh0) memcpy(dh0 + (sidx * Hv + h) * KV, dS, sizeof(double) * KV);
        }
    free(states);
    return GDN_OK;
}
