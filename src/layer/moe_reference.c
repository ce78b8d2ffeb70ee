/* The MoE block in float64 with plain loops (DESIGN §13): the oracle the fp32 block is tested
 * against. Written from the formulas, independently of moe.c: no grouping, no saved activations
 * (the backward recomputes everything per row), the routing rule stated once here. */
#include "moe_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static double sig_d(double v) { return 1.0 / (1.0 + exp(-v)); }

/* Per row: the router probabilities p[n], the chosen experts S[k] (largest p first, a tie to the
 * lower index) and their weights wt[k]. */
static void ref_route(const gdn_moe_config *c, const double *Wr, const double *xr, double *p, int32_t *S, double *wt) {
    const int64_t n = c->n_experts, k = c->top_k, E = c->E;
    double mx = -INFINITY;
    for (int64_t e = 0; e < n; e++) {
        double l = 0.0;
        for (int64_t i = 0; i < E; i++) l += Wr[e * E + i] * xr[i];
        p[e] = l;
        if (l > mx) mx = l;
    }
    double s = 0.0;
    for (int64_t e = 0; e < n; e++) s += p[e] = exp(p[e] - mx);
    for (int64_t e = 0; e < n; e++) p[e] /= s;
    for (int64_t j = 0; j < k; j++) { /* j-th pick: the largest p not yet chosen, lowest index on a tie */
        int64_t best = -1;
        for (int64_t e = 0; e < n; e++) {
            int taken = 0;
            for (int64_t i = 0; i < j; i++) taken |= S[i] == e;
            if (!taken && (best < 0 || p[e] > p[best])) best = e;
        }
        S[j] = (int32_t)best;
    }
    double sw = 0.0;
    for (int64_t j = 0; j < k; j++) sw += p[S[j]];
    for (int64_t j = 0; j < k; j++) wt[j] = c->norm_topk ? p[S[j]] / sw : p[S[j]];
}

/* One expert MLP on one row: a = G xr, b = U xr (rows ldg apart), m = silu(a) b, out = Dm m
 * (Dm [E, I'] row-major). */
static void ref_mlp(int64_t E, int64_t In, const double *G, const double *U, const double *Dm, const double *xr,
                    double *a, double *b, double *m, double *out) {
    for (int64_t i = 0; i < In; i++) {
        double sa = 0.0, sb = 0.0;
        for (int64_t q = 0; q < E; q++) sa += G[i * E + q] * xr[q], sb += U[i * E + q] * xr[q];
        a[i] = sa, b[i] = sb, m[i] = sa * sig_d(sa) * sb;
    }
    for (int64_t q = 0; q < E; q++) {
        double s = 0.0;
        for (int64_t i = 0; i < In; i++) s += Dm[q * In + i] * m[i];
        out[q] = s;
    }
}

typedef struct {
    double *p, *wt, *a, *b, *m, *out, *dm, *c, *dl;
    int32_t *S;
    void *mem;
} ref_ws;

static int ref_ws_make(const gdn_moe_config *c, ref_ws *r) {
    const int64_t n = c->n_experts, k = c->top_k, E = c->E, In = c->I > c->Is ? c->I : c->Is;
    const size_t doubles = (size_t)(n + k + 4 * In + E + k + n + In);
    r->mem = gdn_calloc("moe_reference: r->mem", doubles * sizeof(double) + (size_t)k * sizeof(int32_t), 1);
    if (!r->mem) return gdn_fail(GDN_ERR_NOMEM, "moe reference workspace");
    double *d = r->mem;
    r->p = d, d += n;
    r->wt = d, d += k;
    r->a = d, d += In;
    r->b = d, d += In;
    r->m = d, d += In;
    r->dm = d, d += In;
    r->out = d, d += E;
    r->c = d, d += k;
    r->dl = d, d += n;
    d += In;
    r->S = (int32_t *)d;
    return GDN_OK;
}

