/* The attention core alone (gdn_sdpa_*, include/gdncp/attention.h) against a plain double-loop
 * reference written here: causal softmax attention, GQA (query head h on kv head h / (H/Hkv)),
 * packed documents; forward o and lse, backward dq, dk, dv, each within 1e-5 (max-abs error over
 * max-abs of the reference). Shapes: T = 1, T not a multiple of the 64-token tile, H == Hkv, MQA,
 * group sizes 3, 8 and 16, d = 256 (the Qwen3.5 head), batch rows, packed documents of one token
 * and across tiles, one and two threads.
 * Negative controls: the reference made wrong on purpose (kv head h % Hkv instead of h / grp, the
 * mask off by one key, a document boundary ignored) must fail the same comparisons.
 * Then: the forward without lse gives the same o, thread counts give identical results, and bad
 * input is refused with a message naming it. Last, the core under gdn_sdpa_* over views whose
 * queries and keys are different blocks of one stream (q0 != k0, as the CP and cache paths call
 * it: keys before, across and after the queries, rows that see no key, documents), o, lse and the
 * accumulated dq, dk, dv against the same loops; control: the keys' offset ignored. */
#include "harness.h"
#include "attention_internal.h" /* the core over a view (the CP and cache paths' entry points) */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { RIGHT = 0, WRONG_GQA = 1, WRONG_MASK = 2, WRONG_DOCS = 3 };
static const char *const variant_name[] = {"", "kv head h %% Hkv", "mask off by one (sees key t + 1)",
                                           "document boundaries ignored"};

typedef struct {
    int64_t B, T, H, Hkv, d;
    const int64_t *cu; /* NULL: dense */
    int64_t n_docs;
    double amp; /* q, k uniform in (-amp, amp); 0: 1.5 */
} shape;

static int64_t doc_begin(const shape *s, int64_t t, int variant) {
    if (!s->cu || variant == WRONG_DOCS) return 0;
    int64_t k = 0;
    while (s->cu[k + 1] <= t) k++;
    return s->cu[k];
}
static int64_t doc_end(const shape *s, int64_t t, int variant) {
    if (!s->cu || variant == WRONG_DOCS) return s->T;
    int64_t k = 0;
    while (s->cu[k + 1] <= t) k++;
    return s->cu[k + 1];
}

/* The keys query t sees: [lo, hi). */
static void visible(const shape *s, int64_t t, int variant, int64_t *lo, int64_t *hi) {
    *lo = doc_begin(s, t, variant);
    *hi = t + 1 + (variant == WRONG_MASK);
    const int64_t e = doc_end(s, t, variant);
    if (*hi > e) *hi = e;
}

