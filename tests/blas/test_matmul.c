/* The large GEMM (gdn_matmul, src/blas/matmul.c) against a double-precision triple loop: every
 * flag combination (ACC, A_TRANS, B_TRANS), odd sizes and sizes crossing the block sizes (KC 256,
 * MC 168 rows, NR 32 / 16 columns, NC 1024 columns), padded strides, the streaming path
 * (m <= 16 with B transposed), 1 and 2 threads, kk = 0.
 *
 * Error measure: per element, |C - ref| / sum_p |op(A)_ip op(B)_pj| (+ |C_in| with ACC), i.e.
 * relative to the sum of the absolute terms, which is what fp32 rounding of a dot product is
 * bounded by (cancellation or not): worst case about kk * 2^-24 (3.6e-5 at kk = 600), in practice
 * ~sqrt(kk) * 2^-24 (observed below 1e-6). Tolerance 1e-5; a wrong operand (B shifted by one
 * element) gives errors of order 1e-1 through the same measure. The padding past each row of C
 * must be left untouched. A NaN or Inf in C counts as an infinite error.
 *
 * GDN_GEMM_B_BF16 (B^T only): B is random bfloat16 (fp32 rounded to nearest even, stored as the
 * upper 16 bits); the reference uses those bf16 values converted exactly to double, so the
 * same measure and tolerance apply (the only rounding is fp32's, of the products and sums, as
 * with fp32 B). Negative controls: the bf16 array shifted by one element, and the fp32 array
 * passed in place of the bf16 one. */
#include "harness.h"
#include "kernel_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MM_TOL 1e-5
#define PAD_SENTINEL 1234.5f

static float *ws_alloc(int threads) {
    const size_t bytes = (gdn_matmul_ws_floats(threads) * sizeof(float) + 63) / 64 * 64;
    return aligned_alloc(64, bytes);
}

static uint16_t bf16_rne(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); /* finite inputs only */
}
static float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* Worst per-element error of gdn_matmul (with `threads`) vs the double product. corrupt = 1
 * shifts B by one element, corrupt = 2 (bf16 only) passes the fp32 array as the bf16 one
 * (negative controls). Returns +Inf if C's row padding was written. */
static double mm_err(int flags, int64_t m, int64_t n, int64_t kk, int threads, int corrupt) {
    const int at = (flags & GDN_GEMM_A_TRANS) != 0, bt = (flags & GDN_GEMM_B_TRANS) != 0,
              acc = (flags & GDN_GEMM_ACC) != 0;
    const int64_t lda = at ? m + 3 : kk + 3, ldb = bt ? kk + 5 : n + 5, ldc = n + 2;
    const int64_t arows = at ? kk : m, brows = bt ? n : kk;
    float *A = malloc(sizeof(float) * (size_t)(arows * lda + 1));
    float *B = malloc(sizeof(float) * (size_t)(brows * ldb + 1));
    float *C = malloc(sizeof(float) * (size_t)(m * ldc)), *C0 = malloc(sizeof(float) * (size_t)(m * ldc));
    rng_seed((uint64_t)(flags * 7919 + m * 131 + n * 17 + kk));
    for (int64_t i = 0; i < arows * lda + 1; i++) A[i] = (float)rng_uniform(-1, 1);
    for (int64_t i = 0; i < brows * ldb + 1; i++) B[i] = (float)rng_uniform(-1, 1);
    uint16_t *Bh = NULL; /* bf16 B; B then holds its exact fp32 values for the reference */
    if (flags & GDN_GEMM_B_BF16) {
        Bh = malloc(sizeof(uint16_t) * (size_t)(brows * ldb + 1));
        for (int64_t i = 0; i < brows * ldb + 1; i++) {
            Bh[i] = bf16_rne(B[i]);
            if (corrupt != 2) B[i] = bf16_to_f32(Bh[i]);
        }
    }
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < ldc; j++) C[i * ldc + j] = j < n ? (float)rng_uniform(-1, 1) : PAD_SENTINEL;
    memcpy(C0, C, sizeof(float) * (size_t)(m * ldc));
    float *ws = ws_alloc(threads);
    if (Bh)
        gdn_matmul(flags, m, n, kk, A, lda, corrupt == 2 ? (const void *)B : (const void *)(Bh + corrupt),
                   ldb, C, ldc, ws, threads);
    else
        gdn_matmul(flags, m, n, kk, A, lda, B + corrupt, ldb, C, ldc, ws, threads);
    double worst = 0.0;
    for (int64_t i = 0; i < m; i++) {
        for (int64_t j = n; j < ldc; j++)
            if (C[i * ldc + j] != PAD_SENTINEL) worst = INFINITY;
        for (int64_t j = 0; j < n; j++) {
            double ref = acc ? C0[i * ldc + j] : 0.0, mag = fabs(ref);
            for (int64_t p = 0; p < kk; p++) {
                const double t = (double)(at ? A[p * lda + i] : A[i * lda + p]) *
                                 (bt ? B[j * ldb + p] : B[p * ldb + j]);
                ref += t, mag += fabs(t);
            }
            const double e = fabs(C[i * ldc + j] - ref) / (mag > 0 ? mag : 1.0);
            worst = e <= worst ? worst : isnan(e) ? INFINITY : e; /* (fmax would drop a NaN) */
        }
    }
    free(A), free(B), free(Bh), free(C), free(C0), free(ws);
    return worst;
}

