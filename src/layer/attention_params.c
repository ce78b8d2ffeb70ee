/* The gated attention layer's configuration and its flat parameter layout (names, shapes,
 * offsets): apart from attention.c so that the weight loader and its fuzz harness (which builds
 * no GEMM or OpenMP code) can use them, as layer_params.c is for the GatedDeltaNet layer. */
#include "layer_internal.h"

#include <math.h>
#include <string.h>

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
    if (c->seq_offset < 0 || c->seq_offset > ((int64_t)1 << 40))
        return gdn_fail(GDN_ERR_ARG, "attention seq_offset = %lld is out of range [0, 2^40]", (long long)c->seq_offset);
    if (c->keep != GDN_ATTN_KEEP_ALL && c->keep != GDN_ATTN_KEEP_CORE)
        return gdn_fail(GDN_ERR_ARG, "attention keep = %d is unknown (GDN_ATTN_KEEP_ALL or GDN_ATTN_KEEP_CORE)", c->keep);
    if (!gdn_compute_name(c->compute))
        return gdn_fail(GDN_ERR_ARG, "attention compute = %d (want GDN_COMPUTE_FP32 or GDN_COMPUTE_BF16)", c->compute);
    if (c->cp != GDN_ATTN_CP_KV && c->cp != GDN_ATTN_CP_HEADS)
        return gdn_fail(GDN_ERR_ARG, "attention cp strategy %d is unknown (GDN_ATTN_CP_KV or GDN_ATTN_CP_HEADS)", c->cp);
    if (c->cu_seqlens) {
        const int64_t *cu = c->cu_seqlens, n = c->n_docs;
        if (c->B != 1) return gdn_fail(GDN_ERR_SHAPE, "attention cu_seqlens needs B = 1 (got B = %lld)", (long long)c->B);
        if (n < 1 || n > ((int64_t)1 << 40))
            return gdn_fail(GDN_ERR_SHAPE, "attention n_docs = %lld is out of range [1, 2^40]", (long long)n);
        if (cu[0] != 0 || cu[n] < c->seq_offset + c->T)
            return gdn_fail(GDN_ERR_SHAPE,
                            "attention cu_seqlens must run from 0 to the stream's end, at least seq_offset + T = %lld "
                            "(got %lld .. %lld)",
                            (long long)(c->seq_offset + c->T), (long long)cu[0], (long long)cu[n]);
        for (int64_t i = 0; i < n; i++)
            if (cu[i + 1] <= cu[i])
                return gdn_fail(GDN_ERR_SHAPE, "attention cu_seqlens is not strictly increasing at %lld (%lld, %lld)",
                                (long long)i, (long long)cu[i], (long long)cu[i + 1]);
        if (c->pos_offset)
            return gdn_fail(GDN_ERR_ARG, "attention pos_offset = %lld with cu_seqlens (packed positions restart at 0)",
                            (long long)c->pos_offset);
    }
    if (c->max_position < 0)
        return gdn_fail(GDN_ERR_ARG, "attention max_position = %lld is negative", (long long)c->max_position);
    if (c->max_position) { /* the largest position any token of this call takes, + 1 */
        int64_t reach = c->pos_offset + c->seq_offset + c->T, end = c->seq_offset + c->T;
        if (c->cu_seqlens) {
            reach = 0;
            for (int64_t k = 0; k < c->n_docs && c->cu_seqlens[k] < end; k++) {
                const int64_t e = c->cu_seqlens[k + 1] < end ? c->cu_seqlens[k + 1] : end;
                if (e > c->seq_offset && e - c->cu_seqlens[k] > reach) reach = e - c->cu_seqlens[k];
            }
        }
        if (reach > c->max_position)
            return gdn_fail(GDN_ERR_ARG, "attention positions reach %lld, beyond max_position = %lld",
                            (long long)(reach - 1), (long long)c->max_position);
    }
    return GDN_OK;
}

int gdn_attn_cp_strategy_parse(const char *name) {
    if (!name) return -1;
    if (!strcmp(name, "kv")) return GDN_ATTN_CP_KV;
    if (!strcmp(name, "heads")) return GDN_ATTN_CP_HEADS;
    return -1;
}

const char *gdn_attn_cp_strategy_name(int s) {
    return s == GDN_ATTN_CP_KV ? "kv" : s == GDN_ATTN_CP_HEADS ? "heads" : "unknown";
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

int gdn_attn_param(const gdn_attn_config *c, int which, gdn_param_info *info) {
    if (!c || !info) return gdn_fail(GDN_ERR_ARG, "gdn_attn_param: config or info is NULL");
    if (which < 0 || which >= GDN_A_COUNT)
        return gdn_fail(GDN_ERR_ARG, "attention parameter %d is out of range [0, %d)", which, GDN_A_COUNT);
    memset(info, 0, sizeof *info);
    info->name = attn_param_names[which];
    info->ndim = gdn_attn_param_shape(c, which, info->shape);
    info->offset = gdn_attn_param_offset(c, which);
    info->numel = gdn_attn_param_numel(c, which);
    return GDN_OK;
}

size_t gdn_attn_param_floats(const gdn_attn_config *c) { return gdn_attn_param_offset(c, GDN_A_COUNT); }
