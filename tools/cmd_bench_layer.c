/* gdncp bench layer: the Qwen3.5 GatedDeltaNet layer at the 35B shape and a small one —
 * forward, forward+backward in both memory modes, and decode (B = 1 and 16).
 * FLOPs: projections 2E(2HkK + 2HvV + 2Hv) + 2HvVE per token forward, three times that
 * forward+backward, plus the kernel's DESIGN §3 FLOPs (forward, resp. forward + backward), per
 * token per value head. Fractions are of this machine's native-width FMA peak, measured here.
 * Decode is memory-bound: each step streams the weights and the states once; its bound is the
 * time to stream those bytes at the bandwidth measured in the same run over buffers of the same
 * sizes (so cache effects are the same on both sides). */
#include "cli/cli.h"
#include "commands.h"
#include "cli/parse.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const char *label;
    int64_t E, Hk, Hv, K, V, T;
} layer_shape;

static double proj_flops_per_token(const gdn_layer_config *c) {
    const double E = c->E, kd = c->Hk * c->K, vd = c->Hv * c->V;
    return 2 * E * (2 * kd + 2 * vd + 2 * c->Hv) + 2 * vd * E;
}
/* Qwen-like weights: projections ~ 1/sqrt(fan-in), A = exp(A_log) in (0.5, 16], dt_bias 1. */
static float *layer_weights(const gdn_layer_config *c, uint64_t *s) {
    float *w = calloc(gdn_layer_param_floats(c), sizeof(float));
    for (int i = 0; w && i < GDN_P_COUNT; i++) {
        gdn_param_info info;
        if (gdn_layer_param(c, i, &info)) break;
        const size_t n = info.numel;
        const float a = i == GDN_P_OUT_PROJ ? 1.0f / sqrtf((float)(c->Hv * c->V)) : 1.0f / sqrtf((float)c->E);
        float *r = cli_random_floats(n, -a, a, s), *p = w + info.offset;
        for (size_t j = 0; r && j < n; j++)
            p[j] = i == GDN_P_A_LOG ? logf(0.5f + 15.5f * (r[j] / (2 * a) + 0.5f))
                   : i == GDN_P_DT_BIAS || i == GDN_P_NORM ? 1.0f
                   : i == GDN_P_CONV1D ? r[j] * sqrtf((float)c->E) * 0.5f
                                       : r[j];
        free(r);
    }
    return w;
}

/* The layer (c.compute) vs the double reference on a short prefix (the reference is plain
 * loops), the reference in precision ref_compute: the exact one (fp32) or the BF16 mode's oracle
 * (its bf16-rounded operands). */
static double error_vs_reference(gdn_layer_config c, const float *w, const float *x, int64_t tp, int ref_compute) {
    c.T = tp, c.B = 1;
    gdn_layer_config rc_cfg = c;
    rc_cfg.compute = ref_compute;
    const size_t nx = (size_t)tp * c.E, nw = gdn_layer_param_floats(&c);
    double *xd = malloc(sizeof(double) * nx), *wd = malloc(sizeof(double) * nw), *yd = malloc(sizeof(double) * nx);
    float *y = malloc(sizeof(float) * nx);
    double err = NAN;
    gdn_layer_plan *lp = NULL;
    if (xd && wd && yd && y) {
        for (size_t i = 0; i < nx; i++) xd[i] = x[i];
        for (size_t i = 0; i < nw; i++) wd[i] = w[i];
        if (!gdn_layer_reference_forward(&rc_cfg, yd, xd, wd) && !gdn_layer_plan_create(&lp, &c) &&
            !gdn_layer_forward(lp, y, NULL, x, w, NULL, NULL)) {
            err = cli_rel_err(y, yd, (int64_t)nx);
        }
    }
    gdn_layer_plan_destroy(lp);
    free(xd), free(wd), free(yd), free(y);
    return err;
}

enum { MODE_FORWARD, MODE_KEEP_MIN, MODE_KEEP_PROJ };

/* Each mode (forward; forward+backward keeping the minimum or the projections) in each compute
 * precision asked for, the precisions alternating rep by rep so that a noisy machine hits both
 * alike; the BF16 row also prints its speed-up over the fp32 row (the ratio of the medians). */
