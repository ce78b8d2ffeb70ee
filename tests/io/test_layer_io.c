/* Loading one GatedDeltaNet layer's weights from Hugging Face checkpoints (gdn_layer_weights_load):
 * the golden layer_small file (bare names, dims from __metadata__), the transformers-written
 * qwen35_tiny checkpoint (prefix, config.json, F32 and BF16), Qwen3-Next's fused layout built
 * here by an independent interleave (with a plain-concatenation negative control), the
 * gradient writer's round trip, and every user error as a specific status and message. */
#include "harness.h"
#include "tensor_set.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GOLDEN(name) GDN_GOLDEN_DIR "/" name
#define SMALL GOLDEN("layer_small.weights.safetensors")
#define TINY GOLDEN("qwen35_tiny/model.safetensors")
#define TINY_BF16 GOLDEN("qwen35_tiny/model.bf16.safetensors")
#define TINY_CFG GOLDEN("qwen35_tiny/config.json")
#define L0 "model.layers.0.linear_attn."

/* ------------------------------------------------------------ comparisons */

/* Every parameter of lw bitwise equal to the split tensor set s (names without prefix), and the
 * padding between tensors zero. Returns the number of disagreements; prints the first. */
static int compare_split(const gdn_layer_weights *lw, tset *s, const char *what, int verbose) {
    int bad = 0;
    size_t end = 0;
    for (int p = 0; p < GDN_P_COUNT; p++) {
        const size_t off = gdn_layer_param_offset(&lw->cfg, p), n = gdn_layer_param_numel(&lw->cfg, p);
        for (size_t i = end; i < off; i++) bad += lw->w[i] != 0.0f;
        end = off + n;
        tens *t = tset_find(s, gdn_layer_param_name(p));
        if (!t || (size_t)tens_numel(t) != n || memcmp(t->data, lw->w + off, n * sizeof(float))) {
            if (!bad && verbose) printf("      %s: %s differs\n", what, gdn_layer_param_name(p));
            bad++;
        }
    }
    for (size_t i = end; i < gdn_layer_param_floats(&lw->cfg); i++) bad += lw->w[i] != 0.0f;
    return bad;
}

static int dims_are(const gdn_layer_config *c, int64_t E, int64_t Hk, int64_t Hv, int64_t K,
                    int64_t V, int64_t Kc) {
    return c->E == E && c->Hk == Hk && c->Hv == Hv && c->K == K && c->V == V && c->Kc == Kc &&
           c->B == 0 && c->T == 0;
}

/* ------------------------------------------------------------ the cases */

static void golden_small(void) {
    gdn_layer_weights lw;
    tset s;
    int rc = gdn_layer_weights_load(&lw, SMALL, NULL, NULL, NULL);
    expect_status(rc, GDN_OK, NULL, "layer_small: load with dims from __metadata__ only");
    if (rc || tset_load(&s, SMALL, "")) return;
    check(dims_are(&lw.cfg, 64, 2, 4, 32, 16, 4) && lw.cfg.eps == 1e-6f && !lw.fused &&
              lw.dtype == GDN_F32,
          "layer_small: E=64 Hk=2 Hv=4 K=32 V=16 Kc=4 eps=1e-6, B=T=0, split, F32");
    check(compare_split(&lw, &s, "layer_small", 1) == 0,
          "layer_small: all 9 tensors bitwise equal to the file's, padding zero");
    gdn_layer_weights_free(&lw);
    check(lw.w == NULL, "free clears the struct");
    tset_free(&s);
}

