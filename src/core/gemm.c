/* Small fp32 GEMM for the chunk kernel: register-tiled 6 x 16 micro-kernel written with
 * GCC/Clang vector extensions, so one source compiles to AVX-512/AVX2/SSE/NEON as the
 * target allows. The hot shapes are 64x64x128 .. 128x128x64, operands in L1/L2. Each
 * 16-column panel of B is packed into a contiguous kk x 16 block first: in place, its rows
 * (one cache line each, a row stride of 512 bytes) fall into 8 of L1's 64 sets and evict each
 * other, so every row block re-read the panel from L2 (measured: 10-15 % faster packed). */
#include "internal.h"

#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef float v8f_u __attribute__((vector_size(32), aligned(4))); /* unaligned access */

#define MR 6

static inline v8f load8(const float *p) { return *(const v8f_u *)p; }
static inline void store8(float *p, v8f x) { *(v8f_u *)p = x; }

/* mr x (8*nv) block of C from kk products; mr and nv are compile-time after inlining. */
/* A element (i, p) is A[i * ars + p * acs]: (lda, 1) normally, (1, lda) for A transposed. */
static inline __attribute__((always_inline)) void micro(int mr, int nv, int acc, int kk,
                                                        const float *A, int ars, int acs,
                                                        const float *B, int ldb, float *C,
                                                        int ldc) {
    v8f c0[MR], c1[MR];
#pragma GCC unroll 6
    for (int i = 0; i < MR; i++) c0[i] = c1[i] = (v8f){0};
#pragma GCC unroll 4
    for (int p = 0; p < kk; p++) {
        v8f b0 = load8(B + (size_t)p * ldb);
        v8f b1 = nv > 1 ? load8(B + (size_t)p * ldb + 8) : (v8f){0};
#pragma GCC unroll 6
        for (int i = 0; i < MR; i++) {
            if (i < mr) {
                float a = A[(size_t)i * ars + (size_t)p * acs];
                c0[i] += a * b0;
                if (nv > 1) c1[i] += a * b1;
            }
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < MR; i++) {
        if (i < mr) {
            float *ci = C + (size_t)i * ldc;
            store8(ci, acc ? load8(ci) + c0[i] : c0[i]);
            if (nv > 1) store8(ci + 8, acc ? load8(ci + 8) + c1[i] : c1[i]);
        }
    }
}

/* Columns fewer than 8: plain loops. */
static void edge(int acc, int mr, int nc, int kk, const float *A, int ars, int acs, const float *B,
                 int ldb, float *C, int ldc) {
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nc; j++) {
            float s = 0.0f;
            for (int p = 0; p < kk; p++) s += A[(size_t)i * ars + (size_t)p * acs] * B[(size_t)p * ldb + j];
            C[(size_t)i * ldc + j] = acc ? C[(size_t)i * ldc + j] + s : s;
        }
}

#define DISPATCH(mr_, nv_)                                                         \
    micro(mr_, nv_, acc, kk_eff, A + (size_t)i0 * ars, ars, acs, B + j0, ldb,     \
          C + (size_t)i0 * ldc + j0, ldc)

static void block(int acc, int mr, int nv, int kk_eff, int i0, int j0, const float *A, int ars,
                  int acs, const float *B, int ldb, float *C, int ldc) {
    if (acc) {
        if (nv == 2) {
            switch (mr) {
            case 6: DISPATCH(6, 2); return; case 5: DISPATCH(5, 2); return;
            case 4: DISPATCH(4, 2); return; case 3: DISPATCH(3, 2); return;
            case 2: DISPATCH(2, 2); return; default: DISPATCH(1, 2); return;
            }
        }
        switch (mr) {
        case 6: DISPATCH(6, 1); return; case 5: DISPATCH(5, 1); return;
        case 4: DISPATCH(4, 1); return; case 3: DISPATCH(3, 1); return;
        case 2: DISPATCH(2, 1); return; default: DISPATCH(1, 1); return;
        }
    }
    if (nv == 2) {
        switch (mr) {
        case 6: DISPATCH(6, 2); return; case 5: DISPATCH(5, 2); return;
        case 4: DISPATCH(4, 2); return; case 3: DISPATCH(3, 2); return;
        case 2: DISPATCH(2, 2); return; default: DISPATCH(1, 2); return;
        }
    }
    switch (mr) {
    case 6: DISPATCH(6, 1); return; case 5: DISPATCH(5, 1); return;
    case 4: DISPATCH(4, 1); return; case 3: DISPATCH(3, 1); return;
    case 2: DISPATCH(2, 1); return; default: DISPATCH(1, 1); return;
    }
}

/* In-register transpose of an 8 x 8 block: out[c][r] = in[r][c]. */
static inline void transpose8(v8f r[8]) {
    typedef int32_t v8i __attribute__((vector_size(32)));
    v8f t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = __builtin_shuffle(r[i], r[i + 1], (v8i){0, 8, 1, 9, 4, 12, 5, 13});
        t[i + 1] = __builtin_shuffle(r[i], r[i + 1], (v8i){2, 10, 3, 11, 6, 14, 7, 15});
    }
    for (int i = 0; i < 8; i += 4)
        for (int h = 0; h < 2; h++) {
            u[i + 2 * h] = __builtin_shuffle(t[i + h], t[i + 2 + h], (v8i){0, 1, 8, 9, 4, 5, 12, 13});
            u[i + 2 * h + 1] = __builtin_shuffle(t[i + h], t[i + 2 + h], (v8i){2, 3, 10, 11, 6, 7, 14, 15});
        }
    for (int i = 0; i < 4; i++) {
        r[i] = __builtin_shuffle(u[i], u[i + 4], (v8i){0, 1, 2, 3, 8, 9, 10, 11});
        r[i + 4] = __builtin_shuffle(u[i], u[i + 4], (v8i){4, 5, 6, 7, 12, 13, 14, 15});
    }
}

