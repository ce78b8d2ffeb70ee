/* Packed variable-length sequences (cu_seqlens, as flash-linear-attention): many documents in
 * one token stream, the recurrent state restarting at every document start. Each document (or,
 * in a context-parallel shard, each part of one) is its own chunked stream whose chunks start
 * at the document's first token, so a reset never falls inside a chunk and the chunk machinery
 * runs unchanged; documents are independent work items, which keeps both threads busy even
 * when there are few heads. The dense path does not come here. */
#include "internal.h"

#include <string.h>

/* gdn_pack_check, gdn_pack_check_whole: in status.c with the other configuration checks. */

int64_t gdn_state_floats(const gdn_config *c) {
    return (c->cu_seqlens ? c->n_docs : c->B) * c->Hv * c->K * c->V;
}

void gdn_pack_free(gdn_plan *p) {
    free(p->pack.cu);
    free(p->pack.start);
    free(p->pack.ckpt_first);
    memset(&p->pack, 0, sizeof p->pack);
}

int gdn_pack_init(gdn_plan *p) {
    gdn_config *c = &p->cfg;
    if (!c->cu_seqlens) return GDN_OK;
    gdn_pack *pk = &p->pack;
    const int64_t nd = c->n_docs, t0 = c->seq_offset, t1 = t0 + c->T, C = c->chunk;
    pk->cu = malloc(sizeof(int64_t) * (nd + 1));
    if (!pk->cu) return gdn_fail(GDN_ERR_NOMEM, "cu_seqlens copy (%lld documents)", (long long)nd);
    memcpy(pk->cu, c->cu_seqlens, sizeof(int64_t) * (nd + 1));
    c->cu_seqlens = pk->cu;
    /* The documents that hold tokens t0 and t1 - 1 (binary search: the last d with cu[d] <= t). */
    int64_t lo = 0, hi = nd - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (pk->cu[mid] <= t0) lo = mid;
        else hi = mid - 1;
    }
    const int64_t first = lo;
    hi = nd - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (pk->cu[mid] <= t1 - 1) lo = mid;
        else hi = mid - 1;
    }
    const int64_t last = lo;
    pk->n = last - first + 1;
    pk->first_doc = first;
    pk->cont_first = pk->cu[first] < t0;
    pk->cont_last = pk->cu[last + 1] > t1;
    pk->start = malloc(sizeof(int64_t) * (pk->n + 1));
    pk->ckpt_first = malloc(sizeof(int64_t) * (pk->n + 1));
    if (!pk->start || !pk->ckpt_first) return gdn_fail(GDN_ERR_NOMEM, "packed plan (%lld pieces)", (long long)pk->n);
    int64_t rows = 0;
    for (int64_t i = 0; i < pk->n; i++) {
        pk->start[i] = (pk->cu[first + i] > t0 ? pk->cu[first + i] : t0) - t0;
        pk->ckpt_first[i] = rows;
        const int64_t end = pk->cu[first + i + 1] < t1 ? pk->cu[first + i + 1] : t1;
        const int64_t nchunks = (end - t0 - pk->start[i] + C - 1) / C;
        rows += (nchunks + p->save_chunks - 1) / p->save_chunks - 1; /* the first starts from h0 */
    }
    pk->start[pk->n] = c->T;
    pk->ckpt_first[pk->n] = rows;
    pk->ckpt_rows = rows;
    return GDN_OK;
}

/* The state entering piece i ([Hv, K, V] base, NULL: zeros) and whether piece i's final state
 * is its document's (the document ends within the plan's tokens). */
static const float *piece_h0(const gdn_pack *pk, int64_t i, int64_t ns, const float *h0, const float *s_in) {
    if (i == 0 && pk->cont_first) return s_in;
    return h0 ? h0 + (pk->first_doc + i) * ns : NULL;
}
static int piece_ends_doc(const gdn_pack *pk, int64_t i) { return i + 1 < pk->n || !pk->cont_last; }

static int check_output(const char *name, const float *x, int64_t n, int threads) {
    const int64_t at = gdn_find_nonfinite_f32(x, n, threads);
    if (at >= 0)
        return gdn_fail(GDN_ERR_NONFINITE,
                        "output '%s' is non-finite at flat index %lld (overflow: are gates g > 0 or keys unnormalised?)",
                        name, (long long)at);
    return GDN_OK;
}

