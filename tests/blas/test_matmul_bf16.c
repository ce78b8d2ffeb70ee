/* The BF16-compute GEMM (gdn_matmul_bf16, src/blas/matmul_bf16.c) on every path: the fallback,
 * AVX512-BF16 (VDPBF16PS) where the CPU has it, the AMX kernel with its tile instructions
 * emulated (always), real AMX where the CPU and OS allow it, and the FMA path (the operands
 * rounded as the fp32 GEMMs pack them; always). A path that cannot run here is
 * printed NOT RUN and counts neither as passed nor as failed.
 *
 * Checks, each with its negative control through the same measure:
 *  1. vs a double-precision product of the bf16-rounded operands (rounded here, independently,
 *     to nearest even). Measure per element: |C - ref| / (sum_p |op(A)_ip op(B)_pj| + |C_in|);
 *     the only rounding left is fp32's accumulation (the products of two bf16 are exact in fp32),
 *     bounded by about kk 2^-24 and in practice ~sqrt(kk) 2^-24: tolerance 1e-5 (observed ~1e-7).
 *     Controls: operands truncated instead of rounded (a bias of ~2^-9 per operand: ~1e-3),
 *     B's k pairs off by one (not the FMA path: no pairs), and (AMX) the last 32-deep tile block
 *     of each slice skipped.
 *  2. vs the fp32 gdn_matmul on the unrounded operands: max|C - C32| / max|C32| within 1e-2 (the
 *     bf16 rounding of the inputs, ~2^-9 relative per operand); control: k pairs off by one.
 *  3. bit for bit where the arithmetic is identical: the fallback in VDPBF16PS order (odd product
 *     of a pair first) = AVX512-BF16; the fallback in TDPBF16PS's measured order (blocks of 16
 *     pairs, even and odd partial sums; src/blas/matmul_bf16.c) = the AMX emulator; real AMX =
 *     the emulator. The paths share the slice structure (each KC slice accumulated from zero in
 *     fp32, then added to C), so per element the same fp32 additions happen in the same order. Not bitwise: AVX512-BF16 vs AMX (the pair's order differs).
 *     Controls: the fallback in the other order must differ from the path in >= 1 element.
 * Shapes: ragged m, n, k (not multiples of 14, 16 or 32), k odd, k crossing the slice (512 deep;
 * AMX 2048), n crossing the B panel (1024 columns; AMX 256), m crossing the row pass (4480; AMX
 * 2048); every ACC / A^T / B^T combination; A and B stored as bf16;
 * 1 and 2 threads; row padding of C must stay untouched; every other call packs into a caller
 * workspace of gdn_matmul_bf16_ws_bytes (misaligned), which must not be overrun. */
#include "harness.h"
#include "kernel_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define REF_TOL 1e-5
#define F32_TOL 1e-2
#define PAD_SENTINEL 1234.5f

