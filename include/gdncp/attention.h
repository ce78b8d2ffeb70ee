/* Qwen3.5's gated full-attention layer (`self_attn`, DESIGN §10) on one rank: forward,
 * backward, the float64 reference. */
#ifndef GDNCP_ATTENTION_H
#define GDNCP_ATTENTION_H

#include <stddef.h>
#include <stdint.h>
#include "compute.h"
#include "version.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- gated full attention
 *
 * x [B,T,E] -> y [B,T,E]: [q~ | gate] per head from q_proj (interleaved per head), k~, v from
 * k_proj, v_proj; zero-centred RMSNorm per head on q~ and k~ with (1 + w); RoPE on the first R
 * dims (half-split, inv_freq_i = theta^(-2i/R)); causal softmax attention, scale d^-1/2, query
 * head h on kv head h / (H/Hkv); times sigmoid(gate); o_proj.
 *
 * RoPE angles: inv_freq and p * inv_freq are computed in double and cos/sin rounded to fp32
 * once per (position, pair): the exact angles (transformers computes them in fp32; the two
 * differ by ~1e-7 * p rad, ~0.016 rad near p = 256K). The float64 reference does the same in
 * double throughout.
 *
 * The core runs flash style: query and key tiles, running max and sum in fp32, only the
 * log-sum-exp per (token, head) kept; the backward recomputes the probabilities. Memory O(T),
 * tiles above the diagonal and tiles outside a packed document skipped.
 *
 * Parameters live in one flat fp32 array, the tensors in gdn_attn_param_id order at
 * the offsets gdn_attn_param gives (64-byte aligned), each in its Hugging Face shape (PyTorch
 * [out, in]); gradients use the same layout. */

typedef struct {
    int64_t B, T;       /* batch rows, tokens per row */
    int64_t E;          /* hidden size */
    int64_t H, Hkv, d;  /* query heads, kv heads (H % Hkv == 0), head size */
    int64_t R;          /* rotary dims: int(d * partial_rotary_factor), even, <= d */
    double rope_theta;  /* RoPE base (rope_parameters.rope_theta) */
    float eps;          /* RMSNorm epsilon (rms_norm_eps) */
    int threads;        /* OpenMP threads (0: all) */
    int check_finite;   /* reject NaN/Inf in x, dy and the weights */
    const int64_t *cu_seqlens; /* packed documents (B = 1; NULL: dense), n_docs + 1 offsets of the
                                  whole stream, 0 = cu[0] < ... < cu[n_docs] (= T on one rank;
                                  under CP the whole stream's length): attention never crosses a
                                  document, positions restart at 0 at each document start */
    int64_t n_docs;
    int64_t pos_offset; /* dense: the position of the stream's token 0 in every row (positions
                           pos_offset + seq_offset + t); packed: must be 0 */
    int64_t seq_offset; /* the stream index of this call's token 0: 0 on one rank; under CP the
                           tokens of the ranks before (checked against the shards) */
    int64_t max_position; /* max_position_embeddings: every position must be below it (0: none) */
    int cp;               /* under CP: GDN_ATTN_CP_KV or GDN_ATTN_CP_HEADS (gdncp/cp.h) */
    int keep;             /* what a forward's saved floats hold for the backward: GDN_ATTN_KEEP_ALL
                             or GDN_ATTN_KEEP_CORE (below) */
    int compute;          /* GDN_COMPUTE_FP32 (0, default) or GDN_COMPUTE_BF16 (compute.h): q/k/v_proj
                             and o_proj (forward, dx and dW) and the core's products (QK^T, PV and
                             the backward's five, on blocks of more than 8 query rows: not a decode
                             step's) with bf16 operands and fp32 accumulation; norms, RoPE, the
                             softmax and its statistics stay fp32 */
} gdn_attn_config;

/* Memory modes. KEEP_ALL (default): the projections, the core's output and its log-sum-exp,
 * B T (2Hd + 2Hkv d + Hd + H) floats; the backward recomputes nothing. KEEP_CORE: only the core's
 * output and log-sum-exp, B T (Hd + H) floats (about a quarter at Qwen3.5's shapes); the backward
 * recomputes the projections, norms and RoPE (token-local GEMMs) but never the O(T^2) core. A
 * backward without saved floats recomputes everything. */
enum { GDN_ATTN_KEEP_ALL = 0, GDN_ATTN_KEEP_CORE = 1 };

/* Context-parallel strategies of the attention core (gdn_attn_cp_forward, gdncp/cp.h). */
enum { GDN_ATTN_CP_KV = 0, GDN_ATTN_CP_HEADS = 1 };

