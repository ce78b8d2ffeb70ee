/* The model's weights in every layout transformers writes (src/model/hf_weights.c): transformers'
 * tiny Qwen3.5 rewritten here as the multimodal Qwen3_5ForConditionalGeneration names
 * (model.language_model.*, with a vision tower and an MTP head that are skipped), as dense
 * Qwen3-Next (fused in_proj_qkvz / in_proj_ba built by an independent block interleave; control:
 * plainly concatenated), as two shards with an index, and tied or untied by the weights present.
 * Each loads as the same model with bit-identical weights; every broken variant is refused with a
 * message naming what is wrong. */
#include "harness.h"

#include "gdncp.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define GOLDEN_TINY GDN_GOLDEN_DIR "/qwen35_tiny"

static gdn_model_config G; /* the golden model and its weights */
static float *GW;
static char base[256];

/* One tensor to write: name, shape, data. */
typedef struct {
    char name[200];
    int ndim;
    int64_t shape[3];
    const float *data;
    float *owned;
} entry;

typedef struct {
    entry e[160];
    int n;
} entries;

static entry *add(entries *s, const char *name, int ndim, const int64_t *shape, const float *data) {
    entry *e = &s->e[s->n++];
    memset(e, 0, sizeof *e);
    snprintf(e->name, sizeof e->name, "%s", name);
    e->ndim = ndim;
    memcpy(e->shape, shape, sizeof(int64_t) * (size_t)ndim);
    e->data = data;
    return e;
}
static void entries_free(entries *s) {
    for (int i = 0; i < s->n; i++) free(s->e[i].owned);
    s->n = 0;
}

/* How a variant writes the golden model. */
typedef struct {
    const char *text;  /* "model." or "model.language_model." */
    int fused;         /* Qwen3-Next's fused in_proj_qkvz / in_proj_ba, interleaved per key head */
    int extras;        /* the vision tower and the MTP head's tensors */
    int head;          /* lm_head.weight: 1 the golden head, 0 none, 2 a copy of the embedding, 3 it + 1e-3 */
    const char *foreign; /* an extra tensor's name, or NULL */
    int mixed;         /* layer 0 keeps in_proj_qkv beside its fused tensors */
    int drop_ba;       /* layer 1 without in_proj_ba */
} layout;

/* Qwen3-Next's fused rows of one layer, block by block: per key head h, [q_h | k_h | v and z of
 * its value heads] and [b | a of them]. */
static void fuse(entries *s, const char *lp, const float *qkv, const float *z, const float *b, const float *a) {
    const int64_t Hk = G.Hk, Hv = G.Hv, K = G.K, V = G.V, E = G.E, r = Hv / Hk;
    const int64_t sq[2] = {2 * Hk * K + 2 * Hv * V, E}, sb[2] = {2 * Hv, E};
    char name[200];
    snprintf(name, sizeof name, "%.160sin_proj_qkvz.weight", lp);
    entry *t = add(s, name, 2, sq, NULL);
    snprintf(name, sizeof name, "%.160sin_proj_ba.weight", lp);
    entry *u = add(s, name, 2, sb, NULL);
    float *dq = t->owned = malloc(sizeof(float) * (size_t)(sq[0] * E)), *db = u->owned = malloc(sizeof(float) * (size_t)(sb[0] * E));
    t->data = dq, u->data = db;
    const float *Q = qkv, *Kp = qkv + Hk * K * E, *Vp = qkv + 2 * Hk * K * E;
    for (int64_t h = 0; h < Hk; h++) {
        memcpy(dq, Q + h * K * E, sizeof(float) * (size_t)(K * E)), dq += K * E;
        memcpy(dq, Kp + h * K * E, sizeof(float) * (size_t)(K * E)), dq += K * E;
        memcpy(dq, Vp + h * r * V * E, sizeof(float) * (size_t)(r * V * E)), dq += r * V * E;
        memcpy(dq, z + h * r * V * E, sizeof(float) * (size_t)(r * V * E)), dq += r * V * E;
        memcpy(db, b + h * r * E, sizeof(float) * (size_t)(r * E)), db += r * E;
        memcpy(db, a + h * r * E, sizeof(float) * (size_t)(r * E)), db += r * E;
    }
}

