/* The decode step (T = 1): placeholder until the fast path lands. */
#include "internal.h"

int gdn_step(gdn_plan *plan, float *o, float *state, const float *q, const float *k,
             const float *v, const float *g, const float *beta) {
    return gdn_fail(GDN_ERR_ARG, "gdn_step is not implemented yet");
}
