/* The model's configurations, flat parameter layout (every tensor's Hugging Face name, shape and
 * place) and initialisation (DESIGN §5): what a checkpoint reader needs, apart from the compute in
 * model.c. */
#include "model_internal.h"

#include "base.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

void *gdn_model_alloc(size_t bytes, int zeroed) {
    return zeroed ? gdn_alloc_large_zeroed("gdn_model_alloc", bytes) : gdn_alloc_large("gdn_model_alloc", bytes);
}

/* ---------------------------------------------------------------- configurations */

int gdn_model_config_named(const char *name, gdn_model_config *c) {
    /* Hybrid like Qwen3.5: every fourth layer gated full attention ((l + 1) % 4 == 0), the others
     * GatedDeltaNet; conv 4, eps 1e-6, untied, attention R = d / 4 rotary dims, rope_theta 1e7 */
#define HYBRID(E_, L_, I_, Hk_, Hv_, K_, V_, H_, Hkv_, d_)                                              \
    {.vocab = 256, .E = E_, .L = L_, .I = I_, .Hk = Hk_, .Hv = Hv_, .K = K_, .V = V_, .Kc = 4, .eps = 1e-6f, \
     .H = H_, .Hkv = Hkv_, .d = d_, .R = (d_) / 4, .rope_theta = 1e7}
    /* The MoE forms: every MLP a sparse MoE block whose active width (top_k x moe_I + shared_I)
     * is the dense form's I, the aux loss on with Qwen's coefficient 0.001 */
#define MOE(n_, k_, I_, Is_) .n_experts = n_, .top_k = k_, .moe_I = I_, .shared_I = Is_, .norm_topk = 1, \
                             .router_aux = 1, .router_aux_coef = 1e-3
    /* Qwen3.5's published dense shapes (their config.json): the 248,320-token vocabulary, tied,
     * 24 layers, GatedDeltaNet heads of 128, attention 8/2 heads of 256 with 64 rotary dims */
#define QWEN35(E_, I_)                                                                                     \
    {.vocab = 248320, .E = E_, .L = 24, .I = I_, .Hk = 16, .Hv = 16, .K = 128, .V = 128, .Kc = 4, .eps = 1e-6f, \
     .tie_embeddings = 1, .H = 8, .Hkv = 2, .d = 256, .R = 64, .rope_theta = 1e7, .max_position = 262144}
#define HYBRID_MOE(E_, L_, Hk_, Hv_, K_, V_, H_, Hkv_, d_, ...)                                               \
    {.vocab = 256, .E = E_, .L = L_, .Hk = Hk_, .Hv = Hv_, .K = K_, .V = V_, .Kc = 4, .eps = 1e-6f, .H = H_,  \
     .Hkv = Hkv_, .d = d_, .R = (d_) / 4, .rope_theta = 1e7, MOE(__VA_ARGS__)}
    static const struct { const char *name; gdn_model_config cfg; } named[] = {
        /* E, L, I, Hk, Hv, K, V, H, Hkv, d */
        {"tiny", HYBRID(128, 4, 192, 1, 2, 32, 32, 2, 1, 32)},
        {"small", HYBRID(256, 4, 768, 2, 4, 64, 64, 4, 2, 64)},
        {"long", HYBRID(128, 4, 256, 2, 4, 32, 32, 4, 2, 32)},
        /* E, L, Hk, Hv, K, V, H, Hkv, d, experts, top_k, moe_I, shared_I */
        {"tiny-moe", HYBRID_MOE(128, 4, 1, 2, 32, 32, 2, 1, 32, 8, 2, 64, 64)},
        {"small-moe", HYBRID_MOE(256, 4, 2, 4, 64, 64, 4, 2, 64, 32, 4, 128, 256)},
        /* E, I */
        {"qwen3.5-0.8b", QWEN35(1024, 3584)},
        {"qwen3.5-2b", QWEN35(2048, 6144)},
    };
#undef QWEN35
#undef HYBRID_MOE
#undef MOE
#undef HYBRID
    for (size_t i = 0; i < sizeof named / sizeof named[0]; i++)
        if (name && !strcmp(name, named[i].name)) {
            *c = named[i].cfg;
            gdn_model_set_attention_interval(c, GDN_MODEL_NAMED_ATTN_INTERVAL);
            for (int64_t l = 0; c->n_experts && l < c->L; l++) c->moe[l] = 1;
            return 1;
        }
    return 0;
}