/* panel[p][j] = B[k0 + p][j0 + j] for p < kc, j < nc (row stride 16); with b_trans B is
 * stored as its transpose, B[p][j] = Bt[j * ldb + p], and is transposed 8 x 8 in registers. */
static void pack_panel(float *panel, const float *B, int ldb, int b_trans, int k0, int kc, int j0,
                       int nc) {
    if (!b_trans) { /* (a variable-length memcpy here compiles to a slow rep movs) */
        const float *Bp = B + (size_t)k0 * ldb + j0;
        if (nc == 16)
            for (int p = 0; p < kc; p++) {
                store8(panel + (size_t)p * 16, load8(Bp + (size_t)p * ldb));
                store8(panel + (size_t)p * 16 + 8, load8(Bp + (size_t)p * ldb + 8));
            }
        else
            for (int p = 0; p < kc; p++)
                for (int j = 0; j < nc; j++) panel[(size_t)p * 16 + j] = Bp[(size_t)p * ldb + j];
        return;
    }
    const float *Bt = B + (size_t)j0 * ldb + k0;
    int j = 0;
    for (; j + 8 <= nc; j += 8) {
        int p = 0;
        for (; p + 8 <= kc; p += 8) {
            v8f r[8];
            for (int i = 0; i < 8; i++) r[i] = load8(Bt + (size_t)(j + i) * ldb + p);
            transpose8(r);
            for (int i = 0; i < 8; i++) store8(panel + (size_t)(p + i) * 16 + j, r[i]);
        }
        for (; p < kc; p++)
            for (int i = 0; i < 8; i++) panel[(size_t)p * 16 + j + i] = Bt[(size_t)(j + i) * ldb + p];
    }
    for (; j < nc; j++)
        for (int p = 0; p < kc; p++) panel[(size_t)p * 16 + j] = Bt[(size_t)j * ldb + p];
}

enum { KC = 256 }; /* depth of one packed panel: covers every kk of the chunk kernel */

/* FLOPs the micro-kernels issue (2 per multiply-add actually computed, skipped triangles not
 * counted), for benchmarks: counted per call, added once, only while counting is on. */
static int counting;
static uint64_t issued;
void gdn_flops_issued_start(void) {
    __atomic_store_n(&issued, 0, __ATOMIC_RELAXED);
    counting = 1;
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
    const int ars = (flags & GDN_GEMM_A_TRANS) ? 1 : lda, acs = (flags & GDN_GEMM_A_TRANS) ? lda : 1;
    if (m <= 0 || n <= 0) return;
    if (kk <= 0) {
        if (!acc)
            for (int i = 0; i < m; i++) memset(C + (size_t)i * ldc, 0, sizeof(float) * n);
        return;
    }
    float panel[KC * 16] __attribute__((aligned(64)));
    uint64_t flops = 0;
    for (int j0 = 0; j0 < n; j0 += 16) {
        const int nc = n - j0 < 16 ? n - j0 : 16;
        /* With a lower-triangular result, row blocks entirely above this panel are skipped. */
        const int i_start = c_lower ? (j0 / MR) * MR : 0;
        for (int k0 = 0; k0 < kk; k0 += KC) {
            const int kc = kk - k0 < KC ? kk - k0 : KC, acc_k = acc || k0 > 0;
            pack_panel(panel, B, ldb, b_trans, k0, kc, j0, nc);
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
                const float *Ak = A + (size_t)lo * acs, *Bk = panel + (size_t)(lo - k0) * 16;
                float *Cb = C + j0;
                if (nc == 16) {
                    block(acc_k, mr, 2, kk_eff, i0, 0, Ak, ars, acs, Bk, 16, Cb, ldc);
                    continue;
                }
                int j = 0;
                if (nc >= 8) block(acc_k, mr, 1, kk_eff, i0, 0, Ak, ars, acs, Bk, 16, Cb, ldc), j = 8;
                if (j < nc)
                    edge(acc_k, mr, nc - j, kk_eff, Ak + (size_t)i0 * ars, ars, acs, Bk + j, 16,
                         Cb + (size_t)i0 * ldc + j, ldc);
            }
        }
    }
    if (counting) __atomic_fetch_add(&issued, flops, __ATOMIC_RELAXED);
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

const char *gdn_gemm_path(void) {
#if defined(__AVX512F__)
    return "fused-chunk/vec8x6x16 (AVX-512 target)";
#elif defined(__AVX2__) && defined(__FMA__)
    return "fused-chunk/vec8x6x16 (AVX2+FMA)";
#elif defined(__AVX__)
    return "fused-chunk/vec8x6x16 (AVX)";
#elif defined(__SSE2__)
    return "fused-chunk/vec8x6x16 (SSE2, portable build)";
#else
    return "fused-chunk/vec8x6x16 (generic vectors)";
#endif
}
