/* The trainer's sums over the grid (train.h): targets, router statistics, gradients (the experts'
 * over their replicas), the gradient norm, and the checkpoints (the experts' slices gathered). */
#include "trainer_internal.h"

/* The trainer's state for a checkpoint: what a resume must find unchanged, and where it was. */
static char *state_json(const trainer *t, int64_t step, double loss) {
    const gdn_train_options *o = t->o;
    char hex[2 * GDN_DATA_MAX_SEP + 1];
    gdn_trainer_pack_hex(o, hex);
    json_t *j = json_pack("{s:I, s:I, s:I, s:I, s:f, s:s, s:I, s:f, s:I, s:I, s:f, s:s, s:I, s:s}", "step",
                          (json_int_t)step, "seed", (json_int_t)o->seed, "seq", (json_int_t)o->seq,
                          "global_batch", (json_int_t)(o->batch * t->dp), "val_fraction",
                          o->val_fraction, "data", o->data, "data_bytes",
                          (json_int_t)(gdn_data_split_len(t->data, GDN_SPLIT_TRAIN) +
                                       gdn_data_split_len(t->data, GDN_SPLIT_VAL)),
                          "loss", loss, "dp", (json_int_t)t->dp, "cp", (json_int_t)t->cp_size,
                          "lr_peak", o->opt.lr, "pack_separator_hex", hex, "pack_separator_id",
                          (json_int_t)gdn_trainer_pack_id(o), "data_kind", t->data_info.tokens ? "tokens" : "text");
    char *s = j ? json_dumps(j, JSON_INDENT(2) | JSON_SORT_KEYS) : NULL;
    json_decref(j);
    return s;
}

/* The targets predicted over the whole grid (the loss's denominator): every token's unless
 * packing leaves out the documents' first bytes. */
int gdn_trainer_grid_targets(trainer *t, int64_t local, double *denom) {
    if (!t->sep_len) {
        *denom = (double)(t->o->batch * t->dp) * (double)t->o->seq;
        return GDN_OK;
    }
    int64_t all = 0;
    MPI_Allreduce(&local, &all, 1, MPI_INT64_T, MPI_SUM, t->world);
    *denom = (double)all;
    return all > 0 ? GDN_OK
                   : gdn_fail(GDN_ERR_SHAPE, "--pack: no token of this step's windows lies inside a document (the "
                              "data is separators only?)");
}

/* The MoE routers' statistics of this step over the whole grid (every rank's rows: DP x CP), so
 * that the aux loss and its gradient are the global batch's (a split run's equal one rank's):
 * one all-reduce of 2 n_experts + 1 doubles; *aux the aux loss (0 without MoE layers). */
int gdn_trainer_grid_router_stats(trainer *t, double *aux) {
    *aux = 0;
    if (!gdn_model_moe_layers(&t->cfg)) return GDN_OK;
    const int ns = (int)(2 * t->cfg.n_experts + 1);
    gdn_model_router_stats(t->plan, t->router); /* (plan and array are set: it cannot fail) */
    if (!gdn_test_mutate("train: the MoE aux loss from each rank alone") &&
        MPI_Allreduce(MPI_IN_PLACE, t->router, ns, MPI_DOUBLE, MPI_SUM, t->world) != MPI_SUCCESS)
        return gdn_fail(GDN_ERR_MPI, "MPI_Allreduce of the routers' statistics failed");
    const int rc = gdn_model_set_router_stats(t->plan, t->router);
    if (!rc) *aux = gdn_model_aux_loss(t->plan);
    return rc;
}

/* Sum of a double over the world. */
double gdn_trainer_world_sum(trainer *t, double x) {
    double s = 0;
    MPI_Allreduce(&x, &s, 1, MPI_DOUBLE, MPI_SUM, t->world);
    return s;
}

/* Reduce on the group's rank 0, then broadcast: every rank of comm gets the same bits (an
 * all-reduce may round differently on different ranks, and the replicas would drift apart). */
static void sum_same_bits(float *x, int n, int rank_in, MPI_Comm comm) {
    if (n <= 0) return;
    MPI_Reduce(rank_in ? x : MPI_IN_PLACE, x, n, MPI_FLOAT, MPI_SUM, 0, comm);
    MPI_Bcast(x, n, MPI_FLOAT, 0, comm);
}

/* The gradients summed where their weights are shared: everything over the grid, and under
 * expert parallelism the routed experts' tensors only over the ranks holding the same slice
 * (each run of the flat array, padding included, goes to one kind of group). */
