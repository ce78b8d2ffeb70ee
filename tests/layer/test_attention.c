/* Qwen3.5's gated full-attention layer (include/gdncp/attention.h):
 *   1. the double reference against central finite differences of its own forward;
 *   2. the double reference and the fp32 layer against transformers' exact (float64) module
 *      (tests/data/qwen35_tiny/attn.io.safetensors), y, dx, every weight gradient, and y_off at
 *      positions 1000..1063;
 *   3. the fp32 layer against the double reference on a T that is not a multiple of the tile,
 *      saved and recomputed backward, thread counts;
 *   4. packed documents == each document alone;
 *   5. bad input.
 * Every comparison has a negative control: a deliberately wrong variant (wrong weights or a wrong
 * configuration fed through the same code) run through the same comparison must fail it. */
#include "harness.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GOLDEN(name) GDN_GOLDEN_DIR "/" name


/* ---------------------------------------------------------------- running either implementation */

enum { REF = 0, F32 = 1, F32_RECOMPUTE = 2, F32_KEEP_CORE = 3 };
static const char *const mode_name[] = {"reference", "fp32", "fp32 (backward recomputes)",
                                        "fp32 (keeps the core's output only)"};

/* y (and with dy: dx, dw) of the layer in double: the reference, or the fp32 layer on inputs
 * rounded to fp32 (with its saved floats, or recomputing them). */
static int run_attn(int mode, const gdn_attn_config *c, const double *w, const double *x, const double *dy, double *y,
                    double *dx, double *dw) {
    if (mode == REF) {
        int rc = gdn_attn_reference_forward(c, y, x, w);
        if (!rc && dy) rc = gdn_attn_reference_backward(c, dx, dw, x, w, dy);
        return rc;
    }
    const int64_t nx = c->B * c->T * c->E;
    const size_t nw = gdn_attn_param_floats(c);
    gdn_attn_plan *p = NULL;
    gdn_attn_config ck = *c;
    if (mode == F32_KEEP_CORE) ck.keep = GDN_ATTN_KEEP_CORE;
    int rc = gdn_attn_plan_create(&p, &ck);
    if (rc) return rc;
    float *xf = falloc(nx), *dyf = falloc(nx), *yf = falloc(nx), *dxf = falloc(nx), *wf = falloc(nw), *dwf = falloc(nw);
    float *sv = mode == F32 || mode == F32_KEEP_CORE ? falloc(gdn_attn_saved_floats(p)) : NULL;
    for (int64_t i = 0; i < nx; i++) xf[i] = (float)x[i], dyf[i] = dy ? (float)dy[i] : 0.0f;
    for (size_t i = 0; i < nw; i++) wf[i] = (float)w[i];
    rc = gdn_attn_forward(p, yf, sv, xf, wf);
    if (!rc && dy) rc = gdn_attn_backward(p, dxf, dwf, xf, wf, sv, dyf);
    for (int64_t i = 0; i < nx; i++) y[i] = yf[i];
    if (dy) {
        for (int64_t i = 0; i < nx; i++) dx[i] = dxf[i];
        for (size_t i = 0; i < nw; i++) dw[i] = dwf[i];
    }
    free(xf), free(dyf), free(yf), free(dxf), free(wf), free(dwf), free(sv);
    gdn_attn_plan_destroy(p);
    return rc;
}

/* ---------------------------------------------------------------- wrong variants as weights */

/* The query/gate interleave read as concatenated ([all queries | all gates]): weights whose
 * interleaved reading is the concatenated reading of src. */
static void w_concat(const gdn_attn_config *c, double *dst, const double *src) {
    const int64_t d = c->d, H = c->H, E = c->E, Hd = H * d;
    memcpy(dst, src, sizeof(double) * gdn_attn_param_floats(c));
    const double *s = src + gdn_attn_param_offset(c, GDN_A_Q_PROJ);
    double *q = dst + gdn_attn_param_offset(c, GDN_A_Q_PROJ);
    for (int64_t h = 0; h < H; h++)
        for (int64_t i = 0; i < d; i++) {
            memcpy(q + (2 * h * d + i) * E, s + (h * d + i) * E, sizeof(double) * E);
            memcpy(q + (2 * h * d + d + i) * E, s + (Hd + h * d + i) * E, sizeof(double) * E);
        }
}

/* Query head j moved to position (j % Hkv) r + j / Hkv (its q_proj rows and o_proj columns): the
 * layer then runs head j on kv head j % Hkv (the tiled grouping) — same y as that wrong layer. */
static void w_gqa_mod(const gdn_attn_config *c, double *dst, const double *src) {
    const int64_t d = c->d, H = c->H, E = c->E, Hd = H * d, r = H / c->Hkv;
    memcpy(dst, src, sizeof(double) * gdn_attn_param_floats(c));
    const double *sq = src + gdn_attn_param_offset(c, GDN_A_Q_PROJ), *so = src + gdn_attn_param_offset(c, GDN_A_O_PROJ);
    double *q = dst + gdn_attn_param_offset(c, GDN_A_Q_PROJ), *o = dst + gdn_attn_param_offset(c, GDN_A_O_PROJ);
    for (int64_t j = 0; j < H; j++) {
        const int64_t p = (j % c->Hkv) * r + j / c->Hkv;
        memcpy(q + 2 * p * d * E, sq + 2 * j * d * E, sizeof(double) * 2 * d * E);
        for (int64_t e = 0; e < E; e++)
            for (int64_t i = 0; i < d; i++) o[e * Hd + p * d + i] = so[e * Hd + j * d + i];
    }
}

