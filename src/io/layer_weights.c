/* One GatedDeltaNet layer's weights from a Hugging Face safetensors checkpoint (DESIGN §5).
 *
 * Layouts: Qwen3.5's split one (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) or Qwen3-Next's
 * fused one (in_proj_qkvz, in_proj_ba), whose rows are interleaved per key head h, with
 * r = Hv / Hk (transformers' Qwen3NextGatedDeltaNet.fix_query_key_value_ordering):
 *     in_proj_qkvz: for h = 0..Hk-1: [q of key head h (K) | k of key head h (K) |
 *                                     v of value heads h*r..h*r+r-1 (r*V) | z of those (r*V)]
 *     in_proj_ba:   for h = 0..Hk-1: [b of value heads h*r.. (r) | a of those (r)]
 * Fused files are converted to the split layout on load, and gradients are written back in the
 * fused order (fused_row() is the one map both directions use).
 *
 * Dimensions: config.json, then the file's __metadata__, then the caller's `given`, then the
 * tensor shapes; every source that states a value must agree with the others (dim_state()). */
#include "base.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { D_E, D_HK, D_HV, D_K, D_V, D_KC, D_COUNT };

static const struct {
    const char *name;   /* our name, also the __metadata__ key */
    const char *config; /* config.json field */
    int64_t max;
} dim_info[D_COUNT] = {
    {"E", "hidden_size", (int64_t)1 << 20},
    {"Hk", "linear_num_key_heads", 1 << 16},
    {"Hv", "linear_num_value_heads", 1 << 16},
    {"K", "linear_key_head_dim", GDN_MAX_HEAD_DIM},
    {"V", "linear_value_head_dim", GDN_MAX_HEAD_DIM},
    {"Kc", "linear_conv_kernel_dim", GDN_MAX_CONV},
};

#define SRC_LEN 512

typedef struct {
    int64_t v[D_COUNT];
    char src[D_COUNT][SRC_LEN]; /* who stated v (empty: nobody yet) */
    float eps;
    char eps_src[SRC_LEN];
} dims;

/* A source states dimension d = value: record it, or check it against an earlier statement. */
static int dim_state(dims *ds, int d, int64_t value, const char *source) {
    if (value < 1 || value > dim_info[d].max)
        return gdn_fail(GDN_ERR_SHAPE, "%s = %lld: %s is out of range [1, %lld]", source,
                        (long long)value, dim_info[d].name, (long long)dim_info[d].max);
    if (ds->src[d][0]) {
        if (ds->v[d] != value)
            return gdn_fail(GDN_ERR_SHAPE, "%s disagrees: %s = %lld but %s = %lld",
                            dim_info[d].name, ds->src[d], (long long)ds->v[d], source,
                            (long long)value);
        return GDN_OK;
    }
    ds->v[d] = value;
    snprintf(ds->src[d], SRC_LEN, "%s", source);
    return GDN_OK;
}

static int eps_state(dims *ds, double value, const char *source) {
    if (!(value > 0.0) || !isfinite(value) || !isfinite((float)value) || (float)value <= 0.0f)
        return gdn_fail(GDN_ERR_SHAPE, "%s = %g: rms_norm_eps must be positive and finite", source,
                        value);
    const float e = (float)value;
    if (ds->eps_src[0]) {
        if (fabsf(ds->eps - e) > 1e-6f * fmaxf(ds->eps, e))
            return gdn_fail(GDN_ERR_SHAPE, "rms_norm_eps disagrees: %s = %g but %s = %g",
                            ds->eps_src, (double)ds->eps, source, value);
        return GDN_OK;
    }
    ds->eps = e;
    snprintf(ds->eps_src, SRC_LEN, "%s", source);
    return GDN_OK;
}

/* ------------------------------------------------------------------ the sources */

