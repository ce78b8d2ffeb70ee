/* config.json: transformers' configuration of Qwen3.5 (dense, text-only or the multimodal one's
 * text_config), Qwen3.5-MoE and Qwen3-Next, read into gdn_model_config and written from it; the
 * model's one reader of it (gdn_ckpt_load_config) and its writer (what a checkpoint saves, which
 * transformers loads). */
#include "hf_config.h"

#include "base.h"
#include "hf_weights.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define CONFIG_FILE GDN_HF_CONFIG_FILE


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

int gdn_hf_config_text(const gdn_model_config *cfg, int weight_dtype, char **out) {
    *out = NULL;
    /* gdncp writes its MoE models as Qwen3.5-MoE, whose router (transformers') always renormalises */
    if (gdn_model_moe_layers(cfg) && !cfg->norm_topk)
        return gdn_fail(GDN_ERR_ARG, "config.json: this model's router does not renormalise its top-k weights "
                        "(norm_topk_prob false, a Qwen3-Next's), which a Qwen3.5-MoE checkpoint cannot say: "
                        "transformers' Qwen3.5-MoE router always renormalises");
    json_t *root = config_json(cfg);
    if (root && weight_dtype == GDN_BF16) json_object_set_new(root, "dtype", json_string("bfloat16"));
    /* Nine significant digits hold any float exactly; the sorted, indented form is transformers'. */
    char *text = root ? json_dumps(root, JSON_INDENT(2) | JSON_SORT_KEYS | JSON_REAL_PRECISION(9))
                      : NULL;
    json_decref(root);
    if (!text) return gdn_fail(GDN_ERR_NOMEM, "config.json: cannot build the JSON text");
    const size_t len = strlen(text);
    char *with_newline = gdn_realloc("hf_config: with_newline", text, len + 2);
    if (!with_newline) {
        free(text);
        return gdn_fail(GDN_ERR_NOMEM, "config.json: cannot build the JSON text");
    }
    with_newline[len] = '\n', with_newline[len + 1] = 0;
    *out = with_newline;
    return GDN_OK;
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
/* What the last gdn_ckpt_resolve and gdn_ckpt_load_config on this thread noticed and did not
 * follow, each its own (each call clears its own), joined by gdn_ckpt_note. */
static _Thread_local char config_note[PATH_MAX + 512], resolve_note[2 * PATH_MAX + 512], both[4 + sizeof resolve_note +
                                                                                               sizeof config_note];

void gdn_ckpt_resolve_note(const char *text) { snprintf(resolve_note, sizeof resolve_note, "%s", text ? text : ""); }

const char *gdn_ckpt_note(void) {
    snprintf(both, sizeof both, "%s%s%s", resolve_note, *resolve_note && *config_note ? "; " : "", config_note);
    return both;
}

static int parse_mlps(json_t *obj, const char *path, const char *where, mlp_family family, gdn_model_config *cfg) {
    json_t *ne = json_object_get(obj, "num_experts");
    int rc = GDN_OK;
    if (family == MLP_DENSE) {
        if (ne && !json_is_null(ne) && !json_is_integer(ne))
            return gdn_fail(GDN_ERR_FORMAT, "%s: field '%snum_experts' is not an integer", path, where);
        if (json_is_integer(ne) && json_integer_value(ne) > 0)
            return gdn_fail(GDN_ERR_SHAPE, "%s: field '%snum_experts' = %lld but '%smodel_type' names a dense Qwen3.5 "
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
    /* Qwen3-Next renormalises by norm_topk_prob; transformers' Qwen3.5-MoE router always does and
     * never reads the field (transformers 5.25, Qwen3_5MoeTopKRouter): followed, and a false there
     * said in the config note (gdn_ckpt_note) */
    if ((rc = config_bool(obj, path, where, "norm_topk_prob", 1, &cfg->norm_topk))) return rc;
    if (!next && !cfg->norm_topk) {
        cfg->norm_topk = 1;
        snprintf(config_note, sizeof config_note, "%s: '%snorm_topk_prob' false is ignored: transformers' Qwen3.5-MoE "
                 "router (model_type \"qwen3_5_moe_text\") always renormalises the top-k routing weights, and gdncp "
                 "computes what transformers does (Qwen3-Next's router honours the field)", path, where);
    }
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
    config_note[0] = 0;
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
    if (!rc && gdn_hf_has_weights(dir)) rc = gdn_hf_check_embedding(dir, &parsed, path);
    if (!rc) *cfg = parsed;
    return rc;
}

/* The checkpoint must describe the model it is loaded into: a differing eps, RoPE or size would
 * otherwise load (they are no tensor's shape, or not all of it) and silently change the model. */
int gdn_hf_config_same(const char *dir, const gdn_model_config *cfg) {
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
