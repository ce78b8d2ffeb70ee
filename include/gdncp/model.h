/* The hybrid GatedDeltaNet language model over token ids: its configuration, parameter table,
 * training forward and backward (on one process, or over the ranks of a gdn_cp context made by
 * libgdncp_mpi: cp.h), and the decoder that generates. No MPI here: a program that trains or
 * decodes on one process includes this header and links libgdncp alone. */
#ifndef GDNCP_MODEL_H
#define GDNCP_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "attention.h"
#include "layer.h"
#include "moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A context-parallel group (cp.h, libgdncp_mpi): opaque here. Every `gdn_cp *cp` below may be
 * NULL, for one process. */
typedef struct gdn_cp gdn_cp;

/*
 * The decoder language model gdncp trains and runs (DESIGN §5): Qwen3.5's hybrid stack over a
 * vocabulary of any size (token ids gdn_token in [0, vocab); the named configurations read bytes,
 * vocab 256, and Qwen3.5's own has 248,320). Each layer's token mixer is a GatedDeltaNet
 * ("linear_attention") or a gated full-attention layer ("full_attention", attention.h), chosen
 * per layer:
 *
 *   embed -> L x [ zero-centred RMSNorm -> mixer (GatedDeltaNet | gated attention) -> + residual
 *                  -> zero-centred RMSNorm -> MLP (SwiGLU | sparse MoE, moe.h) -> + residual ]
 *         -> RMSNorm -> lm_head
 *
 * Parameters (and gradients, and AdamW's moments) are one flat fp32 array; every tensor has a
 * Hugging Face Qwen3.5 name ("model.layers.3.mlp.up_proj.weight", "model.layers.3.self_attn.
 * q_proj.weight") and PyTorch [out, in] shape, listed by gdn_model_tensor(). Each layer's mixer
 * weights are one contiguous block in the mixer's own flat layout (gdn_layer_param's offsets or
 * gdn_attn_param's), so the mixer runs on them in place. A tied model (tie_embeddings) has
 * no lm_head tensor: the head reads the embedding, whose gradient sums both uses.
 *
 * Above src/layer: uses both mixers and, for a sequence split over ranks, their CP forms.
 */

/* A token id: 32 bits, in [0, vocab) (a byte text's ids are its bytes, 0..255). Every model entry
 * point refuses an id outside the vocabulary (GDN_ERR_ARG, naming the row, position and id) on
 * every rank of a CP group alike. */
typedef int32_t gdn_token;
/* The largest vocabulary a model may have (ids are int32; vocab x E fp32 must stay addressable). */
#define GDN_MODEL_MAX_VOCAB ((int64_t)1 << 30)

/* The most layers a model may have (gdn_model_config.full_attention's size). */
#define GDN_MODEL_MAX_LAYERS 1024

typedef struct {
    int64_t vocab;         /* vocab_size, 1..GDN_MODEL_MAX_VOCAB (256: bytes) */
    int64_t E;             /* hidden_size */
    int64_t L;             /* num_hidden_layers, 1..GDN_MODEL_MAX_LAYERS */
    int64_t I;             /* intermediate_size (SwiGLU) */
    int64_t Hk, Hv, K, V;  /* linear_num_key_heads, linear_num_value_heads, _key_head_dim, _value_head_dim */
    int64_t Kc;            /* linear_conv_kernel_dim */
    float eps;             /* rms_norm_eps (every norm) */
    int tie_embeddings;    /* tie_word_embeddings: lm_head is the embedding (no tensor of its own) */
    /* The gated full-attention layers (read only when some layer is one; 0 in a GatedDeltaNet-only
     * model, as in the named configurations): */
    int64_t H, Hkv, d;     /* num_attention_heads, num_key_value_heads, head_dim */
    int64_t R;             /* rotary dims: int(head_dim * partial_rotary_factor), even */
    double rope_theta;     /* rope_parameters.rope_theta */
    int64_t max_position;  /* max_position_embeddings (0: no limit; saved as 32768, transformers
                              needs a value, and a model with 0 loads any) */
    /* layer_types: full_attention[l] = 1 where layer l is "full_attention", 0 for
     * "linear_attention"; entries from L on must be 0. */
    unsigned char full_attention[GDN_MODEL_MAX_LAYERS];
    /* The sparse mixture-of-experts MLPs (moe.h; DESIGN §13), read only where some layer has one
     * (all 0 in a dense model): */
    int64_t n_experts;     /* num_experts */
    int64_t top_k;         /* num_experts_per_tok */
    int64_t moe_I;         /* moe_intermediate_size */
    int64_t shared_I;      /* shared_expert_intermediate_size (0: no shared expert) */
    int norm_topk;         /* renormalise the chosen experts' weights (Qwen3.5-MoE: 1; Qwen3-Next:
                              norm_topk_prob) */
    int router_aux;        /* output_router_logits: the training loss adds router_aux_coef x the
                              load-balancing loss (gdn_model_aux_loss) */
    double router_aux_coef;/* router_aux_loss_coef */
    /* moe[l] = 1 where layer l's MLP is the sparse MoE block, 0 for the dense SwiGLU MLP of
     * intermediate_size (I; unused, may be 0, when every layer is MoE); entries from L on 0. */
    unsigned char moe[GDN_MODEL_MAX_LAYERS];
    /* Expert parallelism (ep.h, libgdncp_mpi): not the model's but this process's share of it.
     * The routed experts of every MoE layer split over ep_size ranks, this process holding slice
     * ep_rank (experts [ep_rank n_experts / ep_size, (ep_rank + 1) n_experts / ep_size)): the
     * parameter layout (and gradients, and moments) then holds only those experts' rows of
     * experts.gate_up_proj and experts.down_proj. 0 or 1: every expert (config.json never sets
     * it). ep_size must divide n_experts, and the model must have MoE layers. */
    int64_t ep_size, ep_rank;
} gdn_model_config;

