/* The layers in BF16 compute mode (cfg.compute = GDN_COMPUTE_BF16, compute.h), on the BF16 path
 * this CPU runs (printed), forward and backward: the GatedDeltaNet layer in both memory modes, the
 * gated attention layer keeping all or only the core.
 *
 * 1. Against its own oracle, the double reference layer with the same operands rounded to bf16
 *    (gdn_layer_reference_* with compute = BF16): all that is left is fp32's accumulation and the
 *    fp32 kernel, plus the rare element whose fp32 and double values round to different bf16
 *    neighbours (an intermediate: the gated norm's output, z, dproj; each a bf16 ulp in one term
 *    of a sum). Measured norm-wise (l2_err), tolerance ORACLE_TOL on y and ORACLE_GRAD_TOL on
 *    the gradients (the chunk kernel's forward products run bf16 too, its backward fp32 from the
 *    states that forward saved: the oracle has no such split).
 *    Negative controls through the same check: the recurrent state rounded to bf16 after every
 *    chunk (the round trip the mode must not do: the kernel's site "chunk: the state kept in bf16"; on y),
 *    and the fp32 layer (whose products are not rounded; on y and the worst gradient).
 * 2. Against the fp32 oracle (exact products): the accuracy a user gets, stated per tensor:
 *    bf16 operands give ~2^-9 relative per operand, in practice ~5e-3 on y and ~1e-2 on the
 *    gradients (printed); tolerance F32_TOL. Control: the BF16 GEMM's k pairs shifted by one
 *    (SITE_BF16_PAIR_SHIFT) through the same check.
 * 3. The whole model (the hybrid `tiny`: its MLP, lm_head and both mixers' projections in bf16)
 *    against itself in fp32: the loss within MODEL_LOSS_TOL, every gradient within MODEL_TOL
 *    (norm-wise; the worst tensor printed); control: the shifted k pairs.
 * The attention layer: the same two checks; its controls are the fp32 layer through the BF16
 * oracle's check and the shifted k pairs through the fp32 one (it has no recurrent state).
 * Shapes keep every product above 16 rows (products of <= 16 rows run fp32 in either mode). */
#include "harness.h"
#include "gdncp.h"
#include "kernel_internal.h"
#include "attention_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ORACLE_TOL 2e-4      /* y vs the bf16 oracle */
#define ORACLE_GRAD_TOL 2e-3 /* the gradients vs the bf16 oracle: the kernel's backward runs fp32 from the
                              * states its BF16 forward saved, the oracle's exactly from its own; measured
                              * <= 8.4e-4, the fp32 layer (the control) 7e-3 and above */
#define KERNEL_ORACLE_TOL 5e-4 /* the BF16 kernel vs its oracle: measured 1.3e-4 to 1.6e-4, the bf16 rounding of an fp32
                                  * intermediate (tm, Dl) flipping to the other neighbour than its double; controls >= 2e-3 */
#define ATTN_ORACLE_TOL 5e-4 /* the attention layer's y vs its bf16 oracle: the probabilities it rounds are
                              * exp of fp32 scores; with sharp scores (|s| ~ 30) their relative difference from
                              * the double ones is ~1e-5, and one in a few hundred rounds to the other bf16
                              * neighbour (measured 4e-5 to 1.5e-4; every control >= 1e-2) */
#define ATTN_ORACLE_GRAD_TOL 1e-3 /* the attention layer's gradients vs its bf16 oracle: dS = P (dP - D) is a
                                   * cancelling difference, so its fp32 value rounds to the other bf16 neighbour
                                   * than its double more often than other operands do (measured <= 2.1e-4) */
#define F32_TOL 5e-2
#define MODEL_TOL 5e-2      /* the model's gradients vs fp32, norm-wise (measured 1.9e-2) */
#define MODEL_LOSS_TOL 1e-3 /* its loss vs fp32, relative (measured 2e-5 at the initialisation) */

/* Norm-wise relative error ||x - ref||_2 / ||ref||_2 (NaN fails). Not the max-abs measure of the
 * fp32 tests: the oracle rounds its own double intermediates (the norm's output, z, dproj) to
 * bf16, and the rare element whose fp32 value rounds to the other bf16 neighbour moves one
 * output row by up to a bf16 ulp of one term; norm-wise such a flip is diluted by the tensor's
 * size, while a systematic error (the controls) is not. */
