/* The model's weights from a checkpoint directory as transformers (or gdncp) writes it: one
 * model.safetensors, or shards listed by model.safetensors.index.json; the text model's tensors
 * under "model." (Qwen3_5ForCausalLM, Qwen3NextForCausalLM) or "model.language_model."
 * (Qwen3_5ForConditionalGeneration, whose vision tower model.visual.* and multi-token-prediction
 * head mtp.* gdncp does not run and skips); Qwen3.5's split GatedDeltaNet projections or
 * Qwen3-Next's fused ones (gdn_layer_unfuse, the io layer's one row map). The model's own names
 * (gdn_model_tensor) are the text-only Qwen3.5 ones; this file maps them onto what a file holds. */
#include "hf_weights.h"

#include "base.h"

#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define WEIGHTS_FILE "model.safetensors"
#define INDEX_FILE "model.safetensors.index.json"
#define MAX_SHARDS 256
#define INDEX_MAX_BYTES ((off_t)256 << 20)

typedef struct {
    gdn_st_file *f[MAX_SHARDS];
    int n;
    char where[PATH_MAX]; /* the file errors name: model.safetensors or the index */
    const char *text;     /* what the model's "model." is in these files */
} weights;

int gdn_hf_has_weights(const char *dir) {
    char p[PATH_MAX];
    return (!gdn_path_join(p, sizeof p, dir, WEIGHTS_FILE) && gdn_is_regular_file(p)) ||
           (!gdn_path_join(p, sizeof p, dir, INDEX_FILE) && gdn_is_regular_file(p));
}

static void weights_close(weights *s) {
    for (int i = 0; i < s->n; i++) gdn_st_close(s->f[i]);
    s->n = 0;
}

/* The tensor called name in any shard, or NULL. */
static const gdn_st_tensor *find(const weights *s, const char *name, int *shard) {
    for (int i = 0; i < s->n; i++) {
        const gdn_st_tensor *t = gdn_st_find(s->f[i], name);
        if (t) {
            if (shard) *shard = i;
            return t;
        }
    }
    return NULL;
}

/* A shard's name from the index: a plain file name beside the index, nothing that leaves dir. */
static int shard_name_ok(const char *name) {
    return name[0] && name[0] != '.' && !strchr(name, '/') && strlen(name) < 256;
}

/* Open the shards the index names (each once) and check the index against them. */
static int open_index(weights *s, const char *dir, const char *index) {
    struct stat st;
    if (stat(index, &st) != 0 || !S_ISREG(st.st_mode))
        return gdn_fail(GDN_ERR_IO, "%s: not a regular file", index);
    if (st.st_size > INDEX_MAX_BYTES)
        return gdn_fail(GDN_ERR_FORMAT, "%s: %lld bytes, more than a weight index can be", index, (long long)st.st_size);
    json_error_t err;
    json_t *root = json_load_file(index, JSON_REJECT_DUPLICATES, &err);
    if (!root)
        return gdn_fail(GDN_ERR_FORMAT, "%s: invalid JSON at line %d column %d: %s", index, err.line, err.column,
                        err.text);
    json_t *map = json_object_get(root, "weight_map");
    int rc = json_is_object(map) && json_object_size(map)
                 ? GDN_OK
                 : gdn_fail(GDN_ERR_FORMAT, "%s: no 'weight_map' object (tensor name -> shard file)", index);
    const char *name;
    json_t *file;
    char path[PATH_MAX];
    json_object_foreach(map, name, file) {
        if (rc) break;
        const char *fn = json_string_value(file);
        if (!fn || !shard_name_ok(fn)) {
            rc = gdn_fail(GDN_ERR_FORMAT, "%s: weight_map['%s'] is %s%s%s: a file name beside the index expected", index,
                          name, fn ? "'" : "", fn ? fn : "not a string", fn ? "'" : "");
            break;
        }
        int seen = 0;
        for (int i = 0; i < s->n && !seen; i++) seen = !strcmp(strrchr(gdn_st_path(s->f[i]), '/') + 1, fn);
        if (seen) continue;
        if (s->n == MAX_SHARDS) {
            rc = gdn_fail(GDN_ERR_FORMAT, "%s: more than %d shard files", index, MAX_SHARDS);
            break;
        }
        if (!(rc = gdn_path_join(path, sizeof path, dir, fn)) && !(rc = gdn_st_open(&s->f[s->n], path))) s->n++;
    }
    /* A tensor may be in one shard only, and every name the index lists must be in the shard it
     * names. */
    for (int i = 1; i < s->n && !rc; i++)
        for (int k = 0; k < gdn_st_count(s->f[i]) && !rc; k++) {
            const char *tn = gdn_st_at(s->f[i], k)->name;
            int first = -1;
            find(s, tn, &first);
            if (first != i)
                rc = gdn_fail(GDN_ERR_FORMAT, "%s: tensor '%s' is in two shards, %s and %s", index, tn,
                              gdn_st_path(s->f[first]), gdn_st_path(s->f[i]));
        }
    json_object_foreach(map, name, file) {
        if (rc) break;
        int shard = -1;
        const gdn_st_tensor *t = find(s, name, &shard);
        const char *fn = json_string_value(file);
        if (!t || strcmp(strrchr(gdn_st_path(s->f[shard]), '/') + 1, fn))
            rc = gdn_fail(GDN_ERR_FORMAT, "%s: weight_map puts '%s' in %s, which does not hold it", index, name, fn);
    }
    json_decref(root);
    return rc;
}

