/* One gated full-attention layer's weights (Qwen3.5 / Qwen3-Next `self_attn`) from a Hugging Face
 * safetensors checkpoint: q_proj [2Hd, E] (query and gate interleaved per head, kept as is: the
 * flat layout is the checkpoint's), k_proj, v_proj [Hkv d, E], o_proj [E, Hd], q_norm, k_norm [d].
 *
 * Sources, in order: config.json (or its "text_config"), the file's __metadata__ (E, H, Hkv, d,
 * R, rope_theta, rms_norm_eps, max_position), the caller's `given` (fields > 0), the tensor
 * shapes; every source that states a value must agree with the others (layer_weights.c's rule,
 * loader_common.h's helpers). What no source states:
 *   config.json given but without partial_rotary_factor: 0.25, without a rope theta: 10000,
 *     without rms_norm_eps: 1e-6 -- the defaults of transformers' Qwen3-Next config (and of
 *     its generic RoPE: 10000), so a config read here means what it means to transformers;
 *   no config and nothing in `given` / __metadata__: gdn_attn_config_default's R = int(0.25 d)
 *     (even) and theta 1e7 (the released Qwen3.5 checkpoints' value);
 *   max_position_embeddings absent: 0 (positions unchecked).
 * RoPE: rope_parameters (transformers 5) or rope_scaling (4.x) must be the default kind;
 * "mrope" / an mrope_section (multimodal M-RoPE) is accepted because text positions are the
 * same on its three axes, where M-RoPE is plain 1-D RoPE (interleaved or not). */
#include "loader_common.h"

#include <math.h>
#include <string.h>

enum { A_E, A_H, A_HKV, A_D, A_COUNT };

static const struct {
    const char *name;   /* our name, also the __metadata__ key */
    const char *config; /* config.json field */
    int64_t max;        /* gdn_attn_config_check's bounds */
} dim_info[A_COUNT] = {
    {"E", "hidden_size", (int64_t)1 << 20},
    {"H", "num_attention_heads", 1 << 16},
    {"Hkv", "num_key_value_heads", 1 << 16},
    {"d", "head_dim", 1024},
};

#define SRC_LEN GDN_IO_SRC_LEN
#define MAX_POSITION ((int64_t)1 << 42)

/* A real value as stated by its first source (theta, the rotary factor). */
typedef struct {
    double v;
    char src[SRC_LEN];
} real_stated;

typedef struct {
    gdn_io_dim d[A_COUNT];
    gdn_io_dim R, max_position; /* R: rotary dims stated outright (__metadata__, given) */
    real_stated theta, factor;  /* factor: partial_rotary_factor (config.json) */
    gdn_io_eps eps;
    int have_config;            /* config.json's defaults apply to what it leaves out */
} dims;

static int dim_state(dims *ds, int d, int64_t value, const char *source) {
    return gdn_io_dim_state(&ds->d[d], dim_info[d].name, dim_info[d].max, value, source);
}

/* Relative agreement to 1e-12: one value written two ways ("1e7", "10000000.0") parses alike. */
static int real_state(real_stated *r, const char *name, double value, const char *source) {
    if (r->src[0]) {
        if (fabs(r->v - value) > 1e-12 * fmax(fabs(r->v), fabs(value)))
            return gdn_fail(GDN_ERR_SHAPE, "%s disagrees: %s = %.17g but %s = %.17g", name, r->src, r->v, source,
                            value);
        return GDN_OK;
    }
    r->v = value;
    snprintf(r->src, sizeof r->src, "%s", source);
    return GDN_OK;
}

static int theta_state(dims *ds, double value, const char *source) {
    if (!(value > 1.0) || !isfinite(value))
        return gdn_fail(GDN_ERR_SHAPE, "%s = %g: the RoPE theta must be finite and > 1", source, value);
    return real_state(&ds->theta, "the RoPE theta", value, source);
}

static int factor_state(dims *ds, double value, const char *source) {
    if (!(value > 0.0 && value <= 1.0))
        return gdn_fail(GDN_ERR_SHAPE, "%s = %g: partial_rotary_factor must be in (0, 1]", source, value);
    return real_state(&ds->factor, "partial_rotary_factor", value, source);
}

