/* Checkpoints in Hugging Face's Qwen3.5 layout (see checkpoint.h for the directory and the
 * crash-safety protocol). The tensors go through the project's safetensors writer, with their
 * bytes written straight from the caller's flat arrays (no copy of the model), and are read back
 * with its validating reader. */
#include "gdncp/train.h"

#include "base.h"
#include "gdncp/io.h"
#include "hf_weights.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define CONFIG_FILE "config.json"
#define MODEL_FILE "model.safetensors"
#define OPTIM_FILE "optimizer.safetensors"
#define MASTER_PREFIX "master." /* beside BF16 weights: the fp32 masters (optimizer file) */
#define STATE_FILE "trainer_state.json"
#define PRIMARY_PREFIX "checkpoint-"
#define HIDDEN_PREFIX ".checkpoint-"
#define MAX_STATE_BYTES ((off_t)64 << 20)

/* The test point (gdn_test_point, base.h) of gdn_ckpt_save's stages: 1 (temporary directory
 * complete, not yet renamed), 2 (an existing checkpoint of the same step moved aside, the new one
 * not yet in place) and 3 (the new one in place, the old one not yet removed). */
static void test_hook(int stage) {
    static const char *const site[4] = {"", "ckpt save: stage 1", "ckpt save: stage 2", "ckpt save: stage 3"};
    gdn_test_point(site[stage]);
}

/* ------------------------------------------------------------------ paths and directories */

/* buf = dir + "/" + name; GDN_ERR_ARG when it does not fit. */
/* fsync a directory so that the renames and creations inside it are durable; 0 or errno. */
static int fsync_dir(const char *dir) {
    const int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return errno;
    const int err = fsync(fd) == 0 ? 0 : errno;
    close(fd);
    /* A file system that cannot fsync directories says so with EINVAL: nothing to report. */
    return err == EINVAL ? 0 : err;
}

static int exists(const char *path) {
    struct stat st;
    return lstat(path, &st) == 0;
}

/* Does dir hold what a reader needs: config.json and the weights (model.safetensors, or the
 * shards of a transformers checkpoint's index)? */
static int is_complete(const char *dir) {
    char p[PATH_MAX];
    return snprintf(p, sizeof p, "%s/%s", dir, CONFIG_FILE) < (int)sizeof p && gdn_is_regular_file(p) && gdn_hf_has_weights(dir);
}

/* Remove path and, if it is a directory, everything below it (symbolic links are removed, never
 * followed). 0 or the first errno. */
static int remove_tree(const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0) return errno == ENOENT ? 0 : errno;
    if (!S_ISDIR(st.st_mode)) return unlink(path) == 0 ? 0 : errno;
    DIR *d = opendir(path);
    if (!d) return errno;
    int err = 0;
    char child[PATH_MAX];
    for (struct dirent *e; (e = readdir(d));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        if ((size_t)snprintf(child, sizeof child, "%s/%s", path, e->d_name) >= sizeof child) {
            err = err ? err : ENAMETOOLONG;
            continue;
        }
        const int e2 = remove_tree(child);
        err = err ? err : e2;
    }
    closedir(d);
    if (!err && rmdir(path) != 0) err = errno;
    return err;
}

/* Write text to path (created, truncated) and fsync it. */
static int write_synced(const char *path, const char *text, size_t len) {
    const int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return gdn_fail(GDN_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
    for (size_t done = 0; done < len;) {
        const ssize_t k = write(fd, text + done, len - done);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            const int err = k < 0 ? errno : EIO;
            close(fd);
            return gdn_fail(GDN_ERR_IO, "%s: write failed: %s", path, strerror(err));
        }
        done += (size_t)k;
    }
    if (fsync(fd) != 0) {
        const int err = errno;
        close(fd);
        return gdn_fail(GDN_ERR_IO, "%s: fsync failed: %s", path, strerror(err));
    }
    if (close(fd) != 0) return gdn_fail(GDN_ERR_IO, "%s: close failed: %s", path, strerror(errno));
    return GDN_OK;
}

/* ------------------------------------------------------------------ names in an output directory */

typedef enum { ENTRY_OTHER, ENTRY_PRIMARY, ENTRY_TMP, ENTRY_OLD, ENTRY_DEL } entry_kind;

/* A run of decimal digits at *s (at most 18: no overflow); -1 if none. Advances *s. */
static int64_t parse_digits(const char **s) {
    int64_t v = 0;
    int n = 0;
    for (; **s >= '0' && **s <= '9'; (*s)++, n++) {
        if (n == 18) return -1;
        v = 10 * v + (**s - '0');
    }
    return n ? v : -1;
}

/* "checkpoint-N", or ".checkpoint-N.{tmp,old,del}-PID" (what saves leave behind when killed). */
static entry_kind classify(const char *name, int64_t *step, long *pid) {
    const char *s = name;
    *pid = 0;
    if (!strncmp(s, PRIMARY_PREFIX, strlen(PRIMARY_PREFIX))) {
        s += strlen(PRIMARY_PREFIX);
        *step = parse_digits(&s);
        return *step >= 0 && !*s ? ENTRY_PRIMARY : ENTRY_OTHER;
    }
    if (strncmp(s, HIDDEN_PREFIX, strlen(HIDDEN_PREFIX))) return ENTRY_OTHER;
    s += strlen(HIDDEN_PREFIX);
    *step = parse_digits(&s);
    if (*step < 0) return ENTRY_OTHER;
    static const struct { const char *tag; entry_kind kind; } tags[] = {
        {".tmp-", ENTRY_TMP}, {".old-", ENTRY_OLD}, {".del-", ENTRY_DEL}};
    for (size_t i = 0; i < sizeof tags / sizeof tags[0]; i++) {
        if (strncmp(s, tags[i].tag, 5)) continue;
        s += 5;
        const int64_t p = parse_digits(&s);
        if (p <= 0 || *s || p > LONG_MAX) return ENTRY_OTHER;
        *pid = (long)p;
        return tags[i].kind;
    }
    return ENTRY_OTHER;
}

static void primary_name(char *buf, size_t cap, int64_t step) {
    snprintf(buf, cap, PRIMARY_PREFIX "%08lld", (long long)step);
}

static void hidden_name(char *buf, size_t cap, int64_t step, const char *tag, long pid) {
    snprintf(buf, cap, HIDDEN_PREFIX "%08lld.%s-%ld", (long long)step, tag, pid);
}

/* A leftover belongs to a save that is over: ours (an earlier failed save in this process) or
 * one of a process that no longer exists. Another live process may be saving right now. */
static int owner_gone(long pid) {
    if (pid == (long)getpid()) return 1;
    return kill((pid_t)pid, 0) != 0 && errno == ESRCH;
}

/* Undo what killed saves left: temporary and half-removed directories go; a checkpoint moved
 * aside by a save that died before putting the new one in place goes back (or goes, if its step
 * is in place after all). Best effort: what cannot be removed now is ignored by readers and tried
 * again by the next save. */
static void clean_leftovers(const char *out_dir) {
    DIR *d = opendir(out_dir);
    if (!d) return;
    char path[PATH_MAX], primary[PATH_MAX], name[64];
    for (struct dirent *e; (e = readdir(d));) {
        int64_t step;
        long pid;
        const entry_kind kind = classify(e->d_name, &step, &pid);
        if (kind == ENTRY_OTHER || kind == ENTRY_PRIMARY || !owner_gone(pid)) continue;
        if (gdn_path_join(path, sizeof path, out_dir, e->d_name)) continue;
        if (kind == ENTRY_OLD) {
            primary_name(name, sizeof name, step);
            if (gdn_path_join(primary, sizeof primary, out_dir, name)) continue;
            if (!exists(primary) && is_complete(path)) {
                if (rename(path, primary) == 0) fsync_dir(out_dir);
                continue;
            }
        }
        remove_tree(path);
    }
    closedir(d);
}

/* The complete checkpoint-N directories of out_dir, and the complete moved-aside copies whose
 * step has no complete checkpoint-N (a save killed between its two renames); *out is malloc'd. */
typedef struct {
    int64_t step;
    int aside;
    char name[64];
} found_ckpt;