static double l2_err(const float *xf, const double *xd, const double *ref, int64_t n) {
    double num = 0.0, den = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double d = (xf ? (double)xf[i] : xd[i]) - ref[i];
        num += d * d, den += ref[i] * ref[i];
    }
    const double e = sqrt(num) / fmax(sqrt(den), REL_ERR_FLOOR);
    return e == e ? e : INFINITY;
}
#define rel_err_f32(x, ref, n) l2_err((x), NULL, (ref), (n))
#define rel_err_dd(x, ref, n) l2_err(NULL, (x), (ref), (n))

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
 * every weight gradient against r. Checked: y within tol, each gradient within gtol. Control:
 * y must differ by more than tol and, when gtol > 0, the worst gradient by more than gtol. */
static double run_case(const char *label, const char *what, gdn_layer_config c, const float *w, const float *x,
                       const float *dy, const ref_out *r, double tol, double gtol, int control) {
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
        const double ey = rel_err_f32(y, r->y, (int64_t)nx);
        if (!control) expect_close(ey, tol, "%s %s y (%s)", label, what, keep);
        double e = rel_err_f32(dx, r->dx, (int64_t)nx), worst_grad = e;
        if (!control) expect_close(e, gtol, "%s %s dx (%s)", label, what, keep);
        for (int i = 0; i < GDN_P_COUNT; i++) {
            const size_t off = gdn_layer_param_offset(&c, i);
            e = rel_err_f32(dw + off, r->dw + off, (int64_t)gdn_layer_param_numel(&c, i));
            if (!control) expect_close(e, gtol, "%s %s grad.%s (%s)", label, what, gdn_layer_param_name(i), keep);
            worst_grad = fmax(worst_grad, e);
        }
        if (control) {
            expect_far(ey, tol, "%s %s: y", label, what);
            if (gtol > 0) expect_far(worst_grad, gtol, "%s %s: the worst gradient", label, what);
        }
        worst = fmax(ey, worst_grad);
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
            run_case(label, "vs its bf16-operand oracle", c, w, x, dy, &rb, ORACLE_TOL, ORACLE_GRAD_TOL, 0);
        }
        c.keep = GDN_LAYER_KEEP_MIN;
        test_mutation = "chunk: the state kept in bf16";
        run_case(label, "control: state round-tripped through bf16 per chunk, vs the bf16 oracle", c, w, x, dy, &rb,
                 ORACLE_TOL, 0, 1);
        test_mutation = NULL;
        c.compute = GDN_COMPUTE_FP32;
        run_case(label, "control: the fp32 layer vs the bf16 oracle", c, w, x, dy, &rb, ORACLE_TOL, ORACLE_GRAD_TOL, 1);
        c.compute = GDN_COMPUTE_BF16;
        const double e = run_case(label, "vs the fp32 oracle (its accuracy)", c, w, x, dy, &r32, F32_TOL, F32_TOL, 0);
        if (!tests_quiet) printf("      %s: worst error vs the exact fp32 oracle %.2e\n", label, e);
        test_mutation = SITE_BF16_PAIR_SHIFT;
        run_case(label, "control: bf16 GEMM k pairs shifted, vs the fp32 oracle", c, w, x, dy, &r32, F32_TOL, F32_TOL, 1);
        test_mutation = NULL;
    }
    ref_free(&rb), ref_free(&r32);
    free(w), free(x), free(dy), free(xd), free(dyd), free(wd);
}

/* ---------------------------------------------------------------- the attention layer */

typedef struct {
    double *y, *dx, *dw;
} attn_out;

/* The attention layer in c's compute and keep mode on the fp32 inputs, or its double reference
 * (ref) on the same values; outputs widened to double. */