/* Memory for a model's flat arrays (weights, gradients, AdamW moments) as the trainer allocates
 * them: 64-byte aligned, and from 2 MiB on in transparent huge pages where Linux grants them
 * (the GEMMs stream these arrays; 4 KiB pages cost TLB misses). zeroed: cleared. Release with
 * free(); NULL when out of memory. */
GDN_API void *gdn_model_alloc(size_t bytes, int zeroed);

/* Named sizes: "tiny" (demo, tests), "small", "long" (the long runs), hybrid like Qwen3.5: layer l
 * is full attention when (l + 1) % GDN_MODEL_NAMED_ATTN_INTERVAL == 0 (docs/training.md lists
 * their dimensions). 0 if unknown. */
#define GDN_MODEL_NAMED_ATTN_INTERVAL 4
GDN_API int gdn_model_config_named(const char *name, gdn_model_config *cfg);
GDN_API int gdn_model_config_check(const gdn_model_config *cfg);
/* The layer configuration of one GatedDeltaNet mixer for B rows of T tokens. */
GDN_API gdn_layer_config gdn_model_layer_config(const gdn_model_config *cfg, int64_t B, int64_t T);
/* ... and of one gated attention mixer (dense, seq_offset 0, CP strategy kv). */
GDN_API gdn_attn_config gdn_model_attn_config(const gdn_model_config *cfg, int64_t B, int64_t T);
/* ... and of one sparse MoE MLP for N token rows (the model's moe fields; threads all, checks on). */
GDN_API gdn_moe_config gdn_model_moe_config(const gdn_model_config *cfg, int64_t N);
/* The kinds of layer gdn_model_count_layers counts. */
enum { GDN_MODEL_ATTN_LAYERS = 0, /* full attention (the others, L minus these: GatedDeltaNet) */
       GDN_MODEL_MOE_LAYERS = 1   /* those whose MLP is the sparse MoE block (the others: dense SwiGLU) */ };
/* Layers of `kind` among the model's L (full_attention[] / moe[]); -1 (with gdn_fail) for a NULL
 * cfg or another kind. */
GDN_API int64_t gdn_model_count_layers(const gdn_model_config *cfg, int kind);
/* Transformers' default layer_types (no layer_types in config.json): layer l is full attention
 * when (l + 1) % interval == 0 (full_attention_interval, 4 in Qwen3.5); interval <= 0 or
 * > L: none. Sets full_attention[0..GDN_MODEL_MAX_LAYERS). */
GDN_API void gdn_model_set_attention_interval(gdn_model_config *cfg, int64_t interval);

/* The tensor table: every parameter with its Hugging Face name, shape, place in the flat
 * array and whether AdamW decays it (matrices and conv taps; not norms, A_log, dt_bias). */
