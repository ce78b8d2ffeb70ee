/* The trainer's files: checkpoints in Hugging Face's Qwen3.5 layout (round trip of weights,
 * moments and state, config.json against transformers' own, every corruption as a specific
 * status and message, pruning, replacement, and kills at every stage of a save never losing the
 * latest complete checkpoint) and the byte-level text data (vetting, splits, positioned reads,
 * the training windows). */
#include "harness.h"

#include "gdncp.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define GOLDEN_TINY GDN_GOLDEN_DIR "/qwen35_tiny"

/* Defined in src/model/checkpoint.c for tests only: called at the stages of a save. */

/* ------------------------------------------------------------ small file helpers */

/* snprintf for paths built from other paths: the buffers are sized far above any path these
 * tests make, and vsnprintf spares the compiler's (here unfounded) truncation warnings. */
static void path_fmt(char *dst, size_t cap, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(dst, cap, fmt, ap);
    va_end(ap);
}

static char base_dir[256];

static const char *tpath(char *buf, const char *rel) {
    path_fmt(buf, 512, "%s/%s", base_dir, rel);
    return buf;
}

static void rm_tree(const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0) return;
    if (S_ISDIR(st.st_mode)) {
        DIR *d = opendir(path);
        char child[1024];
        for (struct dirent *e; d && (e = readdir(d));) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
            path_fmt(child, sizeof child, "%s/%s", path, e->d_name);
            rm_tree(child);
        }
        if (d) closedir(d);
        rmdir(path);
    } else {
        unlink(path);
    }
}

static int write_bytes(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    const size_t k = fwrite(data, 1, n, f);
    return fclose(f) == 0 && k == n ? 0 : -1;
}

static unsigned char *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    const long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc(len > 0 ? (size_t)len + 1 : 1);
    *n = b ? fread(b, 1, (size_t)len, f) : 0;
    fclose(f);
    return b;
}

static int copy_file(const char *from, const char *to) {
    size_t n = 0;
    unsigned char *b = slurp(from, &n);
    const int rc = b ? write_bytes(to, b, n) : -1;
    free(b);
    return rc;
}

static int is_dir(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

/* Entries of dir whose name starts with a dot (other than . and ..). */
static int hidden_entries(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d));)
        n += e->d_name[0] == '.' && strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    if (d) closedir(d);
    return n;
}

/* ------------------------------------------------------------ model arrays */

static gdn_model_config cfg;
static size_t nparam;

/* Largest |a - b| over the parameters of the table (the flat array may hold padding). */
static double table_diff(const float *a, const float *b) {
    double m = 0;
    gdn_model_tensor_info t;
    for (int i = 0; i < gdn_model_tensor_count(&cfg); i++) {
        gdn_model_tensor(&cfg, i, &t);
        for (size_t j = 0; j < t.numel; j++) {
            const double d = fabs((double)a[t.offset + j] - (double)b[t.offset + j]);
            m = d > m || d != d ? d : m;
        }
    }
    return m;
}

static int table_same_bytes(const float *a, const float *b) {
    gdn_model_tensor_info t;
    for (int i = 0; i < gdn_model_tensor_count(&cfg); i++) {
        gdn_model_tensor(&cfg, i, &t);
        if (memcmp(a + t.offset, b + t.offset, t.numel * sizeof(float))) return 0;
    }
    return 1;
}

/* Parameters distinct per step: a fixed random base plus the step. */
static float *params_for(const float *base, int64_t step) {
    float *w = malloc(nparam * sizeof(float));
    for (size_t i = 0; i < nparam; i++) w[i] = base[i] + (float)step;
    return w;
}

/* A model.safetensors for cfg with one deliberate fault (NULL: none), written by the project's
 * writer: drop a tensor, add an unknown one, give one a wrong shape, or a NaN value. */
typedef struct {
    const char *drop, *extra, *bad_shape, *nan_at;
    gdn_dtype dtype;
} variant;

static int write_model_variant(const char *path, const float *w, variant v) {
    gdn_st_writer *wr;
    gdn_st_writer_create(&wr);
    gdn_st_writer_metadata(wr, "format", "pt");
    gdn_model_tensor_info t;
    int rc = GDN_OK;
    for (int i = 0; i < gdn_model_tensor_count(&cfg) && !rc; i++) {
        gdn_model_tensor(&cfg, i, &t);
        if (v.drop && !strcmp(v.drop, t.name)) continue;
        float *copy = malloc((t.numel + 1) * sizeof(float));
        memcpy(copy, w + t.offset, t.numel * sizeof(float));
        if (v.nan_at && !strcmp(v.nan_at, t.name)) copy[t.numel / 2] = NAN;
        int64_t shape[3] = {t.shape[0], t.shape[1], t.shape[2]};
        int ndim = t.ndim;
        if (v.bad_shape && !strcmp(v.bad_shape, t.name)) { /* same count, other shape */
            shape[0] = (int64_t)t.numel, ndim = 1;
        }
        rc = gdn_st_writer_add_f32(wr, t.name, v.dtype, ndim, shape, copy);
        free(copy);
    }
    if (!rc && v.extra) {
        const int64_t shape[1] = {3};
        const float x[3] = {1, 2, 3};
        rc = gdn_st_writer_add_f32(wr, v.extra, GDN_F32, 1, shape, x);
    }
    if (!rc) rc = gdn_st_writer_save(wr, path);
    gdn_st_writer_destroy(wr);
    return rc;
}

/* A checkpoint directory `rel` made of `src`'s config.json, trainer state and optimizer file and
 * a model file with the fault. */
static void make_variant_dir(char *dir, const char *rel, const char *src, const float *w, variant v) {
    char a[1024], b[1024];
    tpath(dir, rel);
    rm_tree(dir);
    mkdir(dir, 0755);
    const char *keep[] = {"config.json", "trainer_state.json", "optimizer.safetensors"};
    for (int i = 0; i < 3; i++) {
        path_fmt(a, sizeof a, "%s/%s", src, keep[i]);
        path_fmt(b, sizeof b, "%s/%s", dir, keep[i]);
        copy_file(a, b);
    }
    path_fmt(b, sizeof b, "%s/model.safetensors", dir);
    const int rc = write_model_variant(b, w, v);
    if (rc) printf("note: writing %s failed: %s\n", b, gdn_errmsg());
}

/* ------------------------------------------------------------ checkpoints */

static float *w_base, *m_base, *v_base;

/* Checkpoint `step` holding the arrays and state of `content` (the step itself, unless a test
 * replaces a step with other contents). */
static int save_as(const char *out, int64_t step, int64_t content, int keep_last) {
    float *w = params_for(w_base, content), *m = params_for(m_base, content), *v = params_for(v_base, content);
    char state[64];
    path_fmt(state, sizeof state, "{\"step\": %lld}", (long long)content);
    const int rc = gdn_ckpt_save(out, step, &cfg, w, m, v, state, keep_last, GDN_F32);
    free(w), free(m), free(v);
    return rc;
}

static int save_step(const char *out, int64_t step, int keep_last) { return save_as(out, step, step, keep_last); }

/* Load dir fully and compare with what save_as(., content) wrote: 1 when every byte matches. */
static int loads_as_step(const char *dir, int64_t step) {
    float *w = calloc(nparam, sizeof(float)), *m = calloc(nparam, sizeof(float)),
          *v = calloc(nparam, sizeof(float));
    char *state = NULL;
    int ok = gdn_ckpt_load(dir, &cfg, w, m, v, &state) == GDN_OK;
    float *we = params_for(w_base, step), *me = params_for(m_base, step), *ve = params_for(v_base, step);
    char want[64];
    path_fmt(want, sizeof want, "{\"step\": %lld}", (long long)step);
    ok = ok && table_same_bytes(w, we) && table_same_bytes(m, me) && table_same_bytes(v, ve) &&
         state && !strcmp(state, want);
    free(w), free(m), free(v), free(we), free(me), free(ve), free(state);
    return ok;
}

