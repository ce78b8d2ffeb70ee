/* Decode with a KV cache for the gated attention layer (attention.h, DESIGN §10): the cache in
 * transformers' DynamicCache layout, and gdn_attn_decode, which runs a piece of T new tokens
 * (T = 1: a decode step) against it: the plan's projections, norms and RoPE at the positions
 * after the cache, the new keys (normed and rotated) and raw values appended, the shared core
 * over a view of the cache (queries at global indices len .. len + T - 1, keys 0 .. len + T - 1),
 * the gate and o_proj. Nothing is allocated per call: every buffer is the plan's.
 *
 * Flash-decoding: at T = 1 the core has one job per (batch row, kv head), which leaves threads
 * idle when B Hkv is small. Then the cache's keys are split into ranges, each range's core run
 * by one thread into its own partial (o, lse) carved from plan buffers that inference leaves free,
 * and the partials merged exactly by their log-sum-exp (gdn_attn_merge). */
#include "attention_internal.h"
#include "blas.h" /* gdn_f32_to_bf16 */

#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif


/* ---------------------------------------------------------------- the cache */

int gdn_attn_cache_create(gdn_attn_cache **out, int64_t B, int64_t Hkv, int64_t d, int64_t capacity, int dtype) {
    if (!out) return gdn_fail(GDN_ERR_ARG, "attention cache output pointer is NULL");
    *out = NULL;
    if (dtype != GDN_F32 && dtype != GDN_BF16)
        return gdn_fail(GDN_ERR_ARG, "attention cache dtype %d is neither F32 (0) nor BF16 (2)", dtype);
    const size_t esz = dtype == GDN_BF16 ? 2 : 4;
    const struct { const char *name; int64_t v, max; } dims[] = {
        {"B", B, (int64_t)1 << 31}, {"Hkv", Hkv, 1 << 16}, {"d", d, 1024}, {"capacity", capacity, (int64_t)1 << 40},
    };
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        if (dims[i].v < 1 || dims[i].v > dims[i].max)
            return gdn_fail(GDN_ERR_SHAPE, "attention cache %s = %lld is out of range [1, %lld]", dims[i].name,
                            (long long)dims[i].v, (long long)dims[i].max);
    const double bytes = 2.0 * (double)esz * (double)B * (double)Hkv * (double)d * (double)capacity;
    char what[160];
    snprintf(what, sizeof what, "the attention KV cache [B = %lld, Hkv = %lld, capacity = %lld, d = %lld] x 2 (%s)",
             (long long)B, (long long)Hkv, (long long)capacity, (long long)d, dtype == GDN_BF16 ? "BF16" : "F32");
    int rc = gdn_check_fits(what, bytes);
    if (rc) return rc;
    gdn_attn_cache *c = gdn_calloc("attention_decode: c", 1, sizeof *c);
    const size_t n = (size_t)B * (size_t)Hkv * (size_t)capacity * (size_t)d;
    void *mem = c ? gdn_calloc("attention_decode: mem", 2 * n, esz) : NULL; /* zeros: positions past the length hold 0 */
    if (!mem) {
        free(c);
        return gdn_fail(GDN_ERR_NOMEM, "%s: %.1f MB", what, bytes / 1e6);
    }
    if (dtype == GDN_BF16)
        c->kb = mem, c->vb = c->kb + n;
    else
        c->k = mem, c->v = c->k + n;
    c->B = B, c->Hkv = Hkv, c->d = d, c->cap = capacity, c->len = 0, c->dtype = dtype;
    *out = c;
    return GDN_OK;
}

void gdn_attn_cache_destroy(gdn_attn_cache *c) {
    if (!c) return;
    free(c->k ? (void *)c->k : (void *)c->kb);
    free(c);
}

void gdn_attn_cache_reset(gdn_attn_cache *c) {
    if (c) c->len = 0;
}

int gdn_attn_cache_view(gdn_attn_cache *c, gdn_attn_cache_info *info) {
    if (!info) return gdn_fail(GDN_ERR_ARG, "gdn_attn_cache_view: info is NULL");
    memset(info, 0, sizeof *info);
    if (!c) return gdn_fail(GDN_ERR_ARG, "gdn_attn_cache_view: cache is NULL");
    info->B = c->B, info->Hkv = c->Hkv, info->d = c->d, info->capacity = c->cap, info->length = c->len;
    info->dtype = c->dtype;
    info->keys = c->dtype == GDN_BF16 ? (void *)c->kb : (void *)c->k;
    info->values = c->dtype == GDN_BF16 ? (void *)c->vb : (void *)c->v;
    return GDN_OK;
}

