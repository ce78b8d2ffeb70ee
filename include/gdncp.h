/*
 * gdncp — the Gated DeltaNet token mixer (Qwen3.5 / Qwen3-Next), exact and fast.
 *
 * The whole public API. Conventions (see DESIGN.md §1):
 *   - fp32 row-major tensors in the BTHD layout: q, k [B,T,Hk,K]; v, o [B,T,Hv,V];
 *     g, beta [B,T,Hv]; states h0, ht [B,Hv,K,V].
 *   - value head j uses key head j / (Hv/Hk)  (PyTorch repeat_interleave order).
 *   - g is the log-decay; per-token decay is exp(g).
 *   - every function returns a gdn_status; on failure gdn_errmsg() names what is wrong.
 */
#ifndef GDNCP_H
#define GDNCP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- status codes */

typedef enum {
    GDN_OK = 0,
    GDN_ERR_ARG = 1,       /* a NULL pointer or an option out of range */
    GDN_ERR_SHAPE = 2,     /* sizes that are zero, negative, too large or inconsistent */
    GDN_ERR_NONFINITE = 3, /* NaN or Inf in an input tensor */
    GDN_ERR_NOMEM = 4,     /* allocation failed */
    GDN_ERR_IO = 5,        /* open/read/write/rename failed */
    GDN_ERR_FORMAT = 6,    /* a malformed or truncated file */
    GDN_ERR_MISSING = 7,   /* a required tensor is absent from a file */
    GDN_ERR_DTYPE = 8      /* a tensor has a dtype this operation cannot use */
} gdn_status;

/* Short fixed text for a status code. */
const char *gdn_strerror(int status);
/* Detailed message of the last failure on the calling thread (names the tensor or dimension). */
const char *gdn_errmsg(void);
/* GDN_OK, or GDN_ERR_NOMEM naming `what`, the need and the machine's memory when `bytes` exceed
 * this machine's physical memory: a size that clearly cannot fit, refused before allocating
 * (where overcommit would let malloc succeed and the OOM killer end the run later). A double, so
 * that absurd sizes are refused before any size_t product of them can overflow. */
int gdn_check_fits(const char *what, double bytes);

/* ---------------------------------------------------------------- configuration */

#define GDN_MAX_HEAD_DIM 256 /* K and V may be any size from 1 to this */
#define GDN_SCALE_DEFAULT 0.0f /* scale == 0 means 1/sqrt(K) */

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
} gdn_config;

/* A config with the library defaults: chunk 64, default scale, L2 norm on, all threads, checks on. */
gdn_config gdn_config_default(int64_t B, int64_t T, int64_t Hk, int64_t Hv, int64_t K, int64_t V);

/* Validate a config; returns GDN_OK or an error naming the offending field. */
int gdn_config_check(const gdn_config *cfg);

/* ---------------------------------------------------------------- the fast chunked kernel */

/* A plan fixes shapes, chunk size, threads, kernel path and owns all workspace:
 * executing it allocates nothing. A plan may be executed from one thread at a time. */
typedef struct gdn_plan gdn_plan;

int gdn_plan_create(gdn_plan **plan, const gdn_config *cfg);
void gdn_plan_destroy(gdn_plan *plan);
/* The config the plan was made with (chunk, scale and threads resolved). */
const gdn_config *gdn_plan_config(const gdn_plan *plan);
/* Name of the micro-kernel path the plan runs (for benchmarks and logs). */
const char *gdn_plan_path(const gdn_plan *plan);
/* Other documents for a packed plan's tokens (a training step's): cu_seqlens, n_docs and
 * seq_offset as in gdn_config, checked and copied; shapes and workspace stay. The plan must have
 * been made packed (one document {0, T} will do). On failure the plan keeps its documents. */
int gdn_plan_set_docs(gdn_plan *plan, const int64_t *cu_seqlens, int64_t n_docs, int64_t seq_offset);

/* Forward: o [B,T,Hv,V] and ht [B,Hv,K,V] (ht may be NULL) from q, k, v, g, beta and the
 * initial state h0 (NULL means zeros). */
int gdn_forward(gdn_plan *plan, float *o, float *ht, const float *q, const float *k,
                const float *v, const float *g, const float *beta, const float *h0);