static uint16_t rne(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static float bf(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

typedef struct {
    int flags;
    int64_t m, n, kk, lda, ldb, ldc;
    float *A, *B, *C0;       /* fp32 operands (unrounded), C's initial values */
    uint16_t *Ah, *Bh;       /* bf16 copies (A_BF16 / B_BF16) */
    double *ref, *mag;       /* double product of the rounded operands, sum of |terms| */
    float *C32;              /* fp32 gdn_matmul on the unrounded operands */
} bprob;

static void bprob_make(bprob *P, int flags, int64_t m, int64_t n, int64_t kk) {
    memset(P, 0, sizeof *P);
    const int at = (flags & GDN_GEMM_A_TRANS) != 0, bt = (flags & GDN_GEMM_B_TRANS) != 0;
    P->flags = flags, P->m = m, P->n = n, P->kk = kk;
    P->lda = at ? m + 3 : kk + 3, P->ldb = bt ? kk + 5 : n + 5, P->ldc = n + 2;
    const int64_t na = (at ? kk : m) * P->lda, nb = (bt ? n : kk) * P->ldb;
    P->A = malloc(sizeof(float) * na), P->B = malloc(sizeof(float) * nb);
    P->Ah = malloc(2 * na), P->Bh = malloc(2 * nb);
    P->C0 = malloc(sizeof(float) * m * P->ldc), P->C32 = malloc(sizeof(float) * m * P->ldc);
    P->ref = malloc(sizeof(double) * m * n), P->mag = malloc(sizeof(double) * m * n);
    rng_seed((uint64_t)(flags * 7919 + m * 131 + n * 17 + kk));
    for (int64_t i = 0; i < na; i++) P->A[i] = (float)rng_uniform(-1, 1), P->Ah[i] = rne(P->A[i]);
    for (int64_t i = 0; i < nb; i++) P->B[i] = (float)rng_uniform(-1, 1), P->Bh[i] = rne(P->B[i]);
    /* a triangular op(A) (the small GEMM's A_LOWER / A_UPPER): zeros where the flag says */
    if (flags & (GDN_GEMM_A_LOWER | GDN_GEMM_A_UPPER))
        for (int64_t i = 0; i < m; i++)
            for (int64_t p = 0; p < kk; p++)
                if ((flags & GDN_GEMM_A_LOWER) ? p > i : p < i) {
                    const int64_t e = at ? p * P->lda + i : i * P->lda + p;
                    P->A[e] = 0.0f, P->Ah[e] = 0;
                }
    /* a stored-bf16 operand: its fp32 copy holds the same values (so fp32 sees them too) */
    if (flags & GDN_GEMM_A_BF16)
        for (int64_t i = 0; i < na; i++) P->A[i] = bf(P->Ah[i]);
    if (flags & GDN_GEMM_B_BF16)
        for (int64_t i = 0; i < nb; i++) P->B[i] = bf(P->Bh[i]);
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < P->ldc; j++) P->C0[i * P->ldc + j] = j < n ? (float)rng_uniform(-1, 1) : PAD_SENTINEL;
    const int acc = (flags & GDN_GEMM_ACC) != 0;
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            double r = acc ? P->C0[i * P->ldc + j] : 0.0, g = fabs(r);
            for (int64_t p = 0; p < kk; p++) {
                const double t = (double)bf(at ? P->Ah[p * P->lda + i] : P->Ah[i * P->lda + p]) *
                                 bf(bt ? P->Bh[j * P->ldb + p] : P->Bh[p * P->ldb + j]);
                r += t, g += fabs(t);
            }
            P->ref[i * n + j] = r, P->mag[i * n + j] = g;
        }
    memcpy(P->C32, P->C0, sizeof(float) * m * P->ldc);
    const size_t bytes = (gdn_matmul_ws_floats(2) * sizeof(float) + 63) / 64 * 64;
    float *ws = aligned_alloc(64, bytes);
    gdn_matmul(flags & (GDN_GEMM_ACC | GDN_GEMM_A_TRANS | GDN_GEMM_B_TRANS), m, n, kk, P->A, P->lda, P->B, P->ldb,
               P->C32, P->ldc, ws, 2);
    free(ws);
}
static void bprob_free(bprob *P) {
    free(P->A), free(P->B), free(P->Ah), free(P->Bh), free(P->C0), free(P->C32), free(P->ref), free(P->mag);
}

/* the C entries a check compares: all, or (C_LOWER) the lower triangle with the diagonal */
static int wanted(const bprob *P, int64_t i, int64_t j) { return !(P->flags & GDN_GEMM_C_LOWER) || j <= i; }

static int small; /* run the one-thread small GEMM (gdn_gemm_bf16) instead of gdn_matmul_bf16 */
static int ws_short; /* control: the guard placed 64 bytes before the end of the workspace asked for */
/* C from one path (fault: a SITE_BF16_* control, or NULL; even: the fallback's order,
 * SITE_BF16_AMX_ORDER). Caller frees. */