static const char *flag_name(int flags) {
    static char buf[64];
    snprintf(buf, sizeof buf, "%s%s%s%s", (flags & GDN_GEMM_ACC) ? "acc " : "",
             (flags & GDN_GEMM_A_TRANS) ? "A^T " : "", (flags & GDN_GEMM_B_TRANS) ? "B^T" : "",
             (flags & GDN_GEMM_B_BF16) ? " bf16" : "");
    if (!flags) snprintf(buf, sizeof buf, "plain");
    return buf;
}

static const int FLAG_SET[8] = {0, GDN_GEMM_ACC, GDN_GEMM_A_TRANS, GDN_GEMM_B_TRANS,
                                GDN_GEMM_ACC | GDN_GEMM_A_TRANS, GDN_GEMM_ACC | GDN_GEMM_B_TRANS,
                                GDN_GEMM_A_TRANS | GDN_GEMM_B_TRANS,
                                GDN_GEMM_ACC | GDN_GEMM_A_TRANS | GDN_GEMM_B_TRANS};

/* The blocked path: odd sizes and sizes just past the block sizes. */
static void blocked(void) {
    const int64_t sizes[][3] = {
        {17, 1, 1},     {1, 1, 1},     {7, 17, 33},    {33, 100, 17},  {100, 33, 257},
        {257, 65, 7},   {170, 31, 300}, {29, 513, 19}, {337, 40, 100}, {20, 4100, 9},
    };
    for (int fi = 0; fi < 8; fi++)
        for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
            for (int th = 1; th <= 2; th++) {
                const int64_t m = sizes[s][0], n = sizes[s][1], kk = sizes[s][2];
                expect_close(mm_err(FLAG_SET[fi], m, n, kk, th, 0), MM_TOL,
                             "matmul %-11s m=%-3ld n=%-4ld k=%-3ld threads=%d vs double", flag_name(FLAG_SET[fi]),
                             (long)m, (long)n, (long)kk, th);
            }
}

/* Few row blocks against many columns (a shard's rows, the loss head's chunk against the
 * vocabulary): each thread owns a column range of every B panel. n crosses NC with a last
 * panel one micro-panel wide (where the ranges split differently from the panels before it,
 * while another thread may still be on them) and kk crosses KC; 3 threads split unevenly. Each
 * thread count gives the same bits as one thread; control: a product whose depth blocks run in
 * another order off thread 0 (a mutation inside gdn_matmul) does not. */
