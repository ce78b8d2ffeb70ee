/* The chunked gated delta rule, one fused loop per (batch row, key head, column block): every
 * chunk is gathered once into the thread's workspace, its key-side products are shared by the
 * value heads of that key head, all products run while the data is hot in L1/L2, and only the
 * K x w states survive to the next chunk (DESIGN §3). */
#include "kernel_internal.h"
#include "microkernel.h"

#include <math.h>
#include <string.h>

/* The key side of chunk rows [t0, t0+n) for key head hk, shared by the value heads that use it:
 * normalised, scaled q (qs) and normalised k (kn) with their row factors (qinv, kinv),
 * kt = kn^T, and the lower triangles of pk = K K^T and qk = Q K^T. */
static void gather_keys(const gdn_plan *p, gdn_chunk_ws *ws, const gdn_chunk_inputs *in, int64_t b,
                        int64_t hk, int64_t t0, int n, int want_out) {
    const gdn_config *c = &p->cfg;
    const int64_t K = c->K, Hk = c->Hk;
    const int C = c->chunk;
    for (int i = 0; i < n; i++) {
        const int64_t row = b * c->T + t0 + i;
        const float *qsrc = in->q + (row * Hk + hk) * K, *ksrc = in->k + (row * Hk + hk) * K;
        if (i + 8 < n) /* rows are pages apart: keep several misses in flight */
            for (int64_t off = 0; off < K; off += 16) {
                __builtin_prefetch(qsrc + 8 * Hk * K + off);
                __builtin_prefetch(ksrc + 8 * Hk * K + off);
            }
        float qinv = c->scale, kinv = 1.0f;
        if (c->l2norm || c->check_finite) {
            /* The squared norms double as the finiteness check of the rows (NaN/Inf -> NaN/Inf). */
            const float sq = gdn_sumsq(qsrc, K), sk = gdn_sumsq(ksrc, K);
            if (c->check_finite && !(sq + sk < INFINITY)) ws->nonfinite = 1;
            if (c->l2norm) qinv = c->scale / sqrtf(sq + 1e-6f), kinv = 1.0f / sqrtf(sk + 1e-6f);
        }
        float *qd = ws->qs + (size_t)i * K, *kd = ws->kn + (size_t)i * K;
        for (int64_t j = 0; j < K; j++) qd[j] = qsrc[j] * qinv, kd[j] = ksrc[j] * kinv;
        ws->qinv[i] = qinv, ws->kinv[i] = kinv;
    }
    gdn_transpose(n, (int)K, ws->kn, (int)K, ws->kt, C);
    gdn_chunk_gemm(ws, GDN_GEMM_C_LOWER, n, n, (int)K, ws->kn, (int)K, ws->kt, C, ws->pk, C);
    if (want_out) gdn_chunk_gemm(ws, GDN_GEMM_C_LOWER, n, n, (int)K, ws->qs, (int)K, ws->kt, C, ws->qk, C);
}

/* The value-head side: gates, betas; G = in-chunk cumulative gate, eg = exp(G),
 * egd = exp(Gc - G), ew = exp(G_i - G_j) for j <= i. */
static void gather_gates(const gdn_plan *p, gdn_chunk_ws *ws, const gdn_chunk_inputs *in, int64_t b,
                         int64_t h, int64_t t0, int n) {
    const gdn_config *c = &p->cfg;
    const int64_t Hv = c->Hv;
    for (int i = 0; i < n; i++) {
        const int64_t row = b * c->T + t0 + i;
        ws->g[i] = in->g[row * Hv + h];
        ws->beta[i] = in->beta[row * Hv + h];
        if (!(ws->g[i] * 0.0f == 0.0f && ws->beta[i] * 0.0f == 0.0f)) ws->nonfinite = 1;
    }
    double G = 0.0;
    for (int i = 0; i < n; i++) ws->G[i] = G += ws->g[i];
    for (int i = 0; i < n; i++) {
        ws->eg[i] = gdn_expf_ftz((float)ws->G[i]);
        ws->egd[i] = gdn_expf_ftz((float)(G - ws->G[i]));
    }
    /* Decays between rows, masked (j <= i) before exponentiating; shared by L and the output. */
    const int C = c->chunk;
    typedef double vd __attribute__((vector_size(GDN_VL * 8)));
    typedef double vd_u __attribute__((vector_size(GDN_VL * 8), aligned(8)));
    for (int i = 0; i < n; i++) {
        float *ei = ws->ew + (size_t)i * C;
        const double Gi = ws->G[i];
        int j = 0;
        for (; j + GDN_VL <= i + 1; j += GDN_VL) { /* the difference in double, then exp in fp32 */
            const vd d = Gi - *(const vd_u *)(ws->G + j);
            gdn_vstoreu(ei + j, gdn_vexpf_ftz(__builtin_convertvector(d, gdn_vf)));
        }
        if (j <= i && j + GDN_VL <= C) { /* the diagonal's vector, its lanes past i exp(-1e30) = 0 */
            gdn_vf d;
            for (int l = 0; l < GDN_VL; l++) d[l] = j + l <= i ? (float)(Gi - ws->G[j + l]) : -1e30f;
            gdn_vstoreu(ei + j, gdn_vexpf_ftz(d));
            j = i + 1;
        }
        for (; j <= i; j++) ei[j] = gdn_expf_ftz((float)(Gi - ws->G[j]));
    }
}

