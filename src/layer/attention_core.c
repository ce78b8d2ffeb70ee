/* The flash-style core of the gated attention layer over a view (attention_internal.h): the
 * queries of one call against one block of keys. A job's rows are TB tokens x hg query heads of
 * one kv head (hg: the largest divisor of the group size H/Hkv up to 16), gathered into a tile
 * once, so a key tile read from memory serves the whole group (decode: one token, the group's
 * heads). Tiles of BK keys; a running max and sum per row in fp32; only the log-sum-exp kept.
 * The backward recomputes the probabilities from the final log-sum-exp in two passes, dQ over
 * query blocks and dK, dV over key tiles, so no two threads ever add into the same row and the
 * result does not depend on the schedule. Tiles above the diagonal and outside a document are
 * skipped; a query that sees no key gives 0 (lse = -inf). */
#include "attention_internal.h"

#include <math.h>
#include <string.h>

enum { BQ = 64, BK = 64 };

size_t gdn_attn_tile_floats(int64_t d) {
    /* Qt, dOt [BQ d]; S, dP [BQ BK]; acc, acc2 [BK d]; m, l, lse, D [BQ]; tg, db int64 [BQ] */
    return ((size_t)4 * BQ * (size_t)d + (size_t)2 * BQ * BK + (size_t)8 * BQ + 15) & ~(size_t)15;
}

typedef struct {
    float *Qt, *dOt, *S, *dP, *acc, *acc2, *m, *l, *lse, *D;
    int64_t *tg, *db;
} tile_view;

static tile_view tile_of(const gdn_attn_core *v) {
    tile_view t;
    const size_t d = (size_t)v->d;
    t.Qt = v->tile + (size_t)gdn_thread_id() * gdn_attn_tile_floats(v->d);
    t.dOt = t.Qt + BQ * d, t.S = t.dOt + BQ * d, t.dP = t.S + BQ * BK, t.acc = t.dP + BQ * BK;
    t.acc2 = t.acc + BK * d, t.m = t.acc2 + BK * d, t.l = t.m + BQ, t.lse = t.l + BQ, t.D = t.lse + BQ;
    t.tg = (int64_t *)(t.D + BQ), t.db = t.tg + BQ;
    return t;
}

static int64_t heads_per_job(const gdn_attn_core *v) {
    const int64_t grp = v->H / v->Hkv;
    int64_t hg = grp < 16 ? grp : 16;
    while (grp % hg) hg--;
    return hg;
}

/* The rows of query block blk of head group g in batch row b: i = tt hg + hh is token blk TB + tt
 * of head g hg + hh. Gathers Q (and dO, lse, D when given) and each row's global index and
 * document start; returns the row count. */
static int gather_rows(const gdn_attn_core *v, const tile_view *t, int64_t b, int64_t g, int64_t blk, int64_t hg,
                       const float *Q, const float *dO, const float *lse, const float *D) {
    const int64_t TB = BQ / hg, d = v->d, tok0 = blk * TB;
    const int64_t ntok = v->nq - tok0 < TB ? v->nq - tok0 : TB;
    int64_t db = -1, db_end = -1;
    for (int64_t tt = 0; tt < ntok; tt++) {
        const int64_t tl = tok0 + tt, tgl = v->q0 + tl, row = b * v->nq + tl;
        if (tgl >= db_end) /* a new document (dense: once) */
            db = gdn_attn_doc_begin(v->cu, v->n_docs, tgl), db_end = gdn_attn_doc_end(v->cu, v->n_docs, tgl);
        for (int64_t hh = 0; hh < hg; hh++) {
            const int64_t i = tt * hg + hh, h = g * hg + hh;
            memcpy(t->Qt + i * d, Q + row * v->qld + h * d, sizeof(float) * (size_t)d);
            if (dO) {
                memcpy(t->dOt + i * d, dO + row * v->qld + h * d, sizeof(float) * (size_t)d);
                t->lse[i] = lse[row * v->H + h], t->D[i] = D[row * v->H + h];
            }
            t->tg[i] = tgl, t->db[i] = db;
        }
    }
    return (int)(ntok * hg);
}

