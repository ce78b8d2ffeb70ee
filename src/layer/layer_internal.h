/* Internals of the GatedDeltaNet layer shared by the single-rank and context-parallel paths. */
#ifndef GDNCP_LAYER_INTERNAL_H
#define GDNCP_LAYER_INTERNAL_H

#include "kernel_internal.h"

#include <math.h>

/* The flat parameter arrays of both layers (the GatedDeltaNet layer, gated attention): each
 * tensor starts on a 16-float (64-byte) boundary, so the GEMMs see aligned rows 0. The elements
 * of a tensor of nd dims (0 dims: none, an unknown tensor), and the floats it takes in the array. */
static inline size_t gdn_param_numel(const int64_t *shape, int nd) {
    size_t n = nd > 0;
    for (int i = 0; i < nd; i++) n *= (size_t)shape[i];
    return n;
}
static inline size_t gdn_param_padded(size_t numel) { return (numel + 15) & ~(size_t)15; }

/* Stable scalar pieces of the layer (the double reference keeps its own). */
static inline float gdn_sigmoidf(float x) { return 1.0f / (1.0f + __builtin_expf(-x)); }
/* softplus as torch.nn.functional.softplus (beta 1, threshold 20): x itself above 20. */
static inline float gdn_softplusf(float x) { return x > 20.0f ? x : __builtin_log1pf(__builtin_expf(x)); }
static inline float gdn_siluf(float x) { return x * gdn_sigmoidf(x); }

/* Token rows are N = B*T. Per row the projections are one row of width P:
 * [qkv_pre (cd) | z (vd) | b (Hv) | a (Hv)], cd = conv_dim, vd = Hv*V. */
struct gdn_layer_plan {
    gdn_layer_config cfg;
    int threads;
    int64_t N, cd, vd, P, kd; /* kd = Hk*K */
    size_t param_off[GDN_P_COUNT + 1]; /* gdn_layer_param_offset of each tensor, once (per token
                                          they cost a decode step of a small model ~3 %) */
    gdn_plan *kplan;          /* the kernel's plan for [B, T] */
    size_t ckpt_floats;       /* the kernel's saved states */
    /* workspace, carved from one arena */
    float *proj, *dproj;              /* N x P */
    float *q, *k, *v, *g, *beta;      /* kernel inputs, [B,T,H,D] */
    float *dq, *dk, *dv, *dg, *dbeta; /* their gradients; dq/dk/dv become the conv's du */
    float *o, *nrm;                   /* N x vd: kernel output; gated-norm output (dn, do later) */
    float *ckpt;                      /* the kernel's saved states when the backward recomputes */
    float *halo, *dhalo;              /* B x (Kc-1) x cd: pre-conv rows before token 0 */
    float *convw;                     /* Kc x cd: conv taps transposed (channel-contiguous) */
    float *partial;                   /* threads x (Kc cd + V + 2 Hv): per-thread reductions */
    float *mm_ws;                     /* gdn_matmul packing space */
    float *wsmall;                    /* BF16 weights: fp32 copies of conv1d, A_log, dt_bias, norm */
    void *arena;
    int64_t *doc_begin; /* packed: per local token, its document's first token (local index, at
                           least -(Kc-1): the halo); the conv reads no row before it. NULL: dense */
};

/* What the forward keeps for the backward, carved from `saved`: the pre-conv rows before token 0
 * and the recurrent state entering the call (its shard under CP); with KEEP_PROJ also the
 * kernel's saved states, the projections and the kernel output. */
typedef struct {
    float *halo, *h0, *ckpt, *proj, *o;
} gdn_layer_saved;
GDN_WING gdn_layer_saved gdn_layer_saved_view(const gdn_layer_plan *lp, float *saved);

/* The plan's kernel tensors as the rule's bundles (kernel.h): its q, k, v, g, beta with the
 * initial state h0 (NULL: zeros), and its dq .. dbeta (no dh0). */