/* Rows of the next chunk are 8 KB+ apart in the BTHD layout (one page each): the hardware
 * prefetcher does not follow them, so ask for them while this chunk computes. */
static void prefetch_row(const gdn_plan *p, const gdn_chunk_inputs *in, int64_t b, int64_t h,
                         int64_t t) {
    const gdn_config *c = &p->cfg;
    const int64_t K = c->K, V = c->V, Hk = c->Hk, Hv = c->Hv, hk = h / (Hv / Hk);
    {
        const int64_t row = b * c->T + t;
        const char *q = (const char *)(in->q + (row * Hk + hk) * K),
                   *k = (const char *)(in->k + (row * Hk + hk) * K),
                   *v = in->v ? (const char *)(in->v + (row * Hv + h) * V) : NULL;
        for (int64_t off = 0; off < K * 4; off += 64) {
            __builtin_prefetch(q + off, 0, 2);
            __builtin_prefetch(k + off, 0, 2);
        }
        for (int64_t off = 0; in->v && off < V * 4; off += 64) __builtin_prefetch(v + off, 0, 2);
        __builtin_prefetch(in->g + row * Hv + h, 0, 2); /* a line per row too (Hv floats apart) */
        __builtin_prefetch(in->beta + row * Hv + h, 0, 2);
    }
}

/* The solve's vectors: blas's native width (gdn_vf: 16 lanes with AVX-512, 8 with AVX), four to
 * a group of columns, so that a group's two sums per vector (even and odd m: independent FMA
 * chains, the latency hidden) stay in registers; 16-lane vectors on an AVX2 build spilled them to
 * the stack (the solve was a third of gdn_chunk_prepare there). */
typedef gdn_vf solve_vec;
typedef gdn_vf_u solve_vec_u;
enum { SOLVE_LANES = (int)(sizeof(solve_vec) / sizeof(float)), SOLVE_GROUP = 4 * SOLVE_LANES };

/* Columns [cb, cb + nv lanes) of row i: -sum_{cb <= m < i} L_im row_m. Rows m < cb are zero in
 * these columns (tm is lower triangular), so the sum starts at m = cb. */
static inline __attribute__((always_inline)) void solve_columns(const float *tm, const float *li, int C,
                                                                int cb, int i, int nv, float *ti) {
    solve_vec a[4] = {{0}}, b[4] = {{0}};
    int m = cb;
    for (; m + 1 < i; m += 2) {
        const float f0 = li[m], f1 = li[m + 1];
        const float *r0 = tm + (size_t)m * C + cb, *r1 = r0 + C;
        for (int v = 0; v < nv; v++) {
            a[v] += f0 * *(const solve_vec_u *)(r0 + SOLVE_LANES * v);
            b[v] += f1 * *(const solve_vec_u *)(r1 + SOLVE_LANES * v);
        }
    }
    if (m < i) {
        const float f = li[m];
        const float *r = tm + (size_t)m * C + cb;
        for (int v = 0; v < nv; v++) a[v] += f * *(const solve_vec_u *)(r + SOLVE_LANES * v);
    }
    for (int v = 0; v < nv; v++) *(solve_vec_u *)(ti + cb + SOLVE_LANES * v) = -(a[v] + b[v]);
}

