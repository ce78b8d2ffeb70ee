/* Qwen3.5's gated full-attention layer in fp32 (DESIGN §10): config, flat parameter layout,
 * plan, forward, backward. The projections and o_proj are large GEMMs (gdn_matmul); the norms,
 * RoPE and the gate are row-local loops; the core is flash style (tiles of BQ queries x BK keys,
 * a running max and sum in fp32, only the log-sum-exp saved; the backward recomputes the
 * probabilities in two passes: dQ over query tiles, dK and dV over key tiles, so no two
 * threads ever add into the same row and the result does not depend on the schedule). */
#include "layer_internal.h"

#include <math.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

enum { BQ = 64, BK = 64 };

/* ---------------------------------------------------------------- config and parameters */

gdn_attn_config gdn_attn_config_default(int64_t B, int64_t T, int64_t E, int64_t H, int64_t Hkv, int64_t d) {
    gdn_attn_config c;
    memset(&c, 0, sizeof c);
    c.B = B, c.T = T, c.E = E, c.H = H, c.Hkv = Hkv, c.d = d;
    c.R = ((int64_t)((double)d * 0.25)) & ~(int64_t)1;
    c.rope_theta = 1e7, c.eps = 1e-6f, c.check_finite = 1;
    return c;
}

int gdn_attn_config_check(const gdn_attn_config *c) {
    if (!c) return gdn_fail(GDN_ERR_ARG, "attention config is NULL");
    const struct { const char *name; int64_t v, max; } dims[] = {
        {"B", c->B, (int64_t)1 << 31}, {"T", c->T, (int64_t)1 << 40}, {"E", c->E, (int64_t)1 << 20},
        {"H", c->H, 1 << 16},          {"Hkv", c->Hkv, 1 << 16},      {"d", c->d, 1024},
    };
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        if (dims[i].v < 1 || dims[i].v > dims[i].max)
            return gdn_fail(GDN_ERR_SHAPE, "attention %s = %lld is out of range [1, %lld]", dims[i].name,
                            (long long)dims[i].v, (long long)dims[i].max);
    if (c->H % c->Hkv)
        return gdn_fail(GDN_ERR_SHAPE, "attention H = %lld query heads is not a multiple of Hkv = %lld kv heads",
                        (long long)c->H, (long long)c->Hkv);
    if (c->R < 0 || c->R > c->d || c->R % 2)
        return gdn_fail(GDN_ERR_SHAPE, "attention rotary dims R = %lld must be even and in [0, d = %lld]",
                        (long long)c->R, (long long)c->d);
    if (!(c->rope_theta > 1.0) || !isfinite(c->rope_theta))
        return gdn_fail(GDN_ERR_ARG, "attention rope_theta = %g must be finite and > 1", c->rope_theta);
    if (!(c->eps > 0.0f) || !isfinite(c->eps))
        return gdn_fail(GDN_ERR_ARG, "attention eps = %g must be positive and finite", (double)c->eps);
    if (c->threads < 0) return gdn_fail(GDN_ERR_ARG, "attention threads = %d is negative", c->threads);
    if (2 * c->H * c->d + 2 * c->Hkv * c->d > INT32_MAX / 2)
        return gdn_fail(GDN_ERR_SHAPE, "attention projection width 2(H + Hkv) d = %lld is too large",
                        (long long)(2 * c->H * c->d + 2 * c->Hkv * c->d));
    if (c->pos_offset < 0 || c->pos_offset > ((int64_t)1 << 40))
        return gdn_fail(GDN_ERR_ARG, "attention pos_offset = %lld is out of range [0, 2^40]", (long long)c->pos_offset);
    if (c->cu_seqlens) {
        const int64_t *cu = c->cu_seqlens, n = c->n_docs;
        if (c->B != 1) return gdn_fail(GDN_ERR_SHAPE, "attention cu_seqlens needs B = 1 (got B = %lld)", (long long)c->B);
        if (n < 1 || n > c->T)
            return gdn_fail(GDN_ERR_SHAPE, "attention n_docs = %lld is out of range [1, T = %lld]", (long long)n,
                            (long long)c->T);
        if (cu[0] != 0 || cu[n] != c->T)
            return gdn_fail(GDN_ERR_SHAPE, "attention cu_seqlens must run from 0 to T = %lld (got %lld .. %lld)",
                            (long long)c->T, (long long)cu[0], (long long)cu[n]);
        for (int64_t i = 0; i < n; i++)
            if (cu[i + 1] <= cu[i])
                return gdn_fail(GDN_ERR_SHAPE, "attention cu_seqlens is not strictly increasing at %lld (%lld, %lld)",
                                (long long)i, (long long)cu[i], (long long)cu[i + 1]);
        if (c->pos_offset)
            return gdn_fail(GDN_ERR_ARG, "attention pos_offset = %lld with cu_seqlens (packed positions restart at 0)",
                            (long long)c->pos_offset);
    }
    return GDN_OK;
}