static void golden_tiny(void) {
    tset s[3];
    gdn_layer_weights lw[3];
    char prefix[64];
    for (int l = 0; l < 3; l++) {
        snprintf(prefix, sizeof prefix, "model.layers.%d.linear_attn.", l);
        int rc = gdn_layer_weights_load(&lw[l], TINY, TINY_CFG, prefix, NULL);
        expect_status(rc, GDN_OK, NULL, "qwen35_tiny: load %s with config.json", prefix);
        if (rc || tset_load(&s[l], TINY, prefix)) {
            for (int j = 0; j < l; j++) gdn_layer_weights_free(&lw[j]), tset_free(&s[j]);
            return;
        }
        check(dims_are(&lw[l].cfg, 96, 2, 6, 16, 24, 4) && lw[l].cfg.eps == 1e-6f && !lw[l].fused &&
                  lw[l].dtype == GDN_F32,
              "qwen35_tiny layer %d: E=96 Hk=2 Hv=6 K=16 V=24 Kc=4 eps=1e-6, split, F32", l);
        check(compare_split(&lw[l], &s[l], prefix, 1) == 0,
              "qwen35_tiny layer %d: every tensor bitwise equal to the file's, padding zero", l);
    }
    /* Negative control: layer 1's weights through the same comparison against layer 0's file. */
    check(compare_split(&lw[1], &s[0], "layer 1 vs layer 0", 0) == GDN_P_COUNT,
          "negative control: layer 1 loaded weights differ from layer 0's tensors in all 9 tensors");

    gdn_layer_weights bad;
    expect_status(gdn_layer_weights_load(&bad, TINY, TINY_CFG, NULL, NULL), GDN_ERR_MISSING,
                  "prefix 'model.layers.0.linear_attn.'",
                  "qwen35_tiny without a prefix: the bare names are absent (hint names the prefix)");
    check(bad.w == NULL, "failed load leaves w NULL");
    expect_status(gdn_layer_weights_load(&bad, TINY, TINY_CFG, "model.layers.0.linear_attn", NULL),
                  GDN_ERR_MISSING, "in_proj_qkv.weight", "prefix without its trailing dot");
    expect_status(gdn_layer_weights_load(&bad, TINY, TINY_CFG, "model.layers.3.linear_attn.", NULL),
                  GDN_ERR_MISSING, "model.layers.3.linear_attn.", "layer 3 is full attention");

    /* config.json with the fields under text_config (a multimodal Qwen3.5 config). */
    const char *tc = write_text(
        "text_config.json",
        "{\"architectures\": [\"Qwen3_5ForConditionalGeneration\"], \"vision_config\": {\"hidden_size\": 7},"
        " \"text_config\": {\"hidden_size\": 96, \"linear_num_key_heads\": 2, \"linear_key_head_dim\": 16,"
        " \"linear_num_value_heads\": 6, \"linear_value_head_dim\": 24, \"linear_conv_kernel_dim\": 4,"
        " \"rms_norm_eps\": 1e-6}}");
    gdn_layer_weights lt;
    int rc = gdn_layer_weights_load(&lt, TINY, tc, L0, NULL);
    expect_status(rc, GDN_OK, NULL, "qwen35_tiny: config fields under text_config");
    if (!rc) {
        check(dims_are(&lt.cfg, 96, 2, 6, 16, 24, 4) && compare_split(&lt, &s[0], "text_config", 1) == 0,
              "text_config: same dims and weights");
        gdn_layer_weights_free(&lt);
    }

    /* BF16: values are the bf16 rounding of the f32 ones (8 significant bits: |diff| <= 2^-8 |x|). */
    rc = gdn_layer_weights_load(&lt, TINY_BF16, TINY_CFG, L0, NULL);
    expect_status(rc, GDN_OK, NULL, "qwen35_tiny BF16: load layer 0");
    if (!rc) {
        check(lt.dtype == GDN_BF16 && dims_are(&lt.cfg, 96, 2, 6, 16, 24, 4), "BF16: dtype GDN_BF16, same dims");
        /* Negative control: the same BF16 load given layer 1's prefix, through the same check. */
        gdn_layer_weights lt1;
        const int rc1 = gdn_layer_weights_load(&lt1, TINY_BF16, TINY_CFG, "model.layers.1.linear_attn.", NULL);
        double worst = 0.0, worst_ctrl = rc1 ? INFINITY : 0.0;
        const size_t n = gdn_layer_param_floats(&lt.cfg);
        for (size_t i = 0; i < n; i++) {
            const double x = lw[0].w[i], d = fabs(lt.w[i] - x), dc = rc1 ? 0.0 : fabs(lt1.w[i] - x);
            worst = fmax(worst, x != 0.0 ? d / fabs(x) : d != 0.0 ? INFINITY : 0.0);
            worst_ctrl = fmax(worst_ctrl, x != 0.0 ? dc / fabs(x) : dc != 0.0 ? INFINITY : 0.0);
        }
        expect_close(worst, 1.0 / 256, "BF16 layer 0 vs F32 layer 0: max relative difference per element");
        expect_far(worst_ctrl, 1.0 / 256, "BF16 load of layer 1 vs F32 layer 0 through the same check");
        if (!rc1) gdn_layer_weights_free(&lt1);
        gdn_layer_weights_free(&lt);
    }
    for (int l = 0; l < 3; l++) gdn_layer_weights_free(&lw[l]), tset_free(&s[l]);
}