/* tm = (I + L)^-1 with L_ij = beta_i (k_i.k_j) exp(G_i - G_j), i > j, by forward substitution.
 * pk holds k_i.k_j for j <= i and is left as it is (the backward needs it); L is formed row by
 * row from the masked decays in ew. */
static void invert_unit_lower(gdn_chunk_ws *ws, int n, int C, const gdn_plan *p,
                              const gdn_chunk_inputs *in, int64_t b, int64_t h, int64_t next_t0) {
    float *tm = ws->tm, *li = ws->lrow;
    /* (tests: the correction skipped, tm = I, must be caught against the oracle) */
    const int skip = gdn_test_mutate("chunk: (I + L)^-1 replaced by I");
    for (int i = 0; i < n; i++) {
        /* One row of the next chunk per row of work: spread out, the prefetches all land. */
        if (next_t0 + i < p->cfg.T) prefetch_row(p, in, b, h, next_t0 + i);
        const float *ki = ws->pk + (size_t)i * C, *ei = ws->ew + (size_t)i * C;
        for (int j = 0; j < i; j++) li[j] = skip ? 0.0f : ws->beta[i] * ki[j] * ei[j];
        /* Row i = e_i - sum_{m<i} L_im row_m over whole groups of columns (rows of tm are zero
         * past their diagonal; C is a multiple of 16, so a group's tail is 1 or 2 vectors). */
        float *ti = tm + (size_t)i * C;
        for (int cb = 0; cb < C; cb += SOLVE_GROUP) {
            const int nv = C - cb < SOLVE_GROUP ? (C - cb) / SOLVE_LANES : 4;
            if (nv == 4) solve_columns(tm, li, C, cb, i, 4, ti);
            else if (nv == 2) solve_columns(tm, li, C, cb, i, 2, ti);
            else solve_columns(tm, li, C, cb, i, 1, ti);
        }
        ti[i] = 1.0f;
    }
}

void gdn_chunk_prepare(const gdn_plan *p, gdn_chunk_ws *ws, const gdn_chunk_inputs *in, int64_t b,
                       int64_t h, int64_t t0, int n, int want_out, int keys_ready) {
    const gdn_config *c = &p->cfg;
    const int C = c->chunk, K = (int)c->K;
    if (!keys_ready) gather_keys(p, ws, in, b, h / (c->Hv / c->Hk), t0, n, want_out);
    gather_gates(p, ws, in, b, h, t0, n);

    /* -W = (I+L)^-1 (-diag(beta eG) K)  ->  rows 0..n-1 of xw. Kept negated so that the
     * backward's state gradient dS += Qe^T dO - W^T dDl is one product [-W ; Qe]^T [dDl ; dO]. */
    invert_unit_lower(ws, n, C, p, in, b, h, t0 + C);
    for (int i = 0; i < n; i++) {
        const float f = -ws->beta[i] * ws->eg[i];
        for (int j = 0; j < K; j++) ws->rk[(size_t)i * K + j] = f * ws->kn[(size_t)i * K + j];
    }
    gdn_chunk_gemm(ws, GDN_GEMM_A_LOWER, n, K, n, ws->tm, C, ws->rk, K, ws->xw, K);
    if (!want_out) return;
    /* Rows n..2n-1 of xw: diag(eG) Q, so one product [-W ; diag(eG) Q] S serves both. */
    for (int i = 0; i < n; i++) {
        float *dst = ws->xw + (size_t)(n + i) * K;
        const float *qs = ws->qs + (size_t)i * K;
        for (int j = 0; j < K; j++) dst[j] = ws->eg[i] * qs[j];
    }
    /* A = Q K^T . E . M (lower, diagonal included); the scale is already inside Q. */
    for (int i = 0; i < n; i++) {
        float *ai = ws->am + (size_t)i * C;
        const float *ei = ws->ew + (size_t)i * C, *qi = ws->qk + (size_t)i * C;
        for (int j = 0; j <= i; j++) ai[j] = qi[j] * ei[j];
        for (int j = i + 1; j < C; j++) ai[j] = 0.0f;
    }
}

