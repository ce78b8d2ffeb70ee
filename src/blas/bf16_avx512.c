/* The BF16 GEMM's AVX512-BF16 path (bf16.h): the VDPBF16PS micro-kernel (a 14 x 32 register
 * tile), the transposing A packers by VCVTNE2PS2BF16 (also used on AMX when the CPU has
 * AVX512-BF16) and the instruction's register-only peak. Each function carries its target
 * attributes; nothing here runs unless the CPU has the instructions (matmul_bf16.c's probes). */
#include "bf16.h"

#include <omp.h>
#include <string.h>

#if HAVE_X86
/* The AMX A panels np0 <= ip < np1 from A^T [kk x m] fp32 (the weight gradients' dY^T): panel ip
 * is MR_X rows of kcp bf16, dst[(ip * MR_X + i) * kcp + k] = bf16(A[k * lda + ip * MR_X + i]) (zero
 * past m and past kc). Per 32-deep block and 16 rows: 16 pairs of A^T rows interleaved into words
 * (word i = the pair of row i), then a 16 x 16 transpose of those words, so each store is one
 * 64-byte row of a panel. The depth block is the outer loop: each A^T row is read along all the
 * panels at once (contiguous, so prefetched) rather than 128 bytes at a time a page apart. Element
 * by element (a 2-byte store each) this packing took 17 % of a BF16 training step. */
__attribute__((target("avx512f,avx512bf16,avx512bw"))) void gdn_bf16_pack_a_trans_x_hw(uint16_t *restrict dst,
                                                                                     const float *A, int64_t lda,
                                                                                     int64_t np0, int64_t np1,
                                                                                     int64_t m, int64_t kc, int64_t kcp) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t kb = 0; kb < kcp; kb += 32)
        for (int64_t i0 = np0 * MR_X; i0 < np1 * MR_X; i0 += 16) {
            const int64_t n = m - i0;
            const __mmask16 mk = n >= 16 ? 0xffffu : n <= 0 ? 0 : (__mmask16)((1u << n) - 1u);
            __m512i r[16], t[16];
            for (int p = 0; p < 16; p++) { /* r[p] word i: rows kb + 2p, kb + 2p + 1 of column i0 + i */
                const int64_t k = kb + 2 * p;
                const __m512 a = k < kc && mk ? _mm512_maskz_loadu_ps(mk, A + k * lda + i0) : _mm512_setzero_ps();
                const __m512 b = k + 1 < kc && mk ? _mm512_maskz_loadu_ps(mk, A + (k + 1) * lda + i0) : _mm512_setzero_ps();
                r[p] = _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(b, a));
            }
            /* transpose: words within 128-bit lanes, then pairs of words, then the lanes */
            for (int p = 0; p < 16; p += 2)
                t[p] = _mm512_unpacklo_epi32(r[p], r[p + 1]), t[p + 1] = _mm512_unpackhi_epi32(r[p], r[p + 1]);
            for (int g = 0; g < 16; g += 4) { /* r[g + c], lane L: rows g..g+3 of column 4L + c */
                r[g + 0] = _mm512_unpacklo_epi64(t[g], t[g + 2]), r[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
                r[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]), r[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
            }
            uint16_t *d = dst + i0 * kcp + kb;
            for (int c = 0; c < 4; c++) {
                const __m512i v0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88), w0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xdd),
                              v1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88),
                              w1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xdd);
                _mm512_storeu_si512(d + c * kcp, _mm512_shuffle_i32x4(v0, v1, 0x88));
                _mm512_storeu_si512(d + (4 + c) * kcp, _mm512_shuffle_i32x4(w0, w1, 0x88));
                _mm512_storeu_si512(d + (8 + c) * kcp, _mm512_shuffle_i32x4(v0, v1, 0xdd));
                _mm512_storeu_si512(d + (12 + c) * kcp, _mm512_shuffle_i32x4(w0, w1, 0xdd));
            }
        }
}
/* The same for the vector tiles (AVX512-BF16): panel ip is kp pairs of MR_V words,
 * dst[(ip * kp + p) * MR_V + i] = bf16(A[2p lda + ip MR_V + i]) | bf16(A[(2p + 1) lda + ...]) << 16
 * (zero past m and past kc). Depth outer, as above: each A^T row is read along this thread's
 * panels (contiguous) instead of 56 bytes per row a row apart per panel; the rounding by
 * VCVTNE2PS2BF16 instead of the portable integer rounding (18 % of a BF16 `small` training step
 * on Zen 4 went to this packing). */
__attribute__((target("avx512f,avx512bf16,avx512bw"))) void gdn_bf16_pack_a_trans_v_hw(uint32_t *restrict dst,
                                                                                       const float *A, int64_t lda,
                                                                                       int64_t np0, int64_t np1,
                                                                                       int64_t m, int64_t kc, int64_t kp) {
    for (int64_t p = 0; p < kp; p++) {
        const float *r0 = A + 2 * p * lda, *r1 = 2 * p + 1 < kc ? r0 + lda : NULL;
        for (int64_t ip = np0; ip < np1; ip++) {
            const int64_t i0 = ip * MR_V;
            uint32_t w[16];
            hw_interleave16(w, r0 + i0, r1 ? r1 + i0 : NULL, (int)min64(MR_V, m - i0));
            memcpy(dst + (ip * kp + p) * MR_V, w, sizeof(uint32_t) * MR_V);
        }
    }
}

