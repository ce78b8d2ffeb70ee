/* gdncp bench decode: the decode step gdn_step (T = 1, state in place) at the Qwen3.5 head shape
 * (Hv = 32, Hk = 16, K = V = 128), B = 1 and 8, 1 and 2 threads, against the memory-bandwidth
 * bound of its traffic and against the chunked gdn_forward with T = 1 (the old decode path).
 *
 * Bytes per step: the state read and written once (2 B Hv K V 4) plus the token's rows (q, k, v,
 * g, beta read, o written). The bound is those bytes at the bandwidth of a stream measured in the
 * same run, over a buffer of the state's size, with the same threads splitting it the same way:
 *   - memcpy: src and dst distinct buffers of the state's size (read one, write the other);
 *   - rmw:    x[i] = x[i] * a + b in place over one buffer of the state's size — the same access
 *             pattern as the step's update, the fair bound, used for fraction_of_bound.
 * At these sizes the state (B = 1: 2 MB, B = 8: 16 MB) can sit in L2/L3 rather than DRAM, so the
 * bound must use the same buffer size and access pattern: a DRAM-sized stream would understate
 * the bound and flatter the fraction. Streams and steps are timed in interleaved rounds (the
 * machine may be shared): each per-call time is the median over rounds, and fraction_of_bound the
 * median over rounds of that round's ratio (the load of a shared machine drifts between rounds). */
#include "cli/cli.h"
#include "commands.h"
#include "cli/parse.h"
#include "gdncp/bench.h"
#include "gdncp/layer.h"
#include "gdncp/train.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* the inputs' generator: continued from row to row, restarted for each row's tokens */
static uint64_t rng_state = 0x2545F4914F6CDD1Dull;

typedef float v16 __attribute__((vector_size(64)));
typedef float v16_u __attribute__((vector_size(64), aligned(4)));

/* The thread's contiguous share [lo, hi) of n floats (multiples of 16). */
static void share(size_t n, int t, int nt, size_t *lo, size_t *hi) {
    size_t per = (n / 16 + nt - 1) / nt * 16;
    *lo = per * t < n ? per * t : n;
    *hi = per * (t + 1) < n ? per * (t + 1) : n;
}

/* One pass over x [n] with `threads` threads, each over its share: x = src (a copy) or, src NULL,
 * x = x * a + b in place. */
static void stream(float *x, const float *src, size_t n, int threads) {
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int t = 0, nt = 1;
#ifdef _OPENMP
        t = omp_get_thread_num(), nt = omp_get_num_threads();
#endif
        size_t lo, hi;
        share(n, t, nt, &lo, &hi);
        if (src)
            memcpy(x + lo, src + lo, sizeof(float) * (hi - lo));
        else
            for (size_t i = lo; i < hi; i += 16) {
                v16 y = *(v16_u *)(x + i);
                *(v16_u *)(x + i) = y * 0.999f + 0.001f; /* converges to 1: no drift to Inf/denormals */
            }
    }
}

#define NTOK 16 /* distinct tokens cycled: random keys keep every state direction refreshed (one
                   token repeated would decay the rest of the state into denormals) */

typedef struct {
    double step_us, fwd_us, copy_gbs, rmw_gbs;
    double frac; /* median over rounds of that round's step bandwidth / in-place stream bandwidth */
} decode_times;

