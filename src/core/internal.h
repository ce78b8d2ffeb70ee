/* Internal helpers shared by the compute core: errors, small GEMM kernels, plan layout. */
#ifndef GDNCP_INTERNAL_H
#define GDNCP_INTERNAL_H

#include "gdncp.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/types.h>

/* Record a failure for gdn_errmsg() and return its code: `return gdn_fail(GDN_ERR_SHAPE, "...")`. */
int gdn_fail(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Test-only hooks (not API): weak definitions in status.c do nothing; a test program that links
 * the static library overrides them with strong ones. The library holds no mutable test state.
 * gdn_test_fault: called before each allocation of the CP layer (gdn_cp_malloc) and each MPI
 * datatype it creates, naming the site; non-zero makes that allocation / MPI call fail as if
 * the system had refused it (fault injection: "allocation number N fails on rank R").
 * gdn_test_point: called at named points of long operations (e.g. a safetensors write with its
 * temporary file in place), so a test can act there (raise a signal).
 * gdn_test_threads: called once by the first thread of some parallel regions with the size of
 * the team that runs it, so a test can see that a configured thread count is honoured. */
int gdn_test_fault(const char *site);
void gdn_test_point(const char *site);
void gdn_test_threads(const char *site, int threads);

/* A broken internal invariant (never a user error): abort with file:line. */
#define GDN_ASSERT(cond)                                                                    \
    do {                                                                                    \
        if (!(cond)) {                                                                      \
            fprintf(stderr, "gdncp: internal error %s:%d: %s\n", __FILE__, __LINE__, #cond); \
            abort();                                                                        \
        }                                                                                   \
    } while (0)

/* Subnormal fp32 values cost ~100 cycles per operation on x86. They arise where exp(G) near the
 * flush threshold meets small states (strong gates, as in trained Qwen layers: a layer forward
 * ran 2.5x slower from them). Compute regions flush them to zero (FTZ, DAZ) and restore the
 * caller's mode on the way out; the values lost are below 1.2e-38. */
#if defined(__SSE__)
#include <xmmintrin.h>
typedef unsigned gdn_fpmode;
static inline gdn_fpmode gdn_fp_fast_begin(void) {
    const unsigned m = _mm_getcsr();
    _mm_setcsr(m | 0x8040); /* FTZ (bit 15) | DAZ (bit 6) */
    return m;
}
static inline void gdn_fp_fast_end(gdn_fpmode m) { _mm_setcsr(m); }
#else
typedef int gdn_fpmode;
static inline gdn_fpmode gdn_fp_fast_begin(void) { return 0; }
static inline void gdn_fp_fast_end(gdn_fpmode m) { (void)m; }
#endif

/* Refuse, before allocating, what clearly cannot fit: more bytes than the machine's physical
 * memory (Linux overcommits, so such a malloc would succeed and the OOM killer end the run
 * later). GDN_ERR_NOMEM naming `what`, the need and the memory, or GDN_OK. */
int gdn_check_fits(const char *what, double bytes);

/* What a non-regular file is, for messages ("a directory", "a FIFO", ...); from st_mode. */
const char *gdn_file_kind(mode_t mode);

/* First non-finite element of x[0..n), or -1. A large x is scanned by `threads` OpenMP threads
 * (the caller's plan or run setting; <= 0 means 1): a rank never opens more than it was given. */
int64_t gdn_find_nonfinite_f32(const float *x, int64_t n, int threads);
int64_t gdn_find_nonfinite_f64(const double *x, int64_t n);

/* The GEMMs (src/blas): gdn_gemm, gdn_matmul, gdn_transpose and their flags. */
#include "blas.h"

/* 8-lane fp32 vectors (GCC/Clang vector extensions; AVX2 here, two SSE halves or NEON elsewhere). */
typedef float gdn_v8f __attribute__((vector_size(32)));
typedef float gdn_v8f_u __attribute__((vector_size(32), aligned(4))); /* unaligned access */

/* sum of x[i]^2 with 8 independent partial sums (a serial fp32 sum is latency-bound). */
static inline float gdn_sumsq(const float *x, int64_t n) {
    gdn_v8f acc = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        gdn_v8f v = *(const gdn_v8f_u *)(x + i);
        acc += v * v;
    }
    float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) s += x[i] * x[i];
    return s;
}

/* exp() of 8 lanes, Cephes-style: 2^n * p(r) with |r| <= ln2/2, a degree-6 polynomial, about
 * 1 ulp; lanes below -69 give exactly 0 like gdn_expf_ftz, lanes above 88 give +Inf. */
