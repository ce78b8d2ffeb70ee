/* gdncp bench moe: the sparse mixture-of-experts block (gdn_moe_*, DESIGN §13) at the
 * Qwen3.5-35B-A3B shape (E 2048, 256 experts, top 8, I 512, shared 512) and the Qwen3-Next shape
 * (E 2048, 512 experts, top 10, I 512, shared 512): forward, forward+backward, for each T, and
 * decode (B = 1), in fp32 and BF16 compute.
 *
 * FLOPs (DESIGN §13) per token forward: 2·k·3·E·I (routed) + 2·3·E·Is (shared) + 2·E·n (router);
 * forward+backward three times that (the backward's products are twice the forward's).
 * Elementwise work (softmax, top-k, SwiGLU, the sort, gather and combine) is not counted.
 * Fractions are of this machine's native-width fp32 FMA peak and of the BF16 instruction peak of
 * the path, measured in the same run: again right before every timed run (a shared machine's
 * speed drifts by 2x between seconds), each fraction the median over the runs of that run's
 * ratio, as bench matmul does. The fp32 and BF16 plans alternate rep by rep (which goes first
 * too) and each time is the median of --reps runs after a warm-up; the warm-up forward
 * also collects the router's statistics: the expert-load spread, min / mean / max rows per
 * expert. Every row prints the error of its block's y on the first rows against the float64
 * reference (gdn_moe_reference_forward, same routing rule): max |y - y_ref| / max |y_ref|.
 *
 * Weights: normal(0, 0.02) (cli_fill_normal), the router normal(0, 1/sqrt(E)) so that the
 * logits of the normal(0, 1) token rows are ~normal(0, 1): routing spread over the experts.
 * Allocated once per shape and reused across T.
 *
 * Decode (one token, N = 1): memory-bound; a step reads the router, the k chosen experts and the
 * shared expert once. Its bound is the time to stream those bytes (cli_stream_seconds, a read
 * stream over a buffer of that size, measured in rounds alternating with the steps); the steps
 * cycle through distinct tokens, so the chosen experts change step by step and come from memory
 * as a real generation's do. */
#include "cli/cli.h"
#include "commands.h"
#include "cli/parse.h"
#include "bench_moe.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const moe_shape bench_moe_shapes[3] = {
    {"35b-a3b", 2048, 256, 8, 512, 512},
    {"next", 2048, 512, 10, 512, 512},
    {"quick", 256, 16, 4, 64, 64},
};
#define shapes bench_moe_shapes

double bench_moe_flops_per_token(const moe_shape *s) {
    const double E = (double)s->E;
    return 2.0 * (double)s->k * 3 * E * (double)s->I + 2.0 * 3 * E * (double)s->Is + 2.0 * E * (double)s->n;
}

/* The float64 reference on the first tp rows of x. Its weights in double: the router, the shared
 * expert and only the experts those rows choose (the rest of the array stays calloc's untouched
 * zero pages: the reference reads nothing else, and the whole array in double would be 6 to 13
 * GB). A first pass finds the choices (from the router alone), the second computes y. */
int bench_moe_reference_rows(const gdn_moe_config *cfg, const float *w, const float *x, int64_t tp, double *yref) {
    gdn_moe_config c = *cfg;
    c.N = tp;
    const size_t nw = gdn_moe_param_floats(&c), nx = (size_t)(tp * c.E);
    double *wd = calloc(nw, sizeof(double)), *xd = malloc(sizeof(double) * nx);
    int32_t *sel = malloc(sizeof(int32_t) * (size_t)(tp * c.top_k));
    char *have = calloc((size_t)c.n_experts, 1);
    int rc = wd && xd && sel && have ? GDN_OK : GDN_ERR_NOMEM;
    for (size_t i = 0; !rc && i < nx; i++) xd[i] = x[i];
    const int dense[] = {GDN_MOE_ROUTER, GDN_MOE_SHARED_GATE, GDN_MOE_SHARED_UP, GDN_MOE_SHARED_DOWN,
                         GDN_MOE_SHARED_EXPERT_GATE};
    for (size_t d = 0; !rc && d < sizeof dense / sizeof dense[0]; d++) {
        gdn_param_info p;
        rc = gdn_moe_param(&c, dense[d], &p);
        for (size_t i = 0; !rc && i < p.numel; i++) wd[p.offset + i] = w[p.offset + i];
    }
    if (!rc) rc = gdn_moe_reference_forward(&c, yref, xd, wd, sel);
    gdn_param_info pGU, pD;
    if (!rc) rc = gdn_moe_param(&c, GDN_MOE_GATE_UP, &pGU);
    if (!rc) rc = gdn_moe_param(&c, GDN_MOE_DOWN, &pD);
    const size_t oGU = rc ? 0 : pGU.offset, oD = rc ? 0 : pD.offset;
    const size_t nGU = (size_t)(2 * c.I * c.E), nD = (size_t)(c.E * c.I);
    for (int64_t j = 0; !rc && j < tp * c.top_k; j++) {
        const int32_t e = sel[j];
        if (have[e]) continue;
        have[e] = 1;
        for (size_t i = 0; i < nGU; i++) wd[oGU + e * nGU + i] = w[oGU + e * nGU + i];
        for (size_t i = 0; i < nD; i++) wd[oD + e * nD + i] = w[oD + e * nD + i];
    }
    if (!rc) rc = gdn_moe_reference_forward(&c, yref, xd, wd, NULL);
    free(wd), free(xd), free(sel), free(have);
    return rc;
}

