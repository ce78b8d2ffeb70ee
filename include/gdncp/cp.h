/*
 * gdncp context parallelism: one sequence split across the ranks of an MPI communicator.
 * Rank order is token order; rank r holds tokens [t_r, t_r + T_r) of every batch row in the
 * usual layouts with T = T_r (T_r may differ between ranks, may be 1, need not be a multiple
 * of the chunk). Each rank makes its own plan for its local shape (gdn_plan_create); all
 * ranks must agree on B, Hk, Hv, K, V, chunk, scale and the L2 norm, which is checked.
 * Results equal a single-rank run on the whole sequence up to rounding (DESIGN §4).
 *
 * Packed documents (gdn_config.cu_seqlens, B = 1): every rank's plan gets the whole stream's
 * cu_seqlens and its own seq_offset (the tokens of the ranks before it), both checked. A rank may
 * hold many documents, part of one or lie inside one. h0 and ht are then [n_docs, Hv, K, V] on
 * every rank (each rank applies the h0 of the documents that start on it; the final states are
 * gathered from the ranks where the documents end), and so are dht and ds_in (every document's
 * dh0) in the backward; s_in is the state this rank's first token starts from. Every strategy;
 * heads runs the whole stream's documents for its block of heads (document d's h0 read on the
 * rank where d starts, its dht where d ends, as the others do) and, forming no per-shard states,
 * leaves s_in zero.
 */
#ifndef GDNCP_CP_H
#define GDNCP_CP_H

#include <mpi.h>

#include "../gdncp.h"