static void column_owned(void) {
    const int64_t m = 300, n = 2080, kk = 600;
    for (int fi = 0; fi < 8; fi++)
        for (int th = 1; th <= 3; th += 2)
            expect_close(mm_err(FLAG_SET[fi], m, n, kk, th, 0), MM_TOL,
                         "matmul column-owned %-11s m=%ld n=%ld k=%ld threads=%d vs double", flag_name(FLAG_SET[fi]),
                         (long)m, (long)n, (long)kk, th);
    float *A = malloc(sizeof(float) * (size_t)(m * kk)), *B = malloc(sizeof(float) * (size_t)(n * kk));
    float *C[3];
    rng_seed(77);
    for (int64_t i = 0; i < m * kk; i++) A[i] = (float)rng_uniform(-1, 1);
    for (int64_t i = 0; i < n * kk; i++) B[i] = (float)rng_uniform(-1, 1);
    /* 1 thread, 3 threads, and 3 threads whose depth order differs off the first thread (the
     * control: a mutation inside the product, which the bitwise comparison must see) */
    for (int v = 0; v < 3; v++) {
        const int th = v ? 3 : 1;
        float *ws = ws_alloc(th);
        C[v] = malloc(sizeof(float) * (size_t)(m * n));
        test_mutation = v == 2 ? "matmul: column-owned depth blocks reversed off the first thread" : NULL;
        gdn_matmul(GDN_GEMM_B_TRANS, m, n, kk, A, kk, B, kk, C[v], n, ws, th);
        test_mutation = NULL;
        free(ws);
    }
    double differ[2] = {0, 0}; /* elements whose bits differ from 1 thread's */
    for (int v = 1; v < 3; v++)
        for (int64_t i = 0; i < m * n; i++) differ[v - 1] += memcmp(&C[0][i], &C[v][i], sizeof(float)) != 0;
    expect_close(differ[0], 0, "matmul column-owned B^T m=%ld n=%ld k=%ld: elements of 3 threads' not 1 thread's bits",
                 (long)m, (long)n, (long)kk);
    expect_far(differ[1], 0, "matmul column-owned control: depth blocks in another order off thread 0: elements differing");
    free(A), free(B), free(C[0]), free(C[1]), free(C[2]);
}

/* m = 1..16: the streaming path with B^T (kk past its 512-deep blocks, not a multiple of the
 * vector width; n not a multiple of its tiles of 4 W rows, or 8 at m <= 2 with 16 lanes); the
 * blocked path without. */
static void small_m(void) {
    for (int m = 1; m <= 16; m++)
        for (int fi = 0; fi < 8; fi++) {
            const int flags = FLAG_SET[fi];
            const int64_t n = 37, kk = (flags & GDN_GEMM_B_TRANS) ? 541 : 70;
            const int th = 1 + (m + fi) % 2;
            expect_close(mm_err(flags, m, n, kk, th, 0), MM_TOL,
                         "matmul small m %-11s m=%-2d n=%ld k=%ld threads=%d vs double", flag_name(flags), m,
                         (long)n, (long)kk, th);
        }
    expect_close(mm_err(GDN_GEMM_B_TRANS, 16, 3, 9, 2, 0), MM_TOL,
                 "matmul small m B^T m=16 n=3 k=9 (one partial tile, no full vector) threads=2");
    for (int m = 1; m <= 2; m++) /* the wide tiles with no full vector: only the depth's tail */
        expect_close(mm_err(GDN_GEMM_B_TRANS | (m == 2 ? GDN_GEMM_ACC : 0), m, 19, 9, m, 0), MM_TOL,
                     "matmul small m B^T m=%d n=19 k=9 (tiles and a partial one, no full vector) threads=%d", m, m);
    /* A too large for the padded copy in ws (16 x 20016 floats > ws at 1 thread): read in place */
    expect_close(mm_err(GDN_GEMM_B_TRANS | GDN_GEMM_ACC, 16, 5, 20000, 1, 0), MM_TOL,
                 "matmul small m acc B^T m=16 n=5 k=20000 (A not copied) threads=1");
}

