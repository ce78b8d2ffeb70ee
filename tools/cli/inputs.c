/* Input files of gdncp run, layer and attention: packed-document offsets, position_ids, the run file's header. */
#include "cli.h"
#include "parse.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Print "WHO: <status text>: <detail>" and return status. */
static int say(const char *who, int status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int say(const char *who, int status, const char *fmt, ...) {
    char detail[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s: %s: %s\n", who, gdn_strerror(status), detail);
    return status;
}

int cli_pack_offsets(const char *who, const char *path, const char *rows, const int64_t *given, int64_t n_given,
                     int64_t **cu, int64_t *n_docs) {
    *cu = NULL, *n_docs = 0;
    gdn_st_file *f = NULL;
    int rc = gdn_st_open(&f, path);
    if (rc) {
        fprintf(stderr, "%s: %s: %s\n", who, gdn_strerror(rc), gdn_errmsg());
        return 1;
    }
    const gdn_st_tensor *t = gdn_st_find(f, "cu_seqlens"), *tq = gdn_st_find(f, rows);
    /* (the caller has checked the rows tensor: run's q, layer's x, attention's x; a 2-D one is
     * [T, inner], one row) */
    const int two = tq && tq->ndim == 2;
    const int64_t B = two ? 1 : tq && tq->ndim >= 2 ? tq->shape[0] : 0,
                  T = two ? tq->shape[0] : tq && tq->ndim >= 2 ? tq->shape[1] : 0;
    int64_t *from_file = NULL, n_file = 0;
    if (t) {
        /* (a 1-D tensor's length is its shape; anything else is refused by the reader) */
        const size_t cap = t->ndim == 1 ? (size_t)t->shape[0] : 1;
        if (!(from_file = malloc(sizeof(int64_t) * (cap ? cap : 1))))
            rc = GDN_ERR_NOMEM, fprintf(stderr, "%s: out of memory for %s's cu_seqlens (%zu values)\n", who, path, cap);
        else if ((rc = gdn_st_read_ints(f, "cu_seqlens", from_file, cap, &n_file, 1)))
            fprintf(stderr, "%s: %s: %s\n", who, gdn_strerror(rc), gdn_errmsg());
    }
    gdn_st_close(f);
    if (rc) {
        free(from_file);
        return 1;
    }
    if (given && from_file && (n_given != n_file || memcmp(given, from_file, sizeof(int64_t) * n_file))) {
        fprintf(stderr, "%s: --cu-seqlens (%lld values) differs from the cu_seqlens tensor in %s (%lld values)%s\n",
                who, (long long)n_given, path, (long long)n_file,
                n_given == n_file ? ": the same count, different offsets" : "");
        free(from_file);
        return 1;
    }
    const int64_t *c = given ? given : from_file, n = given ? n_given : n_file;
    const char *src = given ? "--cu-seqlens" : "the file's cu_seqlens";
    if (!c) return 0; /* dense */
    /* The library checks these too; here the message can say where the offsets came from. */
    const char *bad = NULL;
    int64_t at = 0;
    if (n < 2) bad = "needs at least two offsets (0 and T: one document)";
    else if (c[0] != 0) bad = "must start at 0";
    else if (B != 1) bad = "needs B = 1 (one packed stream)";
    for (at = 0; !bad && at + 1 < n; at++)
        if (c[at + 1] <= c[at]) bad = "must be strictly increasing (no empty document)";
    if (!bad && c[n - 1] != T) bad = "must end at T";
    if (bad) {
        fprintf(stderr, "%s: %s %s: got", who, src, bad);
        for (int64_t i = 0; i < n && i < 16; i++) fprintf(stderr, "%s%lld", i ? "," : " ", (long long)c[i]);
        fprintf(stderr, "%s", n > 16 ? ",..." : "");
        if (!strcmp(bad, "needs B = 1 (one packed stream)")) fprintf(stderr, " with B = %lld in %s", (long long)B, path);
        else if (!strcmp(bad, "must end at T")) fprintf(stderr, " (T = %lld in %s)", (long long)T, path);
        else if (at > 0) fprintf(stderr, " (entries %lld and %lld)", (long long)(at - 1), (long long)at);
        fprintf(stderr, "\n");
        free(from_file);
        return 1;
    }
    *cu = malloc(sizeof(int64_t) * n);
    if (!*cu) {
        fprintf(stderr, "%s: out of memory for %lld offsets\n", who, (long long)n);
        free(from_file);
        return 1;
    }
    memcpy(*cu, c, sizeof(int64_t) * n);
    *n_docs = n - 1;
    free(from_file);
    return 0;
}

/* What the input's position_ids say about the tokens' positions: dense (every row b holds
 * off + t at t, one off for all rows) or packed (B = 1, counting from 0 and restarting at 0 at
 * each document start: *cu gets the offsets, malloc'ed). Anything else is refused naming the
 * first token that fits neither. */
int cli_positions_meaning(const char *who, const int64_t *p, int64_t B, int64_t T, int64_t *off, int64_t **cu,
                          int64_t *n_docs) {
    *cu = NULL, *n_docs = 0;
    if (p[0] < 0) return say(who, GDN_ERR_ARG, "position_ids[0] = %lld is negative", (long long)p[0]);
    int64_t bad_b = -1, bad_t = -1;
    for (int64_t b = 0; b < B && bad_b < 0; b++)
        for (int64_t t = 0; t < T; t++)
            if (p[b * T + t] != p[b * T] + t) {
                bad_b = b, bad_t = t;
                break;
            }
    if (bad_b < 0) { /* every row counts up by one: one offset for all of them */
        for (int64_t b = 1; b < B; b++)
            if (p[b * T] != p[0])
                return say(who, GDN_ERR_ARG,
                            "position_ids of row %lld start at %lld, row 0's at %lld: the layer takes one position "
                            "offset for every row",
                            (long long)b, (long long)p[b * T], (long long)p[0]);
        *off = p[0];
        return GDN_OK;
    }
    const int64_t *q = p + bad_b * T;
    if (B > 1 || q[bad_t] != 0 || p[0] != 0)
        return say(who, GDN_ERR_ARG,
                    "position_ids row %lld holds %lld at t = %lld after %lld: positions must be 0..T-1 plus one "
                    "offset per sequence, or restart at 0 at document starts (packed documents: one row, "
                    "counting from 0)",
                    (long long)bad_b, (long long)q[bad_t], (long long)bad_t, (long long)q[bad_t - 1]);
    int64_t docs = 1;
    for (int64_t t = 1; t < T; t++) {
        if (p[t] == 0) docs++;
        else if (p[t] != p[t - 1] + 1)
            return say(who, GDN_ERR_ARG,
                        "position_ids[%lld] = %lld after %lld: neither the next position nor a document start (0); "
                        "packed positions restart at 0 at each document and count up by one",
                        (long long)t, (long long)p[t], (long long)p[t - 1]);
    }
    int64_t *c = malloc(sizeof(int64_t) * (docs + 1));
    if (!c) return say(who, GDN_ERR_NOMEM, "%lld document offsets", (long long)(docs + 1));
    int64_t k = 0;
    for (int64_t t = 0; t < T; t++)
        if (p[t] == 0) c[k++] = t;
    c[k] = T;
    *cu = c, *n_docs = docs;
    return GDN_OK;
}

/* The input's position_ids, when it has them: [T], [1, T] or [B, T], I64 or I32. *p NULL when
 * absent. */
int cli_read_positions(const char *who, gdn_st_file *f, int64_t B, int64_t T, int64_t **p) {
    *p = NULL;
    const gdn_st_tensor *t = gdn_st_find(f, "position_ids");
    if (!t) return GDN_OK;
    const int fits = (t->ndim == 1 && t->shape[0] == T) || (t->ndim == 2 && t->shape[1] == T &&
                                                             (t->shape[0] == B || t->shape[0] == 1));
    if (!fits)
        return say(who, GDN_ERR_SHAPE, "'position_ids' must be [T = %lld] or [B = %lld, T] (or [1, T]), got %d dims (%lld, ...)",
                    (long long)T, (long long)B, t->ndim, (long long)(t->ndim ? t->shape[0] : 0));
    const size_t n = (size_t)(t)->numel;
    int64_t *q = malloc(sizeof(int64_t) * (n ? n : 1)), got = 0;
    if (!q) return say(who, GDN_ERR_NOMEM, "position_ids (%zu values)", n);
    const int rc = gdn_st_read_ints(f, "position_ids", q, n, &got, 0);
    if (rc) {
        free(q);
        return say(who, rc, "%s", gdn_errmsg());
    }
    if ((int64_t)n == T && B > 1) { /* one row given for all: the same positions in each */
        int64_t *all = realloc(q, sizeof(int64_t) * (size_t)(B * T));
        if (!all) {
            free(q);
            return say(who, GDN_ERR_NOMEM, "position_ids for %lld rows", (long long)B);
        }
        for (int64_t b = 1; b < B; b++) memcpy(all + b * T, all, sizeof(int64_t) * (size_t)T);
        q = all;
    }
    *p = q;
    return GDN_OK;
}

int cli_positions_match_documents(const char *who, int64_t T, int64_t off, const int64_t *pcu, int64_t pdocs,
                                  const int64_t *cu, int64_t n_docs) {
    if (!pcu) /* counting from off: one document at most, from 0 */
        return off || n_docs > 1 ? say(who, GDN_ERR_ARG, "position_ids count %lld..%lld without restarting, but "
                                       "cu_seqlens holds %lld document(s) (packed positions restart at 0 at each)",
                                       (long long)off, (long long)(off + T - 1), (long long)n_docs)
                                 : GDN_OK;
    int64_t i = 0; /* the first offset that differs (both lists end at T, so one does unless equal) */
    while (i <= pdocs && i <= n_docs && pcu[i] == cu[i]) i++;
    if (i > pdocs && i > n_docs) return GDN_OK;
    if (i < pdocs && i < n_docs) /* (offset n_docs is T, the end: no document starts there) */
        return say(who, GDN_ERR_ARG, "position_ids restart at documents other than cu_seqlens's: document %lld starts "
                   "at token %lld by position_ids, at %lld by cu_seqlens (%lld and %lld document(s))", (long long)i,
                   (long long)pcu[i], (long long)cu[i], (long long)pdocs, (long long)n_docs);
    return say(who, GDN_ERR_ARG, "position_ids restart at documents other than cu_seqlens's: position_ids hold %lld "
               "document(s), cu_seqlens %lld (the first %lld start alike)", (long long)pdocs, (long long)n_docs,
               (long long)i);
}

int cli_run_header(const char *path, int backward, long long *T, double *bytes_per_token) {
    gdn_st_file *f = NULL;
    const gdn_st_tensor *tq, *tv;
    int rc = gdn_st_open(&f, path);
    if (rc) {
        cli_error("run", rc);
        return rc;
    }
    if (!(tq = gdn_st_find(f, "q")) || tq->ndim != 4) {
        fprintf(stderr, "gdncp run: %s has no 4-D tensor 'q'\n", path);
        gdn_st_close(f);
        return GDN_ERR_MISSING;
    }
    /* (a malformed v is left to the loader to name: it only makes the estimate smaller) */
    const double qk = (double)tq->shape[2] * (double)tq->shape[3];
    double v = 0, g = 0;
    if ((tv = gdn_st_find(f, "v")) && tv->ndim == 4) v = (double)tv->shape[2] * (double)tv->shape[3], g = (double)tv->shape[2];
    const double in = 2 * qk + v + 2 * g + (backward ? v : 0), out = v + (backward ? 2 * qk + v + 2 * g : 0);
    *T = tq->shape[1];
    *bytes_per_token = 4.0 * (double)tq->shape[0] * (in + out);
    gdn_st_close(f);
    return GDN_OK;
}
