/* The sparse mixture-of-experts MLP of Qwen3.5-MoE / Qwen3.6 / Qwen3-Next (DESIGN §13) on one
 * rank: forward, backward (router included, and the aux loss's gradient), the float64 reference. */
#ifndef GDNCP_MOE_H
#define GDNCP_MOE_H

#include <stddef.h>
#include <stdint.h>

#include "compute.h"
#include "version.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- the sparse MoE block
 *
 * x [N, E] -> y [N, E], token by token (rows are independent: a block of any B, T, any document
 * layout or CP shard is N = its rows):
 *
 *   l = W_r x (n_experts logits)    p = softmax(l) (fp32)    S = the top_k experts by p (torch.topk
 *   order: largest first; an exact tie goes to the lower index)    w_j = p_j / sum_{i in S} p_i when
 *   norm_topk, else p_j    e_j(x) = D_j (silu(G_j x) * U_j x)
 *   y = sum_{j in S} w_j e_j(x)  +  sigmoid(g . x) s(x)     (s: the shared expert, same form; none
 *                                                            when Is = 0)
 *
 * Parameters: one flat fp32 array, the tensors in gdn_moe_param_id order at the offsets gdn_moe_param gives,
 * each in transformers' in-memory shape (the experts fused: gate_up_proj [n_experts, 2I, E], the
 * gate rows of expert e first, then its up rows; down_proj [n_experts, E, I]); gradients use the
 * same layout. Execution is grouped: the (token, slot) pairs sorted by expert (a counting sort,
 * stable in token order), each expert's rows one GEMM; an expert no token chose costs nothing
 * and its weights are not read; the combine adds each token's slots in slot order, so results do
 * not depend on the thread count or on how the rows are split (CP shards) beyond the GEMMs'
 * rounding. */

typedef enum {
    GDN_MOE_ROUTER = 0,        /* gate.weight                     [n_experts, E] */
    GDN_MOE_GATE_UP,           /* experts.gate_up_proj            [n_experts, 2I, E] */
    GDN_MOE_DOWN,              /* experts.down_proj               [n_experts, E, I] */
    GDN_MOE_SHARED_GATE,       /* shared_expert.gate_proj.weight  [Is, E] */
    GDN_MOE_SHARED_UP,         /* shared_expert.up_proj.weight    [Is, E] */
    GDN_MOE_SHARED_DOWN,       /* shared_expert.down_proj.weight  [E, Is] */
    GDN_MOE_SHARED_EXPERT_GATE,/* shared_expert_gate.weight       [1, E] */
    GDN_MOE_COUNT
} gdn_moe_param_id;

typedef struct {
    int64_t N;            /* token rows per call */
    int64_t E;            /* hidden_size */
    int64_t n_experts;    /* num_experts, 1..GDN_MOE_MAX_EXPERTS */
    int64_t top_k;        /* num_experts_per_tok, 1..n_experts */
    int64_t I;            /* moe_intermediate_size */
    int64_t Is;           /* shared_expert_intermediate_size (0: no shared expert, no gate) */
    int norm_topk;        /* renormalise the chosen experts' weights to sum 1 (Qwen3.5-MoE: always;
                             Qwen3-Next: norm_topk_prob) */
    int threads;          /* OpenMP threads (0: all) */
    int check_finite;     /* reject NaN/Inf in x, dy and the router's logits */
    int compute;          /* GDN_COMPUTE_FP32 or GDN_COMPUTE_BF16: the expert, shared-expert and
                             router products with bf16 operands and fp32 accumulation; softmax,
                             top-k, weights and the combine stay fp32 */
    /* Expert parallelism (ep.h, libgdncp_mpi): the routed experts split over ep_size ranks, this
     * block holding slice ep_rank, experts [ep_rank n_experts / ep_size, (ep_rank + 1) n_experts
     * / ep_size), so that gate_up_proj and down_proj have n_experts / ep_size rows here (ep_size
     * divides n_experts). 0 or 1: every expert (the default); the router and the shared expert
     * are whole either way. A sliced block runs only through gdn_moe_ep_forward/backward. */
    int64_t ep_size, ep_rank;
} gdn_moe_config;

#define GDN_MOE_MAX_EXPERTS 4096

/* Defaults: norm_topk 1, all threads, checks on, fp32. */
GDN_API gdn_moe_config gdn_moe_config_default(int64_t N, int64_t E, int64_t n_experts, int64_t top_k,
                                              int64_t I, int64_t Is);
