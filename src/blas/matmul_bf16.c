/* BF16-compute GEMM (issue 20, step 1): C[m x n] (+)= op(A)[m x kk] op(B)[kk x n] with both
 * operands rounded to bfloat16 (round to nearest even) while they are packed, products of bf16
 * pairs accumulated in fp32. A and B are fp32 or bf16 (GDN_GEMM_A_BF16 / GDN_GEMM_B_BF16), plain
 * or transposed, so the layer can run a projection's forward (y = x W^T: B_TRANS), its input
 * gradient (dx = dy W: plain B) and its weight gradient (dW = dy^T x: A_TRANS) through it.
 *
 * Paths (blas.h: gdn_bf16_path), chosen at run time (GDN_BF16_AUTO) from CPUID and the OS:
 *  - AMX: TDPBF16PS on 16x16 fp32 tiles, a 32 x 32 C block per call (4 accumulator tiles,
 *    2 A tiles of 16 rows x 32 k, 2 B tiles of 16 k-pairs x 16 columns); needs CPUID AMX-TILE
 *    + AMX-BF16, XCR0 tile state and Linux's permission (arch_prctl(ARCH_REQ_XCOMP_PERM,
 *    XFEATURE_XTILEDATA)). The same kernel source runs with its tile operations routed to a
 *    scalar emulator (GDN_BF16_AMX_EMU) on any CPU, so its blocking, packing and tile
 *    bookkeeping are tested everywhere.
 *  - AVX512-BF16: VDPBF16PS, a 14 x 32 register tile (28 zmm accumulators), A k-pairs
 *    broadcast, B vectors of 16 columns x 2 k (the VNNI pair layout).
 *  - fallback: the same B layout and tile in portable vector code (A's pairs widened to fp32
 *    while packed, B's widened in registers by a shift or a mask), adding the two products of a
 *    pair in VDPBF16PS's order; the
 *    products of two bf16 values are exact in fp32, so this is bit-identical to VDPBF16PS's
 *    pseudo-code (a contracted FMA rounds the same exact product the same way).
 *
 * Packing (per KC-deep slice): op(A) and op(B) are rounded to bf16 and stored in pairs of
 * consecutive k (k odd: the last pair's second element is zero):
 *  - B micro-panels (all paths): kp = ceil(kc/2) rows (kc rounded up to 32 for AMX) of NR = 32
 *    uint32 words, word (p, j) = bf16(op(B)[2p][j]) | bf16(op(B)[2p+1][j]) << 16: one zmm holds 16
 *    columns x 2 k (VDPBF16PS's second operand), and a 16-row x 64-byte block at stride 128 bytes
 *    is a TDPBF16PS B tile.
 *  - A, AVX512-BF16 / fallback: panels of MR = 14 rows, word (p, i) = the pair of row i (a
 *    32-bit broadcast); AMX: panels of 32 rows, each row's kc (rounded up to 32) bf16 values
 *    contiguous (an A tile is 16 rows x 32 k at a row stride of 2 kc bytes).
 * Loops: for each KC slice, the threads pack all of op(A)'s rows (m x kc bf16, once per slice:
 * the whole of A is converted once), then for each NC-column panel they pack op(B)'s
 * micro-panels (shared) and run work items (row block x all micro-panels) dynamically; with
 * few row blocks against many columns each thread instead owns a range of the micro-panels over
 * the whole width and packs them itself (no barrier per panel). C is accumulated in fp32 in
 * memory across slices.
 *
 * Rounding (what each path computes per output element, for one KC slice, the pairs in order):
 *  - VDPBF16PS (Intel SDM vol. 2, VDPBF16PS pseudo-code): acc += a[2i+1] b[2i+1];
 *    acc += a[2i] b[2i] (odd element first), fp32, RNE, DAZ and FTZ, MXCSR ignored;
 *  - TDPBF16PS, as measured on an Emerald Rapids Xeon (family 6 model 207; 20,000 random
 *    instructions per depth 1, 2 and 16 pairs and per input range, normal, products below fp32's
 *    normal range, subnormal inputs: all bit for bit), NOT the SDM's pseudo-code (which adds the
 *    even then the odd product of each pair into the accumulator in turn, and matches only 37 % of
 *    those results at 16 pairs): per element, two fp32 partial sums from +0, E over the even
 *    elements of the instruction's 16 pairs in k order and O over the odd ones, each step a fused
 *    multiply-add rounded to nearest even; then acc + (E + O). Inputs with a zero exponent are
 *    zero (bf16 and the accumulator), every subnormal result is flushed, MXCSR is ignored.
 * The emulator implements exactly that; the tests require real AMX to equal it bit for bit
 * wherever AMX runs. The fallback has a test-only mode in the same order (its pairs in blocks of
 * 16). AMX and AVX512-BF16 agree to fp32 rounding, not bit for bit.
 *
 * Not here yet: a streaming path for small m (decode: m <= 16 runs the blocked loops). */
#define _GNU_SOURCE /* syscall */
#include "base.h"
#include "blas.h"
#include "microkernel.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
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
static bf_blocking blocking(int path) {
    const int amx = path == GDN_BF16_AMX || path == GDN_BF16_AMX_EMU;
    if (amx) return (bf_blocking){1, MR_X, MCP_X, KC_X, NC_X, MC_X};
    return (bf_blocking){0, MR_V, MCP_V, KC_V, NC_V, MC_V};
}

int gdn_bf16_fault = 0;
int gdn_bf16_fallback_amx_order = 0;

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* ---------------------------------------------------------------- bf16 */

