/* The BF16 GEMM's fallback micro-kernel (bf16.h): the AVX512-BF16 tile's layout and arithmetic
 * in portable vector code (GCC/Clang vector extensions at the target's width), bit-identical to
 * VDPBF16PS; a test-only mode in TDPBF16PS's order. */
#include "bf16.h"

#include <math.h>
#include <string.h>

#define NVF (NR / GDN_VL)
/* rows per pass (MR_V = 14 split): accumulators FB_ROWS x NVF + widened B vectors in the register
 * file (32 zmm with AVX-512: 7 x 2 + 4; 16 ymm with AVX: 2 x 4 + 8; 16 xmm: 1 x 8 + ...) */
#if GDN_VL == 16
#define FB_ROWS 7
#elif GDN_VL == 8
#define FB_ROWS 2
#else
#define FB_ROWS 1
#endif
static inline gdn_vf lo_f(gdn_vu w) { gdn_vf f; w <<= 16; memcpy(&f, &w, sizeof f); return f; }
static inline gdn_vf hi_f(gdn_vu w) { gdn_vf f; w &= 0xffff0000u; memcpy(&f, &w, sizeof f); return f; }
static inline float bf_lo(uint32_t w) { float f; w <<= 16; memcpy(&f, &w, sizeof f); return f; }
static inline float bf_hi(uint32_t w) { float f; w &= 0xffff0000u; memcpy(&f, &w, sizeof f); return f; }

/* a: the widened A panel (pairs of fp32). VDPBF16PS's order: per pair, the odd product into the
 * accumulator, then the even one. */
static inline __attribute__((always_inline)) void mk_fb(int64_t kp, const float *a, const uint32_t *b, float *t) {
    for (int r0 = 0; r0 < MR_V; r0 += FB_ROWS) {
        gdn_vf c[FB_ROWS][NVF];
        for (int i = 0; i < FB_ROWS; i++)
            for (int v = 0; v < NVF; v++) c[i][v] = (gdn_vf){0};
        for (int64_t p = 0; p < kp; p++) {
            gdn_vf be[NVF], bo[NVF];
            for (int v = 0; v < NVF; v++) {
                const gdn_vu w = *(const gdn_vu *)(b + p * NR + v * GDN_VL);
                be[v] = lo_f(w), bo[v] = hi_f(w);
            }
            for (int i = 0; i < FB_ROWS; i++) {
                const float ae = a[2 * (p * MR_V + r0 + i)], ao = a[2 * (p * MR_V + r0 + i) + 1];
                for (int v = 0; v < NVF; v++) {
                    c[i][v] += ao * bo[v];
                    c[i][v] += ae * be[v];
                }
            }
        }
        for (int i = 0; i < FB_ROWS; i++)
            for (int v = 0; v < NVF; v++) *(gdn_vf *)(t + (r0 + i) * NR + v * GDN_VL) = c[i][v];
    }
}
/* Tests only: the AMX path's arithmetic (see the top of the file): per element, from C (acc) or
 * zero, the pairs in blocks of 16 from the slice's start, each block's even and odd partial sums
 * from zero, then acc += even + odd. */
static void mk_fb_amx_order(int64_t kp, const float *a, const uint32_t *b, float *C, int64_t ldc, int acc,
                            int mr, int nc) {
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nc; j++) {
            float c = acc ? C[i * ldc + j] : 0.0f;
            for (int64_t p0 = 0; p0 < kp; p0 += 16) {
                float even = 0.0f, odd = 0.0f;
                for (int64_t p = p0; p < p0 + 16 && p < kp; p++) {
                    const uint32_t w = b[p * NR + j];
                    even = fmaf(a[2 * (p * MR_V + i)], bf_lo(w), even);
                    odd = fmaf(a[2 * (p * MR_V + i) + 1], bf_hi(w), odd);
                }
                c += even + odd;
            }
            C[i * ldc + j] = c;
        }
}
void gdn_bf16_mk_fallback(int64_t kp, const float *a, const uint32_t *b, float *C, int64_t ldc, int acc,
                        int mr, int nc, int amx_order) {
    if (amx_order) { /* tests: = the AMX emulator bit for bit */
        mk_fb_amx_order(kp, a, b, C, ldc, acc, mr, nc);
        return;
    }
    float t[MR_V * NR] __attribute__((aligned(64)));
    mk_fb(kp, a, b, t);
    store_tile(t, NR, C, ldc, mr, nc, acc);
}
