/* Large fp32 GEMM for the layer's projections: C[m x n] (+)= op(A)[m x kk] op(B)[kk x n].
 *
 * Two paths:
 *  - blocked (BLIS/GotoBLAS loops): for each NC-column panel and KC-deep slice, the threads
 *    together pack op(B) into NR-column micro-panels (kc x NR, contiguous, zero-padded) shared
 *    by all (KC x NC = 1 MB: it stays in each core's L2); each thread then packs MC x KC blocks
 *    of op(A) of its own rows into MR-row micro-panels and runs the register-tiled MR x NR
 *    micro-kernel: loop ir over the A micro-panels (kc x MR, 14 KB, stays in L1), inner loop jr
 *    over the B micro-panels (streamed from L2). Vectors run along n (NR = 2 vectors), A
 *    elements are broadcast; the C tile is prefetched at the start of each micro-kernel call.
 *    A work item with a single B micro-panel (n <= NR: in_proj_b/a) reads A in place instead
 *    of packing it for one use (40 -> 60 % of peak there).
 *    Work items of a slice (row blocks of about MC rows; for small m, row block x column group)
 *    are handed out dynamically, so that a thread slowed by another process on a shared
 *    machine does not hold the other up at every slice. Fewer than 4 row blocks a thread
 *    against many columns (a shard's rows, the loss head's chunk against the vocabulary): each
 *    thread owns a column range of every panel instead, packs its own B micro-panels and all
 *    of A, and never waits for the other inside the product.
 *  - streaming (decode: m <= 16, A plain and B stored transposed, i.e. a weight matrix
 *    [n x kk]): packing W would double its memory traffic, so each W row is read once and dotted
 *    with all m rows of A (threads split the W rows; 4 W rows x 4 A rows per register tile, or
 *    8 W rows x up to 2 A rows at m <= 2, so that decode at B = 1 has 8 rows of W in flight);
 *    A stays in cache. Bound by memory bandwidth up to m ~ 8.
 *
 * Vector width is the target's (microkernel.h: 16 lanes with AVX-512, 8 with AVX/AVX2, else 4);
 * the micro-kernel and the B packing are the ones gemm.c runs, with 14-row tiles here.
 *
 * Measured (Xeon with AVX-512, 48 KB L1 / 2 MB L2 per core, shared 2-core VM, best of several
 * runs; peak = gdn_measure_peak_gflops, 177 GFLOP/s at 1 thread, 353 at 2): the layer's
 * projection shapes (m = 4096 tokens, E = 2048, N = 8192 / 4096) run at 75-85 % of the peak on
 * 1 thread and 66-78 % on 2; N = 32 shapes (in_proj_b/a, A read in place) at ~60 %;
 * decode (m <= 4) at the memory streaming rate, m = 16 at ~70 % of it.
 *
 * bf16 weights (GDN_GEMM_B_BF16, with B^T): the streaming path widens each 16-value W load in
 * registers (zero-extend + shift), so it streams half the bytes; the blocked path converts
 * while packing B (micro-kernel unchanged). Measured (same machine, W [8192 x 2048] rotated
 * over 12 copies > L3, fp32/bf16 interleaved, best of 30): m = 1 reads W at the same GB/s as
 * fp32 (21 GB/s at 1 thread, 41-42 at 2), i.e. half the time; m = 4 at ~88 % of fp32's GB/s
 * (1.8x faster), m = 16 compute-bound (the widening is redone per 4-row group of A), ~7 % faster
 * than fp32. Blocked 4096 x 8192 x 2048: bf16 B within ~5 % of fp32 B (1 and 2 threads). */
#include "base.h"
#include "blas.h"
#include "pack.h"

#include <omp.h>
#include <string.h>

#define VL GDN_VL
#if VL == 16
#ifndef MR
#define MR 14 /* 28 accumulators + 2 B vectors of 32 zmm registers */
#endif
#define ISA_NAME "AVX-512, 16 lanes"
#else
#define MR 6 /* 12 accumulators + 2 B vectors of 16 registers */
#if VL == 8 && defined(__AVX2__) && defined(__FMA__)
#define ISA_NAME "AVX2+FMA, 8 lanes"
#elif VL == 8
#define ISA_NAME "AVX, 8 lanes"
#else
#define ISA_NAME "generic vectors, 4 lanes"
#endif
#endif
#define NV 2
#define NR (NV * VL)

#define STR_(x) #x
#define STR(x) STR_(x)

/* Block sizes (measured on a 48 KB L1 / 2 MB L2 core, see the commit message):
 * KC: depth of a packed slice (a kc x NR B micro-panel, 32 KB at 256 x 32, stays in L1);
 * MC: rows of a packed A block (MC x KC in L2); NC: columns of the shared packed B panel. */
