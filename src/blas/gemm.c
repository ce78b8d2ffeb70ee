/* Small fp32 GEMM for the chunk kernel: the register-tiled micro-kernel of microkernel.h at
 * the target's vector width (MR x 2 vectors: 8 x 32 with AVX-512, 6 x 16 with AVX2, 6 x 8
 * otherwise). The hot shapes are 64x64x128 .. 128x128x64, operands in L1/L2: every m, n and
 * depth there is a multiple of 64, so 8-row tiles (not the blocked GEMM's 14) leave no ragged
 * row block, and the whole depth runs in one pass over a packed B panel (pack.h: the panel is
 * kk x NR, 16 KB at 128 x 32, in L1). A is read in place (or as its transpose), one broadcast
 * per row and depth step: packing it would copy m x kk for 2-4 uses.
 *
 * Measured (AMD EPYC Zen 4, 1 thread, the chunk kernel's call shapes at C = 64, K = V = 128 in
 * L1/L2, best of 5, interleaved with the former 8-lane 6 x 16 kernel on a shared machine): the
 * forward's set of products 92.9 -> 100.5 GFLOP/s issued, the backward's 92.0 -> 99.1, of a
 * 117 GFLOP/s peak; one 8 x 32 tile alone runs at 115 (98 %), the rest is packing and the
 * short-depth tiles of the triangular products. Zen 4 splits a 512-bit FMA into two 256-bit
 * halves (its 16- and 8-lane peaks are both 117 GFLOP/s), so the gain there is fewer
 * instructions and loads per FLOP; on cores with two 512-bit FMA pipes it is the width. */
#include "base.h"
#include "blas.h"
#include "pack.h"

#include <string.h>

#if GDN_VL == 16
#define MR 8 /* 16 accumulators + 2 B vectors of 32 zmm registers */
#else
#define MR 6 /* 12 accumulators + 2 B vectors of 16 registers */
#endif
#define NV 2
#define NR (NV * GDN_VL)

enum { KC = 256 }; /* depth of one packed panel: covers every kk of the chunk kernel */

/* FLOPs the micro-kernels issue (2 per multiply-add actually computed, skipped triangles not
 * counted), for benchmarks: counted per call, added once, only while counting is on. */
static int counting;
static uint64_t issued;
void gdn_flops_issued_start(void) {
    __atomic_store_n(&issued, 0, __ATOMIC_RELAXED);
    counting = 1;
}
void gdn_flops_issued_add(uint64_t flops) {
    if (counting) __atomic_fetch_add(&issued, flops, __ATOMIC_RELAXED);
}
uint64_t gdn_flops_issued_stop(void) {
    counting = 0;
    return __atomic_load_n(&issued, __ATOMIC_RELAXED);
}

void gdn_gemm(int flags, int m, int n, int kk, const float *A, int lda, const float *B, int ldb,
              float *C, int ldc) {
    const int acc = (flags & GDN_GEMM_ACC) != 0;
    const int a_lower = (flags & GDN_GEMM_A_LOWER) != 0, a_upper = (flags & GDN_GEMM_A_UPPER) != 0;
    const int c_lower = (flags & GDN_GEMM_C_LOWER) != 0;
    const int b_trans = (flags & GDN_GEMM_B_TRANS) != 0;
    const int fma_bf16 = flags & (GDN_GEMM_ROUND_BF16 | GDN_GEMM_TRUNC_BF16 | GDN_GEMM_SHIFT_BF16);
    const int ars = (flags & GDN_GEMM_A_TRANS) ? 1 : lda, acs = (flags & GDN_GEMM_A_TRANS) ? lda : 1;
    if (m <= 0 || n <= 0) return;
    if (kk <= 0) {
        if (!acc)
            for (int i = 0; i < m; i++) memset(C + (size_t)i * ldc, 0, sizeof(float) * n);
        return;
    }
    float panel[KC * NR] __attribute__((aligned(64)));
    uint64_t flops = 0;
    for (int j0 = 0; j0 < n; j0 += NR) {
        const int nc = n - j0 < NR ? n - j0 : NR;
        /* With a lower-triangular result, row blocks entirely above this panel are skipped. */
        const int i_start = c_lower ? (j0 / MR) * MR : 0;
        for (int k0 = 0; k0 < kk; k0 += KC) {
            const int kc = kk - k0 < KC ? kk - k0 : KC, acc_k = acc || k0 > 0;
            gdn_pack_b(NR, panel, B, ldb, b_trans, 0, k0, kc, j0, nc);
            if (fma_bf16) gdn_fma_panel_b(panel, kc, NR, fma_bf16); /* the BF16 GEMM's FMA path */
            for (int i0 = i_start; i0 < m; i0 += MR) {
                const int mr = m - i0 < MR ? m - i0 : MR;
                /* Depth range with nonzero A in this row block, within this depth block. */
                int lo = a_upper ? i0 : 0, hi = a_lower ? (i0 + mr < kk ? i0 + mr : kk) : kk;
                lo = lo > k0 ? lo : k0, hi = hi < k0 + kc ? hi : k0 + kc;
                if (hi <= lo) {
                    if (acc_k) continue; /* nothing to add */
                    lo = hi = k0;        /* a zero block */
                }
                const int kk_eff = hi - lo;
                flops += 2 * (uint64_t)mr * nc * kk_eff;
                gdn_mk_rows(MR, NV, 0, mr, kk_eff, A + (size_t)i0 * ars + (size_t)lo * acs, ars, acs,
                            panel + (size_t)(lo - k0) * NR, NR, C + (size_t)i0 * ldc + j0, ldc, nc,
                            acc_k);
            }
        }
    }
    gdn_flops_issued_add(flops);
}

/* Tiles of 16 x 16 keep both the reads and the strided writes inside a few cache lines. */
void gdn_transpose(int rows, int cols, const float *src, int lds, float *dst, int ldd) {
    enum { TILE = 16 };
    for (int r0 = 0; r0 < rows; r0 += TILE)
        for (int c0 = 0; c0 < cols; c0 += TILE) {
            const int r1 = r0 + TILE < rows ? r0 + TILE : rows, c1 = c0 + TILE < cols ? c0 + TILE : cols;
            if (r1 - r0 == TILE && c1 - c0 == TILE) {
                float tile[TILE][TILE];
                for (int r = 0; r < TILE; r++)
                    for (int c = 0; c < TILE; c++) tile[c][r] = src[(size_t)(r0 + r) * lds + c0 + c];
                for (int c = 0; c < TILE; c++)
                    for (int r = 0; r < TILE; r++) dst[(size_t)(c0 + c) * ldd + r0 + r] = tile[c][r];
                continue;
            }
            for (int r = r0; r < r1; r++)
                for (int c = c0; c < c1; c++) dst[(size_t)c * ldd + r] = src[(size_t)r * lds + c];
        }
}

#define STR_(x) #x
#define STR(x) STR_(x)
const char *gdn_gemm_path(void) {
#if defined(__AVX512F__)
#define ISA "AVX-512"
#elif defined(__AVX2__) && defined(__FMA__)
#define ISA "AVX2+FMA"
#elif defined(__AVX__)
#define ISA "AVX"
#elif defined(__SSE2__)
#define ISA "SSE2, portable build"
#else
#define ISA "generic vectors"
#endif
    return "fused-chunk/vec" GDN_VL_STR "x" STR(MR) "x" GDN_2VL_STR " (" ISA ")";
}
