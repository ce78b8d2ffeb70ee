/* The gated delta rule on one rank: configuration, plans, the chunked forward and
 * backward, segment summaries (the affine view), the float64 oracle and the decode step.
 * Layouts (row-major fp32, BTHD): q, k [B,T,Hk,K]; v, o [B,T,Hv,V]; g, beta [B,T,Hv]; states
 * h0, ht [B,Hv,K,V]; value head j uses key head j / (Hv/Hk) (PyTorch repeat_interleave); g is
 * the log-decay (the per-token decay is exp(g)). See docs/design.md. */
#ifndef GDNCP_KERNEL_H
#define GDNCP_KERNEL_H

#include <stdint.h>
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- configuration */

#define GDN_MAX_HEAD_DIM 256 /* K and V may be any size from 1 to this */
#define GDN_SCALE_DEFAULT 0.0f /* scale == 0 means 1/sqrt(K) */

/* How a context-parallel call of the rule (gdn_cp_forward / gdn_cp_backward, cp.h) crosses the
 * ranks: gdn_config.cp. Single-rank calls ignore it. */
typedef enum {
    GDN_CP_SCAN = 0,      /* log-depth prefix scan of (A, B) pairs over MPI_Sendrecv (default) */
    GDN_CP_ALLGATHER = 1, /* every rank's pair to everyone, then a local fold */
    GDN_CP_RELAY = 2,     /* the state passed rank to rank (D - 1 hops) */
    GDN_CP_HEADS = 3      /* all-to-all to head-parallel and back (D must divide Hk); it forms
                             no per-shard states: s_in, and ds_in except rank 0's dh0, are zero
                             (packed: s_in zero, ds_in every document's dh0 on every rank) */
} gdn_cp_strategy;

typedef struct {
    int64_t B, T;   /* batch rows, tokens */
    int64_t Hk, Hv; /* key heads, value heads; Hv % Hk == 0 */
    int64_t K, V;   /* key and value head dims, 1..GDN_MAX_HEAD_DIM */
    int chunk;      /* 16, 32, 64 or 128; 0 means 64 */
    float scale;    /* multiplies q after the norm; GDN_SCALE_DEFAULT means 1/sqrt(K) */
    int l2norm;     /* 1: in-kernel L2 norm of q and k (Qwen); 0: use them as given */
    int threads;    /* OpenMP threads; 0 means all available */
    int check_finite; /* 1: reject NaN/Inf in inputs before computing (default via gdn_config_default) */
    int checkpoint_chunks; /* backward keeps the state every this many chunks; 0: automatic
                              (saved states under a tenth of the inputs; its own sweep: about
                              sqrt of the chunk count, minimising memory). Each thread also
                              holds one segment's chunk intermediates (~0.5 MB per chunk at
                              K = V = 128, two value heads per key head), at most 64 MB: past
                              that, a segment's earlier chunks form theirs again. */
    /* Packed variable-length sequences (flash-linear-attention's cu_seqlens; needs B = 1): the
     * token stream holds n_docs documents, document d being tokens [cu_seqlens[d],
     * cu_seqlens[d+1]) — cu_seqlens[0] = 0, strictly increasing, cu_seqlens[n_docs] = the
     * stream's length (T on a single rank). The recurrent state restarts at every document start,
     * from h0[d] or zeros, and each document's final state is returned: h0, ht, dht and dh0 are
     * then [n_docs, Hv, K, V] instead of [B, Hv, K, V]. NULL (n_docs 0): dense, one sequence
     * per batch row. The plan keeps its own copy of the offsets. */
    const int64_t *cu_seqlens;
    int64_t n_docs;
    int64_t seq_offset; /* the stream index of this call's first token: 0 on a single rank; under
                           context parallelism the tokens of the ranks before this one (every
                           rank passes the whole stream's cu_seqlens) */
    int compute;        /* GDN_COMPUTE_FP32 (0, default) or GDN_COMPUTE_BF16 (compute.h): the
                           forward sweep's chunk products with bf16 operands, fp32 sums; the state,
                           gates, decays, the triangular solve, the backward and the summaries stay
                           fp32 (docs/design.md, "BF16 compute"). The oracle honours it. */
    int cp;             /* under context parallelism (cp.h): a gdn_cp_strategy, GDN_CP_SCAN (0,
                           default); every rank's plan must name the same one */
} gdn_config;

/* A config with the library defaults: chunk 64, default scale, L2 norm on, all threads, checks on. */
GDN_API gdn_config gdn_config_default(int64_t B, int64_t T, int64_t Hk, int64_t Hv, int64_t K, int64_t V);

/* Validate a config; returns GDN_OK or an error naming the offending field. */
GDN_API int gdn_config_check(const gdn_config *cfg);