#ifndef GDN_MM_KC /* (overridable at compile time for tuning) */
#define GDN_MM_KC 256
#endif
#ifndef GDN_MM_MC
#define GDN_MM_MC (MR * 12)
#endif
#ifndef GDN_MM_NC
#define GDN_MM_NC 1024
#endif
enum { KC = GDN_MM_KC, MC = GDN_MM_MC, NC = GDN_MM_NC };
enum { SMALL_M = 16 }; /* streaming path for m <= SMALL_M with B transposed */

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* ---------------------------------------------------------------- packing */

/* How the operands are stored and packed (gdn_matmul's flags): A in bf16; the BF16 GEMM's FMA
 * path (fma_flags: GDN_GEMM_ROUND_BF16, or its controls _TRUNC_ and _SHIFT_BF16). */
typedef struct {
    int abf, fma_flags;
} pack_mode;

static void pack_a_fp32(float *restrict dst, const float *A, int64_t lda, int a_trans, int64_t i0, int64_t mc,
                        int64_t k0, int64_t kc);
/* dst: ceil(mc/MR) micro-panels of kc x MR (dst[p*MR + i] = op(A)[i0+i][k0+p]), zero-padded rows;
 * rounded to bf16 after (the panels are in L2) when the mode says so. */
static void pack_a(float *restrict dst, const void *A, int64_t lda, int a_trans, int64_t i0, int64_t mc,
                   int64_t k0, int64_t kc, pack_mode pm) {
    if (!pm.abf)
        pack_a_fp32(dst, A, lda, a_trans, i0, mc, k0, kc);
    else /* bf16 A (tests and the FMA path's callers only): element by element */
        for (int64_t ir = 0; ir < mc; ir += MR)
            for (int64_t p = 0; p < kc; p++)
                for (int i = 0; i < MR; i++) {
                    const int64_t r = i0 + ir + i, c = k0 + p;
                    dst[ir * kc + p * MR + i] = ir + i < mc ? gdn_loadw1(A, 1, a_trans ? c * lda + r : r * lda + c) : 0.0f;
                }
    if (pm.fma_flags & (GDN_GEMM_ROUND_BF16 | GDN_GEMM_TRUNC_BF16))
        gdn_round_bf16(dst, dst, (mc + MR - 1) / MR * MR * kc, (pm.fma_flags & GDN_GEMM_TRUNC_BF16) != 0);
}
static void pack_a_fp32(float *restrict dst, const float *A, int64_t lda, int a_trans, int64_t i0, int64_t mc,
                        int64_t k0, int64_t kc) {
    for (int64_t ir = 0; ir < mc; ir += MR) {
        const int mr = (int)min64(MR, mc - ir);
        float *restrict d = dst + ir * kc;
        if (a_trans) { /* op(A)[i][p] = A[p][i]: MR contiguous floats per depth step */
            const float *s = A + k0 * lda + i0 + ir;
            if (mr == MR && ir + 2 * MR <= mc) {
                /* two panels per pass: each depth step's 2 MR floats (112 bytes at MR = 14,
                 * where one panel's 56 left most of a line to the next pass) read as whole
                 * moves (element by element, GCC built vectors from scalar inserts); pack_a
                 * 9.7 -> 8 % of a tiny fp32 training step's profile */
                float *restrict d2 = d + MR * kc;
                for (int64_t p = 0; p < kc; p++) {
                    memcpy(d + p * MR, s + p * lda, sizeof(float) * MR);
                    memcpy(d2 + p * MR, s + p * lda + MR, sizeof(float) * MR);
                }
                ir += MR;
            } else if (mr == MR)
                for (int64_t p = 0; p < kc; p++) memcpy(d + p * MR, s + p * lda, sizeof(float) * MR);
            else
                for (int64_t p = 0; p < kc; p++)
                    for (int i = 0; i < MR; i++) d[p * MR + i] = i < mr ? s[p * lda + i] : 0.0f;
        } else if (mr == MR && MR <= VL) {
            /* rows of A are contiguous in depth: VL x VL register transposes (MR rows, the
             * rest zero); each depth step's MR values are written as a full vector that runs
             * VL - MR floats into the next step, overwritten by it (the ws has VL floats slack) */
            const float *s = A + (i0 + ir) * lda + k0;
            int64_t p = 0;
            for (; p + VL <= kc; p += VL) {
                gdn_vf r[VL];
#pragma GCC unroll 16
                for (int i = 0; i < VL; i++) r[i] = i < MR ? gdn_vloadu(s + i * lda + p) : (gdn_vf){0};
                gdn_transpose_vl(r);
#pragma GCC unroll 16
                for (int l = 0; l < VL; l++) gdn_vstoreu(d + (p + l) * MR, r[l]);
            }
            for (; p < kc; p++)
                for (int i = 0; i < MR; i++) d[p * MR + i] = s[i * lda + p];
        } else { /* partial panel: read rows, write with stride MR (in L1) */
            for (int i = 0; i < mr; i++) {
                const float *s = A + (i0 + ir + i) * lda + k0;
                for (int64_t p = 0; p < kc; p++) d[p * MR + i] = s[p];
            }
            for (int i = mr; i < MR; i++)
                for (int64_t p = 0; p < kc; p++) d[p * MR + i] = 0.0f;
        }
    }
}