enum { MODE_FORWARD, MODE_FWD_BWD };

/* Forward and forward+backward at one T, each compute precision asked for, alternating. */
static int bench_T(const bench_opts *o, const moe_shape *s, int64_t T, const float *w, float *dw, const float *x,
                   const float *dy, float *const y[2], float *dx, const double *yref, int64_t tp) {
    gdn_moe_config c = gdn_moe_config_default(T, s->E, s->n, s->k, s->I, s->Is);
    c.threads = o->threads;
    gdn_moe_plan *p[2] = {NULL, NULL};
    float *saved = NULL;
    double *stats = calloc((size_t)(2 * s->n), sizeof(double));
    /* [mode][compute][rep]: the time, and the fp32 and BF16 peaks measured just before */
    const size_t nt = 2 * 2 * (size_t)o->reps;
    double *t = malloc(sizeof(double) * 3 * nt), *pk32 = t + nt, *pkbf = pk32 + nt;
    int rc = stats && t ? GDN_OK : GDN_ERR_NOMEM;
    for (int cm = 0; cm < 2 && !rc; cm++)
        if (o->compute_mask & (1 << cm)) {
            c.compute = cm;
            rc = gdn_moe_plan_create(&p[cm], &c);
        }
    const int first = p[0] ? 0 : 1;
    if (!rc && !(saved = malloc(sizeof(float) * (cli_moe_plan(p[first]).saved_floats + 1)))) rc = GDN_ERR_NOMEM;
    int got_stats = 0;
    for (int mode = MODE_FORWARD; mode <= MODE_FWD_BWD && !rc; mode++)
        for (int r = 0; r <= o->reps && !rc; r++) /* r = 0 warms up */
            for (int kk = 0; kk < 2 && !rc; kk++) {
                const int cm = (r + kk) % 2; /* alternate which precision goes first */
                if (!p[cm]) continue;
                double *st = !got_stats && cm == first ? stats : NULL; /* one untimed forward's statistics */
                got_stats |= st != NULL;
                const size_t at = (size_t)(mode * 2 + cm) * (size_t)o->reps + (size_t)(r ? r - 1 : 0);
                if (r) {
                    pk32[at] = gdn_measure_peak_gflops(o->threads);
                    pkbf[at] = cm ? cli_bf16(0, o->threads).peak_gflops : NAN;
                }
                const double t0 = cli_now();
                rc = gdn_moe_forward(p[cm], y[cm], mode == MODE_FWD_BWD ? saved : NULL, x, w, st, NULL, NULL);
                if (!rc && mode == MODE_FWD_BWD) rc = gdn_moe_backward(p[cm], dx, dw, x, w, saved, dy, NULL);
                if (r) t[at] = cli_now() - t0;
            }
    if (rc) {
        if (rc == GDN_ERR_NOMEM && !p[0] && !p[1]) fprintf(stderr, "gdncp bench moe: %s T=%lld: out of memory\n", s->label, (long long)T);
        else fprintf(stderr, "gdncp bench moe: %s T=%lld: %s\n", s->label, (long long)T, gdn_errmsg());
    } else {
        double lmin = INFINITY, lmax = 0;
        for (int64_t e = 0; e < s->n; e++) lmin = fmin(lmin, stats[e]), lmax = fmax(lmax, stats[e]);
        const double lmean = (double)T * (double)s->k / (double)s->n;
        double err[2] = {NAN, NAN};
        for (int cm = 0; cm < 2; cm++)
            if (p[cm]) err[cm] = cli_rel_err(y[cm], yref, tp * s->E);
        for (int mode = MODE_FORWARD; mode <= MODE_FWD_BWD; mode++) {
            const double flops = (mode == MODE_FWD_BWD ? 3.0 : 1.0) * (double)T * bench_moe_flops_per_token(s);
            const char *dir = mode == MODE_FORWARD ? "moe_forward" : "moe_fwd_bwd";
            const double med32 = p[0] ? cli_median(t + (mode * 2 + 0) * o->reps, o->reps) : NAN;
            for (int cm = 0; cm < 2; cm++) {
                if (!p[cm]) continue;
                double *tt = t + (mode * 2 + cm) * o->reps, *p32 = pk32 + (mode * 2 + cm) * o->reps,
                       *pbf = pkbf + (mode * 2 + cm) * o->reps, f32[64], fbf[64];
                for (int r = 0; r < o->reps; r++) f32[r] = flops / tt[r] / 1e9 / p32[r], fbf[r] = flops / tt[r] / 1e9 / pbf[r];
                const double fr32 = cli_median(f32, o->reps), frbf = cm ? cli_median(fbf, o->reps) : NAN;
                const double peak = cli_median(p32, o->reps), bpeak = cm ? cli_median(pbf, o->reps) : NAN;
                const double med = cli_median(tt, o->reps), gf = flops / med / 1e9;
                const double speedup = cm && p[0] ? med32 / med : NAN;
                /* fraction_of_bf16_peak: null in JSON, nan in the text on a path without an instruction peak */
                CLI_ROW(o->json, CLI_S("direction", "%s", "%-11s", dir), CLI_S("shape", "%s", " %-7s", s->label),
                        CLI_I("E", "%lld", NULL, s->E), CLI_I("n_experts", "%lld", NULL, s->n),
                        CLI_I("top_k", "%lld", NULL, s->k), CLI_I("I", "%lld", NULL, s->I),
                        CLI_I("Is", "%lld", NULL, s->Is), cli_at(CLI_I("T", "%lld", " T=%-5lld", T), 2),
                        CLI_I("threads", "%lld", " thr=%lld", o->threads),
                        cli_at(CLI_S("compute", "%s", " %s", gdn_compute_name(cm)), 1),
                        cli_at(CLI_F("ms", "%.3f", " %9.1f ms", med * 1e3), 2), CLI_I("reps", "%lld", NULL, o->reps),
                        CLI_F("tokens_per_s", "%.1f", " %8.0f tok/s", (double)T / med),
                        CLI_F("gflops", "%.3f", " %7.1f GFLOP/s", gf), CLI_F("peak_gflops", "%.3f", NULL, peak),
                        cli_x(CLI_F("fraction_of_peak", "%.4f", " %5.1f %% of fp32 peak", fr32), 100),
                        cli_or_null(cm, CLI_F("bf16_peak_gflops", "%.3f", NULL, bpeak)),
                        cli_x(CLI_N("fraction_of_bf16_peak", "%.4f", cm ? " %5.1f %% of bf16 peak" : NULL,
                                    cm && bpeak > 0 ? frbf : NAN), 100),
                        cli_or_null(cm && p[0], CLI_F("speedup_vs_fp32", "%.3f", " %5.2fx fp32", speedup)),
                        CLI_F("load_min", "%.0f", "  load %.0f", lmin), CLI_F("load_mean", "%.2f", "/%.1f", lmean),
                        CLI_F("load_max", "%.0f", "/%.0f", lmax), CLI_I("ref_rows", "%lld", NULL, tp),
                        CLI_F("rel_err_vs_reference", "%.3e", "  err %.1e", err[cm]),
                        CLI_S("gemm_path", "%s", NULL, gdn_compute_path(cm)), CLI_S("cpu", "%s", NULL, o->cpu));
            }
        }
        fflush(stdout);
    }
    free(saved), free(stats), free(t);
    for (int cm = 0; cm < 2; cm++) gdn_moe_plan_destroy(p[cm]);
    return rc ? 1 : 0;
}

