/* The BF16-compute GEMM's framework (matmul_bf16.c and its kernels), one file per ISA path as
 * BLIS keeps one kernel set per architecture:
 *   matmul_bf16.c     the driver: path choice (CPUID probes), blocking, the threaded loops, the
 *                     small and pre-packed GEMMs, the peaks' dispatch and the bench probes;
 *   bf16_pack.c       the packers of every path (portable rounding, or VCVTNE2PS2BF16 where the
 *                     CPU has it);
 *   bf16_fallback.c   portable vector code (the paths' arithmetic in fp32 vectors);
 *   bf16_avx512.c     AVX512-BF16: VDPBF16PS, its transposing packers, its peak;
 *   bf16_amx.c        AMX: TDPBF16PS tiles, tile config and release, its peak;
 *   bf16_amx_emu.c    the scalar TDPBF16PS emulator running the AMX kernel's source.
 * Each ISA file carries its own target attributes; the driver calls its kernels through mk_run.
 * What the paths compute, bit for bit, and how they pack: the top of matmul_bf16.c. Internal to
 * src/blas. */
#ifndef GDNCP_BLAS_BF16_H
#define GDNCP_BLAS_BF16_H

#include "base.h"
#include "blas.h"
#include "microkernel.h"

#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define HAVE_X86 1
#define HAVE_HW_CVT 1 /* VCVTNE2PS2BF16 packing compiled (used where the CPU has AVX512-BF16) */
#else
#define HAVE_X86 0
#define HAVE_HW_CVT 0
#endif
#if HAVE_X86 && (__GNUC__ >= 11 || defined(__clang__))
#define HAVE_AMX_CODE 1
#else
#define HAVE_AMX_CODE 0
#endif

/* Blocking (overridable at compile time for tuning): depth of a slice, columns of the shared B
 * panel and rows per pass, for the vector paths (_V) and for AMX (_X). */
#ifndef GDN_BF_KC
#define GDN_BF_KC 512
#endif
#ifndef GDN_BF_NC
#define GDN_BF_NC 1024 /* 1 MB of B panel; measured 84-86 % of the VDPBF16PS peak vs 81-82 % at 512 (Zen 4, 1 thread) */
#endif
#ifndef GDN_BF_KC_X
#define GDN_BF_KC_X 2048
#endif
#ifndef GDN_BF_NC_X
#define GDN_BF_NC_X 256
#endif
#ifndef GDN_BF_MC_X
#define GDN_BF_MC_X 2048
#endif
#ifndef GDN_BF_MCP
#define GDN_BF_MCP 8
#endif

enum { NR = 32,        /* columns of a B micro-panel (2 zmm, 2 AMX B tiles) */
       MR_V = 14,      /* rows of the AVX512-BF16 / fallback tile */
       MR_X = 32,      /* rows of the AMX block (2 A tiles) */
       KC_V = GDN_BF_KC, /* depth of a slice (even) */
       NC_V = GDN_BF_NC, /* columns of the shared B panel: KC_V x NC_V bf16 (1 MB) */
       MC_V = 4480,      /* rows per pass (a multiple of MR_V): the packed A slice is at most
                            MC_V x KC_V, so the workspace is bounded (4.6 MB; the fallback's fp32
                            panels 9.2 MB) and B is packed once per MC_V rows */
       /* AMX: the C block stays in tiles over a slice 4x as deep (C read and written once per
        * 2048 of depth: at 4096 x 8192 x 2048 the 512-deep slices moved 1 GB of C), with the B
        * panel (2048 x 256 bf16, 1 MB) in L2; measured on a Sapphire Rapids-class Xeon, 2
        * threads: 1.03-1.3x the 512 / 1024 blocking (docs/performance.md) */
       KC_X = GDN_BF_KC_X, /* a multiple of 32 */
       NC_X = GDN_BF_NC_X,
       MC_X = GDN_BF_MC_X, /* a multiple of MR_X: the A slice at most 2048 x 2048 bf16 (8 MB) */
       MCP_V = GDN_BF_MCP, /* MR_V panels per work item */
       MCP_X = 4 };        /* MR_X panels per work item */

/* The path's blocking. */
typedef struct {
    int amx, MR, MCP;
    int64_t KC, NC, MC;
} bf_blocking;
static inline bf_blocking blocking(int path) {
    const int amx = path == GDN_BF16_AMX || path == GDN_BF16_AMX_EMU;
    if (amx) return (bf_blocking){1, MR_X, MCP_X, KC_X, NC_X, MC_X};
    return (bf_blocking){0, MR_V, MCP_V, KC_V, NC_V, MC_V};
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Write a computed tile t (rows of NR floats) into C: mr rows, nc columns, added or stored. */
static inline void store_tile(const float *t, int tld, float *C, int64_t ldc, int mr, int nc, int acc) {
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nc; j++) C[i * ldc + j] = acc ? C[i * ldc + j] + t[i * tld + j] : t[i * tld + j];
}

