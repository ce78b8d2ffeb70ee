/* Packing the B operand of both GEMMs into the panels the micro-kernel (microkernel.h) reads:
 * kc x NR blocks, contiguous and vector-aligned, zero past the wanted columns. Packing first,
 * rather than reading B in place: in place, the rows of a B panel are a power-of-two stride
 * apart (512 bytes in the chunk kernel, 8 KB in the layer), fall into a few L1 sets and evict
 * each other, so every row block re-read its panel from L2 (measured on the chunk kernel's
 * products: 10-15 % faster packed). B is op(B): stored as it is, or as its transpose (then
 * transposed GDN_VL x GDN_VL in registers), in fp32 or, stored transposed, in bfloat16. */
#ifndef GDNCP_BLAS_PACK_H
#define GDNCP_BLAS_PACK_H

#include "blas.h"
#include "microkernel.h"

#include <string.h>

/* B elements: fp32, or bfloat16 (GDN_GEMM_B_BF16: the upper 16 bits of an fp32, stored as
 * uint16_t). `bf` is a compile-time constant wherever these are inlined. */
typedef uint16_t gdn_vh_u __attribute__((vector_size(GDN_VL * 2), aligned(2)));
static inline __attribute__((always_inline)) const void *gdn_eptr(const void *p, int bf, int64_t i) {
    return (const char *)p + i * (bf ? 2 : 4);
}
#if GDN_VL == 16 || (GDN_VL == 8 && defined(__AVX2__))
#include <immintrin.h>
#endif
/* GDN_VL elements at p[i..i+GDN_VL) as fp32 (bf16: zero-extend to 32 bits, shift into the
 * upper half) */
static inline __attribute__((always_inline)) gdn_vf gdn_loadw(const void *p, int bf, int64_t i) {
    if (!bf) return gdn_vloadu((const float *)p + i);
    /* one vpmovzxwd from memory + vpslld: GCC 12 splits the generic form below in halves (5
     * shuffles more per vector on AVX2: bf16 decode ran slower than fp32 there) */
#if GDN_VL == 16
    const gdn_vu u = (gdn_vu)_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))), 16);
#elif GDN_VL == 8 && defined(__AVX2__)
    const gdn_vu u = (gdn_vu)_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))), 16);
#else
    const gdn_vu u = __builtin_convertvector(*(const gdn_vh_u *)((const uint16_t *)p + i), gdn_vu) << 16;