/* Decode: one token per call (N = 1), the tokens x[0..tp) in turn, each precision asked for;
 * rounds of tp steps of each precision alternate with a stream of the step's bytes. */
static int bench_decode(const bench_opts *o, const moe_shape *s, const float *w, const float *x,
                        const double *yref, int64_t tp) {
    gdn_moe_config c = gdn_moe_config_default(1, s->E, s->n, s->k, s->I, s->Is);
    c.threads = o->threads;
    gdn_moe_plan *p[2] = {NULL, NULL};
    const int rounds = o->quick ? 3 : 9;
    const int nsteps = rounds * (int)tp;
    double *t = malloc(sizeof(double) * (size_t)(2 * nsteps + 3 * rounds)), *tb = t + 2 * nsteps;
    double *fr = tb + rounds;  /* [compute][round]: the round's bound / its median step */
    float *y = malloc(sizeof(float) * (size_t)(2 * tp * s->E)); /* [compute][token]: the last round's outputs */
    int rc = t && y ? GDN_OK : GDN_ERR_NOMEM;
    for (int cm = 0; cm < 2 && !rc; cm++)
        if (o->compute_mask & (1 << cm)) {
            c.compute = cm;
            rc = gdn_moe_plan_create(&p[cm], &c);
        }
    const double bytes = 4.0 * ((double)s->n * s->E + (double)s->k * 3 * s->I * s->E +
                                (s->Is ? 3.0 * s->Is * s->E + s->E : 0.0));
    for (int tok = 0; tok < (int)tp && !rc; tok++) /* warm-up: every token once, untimed */
        for (int cm = 0; cm < 2 && !rc; cm++)
            if (p[cm])
                rc = gdn_moe_forward(p[cm], y + (cm * tp + tok) * s->E, NULL, x + tok * s->E, w, NULL, NULL, NULL);
    for (int r = 0; r < rounds && !rc; r++) {
        for (int kk = 0; kk < 2 && !rc; kk++) {
            const int cm = (r + kk) % 2;
            if (!p[cm]) continue;
            for (int tok = 0; tok < (int)tp && !rc; tok++) {
                const double t0 = cli_now();
                rc = gdn_moe_forward(p[cm], y + (cm * tp + tok) * s->E, NULL, x + tok * s->E, w, NULL, NULL, NULL);
                t[cm * nsteps + r * tp + tok] = cli_now() - t0;
            }
        }
        tb[r] = cli_stream_seconds((size_t)bytes, 0, o->threads);
        for (int cm = 0; cm < 2; cm++) {
            if (!p[cm]) continue;
            double tr[4096];
            for (int i = 0; i < tp; i++) tr[i] = t[cm * nsteps + r * tp + i];
            fr[cm * rounds + r] = tb[r] / cli_median(tr, (int)tp);
        }
    }
    if (rc) {
        fprintf(stderr, "gdncp bench moe: decode %s: %s\n", s->label, gdn_errmsg());
    } else {
        const double bound = cli_median(tb, rounds);
        for (int cm = 0; cm < 2; cm++) {
            if (!p[cm]) continue;
            const double med = cli_median(t + cm * nsteps, nsteps), frac = cli_median(fr + cm * rounds, rounds);
            const double e = cli_rel_err(y + cm * tp * s->E, yref, tp * s->E);
            CLI_ROW(o->json, CLI_S("direction", "%s", "%s ", "moe_decode"), CLI_S("shape", "%s", " %-7s", s->label),
                    cli_at(CLI_I("B", "%lld", " B=%lld  ", 1), 2), CLI_I("threads", "%lld", " thr=%lld", o->threads),
                    cli_at(CLI_S("compute", "%s", " %s", gdn_compute_name(cm)), 1),
                    cli_at(CLI_F("us_per_token", "%.2f", " %9.1f us/token", med * 1e6), 2),
                    CLI_I("steps", "%lld", NULL, nsteps),
                    cli_x(CLI_F("bytes_per_step", "%.0f", "  streams %.1f MB", bytes), 1e-6),
                    CLI_I(NULL, NULL, " (router, %lld experts, shared)", s->k),
                    CLI_F("bound_us", "%.2f", "  bound %8.1f us", bound * 1e6),
                    cli_x(CLI_F("fraction_of_bound", "%.4f", "  %5.1f %% of bound", frac), 100),
                    CLI_F("time_over_bound", "%.3f", " (%.2fx)", 1.0 / frac), CLI_I("ref_rows", "%lld", NULL, tp),
                    CLI_F("rel_err_vs_reference", "%.3e", "  err %.1e", e),
                    CLI_S("gemm_path", "%s", NULL, gdn_compute_path(cm)), CLI_S("cpu", "%s", NULL, o->cpu));
        }
        fflush(stdout);
    }
    for (int cm = 0; cm < 2; cm++) gdn_moe_plan_destroy(p[cm]);
    free(t), free(y);
    return rc ? 1 : 0;
}

