/* gdncp bench kernel: this machine's measured fp32 FMA peak, then the chunked forward at the
 * Qwen3.5-35B layer shape and llama.cpp's CPU perf shapes, 1 thread and all threads.
 * FLOPs by DESIGN §3: F_fwd = 3CK + 2CV + 6KV + C^2/3 per token per value head, and the FLOPs
 * the micro-kernels really issue; fractions of the native-width FMA peak measured here. */
#include "cli/cli.h"
#include "commands.h"
#include "cli/parse.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* the inputs' generator, continued from shape to shape */
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

/* Norm-wise: ||x - ref||_2 / ||ref||_2. The BF16 path against its bf16-operand oracle: an fp32
 * intermediate now and then rounds to the other bf16 neighbour than its double, which moves one
 * element by up to a bf16 ulp of one term (max-abs ~1e-3 on a million outputs); norm-wise such
 * flips are diluted while a systematic error is not (the tests measure it so, tests/test_compute_bf16.c). */
static double rel_l2_err(const float *x, const double *ref, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) num += (x[i] - ref[i]) * (x[i] - ref[i]), den += ref[i] * ref[i];
    const double e = den > 0 ? sqrt(num / den) : sqrt(num);
    return e == e ? e : INFINITY;
}

/* Relative error of the fp32 backward's dv against the oracle's on the first tp tokens. */
static double oracle_error_backward(const gdn_config *cfg, int64_t tp, const float *q,
                                    const float *k, const float *v, const float *g,
                                    const float *beta, const float *dout) {
    gdn_config c = *cfg;
    c.T = tp;
    /* packed rows: the first document covers the first tp tokens (doc_len >= 256), dense there */
    c.cu_seqlens = NULL, c.n_docs = 0;
    const int64_t nqk = tp * c.Hk * c.K, nv = tp * c.Hv * c.V, ng = tp * c.Hv;
    double *buf = malloc(sizeof(double) * (4 * nqk + 3 * nv + 4 * ng));
    float *fq = malloc(sizeof(float) * (2 * nqk + nv + 2 * ng) + 64);
    if (!buf || !fq) {
        free(buf), free(fq);
        return NAN;
    }
    double *dq = buf, *dk = dq + nqk, *dv = dk + nqk, *dg = dv + nv, *db = dg + ng, *dd = db + ng;
    double *rq = dd + nv, *rk = rq + nqk, *rg = rk + nqk, *rb = rg + ng, *rdv = rb + ng;
    for (int64_t i = 0; i < nqk; i++) dq[i] = q[i], dk[i] = k[i];
    for (int64_t i = 0; i < nv; i++) dv[i] = v[i], dd[i] = dout[i];
    for (int64_t i = 0; i < ng; i++) dg[i] = g[i], db[i] = beta[i];
    double err = NAN;
    float *oq = fq, *ok = oq + nqk, *ov = ok + nqk, *og = ov + nv, *ob = og + ng;
    gdn_plan *plan = NULL;
    if (gdn_reference_backward(&c,
                               &(gdn_rule_grads_f64){.dq = rq, .dk = rk, .dv = rdv, .dg = rg, .dbeta = rb},
                               &(gdn_rule_inputs_f64){.q = dq, .k = dk, .v = dv, .g = dg, .beta = db}, dd,
                               NULL) == GDN_OK &&
        gdn_plan_create(&plan, &c) == GDN_OK &&
        gdn_backward(plan, &(gdn_rule_grads){.dq = oq, .dk = ok, .dv = ov, .dg = og, .dbeta = ob},
                     &(gdn_rule_inputs){.q = q, .k = k, .v = v, .g = g, .beta = beta}, dout,
                     NULL) == GDN_OK) {
        err = cli_rel_err(ov, rdv, nv);
    }
    gdn_plan_destroy(plan);
    free(buf), free(fq);
    return err;
}