/* One NR-column micro-panel of op(B) (pack.h), bf16 widened here; the cases apart so that the
 * fp32 one has no bf16 branch. Rounded to bf16 after (the panel is in L1) when pm says so. */
static void pack_b_panel(float *restrict dst, const void *B, int64_t ldb, int b_trans, int bf,
                         int64_t k0, int64_t kc, int64_t j0, int nc, pack_mode pm) {
    if (bf && b_trans)
        gdn_pack_b(NR, dst, B, ldb, 1, 1, k0, kc, j0, nc);
    else if (bf)
        gdn_pack_b(NR, dst, B, ldb, 0, 1, k0, kc, j0, nc);
    else
        gdn_pack_b(NR, dst, B, ldb, b_trans, 0, k0, kc, j0, nc);
    if (pm.fma_flags) gdn_fma_panel_b(dst, kc, NR, pm.fma_flags);
}

/* ---------------------------------------------------------------- micro-kernel */

/* C[0..mr) x [0..nr) (+)= a (kc x MR: a packed A micro-panel, a[p*MR + i]; or, direct, A in
 * place, row stride lda) * b (a kc x NR B micro-panel). The C tile is prefetched first: C's
 * rows are a power-of-two stride apart in the layer (same L1 set) and come from L3, so the
 * tile is fetched under the kc-long loop, not after it. */
static void micro(int64_t kc, const float *restrict a, const float *restrict b, float *C,
                  int64_t ldc, int acc, int mr, int nr) {
    gdn_mk_rows(MR, NV, 1, mr, kc, a, 1, MR, b, NR, C, ldc, nr, acc);
}
static void micro_direct(int64_t kc, const float *a, int64_t lda, const float *restrict b, float *C,
                         int64_t ldc, int acc, int mr, int nr) {
    gdn_mk_rows(MR, NV, 1, mr, kc, a, lda, 1, b, NR, C, ldc, nr, acc);
}

/* ---------------------------------------------------------------- streaming (small m, B^T) */