/* ------------------------------------------------------------------ config.json */

/* rope_parameters / rope_scaling: absent, null or an object of the default kind (or M-RoPE). */
static int rope_object(json_t *obj, const char *path, const char *where, const char *field,
                       json_t **out) {
    json_t *rp = json_object_get(obj, field);
    *out = NULL;
    if (!rp || json_is_null(rp)) return GDN_OK;
    if (!json_is_object(rp)) return gdn_fail(GDN_ERR_FORMAT, "%s: field '%s%s' is not an object", path, where, field);
    for (int k = 0; k < 2; k++) { /* transformers 5 writes rope_type; 4.x wrote type */
        json_t *t = json_object_get(rp, k ? "type" : "rope_type");
        if (!t || json_is_null(t)) continue;
        const char *s = json_is_string(t) ? json_string_value(t) : NULL;
        if (!s)
            return gdn_fail(GDN_ERR_FORMAT, "%s: field '%s%s.%s' is not a string", path, where, field,
                            k ? "type" : "rope_type");
        if (strcmp(s, "default") && strcmp(s, "mrope"))
            return gdn_fail(GDN_ERR_FORMAT,
                            "%s: %s%s.%s = '%s': only the default RoPE (or text-only M-RoPE, 'mrope') is "
                            "implemented, not a scaled variant",
                            path, where, field, k ? "type" : "rope_type", s);
    }
    json_t *ms = json_object_get(rp, "mrope_section");
    if (ms && !json_is_null(ms)) {
        int ok = json_is_array(ms) && json_array_size(ms) > 0;
        for (size_t i = 0; ok && i < json_array_size(ms); i++)
            ok = json_is_integer(json_array_get(ms, i)) && json_integer_value(json_array_get(ms, i)) >= 0;
        if (!ok)
            return gdn_fail(GDN_ERR_FORMAT, "%s: field '%s%s.mrope_section' is not a list of counts", path, where,
                            field);
    }
    *out = rp;
    return GDN_OK;
}

/* The sum of an M-RoPE section (rotary pairs per axis), or -1 when there is none. */
static int64_t mrope_pairs(json_t *rp) {
    json_t *ms = rp ? json_object_get(rp, "mrope_section") : NULL;
    if (!json_is_array(ms)) return -1;
    int64_t sum = 0;
    for (size_t i = 0; i < json_array_size(ms); i++) sum += json_integer_value(json_array_get(ms, i));
    return sum;
}

static int config_rope(dims *ds, json_t *obj, const char *path, const char *where, int64_t *mrope) {
    json_t *rp[2];
    static const char *const holders[2] = {"rope_parameters", "rope_scaling"};
    char source[SRC_LEN];
    int rc = GDN_OK, present;
    *mrope = -1;
    for (int h = 0; h < 2 && !rc; h++) rc = rope_object(obj, path, where, holders[h], &rp[h]);
    /* theta and the factor: inside rope_parameters (Qwen3.5, transformers 5) or at the top (4.x) */
    for (int h = 0; h < 3 && !rc; h++) {
        json_t *o = h < 2 ? rp[h] : obj;
        if (!o) continue;
        char in[64]; /* where the field sits, for messages: "text_config.rope_parameters." */
        snprintf(in, sizeof in, "%s%s%s", where, h < 2 ? holders[h] : "", h < 2 ? "." : "");
        double v;
        if (!(rc = gdn_io_config_number(o, path, in, "rope_theta", &v, &present)) && present) {
            snprintf(source, sizeof source, "%s %srope_theta", path, in);
            rc = theta_state(ds, v, source);
        }
        if (!rc && !(rc = gdn_io_config_number(o, path, in, "partial_rotary_factor", &v, &present)) && present) {
            snprintf(source, sizeof source, "%s %spartial_rotary_factor", path, in);
            rc = factor_state(ds, v, source);
        }
        if (h < 2 && mrope_pairs(o) >= 0) *mrope = mrope_pairs(o);
    }
    return rc;
}

