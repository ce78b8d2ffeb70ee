/* The decoder language model on one rank: its tensor table against transformers' checkpoint,
 * the gradient of the whole model against central differences (tensor by tensor), recompute
 * against kept activations, decode against the full forward; each with a negative control. */
#include "harness.h"

#include <omp.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gdncp.h"

/* A model small enough for finite differences, with every piece present. */
static gdn_model_config small_cfg(void) {
    gdn_model_config c = {.vocab = 256, .E = 32, .L = 2, .I = 48, .Hk = 1, .Hv = 2, .K = 16, .V = 16, .Kc = 4, .eps = 1e-6f};
    return c;
}

/* The same with gated attention at layer 1 (2 query heads on 1 kv head, d 16, 8 rotary dims); all:
 * every layer attention (no GatedDeltaNet layer at all). */
static gdn_model_config hybrid_cfg(int all_attention) {
    gdn_model_config c = small_cfg();
    c.H = 2, c.Hkv = 1, c.d = 16, c.R = 8, c.rope_theta = 10000.0;
    c.full_attention[1] = 1;
    if (all_attention) c.full_attention[0] = 1;
    return c;
}

/* Ids from a small alphabet, so that the model sees repeats: bytes 'a'.. for a byte model, else
 * spread over the whole vocabulary (the first and last ids and some beyond 255 among them). */
static gdn_token *random_tokens_v(int64_t n, uint64_t seed, int64_t vocab) {
    gdn_token *t = malloc(sizeof *t * (size_t)n);
    rng_seed(seed);
    for (int64_t i = 0; i < n; i++) {
        const int k = (int)rng_uniform(0, 12);
        t[i] = vocab == 256 ? (gdn_token)(97 + k) : (gdn_token)(k == 11 ? vocab - 1 : (k * (vocab - 1)) / 11);
    }
    return t;
}
static gdn_token *random_tokens(int64_t n, uint64_t seed) { return random_tokens_v(n, seed, 256); }

/* Weights with larger matrices than the 0.02 init (gradients well above fp32 noise), gates
 * with some memory. */
static float *model_weights(const gdn_model_config *c, uint64_t seed) {
    float *w = aligned_alloc(64, sizeof(float) * gdn_model_param_floats(c));
    gdn_model_init(c, w, seed);
    gdn_model_tensor_info t;
    rng_seed(seed + 7);
    for (int i = 0; i < gdn_model_tensor_count(c); i++) {
        gdn_model_tensor(c, i, &t);
        /* embeddings of size ~1: the first norm is smooth at the FD step; tied, the head reads them
         * too, and logits 50 times larger would make the loss's fp32 rounding swamp the differences */
        const float embed_scale = c->tie_embeddings ? 8.0f : 50.0f;
        if (t.ndim == 2)
            for (size_t k = 0; k < t.numel; k++) w[t.offset + k] *= strstr(t.name, "embed") ? embed_scale : 8.0f;
        if (t.ndim == 1 && !strstr(t.name, "A_log") && !strstr(t.name, "dt_bias"))
            for (size_t k = 0; k < t.numel; k++) w[t.offset + k] += (float)rng_uniform(-0.3, 0.3);
        if (strstr(t.name, "A_log"))
            for (size_t k = 0; k < t.numel; k++) w[t.offset + k] = (float)log(rng_uniform(0.05, 1.0));
    }
    return w;
}

static double loss_of(gdn_model_plan *p, const float *w, const gdn_token *tok, double denom) {
    double s = 0;
    int rc = gdn_model_forward(p, w, tok, denom, &s, 0);
    return rc ? NAN : s / denom;
}

