/* Packed documents (cu_seqlens) over ranks: a rank may hold many documents, part of one, or lie
 * inside one. The affine view still holds with resets: a shard that contains a document start
 * forgets its incoming state, so its map is the constant (0, state after its last piece) — for
 * which only that last piece runs — and its adjoint map is the constant (0, the gradient piece
 * 0 sends back when piece 0 continues a document, else 0). A shard inside one document has the
 * dense pair. The scan then carries the resets by itself: composing with a constant map drops
 * everything before it. Document d's h0 is applied on the rank where d starts, its final state
 * comes from the rank where it ends; both are gathered so every rank holds all of them. The
 * heads strategy goes to heads.c (the whole stream per block of heads, no maps). */
#include "cp_internal.h"

#include <limits.h>
#include <string.h>

static double now(void) { return MPI_Wtime(); }

/* First index i in [0, n) with cu[i] >= x, n if none (cu strictly increasing). */
static int64_t lower_bound(const int64_t *cu, int64_t n, int64_t x) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (cu[mid] < x) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

void gdn_cp_doc_ranges(const gdn_cp *cp, const gdn_config *c, int ending, int *count, int *displ) {
    const int64_t nd = c->n_docs, *cu = c->cu_seqlens;
    int64_t t = 0;
    for (int r = 0; r < cp->size; r++) {
        const int64_t t1 = t + cp->shard_T[r];
        /* ending: cu[d + 1] in (t, t1]; starting: cu[d] in [t, t1) */
        const int64_t d0 = ending ? lower_bound(cu, nd + 1, t + 1) - 1 : lower_bound(cu, nd + 1, t);
        const int64_t d1 = ending ? lower_bound(cu, nd + 1, t1 + 1) - 1 : lower_bound(cu, nd + 1, t1);
        count[r] = (int)(d1 - d0), displ[r] = (int)d0;
        t = t1;
    }
}

/* The MPI datatype of one per-document state (Hv K V floats), made before the agreement step
 * that precedes the gather (a local failure must not strand the other ranks in it). The sizes
 * are agreed values: every rank refuses alike. */
static int state_type(const gdn_config *c, MPI_Datatype *type) {
    *type = MPI_DATATYPE_NULL;
    const int64_t nd = c->n_docs, ns = c->Hv * c->K * c->V;
    if (nd > INT_MAX || ns > INT_MAX)
        return gdn_fail(GDN_ERR_SHAPE, "cu_seqlens: %lld documents of %lld-float states exceed MPI's int counts",
                        (long long)nd, (long long)ns);
    if (GDN_CP_MPI_TYPE("cp packed: MPI datatype", MPI_Type_contiguous((int)ns, MPI_FLOAT, type)) != MPI_SUCCESS) {
        *type = MPI_DATATYPE_NULL;
        return gdn_fail(GDN_ERR_MPI, "MPI_Type_contiguous failed (per-document states)");
    }
    if (MPI_Type_commit(type) != MPI_SUCCESS) {
        MPI_Type_free(type);
        return gdn_fail(GDN_ERR_MPI, "MPI_Type_commit failed (per-document states)");
    }
    return GDN_OK;
}

/* Every rank's documents that end (ending = 1) or start within its tokens: contiguous ranges
 * of document indices, gathered in place into buf [n_docs, Hv, K, V] from their owners. */
static int gather_docs(gdn_cp *cp, const gdn_config *c, float *buf, int ending, MPI_Datatype state) {
    const int D = cp->size;
    const int64_t nd = c->n_docs, ns = c->Hv * c->K * c->V;
    int *count = cp->counts, *displ = count + D; /* preallocated (gdn_cp_create) */
    gdn_cp_doc_ranges(cp, c, ending, count, displ);
    int rc = GDN_OK;
    const double t0 = now();
    if (MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, count, displ, state, cp->comm) != MPI_SUCCESS)
        rc = gdn_fail(GDN_ERR_MPI, "MPI_Allgatherv failed (per-document %s)", ending ? "final states" : "dh0");
    cp->stats.comm_s += now() - t0;
    cp->stats.bytes_sent += 4 * (uint64_t)count[cp->rank] * ns * (D - 1), cp->stats.messages += D - 1;
    cp->stats.bytes_recv += 4 * (uint64_t)(nd - count[cp->rank]) * ns, cp->stats.rounds++;
    return rc;
}

