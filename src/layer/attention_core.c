/* The flash-style core of the gated attention layer over a view (attention_internal.h): the
 * queries of one call against one block of keys.
 *
 * Rows. A query block is up to BQ rows: TB tokens x hg query heads of one kv head (hg: the
 * largest divisor of the group size H/Hkv up to 16), so a key tile read from memory serves the
 * whole group. Keys come in tiles of BK, aligned to the view's first key.
 *
 * Transposed scores. Every product runs on the micro-kernel of src/blas (microkernel.h) with the
 * block's rows as the columns of the result: S^T = K Q^T [keys x rows] reads the key tile in
 * place as its A operand and the block's Q^T, gathered (and scaled by d^-1/2) once per block, as
 * its B operand; likewise dP^T = V dO^T; the forward's O^T += V^T P^T and the backward's
 * dQ^T += K^T dS^T read V and K in place and P^T, dS^T (in the tile) as B; dV += P^T dO and
 * dK += dS^T Q read P^T, dS^T in place and the block's dO, Q (gathered row-major once). So no
 * key tile is ever packed or copied, and the softmax runs along rows of S^T: per query row a
 * lane, a running max and sum in vectors (the vector exp of gdn_vexpf_ftz's polynomial).
 *
 * Masks. A tile entirely inside every row's visible range (below the diagonal of the block's
 * first token and at or after the last row's document start) takes a path without masks; the
 * others (the diagonal, a document boundary, the view's edges) mask by vector compares of each
 * row's visible key range.
 *
 * Backward. dS = P (dP - D) from the final log-sum-exp; the five products S, dP, dV, dK, dQ per
 * (block, tile) pair. Fused, one pass: a job is one kv head of one batch row (its query heads,
 * every block, every tile), which alone writes that head's dK, dV and its query heads' dQ; used
 * when those B Hkv jobs keep the threads busy. Otherwise two passes (gdn_attn_core_backward_q over
 * query blocks, _kv over key tiles), which recompute S and dP once more (9 products instead of 7)
 * but spread over every block and tile. Both schedules run the same products on the same operands
 * in the same order, so the result is bitwise the same whichever runs and whatever the thread
 * count; no two threads ever add into one row. A query that sees no key gives 0 (lse = -inf).
 *
 * BF16 (v->bf16, an fp32 view, blocks of more than FEW_ROWS rows). The same tiles, masks,
 * softmax and schedule, with every product on pre-packed bf16 operands (blas.h,
 * gdn_bf16_packed_gemm: AMX tiles, VDPBF16PS or the fallback) accumulated in fp32: the call first
 * packs each key tile of each kv head once as the A operands it needs (K and V^T for the forward;
 * K, V and K^T for the backward's dQ; K and V for its dK, dV), a block packs its scaled Q (and dO)
 * once as B operands (Q^T for the scores, Q for dK; dO^T for dP, dO for dV), and a (block, tile)
 * pair packs P^T (as B for O^T += V^T P^T and as A for dV) and dS^T (as B for dQ, as A for dK).
 * So Q, K, V, dO, P and dS are rounded to bf16 (nearest even); the scores, the running max and
 * sum, alpha, lse, D, O's and the gradients' accumulators stay fp32. P is rounded after it is
 * scaled against the lazy running max (by e^(m_true - m), not a power of two): the BF16 oracle
 * follows the same running max per key tile (attention_reference.c). If the packed keys cannot be
 * allocated, the call runs in fp32. */
#include "attention_internal.h"
#include "pack.h" /* the micro-kernel (microkernel.h) and the in-register transpose */

#include <math.h>
#include <stdio.h>
#include <string.h>

#ifndef BQ
#define BQ 128 /* rows of a query block */
#endif
#define BK GDN_ATTN_KEY_TILE
#ifndef KC
#define KC 256 /* depth of one pass of the score products */
#endif
#ifndef FEW_ROWS
#define FEW_ROWS 8 /* a block of at most this many rows runs by rows (below: "few rows") */
#endif
#if GDN_VL == 16
#define MK_MR 8 /* the rows of gemm.c's tile at this width */
#else
#define MK_MR 6
#endif
#define MK_NV 2
#define MK_NR (MK_NV * GDN_VL)
#define VL GDN_VL

/* Row stride of the row-major gathers: d rounded up to a micro-kernel panel, zero past d. */
static inline int64_t dpad(int64_t d) { return (d + MK_NR - 1) / MK_NR * MK_NR; }

/* ---------------------------------------------------------------- the per-thread tile */

typedef struct {
    float *QtT, *dOtT; /* Q^T, dO^T [d x BQ] (Q scaled by d^-1/2), panel-major (below) */
    float *Qt, *dOt;   /* Q, dO [BQ x dp], zero past d, panel-major */
    float *acc;        /* [d][BQ]: O^T (forward) or dQ^T (backward) */
    float *S, *dP;     /* [BK][BQ]: S^T then P^T; dP^T then dS^T */
    float *m, *l, *lse, *D, *alpha; /* [BQ] */
    int32_t *hi, *lo;  /* [BQ]: each row's visible keys [lo, hi] relative to the tile */
    int64_t *tg, *db;  /* [BQ]: each row's global index and its document's first token */
    int64_t *off, *lix; /* [BQ]: Q/O/dO/dQ offset, lse/D index of each row */
    float *kw, *vw;    /* [BK][d]: a BF16 view's key and value tile widened to fp32 (forward) */
    /* BF16 products: the block's rows of scaled Q and of dO [BQ][d] (zero past R), and packed
     * operands: Q^T, dO^T as B [d x BQ]; Q, dO as B [BQ x d]; P^T, dS^T as B [BK x BQ] and as A
     * [BK x BQ] */
    float *Qr, *dOr;
    void *QtB, *dOtB, *QB, *dOB, *PtB, *dStB, *PtA, *dStA;
} tile_view;

/* The largest packed operand of a shape (an A [m x kk], or a B [kk x m]) over the BF16 paths,
 * in floats. */
static size_t bf_packed_floats(int b, int64_t m, int64_t kk) {
    const int paths[] = {GDN_BF16_FALLBACK, GDN_BF16_AVX512, GDN_BF16_AMX, GDN_BF16_FMA}; /* (FMA: fp32 values) */
    size_t most = 0;
    for (int i = 0; i < 4; i++) {
        const size_t n = b ? gdn_bf16_packed_b_bytes(paths[i], m, kk) : gdn_bf16_packed_a_bytes(paths[i], m, kk);
        most = n > most ? n : most;
    }
    return most / 4;
}

/* Carve the tile (t NULL: only count): 64-byte aligned pieces from a 64-byte aligned start. */
static size_t tile_layout(int64_t d, int bf, float *base, tile_view *t) {
    const size_t dp = (size_t)dpad(d), dq = (size_t)d;
    /* the BF16 pieces only for a BF16 view */
    const size_t qb = bf ? bf_packed_floats(1, BQ, d) : 0, rb = bf ? bf_packed_floats(1, d, BQ) : 0,
                 pb = bf ? bf_packed_floats(1, BQ, BK) : 0, pa = bf ? bf_packed_floats(0, BK, BQ) : 0,
                 rows = bf ? BQ * dq : 0;
    const size_t sizes[] = {dq * BQ, dq * BQ, BQ * dp, BQ * dp, dq * BQ, BK * BQ, BK * BQ, BQ, BQ, BQ, BQ, BQ,
                            BQ, BQ, 2 * BQ, 2 * BQ, 2 * BQ, 2 * BQ, BK * dq, BK * dq,
                            rows, rows, qb, qb, rb, rb, pb, pb, pa, pa};
    size_t at = 0;
    float *p[sizeof sizes / sizeof sizes[0]];
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        p[i] = base ? base + at : NULL;
        at += (sizes[i] + 15) & ~(size_t)15;
    }
    if (t) {
        t->QtT = p[0], t->dOtT = p[1], t->Qt = p[2], t->dOt = p[3], t->acc = p[4], t->S = p[5], t->dP = p[6];
        t->m = p[7], t->l = p[8], t->lse = p[9], t->D = p[10], t->alpha = p[11];
        t->hi = (int32_t *)p[12], t->lo = (int32_t *)p[13];
        t->tg = (int64_t *)p[14], t->db = (int64_t *)p[15], t->off = (int64_t *)p[16], t->lix = (int64_t *)p[17];
        t->kw = p[18], t->vw = p[19];
        t->Qr = p[20], t->dOr = p[21];
        t->QtB = p[22], t->dOtB = p[23], t->QB = p[24], t->dOB = p[25];
        t->PtB = p[26], t->dStB = p[27], t->PtA = p[28], t->dStA = p[29];
    }
    return at + MK_NR; /* + a panel: the micro-kernel reads whole panels past d */
}