/* Plain loops in double: o [B,T,H,d], lse [B,T,H]; with dout also dq, dk, dv. */
static void reference(const shape *s, int variant, const double *q, const double *k, const double *v,
                      const double *dout, double *o, double *lse, double *dq, double *dk, double *dv) {
    const int64_t T = s->T, H = s->H, Hkv = s->Hkv, d = s->d, grp = H / Hkv;
    const double scale = 1.0 / sqrt((double)d);
    double *p = dalloc(T), *dp = dalloc(T);
    if (dout) {
        memset(dq, 0, sizeof(double) * (size_t)(s->B * T * H * d));
        memset(dk, 0, sizeof(double) * (size_t)(s->B * T * Hkv * d));
        memset(dv, 0, sizeof(double) * (size_t)(s->B * T * Hkv * d));
    }
    for (int64_t b = 0; b < s->B; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++) {
                const int64_t j = variant == WRONG_GQA ? h % Hkv : h / grp;
                const double *qr = q + ((b * T + t) * H + h) * d;
                int64_t lo, hi;
                visible(s, t, variant, &lo, &hi);
                double m = -INFINITY, l = 0.0;
                for (int64_t u = lo; u < hi; u++) {
                    const double *kr = k + ((b * T + u) * Hkv + j) * d;
                    double x = 0.0;
                    for (int64_t e = 0; e < d; e++) x += qr[e] * kr[e];
                    p[u] = x * scale;
                    if (p[u] > m) m = p[u];
                }
                for (int64_t u = lo; u < hi; u++) l += exp(p[u] - m);
                double *orow = o + ((b * T + t) * H + h) * d;
                memset(orow, 0, sizeof(double) * (size_t)d);
                for (int64_t u = lo; u < hi; u++) {
                    p[u] = exp(p[u] - m) / l;
                    const double *vr = v + ((b * T + u) * Hkv + j) * d;
                    for (int64_t e = 0; e < d; e++) orow[e] += p[u] * vr[e];
                }
                lse[(b * T + t) * H + h] = hi > lo ? m + log(l) : -INFINITY;
                if (!dout) continue;
                const double *g = dout + ((b * T + t) * H + h) * d;
                double D = 0.0;
                for (int64_t e = 0; e < d; e++) D += g[e] * orow[e];
                for (int64_t u = lo; u < hi; u++) {
                    const double *vr = v + ((b * T + u) * Hkv + j) * d;
                    dp[u] = 0.0;
                    for (int64_t e = 0; e < d; e++) dp[u] += g[e] * vr[e];
                }
                double *dqr = dq + ((b * T + t) * H + h) * d;
                for (int64_t u = lo; u < hi; u++) {
                    const double ds = p[u] * (dp[u] - D);
                    const double *kr = k + ((b * T + u) * Hkv + j) * d;
                    double *dkr = dk + ((b * T + u) * Hkv + j) * d, *dvr = dv + ((b * T + u) * Hkv + j) * d;
                    for (int64_t e = 0; e < d; e++) {
                        dqr[e] += scale * ds * kr[e];
                        dkr[e] += scale * ds * qr[e];
                        dvr[e] += p[u] * g[e];
                    }
                }
            }
    free(p), free(dp);
}

typedef struct {
    float *q, *k, *v, *dout, *o, *lse, *dq, *dk, *dv;
} f32_run;

/* rel_err_f32, but absolute where the reference is zero to rounding (T = 1: dq = dk = 0 exactly,
 * the fp32 rounding of dP - D is what is left; the inputs are O(1)). */
static double err_of(const float *x, const double *ref, int64_t n) {
    double mx = 0.0, num = 0.0;
    for (int64_t i = 0; i < n; i++) mx = fmax(mx, fabs(ref[i]));
    if (mx > 1e-9) return rel_err_f32(x, ref, n);
    for (int64_t i = 0; i < n; i++) num = fmax(num, fabs(x[i] - ref[i]));
    return num != num ? INFINITY : num;
}

static int run_f32(const shape *s, int threads, f32_run *r, int with_lse) {
    gdn_attn_config c = gdn_attn_config_default(s->B, s->T, 0, s->H, s->Hkv, s->d);
    c.threads = threads, c.cu_seqlens = s->cu, c.n_docs = s->n_docs;
    gdn_sdpa_plan *p = NULL;
    int rc = gdn_sdpa_plan_create(&p, &c);
    if (!rc) rc = gdn_sdpa_forward(p, r->o, with_lse ? r->lse : NULL, r->q, r->k, r->v);
    if (!rc && with_lse) rc = gdn_sdpa_backward(p, r->dq, r->dk, r->dv, r->q, r->k, r->v, r->o, r->lse, r->dout);
    gdn_sdpa_plan_destroy(p);
    return rc;
}