static int dims_from_config(dims *ds, const char *config_path) {
    FILE *fp = fopen(config_path, "rb");
    if (!fp) return gdn_fail(GDN_ERR_IO, "%s: cannot open: %s", config_path, strerror(errno));
    json_error_t err;
    json_t *root = json_loadf(fp, 0, &err);
    fclose(fp);
    if (!root)
        return gdn_fail(GDN_ERR_FORMAT, "%s: invalid JSON at line %d column %d: %s", config_path,
                        err.line, err.column, err.text);
    int rc = GDN_OK;
    json_t *obj = root;
    const char *where = "";
    if (!json_is_object(root)) {
        rc = gdn_fail(GDN_ERR_FORMAT, "%s: config is not a JSON object", config_path);
        goto done;
    }
    /* A multimodal config (Qwen3.5 VL) keeps the text model's fields under "text_config". */
    int top = 0;
    for (int d = 0; d < D_COUNT; d++)
        if (d != D_E && json_object_get(root, dim_info[d].config)) top = 1;
    json_t *tc = json_object_get(root, "text_config");
    if (!top && json_is_object(tc)) obj = tc, where = "text_config.";

    int stated = 0;
    char source[SRC_LEN];
    for (int d = 0; d < D_COUNT && !rc; d++) {
        json_t *v = json_object_get(obj, dim_info[d].config);
        if (!v || json_is_null(v)) continue;
        if (!json_is_integer(v)) {
            rc = gdn_fail(GDN_ERR_FORMAT, "%s: field '%s%s' is not an integer", config_path, where,
                          dim_info[d].config);
            break;
        }
        snprintf(source, sizeof source, "%s %s%s", config_path, where, dim_info[d].config);
        rc = dim_state(ds, d, (int64_t)json_integer_value(v), source);
        stated++;
    }
    json_t *e = json_object_get(obj, "rms_norm_eps");
    if (!rc && e && !json_is_null(e)) {
        if (!json_is_number(e)) {
            rc = gdn_fail(GDN_ERR_FORMAT, "%s: field '%srms_norm_eps' is not a number", config_path,
                          where);
        } else {
            snprintf(source, sizeof source, "%s %srms_norm_eps", config_path, where);
            rc = eps_state(ds, json_number_value(e), source);
        }
    }
    if (!rc && !stated)
        rc = gdn_fail(GDN_ERR_FORMAT,
                      "%s: no GatedDeltaNet field (linear_num_key_heads, linear_key_head_dim, "
                      "linear_num_value_heads, linear_value_head_dim, linear_conv_kernel_dim, "
                      "hidden_size) at the top level or under text_config",
                      config_path);
done:
    json_decref(root);
    return rc;
}

static int dims_from_metadata(dims *ds, gdn_st_file *f, const char *path) {
    char source[SRC_LEN];
    for (int d = 0; d < D_COUNT; d++) {
        const char *s = gdn_st_metadata(f, dim_info[d].name);
        if (!s) continue;
        char *end;
        errno = 0;
        long long v = strtoll(s, &end, 10);
        if (end == s || *end || errno)
            return gdn_fail(GDN_ERR_FORMAT, "%s: __metadata__ %s = '%s' is not an integer", path,
                            dim_info[d].name, s);
        snprintf(source, sizeof source, "%s __metadata__ %s", path, dim_info[d].name);
        int rc = dim_state(ds, d, v, source);
        if (rc) return rc;
    }
    const char *s = gdn_st_metadata(f, "rms_norm_eps");
    if (s) {
        char *end;
        double v = strtod(s, &end);
        if (end == s || *end)
            return gdn_fail(GDN_ERR_FORMAT, "%s: __metadata__ rms_norm_eps = '%s' is not a number",
                            path, s);
        snprintf(source, sizeof source, "%s __metadata__ rms_norm_eps", path);
        return eps_state(ds, v, source);
    }
    return GDN_OK;
}

static int dims_from_given(dims *ds, const gdn_layer_config *g) {
    const int64_t v[D_COUNT] = {g->E, g->Hk, g->Hv, g->K, g->V, g->Kc};
    char source[SRC_LEN];
    for (int d = 0; d < D_COUNT; d++) {
        if (v[d] <= 0) continue;
        snprintf(source, sizeof source, "the given %s", dim_info[d].name);
        int rc = dim_state(ds, d, v[d], source);
        if (rc) return rc;
    }
    return g->eps > 0.0f ? eps_state(ds, g->eps, "the given eps") : GDN_OK;
}

