/* The decode step (T = 1): one token of the gated delta rule for every (batch row, value head),
 * the state updated in place, no chunk machinery and nothing allocated.
 *
 * Per stream (DESIGN §2, with kn, qs the normalised key and the scaled query, e = exp(g)):
 *     u = S^T kn,  w = S^T qs                   (first sweep: reads the old state)
 *     d = beta (v - e u)                        (the delta uses the decayed state: (eS)^T kn = e u)
 *     S <- e S + kn d^T                         (second sweep: read-modify-write)
 *     o = S_new^T qs = e w + (kn . qs) d        (no third sweep for the output)
 * u needs every row before any row can be updated, so each element is visited twice; what
 * matters is that the second visit hits a cache and not memory. The columns of S are independent
 * in all four lines, so the state is swept in column blocks of STEP_NB vectors (W = 64 columns,
 * a 32 KB block at K = 128): a block's u, w, d stay in registers, and the update runs over the
 * rows in reverse, starting with those the first sweep read last. A block of a 512-byte-row state
 * only maps to half of the L1 sets, so at most 3/4 of it (48 KB L1, 64 KB head) is still in L1
 * when the update starts; the rest comes again from L2. Traffic beyond L2 is therefore one read
 * and one write of the state, the minimum for an in-place update; in L2 about 1.1x that.
 * When V is a multiple of W the blocks are software-pipelined (step_range_pipelined). */
#include "kernel_internal.h"

#include <math.h>
#include <unistd.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__)
#define VW 16 /* lanes of one vector */
#else
#define VW 8
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vf_u __attribute__((vector_size(VW * 4), aligned(4))); /* unaligned access */

/* Tuning (measured with `gdncp bench decode` on a Xeon with AVX-512, 48 KB L1, 2 MB L2): vectors
 * per column block (2, 4, 8 tried: 4 best; 8 needs 32 registers), and the software prefetch into
 * L2 of the block STEP_PFD ahead (locality STEP_PF; 0: none; distances 1-6 tried: 2-3 best). */
#ifndef STEP_NB
#define STEP_NB 4
#endif
#ifndef STEP_PF
#define STEP_PF 2
#endif
#ifndef STEP_PFD
#define STEP_PFD 2
#endif

typedef struct {
    const float *kn, *qs; /* K each */
    float e, beta, kq;    /* exp(g), beta, kn . qs */
    int64_t K, V;
} head_args;

/* Columns [c, c + nb*VW) of one stream. nf accumulates x*0 over the written state and the output:
 * NaN exactly when one of them is NaN or Inf. */
static inline __attribute__((always_inline)) void col_block(const head_args *a, float *S,
                                                             float *o, const float *v, int64_t c,
                                                             const int nb, vf *nf) {
    const int64_t K = a->K, V = a->V;
    vf u[STEP_NB], w[STEP_NB], d[STEP_NB], z[STEP_NB]; /* z: one x*0 chain per vector (a single
                                                       chain would be latency-bound) */
#pragma GCC unroll 8
    for (int n = 0; n < nb; n++) u[n] = (vf){0}, w[n] = (vf){0}, z[n] = (vf){0};
    for (int64_t i = 0; i < K; i++) {
        const float *row = S + i * V + c;
        const float ki = a->kn[i], qi = a->qs[i];
#pragma GCC unroll 8
        for (int n = 0; n < nb; n++) {
            const vf x = *(const vf_u *)(row + n * VW);
            u[n] += ki * x;
            w[n] += qi * x;
        }
    }
    const float e = a->e, beta = a->beta, kq = a->kq;
#pragma GCC unroll 8
    for (int n = 0; n < nb; n++) {
        d[n] = beta * (*(const vf_u *)(v + c + n * VW) - e * u[n]);
        const vf out = e * w[n] + kq * d[n];
        *(vf_u *)(o + c + n * VW) = out;
        *nf += out * 0.0f;
    }
    /* Rows in reverse: the last rows the first sweep read are the ones still in L1. */
    for (int64_t i = K - 1; i >= 0; i--) {
        float *row = S + i * V + c;
        const float ki = a->kn[i];
#pragma GCC unroll 8
        for (int n = 0; n < nb; n++) {
            const vf x = e * *(vf_u *)(row + n * VW) + ki * d[n];
            *(vf_u *)(row + n * VW) = x;
            z[n] += x * 0.0f;
        }
    }
#pragma GCC unroll 8
    for (int n = 0; n < nb; n++) *nf += z[n];
}

