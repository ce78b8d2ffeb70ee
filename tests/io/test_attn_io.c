/* Loading one gated attention layer's weights (gdn_attn_weights_load): the transformers-written
 * qwen35_tiny checkpoint's layer 3 (prefix, config.json, F32 and BF16; with a negative control),
 * the dims and RoPE settings from each source (config.json at the top or under text_config,
 * rope_parameters / rope_scaling / M-RoPE, __metadata__, `given`, the shapes alone), the gradient
 * writer's round trip, every user error as a specific status and message, and the two readers
 * the attention command needs (gdn_st_read_f32_slice, gdn_st_read_i64_all). */
#include "harness.h"
#include "tensor_set.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GOLDEN(name) GDN_GOLDEN_DIR "/" name
#define TINY GOLDEN("qwen35_tiny/model.safetensors")
#define TINY_BF16 GOLDEN("qwen35_tiny/model.bf16.safetensors")
#define TINY_CFG GOLDEN("qwen35_tiny/config.json")
#define TINY_ATTN_IO GOLDEN("qwen35_tiny/attn.io.safetensors")
#define L3 "model.layers.3.self_attn."

/* Every parameter of aw bitwise equal to the set's tensor of its name, padding zero. Returns the
 * number of tensors (and padding floats) that differ; prints the first when verbose. */
static int compare_attn(const gdn_attn_weights *aw, tset *s, const char *what, int verbose) {
    int bad = 0;
    size_t end = 0;
    for (int p = 0; p < GDN_A_COUNT; p++) {
        const size_t off = gdn_attn_param_offset(&aw->cfg, p), n = gdn_attn_param_numel(&aw->cfg, p);
        for (size_t i = end; i < off; i++) bad += aw->w[i] != 0.0f;
        end = off + n;
        tens *t = tset_find(s, gdn_attn_param_name(p));
        if (!t || (size_t)tens_numel(t) != n || memcmp(t->data, aw->w + off, n * sizeof(float))) {
            if (!bad && verbose) printf("      %s: %s differs\n", what, gdn_attn_param_name(p));
            bad++;
        }
    }
    for (size_t i = end; i < gdn_attn_param_floats(&aw->cfg); i++) bad += aw->w[i] != 0.0f;
    return bad;
}

static int cfg_is(const gdn_attn_config *c, int64_t E, int64_t H, int64_t Hkv, int64_t d, int64_t R, double theta,
                  float eps, int64_t max_position) {
    return c->E == E && c->H == H && c->Hkv == Hkv && c->d == d && c->R == R && c->rope_theta == theta &&
           c->eps == eps && c->max_position == max_position && c->B == 0 && c->T == 0;
}

/* Load `path` (config may be NULL) under prefix; expect status and, on success, nothing else. */
static int load_case(gdn_attn_weights *aw, const char *path, const char *config, const char *prefix,
                     const gdn_attn_config *given, int want, const char *needle, const char *what) {
    memset(aw, 0x5a, sizeof *aw);
    const int rc = gdn_attn_weights_load(aw, path, config, prefix, given);
    expect_status(rc, want, needle, "%s", what);
    if (rc) check(aw->w == NULL, "%s: nothing left allocated", what);
    return rc;
}