static void test_gradients(const gdn_model_config *cfg, const char *what) {
    const gdn_model_config c = *cfg;
    const gdn_model_run r = {.B = 2, .T = 37, .threads = 0, .recompute = 0, .check_finite = 1};
    const double denom = (double)(r.B * r.T);
    gdn_model_plan *p = NULL;
    check(gdn_model_plan_create(&p, &c, &r, NULL) == GDN_OK, "%s: model plan B=2 T=37 E=32 L=2", what);
    if (!p) return;
    float *w = model_weights(&c, 11);
    const size_t nw = gdn_model_param_floats(&c);
    float *dw = aligned_alloc(64, sizeof(float) * nw), *dw_wrong = aligned_alloc(64, sizeof(float) * nw);
    float *wp = aligned_alloc(64, sizeof(float) * nw);
    gdn_token *tok = random_tokens_v(r.B * (r.T + 1), 5, c.vocab), *tok2 = random_tokens_v(r.B * (r.T + 1), 6, c.vocab);
    /* another vocabulary's control: the other draw moved off the alphabet (ids + 5, none of
     * them tok's), so every tensor's gradient differs (two draws of the same 12 ids spread over a
     * large vocabulary are too alike for some tensors) */
    for (int64_t i = 0; c.vocab != 256 && i < r.B * (r.T + 1); i++) tok2[i] = (tok2[i] + 5) % (gdn_token)c.vocab;
    double ls = 0;
    const int rc = model_train_step(p, w, dw, tok, denom, &ls);
    check(rc == GDN_OK && isfinite(ls), "model step: loss %.4f per token", ls / denom);
    check(model_train_step(p, w, dw_wrong, tok2, denom, &ls) == GDN_OK, "model step, other tokens");
    /* The directional derivative along a random direction on one tensor at a time: central
     * differences of the fp32 loss (accumulated in double), Richardson-extrapolated from steps
     * 2e-3 and 1e-3, agree with the analytic gradient to ~3e-3 (the loss's fp32 rounding over the
     * step); tolerance 2e-2, absolute for derivatives under 1e-2. Negative control: the gradient
     * of other targets. */
    double worst = 0, worst_wrong = INFINITY, most_wrong = 0;
    int told_apart = 0;
    char worst_name[96] = "";
    gdn_model_tensor_info t;
    float *dir = malloc(sizeof(float) * nw);
    for (int i = 0; i < gdn_model_tensor_count(&c); i++) {
        gdn_model_tensor(&c, i, &t);
        rng_seed(100 + (uint64_t)i);
        double an = 0, an_wrong = 0;
        for (size_t k = 0; k < t.numel; k++) {
            dir[k] = (float)rng_uniform(-1, 1);
            an += (double)dir[k] * dw[t.offset + k];
            an_wrong += (double)dir[k] * dw_wrong[t.offset + k];
        }
        /* Richardson: (4 D(h/2) - D(h)) / 3 cancels the h^2 term of the central difference, so
         * a step large enough to rise above the fp32 loss's rounding stays accurate */
        const double h = getenv("GDN_FD_EPS") ? atof(getenv("GDN_FD_EPS")) : 2e-3;
        double dd[2];
        for (int half = 0; half < 2; half++) {
            const double eps = half ? h / 2 : h;
            double lp2[2];
            for (int s = 0; s < 2; s++) {
                memcpy(wp, w, sizeof(float) * nw);
                for (size_t k = 0; k < t.numel; k++) wp[t.offset + k] += (float)((s ? -eps : eps) * dir[k]);
                lp2[s] = loss_of(p, wp, tok, denom);
            }
            dd[half] = (lp2[0] - lp2[1]) / (2 * eps);
        }
        const double fd = (4 * dd[1] - dd[0]) / 3;
        const double scale = fmax(fabs(fd), 1e-2); /* absolute below 1e-2 */
        const double err = fabs(an - fd) / scale, err_wrong = fabs(an_wrong - fd) / scale;
        if (getenv("GDN_TEST_VERBOSE"))
            printf("  %-50s an %+.6e fd %+.6e err %.2e (other targets %.2e)\n", t.name, an, fd, err, err_wrong);
        if (err > worst) worst = err, snprintf(worst_name, sizeof worst_name, "%s", t.name);
        if (err_wrong < worst_wrong) worst_wrong = err_wrong;
        if (err_wrong > most_wrong) most_wrong = err_wrong;
        told_apart += err_wrong > 2e-2;
    }
    expect_close(worst, 2e-2, "%s: model gradient vs central differences, every tensor (worst %s)", what, worst_name);
    if (c.vocab == 256) {
        expect_far(worst_wrong, 2e-2, "%s: the gradient of other targets, best tensor", what);
    } else {
        /* with ids spread over a larger vocabulary one tensor's directional derivative can agree
         * by chance (hybrid, vocab 1000: o_proj at 4e-3): the control is the check itself, worst
         * over tensors, and most tensors must tell the targets apart on their own */
        const int n = gdn_model_tensor_count(&c);
        expect_far(most_wrong, 2e-2, "%s: the gradient of other targets, worst tensor (%d of %d tensors tell them "
                   "apart alone)", what, told_apart, n);
        check(told_apart * 10 >= n * 9, "%s: at least 90 %% of the tensors tell other targets apart (%d of %d)", what,
              told_apart, n);
    }
    free(dir);

    /* Recompute (each block's activations recomputed in the backward) gives the same loss and
     * gradient up to rounding (1e-5). Negative control: recompute's gradient for other tokens. */
    gdn_model_run rr = r;
    rr.recompute = 1;
    gdn_model_plan *pr = NULL;
    check(gdn_model_plan_create(&pr, &c, &rr, NULL) == GDN_OK, "model plan with recompute");
    if (pr) {
        double ls_r = 0, ls_k = 0;
        float *dwr = aligned_alloc(64, sizeof(float) * nw);
        model_train_step(p, w, dw, tok, denom, &ls_k);
        check(model_train_step(pr, w, dwr, tok, denom, &ls_r) == GDN_OK, "model step with recompute");
        expect_close(fabs(ls_r - ls_k) / fabs(ls_k), 1e-6, "%s: recompute: loss equals kept activations'", what);
        expect_close(rel_err_ff(dwr, dw, (int64_t)nw), 1e-5, "%s: recompute: gradient equals kept activations'", what);
        model_train_step(pr, w, dwr, tok2, denom, &ls_r);
        expect_far(rel_err_ff(dwr, dw, (int64_t)nw), 1e-5, "%s: recompute's gradient of other tokens", what);
        free(dwr);
        gdn_model_plan_destroy(pr);
    }
    free(tok), free(tok2), free(w), free(wp), free(dw), free(dw_wrong);
    gdn_model_plan_destroy(p);
}

/* Decoding token by token (each layer's decode path and caches), and in prefill pieces, gives
 * the full forward's logits: a GatedDeltaNet-only model and a hybrid one (B = 2). */
static void test_decode_cfg(const gdn_model_config *cp, const char *what) {
    const gdn_model_config c = *cp;
    const int64_t B = 2, T = 30, V = c.vocab, max_len = gdn_model_attn_layers(&c) ? T : 0;
    const gdn_model_run r = {.B = B, .T = T, .threads = 0, .recompute = 0, .check_finite = 1};
    gdn_model_plan *p = NULL;
    gdn_model_decoder *d = NULL, *d2 = NULL;
    check(gdn_model_plan_create(&p, &c, &r, NULL) == GDN_OK, "%s: model plan for logits", what);
    check(gdn_model_decoder_create(&d, &c, B, max_len, 0, GDN_F32) == GDN_OK &&
              gdn_model_decoder_create(&d2, &c, B, max_len, 0, GDN_F32) == GDN_OK,
          "%s: model decoders B=2", what);
    if (!p || !d || !d2) goto out;
    float *w = model_weights(&c, 3);
    gdn_token *tok = random_tokens(B * T, 9), piece[2 * 30];
    float *full = malloc(sizeof(float) * (size_t)(B * T * V));
    float *dec = malloc(sizeof(float) * (size_t)(B * T * V)), *dec_reset = malloc(sizeof(float) * (size_t)(B * T * V));
    check(gdn_model_logits(p, w, tok, full) == GDN_OK, "%s: model logits B=2 T=30", what);
    float *one = malloc(sizeof(float) * (size_t)(B * T * V));
    for (int64_t t = 0; t < T; t++) {
        gdn_token step_tok[2] = {tok[t], tok[T + t]};
        if (t == T / 2) gdn_model_decoder_reset(d2); /* the control: caches dropped halfway */
        for (int pass = 0; pass < 2; pass++) {
            gdn_model_decode(pass ? d2 : d, w, step_tok, one);
            float *dst = pass ? dec_reset : dec;
            for (int64_t b = 0; b < B; b++) memcpy(dst + (b * T + t) * V, one + b * V, sizeof(float) * (size_t)V);
        }
    }
    /* fp32 chunked vs recurrent paths: rounding only (1e-5) */
    expect_close(rel_err_ff(dec, full, B * T * V), 1e-5, "%s: decode token by token vs full forward logits", what);
    expect_far(rel_err_ff(dec_reset, full, B * T * V), 1e-5, "%s: decode with caches dropped halfway", what);
    /* prefill pieces 11, 1, 18 (control: the same pieces after a reset before the last) */
    const int64_t sizes[3] = {11, 1, 18};
    for (int pass = 0; pass < 2; pass++) {
        gdn_model_decoder_reset(d);
        int rc = GDN_OK;
        for (int64_t i = 0, t0 = 0; i < 3 && !rc; t0 += sizes[i], i++) {
            const int64_t Tp = sizes[i];
            if (pass && i == 2) gdn_model_decoder_reset(d);
            for (int64_t b = 0; b < B; b++) memcpy(piece + b * Tp, tok + b * T + t0, sizeof *piece * (size_t)Tp);
            rc = gdn_model_prefill(d, w, piece, Tp, one);
            for (int64_t b = 0; b < B; b++)
                memcpy(dec + (b * T + t0) * V, one + b * Tp * V, sizeof(float) * (size_t)(Tp * V));
        }
        const double e = rc ? INFINITY : rel_err_ff(dec, full, B * T * V);
        if (pass) expect_far(e, 1e-5, "%s: prefill pieces 11, 1, 18 with a reset before the last", what);
        else expect_close(e, 1e-5, "%s: prefill pieces 11, 1, 18 vs full forward logits", what);
    }
    free(w), free(tok), free(full), free(dec), free(dec_reset), free(one);
out:
    gdn_model_plan_destroy(p);
    gdn_model_decoder_destroy(d);
    gdn_model_decoder_destroy(d2);
}

