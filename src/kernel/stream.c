/* The one stream model of the kernel: a plan's tokens are a list of streams, each a run of
 * tokens of one batch row whose state starts at its first token — one per batch row for a dense
 * plan, one per document (or part of a document, in a context-parallel shard) for packed
 * documents (cu_seqlens, as flash-linear-attention). Every stream is chunked from its own first
 * token, so a reset never falls inside a chunk and the chunk machinery runs unchanged; streams
 * are independent work items (with the key heads and column blocks), which keeps all threads busy
 * even with few heads. The forward, the backward and the adjoint over the streams run here; the
 * public entry points are rule.c, the input checks rule_check.c. */
#include "kernel_internal.h"

#include <string.h>

int64_t gdn_state_floats(const gdn_config *c) {
    return (c->cu_seqlens ? c->n_docs : c->B) * c->Hv * c->K * c->V;
}

void gdn_streams_free(gdn_plan *p) {
    free(p->streams.cu);
    free(p->streams.s);
    free(p->streams.run);
    memset(&p->streams, 0, sizeof p->streams);
}

/* The last d with cu[d] <= t (binary search over the n documents). */
static int64_t doc_of(const int64_t *cu, int64_t n, int64_t t) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (cu[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

int gdn_streams_init(gdn_plan *p) {
    gdn_config *c = &p->cfg;
    gdn_streams *st = &p->streams;
    const int64_t C = c->chunk, t0 = c->seq_offset, t1 = t0 + c->T;
    int64_t first = 0, n = c->B;
    if (c->cu_seqlens) {
        const int64_t nd = c->n_docs;
        st->cu = gdn_malloc("stream: st->cu", sizeof(int64_t) * (nd + 1));
        if (!st->cu) return gdn_fail(GDN_ERR_NOMEM, "cu_seqlens copy (%lld documents)", (long long)nd);
        memcpy(st->cu, c->cu_seqlens, sizeof(int64_t) * (nd + 1));
        c->cu_seqlens = st->cu;
        st->packed = 1;
        first = doc_of(st->cu, nd, t0);
        n = doc_of(st->cu, nd, t1 - 1) - first + 1;
        st->first_doc = first;
    }
    st->s = gdn_calloc("stream: st->s", (size_t)n, sizeof *st->s);
    st->run = gdn_malloc("stream: st->run", sizeof(int64_t) * (size_t)n);
    if (!st->s || !st->run) return gdn_fail(GDN_ERR_NOMEM, "the plan's %lld streams", (long long)n);
    st->n = n;
    int64_t rows = 0;
    for (int64_t i = 0; i < n; i++) {
        gdn_stream *s = &st->s[i];
        if (st->packed) { /* B = 1: document first + i, cut to the plan's tokens */
            const int64_t d = first + i, a = st->cu[d], e = st->cu[d + 1];
            *s = (gdn_stream){.b = 0, .t_begin = (a > t0 ? a : t0) - t0, .t_end = (e < t1 ? e : t1) - t0,
                              .row = d, .cont_in = a < t0, .cont_out = e > t1, .last = i + 1 == n};
        } else {
            *s = (gdn_stream){.b = i, .t_begin = 0, .t_end = c->T, .row = i, .last = 1};
        }
        s->ckpt_first = rows;
        const int64_t nchunks = (s->t_end - s->t_begin + C - 1) / C;
        rows += (nchunks + p->save_chunks - 1) / p->save_chunks - 1; /* the first starts from h0 */
    }
    st->ckpt_rows = rows;
    return GDN_OK;
}

/* The state a stream enters with ([Hv, K, V] base; NULL: zeros) and the one its gradient goes
 * to: a stream that continues a document begun before the plan's tokens takes s_in (per batch
 * row), the others their row of h0. */
static const float *stream_h0(const gdn_stream *s, int64_t ns, const float *h0, const float *s_in) {
    if (s->cont_in) return s_in ? s_in + s->b * ns : NULL;
    return h0 ? h0 + s->row * ns : NULL;
}

int gdn_streams_forward(gdn_plan *p, float *o, float *ht, float *ckpt, const float *q,
                        const float *k, const float *v, const float *g, const float *beta,
                        const float *h0, const float *s_in, float *s_out) {
    const gdn_config *c = &p->cfg;
    const gdn_streams *st = &p->streams;
    const int64_t Hv = c->Hv, Hk = c->Hk, r = Hv / Hk, K = c->K, V = c->V, KV = K * V, ns = Hv * KV;
    /* NULLs and h0 now; q, k, v, g, beta and o are checked for NaN/Inf inside the loop, on the
     * rows it touches anyway (separate passes over them cost ~8 % with 2 threads), and scanned
     * exactly only when something was found, to name the tensor and the element. */
    int rc;
    if ((rc = gdn_check_tensor("q", q, 0, 0, 1)) || (rc = gdn_check_tensor("k", k, 0, 0, 1)) ||
        (rc = gdn_check_tensor("v", v, 0, 0, 1)) || (rc = gdn_check_tensor("g", g, 0, 0, 1)) ||
        (rc = gdn_check_tensor("beta", beta, 0, 0, 1)) ||
        (h0 && (rc = gdn_check_tensor("h0", h0, gdn_state_floats(c), c->check_finite, c->threads))))
        return rc;
    for (int t = 0; t < p->threads; t++) p->ws[t].nonfinite = 0;
    /* Without outputs or saved states only the streams whose final state is wanted run (a CP
     * fold of a packed shard needs only its last document: the resets make the others
     * irrelevant to it). */
    int64_t *run = st->run, nrun = 0;
    for (int64_t i = 0; i < st->n; i++)
        if (o || ckpt || (ht && !st->s[i].cont_out) || (s_out && st->s[i].last)) run[nrun++] = i;
    /* One work item per (stream, key head, column block): its r value heads share the key side
     * of every chunk. */
    const int bw = gdn_column_block_width(p, nrun * Hk, (int)V);
    const int nblk = (int)((V + bw - 1) / bw);
    const int64_t items = nrun * Hk * nblk;
    const gdn_chunk_inputs in = {q, k, v, g, beta};
    const int64_t seg_tokens = (int64_t)p->save_chunks * c->chunk;
#pragma omp parallel num_threads(p->threads)
    {
        const gdn_fpmode fm = gdn_fp_fast_begin();
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            gdn_chunk_ws *ws = &p->ws[gdn_thread_id()];
            ws->bf16 = p->bf16_path; /* this sweep's products in the plan's precision */
            const gdn_stream *s = &st->s[run[it / (Hk * nblk)]];
            const int64_t h = (it / nblk) % Hk * r;
            const int c0 = (int)(it % nblk) * bw;
            const int w = (int)(V - c0 < bw ? V - c0 : bw);
            const float *init = stream_h0(s, ns, h0, s_in);
            for (int64_t j = 0; j < r; j++) {
                float *S = ws->state + j * K * w;
                const float *src = init ? init + (h + j) * KV + c0 : NULL;
                for (int64_t a = 0; a < K; a++)
                    for (int jj = 0; jj < w; jj++) S[a * w + jj] = src ? src[a * V + jj] : 0.0f;
            }
            if (!ckpt) {
                gdn_chunk_stream(p, ws, &in, s->b, h, (int)r, c0, w, s->t_begin, s->t_end, o);
            } else { /* segment by segment from the stream's start, keeping each start's state */
                for (int64_t seg = 0; s->t_begin + seg * seg_tokens < s->t_end; seg++) {
                    for (int64_t j = 0; seg > 0 && j < r; j++)
                        for (int64_t a = 0; a < K; a++)
                            memcpy(ckpt + (((h + j) * st->ckpt_rows + s->ckpt_first + seg - 1) * K + a) * V + c0,
                                   ws->state + (j * K + a) * w, sizeof(float) * w);
                    const int64_t a0 = s->t_begin + seg * seg_tokens;
                    const int64_t a1 = a0 + seg_tokens < s->t_end ? a0 + seg_tokens : s->t_end;
                    gdn_chunk_stream(p, ws, &in, s->b, h, (int)r, c0, w, a0, a1, o);
                }
            }
            float *dst[2] = {ht && !s->cont_out ? ht + s->row * ns : NULL, s_out && s->last ? s_out + s->b * ns : NULL};
            for (int d = 0; d < 2; d++)
                for (int64_t j = 0; dst[d] && j < r; j++)
                    for (int64_t a = 0; a < K; a++)
                        memcpy(dst[d] + (h + j) * KV + a * V + c0, ws->state + (j * K + a) * w, sizeof(float) * w);
            ws->bf16 = 0; /* the backward's and the summaries' sweeps stay fp32 */
        }
        gdn_fp_fast_end(fm);
    }
    if (c->check_finite) {
        int found = 0;
        for (int t = 0; t < p->threads; t++) found |= p->ws[t].nonfinite;
        if (found) {
            const gdn_named_output outs[] = {{"o", o, c->B * c->T * Hv * V}};
            return gdn_streams_explain_nonfinite(p, &in, h0, NULL, outs, 1, NULL);
        }
        for (int64_t i = 0; ht && i < st->n; i++)
            if (!st->s[i].cont_out && (rc = gdn_check_output("ht", ht + st->s[i].row * ns, ns, c->threads))) return rc;
    }
    return GDN_OK;
}

int gdn_streams_backward(gdn_plan *p, float *dq, float *dk, float *dv, float *dg, float *dbeta,
                         float *dh0, const float *q, const float *k, const float *v,
                         const float *g, const float *beta, const float *h0, const float *s_in,
                         const float *ckpt, const float *dout, const float *dht,
                         const float *ds_out, float *ds_in) {
    if (!dq || !dk || !dv || !dg || !dbeta)
        return gdn_fail(GDN_ERR_ARG, "gradient output '%s' is NULL",
                        !dq ? "dq" : !dk ? "dk" : !dv ? "dv" : !dg ? "dg" : "dbeta");
    const gdn_config *c = &p->cfg;
    const gdn_streams *st = &p->streams;
    const int64_t Hv = c->Hv, Hk = c->Hk, KV = c->K * c->V, ns = Hv * KV, nst = gdn_state_floats(c);
    /* NULLs and the small state tensors now; q, k, v, g, beta, do and the gradients are checked
     * for NaN/Inf inside the loop on the rows it touches anyway, and scanned exactly only when
     * something was found, to name the tensor and the element (as the forward does). */
    int rc;
    if ((rc = gdn_check_tensor("q", q, 0, 0, 1)) || (rc = gdn_check_tensor("k", k, 0, 0, 1)) ||
        (rc = gdn_check_tensor("v", v, 0, 0, 1)) || (rc = gdn_check_tensor("g", g, 0, 0, 1)) ||
        (rc = gdn_check_tensor("beta", beta, 0, 0, 1)) || (rc = gdn_check_tensor("do", dout, 0, 0, 1)) ||
        (h0 && (rc = gdn_check_tensor("h0", h0, nst, c->check_finite, c->threads))) ||
        (dht && (rc = gdn_check_tensor("dht", dht, nst, c->check_finite, c->threads))))
        return rc;
    for (int t = 0; t < p->threads; t++) p->ws[t].nonfinite = p->bws[t].nonfinite = 0;
    const gdn_chunk_inputs in = {q, k, v, g, beta};
    const gdn_chunk_grads gr = {dq, dk, dv, dg, dbeta, NULL, dout, NULL, NULL, NULL};
    const int64_t items = st->n * Hk;
#pragma omp parallel num_threads(p->threads)
    {
        const gdn_fpmode fm = gdn_fp_fast_begin();
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int tid = gdn_thread_id();
            const gdn_stream *s = &st->s[it / Hk];
            const gdn_range rg = {s->b, s->t_begin, s->t_end, stream_h0(s, ns, h0, s_in),
                                  s->cont_out ? (ds_out ? ds_out + s->b * ns : NULL) : dht ? dht + s->row * ns : NULL,
                                  s->cont_in ? (ds_in ? ds_in + s->b * ns : NULL) : dh0 ? dh0 + s->row * ns : NULL,
                                  ckpt ? ckpt + s->ckpt_first * KV : NULL, st->ckpt_rows};
            gdn_backward_item(p, &p->ws[tid], &p->bws[tid], &in, &gr, &rg, it % Hk);
        }
        gdn_fp_fast_end(fm);
    }
    if (!c->check_finite) return GDN_OK;
    int found = 0;
    for (int t = 0; t < p->threads; t++) found |= p->ws[t].nonfinite | p->bws[t].nonfinite;
    if (!found) return GDN_OK;
    const int64_t nqk = c->B * c->T * Hk * c->K, nv = c->B * c->T * Hv * c->V, ng = c->B * c->T * Hv;
    const gdn_named_output outs[] = {{"dq", dq, nqk}, {"dk", dk, nqk}, {"dv", dv, nv}, {"dg", dg, ng},
                                     {"dbeta", dbeta, ng}};
    return gdn_streams_explain_nonfinite(p, &in, h0, dout, outs, 5, dh0);
}