static int dims_from_config(dims *ds, const char *path, int64_t *mrope) {
    json_t *root = NULL;
    int rc = gdn_io_config_load(path, &root);
    if (rc) return rc;
    /* the attention fields sit under "text_config" in a multimodal config; hidden_size alone is
     * not a sign of the text model (a vision config has one too) */
    static const char *const own[3] = {"num_attention_heads", "num_key_value_heads", "head_dim"};
    const char *where;
    json_t *obj = gdn_io_config_section(root, own, 3, &where);
    char source[SRC_LEN];
    int stated = 0, present;
    int64_t v[A_COUNT] = {0};
    int has[A_COUNT] = {0};
    for (int d = 0; d < A_COUNT && !rc; d++) {
        if ((rc = gdn_io_config_int(obj, path, where, dim_info[d].config, &v[d], &has[d])) || !has[d]) continue;
        snprintf(source, sizeof source, "%s %s%s", path, where, dim_info[d].config);
        rc = dim_state(ds, d, v[d], source);
        stated++;
    }
    /* transformers: head_dim = hidden_size // num_attention_heads when the config has none */
    if (!rc && !has[A_D] && has[A_E] && has[A_H] && v[A_H] > 0) {
        snprintf(source, sizeof source, "%s %shidden_size / num_attention_heads (no head_dim)", path, where);
        rc = dim_state(ds, A_D, v[A_E] / v[A_H], source);
    }
    int64_t mp;
    if (!rc && !(rc = gdn_io_config_int(obj, path, where, "max_position_embeddings", &mp, &present)) && present) {
        snprintf(source, sizeof source, "%s %smax_position_embeddings", path, where);
        rc = gdn_io_dim_state(&ds->max_position, "max_position_embeddings", MAX_POSITION, mp, source);
    }
    double e;
    if (!rc && !(rc = gdn_io_config_number(obj, path, where, "rms_norm_eps", &e, &present)) && present) {
        snprintf(source, sizeof source, "%s %srms_norm_eps", path, where);
        rc = gdn_io_eps_state(&ds->eps, e, source);
    }
    if (!rc) rc = config_rope(ds, obj, path, where, mrope);
    if (!rc && !stated)
        rc = gdn_fail(GDN_ERR_FORMAT,
                      "%s: no attention field (hidden_size, num_attention_heads, num_key_value_heads, "
                      "head_dim) at the top level or under text_config",
                      path);
    ds->have_config = 1;
    json_decref(root);
    return rc;
}

/* ------------------------------------------------------------------ __metadata__ and given */

static int dims_from_metadata(dims *ds, gdn_st_file *f, const char *path) {
    char source[SRC_LEN];
    int present, rc = GDN_OK;
    int64_t v;
    double x;
    for (int d = 0; d < A_COUNT && !rc; d++) {
        if ((rc = gdn_io_metadata_int(f, path, dim_info[d].name, &v, &present)) || !present) continue;
        snprintf(source, sizeof source, "%s __metadata__ %s", path, dim_info[d].name);
        rc = dim_state(ds, d, v, source);
    }
    if (!rc && !(rc = gdn_io_metadata_int(f, path, "R", &v, &present)) && present) {
        snprintf(source, sizeof source, "%s __metadata__ R", path);
        rc = gdn_io_dim_state(&ds->R, "R", 1024, v, source);
    }
    if (!rc && !(rc = gdn_io_metadata_int(f, path, "max_position", &v, &present)) && present) {
        snprintf(source, sizeof source, "%s __metadata__ max_position", path);
        rc = gdn_io_dim_state(&ds->max_position, "max_position", MAX_POSITION, v, source);
    }
    if (!rc && !(rc = gdn_io_metadata_number(f, path, "rope_theta", &x, &present)) && present) {
        snprintf(source, sizeof source, "%s __metadata__ rope_theta", path);
        rc = theta_state(ds, x, source);
    }
    if (!rc && !(rc = gdn_io_metadata_number(f, path, "rms_norm_eps", &x, &present)) && present) {
        snprintf(source, sizeof source, "%s __metadata__ rms_norm_eps", path);
        rc = gdn_io_eps_state(&ds->eps, x, source);
    }
    return rc;
}

