/* gdncp bench attention: Qwen3.5's gated full-attention layer and its attention core alone
 * (gdn_sdpa_*) at the Qwen3.5 heads (35B-A3B: H 16, Hkv 2, d 256, E 2048; 9B: H 16, Hkv 4,
 * E 4096; 0.8B: H 8, Hkv 2, E 1024), forward and forward+backward, B = 1.
 * FLOPs: the core's causal products QK^T and PV, 2d per (query, key) pair each over the T^2/2
 * pairs a causal row sees, 2 T^2 d H forward; x3.5 forward+backward (the backward recomputes QK^T
 * and runs dP = dO V^T, dV = P^T dO, dK = dS^T Q, dQ = dS K: 5 of those products); the layer adds
 * its projections, 2E(2Hd + 2 Hkv d) + 2HdE per token forward, three times that with the
 * backward. Elementwise work (softmax, masks, norms, RoPE, gate) is not counted. Fractions are of
 * this machine's native-width FMA peak measured in the same run. Errors: the core's o (of the
 * timed run) on its first tokens, and dq, dk, dv of a run on those tokens alone, against plain
 * double loops; the layer's y and dx against the double reference layer on its first tokens.
 * The layer rows run in fp32 and BF16 compute, alternating; a decode row (one token against a
 * KV cache of T tokens) against the streaming bound measured in the same run. */
#include "cli/cli.h"
#include "commands.h"
#include "cli/parse.h"
#include "gdncp/io.h" /* gdn_st_bf16 */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const char *label;
    int64_t E, H, Hkv, d;
} attn_shape;

static const attn_shape shapes[] = {
    {"35b-a3b", 2048, 16, 2, 256}, {"9b", 4096, 16, 4, 256}, {"0.8b", 1024, 8, 2, 256},
};
enum { NSHAPES = sizeof shapes / sizeof shapes[0] };

static double proj_flops(const attn_shape *s, int64_t T, int backward) {
    const double E = (double)s->E, Hd = (double)(s->H * s->d), Kd = (double)(s->Hkv * s->d);
    return (backward ? 3.0 : 1.0) * (double)T * (2 * E * (2 * Hd + 2 * Kd) + 2 * Hd * E);
}

/* Causal attention in double with plain loops over the first tp tokens (B = 1, token-major):
 * o, and with dout also dq, dk, dv. */
static void core_reference(const attn_shape *s, int64_t tp, const float *q, const float *k, const float *v,
                           const float *dout, double *o, double *dq, double *dk, double *dv) {
    const int64_t H = s->H, Hkv = s->Hkv, d = s->d, grp = H / Hkv;
    const double scale = 1.0 / sqrt((double)d);
    double *p = malloc(sizeof(double) * (size_t)tp), *dp = malloc(sizeof(double) * (size_t)tp);
    if (dout) {
        memset(dq, 0, sizeof(double) * (size_t)(tp * H * d));
        memset(dk, 0, sizeof(double) * (size_t)(tp * Hkv * d));
        memset(dv, 0, sizeof(double) * (size_t)(tp * Hkv * d));
    }
    for (int64_t t = 0; t < tp; t++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t j = h / grp;
            const float *qr = q + (t * H + h) * d;
            double m = -INFINITY, l = 0;
            for (int64_t u = 0; u <= t; u++) {
                double x = 0;
                for (int64_t e = 0; e < d; e++) x += (double)qr[e] * k[(u * Hkv + j) * d + e];
                p[u] = x * scale, m = fmax(m, p[u]);
            }
            for (int64_t u = 0; u <= t; u++) l += exp(p[u] - m);
            double *orow = o + (t * H + h) * d;
            memset(orow, 0, sizeof(double) * (size_t)d);
            for (int64_t u = 0; u <= t; u++) {
                p[u] = exp(p[u] - m) / l;
                for (int64_t e = 0; e < d; e++) orow[e] += p[u] * v[(u * Hkv + j) * d + e];
            }
            if (!dout) continue;
            const float *g = dout + (t * H + h) * d;
            double D = 0;
            for (int64_t e = 0; e < d; e++) D += g[e] * orow[e];
            for (int64_t u = 0; u <= t; u++) {
                dp[u] = 0;
                for (int64_t e = 0; e < d; e++) dp[u] += (double)g[e] * v[(u * Hkv + j) * d + e];
                const double ds = p[u] * (dp[u] - D);
                for (int64_t e = 0; e < d; e++) {
                    dq[(t * H + h) * d + e] += scale * ds * k[(u * Hkv + j) * d + e];
                    dk[(u * Hkv + j) * d + e] += scale * ds * qr[e];
                    dv[(u * Hkv + j) * d + e] += p[u] * g[e];
                }
            }
        }
    free(p), free(dp);
}