/* A non-finite value found inside the loop: name the input, else the output, else the keys. */
static int explain_nonfinite(gdn_plan *p, const float *q, const float *k, const float *v,
                             const float *g, const float *beta, const float *h0, const char *oname,
                             const float *o, int64_t on) {
    int rc;
    if ((rc = gdn_check_inputs(p, q, k, v, g, beta, h0))) return rc;
    if (o && (rc = check_output(oname, o, on, p->threads))) return rc;
    return gdn_fail(GDN_ERR_NONFINITE, "input 'q' or 'k' has a row whose squared norm overflows fp32 (|x| > 1e19)");
}

int gdn_packed_forward(gdn_plan *p, float *o, float *ht, float *ckpt, const float *q,
                       const float *k, const float *v, const float *g, const float *beta,
                       const float *h0, const float *s_in, float *s_out) {
    const gdn_config *c = &p->cfg;
    const gdn_pack *pk = &p->pack;
    const int64_t Hv = c->Hv, Hk = c->Hk, r = Hv / Hk, K = c->K, V = c->V, KV = K * V, ns = Hv * KV;
    int rc;
    if ((rc = gdn_check_tensor("q", q, 0, 0, 1)) || (rc = gdn_check_tensor("k", k, 0, 0, 1)) ||
        (rc = gdn_check_tensor("v", v, 0, 0, 1)) || (rc = gdn_check_tensor("g", g, 0, 0, 1)) ||
        (rc = gdn_check_tensor("beta", beta, 0, 0, 1)) ||
        (h0 && (rc = gdn_check_tensor("h0", h0, gdn_state_floats(c), c->check_finite, c->threads))))
        return rc;
    for (int t = 0; t < p->threads; t++) p->ws[t].nonfinite = 0;
    /* Only the last piece when its final state is all that is wanted (a CP fold): the resets
     * make every earlier document irrelevant to it. */
    const int64_t first = !o && !ckpt && !ht ? pk->n - 1 : 0, pieces = pk->n - first;
    const int bw = gdn_column_block_width(p, pieces * Hk, (int)V);
    const int nblk = (int)((V + bw - 1) / bw);
    const int64_t items = pieces * Hk * nblk;
    const gdn_inputs in = {q, k, v, g, beta};
    const int64_t seg_tokens = (int64_t)p->save_chunks * c->chunk;
#pragma omp parallel num_threads(p->threads)
    {
        const gdn_fpmode fm = gdn_fp_fast_begin();
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            gdn_chunk_ws *ws = &p->ws[gdn_thread_id()];
            const int64_t i = first + it / (Hk * nblk), h = (it / nblk) % Hk * r;
            const int c0 = (int)(it % nblk) * bw;
            const int w = (int)(V - c0 < bw ? V - c0 : bw);
            const int64_t t_begin = pk->start[i], t_end = pk->start[i + 1];
            const float *init = piece_h0(pk, i, ns, h0, s_in);
            for (int64_t j = 0; j < r; j++) {
                float *S = ws->state + j * K * w;
                const float *src = init ? init + (h + j) * KV + c0 : NULL;
                for (int64_t a = 0; a < K; a++)
                    for (int jj = 0; jj < w; jj++) S[a * w + jj] = src ? src[a * V + jj] : 0.0f;
            }
            if (!ckpt) {
                gdn_chunk_stream(p, ws, &in, 0, h, (int)r, c0, w, t_begin, t_end, o);
            } else { /* segment by segment from the piece's start, keeping each start's state */
                for (int64_t s = 0; t_begin + s * seg_tokens < t_end; s++) {
                    for (int64_t j = 0; s > 0 && j < r; j++)
                        for (int64_t a = 0; a < K; a++)
                            memcpy(ckpt + (((h + j) * pk->ckpt_rows + pk->ckpt_first[i] + s - 1) * K + a) * V + c0,
                                   ws->state + (j * K + a) * w, sizeof(float) * w);
                    const int64_t t1 = t_begin + (s + 1) * seg_tokens < t_end ? t_begin + (s + 1) * seg_tokens : t_end;
                    gdn_chunk_stream(p, ws, &in, 0, h, (int)r, c0, w, t_begin + s * seg_tokens, t1, o);
                }
            }
            float *dst[2] = {ht && piece_ends_doc(pk, i) ? ht + (pk->first_doc + i) * ns : NULL,
                             s_out && i + 1 == pk->n ? s_out : NULL};
            for (int d = 0; d < 2; d++)
                for (int64_t j = 0; dst[d] && j < r; j++)
                    for (int64_t a = 0; a < K; a++)
                        memcpy(dst[d] + (h + j) * KV + a * V + c0, ws->state + (j * K + a) * w, sizeof(float) * w);
        }
        gdn_fp_fast_end(fm);
    }
    if (c->check_finite) {
        int found = 0;
        for (int t = 0; t < p->threads; t++) found |= p->ws[t].nonfinite;
        if (found) return explain_nonfinite(p, q, k, v, g, beta, h0, "o", o, c->T * Hv * V);
        const int64_t d0 = pk->first_doc + (pk->cont_first ? 1 : 0);
        const int64_t d1 = pk->first_doc + pk->n - (pk->cont_last ? 1 : 0);
        if (ht && d1 > d0 && (rc = check_output("ht", ht + d0 * ns, (d1 - d0) * ns, p->threads))) return rc;
    }
    return GDN_OK;
}