int gdn_moe_reference_forward(const gdn_moe_config *c, double *y, const double *x, const double *w,
                              int32_t *routing) {
    int rc = gdn_moe_config_check(c);
    if (rc) return rc;
    if (!y || !x || !w) return gdn_fail(GDN_ERR_ARG, "moe reference forward: y, x or w is NULL");
    const int64_t N = c->N, E = c->E, k = c->top_k, I = c->I, Is = c->Is;
    const double *Wr = w + gdn_moe_param_offset(c, GDN_MOE_ROUTER), *GU = w + gdn_moe_param_offset(c, GDN_MOE_GATE_UP),
                 *D = w + gdn_moe_param_offset(c, GDN_MOE_DOWN);
    ref_ws r;
    if ((rc = ref_ws_make(c, &r))) return rc;
    for (int64_t t = 0; t < N; t++) {
        const double *xr = x + t * E;
        double *yr = y + t * E;
        ref_route(c, Wr, xr, r.p, r.S, r.wt);
        if (routing) memcpy(routing + t * k, r.S, sizeof(int32_t) * (size_t)k);
        for (int64_t q = 0; q < E; q++) yr[q] = 0.0;
        for (int64_t j = 0; j < k; j++) {
            const int64_t e = r.S[j];
            ref_mlp(E, I, GU + e * 2 * I * E, GU + e * 2 * I * E + I * E, D + e * E * I, xr, r.a, r.b, r.m, r.out);
            for (int64_t q = 0; q < E; q++) yr[q] += r.wt[j] * r.out[q];
        }
        if (Is) {
            const double *g = w + gdn_moe_param_offset(c, GDN_MOE_SHARED_EXPERT_GATE);
            ref_mlp(E, Is, w + gdn_moe_param_offset(c, GDN_MOE_SHARED_GATE), w + gdn_moe_param_offset(c, GDN_MOE_SHARED_UP),
                    w + gdn_moe_param_offset(c, GDN_MOE_SHARED_DOWN), xr, r.a, r.b, r.m, r.out);
            double gl = 0.0;
            for (int64_t q = 0; q < E; q++) gl += g[q] * xr[q];
            for (int64_t q = 0; q < E; q++) yr[q] += sig_d(gl) * r.out[q];
        }
    }
    free(r.mem);
    return GDN_OK;
}

/* The backward of one expert MLP on one row, scaled: with dout = sc * dyr, accumulates dG, dU,
 * dDm and dxr; returns <dyr, out> (unscaled). a, b, m, out from ref_mlp. */
static double ref_mlp_back(int64_t E, int64_t In, const double *G, const double *U, const double *Dm, const double *xr,
                           const double *dyr, double sc, const double *a, const double *b, const double *m,
                           const double *out, double *dm, double *dG, double *dU, double *dDm, double *dxr) {
    double cdot = 0.0;
    for (int64_t q = 0; q < E; q++) cdot += dyr[q] * out[q];
    for (int64_t i = 0; i < In; i++) {
        double s = 0.0;
        for (int64_t q = 0; q < E; q++) s += dyr[q] * sc * Dm[q * In + i];
        dm[i] = s;
    }
    for (int64_t q = 0; q < E; q++)
        for (int64_t i = 0; i < In; i++) dDm[q * In + i] += sc * dyr[q] * m[i];
    for (int64_t i = 0; i < In; i++) {
        const double sg = sig_d(a[i]);
        const double da = dm[i] * b[i] * (sg + a[i] * sg * (1.0 - sg)); /* d silu(a) = s + a s (1-s) */
        const double db = dm[i] * a[i] * sg;
        for (int64_t q = 0; q < E; q++) {
            dG[i * E + q] += da * xr[q];
            dU[i * E + q] += db * xr[q];
            dxr[q] += da * G[i * E + q] + db * U[i * E + q];
        }
    }
    return cdot;
}

