/* The sparse mixture-of-experts MLP (DESIGN §13), fp32 on one rank: the router (one GEMM, an fp32
 * softmax, top-k), the (token, slot) pairs grouped by expert (a counting sort, stable in token
 * order), one GEMM per expert that some token chose for each of its products, the sigmoid-gated
 * shared expert as a dense MLP, and a combine that adds each token's slots in slot order (so y
 * does not depend on the thread count beyond the GEMMs). The plan owns all workspace; forward
 * and backward allocate nothing. */
#include "moe_internal.h"

#include <math.h>
#include <omp.h>
#include <string.h>

#include "swiglu.h"

/* Element-wise passes over fewer rows than this run on the calling thread (no OpenMP team). */
#define MOE_PAR_ROWS 64

static size_t pad16(size_t n) { return (n + 15) & ~(size_t)15; }

size_t gdn_moe_saved_floats_cfg(const gdn_moe_config *c) {
    const size_t N = (size_t)c->N, NK = N * (size_t)c->top_k, n = (size_t)c->n_experts, I = (size_t)c->I,
                 Is = (size_t)c->Is;
    size_t s = 2 * pad16(NK) + pad16(N * n);
    if (c->ep_size <= 1) s += pad16(NK * 2 * I); /* under EP the experts' owners recompute it */
    if (Is) s += pad16(N * 2 * Is) + pad16(N);
    return s;
}

gdn_moe_saved gdn_moe_saved_view(const gdn_moe_plan *p, float *saved) {
    gdn_moe_saved s;
    memset(&s, 0, sizeof s);
    float *cur = saved;
    s.sel = (int32_t *)gdn_carve(&cur, (size_t)p->NK);
    s.w = gdn_carve(&cur, (size_t)p->NK);
    s.p = gdn_carve(&cur, (size_t)(p->N * p->n));
    if (p->cfg.ep_size <= 1) s.gu = gdn_carve(&cur, (size_t)p->NK * 2 * (size_t)p->I);
    if (p->Is) {
        s.sgu = gdn_carve(&cur, (size_t)(p->N * 2 * p->Is));
        s.sgl = gdn_carve(&cur, (size_t)p->N);
    }
    return s;
}

int gdn_moe_plan_create(gdn_moe_plan **out, const gdn_moe_config *cfg) {
    if (!out) return gdn_fail(GDN_ERR_ARG, "moe plan output pointer is NULL");
    *out = NULL;
    int rc = gdn_isa_check();
    if (rc || (rc = gdn_moe_config_check(cfg))) return rc;
    gdn_moe_plan *p = gdn_calloc("moe: p", 1, sizeof *p);
    if (!p) return gdn_fail(GDN_ERR_NOMEM, "moe plan");
    p->cfg = *cfg;
#ifdef _OPENMP
    p->threads = cfg->threads > 0 ? cfg->threads : omp_get_max_threads();
#else
    p->threads = 1;
#endif
    p->cfg.threads = p->threads;
    p->N = cfg->N, p->E = cfg->E, p->n = cfg->n_experts, p->k = cfg->top_k, p->I = cfg->I, p->Is = cfg->Is;
    p->NK = p->N * p->k;
    for (int i = 0; i <= GDN_MOE_COUNT; i++) p->off[i] = gdn_moe_param_offset(cfg, i);
    p->saved_floats = gdn_moe_saved_floats_cfg(cfg);
    const size_t N = (size_t)p->N, NK = (size_t)p->NK, E = (size_t)p->E, n = (size_t)p->n, I = (size_t)p->I,
                 Is = (size_t)p->Is;
    const size_t pieces[] = {
        p->saved_floats, N * n,         /* scratch_saved lg */
        NK * E, NK * E,                 /* xg dyg */
        NK * I, NK * I, NK * 2 * I, NK, NK, /* m dm dgu c wr */
        N * Is, N * Is, N * 2 * Is, N,  /* sm sdm sdgu sdl */
        gdn_matmul_compute_ws_floats(cfg->compute, p->threads),
        2 * (n + 1), NK, NK, /* start (int64) pos tok (int32) */
    };
    const size_t np = sizeof pieces / sizeof pieces[0];
    size_t total = 0;
    for (size_t i = 0; i < np; i++) total += pad16(pieces[i]);
    p->bytes = 4.0 * (double)total;
    char what[200];
    snprintf(what, sizeof what, "the moe workspace for N = %lld rows, top_k = %lld (%.1f KB per row)",
             (long long)p->N, (long long)p->k, p->bytes / 1e3 / (double)N);
    if ((rc = gdn_check_fits(what, p->bytes))) {
        gdn_moe_plan_destroy(p);
        return rc;
    }
    p->arena = gdn_alloc_aligned("moe: p->arena", total * sizeof(float));
    if (!p->arena) {
        /* the message before the plan goes: it names the plan's sizes */
        const int rc = gdn_fail(GDN_ERR_NOMEM, "moe workspace: %.1f MB for N = %lld rows", p->bytes / 1e6, (long long)p->N);
        gdn_moe_plan_destroy(p);
        return rc;
    }
    float *cur = p->arena;
    float **dst[] = {&p->scratch_saved, &p->lg, &p->xg, &p->dyg, &p->m, &p->dm, &p->dgu, &p->c, &p->wr,
                     &p->sm, &p->sdm, &p->sdgu, &p->sdl, &p->mm_ws};
    for (size_t i = 0; i < sizeof dst / sizeof dst[0]; i++) *dst[i] = gdn_carve(&cur, pieces[i]);
    const size_t nd = sizeof dst / sizeof dst[0];
    p->start = (int64_t *)gdn_carve(&cur, pieces[nd]);
    p->pos = (int32_t *)gdn_carve(&cur, pieces[nd + 1]);
    p->tok = (int32_t *)gdn_carve(&cur, pieces[nd + 2]);
    *out = p;
    return GDN_OK;
}