size_t gdn_attn_tile_floats(int64_t d, int bf16) {
    return (tile_layout(d, bf16 != 0, NULL, NULL) + 16 + 15) & ~(size_t)15; /* + 16: room to align the start */
}

static tile_view tile_of(const gdn_attn_core *v) {
    float *base = v->tile + (size_t)gdn_thread_id() * gdn_attn_tile_floats(v->d, v->bf16);
    base = (float *)(((uintptr_t)base + 63) & ~(uintptr_t)63);
    tile_view t;
    tile_layout(v->d, v->bf16 != 0, base, &t);
    return t;
}

static int64_t heads_per_job(const gdn_attn_core *v) {
    const int64_t grp = v->H / v->Hkv;
    int64_t hg = grp < 16 ? grp : 16;
    while (grp % hg) hg--;
    return hg;
}

/* ---------------------------------------------------------------- vectors */

static inline gdn_vf vsplat(float x) { return (gdn_vf){0} + x; }
static inline gdn_vf vsel(gdn_vi m, gdn_vf a, gdn_vf b) { /* m ? a : b, lane by lane */
    return (gdn_vf)(((gdn_vi)a & m) | ((gdn_vi)b & ~m));
}
static inline gdn_vf vmax(gdn_vf a, gdn_vf b) { return vsel(a > b, a, b); }
static inline gdn_vf vload(const float *p) { return *(const gdn_vf *)p; }
static inline void vstore(float *p, gdn_vf x) { *(gdn_vf *)p = x; }

/* exp() of the scores: no lane here is above 88 (scores minus their running max or their lse). */
static inline gdn_vf vexp(gdn_vf x) { return gdn_vexpf_ftz_le88(x); }

/* ---------------------------------------------------------------- products */

/* C[m x nc] (+)= A[m x kk] B[kk x nc] on the micro-kernel: A(i, p) at A[i ars + p acs] in place;
 * B in panels of MK_NR columns, panel q at B + q bps with its rows ldb apart, 64-byte aligned
 * (whole panels are read: finite past nc); C anywhere. A row-major B is bps = MK_NR; the block's
 * gathers are panel-major (ldb = MK_NR, bps = rows x MK_NR: each panel contiguous, so it sits in
 * L1 without the set conflicts of a power-of-two row stride). pf: prefetch each C tile first (C in
 * the caller's memory). */
/* Rows to bring into L2 while a product runs (the next key tile: read in place, it would
 * otherwise arrive from L3 on demand, one row stream per micro-tile row): rows of len floats, ld
 * apart. */
typedef struct {
    const float *p;
    int64_t ld, len;
    int rows;
} prefetch_rows;

static inline __attribute__((always_inline)) void mm_body(const int pf, int m, int nc, int kk, const float *A,
                                                          int64_t ars, int64_t acs, const float *B, int64_t ldb,
                                                          int64_t bps, float *C, int64_t ldc, int acc,
                                                          const prefetch_rows *nx) {
    const int tiles = ((nc + MK_NR - 1) / MK_NR) * ((m + MK_MR - 1) / MK_MR);
    const int per = nx ? (nx->rows + tiles - 1) / tiles : 0;
    int r = 0;
    for (int j0 = 0; j0 < nc; j0 += MK_NR) {
        const int n = nc - j0 < MK_NR ? nc - j0 : MK_NR;
        const float *Bq = B + (j0 / MK_NR) * bps;
        for (int i0 = 0; i0 < m; i0 += MK_MR) {
            for (int q = 0; q < per && r < nx->rows; q++, r++)
                for (int64_t e = 0; e < nx->len; e += 16) __builtin_prefetch(nx->p + r * nx->ld + e, 0, 2);
            gdn_mk_rows(MK_MR, MK_NV, pf, m - i0 < MK_MR ? m - i0 : MK_MR, kk, A + (int64_t)i0 * ars, ars, acs, Bq,
                        ldb, C + (int64_t)i0 * ldc + j0, ldc, n, acc);
        }
    }
}
static void mm(int m, int nc, int kk, const float *A, int64_t ars, int64_t acs, const float *B, int64_t ldb,
               int64_t bps, float *C, int64_t ldc, int acc, const prefetch_rows *nx) {
    mm_body(0, m, nc, kk, A, ars, acs, B, ldb, bps, C, ldc, acc, nx);
}
static void mm_pf(int m, int nc, int kk, const float *A, int64_t ars, int64_t acs, const float *B, int64_t ldb,
                  int64_t bps, float *C, int64_t ldc, int acc, const prefetch_rows *nx) {
    mm_body(1, m, nc, kk, A, ars, acs, B, ldb, bps, C, ldc, acc, nx);
}
/* Scores S^T [n x cols] = X [n x d] (in place, rows xld apart) times a panel-major [d x BQ] gather
 * (its first cols columns, a multiple of MK_NR: a block of fewer rows, a decode step's, computes
 * only its panels), the depth in pieces of KC; S's rows stay BQ apart. */
static void scores_t(int n, int d, int cols, const float *X, int64_t xld, const float *GT, float *S,
                     const prefetch_rows *nx) {
    for (int k0 = 0; k0 < d; k0 += KC)
        mm(n, cols, d - k0 < KC ? d - k0 : KC, X + k0, xld, 1, GT + (int64_t)k0 * MK_NR, MK_NR, (int64_t)d * MK_NR, S,
           BQ, k0 > 0, k0 ? NULL : nx);
}

/* ---------------------------------------------------------------- gathers */

/* The transposed gather, panel-major: element e of row i (times mul; zero for i >= R) at
 * dst[(i / MK_NR) d MK_NR + e MK_NR + i % MK_NR], e < d. */
static void gather_t(float *dst, const float *src, const int64_t *off, int R, int64_t d, float mul) {
    for (int i0 = 0; i0 < BQ; i0 += VL) {
        float *pan = dst + (int64_t)(i0 / MK_NR) * d * MK_NR + i0 % MK_NR;
        int64_t e0 = 0;
        for (; e0 + VL <= d; e0 += VL) {
            gdn_vf r[VL];
            for (int l = 0; l < VL; l++) r[l] = i0 + l < R ? gdn_vloadu(src + off[i0 + l] + e0) * mul : vsplat(0.0f);
            gdn_transpose_vl(r);
            for (int l = 0; l < VL; l++) vstore(pan + (e0 + l) * MK_NR, r[l]);
        }
        for (; e0 < d; e0++)
            for (int l = 0; l < VL; l++) pan[e0 * MK_NR + l] = i0 + l < R ? src[off[i0 + l] + e0] * mul : 0.0f;
    }
}

/* The row-major gather, panel-major: element e of row i (times mul; zero for d <= e < dp) at
 * dst[(e / MK_NR) BQ MK_NR + i MK_NR + e % MK_NR], rows i < R. */