static void one_case(const shape *s, int threads, uint64_t seed) {
    const int64_t nq = s->B * s->T * s->H * s->d, nk = s->B * s->T * s->Hkv * s->d, nl = s->B * s->T * s->H;
    char what[200];
    int len = snprintf(what, sizeof what, "B=%lld T=%lld H=%lld Hkv=%lld d=%lld", (long long)s->B, (long long)s->T,
                       (long long)s->H, (long long)s->Hkv, (long long)s->d);
    if (s->cu) {
        len += snprintf(what + len, sizeof what - (size_t)len, " docs [");
        for (int64_t i = 0; i < s->n_docs && len < 170; i++)
            len += snprintf(what + len, sizeof what - (size_t)len, "%s%lld", i ? "," : "",
                            (long long)(s->cu[i + 1] - s->cu[i]));
        len += snprintf(what + len, sizeof what - (size_t)len, "]");
    }
    snprintf(what + len, sizeof what - (size_t)len, ", %d thr%s", threads, s->amp > 1.5 ? ", peaked scores" : "");
    rng_seed(seed);
    f32_run r = {falloc(nq), falloc(nk), falloc(nk), falloc(nq), falloc(nq), falloc(nl), falloc(nq), falloc(nk),
                 falloc(nk)};
    double *q = dalloc(nq), *k = dalloc(nk), *v = dalloc(nk), *dout = dalloc(nq);
    const double amp = s->amp > 0 ? s->amp : 1.5;
    for (int64_t i = 0; i < nq; i++) r.q[i] = (float)rng_uniform(-amp, amp), q[i] = r.q[i];
    for (int64_t i = 0; i < nk; i++) r.k[i] = (float)rng_uniform(-amp, amp), k[i] = r.k[i];
    /* amp > 1.5: keys that grow along the sequence too, so a row's max keeps rising from tile to tile */
    for (int64_t i = 0; s->amp > 1.5 && i < nk; i++)
        r.k[i] *= (float)(1.0 + 3.0 * (double)(i / (s->Hkv * s->d) % s->T) / (double)s->T), k[i] = r.k[i];
    for (int64_t i = 0; i < nk; i++) r.v[i] = (float)rng_uniform(-1, 1), v[i] = r.v[i];
    for (int64_t i = 0; i < nq; i++) r.dout[i] = (float)rng_uniform(-1, 1), dout[i] = r.dout[i];
    for (int64_t i = 0; i < nk; i++) r.dk[i] = r.dv[i] = NAN; /* overwritten, never accumulated into */
    for (int64_t i = 0; i < nq; i++) r.dq[i] = NAN;
    double *o = dalloc(nq), *lse = dalloc(nl), *dq = dalloc(nq), *dk = dalloc(nk), *dv = dalloc(nk);
    expect_status(run_f32(s, threads, &r, 1), GDN_OK, NULL, "sdpa forward + backward %s", what);
    const double tol = 1e-5;
    for (int variant = RIGHT; variant <= WRONG_DOCS; variant++) {
        /* a control only where the wrong variant differs */
        if (variant == WRONG_GQA && !(s->Hkv > 1 && s->H > s->Hkv)) continue;
        if (variant == WRONG_MASK && s->T < 2) continue;
        if (variant == WRONG_DOCS && !s->cu) continue;
        reference(s, variant, q, k, v, dout, o, lse, dq, dk, dv);
        const struct { const char *name; const float *x; const double *ref; int64_t n; } cmp[] = {
            {"o", r.o, o, nq}, {"lse", r.lse, lse, nl}, {"dq", r.dq, dq, nq}, {"dk", r.dk, dk, nk}, {"dv", r.dv, dv, nk},
        };
        char vname[64];
        snprintf(vname, sizeof vname, variant_name[variant], 0);
        for (size_t i = 0; i < sizeof cmp / sizeof cmp[0]; i++) {
            const double err = err_of(cmp[i].x, cmp[i].ref, cmp[i].n);
            if (variant == RIGHT)
                expect_close(err, tol, "sdpa %s vs double reference, %s", cmp[i].name, what);
            else if (variant == WRONG_MASK && !strcmp(cmp[i].name, "lse") && s->T < 3)
                continue; /* (T = 2: one row moves) */
            else if (s->T < 2 && (!strcmp(cmp[i].name, "dq") || !strcmp(cmp[i].name, "dk")))
                continue; /* T = 1: dq = dk = 0 whatever the kv head */
            else
                expect_far(err, tol, "sdpa %s vs the reference with %s, %s", cmp[i].name, vname, what);
        }
    }
    /* lse NULL (inference): the same o */
    {
        float *o1 = falloc(nq);
        memcpy(o1, r.o, sizeof(float) * (size_t)nq);
        expect_status(run_f32(s, threads, &r, 0), GDN_OK, NULL, "sdpa forward without lse, %s", what);
        check(!memcmp(o1, r.o, sizeof(float) * (size_t)nq), "forward without lse gives the same o, %s", what);
        free(o1);
    }
    free(q), free(k), free(v), free(dout), free(o), free(lse), free(dq), free(dk), free(dv);
    free(r.q), free(r.k), free(r.v), free(r.dout), free(r.o), free(r.lse), free(r.dq), free(r.dk), free(r.dv);
}