void gdn_moe_plan_destroy(gdn_moe_plan *p) {
    if (!p) return;
    free(p->arena);
    free(p);
}

int gdn_moe_plan_describe(const gdn_moe_plan *p, gdn_moe_plan_info *info) {
    if (!info) return gdn_fail(GDN_ERR_ARG, "gdn_moe_plan_describe: info is NULL");
    memset(info, 0, sizeof *info);
    if (!p) return gdn_fail(GDN_ERR_ARG, "gdn_moe_plan_describe: the plan is NULL");
    info->config = &p->cfg;
    info->saved_floats = p->saved_floats;
    info->bytes = p->bytes;
    return GDN_OK;
}

/* The product C = op(A) op(B) of the plan's compute precision, its threads, its packing space. */
static void mm(gdn_moe_plan *p, int flags, int64_t m, int64_t n, int64_t kk, const float *A, int64_t lda,
               const float *B, int64_t ldb, float *C, int64_t ldc) {
    gdn_matmul_compute(p->cfg.compute, flags, m, n, kk, A, lda, B, ldb, C, ldc, p->mm_ws, p->threads);
}

/* The counting sort of the pairs by expert, stable in token order: start[e] .. start[e+1] are
 * expert e's grouped rows, pos[pair] the grouped row of a pair, tok[row] its pair (t * k + j). */
static int group_pairs(gdn_moe_plan *p, const int32_t *sel) {
    const int64_t n = p->n, NK = p->NK;
    int64_t *start = p->start;
    memset(start, 0, sizeof(int64_t) * (size_t)(n + 1));
    for (int64_t i = 0; i < NK; i++) {
        const int32_t e = sel[i];
        if (e < 0 || e >= n)
            return gdn_fail(GDN_ERR_ARG, "moe saved routing: expert %d of pair %lld is out of range [0, %lld) "
                            "(saved is not from this plan's forward)", (int)e, (long long)i, (long long)n);
        start[e + 1]++;
    }
    for (int64_t e = 0; e < n; e++) start[e + 1] += start[e];
    for (int64_t i = 0; i < NK; i++) {
        const int64_t r = start[sel[i]]++;
        p->pos[i] = (int32_t)r, p->tok[r] = (int32_t)i;
    }
    for (int64_t e = n; e > 0; e--) start[e] = start[e - 1];
    start[0] = 0;
    return GDN_OK;
}

/* Rows of src (row stride E) into dst in grouped order: dst[r] = src[token of row r]. */
static void gather_rows(const gdn_moe_plan *p, float *dst, const float *src) {
    const int64_t E = p->E, k = p->k;
#pragma omp parallel for num_threads(p->threads) schedule(static) if (p->NK >= MOE_PAR_ROWS)
    for (int64_t r = 0; r < p->NK; r++)
        memcpy(dst + r * E, src + (int64_t)(p->tok[r] / k) * E, sizeof(float) * (size_t)E);
}

