/* gdncp bench train: one training step of the language model (forward, backward, AdamW) on one
 * rank with all threads, for the named sizes, against the FLOP count the trainer reports
 * (6 x non-embedding parameters + the GatedDeltaNet kernel's forward and backward per token + the
 * attention layers' causal core, 7 d H (T + 1) per token). */
#include "cli/cli.h"
#include "commands.h"
#include "cli/parse.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gdncp/bench.h"
#include "gdncp/train.h"

/* forward + backward: the status of the first that fails */
static int train_step(gdn_model_plan *p, const float *w, float *dw, const gdn_token *tok, double denom,
                      double *loss) {
    int rc = gdn_model_forward(p, w, tok, denom, loss, 1);
    return rc ? rc : gdn_model_backward(p, w, dw, tok);
}

/* The gradient against Richardson-extrapolated central differences of the loss along one random
 * direction over every parameter (the whole model's oracle at this size): relative error. */
static double gradient_check(gdn_model_plan *p, const gdn_model_config *c, const float *w,
                             const float *dw, const gdn_token *tok, double denom) {
    const size_t nw = gdn_model_param_floats(c);
    float *wp = aligned_alloc(64, sizeof(float) * ((nw + 15) & ~(size_t)15));
    float *dir = malloc(sizeof(float) * nw);
    if (!wp || !dir) {
        free(wp), free(dir);
        return NAN;
    }
    uint64_t s = 12345;
    double an = 0;
    for (size_t i = 0; i < nw; i++) {
        /* relative to each weight's size: the 0.02-sized embeddings and the unit norms alike */
        dir[i] = (float)(((double)(cli_rng_next(&s) >> 11) * 0x1.0p-53 * 2 - 1) * (fabs(w[i]) + 0.01));
        an += (double)dir[i] * dw[i];
    }
    double d[2];
    for (int half = 0; half < 2; half++) {
        const double eps = half ? 5e-4 : 1e-3;
        double l[2];
        for (int sign = 0; sign < 2; sign++) {
            for (size_t i = 0; i < nw; i++) wp[i] = w[i] + (float)((sign ? -eps : eps) * dir[i]);
            if (gdn_model_forward(p, wp, tok, denom, &l[sign], 0)) l[sign] = NAN;
        }
        d[half] = (l[0] - l[1]) / denom / (2 * eps);
    }
    const double fd = (4 * d[1] - d[0]) / 3;
    free(wp), free(dir);
    return fabs(an - fd) / fmax(fabs(fd), 1e-12);
}

/* The peaks the rows are measured against: fp32 FMA, and the BF16 path's instruction (0: none). */
typedef struct {
    double fp32, bf16;
} peaks;