/* The core's dq, dk, dv on the first tp tokens alone against the double loops: the largest of the
 * three relative errors. */
static double core_backward_error(const attn_shape *s, int64_t tp, int threads, int compute, const float *q,
                                  const float *k, const float *v, const float *dout) {
    const int64_t nq = tp * s->H * s->d, nk = tp * s->Hkv * s->d;
    gdn_attn_config c = gdn_attn_config_default(1, tp, s->E, s->H, s->Hkv, s->d);
    c.threads = threads, c.compute = compute;
    float *o = malloc(4 * nq), *lse = malloc(4 * tp * s->H), *dq = malloc(4 * nq), *dk = malloc(4 * nk),
          *dv = malloc(4 * nk);
    double *ro = malloc(8 * nq), *rq = malloc(8 * nq), *rk = malloc(8 * nk), *rv = malloc(8 * nk);
    gdn_sdpa_plan *p = NULL;
    double err = NAN;
    if (o && lse && dq && dk && dv && ro && rq && rk && rv && !gdn_sdpa_plan_create(&p, &c) &&
        !gdn_sdpa_forward(p, o, lse, q, k, v) && !gdn_sdpa_backward(p, dq, dk, dv, q, k, v, o, lse, dout)) {
        core_reference(s, tp, q, k, v, dout, ro, rq, rk, rv);
        err = fmax(cli_rel_err(dq, rq, nq), fmax(cli_rel_err(dk, rk, nk), cli_rel_err(dv, rv, nk)));
    }
    gdn_sdpa_plan_destroy(p);
    free(o), free(lse), free(dq), free(dk), free(dv), free(ro), free(rq), free(rk), free(rv);
    return err;
}

/* Qwen-like weights: projections ~ 1/sqrt(fan-in), norm weights near 0 ((1 + w) near 1). */
static float *attn_weights(const gdn_attn_config *c, uint64_t *seed) {
    float *w = calloc(gdn_attn_param_floats(c), sizeof(float));
    for (int i = 0; w && i < GDN_A_COUNT; i++) {
        gdn_param_info p;
        if (gdn_attn_param(c, i, &p)) break;
        const float a = p.ndim == 2 ? 1.0f / sqrtf((float)p.shape[1]) : 0.1f;
        float *r = cli_random_floats(p.numel, -a, a, seed);
        if (r) memcpy(w + p.offset, r, sizeof(float) * p.numel);
        free(r);
    }
    return w;
}

/* The layer (c.compute) on its first tp tokens against the exact double reference (fp32
 * semantics, whatever c.compute): y (forward) or dx (backward). */
static double layer_error(gdn_attn_config c, int64_t tp, const float *w, const float *x, const float *dy,
                          const float *y_full, int backward) {
    c.T = tp, c.B = 1;
    gdn_attn_config rc_cfg = c;
    rc_cfg.compute = GDN_COMPUTE_FP32;
    const size_t nx = (size_t)tp * c.E, nw = gdn_attn_param_floats(&c);
    double *xd = malloc(8 * nx), *wd = malloc(8 * nw), *dyd = malloc(8 * nx), *yd = malloc(8 * nx);
    double *dwd = backward ? malloc(8 * nw) : NULL;
    float *dx = malloc(4 * nx), *dw = malloc(4 * nw);
    double err = NAN;
    gdn_attn_plan *p = NULL;
    if (xd && wd && dyd && yd && dx && dw && (!backward || dwd)) {
        for (size_t i = 0; i < nx; i++) xd[i] = x[i], dyd[i] = dy[i];
        for (size_t i = 0; i < nw; i++) wd[i] = w[i];
        if (!backward) {
            if (!gdn_attn_reference_forward(&rc_cfg, yd, xd, wd)) err = cli_rel_err(y_full, yd, (int64_t)nx);
        } else if (!gdn_attn_reference_backward(&rc_cfg, yd, dwd, xd, wd, dyd) && !gdn_attn_plan_create(&p, &c) &&
                   !gdn_attn_backward(p, dx, dw, x, w, NULL, dy)) {
            err = cli_rel_err(dx, yd, (int64_t)nx);
        }
    }
    gdn_attn_plan_destroy(p);
    free(xd), free(wd), free(dyd), free(yd), free(dwd), free(dx), free(dw);
    return err;
}

