/* The layer in double precision (placeholder until it lands). */
#include "layer_internal.h"

int gdn_layer_reference_forward(const gdn_layer_config *cfg, double *y, const double *x,
                                const double *w) {
    return gdn_fail(GDN_ERR_ARG, "not implemented yet");
}
int gdn_layer_reference_backward(const gdn_layer_config *cfg, double *dx, double *dw,
                                 const double *x, const double *w, const double *dy) {
    return gdn_fail(GDN_ERR_ARG, "not implemented yet");
}