static int bench_one(const char *name, int64_t layers, int64_t B, int64_t T, int threads, int reps, peaks peak,
                     const char *cpu, int json) {
    gdn_model_config c;
    gdn_model_config_named(name, &c);
    if (layers > 0) { /* the named model's kinds over L layers (every MLP of a *-moe model MoE) */
        c.L = layers, gdn_model_set_attention_interval(&c, GDN_MODEL_NAMED_ATTN_INTERVAL);
        for (int64_t l = 0; l < GDN_MODEL_MAX_LAYERS; l++) c.moe[l] = c.n_experts > 0 && l < c.L;
    }
    /* at a real vocabulary a step takes tens of seconds: the dense fp32 and BF16 steps only */
    const int real = c.vocab > 65536;
    gdn_model_run run = {.B = B, .T = T, .threads = threads, .recompute = 0, .check_finite = 1};
    const size_t nw = gdn_model_param_floats(&c), bytes = sizeof(float) * ((nw + 15) & ~(size_t)15);
    float *w = gdn_model_alloc(bytes, 0), *dw = gdn_model_alloc(bytes, 0);
    float *m = gdn_model_alloc(bytes, 1), *v = gdn_model_alloc(bytes, 1);
    gdn_token *tok = malloc(sizeof *tok * (size_t)(B * (T + 1)));
    if (!w || !dw || !m || !v || !tok) {
        fprintf(stderr, "gdncp bench train: out of memory\n");
        return 1;
    }
    gdn_model_init(&c, w, 1);
    uint64_t s = 99;
    for (int64_t i = 0; i < B * (T + 1); i++) { /* lower-case letters and spaces, text-like */
        const uint64_t r = cli_rng_next(&s);
        tok[i] = (gdn_token)(r % 27 == 26 ? ' ' : 'a' + r % 27);
    }
    /* Packed rows: documents of 64-320 tokens (fortunes-like; mean 192) cut at random places. */
    int64_t *doc_cu = malloc(sizeof(int64_t) * (size_t)(B * (T + 3))), *n_docs = malloc(sizeof(int64_t) * (size_t)B);
    if (!doc_cu || !n_docs) {
        fprintf(stderr, "gdncp bench train: out of memory\n");
        return 1;
    }
    int64_t at = 0, docs_all = 0;
    for (int64_t b = 0; b < B; b++) {
        int64_t n = 0, pos = -(int64_t)(s % 192); /* the row starts inside a document */
        doc_cu[at] = 0;
        for (;;) {
            pos += 64 + (int64_t)(cli_rng_next(&s) % 257);
            if (pos >= T + 1) break;
            if (pos > 0) doc_cu[at + ++n] = pos;
        }
        doc_cu[at + ++n] = T + 1;
        n_docs[b] = n, at += n + 1, docs_all += n;
    }
    gdn_adamw_config opt = gdn_adamw_default();
    const double flops_tok = gdn_model_train_flops_per_token(&c, T);
    double dense_ms = NAN;
    for (int mode = 0; mode < 4; mode++) { /* dense, dense with recompute, packed, dense in BF16 */
        if (real && (mode == 1 || mode == 2)) continue;
        const int recompute = mode == 1, packed = mode == 2, bf16 = mode == 3;
        run.recompute = recompute, run.pack = packed, run.compute = bf16 ? GDN_COMPUTE_BF16 : GDN_COMPUTE_FP32;
        gdn_model_plan *p = NULL;
        int rc = gdn_model_plan_create(&p, &c, &run, NULL);
        int64_t targets = B * T;
        if (!rc && packed) rc = gdn_model_set_docs(p, doc_cu, n_docs, 0, &targets);
        const double denom = (double)targets;
        double t[16], loss = 0;
        /* the gradient check first, at the initial weights (the timed steps then update them) */
        /* (not for MoE models: along a direction through every parameter some token's top-k
         * changes within the differences' step, and the loss is only piecewise smooth; the MoE
         * gradients are tested against transformers and against the block's finite differences
         * with the routing held) */
        double err = NAN;
        const int moe = gdn_model_count_layers(&c, GDN_MODEL_MOE_LAYERS) > 0;
        if (!rc && mode != 1 && !bf16 && !(rc = train_step(p, w, dw, tok, denom, &loss)) && !moe && !real)
            err = gradient_check(p, &c, w, dw, tok, denom);
        double mix[4];
        for (int r = 0; r <= reps && !rc; r++) { /* r = 0 warms up */
            if (r == 1) gdn_model_mixer_seconds(p, mix, 1); /* the timed steps' share by layer type */
            const double t0 = cli_now();
            rc = train_step(p, w, dw, tok, denom, &loss);
            if (!rc) {
                double ss[2];
                gdn_grad_sumsq(&c, dw, ss);
                const double gn = sqrt(ss[0] + ss[1]);
                gdn_adamw_update(&opt, &c, w, dw, m, v, r + 1, 1e-4, gn > 1 ? 1 / gn : 1, threads);
            }
            if (r) t[r - 1] = cli_now() - t0;
        }
        if (rc) {
            fprintf(stderr, "gdncp bench train: %s: %s\n", name, gdn_errmsg());
            gdn_model_plan_destroy(p);
            return 1;
        }
        gdn_model_mixer_seconds(p, mix, 1);
        const double gdn_ms = 1e3 * (mix[0] + mix[1]) / reps, attn_ms = 1e3 * (mix[2] + mix[3]) / reps;
        /* every token is computed, predicted or not: throughput counts them all */
        const double med = cli_median(t, reps), tps = (double)(B * T) / med, gflops = tps * flops_tok / 1e9;
        if (mode == 0) dense_ms = 1e3 * med;
        const double mb = gdn_model_plan_bytes(p) / 1048576.0, rss = gdn_peak_rss_mb();
        /* a BF16 row against the BF16 instructions' peak too (its products run on them) */
        const double bfrac = bf16 && peak.bf16 > 0 ? gflops / peak.bf16 : NAN;
        char check[32] = "(same step)"; /* the text's: recompute changes no value, checked once */
        if (!isnan(err)) snprintf(check, sizeof check, "%.1e", err);
        char how[48];
        if (packed) snprintf(how, sizeof how, "packed %lld docs", (long long)docs_all);
        else if (bf16) snprintf(how, sizeof how, "compute=bf16");
        else snprintf(how, sizeof how, "recompute=%s", recompute ? "on" : "off");
        if (bf16) snprintf(check, sizeof check, "(fp32's)");
        if (moe && !bf16 && mode != 1) snprintf(check, sizeof check, "n/a (routing)");
        if (real && !bf16) snprintf(check, sizeof check, "not run (size)");
        /* JSON has no NaN: null where not measured */
        CLI_ROW(json, CLI_S("direction", "%s", "%s", "train_step"), CLI_S("model", "%s", " %-9s", name),
                CLI_I("layers", "%lld", " L=%lld", c.L),
                CLI_I("params", "%lld", " %8lld params", gdn_model_param_count(&c)), CLI_I("B", "%lld", " B=%lld", B),
                CLI_I("T", "%lld", " T=%lld", T), CLI_I("threads", "%lld", " thr=%lld", threads),
                CLI_I("recompute", "%lld", NULL, recompute), CLI_I("packed_docs", "%lld", NULL, packed ? docs_all : 0),
                CLI_S("compute", "%s", NULL, gdn_compute_name(run.compute)), CLI_S(NULL, NULL, " %-16s", how),
                CLI_F("ms", "%.3f", " %8.1f ms", 1e3 * med),
                CLI_F("ms_vs_dense", "%.4f", " (%.2fx dense;", 1e3 * med / dense_ms), CLI_I("reps", "%lld", NULL, reps),
                cli_at(CLI_F("tokens_per_s", "%.1f", " %8.0f tok/s", tps), 3),
                CLI_F("flops_per_token", "%.4g", NULL, flops_tok), CLI_F("gflops", "%.3f", " %7.1f GFLOP/s", gflops),
                CLI_F("peak_gflops", "%.3f", NULL, peak.fp32),
                cli_x(CLI_F("fraction_of_peak", "%.4f", " %5.1f %% of peak", gflops / peak.fp32), 100),
                cli_at(CLI_F("gdn_layers_ms", "%.3f", " GatedDeltaNet layers %.1f,", gdn_ms), 2),
                CLI_F("attn_layers_ms", "%.3f", " attention %.1f)", attn_ms),
                cli_at(CLI_F("plan_mb", "%.1f", "  plan %6.1f MB", mb), 4),
                CLI_F("peak_rss_mb", "%.1f", "  peak RSS %.0f MB", rss),
                CLI_F("bf16_peak_gflops", "%.3f", NULL, peak.bf16),
                cli_at(cli_x(CLI_N("fraction_of_bf16_peak", "%.4f", isnan(bfrac) ? NULL : " (%.1f %% of the BF16 peak)",
                                   bfrac), 100), 3),
                cli_at(CLI_N("grad_rel_err_vs_fd", "%.3e", NULL, err), 4), CLI_S(NULL, NULL, "  grad vs FD %s", check),
                CLI_S("gemm_path", "%s", NULL, gdn_compute_path(run.compute)), CLI_S("cpu", "%s", NULL, cpu));
        gdn_model_plan_destroy(p);
    }
    free(w), free(dw), free(m), free(v), free(tok), free(doc_cu), free(n_docs);
    return 0;
}