typedef struct {
    char name[96];
    int ndim;
    int64_t shape[3];
    size_t offset, numel;
    int decay;
    /* A routed experts' tensor (experts.gate_up_proj, experts.down_proj: dimension 0 indexes the
     * experts): experts_whole = n_experts, and this array holds experts [expert_first,
     * expert_first + shape[0]) of them (all but under expert parallelism). 0, 0 otherwise. */
    int64_t experts_whole, expert_first;
} gdn_model_tensor_info;
GDN_API int gdn_model_tensor_count(const gdn_model_config *cfg);
GDN_API int gdn_model_tensor(const gdn_model_config *cfg, int i, gdn_model_tensor_info *info);
GDN_API size_t gdn_model_param_floats(const gdn_model_config *cfg); /* the whole flat array */
GDN_API size_t gdn_model_param_count(const gdn_model_config *cfg);  /* real parameters (no padding) */
/* Offset of layer l's mixer block: its GatedDeltaNet weights (gdn_layer_param_floats of the
 * layer config) or, for a full-attention layer, its attention weights (gdn_attn_param_floats). */
GDN_API size_t gdn_model_layer_offset(const gdn_model_config *cfg, int64_t l);

/* Qwen-style initialisation from a seed (DESIGN §5): normal(0, 0.02) matrices, zero-centred norm
 * weights 0, gated-norm weights 1, dt_bias 1, A_log = log U(1e-3?, 16], conv taps U(+-1/sqrt(Kc)). */
GDN_API void gdn_model_init(const gdn_model_config *cfg, float *w, uint64_t seed);
/* The same values for the flat elements [lo, hi) only, into w (from w[0]): a sharded trainer's
 * slice, without the whole array. */
GDN_API void gdn_model_init_range(const gdn_model_config *cfg, float *w, uint64_t seed, size_t lo, size_t hi);

/* A plan for B sequences of T tokens on this rank (its shard of each, when cp spans several
 * ranks: rank order is token order). cp may be NULL (one rank). recompute: keep only each
 * block's input in the forward and recompute the block in the backward. Attention layers under
 * CP need this shard's first token in the sequence (global RoPE positions, the causal mask): a
 * dense plan learns it at its first forward from the ranks' T (an exclusive scan over cp), a
 * packed one from gdn_model_set_docs. */
typedef struct gdn_model_plan gdn_model_plan;
typedef struct {
    int64_t B, T;   /* rows, tokens of this rank's shard */
    int threads;    /* 0: all */
    int recompute;  /* 0: keep activations; 1: per-block recompute */
    int check_finite;
    int pack;       /* packed documents: gdn_model_set_docs before every forward */
    int attn_cp;    /* under CP, the attention layers' strategy: GDN_ATTN_CP_KV (0, default) or
                       GDN_ATTN_CP_HEADS (the rank count must divide H; attention.h) */
    int compute;    /* GDN_COMPUTE_FP32 (0, default) or GDN_COMPUTE_BF16 (compute.h): every
                       projection, the MLP and lm_head (forward and backward) with bf16
                       operands; the loss, norms, the mixers' own arithmetic stay fp32 */
    int rule_cp;    /* under CP, the GatedDeltaNet layers' strategy: a gdn_cp_strategy
                       (kernel.h; GDN_CP_SCAN, 0, default) */
} gdn_model_run;
GDN_API int gdn_model_plan_create(gdn_model_plan **plan, const gdn_model_config *cfg,
                          const gdn_model_run *run, gdn_cp *cp);
GDN_API void gdn_model_plan_destroy(gdn_model_plan *plan);
/* An expert-parallel group (ep.h, libgdncp_mpi): opaque here. */
typedef struct gdn_ep gdn_ep;
/* The group the MoE layers' experts are split over, for a model whose cfg.ep_size > 1 (its size
 * and this rank's place in it must be cfg.ep_size and cfg.ep_rank); before the first forward.
 * Every forward and backward is then collective over the group as well (DESIGN §14). */
GDN_API int gdn_model_plan_set_experts(gdn_model_plan *plan, gdn_ep *ep);
/* The flat parameter array cut into units: 0 the embedding, 1 + l layer l, L + 1 the final norm
 * and lm_head (with tied embeddings lm_head is unit 0's tensor); unit u is [gdn_model_unit_offset(cfg,
 * u), gdn_model_unit_offset(cfg, u + 1)). The units a sharded trainer gathers one at a time. */
/* The first float of unit u (0 <= u <= L + 2; unit L + 2 is the end, gdn_model_param_floats). */
GDN_API size_t gdn_model_unit_offset(const gdn_model_config *cfg, int64_t u);

/* Bytes the plan holds (workspace + kept activations). */
GDN_API double gdn_model_plan_bytes(const gdn_model_plan *plan);
/* Bytes a plan would hold, without making it (for choosing recompute). */
GDN_API double gdn_model_plan_estimate(const gdn_model_config *cfg, const gdn_model_run *run);