typedef struct {
    int json, reps, threads, quick;
    int compute_mask; /* the core and layer rows: bit 0 fp32, bit 1 bf16 */
    double peak, bf16_peak; /* measured in this run (bf16: when a bf16 row runs) */
    const char *cpu;
} bench_opts;

/* One row; a BF16 row (bf16) also prints its fraction of the BF16 instruction peak. */
static void print_row(const bench_opts *o, const char *dir, const attn_shape *s, int64_t T, double med,
                      double flops, double kept_per_token, double err, const char *path, int bf16) {
    const double gflops = flops / med / 1e9;
    CLI_ROW(o->json, CLI_S("direction", "%s", "%-18s", dir), CLI_S("shape", "%s", " %-7s", s->label),
            CLI_I("B", "%lld", NULL, 1), CLI_I("T", "%lld", " T=%-6lld", T),
            cli_at(CLI_I("E", "%lld", " E=%lld", s->E), 2), cli_at(CLI_I("H", "%lld", " H=%lld", s->H), 1),
            CLI_I("Hkv", "%lld", " Hkv=%lld", s->Hkv), CLI_I("d", "%lld", " d=%lld", s->d),
            cli_at(CLI_I("threads", "%lld", " thr=%lld", o->threads), 3), CLI_F("ms", "%.3f", " %10.1f ms", med * 1e3),
            CLI_I("reps", "%lld", NULL, o->reps), CLI_F("tokens_per_s", "%.1f", " %9.0f tok/s", (double)T / med),
            CLI_F("gflops", "%.3f", " %7.1f GFLOP/s", gflops), CLI_F("peak_gflops", "%.3f", NULL, o->peak),
            cli_x(CLI_F("fraction_of_peak", "%.4f", " %5.1f %% of peak", gflops / o->peak), 100),
            cli_or_null(bf16, CLI_F("bf16_peak_gflops", "%.3f", NULL, o->bf16_peak)),
            cli_or_null(bf16, cli_x(CLI_F("fraction_of_bf16_peak", "%.4f", " %5.1f %% of bf16 peak", gflops / o->bf16_peak),
                                    100)),
            CLI_F("bytes_kept_per_token", "%.1f", "  kept %6.0f B/token", kept_per_token),
            CLI_F("rel_err_vs_reference", "%.3e", "  err %.1e", err), CLI_S("path", "%s", "  %s", path),
            CLI_S("cpu", "%s", NULL, o->cpu));
    fflush(stdout);
}


typedef struct {
    gdn_sdpa_plan *p;
    float *q, *k, *v, *o, *lse, *dout, *dq, *dk, *dv;
} core_ctx;
static int core_fwd(void *c) {
    core_ctx *x = c;
    return gdn_sdpa_forward(x->p, x->o, x->lse, x->q, x->k, x->v);
}
static int core_fwd_bwd(void *c) {
    core_ctx *x = c;
    int rc = gdn_sdpa_forward(x->p, x->o, x->lse, x->q, x->k, x->v);
    return rc ? rc : gdn_sdpa_backward(x->p, x->dq, x->dk, x->dv, x->q, x->k, x->v, x->o, x->lse, x->dout);
}

/* The two precisions' runs (ctx[cm], NULL: not asked for) of fwd, then of fwd_bwd, alternating
 * rep by rep after one untimed run each: t[cm][bwd][rep]. */