static float *run(const bprob *P, int path, int threads, const char *fault, int even) {
    float *C = malloc(sizeof(float) * P->m * P->ldc);
    memcpy(C, P->C0, sizeof(float) * P->m * P->ldc);
    /* every other call with a caller workspace, misaligned by 3 bytes, guarded past its end */
    static int calls;
    const int own = small || ws_short || calls++ % 2;
    const size_t wsb = (small ? gdn_gemm_bf16_ws_bytes(path, (int)P->m, (int)P->n, (int)P->kk)
                              : gdn_matmul_bf16_ws_bytes(path, P->m, P->n, P->kk)) - (ws_short ? 64 : 0);
    unsigned char *wbuf = own ? malloc(wsb + 3 + 64) : NULL;
    if (wbuf) memset(wbuf, 0xA5, wsb + 3 + 64);
    char sites[128];
    snprintf(sites, sizeof sites, "%s,%s", fault ? fault : "", even ? SITE_BF16_AMX_ORDER : "");
    test_mutation = sites;
    const int ran = small ? gdn_gemm_bf16(path, P->flags, (int)P->m, (int)P->n, (int)P->kk, P->A, (int)P->lda, P->B,
                                          (int)P->ldb, C, (int)P->ldc, wbuf + 3)
                          : gdn_matmul_bf16(path, P->flags, P->m, P->n, P->kk,
                                    (P->flags & GDN_GEMM_A_BF16) ? (const void *)P->Ah : P->A, P->lda,
                                    (P->flags & GDN_GEMM_B_BF16) ? (const void *)P->Bh : P->B, P->ldb, C, P->ldc,
                                    wbuf ? wbuf + 3 : NULL, threads);
    test_mutation = NULL;
    if (ran != path) C[0] = NAN; /* not the path asked for: fail every check */
    for (size_t i = 0; wbuf && i < 64; i++)
        if (wbuf[wsb + 3 + i] != 0xA5) C[0] = NAN; /* wrote past the workspace it asked for */
    free(wbuf);
    return C;
}

static double err_ref(const bprob *P, const float *C) {
    double worst = 0;
    for (int64_t i = 0; i < P->m; i++) {
        for (int64_t j = P->n; j < P->ldc; j++)
            if (C[i * P->ldc + j] != PAD_SENTINEL) return INFINITY;
        for (int64_t j = 0; j < P->n; j++) {
            if (!wanted(P, i, j)) continue;
            const double g = P->mag[i * P->n + j];
            const double e = fabs(C[i * P->ldc + j] - P->ref[i * P->n + j]) / (g > 0 ? g : 1.0);
            worst = e <= worst ? worst : isnan(e) ? INFINITY : e;
        }
    }
    return worst;
}
static double err_f32(const bprob *P, const float *C) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < P->m; i++)
        for (int64_t j = 0; j < P->n; j++) {
            if (!wanted(P, i, j)) continue;
            const double d = fabs((double)C[i * P->ldc + j] - P->C32[i * P->ldc + j]);
            num = d <= num ? num : isnan(d) ? INFINITY : d;
            den = fmax(den, fabs(P->C32[i * P->ldc + j]));
        }
    return den > 0 ? num / den : num;
}
/* elements whose bits differ (C's whole rows, padding included) */
static int64_t bits_differ(const bprob *P, const float *X, const float *Y) {
    int64_t d = 0;
    for (int64_t i = 0; i < P->m * P->ldc; i++)
        if (i % P->ldc >= P->n || wanted(P, i / P->ldc, i % P->ldc)) d += memcmp(X + i, Y + i, sizeof(float)) != 0;
    return d;
}

static const char *fname(int flags) {
    static char buf[64];
    snprintf(buf, sizeof buf, "%s%s%s%s%s%s%s%s%s", small ? "small " : "", (flags & GDN_GEMM_ACC) ? "acc " : "",
             (flags & GDN_GEMM_A_TRANS) ? "A^T " : "", (flags & GDN_GEMM_B_TRANS) ? "B^T " : "",
             (flags & GDN_GEMM_A_BF16) ? "Abf16 " : "", (flags & GDN_GEMM_B_BF16) ? "Bbf16 " : "",
             (flags & GDN_GEMM_A_LOWER) ? "Alower " : "", (flags & GDN_GEMM_A_UPPER) ? "Aupper " : "",
             (flags & GDN_GEMM_C_LOWER) ? "Clower " : "");
    if (!flags) snprintf(buf, sizeof buf, "%splain ", small ? "small " : "");
    return buf;
}