/* Qwen3-Next's fused rows, written here block by block (independently of the loader's per-row map):
 * for each key head h: [q_h (K) | k_h (K) | v of value heads h*r..h*r+r-1 (r*V) | z of those]. */
static void interleave(tset *fused, tset *split, int64_t Hk, int64_t Hv, int64_t K, int64_t V,
                       int64_t E, int plain) {
    const tens *qkv = tset_find(split, "in_proj_qkv.weight"), *z = tset_find(split, "in_proj_z.weight"),
               *b = tset_find(split, "in_proj_b.weight"), *a = tset_find(split, "in_proj_a.weight");
    const int64_t r = Hv / Hk, rows = 2 * Hk * K + 2 * Hv * V, rs = E * (int64_t)sizeof(float);
    const int64_t sq[2] = {rows, E}, sb[2] = {2 * Hv, E};
    tens *t = tset_add(fused, "in_proj_qkvz.weight", 2, sq, NULL);
    tens *u = tset_add(fused, "in_proj_ba.weight", 2, sb, NULL);
    char *dst = (char *)t->data, *dba = (char *)u->data;
    const char *Q = (const char *)qkv->data, *Kp = Q + Hk * K * rs, *Vp = Q + 2 * Hk * K * rs,
               *Z = (const char *)z->data, *B = (const char *)b->data, *A = (const char *)a->data;
    if (plain) { /* the wrong layout: [q; k; v; z] and [b; a] concatenated */
        memcpy(dst, Q, (size_t)((2 * Hk * K + Hv * V) * rs));
        memcpy(dst + (2 * Hk * K + Hv * V) * rs, Z, (size_t)(Hv * V * rs));
        memcpy(dba, B, (size_t)(Hv * rs)), memcpy(dba + Hv * rs, A, (size_t)(Hv * rs));
        return;
    }
    for (int64_t h = 0; h < Hk; h++) {
        memcpy(dst, Q + h * K * rs, (size_t)(K * rs)), dst += K * rs;
        memcpy(dst, Kp + h * K * rs, (size_t)(K * rs)), dst += K * rs;
        memcpy(dst, Vp + h * r * V * rs, (size_t)(r * V * rs)), dst += r * V * rs;
        memcpy(dst, Z + h * r * V * rs, (size_t)(r * V * rs)), dst += r * V * rs;
        memcpy(dba, B + h * r * rs, (size_t)(r * rs)), dba += r * rs;
        memcpy(dba, A + h * r * rs, (size_t)(r * rs)), dba += r * rs;
    }
}

static void fused_copy(tset *dst, tset *src, int plain) {
    memset(dst, 0, sizeof *dst);
    for (int i = 0; i < src->n; i++)
        if (strncmp(src->t[i].name, "in_proj_", 8) || !strcmp(src->t[i].name, "in_proj_qkvz.weight"))
            tset_add(dst, src->t[i].name, src->t[i].ndim, src->t[i].shape, src->t[i].data);
    interleave(dst, src, 2, 6, 16, 24, 96, plain);
}