static inline gdn_rule_inputs gdn_layer_rule_inputs(const struct gdn_layer_plan *lp, const float *h0) {
    return (gdn_rule_inputs){.q = lp->q, .k = lp->k, .v = lp->v, .g = lp->g, .beta = lp->beta, .h0 = h0};
}
static inline gdn_rule_grads gdn_layer_rule_grads(const struct gdn_layer_plan *lp) {
    return (gdn_rule_grads){.dq = lp->dq, .dk = lp->dk, .dv = lp->dv, .dg = lp->dg, .dbeta = lp->dbeta};
}

/* Whether the conv may read pre-conv row tt (>= -(Kc-1)) for token t: dense always; packed only
 * from t's document on. */
static inline int gdn_layer_tap_ok(const struct gdn_layer_plan *lp, int64_t t, int64_t tt) {
    return !lp->doc_begin || tt >= lp->doc_begin[t];
}

/* The phases of the forward, shared with the CP path:
 * project: proj = x [W_qkv; W_z; W_b; W_a]^T for the first `rows` rows (a row stride of P).
 * conv_gates: causal conv + SiLU of proj's qkv columns (rows before 0 from halo) into q, k, v,
 *             and g, beta from its b, a columns.
 * norm: nrm = gated RMSNorm of o with proj's z columns. out: y = nrm W_out^T (first `rows` rows). */
GDN_WING void gdn_layer_project(gdn_layer_plan *lp, int64_t rows, float *proj, const float *x, const void *w);
GDN_WING void gdn_layer_conv_gates(gdn_layer_plan *lp, const float *proj, const float *halo, const void *w);
GDN_WING void gdn_layer_norm(gdn_layer_plan *lp, int64_t rows, const float *o, const float *proj,
                    const void *w);
GDN_WING void gdn_layer_out(gdn_layer_plan *lp, int64_t rows, float *y, const void *w);
/* Checks of the public entry points (NULLs, NaN/Inf in x or w); with BF16 weights it also makes
 * the fp32 copies of the small tensors (gdn_layer_weights_prepare), so call it first. */
GDN_WING int gdn_layer_check_inputs(gdn_layer_plan *lp, const float *x, const char *xname, const void *w);
int gdn_layer_weights_prepare(gdn_layer_plan *lp, const void *w, int check_finite);
/* GDN_ERR_DTYPE for BF16 weights (the backward trains fp32 weights). */
GDN_WING int gdn_layer_check_trainable(const gdn_layer_plan *lp);
/* The backward from the kernel inputs on (q..beta in lp, o, proj, halo as the forward had
 * them) down to the projections' gradient in lp->dproj: dw (overwritten) for every weight but
 * the four input projections, and the halo rows' gradient into dhalo (may be NULL).
 * kbwd runs the gated delta rule's backward (single rank or CP) from do (in lp->nrm) into
 * lp->dq .. lp->dbeta. Then gdn_layer_project_backward: dx and the projections' dw. */
typedef int (*gdn_layer_kernel_bwd)(gdn_layer_plan *lp, void *ctx);
GDN_WING int gdn_layer_backward_to_proj(gdn_layer_plan *lp, float *dw, float *dhalo, const float *w,
                               const float *proj, const float *o, const float *halo,
                               const float *dy, gdn_layer_kernel_bwd kbwd, void *ctx);
GDN_WING void gdn_layer_project_backward(gdn_layer_plan *lp, float *dx, float *dw, const float *x,
                                const float *w);

/* The double oracles' operands of a BF16-mode product (compute.h): v rounded to bfloat16's 8
 * significant bits, nearest even, when bf (normal range; zeros and non-finite values kept). */
static inline double gdn_ref_operand(int bf, double v) {
    if (!bf || v == 0.0 || !isfinite(v)) return v;
    int e;
    const double m = frexp(v, &e); /* |m| in [0.5, 1) */
    return ldexp(nearbyint(ldexp(m, 8)), e - 8);
}

#endif