/* The last V % VW columns, one at a time. */
static void col_tail(const head_args *a, float *S, float *o, const float *v, int64_t c,
                     float *nf) {
    const int64_t K = a->K, V = a->V;
    for (; c < V; c++) {
        float u = 0.0f, w = 0.0f;
        for (int64_t i = 0; i < K; i++) u += a->kn[i] * S[i * V + c], w += a->qs[i] * S[i * V + c];
        const float d = a->beta * (v[c] - a->e * u);
        o[c] = a->e * w + a->kq * d;
        *nf += o[c] * 0.0f;
        for (int64_t i = 0; i < K; i++) {
            S[i * V + c] = a->e * S[i * V + c] + a->kn[i] * d;
            *nf += S[i * V + c] * 0.0f;
        }
    }
}

/* The kernel's name for benchmarks (not in the public header; tools/cmd_bench_decode.c). */
const char *gdn_step_path(void);
const char *gdn_step_path(void) {
#define STEP_STR2(x) #x
#define STEP_STR(x) STEP_STR2(x)
    return "gdn_step " STEP_STR(VW) "-lane vectors, column blocks of " STEP_STR(STEP_NB) " vectors";
}

/* One stream's key side: kn, qs, and the scalars of its update. */
typedef struct {
    float kn[GDN_MAX_HEAD_DIM], qs[GDN_MAX_HEAD_DIM];
    float e, beta, kq;
} head_prep;

static void prep_head(const gdn_config *c, head_prep *h, const float *q, const float *k, float g,
                      float beta) {
    const int64_t K = c->K;
    float kinv = 1.0f, qinv = c->scale;
    if (c->l2norm) {
        kinv = 1.0f / sqrtf(gdn_sumsq(k, K) + 1e-6f);
        qinv = c->scale / sqrtf(gdn_sumsq(q, K) + 1e-6f);
    }
    gdn_vf acc = {0};
    int64_t i = 0;
    for (; i + GDN_VL <= K; i += GDN_VL) {
        const gdn_vf kv = gdn_vloadu(k + i) * kinv, qv = gdn_vloadu(q + i) * qinv;
        gdn_vstoreu(h->kn + i, kv), gdn_vstoreu(h->qs + i, qv);
        acc += kv * qv;
    }
    float kq = gdn_vhsum(acc);
    for (; i < K; i++) h->kn[i] = k[i] * kinv, h->qs[i] = q[i] * qinv, kq += h->kn[i] * h->qs[i];
    h->e = gdn_expf_ftz(g), h->beta = beta, h->kq = kq;
}

/* Inputs of a range of streams. */
typedef struct {
    const gdn_config *c;
    float *state, *o;
    const float *q, *k, *v, *g, *beta;
} step_io;

static void prep_item(const step_io *io, head_prep *h, int64_t it) {
    const gdn_config *c = io->c;
    const int64_t b = it / c->Hv, hk = it % c->Hv / (c->Hv / c->Hk), row = (b * c->Hk + hk) * c->K;
    prep_head(c, h, io->q + row, io->k + row, io->g[it], io->beta[it]);
}

/* One stream, any V (column blocks, then single vectors, then scalar columns); returns 1 when
 * the written state or output is non-finite. */
static int step_head(const step_io *io, int64_t it) {
    const gdn_config *c = io->c;
    const int64_t K = c->K, V = c->V;
    head_prep h;
    prep_item(io, &h, it);
    const head_args a = {h.kn, h.qs, h.e, h.beta, h.kq, K, V};
    float *S = io->state + it * K * V, *o = io->o + it * V;
    const float *v = io->v + it * V;
    vf nf = {0};
    int64_t col = 0;
    for (; col + STEP_NB * VW <= V; col += STEP_NB * VW) col_block(&a, S, o, v, col, STEP_NB, &nf);
    for (; col + VW <= V; col += VW) col_block(&a, S, o, v, col, 1, &nf);
    float s = 0.0f;
    if (col < V) col_tail(&a, S, o, v, col, &s);
    for (int l = 0; l < VW; l++) s += nf[l];
    return s != s;
}