static void test_round_trip(void) {
    char out[512], dir[512], dir10[512];
    tpath(out, "run");
    check(save_step(out, 10, 0) == GDN_OK && save_step(out, 20, 0) == GDN_OK,
          "save steps 10 and 20 into %s", out);
    int rc = gdn_ckpt_resolve(out, dir, sizeof dir);
    check(rc == GDN_OK && strstr(dir, "/checkpoint-00000020"), "resolve(out dir) picks the newest: %s", dir);
    rc = gdn_ckpt_resolve(dir, dir10, sizeof dir10);
    check(rc == GDN_OK && !strcmp(dir, dir10), "resolve(a checkpoint dir) is that dir");

    float *w = calloc(nparam, sizeof(float)), *m = calloc(nparam, sizeof(float)),
          *v = calloc(nparam, sizeof(float));
    char *state = NULL;
    rc = gdn_ckpt_load(dir, &cfg, w, m, v, &state);
    float *w20 = params_for(w_base, 20), *m20 = params_for(m_base, 20), *v20 = params_for(v_base, 20);
    check(rc == GDN_OK, "load step 20 (%s)", rc ? gdn_errmsg() : "ok");
    check(table_same_bytes(w, w20) && table_same_bytes(m, m20) && table_same_bytes(v, v20),
          "save then load: weights, exp_avg and exp_avg_sq identical bytes");
    expect_close(table_diff(w, w20), 0.0, "loaded weights vs saved (max abs diff)");
    check(state && !strcmp(state, "{\"step\": 20}"), "trainer_state.json verbatim: %s", state ? state : "(null)");
    free(state);

    /* Negative control: a save that writes the F32 weights rounded to bfloat16 (a mutation of
     * the writer), through the same load and comparison. */
    test_mutation = "ckpt save: F32 tensors written rounded to bfloat16";
    rc = save_step(out, 30, 0);
    test_mutation = NULL;
    path_fmt(dir10, sizeof dir10, "%s/checkpoint-00000030", out);
    if (!rc) rc = gdn_ckpt_load(dir10, &cfg, w, NULL, NULL, NULL);
    float *w30 = params_for(w_base, 30);
    check(rc == GDN_OK, "control: save step 30 through the mutated writer, load it");
    check(!table_same_bytes(w, w30), "control: the weights written rounded are not the saved bytes");
    expect_far(table_diff(w, w30), 1e-6, "control: weights written rounded to bfloat16 vs saved (max abs diff)");
    free(w30);
    rm_tree(dir10);

    /* The file is a Hugging Face checkpoint: F32 tensors under their names, format pt. */
    char p[600];
    path_fmt(p, sizeof p, "%s/model.safetensors", dir);
    gdn_st_file *f = NULL;
    rc = gdn_st_open(&f, p);
    gdn_model_tensor_info t;
    gdn_model_tensor(&cfg, 1, &t);
    const gdn_st_tensor *st = rc ? NULL : gdn_st_find(f, t.name);
    const char *fmt = rc ? NULL : gdn_st_metadata(f, "format");
    check(st && st->dtype == GDN_F32 && st->ndim == t.ndim && gdn_st_count(f) == gdn_model_tensor_count(&cfg) &&
              fmt && !strcmp(fmt, "pt") && gdn_st_find(f, "model.embed_tokens.weight") && gdn_st_find(f, "lm_head.weight"),
          "model.safetensors: %d F32 tensors by Hugging Face name ('%s'), __metadata__ format pt",
          gdn_st_count(f), t.name);
    gdn_st_close(f);
    path_fmt(p, sizeof p, "%s/optimizer.safetensors", dir);
    rc = gdn_st_open(&f, p);
    char name[200];
    path_fmt(name, sizeof name, "exp_avg_sq.%s", t.name);
    check(!rc && gdn_st_find(f, name) && gdn_st_count(f) == 2 * gdn_model_tensor_count(&cfg),
          "optimizer.safetensors: exp_avg.<name> and exp_avg_sq.<name>");
    gdn_st_close(f);

    /* The BF16 form of the same weights loads, converted. */
    make_variant_dir(p, "bf16", dir, w20, (variant){.dtype = GDN_BF16});
    rc = gdn_ckpt_load(p, &cfg, w, NULL, NULL, NULL);
    check(rc == GDN_OK, "a BF16 model.safetensors loads (%s)", rc ? gdn_errmsg() : "ok");
    double rel = 0;
    for (int i = 0; i < gdn_model_tensor_count(&cfg); i++) {
        gdn_model_tensor(&cfg, i, &t);
        for (size_t j = 0; j < t.numel; j++) {
            const double d = fabs(w[t.offset + j] - w20[t.offset + j]) / fabs(w20[t.offset + j]);
            rel = d > rel ? d : rel;
        }
    }
    expect_close(rel, 1.0 / 256, "BF16 weights vs F32 (max relative error, half a BF16 ulp)");
    float *w10 = params_for(w_base, 10);
    expect_far(table_diff(w, w10), 0.1, "BF16 of step 20 vs step 10's weights");

    /* Without optimizer.safetensors: the weights load, the moments are refused. */
    path_fmt(name, sizeof name, "%s/optimizer.safetensors", p);
    unlink(name);
    expect_status(gdn_ckpt_load(p, &cfg, w, m, v, NULL), GDN_ERR_IO, "optimizer.safetensors",
                  "load with moments, optimizer.safetensors missing");
    expect_status(gdn_ckpt_load(p, &cfg, w, NULL, NULL, NULL), GDN_OK, NULL,
                  "... the same directory without moments loads");
    free(w), free(m), free(v), free(w20), free(m20), free(v20), free(w10);
}