/* The golden model's tensors under the layout's names. */
static void collect(entries *s, const layout *lo) {
    gdn_model_tensor_info t;
    const gdn_layer_config lc = gdn_model_layer_config(&G, 1, 1);
    size_t head_offset = 0;
    for (int i = 0; i < gdn_model_tensor_count(&G); i++) {
        gdn_model_tensor(&G, i, &t);
        if (!strcmp(t.name, "lm_head.weight")) { /* written below */
            head_offset = t.offset;
            continue;
        }
        char name[200];
        if (!strncmp(t.name, "model.", 6)) snprintf(name, sizeof name, "%s%s", lo->text, t.name + 6);
        else snprintf(name, sizeof name, "%s", t.name);
        const char *proj = strstr(name, "linear_attn.in_proj_");
        if (lo->fused && proj) {
            long long l = -1;
            sscanf(strstr(name, "layers.") + 7, "%lld", &l);
            const int keep = lo->mixed && l == 0 && strstr(proj, "in_proj_qkv.");
            if (keep) add(s, name, t.ndim, t.shape, GW + t.offset);
            if (!strstr(proj, "in_proj_qkv.")) continue;
            /* once per layer, at in_proj_qkv */
            const size_t off = gdn_model_layer_offset(&G, l);
            char lp[200];
            snprintf(lp, sizeof lp, "%.*s", (int)(proj - name) + 12, name);
            fuse(s, lp, GW + off + gdn_layer_param_offset(&lc, GDN_P_IN_PROJ_QKV),
                 GW + off + gdn_layer_param_offset(&lc, GDN_P_IN_PROJ_Z), GW + off + gdn_layer_param_offset(&lc, GDN_P_IN_PROJ_B),
                 GW + off + gdn_layer_param_offset(&lc, GDN_P_IN_PROJ_A));
            if (lo->drop_ba && l == 1) free(s->e[--s->n].owned); /* the in_proj_ba just added */
            continue;
        }
        add(s, name, t.ndim, t.shape, GW + t.offset);
    }
    const int64_t hs[2] = {G.vocab, G.E};
    if (lo->head == 1) add(s, "lm_head.weight", 2, hs, GW + head_offset);
    if (lo->head >= 2) {
        entry *h = add(s, "lm_head.weight", 2, hs, NULL);
        h->owned = malloc(sizeof(float) * (size_t)(G.vocab * G.E));
        memcpy(h->owned, GW, sizeof(float) * (size_t)(G.vocab * G.E));
        if (lo->head == 3) h->owned[7] += 1e-3f;
        h->data = h->owned;
    }
    static const float junk[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    const int64_t js[2] = {3, 4};
    if (lo->extras) {
        add(s, "model.visual.patch_embed.proj.weight", 2, js, junk);
        add(s, "model.visual.blocks.0.attn.qkv.weight", 2, js, junk);
        add(s, "mtp.fc.weight", 2, js, junk);
        add(s, "mtp.layers.0.mlp.up_proj.weight", 2, js, junk);
    }
    if (lo->foreign) add(s, lo->foreign, 2, js, junk);
}

static int write_file(const char *path, const entries *s, int from, int step) {
    gdn_st_writer *wr = NULL;
    int rc = gdn_st_writer_create(&wr);
    for (int i = from; i < s->n && !rc; i += step)
        rc = gdn_st_writer_add_f32(wr, s->e[i].name, GDN_F32, s->e[i].ndim, s->e[i].shape, s->e[i].data);
    if (!rc) rc = gdn_st_writer_save(wr, path);
    gdn_st_writer_destroy(wr);
    return rc;
}

static void put_json(const char *path, json_t *j) {
    json_dump_file(j, path, JSON_INDENT(2));
    json_decref(j);
}

/* dir/<name>: a fresh directory under the suite's base. */
static const char *fresh(char *dir, const char *name) {
    snprintf(dir, 400, "%s/%s", base, name);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd)) {}
    mkdir(dir, 0755);
    return dir;
}