static const char *const attn_param_names[GDN_A_COUNT] = {
    "q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "q_norm.weight", "k_norm.weight",
};

const char *gdn_attn_param_name(int which) {
    return which >= 0 && which < GDN_A_COUNT ? attn_param_names[which] : NULL;
}

int gdn_attn_param_shape(const gdn_attn_config *c, int which, int64_t shape[2]) {
    switch (which) {
    case GDN_A_Q_PROJ: shape[0] = 2 * c->H * c->d, shape[1] = c->E; return 2;
    case GDN_A_K_PROJ:
    case GDN_A_V_PROJ: shape[0] = c->Hkv * c->d, shape[1] = c->E; return 2;
    case GDN_A_O_PROJ: shape[0] = c->E, shape[1] = c->H * c->d; return 2;
    case GDN_A_Q_NORM:
    case GDN_A_K_NORM: shape[0] = c->d; return 1;
    default: return 0;
    }
}

size_t gdn_attn_param_numel(const gdn_attn_config *c, int which) {
    int64_t shape[2];
    const int nd = gdn_attn_param_shape(c, which, shape);
    return gdn_param_numel(shape, nd);
}

size_t gdn_attn_param_offset(const gdn_attn_config *c, int which) {
    size_t off = 0;
    for (int i = 0; i < which && i < GDN_A_COUNT; i++) off += gdn_param_padded(gdn_attn_param_numel(c, i));
    return off;
}

size_t gdn_attn_param_floats(const gdn_attn_config *c) { return gdn_attn_param_offset(c, GDN_A_COUNT); }

/* ---------------------------------------------------------------- plan */

/* Rows are N = B*T tokens. A projection row holds [q_proj out (2Hd, interleaved) | k (Kd) | v (Kd)]. */
struct gdn_attn_plan {
    gdn_attn_config cfg;
    int threads;
    int64_t N, Hd, Kd, P, nqt, nkt;
    size_t tile_floats;
    int64_t *cu;                  /* own copy of cu_seqlens (NULL: dense) */
    int64_t *doc_begin, *doc_end; /* per token: its document [begin, end) (dense: [0, T)) */
    float *cosv, *sinv;           /* T x R/2: cos/sin of each token's angles */
    float *saved;                 /* the forward's kept floats when the caller keeps none */
    float *qr, *kr, *rq, *rk;     /* normed and rotated q [N, Hd], k [N, Kd]; rstd [N, H], [N, Hkv] */
    float *z, *dO, *Dv;           /* gated output (then its gradient) [N, Hd]; dO [N, Hd]; <dO, o> [N, H] */
    float *dqr, *dkr, *dproj;     /* [N, Hd], [N, Kd], [N, P] */
    float *tile, *partial, *mm_ws;
    void *arena;
};

typedef struct { float *proj, *o, *lse; } attn_saved;
static attn_saved saved_view(const gdn_attn_plan *ap, float *s) {
    attn_saved v = {s, s + (size_t)ap->N * ap->P, s + (size_t)ap->N * ap->P + (size_t)ap->N * ap->Hd};
    return v;
}
static size_t saved_floats(const gdn_attn_plan *ap) {
    return (size_t)ap->N * (ap->P + ap->Hd + ap->cfg.H);
}
size_t gdn_attn_saved_floats(const gdn_attn_plan *ap) { return ap ? saved_floats(ap) : 0; }
const gdn_attn_config *gdn_attn_plan_config(const gdn_attn_plan *ap) { return ap ? &ap->cfg : NULL; }

void gdn_attn_plan_destroy(gdn_attn_plan *ap) {
    if (!ap) return;
    free(ap->cu), free(ap->doc_begin), free(ap->doc_end), free(ap->arena);
    free(ap);
}