static void test_config(void) {
    char out[512], dir[512], p[700];
    tpath(out, "run");
    path_fmt(dir, sizeof dir, "%s/checkpoint-00000020", out);
    gdn_model_config got;
    memset(&got, 0x55, sizeof got);
    int rc = gdn_ckpt_load_config(dir, &got);
    check(rc == GDN_OK && got.vocab == cfg.vocab && got.E == cfg.E && got.L == cfg.L && got.I == cfg.I &&
              got.Hk == cfg.Hk && got.Hv == cfg.Hv && got.K == cfg.K && got.V == cfg.V &&
              got.Kc == cfg.Kc && got.eps == cfg.eps && got.tie_embeddings == cfg.tie_embeddings,
          "config.json round trip: every field, eps %g exactly", (double)got.eps);

    /* The field set is transformers' (from its own Qwen3.5 config). */
    path_fmt(p, sizeof p, "%s/config.json", dir);
    json_t *ours = json_load_file(p, 0, NULL), *golden = json_load_file(GOLDEN_TINY "/config.json", 0, NULL);
    int same_keys = ours && golden;
    const char *key;
    json_t *val;
    char missing[128] = "", extra[128] = "";
    if (same_keys) {
        json_object_foreach(golden, key, val) if (strcmp(key, "transformers_version") && !json_object_get(ours, key)) {
            same_keys = 0;
            path_fmt(missing, sizeof missing, "%s", key);
        }
        json_object_foreach(ours, key, val) if (!json_object_get(golden, key)) {
            same_keys = 0;
            path_fmt(extra, sizeof extra, "%s", key);
        }
    }
    check(same_keys, "config.json has transformers' field set (missing '%s', extra '%s')", missing, extra);
    /* ... with the same JSON types (an integer stays an integer, null stays null). */
    char retyped[128] = "";
    if (same_keys)
        json_object_foreach(ours, key, val) {
            json_t *g = json_object_get(golden, key);
            const int both_bool = json_is_boolean(val) && json_is_boolean(g);
            if (!both_bool && json_typeof(val) != json_typeof(g)) path_fmt(retyped, sizeof retyped, "%s", key);
        }
    check(same_keys && !retyped[0], "config.json's fields have transformers' JSON types (differs: '%s')", retyped);
    json_t *lt = ours ? json_object_get(ours, "layer_types") : NULL;
    int all_linear = json_is_array(lt) && (int64_t)json_array_size(lt) == cfg.L;
    for (size_t i = 0; all_linear && i < json_array_size(lt); i++)
        all_linear = !strcmp(json_string_value(json_array_get(lt, i)), "linear_attention");
    check(all_linear && !strcmp(json_string_value(json_object_get(ours, "model_type")), "qwen3_5_text") &&
              !strcmp(json_string_value(json_array_get(json_object_get(ours, "architectures"), 0)), "Qwen3_5ForCausalLM") &&
              json_is_null(json_object_get(ours, "bos_token_id")) &&
              json_integer_value(json_object_get(ours, "hidden_size")) == cfg.E,
          "config.json: Qwen3_5ForCausalLM, qwen3_5_text, %lld x linear_attention, bos null", (long long)cfg.L);
    /* The shortest decimal of the fp32 eps, as transformers writes it (not 9.99999997e-07). */
    const double eps_written = json_real_value(json_object_get(ours, "rms_norm_eps"));
    check(eps_written == 1e-6, "rms_norm_eps written as the decimal 1e-6 (%.17g)", eps_written);


    /* Edited copies of our config.json, each refused with the field named. */
    struct { const char *what, *field; json_t *value; int remove; int want; const char *needle; } edits[] = {
        {"vocab_size 0", "vocab_size", json_integer(0), 0, GDN_ERR_SHAPE, "vocab_size' = 0"},
        {"hidden_size missing", "hidden_size", NULL, 1, GDN_ERR_FORMAT, "'hidden_size' is missing"},
        {"hidden_size 64.5", "hidden_size", json_real(64.5), 0, GDN_ERR_FORMAT, "'hidden_size' is not an integer"},
        {"linear_key_head_dim 1000", "linear_key_head_dim", json_integer(1000), 0, GDN_ERR_SHAPE, "linear_key_head_dim' = 1000"},
        {"num_hidden_layers -1", "num_hidden_layers", json_integer(-1), 0, GDN_ERR_SHAPE, "num_hidden_layers' = -1"},
        {"layer_types 3 entries for 2 layers", "layer_types", json_pack("[sss]", "linear_attention", "linear_attention",
         "linear_attention"), 0, GDN_ERR_SHAPE, "'layer_types' has 3 entries but num_hidden_layers is 2"},
        {"a layer of type sliding_attention", "layer_types", json_pack("[ss]", "linear_attention", "sliding_attention"), 0,
         GDN_ERR_FORMAT, "layer 1 is \"sliding_attention\""},
        {"num_experts 8 (MoE)", "num_experts", json_integer(8), 0, GDN_ERR_SHAPE, "'num_experts' = 8"},
        {"rms_norm_eps 0", "rms_norm_eps", json_real(0.0), 0, GDN_ERR_SHAPE, "rms_norm_eps"},
        {"model_type qwen3_5_moe_text (transformers' defaults: 256 experts, 8 per token, 512 wide): loads", "model_type", json_string("qwen3_5_moe_text"), 0, GDN_OK, NULL},
        {"model_type llama", "model_type", json_string("llama"), 0, GDN_ERR_FORMAT, "'model_type' is \"llama\""},
        {"linear_num_value_heads 3 (not a multiple of 2 key heads)", "linear_num_value_heads", json_integer(3), 0,
         GDN_ERR_SHAPE, "config.json"},
    };
    char edir[512];
    tpath(edir, "edited");
    mkdir(edir, 0755);
    path_fmt(p, sizeof p, "%s/config.json", edir);
    for (size_t i = 0; i < sizeof edits / sizeof edits[0]; i++) {
        json_t *copy = json_deep_copy(ours);
        if (edits[i].remove) json_object_del(copy, edits[i].field);
        else json_object_set_new(copy, edits[i].field, edits[i].value);
        json_dump_file(copy, p, JSON_INDENT(2));
        json_decref(copy);
        expect_status(gdn_ckpt_load_config(edir, &got), edits[i].want, edits[i].needle, "config.json with %s",
                      edits[i].what);
    }
    /* A multimodal config keeps the text model under text_config: accepted. */
    json_t *wrapped = json_pack("{s:s, s:O}", "model_type", "qwen3_5", "text_config", ours);
    json_dump_file(wrapped, p, JSON_INDENT(2));
    json_decref(wrapped);
    rc = gdn_ckpt_load_config(edir, &got);
    check(rc == GDN_OK && got.E == cfg.E && got.L == cfg.L, "config.json with the fields under text_config loads");
    write_bytes(p, "{\"hidden_size\": ", 16);
    expect_status(gdn_ckpt_load_config(edir, &got), GDN_ERR_FORMAT, "invalid JSON", "truncated config.json");
    json_decref(ours), json_decref(golden);
}

/* ------------------------------------------------------------ hybrid checkpoints (full attention) */

/* transformers' own config.json field by field (every field but transformers_version, values and
 * JSON types): the first that differs into `first` (empty: none). */
static int config_matches_golden(const char *path, char *first, size_t cap) {
    json_t *ours = json_load_file(path, 0, NULL), *golden = json_load_file(GOLDEN_TINY "/config.json", 0, NULL);
    int same = ours && golden && json_object_size(ours) + 1 == json_object_size(golden);
    path_fmt(first, cap, "%s", same ? "" : "(the field count)");
    const char *key;
    json_t *val;
    if (same)
        json_object_foreach(golden, key, val) if (strcmp(key, "transformers_version") &&
                                                  !json_equal(val, json_object_get(ours, key))) {
            if (same) path_fmt(first, cap, "%s", key);
            same = 0;
        }
    json_decref(ours), json_decref(golden);
    return same;
}

/* transformers' tiny Qwen3.5 (3 GatedDeltaNet layers, then full attention) loads with every field,
 * saves back to transformers' own config.json and the same tensors, and a tied model saves without
 * lm_head. Controls: the layer types shifted by one are seen by the same comparisons. */
