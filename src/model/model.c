/* The decoder language model's compute: forward + backward of the loss (single rank or a sequence
 * split over a CP group) and decode (its configurations and parameter layout: model_params.c).
 *
 * Per block, with rows N = B*T of width E:
 *   a1 = norm(x; w_in)            y = mixer(a1)               h = x + y
 *   a2 = norm(h; w_post)          gu = [a2 W_gate^T | a2 W_up^T]
 *   m = silu(gate) * up           x' = h + m W_down^T
 * with norm(x; w) = x / sqrt(mean(x^2) + eps) * (1 + w) (the zero-centred RMSNorm) and the mixer
 * layer l's GatedDeltaNet or gated full attention (cfg.full_attention[l]). */
#include "gdncp/model.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base.h"
#include "layer_internal.h"
#include "swiglu.h"
#include "model_group.h"
#include "model_internal.h"

/* What the forward keeps of one block for its backward (all N rows): the mixer's saved floats
 * and the MLP's (the dense MLP's gate and up projections [N, 2I]; the MoE block's routing and
 * activations). */
typedef struct {
    float *a1, *rstd1, *saved, *h, *a2, *rstd2, *mlp_saved;
} block_acts;

/* One plan per mixer kind, shared by every layer of that kind (same shapes). A call runs over
 * the plan's rows: all of them, or one row at a time under packed CP. */
enum { MIXER_GDN = 0, MIXER_ATTN = 1, MIXER_KINDS = 2 }; /* is_attn(cfg, l): layer l's kind */
typedef struct {
    size_t saved_call;   /* the mixer's saved floats of one call */
    size_t floats;       /* its flat parameters */
} mixer_sizes;

struct gdn_model_plan {
    gdn_model_config cfg;
    gdn_model_run run;
    gdn_cp *cp;
    gdn_ep *ep;               /* the group the experts are split over (NULL: every expert here) */
    int threads;
    int64_t N;                /* B*T rows */
    gdn_layer_plan *lp;       /* the GatedDeltaNet layers' plan (NULL: none) */
    gdn_attn_plan *ap;        /* the attention layers' plan (NULL: none) */
    mixer_sizes mixer[MIXER_KINDS];
    gdn_moe_plan *mp;         /* the MoE layers' block (NULL: none) */
    size_t mlp_saved[2];      /* one block's MLP saved floats, dense and MoE (mlp_ops) */
    double *router_stats;     /* [count n | prob n | rows]: the MoE routers' statistics of the last
                                 forward, summed over the CP group (gdn_model_set_router_stats: the
                                 caller's grid) */
    double *router_local;     /* the same, this rank's rows only */
    double *layer_stats;      /* one MoE layer's statistics of one forward (2 n) */
    double *expert_load;      /* [MoE layers][n]: choices per expert over the training forwards
                                 (gdn_model_expert_load) */
    float *aux_dp;            /* n: the aux loss's gradient in every row's router probabilities */
    int64_t ap_row;           /* packed CP: the row whose documents ap holds (-1: none) */
    int ap_offset_known;      /* dense CP: ap has this shard's seq_offset */
    float *xs;                /* (L+1) x N x E: each block's input, then the final residual */
    block_acts *acts;         /* L of them (recompute: 1, reused) */
    float *af, *rstdf;        /* final norm output, its rstd */
    float *y, *m;             /* N x E layer output; N x I dense MLP activation */
    float *dres, *da, *dm;    /* N x E residual gradient, N x E norm-input gradient, N x I */
    float *logits;            /* LOSS_ROWS x vocab */
    float *dlm;               /* vocab x E: lm_head's gradient from the forward's loss head */
    int ready_for_backward;   /* a forward kept what gdn_model_backward needs */
    gdn_model_units_hook units; /* sharded weights: called around each unit (gdn_model_plan_set_units_hook) */
    double mixer_s[4];        /* wall seconds in the mixers (gdn_model_mixer_seconds) */
    /* packed documents (run.pack; gdn_model_set_docs) */
    int docs_set;
    uint8_t *skip;            /* N: the target starts a document: not predicted */
    int64_t *doc_cu;          /* the mixers' stream offsets: one rank, one stream of all B*T
                                 tokens (rows are documents too); CP, row b's from row_first[b] */
    size_t doc_cu_cap;
    int64_t *row_first, *row_docs; /* B each (one rank: entry 0 only) */
    int64_t seq_offset;
    float *dw_row;            /* CP rows: one row's mixer gradient, summed into dw */
    float *partial;           /* threads x E: per-thread weight-gradient partials */
    double *loss_partial;     /* threads */
    float *mm_ws;
    void *arena;
    size_t arena_bytes;
};

/* The loss head runs over chunks of rows: LOSS_ROWS at most, never fewer than LOSS_MIN_ROWS. A
 * chunk's logits take LOSS_FLOATS floats (64 MiB; a byte vocabulary keeps 1024 rows) or, where
 * the vocabulary is large, up to half the lm_head's own size (E / 2 rows): each chunk streams the
 * whole lm_head through three products, so a chunk of few rows is bound by that read and by
 * packing it, not by its FLOPs (Qwen3.5's 248,320 x 1024: 512 rows, 0.5 GB, where 67 rows made
 * the packing 10 % of a step). Nothing else is per token x vocab. */
enum { LOSS_ROWS = 1024, LOSS_MIN_ROWS = 16 };
#define LOSS_FLOATS ((int64_t)1 << 24)
static int64_t loss_rows(const gdn_model_config *c) {
    int64_t r = LOSS_FLOATS / (c->vocab > 0 ? c->vocab : 1);
    if (r < c->E / 2) r = c->E / 2;
    return r > LOSS_ROWS ? LOSS_ROWS : r < LOSS_MIN_ROWS ? LOSS_MIN_ROWS : r;
}

/* Every id of B rows of n tokens (row b at tokens + b * stride) in [0, vocab); the first one that
 * is not, named. */
static int check_tokens(const char *what, const gdn_token *tokens, int64_t B, int64_t n, int64_t stride,
                        int64_t vocab, const gdn_cp *cp) {
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < n; t++) {
            const gdn_token id = tokens[b * stride + t];
            if (id < 0 || id >= vocab) {
                char where[64] = "";
                if (cp) snprintf(where, sizeof where, " (of CP rank %d's shard)", gdn_model_group_of(cp)->rank);
                return gdn_fail(GDN_ERR_ARG, "%s: token id %d at row %lld position %lld%s is outside the vocabulary "
                                "[0, %lld)", what, (int)id, (long long)b, (long long)t, where, (long long)vocab);
            }
        }
    return GDN_OK;
}
/* A collective entry point's local check, agreed over the CP group (one rank's bad token stops
 * them all before any exchange, each returning an error). */
static int agree_local(const gdn_model_plan *p, int rc) {
    return p->cp ? gdn_model_group_of(p->cp)->agree_status(p->cp, rc) : rc;
}

/* Under expert parallelism a failure outside the experts' exchange (a token check, a mixer; agreed
 * over the CP group) must also reach the rest of the expert group, whose ranks wait in their next
 * exchange: this rank joins that one with its status, when its peers will reach one (a MoE layer
 * from layer `from` on, in the direction dir: +1 forward, -1 backward). */
static int ep_failed(const gdn_model_config *c, gdn_ep *ep, gdn_moe_plan *mp, int rc, int64_t from, int dir) {
    if (!rc || !ep) return rc;
    for (int64_t l = from; l >= 0 && l < c->L; l += dir)
        if (c->moe[l]) return gdn_model_experts_of(ep)->join(ep, mp, rc);
    return rc;
}

/* Packed rows under CP run one mixer call per row (each row its own stream over the ranks). */
static int rows_apart(const gdn_model_run *r, const gdn_cp *cp) { return r->pack && cp; }

/* Floats of the whole arena for this plan: saved_gdn and saved_attn are one block's saved floats
 * of each mixer kind (all rows), mlp[0], mlp[1] one block's MLP saved floats, dense and MoE. */
static size_t plan_floats(const gdn_model_config *c, const gdn_model_run *r, int threads,
                          size_t saved_gdn, size_t saved_attn, const size_t mlp[2]) {
    const size_t N = (size_t)(r->B * r->T), E = (size_t)c->E, L = (size_t)c->L;
    const size_t I = gdn_model_moe_layers(c) < c->L ? (size_t)c->I : 0;
    const size_t na = (size_t)gdn_model_attn_layers(c), nm = (size_t)gdn_model_moe_layers(c);
    const size_t act = pad16(N * E) * 3 + pad16(N) * 2;
    /* recompute: one block's, reused, with room for the larger kinds (a kind the model lacks has 0) */
    const size_t mixer_max = saved_gdn > saved_attn ? saved_gdn : saved_attn;
    const size_t mlp_max = mlp[0] > mlp[1] ? mlp[0] : mlp[1];
    const size_t acts = r->recompute ? act + pad16(mixer_max) + pad16(mlp_max)
                                     : L * act + (L - na) * pad16(saved_gdn) + na * pad16(saved_attn) +
                                           (L - nm) * pad16(mlp[0]) + nm * pad16(mlp[1]);
    return pad16((L + 1) * N * E) + acts + pad16(N * E) + pad16(N) + pad16(N * E) * 3 + pad16(N * I) * 2 +
           pad16((size_t)loss_rows(c) * (size_t)c->vocab) + pad16((size_t)(c->vocab * c->E)) +
           pad16((size_t)threads * E) + pad16(2 * (size_t)threads) + gdn_matmul_compute_ws_floats(r->compute, threads);
}

/* The MoE block's saved floats for N rows, approximated from its per-row sizes (routing, the
 * router's probabilities, every slot's gate/up activations, the shared expert's), and its
 * workspace (each slot's input, activations and output rows). */
static void moe_estimate(const gdn_model_config *c, double N, double *saved, double *ws) {
    const double n = (double)c->n_experts, k = (double)c->top_k, I = (double)c->moe_I, Is = (double)c->shared_I;
    const double E = (double)c->E;
    *saved = N * (n + 2 * k + 2 * k * I + 2 * Is + 1);
    *ws = 4.0 * N * (k * (2 * E + 3 * I) + n + 3 * Is + E);
}

