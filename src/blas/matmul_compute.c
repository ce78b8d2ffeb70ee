/* The projections' GEMM in the caller's compute precision (gdncp/compute.h): one entry point, so
 * that the layer, the attention layer and the model switch every projection between fp32 and
 * BF16 by one setting. */
#include "base.h"
#include "blas.h"
#include "gdncp/compute.h"

const char *gdn_compute_path(int compute) {
    if (compute == GDN_COMPUTE_BF16) return gdn_bf16_path_name(gdn_bf16_path_auto());
    return compute == GDN_COMPUTE_FP32 ? gdn_matmul_path() : NULL;
}

size_t gdn_matmul_compute_ws_floats(int compute, int threads) {
    const size_t f32 = gdn_matmul_ws_floats(threads);
    if (compute != GDN_COMPUTE_BF16) return f32;
    /* the bf16 GEMM's packing space is largest at its deepest slice and widest panel, whatever m */
    const size_t b = (gdn_matmul_bf16_ws_bytes(GDN_BF16_AUTO, INT64_MAX / 4, INT64_MAX / 4, INT64_MAX / 4) + 3) / 4;
    return b > f32 ? b : f32;
}

void gdn_matmul_compute(int compute, int flags, int64_t m, int64_t n, int64_t kk, const void *A, int64_t lda,
                        const void *B, int64_t ldb, float *C, int64_t ldc, float *ws, int threads) {
    /* Decode-sized products (m <= 16 rows) run the fp32 streaming GEMM in either mode: they are
     * bound by reading the weights, which BF16 operands would only add a packing pass to. */
    if (compute == GDN_COMPUTE_BF16 && (m > 16 || (flags & GDN_GEMM_A_BF16))) {
        if (gdn_bf16_path_auto() == GDN_BF16_FMA) /* no BF16 instructions: the fp32 GEMM rounding as it packs, in ws */
            gdn_matmul(flags | gdn_bf16_fma_rounding(), m, n, kk, A, lda, B, ldb, C, ldc, ws, threads);
        else
            gdn_matmul_bf16(GDN_BF16_AUTO, flags, m, n, kk, A, lda, B, ldb, C, ldc, ws, threads);
        return;
    }
    GDN_ASSERT((compute == GDN_COMPUTE_FP32 || compute == GDN_COMPUTE_BF16) && !(flags & GDN_GEMM_A_BF16));
    gdn_matmul(flags, m, n, kk, A, lda, B, ldb, C, ldc, ws, threads);
}