gdn_layer_config gdn_model_layer_config(const gdn_model_config *c, int64_t B, int64_t T) {
    gdn_layer_config lc = gdn_layer_config_default(B, T, c->E, c->Hk, c->Hv, c->K, c->V);
    lc.Kc = c->Kc;
    lc.eps = c->eps;
    return lc;
}

gdn_attn_config gdn_model_attn_config(const gdn_model_config *c, int64_t B, int64_t T) {
    gdn_attn_config ac = gdn_attn_config_default(B, T, c->E, c->H, c->Hkv, c->d);
    ac.R = c->R, ac.rope_theta = c->rope_theta, ac.eps = c->eps, ac.max_position = c->max_position;
    return ac;
}

int64_t gdn_model_attn_before(const gdn_model_config *c, int64_t n) {
    int64_t k = 0;
    for (int64_t l = 0; l < n && l < GDN_MODEL_MAX_LAYERS; l++) k += is_attn(c, l);
    return k;
}
int64_t gdn_model_moe_before(const gdn_model_config *c, int64_t n) {
    int64_t k = 0;
    for (int64_t l = 0; l < n && l < GDN_MODEL_MAX_LAYERS; l++) k += is_moe(c, l);
    return k;
}
int64_t gdn_model_count_layers(const gdn_model_config *c, int kind) {
    if (!c) return gdn_fail(GDN_ERR_ARG, "gdn_model_count_layers: cfg is NULL"), -1;
    switch (kind) {
    case GDN_MODEL_ATTN_LAYERS: return gdn_model_attn_before(c, c->L);
    case GDN_MODEL_MOE_LAYERS: return gdn_model_moe_before(c, c->L);
    default: return gdn_fail(GDN_ERR_ARG, "gdn_model_count_layers: kind %d (GDN_MODEL_ATTN_LAYERS or GDN_MODEL_MOE_LAYERS)", kind), -1;
    }
}

gdn_moe_config gdn_model_moe_config(const gdn_model_config *c, int64_t N) {
    gdn_moe_config mc = gdn_moe_config_default(N, c->E, c->n_experts, c->top_k, c->moe_I, c->shared_I);
    mc.norm_topk = c->norm_topk;
    mc.ep_size = c->ep_size, mc.ep_rank = c->ep_rank;
    return mc;
}

void gdn_model_set_attention_interval(gdn_model_config *c, int64_t interval) {
    memset(c->full_attention, 0, sizeof c->full_attention);
    for (int64_t l = 0; interval > 0 && l < c->L && l < GDN_MODEL_MAX_LAYERS; l++)
        c->full_attention[l] = (l + 1) % interval == 0;
}