double gdn_model_plan_estimate(const gdn_model_config *c, const gdn_model_run *r) {
    const gdn_layer_config lc = gdn_model_layer_config(c, r->B, r->T);
    const int threads = r->threads > 0 ? r->threads : omp_get_max_threads();
    const double tokens = (double)(r->B * r->T);
    const int64_t na = gdn_model_attn_layers(c);
    /* the GatedDeltaNet layer's saved floats and workspace, approximated from its per-token sizes */
    double gdn_ws = 0, gdn_saved = 0;
    if (na < c->L) {
        const double cd = (double)gdn_layer_conv_dim(&lc), vd = (double)(c->Hv * c->V);
        const double P = cd + vd + 2.0 * (double)c->Hv;
        gdn_ws = tokens * (2 * P + 2 * (cd + 2 * (double)c->Hv) + 2 * vd) * 4.0;
        const double per_chunk_state = (double)(c->Hv * c->K * c->V) / 64.0;
        gdn_saved = tokens * (r->recompute ? per_chunk_state : P + vd + per_chunk_state);
    }
    /* the attention layer's (its saved floats: projections, output, lse; its workspace holds a
     * copy of them besides the normed q, k and the gradients' rows) */
    double attn_ws = 0, attn_saved = 0;
    if (na) {
        const double Hd = (double)(c->H * c->d), Kd = (double)(c->Hkv * c->d), P = 2 * Hd + 2 * Kd;
        attn_saved = tokens * (P + Hd + (double)c->H);
        attn_ws = 4.0 * (attn_saved + tokens * (4 * Hd + 2 * Kd + 2 * (double)c->H + (double)c->Hkv + P + (double)c->R));
    }
    double moe_saved = 0, moe_ws = 0;
    if (gdn_model_moe_layers(c)) moe_estimate(c, tokens, &moe_saved, &moe_ws);
    const size_t mlp[2] = {(size_t)(tokens * 2.0 * (double)c->I), (size_t)moe_saved};
    return 4.0 * (double)plan_floats(c, r, threads, (size_t)gdn_saved, (size_t)attn_saved, mlp) + gdn_ws + attn_ws +
           moe_ws;
}

/* The mixers' plans for the run's rows. Packed: one rank runs all rows as one stream (a row start
 * is a document start too); under CP each row is its own stream over the ranks. Made with one
 * document per row (each row's tokens, so no position exceeds a row's); gdn_model_set_docs gives
 * the step's. */
static int mixer_plans_create(gdn_model_plan *p) {
    const gdn_model_config *c = &p->cfg;
    const gdn_model_run *r = &p->run;
    const int apart = rows_apart(r, p->cp);
    const int64_t na = gdn_model_attn_layers(c), rows = r->pack && !apart ? r->B : 1;
    const int64_t T_call = r->pack ? (apart ? r->T : r->B * r->T) : r->T, B_call = r->pack ? 1 : r->B;
    int64_t *row_cu = gdn_malloc("model: row_cu", sizeof(int64_t) * (size_t)(rows + 1));
    if (!row_cu) return gdn_fail(GDN_ERR_NOMEM, "the model's row offsets (B = %lld)", (long long)r->B);
    for (int64_t b = 0; b <= rows; b++) row_cu[b] = b * (T_call / rows);
    int rc = GDN_OK;
    if (na < c->L) {
        const int64_t one_doc[2] = {0, T_call};
        gdn_layer_config lc = gdn_model_layer_config(c, B_call, T_call);
        if (r->pack) lc.cu_seqlens = one_doc, lc.n_docs = 1;
        lc.threads = p->threads;
        lc.check_finite = r->check_finite;
        /* Recompute keeps only the kernel's states (KEEP_MIN) of the one block being recomputed;
         * otherwise every block keeps its projections too, for the faster backward. */
        lc.keep = r->recompute ? GDN_LAYER_KEEP_MIN : GDN_LAYER_KEEP_PROJ;
        lc.compute = r->compute;
        lc.cp = r->rule_cp;
        rc = gdn_layer_plan_create(&p->lp, &lc);
        if (!rc) p->mixer[MIXER_GDN] = (mixer_sizes){gdn_layer_saved_floats(p->lp), gdn_layer_param_floats(&lc)};
    }
    if (!rc && na) {
        gdn_attn_config ac = gdn_model_attn_config(c, B_call, T_call);
        if (r->pack) ac.cu_seqlens = row_cu, ac.n_docs = rows;
        ac.threads = p->threads;
        ac.check_finite = r->check_finite;
        ac.cp = r->attn_cp;
        ac.compute = r->compute;
        rc = gdn_attn_plan_create(&p->ap, &ac);
        if (!rc) p->mixer[MIXER_ATTN] = (mixer_sizes){gdn_attn_saved_floats(p->ap), gdn_attn_param_floats(&ac)};
    }
    free(row_cu);
    /* the MLPs: token by token, so one plan of all B*T rows whatever the documents and shards */
    p->mlp_saved[0] = gdn_model_moe_layers(c) < c->L ? (size_t)(p->N * 2 * c->I) : 0;
    if (!rc && gdn_model_moe_layers(c)) {
        gdn_moe_config mc = gdn_model_moe_config(c, p->N);
        mc.threads = p->threads;
        mc.check_finite = r->check_finite;
        mc.compute = r->compute;
        rc = gdn_moe_plan_create(&p->mp, &mc);
        if (!rc) p->mlp_saved[1] = gdn_moe_saved_floats(p->mp);
    }
    p->ap_row = -1;
    return rc;
}

int gdn_model_plan_create(gdn_model_plan **out, const gdn_model_config *c,
                          const gdn_model_run *r, gdn_cp *cp) {
    if (!out) return gdn_fail(GDN_ERR_ARG, "model plan pointer is NULL");
    *out = NULL;
    int rc = gdn_isa_check();
    if (rc || (rc = gdn_model_config_check(c))) return rc;
    if (!r) return gdn_fail(GDN_ERR_ARG, "model run is NULL");
    if (r->B < 1 || r->T < 1 || r->B > (1 << 20) || r->T > ((int64_t)1 << 36))
        return gdn_fail(GDN_ERR_SHAPE, "model run B = %lld, T = %lld is out of range",
                        (long long)r->B, (long long)r->T);
    if (r->threads < 0) return gdn_fail(GDN_ERR_ARG, "model threads = %d is negative", r->threads);
    if (r->attn_cp != GDN_ATTN_CP_KV && r->attn_cp != GDN_ATTN_CP_HEADS)
        return gdn_fail(GDN_ERR_ARG, "model run attn_cp = %d is unknown (GDN_ATTN_CP_KV or GDN_ATTN_CP_HEADS)",
                        r->attn_cp);
    if (!gdn_compute_name(r->compute))
        return gdn_fail(GDN_ERR_ARG, "model run compute = %d (want GDN_COMPUTE_FP32 or GDN_COMPUTE_BF16)", r->compute);
    if (r->rule_cp < GDN_CP_SCAN || r->rule_cp > GDN_CP_HEADS)
        return gdn_fail(GDN_ERR_ARG, "model run rule_cp = %d is unknown (GDN_CP_SCAN, _ALLGATHER, _RELAY or _HEADS)",
                        r->rule_cp);
    gdn_model_plan *p = gdn_calloc("model: p", 1, sizeof *p);
    if (!p) return gdn_fail(GDN_ERR_NOMEM, "model plan");
    p->cfg = *c, p->run = *r, p->cp = cp;
    p->threads = r->threads > 0 ? r->threads : omp_get_max_threads();
    p->N = r->B * r->T;
    if ((rc = mixer_plans_create(p))) {
        gdn_model_plan_destroy(p);
        return rc;
    }
    const int apart = rows_apart(r, cp);
    const size_t row_mult = (size_t)(apart ? r->B : 1);
    if (r->pack) {
        const size_t mixer_dw = p->mixer[MIXER_GDN].floats > p->mixer[MIXER_ATTN].floats ? p->mixer[MIXER_GDN].floats
                                                                                       : p->mixer[MIXER_ATTN].floats;
        p->skip = gdn_calloc("model: p->skip", (size_t)p->N, 1);
        p->row_first = gdn_calloc("model: p->row_first", (size_t)r->B, sizeof(int64_t));
        p->row_docs = gdn_calloc("model: p->row_docs", (size_t)r->B, sizeof(int64_t));
        if (apart) p->dw_row = gdn_malloc("model: p->dw_row", sizeof(float) * mixer_dw);
        if (!p->skip || !p->row_first || !p->row_docs || (apart && !p->dw_row)) {
            gdn_model_plan_destroy(p);
            return gdn_fail(GDN_ERR_NOMEM, "the model's document tables (B = %lld, T = %lld)", (long long)r->B,
                            (long long)r->T);
        }
    }
    const size_t saved_gdn = p->mixer[MIXER_GDN].saved_call * row_mult,
                 saved_attn = p->mixer[MIXER_ATTN].saved_call * row_mult;
    const size_t floats = plan_floats(c, r, p->threads, saved_gdn, saved_attn, p->mlp_saved);
    if ((rc = gdn_check_fits("the model's activations and workspace", 4.0 * (double)floats))) {
        gdn_model_plan_destroy(p);
        return rc;
    }
    const int nacts = r->recompute ? 1 : (int)c->L;
    p->acts = gdn_calloc("model: p->acts", (size_t)nacts, sizeof *p->acts);
    p->arena = gdn_alloc_large("model: p->arena", sizeof(float) * floats);
    const size_t nstats = 2 * (size_t)c->n_experts + 1;
    p->router_stats = gdn_calloc("model: p->router_stats", 2 * nstats + 2 * (size_t)c->n_experts +
                                 (size_t)(gdn_model_moe_layers(c) * c->n_experts), sizeof(double));
    p->aux_dp = gdn_calloc("model: p->aux_dp", (size_t)c->n_experts + 1, sizeof(float));
    if (!p->acts || !p->arena || !p->router_stats || !p->aux_dp) {
        gdn_model_plan_destroy(p);
        return gdn_fail(GDN_ERR_NOMEM, "the model's activations and workspace (%.3g GB for B = %lld, "
                        "T = %lld)", 4e-9 * (double)floats, (long long)r->B, (long long)r->T);
    }
    p->arena_bytes = sizeof(float) * floats;
    float *a = p->arena;
    p->router_local = p->router_stats + nstats;
    p->layer_stats = p->router_local + nstats;
    p->expert_load = p->layer_stats + 2 * (size_t)c->n_experts;
    const size_t N = (size_t)p->N, E = (size_t)c->E, I = gdn_model_moe_layers(c) < c->L ? (size_t)c->I : 0;
    const size_t saved_max = saved_gdn > saved_attn ? saved_gdn : saved_attn;
    const size_t mlp_max = p->mlp_saved[0] > p->mlp_saved[1] ? p->mlp_saved[0] : p->mlp_saved[1];
#define CARVE(ptr, n) (ptr = a, a += pad16(n))
    CARVE(p->xs, ((size_t)c->L + 1) * N * E);
    for (int l = 0; l < nacts; l++) {
        block_acts *b = &p->acts[l];
        CARVE(b->a1, N * E), CARVE(b->rstd1, N);
        CARVE(b->saved, r->recompute ? saved_max : is_attn(c, l) ? saved_attn : saved_gdn);
        CARVE(b->h, N * E), CARVE(b->a2, N * E), CARVE(b->rstd2, N);
        CARVE(b->mlp_saved, r->recompute ? mlp_max : p->mlp_saved[is_moe(c, l)]);
    }
    CARVE(p->af, N * E), CARVE(p->rstdf, N);
    CARVE(p->y, N * E), CARVE(p->dres, N * E), CARVE(p->da, N * E);
    CARVE(p->m, N * I), CARVE(p->dm, N * I);
    CARVE(p->logits, (size_t)loss_rows(c) * (size_t)c->vocab);
    CARVE(p->dlm, (size_t)(c->vocab * c->E));
    CARVE(p->partial, (size_t)p->threads * E);
    p->loss_partial = (double *)a, a += pad16(2 * (size_t)p->threads);
    p->mm_ws = a;
#undef CARVE
    *out = p;
    return GDN_OK;
}