static void test_decode(void) {
    const gdn_model_config g = small_cfg(), h = hybrid_cfg(0);
    test_decode_cfg(&g, "GatedDeltaNet-only");
    test_decode_cfg(&h, "hybrid");
}

/* Every tensor we write has the name and shape transformers gave the same tensor in its own
 * checkpoint (qwen35_tiny: layers 0..2 are GatedDeltaNet layers). */
static void test_names(void) {
    char path[512];
    snprintf(path, sizeof path, "%s/qwen35_tiny/model.safetensors", GDN_GOLDEN_DIR);
    gdn_st_file *f = NULL;
    if (gdn_st_open(&f, path) != GDN_OK) {
        check(0, "open %s: %s", path, gdn_errmsg());
        return;
    }
    for (int variant = 0; variant < 2; variant++) {
        /* qwen35_tiny's dimensions with its 3 GatedDeltaNet layers; the control: intermediate 193 */
        gdn_model_config c = {.vocab = 256, .E = 96, .L = 3, .I = variant ? 193 : 192, .Hk = 2, .Hv = 6, .K = 16, .V = 24, .Kc = 4, .eps = 1e-6f};
        int bad = 0;
        char first_bad[128] = "";
        gdn_model_tensor_info t;
        for (int i = 0; i < gdn_model_tensor_count(&c); i++) {
            gdn_model_tensor(&c, i, &t);
            const gdn_st_tensor *g = gdn_st_find(f, t.name);
            int ok = g && g->ndim == t.ndim;
            for (int k = 0; ok && k < t.ndim; k++) ok = g->shape[k] == t.shape[k];
            if (!ok && !bad++) snprintf(first_bad, sizeof first_bad, "%s", t.name);
        }
        if (!variant)
            check(!bad, "all %d tensor names and shapes are transformers' own (%d differ, first %s)",
                  gdn_model_tensor_count(&c), bad, first_bad);
        else
            check(bad > 0, "intermediate 193 is detected (%s)", first_bad);
    }
    gdn_st_close(f);
}

static void test_errors_model(void) {
    gdn_model_config c = small_cfg();
    gdn_model_plan *p = NULL;
    gdn_model_run r = {.B = 1, .T = 0};
    expect_status(gdn_model_plan_create(&p, &c, &r, NULL), GDN_ERR_SHAPE, "T = 0", "model plan with T = 0");
    c.vocab = 0;
    r.T = 8;
    expect_status(gdn_model_plan_create(&p, &c, &r, NULL), GDN_ERR_SHAPE, "vocab_size = 0", "model vocab 0");
    c = small_cfg();
    r.T = 8;
    if (!gdn_model_plan_create(&p, &c, &r, NULL)) {
        float *w = model_weights(&c, 1), *dw = malloc(sizeof(float) * gdn_model_param_floats(&c));
        gdn_token tok[9] = {'a', 'b', 'c', 'd', 'e', 'f', 'g', 'h', 0};
        double ls;
        expect_status(gdn_model_backward(p, w, dw, tok), GDN_ERR_ARG, "no gdn_model_forward",
                      "model backward without a forward");
        gdn_model_forward(p, w, tok, 8.0, &ls, 0);
        expect_status(gdn_model_backward(p, w, dw, tok), GDN_ERR_ARG, "for_backward",
                      "model backward after an evaluation-only forward");
        free(w), free(dw);
        gdn_model_plan_destroy(p);
        p = NULL;
    }
    c.Hk = 2, c.Hv = 3;
    expect_status(gdn_model_plan_create(&p, &c, &r, NULL), GDN_ERR_SHAPE, "Hv", "model Hv = 3 with Hk = 2");
}

/* Token ids outside [0, vocab) refused by every entry point, naming the id, row and position;
 * control: the same calls with the ids in range succeed. */
static void test_token_ids(void) {
    gdn_model_config c = small_cfg();
    c.vocab = 300;
    const gdn_model_run r = {.B = 2, .T = 8, .check_finite = 1};
    gdn_model_plan *p = NULL;
    gdn_model_decoder *d = NULL;
    if (gdn_model_plan_create(&p, &c, &r, NULL) || gdn_model_decoder_create(&d, &c, 2, 0, 1, GDN_F32)) {
        check(0, "vocab 300: plan and decoder: %s", gdn_errmsg());
        gdn_model_plan_destroy(p);
        return;
    }
    float *w = model_weights(&c, 2), *dw = malloc(sizeof(float) * gdn_model_param_floats(&c));
    float *logits = malloc(sizeof(float) * 2 * 9 * 300);
    gdn_token *tok = random_tokens_v(2 * 9, 3, 300);
    double ls = 0;
    check(gdn_model_forward(p, w, tok, 16.0, &ls, 1) == GDN_OK && gdn_model_backward(p, w, dw, tok) == GDN_OK &&
              gdn_model_logits(p, w, tok, logits) == GDN_OK && gdn_model_prefill(d, w, tok, 8, logits) == GDN_OK &&
              gdn_model_decode(d, w, tok, logits) == GDN_OK,
          "vocab 300: ids 0..299 pass forward, backward, logits, prefill and decode (control)");
    const gdn_token keep = tok[9 + 5];
    tok[9 + 5] = 300; /* row 1, position 5 */
    expect_status(gdn_model_forward(p, w, tok, 16.0, &ls, 1), GDN_ERR_ARG,
                  "token id 300 at row 1 position 5 is outside the vocabulary [0, 300)", "forward: id 300 of vocab 300");
    tok[9 + 5] = keep;
    tok[0] = -1;
    expect_status(gdn_model_forward(p, w, tok, 16.0, &ls, 0), GDN_ERR_ARG,
                  "token id -1 at row 0 position 0 is outside the vocabulary [0, 300)", "forward: a negative id");
    tok[0] = keep;
    tok[8] = 1 << 30; /* the last target of row 0: targets are checked too */
    expect_status(gdn_model_forward(p, w, tok, 16.0, &ls, 0), GDN_ERR_ARG, "at row 0 position 8",
                  "forward: a target id 2^30");
    tok[8] = 7;
    check(gdn_model_forward(p, w, tok, 16.0, &ls, 1) == GDN_OK, "forward after the refusals (the plan is unharmed)");
    tok[9 + 2] = 301;
    expect_status(gdn_model_backward(p, w, dw, tok), GDN_ERR_ARG, "token id 301 at row 1 position 2",
                  "backward: id 301");
    gdn_token in[16];
    for (int b = 0; b < 2; b++) memcpy(in + 8 * b, tok + 9 * b, sizeof *in * 8);
    expect_status(gdn_model_logits(p, w, in, logits), GDN_ERR_ARG, "token id 301 at row 1 position 2",
                  "logits: id 301");
    gdn_model_decoder_reset(d);
    expect_status(gdn_model_prefill(d, w, in, 8, logits), GDN_ERR_ARG, "token id 301 at row 1 position 2",
                  "prefill: id 301");
    const gdn_token one[2] = {4, -7};
    expect_status(gdn_model_decode(d, w, one, logits), GDN_ERR_ARG, "token id -7 at row 1 position 0",
                  "decode: id -7");
    check(decoder_layer(d, 0).length == 0, "a refused piece feeds nothing (length %lld)",
          (long long)decoder_layer(d, 0).length);
    free(w), free(dw), free(logits), free(tok);
    gdn_model_plan_destroy(p);
    gdn_model_decoder_destroy(d);
}