#endif
    gdn_vf f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline __attribute__((always_inline)) float gdn_loadw1(const void *p, int bf, int64_t i) {
    if (!bf) return ((const float *)p)[i];
    const uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* bf16(x) as fp32, lane by lane: nearest even, as gdn_f32_to_bf16 for every finite x and Inf, or
 * truncated (trunc: the test control GDN_BF16_MUT_TRUNCATE). The BF16 GEMM's FMA path rounds its
 * operands so while the fp32 GEMMs pack them. Five integer operations a vector, no special case:
 * a NaN whose payload lies in the low half only comes out as Inf, still not finite, which every
 * output check catches as it catches the NaN (with the special case, 12 operations, the chunk
 * kernel's small products took 1.19 x the fp32 time on the FMA path, now 1.065 x: AVX2, Zen 4). */
static inline __attribute__((always_inline)) gdn_vf gdn_round_bf16_v(gdn_vf x, int trunc) {
    gdn_vu u;
    memcpy(&u, &x, sizeof u);
    const gdn_vu r = trunc ? u & 0xffff0000u : (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&x, &r, sizeof x);
    return x;
}
/* dst[0..n) = bf16(src[0..n)) as fp32 (dst may be src: in place). */
static inline void gdn_round_bf16(float *dst, const float *src, int64_t n, int trunc) {
    int64_t i = 0;
    for (; i + GDN_VL <= n; i += GDN_VL) gdn_vstoreu(dst + i, gdn_round_bf16_v(gdn_vloadu(src + i), trunc));
    if (i < n) { /* the tail through a zero-padded vector */
        float t[GDN_VL] __attribute__((aligned(64))) = {0};
        memcpy(t, src + i, sizeof(float) * (size_t)(n - i));
        *(gdn_vf *)t = gdn_round_bf16_v(*(gdn_vf *)t, trunc);
        memcpy(dst + i, t, sizeof(float) * (size_t)(n - i));
    }
}

/* The FMA path's treatment of a packed B panel (kc rows of NR floats) per gdn_matmul / gdn_gemm
 * flags: rounded or truncated to bf16, and under the control GDN_GEMM_SHIFT_BF16 its rows moved
 * one depth step up (the last one zero). */
static inline void gdn_fma_panel_b(float *panel, int64_t kc, int NR, int flags) {
    if (flags & (GDN_GEMM_ROUND_BF16 | GDN_GEMM_TRUNC_BF16))
        gdn_round_bf16(panel, panel, kc * NR, (flags & GDN_GEMM_TRUNC_BF16) != 0);
    if (flags & GDN_GEMM_SHIFT_BF16) {
        memmove(panel, panel + NR, sizeof(float) * (size_t)((kc - 1) * NR));
        memset(panel + (kc - 1) * NR, 0, sizeof(float) * (size_t)NR);
    }
}

/* In-register transpose of GDN_VL x GDN_VL held in r[0..GDN_VL): out[c][l] = in[l][c], by
 * log2(GDN_VL) rounds; round h swaps bit h of the row index with bit h of the column index:
 * rows i and i + h (i & h == 0) exchange their off-diagonal h-blocks. */
static inline __attribute__((always_inline)) void gdn_tr_round(gdn_vf r[GDN_VL], int h, gdn_vi lo,
                                                               gdn_vi hi) {
#pragma GCC unroll 16
    for (int i = 0; i < GDN_VL; i++) {
        if (i & h) continue;
        const gdn_vf a = r[i], b = r[i + h];
        r[i] = __builtin_shuffle(a, b, lo);     /* lane l: (l & h) ? b[l - h] : a[l] */
        r[i + h] = __builtin_shuffle(a, b, hi); /* lane l: (l & h) ? b[l] : a[l + h] */
    }
}
static inline __attribute__((always_inline)) void gdn_transpose_vl(gdn_vf r[GDN_VL]) {
#if GDN_VL == 16
    gdn_tr_round(r, 8, (gdn_vi){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                 (gdn_vi){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
    gdn_tr_round(r, 4, (gdn_vi){0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
                 (gdn_vi){4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31});
    gdn_tr_round(r, 2, (gdn_vi){0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
                 (gdn_vi){2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31});
    gdn_tr_round(r, 1, (gdn_vi){0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
                 (gdn_vi){1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31});
#elif GDN_VL == 8
    gdn_tr_round(r, 4, (gdn_vi){0, 1, 2, 3, 8, 9, 10, 11}, (gdn_vi){4, 5, 6, 7, 12, 13, 14, 15});
    gdn_tr_round(r, 2, (gdn_vi){0, 1, 8, 9, 4, 5, 12, 13}, (gdn_vi){2, 3, 10, 11, 6, 7, 14, 15});
    gdn_tr_round(r, 1, (gdn_vi){0, 8, 2, 10, 4, 12, 6, 14}, (gdn_vi){1, 9, 3, 11, 5, 13, 7, 15});
#else
    gdn_tr_round(r, 2, (gdn_vi){0, 1, 4, 5}, (gdn_vi){2, 3, 6, 7});
    gdn_tr_round(r, 1, (gdn_vi){0, 4, 2, 6}, (gdn_vi){1, 5, 3, 7});
#endif
}
/* Horizontal sums of VL vectors at once: lane l of the result is the sum of r[l]'s lanes, added
 * in lane order (a register transpose, then VL - 1 vector adds instead of VL - 1 dependent
 * scalar adds per vector). r is overwritten. */
static inline __attribute__((always_inline)) gdn_vf gdn_hsum_vl(gdn_vf r[GDN_VL]) {
    gdn_transpose_vl(r);
    for (int l = 1; l < GDN_VL; l++) r[0] += r[l];
    return r[0];
}

/* One NR-column panel (NR = NV * GDN_VL, a compile-time constant after inlining):
 * dst[p * NR + j] = op(B)[k0 + p][j0 + j] for p < kc, j < nc, zero for nc <= j < NR.
 * op(B)[p][j] is B[p * ldb + j], or B[j * ldb + p] with b_trans; bf: bf16 B, widened here. */
static inline __attribute__((always_inline)) void gdn_pack_b(const int NR, float *restrict dst,
                                                             const void *Bv, int64_t ldb,
                                                             int b_trans, int bf, int64_t k0,
                                                             int64_t kc, int64_t j0, int nc) {
    if (!b_trans) { /* (a variable-length memcpy here compiles to a slow rep movs) */
        const void *s = gdn_eptr(Bv, bf, k0 * ldb + j0);
        if (nc == NR)
            for (int64_t p = 0; p < kc; p++)
#pragma GCC unroll 4
                for (int v = 0; v < NR; v += GDN_VL)
                    gdn_vstoreu(dst + p * NR + v, gdn_loadw(s, bf, p * ldb + v));
        else
            for (int64_t p = 0; p < kc; p++)
                for (int j = 0; j < NR; j++) dst[p * NR + j] = j < nc ? gdn_loadw1(s, bf, p * ldb + j) : 0.0f;
        return;
    }
    const void *s = gdn_eptr(Bv, bf, j0 * ldb + k0);
    int j = 0;
    for (; j + GDN_VL <= nc; j += GDN_VL) {
        int64_t p = 0;
        for (; p + GDN_VL <= kc; p += GDN_VL) {
            gdn_vf r[GDN_VL];
            for (int l = 0; l < GDN_VL; l++) r[l] = gdn_loadw(s, bf, (j + l) * ldb + p);
            gdn_transpose_vl(r);
            for (int l = 0; l < GDN_VL; l++) gdn_vstoreu(dst + (p + l) * NR + j, r[l]);
        }
        for (; p < kc; p++)
            for (int l = 0; l < GDN_VL; l++) dst[p * NR + j + l] = gdn_loadw1(s, bf, (j + l) * ldb + p);
    }
    for (; j < nc; j++)
        for (int64_t p = 0; p < kc; p++) dst[p * NR + j] = gdn_loadw1(s, bf, j * ldb + p);
    for (; j < NR; j++)
        for (int64_t p = 0; p < kc; p++) dst[p * NR + j] = 0.0f;
}

#endif