int gdn_attn_plan_create(gdn_attn_plan **out, const gdn_attn_config *cfg) {
    if (!out) return gdn_fail(GDN_ERR_ARG, "attention plan output pointer is NULL");
    *out = NULL;
    int rc = gdn_attn_config_check(cfg);
    if (rc) return rc;
    gdn_attn_plan *ap = calloc(1, sizeof *ap);
    if (!ap) return gdn_fail(GDN_ERR_NOMEM, "attention plan");
    ap->cfg = *cfg;
    gdn_attn_config *c = &ap->cfg;
#ifdef _OPENMP
    ap->threads = c->threads > 0 ? c->threads : omp_get_max_threads();
#else
    ap->threads = 1;
#endif
    c->threads = ap->threads;
    const int64_t T = c->T, d = c->d, hr = c->R / 2;
    ap->N = c->B * T, ap->Hd = c->H * d, ap->Kd = c->Hkv * d, ap->P = 2 * ap->Hd + 2 * ap->Kd;
    ap->nqt = (T + BQ - 1) / BQ, ap->nkt = (T + BK - 1) / BK;
    ap->doc_begin = malloc(sizeof(int64_t) * (size_t)T);
    ap->doc_end = malloc(sizeof(int64_t) * (size_t)T);
    if (c->cu_seqlens) ap->cu = malloc(sizeof(int64_t) * (size_t)(c->n_docs + 1));
    if (!ap->doc_begin || !ap->doc_end || (c->cu_seqlens && !ap->cu)) {
        gdn_attn_plan_destroy(ap);
        return gdn_fail(GDN_ERR_NOMEM, "attention document table (%lld tokens)", (long long)T);
    }
    if (c->cu_seqlens) {
        memcpy(ap->cu, c->cu_seqlens, sizeof(int64_t) * (size_t)(c->n_docs + 1));
        c->cu_seqlens = ap->cu;
        for (int64_t k = 0; k < c->n_docs; k++)
            for (int64_t t = ap->cu[k]; t < ap->cu[k + 1]; t++) ap->doc_begin[t] = ap->cu[k], ap->doc_end[t] = ap->cu[k + 1];
    } else {
        for (int64_t t = 0; t < T; t++) ap->doc_begin[t] = 0, ap->doc_end[t] = T;
    }
    const size_t N = (size_t)ap->N, Hd = (size_t)ap->Hd, Kd = (size_t)ap->Kd, P = (size_t)ap->P, H = (size_t)c->H;
    ap->tile_floats = ((size_t)2 * BQ * BK + (size_t)2 * BK * d + (size_t)BQ * d + 4 * BQ + 63) & ~(size_t)15;
    const size_t pieces[] = {
        (size_t)T * hr, (size_t)T * hr, saved_floats(ap), /* cos sin saved */
        N * Hd, N * Kd, N * H, N * (size_t)c->Hkv,        /* qr kr rq rk */
        N * Hd, N * Hd, N * H,                            /* z dO Dv */
        N * Hd, N * Kd, N * P,                            /* dqr dkr dproj */
        (size_t)ap->threads * ap->tile_floats, (size_t)ap->threads * 2 * (size_t)d,
        gdn_matmul_ws_floats(ap->threads),
    };
    const size_t np = sizeof pieces / sizeof pieces[0];
    size_t total = 0;
    for (size_t i = 0; i < np; i++) total += (pieces[i] + 15) & ~(size_t)15;
    char what[160];
    snprintf(what, sizeof what, "the attention workspace for B*T = %lld tokens (%.1f KB per token)", (long long)N,
             4.0 * (double)total / 1e3 / (double)N);
    if ((rc = gdn_check_fits(what, 4.0 * (double)total))) {
        gdn_attn_plan_destroy(ap);
        return rc;
    }
    ap->arena = aligned_alloc(64, total * sizeof(float));
    if (!ap->arena) {
        gdn_attn_plan_destroy(ap);
        return gdn_fail(GDN_ERR_NOMEM, "attention workspace: %.1f MB for B*T = %lld tokens", total * 4.0 / 1e6,
                        (long long)N);
    }
    float *cur = ap->arena;
    float **dst[] = {&ap->cosv, &ap->sinv, &ap->saved, &ap->qr, &ap->kr, &ap->rq, &ap->rk, &ap->z, &ap->dO,
                     &ap->Dv, &ap->dqr, &ap->dkr, &ap->dproj, &ap->tile, &ap->partial, &ap->mm_ws};
    for (size_t i = 0; i < np; i++) *dst[i] = gdn_carve(&cur, pieces[i]);
    /* The angles in double (exact), rounded to fp32 once: inv_freq_i = theta^(-2i/R). */
    for (int64_t t = 0; t < T; t++) {
        const double p = (double)(c->cu_seqlens ? t - ap->doc_begin[t] : c->pos_offset + t);
        for (int64_t i = 0; i < hr; i++) {
            const double ang = p * pow(c->rope_theta, -2.0 * (double)i / (double)c->R);
            ap->cosv[t * hr + i] = (float)cos(ang), ap->sinv[t * hr + i] = (float)sin(ang);
        }
    }
    *out = ap;
    return GDN_OK;
}