/* A stream's key side without copies: its raw k, q rows and the scalars that normalise them
 * (kn = kinv k, qs = qinv q; qinv includes the scale), kq = kn . qs. */
typedef struct {
    const float *k, *q;
    float kinv, qinv, e, beta, kq;
} head_lite;

static void prep_lite(const step_io *io, head_lite *h, int64_t it) {
    const gdn_config *c = io->c;
    const int64_t K = c->K, b = it / c->Hv, hk = it % c->Hv / (c->Hv / c->Hk);
    const float *k = io->k + (b * c->Hk + hk) * K, *q = io->q + (b * c->Hk + hk) * K;
    gdn_vf kk = {0}, qq = {0}, kq = {0};
    int64_t i = 0;
    for (; i + GDN_VL <= K; i += GDN_VL) {
        const gdn_vf kv = gdn_vloadu(k + i), qv = gdn_vloadu(q + i);
        kk += kv * kv, qq += qv * qv, kq += kv * qv;
    }
    float skk = 0, sqq = 0, skq = 0;
    for (int l = 0; l < GDN_VL; l++) skk += kk[l], sqq += qq[l], skq += kq[l];
    for (; i < K; i++) skk += k[i] * k[i], sqq += q[i] * q[i], skq += k[i] * q[i];
    h->k = k, h->q = q;
    h->kinv = c->l2norm ? 1.0f / sqrtf(skk + 1e-6f) : 1.0f;
    h->qinv = c->scale * (c->l2norm ? 1.0f / sqrtf(sqq + 1e-6f) : 1.0f);
    h->kq = h->kinv * h->qinv * skq;
    h->e = gdn_expf_ftz(io->g[it]), h->beta = io->beta[it];
}

/* Streams [it0, it1) when V is a multiple of the block width W = STEP_NB vectors, software-
 * pipelined over the sequence of blocks (stream by stream, W columns at a time): one loop over
 * the rows runs the update of block m (rows in reverse, mostly L1 hits) together with the first
 * sweep of block m + 1 (streamed in), and with pf set prefetches block m + STEP_PFD into L2. The
 * first sweep's loads then overlap the update's arithmetic, and the state streams without
 * pauses (pipelining: B = 8 from 75 % to 85-90 % of the in-place stream). With V = 2W (the
 * Qwen head) the blocks m and m + 1 are the two column halves of the 512-byte rows, which fall in
 * disjoint halves of the L1 sets, so they do not evict each other. */