/* GDN_GEMM_B_BF16 (with B^T): the streaming path (m = 1..16, n not a multiple of its 4-row
 * tiles, kk past its 512-deep blocks and not a multiple of the vector width, so the scalar tail
 * reads bf16 too), and the blocked path (bf16 converted while packing B; sizes crossing KC,
 * MC, NR, NC; A^T also goes there for small m), ACC on and off, 1 and 2 threads. */
static void bf16_b(void) {
    const int BT = GDN_GEMM_B_TRANS | GDN_GEMM_B_BF16;
    for (int m = 1; m <= 16; m++)
        for (int acc = 0; acc <= 1; acc++) {
            const int flags = BT | (acc ? GDN_GEMM_ACC : 0), th = 1 + (m + acc) % 2;
            expect_close(mm_err(flags, m, 37, 541, th, 0), MM_TOL,
                         "matmul streaming %-13s m=%-2d n=37 k=541 threads=%d vs double", flag_name(flags), m, th);
        }
    expect_close(mm_err(BT, 16, 3, 9, 2, 0), MM_TOL,
                 "matmul streaming B^T bf16 m=16 n=3 k=9 (one partial tile, no full vector) threads=2");
    expect_close(mm_err(BT | GDN_GEMM_ACC, 16, 5, 20000, 1, 0), MM_TOL,
                 "matmul streaming acc B^T bf16 m=16 n=5 k=20000 (A not copied) threads=1");
    const int64_t sizes[][3] = {
        {17, 1, 1}, {7, 17, 33}, {100, 33, 257}, {170, 31, 300}, {29, 513, 19}, {337, 40, 100},
        {20, 1100, 9}, {200, 70, 600},
    };
    for (int fi = 0; fi < 4; fi++)
        for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
            const int flags = BT | (fi & 1 ? GDN_GEMM_ACC : 0) | (fi & 2 ? GDN_GEMM_A_TRANS : 0);
            const int64_t m = sizes[s][0], n = sizes[s][1], kk = sizes[s][2];
            const int th = 1 + (int)((s + (size_t)fi) % 2);
            expect_close(mm_err(flags, m, n, kk, th, 0), MM_TOL,
                         "matmul blocked %-17s m=%-3ld n=%-4ld k=%-3ld threads=%d vs double", flag_name(flags),
                         (long)m, (long)n, (long)kk, th);
        }
    expect_far(mm_err(BT, 4, 37, 541, 2, 1), MM_TOL, "matmul streaming B^T bf16 with B shifted by one element");
    expect_far(mm_err(BT, 4, 37, 541, 1, 2), MM_TOL, "matmul streaming B^T bf16 reading the fp32 array as bf16");
    expect_far(mm_err(BT | GDN_GEMM_ACC, 100, 33, 257, 2, 1), MM_TOL,
               "matmul blocked acc B^T bf16 with B shifted by one element");
    expect_far(mm_err(BT, 170, 31, 300, 1, 2), MM_TOL, "matmul blocked B^T bf16 reading the fp32 array as bf16");
}

/* kk = 0: C = 0 without ACC (exactly), C unchanged with it. */
static void empty_depth(void) {
    for (int fi = 0; fi < 8; fi++) {
        const int flags = FLAG_SET[fi];
        const int64_t m = fi % 2 ? 5 : 40, n = 19, ldc = 21;
        float C[40 * 21], *ws = ws_alloc(2);
        for (int i = 0; i < 40 * 21; i++) C[i] = (float)(i % 7) - 3.0f;
        const float a = 1.0f, b = 1.0f;
        gdn_matmul(flags, m, n, 0, &a, 1, &b, 1, C, ldc, ws, 2);
        int ok = 1;
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < ldc; j++) {
                const float orig = (float)((i * ldc + j) % 7) - 3.0f;
                const float want = (j < n && !(flags & GDN_GEMM_ACC)) ? 0.0f : orig;
                ok &= C[i * ldc + j] == want;
            }
        free(ws);
        check(ok, "matmul k=0 %-11s m=%ld n=%ld: C %s, padding untouched", flag_name(flags), (long)m, (long)n,
              (flags & GDN_GEMM_ACC) ? "unchanged" : "zeroed");
    }
}