static int bench_row(int64_t B, int threads, int quick, decode_times *out, double *bytes_out,
                     char *path, size_t npath) {
    const int64_t Hk = 16, Hv = 32, K = 128, V = 128;
    gdn_config cfg = gdn_config_default(B, 1, Hk, Hv, K, V);
    cfg.threads = threads;
    gdn_plan *plan = NULL;
    int rc = gdn_plan_create(&plan, &cfg);
    if (rc) return cli_error("bench decode", rc);
    const size_t ns = (size_t)(B * Hv * K * V), nqk = (size_t)(B * Hk * K), nv = (size_t)(B * Hv * V),
                 ng = (size_t)(B * Hv);
    float *state = aligned_alloc(64, sizeof(float) * ns), *h1 = aligned_alloc(64, sizeof(float) * ns);
    float *h2 = aligned_alloc(64, sizeof(float) * ns), *buf = aligned_alloc(64, sizeof(float) * ns);
    float *q = malloc(sizeof(float) * nqk * NTOK), *k = malloc(sizeof(float) * nqk * NTOK);
    float *v = malloc(sizeof(float) * nv * NTOK), *g = malloc(sizeof(float) * ng * NTOK);
    float *beta = malloc(sizeof(float) * ng * NTOK), *o = malloc(sizeof(float) * nv);
    if (!state || !h1 || !h2 || !buf || !q || !k || !v || !g || !beta || !o) {
        fprintf(stderr, "gdncp bench decode: out of memory\n");
        return 1;
    }
    uint64_t *r = &rng_state;
    for (size_t i = 0; i < ns; i++) state[i] = h1[i] = cli_uniform(r, -1, 1), h2[i] = 0, buf[i] = 1;
    for (size_t i = 0; i < nqk * NTOK; i++) q[i] = cli_uniform(r, -1, 1), k[i] = cli_uniform(r, -1, 1);
    for (size_t i = 0; i < nv * NTOK; i++) v[i] = cli_uniform(r, -1, 1);
    for (size_t i = 0; i < ng * NTOK; i++) g[i] = cli_uniform(r, -0.3f, 0.0f), beta[i] = cli_uniform(r, 0, 1);
    /* Rounds of `calls` calls of each, ~10 ms per kind per round: many short rounds, so that
     * a neighbour's burst spoils a few rounds rather than the median. */
    const int rounds = quick ? 7 : 21;
    const int calls = B == 1 ? (quick ? 30 : 100) : (quick ? 4 : 12);
    const int fcalls = calls >= 16 ? calls / 8 : 2; /* the forward is 10-20x slower */
    double *ts = malloc(sizeof(double) * rounds * 5), *tf = ts + rounds, *tc = tf + rounds,
           *tr = tc + rounds, *fr = tr + rounds;
    int64_t tok = 0;
    float *hin = h1, *hout = h2;
    for (int r = -1; r < rounds && !rc; r++) { /* round -1: warm-up, not timed */
        double t0 = cli_now();
        for (int c = 0; c < calls && !rc; c++, tok = (tok + 1) % NTOK)
            rc = gdn_step(plan, o, state,
                          &(gdn_rule_inputs){.q = q + tok * nqk, .k = k + tok * nqk, .v = v + tok * nv,
                                             .g = g + tok * ng, .beta = beta + tok * ng});
        double t1 = cli_now();
        for (int c = 0; c < fcalls && !rc; c++, tok = (tok + 1) % NTOK) {
            rc = gdn_forward(plan, o, hout,
                             &(gdn_rule_inputs){.q = q + tok * nqk, .k = k + tok * nqk, .v = v + tok * nv,
                                                .g = g + tok * ng, .beta = beta + tok * ng, .h0 = hin});
            float *sw = hin;
            hin = hout, hout = sw;
        }
        double t2 = cli_now();
        for (int c = 0; c < calls; c++) stream(h2, buf, ns, threads);
        double t3 = cli_now();
        for (int c = 0; c < calls; c++) stream(buf, NULL, ns, threads);
        double t4 = cli_now();
        if (r >= 0)
            ts[r] = (t1 - t0) / calls, tf[r] = (t2 - t1) / fcalls, tc[r] = (t3 - t2) / calls,
            tr[r] = (t4 - t3) / calls, fr[r] = tr[r] / ts[r];
    }
    if (rc) {
        cli_error("bench decode", rc);
    } else {
        const double sbytes = 2.0 * sizeof(float) * ns;
        out->step_us = 1e6 * cli_median(ts, rounds), out->fwd_us = 1e6 * cli_median(tf, rounds);
        out->copy_gbs = sbytes / cli_median(tc, rounds) / 1e9;
        out->rmw_gbs = sbytes / cli_median(tr, rounds) / 1e9;
        *bytes_out = sbytes + sizeof(float) * (2.0 * nqk + 2.0 * nv + 2.0 * ng);
        /* bytes over the stream's bytes: the token rows count as traffic of the step */
        out->frac = *bytes_out / sbytes * cli_median(fr, rounds);
        snprintf(path, npath, "%s", gdn_step_path());
    }
    free(ts);
    free(state), free(h1), free(h2), free(buf), free(q), free(k), free(v), free(g), free(beta), free(o);
    gdn_plan_destroy(plan);
    return rc ? 1 : 0;
}

/* A read stream bigger than the last-level cache (bytes): its weights come from DRAM. */
enum { BIG_BYTES = 256 << 20 };

