/* The GatedDeltaNet layer in BF16 compute mode (cfg.compute = GDN_COMPUTE_BF16, compute.h), on
 * the BF16 path this CPU runs (printed), forward and backward in both memory modes.
 *
 * 1. Against its own oracle, the double reference layer with the same operands rounded to bf16
 *    (gdn_layer_reference_* with compute = BF16): all that is left is fp32's accumulation and the
 *    fp32 kernel, plus the rare element whose fp32 and double values round to different bf16
 *    neighbours (an intermediate: the gated norm's output, dproj, ~1e-5 of the elements, each a
 *    2^-9 change in one term of a sum). Tolerance ORACLE_TOL per tensor (observed ~1e-6..3e-5).
 *    Negative controls through the same check: the recurrent state rounded to bf16 after every
 *    chunk (the round trip the mode must not do: the kernel's GDN_KERNEL_FAULT_STATE_BF16), and
 *    the fp32 layer (whose products are not rounded).
 * 2. Against the fp32 oracle (exact products): the accuracy a user gets, stated per tensor:
 *    bf16 operands give ~2^-9 relative per operand, in practice ~5e-3 on y and ~1e-2 on the
 *    gradients (printed); tolerance F32_TOL. Control: the BF16 GEMM's k pairs shifted by one
 *    (GDN_BF16_FAULT_PAIR_SHIFT) through the same check.
 * Shapes keep every product above 16 rows (products of <= 16 rows run fp32 in either mode). */
#include "harness.h"
#include "kernel_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ORACLE_TOL 2e-4
#define F32_TOL 5e-2

typedef struct {
    double *y, *dx, *dw;
} ref_out;

static double *widen(const float *x, size_t n) {
    double *d = malloc(sizeof(double) * (n + 1));
    for (size_t i = 0; i < n; i++) d[i] = x[i];
    return d;
}

static int reference(gdn_layer_config c, int compute, const double *x, const double *w, const double *dy,
                     ref_out *r) {
    const size_t nx = (size_t)c.B * c.T * c.E;
    c.compute = compute;
    r->y = malloc(sizeof(double) * nx), r->dx = malloc(sizeof(double) * nx);
    r->dw = malloc(sizeof(double) * gdn_layer_param_floats(&c));
    int rc = gdn_layer_reference_forward(&c, r->y, x, w);
    if (!rc) rc = gdn_layer_reference_backward(&c, r->dx, r->dw, x, w, dy);
    return rc;
}
static void ref_free(ref_out *r) { free(r->y), free(r->dx), free(r->dw); }

/* The layer (c.compute, c.keep as given) forward + backward; the worst error over y, dx and
 * every weight gradient against r, each checked (expect) or required to fail (control). */
static double run_case(const char *label, const char *what, gdn_layer_config c, const float *w, const float *x,
                       const float *dy, const ref_out *r, double tol, int control) {
    gdn_layer_plan *lp;
    if (gdn_layer_plan_create(&lp, &c)) {
        check(0, "%s: plan: %s", label, gdn_errmsg());
        return INFINITY;
    }
    const size_t nx = (size_t)c.B * c.T * c.E, nw = gdn_layer_param_floats(&c);
    float *y = malloc(sizeof(float) * nx), *dx = malloc(sizeof(float) * nx), *dw = malloc(sizeof(float) * nw);
    float *saved = malloc(sizeof(float) * (gdn_layer_saved_floats(lp) + 1));
    int rc = gdn_layer_forward(lp, y, saved, x, w, NULL, NULL);
    if (!rc) rc = gdn_layer_backward(lp, dx, dw, x, w, saved, dy);
    double worst = INFINITY;
    if (rc) {
        check(0, "%s: %s: %s", label, what, gdn_errmsg());
    } else {
        const char *keep = c.keep == GDN_LAYER_KEEP_PROJ ? "keep proj" : "keep min";
        double e = rel_err_f32(y, r->y, (int64_t)nx);
        worst = e;
        if (control) {
            expect_far(e, tol, "%s %s: y", label, what);
        } else {
            expect_close(e, tol, "%s %s y (%s)", label, what, keep);
            e = rel_err_f32(dx, r->dx, (int64_t)nx);
            expect_close(e, tol, "%s %s dx (%s)", label, what, keep);
            worst = fmax(worst, e);
            for (int i = 0; i < GDN_P_COUNT; i++) {
                const size_t off = gdn_layer_param_offset(&c, i);
                e = rel_err_f32(dw + off, r->dw + off, (int64_t)gdn_layer_param_numel(&c, i));
                expect_close(e, tol, "%s %s grad.%s (%s)", label, what, gdn_layer_param_name(i), keep);
                worst = fmax(worst, e);
            }
        }
    }
    free(y), free(dx), free(dw), free(saved);
    gdn_layer_plan_destroy(lp);
    return worst;
}