static void gather_rows_major(float *dst, const float *src, const int64_t *off, int R, int64_t d, float mul) {
    const int64_t dp = dpad(d);
    for (int i = 0; i < R; i++) {
        const float *s = src + off[i];
        for (int64_t e0 = 0; e0 < dp; e0 += MK_NR) {
            float *o = dst + (e0 / MK_NR) * BQ * MK_NR + (int64_t)i * MK_NR;
            if (e0 + MK_NR <= d) {
                for (int e = 0; e < MK_NR; e += VL) vstore(o + e, gdn_vloadu(s + e0 + e) * mul);
            } else {
                for (int e = 0; e < MK_NR; e++) o[e] = e0 + e < d ? s[e0 + e] * mul : 0.0f;
            }
        }
    }
}

/* Row i's output at dst + off[i] (e < d) from src[e][i] times mul[i] (mul NULL: times k),
 * stored or (add) added. */
static void scatter_t(float *dst, const float *src, const int64_t *off, int R, int64_t d, const float *mul, float k,
                      int add) {
    for (int i0 = 0; i0 < R; i0 += VL) {
        const int ni = R - i0 < VL ? R - i0 : VL;
        int64_t e0 = 0;
        for (; e0 + VL <= d; e0 += VL) {
            gdn_vf r[VL];
            for (int l = 0; l < VL; l++) r[l] = vload(src + (e0 + l) * BQ + i0);
            gdn_transpose_vl(r);
            for (int i = 0; i < ni; i++) {
                float *o = dst + off[i0 + i] + e0;
                const gdn_vf x = r[i] * (mul ? mul[i0 + i] : k);
                gdn_vstoreu(o, add ? gdn_vloadu(o) + x : x);
            }
        }
        for (; e0 < d; e0++)
            for (int i = 0; i < ni; i++) {
                float *o = dst + off[i0 + i] + e0;
                const float x = src[e0 * BQ + i0 + i] * (mul ? mul[i0 + i] : k);
                *o = add ? *o + x : x;
            }
    }
}

/* The plain gather: row i (times mul) at dst[i d], rows R..BQ zero. */
static void gather_plain(float *dst, const float *src, const int64_t *off, int R, int64_t d, float mul) {
    for (int i = 0; i < R; i++) {
        int64_t e = 0;
        for (; e + VL <= d; e += VL) gdn_vstoreu(dst + i * d + e, gdn_vloadu(src + off[i] + e) * mul);
        for (; e < d; e++) dst[i * d + e] = src[off[i] + e] * mul;
    }
    memset(dst + (int64_t)R * d, 0, sizeof(float) * (size_t)(BQ - R) * (size_t)d);
}

/* The rows of query block blk of head group g in batch row b: i = tt hg + hh is token blk TB + tt
 * of head g hg + hh. Fills each row's offsets, global index and document start, Q^T (scaled) and,
 * for the backward (dO given), Q, dO^T, dO, lse and D (bf: Qr and dOr instead of the gathers for
 * the fp32 products); rows past R see nothing. Returns R. */
/* The rows of query block blk (hg heads per token). */
static inline int block_rows(const gdn_attn_core *v, int64_t hg, int64_t blk) {
    const int64_t TB = BQ / hg, left = v->nq - blk * TB;
    return (int)((left < TB ? left : TB) * hg);
}

static int gather_block(const gdn_attn_core *v, const tile_view *t, int64_t b, int64_t g, int64_t blk, int64_t hg,
                        const float *dO, const float *lse, const float *D, int bf) {
    const int64_t TB = BQ / hg, d = v->d, tok0 = blk * TB;
    const int64_t ntok = v->nq - tok0 < TB ? v->nq - tok0 : TB;
    const float scale = 1.0f / sqrtf((float)d);
    int64_t db = -1, db_end = -1;
    for (int64_t tt = 0; tt < ntok; tt++) {
        const int64_t tl = tok0 + tt, tgl = v->q0 + tl, row = b * v->nq + tl;
        if (tgl >= db_end) /* a new document (dense: once) */
            db = gdn_attn_doc_begin(v->cu, v->n_docs, tgl), db_end = gdn_attn_doc_end(v->cu, v->n_docs, tgl);
        for (int64_t hh = 0; hh < hg; hh++) {
            const int64_t i = tt * hg + hh, h = g * hg + hh;
            t->off[i] = row * v->qld + h * d, t->lix[i] = row * v->H + h;
            t->tg[i] = tgl, t->db[i] = db;
        }
    }
    const int R = (int)(ntok * hg);
    for (int i = R; i < BQ; i++) t->tg[i] = INT64_MIN / 2, t->db[i] = INT64_MAX / 2;
    if (bf) { /* rows for the packers (below) */
        gather_plain(t->Qr, v->Q, t->off, R, d, scale);
        if (dO) gather_plain(t->dOr, dO, t->off, R, d, 1.0f);
    } else {
        gather_t(t->QtT, v->Q, t->off, R, d, scale);
        if (dO) {
            gather_t(t->dOtT, dO, t->off, R, d, 1.0f);
            gather_rows_major(t->Qt, v->Q, t->off, R, d, scale);
            gather_rows_major(t->dOt, dO, t->off, R, d, 1.0f);
        }
    }
    if (dO) {
        for (int i = 0; i < BQ; i++) {
            /* a row that saw nothing (lse -inf) and the rows past R: P = exp(s - inf) = 0 */
            const float l = i < R ? lse[t->lix[i]] : INFINITY;
            t->lse[i] = l == -INFINITY ? INFINITY : l;
            t->D[i] = i < R ? D[t->lix[i]] : 0.0f;
        }
    }
    return R;
}

/* The keys rows [0, R) of a block can see, clipped to the view: [lo, hi) global (empty: lo >= hi). */
static inline void key_range(const gdn_attn_core *v, const tile_view *t, int R, int64_t *lo, int64_t *hi) {
    *lo = t->db[0] > v->k0 ? t->db[0] : v->k0;
    *hi = t->tg[R - 1] + 1 < v->k0 + v->nk ? t->tg[R - 1] + 1 : v->k0 + v->nk;
}
/* The first aligned tile of [lo, ...). */
static inline int64_t first_tile(const gdn_attn_core *v, int64_t lo) {
    return v->k0 + (lo > v->k0 ? (lo - v->k0) / BK * BK : 0);
}
/* Every row of the block sees all keys [u0, u0 + n): no mask. */
static inline int tile_full(const tile_view *t, int R, int64_t u0, int n) {
    return u0 >= t->db[R - 1] && u0 + n - 1 <= t->tg[0];
}
/* Each row's visible keys [lo, hi] relative to u0, clamped to [-1, BK]. */
static void set_limits(const tile_view *t, int64_t u0) {
    for (int i = 0; i < BQ; i++) {
        const int64_t h = t->tg[i] - u0, l = t->db[i] - u0;
        t->hi[i] = (int32_t)(h < -1 ? -1 : h > BK ? BK : h);
        t->lo[i] = (int32_t)(l < 0 ? 0 : l > BK ? BK + 1 : l);
    }
}
static inline gdn_vi visible(const tile_view *t, int i0, int c) {
    const gdn_vi cc = (gdn_vi){0} + c;
    return (cc <= *(const gdn_vi *)(t->hi + i0)) & (cc >= *(const gdn_vi *)(t->lo + i0));
}

/* ---------------------------------------------------------------- BF16: the packed keys */


/* The key tiles' A operands a call packs (a mask of): K [n x d] (the scores S^T = K Q^T), V^T
 * [d x n] (O^T += V^T P^T), V [n x d] (dP^T = V dO^T), K^T [d x n] (dQ^T += K^T dS^T). */
enum { BF_K = 1, BF_VT = 2, BF_V = 4, BF_KT = 8 };