/* A vocabulary large enough that the loss head runs in several row chunks (70,000 ids: 239 rows
 * per chunk, 300 rows): the forward's loss equals the cross-entropy of gdn_model_logits' logits
 * computed here in double (1e-6: fp32 logits, double sums both). Control: the loss head mutated
 * to score each row against its own token instead of the next, through the same comparison. */
static void test_large_vocab(void) {
    gdn_model_config c = small_cfg();
    c.vocab = 70000;
    const int64_t T = 300;
    const gdn_model_run r = {.B = 1, .T = T, .check_finite = 1};
    gdn_model_plan *p = NULL;
    if (gdn_model_plan_create(&p, &c, &r, NULL)) {
        check(0, "vocab 70000: plan: %s", gdn_errmsg());
        return;
    }
    float *w = model_weights(&c, 5), *logits = malloc(sizeof(float) * (size_t)(T * c.vocab));
    gdn_token *tok = random_tokens_v(T + 1, 9, c.vocab);
    double ls = 0;
    const int ok = gdn_model_forward(p, w, tok, (double)T, &ls, 0) == GDN_OK &&
                   gdn_model_logits(p, w, tok, logits) == GDN_OK;
    double ce = 0;
    for (int64_t t = 0; ok && t < T; t++) {
        const float *z = logits + t * c.vocab;
        double mx = z[0], se = 0;
        for (int64_t v = 1; v < c.vocab; v++) mx = z[v] > mx ? z[v] : mx;
        for (int64_t v = 0; v < c.vocab; v++) se += exp((double)z[v] - mx);
        ce += mx + log(se) - z[tok[t + 1]];
    }
    expect_close(ok ? fabs(ls - ce) / fabs(ce) : INFINITY, 1e-6,
                 "vocab 70000: the chunked loss head's loss equals the logits' cross-entropy (%.6f per token)", ce / T);
    double ls_early = 0;
    test_mutation = "model: the loss head's targets one position early";
    const int ok_early = gdn_model_forward(p, w, tok, (double)T, &ls_early, 0) == GDN_OK;
    test_mutation = NULL;
    expect_far(ok && ok_early ? fabs(ls_early - ce) / fabs(ce) : 0, 1e-6,
               "mutation: the loss head scoring each row against its own token, not the next");
    /* Qwen3.5's vocabulary: the loss chunk holds 67 rows of logits (66.6 MB) and lm_head's gradient
     * 32 MB at E 32, where 1024 rows would be 1.02 GB */
    gdn_model_config q = small_cfg();
    q.vocab = 248320;
    const gdn_model_run rq = {.B = 1, .T = 4096};
    const double est = gdn_model_plan_estimate(&q, &rq);
    check(est < 0.25e9, "vocab 248,320, T 4096: the plan would hold %.3g GB (no per-token vocabulary arrays)", 1e-9 * est);
    free(w), free(logits), free(tok);
    gdn_model_plan_destroy(p);
}

/* AdamW and its schedule against the formulas written out in double. */
static void test_adamw(void) {
    gdn_model_config c = small_cfg();
    gdn_adamw_config a = gdn_adamw_default();
    a.warmup = 10, a.steps = 100, a.lr = 1e-2, a.min_lr = 1e-3;
    expect_close(fabs(gdn_adamw_lr(&a, 5) - 5e-3), 1e-15, "lr halfway through warmup");
    expect_close(fabs(gdn_adamw_lr(&a, 55) - 5.5e-3), 1e-12, "lr halfway through the cosine");
    expect_close(fabs(gdn_adamw_lr(&a, 100) - 1e-3), 1e-15, "lr at the end");
    const size_t nw = gdn_model_param_floats(&c);
    float *w = aligned_alloc(64, 4 * nw), *g = aligned_alloc(64, 4 * nw), *m = calloc(nw, 4), *v = calloc(nw, 4);
    double *wd = malloc(8 * nw), *md = calloc(nw, 8), *vd = calloc(nw, 8);
    gdn_model_init(&c, w, 1);
    rng_seed(3);
    for (size_t i = 0; i < nw; i++) g[i] = (float)rng_uniform(-1, 1), wd[i] = w[i];
    gdn_model_tensor_info t;
    for (int64_t step = 1; step <= 3; step++) {
        const double lr = gdn_adamw_lr(&a, step);
        gdn_adamw_update(&a, &c, w, g, m, v, step, lr, 0.5, 0);
        for (int i = 0; i < gdn_model_tensor_count(&c); i++) {
            gdn_model_tensor(&c, i, &t);
            for (size_t k = t.offset; k < t.offset + t.numel; k++) {
                const double gg = 0.5 * g[k];
                md[k] = a.beta1 * md[k] + (1 - a.beta1) * gg;
                vd[k] = a.beta2 * vd[k] + (1 - a.beta2) * gg * gg;
                const double mh = md[k] / (1 - pow(a.beta1, step)), vh = vd[k] / (1 - pow(a.beta2, step));
                wd[k] = wd[k] * (t.decay ? 1 - lr * a.weight_decay : 1) - lr * mh / (sqrt(vh) + a.eps);
            }
        }
    }
    double err = rel_err_f32(w, wd, (int64_t)nw);
    expect_close(err, 1e-6, "AdamW 3 steps vs the formula in double");
    /* the control: the same update without weight decay */
    a.weight_decay = 0;
    gdn_model_init(&c, w, 1);
    memset(m, 0, 4 * nw), memset(v, 0, 4 * nw);
    for (int64_t step = 1; step <= 3; step++) gdn_adamw_update(&a, &c, w, g, m, v, step, gdn_adamw_lr(&a, step), 0.5, 0);
    expect_far(rel_err_f32(w, wd, (int64_t)nw), 1e-6, "AdamW without the weight decay");
    free(w), free(g), free(m), free(v), free(wd), free(md), free(vd);
}