static void one_shape(int64_t B, int64_t T, int64_t E, int64_t Hk, int64_t Hv, int64_t K, int64_t V, int chunk,
                      double a_hi, uint64_t seed) {
    gdn_layer_config c = gdn_layer_config_default(B, T, E, Hk, Hv, K, V);
    c.chunk = chunk;
    rng_seed(seed);
    float *w = layer_random_weights(&c, 0.05, a_hi);
    const size_t nx = (size_t)B * T * E, nw = gdn_layer_param_floats(&c);
    float *x = random_floats(nx), *dy = random_floats(nx);
    double *xd = widen(x, nx), *dyd = widen(dy, nx), *wd = widen(w, nw);
    ref_out rb = {0}, r32 = {0};
    char label[160];
    snprintf(label, sizeof label, "bf16 layer B=%lld T=%lld E=%lld Hk=%lld Hv=%lld K=%lld V=%lld C=%d A<=%g",
             (long long)B, (long long)T, (long long)E, (long long)Hk, (long long)Hv, (long long)K, (long long)V,
             chunk, a_hi);
    if (reference(c, GDN_COMPUTE_BF16, xd, wd, dyd, &rb) || reference(c, GDN_COMPUTE_FP32, xd, wd, dyd, &r32)) {
        check(0, "%s: reference: %s", label, gdn_errmsg());
    } else {
        c.compute = GDN_COMPUTE_BF16;
        for (int keep = 0; keep < 2; keep++) {
            c.keep = keep;
            run_case(label, "vs its bf16-operand oracle", c, w, x, dy, &rb, ORACLE_TOL, 0);
        }
        c.keep = GDN_LAYER_KEEP_MIN;
        gdn_kernel_fault = GDN_KERNEL_FAULT_STATE_BF16;
        run_case(label, "control: state round-tripped through bf16 per chunk, vs the bf16 oracle", c, w, x, dy, &rb,
                 ORACLE_TOL, 1);
        gdn_kernel_fault = 0;
        c.compute = GDN_COMPUTE_FP32;
        run_case(label, "control: the fp32 layer vs the bf16 oracle", c, w, x, dy, &rb, ORACLE_TOL, 1);
        c.compute = GDN_COMPUTE_BF16;
        const double e = run_case(label, "vs the fp32 oracle (its accuracy)", c, w, x, dy, &r32, F32_TOL, 0);
        if (!tests_quiet) printf("      %s: worst error vs the exact fp32 oracle %.2e\n", label, e);
        gdn_bf16_fault = GDN_BF16_FAULT_PAIR_SHIFT;
        run_case(label, "control: bf16 GEMM k pairs shifted, vs the fp32 oracle", c, w, x, dy, &r32, F32_TOL, 1);
        gdn_bf16_fault = 0;
    }
    ref_free(&rb), ref_free(&r32);
    free(w), free(x), free(dy), free(xd), free(dyd), free(wd);
}

void test_layer_bf16(void) {
    if (!tests_quiet) printf("bf16 layer: products on %s\n", gdn_compute_path(GDN_COMPUTE_BF16));
    /* grouped heads, K != V, T over several chunks and not a multiple of one; gates weak enough
     * that the state carries across chunks (else its rounding is invisible) */
    one_shape(2, 45, 48, 2, 4, 16, 24, 16, 1, 11);
    one_shape(1, 150, 64, 2, 4, 32, 16, 32, 2, 12);
    /* compute out of range: refused by the config check */
    gdn_layer_config c = gdn_layer_config_default(1, 8, 16, 1, 1, 8, 8);
    c.compute = 7;
    gdn_layer_plan *lp = NULL;
    expect_status(gdn_layer_plan_create(&lp, &c), GDN_ERR_ARG, "compute", "bf16 layer: compute = 7 refused");
    gdn_layer_plan_destroy(lp);
    int cm = -1;
    expect_status(gdn_compute_parse("fp16", &cm), GDN_ERR_ARG, "fp16", "compute 'fp16' refused");
    check(!gdn_compute_parse("bf16", &cm) && cm == GDN_COMPUTE_BF16, "compute 'bf16' parsed");
}