static int dims_from_given(dims *ds, const gdn_attn_config *g) {
    const int64_t v[A_COUNT] = {g->E, g->H, g->Hkv, g->d};
    char source[SRC_LEN];
    int rc = GDN_OK;
    for (int d = 0; d < A_COUNT && !rc; d++) {
        if (v[d] <= 0) continue;
        snprintf(source, sizeof source, "the given %s", dim_info[d].name);
        rc = dim_state(ds, d, v[d], source);
    }
    if (!rc && g->R > 0) rc = gdn_io_dim_state(&ds->R, "R", 1024, g->R, "the given R");
    if (!rc && g->max_position > 0)
        rc = gdn_io_dim_state(&ds->max_position, "max_position", MAX_POSITION, g->max_position, "the given max_position");
    if (!rc && g->rope_theta > 0) rc = theta_state(ds, g->rope_theta, "the given rope_theta");
    if (!rc && g->eps > 0.0f) rc = gdn_io_eps_state(&ds->eps, g->eps, "the given eps");
    return rc;
}

/* ------------------------------------------------------------------ the tensors */

static int weight_ndim(int i) { return i == GDN_A_Q_NORM || i == GDN_A_K_NORM ? 1 : 2; }

/* The layer's tensors under the prefix: found[w] for every weight, or the error naming what is
 * missing, unknown, of an unreadable dtype or of the wrong rank. */
static int find_weights(gdn_st_file *f, const char *path, const char *prefix, const gdn_st_tensor *found[GDN_A_COUNT]) {
    const size_t plen = strlen(prefix);
    int nfound = 0;
    const char *extra = NULL, *bias = NULL;
    for (int i = 0; i < gdn_st_count(f); i++) {
        const gdn_st_tensor *t = gdn_st_at(f, i);
        if (strncmp(t->name, prefix, plen)) continue;
        const char *suffix = t->name + plen;
        int w = 0;
        while (w < GDN_A_COUNT && strcmp(suffix, gdn_attn_param_name(w))) w++;
        const size_t ls = strlen(suffix);
        if (w < GDN_A_COUNT) found[w] = t, nfound++;
        else if (ls > 5 && !strcmp(suffix + ls - 5, ".bias") && !bias) bias = t->name;
        else if (!extra) extra = t->name;
    }
    if (!nfound) {
        static const char *const names[1] = {"q_proj.weight"};
        char hint[SRC_LEN];
        gdn_io_prefix_hint(f, names, 1, hint, sizeof hint);
        return gdn_fail(GDN_ERR_MISSING, "%s: no attention weights under the prefix '%s' (no '%sq_proj.weight')%s",
                        path, prefix, prefix, hint);
    }
    if (bias)
        return gdn_fail(GDN_ERR_FORMAT,
                        "%s: unexpected weight '%s': the layer has no biases (Qwen3.5 and Qwen3-Next: "
                        "attention_bias false)",
                        path, bias);
    if (extra)
        return gdn_fail(GDN_ERR_FORMAT, "%s: unexpected (extra) weight '%s' under the prefix '%s'", path, extra,
                        prefix);
    for (int w = 0; w < GDN_A_COUNT; w++) {
        const gdn_st_tensor *t = found[w];
        if (!t) return gdn_fail(GDN_ERR_MISSING, "%s: missing weight '%s%s'", path, prefix, gdn_attn_param_name(w));
        if (t->dtype == GDN_DTYPE_OTHER)
            return gdn_fail(GDN_ERR_DTYPE, "%s: weight '%s' is %s; only F32, F64 and BF16 are read", path, t->name,
                            t->dtype_name);
        if (t->ndim != weight_ndim(w)) {
            char s[128];
            gdn_io_shape_str(s, sizeof s, t->ndim, t->shape);
            return gdn_fail(GDN_ERR_SHAPE, "%s: weight '%s' has %d dims %s, want %d", path, t->name, t->ndim, s,
                            weight_ndim(w));
        }
    }
    return GDN_OK;
}