static double dot_d(const float *a, const float *b, int64_t n) {
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) s += (double)a[i] * (double)b[i];
    return s;
}

/* Softmax of one row of logits (max-subtracted) into pr, the top k of pr into sr / wr (largest
 * first, an exact tie to the lower index: torch.topk), wr renormalised when norm. Returns 1 when
 * a logit is not finite. */
static int route_row(const float *l, float *pr, int32_t *sr, float *wr, int64_t n, int64_t k, int norm) {
    float mx = l[0];
    int bad = 0;
    for (int64_t e = 0; e < n; e++) {
        bad |= !isfinite(l[e]);
        mx = l[e] > mx ? l[e] : mx;
    }
    float s = 0.0f;
    for (int64_t e = 0; e < n; e++) s += pr[e] = expf(l[e] - mx);
    const float inv = 1.0f / s;
    for (int64_t e = 0; e < n; e++) pr[e] *= inv;
    int64_t cnt = 0;
    for (int64_t e = 0; e < n; e++) {
        const float v = pr[e];
        if (cnt == k && !(v > wr[k - 1])) continue;
        int64_t j = cnt < k ? cnt++ : k - 1;
        for (; j > 0 && v > wr[j - 1]; j--) wr[j] = wr[j - 1], sr[j] = sr[j - 1];
        wr[j] = v, sr[j] = (int32_t)e;
    }
    if (norm) {
        float sw = 0.0f;
        for (int64_t j = 0; j < k; j++) sw += wr[j];
        for (int64_t j = 0; j < k; j++) wr[j] /= sw;
    }
    return bad;
}

int gdn_moe_route(gdn_moe_plan *p, const gdn_moe_saved *s, const float *x, const float *w, double *stats,
                  int32_t *routing, float *routing_w) {
    const gdn_moe_config *c = &p->cfg;
    const int th = p->threads;
    const int64_t N = p->N, E = p->E, n = p->n, k = p->k;
    int rc = gdn_check_tensor("x", x, N * E, c->check_finite, th);
    if (rc) return rc;
    mm(p, GDN_GEMM_B_TRANS, N, n, E, x, E, w + p->off[GDN_MOE_ROUTER], E, p->lg, n);
    int64_t bad = N;
#pragma omp parallel for num_threads(th) schedule(static) reduction(min : bad) if (N >= MOE_PAR_ROWS)
    for (int64_t t = 0; t < N; t++)
        if (route_row(p->lg + t * n, s->p + t * n, s->sel + t * k, s->w + t * k, n, k, c->norm_topk) && t < bad)
            bad = t;
    if (c->check_finite && bad < N) {
        int64_t e = 0;
        while (e < n && isfinite(p->lg[bad * n + e])) e++;
        const float v = e < n ? p->lg[bad * n + e] : NAN;
        return gdn_fail(GDN_ERR_NONFINITE, "moe: %s in the router's logits at row %lld (expert %lld): a non-finite "
                        "value in gate.weight (x is finite), or logits that overflow fp32",
                        v != v ? "NaN" : "Inf", (long long)bad, (long long)e);
    }
    if (stats) { /* in token order: the sums do not depend on the thread count */
        const int64_t next = gdn_test_mutate("moe: a token's choices counted for the next expert") ? 1 : 0;
        for (int64_t t = 0; t < N; t++) {
            for (int64_t j = 0; j < k; j++) stats[(s->sel[t * k + j] + next) % n] += 1.0;
            for (int64_t e = 0; e < n; e++) stats[n + e] += (double)s->p[t * n + e];
        }
    }
    if (routing) memcpy(routing, s->sel, sizeof(int32_t) * (size_t)p->NK);
    if (routing_w) memcpy(routing_w, s->w, sizeof(float) * (size_t)p->NK);
    if ((rc = group_pairs(p, s->sel))) return rc;
    gather_rows(p, p->xg, x);
    return GDN_OK;
}

