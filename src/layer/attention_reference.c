/* Gated full attention in double precision with plain loops (the oracle of the fp32 layer):
 * the whole score row of a query at a time (O(T) per row, never T x T), written from DESIGN §10
 * independently of attention.c. RoPE angles in double: p * theta^(-2i/R). With c->compute =
 * GDN_COMPUTE_BF16, the oracle of the BF16 mode: the operands of q/k/v_proj and o_proj (forward,
 * dx, dW) and of the core's products rounded to bf16 (B(): gdn_ref_operand): the scaled q, k and
 * v; in the backward also dO, the probabilities P (normalised, as the core's backward forms them)
 * and dS. Not the forward's P: the core rounds it scaled against its lazy running max, which
 * this oracle does not follow (tests/layer/test_compute_bf16.c bounds that difference). All else exact. */
#define B(v) gdn_ref_operand(bf, (v))
#include "attention_internal.h" /* the core's key tiles and lazy max (the BF16 oracle) */

#include <math.h>
#include <string.h>

typedef struct {
    const gdn_attn_config *c;
    int64_t N, Hd, Kd;
    double *qg, *k, *v;       /* projections [N, 2Hd] (interleaved), [N, Kd], [N, Kd] */
    double *qn, *kn, *q, *kr; /* normed (before RoPE) and rotated q [N, Hd], k [N, Kd] */
    double *rq, *rk;          /* rstd [N, H], [N, Hkv] */
    double *o, *z;            /* attention output and gated output [N, Hd] */
    int64_t *beg, *pos;       /* per row t: document start, position */
} ref_state;

static void ref_free(ref_state *s) {
    free(s->qg), free(s->k), free(s->v), free(s->qn), free(s->kn), free(s->q), free(s->kr);
    free(s->rq), free(s->rk), free(s->o), free(s->z), free(s->beg), free(s->pos);
}

static int ref_alloc(ref_state *s, const gdn_attn_config *c) {
    memset(s, 0, sizeof *s);
    s->c = c, s->N = c->B * c->T, s->Hd = c->H * c->d, s->Kd = c->Hkv * c->d;
    const size_t N = (size_t)s->N;
    s->qg = gdn_calloc("attention_reference: s->qg", N * 2 * s->Hd, sizeof(double)), s->k = gdn_calloc("attention_reference: s->k", N * s->Kd, sizeof(double));
    s->v = gdn_calloc("attention_reference: s->v", N * s->Kd, sizeof(double)), s->qn = gdn_calloc("attention_reference: s->qn", N * s->Hd, sizeof(double));
    s->kn = gdn_calloc("attention_reference: s->kn", N * s->Kd, sizeof(double)), s->q = gdn_calloc("attention_reference: s->q", N * s->Hd, sizeof(double));
    s->kr = gdn_calloc("attention_reference: s->kr", N * s->Kd, sizeof(double)), s->rq = gdn_calloc("attention_reference: s->rq", N * c->H, sizeof(double));
    s->rk = gdn_calloc("attention_reference: s->rk", N * c->Hkv, sizeof(double)), s->o = gdn_calloc("attention_reference: s->o", N * s->Hd, sizeof(double));
    s->z = gdn_calloc("attention_reference: s->z", N * s->Hd, sizeof(double));
    s->beg = gdn_calloc("attention_reference: s->beg", (size_t)c->T, sizeof(int64_t)), s->pos = gdn_calloc("attention_reference: s->pos", (size_t)c->T, sizeof(int64_t));
    if (!s->qg || !s->k || !s->v || !s->qn || !s->kn || !s->q || !s->kr || !s->rq || !s->rk || !s->o || !s->z ||
        !s->beg || !s->pos) {
        ref_free(s);
        return gdn_fail(GDN_ERR_NOMEM, "attention reference: %lld tokens", (long long)N);
    }
    for (int64_t t = 0; t < c->T; t++) {
        int64_t b = 0;
        if (c->cu_seqlens)
            for (int64_t k = 0; k < c->n_docs; k++)
                if (c->cu_seqlens[k] <= t) b = c->cu_seqlens[k];
        s->beg[t] = b;
        s->pos[t] = c->cu_seqlens ? t - b : c->pos_offset + t;
    }
    return GDN_OK;
}