typedef int32_t gdn_v8i __attribute__((vector_size(32)));
static inline gdn_v8f gdn_vexpf_ftz(gdn_v8f x) {
    const gdn_v8i tiny = x < -69.0f, huge = x > 88.0f;
    x = (gdn_v8f)(((gdn_v8i)x & ~(tiny | huge)));       /* those lanes computed from 0 */
    const gdn_v8f magic = (gdn_v8f){0} + 12582912.0f;    /* 1.5 * 2^23: round to nearest */
    const gdn_v8f t = x * 1.44269504088896341f + magic;
    const gdn_v8f n = t - magic;
    const gdn_v8f r = x - n * 0.693359375f - n * -2.12194440e-4f;
    gdn_v8f p = (gdn_v8f){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const gdn_v8i e = ((gdn_v8i)t - (gdn_v8i)magic + 127) << 23; /* 2^n */
    gdn_v8f y = p * (gdn_v8f)e;
    const gdn_v8f inf = (gdn_v8f){0} + __builtin_inff();
    y = (gdn_v8f)(((gdn_v8i)y & ~(tiny | huge)) | ((gdn_v8i)inf & huge));
    return y;
}

/* sigmoid of 8 lanes by the vector exp above (a scalar expf per element costs a tenth of a
 * layer's or a training step's time). */
static inline gdn_v8f gdn_vsigmoidf(gdn_v8f x) { return 1.0f / (1.0f + gdn_vexpf_ftz(-x)); }

/* exp() that returns exactly 0 below 1e-30 (avoids denormal slow paths; far below fp32 rounding). */
static inline float gdn_expf_ftz(float x) {
    return x < -69.0f ? 0.0f : __builtin_expf(x);
}

/* Carve n floats from a workspace arena; each piece starts on a 64-byte boundary. */
static inline float *gdn_carve(float **cur, size_t n) {
    float *p = *cur;
    *cur += (n + 15) & ~(size_t)15;
    return p;
}

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
} gdn_grads;

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
};

/* Inputs of one (batch row, value head) stream seen by the chunk loop. */
typedef struct {
    const float *q, *k, *v, *g, *beta; /* base pointers of the full tensors */
} gdn_inputs;

/* Run the chunk loop for batch row b, value heads h .. h+nheads-1 (all of one key head) over
 * tokens [t_begin, t_end) (t_begin a multiple of the chunk) and state columns [c0, c0+w) of the
 * augmented width: columns below V are value columns, columns from V on carry zero values
 * (summaries push the identity through them, giving A). The states enter and leave in
 * ws->state (nheads blocks of K x w, row stride w). o: output base (the full [B,T,Hv,V]
 * tensor) or NULL. */
void gdn_chunk_stream(const gdn_plan *p, gdn_chunk_ws *ws, const gdn_inputs *in, int64_t b,
                      int64_t h, int nheads, int c0, int w, int64_t t_begin, int64_t t_end,
                      float *o);

/* The phases of one chunk [t0, t0+n), shared with the backward:
 * prepare: (unless keys_ready: the key side qs, kn, kt, KK^T in pk, QK^T in qk), gates, G and
 *          decays, tm = (I+L)^-1, -W (xw rows 0..n-1) and, with want_out, diag(eG) Q (xw rows
 *          n..2n-1) and A (am);
 * values:  rv = diag(beta) V, u = Dl = tm rv - W S, m2 = [-W ; eG Q] S;
 * update_state: S <- exp(Gc) S + Kd^T Dl (kdt = Kd^T). */
void gdn_chunk_prepare(const gdn_plan *p, gdn_chunk_ws *ws, const gdn_inputs *in, int64_t b,
                       int64_t h, int64_t t0, int n, int want_out, int keys_ready);
void gdn_chunk_values(const gdn_plan *p, gdn_chunk_ws *ws, const gdn_inputs *in, int64_t b,
                      int64_t h, int64_t t0, int n, int c0, int w, int want_out, const float *S);
void gdn_chunk_update_state(const gdn_plan *p, gdn_chunk_ws *ws, int n, int w, float *S);

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
void gdn_backward_item(const gdn_plan *p, gdn_chunk_ws *ws, gdn_bwd_ws *bw, const gdn_inputs *in,
                       const gdn_grads *gr, const gdn_range *rg, int64_t hk);

/* Segment adjoint of stream (b, h) over tokens [t_begin, t_end): the gradient of
 * sum(o * dout) + sum(S_out * ds_out) with respect to the state entering the segment, into sg
 * (K x V); ds_out (K x V) NULL: 0, giving G. Only dout of gr is used. */