static int bench_layer(const layer_shape *s, int threads, double peak, double bf16_peak, int compute_mask,
                       int json, int quick, const char *cpu) {
    gdn_layer_config c = gdn_layer_config_default(1, s->T, s->E, s->Hk, s->Hv, s->K, s->V);
    c.threads = threads;
    uint64_t seed = 0x9E3779B97F4A7C15ull;
    float *w = layer_weights(&c, &seed);
    const size_t nx = (size_t)c.T * c.E, nw = gdn_layer_param_floats(&c);
    float *x = cli_random_floats(nx, -1, 1, &seed), *dy = cli_random_floats(nx, -1, 1, &seed);
    float *y = malloc(sizeof(float) * nx), *dx = malloc(sizeof(float) * nx), *dw = malloc(sizeof(float) * nw);
    if (!w || !x || !dy || !y || !dx || !dw) {
        fprintf(stderr, "gdncp bench layer: out of memory for %s\n", s->label);
        return 1;
    }
    /* the error on the first tokens: 32 of them for BF16, whose products of <= 16 rows are fp32 */
    double err[2] = {NAN, NAN}, err_oracle = NAN; /* vs the exact reference; bf16 also vs its oracle */
    for (int cm = 0; cm < 2; cm++)
        if (compute_mask & (1 << cm)) {
            c.compute = cm;
            const int64_t tp = quick ? (cm ? 24 : 8) : (cm ? 32 : 16);
            err[cm] = error_vs_reference(c, w, x, tp, GDN_COMPUTE_FP32);
            if (cm) err_oracle = error_vs_reference(c, w, x, tp, GDN_COMPUTE_BF16);
        }
    const int reps = quick ? 1 : 3;
    for (int mode = MODE_FORWARD; mode <= MODE_KEEP_PROJ; mode++) {
        c.keep = mode == MODE_KEEP_PROJ ? GDN_LAYER_KEEP_PROJ : GDN_LAYER_KEEP_MIN;
        gdn_layer_plan *lp[2] = {NULL, NULL};
        float *saved[2] = {NULL, NULL};
        size_t nsaved = 0;
        double t[2][8];
        int rc = 0;
        for (int cm = 0; cm < 2 && !rc; cm++)
            if (compute_mask & (1 << cm)) {
                c.compute = cm;
                rc = gdn_layer_plan_create(&lp[cm], &c);
                nsaved = lp[cm] ? cli_layer_plan(lp[cm]).saved_floats : 0;
                if (!rc && mode != MODE_FORWARD && !(saved[cm] = malloc(sizeof(float) * (nsaved + 1)))) {
                    fprintf(stderr, "gdncp bench layer: %s: out of memory for the saved floats\n", s->label);
                    rc = GDN_ERR_NOMEM;
                }
            }
        for (int r = 0; r <= reps && !rc; r++) /* r = 0 warms up */
            for (int k = 0; k < 2 && !rc; k++) {
                const int cm = (r + k) % 2; /* alternate which precision goes first */
                if (!lp[cm]) continue;
                const double t0 = cli_now();
                rc = gdn_layer_forward(lp[cm], y, saved[cm], x, w, NULL, NULL);
                if (!rc && mode != MODE_FORWARD) rc = gdn_layer_backward(lp[cm], dx, dw, x, w, saved[cm], dy);
                if (r) t[cm][r - 1] = cli_now() - t0;
            }
        if (rc) {
            if (rc != GDN_ERR_NOMEM) fprintf(stderr, "gdncp bench layer: %s: %s\n", s->label, gdn_errmsg());
            for (int cm = 0; cm < 2; cm++) free(saved[cm]), gdn_layer_plan_destroy(lp[cm]);
            return 1;
        }
        const int fwd = mode == MODE_FORWARD; /* the kernel's directions: forward (1), or both (3) */
        const double flops = (double)c.T * ((fwd ? 1 : 3) * proj_flops_per_token(&c) +
                                            cli_rule_flops(c.K, c.V, c.chunk, (double)c.Hv, fwd ? 1 : 3));
        const double kept = mode == MODE_FORWARD ? 0 : 4.0 * nsaved / c.T;
        const char *dir = mode == MODE_FORWARD ? "layer_forward" : "layer_fwd_bwd";
        const char *keep = mode == MODE_FORWARD ? "none" : mode == MODE_KEEP_MIN ? "min" : "proj";
        const double med32 = lp[0] ? cli_median(t[0], reps) : NAN;
        for (int cm = 0; cm < 2; cm++) {
            if (!lp[cm]) continue;
            const double med = cli_median(t[cm], reps), gflops = flops / med / 1e9;
            const double speedup = cm && lp[0] ? med32 / med : NAN;
            CLI_ROW(json, CLI_S("direction", "%s", "%-14s", dir), CLI_S("shape", "%s", " %-6s", s->label),
                    cli_at(CLI_I("E", "%lld", " E=%lld", c.E), 2), CLI_I("Hk", "%lld", " Hk=%lld", c.Hk),
                    CLI_I("Hv", "%lld", " Hv=%lld", c.Hv), CLI_I("K", "%lld", " K=V=%lld", c.K),
                    CLI_I("V", "%lld", NULL, c.V), CLI_I("T", "%lld", " T=%lld", c.T),
                    CLI_I("threads", "%lld", " thr=%lld", threads), CLI_S("keep", "%s", " keep=%-4s", keep),
                    cli_at(CLI_S("compute", "%s", " %s", gdn_compute_name(cm)), 1),
                    cli_at(CLI_F("ms", "%.3f", " %9.1f ms", med * 1e3), 2), CLI_I("reps", "%lld", NULL, reps),
                    CLI_F("tokens_per_s", "%.1f", " %9.0f tok/s", c.T / med),
                    CLI_F("gflops", "%.3f", " %7.1f GFLOP/s", gflops), CLI_F("peak_gflops", "%.3f", NULL, peak),
                    cli_x(CLI_F("fraction_of_peak", "%.4f", " %5.1f %% of fp32 peak", gflops / peak), 100),
                    cli_or_null(cm, CLI_F("bf16_peak_gflops", "%.3f", NULL, bf16_peak)),
                    cli_or_null(cm, cli_x(CLI_F("fraction_of_bf16_peak", "%.4f", " %5.1f %% of bf16 peak",
                                                gflops / bf16_peak), 100)),
                    cli_or_null(cm && lp[0], CLI_F("speedup_vs_fp32", "%.3f", " %5.2fx fp32", speedup)),
                    CLI_F("bytes_kept_per_token", "%.1f", "  kept %8.0f B/token", kept),
                    CLI_I("x_bytes_per_token", "%lld", NULL, 4 * c.E),
                    CLI_F("rel_err_vs_reference", "%.3e", "  err %.1e", err[cm]),
                    cli_or_null(cm, CLI_F("rel_err_vs_bf16_oracle", "%.3e", " (vs its bf16-operand oracle %.1e)",
                                          err_oracle)),
                    CLI_S("gemm_path", "%s", NULL, cli_layer_plan(lp[cm]).path), CLI_S("cpu", "%s", NULL, cpu));
        }
        for (int cm = 0; cm < 2; cm++) free(saved[cm]), gdn_layer_plan_destroy(lp[cm]);
    }
    free(w), free(x), free(dy), free(y), free(dx), free(dw);
    return 0;
}