typedef enum {
    GDN_A_Q_PROJ = 0, /* [2 H d, E]: per head h rows [2hd, 2hd+d) query, [2hd+d, 2hd+2d) gate */
    GDN_A_K_PROJ,     /* [Hkv d, E] */
    GDN_A_V_PROJ,     /* [Hkv d, E] */
    GDN_A_O_PROJ,     /* [E, H d] */
    GDN_A_Q_NORM,     /* [d] */
    GDN_A_K_NORM,     /* [d] */
    GDN_A_COUNT
} gdn_attn_param_id;

/* Defaults: R = int(0.25 d) rounded down to even, rope_theta 1e7 (Qwen3.5 checkpoints), eps
 * 1e-6, all threads, checks on, dense, pos_offset 0. */
GDN_API gdn_attn_config gdn_attn_config_default(int64_t B, int64_t T, int64_t E, int64_t H, int64_t Hkv,
                                                int64_t d);
GDN_API int gdn_attn_config_check(const gdn_attn_config *cfg);
/* Parameter `which` (gdn_attn_param_id) into *info: its Hugging Face name ("q_proj.weight", ...,
 * "k_norm.weight"), shape, offset and size in the flat array (compute.h); GDN_ERR_ARG for a
 * `which` outside [0, GDN_A_COUNT). */
GDN_API int gdn_attn_param(const gdn_attn_config *cfg, int which, gdn_param_info *info);
GDN_API size_t gdn_attn_param_floats(const gdn_attn_config *cfg); /* the whole array */

typedef struct gdn_attn_plan gdn_attn_plan;

/* Plan once (checks the config, allocates every workspace, tabulates cos/sin per position);
 * execute allocates nothing. */
GDN_API int gdn_attn_plan_create(gdn_attn_plan **plan, const gdn_attn_config *cfg);
GDN_API void gdn_attn_plan_destroy(gdn_attn_plan *plan);
/* What an attention plan is (gdn_attn_plan_describe). */
typedef struct {
    const gdn_attn_config *config; /* the config it was made with: the plan's own, valid while it lives */
    size_t saved_floats;  /* floats the forward keeps for the backward (cfg.keep): with KEEP_ALL the
                             projections (B T (2Hd + 2Hkv d)), the attention output before the gate
                             (B T H d) and the log-sum-exp (B T H); with KEEP_CORE the last two */
} gdn_attn_plan_info;
/* The plan's config and saved floats into *info (zeroed, and GDN_ERR_ARG, for a NULL plan). */
GDN_API int gdn_attn_plan_describe(const gdn_attn_plan *plan, gdn_attn_plan_info *info);
/* Another step's documents, or this shard's place in the stream, for a plan (the cos/sin table is
 * redone; nothing else changes): a packed plan takes new cu_seqlens (n_docs + 1 offsets, checked
 * as at plan creation), a dense one NULL (then only seq_offset moves). A forward's saved floats
 * belong to the documents it ran with: set the same ones for its backward. On failure the plan
 * keeps what it had. */
GDN_API int gdn_attn_plan_set_docs(gdn_attn_plan *plan, const int64_t *cu_seqlens, int64_t n_docs,
                                   int64_t seq_offset);

/* Forward: y [B,T,E] from x [B,T,E] and the flat weights w. saved (may be NULL: inference)
 * receives gdn_attn_plan_info's saved_floats floats for the backward. */
GDN_API int gdn_attn_forward(gdn_attn_plan *plan, float *y, float *saved, const float *x, const float *w);

/* Backward of loss = sum(y * dy): dx [B,T,E] and dw (flat, overwritten, padding zeroed).
 * saved: what the forward of this x and w filled, or NULL (the forward is recomputed). */
GDN_API int gdn_attn_backward(gdn_attn_plan *plan, float *dx, float *dw, const float *x, const float *w,
                              const float *saved, const float *dy);

/* ---------------------------------------------------------------- decode with a KV cache
 *
 * The cache of one attention layer in transformers' layout: keys (after k_norm and RoPE) and raw
 * values, each [B, Hkv, capacity, d]; the first `length` positions (gdn_attn_cache_view) of every row
 * are filled ([B, Hkv, len, d] of transformers' DynamicCache is its leading part of each head).
 * Created once for the longest sequence; decoding allocates nothing. */
typedef struct gdn_attn_cache gdn_attn_cache;
/* A cache whose keys and values are stored as dtype: GDN_F32 (0) or GDN_BF16 (2, compute.h's
 * gdn_dtype values): BF16 rounds each appended key and value to nearest even, half the memory
 * and half the bytes a decode step streams; the attention reads them widened to fp32, exactly
 * (the scores, softmax and sums stay fp32). Other dtypes: GDN_ERR_ARG. */