/* The group a model's experts are split over: its size and this rank's place must be the
 * config's slice (the parameter layout was made for it). */
static int check_experts(const gdn_model_config *c, const gdn_ep *ep, const char *what) {
    const int64_t size = c->ep_size > 1 ? c->ep_size : 1;
    if (!ep)
        return size > 1 ? gdn_fail(GDN_ERR_ARG, "%s: ep is NULL but the model's experts are split over %lld ranks "
                                   "(ep_size)", what, (long long)size)
                        : GDN_OK;
    const gdn_model_experts *g = gdn_model_experts_of(ep);
    if (g->size != size || g->rank != c->ep_rank)
        return gdn_fail(GDN_ERR_ARG, "%s: the expert group has %d ranks and this is rank %d, but the model config "
                        "holds slice %lld of %lld (ep_rank, ep_size)", what, g->size, g->rank, (long long)c->ep_rank,
                        (long long)size);
    return GDN_OK;
}

/* *slot = ep after that check (NULL when every expert is here). */
static int set_experts(const gdn_model_config *c, gdn_ep *ep, gdn_ep **slot, const char *what) {
    const int rc = check_experts(c, ep, what);
    if (!rc) *slot = c->ep_size > 1 ? ep : NULL;
    return rc;
}

int gdn_model_plan_set_experts(gdn_model_plan *p, gdn_ep *ep) {
    if (!p) return gdn_fail(GDN_ERR_ARG, "model set experts: plan is NULL");
    return set_experts(&p->cfg, ep, &p->ep, "model set experts");
}

int gdn_model_plan_set_units_hook(gdn_model_plan *p, const gdn_model_units_hook *hook) {
    if (!p) return gdn_fail(GDN_ERR_ARG, "model set units hook: plan is NULL");
    if (hook && !hook->call) return gdn_fail(GDN_ERR_ARG, "model set units hook: the hook has no function");
    p->units = hook ? *hook : (gdn_model_units_hook){0};
    return GDN_OK;
}

/* The units hook at one point of a pass (nothing without a hook). */
static int unit_event(gdn_model_plan *p, int64_t u, int event) {
    return p->units.call ? p->units.call(p->units.ctx, u, event, 0) : GDN_OK;
}

/* A pass that failed on this rank: the hook meets its peers' next call with the status. */
static int pass_failed(gdn_model_plan *p, int rc) {
    if (rc && p->units.call) p->units.call(p->units.ctx, -1, GDN_UNIT_FAILED, rc);
    return rc;
}

/* A pass's end: the hook's last call of a pass that succeeded. */
static int pass_end(gdn_model_plan *p) { return unit_event(p, -1, GDN_UNIT_END); }

/* Unit u's gradient zeroed (padding included: the optimiser may run over the whole array). */
static void zero_unit(const gdn_model_config *c, float *dw, int64_t u) {
    const size_t lo = gdn_model_unit_offset(c, u);
    memset(dw + lo, 0, sizeof(float) * (gdn_model_unit_offset(c, u + 1) - lo));
}

void gdn_model_plan_destroy(gdn_model_plan *p) {
    if (!p) return;
    gdn_layer_plan_destroy(p->lp);
    gdn_attn_plan_destroy(p->ap);
    gdn_moe_plan_destroy(p->mp);
    free(p->router_stats), free(p->aux_dp);
    free(p->skip), free(p->doc_cu), free(p->row_first), free(p->row_docs), free(p->dw_row);
    free(p->acts);
    free(p->arena);
    free(p);
}

double gdn_model_plan_bytes(const gdn_model_plan *p) {
    /* the mixers' plans' workspaces are not counted here: they report through their own plans */
    return p ? (double)p->arena_bytes : 0.0;
}

/* ---------------------------------------------------------------- pieces */

/* y = x / sqrt(mean(x^2) + eps) * (1 + w), row by row; rstd keeps 1/sqrt(...). */
/* Qwen3.5's RMSNorm of N rows of E, y = x / rms(x) * (1 + w), the one of the training forward
 * and of the decoder: rstd (NULL: not kept) receives each row's 1 / rms. Rows split over the
 * threads worth a team for their bytes (a decode step's one row opens no region). */
typedef struct {
    int64_t E;
    float eps;
    float *y, *rstd;
    const float *x, *w;
} rms_norm_job;

static void rms_norm_range(void *ctx, int64_t lo, int64_t hi) {
    const rms_norm_job *j = ctx;
    const int64_t E = j->E;
    for (int64_t i = lo; i < hi; i++) {
        const float *xi = j->x + i * E;
        const float r = 1.0f / sqrtf(gdn_sumsq(xi, E) / (float)E + j->eps);
        if (j->rstd) j->rstd[i] = r;
        for (int64_t e = 0; e < E; e++) j->y[i * E + e] = xi[e] * r * (1.0f + j->w[e]);
    }
}

static void rms_norm(int threads, int64_t N, int64_t E, float eps, float *y, float *rstd, const float *x,
                     const float *w) {
    rms_norm_job j = {E, eps, y, rstd, x, w};
    gdn_parallel_range(gdn_threads_for_bytes(threads, 8.0 * (double)(N * E)), N, rms_norm_range, &j);
}

static void norm_forward(const gdn_model_plan *p, int64_t N, float *y, float *rstd, const float *x,
                         const float *w) {
    rms_norm(p->threads, N, p->cfg.E, p->cfg.eps, y, rstd, x, w);
}

/* dx (+)= the norm's input gradient for dy; dw = its weight gradient (overwritten). Per-thread
 * partial sums reduced in thread order: deterministic for a given thread count. */
static void norm_backward(gdn_model_plan *p, int64_t N, float *dx, int accumulate, float *dw,
                          const float *dy, const float *x, const float *rstd, const float *w) {
    const int64_t E = p->cfg.E;
    const int nt = p->threads;
    memset(p->partial, 0, sizeof(float) * (size_t)nt * (size_t)E);
#pragma omp parallel num_threads(nt)
    {
        float *pw = p->partial + (size_t)omp_get_thread_num() * (size_t)E;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < N; i++) {
            const float *xi = x + i * E, *gi = dy + i * E;
            const float r = rstd[i];
            float dot = 0.0f; /* sum_e dy (1 + w) x */
            for (int64_t e = 0; e < E; e++) {
                dot += gi[e] * (1.0f + w[e]) * xi[e];
                pw[e] += gi[e] * xi[e] * r;
            }
            const float c = dot * r * r / (float)E;
            float *di = dx + i * E;
            for (int64_t e = 0; e < E; e++) {
                const float v = r * (gi[e] * (1.0f + w[e]) - xi[e] * c);
                di[e] = accumulate ? di[e] + v : v;
            }
        }
    }
    for (int64_t e = 0; e < E; e++) {
        float s = 0.0f;
        for (int t = 0; t < nt; t++) s += p->partial[(size_t)t * (size_t)E + (size_t)e];
        dw[e] = s;
    }
}

/* Dense under CP: the attention plan needs this shard's first token in the sequence (global
 * RoPE positions and causal mask): the tokens of the ranks before it, an exclusive scan of the
 * shard lengths, once (inside the forward, which is collective anyway). */
static int attn_learn_offset(gdn_model_plan *p) {
    if (!p->ap || !p->cp || p->run.pack || p->ap_offset_known) return GDN_OK;
    const gdn_model_group *g = gdn_model_group_of(p->cp);
    int64_t before = 0;
    int rc = g->exscan_sum(p->cp, p->run.T, &before);
    if (rc) return rc;
    rc = g->agree_status(p->cp, gdn_attn_plan_set_docs(p->ap, NULL, 0, before));
    p->ap_offset_known = !rc;
    return rc;
}

/* ---------------------------------------------------------------- the mixer ops
 *
 * One entry per token-mixer kind (MIXER_GDN, MIXER_ATTN): a call over the plan's rows (one rank:
 * all of them; CP: this rank's shard), in the mixer's CP form through the group's table
 * (model_group.h) when the plan spans ranks; and a row's documents into the kind's plan. */
typedef struct {
    int (*forward)(gdn_model_plan *p, float *y, float *saved, const float *x, const float *w);
    int (*backward)(gdn_model_plan *p, float *dx, float *dw, const float *x, const float *w, const float *saved,
                    const float *dy);
    int (*set_docs)(gdn_model_plan *p, int64_t row, const int64_t *cu, int64_t n, int64_t seq_offset);
} mixer_ops;

static int gdn_mixer_forward(gdn_model_plan *p, float *y, float *saved, const float *x, const float *w) {
    return p->cp ? gdn_model_group_of(p->cp)->layer_forward(p->cp, p->lp, y, saved, x, w)
                 : gdn_layer_forward(p->lp, y, saved, x, w, NULL, NULL);
}
static int gdn_mixer_backward(gdn_model_plan *p, float *dx, float *dw, const float *x, const float *w,
                              const float *saved, const float *dy) {
    return p->cp ? gdn_model_group_of(p->cp)->layer_backward(p->cp, p->lp, dx, dw, x, w, saved, dy)
                 : gdn_layer_backward(p->lp, dx, dw, x, w, saved, dy);
}
static int gdn_mixer_set_docs(gdn_model_plan *p, int64_t row, const int64_t *cu, int64_t n, int64_t seq_offset) {
    (void)row;
    return gdn_layer_plan_set_docs(p->lp, cu, n, seq_offset);
}
static int attn_mixer_forward(gdn_model_plan *p, float *y, float *saved, const float *x, const float *w) {
    return p->cp ? gdn_model_group_of(p->cp)->attn_forward(p->cp, p->ap, y, saved, x, w)
                 : gdn_attn_forward(p->ap, y, saved, x, w);
}
static int attn_mixer_backward(gdn_model_plan *p, float *dx, float *dw, const float *x, const float *w,
                               const float *saved, const float *dy) {
    return p->cp ? gdn_model_group_of(p->cp)->attn_backward(p->cp, p->ap, dx, dw, x, w, saved, dy)
                 : gdn_attn_backward(p->ap, dx, dw, x, w, saved, dy);
}
/* The attention plan keeps the row it holds (its cos/sin table is redone on a change; row < 0:
 * the whole run's documents, always set). */