/* The error of the first `tp` tokens (B == 1) vs the oracle of `compute`: FP32, the exact rule
 * (the accuracy a user gets, BF16 rows too), max-abs over max-abs reference; BF16, the same
 * chunked algorithm with bf16-rounded operands (what the BF16 path must reproduce), norm-wise. */
static double oracle_error(const gdn_config *cfg, int compute, int64_t tp, const float *q, const float *k,
                           const float *v, const float *g, const float *beta, const float *o) {
    gdn_config c = *cfg;
    c.T = tp;
    c.compute = compute;
    /* packed rows: the first document covers the first tp tokens (doc_len >= 256), dense there */
    c.cu_seqlens = NULL, c.n_docs = 0;
    const int64_t nqk = tp * c.Hk * c.K, nv = tp * c.Hv * c.V, ng = tp * c.Hv;
    double *buf = malloc(sizeof(double) * (2 * nqk + 2 * nv + 2 * ng));
    if (!buf) return NAN;
    double *dq = buf, *dk = dq + nqk, *dv = dk + nqk, *dg = dv + nv, *db = dg + ng, *od = db + ng;
    for (int64_t i = 0; i < nqk; i++) dq[i] = q[i], dk[i] = k[i];
    for (int64_t i = 0; i < nv; i++) dv[i] = v[i];
    for (int64_t i = 0; i < ng; i++) dg[i] = g[i], db[i] = beta[i];
    double err = NAN;
    if (gdn_reference_forward(&c, od, NULL,
                              &(gdn_rule_inputs_f64){.q = dq, .k = dk, .v = dv, .g = dg,
                                                     .beta = db}) == GDN_OK) {
        err = compute == GDN_COMPUTE_BF16 ? rel_l2_err(o, od, nv) : cli_rel_err(o, od, nv);
    }
    free(buf);
    return err;
}

typedef struct {
    const char *label;
    int64_t T, Hk, Hv, K, V;
    int chunk; /* 0: the library default (64) */
    int64_t doc_len; /* > 0: the T tokens packed as documents of this many (cu_seqlens); at least
                        256, the tokens the oracle checks inside the first document */
    int compute;     /* GDN_COMPUTE_BF16: the forward sweep's chunk products in bf16 (forward only:
                        the backward runs fp32 in either mode) */
} bench_shape;

