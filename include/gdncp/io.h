/* Files: safetensors reading and atomic writing, layer weights from Hugging Face
 * checkpoints, gated-delta-rule problem files. */
#ifndef GDNCP_IO_H
#define GDNCP_IO_H

#include <stdint.h>
#include "kernel.h"
#include "layer.h"
#include "attention.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- safetensors I/O */

/* The readable/writable dtypes: gdn_dtype (compute.h); other safetensors dtypes are accepted in
 * a file (GDN_DTYPE_OTHER) but reading them is refused with GDN_ERR_DTYPE. */

#define GDN_ST_MAX_DIMS 8

typedef struct {
    const char *name;
    gdn_dtype dtype;
    const char *dtype_name; /* as written in the file, e.g. "F32" */
    int ndim;
    int64_t shape[GDN_ST_MAX_DIMS];
    int64_t numel;        /* number of elements (product of the shape) */
    uint64_t begin, end; /* byte offsets within the data section */
} gdn_st_tensor;

typedef struct gdn_st_file gdn_st_file;

/* Open a file and validate its whole header (JSON, dtypes, shapes, offsets, overlaps, size). */
GDN_API int gdn_st_open(gdn_st_file **f, const char *path);
GDN_API void gdn_st_close(gdn_st_file *f);
/* Tensor i of the file, in header order; NULL for i < 0 or past the last one (walk from 0 until
 * NULL; a NULL file has none). */
GDN_API const gdn_st_tensor *gdn_st_at(const gdn_st_file *f, int i);
/* NULL if absent. */
GDN_API const gdn_st_tensor *gdn_st_find(const gdn_st_file *f, const char *name);
/* The path the file was opened under. */
GDN_API const char *gdn_st_path(const gdn_st_file *f);
/* A metadata value, or NULL. */
GDN_API const char *gdn_st_metadata(const gdn_st_file *f, const char *key);

/* Read tensor `name` converted to dst_dtype (GDN_F32: dst is float[], GDN_F64: double[]; the
 * file's F32, F64 or BF16), n the capacity of dst in elements. count < 0: the whole tensor (axis
 * and begin ignored). count >= 0: rows [begin, begin + count) along dimension `axis`, for every
 * index of the dimensions before it, and only those bytes are read: dst gets [d0, ..,
 * count, ...] (axis 1: the T rows of a [B, T, ...] tensor; axis 0: a contiguous run, e.g. tokens
 * of a [T, E] tensor). Errors name the tensor. */
GDN_API int gdn_st_read(gdn_st_file *f, const char *name, gdn_dtype dst_dtype, void *dst, size_t n, int axis,
                        int64_t begin, int64_t count);
/* Elements [first, first + count) of tensor `name` in row-major order as F32 (from F32, F64 or
 * BF16), into dst (count floats); only those bytes are read (a slice of a sharded state). */
GDN_API int gdn_st_read_span(gdn_st_file *f, const char *name, float *dst, int64_t first, int64_t count);
/* An integer tensor (I64 or I32, e.g. packed documents' cu_seqlens or position_ids [B, T]) as
 * int64, its elements in row-major order: *count gets their number. ndim > 0: the tensor must
 * have that many dimensions (GDN_ERR_SHAPE otherwise); 0: any. Refuses other dtypes
 * (GDN_ERR_DTYPE) and more than n elements (GDN_ERR_SHAPE), naming the tensor. */
GDN_API int gdn_st_read_ints(gdn_st_file *f, const char *name, int64_t *dst, size_t n, int64_t *count, int ndim);

/* A writer gathers tensors, then writes the file atomically (temp file, fsync, rename). */
typedef struct gdn_st_writer gdn_st_writer;

GDN_API int gdn_st_writer_create(gdn_st_writer **w);
GDN_API void gdn_st_writer_destroy(gdn_st_writer *w);
/* data is data_dtype (GDN_F32: float[], GDN_F64: double[]); it is stored as dtype (F32, F64 or
 * BF16 round-to-nearest-even) and copied now; NULL reserves the tensor for gdn_st_write_at
 * (below). */