/* The language-model loss on tokens [B, T+1] (inputs are tokens[., 0..T), targets
 * tokens[., 1..T]; under CP each rank passes its shard plus the next token). loss_sum receives the
 * sum over this rank's B*T tokens of -log p(target). for_backward: also keep what
 * gdn_model_backward needs (and form the loss head's gradient, scaled by 1 / denom, with the
 * loss). Every id, inputs and targets, must lie in [0, vocab) (checked first, agreed over cp).
 * The loss head runs in row chunks whose logits stay within 64 MiB: no [B*T, vocab] array.
 * Collective over cp. */
GDN_API int gdn_model_forward(gdn_model_plan *plan, const float *w, const gdn_token *tokens, double denom,
                      double *loss_sum, int for_backward);
/* Packed documents (run.pack): the documents of this step's rows, before gdn_model_forward.
 * Row b's window is the tokens [0, T_full] of its whole sequence (T_full: its tokens over every
 * CP rank; this rank holds [seq_offset, seq_offset + T) plus the next one). doc_cu lists, row
 * after row, n_docs[b] + 1 offsets of the documents in that window: 0, each document start,
 * T_full + 1. The recurrent state and the conv restart at every document start, and a target
 * that starts a document is not predicted (no loss, no gradient: the loss stays inside
 * documents). *targets receives the predicted targets of this rank's rows (for denom). */
GDN_API int gdn_model_set_docs(gdn_model_plan *plan, const int64_t *doc_cu, const int64_t *n_docs,
                       int64_t seq_offset, int64_t *targets);
/* The mixture-of-experts aux loss (transformers' load_balancing_loss_func over every MoE layer's
 * router, DESIGN §13): a forward counts each router's choices and sums its probabilities over its
 * rows; stats = [count[n_experts] | prob[n_experts] | rows] (2 n_experts + 1 doubles).
 * gdn_model_router_stats gives this rank's rows' of the last forward; the plan itself holds them
 * summed over its CP group. A caller that splits the batch further (data parallelism) sums every
 * rank's and hands the grid's sums back with gdn_model_set_router_stats before the backward, so
 * that the aux loss and its gradient are the whole batch's. gdn_model_aux_loss: the aux loss of
 * the statistics the plan holds (0 without MoE layers); the training loss is loss_sum / denom +
 * router_aux_coef x it when cfg.router_aux, whose gradient gdn_model_backward then includes. */
GDN_API int gdn_model_router_stats(const gdn_model_plan *plan, double *stats);
GDN_API int gdn_model_set_router_stats(gdn_model_plan *plan, const double *stats);
GDN_API double gdn_model_aux_loss(const gdn_model_plan *plan);
/* The experts' load: counts [MoE layers][n_experts] receives the (token, slot) choices of every
 * expert of each MoE layer (in layer order) over this rank's rows of the training forwards
 * (for_backward) since the plan was made or last reset (reset: zero them after reading). */
GDN_API int gdn_model_expert_load(gdn_model_plan *plan, double *counts, int reset);
/* dw (flat, overwritten): the gradient of (sum of every rank's loss_sum) / denom, this rank's
 * share (sum it over the ranks), for the preceding gdn_model_forward(..., for_backward = 1) on
 * the same tokens. Collective over cp. */
GDN_API int gdn_model_backward(gdn_model_plan *plan, const float *w, float *dw, const gdn_token *tokens);
/* Logits [B, T, vocab] of the inputs tokens [B, T] (forward only, tests). Collective over cp. */
GDN_API int gdn_model_logits(gdn_model_plan *plan, const float *w, const gdn_token *tokens, float *logits);
/* Wall seconds this plan's forwards and backwards spent in each kind of token mixer since it was
 * made or last reset: out[0], out[1] the GatedDeltaNet layers' forward and backward, out[2],
 * out[3] the attention layers' (their CP exchanges and waits included; a forward recomputed in
 * the backward counts as forward). reset: zero them after reading. The rest of a step (norms,
 * MLPs, the loss head) is its time minus these. */
GDN_API void gdn_model_mixer_seconds(gdn_model_plan *plan, double out[4], int reset);

/* Generation: B sequences fed piece by piece with every layer's cache, so no token is read twice.
 * A GatedDeltaNet layer keeps its conv and recurrent states (layer.h), a full-attention layer its
 * KV cache (attention.h: keys after k_norm and RoPE, positions continue from the cache length).
 * max_len: the most tokens each sequence may be fed in all (prompt + generated); the KV caches
 * are made for it (0: no limit, only for GatedDeltaNet-only models; with attention layers at most
 * max_position when that is set). Decoding one token allocates nothing; a prefill of T > 1 tokens makes that piece
 * length's plans (kept for the next piece of the same length). */
