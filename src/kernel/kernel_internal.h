/* The kernel layer (src/kernel), internal: the plan and its workspaces, the one stream model,
 * the chunk phases shared by the forward, the backward and the summaries, the configuration
 * checks. Uses base and blas. */
#ifndef GDNCP_KERNEL_INTERNAL_H
#define GDNCP_KERNEL_INTERNAL_H

#include "base.h"
#include "blas.h"
#include "gdncp/compute.h"
#include <string.h>

/* ---- per-thread chunk workspace (sized at plan time for the widest use). */
typedef struct {
    float *qs, *kn, *kt, *kdt; /* C x K, C x K, K x C, K x C */
    float *pk, *qk, *tm, *am, *ew; /* C x C each; ew_ij = exp(G_i - G_j) for j <= i */
    float *xw;                 /* 2C x K : [-W ; diag(eG) Qs] */
    float *rk;                 /* C x K : -diag(beta eG) Kn (negated like W) */
    float *rv, *u, *m2;        /* C x W, C x W, 2C x W   (W = widest column block) */
    float *state;              /* max(r K V, K W): the states of one key head's value heads */
    float *g, *beta, *eg, *egd, *lrow; /* C each */
    float *qinv, *kinv;        /* C each: qs = q * qinv, kn = k * kinv row by row */
    int nonfinite;              /* set when a gathered input or written output is NaN/Inf */
    int bf16;                   /* the BF16 path the chunk products run (gdn_chunk_gemm), 0: fp32;
                                   set by the forward sweep for its items only */
    void *bfws;                 /* the BF16 products' packing space (cfg.compute = BF16) */
    double *G;                  /* C: in-chunk cumulative gate, in double because G_i - G_j
                                   cancels: |G| reaches 20*128 where fp32 spacing is 1e-4 */
} gdn_chunk_ws;

/* ---- per-thread backward workspace. */
typedef struct {
    float *dS;                                           /* r x K x V */
    float *dx;                                           /* 2C x (V + K): [dDl ; dO | dWn ; dQe] */
    float *dr;                                           /* C x (V + K): [dRv | -dRk] */
    float *dKd, *kd, *dQ, *dKn;                          /* C x K */
    float *dA, *dT, *dLn, *tcc, *bsym;                   /* C x C */
    double *dG, *dbeta_row, *colsum;                     /* C */
    float *ckpt;                                         /* segments x r x K x V: checkpoints */
    float *segst;                                        /* N x r x K x V: one segment's states */
    int nonfinite; /* set when a row of do or of a gradient written is NaN/Inf */
    float *rec;   /* N chunk records: each chunk's intermediates, formed once by the segment's
                     forward re-sweep and read back by its backward (gdn_chunk_record_floats) */
} gdn_bwd_ws;

/* Floats of one chunk record: the key side (qs, kn, pk, qinv, kinv) and, for each of the r
 * value heads, the value side (tm, am, ew, -W and eG Q, rk, rv, Dl, gates). */
size_t gdn_chunk_record_floats(const gdn_config *c);
/* Bytes of chunk records each thread may hold (see gdn_plan.rec_slots). */
#define GDN_RECORD_BUDGET ((size_t)64 << 20)

/* Gradient outputs and the extra inputs of the backward. */
typedef struct {
    float *dq, *dk, *dv, *dg, *dbeta, *dh0;
    const float *dout, *dht, *h0;
    const float *ckpt; /* the forward's saved segment-start states [B,Hv,segments,K,V] or NULL */
} gdn_chunk_grads;

/* One stream of a plan's tokens (stream.c): batch row b, local tokens [t_begin, t_end), the
 * state starting at t_begin. A dense plan has one per batch row; a packed plan (cfg.cu_seqlens)
 * one per document, or part of one, within [seq_offset, seq_offset + T). */