static int attn_mixer_set_docs(gdn_model_plan *p, int64_t row, const int64_t *cu, int64_t n, int64_t seq_offset) {
    if (row >= 0 && p->ap_row == row) return GDN_OK;
    const int rc = gdn_attn_plan_set_docs(p->ap, cu, n, seq_offset);
    p->ap_row = rc ? -1 : row;
    return rc;
}

static const mixer_ops mixer_table[MIXER_KINDS] = {
    {gdn_mixer_forward, gdn_mixer_backward, gdn_mixer_set_docs},
    {attn_mixer_forward, attn_mixer_backward, attn_mixer_set_docs}};

/* Packed rows over CP: row b's documents into the mixer's plan (agreed: the call after it is
 * collective). */
static int set_row_docs(gdn_model_plan *p, int attn, int64_t b) {
    const int rc = mixer_table[attn].set_docs(p, b, p->doc_cu + p->row_first[b], p->row_docs[b], p->seq_offset);
    return gdn_model_group_of(p->cp)->agree_status(p->cp, rc);
}

/* Layer l's mixer on all rows: one call, or under packed CP one call per row. */
static int mixer_forward_rows(gdn_model_plan *p, int attn, float *y, float *saved, const float *x, const float *w) {
    if (!rows_apart(&p->run, p->cp)) return mixer_table[attn].forward(p, y, saved, x, w);
    const size_t TE = (size_t)(p->run.T * p->cfg.E), sr = p->mixer[attn].saved_call;
    for (int64_t b = 0; b < p->run.B; b++) {
        int rc = set_row_docs(p, attn, b);
        if (!rc) rc = mixer_table[attn].forward(p, y + b * TE, saved ? saved + b * sr : NULL, x + b * TE, w);
        if (rc) return rc;
    }
    return GDN_OK;
}
static int mixer_forward(gdn_model_plan *p, int64_t l, float *y, float *saved, const float *x, const float *w) {
    const int attn = is_attn(&p->cfg, l);
    const double t0 = omp_get_wtime();
    const int rc = mixer_forward_rows(p, attn, y, saved, x, w);
    p->mixer_s[2 * attn] += omp_get_wtime() - t0;
    return rc;
}
static int mixer_backward_rows(gdn_model_plan *p, int attn, float *dx, float *dw, const float *x, const float *w,
                               const float *saved, const float *dy) {
    if (!rows_apart(&p->run, p->cp)) return mixer_table[attn].backward(p, dx, dw, x, w, saved, dy);
    const size_t TE = (size_t)(p->run.T * p->cfg.E), sr = p->mixer[attn].saved_call;
    const size_t nf = p->mixer[attn].floats;
    for (int64_t b = 0; b < p->run.B; b++) {
        float *dwb = b ? p->dw_row : dw;
        int rc = set_row_docs(p, attn, b);
        if (!rc) rc = mixer_table[attn].backward(p, dx + b * TE, dwb, x + b * TE, w, saved + b * sr, dy + b * TE);
        if (rc) return rc;
        if (b)
            for (size_t i = 0; i < nf; i++) dw[i] += dwb[i];
    }
    return GDN_OK;
}
static int mixer_backward(gdn_model_plan *p, int64_t l, float *dx, float *dw, const float *x, const float *w,
                          const float *saved, const float *dy) {
    const int attn = is_attn(&p->cfg, l);
    const double t0 = omp_get_wtime();
    const int rc = mixer_backward_rows(p, attn, dx, dw, x, w, saved, dy);
    p->mixer_s[2 * attn + 1] += omp_get_wtime() - t0;
    return rc;
}

void gdn_model_mixer_seconds(gdn_model_plan *p, double out[4], int reset) {
    for (int i = 0; i < 4; i++) {
        out[i] = p ? p->mixer_s[i] : 0.0;
        if (p && reset) p->mixer_s[i] = 0.0;
    }
}

/* m = silu(gate) * up for gu = [gate | up] rows of 2I. */
static void swiglu_forward(const gdn_model_plan *p, float *m, const float *gu) {
    const int64_t I = p->cfg.I;
#pragma omp parallel for num_threads(p->threads) schedule(static)
    for (int64_t i = 0; i < p->N; i++) gdn_swiglu_row(m + i * I, gu + i * 2 * I, gu + i * 2 * I + I, I);
}

/* SwiGLU backward in place: gu = [gate | up] becomes [dgate | dup] for dm. */
static void swiglu_backward(const gdn_model_plan *p, float *gu, const float *dm) {
    const int64_t I = p->cfg.I;
#pragma omp parallel for num_threads(p->threads) schedule(static)
    for (int64_t i = 0; i < p->N; i++) {
        float *g = gu + i * 2 * I;
        gdn_swiglu_grad_row(g, g + I, g, g + I, dm + i * I, I);
    }
}

/* The dense MLP's gate and up projections are one [2I x E] matrix when up_proj follows gate_proj
 * with no padding (I E a multiple of 16): then each of their products runs as one GEMM of twice
 * the width instead of two (one parallel region and one set of packing barriers fewer; at m = 1
 * one streaming pass). Returns how many parts to run (1 or 2) and each part's width in *width. */
static int gate_up_parts(const gdn_model_config *c, int64_t *width) {
    const int one = pad16((size_t)(c->I * c->E)) == (size_t)(c->I * c->E);
    *width = one ? 2 * c->I : c->I;
    return one ? 1 : 2;
}
static size_t dense_off(const gdn_model_config *c, int which) { return (size_t)which * pad16((size_t)(c->I * c->E)); }

/* ---------------------------------------------------------------- the MLP ops
 *
 * One entry per MLP kind (model_params.c's gdn_mlp_layout holds their parameter layouts): the
 * forward from a2 = n2(h) into xout = h + mlp(a2), keeping `saved` (NULL: nothing is kept)
 * and adding the MoE routers' statistics into stats (NULL: none); the backward of dy = the
 * block output's gradient into da (overwritten: the gradient of a2) and the block's dw (w, dw:
 * the MLP block's own parameters). */
typedef struct {
    int (*forward)(gdn_model_plan *p, float *xout, float *saved, const float *h, const float *a2, const float *w,
                   double *stats);
    int (*backward)(gdn_model_plan *p, float *da, float *dw, const float *a2, const float *w, float *saved,
                    const float *dy);
} mlp_ops;

/* Dense: gu = a2 [W_gate; W_up]^T (kept), m = silu(gate) * up, xout = h + m W_down^T. */
static int dense_forward(gdn_model_plan *p, float *xout, float *saved, const float *h, const float *a2,
                         const float *w, double *stats) {
    const gdn_model_config *c = &p->cfg;
    const int64_t N = p->N, E = c->E, I = c->I, nt = p->threads;
    float *gu = saved; /* block_forward always gives the dense MLP its gate/up buffer */
    int64_t wd;
    const int parts = gate_up_parts(c, &wd);
    for (int k = 0; k < parts; k++)
        gdn_matmul_compute(p->run.compute, GDN_GEMM_B_TRANS, N, wd, E, a2, E, w + dense_off(c, DENSE_GATE + k), E,
                           gu + k * I, 2 * I, p->mm_ws, (int)nt);
    swiglu_forward(p, p->m, gu);
    memcpy(xout, h, sizeof(float) * (size_t)(N * E));
    gdn_matmul_compute(p->run.compute, GDN_GEMM_B_TRANS | GDN_GEMM_ACC, N, E, I, p->m, I,
                       w + dense_off(c, DENSE_DOWN), I, xout, E, p->mm_ws, (int)nt);
    return GDN_OK;
}

static int dense_backward(gdn_model_plan *p, float *da, float *dw, const float *a2, const float *w, float *saved,
                          const float *dy) {
    const gdn_model_config *c = &p->cfg;
    const int64_t N = p->N, E = c->E, I = c->I;
    const int nt = p->threads;
    /* down_proj: m again from gu, dW_down = dy^T m, dm = dy W_down */
    swiglu_forward(p, p->m, saved);
    gdn_matmul_compute(p->run.compute, GDN_GEMM_A_TRANS, E, I, N, dy, E, p->m, I, dw + dense_off(c, DENSE_DOWN), I,
                       p->mm_ws, nt);
    gdn_matmul_compute(p->run.compute, 0, N, I, E, dy, E, w + dense_off(c, DENSE_DOWN), I, p->dm, I, p->mm_ws, nt);
    /* SwiGLU: gu becomes [dgate | dup] in place */
    float *dgu = saved;
    swiglu_backward(p, dgu, p->dm);
    int64_t wd;
    const int parts = gate_up_parts(c, &wd);
    for (int k = 0; k < parts; k++) /* [dW_gate; dW_up] = dgu^T a2 */
        gdn_matmul_compute(p->run.compute, GDN_GEMM_A_TRANS, wd, E, N, dgu + k * I, 2 * I, a2, E,
                           dw + dense_off(c, DENSE_GATE + k), E, p->mm_ws, nt);
    for (int k = 0; k < parts; k++) /* da = dgu [W_gate; W_up] */
        gdn_matmul_compute(p->run.compute, k ? GDN_GEMM_ACC : 0, N, E, wd, dgu + k * I, 2 * I,
                           w + dense_off(c, DENSE_GATE + k), E, da, E, p->mm_ws, nt);
    return GDN_OK;
}

/* MoE: y = moe(a2) into the plan's layer-output buffer, xout = h + y. */
static int moe_forward(gdn_model_plan *p, float *xout, float *saved, const float *h, const float *a2,
                       const float *w, double *stats) {
    const int rc = p->ep ? gdn_model_experts_of(p->ep)->forward(p->ep, p->mp, p->y, saved, a2, w, stats)
                         : gdn_moe_forward(p->mp, p->y, saved, a2, w, stats, NULL, NULL);
    if (rc) return rc;
    const int64_t n = p->N * p->cfg.E;
#pragma omp parallel for num_threads(p->threads) schedule(static)
    for (int64_t i = 0; i < n; i++) xout[i] = h[i] + p->y[i];
    return GDN_OK;
}

static int moe_backward(gdn_model_plan *p, float *da, float *dw, const float *a2, const float *w, float *saved,
                        const float *dy) {
    const float *aux = p->cfg.router_aux ? p->aux_dp : NULL;
    return p->ep ? gdn_model_experts_of(p->ep)->backward(p->ep, p->mp, da, dw, a2, w, saved, dy, aux)
                 : gdn_moe_backward(p->mp, da, dw, a2, w, saved, dy, aux);
}

static const mlp_ops mlp_table[2] = {{dense_forward, dense_backward}, {moe_forward, moe_backward}};

/* One block forward from x (its input) into xout; keeps what its backward needs in b (keep),
 * the MoE routers' statistics into stats (NULL: not counted, as in a recomputed forward). dir:
 * +1 in the forward, -1 recomputed in the backward (where a failure meets the expert group next). */