static inline uint16_t to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if (gdn_bf16_fault == GDN_BF16_FAULT_TRUNCATE) return (uint16_t)(u >> 16);
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
static inline uint16_t eltb(const void *X, int bf, int trans, int64_t ld, int64_t r, int64_t c) {
    if (bf && gdn_bf16_fault != GDN_BF16_FAULT_TRUNCATE)
        return ((const uint16_t *)X)[trans ? c * ld + r : r * ld + c];
    return to_bf16(elt(X, bf, trans, ld, r, c));
}

/* ---------------------------------------------------------------- packing */

/* Vector rounding (the same bits as to_bf16): lane l of the result holds bf16(x[2l]) |
 * bf16(x[2l+1]) << 16 for 2 GDN_VL contiguous fp32 values x, i.e. GDN_VL k-pairs. */
typedef uint32_t gdn_vu32 __attribute__((vector_size(GDN_VL * 4)));
static inline gdn_vu32 rne_v(gdn_vu32 u) {
    const gdn_vu32 r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const gdn_vu32 special = (gdn_vu32)((u & 0x7f800000u) == 0x7f800000u); /* Inf, NaN */
    const gdn_vu32 sp = (u >> 16) | ((gdn_vu32)((u & 0xffffu) != 0) & 0x40u);
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
static inline gdn_vu32 pairs_vl(const float *x) {
    gdn_vu32 u0, u1;
    memcpy(&u0, x, sizeof u0);
    memcpy(&u1, x + GDN_VL, sizeof u1);
    u0 = rne_v(u0), u1 = rne_v(u1);
    const gdn_vu32 e = __builtin_shuffle(u0, u1, (gdn_vu32)EVEN_IDX), o = __builtin_shuffle(u0, u1, (gdn_vu32)ODD_IDX);
    return e | (o << 16);
}


/* bf16(x[l]) in the low half of lane l, for GDN_VL floats x (n of them, the rest 0). */
static inline gdn_vu32 bf16_lo_vl(const float *x, int n) {
    gdn_vu32 u = {0};
    if (n >= GDN_VL) memcpy(&u, x, sizeof u);
    else memcpy(&u, x, sizeof(float) * (size_t)(n > 0 ? n : 0));
    return rne_v(u);
}

/* The same rounding by VCVTNE2PS2BF16 (the packing of the paths whose CPU has AVX512-BF16, `hw`
 * below): nearest even, as to_bf16 for every finite input that is not subnormal; a subnormal
 * input becomes zero and a NaN a quiet NaN, which changes no product (VDPBF16PS, TDPBF16PS and
 * the fallback's flushed arithmetic all read a bf16 with a zero exponent as zero). */
#if defined(__x86_64__)
#define HAVE_HW_CVT 1
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
/* The AMX A panels np0 <= ip < np1 from A^T [kk x m] fp32 (the weight gradients' dY^T): panel ip
 * is MR_X rows of kcp bf16, dst[(ip * MR_X + i) * kcp + k] = bf16(A[k * lda + ip * MR_X + i]) (zero
 * past m and past kc). Per 32-deep block and 16 rows: 16 pairs of A^T rows interleaved into words
 * (word i = the pair of row i), then a 16 x 16 transpose of those words, so each store is one
 * 64-byte row of a panel. The depth block is the outer loop: each A^T row is read along all the
 * panels at once (contiguous, so prefetched) rather than 128 bytes at a time a page apart. Element
 * by element (a 2-byte store each) this packing took 17 % of a BF16 training step. */
__attribute__((target("avx512f,avx512bf16,avx512bw"))) static void pack_a_trans_panels(uint16_t *restrict dst,
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
__attribute__((target("avx512f,avx512bf16,avx512bw"))) static void pack_a_v_trans_panels(uint32_t *restrict dst,
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
#else
#define HAVE_HW_CVT 0
static void pack_a_trans_panels(uint16_t *dst, const float *A, int64_t lda, int64_t np0, int64_t np1, int64_t m,
                                int64_t kc, int64_t kcp) {
    (void)dst, (void)A, (void)lda, (void)np0, (void)np1, (void)m, (void)kc, (void)kcp;
    GDN_ASSERT(0); /* hw is never set without the conversion instructions */
}
static void pack_a_v_trans_panels(uint32_t *dst, const float *A, int64_t lda, int64_t np0, int64_t np1, int64_t m,
                                  int64_t kc, int64_t kp) {
    (void)dst, (void)A, (void)lda, (void)np0, (void)np1, (void)m, (void)kc, (void)kp;
    GDN_ASSERT(0);
}
#endif

/* B micro-panel: dst[p * NR + j] = pair (2p, 2p+1) of column j0 + j of op(B), k rows k0.., for
 * p < kp (rows past kc and columns past nc zero). hw: round with VCVTNE2PS2BF16 (see above). */
static void pack_b(uint32_t *restrict dst, const void *B, int bf, int bt, int64_t ldb, int64_t k0,
                   int64_t kc, int64_t kp, int64_t j0, int nc, int hw) {
    const int off = gdn_bf16_fault == GDN_BF16_FAULT_PAIR_SHIFT; /* control: pairs (2p+1, 2p+2) */
    if (bt && !bf && !gdn_bf16_fault) { /* W [n x kk] fp32: each column's k contiguous, VL pairs a step */
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
                    const gdn_vu32 w = pairs_vl(src + 2 * p);
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
    if (!bt && !bf && !gdn_bf16_fault) { /* B [kk x n] fp32 rows: a pair is two rows' columns j0.. */
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
                const gdn_vu32 w = bf16_lo_vl(r0 + j, n) | (has1 ? bf16_lo_vl(r1 + j, n) << 16 : (gdn_vu32){0});
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
                if (k < kc) w = eltb(B, bf, bt, ldb, k0 + k, j0 + j);
                if (k + 1 < kc) w |= (uint32_t)eltb(B, bf, bt, ldb, k0 + k + 1, j0 + j) << 16;
            }
            dst[p * NR + j] = w;
        }
}

/* A panels for the vector tiles: for each MR_V rows, dst[p * MR_V + i] = pair of row i; for the
 * fallback (widen), the pair's two bf16 values widened to fp32, dst[2 (p * MR_V + i) + 0/1] (even,
 * odd): the same values, so that its micro-kernel broadcasts them straight from memory. hw: rows
 * of fp32 A rounded with VCVTNE2PS2BF16 (A^T: pack_a_v_trans_panels). */
static void pack_a_v(uint32_t *restrict dst, const void *A, int bf, int at, int64_t lda, int64_t i0,
                     int64_t mr, int64_t k0, int64_t kc, int64_t kp, int widen, int hw) {
    if (!at && !bf && !gdn_bf16_fault) { /* rows of fp32 A: k contiguous, VL pairs a step */
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
                    const gdn_vu32 w = pairs_vl(src + 2 * p);
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
    if (at && !bf && !gdn_bf16_fault) { /* A^T [kk x m] fp32: a pair is two rows' entries i0.. */
        for (int64_t p = 0; p < kp; p++) {
            const float *r0 = (const float *)A + (k0 + 2 * p) * lda + i0, *r1 = r0 + lda;
            const int has1 = 2 * p + 1 < kc;
            uint32_t w[MR_V + GDN_VL];
            for (int i = 0; i < MR_V; i += GDN_VL) {
                const int n = (int)mr - i < MR_V - i ? (int)mr - i : MR_V - i;
                const gdn_vu32 v = bf16_lo_vl(r0 + i, n) | (has1 ? bf16_lo_vl(r1 + i, n) << 16 : (gdn_vu32){0});
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
                w = eltb(A, bf, at, lda, i0 + i, k0 + 2 * p);
                if (2 * p + 1 < kc) w |= (uint32_t)eltb(A, bf, at, lda, i0 + i, k0 + 2 * p + 1) << 16;
            }
            if (widen)
                dst[2 * (p * MR_V + i)] = w << 16, dst[2 * (p * MR_V + i) + 1] = w & 0xffff0000u;
            else
                dst[p * MR_V + i] = w;
        }
}

/* A panel for AMX: MR_X rows of kcp bf16 each (zero past kc and past mr). */
static void pack_a_x(uint16_t *restrict dst, const void *A, int bf, int at, int64_t lda, int64_t i0,
                     int64_t mr, int64_t k0, int64_t kc, int64_t kcp, int hw) {
    if (!at && !bf && !gdn_bf16_fault) { /* rows of fp32 A: the pairs' words are the row's bf16 */
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
                    const gdn_vu32 w = pairs_vl(src + k);
                    memcpy(dst + i * kcp + k, &w, sizeof w);
                }
            for (; k < kcp; k++) dst[i * kcp + k] = i < mr && k < kc ? to_bf16(src[k]) : 0;
        }
        return;
    }
    if (at && !bf && !gdn_bf16_fault) { /* A^T [kk x m] fp32: row k of A^T is column k of 32 rows */
        memset(dst, 0, sizeof(uint16_t) * (size_t)MR_X * (size_t)kcp);
        for (int64_t k = 0; k < kc; k++) {
            const float *r = (const float *)A + (k0 + k) * lda + i0;
            for (int i = 0; i < MR_X && i < mr; i += GDN_VL) {
                const gdn_vu32 v = bf16_lo_vl(r + i, (int)mr - i);
                for (int l = 0; l < GDN_VL && i + l < mr; l++) dst[(i + l) * kcp + k] = (uint16_t)v[l];
            }
        }
        return;
    }
    for (int i = 0; i < MR_X; i++)
        for (int64_t k = 0; k < kcp; k++)
            dst[i * kcp + k] = i < mr && k < kc ? eltb(A, bf, at, lda, i0 + i, k0 + k) : 0;
}

/* Write a computed tile t (rows of NR floats) into C: mr rows, nc columns, added or stored. */
static void store_tile(const float *t, int tld, float *C, int64_t ldc, int mr, int nc, int acc) {
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nc; j++) C[i * ldc + j] = acc ? C[i * ldc + j] + t[i * tld + j] : t[i * tld + j];
}

/* ---------------------------------------------------------------- fallback micro-kernel */

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
static inline gdn_vf lo_f(gdn_vu32 w) { gdn_vf f; w <<= 16; memcpy(&f, &w, sizeof f); return f; }
static inline gdn_vf hi_f(gdn_vu32 w) { gdn_vf f; w &= 0xffff0000u; memcpy(&f, &w, sizeof f); return f; }
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
                const gdn_vu32 w = *(const gdn_vu32 *)(b + p * NR + v * GDN_VL);
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
static void mk_fallback(int64_t kp, const float *a, const uint32_t *b, float *C, int64_t ldc, int acc,
                        int mr, int nc) {
    if (gdn_bf16_fallback_amx_order) { /* tests: = the AMX emulator bit for bit */
        mk_fb_amx_order(kp, a, b, C, ldc, acc, mr, nc);
        return;
    }
    float t[MR_V * NR] __attribute__((aligned(64)));
    mk_fb(kp, a, b, t);
    store_tile(t, NR, C, ldc, mr, nc, acc);
}

/* ---------------------------------------------------------------- AVX512-BF16 micro-kernel */

#if defined(__x86_64__)
#define HAVE_X86 1
__attribute__((target("avx512f,avx512bf16"))) static void mk_avx512bf16(int64_t kp, const uint32_t *a,
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
#else
#define HAVE_X86 0
#endif

/* ---------------------------------------------------------------- AMX tiles and their emulator */

/* Tile configuration (palette 1): tiles 0-3 C (16 rows x 64 bytes fp32), 4-5 A (16 rows x 32
 * bf16), 6-7 B (16 k-pairs x 16 columns x 2 bf16). The 64-byte layout is ldtilecfg's. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;
static void tilecfg_init(tilecfg *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->palette = 1;
    for (int t = 0; t < 8; t++) cfg->rows[t] = 16, cfg->colsb[t] = 64;
}

/* The emulator: 8 tile registers of 16 rows x 64 bytes, per thread; rows/colsb from the config. */
typedef struct {
    uint8_t t[8][16][64];
    tilecfg cfg;
} emu_tiles;
static _Thread_local emu_tiles emu;
static void emu_loadcfg(const tilecfg *c) { emu.cfg = *c; }
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
/* TDPBF16PS c, a, b as the hardware computes it (measured, see the top of the file): per element,
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
    const int64_t nkb = kcp / 32 - (gdn_bf16_fault == GDN_BF16_FAULT_SKIP_KBLOCK);              \
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

static void mk_amx_emu(int64_t kcp, int64_t kst, const uint16_t *a, const uint32_t *b, float *C, int64_t ldc,
                       int acc, int mr, int nc) {
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

#if HAVE_X86 && (__GNUC__ >= 11 || defined(__clang__))
#define HAVE_AMX_CODE 1
__attribute__((target("amx-tile,amx-bf16"))) static void mk_amx(int64_t kcp, int64_t kst, const uint16_t *a,
                                                               const uint32_t *b, float *C, int64_t ldc,
                                                               int acc, int mr, int nc) {
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
__attribute__((target("amx-tile"))) static void amx_loadcfg(const tilecfg *c) { _tile_loadconfig(c); }
__attribute__((target("amx-tile"))) static void amx_release(void) { _tile_release(); }
#else
#define HAVE_AMX_CODE 0
#endif

/* ---------------------------------------------------------------- dispatch */

static int avx512bf16_state = -1; /* -1 unknown, 0 no, 1 yes */
static int cpu_probe_avx512bf16(void);
/* Cached: CPUID traps to the hypervisor in a VM (microseconds), and the small GEMM asks per call. */
static int cpu_has_avx512bf16(void) {
    int s = __atomic_load_n(&avx512bf16_state, __ATOMIC_ACQUIRE);
    if (s < 0) __atomic_store_n(&avx512bf16_state, s = cpu_probe_avx512bf16(), __ATOMIC_RELEASE);
    return s;
}
static int cpu_probe_avx512bf16(void) {
#if HAVE_X86
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5))) return 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(b & (1u << 16))) return 0; /* AVX512F */
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0;         /* OSXSAVE */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (lo & 0xe6u) == 0xe6u; /* XMM, YMM, opmask, ZMM state enabled by the OS */
#else
    return 0;
