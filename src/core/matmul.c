/* Large fp32 GEMM for the layer's projections. (First version: row blocks of gdn_gemm in
 * parallel; to be replaced by a cache-blocked, packed GEMM.) */
#include "internal.h"

#include <string.h>

size_t gdn_matmul_ws_floats(int threads) { return (size_t)(threads > 0 ? threads : 1) * 16; }

void gdn_matmul(int flags, int64_t m, int64_t n, int64_t kk, const float *A, int64_t lda,
                const float *B, int64_t ldb, float *C, int64_t ldc, float *ws, int threads) {
    if (m <= 0 || n <= 0) return;
    const int a_trans = (flags & GDN_GEMM_A_TRANS) != 0;
    const int64_t MB = 96;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t i0 = 0; i0 < m; i0 += MB) {
        const int64_t mb = m - i0 < MB ? m - i0 : MB;
        const float *Ai = a_trans ? A + i0 : A + i0 * lda;
        gdn_gemm(flags & (GDN_GEMM_ACC | GDN_GEMM_A_TRANS | GDN_GEMM_B_TRANS), (int)mb, (int)n,
                 (int)kk, Ai, (int)lda, B, (int)ldb, C + i0 * ldc, (int)ldc);
    }
}

const char *gdn_matmul_path(void) { return "row-blocked gdn_gemm (unpacked A)"; }
