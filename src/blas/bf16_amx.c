/* The BF16 GEMM's AMX path (bf16.h): the block kernel (AMX_BLOCK_BODY on TDPBF16PS tiles), the
 * tile configuration and release, and the instruction's register-only peak. Compiled with
 * amx-tile,amx-bf16 per function where the compiler knows them (HAVE_AMX_CODE); run only where
 * CPUID, XCR0 and Linux's permission allow (matmul_bf16.c's probe). */
#include "bf16.h"

#include <omp.h>

#if HAVE_AMX_CODE
__attribute__((target("amx-tile,amx-bf16"))) void gdn_bf16_mk_amx(int64_t kcp, int64_t kst, const uint16_t *a,
                                                               const uint32_t *b, float *C, int64_t ldc,
                                                               int acc, int mr, int nc, int skip) {
#define TZ(d) _tile_zero(d)
#define TL(d, p, s) _tile_loadd(d, p, s)
#define TD(c, x, y) _tile_dpbf16ps(c, x, y)
#define TS(s, p, st) _tile_stored(s, p, st)
    AMX_BLOCK_BODY
#undef TZ
#undef TL
#undef TD
#undef TS
}
__attribute__((target("amx-tile"))) void gdn_bf16_amx_loadcfg(const tilecfg *c) { _tile_loadconfig(c); }
__attribute__((target("amx-tile"))) void gdn_bf16_amx_release(void) { _tile_release(); }

/* Register-only throughput of TDPBF16PS, GFLOP/s (16 x 16 x 32 x 2 = 16384 FLOPs each) over 4
 * accumulator tiles, one run (gdn_measure_bf16_peak_gflops takes the best). */
__attribute__((target("amx-tile,amx-bf16"))) double gdn_bf16_peak_amx_once(int threads) {
    enum { ITERS = 200000 };
    double secs = 0;
    int used = 1;
    static uint16_t src[16 * 32] __attribute__((aligned(64)));
#pragma omp parallel num_threads(threads)
    {
        tilecfg cfg;
        tilecfg_init(&cfg);
        gdn_bf16_amx_loadcfg(&cfg);
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        _tile_loadd(4, src, 64); _tile_loadd(5, src, 64); _tile_loadd(6, src, 64); _tile_loadd(7, src, 64);
#pragma omp barrier
        const double t0 = omp_get_wtime();
        for (int it = 0; it < ITERS; it++) {
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        }
#pragma omp barrier
        const double t1 = omp_get_wtime();
        gdn_bf16_amx_release();
#pragma omp master
        secs = t1 - t0, used = omp_get_num_threads();
    }
    return 16384.0 * 4 * (double)ITERS * used / secs * 1e-9;
}
#endif