/* The gate left out: gate rows zero (sigmoid = 1/2) and o_proj doubled, exactly the layer without
 * its gate. */
static void w_no_gate(const gdn_attn_config *c, double *dst, const double *src) {
    const int64_t d = c->d, E = c->E;
    memcpy(dst, src, sizeof(double) * gdn_attn_param_floats(c));
    double *q = dst + gdn_attn_param_offset(c, GDN_A_Q_PROJ), *o = dst + gdn_attn_param_offset(c, GDN_A_O_PROJ);
    for (int64_t h = 0; h < c->H; h++) memset(q + (2 * h * d + d) * E, 0, sizeof(double) * d * E);
    for (size_t i = 0; i < gdn_attn_param_numel(c, GDN_A_O_PROJ); i++) o[i] *= 2.0;
}

/* RoPE pairing adjacent dims (2i, 2i+1) instead of halves (i, i + R/2): the query rows of q_proj,
 * the rows of k_proj and both norm weights with dim 2i moved to i and 2i+1 to i + R/2 (the
 * norm's mean and q.k do not see the order of the dims): exactly the adjacent-pairing layer. */
static void w_rope_adjacent(const gdn_attn_config *c, double *dst, const double *src) {
    const int64_t d = c->d, E = c->E, half = c->R / 2;
    memcpy(dst, src, sizeof(double) * gdn_attn_param_floats(c));
    for (int64_t a = 0; a < 2 * half; a++) {
        const int64_t to = a % 2 ? a / 2 + half : a / 2;
        const size_t oq = gdn_attn_param_offset(c, GDN_A_Q_PROJ), ok = gdn_attn_param_offset(c, GDN_A_K_PROJ);
        for (int64_t h = 0; h < c->H; h++)
            memcpy(dst + oq + (2 * h * d + to) * E, src + oq + (2 * h * d + a) * E, sizeof(double) * E);
        for (int64_t j = 0; j < c->Hkv; j++)
            memcpy(dst + ok + (j * d + to) * E, src + ok + (j * d + a) * E, sizeof(double) * E);
        for (int p = GDN_A_Q_NORM; p <= GDN_A_K_NORM; p++)
            dst[gdn_attn_param_offset(c, p) + to] = src[gdn_attn_param_offset(c, p) + a];
    }
}

/* The norms' (1 + w) read as w: weights w - 1. */
static void w_norm_plain(const gdn_attn_config *c, double *dst, const double *src) {
    memcpy(dst, src, sizeof(double) * gdn_attn_param_floats(c));
    for (int p = GDN_A_Q_NORM; p <= GDN_A_K_NORM; p++)
        for (size_t i = 0; i < gdn_attn_param_numel(c, p); i++) dst[gdn_attn_param_offset(c, p) + i] -= 1.0;
}

static double *random_weights(const gdn_attn_config *c) {
    const size_t nw = gdn_attn_param_floats(c);
    double *w = dalloc(nw);
    for (int p = 0; p < GDN_A_COUNT; p++) {
        int64_t shape[2];
        const int nd = gdn_attn_param_shape(c, p, shape);
        const double a = nd == 2 ? 1.5 / sqrt((double)shape[1]) : 0.4; /* norms: w near 0, (1 + w) near 1 */
        for (size_t i = 0; i < gdn_attn_param_numel(c, p); i++) w[gdn_attn_param_offset(c, p) + i] = rng_uniform(-a, a);
    }
    return w;
}

/* ---------------------------------------------------------------- 1. finite differences */

static double loss_of(const gdn_attn_config *c, const double *x, const double *w, const double *dy, double *y) {
    if (gdn_attn_reference_forward(c, y, x, w) != GDN_OK) return NAN;
    double s = 0.0;
    for (int64_t i = 0; i < c->B * c->T * c->E; i++) s += y[i] * dy[i];
    return s;
}

static void fd_grads(const gdn_attn_config *c, double *x, double *w, const double *dy, double *fdx, double *fdw) {
    const double h = 1e-6;
    const int64_t nx = c->B * c->T * c->E;
    double *y = dalloc(nx);
    for (int64_t i = 0; i < nx; i++) {
        const double x0 = x[i];
        x[i] = x0 + h;
        const double lp = loss_of(c, x, w, dy, y);
        x[i] = x0 - h;
        const double lm = loss_of(c, x, w, dy, y);
        x[i] = x0;
        fdx[i] = (lp - lm) / (2 * h);
    }
    memset(fdw, 0, sizeof(double) * gdn_attn_param_floats(c));
    for (int p = 0; p < GDN_A_COUNT; p++) {
        const size_t off = gdn_attn_param_offset(c, p);
        for (size_t i = 0; i < gdn_attn_param_numel(c, p); i++) {
            const double w0 = w[off + i];
            w[off + i] = w0 + h;
            const double lp = loss_of(c, x, w, dy, y);
            w[off + i] = w0 - h;
            const double lm = loss_of(c, x, w, dy, y);
            w[off + i] = w0;
            fdw[off + i] = (lp - lm) / (2 * h);
        }
    }
    free(y);
}