static int time_alternating(int (*fwd)(void *), int (*fwd_bwd)(void *), void *const ctx[2], int reps,
                            double t[2][2][64]) {
    int rc = 0;
    for (int bwd = 0; bwd < 2 && !rc; bwd++)
        for (int r = 0; r <= reps && !rc; r++)
            for (int k = 0; k < 2 && !rc; k++) {
                const int cm = (r + k) % 2;
                if (!ctx[cm]) continue;
                const double t0 = cli_now();
                rc = bwd ? fwd_bwd(ctx[cm]) : fwd(ctx[cm]);
                if (r) t[cm][bwd][r - 1] = cli_now() - t0;
            }
    return rc;
}

/* A BF16 row pair's speed-up over fp32 (what: "core" or "layer"): forward r0, fwd+bwd r1. */
static void print_speedup(const bench_opts *o, const char *what, const attn_shape *s, int64_t T, double r0, double r1) {
    CLI_ROW(o->json, CLI_S("direction", "%s_bf16_speedup", "%s bf16 vs fp32", what),
            CLI_S("shape", "%s", " %-7s", s->label), CLI_I("T", "%lld", " T=%-6lld", T),
            CLI_I("threads", "%lld", " thr=%lld:", o->threads), CLI_F("forward", "%.3f", " forward %.2fx,", r0),
            CLI_F("fwd_bwd", "%.3f", " fwd+bwd %.2fx", r1), CLI_S("cpu", "%s", NULL, o->cpu),
            CLI_T(" (medians of alternating runs)"));
}

/* The core's rows in each compute precision asked for (o->compute_mask), the precisions
 * alternating rep by rep; a BF16 row also prints its speed-up over fp32. */
static int bench_core(const bench_opts *o, const attn_shape *s, int64_t T) {
    gdn_attn_config c = gdn_attn_config_default(1, T, s->E, s->H, s->Hkv, s->d);
    c.threads = o->threads;
    const size_t nq = (size_t)T * s->H * s->d, nk = (size_t)T * s->Hkv * s->d;
    uint64_t seed = 0x9E3779B97F4A7C15ull;
    core_ctx x[2] = {{NULL, cli_random_floats(nq, -1, 1, &seed), cli_random_floats(nk, -1, 1, &seed),
                      cli_random_floats(nk, -1, 1, &seed), malloc(4 * nq), malloc(4 * (size_t)T * s->H),
                      cli_random_floats(nq, -1, 1, &seed), malloc(4 * nq), malloc(4 * nk), malloc(4 * nk)}};
    x[1] = x[0];
    int rc = x[0].q && x[0].k && x[0].v && x[0].o && x[0].lse && x[0].dout && x[0].dq && x[0].dk && x[0].dv ? GDN_OK
                                                                                                          : GDN_ERR_NOMEM;
    for (int cm = 0; cm < 2 && !rc; cm++) {
        x[cm].p = NULL;
        if (!(o->compute_mask & (1 << cm))) continue;
        c.compute = cm;
        rc = gdn_sdpa_plan_create(&x[cm].p, &c);
    }
    double t[2][2][64];
    if (!rc) rc = time_alternating(core_fwd, core_fwd_bwd, (void *[2]){x[0].p ? &x[0] : NULL, x[1].p ? &x[1] : NULL},
                                   o->reps, t);
    double med[2][2];
    for (int cm = 0; cm < 2 && !rc; cm++) {
        if (!x[cm].p) continue;
        med[cm][0] = cli_median(t[cm][0], o->reps), med[cm][1] = cli_median(t[cm][1], o->reps);
        rc = core_fwd(&x[cm]); /* o of this precision for the forward's check */
        const int64_t tp = T < (o->quick ? 64 : 256) ? T : (o->quick ? 64 : 256), tb = tp < 128 ? tp : 128;
        double *ro = malloc(8 * (size_t)tp * s->H * s->d);
        double err_f = NAN;
        if (ro && !rc) {
            core_reference(s, tp, x[cm].q, x[cm].k, x[cm].v, NULL, ro, NULL, NULL, NULL);
            err_f = cli_rel_err(x[cm].o, ro, tp * s->H * s->d); /* the run's first tokens */
        }
        free(ro);
        const double err_b = core_backward_error(s, tb, o->threads, cm, x[cm].q, x[cm].k, x[cm].v, x[cm].dout);
        const char *path = gdn_sdpa_plan_path(x[cm].p);
        print_row(o, cm ? "core_forward_bf16" : "core_forward", s, T, med[cm][0], cli_attn_core_flops(T, s->d, s->H, 0), 0,
                  err_f, path, cm);
        /* kept for the backward: o and lse (q, k, v are the caller's inputs) */
        print_row(o, cm ? "core_fwd_bwd_bf16" : "core_fwd_bwd", s, T, med[cm][1], cli_attn_core_flops(T, s->d, s->H, 1),
                  4.0 * (s->H * s->d + s->H), err_b, path, cm);
        if (cm && x[0].p) print_speedup(o, "core", s, T, med[0][0] / med[1][0], med[0][1] / med[1][1]);
    }
    if (rc) fprintf(stderr, "gdncp bench attention: core %s T=%lld: %s\n", s->label, (long long)T, gdn_errmsg());
    for (int cm = 0; cm < 2; cm++) gdn_sdpa_plan_destroy(x[cm].p);
    free(x[0].q), free(x[0].k), free(x[0].v), free(x[0].o), free(x[0].lse), free(x[0].dout), free(x[0].dq), free(x[0].dk),
        free(x[0].dv);
    return rc ? 1 : 0;
}