void gdn_moe_experts_forward(gdn_moe_plan *p, int64_t nexp, const int64_t *start, const float *GU, const float *D,
                             const float *xg, int64_t ldx, float *gu, float *m, float *out) {
    const int64_t E = p->E, I = p->I, rows_all = start[nexp] - start[0];
    for (int64_t e = 0; e < nexp; e++) {
        const int64_t r0 = start[e] - start[0], rows = start[e + 1] - start[e];
        if (rows) mm(p, GDN_GEMM_B_TRANS, rows, 2 * I, E, xg + r0 * ldx, ldx, GU + e * 2 * I * E, E, gu + r0 * 2 * I, 2 * I);
    }
    if (!out) return; /* the activations alone (a backward that recomputes them) */
#pragma omp parallel for num_threads(p->threads) schedule(static) if (rows_all >= MOE_PAR_ROWS)
    for (int64_t r = 0; r < rows_all; r++) gdn_swiglu_row(m + r * I, gu + r * 2 * I, gu + r * 2 * I + I, I);
    for (int64_t e = 0; e < nexp; e++) {
        const int64_t r0 = start[e] - start[0], rows = start[e + 1] - start[e];
        if (rows) mm(p, GDN_GEMM_B_TRANS, rows, E, I, m + r0 * I, I, D + e * E * I, I, out + r0 * E, E);
    }
}

void gdn_moe_shared_forward(gdn_moe_plan *p, float *y, const gdn_moe_saved *s, const float *x, const float *w) {
    const int64_t N = p->N, E = p->E, Is = p->Is;
    if (!Is) return;
    const float *SG = w + p->off[GDN_MOE_SHARED_GATE], *SU = w + p->off[GDN_MOE_SHARED_UP],
                *SD = w + p->off[GDN_MOE_SHARED_DOWN], *g = w + p->off[GDN_MOE_SHARED_EXPERT_GATE];
    mm(p, GDN_GEMM_B_TRANS, N, Is, E, x, E, SG, E, s->sgu, 2 * Is);
    mm(p, GDN_GEMM_B_TRANS, N, Is, E, x, E, SU, E, s->sgu + Is, 2 * Is);
    mm(p, GDN_GEMM_B_TRANS, N, 1, E, x, E, g, E, s->sgl, 1);
#pragma omp parallel for num_threads(p->threads) schedule(static) if (N >= MOE_PAR_ROWS)
    for (int64_t t = 0; t < N; t++) gdn_swiglu_row(p->sm + t * Is, s->sgu + t * 2 * Is, s->sgu + t * 2 * Is + Is, Is);
    mm(p, GDN_GEMM_B_TRANS, N, E, Is, p->sm, Is, SD, Is, y, E);
}

void gdn_moe_combine(gdn_moe_plan *p, float *y, const gdn_moe_saved *s, const float *outg) {
    const int64_t N = p->N, E = p->E, k = p->k, Is = p->Is;
    /* (the mutation makes the sum's order depend on the thread: what the bitwise thread checks catch) */
    const int by_thread = gdn_test_mutate("moe: the combine's terms added in another order off the first thread");
#pragma omp parallel for num_threads(p->threads) schedule(static) if (N >= MOE_PAR_ROWS)
    for (int64_t t = 0; t < N; t++) {
        float *yr = y + t * E;
        const float sig = Is ? gdn_sigmoidf(s->sgl[t]) : 0.0f;
        const float *o0 = outg + (int64_t)p->pos[t * k] * E;
        const float w0 = s->w[t * k];
        if (Is)
            for (int64_t i = 0; i < E; i++) yr[i] = sig * yr[i];
        if (by_thread && omp_get_thread_num() > 0) { /* the shared expert first, the slots from the last */
            for (int64_t i = 0; i < E; i++) {
                float a = Is ? yr[i] : 0.0f;
                for (int64_t j = k - 1; j >= 0; j--) a += s->w[t * k + j] * outg[(int64_t)p->pos[t * k + j] * E + i];
                yr[i] = a;
            }
            continue;
        }
        for (int64_t i = 0; i < E; i++) {
            float a = w0 * o0[i];
            for (int64_t j = 1; j < k; j++) a += s->w[t * k + j] * outg[(int64_t)p->pos[t * k + j] * E + i];
            yr[i] = Is ? a + yr[i] : a;
        }
    }
}

/* A sliced block (ep_size > 1) holds only some experts: it runs through the wing's EP forms. */
static int whole(const gdn_moe_plan *p, const char *what) {
    if (gdn_moe_local_experts(&p->cfg, NULL) == p->n) return GDN_OK;
    return gdn_fail(GDN_ERR_ARG, "moe %s: this block holds experts of slice %lld of %lld only (ep_size > 1): run it "
                    "with gdn_moe_ep_%s over its expert-parallel group (ep.h)", what, (long long)p->cfg.ep_rank,
                    (long long)p->cfg.ep_size, what);
}