static void fd_case(void) {
    /* H = 4 on Hkv = 2 (so h / 2 and h % 2 differ), R = 4 of d = 6, positions from 3. */
    gdn_attn_config c = gdn_attn_config_default(2, 5, 6, 4, 2, 6);
    c.R = 4, c.rope_theta = 100.0, c.pos_offset = 3;
    const int64_t nx = c.B * c.T * c.E;
    const size_t nw = gdn_attn_param_floats(&c);
    rng_seed(1818);
    double *w = random_weights(&c), *x = dalloc(nx), *dy = dalloc(nx), *y = dalloc(nx), *dx = dalloc(nx);
    double *dw = dalloc(nw), *fdx = dalloc(nx), *fdw = dalloc(nw), *wt = dalloc(nw);
    for (int64_t i = 0; i < nx; i++) x[i] = rng_uniform(-1, 1), dy[i] = rng_uniform(-1, 1);
    for (size_t i = 0; i < nw; i++) dw[i] = NAN;
    expect_status(gdn_attn_reference_backward(&c, dx, dw, x, w, dy), GDN_OK, NULL,
                  "attention reference backward B=2 T=5 E=6 H=4 Hkv=2 d=6 R=4");
    fd_grads(&c, x, w, dy, fdx, fdw);
    /* h = 1e-6 on O(1) values: truncation ~1e-12, rounding ~1e-10 absolute (DESIGN §6: 1e-7). */
    const double tol = 1e-7;
    expect_close(rel_err_dd(dx, fdx, nx), tol, "FD dx (all %lld)", (long long)nx);
    for (int p = 0; p < GDN_A_COUNT; p++) {
        const size_t off = gdn_attn_param_offset(&c, p);
        expect_close(rel_err_dd(dw + off, fdw + off, (int64_t)gdn_attn_param_numel(&c, p)), tol, "FD grad.%s (all %zu)",
                     gdn_attn_param_name(p), gdn_attn_param_numel(&c, p));
    }
    /* the gate rows of q_proj on their own */
    {
        const size_t off = gdn_attn_param_offset(&c, GDN_A_Q_PROJ);
        double *a = dalloc(nw), *b = dalloc(nw);
        int64_t n = 0;
        for (int64_t h = 0; h < c.H; h++)
            for (int64_t i = 0; i < c.d * c.E; i++, n++)
                a[n] = dw[off + (2 * h * c.d + c.d) * c.E + i], b[n] = fdw[off + (2 * h * c.d + c.d) * c.E + i];
        expect_close(rel_err_dd(a, b, n), tol, "FD grad.q_proj.weight, the gate rows alone (%lld)", (long long)n);
        free(a), free(b);
    }
    /* Controls. (a) FD of the layer whose norms use w instead of 1 + w, against our dx and grads. */
    double *fdx2 = dalloc(nx), *fdw2 = dalloc(nw);
    w_norm_plain(&c, wt, w);
    fd_grads(&c, x, wt, dy, fdx2, fdw2);
    expect_far(rel_err_dd(dx, fdx2, nx), tol, "FD dx of the layer with norms (w) instead of (1 + w)");
    for (int p = GDN_A_Q_NORM; p <= GDN_A_K_NORM; p++) {
        const size_t off = gdn_attn_param_offset(&c, p);
        expect_far(rel_err_dd(dw + off, fdw2 + off, c.d), tol, "FD grad.%s of the layer with norms (w)",
                   gdn_attn_param_name(p));
    }
    /* (b) the analytic backward of q/gate read as concatenated, against the FD of the right layer */
    w_concat(&c, wt, w);
    double *dx2 = dalloc(nx), *dw2 = dalloc(nw);
    gdn_attn_reference_backward(&c, dx2, dw2, x, wt, dy);
    expect_far(rel_err_dd(dx2, fdx, nx), tol, "FD dx vs the backward with q/gate concatenated");
    for (int p = 0; p < GDN_A_COUNT; p++) {
        const size_t off = gdn_attn_param_offset(&c, p);
        expect_far(rel_err_dd(dw2 + off, fdw + off, (int64_t)gdn_attn_param_numel(&c, p)), tol,
                   "FD grad.%s vs the backward with q/gate concatenated", gdn_attn_param_name(p));
    }
    /* (c) the backward of RoPE pairing adjacent dims. (A wrong pos_offset is no control: a
     * uniform shift of every position cancels in q.k, RoPE being relative.) */
    w_rope_adjacent(&c, wt, w);
    gdn_attn_reference_backward(&c, dx2, dw2, x, wt, dy);
    expect_far(rel_err_dd(dx2, fdx, nx), tol, "FD dx vs the backward with RoPE pairing adjacent dims");
    free(w), free(x), free(dy), free(y), free(dx), free(dw), free(fdx), free(fdw), free(wt), free(fdx2), free(fdw2);
    free(dx2), free(dw2);
}