static int list_checkpoints(const char *out_dir, found_ckpt **out, int *count) {
    *out = NULL, *count = 0;
    DIR *d = opendir(out_dir);
    if (!d) return gdn_fail(GDN_ERR_IO, "%s: cannot list the directory: %s", out_dir, strerror(errno));
    found_ckpt *list = NULL;
    int n = 0, cap = 0, rc = GDN_OK;
    char path[PATH_MAX];
    for (struct dirent *e; !rc && (e = readdir(d));) {
        int64_t step;
        long pid;
        const entry_kind kind = classify(e->d_name, &step, &pid);
        if ((kind != ENTRY_PRIMARY && kind != ENTRY_OLD) || strlen(e->d_name) >= sizeof list->name)
            continue;
        if (gdn_path_join(path, sizeof path, out_dir, e->d_name) || !is_complete(path)) continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 16;
            found_ckpt *grown = realloc(list, sizeof *list * (size_t)cap);
            if (!grown) {
                rc = gdn_fail(GDN_ERR_NOMEM, "%s: cannot allocate the list of checkpoints", out_dir);
                break;
            }
            list = grown;
        }
        list[n].step = step, list[n].aside = kind == ENTRY_OLD;
        snprintf(list[n].name, sizeof list[n].name, "%s", e->d_name);
        n++;
    }
    closedir(d);
    if (rc) {
        free(list);
        return rc;
    }
    /* A moved-aside copy counts only where its step has no checkpoint-N in place. */
    int kept = 0;
    for (int i = 0; i < n; i++) {
        int shadowed = 0;
        for (int j = 0; j < n && list[i].aside; j++)
            shadowed |= !list[j].aside && list[j].step == list[i].step;
        for (int j = 0; j < kept && list[i].aside && !shadowed; j++)
            shadowed |= list[j].step == list[i].step; /* two asides of one step: keep one */
        if (!shadowed) list[kept++] = list[i];
    }
    *out = list, *count = kept;
    return GDN_OK;
}

/* ------------------------------------------------------------------ config.json */

/* The decimal that round-trips to f with the fewest digits (1e-06, not 9.99999997e-07). */
static double shortest_decimal(float f) {
    char buf[32];
    for (int digits = 1; digits < 9; digits++) {
        snprintf(buf, sizeof buf, "%.*g", digits, (double)f);
        const double d = strtod(buf, NULL);
        if ((float)d == f) return d;
    }
    return (double)f;
}

/* A partial_rotary_factor whose decimal (at most 9 significant digits: the JSON writer's
 * precision) gives back R under transformers' int(head_dim * partial_rotary_factor): the
 * shortest such decimal of R / d, else one half a dim above R. */
static double rotary_factor(int64_t R, int64_t d) {
    char buf[32];
    for (int digits = 1; digits <= 9; digits++) {
        snprintf(buf, sizeof buf, "%.*g", digits, (double)R / (double)d);
        const double f = strtod(buf, NULL);
        if ((int64_t)((double)d * f) == R) return f;
    }
    snprintf(buf, sizeof buf, "%.9g", ((double)R + 0.5) / (double)d);
    return strtod(buf, NULL);
}

/* transformers' Qwen3.5 text config. A model with full-attention layers writes their fields; in
 * a GatedDeltaNet-only one they are there only because transformers requires them to build the
 * config (no layer uses them: every entry of layer_types is linear_attention). */
static json_t *config_json(const gdn_model_config *cfg) {
    const int hybrid = gdn_model_attn_layers(cfg) > 0, moe = gdn_model_moe_layers(cfg) > 0;
    json_t *layer_types = json_array();
    for (int64_t l = 0; layer_types && l < cfg->L; l++)
        json_array_append_new(layer_types, json_string(cfg->full_attention[l] ? "full_attention" : "linear_attention"));
    json_t *rope = json_pack("{s:f, s:f, s:s}", "partial_rotary_factor", hybrid ? rotary_factor(cfg->R, cfg->d) : 0.25,
                             "rope_theta", hybrid ? cfg->rope_theta : 10000.0, "rope_type", "default");
    if (!layer_types || !rope) {
        json_decref(layer_types), json_decref(rope);
        return NULL;
    }
    const int64_t heads = hybrid ? cfg->H : cfg->Hv, kv_heads = hybrid ? cfg->Hkv : cfg->Hk;
    const int64_t head_dim = hybrid ? cfg->d : cfg->V;
    const int64_t max_pos = hybrid && cfg->max_position > 0 ? cfg->max_position : 32768;
    json_t *root = json_pack(
        "{s:[s], s:b, s:f, s:n, s:s, s:n, s:I, s:s, s:I, s:f, s:I, s:o, s:I, s:I, s:I, s:I, s:I,"
        " s:I, s:s, s:I, s:I, s:I, s:n, s:f, s:o, s:b, s:b, s:I}",
        "architectures", "Qwen3_5ForCausalLM", "attention_bias", 0, "attention_dropout", 0.0,
        "bos_token_id", "dtype", "float32", "eos_token_id", "head_dim", (json_int_t)head_dim,
        "hidden_act", "silu", "hidden_size", (json_int_t)cfg->E, "initializer_range", 0.02,
        "intermediate_size", (json_int_t)cfg->I, "layer_types", layer_types,
        "linear_conv_kernel_dim", (json_int_t)cfg->Kc, "linear_key_head_dim", (json_int_t)cfg->K,
        "linear_num_key_heads", (json_int_t)cfg->Hk, "linear_num_value_heads", (json_int_t)cfg->Hv,
        "linear_value_head_dim", (json_int_t)cfg->V, "max_position_embeddings", (json_int_t)max_pos,
        "model_type", "qwen3_5_text", "num_attention_heads", (json_int_t)heads,
        "num_hidden_layers", (json_int_t)cfg->L, "num_key_value_heads", (json_int_t)kv_heads,
        "pad_token_id", "rms_norm_eps", shortest_decimal(cfg->eps), "rope_parameters", rope,
        "tie_word_embeddings", cfg->tie_embeddings != 0, "use_cache", 1, "vocab_size",
        (json_int_t)cfg->vocab);
    if (!root || !moe) return root;
    /* Qwen3.5-MoE: its fields, and the dense layers' indices when some layer is dense (gdncp reads
     * them back; transformers' Qwen3.5-MoE makes every layer MoE) */
    json_t *dense = json_array();
    for (int64_t l = 0; dense && l < cfg->L; l++)
        if (!cfg->moe[l]) json_array_append_new(dense, json_integer((json_int_t)l));
    json_t *moe_fields = json_pack("{s:[s], s:s, s:I, s:I, s:I, s:I, s:b, s:b, s:f, s:o}", "architectures",
                                   "Qwen3_5MoeForCausalLM", "model_type", "qwen3_5_moe_text", "num_experts",
                                   (json_int_t)cfg->n_experts, "num_experts_per_tok", (json_int_t)cfg->top_k,
                                   "moe_intermediate_size", (json_int_t)cfg->moe_I, "shared_expert_intermediate_size",
                                   (json_int_t)cfg->shared_I, "norm_topk_prob", cfg->norm_topk != 0,
                                   "output_router_logits", cfg->router_aux != 0,
                                   "router_aux_loss_coef", cfg->router_aux_coef, "mlp_only_layers", dense);
    if (!moe_fields || json_object_update(root, moe_fields)) {
        json_decref(root), json_decref(moe_fields);
        return NULL;
    }
    json_decref(moe_fields);
    if (gdn_model_moe_layers(cfg) == cfg->L) json_object_del(root, "mlp_only_layers");
    return root;
}

static int write_config(const char *path, const gdn_model_config *cfg, int weight_dtype) {
    json_t *root = config_json(cfg);
    if (root && weight_dtype == GDN_BF16) json_object_set_new(root, "dtype", json_string("bfloat16"));
    /* Nine significant digits hold any float exactly; the sorted, indented form is transformers'. */
    char *text = root ? json_dumps(root, JSON_INDENT(2) | JSON_SORT_KEYS | JSON_REAL_PRECISION(9))
                      : NULL;
    json_decref(root);
    if (!text) return gdn_fail(GDN_ERR_NOMEM, "%s: cannot build the JSON text", path);
    const size_t len = strlen(text);
    char *with_newline = realloc(text, len + 2);
    if (!with_newline) {
        free(text);
        return gdn_fail(GDN_ERR_NOMEM, "%s: cannot build the JSON text", path);
    }
    with_newline[len] = '\n', with_newline[len + 1] = 0;
    const int rc = write_synced(path, with_newline, len + 1);
    free(with_newline);
    return rc;
}