/* ------------------------------------------------------------------ the tensors */

/* The weights a file may hold under the prefix: the split ones in gdn_layer_param order, then
 * the two fused projections. */
enum { W_QKVZ = GDN_P_COUNT, W_BA, W_COUNT };

static const char *weight_name(int i) {
    return i < GDN_P_COUNT ? gdn_layer_param_name(i) : i == W_QKVZ ? "in_proj_qkvz.weight"
                                                                   : "in_proj_ba.weight";
}

static int is_split_only(int i) { return i <= GDN_P_IN_PROJ_A; }
static int is_fused_only(int i) { return i >= W_QKVZ; }

static int weight_ndim(int i) {
    switch (i) {
    case GDN_P_CONV1D: return 3;
    case GDN_P_A_LOG:
    case GDN_P_DT_BIAS:
    case GDN_P_NORM: return 1;
    default: return 2;
    }
}

/* The shape a weight must have under cfg. */
static int weight_shape(const gdn_layer_config *c, int i, int64_t shape[3]) {
    if (i < GDN_P_COUNT) return gdn_layer_param_shape(c, i, shape);
    shape[0] = i == W_QKVZ ? 2 * c->Hk * c->K + 2 * c->Hv * c->V : 2 * c->Hv;
    shape[1] = c->E;
    return 2;
}

static void shape_str(char *buf, size_t n, int ndim, const int64_t *shape) {
    size_t used = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < ndim && used < n; i++)
        used += (size_t)snprintf(buf + used, n - used, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (used < n) snprintf(buf + used, n - used, "]");
}

/* Row `row` of a fused tensor (W_QKVZ or W_BA) is row *dst_row of split parameter *dst. */
static void fused_row(const gdn_layer_config *c, int which, int64_t row, int *dst, int64_t *dst_row) {
    const int64_t r = c->Hv / c->Hk, K = c->K, V = c->V;
    if (which == W_QKVZ) {
        const int64_t per = 2 * K + 2 * r * V, h = row / per, i = row % per;
        if (i < K) *dst = GDN_P_IN_PROJ_QKV, *dst_row = h * K + i;
        else if (i < 2 * K) *dst = GDN_P_IN_PROJ_QKV, *dst_row = c->Hk * K + h * K + (i - K);
        else if (i < 2 * K + r * V)
            *dst = GDN_P_IN_PROJ_QKV, *dst_row = 2 * c->Hk * K + h * r * V + (i - 2 * K);
        else *dst = GDN_P_IN_PROJ_Z, *dst_row = h * r * V + (i - 2 * K - r * V);
    } else {
        const int64_t h = row / (2 * r), i = row % (2 * r);
        if (i < r) *dst = GDN_P_IN_PROJ_B, *dst_row = h * r + i;
        else *dst = GDN_P_IN_PROJ_A, *dst_row = h * r + (i - r);
    }
}

/* If the file holds a layer under some other prefix, name it (for the "nothing found" error). */
static void prefix_hint(const gdn_st_file *f, char *buf, size_t n) {
    buf[0] = 0;
    for (int i = 0; i < gdn_st_count(f); i++) {
        const char *name = gdn_st_at(f, i)->name;
        for (int w = GDN_P_IN_PROJ_QKV; w <= W_QKVZ; w += W_QKVZ - GDN_P_IN_PROJ_QKV) {
            const char *wn = weight_name(w);
            const size_t ln = strlen(name), lw = strlen(wn);
            if (ln >= lw && !strcmp(name + ln - lw, wn) && (ln == lw || name[ln - lw - 1] == '.')) {
                snprintf(buf, n, " (it has '%s': prefix '%.*s'?)", name, (int)(ln - lw), name);
                return;
            }
        }
    }
}