typedef struct {
    int path;        /* 0: the call runs its products in fp32 */
    char *p;         /* per (b, j, tile): the packed operands of the mask, in bit order */
    size_t op_bytes; /* one operand's room */
    int n_ops;
    unsigned mask;
    int64_t nkt;
} bf_keys;

/* The keys of the view's tile kt (its packed depth as V^T, K^T: a row sees n <= that many). */
static inline int64_t tile_keys(const gdn_attn_core *v, int64_t kt) {
    return v->nk - kt * BK < BK ? v->nk - kt * BK : BK;
}

static const void *bf_key_op(const gdn_attn_core *v, const bf_keys *k, int64_t b, int64_t j, int64_t kt, unsigned op) {
    const int slot = __builtin_popcount(k->mask & (op - 1)); /* the operands of lower bits come first */
    return k->p + ((size_t)((b * v->Hkv + j) * k->nkt + kt) * (size_t)k->n_ops + (size_t)slot) * k->op_bytes;
}

/* Pack the view's key tiles (mask: which operands) when its products run in BF16: an fp32 view
 * with blocks of more than FEW_ROWS rows (a decode step's few rows run fp32 by rows); k->path 0
 * otherwise, and when the room cannot be allocated (the call then runs in fp32). */
static bf_keys bf_pack_keys(const gdn_attn_core *v, unsigned mask) {
    bf_keys k = {0};
    if (!v->bf16 || v->Kb || v->Vb || block_rows(v, heads_per_job(v), 0) <= FEW_ROWS || v->nk <= 0) return k;
    const int forced = gdn_test_mutate("attention: the BF16 path of the core"); /* a GDN_BF16_* path; 0: automatic */
    const int path = forced ? forced : gdn_bf16_path_auto();
    const int64_t d = v->d;
    const size_t a1 = gdn_bf16_packed_a_bytes(path, BK, d), a2 = gdn_bf16_packed_a_bytes(path, d, BK);
    k.op_bytes = a1 > a2 ? a1 : a2, k.mask = mask, k.n_ops = __builtin_popcount(mask);
    k.nkt = (v->nk + BK - 1) / BK;
    const int64_t tiles = v->B * v->Hkv * k.nkt;
    k.p = gdn_alloc_aligned("attention_core: k.p", (size_t)tiles * (size_t)k.n_ops * k.op_bytes);
    if (!k.p) return (bf_keys){0};
    k.path = path;
#pragma omp parallel for num_threads(v->threads) schedule(static)
    for (int64_t job = 0; job < tiles; job++) {
        const int64_t kt = job % k.nkt, j = job / k.nkt % v->Hkv, b = job / k.nkt / v->Hkv;
        const int64_t u = kt * BK, n = tile_keys(v, kt);
        const float *Ku = v->K.p + b * v->K.bs + j * v->K.hs + u * v->K.ld;
        const float *Vu = v->V.p + b * v->V.bs + j * v->V.hs + u * v->V.ld;
        if (mask & BF_K) gdn_bf16_pack_a(path, 0, n, d, Ku, v->K.ld, (void *)bf_key_op(v, &k, b, j, kt, BF_K));
        if (mask & BF_VT) gdn_bf16_pack_a(path, 1, d, n, Vu, v->V.ld, (void *)bf_key_op(v, &k, b, j, kt, BF_VT));
        if (mask & BF_V) gdn_bf16_pack_a(path, 0, n, d, Vu, v->V.ld, (void *)bf_key_op(v, &k, b, j, kt, BF_V));
        if (mask & BF_KT) gdn_bf16_pack_a(path, 1, d, n, Ku, v->K.ld, (void *)bf_key_op(v, &k, b, j, kt, BF_KT));
    }
    return k;
}

/* The packed keys for block blk, or none (fp32 products) when the block has at most FEW_ROWS
 * rows: the forward's few-row path is fp32, so its backward is too. */
static inline bf_keys block_keys(const bf_keys *k, const gdn_attn_core *v, int64_t hg, int64_t blk) {
    bf_keys none = {0};
    return k->path && block_rows(v, hg, blk) > FEW_ROWS ? *k : none;
}

/* ---------------------------------------------------------------- forward */

#define LAZY_MAX GDN_ATTN_LAZY_MAX

/* One tile's online-softmax step on S^T (n x BQ, scaled scores): P^T into dP, against each row's
 * running max m (raised when a score passes m + LAZY_MAX, or set by the first scores the row sees);
 * alpha the factor on the row's earlier sum and output. Returns whether some alpha is not 1. */
static int softmax_step(const tile_view *t, int n, int full, int cols) {
    gdn_vi any = {0};
    for (int i0 = 0; i0 < cols; i0 += VL) {
        const gdn_vf mo = vload(t->m + i0);
        if (!full)
            for (int c = 0; c < n; c++)
                vstore(t->S + c * BQ + i0, vsel(visible(t, i0, c), vload(t->S + c * BQ + i0), vsplat(-INFINITY)));
        gdn_vi known = mo > -INFINITY;
        int all = 1;
        for (int l = 0; l < VL; l++) all &= known[l] != 0;
        gdn_vf sum = {0}, mx = vsplat(-INFINITY);
        if (all) { /* one pass against the running max; redone below if a score passes it by LAZY_MAX */
            for (int c = 0; c < n; c++) {
                const gdn_vf s = vload(t->S + c * BQ + i0);
                mx = vmax(mx, s);
                const gdn_vf p = vexp(s - mo);
                vstore(t->dP + c * BQ + i0, p);
                sum += p;
            }
            const gdn_vi grow = mx > mo + LAZY_MAX;
            int none = 1;
            for (int l = 0; l < VL; l++) none &= grow[l] == 0;
            if (none) {
                vstore(t->l + i0, vload(t->l + i0) + sum);
                vstore(t->alpha + i0, vsplat(1.0f));
                continue;
            }
            sum = (gdn_vf){0};
        } else {
            for (int c = 0; c < n; c++) mx = vmax(mx, vload(t->S + c * BQ + i0));
        }
        /* the max moves where it grew past the slack or was unknown (stays -inf while a row sees nothing) */
        const gdn_vf mn = vsel(mx > mo + LAZY_MAX, mx, mo);
        const gdn_vf mu = vsel(mn == -INFINITY, vsplat(0.0f), mn);
        const gdn_vf alpha = vexp(mo - mu);
        for (int c = 0; c < n; c++) {
            const gdn_vf p = vexp(vload(t->S + c * BQ + i0) - mu);
            vstore(t->dP + c * BQ + i0, p);
            sum += p;
        }
        vstore(t->l + i0, vload(t->l + i0) * alpha + sum);
        vstore(t->m + i0, mn);
        vstore(t->alpha + i0, alpha);
        any |= alpha != 1.0f;
    }
    for (int l = 0; l < VL; l++)
        if (any[l]) return 1;
    return 0;
}

/* n rows of d bf16 values (row stride ld) widened into dst [n][d]: exact. */
static void widen_rows(float *restrict dst, const uint16_t *src, int n, int64_t ld, int64_t d) {
    for (int r = 0; r < n; r++)
        for (int64_t e = 0; e < d; e++) {
            const uint32_t u = (uint32_t)src[r * ld + e] << 16;
            memcpy(dst + r * d + e, &u, 4);
        }
}

/* ---------------------------------------------------------------- few rows (a decode step) */

/* A block of at most FEW_ROWS rows (a decode step: one token's hg query heads) wastes most of the
 * tiled path, whose products are MK_NR = 2 VL columns wide. It runs here instead, one row at a
 * time, with the keys along the vector lanes: a score is a dot product along d, VL keys' partial
 * sums reduced at once into one vector of VL scores (gdn_hsum_vl); the softmax runs on those vectors; O
 * accumulates the rows of V scaled by P (a row's o [d] in the tile's acc). Same lazy running max
 * as softmax_step. Measured (gdncp bench decode): see docs/performance.md, the decode step. */