static void test_hybrid_round_trip(void) {
    gdn_model_config g, back, shifted;
    int rc = gdn_ckpt_load_config(GOLDEN_TINY, &g);
    check(rc == GDN_OK && g.L == 4 && !g.full_attention[0] && !g.full_attention[1] && !g.full_attention[2] &&
              g.full_attention[3] && gdn_model_attn_layers(&g) == 1 && g.H == 4 && g.Hkv == 2 && g.d == 24 &&
              g.R == 6 && g.rope_theta == 10000.0 && g.max_position == 32768 && !g.tie_embeddings && g.Hk == 2 &&
              g.Hv == 6 && g.K == 16 && g.V == 24 && g.E == 96 && g.I == 192,
          "load_config(transformers' qwen35_tiny): 3 x linear_attention + full_attention, H 4, Hkv 2, d 24, R 6, "
          "theta 1e4 (%s)", rc ? gdn_errmsg() : "ok");
    if (rc) return;
    const size_t nw = gdn_model_param_floats(&g);
    float *w = calloc(nw, sizeof(float)), *w2 = calloc(nw, sizeof(float));
    rc = gdn_ckpt_load(GOLDEN_TINY, &g, w, NULL, NULL, NULL);
    check(rc == GDN_OK, "load transformers' qwen35_tiny model.safetensors: all %d tensors (%s)",
          gdn_model_tensor_count(&g), rc ? gdn_errmsg() : "ok");
    char out[512], dir[700], p[800], first[128];
    tpath(out, "hybrid");
    rc = gdn_ckpt_save(out, 1, &g, w, NULL, NULL, NULL, 0, GDN_F32);
    path_fmt(dir, sizeof dir, "%s/checkpoint-00000001", out);
    path_fmt(p, sizeof p, "%s/config.json", dir);
    check(!rc && config_matches_golden(p, first, sizeof first),
          "the saved config.json is transformers' own, field by field (first difference: '%s')", first);
    memset(&back, 0x55, sizeof back);
    rc = gdn_ckpt_load_config(dir, &back);
    check(!rc && !memcmp(&back, &g, sizeof g), "config round trip: every field (layer types, attention dims, RoPE)");
    rc = gdn_ckpt_load(dir, &g, w2, NULL, NULL, NULL);
    gdn_model_tensor_info t;
    int same = !rc;
    for (int i = 0; same && i < gdn_model_tensor_count(&g); i++)
        gdn_model_tensor(&g, i, &t), same = !memcmp(w + t.offset, w2 + t.offset, sizeof(float) * t.numel);
    check(same, "the saved weights read back bit for bit (%s)", rc ? gdn_errmsg() : "ok");
    /* control: layer 2 full attention instead of 3 */
    shifted = g;
    shifted.full_attention[2] = 1, shifted.full_attention[3] = 0;
    float *ws = calloc(gdn_model_param_floats(&shifted), sizeof(float));
    gdn_model_init(&shifted, ws, 1);
    rc = gdn_ckpt_save(out, 2, &shifted, ws, NULL, NULL, NULL, 0, GDN_F32);
    path_fmt(p, sizeof p, "%s/checkpoint-00000002/config.json", out);
    check(!rc && !config_matches_golden(p, first, sizeof first) && !strcmp(first, "layer_types"),
          "control: the layer types shifted by one differ from transformers' config.json in '%s'", first);
    expect_status(gdn_ckpt_load(GOLDEN_TINY, &shifted, ws, NULL, NULL, NULL), GDN_ERR_SHAPE,
                  "layer 2 is linear_attention but in the model being loaded full_attention",
                  "the tiny's weights into the model with the layer types shifted");
    free(ws);
    /* tied: no lm_head tensor, tie_word_embeddings true */
    gdn_model_config tied = g;
    tied.tie_embeddings = 1;
    check(gdn_model_param_floats(&tied) < nw && gdn_model_tensor_count(&tied) == gdn_model_tensor_count(&g) - 1,
          "a tied model has one tensor less (no lm_head)");
    rc = gdn_ckpt_save(out, 3, &tied, w, NULL, NULL, NULL, 0, GDN_F32);
    path_fmt(dir, sizeof dir, "%s/checkpoint-00000003", out);
    path_fmt(p, sizeof p, "%s/model.safetensors", dir);
    gdn_st_file *f = NULL;
    if (!rc) rc = gdn_st_open(&f, p);
    const int no_head = !rc && !gdn_st_find(f, "lm_head.weight") && gdn_st_find(f, "model.embed_tokens.weight");
    gdn_st_close(f);
    rc = rc ? rc : gdn_ckpt_load_config(dir, &back);
    check(no_head && !rc && back.tie_embeddings && !gdn_ckpt_load(dir, &back, w2, NULL, NULL, NULL),
          "a tied model saves without lm_head.weight, tie_word_embeddings true, and loads back");
    /* no position limit (0): written as transformers' required field, and loads back into itself */
    gdn_model_config unlimited = g;
    unlimited.max_position = 0;
    rc = gdn_ckpt_save(out, 4, &unlimited, w, NULL, NULL, NULL, 0, GDN_F32);
    path_fmt(dir, sizeof dir, "%s/checkpoint-00000004", out);
    check(!rc && !gdn_ckpt_load(dir, &unlimited, w2, NULL, NULL, NULL),
          "a model without a position limit saves and loads back into itself (%s)", rc ? gdn_errmsg() : "ok");
    free(w), free(w2);
}

/* Edited copies of transformers' tiny config.json (its model.safetensors beside it): what loads
 * and what is refused, naming the field or the tensor. */
static void test_hybrid_config_errors(void) {
    gdn_model_config g, got;
    if (gdn_ckpt_load_config(GOLDEN_TINY, &g)) {
        check(0, "load_config(qwen35_tiny): %s", gdn_errmsg());
        return;
    }
    char dir[512], p[700];
    tpath(dir, "hybrid_edit");
    mkdir(dir, 0755);
    path_fmt(p, sizeof p, "%s/model.safetensors", dir);
    copy_file(GOLDEN_TINY "/model.safetensors", p);
    path_fmt(p, sizeof p, "%s/config.json", dir);
    json_t *golden = json_load_file(GOLDEN_TINY "/config.json", 0, NULL);
    float *w = calloc(gdn_model_param_floats(&g) + 4096, sizeof(float));
    /* each edit: fields set (value) or removed (NULL); want_config for load_config, then (when it
     * loads) want_load for the weights under the loaded config */
    struct {
        const char *what, *field;
        json_t *value;
        const char *field2;
        json_t *value2;
        int want_config, want_load;
        const char *needle;
    } edits[] = {
        {"layer_types absent (transformers' default: every 4th layer)", "layer_types", NULL, NULL, NULL, GDN_OK, GDN_OK,
         NULL},
        {"layer_types absent, full_attention_interval 2", "layer_types", NULL, "full_attention_interval",
         json_integer(2), GDN_OK, GDN_ERR_MISSING, "'model.layers.1.self_attn.q_proj.weight' is missing"},
        {"the older top-level RoPE fields", "rope_parameters", NULL, "rope_theta", json_real(10000.0), GDN_OK, GDN_OK,
         NULL},
        {"layer_types of 5 entries", "layer_types",
         json_pack("[sssss]", "linear_attention", "linear_attention", "linear_attention", "full_attention",
                   "full_attention"), NULL, NULL, GDN_ERR_SHAPE, 0, "'layer_types' has 5 entries but num_hidden_layers is 4"},
        {"an unknown layer type", "layer_types",
         json_pack("[ssss]", "linear_attention", "linear_attention", "linear_attention", "mamba"), NULL, NULL,
         GDN_ERR_FORMAT, 0, "layer 3 is \"mamba\""},
        {"head_dim 32 (the weights have 24)", "head_dim", json_integer(32), NULL, NULL, GDN_OK, GDN_ERR_SHAPE,
         "'model.layers.3.self_attn.q_proj.weight' has shape [192, 96]; the configuration needs [256, 96]"},
        {"num_key_value_heads 1 (the weights have 2)", "num_key_value_heads", json_integer(1), NULL, NULL, GDN_OK,
         GDN_ERR_SHAPE, "'model.layers.3.self_attn.k_proj.weight' has shape [48, 96]; the configuration needs [24, 96]"},
        {"num_attention_heads 3 with 2 kv heads", "num_attention_heads", json_integer(3), NULL, NULL, GDN_ERR_SHAPE, 0,
         "not a multiple of Hkv = 2"},
        {"head_dim missing", "head_dim", NULL, NULL, NULL, GDN_ERR_FORMAT, 0, "'head_dim' is missing"},
        {"partial_rotary_factor 0.3 (7 rotary dims)", "rope_parameters",
         json_pack("{s:f, s:f, s:s}", "partial_rotary_factor", 0.3, "rope_theta", 10000.0, "rope_type", "default"), NULL,
         NULL, GDN_ERR_SHAPE, 0, "R = 7 must be even"},
        {"rope_type yarn", "rope_parameters",
         json_pack("{s:f, s:f, s:s}", "partial_rotary_factor", 0.25, "rope_theta", 10000.0, "rope_type", "yarn"), NULL,
         NULL, GDN_ERR_FORMAT, 0, "the RoPE type is \"yarn\""},
        {"rope_theta missing", "rope_parameters", json_pack("{s:f, s:s}", "partial_rotary_factor", 0.25, "rope_type",
         "default"), NULL, NULL, GDN_ERR_FORMAT, 0, "'rope_parameters.rope_theta' is missing"},
        {"attention_bias true", "attention_bias", json_true(), NULL, NULL, GDN_ERR_FORMAT, 0, "'attention_bias' must be false"},
        {"num_experts 4 (MoE)", "num_experts", json_integer(4), NULL, NULL, GDN_ERR_SHAPE, 0, "'num_experts' = 4"},
        {"max_position_embeddings 0", "max_position_embeddings", json_integer(0), NULL, NULL, GDN_ERR_SHAPE, 0,
         "'max_position_embeddings' = 0 is out of range"},
    };
    for (size_t i = 0; i < sizeof edits / sizeof edits[0]; i++) {
        json_t *copy = json_deep_copy(golden);
        if (edits[i].value) json_object_set_new(copy, edits[i].field, edits[i].value);
        else json_object_del(copy, edits[i].field);
        if (edits[i].field2) json_object_set_new(copy, edits[i].field2, edits[i].value2);
        if (edits[i].field2 && !strcmp(edits[i].field2, "rope_theta"))
            json_object_set_new(copy, "partial_rotary_factor", json_real(0.25));
        json_dump_file(copy, p, JSON_INDENT(2));
        json_decref(copy);
        const int rc = gdn_ckpt_load_config(dir, &got);
        if (edits[i].want_config) {
            expect_status(rc, edits[i].want_config, edits[i].needle, "config.json: %s", edits[i].what);
            continue;
        }
        check(rc == GDN_OK, "config.json: %s loads (%s)", edits[i].what, rc ? gdn_errmsg() : "ok");
        if (rc) continue;
        if (edits[i].want_load == GDN_OK)
            check(!memcmp(&got, &g, sizeof g) && !gdn_ckpt_load(dir, &got, w, NULL, NULL, NULL),
                  "... as the same model, and its weights load");
        else
            expect_status(gdn_ckpt_load(dir, &got, w, NULL, NULL, NULL), edits[i].want_load, edits[i].needle,
                          "... but not the weights of the unedited model");
    }
    /* nested under text_config (a multimodal Qwen3.5 config): the same model; and its MoE field is named there */
    json_t *wrapped = json_pack("{s:s, s:O}", "model_type", "qwen3_5", "text_config", golden);
    json_dump_file(wrapped, p, JSON_INDENT(2));
    const int rc = gdn_ckpt_load_config(dir, &got);
    check(!rc && !memcmp(&got, &g, sizeof g), "config.json with the fields under text_config: the same model");
    json_object_set_new(json_object_get(wrapped, "text_config"), "num_experts", json_integer(512));
    json_dump_file(wrapped, p, JSON_INDENT(2));
    expect_status(gdn_ckpt_load_config(dir, &got), GDN_ERR_SHAPE, "'text_config.num_experts' = 512",
                  "config.json: text_config.num_experts 512");
    json_decref(wrapped), json_decref(golden);
    free(w);
}