/* Find the layer's tensors under the prefix: found[w] (NULL when absent), *fused. */
static int find_weights(gdn_st_file *f, const char *path, const char *prefix,
                        const gdn_st_tensor *found[W_COUNT], int *fused) {
    const size_t plen = strlen(prefix);
    int nfound = 0;
    const char *extra = NULL, *bias = NULL;
    for (int i = 0; i < gdn_st_count(f); i++) {
        const gdn_st_tensor *t = gdn_st_at(f, i);
        if (strncmp(t->name, prefix, plen)) continue;
        const char *suffix = t->name + plen;
        int w = 0;
        while (w < W_COUNT && strcmp(suffix, weight_name(w))) w++;
        if (w < W_COUNT) found[w] = t, nfound++;
        else if (!strcmp(suffix, "conv1d.bias")) bias = t->name;
        else if (!extra) extra = t->name;
    }
    if (!nfound) {
        char hint[SRC_LEN];
        prefix_hint(f, hint, sizeof hint);
        return gdn_fail(GDN_ERR_MISSING,
                        "%s: no GatedDeltaNet weights under the prefix '%s' (no '%sin_proj_qkv.weight' "
                        "or '%sin_proj_qkvz.weight')%s",
                        path, prefix, prefix, prefix, hint);
    }
    if (bias)
        return gdn_fail(GDN_ERR_FORMAT,
                        "%s: unexpected weight '%s': Qwen's GatedDeltaNet conv1d has no bias", path,
                        bias);
    if (extra)
        return gdn_fail(GDN_ERR_FORMAT, "%s: unexpected (extra) weight '%s' under the prefix '%s'",
                        path, extra, prefix);
    int split_w = -1, fused_w = -1;
    for (int w = 0; w < W_COUNT; w++) {
        if (!found[w]) continue;
        if (is_split_only(w) && split_w < 0) split_w = w;
        if (is_fused_only(w) && fused_w < 0) fused_w = w;
    }
    if (split_w >= 0 && fused_w >= 0)
        return gdn_fail(GDN_ERR_FORMAT,
                        "%s: mixed layouts: '%s' (split, Qwen3.5) and '%s' (fused, Qwen3-Next) are "
                        "both present",
                        path, found[split_w]->name, found[fused_w]->name);
    *fused = fused_w >= 0;
    for (int w = 0; w < W_COUNT; w++) {
        const int needed = *fused ? !is_split_only(w) : !is_fused_only(w);
        if (needed && !found[w])
            return gdn_fail(GDN_ERR_MISSING, "%s: missing weight '%s%s' (%s layout)", path, prefix,
                            weight_name(w), *fused ? "fused Qwen3-Next" : "split Qwen3.5");
    }
    for (int w = 0; w < W_COUNT; w++) {
        const gdn_st_tensor *t = found[w];
        if (!t) continue;
        if (t->dtype == GDN_DTYPE_OTHER)
            return gdn_fail(GDN_ERR_DTYPE, "%s: weight '%s' is %s; only F32, F64 and BF16 are read",
                            path, t->name, t->dtype_name);
        if (t->ndim != weight_ndim(w)) {
            char s[128];
            shape_str(s, sizeof s, t->ndim, t->shape);
            return gdn_fail(GDN_ERR_SHAPE, "%s: weight '%s' has %d dims %s, want %d", path, t->name,
                            t->ndim, s, weight_ndim(w));
        }
    }
    return GDN_OK;
}