typedef struct {
    int64_t b, t_begin, t_end;
    int64_t row;        /* its row of h0, ht, dht, dh0: the batch row, or the document */
    int cont_in;        /* its document began before the plan's tokens (a CP shard): it enters
                           from s_in (row b) instead of h0, its gradient goes to ds_in */
    int cont_out;       /* its document goes on after the plan's tokens: its final state is not
                           the document's (no ht row), its gradient comes from ds_out */
    int last;           /* the last stream of its batch row: its final state goes to s_out */
    int64_t ckpt_first; /* gdn_forward_save: its saved states are rows ckpt_first.. of the
                           [Hv, ckpt_rows, K, V] buffer (its first segment starts from its h0) */
} gdn_stream;

typedef struct {
    int64_t n;          /* streams */
    gdn_stream *s;
    int64_t *run;       /* n slots: the streams one forward runs */
    int packed;         /* cfg.cu_seqlens was given */
    int64_t first_doc;  /* packed: the document of stream 0 */
    int64_t ckpt_rows;  /* saved states per value head over all streams */
    int64_t *cu;        /* the plan's copy of cu_seqlens (cfg.cu_seqlens points here) */
} gdn_streams;

struct gdn_plan {
    gdn_config cfg;
    gdn_streams streams;
    int64_t ckpt_rows_cap; /* saved-state rows the plan was made with: gdn_plan_set_docs may
                              never need more (a document start only splits a chunk run) */
    int threads;
    int ckpt_chunks;     /* backward: a checkpoint every this many chunks (its own sweep) */
    int64_t nseg;        /* backward: checkpoints per stream */
    int save_chunks;     /* gdn_forward_save: a saved state every this many chunks, chosen so
                            that all saved states stay under a tenth of the inputs */
    int64_t save_nseg;   /* saved states per stream */
    int rec_slots;       /* chunk records per thread: a segment's last rec_slots chunks keep
                            their intermediates from the re-sweep, earlier ones (only in
                            segments longer than that) form them again before their backward */
    gdn_bwd_ws *bws;     /* one per thread */
    void *bwd_arena;
    int max_width;   /* widest column block the workspace holds (V + K for summaries) */
    gdn_chunk_ws *ws; /* one per thread */
    void *arena;
    int bf16_path;    /* cfg.compute = BF16: the path of the forward sweep's products; else 0 */
    void *bf_arena;   /* the threads' BF16 packing spaces */
};

/* The oracle of cfg.compute = BF16 (reference_bf16.c): the chunked forward in double with the
 * BF16 products' operands rounded; gdn_reference_forward calls it after its checks. */
int gdn_reference_forward_bf16(const gdn_config *c, double *o, double *ht, const gdn_rule_inputs_f64 *in);

/* A chunk product, C (+)= A B with gdn_gemm's flags, in the sweep's precision (ws->bf16). */
static inline void gdn_chunk_gemm(gdn_chunk_ws *ws, int flags, int m, int n, int kk, const float *A, int lda,
                                  const float *B, int ldb, float *C, int ldc) {
    if (ws->bf16) gdn_gemm_bf16(ws->bf16, flags, m, n, kk, A, lda, B, ldb, C, ldc, ws->bfws);
    else gdn_gemm(flags, m, n, kk, A, lda, B, ldb, C, ldc);
}

/* Inputs of one (batch row, value head) stream seen by the chunk loop. */
typedef struct {
    const float *q, *k, *v, *g, *beta; /* base pointers of the full tensors */
} gdn_chunk_inputs;

/* Run the chunk loop for batch row b, value heads h .. h+nheads-1 (all of one key head) over
 * tokens [t_begin, t_end) (t_begin a multiple of the chunk) and state columns [c0, c0+w) of the
 * augmented width: columns below V are value columns, columns from V on carry zero values
 * (summaries push the identity through them, giving A). The states enter and leave in
 * ws->state (nheads blocks of K x w, row stride w). o: output base (the full [B,T,Hv,V]
 * tensor) or NULL. */
