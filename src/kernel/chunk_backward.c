/* The chunked backward (DESIGN §3), one (batch row, key head) per work item so that the value
 * heads sharing a key head accumulate their dq, dk rows without races. Memory: the state is kept
 * only every N chunks (checkpoints). A segment's forward re-sweep from its checkpoint forms each
 * chunk's intermediates (W, U, T, A, Dl, ...) once and keeps them in per-thread chunk records,
 * which the segment's backward then reads: nothing of size T x (anything) is kept beyond the
 * caller's gradients, and nothing is computed twice within a segment. */
#include "kernel_internal.h"

#include <math.h>
#include <string.h>

static size_t key_record_floats(const gdn_config *c) {
    const size_t C = (size_t)c->chunk, K = (size_t)c->K, r16 = 15;
    return 2 * ((C * K + r16) & ~r16) + ((C * C + r16) & ~r16) + 2 * ((C + r16) & ~r16);
}

static size_t head_record_floats(const gdn_config *c) {
    const size_t C = (size_t)c->chunk, K = (size_t)c->K, V = (size_t)c->V, r16 = 15;
    return 3 * ((C * C + r16) & ~r16) + ((2 * C * K + r16) & ~r16) + ((C * K + r16) & ~r16) +
           2 * ((C * V + r16) & ~r16) + 4 * ((C + r16) & ~r16) + ((2 * C + r16) & ~r16);
}

size_t gdn_chunk_record_floats(const gdn_config *c) {
    return key_record_floats(c) + (size_t)(c->Hv / c->Hk) * head_record_floats(c);
}

/* The workspace as seen by the chunk phases, with the pieces a chunk's backward needs placed in
 * record `slot`, value head j: prepare and values write them there, the backward reads them. */
static gdn_chunk_ws record_view(const gdn_plan *p, const gdn_chunk_ws *ws, const gdn_bwd_ws *bw,
                                int64_t slot, int64_t j) {
    const gdn_config *c = &p->cfg;
    const size_t C = (size_t)c->chunk, K = (size_t)c->K, V = (size_t)c->V;
    gdn_chunk_ws v = *ws;
    float *cur = bw->rec + slot * gdn_chunk_record_floats(c);
    v.qs = gdn_carve(&cur, C * K), v.kn = gdn_carve(&cur, C * K), v.pk = gdn_carve(&cur, C * C);
    v.qinv = gdn_carve(&cur, C), v.kinv = gdn_carve(&cur, C);
    cur += j * head_record_floats(c);
    v.tm = gdn_carve(&cur, C * C), v.am = gdn_carve(&cur, C * C), v.ew = gdn_carve(&cur, C * C);
    v.xw = gdn_carve(&cur, 2 * C * K), v.rk = gdn_carve(&cur, C * K);
    v.rv = gdn_carve(&cur, C * V), v.u = gdn_carve(&cur, C * V);
    v.g = gdn_carve(&cur, C), v.beta = gdn_carve(&cur, C), v.eg = gdn_carve(&cur, C);
    v.egd = gdn_carve(&cur, C), v.G = (double *)gdn_carve(&cur, 2 * C);
    return v;
}

/* Ask for the record of the item the backward takes next (value head j of slot; with states,
 * also the key side of the slot and those entry states) while this one computes: records
 * were written a whole segment ago and are out of L2. */
static void prefetch_record(const gdn_plan *p, const gdn_bwd_ws *bw, int64_t slot, int64_t j,
                            const float *states) {
    const gdn_config *c = &p->cfg;
    const size_t rec = gdn_chunk_record_floats(c), keys = key_record_floats(c);
    const char *h = (const char *)(bw->rec + slot * rec + keys + j * head_record_floats(c));
    for (size_t off = 0; off < head_record_floats(c) * sizeof(float); off += 64) __builtin_prefetch(h + off, 0, 1);
    if (!states) return;
    const char *k = (const char *)(bw->rec + slot * rec);
    for (size_t off = 0; off < keys * sizeof(float); off += 64) __builtin_prefetch(k + off, 0, 1);
    const char *st = (const char *)states;
    for (size_t off = 0; off < (size_t)(c->Hv / c->Hk * c->K * c->V) * sizeof(float); off += 64)
        __builtin_prefetch(st + off, 0, 1);
}

