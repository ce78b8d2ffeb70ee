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
 * Files (bf16.h, one per ISA path under this driver): this file chooses the path, blocks and
 * threads the loops; bf16_pack.c packs for every path; bf16_fallback.c, bf16_avx512.c,
 * bf16_amx.c and bf16_amx_emu.c hold each path's micro-kernel (and its peak), compiled with their
 * own target attributes.
 *
 * Not here yet: a streaming path for small m (decode: m <= 16 runs the blocked loops). */
#include "bf16.h"
#include "pack.h"

#include <omp.h>
#include <stdlib.h>
#include <string.h>

int gdn_bf16_mutations(void) {
    return (gdn_test_mutate("bf16 gemm: operands truncated instead of rounded") ? GDN_BF16_MUT_TRUNCATE : 0) |
           (gdn_test_mutate("bf16 gemm: B k pairs taken one k late") ? GDN_BF16_MUT_PAIR_SHIFT : 0) |
           (gdn_test_mutate("bf16 gemm: AMX last k block of a slice skipped") ? GDN_BF16_MUT_SKIP_KBLOCK : 0) |
           (gdn_test_mutate("bf16 gemm: fallback sums in the AMX order") ? GDN_BF16_MUT_AMX_ORDER : 0);
}
int gdn_bf16_fma_rounding(void) {
    const int mut = gdn_bf16_mutations();
    return (mut & GDN_BF16_MUT_TRUNCATE ? GDN_GEMM_TRUNC_BF16 : GDN_GEMM_ROUND_BF16) |
           (mut & GDN_BF16_MUT_PAIR_SHIFT ? GDN_GEMM_SHIFT_BF16 : 0);
}
static void pack_a(int path, int trans, int64_t m, int64_t kk, const float *A, int64_t lda, void *dst, int mut);
static void pack_b(int path, int trans, int64_t n, int64_t kk, const float *B, int64_t ldb, void *dst, int mut);
static void fma_pack_a(int trans, int64_t m, int64_t kk, const float *A, int64_t lda, float *dst, int trunc);

/* ---------------------------------------------------------------- dispatch */

/* The CPU's BF16 instructions as dispatched (base's isa.c: CPUID, the OS, Linux's AMX permission,
 * GDNCP_ISA's cap). */
static int cpu_has_avx512bf16(void) { return HAVE_X86 && gdn_isa_dispatched() >= GDN_ISA_AVX512BF16; }
static int cpu_has_amx(void) { return HAVE_AMX_CODE && gdn_isa_dispatched() >= GDN_ISA_AMX; }