static int bench_forward(const bench_shape *s, int threads, double peak, int json, int quick,
                         const char *cpu, int backward) {
    gdn_config cfg = gdn_config_default(1, s->T, s->Hk, s->Hv, s->K, s->V);
    cfg.threads = threads;
    cfg.compute = s->compute;
    if (s->chunk) cfg.chunk = s->chunk;
    /* Packed rows: the same tokens as documents of doc_len (the last one shorter), so a packed
     * row and the dense row above it compare throughput at equal total tokens. */
    const int64_t n_docs = s->doc_len > 0 ? (s->T + s->doc_len - 1) / s->doc_len : 1;
    int64_t *cu = s->doc_len > 0 ? malloc(sizeof(int64_t) * (n_docs + 1)) : NULL;
    for (int64_t d = 0; cu && d <= n_docs; d++) cu[d] = d * s->doc_len < s->T ? d * s->doc_len : s->T;
    if (cu) cfg.cu_seqlens = cu, cfg.n_docs = n_docs;
    const int64_t nqk = s->T * s->Hk * s->K, nv = s->T * s->Hv * s->V, ng = s->T * s->Hv;
    float *q = malloc(sizeof(float) * nqk), *k = malloc(sizeof(float) * nqk),
          *v = malloc(sizeof(float) * nv), *g = malloc(sizeof(float) * ng),
          *beta = malloc(sizeof(float) * ng), *o = malloc(sizeof(float) * nv),
          *ht = malloc(sizeof(float) * n_docs * s->Hv * s->K * s->V);
    /* The backward's gradient outputs (dq, dk share one buffer each way; dg, dbeta likewise). */
    float *dout = backward ? malloc(sizeof(float) * nv) : NULL, *gq = backward ? malloc(sizeof(float) * 2 * nqk) : NULL,
          *gv = backward ? malloc(sizeof(float) * nv) : NULL, *gg = backward ? malloc(sizeof(float) * 2 * ng) : NULL;
    gdn_plan *plan = NULL;
    int rc = !q || !k || !v || !g || !beta || !o || !ht || (backward && (!dout || !gq || !gv || !gg))
                 ? GDN_ERR_NOMEM : GDN_OK;
    if (!rc) {
        uint64_t *r = &rng_state;
        for (int64_t i = 0; i < nqk; i++) q[i] = cli_uniform(r, -0.5f, 0.5f), k[i] = cli_uniform(r, -0.5f, 0.5f);
        for (int64_t i = 0; i < nv; i++) v[i] = cli_uniform(r, -0.5f, 0.5f);
        for (int64_t i = 0; i < ng; i++) g[i] = cli_uniform(r, 0, -0.1f), beta[i] = cli_uniform(r, 0, 1);
        for (int64_t i = 0; backward && i < nv; i++) dout[i] = cli_uniform(r, -0.5f, 0.5f);
        rc = gdn_plan_create(&plan, &cfg);
    }
    /* BF16 rows: the same inputs through an fp32 plan, run alternately with the BF16 one rep by
     * rep (a shared machine's drift hits both sides), for the speed-up */
    gdn_plan *plan32 = NULL;
    float *o32 = NULL;
    if (!rc && s->compute == GDN_COMPUTE_BF16 && !backward) {
        gdn_config c32 = cfg;
        c32.compute = GDN_COMPUTE_FP32;
        o32 = malloc(sizeof(float) * nv);
        rc = o32 ? gdn_plan_create(&plan32, &c32) : GDN_ERR_NOMEM;
    }
    double times[64], times32[64];
    int reps = 0;
    const gdn_rule_inputs in = {.q = q, .k = k, .v = v, .g = g, .beta = beta};
    const gdn_rule_grads gr = {.dq = gq, .dk = gq ? gq + nqk : NULL, .dv = gv, .dg = gg, .dbeta = gg ? gg + ng : NULL};
    /* The backward of a training step: from the states the forward saved (a tenth of the
     * inputs at most), so it skips the initial sweep; the forward that saves them is not timed. */
    float *ckpt = NULL;
    if (!rc && backward) {
        ckpt = malloc(sizeof(float) * (cli_plan(plan).checkpoint_floats + 1));
        rc = ckpt ? gdn_forward_save(plan, o, ht, ckpt, &in) : GDN_ERR_NOMEM;
    }
    if (!rc) {
#define RUN_ONCE() (backward ? gdn_backward_saved(plan, &gr, &in, ckpt, dout, NULL) : gdn_forward(plan, o, ht, &in))
        rc = RUN_ONCE(); /* warm-up */
        if (!rc && plan32) rc = gdn_forward(plan32, o32, ht, &in);
        double budget = quick ? 0.3 : 1.5, start = cli_now();
        while (!rc && reps < 64 && (reps < 3 || cli_now() - start < budget)) {
            double t0 = cli_now();
            rc = RUN_ONCE();
            times[reps] = cli_now() - t0;
            if (!rc && plan32) {
                t0 = cli_now();
                rc = gdn_forward(plan32, o32, ht, &in);
                times32[reps] = cli_now() - t0;
            }
            reps++;
        }
#undef RUN_ONCE
    }
    if (rc) {
        free(q), free(k), free(v), free(g), free(beta), free(o), free(ht), free(dout), free(gq), free(gv), free(gg);
        free(ckpt), free(cu), free(o32);
        gdn_plan_destroy(plan), gdn_plan_destroy(plan32);
        return cli_error("bench", rc);
    }
    const double med = cli_median(times, reps), med32 = plan32 ? cli_median(times32, reps) : NAN;
    const gdn_config *pc = cli_plan(plan).config;
    const double head_tokens = (double)pc->B * pc->T * pc->Hv;
    const double gflops = cli_rule_flops(pc->K, pc->V, pc->chunk, head_tokens, backward ? 2 : 1) / med / 1e9;
    /* One more run counting what the micro-kernels really issue (triangles skipped). */
    gdn_flops_issued_start();
    rc = backward ? gdn_backward_saved(plan, &gr, &in, ckpt, dout, NULL) : gdn_forward(plan, o, ht, &in);
    const double issued_gflops = (double)gdn_flops_issued_stop() / med / 1e9;
    const double ht_per_s = (double)s->T * s->Hv / med;
    /* BF16 rows: the register-only peak of the path the products run, measured now */
    const int bpath = s->compute == GDN_COMPUTE_BF16 ? cli_bf16(0, 0).path : 0;
    const double bpeak = bpath ? cli_bf16(bpath, threads).peak_gflops : 0.0;
    const int64_t tp = s->T < 256 ? s->T : 256;
    const double err = backward ? oracle_error_backward(pc, tp, q, k, v, g, beta, dout)
                                : oracle_error(pc, GDN_COMPUTE_FP32, tp, q, k, v, g, beta, o);
    const double err_bf16 = bpath ? oracle_error(pc, GDN_COMPUTE_BF16, tp, q, k, v, g, beta, o) : NAN;
    /* Saved between forward and backward: the segment-start states; held while the backward
     * runs: its per-thread workspace. */
    const double saved_bytes = backward ? 4.0 * (double)cli_plan(plan).checkpoint_floats : 0.0;
    const double ws_bytes = (double)cli_plan(plan).backward_bytes * threads;
    const double input_bytes = 4.0 * (double)s->T * (2 * s->Hk * s->K + s->Hv * s->V + 2 * s->Hv);
    char shape[160];
    int len = snprintf(shape, sizeof shape, "B=1 T=%lld Hk=%lld Hv=%lld K=%lld V=%lld C=%d", (long long)s->T,
                       (long long)s->Hk, (long long)s->Hv, (long long)s->K, (long long)s->V, pc->chunk);
    if (cu) snprintf(shape + len, sizeof shape - (size_t)len, " docs=%lldx%lld", (long long)n_docs, (long long)s->doc_len);
    const int bf = bpath != 0, bt = bpath && bpeak > 0; /* a BF16 row (its text: when its path has a peak) */
    CLI_ROW(json, CLI_S("direction", "%s", "%-8s", backward ? "backward" : "forward"),
            CLI_S("case", "%s", " %-13s", s->label), CLI_S("shape", "%s", " %-58s", shape),
            CLI_I("threads", "%lld", " thr=%lld", threads), CLI_S("compute", "%s", NULL, bpath ? "bf16" : "fp32"),
            cli_x(CLI_F("seconds", "%.6e", "  %9.3f ms", med), 1e3), CLI_I("reps", "%lld", NULL, reps),
            CLI_F("head_tokens_per_s", "%.6e", NULL, ht_per_s),
            CLI_F("us_per_head_token", "%.4f", "  %6.3f us/head-tok", 1e6 / ht_per_s),
            CLI_F("gflops", "%.3f", "  %7.1f GFLOP/s", gflops),
            cli_at(CLI_F("peak_gflops", "%.3f", " of %6.1f", peak), 3),
            cli_at(cli_x(CLI_F("fraction_of_peak", "%.4f", "  %5.1f%%", gflops / peak), 100), 2),
            cli_at(CLI_F("issued_gflops", "%.3f", NULL, issued_gflops), 3),
            cli_x(CLI_F("fraction_of_peak_issued", "%.4f", " (issued %5.1f%%)", issued_gflops / peak), 100),
            CLI_F("rel_err_vs_oracle", "%.3e", "  err %.1e", err), CLI_S("path", "%s", "  %s", cli_plan(plan).path),
            CLI_S("cpu", "%s", NULL, cpu),
            cli_if(bf, CLI_F("bf16_peak_gflops", "%.3f", bt ? "  bf16 peak %.0f GFLOP/s" : NULL, bpeak)),
            cli_if(bf, cli_x(CLI_F("fraction_of_bf16_peak", "%.4f", bt ? ": %.1f%%" : NULL,
                                   bpeak > 0 ? gflops / bpeak : 0.0), 100)),
            cli_if(bf, CLI_F("l2_err_vs_bf16_oracle", "%.3e", bt ? "  l2 err vs bf16 oracle %.1e" : NULL, err_bf16)),
            cli_if(bf, cli_at(cli_x(CLI_F("fp32_seconds_alternated", "%.6e", bt ? " (%.3f ms, alternated)" : NULL, med32),
                                    1e3), 5)),
            cli_if(bf, cli_at(CLI_F("speedup_vs_fp32", "%.3f", bt ? "  %.2fx fp32" : NULL, med32 / med), 4)),
            cli_if(backward, CLI_F("saved_bytes_per_token", "%.1f", "  mem: saved %.0f B/tok", saved_bytes / s->T)),
            cli_if(backward, CLI_F("workspace_bytes", "%.0f", NULL, ws_bytes)),
            cli_if(backward, CLI_F("workspace_bytes_per_token", "%.1f", " + workspace %.0f B/tok", ws_bytes / s->T)),
            cli_if(backward, CLI_F(NULL, NULL, " = %.1f%% of inputs", 100 * (saved_bytes + ws_bytes) / input_bytes)),
            cli_if(backward, CLI_F("input_bytes_per_token", "%.1f", " (%.0f B/tok)", input_bytes / s->T)),
            cli_if(backward, CLI_R("from_saved_states", NULL, "true")));
    fflush(stdout);
    free(q), free(k), free(v), free(g), free(beta), free(o), free(ht), free(dout), free(gq), free(gv), free(gg);
    free(ckpt), free(cu), free(o32);
    gdn_plan_destroy(plan), gdn_plan_destroy(plan32);
    return 0;
}

