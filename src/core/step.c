/* The decode step (T = 1): one token of the gated delta rule for every (batch row, value head),
 * the state updated in place, no chunk machinery and nothing allocated.
 *
 * Per stream (DESIGN §2, with kn, qs the normalised key and the scaled query, e = exp(g)):
 *     u = S^T kn,  w = S^T qs                   (the old state, one read)
 *     d = beta (v - e u)                        (the delta uses the decayed state: (eS)^T kn = e u)
 *     S <- e S + kn d^T                         (one read-modify-write)
 *     o = S_new^T qs = e w + (kn . qs) d        (no third sweep for the output)
 * The state is swept in column blocks of STEP_NB vectors: the columns of S are independent in all
 * four lines above, so a block's u, w, d live in registers, and the block (K rows of STEP_NB
 * vectors: 32 KB at K = 128, 4 x 16 lanes) is still in L1 when the update re-reads it. Memory
 * traffic is therefore one read and one write of the state, the minimum for an in-place update. */
#include "internal.h"

#include <math.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__)
#define VW 16 /* lanes of one vector */
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vf_u __attribute__((vector_size(VW * 4), aligned(4))); /* unaligned access */

/* Vectors per column block (see the top comment; measured in `gdncp bench decode`). */
#ifndef STEP_NB
#if VW == 16
#define STEP_NB 4
#else
#define STEP_NB 8
#endif
#endif

typedef struct {
    const float *kn, *qs; /* K each */
    float e, beta, kq;    /* exp(g), beta, kn . qs */
    int64_t K, V;
} head_args;

/* Columns [c, c + nb*VW) of one stream. nf accumulates x*0 over the written state and the output:
 * NaN exactly when one of them is NaN or Inf. */
static inline __attribute__((always_inline)) void col_block(const head_args *a, float *S,
                                                             float *o, const float *v, int64_t c,
                                                             const int nb, vf *nf) {
    const int64_t K = a->K, V = a->V;
    vf u[STEP_NB], w[STEP_NB], d[STEP_NB];
#pragma GCC unroll 8
    for (int n = 0; n < nb; n++) u[n] = (vf){0}, w[n] = (vf){0};
    for (int64_t i = 0; i < K; i++) {
        const float *row = S + i * V + c;
        const float ki = a->kn[i], qi = a->qs[i];
#pragma GCC unroll 8
        for (int n = 0; n < nb; n++) {
            const vf x = *(const vf_u *)(row + n * VW);
            u[n] += ki * x;
            w[n] += qi * x;
        }
    }
    const float e = a->e, beta = a->beta, kq = a->kq;
#pragma GCC unroll 8
    for (int n = 0; n < nb; n++) {
        d[n] = beta * (*(const vf_u *)(v + c + n * VW) - e * u[n]);
        const vf out = e * w[n] + kq * d[n];
        *(vf_u *)(o + c + n * VW) = out;
        *nf += out * 0.0f;
    }
    for (int64_t i = 0; i < K; i++) {
        float *row = S + i * V + c;
        const float ki = a->kn[i];
#pragma GCC unroll 8
        for (int n = 0; n < nb; n++) {
            const vf x = e * *(vf_u *)(row + n * VW) + ki * d[n];
            *(vf_u *)(row + n * VW) = x;
            *nf += x * 0.0f;
        }
    }
}

/* The last V % VW columns, one at a time. */
static void col_tail(const head_args *a, float *S, float *o, const float *v, int64_t c,
                     float *nf) {
    const int64_t K = a->K, V = a->V;
    for (; c < V; c++) {
        float u = 0.0f, w = 0.0f;
        for (int64_t i = 0; i < K; i++) u += a->kn[i] * S[i * V + c], w += a->qs[i] * S[i * V + c];
        const float d = a->beta * (v[c] - a->e * u);
        o[c] = a->e * w + a->kq * d;
        *nf += o[c] * 0.0f;
        for (int64_t i = 0; i < K; i++) {
            S[i * V + c] = a->e * S[i * V + c] + a->kn[i] * d;
            *nf += S[i * V + c] * 0.0f;
        }
    }
}