static void fused(void) {
    tset s, f, fc;
    gdn_layer_weights ls, lf, lc;
    if (tset_load(&s, TINY, L0) || gdn_layer_weights_load(&ls, TINY, TINY_CFG, L0, NULL)) {
        check(0, "fused: read qwen35_tiny layer 0: %s", gdn_errmsg());
        return;
    }
    fused_copy(&f, &s, 0);
    fused_copy(&fc, &s, 1);
    /* An unrelated tensor outside the prefix must be ignored. */
    const int64_t one = 1;
    tset_add(&f, "=model.layers.0.mlp.outside", 1, &one, NULL);
    const char *pf = tmp_path("fused.safetensors");
    int rc = tset_save(&f, pf, L0, NULL, GDN_F32);
    check(rc == GDN_OK, "write a fused (interleaved) copy of layer 0");
    tset_drop(&f, "=model.layers.0.mlp.outside");

    rc = gdn_layer_weights_load(&lf, pf, TINY_CFG, L0, NULL);
    expect_status(rc, GDN_OK, NULL, "fused Qwen3-Next layout: load");
    if (!rc) {
        const size_t n = gdn_layer_param_floats(&ls.cfg);
        check(lf.fused == 1 && lf.dtype == GDN_F32 && dims_are(&lf.cfg, 96, 2, 6, 16, 24, 4) &&
                  gdn_layer_param_floats(&lf.cfg) == n,
              "fused: flagged fused, F32, same dims");
        check(!memcmp(lf.w, ls.w, n * sizeof(float)), "fused load identical to the split load (bitwise)");
        expect_close(rel_err_ff(lf.w, ls.w, (int64_t)n), 0.0, "fused vs split, relative difference");
        /* control: a reader taking the fused rows as concatenated [q;k;v;z], [b;a] (a mutation) */
        test_mutation = "layer io: fused rows read as concatenated (not interleaved)";
        const int crc = gdn_layer_weights_load(&lc, pf, TINY_CFG, L0, NULL);
        test_mutation = NULL;
        if (!crc) {
            expect_far(rel_err_ff(lc.w, ls.w, (int64_t)n), 1e-3,
                       "control: the fused file read as concatenated [q;k;v;z], [b;a] vs split");
            gdn_layer_weights_free(&lc);
        } else {
            check(0, "control: the fused file loads under the mutation: %s", gdn_errmsg());
        }

        /* Gradient writer: the split weights as if gradients, for the fused lw, must come out in
         * the fused file's order under the fused names. */
        gdn_st_writer *wr = NULL;
        gdn_st_writer_create(&wr);
        const char *pg = tmp_path("grads.safetensors");
        rc = gdn_layer_grads_add(wr, &lf, ls.w, "grad.");
        if (!rc) rc = gdn_st_writer_save(wr, pg);
        gdn_st_writer_destroy(wr);
        expect_status(rc, GDN_OK, NULL, "grads_add for the fused checkpoint, saved");
        tset g;
        if (!rc && !tset_load(&g, pg, "grad.")) {
            int same = g.n == f.n;
            for (int i = 0; i < f.n && same; i++) {
                tens *a = &f.t[i], *b = tset_find(&g, a->name);
                same = b && b->ndim == a->ndim && tens_numel(a) == tens_numel(b) &&
                       !memcmp(a->shape, b->shape, sizeof(int64_t) * a->ndim) &&
                       !memcmp(a->data, b->data, sizeof(float) * tens_numel(a));
                if (!same) printf("      grad.%s differs\n", a->name);
            }
            check(same, "grads of fused lw: grad.in_proj_qkvz.weight, grad.in_proj_ba.weight and the "
                        "other 7 equal the fused file's tensors (shapes and values), nothing else");
            /* Negative control: the concatenated tensor through the same comparison. */
            check(memcmp(tset_find(&g, "in_proj_qkvz.weight")->data,
                         tset_find(&fc, "in_proj_qkvz.weight")->data,
                         sizeof(float) * tens_numel(tset_find(&fc, "in_proj_qkvz.weight"))) != 0,
                  "negative control: grad.in_proj_qkvz.weight differs from the plain concatenation");
            tset_free(&g);
        }
        gdn_layer_weights_free(&lf);
    }

    /* Split: grads_add gives back the split file's tensors, under a NULL prefix. */
    gdn_st_writer *wr = NULL;
    gdn_st_writer_create(&wr);
    const char *pg = tmp_path("grads_split.safetensors");
    rc = gdn_layer_grads_add(wr, &ls, ls.w, NULL);
    if (!rc) rc = gdn_st_writer_save(wr, pg);
    gdn_st_writer_destroy(wr);
    gdn_layer_weights lg;
    rc = rc ? rc : gdn_layer_weights_load(&lg, pg, TINY_CFG, NULL, NULL);
    expect_status(rc, GDN_OK, NULL, "grads_add for the split checkpoint, bare names, reloaded");
    if (!rc) {
        check(!lg.fused && compare_split(&lg, &s, "split grads", 1) == 0,
              "split grads round trip: 9 bare-named tensors equal to the checkpoint's");
        gdn_layer_weights_free(&lg);
    }
    expect_status(gdn_layer_grads_add(NULL, &ls, ls.w, ""), GDN_ERR_ARG, NULL, "grads_add NULL writer");

    /* Mixed layouts and a missing fused weight. */
    tens *z = tset_find(&s, "in_proj_z.weight");
    tset_add(&f, "in_proj_z.weight", 2, z->shape, z->data);
    const char *pm = tmp_path("mixed.safetensors");
    gdn_layer_weights bad;
    if (!tset_save(&f, pm, L0, NULL, GDN_F32))
        expect_status(gdn_layer_weights_load(&bad, pm, TINY_CFG, L0, NULL), GDN_ERR_FORMAT,
                      "in_proj_z.weight", "mixed layouts (fused + in_proj_z) named");
    tset_drop(&f, "in_proj_z.weight");
    tset_drop(&f, "in_proj_ba.weight");
    if (!tset_save(&f, pm, L0, NULL, GDN_F32))
        expect_status(gdn_layer_weights_load(&bad, pm, TINY_CFG, L0, NULL), GDN_ERR_MISSING,
                      L0 "in_proj_ba.weight", "fused file without in_proj_ba");

    gdn_layer_weights_free(&ls);
    tset_free(&s), tset_free(&f), tset_free(&fc);
}