static const char *PNAME[6] = {"auto", "fallback", "AVX512-BF16", "AMX", "AMX-emulated", "FMA"};
static int have[6];
enum { NPATH = 5 }; /* paths 1..NPATH */

/* One bprob through every path that runs here, checks 1-3. */
static void one(int flags, int64_t m, int64_t n, int64_t kk, int threads) {
    bprob P;
    bprob_make(&P, flags, m, n, kk);
    float *C[6] = {0};
    for (int p = 1; p <= NPATH; p++) {
        if (!have[p]) continue;
        C[p] = run(&P, p, threads, 0, 0);
        expect_close(err_ref(&P, C[p]), REF_TOL, "bf16 %-12s %-20s m=%-3ld n=%-3ld k=%-4ld thr=%d vs double(bf16 operands)",
                     PNAME[p], fname(flags), (long)m, (long)n, (long)kk, threads);
        expect_close(err_f32(&P, C[p]), F32_TOL, "bf16 %-12s %-20s m=%-3ld n=%-3ld k=%-4ld thr=%d vs fp32 gdn_matmul",
                     PNAME[p], fname(flags), (long)m, (long)n, (long)kk, threads);
    }
    float *even = run(&P, GDN_BF16_FALLBACK, threads, 0, 1);
    expect_close(err_ref(&P, even), REF_TOL, "bf16 fallback(AMX order) %-20s m=%ld n=%ld k=%ld vs double", fname(flags),
                 (long)m, (long)n, (long)kk);
    if (C[2])
        check(bits_differ(&P, C[1], C[2]) == 0, "bf16 AVX512-BF16 == fallback(VDPBF16PS order) bit for bit, %s m=%ld n=%ld k=%ld",
              fname(flags), (long)m, (long)n, (long)kk);
    check(bits_differ(&P, even, C[4]) == 0, "bf16 AMX-emulated == fallback(AMX order) bit for bit, %s m=%ld n=%ld k=%ld",
          fname(flags), (long)m, (long)n, (long)kk);
    if (C[3])
        check(bits_differ(&P, C[3], C[4]) == 0, "bf16 AMX == AMX-emulated bit for bit, %s m=%ld n=%ld k=%ld", fname(flags),
              (long)m, (long)n, (long)kk);
    for (int p = 0; p < 6; p++) free(C[p]);
    free(even);
    bprob_free(&P);
}

/* Few row blocks against many columns: each thread owns a range of the micro-panels over the
 * whole width, packed a part of the B panel at a time (n = 2600: several parts, the last one
 * micro-panel narrow; depth past one slice). Through every path here, 3 threads (uneven ranges)
 * give 1 thread's bits; control: the same check against a product with B perturbed fails. */
static void column_owned(void) {
    bprob P;
    bprob_make(&P, GDN_GEMM_B_TRANS, 150, 2600, 1100);
    one(GDN_GEMM_B_TRANS, 150, 2600, 1100, 3);
    const int64_t at = 7 * P.ldb + 5;
    const float b_at = P.B[at];
    for (int p = 1; p <= NPATH; p++) {
        if (!have[p]) continue;
        float *C1 = run(&P, p, 1, 0, 0), *C3 = run(&P, p, 3, 0, 0);
        check(bits_differ(&P, C1, C3) == 0, "bf16 %s column-owned B^T m=150 n=2600 k=1100: 3 threads == 1 thread bit for bit",
              PNAME[p]);
        free(C3);
        P.B[at] = b_at + 1.0f;
        C3 = run(&P, p, 3, 0, 0);
        check(bits_differ(&P, C1, C3) != 0, "negative control: bf16 %s column-owned with one B element changed differs",
              PNAME[p]);
        P.B[at] = b_at;
        free(C1), free(C3);
    }
    bprob_free(&P);
}