/* ---------------------------------------------------------------- row-local pieces */

/* Zero-centred RMSNorm with (1 + w), then RoPE on the first R dims, of one head row u -> out;
 * returns the rstd. */
static inline float norm_rope_row(const gdn_attn_config *c, const float *u, const float *w, const float *cs,
                                  const float *sn, float *out) {
    const int64_t d = c->d, hr = c->R / 2;
    const float r = 1.0f / sqrtf(gdn_sumsq(u, d) / (float)d + c->eps);
    for (int64_t i = 0; i < d; i++) out[i] = u[i] * r * (1.0f + w[i]);
    for (int64_t i = 0; i < hr; i++) {
        const float a = out[i], b = out[i + hr];
        out[i] = a * cs[i] - b * sn[i], out[i + hr] = b * cs[i] + a * sn[i];
    }
    return r;
}

/* Its backward: g (gradient of out, overwritten) -> du; dw += g_rot * u r. */
static inline void norm_rope_row_bwd(const gdn_attn_config *c, const float *u, float r, const float *w,
                                     const float *cs, const float *sn, const float *g, float *du, float *dw) {
    const int64_t d = c->d, hr = c->R / 2;
    float e[1024];
    for (int64_t i = 0; i < d; i++) e[i] = g[i];
    for (int64_t i = 0; i < hr; i++) { /* the transpose of the rotation */
        const float a = g[i], b = g[i + hr];
        e[i] = a * cs[i] + b * sn[i], e[i + hr] = b * cs[i] - a * sn[i];
    }
    float s = 0.0f;
    for (int64_t i = 0; i < d; i++) {
        dw[i] += e[i] * u[i] * r;
        e[i] *= 1.0f + w[i];
        s += u[i] * e[i];
    }
    const float k = r * r * r / (float)d * s;
    for (int64_t i = 0; i < d; i++) du[i] = r * e[i] - k * u[i];
}

static void norm_rope_fwd(gdn_attn_plan *ap, const float *proj, const float *w) {
    const gdn_attn_config *c = &ap->cfg;
    const int64_t N = ap->N, H = c->H, Hkv = c->Hkv, d = c->d, hr = c->R / 2, P = ap->P, Hd = ap->Hd, Kd = ap->Kd;
    const float *wq = w + gdn_attn_param_offset(c, GDN_A_Q_NORM), *wk = w + gdn_attn_param_offset(c, GDN_A_K_NORM);
#pragma omp parallel for num_threads(ap->threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int64_t t = n % c->T;
        const float *cs = ap->cosv + t * hr, *sn = ap->sinv + t * hr;
        for (int64_t h = 0; h < H; h++)
            ap->rq[n * H + h] = norm_rope_row(c, proj + n * P + 2 * h * d, wq, cs, sn, ap->qr + n * Hd + h * d);
        for (int64_t j = 0; j < Hkv; j++)
            ap->rk[n * Hkv + j] = norm_rope_row(c, proj + n * P + 2 * Hd + j * d, wk, cs, sn, ap->kr + n * Kd + j * d);
    }
}

/* z = o * sigmoid(gate) */
static void gate_fwd(gdn_attn_plan *ap, const float *proj, const float *o) {
    const int64_t N = ap->N, H = ap->cfg.H, d = ap->cfg.d, P = ap->P, Hd = ap->Hd;
#pragma omp parallel for num_threads(ap->threads) schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < d; i++) {
                const float g = proj[n * P + 2 * h * d + d + i];
                ap->z[n * Hd + h * d + i] = o[n * Hd + h * d + i] / (1.0f + expf(-g));
            }
}

/* ---------------------------------------------------------------- the core, flash style */

/* S[i][c] for queries t0+i, keys k0+c -> probabilities in place (masked ones 0), given the row's
 * log-sum-exp (backward) — used by both backward passes. */
static inline void probs(const gdn_attn_plan *ap, float *S, int64_t t0, int nq, int64_t k0, int nk,
                         const float *lse, int64_t lse_stride, float scale) {
    for (int i = 0; i < nq; i++) {
        const int64_t t = t0 + i, beg = ap->doc_begin[t];
        const float l = lse[i * lse_stride];
        float *s = S + (size_t)i * BK;
        for (int cc = 0; cc < nk; cc++) {
            const int64_t u = k0 + cc;
            s[cc] = (u <= t && u >= beg && l > -INFINITY) ? gdn_expf_ftz(s[cc] * scale - l) : 0.0f;
        }
    }
}