static double sigm(double x) { return 1.0 / (1.0 + exp(-x)); }

/* out = rope(u * rstd * (1 + w)) at position p; returns rstd. */
static double norm_rope(const gdn_attn_config *c, const double *u, const double *w, int64_t p, double *nrm,
                        double *out) {
    const int64_t d = c->d, half = c->R / 2;
    double ss = 0.0;
    for (int64_t i = 0; i < d; i++) ss += u[i] * u[i];
    const double r = 1.0 / sqrt(ss / (double)d + (double)c->eps);
    for (int64_t i = 0; i < d; i++) nrm[i] = u[i] * r * (1.0 + w[i]);
    for (int64_t i = 0; i < d; i++) out[i] = nrm[i];
    for (int64_t i = 0; i < half; i++) {
        const double ang = (double)p * pow(c->rope_theta, -2.0 * (double)i / (double)c->R);
        const double cs = cos(ang), sn = sin(ang);
        out[i] = nrm[i] * cs - nrm[i + half] * sn;
        out[i + half] = nrm[i + half] * cs + nrm[i] * sn;
    }
    return r;
}

static int ref_check(const gdn_attn_config *c, const void *x, const void *w, const void *out) {
    int rc = gdn_attn_config_check(c);
    if (rc) return rc;
    if (c->seq_offset || (c->cu_seqlens && c->cu_seqlens[c->n_docs] != c->T))
        return gdn_fail(GDN_ERR_ARG, "attention reference: the whole stream only (seq_offset = %lld, cu_seqlens must "
                        "end at T = %lld)", (long long)c->seq_offset, (long long)c->T);
    if (!x) return gdn_fail(GDN_ERR_ARG, "input 'x' is NULL");
    if (!w) return gdn_fail(GDN_ERR_ARG, "input 'w' (the attention weights) is NULL");
    if (!out) return gdn_fail(GDN_ERR_ARG, "output is NULL");
    if (c->check_finite) {
        int64_t at = gdn_find_nonfinite_f64(x, c->B * c->T * c->E);
        if (at >= 0) return gdn_fail_nonfinite("input", "x", ((const double *)x)[at], at);
        for (int p = 0; p < GDN_A_COUNT; p++) {
            const double *t = (const double *)w + gdn_attn_param_offset(c, p);
            at = gdn_find_nonfinite_f64(t, (int64_t)gdn_attn_param_numel(c, p));
            if (at >= 0) return gdn_fail_nonfinite("weight", gdn_attn_param_name(p), t[at], at);
        }
    }
    return GDN_OK;
}

/* Everything up to the gated output z. */
/* The BF16 forward's weights of scores sc[lo..hi] (max mx): the core rounds each probability
 * to bf16 against its row's running max at the key's tile (the first visible tile's max, moved
 * only when a later tile's passes it by GDN_ATTN_LAZY_MAX), and rescales what it accumulated by
 * exact fp32 factors; so key u weighs bf16(e^(s_u - m_u)) e^(m_u - mx) (into pw). */
static void lazy_rounded_weights(const double *sc, double *pw, int64_t lo, int64_t hi, double mx) {
    double m = -INFINITY;
    for (int64_t u0 = lo; u0 <= hi;) {
        const int64_t u1 = (u0 / GDN_ATTN_KEY_TILE + 1) * GDN_ATTN_KEY_TILE; /* the tile's end */
        double tmax = -INFINITY;
        for (int64_t u = u0; u < u1 && u <= hi; u++) tmax = fmax(tmax, sc[u]);
        if (m == -INFINITY || tmax > m + GDN_ATTN_LAZY_MAX) m = tmax;
        for (int64_t u = u0; u < u1 && u <= hi; u++) pw[u] = gdn_ref_operand(1, exp(sc[u] - m)) * exp(m - mx);
        u0 = u1;
    }
}