void gdn_trainer_reduce_grads(trainer *t) {
    if (t->ep_size <= 1) {
        sum_same_bits(t->dw, (int)t->nw, t->rank, t->world);
        return;
    }
    int replica_rank;
    MPI_Comm_rank(t->replica_comm, &replica_rank);
    const int replicas_summed = !gdn_test_mutate("train: expert gradients not summed over their replicas");
    gdn_model_tensor_info ti;
    size_t run = 0; /* the current run starts here */
    int kind = 0;   /* its kind: 0 shared by the grid, 1 an expert slice */
    const int n = gdn_model_tensor_count(&t->cfg);
    for (int i = 0; i <= n; i++) {
        int k = kind;
        size_t at = t->nw;
        if (i < n) {
            gdn_model_tensor(&t->cfg, i, &ti);
            k = ti.experts_whole > 0, at = ti.offset;
        }
        if (i < n && k == kind) continue;
        if (at > run) {
            if (!kind) sum_same_bits(t->dw + run, (int)(at - run), t->rank, t->world);
            else if (replicas_summed) sum_same_bits(t->dw + run, (int)(at - run), replica_rank, t->replica_comm);
        }
        run = at, kind = k;
    }
}

/* The gradient's norm over the whole model: under expert parallelism the experts' part summed
 * over the slices of the expert group (the same bits on every rank). */
double gdn_trainer_grad_norm(trainer *t) {
    double s[2], experts = 0;
    gdn_grad_sumsq(&t->cfg, t->dw, s);
    if (t->ep_size <= 1) return sqrt(s[0] + s[1]);
    MPI_Reduce(&s[1], &experts, 1, MPI_DOUBLE, MPI_SUM, 0, t->ep_comm);
    MPI_Bcast(&experts, 1, MPI_DOUBLE, 0, t->ep_comm);
    return sqrt(s[0] + experts);
}

/* Under expert parallelism a checkpoint still holds every expert (transformers' layout): the first
 * expert group (world ranks [0, ep)) gathers its slices of the weights and moments on rank 0, which
 * holds the whole model only while it saves. whole: the config without the split. */
static int gather_whole(trainer *t, gdn_model_config *whole, float **wf, float **mf, float **vf) {
    *whole = t->cfg;
    whole->ep_size = 0, whole->ep_rank = 0;
    const size_t nwf = gdn_model_param_floats(whole);
    int rc = GDN_OK;
    if (t->rank == 0) {
        *wf = gdn_calloc("trainer_grid: wf", nwf, sizeof(float)), *mf = gdn_calloc("trainer_grid: mf", nwf, sizeof(float)), *vf = gdn_calloc("trainer_grid: vf", nwf, sizeof(float));
        if (!*wf || !*mf || !*vf) rc = gdn_fail(GDN_ERR_NOMEM, "checkpoint: the whole model's weights and moments "
                                                "(3 x %zu floats) to gather the experts' slices into", nwf);
    }
    int worst = rc;
    MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, t->ep_comm);
    if (worst) return rc ? rc : gdn_fail(worst, "checkpoint: rank 0 could not gather the experts' slices");
    gdn_model_tensor_info li, wi;
    float *const local[3] = {t->w, t->m, t->v}, *const all[3] = {*wf, *mf, *vf};
    for (int i = 0; i < gdn_model_tensor_count(&t->cfg); i++) {
        gdn_model_tensor(&t->cfg, i, &li);
        gdn_model_tensor(whole, i, &wi);
        for (int a = 0; a < 3; a++)
            if (li.experts_whole) /* slice r holds experts [r n / ep, (r + 1) n / ep): rank order */
                MPI_Gather(local[a] + li.offset, (int)li.numel, MPI_FLOAT, t->rank ? NULL : all[a] + wi.offset,
                           (int)li.numel, MPI_FLOAT, 0, t->ep_comm);
            else if (t->rank == 0)
                memcpy(all[a] + wi.offset, local[a] + li.offset, sizeof(float) * li.numel);
    }
    return GDN_OK;
}

int gdn_trainer_save(trainer *t, int64_t step, double loss) {
    int rc = GDN_OK;
    gdn_model_config whole = t->cfg;
    float *wf = NULL, *mf = NULL, *vf = NULL;
    if (t->ep_size > 1 && t->rank < t->ep_size) rc = gather_whole(t, &whole, &wf, &mf, &vf);
    if (t->rank == 0 && !rc) {
        char *st = state_json(t, step, loss);
        rc = st ? gdn_ckpt_save(t->o->out, step, &whole, wf ? wf : t->w, wf ? mf : t->m, wf ? vf : t->v, st,
                                      t->o->keep_last, t->o->save_dtype)
                : gdn_fail(GDN_ERR_NOMEM, "trainer state");
        free(st);
        if (!rc && t->progress) {
            gdn_trainer_clear_status(t);
            fprintf(t->progress, "checkpoint: %s/checkpoint-%08lld\n", t->o->out, (long long)step);
            fflush(t->progress);
        }
    }
    free(wf), free(mf), free(vf);
    return gdn_cp_agree_status(t->agree, rc);
}
