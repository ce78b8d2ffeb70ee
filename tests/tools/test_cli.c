/* End to end: the gdncp command on the golden files and on bad input. */
#include "harness.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* Run a shell command; return its exit status and keep its stderr in `err`. */
static int run_cli(char *err, size_t errn, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int run_cli(char *err, size_t errn, const char *fmt, ...) {
    char args[2048], cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof cmd, "%s %s 2>/tmp/gdncp_cli_err.txt >/dev/null", GDN_CLI_PATH, args);
    int st = system(cmd);
    FILE *f = fopen("/tmp/gdncp_cli_err.txt", "r");
    size_t n = f ? fread(err, 1, errn - 1, f) : 0;
    while (n > 0 && err[n - 1] == '\n') n--;
    err[n] = 0;
    if (f) fclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

/* Relative error of tensor `name` in `out` against the F64 reference of the same name. */
static double compare_file(const char *out, const char *ref, const char *name) {
    gdn_st_file *a = NULL, *b = NULL;
    double err = INFINITY;
    if (gdn_st_open(&a, out) == GDN_OK && gdn_st_open(&b, ref) == GDN_OK) {
        const gdn_st_tensor *t = gdn_st_find(b, name);
        if (t) {
            int64_t n = (t)->numel;
            float *x = malloc(sizeof(float) * n);
            double *r = malloc(sizeof(double) * n);
            if (gdn_st_read_f32(a, name, x, n) == GDN_OK && gdn_st_read_f64(b, name, r, n) == GDN_OK)
                err = rel_err_f32(x, r, n);
            free(x), free(r);
        }
    }
    gdn_st_close(a), gdn_st_close(b);
    return err;
}

/* gdncp diff: NaN or Inf anywhere in either file fails (exit 1) and stderr names the tensor, the
 * file and the first flat index; the same files without them compare clean (the control). */
static void diff_nonfinite(void) {
    char a[] = "/tmp/gdncp_diffa_XXXXXX", b[] = "/tmp/gdncp_diffb_XXXXXX", err[4096], needle[256];
    close(mkstemp(a)), close(mkstemp(b));
    float x[24], y[24], z[6];
    for (int i = 0; i < 24; i++) x[i] = y[i] = (float)(i - 11) * 0.25f;
    for (int i = 0; i < 6; i++) z[i] = (float)i;
    const gdn_named_tensor ta[] = {{"o", 2, {4, 6}, x}, {"extra", 1, {6}, z}}, tb[] = {{"o", 2, {4, 6}, y}};
    gdn_save_tensors(b, tb, 1, "test");
    gdn_save_tensors(a, ta, 2, "test");
    int st = run_cli(err, sizeof err, "diff %s %s", a, b);
    check(st == 0, "gdncp diff of equal finite files exits 0 (%s)", err);
    struct { const char *what; float *arr; int at; float val; const char *name, *file; } cases[] = {
        {"NaN in the compared file", x, 17, NAN, "o", a},
        {"NaN as the last element of the compared file", x, 23, NAN, "o", a},
        {"+Inf in the reference", y, 3, INFINITY, "o", b},
        {"Inf at the same place in both files", NULL, 5, -INFINITY, "o", a},
        {"NaN in a tensor only the compared file has", z, 4, NAN, "extra", a},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        float keep_x = x[cases[i].at], keep_y = y[cases[i].at];
        if (cases[i].arr) cases[i].arr[cases[i].at] = cases[i].val;
        else x[cases[i].at] = y[cases[i].at] = cases[i].val;
        gdn_save_tensors(a, ta, 2, "test");
        gdn_save_tensors(b, tb, 1, "test");
        st = run_cli(err, sizeof err, "diff %s %s", a, b);
        snprintf(needle, sizeof needle, "tensor '%s' in %s holds %s at flat index %d", cases[i].name, cases[i].file,
                 isnan(cases[i].val) ? "NaN" : cases[i].val > 0 ? "+Inf" : "-Inf", cases[i].at);
        check(st == 1 && strstr(err, needle) != NULL, "gdncp diff, %s -> exit %d, stderr names '%s' (%s)", cases[i].what, st,
              needle, err);
        if (cases[i].arr == z) z[cases[i].at] = (float)cases[i].at;
        x[cases[i].at] = keep_x, y[cases[i].at] = keep_y;
    }
    /* NaN in a reference-only tensor: "extra" moved to the reference file. */
    z[2] = NAN;
    const gdn_named_tensor tb2[] = {{"o", 2, {4, 6}, y}, {"extra", 1, {6}, z}};
    gdn_save_tensors(a, tb, 1, "test");
    gdn_save_tensors(b, tb2, 2, "test");
    st = run_cli(err, sizeof err, "diff %s %s", a, b);
    snprintf(needle, sizeof needle, "tensor 'extra' in %s holds NaN at flat index 2", b);
    check(st == 1 && strstr(err, needle) != NULL, "gdncp diff, NaN in a tensor only the reference has -> exit %d (%s)", st, err);
    z[2] = 2.0f;
    gdn_save_tensors(b, tb2, 2, "test");
    st = run_cli(err, sizeof err, "diff %s %s", a, b);
    check(st == 0, "gdncp diff after the values are restored exits 0 (control; %s)", err);
    unlink(a), unlink(b);
}

void test_cli(void) {
    char err[4096], out[] = "/tmp/gdncp_cli_XXXXXX", gold[1024];
    int fd = mkstemp(out);
    close(fd);
    const char *names[] = {"gdn_small", "gdn_strong_gates", "gdn_qwen_heads"};
    for (int i = 0; i < 3; i++) {
        snprintf(gold, sizeof gold, "%s/%s.safetensors", GDN_GOLDEN_DIR, names[i]);
        int st = run_cli(err, sizeof err, "run --in %s --out %s", gold, out);
        check(st == 0, "gdncp run --in %s exits 0 (%s)", names[i], err);
        expect_close(compare_file(out, gold, "o"), 1e-5, "gdncp run %s: o vs golden", names[i]);
        expect_close(compare_file(out, gold, "ht"), 1e-5, "gdncp run %s: ht vs golden", names[i]);
        st = run_cli(err, sizeof err, "run --reference --in %s --out %s", gold, out);
        /* The oracle's only error is the final rounding to F32 (2^-24 relative per element). */
        expect_close(st ? INFINITY : compare_file(out, gold, "o"), 1e-6, "gdncp run --reference %s: o vs golden", names[i]);
        st = run_cli(err, sizeof err, "run --chunk 16 --threads 1 --no-l2norm --in %s --out %s", gold, out);
        expect_far(st ? INFINITY : compare_file(out, gold, "o"), 1e-5, "gdncp run --no-l2norm %s vs golden", names[i]);
    }
    /* Gradients: --backward against the golden autodiff gradients, fast and oracle paths. */
    static const char *grads[] = {"dq", "dk", "dv", "dg", "dbeta", "dh0"};
    for (int i = 0; i < 3; i++) {
        snprintf(gold, sizeof gold, "%s/%s.safetensors", GDN_GOLDEN_DIR, names[i]);
        for (int ref = 0; ref < 2; ref++) {
            int st = run_cli(err, sizeof err, "run --backward %s --in %s --out %s", ref ? "--reference" : "", gold, out);
            check(st == 0, "gdncp run --backward%s %s exits 0 (%s)", ref ? " --reference" : "", names[i], err);
            for (int gi = 0; gi < (i == 1 ? 5 : 6); gi++) /* gdn_strong_gates has no h0 */
                expect_close(compare_file(out, gold, grads[gi]), ref ? 1e-6 : 2e-5, "gdncp run --backward%s %s: %s vs golden",
                             ref ? " --reference" : "", names[i], grads[gi]);
        }
        int st = run_cli(err, sizeof err, "run --backward --no-l2norm --in %s --out %s", gold, out);
        expect_far(st ? INFINITY : compare_file(out, gold, "dq"), 2e-5, "gdncp run --backward --no-l2norm %s: dq vs golden", names[i]);
    }
    /* Bad invocations: non-zero exit, stderr names the problem, an existing output survives. */
    snprintf(gold, sizeof gold, "%s/gdn_small.safetensors", GDN_GOLDEN_DIR);
    char nodo[1100];
    snprintf(nodo, sizeof nodo, "%s.nodo", out);
    gdn_problem pb;
    if (gdn_problem_load(&pb, gold, 0, 0, -1, 0) == GDN_OK) { /* the inputs without 'do' */
        const gdn_config *c = &pb.cfg;
        const gdn_named_tensor t[] = {{"q", 4, {c->B, c->T, c->Hk, c->K}, pb.q}, {"k", 4, {c->B, c->T, c->Hk, c->K}, pb.k},
                                      {"v", 4, {c->B, c->T, c->Hv, c->V}, pb.v}, {"g", 3, {c->B, c->T, c->Hv}, pb.g},
                                      {"beta", 3, {c->B, c->T, c->Hv}, pb.beta}};
        gdn_save_tensors(nodo, t, 5, "test");
        gdn_problem_free(&pb);
    }
    run_cli(err, sizeof err, "run --in %s --out %s", gold, out);
    struct { const char *args, *needle; } bad[] = {
        {"run --in /nonexistent.safetensors --out %s", "cannot open"},
        {"run --chunk 48 --in GOLD --out %s", "--chunk"},
        {"run --chunk abc --in GOLD --out %s", "--chunk"},
        {"run --scale nan --in GOLD --out %s", "--scale"},
        {"run --in GOLD", "--out"},
        {"run --bogus --in GOLD --out %s", "--bogus"},
        {"run --in %s --out %s.2", "'q'"}, /* the output file itself is not a problem file */
        {"frobnicate", "unknown command"},
        {"run --backward --in %s.nodo --out %s.3", "'do' is missing"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char args[1024], tmp[1024];
        snprintf(tmp, sizeof tmp, "%s", bad[i].args);
        char *g = strstr(tmp, "GOLD");
        if (g) {
            char rest[512];
            snprintf(rest, sizeof rest, "%s", g + 4);
            snprintf(g, sizeof tmp - (g - tmp), "%s%s", gold, rest);
        }
        snprintf(args, sizeof args, tmp, out, out);
        int st = run_cli(err, sizeof err, "%s", args);
        check(st != 0 && strstr(err, bad[i].needle) != NULL, "gdncp %s -> exit %d, stderr names '%s'", args, st, bad[i].needle);
    }
    expect_close(compare_file(out, gold, "o"), 1e-5, "earlier output intact after failed runs");
    unlink(out);
    unlink(nodo);
    diff_nonfinite();
}