static int bench_shape(const bench_opts *o, const moe_shape *s, const int64_t *Ts, int64_t nT) {
    int64_t Tmax = 1;
    for (int64_t i = 0; i < nT; i++) Tmax = Ts[i] > Tmax ? Ts[i] : Tmax;
    const int64_t tp = o->quick ? 4 : 16; /* the reference's rows (and the decode's tokens) */
    const int64_t rows = Tmax > tp ? Tmax : tp;
    gdn_moe_config c = gdn_moe_config_default(rows, s->E, s->n, s->k, s->I, s->Is);
    const size_t nw = gdn_moe_param_floats(&c), nx = (size_t)(rows * s->E);
    float *w = calloc(nw, sizeof(float)), *dw = malloc(sizeof(float) * nw);
    float *x = malloc(sizeof(float) * nx), *dy = malloc(sizeof(float) * nx), *dx = malloc(sizeof(float) * nx);
    float *y[2] = {malloc(sizeof(float) * nx), o->compute_mask & 2 ? malloc(sizeof(float) * nx) : NULL};
    double *yref = malloc(sizeof(double) * (size_t)(tp * s->E));
    int rc = 0;
    if (!w || !dw || !x || !dy || !dx || !y[0] || (o->compute_mask & 2 && !y[1]) || !yref) {
        fprintf(stderr, "gdncp bench moe: %s: out of memory for %.1f GB of weights and their gradient\n", s->label,
                8e-9 * (double)nw);
        rc = 1;
    }
    if (!rc) {
        for (int i = 0; i < GDN_MOE_COUNT; i++) {
            const float sd = i == GDN_MOE_ROUTER ? 1.0f / sqrtf((float)s->E) : 0.02f;
            gdn_param_info p;
            if (!gdn_moe_param(&c, i, &p)) cli_fill_normal(w + p.offset, p.numel, sd, 0x5EED0000u + (uint64_t)i);
        }
        cli_fill_normal(x, nx, 1.0f, 0xA11CEu);
        cli_fill_normal(dy, nx, 1.0f, 0xB0Bu);
        if (bench_moe_reference_rows(&c, w, x, tp, yref)) {
            fprintf(stderr, "gdncp bench moe: %s: the reference: %s\n", s->label, gdn_errmsg());
            rc = 1;
        }
    }
    if (!rc && !o->json)
        printf("shape %s: E %lld, %lld experts, top %lld, I %lld, shared %lld; %.2f GB of fp32 weights; %.1f MFLOP "
               "per token forward\n",
               s->label, (long long)s->E, (long long)s->n, (long long)s->k, (long long)s->I, (long long)s->Is,
               4e-9 * (double)nw, bench_moe_flops_per_token(s) / 1e6);
    for (int64_t i = 0; i < nT && !rc; i++) {
        float *yy[2] = {o->compute_mask & 1 ? y[0] : NULL, o->compute_mask & 2 ? y[1] : NULL};
        rc = bench_T(o, s, Ts[i], w, dw, x, dy, yy, dx, yref, Ts[i] < tp ? Ts[i] : tp);
    }
    if (!rc) rc = bench_decode(o, s, w, x, yref, tp);
    free(w), free(dw), free(x), free(dy), free(dx), free(y[0]), free(y[1]), free(yref);
    return rc;
}