static void ref_forward(ref_state *s, const double *x, const double *w) {
    const gdn_attn_config *c = s->c;
    const int64_t T = c->T, E = c->E, H = c->H, Hkv = c->Hkv, d = c->d, Hd = s->Hd, Kd = s->Kd, grp = H / Hkv;
    const double *Wq = w + gdn_attn_param_offset(c, GDN_A_Q_PROJ), *Wk = w + gdn_attn_param_offset(c, GDN_A_K_PROJ);
    const double *Wv = w + gdn_attn_param_offset(c, GDN_A_V_PROJ);
    const double *wqn = w + gdn_attn_param_offset(c, GDN_A_Q_NORM), *wkn = w + gdn_attn_param_offset(c, GDN_A_K_NORM);
    const int bf = c->compute == GDN_COMPUTE_BF16;
    for (int64_t n = 0; n < s->N; n++) {
        const double *xr = x + n * E;
        for (int64_t r = 0; r < 2 * Hd; r++) {
            double a = 0.0;
            for (int64_t e = 0; e < E; e++) a += B(Wq[r * E + e]) * B(xr[e]);
            s->qg[n * 2 * Hd + r] = a;
        }
        for (int64_t r = 0; r < Kd; r++) {
            double a = 0.0, b = 0.0;
            for (int64_t e = 0; e < E; e++) a += B(Wk[r * E + e]) * B(xr[e]), b += B(Wv[r * E + e]) * B(xr[e]);
            s->k[n * Kd + r] = a, s->v[n * Kd + r] = b;
        }
        const int64_t p = s->pos[n % T];
        for (int64_t h = 0; h < H; h++)
            s->rq[n * H + h] = norm_rope(c, s->qg + n * 2 * Hd + 2 * h * d, wqn, p, s->qn + n * Hd + h * d,
                                         s->q + n * Hd + h * d);
        for (int64_t j = 0; j < Hkv; j++)
            s->rk[n * Hkv + j] = norm_rope(c, s->k + n * Kd + j * d, wkn, p, s->kn + n * Kd + j * d,
                                           s->kr + n * Kd + j * d);
    }
    const double tau = 1.0 / sqrt((double)d);
    double *sc = gdn_malloc("attention_reference: sc", sizeof(double) * (size_t)T), *pw = gdn_malloc("attention_reference: pw", sizeof(double) * (size_t)T);
    GDN_ASSERT(sc && pw);
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++) {
                const int64_t n = b * T + t, j = h / grp;
                double mx = -INFINITY, sum = 0.0;
                for (int64_t u = s->beg[t]; u <= t; u++) {
                    double a = 0.0;
                    for (int64_t i = 0; i < d; i++)
                        a += B(tau * s->q[n * Hd + h * d + i]) * B(s->kr[(b * T + u) * Kd + j * d + i]);
                    sc[u] = a;
                    mx = fmax(mx, sc[u]);
                }
                if (bf) lazy_rounded_weights(sc, pw, s->beg[t], t, mx);
                for (int64_t u = s->beg[t]; u <= t; u++) sum += (sc[u] = exp(sc[u] - mx));
                const double *wt = bf ? pw : sc;
                for (int64_t i = 0; i < d; i++) {
                    double a = 0.0;
                    for (int64_t u = s->beg[t]; u <= t; u++) a += wt[u] * B(s->v[(b * T + u) * Kd + j * d + i]);
                    s->o[n * Hd + h * d + i] = a / sum;
                    s->z[n * Hd + h * d + i] = s->o[n * Hd + h * d + i] * sigm(s->qg[n * 2 * Hd + 2 * h * d + d + i]);
                }
            }
    free(sc), free(pw);
}

int gdn_attn_reference_forward(const gdn_attn_config *c, double *y, const double *x, const double *w) {
    int rc = ref_check(c, x, w, y);
    if (rc) return rc;
    ref_state s;
    if ((rc = ref_alloc(&s, c))) return rc;
    ref_forward(&s, x, w);
    const double *Wo = w + gdn_attn_param_offset(c, GDN_A_O_PROJ);
    const int bf = c->compute == GDN_COMPUTE_BF16;
    for (int64_t n = 0; n < s.N; n++)
        for (int64_t e = 0; e < c->E; e++) {
            double a = 0.0;
            for (int64_t i = 0; i < s.Hd; i++) a += B(Wo[e * s.Hd + i]) * B(s.z[n * s.Hd + i]);
            y[n * c->E + e] = a;
        }
    ref_free(&s);
    return GDN_OK;
}