/* d from the norms, E from q_proj's columns, then H and Hkv from the projections' rows. */
static int dims_from_shapes(dims *ds, const gdn_st_tensor *found[GDN_A_COUNT]) {
    char source[SRC_LEN];
    int rc;
    const gdn_st_tensor *q = found[GDN_A_Q_PROJ], *k = found[GDN_A_K_PROJ];
    snprintf(source, sizeof source, "'%s' shape[0]", found[GDN_A_Q_NORM]->name);
    if ((rc = dim_state(ds, A_D, found[GDN_A_Q_NORM]->shape[0], source))) return rc;
    snprintf(source, sizeof source, "'%s' shape[0]", found[GDN_A_K_NORM]->name);
    if ((rc = dim_state(ds, A_D, found[GDN_A_K_NORM]->shape[0], source))) return rc;
    snprintf(source, sizeof source, "'%s' shape[1]", q->name);
    if ((rc = dim_state(ds, A_E, q->shape[1], source))) return rc;
    const int64_t d = ds->d[A_D].v;
    if (q->shape[0] % (2 * d))
        return gdn_fail(GDN_ERR_SHAPE, "'%s' has %lld rows, not 2*H*d for any H (d = %lld from %s)", q->name,
                        (long long)q->shape[0], (long long)d, ds->d[A_D].src);
    if (k->shape[0] % d)
        return gdn_fail(GDN_ERR_SHAPE, "'%s' has %lld rows, not Hkv*d for any Hkv (d = %lld from %s)", k->name,
                        (long long)k->shape[0], (long long)d, ds->d[A_D].src);
    snprintf(source, sizeof source, "'%s' shape[0] / (2 d)", q->name);
    if ((rc = dim_state(ds, A_H, q->shape[0] / (2 * d), source))) return rc;
    snprintf(source, sizeof source, "'%s' shape[0] / d", k->name);
    return dim_state(ds, A_HKV, k->shape[0] / d, source);
}

/* R from partial_rotary_factor (transformers: int(head_dim * factor)) and/or stated outright. */
static int resolve_rotary(const dims *ds, int64_t d, int64_t mrope, int64_t *R) {
    if (ds->factor.src[0]) {
        const int64_t r = (int64_t)((double)d * ds->factor.v);
        if (r % 2)
            return gdn_fail(GDN_ERR_SHAPE,
                            "%s = %g gives R = int(d * factor) = int(%lld * %g) = %lld rotary dims, which is "
                            "not even (RoPE turns pairs)",
                            ds->factor.src, ds->factor.v, (long long)d, ds->factor.v, (long long)r);
        if (ds->R.src[0] && ds->R.v != r)
            return gdn_fail(GDN_ERR_SHAPE, "R disagrees: %s = %lld but %s = %g gives int(%lld * %g) = %lld",
                            ds->R.src, (long long)ds->R.v, ds->factor.src, ds->factor.v, (long long)d,
                            ds->factor.v, (long long)r);
        *R = r;
    } else if (ds->R.src[0]) {
        *R = ds->R.v;
    } else if (ds->have_config) { /* the Qwen3-Next / Qwen3.5 config default, 0.25 */
        *R = (int64_t)((double)d * 0.25);
        if (*R % 2)
            return gdn_fail(GDN_ERR_SHAPE,
                            "the config states no partial_rotary_factor; its default 0.25 gives R = int(%lld * 0.25) "
                            "= %lld rotary dims, which is not even",
                            (long long)d, (long long)*R);
    } else {
        *R = gdn_attn_config_default(1, 1, 1, 1, 1, d).R;
    }
    if (mrope >= 0 && 2 * mrope != *R)
        return gdn_fail(GDN_ERR_SHAPE, "the config's mrope_section covers %lld rotary pairs, but R = %lld rotary dims "
                                       "make %lld pairs",
                        (long long)mrope, (long long)*R, (long long)(*R / 2));
    return GDN_OK;
}