int gdn_moe_reference_backward(const gdn_moe_config *c, double *dx, double *dw, const double *x, const double *w,
                               const double *dy, const double *aux_dp) {
    int rc = gdn_moe_config_check(c);
    if (rc) return rc;
    if (!dx || !dw || !x || !w || !dy) return gdn_fail(GDN_ERR_ARG, "moe reference backward: a tensor is NULL");
    const int64_t N = c->N, E = c->E, n = c->n_experts, k = c->top_k, I = c->I, Is = c->Is;
    const size_t oR = gdn_moe_param_offset(c, GDN_MOE_ROUTER), oGU = gdn_moe_param_offset(c, GDN_MOE_GATE_UP),
                 oD = gdn_moe_param_offset(c, GDN_MOE_DOWN);
    ref_ws r;
    if ((rc = ref_ws_make(c, &r))) return rc;
    memset(dw, 0, sizeof(double) * gdn_moe_param_floats(c));
    for (int64_t t = 0; t < N; t++) {
        const double *xr = x + t * E, *dyr = dy + t * E;
        double *dxr = dx + t * E;
        for (int64_t q = 0; q < E; q++) dxr[q] = 0.0;
        ref_route(c, w + oR, xr, r.p, r.S, r.wt);
        for (int64_t j = 0; j < k; j++) {
            const int64_t e = r.S[j];
            const double *G = w + oGU + e * 2 * I * E, *U = G + I * E, *Dm = w + oD + e * E * I;
            ref_mlp(E, I, G, U, Dm, xr, r.a, r.b, r.m, r.out);
            r.c[j] = ref_mlp_back(E, I, G, U, Dm, xr, dyr, r.wt[j], r.a, r.b, r.m, r.out, r.dm,
                                  dw + oGU + e * 2 * I * E, dw + oGU + e * 2 * I * E + I * E, dw + oD + e * E * I, dxr);
        }
        /* dL/dl_m. Renormalised: w = softmax over S of l, so dl_j = w_j (c_j - sum_i w_i c_i) on
         * S. Plain: w_j = p_j, dp_j = c_j on S, through the softmax Jacobian:
         * dl_m = p_m (dp_m - sum_e p_e dp_e). The aux term: dp_e += aux_dp[e] for every e, through
         * the full softmax. */
        double dot = 0.0;
        for (int64_t j = 0; j < k; j++) dot += r.wt[j] * r.c[j];
        for (int64_t e = 0; e < n; e++) r.dl[e] = c->norm_topk ? 0.0 : -r.p[e] * dot;
        for (int64_t j = 0; j < k; j++) r.dl[r.S[j]] += c->norm_topk ? r.wt[j] * (r.c[j] - dot) : r.p[r.S[j]] * r.c[j];
        if (aux_dp) {
            double pa = 0.0;
            for (int64_t e = 0; e < n; e++) pa += r.p[e] * aux_dp[e];
            for (int64_t e = 0; e < n; e++) r.dl[e] += r.p[e] * (aux_dp[e] - pa);
        }
        for (int64_t e = 0; e < n; e++)
            for (int64_t q = 0; q < E; q++) {
                dw[oR + e * E + q] += r.dl[e] * xr[q];
                dxr[q] += r.dl[e] * w[oR + e * E + q];
            }
        if (Is) {
            const size_t oSG = gdn_moe_param_offset(c, GDN_MOE_SHARED_GATE), oSU = gdn_moe_param_offset(c, GDN_MOE_SHARED_UP),
                         oSD = gdn_moe_param_offset(c, GDN_MOE_SHARED_DOWN),
                         og = gdn_moe_param_offset(c, GDN_MOE_SHARED_EXPERT_GATE);
            double gl = 0.0;
            for (int64_t q = 0; q < E; q++) gl += w[og + q] * xr[q];
            const double sg = sig_d(gl);
            ref_mlp(E, Is, w + oSG, w + oSU, w + oSD, xr, r.a, r.b, r.m, r.out);
            const double cs = ref_mlp_back(E, Is, w + oSG, w + oSU, w + oSD, xr, dyr, sg, r.a, r.b, r.m, r.out, r.dm,
                                           dw + oSG, dw + oSU, dw + oSD, dxr);
            const double dgl = sg * (1.0 - sg) * cs;
            for (int64_t q = 0; q < E; q++) {
                dw[og + q] += dgl * xr[q];
                dxr[q] += dgl * w[og + q];
            }
        }
    }
    free(r.mem);
    return GDN_OK;
}