/* s[c] = q . K[c] for the n keys of a tile (s padded to whole vectors, zero past n): VL keys at
 * a time, each key's partial sums an independent chain along d (in registers when VL keys are
 * whole), then reduced together. */
static void few_scores(const float *q, int64_t d, const float *K, int64_t kld, int n, float *s) {
    const int64_t dv = d / VL * VL;
    for (int c0 = 0; c0 < n; c0 += VL) {
        const int nl = n - c0 < VL ? n - c0 : VL;
        const float *k = K + (int64_t)c0 * kld;
        gdn_vf r[VL];
        for (int l = 0; l < VL; l++) r[l] = (gdn_vf){0};
        if (nl == VL) {
            for (int64_t e = 0; e < dv; e += VL) {
                const gdn_vf qv = gdn_vloadu(q + e);
                for (int l = 0; l < VL; l++) r[l] += gdn_vloadu(k + l * kld + e) * qv;
            }
        } else {
            for (int64_t e = 0; e < dv; e += VL) {
                const gdn_vf qv = gdn_vloadu(q + e);
                for (int l = 0; l < nl; l++) r[l] += gdn_vloadu(k + l * kld + e) * qv;
            }
        }
#if GDN_VL == 16
        if (d - dv >= 8) { /* the head's last 8 dims (d = 24, 40, ...) as a half vector in lanes 0-7 */
            const gdn_v8f q8 = *(const gdn_v8f_u *)(q + dv), z8 = {0};
            for (int l = 0; l < nl; l++)
                r[l] += __builtin_shufflevector(*(const gdn_v8f_u *)(k + l * kld + dv) * q8, z8, 0, 1, 2, 3, 4, 5, 6, 7,
                                                8, 9, 10, 11, 12, 13, 14, 15);
        }
        const int64_t d8 = d - dv >= 8 ? dv + 8 : dv;
#else
        const int64_t d8 = dv;
#endif
        for (int l = 0; l < nl; l++)
            for (int64_t e = d8; e < d; e++) r[l][0] += k[l * kld + e] * q[e];
        vstore(s + c0, gdn_hsum_vl(r));
    }
}

/* o [d] += sum over keys c in [lo, hi] of p[c] V[c]: o in registers along a piece of up to 4
 * vectors of d, the keys inside. */
static void few_accumulate(float *o, int64_t d, const float *p, const float *Vu, int64_t vld, int lo, int hi) {
    int64_t e0 = 0;
    for (; e0 + 4 * VL <= d; e0 += 4 * VL) {
        gdn_vf a0 = gdn_vloadu(o + e0), a1 = gdn_vloadu(o + e0 + VL), a2 = gdn_vloadu(o + e0 + 2 * VL),
               a3 = gdn_vloadu(o + e0 + 3 * VL);
        for (int c = lo; c <= hi; c++) {
            const float *vr = Vu + (int64_t)c * vld + e0;
            const float pc = p[c];
            a0 += pc * gdn_vloadu(vr), a1 += pc * gdn_vloadu(vr + VL);
            a2 += pc * gdn_vloadu(vr + 2 * VL), a3 += pc * gdn_vloadu(vr + 3 * VL);
        }
        gdn_vstoreu(o + e0, a0), gdn_vstoreu(o + e0 + VL, a1);
        gdn_vstoreu(o + e0 + 2 * VL, a2), gdn_vstoreu(o + e0 + 3 * VL, a3);
    }
    /* The rest, a vector at a time: keys four at a time into four accumulators, so that an FMA
     * waits on the one four keys back (one chain of dependent FMAs ran at one per 4 cycles: half
     * a decode step's attention at d = 24). */
    for (; e0 + VL <= d; e0 += VL) {
        gdn_vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        const float *vr = Vu + e0;
        int c = lo;
        for (; c + 3 <= hi; c += 4) {
            a0 += p[c] * gdn_vloadu(vr + (int64_t)c * vld), a1 += p[c + 1] * gdn_vloadu(vr + (int64_t)(c + 1) * vld);
            a2 += p[c + 2] * gdn_vloadu(vr + (int64_t)(c + 2) * vld), a3 += p[c + 3] * gdn_vloadu(vr + (int64_t)(c + 3) * vld);
        }
        for (; c <= hi; c++) a0 += p[c] * gdn_vloadu(vr + (int64_t)c * vld);
        gdn_vstoreu(o + e0, gdn_vloadu(o + e0) + ((a0 + a1) + (a2 + a3)));
    }
#if GDN_VL == 16
    if (d - e0 >= 8) { /* a last half vector, the same way */
        gdn_v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        const float *vr = Vu + e0;
        int c = lo;
        for (; c + 3 <= hi; c += 4) {
            a0 += p[c] * *(const gdn_v8f_u *)(vr + (int64_t)c * vld);
            a1 += p[c + 1] * *(const gdn_v8f_u *)(vr + (int64_t)(c + 1) * vld);
            a2 += p[c + 2] * *(const gdn_v8f_u *)(vr + (int64_t)(c + 2) * vld);
            a3 += p[c + 3] * *(const gdn_v8f_u *)(vr + (int64_t)(c + 3) * vld);
        }
        for (; c <= hi; c++) a0 += p[c] * *(const gdn_v8f_u *)(vr + (int64_t)c * vld);
        *(gdn_v8f_u *)(o + e0) = *(gdn_v8f_u *)(o + e0) + ((a0 + a1) + (a2 + a3));
        e0 += 8;
    }
#endif
    for (; e0 < d; e0++)
        for (int c = lo; c <= hi; c++) o[e0] += p[c] * Vu[(int64_t)c * vld + e0];
}

/* One tile's step for row i of a few-row block: scores of keys [u0, u0 + n) (masked unless full),
 * the running max and sum (m, l), o [d] rescaled when the max moves and += P V. */
static void few_row_tile(const tile_view *t, int i, int64_t d, const float *q, float *o, const float *Ku, int64_t kld,
                         const float *Vu, int64_t vld, int n, int full) {
    float *s = t->S + (int64_t)i * BK; /* the tile's S holds BQ x BK floats: row i's BK scores */
    few_scores(q, d, Ku, kld, n, s);
    const int lo = full ? 0 : t->lo[i], hi = full ? n - 1 : (t->hi[i] < n - 1 ? t->hi[i] : n - 1);
    if (lo > hi) return; /* this row sees none of the tile */
    gdn_vf mxv = vsplat(-INFINITY);
    gdn_vi lane;
    for (int l = 0; l < VL; l++) lane[l] = l;
    for (int c0 = 0; c0 < n; c0 += VL) {
        const gdn_vi c = lane + c0;
        const gdn_vf x = vsel((c >= lo) & (c <= hi), vload(s + c0), vsplat(-INFINITY));
        vstore(s + c0, x);
        mxv = vmax(mxv, x);
    }
    float mx = mxv[0];
    for (int l = 1; l < VL; l++) mx = mxv[l] > mx ? mxv[l] : mx;
    float m = t->m[i];
    if (m == -INFINITY || mx > m + LAZY_MAX) { /* the max moves: rescale the earlier sum and output */
        const float alpha = m == -INFINITY ? 0.0f : vexp(vsplat(m - mx))[0];
        t->l[i] *= alpha;
        for (int64_t e = 0; e < d; e++) o[e] *= alpha;
        t->m[i] = m = mx;
    }
    gdn_vf sum = {0};
    for (int c0 = 0; c0 < n; c0 += VL) {
        const gdn_vf p = vexp(vload(s + c0) - m); /* -inf (masked, or past n) -> 0 */
        vstore(s + c0, p);
        sum += p;
    }
    float l = 0.0f;
    for (int c = 0; c < VL; c++) l += sum[c];
    t->l[i] += l;
    few_accumulate(o, d, s, Vu, vld, lo, hi);
}

