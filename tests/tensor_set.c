/* The loader suites' tensor sets and temporary files (tensor_set.h). */
#include "tensor_set.h"
#include "base.h" /* gdn_st_read_f32, gdn_st_writer_add_f32 */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int64_t tens_numel(const tens *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

tens *tset_find(tset *s, const char *name) {
    for (int i = 0; i < s->n; i++)
        if (!strcmp(s->t[i].name, name)) return &s->t[i];
    return NULL;
}

tens *tset_add(tset *s, const char *name, int ndim, const int64_t *shape, const float *data) {
    if (s->n == (int)(sizeof s->t / sizeof s->t[0])) return NULL;
    tens *t = &s->t[s->n++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
    const int64_t n = tens_numel(t);
    t->data = calloc((size_t)n + 1, sizeof(float));
    if (data) memcpy(t->data, data, (size_t)n * sizeof(float));
    return t;
}

void tset_drop(tset *s, const char *name) {
    tens *t = tset_find(s, name);
    if (!t) return;
    free(t->data);
    *t = s->t[--s->n];
}

void tset_free(tset *s) {
    for (int i = 0; i < s->n; i++) free(s->t[i].data);
    s->n = 0;
}

int tset_load(tset *s, const char *path, const char *prefix) {
    memset(s, 0, sizeof *s);
    gdn_st_file *f = NULL;
    int rc = gdn_st_open(&f, path);
    const size_t pl = strlen(prefix);
    for (int i = 0; !rc && i < gdn_st_count(f); i++) {
        const gdn_st_tensor *st = gdn_st_at(f, i);
        if (strncmp(st->name, prefix, pl) || st->ndim > 3) continue;
        tens *t = tset_add(s, st->name + pl, st->ndim, st->shape, NULL);
        rc = t ? gdn_st_read_f32(f, st->name, t->data, (size_t)tens_numel(t)) : GDN_ERR_NOMEM;
    }
    gdn_st_close(f);
    return rc;
}

int tset_save(const tset *s, const char *path, const char *prefix, const char *const *meta, gdn_dtype dtype) {
    gdn_st_writer *w = NULL;
    int rc = gdn_st_writer_create(&w);
    char name[256];
    for (int i = 0; !rc && i < s->n; i++) {
        const char *n = s->t[i].name; /* a leading '=' : written without the prefix */
        snprintf(name, sizeof name, "%s%s", n[0] == '=' ? "" : prefix, n + (n[0] == '='));
        rc = gdn_st_writer_add_f32(w, name, dtype, s->t[i].ndim, s->t[i].shape, s->t[i].data);
    }
    for (int i = 0; !rc && meta && meta[i]; i += 2) rc = gdn_st_writer_metadata(w, meta[i], meta[i + 1]);
    if (!rc) rc = gdn_st_writer_save(w, path);
    gdn_st_writer_destroy(w);
    return rc;
}

static char tmpdir[256];
static char tmpfiles[48][300];
static int ntmp;

int tmp_begin(const char *tag) {
    snprintf(tmpdir, sizeof tmpdir, "/tmp/%s_XXXXXX", tag);
    ntmp = 0;
    return mkdtemp(tmpdir) ? 0 : -1;
}

const char *tmp_path(const char *name) {
    for (int i = 0; i < ntmp; i++)
        if (!strcmp(strrchr(tmpfiles[i], '/') + 1, name)) return tmpfiles[i];
    if (ntmp == (int)(sizeof tmpfiles / sizeof tmpfiles[0])) return "/nonexistent/too-many-temp-files";
    snprintf(tmpfiles[ntmp], sizeof tmpfiles[0], "%s/%s", tmpdir, name);
    return tmpfiles[ntmp++];
}

const char *write_text(const char *name, const char *text) {
    const char *p = tmp_path(name);
    FILE *fp = fopen(p, "w");
    if (fp) fputs(text, fp), fclose(fp);
    return p;
}

int tmp_end(void) {
    for (int i = 0; i < ntmp; i++) unlink(tmpfiles[i]);
    ntmp = 0;
    return rmdir(tmpdir);
}