/* AdamW runs with the trainer's thread count, never OpenMP's default team: with the default
 * raised to 4, threads = 1 and threads = 0 ("not given": one thread) update a 256 x 512
 * embedding with a team of 1; the control, threads = 3, is seen with 3. */
/* The sharded trainer's pieces (DESIGN §15): the initialisation, the AdamW update and the squared
 * gradient norm over slices [lo, hi) of uneven lengths give the whole array's values bit for bit;
 * the controls: a slice drawn from the tensor's stream without skipping to its start, and a slice
 * updated at another step, differ. */
static void test_ranges(void) {
    gdn_model_config c = small_cfg();
    gdn_adamw_config a = gdn_adamw_default();
    const size_t nw = gdn_model_param_floats(&c);
    float *w = malloc(4 * nw), *ws = malloc(4 * nw), *g = malloc(4 * nw), *m = calloc(nw, 4), *v = calloc(nw, 4),
          *ms = calloc(nw, 4), *vs = calloc(nw, 4);
    gdn_model_init(&c, w, 7);
    const size_t cut[] = {0, 1, nw / 3 + 5, nw / 2 + 1, nw - 7, nw}; /* slices that split tensors */
    const int ncut = (int)(sizeof cut / sizeof cut[0]);
    for (int i = 0; i + 1 < ncut; i++) gdn_model_init_range(&c, ws + cut[i], 7, cut[i], cut[i + 1]);
    check(!memcmp(w, ws, 4 * nw), "model init over 5 slices = the whole array's, bit for bit");
    /* control: the second slice drawn as if it started its tensors' streams */
    gdn_model_init_range(&c, ws + cut[1], 7, 0, cut[2] - cut[1]);
    check(memcmp(w + cut[1], ws + cut[1], 4 * (cut[2] - cut[1])) != 0,
                "control: a slice not skipped to its place in the streams differs");
    rng_seed(5);
    for (size_t i = 0; i < nw; i++) g[i] = (float)rng_uniform(-1, 1);
    memcpy(ws, w, 4 * nw);
    double whole[2], part[2], sum[2] = {0, 0};
    gdn_grad_sumsq(&c, g, whole);
    for (int i = 0; i + 1 < ncut; i++) {
        gdn_grad_sumsq_range(&c, g + cut[i], cut[i], cut[i + 1], part);
        sum[0] += part[0], sum[1] += part[1];
    }
    expect_close(fabs(sum[0] - whole[0]) / whole[0], 1e-12, "the squared gradient norm summed over 5 slices");
    gdn_grad_sumsq_range(&c, g + cut[2], cut[2], cut[3], part);
    expect_far(fabs(sum[0] - part[0] - whole[0]) / whole[0], 1e-12, "control: the same sum with one slice left out");
    for (int64_t step = 1; step <= 2; step++) {
        gdn_adamw_update(&a, &c, w, g, m, v, step, 1e-3, 0.5, 0);
        for (int i = 0; i + 1 < ncut; i++)
            gdn_adamw_update_range(&a, &c, ws + cut[i], g + cut[i], ms + cut[i], vs + cut[i], cut[i], cut[i + 1],
                                   step, 1e-3, 0.5, 0);
    }
    check(!memcmp(w, ws, 4 * nw) && !memcmp(m, ms, 4 * nw) && !memcmp(v, vs, 4 * nw),
                "AdamW over 5 slices, 2 steps = the whole array's weights and moments, bit for bit");
    gdn_adamw_update_range(&a, &c, ws + cut[2], g + cut[2], ms + cut[2], vs + cut[2], cut[2], cut[3], 5, 1e-3, 0.5, 0);
    check(memcmp(w, ws, 4 * nw) != 0, "control: one slice updated once more differs");
    free(w), free(ws), free(g), free(m), free(v), free(ms), free(vs);
}

static void test_adamw_threads(void) {
    gdn_model_config c = small_cfg();
    c.E = 512, c.I = 64;
    gdn_adamw_config a = gdn_adamw_default();
    const size_t nw = gdn_model_param_floats(&c);
    float *w = aligned_alloc(64, 4 * nw), *g = aligned_alloc(64, 4 * nw), *m = calloc(nw, 4), *v = calloc(nw, 4);
    gdn_model_init(&c, w, 1);
    for (size_t i = 0; i < nw; i++) g[i] = 1e-3f * (float)(i % 7);
    const int before = omp_get_max_threads();
    omp_set_num_threads(4);
    const int asked[3] = {1, 0, 3}, want[3] = {1, 1, 3};
    for (int i = 0; i < 3; i++) {
        test_threads_site = "adamw_update", test_threads_seen = -1;
        gdn_adamw_update(&a, &c, w, g, m, v, 1, 1e-3, 1.0, asked[i]);
        const int seen = test_threads_seen;
        test_threads_site = NULL;
        check(seen == want[i], "AdamW with threads = %d (OpenMP default 4) runs with %d thread(s), want %d", asked[i],
              seen, want[i]);
    }
    omp_set_num_threads(before);
    free(w), free(g), free(m), free(v);
}

/* A checkpoint written and read back gives the same logits, bit for bit; the control: the
 * logits of the weights one AdamW-like nudge away (another checkpoint) differ. */
static void test_checkpoint_logits(void) {
    const gdn_model_config c = small_cfg();
    const int64_t T = 24;
    const gdn_model_run r = {.B = 1, .T = T, .threads = 0, .recompute = 0, .check_finite = 1};
    char dir[] = "/tmp/gdn_ckpt_logits_XXXXXX", ck[4200];
    gdn_model_plan *p = NULL;
    if (!mkdtemp(dir) || gdn_model_plan_create(&p, &c, &r, NULL)) {
        check(0, "checkpoint logits: setup (%s)", gdn_errmsg());
        return;
    }
    const size_t nw = gdn_model_param_floats(&c);
    float *w = model_weights(&c, 5), *back = aligned_alloc(64, sizeof(float) * nw);
    float *l0 = malloc(sizeof(float) * (size_t)(T * c.vocab)), *l1 = malloc(sizeof(float) * (size_t)(T * c.vocab));
    gdn_token *tok = random_tokens(T, 4);
    int rc = gdn_ckpt_save(dir, 1, &c, w, NULL, NULL, NULL, 0, GDN_F32);
    /* step 2: the same weights through a writer that rounds F32 to bfloat16 (a mutation) */
    test_mutation = "ckpt save: F32 tensors written rounded to bfloat16";
    if (!rc) rc = gdn_ckpt_save(dir, 2, &c, w, NULL, NULL, NULL, 0, GDN_F32);
    test_mutation = NULL;
    snprintf(ck, sizeof ck, "%s/checkpoint-00000001", dir);
    gdn_model_config cl;
    if (!rc) rc = gdn_ckpt_load_config(ck, &cl);
    if (!rc) rc = gdn_ckpt_load(ck, &cl, back, NULL, NULL, NULL);
    check(rc == GDN_OK, "checkpoint save + load (%s)", rc ? gdn_errmsg() : "ok");
    if (!rc) {
        gdn_model_logits(p, w, tok, l0);
        gdn_model_logits(p, back, tok, l1);
        expect_close(rel_err_ff(l1, l0, T * c.vocab), 0.0, "logits of the checkpoint read back == before writing");
        snprintf(ck, sizeof ck, "%s", dir); /* the newest: step 2, written by the mutated writer */
        char newest[4200];
        if (!gdn_ckpt_resolve(ck, newest, sizeof newest) && !gdn_ckpt_load(newest, &cl, back, NULL, NULL, NULL)) {
            gdn_model_logits(p, back, tok, l1);
            expect_far(rel_err_ff(l1, l0, T * c.vocab), 1e-5,
                       "control: logits of the checkpoint written rounded to bfloat16 (a writer mutation)");
        } else {
            check(0, "load the newest checkpoint: %s", gdn_errmsg());
        }
    }
    char cmd[4300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd)) check(0, "remove %s", dir);
    free(w), free(back), free(l0), free(l1), free(tok);
    gdn_model_plan_destroy(p);
}