static int attn_run(const gdn_attn_config *c, int ref, const float *x, const float *w, const float *dy, attn_out *o) {
    const size_t nx = (size_t)c->B * c->T * c->E, nw = gdn_attn_param_floats(c);
    o->y = dalloc((int64_t)nx), o->dx = dalloc((int64_t)nx), o->dw = dalloc((int64_t)nw);
    if (ref) {
        double *xd = widen(x, nx), *wd = widen(w, nw), *dyd = widen(dy, nx);
        int rc = gdn_attn_reference_forward(c, o->y, xd, wd);
        if (!rc) rc = gdn_attn_reference_backward(c, o->dx, o->dw, xd, wd, dyd);
        free(xd), free(wd), free(dyd);
        return rc;
    }
    gdn_attn_plan *p = NULL;
    int rc = gdn_attn_plan_create(&p, c);
    if (rc) return rc;
    float *y = falloc((int64_t)nx), *dx = falloc((int64_t)nx), *dw = falloc((int64_t)nw);
    float *sv = falloc((int64_t)gdn_attn_saved_floats(p) + 1);
    rc = gdn_attn_forward(p, y, sv, x, w);
    if (!rc) rc = gdn_attn_backward(p, dx, dw, x, w, sv, dy);
    for (size_t i = 0; i < nx; i++) o->y[i] = y[i], o->dx[i] = dx[i];
    for (size_t i = 0; i < nw; i++) o->dw[i] = dw[i];
    free(y), free(dx), free(dw), free(sv);
    gdn_attn_plan_destroy(p);
    return rc;
}
static void attn_free(attn_out *o) { free(o->y), free(o->dx), free(o->dw); }

/* Every tensor of o against r: y within tol, dx and the weight gradients within gtol (control:
 * y must differ by more than tol). */
static void attn_compare(const char *label, const char *what, const gdn_attn_config *c, const attn_out *o,
                         const attn_out *r, double tol, double gtol, int control) {
    const int64_t nx = c->B * c->T * c->E;
    if (control) {
        expect_far(rel_err_dd(o->y, r->y, nx), tol, "%s %s: y", label, what);
        return;
    }
    expect_close(rel_err_dd(o->y, r->y, nx), tol, "%s %s y", label, what);
    expect_close(rel_err_dd(o->dx, r->dx, nx), gtol, "%s %s dx", label, what);
    for (int p = 0; p < GDN_A_COUNT; p++) {
        const size_t off = gdn_attn_param_offset(c, p);
        expect_close(rel_err_dd(o->dw + off, r->dw + off, (int64_t)gdn_attn_param_numel(c, p)), gtol, "%s %s grad.%s",
                     label, what, gdn_attn_param_name(p));
    }
}

/* Whether two runs gave the same bits (y, dx, dw). */
static int attn_same_bits(const gdn_attn_config *c, const attn_out *a, const attn_out *b) {
    const size_t nx = (size_t)(c->B * c->T * c->E), nw = gdn_attn_param_floats(c);
    return !memcmp(a->y, b->y, sizeof(double) * nx) && !memcmp(a->dx, b->dx, sizeof(double) * nx) &&
           !memcmp(a->dw, b->dw, sizeof(double) * nw);
}

/* The attention layer: its projections and its core's products in bf16 (the core on each BF16
 * path in turn: the site "attention: the BF16 path of the core"), against its oracle (which rounds what the core rounds, P
 * against the core's lazy running max: attention_reference.c) and the fp32 oracle. norm_w: the
 * q/k norm weights (large: sharp scores, so a row's running max moves in later key tiles). Bit for
 * bit: AMX emulated == the fallback in TDPBF16PS's order, AMX == AMX emulated, AVX512-BF16 == the
 * fallback (where the CPU has them). */