int gdn_attn_cache_set_length(gdn_attn_cache *c, int64_t len) {
    if (!c) return gdn_fail(GDN_ERR_ARG, "gdn_attn_cache_set_length: cache is NULL");
    if (len < 0 || len > c->cap)
        return gdn_fail(GDN_ERR_ARG, "gdn_attn_cache_set_length: length %lld is out of range [0, capacity = %lld]",
                        (long long)len, (long long)c->cap);
    c->len = len;
    return GDN_OK;
}

/* ---------------------------------------------------------------- the key split */

/* Free floats of the plan during inference (after norm_rope, before finish): spans first fit. */
typedef struct {
    float *p;
    size_t left;
} span;

static float *take(span *pool, int n, size_t want) {
    const size_t adv = (want + 15) & ~(size_t)15;
    for (int i = 0; i < n; i++)
        if (pool[i].left >= want) {
            float *r = pool[i].p;
            pool[i].p += adv, pool[i].left = pool[i].left > adv ? pool[i].left - adv : 0;
            return r;
        }
    return NULL;
}

enum { MAX_SPLITS = 256, KEY_ALIGN = 64 /* the core's key tile */ };

/* When the core would have fewer jobs than threads (B Hkv small, T = 1), the cache's keys are
 * split into ranges of at least this many keys, one per thread, whose partial results merge by
 * their log-sum-exp (flash-decoding): 512 (caches above 1024 keys split), or the test site's. */
static int64_t decode_split_keys(void) {
    const int keys = gdn_test_mutate("attention decode: keys a range at least");
    return keys > 0 ? keys : 512;
}

/* The core over the cache, split over key ranges when that gives idle threads work; o, lse: the
 * saved view's (the finish reads o). */
static void decode_core(gdn_attn_plan *ap, const gdn_attn_core *v, float *o, float *lse) {
    const gdn_attn_config *c = &ap->cfg;
    const int64_t N = ap->N, H = c->H, d = c->d, grp = H / c->Hkv, nk = v->nk;
    /* the core's jobs: (batch row, kv head, query block of about 64 / group rows); an estimate */
    const int64_t hg = grp < 16 ? grp : 16, jobs = c->B * (H / hg) * ((v->nq + 64 / hg - 1) / (64 / hg));
    int64_t S = ap->threads;
    if (S > MAX_SPLITS) S = MAX_SPLITS;
    const int64_t keys = decode_split_keys();
    if (nk / keys < S) S = nk / keys;
    float *os[MAX_SPLITS], *ls[MAX_SPLITS];
    if (jobs < ap->threads && S >= 2) {
        span pool[] = {
            {ap->Dv, (size_t)N * H},          {ap->rq, (size_t)N * H},        {ap->rk, (size_t)N * c->Hkv},
            {ap->partial, (size_t)ap->threads * 2 * (size_t)d},              {ap->z, (size_t)N * ap->Hd},
            {ap->dO, (size_t)N * ap->Hd},     {ap->dqr, (size_t)N * ap->Hd}, {ap->dkr, (size_t)N * ap->Kd},
            {ap->dproj, (size_t)N * ap->P},   {ap->mm_ws, gdn_matmul_compute_ws_floats(c->compute, ap->threads)},
        };
        const int np = (int)(sizeof pool / sizeof pool[0]);
        os[0] = o, ls[0] = lse;
        int64_t got = 1;
        for (; got < S; got++)
            if (!(os[got] = take(pool, np, (size_t)N * ap->Hd)) || !(ls[got] = take(pool, np, (size_t)N * H))) break;
        S = got;
    }
    if (jobs >= ap->threads || S < 2) {
        gdn_attn_core_forward(v, o, lse);
        return;
    }
    int64_t chunk = (nk + S - 1) / S;
    chunk = (chunk + KEY_ALIGN - 1) / KEY_ALIGN * KEY_ALIGN;
    S = (nk + chunk - 1) / chunk;
    gdn_test_threads("attn_decode_split", (int)S); /* the number of key ranges */
    const size_t tf = gdn_attn_tile_floats(d, v->bf16);
#pragma omp parallel for num_threads((int)S) schedule(static, 1)
    for (int64_t s = 0; s < S; s++) {
        gdn_attn_core vs = *v;
        const int64_t lo = s * chunk, hi = lo + chunk < nk ? lo + chunk : nk;
        vs.k0 = v->k0 + lo, vs.nk = hi - lo;
        if (vs.Kb)
            vs.Kb += lo * vs.K.ld, vs.Vb += lo * vs.V.ld;
        else
            vs.K.p += lo * vs.K.ld, vs.V.p += lo * vs.V.ld;
        /* one thread each; the core's tile is that of its thread 0, so each range gets its own */
        vs.threads = 1, vs.tile = ap->tile + (size_t)s * tf;
        gdn_attn_core_forward(&vs, os[s], ls[s]);
    }
    const int mt = N * H * d > (1 << 16) ? ap->threads : 1;
    for (int64_t s = 1; s < S; s++) gdn_attn_merge(N, H, d, ap->Hd, o, lse, os[s], ls[s], mt);
}