#endif
}

static int amx_state = -1; /* -1 unknown, 0 no, 1 yes (permission granted) */
static int cpu_has_amx(void) {
#if HAVE_X86 && HAVE_AMX_CODE
    int s = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (s >= 0) return s;
    s = 0;
    unsigned a, b, c, d;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 24)) && (d & (1u << 22)) &&
        __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 27))) {
        unsigned lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        /* XTILECFG (17) and XTILEDATA (18) in XCR0, then Linux's per-process permission */
        if ((lo & (3u << 17)) == (3u << 17) && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                                       18 /* XFEATURE_XTILEDATA */) == 0)
            s = 1;
    }
    __atomic_store_n(&amx_state, s, __ATOMIC_RELEASE);
    return s;
#else
    return 0;
#endif
}

int gdn_bf16_path_available(int path) {
    switch (path) {
    case GDN_BF16_FALLBACK:
    case GDN_BF16_AMX_EMU: return 1;
    case GDN_BF16_AVX512: return cpu_has_avx512bf16();
    case GDN_BF16_AMX: return cpu_has_amx();
    default: return 0;
    }
}
int gdn_bf16_path_auto(void) {
    return cpu_has_amx() ? GDN_BF16_AMX : cpu_has_avx512bf16() ? GDN_BF16_AVX512 : GDN_BF16_FALLBACK;
}
const char *gdn_bf16_path_name(int path) {
    switch (path) {
    case GDN_BF16_FALLBACK: return "bf16 fallback (fp32 vectors, " GDN_VL_STR " lanes, VDPBF16PS order)";
    case GDN_BF16_AVX512: return "bf16 AVX512-BF16 (VDPBF16PS, 14x32 tile)";
    case GDN_BF16_AMX: return "bf16 AMX (TDPBF16PS, 32x32 block)";
    case GDN_BF16_AMX_EMU: return "bf16 AMX emulated (scalar TDPBF16PS, 32x32 block)";
    default: return "bf16 auto";
    }
}

