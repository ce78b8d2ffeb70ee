/* Segment summaries: the exact affine map S_out = A S_in + B of a token segment (DESIGN §4),
 * and composing / applying such maps. */
#include "kernel_internal.h"

#include <string.h>

/* q, k, g, beta: present and (with check_finite) finite. */
static int check_keys_gates(const gdn_config *c, const float *q, const float *k, const float *g,
                            const float *beta) {
    const int64_t nqk = c->B * c->T * c->Hk * c->K, ng = c->B * c->T * c->Hv;
    int rc;
    if ((rc = gdn_check_tensor("q", q, nqk, c->check_finite, c->threads)) ||
        (rc = gdn_check_tensor("k", k, nqk, c->check_finite, c->threads)) ||
        (rc = gdn_check_tensor("g", g, ng, c->check_finite, c->threads)) ||
        (rc = gdn_check_tensor("beta", beta, ng, c->check_finite, c->threads)))
        return rc;
    return GDN_OK;
}

/* A packed plan's map is the dense one only while its tokens hold no document start (a CP shard
 * inside one document); across a start it forgets the incoming state, which the CP path handles
 * itself (gdn_streams_forward, gdn_streams_adjoint_first). */
static int check_no_reset(const gdn_plan *p, const char *fn) {
    if (p->streams.packed && !(p->streams.n == 1 && p->streams.s[0].cont_in))
        return gdn_fail(GDN_ERR_ARG, "%s: the plan's tokens contain a document start (cu_seqlens), where the "
                        "map forgets the incoming state; summaries are defined for spans inside one document", fn);
    return GDN_OK;
}

int gdn_summary(gdn_plan *p, float *sa, float *sb, const gdn_rule_inputs *ri) {
    if (!p) return gdn_fail(GDN_ERR_ARG, "plan is NULL");
    if (!sa) return gdn_fail(GDN_ERR_ARG, "summary output 'A' is NULL");
    const gdn_config *c = &p->cfg;
    int rc;
    if ((rc = gdn_rule_inputs_check(ri, sb != NULL))) return rc; /* A alone ignores v */
    const float *q = ri->q, *k = ri->k, *v = ri->v, *g = ri->g, *beta = ri->beta;
    if ((rc = check_no_reset(p, "gdn_summary"))) return rc;
    if ((rc = check_keys_gates(c, q, k, g, beta)) ||
        (sb && (rc = gdn_check_tensor("v", v, c->B * c->T * c->Hv * c->V, c->check_finite, c->threads))))
        return rc; /* A alone ignores v */
    const int64_t Hv = c->Hv, K = c->K, V = c->V;
    /* The augmented state [S | A]; without sb only the A columns are pushed through. */
    const int first = sb ? 0 : (int)V, width = (int)(V + K) - first;
    const int bw = gdn_column_block_width(p, c->B * Hv, width);
    const int nblk = (width + bw - 1) / bw;
    const int64_t items = c->B * Hv * nblk;
    const gdn_chunk_inputs in = {q, k, v, g, beta};
#pragma omp parallel num_threads(p->threads)
    {
        const gdn_fpmode fm = gdn_fp_fast_begin();
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            gdn_chunk_ws *ws = &p->ws[gdn_thread_id()];
            const int64_t b = it / (Hv * nblk), h = (it / nblk) % Hv;
            const int c0 = first + (int)(it % nblk) * bw;
            const int w = first + width - c0 < bw ? first + width - c0 : bw;
            /* [S | A] starts as [0 | I]: B is the final state from zero, A the pushed identity. */
            for (int64_t i = 0; i < K; i++)
                for (int j = 0; j < w; j++) ws->state[i * w + j] = (c0 + j - V == i) ? 1.0f : 0.0f;
            gdn_chunk_stream(p, ws, &in, b, h, 1, c0, w, 0, c->T, NULL);
            float *A = sa + (b * Hv + h) * K * K, *Bm = sb ? sb + (b * Hv + h) * K * V : NULL;
            for (int64_t i = 0; i < K; i++)
                for (int j = 0; j < w; j++) {
                    const int64_t col = c0 + j;
                    if (col < V) Bm[i * V + col] = ws->state[i * w + j];
                    else A[i * K + col - V] = ws->state[i * w + j];
                }
        }
        gdn_fp_fast_end(fm);
    }
    return GDN_OK;
}

