/* Layer weights from Hugging Face checkpoints (placeholder until it lands). */
#include "../core/internal.h"

int gdn_layer_weights_load(gdn_layer_weights *lw, const char *path, const char *config_path,
                           const char *prefix, const gdn_layer_config *given) {
    return gdn_fail(GDN_ERR_ARG, "not implemented yet");
}
void gdn_layer_weights_free(gdn_layer_weights *lw) {}
int gdn_layer_grads_add(gdn_st_writer *wr, const gdn_layer_weights *lw, const float *dw,
                        const char *name_prefix) {
    return gdn_fail(GDN_ERR_ARG, "not implemented yet");
}