void gdn_chunk_stream(const gdn_plan *p, gdn_chunk_ws *ws, const gdn_chunk_inputs *in, int64_t b,
                      int64_t h, int nheads, int c0, int w, int64_t t_begin, int64_t t_end,
                      float *o);

/* The phases of one chunk [t0, t0+n), shared with the backward:
 * prepare: (unless keys_ready: the key side qs, kn, kt, KK^T in pk, QK^T in qk), gates, G and
 *          decays, tm = (I+L)^-1, -W (xw rows 0..n-1) and, with want_out, diag(eG) Q (xw rows
 *          n..2n-1) and A (am);
 * values:  rv = diag(beta) V, u = Dl = tm rv - W S, m2 = [-W ; eG Q] S;
 * update_state: S <- exp(Gc) S + Kd^T Dl (kdt = Kd^T). */
void gdn_chunk_prepare(const gdn_plan *p, gdn_chunk_ws *ws, const gdn_chunk_inputs *in, int64_t b,
                       int64_t h, int64_t t0, int n, int want_out, int keys_ready);
void gdn_chunk_values(const gdn_plan *p, gdn_chunk_ws *ws, const gdn_chunk_inputs *in, int64_t b,
                      int64_t h, int64_t t0, int n, int c0, int w, int want_out, const float *S);
void gdn_chunk_update_state(const gdn_plan *p, gdn_chunk_ws *ws, int n, int w, float *S);
/* Tests only: negative controls injected into the chunk kernel (0: none).
 * STATE_BF16: the recurrent state rounded to bf16 after every chunk (the round trip DESIGN
 * rules out; the BF16 compute mode keeps the state fp32, and its tests must see this fail). */
static inline float gdn_bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* One stream of the backward: batch row b, tokens [t_begin, t_end) (the whole row, or one
 * piece of a packed stream), with its states: h0, dht, dh0 are [Hv, K, V] bases (value head h
 * at + h K V; NULL: zeros, or not wanted); ckpt (NULL: the backward sweeps itself) holds the
 * forward's saved states, value head h's s-th (s >= 1) at ckpt + (h ckpt_rows + s - 1) K V. */
typedef struct {
    int64_t b, t_begin, t_end;
    const float *h0, *dht;
    float *dh0;
    const float *ckpt;
    int64_t ckpt_rows;
} gdn_range;

/* Backward of one (stream, key head): all its value heads, checkpoints and recompute.
 * Uses ws only as scratch; of gr only the token tensors (gradients, do) are used. */
void gdn_backward_item(const gdn_plan *p, gdn_chunk_ws *ws, gdn_bwd_ws *bw, const gdn_chunk_inputs *in,
                       const gdn_chunk_grads *gr, const gdn_range *rg, int64_t hk);

/* Segment adjoint of stream (b, h) over tokens [t_begin, t_end): the gradient of
 * sum(o * dout) + sum(S_out * ds_out) with respect to the state entering the segment, into sg
 * (K x V); ds_out (K x V) NULL: 0, giving G. Only dout of gr is used. */
void gdn_adjoint_item(const gdn_plan *p, gdn_chunk_ws *ws, gdn_bwd_ws *bw, const gdn_chunk_inputs *in,
                      const gdn_chunk_grads *gr, int64_t b, int64_t h, int64_t t_begin, int64_t t_end,
                      const float *ds_out, float *sg);