int gdn_model_config_check(const gdn_model_config *c) {
    if (!c) return gdn_fail(GDN_ERR_ARG, "model config is NULL");
    if (c->vocab < 1 || c->vocab > GDN_MODEL_MAX_VOCAB)
        return gdn_fail(GDN_ERR_SHAPE, "model vocab_size = %lld is out of range [1, %lld]", (long long)c->vocab,
                        (long long)GDN_MODEL_MAX_VOCAB);
    if (c->L < 1 || c->L > GDN_MODEL_MAX_LAYERS)
        return gdn_fail(GDN_ERR_SHAPE, "model num_hidden_layers = %lld is out of range [1, %d]", (long long)c->L,
                        GDN_MODEL_MAX_LAYERS);
    for (int64_t l = 0; l < GDN_MODEL_MAX_LAYERS; l++) {
        if (c->full_attention[l] > 1)
            return gdn_fail(GDN_ERR_ARG, "model full_attention[%lld] = %d: 1 (full attention) or 0 (GatedDeltaNet)",
                            (long long)l, c->full_attention[l]);
        if (l >= c->L && c->full_attention[l])
            return gdn_fail(GDN_ERR_SHAPE, "model full_attention[%lld] = 1 but the model has %lld layers",
                            (long long)l, (long long)c->L);
        if (c->moe[l] > 1)
            return gdn_fail(GDN_ERR_ARG, "model moe[%lld] = %d: 1 (sparse MoE MLP) or 0 (dense)", (long long)l,
                            c->moe[l]);
        if (l >= c->L && c->moe[l])
            return gdn_fail(GDN_ERR_SHAPE, "model moe[%lld] = 1 but the model has %lld layers", (long long)l,
                            (long long)c->L);
    }
    /* each MLP kind's dimensions only where some layer is of that kind */
    const int64_t nm = gdn_model_moe_layers(c);
    if (nm < c->L && (c->I < 1 || c->I > (int64_t)1 << 20))
        return gdn_fail(GDN_ERR_SHAPE, "model intermediate_size = %lld is out of range [1, %lld]", (long long)c->I,
                        (long long)1 << 20);
    if (c->ep_size > 1 && !nm)
        return gdn_fail(GDN_ERR_ARG, "model ep_size = %lld: expert parallelism needs MoE layers, and this model has "
                        "none", (long long)c->ep_size);
    if (!nm && c->ep_rank)
        return gdn_fail(GDN_ERR_ARG, "model ep_rank = %lld without expert parallelism", (long long)c->ep_rank);
    if (nm) {
        const gdn_moe_config mc = gdn_model_moe_config(c, 1);
        int rc = gdn_moe_config_check(&mc);
        if (rc) return rc;
        if (!(c->router_aux_coef >= 0.0) || !isfinite(c->router_aux_coef))
            return gdn_fail(GDN_ERR_ARG, "model router_aux_loss_coef = %g must be finite and >= 0", c->router_aux_coef);
    }
    /* each kind's dimensions only where some layer is of that kind */
    const int64_t na = gdn_model_attn_layers(c);
    int rc = GDN_OK;
    if (na < c->L) {
        const gdn_layer_config lc = gdn_model_layer_config(c, 1, 1);
        rc = gdn_layer_config_check(&lc);
    }
    if (!rc && na) {
        const gdn_attn_config ac = gdn_model_attn_config(c, 1, 1);
        rc = gdn_attn_config_check(&ac);
    }
    return rc;
}

/* ---------------------------------------------------------------- the flat parameter layout */

/* Floats of one mixer block of each kind (0 for a kind the model does not use: its dimensions
 * may be unset), of layer l's, and of the norms and the MLP that follow every mixer. */
static size_t gdn_mixer_floats(const gdn_model_config *c) {
    if (gdn_model_attn_layers(c) == c->L) return 0;
    const gdn_layer_config lc = gdn_model_layer_config(c, 1, 1);
    return pad16(gdn_layer_param_floats(&lc));
}
static size_t attn_mixer_floats(const gdn_model_config *c) {
    if (!gdn_model_attn_layers(c)) return 0;
    const gdn_attn_config ac = gdn_model_attn_config(c, 1, 1);
    return pad16(gdn_attn_param_floats(&ac));
}
static size_t mixer_floats(const gdn_model_config *c, int64_t l) {
    return is_attn(c, l) ? attn_mixer_floats(c) : gdn_mixer_floats(c);
}

/* ---- the MLP kinds' parameter layouts: the dense SwiGLU (gate_proj, up_proj, down_proj, each
 * padded to 16 floats) and the sparse MoE block (moe.h's flat layout), each tensor named under
 * the layer's "mlp." module. One entry per kind; model.c's mlp_ops holds their compute. */
static const char *const dense_names[DENSE_COUNT] = {"gate_proj.weight", "up_proj.weight", "down_proj.weight"};
static size_t dense_floats(const gdn_model_config *c) { return 3 * pad16((size_t)(c->I * c->E)); }
static int dense_count(const gdn_model_config *c) { return DENSE_COUNT; }
static void dense_tensor(const gdn_model_config *c, int j, gdn_model_tensor_info *t) {
    snprintf(t->name, sizeof t->name, "%s", dense_names[j]);
    t->ndim = 2;
    t->shape[0] = j == DENSE_DOWN ? c->E : c->I;
    t->shape[1] = j == DENSE_DOWN ? c->I : c->E;
    t->offset = (size_t)j * pad16((size_t)(c->I * c->E));
    t->numel = (size_t)(c->I * c->E);
}
static size_t moe_floats(const gdn_model_config *c) {
    const gdn_moe_config mc = gdn_model_moe_config(c, 1);
    return pad16(gdn_moe_param_floats(&mc));
}
/* Without a shared expert (shared_I = 0) its three tensors and its gate are absent. */
static int moe_count(const gdn_model_config *c) { return c->shared_I > 0 ? GDN_MOE_COUNT : GDN_MOE_SHARED_GATE; }
static void moe_tensor(const gdn_model_config *c, int j, gdn_model_tensor_info *t) {
    const gdn_moe_config mc = gdn_model_moe_config(c, 1);
    snprintf(t->name, sizeof t->name, "%s", gdn_moe_param_name(j));
    t->ndim = gdn_moe_param_shape(&mc, j, t->shape);
    t->offset = gdn_moe_param_offset(&mc, j);
    t->numel = gdn_moe_param_numel(&mc, j);
    if (j == GDN_MOE_GATE_UP || j == GDN_MOE_DOWN) {
        t->experts_whole = c->n_experts;
        gdn_moe_local_experts(&mc, &t->expert_first);
    }
}
static const gdn_mlp_layout mlp_layouts[2] = {
    {"dense", dense_floats, dense_count, dense_tensor},
    {"moe", moe_floats, moe_count, moe_tensor},
};
const gdn_mlp_layout *gdn_model_mlp_layout(const gdn_model_config *c, int64_t l) { return &mlp_layouts[is_moe(c, l)]; }