GDN_API int gdn_st_writer_add(gdn_st_writer *w, const char *name, gdn_dtype dtype, int ndim, const int64_t *shape,
                              const void *data, gdn_dtype data_dtype);
/* The BF16 bits a writer stores for x: round to nearest even (a NaN stays a NaN). */
GDN_API uint16_t gdn_st_bf16(float x);
/* An integer tensor stored as I64 (e.g. cu_seqlens); data is copied now (NULL: reserved). */
GDN_API int gdn_st_writer_add_i64(gdn_st_writer *w, const char *name, int ndim, const int64_t *shape,
                          const int64_t *data);
GDN_API int gdn_st_writer_metadata(gdn_st_writer *w, const char *key, const char *value);
GDN_API int gdn_st_writer_save(gdn_st_writer *w, const char *path);

/* One file written by several processes at once (context parallelism: each rank writes its own
 * rows, so no rank holds the whole output). Add the tensors that others will write with data
 * NULL (reserved); every process builds the same writer, so the layout agrees. Then: one process
 * gdn_st_writer_begin (temporary file next to path with the header, the tensors that have data,
 * and the full size; its name into tmp), all processes gdn_st_write_at their bytes at
 * gdn_st_writer_offset + their position (F32 tensors), then, after all have written, one process
 * gdn_st_commit (rename over path, fsync the directory). gdn_st_writer_save refuses reserved
 * tensors. */
GDN_API int gdn_st_writer_offset(gdn_st_writer *w, const char *name, uint64_t *offset);
GDN_API int gdn_st_writer_begin(gdn_st_writer *w, const char *path, char *tmp, size_t cap);
GDN_API int gdn_st_write_at(const char *tmp, uint64_t offset, const float *data, size_t n);
GDN_API int gdn_st_commit(const char *tmp, const char *path);
/* The library installs no signal handlers. For an application's SIGINT/SIGTERM handler
 * (async-signal-safe): remove the temporary files of every safetensors write in progress in
 * this process (gdn_st_writer_save's, and gdn_st_writer_begin's until gdn_st_commit), so an
 * interrupted write leaves the previous file and no temporary one. */
GDN_API void gdn_st_remove_temporaries(void);

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
GDN_API int gdn_layer_weights_load(gdn_layer_weights *lw, const char *path, const char *config_path,
                           const char *prefix, const gdn_layer_config *given);
GDN_API void gdn_layer_weights_free(gdn_layer_weights *lw);
/* Keep the weights as BF16 in memory (inference: half the bytes each decode step streams):
 * rounds to nearest even (exact for a BF16 checkpoint), frees the fp32 copy and sets
 * cfg.weight_dtype = GDN_BF16. */
GDN_API int gdn_layer_weights_to_bf16(gdn_layer_weights *lw);
/* The flat parameters to pass to the layer: w or w_bf16, as cfg.weight_dtype says. */
GDN_API const void *gdn_layer_weights_data(const gdn_layer_weights *lw);
/* Add gradients dw (flat, split layout) to a writer as name_prefix + the name each weight was
 * loaded under, without the file's prefix: fused checkpoints get in_proj_qkvz.weight and
 * in_proj_ba.weight in their interleaved order. dw NULL reserves them (gdn_st_writer_begin). */
GDN_API int gdn_layer_grads_add(gdn_st_writer *wr, const gdn_layer_weights *lw, const float *dw,
                        const char *name_prefix);

/* Qwen3-Next's fused projections against Qwen3.5's split ones (one map for reading, writing and
 * gradients): in_proj_qkvz ([2 Hk K + 2 Hv V, E], GDN_FUSED_QKVZ) holds in_proj_qkv's and
 * in_proj_z's rows, in_proj_ba ([2 Hv, E], GDN_FUSED_BA) in_proj_b's and in_proj_a's, interleaved
 * per key head. gdn_layer_unfuse scatters a fused tensor into the flat split parameters w
 * (gdn_layer_param's layout; the other parameters untouched), gdn_layer_fuse gathers it
 * back. */