static void attention_case(int64_t B, int64_t T, int64_t E, int64_t H, int64_t Hkv, int64_t d, double norm_w,
                           uint64_t seed) {
    gdn_attn_config c = gdn_attn_config_default(B, T, E, H, Hkv, d);
    c.R = d / 2, c.rope_theta = 1e4;
    rng_seed(seed);
    const size_t nx = (size_t)B * T * E;
    float *w = attn_random_weights(&c), *x = random_floats(nx), *dy = random_floats(nx);
    if (norm_w != 0)
        for (int p = GDN_A_Q_NORM; p <= GDN_A_K_NORM; p++)
            for (size_t i = 0; i < gdn_attn_param_numel(&c, p); i++) w[gdn_attn_param_offset(&c, p) + i] = (float)norm_w;
    char label[160];
    snprintf(label, sizeof label, "bf16 attention B=%lld T=%lld E=%lld H=%lld Hkv=%lld d=%lld norm w %g", (long long)B,
             (long long)T, (long long)E, (long long)H, (long long)Hkv, (long long)d, norm_w);
    attn_out rb = {0}, r32 = {0}, o = {0};
    c.compute = GDN_COMPUTE_BF16;
    int rc = attn_run(&c, 1, x, w, dy, &rb);
    c.compute = GDN_COMPUTE_FP32;
    if (!rc) rc = attn_run(&c, 1, x, w, dy, &r32);
    if (rc) {
        check(0, "%s: reference: %s", label, gdn_errmsg());
    } else {
        c.compute = GDN_COMPUTE_BF16;
        for (int keep = GDN_ATTN_KEEP_ALL; keep <= GDN_ATTN_KEEP_CORE; keep++) {
            c.keep = keep;
            if (!attn_run(&c, 0, x, w, dy, &o))
                attn_compare(label, keep == GDN_ATTN_KEEP_ALL ? "vs its bf16-operand oracle (keep all)"
                                                              : "vs its bf16-operand oracle (keep core)",
                             &c, &o, &rb, ATTN_ORACLE_TOL, ATTN_ORACLE_GRAD_TOL, 0);
            else
                check(0, "%s: %s", label, gdn_errmsg());
            attn_free(&o);
        }
        c.keep = GDN_ATTN_KEEP_ALL;
        /* the core on each path: 0 emulated AMX, 1 the fallback in AMX order, 2 the fallback,
         * 3 AVX512-BF16, 4 AMX */
        static const int path[5] = {GDN_BF16_AMX_EMU, GDN_BF16_FALLBACK, GDN_BF16_FALLBACK, GDN_BF16_AVX512, GDN_BF16_AMX};
        static const char *name[5] = {"AMX emulated", "fallback (AMX order)", "fallback", "AVX512-BF16", "AMX"};
        attn_out po[5] = {{0}};
        int ran[5] = {0};
        for (int k = 0; k < 5; k++) {
            if (!gdn_bf16_path_available(path[k])) {
                if (!tests_quiet) printf("      %s: core on %s: not on this CPU (its bits are the emulated ones')\n", label, name[k]);
                continue;
            }
            /* the projections run on the automatic path: where that is the fallback (no
             * AVX512-BF16), they too must be in AMX order in both runs compared bit for bit */
            char sites[128];
            snprintf(sites, sizeof sites, "attention: the BF16 path of the core=%d%s", path[k], k <= 1 ? "," SITE_BF16_AMX_ORDER : "");
            test_mutation = sites;
            ran[k] = !attn_run(&c, 0, x, w, dy, &po[k]);
            test_mutation = NULL;
            check(ran[k], "%s: core on %s ran", label, name[k]);
            if (!ran[k]) continue;
            char what[96];
            snprintf(what, sizeof what, "[core on %s] vs its bf16-operand oracle", name[k]);
            attn_compare(label, what, &c, &po[k], &rb, ATTN_ORACLE_TOL, ATTN_ORACLE_GRAD_TOL, 0);
        }
        if (ran[0] && ran[1]) check(attn_same_bits(&c, &po[0], &po[1]), "%s: core AMX emulated == fallback (AMX order) bit for bit", label);
        if (ran[4] && ran[0]) check(attn_same_bits(&c, &po[4], &po[0]), "%s: core AMX == AMX emulated bit for bit", label);
        if (ran[3] && ran[2]) check(attn_same_bits(&c, &po[3], &po[2]), "%s: core AVX512-BF16 == fallback bit for bit", label);
        for (int k = 0; k < 5; k++) attn_free(&po[k]);
        if (!attn_run(&c, 0, x, w, dy, &o))
            attn_compare(label, "vs the fp32 oracle (its accuracy)", &c, &o, &r32, F32_TOL, F32_TOL, 0);
        attn_free(&o);
        test_mutation = SITE_BF16_PAIR_SHIFT;
        if (!attn_run(&c, 0, x, w, dy, &o))
            attn_compare(label, "control: bf16 GEMM k pairs shifted, vs the fp32 oracle", &c, &o, &r32, F32_TOL, F32_TOL, 1);
        attn_free(&o);
        test_mutation = SITE_BF16_TRUNCATE;
        if (!attn_run(&c, 0, x, w, dy, &o))
            attn_compare(label, "control: operands truncated to bf16, vs its bf16-operand oracle", &c, &o, &rb, ATTN_ORACLE_TOL,
                         ATTN_ORACLE_TOL, 1);
        test_mutation = NULL;
        attn_free(&o);
        c.compute = GDN_COMPUTE_FP32;
        if (!attn_run(&c, 0, x, w, dy, &o))
            attn_compare(label, "control: the fp32 layer vs the bf16 oracle", &c, &o, &rb, ATTN_ORACLE_TOL, ATTN_ORACLE_TOL, 1);
        attn_free(&o);
    }
    attn_free(&rb), attn_free(&r32);
    free(w), free(x), free(dy);
}