/* ---------------------------------------------------------------- tensor bundles
 *
 * The rule's token tensors travel in named structs, so that two same-typed pointers cannot be
 * swapped silently (issue 17). Calls take outputs first, then inputs, then sizes; the lone
 * tensors that are not part of the rule's inputs or gradients (o, ht, ckpt, dout, dht, the CP
 * s_in) stay parameters of their own. A NULL bundle pointer, or a NULL required field, returns
 * GDN_ERR_ARG naming it ("inputs 'in' (gdn_rule_inputs) is NULL", "input 'q' is
 * NULL", "gradients 'grads' (gdn_rule_grads) is NULL", "gradient output 'dq' is NULL"). Designated initialisers read best:
 *     gdn_rule_inputs in = {.q = q, .k = k, .v = v, .g = g, .beta = beta};  (h0 NULL: zeros)
 * Fields a function does not read are said so at the function (e.g. gdn_summary_adjoint ignores
 * v and h0). */

/* The inputs of the rule: q, k [B,T,Hk,K]; v [B,T,Hv,V]; g, beta [B,T,Hv]: required. h0
 * [B,Hv,K,V] (packed: [n_docs,Hv,K,V]): optional, the initial state; NULL means zeros. */
typedef struct {
    const float *q, *k, *v, *g, *beta;
    const float *h0;
} gdn_rule_inputs;

/* The gradients of the rule, written by the backward: dq, dk [B,T,Hk,K]; dv [B,T,Hv,V];
 * dg, dbeta [B,T,Hv]: required. dh0 [B,Hv,K,V] (packed: [n_docs,Hv,K,V]): optional; NULL means
 * not wanted. */
typedef struct {
    float *dq, *dk, *dv, *dg, *dbeta;
    float *dh0;
} gdn_rule_grads;

/* The double-precision twins, for the oracle (gdn_reference_forward / _backward); the same
 * fields, shapes and NULL rules. */
typedef struct {
    const double *q, *k, *v, *g, *beta;
    const double *h0;
} gdn_rule_inputs_f64;

typedef struct {
    double *dq, *dk, *dv, *dg, *dbeta;
    double *dh0;
} gdn_rule_grads_f64;

/* The chunked rule's useful FLOPs per (value head, token) at chunk C (0: 64), value and key
 * widths K, V (DESIGN §3, triangular products counted in full): the forward, or (backward = 1)
 * the backward with its recompute. The one count of the benchmarks and the trainer. */
GDN_API double gdn_rule_flops_per_head_token(int64_t K, int64_t V, int chunk, int backward);

/* ---------------------------------------------------------------- the fast chunked kernel */

/* A plan fixes shapes, chunk size, threads, kernel path and owns all workspace:
 * executing it allocates nothing. A plan may be executed from one thread at a time. */
typedef struct gdn_plan gdn_plan;

GDN_API int gdn_plan_create(gdn_plan **plan, const gdn_config *cfg);
GDN_API void gdn_plan_destroy(gdn_plan *plan);
/* What a plan is (gdn_plan_describe). */
typedef struct {
    const gdn_config *config;  /* the config the plan was made with (chunk, scale and threads
                                  resolved): the plan's own, valid while it lives */
    const char *path;          /* name of the micro-kernel path it runs (benchmarks, logs; static) */
    size_t checkpoint_floats;  /* gdn_forward_save's ckpt floats (below) */
    size_t backward_bytes;     /* bytes the backward uses per thread (below) */
} gdn_plan_info;
/* The plan's config, path and sizes into *info (zeroed, and GDN_ERR_ARG, for a NULL plan). */
GDN_API int gdn_plan_describe(const gdn_plan *plan, gdn_plan_info *info);
/* Other documents for a packed plan's tokens (a training step's): cu_seqlens, n_docs and
 * seq_offset as in gdn_config, checked and copied; shapes and workspace stay. The plan must have
 * been made packed (one document {0, T} will do). On failure the plan keeps its documents. */
GDN_API int gdn_plan_set_docs(gdn_plan *plan, const int64_t *cu_seqlens, int64_t n_docs, int64_t seq_offset);

/* Forward: o [B,T,Hv,V] (required) and ht [B,Hv,K,V] (NULL: not wanted) from the inputs
 * (in->h0 NULL means zeros). */
GDN_API int gdn_forward(gdn_plan *plan, float *o, float *ht, const gdn_rule_inputs *in);

/* Backward: into grads, the gradients of loss = sum(o * dout) + sum(ht * dht) with respect to
 * the un-normalised q, k and to v, g, beta, h0 (grads->dh0 NULL: not wanted). dout [B,T,Hv,V]
 * is required; dht [B,Hv,K,V] may be NULL (zeros), as may in->h0. The forward is recomputed
 * from checkpoints: nothing needs to be saved from gdn_forward. */
GDN_API int gdn_backward(gdn_plan *plan, const gdn_rule_grads *grads, const gdn_rule_inputs *in,
                         const float *dout, const float *dht);

/* Training step without the backward's forward sweep: gdn_forward_save also writes the state at
 * the start of every checkpoint segment after the first into ckpt (gdn_plan_info's
 * checkpoint_floats: [B, Hv, segments - 1, K, V]; at most a tenth of the inputs with automatic
 * checkpointing), and gdn_backward_saved starts from them (the first segment from h0). ckpt
 * must come from the same plan and inputs; gdn_backward_saved with ckpt NULL is gdn_backward. */