/* Packed documents: one step over rows of several documents equals each document run alone as
 * its own sequence (loss summed, gradient summed, the same denominator): documents of one token,
 * starts at the chunk boundary (64) and one token either side, a document whose only token is
 * the last target. Negative control: the same rows with one document start left out (no reset
 * there) must miss. Also: recompute equals kept activations; refusals. */
static void test_packed(const gdn_model_config *cfg, const char *what) {
    const gdn_model_config c = *cfg;
    enum { B = 2, T = 150 };
    const int64_t cu[] = {0, 5, 6, 64, 129, 151, /* row 1 */ 0, 65, 150, 151};
    const int64_t n_docs[B] = {5, 3};
    const int64_t cu_noreset[] = {0, 5, 6, 129, 151, 0, 65, 150, 151}, n_noreset[B] = {4, 3};
    const size_t nw = gdn_model_param_floats(&c);
    float *w = model_weights(&c, 13);
    float *dw = aligned_alloc(64, sizeof(float) * nw), *dw_ref = aligned_alloc(64, sizeof(float) * nw);
    float *dw_doc = aligned_alloc(64, sizeof(float) * nw);
    gdn_token *tok = random_tokens(B * (T + 1), 8);
    /* the reference: each document alone, targets inside it only */
    int64_t want = 0;
    double ref = 0;
    memset(dw_ref, 0, sizeof(float) * nw);
    for (int64_t b = 0, at = 0; b < B; at += n_docs[b] + 1, b++)
        for (int64_t d = 0; d < n_docs[b]; d++) want += cu[at + d + 1] - cu[at + d] - 1;
    const double denom = (double)want;
    int ok = 1;
    for (int64_t b = 0, at = 0; b < B; at += n_docs[b] + 1, b++)
        for (int64_t d = 0; d < n_docs[b]; d++) {
            const int64_t s = cu[at + d], n = cu[at + d + 1] - s - 1; /* inputs */
            if (n < 1) continue; /* a one-token document predicts nothing */
            const gdn_model_run r1 = {.B = 1, .T = n, .threads = 0, .check_finite = 1};
            gdn_model_plan *p1 = NULL;
            double ls = 0;
            ok &= gdn_model_plan_create(&p1, &c, &r1, NULL) == GDN_OK &&
                  model_train_step(p1, w, dw_doc, tok + b * (T + 1) + s, denom, &ls) == GDN_OK;
            ref += ls;
            for (size_t i = 0; i < nw; i++) dw_ref[i] += dw_doc[i];
            gdn_model_plan_destroy(p1);
        }
    check(ok, "%s: each document alone through an unpacked plan", what);
    for (int recompute = 0; recompute < 2; recompute++) {
        const gdn_model_run r = {.B = B, .T = T, .threads = 0, .recompute = recompute, .check_finite = 1, .pack = 1};
        gdn_model_plan *p = NULL;
        int64_t got_targets = -1;
        double ls = 0;
        check(gdn_model_plan_create(&p, &c, &r, NULL) == GDN_OK, "%s: packed model plan (recompute %d)", what, recompute);
        if (!p) continue;
        if (!recompute)
            expect_status(gdn_model_forward(p, w, tok, denom, &ls, 0), GDN_ERR_ARG, "gdn_model_set_docs",
                         "packed forward before any documents are set");
        const int set = gdn_model_set_docs(p, cu, n_docs, 0, &got_targets);
        check(set == GDN_OK && got_targets == want, "gdn_model_set_docs: %lld targets predicted (%lld inside "
              "documents)", (long long)got_targets, (long long)want);
        check(model_train_step(p, w, dw, tok, denom, &ls) == GDN_OK, "packed model step");
        expect_close(fabs(ls - ref) / fabs(ref), 2e-5, "%s: packed loss vs each document alone (recompute %d)", what,
                     recompute);
        expect_close(rel_err_ff(dw, dw_ref, (int64_t)nw), 2e-5,
                     "%s: packed gradient vs each document alone (recompute %d)", what, recompute);
        if (!recompute) {
            check(gdn_model_set_docs(p, cu_noreset, n_noreset, 0, &got_targets) == GDN_OK,
                  "documents with the start at 64 left out");
            model_train_step(p, w, dw, tok, denom, &ls);
            expect_far(rel_err_ff(dw, dw_ref, (int64_t)nw), 2e-5, "%s: packed gradient without the reset at 64", what);
            const int64_t bad_order[] = {0, 9, 9, 151, 0, 151}, n_bad[B] = {3, 1};
            expect_status(gdn_model_set_docs(p, bad_order, n_bad, 0, &got_targets), GDN_ERR_SHAPE, "not increasing",
                         "documents not increasing");
            expect_status(gdn_model_forward(p, w, tok, denom, &ls, 0), GDN_ERR_ARG, "gdn_model_set_docs",
                         "a forward after refused documents");
            const int64_t short_row[] = {0, 151, 0, 150}, n_short[B] = {1, 1};
            expect_status(gdn_model_set_docs(p, short_row, n_short, 0, &got_targets), GDN_ERR_SHAPE, "row 1",
                         "rows whose windows differ in length");
            const int64_t one[] = {0, 151, 0, 151}, n_one[B] = {1, 1};
            expect_status(gdn_model_set_docs(p, one, n_one, 3, &got_targets), GDN_ERR_SHAPE, "seq_offset",
                         "a seq_offset on one rank");
        }
        gdn_model_plan_destroy(p);
    }
    {
        const gdn_model_run r = {.B = B, .T = T, .threads = 0, .check_finite = 1};
        gdn_model_plan *p = NULL;
        int64_t got = 0;
        if (gdn_model_plan_create(&p, &c, &r, NULL) == GDN_OK)
            expect_status(gdn_model_set_docs(p, cu, n_docs, 0, &got), GDN_ERR_ARG, "run.pack",
                         "documents for a plan made without run.pack");
        gdn_model_plan_destroy(p);
    }
    free(w), free(dw), free(dw_ref), free(dw_doc), free(tok);
}