static void test_corrupt(void) {
    char out[512], good[512], p[700], name[700];
    tpath(out, "run");
    path_fmt(good, sizeof good, "%s/checkpoint-00000020", out);
    float *w20 = params_for(w_base, 20), *w = calloc(nparam, sizeof(float)), *m = calloc(nparam, sizeof(float)),
          *v = calloc(nparam, sizeof(float));
    gdn_model_tensor_info t;
    gdn_model_tensor(&cfg, 5, &t);
    const char *some = t.name;
    char some_copy[128];
    path_fmt(some_copy, sizeof some_copy, "%s", some);

    /* Control: the unfaulted variant loads. */
    make_variant_dir(p, "v_ok", good, w20, (variant){.dtype = GDN_F32});
    expect_status(gdn_ckpt_load(p, &cfg, w, m, v, NULL), GDN_OK, NULL, "control: a rewritten model.safetensors loads");

    make_variant_dir(p, "v_missing", good, w20, (variant){.drop = "model.norm.weight"});
    expect_status(gdn_ckpt_load(p, &cfg, w, NULL, NULL, NULL), GDN_ERR_MISSING, "'model.norm.weight' is missing",
                  "model.safetensors without model.norm.weight");
    make_variant_dir(p, "v_extra", good, w20, (variant){.extra = "model.layers.0.self_attn.q_proj.weight"});
    expect_status(gdn_ckpt_load(p, &cfg, w, NULL, NULL, NULL), GDN_ERR_FORMAT,
                  "unexpected tensor 'model.layers.0.self_attn.q_proj.weight'", "model.safetensors with an extra tensor");
    make_variant_dir(p, "v_shape", good, w20, (variant){.bad_shape = some_copy});
    path_fmt(name, sizeof name, "'%s' has shape", some_copy);
    expect_status(gdn_ckpt_load(p, &cfg, w, NULL, NULL, NULL), GDN_ERR_SHAPE, name, "model.safetensors, %s flattened",
                  some_copy);
    make_variant_dir(p, "v_nan", good, w20, (variant){.nan_at = "lm_head.weight"});
    expect_status(gdn_ckpt_load(p, &cfg, w, NULL, NULL, NULL), GDN_ERR_NONFINITE, "'lm_head.weight' holds nan",
                  "model.safetensors with a NaN in lm_head.weight");

    /* Truncated: the header promises more bytes than the file has. */
    make_variant_dir(p, "v_trunc", good, w20, (variant){.dtype = GDN_F32});
    path_fmt(name, sizeof name, "%s/model.safetensors", p);
    size_t n = 0;
    unsigned char *bytes = slurp(name, &n);
    write_bytes(name, bytes, n / 2);
    expect_status(gdn_ckpt_load(p, &cfg, w, NULL, NULL, NULL), GDN_ERR_FORMAT, "model.safetensors",
                  "model.safetensors truncated to %zu of %zu bytes", n / 2, n);
    write_bytes(name, bytes, 5);
    expect_status(gdn_ckpt_load(p, &cfg, w, NULL, NULL, NULL), GDN_ERR_FORMAT, "too short",
                  "model.safetensors truncated to 5 bytes");
    memset(bytes + 8, '#', 16); /* the header's JSON */
    write_bytes(name, bytes, n);
    expect_status(gdn_ckpt_load(p, &cfg, w, NULL, NULL, NULL), GDN_ERR_FORMAT, "header JSON is invalid",
                  "model.safetensors with a corrupt header");
    free(bytes);

    /* The optimizer file of another configuration (no exp_avg_sq) is refused. */
    make_variant_dir(p, "v_optim", good, w20, (variant){.dtype = GDN_F32});
    path_fmt(name, sizeof name, "%s/optimizer.safetensors", p);
    gdn_st_writer *wr;
    gdn_st_writer_create(&wr);
    char tn[200];
    for (int i = 0; i < gdn_model_tensor_count(&cfg); i++) {
        gdn_model_tensor(&cfg, i, &t);
        path_fmt(tn, sizeof tn, "exp_avg.%s", t.name);
        gdn_st_writer_add_f32(wr, tn, GDN_F32, t.ndim, t.shape, w20 + t.offset);
    }
    gdn_st_writer_save(wr, name);
    gdn_st_writer_destroy(wr);
    gdn_model_tensor(&cfg, 0, &t);
    path_fmt(tn, sizeof tn, "'exp_avg_sq.%s' is missing", t.name);
    expect_status(gdn_ckpt_load(p, &cfg, w, m, v, NULL), GDN_ERR_MISSING, tn, "optimizer.safetensors without exp_avg_sq");

    /* A checkpoint of another size is refused by shape (the caller's configuration differs). */
    gdn_model_config other = cfg;
    other.I = cfg.I + 8;
    float *big = calloc(gdn_model_param_floats(&other), sizeof(float));
    char needle[64];
    path_fmt(needle, sizeof needle, "intermediate_size is %lld", (long long)cfg.I);
    expect_status(gdn_ckpt_load(good, &other, big, NULL, NULL, NULL), GDN_ERR_SHAPE, needle,
                  "load a checkpoint with intermediate_size %lld into a %lld model", (long long)cfg.I, (long long)other.I);
    other = cfg, other.eps = 1e-5f;
    expect_status(gdn_ckpt_load(good, &other, w, NULL, NULL, NULL), GDN_ERR_SHAPE, "rms_norm_eps is 1e-06",
                  "load a checkpoint with rms_norm_eps 1e-6 into a model with 1e-5");
    /* The same tensors under a config.json of another size: the shapes are checked too. */
    make_variant_dir(p, "v_cfg", good, w20, (variant){.dtype = GDN_F32});
    path_fmt(name, sizeof name, "%s/config.json", p);
    json_t *edited = json_load_file(name, 0, NULL);
    json_object_set_new(edited, "intermediate_size", json_integer(other.I = cfg.I + 8));
    json_dump_file(edited, name, JSON_INDENT(2));
    json_decref(edited);
    other.eps = cfg.eps;
    expect_status(gdn_ckpt_load(p, &other, big, NULL, NULL, NULL), GDN_ERR_SHAPE, "mlp.gate_proj.weight' has shape",
                  "model.safetensors of intermediate_size %lld under a config.json of %lld", (long long)cfg.I,
                  (long long)other.I);
    free(big);

    /* trainer_state.json missing: named. */
    char *state = NULL;
    make_variant_dir(p, "v_state", good, w20, (variant){.dtype = GDN_F32});
    path_fmt(name, sizeof name, "%s/trainer_state.json", p);
    unlink(name);
    expect_status(gdn_ckpt_load(p, &cfg, w, NULL, NULL, &state), GDN_ERR_IO, "trainer_state.json",
                  "trainer_state.json missing");
    check(state == NULL, "... and no state returned");
    free(w20), free(w), free(m), free(v);
}

