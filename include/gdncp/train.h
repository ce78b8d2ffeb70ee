/* The trainer over MPI (libgdncp_mpi): the model (model.h) trained on a DP x CP grid of ranks,
 * with AdamW (optim.h), the data (data.h) and checkpoints (checkpoint.h). */
#ifndef GDNCP_TRAIN_H
#define GDNCP_TRAIN_H

#include <stdio.h>

#include "cp.h"
#include "ep.h"
#include "model.h"
#include "optim.h"
#include "data.h"
#include "checkpoint.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * The training loop: the language model above on byte text or a token file, its sequences split over a
 * DP x CP grid of MPI ranks, AdamW, checkpoints in Hugging Face's layout, progress lines and a
 * CSV log.
 *
 * Grid: ranks [g*cp, (g+1)*cp) form CP group g (one sequence per row, sharded contiguously in
 * rank order); the DP index is g = rank / cp. With expert parallelism (ep > 1) ranks [e*ep,
 * (e+1)*ep) also form expert group e: rank r holds slice r % ep of every MoE layer's experts, the
 * experts' gradients are summed over the ranks holding the same slice and everything else's over
 * the whole grid; checkpoints hold transformers' layout, each rank writing its own slices into
 * them. Every rank reads only its own rows' shard of the text. Weight gradients are summed over
 * the whole grid (reduce-scattered onto each slice's owner and, below zero = 2, all-gathered back:
 * every rank applies bit-identical updates). Deterministic for a given seed and grid: the text
 * windows are a function of (seed, step, row), so a resumed run repeats the uninterrupted one.
 *
 * Packing (--pack SEP, or --pack-id N for one id): the data is documents each ending with SEP; a window holds whatever
 * documents (or parts) fall in it, the state and the conv restart at each document start, and
 * the loss is the mean over the targets inside documents (over the whole grid).
 */



typedef struct {
    gdn_model_config model; /* with init/resume the checkpoint's config is used: then model must
                               agree with it where model_explicit is set */
    int model_explicit;     /* which of model's fields were given (GDN_GIVEN_* bits; --model: all):
                               with init / resume, a given field that differs from the checkpoint's
                               is refused, naming it; the others take the checkpoint's */
    double router_aux_coef; /* MoE models: the aux loss's coefficient over the model's (-1: the model's
                               router_aux / router_aux_coef; 0: off; > 0: on with this coefficient) */
    int attn_cp;            /* the attention layers' CP strategy: GDN_ATTN_CP_KV or GDN_ATTN_CP_HEADS */
    int compute;            /* GDN_COMPUTE_FP32 or GDN_COMPUTE_BF16 (the model's products; gdn_model_run) */
    const char *data;       /* byte text or token file */
    double val_fraction;    /* its last fraction is the validation split */
    int64_t seq;            /* tokens per sequence (the whole sequence, before the CP split) */
    int64_t batch;          /* sequences per DP group per step */
    int64_t steps;          /* train until this step */
    gdn_adamw_config opt;
    uint64_t seed;
    int cp;                 /* ranks per sequence (divides the world size) */
    int ep;                 /* expert parallelism (ep.h): the MoE layers' experts split over groups of
                               ep consecutive ranks, each rank holding (and training) n_experts / ep
                               of them, replicated across the groups; 0 or 1: every rank holds every
                               expert. Divides the world size and n_experts, and divides --cp or is
                               a multiple of it */
    int zero;               /* the training state sharded over the ranks replicating it (DESIGN
                               §15): 0 replicated; 1 the AdamW moments (each rank updates its
                               slice, then the weights are all-gathered); 2 also the gradients
                               (reduce-scattered to their slices' owners); 3 also the weights
                               (each unit all-gathered just before the model reads it) */
    int dry_run;            /* plan only: check and agree the options, the model and the memory, print
                               each rank's memory, allocate nothing large, train nothing */
    int strategy;           /* gdn_cp_strategy */
    int threads;            /* per rank (0: the cores divided among the ranks on this node) */
    int recompute;          /* -1: when the kept activations would not fit; 0; 1 */
    const char *out;        /* checkpoint directory (NULL: none written) */
    int64_t save_every;     /* 0: only at the end */
    int keep_last;          /* checkpoints kept (<= 0: all) */
    int save_dtype;         /* model.safetensors' weights: 0 F32 (default) or 2 BF16 (--save-dtype;
                               gdn_ckpt_save with GDN_BF16: the fp32 master weights stay in the optimizer
                               file, so a resume is exact) */
    const char *resume;     /* continue from this checkpoint (or the newest in this directory) */
    const char *init;       /* start from these weights with a fresh optimiser */
    const char *log_csv;    /* per-step CSV (NULL: none) */
    int64_t log_every;      /* a full progress line every N steps (<= 1: every step), at the first
                               and last step and at each validation; the CSV keeps every step */
    int progress_line;      /* between full lines, one status line updated in place (step / total,
                               loss, tokens/s, elapsed and ETA; for a terminal) */
    int64_t eval_every;     /* validation loss every N steps and at the end (0: never) */
    int64_t eval_seqs;      /* validation sequences (rounded up to whole DP batches) */
    const uint8_t *pack;    /* packed documents: the bytes that end a document (NULL: none; byte
                               text only) */
    int pack_len;           /*   their count (1..GDN_DATA_MAX_SEP); the state and the conv restart
                               after each, and the byte after one is not predicted */
    int pack_by_id;         /* packed documents ending with the one id pack_id (--pack-id; byte
                               text or token file; excludes pack) */
    gdn_token pack_id;
} gdn_train_options;