static size_t embed_floats(const gdn_model_config *c) { return pad16((size_t)(c->vocab * c->E)); }

size_t gdn_model_layer_offset(const gdn_model_config *c, int64_t l) {
    /* the layers before l, counted by kind (dense and MoE blocks, GatedDeltaNet and attention mixers) */
    const int64_t na = gdn_model_attn_before(c, l), nm = gdn_model_moe_before(c, l);
    const size_t norms = 2 * pad16((size_t)c->E);
    size_t off = embed_floats(c) + (size_t)l * norms + (size_t)na * attn_mixer_floats(c) +
                 (size_t)(l - na) * gdn_mixer_floats(c);
    if (nm) off += (size_t)nm * mlp_layouts[1].floats(c);
    if (l - nm) off += (size_t)(l - nm) * mlp_layouts[0].floats(c);
    return off;
}
size_t gdn_model_blk_offset(const gdn_model_config *c, int64_t l, int which) {
    return gdn_model_layer_offset(c, l) + mixer_floats(c, l) + (size_t)which * pad16((size_t)c->E);
}
size_t gdn_model_final_norm_offset(const gdn_model_config *c) { return gdn_model_layer_offset(c, c->L); }
size_t gdn_model_lm_head_offset(const gdn_model_config *c) {
    return c->tie_embeddings ? 0 : gdn_model_final_norm_offset(c) + pad16((size_t)c->E);
}

size_t gdn_model_unit_offset(const gdn_model_config *c, int64_t u) {
    if (u <= 0) return 0;
    return u <= c->L + 1 ? gdn_model_layer_offset(c, u - 1) : gdn_model_param_floats(c);
}

size_t gdn_model_param_floats(const gdn_model_config *c) {
    return gdn_model_final_norm_offset(c) + pad16((size_t)c->E) + (c->tie_embeddings ? 0 : embed_floats(c));
}

/* Tensors of layer l: its mixer's, then the norms and the MLP. */
static int mixer_tensors(const gdn_model_config *c, int64_t l) { return is_attn(c, l) ? GDN_A_COUNT : GDN_P_COUNT; }
static int head_tensors(const gdn_model_config *c) { return c->tie_embeddings ? 1 : 2; } /* after the layers */
/* Layer l's: its mixer's, the two norms, its MLP's. */
static int layer_tensors(const gdn_model_config *c, int64_t l) {
    return mixer_tensors(c, l) + 2 + gdn_model_mlp_layout(c, l)->count(c);
}

int gdn_model_tensor_count(const gdn_model_config *c) {
    int n = 1 + head_tensors(c);
    for (int64_t l = 0; l < c->L; l++) n += layer_tensors(c, l);
    return n;
}

/* The embedding (which 0), the final norm (1), lm_head (2). */
static void outer_tensor(const gdn_model_config *c, int which, gdn_model_tensor_info *t) {
    static const char *const names[3] = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"};
    snprintf(t->name, sizeof t->name, "%s", names[which]);
    t->ndim = which == 1 ? 1 : 2;
    t->shape[0] = which == 1 ? c->E : c->vocab;
    t->shape[1] = c->E;
    t->offset = which == 0 ? 0 : which == 1 ? gdn_model_final_norm_offset(c) : gdn_model_lm_head_offset(c);
    t->numel = which == 1 ? (size_t)c->E : (size_t)(c->vocab * c->E);
    t->decay = which != 1;
}