int gdn_bf16_path_available(int path) {
    switch (path) {
    case GDN_BF16_FALLBACK:
    case GDN_BF16_FMA:
    case GDN_BF16_AMX_EMU: return 1;
    case GDN_BF16_AVX512: return cpu_has_avx512bf16();
    case GDN_BF16_AMX: return cpu_has_amx();
    default: return 0;
    }
}
int gdn_bf16_path_auto(void) {
    return cpu_has_amx() ? GDN_BF16_AMX : cpu_has_avx512bf16() ? GDN_BF16_AVX512 : GDN_BF16_FMA;
}
const char *gdn_bf16_path_name(int path) {
    switch (path) {
    case GDN_BF16_FALLBACK: return "bf16 fallback (fp32 vectors, " GDN_VL_STR " lanes, VDPBF16PS order)";
    case GDN_BF16_AVX512: return "bf16 AVX512-BF16 (VDPBF16PS, 14x32 tile)";
    case GDN_BF16_AMX: return "bf16 AMX (TDPBF16PS, 32x32 block)";
    case GDN_BF16_AMX_EMU: return "bf16 AMX emulated (scalar TDPBF16PS, 32x32 block)";
    case GDN_BF16_FMA: return "bf16 operands on the fp32 FMA micro-kernel (no BF16 instructions; " GDN_VL_STR " lanes)";
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
    if (path == GDN_BF16_FMA) return 64; /* (gdn_matmul's space, allocated per call) */
    size_t a, b;
    ws_parts(path, m, n, kk, &a, &b);
    return a + b + 64;
}

/* One micro-kernel call of `path`: depth [lo, lo + depth) (even; on AMX whole 32-deep blocks) of
 * row panel ip of the packed A (MR rows; kcp values a row, the vector paths in pairs) against the
 * B micro-panel bq (already at lo), into the mr x nc block C. */
static inline void mk_run(int path, const void *apack, int64_t ip, int MR, int64_t kcp, int64_t lo, int64_t depth,
                          const uint32_t *bq, float *C, int64_t ldc, int acc, int mr, int nc, int mut) {
    const int64_t kp = kcp / 2;
    switch (path) {
    case GDN_BF16_FALLBACK:
        gdn_bf16_mk_fallback(depth / 2, (const float *)apack + ((size_t)ip * MR * kp + (size_t)(lo / 2) * MR) * 2, bq, C, ldc, acc,
                    mr, nc, (mut & GDN_BF16_MUT_AMX_ORDER) != 0);
        break;
#if HAVE_X86
    case GDN_BF16_AVX512:
        gdn_bf16_mk_avx512(depth / 2, (const uint32_t *)apack + (size_t)ip * MR * kp + (size_t)(lo / 2) * MR, bq, C, ldc, acc,
                      mr, nc);
        break;
#endif
#if HAVE_AMX_CODE
    case GDN_BF16_AMX:
        gdn_bf16_mk_amx(depth, kcp, (const uint16_t *)apack + (size_t)ip * MR * kcp + lo, bq, C, ldc, acc, mr, nc,
                        mut & GDN_BF16_MUT_SKIP_KBLOCK);
        break;
#endif
    default:
        gdn_bf16_mk_amx_emu(depth, kcp, (const uint16_t *)apack + (size_t)ip * MR * kcp + lo, bq, C, ldc, acc, mr, nc,
                            mut & GDN_BF16_MUT_SKIP_KBLOCK);
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
    const int mut = gdn_bf16_mutations();
    const int64_t KC = bl.KC, NC = bl.NC;
    const int64_t mpanels = (m + MR - 1) / MR;
    /* packed A slice: mpanels x MR x kcp bf16; B panel: NC/NR micro-panels x kcp/2 x NR words */
    size_t abytes, bbytes;
    ws_parts(path, m, n, kk, &abytes, &bbytes);
    char *buf = ws ? NULL : gdn_alloc_aligned("matmul_bf16: buf", abytes + bbytes + 64);
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
            if (HAVE_HW_CVT && hw && at && !abf && !(mut & GDN_BF16_MUT_PACKING)) {
                /* A^T fp32 (see gdn_bf16_pack_a_trans_x_hw): this thread's share of the panels, depth outer */
                const int64_t per = (mpanels + nt - 1) / nt, np0 = min64(mpanels, tid * per);
                if (amx)
                    gdn_bf16_pack_a_trans_x_hw((uint16_t *)apack, (const float *)A + pc * lda, lda, np0,
                                        min64(mpanels, np0 + per), m, kc, kcp);
                else
                    gdn_bf16_pack_a_trans_v_hw((uint32_t *)apack, (const float *)A + pc * lda, lda, np0,
                                          min64(mpanels, np0 + per), m, kc, kp);
#pragma omp barrier
            } else {
#pragma omp for schedule(static)
                for (int64_t ip = 0; ip < mpanels; ip++) {
                    const int64_t mr = min64(MR, m - ip * MR);
                    if (amx)
                        gdn_bf16_panel_a_x((uint16_t *)apack + ip * MR * kcp, A, abf, at, lda, ip * MR, mr, pc, kc, kcp, hw, mut);
                    else
                        gdn_bf16_panel_a_v((uint32_t *)apack + ip * MR * kp * (fb + 1), A, abf, at, lda, ip * MR, mr, pc,
                                 kc, kp, fb, hw, mut);
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
                        gdn_bf16_panel_b(own + q * kp * NR, B, bbf, bt, ldb, pc, kc, kp, (q0 + q) * NR,
                               (int)min64(NR, n - (q0 + q) * NR), hw, mut);
                    for (int64_t ip = 0; ip < mpanels; ip++)
                        for (int64_t q = 0; q < nq; q++)
                            mk_run(path, apack, ip, MR, kcp, 0, kcp, own + q * kp * NR,
                                   C + ip * MR * ldc + (q0 + q) * NR, ldc, acc_k, (int)min64(MR, m - ip * MR),
                                   (int)min64(NR, n - (q0 + q) * NR), mut);
                }
#pragma omp barrier /* (the A slice is repacked next) */
                continue;
            }
            for (int64_t jc = 0; jc < n; jc += NC) {
                const int64_t nc = min64(NC, n - jc), npan = (nc + NR - 1) / NR;
                for (int64_t q = tid; q < npan; q += nt)
                    gdn_bf16_panel_b((uint32_t *)bpack + q * kp * NR, B, bbf, bt, ldb, pc, kc, kp, jc + q * NR,
                           (int)min64(NR, nc - q * NR), hw, mut);
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
                        mk_run(path, apack, ip, MR, kcp, 0, kcp, bq, Crow + q * NR, ldc, acc_k, mr, ncq, mut);
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
    if (path == GDN_BF16_FMA) { /* the fp32 GEMM rounding as it packs */
        float *fws = gdn_alloc_aligned("matmul_bf16: fma ws", gdn_matmul_ws_floats(threads) * sizeof(float));
        GDN_ASSERT(fws);
        gdn_matmul(flags | gdn_bf16_fma_rounding(), m, n, kk, A, lda, B, ldb, C, ldc, fws, threads);
        free(fws);
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
    if (path == GDN_BF16_FMA) return (size_t)m * (size_t)kk * 4 + 64; /* op(A) alone (gdn_gemm packs B), aligned */
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
    if (path == GDN_BF16_FMA) { /* op(A) rounded into ws, then the fp32 small GEMM rounding B as it packs */
        const int rounding = gdn_bf16_fma_rounding();
        float *a = (float *)(((uintptr_t)ws + 63) & ~(uintptr_t)63);
        fma_pack_a(at, m, kk, A, lda, a, (rounding & GDN_GEMM_TRUNC_BF16) != 0);
        gdn_gemm((flags & ~GDN_GEMM_A_TRANS) | rounding, m, n, kk, a, kk, B, ldb, C, ldc);
        return path;
    }
    const bf_blocking bl = blocking(path);
    const int amx = bl.amx, MR = bl.MR;
    /* depth granule: a 32-deep tile block (AMX) or a pair */
    const int gran = amx ? 32 : 2;
    const int64_t kcp = (kk + gran - 1) / gran * gran, kp = kcp / 2;
    const int mpanels = (m + MR - 1) / MR, npan = (n + NR - 1) / NR;
    char *apack = (char *)(((uintptr_t)ws + 63) & ~(uintptr_t)63), *bpack = apack + gdn_bf16_packed_a_bytes(path, m, kk);
    const int mut = gdn_bf16_mutations();
    pack_a(path, at, m, kk, A, lda, apack, mut);
    pack_b(path, bt, n, kk, B, ldb, bpack, mut);
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
            mk_run(path, apack, ip, MR, kcp, lo, hi - lo, bq, Cb, ldc, acc, mr, ncq, mut);
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
/* The FMA path's packed operands: op(A) [m x kk] and op(B)^T [n x kk], row-major fp32 rounded to
 * bf16, so that a product over fewer rows, columns or depth finds them in place (gdn_gemm reads
 * A in place and packs B into its own panel). */
static void fma_pack_a(int trans, int64_t m, int64_t kk, const float *A, int64_t lda, float *dst, int trunc) {
    if (trans) {
        gdn_transpose((int)kk, (int)m, A, (int)lda, dst, (int)kk);
        gdn_round_bf16(dst, dst, m * kk, trunc);
        return;
    }
    for (int64_t i = 0; i < m; i++) gdn_round_bf16(dst + i * kk, A + i * lda, kk, trunc); /* read, rounded, stored */
}
size_t gdn_bf16_packed_a_bytes(int path, int64_t m, int64_t kk) {
    if (path == GDN_BF16_FMA) return ((size_t)m * (size_t)kk * 4 + 63) / 64 * 64;
    const bf_blocking bl = blocking(path);
    const size_t esz = path == GDN_BF16_FALLBACK ? 4 : 2; /* the fallback's A widened to fp32 */
    return ((size_t)((m + bl.MR - 1) / bl.MR) * (size_t)bl.MR * (size_t)packed_depth(path, kk) * esz + 63) / 64 * 64;
}
size_t gdn_bf16_packed_b_bytes(int path, int64_t n, int64_t kk) {
    if (path == GDN_BF16_FMA) return ((size_t)n * (size_t)kk * 4 + 63) / 64 * 64;
    return (size_t)((n + NR - 1) / NR) * (size_t)(packed_depth(path, kk) / 2) * NR * 4;
}
static void pack_a(int path, int trans, int64_t m, int64_t kk, const float *A, int64_t lda, void *dst, int mut) {
    const bf_blocking bl = blocking(path);
    const int64_t kcp = packed_depth(path, kk), kp = kcp / 2;
    const int fb = path == GDN_BF16_FALLBACK, hw = hw_convert(path);
    for (int64_t ip = 0; ip * bl.MR < m; ip++) {
        const int64_t mr = min64(bl.MR, m - ip * bl.MR);
        if (bl.amx)
            gdn_bf16_panel_a_x((uint16_t *)dst + ip * bl.MR * kcp, A, 0, trans, lda, ip * bl.MR, mr, 0, kk, kcp, hw, mut);
        else
            gdn_bf16_panel_a_v((uint32_t *)dst + ip * bl.MR * kp * (fb + 1), A, 0, trans, lda, ip * bl.MR, mr, 0, kk, kp, fb, hw, mut);
    }
}
static void pack_b(int path, int trans, int64_t n, int64_t kk, const float *B, int64_t ldb, void *dst, int mut) {
    const int64_t kp = packed_depth(path, kk) / 2;
    for (int64_t q = 0; q * NR < n; q++)
        gdn_bf16_panel_b((uint32_t *)dst + q * kp * NR, B, 0, trans, ldb, 0, kk, kp, q * NR, (int)min64(NR, n - q * NR),
               hw_convert(path), mut);
}
void gdn_bf16_pack_a(int path, int trans, int64_t m, int64_t kk, const float *A, int64_t lda, void *dst) {
    const int mut = gdn_bf16_mutations();
    if (path == GDN_BF16_FMA)
        fma_pack_a(trans, m, kk, A, lda, dst, (mut & GDN_BF16_MUT_TRUNCATE) != 0);
    else
        pack_a(path, trans, m, kk, A, lda, dst, mut);
}
void gdn_bf16_pack_b(int path, int trans, int64_t n, int64_t kk, const float *B, int64_t ldb, void *dst) {
    const int mut = gdn_bf16_mutations();
    if (path == GDN_BF16_FMA) /* op(B)^T [n x kk]: its rows where they are whatever n a product uses */
        fma_pack_a(!trans, n, kk, B, ldb, dst, (mut & GDN_BF16_MUT_TRUNCATE) != 0);
    else
        pack_b(path, trans, n, kk, B, ldb, dst, mut);
}
unsigned gdn_bf16_thread_begin(int path) {
    const gdn_fpmode fm = gdn_fp_fast_begin();
    tilecfg cfg;
    tilecfg_init(&cfg);
    if (path == GDN_BF16_AMX_EMU) gdn_bf16_emu_loadcfg(&cfg);
#if HAVE_AMX_CODE
    if (path == GDN_BF16_AMX) gdn_bf16_amx_loadcfg(&cfg);
#endif
    return (unsigned)fm;
}
void gdn_bf16_thread_end(int path, unsigned mode) {
#if HAVE_AMX_CODE
    if (path == GDN_BF16_AMX) gdn_bf16_amx_release();
#endif
    (void)path;
    gdn_fp_fast_end((gdn_fpmode)mode);
}
void gdn_bf16_packed_gemm(int path, int acc, int64_t m, int64_t n, int64_t kk, const void *a, int64_t a_kk,
                          const void *b, int64_t b_kk, float *C, int64_t ldc) {
    GDN_ASSERT(kk <= a_kk && kk <= b_kk);
    if (path == GDN_BF16_FMA) {
        /* (B already rounded: rounding it again as gdn_gemm packs it changes nothing but the controls) */
        gdn_gemm((acc ? GDN_GEMM_ACC : 0) | GDN_GEMM_B_TRANS | gdn_bf16_fma_rounding(), (int)m, (int)n, (int)kk, a,
                 (int)a_kk, b, (int)b_kk, C, (int)ldc);
        return;
    }
    const bf_blocking bl = blocking(path);
    const int64_t depth = packed_depth(path, kk), akcp = packed_depth(path, a_kk), bkp = packed_depth(path, b_kk) / 2;
    const int mut = gdn_bf16_mutations();
    for (int64_t ip = 0; ip * bl.MR < m; ip++) {
        const int mr = (int)min64(bl.MR, m - ip * bl.MR);
        for (int64_t q = 0; q * NR < n; q++)
            mk_run(path, a, ip, bl.MR, akcp, 0, depth, (const uint32_t *)b + q * bkp * NR,
                   C + ip * bl.MR * ldc + q * NR, ldc, acc, mr, (int)min64(NR, n - q * NR), mut);
    }
}

/* ---------------------------------------------------------------- peaks and the bench probe */

/* Register-only throughput of the path's instruction, GFLOP/s (2 per multiply-add): VDPBF16PS
 * zmm (64 FLOPs each) over 24 independent accumulators, or TDPBF16PS (16 x 16 x 32 x 2 = 16384
 * FLOPs each) over 4 accumulator tiles; best of several runs. 0 for a path without its own
 * instruction (fallback, emulated). */

double gdn_measure_bf16_peak_gflops(int path, int threads) {
    if (threads < 1) threads = 1;
    double best = 0;
    for (int run = 0; run < 6; run++) {
        double g = path == GDN_BF16_FMA ? gdn_measure_peak_gflops(threads) : 0;
#if HAVE_X86
        if (path == GDN_BF16_AVX512 && cpu_has_avx512bf16()) g = gdn_bf16_peak_avx512_once(threads);
#endif
#if HAVE_AMX_CODE
        if (path == GDN_BF16_AMX && cpu_has_amx()) g = gdn_bf16_peak_amx_once(threads);
#endif
        if (g > best) best = g;
    }
    return best;
}

/* Public probes for `gdncp bench matmul` (include/gdncp/bench.h). */
int gdn_bench_bf16(int path, int threads, gdn_bf16_path_info *info) {
    if (info) memset(info, 0, sizeof *info);
    if (!info) return gdn_fail(GDN_ERR_ARG, "gdn_bench_bf16: info is NULL");
    if (path < GDN_BF16_AUTO || path > GDN_BF16_FMA)
        return gdn_fail(GDN_ERR_ARG, "gdn_bench_bf16: path %d (0 for this CPU's, or 1..5)", path);
    if (path == GDN_BF16_AUTO) path = gdn_bf16_path_auto();
    info->path = path;
    info->available = gdn_bf16_path_available(path);
    info->name = gdn_bf16_path_name(path);
    info->peak_gflops = threads >= 1 ? gdn_measure_bf16_peak_gflops(path, threads) : 0.0;
    return GDN_OK;
}
void gdn_bench_projection(int bf16_path, int64_t m, int64_t n, int64_t kk, const float *x, const float *W,
                          float *y, int threads) {
    if (bf16_path < 0) {
        const size_t bytes = (gdn_matmul_ws_floats(threads) * sizeof(float) + 63) / 64 * 64;
        float *ws = gdn_alloc_aligned("matmul_bf16: ws", bytes);
        GDN_ASSERT(ws);
        gdn_matmul(GDN_GEMM_B_TRANS, m, n, kk, x, kk, W, kk, y, n, ws, threads);
        free(ws);
        return;
    }
    gdn_matmul_bf16(bf16_path, GDN_GEMM_B_TRANS, m, n, kk, x, kk, W, kk, y, n, NULL, threads);
}
