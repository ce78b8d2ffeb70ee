/* The fp32 GEMMs of the library (src/blas), internal: the small in-cache GEMM the chunk kernel
 * runs (gemm.c) and the blocked GEMM of the layer's projections (matmul.c), both on the one
 * micro-kernel of microkernel.h. Included by src/kernel/kernel_internal.h. */
#ifndef GDNCP_BLAS_H
#define GDNCP_BLAS_H

#include <stddef.h>
#include <stdint.h>

/* ---- small GEMM: C[m x n] (+)= A[m x kk] B[kk x n], row-major with row strides.
 * flags: GDN_GEMM_ACC adds into C (else overwrites);
 *        GDN_GEMM_A_TRANS: A is stored as its transpose (kk x m, row stride lda);
 *        GDN_GEMM_B_TRANS: B is stored as its transpose (n x kk, row stride ldb);
 *        GDN_GEMM_A_LOWER: A[i][p] == 0 for p > i, so those products are skipped;
 *        GDN_GEMM_A_UPPER: A[i][p] == 0 for p < i (e.g. the transpose of a lower triangle), same;
 *        GDN_GEMM_C_LOWER: only C[i][j] with j <= i is needed (others may hold anything);
 *        GDN_GEMM_B_BF16: gdn_matmul only (B in bfloat16, with GDN_GEMM_B_TRANS), see below. */
enum { GDN_GEMM_ACC = 1, GDN_GEMM_A_LOWER = 2, GDN_GEMM_C_LOWER = 4, GDN_GEMM_A_TRANS = 8,
       GDN_GEMM_B_TRANS = 16, GDN_GEMM_A_UPPER = 32, GDN_GEMM_B_BF16 = 64 };
void gdn_gemm(int flags, int m, int n, int kk, const float *A, int lda, const float *B, int ldb,
              float *C, int ldc);
/* ---- large GEMM for the layer's projections (m = tokens, n and kk = thousands):
 * C[m x n] (+)= op(A) op(B) with the flags GDN_GEMM_ACC, GDN_GEMM_A_TRANS, GDN_GEMM_B_TRANS of
 * gdn_gemm; cache-blocked and packed, run by `threads` OpenMP threads (call it from outside a
 * parallel region). ws: gdn_matmul_ws_floats(threads) floats of packing space.
 * B is const float * unless GDN_GEMM_B_BF16 (gdn_matmul only): then B points to bfloat16
 * values stored as uint16_t (the upper 16 bits of an fp32: value = bits (uint32_t)h << 16),
 * same layout and ldb (in elements); converted to fp32 on the fly (A, C and all arithmetic stay
 * fp32). Precondition: only together with GDN_GEMM_B_TRANS (a weight matrix W [n x kk]
 * row-major, B = W^T); without it gdn_matmul aborts (GDN_ASSERT). */
size_t gdn_matmul_ws_floats(int threads);
void gdn_matmul(int flags, int64_t m, int64_t n, int64_t kk, const float *A, int64_t lda,
                const void *B, int64_t ldb, float *C, int64_t ldc, float *ws, int threads);
/* The name of the path gdn_matmul runs (for benchmarks). */
const char *gdn_matmul_path(void);
/* dst[c][r] = src[r][c] for an r x c block. */
void gdn_transpose(int rows, int cols, const float *src, int lds, float *dst, int ldd);
/* The name of the GEMM micro-kernel compiled in. */
const char *gdn_gemm_path(void);


#endif