/* Open dir's weights. */
static int weights_open(weights *s, const char *dir) {
    memset(s, 0, sizeof *s);
    int rc = gdn_path_join(s->where, sizeof s->where, dir, WEIGHTS_FILE);
    if (rc) return rc;
    if (gdn_is_regular_file(s->where) || !gdn_hf_has_weights(dir)) { /* the latter: gdn_st_open names what is wrong */
        rc = gdn_st_open(&s->f[0], s->where);
        s->n = !rc;
    } else if (!(rc = gdn_path_join(s->where, sizeof s->where, dir, INDEX_FILE))) {
        rc = open_index(s, dir, s->where);
    }
    s->text = !rc && find(s, "model.language_model.embed_tokens.weight", NULL) ? "model.language_model." : "model.";
    if (rc) weights_close(s);
    return rc;
}

/* The file's name for the model's tensor name. */
static void file_name(const weights *s, const char *ours, char *buf, size_t cap) {
    if (!strncmp(ours, "model.", 6)) snprintf(buf, cap, "%s%s", s->text, ours + 6);
    else snprintf(buf, cap, "%s", ours);
}

int gdn_hf_weights_hold(const char *dir, const char *name, int *present) {
    if (!dir || !name || !present) return gdn_fail(GDN_ERR_ARG, "weights hold: NULL argument");
    weights s;
    int rc = weights_open(&s, dir);
    if (rc) return rc;
    char fname[192];
    file_name(&s, name, fname, sizeof fname);
    *present = find(&s, fname, NULL) != NULL;
    weights_close(&s);
    return GDN_OK;
}

int gdn_hf_check_embedding(const char *dir, const gdn_model_config *cfg, const char *config_path) {
    if (!dir || !cfg || !config_path) return gdn_fail(GDN_ERR_ARG, "check embedding: NULL argument");
    weights s;
    int rc = weights_open(&s, dir);
    if (rc) return rc;
    char fname[192];
    file_name(&s, "model.embed_tokens.weight", fname, sizeof fname);
    int shard = 0;
    const gdn_st_tensor *t = find(&s, fname, &shard);
    if (t && (t->ndim != 2 || t->shape[0] != cfg->vocab || t->shape[1] != cfg->E)) {
        char got[96] = "";
        for (int d = 0; d < t->ndim && d < GDN_ST_MAX_DIMS; d++)
            snprintf(got + strlen(got), sizeof got - strlen(got), "%s%lld", d ? ", " : "", (long long)t->shape[d]);
        rc = gdn_fail(GDN_ERR_SHAPE, "%s: tensor '%s' has shape [%s], but %s's vocab_size %lld and hidden_size %lld "
                      "need [%lld, %lld]", gdn_st_path(s.f[shard]), fname, got, config_path, (long long)cfg->vocab,
                      (long long)cfg->E, (long long)cfg->vocab, (long long)cfg->E);
    }
    weights_close(&s);
    return rc;
}