/* One, two and three threads give bitwise identical results: no two threads add into one row, and
 * the fused one-pass backward (B Hkv jobs busy enough: 1, 2 threads here) and the two-pass one (3
 * threads) run the same products in the same order. */
static void threads_identical(const shape *s) {
    const int64_t nq = s->B * s->T * s->H * s->d, nk = s->B * s->T * s->Hkv * s->d, nl = s->B * s->T * s->H;
    enum { NT = 3 };
    f32_run r[NT];
    rng_seed(99);
    for (int i = 0; i < NT; i++)
        r[i] = (f32_run){falloc(nq), falloc(nk), falloc(nk), falloc(nq), falloc(nq), falloc(nl), falloc(nq), falloc(nk),
                         falloc(nk)};
    for (int64_t i = 0; i < nq; i++) r[0].q[i] = (float)rng_uniform(-1, 1), r[0].dout[i] = (float)rng_uniform(-1, 1);
    for (int64_t i = 0; i < nk; i++) r[0].k[i] = (float)rng_uniform(-1, 1), r[0].v[i] = (float)rng_uniform(-1, 1);
    const char *path[NT];
    int ok = 1;
    for (int i = 0; i < NT; i++) {
        memcpy(r[i].q, r[0].q, 4 * (size_t)nq), memcpy(r[i].dout, r[0].dout, 4 * (size_t)nq);
        memcpy(r[i].k, r[0].k, 4 * (size_t)nk), memcpy(r[i].v, r[0].v, 4 * (size_t)nk);
        ok &= run_f32(s, i + 1, &r[i], 1) == GDN_OK;
        gdn_attn_config c = gdn_attn_config_default(s->B, s->T, 0, s->H, s->Hkv, s->d);
        c.threads = i + 1, c.cu_seqlens = s->cu, c.n_docs = s->n_docs;
        gdn_sdpa_plan *p = NULL;
        path[i] = gdn_sdpa_plan_create(&p, &c) ? "?" : gdn_sdpa_plan_path(p);
        gdn_sdpa_plan_destroy(p);
    }
    for (int i = 1; i < NT; i++)
        ok &= !memcmp(r[0].o, r[i].o, 4 * (size_t)nq) && !memcmp(r[0].lse, r[i].lse, 4 * (size_t)nl) &&
              !memcmp(r[0].dq, r[i].dq, 4 * (size_t)nq) && !memcmp(r[0].dk, r[i].dk, 4 * (size_t)nk) &&
              !memcmp(r[0].dv, r[i].dv, 4 * (size_t)nk);
    check(ok, "sdpa 1, 2, 3 threads bitwise identical (o, lse, dq, dk, dv), B=%lld T=%lld H=%lld Hkv=%lld d=%lld%s",
          (long long)s->B, (long long)s->T, (long long)s->H, (long long)s->Hkv, (long long)s->d, s->cu ? " packed" : "");
    check(strcmp(path[0], path[2]) != 0, "the comparison covers both backward schedules: 1 thread '%s', 3 threads '%s'",
          path[0], path[2]);
    for (int i = 0; i < NT; i++) {
        free(r[i].q), free(r[i].k), free(r[i].v), free(r[i].dout), free(r[i].o), free(r[i].lse);
        free(r[i].dq), free(r[i].dk), free(r[i].dv);
    }
}