static void core_fwd(gdn_attn_plan *ap, const float *proj, float *o, float *lse) {
    const gdn_attn_config *c = &ap->cfg;
    const int64_t T = c->T, H = c->H, d = c->d, P = ap->P, Hd = ap->Hd, Kd = ap->Kd, grp = c->H / c->Hkv;
    const float scale = 1.0f / sqrtf((float)d);
    const int64_t jobs = c->B * H * ap->nqt;
#pragma omp parallel for num_threads(ap->threads) schedule(dynamic, 1)
    for (int64_t job = 0; job < jobs; job++) {
        const int64_t qt = ap->nqt - 1 - job / (c->B * H), b = job % (c->B * H) / H, h = job % H; /* longest first */
        const int64_t t0 = qt * BQ, j = h / grp;
        const int nq = (int)(T - t0 < BQ ? T - t0 : BQ);
        float *S = ap->tile + (size_t)gdn_thread_id() * ap->tile_floats;
        float *acc = S + (size_t)BQ * BK, *m = acc + (size_t)BQ * d, *l = m + BQ;
        const float *Q = ap->qr + (b * T + t0) * Hd + h * d;
        const float *K = ap->kr + b * T * Kd + j * d, *V = proj + b * T * P + 2 * Hd + Kd + j * d;
        for (int i = 0; i < nq; i++) m[i] = -INFINITY, l[i] = 0.0f;
        memset(acc, 0, sizeof(float) * (size_t)BQ * d);
        const int64_t lo = ap->doc_begin[t0], hi = t0 + nq; /* keys [lo, hi) can be seen */
        for (int64_t k0 = lo / BK * BK; k0 < hi; k0 += BK) {
            const int nk = (int)(hi - k0 < BK ? hi - k0 : BK);
            gdn_gemm(GDN_GEMM_B_TRANS, nq, nk, (int)d, Q, (int)Hd, K + k0 * Kd, (int)Kd, S, BK);
            for (int i = 0; i < nq; i++) {
                const int64_t t = t0 + i, beg = ap->doc_begin[t];
                float *s = S + (size_t)i * BK, mx = m[i];
                for (int cc = 0; cc < nk; cc++) {
                    const int64_t u = k0 + cc;
                    s[cc] = (u <= t && u >= beg) ? s[cc] * scale : -INFINITY;
                    mx = s[cc] > mx ? s[cc] : mx;
                }
                if (mx == -INFINITY) { /* nothing visible yet */
                    for (int cc = 0; cc < nk; cc++) s[cc] = 0.0f;
                    continue;
                }
                const float alpha = m[i] == -INFINITY ? 0.0f : gdn_expf_ftz(m[i] - mx);
                float sum = 0.0f;
                for (int cc = 0; cc < nk; cc++) {
                    s[cc] = s[cc] == -INFINITY ? 0.0f : gdn_expf_ftz(s[cc] - mx);
                    sum += s[cc];
                }
                l[i] = l[i] * alpha + sum, m[i] = mx;
                if (alpha != 1.0f)
                    for (int64_t e = 0; e < d; e++) acc[i * d + e] *= alpha;
            }
            gdn_gemm(GDN_GEMM_ACC, nq, (int)d, nk, S, BK, V + k0 * P, (int)P, acc, (int)d);
        }
        for (int i = 0; i < nq; i++) {
            float *orow = o + (b * T + t0 + i) * Hd + h * d;
            const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f; /* a fully masked row gives 0 */
            for (int64_t e = 0; e < d; e++) orow[e] = acc[i * d + e] * inv;
            lse[(b * T + t0 + i) * H + h] = l[i] > 0.0f ? m[i] + logf(l[i]) : -INFINITY;
        }
    }
}

/* dQ over (batch, head, query tile); dK, dV over (batch, kv head, key tile), summing the group's
 * query heads. dV goes into dproj's v columns, dK into dkr, dQ into dqr. */
