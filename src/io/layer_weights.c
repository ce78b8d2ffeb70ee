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
#include "loader_common.h"

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

#define SRC_LEN GDN_IO_SRC_LEN

typedef struct {
    gdn_io_dim d[D_COUNT];
    gdn_io_eps eps;
} dims;

/* A source states dimension d = value: record it, or check it against an earlier statement. */
static int dim_state(dims *ds, int d, int64_t value, const char *source) {
    return gdn_io_dim_state(&ds->d[d], dim_info[d].name, dim_info[d].max, value, source);
}

/* ------------------------------------------------------------------ the sources */

static int dims_from_config(dims *ds, const char *config_path) {
    json_t *root = NULL;
    int rc = gdn_io_config_load(config_path, &root);
    if (rc) return rc;
    /* A multimodal config (Qwen3.5 VL) keeps the text model's fields under "text_config"; the
     * top level counts when it has any GatedDeltaNet field (hidden_size alone is everyone's). */
    const char *fields[D_COUNT - 1], *where;
    for (int d = 1; d < D_COUNT; d++) fields[d - 1] = dim_info[d].config;
    json_t *obj = gdn_io_config_section(root, fields, D_COUNT - 1, &where);
    int stated = 0, present;
    char source[SRC_LEN];
    for (int d = 0; d < D_COUNT && !rc; d++) {
        int64_t v;
        if ((rc = gdn_io_config_int(obj, config_path, where, dim_info[d].config, &v, &present)) || !present)
            continue;
        snprintf(source, sizeof source, "%s %s%s", config_path, where, dim_info[d].config);
        rc = dim_state(ds, d, v, source);
        stated++;
    }
    double e;
    if (!rc && !(rc = gdn_io_config_number(obj, config_path, where, "rms_norm_eps", &e, &present)) && present) {
        snprintf(source, sizeof source, "%s %srms_norm_eps", config_path, where);
        rc = gdn_io_eps_state(&ds->eps, e, source);
    }
    if (!rc && !stated)
        rc = gdn_fail(GDN_ERR_FORMAT,
                      "%s: no GatedDeltaNet field (linear_num_key_heads, linear_key_head_dim, "
                      "linear_num_value_heads, linear_value_head_dim, linear_conv_kernel_dim, "
                      "hidden_size) at the top level or under text_config",
                      config_path);
    json_decref(root);
    return rc;
}

