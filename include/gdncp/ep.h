/*
 * gdncp expert parallelism (libgdncp_mpi): the routed experts of the sparse MoE block (moe.h)
 * split over the ranks of an MPI communicator, each rank holding the weights (and gradients, and
 * optimizer moments) of its slice only (DESIGN §14).
 *
 * Every rank routes its own token rows. Per call: one MPI_Alltoall of each rank's row counts per
 * expert (with its status and shape, so that a failure or a mismatch on one rank stops every rank
 * with a message, never a hang), one MPI_Allreduce of the receivers' statuses (their buffers grow
 * there), then MPI_Ialltoallv of the pairs' rows to the ranks holding their experts, the experts'
 * GEMMs there, and MPI_Ialltoallv of the results back; the combine adds each token's slots in slot
 * order as the one-rank block does. Dropless: no capacity, no token dropped. Exact: a block split
 * over D ranks equals the one-rank block on the same rows up to the GEMMs' rounding, forward and
 * backward (the experts' weight gradients summed over the group's rows on their owner).
 *
 * The forward dispatches while it computes the shared expert; the owner keeps nothing between
 * forward and backward (its rows change from step to step): the backward sends each pair's x with
 * its dy and weight, and the owner recomputes its gate/up activations (1/9 more expert FLOPs, no
 * memory that depends on the routing).
 *
 * A model (model.h) uses an EP group through gdn_model_plan_set_experts; its parameter layout then
 * holds this rank's slice (gdn_model_config.ep_size, ep_rank).
 */
#ifndef GDNCP_EP_H
#define GDNCP_EP_H

#include <mpi.h>

#include "../gdncp.h"

#ifdef __cplusplus
extern "C" {
#endif

/* gdn_ep: model.h (opaque there). */

/* comm (duplicated): the ranks the experts are split over; this rank holds slice
 * rank-in-comm. Collective over comm. */
GDN_API int gdn_ep_create(gdn_ep **ep, MPI_Comm comm);
GDN_API void gdn_ep_destroy(gdn_ep *ep);
GDN_API int gdn_ep_rank(const gdn_ep *ep);
GDN_API int gdn_ep_size(const gdn_ep *ep);

/* Set cfg's ep_size and ep_rank to this group's (the slice this rank holds); GDN_ERR_SHAPE when
 * the group's size does not divide cfg->n_experts. Local. */
GDN_API int gdn_ep_moe_config(const gdn_ep *ep, gdn_moe_config *cfg);

/* The MoE block on this rank's N rows with its experts spread over the group: as
 * gdn_moe_forward / gdn_moe_backward (same saved, stats, aux_dp; w and dw in the sliced layout of
 * the plan's config, whose ep_size and ep_rank must be the group's). Collective over the group:
 * every rank calls it, each with its own rows (N may differ between ranks). */
GDN_API int gdn_moe_ep_forward(gdn_ep *ep, gdn_moe_plan *plan, float *y, float *saved, const float *x,
                               const float *w, double *stats);
GDN_API int gdn_moe_ep_backward(gdn_ep *ep, gdn_moe_plan *plan, float *dx, float *dw, const float *x,
                                const float *w, const float *saved, const float *dy, const float *aux_dp);

/* What the group's calls did on this rank since it was made or last reset. */
typedef struct {
    double exchange_s;      /* waiting in the all-to-alls (counts, statuses, rows) */
    double experts_s;       /* the experts' GEMMs and SwiGLU on the rows this rank owns */
    double bytes_sent, bytes_recv; /* rows' bytes, both directions, forward and backward */
    double rows_owned;      /* (token, slot) rows this rank's experts computed, summed over calls */
    double rows_routed;     /* rows this rank's tokens sent out (N top_k per call) */
    int64_t calls;          /* forwards + backwards */
} gdn_ep_stats;
GDN_API void gdn_ep_get_stats(gdn_ep *ep, gdn_ep_stats *stats, int reset);

#ifdef __cplusplus
}
#endif
#endif /* GDNCP_EP_H */
