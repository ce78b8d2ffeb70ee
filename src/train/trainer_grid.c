/* The trainer's sums over the grid (train.h): targets, router statistics, the loss (the
 * parameters' state, gradients and checkpoints: trainer_shard.c). */
#include "trainer_internal.h"

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