int gdn_hf_check_tensor(const char *path, const gdn_st_tensor *t, const gdn_model_tensor_info *want) {
    if (t->dtype != GDN_F32 && t->dtype != GDN_BF16 && t->dtype != GDN_F64)
        return gdn_fail(GDN_ERR_DTYPE, "%s: tensor '%s' is %s; F32 or BF16 expected", path, t->name, t->dtype_name);
    /* a slice of the experts (expert parallelism) is read from the whole tensor */
    int64_t whole[3] = {want->shape[0], want->shape[1], want->shape[2]};
    if (want->experts_whole) whole[0] = want->experts_whole;
    int same = t->ndim == want->ndim;
    for (int d = 0; same && d < t->ndim; d++) same = t->shape[d] == whole[d];
    if (same) return GDN_OK;
    char need[96] = "", got[96] = "";
    for (int d = 0; d < want->ndim; d++)
        snprintf(need + strlen(need), sizeof need - strlen(need), "%s%lld", d ? ", " : "", (long long)whole[d]);
    for (int d = 0; d < t->ndim && d < GDN_ST_MAX_DIMS; d++)
        snprintf(got + strlen(got), sizeof got - strlen(got), "%s%lld", d ? ", " : "", (long long)t->shape[d]);
    return gdn_fail(GDN_ERR_SHAPE, "%s: tensor '%s' has shape [%s]; the configuration needs [%s]", path, t->name,
                    got, need);
}

int gdn_hf_read_tensor(gdn_st_file *f, const gdn_st_tensor *t, const gdn_model_tensor_info *want, float *dst) {
    int rc = gdn_hf_check_tensor(gdn_st_path(f), t, want);
    if (rc) return rc;
    if (want->experts_whole && want->shape[0] != want->experts_whole) /* this rank's experts only */
        return gdn_st_read_f32_slice(f, t->name, dst, want->numel, 0, want->expert_first, want->shape[0]);
    return gdn_st_read_f32(f, t->name, dst, want->numel);
}

/* The tensors read so far, so that whatever else a file holds can be named. */
typedef struct {
    const gdn_st_tensor **t;
    int n;
} used_set;

static int is_used(const used_set *u, const gdn_st_tensor *t) {
    for (int i = 0; i < u->n; i++)
        if (u->t[i] == t) return 1;
    return 0;
}

/* Check t against want and read it (as fp32) into dst. */
static int read_one(const weights *s, const gdn_st_tensor *t, int shard, const gdn_model_tensor_info *want,
                    float *dst, used_set *u) {
    const int rc = gdn_hf_read_tensor(s->f[shard], t, want, dst);
    if (!rc) u->t[u->n++] = t;
    return rc;
}

/* Index of the table entry called name, or -1. */
static int table_index(const gdn_model_tensor_info *table, int n, const char *name) {
    for (int i = 0; i < n; i++)
        if (!strcmp(table[i].name, name)) return i;
    return -1;
}

/* Layer l's GatedDeltaNet projections from Qwen3-Next's fused tensors when the file has them:
 * scattered into w, their four split entries marked done. */
static int read_fused_layer(const weights *s, const gdn_model_config *cfg, int64_t l, const gdn_model_tensor_info *table,
                            int n, float *w, char *done, used_set *u) {
    char lp[128], name[192], ours[160];
    snprintf(lp, sizeof lp, "%slayers.%lld.linear_attn.", s->text, (long long)l);
    const gdn_st_tensor *fused[GDN_FUSED_COUNT];
    int shard[GDN_FUSED_COUNT] = {0}, any = 0;
    for (int f = 0; f < GDN_FUSED_COUNT; f++) {
        snprintf(name, sizeof name, "%s%s", lp, gdn_layer_fused_name(f));
        any |= (fused[f] = find(s, name, &shard[f])) != NULL;
    }
    if (!any) return GDN_OK;
    static const int split[4] = {GDN_P_IN_PROJ_QKV, GDN_P_IN_PROJ_Z, GDN_P_IN_PROJ_B, GDN_P_IN_PROJ_A};
    for (int k = 0; k < 4; k++) {
        snprintf(name, sizeof name, "%s%s", lp, gdn_layer_param_name(split[k]));
        if (find(s, name, NULL))
            return gdn_fail(GDN_ERR_FORMAT, "%s: layer %lld mixes layouts: '%s' (split, Qwen3.5) and fused Qwen3-Next "
                            "projections are both present", s->where, (long long)l, name);
    }
    const gdn_layer_config lc = gdn_model_layer_config(cfg, 1, 1);
    float *tmp = NULL;
    int rc = GDN_OK;
    for (int f = 0; f < GDN_FUSED_COUNT && !rc; f++) {
        gdn_model_tensor_info want = {.ndim = 2, .shape = {gdn_layer_fused_rows(&lc, f), cfg->E}};
        want.numel = (size_t)(want.shape[0] * want.shape[1]);
        if (!fused[f]) {
            rc = gdn_fail(GDN_ERR_MISSING, "%s: tensor '%s%s' is missing (the fused Qwen3-Next layout)", s->where, lp,
                          gdn_layer_fused_name(f));
            break;
        }
        free(tmp);
        tmp = gdn_malloc("hf_weights: tmp", want.numel * sizeof *tmp);
        if (!tmp) rc = gdn_fail(GDN_ERR_NOMEM, "reading '%s' (%zu floats)", want.name, want.numel);
        if (!rc) rc = read_one(s, fused[f], shard[f], &want, tmp, u);
        if (!rc) rc = gdn_layer_unfuse(&lc, f, tmp, w + gdn_model_layer_offset(cfg, l));
    }
    free(tmp);
    for (int k = 0; k < 4 && !rc; k++) {
        snprintf(ours, sizeof ours, "model.layers.%lld.linear_attn.%s", (long long)l, gdn_layer_param_name(split[k]));
        const int i = table_index(table, n, ours);
        if (i >= 0) done[i] = 1;
    }
    return rc;
}