/* Backward: gradients of loss = sum(o * dout) + sum(ht * dht) with respect to the
 * un-normalised q, k and to v, g, beta, h0. dht and h0 may be NULL (zeros); dh0 may be NULL.
 * The forward is recomputed from checkpoints: nothing needs to be saved from gdn_forward. */
int gdn_backward(gdn_plan *plan, float *dq, float *dk, float *dv, float *dg, float *dbeta,
                 float *dh0, const float *q, const float *k, const float *v, const float *g,
                 const float *beta, const float *h0, const float *dout, const float *dht);

/* Training step without the backward's forward sweep: gdn_forward_save also writes the state at
 * the start of every checkpoint segment after the first into ckpt (gdn_plan_checkpoint_floats()
 * floats: [B, Hv, segments - 1, K, V]; at most a tenth of the inputs with automatic
 * checkpointing), and gdn_backward_saved starts from them (the first segment from h0). ckpt
 * must come from the same plan and inputs; gdn_backward_saved with ckpt NULL is gdn_backward. */
size_t gdn_plan_checkpoint_floats(const gdn_plan *plan);
int gdn_forward_save(gdn_plan *plan, float *o, float *ht, float *ckpt, const float *q,
                     const float *k, const float *v, const float *g, const float *beta,
                     const float *h0);
int gdn_backward_saved(gdn_plan *plan, float *dq, float *dk, float *dv, float *dg, float *dbeta,
                       float *dh0, const float *q, const float *k, const float *v,
                       const float *g, const float *beta, const float *h0, const float *ckpt,
                       const float *dout, const float *dht);

/* Bytes the backward uses per thread (its own checkpoints, one segment's states and chunk
 * intermediates, scratch) — independent of B and of the number of heads; it grows as sqrt(T)
 * with automatic checkpointing. */
size_t gdn_plan_backward_bytes(const gdn_plan *plan);

/* This machine's fp32 FMA peak in GFLOP/s with `threads` threads, at the widest vector width the
 * CPU runs (16 lanes with AVX-512, 8 with AVX2): the denominator of benchmarks' fractions. */
double gdn_measure_peak_gflops(int threads);
/* Count the FLOPs the kernel's GEMM micro-kernels issue between start and stop (2 per
 * multiply-add computed; the zero triangles it skips are not issued): DESIGN §3's canonical
 * count overstates the work once triangles are skipped. Not thread-safe against itself. */
void gdn_flops_issued_start(void);
uint64_t gdn_flops_issued_stop(void);

/* ---------------------------------------------------------------- segment summaries (affine view)
 *
 * A token segment maps the state entering it affinely: S_out = A S_in + B, with
 * A [B,Hv,K,K] and B [B,Hv,K,V] (named sa, sb here). Composition is not commutative:
 * applying (A1,B1) first, then (A2,B2), gives (A2 A1, A2 B1 + B2). */

/* The segment's exact map, computed in one pass over the augmented state [S | A]
 * without forming per-chunk pairs. sa [B,Hv,K,K], sb [B,Hv,K,V]. With sb NULL only A is
 * computed (v is then not read and may be NULL). */
int gdn_summary(gdn_plan *plan, float *sa, float *sb, const float *q, const float *k,
                const float *v, const float *g, const float *beta);

/* The segment's adjoint offset G [B,Hv,K,V]: the gradient of sum(o * dout) with respect to the
 * state entering the segment, so that dS_in = A^T dS_out + G (DESIGN §4). G does not depend on
 * the incoming state or on v. One reverse pass, no forward sweep. */
int gdn_summary_adjoint(gdn_plan *plan, float *sg, const float *q, const float *k,
                        const float *g, const float *beta, const float *dout);

/* (out_a, out_b) = (a2,b2) o (a1,b1), i.e. first 1 then 2. Outputs may not alias inputs.
 * nmaps = B*Hv maps, each K x K and K x V. */
int gdn_summary_compose(float *out_a, float *out_b, const float *a2, const float *b2,
                        const float *a1, const float *b1, int64_t nmaps, int64_t K, int64_t V);

/* out = a s + b for each of nmaps maps; out may not alias s. */
int gdn_summary_apply(float *out, const float *a, const float *b, const float *s, int64_t nmaps,
                      int64_t K, int64_t V);