static void bench_moe_init(void *p) {
    bench_moe_cli *o = p;
    o->reps = 3, o->compute_mask = 3, o->shape = 3, o->ep = 1;
}

static const cli_opt bench_moe_table[] = {
    {CLI_FLAG("--json", bench_moe_cli, json, "one JSON object per row instead of text")},
    {CLI_FLAG("--quick", bench_moe_cli, quick, "E 256, 16 experts, top 4, I 64, shared 64, T 256 (unless --T), one repetition (unless --reps)")},
    {CLI_ENUM("--shape", bench_moe_cli, shape, "35b|next|both", CLI_VALUES(1, 2, 3), "35b: Qwen3.5-35B-A3B (E 2048, 256 experts, top 8, I 512, shared 512); next: Qwen3-Next (512 experts, top 10)")},
    {CLI_LIST("--T", bench_moe_cli, Ts, nT, "N[,N..]", "tokens, each in [1, 2^20]"), .dflt = "1024,2048,4096,8192"},
    {CLI_ENUM("--compute", bench_moe_cli, compute_mask, "fp32|bf16|both", CLI_VALUES(1, 2, 3), "the block's GEMMs' precision (both: alternating rep by rep)")},
    {CLI_I64("--threads", bench_moe_cli, threads, 1, 4096, "N", "OpenMP threads"), .dflt = "all"},
    {CLI_I64("--reps", bench_moe_cli, reps, 1, 50, "R", "timed repetitions after a warm-up (the median)")},
    {CLI_I64("--ep", bench_moe_cli, ep, 1, 1 << 20, "N", "under mpiexec -n N: the experts split over the N ranks, each with its own --T tokens, against the one-rank block on the same tokens (all-to-all time and bytes, the experts' GEMMs, imbalance; fp32)")},
};