/* --case: want[i] set for each shape whose label the comma-separated list names; every name
 * must be a case (a typo must not silently run nothing). */
static int select_cases(const char *list, const bench_shape *shapes, int n, int *want) {
    char buf[256];
    snprintf(buf, sizeof buf, "%s", list);
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        int found = 0;
        for (int i = 0; i < n; i++)
            if (!strcmp(tok, shapes[i].label)) want[i] = found = 1;
        if (!found) {
            fprintf(stderr, "gdncp bench kernel: unknown --case '%s' (cases:", tok);
            for (int i = 0; i < n; i++) {
                int seen = 0;
                for (int j = 0; j < i; j++) seen |= !strcmp(shapes[i].label, shapes[j].label);
                if (!seen) fprintf(stderr, " %s", shapes[i].label);
            }
            fprintf(stderr, ")\n");
            return 0;
        }
    }
    return 1;
}

typedef struct {
    const char *what; /* the bench's name: kernel */
    int json, quick;
    const char *cases;
} kernel_opts;

static const cli_opt kernel_table[] = {
    {CLI_FLAG("--json", kernel_opts, json, "one JSON object per row instead of text")},
    {CLI_FLAG("--quick", kernel_opts, quick, "toy sizes (T at most 1024; the tests' smoke runs)")},
    {CLI_STR("--case", kernel_opts, cases, "NAME[,NAME..]", "run only these cases (qwen35b, qwen35b-pk512, qwen35b-bf16, llama64, llama256, llama512, llama1024)"), .dflt = "all"},
};