/* ---------------------------------------------------------------- the double-precision oracle */

/* The token-by-token recurrence of DESIGN §2 in double precision. Same layouts and
 * options as the fast path (chunk and threads are ignored). ht and h0 may be NULL. */
int gdn_reference_forward(const gdn_config *cfg, double *o, double *ht, const double *q,
                          const double *k, const double *v, const double *g, const double *beta,
                          const double *h0);

/* Backward of the oracle (reverse token loop, double): gradients of
 * loss = sum(o * dout) + sum(ht * dht) with respect to the un-normalised q, k and to v, g, beta
 * and h0. A key head's gradient sums over the value heads sharing it. dht and h0 may be NULL
 * (zeros); dh0 may be NULL (not wanted). */
int gdn_reference_backward(const gdn_config *cfg, double *dq, double *dk, double *dv,
                           double *dg, double *dbeta, double *dh0, const double *q,
                           const double *k, const double *v, const double *g,
                           const double *beta, const double *h0, const double *dout,
                           const double *dht);

/* ---------------------------------------------------------------- the decode step (T = 1)
 *
 * One token of the recurrence for every (batch row, value head), the state updated in place:
 * state [B,Hv,K,V] holds S_{t-1} on entry and S_t on return (ht == h0: no copy follows the
 * step). q, k [B,Hk,K], v, o [B,Hv,V], g, beta [B,Hv] (the [B,1,H,D] tensors of one token).
 * Uses the plan's B, Hk, Hv, K, V, scale, L2 norm, threads and check_finite (its T and chunk are
 * ignored); no chunk machinery, nothing allocated. With check_finite, non-finite inputs are found
 * on the rows the step reads anyway and the state is left unchanged when they are. */
int gdn_step(gdn_plan *plan, float *o, float *state, const float *q, const float *k,
             const float *v, const float *g, const float *beta);
/* Name of the code path gdn_step runs (for benchmarks). */
const char *gdn_step_path(void);

/* ---------------------------------------------------------------- the Qwen3.5 GatedDeltaNet layer
 *
 * x [B,T,E] -> y [B,T,E] (DESIGN §5): in_proj_qkv/z/b/a, causal depthwise conv (kernel Kc) + SiLU
 * over the [q|k|v] channels, beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias), the gated
 * delta rule (L2 norm on, scale 1/sqrt(K)), gated RMSNorm per value head, out_proj.
 *
 * Parameters live in one flat fp32 array, the tensors in gdn_layer_param order at
 * gdn_layer_param_offset(), each in its Hugging Face shape (PyTorch [out, in]); gradients use
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
    const int64_t *cu_seqlens; /* packed documents, as in gdn_config (B = 1; NULL: dense): the conv
                                  and the recurrent state restart at every document start (no tap
                                  reads across one, also across the CP halo); every document starts
                                  from zero states: conv_state [n_docs, conv_dim, Kc] and rec_state
                                  [n_docs, Hv, K, V], when given, must hold zeros and receive each
                                  document's final caches (a packed prefill, then decode with
                                  B = n_docs) */
    int64_t n_docs;
    int64_t seq_offset;        /* under CP: this rank's first token in the packed stream */
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
} gdn_layer_param;

/* Defaults: Kc 4, eps 1e-6, chunk 64, all threads, KEEP_MIN, checks on. */
gdn_layer_config gdn_layer_config_default(int64_t B, int64_t T, int64_t E, int64_t Hk,
                                          int64_t Hv, int64_t K, int64_t V);
int gdn_layer_config_check(const gdn_layer_config *cfg);
int64_t gdn_layer_conv_dim(const gdn_layer_config *cfg);
/* Hugging Face name of a parameter ("in_proj_qkv.weight", "conv1d.weight", "A_log", ...). */
const char *gdn_layer_param_name(int which);
/* Its shape (returns ndim, fills shape[0..ndim)), offset and size in the flat array. */
int gdn_layer_param_shape(const gdn_layer_config *cfg, int which, int64_t shape[3]);
size_t gdn_layer_param_offset(const gdn_layer_config *cfg, int which);
size_t gdn_layer_param_numel(const gdn_layer_config *cfg, int which);
size_t gdn_layer_param_floats(const gdn_layer_config *cfg); /* the whole array */