#define SI (VL == 16 ? 4 : 2) /* A rows per tile (SI * SR accumulators); a macro: used in #if */
#ifndef GDN_MM_SK
#define GDN_MM_SK 512
#endif
#ifndef GDN_MM_PFL /* prefetch locality of the next W block: 2, into L2 (prefetcht1). Measured
                    * (Zen 4, W from DRAM, 1 thread): 19 -> 24-28 GB/s against 3 (into L1; the
                    * L1's few miss buffers held the stream back), from L3 the same; on the Xeon
                    * where 3 was chosen, L2 measured no worse. */
#define GDN_MM_PFL 2
#endif
enum { SR = 4,                        /* W rows per tile */
       SR_WIDE = 2 * SR,              /* ... when a tile has at most SI / 2 A rows (decode at B <= 2;
                                       * AVX2: B = 1): the same SI * SR accumulators, twice the W
                                       * rows in flight (AVX2, B = 1, bf16 W from DRAM: 64-74 ->
                                       * 78-107 % of the bound, Zen 4, noisy) */
       SK = GDN_MM_SK };              /* depth block: A's m x SK slice and the tile's W rows in L1 */

/* part[i * tr + r] (+)= A[i][k0..k0+kv) . W[r][k0..k0+kv) lane-wise, for i < mi, r < nr <= tr
 * (tr = SR, or SR_WIDE with mi <= SI / 2); kv % VL == 0; first: part starts from zero. W (and pf)
 * fp32, or bf16 when bf (a constant: half the bytes per step, one prefetch per 64). Each lane
 * sums its depth positions in order whatever tr is, so a product's bits do not depend on it. */
static inline __attribute__((always_inline)) void stream_tile(int mi, int tr, int nr, int bf, int first,
                                                              int64_t kv, const float *A, int64_t lda,
                                                              const void *W, int64_t ldw, const void *pf,
                                                              gdn_vf part[SI * SR]) {
    gdn_vf s[SI * SR];
    for (int i = 0; i < mi; i++)
        for (int r = 0; r < tr; r++) s[i * tr + r] = first ? (gdn_vf){0} : part[i * tr + r];
    for (int64_t k = 0; k < kv; k += VL) {
        if (pf && (!bf || (k & 31) == 0))
            for (int r = 0; r < tr; r++) __builtin_prefetch(gdn_eptr(pf, bf, r * ldw + k), 0, GDN_MM_PFL);
        /* Each A and W vector is loaded once into a register when it is used more than once:
         * GCC otherwise folds the load into every FMA that reads it (4 x 4 tile: 20 loads for 16
         * FMAs, load-bound); the empty asm makes the value a register's. */
        gdn_vf av[SI];
        for (int i = 0; i < mi; i++) {
            av[i] = gdn_vloadu(A + i * lda + k);
#if defined(__x86_64__)
            if (nr > 1) __asm__("" : "+v"(av[i]));
#endif
        }
        for (int r = 0; r < tr; r++) {
            if (r >= nr) continue;
            gdn_vf w = gdn_loadw(W, bf, r * ldw + k);
#if defined(__x86_64__)
            if (mi > 1) __asm__("" : "+v"(w));
#endif
            for (int i = 0; i < mi; i++) s[i * tr + r] += av[i] * w;
        }
    }
    for (int i = 0; i < mi; i++)
        for (int r = 0; r < tr; r++) part[i * tr + r] = s[i * tr + r];
}

/* Full-width tiles specialised per row count and width (separate functions: inlined into one
 * switch, GCC merged them back into the generic loop with a branch per FMA). */
#define STREAM_TILE_FN(MI, TR, BF, NAME)                                                               \
    static __attribute__((noinline)) void NAME(int first, int64_t kv, const float *A, int64_t lda,      \
                                               const void *W, int64_t ldw, const void *pf,               \
                                               gdn_vf part[SI * SR]) {                                   \
        stream_tile(MI, TR, TR, BF, first, kv, A, lda, W, ldw, pf, part);                              \
    }
STREAM_TILE_FN(1, SR, 0, stream_tile_1)
STREAM_TILE_FN(2, SR, 0, stream_tile_2)
STREAM_TILE_FN(1, SR, 1, stream_tile_bf_1)
STREAM_TILE_FN(2, SR, 1, stream_tile_bf_2)
STREAM_TILE_FN(1, SR_WIDE, 0, stream_tile_w1)
STREAM_TILE_FN(1, SR_WIDE, 1, stream_tile_bf_w1)
#if SI > 2
STREAM_TILE_FN(3, SR, 0, stream_tile_3)
STREAM_TILE_FN(4, SR, 0, stream_tile_4)
STREAM_TILE_FN(3, SR, 1, stream_tile_bf_3)
STREAM_TILE_FN(4, SR, 1, stream_tile_bf_4)
STREAM_TILE_FN(2, SR_WIDE, 0, stream_tile_w2)
STREAM_TILE_FN(2, SR_WIDE, 1, stream_tile_bf_w2)
#endif
static __attribute__((noinline)) void stream_tile_edge(int mi, int tr, int nr, int first, int64_t kv,
                                                       const float *A, int64_t lda, const void *W,
                                                       int64_t ldw, const void *pf, gdn_vf part[SI * SR]) {
    stream_tile(mi, tr, nr, 0, first, kv, A, lda, W, ldw, pf, part);
}
static __attribute__((noinline)) void stream_tile_bf_edge(int mi, int tr, int nr, int first, int64_t kv,
                                                          const float *A, int64_t lda, const void *W,
                                                          int64_t ldw, const void *pf, gdn_vf part[SI * SR]) {
    stream_tile(mi, tr, nr, 1, first, kv, A, lda, W, ldw, pf, part);
}

/* The width of a tile of W rows for a product of m A rows: SR_WIDE when all m rows fit one
 * group of at most SI / 2, else SR. */
static inline int stream_width(int64_t m) { return m <= SI / 2 ? SR_WIDE : SR; }

static void stream_tile_any(int mi, int tr, int nr, int bf, int first, int64_t kv, const float *A,
                            int64_t lda, const void *W, int64_t ldw, const void *pf, gdn_vf part[SI * SR]) {
    if (nr == tr) {
        switch (mi + (bf ? 8 : 0) + (tr != SR ? 16 : 0)) {
        case 1: stream_tile_1(first, kv, A, lda, W, ldw, pf, part); return;
        case 2: stream_tile_2(first, kv, A, lda, W, ldw, pf, part); return;
        case 9: stream_tile_bf_1(first, kv, A, lda, W, ldw, pf, part); return;
        case 10: stream_tile_bf_2(first, kv, A, lda, W, ldw, pf, part); return;
        case 17: stream_tile_w1(first, kv, A, lda, W, ldw, pf, part); return;
        case 25: stream_tile_bf_w1(first, kv, A, lda, W, ldw, pf, part); return;
#if SI > 2
        case 3: stream_tile_3(first, kv, A, lda, W, ldw, pf, part); return;
        case 4: stream_tile_4(first, kv, A, lda, W, ldw, pf, part); return;
        case 11: stream_tile_bf_3(first, kv, A, lda, W, ldw, pf, part); return;
        case 12: stream_tile_bf_4(first, kv, A, lda, W, ldw, pf, part); return;
        case 18: stream_tile_w2(first, kv, A, lda, W, ldw, pf, part); return;
        case 26: stream_tile_bf_w2(first, kv, A, lda, W, ldw, pf, part); return;
#endif
        default: break;
        }
    }
    if (bf) /* edges: generic */
        stream_tile_bf_edge(mi, tr, nr, first, kv, A, lda, W, ldw, pf, part);
    else
        stream_tile_edge(mi, tr, nr, first, kv, A, lda, W, ldw, pf, part);
}

static inline float *align64(float *p) {
    return (float *)(((uintptr_t)p + 63) & ~(uintptr_t)63);
}

/* Partial vectors waiting for their horizontal sums: element (i, j) of C is the sum of v's
 * lanes, VL of them at a time (gdn_hsum_vl); queued across tiles, so that at m = 1 (a tile's
 * SR = 4 sums) the transpose is not spent on 4 vectors of VL. */
typedef struct {
    gdn_vf v[VL];
    int64_t i[VL], j[VL];
    int n;
} hsum_queue;

static void hsum_flush(hsum_queue *q, int acc, int64_t kv_all, int64_t kk, const float *A, int64_t lda,
                       const void *W, int bf, int64_t ldw, float *C, int64_t ldc) {
    if (!q->n) return;
    gdn_vf r[VL];
    for (int l = 0; l < VL; l++) r[l] = l < q->n ? q->v[l] : (gdn_vf){0};
    const gdn_vf sums = gdn_hsum_vl(r);
    for (int l = 0; l < q->n; l++) {
        const int64_t i = q->i[l], j = q->j[l];
        float s = sums[l];
        for (int64_t k = kv_all; k < kk; k++) s += A[i * lda + k] * gdn_loadw1(W, bf, j * ldw + k); /* the depth's tail */
        float *c = C + i * ldc + j;
        *c = acc ? *c + s : s;
    }
    q->n = 0;
}

/* One A row (m = 1) against VL W rows j0.. whose sums go straight to C[j0 .. j0 + VL): VL
 * accumulators in registers over the whole depth kk (a multiple of VL), the same lane order and
 * the same gdn_hsum_vl as the tiles and their queue, so the same bits. For a W that sits in the
 * caches (small models decode from L2/L3): the tiles' depth blocks, prefetches, stores of partial
 * vectors and queue bookkeeping cost there as much as the FMAs at E of a few hundred. */
static inline __attribute__((always_inline)) void stream_rows_vl(int bf, int acc, int64_t kk, const float *a,
                                                                 const void *W, int64_t ldw, float *c) {
    gdn_vf s[VL];
    for (int r = 0; r < VL; r++) s[r] = (gdn_vf){0};
    for (int64_t k = 0; k < kk; k += VL) {
        const gdn_vf av = gdn_vloadu(a + k);
        for (int r = 0; r < VL; r++) s[r] += av * gdn_loadw(W, bf, r * ldw + k);
    }
    gdn_vf sums = gdn_hsum_vl(s);
    if (acc) sums = gdn_vloadu(c) + sums;
    gdn_vstoreu(c, sums);
}
static __attribute__((noinline)) void stream_rows_vl_f32(int acc, int64_t kk, const float *a, const void *W,
                                                         int64_t ldw, float *c) {
    stream_rows_vl(0, acc, kk, a, W, ldw, c);
}
static __attribute__((noinline)) void stream_rows_vl_bf16(int acc, int64_t kk, const float *a, const void *W,
                                                          int64_t ldw, float *c) {
    stream_rows_vl(1, acc, kk, a, W, ldw, c);
}
/* W bytes up to which a one-row product takes stream_rows_vl: a matrix of a model that sits in
 * L2 or L3. Measured (Zen 4, 32 MB L3, 1 thread, `small`'s 14 MB, 0.5-1.5 MB matrices): 292-301
 * us per token with every matrix here against 343-345 us with the tiles above 512 KB. Larger
 * matrices (a real checkpoint's, from DRAM) keep the tiles and their L2 prefetch. */
#ifndef GDN_MM_ROWS_VL_MAX
#define GDN_MM_ROWS_VL_MAX (4 << 20)
#endif
enum { ROWS_VL_MAX_BYTES = GDN_MM_ROWS_VL_MAX };

/* One streaming product C (+)= A W^T, shared by a team (gdn_team). */
typedef struct {
    int acc, bf;
    int64_t m, n, kk;
    const float *A;
    int64_t lda;
    const void *W;
    int64_t ldw;
    float *C;
    int64_t ldc;
    float *ws;
    int copy;
} stream_job;

/* Thread t of nt: its contiguous range of W rows, in units of tiles. A (m <= 16 rows) is first
 * copied into ws with a row stride of kk rounded up to 16 floats plus 16 (when it fits): in
 * place, with a power-of-two lda, the same depth of all m rows falls into one L1 set and the
 * 16 + SR lines evict each other (measured: m = 16 ran at half speed). */
static void stream_share(void *p, int t, int nt) {
    const stream_job *jb = p;
    const int acc = jb->acc, bf = jb->bf;
    const int64_t m = jb->m, n = jb->n, kk = jb->kk, ldw = jb->ldw, ldc = jb->ldc;
    const void *W = jb->W;
    float *C = jb->C;
    const int64_t kv_all = kk / VL * VL;
    const int64_t lda2 = (kk + 15) / 16 * 16 + 16;
    const gdn_fpmode fm = gdn_fp_fast_begin();
    if (jb->copy) {
        for (int64_t i = t; i < m; i += nt) memcpy(jb->ws + i * lda2, jb->A + i * jb->lda, sizeof(float) * (size_t)kk);
#pragma omp barrier
    }
    const float *As = jb->copy ? jb->ws : jb->A;
    const int64_t ldas = jb->copy ? lda2 : jb->lda;
    const int tr = stream_width(m);
    const int64_t tiles = (n + tr - 1) / tr;
    const int64_t j_lo = tiles * t / nt * tr, j_hi = min64(n, tiles * (t + 1) / nt * tr);
    const int groups = (int)((m + SI - 1) / SI);
    gdn_vf part[SMALL_M / SI][SI * SR];
    if (!kv_all) memset(part, 0, sizeof part[0] * (size_t)groups); /* only the depth's tail */
    hsum_queue hq = {.n = 0};
    int64_t j_from = j_lo;
    if (m == 1 && kv_all == kk && (double)n * (double)kk * (bf ? 2 : 4) <= ROWS_VL_MAX_BYTES)
        for (; j_from + VL <= j_hi; j_from += VL)
            (bf ? stream_rows_vl_bf16 : stream_rows_vl_f32)(acc, kk, As, gdn_eptr(W, bf, j_from * ldw), ldw, C + j_from);
    /* bf16 W under several row groups: the block widened once into L1 (wide), which every group
     * then reads as fp32; widened again per group, the conversions outnumbered the FMAs at m = 16
     * with AVX2's 2-row groups (bf16 decode at B = 16 ran 1.5x slower than fp32). The same FMAs in
     * the same order: the same bits. */
    float wide[SR * SK] __attribute__((aligned(64)));
    const int widen = bf && groups > 1 && tr == SR;
    for (int64_t j0 = j_from; j0 < j_hi; j0 += tr) {
        const int nr = (int)min64(tr, j_hi - j0);
        for (int64_t k0 = 0; k0 < kv_all; k0 += SK) {
            const int64_t kv = min64(SK, kv_all - k0);
            /* the first row group reads this block of W from memory; it also prefetches
             * the next block (or the next tile's first), so that the memory stream runs
             * under the other groups' arithmetic instead of after it */
            const void *next = gdn_eptr(W, bf, k0 + SK < kv_all ? j0 * ldw + k0 + SK : (j0 + tr) * ldw);
            if (j0 + tr >= j_hi && k0 + SK >= kv_all) next = NULL;
            const void *wb = gdn_eptr(W, bf, j0 * ldw + k0);
            int64_t ldwb = ldw;
            int bfb = bf;
            if (widen) {
                for (int r = 0; r < nr; r++) {
                    for (int64_t k = 0; next && k < kv; k += 32) __builtin_prefetch(gdn_eptr(next, 1, r * ldw + k), 0, GDN_MM_PFL);
                    for (int64_t k = 0; k < kv; k += VL) gdn_vstoreu(wide + r * SK + k, gdn_loadw(wb, 1, r * ldw + k));
                }
                wb = wide, ldwb = SK, bfb = 0, next = NULL;
            }
            for (int g = 0; g < groups; g++)
                stream_tile_any((int)min64(SI, m - g * SI), tr, nr, bfb, k0 == 0, kv, As + g * SI * ldas + k0,
                                ldas, wb, ldwb, g ? NULL : next, part[g]);
        }
        /* the m x nr partial vectors join the queue of horizontal sums */
        for (int64_t i = 0; i < m; i++)
            for (int r = 0; r < nr; r++) {
                hq.v[hq.n] = part[i / SI][i % SI * tr + r], hq.i[hq.n] = i, hq.j[hq.n] = j0 + r;
                if (++hq.n == VL) hsum_flush(&hq, acc, kv_all, kk, As, ldas, W, bf, ldw, C, ldc);
            }
    }
    hsum_flush(&hq, acc, kv_all, kk, As, ldas, W, bf, ldw, C, ldc);
    gdn_fp_fast_end(fm);
}

static void matmul_stream(int acc, int bf, int64_t m, int64_t n, int64_t kk, const float *A, int64_t lda,
                          const void *W, int64_t ldw, float *C, int64_t ldc, float *ws,
                          size_t ws_floats, int threads) {
    const int64_t lda2 = (kk + 15) / 16 * 16 + 16;
    stream_job jb = {acc, bf, m, n, kk, A, lda, W, ldw, C, ldc, ws, (size_t)(m * lda2) <= ws_floats};
    gdn_team(gdn_threads_for_bytes(threads, (double)n * (double)kk * (bf ? 2 : 4)), stream_share, &jb);
}

/* ---------------------------------------------------------------- blocked path */

/* Rows [ic, ic + mc) of op(A)'s depth slice [pc, pc + kc), packed into apack, times the packed B
 * micro-panels q_lo..q_hi of the panel at bp (panel q at bp + q kc NR) into C's columns
 * [q_lo NR, q_hi NR) of the nc the panel holds (C at the panel's first column). Each A
 * micro-panel (kc x MR, 14 KB) stays in L1 while the B micro-panels stream from L2. */
static void block_product(float *apack, const void *A, int64_t lda, int a_trans, int64_t ic, int64_t mc,
                          int64_t pc, int64_t kc, const float *bp, int64_t q_lo, int64_t q_hi, float *C, int64_t ldc,
                          int64_t nc, int acc, pack_mode pm) {
    pack_a(apack, A, lda, a_trans, ic, mc, pc, kc, pm);
    for (int64_t ir = 0; ir < mc; ir += MR)
        for (int64_t q = q_lo; q < q_hi; q++)
            micro(kc, apack + ir * kc, bp + q * kc * NR, C + (ic + ir) * ldc + q * NR, ldc, acc,
                  (int)min64(MR, mc - ir), (int)min64(NR, nc - q * NR));
}

size_t gdn_matmul_ws_floats(int threads) {
    if (threads < 1) threads = 1;
    /* shared B panel (NC rounded to NR; one more micro-panel a thread where each owns a
     * region of it) + one A block per thread + alignment slack */
    return (size_t)KC * NR * ((NC + NR - 1) / NR + (size_t)threads) +
           (size_t)threads * ((MC + MR - 1) / MR * MR * KC + 16) + 16;
}

void gdn_matmul(int flags, int64_t m, int64_t n, int64_t kk, const void *A, int64_t lda,
                const void *B, int64_t ldb, float *C, int64_t ldc, float *ws, int threads) {
    const int acc = (flags & GDN_GEMM_ACC) != 0, a_trans = (flags & GDN_GEMM_A_TRANS) != 0,
              b_trans = (flags & GDN_GEMM_B_TRANS) != 0, bf = (flags & GDN_GEMM_B_BF16) != 0;
    const pack_mode pm = {(flags & GDN_GEMM_A_BF16) != 0,
                          flags & (GDN_GEMM_ROUND_BF16 | GDN_GEMM_TRUNC_BF16 | GDN_GEMM_SHIFT_BF16)};
    /* A read in place (the streaming path, one B micro-panel) only when it is fp32 as it stands */
    const int a_in_place = !pm.abf && !pm.fma_flags;
    if (m <= 0 || n <= 0) return;
    if (threads < 1) threads = 1;
    if (kk <= 0) {
        if (!acc)
            for (int64_t i = 0; i < m; i++) memset(C + i * ldc, 0, sizeof(float) * (size_t)n);
        return;
    }
    if (m <= SMALL_M && b_trans && !a_trans && a_in_place) {
        float *w64 = align64(ws);
        matmul_stream(acc, bf, m, n, kk, (const float *)A, lda, B, ldb, C, ldc, w64,
                      gdn_matmul_ws_floats(threads) - (size_t)(w64 - ws), threads);
        return;
    }
    float *bpack = align64(ws);
    float *apack0 = bpack + (size_t)KC * NR * ((NC + NR - 1) / NR + (size_t)threads);
    const int64_t ablock = (int64_t)((MC + MR - 1) / MR * MR) * KC + 16; /* + slack, see pack_a */
    /* Row blocks of about MC rows (whole MR panels, sizes balanced); when there are fewer row
     * blocks than threads, each row block is also split into column groups. The work items
     * (row block x column group) of a slice are handed out dynamically: on a shared machine one
     * thread may run slower, and a static split would make the other wait at every slice. */
    const int64_t mpanels = (m + MR - 1) / MR, ppb_max = MC / MR;
    const int64_t nblk = (mpanels + ppb_max - 1) / ppb_max;
    const int64_t ppb = (mpanels + nblk - 1) / nblk; /* panels per row block */
    const int64_t nblk_m = (mpanels + ppb - 1) / ppb;
    /* Few row blocks (m up to a few thousand rows: a sequence shard, the loss head's chunk)
     * against many columns: each thread owns a column range of every panel instead, packs its
     * own B micro-panels and every A block, and never waits for the other within the product.
     * Shared row blocks would be handed out a few per slice (4 at m = 512: 20 panels against
     * 17), the slower thread setting every slice's pace (the lm_head's 512 x 248,320 x 1024 ran
     * at 71 % of the peak there against 92 % with many blocks); packing A once per thread costs
     * about 1 / (2 n / threads) of the FLOPs. */
    const int own_cols = nblk_m < 4 * threads && n >= 4 * NR * threads;
    /* (a mutation whose sums depend on the thread: what the tests' bitwise thread checks catch) */
    const int depth_reversed = own_cols && gdn_test_mutate("matmul: column-owned depth blocks reversed off the first thread");
    const int64_t depth_blocks = (kk + KC - 1) / KC;
#pragma omp parallel num_threads(threads)
    {
        const gdn_fpmode fm = gdn_fp_fast_begin();
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        float *apack = apack0 + t * ablock;
        const int64_t tn = nblk_m >= nt ? 1 : nt, items = nblk_m * tn;
        const int64_t own_panels = (NC + NR - 1) / NR / nt + 1; /* the most a thread packs */
        for (int64_t jc = 0; jc < n; jc += NC) {
            const int64_t nc = min64(NC, n - jc), npan = (nc + NR - 1) / NR;
            for (int64_t pc = 0; pc < kk; pc += KC) {
                const int64_t kc = min64(KC, kk - pc);
                const int acc_k = acc || pc > 0;
                if (own_cols) {
                    /* the thread's panels in a region of its own: another thread may already
                     * be packing the next slice, whose narrower last panel splits differently */
                    const int64_t q_lo = npan * t / nt, q_hi = npan * (t + 1) / nt;
                    const int64_t po = depth_reversed && t ? (depth_blocks - 1 - pc / KC) * KC : pc;
                    const int64_t ko = min64(KC, kk - po);
                    float *own = bpack + t * own_panels * KC * NR - q_lo * ko * NR;
                    for (int64_t q = q_lo; q < q_hi; q++)
                        pack_b_panel(own + q * ko * NR, B, ldb, b_trans, bf, po, ko, jc + q * NR,
                                     (int)min64(NR, nc - q * NR), pm);
                    for (int64_t ib = 0; ib < nblk_m && q_lo < q_hi; ib++) {
                        const int64_t ic = ib * ppb * MR;
                        block_product(apack, A, lda, a_trans, ic, min64(ppb * MR, m - ic), po, ko, own, q_lo, q_hi,
                                      C + jc, ldc, nc, acc_k, pm);
                    }
                    continue;
                }
                for (int64_t q = t; q < npan; q += nt)
                    pack_b_panel(bpack + q * kc * NR, B, ldb, b_trans, bf, pc, kc, jc + q * NR,
                                 (int)min64(NR, nc - q * NR), pm);
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
                for (int64_t it = 0; it < items; it++) {
                    const int64_t ib = it / tn, tj = it % tn;
                    const int64_t ic = ib * ppb * MR, mc = min64(ppb * MR, m - ic);
                    const int64_t q_lo = npan * tj / tn, q_hi = npan * (tj + 1) / tn;
                    if (q_lo == q_hi) continue;
                    if (!a_trans && q_hi - q_lo == 1 && a_in_place) { /* one B micro-panel: A in place */
                        for (int64_t ir = 0; ir < mc; ir += MR)
                            micro_direct(kc, (const float *)A + (ic + ir) * lda + pc, lda, bpack + q_lo * kc * NR,
                                         C + (ic + ir) * ldc + jc + q_lo * NR, ldc, acc_k,
                                         (int)min64(MR, mc - ir), (int)min64(NR, nc - q_lo * NR));
                        continue;
                    }
                    block_product(apack, A, lda, a_trans, ic, mc, pc, kc, bpack, q_lo, q_hi, C + jc, ldc, nc, acc_k, pm);
                } /* (implied barrier: the B panel is repacked next) */
            }
        }
        gdn_fp_fast_end(fm);
    }
}

const char *gdn_matmul_path(void) {
    return "blocked " STR(MR) "x" GDN_2VL_STR " (" ISA_NAME "), streaming for m<=16 with B^T";
}

/* ---------------------------------------------------------------- peak */

/* Native-width FMA peak: each thread runs NACC independent accumulator chains (enough to cover
 * FMA latency x FMA ports); best of several short runs. */
double gdn_measure_peak_gflops(int threads) {
    enum { NACC = VL == 16 ? 24 : 12, ITERS = 3000000, RUNS = 8 }; /* ~0.1 s at 1 thread */
    if (threads < 1) threads = 1;
    double best = 0.0;
    volatile float seed = 1.0f;
    for (int run = 0; run < RUNS; run++) {
        double secs = 0.0;
        int used = 1;
#pragma omp parallel num_threads(threads)
        {
            const float x0 = seed * 0.999999f, y0 = seed * 1e-7f;
            gdn_vf acc[NACC];
            const gdn_vf x = (gdn_vf){0} + x0, y = (gdn_vf){0} + y0;
#pragma GCC unroll 32
            for (int i = 0; i < NACC; i++) acc[i] = (gdn_vf){0} + (float)i;
#pragma omp barrier
            const double t0 = omp_get_wtime();
            for (int it = 0; it < ITERS; it++) {
#pragma GCC unroll 32
                for (int i = 0; i < NACC; i++) acc[i] = acc[i] * x + y;
            }
#pragma omp barrier
            const double t1 = omp_get_wtime();
            gdn_vf s = {0};
            for (int i = 0; i < NACC; i++) s += acc[i];
            if (s[0] == 12345.678f) seed = s[1]; /* practically never: keeps the result live */
#pragma omp master
            {
                secs = t1 - t0;
                used = omp_get_num_threads();
            }
        }
        const double gf = 2.0 * VL * NACC * (double)ITERS * used / secs * 1e-9;
        if (gf > best) best = gf;
    }
    return best;
}