void gdn_chunk_values(const gdn_plan *p, gdn_chunk_ws *ws, const gdn_chunk_inputs *in, int64_t b,
                      int64_t h, int64_t t0, int n, int c0, int w, int want_out, const float *S) {
    const gdn_config *c = &p->cfg;
    const int C = c->chunk, K = (int)c->K, V = (int)c->V;
    const int vcols = V - c0 < w ? (V - c0 > 0 ? V - c0 : 0) : w; /* value columns in block */
    /* U = (I+L)^-1 diag(beta) V over this block's columns (zero past V). */
    for (int i = 0; i < n; i++) {
        float *rv = ws->rv + (size_t)i * w;
        if (vcols > 0) {
            const float *vsrc = in->v + ((b * c->T + t0 + i) * c->Hv + h) * V + c0;
            if (i + 8 < n)
                for (int off = 0; off < vcols; off += 16) __builtin_prefetch(vsrc + 8 * c->Hv * V + off);
            if (c->check_finite && gdn_row_nonfinite(vsrc, vcols)) ws->nonfinite = 1;
            for (int j = 0; j < vcols; j++) rv[j] = ws->beta[i] * vsrc[j];
        }
        for (int j = vcols; j < w; j++) rv[j] = 0.0f;
    }
    gdn_chunk_gemm(ws, GDN_GEMM_A_LOWER, n, w, n, ws->tm, C, ws->rv, w, ws->u, w);
    /* m2 = [-W ; diag(eG) Q] S; Dl = U - W S overwrites u. */
    gdn_chunk_gemm(ws, 0, want_out ? 2 * n : n, w, K, ws->xw, K, S, w, ws->m2, w);
    for (int64_t i = 0; i < (int64_t)n * w; i++) ws->u[i] += ws->m2[i];
}

void gdn_chunk_update_state(const gdn_plan *p, gdn_chunk_ws *ws, int n, int w, float *S) {
    const int C = p->cfg.chunk, K = (int)p->cfg.K;
    /* S' = exp(Gc) S + Kd^T Dl, Kd = diag(exp(Gc - G)) K */
    for (int j = 0; j < K; j++) { /* kdt = kt diag(egd): row by row, no scattered writes */
        const float *kt = ws->kt + (size_t)j * C;
        float *kd = ws->kdt + (size_t)j * C;
        for (int i = 0; i < n; i++) kd[i] = kt[i] * ws->egd[i];
    }
    const float egc = ws->eg[n - 1];
    for (int64_t i = 0; i < (int64_t)K * w; i++) S[i] *= egc;
    gdn_chunk_gemm(ws, GDN_GEMM_ACC, K, w, n, ws->kdt, C, ws->u, w, S, w);
    if (gdn_test_mutate("chunk: the state kept in bf16"))
        for (int64_t i = 0; i < (int64_t)K * w; i++) S[i] = gdn_bf16_to_f32(gdn_f32_to_bf16(S[i]));
}

void gdn_chunk_stream(const gdn_plan *p, gdn_chunk_ws *ws, const gdn_chunk_inputs *in, int64_t b,
                      int64_t h, int nheads, int c0, int w, int64_t t_begin, int64_t t_end,
                      float *o) {
    const gdn_config *c = &p->cfg;
    const int C = c->chunk, K = (int)c->K, V = (int)c->V;
    const int64_t T = c->T, Hv = c->Hv;
    const int vcols = V - c0 < w ? (V - c0 > 0 ? V - c0 : 0) : w;
    for (int64_t t0 = t_begin; t0 < t_end; t0 += C) {
        const int n = t_end - t0 < C ? (int)(t_end - t0) : C;
        /* The value heads of one key head share the key side of the chunk. */
        for (int j = 0; j < nheads; j++) {
            float *S = ws->state + (size_t)j * K * w;
            gdn_chunk_prepare(p, ws, in, b, h + j, t0, n, o != NULL, j > 0);
            gdn_chunk_values(p, ws, in, b, h + j, t0, n, c0, w, o != NULL, S);
            if (o) {
                /* O = eG Q S + A Dl */
                float *oc = ws->m2 + (size_t)n * w;
                gdn_chunk_gemm(ws, GDN_GEMM_ACC | GDN_GEMM_A_LOWER, n, w, n, ws->am, C, ws->u, w, oc, w);
                for (int i = 0; i < n; i++)
                    memcpy(o + ((b * T + t0 + i) * Hv + h + j) * V + c0, oc + (size_t)i * w,
                           sizeof(float) * vcols);
                if (c->check_finite && gdn_row_nonfinite(oc, (int64_t)n * w)) ws->nonfinite = 1;
            }
            gdn_chunk_update_state(p, ws, n, w, S);
        }
    }
}
