/* The MoE block's configuration and its flat parameter layout (names, shapes, offsets): as the
 * other layers (layer_params.c), each tensor on a 16-float boundary. */
#include "moe_internal.h"

#include <string.h>

gdn_moe_config gdn_moe_config_default(int64_t N, int64_t E, int64_t n_experts, int64_t top_k, int64_t I,
                                      int64_t Is) {
    gdn_moe_config c;
    memset(&c, 0, sizeof c);
    c.N = N, c.E = E, c.n_experts = n_experts, c.top_k = top_k, c.I = I, c.Is = Is;
    c.norm_topk = 1, c.threads = 0, c.check_finite = 1, c.compute = GDN_COMPUTE_FP32;
    return c;
}

int gdn_moe_config_check(const gdn_moe_config *c) {
    if (!c) return gdn_fail(GDN_ERR_ARG, "moe config is NULL");
    const struct { const char *name; int64_t v, min, max; } dims[] = {
        {"N", c->N, 1, (int64_t)1 << 40},
        {"E", c->E, 1, (int64_t)1 << 20},
        {"n_experts", c->n_experts, 1, GDN_MOE_MAX_EXPERTS},
        {"I", c->I, 1, (int64_t)1 << 20},
        {"Is", c->Is, 0, (int64_t)1 << 20},
    };
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        if (dims[i].v < dims[i].min || dims[i].v > dims[i].max)
            return gdn_fail(GDN_ERR_SHAPE, "moe %s = %lld is out of range [%lld, %lld]", dims[i].name,
                            (long long)dims[i].v, (long long)dims[i].min, (long long)dims[i].max);
    if (c->top_k < 1 || c->top_k > c->n_experts)
        return gdn_fail(GDN_ERR_SHAPE, "moe top_k = %lld is out of range [1, n_experts = %lld]",
                        (long long)c->top_k, (long long)c->n_experts);
    /* The (token, slot) pairs are indexed by int32 (and are the rows of the experts' GEMMs). */
    if (c->N > (int64_t)INT32_MAX / c->top_k)
        return gdn_fail(GDN_ERR_SHAPE, "moe N * top_k = %lld * %lld (token, slot) pairs is too large (at most %d)",
                        (long long)c->N, (long long)c->top_k, INT32_MAX);
    if (c->threads < 0) return gdn_fail(GDN_ERR_ARG, "moe threads = %d is negative", c->threads);
    if (c->norm_topk != 0 && c->norm_topk != 1)
        return gdn_fail(GDN_ERR_ARG, "moe norm_topk = %d (want 0 or 1)", c->norm_topk);
    if (c->ep_size < 0 || c->ep_size > c->n_experts || (c->ep_size > 1 && c->n_experts % c->ep_size))
        return gdn_fail(GDN_ERR_SHAPE, "moe ep_size = %lld must divide n_experts = %lld (the experts split evenly "
                        "over the expert-parallel ranks)", (long long)c->ep_size, (long long)c->n_experts);
    if (c->ep_rank < 0 || c->ep_rank >= (c->ep_size > 1 ? c->ep_size : 1))
        return gdn_fail(GDN_ERR_ARG, "moe ep_rank = %lld is out of range [0, ep_size = %lld)", (long long)c->ep_rank,
                        (long long)(c->ep_size > 1 ? c->ep_size : 1));
    if (!gdn_compute_name(c->compute))
        return gdn_fail(GDN_ERR_ARG, "moe compute = %d (want GDN_COMPUTE_FP32 or GDN_COMPUTE_BF16)", c->compute);
    return GDN_OK;
}

int64_t gdn_moe_local_experts(const gdn_moe_config *c, int64_t *first) {
    const int64_t count = c->ep_size > 1 ? c->n_experts / c->ep_size : c->n_experts;
    if (first) *first = c->ep_size > 1 ? c->ep_rank * count : 0;
    return count;
}

static const char *const param_names[GDN_MOE_COUNT] = {
    "gate.weight",
    "experts.gate_up_proj",
    "experts.down_proj",
    "shared_expert.gate_proj.weight",
    "shared_expert.up_proj.weight",
    "shared_expert.down_proj.weight",
    "shared_expert_gate.weight",
};

const char *gdn_moe_param_name(int which) {
    return which >= 0 && which < GDN_MOE_COUNT ? param_names[which] : NULL;
}

int gdn_moe_param_shape(const gdn_moe_config *c, int which, int64_t shape[3]) {
    const int shared = c->Is > 0;
    switch (which) {
    case GDN_MOE_ROUTER: shape[0] = c->n_experts, shape[1] = c->E; return 2;
    case GDN_MOE_GATE_UP: shape[0] = gdn_moe_local_experts(c, NULL), shape[1] = 2 * c->I, shape[2] = c->E; return 3;
    case GDN_MOE_DOWN: shape[0] = gdn_moe_local_experts(c, NULL), shape[1] = c->E, shape[2] = c->I; return 3;
    case GDN_MOE_SHARED_GATE:
    case GDN_MOE_SHARED_UP:
        if (!shared) return 0;
        shape[0] = c->Is, shape[1] = c->E;
        return 2;
    case GDN_MOE_SHARED_DOWN:
        if (!shared) return 0;
        shape[0] = c->E, shape[1] = c->Is;
        return 2;
    case GDN_MOE_SHARED_EXPERT_GATE:
        if (!shared) return 0;
        shape[0] = 1, shape[1] = c->E;
        return 2;
    default: return 0;
    }
}

size_t gdn_moe_param_numel(const gdn_moe_config *c, int which) {
    int64_t shape[3];
    const int nd = gdn_moe_param_shape(c, which, shape);
    return gdn_param_numel(shape, nd);
}

size_t gdn_moe_param_offset(const gdn_moe_config *c, int which) {
    size_t off = 0;
    for (int i = 0; i < which && i < GDN_MOE_COUNT; i++) off += gdn_param_padded(gdn_moe_param_numel(c, i));
    return off;
}

int gdn_moe_param(const gdn_moe_config *c, int which, gdn_param_info *info) {
    if (!c || !info) return gdn_fail(GDN_ERR_ARG, "gdn_moe_param: config or info is NULL");
    if (which < 0 || which >= GDN_MOE_COUNT)
        return gdn_fail(GDN_ERR_ARG, "moe parameter %d is out of range [0, %d)", which, GDN_MOE_COUNT);
    memset(info, 0, sizeof *info);
    info->name = param_names[which];
    info->ndim = gdn_moe_param_shape(c, which, info->shape);
    info->offset = gdn_moe_param_offset(c, which);
    info->numel = gdn_moe_param_numel(c, which);
    return GDN_OK;
}

size_t gdn_moe_param_floats(const gdn_moe_config *c) { return gdn_moe_param_offset(c, GDN_MOE_COUNT); }