/* ---------------------------------------------------------------- packers (bf16_pack.c) */

/* B micro-panel: NR columns j0.. of op(B), kp pairs from depth k0 (kc deep); A panels for the
 * vector tiles (MR_V rows; widen: the fallback's fp32 pairs) and for AMX (MR_X rows of kcp
 * bf16). bf: that operand is bf16; hw: round with VCVTNE2PS2BF16; mut: gdn_bf16_mutations(). */
void gdn_bf16_panel_b(uint32_t *restrict dst, const void *B, int bf, int bt, int64_t ldb, int64_t k0, int64_t kc,
                      int64_t kp, int64_t j0, int nc, int hw, int mut);
void gdn_bf16_panel_a_v(uint32_t *restrict dst, const void *A, int bf, int at, int64_t lda, int64_t i0, int64_t mr,
                        int64_t k0, int64_t kc, int64_t kp, int widen, int hw, int mut);
void gdn_bf16_panel_a_x(uint16_t *restrict dst, const void *A, int bf, int at, int64_t lda, int64_t i0, int64_t mr,
                        int64_t k0, int64_t kc, int64_t kcp, int hw, int mut);

/* The packers' rounding by VCVTNE2PS2BF16 (the packing of the paths whose CPU has AVX512-BF16,
 * `hw`): nearest even, as bf16_pack.c's to_bf16 for every finite input that is not subnormal; a subnormal
 * input becomes zero and a NaN a quiet NaN, which changes no product (VDPBF16PS, TDPBF16PS and
 * the fallback's flushed arithmetic all read a bf16 with a zero exponent as zero). */
#if HAVE_HW_CVT
/* dst[0..15]: the pairs of x[0..31] (n of them valid, the rest zero), bf16(x[2l]) | bf16(x[2l+1]) << 16. */
__attribute__((target("avx512f,avx512bf16"))) static inline void hw_pairs32(uint32_t *dst, const float *x, int n) {
    const __mmask16 m0 = n >= 16 ? 0xffffu : (__mmask16)((1u << (n > 0 ? n : 0)) - 1u);
    const __mmask16 m1 = n >= 32 ? 0xffffu : n <= 16 ? 0 : (__mmask16)((1u << (n - 16)) - 1u);
    const __m512bh c = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m1, x + 16), _mm512_maskz_loadu_ps(m0, x));
    _mm512_storeu_si512(dst, (__m512i)c);
}
/* dst[0..15] = bf16(r0[j]) | bf16(r1[j]) << 16 for j < n (<= 16; r1 NULL: zeros), the rest zero. */
__attribute__((target("avx512f,avx512bf16,avx512bw"))) static inline void hw_interleave16(uint32_t *dst, const float *r0,
                                                                                     const float *r1, int n) {
    const __mmask16 m = n >= 16 ? 0xffffu : (__mmask16)((1u << (n > 0 ? n : 0)) - 1u);
    const __m512 a = _mm512_maskz_loadu_ps(m, r0), b = r1 ? _mm512_maskz_loadu_ps(m, r1) : _mm512_setzero_ps();
    const __m512i c = (__m512i)_mm512_cvtne2ps_pbh(b, a); /* words 0..15: a's, 16..31: b's */
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(idx, c));
}
#endif

/* ---------------------------------------------------------------- AVX512-BF16 (bf16_avx512.c) */

/* The A panels np0 <= ip < np1 of A^T [kk x m] fp32 by VCVTNE2PS2BF16, depth outer: for AMX
 * (MR_X rows of kcp bf16) and for the vector tiles (kp pairs of MR_V words). Only with hw. */
void gdn_bf16_pack_a_trans_x_hw(uint16_t *restrict dst, const float *A, int64_t lda, int64_t np0, int64_t np1,
                                int64_t m, int64_t kc, int64_t kcp);
void gdn_bf16_pack_a_trans_v_hw(uint32_t *restrict dst, const float *A, int64_t lda, int64_t np0, int64_t np1,
                                int64_t m, int64_t kc, int64_t kp);
#if HAVE_X86
/* C[mr x nc] (+)= kp pairs of the A panel (MR_V words a pair) x the B micro-panel. */
void gdn_bf16_mk_avx512(int64_t kp, const uint32_t *a, const uint32_t *b, float *C, int64_t ldc, int acc, int mr,
                        int nc);