/* The whole model generating at B = 1 (gdn_model_decode after a prefill of P tokens), random
 * weights w: per token it reads every weight once (the embedding's one row, unless tied to the
 * head), every attention layer's KV cache at its current length, and reads and writes every
 * GatedDeltaNet layer's conv and recurrent states. The bound is those bytes at the read stream
 * measured in the same run over a buffer of that size (cli_stream_seconds); streams and runs of
 * steps alternate (below), medians. A model of more than BIG_BYTES streams from DRAM whatever
 * runs between its steps: its bound is the stream over a BIG_BYTES buffer scaled to its bytes,
 * measured before every run of steps. cache_dtype 0 F32, 2 BF16. */
/* The tokens a row feeds: a prompt of P random ids (the same every row), then id s % vocab at
 * step s. */
static void row_tokens(const gdn_model_config *c, int64_t P, int steps, gdn_token *tok) {
    rng_state = 0x2545F4914F6CDD1Dull;
    for (int64_t t = 0; t < P; t++) tok[t] = (gdn_token)(cli_uniform(&rng_state, 0, 1) * (float)(c->vocab - 1));
    for (int s = 0; s < steps; s++) tok[P + s] = (gdn_token)(s % c->vocab);
}

/* ref: the forward's logits at the last position the row feeds (its error is printed). */
static int model_row(const char *name, const gdn_model_config *cp, const float *w, int64_t P, int steps,
                     const float *ref, int threads, int cache_dtype, int json, const char *cpu) {
    const gdn_model_config c = *cp;
    float *logits = malloc(sizeof(float) * (size_t)c.vocab * (size_t)P); /* [P, vocab] */
    gdn_token *prompt = malloc(sizeof(gdn_token) * (size_t)(P + steps));
    gdn_model_decoder *dec = NULL;
    int rc = logits && prompt ? GDN_OK : GDN_ERR_NOMEM;
    if (!rc) {
        row_tokens(&c, P, steps, prompt);
        rc = gdn_model_decoder_create(&dec, &c, 1, P + steps + 1, threads, cache_dtype);
    }
    if (!rc) rc = gdn_model_prefill(dec, w, prompt, P, logits);
    const int64_t na = gdn_model_count_layers(&c, GDN_MODEL_ATTN_LAYERS), ng = c.L - na;
    gdn_layer_config lc = gdn_model_layer_config(&c, 1, 1);
    const double esz = cache_dtype ? 2.0 : 4.0;
    const double wbytes = 4.0 * ((double)gdn_model_param_count(&c) - (c.tie_embeddings ? 0.0 : (double)(c.vocab - 1) * c.E));
    const double sbytes = 2.0 * 4.0 * (double)ng * ((double)c.Hv * c.K * c.V + (double)gdn_layer_conv_dim(&lc) * c.Kc);
    /* the KV caches' bytes a token reads when len positions are cached (its own included) */
    const double kv_per_pos = 2.0 * esz * (double)na * (double)c.Hkv * (double)c.d;
    const int big = wbytes > (double)BIG_BYTES;
    /* Blocks of RUN steps back to back, as generation runs them, each after one stream
     * measurement; a block's first step, which finds its bytes evicted by that stream, is not
     * timed (the bound's stream is itself the best of warm passes over its buffer). */
    enum { RUN = 4 };
    double t[64], b[64];
    int nt = 0, nb = 0;
    for (int s = 0; s < steps && !rc; s++) {
        const gdn_token tok = prompt[P + s];
        const double kv = kv_per_pos * (double)(P + s + 1);
        const double bytes = wbytes + sbytes + kv;
        if (s % RUN == 0)
            b[nb++] = big ? cli_stream_seconds(BIG_BYTES, 0, threads) * bytes / BIG_BYTES
                          : cli_stream_seconds((size_t)bytes, 0, threads);
        const double t0 = cli_now();
        rc = gdn_model_decode(dec, w, &tok, logits);
        if (s % RUN) t[nt++] = cli_now() - t0;
    }
    if (rc) {
        fprintf(stderr, "gdncp bench decode: model %s: %s\n", name, gdn_errmsg());
    } else {
        const double step = cli_median(t, nt), bound = cli_median(b, nb);
        const double kv = kv_per_pos * (double)(P + steps / 2); /* the median step's */
        const double err = cli_rel_err_f32(logits, ref, c.vocab); /* the last step's logits */
        CLI_ROW(json, CLI_S("direction", "%s", NULL, "model_decode"), CLI_S("model", "%s", "model %-6s", name),
                CLI_I("B", "%lld", " B=%lld", 1), CLI_I("prompt", "%lld", " prompt %-5lld", P),
                CLI_S("cache_dtype", "%s", " cache %-4s", cache_dtype ? "bf16" : "f32"),
                CLI_I("threads", "%lld", " thr=%lld", threads),
                CLI_F("us_per_token", "%.2f", " %9.1f us/token", step * 1e6),
                CLI_F("tokens_per_s", "%.1f", " %8.0f tokens/s", 1 / step),
                cli_x(CLI_F("bytes_per_token", "%.0f", "  reads %.1f MB", wbytes + sbytes + kv), 1e-6),
                CLI_F(NULL, NULL, " (weights %.1f,", wbytes / 1e6), CLI_F(NULL, NULL, " states %.1f,", sbytes / 1e6),
                CLI_F(NULL, NULL, " KV %.1f)", kv / 1e6), CLI_F("bound_us", "%.2f", "  bound %8.1f us", bound * 1e6),
                cli_x(CLI_F("fraction_of_bound", "%.4f", "  %6.1f %% of bound", bound / step), 100),
                CLI_F(NULL, NULL, " (%.2fx)", step / bound),
                CLI_F("rel_err_vs_forward", "%.3e", "  err vs forward %.1e", err), CLI_S("cpu", "%s", NULL, cpu));
    }
    gdn_model_decoder_destroy(dec);
    free(logits), free(prompt);
    return rc ? 1 : 0;
}