__attribute__((target("avx512f,avx512bf16"))) void gdn_bf16_mk_avx512(int64_t kp, const uint32_t *a,
                                                                         const uint32_t *b, float *C,
                                                                         int64_t ldc, int acc, int mr,
                                                                         int nc) {
    __m512 c[MR_V][2];
#pragma GCC unroll 14
    for (int i = 0; i < MR_V; i++) {
        c[i][0] = _mm512_setzero_ps(), c[i][1] = _mm512_setzero_ps();
        __builtin_prefetch(C + i * ldc, 1, 3);
        __builtin_prefetch(C + i * ldc + NR - 1, 1, 3);
    }
#pragma GCC unroll 2
    for (int64_t p = 0; p < kp; p++) {
        const __m512bh b0 = (__m512bh)_mm512_load_si512(b + p * NR);
        const __m512bh b1 = (__m512bh)_mm512_load_si512(b + p * NR + 16);
#pragma GCC unroll 14
        for (int i = 0; i < MR_V; i++) {
            const __m512bh av = (__m512bh)_mm512_set1_epi32((int)a[p * MR_V + i]);
            c[i][0] = _mm512_dpbf16_ps(c[i][0], av, b0);
            c[i][1] = _mm512_dpbf16_ps(c[i][1], av, b1);
        }
    }
    if (mr == MR_V && nc == NR) {
#pragma GCC unroll 14
        for (int i = 0; i < MR_V; i++) {
            float *ci = C + i * ldc;
            if (acc) {
                c[i][0] = _mm512_add_ps(c[i][0], _mm512_loadu_ps(ci));
                c[i][1] = _mm512_add_ps(c[i][1], _mm512_loadu_ps(ci + 16));
            }
            _mm512_storeu_ps(ci, c[i][0]);
            _mm512_storeu_ps(ci + 16, c[i][1]);
        }
        return;
    }
    float t[MR_V * NR] __attribute__((aligned(64)));
    for (int i = 0; i < MR_V; i++) _mm512_store_ps(t + i * NR, c[i][0]), _mm512_store_ps(t + i * NR + 16, c[i][1]);
    store_tile(t, NR, C, ldc, mr, nc, acc);
}

/* Register-only throughput of VDPBF16PS, GFLOP/s (2 per multiply-add): zmm (64 FLOPs each)
 * over 24 independent accumulators, one run (gdn_measure_bf16_peak_gflops takes the best). */
__attribute__((target("avx512f,avx512bf16"))) double gdn_bf16_peak_avx512_once(int threads) {
    enum { NACC = 24, ITERS = 1500000 };
    double secs = 0;
    int used = 1;
    volatile float seed = 1.0f;
#pragma omp parallel num_threads(threads)
    {
        __m512 acc[NACC];
        const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80 + (int)(seed - 1.0f));
        const __m512bh y = (__m512bh)_mm512_set1_epi32(0x33803380);
#pragma GCC unroll 32
        for (int i = 0; i < NACC; i++) acc[i] = _mm512_set1_ps((float)i);
#pragma omp barrier
        const double t0 = omp_get_wtime();
        for (int it = 0; it < ITERS; it++) {
#pragma GCC unroll 32
            for (int i = 0; i < NACC; i++) acc[i] = _mm512_dpbf16_ps(acc[i], x, y);
        }
#pragma omp barrier
        const double t1 = omp_get_wtime();
        __m512 s = acc[0];
        for (int i = 1; i < NACC; i++) s = _mm512_add_ps(s, acc[i]);
        if (_mm512_reduce_add_ps(s) == 12345.678f) seed = 2.0f;
#pragma omp master
        secs = t1 - t0, used = omp_get_num_threads();
    }
    return 64.0 * NACC * (double)ITERS * used / secs * 1e-9;
}
#else
void gdn_bf16_pack_a_trans_x_hw(uint16_t *dst, const float *A, int64_t lda, int64_t np0, int64_t np1, int64_t m,
                                int64_t kc, int64_t kcp) {
    (void)dst, (void)A, (void)lda, (void)np0, (void)np1, (void)m, (void)kc, (void)kcp;
    GDN_ASSERT(0); /* hw is never set without the conversion instructions */
}
void gdn_bf16_pack_a_trans_v_hw(uint32_t *dst, const float *A, int64_t lda, int64_t np0, int64_t np1, int64_t m,
                                  int64_t kc, int64_t kp) {
    (void)dst, (void)A, (void)lda, (void)np0, (void)np1, (void)m, (void)kc, (void)kp;
    GDN_ASSERT(0);
}
#endif
