/* The attention core alone (include/gdncp/attention.h, "the attention core alone"): causal
 * softmax attention over token-major q [B, T, H, d], k, v [B, T, Hkv, d], GQA and packed
 * documents, as PyTorch's scaled_dot_product_attention(is_causal=True, enable_gqa=True) computes
 * it, on attention_core.c's flash core. The plan holds the core's per-thread tiles, the
 * log-sum-exp of a forward whose caller keeps none, and D = rowsum(dout * o) [B, T, H] for the
 * backward; executing allocates nothing. */
#include "attention_internal.h"

#include <math.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

struct gdn_sdpa_plan {
    gdn_attn_config cfg; /* cu_seqlens points to the plan's own copy */
    int threads;
    int64_t N, Hd, Kd;   /* B T tokens; H d, Hkv d floats per token */
    int64_t *cu;
    float *tile, *lse, *D; /* threads x gdn_attn_tile_floats(d); [B, T, H]; [B, T, H] */
    void *arena;
};

void gdn_sdpa_plan_destroy(gdn_sdpa_plan *p) {
    if (!p) return;
    free(p->cu), free(p->arena);
    free(p);
}

/* The fields the core reads, checked as the layer checks them; the others are set to valid
 * values so that gdn_attn_config_check judges only these. One rank sees the whole stream. */
static int sdpa_config_check(const gdn_attn_config *cfg) {
    if (!cfg) return gdn_fail(GDN_ERR_ARG, "sdpa config is NULL");
    gdn_attn_config c = gdn_attn_config_default(cfg->B, cfg->T, 1, cfg->H, cfg->Hkv, cfg->d);
    c.R = 0, c.threads = cfg->threads, c.cu_seqlens = cfg->cu_seqlens, c.n_docs = cfg->n_docs, c.compute = cfg->compute;
    int rc = gdn_attn_config_check(&c);
    if (rc) return rc;
    if (cfg->cu_seqlens && cfg->cu_seqlens[cfg->n_docs] != cfg->T)
        return gdn_fail(GDN_ERR_SHAPE, "sdpa cu_seqlens must end at T = %lld (got %lld)", (long long)cfg->T,
                        (long long)cfg->cu_seqlens[cfg->n_docs]);
    return GDN_OK;
}

int gdn_sdpa_plan_create(gdn_sdpa_plan **out, const gdn_attn_config *cfg) {
    if (!out) return gdn_fail(GDN_ERR_ARG, "sdpa plan output pointer is NULL");
    *out = NULL;
    int rc = gdn_isa_check();
    if (rc || (rc = sdpa_config_check(cfg))) return rc;
    gdn_sdpa_plan *p = gdn_calloc("sdpa: p", 1, sizeof *p);
    if (!p) return gdn_fail(GDN_ERR_NOMEM, "sdpa plan");
    p->cfg = *cfg;
    gdn_attn_config *c = &p->cfg;
#ifdef _OPENMP
    p->threads = c->threads > 0 ? c->threads : omp_get_max_threads();
#else
    p->threads = 1;
#endif
    c->threads = p->threads;
    p->N = c->B * c->T, p->Hd = c->H * c->d, p->Kd = c->Hkv * c->d;
    if (c->cu_seqlens) {
        if (!(p->cu = gdn_malloc("sdpa: p->cu", sizeof(int64_t) * (size_t)(c->n_docs + 1)))) {
            gdn_sdpa_plan_destroy(p);
            return gdn_fail(GDN_ERR_NOMEM, "sdpa cu_seqlens copy (%lld documents)", (long long)c->n_docs);
        }
        memcpy(p->cu, c->cu_seqlens, sizeof(int64_t) * (size_t)(c->n_docs + 1));
        c->cu_seqlens = p->cu;
    } else {
        c->n_docs = 0;
    }
    const size_t pieces[] = {(size_t)p->threads * gdn_attn_tile_floats(c->d, c->compute == GDN_COMPUTE_BF16), (size_t)p->N * (size_t)c->H,
                             (size_t)p->N * (size_t)c->H};
    size_t total = 0;
    for (size_t i = 0; i < 3; i++) total += (pieces[i] + 15) & ~(size_t)15;
    char what[160];
    snprintf(what, sizeof what, "the sdpa workspace for B*T = %lld tokens", (long long)p->N);
    if ((rc = gdn_check_fits(what, 4.0 * (double)total))) {
        gdn_sdpa_plan_destroy(p);
        return rc;
    }
    if (!(p->arena = gdn_alloc_aligned("sdpa: p->arena", total * sizeof(float)))) {
        /* the message before the plan goes: it names the plan's token count */
        const int rc = gdn_fail(GDN_ERR_NOMEM, "sdpa workspace: %.1f MB for B*T = %lld tokens", total * 4.0 / 1e6,
                                (long long)p->N);
        gdn_sdpa_plan_destroy(p);
        return rc;
    }
    float *cur = p->arena;
    p->tile = gdn_carve(&cur, pieces[0]), p->lse = gdn_carve(&cur, pieces[1]), p->D = gdn_carve(&cur, pieces[2]);
    *out = p;
    return GDN_OK;
}

/* The core's view of token-major q, k, v: Q, O at (b T + t) H d + h d; K, V kv head j of key u in
 * row b at b T Hkv d + u Hkv d + j d. */
