/* The gated delta rule over ranks for the scan, allgather and relay strategies (the heads
 * strategy is heads.c), dense rows and packed documents alike: a shard is its plan's streams
 * (stream.c), placed in the split (a dense shard's rows continue from the ranks before and go on
 * to the ranks after; a packed shard's documents say where they start and end).
 *
 * The affine view holds with resets: a shard whose every stream continues from the shard before
 * (a dense shard after the first, a shard inside one document) has the dense pair (A, B); a
 * shard where a stream starts afresh (rank 0; a document start) forgets its incoming state, so
 * its map is the constant (0, the state after each row's last stream), for which only that last
 * stream runs. Its adjoint map likewise: the dense adjoint pair (A^T, G) inside, else the
 * constant (0, the gradient each row's first stream sends back when it continues, else 0). The
 * scan then carries the resets by itself: composing with a constant map drops everything before
 * it. A row's initial state (h0) is applied where its stream starts, its final state comes from
 * where it ends; under packing both are per document and gathered so every rank holds all. */
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
    const int D = cp->size;
    if (!c->cu_seqlens) { /* dense: every row starts on rank 0 and ends on the last rank */
        for (int r = 0; r < D; r++) {
            const int owner = ending ? r == D - 1 : r == 0;
            count[r] = owner ? (int)c->B : 0, displ[r] = 0;
        }
        return;
    }
    const int64_t nd = c->n_docs, *cu = c->cu_seqlens;
    int64_t t = 0;
    for (int r = 0; r < D; r++) {
        const int64_t t1 = t + cp->shard_T[r];
        /* ending: cu[d + 1] in (t, t1]; starting: cu[d] in [t, t1) */
        const int64_t d0 = ending ? lower_bound(cu, nd + 1, t + 1) - 1 : lower_bound(cu, nd + 1, t);
        const int64_t d1 = ending ? lower_bound(cu, nd + 1, t1 + 1) - 1 : lower_bound(cu, nd + 1, t1);
        count[r] = (int)(d1 - d0), displ[r] = (int)d0;
        t = t1;
    }
}

/* The MPI datatype of one row's state (Hv K V floats), made before the agreement step that
 * precedes the gather (a local failure must not strand the other ranks in it). The sizes are
 * agreed values: every rank refuses alike. */
static int state_type(const gdn_config *c, MPI_Datatype *type) {
    *type = MPI_DATATYPE_NULL;
    const int64_t nd = c->cu_seqlens ? c->n_docs : c->B, ns = c->Hv * c->K * c->V;
    if (nd > INT_MAX || ns > INT_MAX)
        return gdn_fail(GDN_ERR_SHAPE, "%lld rows of %lld-float states exceed MPI's int counts", (long long)nd,
                        (long long)ns);
    if (GDN_CP_MPI_TYPE("cp rows: MPI datatype", MPI_Type_contiguous((int)ns, MPI_FLOAT, type)) != MPI_SUCCESS) {
        *type = MPI_DATATYPE_NULL;
        return gdn_fail(GDN_ERR_MPI, "MPI_Type_contiguous failed (per-row states)");
    }
    if (MPI_Type_commit(type) != MPI_SUCCESS) {
        MPI_Type_free(type);
        return gdn_fail(GDN_ERR_MPI, "MPI_Type_commit failed (per-row states)");
    }
    return GDN_OK;
}

/* Every rank's rows (batch rows, or documents) that end (ending = 1) or start within its tokens:
 * contiguous ranges of row indices, gathered in place into buf [rows, Hv, K, V] from their
 * owners. */