int gdn_moe_forward(gdn_moe_plan *p, float *y, float *saved, const float *x, const float *w, double *stats,
                    int32_t *routing, float *routing_w) {
    if (!p) return gdn_fail(GDN_ERR_ARG, "moe forward: plan is NULL");
    if (!y) return gdn_fail(GDN_ERR_ARG, "moe forward: output 'y' is NULL");
    if (!w) return gdn_fail(GDN_ERR_ARG, "moe forward: weights 'w' are NULL");
    int rc = whole(p, "forward");
    if (rc) return rc;
    gdn_moe_saved s = gdn_moe_saved_view(p, saved ? saved : p->scratch_saved);
    if ((rc = gdn_moe_route(p, &s, x, w, stats, routing, routing_w))) return rc;
    /* the experts' outputs replace the gathered x */
    gdn_moe_experts_forward(p, p->n, p->start, w + p->off[GDN_MOE_GATE_UP], w + p->off[GDN_MOE_DOWN], p->xg, p->E,
                            s.gu, p->m, p->xg);
    gdn_moe_shared_forward(p, y, &s, x, w);
    gdn_moe_combine(p, y, &s, p->xg);
    return GDN_OK;
}

int gdn_moe_backward_begin(gdn_moe_plan *p, const gdn_moe_saved *s, const float *x, const float *dy) {
    const int th = p->threads;
    int rc = gdn_check_tensor("x", x, p->N * p->E, p->cfg.check_finite, th);
    if (!rc) rc = gdn_check_tensor("dy", dy, p->N * p->E, p->cfg.check_finite, th);
    if (!rc) rc = group_pairs(p, s->sel);
    if (rc) return rc;
    for (int64_t r = 0; r < p->NK; r++) p->wr[r] = s->w[p->tok[r]];
    return GDN_OK;
}

void gdn_moe_experts_backward(gdn_moe_plan *p, int64_t nexp, const int64_t *start, const float *GU, const float *D,
                              float *dGU, float *dD, const float *xg, int64_t ldx, const float *gu, const float *dyg,
                              int64_t ldd, const float *wr, float *m, float *dm, float *dgu, float *c, float *dxg) {
    const int64_t E = p->E, I = p->I, rows_all = start[nexp] - start[0];
    /* dm_raw = dy D_e per row; c = <dm_raw, m> = <dy, e(x)>; the row's gradient is the dense
     * MLP's scaled by its weight. */
    for (int64_t e = 0; e < nexp; e++) {
        const int64_t r0 = start[e] - start[0], rows = start[e + 1] - start[e];
        if (rows) mm(p, 0, rows, I, E, dyg + r0 * ldd, ldd, D + e * E * I, I, dm + r0 * I, I);
    }
#pragma omp parallel for num_threads(p->threads) schedule(static) if (rows_all >= MOE_PAR_ROWS)
    for (int64_t r = 0; r < rows_all; r++) {
        const float wt = wr[r];
        const float *g = gu + r * 2 * I;
        float *mr = m + r * I, *dmr = dm + r * I;
        gdn_swiglu_row(mr, g, g + I, I);
        c[r] = (float)dot_d(dmr, mr, I);
        for (int64_t i = 0; i < I; i++) mr[i] *= wt, dmr[i] *= wt;
        gdn_swiglu_grad_row(dgu + r * 2 * I, dgu + r * 2 * I + I, g, g + I, dmr, I);
    }
    for (int64_t e = 0; e < nexp; e++) {
        const int64_t r0 = start[e] - start[0], rows = start[e + 1] - start[e];
        float *dDe = dD + e * E * I, *dGUe = dGU + e * 2 * I * E;
        if (!rows) { /* chosen by no row: zero gradient, its weights unread */
            memset(dDe, 0, sizeof(float) * (size_t)(E * I));
            memset(dGUe, 0, sizeof(float) * (size_t)(2 * I * E));
            continue;
        }
        mm(p, GDN_GEMM_A_TRANS, E, I, rows, dyg + r0 * ldd, ldd, m + r0 * I, I, dDe, I);
        mm(p, GDN_GEMM_A_TRANS, 2 * I, E, rows, dgu + r0 * 2 * I, 2 * I, xg + r0 * ldx, ldx, dGUe, E);
        mm(p, 0, rows, E, 2 * I, dgu + r0 * 2 * I, 2 * I, GU + e * 2 * I * E, E, dxg + r0 * ldd, ldd);
    }
}

