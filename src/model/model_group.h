/* What the model needs from the ranks its sequence is split over (context parallelism).
 *
 * libgdncp links no MPI, so the model cannot call the CP forms of its mixers or an MPI collective
 * itself. The MPI wing (libgdncp_mpi, src/cp) fills this table when it makes a gdn_cp context,
 * whose struct starts with it, and the model reaches its peers only through it. A NULL cp is one
 * process: the model then calls the mixers' single-rank forms. Another transport would fill the
 * same table. */
#ifndef GDNCP_MODEL_GROUP_H
#define GDNCP_MODEL_GROUP_H

#include "gdncp/model.h"
#include "base.h" /* GDN_WING */

typedef struct {
    int rank; /* this rank in the group, for messages */
    /* Every rank's status in, the same verdict out on every rank (gdn_cp_agree_status). */
    int (*agree_status)(gdn_cp *cp, int local_status);
    /* *before = the sum of `mine` over the ranks before this one (0 on the first). */
    int (*exscan_sum)(gdn_cp *cp, int64_t mine, int64_t *before);
    /* out[i] = in[i] summed over the ranks, on every rank. */
    int (*sum_doubles)(gdn_cp *cp, const double *in, double *out, int n);
    /* The mixers' CP forms (cp.h). */
    int (*layer_forward)(gdn_cp *cp, gdn_layer_plan *plan, float *y, float *saved, const float *x, const void *w);
    int (*layer_backward)(gdn_cp *cp, gdn_layer_plan *plan, float *dx, float *dw, const float *x, const float *w,
                          const float *saved, const float *dy);
    int (*attn_forward)(gdn_cp *cp, gdn_attn_plan *plan, float *y, float *saved, const float *x, const float *w);
    int (*attn_backward)(gdn_cp *cp, gdn_attn_plan *plan, float *dx, float *dw, const float *x, const float *w,
                         const float *saved, const float *dy);
} gdn_model_group;

/* What the model needs from the ranks its MoE layers' experts are split over (expert parallelism):
 * the wing's gdn_ep context starts with this table (ep.h; the MoE block's EP forms). */
typedef struct {
    int size, rank;
    int (*forward)(gdn_ep *ep, gdn_moe_plan *plan, float *y, float *saved, const float *x, const float *w,
                   double *stats);
    int (*backward)(gdn_ep *ep, gdn_moe_plan *plan, float *dx, float *dw, const float *x, const float *w,
                    const float *saved, const float *dy, const float *aux_dp);
    /* A rank that failed elsewhere (status != 0) joins its peers' next forward or backward with
     * that status: they stop there with an error naming it instead of waiting; returns status. */
    int (*join)(gdn_ep *ep, gdn_moe_plan *plan, int status);
} gdn_model_experts;

static inline const gdn_model_experts *gdn_model_experts_of(const gdn_ep *ep) {
    return (const gdn_model_experts *)(const void *)ep;
}

/* Sharded weights (DESIGN §15, level 3: a caller that keeps only slices of the weights and
 * gathers each unit (gdn_model_unit_offset, model.h) just before the model reads it; the wing's
 * trainer fills it). With a hook set, every forward and backward calls it at these points, in this order on every rank:
 *   GDN_UNIT_NEED     before the model reads unit u's weights (the forward: 0, 1, .., L + 1 and,
 *                     tied, 0 again for the head; the backward: L + 1, L, .., 1);
 *   GDN_UNIT_DONE     once it no longer reads them in this pass (the hook may release them);
 *   GDN_UNIT_GRADS    in the backward, once unit u's gradient in dw is complete (L + 1, .., 1, 0;
 *                     the hook may sum it over its ranks and release it): the model zeroes a
 *                     unit's gradient just before it first writes it, never the whole array;
 *   GDN_UNIT_END      (u -1) at the end of a pass that succeeded;
 *   GDN_UNIT_FAILED   (u -1, status) once, instead, when the pass fails on this rank: the hook
 *                     then meets the other ranks' next call (e.g. an agreement of statuses) so
 *                     that they stop too, with no hang.
 * A non-zero return stops the pass with that status. NULL hook: the whole array is always there. */
enum { GDN_UNIT_NEED = 0, GDN_UNIT_DONE = 1, GDN_UNIT_GRADS = 2, GDN_UNIT_END = 3, GDN_UNIT_FAILED = 4, GDN_UNIT_BEGIN = 5 };
typedef struct {
    void *ctx;
    int (*call)(void *ctx, int64_t unit, int event, int status);
} gdn_model_units_hook;
GDN_WING int gdn_model_plan_set_units_hook(gdn_model_plan *plan, const gdn_model_units_hook *hook);
/* The table at the head of a context (C allows a struct pointer to be read as its first member). */
static inline const gdn_model_group *gdn_model_group_of(const gdn_cp *cp) {
    return (const gdn_model_group *)(const void *)cp;
}

#endif /* GDNCP_MODEL_GROUP_H */