static int bench_decode(const layer_shape *s, int64_t B, int threads, int bf16, int json, int quick,
                        const char *cpu) {
    gdn_layer_config c = gdn_layer_config_default(B, 1, s->E, s->Hk, s->Hv, s->K, s->V);
    c.threads = threads;
    uint64_t seed = 0x2545F4914F6CDD1Dull;
    /* BF16: the weights stay BF16 in memory, as a BF16 checkpoint's do for inference */
    gdn_layer_weights lw = {.cfg = c, .w = layer_weights(&c, &seed)};
    if (bf16 && lw.w && gdn_layer_weights_to_bf16(&lw)) lw.w = NULL;
    c = lw.cfg;
    const void *w = gdn_layer_weights_data(&lw);
    const size_t nconv = (size_t)B * gdn_layer_conv_dim(&c) * c.Kc, ns = (size_t)B * c.Hv * c.K * c.V;
    float *x = cli_random_floats((size_t)B * c.E, -1, 1, &seed), *y = malloc(sizeof(float) * B * c.E);
    float *conv = cli_random_floats(nconv, -1, 1, &seed), *rec = cli_random_floats(ns, -0.1f, 0.1f, &seed);
    gdn_layer_plan *lp = NULL;
    int rc = w && x && y && conv && rec ? gdn_layer_plan_create(&lp, &c) : GDN_ERR_NOMEM;
    const int steps = quick ? 5 : 30;
    double t[64];
    for (int r = 0; r <= steps && !rc; r++) {
        const double t0 = cli_now();
        rc = gdn_layer_decode(lp, y, x, w, conv, rec);
        if (r) t[r - 1] = cli_now() - t0;
    }
    if (rc) {
        fprintf(stderr, "gdncp bench layer: decode %s B=%lld: %s\n", s->label, (long long)B, gdn_errmsg());
        return 1;
    }
    const double med = cli_median(t, steps);
    size_t wbytes = 0;
    for (int i = 0; i < GDN_P_COUNT; i++) {
        gdn_param_info p;
        if (!gdn_layer_param(&c, i, &p)) wbytes += (bf16 ? 2 : 4) * p.numel;
    }
    const size_t sbytes = 4 * (nconv + ns);
    const double bound = cli_stream_seconds(wbytes, 0, threads) + cli_stream_seconds(sbytes, 1, threads);
    const double bytes = (double)wbytes + 2.0 * sbytes;
    CLI_ROW(json, CLI_S("direction", "%s", "%s  ", "layer_decode"), CLI_S("shape", "%s", " %-6s", s->label),
            CLI_I("B", "%lld", " B=%-3lld", B), CLI_I("threads", "%lld", " thr=%lld", threads),
            cli_at(CLI_F("us_per_token", "%.2f", " %8.1f us/token", med * 1e6 / B), 3),
            cli_at(CLI_F("us_per_step", "%.2f", " %9.1f us/step", med * 1e6), 2),
            cli_at(cli_x(CLI_F("bytes_per_step", "%.0f", "  streams %.1f MB", bytes), 1e-6), 4),
            CLI_I("weights_bytes", "%lld", NULL, wbytes),
            CLI_S("weights_dtype", "%s", " (weights %s", bf16 ? "BF16" : "F32"),
            CLI_F(NULL, NULL, " %.1f MB)", wbytes / 1e6), CLI_F("bound_us", "%.2f", "  bound %8.1f us", bound * 1e6),
            cli_x(CLI_F("fraction_of_bound", "%.4f", "  %5.1f %% of bound", bound / med), 100),
            CLI_S("gemm_path", "%s", NULL, cli_layer_plan(lp).path), CLI_S("cpu", "%s", NULL, cpu));
    gdn_layer_plan_destroy(lp);
    gdn_layer_weights_free(&lw);
    free(x), free(y), free(conv), free(rec);
    return 0;
}