/* Tensor j of layer l's mixer, under its Hugging Face module (linear_attn or self_attn). */
static void mixer_tensor(const gdn_model_config *c, int64_t l, int j, gdn_model_tensor_info *t) {
    const size_t base = gdn_model_layer_offset(c, l);
    if (is_attn(c, l)) {
        const gdn_attn_config ac = gdn_model_attn_config(c, 1, 1);
        snprintf(t->name, sizeof t->name, "model.layers.%lld.self_attn.%s", (long long)l, gdn_attn_param_name(j));
        t->ndim = gdn_attn_param_shape(&ac, j, t->shape);
        t->offset = base + gdn_attn_param_offset(&ac, j);
        t->numel = gdn_attn_param_numel(&ac, j);
    } else {
        const gdn_layer_config lc = gdn_model_layer_config(c, 1, 1);
        snprintf(t->name, sizeof t->name, "model.layers.%lld.linear_attn.%s", (long long)l, gdn_layer_param_name(j));
        t->ndim = gdn_layer_param_shape(&lc, j, t->shape);
        t->offset = base + gdn_layer_param_offset(&lc, j);
        t->numel = gdn_layer_param_numel(&lc, j);
    }
    t->decay = t->ndim >= 2;
}

int gdn_model_tensor(const gdn_model_config *c, int i, gdn_model_tensor_info *t) {
    const int n = gdn_model_tensor_count(c), tail = head_tensors(c);
    if (i < 0 || i >= n) return gdn_fail(GDN_ERR_ARG, "model tensor index %d is out of range [0, %d)", i, n);
    memset(t, 0, sizeof *t);
    if (i == 0 || i >= n - tail) {
        outer_tensor(c, i == 0 ? 0 : i - (n - tail) + 1, t);
        return GDN_OK;
    }
    int j = i - 1;
    int64_t l = 0;
    for (; j >= layer_tensors(c, l); l++) j -= layer_tensors(c, l);
    if (j < mixer_tensors(c, l)) {
        mixer_tensor(c, l, j, t);
        return GDN_OK;
    }
    j -= mixer_tensors(c, l);
    if (j < 2) { /* input_layernorm, post_attention_layernorm */
        snprintf(t->name, sizeof t->name, "model.layers.%lld.%s", (long long)l,
                 j ? "post_attention_layernorm.weight" : "input_layernorm.weight");
        t->offset = gdn_model_blk_offset(c, l, j);
        t->numel = (size_t)c->E;
        t->ndim = 1, t->shape[0] = c->E;
        return GDN_OK;
    }
    gdn_model_mlp_layout(c, l)->tensor(c, j - 2, t);
    char leaf[sizeof t->name];
    memcpy(leaf, t->name, sizeof leaf); /* a leaf name is short: "experts.gate_up_proj" at most */
    snprintf(t->name, sizeof t->name, "model.layers.%lld.mlp.%.40s", (long long)l, leaf);
    t->offset += gdn_model_blk_offset(c, l, BLK_MLP);
    t->decay = t->ndim >= 2;
    return GDN_OK;
}

size_t gdn_model_param_count(const gdn_model_config *c) {
    size_t n = 0;
    gdn_model_tensor_info t;
    for (int i = 0; i < gdn_model_tensor_count(c); i++)
        if (!gdn_model_tensor(c, i, &t)) n += t.numel;
    return n;
}

/* ---------------------------------------------------------------- initialisation */