static void errors(void) {
    gdn_attn_config c = gdn_attn_config_default(1, 10, 0, 4, 2, 8);
    gdn_sdpa_plan *p = NULL;
    expect_status(gdn_sdpa_plan_create(NULL, &c), GDN_ERR_ARG, "output pointer", "sdpa plan: NULL output refused");
    expect_status(gdn_sdpa_plan_create(&p, NULL), GDN_ERR_ARG, "config is NULL", "sdpa plan: NULL config refused");
    expect_status(gdn_sdpa_plan_create(&p, &c), GDN_OK, NULL, "sdpa plan: a valid config plans (control)");
    const int64_t nq = 10 * 4 * 8, nk = 10 * 2 * 8, nl = 10 * 4;
    float *q = falloc(nq), *k = falloc(nk), *v = falloc(nk), *o = falloc(nq), *lse = falloc(nl), *dq = falloc(nq);
    float *dk = falloc(nk), *dv = falloc(nk), *dout = falloc(nq);
    expect_status(gdn_sdpa_forward(p, o, lse, q, k, v), GDN_OK, NULL, "sdpa forward of zeros runs (control)");
    expect_status(gdn_sdpa_backward(p, dq, dk, dv, q, k, v, o, lse, dout), GDN_OK, NULL,
                  "sdpa backward of zeros runs (control)");
    expect_status(gdn_sdpa_forward(NULL, o, lse, q, k, v), GDN_ERR_ARG, "plan is NULL", "sdpa forward: NULL plan");
    expect_status(gdn_sdpa_forward(p, NULL, lse, q, k, v), GDN_ERR_ARG, "'o'", "sdpa forward: NULL o");
    expect_status(gdn_sdpa_forward(p, o, lse, NULL, k, v), GDN_ERR_ARG, "'q'", "sdpa forward: NULL q");
    expect_status(gdn_sdpa_forward(p, o, lse, q, k, NULL), GDN_ERR_ARG, "'v'", "sdpa forward: NULL v");
    expect_status(gdn_sdpa_backward(p, dq, NULL, dv, q, k, v, o, lse, dout), GDN_ERR_ARG, "'dk'",
                  "sdpa backward: NULL dk");
    expect_status(gdn_sdpa_backward(p, dq, dk, dv, q, k, v, o, NULL, dout), GDN_ERR_ARG, "'lse'",
                  "sdpa backward: NULL lse");
    expect_status(gdn_sdpa_backward(p, dq, dk, dv, q, k, v, o, lse, NULL), GDN_ERR_ARG, "'dout'",
                  "sdpa backward: NULL dout");
    k[5] = NAN;
    expect_status(gdn_sdpa_forward(p, o, lse, q, k, v), GDN_ERR_NONFINITE, "'k'", "sdpa forward: NaN in k refused");
    k[5] = 0.0f;
    dout[7] = INFINITY;
    expect_status(gdn_sdpa_backward(p, dq, dk, dv, q, k, v, o, lse, dout), GDN_ERR_NONFINITE, "'dout'",
                  "sdpa backward: Inf in dout refused");
    dout[7] = 0.0f;
    /* finite inputs whose scores overflow fp32: reported, not returned as NaN */
    for (int64_t i = 0; i < nq; i++) q[i] = 1e30f;
    for (int64_t i = 0; i < nk; i++) k[i] = 1e30f;
    expect_status(gdn_sdpa_forward(p, o, lse, q, k, v), GDN_ERR_NONFINITE, "output 'o'",
                  "sdpa forward: overflowing scores reported");
    gdn_sdpa_plan_destroy(p);
    const int64_t cu_short[3] = {0, 6, 9}, cu_ok[3] = {0, 6, 10}, cu_flat[3] = {0, 6, 6};
    struct { const char *what, *needle; int64_t B, T, H, Hkv, d; const int64_t *cu; int want; } bad[] = {
        {"T = 0", "T = 0", 1, 0, 4, 2, 8, NULL, GDN_ERR_SHAPE},
        {"d = 0", "d = 0", 1, 10, 4, 2, 0, NULL, GDN_ERR_SHAPE},
        {"H not a multiple of Hkv", "not a multiple", 1, 10, 3, 2, 8, NULL, GDN_ERR_SHAPE},
        {"cu_seqlens ending before T", "cu_seqlens must", 1, 10, 4, 2, 8, cu_short, GDN_ERR_SHAPE},
        {"cu_seqlens not increasing", "strictly increasing", 1, 6, 4, 2, 8, cu_flat, GDN_ERR_SHAPE},
        {"cu_seqlens with B = 2", "B = 1", 2, 10, 4, 2, 8, cu_ok, GDN_ERR_SHAPE},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        gdn_attn_config b = gdn_attn_config_default(bad[i].B, bad[i].T, 0, bad[i].H, bad[i].Hkv, bad[i].d);
        b.cu_seqlens = bad[i].cu, b.n_docs = bad[i].cu ? 2 : 0;
        p = NULL;
        expect_status(gdn_sdpa_plan_create(&p, &b), bad[i].want, bad[i].needle, "sdpa plan refuses %s", bad[i].what);
        gdn_sdpa_plan_destroy(p);
    }
    free(q), free(k), free(v), free(o), free(lse), free(dq), free(dk), free(dv), free(dout);
}