typedef struct {
    gdn_attn_plan *p;
    float *x, *w, *y, *dy, *dx, *dw, *saved;
} layer_ctx;
static int layer_fwd(void *c) {
    layer_ctx *l = c;
    return gdn_attn_forward(l->p, l->y, NULL, l->x, l->w);
}
static int layer_fwd_bwd(void *c) {
    layer_ctx *l = c;
    int rc = gdn_attn_forward(l->p, l->y, l->saved, l->x, l->w);
    return rc ? rc : gdn_attn_backward(l->p, l->dx, l->dw, l->x, l->w, l->saved, l->dy);
}

/* The layer's rows in each compute precision asked for (o->compute_mask: bit 0 fp32, bit 1
 * bf16), the precisions alternating rep by rep; a BF16 row also prints its speed-up over fp32. */
static int bench_layer_rows(const bench_opts *o, const attn_shape *s, int64_t T) {
    gdn_attn_config c = gdn_attn_config_default(1, T, s->E, s->H, s->Hkv, s->d);
    c.threads = o->threads;
    uint64_t seed = 0x2545F4914F6CDD1Dull;
    const size_t nx = (size_t)T * s->E, nw = gdn_attn_param_floats(&c);
    layer_ctx l[2] = {{NULL, cli_random_floats(nx, -1, 1, &seed), attn_weights(&c, &seed), malloc(4 * nx),
                       cli_random_floats(nx, -1, 1, &seed), malloc(4 * nx), malloc(4 * nw), NULL}};
    l[1] = l[0];
    l[1].saved = NULL;
    int rc = l[0].x && l[0].w && l[0].y && l[0].dy && l[0].dx && l[0].dw ? GDN_OK : GDN_ERR_NOMEM;
    size_t nsaved = 0;
    for (int cm = 0; cm < 2 && !rc; cm++) {
        l[cm].p = NULL;
        if (!(o->compute_mask & (1 << cm))) continue;
        c.compute = cm;
        rc = gdn_attn_plan_create(&l[cm].p, &c);
        nsaved = l[cm].p ? cli_attn_plan(l[cm].p).saved_floats : 0;
        if (!rc && !(l[cm].saved = malloc(4 * (nsaved + 1)))) rc = GDN_ERR_NOMEM;
    }
    double t[2][2][64];
    if (!rc) rc = time_alternating(layer_fwd, layer_fwd_bwd, (void *[2]){l[0].p ? &l[0] : NULL, l[1].p ? &l[1] : NULL},
                                   o->reps, t);
    for (int cm = 0; cm < 2 && !rc; cm++) {
        if (!l[cm].p) continue;
        c.compute = cm;
        /* the error on the first tokens (BF16: 32, as products of <= 16 rows run fp32) */
        const int64_t want = cm ? 32 : (o->quick ? 8 : 16), tp = T < want ? T : want;
        rc = layer_fwd(&l[cm]); /* y of the whole run for the forward's check */
        const double err_f = rc ? NAN : layer_error(c, tp, l[cm].w, l[cm].x, l[cm].dy, l[cm].y, 0);
        const double err_b = layer_error(c, tp, l[cm].w, l[cm].x, l[cm].dy, NULL, 1);
        char path[256];
        snprintf(path, sizeof path, "core %s, projections %s", cm ? "bf16 products" : "fp32", gdn_compute_path(cm));
        char dir[2][32];
        snprintf(dir[0], sizeof dir[0], "layer_forward%s", cm ? "_bf16" : "");
        snprintf(dir[1], sizeof dir[1], "layer_fwd_bwd%s", cm ? "_bf16" : "");
        const double m0 = cli_median(t[cm][0], o->reps), m1 = cli_median(t[cm][1], o->reps);
        print_row(o, dir[0], s, T, m0, proj_flops(s, T, 0) + cli_attn_core_flops(T, s->d, s->H, 0), 0, err_f, path, cm);
        print_row(o, dir[1], s, T, m1, proj_flops(s, T, 1) + cli_attn_core_flops(T, s->d, s->H, 1), 4.0 * nsaved / T, err_b,
                  path, cm);
        if (cm && l[0].p)
            print_speedup(o, "layer", s, T, cli_median(t[0][0], o->reps) / m0, cli_median(t[0][1], o->reps) / m1);
    }
    if (rc) fprintf(stderr, "gdncp bench attention: layer %s T=%lld: %s\n", s->label, (long long)T, gdn_errmsg());
    for (int cm = 0; cm < 2; cm++) gdn_attn_plan_destroy(l[cm].p), free(l[cm].saved);
    free(l[0].x), free(l[0].w), free(l[0].y), free(l[0].dy), free(l[0].dx), free(l[0].dw);
    return rc ? 1 : 0;
}