typedef double v4d __attribute__((vector_size(32)));
typedef double v4d_u __attribute__((vector_size(32), aligned(8)));
static inline v4d lo4(gdn_v8f x) { return __builtin_convertvector(__builtin_shufflevector(x, x, 0, 1, 2, 3), v4d); }
static inline v4d hi4(gdn_v8f x) { return __builtin_convertvector(__builtin_shufflevector(x, x, 4, 5, 6, 7), v4d); }
static inline double hsum4(v4d x) { return (x[0] + x[1]) + (x[2] + x[3]); }
/* The 8 lanes summed in double. */
static inline double hsum8(gdn_v8f x) { return hsum4(lo4(x)) + hsum4(hi4(x)); }

/* Dot product: four 8-lane fp32 accumulators over blocks of 256, blocks summed in double. */
static double dot_f(const float *a, const float *b, int n) {
    double s = 0.0;
    int i = 0;
    while (i + 32 <= n) {
        gdn_v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        const int end = i + 256 < n ? i + 256 : n;
        for (; i + 32 <= end; i += 32) {
            a0 += *(const gdn_v8f_u *)(a + i) * *(const gdn_v8f_u *)(b + i);
            a1 += *(const gdn_v8f_u *)(a + i + 8) * *(const gdn_v8f_u *)(b + i + 8);
            a2 += *(const gdn_v8f_u *)(a + i + 16) * *(const gdn_v8f_u *)(b + i + 16);
            a3 += *(const gdn_v8f_u *)(a + i + 24) * *(const gdn_v8f_u *)(b + i + 24);
        }
        const gdn_v8f t = (a0 + a1) + (a2 + a3);
        for (int l = 0; l < 8; l++) s += t[l];
    }
    for (; i < n; i++) s += (double)a[i] * b[i];
    return s;
}

/* Gradient with respect to x of one row from d, the gradient with respect to u = f x (the
 * normalised, scaled row as the forward formed it: f = s / sqrt(|x|^2 + 1e-6) with the L2 norm,
 * f = s without): dx = f d - f (u.d) / s^2 u with the norm, dx = f d without. */
static void norm_backward_row(int K, int l2norm, float *dx, const float *d, const float *u,
                              float f, float s) {
    if (!l2norm) {
        for (int j = 0; j < K; j++) dx[j] = f * d[j];
        return;
    }
    const float proj = (float)(f * dot_f(u, d, K) / ((double)s * s));
    for (int j = 0; j < K; j++) dx[j] = f * d[j] - proj * u[j];
}

/* Backward through chunk [t0, t0+n) of stream (b, h), whose intermediates ws holds (prepared
 * with want_out, and with values unless state_only). S: the state entering the chunk; dS: on
 * entry the gradient of the state leaving it, on exit the gradient of S. Writes dv, dg, dbeta
 * rows of head h; adds the gradients with respect to the normalised, scaled q and the
 * normalised k into the dq, dk rows (finished by the caller). With state_only, only the state
 * gradient is propagated (the segment adjoint): it needs neither S nor the values. */