int gdn_packed_backward(gdn_plan *p, float *dq, float *dk, float *dv, float *dg, float *dbeta,
                        float *dh0, const float *q, const float *k, const float *v,
                        const float *g, const float *beta, const float *h0, const float *s_in,
                        const float *ckpt, const float *dout, const float *dht,
                        const float *ds_out, float *ds_in) {
    if (!dq || !dk || !dv || !dg || !dbeta)
        return gdn_fail(GDN_ERR_ARG, "gradient output '%s' is NULL",
                        !dq ? "dq" : !dk ? "dk" : !dv ? "dv" : !dg ? "dg" : "dbeta");
    const gdn_config *c = &p->cfg;
    const gdn_pack *pk = &p->pack;
    const int64_t Hv = c->Hv, Hk = c->Hk, KV = c->K * c->V, ns = Hv * KV, nst = gdn_state_floats(c);
    int rc;
    if ((rc = gdn_check_tensor("q", q, 0, 0, 1)) || (rc = gdn_check_tensor("k", k, 0, 0, 1)) ||
        (rc = gdn_check_tensor("v", v, 0, 0, 1)) || (rc = gdn_check_tensor("g", g, 0, 0, 1)) ||
        (rc = gdn_check_tensor("beta", beta, 0, 0, 1)) || (rc = gdn_check_tensor("do", dout, 0, 0, 1)) ||
        (h0 && (rc = gdn_check_tensor("h0", h0, nst, c->check_finite, c->threads))) ||
        (dht && (rc = gdn_check_tensor("dht", dht, nst, c->check_finite, c->threads))))
        return rc;
    for (int t = 0; t < p->threads; t++) p->ws[t].nonfinite = p->bws[t].nonfinite = 0;
    const gdn_inputs in = {q, k, v, g, beta};
    const gdn_grads gr = {dq, dk, dv, dg, dbeta, NULL, dout, NULL, NULL, NULL};
    const int64_t items = pk->n * Hk;
#pragma omp parallel num_threads(p->threads)
    {
        const gdn_fpmode fm = gdn_fp_fast_begin();
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int tid = gdn_thread_id();
            const int64_t i = it / Hk, doc = pk->first_doc + i;
            const int cont_in = i == 0 && pk->cont_first, cont_out = i + 1 == pk->n && pk->cont_last;
            const gdn_range rg = {0, pk->start[i], pk->start[i + 1], piece_h0(pk, i, ns, h0, s_in),
                                  cont_out ? ds_out : dht ? dht + doc * ns : NULL,
                                  cont_in ? ds_in : dh0 ? dh0 + doc * ns : NULL,
                                  ckpt ? ckpt + pk->ckpt_first[i] * KV : NULL, pk->ckpt_rows};
            gdn_backward_item(p, &p->ws[tid], &p->bws[tid], &in, &gr, &rg, it % Hk);
        }
        gdn_fp_fast_end(fm);
    }
    if (!c->check_finite) return GDN_OK;
    int found = 0;
    for (int t = 0; t < p->threads; t++) found |= p->ws[t].nonfinite | p->bws[t].nonfinite;
    if (!found) return GDN_OK;
    const int64_t nv = c->T * Hv * c->V;
    if ((rc = gdn_check_tensor("do", dout, nv, 1, c->threads))) return rc;
    const int64_t nqk = c->T * Hk * c->K, ng = c->T * Hv;
    const struct { const char *name; const float *x; int64_t n; } outs[] = {
        {"dq", dq, nqk}, {"dk", dk, nqk}, {"dv", dv, nv}, {"dg", dg, ng}, {"dbeta", dbeta, ng}};
    if ((rc = gdn_check_inputs(p, q, k, v, g, beta, h0))) return rc;
    for (int i = 0; i < 5; i++)
        if ((rc = check_output(outs[i].name, outs[i].x, outs[i].n, p->threads))) return rc;
    return explain_nonfinite(p, q, k, v, g, beta, h0, "dh0", NULL, 0);
}

