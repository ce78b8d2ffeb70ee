/* The oracle of the kernel's BF16 compute mode (cfg.compute = GDN_COMPUTE_BF16): the chunked
 * algorithm of chunk_forward.c in double precision, with the operands of exactly the products
 * that mode runs in bf16 rounded (each value rounded to fp32, then to bf16 nearest even, as the
 * kernel rounds its fp32 intermediates) and everything else exact: the norms, gates and decays,
 * the triangular solve (I + L)^-1, the additions and the state. So all that separates the BF16
 * kernel from it is fp32 arithmetic, and the rare element whose fp32 and double values round to
 * different bf16 neighbours (tests measure norm-wise). The chunk grid is the kernel's: chunks of
 * cfg.chunk from each stream's start (a row, or a packed document). */
#include "kernel_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static double bfr(double x) { /* the bf16 operand of a product */
    const uint32_t u = (uint32_t)gdn_f32_to_bf16((float)x) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* One stream: tokens [t0s, t1s) of batch row b, value head h, state S (K x V) in and out. */
static void stream_bf16(const gdn_config *c, const gdn_rule_inputs_f64 *in, double scale, int64_t b, int64_t h,
                        int64_t t0s, int64_t t1s, double *S, double *o, double *scratch) {
    const int64_t T = c->T, Hk = c->Hk, Hv = c->Hv, K = c->K, V = c->V, hk = h / (Hv / Hk);
    const int C = c->chunk ? c->chunk : 64;
    double *qd = scratch, *kd = qd + C * K, *tm = kd + C * K, *pk = tm + C * C, *qk = pk + C * C, *G = qk + C * C;
    double *xw = G + C, *U = xw + 2 * C * K, *m2 = U + C * V, *Sb = m2 + 2 * C * V, *Dl = Sb + K * V;
    for (int64_t t0 = t0s; t0 < t1s; t0 += C) {
        const int n = (int)(t1s - t0 < C ? t1s - t0 : C);
        for (int i = 0; i < n; i++) { /* normalised q (scaled) and k, as the kernel's prep */
            const int64_t row = b * T + t0 + i;
            const double *qs = in->q + (row * Hk + hk) * K, *ks = in->k + (row * Hk + hk) * K;
            double sq = 0, sk = 0;
            for (int64_t d = 0; d < K; d++) sq += qs[d] * qs[d], sk += ks[d] * ks[d];
            const double qi = c->l2norm ? scale / sqrt(sq + 1e-6) : scale, ki = c->l2norm ? 1.0 / sqrt(sk + 1e-6) : 1.0;
            for (int64_t d = 0; d < K; d++) qd[i * K + d] = qs[d] * qi, kd[i * K + d] = ks[d] * ki;
        }
        double Gs = 0;
        for (int i = 0; i < n; i++) G[i] = Gs += in->g[(b * T + t0 + i) * Hv + h];
        const double *beta = in->beta;
#define BETA(i) beta[(b * T + t0 + (i)) * Hv + h]
        /* pk = bf(Kn) bf(Kn)^T and qk = bf(Q) bf(Kn)^T (lower triangles) */
        for (int i = 0; i < n; i++)
            for (int j = 0; j <= i; j++) {
                double a = 0, q = 0;
                for (int64_t d = 0; d < K; d++) {
                    const double kj = bfr(kd[j * K + d]);
                    a += bfr(kd[i * K + d]) * kj, q += bfr(qd[i * K + d]) * kj;
                }
                pk[i * C + j] = a, qk[i * C + j] = q;
            }
        /* tm = (I + L)^-1, L_ij = beta_i pk_ij exp(G_i - G_j) (i > j), exactly */
        for (int i = 0; i < n; i++) {
            for (int j = 0; j < n; j++) tm[i * C + j] = i == j;
            for (int j = 0; j < i; j++) {
                const double l = BETA(i) * pk[i * C + j] * exp(G[i] - G[j]);
                for (int jj = 0; jj <= j; jj++) tm[i * C + jj] -= l * tm[j * C + jj];
            }
        }
        /* xw = [bf(tm) bf(-diag(beta eG) Kn) ; diag(eG) Q], U = bf(tm) bf(diag(beta) V) */
        for (int i = 0; i < n; i++) {
            for (int64_t d = 0; d < K; d++) {
                double a = 0;
                for (int j = 0; j <= i; j++) a += bfr(tm[i * C + j]) * bfr(-BETA(j) * exp(G[j]) * kd[j * K + d]);
                xw[i * K + d] = a, xw[(n + i) * K + d] = exp(G[i]) * qd[i * K + d];
            }
            for (int64_t e = 0; e < V; e++) {
                double a = 0;
                for (int j = 0; j <= i; j++)
                    a += bfr(tm[i * C + j]) * bfr(BETA(j) * in->v[((b * T + t0 + j) * Hv + h) * V + e]);
                U[i * V + e] = a;
            }
        }
        /* m2 = bf(xw) bf(S); Dl = U + m2's upper half */
        for (int64_t x = 0; x < K * V; x++) Sb[x] = bfr(S[x]);
        for (int i = 0; i < 2 * n; i++)
            for (int64_t e = 0; e < V; e++) {
                double a = 0;
                for (int64_t d = 0; d < K; d++) a += bfr(xw[i * K + d]) * Sb[d * V + e];
                m2[i * V + e] = a;
            }
        for (int i = 0; i < n; i++)
            for (int64_t e = 0; e < V; e++) Dl[i * V + e] = U[i * V + e] + m2[i * V + e];
        /* O = eG Q S + bf(A) bf(Dl), A_ij = qk_ij exp(G_i - G_j) (j <= i) */
        for (int i = 0; o && i < n; i++)
            for (int64_t e = 0; e < V; e++) {
                double a = m2[(n + i) * V + e];
                for (int j = 0; j <= i; j++) a += bfr(qk[i * C + j] * exp(G[i] - G[j])) * bfr(Dl[j * V + e]);
                o[((b * T + t0 + i) * Hv + h) * V + e] = a;
            }
        /* S = exp(Gc) S + bf(Kd)^T bf(Dl), Kd = diag(exp(Gc - G)) Kn */
        const double gc = G[n - 1];
        for (int64_t d = 0; d < K; d++)
            for (int64_t e = 0; e < V; e++) {
                double a = exp(gc) * S[d * V + e];
                for (int j = 0; j < n; j++) a += bfr(kd[j * K + d] * exp(gc - G[j])) * bfr(Dl[j * V + e]);
                S[d * V + e] = a;
            }
#undef BETA
    }
}