static void chunk_backward(const gdn_plan *p, const gdn_chunk_ws *ws, gdn_bwd_ws *bw,
                           const gdn_chunk_inputs *in, const gdn_chunk_grads *gr, int64_t b, int64_t h,
                           int64_t t0, int n, int state_only, const float *S, float *dS,
                           int first_head) {
    const gdn_config *c = &p->cfg;
    const int C = c->chunk, K = (int)c->K, V = (int)c->V, LD = V + K;
    const int64_t T = c->T, Hv = c->Hv;
    const float *Dl = ws->u, *nWQe = ws->xw;
    const float *A = ws->am, *Tm = ws->tm, *Rv = ws->rv, *nRk = ws->rk, *Kn = ws->kn, *Qs = ws->qs;
    const float egc = ws->eg[n - 1];
    /* dx (row stride LD): columns [0, V) hold [dDl ; dO], columns [V, V+K) hold [dWn ; dQe]
     * (dWn = dDl S^T = -dW), so [dDl | dWn] is its first n rows. */
    float *dDl = bw->dx, *dO = bw->dx + (size_t)n * LD, *dWn = bw->dx + V, *dQe = dWn + (size_t)n * LD;

    /* 1. S' = exp(Gc) S + Kd^T Dl */
    for (int i = 0; i < n; i++)
        for (int j = 0; j < K; j++) bw->kd[(size_t)i * K + j] = ws->egd[i] * Kn[(size_t)i * K + j];
    gdn_gemm(0, n, V, K, bw->kd, K, dS, V, dDl, LD);                            /* dDl = Kd dS' */
    double dGc = 0.0;
    if (!state_only) {
        gdn_gemm(GDN_GEMM_B_TRANS, n, K, V, Dl, V, dS, V, bw->dKd, K);          /* dKd = Dl dS'^T */
        dGc = (double)egc * dot_f(S, dS, K * V);
    }
    for (int64_t i = 0; i < (int64_t)K * V; i++) dS[i] *= egc;

    /* 2. O = diag(eG) Q S + A Dl;  3. Dl = U - W S */
    for (int i = 0; i < n; i++) {
        const float *src = gr->dout + ((b * T + t0 + i) * Hv + h) * V;
        memcpy(dO + (size_t)i * LD, src, sizeof(float) * V);
        if (c->check_finite && gdn_row_nonfinite(src, V)) bw->nonfinite = 1;
    }
    gdn_gemm(GDN_GEMM_ACC | GDN_GEMM_A_TRANS | GDN_GEMM_A_UPPER, n, V, n, A, C, dO, LD, dDl, LD);  /* dDl += A^T dO */
    /* dS += Qe^T dO - W^T dDl = [-W ; Qe]^T [dDl ; dO] */
    gdn_gemm(GDN_GEMM_ACC | GDN_GEMM_A_TRANS, K, V, 2 * n, nWQe, K, dDl, LD, dS, V);
    if (state_only) return;
    gdn_gemm(GDN_GEMM_B_TRANS, 2 * n, K, V, dDl, LD, S, V, dWn, LD);          /* [dWn ; dQe] = [dDl ; dO] S^T */
    gdn_gemm(GDN_GEMM_C_LOWER | GDN_GEMM_B_TRANS, n, n, V, dO, LD, Dl, V, bw->dA, C); /* dA = dO Dl^T */
    for (int i = 0; i < n; i++)
        for (int j = i + 1; j < C; j++) bw->dA[(size_t)i * C + j] = 0.0f;

    /* 4. U = T Rv, W = T Rk, T = (I + L)^-1: dT = dU Rv^T + dWn (-Rk)^T (lower part only) */
    gdn_gemm(GDN_GEMM_C_LOWER | GDN_GEMM_B_TRANS, n, n, V, dDl, LD, Rv, V, bw->dT, C);
    gdn_gemm(GDN_GEMM_ACC | GDN_GEMM_C_LOWER | GDN_GEMM_B_TRANS, n, n, K, dWn, LD, nRk, K, bw->dT, C);
    for (int i = 0; i < n; i++)
        for (int j = i + 1; j < C; j++) bw->dT[(size_t)i * C + j] = 0.0f;
    gdn_gemm(GDN_GEMM_A_TRANS | GDN_GEMM_A_UPPER, n, LD, n, Tm, C, dDl, LD, bw->dr, LD);         /* [dRv | -dRk] = T^T [dU | dWn] */
    gdn_gemm(GDN_GEMM_A_TRANS | GDN_GEMM_A_UPPER, n, n, n, Tm, C, bw->dT, C, bw->tcc, C);
    gdn_gemm(GDN_GEMM_C_LOWER | GDN_GEMM_B_TRANS, n, n, n, bw->tcc, C, Tm, C, bw->dLn, C); /* -dL = T^T dT T^T */

    /* 5. Per row: dv, dbeta, dG and this head's share of dq, dk (added to the other value
     * heads' shares in dQ, dKn unless first_head). */
    double *dG = bw->dG;
    for (int i = 0; i < n; i++) {
        const int64_t row = b * T + t0 + i;
        if (i + 4 < n) { /* dv rows are pages apart */
            const char *dvn = (const char *)(gr->dv + ((row + 4) * Hv + h) * V);
            for (int off = 0; off < V * 4; off += 64) __builtin_prefetch(dvn + off, 1);
        }
        const float *kn = Kn + (size_t)i * K, *qs = Qs + (size_t)i * K, *dqe = dQe + (size_t)i * LD;
        const float *drv = bw->dr + (size_t)i * LD, *drkn = drv + V, *dkd = bw->dKd + (size_t)i * K;
        /* v . drv from the record's rv = beta v; v itself (pages apart) only for beta ~ 0 */
        const int from_rv = fabsf(ws->beta[i]) >= 1e-20f;
        const float *vrow = from_rv ? ws->rv + (size_t)i * V : in->v + (row * Hv + h) * V;
        const float beta = ws->beta[i], eg = ws->eg[i], egd = ws->egd[i], nbe = -beta * eg;
        float *dq = bw->dQ + (size_t)i * K, *dk = bw->dKn + (size_t)i * K, *dv = gr->dv + (row * Hv + h) * V;
        gdn_v8f s_rk = {0}, s_kd = {0}, s_qe = {0}, s_v = {0};
        const gdn_v8f zero = {0};
        int j = 0;
        for (; j + 8 <= K; j += 8) {
            const gdn_v8f knv = *(const gdn_v8f_u *)(kn + j), drk = *(const gdn_v8f_u *)(drkn + j);
            const gdn_v8f dkdv = *(const gdn_v8f_u *)(dkd + j), dqev = *(const gdn_v8f_u *)(dqe + j);
            s_rk += knv * drk, s_kd += knv * dkdv, s_qe += *(const gdn_v8f_u *)(qs + j) * dqev;
            const gdn_v8f q0 = first_head ? zero : *(gdn_v8f_u *)(dq + j);
            const gdn_v8f k0 = first_head ? zero : *(gdn_v8f_u *)(dk + j);
            *(gdn_v8f_u *)(dq + j) = q0 + eg * dqev;
            *(gdn_v8f_u *)(dk + j) = k0 + nbe * drk + egd * dkdv;
        }
        double kn_drkn = hsum8(s_rk), kn_dkd = hsum8(s_kd), qs_dqe = hsum8(s_qe);
        for (; j < K; j++) {
            kn_drkn += (double)kn[j] * drkn[j], kn_dkd += (double)kn[j] * dkd[j];
            qs_dqe += (double)qs[j] * dqe[j];
            dq[j] = (first_head ? 0.0f : dq[j]) + eg * dqe[j];
            dk[j] = (first_head ? 0.0f : dk[j]) + nbe * drkn[j] + egd * dkd[j];
        }
        gdn_v8f nan_dv = {0}; /* NaN/Inf in any lane of dv makes this NaN */
        for (j = 0; j + 8 <= V; j += 8) {
            const gdn_v8f d = *(const gdn_v8f_u *)(drv + j);
            s_v += *(const gdn_v8f_u *)(vrow + j) * d;
            *(gdn_v8f_u *)(dv + j) = beta * d;
            nan_dv += beta * d * 0.0f;
        }
        double v_drv = hsum8(s_v);
        for (; j < V; j++) v_drv += (double)vrow[j] * drv[j], dv[j] = beta * drv[j], nan_dv[0] += dv[j] * 0.0f;
        if (hsum8(nan_dv) != 0.0) bw->nonfinite = 1;
        if (from_rv) v_drv /= beta;
        bw->dbeta_row[i] = v_drv - eg * kn_drkn;
        dG[i] = -(double)beta * eg * kn_drkn + eg * qs_dqe - egd * kn_dkd;
        dGc += egd * kn_dkd;
    }
    /* A = (Q K^T) . E . M and L = diag(beta) (K K^T) . E (strictly lower): P = dA . E,
     * Bl = diag(beta) dL . E; the decays feed dG through dA . A and dL . L, whose row sums add
     * to dG_i and column sums subtract from dG_j (products of two floats: exact in double). */
    double *colsum = bw->colsum;
    for (int j = 0; j < C; j++) colsum[j] = 0.0;
    typedef int32_t v8i __attribute__((vector_size(32)));
    const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
    for (int i = 0; i < n; i++) {
        float *pi = bw->dA + (size_t)i * C, *bi = bw->tcc + (size_t)i * C;
        const float *ai = A + (size_t)i * C, *ei = ws->ew + (size_t)i * C;
        const float *kki = ws->pk + (size_t)i * C, *dli = bw->dLn + (size_t)i * C;
        const float beta = ws->beta[i];
        v4d rowsum = {0}, dbeta = {0};
        /* Columns past the diagonal hold zeros (dA, A) or anything (ew, pk, dLn): masked. */
        for (int j = 0; j <= i; j += 8) {
            const v8i on = lane + j <= i;
            const gdn_v8f pv = *(gdn_v8f_u *)(pi + j);
            const v4d z0 = lo4(pv) * lo4(*(const gdn_v8f_u *)(ai + j));
            const v4d z1 = hi4(pv) * hi4(*(const gdn_v8f_u *)(ai + j));
            rowsum += z0 + z1;
            *(v4d_u *)(colsum + j) -= z0, *(v4d_u *)(colsum + j + 4) -= z1;
            *(gdn_v8f_u *)(pi + j) = (gdn_v8f)((v8i)(pv * *(const gdn_v8f_u *)(ei + j)) & on);
        }
        for (int j = 0; j < C; j += 8) {
            const v8i on = lane + j < i;
            if (j >= i) {
                *(gdn_v8f_u *)(bi + j) = (gdn_v8f){0};
                continue;
            }
            const gdn_v8f pl = (gdn_v8f)((v8i)(-*(const gdn_v8f_u *)(dli + j) * *(const gdn_v8f_u *)(ei + j)) & on);
            const gdn_v8f kk = (gdn_v8f)((v8i) * (const gdn_v8f_u *)(kki + j) & on);
            const v4d y0 = lo4(pl) * lo4(kk), y1 = hi4(pl) * hi4(kk); /* (dL . E)_ij K_ij */
            dbeta += y0 + y1;
            const v4d z0 = y0 * (double)beta, z1 = y1 * (double)beta;   /* dL_ij L_ij */
            rowsum += z0 + z1;
            *(v4d_u *)(colsum + j) -= z0, *(v4d_u *)(colsum + j + 4) -= z1;
            *(gdn_v8f_u *)(bi + j) = beta * pl;
        }
        dG[i] += hsum4(rowsum);
        bw->dbeta_row[i] += hsum4(dbeta);
    }
    for (int j = 0; j < n; j++) dG[j] += colsum[j];
    gdn_gemm(GDN_GEMM_ACC | GDN_GEMM_A_LOWER, n, K, n, bw->dA, C, Kn, K, bw->dQ, K); /* dQ += P Kn */
    for (int i = 0; i < n; i++) /* Bl + Bl^T (n x n) */
        for (int j = 0; j < n; j++)
            bw->bsym[(size_t)i * C + j] = bw->tcc[(size_t)i * C + j] + bw->tcc[(size_t)j * C + i];
    gdn_gemm(GDN_GEMM_ACC | GDN_GEMM_A_TRANS | GDN_GEMM_A_UPPER, n, K, n, bw->dA, C, Qs, K, bw->dKn, K); /* dK += P^T Q */
    gdn_gemm(GDN_GEMM_ACC, n, K, n, bw->bsym, C, Kn, K, bw->dKn, K);   /* dK += (Bl + Bl^T) K */
    dG[n - 1] += dGc;

    /* dg = reverse cumulative sum of dG within the chunk (tests: the sum dropped, each row its
     * own dG, must be caught against the oracle). */
    const int no_cumsum = gdn_test_mutate("chunk: dg without its reverse cumulative sum");
    double acc = 0.0;
    for (int i = n - 1; i >= 0; i--) {
        const int64_t row = b * T + t0 + i;
        acc = no_cumsum ? dG[i] : acc + dG[i];
        const float dg = (float)acc, db = (float)bw->dbeta_row[i];
        gr->dg[row * Hv + h] = dg, gr->dbeta[row * Hv + h] = db;
        if (!(dg * 0.0f == 0.0f && db * 0.0f == 0.0f)) bw->nonfinite = 1;
    }
}