/* One decode step (B = 1) against a KV cache of T tokens (filled with random keys and values,
 * its length reset to T before every step, so each step attends to T + 1): memory-bound, against
 * the time to stream the weights and the cache once at the bandwidth measured in the same run.
 * dtype: the cache's (0 F32, 2 BF16: half the cache bytes). */
static int bench_decode_row(const bench_opts *o, const attn_shape *s, int64_t T, int dtype) {
    gdn_attn_config c = gdn_attn_config_default(1, 1, s->E, s->H, s->Hkv, s->d);
    c.threads = o->threads;
    uint64_t seed = 0x5851F42D4C957F2Dull;
    float *w = attn_weights(&c, &seed), *x = cli_random_floats((size_t)s->E, -1, 1, &seed);
    float *y = malloc(4 * (size_t)s->E);
    gdn_attn_plan *p = NULL;
    gdn_attn_cache *cache = NULL;
    int rc = w && x && y ? gdn_attn_plan_create(&p, &c) : GDN_ERR_NOMEM;
    if (!rc) rc = gdn_attn_cache_create(&cache, 1, s->Hkv, s->d, T + 1, dtype);
    gdn_attn_cache_info ci;
    if (!rc) rc = gdn_attn_cache_view(cache, &ci);
    if (!rc) {
        const size_t n = (size_t)s->Hkv * (size_t)(T + 1) * (size_t)s->d;
        const int f32 = ci.dtype == GDN_F32;
        float *kf = f32 ? ci.keys : NULL, *vf = f32 ? ci.values : NULL;
        uint16_t *kb = f32 ? NULL : ci.keys, *vb = f32 ? NULL : ci.values;
        for (size_t i = 0; i < n; i++) {
            const float k = cli_uniform(&seed, -0.5f, 0.5f), v = cli_uniform(&seed, -0.5f, 0.5f);
            if (kf) kf[i] = k, vf[i] = v;
            else kb[i] = gdn_st_bf16(k), vb[i] = gdn_st_bf16(v);
        }
    }
    const int steps = o->quick ? 5 : 20;
    double t[64];
    for (int r = 0; r <= steps && !rc; r++) {
        rc = gdn_attn_cache_set_length(cache, T);
        const double t0 = cli_now();
        if (!rc) rc = gdn_attn_decode(p, cache, y, x, w);
        if (r) t[r - 1] = cli_now() - t0;
    }
    if (!rc) {
        const double med = cli_median(t, steps);
        const double wbytes = 4.0 * (double)gdn_attn_param_floats(&c),
                     cbytes = (dtype ? 4.0 : 8.0) * (double)s->Hkv * (T + 1) * s->d;
        const double bound = cli_stream_seconds((size_t)(wbytes + cbytes), 0, o->threads);
        CLI_ROW(o->json, CLI_S("direction", "%s", "%s ", "layer_decode"), CLI_S("shape", "%s", " %-7s", s->label),
                CLI_I("B", "%lld", NULL, 1), CLI_I("T_cache", "%lld", " cache T=%-6lld", T),
                CLI_S("cache_dtype", "%s", " %-4s", dtype ? "bf16" : "f32"),
                CLI_I("threads", "%lld", " thr=%lld", o->threads),
                CLI_F("us_per_token", "%.2f", " %9.1f us/token", med * 1e6),
                cli_x(CLI_F("bytes_per_step", "%.0f", "  streams %.1f MB", wbytes + cbytes), 1e-6),
                CLI_F(NULL, NULL, " (weights %.1f MB,", wbytes / 1e6),
                CLI_F(NULL, NULL, " cache %.1f MB)", cbytes / 1e6),
                CLI_F("bound_us", "%.2f", "  bound %8.1f us", bound * 1e6),
                cli_x(CLI_F("fraction_of_bound", "%.4f", "  %5.1f %% of bound", bound / med), 100),
                CLI_S("cpu", "%s", NULL, o->cpu));
    } else {
        fprintf(stderr, "gdncp bench attention: decode %s T=%lld: %s\n", s->label, (long long)T, gdn_errmsg());
    }
    gdn_attn_cache_destroy(cache);
    gdn_attn_plan_destroy(p);
    free(w), free(x), free(y);
    return rc ? 1 : 0;
}