static void golden_tiny(void) {
    gdn_attn_weights aw;
    tset s, s0;
    int rc = load_case(&aw, TINY, TINY_CFG, L3, NULL, GDN_OK, NULL, "qwen35_tiny layer 3: load with config.json");
    if (rc || tset_load(&s, TINY, L3)) return;
    check(cfg_is(&aw.cfg, 96, 4, 2, 24, 6, 10000.0, 1e-6f, 32768) && aw.dtype == GDN_F32,
          "qwen35_tiny layer 3: E=96 H=4 Hkv=2 d=24 R=6 (0.25 d) theta=10000 eps=1e-6 max_position=32768, "
          "B=T=0, F32 (got E=%lld H=%lld Hkv=%lld d=%lld R=%lld theta=%g)",
          (long long)aw.cfg.E, (long long)aw.cfg.H, (long long)aw.cfg.Hkv, (long long)aw.cfg.d, (long long)aw.cfg.R,
          aw.cfg.rope_theta);
    check(compare_attn(&aw, &s, "layer 3", 1) == 0, "qwen35_tiny layer 3: all 6 tensors bitwise equal to the file's, "
                                                    "padding zero");
    /* Negative control: q_norm and k_norm swapped in the reference set, through the same check. */
    tens *qn = tset_find(&s, "q_norm.weight"), *kn = tset_find(&s, "k_norm.weight");
    snprintf(qn->name, sizeof qn->name, "k_norm.weight"), snprintf(kn->name, sizeof kn->name, "q_norm.weight");
    check(compare_attn(&aw, &s, "swapped", 0) == 2, "negative control: q_norm/k_norm swapped: exactly 2 tensors differ");
    snprintf(qn->name, sizeof qn->name, "q_norm.weight"), snprintf(kn->name, sizeof kn->name, "k_norm.weight");

    /* Without config.json: the dims from the shapes, R and theta the library's defaults. */
    gdn_attn_weights an;
    if (!load_case(&an, TINY, NULL, L3, NULL, GDN_OK, NULL, "qwen35_tiny layer 3 without config.json")) {
        check(cfg_is(&an.cfg, 96, 4, 2, 24, 6, 1e7, 1e-6f, 0) && compare_attn(&an, &s, "no config", 1) == 0,
              "no config: E, H, Hkv, d from the shapes; R = 6, theta 1e7 (gdn_attn_config_default), no max_position");
        gdn_attn_weights_free(&an);
    }
    gdn_attn_config given;
    memset(&given, 0, sizeof given);
    given.rope_theta = 10000.0, given.R = 8, given.max_position = 4096;
    if (!load_case(&an, TINY, NULL, L3, &given, GDN_OK, NULL, "no config, given theta 10000, R 8, max_position 4096")) {
        check(cfg_is(&an.cfg, 96, 4, 2, 24, 8, 10000.0, 1e-6f, 4096), "given R, theta and max_position are used");
        gdn_attn_weights_free(&an);
    }
    given.R = 0, given.H = 8;
    load_case(&an, TINY, NULL, L3, &given, GDN_ERR_SHAPE, "the given H", "given H = 8 disagrees with q_proj's rows");
    memset(&given, 0, sizeof given);
    given.rope_theta = 1e6;
    load_case(&an, TINY, TINY_CFG, L3, &given, GDN_ERR_SHAPE, "rope_theta",
              "given theta 1e6 disagrees with config.json's rope_parameters.rope_theta 10000");

    /* BF16 checkpoint: the bf16 rounding of the F32 values (|diff| <= 2^-8 |x|). */
    if (!load_case(&an, TINY_BF16, TINY_CFG, L3, NULL, GDN_OK, NULL, "qwen35_tiny BF16: load layer 3")) {
        double worst = 0.0;
        const size_t n = gdn_attn_param_floats(&an.cfg);
        for (size_t i = 0; i < n; i++) {
            const double x = aw.w[i], dd = fabs(an.w[i] - x);
            worst = fmax(worst, x != 0.0 ? dd / fabs(x) : dd != 0.0 ? INFINITY : 0.0);
        }
        check(an.dtype == GDN_BF16 && cfg_is(&an.cfg, 96, 4, 2, 24, 6, 10000.0, 1e-6f, 32768), "BF16: dtype, same cfg");
        expect_close(worst, 1.0 / 256, "BF16 layer 3 vs F32 layer 3: max relative difference per element");
        /* Negative control: the BF16 q_proj read against the F32 k_proj... through the same
         * measure: k_proj's rows as if they were q_proj's first rows. */
        const size_t q = gdn_attn_param_offset(&an.cfg, GDN_A_Q_PROJ), k = gdn_attn_param_offset(&an.cfg, GDN_A_K_PROJ);
        double ctrl = 0.0;
        for (size_t i = 0; i < gdn_attn_param_numel(&an.cfg, GDN_A_K_PROJ); i++) {
            const double x = aw.w[k + i], dd = fabs(an.w[q + i] - x);
            ctrl = fmax(ctrl, x != 0.0 ? dd / fabs(x) : dd != 0.0 ? INFINITY : 0.0);
        }
        expect_far(ctrl, 1.0 / 256, "negative control: BF16 q_proj vs F32 k_proj through the same measure");
        gdn_attn_weights_free(&an);
    }

    /* Prefixes that name no attention layer. */
    load_case(&an, TINY, TINY_CFG, NULL, NULL, GDN_ERR_MISSING, "prefix 'model.layers.3.self_attn.'",
              "no prefix: the bare names are absent, the hint names the prefix");
    load_case(&an, TINY, TINY_CFG, "model.layers.3.self_attn", NULL, GDN_ERR_MISSING, "q_proj.weight",
              "prefix without its trailing dot");
    load_case(&an, TINY, TINY_CFG, "model.layers.0.self_attn.", NULL, GDN_ERR_MISSING, "model.layers.0.self_attn.",
              "layer 0 is linear attention: no self_attn");
    load_case(&an, TINY, TINY_CFG, "model.layers.3.", NULL, GDN_ERR_MISSING, "prefix 'model.layers.3.self_attn.'",
              "the layer's prefix without self_attn.");

    /* Gradients: aw.w written as if gradients under "grad.", reloaded under that prefix. */
    gdn_st_writer *wr = NULL;
    gdn_st_writer_create(&wr);
    const char *pg = tmp_path("attn_grads.safetensors");
    rc = gdn_attn_grads_add(wr, &aw, aw.w, "grad.");
    if (!rc) rc = gdn_st_writer_save(wr, pg);
    gdn_st_writer_destroy(wr);
    expect_status(rc, GDN_OK, NULL, "grads_add under 'grad.', saved");
    if (!rc && !load_case(&an, pg, TINY_CFG, "grad.", NULL, GDN_OK, NULL, "the gradient file reloads under 'grad.'")) {
        gdn_st_file *f = NULL;
        const int count = gdn_st_open(&f, pg) ? -1 : gdn_st_count(f);
        gdn_st_close(f);
        check(count == GDN_A_COUNT && compare_attn(&an, &s, "grads", 1) == 0,
              "gradient round trip: exactly the 6 tensors, names and values of the checkpoint's");
        gdn_attn_weights_free(&an);
    }
    gdn_st_writer_create(&wr);
    rc = gdn_attn_grads_add(wr, &aw, NULL, NULL);
    uint64_t off = 0;
    if (!rc) rc = gdn_st_writer_offset(wr, "o_proj.weight", &off);
    gdn_st_writer_destroy(wr);
    expect_status(rc, GDN_OK, NULL, "grads_add with dw NULL reserves bare-named tensors (o_proj.weight has an offset)");
    expect_status(gdn_attn_grads_add(NULL, &aw, aw.w, ""), GDN_ERR_ARG, NULL, "grads_add NULL writer");

    /* Layer 0's linear-attention tensors loaded as if attention: nothing under its prefix fits. */
    if (!tset_load(&s0, TINY, "model.layers.0.linear_attn.")) {
        const char *p0 = tmp_path("l0_as_attn.safetensors");
        if (!tset_save(&s0, p0, L3, NULL, GDN_F32))
            load_case(&an, p0, TINY_CFG, L3, NULL, GDN_ERR_MISSING, "q_proj.weight",
                      "a GatedDeltaNet layer's tensors under the attention prefix");
        tset_free(&s0);
    }
    gdn_attn_weights_free(&aw);
    check(aw.w == NULL, "free clears the struct");
    tset_free(&s);
}