static void core_bwd(gdn_attn_plan *ap, const float *proj, const float *lse) {
    const gdn_attn_config *c = &ap->cfg;
    const int64_t T = c->T, H = c->H, Hkv = c->Hkv, d = c->d, P = ap->P, Hd = ap->Hd, Kd = ap->Kd,
                  grp = c->H / c->Hkv;
    const float scale = 1.0f / sqrtf((float)d);
    const int64_t qjobs = c->B * H * ap->nqt, kjobs = c->B * Hkv * ap->nkt;
#pragma omp parallel num_threads(ap->threads)
    {
        float *S = ap->tile + (size_t)gdn_thread_id() * ap->tile_floats;
        float *dP = S + (size_t)BQ * BK, *acc = dP + (size_t)BQ * BK, *acc2 = acc + (size_t)BK * d;
#pragma omp for schedule(dynamic, 1)
        for (int64_t job = 0; job < qjobs; job++) {
            const int64_t qt = ap->nqt - 1 - job / (c->B * H), b = job % (c->B * H) / H, h = job % H; /* longest first */
            const int64_t t0 = qt * BQ, j = h / grp;
            const int nq = (int)(T - t0 < BQ ? T - t0 : BQ);
            const float *Q = ap->qr + (b * T + t0) * Hd + h * d, *dO = ap->dO + (b * T + t0) * Hd + h * d;
            const float *K = ap->kr + b * T * Kd + j * d, *V = proj + b * T * P + 2 * Hd + Kd + j * d;
            const float *L = lse + (b * T + t0) * H + h, *Dr = ap->Dv + (b * T + t0) * H + h;
            memset(acc, 0, sizeof(float) * (size_t)BQ * d);
            const int64_t lo = ap->doc_begin[t0], hi = t0 + nq;
            for (int64_t k0 = lo / BK * BK; k0 < hi; k0 += BK) {
                const int nk = (int)(hi - k0 < BK ? hi - k0 : BK);
                gdn_gemm(GDN_GEMM_B_TRANS, nq, nk, (int)d, Q, (int)Hd, K + k0 * Kd, (int)Kd, S, BK);
                probs(ap, S, t0, nq, k0, nk, L, H, scale);
                gdn_gemm(GDN_GEMM_B_TRANS, nq, nk, (int)d, dO, (int)Hd, V + k0 * P, (int)P, dP, BK);
                for (int i = 0; i < nq; i++)
                    for (int cc = 0; cc < nk; cc++)
                        dP[i * BK + cc] = S[i * BK + cc] * (dP[i * BK + cc] - Dr[i * H]);
                gdn_gemm(GDN_GEMM_ACC, nq, (int)d, nk, dP, BK, K + k0 * Kd, (int)Kd, acc, (int)d);
            }
            for (int i = 0; i < nq; i++)
                for (int64_t e = 0; e < d; e++) ap->dqr[(b * T + t0 + i) * Hd + h * d + e] = scale * acc[i * d + e];
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t job = 0; job < kjobs; job++) {
            const int64_t kt = job / (c->B * Hkv), b = job % (c->B * Hkv) / Hkv, j = job % Hkv; /* longest first */
            const int64_t k0 = kt * BK;
            const int nk = (int)(T - k0 < BK ? T - k0 : BK);
            const float *K = ap->kr + (b * T + k0) * Kd + j * d, *V = proj + (b * T + k0) * P + 2 * Hd + Kd + j * d;
            memset(acc, 0, sizeof(float) * (size_t)BK * d);  /* dK */
            memset(acc2, 0, sizeof(float) * (size_t)BK * d); /* dV */
            const int64_t qend = ap->doc_end[k0 + nk - 1]; /* no later query sees these keys */
            for (int64_t h = j * grp; h < (j + 1) * grp; h++)
                for (int64_t t0 = k0 / BQ * BQ; t0 < qend; t0 += BQ) {
                    const int nq = (int)(T - t0 < BQ ? T - t0 : BQ);
                    const float *Q = ap->qr + (b * T + t0) * Hd + h * d, *dO = ap->dO + (b * T + t0) * Hd + h * d;
                    const float *L = lse + (b * T + t0) * H + h, *Dr = ap->Dv + (b * T + t0) * H + h;
                    gdn_gemm(GDN_GEMM_B_TRANS, nq, nk, (int)d, Q, (int)Hd, K, (int)Kd, S, BK);
                    probs(ap, S, t0, nq, k0, nk, L, H, scale);
                    gdn_gemm(GDN_GEMM_ACC | GDN_GEMM_A_TRANS, nk, (int)d, nq, S, BK, dO, (int)Hd, acc2, (int)d);
                    gdn_gemm(GDN_GEMM_B_TRANS, nq, nk, (int)d, dO, (int)Hd, V, (int)P, dP, BK);
                    for (int i = 0; i < nq; i++)
                        for (int cc = 0; cc < nk; cc++)
                            dP[i * BK + cc] = S[i * BK + cc] * (dP[i * BK + cc] - Dr[i * H]);
                    gdn_gemm(GDN_GEMM_ACC | GDN_GEMM_A_TRANS, nk, (int)d, nq, dP, BK, Q, (int)Hd, acc, (int)d);
                }
            for (int cc = 0; cc < nk; cc++)
                for (int64_t e = 0; e < d; e++) {
                    ap->dkr[(b * T + k0 + cc) * Kd + j * d + e] = scale * acc[cc * d + e];
                    ap->dproj[(b * T + k0 + cc) * P + 2 * Hd + Kd + j * d + e] = acc2[cc * d + e];
                }
        }
    }
}