/* ---------------------------------------------------------------- the model */

/* Loss and flat gradient of the tiny hybrid model on one batch in the given precision. */
static int model_step(const gdn_model_config *mc, int compute, const float *w, const gdn_token *tok, int64_t B,
                      int64_t T, double *loss, float *dw) {
    gdn_model_run run = {.B = B, .T = T, .threads = 0, .check_finite = 1, .compute = compute};
    gdn_model_plan *p = NULL;
    int rc = gdn_model_plan_create(&p, mc, &run, NULL);
    if (!rc) rc = model_train_step(p, w, dw, tok, (double)(B * T), loss);
    gdn_model_plan_destroy(p);
    return rc;
}

static void model_case(void) {
    gdn_model_config mc;
    if (!gdn_model_config_named("tiny", &mc)) {
        check(0, "the named tiny model exists");
        return;
    }
    const int64_t B = 2, T = 48, nw = (int64_t)gdn_model_param_floats(&mc);
    float *w = falloc(nw), *dw32 = falloc(nw), *dwb = falloc(nw);
    gdn_model_init(&mc, w, 5);
    gdn_token *tok = malloc(sizeof(gdn_token) * (size_t)(B * (T + 1)));
    rng_seed(21);
    for (int64_t i = 0; i < B * (T + 1); i++) tok[i] = (gdn_token)(32 + (int)rng_uniform(0, 90));
    double l32 = NAN, lb = NAN, lbad = NAN;
    int rc = model_step(&mc, GDN_COMPUTE_FP32, w, tok, B, T, &l32, dw32);
    if (!rc) rc = model_step(&mc, GDN_COMPUTE_BF16, w, tok, B, T, &lb, dwb);
    if (rc) {
        check(0, "bf16 model step: %s", gdn_errmsg());
    } else {
        double *ref = dalloc(nw);
        for (int64_t i = 0; i < nw; i++) ref[i] = dw32[i];
        const double el = fabs(lb - l32) / fabs(l32), eg = rel_err_f32(dwb, ref, nw);
        expect_close(el, MODEL_LOSS_TOL, "bf16 model (tiny, B=%lld T=%lld) loss vs fp32 (%.6f vs %.6f)", (long long)B,
                     (long long)T, lb / (double)(B * T), l32 / (double)(B * T));
        expect_close(eg, MODEL_TOL, "bf16 model (tiny) every gradient vs fp32 (norm-wise)");
        int worst = -1;
        double we = 0;
        for (int i = 0; i < gdn_model_tensor_count(&mc); i++) {
            gdn_model_tensor_info info;
            gdn_model_tensor(&mc, i, &info);
            const double e = rel_err_f32(dwb + info.offset, ref + info.offset, (int64_t)info.numel);
            if (e > we) we = e, worst = i;
        }
        gdn_model_tensor_info info;
        if (worst >= 0 && !gdn_model_tensor(&mc, worst, &info) && !tests_quiet)
            printf("      bf16 model: the worst tensor's gradient vs fp32: %s %.2e\n", info.name, we);
        test_mutation = SITE_BF16_PAIR_SHIFT;
        rc = model_step(&mc, GDN_COMPUTE_BF16, w, tok, B, T, &lbad, dwb);
        test_mutation = NULL;
        if (rc) check(0, "bf16 model control step: %s", gdn_errmsg());
        else {
            expect_far(rel_err_f32(dwb, ref, nw), MODEL_TOL, "control: bf16 model with k pairs shifted, gradient vs fp32");
            expect_far(fabs(lbad - l32) / fabs(l32), MODEL_LOSS_TOL, "control: bf16 model with k pairs shifted, loss vs fp32");
        }
        free(ref);
    }
    free(w), free(dw32), free(dwb), free(tok);
}

