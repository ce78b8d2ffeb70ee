/* The `heads` strategy: all-to-all from sequence-parallel to head-parallel, the single-rank
 * kernel on whole sequences of D-th of the heads, and all-to-all back. */
#include "cp_internal.h"

int gdn_cp_heads_forward(gdn_cp *cp, gdn_plan *plan, float *o, float *ht, float *s_in,
                         const float *q, const float *k, const float *v, const float *g,
                         const float *beta, const float *h0) {
    (void)plan, (void)o, (void)ht, (void)s_in, (void)q, (void)k, (void)v, (void)g, (void)beta, (void)h0;
    return gdn_cp_agree_status(cp, gdn_fail(GDN_ERR_ARG, "strategy 'heads' is not available yet"));
}

int gdn_cp_heads_backward(gdn_cp *cp, gdn_plan *plan, float *dq, float *dk, float *dv,
                          float *dg, float *dbeta, float *ds_in, const float *q, const float *k,
                          const float *v, const float *g, const float *beta, const float *h0,
                          const float *dout, const float *dht) {
    (void)plan, (void)dq, (void)dk, (void)dv, (void)dg, (void)dbeta, (void)ds_in, (void)q, (void)k;
    (void)v, (void)g, (void)beta, (void)h0, (void)dout, (void)dht;
    return gdn_cp_agree_status(cp, gdn_fail(GDN_ERR_ARG, "strategy 'heads' is not available yet"));
}