/* ---------------------------------------------------------------- the GEMM */

/* Pack with VCVTNE2PS2BF16: the paths of CPUs that have it (the emulator and the fallback keep
 * the portable rounding, so the tests compare the two conversions too). */
static int hw_convert(int path) {
    return HAVE_HW_CVT && (path == GDN_BF16_AVX512 || (path == GDN_BF16_AMX && cpu_has_avx512bf16()));
}

/* Packing space: the A slice (all m rows' panels x kcp bf16) and the shared B panel, 64-aligned. */
static void ws_parts(int path, int64_t m, int64_t n, int64_t kk, size_t *abytes, size_t *bbytes) {
    const bf_blocking bl = blocking(path);
    const int amx = bl.amx, MR = bl.MR;
    const int64_t KC = bl.KC, NC = bl.NC;
    m = min64(m, bl.MC);
    const int64_t kcmax = min64(KC, kk > 0 ? kk : 1), kcpmax = amx ? (kcmax + 31) / 32 * 32 : (kcmax + 1) / 2 * 2;
    const size_t esz = path == GDN_BF16_FALLBACK ? 4 : 2; /* the fallback's A widened to fp32 */
    *abytes = ((size_t)((m + MR - 1) / MR) * MR * (size_t)kcpmax * esz + 63) / 64 * 64;
    *bbytes = ((size_t)((min64(NC, n > 0 ? n : 1) + NR - 1) / NR) * (size_t)(kcpmax / 2) * NR * 4 + 63) / 64 * 64;
}
size_t gdn_matmul_bf16_ws_bytes(int path, int64_t m, int64_t n, int64_t kk) {
    if (path == GDN_BF16_AUTO) path = gdn_bf16_path_auto();
    size_t a, b;
    ws_parts(path, m, n, kk, &a, &b);
    return a + b + 64;
}