typedef struct {
    int json, quick, threads, reps, compute_mask;
    const char *shape, *what;
    int64_t *Ts, nT;
} bench_attn_cli;

static void bench_attn_init(void *p) {
    bench_attn_cli *o = p;
    o->reps = 3, o->compute_mask = 3;
}

static const cli_opt bench_attn_table[] = {
    {CLI_FLAG("--json", bench_attn_cli, json, "one JSON object per row instead of text")},
    {CLI_FLAG("--quick", bench_attn_cli, quick, "0.8b, T 128, one repetition")},
    {CLI_STR("--shape", bench_attn_cli, shape, "S[,S..]", "35b-a3b (H 16, Hkv 2, E 2048), 9b (H 16, Hkv 4, E 4096), 0.8b (H 8, Hkv 2, E 1024), all d 256; all"), .dflt = "all"},
    {CLI_LIST("--T", bench_attn_cli, Ts, nT, "N[,N..]", "tokens, each in [1, 2^20]"), .dflt = "1024"},
    {CLI_I64("--threads", bench_attn_cli, threads, 1, 4096, "N", "OpenMP threads"), .dflt = "all"},
    {CLI_I64("--reps", bench_attn_cli, reps, 1, 50, "R", "timed repetitions (the median)")},
    {CLI_STR("--what", bench_attn_cli, what, "core,layer", "the attention core alone (gdn_sdpa), the layer, or both"), .dflt = "core,layer"},
    {CLI_ENUM("--compute", bench_attn_cli, compute_mask, "fp32|bf16|both", CLI_VALUES(1, 2, 3), "the core's and the layer's precision (both: alternating rep by rep)")},
};