double gdn_bf16_peak_avx512_once(int threads);
#endif

/* ---------------------------------------------------------------- the fallback (bf16_fallback.c) */

/* The same with the A panel widened to fp32 pairs, in VDPBF16PS's order (or, for the tests,
 * amx_order, GDN_BF16_MUT_AMX_ORDER: TDPBF16PS's). */
void gdn_bf16_mk_fallback(int64_t kp, const float *a, const uint32_t *b, float *C, int64_t ldc, int acc, int mr,
                          int nc, int amx_order);

/* ---------------------------------------------------------------- AMX (bf16_amx.c, bf16_amx_emu.c) */

/* Tile configuration (palette 1): tiles 0-3 C (16 rows x 64 bytes fp32), 4-5 A (16 rows x 32
 * bf16), 6-7 B (16 k-pairs x 16 columns x 2 bf16). The 64-byte layout is ldtilecfg's. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;
static inline void tilecfg_init(tilecfg *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->palette = 1;
    for (int t = 0; t < 8; t++) cfg->rows[t] = 16, cfg->colsb[t] = 64;
}

/* The AMX block kernel, one source for both: C[0..mr) x [0..nc) (+)= a (MR_X rows of kcp bf16,
 * kst apart) b (kcp/2 x NR words). The accumulator tiles start from C itself (acc) or zero and are stored
 * straight back, so per element the slice's instructions add into C in k order (a partial block
 * goes through a zero-padded copy t). Tile ops are the macros TZ (zero), TL (load), TD
 * (dpbf16ps), TS (store). */
#define AMX_BLOCK_BODY                                                                           \
    float t[MR_X * NR] __attribute__((aligned(64)));                                           \
    const int full = mr == MR_X && nc == NR;                                                   \
    float *cb = full ? C : t;                                                                  \
    const int64_t cs = (full ? ldc : NR) * 4;                                                  \
    if (!full && acc) {                                                                        \
        memset(t, 0, sizeof t);                                                                \
        for (int i = 0; i < mr; i++) memcpy(t + i * NR, C + i * ldc, sizeof(float) * (size_t)nc); \
    }                                                                                          \
    if (acc) {                                                                                 \
        TL(0, cb, cs); TL(1, cb + 16, cs); TL(2, (char *)cb + 16 * cs, cs);                     \
        TL(3, (char *)cb + 16 * cs + 64, cs);                                                  \
    } else {                                                                                   \
        TZ(0); TZ(1); TZ(2); TZ(3);                                                            \
    }                                                                                          \
    const int64_t nkb = kcp / 32 - (skip != 0); /* skip: the control GDN_BF16_MUT_SKIP_KBLOCK */ \
    for (int64_t kb = 0; kb < nkb; kb++) {                                                     \
        TL(4, a + kb * 32, kst * 2);                                                           \
        TL(5, a + 16 * kst + kb * 32, kst * 2);                                                \
        TL(6, b + kb * 16 * NR, NR * 4);                                                       \
        TL(7, b + kb * 16 * NR + 16, NR * 4);                                                  \
        TD(0, 4, 6); TD(1, 4, 7); TD(2, 5, 6); TD(3, 5, 7);                                    \
    }                                                                                          \
    TS(0, cb, cs); TS(1, cb + 16, cs); TS(2, (char *)cb + 16 * cs, cs);                         \
    TS(3, (char *)cb + 16 * cs + 64, cs);                                                      \
    if (!full)                                                                                 \
        for (int i = 0; i < mr; i++) memcpy(C + i * ldc, t + i * NR, sizeof(float) * (size_t)nc);

/* C[mr x nc] (+)= the AMX block: a (MR_X rows of kcp bf16, kst apart) x b (kcp/2 x NR words). */
void gdn_bf16_mk_amx_emu(int64_t kcp, int64_t kst, const uint16_t *a, const uint32_t *b, float *C, int64_t ldc,
                         int acc, int mr, int nc, int skip);
void gdn_bf16_emu_loadcfg(const tilecfg *c); /* the calling thread's emulated tile configuration */
#if HAVE_AMX_CODE
void gdn_bf16_mk_amx(int64_t kcp, int64_t kst, const uint16_t *a, const uint32_t *b, float *C, int64_t ldc, int acc,
                     int mr, int nc, int skip);
void gdn_bf16_amx_loadcfg(const tilecfg *c);
void gdn_bf16_amx_release(void);
double gdn_bf16_peak_amx_once(int threads);
#endif

#endif