static int dims_from_metadata(dims *ds, gdn_st_file *f, const char *path) {
    char source[SRC_LEN];
    int present, rc = GDN_OK;
    for (int d = 0; d < D_COUNT && !rc; d++) {
        int64_t v;
        if ((rc = gdn_io_metadata_int(f, path, dim_info[d].name, &v, &present)) || !present) continue;
        snprintf(source, sizeof source, "%s __metadata__ %s", path, dim_info[d].name);
        rc = dim_state(ds, d, v, source);
    }
    double e;
    if (!rc && !(rc = gdn_io_metadata_number(f, path, "rms_norm_eps", &e, &present)) && present) {
        snprintf(source, sizeof source, "%s __metadata__ rms_norm_eps", path);
        rc = gdn_io_eps_state(&ds->eps, e, source);
    }
    return rc;
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
    return g->eps > 0.0f ? gdn_io_eps_state(&ds->eps, g->eps, "the given eps") : GDN_OK;
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

const char *gdn_layer_fused_name(int fused) {
    return fused == GDN_FUSED_QKVZ || fused == GDN_FUSED_BA ? weight_name(W_QKVZ + fused) : NULL;
}

int64_t gdn_layer_fused_rows(const gdn_layer_config *c, int fused) {
    if (!c || !gdn_layer_fused_name(fused)) return 0;
    int64_t shape[3];
    weight_shape(c, W_QKVZ + fused, shape);
    return shape[0];
}

int gdn_layer_fused(const gdn_layer_config *c, int fused, gdn_param_info *info) {
    if (!c || !info) return gdn_fail(GDN_ERR_ARG, "gdn_layer_fused: config or info is NULL");
    memset(info, 0, sizeof *info);
    if (!gdn_layer_fused_name(fused))
        return gdn_fail(GDN_ERR_ARG, "gdn_layer_fused: %d is neither GDN_FUSED_QKVZ nor GDN_FUSED_BA", fused);
    info->name = gdn_layer_fused_name(fused);
    info->ndim = 2;
    info->shape[0] = gdn_layer_fused_rows(c, fused), info->shape[1] = c->E;
    info->numel = (size_t)(info->shape[0] * info->shape[1]);
    return GDN_OK;
}

/* Copy the fused tensor's rows to (to_split) or from the split parameters. */
static int move_fused(const gdn_layer_config *c, int fused, float *split, float *tensor, int to_split) {
    if (!c || !split || !tensor || !gdn_layer_fused_name(fused))
        return gdn_fail(GDN_ERR_ARG, "layer (un)fuse: NULL argument or fused tensor %d is not GDN_FUSED_QKVZ or GDN_FUSED_BA",
                        fused);
    gdn_layer_config k = *c;
    k.B = k.T = 1;
    const int rc = gdn_layer_config_check(&k);
    if (rc) return rc;
    const int64_t rows = gdn_layer_fused_rows(c, fused), E = c->E;
    /* the mistake a reader of Qwen3-Next files makes: the fused rows taken as [q; k; v; z] and
     * [b; a] concatenated, not interleaved per key head (the loaders' tests must catch it) */
    const int concatenated = to_split && gdn_test_mutate("layer io: fused rows read as concatenated (not interleaved)");
    const int64_t first_rows = fused == GDN_FUSED_QKVZ ? 2 * c->Hk * c->K + c->Hv * c->V : c->Hv;
    for (int64_t i = 0; i < rows; i++) {
        int p;
        int64_t pr;
        fused_row(c, W_QKVZ + fused, i, &p, &pr);
        if (concatenated) {
            const int first = i < first_rows;
            p = fused == GDN_FUSED_QKVZ ? (first ? GDN_P_IN_PROJ_QKV : GDN_P_IN_PROJ_Z)
                                        : (first ? GDN_P_IN_PROJ_B : GDN_P_IN_PROJ_A);
            pr = first ? i : i - first_rows;
        }
        float *s = split + gdn_layer_param_offset(c, p) + pr * E, *t = tensor + i * E;
        memcpy(to_split ? s : t, to_split ? t : s, (size_t)E * sizeof *s);
    }
    return GDN_OK;
}
int gdn_layer_unfuse(const gdn_layer_config *c, int fused, const float *src, float *w) {
    return move_fused(c, fused, w, (float *)src, 1);
}
int gdn_layer_fuse(const gdn_layer_config *c, int fused, const float *w, float *dst) {
    return move_fused(c, fused, (float *)w, dst, 0);
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
        static const char *const names[2] = {"in_proj_qkv.weight", "in_proj_qkvz.weight"};
        char hint[SRC_LEN];
        gdn_io_prefix_hint(f, names, 2, hint, sizeof hint);
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
            gdn_io_shape_str(s, sizeof s, t->ndim, t->shape);
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
    const int64_t hvv = ds->d[D_HV].v * ds->d[D_V].v;
    const gdn_st_tensor *vt[2] = {found[GDN_P_OUT_PROJ], fused ? NULL : found[GDN_P_IN_PROJ_Z]};
    for (int i = 0; i < 2; i++)
        if (vt[i] && vt[i]->shape[i ? 0 : 1] != hvv)
            return gdn_fail(GDN_ERR_SHAPE,
                            "'%s' shape[%d] = %lld is not Hv*V = %lld (Hv = %lld from %s; V = %lld "
                            "from %s)",
                            vt[i]->name, i ? 0 : 1, (long long)vt[i]->shape[i ? 0 : 1],
                            (long long)hvv, (long long)ds->d[D_HV].v, ds->d[D_HV].src,
                            (long long)ds->d[D_V].v, ds->d[D_V].src);
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
    const int has_hk = ds->d[D_HK].src[0] != 0, has_k = ds->d[D_K].src[0] != 0;
    if (!has_hk && !has_k)
        return gdn_fail(GDN_ERR_SHAPE,
                        "cannot tell Hk from K: the shapes give only Hk*K = %lld; state one of them "
                        "(config.json linear_num_key_heads or linear_key_head_dim, __metadata__ Hk "
                        "or K, or the given Hk or K, e.g. --Hk / --K)",
                        (long long)hkk);
    const int known = has_hk ? D_HK : D_K, other = has_hk ? D_K : D_HK;
    if (hkk % ds->d[known].v)
        return gdn_fail(GDN_ERR_SHAPE,
                        "'%s' has %lld rows, so Hk*K = %lld, which %s = %lld does not divide",
                        conv->name, (long long)conv->shape[0], (long long)hkk, ds->d[known].src,
                        (long long)ds->d[known].v);
    snprintf(source, sizeof source, "Hk*K from '%s' rows (%lld = 2*Hk*K + Hv*V) / %s (%lld)",
             conv->name, (long long)conv->shape[0], dim_info[known].name,
             (long long)ds->d[known].v);
    return dim_state(ds, other, hkk / ds->d[known].v, source);
}

/* Read one fused tensor and scatter its rows into the split parameters of lw->w. */
static int read_fused(gdn_st_file *f, const gdn_st_tensor *t, int which, gdn_layer_weights *lw) {
    const int64_t rows = t->shape[0], E = t->shape[1];
    float *tmp = gdn_malloc("layer_weights: tmp", (size_t)(rows * E) * sizeof *tmp + 1);
    if (!tmp) return gdn_fail(GDN_ERR_NOMEM, "reading '%s'", t->name);
    int rc = gdn_st_read_f32(f, t->name, tmp, (size_t)(rows * E));
    if (!rc) rc = gdn_layer_unfuse(&lw->cfg, which - W_QKVZ, tmp, lw->w);
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

    gdn_layer_config c = gdn_layer_config_default(1, 1, ds.d[D_E].v, ds.d[D_HK].v, ds.d[D_HV].v,
                                                  ds.d[D_K].v, ds.d[D_V].v);
    c.Kc = ds.d[D_KC].v;
    if (ds.eps.src[0]) c.eps = ds.eps.v;
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
            gdn_io_shape_str(s, sizeof s, t->ndim, t->shape);
            gdn_io_shape_str(s2, sizeof s2, nd, want);
            return gdn_fail(GDN_ERR_SHAPE,
                            "%s: weight '%s' has shape %s but the layer (E=%lld Hk=%lld Hv=%lld "
                            "K=%lld V=%lld Kc=%lld) needs %s",
                            path, t->name, s, (long long)c.E, (long long)c.Hk, (long long)c.Hv,
                            (long long)c.K, (long long)c.V, (long long)c.Kc, s2);
        }
    }

    const size_t n = gdn_layer_param_floats(&c);
    lw->w = gdn_calloc("layer_weights: lw->w", n, sizeof *lw->w);
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
    uint16_t *h = gdn_malloc("layer_weights: h", sizeof(uint16_t) * (n ? n : 1));
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
            rc = gdn_io_add_named(wr, name_prefix, weight_name(w), nd, shape,
                         dw ? dw + gdn_layer_param_offset(&c, w) : NULL);
            continue;
        }
        if (!dw) { /* reserved: written later at its offset */
            rc = gdn_io_add_named(wr, name_prefix, weight_name(w), nd, shape, NULL);
            continue;
        }
        /* Gather the split gradients back into the fused, interleaved order. */
        float *tmp = gdn_malloc("layer_weights: tmp", (size_t)(shape[0] * shape[1]) * sizeof *tmp);
        if (!tmp) return gdn_fail(GDN_ERR_NOMEM, "gradient of '%s'", weight_name(w));
        rc = gdn_layer_fuse(&c, w - W_QKVZ, dw, tmp);
        if (!rc) rc = gdn_io_add_named(wr, name_prefix, weight_name(w), nd, shape, tmp);
        free(tmp);
    }
    return rc;
}