int gdn_cp_packed_forward(gdn_cp *cp, gdn_plan *plan, float *o, float *ht, float *s_in,
                          const float *q, const float *k, const float *v, const float *g,
                          const float *beta, const float *h0) {
    if (cp->strategy == GDN_CP_HEADS) /* (agreed) the whole stream per head block: heads.c */
        return gdn_cp_heads_forward(cp, plan, o, ht, s_in, q, k, v, g, beta, h0);
    int rc = GDN_OK;
    const gdn_config *c = gdn_plan_config(plan);
    const gdn_pack *pk = &plan->pack;
    const int D = cp->size, r = cp->rank, relay = cp->strategy == GDN_CP_RELAY;
    const int64_t nm = c->Hv, K = c->K, V = c->V, ns = nm * K * V, na = nm * K * K, pair = na + ns;
    MPI_Datatype st = MPI_DATATYPE_NULL;
    /* (a failure here meets the other ranks' first collective, the fold's agreement step) */
    float *mine = gdn_cp_calloc((size_t)(pair + 2 * ns), sizeof(float), "cp packed forward: pair and states");
    if (!mine) return gdn_cp_agree_status(cp, gdn_fail(GDN_ERR_NOMEM, "cp pair (%lld floats)", (long long)pair));
    float *incoming = mine + pair, *out_state = incoming + ns;
    /* 1. Fold (the last rank's map is needed by nobody; relay passes states instead, but a relay
     *    rank where a document starts knows the state it passes on now: its last piece's). */
    const int inside = pk->n == 1 && pk->cont_first, early = relay && r + 1 < D && !inside;
    double t0 = now();
    if (r < D - 1 && !relay) {
        if (inside) /* inside one document: the dense pair */
            rc = gdn_summary(plan, mine, mine + na, q, k, v, g, beta);
        else /* a document starts here: (0, the last piece's final state), A left zero */
            rc = gdn_packed_forward(plan, NULL, NULL, NULL, q, k, v, g, beta, h0, NULL, mine + na);
    } else if (early) {
        rc = gdn_packed_forward(plan, NULL, NULL, NULL, q, k, v, g, beta, h0, NULL, out_state);
    }
    cp->stats.fold_s += now() - t0;
    if (!rc) rc = gdn_cp_combine_reserve(cp, nm, K, V);
    if ((rc = gdn_cp_agree_status(cp, rc))) goto done;

    /* 2. Combine (rank 0 starts document 0: its map is constant, as the scan needs). Relay: the
     *    early state goes on before this rank waits for its own (sends only go up the ranks, so the
     *    last rank, which sends nothing, unblocks them all). */
    if (relay) {
        if (early) rc = gdn_cp_sendrecv(cp, out_state, ns, r + 1, NULL, 0, MPI_PROC_NULL);
        if (!rc && r >= 1) rc = gdn_cp_sendrecv(cp, NULL, 0, MPI_PROC_NULL, incoming, ns, r - 1);
    } else {
        rc = gdn_cp_combine(cp, mine, incoming, nm, K, V, +1);
    }
    /* 3. Replay from the true incoming state (used only when piece 0 continues a document). */
    if (!rc) {
        if (r >= 1 && cp->fault == GDN_CP_FAULT_DROP_INCOMING) memset(incoming, 0, sizeof(float) * ns);
        t0 = now();
        if (o) rc = gdn_packed_forward(plan, o, ht, NULL, q, k, v, g, beta, h0, incoming, out_state);
        else if (relay && r + 1 < D && !early) /* the state must travel on */
            rc = gdn_packed_forward(plan, NULL, NULL, NULL, q, k, v, g, beta, h0, incoming, out_state);
        cp->stats.replay_s += now() - t0;
    }
    if (!rc && relay && r + 1 < D && !early) rc = gdn_cp_sendrecv(cp, out_state, ns, r + 1, NULL, 0, MPI_PROC_NULL);
    if (relay) cp->stats.rounds = D - 1;
    if (!rc && o && ht) rc = state_type(c, &st);
    if ((rc = gdn_cp_agree_status(cp, rc))) goto done;
    if (o && ht) rc = gather_docs(cp, c, ht, 1, st); /* ht given on every rank or none: agreed */
    if (!rc && s_in) { /* the state this shard's first token starts from */
        const float *src = pk->cont_first ? incoming : h0 ? h0 + pk->first_doc * ns : NULL;
        if (src) memcpy(s_in, src, sizeof(float) * ns);
        else memset(s_in, 0, sizeof(float) * ns);
    }
done:
    if (st != MPI_DATATYPE_NULL) MPI_Type_free(&st);
    free(mine);
    return rc;
}