/* The decode rows of one model: 1 and 2 threads, F32 and BF16 caches, on one set of weights:
 * those of the checkpoint directory ckpt, else random ones. */
static int model_rows(const char *name, const gdn_model_config *c, const char *ckpt, int64_t P, int quick, int json,
                      const char *cpu) {
    const size_t nw = gdn_model_param_floats(c);
    float *w = malloc(sizeof(float) * nw);
    if (!w) {
        fprintf(stderr, "gdncp bench decode: model %s: out of memory for %.1f GB of weights\n", name, 4e-9 * (double)nw);
        return 1;
    }
    if (ckpt) {
        if (gdn_ckpt_load(ckpt, c, w, NULL, NULL, NULL)) {
            fprintf(stderr, "gdncp bench decode: %s\n", gdn_errmsg());
            free(w);
            return 1;
        }
    } else if (nw * sizeof(float) > (size_t)BIG_BYTES) {
        /* U(-0.035, 0.035) (the std of Qwen's N(0, 0.02)), in parallel: gdn_model_init's sequential
         * normal draws take ~25 s for 0.75 G parameters, and a decode step's work does not depend on
         * the values */
        cli_fill_uniform_sym(w, nw, 0.035f, 0);
    } else {
        gdn_model_init(c, w, 7);
    }
    /* the reference: the training forward's logits over the same tokens, at the last position */
    const int steps = quick ? 8 : 48;
    const int64_t T = P + steps;
    gdn_token *tok = malloc(sizeof(gdn_token) * (size_t)T);
    float *all = malloc(sizeof(float) * (size_t)T * (size_t)c->vocab);
    const gdn_model_run r = {.B = 1, .T = T, .threads = 0};
    gdn_model_plan *plan = NULL;
    int rc = tok && all ? GDN_OK : GDN_ERR_NOMEM;
    if (!rc) row_tokens(c, P, steps, tok), rc = gdn_model_plan_create(&plan, c, &r, NULL);
    if (!rc) rc = gdn_model_logits(plan, w, tok, all);
    gdn_model_plan_destroy(plan);
    if (rc) fprintf(stderr, "gdncp bench decode: model %s: the forward reference: %s\n", name, gdn_errmsg());
    const float *ref = all ? all + (size_t)(T - 1) * (size_t)c->vocab : NULL;
    for (int threads = 1; threads <= 2 && !rc; threads++)
        for (int dt = 0; dt <= 2 && !rc; dt += 2) rc = model_row(name, c, w, P, steps, ref, threads, dt, json, cpu);
    free(w), free(tok), free(all);
    return rc ? 1 : 0;
}

