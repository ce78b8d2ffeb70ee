/* The one fp32 register-tiled micro-kernel under both GEMMs (gemm.c: the chunk kernel's small
 * in-cache products; matmul.c: the layer's blocked projections), on the native-width vectors of
 * base's simd.h (16 floats with AVX-512, 8 with AVX/AVX2, 4 otherwise), so one source builds for
 * every target and the same binary path is what the peak (gdn_measure_peak_gflops) runs.
 *
 * The tile: MR rows of C by NV vectors of columns, MR * NV accumulators held in registers for
 * the whole depth loop; per depth step NV vector loads of B and MR scalar broadcasts of A, so
 * MR * NV FMAs per MR + NV loads. B is a packed panel (rows `ldb` floats apart, every row
 * vector-aligned, zero past the wanted columns); A is read where it lies, element (i, p) at
 * A[i * ars + p * acs] (a packed panel, a matrix in place, or its transpose). */
#ifndef GDNCP_BLAS_MICROKERNEL_H
#define GDNCP_BLAS_MICROKERNEL_H

#include "simd.h"

#include <stdint.h>

/* The largest tile the unrolled loops below can express (what a caller may ask for is bounded
 * by the register file: MR * NV accumulators + NV B vectors + a broadcast within 32 vector
 * registers with AVX-512, 16 with AVX/AVX2 and SSE2). */
#define GDN_MK_MAX_MR 16
#define GDN_MK_MAX_NV 4

/* C[0..MR) x [0..nc) (+)= sum_{p < kk} A(i, p) B[p][.] for one tile of exactly MR rows (MR, NV
 * compile-time constants after inlining; the caller guarantees MR rows of A are readable).
 * nc < NV * GDN_VL: the columns past nc are computed (from B's zero padding) and not stored.
 * acc: add into C, else overwrite. pf: prefetch the C tile first, so that a C coming from L3
 * (the blocked GEMM's, rows a power-of-two stride apart) arrives under the depth loop. */
static inline __attribute__((always_inline)) void gdn_mk_tile(const int MR, const int NV,
                                                              const int pf, int64_t kk,
                                                              const float *A, int64_t ars,
                                                              int64_t acs, const float *B,
                                                              int64_t ldb, float *C, int64_t ldc,
                                                              int nc, int acc) {
    gdn_vf c[GDN_MK_MAX_MR][GDN_MK_MAX_NV];
#pragma GCC unroll 16
    for (int i = 0; i < GDN_MK_MAX_MR; i++) {
        if (i >= MR) continue;
#pragma GCC unroll 4
        for (int v = 0; v < GDN_MK_MAX_NV; v++)
            if (v < NV) c[i][v] = (gdn_vf){0};
        if (pf) {
            __builtin_prefetch(C + i * ldc, 1, 3);
            __builtin_prefetch(C + i * ldc + NV * GDN_VL - 1, 1, 3);
        }
    }
#pragma GCC unroll 4
    for (int64_t p = 0; p < kk; p++) {
        gdn_vf b[GDN_MK_MAX_NV];
#pragma GCC unroll 4
        for (int v = 0; v < GDN_MK_MAX_NV; v++)
            if (v < NV) b[v] = *(const gdn_vf *)(B + p * ldb + v * GDN_VL);
#pragma GCC unroll 16
        for (int i = 0; i < GDN_MK_MAX_MR; i++) {
            if (i >= MR) continue;
            const float a = A[i * ars + p * acs];
#pragma GCC unroll 4
            for (int v = 0; v < GDN_MK_MAX_NV; v++)
                if (v < NV) c[i][v] += a * b[v];
        }
    }
    if (nc >= NV * GDN_VL) {
#pragma GCC unroll 16
        for (int i = 0; i < GDN_MK_MAX_MR; i++) {
            if (i >= MR) continue;
            float *ci = C + i * ldc;
#pragma GCC unroll 4
            for (int v = 0; v < GDN_MK_MAX_NV; v++)
                if (v < NV)
                    gdn_vstoreu(ci + v * GDN_VL,
                                acc ? gdn_vloadu(ci + v * GDN_VL) + c[i][v] : c[i][v]);
        }
        return;
    }
#pragma GCC unroll 16
    for (int i = 0; i < GDN_MK_MAX_MR; i++) { /* a partial tile: through a row in memory */
        if (i >= MR) continue;
        float t[GDN_MK_MAX_NV * GDN_VL] __attribute__((aligned(64)));
#pragma GCC unroll 4
        for (int v = 0; v < GDN_MK_MAX_NV; v++)
            if (v < NV) *(gdn_vf *)(t + v * GDN_VL) = c[i][v];
        float *ci = C + i * ldc;
        for (int j = 0; j < nc; j++) ci[j] = acc ? ci[j] + t[j] : t[j];
    }
}

/* The same for mr <= MR rows: a full tile, else the rows split into tiles of 8, 4, 2 and 1
 * (each re-reads the B panel from L1), so that no row past mr is read or computed and only
 * log2(MR) + 1 tile shapes are compiled. */
static inline __attribute__((always_inline)) void gdn_mk_rows(const int MR, const int NV,
                                                              const int pf, int mr, int64_t kk,
                                                              const float *A, int64_t ars,
                                                              int64_t acs, const float *B,
                                                              int64_t ldb, float *C, int64_t ldc,
                                                              int nc, int acc) {
    if (mr == MR) {
        gdn_mk_tile(MR, NV, pf, kk, A, ars, acs, B, ldb, C, ldc, nc, acc);
        return;
    }
#pragma GCC unroll 4
    for (int r = 8; r >= 1; r /= 2) {
        if (r >= MR || !(mr & r)) continue;
        gdn_mk_tile(r, NV, pf, kk, A, ars, acs, B, ldb, C, ldc, nc, acc);
        A += r * ars, C += r * ldc, mr -= r;
    }
}

#endif