const cli_command cmd_bench_cli = {
    .name = "bench kernel",
    .usage = "usage: gdncp bench kernel [--json] [--quick] [--case NAME[,NAME..]]   the chunked gated delta rule\n"
             "       gdncp bench layer|attention|train|decode|matmul|moe ...\n"
             "       mpiexec -n D gdncp bench cp|attention-cp ...\n",
    .summary = "the chunked kernel, forward and backward, at the Qwen3.5-35B and llama.cpp shapes, against the measured peak",
    .about = "  gdncp bench SUB --help for each one's options\n",
    .size = sizeof(kernel_opts), CLI_OPTS(kernel_table),
    .max_pos = 1, .pos_off = offsetof(kernel_opts, what),
};

int cmd_bench(int argc, char **argv) {
    kernel_opts o;
    if (cli_parse(&cmd_bench_cli, argc, argv, &o, NULL)) return CLI_USAGE_ERROR;
    const int json = o.json, quick = o.quick;
    const char *cases = o.cases;
    if (!o.what || strcmp(o.what, "kernel")) {
        fputs(cmd_bench_cli.usage, stderr);
        return CLI_USAGE_ERROR;
    }
    /* The 35B layer again with chunk 32: the same math, less work in the C-sized products
     * (DESIGN §3's FLOPs shrink with C), smaller GEMMs; which is faster depends on the machine. */
    /* qwen35b-pk512: the first row's tokens packed as documents of 512 (cu_seqlens): the
     * packed path's cost against the dense one at equal total tokens (issue 11: within 10 %). */
    const bench_shape shapes[] = {
        {"qwen35b", 8192, 16, 32, 128, 128, 0, 0, 0}, {"qwen35b-pk512", 8192, 16, 32, 128, 128, 0, 512, 0},
        {"qwen35b", 8192, 16, 32, 128, 128, 32, 0, 0},
        /* BF16 compute (issue 20's target: forward >= 2x the fp32 row at C = 64) */
        {"qwen35b-bf16", 8192, 16, 32, 128, 128, 0, 0, GDN_COMPUTE_BF16},
        {"llama64", 64, 32, 32, 128, 128, 0, 0, 0}, {"llama256", 256, 32, 32, 128, 128, 0, 0, 0},
        {"llama512", 512, 32, 32, 128, 128, 0, 0, 0}, {"llama1024", 1024, 32, 32, 128, 128, 0, 0, 0}};
    const int n = sizeof shapes / sizeof shapes[0];
    int want[sizeof shapes / sizeof shapes[0]];
    for (int i = 0; i < n; i++) want[i] = !cases;
    if (cases && !select_cases(cases, shapes, n, want)) return 1;
    const int maxt = cli_max_threads();
    const char *cpu = cli_cpu();
    const int thread_counts[2] = {1, maxt};
    const int nthr = maxt > 1 ? 2 : 1;
    if (!json) printf("gdncp bench kernel — CPU: %s\n", cpu);
    double peak[2];
    for (int i = 0; i < nthr; i++) peak[i] = cli_peak_gflops(thread_counts[i], json);
    if (!json)
        printf("GFLOP/s count DESIGN §3 FLOPs per head-token: forward 3CK+2CV+6KV+C^2/3, backward "
               "18CK+10CV+16KV+4C^2; 'issued': the FLOPs the GEMM micro-kernels really issue (zero "
               "triangles skipped, elementwise work not counted); err = max|x-oracle|/max|oracle| (o, "
               "resp. dv) over the first 256 tokens; bf16 rows: l2 err = ||x-oracle||/||oracle|| vs the oracle with the "
               "same operands rounded, and the speed-up over an fp32 plan run alternately on the same inputs\n");
    for (int si = 0; si < n; si++) {
        bench_shape s = shapes[si];
        if (!want[si]) continue;
        if (quick && s.T > 1024) s.T = 1024; /* CI smoke: same heads and dims, fewer tokens */
        for (int dir = 0; dir < 2 - (s.compute == GDN_COMPUTE_BF16); dir++)
            for (int i = 0; i < nthr; i++)
                if (bench_forward(&s, thread_counts[i], peak[i], json, quick, cpu, dir)) return 1;
    }
    return 0;
}