/* A prefill of P tokens forming only the last logits (gdn_model_prefill_last, what generation
 * runs), 2 threads, fp32: the median of 3 after a warm-up, against the measured fp32 peak on the
 * forward FLOPs it needs (gdn_model_prefill_flops); the error of its logits against the
 * training forward's at the last position (ref). */
static int prefill_row(const char *name, const gdn_model_config *c, const float *w, int64_t P, const float *ref,
                       int compute, double peak, int json, const char *cpu) {
    const int threads = 2;
    gdn_token *tok = malloc(sizeof(gdn_token) * (size_t)P);
    float *logits = malloc(sizeof(float) * (size_t)c->vocab);
    gdn_model_decoder *dec = NULL;
    int rc = tok && logits ? GDN_OK : GDN_ERR_NOMEM;
    if (!rc) row_tokens(c, P, 0, tok), rc = gdn_model_decoder_create(&dec, c, 1, P, threads, GDN_F32);
    if (!rc) rc = gdn_model_decoder_set_compute(dec, compute);
    double t[4];
    for (int r = 0; r < 4 && !rc; r++) { /* r = 0 warms up (the piece's plans, first touch) */
        gdn_model_decoder_reset(dec);
        const double t0 = cli_now();
        rc = gdn_model_prefill_last(dec, w, tok, P, logits);
        if (r) t[r - 1] = cli_now() - t0;
    }
    if (rc) {
        fprintf(stderr, "gdncp bench decode: prefill %s: %s\n", name, gdn_errmsg());
    } else {
        const double s = cli_median(t, 3), gf = gdn_model_prefill_flops(c, P, 1) / s / 1e9;
        const double err = ref ? cli_rel_err_f32(logits, ref, c->vocab) : NAN;
        CLI_ROW(json, CLI_S("direction", "%s", NULL, "model_prefill"), CLI_S("model", "%s", "prefill %-14s", name),
                CLI_I("layers", "%lld", " L=%-2lld", c->L), CLI_I("B", "%lld", " B=%lld", 1),
                CLI_I("prompt", "%lld", " prompt %-5lld", P), CLI_I("threads", "%lld", " thr=%lld", threads),
                CLI_S("compute", "%s", " %-4s", gdn_compute_name(compute)), CLI_F("ms", "%.2f", " %9.1f ms", 1e3 * s),
                CLI_F("tokens_per_s", "%.1f", " %8.0f tokens/s", (double)P / s),
                CLI_F("gflops", "%.2f", " %7.1f GFLOP/s", gf), CLI_F("peak_gflops", "%.2f", NULL, peak),
                cli_x(CLI_F("fraction_of_peak", "%.4f", " %5.1f %% of the", gf / peak), 100),
                CLI_S(NULL, NULL, " %s peak  last logits only", compute == GDN_COMPUTE_BF16 ? "BF16" : "fp32"),
                CLI_F("rel_err_vs_forward", "%.3e", "  err vs forward %.1e", err),
                CLI_S("gemm_path", "%s", NULL, gdn_compute_path(compute)), CLI_S("cpu", "%s", NULL, cpu));
    }
    gdn_model_decoder_destroy(dec);
    free(tok), free(logits);
    return rc ? 1 : 0;
}

/* The prefill row of one model on random weights: the reference the training forward's logits
 * at the prompt's last position. */
static int prefill_rows(const char *name, const gdn_model_config *c, int64_t P, const double peak[2], int json,
                        const char *cpu) {
    const size_t nw = gdn_model_param_floats(c);
    float *w = malloc(sizeof(float) * nw), *all = malloc(sizeof(float) * (size_t)P * (size_t)c->vocab);
    gdn_token *tok = malloc(sizeof(gdn_token) * (size_t)P);
    const gdn_model_run r = {.B = 1, .T = P, .threads = 0};
    gdn_model_plan *plan = NULL;
    int rc = w && all && tok ? GDN_OK : GDN_ERR_NOMEM;
    if (!rc) {
        cli_fill_uniform_sym(w, nw, 0.035f, 0); /* as model_rows does for a large model */
        row_tokens(c, P, 0, tok);
        rc = gdn_model_plan_create(&plan, c, &r, NULL);
    }
    if (!rc) rc = gdn_model_logits(plan, w, tok, all);
    gdn_model_plan_destroy(plan);
    if (rc) fprintf(stderr, "gdncp bench decode: prefill %s: the forward reference: %s\n", name, gdn_errmsg());
    /* fp32, then BF16 compute where a BF16 path runs (its fraction of the BF16 instructions' peak) */
    for (int k = 0; k < (peak[1] > 0 ? 2 : 1) && !rc; k++)
        rc = prefill_row(name, c, w, P, all + (size_t)(P - 1) * (size_t)c->vocab, k ? GDN_COMPUTE_BF16 : GDN_COMPUTE_FP32,
                         peak[k], json, cpu);
    free(w), free(all), free(tok);
    return rc ? 1 : 0;
}