static int gather_rows(gdn_cp *cp, const gdn_config *c, float *buf, int ending, MPI_Datatype state) {
    const int D = cp->size;
    const int64_t nd = c->cu_seqlens ? c->n_docs : c->B, ns = c->Hv * c->K * c->V;
    int *count = cp->counts, *displ = count + D; /* preallocated (gdn_cp_create) */
    gdn_cp_doc_ranges(cp, c, ending, count, displ);
    int rc = GDN_OK;
    const double t0 = now();
    if (gdn_cp_allgatherv_in_place(cp, buf, count, displ, state) != MPI_SUCCESS)
        rc = gdn_fail(GDN_ERR_MPI, "MPI_Allgatherv failed (per-row %s)", ending ? "final states" : "dh0");
    cp->stats.comm_s += now() - t0;
    cp->stats.bytes_sent += 4 * (uint64_t)count[cp->rank] * ns * (D - 1), cp->stats.messages += D - 1;
    cp->stats.bytes_recv += 4 * (uint64_t)(nd - count[cp->rank]) * ns; /* (not a round of the strategy) */
    return rc;
}

/* Every stream continues from the shard before (each row is one stream through the shard's
 * first token); and, with `through`, also goes on after it. */
static int continues(const gdn_streams *st, int through) {
    for (int64_t i = 0; i < st->n; i++)
        if (!st->s[i].cont_in || (through && !st->s[i].cont_out)) return 0;
    return 1;
}

int gdn_cp_rule_forward(gdn_cp *cp, gdn_plan *plan, float *o, float *ht, float *s_in,
                        const float *q, const float *k, const float *v, const float *g,
                        const float *beta, const float *h0) {
    int rc = GDN_OK;
    const gdn_config *c = gdn_plan_config(plan);
    const gdn_streams *st = &plan->streams;
    const int D = cp->size, r = cp->rank, relay = c->cp == GDN_CP_RELAY;
    gdn_streams_set_shard(plan, r == 0, r == D - 1);
    const int64_t nm = c->B * c->Hv, K = c->K, V = c->V, KV = K * V, ns = nm * KV, na = nm * K * K, pair = na + ns;
    MPI_Datatype st_type = MPI_DATATYPE_NULL;
    /* (a failure here meets the other ranks' first collective, the fold's agreement step) */
    float *mine = gdn_calloc("cp forward: pair and states", (size_t)(pair + 2 * ns), sizeof(float));
    if (!mine) return gdn_cp_agree_status(cp, gdn_fail(GDN_ERR_NOMEM, "cp pair (%lld floats)", (long long)pair));
    float *incoming = mine + pair, *out_state = incoming + ns;
    /* 1. Fold (the last rank's map is needed by nobody; relay passes states instead, but a relay
     *    rank where a stream starts afresh knows the state it passes on now: its last stream's). */
    const int inside = continues(st, 0), early = relay && r + 1 < D && !inside;
    double t0 = now();
    if (r < D - 1 && !relay) {
        if (inside) /* every row continues: the dense pair */
            rc = gdn_summary(plan, mine, mine + na,
                             &(gdn_rule_inputs){.q = q, .k = k, .v = v, .g = g, .beta = beta});
        else /* a stream starts here: (0, the last stream's final state), A left zero */
            rc = gdn_streams_forward(plan, NULL, NULL, NULL, q, k, v, g, beta, h0, NULL, mine + na);
    } else if (early) {
        rc = gdn_streams_forward(plan, NULL, NULL, NULL, q, k, v, g, beta, h0, NULL, out_state);
    }
    (D == 1 ? &cp->stats.replay_s : &cp->stats.fold_s)[0] += now() - t0;
    if (!rc) rc = gdn_cp_combine_reserve(cp, c->cp, nm, K, V);
    if ((rc = gdn_cp_agree_status(cp, rc))) goto done;

    /* 2. Combine (rank 0 starts every row afresh: its map is constant, as the scan needs). Relay:
     *    the early state goes on before this rank waits for its own (sends only go up the ranks,
     *    so the last rank, which sends nothing, unblocks them all). */
    if (relay) {
        if (early) rc = gdn_cp_sendrecv(cp, out_state, ns, r + 1, NULL, 0, MPI_PROC_NULL);
        if (!rc && r >= 1) rc = gdn_cp_sendrecv(cp, NULL, 0, MPI_PROC_NULL, incoming, ns, r - 1);
    } else {
        rc = gdn_cp_combine(cp, c->cp, mine, incoming, nm, K, V, +1);
    }
    /* 3. Replay from the true incoming state (used by the streams that continue). */
    if (!rc) {
        if (r >= 1 && gdn_test_mutate("cp: incoming state dropped")) memset(incoming, 0, sizeof(float) * ns);
        t0 = now();
        if (o) rc = gdn_streams_forward(plan, o, ht, NULL, q, k, v, g, beta, h0, incoming, out_state);
        else if (relay && r + 1 < D && !early) /* the state must travel on */
            rc = gdn_streams_forward(plan, NULL, NULL, NULL, q, k, v, g, beta, h0, incoming, out_state);
        cp->stats.replay_s += now() - t0;
    }
    if (!rc && relay && r + 1 < D && !early) rc = gdn_cp_sendrecv(cp, out_state, ns, r + 1, NULL, 0, MPI_PROC_NULL);
    if (relay) cp->stats.rounds = D - 1;
    /* The final states, on every rank from where their rows end: a packed call agreed on ht; a
     * dense call gathers whenever it has outputs (ht may be given on some ranks only). */
    const int gather = o && (ht || !st->packed);
    if (!rc && gather) rc = state_type(c, &st_type);
    if ((rc = gdn_cp_agree_status(cp, rc))) goto done;
    if (gather) rc = gather_rows(cp, c, ht ? ht : out_state, 1, st_type);
    for (int64_t i = 0; !rc && s_in && i < st->n; i++) { /* the state each row's first token starts from */
        const gdn_stream *s = &st->s[i];
        if (i > 0 && st->s[i - 1].b == s->b) continue;
        const float *src = s->cont_in ? incoming + s->b * c->Hv * KV : h0 ? h0 + s->row * c->Hv * KV : NULL;
        if (src) memcpy(s_in + s->b * c->Hv * KV, src, sizeof(float) * c->Hv * KV);
        else memset(s_in + s->b * c->Hv * KV, 0, sizeof(float) * c->Hv * KV);
    }
done:
    if (st_type != MPI_DATATYPE_NULL) MPI_Type_free(&st_type);
    free(mine);
    return rc;
}