/* Queries [q0, q0 + nq) of the stream against its keys [k0, k0 + nk) (batch rows b; documents cu
 * over the whole stream): the double loops with the view's offsets (honour 0: read k0 as q0). */
static void view_reference(int64_t B, int64_t H, int64_t Hkv, int64_t d, int64_t nq, int64_t q0, int64_t nk,
                           int64_t k0, const int64_t *cu, int64_t n_docs, const double *q, const double *k,
                           const double *v, const double *dO, const double *D, double *o, double *lse, double *dq,
                           double *dk, double *dv) {
    const double scale = 1.0 / sqrt((double)d);
    const int64_t grp = H / Hkv;
    double *p = dalloc(nk);
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < nq; t++)
            for (int64_t h = 0; h < H; h++) {
                const int64_t tg = q0 + t, j = h / grp, row = (b * nq + t) * H + h;
                const int64_t db = cu ? gdn_attn_doc_begin(cu, n_docs, tg) : 0;
                const double *qr = q + row * d;
                double m = -INFINITY, l = 0;
                for (int64_t u = 0; u < nk; u++) {
                    const int64_t ug = k0 + u;
                    p[u] = NAN;
                    if (ug > tg || ug < db) continue;
                    double x = 0;
                    for (int64_t e = 0; e < d; e++) x += qr[e] * k[((b * nk + u) * Hkv + j) * d + e];
                    p[u] = x * scale, m = fmax(m, p[u]);
                }
                for (int64_t u = 0; u < nk; u++) if (p[u] == p[u]) l += exp(p[u] - m);
                double *orow = o + row * d;
                memset(orow, 0, sizeof(double) * (size_t)d);
                lse[row] = l > 0 ? m + log(l) : -INFINITY;
                for (int64_t u = 0; u < nk; u++) {
                    if (p[u] != p[u]) continue;
                    p[u] = exp(p[u] - m) / l;
                    const double *vr = v + ((b * nk + u) * Hkv + j) * d;
                    double dp = 0;
                    for (int64_t e = 0; e < d; e++) orow[e] += p[u] * vr[e], dp += dO[row * d + e] * vr[e];
                    const double ds = p[u] * (dp - D[row]);
                    for (int64_t e = 0; e < d; e++) {
                        dq[row * d + e] += scale * ds * k[((b * nk + u) * Hkv + j) * d + e];
                        dk[((b * nk + u) * Hkv + j) * d + e] += scale * ds * qr[e];
                        dv[((b * nk + u) * Hkv + j) * d + e] += p[u] * dO[row * d + e];
                    }
                }
            }
    free(p);
}