/* An integer field in [lo, hi]. */
static int config_int(json_t *obj, const char *path, const char *where, const char *field,
                      int64_t lo, int64_t hi, int64_t *out) {
    json_t *v = json_object_get(obj, field);
    if (!v || json_is_null(v))
        return gdn_fail(GDN_ERR_FORMAT, "%s: field '%s%s' is missing", path, where, field);
    if (!json_is_integer(v))
        return gdn_fail(GDN_ERR_FORMAT, "%s: field '%s%s' is not an integer", path, where, field);
    const json_int_t x = json_integer_value(v);
    if (x < lo || x > hi)
        return gdn_fail(GDN_ERR_SHAPE, "%s: field '%s%s' = %lld is out of range [%lld, %lld]", path,
                        where, field, (long long)x, (long long)lo, (long long)hi);
    *out = (int64_t)x;
    return GDN_OK;
}

/* A number field in [lo, hi]; absent (or null): dflt when `optional`, else an error. */
static int config_real(json_t *obj, const char *path, const char *where, const char *field, double lo,
                       double hi, int optional, double dflt, double *out) {
    json_t *v = json_object_get(obj, field);
    if (!v || json_is_null(v)) {
        if (!optional) return gdn_fail(GDN_ERR_FORMAT, "%s: field '%s%s' is missing", path, where, field);
        *out = dflt;
        return GDN_OK;
    }
    if (!json_is_number(v))
        return gdn_fail(GDN_ERR_FORMAT, "%s: field '%s%s' is not a number", path, where, field);
    const double x = json_number_value(v);
    if (!(x >= lo && x <= hi))
        return gdn_fail(GDN_ERR_SHAPE, "%s: field '%s%s' = %g is out of range [%g, %g]", path, where, field, x, lo, hi);
    *out = x;
    return GDN_OK;
}

/* The integer fields of a table into their destinations, in order. */
typedef struct {
    const char *field;
    int64_t lo, hi;
    int64_t *dst;
} int_field;
static int config_ints(json_t *obj, const char *path, const char *where, const int_field *f, size_t n) {
    for (size_t i = 0; i < n; i++) {
        const int rc = config_int(obj, path, where, f[i].field, f[i].lo, f[i].hi, f[i].dst);
        if (rc) return rc;
    }
    return GDN_OK;
}

/* Which layers are full attention: layer_types, or without it transformers' default from
 * full_attention_interval (every interval-th layer; 4 when that is absent too). */
static int parse_layer_types(json_t *obj, const char *path, const char *where, gdn_model_config *cfg) {
    json_t *lt = json_object_get(obj, "layer_types");
    if (!lt || json_is_null(lt)) {
        int64_t interval = 4;
        json_t *iv = json_object_get(obj, "full_attention_interval");
        if (iv && !json_is_null(iv)) {
            const int rc = config_int(obj, path, where, "full_attention_interval", 1, INT32_MAX, &interval);
            if (rc) return rc;
        }
        gdn_model_set_attention_interval(cfg, interval);
        return GDN_OK;
    }
    if (!json_is_array(lt))
        return gdn_fail(GDN_ERR_FORMAT, "%s: '%slayer_types' is not an array (of \"linear_attention\" and "
                        "\"full_attention\")", path, where);
    if ((int64_t)json_array_size(lt) != cfg->L)
        return gdn_fail(GDN_ERR_SHAPE, "%s: '%slayer_types' has %zu entries but num_hidden_layers "
                        "is %lld", path, where, json_array_size(lt), (long long)cfg->L);
    for (size_t l = 0; l < json_array_size(lt); l++) {
        json_t *t = json_array_get(lt, l);
        const char *name = json_is_string(t) ? json_string_value(t) : NULL;
        if (name && (!strcmp(name, "linear_attention") || !strcmp(name, "full_attention"))) {
            cfg->full_attention[l] = !strcmp(name, "full_attention");
            continue;
        }
        return gdn_fail(GDN_ERR_FORMAT, "%s: layer %zu is %s%s%s: gdncp's layers are \"linear_attention\" "
                        "(GatedDeltaNet) and \"full_attention\" (gated attention)", path, l, name ? "\"" : "",
                        name ? name : "not a string", name ? "\"" : "");
    }
    return GDN_OK;
}

/* The gated attention layers' fields. RoPE from transformers 5's rope_parameters, or the older
 * top-level rope_theta / partial_rotary_factor / rope_scaling. A multimodal config's
 * mrope_section is accepted: with text only, every position component is the token's position,
 * which makes the multimodal RoPE the plain one. */
static int parse_attention(json_t *obj, const char *path, const char *where, gdn_model_config *cfg) {
    const int_field ints[] = {
        {"num_attention_heads", 1, (int64_t)1 << 16, &cfg->H},
        {"num_key_value_heads", 1, (int64_t)1 << 16, &cfg->Hkv},
        {"head_dim", 1, 1024, &cfg->d},
    };
    int rc = config_ints(obj, path, where, ints, sizeof ints / sizeof ints[0]);
    if (rc) return rc;
    json_t *bias = json_object_get(obj, "attention_bias");
    if (bias && !json_is_false(bias) && !json_is_null(bias))
        return gdn_fail(GDN_ERR_FORMAT, "%s: '%sattention_bias' must be false: gdncp's attention projections have "
                        "no biases", path, where);
    json_t *rp = json_object_get(obj, "rope_parameters");
    json_t *rs = json_object_get(obj, "rope_scaling");
    json_t *rope = json_is_object(rp) ? rp : obj;
    char rwhere[64];
    snprintf(rwhere, sizeof rwhere, "%s%s", where, json_is_object(rp) ? "rope_parameters." : "");
    json_t *type = json_object_get(rope, "rope_type");
    if (!type && json_is_object(rs)) type = json_object_get(rs, "rope_type") ? json_object_get(rs, "rope_type")
                                                                              : json_object_get(rs, "type");
    if (type && !(json_is_string(type) && !strcmp(json_string_value(type), "default")))
        return gdn_fail(GDN_ERR_FORMAT, "%s: the RoPE type is %s%s%s: gdncp has only \"default\" (no scaling)", path,
                        json_is_string(type) ? "\"" : "", json_is_string(type) ? json_string_value(type) : "not a string",
                        json_is_string(type) ? "\"" : "");
    double theta = 0, factor = 0.25;
    if ((rc = config_real(rope, path, rwhere, "rope_theta", 1.0 + 1e-9, 1e300, 0, 0, &theta)) ||
        (rc = config_real(rope, path, rwhere, "partial_rotary_factor", 0.0, 1.0, 1, 0.25, &factor)))
        return rc;
    cfg->rope_theta = theta;
    cfg->R = (int64_t)((double)cfg->d * factor); /* transformers' int(head_dim * partial_rotary_factor) */
    int64_t max_pos = 0;
    json_t *mp = json_object_get(obj, "max_position_embeddings");
    if (mp && !json_is_null(mp) && (rc = config_int(obj, path, where, "max_position_embeddings", 1, (int64_t)1 << 40, &max_pos)))
        return rc;
    cfg->max_position = max_pos;
    return GDN_OK;
}

/* The model types read and what their MLPs are: Qwen3.5 dense, Qwen3.5-MoE (every layer's MLP a
 * mixture of experts, the chosen experts' weights always renormalised), Qwen3-Next (MoE or dense
 * per layer, below). */
typedef enum { MLP_DENSE = 0, MLP_QWEN35_MOE, MLP_QWEN3_NEXT } mlp_family;
static const struct { const char *type; mlp_family family; } model_types[] = {
    {"qwen3_5_text", MLP_DENSE}, {"qwen3_5", MLP_DENSE}, {"qwen3_5_moe_text", MLP_QWEN35_MOE},
    {"qwen3_5_moe", MLP_QWEN35_MOE}, {"qwen3_next", MLP_QWEN3_NEXT},
};

/* An optional boolean field (absent or null: dflt). */
static int config_bool(json_t *obj, const char *path, const char *where, const char *field, int dflt, int *out) {
    json_t *v = json_object_get(obj, field);
    if (!v || json_is_null(v)) {
        *out = dflt;
        return GDN_OK;
    }
    if (!json_is_boolean(v))
        return gdn_fail(GDN_ERR_FORMAT, "%s: field '%s%s' is not true or false", path, where, field);
    *out = json_is_true(v);
    return GDN_OK;
}
/* An optional integer field in [lo, hi] (absent or null: dflt). */
static int config_int_or(json_t *obj, const char *path, const char *where, const char *field, int64_t lo, int64_t hi,
                         int64_t dflt, int64_t *out) {
    json_t *v = json_object_get(obj, field);
    if (!v || json_is_null(v)) {
        *out = dflt;
        return GDN_OK;
    }
    return config_int(obj, path, where, field, lo, hi, out);
}