/* The negative controls, on a bprob large enough that each must show. */
static void controls(void) {
    bprob P;
    const int flags = GDN_GEMM_ACC | GDN_GEMM_B_TRANS;
    bprob_make(&P, flags, 45, 70, 601);
    for (int p = 1; p <= NPATH; p++) {
        if (!have[p]) continue;
        float *t = run(&P, p, 2, SITE_BF16_TRUNCATE, 0);
        expect_far(err_ref(&P, t), REF_TOL, "bf16 %-12s control: operands truncated, not rounded (vs double)", PNAME[p]);
        if (p == GDN_BF16_FMA) { /* no k pairs on the fp32 micro-kernel */
            free(t);
            continue;
        }
        float *s = run(&P, p, 1, SITE_BF16_PAIR_SHIFT, 0);
        expect_far(err_ref(&P, s), REF_TOL, "bf16 %-12s control: B's k pairs off by one (vs double)", PNAME[p]);
        expect_far(err_f32(&P, s), F32_TOL, "bf16 %-12s control: B's k pairs off by one (vs fp32)", PNAME[p]);
        if (p >= 3) {
            float *k = run(&P, p, 2, SITE_BF16_SKIP_KBLOCK, 0);
            expect_far(err_ref(&P, k), REF_TOL, "bf16 %-12s control: last 32-deep tile block of each slice skipped",
                       PNAME[p]);
            free(k);
        }
        free(t), free(s);
    }
    /* the workspace guard sees a write into the last 64 bytes asked for */
    ws_short = 1;
    for (int p = 1; p <= NPATH; p++) {
        /* (the FMA path's large GEMM takes no caller workspace: gdn_matmul's depends on the threads) */
        if (!have[p] || (p == GDN_BF16_FMA && !small)) continue;
        float *w = run(&P, p, 2, 0, 0);
        expect_far(err_ref(&P, w), REF_TOL, "bf16 %-12s control: workspace guard 64 bytes early (must be hit)", PNAME[p]);
        free(w);
    }
    ws_short = 0;
    /* the bitwise checks see the order of a pair's two additions */
    float *odd = run(&P, GDN_BF16_FALLBACK, 2, 0, 0), *even = run(&P, GDN_BF16_FALLBACK, 2, 0, 1);
    float *emu = run(&P, GDN_BF16_AMX_EMU, 2, 0, 0);
    const int64_t d1 = bits_differ(&P, odd, emu);
    expect_far((double)d1, 0.5, "bf16 control: AMX-emulated vs fallback(VDPBF16PS order) differ bitwise (%ld elements)", (long)d1);
    if (have[2]) {
        float *v = run(&P, GDN_BF16_AVX512, 2, 0, 0);
        const int64_t d2 = bits_differ(&P, even, v);
        expect_far((double)d2, 0.5, "bf16 control: AVX512-BF16 vs fallback(AMX order) differ bitwise (%ld elements)",
                   (long)d2);
        free(v);
    } else {
        printf("NOT RUN  bf16 control: AVX512-BF16 vs fallback(AMX order) (no AVX512-BF16 here)\n");
    }
    free(odd), free(even), free(emu);
    bprob_free(&P);
}

/* Rounding, exactly: C = A I (and C = I B^T) is bf16(A) (bf16(B)) bit for bit on every path, the
 * products by 1 and 0 and the sums with zeros being exact; A's values include ties (low half
 * 0x8000, upper half even and odd), 0x7fff and 0x8001 below/above them, signs, exponents
 * 2^-27..2^23. Measure: the number of elements whose bits differ from this file's own
 * round-to-nearest-even; control: the truncating fault. kk = 77: vector steps and the tail. */