static int check_maps(int64_t nmaps, int64_t K, int64_t V) {
    if (nmaps <= 0 || K <= 0 || V <= 0 || K > GDN_MAX_HEAD_DIM || V > GDN_MAX_HEAD_DIM)
        return gdn_fail(GDN_ERR_SHAPE, "summary sizes nmaps=%lld K=%lld V=%lld out of range",
                        (long long)nmaps, (long long)K, (long long)V);
    return GDN_OK;
}

int gdn_summary_compose(float *out_a, float *out_b, const float *a2, const float *b2,
                        const float *a1, const float *b1, int64_t nmaps, int64_t K, int64_t V) {
    int rc = check_maps(nmaps, K, V);
    if (rc) return rc;
    if (!out_a || !out_b || !a2 || !b2 || !a1 || !b1)
        return gdn_fail(GDN_ERR_ARG, "summary compose: a pointer is NULL");
    for (int64_t m = 0; m < nmaps; m++) {
        const float *A2 = a2 + m * K * K, *A1 = a1 + m * K * K;
        gdn_gemm(0, (int)K, (int)K, (int)K, A2, (int)K, A1, (int)K, out_a + m * K * K, (int)K);
        float *ob = out_b + m * K * V;
        memcpy(ob, b2 + m * K * V, sizeof(float) * K * V);
        gdn_gemm(GDN_GEMM_ACC, (int)K, (int)V, (int)K, A2, (int)K, b1 + m * K * V, (int)V, ob,
                 (int)V);
    }
    return GDN_OK;
}

int gdn_summary_apply(float *out, const float *a, const float *b, const float *s, int64_t nmaps,
                      int64_t K, int64_t V) {
    int rc = check_maps(nmaps, K, V);
    if (rc) return rc;
    if (!out || !a || !b || !s) return gdn_fail(GDN_ERR_ARG, "summary apply: a pointer is NULL");
    for (int64_t m = 0; m < nmaps; m++) {
        float *om = out + m * K * V;
        memcpy(om, b + m * K * V, sizeof(float) * K * V);
        gdn_gemm(GDN_GEMM_ACC, (int)K, (int)V, (int)K, a + m * K * K, (int)K, s + m * K * V,
                 (int)V, om, (int)V);
    }
    return GDN_OK;
}

int gdn_summary_adjoint(gdn_plan *p, float *sg, const gdn_rule_inputs *in, const float *dout) {
    if (!p) return gdn_fail(GDN_ERR_ARG, "plan is NULL"); /* the order of gdn_summary's checks */
    if (!sg) return gdn_fail(GDN_ERR_ARG, "adjoint output is NULL");
    int rc = gdn_rule_inputs_check(in, 0); /* v and h0 are not read */
    return rc ? rc : gdn_state_adjoint(p, sg, in->q, in->k, in->g, in->beta, dout, NULL);
}

int gdn_state_adjoint(gdn_plan *p, float *sg, const float *q, const float *k, const float *g,
                      const float *beta, const float *dout, const float *ds_out) {
    if (!p) return gdn_fail(GDN_ERR_ARG, "plan is NULL");
    if (!sg) return gdn_fail(GDN_ERR_ARG, "adjoint output is NULL");
    const gdn_config *c = &p->cfg;
    int rc;
    if ((rc = check_no_reset(p, "gdn_summary_adjoint"))) return rc;
    if ((rc = check_keys_gates(c, q, k, g, beta)) ||
        (rc = gdn_check_tensor("do", dout, c->B * c->T * c->Hv * c->V, c->check_finite, c->threads)) ||
        (ds_out && (rc = gdn_check_tensor("dS_out", ds_out, c->B * c->Hv * c->K * c->V, c->check_finite, c->threads))))
        return rc;
    const gdn_chunk_inputs in = {q, k, NULL, g, beta};
    const gdn_chunk_grads gr = {NULL, NULL, NULL, NULL, NULL, NULL, dout, ds_out, NULL, NULL};
    const int64_t items = c->B * c->Hv, KV = c->K * c->V;
#pragma omp parallel num_threads(p->threads)
    {
        const gdn_fpmode fm = gdn_fp_fast_begin();
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int tid = gdn_thread_id();
            gdn_adjoint_item(p, &p->ws[tid], &p->bws[tid], &in, &gr, it / c->Hv, it % c->Hv, 0, c->T,
                             ds_out ? ds_out + it * KV : NULL, sg + it * KV);
        }
        gdn_fp_fast_end(fm);
    }
    return GDN_OK;
}