/* The names of --model: each a named model, separated by single commas. */
static int parse_models(const char *v, char names[][32], int max, int *n) {
    *n = 0;
    for (const char *p = v;;) {
        const char *e = strchr(p, ',');
        const size_t len = e ? (size_t)(e - p) : strlen(p);
        gdn_model_config c;
        if (*n == max || len == 0 || len >= 32) {
            fprintf(stderr, "gdncp bench train: --model needs at most %d named models separated by single commas, "
                            "got '%s'\n", max, v);
            return CLI_USAGE_ERROR;
        }
        memcpy(names[*n], p, len), names[*n][len] = 0;
        if (!gdn_model_config_named(names[*n], &c)) {
            fprintf(stderr, "gdncp bench train: --model %s: no such named model (tiny, small, long, tiny-moe, "
                            "small-moe, qwen3.5-0.8b, qwen3.5-2b)\n", names[*n]);
            return CLI_USAGE_ERROR;
        }
        ++*n;
        if (!e) return 0;
        p = e + 1;
    }
}

typedef struct {
    int json, quick;
    int64_t T, B, layers;
    const char *models;
} bench_train_opts;

static void bench_train_init(void *p) {
    bench_train_opts *o = p;
    o->T = 512, o->B = 8;
}

static const cli_opt bench_train_table[] = {
    {CLI_FLAG("--json", bench_train_opts, json, "one JSON object per row instead of text")},
    {CLI_FLAG("--quick", bench_train_opts, quick, "tiny and tiny-moe, 2 x 128, one repetition")},
    {CLI_I64("--T", bench_train_opts, T, 1, 1 << 22, "N", "tokens per sequence"), .dflt = "512 (--model: 2048)"},
    {CLI_I64("--B", bench_train_opts, B, 1, 4096, "N", "sequences per step"), .dflt = "8 (--model: 1)"},
    {CLI_STR("--model", bench_train_opts, models, "NAME[,NAME..]", "these named models instead (qwen3.5-0.8b, qwen3.5-2b: the real vocabulary, dense fp32 and BF16 only, 2 timed steps)"), .dflt = "tiny,tiny-moe,small,small-moe"},
    {CLI_I64("--layers", bench_train_opts, layers, 1, GDN_MODEL_MAX_LAYERS, "L", "the models' layers (every fourth full attention)"), .dflt = "the model's"},
};