/* The chunk's dq, dk rows, summed over the key head's value heads in dQ, dKn, are gradients
 * with respect to the normalised rows (qs, kn of the chunk's record ws): turn them into
 * gradients with respect to the raw q, k rows, without reading those again. */
static void finish_key_rows(const gdn_plan *p, const gdn_chunk_ws *ws, gdn_bwd_ws *bw,
                            const gdn_chunk_grads *gr, int64_t b, int64_t hk, int64_t t0, int n) {
    const gdn_config *c = &p->cfg;
    const int K = (int)c->K;
    for (int i = 0; i < n; i++) {
        const int64_t off = ((b * c->T + t0 + i) * c->Hk + hk) * K;
        if (i + 4 < n)
            for (int o = 0; o < K; o += 16) {
                __builtin_prefetch(gr->dq + off + 4 * c->Hk * K + o, 1);
                __builtin_prefetch(gr->dk + off + 4 * c->Hk * K + o, 1);
            }
        norm_backward_row(K, c->l2norm, gr->dq + off, bw->dQ + (size_t)i * K, ws->qs + (size_t)i * K,
                          ws->qinv[i], c->scale);
        norm_backward_row(K, c->l2norm, gr->dk + off, bw->dKn + (size_t)i * K, ws->kn + (size_t)i * K,
                          ws->kinv[i], 1.0f);
        if (c->check_finite && (gdn_row_nonfinite(gr->dq + off, K) || gdn_row_nonfinite(gr->dk + off, K)))
            bw->nonfinite = 1;
    }
}

