/* gdncp diff A B [--tol X]: for every tensor present in both files, max|a-b| / max|b| (B is the
 * reference). Exits 1 when any tensor exceeds the tolerance or a shape differs. */
#include "cli.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int cmd_diff(int argc, char **argv) {
    const char *pa = NULL, *pb = NULL;
    double tol = 1e-5;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tol") && i + 1 < argc) {
            char *end;
            tol = strtod(argv[++i], &end);
            if (*end || !(tol >= 0)) {
                fprintf(stderr, "gdncp diff: --tol needs a number >= 0, got '%s'\n", argv[i]);
                return 1;
            }
        } else if (!pa) pa = argv[i];
        else if (!pb) pb = argv[i];
        else {
            fprintf(stderr, "gdncp diff: unexpected argument '%s'\n", argv[i]);
            return 1;
        }
    }
    if (!pa || !pb) {
        fprintf(stderr, "gdncp diff: usage: gdncp diff OURS.safetensors REFERENCE.safetensors [--tol X]\n");
        return 1;
    }
    gdn_st_file *a = NULL, *b = NULL;
    int rc = gdn_st_open(&a, pa);
    if (!rc) rc = gdn_st_open(&b, pb);
    if (rc) {
        gdn_st_close(a);
        return cli_error("diff", rc);
    }
    int compared = 0, bad = 0;
    for (int i = 0; i < gdn_st_count(a); i++) {
        const gdn_st_tensor *ta = gdn_st_at(a, i), *tb = gdn_st_find(b, ta->name);
        if (!tb) continue;
        int same = ta->ndim == tb->ndim;
        for (int d = 0; same && d < ta->ndim; d++) same = ta->shape[d] == tb->shape[d];
        if (!same) {
            printf("%-8s shapes differ\n", ta->name);
            bad++;
            continue;
        }
        const int64_t n = gdn_st_numel(ta);
        double *x = malloc(sizeof(double) * (n ? n : 1)), *y = malloc(sizeof(double) * (n ? n : 1));
        if (!x || !y || (rc = gdn_st_read_f64(a, ta->name, x, n)) || (rc = gdn_st_read_f64(b, ta->name, y, n))) {
            free(x), free(y);
            gdn_st_close(a), gdn_st_close(b);
            return cli_error("diff", rc ? rc : GDN_ERR_NOMEM);
        }
        double num = 0, den = 0;
        for (int64_t j = 0; j < n; j++) {
            double d = fabs(x[j] - y[j]);
            if (!(d <= num)) num = d;
            den = fmax(den, fabs(y[j]));
        }
        double rel = den > 0 ? num / den : num;
        int ok = rel <= tol;
        printf("%-8s %-5s rel err %.3e (max abs err %.3e, max |ref| %.3e)\n", ta->name,
               ok ? "ok" : "OVER", rel, num, den);
        bad += !ok;
        compared++;
        free(x), free(y);
    }
    gdn_st_close(a), gdn_st_close(b);
    if (!compared) {
        fprintf(stderr, "gdncp diff: no tensor name is common to %s and %s\n", pa, pb);
        return 1;
    }
    printf("%d tensor(s) compared, %d over tolerance %.1e\n", compared, bad, tol);
    return bad ? 1 : 0;
}