/* Decode-sized products (<= 16 rows) run fp32 in either mode: a BF16 plan's decode steps equal
 * the fp32 plan's bit for bit (y and both states), while its forward over 40 rows is not the
 * fp32 one (control: the BF16 products did run there). */
static void decode_case(void) {
    gdn_layer_config c = gdn_layer_config_default(2, 20, 24, 2, 4, 8, 12);
    rng_seed(31);
    float *w = layer_random_weights(&c, 0.05, 1);
    const int64_t B = c.B, E = c.E, cd = gdn_layer_conv_dim(&c);
    const size_t nconv = (size_t)B * cd * c.Kc, ns = (size_t)B * c.Hv * c.K * c.V, nx = (size_t)B * c.T * E;
    float *x = random_floats(nx), *y[2], *conv[2], *rec[2], *yf[2];
    int rc = 0;
    for (int cm = 0; cm < 2; cm++) {
        y[cm] = falloc((int64_t)(B * E)), yf[cm] = falloc((int64_t)nx);
        conv[cm] = falloc((int64_t)nconv), rec[cm] = falloc((int64_t)ns);
        memset(conv[cm], 0, sizeof(float) * nconv), memset(rec[cm], 0, sizeof(float) * ns);
        c.compute = cm;
        gdn_layer_plan *lp = NULL;
        rc = rc ? rc : gdn_layer_plan_create(&lp, &c);
        for (int t = 0; t < 5 && !rc; t++) { /* 5 tokens one at a time (x's first 5 of each row) */
            float xt[2 * 24];
            for (int64_t b = 0; b < B; b++) memcpy(xt + b * E, x + (b * c.T + t) * E, sizeof(float) * (size_t)E);
            rc = gdn_layer_decode(lp, y[cm], xt, w, conv[cm], rec[cm]);
        }
        if (!rc) rc = gdn_layer_forward(lp, yf[cm], NULL, x, w, NULL, NULL);
        gdn_layer_plan_destroy(lp);
    }
    if (rc) {
        check(0, "bf16 decode: %s", gdn_errmsg());
    } else {
        check(!memcmp(y[0], y[1], sizeof(float) * (size_t)(B * E)) && !memcmp(rec[0], rec[1], sizeof(float) * ns) &&
                  !memcmp(conv[0], conv[1], sizeof(float) * nconv),
              "bf16 plan: decode (2 rows a step) = the fp32 plan's bit for bit (y, conv and recurrent states)");
        check(memcmp(yf[0], yf[1], sizeof(float) * nx) != 0,
              "control: the bf16 plan's forward over 40 rows differs from fp32's (its products ran in bf16)");
    }
    for (int cm = 0; cm < 2; cm++) free(y[cm]), free(yf[cm]), free(conv[cm]), free(rec[cm]);
    free(w), free(x);
}

/* ---------------------------------------------------------------- the chunk kernel */

/* The kernel in c's compute mode on the float inputs (h0 may be NULL); o, ht widened to double. */
static int kernel_run(const gdn_config *c, const float *const f[6], double *o, double *ht) {
    const int64_t no = c->B * c->T * c->Hv * c->V, ns = gdn_state_floats(c);
    float *fo = malloc(sizeof(float) * no), *fh = malloc(sizeof(float) * ns);
    gdn_plan *p = NULL;
    int rc = gdn_plan_create(&p, c);
    if (!rc)
        rc = gdn_forward(p, fo, fh, &(gdn_rule_inputs){.q = f[0], .k = f[1], .v = f[2], .g = f[3], .beta = f[4], .h0 = f[5]});
    for (int64_t i = 0; !rc && i < no; i++) o[i] = fo[i];
    for (int64_t i = 0; !rc && i < ns; i++) ht[i] = fh[i];
    gdn_plan_destroy(p);
    free(fo), free(fh);
    return rc;
}