/* Write `s` (layer_small's tensors, bare names) with metadata, then load; expect status/needle. */
static void small_case(tset *s, const char *const *meta, const char *config, const gdn_layer_config *given,
                       int want, const char *needle, const char *what) {
    const char *p = tmp_path("case.safetensors");
    gdn_layer_weights lw;
    if (tset_save(s, p, "", meta, GDN_F32)) {
        check(0, "%s: write the test file: %s", what, gdn_errmsg());
        return;
    }
    memset(&lw, 0x5a, sizeof lw);
    const int rc = gdn_layer_weights_load(&lw, p, config, NULL, given);
    expect_status(rc, want, needle, "%s", what);
    if (rc) check(lw.w == NULL, "%s: nothing left allocated", what);
    gdn_layer_weights_free(&lw);
}

static void errors(void) {
    tset s;
    if (tset_load(&s, SMALL, "")) {
        check(0, "errors: read layer_small: %s", gdn_errmsg());
        return;
    }
    static const char *const meta[] = {"E", "64", "Hk", "2", "Hv", "4", "K", "32", "V", "16",
                                       "Kc", "4", "rms_norm_eps", "1e-06", NULL};
    static const char *const meta_noK[] = {"Hv", "4", "V", "16", NULL};
    static const char *const meta_hk4[] = {"Hk", "4", NULL};
    static const char *const meta_badhk[] = {"Hk", "two", NULL};
    small_case(&s, meta, NULL, NULL, GDN_OK, NULL, "control: the rewritten layer_small loads");

    /* Dims from `given` when nothing else states Hk or K. */
    gdn_layer_config given = gdn_layer_config_default(0, 0, 0, 2, 0, 0, 0);
    small_case(&s, meta_noK, NULL, &given, GDN_OK, NULL, "given Hk = 2 (K = 32 from the shapes)");
    given = gdn_layer_config_default(0, 0, 0, 0, 0, 32, 0);
    small_case(&s, meta_noK, NULL, &given, GDN_OK, NULL, "given K = 32 (Hk = 2 from the shapes)");
    small_case(&s, meta_noK, NULL, NULL, GDN_ERR_SHAPE, "linear_num_key_heads",
               "no source for Hk or K: the message names the fields to state");
    given = gdn_layer_config_default(0, 0, 0, 0, 0, 7, 0);
    small_case(&s, meta_noK, NULL, &given, GDN_ERR_SHAPE, "does not divide", "given K = 7 does not divide Hk*K = 64");
    given = gdn_layer_config_default(0, 0, 0, 4, 0, 0, 0);
    small_case(&s, meta, NULL, &given, GDN_ERR_SHAPE, "the given Hk", "given Hk = 4 disagrees with __metadata__ Hk = 2");
    given = gdn_layer_config_default(0, 0, 0, 0, 0, 0, 0);
    given.eps = 1e-5f;
    small_case(&s, meta, NULL, &given, GDN_ERR_SHAPE, "rms_norm_eps", "given eps 1e-5 vs __metadata__ 1e-06");

    /* Config vs metadata vs shapes. Hk=4, K=16 keeps Hk*K = 64: only the metadata can object. */
    const char *c44 = write_text("hk4.json", "{\"linear_num_key_heads\": 4, \"linear_key_head_dim\": 16}");
    small_case(&s, meta, c44, NULL, GDN_ERR_SHAPE, "__metadata__ Hk",
               "config Hk = 4 disagrees with __metadata__ Hk = 2");
    small_case(&s, meta_hk4, NULL, NULL, GDN_OK, NULL, "control: metadata Hk = 4 alone is consistent with the shapes");
    const char *ce = write_text("e.json", "{\"hidden_size\": 65, \"linear_num_key_heads\": 2}");
    small_case(&s, meta_noK, ce, NULL, GDN_ERR_SHAPE, "hidden_size",
               "config hidden_size = 65 disagrees with the shapes (E = 64)");
    const char *cv = write_text("v.json", "{\"linear_value_head_dim\": 32, \"linear_num_key_heads\": 2}");
    small_case(&s, meta_noK, cv, NULL, GDN_ERR_SHAPE, "linear_value_head_dim",
               "config V = 32 disagrees with __metadata__ V = 16");
    const char *ck = write_text("k.json", "{\"linear_key_head_dim\": 8, \"linear_num_key_heads\": 2}");
    small_case(&s, NULL, ck, NULL, GDN_ERR_SHAPE, "linear_key_head_dim",
               "config Hk = 2, K = 8 disagree with the shapes (Hk*K = 64)");
    small_case(&s, meta_badhk, NULL, NULL, GDN_ERR_FORMAT, "Hk = 'two'", "__metadata__ Hk = 'two'");
    const char *ct = write_text("type.json", "{\"linear_num_key_heads\": \"2\"}");
    small_case(&s, meta, ct, NULL, GDN_ERR_FORMAT, "linear_num_key_heads", "config field of the wrong type");
    const char *cm = write_text("malformed.json", "{\"linear_num_key_heads\": 2,");
    small_case(&s, meta, cm, NULL, GDN_ERR_FORMAT, "malformed.json", "malformed config.json");
    const char *cn = write_text("none.json", "{\"vocab_size\": 256}");
    small_case(&s, meta, cn, NULL, GDN_ERR_FORMAT, "linear_num_key_heads", "config.json with no GatedDeltaNet field");
    small_case(&s, meta, "/nonexistent/config.json", NULL, GDN_ERR_IO, "/nonexistent/config.json",
               "config.json that does not exist");

    /* Tensors: missing, extra, bias, mis-shaped. */
    tens *al = tset_find(&s, "A_log");
    float *alog = malloc(sizeof(float) * (size_t)tens_numel(al));
    memcpy(alog, al->data, sizeof(float) * (size_t)tens_numel(al));
    const int64_t hv = al->shape[0];
    tset_drop(&s, "A_log");
    small_case(&s, meta, NULL, NULL, GDN_ERR_MISSING, "'A_log'", "missing weight A_log");
    const int64_t hv1[2] = {hv, 1};
    tset_add(&s, "A_log", 2, hv1, alog);
    small_case(&s, meta, NULL, NULL, GDN_ERR_SHAPE, "A_log", "A_log with 2 dims [Hv, 1]");
    tset_drop(&s, "A_log");
    tset_add(&s, "A_log", 1, &hv, alog);
    free(alog);
    small_case(&s, meta, NULL, NULL, GDN_OK, NULL, "control: A_log put back loads");

    const int64_t one = 1, cd = 192;
    tset_add(&s, "in_proj_x.weight", 1, &one, NULL);
    small_case(&s, meta, NULL, NULL, GDN_ERR_FORMAT, "in_proj_x.weight", "extra weight under the prefix");
    tset_drop(&s, "in_proj_x.weight");
    tset_add(&s, "conv1d.bias", 1, &cd, NULL);
    small_case(&s, meta, NULL, NULL, GDN_ERR_FORMAT, "conv1d.bias", "conv1d.bias present (Qwen has none)");
    tset_drop(&s, "conv1d.bias");

    tens *nw = tset_find(&s, "norm.weight");
    const int64_t v1 = nw->shape[0] + 1;
    float *nd = calloc((size_t)v1, sizeof(float));
    memcpy(nd, nw->data, sizeof(float) * (size_t)nw->shape[0]);
    tset_drop(&s, "norm.weight");
    tset_add(&s, "norm.weight", 1, &v1, nd);
    small_case(&s, meta, NULL, NULL, GDN_ERR_SHAPE, "norm.weight", "norm.weight [V+1] vs __metadata__ V");
    small_case(&s, meta_hk4, NULL, NULL, GDN_ERR_SHAPE, "norm.weight",
               "norm.weight [V+1] with V from the shapes only (disagrees with the projections)");
    tset_drop(&s, "norm.weight");
    const int64_t v0 = v1 - 1;
    tset_add(&s, "norm.weight", 1, &v0, nd);
    free(nd);

    tens *cw = tset_find(&s, "conv1d.weight");
    const int64_t cshape[3] = {cw->shape[0], 2, cw->shape[2] / 2};
    float *cdat = malloc(sizeof(float) * (size_t)tens_numel(cw));
    memcpy(cdat, cw->data, sizeof(float) * (size_t)tens_numel(cw));
    const int64_t cgood[3] = {cw->shape[0], cw->shape[1], cw->shape[2]};
    tset_drop(&s, "conv1d.weight");
    tset_add(&s, "conv1d.weight", 3, cshape, cdat);
    small_case(&s, meta_hk4, NULL, NULL, GDN_ERR_SHAPE, "conv1d.weight", "conv1d.weight [conv_dim, 2, 2]");
    tset_drop(&s, "conv1d.weight");
    tset_add(&s, "conv1d.weight", 3, cgood, cdat);
    free(cdat);
    small_case(&s, meta, NULL, NULL, GDN_OK, NULL, "control: everything restored loads");

    /* Files and arguments. */
    gdn_layer_weights lw;
    expect_status(gdn_layer_weights_load(&lw, "/nonexistent/w.safetensors", NULL, NULL, NULL), GDN_ERR_IO,
                  "/nonexistent/w.safetensors", "weights file that does not exist");
    expect_status(gdn_layer_weights_load(&lw, TINY_CFG, NULL, NULL, NULL), GDN_ERR_FORMAT, "config.json",
                  "a JSON file given as the weights");
    expect_status(gdn_layer_weights_load(NULL, SMALL, NULL, NULL, NULL), GDN_ERR_ARG, NULL, "NULL lw");
    expect_status(gdn_layer_weights_load(&lw, NULL, NULL, NULL, NULL), GDN_ERR_ARG, NULL, "NULL path");
    tset_free(&s);
}

void test_layer_io(void) {
    if (tmp_begin("gdncp_layer_io")) {
        check(0, "mkdtemp for the layer_io suite");
        return;
    }
    golden_small();
    golden_tiny();
    fused();
    errors();
    check(tmp_end() == 0, "temporary directory of the layer_io suite removed");
}