typedef struct gdn_layer_plan gdn_layer_plan;

int gdn_layer_plan_create(gdn_layer_plan **plan, const gdn_layer_config *cfg);
void gdn_layer_plan_destroy(gdn_layer_plan *plan);
const gdn_layer_config *gdn_layer_plan_config(const gdn_layer_plan *plan);
/* Other documents for a packed layer plan (gdn_plan_set_docs; the conv restarts move too). A
 * forward's saved floats belong to the documents it ran with: set the same ones for its backward. */
int gdn_layer_plan_set_docs(gdn_layer_plan *plan, const int64_t *cu_seqlens, int64_t n_docs,
                            int64_t seq_offset);
/* Floats the forward keeps for the backward (depends on cfg.keep). */
size_t gdn_layer_saved_floats(const gdn_layer_plan *plan);
/* Name of the GEMM path the projections run. */
const char *gdn_layer_plan_path(const gdn_layer_plan *plan);

/* Forward. w: the flat parameters (float, or uint16_t BF16 when cfg.weight_dtype is GDN_BF16).
 * saved (may be NULL: inference) receives what the backward
 * needs. conv_state [B, conv_dim, Kc] (Hugging Face's cache layout, newest column last) and
 * rec_state [B,Hv,K,V] may be NULL (zeros; not returned); when given they hold the state before x
 * on entry and the state after x on return, so a prompt can be prefilled in pieces. */
int gdn_layer_forward(gdn_layer_plan *plan, float *y, float *saved, const float *x,
                      const void *w, float *conv_state, float *rec_state);

/* Backward of loss = sum(y * dy): dx [B,T,E] and dw (flat, overwritten) for the forward that
 * filled saved (with its initial states, if any). saved NULL: the forward started from zero
 * states and everything is recomputed. */
int gdn_layer_backward(gdn_layer_plan *plan, float *dx, float *dw, const float *x,
                       const float *w, const float *saved, const float *dy);

/* Decode: one token for each of the plan's B sequences, x, y [B,1,E] (any plan of this B; its T
 * is not used), conv_state and rec_state in place as above (required). No chunk machinery,
 * nothing allocated. */
int gdn_layer_decode(gdn_layer_plan *plan, float *y, const float *x, const void *w,
                     float *conv_state, float *rec_state);

/* The layer in double precision with plain loops (zero initial states): the oracle the fp32
 * layer is tested against. w, dw: flat parameters as above, in double. */
int gdn_layer_reference_forward(const gdn_layer_config *cfg, double *y, const double *x,
                                const double *w);
int gdn_layer_reference_backward(const gdn_layer_config *cfg, double *dx, double *dw,
                                 const double *x, const double *w, const double *dy);

/* ---------------------------------------------------------------- safetensors I/O */

/* Readable/writable dtypes; other safetensors dtypes are accepted in a file (GDN_DTYPE_OTHER)
 * but reading them is refused with GDN_ERR_DTYPE. */
typedef enum { GDN_F32 = 0, GDN_F64 = 1, GDN_BF16 = 2, GDN_DTYPE_OTHER = 3 } gdn_dtype;

#define GDN_ST_MAX_DIMS 8

typedef struct {
    const char *name;
    gdn_dtype dtype;
    const char *dtype_name; /* as written in the file, e.g. "F32" */
    int ndim;
    int64_t shape[GDN_ST_MAX_DIMS];
    uint64_t begin, end; /* byte offsets within the data section */
} gdn_st_tensor;

typedef struct gdn_st_file gdn_st_file;

/* Open a file and validate its whole header (JSON, dtypes, shapes, offsets, overlaps, size). */
int gdn_st_open(gdn_st_file **f, const char *path);
void gdn_st_close(gdn_st_file *f);
int gdn_st_count(const gdn_st_file *f);
const gdn_st_tensor *gdn_st_at(const gdn_st_file *f, int i);
/* NULL if absent. */
const gdn_st_tensor *gdn_st_find(const gdn_st_file *f, const char *name);
/* A metadata value, or NULL. */
const char *gdn_st_metadata(const gdn_st_file *f, const char *key);