/* Write the layout into dir (one file, or `shards` files and an index); config: the golden
 * config.json edited by the caller (taken). */
static int write_variant(const char *dir, const layout *lo, json_t *config, int shards) {
    entries s = {.n = 0};
    collect(&s, lo);
    char p[600];
    snprintf(p, sizeof p, "%s/config.json", dir);
    put_json(p, config);
    int rc = GDN_OK;
    if (shards <= 1) {
        snprintf(p, sizeof p, "%s/model.safetensors", dir);
        rc = write_file(p, &s, 0, 1);
    } else {
        json_t *map = json_object();
        for (int k = 0; k < shards && !rc; k++) {
            char fn[64];
            snprintf(fn, sizeof fn, "model-%05d-of-%05d.safetensors", k + 1, shards);
            snprintf(p, sizeof p, "%s/%s", dir, fn);
            rc = write_file(p, &s, k, shards);
            for (int i = k; i < s.n; i += shards) json_object_set_new(map, s.e[i].name, json_string(fn));
        }
        snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
        put_json(p, json_pack("{s:{s:i}, s:o}", "metadata", "total_size", 0, "weight_map", map));
    }
    entries_free(&s);
    return rc;
}

static json_t *golden_config(void) { return json_load_file(GOLDEN_TINY "/config.json", 0, NULL); }

/* The multimodal config: text_config holds the text model, as Qwen3_5Config writes it. */
static json_t *nested(json_t *text) {
    json_object_set_new(text, "model_type", json_string("qwen3_5_text"));
    return json_pack("{s:[s], s:s, s:o, s:{s:i}, s:b}", "architectures", "Qwen3_5ForConditionalGeneration", "model_type",
                     "qwen3_5", "text_config", text, "vision_config", "depth", 1, "tie_word_embeddings", 0);
}

static json_t *next_config(int num_experts) {
    json_t *c = golden_config();
    json_object_set_new(c, "model_type", json_string("qwen3_next"));
    json_object_set_new(c, "architectures", json_pack("[s]", "Qwen3NextForCausalLM"));
    if (num_experts >= 0) json_object_set_new(c, "num_experts", json_integer(num_experts));
    return c;
}

/* Load dir; 1 when it is the golden model with the golden weights bit for bit. `far`: the largest
 * difference from them (for the negative controls). */
static int loads_as_golden(const char *dir, const gdn_model_config *want, double *far, const char *what) {
    gdn_model_config c;
    int rc = gdn_ckpt_load_config(dir, &c);
    if (rc) {
        check(0, "%s: load_config: %s", what, gdn_errmsg());
        return 0;
    }
    if (memcmp(&c, want, sizeof c)) {
        check(0, "%s: the config differs from the expected model (tie %d)", what, c.tie_embeddings);
        return 0;
    }
    float *w = calloc(gdn_model_param_floats(&c), sizeof(float));
    rc = gdn_ckpt_load(dir, &c, w, NULL, NULL, NULL);
    if (rc) {
        check(0, "%s: load: %s", what, gdn_errmsg());
        free(w);
        return 0;
    }
    /* tensor by tensor against the golden model's (a tied model has no head of its own) */
    gdn_model_tensor_info t, g;
    double worst = 0;
    for (int i = 0; i < gdn_model_tensor_count(&c); i++) {
        gdn_model_tensor(&c, i, &t);
        int j = 0;
        for (; j < gdn_model_tensor_count(&G); j++)
            if (!gdn_model_tensor(&G, j, &g) && !strcmp(g.name, t.name)) break;
        for (size_t k = 0; k < t.numel; k++) {
            const double d = fabs((double)w[t.offset + k] - (double)GW[g.offset + k]);
            worst = d > worst ? d : worst;
        }
    }
    free(w);
    if (far) *far = worst;
    return worst == 0;
}