void gdn_moe_router_shared_backward(gdn_moe_plan *p, float *dx, float *dw, const float *x, const float *w,
                                    const gdn_moe_saved *s, const float *dy, const float *aux_dp, const float *dxg,
                                    int64_t lddx, const float *cg, int64_t ldc) {
    const gdn_moe_config *c = &p->cfg;
    const int th = p->threads;
    const int64_t N = p->N, E = p->E, n = p->n, k = p->k, Is = p->Is;
    const float *Wr = w + p->off[GDN_MOE_ROUTER];
    float *dWr = dw + p->off[GDN_MOE_ROUTER];

    /* The router: dl per row (DESIGN §13) into lg, plus the aux term through the softmax. */
    float *dl = p->lg;
#pragma omp parallel for num_threads(th) schedule(static) if (N >= MOE_PAR_ROWS)
    for (int64_t t = 0; t < N; t++) {
        float *d = dl + t * n;
        const float *pr = s->p + t * n, *wt = s->w + t * k;
        const int32_t *sr = s->sel + t * k;
        double dot = 0.0;
        for (int64_t j = 0; j < k; j++) dot += (double)wt[j] * (double)cg[(int64_t)p->pos[t * k + j] * ldc];
        if (c->norm_topk) {
            for (int64_t e = 0; e < n; e++) d[e] = 0.0f;
            for (int64_t j = 0; j < k; j++)
                d[sr[j]] = (float)((double)wt[j] * ((double)cg[(int64_t)p->pos[t * k + j] * ldc] - dot));
        } else {
            for (int64_t e = 0; e < n; e++) d[e] = (float)(-(double)pr[e] * dot);
            for (int64_t j = 0; j < k; j++)
                d[sr[j]] += (float)((double)pr[sr[j]] * (double)cg[(int64_t)p->pos[t * k + j] * ldc]);
        }
        if (aux_dp) {
            double pa = 0.0;
            for (int64_t e = 0; e < n; e++) pa += (double)pr[e] * (double)aux_dp[e];
            for (int64_t e = 0; e < n; e++) d[e] += (float)((double)pr[e] * ((double)aux_dp[e] - pa));
        }
    }
    mm(p, GDN_GEMM_A_TRANS, n, E, N, dl, n, x, E, dWr, E);
    mm(p, 0, N, E, n, dl, n, Wr, E, dx, E);

    /* The shared expert: its MLP's backward scaled by sigma = sigmoid(g . x); d(g . x) =
     * sigma' <dy, s(x)> = sigma' <dy SD, m_s>. */
    const float *g = NULL;
    if (Is) {
        const float *SG = w + p->off[GDN_MOE_SHARED_GATE], *SU = w + p->off[GDN_MOE_SHARED_UP],
                    *SD = w + p->off[GDN_MOE_SHARED_DOWN];
        g = w + p->off[GDN_MOE_SHARED_EXPERT_GATE];
        float *dSG = dw + p->off[GDN_MOE_SHARED_GATE], *dSU = dw + p->off[GDN_MOE_SHARED_UP],
              *dSD = dw + p->off[GDN_MOE_SHARED_DOWN], *dg = dw + p->off[GDN_MOE_SHARED_EXPERT_GATE];
        mm(p, 0, N, Is, E, dy, E, SD, Is, p->sdm, Is);
#pragma omp parallel for num_threads(th) schedule(static) if (N >= MOE_PAR_ROWS)
        for (int64_t t = 0; t < N; t++) {
            const float sig = gdn_sigmoidf(s->sgl[t]);
            const float *gu = s->sgu + t * 2 * Is;
            float *m = p->sm + t * Is, *dm = p->sdm + t * Is;
            gdn_swiglu_row(m, gu, gu + Is, Is);
            p->sdl[t] = (float)((double)sig * (1.0 - (double)sig) * dot_d(dm, m, Is));
            for (int64_t i = 0; i < Is; i++) m[i] *= sig, dm[i] *= sig;
            gdn_swiglu_grad_row(p->sdgu + t * 2 * Is, p->sdgu + t * 2 * Is + Is, gu, gu + Is, dm, Is);
        }
        mm(p, GDN_GEMM_A_TRANS, E, Is, N, dy, E, p->sm, Is, dSD, Is);
        mm(p, GDN_GEMM_A_TRANS, Is, E, N, p->sdgu, 2 * Is, x, E, dSG, E);
        mm(p, GDN_GEMM_A_TRANS, Is, E, N, p->sdgu + Is, 2 * Is, x, E, dSU, E);
        mm(p, GDN_GEMM_A_TRANS, 1, E, N, p->sdl, 1, x, E, dg, E);
        mm(p, GDN_GEMM_ACC, N, E, Is, p->sdgu, 2 * Is, SG, E, dx, E);
        mm(p, GDN_GEMM_ACC, N, E, Is, p->sdgu + Is, 2 * Is, SU, E, dx, E);
    }

    /* Combine: dx[t] += the pairs' dx in slot order (+ d(g . x_t) g). */
#pragma omp parallel for num_threads(th) schedule(static) if (N >= MOE_PAR_ROWS)
    for (int64_t t = 0; t < N; t++) {
        float *d = dx + t * E;
        for (int64_t j = 0; j < k; j++) {
            const float *src = dxg + (int64_t)p->pos[t * k + j] * lddx;
            for (int64_t i = 0; i < E; i++) d[i] += src[i];
        }
        if (g) {
            const float sd = p->sdl[t];
            for (int64_t i = 0; i < E; i++) d[i] += sd * g[i];
        }
    }
    /* the padding between tensors: zero */
    for (int i = 0; i < GDN_MOE_COUNT; i++) {
        const size_t end = p->off[i] + gdn_moe_param_numel(c, i);
        memset(dw + end, 0, sizeof(float) * (p->off[i + 1] - end));
    }
}