int gdn_streams_adjoint_first(gdn_plan *p, float *sg, const float *q, const float *k,
                              const float *g, const float *beta, const float *dout,
                              const float *dht) {
    const gdn_config *c = &p->cfg;
    const gdn_streams *st = &p->streams;
    const int64_t Hv = c->Hv, KV = c->K * c->V;
    /* every row's first stream: stream 0 of a packed plan, each batch row's of a dense one */
    int64_t *first = st->run, nf = 0;
    for (int64_t i = 0; i < st->n; i++)
        if (i == 0 || st->s[i - 1].b != st->s[i].b) first[nf++] = i;
    const gdn_chunk_inputs in = {q, k, NULL, g, beta};
    const gdn_chunk_grads gr = {NULL, NULL, NULL, NULL, NULL, NULL, dout, NULL, NULL, NULL};
    const int64_t items = nf * Hv;
#pragma omp parallel num_threads(p->threads)
    {
        const gdn_fpmode fm = gdn_fp_fast_begin();
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int tid = gdn_thread_id();
            const gdn_stream *s = &st->s[first[it / Hv]];
            const int64_t h = it % Hv;
            const float *ds_end = dht && !s->cont_out ? dht + (s->row * Hv + h) * KV : NULL;
            gdn_adjoint_item(p, &p->ws[tid], &p->bws[tid], &in, &gr, s->b, h, s->t_begin, s->t_end, ds_end,
                             sg + (s->b * Hv + h) * KV);
        }
        gdn_fp_fast_end(fm);
    }
    return GDN_OK;
}

void gdn_streams_set_shard(gdn_plan *p, int first_shard, int last_shard) {
    if (p->streams.packed) return; /* the documents and seq_offset place a packed shard */
    for (int64_t i = 0; i < p->streams.n; i++) {
        p->streams.s[i].cont_in = !first_shard;
        p->streams.s[i].cont_out = !last_shard;
    }
}