static void test_layouts(void) {
    char dir[400];
    layout plain = {.text = "model.", .head = 1};
    double far = 0;

    /* Qwen3_5ForConditionalGeneration's names, its vision tower and MTP head skipped */
    layout mm = plain;
    mm.text = "model.language_model.", mm.extras = 1;
    fresh(dir, "multimodal");
    check(!write_variant(dir, &mm, nested(golden_config()), 1) && loads_as_golden(dir, &G, NULL, "multimodal"),
          "the multimodal layout (model.language_model.*, model.visual.*, mtp.*, config under text_config) loads as "
          "the golden model, bit for bit");
    mm.foreign = "model.language_model.layers.7.mlp.up_proj.weight";
    fresh(dir, "multimodal_foreign");
    write_variant(dir, &mm, nested(golden_config()), 1);
    float *w = calloc(gdn_model_param_floats(&G) + 16, sizeof(float));
    expect_status(gdn_ckpt_load(dir, &G, w, NULL, NULL, NULL), GDN_ERR_FORMAT,
                  "unexpected tensor 'model.language_model.layers.7.mlp.up_proj.weight'",
                  "a layer the config does not have, beside the skipped ones");
    layout mm_text_only = plain; /* the multimodal names without their prefix being detected */
    mm_text_only.foreign = "visual.blocks.0.attn.qkv.weight";
    fresh(dir, "visual_unprefixed");
    write_variant(dir, &mm_text_only, golden_config(), 1);
    expect_status(gdn_ckpt_load(dir, &G, w, NULL, NULL, NULL), GDN_ERR_FORMAT, "unexpected tensor 'visual.blocks",
                  "only model.visual.* and mtp.* are skipped");

    /* dense Qwen3-Next: fused projections */
    layout nx = plain;
    nx.fused = 1;
    fresh(dir, "next");
    check(!write_variant(dir, &nx, next_config(0), 1) && loads_as_golden(dir, &G, NULL, "qwen3_next"),
          "dense Qwen3-Next (model_type qwen3_next, num_experts 0, fused in_proj_qkvz / in_proj_ba) loads as the "
          "golden model, bit for bit");
    /* control: the same file through a reader that takes the fused rows as concatenated (a
     * mutation of the loader) */
    test_mutation = "layer io: fused rows read as concatenated (not interleaved)";
    loads_as_golden(dir, &G, &far, "qwen3_next, read as concatenated");
    test_mutation = NULL;
    expect_far(far, 1e-3, "control: fused tensors read as concatenated instead of interleaved per key head: other weights");
    nx.fused = 1, nx.mixed = 1;
    fresh(dir, "next_mixed");
    write_variant(dir, &nx, next_config(0), 1);
    expect_status(gdn_ckpt_load(dir, &G, w, NULL, NULL, NULL), GDN_ERR_FORMAT, "layer 0 mixes layouts",
                  "a layer with both in_proj_qkv and in_proj_qkvz");
    nx.mixed = 0, nx.drop_ba = 1;
    fresh(dir, "next_no_ba");
    write_variant(dir, &nx, next_config(0), 1);
    expect_status(gdn_ckpt_load(dir, &G, w, NULL, NULL, NULL), GDN_ERR_MISSING,
                  "'model.layers.1.linear_attn.in_proj_ba.weight' is missing (the fused Qwen3-Next layout)",
                  "layer 1 fused without in_proj_ba");

    /* Qwen3-Next's mixture-of-experts rule (transformers' Qwen3NextDecoderLayer): which layers get
     * the sparse MoE block ('1') and which the dense MLP ('0'); 8 experts, 2 per token unless said */
    gdn_model_config c;
    struct { const char *what; int experts; const char *field; json_t *value; int want; const char *needle, *layers; } moe[] = {
        {"num_experts absent (its default, 512; 10 per token)", -1, NULL, NULL, GDN_OK, NULL, "1111"},
        {"num_experts 8", 8, NULL, NULL, GDN_OK, NULL, "1111"},
        {"num_experts 8, 10 per token", 8, "num_experts_per_tok", json_integer(10), GDN_ERR_SHAPE,
         "'num_experts_per_tok' = 10 is more than num_experts = 8", NULL},
        {"num_experts 8, mlp_only_layers every layer", 8, "mlp_only_layers", json_pack("[iiii]", 0, 1, 2, 3), GDN_OK, NULL,
         "0000"},
        {"num_experts 8, mlp_only_layers [0, 1, 2]", 8, "mlp_only_layers", json_pack("[iii]", 0, 1, 2), GDN_OK, NULL, "0001"},
        {"num_experts 8, decoder_sparse_step 5 (> 4 layers)", 8, "decoder_sparse_step", json_integer(5), GDN_OK, NULL,
         "0000"},
        {"num_experts 8, decoder_sparse_step 2", 8, "decoder_sparse_step", json_integer(2), GDN_OK, NULL, "0101"},
        {"decoder_sparse_step 0", 8, "decoder_sparse_step", json_integer(0), GDN_ERR_SHAPE, "'decoder_sparse_step' = 0",
         NULL},
        {"mlp_only_layers 3", 8, "mlp_only_layers", json_integer(3), GDN_ERR_FORMAT, "'mlp_only_layers' is not a list", NULL},
        {"num_experts_per_tok 0", 8, "num_experts_per_tok", json_integer(0), GDN_ERR_SHAPE, "'num_experts_per_tok' = 0",
         NULL},
    };
    fresh(dir, "next_moe");
    for (size_t i = 0; i < sizeof moe / sizeof moe[0]; i++) {
        json_t *cfg = next_config(moe[i].experts);
        if (moe[i].experts == 8) json_object_set_new(cfg, "num_experts_per_tok", json_integer(2));
        json_object_set_new(cfg, "moe_intermediate_size", json_integer(16));
        if (moe[i].field) json_object_set_new(cfg, moe[i].field, moe[i].value);
        char p[600];
        snprintf(p, sizeof p, "%s/config.json", dir);
        put_json(p, cfg);
        const int rc = gdn_ckpt_load_config(dir, &c);
        expect_status(rc, moe[i].want, moe[i].needle, "qwen3_next config: %s", moe[i].what);
        if (rc || !moe[i].layers) continue;
        char got[8] = "";
        for (int64_t l = 0; l < c.L && l < 4; l++) got[l] = c.moe[l] ? '1' : '0';
        check(!strcmp(got, moe[i].layers) && (strchr(got, '1') == NULL || c.n_experts == (moe[i].experts < 0 ? 512 : 8)),
              "qwen3_next config, %s: MoE layers %s (want %s), %lld experts", moe[i].what, got, moe[i].layers,
              (long long)c.n_experts);
    }
    /* Qwen3.5-MoE: every layer's MLP a mixture of experts */
    json_t *moe_type = golden_config();
    json_object_set_new(moe_type, "model_type", json_string("qwen3_5_moe_text"));
    json_object_set_new(moe_type, "num_experts", json_integer(4));
    json_object_set_new(moe_type, "num_experts_per_tok", json_integer(2));
    json_object_set_new(moe_type, "moe_intermediate_size", json_integer(16));
    char p[600];
    snprintf(p, sizeof p, "%s/config.json", dir);
    put_json(p, moe_type);
    const int rc35 = gdn_ckpt_load_config(dir, &c);
    check(!rc35 && gdn_model_moe_layers(&c) == c.L && c.n_experts == 4 && c.top_k == 2 && c.moe_I == 16 &&
              c.shared_I == 512 && c.norm_topk,
          "model_type qwen3_5_moe_text: every layer MoE, 4 experts, 2 per token, I 16, shared expert 512 (the default), "
          "renormalised (status %d %s)", rc35, rc35 ? gdn_errmsg() : "");
    json_t *dense_moe = golden_config();
    json_object_set_new(dense_moe, "num_experts", json_integer(4));
    put_json(p, dense_moe);
    expect_status(gdn_ckpt_load_config(dir, &c), GDN_ERR_SHAPE, "names a dense Qwen3.5 model",
                  "model_type qwen3_5_text with num_experts 4 (another model)");

    /* shards and their index */
    fresh(dir, "sharded");
    check(!write_variant(dir, &plain, golden_config(), 3) && loads_as_golden(dir, &G, NULL, "sharded"),
          "three shards with model.safetensors.index.json load as the golden model, bit for bit");
    layout nx_mm = mm;
    nx_mm.foreign = NULL, nx_mm.fused = 1;
    json_t *nmm = nested(next_config(0));
    json_object_set_new(json_object_get(nmm, "text_config"), "model_type", json_string("qwen3_next"));
    fresh(dir, "sharded_next_mm");
    check(!write_variant(dir, &nx_mm, nmm, 2) && loads_as_golden(dir, &G, NULL, "sharded fused multimodal"),
          "fused projections under model.language_model. in two shards load as the golden model");
    struct { const char *what, *tensor, *file; int want; const char *needle; } bad[] = {
        {"a shard outside the directory", "model.norm.weight", "../model-00001-of-00003.safetensors", GDN_ERR_FORMAT,
         "a file name beside the index expected"},
        {"a tensor in the wrong shard", "model.embed_tokens.weight", "model-00002-of-00003.safetensors", GDN_ERR_FORMAT,
         "which does not hold it"},
        {"a shard that does not exist", "model.norm.weight", "model-00009-of-00003.safetensors", GDN_ERR_IO,
         "model-00009-of-00003.safetensors: cannot open"},
        {"a shard name that is not a string", "model.norm.weight", NULL, GDN_ERR_FORMAT, "is not a string"},
    };
    char ip[600];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        fresh(dir, "sharded_bad");
        write_variant(dir, &plain, golden_config(), 3);
        snprintf(ip, sizeof ip, "%s/model.safetensors.index.json", dir);
        json_t *ix = json_load_file(ip, 0, NULL);
        json_t *map = json_object_get(ix, "weight_map");
        /* the embedding, the first tensor written, is in shard 1 */
        json_object_set_new(map, bad[i].tensor, bad[i].file ? json_string(bad[i].file) : json_integer(3));
        put_json(ip, ix);
        expect_status(gdn_ckpt_load(dir, &G, w, NULL, NULL, NULL), bad[i].want, bad[i].needle, "index: %s", bad[i].what);
    }
    fresh(dir, "sharded_twice");
    write_variant(dir, &plain, golden_config(), 2);
    entries s = {.n = 0};
    add(&s, "model.norm.weight", 1, (int64_t[]){G.E}, GW);
    snprintf(ip, sizeof ip, "%s/model-00003-of-00002.safetensors", dir);
    write_file(ip, &s, 0, 1);
    snprintf(ip, sizeof ip, "%s/model.safetensors.index.json", dir);
    json_t *ix = json_load_file(ip, 0, NULL);
    json_object_set_new(json_object_get(ix, "weight_map"), "model.norm.weight",
                        json_string("model-00003-of-00002.safetensors"));
    put_json(ip, ix);
    expect_status(gdn_ckpt_load(dir, &G, w, NULL, NULL, NULL), GDN_ERR_FORMAT, "is in two shards",
                  "index: a tensor in two shards");
    snprintf(ip, sizeof ip, "%s/model.safetensors.index.json", dir);
    put_json(ip, json_pack("{s:{}}", "weight_map"));
    expect_status(gdn_ckpt_load(dir, &G, w, NULL, NULL, NULL), GDN_ERR_FORMAT, "no 'weight_map' object",
                  "index: an empty weight_map");
    FILE *tf = fopen(ip, "wb");
    if (tf) fputs("{\"weight_map\": {", tf), fclose(tf);
    expect_status(gdn_ckpt_load(dir, &G, w, NULL, NULL, NULL), GDN_ERR_FORMAT, "invalid JSON", "index: truncated");

    /* tying: stated, or told by the weights when the config is silent */
    gdn_model_config tied = G;
    tied.tie_embeddings = 1;
    layout nohead = plain;
    nohead.head = 0;
    json_t *silent = golden_config();
    json_object_del(silent, "tie_word_embeddings");
    fresh(dir, "tie_silent");
    check(!write_variant(dir, &nohead, silent, 1) && loads_as_golden(dir, &tied, NULL, "silent, no lm_head"),
          "tie_word_embeddings absent and no lm_head.weight: a tied model (the embedding is the head)");
    silent = golden_config();
    json_object_del(silent, "tie_word_embeddings");
    fresh(dir, "tie_silent_head");
    check(!write_variant(dir, &plain, silent, 1) && loads_as_golden(dir, &G, NULL, "silent, lm_head"),
          "control: tie_word_embeddings absent with lm_head.weight present: untied");
    json_t *t1 = golden_config();
    json_object_set_new(t1, "tie_word_embeddings", json_true());
    layout copyhead = plain;
    copyhead.head = 2;
    fresh(dir, "tie_copy");
    check(!write_variant(dir, &copyhead, t1, 1) && loads_as_golden(dir, &tied, NULL, "tied with a copy of the embedding"),
          "tie_word_embeddings true with lm_head.weight equal to the embedding: loads, tied");
    t1 = golden_config();
    json_object_set_new(t1, "tie_word_embeddings", json_true());
    copyhead.head = 3;
    fresh(dir, "tie_differs");
    write_variant(dir, &copyhead, t1, 1);
    expect_status(gdn_ckpt_load(dir, &tied, w, NULL, NULL, NULL), GDN_ERR_FORMAT,
                  "lm_head.weight differs from the embedding (element 7",
                  "tie_word_embeddings true with another lm_head.weight");
    json_t *conflict = nested(golden_config());
    json_object_set_new(conflict, "tie_word_embeddings", json_true());
    fresh(dir, "tie_conflict");
    write_variant(dir, &mm, conflict, 1);
    expect_status(gdn_ckpt_load_config(dir, &c), GDN_ERR_FORMAT,
                  "'tie_word_embeddings' is true but 'text_config.tie_word_embeddings' is false",
                  "a multimodal config whose two tie_word_embeddings disagree");
    json_t *top_only = nested(golden_config());
    json_object_del(json_object_get(top_only, "text_config"), "tie_word_embeddings");
    json_object_set_new(top_only, "tie_word_embeddings", json_true());
    layout mm_tied = mm;
    mm_tied.foreign = NULL, mm_tied.head = 0;
    fresh(dir, "tie_top");
    check(!write_variant(dir, &mm_tied, top_only, 1) && loads_as_golden(dir, &tied, NULL, "top-level tie"),
          "a multimodal config tied at its top level only: tied");
    free(w);
}

void test_hf_layouts(void) {
    const char *tmp = getenv("TMPDIR");
    snprintf(base, sizeof base, "%s/gdn_hf_layouts_XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(base)) {
        check(0, "hf_layouts: cannot create a temporary directory");
        return;
    }
    int rc = gdn_ckpt_load_config(GOLDEN_TINY, &G);
    GW = rc ? NULL : calloc(gdn_model_param_floats(&G), sizeof(float));
    if (!rc) rc = gdn_ckpt_load(GOLDEN_TINY, &G, GW, NULL, NULL, NULL);
    check(rc == GDN_OK, "the golden tiny Qwen3.5 loads (%s)", rc ? gdn_errmsg() : "ok");
    if (!rc) test_layouts();
    free(GW);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", base);
    check(system(cmd) == 0, "temporary directory of the hf_layouts suite removed");
}