static int block_forward(gdn_model_plan *p, int64_t l, float *xout, const float *x,
                         const block_acts *b, const float *w, int keep, double *stats, int dir) {
    const gdn_model_config *c = &p->cfg;
    const int64_t N = p->N, E = c->E, nt = p->threads;
    norm_forward(p, N, b->a1, b->rstd1, x, w + gdn_model_blk_offset(c, l, BLK_IN_NORM));
    int rc = mixer_forward(p, l, p->y, keep ? b->saved : NULL, b->a1, w + gdn_model_layer_offset(c, l));
    if (rc) return ep_failed(c, p->ep, p->mp, rc, l, dir);
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t i = 0; i < N * E; i++) b->h[i] = x[i] + p->y[i];
    norm_forward(p, N, b->a2, b->rstd2, b->h, w + gdn_model_blk_offset(c, l, BLK_POST_NORM));
    /* the dense MLP keeps its gate/up rows in any case (its own buffer); MoE only when asked */
    float *saved = keep || !is_moe(c, l) ? b->mlp_saved : NULL;
    rc = mlp_table[is_moe(c, l)].forward(p, xout, saved, b->h, b->a2, w + gdn_model_blk_offset(c, l, BLK_MLP), stats);
    /* the MoE block can fail on one rank alone (a NaN in its router): agreed before the next
     * layer's CP exchanges */
    return is_moe(c, l) ? agree_local(p, rc) : rc;
}

/* One block backward: dres holds the gradient of the block's output on entry and of its input
 * x on return; dw receives the block's weight gradients. */
static int block_backward(gdn_model_plan *p, int64_t l, const float *x, const block_acts *b,
                          const float *w, float *dw) {
    const gdn_model_config *c = &p->cfg;
    const int64_t N = p->N;
    const size_t mo = gdn_model_blk_offset(c, l, BLK_MLP);
    int rc = mlp_table[is_moe(c, l)].backward(p, p->da, dw + mo, b->a2, w + mo, b->mlp_saved, p->dres);
    if (is_moe(c, l)) rc = agree_local(p, rc);
    if (rc) return rc;
    /* post norm: dres (dh) += its input gradient */
    norm_backward(p, N, p->dres, 1, dw + gdn_model_blk_offset(c, l, BLK_POST_NORM), p->da, b->h, b->rstd2,
                  w + gdn_model_blk_offset(c, l, BLK_POST_NORM));
    /* the mixer: dy = dh -> da1 (into da) */
    const size_t lo = gdn_model_layer_offset(c, l);
    rc = mixer_backward(p, l, p->da, dw + lo, b->a1, w + lo, b->saved, p->dres);
    if (rc) return ep_failed(c, p->ep, p->mp, rc, l - 1, -1);
    /* input norm: dx = dh + its input gradient */
    norm_backward(p, N, p->dres, 1, dw + gdn_model_blk_offset(c, l, BLK_IN_NORM), p->da, x, b->rstd1,
                  w + gdn_model_blk_offset(c, l, BLK_IN_NORM));
    return GDN_OK;
}

/* The loss head in row chunks: logits, softmax cross-entropy against the targets, and (dw not
 * NULL) the gradient into dres and lm_head's dw. Returns the summed loss of the N rows. */
static double loss_head(gdn_model_plan *p, const float *w, float *dlm, const gdn_token *tokens,
                        double denom) {
    const gdn_model_config *c = &p->cfg;
    const int64_t N = p->N, T = p->run.T, E = c->E, Vv = c->vocab;
    const int nt = p->threads;
    const float *wl = w + gdn_model_lm_head_offset(c);
    double loss = 0.0;
    const float scale = (float)(1.0 / denom);
    const int64_t chunk = loss_rows(c);
    /* (tests: each row scored against its own token instead of the next, must be caught) */
    const int64_t ahead = gdn_test_mutate("model: the loss head's targets one position early") ? 0 : 1;
    for (int64_t r0 = 0; r0 < N; r0 += chunk) {
        const int64_t R = N - r0 < chunk ? N - r0 : chunk;
        gdn_matmul_compute(p->run.compute, GDN_GEMM_B_TRANS, R, Vv, E, p->af + r0 * E, E, wl, E, p->logits, Vv, p->mm_ws, nt);
        for (int t = 0; t < nt; t++) p->loss_partial[t] = 0.0;
#pragma omp parallel num_threads(nt)
        {
            double acc = 0.0;
#pragma omp for schedule(static)
            for (int64_t i = 0; i < R; i++) {
                const int64_t row = r0 + i, bb = row / T, t = row % T;
                const int target = tokens[bb * (T + 1) + t + ahead];
                float *li = p->logits + i * Vv;
                if (p->skip && p->skip[row]) { /* a document's first token: not predicted */
                    if (dlm) memset(li, 0, sizeof(float) * (size_t)Vv);
                    continue;
                }
                float mx = li[0];
                for (int64_t v = 1; v < Vv; v++) mx = li[v] > mx ? li[v] : mx;
                const float lt = li[target];
                /* li becomes exp(li - mx) (the vector exp; below e^-69 a probability is 0) */
                gdn_vf ev = {0};
                int64_t v = 0;
                for (; v + GDN_VL <= Vv; v += GDN_VL) {
                    const gdn_vf e = gdn_vexpf_ftz(gdn_vloadu(li + v) - mx);
                    gdn_vstoreu(li + v, e);
                    ev += e;
                }
                double se = 0.0;
                for (int l = 0; l < GDN_VL; l++) se += (double)ev[l];
                for (; v < Vv; v++) se += (double)(li[v] = expf(li[v] - mx));
                acc += log(se) - (double)(lt - mx);
                if (dlm) {
                    const float f = (float)(1.0 / se) * scale;
                    for (v = 0; v < Vv; v++) li[v] *= f;
                    li[target] -= scale;
                }
            }
            p->loss_partial[omp_get_thread_num()] = acc;
        }
        for (int t = 0; t < nt; t++) loss += p->loss_partial[t];
        if (dlm) {
            gdn_matmul_compute(p->run.compute, r0 ? GDN_GEMM_A_TRANS | GDN_GEMM_ACC : GDN_GEMM_A_TRANS, Vv, E, R, p->logits,
                       Vv, p->af + r0 * E, E, dlm, E, p->mm_ws, nt);
            gdn_matmul_compute(p->run.compute, 0, R, E, Vv, p->logits, Vv, wl, E, p->da + r0 * E, E, p->mm_ws, nt);
        }
    }
    return loss;
}

/* Embedding rows of the input tokens into xs[0]. */
static void embed_forward(gdn_model_plan *p, const float *w, const gdn_token *tokens) {
    const int64_t T = p->run.T, E = p->cfg.E;
#pragma omp parallel for num_threads(p->threads) schedule(static)
    for (int64_t row = 0; row < p->N; row++) {
        const int tok = tokens[(row / T) * (T + 1) + row % T];
        memcpy(p->xs + row * E, w + (size_t)tok * (size_t)E, sizeof(float) * (size_t)E);
    }
}

/* The MoE routers' statistics of the forward just run: this rank's (router_local, its rows
 * counted once per MoE layer in the last entry), summed over the CP group into router_stats. */
static int router_stats_done(gdn_model_plan *p) {
    const int64_t nm = gdn_model_moe_layers(&p->cfg);
    const size_t ns = 2 * (size_t)p->cfg.n_experts + 1;
    if (!nm) return GDN_OK;
    p->router_local[ns - 1] = (double)(p->N * nm);
    if (!p->cp) {
        memcpy(p->router_stats, p->router_local, sizeof(double) * ns);
        return GDN_OK;
    }
    return gdn_model_group_of(p->cp)->sum_doubles(p->cp, p->router_local, p->router_stats, (int)ns);
}

static int forward_all(gdn_model_plan *p, const float *w, const gdn_token *tokens, int keep) {
    const gdn_model_config *c = &p->cfg;
    const size_t NE = (size_t)(p->N * c->E);
    int rc = attn_learn_offset(p);
    if (rc) return ep_failed(c, p->ep, p->mp, rc, 0, 1);
    const int64_t n = c->n_experts;
    memset(p->router_local, 0, sizeof(double) * (2 * (size_t)n + 1));
    if ((rc = unit_event(p, 0, GDN_UNIT_NEED))) return rc;
    embed_forward(p, w, tokens);
    if ((rc = unit_event(p, 0, GDN_UNIT_DONE))) return rc;
    for (int64_t l = 0, mi = 0; l < c->L; l++) {
        const block_acts *b = &p->acts[p->run.recompute ? 0 : l];
        if (is_moe(c, l)) memset(p->layer_stats, 0, sizeof(double) * 2 * (size_t)n);
        if ((rc = unit_event(p, 1 + l, GDN_UNIT_NEED))) return rc;
        rc = block_forward(p, l, p->xs + (size_t)(l + 1) * NE, p->xs + (size_t)l * NE, b, w,
                           keep && !p->run.recompute, p->layer_stats, 1);
        /* (tests: a failure of this rank alone, where its peers carry on to their next exchange) */
        if (!rc && l == c->L - 1 && gdn_test_mutate("model: this rank's forward fails at its last layer (a fault)"))
            rc = gdn_fail(GDN_ERR_NONFINITE, "model forward: layer %lld failed (an injected fault)", (long long)l);
        if (!rc) rc = unit_event(p, 1 + l, GDN_UNIT_DONE);
        if (rc) return rc;
        if (!is_moe(c, l)) continue;
        for (int64_t e = 0; e < 2 * n; e++) p->router_local[e] += p->layer_stats[e];
        for (int64_t e = 0; keep && e < n; e++) p->expert_load[mi * n + e] += p->layer_stats[e];
        mi++;
    }
    /* the head: the final norm here, lm_head (unit 0 again when tied) in the caller */
    if ((rc = unit_event(p, c->L + 1, GDN_UNIT_NEED))) return rc;
    if (c->tie_embeddings && (rc = unit_event(p, 0, GDN_UNIT_NEED))) return rc;
    norm_forward(p, p->N, p->af, p->rstdf, p->xs + (size_t)c->L * NE, w + gdn_model_final_norm_offset(c));
    return router_stats_done(p);
}

/* The head's units released after the caller's lm_head product. */
static int head_done(gdn_model_plan *p) {
    int rc = unit_event(p, p->cfg.L + 1, GDN_UNIT_DONE);
    if (!rc && p->cfg.tie_embeddings) rc = unit_event(p, 0, GDN_UNIT_DONE);
    return rc;
}

int gdn_model_router_stats(const gdn_model_plan *p, double *stats) {
    if (!p || !stats) return gdn_fail(GDN_ERR_ARG, "model router statistics: plan and stats must not be NULL");
    memcpy(stats, p->router_local, sizeof(double) * (2 * (size_t)p->cfg.n_experts + 1));
    return GDN_OK;
}