static int64_t rounding_mismatches(int path, int b_side, const char *fault) {
    enum { R = 19, KK = 77 };
    float X[R * KK], I[KK * KK], C[R * KK > KK * R ? R * KK : KK * R];
    rng_seed(4242);
    static const uint32_t lows[4] = {0x8000u, 0x7fffu, 0x8001u, 0u};
    for (int i = 0; i < R * KK; i++) {
        const uint32_t e = 100 + (uint32_t)rng_uniform(0, 50), mant = (uint32_t)rng_uniform(0, 128);
        const uint32_t sign = rng_uniform(0, 1) < 0.5 ? 0x80000000u : 0u;
        const uint32_t low = i % 5 < 4 ? lows[i % 4] : (uint32_t)rng_uniform(0, 65536);
        const uint32_t u = sign | e << 23 | mant << 16 | low;
        memcpy(X + i, &u, sizeof u);
    }
    for (int i = 0; i < KK * KK; i++) I[i] = i / KK == i % KK ? 1.0f : 0.0f;
    test_mutation = fault;
    if (!b_side) /* C [R x KK] = X [R x KK] I */
        gdn_matmul_bf16(path, 0, R, KK, KK, X, KK, I, KK, C, KK, NULL, 1 + (path % 2));
    else /* C [KK x R] = I X^T: C[i][j] = X[j][i] (B = X^T, X stored as W [R x KK]) */
        gdn_matmul_bf16(path, GDN_GEMM_B_TRANS, KK, R, KK, I, KK, X, KK, C, R, NULL, 1 + (path % 2));
    test_mutation = NULL;
    int64_t bad = 0;
    for (int i = 0; i < R; i++)
        for (int p = 0; p < KK; p++) {
            const float want = bf(rne(X[i * KK + p])), got = b_side ? C[p * R + i] : C[i * KK + p];
            bad += memcmp(&want, &got, sizeof want) != 0;
        }
    return bad;
}

static void rounding(void) {
    for (int p = 1; p <= NPATH; p++) {
        if (!have[p]) continue;
        for (int side = 0; side <= 1; side++) {
            const int64_t ok = rounding_mismatches(p, side, NULL), bad = rounding_mismatches(p, side, SITE_BF16_TRUNCATE);
            expect_close((double)ok, 0.0, "bf16 %-12s %s rounded to nearest even, bit for bit (ties, 0x7fff, 0x8001): %ld differ",
                         PNAME[p], side ? "B (W, k contiguous)" : "A (rows)", (long)ok);
            expect_far((double)bad, 0.5, "bf16 %-12s %s control: truncated instead (%ld elements differ)", PNAME[p],
                       side ? "B" : "A", (long)bad);
        }
    }
}

/* gdn_bench_bf16 (bench.h) against the pieces it replaces (the CPU's path, each path's
 * availability and name; the peak only when threads >= 1) and its refusals. */
static void bench_bf16_info(void) {
    gdn_bf16_path_info info;
    int bad = 0;
    for (int p = 0; p <= NPATH; p++) {
        const int want = p ? p : gdn_bf16_path_auto();
        bad += gdn_bench_bf16(p, 0, &info) != GDN_OK;
        bad += info.path != want || info.available != gdn_bf16_path_available(want) ||
               !info.name || strcmp(info.name, gdn_bf16_path_name(want)) != 0 || info.peak_gflops != 0.0;
    }
    expect_close((double)bad, 0.0, "gdn_bench_bf16(0..5, threads 0): the CPU's path, availability and name as the pieces, no peak (%d differ)", bad);
    /* every automatic path has an instruction: VDPBF16PS, TDPBF16PS, or the FMA path's fp32 FMA */
    const int have_peak = gdn_bf16_path_auto() != GDN_BF16_FALLBACK && gdn_bf16_path_auto() != GDN_BF16_AMX_EMU;
    expect_close(gdn_bench_bf16(GDN_BF16_FALLBACK, 1, &info) == GDN_OK && info.peak_gflops == 0.0 ? 0 : 1, 0,
                 "gdn_bench_bf16(fallback, 1 thread): no instruction peak (0)");
    expect_close(gdn_bench_bf16(0, 1, &info) == GDN_OK && (info.peak_gflops > 0) == have_peak ? 0 : 1, 0,
                 "gdn_bench_bf16(0, 1 thread): a measured peak exactly when the path has an instruction (%g)", info.peak_gflops);
    info.path = 7;
    expect_status(gdn_bench_bf16(6, 0, &info), GDN_ERR_ARG, "path 6", "gdn_bench_bf16: path past the end refused");
    expect_close(info.path == 0 && info.name == NULL ? 0 : 1, 0, "gdn_bench_bf16: a refused call leaves info zeroed");
    expect_status(gdn_bench_bf16(-1, 0, &info), GDN_ERR_ARG, "path -1", "gdn_bench_bf16: a negative path refused");
    expect_status(gdn_bench_bf16(0, 0, NULL), GDN_ERR_ARG, "info is NULL", "gdn_bench_bf16: a NULL info refused");
}