/* One micro-kernel call of `path`: depth [lo, lo + depth) (even; on AMX whole 32-deep blocks) of
 * row panel ip of the packed A (MR rows; kcp values a row, the vector paths in pairs) against the
 * B micro-panel bq (already at lo), into the mr x nc block C. */
static inline void mk_run(int path, const void *apack, int64_t ip, int MR, int64_t kcp, int64_t lo, int64_t depth,
                          const uint32_t *bq, float *C, int64_t ldc, int acc, int mr, int nc) {
    const int64_t kp = kcp / 2;
    switch (path) {
    case GDN_BF16_FALLBACK:
        mk_fallback(depth / 2, (const float *)apack + ((size_t)ip * MR * kp + (size_t)(lo / 2) * MR) * 2, bq, C, ldc, acc,
                    mr, nc);
        break;
#if HAVE_X86
    case GDN_BF16_AVX512:
        mk_avx512bf16(depth / 2, (const uint32_t *)apack + (size_t)ip * MR * kp + (size_t)(lo / 2) * MR, bq, C, ldc, acc,
                      mr, nc);
        break;
#endif
#if HAVE_AMX_CODE
    case GDN_BF16_AMX:
        mk_amx(depth, kcp, (const uint16_t *)apack + (size_t)ip * MR * kcp + lo, bq, C, ldc, acc, mr, nc);
        break;
#endif
    default:
        mk_amx_emu(depth, kcp, (const uint16_t *)apack + (size_t)ip * MR * kcp + lo, bq, C, ldc, acc, mr, nc);
        break;
    }
}

