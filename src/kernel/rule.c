/* The gated delta rule's single-rank entry points (kernel.h): the plan's documents and its
 * checkpoint size, the forward and the backward, each checking its bundles (rule_check.c) and
 * placing the plan as the whole sequence before running its streams (stream.c). */
#include "kernel_internal.h"

#include <string.h>

int gdn_plan_set_docs(gdn_plan *p, const int64_t *cu_seqlens, int64_t n_docs, int64_t seq_offset) {
    if (!p) return gdn_fail(GDN_ERR_ARG, "gdn_plan_set_docs: plan is NULL");
    if (!p->streams.packed)
        return gdn_fail(GDN_ERR_ARG, "gdn_plan_set_docs: the plan was made dense (cu_seqlens NULL); make it with "
                        "offsets (e.g. one document {0, T}) to change its documents later");
    if (!cu_seqlens) return gdn_fail(GDN_ERR_ARG, "gdn_plan_set_docs: cu_seqlens is NULL");
    gdn_config c = p->cfg;
    c.cu_seqlens = cu_seqlens, c.n_docs = n_docs, c.seq_offset = seq_offset;
    int rc = gdn_pack_check(&c);
    if (rc) return rc;
    /* Build the new streams beside the old ones, so that a failure leaves the plan as it was
     * (never silently dense). */
    const gdn_streams old = p->streams;
    const gdn_config old_cfg = p->cfg;
    memset(&p->streams, 0, sizeof p->streams);
    p->cfg = c;
    rc = gdn_streams_init(p);
    if (!rc && p->streams.ckpt_rows > p->ckpt_rows_cap) /* cannot happen: see ckpt_rows_cap */
        rc = gdn_fail(GDN_ERR_SHAPE, "gdn_plan_set_docs: %lld saved-state rows exceed the plan's %lld",
                      (long long)p->streams.ckpt_rows, (long long)p->ckpt_rows_cap);
    if (rc) {
        gdn_streams_free(p);
        p->streams = old, p->cfg = old_cfg;
        return rc;
    }
    free(old.cu);
    free(old.s);
    free(old.run);
    return GDN_OK;
}

size_t gdn_plan_ckpt_floats(const gdn_plan *p) {
    return p ? (size_t)(p->cfg.Hv * p->streams.ckpt_rows) * p->cfg.K * p->cfg.V : 0;
}

/* ---------------------------------------------------------------- the single-rank entry points */

/* The plan's tokens are the whole sequence: every stream starts from its h0 row and ends with
 * its ht row. */
static int single_rank(gdn_plan *p) {
    int rc = gdn_pack_check_whole(&p->cfg);
    if (!rc) gdn_streams_set_shard(p, 1, 1);
    return rc;
}

int gdn_forward(gdn_plan *p, float *o, float *ht, const gdn_rule_inputs *in) {
    if (!p) return gdn_fail(GDN_ERR_ARG, "plan is NULL");
    if (!o) return gdn_fail(GDN_ERR_ARG, "output 'o' is NULL");
    int rc = gdn_rule_inputs_check(in, 1);
    if (!rc) rc = single_rank(p);
    return rc ? rc : gdn_streams_forward(p, o, ht, NULL, in->q, in->k, in->v, in->g, in->beta, in->h0, NULL, NULL);
}

int gdn_forward_save(gdn_plan *p, float *o, float *ht, float *ckpt, const gdn_rule_inputs *in) {
    if (!p) return gdn_fail(GDN_ERR_ARG, "plan is NULL");
    if (!o) return gdn_fail(GDN_ERR_ARG, "output 'o' is NULL");
    if (!ckpt) return gdn_fail(GDN_ERR_ARG, "checkpoint buffer is NULL");
    int rc = gdn_rule_inputs_check(in, 1);
    if (!rc) rc = single_rank(p);
    return rc ? rc : gdn_streams_forward(p, o, ht, ckpt, in->q, in->k, in->v, in->g, in->beta, in->h0, NULL, NULL);
}

int gdn_backward(gdn_plan *p, const gdn_rule_grads *grads, const gdn_rule_inputs *in,
                 const float *dout, const float *dht) {
    return gdn_backward_saved(p, grads, in, NULL, dout, dht);
}

int gdn_backward_saved(gdn_plan *p, const gdn_rule_grads *grads, const gdn_rule_inputs *in,
                       const float *ckpt, const float *dout, const float *dht) {
    if (!p) return gdn_fail(GDN_ERR_ARG, "plan is NULL");
    int rc = gdn_rule_grads_check(grads);
    if (!rc) rc = gdn_rule_inputs_check(in, 1);
    if (!rc) rc = single_rank(p);
    return rc ? rc : gdn_streams_backward(p, grads->dq, grads->dk, grads->dv, grads->dg, grads->dbeta, grads->dh0,
                                          in->q, in->k, in->v, in->g, in->beta, in->h0, NULL, ckpt, dout, dht,
                                          NULL, NULL);
}
