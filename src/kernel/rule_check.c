/* The rule's input checks: the public bundles (gdn_rule_inputs, gdn_rule_grads) for NULLs,
 * the inputs of a plan's shape for NULLs and NaN/Inf, and the explanation of a non-finite value
 * that the stream loops (stream.c) found on the way. */
#include "kernel_internal.h"

int gdn_rule_inputs_check(const gdn_rule_inputs *in, int need_v) {
    if (!in) return gdn_fail(GDN_ERR_ARG, "inputs 'in' (gdn_rule_inputs) is NULL");
    const char *miss = !in->q ? "q" : !in->k ? "k" : need_v && !in->v ? "v" : !in->g ? "g" : !in->beta ? "beta" : NULL;
    return miss ? gdn_fail(GDN_ERR_ARG, "input '%s' is NULL", miss) : GDN_OK;
}

int gdn_rule_grads_check(const gdn_rule_grads *gr) {
    if (!gr) return gdn_fail(GDN_ERR_ARG, "gradients 'grads' (gdn_rule_grads) is NULL");
    const char *miss = !gr->dq ? "dq" : !gr->dk ? "dk" : !gr->dv ? "dv" : !gr->dg ? "dg" : !gr->dbeta ? "dbeta" : NULL;
    return miss ? gdn_fail(GDN_ERR_ARG, "gradient output '%s' is NULL", miss) : GDN_OK;
}

int gdn_check_inputs(const gdn_plan *p, const float *q, const float *k, const float *v,
                     const float *g, const float *beta, const float *h0) {
    const gdn_config *c = &p->cfg;
    const int64_t nqk = c->B * c->T * c->Hk * c->K, nv = c->B * c->T * c->Hv * c->V,
                  ng = c->B * c->T * c->Hv;
    int rc;
    if ((rc = gdn_check_tensor("q", q, nqk, c->check_finite, c->threads))) return rc;
    if ((rc = gdn_check_tensor("k", k, nqk, c->check_finite, c->threads))) return rc;
    if ((rc = gdn_check_tensor("v", v, nv, c->check_finite, c->threads))) return rc;
    if ((rc = gdn_check_tensor("g", g, ng, c->check_finite, c->threads))) return rc;
    if ((rc = gdn_check_tensor("beta", beta, ng, c->check_finite, c->threads))) return rc;
    if (h0 && (rc = gdn_check_tensor("h0", h0, gdn_state_floats(c), c->check_finite, c->threads))) return rc;
    return GDN_OK;
}

/* A non-finite value found inside a stream loop: name the input (or do), else the output (dh0: the
 * rows of the documents that start within the plan), else the keys whose squared norm
 * overflowed. */
int gdn_streams_explain_nonfinite(gdn_plan *p, const gdn_chunk_inputs *in, const float *h0, const float *dout,
                                  const gdn_named_output *outs, int nouts, const float *dh0) {
    const gdn_config *c = &p->cfg;
    const int64_t ns = c->Hv * c->K * c->V;
    int rc;
    if ((rc = gdn_check_inputs(p, in->q, in->k, in->v, in->g, in->beta, h0))) return rc;
    if (dout && (rc = gdn_check_tensor("do", dout, c->B * c->T * c->Hv * c->V, 1, c->threads))) return rc;
    for (int i = 0; i < nouts; i++)
        if (outs[i].x && (rc = gdn_check_output(outs[i].name, outs[i].x, outs[i].n, c->threads))) return rc;
    for (int64_t i = 0; dh0 && i < p->streams.n; i++)
        if (!p->streams.s[i].cont_in && (rc = gdn_check_output("dh0", dh0 + p->streams.s[i].row * ns, ns, c->threads)))
            return rc;
    return gdn_fail_keys_overflow();
}
