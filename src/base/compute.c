/* The compute precisions' names (gdncp/compute.h): below every layer, so that the configs'
 * checks need no GEMM (gdn_compute_path, which names the path, lives with the GEMMs). */
#include "base.h"
#include "gdncp/compute.h"

#include <string.h>

int gdn_compute_parse(const char *name, int *compute) {
    if (!compute) return gdn_fail(GDN_ERR_ARG, "compute: the output is NULL");
    if (name && !strcmp(name, "fp32")) return *compute = GDN_COMPUTE_FP32, GDN_OK;
    if (name && !strcmp(name, "bf16")) return *compute = GDN_COMPUTE_BF16, GDN_OK;
    return gdn_fail(GDN_ERR_ARG, "compute '%s': expected fp32 or bf16", name ? name : "(null)");
}
const char *gdn_compute_name(int compute) {
    return compute == GDN_COMPUTE_FP32 ? "fp32" : compute == GDN_COMPUTE_BF16 ? "bf16" : NULL;
}
