/*
 * The decoder language model gdncp trains (DESIGN §5): a Qwen3.5-style stack built only from
 * GatedDeltaNet token mixers over a byte vocabulary.
 *
 *   embed -> L x [ zero-centred RMSNorm -> GatedDeltaNet -> + residual
 *                  -> zero-centred RMSNorm -> SwiGLU MLP -> + residual ] -> RMSNorm -> lm_head
 *
 * Parameters (and gradients, and AdamW's moments) are one flat fp32 array; every tensor has a
 * Hugging Face Qwen3.5 name ("model.layers.3.mlp.up_proj.weight") and PyTorch [out, in] shape,
 * listed by gdn_model_tensor(). Each layer's GatedDeltaNet weights are one contiguous block in the
 * layer's own flat layout (gdn_layer_param_offset), so the layer runs on them in place.
 *
 * Above src/model: uses the layer and, for a sequence split over ranks, its CP form.
 */
#ifndef GDNCP_TRAIN_MODEL_H
#define GDNCP_TRAIN_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "gdncp.h"
#include "gdncp_cp.h"

typedef struct {
    int64_t vocab;         /* 256: bytes */
    int64_t E;             /* hidden_size */
    int64_t L;             /* num_hidden_layers */
    int64_t I;             /* intermediate_size (SwiGLU) */
    int64_t Hk, Hv, K, V;  /* linear_num_key_heads, linear_num_value_heads, _key_head_dim, _value_head_dim */
    int64_t Kc;            /* linear_conv_kernel_dim */
    float eps;             /* rms_norm_eps (every norm) */
    int tie_embeddings;    /* 0: lm_head has its own weight (the only form written today) */
} gdn_model_config;

/* Named sizes: "tiny" (demo, tests), "small", "long" (the million-token run). 0 if unknown. */
int gdn_model_config_named(const char *name, gdn_model_config *cfg);
int gdn_model_config_check(const gdn_model_config *cfg);
/* The layer configuration of one GatedDeltaNet mixer for B rows of T tokens. */
gdn_layer_config gdn_model_layer_config(const gdn_model_config *cfg, int64_t B, int64_t T);

/* The tensor table: every parameter with its Hugging Face name, shape, place in the flat
 * array and whether AdamW decays it (matrices and conv taps; not norms, A_log, dt_bias). */
typedef struct {
    char name[96];
    int ndim;
    int64_t shape[3];
    size_t offset, numel;
    int decay;
} gdn_model_tensor_info;
int gdn_model_tensor_count(const gdn_model_config *cfg);
int gdn_model_tensor(const gdn_model_config *cfg, int i, gdn_model_tensor_info *info);
size_t gdn_model_param_floats(const gdn_model_config *cfg); /* the whole flat array */
size_t gdn_model_param_count(const gdn_model_config *cfg);  /* real parameters (no padding) */
/* Offset of layer l's GatedDeltaNet block (gdn_layer_param_floats of the layer config). */
size_t gdn_model_layer_offset(const gdn_model_config *cfg, int64_t l);

/* Qwen-style initialisation from a seed (DESIGN §5): normal(0, 0.02) matrices, zero-centred norm
 * weights 0, gated-norm weights 1, dt_bias 1, A_log = log U(1e-3?, 16], conv taps U(+-1/sqrt(Kc)). */
void gdn_model_init(const gdn_model_config *cfg, float *w, uint64_t seed);

/* A plan for B sequences of T tokens on this rank (its shard of each, when cp spans several
 * ranks: rank order is token order). cp may be NULL (one rank). recompute: keep only each
 * block's input in the forward and recompute the block in the backward. */
typedef struct gdn_model_plan gdn_model_plan;
typedef struct {
    int64_t B, T;   /* rows, tokens of this rank's shard */
    int threads;    /* 0: all */
    int recompute;  /* 0: keep activations; 1: per-block recompute */
    int check_finite;
    int pack;       /* packed documents: gdn_model_set_docs before every forward */
} gdn_model_run;
int gdn_model_plan_create(gdn_model_plan **plan, const gdn_model_config *cfg,
                          const gdn_model_run *run, gdn_cp *cp);
void gdn_model_plan_destroy(gdn_model_plan *plan);
/* Bytes the plan holds (workspace + kept activations). */
double gdn_model_plan_bytes(const gdn_model_plan *plan);
/* Bytes a plan would hold, without making it (for choosing recompute). */
double gdn_model_plan_estimate(const gdn_model_config *cfg, const gdn_model_run *run);

/* The language-model loss on tokens [B, T+1] (inputs are tokens[., 0..T), targets
 * tokens[., 1..T]; under CP each rank passes its shard plus the next token). loss_sum receives the
 * sum over this rank's B*T tokens of -log p(target). for_backward: also keep what
 * gdn_model_backward needs (and form the loss head's gradient, scaled by 1 / denom, with the
 * loss). Collective over cp. */
int gdn_model_forward(gdn_model_plan *plan, const float *w, const uint8_t *tokens, double denom,
                      double *loss_sum, int for_backward);
/* Packed documents (run.pack): the documents of this step's rows, before gdn_model_forward.
 * Row b's window is the tokens [0, T_full] of its whole sequence (T_full: its tokens over every
 * CP rank; this rank holds [seq_offset, seq_offset + T) plus the next one). doc_cu lists, row
 * after row, n_docs[b] + 1 offsets of the documents in that window: 0, each document start,
 * T_full + 1. The recurrent state and the conv restart at every document start, and a target
 * that starts a document is not predicted (no loss, no gradient: the loss stays inside
 * documents). *targets receives the predicted targets of this rank's rows (for denom). */
int gdn_model_set_docs(gdn_model_plan *plan, const int64_t *doc_cu, const int64_t *n_docs,
                       int64_t seq_offset, int64_t *targets);
/* dw (flat, overwritten): the gradient of (sum of every rank's loss_sum) / denom, this rank's
 * share (sum it over the ranks), for the preceding gdn_model_forward(..., for_backward = 1) on
 * the same tokens. Collective over cp. */
int gdn_model_backward(gdn_model_plan *plan, const float *w, float *dw, const uint8_t *tokens);
/* Logits [B, T, vocab] of the inputs tokens [B, T] (forward only, tests). Collective over cp. */
int gdn_model_logits(gdn_model_plan *plan, const float *w, const uint8_t *tokens, float *logits);

/* Generation: per-sequence recurrent caches for B sequences, one token at a time. */
typedef struct gdn_model_decoder gdn_model_decoder;
int gdn_model_decoder_create(gdn_model_decoder **dec, const gdn_model_config *cfg, int64_t B,
                             int threads);
void gdn_model_decoder_destroy(gdn_model_decoder *dec);
/* Feed tokens[b] for each sequence; logits [B, vocab] of the next token. */
int gdn_model_decode(gdn_model_decoder *dec, const float *w, const uint8_t *tokens, float *logits);

#endif