static uint64_t splitmix64(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static double uniform01(uint64_t *s) { return ((splitmix64(s) >> 11) + 0.5) * 0x1.0p-53; }
static double normal(uint64_t *s) { /* Box-Muller */
    return sqrt(-2.0 * log(uniform01(s))) * cos(6.283185307179586 * uniform01(s));
}

void gdn_model_init_range(const gdn_model_config *c, float *w, uint64_t seed, size_t lo, size_t hi) {
    memset(w, 0, sizeof(float) * (hi - lo));
    gdn_model_tensor_info t;
    for (int i = 0; i < gdn_model_tensor_count(c); i++) {
        gdn_model_tensor(c, i, &t);
        /* this tensor's elements [k0, k1) inside [lo, hi) */
        const size_t k0 = lo > t.offset ? lo - t.offset : 0;
        const size_t k1 = hi < t.offset + t.numel ? (hi > t.offset ? hi - t.offset : 0) : t.numel;
        if (k0 >= k1) continue;
        uint64_t s = seed * 0x100000001b3ull + (uint64_t)i; /* each tensor its own stream */
#define p(k) w[t.offset + (k) - lo] /* element k of the tensor (k in [k0, k1): inside w) */
        const char *leaf = strrchr(t.name, '.') ? strrchr(t.name, '.') + 1 : t.name;
        const int is_weight_leaf = !strcmp(leaf, "weight");
        const char *base = t.name;
        /* the stream skipped to element k0: a splitmix64 draw adds one constant; uniform draws
         * once an element, normal twice */
        const uint64_t step = 0x9e3779b97f4a7c15ull;
        if (strstr(base, "conv1d.weight")) {
            /* PyTorch's Conv1d default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = Kc */
            const double b = 1.0 / sqrt((double)c->Kc);
            s += (uint64_t)k0 * step;
            for (size_t k = k0; k < k1; k++) p(k) = (float)(b * (2 * uniform01(&s) - 1));
        } else if (strstr(base, "A_log")) {
            /* A uniform in (0, 16], its lower end kept away from 0 (DESIGN §5) */
            s += (uint64_t)k0 * step;
            for (size_t k = k0; k < k1; k++) p(k) = (float)log(0.01 + (16.0 - 0.01) * uniform01(&s));
        } else if (strstr(base, "dt_bias") || strstr(base, "linear_attn.norm.weight")) {
            for (size_t k = k0; k < k1; k++) p(k) = 1.0f;
        } else if (t.ndim == 1 && is_weight_leaf) {
            /* zero-centred RMSNorm: scale 1 + w starts at 1 */
        } else {
            /* a slice of the experts (expert parallelism) draws what the whole tensor's stream
             * draws there: the stream skipped to its first element */
            s += 2 * ((uint64_t)t.expert_first * (uint64_t)(t.numel / (size_t)t.shape[0]) + (uint64_t)k0) * step;
            for (size_t k = k0; k < k1; k++) p(k) = (float)(0.02 * normal(&s));
        }
    }
#undef p
}

void gdn_model_init(const gdn_model_config *c, float *w, uint64_t seed) {
    gdn_model_init_range(c, w, seed, 0, gdn_model_param_floats(c));
}

/* ---------------------------------------------------------------- plan */

/* A token's FLOPs through the model: passes 1 (a forward) or 3 (forward and backward, the
 * weights' products twice as many backward), the lm_head's product included or not. */
static double flops_per_token(const gdn_model_config *c, int64_t T, int train, int head) {
    /* the embedding's lookup is free; a tied one still does the head's matmul; a token runs only
     * top_k of an MoE layer's n_experts experts (the active parameters) */
    const double idle_experts = (double)gdn_model_moe_layers(c) * (double)(c->n_experts - c->top_k) * 3.0 *
                                (double)c->moe_I * (double)c->E;
    gdn_model_config whole = *c; /* a token's FLOPs are the whole model's, however its experts are split */
    whole.ep_size = 0, whole.ep_rank = 0;
    const double params = (double)gdn_model_param_count(&whole) - (c->tie_embeddings ? 0.0 : (double)(c->vocab * c->E)) -
                          idle_experts - (head ? 0.0 : (double)(c->vocab * c->E));
    const double f = gdn_rule_flops_per_head_token(c->K, c->V, 64, 0), b = gdn_rule_flops_per_head_token(c->K, c->V, 64, 1);
    /* the GatedDeltaNet layers' kernels, and the attention layers' causal cores (forward
     * 2 d H (T + 1) a token: QK^T and PV over half the positions on average; backward 5) */
    const double na = (double)gdn_model_attn_layers(c);
    return (train ? 6 : 2) * params + (double)((c->L - gdn_model_attn_layers(c)) * c->Hv) * (train ? f + b : f) +
           na * (train ? 7.0 : 2.0) * (double)c->d * (double)c->H * (double)(T + 1);
}

double gdn_model_train_flops_per_token(const gdn_model_config *c, int64_t T) { return flops_per_token(c, T, 1, 1); }

double gdn_model_prefill_flops(const gdn_model_config *c, int64_t T, int64_t head_rows) {
    return (double)T * flops_per_token(c, T, 0, 0) + 2.0 * (double)head_rows * (double)c->vocab * (double)c->E;
}