/* ---- streams (stream.c; the packed offsets' checks config.c) */
/* Offsets valid for the config (called by gdn_config_check): GDN_OK for a dense config. */
int gdn_pack_check(const gdn_config *c);
/* The config's tokens are the whole stream (single-rank entry points and the oracle). */
int gdn_pack_check_whole(const gdn_config *c);
/* Floats of h0, ht, dht, dh0: [n_docs or B, Hv, K, V]. */
GDN_WING int64_t gdn_state_floats(const gdn_config *c);
/* Build / free p->streams (after the backward's segment sizes are chosen). */
int gdn_streams_init(gdn_plan *p);
void gdn_streams_free(gdn_plan *p);
/* The forward and backward over the plan's streams. h0, ht, dht, dh0: per row of the streams
 * ([B or n_docs, Hv, K, V]; the rows of the streams that start / end within the plan's tokens
 * are read / written). For a shard of a packed stream (context parallelism): s_in [B, Hv, K, V]
 * is the state entering a stream that continues a document (NULL: zeros), s_out receives the
 * state after each row's last stream; ds_out is the gradient of that state for a stream whose
 * document goes on (NULL: zeros), ds_in receives the gradient of s_in. With o, ckpt and ht all
 * NULL only the last streams run (their final states are all that is wanted). */
GDN_WING int gdn_streams_forward(gdn_plan *p, float *o, float *ht, float *ckpt, const float *q,
                        const float *k, const float *v, const float *g, const float *beta,
                        const float *h0, const float *s_in, float *s_out);
GDN_WING int gdn_streams_backward(gdn_plan *p, float *dq, float *dk, float *dv, float *dg, float *dbeta,
                         float *dh0, const float *q, const float *k, const float *v,
                         const float *g, const float *beta, const float *h0, const float *s_in,
                         const float *ckpt, const float *dout, const float *dht,
                         const float *ds_out, float *ds_in);
/* The adjoint offset of every row's first stream alone (its gradient with respect to the state
 * entering it, from its outputs and, when its document ends within the plan, from that
 * document's dht), into sg [B, Hv, K, V]. */
GDN_WING int gdn_streams_adjoint_first(gdn_plan *p, float *sg, const float *q, const float *k,
                              const float *g, const float *beta, const float *dout,
                              const float *dht);

/* A dense plan's place in a context-parallel split: not the first shard, its streams continue
 * from s_in; not the last, they go on into s_out (no ht rows). A packed plan is placed by its
 * documents and seq_offset (no-op). The single-rank entry points set (1, 1). */
GDN_WING void gdn_streams_set_shard(gdn_plan *p, int first_shard, int last_shard);

/* ---- the rule's input checks (rule_check.c) */
/* The public bundles (kernel.h) checked for NULL: the bundle itself, then each required field
 * (need_v: in->v is required). GDN_OK or GDN_ERR_ARG naming the bundle or the field. */
GDN_WING int gdn_rule_inputs_check(const gdn_rule_inputs *in, int need_v);
GDN_WING int gdn_rule_grads_check(const gdn_rule_grads *gr);

/* Validate the inputs of a plan's shape (NULL, and NaN/Inf when check_finite is on); h0 may be NULL. */
GDN_WING int gdn_check_inputs(const gdn_plan *p, const float *q, const float *k, const float *v,
                     const float *g, const float *beta, const float *h0);
/* A non-finite value that a stream loop found (its nonfinite flags): GDN_ERR_NONFINITE naming the
 * input (q, k, v, g, beta, h0; do when given), else the first of the outputs outs[0..nouts) that
 * holds one (dh0: the rows of the streams that start within the plan), else the keys whose
 * squared norm overflowed. */
int gdn_streams_explain_nonfinite(gdn_plan *p, const gdn_chunk_inputs *in, const float *h0, const float *dout,
                                  const gdn_named_output *outs, int nouts, const float *dh0);
/* dS_in = A^T dS_out + G for every (batch row, value head) in one state-only reverse pass
 * (ds_out NULL: G alone). What gdn_summary_adjoint computes, with a final-state gradient. */
int gdn_state_adjoint(gdn_plan *p, float *ds_in, const float *q, const float *k, const float *g,
                      const float *beta, const float *dout, const float *ds_out);

/* Column blocking: the width of the column blocks that `streams` streams of `width` state
 * columns are split into so that all threads have work (== width when there are enough). */
int gdn_column_block_width(const gdn_plan *p, int64_t streams, int width);

#endif