typedef struct gdn_model_decoder gdn_model_decoder;
/* The attention layers' KV caches in cache_dtype: 0 (GDN_F32) or 2 (GDN_BF16: half their memory
 * and of what each decode step reads; gdn_attn_cache_create). */
GDN_API int gdn_model_decoder_create(gdn_model_decoder **dec, const gdn_model_config *cfg, int64_t B,
                                     int64_t max_len, int threads, int cache_dtype);
GDN_API void gdn_model_decoder_destroy(gdn_model_decoder *dec);
/* New sequences: every state and cache emptied (length 0). */
GDN_API void gdn_model_decoder_reset(gdn_model_decoder *dec);
/* Feed the next T tokens of each sequence, tokens [B, T]; logits [B, T, vocab], row (b, t) the
 * logits of the token after tokens[b, t]. Pieces of any sizes give the forward's logits of the
 * whole sequence. An id outside [0, vocab) is refused before anything is fed; on another error
 * the caches may be partly advanced: reset before reusing them. */
GDN_API int gdn_model_prefill(gdn_model_decoder *dec, const float *w, const gdn_token *tokens, int64_t T,
                              float *logits);
/* The same, forming only each sequence's last logits: logits [B, vocab] (those of the token after
 * tokens[b, T - 1]). What generation needs: at a real vocabulary the head over every prompt
 * position is most of a prefill's work. */
GDN_API int gdn_model_prefill_last(gdn_model_decoder *dec, const float *w, const gdn_token *tokens, int64_t T,
                                   float *logits);
/* The precision of the products of pieces of T > 1 tokens (a prefill): GDN_COMPUTE_FP32 (the
 * default) or GDN_COMPUTE_BF16 (compute.h: bf16 operands, fp32 accumulation; the projections, the
 * MLPs and the head, about 1.6x faster where the CPU has BF16 instructions, logits within ~1e-2).
 * A token's decode step stays fp32 either way: it is bound by reading the weights. */
GDN_API int gdn_model_decoder_set_compute(gdn_model_decoder *dec, int compute);
/* The expert-parallel group of a decoder whose cfg.ep_size > 1 (gdn_model_plan_set_experts):
 * every prefill and decode step is then collective over it, each rank feeding its own sequences. */
GDN_API int gdn_model_decoder_set_experts(gdn_model_decoder *dec, gdn_ep *ep);
/* One token: gdn_model_prefill with T = 1 (tokens [B], logits [B, vocab]). */
GDN_API int gdn_model_decode(gdn_model_decoder *dec, const float *w, const gdn_token *tokens, float *logits);
/* The decoder as it stands and layer l's caches themselves (tests, saving a session), writable
 * in place: a full-attention layer's KV cache, or a GatedDeltaNet layer's conv_state
 * [B, conv_dim, Kc] (newest column last) and rec_state [B, Hv, K, V]; the other kind's NULL. */
typedef struct {
    int64_t length;                /* tokens fed so far to each sequence (every layer alike) */
    gdn_attn_cache *kv;            /* full attention: its KV cache (attention.h) */
    float *conv_state, *rec_state; /* GatedDeltaNet: its conv and recurrent states */
} gdn_model_decoder_view;
/* GDN_ERR_ARG (out zeroed) for a NULL decoder or out, or l outside [0, L). */
GDN_API int gdn_model_decoder_layer(gdn_model_decoder *dec, int64_t l, gdn_model_decoder_view *out);

/* Useful FLOPs of one trained token (forward + backward) in a sequence of T tokens: 6 x the
 * non-embedding parameters (a tied embedding counts: it is the head) + the GatedDeltaNet kernel's
 * forward and backward per GatedDeltaNet layer (DESIGN §3's formulas, chunk 64) + per attention
 * layer its causal core, 7 d H (T + 1) (QK^T and PV over the (T + 1) / 2 keys a token sees on
 * average, 4 d H each, x3.5 with the backward, as `gdncp bench attention` counts). Packed
 * documents see fewer keys: T is then an upper bound. */
GDN_API double gdn_model_train_flops_per_token(const gdn_model_config *cfg, int64_t T);
/* The FLOPs of a forward over one sequence of T tokens whose head_rows rows go through the
 * lm_head (a prefill that forms the last logits: 1; every position's: T). */
GDN_API double gdn_model_prefill_flops(const gdn_model_config *cfg, int64_t T, int64_t head_rows);

#ifdef __cplusplus
}
#endif
#endif /* GDNCP_MODEL_H */