static void view_case(int64_t B, int64_t H, int64_t Hkv, int64_t d, int64_t nq, int64_t q0, int64_t nk, int64_t k0,
                      const int64_t *cu, int64_t n_docs, int threads) {
    const int64_t nQ = B * nq * H * d, nK = B * nk * Hkv * d, nL = B * nq * H;
    float *q = falloc(nQ), *k = falloc(nK), *v = falloc(nK), *dO = falloc(nQ), *D = falloc(nL), *o = falloc(nQ);
    float *lse = falloc(nL), *dq = falloc(nQ), *dk = falloc(nK), *dv = falloc(nK);
    double *qd = dalloc(nQ), *kd = dalloc(nK), *vd = dalloc(nK), *dOd = dalloc(nQ), *Dd = dalloc(nL), *od = dalloc(nQ);
    double *ld = dalloc(nL), *dqd = dalloc(nQ), *dkd = dalloc(nK), *dvd = dalloc(nK);
    rng_seed(4242 + (uint64_t)(q0 * 7 + k0));
    for (int64_t i = 0; i < nQ; i++) q[i] = (float)rng_uniform(-1.5, 1.5), dO[i] = (float)rng_uniform(-1, 1);
    for (int64_t i = 0; i < nK; i++) k[i] = (float)rng_uniform(-1.5, 1.5), v[i] = (float)rng_uniform(-1, 1);
    for (int64_t i = 0; i < nL; i++) D[i] = (float)rng_uniform(-0.5, 0.5);
    for (int64_t i = 0; i < nQ; i++) qd[i] = q[i], dOd[i] = dO[i], dq[i] = 0.5f;
    for (int64_t i = 0; i < nK; i++) kd[i] = k[i], vd[i] = v[i], dk[i] = dv[i] = 0.25f;
    for (int64_t i = 0; i < nL; i++) Dd[i] = D[i];
    float *tile = falloc((int64_t)(gdn_attn_tile_floats(d, 0) * (size_t)threads));
    const gdn_attn_core view = {.B = B, .H = H, .Hkv = Hkv, .d = d, .Q = q, .nq = nq, .q0 = q0, .qld = H * d,
                                .nk = nk, .k0 = k0, .K = {k, Hkv * d, d, nk * Hkv * d}, .V = {v, Hkv * d, d, nk * Hkv * d},
                                .cu = cu, .n_docs = n_docs, .threads = threads, .tile = tile};
    const gdn_attn_kv gk = {dk, Hkv * d, d, nk * Hkv * d}, gv = {dv, Hkv * d, d, nk * Hkv * d};
    const gdn_fpmode fm = gdn_fp_fast_begin();
    gdn_attn_core_forward(&view, o, lse);
    gdn_attn_core_backward(&view, dO, lse, D, dq, gk, gv);
    gdn_fp_fast_end(fm);
    for (int64_t i = 0; i < nQ; i++) dq[i] -= 0.5f; /* what was added */
    for (int64_t i = 0; i < nK; i++) dk[i] -= 0.25f, dv[i] -= 0.25f;
    char what[160];
    snprintf(what, sizeof what, "view: queries [%lld, %lld) keys [%lld, %lld) B=%lld H=%lld Hkv=%lld d=%lld%s, %d thr",
             (long long)q0, (long long)(q0 + nq), (long long)k0, (long long)(k0 + nk), (long long)B, (long long)H,
             (long long)Hkv, (long long)d, cu ? " docs" : "", threads);
    for (int control = 0; control < 2; control++) {
        memset(dqd, 0, sizeof(double) * (size_t)nQ), memset(dkd, 0, sizeof(double) * (size_t)nK);
        memset(dvd, 0, sizeof(double) * (size_t)nK);
        view_reference(B, H, Hkv, d, nq, q0, nk, control ? q0 : k0, cu, n_docs, qd, kd, vd, dOd, Dd, od, ld, dqd, dkd, dvd);
        int64_t inf_mismatch = 0, n_inf = 0;
        double le = 0;
        for (int64_t i = 0; i < nL; i++) {
            n_inf += ld[i] == -INFINITY;
            if ((ld[i] == -INFINITY) != (lse[i] == -INFINITY)) inf_mismatch++;
            else if (ld[i] != -INFINITY) le = fmax(le, fabs(lse[i] - ld[i]) / fmax(1.0, fabs(ld[i])));
        }
        const double err = fmax(fmax(err_of(o, od, nQ), le + (double)inf_mismatch),
                                fmax(err_of(dq, dqd, nQ), fmax(err_of(dk, dkd, nK), err_of(dv, dvd, nK))));
        if (!control)
            expect_close(err, 1e-5, "%s: o, lse (%lld rows see nothing), dq, dk, dv += vs double loops", what,
                         (long long)n_inf);
        else
            expect_far(err, 1e-5, "%s: against loops that ignore the keys' offset", what);
    }
    free(q), free(k), free(v), free(dO), free(D), free(o), free(lse), free(dq), free(dk), free(dv), free(tile);
    free(qd), free(kd), free(vd), free(dOd), free(Dd), free(od), free(ld), free(dqd), free(dkd), free(dvd);
}