static int step_range_pipelined(const step_io *io, int64_t it0, int64_t it1, int pf) {
    const gdn_config *c = io->c;
    const int64_t K = c->K, V = c->V, W = STEP_NB * VW, nb = V / W, M = (it1 - it0) * nb;
    if (M <= 0) return 0;
    /* The sweeps use the raw rows k, q: u = S^T kn = kinv S^T k, and S + kn d^T = S + k (kinv d)^T. */
    head_lite hl[2]; /* streams alternate between the two */
    vf u[STEP_NB], w[STEP_NB], d[STEP_NB], z[STEP_NB];
#pragma GCC unroll 8
    for (int n = 0; n < STEP_NB; n++) u[n] = w[n] = z[n] = (vf){0};
    prep_lite(io, &hl[0], it0);
    { /* the first sweep of block 0 alone */
        const float *S = io->state + it0 * K * V;
        for (int64_t i = 0; i < K; i++) {
            const float ki = hl[0].k[i], qi = hl[0].q[i];
#pragma GCC unroll 8
            for (int n = 0; n < STEP_NB; n++) {
                const vf x = *(const vf_u *)(S + i * V + n * VW);
                u[n] += ki * x, w[n] += qi * x;
            }
        }
    }
    vf nfo = {0};
    for (int64_t m = 0; m < M; m++) {
        const int64_t it = it0 + m / nb, col = m % nb * W;
        const head_lite *h = &hl[(it - it0) & 1];
        float *S = io->state + it * K * V + col;
        const float *v = io->v + it * V + col;
        float *o = io->o + it * V + col;
        const float e = h->e, beta = h->beta, kq = h->kq, kinv = h->kinv, qinv = h->qinv;
        const float *kr = h->k;
#pragma GCC unroll 8
        for (int n = 0; n < STEP_NB; n++) {
            const vf dn = beta * (*(const vf_u *)(v + n * VW) - (e * kinv) * u[n]);
            const vf out = (e * qinv) * w[n] + kq * dn;
            *(vf_u *)(o + n * VW) = out;
            nfo += out * 0.0f;
            d[n] = kinv * dn;
            u[n] = w[n] = (vf){0};
        }
        if (m + 1 < M) {
            const int64_t itn = it0 + (m + 1) / nb, coln = (m + 1) % nb * W;
            head_lite *h1 = &hl[(itn - it0) & 1];
            if (coln == 0) prep_lite(io, h1, itn);
            const float *S1 = io->state + itn * K * V + coln, *k1 = h1->k, *q1 = h1->q;
            /* block m + STEP_PFD into L2, never past this thread's range (lines another
             * thread is writing would bounce between the cores) */
            const int64_t m2 = m + STEP_PFD < M ? m + STEP_PFD : m + 1;
            const float *S2 = io->state + (it0 + m2 / nb) * K * V + m2 % nb * W;
            (void)S2;
            for (int64_t i = 0; i < K; i++) {
                const int64_t r = K - 1 - i;
                const float kb = kr[r], ki = k1[i], qi = q1[i];
#if STEP_PF
                if (pf)
#pragma GCC unroll 8
                    for (int n = 0; n < W; n += 16) __builtin_prefetch(S2 + i * V + n, 0, STEP_PF);
#endif
#pragma GCC unroll 8
                for (int n = 0; n < STEP_NB; n++) {
                    const vf x = e * *(vf_u *)(S + r * V + n * VW) + kb * d[n];
                    *(vf_u *)(S + r * V + n * VW) = x;
                    z[n] += x * 0.0f;
                    const vf y = *(const vf_u *)(S1 + i * V + n * VW);
                    u[n] += ki * y, w[n] += qi * y;
                }
            }
        } else {
            for (int64_t r = K - 1; r >= 0; r--) {
                const float kb = kr[r];
#pragma GCC unroll 8
                for (int n = 0; n < STEP_NB; n++) {
                    const vf x = e * *(vf_u *)(S + r * V + n * VW) + kb * d[n];
                    *(vf_u *)(S + r * V + n * VW) = x;
                    z[n] += x * 0.0f;
                }
            }
        }
    }
#pragma GCC unroll 8
    for (int n = 0; n < STEP_NB; n++) nfo += z[n];
    float s = 0.0f;
    for (int l = 0; l < VW; l++) s += nfo[l];
    return s != s;
}

/* Streams [it0, it1) of the step. */
static int step_range(const step_io *io, int64_t it0, int64_t it1, int pf) {
    if (io->c->V % (STEP_NB * VW) == 0) return step_range_pipelined(io, it0, it1, pf);
    int bad = 0;
    for (int64_t it = it0; it < it1; it++) bad |= step_head(io, it);
    return bad;
}

/* This core's L2 in bytes (1 MB when the system does not say). */
static double l2_bytes(void) {
    static long cached = 0;
    long v = cached;
    if (!v) {
#ifdef _SC_LEVEL2_CACHE_SIZE
        v = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
        if (v <= 0) v = 1 << 20;
        cached = v;
    }
    return (double)v;
}

/* The first non-finite element of a small input tensor, or -1 (inline: no parallel region). */
static int64_t find_nonfinite(const float *x, int64_t n) {
    if (!gdn_row_nonfinite(x, n)) return -1;
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return i;
    return -1;
}

/* The non-finite check of q or k: with the L2 norm, a row's squared norm (NaN or Inf when an
 * element is, and Inf when a finite row overflows it); without, the elements. */
static int check_keys(const char *name, const float *x, int64_t rows, int64_t K, int l2norm) {
    int64_t at = -1;
    if (l2norm) {
        int64_t r = 0;
        while (r < rows && isfinite(gdn_sumsq(x + r * K, K))) r++;
        if (r == rows) return GDN_OK;
        at = find_nonfinite(x + r * K, K);
        if (at < 0)
            return gdn_fail(GDN_ERR_NONFINITE,
                            "input '%s' row %lld has a squared norm that overflows fp32 (|x| > 1e19)",
                            name, (long long)r);
        at += r * K;
    } else if ((at = find_nonfinite(x, rows * K)) < 0)
        return GDN_OK;
    return gdn_fail_nonfinite("input", name, (double)x[at], at);
}