enum {
    GDN_GIVEN_VOCAB = 1 << 0, GDN_GIVEN_HIDDEN = 1 << 1, GDN_GIVEN_LAYERS = 1 << 2, GDN_GIVEN_INTERMEDIATE = 1 << 3,
    GDN_GIVEN_KEY_HEADS = 1 << 4, GDN_GIVEN_VALUE_HEADS = 1 << 5, GDN_GIVEN_KEY_DIM = 1 << 6,
    GDN_GIVEN_VALUE_DIM = 1 << 7, GDN_GIVEN_CONV = 1 << 8, GDN_GIVEN_ATTN_HEADS = 1 << 9, GDN_GIVEN_KV_HEADS = 1 << 10,
    GDN_GIVEN_HEAD_DIM = 1 << 11, GDN_GIVEN_LAYER_TYPES = 1 << 12, GDN_GIVEN_EXPERTS = 1 << 13,
    GDN_GIVEN_EXPERTS_PER_TOK = 1 << 14, GDN_GIVEN_MOE_INTERMEDIATE = 1 << 15, GDN_GIVEN_SHARED_INTERMEDIATE = 1 << 16,
    GDN_GIVEN_ALL = (1 << 17) - 1
};
GDN_API gdn_train_options gdn_train_defaults(void);
/* Train. Progress lines go to `progress` on world rank 0 (NULL: quiet). Collective over world:
 * every rank returns the same status. */
GDN_API int gdn_train(MPI_Comm world, const gdn_train_options *o, FILE *progress);
/* A digest of every byte of a checkpoint directory's weight files (model.safetensors, or the
 * shards model-*-of-*.safetensors, in name order): what ranks each given a checkpoint agree on, since
 * under expert parallelism a rank reads only its own experts. -1 when one cannot be read. Not
 * collective. */
GDN_API int64_t gdn_train_checkpoint_digest(const char *dir);
/* A rank that cannot even build its options (a bad command line) joins the other ranks' first
 * agreement step with this failure, so that they stop with it instead of waiting. Collective. */
GDN_API int gdn_train_fail(MPI_Comm world, int status);

#ifdef __cplusplus
}
#endif
#endif /* GDNCP_TRAIN_H */
