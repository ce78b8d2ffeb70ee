/*
 * The training loop: the language model of model.h on byte text, its sequences split over a
 * DP x CP grid of MPI ranks, AdamW, checkpoints in Hugging Face's layout, progress lines and a
 * CSV log.
 *
 * Grid: ranks [g*cp, (g+1)*cp) form CP group g (one sequence per row, sharded contiguously in
 * rank order); the DP index is g = rank / cp. Every rank reads only its own rows' shard of the
 * text. Weight gradients are summed over the whole grid (reduced on rank 0 and broadcast, so
 * every rank applies bit-identical updates). Deterministic for a given seed and grid: the text
 * windows are a function of (seed, step, row), so a resumed run repeats the uninterrupted one.
 *
 * Packing (--pack SEP): the text is documents each ending with SEP; a window holds whatever
 * documents (or parts) fall in it, the state and the conv restart at each document start, and
 * the loss is the mean over the targets inside documents (over the whole grid).
 */
#ifndef GDNCP_TRAIN_TRAINER_H
#define GDNCP_TRAIN_TRAINER_H

#include <stdint.h>
#include <stdio.h>

#include "model.h"
#include "optim.h"

typedef struct {
    gdn_model_config model; /* ignored with init/resume: the checkpoint's config is used */
    const char *data;       /* text file */
    double val_fraction;    /* its last fraction is the validation split */
    int64_t seq;            /* tokens per sequence (the whole sequence, before the CP split) */
    int64_t batch;          /* sequences per DP group per step */
    int64_t steps;          /* train until this step */
    gdn_adamw_config opt;
    uint64_t seed;
    int cp;                 /* ranks per sequence (divides the world size) */
    int strategy;           /* gdn_cp_strategy */
    int threads;            /* per rank (0: the cores divided among the ranks on this node) */
    int recompute;          /* -1: when the kept activations would not fit; 0; 1 */
    const char *out;        /* checkpoint directory (NULL: none written) */
    int64_t save_every;     /* 0: only at the end */
    int keep_last;          /* checkpoints kept (<= 0: all) */
    const char *resume;     /* continue from this checkpoint (or the newest in this directory) */
    const char *init;       /* start from these weights with a fresh optimiser */
    const char *log_csv;    /* per-step CSV (NULL: none) */
    int64_t eval_every;     /* validation loss every N steps and at the end (0: never) */
    int64_t eval_seqs;      /* validation sequences (rounded up to whole DP batches) */
    const uint8_t *pack;    /* packed documents: the bytes that end a document (NULL: none) */
    int pack_len;           /*   their count (1..GDN_DATA_MAX_SEP); the state and the conv restart
                               after each, and the byte after one is not predicted */
    int fault;              /* testing only: a gdn_cp fault injected into every CP exchange */
} gdn_train_options;

gdn_train_options gdn_train_defaults(void);
/* Train. Progress lines go to `progress` on world rank 0 (NULL: quiet). Collective over world:
 * every rank returns the same status. */
int gdn_train(MPI_Comm world, const gdn_train_options *o, FILE *progress);
/* A rank that cannot even build its options (a bad command line) joins the other ranks' first
 * agreement step with this failure, so that they stop with it instead of waiting. Collective. */
int gdn_train_fail(MPI_Comm world, int status);

/* Peak resident set of this process in MiB. */
double gdn_peak_rss_mb(void);
/* Useful FLOPs of one trained token (forward + backward): 6 x the non-embedding parameters +
 * the GatedDeltaNet kernel's forward and backward per layer (DESIGN §3's formulas, chunk 64). */
double gdn_model_train_flops_per_token(const gdn_model_config *cfg);

#endif