void gdn_adjoint_item(const gdn_plan *p, gdn_chunk_ws *ws, gdn_bwd_ws *bw, const gdn_inputs *in,
                      const gdn_grads *gr, int64_t b, int64_t h, int64_t t_begin, int64_t t_end,
                      const float *ds_out, float *sg);

/* ---- streams (stream.c) */
/* Offsets valid for the config (called by gdn_config_check): GDN_OK for a dense config. */
int gdn_pack_check(const gdn_config *c);
/* The config's tokens are the whole stream (single-rank entry points and the oracle). */
int gdn_pack_check_whole(const gdn_config *c);
/* Floats of h0, ht, dht, dh0: [n_docs or B, Hv, K, V]. */
int64_t gdn_state_floats(const gdn_config *c);
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
int gdn_streams_forward(gdn_plan *p, float *o, float *ht, float *ckpt, const float *q,
                        const float *k, const float *v, const float *g, const float *beta,
                        const float *h0, const float *s_in, float *s_out);
int gdn_streams_backward(gdn_plan *p, float *dq, float *dk, float *dv, float *dg, float *dbeta,
                         float *dh0, const float *q, const float *k, const float *v,
                         const float *g, const float *beta, const float *h0, const float *s_in,
                         const float *ckpt, const float *dout, const float *dht,
                         const float *ds_out, float *ds_in);
/* The adjoint offset of every row's first stream alone (its gradient with respect to the state
 * entering it, from its outputs and, when its document ends within the plan, from that
 * document's dht), into sg [B, Hv, K, V]. */
int gdn_streams_adjoint_first(gdn_plan *p, float *sg, const float *q, const float *k,
                              const float *g, const float *beta, const float *dout,
                              const float *dht);

/* A dense plan's place in a context-parallel split: not the first shard, its streams continue
 * from s_in; not the last, they go on into s_out (no ht rows). A packed plan is placed by its
 * documents and seq_offset (no-op). The single-rank entry points set (1, 1). */
void gdn_streams_set_shard(gdn_plan *p, int first_shard, int last_shard);

/* ---- the one tensor checker (check.c): NULLs and non-finite values, one set of messages */
/* Validate the inputs of a plan's shape (NULL, and NaN/Inf when check_finite is on); h0 may be NULL. */
int gdn_check_inputs(const gdn_plan *p, const float *q, const float *k, const float *v,
                     const float *g, const float *beta, const float *h0);
/* 1 when some element of x[0..n) is NaN or Inf (vectorised; for rows inside the hot loop). */
static inline int gdn_row_nonfinite(const float *x, int64_t n) {
    gdn_v8f acc = {0};
    float s = 0.0f;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc += *(const gdn_v8f_u *)(x + i) * 0.0f;
    for (; i < n; i++) s += x[i] * 0.0f;
    for (int l = 0; l < 8; l++) s += acc[l];
    return s != s;
}
int gdn_check_tensor(const char *name, const float *x, int64_t n, int check_finite, int threads);
/* An output (or a gradient) that came out non-finite: GDN_ERR_NONFINITE naming it and the
 * element, with the usual causes; GDN_OK when finite. */
int gdn_check_output(const char *name, const float *x, int64_t n, int threads);
typedef struct { const char *name; const float *x; int64_t n; } gdn_named_output;
/* The in-loop check found a non-finite row but the exact scans found nothing: a finite q or k
 * row so large that its squared norm overflows. Returns GDN_ERR_NONFINITE. */
int gdn_fail_keys_overflow(void);
/* The message of a non-finite element of a tensor in a role ("input", "weight"): GDN_ERR_NONFINITE. */
int gdn_fail_nonfinite(const char *role, const char *name, double value, int64_t at);

/* The calling OpenMP thread's index (0 outside parallel regions or without OpenMP): each
 * thread works in p->ws[gdn_thread_id()]. */
int gdn_thread_id(void);

/* dS_in = A^T dS_out + G for every (batch row, value head) in one state-only reverse pass
 * (ds_out NULL: G alone). What gdn_summary_adjoint computes, with a final-state gradient. */
int gdn_state_adjoint(gdn_plan *p, float *ds_in, const float *q, const float *k, const float *g,
                      const float *beta, const float *dout, const float *ds_out);
/* The final state alone (no outputs): the forward without its output half. */
int gdn_forward_state(gdn_plan *p, float *ht, const float *q, const float *k, const float *v,
                      const float *g, const float *beta, const float *h0);

/* Column blocking: the width of the column blocks that `streams` streams of `width` state
 * columns are split into so that all threads have work (== width when there are enough). */
int gdn_column_block_width(const gdn_plan *p, int64_t streams, int width);

#endif