enum { GDN_FUSED_QKVZ, GDN_FUSED_BA, GDN_FUSED_COUNT };
/* The fused tensor's name ("in_proj_qkvz.weight", "in_proj_ba.weight"), shape [rows, E] and numel
 * into *info (offset 0: it is not in the flat array); GDN_ERR_ARG for another `fused`. */
GDN_API int gdn_layer_fused(const gdn_layer_config *c, int fused, gdn_param_info *info);
GDN_API int gdn_layer_unfuse(const gdn_layer_config *c, int fused, const float *src, float *w);
GDN_API int gdn_layer_fuse(const gdn_layer_config *c, int fused, const float *w, float *dst);

/* ---------------------------------------------------------------- attention weights
 * One gated full-attention layer's weights (Qwen3.5 / Qwen3-Next `self_attn`), bare
 * ("q_proj.weight") or under a prefix ("model.layers.3.self_attn."), F32, F64 or BF16 on disk.
 * Dimensions from config_path (config.json, or its "text_config": hidden_size,
 * num_attention_heads, num_key_value_heads, head_dim (absent: hidden_size / num_attention_heads),
 * partial_rotary_factor and rope_theta (at the top level or in rope_parameters / rope_scaling,
 * which must be the default RoPE or text-only M-RoPE), rms_norm_eps, max_position_embeddings)
 * when given, the file's __metadata__ (E, H, Hkv, d, R, rope_theta, rms_norm_eps,
 * max_position), `given` (fields > 0; may be NULL: start from a zeroed struct, not
 * gdn_attn_config_default's) and the tensor shapes; every source that states a value must agree
 * with the others. Unstated: with a config, partial_rotary_factor 0.25, theta 10000 and eps 1e-6
 * (transformers' Qwen3-Next config defaults); without one, gdn_attn_config_default's R and theta
 * (1e7); max_position 0 (unchecked). R = int(d * partial_rotary_factor) must be even. Under the
 * prefix, missing, unknown or mis-shaped tensors are errors naming the weight. */
typedef struct {
    gdn_attn_config cfg; /* E, H, Hkv, d, R, rope_theta, eps, max_position; B = T = 0 */
    float *w;            /* flat fp32 parameters (gdn_attn_param_floats(&cfg)) */
    gdn_dtype dtype;     /* dtype of q_proj on disk */
} gdn_attn_weights;
GDN_API int gdn_attn_weights_load(gdn_attn_weights *aw, const char *path, const char *config_path,
                                  const char *prefix, const gdn_attn_config *given);
GDN_API void gdn_attn_weights_free(gdn_attn_weights *aw);
/* Add gradients dw (flat) to a writer as name_prefix + each weight's name; dw NULL reserves
 * them (gdn_st_writer_begin). */
GDN_API int gdn_attn_grads_add(gdn_st_writer *wr, const gdn_attn_weights *aw, const float *dw,
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

/* Read and validate. want_grads: also read "do" (required) and "dht" (optional). Tokens
 * [t_begin, t_begin + count) only (a context-parallel shard; count < 0: every row, t_begin 0):
 * shapes are checked against the whole file, only the shard's rows are read; h0 and dht whole.
 * n_docs >= 1: packed documents: B must be 1, and h0 and dht, when present, are per document,
 * [n_docs, Hv, K, V] (0: dense). The offsets themselves are the caller's (the file's
 * "cu_seqlens" tensor: gdn_st_read_ints). */
GDN_API int gdn_problem_load(gdn_problem *pb, const char *path, int want_grads, int64_t t_begin, int64_t count,
                             int64_t n_docs);
GDN_API void gdn_problem_free(gdn_problem *pb);

/* Write named f32 tensors atomically. */
typedef struct {
    const char *name;
    int ndim;
    int64_t shape[4];
    const float *data;
} gdn_named_tensor;
GDN_API int gdn_save_tensors(const char *path, const gdn_named_tensor *t, int n, const char *tool);

#ifdef __cplusplus
}
#endif
#endif /* GDNCP_IO_H */