int gdn_cp_rule_backward(gdn_cp *cp, gdn_plan *plan, float *dq, float *dk, float *dv, float *dg,
                         float *dbeta, float *ds_in, const float *q, const float *k, const float *v,
                         const float *g, const float *beta, const float *h0, const float *s_in,
                         const float *dout, const float *dht) {
    int rc = GDN_OK;
    const gdn_config *c = gdn_plan_config(plan);
    const gdn_streams *st = &plan->streams;
    const int D = cp->size, r = cp->rank, relay = c->cp == GDN_CP_RELAY;
    const int64_t nm = c->B * c->Hv, K = c->K, V = c->V, ns = nm * K * V, na = nm * K * K, pair = na + ns;
    MPI_Datatype st_type = MPI_DATATYPE_NULL;
    /* (a failure here meets the other ranks' first collective: the recompute's or the fold's
     * agreement step) */
    float *mine = gdn_calloc("cp backward: pair and states", (size_t)(pair + 3 * ns + na), sizeof(float));
    if (!mine) return gdn_cp_agree_status(cp, gdn_fail(GDN_ERR_NOMEM, "cp pair (%lld floats)", (long long)pair));
    float *ds_out = mine + pair, *state_in = ds_out + ns, *dsin = state_in + ns, *A = dsin + ns;
    gdn_cp_stats fwd = {0};
    if (s_in) {
        memcpy(state_in, s_in, sizeof(float) * ns);
    } else { /* the incoming state again, by the forward's fold and combine (reported as theirs) */
        rc = gdn_cp_rule_forward(cp, plan, NULL, NULL, state_in, q, k, v, g, beta, h0);
        fwd = cp->stats;
        if (rc) goto done;
    }
    cp->stats = fwd;
    gdn_streams_set_shard(plan, r == 0, r == D - 1);
    /* 1. Fold: the adjoint pair (A^T, G) of ranks after the first (rank 0's is needed by nobody).
     *    Relay: a rank where a stream ends (before its last token) knows the gradient it sends
     *    back now: its first streams', or zero when they start at its first token. */
    const int inside = continues(st, 1), early = relay && r > 0 && !inside;
    const int first_continues = st->s[0].cont_in; /* every row's first stream alike */
    double t0 = now();
    if (early && first_continues) {
        rc = gdn_streams_adjoint_first(plan, dsin, q, k, g, beta, dout, dht);
    } else if (r > 0 && !relay) {
        if (inside) { /* every row runs through: the dense adjoint pair, A alone transposed */
            const gdn_rule_inputs keys = {.q = q, .k = k, .g = g, .beta = beta}; /* v, h0 not read */
            rc = gdn_summary(plan, A, NULL, &keys);
            for (int64_t m = 0; !rc && m < nm; m++)
                gdn_transpose((int)K, (int)K, A + m * K * K, (int)K, mine + m * K * K, (int)K);
            if (!rc) rc = gdn_summary_adjoint(plan, mine + na, &keys, dout);
        } else if (first_continues) { /* the first streams' gradient; nothing after them reaches back */
            rc = gdn_streams_adjoint_first(plan, mine + na, q, k, g, beta, dout, dht);
        } /* else every stream starts here: no gradient flows to the ranks before */
    }
    (D == 1 ? &cp->stats.replay_s : &cp->stats.fold_s)[0] += now() - t0;
    if (!rc) rc = gdn_cp_combine_reserve(cp, c->cp, nm, K, V);
    if ((rc = gdn_cp_agree_status(cp, rc))) goto done;

    /* 2. Combine in reverse rank order (the last rank ends every row: a constant map). */
    if (relay) { /* (the early gradient first: sends only go down the ranks; rank 0 sends none) */
        if (early) rc = gdn_cp_sendrecv(cp, dsin, ns, r - 1, NULL, 0, MPI_PROC_NULL);
        if (!rc && r < D - 1) rc = gdn_cp_sendrecv(cp, NULL, 0, MPI_PROC_NULL, ds_out, ns, r + 1);
    } else {
        rc = gdn_cp_combine(cp, c->cp, mine, ds_out, nm, K, V, -1);
    }
    /* 3. Local backward: ds_out feeds the streams that go on. A packed call's ds_in is every
     *    document's dh0 (the documents that start here written now, the others gathered); a
     *    dense call's is this rank's gradient of its incoming state (rank 0: dh0). */
    if (!rc) {
        if (r < D - 1 && gdn_test_mutate("cp: incoming state gradient dropped")) memset(ds_out, 0, sizeof(float) * ns);
        t0 = now();
        rc = gdn_streams_backward(plan, dq, dk, dv, dg, dbeta, st->packed ? ds_in : dsin, q, k, v, g, beta, h0,
                                  state_in, NULL, dout, dht, ds_out, dsin);
        cp->stats.replay_s += now() - t0;
    }
    if (!rc && relay && r > 0 && !early) rc = gdn_cp_sendrecv(cp, dsin, ns, r - 1, NULL, 0, MPI_PROC_NULL);
    if (relay) cp->stats.rounds = D - 1;
    if (!rc && st->packed && ds_in) rc = state_type(c, &st_type);
    if ((rc = gdn_cp_agree_status(cp, rc))) goto done;
    if (st->packed && ds_in) rc = gather_rows(cp, c, ds_in, 0, st_type); /* given on every rank or none: agreed */
    else if (ds_in) memcpy(ds_in, dsin, sizeof(float) * ns);
done:
    if (st_type != MPI_DATATYPE_NULL) MPI_Type_free(&st_type);
    free(mine);
    return rc;
}