typedef struct {
    int json, quick, compute_mask; /* bit 0: fp32, bit 1: bf16 */
    int64_t T;
} bench_layer_opts;

static void bench_layer_init(void *p) {
    bench_layer_opts *o = p;
    o->compute_mask = 3, o->T = 4096;
}

static const cli_opt bench_layer_table[] = {
    {CLI_FLAG("--json", bench_layer_opts, json, "one JSON object per row instead of text")},
    {CLI_FLAG("--quick", bench_layer_opts, quick, "toy sizes (T at most 256)")},
    {CLI_I64("--T", bench_layer_opts, T, 1, 1 << 24, "N", "tokens")},
    {CLI_ENUM("--compute", bench_layer_opts, compute_mask, "fp32|bf16|both", CLI_VALUES(1, 2, 3), "the projections' precision (both: alternating rep by rep)")},
};

const cli_command cmd_bench_layer_cli = {
    .name = "bench layer",
    .usage = "usage: gdncp bench layer [--json] [--quick] [--T N] [--compute fp32|bf16|both]\n",
    .summary = "the GatedDeltaNet layer: forward, forward + backward, decode, fp32 and BF16 compute",
    .about = "  the GatedDeltaNet layer at the Qwen3.5 shapes: forward, forward+backward and decode, fp32 and BF16\n",
    .size = sizeof(bench_layer_opts), .init = bench_layer_init, CLI_OPTS(bench_layer_table),
};

int cmd_bench_layer(int argc, char **argv) {
    bench_layer_opts o;
    if (cli_parse(&cmd_bench_layer_cli, argc - 1, argv + 1, &o, NULL)) return CLI_USAGE_ERROR;
    const int json = o.json, quick = o.quick, compute_mask = o.compute_mask;
    int64_t T = o.T;
    if (quick && T > 256) T = 256;
    const int maxt = cli_max_threads();
    const char *cpu = cli_cpu();
    const double peak = cli_peak_gflops(maxt, json);
    if (!json)
        printf("GEMM path: fp32 %s; bf16 %s\n", gdn_compute_path(GDN_COMPUTE_FP32), gdn_compute_path(GDN_COMPUTE_BF16));
    const double bf16_peak = compute_mask & 2 ? cli_bf16_peak(0, maxt, json,
                                                              " (0: the path has no instruction of its own)")
                                              : NAN;
    if (!json) {
        printf("GFLOP/s: projections 2E(2HkK+2HvV+2Hv)+2HvVE per token (x3 with the backward) + kernel DESIGN §3; "
               "err: y vs the exact double reference layer on the first tokens (16; bf16: 32, with in_proj_qkv, "
               "in_proj_z, out_proj in bf16: also vs the reference with those operands rounded to bf16)\n");
    }
    const layer_shape shapes[] = {{"qwen35b", 2048, 16, 32, 128, 128, T}, {"small", 512, 4, 8, 64, 64, T}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        if (bench_layer(&shapes[i], maxt, peak, bf16_peak, compute_mask, json, quick, cpu)) return 1;
    const int64_t batches[] = {1, 16};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        for (int b = 0; b < 2; b++)
            for (int bf16 = 0; bf16 < 2; bf16++)
                for (int t = 1; t <= maxt; t = t == maxt ? maxt + 1 : maxt)
                    if (bench_decode(&shapes[i], batches[b], t, bf16, json, quick, cpu)) return 1;
    return 0;
}