GDN_API int gdn_attn_cache_create(gdn_attn_cache **cache, int64_t B, int64_t Hkv, int64_t d, int64_t capacity,
                                  int dtype);
GDN_API void gdn_attn_cache_destroy(gdn_attn_cache *cache);
GDN_API void gdn_attn_cache_reset(gdn_attn_cache *cache); /* length 0 */
/* What a cache is and holds (gdn_attn_cache_view). */
typedef struct {
    int64_t B, Hkv, d, capacity;
    int64_t length;       /* positions filled in every row */
    int dtype;            /* GDN_F32 or GDN_BF16 */
    void *keys, *values;  /* [B, Hkv, capacity, d] each, float (F32) or bf16 bits as uint16_t
                             (BF16); writable: a caller may fill a cache it saved, then set its
                             length */
} gdn_attn_cache_info;
/* The cache's shape, length, dtype and storage into *info (zeroed, and GDN_ERR_ARG, for a NULL
 * cache). */
GDN_API int gdn_attn_cache_view(gdn_attn_cache *cache, gdn_attn_cache_info *info);
/* Set the length (0 .. capacity; GDN_ERR_ARG otherwise, the length unchanged). */
GDN_API int gdn_attn_cache_set_length(gdn_attn_cache *cache, int64_t len);

/* Prefill a piece or decode: x [B, T, E] holds the next T tokens of every row (the plan's B and
 * T; dense, seq_offset 0; T = 1 decodes), at positions pos_offset + len .. + T - 1 where len is
 * the cache length on entry. Their keys and values are appended (the cache must hold len + T),
 * then each attends to the whole cache causally; y [B, T, E]. Pieces of any sizes give the
 * forward of the whole sequence. On an error the cache length is unchanged. */
GDN_API int gdn_attn_decode(gdn_attn_plan *plan, gdn_attn_cache *cache, float *y, const float *x,
                            const float *w);

/* ---------------------------------------------------------------- the attention core alone
 *
 * Causal softmax attention without projections, norms, RoPE or gate (SDPA / flash-attention
 * style, GQA, packed documents): q [B, T, H, d], k, v [B, T, Hkv, d], o [B, T, H, d], lse
 * [B, T, H] (natural log of each row's softmax sum of exp(scale q.k), -inf for a row that sees
 * nothing), scale d^-1/2. From cfg: B, T, H, Hkv, d, threads, check_finite, cu_seqlens, n_docs,
 * compute (the rest is ignored). Plan once; in fp32 execute allocates nothing; in BF16 each call
 * packs the keys and values once as bf16 (about 2 x B T Hkv d x 2-4 bytes; if that cannot be
 * allocated the call computes its products in fp32). */
typedef struct gdn_sdpa_plan gdn_sdpa_plan;
GDN_API int gdn_sdpa_plan_create(gdn_sdpa_plan **plan, const gdn_attn_config *cfg);
GDN_API void gdn_sdpa_plan_destroy(gdn_sdpa_plan *plan);
/* lse may be NULL (inference). */
GDN_API int gdn_sdpa_forward(gdn_sdpa_plan *plan, float *o, float *lse, const float *q, const float *k,
                             const float *v);
/* Gradients of sum(o * dout): dq, dk, dv (overwritten), from the forward's o and lse. */
GDN_API int gdn_sdpa_backward(gdn_sdpa_plan *plan, float *dq, float *dk, float *dv, const float *q,
                              const float *k, const float *v, const float *o, const float *lse,
                              const float *dout);
/* The core's path for this plan (tiles, the backward's schedule, the micro-kernel; NULL: the
 * default's), for benchmarks. */
GDN_API const char *gdn_sdpa_plan_path(const gdn_sdpa_plan *plan);

/* "kv" -> GDN_ATTN_CP_KV, "heads" -> GDN_ATTN_CP_HEADS; -1 if unknown. And back. */
GDN_API int gdn_attn_cp_strategy_parse(const char *name);
GDN_API const char *gdn_attn_cp_strategy_name(int strategy);

/* The layer in double precision with plain loops: the oracle. w, dw: the flat layout above in
 * double. */
GDN_API int gdn_attn_reference_forward(const gdn_attn_config *cfg, double *y, const double *x,
                                       const double *w);
GDN_API int gdn_attn_reference_backward(const gdn_attn_config *cfg, double *dx, double *dw,
                                        const double *x, const double *w, const double *dy);

#ifdef __cplusplus
}
#endif
#endif /* GDNCP_ATTENTION_H */