/* ---------------------------------------------------------------- 2. golden: transformers' module */

static void golden(void) {
    gdn_st_file *fw = NULL, *io = NULL;
    if (gdn_st_open(&fw, GOLDEN("qwen35_tiny/model.safetensors")) ||
        gdn_st_open(&io, GOLDEN("qwen35_tiny/attn.io.safetensors"))) {
        check(0, "open qwen35_tiny attention golden files: %s", gdn_errmsg());
        gdn_st_close(fw);
        return;
    }
    /* qwen35_tiny/config.json: hidden 96, 4 heads, 2 kv heads, head_dim 24, partial_rotary_factor
     * 0.25 (R = 6), rope_theta 10000, rms_norm_eps 1e-6; x [2, 150, 96]. */
    gdn_attn_config c = gdn_attn_config_default(2, 150, 96, 4, 2, 24);
    c.R = (int64_t)(24 * 0.25), c.rope_theta = 10000.0, c.eps = 1e-6f;
    const int64_t nx = c.B * c.T * c.E;
    const size_t nw = gdn_attn_param_floats(&c);
    double *w = dalloc(nw), *wt = dalloc(nw), *gref = dalloc(nw), *dw = dalloc(nw);
    double *x = dalloc(nx), *dy = dalloc(nx), *yref = dalloc(nx), *dxref = dalloc(nx), *y = dalloc(nx), *dx = dalloc(nx);
    int bad = 0;
    for (int p = 0; p < GDN_A_COUNT; p++) {
        char name[160];
        snprintf(name, sizeof name, "model.layers.3.self_attn.%s", gdn_attn_param_name(p));
        const gdn_st_tensor *t = gdn_st_find(fw, name);
        int64_t shape[2];
        const int nd = gdn_attn_param_shape(&c, p, shape);
        int ok = t && t->ndim == nd;
        for (int i = 0; ok && i < nd; i++) ok = t->shape[i] == shape[i];
        ok = ok && !gdn_st_read_f64(fw, name, w + gdn_attn_param_offset(&c, p), gdn_attn_param_numel(&c, p));
        snprintf(name, sizeof name, "grad.%s", gdn_attn_param_name(p));
        ok = ok && !gdn_st_read_f64(io, name, gref + gdn_attn_param_offset(&c, p), gdn_attn_param_numel(&c, p));
        if (!ok) check(0, "golden %s with the config's shape: %s", name, gdn_errmsg()), bad = 1;
    }
    const char *names[4] = {"x", "dy", "y", "dx"};
    double *dst[4] = {x, dy, yref, dxref};
    for (int i = 0; i < 4; i++)
        if (gdn_st_read_f64(io, names[i], dst[i], (size_t)nx)) check(0, "read '%s': %s", names[i], gdn_errmsg()), bad = 1;
    int64_t pos[150], np = 0, pos_off[64], np_off = 0;
    if (gdn_st_read_i64(io, "position_ids", pos, 150, &np) || np != 150 || pos[0] != 0 || pos[149] != 149 ||
        gdn_st_read_i64(io, "position_ids_off", pos_off, 64, &np_off) || np_off != 64 || pos_off[63] != pos_off[0] + 63)
        check(0, "golden position_ids 0..149 and position_ids_off consecutive"), bad = 1;
    gdn_attn_config co = c;
    co.B = 1, co.T = 64, co.pos_offset = bad ? 0 : pos_off[0];
    double *xo = dalloc(64 * 96), *yoref = dalloc(64 * 96), *yo = dalloc(64 * 96);
    if (gdn_st_read_f64(io, "x_off", xo, 64 * 96) || gdn_st_read_f64(io, "y_off", yoref, 64 * 96))
        check(0, "read x_off / y_off: %s", gdn_errmsg()), bad = 1;
    if (bad) goto out;

    for (int mode = REF; mode <= F32_RECOMPUTE; mode++) {
        /* double: 1e-10 (the file is exact); fp32: 1e-5 relative per tensor */
        const double tol = mode == REF ? 1e-10 : 1e-5;
        const char *m = mode_name[mode];
        expect_status(run_attn(mode, &c, w, x, dy, y, dx, dw), GDN_OK, NULL, "%s golden forward + backward", m);
        expect_close(rel_err_dd(y, yref, nx), tol, "%s y [2,150,96] vs transformers", m);
        expect_close(rel_err_dd(dx, dxref, nx), tol, "%s dx vs transformers", m);
        for (int p = 0; p < GDN_A_COUNT; p++) {
            const size_t off = gdn_attn_param_offset(&c, p);
            expect_close(rel_err_dd(dw + off, gref + off, (int64_t)gdn_attn_param_numel(&c, p)), tol,
                         "%s grad.%s vs transformers", m, gdn_attn_param_name(p));
        }
        expect_status(run_attn(mode, &co, w, xo, NULL, yo, NULL, NULL), GDN_OK, NULL, "%s forward at offset", m);
        expect_close(rel_err_dd(yo, yoref, 64 * 96), tol, "%s y_off at positions %lld..%lld", m, (long long)pos_off[0],
                     (long long)pos_off[63]);
        if (mode == F32_RECOMPUTE) continue; /* its controls are F32's */
        /* Controls through the same comparisons. */
        /* y_off: a uniform shift of the positions cancels in q.k (RoPE is relative), so
         * positions 0..63 give the same y_off in exact arithmetic: what y_off tests is the angles
         * at p ~ 1000 (fp32 angles would be off by ~p * 6e-8 rad). Its controls are wrong RoPE. */
        {
            gdn_attn_config c0 = co;
            c0.rope_theta = 1e7;
            run_attn(mode, &c0, w, xo, NULL, yo, NULL, NULL);
            expect_far(rel_err_dd(yo, yoref, 64 * 96), tol, "%s y_off with rope_theta 1e7 (the file's is 1e4)", m);
            w_rope_adjacent(&c, wt, w);
            run_attn(mode, &co, wt, xo, NULL, yo, NULL, NULL);
            expect_far(rel_err_dd(yo, yoref, 64 * 96), tol, "%s y_off with RoPE pairing adjacent dims", m);
        }
        w_norm_plain(&c, wt, w);
        run_attn(mode, &c, wt, x, dy, y, dx, dw);
        expect_far(rel_err_dd(y, yref, nx), tol, "%s y with the norms' (1 + w) read as w", m);
        expect_far(rel_err_dd(dx, dxref, nx), tol, "%s dx with the norms' (1 + w) read as w", m);
        for (int p = 0; p < GDN_A_COUNT; p++) {
            const size_t off = gdn_attn_param_offset(&c, p);
            expect_far(rel_err_dd(dw + off, gref + off, (int64_t)gdn_attn_param_numel(&c, p)), tol,
                       "%s grad.%s with the norms' (1 + w) read as w", m, gdn_attn_param_name(p));
        }
        const struct { const char *what; void (*fn)(const gdn_attn_config *, double *, const double *); } wrong[] = {
            {"q/gate interleave read as concatenated", w_concat},
            {"the gate left out", w_no_gate},
            {"query head h on kv head h %% Hkv", w_gqa_mod},
            {"RoPE pairing adjacent dims", w_rope_adjacent},
        };
        for (size_t k = 0; k < sizeof wrong / sizeof wrong[0]; k++) {
            wrong[k].fn(&c, wt, w);
            run_attn(mode, &c, wt, x, dy, y, dx, dw);
            char what[128];
            snprintf(what, sizeof what, wrong[k].what, 0);
            expect_far(rel_err_dd(y, yref, nx), tol, "%s y with %s", m, what);
            expect_far(rel_err_dd(dx, dxref, nx), tol, "%s dx with %s", m, what);
        }
        {
            gdn_attn_config ct = c;
            ct.rope_theta = 1e7; /* a real checkpoint's theta, wrong for this one */
            run_attn(mode, &ct, w, x, dy, y, dx, dw);
            expect_far(rel_err_dd(y, yref, nx), tol, "%s y with rope_theta 1e7 (the file's is 1e4)", m);
            const size_t off = gdn_attn_param_offset(&c, GDN_A_K_NORM);
            expect_far(rel_err_dd(dw + off, gref + off, c.d), tol, "%s grad.k_norm.weight with rope_theta 1e7", m);
        }
    }
out:
    free(w), free(wt), free(gref), free(dw), free(x), free(dy), free(yref), free(dxref), free(y), free(dx);
    free(xo), free(yoref), free(yo);
    gdn_st_close(fw), gdn_st_close(io);
}