int gdn_packed_adjoint_first(gdn_plan *p, float *sg, const float *q, const float *k,
                             const float *g, const float *beta, const float *dout,
                             const float *dht) {
    const gdn_config *c = &p->cfg;
    const gdn_pack *pk = &p->pack;
    const int64_t Hv = c->Hv, KV = c->K * c->V;
    const float *ds_end = dht && piece_ends_doc(pk, 0) ? dht + pk->first_doc * Hv * KV : NULL;
    const gdn_inputs in = {q, k, NULL, g, beta};
    const gdn_grads gr = {NULL, NULL, NULL, NULL, NULL, NULL, dout, NULL, NULL, NULL};
#pragma omp parallel num_threads(p->threads)
    {
        const gdn_fpmode fm = gdn_fp_fast_begin();
#pragma omp for schedule(dynamic, 1)
        for (int64_t h = 0; h < Hv; h++) {
            const int tid = gdn_thread_id();
            gdn_adjoint_item(p, &p->ws[tid], &p->bws[tid], &in, &gr, 0, h, pk->start[0], pk->start[1],
                             ds_end ? ds_end + h * KV : NULL, sg + h * KV);
        }
        gdn_fp_fast_end(fm);
    }
    return GDN_OK;
}

int gdn_plan_set_docs(gdn_plan *p, const int64_t *cu_seqlens, int64_t n_docs, int64_t seq_offset) {
    if (!p) return gdn_fail(GDN_ERR_ARG, "gdn_plan_set_docs: plan is NULL");
    if (!p->pack.n)
        return gdn_fail(GDN_ERR_ARG, "gdn_plan_set_docs: the plan was made dense (cu_seqlens NULL); make it with "
                        "offsets (e.g. one document {0, T}) to change its documents later");
    if (!cu_seqlens) return gdn_fail(GDN_ERR_ARG, "gdn_plan_set_docs: cu_seqlens is NULL");
    gdn_config c = p->cfg;
    c.cu_seqlens = cu_seqlens, c.n_docs = n_docs, c.seq_offset = seq_offset;
    int rc = gdn_pack_check(&c);
    if (rc) return rc;
    /* Build the new pieces beside the old ones, so that a failure leaves the plan as it was
     * (never silently dense). */
    const gdn_pack old = p->pack;
    const gdn_config old_cfg = p->cfg;
    memset(&p->pack, 0, sizeof p->pack);
    p->cfg = c;
    rc = gdn_pack_init(p);
    if (!rc && p->pack.ckpt_rows > p->pack_ckpt_cap) /* cannot happen: see pack_ckpt_cap */
        rc = gdn_fail(GDN_ERR_SHAPE, "gdn_plan_set_docs: %lld saved-state rows exceed the plan's %lld",
                      (long long)p->pack.ckpt_rows, (long long)p->pack_ckpt_cap);
    if (rc) {
        gdn_pack_free(p);
        p->pack = old, p->cfg = old_cfg;
        return rc;
    }
    free(old.cu);
    free(old.start);
    free(old.ckpt_first);
    return GDN_OK;
}