/* ---------------------------------------------------------------- entry points */

static int check_weights(const gdn_attn_plan *ap, const float *w) {
    if (!w) return gdn_fail(GDN_ERR_ARG, "input 'w' (the attention weights) is NULL");
    if (!ap->cfg.check_finite) return GDN_OK;
    for (int p = 0; p < GDN_A_COUNT; p++) {
        const int rc = gdn_check_tensor(gdn_attn_param_name(p), w + gdn_attn_param_offset(&ap->cfg, p),
                                        (int64_t)gdn_attn_param_numel(&ap->cfg, p), 1, ap->threads);
        if (rc) return rc;
    }
    return GDN_OK;
}

/* Projections, norms and RoPE, the core and the gate: sv filled, ap->z holds the gated output. */
static void forward_to_z(gdn_attn_plan *ap, attn_saved sv, const float *x, const float *w) {
    const gdn_attn_config *c = &ap->cfg;
    const int64_t N = ap->N, E = c->E, P = ap->P, Hd = ap->Hd, Kd = ap->Kd;
    gdn_matmul(GDN_GEMM_B_TRANS, N, 2 * Hd, E, x, E, w + gdn_attn_param_offset(c, GDN_A_Q_PROJ), E, sv.proj, P,
               ap->mm_ws, ap->threads);
    gdn_matmul(GDN_GEMM_B_TRANS, N, Kd, E, x, E, w + gdn_attn_param_offset(c, GDN_A_K_PROJ), E, sv.proj + 2 * Hd, P,
               ap->mm_ws, ap->threads);
    gdn_matmul(GDN_GEMM_B_TRANS, N, Kd, E, x, E, w + gdn_attn_param_offset(c, GDN_A_V_PROJ), E,
               sv.proj + 2 * Hd + Kd, P, ap->mm_ws, ap->threads);
    norm_rope_fwd(ap, sv.proj, w);
    core_fwd(ap, sv.proj, sv.o, sv.lse);
    gate_fwd(ap, sv.proj, sv.o);
}

int gdn_attn_forward(gdn_attn_plan *ap, float *y, float *saved, const float *x, const float *w) {
    if (!ap) return gdn_fail(GDN_ERR_ARG, "gdn_attn_forward: plan is NULL");
    const gdn_attn_config *c = &ap->cfg;
    if (!y) return gdn_fail(GDN_ERR_ARG, "output 'y' is NULL");
    int rc = gdn_check_tensor("x", x, ap->N * c->E, c->check_finite, ap->threads);
    if (rc || (rc = check_weights(ap, w))) return rc;
    const gdn_fpmode fm = gdn_fp_fast_begin();
    forward_to_z(ap, saved_view(ap, saved ? saved : ap->saved), x, w);
    gdn_matmul(GDN_GEMM_B_TRANS, ap->N, c->E, ap->Hd, ap->z, ap->Hd, w + gdn_attn_param_offset(c, GDN_A_O_PROJ),
               ap->Hd, y, c->E, ap->mm_ws, ap->threads);
    gdn_fp_fast_end(fm);
    return gdn_check_output("y", y, ap->N * c->E, ap->threads);
}