/* A tied model (no lm_head: the head reads the embedding) equals the untied model whose lm_head is
 * a copy of its embedding: the same loss and logits, and the tied embedding's gradient is the sum
 * of the untied embedding's and lm_head's. Control: the untied embedding's gradient alone (the
 * head's use of the embedding left out). */
static void test_tied(void) {
    const gdn_model_config cu = hybrid_cfg(0);
    gdn_model_config ct = cu;
    ct.tie_embeddings = 1;
    check(gdn_model_tensor_count(&ct) == gdn_model_tensor_count(&cu) - 1 &&
              gdn_model_param_floats(&ct) == gdn_model_param_floats(&cu) - 256 * 32,
          "tied: no lm_head tensor, %zu floats fewer", gdn_model_param_floats(&cu) - gdn_model_param_floats(&ct));
    float *wu = model_weights(&cu, 17), *wt = aligned_alloc(64, sizeof(float) * gdn_model_param_floats(&ct));
    gdn_model_tensor_info t, u, emb = {0}, head = {0};
    for (int i = 0; i < gdn_model_tensor_count(&cu); i++) {
        gdn_model_tensor(&cu, i, &u);
        if (!strcmp(u.name, "model.embed_tokens.weight")) emb = u;
        if (!strcmp(u.name, "lm_head.weight")) head = u;
    }
    memcpy(wu + head.offset, wu + emb.offset, sizeof(float) * emb.numel);
    for (int i = 0; i < gdn_model_tensor_count(&ct); i++) { /* the same tensors by name */
        gdn_model_tensor(&ct, i, &t);
        for (int k = 0; k < gdn_model_tensor_count(&cu); k++)
            if (!gdn_model_tensor(&cu, k, &u) && !strcmp(u.name, t.name)) memcpy(wt + t.offset, wu + u.offset, 4 * t.numel);
    }
    const gdn_model_run r = {.B = 2, .T = 37, .threads = 0, .check_finite = 1};
    gdn_model_plan *pu = NULL, *pt = NULL;
    float *dwu = aligned_alloc(64, sizeof(float) * gdn_model_param_floats(&cu));
    float *dwt = aligned_alloc(64, sizeof(float) * gdn_model_param_floats(&ct));
    float *lu = malloc(sizeof(float) * 2 * 37 * 256), *lt = malloc(sizeof(float) * 2 * 37 * 256);
    gdn_token *tok = random_tokens(2 * 38, 21), in[2 * 37];
    for (int b = 0; b < 2; b++) memcpy(in + b * 37, tok + b * 38, sizeof *in * 37);
    double su = 0, st = 0;
    if (!gdn_model_plan_create(&pu, &cu, &r, NULL) && !gdn_model_plan_create(&pt, &ct, &r, NULL) &&
        !model_train_step(pu, wu, dwu, tok, 74, &su) && !model_train_step(pt, wt, dwt, tok, 74, &st) &&
        !gdn_model_logits(pu, wu, in, lu) && !gdn_model_logits(pt, wt, in, lt)) {
        expect_close(fabs(st - su) / fabs(su), 1e-6, "tied: loss equals the untied model's with lm_head = embedding");
        expect_close(rel_err_ff(lt, lu, 2 * 37 * 256), 1e-6, "tied: logits equal the untied model's");
        float *sum = malloc(sizeof(float) * emb.numel);
        for (size_t k = 0; k < emb.numel; k++) sum[k] = dwu[emb.offset + k] + dwu[head.offset + k];
        expect_close(rel_err_ff(dwt, sum, (int64_t)emb.numel), 1e-5,
                     "tied: the embedding's gradient = the untied embedding's + lm_head's");
        expect_far(rel_err_ff(dwt, dwu + emb.offset, (int64_t)emb.numel), 1e-5,
                   "tied: ... against the untied embedding's alone (the head's use left out)");
        free(sum);
    } else {
        check(0, "tied and untied model steps: %s", gdn_errmsg());
    }
    gdn_model_plan_destroy(pu), gdn_model_plan_destroy(pt);
    free(wu), free(wt), free(dwu), free(dwt), free(lu), free(lt), free(tok);
}

/* A hybrid configuration or run that cannot be is refused, naming what is wrong. */
/* gdn_model_count_layers against the config's own arrays (full_attention[], moe[]), and its
 * refusals. */
static void test_count_layers(void) {
    gdn_model_config c;
    memset(&c, 0, sizeof c);
    c.L = 6;
    c.full_attention[1] = c.full_attention[5] = 1;
    c.moe[0] = c.moe[2] = c.moe[3] = 1;
    c.full_attention[6] = c.moe[7] = 1; /* past L: not counted */
    int64_t na = 0, nm = 0;
    for (int l = 0; l < c.L; l++) na += c.full_attention[l], nm += c.moe[l];
    check(gdn_model_count_layers(&c, GDN_MODEL_ATTN_LAYERS) == na && na == 2 && gdn_model_attn_layers(&c) == na,
          "gdn_model_count_layers: 2 full-attention layers of 6, as full_attention[] and the shorthand say");
    check(gdn_model_count_layers(&c, GDN_MODEL_MOE_LAYERS) == nm && nm == 3 && gdn_model_moe_layers(&c) == nm,
          "gdn_model_count_layers: 3 MoE layers of 6, as moe[] and the shorthand say");
    check(gdn_model_count_layers(&c, 2) == -1 && strstr(gdn_errmsg(), "kind 2"), "gdn_model_count_layers: kind 2 refused (-1)");
    check(gdn_model_count_layers(&c, -1) == -1, "gdn_model_count_layers: kind -1 refused (-1)");
    check(gdn_model_count_layers(NULL, GDN_MODEL_ATTN_LAYERS) == -1 && strstr(gdn_errmsg(), "cfg is NULL"),
          "gdn_model_count_layers: a NULL cfg refused (-1)");
}