/* The probabilities of rows x keys [u0, u0 + n) (global) in S from the scores, given each row's
 * final lse: exp(s scale - lse), 0 where masked. */
static inline void probs(const tile_view *t, int rows, int64_t u0, int n, float scale) {
    for (int i = 0; i < rows; i++) {
        const int64_t tg = t->tg[i], db = t->db[i];
        const float l = t->lse[i];
        float *s = t->S + (size_t)i * BK;
        for (int c = 0; c < n; c++) {
            const int64_t u = u0 + c;
            s[c] = (u <= tg && u >= db && l > -INFINITY) ? gdn_expf_ftz(s[c] * scale - l) : 0.0f;
        }
    }
}

/* dS = P (dP - D), in dP */
static inline void dscores(const tile_view *t, int rows, int n) {
    for (int i = 0; i < rows; i++) {
        const float Di = t->D[i];
        float *dp = t->dP + (size_t)i * BK;
        const float *p = t->S + (size_t)i * BK;
        for (int c = 0; c < n; c++) dp[c] = p[c] * (dp[c] - Di);
    }
}

/* The keys rows [first, last] of a query block can see, clipped to the view: [lo, hi) global. */
static inline void key_range(const gdn_attn_core *v, const tile_view *t, int rows, int64_t *lo, int64_t *hi) {
    *lo = t->db[0] > v->k0 ? t->db[0] : v->k0;
    *hi = t->tg[rows - 1] + 1 < v->k0 + v->nk ? t->tg[rows - 1] + 1 : v->k0 + v->nk;
}

void gdn_attn_core_forward(const gdn_attn_core *v, float *o, float *lse) {
    const int64_t hg = heads_per_job(v), TB = BQ / hg, nblk = (v->nq + TB - 1) / TB, ng = v->H / hg;
    const int64_t grp = v->H / v->Hkv, d = v->d, jobs = v->B * ng * nblk;
    const float scale = 1.0f / sqrtf((float)d);
#pragma omp parallel for num_threads(v->threads) schedule(dynamic, 1)
    for (int64_t job = 0; job < jobs; job++) {
        const int64_t blk = nblk - 1 - job / (v->B * ng), b = job % (v->B * ng) / ng, g = job % ng; /* longest first */
        const tile_view t = tile_of(v);
        const int rows = gather_rows(v, &t, b, g, blk, hg, v->Q, NULL, NULL, NULL);
        const int64_t j = g * hg / grp;
        const float *K = v->K.p + b * v->K.bs + j * v->K.hs, *V = v->V.p + b * v->V.bs + j * v->V.hs;
        for (int i = 0; i < rows; i++) t.m[i] = -INFINITY, t.l[i] = 0.0f;
        memset(t.acc, 0, sizeof(float) * (size_t)rows * (size_t)d);
        int64_t lo, hi;
        key_range(v, &t, rows, &lo, &hi);
        for (int64_t u0 = v->k0 + (lo > v->k0 ? (lo - v->k0) / BK * BK : 0); u0 < hi; u0 += BK) {
            const int n = (int)(hi - u0 < BK ? hi - u0 : BK);
            gdn_gemm(GDN_GEMM_B_TRANS, rows, n, (int)d, t.Qt, (int)d, K + (u0 - v->k0) * v->K.ld, (int)v->K.ld, t.S, BK);
            for (int i = 0; i < rows; i++) {
                const int64_t tg = t.tg[i], db = t.db[i];
                float *s = t.S + (size_t)i * BK, mx = t.m[i];
                for (int c = 0; c < n; c++) {
                    const int64_t u = u0 + c;
                    s[c] = (u <= tg && u >= db) ? s[c] * scale : -INFINITY;
                    mx = s[c] > mx ? s[c] : mx;
                }
                if (mx == -INFINITY) { /* nothing visible yet */
                    memset(s, 0, sizeof(float) * (size_t)n);
                    continue;
                }
                const float alpha = t.m[i] == -INFINITY ? 0.0f : gdn_expf_ftz(t.m[i] - mx);
                float sum = 0.0f;
                for (int c = 0; c < n; c++) {
                    s[c] = s[c] == -INFINITY ? 0.0f : gdn_expf_ftz(s[c] - mx);
                    sum += s[c];
                }
                t.l[i] = t.l[i] * alpha + sum, t.m[i] = mx;
                if (alpha != 1.0f)
                    for (int64_t e = 0; e < d; e++) t.acc[i * d + e] *= alpha;
            }
            gdn_gemm(GDN_GEMM_ACC, rows, (int)d, n, t.S, BK, V + (u0 - v->k0) * v->V.ld, (int)v->V.ld, t.acc, (int)d);
        }
        for (int i = 0; i < rows; i++) {
            const int64_t tt = i / hg, h = g * hg + i % hg, row = b * v->nq + blk * TB + tt;
            float *orow = o + row * v->qld + h * d;
            const float inv = t.l[i] > 0.0f ? 1.0f / t.l[i] : 0.0f; /* a query that sees nothing gives 0 */
            for (int64_t e = 0; e < d; e++) orow[e] = t.acc[i * d + e] * inv;
            lse[row * v->H + h] = t.l[i] > 0.0f ? t.m[i] + logf(t.l[i]) : -INFINITY;
        }
    }
}