static void test_save_errors(void) {
    char p[512], out[512];
    float *w = params_for(w_base, 1);
    expect_status(gdn_ckpt_save(tpath(p, "no/such/parent"), 1, &cfg, w, NULL, NULL, NULL, 0, GDN_F32), GDN_ERR_IO,
                  "parent directory does not exist", "save into a directory whose parent is missing");
    write_bytes(tpath(p, "a_file"), "x", 1);
    expect_status(gdn_ckpt_save(p, 1, &cfg, w, NULL, NULL, NULL, 0, GDN_F32), GDN_ERR_IO, "not a directory",
                  "save into a path that is a file");
    expect_status(gdn_ckpt_save(tpath(out, "run_err"), 1, &cfg, w, NULL, NULL, "{\"step\": ", 0, GDN_F32), GDN_ERR_ARG,
                  "not JSON", "save with a trainer state that is not JSON");
    check(save_step(out, 3, 0) == GDN_OK, "a good checkpoint (step 3) in %s", out);
    gdn_model_tensor_info t;
    gdn_model_tensor(&cfg, 7, &t);
    w[t.offset + 1] = INFINITY;
    char needle[160];
    path_fmt(needle, sizeof needle, "'%s' holds inf", t.name);
    expect_status(gdn_ckpt_save(out, 4, &cfg, w, NULL, NULL, NULL, 1, GDN_F32), GDN_ERR_NONFINITE, needle,
                  "save refuses non-finite weights");
    char dir[512];
    const int rc = gdn_ckpt_resolve(out, dir, sizeof dir);
    check(rc == GDN_OK && strstr(dir, "checkpoint-00000003") && loads_as_step(dir, 3),
          "... and the good checkpoint is untouched (not pruned)");
    expect_status(gdn_ckpt_resolve(tpath(p, "nothing_here"), dir, sizeof dir), GDN_ERR_IO, "nothing_here",
                  "resolve a path that does not exist");
    mkdir(tpath(p, "empty_out"), 0755);
    expect_status(gdn_ckpt_resolve(p, dir, sizeof dir), GDN_ERR_MISSING, "no complete checkpoint",
                  "resolve an output directory without checkpoints");
    expect_status(gdn_ckpt_save(out, -1, &cfg, w, NULL, NULL, NULL, 0, GDN_F32), GDN_ERR_ARG, "negative", "save step -1");
    free(w);
}

static void test_keep_and_replace(void) {
    char out[512], dir[512], p[700];
    tpath(out, "keep");
    int rc = GDN_OK;
    for (int s = 1; s <= 5 && !rc; s++) rc = save_step(out, s, 3);
    int present[6] = {0};
    for (int s = 1; s <= 5; s++) {
        path_fmt(p, sizeof p, "%s/checkpoint-%08d", out, s);
        present[s] = is_dir(p);
    }
    check(rc == GDN_OK && !present[1] && !present[2] && present[3] && present[4] && present[5] &&
              hidden_entries(out) == 0,
          "keep_last 3 after steps 1..5: 3, 4, 5 remain, nothing hidden left");

    /* Leftovers: a complete temporary directory of a dead process and an incomplete
     * checkpoint-N are both ignored by resolve, and the next save removes the former. */
    fflush(stdout);
    const pid_t dead = fork();
    if (dead == 0) _exit(0);
    waitpid(dead, NULL, 0);
    path_fmt(p, sizeof p, "%s/.checkpoint-00000099.tmp-%ld", out, (long)dead);
    char from[700], to[700];
    mkdir(p, 0755);
    path_fmt(from, sizeof from, "%s/checkpoint-00000005/config.json", out);
    path_fmt(to, sizeof to, "%s/config.json", p);
    copy_file(from, to);
    path_fmt(from, sizeof from, "%s/checkpoint-00000005/model.safetensors", out);
    path_fmt(to, sizeof to, "%s/model.safetensors", p);
    copy_file(from, to);
    path_fmt(p, sizeof p, "%s/checkpoint-00000100", out);
    mkdir(p, 0755);
    path_fmt(to, sizeof to, "%s/config.json", p);
    copy_file(tpath(from, "keep/checkpoint-00000005/config.json"), to);
    rc = gdn_ckpt_resolve(out, dir, sizeof dir);
    check(rc == GDN_OK && strstr(dir, "/checkpoint-00000005"),
          "resolve ignores a leftover temporary dir (step 99) and an incomplete checkpoint-00000100: %s", dir);
    rc = save_step(out, 6, 0);
    check(rc == GDN_OK && hidden_entries(out) == 0, "the next save removes the dead process's temporary dir");
    rm_tree(p);

    /* Replacing an existing step: new contents in place, nothing left aside. */
    float *w = params_for(w_base, 77);
    rc = gdn_ckpt_save(out, 6, &cfg, w, NULL, NULL, "{\"replaced\": true}", 0, GDN_F32);
    path_fmt(dir, sizeof dir, "%s/checkpoint-00000006", out);
    float *got = calloc(nparam, sizeof(float));
    char *state = NULL;
    const int lrc = gdn_ckpt_load(dir, &cfg, got, NULL, NULL, &state);
    path_fmt(p, sizeof p, "%s/optimizer.safetensors", dir);
    check(rc == GDN_OK && lrc == GDN_OK && table_same_bytes(got, w) && state && strstr(state, "replaced") &&
              access(p, F_OK) != 0 && hidden_entries(out) == 0,
          "save over an existing step replaces it whole (weights, state, no stale optimizer file)");
    /* control: the same replacement through a writer that rounds the F32 weights (a mutation) */
    test_mutation = "ckpt save: F32 tensors written rounded to bfloat16";
    rc = gdn_ckpt_save(out, 6, &cfg, w, NULL, NULL, "{\"replaced\": true}", 0, GDN_F32);
    test_mutation = NULL;
    const int mrc = rc ? rc : gdn_ckpt_load(dir, &cfg, got, NULL, NULL, NULL);
    check(mrc == GDN_OK && !table_same_bytes(got, w) && table_diff(got, w) > 1e-6,
          "control: a replacement written rounded to bfloat16 is not the weights saved (max diff %g)",
          table_diff(got, w));
    free(w), free(got), free(state);
}

/* ------------------------------------------------------------ kills during a save */

/* At the library's test point of checkpoint stage GDN_TEST_KILL_STAGE ("ckpt save: stage N"). */
static void kill_self(const char *site) {
    const char *want = getenv("GDN_TEST_KILL_STAGE");
    if (want && !strncmp(site, "ckpt save: stage ", 17) && atoi(site + 17) == atoi(want)) raise(SIGKILL);
}

/* A child saving `step` (with the arrays of `content`) is killed with SIGKILL at `stage`; the
 * latest complete checkpoint must still resolve to `expect_step` and load whole, holding
 * `expect_content`. A stage that never comes: the child's save completes. */