/* Read a whole tensor converting to f32 / f64. n is the capacity of dst in elements. */
int gdn_st_read_f32(gdn_st_file *f, const char *name, float *dst, size_t n);
int gdn_st_read_f64(gdn_st_file *f, const char *name, double *dst, size_t n);
/* Rows [begin, begin+count) along dimension 1 (the T axis of [B,T,...] tensors), for every
 * index of dimension 0: dst gets [d0, count, d2, ...]. Only those bytes are read. */
int gdn_st_read_f32_rows(gdn_st_file *f, const char *name, float *dst, size_t n, int64_t begin,
                         int64_t count);
/* A 1-D integer tensor (I64 or I32, e.g. packed documents' cu_seqlens) as int64: *count gets its
 * length. Refuses other dtypes (GDN_ERR_DTYPE), other ranks and more than n elements
 * (GDN_ERR_SHAPE), naming the tensor. */
int gdn_st_read_i64(gdn_st_file *f, const char *name, int64_t *dst, size_t n, int64_t *count);
/* Number of elements of a tensor (product of its shape). */
int64_t gdn_st_numel(const gdn_st_tensor *t);

/* A writer gathers tensors, then writes the file atomically (temp file, fsync, rename). */
typedef struct gdn_st_writer gdn_st_writer;

int gdn_st_writer_create(gdn_st_writer **w);
void gdn_st_writer_destroy(gdn_st_writer *w);
/* data is f32; it is stored as dtype (F32, F64 or BF16 round-to-nearest-even) and copied now;
 * NULL reserves the tensor for gdn_st_write_at (below). */
int gdn_st_writer_add_f32(gdn_st_writer *w, const char *name, gdn_dtype dtype, int ndim,
                          const int64_t *shape, const float *data);
int gdn_st_writer_add_f64(gdn_st_writer *w, const char *name, gdn_dtype dtype, int ndim,
                          const int64_t *shape, const double *data);
/* An integer tensor stored as I64 (e.g. cu_seqlens); data is copied now (NULL: reserved). */
int gdn_st_writer_add_i64(gdn_st_writer *w, const char *name, int ndim, const int64_t *shape,
                          const int64_t *data);
int gdn_st_writer_metadata(gdn_st_writer *w, const char *key, const char *value);
int gdn_st_writer_save(gdn_st_writer *w, const char *path);

/* One file written by several processes at once (context parallelism: each rank writes its own
 * rows, so no rank holds the whole output). Add the tensors that others will write with data
 * NULL (reserved); every process builds the same writer, so the layout agrees. Then: one process
 * gdn_st_writer_begin (temporary file next to path with the header, the tensors that have data,
 * and the full size; its name into tmp), all processes gdn_st_write_at their bytes at
 * gdn_st_writer_offset + their position (F32 tensors), then, after all have written, one process
 * gdn_st_commit (rename over path, fsync the directory). gdn_st_writer_save refuses reserved
 * tensors. */
int gdn_st_writer_offset(gdn_st_writer *w, const char *name, uint64_t *offset);
int gdn_st_writer_begin(gdn_st_writer *w, const char *path, char *tmp, size_t cap);
int gdn_st_write_at(const char *tmp, uint64_t offset, const float *data, size_t n);
int gdn_st_commit(const char *tmp, const char *path);
/* The library installs no signal handlers. For an application's SIGINT/SIGTERM handler
 * (async-signal-safe): remove the temporary files of every safetensors write in progress in
 * this process (gdn_st_writer_save's, and gdn_st_writer_begin's until gdn_st_commit), so an
 * interrupted write leaves the previous file and no temporary one. */
void gdn_st_remove_temporaries(void);

/* ---------------------------------------------------------------- layer weights from checkpoints
 * A Hugging Face safetensors file holding one GatedDeltaNet layer's weights, bare
 * ("in_proj_qkv.weight") or under a prefix ("model.layers.0.linear_attn."), in Qwen3.5's split
 * layout or Qwen3-Next's fused one (in_proj_qkvz, in_proj_ba, interleaved per key head), F32,
 * F64 or BF16 on disk. Tensors outside the prefix are ignored; under it, missing, unknown or
 * mis-shaped ones are errors naming the weight. */