static int load(gdn_attn_weights *aw, gdn_st_file *f, const char *path, const char *config_path, const char *prefix,
                const gdn_attn_config *given) {
    dims ds;
    memset(&ds, 0, sizeof ds);
    int64_t mrope = -1;
    int rc = GDN_OK;
    if (config_path && (rc = dims_from_config(&ds, config_path, &mrope))) return rc;
    if ((rc = dims_from_metadata(&ds, f, path))) return rc;
    if (given && (rc = dims_from_given(&ds, given))) return rc;
    const gdn_st_tensor *found[GDN_A_COUNT] = {0};
    if ((rc = find_weights(f, path, prefix, found))) return rc;
    if ((rc = dims_from_shapes(&ds, found))) return rc;

    gdn_attn_config c = gdn_attn_config_default(1, 1, ds.d[A_E].v, ds.d[A_H].v, ds.d[A_HKV].v, ds.d[A_D].v);
    if ((rc = resolve_rotary(&ds, c.d, mrope, &c.R))) return rc;
    if (ds.theta.src[0]) c.rope_theta = ds.theta.v;
    else if (ds.have_config) c.rope_theta = 10000.0; /* transformers' default theta */
    if (ds.eps.src[0]) c.eps = ds.eps.v;
    c.max_position = ds.max_position.src[0] ? ds.max_position.v : 0;
    if ((rc = gdn_attn_config_check(&c))) return rc;
    c.B = c.T = 0;
    aw->cfg = c;

    /* Every weight's whole shape, now that the dims are known (o_proj, v_proj, the columns). */
    for (int w = 0; w < GDN_A_COUNT; w++) {
        const gdn_st_tensor *t = found[w];
        int64_t want[2];
        const int nd = gdn_attn_param_shape(&c, w, want);
        int same = nd == t->ndim;
        for (int i = 0; i < nd && same; i++) same = want[i] == t->shape[i];
        if (!same) {
            char s[128], s2[128];
            gdn_io_shape_str(s, sizeof s, t->ndim, t->shape);
            gdn_io_shape_str(s2, sizeof s2, nd, want);
            return gdn_fail(GDN_ERR_SHAPE, "%s: weight '%s' has shape %s but the layer (E=%lld H=%lld Hkv=%lld d=%lld) needs %s",
                            path, t->name, s, (long long)c.E, (long long)c.H, (long long)c.Hkv, (long long)c.d, s2);
        }
    }
    const size_t n = gdn_attn_param_floats(&c);
    if ((rc = gdn_check_fits("the attention weights", 4.0 * (double)n))) return rc;
    aw->w = gdn_calloc("attn_weights: aw->w", n, sizeof *aw->w);
    if (!aw->w) return gdn_fail(GDN_ERR_NOMEM, "attention weights (%zu floats)", n);
    aw->dtype = found[GDN_A_Q_PROJ]->dtype;
    for (int w = 0; w < GDN_A_COUNT && !rc; w++)
        rc = gdn_st_read_f32(f, found[w]->name, aw->w + gdn_attn_param_offset(&c, w), gdn_attn_param_numel(&c, w));
    return rc;
}

int gdn_attn_weights_load(gdn_attn_weights *aw, const char *path, const char *config_path, const char *prefix,
                          const gdn_attn_config *given) {
    if (!aw || !path) return gdn_fail(GDN_ERR_ARG, "attention weights load: NULL argument");
    memset(aw, 0, sizeof *aw);
    gdn_st_file *f = NULL;
    int rc = gdn_st_open(&f, path);
    if (rc) return rc;
    rc = load(aw, f, path, config_path, prefix ? prefix : "", given);
    gdn_st_close(f);
    if (rc) gdn_attn_weights_free(aw);
    return rc;
}

void gdn_attn_weights_free(gdn_attn_weights *aw) {
    if (!aw) return;
    free(aw->w);
    memset(aw, 0, sizeof *aw);
}

int gdn_attn_grads_add(gdn_st_writer *wr, const gdn_attn_weights *aw, const float *dw, const char *name_prefix) {
    if (!wr || !aw) return gdn_fail(GDN_ERR_ARG, "attention grads add: NULL argument");
    gdn_attn_config c = aw->cfg;
    c.B = c.T = 1;
    int rc = gdn_attn_config_check(&c);
    int64_t shape[2];
    for (int w = 0; w < GDN_A_COUNT && !rc; w++) {
        const int nd = gdn_attn_param_shape(&c, w, shape);
        rc = gdn_io_add_named(wr, name_prefix ? name_prefix : "", gdn_attn_param_name(w), nd, shape,
                              dw ? dw + gdn_attn_param_offset(&c, w) : NULL);
    }
    return rc;
}