/* GDNCP_ISA's cap as the dispatch sees it (gdncp/isa.h): the levels agree (dispatched = the CPU's,
 * capped; never below the build's), and the BF16 paths available and chosen are within the
 * dispatched level: no AVX512-BF16 below avx512bf16, no AMX below amx. Control (where the cap is
 * below the CPU: CI's portable run at GDNCP_ISA=avx2 on an AVX-512 machine): the cap ignored
 * ("isa: the GDNCP_ISA cap ignored") must break that check. The refusals of bad values:
 * scripts/test_cli.sh (the cap is read once per process). */
static int paths_within(const gdn_isa_info *in) {
    const int lv = gdn_isa_dispatched(), a = gdn_bf16_path_auto();
    return lv == in->dispatched && gdn_bf16_path_available(GDN_BF16_AVX512) == (lv >= GDN_ISA_AVX512BF16) &&
           gdn_bf16_path_available(GDN_BF16_AMX) <= (lv >= GDN_ISA_AMX) &&
           (a != GDN_BF16_AVX512 || lv >= GDN_ISA_AVX512BF16) && (a != GDN_BF16_AMX || lv >= GDN_ISA_AMX);
}
static void isa_cap(void) {
    gdn_isa_info in;
    const int rc = gdn_isa(&in);
    check(rc == GDN_OK, "gdn_isa: this run's GDNCP_ISA accepted (%s)", rc ? gdn_errmsg() : "ok");
    const int want = in.cap >= 0 ? in.cap : in.cpu;
    check(in.dispatched == want && in.compiled <= in.dispatched && in.dispatched <= in.cpu,
          "gdn_isa: cpu %s, compiled %s, cap %s: dispatched %s = the CPU's capped, not below the build's",
          gdn_isa_name(in.cpu), gdn_isa_name(in.compiled), in.cap >= 0 ? gdn_isa_name(in.cap) : "unset",
          gdn_isa_name(in.dispatched));
    check(gdn_isa_name(GDN_ISA_AVX2) && !strcmp(gdn_isa_name(GDN_ISA_AVX512BF16), "avx512bf16") && !gdn_isa_name(5) &&
              !gdn_isa_name(-1),
          "gdn_isa_name: GDNCP_ISA's names, NULL outside the levels");
    expect_status(gdn_isa(NULL), GDN_ERR_ARG, "NULL", "gdn_isa: a NULL info refused");
    check(paths_within(&in), "isa: the BF16 paths available and chosen (%s) are within the dispatched level %s",
          gdn_bf16_path_name(gdn_bf16_path_auto()), gdn_isa_name(in.dispatched));
    if (in.cap >= 0 && in.cap < in.cpu) {
        test_mutation = "isa: the GDNCP_ISA cap ignored";
        const int within = paths_within(&in);
        test_mutation = NULL;
        check(!within, "negative control: the cap %s ignored (the CPU's %s dispatched) breaks the level check",
              gdn_isa_name(in.cap), gdn_isa_name(in.cpu));
    } else if (!tests_quiet) {
        printf("NOT RUN  isa control: the cap ignored (GDNCP_ISA %s the CPU's level: nothing to ignore)\n",
               in.cap >= 0 ? "equals" : "unset, at");
    }
}