const cli_command cmd_bench_moe_cli = {
    .name = "bench moe",
    .usage = "usage: gdncp bench moe [--json] [--quick] [--shape 35b|next|both] [--T N[,N..]]\n"
             "       [--compute fp32|bf16|both] [--threads N] [--reps R]\n"
             "       mpiexec -n N gdncp bench moe --ep N [--quick] [--shape 35b|next] [--T N[,N..]] [--threads N]\n",
    .summary = "the sparse MoE block: forward, forward + backward and decode, fp32 and BF16 compute",
    .about = "  the sparse MoE block: forward, forward+backward and decode (B = 1), fp32 and BF16 compute\n",
    .size = sizeof(bench_moe_cli), .init = bench_moe_init, CLI_OPTS(bench_moe_table),
};

static int bench_moe_with(const bench_moe_cli *c, const unsigned char *seen);

int cmd_bench_moe(int argc, char **argv) {
    bench_moe_cli c;
    unsigned char seen[CLI_MAX_OPTS];
    int rc = cli_parse(&cmd_bench_moe_cli, argc - 1, argv + 1, &c, seen);
    if (!rc) rc = bench_moe_with(&c, seen);
    cli_free(&cmd_bench_moe_cli, &c);
    return rc;
}

static int bench_moe_with(const bench_moe_cli *c, const unsigned char *seen) {
    bench_opts o = {.json = c->json, .quick = c->quick, .threads = c->threads, .reps = c->reps,
                    .compute_mask = c->compute_mask};
    const int want[2] = {c->shape & 1, (c->shape >> 1) & 1}, reps_set = cli_given(&cmd_bench_moe_cli, seen, "--reps");
    int64_t *Ts = c->Ts, nT = c->nT;
    for (int64_t k = 0; k < nT; k++)
        if (Ts[k] < 1 || Ts[k] > (1 << 20)) {
            fprintf(stderr, "gdncp bench moe: option --T needs values in [1, 2^20], got %lld\n", (long long)Ts[k]);
            return CLI_USAGE_ERROR;
        }
    if (c->ep > 1) return bench_moe_ep(c, reps_set);
    int64_t T_default[] = {1024, 2048, 4096, 8192}, T_quick = 256;
    if (!Ts) {
        if (o.quick) Ts = &T_quick, nT = 1;
        else Ts = T_default, nT = 4;
    }
    if (o.quick && !reps_set) o.reps = 1;
    if (!o.threads) o.threads = cli_max_threads();
    o.cpu = cli_cpu();
    if (!o.json) printf("gdncp bench moe — CPU: %s\n", o.cpu);
    o.peak = cli_peaks(o.threads, o.json, o.compute_mask & 2, " (0: the path has no instruction of its own)",
                       &o.bf16_peak);
    if (!o.json)
        printf("GEMM path: fp32 %s; bf16 %s\nmedians of %d after a warm-up, fp32 and bf16 alternating; GFLOP/s: "
               "2k*3*E*I + 2*3*E*Is + 2*E*n per token forward (x3 with the backward); %% of peak: the median over the "
               "runs of each run's ratio to the peaks measured again right before it; load: min/mean/max rows per "
               "expert (the forward's router statistics); err: y on the first rows vs the float64 reference "
               "block; decode: one token, against streaming the router, the k chosen experts and the shared "
               "expert once\n",
               gdn_compute_path(GDN_COMPUTE_FP32), gdn_compute_path(GDN_COMPUTE_BF16), o.reps);
    int rc = 0;
    if (o.quick) rc = bench_shape(&o, &shapes[2], Ts, nT);
    for (int k = 0; k < 2 && !rc && !o.quick; k++)
        if (want[k]) rc = bench_shape(&o, &shapes[k], Ts, nT);
    return rc;
}
