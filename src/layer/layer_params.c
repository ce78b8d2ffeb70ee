/* The layer's configuration and its flat parameter layout (names, shapes, offsets). */
#include "layer_internal.h"

#include <math.h>
#include <string.h>

gdn_layer_config gdn_layer_config_default(int64_t B, int64_t T, int64_t E, int64_t Hk,
                                          int64_t Hv, int64_t K, int64_t V) {
    gdn_layer_config c;
    memset(&c, 0, sizeof c);
    c.B = B, c.T = T, c.E = E, c.Hk = Hk, c.Hv = Hv, c.K = K, c.V = V;
    c.Kc = 4, c.eps = 1e-6f, c.chunk = 64, c.threads = 0, c.keep = GDN_LAYER_KEEP_MIN;
    c.check_finite = 1;
    return c;
}

int64_t gdn_layer_conv_dim(const gdn_layer_config *c) { return 2 * c->Hk * c->K + c->Hv * c->V; }

int gdn_layer_config_check(const gdn_layer_config *c) {
    if (!c) return gdn_fail(GDN_ERR_ARG, "layer config is NULL");
    const struct { const char *name; int64_t v, max; } dims[] = {
        {"B", c->B, (int64_t)1 << 31},  {"T", c->T, (int64_t)1 << 40},
        {"E", c->E, (int64_t)1 << 20},  {"Hk", c->Hk, 1 << 16},
        {"Hv", c->Hv, 1 << 16},         {"K", c->K, GDN_MAX_HEAD_DIM},
        {"V", c->V, GDN_MAX_HEAD_DIM},  {"Kc", c->Kc, GDN_MAX_CONV},
    };
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        if (dims[i].v < 1 || dims[i].v > dims[i].max)
            return gdn_fail(GDN_ERR_SHAPE, "layer %s = %lld is out of range [1, %lld]", dims[i].name,
                            (long long)dims[i].v, (long long)dims[i].max);
    if (c->Hv % c->Hk)
        return gdn_fail(GDN_ERR_SHAPE, "layer Hv = %lld is not a multiple of Hk = %lld",
                        (long long)c->Hv, (long long)c->Hk);
    if (!(c->eps > 0.0f) || !isfinite(c->eps))
        return gdn_fail(GDN_ERR_ARG, "layer eps = %g must be positive and finite", (double)c->eps);
    if (c->chunk != 0 && c->chunk != 16 && c->chunk != 32 && c->chunk != 64 && c->chunk != 128)
        return gdn_fail(GDN_ERR_ARG, "layer chunk = %d (want 16, 32, 64 or 128)", c->chunk);
    if (c->keep != GDN_LAYER_KEEP_MIN && c->keep != GDN_LAYER_KEEP_PROJ)
        return gdn_fail(GDN_ERR_ARG, "layer keep = %d (want GDN_LAYER_KEEP_MIN or _PROJ)", c->keep);
    if (c->threads < 0) return gdn_fail(GDN_ERR_ARG, "layer threads = %d is negative", c->threads);
    if (c->weight_dtype != GDN_F32 && c->weight_dtype != GDN_BF16)
        return gdn_fail(GDN_ERR_DTYPE, "layer weight_dtype = %d (want GDN_F32 or GDN_BF16)", c->weight_dtype);
    if (!gdn_compute_name(c->compute))
        return gdn_fail(GDN_ERR_ARG, "layer compute = %d (want GDN_COMPUTE_FP32 or GDN_COMPUTE_BF16)", c->compute);
    if (c->cp < GDN_CP_SCAN || c->cp > GDN_CP_HEADS)
        return gdn_fail(GDN_ERR_ARG, "layer cp = %d (want a CP strategy: GDN_CP_SCAN, _ALLGATHER, _RELAY or _HEADS)", c->cp);
    /* Every per-token row count must fit the int-sized leading dimensions of the GEMMs. */
    if (gdn_layer_conv_dim(c) > INT32_MAX / 2)
        return gdn_fail(GDN_ERR_SHAPE, "layer conv_dim = %lld is too large", (long long)gdn_layer_conv_dim(c));
    return GDN_OK;
}

static const char *const param_names[GDN_P_COUNT] = {
    "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
    "conv1d.weight",      "A_log",            "dt_bias",          "norm.weight",
    "out_proj.weight",
};

const char *gdn_layer_param_name(int which) {
    return which >= 0 && which < GDN_P_COUNT ? param_names[which] : NULL;
}

int gdn_layer_param_shape(const gdn_layer_config *c, int which, int64_t shape[3]) {
    const int64_t cd = gdn_layer_conv_dim(c), vd = c->Hv * c->V;
    switch (which) {
    case GDN_P_IN_PROJ_QKV: shape[0] = cd, shape[1] = c->E; return 2;
    case GDN_P_IN_PROJ_Z: shape[0] = vd, shape[1] = c->E; return 2;
    case GDN_P_IN_PROJ_B:
    case GDN_P_IN_PROJ_A: shape[0] = c->Hv, shape[1] = c->E; return 2;
    case GDN_P_CONV1D: shape[0] = cd, shape[1] = 1, shape[2] = c->Kc; return 3;
    case GDN_P_A_LOG:
    case GDN_P_DT_BIAS: shape[0] = c->Hv; return 1;
    case GDN_P_NORM: shape[0] = c->V; return 1;
    case GDN_P_OUT_PROJ: shape[0] = c->E, shape[1] = vd; return 2;
    default: return 0;
    }
}

size_t gdn_layer_param_numel(const gdn_layer_config *c, int which) {
    int64_t shape[3];
    const int nd = gdn_layer_param_shape(c, which, shape);
    return gdn_param_numel(shape, nd);
}

size_t gdn_layer_param_offset(const gdn_layer_config *c, int which) {
    size_t off = 0;
    for (int i = 0; i < which && i < GDN_P_COUNT; i++) off += gdn_param_padded(gdn_layer_param_numel(c, i));
    return off;
}

int gdn_layer_param(const gdn_layer_config *c, int which, gdn_param_info *info) {
    if (!c || !info) return gdn_fail(GDN_ERR_ARG, "gdn_layer_param: config or info is NULL");
    if (which < 0 || which >= GDN_P_COUNT)
        return gdn_fail(GDN_ERR_ARG, "layer parameter %d is out of range [0, %d)", which, GDN_P_COUNT);
    memset(info, 0, sizeof *info);
    info->name = param_names[which];
    info->ndim = gdn_layer_param_shape(c, which, info->shape);
    info->offset = gdn_layer_param_offset(c, which);
    info->numel = gdn_layer_param_numel(c, which);
    return GDN_OK;
}

size_t gdn_layer_param_floats(const gdn_layer_config *c) {
    return gdn_layer_param_offset(c, GDN_P_COUNT);
}