int gdn_model_set_router_stats(gdn_model_plan *p, const double *stats) {
    if (!p || !stats) return gdn_fail(GDN_ERR_ARG, "model router statistics: plan and stats must not be NULL");
    const int64_t n = p->cfg.n_experts;
    double rows = stats[2 * n];
    for (int64_t i = 0; i < 2 * n; i++)
        if (!(stats[i] >= 0.0) || !isfinite(stats[i]))
            return gdn_fail(GDN_ERR_ARG, "model router statistics: entry %lld = %g is not a finite count or sum",
                            (long long)i, stats[i]);
    if (gdn_model_moe_layers(&p->cfg) && !(rows >= 1.0 && isfinite(rows)))
        return gdn_fail(GDN_ERR_ARG, "model router statistics: %g rows (want >= 1)", rows);
    memcpy(p->router_stats, stats, sizeof(double) * (2 * (size_t)n + 1));
    return GDN_OK;
}

int gdn_model_expert_load(gdn_model_plan *p, double *counts, int reset) {
    if (!p || !counts) return gdn_fail(GDN_ERR_ARG, "model expert load: plan and counts must not be NULL");
    const size_t k = (size_t)(gdn_model_moe_layers(&p->cfg) * p->cfg.n_experts);
    memcpy(counts, p->expert_load, sizeof(double) * k);
    if (reset) memset(p->expert_load, 0, sizeof(double) * k);
    return GDN_OK;
}

double gdn_model_aux_loss(const gdn_model_plan *p) {
    if (!p || !gdn_model_moe_layers(&p->cfg)) return 0.0;
    const int64_t n = p->cfg.n_experts;
    return gdn_moe_aux(n, p->router_stats, p->router_stats[2 * n], 0.0, NULL);
}

int gdn_model_forward(gdn_model_plan *p, const float *w, const gdn_token *tokens, double denom,
                      double *loss_sum, int for_backward) {
    if (!p || !w || !tokens || !loss_sum)
        return gdn_fail(GDN_ERR_ARG, "model forward: plan, w, tokens and loss_sum must not be NULL");
    if (!(denom > 0.0) || !isfinite(denom))
        return gdn_fail(GDN_ERR_ARG, "model forward: denom = %g must be positive", denom);
    p->ready_for_backward = 0;
    if (p->units.call) p->units.call(p->units.ctx, 0, GDN_UNIT_BEGIN, 0);
    int rc = p->run.pack && !p->docs_set
                 ? gdn_fail(GDN_ERR_ARG, "model forward: a packed plan needs gdn_model_set_docs first")
                 : check_tokens("model forward", tokens, p->run.B, p->run.T + 1, p->run.T + 1, p->cfg.vocab, p->cp);
    if ((rc = agree_local(p, rc))) return pass_failed(p, ep_failed(&p->cfg, p->ep, p->mp, rc, 0, 1));
    rc = forward_all(p, w, tokens, for_backward);
    if (rc) return pass_failed(p, rc);
    /* The head's gradient is formed with its loss, chunk by chunk, so no [N, vocab] logits are
     * kept: da (the final norm's output gradient) and lm_head's gradient wait in the plan. */
    if (for_backward) memset(p->da, 0, sizeof(float) * (size_t)(p->N * p->cfg.E));
    *loss_sum = loss_head(p, w, for_backward ? p->dlm : NULL, tokens, denom);
    if ((rc = head_done(p))) return pass_failed(p, rc);
    p->ready_for_backward = for_backward;
    return pass_end(p);
}

int gdn_model_backward(gdn_model_plan *p, const float *w, float *dw, const gdn_token *tokens) {
    if (!p || !w || !dw || !tokens)
        return gdn_fail(GDN_ERR_ARG, "model backward: plan, w, dw and tokens must not be NULL");
    if (p->units.call) p->units.call(p->units.ctx, 1, GDN_UNIT_BEGIN, 0);
    int rc = !p->ready_for_backward
                 ? gdn_fail(GDN_ERR_ARG, "model backward: no gdn_model_forward(..., for_backward = 1) precedes it")
                 : check_tokens("model backward", tokens, p->run.B, p->run.T, p->run.T + 1, p->cfg.vocab, p->cp);
    p->ready_for_backward = 0;
    if ((rc = agree_local(p, rc))) return pass_failed(p, ep_failed(&p->cfg, p->ep, p->mp, rc, p->cfg.L - 1, -1));
    const gdn_model_config *c = &p->cfg;
    const size_t NE = (size_t)(p->N * c->E);
    /* each unit's gradient zeroed just before it is first written (a sharded caller holds one at
     * a time): the head's now, and with tied embeddings the embedding's, where lm_head's goes */
    zero_unit(c, dw, c->L + 1);
    if (c->tie_embeddings) zero_unit(c, dw, 0);
    memcpy(dw + gdn_model_lm_head_offset(c), p->dlm, sizeof(float) * (size_t)(c->vocab * c->E));
    /* the aux loss's gradient in every row's router probabilities, from the grid's statistics */
    if (c->router_aux && gdn_model_moe_layers(c))
        gdn_moe_aux(c->n_experts, p->router_stats, p->router_stats[2 * c->n_experts], c->router_aux_coef, p->aux_dp);
    const float *xL = p->xs + (size_t)c->L * NE;
    if ((rc = unit_event(p, c->L + 1, GDN_UNIT_NEED))) return pass_failed(p, rc);
    norm_backward(p, p->N, p->dres, 0, dw + gdn_model_final_norm_offset(c), p->da, xL, p->rstdf,
                  w + gdn_model_final_norm_offset(c));
    if ((rc = unit_event(p, c->L + 1, GDN_UNIT_DONE)) || (rc = unit_event(p, c->L + 1, GDN_UNIT_GRADS)))
        return pass_failed(p, rc);
    for (int64_t l = c->L - 1; l >= 0; l--) {
        const float *x = p->xs + (size_t)l * NE;
        const block_acts *b = &p->acts[p->run.recompute ? 0 : l];
        zero_unit(c, dw, 1 + l);
        if ((rc = unit_event(p, 1 + l, GDN_UNIT_NEED))) return pass_failed(p, rc);
        if (p->run.recompute) /* the block again, this time keeping what its backward needs */
            if ((rc = block_forward(p, l, p->y, x, b, w, 1, NULL, -1))) return pass_failed(p, rc);
        if ((rc = block_backward(p, l, x, b, w, dw))) return pass_failed(p, rc);
        if (l == 0 && gdn_test_mutate("model: this rank's backward fails at its first layer (a fault)"))
            return pass_failed(p, gdn_fail(GDN_ERR_NONFINITE, "model backward: layer 0 failed (an injected fault)"));
        if ((rc = unit_event(p, 1 + l, GDN_UNIT_DONE)) || (rc = unit_event(p, 1 + l, GDN_UNIT_GRADS)))
            return pass_failed(p, rc);
    }
    /* embedding: scatter-add the input rows' gradient (serial: tokens repeat) */
    if (!c->tie_embeddings) zero_unit(c, dw, 0);
    const int64_t T = p->run.T, E = c->E;
    for (int64_t row = 0; row < p->N; row++) {
        const int tok = tokens[(row / T) * (T + 1) + row % T];
        float *d = dw + (size_t)tok * (size_t)E;
        const float *g = p->dres + row * E;
        for (int64_t e = 0; e < E; e++) d[e] += g[e];
    }
    if ((rc = unit_event(p, 0, GDN_UNIT_GRADS))) return pass_failed(p, rc);
    return pass_end(p);
}

int gdn_model_logits(gdn_model_plan *p, const float *w, const gdn_token *tokens, float *logits) {
    if (!p || !w || !tokens || !logits)
        return gdn_fail(GDN_ERR_ARG, "model logits: plan, w, tokens and logits must not be NULL");
    const int64_t T = p->run.T, B = p->run.B;
    if (p->units.call) p->units.call(p->units.ctx, 0, GDN_UNIT_BEGIN, 0);
    int rc = p->run.pack && !p->docs_set
                 ? gdn_fail(GDN_ERR_ARG, "model logits: a packed plan needs gdn_model_set_docs first")
                 : check_tokens("model logits", tokens, B, T, T, p->cfg.vocab, p->cp);
    /* the inputs in the [B, T+1] layout the step uses (the extra column is not read) */
    gdn_token *tk = rc ? NULL : gdn_calloc("model: tk", (size_t)(B * (T + 1)), sizeof *tk);
    if (!rc && !tk) rc = gdn_fail(GDN_ERR_NOMEM, "model logits: token copy");
    if ((rc = agree_local(p, rc))) {
        free(tk);
        return pass_failed(p, ep_failed(&p->cfg, p->ep, p->mp, rc, 0, 1));
    }
    for (int64_t b = 0; b < B; b++) memcpy(tk + b * (T + 1), tokens + b * T, sizeof *tk * (size_t)T);
    p->ready_for_backward = 0; /* the activations are overwritten */
    rc = forward_all(p, w, tk, 0);
    free(tk);
    if (rc) return pass_failed(p, rc);
    const gdn_model_config *c = &p->cfg;
    gdn_matmul_compute(p->run.compute, GDN_GEMM_B_TRANS, p->N, c->vocab, c->E, p->af, c->E, w + gdn_model_lm_head_offset(c), c->E,
               logits, c->vocab, p->mm_ws, p->threads);
    if ((rc = head_done(p))) return pass_failed(p, rc);
    return pass_end(p);
}