/* The dims the shapes show directly, then Hk and K from the conv's row count. */
static int dims_from_shapes(dims *ds, const gdn_st_tensor *found[W_COUNT], int fused) {
    char source[SRC_LEN];
#define STATE(d, w, axis, value)                                                               \
    do {                                                                                       \
        snprintf(source, sizeof source, "'%s' shape[%d]%s", found[w]->name, axis,              \
                 (int)(w) == (int)W_BA ? " / 2" : "");                                                    \
        int rc_ = dim_state(ds, d, value, source);                                             \
        if (rc_) return rc_;                                                                   \
    } while (0)
    STATE(D_HV, GDN_P_A_LOG, 0, found[GDN_P_A_LOG]->shape[0]);
    STATE(D_HV, GDN_P_DT_BIAS, 0, found[GDN_P_DT_BIAS]->shape[0]);
    STATE(D_V, GDN_P_NORM, 0, found[GDN_P_NORM]->shape[0]);
    STATE(D_KC, GDN_P_CONV1D, 2, found[GDN_P_CONV1D]->shape[2]);
    STATE(D_E, GDN_P_OUT_PROJ, 0, found[GDN_P_OUT_PROJ]->shape[0]);
    if (fused) {
        if (found[W_BA]->shape[0] % 2)
            return gdn_fail(GDN_ERR_SHAPE, "'%s' has %lld rows, not 2*Hv (an even number)",
                            found[W_BA]->name, (long long)found[W_BA]->shape[0]);
        STATE(D_HV, W_BA, 0, found[W_BA]->shape[0] / 2);
        STATE(D_E, W_QKVZ, 1, found[W_QKVZ]->shape[1]);
    } else {
        STATE(D_HV, GDN_P_IN_PROJ_B, 0, found[GDN_P_IN_PROJ_B]->shape[0]);
        STATE(D_E, GDN_P_IN_PROJ_QKV, 1, found[GDN_P_IN_PROJ_QKV]->shape[1]);
    }
#undef STATE
    /* value_dim = Hv V: out_proj's columns (and in_proj_z's rows) must agree with Hv and V. */
    const int64_t hvv = ds->v[D_HV] * ds->v[D_V];
    const gdn_st_tensor *vt[2] = {found[GDN_P_OUT_PROJ], fused ? NULL : found[GDN_P_IN_PROJ_Z]};
    for (int i = 0; i < 2; i++)
        if (vt[i] && vt[i]->shape[i ? 0 : 1] != hvv)
            return gdn_fail(GDN_ERR_SHAPE,
                            "'%s' shape[%d] = %lld is not Hv*V = %lld (Hv = %lld from %s; V = %lld "
                            "from %s)",
                            vt[i]->name, i ? 0 : 1, (long long)vt[i]->shape[i ? 0 : 1],
                            (long long)hvv, (long long)ds->v[D_HV], ds->src[D_HV],
                            (long long)ds->v[D_V], ds->src[D_V]);
    /* conv_dim = 2 Hk K + Hv V: the shapes give only the product Hk K. */
    const gdn_st_tensor *conv = found[GDN_P_CONV1D];
    const int64_t hkk2 = conv->shape[0] - hvv;
    if (hkk2 < 2 || hkk2 % 2)
        return gdn_fail(GDN_ERR_SHAPE,
                        "'%s' has %lld rows, which is not 2*Hk*K + Hv*V for any Hk, K >= 1 "
                        "(Hv*V = %lld)",
                        conv->name, (long long)conv->shape[0],
                        (long long)hvv);
    const int64_t hkk = hkk2 / 2;
    const int has_hk = ds->src[D_HK][0] != 0, has_k = ds->src[D_K][0] != 0;
    if (!has_hk && !has_k)
        return gdn_fail(GDN_ERR_SHAPE,
                        "cannot tell Hk from K: the shapes give only Hk*K = %lld; state one of them "
                        "(config.json linear_num_key_heads or linear_key_head_dim, __metadata__ Hk "
                        "or K, or the given Hk or K, e.g. --Hk / --K)",
                        (long long)hkk);
    const int known = has_hk ? D_HK : D_K, other = has_hk ? D_K : D_HK;
    if (hkk % ds->v[known])
        return gdn_fail(GDN_ERR_SHAPE,
                        "'%s' has %lld rows, so Hk*K = %lld, which %s = %lld does not divide",
                        conv->name, (long long)conv->shape[0], (long long)hkk, ds->src[known],
                        (long long)ds->v[known]);
    snprintf(source, sizeof source, "Hk*K from '%s' rows (%lld = 2*Hk*K + Hv*V) / %s (%lld)",
             conv->name, (long long)conv->shape[0], dim_info[known].name,
             (long long)ds->v[known]);
    return dim_state(ds, other, hkk / ds->v[known], source);
}