/* ---------------------------------------------------------------- decode */

int gdn_attn_decode_check(const gdn_attn_plan *ap, const gdn_attn_cache *cache, const float *y, const float *x,
                          const float *w, int64_t len_total, int appends) {
    const gdn_attn_config *c = &ap->cfg;
    if (c->cu_seqlens)
        return gdn_fail(GDN_ERR_ARG,
                        "gdn_attn_decode: the plan is packed (cu_seqlens, %lld documents); decode takes dense rows, "
                        "one sequence per batch row",
                        (long long)c->n_docs);
    if (c->seq_offset)
        return gdn_fail(GDN_ERR_ARG, "gdn_attn_decode: the plan has seq_offset = %lld (a CP shard); decode needs 0",
                        (long long)c->seq_offset);
    if (cache->B != c->B || cache->Hkv != c->Hkv || cache->d != c->d)
        return gdn_fail(GDN_ERR_SHAPE,
                        "gdn_attn_decode: the cache is for B = %lld, Hkv = %lld, d = %lld; the plan has B = %lld, Hkv = "
                        "%lld, d = %lld",
                        (long long)cache->B, (long long)cache->Hkv, (long long)cache->d, (long long)c->B,
                        (long long)c->Hkv, (long long)c->d);
    const int64_t T = c->T;
    if (appends && cache->len + T > cache->cap)
        return gdn_fail(GDN_ERR_SHAPE,
                        "gdn_attn_decode: the cache holds %lld of its capacity %lld positions; T = %lld more tokens do "
                        "not fit",
                        (long long)cache->len, (long long)cache->cap, (long long)T);
    if (c->max_position && c->pos_offset + len_total + T > c->max_position)
        return gdn_fail(GDN_ERR_ARG,
                        "gdn_attn_decode: positions reach %lld (pos_offset %lld + cache length %lld + T %lld - 1), "
                        "beyond max_position = %lld",
                        (long long)(c->pos_offset + len_total + T - 1), (long long)c->pos_offset, (long long)len_total,
                        (long long)T, (long long)c->max_position);
    if (!y) return gdn_fail(GDN_ERR_ARG, "output 'y' is NULL");
    /* A decode step (T = 1) checks x only: scanning every weight for NaN/Inf per token read the
     * weights twice (half the step's time at the 35B shape); a prefill piece, like the forward,
     * checks them, and a non-finite weight that reaches a step still makes y non-finite, which
     * the step refuses (the cache length unchanged), as gdn_layer_decode does. */
    if (T > 1) return gdn_attn_check_inputs(ap, x, w);
    int rc = gdn_check_tensor("x", x, ap->N * c->E, c->check_finite, ap->threads);
    if (!rc && !w) rc = gdn_fail(GDN_ERR_ARG, "input 'w' (the attention weights) is NULL");
    return rc;
}

void gdn_attn_decode_project(gdn_attn_plan *ap, gdn_attn_saved sv, const float *x, const float *w, int64_t base) {
    const int64_t T = ap->cfg.T, hr = ap->cfg.R / 2;
    gdn_attn_project(ap, sv.proj, x, w);
    /* RoPE at positions base + t: a table for this call in dqr (free in inference, N Hd >= T R
     * floats), lent to norm_rope; the plan's own table stays that of its config, so
     * gdn_attn_forward / backward with this plan are unaffected. */
    float *const cos0 = ap->cosv, *const sin0 = ap->sinv;
    ap->cosv = ap->dqr, ap->sinv = ap->dqr + T * hr;
    gdn_attn_rope_table(ap, base, ap->cosv, ap->sinv);
    gdn_attn_norm_rope(ap, sv.proj, w);
    ap->cosv = cos0, ap->sinv = sin0;
}

typedef struct {
    const gdn_attn_plan *ap;
    gdn_attn_cache *cache;
    const float *proj;
} append_job;

/* rows [lo, hi) of the B Hkv T new cache rows: keys normed and rotated (kr), values raw (proj's
 * v columns), at [len, len + T) */
