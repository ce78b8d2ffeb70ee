/* The pieces both checkpoint loaders share (loader_common.h). */
#include "loader_common.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

int gdn_io_dim_state(gdn_io_dim *d, const char *name, int64_t max, int64_t value, const char *source) {
    if (value < 1 || value > max)
        return gdn_fail(GDN_ERR_SHAPE, "%s = %lld: %s is out of range [1, %lld]", source, (long long)value, name,
                        (long long)max);
    if (d->src[0]) {
        if (d->v != value)
            return gdn_fail(GDN_ERR_SHAPE, "%s disagrees: %s = %lld but %s = %lld", name, d->src, (long long)d->v,
                            source, (long long)value);
        return GDN_OK;
    }
    d->v = value;
    snprintf(d->src, sizeof d->src, "%s", source);
    return GDN_OK;
}

int gdn_io_eps_state(gdn_io_eps *e, double value, const char *source) {
    if (!(value > 0.0) || !isfinite(value) || !isfinite((float)value) || (float)value <= 0.0f)
        return gdn_fail(GDN_ERR_SHAPE, "%s = %g: rms_norm_eps must be positive and finite", source, value);
    const float v = (float)value;
    if (e->src[0]) {
        if (fabsf(e->v - v) > 1e-6f * fmaxf(e->v, v))
            return gdn_fail(GDN_ERR_SHAPE, "rms_norm_eps disagrees: %s = %g but %s = %g", e->src, (double)e->v,
                            source, value);
        return GDN_OK;
    }
    e->v = v;
    snprintf(e->src, sizeof e->src, "%s", source);
    return GDN_OK;
}

int gdn_io_config_load(const char *path, json_t **root) {
    *root = NULL;
    FILE *fp = fopen(path, "rb");
    if (!fp) return gdn_fail(GDN_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    json_error_t err;
    json_t *r = json_loadf(fp, 0, &err);
    fclose(fp);
    if (!r)
        return gdn_fail(GDN_ERR_FORMAT, "%s: invalid JSON at line %d column %d: %s", path, err.line, err.column,
                        err.text);
    if (!json_is_object(r)) {
        json_decref(r);
        return gdn_fail(GDN_ERR_FORMAT, "%s: config is not a JSON object", path);
    }
    *root = r;
    return GDN_OK;
}

json_t *gdn_io_config_section(json_t *root, const char *const *fields, int n, const char **where) {
    *where = "";
    for (int i = 0; i < n; i++)
        if (json_object_get(root, fields[i])) return root;
    json_t *tc = json_object_get(root, "text_config");
    if (!json_is_object(tc)) return root;
    *where = "text_config.";
    return tc;
}

int gdn_io_config_int(json_t *obj, const char *path, const char *where, const char *field, int64_t *v,
                      int *present) {
    json_t *j = json_object_get(obj, field);
    *present = 0;
    if (!j || json_is_null(j)) return GDN_OK;
    if (!json_is_integer(j))
        return gdn_fail(GDN_ERR_FORMAT, "%s: field '%s%s' is not an integer", path, where, field);
    *v = (int64_t)json_integer_value(j);
    *present = 1;
    return GDN_OK;
}

int gdn_io_config_number(json_t *obj, const char *path, const char *where, const char *field, double *v,
                         int *present) {
    json_t *j = json_object_get(obj, field);
    *present = 0;
    if (!j || json_is_null(j)) return GDN_OK;
    if (!json_is_number(j)) return gdn_fail(GDN_ERR_FORMAT, "%s: field '%s%s' is not a number", path, where, field);
    *v = json_number_value(j);
    *present = 1;
    return GDN_OK;
}

int gdn_io_metadata_int(gdn_st_file *f, const char *path, const char *key, int64_t *v, int *present) {
    const char *s = gdn_st_metadata(f, key);
    *present = 0;
    if (!s) return GDN_OK;
    char *end;
    errno = 0;
    const long long x = strtoll(s, &end, 10);
    if (end == s || *end || errno)
        return gdn_fail(GDN_ERR_FORMAT, "%s: __metadata__ %s = '%s' is not an integer", path, key, s);
    *v = x, *present = 1;
    return GDN_OK;
}

int gdn_io_metadata_number(gdn_st_file *f, const char *path, const char *key, double *v, int *present) {
    const char *s = gdn_st_metadata(f, key);
    *present = 0;
    if (!s) return GDN_OK;
    char *end;
    const double x = strtod(s, &end);
    if (end == s || *end) return gdn_fail(GDN_ERR_FORMAT, "%s: __metadata__ %s = '%s' is not a number", path, key, s);
    *v = x, *present = 1;
    return GDN_OK;
}

void gdn_io_shape_str(char *buf, size_t n, int ndim, const int64_t *shape) {
    size_t used = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < ndim && used < n; i++)
        used += (size_t)snprintf(buf + used, n - used, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (used < n) snprintf(buf + used, n - used, "]");
}

void gdn_io_prefix_hint(const gdn_st_file *f, const char *const *suffixes, int n, char *buf, size_t len) {
    buf[0] = 0;
    for (int i = 0; i < gdn_st_count(f); i++) {
        const char *name = gdn_st_at(f, i)->name;
        const size_t ln = strlen(name);
        for (int s = 0; s < n; s++) {
            const size_t lw = strlen(suffixes[s]);
            if (ln >= lw && !strcmp(name + ln - lw, suffixes[s]) && (ln == lw || name[ln - lw - 1] == '.')) {
                snprintf(buf, len, " (it has '%s': prefix '%.*s'?)", name, (int)(ln - lw), name);
                return;
            }
        }
    }
}

int gdn_io_add_named(gdn_st_writer *wr, const char *name_prefix, const char *name, int ndim,
                     const int64_t *shape, const float *data) {
    const size_t len = strlen(name_prefix) + strlen(name) + 1;
    char *full = gdn_malloc("loader_common: full", len);
    if (!full) return gdn_fail(GDN_ERR_NOMEM, "gradient name");
    snprintf(full, len, "%s%s", name_prefix, name);
    const int rc = gdn_st_writer_add_f32(wr, full, GDN_F32, ndim, shape, data);
    free(full);
    return rc;
}