int gdn_model_set_docs(gdn_model_plan *p, const int64_t *doc_cu, const int64_t *n_docs,
                       int64_t seq_offset, int64_t *targets) {
    if (!p || !doc_cu || !n_docs || !targets)
        return gdn_fail(GDN_ERR_ARG, "model documents: plan, doc_cu, n_docs and targets must not be NULL");
    if (!p->run.pack) return gdn_fail(GDN_ERR_ARG, "model documents: the plan was made without run.pack");
    p->docs_set = 0;
    const int64_t B = p->run.B, T = p->run.T;
    if (seq_offset < 0 || (!p->cp && seq_offset != 0))
        return gdn_fail(GDN_ERR_SHAPE, "model documents: seq_offset %lld (one rank holds whole rows: 0)",
                        (long long)seq_offset);
    /* every row's window: 0, increasing, the same end T_full + 1 covering this rank's tokens */
    size_t total = 0;
    int64_t full = -1;
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = n_docs[b], *cu = doc_cu + total;
        if (n < 1 || n > ((int64_t)1 << 40))
            return gdn_fail(GDN_ERR_SHAPE, "model documents: row %lld has n_docs %lld", (long long)b, (long long)n);
        if (cu[0] != 0)
            return gdn_fail(GDN_ERR_SHAPE, "model documents: row %lld's offsets start at %lld, not 0", (long long)b,
                            (long long)cu[0]);
        for (int64_t d = 0; d < n; d++)
            if (cu[d + 1] <= cu[d])
                return gdn_fail(GDN_ERR_SHAPE, "model documents: row %lld's offsets are not increasing at %lld "
                                "(%lld then %lld)", (long long)b, (long long)d, (long long)cu[d], (long long)cu[d + 1]);
        if (b == 0) full = cu[n] - 1;
        else if (cu[n] - 1 != full)
            return gdn_fail(GDN_ERR_SHAPE, "model documents: row %lld's window has %lld tokens, row 0's %lld",
                            (long long)b, (long long)cu[n], (long long)(full + 1));
        total += (size_t)n + 1;
    }
    if (full < seq_offset + T || (!p->cp && full != T))
        return gdn_fail(GDN_ERR_SHAPE, "model documents: windows of %lld + 1 tokens do not match this rank's "
                        "tokens [%lld, %lld) plus the next", (long long)full, (long long)seq_offset,
                        (long long)(seq_offset + T));
    if (total + 1 > p->doc_cu_cap) {
        int64_t *grown = gdn_realloc("model: grown", p->doc_cu, sizeof(int64_t) * (total + 1));
        if (!grown) return gdn_fail(GDN_ERR_NOMEM, "model documents (%zu offsets)", total + 1);
        p->doc_cu = grown, p->doc_cu_cap = total + 1;
    }
    /* the layer's stream offsets (the documents that start before T_full, ending at T_full; one
     * rank: all rows in one stream), and which targets start a document */
    int64_t k = 0, predicted = 0;
    const int64_t *cu = doc_cu;
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = n_docs[b];
        if (p->cp) p->row_first[b] = k;
        for (int64_t d = 0; d < n && cu[d] < full; d++) p->doc_cu[k++] = (p->cp ? 0 : b * T) + cu[d];
        if (p->cp) {
            p->doc_cu[k++] = full;
            p->row_docs[b] = k - p->row_first[b] - 1;
        }
        int64_t d = 1;
        for (int64_t t = 0; t < T; t++) {
            const int64_t j = seq_offset + t + 1; /* the target's place in the window */
            while (d < n && cu[d] < j) d++;
            const int starts = d < n && cu[d] == j;
            p->skip[b * T + t] = (uint8_t)starts;
            predicted += !starts;
        }
        cu += n + 1;
    }
    p->seq_offset = seq_offset;
    p->ap_row = -1; /* packed CP: every row's documents are new */
    if (!p->cp) {
        p->doc_cu[k++] = B * T;
        p->row_docs[0] = k - 1;
        int rc = GDN_OK; /* one rank: every row's documents at once, in each kind's plan that exists */
        for (int kind = 0; kind < MIXER_KINDS && !rc; kind++)
            if (kind == MIXER_ATTN ? p->ap != NULL : p->lp != NULL)
                rc = mixer_table[kind].set_docs(p, -1, p->doc_cu, k - 1, 0);
        if (rc) return rc;
    }
    *targets = predicted;
    p->docs_set = 1;
    return GDN_OK;
}

/* ---------------------------------------------------------------- decode
 *
 * The decoder runs pieces of T tokens per sequence ([B, T] rows; T = 1 decodes) through the same
 * per-token code (norms, MLP, head over B * T rows) and each layer's mixer with its cache: a
 * GatedDeltaNet layer its conv and recurrent states (gdn_layer_forward for a piece, its decode for
 * one token), an attention layer its KV cache (gdn_attn_decode, positions from the cache length).
 * The one-token plans and buffers are made at create; a longer piece makes its plans (and grows
 * the buffers) at that prefill, so decoding allocates nothing. */

struct gdn_model_decoder {
    gdn_model_config cfg;
    int64_t B, max_len, len; /* len: tokens fed per sequence */
    int threads;
    gdn_layer_plan *lp1, *lpT;      /* GatedDeltaNet plans: one token, the current piece */
    gdn_attn_plan *ap1, *apT;       /* attention plans (NULL without attention layers) */
    gdn_moe_plan *mp1, *mpT;        /* MoE plans (NULL without MoE layers) */
    int64_t pT, cap_rows;           /* the piece plans' T; rows the buffers hold */
    int compute;                    /* the pieces' products (a token's stay fp32: compute.h) */
    gdn_ep *ep;                     /* the group the experts are split over (NULL: all here) */
    gdn_attn_cache **kv;            /* one per attention layer */
    float *conv, *rec;              /* per GatedDeltaNet layer: [B, conv_dim, Kc], [B, Hv, K, V] */
    float *x, *a, *y, *h, *gu, *m;  /* cap_rows rows */
    float *mm_ws;
    size_t conv_floats, rec_floats;
    size_t *woff; /* [L][WOFF]: gdn_model_blk_offset of the two norms and the MLP block, then the
                     layer's gdn_model_layer_offset; computed once (per token they cost a small
                     model's decode step a few %) */
};

enum { WOFF_LAYER = BLK_MLP + 1, WOFF = WOFF_LAYER + 1 };
static size_t blk_off(const gdn_model_decoder *d, int64_t l, int which) { return d->woff[l * WOFF + which]; }
static size_t layer_off(const gdn_model_decoder *d, int64_t l) { return blk_off(d, l, WOFF_LAYER); }

/* The per-layer cache index: layer l's place among the layers of its kind. */
static int64_t kind_index(const gdn_model_config *c, int64_t l) {
    return is_attn(c, l) ? gdn_model_attn_before(c, l) : l - gdn_model_attn_before(c, l);
}

/* The products' precision of a piece of T tokens: the decoder's for a prefill, fp32 for a token
 * (bound by reading the weights; compute.h). */
static int piece_compute(const gdn_model_decoder *d, int64_t T) { return T > 1 ? d->compute : GDN_COMPUTE_FP32; }

/* The plans for pieces of T > 1 tokens dropped: the next prefill makes them anew. */
static void drop_piece_plans(gdn_model_decoder *d) {
    gdn_layer_plan_destroy(d->lpT), gdn_attn_plan_destroy(d->apT), gdn_moe_plan_destroy(d->mpT);
    d->lpT = NULL, d->apT = NULL, d->mpT = NULL, d->pT = 0;
}

/* Plans of the mixers and the MoE blocks for pieces of T tokens (T = 1: the decode plans). */
static int decoder_plans(gdn_model_decoder *d, int64_t T, gdn_layer_plan **lp, gdn_attn_plan **ap,
                         gdn_moe_plan **mp) {
    const gdn_model_config *c = &d->cfg;
    const int compute = piece_compute(d, T);
    gdn_layer_config lc = gdn_model_layer_config(c, d->B, T);
    lc.threads = d->threads, lc.compute = compute;
    int rc = c->L > gdn_model_attn_layers(c) ? gdn_layer_plan_create(lp, &lc) : GDN_OK;
    if (!rc && gdn_model_attn_layers(c)) {
        gdn_attn_config ac = gdn_model_attn_config(c, d->B, T);
        ac.threads = d->threads, ac.compute = compute;
        rc = gdn_attn_plan_create(ap, &ac);
    }
    if (!rc && gdn_model_moe_layers(c)) {
        gdn_moe_config mc = gdn_model_moe_config(c, d->B * T);
        mc.threads = d->threads, mc.compute = compute;
        rc = gdn_moe_plan_create(mp, &mc);
    }
    return rc;
}

/* Buffers for B * T rows (kept: they only grow). */
static int decoder_rows(gdn_model_decoder *d, int64_t T) {
    const int64_t rows = d->B * T;
    if (rows <= d->cap_rows) return GDN_OK;
    const size_t E = (size_t)d->cfg.E, I = gdn_model_moe_layers(&d->cfg) < d->cfg.L ? (size_t)d->cfg.I : 0;
    float *x = gdn_calloc("model: x", (size_t)rows * (4 * E + 3 * I), sizeof(float));
    if (!x) return gdn_fail(GDN_ERR_NOMEM, "decoder: buffers for %lld rows", (long long)rows);
    free(d->x);
    d->x = x, d->cap_rows = rows;
    d->a = d->x + rows * E, d->y = d->a + rows * E, d->h = d->y + rows * E, d->gu = d->h + rows * E;
    d->m = d->gu + (size_t)rows * 2 * I;
    return GDN_OK;
}

int gdn_model_decoder_create(gdn_model_decoder **out, const gdn_model_config *c, int64_t B, int64_t max_len,
                             int threads, int cache_dtype) {
    if (!out) return gdn_fail(GDN_ERR_ARG, "decoder pointer is NULL");
    if (cache_dtype != 0 && cache_dtype != 2)
        return gdn_fail(GDN_ERR_ARG, "decoder cache dtype %d is neither F32 (0) nor BF16 (2)", cache_dtype);
    *out = NULL;
    int rc = gdn_isa_check();
    if (rc || (rc = gdn_model_config_check(c))) return rc;
    if (B < 1 || B > 4096) return gdn_fail(GDN_ERR_SHAPE, "decoder B = %lld is out of range [1, 4096]", (long long)B);
    const int64_t na = gdn_model_attn_layers(c), ng = c->L - na;
    if (max_len < 0 || (na && max_len < 1))
        return gdn_fail(GDN_ERR_SHAPE, "decoder max_len = %lld: a model with attention layers needs max_len >= 1 "
                        "(their KV caches hold that many tokens; 0, no limit, is for GatedDeltaNet-only models)",
                        (long long)max_len);
    if (na && c->max_position > 0 && max_len > c->max_position) /* positions matter to attention only */
        return gdn_fail(GDN_ERR_SHAPE, "decoder max_len = %lld is beyond max_position = %lld", (long long)max_len,
                        (long long)c->max_position);
    gdn_model_decoder *d = gdn_calloc("model: d", 1, sizeof *d);
    if (!d) return gdn_fail(GDN_ERR_NOMEM, "decoder");
    d->cfg = *c, d->B = B, d->max_len = max_len, d->threads = threads > 0 ? threads : omp_get_max_threads();
    if ((rc = decoder_plans(d, 1, &d->lp1, &d->ap1, &d->mp1)) || (rc = decoder_rows(d, 1))) {
        gdn_model_decoder_destroy(d);
        return rc;
    }
    gdn_layer_config lc = gdn_model_layer_config(c, B, 1);
    d->conv_floats = (size_t)(B * gdn_layer_conv_dim(&lc) * c->Kc);
    d->rec_floats = (size_t)(B * c->Hv * c->K * c->V);
    d->conv = gdn_calloc("model: d->conv", (size_t)ng * d->conv_floats + 1, sizeof(float));
    d->rec = gdn_calloc("model: d->rec", (size_t)ng * d->rec_floats + 1, sizeof(float));
    d->kv = gdn_calloc("model: d->kv", (size_t)na + 1, sizeof *d->kv);
    /* room for either precision's packing: gdn_model_decoder_set_compute may switch it later */
    d->mm_ws = gdn_malloc("model: d->mm_ws", sizeof(float) * gdn_matmul_compute_ws_floats(GDN_COMPUTE_BF16, d->threads));
    d->woff = gdn_malloc("model: d->woff", sizeof(size_t) * (size_t)(c->L * WOFF));
    if (!d->conv || !d->rec || !d->kv || !d->mm_ws || !d->woff) {
        gdn_model_decoder_destroy(d);
        return gdn_fail(GDN_ERR_NOMEM, "decoder caches");
    }
    for (int64_t l = 0; l < c->L; l++) {
        size_t *o = d->woff + l * WOFF;
        for (int b = 0; b <= BLK_MLP; b++) o[b] = gdn_model_blk_offset(c, l, b);
        o[WOFF_LAYER] = gdn_model_layer_offset(c, l);
    }
    for (int64_t i = 0; i < na; i++)
        if ((rc = gdn_attn_cache_create(&d->kv[i], B, c->Hkv, c->d, max_len, cache_dtype))) {
            gdn_model_decoder_destroy(d);
            return rc;
        }
    *out = d;
    return GDN_OK;
}