static void kill_at_stage(const char *out, int64_t step, int64_t content, int stage, int64_t expect_step,
                          int64_t expect_content, const char *what) {
    fflush(stdout), fflush(stderr);
    const pid_t pid = fork();
    if (pid == 0) {
        char s[8];
        path_fmt(s, sizeof s, "%d", stage);
        setenv("GDN_TEST_KILL_STAGE", s, 1);
        test_point_action = kill_self;
        _exit(save_as(out, step, content, 2) == GDN_OK ? 0 : 1);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    char dir[512], want[64];
    const int rc = gdn_ckpt_resolve(out, dir, sizeof dir);
    path_fmt(want, sizeof want, "checkpoint-%08lld", (long long)expect_step);
    const int as_expected = stage <= 3 ? WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL
                                       : WIFEXITED(st) && WEXITSTATUS(st) == 0;
    check(as_expected && rc == GDN_OK && strstr(dir, want) && loads_as_step(dir, expect_content),
          "kill -9 %s: step %lld resolves (%s) and loads whole with the arrays of %lld", what,
          (long long)expect_step, rc ? gdn_errmsg() : dir, (long long)expect_content);
}

static void test_kills(void) {
    char out[512], p[700];
    tpath(out, "kills");
    check(save_step(out, 1, 2) == GDN_OK && save_step(out, 2, 2) == GDN_OK, "steps 1 and 2 saved");
    kill_at_stage(out, 3, 3, 1, 2, 2, "after step 3's files are written, before the rename");
    kill_at_stage(out, 2, 1002, 2, 2, 2, "while replacing step 2, between moving the old aside and the new in place");
    check(hidden_entries(out) == 2, "... (that kill left the old copy aside and the new one's temporary dir)");
    kill_at_stage(out, 2, 1002, 3, 2, 1002, "while replacing step 2, the new in place and the old not yet removed");
    /* The next save cleans up (the moved-aside copy was put back by the save killed at stage 3,
     * then moved aside again and is now obsolete). */
    check(save_step(out, 4, 0) == GDN_OK, "the next save (step 4) after the kills");
    path_fmt(p, sizeof p, "%s/checkpoint-00000002", out);
    check(hidden_entries(out) == 0 && loads_as_step(p, 1002), "... leaves no hidden leftovers and the new step 2 whole");
    /* Control: the same hook at a stage that never comes lets the save finish. */
    kill_at_stage(out, 5, 5, 9, 5, 5, "never (control: the save completes)");

    /* Kills at arbitrary moments of a stream of saves: whatever resolves loads whole. */
    int good = 0, killed = 0;
    const int trials = 12;
    for (int trial = 0; trial < trials; trial++) {
        fflush(stdout), fflush(stderr);
        const pid_t pid = fork();
        if (pid == 0) {
            for (int64_t s = 10 + trial * 100;; s++) save_step(out, s, 2);
            _exit(0);
        }
        const struct timespec delay = {0, (long)(1 + 7 * trial) * 1000000L};
        nanosleep(&delay, NULL);
        kill(pid, SIGKILL);
        int st = 0;
        waitpid(pid, &st, 0);
        killed += WIFSIGNALED(st);
        char dir[512];
        if (gdn_ckpt_resolve(out, dir, sizeof dir) != GDN_OK) continue;
        const char *digits = strstr(strrchr(dir, '/'), "checkpoint-");
        const int64_t step = digits ? strtoll(digits + strlen("checkpoint-"), NULL, 10) : -1;
        good += loads_as_step(dir, step);
    }
    check(killed == trials && good == trials, "kill -9 at %d arbitrary moments of repeated saves: the latest "
          "checkpoint resolves and loads whole every time (%d of %d)", trials, good, trials);
}

/* ------------------------------------------------------------ data */

/* Do n ids equal n bytes? */
static int ids_are_bytes(const gdn_token *ids, const char *bytes, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] != (gdn_token)(unsigned char)bytes[i]) return 0;
    return 1;
}

static void test_data(void) {
    char p[512];
    gdn_data *d = NULL;
    expect_status(gdn_data_open(&d, tpath(p, "no_such.txt"), 0.1, 256), GDN_ERR_IO, "no_such.txt", "data: missing file");
    write_bytes(tpath(p, "empty.txt"), "", 0);
    expect_status(gdn_data_open(&d, p, 0.1, 256), GDN_ERR_FORMAT, "empty", "data: empty file");
    check(d == NULL, "... no handle");
    expect_status(gdn_data_open(&d, base_dir, 0.1, 256), GDN_ERR_IO, "a directory", "data: a directory");

    /* Text: printable lines with a few tabs and one backspace (old fortune files have those). */
    const int N = 20000;
    char *text = malloc(N);
    for (int i = 0; i < N; i++) text[i] = i % 61 == 60 ? '\n' : i % 97 == 5 ? '\t' : (char)('a' + (i * 7) % 26);
    text[333] = '\b';
    write_bytes(tpath(p, "text.txt"), text, N);
    const double bad_fraction[] = {0.0, 0.6, NAN, -0.1};
    for (int i = 0; i < 4; i++)
        expect_status(gdn_data_open(&d, p, bad_fraction[i], 256), GDN_ERR_ARG, "(0, 0.5]", "data: validation fraction %g",
                      bad_fraction[i]);
    int rc = gdn_data_open(&d, p, 0.1, 256);
    check(rc == GDN_OK && gdn_data_split_len(d, GDN_SPLIT_TRAIN) == 18000 && gdn_data_split_len(d, GDN_SPLIT_VAL) == 2000,
          "data: %d bytes of text split 18000 / 2000 (%s)", N, rc ? gdn_errmsg() : "ok");
    gdn_token buf[128];
    rc = gdn_data_read(d, GDN_SPLIT_VAL, 100, 64, buf);
    check(rc == GDN_OK && ids_are_bytes(buf, text + 18100, 64), "data: validation bytes [100, 164) are the file's [18100, 18164)");
    rc = gdn_data_read(d, GDN_SPLIT_TRAIN, 17936, 64, buf);
    check(rc == GDN_OK && ids_are_bytes(buf, text + 17936, 64), "data: the last 64 training bytes");
    check(rc == GDN_OK && !ids_are_bytes(buf, text + 17937, 64), "data: ... and not the bytes one later (control)");
    expect_status(gdn_data_read(d, GDN_SPLIT_TRAIN, 17937, 64, buf), GDN_ERR_SHAPE, "[17937, 18001) are outside the training split of 18000",
                  "data: a read past the end of the training split");
    expect_status(gdn_data_read(d, GDN_SPLIT_VAL, -1, 4, buf), GDN_ERR_SHAPE, "outside", "data: negative start");
    expect_status(gdn_data_read(d, 2, 0, 4, buf), GDN_ERR_ARG, "split 2", "data: split 2");
    check(gdn_data_read(d, GDN_SPLIT_VAL, 2000, 0, buf) == GDN_OK, "data: an empty read at the end is fine");
    /* The file shrinks under the open handle: a clear error, not garbage. */
    if (truncate(p, 18050) != 0) printf("note: truncate %s: %s\n", p, strerror(errno));
    expect_status(gdn_data_read(d, GDN_SPLIT_VAL, 0, 100, buf), GDN_ERR_IO, "shrink", "data: file truncated after opening");
    gdn_data_close(d);

    /* Binary: a NUL byte, and too many control bytes. */
    text[4321] = 0;
    write_bytes(tpath(p, "nul.bin"), text, N);
    expect_status(gdn_data_open(&d, p, 0.1, 256), GDN_ERR_FORMAT, "NUL byte at offset 4321", "data: a binary file with a NUL");
    text[4321] = 'x';
    for (int i = 1000; i < 1000 + N / 20; i++) text[i] = i % 2 ? 0x01 : 0x1b;
    write_bytes(tpath(p, "ctl.bin"), text, N);
    expect_status(gdn_data_open(&d, p, 0.1, 256), GDN_ERR_FORMAT, "the first 0x08 at offset 333",
                  "data: 5 %% control bytes (names the first)");
    write_bytes(tpath(p, "tiny.txt"), "a", 1);
    expect_status(gdn_data_open(&d, p, 0.5, 256), GDN_ERR_SHAPE, "too few", "data: a 1-byte file cannot be split");
    free(text);

    /* Windows: in range, deterministic, spread over the text. */
    expect_status((int)(gdn_data_window(1, 0, 0, 900, 901) == -1 ? GDN_ERR_SHAPE : GDN_OK), GDN_ERR_SHAPE,
                  "the text has 900 bytes, a sequence needs 901", "data window longer than the text");
    check(gdn_data_window(1, 0, 0, 900, 900) == 0, "data window as long as the text starts at 0");
    const int64_t len = 100000, win = 257, positions = len - win + 1;
    int in_range = 1, same = 1, swapped_equal = 0, biased_failed = 0;
    enum { BINS = 20, DRAWS = 20000 };
    double hist[BINS] = {0}, biased[BINS] = {0};
    for (int i = 0; i < DRAWS; i++) {
        const int64_t step = i / 8, row = i % 8;
        const int64_t s = gdn_data_window(42, step, row, len, win);
        in_range &= s >= 0 && s <= len - win;
        same &= s == gdn_data_window(42, step, row, len, win);
        swapped_equal += row != step && s == gdn_data_window(42, row, step, len, win);
        hist[s * BINS / positions] += 1;
        /* a broken spread, only the first half: the same draw told the text is half as long */
        const int64_t sb = gdn_data_window(42, step, row, (len + win) / 2, win);
        if (sb >= 0) biased[sb * BINS / positions] += 1;
        else biased_failed = 1;
    }
    check(in_range && same, "data windows: %d draws all in [0, %lld], the same when drawn again", DRAWS,
          (long long)(len - win));
    check(swapped_equal <= 2, "data windows: (step, row) and (row, step) differ (%d equal)", swapped_equal);
    check(gdn_data_window(42, 3, 1, len, win) != gdn_data_window(43, 3, 1, len, win), "data windows depend on the seed");
    double chi = 0, chi_biased = 0;
    const double expect = (double)DRAWS / BINS;
    for (int b = 0; b < BINS; b++) {
        chi += (hist[b] - expect) * (hist[b] - expect) / expect;
        chi_biased += (biased[b] - expect) * (biased[b] - expect) / expect;
    }
    /* 19 degrees of freedom: chi^2 above 43.8 has probability 0.001 for a uniform spread. */
    expect_close(chi, 43.8, "data windows uniform over the text (chi^2, %d bins)", BINS);
    expect_far(biased_failed ? NAN : chi_biased, 43.8, "windows drawn for a text half as long, confined to its first half (chi^2)");
}