/* ---------------------------------------------------------------- 3. fp32 vs the reference */

static void vs_reference(int64_t B, int64_t T, int64_t H, int64_t Hkv, int64_t d, int64_t R, int threads) {
    gdn_attn_config c = gdn_attn_config_default(B, T, 32, H, Hkv, d);
    c.R = R, c.rope_theta = 1e4, c.threads = threads, c.pos_offset = 7;
    const int64_t nx = c.B * c.T * c.E;
    const size_t nw = gdn_attn_param_floats(&c);
    rng_seed(77 + (uint64_t)T);
    double *w = random_weights(&c), *x = dalloc(nx), *dy = dalloc(nx);
    for (int64_t i = 0; i < nx; i++) x[i] = (float)rng_uniform(-2, 2), dy[i] = (float)rng_uniform(-1, 1);
    for (size_t i = 0; i < nw; i++) w[i] = (float)w[i];
    double *yr = dalloc(nx), *dxr = dalloc(nx), *dwr = dalloc(nw), *y = dalloc(nx), *dx = dalloc(nx), *dw = dalloc(nw);
    double *y2 = dalloc(nx), *dx2 = dalloc(nx), *dw2 = dalloc(nw);
    char what[128];
    snprintf(what, sizeof what, "B=%lld T=%lld H=%lld Hkv=%lld d=%lld R=%lld, %d threads", (long long)B, (long long)T,
             (long long)H, (long long)Hkv, (long long)d, (long long)R, threads);
    expect_status(run_attn(REF, &c, w, x, dy, yr, dxr, dwr), GDN_OK, NULL, "reference %s", what);
    expect_status(run_attn(F32, &c, w, x, dy, y, dx, dw), GDN_OK, NULL, "fp32 %s", what);
    const double tol = 1e-5;
    expect_close(rel_err_dd(y, yr, nx), tol, "fp32 vs reference y, %s", what);
    expect_close(rel_err_dd(dx, dxr, nx), tol, "fp32 vs reference dx, %s", what);
    for (int p = 0; p < GDN_A_COUNT; p++) {
        const size_t off = gdn_attn_param_offset(&c, p);
        expect_close(rel_err_dd(dw + off, dwr + off, (int64_t)gdn_attn_param_numel(&c, p)), tol,
                     "fp32 vs reference grad.%s, %s", gdn_attn_param_name(p), what);
    }
    /* The recomputing backward, and the one that keeps only the core's output, give the same
     * numbers as the saved one. */
    for (int m = F32_RECOMPUTE; m <= F32_KEEP_CORE; m++) {
        run_attn(m, &c, w, x, dy, y2, dx2, dw2);
        check(!memcmp(y, y2, sizeof(double) * nx) && !memcmp(dx, dx2, sizeof(double) * nx) &&
                  !memcmp(dw, dw2, sizeof(double) * nw),
              "%s and %s identical, %s", mode_name[F32], mode_name[m], what);
    }
    /* Controls through the same comparisons: the fp32 layer with wrong weights. */
    double *wt = dalloc(nw);
    if (Hkv > 1 && H > Hkv) { /* kv head h % Hkv differs from h / (H/Hkv) */
        w_gqa_mod(&c, wt, w);
        run_attn(F32, &c, wt, x, dy, y2, dx2, dw2);
        expect_far(rel_err_dd(y2, yr, nx), tol, "fp32 y with kv head h %% Hkv, %s", what);
        expect_far(rel_err_dd(dx2, dxr, nx), tol, "fp32 dx with kv head h %% Hkv, %s", what);
    }
    w_norm_plain(&c, wt, w);
    run_attn(F32, &c, wt, x, dy, y2, dx2, dw2);
    for (int p = 0; p < GDN_A_COUNT; p++) {
        const size_t off = gdn_attn_param_offset(&c, p);
        expect_far(rel_err_dd(dw2 + off, dwr + off, (int64_t)gdn_attn_param_numel(&c, p)), tol,
                   "fp32 grad.%s with norms (w), %s", gdn_attn_param_name(p), what);
    }
    expect_far(rel_err_dd(y2, yr, nx), tol, "fp32 y with norms (w), %s", what);
    expect_far(rel_err_dd(dx2, dxr, nx), tol, "fp32 dx with norms (w), %s", what);
    free(w), free(x), free(dy), free(yr), free(dxr), free(dwr), free(y), free(dx), free(dw), free(y2), free(dx2);
    free(dw2), free(wt);
}

