/* The one tensor checker: NULL tensors and non-finite values, with one set of messages for the
 * kernel, the layer, the decode step and the oracles. */
#include "internal.h"

int gdn_fail_nonfinite(const char *role, const char *name, double value, int64_t at) {
    return gdn_fail(GDN_ERR_NONFINITE, "%s '%s' has a non-finite value (%g) at flat index %lld", role, name,
                    value, (long long)at);
}

int gdn_check_tensor(const char *name, const float *x, int64_t n, int check_finite, int threads) {
    if (!x) return gdn_fail(GDN_ERR_ARG, "input '%s' is NULL", name);
    if (check_finite) {
        const int64_t at = gdn_find_nonfinite_f32(x, n, threads);
        if (at >= 0) return gdn_fail_nonfinite("input", name, (double)x[at], at);
    }
    return GDN_OK;
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

int gdn_fail_keys_overflow(void) {
    return gdn_fail(GDN_ERR_NONFINITE, "input 'q' or 'k' has a row whose squared norm overflows fp32 (|x| > 1e19)");
}

/* Outputs that overflowed (e.g. from large positive gates) are reported, never returned silently. */
int gdn_check_output(const char *name, const float *x, int64_t n, int threads) {
    const int64_t at = gdn_find_nonfinite_f32(x, n, threads);
    if (at >= 0)
        return gdn_fail(GDN_ERR_NONFINITE,
                        "output '%s' is non-finite at flat index %lld (overflow: are gates g > 0 or keys unnormalised?)",
                        name, (long long)at);
    return GDN_OK;
}