/* One pass over m <= the path's MC rows of C. */
static void matmul_bf16_rows(int path, int flags, int64_t m, int64_t n, int64_t kk, const void *A, int64_t lda,
                             const void *B, int64_t ldb, float *C, int64_t ldc, void *ws, int threads) {
    const int acc = (flags & GDN_GEMM_ACC) != 0, at = (flags & GDN_GEMM_A_TRANS) != 0,
              bt = (flags & GDN_GEMM_B_TRANS) != 0, abf = (flags & GDN_GEMM_A_BF16) != 0,
              bbf = (flags & GDN_GEMM_B_BF16) != 0;
    const bf_blocking bl = blocking(path);
    const int amx = bl.amx, fb = path == GDN_BF16_FALLBACK, MR = bl.MR, MCP = bl.MCP, hw = hw_convert(path);
    const int64_t KC = bl.KC, NC = bl.NC;
    const int64_t mpanels = (m + MR - 1) / MR;
    /* packed A slice: mpanels x MR x kcp bf16; B panel: NC/NR micro-panels x kcp/2 x NR words */
    size_t abytes, bbytes;
    ws_parts(path, m, n, kk, &abytes, &bbytes);
    char *buf = ws ? NULL : aligned_alloc(64, abytes + bbytes + 64);
    GDN_ASSERT(ws || buf);
    char *apack = (char *)(((uintptr_t)(ws ? ws : buf) + 63) & ~(uintptr_t)63), *bpack = apack + abytes;
    const int64_t nblk = (mpanels + MCP - 1) / MCP;
    /* Few row blocks against many columns (the loss head's chunk against the vocabulary): each
     * thread owns a range of the columns and packs its own B micro-panels, with no wait for the
     * others within the slice (a shared panel costs a barrier per NC columns: 243 of them in the
     * loss head's 512 x 248,320 x 1024). The same micro-kernel calls over the same depth: the
     * same bits. */
    const int own_cols = nblk < 4 * threads && n >= 4 * NR * threads && NC / NR >= threads;
#pragma omp parallel num_threads(threads)
    {
        const unsigned fm = gdn_bf16_thread_begin(path);
        const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
        for (int64_t pc = 0; pc < kk; pc += KC) {
            const int64_t kc = min64(KC, kk - pc);
            const int64_t kcp = amx ? (kc + 31) / 32 * 32 : (kc + 1) / 2 * 2, kp = kcp / 2;
            const int acc_k = acc || pc > 0;
            if (HAVE_HW_CVT && hw && at && !abf && !gdn_bf16_fault) {
                /* A^T fp32 (see pack_a_trans_panels): this thread's share of the panels, depth outer */
                const int64_t per = (mpanels + nt - 1) / nt, np0 = min64(mpanels, tid * per);
                if (amx)
                    pack_a_trans_panels((uint16_t *)apack, (const float *)A + pc * lda, lda, np0,
                                        min64(mpanels, np0 + per), m, kc, kcp);
                else
                    pack_a_v_trans_panels((uint32_t *)apack, (const float *)A + pc * lda, lda, np0,
                                          min64(mpanels, np0 + per), m, kc, kp);
#pragma omp barrier
            } else {
#pragma omp for schedule(static)
                for (int64_t ip = 0; ip < mpanels; ip++) {
                    const int64_t mr = min64(MR, m - ip * MR);
                    if (amx)
                        pack_a_x((uint16_t *)apack + ip * MR * kcp, A, abf, at, lda, ip * MR, mr, pc, kc, kcp, hw);
                    else
                        pack_a_v((uint32_t *)apack + ip * MR * kp * (fb + 1), A, abf, at, lda, ip * MR, mr, pc,
                                 kc, kp, fb, hw);
                }
            }
            if (own_cols) {
                /* this thread's micro-panels of the whole width, cap at a time into its own
                 * part of the B panel; every row panel against them (the A panel in L1) */
                const int64_t p_all = (n + NR - 1) / NR, cap = (min64(NC, n) + NR - 1) / NR / nt; /* ws_parts */
                uint32_t *own = (uint32_t *)bpack + tid * cap * kp * NR;
                for (int64_t q0 = p_all * tid / nt, q_hi = p_all * (tid + 1) / nt; q0 < q_hi; q0 += cap) {
                    const int64_t nq = min64(cap, q_hi - q0);
                    for (int64_t q = 0; q < nq; q++)
                        pack_b(own + q * kp * NR, B, bbf, bt, ldb, pc, kc, kp, (q0 + q) * NR,
                               (int)min64(NR, n - (q0 + q) * NR), hw);
                    for (int64_t ip = 0; ip < mpanels; ip++)
                        for (int64_t q = 0; q < nq; q++)
                            mk_run(path, apack, ip, MR, kcp, 0, kcp, own + q * kp * NR,
                                   C + ip * MR * ldc + (q0 + q) * NR, ldc, acc_k, (int)min64(MR, m - ip * MR),
                                   (int)min64(NR, n - (q0 + q) * NR));
                }
#pragma omp barrier /* (the A slice is repacked next) */
                continue;
            }
            for (int64_t jc = 0; jc < n; jc += NC) {
                const int64_t nc = min64(NC, n - jc), npan = (nc + NR - 1) / NR;
                for (int64_t q = tid; q < npan; q += nt)
                    pack_b((uint32_t *)bpack + q * kp * NR, B, bbf, bt, ldb, pc, kc, kp, jc + q * NR,
                           (int)min64(NR, nc - q * NR), hw);
#pragma omp barrier
                /* Work items: a block of MCP row panels x a group of B micro-panels. Few row
                 * blocks (an MoE expert's ~100-200 rows are 1-2 of them) are also split by
                 * columns, so that every thread has items (4 per thread); each C element is
                 * still one micro-kernel call over the same depth: the same bits. */
                int64_t ncg = 1;
                if (nblk < 4 * nt) ncg = min64(npan, (4 * nt + nblk - 1) / nblk);
                const int64_t qper = (npan + ncg - 1) / ncg;
                ncg = (npan + qper - 1) / qper;
#pragma omp for schedule(dynamic, 1)
                for (int64_t it = 0; it < nblk * ncg; it++) {
                    /* each A panel of the work item over its B micro-panels: the A panel stays
                     * in L1 (measured on AMX: faster than B-outer, and than prefetching the next
                     * micro-panel) */
                    const int64_t ib = it / ncg, q0 = it % ncg * qper, nq = min64(npan, q0 + qper) - q0;
                    const int64_t ip0 = ib * MCP, nip = min64(mpanels, ip0 + MCP) - ip0;
                    for (int64_t sidx = 0; sidx < nip * nq; sidx++) {
                        const int64_t ip = ip0 + sidx / nq, q = q0 + sidx % nq;
                        const int mr = (int)min64(MR, m - ip * MR);
                        float *Crow = C + ip * MR * ldc + jc;
                        const uint32_t *bq = (const uint32_t *)bpack + q * kp * NR;
                        const int ncq = (int)min64(NR, nc - q * NR);
                        mk_run(path, apack, ip, MR, kcp, 0, kcp, bq, Crow + q * NR, ldc, acc_k, mr, ncq);
                    }
                }
                /* (implied barrier: the B panel is repacked next, the A slice after the last) */
            }
        }
        gdn_bf16_thread_end(path, fm);
    }
    free(buf);
}

int gdn_matmul_bf16(int path, int flags, int64_t m, int64_t n, int64_t kk, const void *A, int64_t lda,
                    const void *B, int64_t ldb, float *C, int64_t ldc, void *ws, int threads) {
    if (path == GDN_BF16_AUTO) path = gdn_bf16_path_auto();
    GDN_ASSERT(gdn_bf16_path_available(path));
    if (m <= 0 || n <= 0) return path;
    if (threads < 1) threads = 1;
    if (kk <= 0) {
        if (!(flags & GDN_GEMM_ACC))
            for (int64_t i = 0; i < m; i++) memset(C + i * ldc, 0, sizeof(float) * (size_t)n);
        return path;
    }
    const size_t esz = flags & GDN_GEMM_A_BF16 ? 2 : 4;
    const int64_t MC = blocking(path).MC;
    for (int64_t i0 = 0; i0 < m; i0 += MC) { /* op(A)'s rows i0..: A's rows, or its columns (A^T) */
        const char *Ai = (const char *)A + esz * (size_t)(flags & GDN_GEMM_A_TRANS ? i0 : i0 * lda);
        matmul_bf16_rows(path, flags, min64(MC, m - i0), n, kk, Ai, lda, B, ldb, C + i0 * ldc, ldc, ws, threads);
    }
    return path;
}

/* ---------------------------------------------------------------- the small GEMM (one thread) */

/* gdn_gemm_bf16's packing: all of op(A)'s panels and op(B)'s micro-panels, the whole depth in
 * one slice (the chunk kernel's depths are at most 256): the pre-packed operands' layout. */