int gdn_moe_backward(gdn_moe_plan *p, float *dx, float *dw, const float *x, const float *w, const float *saved,
                     const float *dy, const float *aux_dp) {
    if (!p) return gdn_fail(GDN_ERR_ARG, "moe backward: plan is NULL");
    if (!dx) return gdn_fail(GDN_ERR_ARG, "moe backward: output 'dx' is NULL");
    if (!dw) return gdn_fail(GDN_ERR_ARG, "moe backward: output 'dw' is NULL");
    if (!w) return gdn_fail(GDN_ERR_ARG, "moe backward: weights 'w' are NULL");
    if (!saved) return gdn_fail(GDN_ERR_ARG, "moe backward: 'saved' is NULL (run the forward with saved)");
    int rc = whole(p, "backward");
    if (rc) return rc;
    const gdn_moe_saved s = gdn_moe_saved_view(p, (float *)saved);
    if ((rc = gdn_moe_backward_begin(p, &s, x, dy))) return rc;
    gather_rows(p, p->xg, x);
    gather_rows(p, p->dyg, dy);
    /* the pairs' dx replace their gathered dy */
    gdn_moe_experts_backward(p, p->n, p->start, w + p->off[GDN_MOE_GATE_UP], w + p->off[GDN_MOE_DOWN],
                             dw + p->off[GDN_MOE_GATE_UP], dw + p->off[GDN_MOE_DOWN], p->xg, p->E, s.gu, p->dyg, p->E,
                             p->wr, p->m, p->dm, p->dgu, p->c, p->dyg);
    gdn_moe_router_shared_backward(p, dx, dw, x, w, &s, dy, aux_dp, p->dyg, p->E, p->c, 1);
    return GDN_OK;
}

double gdn_moe_aux(int64_t n_experts, const double *stats, double R, double coef, float *aux_dp) {
    if (n_experts < 1 || n_experts > GDN_MOE_MAX_EXPERTS) {
        gdn_fail(GDN_ERR_SHAPE, "moe aux: n_experts = %lld is out of range [1, %d]", (long long)n_experts,
                 GDN_MOE_MAX_EXPERTS);
        return NAN;
    }
    if (!stats) {
        gdn_fail(GDN_ERR_ARG, "moe aux: stats is NULL");
        return NAN;
    }
    if (!(R > 0.0) || !isfinite(R)) {
        gdn_fail(GDN_ERR_ARG, "moe aux: rows R = %g must be positive and finite", R);
        return NAN;
    }
    const double n = (double)n_experts;
    double s = 0.0;
    for (int64_t e = 0; e < n_experts; e++) s += (stats[e] / R) * (stats[n_experts + e] / R);
    if (aux_dp)
        for (int64_t e = 0; e < n_experts; e++) aux_dp[e] = (float)(coef * n * stats[e] / (R * R));
    return n * s;
}