int gdn_cp_packed_backward(gdn_cp *cp, gdn_plan *plan, float *dq, float *dk, float *dv, float *dg,
                           float *dbeta, float *dh0, const float *q, const float *k, const float *v,
                           const float *g, const float *beta, const float *h0, const float *s_in,
                           const float *dout, const float *dht) {
    if (cp->strategy == GDN_CP_HEADS) /* (agreed) s_in unused: heads forms no incoming state */
        return gdn_cp_heads_backward(cp, plan, dq, dk, dv, dg, dbeta, dh0, q, k, v, g, beta, h0, dout, dht);
    int rc = GDN_OK;
    const gdn_config *c = gdn_plan_config(plan);
    const gdn_pack *pk = &plan->pack;
    const int D = cp->size, r = cp->rank, relay = cp->strategy == GDN_CP_RELAY;
    const int64_t nm = c->Hv, K = c->K, V = c->V, ns = nm * K * V, na = nm * K * K, pair = na + ns;
    MPI_Datatype st = MPI_DATATYPE_NULL;
    /* (a failure here meets the other ranks' first collective: the recompute's or the fold's
     * agreement step) */
    float *mine = gdn_cp_calloc((size_t)(pair + 3 * ns + na), sizeof(float), "cp packed backward: pair and states");
    if (!mine) return gdn_cp_agree_status(cp, gdn_fail(GDN_ERR_NOMEM, "cp pair (%lld floats)", (long long)pair));
    float *ds_out = mine + pair, *state_in = ds_out + ns, *dsin = state_in + ns, *A = dsin + ns;
    gdn_cp_stats fwd = {0};
    if (s_in) {
        memcpy(state_in, s_in, sizeof(float) * ns);
    } else { /* the incoming state again, by the forward's fold and combine (reported as theirs) */
        rc = gdn_cp_packed_forward(cp, plan, NULL, NULL, state_in, q, k, v, g, beta, h0);
        fwd = cp->stats;
        if (rc) goto done;
    }
    cp->stats = fwd;
    /* 1. Fold: the adjoint pair (A^T, G) of ranks after the first (rank 0's is needed by nobody).
     *    Relay: a rank where a document ends (before its last token) knows the gradient it sends
     *    back now: piece 0's, or zero when a document starts at its first token. */
    const int early = relay && r > 0 && !(pk->n == 1 && pk->cont_first && pk->cont_last);
    double t0 = now();
    if (early && pk->cont_first) {
        rc = gdn_packed_adjoint_first(plan, dsin, q, k, g, beta, dout, dht);
    } else if (r > 0 && !relay) {
        if (pk->n == 1 && pk->cont_first && pk->cont_last) { /* inside one document: dense */
            rc = gdn_summary(plan, A, NULL, q, k, NULL, g, beta);
            for (int64_t m = 0; !rc && m < nm; m++)
                gdn_transpose((int)K, (int)K, A + m * K * K, (int)K, mine + m * K * K, (int)K);
            if (!rc) rc = gdn_summary_adjoint(plan, mine + na, q, k, g, beta, dout);
        } else if (pk->cont_first) { /* piece 0's gradient; nothing after it reaches back */
            rc = gdn_packed_adjoint_first(plan, mine + na, q, k, g, beta, dout, dht);
        } /* else the shard starts a document: no gradient flows to the ranks before it */
    }
    cp->stats.fold_s += now() - t0;
    if (!rc) rc = gdn_cp_combine_reserve(cp, nm, K, V);
    if ((rc = gdn_cp_agree_status(cp, rc))) goto done;

    /* 2. Combine in reverse rank order (the last rank ends the last document: constant map). */
    if (relay) { /* (the early gradient first: sends only go down the ranks; rank 0 sends none) */
        if (early) rc = gdn_cp_sendrecv(cp, dsin, ns, r - 1, NULL, 0, MPI_PROC_NULL);
        if (!rc && r < D - 1) rc = gdn_cp_sendrecv(cp, NULL, 0, MPI_PROC_NULL, ds_out, ns, r + 1);
    } else {
        rc = gdn_cp_combine(cp, mine, ds_out, nm, K, V, -1);
    }
    /* 3. Local backward: ds_out feeds the last piece when its document goes on. */
    if (!rc) {
        if (r < D - 1 && cp->fault == GDN_CP_FAULT_DROP_GRADIENT) memset(ds_out, 0, sizeof(float) * ns);
        t0 = now();
        rc = gdn_packed_backward(plan, dq, dk, dv, dg, dbeta, dh0, q, k, v, g, beta, h0, state_in, NULL, dout,
                                 dht, ds_out, dsin);
        cp->stats.replay_s += now() - t0;
    }
    if (!rc && relay && r > 0 && !early) rc = gdn_cp_sendrecv(cp, dsin, ns, r - 1, NULL, 0, MPI_PROC_NULL);
    if (relay) cp->stats.rounds = D - 1;
    if (!rc && dh0) rc = state_type(c, &st);
    if ((rc = gdn_cp_agree_status(cp, rc))) goto done;
    if (dh0) rc = gather_docs(cp, c, dh0, 0, st); /* dh0 given on every rank or none: agreed */
done:
    if (st != MPI_DATATYPE_NULL) MPI_Type_free(&st);
    free(mine);
    return rc;
}