void gdn_attn_merge(int64_t rows, int64_t H, int64_t d, int64_t qld, float *o, float *lse, const float *o2,
                    const float *lse2, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < H; h++) {
            const float l1 = lse[r * H + h], l2 = lse2[r * H + h];
            if (l2 == -INFINITY) continue;
            float *a = o + r * qld + h * d;
            const float *c = o2 + r * qld + h * d;
            if (l1 == -INFINITY) {
                memcpy(a, c, sizeof(float) * (size_t)d);
                lse[r * H + h] = l2;
                continue;
            }
            const float m = l1 > l2 ? l1 : l2, w1 = expf(l1 - m), w2 = expf(l2 - m), inv = 1.0f / (w1 + w2);
            for (int64_t e = 0; e < d; e++) a[e] = (w1 * a[e] + w2 * c[e]) * inv;
            lse[r * H + h] = m + logf(w1 + w2);
        }
}

void gdn_attn_core_backward_q(const gdn_attn_core *v, const float *dO, const float *lse, const float *D, float *dq) {
    const int64_t hg = heads_per_job(v), TB = BQ / hg, nblk = (v->nq + TB - 1) / TB, ng = v->H / hg;
    const int64_t grp = v->H / v->Hkv, d = v->d, jobs = v->B * ng * nblk;
    const float scale = 1.0f / sqrtf((float)d);
#pragma omp parallel for num_threads(v->threads) schedule(dynamic, 1)
    for (int64_t job = 0; job < jobs; job++) {
        const int64_t blk = nblk - 1 - job / (v->B * ng), b = job % (v->B * ng) / ng, g = job % ng;
        const tile_view t = tile_of(v);
        const int rows = gather_rows(v, &t, b, g, blk, hg, v->Q, dO, lse, D);
        const int64_t j = g * hg / grp;
        const float *K = v->K.p + b * v->K.bs + j * v->K.hs, *V = v->V.p + b * v->V.bs + j * v->V.hs;
        int64_t lo, hi;
        key_range(v, &t, rows, &lo, &hi);
        if (lo >= hi) continue;
        memset(t.acc, 0, sizeof(float) * (size_t)rows * (size_t)d);
        for (int64_t u0 = v->k0 + (lo > v->k0 ? (lo - v->k0) / BK * BK : 0); u0 < hi; u0 += BK) {
            const int n = (int)(hi - u0 < BK ? hi - u0 : BK);
            const float *Ku = K + (u0 - v->k0) * v->K.ld, *Vu = V + (u0 - v->k0) * v->V.ld;
            gdn_gemm(GDN_GEMM_B_TRANS, rows, n, (int)d, t.Qt, (int)d, Ku, (int)v->K.ld, t.S, BK);
            probs(&t, rows, u0, n, scale);
            gdn_gemm(GDN_GEMM_B_TRANS, rows, n, (int)d, t.dOt, (int)d, Vu, (int)v->V.ld, t.dP, BK);
            dscores(&t, rows, n);
            gdn_gemm(GDN_GEMM_ACC, rows, (int)d, n, t.dP, BK, Ku, (int)v->K.ld, t.acc, (int)d);
        }
        for (int i = 0; i < rows; i++) {
            const int64_t tt = i / hg, h = g * hg + i % hg, row = b * v->nq + blk * TB + tt;
            float *r = dq + row * v->qld + h * d;
            for (int64_t e = 0; e < d; e++) r[e] += scale * t.acc[i * d + e];
        }
    }
}