/* Backward of norm_rope: g, the gradient of its output; du += ..., dw += ... */
static void norm_rope_bwd(const gdn_attn_config *c, const double *u, double r, const double *w, int64_t p,
                          const double *g, double *du, double *dw) {
    const int64_t d = c->d, half = c->R / 2;
    double gn[1024];
    for (int64_t i = 0; i < d; i++) gn[i] = g[i];
    for (int64_t i = 0; i < half; i++) {
        const double ang = (double)p * pow(c->rope_theta, -2.0 * (double)i / (double)c->R);
        const double cs = cos(ang), sn = sin(ang);
        gn[i] = g[i] * cs + g[i + half] * sn;
        gn[i + half] = g[i + half] * cs - g[i] * sn;
    }
    /* nrm_i = u_i r (1 + w_i), r = (mean u^2 + eps)^-1/2, dr/du_i = -r^3 u_i / d */
    double s = 0.0;
    for (int64_t i = 0; i < d; i++) {
        dw[i] += gn[i] * u[i] * r;
        s += gn[i] * (1.0 + w[i]) * u[i];
    }
    for (int64_t i = 0; i < d; i++) du[i] += gn[i] * (1.0 + w[i]) * r - r * r * r * u[i] * s / (double)d;
}

int gdn_attn_reference_backward(const gdn_attn_config *c, double *dx, double *dw, const double *x, const double *w,
                                const double *dy) {
    int rc = ref_check(c, x, w, dx);
    if (rc) return rc;
    if (!dw) return gdn_fail(GDN_ERR_ARG, "output 'dw' is NULL");
    if (!dy) return gdn_fail(GDN_ERR_ARG, "input 'dy' is NULL");
    ref_state s;
    if ((rc = ref_alloc(&s, c))) return rc;
    ref_forward(&s, x, w);
    const int64_t T = c->T, E = c->E, H = c->H, Hkv = c->Hkv, d = c->d, Hd = s.Hd, Kd = s.Kd, grp = H / Hkv, N = s.N;
    const double *Wq = w + gdn_attn_param_offset(c, GDN_A_Q_PROJ), *Wk = w + gdn_attn_param_offset(c, GDN_A_K_PROJ);
    const double *Wv = w + gdn_attn_param_offset(c, GDN_A_V_PROJ), *Wo = w + gdn_attn_param_offset(c, GDN_A_O_PROJ);
    memset(dw, 0, sizeof(double) * gdn_attn_param_floats(c));
    double *dWq = dw + gdn_attn_param_offset(c, GDN_A_Q_PROJ), *dWk = dw + gdn_attn_param_offset(c, GDN_A_K_PROJ);
    double *dWv = dw + gdn_attn_param_offset(c, GDN_A_V_PROJ), *dWo = dw + gdn_attn_param_offset(c, GDN_A_O_PROJ);
    double *dqg = gdn_calloc("attention_reference: dqg", (size_t)N * 2 * Hd, sizeof(double)), *dk = gdn_calloc("attention_reference: dk", (size_t)N * Kd, sizeof(double));
    double *dv = gdn_calloc("attention_reference: dv", (size_t)N * Kd, sizeof(double)), *dq = gdn_calloc("attention_reference: dq", (size_t)N * Hd, sizeof(double));
    double *dkr = gdn_calloc("attention_reference: dkr", (size_t)N * Kd, sizeof(double)), *dO = gdn_calloc("attention_reference: dO", (size_t)N * Hd, sizeof(double));
    double *P = gdn_malloc("attention_reference: P", sizeof(double) * (size_t)T);
    if (!dqg || !dk || !dv || !dq || !dkr || !dO || !P) {
        free(dqg), free(dk), free(dv), free(dq), free(dkr), free(dO), free(P), ref_free(&s);
        return gdn_fail(GDN_ERR_NOMEM, "attention reference backward");
    }
    /* y = z Wo^T */
    const int bf = c->compute == GDN_COMPUTE_BF16;
    for (int64_t n = 0; n < N; n++)
        for (int64_t i = 0; i < Hd; i++) {
            double a = 0.0;
            for (int64_t e = 0; e < E; e++) {
                a += B(dy[n * E + e]) * B(Wo[e * Hd + i]);
                dWo[e * Hd + i] += B(dy[n * E + e]) * B(s.z[n * Hd + i]);
            }
            /* z = o sigmoid(g) */
            const int64_t h = i / d, ii = i % d;
            const double g = s.qg[n * 2 * Hd + 2 * h * d + d + ii], sg = sigm(g);
            dO[n * Hd + i] = a * sg;
            dqg[n * 2 * Hd + 2 * h * d + d + ii] = a * s.o[n * Hd + i] * sg * (1.0 - sg);
        }
    /* softmax attention, one query row at a time */
    const double tau = 1.0 / sqrt((double)d);
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++) {
                const int64_t n = b * T + t, j = h / grp;
                const double *qt = s.q + n * Hd + h * d, *dot = dO + n * Hd + h * d;
                double mx = -INFINITY, sum = 0.0, D = 0.0;
                for (int64_t u = s.beg[t]; u <= t; u++) {
                    double a = 0.0;
                    for (int64_t i = 0; i < d; i++) a += B(tau * qt[i]) * B(s.kr[(b * T + u) * Kd + j * d + i]);
                    P[u] = a;
                    mx = fmax(mx, P[u]);
                }
                for (int64_t u = s.beg[t]; u <= t; u++) sum += (P[u] = exp(P[u] - mx));
                for (int64_t u = s.beg[t]; u <= t; u++) P[u] /= sum;
                for (int64_t i = 0; i < d; i++) D += dot[i] * s.o[n * Hd + h * d + i];
                for (int64_t u = s.beg[t]; u <= t; u++) {
                    const int64_t m = b * T + u;
                    double dp = 0.0;
                    for (int64_t i = 0; i < d; i++) dp += B(dot[i]) * B(s.v[m * Kd + j * d + i]);
                    const double ds = P[u] * (dp - D);
                    for (int64_t i = 0; i < d; i++) {
                        dv[m * Kd + j * d + i] += B(P[u]) * B(dot[i]);
                        dq[n * Hd + h * d + i] += tau * B(ds) * B(s.kr[m * Kd + j * d + i]);
                        dkr[m * Kd + j * d + i] += B(ds) * B(tau * qt[i]);
                    }
                }
            }
    /* norms and RoPE */
    const double *wqn = w + gdn_attn_param_offset(c, GDN_A_Q_NORM), *wkn = w + gdn_attn_param_offset(c, GDN_A_K_NORM);
    double *dwqn = dw + gdn_attn_param_offset(c, GDN_A_Q_NORM), *dwkn = dw + gdn_attn_param_offset(c, GDN_A_K_NORM);
    for (int64_t n = 0; n < N; n++) {
        const int64_t p = s.pos[n % T];
        for (int64_t h = 0; h < H; h++)
            norm_rope_bwd(c, s.qg + n * 2 * Hd + 2 * h * d, s.rq[n * H + h], wqn, p, dq + n * Hd + h * d,
                          dqg + n * 2 * Hd + 2 * h * d, dwqn);
        for (int64_t j = 0; j < Hkv; j++)
            norm_rope_bwd(c, s.k + n * Kd + j * d, s.rk[n * Hkv + j], wkn, p, dkr + n * Kd + j * d, dk + n * Kd + j * d,
                          dwkn);
    }
    /* projections */
    for (int64_t n = 0; n < N; n++) {
        const double *xr = x + n * E;
        for (int64_t e = 0; e < E; e++) {
            double a = 0.0;
            for (int64_t r = 0; r < 2 * Hd; r++) a += B(dqg[n * 2 * Hd + r]) * B(Wq[r * E + e]);
            for (int64_t r = 0; r < Kd; r++)
                a += B(dk[n * Kd + r]) * B(Wk[r * E + e]) + B(dv[n * Kd + r]) * B(Wv[r * E + e]);
            dx[n * E + e] = a;
        }
        for (int64_t r = 0; r < 2 * Hd; r++)
            for (int64_t e = 0; e < E; e++) dWq[r * E + e] += B(dqg[n * 2 * Hd + r]) * B(xr[e]);
        for (int64_t r = 0; r < Kd; r++)
            for (int64_t e = 0; e < E; e++)
                dWk[r * E + e] += B(dk[n * Kd + r]) * B(xr[e]), dWv[r * E + e] += B(dv[n * Kd + r]) * B(xr[e]);
    }
    free(dqg), free(dk), free(dv), free(dq), free(dkr), free(dO), free(P);
    ref_free(&s);
    return GDN_OK;
}