GDN_API int gdn_moe_config_check(const gdn_moe_config *cfg);
/* The experts this block holds: *first and the count (n_experts / ep_size; all when ep_size <= 1). */
GDN_API int64_t gdn_moe_local_experts(const gdn_moe_config *cfg, int64_t *first);
/* Parameter `which` (gdn_moe_param_id) into *info: transformers' in-memory name ("gate.weight",
 * "experts.gate_up_proj", ...), shape (ndim 0 for a shared-expert tensor when Is = 0), offset and
 * size in the flat array (compute.h); GDN_ERR_ARG for a `which` outside [0, GDN_MOE_COUNT). */
GDN_API int gdn_moe_param(const gdn_moe_config *cfg, int which, gdn_param_info *info);
GDN_API size_t gdn_moe_param_floats(const gdn_moe_config *cfg); /* the whole array */

typedef struct gdn_moe_plan gdn_moe_plan;
GDN_API int gdn_moe_plan_create(gdn_moe_plan **plan, const gdn_moe_config *cfg);
GDN_API void gdn_moe_plan_destroy(gdn_moe_plan *plan);
/* What a MoE plan is (gdn_moe_plan_describe). */
typedef struct {
    const gdn_moe_config *config; /* the config it was made with: the plan's own, valid while it lives */
    size_t saved_floats;  /* floats the forward keeps for the backward (routing, the router's
                             probabilities, the experts' gate/up activations per (token, slot), the
                             shared expert's) */
    double bytes;         /* bytes of the plan's workspace */
} gdn_moe_plan_info;
/* The plan's config, saved floats and workspace bytes into *info (zeroed, and GDN_ERR_ARG, for a
 * NULL plan). */
GDN_API int gdn_moe_plan_describe(const gdn_moe_plan *plan, gdn_moe_plan_info *info);

/* The router's statistics of the rows of one forward, for the aux loss (transformers'
 * load_balancing_loss_func): count[e] = (token, slot) choices of expert e, prob[e] = the sum over
 * the rows of p_e. Added into stats = [count[n_experts] | prob[n_experts]] (doubles). */

/* Forward. saved (NULL: inference) receives what the backward needs; stats (NULL: not wanted)
 * accumulates the router statistics above; routing (NULL: not wanted) receives each row's chosen
 * experts [N, top_k] (int32, largest p first) and weights [N, top_k] into routing_w (NULL: not
 * wanted). */
GDN_API int gdn_moe_forward(gdn_moe_plan *plan, float *y, float *saved, const float *x, const float *w,
                            double *stats, int32_t *routing, float *routing_w);

/* Backward of loss = sum(y * dy) + sum_rows sum_e aux_dp[e] * p_e(row): dx [N, E] and dw (flat,
 * overwritten) for the forward that filled saved. aux_dp (NULL: no aux term) is the aux loss's
 * gradient with respect to every row's router probability p_e, the same for every row
 * (coef * n_experts * f_e / R for transformers' aux loss; gdn_moe_aux). The router's gradient
 * flows through the weights w (and p, and the renormalisation), not through the choice S. */
GDN_API int gdn_moe_backward(gdn_moe_plan *plan, float *dx, float *dw, const float *x, const float *w,
                             const float *saved, const float *dy, const float *aux_dp);

/* The aux loss from router statistics summed over every MoE layer's rows (and every rank's):
 * stats = [count[n] | prob[n]], R the rows they cover (each layer's rows counted again):
 * returns aux = n * sum_e (count[e] / R) (prob[e] / R); aux_dp (NULL: not wanted) receives
 * d(coef * aux) / d p_e(row) = coef * n * count[e] / R^2 (the choice counts carry no gradient). */
GDN_API double gdn_moe_aux(int64_t n_experts, const double *stats, double R, double coef, float *aux_dp);

/* The block in double precision with plain loops: the oracle the fp32 block is tested against
 * (same routing rule; cfg.compute is ignored). routing [N, top_k] (NULL: not wanted) receives the
 * chosen experts. The backward takes aux_dp as gdn_moe_backward (NULL: none). */
GDN_API int gdn_moe_reference_forward(const gdn_moe_config *cfg, double *y, const double *x, const double *w,
                                      int32_t *routing);
GDN_API int gdn_moe_reference_backward(const gdn_moe_config *cfg, double *dx, double *dw, const double *x,
                                       const double *w, const double *dy, const double *aux_dp);

#ifdef __cplusplus
}
#endif

#endif /* GDNCP_MOE_H */