GDN_API int gdn_forward_save(gdn_plan *plan, float *o, float *ht, float *ckpt,
                             const gdn_rule_inputs *in);
GDN_API int gdn_backward_saved(gdn_plan *plan, const gdn_rule_grads *grads,
                               const gdn_rule_inputs *in, const float *ckpt, const float *dout,
                               const float *dht);

/* gdn_plan_info's backward_bytes: the bytes the backward uses per thread (its own checkpoints,
 * one segment's states and chunk intermediates, scratch) — independent of B and of the number of
 * heads; it grows as sqrt(T) with automatic checkpointing. */

/* ---------------------------------------------------------------- segment summaries (affine view)
 *
 * A token segment maps the state entering it affinely: S_out = A S_in + B, with
 * A [B,Hv,K,K] and B [B,Hv,K,V] (named sa, sb here). Composition is not commutative:
 * applying (A1,B1) first, then (A2,B2), gives (A2 A1, A2 B1 + B2). */

/* The segment's exact map, computed in one pass over the augmented state [S | A]
 * without forming per-chunk pairs. sa [B,Hv,K,K], sb [B,Hv,K,V]. With sb NULL only A is
 * computed (in->v is then not read and may be NULL). in->h0 is not read (the map does not
 * depend on the state). */
GDN_API int gdn_summary(gdn_plan *plan, float *sa, float *sb, const gdn_rule_inputs *in);

/* The segment's adjoint offset G [B,Hv,K,V]: the gradient of sum(o * dout) with respect to the
 * state entering the segment, so that dS_in = A^T dS_out + G (DESIGN §4). G does not depend on
 * the incoming state or on v: in->v and in->h0 are not read (may be NULL). dout [B,T,Hv,V]
 * is required. One reverse pass, no forward sweep. */
GDN_API int gdn_summary_adjoint(gdn_plan *plan, float *sg, const gdn_rule_inputs *in,
                                const float *dout);

/* (out_a, out_b) = (a2,b2) o (a1,b1), i.e. first 1 then 2. Outputs may not alias inputs.
 * nmaps = B*Hv maps, each K x K and K x V. */
GDN_API int gdn_summary_compose(float *out_a, float *out_b, const float *a2, const float *b2,
                        const float *a1, const float *b1, int64_t nmaps, int64_t K, int64_t V);

/* out = a s + b for each of nmaps maps; out may not alias s. */
GDN_API int gdn_summary_apply(float *out, const float *a, const float *b, const float *s, int64_t nmaps,
                      int64_t K, int64_t V);

/* ---------------------------------------------------------------- the double-precision oracle */

/* The token-by-token recurrence of DESIGN §2 in double precision. Same layouts and
 * options as the fast path (chunk and threads are ignored). ht and in->h0 may be NULL.
 * With cfg->compute = GDN_COMPUTE_BF16 it is the oracle of that mode instead: the chunked
 * forward (chunks of cfg->chunk) in double with the operands of the mode's bf16 products
 * rounded to bf16 and all else exact. The backward oracle is the exact one in either mode (the
 * kernel's backward runs fp32). */
GDN_API int gdn_reference_forward(const gdn_config *cfg, double *o, double *ht,
                                  const gdn_rule_inputs_f64 *in);

/* Backward of the oracle (reverse token loop, double): gradients of
 * loss = sum(o * dout) + sum(ht * dht) with respect to the un-normalised q, k and to v, g, beta
 * and h0, into grads. A key head's gradient sums over the value heads sharing it. dout is
 * required; dht and in->h0 may be NULL (zeros); grads->dh0 may be NULL (not wanted). */
GDN_API int gdn_reference_backward(const gdn_config *cfg, const gdn_rule_grads_f64 *grads,
                                   const gdn_rule_inputs_f64 *in, const double *dout,
                                   const double *dht);

/* ---------------------------------------------------------------- the decode step (T = 1)
 *
 * One token of the recurrence for every (batch row, value head), the state updated in place:
 * state [B,Hv,K,V] holds S_{t-1} on entry and S_t on return (ht == h0: no copy follows the
 * step). in->q, in->k [B,Hk,K], in->v, o [B,Hv,V], in->g, in->beta [B,Hv] (the [B,1,H,D]
 * tensors of one token); in->h0 must be NULL (the state is `state`: a non-NULL h0 is refused
 * rather than silently ignored).
 * Uses the plan's B, Hk, Hv, K, V, scale, L2 norm, threads and check_finite (its T and chunk are
 * ignored); no chunk machinery, nothing allocated. With check_finite, non-finite inputs are found
 * on the rows the step reads anyway and the state is left unchanged when they are. */
GDN_API int gdn_step(gdn_plan *plan, float *o, float *state, const gdn_rule_inputs *in);
/* Name of the code path gdn_step runs (for benchmarks). */
GDN_API const char *gdn_step_path(void);

#ifdef __cplusplus
}
#endif
#endif /* GDNCP_KERNEL_H */