/* One job of the forward core: query block blk of batch row b, head group g (hg heads). */
static void core_forward_job(const gdn_attn_core *v, const bf_keys *pbk, int64_t hg, int64_t blk, int64_t b, int64_t g,
                             float *o, float *lse) {
    const bf_keys bk = *pbk;
    const int64_t grp = v->H / v->Hkv, d = v->d;
    const tile_view t = tile_of(v);
    const bf_keys kb = block_keys(&bk, v, hg, blk);
    const int bf = kb.path != 0;
    const int R = gather_block(v, &t, b, g, blk, hg, NULL, NULL, NULL, bf);
    const int cols = (R + MK_NR - 1) / MK_NR * MK_NR; /* the block's panels in use (columns are
                                                         independent: the same bits as all BQ) */
    const int64_t j = g * hg / grp;
    const unsigned fm = bf ? gdn_bf16_thread_begin(bk.path) : 0;
    if (bf) gdn_bf16_pack_b(bk.path, 1, cols, d, t.Qr, d, t.QtB); /* Q^T [d x cols] */
    /* a BF16 view (a BF16 KV cache) is read a tile at a time, widened into the tile's kw, vw */
    const int kvb = v->Kb != NULL;
    const float *K = kvb ? NULL : v->K.p + b * v->K.bs + j * v->K.hs, *V = kvb ? NULL : v->V.p + b * v->V.bs + j * v->V.hs;
    const uint16_t *Kb = kvb ? v->Kb + b * v->K.bs + j * v->K.hs : NULL, *Vb = kvb ? v->Vb + b * v->V.bs + j * v->V.hs : NULL;
    const int64_t kld = kvb ? d : v->K.ld, vld = kvb ? d : v->V.ld;
    for (int i = 0; i < BQ; i++) t.m[i] = -INFINITY, t.l[i] = 0.0f;
    const int few = R <= FEW_ROWS; /* rows of q [d] in Qt, of o [d] in acc */
    if (few)
        for (int i = 0; i < R; i++) {
            for (int64_t e = 0; e < d; e++) t.Qt[i * d + e] = t.QtT[e * MK_NR + i]; /* scaled, as gathered */
            memset(t.acc + i * d, 0, sizeof(float) * (size_t)d);
        }
    int64_t lo, hi;
    key_range(v, &t, R, &lo, &hi);
    int first = 1;
    for (int64_t u0 = first_tile(v, lo); u0 < hi; u0 += BK) {
        const int n = (int)(hi - u0 < BK ? hi - u0 : BK);
        const float *Ku, *Vu;
        if (kvb) {
            widen_rows(t.kw, Kb + (u0 - v->k0) * v->K.ld, n, v->K.ld, d);
            widen_rows(t.vw, Vb + (u0 - v->k0) * v->V.ld, n, v->V.ld, d);
            Ku = t.kw, Vu = t.vw;
        } else {
            Ku = K + (u0 - v->k0) * v->K.ld, Vu = V + (u0 - v->k0) * v->V.ld;
        }
        if (few) {
            const int full = tile_full(&t, R, u0, n);
            if (!full) set_limits(&t, u0);
            for (int i = 0; i < R; i++)
                few_row_tile(&t, i, d, t.Qt + i * d, t.acc + i * d, Ku, kld, Vu, vld, n, full);
            first = 0;
            continue;
        }
        /* the next tile's keys and values come into L2 under this one's products (fp32 views) */
        const int nn = bf || kvb ? 0 : (int)(hi - u0 - BK < BK ? hi - u0 - BK : BK);
        const prefetch_rows nk = {Ku + BK * kld, kld, d, nn > 0 ? nn : 0};
        const prefetch_rows nv = {Vu + BK * vld, vld, d, nn > 0 ? nn : 0};
        const int64_t kt = (u0 - v->k0) / BK;
        if (bf) /* S^T = K Q^T */
            gdn_bf16_packed_gemm(bk.path, 0, n, cols, d, bf_key_op(v, &bk, b, j, kt, BF_K), d, t.QtB, d, t.S, BQ);
        else
            scores_t(n, (int)d, cols, Ku, kld, t.QtT, t.S, &nk);
        const int full = tile_full(&t, R, u0, n);
        if (!full) set_limits(&t, u0);
        const int rescale = softmax_step(&t, n, full, cols);
        if (rescale && !first)
            for (int64_t e = 0; e < d; e++)
                for (int i0 = 0; i0 < cols; i0 += VL) vstore(t.acc + e * BQ + i0, vload(t.acc + e * BQ + i0) * vload(t.alpha + i0));
        if (bf) { /* O^T += V^T P^T */
            gdn_bf16_pack_b(bk.path, 0, cols, n, t.dP, BQ, t.PtB);
            gdn_bf16_packed_gemm(bk.path, !first, d, cols, n, bf_key_op(v, &bk, b, j, kt, BF_VT), tile_keys(v, kt), t.PtB, n,
                                 t.acc, BQ);
        } else {
            mm((int)d, cols, n, Vu, 1, vld, t.dP, BQ, MK_NR, t.acc, BQ, !first, &nv);
        }
        first = 0;
    }
    if (bf) gdn_bf16_thread_end(bk.path, fm);
    for (int i = 0; i < BQ; i++) { /* 1 / l per row, lse; a query that sees nothing: o = 0, lse = -inf */
        const float l = t.l[i];
        if (i < R) lse[t.lix[i]] = l > 0.0f && !first ? t.m[i] + logf(l) : -INFINITY;
        t.alpha[i] = l > 0.0f && !first ? 1.0f / l : 0.0f;
    }
    if (few) {
        for (int i = 0; i < R; i++)
            for (int64_t e = 0; e < d; e++) o[t.off[i] + e] = t.acc[i * d + e] * t.alpha[i];
        return;
    }
    if (first) memset(t.acc, 0, sizeof(float) * (size_t)d * BQ);
    scatter_t(o, t.acc, t.off, R, d, t.alpha, 0.0f, 0);
}

void gdn_attn_core_forward(const gdn_attn_core *v, float *o, float *lse) {
    const int64_t hg = heads_per_job(v), TB = BQ / hg, nblk = (v->nq + TB - 1) / TB, ng = v->H / hg;
    const int64_t jobs = v->B * ng * nblk;
    const bf_keys bk = bf_pack_keys(v, BF_K | BF_VT);
    /* longest first; one thread enters no parallel region (gdn_team), nor does a core whose
     * keys and values, read once per query row, are too few to be worth a team (a decode step
     * over a short cache) */
    const int nt = gdn_threads_for_bytes(v->threads, 2.0 * sizeof(float) * (double)(v->B * v->Hkv * v->d) *
                                                         (double)v->nk * (double)v->nq);
    if (nt <= 1 || jobs == 1) {
        for (int64_t job = 0; job < jobs; job++)
            core_forward_job(v, &bk, hg, nblk - 1 - job / (v->B * ng), job % (v->B * ng) / ng, job % ng, o, lse);
    } else {
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1)
        for (int64_t job = 0; job < jobs; job++)
            core_forward_job(v, &bk, hg, nblk - 1 - job / (v->B * ng), job % (v->B * ng) / ng, job % ng, o, lse);
    }
    free(bk.p);
}