void test_sdpa(void) {
    static const int64_t cu1[4] = {0, 50, 51, 150};            /* a 1-token document, documents across tiles */
    static const int64_t cu2[5] = {0, 130, 131, 192, 333};     /* from inside a tile to a tile's end */
    static const int64_t cu3[4] = {0, 64, 200, 300};           /* a boundary on a tile edge */
    const struct { shape s; int threads; } cases[] = {
        {{2, 77, 4, 2, 16, NULL, 0, 0}, 2},   /* GQA, T not a multiple of 64, batch rows */
        {{1, 1, 4, 2, 8, NULL, 0, 0}, 1},     /* T = 1 */
        {{1, 1, 8, 1, 256, NULL, 0, 0}, 2},   /* T = 1, MQA, d = 256 */
        {{1, 200, 4, 4, 32, NULL, 0, 0}, 2},  /* H == Hkv */
        {{1, 130, 8, 1, 24, NULL, 0, 0}, 2},  /* MQA, d not a multiple of 16 */
        {{1, 70, 16, 1, 16, NULL, 0, 0}, 1},  /* a group of 16 heads */
        {{2, 90, 6, 2, 16, NULL, 0, 0}, 2},   /* a group of 3 (rows not filling a tile) */
        {{1, 150, 16, 2, 256, NULL, 0, 0}, 2},/* the Qwen3.5 35B heads: group 8, d = 256 */
        {{1, 150, 4, 2, 16, cu1, 3, 0}, 2},
        {{1, 333, 4, 2, 16, cu2, 4, 0}, 2},
        {{1, 300, 16, 2, 64, cu3, 3, 0}, 2},
        {{1, 150, 4, 1, 8, cu1, 3, 0}, 1},
        {{1, 400, 8, 2, 32, NULL, 0, 3.0}, 2},   /* scores spread over tens: the running max moves */
        {{1, 300, 16, 2, 64, cu3, 3, 3.0}, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) one_case(&cases[i].s, cases[i].threads, 700 + i);
    const shape tid[] = {{1, 300, 16, 2, 64, cu3, 3, 0}, {2, 140, 8, 1, 32, NULL, 0, 0}, {1, 333, 4, 2, 16, cu2, 4, 0}};
    for (size_t i = 0; i < sizeof tid / sizeof tid[0]; i++) threads_identical(&tid[i]);
    errors();
    static const int64_t cuv[4] = {0, 120, 190, 400};
    view_case(2, 8, 2, 32, 50, 100, 90, 30, NULL, 0, 2);   /* keys before and across the queries */
    view_case(1, 16, 2, 64, 70, 200, 60, 0, NULL, 0, 2);   /* an earlier block: all visible */
    view_case(1, 8, 2, 32, 50, 0, 40, 30, NULL, 0, 2);     /* the first 30 rows see nothing */
    view_case(1, 8, 2, 32, 200, 0, 60, 170, NULL, 0, 3);   /* keys after most queries, two-pass */
    view_case(1, 6, 2, 16, 100, 150, 120, 100, cuv, 3, 2); /* documents across both blocks, group 3 */
}