static void append_rows(void *p, int64_t lo, int64_t hi) {
    const append_job *jb = p;
    const gdn_attn_plan *ap = jb->ap;
    gdn_attn_cache *cache = jb->cache;
    const int64_t Hkv = ap->cfg.Hkv, T = ap->cfg.T, d = ap->cfg.d, len = cache->len, cap = cache->cap;
    /* tests: an F32 cache holding the values a BF16 cache would (its decode must give that one's bits) */
    const int round_f32 = cache->dtype != GDN_BF16 && gdn_test_mutate("attention decode: the F32 cache rounds to bf16");
    for (int64_t r = lo; r < hi; r++) {
        const int64_t b = r / (Hkv * T), j = r / T % Hkv, t = r % T, n = b * T + t;
        const size_t at = ((size_t)(b * Hkv + j) * (size_t)cap + (size_t)(len + t)) * (size_t)d;
        const float *ks = ap->kr + n * ap->Kd + j * d, *vs = jb->proj + n * ap->P + 2 * ap->Hd + ap->Kd + j * d;
        if (cache->dtype == GDN_BF16) {
            for (int64_t e = 0; e < d; e++)
                cache->kb[at + e] = gdn_f32_to_bf16(ks[e]), cache->vb[at + e] = gdn_f32_to_bf16(vs[e]);
        } else if (round_f32) {
            for (int64_t e = 0; e < d; e++) {
                const uint32_t uk = (uint32_t)gdn_f32_to_bf16(ks[e]) << 16, uv = (uint32_t)gdn_f32_to_bf16(vs[e]) << 16;
                memcpy(cache->k + at + e, &uk, 4), memcpy(cache->v + at + e, &uv, 4);
            }
        } else {
            memcpy(cache->k + at, ks, sizeof(float) * (size_t)d);
            memcpy(cache->v + at, vs, sizeof(float) * (size_t)d);
        }
    }
}

void gdn_attn_cache_append(gdn_attn_plan *ap, gdn_attn_cache *cache, const float *proj) {
    const int64_t rows = ap->cfg.B * ap->cfg.Hkv * ap->cfg.T;
    append_job j = {ap, cache, proj};
    gdn_parallel_range(rows * ap->cfg.d > (1 << 16) ? ap->threads : 1, rows, append_rows, &j);
}

void gdn_attn_cache_unappend(gdn_attn_cache *cache, int64_t T) {
    const int64_t d = cache->d, n = T < cache->cap - cache->len ? T : cache->cap - cache->len;
    const size_t esz = cache->dtype == GDN_BF16 ? 2 : 4;
    char *k = cache->k ? (char *)cache->k : (char *)cache->kb, *v = cache->v ? (char *)cache->v : (char *)cache->vb;
    for (int64_t bj = 0; bj < cache->B * cache->Hkv && n > 0; bj++) {
        const size_t at = ((size_t)bj * (size_t)cache->cap + (size_t)cache->len) * (size_t)d * esz;
        memset(k + at, 0, (size_t)(n * d) * esz), memset(v + at, 0, (size_t)(n * d) * esz);
    }
}

void gdn_attn_decode_attend(gdn_attn_plan *ap, const gdn_attn_cache *cache, int64_t nk, int64_t q0, int64_t k0,
                            float *o, float *lse) {
    const gdn_attn_config *c = &ap->cfg;
    const int64_t d = c->d, cap = cache->cap, Hkv = c->Hkv;
    const gdn_attn_core v = {
        .B = c->B, .H = c->H, .Hkv = Hkv, .d = d, .Q = ap->qr, .nq = c->T, .q0 = q0, .qld = ap->Hd, .nk = nk,
        .k0 = k0, .K = {cache->k, d, cap * d, Hkv * cap * d}, .V = {cache->v, d, cap * d, Hkv * cap * d},
        .Kb = cache->kb, .Vb = cache->vb, .cu = NULL,
        .n_docs = 0, .threads = ap->threads, .bf16 = ap->cfg.compute == GDN_COMPUTE_BF16, .tile = ap->tile,
    };
    decode_core(ap, &v, o, lse);
}

int gdn_attn_decode(gdn_attn_plan *ap, gdn_attn_cache *cache, float *y, const float *x, const float *w) {
    if (!ap) return gdn_fail(GDN_ERR_ARG, "gdn_attn_decode: plan is NULL");
    if (!cache) return gdn_fail(GDN_ERR_ARG, "gdn_attn_decode: cache is NULL");
    const int64_t len = cache->len;
    int rc = gdn_attn_decode_check(ap, cache, y, x, w, len, 1);
    if (rc) return rc;
    const gdn_fpmode fm = gdn_fp_fast_begin();
    const gdn_attn_saved sv = gdn_attn_saved_view(ap, ap->saved);
    gdn_attn_decode_project(ap, sv, x, w, ap->cfg.pos_offset + len);
    gdn_attn_cache_append(ap, cache, sv.proj);
    gdn_attn_decode_attend(ap, cache, len + ap->cfg.T, len, 0, sv.o, sv.lse);
    gdn_attn_finish(ap, y, sv, w);
    gdn_fp_fast_end(fm);
    /* the new positions count only when y came out finite (on an error the length is unchanged,
     * and what was appended is cleared) */
    if ((rc = gdn_check_output("y", y, ap->N * ap->cfg.E, ap->threads))) {
        gdn_attn_cache_unappend(cache, ap->cfg.T);
        return rc;
    }
    cache->len = len + ap->cfg.T;
    return GDN_OK;
}