/* ---------------------------------------------------------------- 4. packed documents */

static void packed(const int64_t *cu, int64_t n_docs) {
    gdn_attn_config c = gdn_attn_config_default(1, cu[n_docs], 32, 4, 2, 16);
    c.R = 8, c.rope_theta = 1e4, c.cu_seqlens = cu, c.n_docs = n_docs;
    const int64_t E = c.E, nx = c.T * E;
    const size_t nw = gdn_attn_param_floats(&c);
    rng_seed(5151);
    double *w = random_weights(&c), *x = dalloc(nx), *dy = dalloc(nx);
    for (int64_t i = 0; i < nx; i++) x[i] = (float)rng_uniform(-2, 2), dy[i] = (float)rng_uniform(-1, 1);
    for (size_t i = 0; i < nw; i++) w[i] = (float)w[i];
    double *y = dalloc(nx), *dx = dalloc(nx), *dw = dalloc(nw), *ys = dalloc(nx), *dxs = dalloc(nx), *dws = dalloc(nw);
    double *dwd = dalloc(nw), *yr = dalloc(nx), *dxr = dalloc(nx), *dwr = dalloc(nw);
    char docs[160] = "";
    for (int64_t k = 0; k < n_docs && strlen(docs) < 140; k++)
        snprintf(docs + strlen(docs), sizeof docs - strlen(docs), "%s%lld", k ? ", " : "", (long long)(cu[k + 1] - cu[k]));
    expect_status(run_attn(F32, &c, w, x, dy, y, dx, dw), GDN_OK, NULL, "fp32 packed [%s]", docs);
    /* each document alone, dense, positions from 0 */
    for (int64_t k = 0; k < n_docs; k++) {
        gdn_attn_config cd = c;
        cd.cu_seqlens = NULL, cd.n_docs = 0, cd.T = cu[k + 1] - cu[k];
        run_attn(F32, &cd, w, x + cu[k] * E, dy + cu[k] * E, ys + cu[k] * E, dxs + cu[k] * E, dwd);
        for (size_t i = 0; i < nw; i++) dws[i] += dwd[i];
    }
    const double tol = 1e-5;
    expect_close(rel_err_dd(y, ys, nx), tol, "packed y == each document alone [%s]", docs);
    expect_close(rel_err_dd(dx, dxs, nx), tol, "packed dx == each document alone [%s]", docs);
    expect_close(rel_err_dd(dw, dws, (int64_t)nw), tol, "packed dw == sum over documents alone [%s]", docs);
    /* the packed reference agrees too */
    expect_status(run_attn(REF, &c, w, x, dy, yr, dxr, dwr), GDN_OK, NULL, "reference packed [%s]", docs);
    expect_close(rel_err_dd(y, yr, nx), tol, "packed fp32 y vs packed reference [%s]", docs);
    expect_close(rel_err_dd(dw, dwr, (int64_t)nw), tol, "packed fp32 dw vs packed reference [%s]", docs);
    /* Control: no reset (the three documents as one sequence) through the same comparisons. */
    gdn_attn_config c1 = c;
    c1.cu_seqlens = NULL, c1.n_docs = 0;
    run_attn(F32, &c1, w, x, dy, y, dx, dw);
    expect_far(rel_err_dd(y, ys, nx), tol, "no-reset y vs each document alone [%s]", docs);
    expect_far(rel_err_dd(dx, dxs, nx), tol, "no-reset dx vs each document alone [%s]", docs);
    expect_far(rel_err_dd(dw, dws, (int64_t)nw), tol, "no-reset dw vs each document alone [%s]", docs);
    run_attn(REF, &c1, w, x, dy, yr, dxr, dwr);
    expect_far(rel_err_dd(yr, ys, nx), tol, "no-reset reference y vs each document alone [%s]", docs);
    free(w), free(x), free(dy), free(y), free(dx), free(dw), free(ys), free(dxs), free(dws), free(dwd), free(yr);
    free(dxr), free(dwr);
}