int gdn_attn_backward(gdn_attn_plan *ap, float *dx, float *dw, const float *x, const float *w, const float *saved,
                      const float *dy) {
    if (!ap) return gdn_fail(GDN_ERR_ARG, "gdn_attn_backward: plan is NULL");
    const gdn_attn_config *c = &ap->cfg;
    if (!dx) return gdn_fail(GDN_ERR_ARG, "output 'dx' is NULL");
    if (!dw) return gdn_fail(GDN_ERR_ARG, "output 'dw' is NULL");
    int rc = gdn_check_tensor("x", x, ap->N * c->E, c->check_finite, ap->threads);
    if (rc || (rc = gdn_check_tensor("dy", dy, ap->N * c->E, c->check_finite, ap->threads)) ||
        (rc = check_weights(ap, w)))
        return rc;
    const int64_t N = ap->N, E = c->E, H = c->H, Hkv = c->Hkv, d = c->d, hr = c->R / 2, P = ap->P, Hd = ap->Hd,
                  Kd = ap->Kd;
    const gdn_fpmode fm = gdn_fp_fast_begin();
    attn_saved sv;
    if (saved) {
        sv = saved_view(ap, (float *)saved); /* read only */
        norm_rope_fwd(ap, sv.proj, w);
        gate_fwd(ap, sv.proj, sv.o);
    } else {
        sv = saved_view(ap, ap->saved);
        forward_to_z(ap, sv, x, w);
    }
    memset(dw, 0, sizeof(float) * gdn_attn_param_floats(c));
    const float *wo = w + gdn_attn_param_offset(c, GDN_A_O_PROJ);
    /* o_proj: dWo = dy^T z, dz = dy Wo (into z) */
    gdn_matmul(GDN_GEMM_A_TRANS, E, Hd, N, dy, E, ap->z, Hd, dw + gdn_attn_param_offset(c, GDN_A_O_PROJ), Hd,
               ap->mm_ws, ap->threads);
    gdn_matmul(0, N, Hd, E, dy, E, wo, Hd, ap->z, Hd, ap->mm_ws, ap->threads);
    /* the gate: dO = dz sigma, dgate = dz o sigma (1 - sigma); D = <dO, o> */
#pragma omp parallel for num_threads(ap->threads) schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t h = 0; h < H; h++) {
            float D = 0.0f;
            for (int64_t i = 0; i < d; i++) {
                const size_t zi = (size_t)(n * Hd + h * d + i);
                const float g = sv.proj[n * P + 2 * h * d + d + i], sg = 1.0f / (1.0f + expf(-g));
                const float dz = ap->z[zi], o = sv.o[zi];
                ap->dO[zi] = dz * sg;
                ap->dproj[n * P + 2 * h * d + d + i] = dz * o * sg * (1.0f - sg);
                D += dz * sg * o;
            }
            ap->Dv[n * H + h] = D;
        }
    core_bwd(ap, sv.proj, sv.lse);
    /* norms and RoPE: dqr, dkr -> dproj q and k columns; dw of the norms per thread, then summed */
    const float *wq = w + gdn_attn_param_offset(c, GDN_A_Q_NORM), *wk = w + gdn_attn_param_offset(c, GDN_A_K_NORM);
    memset(ap->partial, 0, sizeof(float) * (size_t)ap->threads * 2 * (size_t)d);
#pragma omp parallel num_threads(ap->threads)
    {
        float *pq = ap->partial + (size_t)gdn_thread_id() * 2 * (size_t)d, *pk = pq + d;
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const int64_t t = n % c->T;
            const float *cs = ap->cosv + t * hr, *sn = ap->sinv + t * hr;
            for (int64_t h = 0; h < H; h++)
                norm_rope_row_bwd(c, sv.proj + n * P + 2 * h * d, ap->rq[n * H + h], wq, cs, sn,
                                  ap->dqr + n * Hd + h * d, ap->dproj + n * P + 2 * h * d, pq);
            for (int64_t j = 0; j < Hkv; j++)
                norm_rope_row_bwd(c, sv.proj + n * P + 2 * Hd + j * d, ap->rk[n * Hkv + j], wk, cs, sn,
                                  ap->dkr + n * Kd + j * d, ap->dproj + n * P + 2 * Hd + j * d, pk);
        }
    }
    float *dwq = dw + gdn_attn_param_offset(c, GDN_A_Q_NORM), *dwk = dw + gdn_attn_param_offset(c, GDN_A_K_NORM);
    for (int th = 0; th < ap->threads; th++)
        for (int64_t i = 0; i < d; i++)
            dwq[i] += ap->partial[(size_t)th * 2 * d + i], dwk[i] += ap->partial[(size_t)th * 2 * d + d + i];
    /* the projections: dx = dproj [Wq; Wk; Wv], dW = dproj^T x */
    const int cols[3] = {GDN_A_Q_PROJ, GDN_A_K_PROJ, GDN_A_V_PROJ};
    const int64_t at[3] = {0, 2 * Hd, 2 * Hd + Kd}, width[3] = {2 * Hd, Kd, Kd};
    for (int m = 0; m < 3; m++) {
        gdn_matmul(m ? GDN_GEMM_ACC : 0, N, E, width[m], ap->dproj + at[m], P, w + gdn_attn_param_offset(c, cols[m]),
                   E, dx, E, ap->mm_ws, ap->threads);
        gdn_matmul(GDN_GEMM_A_TRANS, width[m], E, N, ap->dproj + at[m], P, x, E,
                   dw + gdn_attn_param_offset(c, cols[m]), E, ap->mm_ws, ap->threads);
    }
    gdn_fp_fast_end(fm);
    if ((rc = gdn_check_output("dx", dx, N * E, ap->threads))) return rc;
    return gdn_check_output("dw", dw, (int64_t)gdn_attn_param_floats(c), ap->threads);
}