/* One A row against a small W whose depth is a multiple of the vector width: W rows a vector's
 * width at a time, their sums straight into C (stream_rows_vl; the rest of n by the tiles),
 * fp32 and bf16 W, with and without ACC, 1 and 2 threads. It must give row 0 of the m = 2
 * product (the tiles and their queue of horizontal sums) bit for bit: a model's decode step is
 * compared with its forward. Control: A's first element 0.1 % larger gives other bits. */
static void one_row(void) {
    const int64_t n = 37, ks[2] = {96, 192};
    for (int fi = 0; fi < 8; fi++) {
        const int flags = GDN_GEMM_B_TRANS | (fi & 1 ? GDN_GEMM_ACC : 0) | (fi & 2 ? GDN_GEMM_B_BF16 : 0);
        const int64_t kk = ks[fi / 4 % 2];
        const int th = 1 + fi / 4;
        expect_close(mm_err(flags, 1, n, kk, th, 0), MM_TOL, "matmul one row %-13s n=%ld k=%ld threads=%d vs double",
                     flag_name(flags), (long)n, (long)kk, th);
        if (fi == 2) expect_far(mm_err(flags, 1, n, kk, th, 1), MM_TOL, "one row, %s, B shifted by one element",
                                flag_name(flags));
        float *A = malloc(sizeof(float) * (size_t)(2 * kk)), *W = malloc(sizeof(float) * (size_t)(n * kk));
        uint16_t *Wh = malloc(sizeof(uint16_t) * (size_t)(n * kk));
        float C1[40], C2[80], *ws = ws_alloc(th);
        rng_seed((uint64_t)(fi + 77));
        for (int64_t i = 0; i < 2 * kk; i++) A[i] = (float)rng_uniform(-1, 1);
        for (int64_t i = 0; i < n * kk; i++) W[i] = (float)rng_uniform(-1, 1), Wh[i] = bf16_rne(W[i]);
        const void *Wv = (flags & GDN_GEMM_B_BF16) ? (const void *)Wh : (const void *)W;
        int differs[2];
        for (int ctl = 0; ctl < 2; ctl++) {
            for (int j = 0; j < 40; j++) C1[j] = C2[j] = (float)j * 0.25f;
            gdn_matmul(flags, 1, n, kk, A, kk, Wv, kk, C1, n, ws, th);
            const float a0 = A[0];
            if (ctl) A[0] = a0 * 1.001f;
            gdn_matmul(flags, 2, n, kk, A, kk, Wv, kk, C2, n, ws, th);
            A[0] = a0;
            differs[ctl] = memcmp(C1, C2, sizeof(float) * (size_t)n) != 0;
        }
        check(!differs[0] && differs[1], "matmul one row %-13s n=%ld k=%ld threads=%d: row 0 of m = 2 bit for bit "
              "(%s); control, A[0] 0.1 %% larger: %s", flag_name(flags), (long)n, (long)kk, th,
              differs[0] ? "differs" : "same", differs[1] ? "differs" : "same");
        free(A), free(W), free(Wh), free(ws);
    }
}

static void negative_controls(void) {
    expect_far(mm_err(0, 100, 33, 257, 2, 1), MM_TOL, "matmul plain with B shifted by one element");
    expect_far(mm_err(GDN_GEMM_B_TRANS, 100, 33, 257, 2, 1), MM_TOL,
               "matmul B^T with B shifted by one element");
    expect_far(mm_err(GDN_GEMM_A_TRANS | GDN_GEMM_ACC, 170, 31, 300, 1, 1), MM_TOL,
               "matmul acc A^T with B shifted by one element");
    expect_far(mm_err(GDN_GEMM_B_TRANS, 4, 37, 541, 2, 1), MM_TOL,
               "matmul small-m B^T (streaming) with B shifted by one element");
}

void test_matmul(void) {
    if (!tests_quiet) printf("matmul path: %s\n", gdn_matmul_path());
    blocked();
    column_owned();
    small_m();
    one_row();
    bf16_b();
    empty_depth();
    negative_controls();
}
