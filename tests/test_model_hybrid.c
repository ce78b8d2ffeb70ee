/* The hybrid language model (GatedDeltaNet and gated full-attention layers) on one rank against
 * transformers' own Qwen3_5ForCausalLM (tests/data/qwen35_tiny, float64 references of the whole
 * model): the loss, the logits and every parameter's gradient, dense and with packed documents,
 * and the stock fp32 logits. Negative controls run through the same comparisons: the layer types
 * shifted by one (the attention layer's weights at layer 2, layer 2's GatedDeltaNet at 3), the
 * attention layer removed (o_proj zero), the packed row run without its documents. */
#include "harness.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gdncp/train.h"

#define TINY GDN_GOLDEN_DIR "/qwen35_tiny"

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
    int rc = gdn_ckpt_load_config(TINY, &m->cfg);
    m->w = rc ? NULL : aligned_alloc(64, sizeof(float) * ((gdn_model_param_floats(&m->cfg) + 15) & ~(size_t)15));
    if (!rc) rc = m->w ? gdn_ckpt_load(TINY, &m->cfg, m->w, NULL, NULL, NULL) : GDN_ERR_NOMEM;
    if (rc) check(0, "load %s: %s", TINY, gdn_errmsg());
    return rc;
}

/* Bytes of an I64 tensor of n values of any rank (gdn_st_read_i64 reads 1-D ones): its bytes
 * straight from the file, after the 8-byte header length and the header. */
static int read_bytes(gdn_st_file *f, const char *path, const char *name, uint8_t *dst, int64_t n) {
    const gdn_st_tensor *t = gdn_st_find(f, name);
    FILE *fp = fopen(path, "rb");
    uint64_t hlen = 0;
    int ok = t && fp && !strcmp(t->dtype_name, "I64") && gdn_st_numel(t) == n && fread(&hlen, 8, 1, fp) == 1 &&
             !fseeko(fp, (off_t)(8 + hlen + t->begin), SEEK_SET);
    for (int64_t i = 0; ok && i < n; i++) {
        int64_t v;
        ok = fread(&v, 8, 1, fp) == 1 && v >= 0 && v <= 255;
        dst[i] = (uint8_t)v;
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
static int run_model(const gdn_model_config *c, const float *w, const uint8_t *tok, int64_t B, int64_t T,
                     double denom, const int64_t *docs, int64_t n_docs, run_out *o) {
    const gdn_model_run r = {.B = B, .T = T, .threads = 0, .check_finite = 1, .pack = docs != NULL};
    gdn_model_plan *p = NULL;
    int64_t targets = 0;
    double ls = 0;
    int rc = gdn_model_plan_create(&p, c, &r, NULL);
    if (!rc && docs) rc = gdn_model_set_docs(p, docs, &n_docs, 0, &targets);
    if (!rc) rc = model_train_step(p, w, o->dw, tok, denom, &ls);
    o->loss = ls / denom;
    uint8_t *in = malloc((size_t)(B * T));
    for (int64_t b = 0; b < B; b++) memcpy(in + b * T, tok + b * (T + 1), (size_t)T);
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
    if (gdn_st_open(&ref, TINY "/model_grads.io.safetensors")) {
        check(0, "open model_grads.io: %s", gdn_errmsg());
        return;
    }
    enum { B = 2, N = 200, V = 256 };
    uint8_t tok[B * N];
    double loss_ref = NAN, *lref = dalloc(B * N * V);
    int bad = read_bytes(ref, TINY "/model_grads.io.safetensors", "input_ids", tok, B * N) || gdn_st_read_f64(ref, "loss", &loss_ref, 1) ||
              gdn_st_read_f64(ref, "logits", lref, (size_t)B * N * V);
    check(!bad, "model_grads.io: input_ids [2, 200], loss, logits");
    const gdn_model_config *c = &m->cfg;
    const size_t nw = gdn_model_param_floats(c);
    run_out o = {0, falloc(B * N * V), falloc((int64_t)nw)}, scratch = {0, falloc(B * N * V), falloc((int64_t)nw)};
    /* the loss and gradient over T = 199 inputs; the logits of all 200 from a plan of T = 200 */
    if (bad || run_model(c, m->w, tok, B, N - 1, B * (N - 1), NULL, 0, &o)) goto out;
    {
        uint8_t tok200[B * (N + 1)];
        for (int b = 0; b < B; b++) memcpy(tok200 + b * (N + 1), tok + b * N, N), tok200[b * (N + 1) + N] = 0;
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
    run_out s = {0, scratch.logits, falloc((int64_t)gdn_model_param_floats(&sc))};
    double *l199 = first_positions(lref, B, N, N - 1, V);
    if (!run_model(&sc, ws, tok, B, N - 1, B * (N - 1), NULL, 0, &s)) {
        expect_far(fabs(s.loss - loss_ref) / fabs(loss_ref), TOL_LOSS, "the layer types shifted by one, loss");
        expect_far(rel_err_f32(s.logits, l199, B * (N - 1) * V), TOL_LOGITS,
                   "the layer types shifted by one, logits (199 positions)");
    }
    free(ws), free(s.dw), free(l199);
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
    if (gdn_st_open(&ref, TINY "/model_packed.io.safetensors")) {
        check(0, "open model_packed.io: %s", gdn_errmsg());
        return;
    }
    enum { N = 131, V = 256 };
    uint8_t tok[N];
    int64_t cu[4] = {0}, ncu = 0;
    double loss_ref = NAN, *lref = dalloc(N * V);
    int bad = read_bytes(ref, TINY "/model_packed.io.safetensors", "input_ids", tok, N) || gdn_st_read_i64(ref, "cu_seqlens", cu, 4, &ncu) || ncu != 4 ||
              gdn_st_read_f64(ref, "loss", &loss_ref, 1) || gdn_st_read_f64(ref, "logits", lref, (size_t)N * V);
    check(!bad && cu[1] == 50 && cu[2] == 51 && cu[3] == 131, "model_packed.io: input_ids [1, 131], cu_seqlens "
          "[0, 50, 51, 131], loss, logits");
    const gdn_model_config *c = &m->cfg;
    const size_t nw = gdn_model_param_floats(c);
    run_out o = {0, falloc(N * V), falloc((int64_t)nw)};
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
    if (gdn_st_open(&ref, TINY "/logits.io.safetensors")) {
        check(0, "open logits.io: %s", gdn_errmsg());
        return;
    }
    enum { N = 135, V = 256 };
    uint8_t tok[N];
    double *lref = dalloc(N * V);
    float *logits = falloc(N * V);
    const int bad = read_bytes(ref, TINY "/logits.io.safetensors", "input_ids", tok, N) || gdn_st_read_f64(ref, "logits", lref, (size_t)N * V);
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

void test_model_hybrid(void) {
    model_w m;
    if (tiny_load(&m)) return;
    test_dense(&m);
    test_packed_hf(&m);
    test_stock_logits(&m);
    free(m.w);
}