/* One (batch row, value head) stream; returns 1 when the written state or output is non-finite. */
static int step_head(const gdn_config *c, float *S, float *o, const float *q, const float *k,
                     const float *v, float g, float beta) {
    const int64_t K = c->K, V = c->V;
    float kn[GDN_MAX_HEAD_DIM], qs[GDN_MAX_HEAD_DIM];
    float kinv = 1.0f, qinv = c->scale;
    if (c->l2norm) {
        kinv = 1.0f / sqrtf(gdn_sumsq(k, K) + 1e-6f);
        qinv = c->scale / sqrtf(gdn_sumsq(q, K) + 1e-6f);
    }
    gdn_v8f acc = {0};
    int64_t i = 0;
    for (; i + 8 <= K; i += 8) {
        const gdn_v8f kv = *(const gdn_v8f_u *)(k + i) * kinv, qv = *(const gdn_v8f_u *)(q + i) * qinv;
        *(gdn_v8f_u *)(kn + i) = kv, *(gdn_v8f_u *)(qs + i) = qv;
        acc += kv * qv;
    }
    float kq = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < K; i++) kn[i] = k[i] * kinv, qs[i] = q[i] * qinv, kq += kn[i] * qs[i];
    const head_args a = {kn, qs, gdn_expf_ftz(g), beta, kq, K, V};
    vf nf = {0};
    int64_t col = 0;
    for (; col + STEP_NB * VW <= V; col += STEP_NB * VW) col_block(&a, S, o, v, col, STEP_NB, &nf);
    for (; col + VW <= V; col += VW) col_block(&a, S, o, v, col, 1, &nf);
    float s = 0.0f;
    if (col < V) col_tail(&a, S, o, v, col, &s);
    for (int l = 0; l < VW; l++) s += nf[l];
    return s != s;
}

/* The non-finite check of q or k: with the L2 norm, a row's squared norm (NaN or Inf when an
 * element is, and Inf when a finite row overflows it); without, the elements. */
static int check_keys(const char *name, const float *x, int64_t rows, int64_t K, int l2norm) {
    int64_t at = -1;
    if (l2norm) {
        int64_t r = 0;
        while (r < rows && isfinite(gdn_sumsq(x + r * K, K))) r++;
        if (r == rows) return GDN_OK;
        at = gdn_find_nonfinite_f32(x + r * K, K);
        if (at < 0)
            return gdn_fail(GDN_ERR_NONFINITE,
                            "input '%s' row %lld has a squared norm that overflows fp32 (|x| > 1e19)",
                            name, (long long)r);
        at += r * K;
    } else if ((at = gdn_find_nonfinite_f32(x, rows * K)) < 0)
        return GDN_OK;
    return gdn_fail(GDN_ERR_NONFINITE, "input '%s' has a non-finite value (%g) at flat index %lld",
                    name, (double)x[at], (long long)at);
}

int gdn_step(gdn_plan *p, float *o, float *state, const float *q, const float *k, const float *v,
             const float *g, const float *beta) {
    if (!p) return gdn_fail(GDN_ERR_ARG, "plan is NULL");
    if (!o) return gdn_fail(GDN_ERR_ARG, "output 'o' is NULL");
    if (!state) return gdn_fail(GDN_ERR_ARG, "'state' is NULL");
    const gdn_config *c = &p->cfg;
    const int64_t B = c->B, Hk = c->Hk, Hv = c->Hv, K = c->K, V = c->V, r = Hv / Hk;
    int rc;
    if ((rc = gdn_check_tensor("q", q, 0, 0)) || (rc = gdn_check_tensor("k", k, 0, 0)) ||
        (rc = gdn_check_tensor("v", v, B * Hv * V, c->check_finite)) ||
        (rc = gdn_check_tensor("g", g, B * Hv, c->check_finite)) ||
        (rc = gdn_check_tensor("beta", beta, B * Hv, c->check_finite)))
        return rc;
    /* All checks on the token's inputs (B (2 Hk K + Hv (V + 2)) floats, under 1 % of the state)
     * come before the state is touched, so a rejected step leaves it unchanged. */
    if (c->check_finite && ((rc = check_keys("q", q, B * Hk, K, c->l2norm)) ||
                            (rc = check_keys("k", k, B * Hk, K, c->l2norm))))
        return rc;
    const int64_t items = B * Hv;
    int bad = 0;
    if (p->threads > 1) {
#pragma omp parallel for schedule(static) num_threads(p->threads) reduction(| : bad)
        for (int64_t it = 0; it < items; it++) {
            const int64_t b = it / Hv, hk = it % Hv / r;
            bad |= step_head(c, state + it * K * V, o + it * V, q + (b * Hk + hk) * K,
                             k + (b * Hk + hk) * K, v + it * V, g[it], beta[it]);
        }
    } else {
        for (int64_t it = 0; it < items; it++) {
            const int64_t b = it / Hv, hk = it % Hv / r;
            bad |= step_head(c, state + it * K * V, o + it * V, q + (b * Hk + hk) * K,
                             k + (b * Hk + hk) * K, v + it * V, g[it], beta[it]);
        }
    }
    if (bad && c->check_finite) {
        int64_t at = gdn_find_nonfinite_f32(state, items * K * V);
        const char *name = at >= 0 ? "state" : "o";
        if (at < 0) at = gdn_find_nonfinite_f32(o, items * V);
        return gdn_fail(GDN_ERR_NONFINITE,
                        "output '%s' is non-finite at flat index %lld after the step (overflow: are "
                        "gates g > 0 or keys unnormalised?)",
                        name, (long long)at);
    }
    return GDN_OK;
}
