/* The Qwen3.5 GatedDeltaNet layer on one rank: forward, backward, decode, the float64
 * reference. */
#ifndef GDNCP_LAYER_H
#define GDNCP_LAYER_H

#include <stdint.h>
#include "compute.h"
#include "kernel.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- the Qwen3.5 GatedDeltaNet layer
 *
 * x [B,T,E] -> y [B,T,E] (DESIGN §5): in_proj_qkv/z/b/a, causal depthwise conv (kernel Kc) + SiLU
 * over the [q|k|v] channels, beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), the gated
 * delta rule (L2 norm on, scale 1/sqrt(K)), gated RMSNorm per value head, out_proj.
 *
 * Parameters live in one flat fp32 array, the tensors in gdn_layer_param_id order at
 * the offsets gdn_layer_param gives, each in its Hugging Face shape (PyTorch [out, in]); gradients use
 * the same layout. */

#define GDN_MAX_CONV 16 /* Kc may be 1..this */

typedef enum {
    GDN_LAYER_KEEP_MIN = 0,  /* forward keeps for the backward only the kernel's saved states
                                (x stays the caller's): projections, conv and kernel outputs are
                                recomputed in the backward */
    GDN_LAYER_KEEP_PROJ = 1  /* also keeps the projections and the kernel output (faster
                                backward, ~4x the bytes of x per token at Qwen shapes) */
} gdn_layer_keep;

typedef struct {
    int64_t B, T;          /* batch rows, tokens per call (under CP: this rank's shard) */
    int64_t E;             /* hidden size */
    int64_t Hk, Hv, K, V;  /* heads and head dims as in gdn_config */
    int64_t Kc;            /* causal conv kernel size (linear_conv_kernel_dim, 4 in Qwen) */
    float eps;             /* gated RMSNorm epsilon (rms_norm_eps) */
    int chunk;             /* kernel chunk (0: 64) */
    int threads;           /* OpenMP threads (0: all) */
    int keep;              /* gdn_layer_keep */
    int check_finite;      /* reject NaN/Inf in x, dy and the weights */
    int weight_dtype;      /* GDN_F32 (default) or GDN_BF16: the flat parameters `w` are then
                              bfloat16 (uint16_t) and stay so in memory (forward and decode only;
                              the backward trains fp32 weights) */
    int compute;           /* GDN_COMPUTE_FP32 (0, default) or GDN_COMPUTE_BF16 (compute.h): in_proj_qkv,
                              in_proj_z and out_proj (forward, dx and dW) with bf16 operands and fp32
                              accumulation, and the chunk kernel's forward products likewise; the
                              state, the kernel's backward, conv, gates and norm stay fp32 */
    const int64_t *cu_seqlens; /* packed documents, as in gdn_config (B = 1; NULL: dense): the conv
                                  and the recurrent state restart at every document start (no tap
                                  reads across one, also across the CP halo); every document starts
                                  from zero states: conv_state [n_docs, conv_dim, Kc] and rec_state
                                  [n_docs, Hv, K, V], when given, must hold zeros and receive each
                                  document's final caches (a packed prefill, then decode with
                                  B = n_docs) */
    int64_t n_docs;
    int64_t seq_offset;        /* under CP: this rank's first token in the packed stream */
    int cp;                    /* under CP: the rule's gdn_cp_strategy (kernel.h; GDN_CP_SCAN, 0,
                                  default) */
} gdn_layer_config;

typedef enum {
    GDN_P_IN_PROJ_QKV = 0, /* [conv_dim, E], conv_dim = 2 Hk K + Hv V */
    GDN_P_IN_PROJ_Z,       /* [Hv V, E] */
    GDN_P_IN_PROJ_B,       /* [Hv, E] */
    GDN_P_IN_PROJ_A,       /* [Hv, E] */
    GDN_P_CONV1D,          /* [conv_dim, 1, Kc] */
    GDN_P_A_LOG,           /* [Hv] */
    GDN_P_DT_BIAS,         /* [Hv] */
    GDN_P_NORM,            /* [V] */
    GDN_P_OUT_PROJ,        /* [E, Hv V] */
    GDN_P_COUNT
} gdn_layer_param_id;

