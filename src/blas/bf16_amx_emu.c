/* The BF16 GEMM's AMX emulator (bf16.h): 8 tile registers per thread in memory and TDPBF16PS as
 * the hardware computes it, running the AMX block kernel's source (AMX_BLOCK_BODY) on any CPU,
 * so that the AMX path's blocking, packing and tile bookkeeping are tested everywhere. */
#include "bf16.h"

#include <math.h>
#include <string.h>

/* The emulator: 8 tile registers of 16 rows x 64 bytes, per thread; rows/colsb from the config. */
typedef struct {
    uint8_t t[8][16][64];
    tilecfg cfg;
} emu_tiles;
static _Thread_local emu_tiles emu;
void gdn_bf16_emu_loadcfg(const tilecfg *c) { emu.cfg = *c; }
static void emu_zero(int d) { memset(emu.t[d], 0, sizeof emu.t[d]); }
static void emu_load(int d, const void *base, int64_t stride) {
    emu_zero(d);
    for (int r = 0; r < emu.cfg.rows[d]; r++) memcpy(emu.t[d][r], (const char *)base + r * stride, emu.cfg.colsb[d]);
}
static void emu_store(int s, void *base, int64_t stride) {
    for (int r = 0; r < emu.cfg.rows[s]; r++) memcpy((char *)base + r * stride, emu.t[s][r], emu.cfg.colsb[s]);
}
static inline float emu_bf(const uint8_t *p) { /* make_fp32 with DAZ: a zero exponent is zero */
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t u = (uint32_t)h << 16;
    if (!(u & 0x7f800000u)) u &= 0x80000000u;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline float emu_ftz(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if (!(u & 0x7f800000u)) u &= 0x80000000u;
    memcpy(&x, &u, sizeof x);
    return x;
}
/* TDPBF16PS c, a, b as the hardware computes it (measured, see the top of matmul_bf16.c): per element,
 * two fp32 partial sums from +0, E over the even elements of the instruction's 16 pairs and O over
 * the odd ones, each step one fused multiply-add rounded to nearest even (the product is exact,
 * even below fp32's normal range) and flushed if subnormal; then c = c + (E + O), the two additions
 * rounded and flushed. Inputs (bf16 and c) with a zero exponent are zero. */
static void emu_dpbf16ps(int c, int a, int b) {
    const int M = emu.cfg.rows[c], K = emu.cfg.colsb[a] / 4, N = emu.cfg.colsb[c] / 4;
    for (int m = 0; m < M; m++) {
        float tmp[16];
        memcpy(tmp, emu.t[c][m], sizeof tmp);
        for (int n = 0; n < N; n++) {
            float even = 0.0f, odd = 0.0f;
            for (int k = 0; k < K; k++) {
                even = emu_ftz(fmaf(emu_bf(&emu.t[a][m][4 * k]), emu_bf(&emu.t[b][k][4 * n]), even));
                odd = emu_ftz(fmaf(emu_bf(&emu.t[a][m][4 * k + 2]), emu_bf(&emu.t[b][k][4 * n + 2]), odd));
            }
            tmp[n] = emu_ftz(emu_ftz(tmp[n]) + emu_ftz(even + odd));
        }
        memcpy(emu.t[c][m], tmp, sizeof tmp);
    }
}

void gdn_bf16_mk_amx_emu(int64_t kcp, int64_t kst, const uint16_t *a, const uint32_t *b, float *C, int64_t ldc,
                       int acc, int mr, int nc, int skip) {
#define TZ(d) emu_zero(d)
#define TL(d, p, s) emu_load(d, p, s)
#define TD(c, x, y) emu_dpbf16ps(c, x, y)
#define TS(s, p, st) emu_store(s, p, st)
    AMX_BLOCK_BODY
#undef TZ
#undef TL
#undef TD
#undef TS
}