/* The worse of o's and ht's norm-wise errors against (ro, rh). */
static double kernel_err(const gdn_config *c, const double *o, const double *ht, const double *ro, const double *rh) {
    const double eo = rel_err_dd(o, ro, c->B * c->T * c->Hv * c->V), eh = rel_err_dd(ht, rh, gdn_state_floats(c));
    return eo > eh ? eo : eh;
}

/* One kernel shape: the BF16 kernel against its oracle (gdn_reference_forward with compute =
 * BF16: the chunked algorithm in double, the same operands rounded) within KERNEL_ORACLE_TOL, on the
 * automatic path and on `also` (another BF16 path, e.g. AMX emulated; 0: none); controls: the
 * state round-tripped through bf16 per chunk, and the fp32 kernel, through the same check.
 * Against the exact oracle: its accuracy, within F32_TOL (printed); control: k pairs shifted. */
static void kernel_case(int64_t B, int64_t T, int64_t Hk, int64_t Hv, int64_t K, int64_t V, int chunk,
                        const int64_t *cu, int64_t ndocs, int with_h0, int also, uint64_t seed) {
    gdn_config c = gdn_config_default(B, T, Hk, Hv, K, V);
    c.chunk = chunk, c.cu_seqlens = cu, c.n_docs = ndocs;
    rng_seed(seed);
    const int64_t nqk = B * T * Hk * K, nv = B * T * Hv * V, ng = B * T * Hv, ns = gdn_state_floats(&c);
    const int64_t n[6] = {nqk, nqk, nv, ng, ng, ns};
    float *f[6];
    double *d[6];
    for (int t = 0; t < 6; t++) {
        f[t] = malloc(sizeof(float) * n[t]), d[t] = malloc(sizeof(double) * n[t]);
        for (int64_t i = 0; i < n[t]; i++) {
            /* gates weak enough that the state carries across chunks (else its rounding hides) */
            const double x = t == 3 ? rng_uniform(-0.08, 0) : t == 4 ? rng_uniform(0.1, 1) : rng_uniform(-1, 1);
            f[t][i] = (float)x, d[t][i] = f[t][i];
        }
    }
    if (!with_h0) f[5] = (free(f[5]), NULL), d[5] = (free(d[5]), NULL);
    double *rb_o = dalloc(nv), *rb_h = dalloc(ns), *r32_o = dalloc(nv), *r32_h = dalloc(ns), *o = dalloc(nv), *ht = dalloc(ns);
    char label[160];
    snprintf(label, sizeof label, "bf16 kernel B=%lld T=%lld Hk=%lld Hv=%lld K=%lld V=%lld C=%d%s%s", (long long)B,
             (long long)T, (long long)Hk, (long long)Hv, (long long)K, (long long)V, chunk, cu ? " packed" : "",
             with_h0 ? " h0" : "");
    const gdn_rule_inputs_f64 in = {.q = d[0], .k = d[1], .v = d[2], .g = d[3], .beta = d[4], .h0 = d[5]};
    gdn_config cb = c;
    cb.compute = GDN_COMPUTE_BF16;
    if (gdn_reference_forward(&cb, rb_o, rb_h, &in) || gdn_reference_forward(&c, r32_o, r32_h, &in)) {
        check(0, "%s: oracle: %s", label, gdn_errmsg());
    } else {
        const int paths[2] = {0, also};
        char site[64];
        for (int pi = 0; pi < 2; pi++) {
            if (pi && !also) continue;
            snprintf(site, sizeof site, "kernel: the BF16 path a plan uses=%d", paths[pi]);
            test_mutation = site;
            const char *pname = gdn_bf16_path_name(paths[pi] ? paths[pi] : gdn_bf16_path_auto());
            int rc = kernel_run(&cb, (const float *const *)f, o, ht);
            expect_close(rc ? INFINITY : kernel_err(&c, o, ht, rb_o, rb_h), KERNEL_ORACLE_TOL, "%s [%s] o, ht vs its bf16-operand oracle",
                         label, pname);
            if (pi == 0) {
                const double e = rc ? INFINITY : kernel_err(&c, o, ht, r32_o, r32_h);
                expect_close(e, F32_TOL, "%s o, ht vs the exact oracle (its accuracy)", label);
                if (!tests_quiet) printf("      %s: error vs the exact oracle %.2e\n", label, e);
            }
        }
        test_mutation = "chunk: the state kept in bf16";
        int rc = kernel_run(&cb, (const float *const *)f, o, ht);
        test_mutation = NULL;
        expect_far(rc ? 0.0 : kernel_err(&c, o, ht, rb_o, rb_h), KERNEL_ORACLE_TOL,
                   "%s control: state round-tripped through bf16 per chunk, vs the bf16 oracle", label);
        rc = kernel_run(&c, (const float *const *)f, o, ht);
        expect_far(rc ? 0.0 : kernel_err(&c, o, ht, rb_o, rb_h), KERNEL_ORACLE_TOL, "%s control: the fp32 kernel vs the bf16 oracle",
                   label);
        test_mutation = SITE_BF16_PAIR_SHIFT;
        rc = kernel_run(&cb, (const float *const *)f, o, ht);
        test_mutation = NULL;
        expect_far(rc ? 0.0 : kernel_err(&c, o, ht, r32_o, r32_h), F32_TOL,
                   "%s control: bf16 GEMM k pairs shifted, vs the exact oracle", label);
    }
    for (int t = 0; t < 6; t++) free(f[t]), free(d[t]);
    free(rb_o), free(rb_h), free(r32_o), free(r32_h), free(o), free(ht);
}