/* Defaults: Kc 4, eps 1e-6, chunk 64, all threads, KEEP_MIN, checks on. */
GDN_API gdn_layer_config gdn_layer_config_default(int64_t B, int64_t T, int64_t E, int64_t Hk,
                                          int64_t Hv, int64_t K, int64_t V);
GDN_API int gdn_layer_config_check(const gdn_layer_config *cfg);
GDN_API int64_t gdn_layer_conv_dim(const gdn_layer_config *cfg);
/* Parameter `which` (gdn_layer_param_id) into *info: its Hugging Face name ("in_proj_qkv.weight",
 * "conv1d.weight", "A_log", ...), shape, offset and size in the flat array (compute.h);
 * GDN_ERR_ARG for a `which` outside [0, GDN_P_COUNT). */
GDN_API int gdn_layer_param(const gdn_layer_config *cfg, int which, gdn_param_info *info);
GDN_API size_t gdn_layer_param_floats(const gdn_layer_config *cfg); /* the whole array */

typedef struct gdn_layer_plan gdn_layer_plan;

GDN_API int gdn_layer_plan_create(gdn_layer_plan **plan, const gdn_layer_config *cfg);
GDN_API void gdn_layer_plan_destroy(gdn_layer_plan *plan);
/* What a layer plan is (gdn_layer_plan_describe). */
typedef struct {
    const gdn_layer_config *config; /* the config it was made with: the plan's own, valid while it lives */
    const char *path;               /* name of the GEMM path the projections run (cfg.compute's:
                                       gdn_compute_path; static) */
    size_t saved_floats;            /* floats the forward keeps for the backward (depends on cfg.keep) */
} gdn_layer_plan_info;
/* The plan's config, path and saved floats into *info (zeroed, and GDN_ERR_ARG, for a NULL plan). */
GDN_API int gdn_layer_plan_describe(const gdn_layer_plan *plan, gdn_layer_plan_info *info);
/* Other documents for a packed layer plan (gdn_plan_set_docs; the conv restarts move too). A
 * forward's saved floats belong to the documents it ran with: set the same ones for its backward. */
GDN_API int gdn_layer_plan_set_docs(gdn_layer_plan *plan, const int64_t *cu_seqlens, int64_t n_docs,
                            int64_t seq_offset);

/* Forward. w: the flat parameters (float, or uint16_t BF16 when cfg.weight_dtype is GDN_BF16).
 * saved (may be NULL: inference) receives what the backward
 * needs. conv_state [B, conv_dim, Kc] (Hugging Face's cache layout, newest column last) and
 * rec_state [B,Hv,K,V] may be NULL (zeros; not returned); when given they hold the state before x
 * on entry and the state after x on return, so a prompt can be prefilled in pieces. */
GDN_API int gdn_layer_forward(gdn_layer_plan *plan, float *y, float *saved, const float *x,
                      const void *w, float *conv_state, float *rec_state);

/* Backward of loss = sum(y * dy): dx [B,T,E] and dw (flat, overwritten) for the forward that
 * filled saved (with its initial states, if any). saved NULL: the forward started from zero
 * states and everything is recomputed. */
GDN_API int gdn_layer_backward(gdn_layer_plan *plan, float *dx, float *dw, const float *x,
                       const float *w, const float *saved, const float *dy);

/* Decode: one token for each of the plan's B sequences, x, y [B,1,E] (any plan of this B; its T
 * is not used), conv_state and rec_state in place as above (required). No chunk machinery,
 * nothing allocated. */
GDN_API int gdn_layer_decode(gdn_layer_plan *plan, float *y, const float *x, const void *w,
                     float *conv_state, float *rec_state);

/* The layer in double precision with plain loops (zero initial states): the oracle the fp32
 * layer is tested against. w, dw: flat parameters as above, in double. With cfg.compute =
 * GDN_COMPUTE_BF16 the operands of the products the BF16 mode runs in bf16 are rounded to bf16
 * (nearest even) and all else is exact: the BF16 layer's oracle. */
GDN_API int gdn_layer_reference_forward(const gdn_layer_config *cfg, double *y, const double *x,
                                const double *w);
GDN_API int gdn_layer_reference_backward(const gdn_layer_config *cfg, double *dx, double *dw,
                                 const double *x, const double *w, const double *dy);

#ifdef __cplusplus
}
#endif
#endif /* GDNCP_LAYER_H */