void gdn_model_decoder_destroy(gdn_model_decoder *d) {
    if (!d) return;
    gdn_layer_plan_destroy(d->lp1), gdn_layer_plan_destroy(d->lpT);
    gdn_attn_plan_destroy(d->ap1), gdn_attn_plan_destroy(d->apT);
    gdn_moe_plan_destroy(d->mp1), gdn_moe_plan_destroy(d->mpT);
    for (int64_t i = 0; d->kv && i < gdn_model_attn_layers(&d->cfg); i++) gdn_attn_cache_destroy(d->kv[i]);
    free(d->kv), free(d->conv), free(d->rec), free(d->x), free(d->mm_ws), free(d->woff);
    free(d);
}

void gdn_model_decoder_reset(gdn_model_decoder *d) {
    if (!d) return;
    const int64_t na = gdn_model_attn_layers(&d->cfg), ng = d->cfg.L - na;
    memset(d->conv, 0, sizeof(float) * (size_t)ng * d->conv_floats);
    memset(d->rec, 0, sizeof(float) * (size_t)ng * d->rec_floats);
    for (int64_t i = 0; i < na; i++) gdn_attn_cache_reset(d->kv[i]);
    d->len = 0;
}

int gdn_model_decoder_layer(gdn_model_decoder *d, int64_t l, gdn_model_decoder_view *out) {
    if (out) memset(out, 0, sizeof *out);
    if (!d || !out) return gdn_fail(GDN_ERR_ARG, "gdn_model_decoder_layer: decoder or out is NULL");
    if (l < 0 || l >= d->cfg.L)
        return gdn_fail(GDN_ERR_ARG, "decoder: layer %lld is outside the model's [0, %lld)", (long long)l,
                        (long long)d->cfg.L);
    const int64_t k = kind_index(&d->cfg, l);
    out->length = d->len;
    if (is_attn(&d->cfg, l)) {
        out->kv = d->kv[k];
    } else {
        out->conv_state = d->conv + (size_t)k * d->conv_floats;
        out->rec_state = d->rec + (size_t)k * d->rec_floats;
    }
    return GDN_OK;
}

/* The per-row norm for the decoder's rows (no plan: a tiny loop). */
/* Layer l's mixer on the piece d->a [B, T, E] into d->y, with its cache. */
static int decoder_mixer(gdn_model_decoder *d, int64_t l, int64_t T, const float *w) {
    const gdn_model_config *c = &d->cfg;
    const float *wl = w + layer_off(d, l);
    if (is_attn(c, l)) return gdn_attn_decode(T == 1 ? d->ap1 : d->apT, d->kv[kind_index(c, l)], d->y, d->a, wl);
    gdn_model_decoder_view v;
    gdn_model_decoder_layer(d, l, &v);
    return T == 1 ? gdn_layer_decode(d->lp1, d->y, d->a, wl, v.conv_state, v.rec_state)
                  : gdn_layer_forward(d->lpT, d->y, NULL, d->a, wl, v.conv_state, v.rec_state);
}

/* A piece of T tokens per sequence through every layer with its cache; the head over every
 * position (logits [B, T, vocab]) or, last_only, each sequence's last (logits [B, vocab]: what
 * generation needs; at a real vocabulary the head is most of a prefill's work). */
static int prefill(gdn_model_decoder *d, const float *w, const gdn_token *tokens, int64_t T, float *logits,
                   int last_only) {
    if (!d || !w || !tokens || !logits)
        return gdn_fail(GDN_ERR_ARG, "decode: decoder, w, tokens and logits must not be NULL");
    /* (under expert parallelism a failure before layer l's experts reaches the group there) */
    int rc = T < 1 ? gdn_fail(GDN_ERR_SHAPE, "decode: a piece of T = %lld tokens (>= 1)", (long long)T)
           : d->max_len && d->len + T > d->max_len
               ? gdn_fail(GDN_ERR_SHAPE, "decode: %lld tokens fed + %lld new exceed the decoder's max_len = %lld",
                          (long long)d->len, (long long)T, (long long)d->max_len)
               : check_tokens(T == 1 ? "decode" : "prefill", tokens, d->B, T, T, d->cfg.vocab, NULL);
    if (!rc && T > 1 && T != d->pT) { /* this piece length's plans (made at a prefill, never per token) */
        drop_piece_plans(d);
        if (!(rc = decoder_plans(d, T, &d->lpT, &d->apT, &d->mpT))) d->pT = T;
    }
    if (!rc) rc = decoder_rows(d, T);
    if (rc) return ep_failed(&d->cfg, d->ep, d->mp1, rc, 0, 1);
    const gdn_model_config *c = &d->cfg;
    const int64_t N = d->B * T, E = c->E, I = c->I;
    const int nt = d->threads, compute = piece_compute(d, T);
    for (int64_t i = 0; i < N; i++)
        memcpy(d->x + i * E, w + (size_t)tokens[i] * (size_t)E, sizeof(float) * (size_t)E);
    for (int64_t l = 0; l < c->L; l++) {
        rms_norm(nt, N, E, c->eps, d->a, NULL, d->x, w + blk_off(d, l, BLK_IN_NORM));
        if ((rc = decoder_mixer(d, l, T, w))) return ep_failed(c, d->ep, d->mp1, rc, l, 1);
        for (int64_t i = 0; i < N * E; i++) d->h[i] = d->x[i] + d->y[i];
        rms_norm(nt, N, E, c->eps, d->a, NULL, d->h, w + blk_off(d, l, BLK_POST_NORM));
        const float *wm = w + blk_off(d, l, BLK_MLP);
        if (is_moe(c, l)) { /* only the chosen experts' weights are read */
            gdn_moe_plan *mp = T == 1 ? d->mp1 : d->mpT;
            rc = d->ep ? gdn_model_experts_of(d->ep)->forward(d->ep, mp, d->y, NULL, d->a, wm, NULL)
                       : gdn_moe_forward(mp, d->y, NULL, d->a, wm, NULL, NULL, NULL);
            if (rc) return rc;
            for (int64_t i = 0; i < N * E; i++) d->x[i] = d->h[i] + d->y[i];
            continue;
        }
        int64_t wd;
        const int parts = gate_up_parts(c, &wd);
        for (int h = 0; h < parts; h++)
            gdn_matmul_compute(compute, GDN_GEMM_B_TRANS, N, wd, E, d->a, E, wm + dense_off(c, DENSE_GATE + h), E,
                               d->gu + h * I, 2 * I, d->mm_ws, nt);
        for (int64_t i = 0; i < N; i++) gdn_swiglu_row(d->m + i * I, d->gu + i * 2 * I, d->gu + i * 2 * I + I, I);
        memcpy(d->x, d->h, sizeof(float) * (size_t)(N * E));
        gdn_matmul_compute(compute, GDN_GEMM_B_TRANS | GDN_GEMM_ACC, N, E, I, d->m, I, wm + dense_off(c, DENSE_DOWN),
                           I, d->x, E, d->mm_ws, nt);
    }
    const float *wf = w + gdn_model_final_norm_offset(c);
    int64_t rows = N;
    if (last_only && T > 1) { /* each sequence's last position's row, then the head over B rows */
        for (int64_t b = 0; b < d->B; b++) rms_norm(1, 1, E, c->eps, d->a + b * E, NULL, d->x + (b * T + T - 1) * E, wf);
        rows = d->B;
    } else {
        rms_norm(nt, N, E, c->eps, d->a, NULL, d->x, wf);
    }
    gdn_matmul_compute(compute, GDN_GEMM_B_TRANS, rows, c->vocab, E, d->a, E,
                       w + gdn_model_lm_head_offset(c), E, logits, c->vocab, d->mm_ws, nt);
    d->len += T;
    return GDN_OK;
}

int gdn_model_decoder_set_compute(gdn_model_decoder *d, int compute) {
    if (!d) return gdn_fail(GDN_ERR_ARG, "decoder is NULL");
    if (compute != GDN_COMPUTE_FP32 && compute != GDN_COMPUTE_BF16)
        return gdn_fail(GDN_ERR_ARG, "decoder compute %d is neither GDN_COMPUTE_FP32 (0) nor GDN_COMPUTE_BF16 (1)",
                        compute);
    if (compute != d->compute) drop_piece_plans(d); /* remade in it at the next prefill */
    d->compute = compute;
    return GDN_OK;
}

int gdn_model_decoder_set_experts(gdn_model_decoder *d, gdn_ep *ep) {
    if (!d) return gdn_fail(GDN_ERR_ARG, "decoder set experts: decoder is NULL");
    return set_experts(&d->cfg, ep, &d->ep, "decoder set experts");
}

int gdn_model_prefill(gdn_model_decoder *d, const float *w, const gdn_token *tokens, int64_t T, float *logits) {
    return prefill(d, w, tokens, T, logits, 0);
}
int gdn_model_prefill_last(gdn_model_decoder *d, const float *w, const gdn_token *tokens, int64_t T, float *logits) {
    return prefill(d, w, tokens, T, logits, 1);
}
int gdn_model_decode(gdn_model_decoder *d, const float *w, const gdn_token *tokens, float *logits) {
    /* (tests: every decoded token attending to itself alone must be caught against the references) */
    if (d && gdn_test_mutate("decode: the attention caches emptied before each step"))
        for (int64_t l = 0; l < d->cfg.L; l++)
            if (is_attn(&d->cfg, l)) gdn_attn_cache_reset(d->kv[kind_index(&d->cfg, l)]);
    return prefill(d, w, tokens, 1, logits, 0);
}