/* --ckpt DIR: the rows of that checkpoint's model on its own weights (a prefill of 1,024 tokens,
 * fewer if its max_position_embeddings says so), instead of the step's and the named models'. */
static int checkpoint_rows(const char *ckpt, int quick, int json, const char *cpu) {
    char dir[4096];
    gdn_model_config c;
    if (gdn_ckpt_resolve(ckpt, dir, sizeof dir) || gdn_ckpt_load_config(dir, &c)) {
        fprintf(stderr, "gdncp bench decode: %s\n", gdn_errmsg());
        return 1;
    }
    int64_t P = quick ? 64 : 1024;
    const int64_t room = c.max_position - 64; /* the steps after the prompt */
    if (c.max_position && P > room) P = room;
    if (P < 1) {
        fprintf(stderr, "gdncp bench decode: %s: max_position_embeddings = %lld leaves no room for a prompt and 48 "
                        "steps\n", dir, (long long)c.max_position);
        return 1;
    }
    return model_rows("ckpt", &c, dir, P, quick, json, cpu);
}

typedef struct {
    int json, quick;
    const char *ckpt;
} bench_decode_opts;

static const cli_opt bench_decode_table[] = {
    {CLI_FLAG("--json", bench_decode_opts, json, "one JSON object per row instead of text")},
    {CLI_FLAG("--quick", bench_decode_opts, quick, "toy sizes (the small model, a 64-token prefill)")},
    {CLI_STR("--ckpt", bench_decode_opts, ckpt, "DIR", "measure this checkpoint's model on its own weights instead")},
};

const cli_command cmd_bench_decode_cli = {
    .name = "bench decode",
    .usage = "usage: gdncp bench decode [--json] [--quick] [--ckpt DIR]\n",
    .summary = "the decode step (gdn_step, the layer, the whole model) against the memory bound of its traffic",
    .about = "  one decode step (gdn_step, the layer, the whole model; --ckpt: a checkpoint's model) against\n"
             "  the bound of streaming its weights and caches once\n",
    .size = sizeof(bench_decode_opts), CLI_OPTS(bench_decode_table),
};

