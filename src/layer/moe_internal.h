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
 *                      the backward redoes from sel); absent under expert parallelism (ep_size
 *                      > 1), where the experts' owners recompute them in the backward
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
    float *wr;              /* NK: each grouped row's slot weight */
    float *sm, *sdm, *sdgu; /* N x Is, N x Is, N x 2Is */
    float *sdl;             /* N: d(g . x) */
    float *mm_ws;           /* gdn_matmul_compute packing space */
    int64_t *start;         /* n + 1: the first grouped row of each expert */
    int32_t *pos;           /* NK: grouped row of pair (t, j) */
    int32_t *tok;           /* NK: token of grouped row r */
    void *arena;
    double bytes;
};

GDN_WING gdn_moe_saved gdn_moe_saved_view(const struct gdn_moe_plan *p, float *saved);
size_t gdn_moe_saved_floats_cfg(const gdn_moe_config *c);

/* The block's steps, shared by gdn_moe_forward/backward and the expert-parallel block of the MPI
 * wing (src/cp/moe_ep.c), which moves the grouped rows to the ranks holding their experts between
 * them. "Grouped rows": the (token, slot) pairs sorted by expert, stable in token order
 * (p->start, p->pos, p->tok after gdn_moe_route). */

/* The router (logits, softmax, top-k, weights into s), its statistics (stats, routing,
 * routing_w as gdn_moe_forward), the pairs grouped, x gathered into p->xg. Local: a non-finite
 * x or logit returns an error here, before anything is exchanged. */
GDN_WING int gdn_moe_route(gdn_moe_plan *p, const gdn_moe_saved *s, const float *x, const float *w, double *stats,
                           int32_t *routing, float *routing_w);
/* The routed experts' forward over grouped rows: expert j of the nexp whose weights GU, D hold
 * (GU [nexp, 2I, E], D [nexp, E, I]) takes rows [start[j], start[j + 1]) of xg (row stride ldx);
 * gu [rows, 2I] receives the gate/up activations, m [rows, I] is workspace, out [rows, E] (may
 * be xg when ldx = E; NULL: the activations alone) the expert outputs. */
GDN_WING void gdn_moe_experts_forward(gdn_moe_plan *p, int64_t nexp, const int64_t *start, const float *GU,
                                      const float *D, const float *xg, int64_t ldx, float *gu, float *m, float *out);
/* The shared expert's output into y (scaled at the combine), its activations into s. */
GDN_WING void gdn_moe_shared_forward(gdn_moe_plan *p, float *y, const gdn_moe_saved *s, const float *x,
                                     const float *w);
/* y[t] = sum_j w_tj out(t, j) in slot order (+ sigmoid(g . x_t) y[t], the shared expert's output
 * already there); outg: the pairs' expert outputs in grouped order, row stride E. */
GDN_WING void gdn_moe_combine(gdn_moe_plan *p, float *y, const gdn_moe_saved *s, const float *outg);
/* The routed experts' backward over grouped rows (start, GU, D as the forward): rows of xg
 * (stride ldx), dyg (stride ldd) and their slot weights wr; gu the rows' gate/up activations
 * (saved or recomputed). dGU, dD (overwritten; zero for an expert with no row); c[r] = <dy_r,
 * e(x_r)> for the router; dxg (may be dyg: each expert's rows are read before they are
 * overwritten) the rows' dx, stride ldd. m, dm [rows, I], dgu [rows, 2I]: workspace. */
GDN_WING void gdn_moe_experts_backward(gdn_moe_plan *p, int64_t nexp, const int64_t *start, const float *GU,
                                       const float *D, float *dGU, float *dD, const float *xg, int64_t ldx,
                                       const float *gu, const float *dyg, int64_t ldd, const float *wr, float *m,
                                       float *dm, float *dgu, float *c, float *dxg);
/* The rest of the backward: the router (with the aux term), the shared expert, and dx's combine,
 * from the pairs' dx (dxg, grouped order, stride lddx) and c (grouped row r at cg[r * ldc]);
 * zeroes dw's padding. p->start/pos/tok must be those of s (gdn_moe_group_saved). */
GDN_WING void gdn_moe_router_shared_backward(gdn_moe_plan *p, float *dx, float *dw, const float *x, const float *w,
                                             const gdn_moe_saved *s, const float *dy, const float *aux_dp,
                                             const float *dxg, int64_t lddx, const float *cg, int64_t ldc);
/* The checks of a backward's inputs, then the pairs of saved grouped again (p->start/pos/tok)
 * and each grouped row's weight into p->wr. */
GDN_WING int gdn_moe_backward_begin(gdn_moe_plan *p, const gdn_moe_saved *s, const float *x, const float *dy);

#endif