void gdn_backward_item(const gdn_plan *p, gdn_chunk_ws *ws, gdn_bwd_ws *bw, const gdn_chunk_inputs *in,
                       const gdn_chunk_grads *gr, const gdn_range *rg, int64_t hk) {
    const gdn_config *c = &p->cfg;
    const int C = c->chunk;
    const int64_t K = c->K, V = c->V, Hv = c->Hv, Hk = c->Hk, r = Hv / Hk, KV = K * V;
    const int64_t b = rg->b, t_begin = rg->t_begin, t_end = rg->t_end;
    /* Segments: those of the forward's saved states, or of this backward's own sweep. Chunks
     * start at t_begin (a document start, in a packed stream). */
    const int64_t nchunks = (t_end - t_begin + C - 1) / C, N = rg->ckpt ? p->save_chunks : p->ckpt_chunks,
                  nseg = (nchunks + N - 1) / N;
    /* The r value heads of this key head go through every chunk together, so each chunk's key
     * side (normalised q, k; K K^T, Q K^T) is formed once for all of them. */
    const int64_t h0 = hk * r;
    float *S = ws->state;
    if (!rg->ckpt) { /* forward sweep keeping the states at segment starts */
        for (int64_t j = 0; j < r; j++) {
            if (rg->h0) memcpy(S + j * KV, rg->h0 + (h0 + j) * KV, sizeof(float) * KV);
            else memset(S + j * KV, 0, sizeof(float) * KV);
        }
        for (int64_t s = 0; s < nseg; s++) {
            memcpy(bw->ckpt + s * r * KV, S, sizeof(float) * r * KV);
            const int64_t t1 = t_begin + (s + 1) * N * C < t_end ? t_begin + (s + 1) * N * C : t_end;
            if (s + 1 < nseg) gdn_chunk_stream(p, ws, in, b, h0, (int)r, 0, (int)V, t_begin + s * N * C, t1, NULL);
        }
    }
    for (int64_t j = 0; j < r; j++) {
        if (rg->dht) memcpy(bw->dS + j * KV, rg->dht + (h0 + j) * KV, sizeof(float) * KV);
        else memset(bw->dS + j * KV, 0, sizeof(float) * KV);
    }
    for (int64_t s = nseg - 1; s >= 0; s--) {
        const int64_t c_begin = s * N, c_end = (s + 1) * N < nchunks ? (s + 1) * N : nchunks;
        for (int64_t j = 0; j < r; j++) { /* the segment's start: saved by the forward or swept */
            if (!rg->ckpt) memcpy(S + j * KV, bw->ckpt + (s * r + j) * KV, sizeof(float) * KV);
            else if (s > 0) memcpy(S + j * KV, rg->ckpt + ((h0 + j) * rg->ckpt_rows + s - 1) * KV, sizeof(float) * KV);
            else if (rg->h0) memcpy(S + j * KV, rg->h0 + (h0 + j) * KV, sizeof(float) * KV);
            else memset(S + j * KV, 0, sizeof(float) * KV);
        }
        /* Forward re-sweep: each chunk's entry state and, for the segment's last rec_slots
         * chunks, its intermediates into its record (slot ci - first_rec). */
        const int64_t first_rec = c_end - (c_end - c_begin < p->rec_slots ? c_end - c_begin : p->rec_slots);
        for (int64_t ci = c_begin; ci < c_end; ci++) {
            const int64_t t0 = t_begin + ci * C, slot = ci - first_rec;
            const int n = (int)(t_end - t0 < C ? t_end - t0 : C);
            memcpy(bw->segst + (ci - c_begin) * r * KV, S, sizeof(float) * r * KV);
            for (int64_t j = 0; j < r; j++) {
                gdn_chunk_ws v = slot >= 0 ? record_view(p, ws, bw, slot, j) : *ws;
                gdn_chunk_prepare(p, &v, in, b, h0 + j, t0, n, slot >= 0, j > 0);
                gdn_chunk_values(p, &v, in, b, h0 + j, t0, n, 0, (int)V, 0, S + j * KV);
                if (ci + 1 < c_end) gdn_chunk_update_state(p, &v, n, (int)V, S + j * KV);
                ws->nonfinite |= v.nonfinite;
            }
        }
        for (int64_t ci = c_end - 1; ci >= c_begin; ci--) {
            const int64_t t0 = t_begin + ci * C, slot = ci - first_rec;
            const int n = (int)(t_end - t0 < C ? t_end - t0 : C);
            const float *Sc = bw->segst + (ci - c_begin) * r * KV; /* the chunk's entry states */
            for (int64_t j = 0; j < r; j++) {
                gdn_chunk_ws v = slot >= 0 ? record_view(p, ws, bw, slot, j) : *ws;
                if (slot < 0) { /* no record: form the intermediates again, in the scratch */
                    gdn_chunk_prepare(p, &v, in, b, h0 + j, t0, n, 1, j > 0);
                    gdn_chunk_values(p, &v, in, b, h0 + j, t0, n, 0, (int)V, 0, Sc + j * KV);
                } else if (j + 1 < r) {
                    prefetch_record(p, bw, slot, j + 1, NULL);
                } else if (slot > 0) {
                    prefetch_record(p, bw, slot - 1, 0, Sc - r * KV);
                }
                chunk_backward(p, &v, bw, in, gr, b, h0 + j, t0, n, 0, Sc + j * KV,
                               bw->dS + j * KV, j == 0);
            }
            const gdn_chunk_ws keys = slot >= 0 ? record_view(p, ws, bw, slot, 0) : *ws;
            finish_key_rows(p, &keys, bw, gr, b, hk, t0, n);
        }
    }
    for (int64_t j = 0; rg->dh0 && j < r; j++) {
        memcpy(rg->dh0 + (h0 + j) * KV, bw->dS + j * KV, sizeof(float) * KV);
        if (c->check_finite && gdn_row_nonfinite(bw->dS + j * KV, KV)) bw->nonfinite = 1;
    }
}

void gdn_adjoint_item(const gdn_plan *p, gdn_chunk_ws *ws, gdn_bwd_ws *bw, const gdn_chunk_inputs *in,
                      const gdn_chunk_grads *gr, int64_t b, int64_t h, int64_t t_begin, int64_t t_end,
                      const float *ds_out, float *sg) {
    const gdn_config *c = &p->cfg;
    const int C = c->chunk;
    const int64_t KV = c->K * c->V;
    if (ds_out) memcpy(bw->dS, ds_out, sizeof(float) * KV);
    else memset(bw->dS, 0, sizeof(float) * KV);
    for (int64_t t0 = t_begin + (t_end - t_begin - 1) / C * C; t0 >= t_begin; t0 -= C) {
        const int n = (int)(t_end - t0 < C ? t_end - t0 : C);
        gdn_chunk_prepare(p, ws, in, b, h, t0, n, 1, 0);
        chunk_backward(p, ws, bw, in, gr, b, h, t0, n, 1, NULL, bw->dS, 0);
    }
    memcpy(sg, bw->dS, sizeof(float) * KV);
}
