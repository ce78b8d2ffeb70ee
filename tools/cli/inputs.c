/* Input files of gdncp run and gdncp layer: packed-document offsets, the run file's header. */
#include "cli.h"
#include "parse.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
        else if ((rc = gdn_st_read_i64(f, "cu_seqlens", from_file, cap, &n_file)))
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