typedef struct {
    gdn_layer_config cfg; /* E, Hk, Hv, K, V, Kc, eps from the sources; B = T = 0 */
    float *w;             /* flat fp32 parameters (gdn_layer_param_floats(&cfg)); NULL after
                             gdn_layer_weights_to_bf16 */
    uint16_t *w_bf16;     /* the same as BF16 after gdn_layer_weights_to_bf16, else NULL */
    int fused;            /* 1: the file used the fused Qwen3-Next layout */
    gdn_dtype dtype;      /* dtype of in_proj_qkv (or in_proj_qkvz) on disk */
} gdn_layer_weights;

/* Dimensions come from config_path (config.json: linear_num_key_heads, linear_key_head_dim,
 * linear_num_value_heads, linear_value_head_dim, linear_conv_kernel_dim, hidden_size,
 * rms_norm_eps; or the same under "text_config") when given, else from the file's __metadata__
 * (Hk, Hv, K, V, Kc, E, rms_norm_eps), else from `given` (fields > 0; may be NULL), and every
 * source that states a value must agree with the others and with the tensor shapes. prefix may
 * be NULL or "". */
int gdn_layer_weights_load(gdn_layer_weights *lw, const char *path, const char *config_path,
                           const char *prefix, const gdn_layer_config *given);
void gdn_layer_weights_free(gdn_layer_weights *lw);
/* Keep the weights as BF16 in memory (inference: half the bytes each decode step streams):
 * rounds to nearest even (exact for a BF16 checkpoint), frees the fp32 copy and sets
 * cfg.weight_dtype = GDN_BF16. */
int gdn_layer_weights_to_bf16(gdn_layer_weights *lw);
/* The flat parameters to pass to the layer: w or w_bf16, as cfg.weight_dtype says. */
const void *gdn_layer_weights_data(const gdn_layer_weights *lw);
/* Add gradients dw (flat, split layout) to a writer as name_prefix + the name each weight was
 * loaded under, without the file's prefix: fused checkpoints get in_proj_qkvz.weight and
 * in_proj_ba.weight in their interleaved order. dw NULL reserves them (gdn_st_writer_begin). */
int gdn_layer_grads_add(gdn_st_writer *wr, const gdn_layer_weights *lw, const float *dw,
                        const char *name_prefix);

/* ---------------------------------------------------------------- problem files
 * A gated-delta-rule problem in one safetensors file: q, k, v, g, beta, optional h0, and for
 * gradients do (required) and dht (optional), in the layouts above, any readable dtype. */
typedef struct {
    gdn_config cfg; /* shapes inferred from the tensors (T = the rows loaded); options default */
    int64_t T_full, t_begin; /* the file's sequence length and the first row loaded */
    float *q, *k, *v, *g, *beta;
    float *h0;      /* NULL when the file has none */
    float *dout;    /* "do", only when asked for */
    float *dht;     /* NULL when absent */
} gdn_problem;

/* Read and validate. want_grads: also read "do" (required) and "dht" (optional). */
int gdn_problem_load(gdn_problem *pb, const char *path, int want_grads);
/* The same for tokens [t_begin, t_begin + count) only (a context-parallel shard): shapes are
 * checked against the whole file, only the shard's rows are read; h0 and dht whole. */
int gdn_problem_load_rows(gdn_problem *pb, const char *path, int want_grads, int64_t t_begin,
                          int64_t count);
/* Packed documents (n_docs >= 1; 0 is gdn_problem_load_rows): B must be 1, and h0 and dht, when
 * present, are per document, [n_docs, Hv, K, V]. count < 0: every row. The offsets themselves
 * are the caller's (the file's "cu_seqlens" tensor: gdn_st_read_i64). */
int gdn_problem_load_packed(gdn_problem *pb, const char *path, int want_grads, int64_t t_begin,
                            int64_t count, int64_t n_docs);
void gdn_problem_free(gdn_problem *pb);

/* Write named f32 tensors atomically. */
typedef struct {
    const char *name;
    int ndim;
    int64_t shape[4];
    const float *data;
} gdn_named_tensor;
int gdn_save_tensors(const char *path, const gdn_named_tensor *t, int n, const char *tool);


#ifdef __cplusplus
}
#endif
#endif /* GDNCP_H */