void test_compute_bf16(void) {
    if (!tests_quiet) printf("bf16 layer: products on %s\n", gdn_compute_path(GDN_COMPUTE_BF16));
    /* grouped heads, K != V, T over several chunks and not a multiple of one; gates weak enough
     * that the state carries across chunks (else its rounding is invisible) */
    one_shape(2, 45, 48, 2, 4, 16, 24, 16, 1, 11);
    one_shape(1, 150, 64, 2, 4, 32, 16, 16, 0.05, 12);
    /* the attention layer: GQA, a T over the core's tiles, E and every projection width > 16 */
    attention_case(2, 40, 32, 4, 2, 16, 0, 13);
    /* several key tiles and query blocks (a partial last one), d over two B panels, sharp scores;
     * 4 heads a kv head: blocks of 32 tokens, so a block sees part of a key tile that holds more
     * (the packed V^T and K^T are deeper than the product) */
    attention_case(1, 200, 48, 8, 2, 48, 2, 14);
    model_case();
    decode_case();
    /* the chunk kernel: grouped heads, K != V, ragged T, several chunk sizes, h0, packed
     * documents (chunks restart at each); the AMX kernel's tile bookkeeping emulated on one */
    if (!tests_quiet) printf("bf16 kernel: chunk products on %s\n", gdn_bf16_path_name(gdn_bf16_path_auto()));
    kernel_case(2, 150, 2, 4, 32, 48, 32, NULL, 0, 1, GDN_BF16_AMX_EMU, 21);
    kernel_case(1, 200, 1, 2, 64, 64, 64, NULL, 0, 0, GDN_BF16_FALLBACK, 22);
    static const int64_t cu[4] = {0, 70, 181, 250};
    kernel_case(1, 250, 2, 2, 16, 32, 16, cu, 3, 1, 0, 23);
    /* compute out of range: refused by the config check */
    gdn_layer_config c = gdn_layer_config_default(1, 8, 16, 1, 1, 8, 8);
    c.compute = 7;
    gdn_layer_plan *lp = NULL;
    expect_status(gdn_layer_plan_create(&lp, &c), GDN_ERR_ARG, "compute", "bf16 layer: compute = 7 refused");
    gdn_layer_plan_destroy(lp);
    gdn_config kc = gdn_config_default(1, 8, 1, 1, 8, 8);
    kc.compute = 2;
    expect_status(gdn_config_check(&kc), GDN_ERR_ARG, "compute", "bf16 kernel: compute = 2 refused");
    int cm = -1;
    expect_status(gdn_compute_parse("fp16", &cm), GDN_ERR_ARG, "fp16", "compute 'fp16' refused");
    check(!gdn_compute_parse("bf16", &cm) && cm == GDN_COMPUTE_BF16, "compute 'bf16' parsed");
}
