/* The BF16 GEMM's packers (bf16.h), shared by every path: op(A) and op(B), fp32 or bf16, plain
 * or transposed, rounded to bfloat16 (nearest even) into the pair layouts of the top of
 * matmul_bf16.c; the rounding in portable vectors, or by VCVTNE2PS2BF16 (hw) on the paths whose
 * CPU has AVX512-BF16. */
#include "bf16.h"

#include <string.h>

/* ---------------------------------------------------------------- bf16 */

static inline uint16_t to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7f800000u) == 0x7f800000u) /* Inf, NaN: keep (NaN stays NaN) */
        return (uint16_t)((u >> 16) | ((u & 0xffffu) ? 0x40u : 0u));
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
uint16_t gdn_f32_to_bf16(float x) { return to_bf16(x); }

/* op(X)[r][c] as fp32 from an fp32 or bf16 matrix (trans: stored as its transpose). */
static inline float elt(const void *X, int bf, int trans, int64_t ld, int64_t r, int64_t c) {
    const int64_t i = trans ? c * ld + r : r * ld + c;
    if (!bf) return ((const float *)X)[i];
    const uint32_t u = (uint32_t)((const uint16_t *)X)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
/* The same rounded to bf16; trunc: truncated instead (the control GDN_BF16_MUT_TRUNCATE). */
static inline uint16_t eltb(const void *X, int bf, int trans, int64_t ld, int64_t r, int64_t c, int trunc) {
    if (bf && !trunc) return ((const uint16_t *)X)[trans ? c * ld + r : r * ld + c];
    const float x = elt(X, bf, trans, ld, r, c);
    if (!trunc) return to_bf16(x);
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (uint16_t)(u >> 16);
}

/* ---------------------------------------------------------------- packing */

/* Vector rounding (the same bits as to_bf16): lane l of the result holds bf16(x[2l]) |
 * bf16(x[2l+1]) << 16 for 2 GDN_VL contiguous fp32 values x, i.e. GDN_VL k-pairs. */
static inline gdn_vu rne_v(gdn_vu u) {
    const gdn_vu r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const gdn_vu special = (gdn_vu)((u & 0x7f800000u) == 0x7f800000u); /* Inf, NaN */
    const gdn_vu sp = (u >> 16) | ((gdn_vu)((u & 0xffffu) != 0) & 0x40u);
    return (sp & special) | (r & ~special);
}
#if GDN_VL == 16
#define EVEN_IDX {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}
#define ODD_IDX {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}
#elif GDN_VL == 8
#define EVEN_IDX {0, 2, 4, 6, 8, 10, 12, 14}
#define ODD_IDX {1, 3, 5, 7, 9, 11, 13, 15}
#else
#define EVEN_IDX {0, 2, 4, 6}
#define ODD_IDX {1, 3, 5, 7}
#endif
static inline gdn_vu pairs_vl(const float *x) {
    gdn_vu u0, u1;
    memcpy(&u0, x, sizeof u0);
    memcpy(&u1, x + GDN_VL, sizeof u1);
    u0 = rne_v(u0), u1 = rne_v(u1);
    const gdn_vu e = __builtin_shuffle(u0, u1, (gdn_vu)EVEN_IDX), o = __builtin_shuffle(u0, u1, (gdn_vu)ODD_IDX);
    return e | (o << 16);
}


/* bf16(x[l]) in the low half of lane l, for GDN_VL floats x (n of them, the rest 0). */
static inline gdn_vu bf16_lo_vl(const float *x, int n) {
    gdn_vu u = {0};
    if (n >= GDN_VL) memcpy(&u, x, sizeof u);
    else memcpy(&u, x, sizeof(float) * (size_t)(n > 0 ? n : 0));
    return rne_v(u);
}
/* B micro-panel: dst[p * NR + j] = pair (2p, 2p+1) of column j0 + j of op(B), k rows k0.., for
 * p < kp (rows past kc and columns past nc zero). hw: round with VCVTNE2PS2BF16 (bf16.h). */
void gdn_bf16_panel_b(uint32_t *restrict dst, const void *B, int bf, int bt, int64_t ldb, int64_t k0,
                   int64_t kc, int64_t kp, int64_t j0, int nc, int hw, int mut) {
    const int off = (mut & GDN_BF16_MUT_PAIR_SHIFT) != 0, trunc = mut & GDN_BF16_MUT_TRUNCATE; /* off: pairs (2p+1, 2p+2) */
    mut &= GDN_BF16_MUT_PACKING;
    if (bt && !bf && !mut) { /* W [n x kk] fp32: each column's k contiguous, VL pairs a step */
        for (int j = 0; j < NR; j++) {
            const float *src = j < nc ? (const float *)B + (j0 + j) * ldb + k0 : NULL;
            int64_t p = 0;
#if HAVE_HW_CVT
            if (hw && j < nc)
                for (; 2 * p + 32 <= kc; p += 16) {
                    uint32_t w[16];
                    hw_pairs32(w, src + 2 * p, 32);
                    for (int l = 0; l < 16; l++) dst[(p + l) * NR + j] = w[l];
                }
#endif
            if (j < nc)
                for (; 2 * p + 2 * GDN_VL <= kc; p += GDN_VL) {
                    const gdn_vu w = pairs_vl(src + 2 * p);
                    for (int l = 0; l < GDN_VL; l++) dst[(p + l) * NR + j] = w[l];
                }
            for (; p < kp; p++) {
                uint32_t w = 0;
                if (j < nc) {
                    if (2 * p < kc) w = to_bf16(src[2 * p]);
                    if (2 * p + 1 < kc) w |= (uint32_t)to_bf16(src[2 * p + 1]) << 16;
                }
                dst[p * NR + j] = w;
            }
        }
        return;
    }
    if (!bt && !bf && !mut) { /* B [kk x n] fp32 rows: a pair is two rows' columns j0.. */
        for (int64_t p = 0; p < kp; p++) {
            if (2 * p >= kc) { /* AMX pads the slice to 32 deep: zero pairs */
                memset(dst + p * NR, 0, sizeof(uint32_t) * NR);
                continue;
            }
            const float *r0 = (const float *)B + (k0 + 2 * p) * ldb + j0, *r1 = r0 + ldb;
            const int has1 = 2 * p + 1 < kc;
#if HAVE_HW_CVT
            if (hw) {
                for (int j = 0; j < NR; j += 16) hw_interleave16(dst + p * NR + j, r0 + j, has1 ? r1 + j : NULL, nc - j);
                continue;
            }
#endif
            for (int j = 0; j < NR; j += GDN_VL) {
                const int n = nc - j;
                const gdn_vu w = bf16_lo_vl(r0 + j, n) | (has1 ? bf16_lo_vl(r1 + j, n) << 16 : (gdn_vu){0});
                memcpy(dst + p * NR + j, &w, sizeof w);
            }
        }
        return;
    }
    for (int64_t p = 0; p < kp; p++)
        for (int j = 0; j < NR; j++) {
            uint32_t w = 0;
            if (j < nc) {
                const int64_t k = 2 * p + off;
                if (k < kc) w = eltb(B, bf, bt, ldb, k0 + k, j0 + j, trunc);
                if (k + 1 < kc) w |= (uint32_t)eltb(B, bf, bt, ldb, k0 + k + 1, j0 + j, trunc) << 16;
            }
            dst[p * NR + j] = w;
        }
}

/* A panels for the vector tiles: for each MR_V rows, dst[p * MR_V + i] = pair of row i; for the
 * fallback (widen), the pair's two bf16 values widened to fp32, dst[2 (p * MR_V + i) + 0/1] (even,
 * odd): the same values, so that its micro-kernel broadcasts them straight from memory. hw: rows
 * of fp32 A rounded with VCVTNE2PS2BF16 (A^T: gdn_bf16_pack_a_trans_v_hw). */
void gdn_bf16_panel_a_v(uint32_t *restrict dst, const void *A, int bf, int at, int64_t lda, int64_t i0,
                     int64_t mr, int64_t k0, int64_t kc, int64_t kp, int widen, int hw, int mut) {
    const int trunc = mut & GDN_BF16_MUT_TRUNCATE;
    mut &= GDN_BF16_MUT_PACKING;
    if (!at && !bf && !mut) { /* rows of fp32 A: k contiguous, VL pairs a step */
        for (int i = 0; i < MR_V; i++) {
            const float *src = i < mr ? (const float *)A + (i0 + i) * lda + k0 : NULL;
            int64_t p = 0;
#if HAVE_HW_CVT
            if (hw && !widen && i < mr)
                for (; 2 * p + 32 <= kc; p += 16) {
                    uint32_t w[16];
                    hw_pairs32(w, src + 2 * p, 32);
                    for (int l = 0; l < 16; l++) dst[(p + l) * MR_V + i] = w[l];
                }
#else
            (void)hw;
#endif
            if (i < mr)
                for (; 2 * p + 2 * GDN_VL <= kc; p += GDN_VL) {
                    const gdn_vu w = pairs_vl(src + 2 * p);
                    for (int l = 0; l < GDN_VL; l++) {
                        const int64_t d = (p + l) * MR_V + i;
                        if (widen)
                            dst[2 * d] = w[l] << 16, dst[2 * d + 1] = w[l] & 0xffff0000u;
                        else
                            dst[d] = w[l];
                    }
                }
            for (; p < kp; p++) {
                uint32_t w = 0;
                if (i < mr) {
                    if (2 * p < kc) w = to_bf16(src[2 * p]);
                    if (2 * p + 1 < kc) w |= (uint32_t)to_bf16(src[2 * p + 1]) << 16;
                }
                const int64_t d = p * MR_V + i;
                if (widen)
                    dst[2 * d] = w << 16, dst[2 * d + 1] = w & 0xffff0000u;
                else
                    dst[d] = w;
            }
        }
        return;
    }
    if (at && !bf && !mut) { /* A^T [kk x m] fp32: a pair is two rows' entries i0.. */
        for (int64_t p = 0; p < kp; p++) {
            const float *r0 = (const float *)A + (k0 + 2 * p) * lda + i0, *r1 = r0 + lda;
            const int has1 = 2 * p + 1 < kc;
            uint32_t w[MR_V + GDN_VL];
            for (int i = 0; i < MR_V; i += GDN_VL) {
                const int n = (int)mr - i < MR_V - i ? (int)mr - i : MR_V - i;
                const gdn_vu v = bf16_lo_vl(r0 + i, n) | (has1 ? bf16_lo_vl(r1 + i, n) << 16 : (gdn_vu){0});
                memcpy(w + i, &v, sizeof v);
            }
            for (int i = 0; i < MR_V; i++) {
                const int64_t d = p * MR_V + i;
                if (widen)
                    dst[2 * d] = w[i] << 16, dst[2 * d + 1] = w[i] & 0xffff0000u;
                else
                    dst[d] = w[i];
            }
        }
        return;
    }
    for (int64_t p = 0; p < kp; p++)
        for (int i = 0; i < MR_V; i++) {
            uint32_t w = 0;
            if (i < mr) {
                w = eltb(A, bf, at, lda, i0 + i, k0 + 2 * p, trunc);
                if (2 * p + 1 < kc) w |= (uint32_t)eltb(A, bf, at, lda, i0 + i, k0 + 2 * p + 1, trunc) << 16;
            }
            if (widen)
                dst[2 * (p * MR_V + i)] = w << 16, dst[2 * (p * MR_V + i) + 1] = w & 0xffff0000u;
            else
                dst[p * MR_V + i] = w;
        }
}

/* A panel for AMX: MR_X rows of kcp bf16 each (zero past kc and past mr). */
void gdn_bf16_panel_a_x(uint16_t *restrict dst, const void *A, int bf, int at, int64_t lda, int64_t i0,
                     int64_t mr, int64_t k0, int64_t kc, int64_t kcp, int hw, int mut) {
    const int trunc = mut & GDN_BF16_MUT_TRUNCATE;
    mut &= GDN_BF16_MUT_PACKING;
    if (!at && !bf && !mut) { /* rows of fp32 A: the pairs' words are the row's bf16 */
        for (int i = 0; i < MR_X; i++) {
            const float *src = i < mr ? (const float *)A + (i0 + i) * lda + k0 : NULL;
            int64_t k = 0;
#if HAVE_HW_CVT
            if (hw && i < mr) { /* kcp is a multiple of 32: the row's tail zero-padded by the masks */
                for (; k < kcp; k += 32) hw_pairs32((uint32_t *)(dst + i * kcp + k), src + k, (int)(kc - k));
                continue;
            }
#endif
            if (i < mr)
                for (; k + 2 * GDN_VL <= kc; k += 2 * GDN_VL) {
                    const gdn_vu w = pairs_vl(src + k);
                    memcpy(dst + i * kcp + k, &w, sizeof w);
                }
            for (; k < kcp; k++) dst[i * kcp + k] = i < mr && k < kc ? to_bf16(src[k]) : 0;
        }
        return;
    }
    if (at && !bf && !mut) { /* A^T [kk x m] fp32: row k of A^T is column k of 32 rows */
        memset(dst, 0, sizeof(uint16_t) * (size_t)MR_X * (size_t)kcp);
        for (int64_t k = 0; k < kc; k++) {
            const float *r = (const float *)A + (k0 + k) * lda + i0;
            for (int i = 0; i < MR_X && i < mr; i += GDN_VL) {
                const gdn_vu v = bf16_lo_vl(r + i, (int)mr - i);
                for (int l = 0; l < GDN_VL && i + l < mr; l++) dst[(i + l) * kcp + k] = (uint16_t)v[l];
            }
        }
        return;
    }
    for (int i = 0; i < MR_X; i++)
        for (int64_t k = 0; k < kcp; k++)
            dst[i * kcp + k] = i < mr && k < kc ? eltb(A, bf, at, lda, i0 + i, k0 + k, trunc) : 0;
}
