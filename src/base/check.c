/* The one tensor checker: NULL tensors and non-finite values, with one set of messages for the
 * kernel, the layer, the decode step and the oracles (gdn_check_inputs, a plan's inputs, is the
 * kernel's: stream.c). */
#include "base.h"

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
