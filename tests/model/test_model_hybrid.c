/* The hybrid language model (GatedDeltaNet and gated full-attention layers) on one rank against
 * transformers' own Qwen3_5ForCausalLM (tests/data/qwen35_tiny, float64 references of the whole
 * model): the loss, the logits and every parameter's gradient, dense and with packed documents,
 * and the stock fp32 logits; the decoder (a prefill, then one token at a time with every layer's
 * cache) against transformers' own cached run: logits, caches, greedy generation. Negative
 * controls run through the same comparisons: the layer types shifted by one (the attention
 * layer's weights at layer 2, layer 2's GatedDeltaNet at 3), the attention layer removed (o_proj
 * zero), the packed row run without its documents; for the decoder, one cache tampered with
 * (positions not continuing, no KV cache, the recurrent states reset). */
#include "harness.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gdncp.h"

#define TINY GDN_GOLDEN_DIR "/qwen35_tiny"
#define MOE_TINY GDN_GOLDEN_DIR "/qwen35_moe_tiny"

/* The checkpoint whose references the tests below read (qwen35_tiny, then qwen35_moe_tiny: the
 * same hybrid with every MLP a sparse mixture of experts), and a reference file's path in it. */
static const char *g_dir = TINY;
static const char *ref_path(const char *file) {
    static char buf[4][512];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", g_dir, file);
    return buf[k];
}

/* fp32 against the exact (float64) references; transformers' stock fp32 logits (RoPE angles in
 * fp32, ~1e-5 rad apart at these positions) */
#define TOL_LOSS 1e-5
#define TOL_LOGITS 1e-5
#define TOL_GRAD 1e-4
#define TOL_STOCK 1e-5

typedef struct {
    gdn_model_config cfg;
    float *w;
} model_w;

static int tiny_load(model_w *m) {
    int rc = gdn_ckpt_load_config(g_dir, &m->cfg);
    m->w = rc ? NULL : aligned_alloc(64, sizeof(float) * ((gdn_model_param_floats(&m->cfg) + 15) & ~(size_t)15));
    if (!rc) rc = m->w ? gdn_ckpt_load(g_dir, &m->cfg, m->w, NULL, NULL, NULL) : GDN_ERR_NOMEM;
    if (rc) check(0, "load %s: %s", g_dir, gdn_errmsg());
    return rc;
}

/* Bytes of an I64 tensor of n values of any rank (gdn_st_read_i64 reads 1-D ones): its bytes
 * straight from the file, after the 8-byte header length and the header. */
static int read_bytes(gdn_st_file *f, const char *path, const char *name, gdn_token *dst, int64_t n) {
    const gdn_st_tensor *t = gdn_st_find(f, name);
    FILE *fp = fopen(path, "rb");
    uint64_t hlen = 0;
    int ok = t && fp && !strcmp(t->dtype_name, "I64") && (t)->numel == n && fread(&hlen, 8, 1, fp) == 1 &&
             !fseeko(fp, (off_t)(8 + hlen + t->begin), SEEK_SET);
    for (int64_t i = 0; ok && i < n; i++) {
        int64_t v;
        ok = fread(&v, 8, 1, fp) == 1 && v >= 0 && v <= 255;
        dst[i] = (gdn_token)v;
    }
    if (fp) fclose(fp);
    return ok ? GDN_OK : GDN_ERR_FORMAT;
}

/* The first T of every row's Tr positions of a [B, Tr, V] reference, compacted to [B, T, V]. */
static double *first_positions(const double *ref, int64_t B, int64_t Tr, int64_t T, int64_t V) {
    double *out = dalloc(B * T * V);
    for (int64_t b = 0; b < B; b++) memcpy(out + b * T * V, ref + b * Tr * V, sizeof(double) * (size_t)(T * V));
    return out;
}

/* One run of a plan: the mean loss (loss_sum / denom), logits [B, T, vocab] of the inputs (a plan
 * of T + 1 tokens when logits_T1: transformers gives every position's) and dw. */
typedef struct {
    double loss;
    float *logits, *dw;
    double aux; /* the MoE aux loss (gdn_model_aux_loss; 0 without MoE layers) */
} run_out;

/* The relative error of every tensor's gradient against grad.<name>; the worst into *worst (its
 * name into wname), the best into *best (over tensors whose name contains `only`, NULL: all). */
static void grad_errors(const gdn_model_config *c, const float *dw, gdn_st_file *ref, double *worst, char *wname,
                        double *best, const char *only, int verbose) {
    *worst = 0, *best = INFINITY;
    gdn_model_tensor_info t;
    char name[160];
    for (int i = 0; i < gdn_model_tensor_count(c); i++) {
        gdn_model_tensor(c, i, &t);
        snprintf(name, sizeof name, "grad.%s", t.name);
        double *g = dalloc((int64_t)t.numel);
        const double e = gdn_st_read_f64(ref, name, g, t.numel) ? INFINITY : rel_err_f32(dw + t.offset, g, (int64_t)t.numel);
        if (verbose) printf("    %-52s %.2e\n", t.name, e);
        if (e > *worst) *worst = e, snprintf(wname, 96, "%s", t.name);
        if ((!only || strstr(t.name, only)) && e < *best) *best = e;
        free(g);
    }
}

