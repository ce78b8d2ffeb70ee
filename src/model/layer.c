/* The GatedDeltaNet layer, fp32 (placeholder). */
#include "layer_internal.h"

int gdn_layer_plan_create(gdn_layer_plan **plan, const gdn_layer_config *cfg) {
    return gdn_fail(GDN_ERR_ARG, "not implemented yet");
}
void gdn_layer_plan_destroy(gdn_layer_plan *plan) {}
const gdn_layer_config *gdn_layer_plan_config(const gdn_layer_plan *plan) { return NULL; }
size_t gdn_layer_saved_floats(const gdn_layer_plan *plan) { return 0; }
const char *gdn_layer_plan_path(const gdn_layer_plan *plan) { return ""; }
int gdn_layer_forward(gdn_layer_plan *plan, float *y, float *saved, const float *x,
                      const float *w, float *conv_state, float *rec_state) {
    return gdn_fail(GDN_ERR_ARG, "not implemented yet");
}
int gdn_layer_backward(gdn_layer_plan *plan, float *dx, float *dw, const float *x,
                       const float *w, const float *saved, const float *dy) {
    return gdn_fail(GDN_ERR_ARG, "not implemented yet");
}
int gdn_layer_decode(gdn_layer_plan *plan, float *y, const float *x, const float *w,
                     float *conv_state, float *rec_state) {
    return gdn_fail(GDN_ERR_ARG, "not implemented yet");
}