/* Layer l's MoE experts stored one by one (experts.E.{gate,up,down}_proj.weight: what
 * save_pretrained writes and Qwen ships) when the file does not hold the fused in-memory tensors
 * (experts.gate_up_proj [n, 2I, E], experts.down_proj [n, E, I]): each read into its place in the
 * fused layout (expert e's gate rows, then its up rows), the two fused entries marked done. A file
 * with both layouts, or with some experts missing, is refused naming the tensor. */
static int read_expert_layer(const weights *s, const gdn_model_config *cfg, int64_t l, const gdn_model_tensor_info *table,
                             int n, float *w, char *done, used_set *u) {
    char ours[160], name[192];
    int idx[2];
    static const char *const fused[2] = {"gate_up_proj", "down_proj"};
    int has_fused = 0;
    for (int f = 0; f < 2; f++) {
        snprintf(ours, sizeof ours, "model.layers.%lld.mlp.experts.%s", (long long)l, fused[f]);
        idx[f] = table_index(table, n, ours);
        if (idx[f] < 0) return gdn_fail(GDN_ERR_ARG, "internal: the model table lacks '%s'", ours);
        file_name(s, ours, name, sizeof name);
        has_fused |= find(s, name, NULL) != NULL;
    }
    snprintf(ours, sizeof ours, "model.layers.%lld.mlp.experts.0.gate_proj.weight", (long long)l);
    file_name(s, ours, name, sizeof name);
    const int has_split = find(s, name, NULL) != NULL;
    if (has_fused && has_split)
        return gdn_fail(GDN_ERR_FORMAT, "%s: layer %lld's experts are stored twice: '%s' (one by one) beside the fused "
                        "experts.gate_up_proj / experts.down_proj; keep one layout", s->where, (long long)l, name);
    if (has_fused) return GDN_OK; /* read by name with the rest of the table */
    const int64_t I = cfg->moe_I, E = cfg->E, first = table[idx[0]].expert_first, count = table[idx[0]].shape[0];
    static const char *const parts[3] = {"gate_proj", "up_proj", "down_proj"};
    for (int64_t e = 0; e < cfg->n_experts; e++)
        for (int k = 0; k < 3; k++) {
            gdn_model_tensor_info want = {.ndim = 2, .shape = {k == 2 ? E : I, k == 2 ? I : E}};
            want.numel = (size_t)(I * E);
            snprintf(want.name, sizeof want.name, "model.layers.%lld.mlp.experts.%lld.%s.weight", (long long)l,
                     (long long)e, parts[k]);
            file_name(s, want.name, name, sizeof name);
            int shard = 0;
            const gdn_st_tensor *t = find(s, name, &shard);
            if (!t)
                return gdn_fail(GDN_ERR_MISSING, "%s: tensor '%s' is missing (layer %lld's experts are stored one by "
                                "one: every expert's gate_proj, up_proj and down_proj)", s->where, name, (long long)l);
            if (e < first || e >= first + count) { /* another rank's expert (expert parallelism) */
                u->t[u->n++] = t;
                continue;
            }
            /* gate rows of expert e at [e, 0:I), up rows at [e, I:2I) of gate_up; down [e] of down_proj */
            const size_t j = (size_t)(e - first);
            const size_t at = k == 2 ? table[idx[1]].offset + j * want.numel
                                     : table[idx[0]].offset + j * 2 * want.numel + (size_t)k * want.numel;
            const int rc = read_one(s, t, shard, &want, w + at, u);
            if (rc) return rc;
        }
    done[idx[0]] = done[idx[1]] = 1;
    return GDN_OK;
}