void test_matmul_bf16(void) {
    isa_cap();
    for (int p = 1; p <= NPATH; p++) have[p] = gdn_bf16_path_available(p);
    bench_bf16_info();
    if (!tests_quiet) {
        printf("bf16 paths here (auto: %s):\n", gdn_bf16_path_name(gdn_bf16_path_auto()));
        for (int p = 1; p <= NPATH; p++)
            printf("  %-12s %s%s\n", PNAME[p], have[p] ? "RUN" : "NOT RUN",
                   have[p] ? "" : p == 2 ? " (CPUID: no AVX512-BF16, or the OS does not enable zmm state)"
                                         : " (CPUID: no AMX-TILE/AMX-BF16, XCR0 lacks tile state, or Linux refused "
                                           "ARCH_REQ_XCOMP_PERM): its bitwise check vs the emulator did not run");
    }
    const int64_t sizes[][3] = {{1, 1, 1},    {7, 17, 33},   {33, 100, 17}, {45, 70, 1},  {100, 33, 63},
                                {61, 95, 531}, {20, 530, 45}, {37, 40, 1100}, {3, 33, 2},
                                {35, 40, 2100}}; /* depth past AMX's 2048-deep slice */
    static const int FL[8] = {0, GDN_GEMM_ACC, GDN_GEMM_A_TRANS, GDN_GEMM_B_TRANS, GDN_GEMM_ACC | GDN_GEMM_A_TRANS,
                              GDN_GEMM_ACC | GDN_GEMM_B_TRANS, GDN_GEMM_A_TRANS | GDN_GEMM_B_TRANS,
                              GDN_GEMM_ACC | GDN_GEMM_A_TRANS | GDN_GEMM_B_TRANS};
    const int ns = (int)(sizeof sizes / sizeof sizes[0]);
    for (int s = 0; s < ns; s++)
        for (int f = 0; f < 8; f++)
            if ((s + f) % 3 == 0 || s == 5) /* every flag set on the slice-crossing shape, a third elsewhere */
                one(FL[f], sizes[s][0], sizes[s][1], sizes[s][2], 1 + (s + f) % 2);
    /* operands stored as bf16 (the layer's weights; activations kept in bf16 later) */
    one(GDN_GEMM_B_TRANS | GDN_GEMM_B_BF16, 61, 95, 531, 2);
    one(GDN_GEMM_A_BF16 | GDN_GEMM_ACC, 37, 40, 99, 1);
    one(GDN_GEMM_A_TRANS | GDN_GEMM_A_BF16 | GDN_GEMM_B_BF16, 100, 33, 63, 2);
    /* more rows than one pass (4480; AMX 2048): the row blocks' offsets into A, A^T and C */
    one(GDN_GEMM_ACC, 4500, 37, 40, 2);
    one(GDN_GEMM_A_TRANS | GDN_GEMM_A_BF16 | GDN_GEMM_B_TRANS, 4500, 37, 40, 2);
    column_owned();
    rounding();
    controls();
    /* the one-thread small GEMM of the chunk kernel (gdn_gemm_bf16): the same checks and
     * controls, with its triangular flags, at the kernel's shapes and ragged ones */
    small = 1;
    const int64_t ssizes[][3] = {{64, 64, 128}, {128, 128, 64}, {64, 128, 64}, {45, 70, 33}, {7, 17, 1}, {100, 33, 63}};
    static const int SF[] = {0, GDN_GEMM_ACC, GDN_GEMM_A_LOWER, GDN_GEMM_ACC | GDN_GEMM_A_LOWER, GDN_GEMM_C_LOWER,
                             GDN_GEMM_A_UPPER | GDN_GEMM_A_TRANS, GDN_GEMM_ACC | GDN_GEMM_B_TRANS,
                             GDN_GEMM_C_LOWER | GDN_GEMM_B_TRANS, GDN_GEMM_ACC | GDN_GEMM_A_TRANS | GDN_GEMM_A_UPPER};
    for (int s = 0; s < (int)(sizeof ssizes / sizeof ssizes[0]); s++)
        for (int f = 0; f < (int)(sizeof SF / sizeof SF[0]); f++)
            if ((SF[f] & (GDN_GEMM_A_LOWER | GDN_GEMM_A_UPPER)) == 0 || ssizes[s][0] == ssizes[s][2] || s >= 3)
                one(SF[f], ssizes[s][0], ssizes[s][1], ssizes[s][2], 1);
    controls();
    small = 0;
}