/* Read one fused tensor and scatter its rows into the split parameters of lw->w. */
static int read_fused(gdn_st_file *f, const gdn_st_tensor *t, int which, gdn_layer_weights *lw) {
    const int64_t rows = t->shape[0], E = t->shape[1];
    float *tmp = malloc((size_t)(rows * E) * sizeof *tmp + 1);
    if (!tmp) return gdn_fail(GDN_ERR_NOMEM, "reading '%s'", t->name);
    int rc = gdn_st_read_f32(f, t->name, tmp, (size_t)(rows * E));
    for (int64_t i = 0; i < rows && !rc; i++) {
        int dst;
        int64_t dr;
        fused_row(&lw->cfg, which, i, &dst, &dr);
        memcpy(lw->w + gdn_layer_param_offset(&lw->cfg, dst) + dr * E, tmp + i * E,
               (size_t)E * sizeof *tmp);
    }
    free(tmp);
    return rc;
}

static int load(gdn_layer_weights *lw, gdn_st_file *f, const char *path, const char *config_path,
                const char *prefix, const gdn_layer_config *given) {
    dims ds;
    memset(&ds, 0, sizeof ds);
    int rc = GDN_OK;
    if (config_path && (rc = dims_from_config(&ds, config_path))) return rc;
    if ((rc = dims_from_metadata(&ds, f, path))) return rc;
    if (given && (rc = dims_from_given(&ds, given))) return rc;
    const gdn_st_tensor *found[W_COUNT] = {0};
    int fused = 0;
    if ((rc = find_weights(f, path, prefix, found, &fused))) return rc;
    if ((rc = dims_from_shapes(&ds, found, fused))) return rc;

    gdn_layer_config c = gdn_layer_config_default(1, 1, ds.v[D_E], ds.v[D_HK], ds.v[D_HV],
                                                  ds.v[D_K], ds.v[D_V]);
    c.Kc = ds.v[D_KC];
    if (ds.eps_src[0]) c.eps = ds.eps;
    if ((rc = gdn_layer_config_check(&c))) return rc;
    c.B = c.T = 0;
    lw->cfg = c;

    /* Every weight's whole shape, now that the dims are known. */
    for (int w = 0; w < W_COUNT; w++) {
        const gdn_st_tensor *t = found[w];
        if (!t) continue;
        int64_t want[3];
        const int nd = weight_shape(&c, w, want);
        int same = nd == t->ndim;
        for (int i = 0; i < nd && same; i++) same = want[i] == t->shape[i];
        if (!same) {
            char s[128], s2[128];
            shape_str(s, sizeof s, t->ndim, t->shape);
            shape_str(s2, sizeof s2, nd, want);
            return gdn_fail(GDN_ERR_SHAPE,
                            "%s: weight '%s' has shape %s but the layer (E=%lld Hk=%lld Hv=%lld "
                            "K=%lld V=%lld Kc=%lld) needs %s",
                            path, t->name, s, (long long)c.E, (long long)c.Hk, (long long)c.Hv,
                            (long long)c.K, (long long)c.V, (long long)c.Kc, s2);
        }
    }

    const size_t n = gdn_layer_param_floats(&c);
    lw->w = calloc(n, sizeof *lw->w);
    if (!lw->w) return gdn_fail(GDN_ERR_NOMEM, "layer weights (%zu floats)", n);
    lw->fused = fused;
    lw->dtype = found[fused ? W_QKVZ : GDN_P_IN_PROJ_QKV]->dtype;
    for (int w = 0; w < W_COUNT && !rc; w++) {
        if (!found[w]) continue;
        if (w >= GDN_P_COUNT) rc = read_fused(f, found[w], w, lw);
        else
            rc = gdn_st_read_f32(f, found[w]->name, lw->w + gdn_layer_param_offset(&c, w),
                                 gdn_layer_param_numel(&c, w));
    }
    return rc;
}

int gdn_layer_weights_load(gdn_layer_weights *lw, const char *path, const char *config_path,
                           const char *prefix, const gdn_layer_config *given) {
    if (!lw || !path) return gdn_fail(GDN_ERR_ARG, "layer weights load: NULL argument");
    memset(lw, 0, sizeof *lw);
    gdn_st_file *f = NULL;
    int rc = gdn_st_open(&f, path);
    if (rc) return rc;
    rc = load(lw, f, path, config_path, prefix ? prefix : "", given);
    gdn_st_close(f);
    if (rc) gdn_layer_weights_free(lw);
    return rc;
}