/* A tied model's file may keep lm_head.weight (transformers writes it for some models): it must be
 * the embedding, which the model uses as its head. */
static int read_tied_head(const weights *s, const gdn_model_tensor_info *table, int n, const float *w, used_set *u) {
    int shard = 0;
    const gdn_st_tensor *t = find(s, "lm_head.weight", &shard);
    if (!t) return GDN_OK;
    const int e = table_index(table, n, "model.embed_tokens.weight");
    const gdn_model_tensor_info want = table[e];
    float *head = gdn_malloc("hf_weights: head", want.numel * sizeof *head + 1);
    if (!head) return gdn_fail(GDN_ERR_NOMEM, "reading lm_head.weight (%zu floats)", want.numel);
    int rc = read_one(s, t, shard, &want, head, u);
    size_t k = 0;
    while (!rc && k < want.numel && head[k] == w[table[e].offset + k]) k++;
    if (!rc && k < want.numel)
        rc = gdn_fail(GDN_ERR_FORMAT, "%s: tie_word_embeddings is true but lm_head.weight differs from the embedding "
                      "(element %zu: %g against %g); a tied model's head is its embedding", gdn_st_path(s->f[shard]), k,
                      (double)head[k], (double)w[table[e].offset + k]);
    free(head);
    return rc;
}

/* What gdncp does not run: the vision tower and the multi-token-prediction head. */
static int is_skipped(const char *name) { return !strncmp(name, "mtp.", 4) || !strncmp(name, "model.visual.", 13); }

int gdn_hf_read_model(const char *dir, const gdn_model_config *cfg, const gdn_model_tensor_info *table, int n,
                      float *w) {
    if (!dir || !cfg || !table || n < 1 || !w) return gdn_fail(GDN_ERR_ARG, "model weights read: NULL argument");
    weights s;
    int rc = weights_open(&s, dir);
    if (rc) return rc;
    int total = 0;
    for (int i = 0; i < s.n; i++) total += gdn_st_count(s.f[i]);
    char *done = gdn_calloc("hf_weights: done", (size_t)n, 1);
    used_set u = {gdn_calloc("hf_weights: u.t", (size_t)total + 1, sizeof *u.t), 0};
    if (!done || !u.t) rc = gdn_fail(GDN_ERR_NOMEM, "model weights read: %d tensors", total);
    for (int64_t l = 0; l < cfg->L && !rc; l++)
        if (!cfg->full_attention[l]) rc = read_fused_layer(&s, cfg, l, table, n, w, done, &u);
    for (int64_t l = 0; l < cfg->L && !rc; l++)
        if (cfg->moe[l]) rc = read_expert_layer(&s, cfg, l, table, n, w, done, &u);
    char name[192];
    for (int i = 0; i < n && !rc; i++) {
        if (done[i]) continue;
        file_name(&s, table[i].name, name, sizeof name);
        int shard = 0;
        const gdn_st_tensor *t = find(&s, name, &shard);
        rc = t ? read_one(&s, t, shard, &table[i], w + table[i].offset, &u)
               : gdn_fail(GDN_ERR_MISSING, "%s: tensor '%s' is missing", s.where, name);
    }
    if (!rc && cfg->tie_embeddings) rc = read_tied_head(&s, table, n, w, &u);
    /* Anything else is foreign: another model's, or a layer this configuration does not have. */
    for (int i = 0; i < s.n && !rc; i++)
        for (int k = 0; k < gdn_st_count(s.f[i]) && !rc; k++) {
            const gdn_st_tensor *t = gdn_st_at(s.f[i], k);
            if (!is_used(&u, t) && !is_skipped(t->name))
                rc = gdn_fail(GDN_ERR_FORMAT, "%s: unexpected tensor '%s' (not a parameter of this configuration)",
                              gdn_st_path(s.f[i]), t->name);
        }
    free(done), free(u.t);
    weights_close(&s);
    return rc;
}