static gdn_attn_core sdpa_view(const gdn_sdpa_plan *p, const float *q, const float *k, const float *v) {
    const gdn_attn_config *c = &p->cfg;
    const int64_t T = c->T;
    gdn_attn_core view = {
        .B = c->B, .H = c->H, .Hkv = c->Hkv, .d = c->d, .Q = q, .nq = T, .q0 = 0, .qld = p->Hd, .nk = T, .k0 = 0,
        .K = {(float *)k, p->Kd, c->d, T * p->Kd}, .V = {(float *)v, p->Kd, c->d, T * p->Kd}, .cu = p->cu,
        .n_docs = c->n_docs, .threads = p->threads, .bf16 = c->compute == GDN_COMPUTE_BF16, .tile = p->tile,
    };
    return view;
}

static int check_qkv(const gdn_sdpa_plan *p, const float *q, const float *k, const float *v) {
    const int cf = p->cfg.check_finite;
    int rc;
    if ((rc = gdn_check_tensor("q", q, p->N * p->Hd, cf, p->threads)) ||
        (rc = gdn_check_tensor("k", k, p->N * p->Kd, cf, p->threads)) ||
        (rc = gdn_check_tensor("v", v, p->N * p->Kd, cf, p->threads)))
        return rc;
    return GDN_OK;
}

int gdn_sdpa_forward(gdn_sdpa_plan *p, float *o, float *lse, const float *q, const float *k, const float *v) {
    if (!p) return gdn_fail(GDN_ERR_ARG, "gdn_sdpa_forward: plan is NULL");
    if (!o) return gdn_fail(GDN_ERR_ARG, "output 'o' is NULL");
    int rc = check_qkv(p, q, k, v);
    if (rc) return rc;
    const gdn_fpmode fm = gdn_fp_fast_begin();
    const gdn_attn_core view = sdpa_view(p, q, k, v);
    gdn_attn_core_forward(&view, o, lse ? lse : p->lse);
    gdn_fp_fast_end(fm);
    /* finite inputs whose scores overflow fp32 (|q.k| d^-1/2 > 3e38) give NaN: reported */
    return p->cfg.check_finite ? gdn_check_output("o", o, p->N * p->Hd, p->threads) : GDN_OK;
}

int gdn_sdpa_backward(gdn_sdpa_plan *p, float *dq, float *dk, float *dv, const float *q, const float *k,
                      const float *v, const float *o, const float *lse, const float *dout) {
    if (!p) return gdn_fail(GDN_ERR_ARG, "gdn_sdpa_backward: plan is NULL");
    if (!dq) return gdn_fail(GDN_ERR_ARG, "output 'dq' is NULL");
    if (!dk) return gdn_fail(GDN_ERR_ARG, "output 'dk' is NULL");
    if (!dv) return gdn_fail(GDN_ERR_ARG, "output 'dv' is NULL");
    const int cf = p->cfg.check_finite;
    const int64_t N = p->N, H = p->cfg.H, d = p->cfg.d, Hd = p->Hd, Kd = p->Kd;
    int rc = check_qkv(p, q, k, v);
    /* every query sees at least itself, so a forward's lse is finite */
    if (rc || (rc = gdn_check_tensor("o", o, N * Hd, cf, p->threads)) ||
        (rc = gdn_check_tensor("lse", lse, N * H, cf, p->threads)) ||
        (rc = gdn_check_tensor("dout", dout, N * Hd, cf, p->threads)))
        return rc;
    const gdn_fpmode fm = gdn_fp_fast_begin();
    float *D = p->D;
#pragma omp parallel for num_threads(p->threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        memset(dq + n * Hd, 0, sizeof(float) * (size_t)Hd);
        memset(dk + n * Kd, 0, sizeof(float) * (size_t)Kd);
        memset(dv + n * Kd, 0, sizeof(float) * (size_t)Kd);
        for (int64_t h = 0; h < H; h++) {
            const float *a = dout + n * Hd + h * d, *b = o + n * Hd + h * d;
            gdn_vf acc = {0};
            float s = 0.0f;
            int64_t e = 0;
            for (; e + GDN_VL <= d; e += GDN_VL) acc += gdn_vloadu(a + e) * gdn_vloadu(b + e);
            for (; e < d; e++) s += a[e] * b[e];
            D[n * H + h] = s + gdn_vhsum(acc);
        }
    }
    const gdn_attn_core view = sdpa_view(p, q, k, v);
    const gdn_attn_kv gk = {dk, Kd, d, p->cfg.T * Kd}, gv = {dv, Kd, d, p->cfg.T * Kd};
    gdn_attn_core_backward(&view, dout, lse, D, dq, gk, gv);
    gdn_fp_fast_end(fm);
    if (!cf) return GDN_OK;
    if ((rc = gdn_check_output("dq", dq, N * Hd, p->threads)) || (rc = gdn_check_output("dk", dk, N * Kd, p->threads)))
        return rc;
    return gdn_check_output("dv", dv, N * Kd, p->threads);
}

const char *gdn_sdpa_plan_path(const gdn_sdpa_plan *p) {
    if (!p) return gdn_attn_core_path(NULL);
    const gdn_attn_core view = sdpa_view(p, NULL, NULL, NULL);
    return gdn_attn_core_path(&view);
}
