/* The kernel's configuration: defaults and validation, packed-document offsets included. Built
 * without the kernels too (the fuzz targets link it with the readers). */
#include "kernel_internal.h"

#include <math.h>

gdn_config gdn_config_default(int64_t B, int64_t T, int64_t Hk, int64_t Hv, int64_t K, int64_t V) {
    gdn_config c = {0};
    c.B = B, c.T = T, c.Hk = Hk, c.Hv = Hv, c.K = K, c.V = V;
    c.chunk = 64;
    c.scale = GDN_SCALE_DEFAULT;
    c.l2norm = 1;
    c.threads = 0;
    c.check_finite = 1;
    return c;
}

/* Products of the sizes must stay addressable: refuse tensors above 2^62 elements. */
static int too_big(int64_t a, int64_t b, int64_t c, int64_t d) {
    const double lim = 4.6e18;
    return (double)a * (double)b * (double)c * (double)d > lim;
}

/* cu_seqlens (packed documents): with the configuration checks, so that everything that
 * validates a gdn_config builds without the kernels (the fuzz targets link this file alone). */
int gdn_pack_check(const gdn_config *c) {
    if (!c->cu_seqlens) {
        if (c->n_docs != 0 || c->seq_offset != 0)
            return gdn_fail(GDN_ERR_ARG, "n_docs (%lld) or seq_offset (%lld) given without cu_seqlens",
                            (long long)c->n_docs, (long long)c->seq_offset);
        return GDN_OK;
    }
    const int64_t *cu = c->cu_seqlens, n = c->n_docs;
    if (c->B != 1)
        return gdn_fail(GDN_ERR_SHAPE, "packed documents (cu_seqlens) need B = 1 (one packed stream), got B = %lld",
                        (long long)c->B);
    if (n < 1) return gdn_fail(GDN_ERR_SHAPE, "cu_seqlens: n_docs must be >= 1, got %lld", (long long)n);
    if (cu[0] != 0)
        return gdn_fail(GDN_ERR_SHAPE, "cu_seqlens must start at 0, got cu_seqlens[0] = %lld", (long long)cu[0]);
    for (int64_t d = 0; d < n; d++)
        if (cu[d + 1] <= cu[d])
            return gdn_fail(GDN_ERR_SHAPE,
                            "cu_seqlens must be strictly increasing (every document at least one token): "
                            "cu_seqlens[%lld] = %lld, cu_seqlens[%lld] = %lld",
                            (long long)d, (long long)cu[d], (long long)(d + 1), (long long)cu[d + 1]);
    if (c->seq_offset < 0)
        return gdn_fail(GDN_ERR_SHAPE, "seq_offset must be >= 0, got %lld", (long long)c->seq_offset);
    if (c->seq_offset > cu[n] - c->T)
        return gdn_fail(GDN_ERR_SHAPE, "cu_seqlens ends at %lld but the tokens reach %lld (seq_offset %lld + T %lld)",
                        (long long)cu[n], (long long)(c->seq_offset + c->T), (long long)c->seq_offset,
                        (long long)c->T);
    return GDN_OK;
}

int gdn_pack_check_whole(const gdn_config *c) {
    if (!c->cu_seqlens) return GDN_OK;
    const int64_t end = c->cu_seqlens[c->n_docs];
    if (c->seq_offset != 0)
        return gdn_fail(GDN_ERR_SHAPE, "this plan is a shard of a packed stream (seq_offset %lld, T %lld of %lld tokens): "
                        "run it with gdn_cp_forward / gdn_cp_backward",
                        (long long)c->seq_offset, (long long)c->T, (long long)end);
    if (end != c->T)
        return gdn_fail(GDN_ERR_SHAPE, "cu_seqlens must end at T = %lld, it ends at %lld", (long long)c->T, (long long)end);
    return GDN_OK;
}

double gdn_rule_flops_per_head_token(int64_t K, int64_t V, int chunk, int backward) {
    const double C = chunk > 0 ? chunk : 64, k = (double)K, v = (double)V;
    return backward ? 18 * C * k + 10 * C * v + 16 * k * v + 4 * C * C : 3 * C * k + 2 * C * v + 6 * k * v + C * C / 3;
}

int gdn_config_check(const gdn_config *cfg) {
    if (!cfg) return gdn_fail(GDN_ERR_ARG, "config is NULL");
    const struct { const char *name; int64_t v; } dims[] = {
        {"B (batch)", cfg->B}, {"T (tokens)", cfg->T}, {"Hk (key heads)", cfg->Hk},
        {"Hv (value heads)", cfg->Hv}, {"K (key head dim)", cfg->K}, {"V (value head dim)", cfg->V}};
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        if (dims[i].v <= 0)
            return gdn_fail(GDN_ERR_SHAPE, "%s must be >= 1, got %lld", dims[i].name,
                            (long long)dims[i].v);
    if (cfg->Hv % cfg->Hk != 0)
        return gdn_fail(GDN_ERR_SHAPE, "Hv (%lld) must be a multiple of Hk (%lld)",
                        (long long)cfg->Hv, (long long)cfg->Hk);
    if (cfg->K > GDN_MAX_HEAD_DIM)
        return gdn_fail(GDN_ERR_SHAPE, "K (key head dim) is %lld, the maximum is %d",
                        (long long)cfg->K, GDN_MAX_HEAD_DIM);
    if (cfg->V > GDN_MAX_HEAD_DIM)
        return gdn_fail(GDN_ERR_SHAPE, "V (value head dim) is %lld, the maximum is %d",
                        (long long)cfg->V, GDN_MAX_HEAD_DIM);
    if (too_big(cfg->B, cfg->T, cfg->Hv, cfg->V > cfg->K ? cfg->V : cfg->K))
        return gdn_fail(GDN_ERR_SHAPE, "tensors of B*T*H*D = %lld*%lld*%lld*%lld are too large",
                        (long long)cfg->B, (long long)cfg->T, (long long)cfg->Hv,
                        (long long)(cfg->V > cfg->K ? cfg->V : cfg->K));
    if (cfg->compute != GDN_COMPUTE_FP32 && cfg->compute != GDN_COMPUTE_BF16)
        return gdn_fail(GDN_ERR_ARG, "compute must be GDN_COMPUTE_FP32 (0) or GDN_COMPUTE_BF16 (1), got %d", cfg->compute);
    if (cfg->cp < GDN_CP_SCAN || cfg->cp > GDN_CP_HEADS)
        return gdn_fail(GDN_ERR_ARG, "cp must be a CP strategy: GDN_CP_SCAN (0), GDN_CP_ALLGATHER (1), GDN_CP_RELAY (2) "
                        "or GDN_CP_HEADS (3), got %d", cfg->cp);
    if (cfg->chunk != 0 && cfg->chunk != 16 && cfg->chunk != 32 && cfg->chunk != 64 &&
        cfg->chunk != 128)
        return gdn_fail(GDN_ERR_ARG, "chunk must be 16, 32, 64 or 128, got %d", cfg->chunk);
    if (!isfinite(cfg->scale))
        return gdn_fail(GDN_ERR_ARG, "scale must be finite, got %g", (double)cfg->scale);
    if (cfg->threads < 0)
        return gdn_fail(GDN_ERR_ARG, "threads must be >= 0, got %d", cfg->threads);
    return gdn_pack_check(cfg);
}