/* A BF16 save (gdn_ckpt_save with GDN_BF16): model.safetensors holds BF16 tensors equal to the nearest-even
 * rounding of the weights bit for bit, config.json says "bfloat16"; loading it for inference gives
 * those rounded weights, resuming (the moments) gives the fp32 masters back bit for bit. Controls:
 * the inference load is not the fp32 weights (the rounding happened), and a model file from
 * another save (the weights scaled) beside the same optimizer file is refused by name. */
static void test_bf16_save(void) {
    char out[512], dir[512], path[600];
    tpath(out, "bf16_save");
    float *w = params_for(w_base, 7), *m = params_for(m_base, 7), *v = params_for(v_base, 7);
    int rc = gdn_ckpt_save(out, 7, &cfg, w, m, v, "{\"step\": 7}", 0, GDN_BF16);
    check(rc == GDN_OK, "BF16 save with the moments: %s", rc ? gdn_errmsg() : "ok");
    rc = rc ? rc : gdn_ckpt_resolve(out, dir, sizeof dir);
    if (rc) goto out;
    path_fmt(path, sizeof path, "%s/model.safetensors", dir);
    gdn_st_file *f = NULL;
    long wrong_dtype = 0, differ = 0, rounded = 0;
    gdn_model_tensor_info t;
    if (gdn_st_open(&f, path) == GDN_OK) {
        for (int i = 0; i < gdn_model_tensor_count(&cfg); i++) {
            gdn_model_tensor(&cfg, i, &t);
            const gdn_st_tensor *st = gdn_st_find(f, t.name);
            if (!st || st->dtype != GDN_BF16) {
                wrong_dtype++;
                continue;
            }
            float *got = calloc(t.numel, sizeof(float));
            if (gdn_st_read_f32(f, t.name, got, t.numel) == GDN_OK)
                for (size_t e = 0; e < t.numel; e++) {
                    const uint32_t u = (uint32_t)gdn_st_bf16(w[t.offset + e]) << 16;
                    float r;
                    memcpy(&r, &u, 4);
                    differ += memcmp(&r, &got[e], 4) != 0;
                    rounded += r != w[t.offset + e];
                }
            else
                differ += (long)t.numel;
            free(got);
        }
        gdn_st_close(f);
    } else
        wrong_dtype = -1;
    check(wrong_dtype == 0, "BF16 save: every tensor of model.safetensors is BF16 (%ld are not)", wrong_dtype);
    expect_close((double)differ, 0.0, "BF16 save: model.safetensors = bf16(weights) bit for bit (%ld differ)", differ);
    expect_far((double)rounded, 0.5, "BF16 save control: the rounding changed %ld weights", rounded);
    path_fmt(path, sizeof path, "%s/config.json", dir);
    size_t n = 0;
    char *text = (char *)slurp(path, &n);
    check(text && strstr(text, "\"dtype\": \"bfloat16\""), "BF16 save: config.json says dtype bfloat16");
    free(text);

    float *w2 = calloc(nparam, sizeof(float)), *m2 = calloc(nparam, sizeof(float)), *v2 = calloc(nparam, sizeof(float));
    rc = gdn_ckpt_load(dir, &cfg, w2, m2, v2, NULL);
    check(rc == GDN_OK && table_same_bytes(w2, w) && table_same_bytes(m2, m) && table_same_bytes(v2, v),
          "BF16 save resumed: the fp32 master weights and the moments bit for bit (%s)", rc ? gdn_errmsg() : "ok");
    memset(w2, 0, sizeof(float) * nparam);
    rc = gdn_ckpt_load(dir, &cfg, w2, NULL, NULL, NULL);
    check(rc == GDN_OK && !table_same_bytes(w2, w), "BF16 save loaded for inference: the rounded weights, not the masters");

    /* another save's model file beside this optimizer file */
    for (size_t i = 0; i < nparam; i++) w2[i] = w[i] * 1.5f;
    char out2[512], dir2[512], from[700];
    tpath(out2, "bf16_other");
    rc = gdn_ckpt_save(out2, 7, &cfg, w2, NULL, NULL, NULL, 0, GDN_BF16);
    if (!rc) rc = gdn_ckpt_resolve(out2, dir2, sizeof dir2);
    if (!rc) {
        path_fmt(from, sizeof from, "%s/model.safetensors", dir2);
        path_fmt(path, sizeof path, "%s/model.safetensors", dir);
        copy_file(from, path);
        expect_status(gdn_ckpt_load(dir, &cfg, w2, m2, v2, NULL), GDN_ERR_FORMAT,
                      "come from different saves", "BF16 model file of another save beside the masters: refused");
    } else
        check(0, "BF16 save without moments: %s", gdn_errmsg());
    expect_status(gdn_ckpt_save(out2, 8, &cfg, w, NULL, NULL, NULL, 0, 1), GDN_ERR_ARG, "neither F32",
                  "a save in F64 (not offered) is refused");
    free(w2), free(m2), free(v2);
out:
    free(w), free(m), free(v);
}

void test_train_io(void) {
    if (!gdn_model_config_named("tiny", &cfg)) {
        check(0, "the tiny model configuration exists");
        return;
    }
    /* these tests' GatedDeltaNet-only model: the tiny of before the named sizes became hybrid
     * (E 128, 2 layers, I 384, Hk 2, Hv 4); the hybrid ones have their own tests below */
    cfg.L = 2, cfg.I = 384, cfg.Hk = 2, cfg.Hv = 4;
    gdn_model_set_attention_interval(&cfg, 0);
    path_fmt(base_dir, sizeof base_dir, "/tmp/gdn_train_io_XXXXXX");
    if (!mkdtemp(base_dir)) {
        check(0, "make a scratch directory: %s", strerror(errno));
        return;
    }
    nparam = gdn_model_param_floats(&cfg);
    rng_seed(20240601);
    w_base = random_floats(nparam), m_base = random_floats(nparam), v_base = random_floats(nparam);
    for (size_t i = 0; i < nparam; i++) v_base[i] = fabsf(v_base[i]);
    test_round_trip();
    test_config();
    test_hybrid_round_trip();
    test_hybrid_config_errors();
    test_corrupt();
    test_save_errors();
    test_keep_and_replace();
    test_kills();
    test_data();
    test_bf16_save();
    free(w_base), free(m_base), free(v_base);
    rm_tree(base_dir);
}
