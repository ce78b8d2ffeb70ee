/* The trainer's files (trainer.c: the loop; trainer_setup.c: the options, the agreement, the set-up;
 * trainer_grid.c: the sums over the grid and the checkpoints; trainer_report.c: the progress
 * reports): what one rank holds while training, and the steps they share. */
#ifndef GDNCP_TRAINER_INTERNAL_H
#define GDNCP_TRAINER_INTERNAL_H

#include "gdncp/train.h"
#include "gdncp/io.h"

#include <dirent.h>
#include <fnmatch.h>
#include <jansson.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <errno.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base.h"
#include "gdncp/attention.h"
#include "model_group.h"

/* A run of the flat parameter array (trainer_shard.c): [lo, hi), shared by the grid (kind 0) or
 * by an expert slice's replicas (kind 1), split over that group's `size` ranks (counts, displs:
 * each rank's slice, relative to lo); this rank (`me` in the group) owns [own_lo, own_hi), whose
 * moments start at `at` of the packed moments (levels >= 1). */
typedef struct {
    size_t lo, hi, own_lo, own_hi, at;
    int kind, size, me;
    int *counts, *displs;
} gdn_shard_run;

/* Levels 2 and 3's schedule of non-blocking collectives (trainer_shard.c's units hook). */
typedef struct {
    int64_t unit;
    int kind;     /* a gather of the weights or a reduce-scatter of the gradient */
    int last_req; /* its requests end here in req */
} gdn_shard_pending;
typedef struct {
    MPI_Request *req;
    int nreq;
    gdn_shard_pending *pend;
    int npend;
    char *gathered;         /* per unit: its weights are in the flat array */
    int dir;                /* the pass's direction (+1 forward, -1 backward) */
    int64_t last_need;      /* the pass's last unit needed (-1: none yet) */
    int keep_embedding;     /* tied embeddings, a forward: unit 0 kept from the embedding to the head */
    int failed, kept_stale; /* a failure agreed at an event; (a test mutation's unit kept) */
} gdn_shard_sched;

/* Everything one rank holds while training. */
typedef struct {
    const gdn_train_options *o;
    MPI_Comm world, cp_comm;
    gdn_cp *agree; /* world-wide agreement of statuses and values */
    gdn_cp *cp;    /* this rank's CP group */
    /* expert parallelism (--ep > 1): the group the experts are split over, the ranks holding the
     * same slice (replicas), and an agreement over those */
    MPI_Comm ep_comm, replica_comm;
    gdn_ep *ep;
    gdn_cp *replica_agree;
    int ep_size, ep_rank;
    int rank, size, dp, dp_index, cp_rank, cp_size;
    int64_t t0, tn; /* this rank's shard of every sequence */
    gdn_model_config cfg;
    size_t nw;
    float *w, *dw, *m, *v; /* m, v: every parameter's (--zero 0) or the owned slices' */
    gdn_shard_run *runs;
    int nruns;
    size_t owned; /* floats in this rank's slices */
    float *w_own, *dw_own; /* this rank's slices of the weights (level 3) and of the summed gradients (2, 3) */
    float *rs_scratch;     /* levels 0, 1: one run's slice of the gradients' sum */
    size_t rs_floats;
    int *unit_first;       /* levels >= 2: unit u's runs are [unit_first[u], unit_first[u + 1]) */
    gdn_shard_sched sched;
    double zero_bytes; /* bytes the sums and gathers moved on this rank (count_bytes) */
    double *router; /* MoE: the routers' statistics, 2 n_experts + 1 (gdn_trainer_grid_router_stats) */
    double *load;   /* MoE: the experts' load, 2 x MoE layers x n_experts (gdn_trainer_expert_load) */
    gdn_model_plan *plan;
    gdn_data *data;
    gdn_data_info data_info; /* what it is (gdn_data_describe, once opened) */
    gdn_token *tokens; /* batch x (tn + 1) */
    gdn_token *window; /* packing: one row's whole window (and the separator's length before it) */
    gdn_token sep[GDN_DATA_MAX_SEP]; /* packing: the separator's ids (--pack's bytes or --pack-id) */
    int sep_len;                     /*   0: not packing */
    int64_t *doc_cu, *n_docs; /* packing: the rows' document offsets (gdn_model_set_docs) */
    int recompute, threads;
    int local, sleep_wait; /* ranks on this node; waits sleep (more threads than cores) */
    char run_id[40];       /* this run's (trainer_state.json "run_id"): drawn by a new run, a resume's
                              continued; its saves replace and prune only checkpoints of this run */
    double mem[6]; /* bytes: weights, gradients, moments (the most of any rank), activations; this node's
                      total, its MemAvailable (-1 unknown) */
    FILE *progress, *csv;
    int status_shown; /* rank 0: a status line (--progress line) is on the terminal */
    double peak_gflops, flops_per_token;
    int64_t first_step;
} trainer;

/* trainer_setup.c */
void gdn_trainer_pack_hex(const gdn_train_options *o, char out[2 * GDN_DATA_MAX_SEP + 1]);
int64_t gdn_trainer_pack_id(const gdn_train_options *o);
int gdn_trainer_setup(trainer *t);
/* trainer_grid.c */
int gdn_trainer_grid_targets(trainer *t, int64_t local, double *denom);
int gdn_trainer_grid_router_stats(trainer *t, double *aux);
double gdn_trainer_world_sum(trainer *t, double x);
/* trainer_shard.c */
int gdn_trainer_shard_setup(trainer *t);
void gdn_trainer_shard_free(trainer *t);
void gdn_trainer_reduce_grads(trainer *t);
double gdn_trainer_grad_norm(trainer *t);
void gdn_trainer_update(trainer *t, int64_t step, double lr, double scale);
int gdn_trainer_load_slices(trainer *t, const char *dir);
int gdn_trainer_units_setup(trainer *t);
void gdn_trainer_init_weights(trainer *t);
void gdn_trainer_keep_slices(trainer *t);
void gdn_trainer_release_weights(trainer *t);
void gdn_trainer_zero_summary(trainer *t, int64_t steps);
int gdn_trainer_save(trainer *t, int64_t step, double loss);
/* trainer_report.c */
void gdn_trainer_fmt_duration(char *buf, size_t n, double secs);
void gdn_trainer_fmt_bytes(char *buf, size_t n, double bytes);
void gdn_trainer_clear_status(trainer *t);
void gdn_trainer_layer_type_times(trainer *t, const double mixer_sum[4], double step_sum, int64_t steps);
void gdn_trainer_expert_load(trainer *t);
void gdn_trainer_ep_summary(trainer *t, int64_t steps);

#endif