/* The MLPs: which layers are mixtures of experts and the experts' fields (transformers' defaults
 * where a field is absent: Qwen3.5-MoE's 256 experts, 8 per token, 512 wide, a shared expert of
 * 512, aux coefficient 0.001; Qwen3-Next's 512 and 10). Qwen3-Next's layer l is MoE unless l is in
 * mlp_only_layers, num_experts is 0, or (l + 1) is not a multiple of decoder_sparse_step
 * (transformers' Qwen3NextDecoderLayer); its dense layers are intermediate_size wide. The dense
 * types have no experts: a num_experts > 0 there is another model, refused. */
static int parse_mlps(json_t *obj, const char *path, const char *where, mlp_family family, gdn_model_config *cfg) {
    json_t *ne = json_object_get(obj, "num_experts");
    int rc = GDN_OK;
    if (family == MLP_DENSE) {
        if (ne && !json_is_null(ne) && !json_is_integer(ne))
            return gdn_fail(GDN_ERR_FORMAT, "%s: field '%snum_experts' is not an integer", path, where);
        if (json_is_integer(ne) && json_integer_value(ne) > 0)
            return gdn_fail(GDN_ERR_FORMAT, "%s: field '%snum_experts' = %lld but '%smodel_type' names a dense Qwen3.5 "
                            "model (its MoE form is \"qwen3_5_moe_text\")", path, where,
                            (long long)json_integer_value(ne), where);
        return config_int(obj, path, where, "intermediate_size", 1, (int64_t)1 << 24, &cfg->I);
    }
    const int next = family == MLP_QWEN3_NEXT;
    int64_t step = 1;
    /* decoder_sparse_step and mlp_only_layers are Qwen3-Next's; gdncp writes them for a Qwen3.5-MoE
     * model with dense layers too (which transformers' Qwen3.5-MoE cannot build) */
    if ((rc = config_int_or(obj, path, where, "num_experts", next ? 0 : 1, GDN_MOE_MAX_EXPERTS, next ? 512 : 256,
                            &cfg->n_experts)) ||
        (rc = config_int_or(obj, path, where, "num_experts_per_tok", 1, GDN_MOE_MAX_EXPERTS, next ? 10 : 8,
                            &cfg->top_k)) ||
        (rc = config_int_or(obj, path, where, "moe_intermediate_size", 1, (int64_t)1 << 20, 512, &cfg->moe_I)) ||
        (rc = config_int_or(obj, path, where, "shared_expert_intermediate_size", 0, (int64_t)1 << 20, 512,
                            &cfg->shared_I)) ||
        (rc = config_bool(obj, path, where, "output_router_logits", 0, &cfg->router_aux)) ||
        (rc = config_real(obj, path, where, "router_aux_loss_coef", 0.0, 1e30, 1, 0.001, &cfg->router_aux_coef)))
        return rc;
    /* Qwen3-Next renormalises by norm_topk_prob; transformers' Qwen3.5-MoE router always does (its
     * released configs say norm_topk_prob true; gdncp writes false for a model that does not) */
    if ((rc = config_bool(obj, path, where, "norm_topk_prob", 1, &cfg->norm_topk))) return rc;
    if ((rc = config_int_or(obj, path, where, "decoder_sparse_step", 1, INT32_MAX, 1, &step))) return rc;
    json_t *only = json_object_get(obj, "mlp_only_layers");
    if (only && !json_is_null(only) && !json_is_array(only))
        return gdn_fail(GDN_ERR_FORMAT, "%s: field '%smlp_only_layers' is not a list of layer indices", path, where);
    for (size_t k = 0; json_is_array(only) && k < json_array_size(only); k++) {
        json_t *v = json_array_get(only, k);
        if (!json_is_integer(v) || json_integer_value(v) < 0)
            return gdn_fail(GDN_ERR_FORMAT, "%s: entry %zu of '%smlp_only_layers' is not a layer index", path, k, where);
    }
    for (int64_t l = 0; l < cfg->L; l++) {
        int dense = cfg->n_experts == 0 || (l + 1) % step != 0;
        for (size_t k = 0; !dense && json_is_array(only) && k < json_array_size(only); k++)
            dense = json_integer_value(json_array_get(only, k)) == l;
        cfg->moe[l] = (unsigned char)!dense;
    }
    if (!gdn_model_moe_layers(cfg)) { /* no expert anywhere: a dense model, whatever the experts' fields say */
        cfg->n_experts = cfg->top_k = cfg->moe_I = cfg->shared_I = 0;
        cfg->norm_topk = cfg->router_aux = 0, cfg->router_aux_coef = 0;
    } else if (cfg->top_k > cfg->n_experts) {
        return gdn_fail(GDN_ERR_SHAPE, "%s: field '%snum_experts_per_tok' = %lld is more than num_experts = %lld", path,
                        where, (long long)cfg->top_k, (long long)cfg->n_experts);
    }
    if (gdn_model_moe_layers(cfg) < cfg->L) /* the dense layers' width */
        return config_int(obj, path, where, "intermediate_size", 1, (int64_t)1 << 24, &cfg->I);
    json_t *is = json_object_get(obj, "intermediate_size"); /* unused; kept to be written back */
    if (json_is_integer(is) && json_integer_value(is) >= 1 && json_integer_value(is) <= ((int64_t)1 << 24))
        cfg->I = (int64_t)json_integer_value(is);
    return GDN_OK;
}

/* *tie_stated: whether the config says tie_word_embeddings (else the weights tell, see
 * gdn_ckpt_load_config). */
static int parse_config(json_t *root, const char *path, gdn_model_config *cfg, int *tie_stated) {
    if (!json_is_object(root)) return gdn_fail(GDN_ERR_FORMAT, "%s: not a JSON object", path);
    /* A multimodal Qwen3.5 config keeps the text model under "text_config". */
    json_t *obj = root;
    const char *where = "";
    json_t *tc = json_object_get(root, "text_config");
    if (!json_object_get(root, "hidden_size") && json_is_object(tc)) obj = tc, where = "text_config.";

    /* Qwen3.5 (text-only or the multimodal one's text model), its MoE form, and Qwen3-Next: the
     * same layers, a different file layout of the GatedDeltaNet projections (read by hf_weights.c). */
    json_t *mt = json_object_get(obj, "model_type");
    const char *type = json_string_value(mt);
    size_t k = 0;
    const size_t ntypes = sizeof model_types / sizeof model_types[0];
    while (type && k < ntypes && strcmp(type, model_types[k].type)) k++;
    if (mt && (!type || k == ntypes))
        return gdn_fail(GDN_ERR_FORMAT, "%s: '%smodel_type' is %s%s%s, not \"qwen3_5_text\", \"qwen3_5\", "
                        "\"qwen3_5_moe_text\", \"qwen3_5_moe\" or \"qwen3_next\"", path, where, type ? "\"" : "",
                        type ? type : "not a string", type ? "\"" : "");
    const mlp_family family = mt ? model_types[k].family : MLP_DENSE;
    int rc;
    json_t *act = json_object_get(obj, "hidden_act");
    if (act && !(json_is_string(act) && !strcmp(json_string_value(act), "silu")))
        return gdn_fail(GDN_ERR_FORMAT, "%s: '%shidden_act' must be \"silu\" (the SwiGLU MLP)", path,
                        where);

    memset(cfg, 0, sizeof *cfg);
    const int_field ints[] = {
        {"vocab_size", 1, GDN_MODEL_MAX_VOCAB, &cfg->vocab},
        {"hidden_size", 1, (int64_t)1 << 20, &cfg->E},
        {"num_hidden_layers", 1, GDN_MODEL_MAX_LAYERS, &cfg->L},
    };
    if ((rc = config_ints(obj, path, where, ints, sizeof ints / sizeof ints[0]))) return rc;
    if ((rc = parse_layer_types(obj, path, where, cfg))) return rc;
    if ((rc = parse_mlps(obj, path, where, family, cfg))) return rc;
    /* each kind's fields where some layer is of that kind */
    const int64_t na = gdn_model_attn_layers(cfg);
    const int_field linear[] = {
        {"linear_num_key_heads", 1, (int64_t)1 << 16, &cfg->Hk},
        {"linear_num_value_heads", 1, (int64_t)1 << 16, &cfg->Hv},
        {"linear_key_head_dim", 1, GDN_MAX_HEAD_DIM, &cfg->K},
        {"linear_value_head_dim", 1, GDN_MAX_HEAD_DIM, &cfg->V},
        {"linear_conv_kernel_dim", 1, GDN_MAX_CONV, &cfg->Kc},
    };
    if (na < cfg->L && (rc = config_ints(obj, path, where, linear, sizeof linear / sizeof linear[0]))) return rc;
    if (na && (rc = parse_attention(obj, path, where, cfg))) return rc;

    json_t *eps = json_object_get(obj, "rms_norm_eps");
    if (!eps || json_is_null(eps))
        return gdn_fail(GDN_ERR_FORMAT, "%s: field '%srms_norm_eps' is missing", path, where);
    if (!json_is_number(eps))
        return gdn_fail(GDN_ERR_FORMAT, "%s: field '%srms_norm_eps' is not a number", path, where);
    const double e = json_number_value(eps);
    if (!(e > 0.0) || !isfinite((float)e) || (float)e <= 0.0f)
        return gdn_fail(GDN_ERR_SHAPE, "%s: field '%srms_norm_eps' = %g must be positive and finite "
                        "in fp32", path, where, e);
    cfg->eps = (float)e;

    /* The text model's own field, else a multimodal config's top-level one; both stated must
     * agree. Neither: the caller looks at the weights. */
    json_t *tie = json_object_get(obj, "tie_word_embeddings"), *top = obj != root ? json_object_get(root, "tie_word_embeddings") : NULL;
    if (tie && !json_is_boolean(tie))
        return gdn_fail(GDN_ERR_FORMAT, "%s: field '%stie_word_embeddings' is not true or false",
                        path, where);
    if (top && !json_is_boolean(top))
        return gdn_fail(GDN_ERR_FORMAT, "%s: field 'tie_word_embeddings' is not true or false", path);
    if (tie && top && json_is_true(tie) != json_is_true(top))
        return gdn_fail(GDN_ERR_FORMAT, "%s: 'tie_word_embeddings' is %s but '%stie_word_embeddings' is %s", path,
                        json_is_true(top) ? "true" : "false", where, json_is_true(tie) ? "true" : "false");
    if (!tie) tie = top;
    cfg->tie_embeddings = tie ? json_is_true(tie) : 0;
    *tie_stated = tie != NULL;
    return GDN_OK;
}