static void test_hybrid_errors(void) {
    gdn_model_plan *p = NULL;
    gdn_model_run r = {.B = 1, .T = 8, .check_finite = 1};
    struct {
        const char *what, *needle;
        int want;
        void (*edit)(gdn_model_config *c);
    } cases[] = {
        {"a full-attention layer beyond num_hidden_layers", "full_attention[5] = 1 but the model has 2 layers",
         GDN_ERR_SHAPE, NULL},
        {"a layer type 2", "1 (full attention) or 0 (GatedDeltaNet)", GDN_ERR_ARG, NULL},
        {"3 query heads on 2 kv heads", "not a multiple of Hkv = 2", GDN_ERR_SHAPE, NULL},
        {"7 rotary dims", "R = 7 must be even", GDN_ERR_SHAPE, NULL},
        {"head_dim 0", "attention d = 0 is out of range", GDN_ERR_SHAPE, NULL},
    };
    for (int i = 0; i < (int)(sizeof cases / sizeof cases[0]); i++) {
        gdn_model_config c = hybrid_cfg(0);
        if (i == 0) c.full_attention[5] = 1;
        if (i == 1) c.full_attention[0] = 2;
        if (i == 2) c.H = 3, c.Hkv = 2;
        if (i == 3) c.R = 7;
        if (i == 4) c.d = 0;
        expect_status(gdn_model_plan_create(&p, &c, &r, NULL), cases[i].want, cases[i].needle, "model plan: %s",
                      cases[i].what);
    }
    gdn_model_config c = hybrid_cfg(0);
    r.attn_cp = 7;
    expect_status(gdn_model_plan_create(&p, &c, &r, NULL), GDN_ERR_ARG, "attn_cp = 7 is unknown",
                  "model plan: attention CP strategy 7");
    r.attn_cp = GDN_ATTN_CP_KV, r.T = 32;
    c.max_position = 16;
    expect_status(gdn_model_plan_create(&p, &c, &r, NULL), GDN_ERR_ARG, "beyond max_position = 16",
                  "model plan: 32 tokens with max_position_embeddings 16");
    gdn_model_decoder *d = NULL;
    c = hybrid_cfg(0);
    expect_status(gdn_model_decoder_create(&d, &c, 1, 0, 1, GDN_F32), GDN_ERR_SHAPE, "needs max_len >= 1",
                  "decoder of a hybrid model without max_len (its KV caches need one)");
    c.max_position = 16;
    expect_status(gdn_model_decoder_create(&d, &c, 1, 17, 1, GDN_F32), GDN_ERR_SHAPE, "beyond max_position = 16",
                  "decoder max_len 17 with max_position_embeddings 16");
    {
        gdn_model_config g = small_cfg();
        g.max_position = 16;
        check(gdn_model_decoder_create(&d, &g, 1, 17, 1, GDN_F32) == GDN_OK,
              "decoder max_len 17 of a GatedDeltaNet-only model with max_position 16 (no positions)");
        gdn_model_decoder_destroy(d);
        d = NULL;
    }
    c.max_position = 0;
    check(gdn_model_decoder_create(&d, &c, 1, 4, 1, GDN_F32) == GDN_OK, "decoder of a hybrid model, max_len 4");
    {
        const gdn_token tok[5] = {1, 2, 3, 4, 5};
        float *lg = malloc(sizeof(float) * 5 * (size_t)c.vocab), *wt = model_weights(&c, 1);
        check(gdn_model_prefill(d, wt, tok, 3, lg) == GDN_OK, "prefill 3 of max_len 4");
        expect_status(gdn_model_prefill(d, wt, tok, 2, lg), GDN_ERR_SHAPE, "exceed the decoder's max_len = 4",
                      "3 fed + 2 more past max_len 4");
        expect_status(gdn_model_prefill(d, wt, tok, 0, lg), GDN_ERR_SHAPE, "T = 0", "a piece of 0 tokens");
        const gdn_model_decoder_view v0 = decoder_layer(d, 0), v1 = decoder_layer(d, 1);
        check(!v0.kv && v0.conv_state && v0.rec_state && v1.kv && !v1.conv_state && !v1.rec_state &&
                  v0.length == 3 && v1.length == 3,
              "decoder layers: states for the GatedDeltaNet layer (0), a KV cache for the attention layer (1), "
              "3 tokens fed");
        gdn_model_decoder_view out;
        expect_status(gdn_model_decoder_layer(d, c.L, &out), GDN_ERR_ARG, "outside the model", "layer L refused");
        check(!out.kv && !out.rec_state && !out.length, "a refused layer's view is zeroed");
        expect_status(gdn_model_decoder_layer(d, 0, NULL), GDN_ERR_ARG, "NULL", "a NULL view refused");
        free(lg), free(wt);
    }
    gdn_model_decoder_destroy(d);
    d = NULL;
    /* a GatedDeltaNet-only model reads no attention field */
    c = small_cfg();
    c.H = -5, c.d = 3;
    check(gdn_model_plan_create(&p, &c, &r, NULL) == GDN_OK, "a GatedDeltaNet-only model ignores its attention fields");
    gdn_model_plan_destroy(p);
}

/* Whether layer 0's up_proj starts right where its gate_proj ends in the flat layout. */
static int gate_up_adjacent(const gdn_model_config *c) {
    size_t gate_end = 0, up = 1;
    gdn_model_tensor_info t;
    for (int i = 0; i < gdn_model_tensor_count(c); i++) {
        gdn_model_tensor(c, i, &t);
        if (strstr(t.name, "layers.0.mlp.gate_proj")) gate_end = t.offset + t.numel;
        if (strstr(t.name, "layers.0.mlp.up_proj")) up = t.offset;
    }
    return gate_end == up;
}

void test_model(void) {
    test_ranges();
    test_checkpoint_logits();
    test_names();
    test_errors_model();
    test_adamw();
    test_adamw_threads();
    test_count_layers();
    test_hybrid_errors();
    const gdn_model_config gdn = small_cfg(), hyb = hybrid_cfg(0), att = hybrid_cfg(1);
    gdn_model_config tied = hyb;
    tied.tie_embeddings = 1;
    test_gradients(&gdn, "GatedDeltaNet");
    test_gradients(&hyb, "hybrid");
    test_gradients(&tied, "hybrid, tied");
    test_tied();
    test_packed(&gdn, "GatedDeltaNet");
    test_packed(&hyb, "hybrid");
    test_packed(&att, "attention only");
    test_decode();
    /* vocabularies other than bytes: the whole gradient against central differences, with its
     * negative control (test_gradients), ids spread over the whole vocabulary */
    gdn_model_config v300 = gdn, v1000 = hyb;
    v300.vocab = 300, v1000.vocab = 1000;
    test_gradients(&v300, "GatedDeltaNet, vocab 300");
    test_gradients(&v1000, "hybrid, vocab 1000");
    /* I E not a multiple of 16: gate_proj and up_proj apart in the flat layout (padding between
     * them), so the MLP runs them as two GEMMs instead of one [2I x E] */
    gdn_model_config apart = hyb;
    apart.E = 36, apart.I = 49;
    check(!gate_up_adjacent(&apart) && gate_up_adjacent(&hyb),
          "E 36, I 49: up_proj is not right after gate_proj in the flat layout (E 32, I 48: it is)");
    test_gradients(&apart, "hybrid, E 36, I 49");
    test_token_ids();
    test_large_vocab();
}