size_t gdn_gemm_bf16_ws_bytes(int path, int m, int n, int kk) {
    if (path == GDN_BF16_AUTO) path = gdn_bf16_path_auto();
    m = m > 0 ? m : 1, n = n > 0 ? n : 1, kk = kk > 0 ? kk : 1;
    return gdn_bf16_packed_a_bytes(path, m, kk) + gdn_bf16_packed_b_bytes(path, n, kk) + 64;
}

int gdn_gemm_bf16(int path, int flags, int m, int n, int kk, const float *A, int lda, const float *B, int ldb,
                  float *C, int ldc, void *ws) {
    if (path == GDN_BF16_AUTO) path = gdn_bf16_path_auto();
    GDN_ASSERT(gdn_bf16_path_available(path) && !(flags & (GDN_GEMM_A_BF16 | GDN_GEMM_B_BF16)));
    const int acc = (flags & GDN_GEMM_ACC) != 0, at = (flags & GDN_GEMM_A_TRANS) != 0,
              bt = (flags & GDN_GEMM_B_TRANS) != 0, a_lower = (flags & GDN_GEMM_A_LOWER) != 0,
              a_upper = (flags & GDN_GEMM_A_UPPER) != 0, c_lower = (flags & GDN_GEMM_C_LOWER) != 0;
    if (m <= 0 || n <= 0) return path;
    if (kk <= 0) {
        if (!acc)
            for (int i = 0; i < m; i++) memset(C + (size_t)i * ldc, 0, sizeof(float) * (size_t)n);
        return path;
    }
    const bf_blocking bl = blocking(path);
    const int amx = bl.amx, MR = bl.MR;
    /* depth granule: a 32-deep tile block (AMX) or a pair */
    const int gran = amx ? 32 : 2;
    const int64_t kcp = (kk + gran - 1) / gran * gran, kp = kcp / 2;
    const int mpanels = (m + MR - 1) / MR, npan = (n + NR - 1) / NR;
    char *apack = (char *)(((uintptr_t)ws + 63) & ~(uintptr_t)63), *bpack = apack + gdn_bf16_packed_a_bytes(path, m, kk);
    gdn_bf16_pack_a(path, at, m, kk, A, lda, apack);
    gdn_bf16_pack_b(path, bt, n, kk, B, ldb, bpack);
    const unsigned fm = gdn_bf16_thread_begin(path);
    uint64_t flops = 0;
    for (int ip = 0; ip < mpanels; ip++) {
        const int i0 = ip * MR, mr = (int)min64(MR, m - i0);
        /* the depth range where this row panel's A may be nonzero, widened to whole granules;
         * its start on a 32-deep boundary on every path, so that the fallback in TDPBF16PS's
         * order groups the pairs in the same blocks of 16 as AMX (the tests' bitwise check) */
        int64_t lo = a_upper ? i0 : 0, hi = a_lower ? min64(i0 + mr, kk) : kk;
        lo = lo / 32 * 32, hi = (hi + gran - 1) / gran * gran;
        for (int q = 0; q < npan; q++) {
            const int j0 = q * NR, ncq = (int)min64(NR, n - j0);
            if (c_lower && j0 > i0 + mr - 1) break; /* this and the later panels lie above the diagonal */
            float *Cb = C + (size_t)i0 * ldc + j0;
            if (hi <= lo) { /* A is zero here */
                if (!acc)
                    for (int i = 0; i < mr; i++) memset(Cb + (size_t)i * ldc, 0, sizeof(float) * (size_t)ncq);
                continue;
            }
            const uint32_t *bq = (const uint32_t *)bpack + (size_t)q * kp * NR + (size_t)(lo / 2) * NR;
            flops += 2 * (uint64_t)mr * (uint64_t)ncq * (uint64_t)(hi - lo);
            mk_run(path, apack, ip, MR, kcp, lo, hi - lo, bq, Cb, ldc, acc, mr, ncq);
        }
    }
    gdn_bf16_thread_end(path, fm);
    gdn_flops_issued_add(flops);
    return path;
}

/* ---------------------------------------------------------------- pre-packed operands */

/* A packed op(A) [m x kk]: its row panels in mk_run's layout over the whole depth (kcp: kk
 * rounded up to the path's granule, 32 with AMX, a pair otherwise); a packed op(B) [kk x n]: its
 * micro-panels of NR columns, kcp / 2 pair rows each. */