int gdn_reference_forward_bf16(const gdn_config *c, double *o, double *ht, const gdn_rule_inputs_f64 *in) {
    const int64_t B = c->B, T = c->T, Hv = c->Hv, K = c->K, V = c->V;
    const int64_t C = c->chunk ? c->chunk : 64;
    const double scale = c->scale != 0.0f ? (double)c->scale : 1.0 / sqrt((double)K);
    const size_t nscr = (size_t)(2 * C * K + 3 * C * C + C + 2 * C * K + C * V + 2 * C * V + 2 * K * V + K * V);
    double *S = gdn_malloc("reference_bf16: S", sizeof(double) * (K * V + nscr));
    if (!S) return gdn_fail(GDN_ERR_NOMEM, "BF16 oracle scratch (%zu doubles)", nscr);
    const int64_t *cu = c->cu_seqlens, nseq = cu ? c->n_docs : 1;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hv; h++)
            for (int64_t sq = 0; sq < nseq; sq++) {
                const int64_t sidx = cu ? sq : b;
                if (in->h0) memcpy(S, in->h0 + (sidx * Hv + h) * K * V, sizeof(double) * K * V);
                else memset(S, 0, sizeof(double) * K * V);
                stream_bf16(c, in, scale, b, h, cu ? cu[sq] : 0, cu ? cu[sq + 1] : T, S, o, S + K * V);
                if (ht) memcpy(ht + (sidx * Hv + h) * K * V, S, sizeof(double) * K * V);
            }
    free(S);
    return GDN_OK;
}