const cli_command cmd_bench_train_cli = {
    .name = "bench train",
    .usage = "usage: gdncp bench train [--json] [--quick] [--T N] [--B N] [--model NAME[,NAME...]] [--layers L]\n",
    .summary = "one training step of the tiny and small models (and their MoE twins), against the measured peaks",
    .about = "  one training step (forward, backward, AdamW) of the named models tiny, tiny-moe, small and\n"
             "  small-moe (--quick: tiny and tiny-moe), dense, recomputed and packed, and the BF16 compute\n"
             "  path, against this machine's measured peaks\n",
    .size = sizeof(bench_train_opts), .init = bench_train_init, CLI_OPTS(bench_train_table),
};

int cmd_bench_train(int argc, char **argv) {
    bench_train_opts o;
    unsigned char seen[CLI_MAX_OPTS];
    if (cli_parse(&cmd_bench_train_cli, argc - 1, argv + 1, &o, seen)) return CLI_USAGE_ERROR;
    const int json = o.json, quick = o.quick;
    int n_models = 0;
    int64_t T = o.T, B = o.B, layers = o.layers;
    char models[8][32];
    const int given_T = cli_given(&cmd_bench_train_cli, seen, "--T"), given_B = cli_given(&cmd_bench_train_cli, seen, "--B");
    if (o.models && parse_models(o.models, models, 8, &n_models)) return CLI_USAGE_ERROR;
    const int given_models = n_models > 0;
    if (!given_models) { /* the named sizes */
        static const char *const names[] = {"tiny", "tiny-moe", "small", "small-moe"};
        for (int i = 0; i < (quick ? 2 : 4); i++) snprintf(models[n_models++], sizeof models[0], "%s", names[i]);
    }
    /* defaults: --quick 2 x 128; models given (the real shapes) one sequence of 2048 */
    if (!given_T) T = quick ? 128 : given_models ? 2048 : T;
    if (!given_B) B = quick ? 2 : given_models ? 1 : B;
    const int threads = cli_max_threads();
    const char *cpu = cli_cpu();
    peaks peak = {cli_peak_gflops(threads, json), 0};
    peak.bf16 = cli_bf16_peak(0, threads, json, NULL); /* the text: in the line below */
    if (!json)
        printf("gdncp bench train: one step (forward + backward + AdamW) on %s, %d threads; FLOPs = 6 x "
               "non-embedding parameters + the GatedDeltaNet kernel's forward and backward + the attention "
               "core's 7 d H (T + 1) per token; grad vs FD: Richardson central differences along a random "
               "direction; the last row: dense with BF16 compute on %s, as a ratio to the first (x dense); measured "
               "BF16 instruction peak %.1f GFLOP/s\n",
               cpu, threads, gdn_compute_path(GDN_COMPUTE_BF16), peak.bf16);
    /* the *-moe models: FLOPs on the active parameters (each token's top_k experts) */
    for (int i = 0; i < n_models; i++) {
        gdn_model_config c;
        gdn_model_config_named(models[i], &c);
        const int reps = quick ? 1 : c.vocab > 65536 ? 2 : 5;
        if (bench_one(models[i], layers, B, T, threads, reps, peak, cpu, json)) return 1;
    }
    return 0;
}