int gdn_ckpt_load_config(const char *dir, gdn_model_config *cfg) {
    if (!dir || !cfg) return gdn_fail(GDN_ERR_ARG, "checkpoint config: NULL argument");
    char path[PATH_MAX];
    int rc = gdn_path_join(path, sizeof path, dir, CONFIG_FILE);
    if (rc) return rc;
    struct stat st;
    if (stat(path, &st) != 0)
        return gdn_fail(GDN_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    if (!S_ISREG(st.st_mode))
        return gdn_fail(GDN_ERR_IO, "%s: not a regular file (%s)", path, gdn_file_kind(st.st_mode));
    json_error_t err;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &err);
    if (!root)
        return gdn_fail(GDN_ERR_FORMAT, "%s: invalid JSON at line %d column %d: %s", path, err.line,
                        err.column, err.text);
    gdn_model_config parsed;
    int tie_stated = 0;
    rc = parse_config(root, path, &parsed, &tie_stated);
    json_decref(root);
    /* Silent on tying: a file without lm_head.weight is a tied model, as the embedding is then
     * the only head there is; without weights (a config alone), transformers' default, untied. */
    if (!rc && !tie_stated && gdn_hf_has_weights(dir)) {
        int head = 0;
        rc = gdn_hf_weights_hold(dir, "lm_head.weight", &head);
        parsed.tie_embeddings = !head;
    }
    if (!rc) {
        rc = gdn_model_config_check(&parsed);
        if (rc) {
            char why[400];
            snprintf(why, sizeof why, "%s", gdn_errmsg());
            rc = gdn_fail(rc, "%s: %s", path, why);
        }
    }
    if (!rc) *cfg = parsed;
    return rc;
}

/* ------------------------------------------------------------------ the tensor files */

/* The table of gdn_model_tensor(), fetched once. */
static int model_table(const gdn_model_config *cfg, gdn_model_tensor_info **out, int *count) {
    const int n = gdn_model_tensor_count(cfg);
    if (n <= 0) return gdn_fail(GDN_ERR_ARG, "the model configuration has no tensors");
    gdn_model_tensor_info *t = calloc((size_t)n, sizeof *t);
    if (!t) return gdn_fail(GDN_ERR_NOMEM, "cannot allocate the table of %d tensors", n);
    for (int i = 0; i < n; i++) {
        const int rc = gdn_model_tensor(cfg, i, &t[i]);
        if (rc) {
            free(t);
            return rc;
        }
    }
    *out = t, *count = n;
    return GDN_OK;
}

/* A set of flat arrays stored in one file, each tensor as prefix + its name. */
typedef struct {
    const char *prefix;
    float *data;
} tensor_group;

/* The first non-finite value of any tensor, so that a diverged run never replaces (or prunes)
 * the good checkpoints with one that cannot be loaded. */
static int check_finite(const gdn_model_tensor_info *table, int n, const float *data,
                        const char *what, const char *prefix) {
    for (int i = 0; i < n; i++) {
        const int64_t bad = gdn_find_nonfinite_f32(data + table[i].offset, (int64_t)table[i].numel, 1);
        if (bad >= 0)
            return gdn_fail(GDN_ERR_NONFINITE, "%s: tensor '%s%s' holds %g at element %lld", what,
                            prefix, table[i].name, (double)data[table[i].offset + (size_t)bad],
                            (long long)bad);
    }
    return GDN_OK;
}

/* Write the groups' tensors as one F32 safetensors file at path: the project's writer lays out
 * the header and the temporary file; the bytes come straight from the arrays. */
static int write_tensors(const char *path, const gdn_model_tensor_info *table, int n,
                         const tensor_group *groups, int ngroups, int dtype) {
    const size_t esz = dtype == GDN_BF16 ? 2 : 4;
    enum { CHUNK = 1 << 16 };
    uint16_t *half = dtype == GDN_BF16 ? malloc(sizeof(uint16_t) * CHUNK) : NULL;
    if (dtype == GDN_BF16 && !half) return gdn_fail(GDN_ERR_NOMEM, "%s: a conversion buffer", path);
    gdn_st_writer *wr = NULL;
    int rc = gdn_st_writer_create(&wr);
    if (!rc) rc = gdn_st_writer_metadata(wr, "format", "pt");
    char name[sizeof table->name + 32];
    for (int g = 0; g < ngroups && !rc; g++)
        for (int i = 0; i < n && !rc; i++) {
            snprintf(name, sizeof name, "%s%s", groups[g].prefix, table[i].name);
            rc = gdn_st_writer_add_f32(wr, name, (gdn_dtype)dtype, table[i].ndim, table[i].shape, NULL);
        }
    /* The writer stores tensors in the order added, back to back after the header. */
    uint64_t offset = 0;
    if (!rc) {
        snprintf(name, sizeof name, "%s%s", groups[0].prefix, table[0].name);
        rc = gdn_st_writer_offset(wr, name, &offset);
    }
    char tmp[PATH_MAX + 32];
    if (!rc) rc = gdn_st_writer_begin(wr, path, tmp, sizeof tmp);
    gdn_st_writer_destroy(wr);
    if (rc) {
        free(half);
        return rc;
    }
    const int fd = open(tmp, O_WRONLY | O_CLOEXEC);
    int err = fd < 0 ? errno : 0;
    for (int g = 0; g < ngroups && !err; g++)
        for (int i = 0; i < n && !err; i++) {
            const float *src = groups[g].data + table[i].offset;
            /* F32: the floats as they are; BF16: rounded a chunk at a time */
            for (size_t e0 = 0; e0 < table[i].numel && !err; e0 += half ? CHUNK : table[i].numel) {
                const size_t ne = half && table[i].numel - e0 > CHUNK ? CHUNK : table[i].numel - e0;
                if (half)
                    for (size_t e = 0; e < ne; e++) half[e] = gdn_st_bf16(src[e0 + e]);
                const char *bytes = half ? (const char *)half : (const char *)src;
                const size_t len = ne * esz;
                for (size_t done = 0; done < len && !err;) {
                    const ssize_t k = pwrite(fd, bytes + done, len - done, (off_t)(offset + done));
                    if (k < 0 && errno == EINTR) continue;
                    if (k <= 0) err = k < 0 ? errno : EIO;
                    else done += (size_t)k;
                }
                offset += len;
            }
        }
    free(half);
    struct stat st;
    if (!err && fstat(fd, &st) != 0) err = errno;
    if (!err && (uint64_t)st.st_size != offset) err = EFBIG; /* layout assumption broken */
    if (!err && fsync(fd) != 0) err = errno;
    if (fd >= 0 && close(fd) != 0 && !err) err = errno;
    if (err) {
        unlink(tmp);
        return gdn_fail(GDN_ERR_IO, "%s: writing the tensors failed: %s", path, strerror(err));
    }
    return gdn_st_commit(tmp, path);
}