/* ---------------------------------------------------------------- 5. bad input */

static void errors(void) {
    gdn_attn_config c = gdn_attn_config_default(1, 10, 16, 4, 2, 8);
    gdn_attn_plan *p = NULL;
    expect_status(gdn_attn_plan_create(&p, &c), GDN_OK, NULL, "a valid config plans (control)");
    const int64_t nx = c.B * c.T * c.E;
    const size_t nw = gdn_attn_param_floats(&c);
    float *x = calloc(nx, 4), *y = calloc(nx, 4), *w = calloc(nw, 4), *dw = calloc(nw, 4);
    double *xd = calloc(nx, 8), *yd = calloc(nx, 8), *wd = calloc(nw, 8);
    expect_status(gdn_attn_forward(p, y, NULL, x, w), GDN_OK, NULL, "forward of zeros runs (control)");
    expect_status(gdn_attn_forward(p, y, NULL, NULL, w), GDN_ERR_ARG, "'x'", "NULL x refused");
    expect_status(gdn_attn_forward(p, y, NULL, x, NULL), GDN_ERR_ARG, "'w'", "NULL w refused");
    expect_status(gdn_attn_forward(p, NULL, NULL, x, w), GDN_ERR_ARG, "'y'", "NULL y refused");
    expect_status(gdn_attn_backward(p, y, dw, x, w, NULL, NULL), GDN_ERR_ARG, "'dy'", "NULL dy refused");
    x[17] = NAN;
    expect_status(gdn_attn_forward(p, y, NULL, x, w), GDN_ERR_NONFINITE, "'x'", "NaN in x refused");
    x[17] = 0.0f;
    w[gdn_attn_param_offset(&c, GDN_A_K_PROJ) + 3] = INFINITY;
    expect_status(gdn_attn_forward(p, y, NULL, x, w), GDN_ERR_NONFINITE, "k_proj.weight", "Inf in k_proj refused");
    w[gdn_attn_param_offset(&c, GDN_A_K_PROJ) + 3] = 0.0f;
    gdn_attn_plan_destroy(p);
    xd[3] = NAN;
    expect_status(gdn_attn_reference_forward(&c, yd, xd, wd), GDN_ERR_NONFINITE, "'x'", "reference: NaN in x refused");
    const int64_t cu_bad[3] = {0, 6, 9}, cu_ok[3] = {0, 6, 10};
    struct { const char *what, *needle; int64_t T, H, Hkv, d, R, B, pos; const int64_t *cu; int want; } bad[] = {
        {"T = 0", "T = 0", 0, 4, 2, 8, 2, 1, 0, NULL, GDN_ERR_SHAPE},
        {"H not a multiple of Hkv", "not a multiple", 10, 3, 2, 8, 2, 1, 0, NULL, GDN_ERR_SHAPE},
        {"rotary dims odd", "rotary dims R = 3", 10, 4, 2, 8, 3, 1, 0, NULL, GDN_ERR_SHAPE},
        {"rotary dims > d", "rotary dims R = 10", 10, 4, 2, 8, 10, 1, 0, NULL, GDN_ERR_SHAPE},
        {"cu_seqlens not ending at T", "cu_seqlens", 10, 4, 2, 8, 2, 1, 0, cu_bad, GDN_ERR_SHAPE},
        {"cu_seqlens with B = 2", "B = 1", 10, 4, 2, 8, 2, 2, 0, cu_ok, GDN_ERR_SHAPE},
        {"pos_offset with cu_seqlens", "pos_offset", 10, 4, 2, 8, 2, 1, 5, cu_ok, GDN_ERR_ARG},
        {"negative pos_offset", "pos_offset", 10, 4, 2, 8, 2, 1, -1, NULL, GDN_ERR_ARG},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        gdn_attn_config b = gdn_attn_config_default(bad[i].B, bad[i].T, 16, bad[i].H, bad[i].Hkv, bad[i].d);
        b.R = bad[i].R, b.pos_offset = bad[i].pos, b.cu_seqlens = bad[i].cu, b.n_docs = bad[i].cu ? 2 : 0;
        p = NULL;
        expect_status(gdn_attn_plan_create(&p, &b), bad[i].want, bad[i].needle, "plan refuses %s", bad[i].what);
        gdn_attn_plan_destroy(p);
        expect_status(gdn_attn_reference_forward(&b, yd, xd, wd), bad[i].want, bad[i].needle, "reference refuses %s",
                      bad[i].what);
    }
    /* positions beyond max_position: dense (pos_offset + T), packed (the longest document) */
    gdn_attn_config mp = gdn_attn_config_default(1, 10, 16, 4, 2, 8);
    mp.max_position = 10;
    p = NULL;
    expect_status(gdn_attn_plan_create(&p, &mp), GDN_OK, NULL, "positions 0..9 with max_position 10 plan (control)");
    gdn_attn_plan_destroy(p), p = NULL;
    mp.pos_offset = 1;
    expect_status(gdn_attn_plan_create(&p, &mp), GDN_ERR_ARG, "max_position = 10",
                  "positions 1..10 beyond max_position 10 refused");
    gdn_attn_plan_destroy(p), p = NULL;
    const int64_t cu_long[3] = {0, 2, 10};
    mp.pos_offset = 0, mp.max_position = 7, mp.cu_seqlens = cu_long, mp.n_docs = 2;
    expect_status(gdn_attn_plan_create(&p, &mp), GDN_ERR_ARG, "positions reach 7",
                  "a packed document of 8 tokens beyond max_position 7 refused");
    gdn_attn_plan_destroy(p), p = NULL;
    mp.max_position = 8;
    expect_status(gdn_attn_plan_create(&p, &mp), GDN_OK, NULL, "the same documents with max_position 8 plan (control)");
    gdn_attn_plan_destroy(p);
    free(x), free(y), free(w), free(dw), free(xd), free(yd), free(wd);
}

