/* Internals of the sparse mixture-of-experts MLP (moe.c, moe_params.c). */
#ifndef GDNCP_MOE_INTERNAL_H
#define GDNCP_MOE_INTERNAL_H

#include "layer_internal.h"

/* What the forward keeps for the backward, carved from `saved` in this order, each piece starting
 * on a 16-float boundary (gdn_carve), NK = N * top_k (token t's slot j is pair t*top_k + j):
 *   sel  [NK]          the chosen experts, int32 stored bitwise in the float slots, per token
 *                      largest p first (torch.topk's order)
 *   w    [NK]          their weights (renormalised when norm_topk)
 *   p    [N, n]        the router's probabilities (fp32 softmax)
 *   gu   [NK, 2I]      each pair's expert [gate | up] activations, in GROUPED order: the pairs
 *                      sorted by expert, stable in token order (the counting sort of sel, which
 *                      the backward redoes from sel)
 *   sgu  [N, 2Is]      the shared expert's [gate | up] activations   (absent when Is = 0)
 *   sgl  [N]           the shared expert's gate logit g . x          (absent when Is = 0) */
typedef struct {
    int32_t *sel;
    float *w, *p, *gu, *sgu, *sgl;
} gdn_moe_saved;

struct gdn_moe_plan {
    gdn_moe_config cfg;
    int threads;
    int64_t N, E, n, k, I, Is, NK;
    size_t off[GDN_MOE_COUNT + 1]; /* gdn_moe_param_offset of each tensor */
    size_t saved_floats;
    /* workspace, carved from one arena */
    float *scratch_saved;   /* the forward's `saved` when the caller passes NULL */
    float *lg;              /* N x n: router logits (the backward: dl) */
    float *xg;              /* NK x E: x gathered in grouped order (forward: then the experts' outputs) */
    float *dyg;             /* NK x E: dy gathered (then the pairs' dx) */
    float *m;               /* NK x I: silu(gate) * up (the backward: w * m) */
    float *dm;              /* NK x I */
    float *dgu;             /* NK x 2I */
    float *c;               /* NK: <dy, e_j(x)> per pair (grouped order) */
    float *sm, *sdm, *sdgu; /* N x Is, N x Is, N x 2Is */
    float *sdl;             /* N: d(g . x) */
    float *mm_ws;           /* gdn_matmul_compute packing space */
    int64_t *start;         /* n + 1: the first grouped row of each expert */
    int32_t *pos;           /* NK: grouped row of pair (t, j) */
    int32_t *tok;           /* NK: token of grouped row r */
    void *arena;
    double bytes;
};

gdn_moe_saved gdn_moe_saved_view(const struct gdn_moe_plan *p, float *saved);
size_t gdn_moe_saved_floats_cfg(const gdn_moe_config *c);

#endif