void gdn_layer_weights_free(gdn_layer_weights *lw) {
    if (!lw) return;
    free(lw->w);
    free(lw->w_bf16);
    memset(lw, 0, sizeof *lw);
}

int gdn_layer_weights_to_bf16(gdn_layer_weights *lw) {
    if (!lw || !lw->w) return gdn_fail(GDN_ERR_ARG, "no fp32 layer weights to convert");
    const size_t n = gdn_layer_param_floats(&lw->cfg);
    uint16_t *h = malloc(sizeof(uint16_t) * (n ? n : 1));
    if (!h) return gdn_fail(GDN_ERR_NOMEM, "BF16 layer weights (%zu values)", n);
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &lw->w[i], 4);
        if ((u & 0x7F800000u) == 0x7F800000u) h[i] = (uint16_t)((u >> 16) | ((u & 0xFFFFu) ? 0x40 : 0)); /* Inf, NaN stays NaN */
        else h[i] = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16); /* round to nearest even */
    }
    free(lw->w);
    lw->w = NULL, lw->w_bf16 = h, lw->cfg.weight_dtype = GDN_BF16;
    return GDN_OK;
}

const void *gdn_layer_weights_data(const gdn_layer_weights *lw) {
    if (!lw) return NULL;
    return lw->cfg.weight_dtype == GDN_BF16 ? (const void *)lw->w_bf16 : (const void *)lw->w;
}

static int add_one(gdn_st_writer *wr, const char *name_prefix, const char *name, int ndim,
                   const int64_t *shape, const float *data) {
    const size_t len = strlen(name_prefix) + strlen(name) + 1;
    char *full = malloc(len);
    if (!full) return gdn_fail(GDN_ERR_NOMEM, "gradient name");
    snprintf(full, len, "%s%s", name_prefix, name);
    const int rc = gdn_st_writer_add_f32(wr, full, GDN_F32, ndim, shape, data);
    free(full);
    return rc;
}

int gdn_layer_grads_add(gdn_st_writer *wr, const gdn_layer_weights *lw, const float *dw,
                        const char *name_prefix) {
    if (!wr || !lw) return gdn_fail(GDN_ERR_ARG, "layer grads add: NULL argument");
    if (!name_prefix) name_prefix = "";
    gdn_layer_config c = lw->cfg;
    c.B = c.T = 1;
    int rc = gdn_layer_config_check(&c);
    if (rc) return rc;
    int64_t shape[3];
    for (int w = 0; w < W_COUNT && !rc; w++) {
        if (lw->fused ? is_split_only(w) : is_fused_only(w)) continue;
        const int nd = weight_shape(&c, w, shape);
        if (w < GDN_P_COUNT) {
            rc = add_one(wr, name_prefix, weight_name(w), nd, shape,
                         dw ? dw + gdn_layer_param_offset(&c, w) : NULL);
            continue;
        }
        if (!dw) { /* reserved: written later at its offset */
            rc = add_one(wr, name_prefix, weight_name(w), nd, shape, NULL);
            continue;
        }
        /* Gather the split gradients back into the fused, interleaved order. */
        const int64_t rows = shape[0], E = shape[1];
        float *tmp = malloc((size_t)(rows * E) * sizeof *tmp);
        if (!tmp) return gdn_fail(GDN_ERR_NOMEM, "gradient of '%s'", weight_name(w));
        for (int64_t i = 0; i < rows; i++) {
            int src;
            int64_t sr;
            fused_row(&c, w, i, &src, &sr);
            memcpy(tmp + i * E, dw + gdn_layer_param_offset(&c, src) + sr * E,
                   (size_t)E * sizeof *tmp);
        }
        rc = add_one(wr, name_prefix, weight_name(w), nd, shape, tmp);
        free(tmp);
    }
    return rc;
}