#ifdef __cplusplus
extern "C" {
#endif


typedef struct {
    double fold_s;     /* local summaries / adjoints */
    double comm_s;     /* time inside MPI calls */
    double replay_s;   /* local forward or backward from the true boundary state */
    uint64_t bytes_sent, bytes_recv, messages;
    int rounds;        /* communication rounds (scan depth, hops, collectives) */
} gdn_cp_stats;

typedef struct gdn_cp gdn_cp;

/* A CP group: comm is duplicated; any communicator works (e.g. one axis of a DP x CP grid).
 * The context is the group alone: how a call crosses the ranks is the plan's choice (the
 * rule's gdn_config.cp, kernel.h; the attention's gdn_attn_config.cp), so one context serves
 * every strategy and every layer. Collective. */
GDN_API int gdn_cp_create(gdn_cp **cp, MPI_Comm comm);
GDN_API void gdn_cp_destroy(gdn_cp *cp);
GDN_API int gdn_cp_rank(const gdn_cp *cp);
GDN_API int gdn_cp_size(const gdn_cp *cp);
GDN_API const char *gdn_cp_strategy_name(gdn_cp_strategy s);
/* Parse "scan", "allgather", "relay", "heads"; -1 if unknown. */
GDN_API int gdn_cp_strategy_parse(const char *name);

/* Forward on this rank's shard: in holds the local q, k, v, g, beta (gdn_rule_inputs, kernel.h).
 * in->h0 [B,Hv,K,V] is the state before the first token of the whole sequence and is read on
 * rank 0 only (may be NULL: zeros). o is required. ht (may be NULL) receives the final state of
 * the whole sequence on every rank. s_in (may be NULL) receives the state entering this rank's
 * shard, which gdn_cp_backward can reuse. Collective: every rank calls it; a NULL `in` or
 * required field on any rank fails every rank. */
GDN_API int gdn_cp_forward(gdn_cp *cp, gdn_plan *plan, float *o, float *ht, float *s_in,
                           const gdn_rule_inputs *in);

/* Backward on this rank's shard: into grads, the gradients of sum(o * dout) + sum(ht * dht) for
 * the local q, k, v, g, beta. grads->dh0 (may be NULL) is this rank's ds_in: the gradient with
 * respect to the state entering this rank's shard (on rank 0, dh0; packed: every document's dh0,
 * see above). in->h0 is read on rank 0 only. dout (required) is the local one; dht is read on the
 * last rank only (may be NULL). s_in: this rank's incoming state from gdn_cp_forward, or NULL to
 * recompute it. Collective. */
GDN_API int gdn_cp_backward(gdn_cp *cp, gdn_plan *plan, const gdn_rule_grads *grads,
                            const gdn_rule_inputs *in, const float *s_in, const float *dout,
                            const float *dht);

/* Gather every rank's [B, T_r, inner] block into the full [B, T, inner] tensor on `root`
 * (full may be NULL elsewhere). Collective. */
GDN_API int gdn_cp_gather_rows(gdn_cp *cp, const float *local, int64_t B, int64_t T_local, int64_t inner,
                       float *full, int root);

/* The halo of a token-axis stencil (the layer's causal conv): every rank receives the `rows`
 * token rows that precede its shard in the global sequence into halo [B, rows, width] (zeros
 * before the sequence start), from however many predecessors hold them, by point-to-point
 * messages. x is this rank's [B, T_local] rows of `width` floats, `row_stride` apart.
 * gdn_cp_halo_backward is its adjoint: dhalo goes back to the owners and is added into their
 * rows of dx (same layout as x). local_status: a failure on this rank before the call, made
 * every rank's. Collective. */
GDN_API int gdn_cp_halo_forward(gdn_cp *cp, float *halo, const float *x, int64_t B, int64_t T_local,
                        int64_t width, int64_t row_stride, int64_t rows, int local_status);
GDN_API int gdn_cp_halo_backward(gdn_cp *cp, float *dx, const float *dhalo, int64_t B, int64_t T_local,
                         int64_t width, int64_t row_stride, int64_t rows, int local_status);

/* The GatedDeltaNet layer (gdncp.h) on this rank's token slice x [B, T_r, E], the plan made for
 * T = T_r: the conv's Kc-1 halo rows come from the predecessor rank(s), the recurrence runs
 * with cp's strategy. The whole sequence starts from zero states. saved (may be NULL) as in
 * gdn_layer_forward (it keeps the halo and this shard's incoming state). Collective. */
GDN_API int gdn_layer_cp_forward(gdn_cp *cp, gdn_layer_plan *plan, float *y, float *saved,
                         const float *x, const void *w);
/* dx for this rank's rows, and dw: this rank's share of the weight gradient (sum dw over the
 * ranks, e.g. with MPI_Allreduce, for the gradient of the whole sequence). Collective. */
GDN_API int gdn_layer_cp_backward(gdn_cp *cp, gdn_layer_plan *plan, float *dx, float *dw,
                          const float *x, const float *w, const float *saved, const float *dy);

/* Qwen3.5's gated attention layer (attention.h) on this rank's token slice x [B, T_r, E]: each
 * rank's plan is made for its own T = T_r with seq_offset = the tokens of the ranks before it
 * (packed: the whole stream's cu_seqlens on every rank), the strategy in cfg.cp:
 *   GDN_ATTN_CP_KV: every rank's keys and values travel to the later ranks (the causal part
 *     only, double-buffered point to point, the next block in flight while one is attended);
 *     in the backward their gradients travel with them and return to their owners. Any D, any
 *     shard lengths.
 *   GDN_ATTN_CP_HEADS: an all-to-all to head-parallel (every rank the whole sequence for H/D
 *     query heads and their kv heads, replicated when D > Hkv, their gradients summed by the
 *     token owners) for the core only, then back. D must divide H, and H/D and H/Hkv must
 *     divide one another.
 * Results equal one rank's on the whole sequence up to rounding. saved (may be NULL) as in
 * gdn_attn_forward. Collective; every rank's stats (gdn_cp_last_stats: replay_s is the
 * attention core's compute, comm_s the time in MPI). */
GDN_API int gdn_attn_cp_forward(gdn_cp *cp, gdn_attn_plan *plan, float *y, float *saved, const float *x,
                                const float *w);
/* dx for this rank's rows; dw: this rank's share of the weight gradient (sum over ranks).
 * Collective. */
GDN_API int gdn_attn_cp_backward(gdn_cp *cp, gdn_attn_plan *plan, float *dx, float *dw, const float *x,
                                 const float *w, const float *saved, const float *dy);

/* Generation with the cache split over the ranks: each rank keeps its own part (rank r the keys
 * of its shard of the prompt, the last rank also every generated token's).
 * gdn_attn_cp_prefill: gdn_attn_cp_forward on this rank's shard of the prompt (the plan as
 *   there), its keys and values then stored in this rank's (empty) cache.
 * gdn_attn_cp_decode: the next T tokens of every row on every rank alike (x [B, T, E] the same
 *   everywhere, checked; the plan dense, seq_offset 0, as gdn_attn_decode's), at positions after
 *   all the ranks' cached tokens. Their keys and values are appended on the last rank (its cache
 *   must have room); each rank attends to its part and the partial results merge by their
 *   log-sum-exp (two all-reduces of B T H and B T H (d + 1) floats); every rank gets the same y.
 *   Collective. */
GDN_API int gdn_attn_cp_prefill(gdn_cp *cp, gdn_attn_plan *plan, gdn_attn_cache *cache, float *y,
                                const float *x, const float *w);
GDN_API int gdn_attn_cp_decode(gdn_cp *cp, gdn_attn_plan *plan, gdn_attn_cache *cache, float *y,
                               const float *x, const float *w);

/* A failure on any rank becomes a failure on every rank: returns local_status where it is
 * non-zero (its message kept), another rank's failure elsewhere, GDN_OK when none. Collective. */
GDN_API int gdn_cp_agree_status(gdn_cp *cp, int local_status);
/* One agreement step: every rank passes n values (options, sizes, flags that decide which
 * collectives follow) and its local status; returns GDN_OK when every rank's values equal rank
 * 0's and no rank failed, else the same failure on every rank naming the value (names[i]) or the
 * rank. A name ending in " (its bits)" marks a double passed as its bits (memcpy): the message
 * shows the numbers. Ranks may pass different n (a rank that failed before it knew its values
 * passes 0): a disagreement like any other, never a mismatched collective. Collective. */
GDN_API int gdn_cp_agree_values(gdn_cp *cp, const int64_t *vals, int n, const char *const *names,
                        int local_status);
/* A digest of `bytes` bytes at data, for agreeing in gdn_cp_agree_values on something every rank
 * must hold alike (weights, a whole-sequence state): over the size and every byte (four lanes of
 * 8-byte words, at memory speed; a change to any one word always changes it). In [0, 2^63); 0 for
 * NULL. Not collective: each rank digests its own copy. */
GDN_API int64_t gdn_cp_digest(const void *data, size_t bytes);
/* The same over a whole file's bytes, read in pieces (a data file, a checkpoint's weight files: what
 * ranks given different paths must hold alike); -1 when it cannot be read. Not collective. */
GDN_API int64_t gdn_cp_digest_file(const char *path);

/* Accounting of the last forward or backward call on this rank. */
GDN_API gdn_cp_stats gdn_cp_last_stats(const gdn_cp *cp);

/* How a rank waits for its peers in the collectives of the layers' hot paths. MPI's blocking
 * calls busy-poll; with more ranks (times their threads) than cores, a waiting rank takes the
 * core of the one it waits for (measured: the hybrid `long` model over 8 ranks on 2 cores, a
 * 16,384-token step 10.5 s spinning, 5.4 s sleeping). GDN_CP_WAIT_SLEEP spins 50 us, then sleeps
 * 20 us growing to 1 ms between tests; GDN_CP_WAIT_SPIN waits as MPI does (lowest latency on
 * dedicated cores). gdn_cp_create chooses (AUTO): SLEEP when this communicator's ranks on the
 * node times omp_get_max_threads() exceed the node's online cores on any node, else SPIN; a
 * caller that knows about other ranks on the node (gdn_train's DP groups) sets it. Collective:
 * every rank must ask for the same mode (a blocking collective must never meet a nonblocking one),
 * else GDN_ERR_ARG on every rank and the mode is unchanged; GDN_ERR_ARG for an unknown mode. */
typedef enum { GDN_CP_WAIT_AUTO = 0, GDN_CP_WAIT_SPIN = 1, GDN_CP_WAIT_SLEEP = 2 } gdn_cp_wait;
GDN_API int gdn_cp_set_wait(gdn_cp *cp, int mode);
GDN_API int gdn_cp_get_wait(const gdn_cp *cp); /* GDN_CP_WAIT_SPIN or _SLEEP */

#ifdef __cplusplus
}
#endif
#endif