static int check_small(const char *name, const float *x, int64_t n, int check_finite) {
    if (!x) return gdn_fail(GDN_ERR_ARG, "input '%s' is NULL", name);
    const int64_t at = check_finite ? find_nonfinite(x, n) : -1;
    if (at >= 0)
        return gdn_fail_nonfinite("input", name, (double)x[at], at);
    return GDN_OK;
}

int gdn_step(gdn_plan *p, float *o, float *state, const gdn_rule_inputs *in) {
    if (!p) return gdn_fail(GDN_ERR_ARG, "plan is NULL");
    if (!o) return gdn_fail(GDN_ERR_ARG, "output 'o' is NULL");
    if (!state) return gdn_fail(GDN_ERR_ARG, "'state' is NULL");
    if (!in) return gdn_fail(GDN_ERR_ARG, "inputs 'in' (gdn_rule_inputs) is NULL");
    if (in->h0)
        return gdn_fail(GDN_ERR_ARG, "input 'h0' is not read by gdn_step (the state is updated in place in "
                        "'state'): pass h0 NULL");
    const float *q = in->q, *k = in->k, *v = in->v, *g = in->g, *beta = in->beta;
    const gdn_config *c = &p->cfg;
    const int64_t B = c->B, Hk = c->Hk, Hv = c->Hv, K = c->K, V = c->V;
    int rc;
    if ((rc = check_small("q", q, 0, 0)) || (rc = check_small("k", k, 0, 0)) ||
        (rc = check_small("v", v, B * Hv * V, c->check_finite)) ||
        (rc = check_small("g", g, B * Hv, c->check_finite)) ||
        (rc = check_small("beta", beta, B * Hv, c->check_finite)))
        return rc;
    /* All checks on the token's inputs (B (2 Hk K + Hv (V + 2)) floats, under 1 % of the state)
     * come before the state is touched, so a rejected step leaves it unchanged. */
    if (c->check_finite && ((rc = check_keys("q", q, B * Hk, K, c->l2norm)) ||
                            (rc = check_keys("k", k, B * Hk, K, c->l2norm))))
        return rc;
    const step_io io = {c, state, o, q, k, v, g, beta};
    const int64_t items = B * Hv;
    /* Software prefetch only when a thread's share of the state is well beyond its L2: there
     * it keeps the L3/DRAM stream busy while a block is updated (B = 8 at the Qwen shape: +15 %);
     * on L2-resident states the prefetches are pure overhead (-10 %, measured). */
    const int nt = gdn_threads_for_bytes((int)(p->threads < items ? p->threads : items),
                                         (double)items * K * V * sizeof(float));
    const int pf = (double)items * K * V * sizeof(float) / nt > 2.0 * l2_bytes();
    int bad = 0;
    if (nt > 1) {
        /* Contiguous ranges of streams, one per thread: each thread's state is one stream of
         * memory for its pipeline. */
#pragma omp parallel num_threads(nt) reduction(| : bad)
        {
            /* split by the team actually delivered (nested or dynamic teams may be smaller) */
#ifdef _OPENMP
            const int t = omp_get_thread_num(), n = omp_get_num_threads();
#else
            const int t = 0, n = 1;
#endif
            const gdn_fpmode fm = gdn_fp_fast_begin();
            bad |= step_range(&io, items * t / n, items * (t + 1) / n, pf);
            gdn_fp_fast_end(fm);
        }
    } else {
        const gdn_fpmode fm = gdn_fp_fast_begin();
        bad = step_range(&io, 0, items, pf);
        gdn_fp_fast_end(fm);
    }
    if (bad && c->check_finite) {
        int64_t at = gdn_find_nonfinite_f32(state, items * K * V, p->threads);
        const char *name = at >= 0 ? "state" : "o";
        if (at < 0) at = gdn_find_nonfinite_f32(o, items * V, p->threads);
        return gdn_fail(GDN_ERR_NONFINITE,
                        "output '%s' is non-finite at flat index %lld after the step (overflow: are "
                        "gates g > 0 or keys unnormalised?)",
                        name, (long long)at);
    }
    return GDN_OK;
}