const cli_command cmd_bench_attention_cli = {
    .name = "bench attention",
    .usage = "usage: gdncp bench attention [--json] [--quick] [--shape S[,S..]]\n"
             "       [--T N[,N..]] [--threads N] [--reps R] [--what core,layer] [--compute fp32|bf16|both]\n",
    .summary = "the gated attention layer and its core (gdn_sdpa) at the Qwen3.5 heads, against the measured peak",
    .size = sizeof(bench_attn_cli), .init = bench_attn_init, CLI_OPTS(bench_attn_table),
};

static int bench_attention_with(bench_attn_cli *c);

int cmd_bench_attention(int argc, char **argv) {
    bench_attn_cli c;
    int rc = cli_parse(&cmd_bench_attention_cli, argc - 1, argv + 1, &c, NULL);
    if (!rc) rc = bench_attention_with(&c);
    cli_free(&cmd_bench_attention_cli, &c);
    return rc;
}

static int bench_attention_with(bench_attn_cli *c) {
    bench_opts o = {.json = c->json, .quick = c->quick, .threads = c->threads, .reps = c->reps,
                    .compute_mask = c->compute_mask};
    int want[NSHAPES] = {0}, any_shape = 0, core = 1, layer = 1;
    int64_t *Ts = c->Ts, nT = c->nT;
    for (int64_t k = 0; k < nT; k++)
        if (Ts[k] < 1 || Ts[k] > (1 << 20)) {
            fprintf(stderr, "gdncp bench attention: option --T needs values in [1, 2^20], got %lld\n", (long long)Ts[k]);
            return CLI_USAGE_ERROR;
        }
    for (int is_shape = 1; is_shape >= 0; is_shape--) {
        const char *val = is_shape ? c->shape : c->what, *a = is_shape ? "--shape" : "--what";
        if (!val) continue;
        if (!is_shape) core = layer = 0;
        char buf[256];
        snprintf(buf, sizeof buf, "%s", val);
        for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
            int found = 0;
            if (is_shape) {
                for (int k = 0; k < NSHAPES; k++)
                    if (!strcmp(tok, shapes[k].label) || !strcmp(tok, "all")) want[k] = 1, found = 1;
                any_shape = 1;
            } else if (!strcmp(tok, "core")) core = found = 1;
            else if (!strcmp(tok, "layer")) layer = found = 1;
            if (!found) {
                fprintf(stderr, "gdncp bench attention: %s '%s' is unknown\n", a, tok);
                fputs(cmd_bench_attention_cli.usage, stderr);
                return CLI_USAGE_ERROR;
            }
        }
    }
    if (!any_shape)
        for (int k = 0; k < NSHAPES; k++) want[k] = !o.quick || k == 2; /* --quick: 0.8b */
    int64_t T_default = o.quick ? 128 : 1024;
    if (!Ts) Ts = &T_default, nT = 1;
    if (o.quick) o.reps = 1;
    if (!o.threads) o.threads = cli_max_threads();
    o.cpu = cli_cpu();
    o.peak = cli_peaks(o.threads, o.json, o.compute_mask & 2, " (the bf16 rows run their products there)",
                       &o.bf16_peak);
    if (!o.json)
        printf("CPU: %s; medians of %d after a warm-up; B = 1\nGFLOP/s: core 2 T^2 d H forward (QK^T and PV over the "
               "causal half), x3.5 forward+backward; layer: + projections 2E(2Hd + 2 Hkv d) + 2HdE per token (x3 "
               "with the backward); err: core o of the timed run (first tokens) and dq, dk, dv (a run on the first "
               "128 tokens) vs double loops; layer y, dx vs the double reference layer on the first tokens\n",
               o.cpu, o.reps);
    int rc = 0;
    for (int k = 0; k < NSHAPES && !rc; k++) {
        if (!want[k]) continue;
        for (int64_t t = 0; t < nT && !rc; t++) {
            if (core) rc = bench_core(&o, &shapes[k], Ts[t]);
            if (layer && !rc) rc = bench_layer_rows(&o, &shapes[k], Ts[t]);
            if (layer && !rc) rc = bench_decode_row(&o, &shapes[k], Ts[t], 0);
            if (layer && !rc) rc = bench_decode_row(&o, &shapes[k], Ts[t], 2);
        }
    }
    return rc;
}
