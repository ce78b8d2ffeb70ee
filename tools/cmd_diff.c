/* gdncp diff A B [--tol X]: for every tensor present in both files, max|a-b| / max|b| (B is the
 * reference). Exits 1 when any tensor exceeds the tolerance or a shape differs, and when any
 * tensor of either file (common to both or not) holds a NaN or an Inf: stderr names the tensor,
 * the file and the first flat index. */
#include "cli/cli.h"
#include "commands.h"
#include "cli/parse.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Read tensor t of file f (at path) as doubles into *out (returns a status, or -1 when it has
 * printed an allocation failure itself); a NaN or Inf is reported on stderr by
 * tensor, file and first flat index, and counted in *nonfinite. Tensors of other dtypes (integers)
 * cannot hold NaN: they are skipped when only scanned, and refused where compared. */
static int read_checked(gdn_st_file *f, const char *path, const gdn_st_tensor *t, int compare,
                        double **out, int *nonfinite) {
    *out = NULL;
    const int64_t n = (t)->numel;
    if (t->dtype == GDN_DTYPE_OTHER && !compare) return GDN_OK;
    double *x = malloc(sizeof(double) * (n ? n : 1));
    if (!x) {
        fprintf(stderr, "gdncp diff: %s: cannot allocate %lld doubles for tensor '%s' of %s\n",
                gdn_strerror(GDN_ERR_NOMEM), (long long)n, t->name, path);
        return -1; /* reported here */
    }
    int rc = gdn_st_read(f, t->name, GDN_F64, x, (size_t)n, 0, 0, -1);
    if (rc) {
        free(x);
        return rc;
    }
    int64_t at = 0;
    while (at < n && isfinite(x[at])) at++;
    if (at < n) {
        fprintf(stderr, "gdncp diff: tensor '%s' in %s holds %s at flat index %lld (the first)\n",
                t->name, path, isnan(x[at]) ? "NaN" : x[at] > 0 ? "+Inf" : "-Inf", (long long)at);
        printf("%-8s NaN/Inf in %s at flat index %lld\n", t->name, path, (long long)at);
        ++*nonfinite;
    }
    *out = x;
    return GDN_OK;
}

typedef struct {
    const char *files[2]; /* OURS, REFERENCE */
    double tol;
} diff_opts;

static void diff_init(void *p) { ((diff_opts *)p)->tol = 1e-5; }

static const cli_opt diff_table[] = {
    /* a relative error: from about 2 on, any two tensors of similar magnitude pass, so a tolerance
     * above 1000 (or inf) can only be a mistake */
    {CLI_F64("--tol", diff_opts, tol, 0.0, 1e3, "X", "the largest relative error max|ours - ref| / max|ref| (the absolute one where ref is all zeros) that passes")},
};

const cli_command cmd_diff_cli = {
    .name = "diff",
    .usage = "usage: gdncp diff OURS.safetensors REFERENCE.safetensors [--tol X]\n",
    .summary = "per-tensor relative error of two files against a tolerance; fails on NaN/Inf",
    .about = "  per-tensor relative error max|ours - ref| / max|ref| of the tensors both files hold;\n"
             "  exit status 1 when one exceeds X\n",
    .size = sizeof(diff_opts), .init = diff_init, CLI_OPTS(diff_table),
    .max_pos = 2, .pos_off = offsetof(diff_opts, files),
};

int cmd_diff(int argc, char **argv) {
    diff_opts o;
    if (cli_parse(&cmd_diff_cli, argc, argv, &o, NULL)) return CLI_USAGE_ERROR;
    const char *pa = o.files[0], *pb = o.files[1];
    const double tol = o.tol;
    if (!pa || !pb) {
        fputs(cmd_diff_cli.usage, stderr);
        return CLI_USAGE_ERROR;
    }
    gdn_st_file *a = NULL, *b = NULL;
    int rc = gdn_st_open(&a, pa);
    if (!rc) rc = gdn_st_open(&b, pb);
    if (rc) {
        gdn_st_close(a);
        return cli_error("diff", rc);
    }
    int compared = 0, bad = 0, nonfinite = 0;
    const gdn_st_tensor *ta;
    for (int i = 0; (ta = gdn_st_at(a, i)); i++) {
        const gdn_st_tensor *tb = gdn_st_find(b, ta->name);
        int same = tb && ta->ndim == tb->ndim;
        for (int d = 0; same && d < ta->ndim; d++) same = ta->shape[d] == tb->shape[d];
        if (tb && !same) {
            printf("%-8s shapes differ\n", ta->name);
            bad++;
        }
        double *x = NULL, *y = NULL;
        rc = read_checked(a, pa, ta, same, &x, &nonfinite);
        if (!rc && same) rc = read_checked(b, pb, tb, 1, &y, &nonfinite);
        if (rc) {
            free(x), free(y);
            gdn_st_close(a), gdn_st_close(b);
            return rc < 0 ? 1 : cli_error("diff", rc);
        }
        if (!same) {
            free(x);
            continue;
        }
        const int64_t n = (ta)->numel;
        double num = 0, den = 0;
        for (int64_t j = 0; j < n; j++) {
            double d = fabs(x[j] - y[j]);
            if (!(d <= num)) num = d;
            den = fmax(den, fabs(y[j]));
        }
        double rel = den > 0 ? num / den : num;
        int ok = rel <= tol && !(isnan(num) || isinf(num) || isinf(den));
        printf("%-8s %-5s rel err %.3e (max abs err %.3e, max |ref| %.3e)\n", ta->name,
               ok ? "ok" : "OVER", rel, num, den);
        bad += !ok;
        compared++;
        free(x), free(y);
    }
    /* Tensors only in the reference are not compared, but must be finite too. */
    const gdn_st_tensor *tb;
    for (int i = 0; (tb = gdn_st_at(b, i)); i++) {
        if (gdn_st_find(a, tb->name)) continue;
        double *y = NULL;
        rc = read_checked(b, pb, tb, 0, &y, &nonfinite);
        free(y);
        if (rc) {
            gdn_st_close(a), gdn_st_close(b);
            return rc < 0 ? 1 : cli_error("diff", rc);
        }
    }
    gdn_st_close(a), gdn_st_close(b);
    if (!compared) {
        fprintf(stderr, "gdncp diff: no tensor name is common to %s and %s\n", pa, pb);
        return 1;
    }
    printf("%d tensor(s) compared, %d over tolerance %.1e, %d with NaN/Inf\n", compared, bad, tol,
           nonfinite);
    if (nonfinite)
        fprintf(stderr, "gdncp diff: NaN or Inf found (%d tensor(s) over both files): failure\n", nonfinite);
    return bad || nonfinite ? 1 : 0;
}