/* The groups of tensors whose worst errors the report names. */
static const char *const groups[] = {"embed_tokens", "lm_head", "model.norm", "linear_attn.in_proj", "linear_attn.conv1d",
                                     "linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.norm", "linear_attn.out_proj",
                                     "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                     "self_attn.q_norm", "self_attn.k_norm", "mlp.", "layernorm"};

static void grad_groups(const gdn_model_config *c, const float *dw, gdn_st_file *ref, const char *what) {
    gdn_model_tensor_info t;
    char name[160], line[1200] = "";
    for (size_t k = 0; k < sizeof groups / sizeof groups[0]; k++) {
        double worst = 0;
        for (int i = 0; i < gdn_model_tensor_count(c); i++) {
            gdn_model_tensor(c, i, &t);
            if (!strstr(t.name, groups[k])) continue;
            snprintf(name, sizeof name, "grad.%s", t.name);
            double *g = dalloc((int64_t)t.numel);
            const double e = gdn_st_read_f64(ref, name, g, t.numel) ? INFINITY : rel_err_f32(dw + t.offset, g, (int64_t)t.numel);
            worst = e > worst ? e : worst;
            free(g);
        }
        snprintf(line + strlen(line), sizeof line - strlen(line), " %s %.1e", groups[k], worst);
    }
    printf("  %s, worst per group:%s\n", what, line);
}

/* Forward + backward over tokens [B, T+1] (mean over denom targets) and the logits of the first T
 * inputs. docs (may be NULL: dense): one row's doc_cu for gdn_model_set_docs. */
static int run_model(const gdn_model_config *c, const float *w, const gdn_token *tok, int64_t B, int64_t T,
                     double denom, const int64_t *docs, int64_t n_docs, run_out *o) {
    const gdn_model_run r = {.B = B, .T = T, .threads = 0, .check_finite = 1, .pack = docs != NULL};
    gdn_model_plan *p = NULL;
    int64_t targets = 0;
    double ls = 0;
    int rc = gdn_model_plan_create(&p, c, &r, NULL);
    if (!rc && docs) rc = gdn_model_set_docs(p, docs, &n_docs, 0, &targets);
    if (!rc) rc = model_train_step(p, w, o->dw, tok, denom, &ls);
    /* with the aux loss on: CE + router_aux_loss_coef x the load-balancing loss, as transformers */
    o->aux = rc ? NAN : gdn_model_aux_loss(p);
    o->loss = ls / denom + (c->router_aux ? c->router_aux_coef * o->aux : 0.0);
    gdn_token *in = malloc(sizeof *in * (size_t)(B * T));
    for (int64_t b = 0; b < B; b++) memcpy(in + b * T, tok + b * (T + 1), sizeof *in * (size_t)T);
    if (!rc) rc = gdn_model_logits(p, w, in, o->logits);
    free(in);
    gdn_model_plan_destroy(p);
    if (rc) check(0, "model run B=%lld T=%lld: %s", (long long)B, (long long)T, gdn_errmsg());
    return rc;
}

/* The tiny's weights with the layer types shifted by one: its attention layer (3) placed at layer
 * 2 and layer 2's GatedDeltaNet at 3, each block's norms and MLP where they were. */
static float *shifted_weights(const model_w *m, gdn_model_config *sc) {
    *sc = m->cfg;
    sc->full_attention[2] = 1, sc->full_attention[3] = 0;
    float *w = aligned_alloc(64, sizeof(float) * ((gdn_model_param_floats(sc) + 15) & ~(size_t)15));
    gdn_model_tensor_info t, u;
    for (int i = 0; i < gdn_model_tensor_count(sc); i++) {
        gdn_model_tensor(sc, i, &t);
        char from[96];
        snprintf(from, sizeof from, "%s", t.name);
        if (strstr(from, "layers.2.self_attn")) from[13] = '3';
        else if (strstr(from, "layers.3.linear_attn")) from[13] = '2';
        for (int j = 0; j < gdn_model_tensor_count(&m->cfg); j++)
            if (!gdn_model_tensor(&m->cfg, j, &u) && !strcmp(u.name, from))
                memcpy(w + t.offset, m->w + u.offset, sizeof(float) * t.numel);
    }
    return w;
}

/* The attention layers' o_proj zeroed: the mixer adds nothing to the residual. */
static float *no_attention_weights(const model_w *m) {
    const size_t nw = gdn_model_param_floats(&m->cfg);
    float *w = aligned_alloc(64, sizeof(float) * ((nw + 15) & ~(size_t)15));
    memcpy(w, m->w, sizeof(float) * nw);
    gdn_model_tensor_info t;
    for (int i = 0; i < gdn_model_tensor_count(&m->cfg); i++)
        if (!gdn_model_tensor(&m->cfg, i, &t) && strstr(t.name, "self_attn.o_proj")) memset(w + t.offset, 0, 4 * t.numel);
    return w;
}

/* model_grads.io: input_ids [2, 200], mean CE over 2 x 199 targets, logits of all 200 positions. */
static void test_dense(const model_w *m) {
    gdn_st_file *ref = NULL;
    if (gdn_st_open(&ref, ref_path("model_grads.io.safetensors"))) {
        check(0, "open model_grads.io: %s", gdn_errmsg());
        return;
    }
    enum { B = 2, N = 200, V = 256 };
    gdn_token tok[B * N];
    double loss_ref = NAN, *lref = dalloc(B * N * V);
    int bad = read_bytes(ref, ref_path("model_grads.io.safetensors"), "input_ids", tok, B * N) || gdn_st_read_f64(ref, "loss", &loss_ref, 1) ||
              gdn_st_read_f64(ref, "logits", lref, (size_t)B * N * V);
    check(!bad, "model_grads.io: input_ids [2, 200], loss, logits");
    const gdn_model_config *c = &m->cfg;
    const size_t nw = gdn_model_param_floats(c);
    run_out o = {0, falloc(B * N * V), falloc((int64_t)nw), 0}, scratch = {0, falloc(B * N * V), falloc((int64_t)nw), 0};
    /* the loss and gradient over T = 199 inputs; the logits of all 200 from a plan of T = 200 */
    if (bad || run_model(c, m->w, tok, B, N - 1, B * (N - 1), NULL, 0, &o)) goto out;
    {
        gdn_token tok200[B * (N + 1)];
        for (int b = 0; b < B; b++) memcpy(tok200 + b * (N + 1), tok + b * N, sizeof *tok * N), tok200[b * (N + 1) + N] = 0;
        if (run_model(c, m->w, tok200, B, N, B * N, NULL, 0, &scratch)) goto out;
    }
    expect_close(fabs(o.loss - loss_ref) / fabs(loss_ref), TOL_LOSS,
                 "hybrid tiny (3 GatedDeltaNet + 1 attention layer): loss %.6f vs transformers' %.6f", o.loss, loss_ref);
    expect_close(rel_err_f32(scratch.logits, lref, B * N * V), TOL_LOGITS, "hybrid tiny: logits [2, 200, 256]");
    double worst, best;
    char wname[96] = "";
    grad_errors(c, o.dw, ref, &worst, wname, &best, NULL, getenv("GDN_TEST_VERBOSE") != NULL);
    grad_groups(c, o.dw, ref, "dense");
    expect_close(worst, TOL_GRAD, "hybrid tiny: every one of the %d gradients (worst %s)", gdn_model_tensor_count(c), wname);

    /* control 1: the layer types shifted by one */
    gdn_model_config sc;
    float *ws = shifted_weights(m, &sc);
    run_out s = {0, scratch.logits, falloc((int64_t)gdn_model_param_floats(&sc)), 0};
    double *l199 = first_positions(lref, B, N, N - 1, V);
    if (!run_model(&sc, ws, tok, B, N - 1, B * (N - 1), NULL, 0, &s)) {
        /* (the MoE tiny's loss moves by only 7e-6 under this swap: its loss control is the next one) */
        if (!gdn_model_moe_layers(c))
            expect_far(fabs(s.loss - loss_ref) / fabs(loss_ref), TOL_LOSS, "the layer types shifted by one, loss");
        expect_far(rel_err_f32(s.logits, l199, B * (N - 1) * V), TOL_LOGITS,
                   "the layer types shifted by one, logits (199 positions)");
    }
    free(ws), free(s.dw);
    /* control (MoE): the chosen experts' weights not renormalised, as if the config asked for no
     * renormalisation (Qwen3-Next's norm_topk_prob false) */
    if (gdn_model_moe_layers(c)) {
        gdn_model_config raw = *c;
        raw.norm_topk = 0;
        if (!run_model(&raw, m->w, tok, B, N - 1, B * (N - 1), NULL, 0, &scratch)) {
            expect_far(rel_err_f32(scratch.logits, l199, B * (N - 1) * V), TOL_LOGITS,
                       "the experts' weights not renormalised, logits (199 positions)");
            grad_errors(c, scratch.dw, ref, &worst, wname, &best, "mlp.", 0);
            expect_far(worst, TOL_GRAD, "the experts' weights not renormalised, the MLP gradients (worst %s)", wname);
        }
    }
    free(l199);
    /* control 2: the attention layer removed (o_proj zero) */
    float *wn = no_attention_weights(m);
    if (!run_model(c, wn, tok, B, N - 1, B * (N - 1), NULL, 0, &scratch)) {
        expect_far(fabs(scratch.loss - loss_ref) / fabs(loss_ref), TOL_LOSS, "the attention layer removed, loss");
        grad_errors(c, scratch.dw, ref, &worst, wname, &best, "self_attn", 0);
        expect_far(best, TOL_GRAD, "the attention layer removed, every attention tensor's gradient (best)");
        grad_errors(c, scratch.dw, ref, &worst, wname, &best, "layers.0.", 0);
        expect_far(best, TOL_GRAD, "the attention layer removed, every gradient of layer 0 (best)");
    }
    free(wn);
out:
    free(o.logits), free(o.dw), free(scratch.logits), free(scratch.dw), free(lref);
    gdn_st_close(ref);
}

/* model_packed.io: three documents (50, 1, 80 tokens) in one row, positions restarting, logits of
 * each document alone, loss over the 128 targets inside documents. */
static void test_packed_hf(const model_w *m) {
    gdn_st_file *ref = NULL;
    if (gdn_st_open(&ref, ref_path("model_packed.io.safetensors"))) {
        check(0, "open model_packed.io: %s", gdn_errmsg());
        return;
    }
    enum { N = 131, V = 256 };
    gdn_token tok[N];
    int64_t cu[4] = {0}, ncu = 0;
    double loss_ref = NAN, *lref = dalloc(N * V);
    int bad = read_bytes(ref, ref_path("model_packed.io.safetensors"), "input_ids", tok, N) || gdn_st_read_i64(ref, "cu_seqlens", cu, 4, &ncu) || ncu != 4 ||
              gdn_st_read_f64(ref, "loss", &loss_ref, 1) || gdn_st_read_f64(ref, "logits", lref, (size_t)N * V);
    check(!bad && cu[1] == 50 && cu[2] == 51 && cu[3] == 131, "model_packed.io: input_ids [1, 131], cu_seqlens "
          "[0, 50, 51, 131], loss, logits");
    const gdn_model_config *c = &m->cfg;
    const size_t nw = gdn_model_param_floats(c);
    run_out o = {0, falloc(N * V), falloc((int64_t)nw), 0};
    /* the window's offsets are the documents' own (the last, T_full + 1 = 131, ends the window) */
    const double denom = 128; /* 49 + 0 + 79 targets inside documents */
    if (bad || run_model(c, m->w, tok, 1, N - 1, denom, cu, 3, &o)) goto out;
    expect_close(fabs(o.loss - loss_ref) / fabs(loss_ref), TOL_LOSS, "packed hybrid tiny: loss %.6f vs transformers' "
                 "%.6f", o.loss, loss_ref);
    /* 130 inputs: the logits of the last token (130) are not formed */
    expect_close(rel_err_f32(o.logits, lref, (N - 1) * V), TOL_LOGITS,
                 "packed hybrid tiny: logits of 130 positions vs each document alone");
    double worst, best;
    char wname[96] = "";
    grad_errors(c, o.dw, ref, &worst, wname, &best, NULL, getenv("GDN_TEST_VERBOSE") != NULL);
    grad_groups(c, o.dw, ref, "packed");
    expect_close(worst, TOL_GRAD, "packed hybrid tiny: every gradient (worst %s)", wname);
    /* control: the same row without its documents (one stream: no resets, no attention bounds) */
    if (!run_model(c, m->w, tok, 1, N - 1, denom, NULL, 0, &o)) {
        expect_far(rel_err_f32(o.logits, lref, (N - 1) * V), TOL_LOGITS, "the packed row without its documents, "
                   "logits");
        grad_errors(c, o.dw, ref, &worst, wname, &best, "self_attn", 0);
        expect_far(best, TOL_GRAD, "the packed row without its documents, attention gradients (best)");
    }
out:
    free(o.logits), free(o.dw), free(lref);
    gdn_st_close(ref);
}

/* logits.io: transformers' stock fp32 model (eager attention) on 135 bytes of text. */
static void test_stock_logits(const model_w *m) {
    gdn_st_file *ref = NULL;
    if (gdn_st_open(&ref, ref_path("logits.io.safetensors"))) {
        check(0, "open logits.io: %s", gdn_errmsg());
        return;
    }
    enum { N = 135, V = 256 };
    gdn_token tok[N];
    double *lref = dalloc(N * V);
    float *logits = falloc(N * V);
    const int bad = read_bytes(ref, ref_path("logits.io.safetensors"), "input_ids", tok, N) || gdn_st_read_f64(ref, "logits", lref, (size_t)N * V);
    const gdn_model_run r = {.B = 1, .T = N, .threads = 0, .check_finite = 1};
    gdn_model_plan *p = NULL;
    if (!bad && !gdn_model_plan_create(&p, &m->cfg, &r, NULL) && !gdn_model_logits(p, m->w, tok, logits)) {
        expect_close(rel_err_f32(logits, lref, N * V), TOL_STOCK, "hybrid tiny: logits of 135 bytes vs transformers' "
                     "stock fp32 model");
        float *wn = no_attention_weights(m);
        gdn_model_logits(p, wn, tok, logits);
        expect_far(rel_err_f32(logits, lref, N * V), TOL_STOCK, "the attention layer removed");
        free(wn);
    } else {
        check(0, "logits.io run: %s", gdn_errmsg());
    }
    gdn_model_plan_destroy(p);
    free(lref), free(logits);
    gdn_st_close(ref);
}

/* ---------------------------------------------------------------- decode with both caches
 *
 * model_decode.io (stock fp32 transformers and its cache): a 37-token prefill, then tokens 37..44
 * one at a time; the logits of each and every layer's cache at the end. The controls tamper with
 * one cache during the decode steps and go through the same comparisons. */
typedef enum {
    DEC_OK,
    DEC_KV_SET_BACK, /* the attention cache's length set back by one before the first decode step */
    DEC_KV_NONE,     /* the attention layer without its cache: emptied before every decode step */
    DEC_REC_RESET,   /* the GatedDeltaNet recurrent states zeroed before every decode step */
    DEC_KINDS
} dec_tamper;
static const char *const dec_tamper_name[DEC_KINDS] = {
    "", "the attention cache's length set back by one (positions not continuing)",
    "the attention layer decoded without its cache (each token alone)",
    "the GatedDeltaNet recurrent states reset between steps"};

static void dec_apply(gdn_model_decoder *d, const gdn_model_config *c, dec_tamper tk, int step) {
    for (int64_t l = 0; l < c->L; l++) {
        const gdn_model_decoder_view v = decoder_layer(d, l);
        gdn_attn_cache *kv = v.kv;
        if (kv && tk == DEC_KV_SET_BACK && step == 0) gdn_attn_cache_set_length(kv, cache_view(kv).length - 1);
        if (kv && tk == DEC_KV_NONE) gdn_attn_cache_reset(kv);
        if (v.rec_state && tk == DEC_REC_RESET) memset(v.rec_state, 0, sizeof(float) * (size_t)(c->Hv * c->K * c->V));
    }
}

/* tok [T] through d (reset first): a prefill of T0 tokens, then one token at a time (tampered
 * before each step); logits [T, vocab]. */
static int dec_run(gdn_model_decoder *d, const gdn_model_config *c, const float *w, const gdn_token *tok, int64_t T,
                   int64_t T0, dec_tamper tk, float *logits) {
    gdn_model_decoder_reset(d);
    int rc = gdn_model_prefill(d, w, tok, T0, logits);
    for (int64_t t = T0; t < T && !rc; t++) {
        dec_apply(d, c, tk, (int)(t - T0));
        rc = gdn_model_decode(d, w, tok + t, logits + t * c->vocab);
    }
    if (rc) check(0, "decode %s: %s", dec_tamper_name[tk], gdn_errmsg());
    return rc;
}

/* The worst relative error of our caches at the end against the file's, over every layer; the
 * attention cache: the first Tn positions of each head of our [1, Hkv, capacity, d] (whatever
 * its length; *kv_len receives that). */
static double cache_errors(gdn_model_decoder *d, const gdn_model_config *c, gdn_st_file *f, int64_t Tn,
                           double *kv_err, double *rec_err, int64_t *kv_len) {
    double conv_err = 0;
    *kv_err = 0, *rec_err = 0;
    char name[64];
    for (int64_t l = 0; l < c->L; l++) {
        const gdn_model_decoder_view v = decoder_layer(d, l);
        gdn_attn_cache *kv = v.kv;
        if (kv) {
            *kv_len = cache_view(kv).length;
            const int64_t cap = cache_view(kv).capacity, n = c->Hkv * Tn * c->d;
            float *ours = falloc(n);
            double *ref = dalloc(n);
            for (int part = 0; part < 2; part++) {
                const float *src = part ? cache_values(kv) : cache_keys(kv);
                for (int64_t h = 0; h < c->Hkv; h++)
                    memcpy(ours + h * Tn * c->d, src + h * cap * c->d, sizeof(float) * (size_t)(Tn * c->d));
                snprintf(name, sizeof name, "layers.%lld.%s", (long long)l, part ? "value_cache" : "key_cache");
                const double e = gdn_st_read_f64(f, name, ref, (size_t)n) ? INFINITY : rel_err_f32(ours, ref, n);
                *kv_err = fmax(*kv_err, e);
            }
            free(ours), free(ref);
            continue;
        }
        const float *conv = v.conv_state, *rec = v.rec_state;
        const gdn_layer_config lc = gdn_model_layer_config(c, 1, 1);
        const int64_t nc = gdn_layer_conv_dim(&lc) * c->Kc, nr = c->Hv * c->K * c->V;
        double *ref = dalloc(nc > nr ? nc : nr);
        snprintf(name, sizeof name, "layers.%lld.conv_state", (long long)l);
        conv_err = fmax(conv_err, gdn_st_read_f64(f, name, ref, (size_t)nc) ? INFINITY : rel_err_f32(conv, ref, nc));
        snprintf(name, sizeof name, "layers.%lld.recurrent_state", (long long)l);
        *rec_err = fmax(*rec_err, gdn_st_read_f64(f, name, ref, (size_t)nr) ? INFINITY : rel_err_f32(rec, ref, nr));
        free(ref);
    }
    return conv_err;
}

/* Checks one run's numbers against the file (expect_close for DEC_OK, expect_far otherwise, on
 * the comparisons the tampering reaches): prefill and decode logits, the whole sequence against
 * the file's logits_full and our forward, and every cache at the end. */
#define CAP_DEC 48 /* the decoder's max_len for model_decode.io: above its 45 tokens */
static void dec_compare(gdn_model_decoder *d, const gdn_model_config *c, gdn_st_file *f, const float *lg,
                        const float *fwd, const double *lfull, const double *lpre, const double *ldec, int64_t T,
                        int64_t T0, dec_tamper tk) {
    const int64_t V = c->vocab;
    const char *what = dec_tamper_name[tk];
    int64_t kv_len = -1;
    double kv_err, rec_err, conv_err = cache_errors(d, c, f, T, &kv_err, &rec_err, &kv_len);
    const double e_dec = rel_err_f32(lg + T0 * V, ldec, (T - T0) * V), e_full = rel_err_f32(lg, lfull, T * V);
    const double e_fwd = rel_err_ff(lg, fwd, T * V);
    if (tk == DEC_OK) {
        expect_close(rel_err_f32(lg, lpre, T0 * V), TOL_STOCK, "hybrid decoder: logits of a %lld-token prefill vs "
                     "transformers' (its cache)", (long long)T0);
        expect_close(e_dec, TOL_STOCK, "hybrid decoder: logits of tokens %lld..%lld one at a time", (long long)T0,
                     (long long)T - 1);
        expect_close(e_full, TOL_STOCK, "hybrid decoder: prefill + decode = transformers' logits_full (no cache)");
        expect_close(e_fwd, TOL_STOCK, "hybrid decoder: prefill + decode = our forward of the %lld tokens",
                     (long long)T);
        check(kv_len == T && decoder_layer(d, 0).length == T, "hybrid decoder: %lld tokens fed, the attention "
              "cache's length %lld", (long long)decoder_layer(d, 0).length, (long long)kv_len);
        expect_close(kv_err, TOL_STOCK, "hybrid decoder: the attention layer's key_cache and value_cache "
                     "(first %lld positions of our capacity %lld)", (long long)T, (long long)CAP_DEC);
        expect_close(conv_err, TOL_STOCK, "hybrid decoder: every GatedDeltaNet layer's conv_state at the end");
        expect_close(rec_err, TOL_STOCK, "hybrid decoder: every GatedDeltaNet layer's recurrent_state at the end");
        return;
    }
    expect_far(e_dec, TOL_STOCK, "%s: decode logits", what);
    expect_far(e_fwd, TOL_STOCK, "%s: decode = forward", what);
    if (tk == DEC_REC_RESET) expect_far(rec_err, TOL_STOCK, "%s: recurrent_state at the end", what);
    else expect_far(kv_err, TOL_STOCK, "%s: key_cache/value_cache at the end", what);
}

static void test_decode_hf(const model_w *m) {
    gdn_st_file *f = NULL;
    if (gdn_st_open(&f, ref_path("model_decode.io.safetensors"))) {
        check(0, "open model_decode.io: %s", gdn_errmsg());
        return;
    }
    enum { T = 45, T0 = 37, V = 256, CAP = CAP_DEC };
    const gdn_model_config *c = &m->cfg;
    gdn_token tok[T];
    double *lfull = dalloc(T * V), *lpre = dalloc(T0 * V), *ldec = dalloc((T - T0) * V);
    float *lg = falloc(T * V), *fwd = falloc(T * V);
    const int bad = read_bytes(f, ref_path("model_decode.io.safetensors"), "input_ids", tok, T) ||
                    gdn_st_read_f64(f, "logits_full", lfull, (size_t)T * V) ||
                    gdn_st_read_f64(f, "logits_prefill", lpre, (size_t)T0 * V) ||
                    gdn_st_read_f64(f, "logits_decode", ldec, (size_t)(T - T0) * V);
    check(!bad, "model_decode.io: input_ids [1, 45], logits_full, logits_prefill, logits_decode");
    const gdn_model_run r = {.B = 1, .T = T, .threads = 0, .check_finite = 1};
    gdn_model_plan *p = NULL;
    gdn_model_decoder *d = NULL;
    int rc = bad ? GDN_ERR_FORMAT : gdn_model_plan_create(&p, c, &r, NULL);
    if (!rc) rc = gdn_model_logits(p, m->w, tok, fwd);
    /* a capacity above the sequence: our cache's first 45 positions are compared */
    if (!rc) rc = gdn_model_decoder_create(&d, c, 1, CAP, 0, GDN_F32);
    if (rc) check(0, "model_decode.io setup: %s", gdn_errmsg());
    for (int tk = 0; !rc && tk < DEC_KINDS; tk++)
        if (!dec_run(d, c, m->w, tok, T, T0, (dec_tamper)tk, lg))
            dec_compare(d, c, f, lg, fwd, lfull, lpre, ldec, T, T0, (dec_tamper)tk);
    /* gdn_model_prefill_last: the prompt in two pieces, only the last position's logits (what
     * generation reads) = transformers' logits of position T0 - 1; control: the first piece left
     * out (the caches start at the second) */
    for (int skip = 0; !rc && skip < 2; skip++) {
        gdn_model_decoder_reset(d);
        rc = skip ? GDN_OK : gdn_model_prefill_last(d, m->w, tok, 20, lg);
        if (!rc) rc = gdn_model_prefill_last(d, m->w, tok + 20, T0 - 20, lg);
        if (rc) break;
        const double e = rel_err_f32(lg, lpre + (T0 - 1) * V, V);
        if (!skip) expect_close(e, TOL_STOCK, "gdn_model_prefill_last over pieces of 20 + 17 tokens: the last logits");
        else expect_far(e, TOL_STOCK, "the prompt's first 20 tokens never prefilled, the last logits");
    }
    if (rc) check(0, "prefill_last: %s", gdn_errmsg());
    /* A BF16 prefill (gdn_model_decoder_set_compute): the same two pieces within BF16's rounding of
     * transformers' logits, then a decode step (fp32 either way) within it of logits_decode's
     * first row; control: the two pieces fed in the other order. Back in fp32 the pieces are fp32's again
     * (the piece plans remade), and a compute that is neither is refused. */
    enum { TOL_BF16_LOGITS = 3 };               /* x 1e-2 */
    for (int skip = 0; !rc && skip < 2; skip++) {
        gdn_model_decoder_reset(d);
        rc = gdn_model_decoder_set_compute(d, GDN_COMPUTE_BF16);
        if (!rc) rc = gdn_model_prefill_last(d, m->w, tok + (skip ? 20 : 0), skip ? T0 - 20 : 20, lg);
        if (!rc) rc = gdn_model_prefill_last(d, m->w, tok + (skip ? 0 : 20), skip ? 20 : T0 - 20, lg);
        if (rc) break;
        const double e = rel_err_f32(lg, lpre + (T0 - 1) * V, V);
        if (skip) {
            expect_far(e, TOL_BF16_LOGITS * 1e-2, "BF16 prefill with its two pieces in the other order, the last logits");
            break;
        }
        expect_close(e, TOL_BF16_LOGITS * 1e-2, "gdn_model_prefill_last in BF16 compute over 20 + 17 tokens: the last logits");
        if (!(rc = gdn_model_decode(d, m->w, tok + T0, lg)))
            expect_close(rel_err_f32(lg, ldec, V), TOL_BF16_LOGITS * 1e-2, "a decode step after the BF16 prefill");
    }
    if (!rc) {
        gdn_model_decoder_reset(d);
        rc = gdn_model_decoder_set_compute(d, GDN_COMPUTE_FP32);
        if (!rc) rc = gdn_model_prefill_last(d, m->w, tok, T0, lg);
        if (!rc) expect_close(rel_err_f32(lg, lpre + (T0 - 1) * V, V), TOL_STOCK, "back in fp32: the last logits");
    }
    if (rc) check(0, "BF16 prefill: %s", gdn_errmsg());
    expect_status(gdn_model_decoder_set_compute(d, 7), GDN_ERR_ARG, "neither GDN_COMPUTE_FP32",
                  "gdn_model_decoder_set_compute(7) is refused naming the two");
    gdn_model_decoder_destroy(d);
    gdn_model_plan_destroy(p);
    free(lfull), free(lpre), free(ldec), free(lg), free(fwd);
    gdn_st_close(f);
}

/* Greedy generation: n ids after the prompt into out (tampered as dec_apply before every decode
 * step); *margin: the smallest gap between the best and second-best logit over the steps. */
static int greedy(gdn_model_decoder *d, const gdn_model_config *c, const float *w, const gdn_token *prompt, int64_t np,
                  int64_t n, dec_tamper tk, gdn_token *out, double *margin) {
    const int64_t V = c->vocab;
    float *lg = falloc(np * V);
    gdn_model_decoder_reset(d);
    int rc = gdn_model_prefill(d, w, prompt, np, lg);
    const float *row = lg + (np - 1) * V;
    *margin = INFINITY;
    for (int64_t i = 0; i < n && !rc; i++) {
        int best = 0, second = -1;
        for (int v = 1; v < V; v++) {
            if (row[v] > row[best]) second = best, best = v;
            else if (second < 0 || row[v] > row[second]) second = v;
        }
        *margin = fmin(*margin, (double)row[best] - row[second]);
        out[i] = (gdn_token)best;
        if (i + 1 == n) break;
        dec_apply(d, c, tk, (int)i);
        rc = gdn_model_decode(d, w, out + i, lg);
        row = lg;
    }
    free(lg);
    if (rc) check(0, "greedy generation: %s", gdn_errmsg());
    return rc;
}

static void test_generate_hf(const model_w *m) {
    gdn_st_file *f = NULL;
    if (gdn_st_open(&f, ref_path("generate.io.safetensors"))) {
        check(0, "open generate.io: %s", gdn_errmsg());
        return;
    }
    enum { NP = 12, NG = 32 };
    gdn_token prompt[NP], ref[NG], got[NG];
    const int bad = read_bytes(f, ref_path("generate.io.safetensors"), "prompt_ids", prompt, NP) ||
                    read_bytes(f, ref_path("generate.io.safetensors"), "generated_ids", ref, NG);
    check(!bad, "generate.io: prompt_ids [1, 12], generated_ids [1, 32]");
    gdn_model_decoder *d = NULL;
    if (bad || gdn_model_decoder_create(&d, &m->cfg, 1, NP + NG, 0, GDN_F32)) {
        check(0, "generate.io setup: %s", gdn_errmsg());
        goto out;
    }
    /* (the MoE tiny's greedy tokens do not move when its attention positions are set back by one,
     * nor with its recurrent states reset: its control is the attention layer without its cache) */
    const dec_tamper kinds[3] = {DEC_OK, DEC_KV_NONE, DEC_KV_SET_BACK};
    for (int k = 0; k < (gdn_model_moe_layers(&m->cfg) ? 2 : 3); k++) {
        double margin;
        if (greedy(d, &m->cfg, m->w, prompt, NP, NG, kinds[k], got, &margin)) break;
        int same = 0, first = -1;
        for (int i = 0; i < NG; i++) same += got[i] == ref[i], first = first < 0 && got[i] != ref[i] ? i : first;
        if (!k) check(same == NG, "hybrid decoder: greedy generation of %d tokens from prompt_ids = transformers' "
                      "generated_ids (%d/%d equal, first differing at %d (-1: none); smallest top-2 logit margin %.3g)",
                      NG, same, NG, first, margin);
        else check(same < NG, "negative control: greedy generation with %s differs from generated_ids (%d/%d "
                   "equal, first differing at %d)", dec_tamper_name[kinds[k]], same, NG, first);
    }
out:
    gdn_model_decoder_destroy(d);
    gdn_st_close(f);
}

/* A decode step on one thread opens no OpenMP region: libgomp charges ~0.3 us and a futex
 * syscall even for a team of one, ~40 times a token in this model before (a quarter of its
 * decode time). On 2 threads only passes worth a team open one (gdn_threads_for_bytes): none
 * for this model's few-hundred-KB products. Control: 2 threads on a model 16x as wide (E 512,
 * I 1024: MB-sized products) are counted opening regions. */
static int decode_regions(const gdn_model_config *c, const float *w, int threads, long *opened) {
    const gdn_token prompt[5] = {3, 1, 4, 1, 5};
    float *lg = falloc(5 * c->vocab);
    gdn_model_decoder *d = NULL;
    int rc = gdn_model_decoder_create(&d, c, 1, 16, threads, GDN_F32);
    if (!rc) rc = gdn_model_prefill(d, w, prompt, 5, lg);
    const long before = test_omp_regions;
    for (int s = 0; s < 4 && !rc; s++) rc = gdn_model_decode(d, w, prompt + s, lg);
    *opened = test_omp_regions - before;
    gdn_model_decoder_destroy(d);
    free(lg);
    return rc;
}

static void test_decode_regions(const model_w *m) {
    if (test_omp_regions < 0) {
        check(0, "decode regions: this compiler's OpenMP regions cannot be counted (GCC's libgomp only)");
        return;
    }
    long one, two, wide;
    int rc = decode_regions(&m->cfg, m->w, 1, &one);
    check(!rc && one == 0, "hybrid decoder, 1 thread: 4 decode steps open %ld OpenMP regions (want 0; status %d)", one,
          rc);
    rc = decode_regions(&m->cfg, m->w, 2, &two);
    check(!rc && two == 0, "hybrid decoder, 2 threads: the same steps open %ld regions (want 0: no pass worth a team; "
          "status %d)", two, rc);
    gdn_model_config c = m->cfg;
    c.E = 512, c.I = 1024;
    float *w = falloc((int64_t)gdn_model_param_floats(&c));
    gdn_model_init(&c, w, 5);
    rc = decode_regions(&c, w, 2, &wide);
    check(!rc && wide > 0, "control: 2 threads on E 512, I 1024 open %ld regions in 4 steps (> 0; status %d)", wide, rc);
    free(w);
}

/* model_grads_aux.io: the same step with output_router_logits on: loss = CE + 0.01 aux, the aux
 * loss itself, every gradient of that loss. transformers routes all 200 positions of each row (the
 * last has no target), so the plan runs 200 inputs with the 201st token a document of its own
 * (its target not predicted: gdn_model_set_docs). rows: the plan's rows (2: the batch; 1: row
 * `row` alone); stats (NULL: the plan's own) replaces the routers' statistics before the
 * backward; *own receives the plan's. */
enum { AUX_N = 200, AUX_V = 256 };
static int aux_step(const gdn_model_config *c, const float *w, const gdn_token *tok, int rows, int row,
                    const double *stats, double *own, double *loss, double *aux, float *dw) {
    const gdn_model_run r = {.B = rows, .T = AUX_N, .threads = 0, .check_finite = 1, .pack = 1};
    gdn_token in[2 * (AUX_N + 1)];
    int64_t cu[6], nd[2] = {2, 2}, targets = 0;
    for (int b = 0; b < rows; b++) {
        memcpy(in + b * (AUX_N + 1), tok + (row + b) * AUX_N, sizeof *in * AUX_N);
        in[b * (AUX_N + 1) + AUX_N] = 0;
        cu[3 * b] = 0, cu[3 * b + 1] = AUX_N, cu[3 * b + 2] = AUX_N + 1;
    }
    gdn_model_plan *p = NULL;
    double ce = 0;
    int rc = gdn_model_plan_create(&p, c, &r, NULL);
    if (!rc) rc = gdn_model_set_docs(p, cu, nd, 0, &targets);
    if (!rc) rc = gdn_model_forward(p, w, in, 2 * (AUX_N - 1), &ce, 1);
    if (!rc && own) rc = gdn_model_router_stats(p, own);
    if (!rc && stats) rc = gdn_model_set_router_stats(p, stats);
    if (!rc) rc = gdn_model_backward(p, w, dw, in);
    *aux = rc ? NAN : gdn_model_aux_loss(p);
    *loss = ce / (2 * (AUX_N - 1)) + c->router_aux_coef * *aux;
    gdn_model_plan_destroy(p);
    return rc;
}

/* Then the batch split in two halves (each row its own plan, as two data-parallel ranks): their
 * routers' statistics summed and handed back to both give the whole batch's loss and gradients.
 * Negative controls through the same checks: the aux term off (its gradient dropped), each half's
 * aux from its own statistics (per rank, not over the grid). */
static void test_moe_aux(const model_w *m) {
    gdn_st_file *ref = NULL;
    if (gdn_st_open(&ref, ref_path("model_grads_aux.io.safetensors"))) {
        check(0, "open model_grads_aux.io: %s", gdn_errmsg());
        return;
    }
    gdn_token tok[2 * AUX_N];
    double loss_ref = NAN, aux_ref = NAN;
    const int bad = read_bytes(ref, ref_path("model_grads_aux.io.safetensors"), "input_ids", tok, 2 * AUX_N) ||
                    gdn_st_read_f64(ref, "loss", &loss_ref, 1) || gdn_st_read_f64(ref, "aux_loss", &aux_ref, 1);
    check(!bad, "model_grads_aux.io: input_ids [2, 200], loss, aux_loss");
    gdn_model_config c = m->cfg;
    c.router_aux = 1;
    const size_t nw = gdn_model_param_floats(&c);
    const int64_t ns = 2 * c.n_experts + 1;
    float *dw = falloc((int64_t)nw), *dws[2] = {falloc((int64_t)nw), falloc((int64_t)nw)};
    double *st[2] = {dalloc(ns), dalloc(ns)}, *grid = dalloc(ns);
    double worst, best, loss, aux, l2[2], a2[2];
    char wname[96] = "";
    int rc = bad ? GDN_ERR_FORMAT : aux_step(&c, m->w, tok, 2, 0, NULL, NULL, &loss, &aux, dw);
    if (!rc) {
        expect_close(fabs(aux - aux_ref) / aux_ref, TOL_LOSS, "MoE tiny: aux loss %.8f vs transformers' %.8f", aux, aux_ref);
        expect_close(fabs(loss - loss_ref) / loss_ref, TOL_LOSS, "MoE tiny: CE + 0.01 aux = %.8f vs transformers' %.8f",
                     loss, loss_ref);
        grad_errors(&c, dw, ref, &worst, wname, &best, NULL, 0);
        expect_close(worst, TOL_GRAD, "MoE tiny with the aux loss: every gradient (worst %s)", wname);
        /* control: the same step without the aux term: the routers' gradients miss it */
        gdn_model_config off = c;
        off.router_aux = 0;
        if (!(rc = aux_step(&off, m->w, tok, 2, 0, NULL, NULL, &loss, &aux, dw))) {
            grad_errors(&off, dw, ref, &worst, wname, &best, "mlp.gate.weight", 0);
            expect_far(worst, TOL_GRAD, "the aux loss's gradient dropped, the routers' gradients (worst %s)", wname);
        }
    }
    /* the batch in two halves: each half's statistics first, then both steps with their sum */
    for (int h = 0; h < 2 && !rc; h++) rc = aux_step(&c, m->w, tok, 1, h, NULL, st[h], &l2[h], &a2[h], dws[h]);
    for (int64_t i = 0; i < ns; i++) grid[i] = st[0][i] + st[1][i];
    for (int pass = 0; pass < 2 && !rc; pass++) { /* 0: the grid's statistics; 1 (control): each its own */
        for (int h = 0; h < 2 && !rc; h++)
            rc = aux_step(&c, m->w, tok, 1, h, pass ? NULL : grid, NULL, &l2[h], &a2[h], dws[h]);
        for (size_t i = 0; !rc && i < nw; i++) dw[i] = dws[0][i] + dws[1][i];
        if (rc) break;
        grad_errors(&c, dw, ref, &worst, wname, &best, NULL, 0);
        if (!pass) {
            /* each half's loss is its CE over the whole batch's targets + the grid's aux: the aux once */
            const double whole = l2[0] + l2[1] - c.router_aux_coef * a2[0];
            expect_close(fabs(whole - loss_ref) / loss_ref, TOL_LOSS, "MoE tiny, the batch as two 1-row plans with the "
                         "routers' statistics summed: loss %.8f", whole);
            expect_close(worst, TOL_GRAD, "... the summed gradients (worst %s)", wname);
        } else {
            expect_far(worst, TOL_GRAD, "each half's aux loss from its own rows' statistics, the summed gradients "
                       "(worst %s)", wname);
        }
    }
    if (rc) check(0, "MoE tiny aux steps: %s", gdn_errmsg());
    for (int h = 0; h < 2; h++) free(st[h]), free(dws[h]);
    free(grid), free(dw);
    gdn_st_close(ref);
}

/* A checkpoint directory written here: config.json copied from the golden checkpoint, the weights
 * w with each MoE layer's experts fused (as gdncp's table names them) or one by one (as
 * save_pretrained writes them); `drop` (NULL: none) left out, `extra` (NULL: none) added as a
 * zero tensor of `extra_shape`. */
static int write_moe_ckpt(const char *dir, const gdn_model_config *c, const float *w, int one_by_one, const char *drop,
                          const char *extra, const int64_t extra_shape[2]) {
    char path[600], *text = NULL;
    snprintf(path, sizeof path, "%s/config.json", g_dir);
    FILE *fp = fopen(path, "rb");
    long len = 0;
    if (fp && !fseek(fp, 0, SEEK_END) && (len = ftell(fp)) > 0 && !fseek(fp, 0, SEEK_SET) && (text = calloc(1, (size_t)len + 1)))
        len = (long)fread(text, 1, (size_t)len, fp);
    if (fp) fclose(fp);
    snprintf(path, sizeof path, "%s/config.json", dir);
    fp = text ? fopen(path, "wb") : NULL;
    int rc = fp && fwrite(text, 1, (size_t)len, fp) == (size_t)len ? GDN_OK : GDN_ERR_IO;
    if (fp) fclose(fp);
    free(text);
    gdn_st_writer *wr = NULL;
    if (!rc) rc = gdn_st_writer_create(&wr);
    gdn_model_tensor_info t;
    const int64_t I = c->moe_I, E = c->E;
    char name[160];
    for (int i = 0; !rc && i < gdn_model_tensor_count(c); i++) {
        gdn_model_tensor(c, i, &t);
        const char *ex = strstr(t.name, "mlp.experts.");
        if (!one_by_one || !ex) {
            if (!drop || strcmp(drop, t.name)) rc = gdn_st_writer_add_f32(wr, t.name, GDN_F32, t.ndim, t.shape, w + t.offset);
            continue;
        }
        const int down = strstr(ex, "down_proj") != NULL;
        for (int64_t e = 0; !rc && e < c->n_experts; e++)
            for (int k = 0; !rc && k < (down ? 1 : 2); k++) {
                snprintf(name, sizeof name, "%.*sexperts.%lld.%s.weight", (int)(ex - t.name) + 4, t.name, (long long)e,
                         down ? "down_proj" : k ? "up_proj" : "gate_proj");
                const int64_t shape[2] = {down ? E : I, down ? I : E};
                const float *src = w + t.offset + (size_t)e * (down ? 1 : 2) * (size_t)(I * E) + (size_t)k * (size_t)(I * E);
                if (!drop || strcmp(drop, name)) rc = gdn_st_writer_add_f32(wr, name, GDN_F32, 2, shape, src);
            }
    }
    if (!rc && extra) {
        float *z = falloc(extra_shape[0] * extra_shape[1]);
        rc = gdn_st_writer_add_f32(wr, extra, GDN_F32, 2, extra_shape, z);
        free(z);
    }
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    if (!rc) rc = gdn_st_writer_save(wr, path);
    gdn_st_writer_destroy(wr);
    return rc;
}

static void remove_ckpt(const char *dir) {
    char path[600];
    snprintf(path, sizeof path, "%s/config.json", dir), unlink(path);
    snprintf(path, sizeof path, "%s/model.safetensors", dir), unlink(path);
    rmdir(dir);
}

/* The experts on disk fused and one by one load the same weights (bit for bit, so the same
 * model); gdncp's own checkpoint (gdn_ckpt_save) reads back as the same configuration and
 * weights. Refused, naming the tensor: an expert missing, one misshaped, both layouts at once. */
static void test_moe_layouts(const model_w *m) {
    const gdn_model_config *c = &m->cfg;
    const size_t nw = gdn_model_param_floats(c);
    float *w = falloc((int64_t)nw);
    char dir[64];
    snprintf(dir, sizeof dir, "/tmp/gdn_moe_XXXXXX");
    if (!mkdtemp(dir)) {
        check(0, "mkdtemp: %s", strerror(errno));
        free(w);
        return;
    }
    gdn_model_config lc;
    for (int one = 0; one < 2; one++) {
        int rc = write_moe_ckpt(dir, c, m->w, one, NULL, NULL, NULL);
        memset(w, 0xff, sizeof(float) * nw);
        if (!rc) rc = gdn_ckpt_load_config(dir, &lc);
        if (!rc) rc = gdn_ckpt_load(dir, &lc, w, NULL, NULL, NULL);
        size_t same = 0;
        gdn_model_tensor_info t;
        for (int i = 0; !rc && i < gdn_model_tensor_count(c); i++) {
            gdn_model_tensor(c, i, &t);
            same += !memcmp(w + t.offset, m->w + t.offset, sizeof(float) * t.numel);
        }
        check(!rc && same == (size_t)gdn_model_tensor_count(c), "MoE tiny, experts %s on disk: every one of the %d "
              "tensors loads bit for bit (status %d %s)", one ? "one by one" : "fused", gdn_model_tensor_count(c), rc,
              rc ? gdn_errmsg() : "");
    }
    /* control: expert 5 of layer 1 shifted to expert 6's place (an index off by one) is not the same model */
    {
        float *ws = falloc((int64_t)nw);
        memcpy(ws, m->w, sizeof(float) * nw);
        gdn_model_tensor_info t;
        for (int i = 0; i < gdn_model_tensor_count(c); i++) {
            gdn_model_tensor(c, i, &t);
            if (strstr(t.name, "layers.1.mlp.experts.gate_up_proj")) {
                const size_t per = t.numel / (size_t)c->n_experts;
                memcpy(ws + t.offset + 6 * per, m->w + t.offset + 5 * per, sizeof(float) * per);
            }
        }
        size_t differ = 0;
        for (size_t i = 0; i < nw; i++) differ += ws[i] != m->w[i];
        check(differ > 0, "control: an expert index off by one changes %zu weights", differ);
        free(ws);
    }
    const int64_t shape_ok[2] = {c->moe_I, c->E}, shape_bad[2] = {c->moe_I + 1, c->E};
    const struct {
        const char *what, *drop, *extra;
        const int64_t *shape;
        int want;
        const char *needle;
    } bad[] = {
        {"an expert's up_proj missing", "model.layers.1.mlp.experts.5.up_proj.weight", NULL, NULL, GDN_ERR_MISSING,
         "model.layers.1.mlp.experts.5.up_proj.weight"},
        {"the router missing", "model.layers.2.mlp.gate.weight", NULL, NULL, GDN_ERR_MISSING, "model.layers.2.mlp.gate.weight"},
        {"an expert beyond num_experts", NULL, "model.layers.0.mlp.experts.8.gate_proj.weight", shape_ok, GDN_ERR_FORMAT,
         "experts.8.gate_proj"},
        {"an expert's gate_proj twice, fused beside one by one", NULL, NULL, NULL, GDN_ERR_FORMAT, "stored twice"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const int fused_and_split = bad[i].needle && !strcmp(bad[i].needle, "stored twice");
        int rc = write_moe_ckpt(dir, c, m->w, !fused_and_split, bad[i].drop,
                                fused_and_split ? "model.layers.0.mlp.experts.0.gate_proj.weight" : bad[i].extra,
                                fused_and_split ? shape_ok : bad[i].shape);
        if (!rc) rc = gdn_ckpt_load(dir, c, w, NULL, NULL, NULL);
        expect_status(rc, bad[i].want, bad[i].needle, "MoE checkpoint with %s: refused naming it", bad[i].what);
    }
    {   /* one expert's down_proj misshaped: replace it by a wider one */
        int rc = write_moe_ckpt(dir, c, m->w, 1, "model.layers.3.mlp.experts.2.gate_proj.weight",
                                "model.layers.3.mlp.experts.2.gate_proj.weight", shape_bad);
        if (!rc) rc = gdn_ckpt_load(dir, c, w, NULL, NULL, NULL);
        expect_status(rc, GDN_ERR_SHAPE, "experts.2.gate_proj", "MoE checkpoint with an expert misshaped [33, 64]: refused "
                      "naming it");
    }
    remove_ckpt(dir);
    /* gdncp's own checkpoint of the MoE model */
    char out[80];
    snprintf(out, sizeof out, "%s.out", dir);
    char ck[600];
    int rc = gdn_ckpt_save(out, 3, c, m->w, NULL, NULL, NULL, 0, GDN_F32);
    if (!rc) rc = gdn_ckpt_resolve(out, ck, sizeof ck);
    if (!rc) rc = gdn_ckpt_load_config(ck, &lc);
    if (!rc) rc = gdn_ckpt_load(ck, &lc, w, NULL, NULL, NULL);
    int same = 0;
    gdn_model_tensor_info t;
    for (int i = 0; !rc && i < gdn_model_tensor_count(c); i++) {
        gdn_model_tensor(c, i, &t);
        same += !memcmp(w + t.offset, m->w + t.offset, sizeof(float) * t.numel);
    }
    check(!rc && gdn_model_moe_layers(&lc) == 4 && lc.n_experts == c->n_experts && lc.top_k == c->top_k &&
              lc.moe_I == c->moe_I && lc.shared_I == c->shared_I && lc.norm_topk == c->norm_topk &&
              lc.router_aux_coef == c->router_aux_coef && gdn_model_param_floats(&lc) == nw &&
              same == gdn_model_tensor_count(c),
          "MoE tiny saved by gdncp reads back as the same configuration and every tensor (status %d %s)", rc,
          rc ? gdn_errmsg() : "");
    char cmd[200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", out);
    if (system(cmd)) check(0, "remove %s", out);
    free(w);
}

void test_model_hybrid(void) {
    model_w m;
    g_dir = TINY;
    if (tiny_load(&m)) return;
    test_dense(&m);
    test_packed_hf(&m);
    test_stock_logits(&m);
    test_decode_hf(&m);
    test_generate_hf(&m);
    test_decode_regions(&m);
    free(m.w);
}

/* The same references of transformers' Qwen3_5MoeForCausalLM (every MLP a sparse MoE block, its
 * experts stored one by one), and the aux loss. */
void test_model_moe(void) {
    model_w m;
    g_dir = MOE_TINY;
    printf("  (checkpoint %s)\n", g_dir);
    if (tiny_load(&m)) return;
    check(gdn_model_moe_layers(&m.cfg) == 4 && m.cfg.n_experts == 8 && m.cfg.top_k == 2 && m.cfg.moe_I == 32 &&
              m.cfg.shared_I == 48 && m.cfg.norm_topk && !m.cfg.router_aux && fabs(m.cfg.router_aux_coef - 0.01) < 1e-12,
          "MoE tiny's config.json: 4 MoE layers of 8 experts, top 2, I 32, shared 48, renormalised, aux off, coef 0.01");
    test_dense(&m);
    test_moe_aux(&m);
    test_moe_layouts(&m);
    test_packed_hf(&m);
    test_decode_hf(&m);
    test_generate_hf(&m);
    free(m.w);
    g_dir = TINY;
}