/* Check a file of gdncp's own (the optimizer's moments) against the groups' tensors (names,
 * dtypes, exact shapes, nothing else), then read it into the arrays and check the values are
 * finite. The model's weights, which may come from transformers, go through gdn_hf_read_model. */
static int read_tensors(const char *path, const gdn_model_tensor_info *table, int n,
                        const tensor_group *groups, int ngroups) {
    gdn_st_file *f = NULL;
    int rc = gdn_st_open(&f, path);
    if (rc) return rc;
    char name[sizeof table->name + 32];
    for (int g = 0; g < ngroups && !rc; g++)
        for (int i = 0; i < n && !rc; i++) {
            snprintf(name, sizeof name, "%s%s", groups[g].prefix, table[i].name);
            const gdn_st_tensor *t = gdn_st_find(f, name);
            if (!t) {
                rc = gdn_fail(GDN_ERR_MISSING, "%s: tensor '%s' is missing", path, name);
                break;
            }
            rc = gdn_hf_check_tensor(path, t, &table[i]);
        }
    /* Every expected name was found once, so any further tensor is foreign. */
    if (!rc && gdn_st_count(f) != n * ngroups) {
        for (int k = 0; k < gdn_st_count(f) && !rc; k++) {
            const char *fname = gdn_st_at(f, k)->name;
            int known = 0;
            for (int g = 0; g < ngroups && !known; g++) {
                const size_t pl = strlen(groups[g].prefix);
                if (strncmp(fname, groups[g].prefix, pl)) continue;
                for (int i = 0; i < n && !known; i++) known = !strcmp(fname + pl, table[i].name);
            }
            if (!known)
                rc = gdn_fail(GDN_ERR_FORMAT, "%s: unexpected tensor '%s' (not a parameter of this "
                              "configuration)", path, fname);
        }
    }
    for (int g = 0; g < ngroups && !rc; g++)
        for (int i = 0; i < n && !rc; i++) {
            snprintf(name, sizeof name, "%s%s", groups[g].prefix, table[i].name);
            rc = gdn_st_read_f32(f, name, groups[g].data + table[i].offset, table[i].numel);
        }
    for (int g = 0; g < ngroups && !rc; g++) rc = check_finite(table, n, groups[g].data, path, groups[g].prefix);
    gdn_st_close(f);
    return rc;
}

/* ------------------------------------------------------------------ save */

/* Build the checkpoint's files in tmp_dir. */
static int write_files(const char *tmp_dir, const gdn_model_config *cfg,
                       const gdn_model_tensor_info *table, int n, const float *w,
                       const float *adam_m, const float *adam_v, const char *state_json, int weight_dtype) {
    char path[PATH_MAX];
    int rc = gdn_path_join(path, sizeof path, tmp_dir, CONFIG_FILE);
    if (!rc) rc = write_config(path, cfg, weight_dtype);
    const tensor_group model[1] = {{"", (float *)w}};
    if (!rc) rc = gdn_path_join(path, sizeof path, tmp_dir, MODEL_FILE);
    if (!rc) rc = write_tensors(path, table, n, model, 1, weight_dtype);
    /* the optimizer file: the moments, and beside BF16 weights the fp32 masters they round */
    const tensor_group moments[3] = {{"exp_avg.", (float *)adam_m}, {"exp_avg_sq.", (float *)adam_v},
                                     {MASTER_PREFIX, (float *)w}};
    if (!rc && adam_m) rc = gdn_path_join(path, sizeof path, tmp_dir, OPTIM_FILE);
    if (!rc && adam_m) rc = write_tensors(path, table, n, moments, weight_dtype == GDN_BF16 ? 3 : 2, GDN_F32);
    if (!rc) rc = gdn_path_join(path, sizeof path, tmp_dir, STATE_FILE);
    if (!rc) rc = write_synced(path, state_json, strlen(state_json));
    if (!rc) {
        const int err = fsync_dir(tmp_dir);
        if (err) rc = gdn_fail(GDN_ERR_IO, "%s: fsync failed: %s", tmp_dir, strerror(err));
    }
    return rc;
}

/* Put the complete tmp_dir in place as final; an existing final is moved aside first and
 * removed only once the new one is in place. */
static int install(const char *out_dir, const char *tmp_dir, const char *final, int64_t step) {
    char aside[PATH_MAX], name[64];
    hidden_name(name, sizeof name, step, "old", (long)getpid());
    int rc = gdn_path_join(aside, sizeof aside, out_dir, name);
    if (rc) return rc;
    const int replacing = exists(final);
    if (replacing) {
        remove_tree(aside); /* an earlier failed save of this process */
        if (rename(final, aside) != 0)
            return gdn_fail(GDN_ERR_IO, "%s: cannot move the existing checkpoint aside to %s: %s",
                            final, aside, strerror(errno));
        fsync_dir(out_dir);
        test_hook(2);
    }
    if (rename(tmp_dir, final) != 0) {
        const int err = errno;
        if (replacing && rename(aside, final) == 0) fsync_dir(out_dir);
        return gdn_fail(GDN_ERR_IO, "%s: cannot rename %s into place: %s", final, tmp_dir,
                        strerror(err));
    }
    const int err = fsync_dir(out_dir);
    if (err) return gdn_fail(GDN_ERR_IO, "%s: renamed into place, but fsync of %s failed: %s", final,
                             out_dir, strerror(err));
    if (replacing) {
        test_hook(3);
        const int gone = remove_tree(aside);
        if (gone)
            return gdn_fail(GDN_ERR_IO, "%s written, but the replaced copy %s could not be removed: %s",
                            final, aside, strerror(gone));
    }
    return GDN_OK;
}

static int by_step_descending(const void *a, const void *b) {
    const found_ckpt *x = a, *y = b;
    return x->step < y->step ? 1 : x->step > y->step ? -1 : 0;
}

/* Remove all but the keep_last newest complete checkpoints: each is renamed out of the readers'
 * sight first, so an interrupted removal never leaves a half checkpoint under a real name. */
static int prune(const char *out_dir, int keep_last) {
    found_ckpt *list = NULL;
    int n = 0;
    int rc = list_checkpoints(out_dir, &list, &n);
    if (rc) return rc;
    qsort(list, (size_t)n, sizeof *list, by_step_descending);
    char from[PATH_MAX], to[PATH_MAX], name[64];
    for (int i = keep_last; i < n && !rc; i++) {
        if (list[i].aside) continue; /* only possible for a step we did not just write */
        hidden_name(name, sizeof name, list[i].step, "del", (long)getpid());
        rc = gdn_path_join(from, sizeof from, out_dir, list[i].name);
        if (!rc) rc = gdn_path_join(to, sizeof to, out_dir, name);
        if (rc) break;
        if (rename(from, to) != 0) {
            rc = gdn_fail(GDN_ERR_IO, "%s: cannot remove this old checkpoint (keeping the newest %d): "
                          "%s", from, keep_last, strerror(errno));
            break;
        }
        const int err = remove_tree(to);
        if (err)
            rc = gdn_fail(GDN_ERR_IO, "%s: cannot remove this old checkpoint (keeping the newest %d): "
                          "%s", to, keep_last, strerror(err));
    }
    free(list);
    if (!rc) fsync_dir(out_dir);
    return rc;
}

int gdn_ckpt_save(const char *out_dir, int64_t step, const gdn_model_config *cfg, const float *w,
                  const float *adam_m, const float *adam_v, const char *state_json, int keep_last) {
    return gdn_ckpt_save_dtype(out_dir, step, cfg, w, adam_m, adam_v, state_json, keep_last, GDN_F32);
}