void gdn_attn_merge(int64_t rows, int64_t H, int64_t d, int64_t qld, float *o, float *lse, const float *o2,
                    const float *lse2, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < H; h++) {
            const float l1 = lse[r * H + h], l2 = lse2[r * H + h];
            if (l2 == -INFINITY) continue;
            float *a = o + r * qld + h * d;
            const float *c = o2 + r * qld + h * d;
            if (l1 == -INFINITY) {
                memcpy(a, c, sizeof(float) * (size_t)d);
                lse[r * H + h] = l2;
                continue;
            }
            const float m = l1 > l2 ? l1 : l2, w1 = expf(l1 - m), w2 = expf(l2 - m), inv = 1.0f / (w1 + w2);
            for (int64_t e = 0; e < d; e++) a[e] = (w1 * a[e] + w2 * c[e]) * inv;
            lse[r * H + h] = m + logf(w1 + w2);
        }
}

/* ---------------------------------------------------------------- backward */

enum { PAIR_DQ = 1, PAIR_DKV = 2 };

/* One (block, tile) pair of the backward: keys [u0, u0 + n) of kv head j (Ku, Vu: key u0; dKu,
 * dVu: its gradient rows). PAIR_DQ: dQ^T += K^T dS^T (overwritten when first); PAIR_DKV:
 * dV += P^T dO, dK += dS^T Q (scaled Q: the d^-1/2 of dK) into the caller's rows. bk->path: the
 * products on the packed key tile kt of (b, j) and the block's packed rows (bf_pack_block). */
static void backward_pair(const gdn_attn_core *v, const tile_view *t, int R, int64_t u0, int n, const float *Ku,
                          const float *Vu, int flags, int first, float *dKu, int64_t dk_ld, float *dVu, int64_t dv_ld,
                          int n_next, const bf_keys *bk, int64_t b, int64_t j) {
    const int d = (int)v->d, path = bk->path;
    const int64_t kt = (u0 - v->k0) / BK;
    if (path) {
        gdn_bf16_packed_gemm(path, 0, n, BQ, d, bf_key_op(v, bk, b, j, kt, BF_K), d, t->QtB, d, t->S, BQ);   /* S^T = K Q^T */
        gdn_bf16_packed_gemm(path, 0, n, BQ, d, bf_key_op(v, bk, b, j, kt, BF_V), d, t->dOtB, d, t->dP, BQ); /* dP^T = V dO^T */
    } else {
        /* the next tile's keys and values (n_next of them, in the caller's order) come into L2 */
        const prefetch_rows nk = {Ku + BK * v->K.ld, v->K.ld, d, n_next}, nv = {Vu + BK * v->V.ld, v->V.ld, d, n_next};
        scores_t(n, d, BQ, Ku, v->K.ld, t->QtT, t->S, &nk);  /* S^T = K Q^T (scaled) */
        scores_t(n, d, BQ, Vu, v->V.ld, t->dOtT, t->dP, &nv); /* dP^T = V dO^T */
    }
    const int full = tile_full(t, R, u0, n);
    if (!full) set_limits(t, u0);
    for (int i0 = 0; i0 < BQ; i0 += VL) {
        const gdn_vf l = vload(t->lse + i0), Dv = vload(t->D + i0);
        for (int c = 0; c < n; c++) {
            gdn_vf p = vexp(vload(t->S + c * BQ + i0) - l);
            if (!full) p = vsel(visible(t, i0, c), p, vsplat(0.0f));
            vstore(t->S + c * BQ + i0, p);
            vstore(t->dP + c * BQ + i0, p * (vload(t->dP + c * BQ + i0) - Dv)); /* dS = P (dP - D) */
        }
    }
    if (flags & PAIR_DKV) {
        if (path) {
            gdn_bf16_pack_a(path, 0, n, R, t->S, BQ, t->PtA);
            gdn_bf16_packed_gemm(path, 1, n, d, R, t->PtA, R, t->dOB, R, dVu, dv_ld); /* dV += P^T dO */
            gdn_bf16_pack_a(path, 0, n, R, t->dP, BQ, t->dStA);
            gdn_bf16_packed_gemm(path, 1, n, d, R, t->dStA, R, t->QB, R, dKu, dk_ld); /* dK += dS^T Q */
        } else {
            mm_pf(n, d, R, t->S, BQ, 1, t->dOt, MK_NR, BQ * MK_NR, dVu, dv_ld, 1, NULL); /* dV += P^T dO */
            mm_pf(n, d, R, t->dP, BQ, 1, t->Qt, MK_NR, BQ * MK_NR, dKu, dk_ld, 1, NULL); /* dK += dS^T Q */
        }
    }
    if (flags & PAIR_DQ) { /* dQ^T += K^T dS^T */
        if (path) {
            gdn_bf16_pack_b(path, 0, BQ, n, t->dP, BQ, t->dStB);
            gdn_bf16_packed_gemm(path, !first, d, BQ, n, bf_key_op(v, bk, b, j, kt, BF_KT), tile_keys(v, kt), t->dStB, n,
                                 t->acc, BQ);
        } else {
            mm(d, BQ, n, Ku, 1, v->K.ld, t->dP, BQ, MK_NR, t->acc, BQ, !first, NULL);
        }
    }
}

/* A gathered block's rows packed for the BF16 backward (R rows; flags: which pairs follow):
 * Q^T and dO^T as the scores' B operands, and (PAIR_DKV) Q and dO as dK's and dV's. */
static void bf_pack_block(int path, const tile_view *t, int R, int64_t d, int flags) {
    gdn_bf16_pack_b(path, 1, BQ, d, t->Qr, d, t->QtB);
    gdn_bf16_pack_b(path, 1, BQ, d, t->dOr, d, t->dOtB);
    if (flags & PAIR_DKV) {
        gdn_bf16_pack_b(path, 0, d, R, t->Qr, d, t->QB);
        gdn_bf16_pack_b(path, 0, d, R, t->dOr, d, t->dOB);
    }
}

/* Every tile of one gathered block (rows [0, R)): the pairs in key order; dQ added into dq when
 * asked. */
static void backward_block(const gdn_attn_core *v, const tile_view *t, int R, int64_t b, int64_t j, int flags,
                           float *dq, const gdn_attn_kv *dk, const gdn_attn_kv *dv, const bf_keys *bk) {
    int64_t lo, hi;
    key_range(v, t, R, &lo, &hi);
    if (lo >= hi) return;
    if (bk->path) bf_pack_block(bk->path, t, R, v->d, flags);
    const float *K = v->K.p + b * v->K.bs + j * v->K.hs, *V = v->V.p + b * v->V.bs + j * v->V.hs;
    int first = 1;
    for (int64_t u0 = first_tile(v, lo); u0 < hi; u0 += BK, first = 0) {
        const int n = (int)(hi - u0 < BK ? hi - u0 : BK);
        const int64_t u = u0 - v->k0;
        const int nn = (int)(hi - u0 - BK < BK ? hi - u0 - BK : BK);
        backward_pair(v, t, R, u0, n, K + u * v->K.ld, V + u * v->V.ld, flags, first,
                      flags & PAIR_DKV ? dk->p + b * dk->bs + j * dk->hs + u * dk->ld : NULL, flags & PAIR_DKV ? dk->ld : 0,
                      flags & PAIR_DKV ? dv->p + b * dv->bs + j * dv->hs + u * dv->ld : NULL, flags & PAIR_DKV ? dv->ld : 0,
                      nn > 0 ? nn : 0, bk, b, j);
    }
    if (flags & PAIR_DQ) scatter_t(dq, t->acc, t->off, R, v->d, NULL, 1.0f / sqrtf((float)v->d), 1);
}