void gdn_attn_core_backward_kv(const gdn_attn_core *v, const float *dO, const float *lse, const float *D,
                               gdn_attn_kv dk, gdn_attn_kv dv) {
    const int64_t hg = heads_per_job(v), TB = BQ / hg, ng_kv = v->H / v->Hkv / hg;
    const int64_t d = v->d, nkt = (v->nk + BK - 1) / BK, jobs = v->B * v->Hkv * nkt;
    const float scale = 1.0f / sqrtf((float)d);
#pragma omp parallel for num_threads(v->threads) schedule(dynamic, 1)
    for (int64_t job = 0; job < jobs; job++) {
        const int64_t kt = job / (v->B * v->Hkv), b = job % (v->B * v->Hkv) / v->Hkv, j = job % v->Hkv; /* longest first */
        const int64_t u0 = v->k0 + kt * BK;
        const int n = (int)(v->k0 + v->nk - u0 < BK ? v->k0 + v->nk - u0 : BK);
        /* the queries that can see these keys: [u0, the end of the last key's document) */
        const int64_t de = gdn_attn_doc_end(v->cu, v->n_docs, u0 + n - 1);
        const int64_t t_lo = u0 - v->q0 > 0 ? u0 - v->q0 : 0;
        const int64_t t_hi = de == INT64_MAX || de - v->q0 > v->nq ? v->nq : de - v->q0;
        if (t_lo >= t_hi) continue;
        const tile_view t = tile_of(v);
        const float *Ku = v->K.p + b * v->K.bs + j * v->K.hs + kt * BK * v->K.ld;
        const float *Vu = v->V.p + b * v->V.bs + j * v->V.hs + kt * BK * v->V.ld;
        memset(t.acc, 0, sizeof(float) * (size_t)BK * (size_t)d);  /* dK */
        memset(t.acc2, 0, sizeof(float) * (size_t)BK * (size_t)d); /* dV */
        for (int64_t g = j * ng_kv; g < (j + 1) * ng_kv; g++)
            for (int64_t blk = t_lo / TB; blk * TB < t_hi; blk++) {
                const int rows = gather_rows(v, &t, b, g, blk, hg, v->Q, dO, lse, D);
                gdn_gemm(GDN_GEMM_B_TRANS, rows, n, (int)d, t.Qt, (int)d, Ku, (int)v->K.ld, t.S, BK);
                probs(&t, rows, u0, n, scale);
                gdn_gemm(GDN_GEMM_ACC | GDN_GEMM_A_TRANS, n, (int)d, rows, t.S, BK, t.dOt, (int)d, t.acc2, (int)d);
                gdn_gemm(GDN_GEMM_B_TRANS, rows, n, (int)d, t.dOt, (int)d, Vu, (int)v->V.ld, t.dP, BK);
                dscores(&t, rows, n);
                gdn_gemm(GDN_GEMM_ACC | GDN_GEMM_A_TRANS, n, (int)d, rows, t.dP, BK, t.Qt, (int)d, t.acc, (int)d);
            }
        float *dkr = dk.p + b * dk.bs + j * dk.hs + kt * BK * dk.ld, *dvr = dv.p + b * dv.bs + j * dv.hs + kt * BK * dv.ld;
        for (int c = 0; c < n; c++)
            for (int64_t e = 0; e < d; e++) dkr[c * dk.ld + e] += scale * t.acc[c * d + e], dvr[c * dv.ld + e] += t.acc2[c * d + e];
    }
}

const char *gdn_attn_core_path(const gdn_attn_core *v) {
    (void)v;
    return "flash 64x64 tiles, two-pass backward, gdn_gemm";
}