static int64_t packed_depth(int path, int64_t kk) {
    return blocking(path).amx ? (kk + 31) / 32 * 32 : (kk + 1) / 2 * 2;
}
size_t gdn_bf16_packed_a_bytes(int path, int64_t m, int64_t kk) {
    const bf_blocking bl = blocking(path);
    const size_t esz = path == GDN_BF16_FALLBACK ? 4 : 2; /* the fallback's A widened to fp32 */
    return ((size_t)((m + bl.MR - 1) / bl.MR) * (size_t)bl.MR * (size_t)packed_depth(path, kk) * esz + 63) / 64 * 64;
}
size_t gdn_bf16_packed_b_bytes(int path, int64_t n, int64_t kk) {
    return (size_t)((n + NR - 1) / NR) * (size_t)(packed_depth(path, kk) / 2) * NR * 4;
}
void gdn_bf16_pack_a(int path, int trans, int64_t m, int64_t kk, const float *A, int64_t lda, void *dst) {
    const bf_blocking bl = blocking(path);
    const int64_t kcp = packed_depth(path, kk), kp = kcp / 2;
    const int fb = path == GDN_BF16_FALLBACK, hw = hw_convert(path);
    for (int64_t ip = 0; ip * bl.MR < m; ip++) {
        const int64_t mr = min64(bl.MR, m - ip * bl.MR);
        if (bl.amx)
            pack_a_x((uint16_t *)dst + ip * bl.MR * kcp, A, 0, trans, lda, ip * bl.MR, mr, 0, kk, kcp, hw);
        else
            pack_a_v((uint32_t *)dst + ip * bl.MR * kp * (fb + 1), A, 0, trans, lda, ip * bl.MR, mr, 0, kk, kp, fb, hw);
    }
}
void gdn_bf16_pack_b(int path, int trans, int64_t n, int64_t kk, const float *B, int64_t ldb, void *dst) {
    const int64_t kp = packed_depth(path, kk) / 2;
    for (int64_t q = 0; q * NR < n; q++)
        pack_b((uint32_t *)dst + q * kp * NR, B, 0, trans, ldb, 0, kk, kp, q * NR, (int)min64(NR, n - q * NR),
               hw_convert(path));
}
unsigned gdn_bf16_thread_begin(int path) {
    const gdn_fpmode fm = gdn_fp_fast_begin();
    tilecfg cfg;
    tilecfg_init(&cfg);
    if (path == GDN_BF16_AMX_EMU) emu_loadcfg(&cfg);
#if HAVE_AMX_CODE
    if (path == GDN_BF16_AMX) amx_loadcfg(&cfg);
#endif
    return (unsigned)fm;
}
void gdn_bf16_thread_end(int path, unsigned mode) {
#if HAVE_AMX_CODE
    if (path == GDN_BF16_AMX) amx_release();
#endif
    (void)path;
    gdn_fp_fast_end((gdn_fpmode)mode);
}
void gdn_bf16_packed_gemm(int path, int acc, int64_t m, int64_t n, int64_t kk, const void *a, int64_t a_kk,
                          const void *b, int64_t b_kk, float *C, int64_t ldc) {
    GDN_ASSERT(kk <= a_kk && kk <= b_kk);
    const bf_blocking bl = blocking(path);
    const int64_t depth = packed_depth(path, kk), akcp = packed_depth(path, a_kk), bkp = packed_depth(path, b_kk) / 2;
    for (int64_t ip = 0; ip * bl.MR < m; ip++) {
        const int mr = (int)min64(bl.MR, m - ip * bl.MR);
        for (int64_t q = 0; q * NR < n; q++)
            mk_run(path, a, ip, bl.MR, akcp, 0, depth, (const uint32_t *)b + q * bkp * NR,
                   C + ip * bl.MR * ldc + q * NR, ldc, acc, mr, (int)min64(NR, n - q * NR));
    }
}

/* ---------------------------------------------------------------- peaks and the bench probe */

/* Register-only throughput of the path's instruction, GFLOP/s (2 per multiply-add): VDPBF16PS
 * zmm (64 FLOPs each) over 24 independent accumulators, or TDPBF16PS (16 x 16 x 32 x 2 = 16384
 * FLOPs each) over 4 accumulator tiles; best of several runs. 0 for a path without its own
 * instruction (fallback, emulated). */
#if HAVE_X86
__attribute__((target("avx512f,avx512bf16"))) static double peak_avx512bf16_once(int threads) {
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
#endif
#if HAVE_AMX_CODE
__attribute__((target("amx-tile,amx-bf16"))) static double peak_amx_once(int threads) {
    enum { ITERS = 200000 };
    double secs = 0;
    int used = 1;
    static uint16_t src[16 * 32] __attribute__((aligned(64)));
#pragma omp parallel num_threads(threads)
    {
        tilecfg cfg;
        tilecfg_init(&cfg);
        amx_loadcfg(&cfg);
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        _tile_loadd(4, src, 64); _tile_loadd(5, src, 64); _tile_loadd(6, src, 64); _tile_loadd(7, src, 64);
#pragma omp barrier
        const double t0 = omp_get_wtime();
        for (int it = 0; it < ITERS; it++) {
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        }
#pragma omp barrier
        const double t1 = omp_get_wtime();
        amx_release();
#pragma omp master
        secs = t1 - t0, used = omp_get_num_threads();
    }
    return 16384.0 * 4 * (double)ITERS * used / secs * 1e-9;
}
#endif

double gdn_measure_bf16_peak_gflops(int path, int threads) {
    if (threads < 1) threads = 1;
    double best = 0;
    for (int run = 0; run < 6; run++) {
        double g = 0;
#if HAVE_X86
        if (path == GDN_BF16_AVX512 && cpu_has_avx512bf16()) g = peak_avx512bf16_once(threads);
#endif
#if HAVE_AMX_CODE
        if (path == GDN_BF16_AMX && cpu_has_amx()) g = peak_amx_once(threads);
#endif
        if (g > best) best = g;
    }
    return best;
}

/* Public probes for `gdncp bench matmul` (include/gdncp/bench.h). */
int gdn_bench_bf16_path(void) { return gdn_bf16_path_auto(); }
const char *gdn_bench_bf16_path_name(int path) { return gdn_bf16_path_name(path); }
int gdn_bench_bf16_path_available(int path) { return gdn_bf16_path_available(path); }
double gdn_bench_bf16_peak_gflops(int path, int threads) { return gdn_measure_bf16_peak_gflops(path, threads); }
void gdn_bench_projection(int bf16_path, int64_t m, int64_t n, int64_t kk, const float *x, const float *W,
                          float *y, int threads) {
    if (bf16_path < 0) {
        const size_t bytes = (gdn_matmul_ws_floats(threads) * sizeof(float) + 63) / 64 * 64;
        float *ws = aligned_alloc(64, bytes);
        GDN_ASSERT(ws);
        gdn_matmul(GDN_GEMM_B_TRANS, m, n, kk, x, kk, W, kk, y, n, ws, threads);
        free(ws);
        return;
    }
    gdn_matmul_bf16(bf16_path, GDN_GEMM_B_TRANS, m, n, kk, x, kk, W, kk, y, n, NULL, threads);
}
