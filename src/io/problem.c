/* Loading a gated-delta-rule problem from safetensors with every shape cross-checked, and
 * saving named f32 tensors. */
#include "base.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void shape_str(char *buf, size_t n, const int64_t *s, int nd) {
    size_t off = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < nd && off < n; i++)
        off += (size_t)snprintf(buf + off, n - off, "%s%lld", i ? "," : "", (long long)s[i]);
    if (off < n) snprintf(buf + off, n - off, "]");
}

/* Check that tensor `name` exists with exactly the expected shape, then read it as f32
 * (rows [t0, t0 + tn) of dimension 1 when tn >= 0). */
static int read_exact(gdn_st_file *f, const char *path, const char *name, int nd,
                      const int64_t *want, float **dst, int64_t t0, int64_t tn) {
    const gdn_st_tensor *t = gdn_st_find(f, name);
    if (!t) return gdn_fail(GDN_ERR_MISSING, "%s: required tensor '%s' is missing", path, name);
    int same = t->ndim == nd;
    for (int i = 0; same && i < nd; i++) same = t->shape[i] == want[i];
    if (!same) {
        char a[128], b[128];
        shape_str(a, sizeof a, t->shape, t->ndim);
        shape_str(b, sizeof b, want, nd);
        return gdn_fail(GDN_ERR_SHAPE, "%s: tensor '%s' has shape %s, expected %s", path, name, a, b);
    }
    size_t n = 1;
    for (int i = 0; i < nd; i++) n *= (size_t)(i == 1 && tn >= 0 ? tn : want[i]);
    *dst = gdn_malloc("problem: dst", sizeof(float) * (n ? n : 1));
    if (!*dst) return gdn_fail(GDN_ERR_NOMEM, "%s: tensor '%s' (%zu floats)", path, name, n);
    return tn >= 0 ? gdn_st_read_f32_rows(f, name, *dst, n, t0, tn) : gdn_st_read_f32(f, name, *dst, n);
}

int gdn_problem_load(gdn_problem *pb, const char *path, int want_grads, int64_t t0, int64_t tn,
                     int64_t n_docs) {
    memset(pb, 0, sizeof *pb);
    gdn_st_file *f = NULL;
    int rc = gdn_st_open(&f, path);
    if (rc) return rc;
    const gdn_st_tensor *tq = gdn_st_find(f, "q"), *tv = gdn_st_find(f, "v");
    if (!tq || !tv) {
        rc = gdn_fail(GDN_ERR_MISSING, "%s: required tensor '%s' is missing", path, tq ? "v" : "q");
        goto done;
    }
    if (tq->ndim != 4 || tv->ndim != 4) {
        rc = gdn_fail(GDN_ERR_SHAPE, "%s: tensor '%s' must be 4-D [B,T,H,D], it has %d dims", path,
                      tq->ndim != 4 ? "q" : "v", tq->ndim != 4 ? tq->ndim : tv->ndim);
        goto done;
    }
    const int64_t B = tq->shape[0], T = tq->shape[1], Hk = tq->shape[2], K = tq->shape[3];
    const int64_t Hv = tv->shape[2], V = tv->shape[3];
    if (tv->shape[0] != B || tv->shape[1] != T) {
        rc = gdn_fail(GDN_ERR_SHAPE, "%s: 'v' is [%lld,%lld,...] but 'q' is [%lld,%lld,...] (B, T must match)",
                      path, (long long)tv->shape[0], (long long)tv->shape[1], (long long)B,
                      (long long)T);
        goto done;
    }
    pb->cfg = gdn_config_default(B, T, Hk, Hv, K, V);
    if ((rc = gdn_config_check(&pb->cfg))) goto done;
    if (n_docs < 0 || (n_docs > 0 && B != 1)) { /* one packed stream: its documents' states replace B's */
        rc = n_docs < 0 ? gdn_fail(GDN_ERR_ARG, "%s: n_docs must be >= 0, got %lld", path, (long long)n_docs)
                        : gdn_fail(GDN_ERR_SHAPE, "%s: packed documents (cu_seqlens) need B = 1 (one packed stream), "
                                   "the file has B = %lld", path, (long long)B);
        goto done;
    }
    const int64_t state_rows = n_docs > 0 ? n_docs : B;
    if (tn >= 0 && (t0 < 0 || tn < 1 || t0 + tn > T)) {
        rc = gdn_fail(GDN_ERR_SHAPE, "%s: tokens [%lld, %lld) are not inside T = %lld", path,
                      (long long)t0, (long long)(t0 + tn), (long long)T);
        goto done;
    }
    pb->T_full = T, pb->t_begin = tn >= 0 ? t0 : 0;
    if (tn >= 0) pb->cfg.T = tn;
    { /* everything this load allocates, before any of it */
        const double rows = (double)B * pb->cfg.T, state = (double)state_rows * Hv * K * V;
        const double floats = rows * (2.0 * Hk * K + (want_grads ? 2.0 : 1.0) * Hv * V + 2.0 * Hv) +
                              (want_grads ? 2 : 1) * state;
        char what[600];
        snprintf(what, sizeof what, "loading %s (B=%lld, %lld tokens, Hk=%lld, Hv=%lld, K=%lld, V=%lld)", path,
                 (long long)B, (long long)pb->cfg.T, (long long)Hk, (long long)Hv, (long long)K, (long long)V);
        if ((rc = gdn_check_fits(what, 4.0 * floats))) goto done;
    }
    const int64_t sqk[4] = {B, T, Hk, K}, sv[4] = {B, T, Hv, V}, sg[3] = {B, T, Hv},
                  ss[4] = {state_rows, Hv, K, V};
    if ((rc = read_exact(f, path, "q", 4, sqk, &pb->q, t0, tn)) ||
        (rc = read_exact(f, path, "k", 4, sqk, &pb->k, t0, tn)) ||
        (rc = read_exact(f, path, "v", 4, sv, &pb->v, t0, tn)) ||
        (rc = read_exact(f, path, "g", 3, sg, &pb->g, t0, tn)) ||
        (rc = read_exact(f, path, "beta", 3, sg, &pb->beta, t0, tn)))
        goto done;
    if (gdn_st_find(f, "h0") && (rc = read_exact(f, path, "h0", 4, ss, &pb->h0, 0, -1))) goto done;
    if (want_grads) {
        if ((rc = read_exact(f, path, "do", 4, sv, &pb->dout, t0, tn))) goto done;
        if (gdn_st_find(f, "dht") && (rc = read_exact(f, path, "dht", 4, ss, &pb->dht, 0, -1)))
            goto done;
    }
done:
    gdn_st_close(f);
    if (rc) gdn_problem_free(pb);
    return rc;
}

void gdn_problem_free(gdn_problem *pb) {
    free(pb->q), free(pb->k), free(pb->v), free(pb->g), free(pb->beta);
    free(pb->h0), free(pb->dout), free(pb->dht);
    memset(pb, 0, sizeof *pb);
}

int gdn_save_tensors(const char *path, const gdn_named_tensor *t, int n, const char *tool) {
    gdn_st_writer *w = NULL;
    int rc = gdn_st_writer_create(&w);
    if (rc) return rc;
    if (tool) rc = gdn_st_writer_metadata(w, "producer", tool);
    for (int i = 0; i < n && !rc; i++)
        if (t[i].data)
            rc = gdn_st_writer_add_f32(w, t[i].name, GDN_F32, t[i].ndim, t[i].shape, t[i].data);
    if (!rc) rc = gdn_st_writer_save(w, path);
    gdn_st_writer_destroy(w);
    return rc;
}