int cmd_bench_decode(int argc, char **argv) {
    bench_decode_opts o;
    if (cli_parse(&cmd_bench_decode_cli, argc - 1, argv + 1, &o, NULL)) return CLI_USAGE_ERROR;
    const int json = o.json, quick = o.quick;
    const char *ckpt = o.ckpt;
    const char *cpu = cli_cpu();
    if (ckpt) { /* that model's generation only */
        if (!json)
            printf("gdncp bench decode — CPU: %s\ncheckpoint %s generating (gdn_model_decode, B = 1, after a prefill): "
                   "bytes = weights (the embedding's one row) + GatedDeltaNet states read and written + KV caches read; "
                   "bound = those bytes at a read stream over a buffer of that size, same run\n", cpu, ckpt);
        return checkpoint_rows(ckpt, quick, json, cpu);
    }
    if (!json) {
        printf("gdncp bench decode — CPU: %s\n", cpu);
        printf("gdn_step, Hv=32 Hk=16 K=V=128; bytes = state read+write + token rows; bound = those "
               "bytes at the in-place stream x=x*a+b over a state-sized buffer (memcpy of the same "
               "size shown too); fwd = gdn_forward with T=1 (chunked path)\n");
        printf("%-5s %-3s %10s %8s %9s %9s %8s %11s %8s\n", "B", "thr", "us/step", "GB/s",
               "rmw GB/s", "copy GB/s", "of bound", "fwd T=1 us", "speedup");
    }
    const int64_t Bs[2] = {1, 8};
    const int thr[2] = {1, 2};
    double rmw1 = 0;
    for (int bi = 0; bi < 2; bi++)
        for (int ti = 0; ti < 2; ti++) {
            decode_times t = {0};
            double bytes = 0;
            char path[128];
            if (bench_row(Bs[bi], thr[ti], quick, &t, &bytes, path, sizeof path)) return 1;
            const double gbs = bytes / (t.step_us * 1e-6) / 1e9, frac = t.frac;
            if (ti == 1 && t.rmw_gbs < 1.2 * rmw1)
                fprintf(stderr, "gdncp bench decode: warning: the 2-thread stream (%.1f GB/s) is not "
                                "faster than 1 thread (%.1f GB/s): the machine looks busy, 2-thread "
                                "rows are unreliable\n", t.rmw_gbs, rmw1);
            if (ti == 0) rmw1 = t.rmw_gbs;
            char shape[96];
            snprintf(shape, sizeof shape, "B=%lld Hk=16 Hv=32 K=128 V=128", (long long)Bs[bi]);
            CLI_ROW(json, CLI_S("direction", "%s", NULL, "decode_step"), CLI_I(NULL, NULL, "%-5lld", Bs[bi]),
                    CLI_S("shape", "%s", NULL, shape), CLI_I("threads", "%lld", " %-3lld", thr[ti]),
                    CLI_F("us_per_step", "%.3f", " %10.1f", t.step_us), CLI_F("bytes_per_step", "%.0f", NULL, bytes),
                    CLI_F("gb_per_s", "%.3f", " %8.1f", gbs), CLI_F("bound_gb_per_s", "%.3f", " %9.1f", t.rmw_gbs),
                    CLI_F("memcpy_gb_per_s", "%.3f", " %9.1f", t.copy_gbs),
                    cli_x(CLI_F("fraction_of_bound", "%.4f", " %7.1f%%", frac), 100),
                    CLI_F("forward_t1_us_per_step", "%.3f", " %11.1f", t.fwd_us),
                    CLI_F("speedup_vs_forward_t1", "%.3f", " %7.1fx", t.fwd_us / t.step_us),
                    CLI_S("path", "%s", NULL, path), CLI_S("cpu", "%s", NULL, cpu));
            fflush(stdout);
        }
    if (!json) {
        char path[128];
        snprintf(path, sizeof path, "%s", gdn_step_path());
        printf("path: %s\n", path);
        printf("model generation (gdn_model_decode, B = 1, after a prefill): bytes = weights (the embedding's "
               "one row) + GatedDeltaNet states read and written + KV caches read; bound = those bytes at "
               "a read stream over a buffer of that size, same run\n");
    }
    static const char *const models[] = {"small", "long"};
    for (int m = 0; m < 2; m++) {
        gdn_model_config c;
        gdn_model_config_named(models[m], &c);
        if (model_rows(models[m], &c, NULL, quick ? 64 : 1024, quick, json, cpu)) return 1;
    }
    if (!quick) { /* Qwen3.5-0.8B's shape, 3 GB of weights: not in the smoke test */
        gdn_model_config c;
        gdn_model_config_named("qwen3.5-0.8b", &c);
        if (model_rows("qwen3.5-0.8b", &c, NULL, 128, quick, json, cpu)) return 1;
    }
    /* Prefill of a prompt forming the last logits: at the real vocabulary, 4 layers (LLLF) and
     * all 24 of Qwen3.5-0.8B's shape; --quick: the small model's */
    const gdn_bf16_path_info bp = cli_bf16(0, 2);
    const double peak[2] = {cli_peak_gflops(2, json), bp.peak_gflops};
    if (!json)
        printf("prefill (gdn_model_prefill_last, B = 1, fp32 and BF16 compute): FLOPs = 2 x the non-embedding "
               "parameters a token + the GatedDeltaNet kernel's forward + the attention core's 2 d H (T + 1) + the "
               "last row's head; measured BF16 instruction peak %.1f GFLOP/s (%s)\n", peak[1],
               bp.name);
    for (int v = 0; v < (quick ? 1 : 2); v++) {
        gdn_model_config c;
        gdn_model_config_named(quick ? "small" : "qwen3.5-0.8b", &c);
        if (!quick && v == 0) c.L = 4, gdn_model_set_attention_interval(&c, GDN_MODEL_NAMED_ATTN_INTERVAL);
        if (prefill_rows(quick ? "small" : "qwen3.5-0.8b", &c, quick ? 64 : 1024, peak, json, cpu)) return 1;
    }
    return 0;
}