void gdn_attn_core_backward_q(const gdn_attn_core *v, const float *dO, const float *lse, const float *D, float *dq) {
    GDN_ASSERT(!v->Kb && !v->Vb); /* BF16 views are a KV cache's: forward only */
    const int64_t hg = heads_per_job(v), TB = BQ / hg, nblk = (v->nq + TB - 1) / TB, ng = v->H / hg;
    const int64_t grp = v->H / v->Hkv, jobs = v->B * ng * nblk;
    const bf_keys bk = bf_pack_keys(v, BF_K | BF_V | BF_KT);
#pragma omp parallel for num_threads(v->threads) schedule(dynamic, 1)
    for (int64_t job = 0; job < jobs; job++) {
        const int64_t blk = nblk - 1 - job / (v->B * ng), b = job % (v->B * ng) / ng, g = job % ng; /* longest first */
        const tile_view t = tile_of(v);
        const bf_keys kb = block_keys(&bk, v, hg, blk);
        const unsigned fm = kb.path ? gdn_bf16_thread_begin(kb.path) : 0;
        const int R = gather_block(v, &t, b, g, blk, hg, dO, lse, D, kb.path != 0);
        backward_block(v, &t, R, b, g * hg / grp, PAIR_DQ, dq, NULL, NULL, &kb);
        if (kb.path) gdn_bf16_thread_end(kb.path, fm);
    }
    free(bk.p);
}

/* The query blocks of group g that can see keys [u0, u0 + n): [*blo, *bhi). */
static void blocks_seeing(const gdn_attn_core *v, int64_t TB, int64_t u0, int n, int64_t *blo, int64_t *bhi) {
    const int64_t de = gdn_attn_doc_end(v->cu, v->n_docs, u0 + n - 1); /* the end of the last key's document */
    const int64_t t_lo = u0 - v->q0 > 0 ? u0 - v->q0 : 0;
    const int64_t t_hi = de == INT64_MAX || de - v->q0 > v->nq ? v->nq : de - v->q0;
    *blo = t_lo / TB, *bhi = t_lo >= t_hi ? t_lo / TB : (t_hi + TB - 1) / TB;
}

void gdn_attn_core_backward_kv(const gdn_attn_core *v, const float *dO, const float *lse, const float *D,
                               gdn_attn_kv dk, gdn_attn_kv dv) {
    GDN_ASSERT(!v->Kb && !v->Vb);
    const int64_t hg = heads_per_job(v), TB = BQ / hg, ng_kv = v->H / v->Hkv / hg;
    const int64_t nkt = (v->nk + BK - 1) / BK, jobs = v->B * v->Hkv * nkt;
    const bf_keys bk = bf_pack_keys(v, BF_K | BF_V);
#pragma omp parallel for num_threads(v->threads) schedule(dynamic, 1)
    for (int64_t job = 0; job < jobs; job++) {
        const int64_t kt = job / (v->B * v->Hkv), b = job % (v->B * v->Hkv) / v->Hkv, j = job % v->Hkv; /* longest first */
        const int64_t u0 = v->k0 + kt * BK, u = kt * BK;
        const int nt = (int)(v->k0 + v->nk - u0 < BK ? v->k0 + v->nk - u0 : BK);
        int64_t blo, bhi;
        blocks_seeing(v, TB, u0, nt, &blo, &bhi);
        if (blo >= bhi) continue;
        const tile_view t = tile_of(v);
        const float *Ku = v->K.p + b * v->K.bs + j * v->K.hs + u * v->K.ld;
        const float *Vu = v->V.p + b * v->V.bs + j * v->V.hs + u * v->V.ld;
        float *dKu = dk.p + b * dk.bs + j * dk.hs + u * dk.ld, *dVu = dv.p + b * dv.bs + j * dv.hs + u * dv.ld;
        const unsigned fm = bk.path ? gdn_bf16_thread_begin(bk.path) : 0;
        /* the same pairs in the same order as the fused pass: groups, then blocks, ascending */
        for (int64_t g = j * ng_kv; g < (j + 1) * ng_kv; g++)
            for (int64_t blk = blo; blk < bhi; blk++) {
                const bf_keys kb = block_keys(&bk, v, hg, blk);
                const int R = gather_block(v, &t, b, g, blk, hg, dO, lse, D, kb.path != 0);
                int64_t lo, hi;
                key_range(v, &t, R, &lo, &hi);
                if (lo >= hi || u0 < first_tile(v, lo) || u0 >= hi) continue;
                const int n = (int)(hi - u0 < BK ? hi - u0 : BK);
                if (kb.path) bf_pack_block(kb.path, &t, R, v->d, PAIR_DKV);
                backward_pair(v, &t, R, u0, n, Ku, Vu, PAIR_DKV, 1, dKu, dk.ld, dVu, dv.ld, 0, &kb, b, j);
            }
        if (bk.path) gdn_bf16_thread_end(bk.path, fm);
    }
    free(bk.p);
}

/* Whether the fused pass keeps the threads busy: its B Hkv equal jobs against the two passes'
 * 9/7 of the work spread over every block and tile. */
static int fused_pays(const gdn_attn_core *v) {
    const int64_t jobs = v->B * v->Hkv, p = v->threads > 0 ? v->threads : 1;
    const int64_t rounds = (jobs + p - 1) / p;
    return (double)jobs / (double)(rounds * p) >= 0.8;
}

void gdn_attn_core_backward(const gdn_attn_core *v, const float *dO, const float *lse, const float *D, float *dq,
                            gdn_attn_kv dk, gdn_attn_kv dv) {
    GDN_ASSERT(!v->Kb && !v->Vb);
    if (!fused_pays(v)) {
        gdn_attn_core_backward_q(v, dO, lse, D, dq);
        gdn_attn_core_backward_kv(v, dO, lse, D, dk, dv);
        return;
    }
    const int64_t hg = heads_per_job(v), TB = BQ / hg, nblk = (v->nq + TB - 1) / TB, ng_kv = v->H / v->Hkv / hg;
    const int64_t jobs = v->B * v->Hkv;
    const bf_keys bk = bf_pack_keys(v, BF_K | BF_V | BF_KT);
#pragma omp parallel for num_threads(v->threads) schedule(dynamic, 1)
    for (int64_t job = 0; job < jobs; job++) {
        const int64_t b = job / v->Hkv, j = job % v->Hkv;
        const tile_view t = tile_of(v);
        const unsigned fm = bk.path ? gdn_bf16_thread_begin(bk.path) : 0;
        for (int64_t g = j * ng_kv; g < (j + 1) * ng_kv; g++)
            for (int64_t blk = 0; blk < nblk; blk++) {
                const bf_keys kb = block_keys(&bk, v, hg, blk);
                const int R = gather_block(v, &t, b, g, blk, hg, dO, lse, D, kb.path != 0);
                backward_block(v, &t, R, b, j, PAIR_DQ | PAIR_DKV, dq, &dk, &dv, &kb);
            }
        if (bk.path) gdn_bf16_thread_end(bk.path, fm);
    }
    free(bk.p);
}

const char *gdn_attn_core_path(const gdn_attn_core *v) {
#define STR_(x) #x
#define STR(x) STR_(x)
    static const char fused[] = "flash " STR(BQ) "x" STR(BK) " transposed tiles, fused backward (B Hkv jobs), "
                                "micro-kernel " GDN_VL_STR "x" STR(MK_MR) "x" GDN_2VL_STR
                                ", blocks of <= " STR(FEW_ROWS) " rows (decode) by rows";
    static const char two[] = "flash " STR(BQ) "x" STR(BK) " transposed tiles, two-pass backward, "
                              "micro-kernel " GDN_VL_STR "x" STR(MK_MR) "x" GDN_2VL_STR
                              ", blocks of <= " STR(FEW_ROWS) " rows (decode) by rows";
    const char *base = v && !fused_pays(v) ? two : fused;
    if (!v || !v->bf16 || v->Kb) return base;
    static _Thread_local char buf[320];
    const int forced = gdn_test_mutate("attention: the BF16 path of the core"); /* a GDN_BF16_* path; 0: automatic */
    const int path = forced ? forced : gdn_bf16_path_auto();
    snprintf(buf, sizeof buf, "%s; blocks of more rows: products bf16 on %s", base, gdn_bf16_path_name(path));
    return buf;
}