/* The tiny layer 3's tensors written bare with metadata and loaded with `config` (may be NULL). */
static int bare_case(tset *s, const char *const *meta, const char *config, const gdn_attn_config *given, int want,
                     const char *needle, const char *what, gdn_attn_weights *out) {
    const char *p = tmp_path("case.safetensors");
    if (tset_save(s, p, "", meta, GDN_F32)) {
        check(0, "%s: write the test file: %s", what, gdn_errmsg());
        return -1;
    }
    gdn_attn_weights aw;
    const int rc = load_case(&aw, p, config, NULL, given, want, needle, what);
    if (out && !rc) *out = aw;
    else gdn_attn_weights_free(&aw);
    return rc;
}

/* A config text: the tiny checkpoint's attention fields with `rope` as its RoPE part. */
static const char *config_with(const char *name, const char *fields) {
    char text[2048];
    snprintf(text, sizeof text, "{\"vocab_size\": 256, %s}", fields);
    return write_text(name, text);
}

#define DIMS "\"hidden_size\": 96, \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 24"

static void configs(void) {
    tset s;
    if (tset_load(&s, TINY, L3)) {
        check(0, "configs: read qwen35_tiny layer 3: %s", gdn_errmsg());
        return;
    }
    gdn_attn_weights aw;
    const char *c;
    /* A multimodal config: the text model under text_config, M-RoPE sections (3 pairs = R/2). */
    c = write_text("vl.json",
                   "{\"architectures\": [\"Qwen3_5ForConditionalGeneration\"], \"vision_config\": {\"hidden_size\": 7,"
                   " \"num_heads\": 3}, \"text_config\": {" DIMS ", \"rms_norm_eps\": 1e-6,"
                   " \"max_position_embeddings\": 262144, \"rope_parameters\": {\"mrope_interleaved\": true,"
                   " \"mrope_section\": [1, 1, 1], \"rope_type\": \"default\", \"rope_theta\": 10000000,"
                   " \"partial_rotary_factor\": 0.25}}}");
    if (!bare_case(&s, NULL, c, NULL, GDN_OK, NULL, "text_config with rope_parameters and an M-RoPE section", &aw)) {
        check(cfg_is(&aw.cfg, 96, 4, 2, 24, 6, 1e7, 1e-6f, 262144) && compare_attn(&aw, &s, "vl", 1) == 0,
              "text_config: R = 6, theta 1e7, max_position 262144 from text_config, same weights");
        gdn_attn_weights_free(&aw);
    }
    c = write_text("vl_bad_mrope.json", "{\"text_config\": {" DIMS ", \"rope_parameters\": {\"mrope_section\": [2, 2],"
                                        " \"rope_theta\": 10000}}}");
    bare_case(&s, NULL, c, NULL, GDN_ERR_SHAPE, "mrope_section covers 4", "an M-RoPE section of 4 pairs for R = 6", NULL);
    /* transformers 4.x: theta and the factor at the top level, rope_scaling null or of type mrope */
    c = config_with("v4.json", DIMS ", \"rope_theta\": 500000.0, \"partial_rotary_factor\": 0.5, \"rope_scaling\": null");
    if (!bare_case(&s, NULL, c, NULL, GDN_OK, NULL, "top-level rope_theta 5e5, partial_rotary_factor 0.5", &aw)) {
        check(aw.cfg.R == 12 && aw.cfg.rope_theta == 5e5, "R = int(24 * 0.5) = 12, theta 5e5");
        gdn_attn_weights_free(&aw);
    }
    c = config_with("mrope4.json", DIMS ", \"rope_scaling\": {\"type\": \"mrope\", \"mrope_section\": [1, 2]}");
    if (!bare_case(&s, NULL, c, NULL, GDN_OK, NULL, "rope_scaling of type mrope (3 pairs), no theta: 10000", &aw)) {
        check(aw.cfg.R == 6 && aw.cfg.rope_theta == 10000.0 && aw.cfg.eps == 1e-6f && aw.cfg.max_position == 0,
              "config without theta, factor, eps, max_position: 10000, 0.25, 1e-6, 0");
        gdn_attn_weights_free(&aw);
    }
    c = config_with("nohd.json", "\"hidden_size\": 96, \"num_attention_heads\": 4, \"num_key_value_heads\": 2");
    bare_case(&s, NULL, c, NULL, GDN_OK, NULL, "no head_dim: d = hidden_size / num_attention_heads = 24", NULL);
    c = config_with("nohd8.json", "\"hidden_size\": 96, \"num_attention_heads\": 8");
    bare_case(&s, NULL, c, NULL, GDN_ERR_SHAPE, "hidden_size / num_attention_heads",
              "no head_dim, 8 heads: d = 12 disagrees with q_norm's 24", NULL);

    /* Refusals: each names the field or the tensor. */
    static const struct { const char *file, *fields; int want; const char *needle, *what; } bad[] = {
        {"h8b.json", "\"hidden_size\": 96, \"num_attention_heads\": 8, \"head_dim\": 24", GDN_ERR_SHAPE,
         "num_attention_heads", "num_attention_heads = 8 contradicts q_proj's 192 rows (H = 4)"},
        {"kv4.json", "\"num_key_value_heads\": 4, \"head_dim\": 24", GDN_ERR_SHAPE, "num_key_value_heads",
         "num_key_value_heads = 4 contradicts k_proj's 48 rows"},
        {"e95.json", "\"hidden_size\": 95, \"num_attention_heads\": 4, \"head_dim\": 24", GDN_ERR_SHAPE, "hidden_size",
         "hidden_size = 95 contradicts q_proj's 96 columns"},
        {"d32.json", "\"head_dim\": 32", GDN_ERR_SHAPE, "head_dim", "head_dim = 32 contradicts q_norm's 24"},
        {"f03.json", DIMS ", \"partial_rotary_factor\": 0.3", GDN_ERR_SHAPE, "not even",
         "partial_rotary_factor 0.3: R = int(7.2) = 7 is odd"},
        {"f0.json", DIMS ", \"partial_rotary_factor\": 0", GDN_ERR_SHAPE, "partial_rotary_factor",
         "partial_rotary_factor 0 is out of (0, 1]"},
        {"two.json", DIMS ", \"rope_theta\": 10000, \"rope_parameters\": {\"rope_theta\": 1000000}", GDN_ERR_SHAPE,
         "rope_parameters.rope_theta", "rope_theta at the top and in rope_parameters disagree"},
        {"yarn.json", DIMS ", \"rope_parameters\": {\"rope_type\": \"yarn\", \"factor\": 4}", GDN_ERR_FORMAT, "'yarn'",
         "rope_parameters.rope_type yarn: a scaled RoPE is refused"},
        {"lin.json", DIMS ", \"rope_scaling\": {\"type\": \"linear\", \"factor\": 2}", GDN_ERR_FORMAT, "'linear'",
         "rope_scaling.type linear: refused"},
        {"rpnum.json", DIMS ", \"rope_parameters\": 7", GDN_ERR_FORMAT, "rope_parameters", "rope_parameters not an object"},
        {"theta1.json", DIMS ", \"rope_theta\": 1", GDN_ERR_SHAPE, "rope_theta", "rope_theta 1 (not > 1)"},
        {"thetas.json", DIMS ", \"rope_theta\": \"1e4\"", GDN_ERR_FORMAT, "rope_theta", "rope_theta as a string"},
        {"ms.json", DIMS ", \"rope_parameters\": {\"mrope_section\": [1, \"a\"]}", GDN_ERR_FORMAT, "mrope_section",
         "mrope_section with a string"},
        {"htype.json", "\"num_attention_heads\": 4.5", GDN_ERR_FORMAT, "num_attention_heads",
         "num_attention_heads not an integer"},
        {"eps.json", DIMS ", \"rms_norm_eps\": -1", GDN_ERR_SHAPE, "rms_norm_eps", "rms_norm_eps negative"},
        {"mp.json", DIMS ", \"max_position_embeddings\": 0", GDN_ERR_SHAPE, "max_position_embeddings",
         "max_position_embeddings 0"},
        {"none.json", "\"linear_num_key_heads\": 2", GDN_ERR_FORMAT, "no attention field", "a config without attention fields"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        c = config_with(bad[i].file, bad[i].fields);
        bare_case(&s, NULL, c, NULL, bad[i].want, bad[i].needle, bad[i].what, NULL);
    }
    bare_case(&s, NULL, write_text("malformed.json", "{\"head_dim\": 24,"), NULL, GDN_ERR_FORMAT, "malformed.json",
              "malformed config.json", NULL);
    bare_case(&s, NULL, write_text("array.json", "[1, 2]"), NULL, GDN_ERR_FORMAT, "not a JSON object",
              "config.json that is an array", NULL);
    bare_case(&s, NULL, "/nonexistent/config.json", NULL, GDN_ERR_IO, "/nonexistent/config.json",
              "config.json that does not exist", NULL);

    /* __metadata__ as a source. */
    static const char *const meta_ok[] = {"R", "4", "rope_theta", "500000", "max_position", "1024", NULL};
    if (!bare_case(&s, meta_ok, NULL, NULL, GDN_OK, NULL, "__metadata__ R 4, rope_theta 5e5, max_position 1024", &aw)) {
        check(cfg_is(&aw.cfg, 96, 4, 2, 24, 4, 5e5, 1e-6f, 1024), "the metadata's R, theta and max_position are used");
        gdn_attn_weights_free(&aw);
    }
    static const char *const meta_h8[] = {"H", "8", NULL}, *const meta_dx[] = {"d", "x24", NULL},
                             *const meta_r7[] = {"R", "7", NULL}, *const meta_th[] = {"rope_theta", "1e6", NULL};
    bare_case(&s, meta_h8, NULL, NULL, GDN_ERR_SHAPE, "__metadata__ H", "__metadata__ H = 8 vs the shapes", NULL);
    bare_case(&s, meta_dx, NULL, NULL, GDN_ERR_FORMAT, "d = 'x24'", "__metadata__ d = 'x24'", NULL);
    bare_case(&s, meta_r7, NULL, NULL, GDN_ERR_SHAPE, "rotary dims R = 7", "__metadata__ R = 7 (odd)", NULL);
    bare_case(&s, meta_th, TINY_CFG, NULL, GDN_ERR_SHAPE, "__metadata__ rope_theta",
              "__metadata__ rope_theta 1e6 vs config.json's 10000", NULL);
    tset_free(&s);
}

static void tensors(void) {
    tset s;
    if (tset_load(&s, TINY, L3)) {
        check(0, "tensors: read qwen35_tiny layer 3: %s", gdn_errmsg());
        return;
    }
    bare_case(&s, NULL, TINY_CFG, NULL, GDN_OK, NULL, "control: the bare copy of layer 3 loads", NULL);
    tens *kn = tset_find(&s, "k_norm.weight");
    float knd[24];
    memcpy(knd, kn->data, sizeof knd);
    const int64_t d24 = 24, d23 = 23, d2[2] = {24, 1};
    tset_drop(&s, "k_norm.weight");
    bare_case(&s, NULL, TINY_CFG, NULL, GDN_ERR_MISSING, "'k_norm.weight'", "missing k_norm.weight", NULL);
    tset_add(&s, "k_norm.weight", 1, &d23, knd);
    bare_case(&s, NULL, NULL, NULL, GDN_ERR_SHAPE, "k_norm.weight", "k_norm [23] vs q_norm [24] (no config)", NULL);
    tset_drop(&s, "k_norm.weight");
    tset_add(&s, "k_norm.weight", 2, d2, knd);
    bare_case(&s, NULL, TINY_CFG, NULL, GDN_ERR_SHAPE, "k_norm.weight", "k_norm with 2 dims [24, 1]", NULL);
    tset_drop(&s, "k_norm.weight");
    tset_add(&s, "k_norm.weight", 1, &d24, knd);

    const int64_t b192 = 192, one = 1;
    tset_add(&s, "q_proj.bias", 1, &b192, NULL);
    bare_case(&s, NULL, TINY_CFG, NULL, GDN_ERR_FORMAT, "q_proj.bias", "q_proj.bias present (no biases)", NULL);
    tset_drop(&s, "q_proj.bias");
    tset_add(&s, "rotary_emb.inv_freq", 1, &one, NULL);
    bare_case(&s, NULL, TINY_CFG, NULL, GDN_ERR_FORMAT, "rotary_emb.inv_freq", "an extra tensor under the prefix", NULL);
    tset_drop(&s, "rotary_emb.inv_freq");

    /* Wrong shapes, one tensor at a time (the good one put back after each). */
    static const struct { const char *name; int64_t r, c; const char *needle, *what; } shapes[] = {
        {"q_proj.weight", 190, 96, "not 2*H*d", "q_proj with 190 rows (not a multiple of 2d = 48)"},
        {"q_proj.weight", 96, 96, "num_attention_heads", "q_proj with 96 rows: H = 2 vs the config's 4"},
        {"k_proj.weight", 50, 96, "not Hkv*d", "k_proj with 50 rows"},
        {"v_proj.weight", 72, 96, "v_proj.weight", "v_proj with 72 rows (Hkv d = 48)"},
        {"o_proj.weight", 96, 95, "o_proj.weight", "o_proj [96, 95] (H d = 96)"},
        {"o_proj.weight", 95, 96, "o_proj.weight", "o_proj [95, 96] (E = 96)"},
        {"k_proj.weight", 48, 95, "k_proj.weight", "k_proj with 95 columns (E = 96)"},
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        tens *t = tset_find(&s, shapes[i].name);
        tens keep = *t;
        keep.data = malloc(sizeof(float) * (size_t)tens_numel(t));
        memcpy(keep.data, t->data, sizeof(float) * (size_t)tens_numel(t));
        tset_drop(&s, shapes[i].name);
        const int64_t sh[2] = {shapes[i].r, shapes[i].c};
        tset_add(&s, shapes[i].name, 2, sh, NULL);
        bare_case(&s, NULL, TINY_CFG, NULL, GDN_ERR_SHAPE, shapes[i].needle, shapes[i].what, NULL);
        tset_drop(&s, shapes[i].name);
        tset_add(&s, shapes[i].name, keep.ndim, keep.shape, keep.data);
        free(keep.data);
    }
    bare_case(&s, NULL, TINY_CFG, NULL, GDN_OK, NULL, "control: every tensor restored loads", NULL);

    /* Storage types: F64 on disk reads the same values; an integer weight is refused. */
    const char *p64 = tmp_path("f64.safetensors");
    gdn_attn_weights a64, a32;
    if (!tset_save(&s, p64, L3, NULL, GDN_F64) &&
        !load_case(&a64, p64, TINY_CFG, L3, NULL, GDN_OK, NULL, "F64 copy of layer 3 loads")) {
        check(a64.dtype == GDN_F64 && compare_attn(&a64, &s, "f64", 1) == 0, "F64 on disk: the same fp32 values, dtype F64");
        gdn_attn_weights_free(&a64);
    }
    const char *pi = tmp_path("int.safetensors");
    gdn_st_writer *w = NULL;
    int rc = gdn_st_writer_create(&w);
    for (int i = 0; i < s.n && !rc; i++)
        if (strcmp(s.t[i].name, "q_norm.weight"))
            rc = gdn_st_writer_add_f32(w, s.t[i].name, GDN_F32, s.t[i].ndim, s.t[i].shape, s.t[i].data);
    const int64_t ints[24] = {0};
    if (!rc) rc = gdn_st_writer_add_i64(w, "q_norm.weight", 1, &d24, ints);
    if (!rc) rc = gdn_st_writer_save(w, pi);
    gdn_st_writer_destroy(w);
    if (!rc) load_case(&a32, pi, TINY_CFG, NULL, NULL, GDN_ERR_DTYPE, "I64", "q_norm.weight stored as I64");

    /* Files and arguments. */
    load_case(&a32, "/nonexistent/w.safetensors", NULL, NULL, NULL, GDN_ERR_IO, "/nonexistent/w.safetensors",
              "weights file that does not exist");
    load_case(&a32, TINY_CFG, NULL, NULL, NULL, GDN_ERR_FORMAT, "config.json", "a JSON file given as the weights");
    expect_status(gdn_attn_weights_load(NULL, TINY, NULL, L3, NULL), GDN_ERR_ARG, NULL, "NULL aw");
    expect_status(gdn_attn_weights_load(&a32, NULL, NULL, L3, NULL), GDN_ERR_ARG, NULL, "NULL path");
    gdn_attn_weights_free(NULL);
    tset_free(&s);
}

/* gdn_st_read_f32_slice along dimension 0 and 2, and gdn_st_read_i64_all of 1-D and 2-D ints. */
static void readers(void) {
    gdn_st_file *f = NULL;
    int rc = gdn_st_open(&f, TINY_ATTN_IO);
    expect_status(rc, GDN_OK, NULL, "open attn.io.safetensors");
    if (rc) return;
    float *all = falloc(2 * 150 * 96), *part = falloc(2 * 150 * 96);
    rc = gdn_st_read_f32(f, "x", all, 2 * 150 * 96);
    /* [2,150,96] along axis 2: columns 10..29 of every row */
    if (!rc) rc = gdn_st_read_f32_slice(f, "x", part, 2 * 150 * 20, 2, 10, 20);
    int same = !rc;
    for (int64_t r = 0; r < 300 && same; r++) same = !memcmp(part + r * 20, all + r * 96 + 10, 20 * sizeof(float));
    check(same, "read_f32_slice axis 2: columns [10, 30) of every row of x");
    /* axis 0: batch row 1 */
    rc = gdn_st_read_f32_slice(f, "x", part, 150 * 96, 0, 1, 1);
    check(!rc && !memcmp(part, all + 150 * 96, 150 * 96 * sizeof(float)), "read_f32_slice axis 0: batch row 1 of x");
    check(!rc && memcmp(part, all, 150 * 96 * sizeof(float)), "negative control: batch row 1 differs from row 0");
    /* axis 1 equals read_f32_rows */
    float *rows = falloc(2 * 7 * 96);
    rc = gdn_st_read_f32_slice(f, "x", part, 2 * 7 * 96, 1, 140, 7);
    if (!rc) rc = gdn_st_read_f32_rows(f, "x", rows, 2 * 7 * 96, 140, 7);
    check(!rc && !memcmp(part, rows, 2 * 7 * 96 * sizeof(float)), "read_f32_slice axis 1 == read_f32_rows");
    expect_status(gdn_st_read_f32_slice(f, "x", part, 2 * 150 * 96, 0, 2, 1), GDN_ERR_SHAPE, "along dimension 0",
                  "read_f32_slice past the end of dimension 0");
    expect_status(gdn_st_read_f32_slice(f, "x", part, 2 * 150 * 96, 3, 0, 1), GDN_ERR_SHAPE, "dimension 3",
                  "read_f32_slice of a dimension x does not have");
    expect_status(gdn_st_read_f32_slice(f, "x", part, 10, 0, 0, 1), GDN_ERR_SHAPE, "does not fit",
                  "read_f32_slice into a buffer too small");
    int64_t pos[150], n = 0;
    rc = gdn_st_read_i64_all(f, "position_ids", pos, 150, &n);
    int ramp = !rc && n == 150;
    for (int i = 0; i < 150 && ramp; i++) ramp = pos[i] == i;
    check(ramp, "read_i64_all of the 1-D position_ids: 0..149");
    gdn_st_close(f), free(all), free(part), free(rows);

    const char *p = tmp_path("ints.safetensors");
    const int64_t shape[2] = {2, 3}, vals[6] = {0, 1, 2, 5, 6, 7};
    gdn_st_writer *w = NULL;
    rc = gdn_st_writer_create(&w);
    if (!rc) rc = gdn_st_writer_add_i64(w, "position_ids", 2, shape, vals);
    if (!rc) rc = gdn_st_writer_save(w, p);
    gdn_st_writer_destroy(w);
    if (!rc) rc = gdn_st_open(&f, p);
    if (!rc) {
        int64_t got[6] = {0};
        rc = gdn_st_read_i64_all(f, "position_ids", got, 6, &n);
        check(!rc && n == 6 && !memcmp(got, vals, sizeof vals), "read_i64_all of a [2, 3] I64 tensor, row-major");
        expect_status(gdn_st_read_i64(f, "position_ids", got, 6, &n), GDN_ERR_SHAPE, "1-D",
                      "control: gdn_st_read_i64 still refuses 2 dims");
        expect_status(gdn_st_read_i64_all(f, "position_ids", got, 5, &n), GDN_ERR_SHAPE, "buffer holds 5",
                      "read_i64_all into a buffer of 5");
        gdn_st_close(f);
    } else {
        check(0, "write and open the I64 test file: %s", gdn_errmsg());
    }
}

void test_attn_io(void) {
    if (tmp_begin("gdncp_attn_io")) {
        check(0, "mkdtemp for the attn_io suite");
        return;
    }
    golden_tiny();
    configs();
    tensors();
    readers();
    check(tmp_end() == 0, "temporary directory of the attn_io suite removed");
}