/* O(T) memory: what the forward keeps is linear in T (the projections, the core's output and the
 * LSE per token), and a long sequence plans in a few MB per thousand tokens at these shapes. */
static void memory(void) {
    size_t kept[2] = {0, 0};
    for (int i = 0; i < 2; i++) {
        gdn_attn_config c = gdn_attn_config_default(1, 8192 << i, 16, 4, 2, 8);
        gdn_attn_plan *p = NULL;
        expect_status(gdn_attn_plan_create(&p, &c), GDN_OK, NULL, "plan at T = %lld", (long long)c.T);
        kept[i] = gdn_attn_saved_floats(p);
        const size_t want = (size_t)c.T * (size_t)(2 * 32 + 2 * 16 + 32 + 4);
        check(kept[i] == want, "saved floats at T = %lld: %zu == T (2Hd + 2Hkv d + Hd + H) = %zu", (long long)c.T,
              kept[i], want);
        gdn_attn_plan_destroy(p);
    }
    check(kept[1] == 2 * kept[0], "saved floats double with T (%zu -> %zu), not 4x", kept[0], kept[1]);
    gdn_attn_config c = gdn_attn_config_default(1, 8192, 16, 4, 2, 8);
    c.keep = GDN_ATTN_KEEP_CORE;
    gdn_attn_plan *p = NULL;
    expect_status(gdn_attn_plan_create(&p, &c), GDN_OK, NULL, "plan keeping the core's output only");
    const size_t core = gdn_attn_saved_floats(p), want = (size_t)c.T * (size_t)(32 + 4);
    check(core == want, "KEEP_CORE saved floats at T = 8192: %zu == T (Hd + H) = %zu (%.0f%% of KEEP_ALL's)", core, want,
          100.0 * (double)core / (double)kept[0]);
    gdn_attn_plan_destroy(p);
    c.keep = 7;
    expect_status(gdn_attn_plan_create(&p, &c), GDN_ERR_ARG, "keep = 7", "an unknown memory mode refused");
}

void test_attention(void) {
    fd_case();
    golden();
    vs_reference(2, 77, 4, 2, 16, 8, 2);  /* T not a multiple of the 64-token tile */
    vs_reference(1, 200, 4, 1, 32, 32, 1); /* full rotary, MQA, 4 tiles, one thread */
    vs_reference(3, 64, 2, 2, 8, 0, 2);   /* no RoPE, H == Hkv, exactly one tile */
    const int64_t cu1[4] = {0, 50, 51, 150};            /* a 1-token document, documents across tiles */
    const int64_t cu2[5] = {0, 130, 131, 192, 333};      /* one from inside a tile to a tile's end */
    packed(cu1, 3);
    packed(cu2, 4);
    memory();
    errors();
}