int gdn_ckpt_save_dtype(const char *out_dir, int64_t step, const gdn_model_config *cfg, const float *w,
                        const float *adam_m, const float *adam_v, const char *state_json, int keep_last,
                        int weight_dtype) {
    if (!out_dir || !cfg || !w || (adam_m && !adam_v) || (!adam_m && adam_v))
        return gdn_fail(GDN_ERR_ARG, "checkpoint save: NULL argument (the moments: both or neither)");
    if (weight_dtype != GDN_F32 && weight_dtype != GDN_BF16)
        return gdn_fail(GDN_ERR_ARG, "checkpoint save: weight dtype %d is neither F32 (0) nor BF16 (2)", weight_dtype);
    if (step < 0) return gdn_fail(GDN_ERR_ARG, "checkpoint save: step %lld is negative", (long long)step);
    int rc = gdn_model_config_check(cfg);
    if (rc) return rc;
    if (!state_json) state_json = "{}";
    json_error_t jerr;
    json_t *state = json_loads(state_json, JSON_DECODE_ANY, &jerr);
    if (!state)
        return gdn_fail(GDN_ERR_ARG, "checkpoint save: the trainer state is not JSON (line %d column "
                        "%d: %s)", jerr.line, jerr.column, jerr.text);
    json_decref(state);

    gdn_model_tensor_info *table = NULL;
    int n = 0;
    rc = model_table(cfg, &table, &n);
    if (!rc) rc = check_finite(table, n, w, "refusing to save a checkpoint", "");
    if (!rc && adam_m) rc = check_finite(table, n, adam_m, "refusing to save a checkpoint", "exp_avg.");
    if (!rc && adam_m) rc = check_finite(table, n, adam_v, "refusing to save a checkpoint", "exp_avg_sq.");
    if (rc) {
        free(table);
        return rc;
    }

    /* One level only: a missing parent is more likely a typo than a wish. */
    struct stat st;
    const int made = mkdir(out_dir, 0755) == 0 ? 0 : errno;
    if (made && made != EEXIST) {
        rc = gdn_fail(GDN_ERR_IO, "%s: cannot create the output directory: %s%s", out_dir,
                      strerror(made), made == ENOENT ? " (its parent directory does not exist)" : "");
    } else if (stat(out_dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
        rc = gdn_fail(GDN_ERR_IO, "%s: the output path exists and is not a directory", out_dir);
    }
    char tmp_dir[PATH_MAX], final[PATH_MAX], name[64];
    if (!rc) {
        clean_leftovers(out_dir);
        hidden_name(name, sizeof name, step, "tmp", (long)getpid());
        rc = gdn_path_join(tmp_dir, sizeof tmp_dir, out_dir, name);
    }
    if (!rc) {
        primary_name(name, sizeof name, step);
        rc = gdn_path_join(final, sizeof final, out_dir, name);
    }
    if (!rc) {
        remove_tree(tmp_dir);
        if (mkdir(tmp_dir, 0755) != 0)
            rc = gdn_fail(GDN_ERR_IO, "%s: cannot create the temporary directory: %s", tmp_dir,
                          strerror(errno));
        else
            rc = write_files(tmp_dir, cfg, table, n, w, adam_m, adam_v, state_json, weight_dtype);
        if (!rc) {
            test_hook(1);
            rc = install(out_dir, tmp_dir, final, step);
        }
        if (rc) remove_tree(tmp_dir); /* the previous checkpoints are untouched */
    }
    free(table);
    if (!rc && keep_last > 0) rc = prune(out_dir, keep_last);
    return rc;
}

/* ------------------------------------------------------------------ resolve and load */

int gdn_ckpt_resolve(const char *path, char *dir, size_t n) {
    if (!path || !dir || !n) return gdn_fail(GDN_ERR_ARG, "checkpoint resolve: NULL argument");
    struct stat st;
    if (stat(path, &st) != 0)
        return gdn_fail(GDN_ERR_IO, "%s: no such checkpoint or output directory: %s", path,
                        strerror(errno));
    if (!S_ISDIR(st.st_mode))
        return gdn_fail(GDN_ERR_IO, "%s: not a directory (%s); give a checkpoint directory or a "
                        "training output directory", path,
                        S_ISREG(st.st_mode) ? "a regular file" : gdn_file_kind(st.st_mode));
    if (is_complete(path)) {
        if ((size_t)snprintf(dir, n, "%s", path) >= n)
            return gdn_fail(GDN_ERR_ARG, "%s: path too long", path);
        return GDN_OK;
    }
    found_ckpt *list = NULL;
    int count = 0;
    int rc = list_checkpoints(path, &list, &count);
    if (rc) return rc;
    int best = -1;
    for (int i = 0; i < count; i++)
        if (best < 0 || list[i].step > list[best].step ||
            (list[i].step == list[best].step && !list[i].aside))
            best = i;
    if (best < 0)
        rc = gdn_fail(GDN_ERR_MISSING, "%s: no complete checkpoint (neither %s nor %s here, nor a "
                      "checkpoint-N directory holding them)", path, CONFIG_FILE, MODEL_FILE);
    else if ((size_t)snprintf(dir, n, "%s/%s", path, list[best].name) >= n)
        rc = gdn_fail(GDN_ERR_ARG, "%s/%s: path too long", path, list[best].name);
    free(list);
    return rc;
}

/* A whole small text file, malloc'd and NUL-terminated. */
static int read_text(const char *path, char **out) {
    struct stat st;
    if (stat(path, &st) != 0) return gdn_fail(GDN_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    if (!S_ISREG(st.st_mode))
        return gdn_fail(GDN_ERR_IO, "%s: not a regular file (%s)", path, gdn_file_kind(st.st_mode));
    if (st.st_size > MAX_STATE_BYTES)
        return gdn_fail(GDN_ERR_FORMAT, "%s: %lld bytes, more than a trainer state can be (%lld)", path,
                        (long long)st.st_size, (long long)MAX_STATE_BYTES);
    const int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return gdn_fail(GDN_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    char *text = malloc((size_t)st.st_size + 1);
    if (!text) {
        close(fd);
        return gdn_fail(GDN_ERR_NOMEM, "%s: cannot allocate %lld bytes", path, (long long)st.st_size);
    }
    size_t done = 0;
    int err = 0;
    while (done < (size_t)st.st_size) {
        const ssize_t k = read(fd, text + done, (size_t)st.st_size - done);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            err = k < 0 ? errno : EIO;
            break;
        }
        done += (size_t)k;
    }
    close(fd);
    text[done] = 0;
    if (err) {
        free(text);
        return gdn_fail(GDN_ERR_IO, "%s: read failed: %s", path, strerror(err));
    }
    const size_t nul = strlen(text);
    if (nul != done) {
        free(text);
        return gdn_fail(GDN_ERR_FORMAT, "%s: holds a NUL byte at offset %zu; not JSON text", path, nul);
    }
    *out = text;
    return GDN_OK;
}

/* The checkpoint must describe the model it is loaded into: a differing eps, RoPE or size would
 * otherwise load (they are no tensor's shape, or not all of it) and silently change the model. */
static int same_config(const char *dir, const gdn_model_config *cfg) {
    gdn_model_config file;
    int rc = gdn_ckpt_load_config(dir, &file);
    if (rc) return rc;
    for (int64_t l = 0; l < cfg->L && l < file.L; l++)
        if (file.full_attention[l] != cfg->full_attention[l])
            return gdn_fail(GDN_ERR_SHAPE, "%s/%s: layer %lld is %s but in the model being loaded %s", dir, CONFIG_FILE,
                            (long long)l, file.full_attention[l] ? "full_attention" : "linear_attention",
                            cfg->full_attention[l] ? "full_attention" : "linear_attention");
    for (int64_t l = 0; l < cfg->L && l < file.L; l++)
        if (file.moe[l] != cfg->moe[l])
            return gdn_fail(GDN_ERR_SHAPE, "%s/%s: layer %lld's MLP is %s but in the model being loaded %s", dir,
                            CONFIG_FILE, (long long)l, file.moe[l] ? "a mixture of experts" : "dense",
                            cfg->moe[l] ? "a mixture of experts" : "dense");
    const int linear = gdn_model_attn_layers(cfg) < cfg->L, attn = gdn_model_attn_layers(cfg) > 0;
    const int dense = gdn_model_moe_layers(cfg) < cfg->L, moe = gdn_model_moe_layers(cfg) > 0;
    const struct { const char *field; int64_t file, want; int used; } ints[] = {
        {"hidden_size", file.E, cfg->E, 1},
        {"num_hidden_layers", file.L, cfg->L, 1},
        {"intermediate_size", file.I, cfg->I, dense},
        {"num_experts", file.n_experts, cfg->n_experts, moe},
        {"num_experts_per_tok", file.top_k, cfg->top_k, moe},
        {"moe_intermediate_size", file.moe_I, cfg->moe_I, moe},
        {"shared_expert_intermediate_size", file.shared_I, cfg->shared_I, moe},
        {"norm_topk_prob", file.norm_topk != 0, cfg->norm_topk != 0, moe},
        {"linear_num_key_heads", file.Hk, cfg->Hk, linear},
        {"linear_num_value_heads", file.Hv, cfg->Hv, linear},
        {"linear_key_head_dim", file.K, cfg->K, linear},
        {"linear_value_head_dim", file.V, cfg->V, linear},
        {"linear_conv_kernel_dim", file.Kc, cfg->Kc, linear},
        {"num_attention_heads", file.H, cfg->H, attn},
        {"num_key_value_heads", file.Hkv, cfg->Hkv, attn},
        {"head_dim", file.d, cfg->d, attn},
        {"the rotary dims (head_dim x partial_rotary_factor)", file.R, cfg->R, attn},
        {"max_position_embeddings", file.max_position, cfg->max_position, attn && cfg->max_position}, /* 0: none */
        {"tie_word_embeddings", file.tie_embeddings != 0, cfg->tie_embeddings != 0, 1},
    };
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++)
        if (ints[i].used && ints[i].file != ints[i].want)
            return gdn_fail(GDN_ERR_SHAPE, "%s/%s: %s is %lld but the model being loaded has %lld", dir,
                            CONFIG_FILE, ints[i].field, (long long)ints[i].file, (long long)ints[i].want);
    if (file.eps != cfg->eps)
        return gdn_fail(GDN_ERR_SHAPE, "%s/%s: rms_norm_eps is %g but the model being loaded has %g", dir,
                        CONFIG_FILE, (double)file.eps, (double)cfg->eps);
    if (attn && file.rope_theta != cfg->rope_theta)
        return gdn_fail(GDN_ERR_SHAPE, "%s/%s: rope_theta is %.17g but the model being loaded has %.17g", dir,
                        CONFIG_FILE, file.rope_theta, cfg->rope_theta);
    return GDN_OK;
}

/* The optimizer file `path` into the moments; when it also holds the fp32 master weights (a BF16
 * save), they replace w, which must be their rounding bit for bit (else the two files come from
 * different saves, and neither is trusted). */
static int read_moments(const char *dir, const char *path, const gdn_model_config *cfg,
                        const gdn_model_tensor_info *table, int n, float *w, float *adam_m, float *adam_v) {
    gdn_st_file *f = NULL;
    int rc = gdn_st_open(&f, path);
    if (rc) return rc;
    char name[sizeof table->name + 32];
    snprintf(name, sizeof name, MASTER_PREFIX "%s", table[0].name);
    const int masters = gdn_st_find(f, name) != NULL;
    gdn_st_close(f);
    const size_t nw = gdn_model_param_floats(cfg);
    float *master = masters ? malloc(sizeof(float) * nw) : NULL;
    if (masters && !master) return gdn_fail(GDN_ERR_NOMEM, "%s: the master weights (%zu floats)", path, nw);
    if (master) memcpy(master, w, sizeof(float) * nw); /* (padding between tensors kept) */
    const tensor_group groups[3] = {{"exp_avg.", adam_m}, {"exp_avg_sq.", adam_v}, {MASTER_PREFIX, master}};
    rc = read_tensors(path, table, n, groups, masters ? 3 : 2);
    for (int i = 0; masters && !rc && i < n; i++)
        for (size_t e = 0; e < table[i].numel && !rc; e++) {
            const size_t at = table[i].offset + e;
            const uint32_t u = (uint32_t)gdn_st_bf16(master[at]) << 16;
            float r;
            memcpy(&r, &u, sizeof r);
            if (memcmp(&r, &w[at], sizeof r))
                rc = gdn_fail(GDN_ERR_FORMAT, "%s/%s: %s[%zu] = %.9g is not the bf16 rounding of its master weight "
                              "%.9g in %s: the two files come from different saves", dir, MODEL_FILE, table[i].name,
                              e, (double)w[at], (double)master[at], path);
        }
    if (master && !rc) memcpy(w, master, sizeof(float) * nw);
    free(master);
    return rc;
}

int gdn_ckpt_load(const char *dir, const gdn_model_config *cfg, float *w, float *adam_m,
                  float *adam_v, char **state_json) {
    if (!dir || !cfg || !w || (adam_m && !adam_v) || (!adam_m && adam_v))
        return gdn_fail(GDN_ERR_ARG, "checkpoint load: NULL argument (the moments: both or neither)");
    if (state_json) *state_json = NULL;
    int rc = gdn_model_config_check(cfg);
    if (!rc) rc = same_config(dir, cfg);
    if (rc) return rc;
    gdn_model_tensor_info *table = NULL;
    int n = 0;
    rc = model_table(cfg, &table, &n);
    if (rc) return rc;
    char path[PATH_MAX];
    rc = gdn_hf_read_model(dir, cfg, table, n, w);
    if (!rc) rc = gdn_path_join(path, sizeof path, dir, MODEL_FILE);
    if (!rc) rc = check_finite(table, n, w, path, "");
    if (!rc && adam_m) rc = gdn_path_join(path, sizeof path, dir, OPTIM_FILE);
    if (!rc && adam_m) {
        struct stat st;
        if (stat(path, &st) != 0)
            rc = gdn_fail(GDN_ERR_IO, "%s: the optimizer state is missing (%s): this checkpoint can "
                          "start a run (--init) but not resume one", path, strerror(errno));
        else
            rc = read_moments(dir, path, cfg, table, n, w, adam_m, adam_v);
    }
    free(table);
    if (!rc && state_json) rc = gdn_path_join(path, sizeof path, dir, STATE_FILE);
    if (!rc && state_json) rc = read_text(path, state_json);
    return rc;
}

/* dir/trainer_state.json parsed into *j (path: its name), or *j NULL when the directory has none
 * (not a gdncp training checkpoint, e.g. transformers'). */
static int read_state(const char *dir, char path[4096], json_t **j) {
    *j = NULL;
    int rc = gdn_path_join(path, 4096, dir, STATE_FILE);
    struct stat st;
    if (rc || stat(path, &st) != 0) return rc;
    char *text = NULL;
    if ((rc = read_text(path, &text))) return rc;
    json_error_t err;
    *j = json_loads(text, 0, &err);
    free(text);
    return *j ? GDN_OK : gdn_fail(GDN_ERR_FORMAT, "%s: %s (line %d)", path, err.text, err.line);
}

int gdn_ckpt_pack_separator(const char *dir, uint8_t *sep, int cap, int *len) {
    if (!dir || !sep || !len || cap < 1) return gdn_fail(GDN_ERR_ARG, "checkpoint separator: NULL argument");
    *len = 0;
    char path[4096];
    json_t *j;
    int rc = read_state(dir, path, &j);
    if (rc || !j) return rc; /* not a gdncp training checkpoint: not packed */
    const char *hex = json_string_value(json_object_get(j, "pack_separator_hex"));
    const size_t n = hex ? strlen(hex) : 0;
    if (n % 2 || n / 2 > (size_t)cap)
        rc = gdn_fail(GDN_ERR_FORMAT, "%s: pack_separator_hex '%s' is not 1 to %d bytes of hex", path, hex, cap);
    for (size_t i = 0; !rc && i < n / 2; i++) {
        unsigned byte;
        if (!isxdigit((unsigned char)hex[2 * i]) || !isxdigit((unsigned char)hex[2 * i + 1]) ||
            sscanf(hex + 2 * i, "%2x", &byte) != 1)
            rc = gdn_fail(GDN_ERR_FORMAT, "%s: pack_separator_hex '%s' is not hex", path, hex);
        else
            sep[i] = (uint8_t)byte;
    }
    if (!rc) *len = (int)(n / 2);
    json_decref(j);
    return rc;
}

int gdn_ckpt_pack_separator_id(const char *dir, int64_t *id) {
    if (!dir || !id) return gdn_fail(GDN_ERR_ARG, "checkpoint separator id: NULL argument");
    *id = -1;
    char path[4096];
    json_t *j;
    int rc = read_state(dir, path, &j);
    if (rc || !j) return rc; /* not a gdncp training checkpoint: not packed */
    json_t *v = json_object_get(j, "pack_separator_id");
    if (v && !(json_is_integer(v) && json_integer_value(v) >= -1 && json_integer_value(v) < GDN_MODEL_MAX_VOCAB))
        rc = gdn_fail(GDN_ERR_FORMAT, "%s: pack_separator_id is not an integer in [-1, %lld)", path,
                      (long long)GDN_MODEL_MAX_VOCAB);
    else if (v)
        *id = (int64_t)json_integer_value(v);
    json_decref(j);
    return rc;
}
